"""The SM90 chunked GDN main kernel's producer loads (a mixin of
:class:`cutedsl_attn.sm90.gdn_chunked.GdnChunkedSm90Kernel`): a chunk's q / k rows and the prep's scratch blocks
into the 128-byte-swizzled ring stages, by ``cp.async`` (:meth:`GdnSm90Loads._load_chunk`) or, with
``Tiles.tma = 1``, the full tiles by TMA boxes (:meth:`GdnSm90Loads._load_chunk_tma`); and a consumer thread's
state elements from / to global memory (:meth:`GdnSm90Loads._state_io`).  The methods read the kernel's ``C`` /
``K`` / ``V`` / ``BV`` / ``RU`` / ``F_BYTES`` / ``write_output`` / ``zero_u`` / ``bf16_state`` attributes.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int64, const_expr
from cutlass.cute.nvgpu import cpasync

from ..common import ptx
from ..common.smem import sw128_offset
from ..planning.gdn import CHUNK


class GdnSm90Loads:
    """Producer-warpgroup loads and the consumers' state I/O of the SM90 chunked GDN main kernel; see the module
    docstring."""

    @cute.jit
    def _load_chunk(self, mQ, mK, mW, mU, mAqk, mF, storage, stage, c, t0, ln, qh, kh, ho, v0, tid):
        """Producer warpgroup: cp.async chunk ``c`` (tokens ``t0 .. t0 + ln``) into ring stage ``stage``: q / k
        rows (zero past ``ln``: rows of the next sequence may hold anything; q through
        :meth:`~cutedsl_attn.sm90.gdn_rows.GdnSm90Rows._load_q_rows`, mapped on an expanded timeline) and W,
        Aqk into the swizzled tiles, the V-slice of U (padded rows) and the row factors."""
        C, K = self.C, self.K
        HO = mW.shape[1]
        tile_ck = C * K * 2
        if const_expr(self.write_output):  # q and Aqk feed the outputs only
            self._load_q_rows(mQ, storage.sQ.data_ptr().toint() + stage * tile_ck, t0, ln, qh, tid)
        self._load_qk_rows(mK, storage.sK.data_ptr().toint() + stage * tile_ck, t0, ln, kh, tid)
        blk = Int64(c) * HO + ho
        self._load_tile(mW.iterator.toint() + blk * (C * K * 2), K, storage.sW.data_ptr().toint() + stage * tile_ck,
                         tid)
        if const_expr(self.write_output):
            self._load_tile(mAqk.iterator.toint() + blk * (C * C * 2), C,
                             storage.sAqk.data_ptr().toint() + stage * (C * C * 2), tid)
        self._load_u_f(mU, mF, storage, stage, blk, v0, tid)

    @cute.jit
    def _load_u_f(self, mU, mF, storage, stage, blk, v0, tid):
        """cp.async block ``blk``'s V-slice of U (padded rows) and its row factors into ring stage ``stage``."""
        C, V, BV, RU = self.C, self.V, self.BV, self.RU
        if const_expr(not self.zero_u):
            u_src = mU.iterator.toint() + blk * (C * V * 2) + v0 * 2
            u_dst = storage.sU.data_ptr().toint() + stage * (C * RU)
            cpr = BV // 8
            for it in cutlass.range((C * cpr) // 128, unroll=2):
                idx = it * 128 + tid
                r = idx // cpr
                col = idx % cpr
                ptx.cp_async_16(u_dst + r * RU + col * 16, u_src + (Int64(r) * V + col * 8) * 2, 16)
        if tid < self.F_BYTES // 16:
            ptx.cp_async_16(storage.sF.data_ptr().toint() + stage * self.F_BYTES + tid * 16,
                            mF.iterator.toint() + blk * self.F_BYTES + tid * 16, 16)

    @cute.jit
    def _load_chunk_tma(self, mQ, mK, mW, mU, mF, storage, pipe, state, c, t0, ln, qh, kh, ho, v0, tid, warp_idx,
                        s_ck, s_cc, tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_W, tma_W, tma_atom_A, tma_A):
        """Producer warpgroup, ``Tiles.tma = 1``: warp 0 expects the stage's TMA bytes and issues the W / Aqk boxes
        and, for a full chunk, the q / k boxes; all 128 threads ``cp.async`` the rest (a tail chunk's q / k rows
        zero past ``ln``, the U slice, the row factors) and arrive through :meth:`_load_chunk`'s pieces."""
        C, K = self.C, self.K
        stage = state.index
        tile_ck = C * K * 2
        full = ln == C
        bar = pipe.producer_get_barrier(state)
        if warp_idx == 0:
            wo = int(self.write_output)  # q and Aqk feed the outputs only
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(
                    bar, tile_ck + wo * C * C * 2 + cutlass.select_(full, (1 + wo) * tile_ck, 0))
            sW = storage.sW.get_tensor(s_ck.outer, swizzle=s_ck.inner)
            self._tma_box(tma_atom_W, tma_W[None, None, ho, c], sW, stage, bar, (C, K))
            if const_expr(self.write_output):
                sA = storage.sAqk.get_tensor(s_cc.outer, swizzle=s_cc.inner)
                self._tma_box(tma_atom_A, tma_A[None, None, ho, c], sA, stage, bar, (C, C))
            if full:
                sK = storage.sK.get_tensor(s_ck.outer, swizzle=s_ck.inner)
                self._tma_box(tma_atom_K, cute.domain_offset((t0, 0), tma_K[None, None, kh]), sK, stage, bar, (C, K))
                if const_expr(self.write_output):
                    sQ = storage.sQ.get_tensor(s_ck.outer, swizzle=s_ck.inner)
                    self._tma_box(tma_atom_Q, cute.domain_offset((t0, 0), tma_Q[None, None, qh]), sQ, stage, bar,
                                  (C, K))
        if not full:
            if const_expr(self.write_output):
                self._load_qk_rows(mQ, storage.sQ.data_ptr().toint() + stage * tile_ck, t0, ln, qh, tid)
            self._load_qk_rows(mK, storage.sK.data_ptr().toint() + stage * tile_ck, t0, ln, kh, tid)
        self._load_u_f(mU, mF, storage, stage, Int64(c) * mW.shape[1] + ho, v0, tid)

    @cute.jit
    def _tma_box(self, atom, gX, sX, stage, bar, box: cutlass.Constexpr):
        """One warp: the TMA box at the origin of ``gX`` into stage ``stage`` of ``sX`` (the copy elects its lane)."""
        src = cute.local_tile(gX, box, (0, 0))
        tXs, tXg = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                         cute.group_modes(src, 0, 2))
        cute.copy(atom, tXg, tXs[None, stage], tma_bar_ptr=bar)

    @cute.jit
    def _load_qk_rows(self, mX, s_dst, t0, ln, head, tid):
        """cp.async rows ``t0 .. t0 + C`` of head ``head`` of ``mX`` ``[T, H, K]`` into a swizzled (C, K) tile,
        zero past ``ln`` (the source address stays in bounds: row ``t0``)."""
        cpr = self.K // 8
        base = mX.iterator.toint()
        for it in cutlass.range((self.C * cpr) // 128, unroll=2):
            idx = it * 128 + tid
            r = idx // cpr
            col = idx % cpr
            ok = r < ln
            tok = cutlass.select_(ok, t0 + r, t0)
            goff = Int64(tok) * mX.stride[0] + Int64(head) * mX.stride[1] + col * 8
            ptx.cp_async_16(s_dst + sw128_offset(r, col, CHUNK), base + goff * 2, cutlass.select_(ok, 16, 0))

    @cute.jit
    def _load_tile(self, g_base, D: cutlass.Constexpr, s_dst, tid):
        """cp.async a row-major ``[C, D]`` 16-bit scratch block at ``g_base`` into a swizzled (C, D) tile."""
        cpr = D // 8
        for it in cutlass.range((self.C * cpr) // 128, unroll=2):
            idx = it * 128 + tid
            r = idx // cpr
            col = idx % cpr
            ptx.cp_async_16(s_dst + sw128_offset(r, col, CHUNK), g_base + (Int64(r) * D + col * 8) * 2, 16)

    @cute.jit
    def _state_io(self, mH, fS, mat, vw, warp, g, t, store: cutlass.Constexpr):
        """Load (or store) the thread's state elements of matrix ``mat`` (= row * HO + head) of ``[*, HO, V, K]``:
        rows ``vw + 16 warp + g (+ 8)``, column pairs ``8 j + 2 t``."""
        K, V = self.K, self.V
        h_base = mH.iterator.toint()
        for j in cutlass.range_constexpr(K // 8):
            for h in cutlass.range_constexpr(2):
                off = (mat * V + vw + warp * 16 + g + 8 * h) * K + j * 8 + 2 * t
                i = 4 * j + 2 * h
                if const_expr(self.bf16_state):
                    addr = h_base + off * 2
                    if const_expr(store):
                        ptx.st_global_u32(addr, ptx.pack2(fS[i], fS[i + 1], cutlass.BFloat16))
                    else:
                        lo, hi = ptx.unpack2(ptx.ld_global_b32(addr), cutlass.BFloat16)
                        fS[i] = lo
                        fS[i + 1] = hi
                else:
                    addr = h_base + off * 4
                    if const_expr(store):
                        ptx.st_global_v2_f32(addr, fS[i], fS[i + 1])
                    else:
                        x = ptx.ld_global_v2_f32(addr)
                        fS[i] = x[0]
                        fS[i + 1] = x[1]
