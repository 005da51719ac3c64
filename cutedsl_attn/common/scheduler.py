"""Tile scheduler over a prefill work table (:mod:`cutedsl_attn.planning.prefill`): which tile a CTA runs next.

A tile is one (work row, kv head) pair, numbered ``t = work row + W * kv head`` for ``W`` work rows (work row
fastest: the CTAs in flight share one kv head's K/V through L2), or by sections of kv heads (``section_tokens``).
One CTA per tile, or a persistent grid whose CTAs claim tiles from an atomic counter in the table's
``W_SCHED`` column, or take every ``gridDim.x``-th tile (:meth:`TileScheduler.next_static`: no claims, every
warp of a CTA derives the same sequence). Device code only (called while a kernel is traced), except
:meth:`TileScheduler.grid`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from ..planning.prefill import W_SCHED
from . import ptx


class TileScheduler:
    """Grid, first tile, claim and advance over the ``W x kv heads`` tiles of a work table ``mWork`` and K ``mK``.

    A persistent grid has at most ``persistent_ctas`` CTAs (:meth:`grid`): CTA ``i`` starts with tile ``i`` and then
    claims the next unclaimed one (:meth:`claim_begin` / :meth:`claim_end`), so tiles start in the same order as with
    one CTA per tile; or, statically, runs tiles ``i + k * gridDim.x`` (:meth:`next_static`).
    ``section_tokens > 0``: tiles go out in sections of ``S = section_tokens // kv_tokens`` kv heads (clamped to
    ``[1, kv heads]``, the remainder heads joining the last section), rows of a section in the table's order with
    its heads fastest (:meth:`coords`); ragged K only, whose rows are its token count.
    """

    def __init__(self, mWork, mK, *, paged: bool, section_tokens: int = 0, num_kv_heads=None):
        self.mK, self.paged = mK, paged
        self._num_kv_heads = num_kv_heads  # (given: a kernel that holds no plain K tensor, only its TMA view)
        self.W = mWork.shape[0]
        self.num_tiles = self.W * self.num_kv_heads()
        self.section_tokens = section_tokens

    def num_kv_heads(self):
        """K's kv-head count (``mK``: ragged ``[tokens, kv heads, D]``, paged ``[pages, page_size, kv heads, D]``),
        or the ``num_kv_heads`` given."""
        if self._num_kv_heads is not None:
            return self._num_kv_heads
        return self.mK.shape[2 if self.paged else 1]

    # immutable to the DSL's dynamic control flow (which treats a method call as a write): its values are
    # defined where it is made, so nothing needs carrying
    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    @staticmethod
    def grid(num_work_rows, num_kv_heads, persistent_ctas: int = 0):
        """The launch grid: ``(W, kv heads, 1)`` with one CTA per tile, ``(min(tiles, persistent_ctas), 1, 1)``
        for a persistent grid."""
        if persistent_ctas > 0:
            return (cutlass.min(num_work_rows * num_kv_heads, persistent_ctas), 1, 1)
        return (num_work_rows, num_kv_heads, 1)

    def first_tile(self, bx, by):
        """The CTA's first tile (``blockIdx.x + W * blockIdx.y``)."""
        return bx + self.W * by

    @staticmethod
    def next_static(t):
        """Static persistent schedule: the CTA's tile after ``t``, ``t + gridDim.x`` (CTA ``i`` runs tiles ``i``,
        ``i + G``, ``i + 2 G``, .. of a grid of ``G``: the first wave is the one-CTA-per-tile order)."""
        return t + cute.arch.grid_dim()[0]

    @cute.jit
    def claim_begin(self, mWork):
        """Persistent grid, one warp: lane 0 claims the next tile with ``atomicAdd(counter, 1)`` on ``mWork``'s
        counter; the value is read only by :meth:`claim_end`, so the atomic's round trip can hide behind the
        caller's loads in between.  (``mWork`` passed again, not kept: as an argument the DSL re-binds it here.)"""
        v = Int32(0)
        if cute.arch.lane_idx() == 0:
            v = ptx.atomic_add_global_u32(mWork.iterator.toint() + W_SCHED * 4, 1)
        return v

    @cute.jit
    def claim_end(self, mWork, v):
        """The claimed tile, ``gridDim.x + v``, to the whole warp (the next tile; ``>= num_tiles``: none left).
        Every CTA claims until it gets a tile past the end, so the claims number ``num_tiles`` and the one that
        returned ``num_tiles - 1`` is the launch's last: it resets the counter to 0 for the next launch."""
        if cute.arch.lane_idx() == 0:
            if v == self.num_tiles - 1:
                ptx.st_global_u32(mWork.iterator.toint() + W_SCHED * 4, 0)
        return cute.arch.grid_dim()[0] + cute.arch.shuffle_sync(v, 0)

    @cute.jit
    def coords(self, t):
        """(work row, kv head) of tile ``t``: ``(t % W, t // W)``, or with sections of S kv heads: section
        ``t // (W * S)`` (the last one also takes the remainder heads), inside it work row ``idx // s`` of kv head
        ``h0 + idx % s``."""
        W = self.W
        res = (t % W, t // W)
        if const_expr(self.section_tokens > 0):
            hkv = self.num_kv_heads()  # (ragged: K's rows are its token count)
            sec_heads = cutlass.max(cutlass.min(Int32(self.section_tokens) // cutlass.max(self.mK.shape[0], 1), hkv), 1)
            n_sec = hkv // sec_heads
            sec = cutlass.min(t // (W * sec_heads), n_sec - 1)
            h0 = sec * sec_heads
            s_eff = sec_heads
            if sec == n_sec - 1:
                s_eff = hkv - h0
            idx = t - h0 * W
            res = (idx // s_eff, h0 + idx % s_eff)
        return res
