"""Attention masks shared by the kernels (FlashInfer's conventions), evaluated per score element.

Helpers called while a kernel is traced; the ``causal`` / ``use_window`` flags are compile-time
Python bools, so a disabled mask emits no code.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr


def visible(j, kv_len, qpos, window_left, *, causal: bool, use_window: bool):
    """Whether key ``j`` (request-relative) is visible to the query at bottom-right position ``qpos``
    (``= i + kv_len - qo_len`` for query row ``i``): inside the request, ``j <= qpos`` when ``causal``,
    and ``j >= qpos - window_left`` when ``use_window`` and ``window_left >= 0`` (``w + 1`` keys)."""
    ok = j < kv_len
    if causal:
        ok = ok & (j <= qpos)
    if use_window:  # (a window of kv_len keys or more is no window: the clamp keeps int32 from wrapping)
        ok = ok & ((window_left < 0) | (j >= qpos - cutlass.min(window_left, kv_len)))
    return ok


def visible_range(j0, kv_len, qpos, window_left, *, causal: bool, use_window: bool):
    """:func:`visible` as a range of offsets: key ``j0 + c`` is visible to the query at ``qpos`` iff
    ``lo <= c <= hi``, ``(lo, hi)`` returned (``lo`` is None without a window: every ``c >= 0`` passes it).
    With per-thread column offsets known at trace time, one compare per bound and score replaces the
    key-index arithmetic."""
    hi = kv_len - 1 - j0
    if causal:
        hi = cutlass.min(hi, qpos - j0)
    lo = None
    if use_window:  # (window clamped to kv_len as in visible(): no int32 wrap for window_left up to 2^31 - 1)
        lo = cutlass.select_(window_left >= 0, qpos - cutlass.min(window_left, kv_len) - j0, Int32(-1))
    return lo, hi


def num_right_masked(blk_lo, n_blk, kv_len, pos_first, tile_n: int, *, causal: bool):
    """Of the KV blocks ``[blk_lo, blk_lo + n_blk)`` of ``tile_n`` keys, how many -- counted from the right,
    the order the kernels walk them -- need the sequence-end or causal mask for a tile whose first query
    sits at bottom-right position ``pos_first``: block ``n`` does when its last key ``(n + 1) * tile_n - 1``
    is past ``min(kv_len, pos_first + 1) - 1`` (the condition of a kernel's per-block check), i.e. for
    ``n >= min(kv_len, pos_first + 1) // tile_n`` (0 when that is negative)."""
    lim1 = kv_len
    if causal:
        lim1 = cutlass.min(lim1, pos_first + 1)
    first = cutlass.max(cutlass.max(lim1, 0) // tile_n, blk_lo)
    return cutlass.min(cutlass.max(blk_lo + n_blk - first, 0), n_blk)


def custom_row_bit(mask_off, qtok, kv_len):
    """First bit of query token ``qtok``'s row in a packed custom mask (FlashInfer's ``packed_custom_mask``:
    little-endian bits, 1 = visible, the request's segment starting at bit ``mask_off``, rows of ``kv_len``
    bits).  ``qtok`` must be a valid query token of the request (callers clamp padding rows)."""
    return Int64(mask_off) + Int64(qtok) * kv_len


def custom_visible(mMask, row_bit, kv_len, j):
    """Whether key ``j`` is visible in the custom-mask row starting at bit ``row_bit``
    (:func:`custom_row_bit`); keys past the request read the row's last bit (they are masked by
    :func:`visible` anyway)."""
    bit = row_bit + cutlass.min(j, kv_len - 1)
    byte = Int32(mMask[bit >> 3])
    return ((byte >> Int32(bit & 7)) & 1) != 0


@cute.jit
def kv_block_range(row0, qo_len, kv_len, window_left, group_size: cutlass.Constexpr, tile_m: cutlass.Constexpr,
                   tile_n: cutlass.Constexpr, causal: cutlass.Constexpr, use_window: cutlass.Constexpr):
    """``(blk_lo, n_blk)``: the ``tile_n``-token KV blocks ``[blk_lo, blk_lo + n_blk)`` holding every key some
    row of the tile starting at packed row ``row0`` can see (the device twin of
    :func:`cutedsl_attn.planning.prefill.tile_kv_range`); ``n_blk`` is 0 when no row sees a key."""
    G = group_size
    last_row = cutlass.min(row0 + tile_m, qo_len * G) - 1
    hi = kv_len
    if const_expr(causal):
        hi = cutlass.min(kv_len, last_row // G + kv_len - qo_len + 1)
    lo = Int32(0)
    if const_expr(use_window):
        if window_left >= 0:
            lo = cutlass.max(row0 // G + kv_len - qo_len - cutlass.min(window_left, kv_len), 0)
    hi = cutlass.max(hi, 0)
    blk_lo = lo // tile_n
    n_blk = cutlass.max((hi + tile_n - 1) // tile_n - blk_lo, 0)
    return blk_lo, n_blk
