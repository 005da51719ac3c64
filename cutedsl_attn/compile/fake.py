"""Fake (symbolic) tensors that kernels are compiled against (no GPU, no data): host code of the compile layer.

Every size is a symbolic int, so one compiled kernel serves any batch, length, head count and
page count; only the config's static values (dtypes, head dims, page size) are fixed.  Strides
are symbolic multiples of 8 elements (16 bytes) with a contiguous last dim, as the API checks.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


def prefill_tensors(cfg, work_cols: int) -> tuple:
    """``(q, k, v, indices, work, o, lse, mask, sinks)`` for a prefill problem (``cfg``: anything with the fields of
    :class:`cutedsl_attn.planning.prefill.PrefillProblem` and a ``cutlass_dtype``; a ``kv_cutlass_dtype``, where
    present, types k and v, else they have q's).

    q ``[tokens, Hq, head_dim_qk]``; k/v ``[tokens, Hkv, D]`` (ragged) or
    ``[pages, page_size, Hkv, D]`` (``cfg.page_size > 0``), strides in elements of 16-byte chunks (8 elements, 16
    for an fp8 cache); indices int32 page ids; work
    ``[W, work_cols]`` int32 (:mod:`cutedsl_attn.planning.prefill`'s ``WORK_COLS``); o ``[tokens, Hq, head_dim_vo]``
    and lse ``[tokens, Hq]`` fp32, contiguous; mask uint8 packed bits; sinks fp32 ``[Hq]``.
    """
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

    dt = cfg.cutlass_dtype
    kv_dt = getattr(cfg, "kv_cutlass_dtype", dt)
    kv_div = 128 // kv_dt.width  # elements of a 16-byte chunk

    def sym():
        return cute.sym_int()

    def s64(div=8):
        return cute.sym_int64(divisibility=div)

    def kv64():
        return s64(kv_div)

    TQ, Hq, Hkv, NNZ, W, NB = (sym() for _ in range(6))
    q = make_fake_tensor(dt, (TQ, Hq, cfg.head_dim_qk), (s64(), s64(), 1), assumed_align=16)
    if cfg.page_size > 0:
        P = sym()
        k = make_fake_tensor(kv_dt, (P, cfg.page_size, Hkv, cfg.head_dim_qk), (kv64(), kv64(), kv64(), 1),
                             assumed_align=16)
        v = make_fake_tensor(kv_dt, (P, cfg.page_size, Hkv, cfg.head_dim_vo), (kv64(), kv64(), kv64(), 1),
                             assumed_align=16)
    else:
        TK = sym()
        k = make_fake_tensor(kv_dt, (TK, Hkv, cfg.head_dim_qk), (kv64(), kv64(), 1), assumed_align=16)
        v = make_fake_tensor(kv_dt, (TK, Hkv, cfg.head_dim_vo), (kv64(), kv64(), 1), assumed_align=16)
    idx = make_fake_compact_tensor(Int32, (NNZ,), assumed_align=4)
    work = make_fake_compact_tensor(Int32, (W, work_cols), stride_order=(1, 0), assumed_align=16)
    o = make_fake_compact_tensor(dt, (TQ, Hq, cfg.head_dim_vo), stride_order=(2, 1, 0), assumed_align=16)
    lse = make_fake_compact_tensor(Float32, (TQ, Hq), stride_order=(1, 0), assumed_align=4)
    mask = make_fake_compact_tensor(cutlass.Uint8, (NB,), assumed_align=1)
    sinks = make_fake_compact_tensor(Float32, (sym(),), assumed_align=4)
    return q, k, v, idx, work, o, lse, mask, sinks



def decode_tensors(cfg, work_cols: int) -> tuple:
    """``(q, k, v, indices, work, o, lse, part_o, part_lse, counters, sinks, alibi_slopes)`` for a paged decode
    problem (``cfg``: anything with a ``problem`` holding the fields of
    :class:`cutedsl_attn.planning.decode.DecodeProblem`, a ``cutlass_dtype`` typing q and o and a
    ``kv_cutlass_dtype`` typing k and v; the decode kernels' ``Config``).

    q ``[batch, Hq, head_dim]``; k/v ``[pages, page_size, Hkv, head_dim]`` (NHD or HND through the strides);
    strides in elements of 16-byte chunks (8 elements, 16 for an fp8 cache), last dims contiguous; indices int32
    page ids; work ``[W, work_cols]`` int32 (:mod:`cutedsl_attn.planning.decode`'s ``WORK_COLS``); o
    ``[batch, Hq, head_dim]`` and lse ``[batch, Hq]`` fp32, contiguous; part_o ``[parts, Hq, head_dim]`` and
    part_lse ``[parts, Hq]`` fp32, contiguous; counters int32; sinks and alibi_slopes fp32 ``[Hq]``.  Every size
    is symbolic except ``page_size`` and ``head_dim``.
    """
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

    dt = cfg.cutlass_dtype
    kv_dt = cfg.kv_cutlass_dtype  # torch.float8_e4m3fn reaches tvm-ffi as DLPack float8_e4m3fn: no uint8 view
    kv_div = 128 // kv_dt.width  # elements of a 16-byte chunk
    D = cfg.problem.head_dim
    PS = cfg.problem.page_size

    def sym():
        return cute.sym_int()

    def s64(div=1):
        return cute.sym_int64(divisibility=div)

    B, Hq, P, Hkv, NNZ, W, NP, NC = (sym() for _ in range(8))
    q = make_fake_tensor(dt, (B, Hq, D), (s64(8), s64(8), 1), assumed_align=16)
    k = make_fake_tensor(kv_dt, (P, PS, Hkv, D), (s64(kv_div), s64(kv_div), s64(kv_div), 1), assumed_align=16)
    v = make_fake_tensor(kv_dt, (P, PS, Hkv, D), (s64(kv_div), s64(kv_div), s64(kv_div), 1), assumed_align=16)
    idx = make_fake_compact_tensor(Int32, (NNZ,), assumed_align=4)
    work = make_fake_compact_tensor(Int32, (W, work_cols), stride_order=(1, 0), assumed_align=16)
    o = make_fake_compact_tensor(dt, (B, Hq, D), stride_order=(2, 1, 0), assumed_align=16)
    lse = make_fake_compact_tensor(Float32, (B, Hq), stride_order=(1, 0), assumed_align=4)
    po = make_fake_compact_tensor(Float32, (NP, Hq, D), stride_order=(2, 1, 0), assumed_align=16)
    plse = make_fake_compact_tensor(Float32, (NP, Hq), stride_order=(1, 0), assumed_align=4)
    cnt = make_fake_compact_tensor(Int32, (NC,), assumed_align=4)
    sinks = make_fake_compact_tensor(Float32, (sym(),), assumed_align=4)
    alibi = make_fake_compact_tensor(Float32, (sym(),), assumed_align=4)
    return q, k, v, idx, work, o, lse, po, plse, cnt, sinks, alibi


def mla_tensors(cfg, work_cols: int) -> tuple:
    """``(q_nope, q_pe, ckv, kpe, indices, work, o, lse, part_o, part_lse, counters)`` for an MLA decode problem
    (``cfg``: anything with a ``problem`` holding the fields of :class:`cutedsl_attn.planning.mla.MlaProblem`
    and ``cutlass_dtype`` (o), ``q_cutlass_dtype`` and ``kv_cutlass_dtype``; the MLA kernels' ``Config``).

    q_nope ``[T, H, head_dim_ckv]``, q_pe ``[T, H, head_dim_kpe]``; ckv / kpe ``[pages, page_size, head_dim]``;
    indices int32 page ids; work ``[W, work_cols]`` int32 (:mod:`cutedsl_attn.planning.mla`'s
    ``MLA_WORK_COLS``); o ``[T, H, head_dim_ckv]``; lse ``[T, H]`` fp32; part_o ``[parts, rows, head_dim_ckv]``
    and part_lse ``[parts, rows]`` fp32, contiguous; counters int32.  Every size is symbolic but the head dims
    and the page size; last dims contiguous, strides multiples of 16 bytes (8 elements, 16 for fp8 q or caches).
    """
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

    dt = cfg.cutlass_dtype
    q_dt, kv_dt = cfg.q_cutlass_dtype, cfg.kv_cutlass_dtype  # fp8 tensors reach tvm-ffi as DLPack float8_e4m3fn
    qd, kvd = (16 if cfg.problem.q_fp8 else 8), (16 if cfg.problem.kv_fp8 else 8)  # 16-byte strides, in elements
    PS = cfg.problem.page_size
    Dc, Dr = cfg.problem.head_dim_ckv, cfg.problem.head_dim_kpe

    def sym():
        return cute.sym_int()

    def s64(div=8):
        return cute.sym_int64(divisibility=div)

    T, H, P, NNZ, W, NP, R, NC = (sym() for _ in range(8))
    qn = make_fake_tensor(q_dt, (T, H, Dc), (s64(qd), s64(qd), 1), assumed_align=16)
    qp = make_fake_tensor(q_dt, (T, H, Dr), (s64(qd), s64(qd), 1), assumed_align=16)
    ckv = make_fake_tensor(kv_dt, (P, PS, Dc), (s64(kvd), s64(kvd), 1), assumed_align=16)
    kpe = make_fake_tensor(kv_dt, (P, PS, Dr), (s64(kvd), s64(kvd), 1), assumed_align=16)
    idx = make_fake_compact_tensor(Int32, (NNZ,), assumed_align=4)
    work = make_fake_compact_tensor(Int32, (W, work_cols), stride_order=(1, 0), assumed_align=8)
    o = make_fake_tensor(dt, (T, H, Dc), (s64(), s64(), 1), assumed_align=16)
    lse = make_fake_compact_tensor(Float32, (T, H), stride_order=(1, 0), assumed_align=4)
    po = make_fake_compact_tensor(Float32, (NP, R, Dc), stride_order=(2, 1, 0), assumed_align=16)
    plse = make_fake_compact_tensor(Float32, (NP, R), stride_order=(1, 0), assumed_align=4)
    cnt = make_fake_compact_tensor(Int32, (NC,), assumed_align=4)
    return qn, qp, ckv, kpe, idx, work, o, lse, po, plse, cnt


def gdn_chunked_tensors(io, state_dtype, head_dim_k: int, head_dim_v: int, chunk: int) -> tuple:
    """The chunked GDN kernels' tensors, in their launch order: q / k ``[T, H, K]`` and v ``[T, H, V]`` (``io``,
    strides multiples of 8 elements), g / beta fp32 ``[T, HO]``, cu_seqlens int32, the chunk table int32
    ``[chunks, 4]`` and its offsets, initial / final states ``[*, HO, V, K]`` (``state_dtype``) with their
    int32 row indices, o ``[T, HO, V]``, and the prep kernel's scratch: W ``[chunks, HO, chunk, K]``, U
    ``[.., V]``, Aqk ``[.., chunk]`` (``io``) and the fp32 row factors ``[chunks, HO, 3, chunk]``."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

    K, V, C = head_dim_k, head_dim_v, chunk

    def sym():
        return cute.sym_int()

    def s64(div=8):
        return cute.sym_int64(divisibility=div)

    def compact(dt, shape):
        return make_fake_compact_tensor(dt, shape, stride_order=tuple(reversed(range(len(shape)))),
                                        assumed_align=16)

    T = sym()
    q = make_fake_tensor(io, (T, sym(), K), (s64(), s64(), 1), assumed_align=16)
    k = make_fake_tensor(io, (T, sym(), K), (s64(), s64(), 1), assumed_align=16)
    v = make_fake_tensor(io, (T, sym(), V), (s64(), s64(), 1), assumed_align=16)
    g = make_fake_tensor(Float32, (sym(), sym()), (s64(1), 1), assumed_align=4)
    beta = make_fake_tensor(Float32, (sym(), sym()), (s64(1), 1), assumed_align=4)

    def index():
        return make_fake_compact_tensor(Int32, (sym(),), assumed_align=4)

    cu = index()
    chunks = compact(Int32, (sym(), 4))
    chunk_off = index()
    h0, h0_idx = compact(state_dtype, (sym(), sym(), V, K)), index()
    ht, ht_idx = compact(state_dtype, (sym(), sym(), V, K)), index()
    o = compact(io, (sym(), sym(), V))
    nc, ho = sym(), sym()
    w, u, aqk = (compact(io, (nc, ho, C, d)) for d in (K, V, C))
    f = compact(Float32, (nc, ho, 3, C))
    return q, k, v, g, beta, cu, chunks, chunk_off, h0, h0_idx, ht, ht_idx, o, w, u, aqk, f


def kda_chunked_tensors(io, state_dtype, head_dim_k: int, head_dim_v: int, chunk: int,
                        erase_write_gates: bool) -> tuple:
    """Fake tensors of the per-channel (KDA / GDN-2) chunked kernels, in their compiled function's order: the
    chunked GDN ones (:func:`gdn_chunked_tensors`, the same arguments) with g ``[T, HO, K]`` fp32, beta
    ``[T, HO]`` (KDA) or ``[T, HO, K + V]`` (GDN-2: ``erase_write_gates``), the token-major Qg / Kd ``[T, HO, K]``
    (``io``) and F ``[chunks, HO, 2 chunk + K]`` fp32."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    K, V = head_dim_k, head_dim_v
    q, k, v, _, beta, cu, chunks, chunk_off, h0, h0_idx, ht, ht_idx, o, w, u, aqk, _ = gdn_chunked_tensors(
        io, state_dtype, K, V, chunk)

    def compact(dt, last):
        return make_fake_compact_tensor(dt, (cute.sym_int(), cute.sym_int(), last), stride_order=(2, 1, 0),
                                        assumed_align=16)

    g = compact(Float32, K)
    if erase_write_gates:
        beta = compact(Float32, K + V)
    qg, kd = compact(io, K), compact(io, K)
    f = compact(Float32, 2 * chunk + K)
    return q, k, v, g, beta, cu, chunks, chunk_off, h0, h0_idx, ht, ht_idx, o, qg, kd, w, u, aqk, f


def vector_f32():
    """A symbolic-length fp32 vector (e.g. the ALiBi slopes ``[Hq]``)."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    return make_fake_compact_tensor(Float32, (cute.sym_int(),), assumed_align=4)
