"""The producer warpgroup of the SM90 prefill kernel: hands each tile's Q to the consumers and streams its K/V.

Warp 0 publishes the tile index (and with ``TileInfo.SMEM*`` its work-table fields) in shared memory and loads
the tile's packed Q rows by TMA, one box per 64 columns (Q viewed as ``((group, tokens), dim, kv_heads)``).
Ragged K/V: warp 0 streams ``tile_n``-token K and V blocks by TMA into a ``num_stages`` ring (one mbarrier
pipeline each).  Paged K/V: a full block of whole pages (or inside one page) loads by TMA per page; the block
holding the request's end, and every block for pages of fewer than 16 rows, is gathered by all 128 threads with
``cp.async`` into the same swizzled layout, zero past the request.  KV blocks go right to left.  A mixin of
:class:`~cutedsl_attn.sm90.prefill.kernel.Sm90PrefillKernel`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import const_expr
from cutlass.cute.nvgpu import cpasync

from ...common import paging, ptx
from ...common.smem import sw128_offset
from ...planning.prefill import W_BATCH, W_KV_LEN, W_MASK_OFF, W_Q_START, W_QO_LEN, W_ROW0

# work-table fields the producer copies next to the tile index with TileInfo.SMEM* (7 fit the 8-int slot)
INFO_COLS = (W_BATCH, W_ROW0, W_QO_LEN, W_KV_LEN, W_Q_START, W_MASK_OFF)


class Producer:
    """Q hand-over and the K/V loads of the producer warpgroup."""

    @cute.jit
    def _hand_over(self, pipe_q, q_state, s_tile, t, tma_atom_Q, tma_Q, sQ, mWork, wi, kvh, mMaskT=None):
        """Producer warp 0: wait until the consumers are done with Q, publish tile ``t`` in shared memory
        and TMA its packed Q rows (``t < 0``: no tile left, the full barrier is arrived on without a
        load).  The tile index is stored before the barrier arrive, whose release orders it for the
        consumers' wait."""
        pipe_q.sync_object_empty.wait(q_state.index, q_state.phase)
        self._stamp_hand_over(mMaskT, t)
        # compute-sanitizer's racecheck reports this store against the consumers' load of the index: it does not
        # model mbarriers; the arrive below (release) and the consumers' full-barrier wait (acquire) order them
        # (and their empty-barrier arrive before the wait above orders their earlier load of the slot before it)
        s_tile[self._slot(q_state)] = t
        if t >= 0:
            if const_expr(self.tile_info_smem):
                for k, col in enumerate(INFO_COLS):
                    s_tile[self._slot(q_state) + 1 + k] = mWork[wi, col]
            TM, DQ = self.TM, self.DQ
            gQ = cute.local_tile(
                cute.domain_offset(((0, mWork[wi, W_Q_START]), 0), tma_Q[None, None, kvh]), (TM, DQ),
                (mWork[wi, W_ROW0] // TM, 0))
            tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                               cute.group_modes(gQ, 0, 2))
            if const_expr(self.QS > 1):
                tQsQ = tQsQ[None, q_state.index]
            pipe_q.sync_object_full.arrive(q_state.index, None)
            cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        else:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive(pipe_q.producer_get_barrier(q_state))

    @cute.jit
    def _produce(self, tma_K, tma_V, tma_atom_K, tma_atom_V, sK, sV, pipe_k, pipe_v, kvh, kv_start, kv_len, blk_lo,
                 n_blk, state, v_tail):
        """Warp 0: TMA the tile's K and V blocks right to left into the stage ring.  ``state``: the ring position,
        carried from tile to tile; ``v_tail``: (the tail mbarrier, its phase, sV's shared byte address).  V of a
        first block that runs past the request's end lands on the tail mbarrier instead of the stage's: its rows
        past the end are zeroed once the next block is issued (:meth:`_zero_v_tail`), and only then is the stage
        full.  Returns ``(state advanced, the tail mbarrier's next phase)``."""
        TN, DQ, DV = self.TN, self.DQ, self.DV
        gK = cute.local_tile(cute.domain_offset((kv_start, 0), tma_K[None, None, kvh]), (TN, DQ), (None, 0))
        gV = cute.local_tile(cute.domain_offset((kv_start, 0), tma_V[None, None, kvh]), (TN, DV), (None, 0))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                           cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                           cute.group_modes(gV, 0, 2))
        v_bar, v_phase, sV_addr = v_tail
        rows = kv_len - (blk_lo + n_blk - 1) * TN  # rows of the first (rightmost) block inside the request
        tail = rows < TN
        tail_stage = state.index
        for i in cutlass.range(n_blk, unroll=1):
            n = blk_lo + n_blk - 1 - i
            pipe_k.producer_acquire(state)
            cute.copy(tma_atom_K, tKgK[None, n], tKsK[None, state.index], tma_bar_ptr=pipe_k.producer_get_barrier(state))
            if tail & (i == 0):
                pipe_v.sync_object_empty.wait(state.index, state.phase)
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(v_bar, self.v_bytes)
                cute.copy(tma_atom_V, tVgV[None, n], tVsV[None, state.index], tma_bar_ptr=v_bar)
            else:
                pipe_v.producer_acquire(state)
                cute.copy(tma_atom_V, tVgV[None, n], tVsV[None, state.index],
                          tma_bar_ptr=pipe_v.producer_get_barrier(state))
            if tail & (i == 1):  # (deferred a block: the next K load is not held up by the tail's landing)
                v_phase = self._zero_v_tail(pipe_v, tail_stage, v_bar, v_phase, sV_addr, rows)
            state.advance()
        if tail & (n_blk == 1):
            v_phase = self._zero_v_tail(pipe_v, tail_stage, v_bar, v_phase, sV_addr, rows)
        return state, v_phase

    @cute.jit
    def _zero_v_tail(self, pipe_v, stage, v_bar, v_phase, sV_addr, rows):
        """Warp 0, ragged K/V: wait for V stage ``stage`` (loaded on ``v_bar``, phase ``v_phase``), zero its rows
        ``rows ..`` (past the request: another request's or a spare buffer row, which a masked P of 0 would turn
        into NaN in P V if they hold NaN or inf), order the stores before wgmma's async-proxy reads, and arrive on
        the stage's full barrier (count 1, no bytes: it completes).  Returns the next phase of ``v_bar``."""
        TN, DV = self.TN, self.DV
        cute.arch.mbarrier_wait(v_bar, v_phase)
        lane = cute.arch.lane_idx()
        # a row's 16-byte chunks stay within its 128-byte segment of each 64-column atom column (the swizzle
        # permutes them there), so rows .. TN - 1 of an atom column are one contiguous byte range
        base = sV_addr + stage * (TN * DV * 2) + rows * 128
        for a in cutlass.range_constexpr(DV // 64):
            for c in cutlass.range(lane, (TN - rows) * 8, 32, unroll=1):
                ptx.st_shared_zero_v4(base + a * (TN * 128) + c * 16)
        ptx.fence_proxy_async_shared()
        cute.arch.sync_warp()
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive(pipe_v.sync_object_full.get_barrier(stage))
        return v_phase ^ 1

    @cute.jit
    def _produce_paged(self, mK, mV, mIdx, sK_addr, sV_addr, pipe_k, pipe_v, kvh, page_off, kv_len, blk_lo, n_blk,
                       tid, state, tma_K, tma_V, tma_atom_K, tma_atom_V, sK, sV):
        """Producer warpgroup, paged K/V, blocks right to left.  A block that ends past the request is
        gathered through the page table with cp.async into the swizzled layout the TMA writes, zero past
        the request (so no stale value of the last page reaches P V).  With ``page_rows > 0`` every full
        block loads by TMA instead, one box of ``page_rows`` rows per page (one lane expects the
        transaction bytes, warp 0 issues the boxes, all 128 threads arrive), else it is gathered too."""
        TN, DQ, DV = self.TN, self.DQ, self.DV
        for i in cutlass.range(n_blk, unroll=1):
            tok0 = (blk_lo + n_blk - 1 - i) * TN
            tma_block = False
            if const_expr(self.page_rows > 0):
                tma_block = tok0 + TN <= kv_len
            self._paged_block(pipe_k, state, tma_block, tma_atom_K, tma_K, sK, self.k_bytes, mK, sK_addr, DQ, mIdx,
                              page_off, tok0, kv_len, kvh, tid)
            self._paged_block(pipe_v, state, tma_block, tma_atom_V, tma_V, sV, self.v_bytes, mV, sV_addr, DV, mIdx,
                              page_off, tok0, kv_len, kvh, tid)
            state.advance()
        return state

    @cute.jit
    def _paged_block(self, pipe, state, tma_block, tma_atom, tma_X, sX, nbytes, mX, s_addr, D: cutlass.Constexpr,
                     mIdx, page_off, tok0, kv_len, kvh, tid):
        """One K or V block of :meth:`_produce_paged` into stage ``state``: TMA per page, or the cp.async
        gather (committed as the stage's cp.async arrivals)."""
        pipe.producer_acquire(state)
        if tma_block:
            self._load_pages(tma_atom, tma_X, sX, pipe, state, nbytes, mIdx, page_off, tok0, kvh)
        else:
            self._gather(mX, mIdx, s_addr + state.index * (self.TN * D * 2), D, tok0, kv_len, page_off, kvh, tid)
            pipe.producer_commit(state)

    @cute.jit
    def _load_pages(self, tma_atom, tma_X, sX, pipe, state, nbytes, mIdx, page_off, tok0, kvh):
        """TMA one full block of ``tile_n`` paged tokens starting at ``tok0`` into stage ``state``: box ``j``
        (``page_rows`` rows) from page ``mIdx[page_off + (tok0 + j * page_rows) // page_size]`` into rows
        ``j * page_rows ..`` of the stage (1 KiB aligned: ``page_rows`` is a multiple of 8)."""
        R, PS, TN = self.page_rows, self.page_size, self.TN
        if const_expr(R > 0):  # (traced only where full blocks can load by TMA)
            bar = pipe.producer_get_barrier(state)
            # the whole of warp 0 issues: the TMA copy (and elect_one) elect a lane with elect.sync, which
            # needs every lane of the warp (called from one lane it hangs)
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_expect_tx(bar, nbytes)
                for j in cutlass.range_constexpr(TN // R):
                    tok = tok0 + j * R
                    page = mIdx[page_off + tok // PS]
                    gX = cute.local_tile(tma_X[None, None, kvh, page], (R, tma_X.shape[1]), (tok % PS // R, 0))
                    dst = cute.local_tile(sX[None, None, state.index], (R, sX.shape[1]), (j, 0))
                    tXs, tXg = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                                                     cute.group_modes(gX, 0, 2))
                    cute.copy(tma_atom, tXg, tXs, tma_bar_ptr=bar)
            cute.arch.mbarrier_arrive(bar)  # all 128 producer threads, as the cp.async arrivals of a gather

    @cute.jit
    def _gather(self, mX, mIdx, s_addr, D: cutlass.Constexpr, tok0, kv_len, page_off, kvh, tid):
        """cp.async one (tile_n, D) block of a paged cache, 16 bytes per copy, 128 producer threads."""
        TN, PS = self.TN, self.page_size
        cpr = D // 8
        base = mX.iterator.toint()
        # a rolled loop: unrolled, the page-id loads and 64-bit addresses of every copy stay live and
        # spill out of the producer's small register budget
        for it in cutlass.range((TN * cpr) // 128, unroll=2):
            idx = it * 128 + tid
            r = idx // cpr
            c = idx % cpr
            goff, valid = paging.kv_chunk_offset(mX, mIdx, tok0 + r, kv_len, page_off, kvh, c, PS)
            soff = sw128_offset(r, c, TN)
            ptx.cp_async_16(s_addr + soff, base + goff * 2, cutlass.select_(valid, 16, 0))
