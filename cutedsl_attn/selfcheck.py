"""The first-use self-check of a prefill kernel on the GPU in hand: a small problem of the candidate's configuration
through the candidate and through the portable kernel, both compared with the float64 oracle.

``dispatch`` routes a problem to a kernel that was never run on its hardware (the SM100 / SM103 tcgen05 kernel)
only after :func:`admit_prefill` says yes; the verdict store, the warning and the ``CUTEDSL_ATTN_SELFCHECK``
switch are :mod:`cutedsl_attn.compile.selfcheck`.  The candidate and the reference are arguments (anything
with ``name``, ``cfg``, ``problem``, ``tile_m`` and ``launch(PrefillArgs)``, as ``dispatch.KernelChoice``), so
the logic is exercised on any GPU with another kernel standing in for the candidate.

The problem: two kv heads, four requests (query / KV lengths 37/300, 150/90, 0/50, 5/0: several KV blocks
with a tail, causal rows that see no key, an empty request, a request with no KV), the configuration's head
dims, spare K/V rows past the batch and both outputs poisoned with NaN, an output scale of 0.75, and the
configuration's features: random sinks; a sliding window of ``window_left`` 50; a soft cap of 9 with q scaled by
4 (logits the cap bends); a random custom mask (causal off, the first request's first rows seeing no key) packed
per request little-endian, its bit offsets in the work table; the problem's ``score_mod``; paged K/V on shuffled
pages of the problem's page size, three spare pages and the slots past each request NaN.  Tolerance: the GPU
tests' relative Frobenius error of O (bf16 1e-2, fp16 4e-3), LSE within 2e-2 with the -inf pattern of rows that
see no key, and those rows' O exactly 0.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from . import ref
from .compile import selfcheck as _verdicts
from .compile.selfcheck import Verdict
from .planning.decode import DecodeArgs, plan_paged_decode
from .planning.prefill import PrefillArgs, plan_prefill

__all__ = ["LSE_TOL", "TOL", "admit_decode", "admit_prefill", "check_decode", "check_prefill", "compare"]

#: relative Frobenius error of O against the float64 oracle, by dtype name
TOL = {"bfloat16": 1e-2, "float16": 4e-3}
#: largest absolute error of a finite LSE (base 2)
LSE_TOL = 2e-2

_QO_LENS = (37, 150, 0, 5)
_KV_LENS = (300, 90, 50, 0)
_NUM_KV_HEADS = 2
_SPARE_ROWS = 16
_OUTPUT_SCALE = 0.75
_WINDOW_LEFT = 50
_SOFT_CAP = 9.0
_SOFT_CAP_Q_SCALE = 4.0  # logits of std ~4 reach the cap's bend (tanh(s / 9) far from s / 9)
_MASK_VISIBLE = 0.7  # share of visible (query, key) pairs of the custom mask
_SPARE_PAGES = 3
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def compare(out, lse, o_ref, lse_ref, tol: float) -> tuple[float | None, str | None]:
    """``(relative error of O or None, None or the first rule broken)`` of a kernel's ``out`` ``[T, Hq, D]`` /
    ``lse`` ``[T, Hq]`` against the oracle's: no NaN (an unwritten value), O within ``tol``, LSE's -inf
    pattern equal and finite values within :data:`LSE_TOL`, rows with no visible key exactly 0."""
    out, lse = out.detach().double().cpu(), lse.detach().double().cpu()
    o_ref, lse_ref = o_ref.detach().double().cpu(), lse_ref.detach().double().cpu()
    if torch.isnan(out).any() or torch.isnan(lse).any():
        return None, "NaN in the output or LSE (an unwritten value)"
    err = ((out - o_ref).norm() / o_ref.norm().clamp_min(1e-30)).item()
    if not err <= tol:
        return err, f"output rel err {err:.3g} > {tol:g}"
    fin = torch.isfinite(lse_ref)
    if not torch.equal(torch.isfinite(lse), fin) or (lse[~fin] != float("-inf")).any():
        return err, "the LSE's -inf pattern (rows with no visible key) differs"
    if fin.any():
        d = (lse[fin] - lse_ref[fin]).abs().max().item()
        if not d < LSE_TOL:
            return err, f"LSE abs err {d:.3g} >= {LSE_TOL:g}"
    if (~fin).any() and (out[~fin] != 0).any():
        return err, "rows with no visible key are not 0"
    return err, None


def _median_call_us(fn, reps: int = 10) -> float:
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return sorted(ts)[reps // 2]


def _indptr(lens) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


def prefill_refusal(problem) -> str | None:
    """Why the first-use prefill check cannot build ``problem``'s features, or None (dispatch keeps the portable
    kernel for such a problem rather than admitting a tcgen05 kernel it cannot check).  It builds every feature
    of the module docstring; it refuses positional encodings (RoPE / ALiBi) and caches other than bfloat16 /
    float16."""
    p = problem
    if p.pos_encoding_mode != "NONE":
        return (f"the prefill self-check builds problems without positional encodings; {p.pos_encoding_mode} "
                "(RoPE / ALiBi) is not among them")
    if p.dtype not in TOL or p.kv_dtype:
        return (f"the prefill self-check covers bfloat16 / float16 q and K/V, got {p.dtype!r} with kv_dtype "
                f"{p.kv_dtype!r}")
    return None


def _paged(k, v, kv_lens, kv_ip, page_size, gen):
    """The ragged ``k`` / ``v`` of the batch on shuffled pages (``_SPARE_PAGES`` spare, every unused slot NaN):
    ``(k_pages, v_pages [pages, page_size, Hkv, D], page-list offsets [B], page ids int32)``."""
    n_pages = [-(-n // page_size) for n in kv_lens]
    total = sum(n_pages) + _SPARE_PAGES
    page_ids = torch.randperm(total, generator=gen)[:sum(n_pages)].to(torch.int32)
    pg_ip = _indptr(n_pages)
    kp = torch.full((total, page_size, *k.shape[1:]), float("nan"), dtype=k.dtype)
    vp = torch.full((total, page_size, *v.shape[1:]), float("nan"), dtype=v.dtype)
    for b, n in enumerate(kv_lens):
        tok = torch.arange(n)
        pg = page_ids[int(pg_ip[b]) + tok // page_size].long()
        kp[pg, tok % page_size] = k[int(kv_ip[b]):int(kv_ip[b]) + n]
        vp[pg, tok % page_size] = v[int(kv_ip[b]):int(kv_ip[b]) + n]
    return kp, vp, pg_ip[:-1], page_ids


def _prefill_case(problem, seed: int) -> dict:
    """The module docstring's problem for ``problem``'s features, on the CPU: the launch's inputs (``q``, ``k``,
    ``v``, ``indices``, ``mask``, ``sinks``, the plan's ``kv_starts`` / ``mask_bit_offsets`` / ``causal``, the
    scalars) and the oracle's ``o_ref`` / ``lse_ref`` (float64, O times the output scale)."""
    from .api.quantization import segment_packbits

    tdt = _DTYPES[problem.dtype]
    group, hkv = problem.group_size, _NUM_KV_HEADS
    hq, dqk, dvo = hkv * group, problem.head_dim_qk, problem.head_dim_vo
    qo_ip, kv_ip = _indptr(_QO_LENS), _indptr(_KV_LENS)
    tq, tk = int(qo_ip[-1]), int(kv_ip[-1])
    g = torch.Generator().manual_seed(seed)
    q_scale = _SOFT_CAP_Q_SCALE if problem.use_soft_cap else 1.0
    q = (torch.randn(tq, hq, dqk, generator=g) * q_scale).to(tdt)
    k = torch.randn(tk + _SPARE_ROWS, hkv, dqk, generator=g).to(tdt)
    v = torch.randn(tk + _SPARE_ROWS, hkv, dvo, generator=g).to(tdt)
    sinks = (torch.randn(hq, generator=g) * 2).float() if problem.use_sinks else None
    causal = problem.causal and not problem.use_custom_mask  # a custom mask replaces causal
    window_left = _WINDOW_LEFT if problem.use_window else -1
    soft_cap = _SOFT_CAP if problem.use_soft_cap else 0.0
    sm_scale = dqk ** -0.5
    oracle_kw = dict(causal=causal, sm_scale=sm_scale, sinks=sinks, window_left=window_left,
                     logits_soft_cap=soft_cap if problem.use_soft_cap else None, score_mod=problem.score_mod)
    mask, bit_offsets = None, None
    if problem.use_custom_mask:
        n_elem = [a * b for a, b in zip(_QO_LENS, _KV_LENS)]
        visible = torch.rand(sum(n_elem), generator=g) < _MASK_VISIBLE
        visible[:n_elem[0] // 2] = False  # the first request's first rows see no key
        mask, byte_ptr = segment_packbits(visible, _indptr(n_elem), bitorder="little")
        bit_offsets = (byte_ptr[:-1].to(torch.int64) * 8).tolist()
        oracle_kw["custom_mask"] = visible
    o_ref, lse_ref = ref.ragged_prefill(q, k[:tk], v[:tk], qo_ip, kv_ip, **oracle_kw)
    k[tk:], v[tk:] = float("nan"), float("nan")  # rows past the batch must never reach an output
    indices, kv_starts = None, kv_ip[:-1]
    if problem.page_size > 0:
        k, v, kv_starts, indices = _paged(k[:tk], v[:tk], _KV_LENS, kv_ip, problem.page_size, g)
    return dict(q=q, k=k, v=v, indices=indices, mask=mask, sinks=sinks, q_starts=qo_ip[:-1], kv_starts=kv_starts,
                mask_bit_offsets=bit_offsets, causal=causal, window_left=window_left, soft_cap=soft_cap,
                sm_scale=sm_scale, o_ref=o_ref * _OUTPUT_SCALE, lse_ref=lse_ref, total_q=tq, num_qo_heads=hq)


def check_prefill(candidate, reference, *, seed: int = 0, device=None, timings: dict | None = None) -> Verdict:
    """Run the module docstring's problem (with the features of ``candidate.problem``) through ``candidate`` and
    ``reference`` (kernel choices of one ``problem``: ``.problem``, ``.tile_m``, ``.launch(PrefillArgs)``;
    ``reference`` is the portable kernel) on ``device`` (default: the current CUDA device; a CPU device serves
    kernels emulated on the host) and compare both with the float64 oracle.

    Returns a :class:`~cutedsl_attn.compile.selfcheck.Verdict`: passed when the candidate meets every rule of
    :func:`compare`; its ``detail`` also says when the reference missed too (the check's inputs or the
    device are then suspect).  Raises NotImplementedError before any launch for a problem
    :func:`prefill_refusal` refuses (positional encodings, fp8 K/V); ValueError when the two choices hold
    different problems; the candidate's own errors from its launch.  ``timings`` (a dict, CUDA devices only):
    also gets ``candidate_us``, the median of 10 candidate calls on the problem (CUDA events around each call).
    """
    problem = candidate.problem
    if reference.problem != problem:
        raise ValueError(f"candidate and reference must serve one problem, got {problem!r} and {reference.problem!r}")
    reason = prefill_refusal(problem)
    if reason is not None:
        raise NotImplementedError(reason)
    t0 = time.perf_counter()
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    tdt = _DTYPES[problem.dtype]
    case = _prefill_case(problem, seed)
    tq, hq, dvo = case["total_q"], case["num_qo_heads"], problem.head_dim_vo
    q_d, k_d, v_d = case["q"].to(dev), case["k"].to(dev), case["v"].to(dev)
    dummy_f32 = torch.zeros(1, dtype=torch.float32, device=dev)
    sinks_d = dummy_f32 if case["sinks"] is None else case["sinks"].to(dev)
    idx_d = torch.zeros(1, dtype=torch.int32, device=dev) if case["indices"] is None else case["indices"].to(dev)
    mask_d = torch.zeros(1, dtype=torch.uint8, device=dev) if case["mask"] is None else case["mask"].to(dev)

    def args_for(choice):
        work, _ = plan_prefill(_QO_LENS, _KV_LENS, case["q_starts"], case["kv_starts"], case["mask_bit_offsets"],
                               group_size=problem.group_size, tile_m=choice.tile_m, causal=case["causal"],
                               window_left=case["window_left"])
        out = torch.full((tq, hq, dvo), float("nan"), dtype=tdt, device=dev)
        lse = torch.full((tq, hq), float("nan"), dtype=torch.float32, device=dev)
        return PrefillArgs(q_d, k_d, v_d, idx_d, work.to(dev), out, lse, mask_d, sinks_d, dummy_f32, case["sm_scale"],
                           case["soft_cap"], case["window_left"], 1.0, 0.0, _OUTPUT_SCALE)

    def run(choice, args):
        choice.launch(args)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return compare(args.out, args.lse, case["o_ref"], case["lse_ref"], TOL[problem.dtype])

    ref_err, ref_reason = run(reference, args_for(reference))
    cand_args = args_for(candidate)
    err, reason = run(_few_ctas(candidate), cand_args)
    if timings is not None:
        timings["candidate_us"] = _median_call_us(lambda: candidate.launch(cand_args))
    detail = "matches the oracle" if reason is None else reason
    if ref_reason is not None:
        detail += f" (the portable kernel also misses the oracle: {ref_reason})"
    return Verdict(passed=reason is None, detail=detail, candidate_err=err, reference_err=ref_err,
                   tolerance=TOL[problem.dtype], seconds=time.perf_counter() - t0,
                   device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev))


def _few_ctas(choice):
    """``choice`` itself, or for the SM100 prefill kernel's persistent grid (``tiles.num_ctas > 0``) the same
    device code on 3 CTAs: the check's 8-16 tiles then cross tile boundaries in each CTA, as a full-size launch
    does (that kernel's grid size never reaches its device code: its CPU tests compare the PTX)."""
    tiles = getattr(choice, "tiles", None)
    if (getattr(choice, "name", None) != "prefill_sm100" or not getattr(tiles, "num_ctas", 0)
            or tiles.num_ctas <= 3):
        return choice
    return type(choice)(choice.module, choice.problem, dataclasses.replace(tiles, num_ctas=3))


def admit_prefill(candidate, reference) -> bool:
    """Whether ``candidate`` (a prefill kernel choice) may serve its configuration:
    :func:`cutedsl_attn.compile.selfcheck.admitted` with :func:`check_prefill` against ``reference`` (the
    portable kernel's choice of the same problem) as the check; ``reference`` None: no device to check on (a
    known verdict only)."""
    check = None if reference is None else (lambda: check_prefill(candidate, reference))
    return _verdicts.admitted(candidate.name, candidate.cfg, check)


# ----------------------------------------------------------------------------- decode
#: the decode check's KV lengths: several 128-token blocks with a tail, one token, an empty request, one block
#: and a row past it, a long request that the fixed split cuts into pieces
_DEC_KV_LENS = (300, 1, 0, 129, 700)
_DEC_SPLIT_TOKENS = 96  # the split launch's piece: the merge joins 300 / 129 / 700 tokens from 4 / 2 / 8 pieces
_DEC_SPARE_PAGES = 3


def _decode_refusal(problem) -> str | None:
    if problem.use_soft_cap or problem.pos_encoding_mode != "NONE":
        return "the decode self-check builds problems without soft caps and positional encodings"
    if problem.dtype not in TOL:
        return f"the decode self-check covers bfloat16 / float16, got {problem.dtype!r}"
    return None


def check_decode(candidate, reference, *, seed: int = 0, device=None, timings: dict | None = None) -> Verdict:
    """A paged decode batch (two kv heads, the KV lengths of ``_DEC_KV_LENS`` on shuffled pages of the problem's
    page size, NaN in spare pages and in the slots past each request, outputs poisoned with NaN, an output scale
    of 0.75, random sinks when the problem has them, an fp8 cache when it is one) through ``candidate`` and
    ``reference`` (decode kernel choices of one problem; ``reference`` the portable kernel), each launched twice:
    one work item per request and a fixed split of ``_DEC_SPLIT_TOKENS`` tokens (the in-launch merge); both
    compared with the float64 oracle on the cache as stored (:func:`compare`), and the split counters must be 0
    again.  Returns a :class:`Verdict` as :func:`check_prefill`; raises as it (the refusals: soft caps and
    positional encodings).  ``timings``: ``candidate_us`` of the unsplit launch."""
    problem = candidate.problem
    if reference.problem != problem:
        raise ValueError(f"candidate and reference must serve one problem, got {problem!r} and {reference.problem!r}")
    reason = _decode_refusal(problem)
    if reason is not None:
        raise NotImplementedError(reason)
    t0 = time.perf_counter()
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    tdt, ps, hkv, d = _DTYPES[problem.dtype], problem.page_size, _NUM_KV_HEADS, problem.head_dim
    hq = hkv * problem.group_size
    kv_dt = torch.float8_e4m3fn if problem.kv_fp8 else tdt
    g = torch.Generator().manual_seed(seed)
    npages = [-(-n // ps) for n in _DEC_KV_LENS]
    used = sum(npages)
    pages = used + _DEC_SPARE_PAGES
    indices = torch.randperm(pages, generator=g)[:used].to(torch.int32)
    indptr = torch.tensor([0] + torch.tensor(npages).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * ps if p else 0 for n, p in zip(_DEC_KV_LENS, npages)], dtype=torch.int32)
    k = torch.randn(pages, ps, hkv, d, generator=g).to(kv_dt)
    v = torch.randn(pages, ps, hkv, d, generator=g).to(kv_dt)
    q = torch.randn(len(_DEC_KV_LENS), hq, d, generator=g).to(tdt)
    sinks = (torch.randn(hq, generator=g) * 2).float() if problem.use_sinks else None
    sm_scale = d ** -0.5
    o_ref, lse_ref = ref.paged_decode(q, k.float(), v.float(), indptr, indices, last, sm_scale=sm_scale,
                                      sinks=sinks)
    o_ref = o_ref * _OUTPUT_SCALE
    live = torch.zeros(pages, ps, dtype=torch.bool)  # NaN wherever no request's token lives
    for b, n in enumerate(_DEC_KV_LENS):
        for t in range(n):
            live[indices[indptr[b] + t // ps], t % ps] = True
    for x in (k, v):  # through a byte view: e4m3's NaN is 0x7f (torch has no masked fill for fp8)
        if problem.kv_fp8:
            x.view(torch.uint8)[~live] = 0x7F
        else:
            x[~live] = float("nan")
    q_d, k_d, v_d, idx_d = q.to(dev), k.to(dev), v.to(dev), indices.to(dev)
    dummy = torch.zeros(1, dtype=torch.float32, device=dev)
    sinks_d = dummy if sinks is None else sinks.to(dev)
    kv_lens = torch.tensor(_DEC_KV_LENS)

    def run(choice, split):
        wp = plan_paged_decode(kv_lens, indptr[:-1], num_kv_heads=hkv, page_size=ps, disable_split_kv=not split,
                               fixed_split_tokens=_DEC_SPLIT_TOKENS if split else None,
                               max_splits_per_request=choice.cfg.max_splits_per_request)
        out = torch.full((len(_DEC_KV_LENS), hq, d), float("nan"), dtype=tdt, device=dev)
        lse = torch.full((len(_DEC_KV_LENS), hq), float("nan"), dtype=torch.float32, device=dev)
        n_part = max(1, wp.num_partials)
        counters = torch.zeros(len(_DEC_KV_LENS) * hkv, dtype=torch.int32, device=dev)
        args = DecodeArgs(q_d, k_d, v_d, idx_d, wp.work.to(dev), out, lse,
                          torch.empty(n_part, hq, d, dtype=torch.float32, device=dev),
                          torch.empty(n_part, hq, dtype=torch.float32, device=dev), counters, sinks_d, dummy,
                          sm_scale, 0.0, 1.0, 0.0, _OUTPUT_SCALE)
        choice.launch(args)
        torch.cuda.synchronize(dev)
        err, why = compare(out, lse, o_ref, lse_ref, TOL[problem.dtype])
        if why is None and (counters != 0).any():
            why = "the split-KV counters are not 0 after the launch"
        return err, why, args

    ref_err, ref_reason = None, None
    for split in (False, True):
        e, why, _ = run(reference, split)
        ref_err = e if ref_err is None else max(ref_err, e or 0.0)
        ref_reason = ref_reason or (None if why is None else f"{'split' if split else 'unsplit'}: {why}")
    err, reason, cand_args = run(candidate, False)
    if reason is None:
        e2, why2, _ = run(candidate, True)
        err, reason = max(err or 0.0, e2 or 0.0), None if why2 is None else f"split-KV: {why2}"
    if timings is not None:
        timings["candidate_us"] = _median_call_us(lambda: candidate.launch(cand_args))
    detail = "matches the oracle (unsplit and split-KV)" if reason is None else reason
    if ref_reason is not None:
        detail += f" (the portable kernel also misses the oracle: {ref_reason})"
    return Verdict(passed=reason is None, detail=detail, candidate_err=err, reference_err=ref_err,
                   tolerance=TOL[problem.dtype], seconds=time.perf_counter() - t0,
                   device=torch.cuda.get_device_name(dev))


def admit_decode(candidate, reference) -> bool:
    """:func:`admit_prefill` for a decode kernel choice, with :func:`check_decode` as the check."""
    check = None if reference is None else (lambda: check_decode(candidate, reference))
    return _verdicts.admitted(candidate.name, candidate.cfg, check)
