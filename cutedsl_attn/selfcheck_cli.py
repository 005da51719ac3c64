"""``python -m cutedsl_attn selfcheck``: every kernel of this GPU against the float64 oracle on a short matrix.

With a GPU: prefill (each prefill kernel of the arch: SM90 on ``sm_90a``, the tcgen05 kernel on ``sm_100a`` /
``sm_103a`` run directly, without its first-use check, and the portable kernel everywhere; through
:func:`cutedsl_attn.selfcheck.check_prefill`), paged decode, the gated delta rule and MLA (through the public
API), each case compared with the oracle; a table of pass / FAIL with the relative error of O, the first
call's seconds (the compile or the disk-cache load included) and the median time of a call (CUDA events
around the call: kernel and host launch cost).  The prefill and decode rows also time the peers installed here
on the same inputs (:func:`installed_peers`: FlashInfer's ragged prefill and paged decode wrappers,
FlashAttention-4's ``flash_attn.cute`` varlen forward for prefill), ``-`` where none is; a peer that raises is
reported in the row's note, never fails the row.  The SM100 rows run last, so a device fault there cannot hide
the other results.  Exit status 1 when any case fails or raises, else 0.

Without a GPU nothing can run: the command says so, cross-compiles the prefill and decode kernels of the
matrix for ``--arch`` (default ``sm_100a``) and exits 0 when every build succeeds (1 otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import statistics
import sys
import time

import torch

__all__ = ["Row", "Peers", "PEER_MODULES", "installed_peers", "format_table", "gpu_matrix", "cross_compile_matrix",
           "main"]

BF16, FP16 = torch.bfloat16, torch.float16
_O_TOL = {BF16: 1e-2, FP16: 4e-3}
_LSE_TOL = 2e-2

# prefill: (label, dtype, head_dim, group_size, causal, use_sinks)
PREFILL_CASES = (("bf16 d128 G4 causal", BF16, 128, 4, True, False),
                 ("fp16 d64 G1", FP16, 64, 1, False, False),
                 ("bf16 d128 G8 causal sinks", BF16, 128, 8, True, True))
# decode: (label, dtype, head_dim, group_size, page_size, kv lengths)
DECODE_CASES = (("bf16 d128 G4 page16", BF16, 128, 4, 16, (1, 77, 1000, 4097)),
                ("fp16 d64 G8 page1", FP16, 64, 8, 1, (3, 300, 64)))


@dataclasses.dataclass
class Row:
    """One line of the table: ``status`` is ``pass``, ``FAIL``, ``error``, ``built`` (cross-compiled) or
    ``skip``; ``err``: relative error of O; ``first_s``: seconds of the first call (compile or load included);
    ``call_us``: median microseconds of a call; ``note``: why it failed or was skipped (and a peer's error);
    ``peers``: the installed peers' median microseconds per call on the same inputs (``"flashinfer 12.3 fa4
    9.8"``; ``name n/a``: the peer cannot express the case, ``name error``: it raised), ``-`` where no peer of
    the op is installed, empty for the ops peers are not timed on."""

    op: str
    kernel: str
    case: str
    status: str
    err: float | None = None
    first_s: float | None = None
    call_us: float | None = None
    note: str = ""
    peers: str = ""


def format_table(rows) -> str:
    """The rows as an aligned text table."""
    head = ("op", "kernel", "case", "result", "O rel err", "first call s", "us / call", "peers us / call", "note")
    cells = [head] + [(r.op, r.kernel, r.case, r.status, "" if r.err is None else f"{r.err:.2e}",
                       "" if r.first_s is None else f"{r.first_s:.2f}",
                       "" if r.call_us is None else f"{r.call_us:.1f}", r.peers, r.note) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head) - 1)]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(len(widths))) + "  " + c[-1] for c in cells)


def _call_us(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


#: The peer libraries timed beside the prefill / decode rows: table name -> module imported.
PEER_MODULES = {"flashinfer": "flashinfer", "fa4": "flash_attn.cute"}


def installed_peers() -> dict:
    """Table name -> module of each :data:`PEER_MODULES` entry importable here; an import that fails other than
    with ImportError (a broken install) maps to its exception, which the rows then report.  Absent ones are
    left out."""
    found = {}
    for name, module in PEER_MODULES.items():
        try:
            found[name] = importlib.import_module(module)
        except ImportError:
            continue
        except Exception as e:  # noqa: BLE001 - reported in the rows, not fatal
            found[name] = e
    return found


@dataclasses.dataclass
class Peers:
    """The installed peers (:func:`installed_peers`) and the prefill cells already timed (``case label ->
    (cell, note)``: every prefill kernel's row of a case shows the one timing)."""

    modules: dict
    prefill_cells: dict = dataclasses.field(default_factory=dict)


def _peer_cell(makers: dict) -> tuple[str, str]:
    """``(cell, note)`` of the peers of one row: ``makers`` maps a peer's name to None (it cannot express the
    case) or to a callable that plans the peer and returns its no-argument call, timed with :func:`_call_us`.
    A peer raising (its import, plan or call) gives ``name error`` and its message in the note."""
    if not makers:
        return "-", ""
    cells, notes = [], []
    for name, make in makers.items():
        if make is None:
            cells.append(f"{name} n/a")
            continue
        try:
            cells.append(f"{name} {_call_us(make()):.1f}")
        except Exception as e:  # noqa: BLE001 - a peer's failure is reported, not the row's
            cells.append(f"{name} error")
            notes.append(f"peer {name}: {type(e).__name__}: {str(e)[:120]}")
    return " ".join(cells), "; ".join(notes)


def _guarded_cell(build) -> tuple[str, str]:
    """:func:`_peer_cell` of ``build()``'s makers; ``build`` raising (the peers' inputs) gives ``error`` and its
    message, not a lost row."""
    try:
        return _peer_cell(build())
    except Exception as e:  # noqa: BLE001 - a peer's failure is reported, not the row's
        return "error", f"peers: {type(e).__name__}: {str(e)[:120]}"


def _raises(e: BaseException):
    def make():
        raise e
    return make


def _prefill_peer_makers(modules: dict, problem, dev) -> dict:
    """Peer makers (:func:`_peer_cell`) on the prefill self-check's problem for ``problem`` (seed 0: the inputs
    :func:`cutedsl_attn.selfcheck.check_prefill` runs): FlashInfer's ragged prefill wrapper (no sinks in its
    API: ``n/a`` with sinks) and FlashAttention-4's varlen forward."""
    from . import selfcheck as sc

    case = sc._prefill_case(problem, 0)  # (the check's own inputs)
    qo_ip, kv_ip = sc._indptr(sc._QO_LENS), sc._indptr(sc._KV_LENS)
    tk = int(kv_ip[-1])
    hq, hkv = case["num_qo_heads"], case["k"].shape[1]
    dqk, dvo, dtype = problem.head_dim_qk, problem.head_dim_vo, case["q"].dtype
    q, k, v = case["q"].to(dev), case["k"][:tk].to(dev), case["v"][:tk].to(dev)
    qo_d, kv_d = qo_ip.to(dev), kv_ip.to(dev)
    sinks = None if case["sinks"] is None else case["sinks"].to(dev)
    makers = {}
    fi = modules.get("flashinfer")
    if isinstance(fi, BaseException):
        makers["flashinfer"] = _raises(fi)
    elif fi is not None:
        def fi_prefill():
            w = fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev), "NHD")
            w.plan(qo_d, kv_d, hq, hkv, dqk, head_dim_vo=dvo, causal=case["causal"], sm_scale=case["sm_scale"],
                   q_data_type=dtype, kv_data_type=dtype)
            return lambda: w.run(q, k, v)

        makers["flashinfer"] = None if sinks is not None else fi_prefill
    fa4 = modules.get("fa4")
    if isinstance(fa4, BaseException):
        makers["fa4"] = _raises(fa4)
    elif fa4 is not None:
        def fa4_prefill():
            kw = dict(cu_seqlens_q=qo_d, cu_seqlens_k=kv_d, max_seqlen_q=max(sc._QO_LENS),
                      max_seqlen_k=max(sc._KV_LENS), softmax_scale=case["sm_scale"], causal=case["causal"])
            if sinks is not None:
                kw["learnable_sink"] = sinks
            return lambda: fa4.flash_attn_varlen_func(q, k, v, **kw)

        makers["fa4"] = fa4_prefill
    return makers


def _decode_peer_makers(modules: dict, plan_args: tuple, plan_kw: dict, q, cache) -> dict:
    """Peer makers (:func:`_peer_cell`) of a decode row: FlashInfer's paged decode wrapper planned with the
    row's own ``plan`` arguments and run on its ``q`` / ``cache`` (device tensors)."""
    fi = modules.get("flashinfer")
    if isinstance(fi, BaseException):
        return {"flashinfer": _raises(fi)}
    if fi is None:
        return {}

    def fi_decode():
        w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=q.device), "NHD")
        w.plan(*plan_args, **plan_kw)
        return lambda: w.run(q, cache)

    return {"flashinfer": fi_decode}


def _with(note: str, extra: str) -> str:
    return "; ".join(x for x in (note, extra) if x)


def _rel(x, y) -> float:
    x, y = x.detach().double().cpu(), y.detach().double().cpu()
    if not torch.isfinite(x).all():
        return float("nan")
    return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()


def _verdict(err: float, tol: float, extra: str | None = None) -> tuple[str, str]:
    if extra:
        return "FAIL", extra
    if not err <= tol:
        return "FAIL", f"O rel err > {tol:g}" if err == err else "non-finite output"
    return "pass", ""


def _prefill_kernels(arch: str) -> tuple[str, ...]:
    return {"sm_90a": ("portable", "sm90"), "sm_100a": ("portable", "sm100"),
            "sm_103a": ("portable", "sm100")}.get(arch, ("portable",))


def _prefill_rows(arch: str, kernel: str, peers: Peers | None = None):
    from . import dispatch
    from .selfcheck import check_prefill

    for label, dtype, d, group, causal, sinks in PREFILL_CASES:
        p = dispatch.prefill_problem(dtype=dtype, head_dim_qk=d, head_dim_vo=d, group_size=group, causal=causal,
                                     use_sinks=sinks, arch=arch)
        choice = dispatch.prefill_choice(p, kernel=kernel)
        if choice.name != f"prefill_{kernel}":
            yield Row("prefill", f"prefill_{kernel}", label, "skip", note=f"served by {choice.name}")
            continue
        t0 = time.perf_counter()
        choice.fn  # noqa: B018 - the compile (or disk-cache load), timed apart from the check
        first = time.perf_counter() - t0
        timings: dict = {}
        v = check_prefill(choice, dispatch.prefill_choice(p, kernel="portable"), timings=timings)
        cell, peer_note = "", ""
        if peers is not None:
            if label not in peers.prefill_cells:
                peers.prefill_cells[label] = _guarded_cell(
                    lambda: _prefill_peer_makers(peers.modules, p, torch.device("cuda")))
            cell, peer_note = peers.prefill_cells[label]
        yield Row("prefill", choice.name, label, "pass" if v.passed else "FAIL", v.candidate_err, first,
                  timings.get("candidate_us"), _with("" if v.passed else v.detail, peer_note), cell)


def _decode_rows(peers: Peers | None = None):
    import cutedsl_attn as ca

    from . import ref

    dev = torch.device("cuda")
    for label, dtype, d, group, ps, lens in DECODE_CASES:
        g = torch.Generator().manual_seed(0)
        hkv = 2
        npages = [-(-n // ps) for n in lens]
        pool = sum(npages) + 3
        indptr = torch.tensor([0] + torch.tensor(npages).cumsum(0).tolist(), dtype=torch.int32)
        indices = torch.randperm(pool, generator=g)[: sum(npages)].to(torch.int32)
        last = torch.tensor([n - (m - 1) * ps for n, m in zip(lens, npages)], dtype=torch.int32)
        cache = torch.randn(pool, 2, ps, hkv, d, generator=g).to(dtype)
        q = torch.randn(len(lens), hkv * group, d, generator=g).to(dtype)
        w = ca.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=dev), "NHD")
        plan_args = (indptr.to(dev), indices.to(dev), last.to(dev), hkv * group, hkv, d, ps)
        w.plan(*plan_args, q_data_type=dtype)
        q_d, cache_d = q.to(dev), cache.to(dev)
        t0 = time.perf_counter()
        out, lse = w.run(q_d, cache_d, return_lse=True)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        o_ref, lse_ref = ref.paged_decode(q, cache[:, 0], cache[:, 1], indptr, indices, last, kv_layout="NHD")
        err = _rel(out, o_ref)
        d_lse = (lse.double().cpu() - lse_ref.double()).abs().max().item()
        status, note = _verdict(err, _O_TOL[dtype], None if d_lse < _LSE_TOL else f"LSE abs err {d_lse:.2e}")
        kernel = getattr(w._plan.get("choice"), "name", "paged_decode")  # the kernel dispatch took
        us = _call_us(lambda: w.run(q_d, cache_d))
        cell, peer_note = "", ""
        if peers is not None:
            cell, peer_note = _guarded_cell(lambda: _decode_peer_makers(
                peers.modules, plan_args, dict(q_data_type=dtype, kv_data_type=dtype), q_d, cache_d))
        yield Row("decode", kernel, label, status, err, first, us, _with(note, peer_note), cell)


def _gdn_rows():
    import cutedsl_attn as ca

    from . import ref

    dev = torch.device("cuda")
    lens, hq, hk, hv, kd, vd = (1, 63, 300), 4, 4, 8, 128, 128
    g = torch.Generator().manual_seed(0)
    T = sum(lens)
    k = torch.randn(T, hk, kd, generator=g)
    kw = dict(q=torch.randn(T, hq, kd, generator=g).to(BF16), k=(k / k.norm(dim=-1, keepdim=True)).to(BF16),
              v=torch.randn(T, hv, vd, generator=g).to(BF16), g=torch.rand(T, hv, generator=g) * 0.5 + 0.5,
              beta=torch.rand(T, hv, generator=g),
              cu_seqlens=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32),
              initial_state=torch.randn(len(lens), hv, vd, kd, generator=g) * 0.1)
    kw_d = {n: t.to(dev) for n, t in kw.items()}
    o_ref, s_ref = ref.chunk_gated_delta_rule(**kw, output_final_state=True)
    # prefill runs the chunked kernel (its MMAs take the state rounded to 16 bits: a looser state bound); the
    # recurrent one (the decode kernel) is forced through the dispatch switch on the same problem
    from .compile import device_arch

    for kernel, s_tol in (("gdn_chunked_sm90", 5e-3), ("gdn_chunked", 5e-3), ("gdn_recurrent", 1e-3)):
        if kernel.endswith("sm90") and device_arch() != "sm_90a":
            yield Row("gdn", kernel, "bf16 K=V=128 GVA 4/4/8", "skip", note="an sm_90a kernel")
            continue
        saved = os.environ.get("CUTEDSL_ATTN_GDN_KERNEL")
        os.environ["CUTEDSL_ATTN_GDN_KERNEL"] = kernel[4:]
        try:
            t0 = time.perf_counter()
            o, s = ca.chunk_gated_delta_rule(**kw_d, output_final_state=True)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            err, s_err = _rel(o, o_ref), _rel(s, s_ref)
            status, note = _verdict(err, 1e-2, None if s_err < s_tol else f"state rel err {s_err:.2e}")
            us = _call_us(lambda: ca.chunk_gated_delta_rule(**kw_d, output_final_state=True))
        finally:
            if saved is None:
                os.environ.pop("CUTEDSL_ATTN_GDN_KERNEL", None)
            else:
                os.environ["CUTEDSL_ATTN_GDN_KERNEL"] = saved
        yield Row("gdn", kernel, "bf16 K=V=128 GVA 4/4/8", status, err, first, us, note)


def _kda_rows():
    import cutedsl_attn as ca

    from . import ref
    from .compile import device_arch

    dev = torch.device("cuda")
    lens, hk, hv, d = (1, 17, 300), 2, 4, 128
    g = torch.Generator().manual_seed(0)
    T = sum(lens)
    kw = dict(q=torch.randn(1, T, hk, d, generator=g).to(BF16), k=torch.randn(1, T, hk, d, generator=g).to(BF16),
              v=torch.randn(1, T, hv, d, generator=g).to(BF16), g=-torch.rand(1, T, hv, d, generator=g) * 0.3,
              beta=torch.rand(1, T, hv, generator=g),
              cu_seqlens=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32),
              initial_state=torch.randn(len(lens), hv, d, d, generator=g) * 0.1)
    kw_d = {n: t.to(dev) for n, t in kw.items()}
    # recurrent_kda advances initial_state in place: each call gets its own copy
    o_ref, s_ref = ref.recurrent_kda(**dict(kw, initial_state=kw["initial_state"].clone()), output_final_state=True)

    def call():
        return ca.recurrent_kda(**dict(kw_d, initial_state=kw_d["initial_state"].clone()), output_final_state=True)

    t0 = time.perf_counter()
    o, s = call()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    err, s_err = _rel(o, o_ref), _rel(s, s_ref)
    status, note = _verdict(err, 1e-2, None if s_err < 5e-3 else f"state rel err {s_err:.2e}")
    name = "kda_chunked_sm90" if device_arch() == "sm_90a" else "kda_chunked"  # dispatch's automatic pick
    yield Row("gdn", name, "KDA bf16 K=V=128 GVA 2/4", status, err, first, _call_us(call), note)


def _mla_rows():
    for ps in (16, 64):  # page 16: the portable kernel; page 64: the SM90 one on sm_90a (dispatch's pick)
        yield _mla_row(ps)


def _mla_row(ps: int):
    from . import ref
    from .api.mla import BatchMLAPagedAttentionWrapper

    dev = torch.device("cuda")
    H, dc, dr, kv_lens = 16, 512, 64, (1, 100, 2000)
    g = torch.Generator().manual_seed(0)
    npages = [-(-n // ps) for n in kv_lens]
    pool = sum(npages) + 3
    kv_indptr = torch.tensor([0] + torch.tensor(npages).cumsum(0).tolist(), dtype=torch.int32)
    kv_indices = torch.randperm(pool, generator=g)[: sum(npages)].to(torch.int32)
    qo_indptr = torch.arange(len(kv_lens) + 1, dtype=torch.int32)
    kv_len = torch.tensor(kv_lens, dtype=torch.int32)
    q_nope, q_pe = (torch.randn(len(kv_lens), H, n, generator=g).to(BF16) for n in (dc, dr))
    ckv, kpe = (torch.randn(pool, ps, n, generator=g).to(BF16) for n in (dc, dr))
    sm_scale = 1.0 / (128 + 64) ** 0.5
    w = BatchMLAPagedAttentionWrapper(torch.empty(256 << 20, dtype=torch.int8, device=dev))
    w.plan(qo_indptr.to(dev), kv_indptr.to(dev), kv_indices.to(dev), kv_len.to(dev), H, dc, dr, ps, False, sm_scale,
           BF16, BF16)
    args_d = [t.to(dev) for t in (q_nope, q_pe, ckv, kpe)]
    t0 = time.perf_counter()
    o, lse = w.run(*args_d, return_lse=True)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    o_ref, lse_ref = ref.mla_paged_attention(q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_len,
                                             sm_scale=sm_scale, causal=False)
    err = _rel(o, o_ref)
    d_lse = (lse.double().cpu() - lse_ref.double()).abs().max().item()
    status, note = _verdict(err, 1e-2, None if d_lse < _LSE_TOL else f"LSE abs err {d_lse:.2e}")
    return Row("mla", w._plan["module"].NAME, f"bf16 H16 page{ps} decode", status, err, first,
               _call_us(lambda: w.run(*args_d)), note)


def _guarded(op: str, kernel: str, rows):
    """The rows of one generator; an exception becomes an ``error`` row (the remaining cases of it are lost)."""
    try:
        yield from rows
    except Exception as e:  # noqa: BLE001 - the table reports every failure and goes on
        yield Row(op, kernel, "-", "error", note=f"{type(e).__name__}: {str(e)[:200]}")


def gpu_matrix(only: str = "", peers: bool = True):
    """Yields the :class:`Row` of every case on the current GPU (``only``: rows whose op or kernel contain it;
    ``peers``: time the installed peers beside the prefill and decode rows)."""
    from .compile import device_arch

    arch = device_arch()
    kernels = _prefill_kernels(arch)
    found = None  # (the peers are imported only when a prefill or decode row runs)
    # (op, the kernels its rows name, the rows): ``only`` keeps a group naming a matching op or kernel, then the
    # rows whose op or kernel match
    groups = [("prefill", (f"prefill_{k}",), lambda k=k: _prefill_rows(arch, k, found))
              for k in kernels if k != "sm100"]
    groups += [("decode", ("paged_decode",), lambda: _decode_rows(found)),
               ("gdn", ("gdn_chunked_sm90", "gdn_chunked", "gdn_recurrent"), _gdn_rows),
               ("gdn", ("kda_chunked", "kda_chunked_sm90"), _kda_rows),
               ("mla", ("mla_decode_portable", "mla_decode_sm90"), _mla_rows)]
    groups += [("prefill", ("prefill_sm100",), lambda: _prefill_rows(arch, "sm100", found))
               for k in kernels if k == "sm100"]
    groups = [g for g in groups if not only or only in g[0] or any(only in k for k in g[1])]
    if peers and any(op in ("prefill", "decode") for op, _, _ in groups):
        found = Peers(installed_peers())
    for op, names, make in groups:
        for row in _guarded(op, names[0], make()):
            if not only or only in row.op or only in row.kernel:
                yield row


def cross_compile_matrix(arch: str, only: str = ""):
    """Yields a ``built`` / ``error`` :class:`Row` per prefill and decode configuration of the matrix (the tcgen05
    decode kernel too on sm_100a / sm_103a), the chunked GDN kernel and the MLA kernel, compiled for ``arch`` on
    this machine (no GPU needed)."""
    from . import dispatch

    for kernel in _prefill_kernels(arch):
        for label, dtype, d, group, causal, sinks in PREFILL_CASES:
            name = f"prefill_{kernel}"
            if only and only not in "prefill" and only not in name:
                continue
            p = dispatch.prefill_problem(dtype=dtype, head_dim_qk=d, head_dim_vo=d, group_size=group,
                                         causal=causal, use_sinks=sinks, arch=arch)
            yield _build("prefill", name, label, lambda p=p, k=kernel: dispatch.prefill_choice(p, kernel=k))
    decode_kernels = ["paged_decode"] + (["paged_decode_sm100"] if arch in ("sm_100a", "sm_103a") else [])
    for name in decode_kernels:
        for label, dtype, d, group, ps, _ in DECODE_CASES:
            if only and only not in "decode" and only not in name:
                continue
            p = dispatch.decode_problem(dtype=dtype, head_dim=d, page_size=ps, group_size=group, arch=arch)
            k = "sm100" if name.endswith("sm100") else "portable"
            yield _build("decode", name, label, lambda p=p, k=k: dispatch.decode_choice(p, kernel=k))
    from .planning.gdn import GdnProblem
    from .planning.mla import MlaProblem

    from .portable import gdn_chunked, kda_chunked
    from .sm90 import gdn_chunked as gdn_chunked_sm90
    from .sm90 import kda_chunked as kda_chunked_sm90

    gp = GdnProblem(dtype="bfloat16", head_dim_k=128, head_dim_v=128, use_qk_l2norm=True, arch=arch)
    kp = dataclasses.replace(gp, gate_domain="log", gate_per_channel=True)
    gdn_kernels = [(gdn_chunked, gp, "bf16 K=V=128 l2norm"), (kda_chunked, kp, "KDA bf16 K=V=128 l2norm")]
    if arch == "sm_90a":
        gdn_kernels.insert(0, (gdn_chunked_sm90, gp, "bf16 K=V=128 l2norm"))
        gdn_kernels.insert(2, (kda_chunked_sm90, kp, "KDA bf16 K=V=128 l2norm"))
    for mod, prob, label in gdn_kernels:  # each chunked kernel this arch builds, not only dispatch's pick
        if not only or only in "gdn" or only in mod.NAME:
            yield _build_module("gdn", mod.NAME, label, lambda m=mod, p=prob: (
                m, m.Config(p, m.default_tiles(p, num_sms=132))))
    from .portable import mla_decode
    from .sm90 import mla as mla_sm90

    mp = MlaProblem(dtype="bfloat16", page_size=64, causal=False, arch=arch)
    for mod in (mla_decode,) + ((mla_sm90,) if arch == "sm_90a" else ()):  # both: the SM90 one is the sm_90a default at page 64
        if not only or only in "mla" or only in mod.NAME:
            yield _build_module("mla", mod.NAME, "bf16 page64", lambda m=mod: (
                m, m.Config(mp, m.default_tiles(mp, num_sms=132))))


def _build(op, kernel, label, choose) -> Row:
    t0 = time.perf_counter()
    try:
        choice = choose()
        if choice.name != kernel:
            return Row(op, kernel, label, "skip", note=f"served by {choice.name}")
        choice.fn  # noqa: B018 - compiles (or loads from the disk cache)
    except Exception as e:  # noqa: BLE001
        return Row(op, kernel, label, "error", note=f"{type(e).__name__}: {str(e)[:200]}")
    return Row(op, kernel, label, "built", first_s=time.perf_counter() - t0)


def _build_module(op, kernel, label, choose) -> Row:
    """:func:`_build` for the families whose choice is ``(kernel module, config)`` (GDN, MLA)."""
    from .compile import get_compiled

    t0 = time.perf_counter()
    try:
        module, cfg = choose()
        if module.NAME != kernel:
            return Row(op, kernel, label, "skip", note=f"served by {module.NAME}")
        get_compiled(module.NAME, cfg, module.compile)
    except Exception as e:  # noqa: BLE001
        return Row(op, kernel, label, "error", note=f"{type(e).__name__}: {str(e)[:200]}")
    return Row(op, kernel, label, "built", first_s=time.perf_counter() - t0)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m cutedsl_attn selfcheck",
        description="Run every kernel of this GPU against the float64 oracle on a short matrix and print a "
                    "pass/fail table with timings (and the installed peers' on the prefill and decode cases: "
                    "FlashInfer, FlashAttention-4).  Without a GPU: say so, cross-compile the prefill and decode "
                    "kernels of the matrix, the chunked GDN / KDA kernels and the MLA kernels for --arch and exit "
                    "0 when every build succeeds.")
    ap.add_argument("--arch", default="sm_100a",
                    help="without a GPU: the architecture to cross-compile for (default sm_100a); ignored with one")
    ap.add_argument("--only", default="", help="only the rows whose op or kernel name contains this text")
    ap.add_argument("--no-peers", action="store_true",
                    help="with a GPU: do not time the installed peers (FlashInfer, FlashAttention-4)")
    return ap


def main(argv=None) -> int:
    """Entry point of ``python -m cutedsl_attn selfcheck``; returns the exit status (0: every case passed or
    built; 1: a case failed or raised; 2: bad arguments, or ``--only`` matching no case)."""
    args = build_parser().parse_args(argv)
    from .compile import device_arch, normalize_arch

    dev = device_arch()
    rows = []
    if dev is None:
        try:
            arch = normalize_arch(args.arch)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"no CUDA GPU here: no kernel can run; cross-compiling the matrix's prefill, decode, GDN and MLA "
              f"kernels for {arch} instead (nothing is compared with the oracle)", flush=True)
        source = cross_compile_matrix(arch, args.only)
    else:
        print(f"{torch.cuda.get_device_name()} ({dev}): every kernel of this GPU against the float64 oracle",
              flush=True)
        source = gpu_matrix(args.only, peers=not args.no_peers)
    for row in source:
        rows.append(row)
        print(f"  {row.op} {row.kernel} {row.case}: {row.status}", file=sys.stderr, flush=True)
    if not rows:
        print(f"error: no case matches --only {args.only!r}", file=sys.stderr)
        return 2
    print(format_table(rows))
    bad = [r for r in rows if r.status in ("FAIL", "error")]
    print(f"{len(rows) - len(bad)} of {len(rows)} rows ok" + (f"; {len(bad)} failed" if bad else ""))
    return 1 if bad else 0
