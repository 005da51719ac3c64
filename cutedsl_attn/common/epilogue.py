"""Prefill epilogue shared by the portable and SM90 kernels: normalise a warp's 16 rows, write O and the LSE.

Both kernels hold O in the ``mma.m16n8`` C layout (the SM90 wgmma accumulator of one warp is that
layout repeated over n8 tiles): ``acc[4*n + e]`` is row ``g`` (``e`` in {0, 1}) or ``g + 8``
(``e`` in {2, 3}) of the warp, columns ``8*n + 2*t + e % 2``, with ``g = lane // 4`` and
``t = lane % 4``.  Packed row ``r`` of a tile is query token ``r // group_size`` and query head
``kv_head * group_size + r % group_size`` (GQA packing, :mod:`cutedsl_attn.planning.prefill`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64, const_expr

from . import ptx
from . import softmax as sm
from .constants import LOG2E, NEG_INF
from .smem import sw128_offset


@cute.jit
def _row_factor(mSinks, row_m, row_l, h: cutlass.Constexpr, head, use_sinks: cutlass.Constexpr):
    """(factor, lse) of the lane's row ``h`` (:func:`softmax.finalize_row`), with the sink logit of query head
    ``head`` (natural log, converted to log2 units) where ``use_sinks``."""
    sink_l2 = Float32(NEG_INF)
    if const_expr(use_sinks):
        sink_l2 = mSinks[head] * LOG2E
    return sm.finalize_row(row_m[h], row_l[h], sink_l2)


@cute.jit
def _scaled_pair(acc, i: cutlass.Constexpr, inv, zero_empty_rows: cutlass.Constexpr, dtype: cutlass.Constexpr):
    """``acc[i], acc[i + 1]`` times ``inv`` packed into one 32-bit word; with ``zero_empty_rows`` an exact 0
    where ``inv == 0`` (a row that saw no key), whatever ``acc`` holds."""
    inv_ok = inv != Float32(0.0)
    o0 = acc[i] * inv
    if const_expr(zero_empty_rows):
        o0 = Float32(cutlass.select_(inv_ok, o0, Float32(0.0)))
    o1 = acc[i + 1] * inv
    if const_expr(zero_empty_rows):
        o1 = Float32(cutlass.select_(inv_ok, o1, Float32(0.0)))
    return ptx.pack2(o0, o1, dtype)


@cute.jit
def store_rows(mO, mLSE, mSinks, acc, row_m, row_l, row0, qo_len, q_start, kvh, lane, warp,
               head_dim_vo: cutlass.Constexpr, group_size: cutlass.Constexpr, use_sinks: cutlass.Constexpr,
               dtype: cutlass.Constexpr, zero_empty_rows: cutlass.Constexpr, output_scale=None):
    """Normalise (sinks folded in) and store the lane's two rows of a warp's 16: O two values per 32-bit
    store into ``mO [tokens, Hq, head_dim_vo]`` (contiguous), the base-2 LSE into ``mLSE [tokens, Hq]``
    (by the row's first lane).  Rows past the request (``qo_len * group_size``) are not written.

    ``row_m``/``row_l``: the running max (log2 units) and the quad-reduced sum of each row; ``mSinks``:
    per-head sink logits (natural log), read when ``use_sinks``.  ``zero_empty_rows`` writes an exact 0
    for a row whose normalising factor is 0 (no visible key) whatever ``acc`` holds there, instead of
    ``acc * 0``.  ``output_scale`` (Float32, or None for none): a factor on the normalised output, applied in
    fp32 before the 16-bit rounding (FlashInfer's ``v_scale / o_scale``).
    """
    DV, G = head_dim_vo, group_size
    g = lane // 4
    t = lane % 4
    hq = mO.shape[1]
    o_base = mO.iterator.toint()
    for h in cutlass.range_constexpr(2):
        pr = row0 + warp * 16 + g + 8 * h
        if pr < qo_len * G:
            tok = q_start + pr // G
            head = kvh * G + pr % G
            inv, lse = _row_factor(mSinks, row_m, row_l, h, head, use_sinks)
            if const_expr(output_scale is not None):
                inv = inv * output_scale
            row_addr = o_base + ((Int64(tok) * hq + head) * DV) * 2
            for dd in cutlass.range_constexpr(DV // 8):
                v = _scaled_pair(acc, dd * 4 + 2 * h, inv, zero_empty_rows, dtype)
                ptx.st_global_u32(row_addr + (dd * 8 + 2 * t) * 2, v)
            if t == 0:
                mLSE[tok, head] = lse


def staged_offset(r, c):
    """Byte offset of 16-byte chunk ``c`` (columns ``8c .. 8c+7``) of row ``r`` (0..15) in a warp's staging
    rows (:func:`stage_rows`): one 2 KiB box of 16 rows x 64 columns per 64 columns, 128-byte rows,
    chunks XOR-swizzled by ``r % 8`` -- the K-major 128-byte-swizzled layout that a TMA box of 16 x 64 reads
    (staging base 1 KiB aligned), conflict-free for ``stmatrix`` and 16-byte loads (plain ints or DSL
    integers, so the layout can be replayed on the host)."""
    return sw128_offset(r, c, 16)


def stmatrix_row(lane, dd: int):
    """(row, chunk) whose address ``lane`` gives to the ``stmatrix.x4`` of column blocks ``dd, dd + 1``:
    matrix ``lane // 8`` is (column block ``dd + m // 2``, row half ``m % 2``), row ``lane % 8`` of it."""
    m = lane // 8
    return (m % 2) * 8 + lane % 8, dd + m // 2


@cute.jit
def stage_rows(mSinks, acc, row_m, row_l, row0, kvh, lane, warp, s_base, head_dim_vo: cutlass.Constexpr,
               group_size: cutlass.Constexpr, use_sinks: cutlass.Constexpr, dtype: cutlass.Constexpr,
               output_scale=None):
    """Normalise the warp's 16 rows (sinks folded in, exact 0 for rows that saw no key) and ``stmatrix`` them
    to ``s_base`` (Int32 shared-window byte address, 1 KiB aligned, of ``16 * head_dim_vo * 2`` bytes that
    only this warp touches; :func:`staged_offset`'s layout).  Returns the LSE of the lane's two rows (base
    2).  The caller syncs the warp before reading the rows back (:func:`store_staged_rows`) or hands them
    to a TMA store.  ``output_scale``: as :func:`store_rows`."""
    DV, G = head_dim_vo, group_size
    g = lane // 4
    words = []  # words[h][dd]: the packed pair of row g + 8h, columns 8 dd + 2t, +1
    lses = []
    for h in cutlass.range_constexpr(2):
        pr = row0 + warp * 16 + g + 8 * h
        inv, lse = _row_factor(mSinks, row_m, row_l, h, kvh * G + pr % G, use_sinks)
        if const_expr(output_scale is not None):
            inv = inv * output_scale
        lses.append(lse)
        words.append([_scaled_pair(acc, dd * 4 + 2 * h, inv, True, dtype) for dd in range(DV // 8)])
    # stmatrix x4: matrices (dd, row half 0), (dd, 1), (dd + 1, 0), (dd + 1, 1)
    for dd in cutlass.range_constexpr(0, DV // 8, 2):
        r_st, c = stmatrix_row(lane, dd)
        ptx.stmatrix_x4(s_base + staged_offset(r_st, c),
                        words[0][dd], words[1][dd], words[0][dd + 1], words[1][dd + 1])
    return lses[0], lses[1]


@cute.jit
def store_staged_rows(mO, row0, qo_len, q_start, kvh, lane, warp, s_base, head_dim_vo: cutlass.Constexpr,
                      group_size: cutlass.Constexpr):
    """Copy the warp's 16 staged rows (:func:`stage_rows`, warp synced) from shared memory to ``mO``, whole
    16-byte chunks per lane: each store instruction writes 512 bytes of whole rows (two rows at head_dim_vo
    128; full 32-byte sectors) instead of :func:`store_rows`' 4 bytes per lane of eight rows; with
    :func:`stage_rows` and :func:`store_lse` the same rows, values, LSE and empty-row zeros as
    :func:`store_rows` with ``zero_empty_rows`` (needs ``head_dim_vo % 64 == 0``: 8+ chunks per row).  Rows
    past the request (``qo_len * group_size``) are not written."""
    DV, G = head_dim_vo, group_size
    CPR = DV // 8  # 16-byte chunks per row
    hq = mO.shape[1]
    o_base = mO.iterator.toint()
    limit = qo_len * G
    for it in cutlass.range_constexpr(16 * CPR // 32):
        idx = it * 32 + lane
        r = idx // CPR
        c = idx % CPR
        v = ptx.ld_shared_v4_b32(s_base + staged_offset(r, c))
        pr = row0 + warp * 16 + r
        if pr < limit:
            tok = q_start + pr // G
            head = kvh * G + pr % G
            ptx.st_global_v4_b32(o_base + ((Int64(tok) * hq + head) * DV + c * 8) * 2, v[0], v[1], v[2], v[3])


@cute.jit
def store_lse(mLSE, lse0, lse1, row0, qo_len, q_start, kvh, lane, warp, group_size: cutlass.Constexpr):
    """The base-2 LSE of the lane's two rows (:func:`stage_rows`) into ``mLSE [tokens, Hq]``, by each row's
    first lane; rows past the request are not written."""
    G = group_size
    g = lane // 4
    lses = [lse0, lse1]
    for h in cutlass.range_constexpr(2):
        pr = row0 + warp * 16 + g + 8 * h
        if pr < qo_len * G:
            if lane % 4 == 0:
                mLSE[q_start + pr // G, kvh * G + pr % G] = lses[h]
