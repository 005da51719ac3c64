"""The softmax warpgroups of the SM100 prefill kernel: per KV block, S from TMEM, the logits (soft cap or
``score_mod``), the masks, the online max and sum, and the 16-bit P back to TMEM.

One thread owns one packed row (its TMEM lane) and holds the block's ``tile_n`` scores, their key offsets known at
trace time, so each mask bound is one compare per score (:func:`cutedsl_attn.common.masks.visible_range`); the
logit scales, the ``score_mod`` call and the custom-mask bits are those of :mod:`cutedsl_attn.common.softmax` and
:mod:`cutedsl_attn.common.masks`, as in the SM90 and portable kernels.  A mixin of
:class:`~cutedsl_attn.sm100.prefill.kernel.Sm100PrefillKernel`, whose attributes it reads.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, const_expr
from cutlass.cute.nvgpu import tcgen05

from ...common import masks, ptx
from ...common import softmax as sm
from ...common.constants import LOG2E, NEG_INF
from ...common.tcgen05 import fence_after_sync, fence_before_sync, state_at
from ...planning.prefill import W_MASK_OFF


def _plus(base, x):
    """``base + x``; ``x`` itself for a base of trace-time 0 (one CTA per tile: that build's code is unchanged)."""
    return x if isinstance(base, int) and base == 0 else base + x


class SoftmaxWarpgroup:
    """The softmax warpgroup of one Q tile (:meth:`_softmax`) and its per-block logits and masks."""

    def _features(self, feat):
        """``(mMask, soft_cap, window_left, mIdx)`` from the kernel's feature arguments ``feat`` (only those the
        problem uses travel: an unused one would be a kernel parameter, and change the code of every other
        problem); None / ``Int32(-1)`` for the others."""
        it = iter(feat)
        mMask = next(it) if self.use_custom_mask else None
        soft_cap = next(it) if self.use_soft_cap else None
        window_left = next(it) if self.use_window else Int32(-1)
        mIdx = next(it) if self.paged else None
        return mMask, soft_cap, window_left, mIdx

    @cute.jit
    def _softmax(self, tmem_ptr, qk_mma, s_stats, pipe_s, pipe_p, pipe_stats, sm_scale, feat, mWork, wi, b, kvh,
                 row0, qo_len, kv_len, blk_lo, n_blk, tidx, t: cutlass.Constexpr, cnt):
        """Softmax warpgroup of Q tile ``t``: thread ``tidx`` owns packed row ``row0 + 128 t + lane`` (TMEM lane
        ``lane``): per block, its scores by ``tcgen05.ld``, the soft cap or ``score_mod``, masked where the block
        needs it, the online max and sum, P = 2^(s - max) back to TMEM as 16-bit values 32 columns at a time; the
        rescale factor of O to the correction warpgroup; at the end the row's sum and max.  ``cnt``: the kernel's
        pipeline counts before this tile (``_tiles``)."""
        nb, _, ns, _, _ = cnt
        TM, TN, G, QT = self.TM, self.TN, self.G, self.QT
        CW = 16  # P words (32 columns of 16-bit values) per tcgen05.st
        qk_thr = qk_mma.get_slice(0)
        tStS0 = self._tmem_S(tmem_ptr, qk_mma, "S0")
        ld_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32)
        tiled_ld = tcgen05.make_tmem_copy(ld_atom, tStS0)
        thr_ld = tiled_ld.get_slice(tidx)
        tLtS0 = thr_ld.partition_S(tStS0)
        s_cols, p_cols = self.tmem["S1"][0] - self.tmem["S0"][0], self.tmem["P1"][0] - self.tmem["P0"][0]
        tLcS = thr_ld.partition_D(qk_thr.partition_C(cute.make_identity_tensor((TM, TN))))
        tPc = cute.make_tensor(tmem_ptr + self.tmem["P0"][0],
                               cute.composition(tStS0.layout, cute.make_layout((TM, CW))))
        tiled_st = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(CW)), Float32), tPc)
        thr_st = tiled_st.get_slice(tidx)
        tStP0 = thr_st.partition_D(tPc)
        tScP = thr_st.partition_S(cute.make_identity_tensor((TM, CW)))

        mMask, soft_cap, window_left, _ = self._features(feat)
        if const_expr(self.use_soft_cap or self.score_mod is not None):
            # the logits come out of _logits in log2 units (soft cap: scale 1 in the exponent) or natural-log ones
            # (score_mod: log2 e there); the max is taken on them, so any sm_scale sign works
            sc_in, sc_out = sm.logit_scales(sm_scale, soft_cap, self.use_soft_cap, self.score_mod is not None)
            scale_log2 = Float32(1.0) if self.use_soft_cap else Float32(sc_out)
        else:
            sc_in, sc_out = None, None
            scale_log2 = sm_scale * Float32(LOG2E)  # raw q.k: the max is taken before the (positive) scale
        row_max = Float32(NEG_INF)
        row_sum = Float32(0.0)
        row = tLcS[0][0]  # this thread's row of the tile: its TMEM lane
        pr = row0 + t * TM + row  # packed row: token pr // G of query head kvh * G + pr % G
        qpos = pr // G + kv_len - qo_len  # the row's bottom-right position
        n_masked = n_blk  # a custom mask masks every block
        if const_expr(not self.use_custom_mask):
            n_masked = masks.num_right_masked(blk_lo, n_blk, kv_len, row0 // G + kv_len - qo_len, TN,
                                              causal=self.mask_causal)
        row_bit = None
        if const_expr(self.use_custom_mask):  # (padding rows read the request's last row)
            row_bit = masks.custom_row_bit(mWork[wi, W_MASK_OFF], cutlass.min(pr // G, qo_len - 1), kv_len)
        pos_last = None
        if const_expr(self.use_window):  # the tile's last live query (the largest window start of its rows)
            pos_last = (cutlass.min(row0 + t * TM + TM, qo_len * G) - 1) // G + kv_len - qo_len
        row_info = None
        if const_expr(self.score_mod is not None):  # score_mod's batch, query head and query position
            row_info = (b, kvh * G + pr % G, qpos)
        for i in cutlass.range(n_blk, unroll=1):
            s_state = state_at(2, _plus(nb, i) * QT + t, False)
            p_state = state_at(2, _plus(nb, i) * QT + t, True)
            st_state = state_at(QT, _plus(ns, i) * QT + t, True)
            mbits = None
            if const_expr(self.use_custom_mask):  # (read while the MMA computes S: only TN / 32 words stay live)
                mbits = self._mask_bits(mMask, row_bit, kv_len, (blk_lo + n_blk - 1 - i) * TN)
            rS = cute.make_rmem_tensor(tLcS.shape, Float32)
            pipe_s.consumer_wait(s_state)
            fence_after_sync()
            cute.copy(tiled_ld, cute.make_tensor(tLtS0.iterator + s_state.index * s_cols, tLtS0.layout), rS)
            cute.arch.fence_view_async_tmem_load()
            fence_before_sync()
            pipe_s.consumer_release(s_state)
            if const_expr(self.use_soft_cap or self.score_mod is not None):
                self._logits(rS, tLcS, sc_in, sc_out, row_info, (blk_lo + n_blk - 1 - i) * TN)
            need_mask = i < n_masked
            if const_expr(self.use_window):  # the window cuts the block for some row of the tile
                need_mask = need_mask | ((window_left >= 0) & (
                    (blk_lo + n_blk - 1 - i) * TN < pos_last - cutlass.min(window_left, kv_len)))
            if need_mask:
                self._mask(rS, tLcS, (blk_lo + n_blk - 1 - i) * TN, kv_len, qpos, window_left, mbits)
            m_new = cute.arch.fmax(row_max, rS.load().reduce(cute.ReductionOp.MAX, Float32(NEG_INF), 0))
            if const_expr(self.rescale_threshold > 0):
                # keep the running max while the block's max exceeds it by <= 2^threshold (P <= 2^threshold fits
                # 16 bits): O's factor stays 1 and the correction warpgroup skips its TMEM round trip (a row that
                # saw nothing yet, -inf, always takes the new max: the difference is +inf or NaN)
                grow = (m_new - row_max) * scale_log2
                m_new = Float32(cutlass.select_(grow <= Float32(self.rescale_threshold), row_max, m_new))
            m_use = Float32(cutlass.select_(m_new == Float32(NEG_INF), Float32(0.0), m_new))
            alpha = ptx.ex2((row_max - m_use) * scale_log2)
            pipe_stats.producer_acquire(st_state)  # (block 0's factor is not used: its P V starts O)
            s_stats[t * TM + row, 0] = alpha
            pipe_stats.producer_commit(st_state)
            row_max = m_new
            neg_m = -m_use * scale_log2
            acc = (row_sum * alpha, Float32(0.0))
            pipe_p.producer_acquire(p_state)  # the P V that read this P buffer last is done
            fence_after_sync()
            p_base = tStP0.iterator + p_state.index * p_cols
            for c in cutlass.range_constexpr(TN // 32):
                for e in cutlass.range_constexpr(32 * c, 32 * c + 32, 2):
                    x0, x1 = cute.arch.fma_packed_f32x2((rS[e], rS[e + 1]), (scale_log2, scale_log2),
                                                        (neg_m, neg_m))
                    rS[e] = ptx.ex2(x0)
                    rS[e + 1] = ptx.ex2(x1)
                    acc = cute.arch.add_packed_f32x2(acc, (rS[e], rS[e + 1]))
                rP = cute.make_rmem_tensor(tScP.shape, Float32)
                rPw = cute.recast_tensor(rP, Int32)  # the same registers, as packed 16-bit pairs
                for w in cutlass.range_constexpr(CW):
                    rPw[w] = ptx.pack2(rS[32 * c + 2 * w], rS[32 * c + 2 * w + 1], self.dtype)
                cute.copy(tiled_st, rP, cute.make_tensor(p_base + c * CW, tStP0.layout))
            row_sum = acc[0] + acc[1]
            cute.arch.fence_view_async_tmem_store()
            fence_before_sync()
            pipe_p.producer_commit(p_state)
        # final message: the row's sum and its max in log2 units (-inf: no visible key)
        st_state = state_at(QT, _plus(ns, n_blk) * QT + t, True)
        pipe_stats.producer_acquire(st_state)
        s_stats[t * TM + row, 0] = row_sum
        s_stats[t * TM + row, 1] = row_max * scale_log2
        pipe_stats.producer_commit(st_state)

    @cute.jit
    def _logits(self, rS, tLcS, sc_in, sc_out, row_info, j0):
        """Every score of the block starting at key ``j0`` made a logit: ``cap * tanh(s / cap)`` on the scaled
        score in log2 units (``sc_in`` / ``sc_out`` of :func:`~cutedsl_attn.common.softmax.logit_scales`), or the
        user's ``score_mod`` in natural-log units (``row_info``: its batch, head and query-position indices);
        masks come after, so a masked key stays -inf whatever these return."""
        for e in cutlass.range_constexpr(cute.size(rS)):
            if const_expr(self.use_soft_cap):
                rS[e] = ptx.tanh(rS[e] * sc_in) * sc_out
            if const_expr(self.score_mod is not None):
                rS[e] = sm.score_mod_logit(self.score_mod, rS[e], sc_in, row_info[0], row_info[1], row_info[2],
                                           j0 + tLcS[e][1])

    @cute.jit
    def _mask_bits(self, mMask, row_bit, kv_len, j0):
        """The custom-mask bits of this row for the block starting at key ``j0`` (FlashInfer's packed little-endian
        bits, the row at bit ``row_bit``: :func:`~cutedsl_attn.common.masks.custom_row_bit`) as ``tile_n / 32``
        Uint32 words, bit ``c % 32`` of word ``c // 32`` key ``j0 + c``'s: ``tile_n / 8 + 1`` byte loads instead of
        one per score (one per score keeps 128 loads in flight and spills).  Bytes past the row's last read its last
        byte (as ``custom_visible`` clamps; those keys are past the request, hidden by the sequence-end bound)."""
        start = row_bit + j0
        b0 = start >> 3
        last = (row_bit + kv_len - 1) >> 3
        sh = Uint32(Int32(start & 7))
        by = [Uint32(Int32(mMask[cutlass.min(b0 + k, last)])) for k in range(self.TN // 8 + 1)]
        words = []
        for w in cutlass.range_constexpr(self.TN // 32):
            lo = (by[4 * w] | (by[4 * w + 1] << Uint32(8)) | (by[4 * w + 2] << Uint32(16))
                  | (by[4 * w + 3] << Uint32(24)))
            # (the next byte's low bits on top: two shifts, as one by 32 - sh is undefined for sh = 0)
            words.append((lo >> sh) | ((by[4 * w + 4] << Uint32(1)) << (Uint32(31) - sh)))
        return words

    @cute.jit
    def _mask(self, rS, tLcS, j0, kv_len, qpos, window_left, mbits):
        """-inf for the scores of the block starting at key ``j0`` that the row at ``qpos`` cannot see: the
        sequence end, the causal diagonal (not with a custom mask, which replaces it), the sliding window (one
        compare per bound: :func:`~cutedsl_attn.common.masks.visible_range`), the custom mask's bit (``mbits``:
        :meth:`_mask_bits`)."""
        lo, hi = masks.visible_range(j0, kv_len, qpos, window_left, causal=self.mask_causal,
                                     use_window=self.use_window)
        for e in cutlass.range_constexpr(cute.size(rS)):
            c = tLcS[e][1]
            if const_expr(lo is None and not self.use_custom_mask):
                rS[e] = Float32(cutlass.select_(c <= hi, rS[e], Float32(NEG_INF)))
            else:
                ok = c <= hi
                if const_expr(lo is not None):
                    ok = ok & (lo <= c)
                if const_expr(self.use_custom_mask):
                    if const_expr(not isinstance(c, int)):
                        raise TypeError("the key offsets of a thread's scores must be known at trace time")
                    ok = ok & (((mbits[c // 32] >> Uint32(c % 32)) & Uint32(1)) != Uint32(0))
                rS[e] = Float32(cutlass.select_(ok, rS[e], Float32(NEG_INF)))
