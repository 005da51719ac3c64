"""The SM90 prefill epilogue: normalise O, apply the output scale, store O and the LSE of a tile.

From registers, or staged (``stmatrix``) in the warpgroup's own Q rows -- free after its last S GEMM -- and
stored as whole rows or by TMA (:mod:`cutedsl_attn.common.epilogue`).  A mixin of
:class:`~cutedsl_attn.sm90.prefill.kernel.Sm90PrefillKernel`.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import const_expr
from cutlass.cute.nvgpu import cpasync

from ...common import epilogue, ptx
from ...planning.prefill import W_Q_START, W_QO_LEN, W_ROW0
from .barriers import Barrier, barrier_id


class TileEpilogue:
    """The tile epilogue of a consumer warpgroup."""

    @cute.jit
    def _tile_epilogue(self, sched, mO, tma_O, tma_atom_O, sO_layout, mLSE, mSinks, mMask, mWork, sQ_addr, pipe_q,
                       q_state, s_tile, acc_O, st, tile, tid, wg, epi, output_scale):
        """Normalise O by the row sums of ``st`` (the tile's ``SoftmaxState``), times ``output_scale`` (Float32 or
        None), and store it and the LSE: from registers (``Epilogue.REGS``), or staged through the Q rows, which
        then releases the Q stage (``SMEM``; ``SMEM_TMA``: a warp whose rows all lie in the request stores them
        by TMA, :meth:`_tma_store_o`).  ``epi``: the coordinates read before the Q stage's release
        (``TileInfo.*_EARLY``), else unused."""
        st.quad_sum()
        # re-derive the tile's coordinates from the (opaque) tile index rather than keep them live through
        # the main loop, where the consumer's registers run out
        # (the Q stage, and with it s_tile's copy of the fields, is still held only with a staged epilogue)
        if const_expr(self.epi_coords_early and not self.smem_epilogue):
            e_row0, e_qo_len, e_q_start, e_kvh, e_lane, e_warp = epi
        else:
            e_row0, e_qo_len, e_q_start, e_kvh, e_lane, e_warp = self._epi_coords(
                sched, mWork, tile, tid, s_tile if const_expr(self.smem_epilogue) else None, q_state)
        self._stamp_fine(mMask, tile, 8, tid)
        if const_expr(self.smem_epilogue):
            # the warpgroup's Q rows are free once all its warps are past the last S GEMM; each warp stages its
            # 16 rows of O there (own bytes), then releases Q once its reads of them are done
            cute.arch.barrier(barrier_id=barrier_id(Barrier.EPILOGUE, wg, self.NWG), number_of_threads=128)
            self._stamp_fine(mMask, tile, 9, tid)
            s_base = sQ_addr + self._staging_offset(q_state, wg, e_warp)
            lse0, lse1 = epilogue.stage_rows(mSinks, acc_O, st.row_max, st.row_sum, e_row0, e_kvh, e_lane, e_warp,
                                             s_base, self.DV, self.G, self.use_sinks, self.dtype, output_scale)
            if const_expr(self.tma_epilogue):
                ptx.fence_proxy_async_shared()  # the stmatrix writes, before the TMA store (async proxy) reads
            cute.arch.sync_warp()
            self._stamp_fine(mMask, tile, 10, tid)
            if const_expr(self.tma_epilogue):
                if e_row0 + e_warp * 16 + 16 <= e_qo_len * self.G:  # all 16 rows in the request
                    self._tma_store_o(tma_O, tma_atom_O, sO_layout, s_base, e_row0, e_q_start, e_kvh, e_lane, e_warp)
                else:
                    epilogue.store_staged_rows(mO, e_row0, e_qo_len, e_q_start, e_kvh, e_lane, e_warp, s_base,
                                               self.DV, self.G)
            else:
                epilogue.store_staged_rows(mO, e_row0, e_qo_len, e_q_start, e_kvh, e_lane, e_warp, s_base, self.DV,
                                           self.G)
            self._stamp_fine(mMask, tile, 11, tid)
            epilogue.store_lse(mLSE, lse0, lse1, e_row0, e_qo_len, e_q_start, e_kvh, e_lane, e_warp, self.G)
            ptx.fence_proxy_async_shared()  # before the next TMA load overwrites the staged rows
            cute.arch.sync_warp()  # every lane's reads and fence before lane 0's release
            pipe_q.consumer_release(q_state)
        else:
            epilogue.store_rows(mO, mLSE, mSinks, acc_O, st.row_max, st.row_sum, e_row0, e_qo_len, e_q_start, e_kvh,
                                e_lane, e_warp, self.DV, self.G, self.use_sinks, self.dtype, True, output_scale)
        self._stamp(mMask, tile, 4 * wg + 3, tid % 128 == 0)

    @cute.jit
    def _tma_store_o(self, tma_O, tma_atom_O, sO_layout, s_base, row0, q_start, kvh, lane, warp):
        """``Epilogue.SMEM_TMA``: store the warp's 16 staged rows (all inside the request) with TMA, one box per 64
        columns, and wait until the boxes have been read out of shared memory, so the Q stage they occupy can
        be released."""
        TMW = 16
        ptr = cute.make_ptr(self.dtype, s_base, cute.AddressSpace.smem, assumed_align=1024)
        sO = cute.make_tensor(cute.recast_ptr(ptr, sO_layout.inner, dtype=self.dtype), sO_layout.outer)
        gO = cute.local_tile(cute.domain_offset(((0, q_start), 0), tma_O[None, None, kvh]), (TMW, self.DV),
                             ((row0 + warp * TMW) // TMW, 0))
        tOsO, tOgO = cpasync.tma_partition(tma_atom_O, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                                           cute.group_modes(gO, 0, 2))
        # one lane issues (the DSL 4.8.1 emits the store unpredicated: every calling lane would store) and
        # waits for its bulk group's reads; the caller's warp sync then orders the release after them
        if lane == 0:
            cute.copy(tma_atom_O, tOsO, tOgO)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _epi_coords(self, sched, mWork, tile, tid, s_tile=None, q_state=None):
        """(row0, qo_len, q_start, kv head, lane, consumer warp) of tile ``tile`` for the epilogue (the
        fields from ``s_tile`` where given: :meth:`_field`)."""
        wi, kvh = sched.coords(ptx.opaque_i32(tile))
        row0 = self._field(mWork, wi, W_ROW0, s_tile, q_state)
        qo_len = self._field(mWork, wi, W_QO_LEN, s_tile, q_state)
        q_start = self._field(mWork, wi, W_Q_START, s_tile, q_state)
        lane = ptx.opaque_i32(tid) % 32
        warp = ptx.opaque_i32(tid) // 32
        return row0, qo_len, q_start, kvh, lane, warp

    def _staging_offset(self, q_state, wg, warp):
        """Byte offset in ``sQ`` of consumer warp ``warp``'s ``16 x head_dim_vo`` staging rows: inside its
        warpgroup's 64 Q rows of the current Q stage, which the K-major 128-byte-swizzled layout stores as
        ``head_dim_qk / 64`` runs of 8 KiB (64 rows x 64 columns each, one per 64-column atom at ``atom *
        tile_m * 128``), ``256 / head_dim_vo`` warps per run."""
        TM, DQ, DV = self.TM, self.DQ, self.DV
        per_run = 256 // DV
        wl = warp % 4
        off = (wl // per_run) * (TM * 128) + wg * (64 * 128) + (wl % per_run) * (32 * DV)
        return off + self._q_index(q_state) * (TM * DQ * 2)
