"""One decode problem through every decode entry point and backend, against the float64 oracle (GPU tests).

:func:`run_all` builds ONE random paged K/V pool for a :class:`Spec` (NaN in the spare pages, in the slots past
each request's length and in the block-table columns past a request's pages), the query, the sinks, and the
oracle ``ref.paged_prefill`` on the values the kernels read (an fp8 cache dequantised exactly with its ``k_scale``
/ ``v_scale``), then runs each :data:`ROUTES` entry with its outputs NaN-poisoned (``single_decode_with_kv_cache``
takes no output buffer: its fresh outputs are checked for NaN) and compares O (and the base-2 LSE where the entry
point returns one) with :func:`_checks.check`.  The one softmax scale ``sm_scale`` (logits
``sm_scale * q . k`` on the dequantised cache) maps onto each API as the scale table of
``cutedsl_attn.api.trtllm`` says:

    route            softmax-scale arguments                                  output-scale argument
    wrapper_*        plan(sm_scale=sm / QS), run(q_scale=QS, k_scale=ks)       run(v_scale=vs)
    single           sm_scale=sm / QS, q_scale=QS, k_scale=ks                  v_scale=vs
    trtllm_*         bmm1_scale = sm * ks                                     bmm2_scale = vs
    xqa_*, 16-bit    q_scale = sm * sqrt(D)                                   (1)
    xqa_*, fp8       q_scale = sm * ks * sqrt(D) / vs, kv_scale = vs          (kv_scale)
    prims_ts         bmm1_scale = sm * ks                                     bmm2_scale = vs
    cudnn            scale = sm                                               (none: 16-bit only)

(``ks = vs = 1`` for a 16-bit cache; the wrapper's cuDNN backend takes no ``v_scale``.)  A route a combination
is outside of is never skipped silently: a feature whose argument the entry point's signature lacks is recorded
``n/a`` after asserting the argument is absent; a documented refusal (:func:`expected_refusal`) must raise its
exception with its message; a cuDNN graph no engine serves may raise the documented decline (message checked).
Everything else must run and match the oracle.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re

import torch

from cutedsl_attn import ref
from cutedsl_attn.api.cudnn_decode import cudnn_batch_decode_with_kv_cache
from cutedsl_attn.api.decode import BatchDecodeWithPagedKVCacheWrapper
from cutedsl_attn.api.single_decode import single_decode_with_kv_cache
from cutedsl_attn.api.trtllm import XQA_PAGE_SIZES, trtllm_batch_decode_with_kv_cache, xqa
from cutedsl_attn.attention import prims_ts
from cutedsl_attn.ref.paged import dequantize_kv_cache
from _checks import NAN, TOL, check, rel_err, used_page_slots

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
QS = 2.0  # the q_scale the wrapper routes fold out of the planned sm_scale (exercises run()'s scale algebra)
CUDNN_MULTIROW_TILE = 128  # cuDNN's multi-row graph reads K/V in whole 128-key tiles (its documented limitation)
CUDNN_DECLINE = r"has no engine for this decode graph.*Served instead by BatchDecodeWithPagedKVCacheWrapper"
NO_FRONTEND = r"needs the cuDNN frontend Python package"


@dataclasses.dataclass(frozen=True)
class Spec:
    """One decode problem.  ``kv_lens``: tokens per request (0 allowed with ``q_len == 1``); ``kv_dtype`` None:
    the query's dtype, else ``torch.float8_e4m3fn`` with per-tensor ``k_scale`` / ``v_scale``; ``window_left``
    FlashInfer's (keeps ``w + 1`` keys, -1 off); ``sinks``: random per-head sink logits; ``q_len``: query rows per
    request (bottom-right causal); ``soft_cap``: ``cap * tanh(s / cap)`` (0 off); ``sm_scale`` None:
    ``0.7 / sqrt(head_dim)`` (not the default, so a lost scale shows)."""

    kv_lens: tuple
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: torch.dtype = BF16
    kv_dtype: torch.dtype | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0
    window_left: int = -1
    sinks: bool = False
    q_len: int = 1
    soft_cap: float = 0.0
    sm_scale: float | None = None

    def __post_init__(self):
        if self.q_len > 1 and min(self.kv_lens) < self.q_len:
            raise ValueError(f"every kv_len must be >= q_len={self.q_len} (the entry points' rule), got {self.kv_lens}")
        if self.kv_dtype is None and (self.k_scale, self.v_scale) != (1.0, 1.0):
            raise ValueError("k_scale / v_scale are the fp8 cache's dequantisation scales: 1.0 for a 16-bit cache")

    @property
    def fp8(self) -> bool:
        return self.kv_dtype == FP8

    @property
    def scale(self) -> float:
        return 0.7 / math.sqrt(self.head_dim) if self.sm_scale is None else self.sm_scale

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype

    def short(self) -> str:
        d = dataclasses.asdict(self)
        base = dataclasses.asdict(Spec(kv_lens=self.kv_lens))
        return ", ".join(f"{k}={v}" for k, v in d.items() if k == "kv_lens" or v != base[k])


# ----------------------------------------------------------------------------- the problem
def build(spec: Spec, gen: torch.Generator, device) -> dict:
    """The pool ``[pages, 2, page_size, Hkv, D]`` (NHD, ``spec.cache_dtype``, NaN where no request owns a slot),
    its HND copy, a block table ``[B, W]`` (columns past a request's pages point at NaN spare pages; ``W`` covers
    cuDNN's 128-key tiles), its CSR form, q ``[B * q_len, Hq, D]``, sinks, and the oracle's ``(o, lse)``."""
    lens, ps, hkv, d = list(spec.kv_lens), spec.page_size, spec.num_kv_heads, spec.head_dim
    npages = [-(-L // ps) for L in lens]
    total = sum(npages) + 4
    perm = torch.randperm(total, generator=gen)
    spare = perm[sum(npages):]
    width = max(max(npages) + 2, -(-(-(-max(lens) // CUDNN_MULTIROW_TILE) * CUDNN_MULTIROW_TILE) // ps))
    table = torch.empty(len(lens), width, dtype=torch.int32)
    off = 0
    for b, n in enumerate(npages):
        table[b, :n] = perm[off:off + n]
        table[b, n:] = spare[torch.randint(len(spare), (width - n,), generator=gen)]
        off += n
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    csr = ref.block_tables_to_csr(table, seq_lens, ps)
    used = used_page_slots(*csr, total, ps)
    amp = 2.0 if spec.fp8 else 1.0  # fp8: values across e4m3's exponent range
    x = torch.randn(total, 2, ps, hkv, d, generator=gen) * amp
    x.masked_fill_(~used[:, None, :, None, None], NAN)
    pool = x.to(spec.cache_dtype)
    B, hq, m = len(lens), spec.num_qo_heads, spec.q_len
    q = torch.randn(B * m, hq, d, generator=gen).to(spec.dtype)
    sinks = torch.randn(hq, generator=gen) * 2 if spec.sinks else None
    k_ref, v_ref = pool[:, 0], pool[:, 1]
    if spec.fp8:  # the kernels' values: e4m3 widened exactly, times the per-tensor scales
        k_ref, v_ref = dequantize_kv_cache(k_ref, spec.k_scale), dequantize_kv_cache(v_ref, spec.v_scale)
    qo = torch.arange(B + 1, dtype=torch.int32) * m
    o_ref, lse_ref = ref.paged_prefill(q, k_ref, v_ref, qo, *csr, kv_layout="NHD", causal=True,
                                       window_left=spec.window_left, sinks=sinks, sm_scale=spec.scale,
                                       logits_soft_cap=spec.soft_cap or None)
    dev = torch.device(device)
    pool_d = pool.to(dev)
    return dict(spec=spec, B=B, pool=pool_d, pool_hnd=pool_d.transpose(2, 3).contiguous(), table=table.to(dev),
                lens=seq_lens.to(dev), lens_host=seq_lens, csr=tuple(t.to(dev) for t in csr), q=q.to(dev),
                sinks=None if sinks is None else sinks.to(dev), o_ref=o_ref, lse_ref=lse_ref, device=dev)


def finite_pool(p) -> torch.Tensor:
    """The pool with every NaN replaced by 0: for cuDNN's multi-row graph, which reads K/V slots up to the next
    128-key boundary past each length (documented in ``cudnn_batch_decode_with_kv_cache``)."""
    pool = p["pool"]
    return torch.where(torch.isnan(pool), torch.zeros((), dtype=pool.dtype, device=pool.device), pool)


def poisoned(shape, dtype, device):
    return torch.full(shape, NAN, dtype=dtype, device=device)


def workspace(device):
    return torch.zeros(128 << 20, dtype=torch.uint8, device=device)


def causal_draft_mask_u16(B: int, n: int, device) -> torch.Tensor:
    """xqa's bit-packed uint16 ``[B, n, ceil(n/32)*2]`` mask of a lower-triangular draft block (bottom-right
    causal rows: draft row ``i`` sees draft tokens ``0 .. i``)."""
    m = torch.zeros(B, n, -(-n // 32) * 2, dtype=torch.int64)
    for i in range(n):
        for j in range(i + 1):
            m[:, i, 2 * (j // 32) + (j % 32) // 16] |= 1 << (j % 16)
    return m.to(torch.int32).to(torch.uint16).to(device)


def _scales16(spec):
    """``(k_scale, v_scale)`` arguments of the wrapper / single routes: None (1) for a 16-bit cache."""
    return (spec.k_scale, spec.v_scale) if spec.fp8 else (None, None)


# ----------------------------------------------------------------------------- the routes
def _wrapper(p, *, backend):
    spec, dev, B, m = p["spec"], p["device"], p["B"], p["spec"].q_len
    hq = spec.num_qo_heads
    ks, vs = _scales16(spec)
    common = dict(window_left=spec.window_left, logits_soft_cap=spec.soft_cap or None, q_data_type=spec.dtype,
                  kv_data_type=spec.cache_dtype, sm_scale=spec.scale / QS, q_len_per_req=m)
    if backend == "cute":  # NHD pool, CSR page table
        w = BatchDecodeWithPagedKVCacheWrapper(workspace(dev), "NHD", use_tensor_cores=True, backend="cute")
        w.plan(*p["csr"], hq, spec.num_kv_heads, spec.head_dim, spec.page_size, **common)
        cache = p["pool"]
    else:  # HND (k, v) views, block table
        w = BatchDecodeWithPagedKVCacheWrapper(workspace(dev), "HND", use_tensor_cores=True, backend="cudnn")
        w.plan(None, None, None, hq, spec.num_kv_heads, spec.head_dim, spec.page_size, block_tables=p["table"],
               seq_lens=p["lens"], **common)
        pool = finite_pool(p).transpose(2, 3).contiguous() if m > 1 else p["pool_hnd"]
        cache = (pool[:, 0], pool[:, 1])
        vs = None  # cuDNN's graph has no output scale (16-bit only: vs is 1 here)
    out, lse = poisoned((B * m, hq, spec.head_dim), spec.dtype, dev), poisoned((B * m, hq), torch.float32, dev)
    r = w.run(p["q"], cache, q_scale=QS, k_scale=ks, v_scale=vs, out=out, lse=lse, return_lse=True, sinks=p["sinks"])
    assert r[0] is out and r[1] is lse
    return out, lse, None


def route_wrapper_cute(p):
    return _wrapper(p, backend="cute")


def route_wrapper_cudnn(p):
    return _wrapper(p, backend="cudnn")


def route_single(p):
    """Each request alone, its tokens gathered into a contiguous K/V (NHD for even requests, HND for odd)."""
    spec, dev = p["spec"], p["device"]
    ks, vs = _scales16(spec)
    indptr, indices, _ = (t.cpu() for t in p["csr"])
    lens = p["lens_host"].tolist()
    outs, lses = [], []
    for b, L in enumerate(lens):
        pages = indices[indptr[b]:indptr[b + 1]].long().to(dev)
        k = p["pool"][pages, 0].reshape(-1, spec.num_kv_heads, spec.head_dim)[:L]
        v = p["pool"][pages, 1].reshape(-1, spec.num_kv_heads, spec.head_dim)[:L]
        layout = "NHD" if b % 2 == 0 else "HND"
        if layout == "HND":
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        o, lse = single_decode_with_kv_cache(
            p["q"][b], k.contiguous(), v.contiguous(), kv_layout=layout, use_tensor_cores=True, q_scale=QS,
            k_scale=ks, v_scale=vs, window_left=spec.window_left, logits_soft_cap=spec.soft_cap or None,
            sm_scale=spec.scale / QS, return_lse=True)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses), None


def _trtllm(p, layout):
    spec, dev, B, m = p["spec"], p["device"], p["B"], p["spec"].q_len
    hq = spec.num_qo_heads
    # HND: one 5-D combined tensor; NHD: the (k, v) tuple form
    cache = p["pool_hnd"] if layout == "HND" else (p["pool"][:, 0], p["pool"][:, 1])
    out, lse = poisoned((B * m, hq, spec.head_dim), spec.dtype, dev), poisoned((B * m, hq), torch.float32, dev)
    r = trtllm_batch_decode_with_kv_cache(
        p["q"], cache, workspace(dev), p["table"], p["lens_host"].to(torch.uint32).to(dev),
        max(1, max(spec.kv_lens)),
        bmm1_scale=spec.scale * spec.k_scale, bmm2_scale=spec.v_scale, window_left=spec.window_left, out=out,
        sinks=p["sinks"], kv_layout=layout, q_len_per_req=m, lse=lse, return_lse=True)
    assert r[0] is out and r[1] is lse
    return out, lse, None


def route_trtllm_hnd(p):
    return _trtllm(p, "HND")


def route_trtllm_nhd(p):
    return _trtllm(p, "NHD")


def _xqa(p, layout):
    spec, dev, B, m = p["spec"], p["device"], p["B"], p["spec"].q_len
    hq, hkv, d = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim
    pool = p["pool_hnd"] if layout == "HND" else p["pool"]
    if spec.fp8:  # logits q_scale * kv_scale / sqrt(D), output x kv_scale
        q_scale, kv_scale = spec.scale * spec.k_scale * math.sqrt(d) / spec.v_scale, spec.v_scale
    else:  # logits q_scale / sqrt(D); kv_scale unused for a 16-bit cache
        q_scale, kv_scale = spec.scale * math.sqrt(d), 1.0
    shape = (B, 1, hq, d) if m == 1 else (B, 1, m, hq, d)
    output = poisoned(shape, spec.dtype, dev)
    lens = p["lens_host"].to(torch.uint32).to(dev).reshape(B, 1)  # xqa's [B, beam_width] uint32
    semaphores = torch.zeros(1 << 20, dtype=torch.uint32, device=dev)
    r = xqa(p["q"].reshape(shape), pool[:, 0], pool[:, 1], p["table"], lens, output, workspace(dev), semaphores, hkv,
            spec.page_size,
            sinks=None if p["sinks"] is None else p["sinks"].reshape(hkv, hq // hkv), q_scale=q_scale,
            kv_scale=kv_scale, sliding_win_size=spec.window_left + 1 if spec.window_left >= 0 else 0,
            kv_layout=layout, q_seq_len=m, mask=causal_draft_mask_u16(B, m, dev) if m > 1 else None)
    assert r is None  # in place
    return output.reshape(B * m, hq, d), None, None


def route_xqa_nhd(p):
    return _xqa(p, "NHD")


def route_xqa_hnd(p):
    return _xqa(p, "HND")


def route_prims_ts(p):
    """The HND pool, a row-strided block table (padding between rows), fixed token-major rows for ``q_len > 1``."""
    spec, dev, B, m = p["spec"], p["device"], p["B"], p["spec"].q_len
    hq, d = spec.num_qo_heads, spec.head_dim
    W = p["table"].shape[1]
    store = torch.full((B, W + 3), -7, dtype=torch.int32, device=dev)
    store[:, :W] = p["table"]
    table = store[:, :W]
    q = p["q"] if m == 1 else p["q"].view(B, m, hq, d)
    mask = "causal" if m > 1 or spec.window_left >= 0 else "dense"  # one row: dense and causal are the same keys
    kw = dict(seq_len_q=m, mask_type=mask, window_left=spec.window_left, bmm1_scale=spec.scale * spec.k_scale,
              bmm2_scale=spec.v_scale)
    try:
        prims_ts.batch_decode_with_paged_kv_cache(q, p["pool"], table, p["lens"], kv_layout="NHD", **kw)
        raise AssertionError("prims_ts with kv_layout='NHD' must raise NotImplementedError")
    except NotImplementedError as e:
        assert "kv_layout='NHD' is not supported" in str(e), str(e)
    out = poisoned(q.shape, spec.dtype, dev)
    r = prims_ts.batch_decode_with_paged_kv_cache(q, p["pool_hnd"], table, p["lens"], out=out, **kw)
    assert r is out
    return out.reshape(B * m, hq, d), None, None


def route_cudnn(p):
    """The requests with at least ``q_len`` keys (its documented precondition: ``actual_seq_lens_kv`` is device
    data it does not check); K/V as the HND ``transpose(1, 2)`` views of the NHD pool, as its docstring says."""
    spec, dev, m = p["spec"], p["device"], p["spec"].q_len
    hq, d = spec.num_qo_heads, spec.head_dim
    keep = [b for b, L in enumerate(spec.kv_lens) if L >= max(m, 1)]
    rows = torch.tensor([b * m + i for b in keep for i in range(m)], dtype=torch.long)
    pool = finite_pool(p) if m > 1 else p["pool"]
    idx = torch.tensor(keep, dtype=torch.long, device=dev)
    q = p["q"][rows.to(dev)]
    lens = p["lens"][idx].contiguous()
    out, lse = poisoned((len(rows), hq, d), spec.dtype, dev), poisoned((len(rows), hq), torch.float32, dev)
    r = cudnn_batch_decode_with_kv_cache(
        q, pool[:, 0].transpose(1, 2), pool[:, 1].transpose(1, 2), spec.scale, workspace(dev),
        max_sequence_kv=max(spec.kv_lens[b] for b in keep), actual_seq_lens_kv=lens,
        block_tables=p["table"][idx].contiguous(), out=out, return_lse=True, lse=lse, q_len_per_req=m,
        window_left=spec.window_left, sinks=p["sinks"])
    assert r[0] is out and r[1] is lse
    return out, lse, rows


#: name -> (the route, the public function whose signature it follows, {feature: FlashInfer's argument name} of
#: the features that function has no argument for)
ROUTES = {
    "wrapper_cute": (route_wrapper_cute, BatchDecodeWithPagedKVCacheWrapper.plan, {}),
    "wrapper_cudnn": (route_wrapper_cudnn, BatchDecodeWithPagedKVCacheWrapper.plan, {}),
    "single": (route_single, single_decode_with_kv_cache, {"sinks": "sinks", "q_len": "q_len_per_req"}),
    "trtllm_hnd": (route_trtllm_hnd, trtllm_batch_decode_with_kv_cache, {"soft_cap": "logits_soft_cap"}),
    "trtllm_nhd": (route_trtllm_nhd, trtllm_batch_decode_with_kv_cache, {"soft_cap": "logits_soft_cap"}),
    "xqa_nhd": (route_xqa_nhd, xqa, {"soft_cap": "logits_soft_cap"}),
    "xqa_hnd": (route_xqa_hnd, xqa, {"soft_cap": "logits_soft_cap"}),
    "prims_ts": (route_prims_ts, prims_ts.batch_decode_with_paged_kv_cache,
                 {"sinks": "sinks", "soft_cap": "logits_soft_cap"}),
    "cudnn": (route_cudnn, cudnn_batch_decode_with_kv_cache, {"soft_cap": "logits_soft_cap"}),
}


def _features(spec: Spec) -> set:
    return {f for f, on in (("sinks", spec.sinks), ("soft_cap", spec.soft_cap > 0), ("q_len", spec.q_len > 1)) if on}


def expected_refusal(name: str, spec: Spec, frontend: bool):
    """``(exception type, message regex)`` the route's documentation promises for ``spec``, or None."""
    if name == "wrapper_cudnn":
        if spec.fp8 or spec.soft_cap:
            return NotImplementedError, r"backend='cudnn' does not serve .*(an fp8 KV cache|logits_soft_cap)"
        if min(spec.kv_lens) == 0:  # the graph does not define an empty request's row: refused before planning
            return NotImplementedError, r"backend='cudnn' does not serve a request with no KV \(kv length 0\)"
        if not frontend:
            return NotImplementedError, NO_FRONTEND
    if name == "cudnn":
        if spec.fp8:
            return NotImplementedError, r"fp8 is not supported by cudnn_batch_decode_with_kv_cache"
        if not frontend:
            return NotImplementedError, NO_FRONTEND
    if name.startswith("xqa"):
        if spec.page_size not in XQA_PAGE_SIZES:  # xqa's documented page sizes (a ValueError, as FlashInfer's)
            return ValueError, re.escape(f"page_size must be one of {XQA_PAGE_SIZES}")
        if spec.q_len > 1 and spec.window_left >= 0:
            return NotImplementedError, r"sliding_win_size with q_seq_len > 1 is not supported"
    if name == "prims_ts" and spec.window_left >= 0 and min(spec.kv_lens) < spec.q_len:
        return ValueError, r"mask_type='causal' needs q_len <= kv_len"
    return None


def may_decline(name: str, spec: Spec) -> bool:
    """cuDNN routes may meet a graph no engine of the loaded cuDNN serves (documented: NotImplementedError with
    the decline message) with sinks, a page size below 16, or a window over several rows; the rest must be
    served (cuDNN 9.19 on the H200 serves them: ``test_cudnn_decode_gpu``)."""
    return name in ("wrapper_cudnn", "cudnn") and (spec.sinks or spec.page_size < 16
                                                   or (spec.q_len > 1 and spec.window_left >= 0))


def run_all(spec: Spec, *, seed: int | None = None, device="cuda", routes=None) -> dict:
    """Every route of :data:`ROUTES` (or ``routes``) on one :func:`build` problem; returns ``{route: outcome}``
    (``"ok rel_err=..."``, ``"refused: ..."``, ``"declined: ..."``, ``"n/a: ..."``).  Raises AssertionError on the
    first route that writes a wrong, partial or NaN result, raises something undocumented, or runs where it must
    refuse."""
    from cutedsl_attn.cudnn.decode import cudnn_available

    seed = torch.seed() % (2**31) if seed is None else seed
    gen = torch.Generator().manual_seed(seed)
    p = build(spec, gen, device)
    frontend = cudnn_available()
    what0 = f"seed {seed} [{spec.short()}]"
    outcomes = {}
    for name in routes or ROUTES:
        fn, public, absent = ROUTES[name]
        what = f"{what0} {name}"
        lacking = sorted(_features(spec) & set(absent))
        if lacking:
            params = inspect.signature(public).parameters
            for f in lacking:
                assert absent[f] not in params, f"{what}: the route table says {public.__name__} has no {absent[f]}"
            outcomes[name] = f"n/a: {public.__name__} has no argument for {', '.join(lacking)}"
            continue
        if name == "cudnn" and not any(L >= spec.q_len for L in spec.kv_lens):
            outcomes[name] = "n/a: every request is empty"
            continue
        refusal = expected_refusal(name, spec, frontend)
        try:
            out, lse, rows = fn(p)
            torch.cuda.synchronize()
        except (NotImplementedError, ValueError) as e:
            msg = str(e)
            if refusal is not None and isinstance(e, refusal[0]) and re.search(refusal[1], msg):
                outcomes[name] = f"refused: {msg[:160]}"
                continue
            declined = isinstance(e, NotImplementedError) and re.search(CUDNN_DECLINE, msg, re.S)
            if declined and may_decline(name, spec):
                outcomes[name] = f"declined: {msg[:160]}"
                continue
            raise AssertionError(f"{what}: undocumented {type(e).__name__}: {msg}") from e
        assert refusal is None, f"{what}: ran, but its documentation promises {refusal[0].__name__} /{refusal[1]}/"
        o_ref, lse_ref = (p["o_ref"], p["lse_ref"]) if rows is None else (p["o_ref"][rows], p["lse_ref"][rows])
        if lse is not None:
            e = check(out, lse, o_ref, lse_ref, spec.dtype, what)
        else:
            out = out.detach().cpu()
            assert not torch.isnan(out).any(), f"{what}: NaN / unwritten output"
            e = rel_err(out, o_ref)
            assert e <= TOL[spec.dtype], f"{what}: output rel err {e}"
            empty = ~torch.isfinite(lse_ref)
            assert (out[empty] == 0).all(), f"{what}: rows with no visible key must be 0"
        outcomes[name] = f"ok rel_err={e:.2e}"
    return outcomes
