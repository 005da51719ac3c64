"""The merges of the paged decode kernel (:mod:`cutedsl_attn.portable.paged_decode`): its warps' (m, l, O)
states through shared memory, then, for a request split across work items (split-KV), the partials of every
item by the last CTA of (request, kv head) to finish (:func:`cutedsl_attn.common.splitkv.merge_splits`, shared
with the SM100 decode kernel).

Device code only, traced as methods of :class:`~cutedsl_attn.portable.paged_decode.PagedDecodeKernel` (which
derives from :class:`DecodeMerge`).  Shared memory: per (warp, row) fp32 ``m``, ``l`` and merge weights
(``sM``, ``sL``, ``sW``), per row two fp32 (``sRow``), one flag (``sFlag``), and the K/V ring reused as the
fp32 O buffer (``sO`` / ``sBuf``) once every warp has left the main loop.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from ..common import ptx, splitkv
from ..common.constants import LOG2E, NEG_INF
from ..planning.decode import W_BATCH, W_NUM_SPLITS, W_PART_BASE, W_SPLIT_IDX


class DecodeMerge:
    """The warp merge and the split-KV merge of the paged decode kernel.  The kernel class provides ``D``
    (head_dim), ``G`` (group_size), ``NW`` (warps), ``NT`` (threads), ``kv_fp8``, ``problem`` and ``dtype``
    (the element type of O)."""

    @cute.jit
    def _merge(self, mO, mLSE, mPO, mPLSE, mCnt, mSinks, mWork, acc, row_m, row_l, sM, sL, sW, sRow, sFlag, sKV,
               wi, kvh, num_kv_heads, head0, output_scale, tidx, lane, warp):
        """Both merges with the work row read again after the main loop, so none of it stays live through the
        loop (the fp8 loop at 8 warps fits 128 registers without a spill)."""
        b = mWork[wi, W_BATCH]
        n_splits = mWork[wi, W_NUM_SPLITS]
        part0 = mWork[wi, W_PART_BASE]
        final = n_splits == 1
        self._merge_warps(mO, mLSE, mPO, mPLSE, mSinks, acc, row_m, row_l, sM, sL, sW, sKV,
                          b, part0 + mWork[wi, W_SPLIT_IDX], head0, final, output_scale, tidx, lane, warp)
        if n_splits > 1:
            self._merge_splits(mO, mLSE, mPO, mPLSE, mCnt, mSinks, sRow, sFlag, sKV,
                               b, kvh, num_kv_heads, part0, n_splits, head0, output_scale, tidx)

    @cute.jit
    def _merge_warps(self, mO, mLSE, mPO, mPLSE, mSinks, acc, row_m, row_l, sM, sL, sW, sO,
                     b, part, head0, final, output_scale, tidx, lane, warp):
        """Merge the NW warp states; write O (times ``output_scale``) and the LSE (one split) or the unscaled fp32
        partial (split-KV)."""
        D, G, NW, NT = self.D, self.G, self.NW, self.NT
        g = lane // 4
        t = lane % 4
        cute.arch.sync_threads()  # every warp is done with its K/V ring; sO aliases it
        if t == 0:
            for h in cutlass.range_constexpr(2):
                ptx.st_shared_f32(sM + (warp * 16 + g + 8 * h) * 4, row_m[h])
                ptx.st_shared_f32(sL + (warp * 16 + g + 8 * h) * 4, row_l[h])
        for dd in cutlass.range_constexpr(D // 8):
            for e in cutlass.range_constexpr(4):
                if const_expr(self.kv_fp8):  # tile dd, column n holds d = 32 (dd // 4) + 4 n + dd % 4
                    col = 32 * (dd // 4) + 8 * t + 4 * (e % 2) + dd % 4
                    ptx.st_shared_f32(sO + ((warp * 16 + g + 8 * (e // 2)) * D + col) * 4, acc[dd * 4 + e])
                else:
                    ptx.st_shared_f32(sO + ((warp * 16 + g + 8 * (e // 2)) * D + dd * 8 + 2 * t + (e % 2)) * 4,
                                      acc[dd * 4 + e])
        cute.arch.sync_threads()

        if tidx < G:
            big_m = Float32(NEG_INF)
            for w in cutlass.range_constexpr(NW):
                big_m = cute.arch.fmax(big_m, ptx.ld_shared_f32(sM + (w * 16 + tidx) * 4))
            sink_l2 = Float32(NEG_INF)
            if const_expr(self.problem.use_sinks):
                if final:
                    sink_l2 = mSinks[head0 + tidx] * LOG2E
            m_all = cute.arch.fmax(big_m, sink_l2)
            m_use = Float32(cutlass.select_(m_all == Float32(NEG_INF), Float32(0.0), m_all))
            tot = ptx.ex2(sink_l2 - m_use)
            for w in cutlass.range_constexpr(NW):
                tot = tot + ptx.ld_shared_f32(sL + (w * 16 + tidx) * 4) * ptx.ex2(
                    ptx.ld_shared_f32(sM + (w * 16 + tidx) * 4) - m_use)
            inv = Float32(cutlass.select_(tot > Float32(0.0), ptx.rcp(tot), Float32(0.0)))
            # the output scale rides on the merge weights of the final write only: a partial stays unscaled
            w_scale = inv * Float32(cutlass.select_(final, output_scale, Float32(1.0)))
            for w in cutlass.range_constexpr(NW):
                ptx.st_shared_f32(sW + (w * 16 + tidx) * 4,
                                  ptx.ex2(ptx.ld_shared_f32(sM + (w * 16 + tidx) * 4) - m_use) * w_scale)
            lse = Float32(cutlass.select_(tot > Float32(0.0), m_use + ptx.lg2(tot), Float32(NEG_INF)))
            if final:
                mLSE[b, head0 + tidx] = lse
            else:
                mPLSE[part, head0 + tidx] = lse
        cute.arch.sync_threads()

        for e in cutlass.range((G * D + NT - 1 - tidx) // NT, unroll=1):
            idx = tidx + e * NT
            r = idx // D
            d = idx % D
            o = Float32(0.0)
            for w in cutlass.range_constexpr(NW):
                o = o + ptx.ld_shared_f32(sW + (w * 16 + r) * 4) * ptx.ld_shared_f32(sO + ((w * 16 + r) * D + d) * 4)
            if final:
                mO[b, head0 + r, d] = o.to(self.dtype)
            else:
                mPO[part, head0 + r, d] = o

    def _merge_splits(self, mO, mLSE, mPO, mPLSE, mCnt, mSinks, sRow, sFlag, sBuf, b, kvh, num_kv_heads, part0,
                      n_splits, head0, output_scale, tidx):
        """Split-KV: :func:`cutedsl_attn.common.splitkv.merge_splits` with this kernel's head_dim, group size,
        thread count and sinks."""
        splitkv.merge_splits(mO, mLSE, mPO, mPLSE, mCnt, mSinks, sRow, sFlag, sBuf, b, kvh, num_kv_heads, part0,
                             n_splits, head0, output_scale, tidx, head_dim=self.D, group_size=self.G,
                             num_threads=self.NT, use_sinks=self.problem.use_sinks)
