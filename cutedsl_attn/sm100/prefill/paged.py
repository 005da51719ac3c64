"""Paged K/V loads of the SM100 prefill kernel's load warp: TMA per page (one box a page's rows, in the MMA's
128-byte-swizzled (token, dim) layout), a ``cp.async`` gather through the page table for page sizes TMA cannot
box, and the zeroing of V rows past a request.  A mixin of
:class:`~cutedsl_attn.sm100.prefill.kernel.Sm100PrefillKernel`, whose attributes it reads.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import LayoutEnum

from ...common import paging, ptx
from ...common.smem import sw128_offset


class PagedKV:
    """Paged K / V into the load warp's ring stages (:meth:`_paged_tma`, :meth:`_load_pages`, :meth:`_gather_block`)."""

    def _paged_tma(self, mK, mV):
        """TMA atoms of paged K and V (``[pages, page_size, kv_heads, D]``) viewed as (row in page, dim, kv_heads,
        pages): one box is ``page_rows`` rows of one page, in the 128-byte-swizzled (tokens, dim) layout that
        :meth:`_rows_view` gives a stage."""
        R, TM, dt = self.page_rows, self.TM, self.dtype
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        out = []
        for mX, D in ((mK, self.DQ), (mV, self.DV)):
            mX_t = cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=[1, 3, 2, 0]))
            box = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TM, R, D), dt, 1)
            out.extend(cpasync.make_tiled_tma_atom(g2s, mX_t, cute.select(box, mode=[0, 1]), (R, D), 1))
        return tuple(out)

    def _rows_view(self, buf, D):
        """A K or V ring as (token, dim, stage): the same bytes as the MMA's view (both operands hold a token's
        ``D`` values in 128-byte rows of 64, 8-row swizzle atoms down the tokens first, then the 64-wide column
        blocks; the CPU tests check the two layouts agree element by element)."""
        lay = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (self.TM, self.TN, D), self.dtype, self.S)
        return buf.get_tensor(lay.outer, swizzle=lay.inner)

    @cute.jit
    def _gather_block(self, pipe, state, mX, mIdx, s_addr, D: cutlass.Constexpr, page_off, tok0, kv_len, kvh):
        """cp.async the block of ``tile_n`` paged tokens from ``tok0`` into ring stage ``state`` (the load warp's 32
        lanes, 16 bytes a copy through the page table: :func:`cutedsl_attn.common.paging.kv_chunk_offset`, zero
        past the request), in the layout the MMA reads (:meth:`_rows_view`'s, 128-byte swizzle); then complete the
        stage: the copies waited for, ordered before the MMA's async-proxy reads, one arrive (no bytes)."""
        TN, PS = self.TN, self.page_size
        cpr = D // 8  # 16-byte chunks of a token's row
        lane = cute.arch.lane_idx()
        pipe.sync_object_empty.wait(state.index, state.phase)
        base = mX.iterator.toint()
        dst = s_addr + state.index * (TN * D * 2)
        # (rolled: unrolled, the page-id loads and 64-bit addresses outgrow the load warp's 32 or 48 registers)
        for it in cutlass.range((TN * cpr) // 32, unroll=1):
            idx = it * 32 + lane
            r = idx // cpr
            c = idx % cpr
            goff, valid = paging.kv_chunk_offset(mX, mIdx, tok0 + r, kv_len, page_off, kvh, c, PS)
            ptx.cp_async_16(dst + sw128_offset(r, c, TN), base + goff * 2, cutlass.select_(valid, 16, 0))
        ptx.cp_async_commit()
        ptx.cp_async_wait(0)
        ptx.fence_proxy_async_shared()
        cute.arch.sync_warp()
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive(pipe.sync_object_full.get_barrier(state.index))

    @cute.jit
    def _load_pages(self, tma_atom, tma_X, sX_rows, bar, mIdx, page_off, tok0, kv_len, kvh, stage):
        """TMA the block of ``tile_n`` tokens from ``tok0`` into ring stage ``stage``, box ``j`` (``page_rows``
        rows) from page ``mIdx[page_off + tok // page_size]`` into the stage's rows ``j * page_rows ..`` (1 KiB
        aligned: ``page_rows`` is a multiple of 8); ``bar`` expects the block's bytes.  Boxes past the request read
        its last page again (whole boxes keep the byte count; those rows are masked in S, zeroed in V)."""
        R, PS, TN = self.page_rows, self.page_size, self.TN
        for j in cutlass.range(TN // R, unroll=1):  # (rolled: unrolled, the boxes spill the load warp's registers)
            tok = tok0 + j * R
            page = mIdx[page_off + cutlass.min(tok, kv_len - 1) // PS]
            gX = cute.local_tile(tma_X[None, None, kvh, page], (R, tma_X.shape[1]), (tok % PS // R, 0))
            dst = cute.local_tile(sX_rows[None, None, stage], (R, sX_rows.shape[1]), (j, 0))
            tXs, tXg = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                                             cute.group_modes(gX, 0, 2))
            cute.copy(tma_atom, tXg, tXs, tma_bar_ptr=bar)

    @cute.jit
    def _zero_v_rows(self, sV, stage, rows):
        """Zero token rows ``rows .. tile_n - 1`` of V stage ``stage`` (another request's rows or spare buffer
        rows, which a masked P of 0 would turn into NaN in P V if they held NaN or inf), then order the stores
        before the MMA's async-proxy reads."""
        TN, DV = self.TN, self.DV
        lane = cute.arch.lane_idx()
        sVs = sV[None, None, None, stage]
        # sVs: ((head_dim, 16 tokens), 1, tile_n / 16): the P V GEMM's B operand per 16-token k-block
        for e in cutlass.range(lane, (TN - rows) * DV, 32, unroll=1):
            r = rows + e // DV
            sVs[((e % DV, r % 16), 0, r // 16)] = self.dtype(0.0)
        ptx.fence_proxy_async_shared()
        cute.arch.sync_warp()
