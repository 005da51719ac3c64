"""Block softmax of the SM90 prefill consumers: scale, mask and exponentiate one S block, and convert P.

The lane's scores are the wgmma accumulator of one warp, the ``mma.m16n8`` C layout repeated over n8 tiles, so
the online softmax of :mod:`cutedsl_attn.common.softmax` applies (its state: a ``SoftmaxState``).  A mixin of
:class:`~cutedsl_attn.sm90.prefill.kernel.Sm90PrefillKernel`, whose attributes it reads.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ...common import masks, ptx
from ...common import softmax as sm
from ...common.constants import NEG_INF
from .barriers import Barrier, barrier_id


class BlockSoftmax:
    """Softmax of one S block (exact or against a stale max), its masks, and the P conversion."""

    @cute.jit
    def _softmax_block(self, acc_S, st, tok0, kv_len, qpos, pos_first, pos_last, sc_in, sc_out,
                       window_left, t, mask, mask_mode: cutlass.Constexpr, stale: cutlass.Constexpr = False, wg=None):
        """Scale and mask S of the block starting at KV token ``tok0``, then the online softmax step on ``st``
        (:class:`~cutedsl_attn.common.softmax.SoftmaxState`; its ``scale`` receives the factor for the O rows).  ``mask_mode``: ``"dynamic"`` masks where the block
        needs it (sequence end, causal diagonal, window; every block with a custom mask: ``mask = (mMask,
        row_bit)``); ``loop_split``'s ``"all"`` always, and ``"window"`` only where the sliding window cuts
        the block (no mask code at all without a window or custom mask).  ``stale`` (``Softmax.STALE``): a block
        needing no mask takes :func:`~cutedsl_attn.common.softmax.stale_max_step`; returns its redo flag (False where the
        block took the exact step), agreed by the warpgroup ``wg`` (the redo is a warpgroup GEMM):
        :meth:`_wg_any`."""
        TN = self.TN
        n8 = TN // 8
        if const_expr(mask_mode == "all" or self.use_custom_mask):
            need_mask = True
        elif const_expr(mask_mode == "window"):
            need_mask = False
            if const_expr(self.use_window):
                need_mask = self._window_cuts(tok0, pos_last, window_left, kv_len)
        else:
            need_mask = tok0 + TN > kv_len
            if const_expr(self.mask_causal):
                need_mask = need_mask | (tok0 + TN - 1 > pos_first)
            if const_expr(self.use_window):
                need_mask = need_mask | self._window_cuts(tok0, pos_last, window_left, kv_len)
        exact = (acc_S, st, tok0, kv_len, qpos, window_left, t, mask, sc_in, sc_out)
        redo = cutlass.Boolean(False)
        if const_expr(stale and isinstance(need_mask, bool)):  # "window" mode without a window: never masked
            redo = st.stale_step(acc_S, n8, sc_in, lambda b: self._wg_any(b, wg))
        elif const_expr(stale):  # (plain logits: no soft cap / score_mod / custom mask, Config)
            if need_mask:
                self._exact_block(*exact, True)
            else:
                redo = st.stale_step(acc_S, n8, sc_in, lambda b: self._wg_any(b, wg))
        else:
            self._exact_block(*exact, need_mask)
        return redo

    @cute.jit
    def _exact_block(self, acc_S, st, tok0, kv_len, qpos, window_left, t, mask, sc_in, sc_out, need_mask):
        """The exact online softmax step (row max first) of the block starting at KV token ``tok0``, after the
        soft cap / ``score_mod`` and, where ``need_mask``, the masks (:meth:`_mask_scores`)."""
        n8 = self.TN // 8
        if need_mask:
            self._mask_scores(acc_S, tok0, kv_len, qpos, window_left, t, mask, sc_in, sc_out)
        else:
            if const_expr(self.use_soft_cap):
                for i in cutlass.range_constexpr(4 * n8):
                    acc_S[i] = ptx.tanh(acc_S[i] * sc_in) * sc_out
            if const_expr(self.score_mod is not None):
                for j in cutlass.range_constexpr(n8):
                    for e in cutlass.range_constexpr(4):
                        acc_S[4 * j + e] = self._score_mod(acc_S[4 * j + e], sc_in, mask, e // 2,
                                                           tok0 + 2 * t + j * 8 + (e % 2))
        # without a soft cap S stays raw and the scale is folded into the exponent (fma + ex2); with a score_mod
        # the logits are in natural-log units and log2(e) is folded there
        logit_scale = None if self.use_soft_cap else (sc_out if self.score_mod is not None else sc_in)
        st.online_step(acc_S, n8, logit_scale, self.rescale_threshold)

    def _wg_any(self, pred, wg):
        """Whether ``pred`` holds in any thread of consumer warpgroup ``wg`` (``bar.red.or`` on its ``ANY`` barrier)."""
        bar = barrier_id(Barrier.ANY, wg, self.NWG)
        return ptx.barrier_or(cutlass.select_(pred, Int32(1), Int32(0)), bar, 128) != Int32(0)

    @cute.jit
    def _mask_scores(self, acc_S, tok0, kv_len, qpos, window_left, t, mask, sc_in, sc_out):
        """Soft cap / ``score_mod`` and the masks of a block's scores (-inf where hidden)."""
        n8 = self.TN // 8
        # the lane's scores of row h are keys tok0 + 2t + c with c = 8j + (e % 2) known at trace time:
        # one compare per bound and score (visible_range), no per-score key arithmetic
        bounds = [masks.visible_range(tok0 + 2 * t, kv_len, qpos[h], window_left, causal=self.mask_causal,
                                      use_window=self.use_window) for h in range(2)]
        for j in cutlass.range_constexpr(n8):
            for e in cutlass.range_constexpr(4):
                h = e // 2
                c = j * 8 + (e % 2)
                lo, hi = bounds[h]
                x = acc_S[4 * j + e]
                if const_expr(self.use_soft_cap):
                    x = ptx.tanh(x * sc_in) * sc_out
                if const_expr(self.score_mod is not None):
                    x = self._score_mod(x, sc_in, mask, h, tok0 + 2 * t + c)
                ok = hi >= c
                if const_expr(lo is not None):
                    ok = ok & (lo <= c)
                if const_expr(self.use_custom_mask):
                    ok = ok & masks.custom_visible(mask[0], mask[1][h], kv_len, tok0 + 2 * t + c)
                acc_S[4 * j + e] = Float32(cutlass.select_(ok, x, Float32(NEG_INF)))

    def _score_mod(self, x, sc_in, mask, h: int, kv_idx):
        """``score_mod`` of one raw score of the lane's row ``h`` (indices from ``mask``: :meth:`_consume`), in
        natural-log units (``sc_out = log2 e`` is folded into the exponent)."""
        return sm.score_mod_logit(self.score_mod, x, sc_in, mask[2], mask[3][h], mask[4][h], kv_idx)

    def _window_cuts(self, tok0, pos_last, window_left, kv_len):
        """Whether the sliding window (``window_left >= 0``, clamped to ``kv_len`` as in :mod:`cutedsl_attn.common.masks`)
        hides some key of the block starting at ``tok0`` from the tile's last query (at ``pos_last``)."""
        return (window_left >= 0) & (tok0 < pos_last - cutlass.min(window_left, kv_len))

    @cute.jit
    def _to_p(self, acc_S, tOrP, lo: int = 0, hi: int = -1):
        """P (fp32 accumulator registers) -> the 16-bit A fragment of the P V GEMM (same register order),
        two values per ``cvt.rn.bf16x2`` / ``cvt.rn.f16x2`` (inline PTX: LLVM cannot duplicate or sink the conversion, which
        in the persistent tile loop it did, keeping S and P live together and running out of registers)."""
        n = cute.size(acc_S)
        s_flat = cute.make_tensor(acc_S.iterator, cute.make_layout(n))
        p_words = cute.make_tensor(cute.recast_ptr(tOrP.iterator, dtype=Int32), cute.make_layout(n // 2))
        for i in cutlass.range_constexpr(lo, n // 2 if hi < 0 else hi):  # (words lo .. hi - 1: p_tail)
            p_words[i] = ptx.pack2(s_flat[2 * i], s_flat[2 * i + 1], self.dtype)
