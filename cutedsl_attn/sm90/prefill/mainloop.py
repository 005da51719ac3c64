"""The consumer warpgroups' main loop of the SM90 prefill kernel: S = Q K^T, block softmax, O += P V per KV block.

KV blocks run right to left (the block needing the sequence-end / causal mask first).  Within a warpgroup the S
GEMM of block ``j + 1`` is issued with the P V GEMM of block ``j`` and the softmax of ``j + 1`` runs while P V is
in flight; between warpgroups the GEMM issue is handed round (ping-pong, FA3's schedule), so one warpgroup's
softmax overlaps the others' GEMMs.  A mixin of :class:`~cutedsl_attn.sm90.prefill.kernel.Sm90PrefillKernel`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from ...common import masks
from ...common import softmax as sm
from ...common.smem import transpose_view
from ...planning.prefill import W_BATCH, W_KV_LEN, W_MASK_OFF, W_QO_LEN, W_ROW0
from .barriers import Barrier, barrier_id


class Mainloop:
    """One tile of a consumer warpgroup: the first S, the main-loop blocks, the last P V, then the epilogue."""

    @cute.jit
    def _consume(self, sched, mO, tma_O, tma_atom_O, sO_layout, mLSE, mSinks, mMask, sQ, sQ_addr, sK, sV, pipe_q,
                 q_state, s_tile, pipe_k, pipe_v, tiled_mma_qk, tiled_mma_pv,
                 mWork, tile, wi, kvh, blk_lo, n_blk, sm_scale, soft_cap, window_left, output_scale, tid, wg, state,
                 pin_bar=None):
        """Consumer warpgroups, tile ``tile`` (work row ``wi``, kv head ``kvh``; its Q has landed).  Q is released
        to the producer after the last S GEMM, so the next tile's Q loads during the last P V and the epilogue
        (with a staged epilogue after it, which writes O into Q's rows: the next Q then needs a second Q stage to
        load early).  ``state``: the K/V ring position, carried from tile to tile; returned advanced.
        ``pin_bar``: the dummy mbarrier of ``pins_pv_wait`` (else None)."""
        row0 = self._field(mWork, wi, W_ROW0, s_tile, q_state)
        qo_len = self._field(mWork, wi, W_QO_LEN, s_tile, q_state)
        kv_len = self._field(mWork, wi, W_KV_LEN, s_tile, q_state)
        TM, TN, DV, G = self.TM, self.TN, self.DV, self.G
        wg_layout = cute.make_layout(self.NWG, stride=128)
        wg_mma_qk = tiled_mma_qk.get_slice(wg_layout(wg))
        wg_mma_pv = tiled_mma_pv.get_slice(wg_layout(wg))
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        if const_expr(self.QS > 1):
            tSrQ = tSrQ[None, None, None, q_state.index]
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(transpose_view(sV)))
        acc_S = cute.make_rmem_tensor(wg_mma_qk.partition_shape_C((TM, TN)), Float32)
        acc_O = cute.make_rmem_tensor(wg_mma_pv.partition_shape_C((TM, DV)), Float32)
        tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((TM, TN)))
        acc_O.fill(0.0)
        acc_S.fill(0.0)  # defined input of the first (non-accumulating) S GEMM: no live range across tiles

        lane = tid % 32
        warp = tid // 32  # consumer warp: rows warp*16 .. +16 of the tile
        g = lane // 4
        t = lane % 4
        st = sm.SoftmaxState()
        qpos = cute.make_rmem_tensor((2,), Int32)
        row_bit = cute.make_rmem_tensor((2,), cutlass.Int64)  # custom mask: first bit of each row's mask
        for h in cutlass.range_constexpr(2):
            st.reset_row(h)
            qpos[h] = (row0 + warp * 16 + g + 8 * h) // G + kv_len - qo_len
            if const_expr(self.use_custom_mask):  # padding rows read the request's last row
                qtok = cutlass.min((row0 + warp * 16 + g + 8 * h) // G, qo_len - 1)
                row_bit[h] = masks.custom_row_bit(self._field(mWork, wi, W_MASK_OFF, s_tile, q_state), qtok, kv_len)
        mask = (mMask, row_bit)
        if const_expr(self.score_mod is not None):
            # score_mod's indices of the lane's two rows: request, query head and (qpos) the query's bottom-right
            # position on the key axis
            q_head = cute.make_rmem_tensor((2,), Int32)
            for h in cutlass.range_constexpr(2):
                q_head[h] = kvh * G + (row0 + warp * 16 + g + 8 * h) % G
            mask = (mMask, row_bit, self._field(mWork, wi, W_BATCH, s_tile, q_state), q_head, qpos)

        sc_in, sc_out = sm.logit_scales(sm_scale, soft_cap, self.use_soft_cap, self.score_mod is not None)
        # first / last query position of the tile (blocks ending before the first need no causal mask)
        pos_first = row0 // G + kv_len - qo_len
        pos_last = (cutlass.min(row0 + TM, qo_len * G) - 1) // G + kv_len - qo_len

        # the epilogue's coordinates where read early (TileInfo.*_EARLY), in either branch below (a placeholder
        # first: the DSL needs the values defined ahead of a dynamic branch that assigns them)
        epi = (Int32(0),) * 6
        if n_blk > 0:
            n = blk_lo + n_blk - 1
            self._first_s(tiled_mma_qk, acc_S, tSrQ, tSrK, pipe_k, state, wg, mMask, tile, tid)
            warpgroup.wait_group(0)
            self._stamp(mMask, tile, 4 * wg + 1, tid % 128 == 0)
            pipe_k.consumer_release(state)
            self._softmax_block(acc_S, st, n * TN, kv_len, qpos, pos_first, pos_last, sc_in, sc_out, window_left, t,
                                mask, "dynamic")
            self._to_p(acc_S, tOrP)
            blk = (acc_S, acc_O, tOrP, tSrQ, tSrK, tOrVt, tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, st,
                   kv_len, qpos, pos_first, pos_last, sc_in, sc_out, window_left, t, mask, wg, pin_bar)
            if const_expr(self.loop_split):
                # the blocks needing the sequence-end / causal mask (counted from the right), then the rest
                n_r = n_blk  # (a custom mask masks every block)
                if const_expr(not self.use_custom_mask):
                    n_r = masks.num_right_masked(blk_lo, n_blk, kv_len, pos_first, TN, causal=self.mask_causal)
                n_r = cutlass.max(n_r, 1)
                for i in cutlass.range(n_r - 1, unroll=1):
                    state = self._mainloop_block(*blk, state, blk_lo, n_blk, 2, i, "all")
                for i in cutlass.range(n_blk - n_r, unroll=1):
                    state = self._mainloop_block(*blk, state, blk_lo, n_blk, n_r + 1, i, "window")
            else:
                for i in cutlass.range(n_blk - 1, unroll=1):
                    state = self._mainloop_block(*blk, state, blk_lo, n_blk, 2, i, "dynamic")
            if const_expr(not self.smem_epilogue):
                if const_expr(self.epi_coords_early):
                    epi = self._epi_coords(sched, mWork, tile, tid, s_tile, q_state)
                    if const_expr(self.tile_info_smem):
                        cute.arch.sync_warp()  # every lane's reads of the Q stage's fields before lane 0's release
                pipe_q.consumer_release(q_state)  # the last S GEMM is complete
            if const_expr(self.rescale_o_before_pv):
                self._rescale_o(acc_O, st)
            pipe_v.consumer_wait(state)
            self._proxy_fence()
            self._turn_begin(wg)
            self._gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, state.index], False)
            self._turn_end(wg)
            warpgroup.wait_group(0)
            self._stamp(mMask, tile, 4 * wg + 2, tid % 128 == 0)
            pipe_v.consumer_release(state)
            state.advance()
        else:
            # no GEMM read Q; the warp's lanes have all read the tile index (s_tile) before lane 0's release
            # lets the producer overwrite it (with early coordinates also the fields read here)
            if const_expr(self.epi_coords_early and not self.smem_epilogue):
                epi = self._epi_coords(sched, mWork, tile, tid, s_tile, q_state)
            cute.arch.sync_warp()
            if const_expr(not self.smem_epilogue):
                pipe_q.consumer_release(q_state)
        self._tile_epilogue(sched, mO, tma_O, tma_atom_O, sO_layout, mLSE, mSinks, mMask, mWork, sQ_addr, pipe_q,
                            q_state, s_tile, acc_O, st, tile, tid, wg, epi, output_scale)
        return state

    @cute.jit
    def _first_s(self, tiled_mma_qk, acc_S, tSrQ, tSrK, pipe_k, state, wg, mMask, tile, tid):
        """Issue a tile's first S GEMM (its last K block, stage ``state``) in the warpgroup's ping-pong turn;
        the caller waits."""
        pipe_k.consumer_wait(state)
        self._proxy_fence()
        self._turn_begin(wg)
        self._stamp_fine(mMask, tile, 15, tid)
        self._gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], True)
        self._turn_end(wg)

    @cute.jit
    def _mainloop_block(self, acc_S, acc_O, tOrP, tSrQ, tSrK, tOrVt, tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v,
                        st, kv_len, qpos, pos_first, pos_last, sc_in, sc_out, window_left, t,
                        mask, wg, pin_bar, state, blk_lo, n_blk, skip, i, mask_mode: cutlass.Constexpr):
        """One main-loop block, ``n = blk_lo + n_blk - skip - i`` (``state``: the K stage of the previous block;
        returned advanced): S of this block and P V of the previous one issued together in this warpgroup's
        ping-pong turn, this block's softmax while P V runs.  ``mask_mode``: see :meth:`_softmax_block`."""
        state_v = state.clone()
        state.advance()
        n = blk_lo + n_blk - skip - i
        pipe_k.consumer_wait(state)
        if const_expr(not self.v_wait_late):
            pipe_v.consumer_wait(state_v)
        self._proxy_fence()
        self._turn_begin(wg)
        self._gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], True)
        if const_expr(self.rescale_o_before_pv):  # the previous block's factor, while S is in flight
            self._rescale_o(acc_O, st)
        if const_expr(self.v_wait_late):  # (LoopOrder.SPLIT_LATE_V: V waited for inside the turn, after S)
            pipe_v.consumer_wait(state_v)
            self._proxy_fence()
        self._gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, state_v.index], False)
        self._turn_end(wg)
        warpgroup.wait_group(1)
        stale = const_expr(self.stale_max and mask_mode != "all")
        # p_tail: blocks that are never masked (the split loop's unmasked part without a window) convert all but
        # the last p_tail n8 tiles of P while those tiles' exponentials run (P V waited for there)
        early = const_expr(stale and self.p_tail > 0 and mask_mode == "window" and not self.use_window)
        n_early = self.TN // 8 - self.p_tail
        pin = const_expr(early and self.pins_pv_wait)
        n_wait = max(1, n_early - self.p_wait_lead)
        if const_expr(early):
            def after_tile(j, l_run):
                if const_expr(j == (n_wait if pin else n_early) - 1):
                    if const_expr(pin):
                        self._pin_arrive(pin_bar, l_run[0] + l_run[1], sc_in)
                    warpgroup.wait_group(0)
                    if const_expr(pin):
                        pipe_v.consumer_release(state_v)  # (after the wait: P V has read the stage)
                    self._to_p(acc_S, tOrP, 0, 2 * (j + 1))
                elif const_expr(pin and n_wait <= j < n_early):
                    self._to_p(acc_S, tOrP, 2 * j, 2 * (j + 1))

            redo = st.stale_step(acc_S, self.TN // 8, sc_in, lambda b: self._wg_any(b, wg), after_tile,
                                 running_sums=pin)
        else:
            redo = self._softmax_block(acc_S, st, n * self.TN, kv_len, qpos, pos_first, pos_last, sc_in, sc_out,
                                       window_left, t, mask, mask_mode, stale, wg)
        if const_expr(stale):
            if redo:  # a row's max moved too far (warpgroup-uniform: _wg_any): S again from the still-held K stage
                # and the exact step (issued outside the ping-pong turn: a rare path)
                self._gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], True)
                warpgroup.wait_group(0)
                self._exact_block(acc_S, st, n * self.TN, kv_len, qpos, window_left, t, mask, sc_in, sc_out, False)
                if const_expr(early):
                    self._to_p(acc_S, tOrP, 0, 2 * n_early)  # the exact P of those tiles
        # ptxas keeps the wait for P V right behind this arrive and hoists the arrive as far as its inputs allow,
        # so released after the softmax, part of the exponentials run while P V is in flight (released earlier,
        # only the row max did; pinned to the row sums, all of them: both slower, perf/RESULTS.md "Prefill: SM90
        # kernel"); p_tail's mid-softmax wait is pinned on purpose (_pin_arrive)
        pipe_k.consumer_release(state)
        # (with p_tail waited for already; without this second wait ptxas builds the next turn's GEMM descriptors
        # in vector registers and moves them over with R2UR)
        warpgroup.wait_group(0)
        if const_expr(not pin):
            pipe_v.consumer_release(state_v)
        if const_expr(not self.rescale_o_before_pv):
            self._rescale_o(acc_O, st)
        self._to_p(acc_S, tOrP, 2 * n_early if early else 0)  # (early: the tail tiles' words only)
        return state

    @cute.jit
    def _pin_arrive(self, bar, x, positive):
        """``pins_pv_wait``: lane 0 arrives on the dummy mbarrier ``bar`` (count 1: every arrive completes a phase;
        nothing waits on it) once ``x`` (a sum of probabilities: never negative) is computed -- ptxas keeps the
        wgmma wait that follows behind an mbarrier arrive and the arrive behind its inputs, so the wait for P V
        stays after the exponentials ``x`` sums (the V stage itself is released after the wait: P V reads it
        until then).  The predicate, ``not x < -positive`` (a run-time value > 0, the stale softmax's logit
        scale), always holds (NaN too) but is not provable: against a constant 0 ptxas folds it (it knows
        ``ex2`` is never negative) and moves the arrive up to the first exponentials."""
        if cute.arch.lane_idx() == 0:
            if not (x < -positive):
                cute.arch.mbarrier_arrive(bar)

    @cute.jit
    def _rescale_o(self, acc_O, st):
        """O rows times the softmax state's factors; with ``rescale_threshold`` or the stale softmax only where
        some row of the warp moved its max (a factor other than exactly 1; a warp-uniform branch)."""
        if const_expr(self.rescale_threshold > 0 or self.stale_max):
            if cute.arch.vote_any_sync((st.scale[0] != Float32(1.0)) | (st.scale[1] != Float32(1.0))):
                st.rescale(acc_O, self.DV // 8)
        else:
            st.rescale(acc_O, self.DV // 8)

    @cute.jit
    def _proxy_fence(self):
        """Paged K/V arrive through cp.async (generic proxy); wgmma reads shared memory through the async
        proxy: order the two after the full-barrier wait."""
        if const_expr(self.paged):
            cute.arch.fence_view_async_shared()

    @cute.jit
    def _turn_begin(self, wg):
        """Ping-pong: wait until the previous warpgroup has issued its GEMMs (its ``TURN`` barrier)."""
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=barrier_id(Barrier.TURN, wg, self.NWG), number_of_threads=256)

    @cute.jit
    def _turn_end(self, wg):
        """Ping-pong: hand the tensor cores to the next warpgroup."""
        if const_expr(self.pingpong):
            nxt = Int32(cutlass.select_(wg == self.NWG - 1, 0, wg + 1))
            cute.arch.barrier_arrive(barrier_id=barrier_id(Barrier.TURN, nxt, self.NWG), number_of_threads=256)

    @cute.jit
    def _gemm(self, tiled_mma, acc, tA, tB, zero_init):
        """Issue one warpgroup GEMM (k-blocks unrolled) and commit it; the caller waits.  ``zero_init``
        (static or dynamic) overwrites ``acc`` instead of accumulating: the accumulators are only ever
        written by wgmma between pipeline stages, so ptxas keeps the wgmma pipeline (no serialisation)."""
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for k in cutlass.range_constexpr(cute.size(tA.shape[2])):
            cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
