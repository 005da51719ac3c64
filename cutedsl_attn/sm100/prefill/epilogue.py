"""The final O tile of the SM100 prefill kernel: the correction warpgroup normalises it out of TMEM into shared
memory, the epilogue warp stores it to global memory.

The hand-off goes through :attr:`~cutedsl_attn.sm100.prefill.config.Config.epi_stages` staging buffers of
``128 x EPI_COLS`` 16-bit values (the K-major 128-byte swizzle, :func:`cutedsl_attn.common.smem.sw128_offset`)
and a ``PipelineAsync`` (full: the 128 correction threads arrive; empty: the 32 epilogue lanes), one message
per ``EPI_COLS`` columns of each Q tile; a buffer also carries its 128 rows' base-2 LSE.  The correction
warpgroup moves on to the next tile's rescales as soon as the last buffer is written.  The epilogue warp stores
a Q tile whose rows all belong to the request with one TMA box per buffer (``cp.async.bulk.tensor`` shared to
global, GQA-packed rows as the Q loads), and a ragged one (rows past the request's end, which belong to the
next request's tokens) with 16-byte stores of its live rows, 8 lanes a row.  With no room for a buffer
(``epi_stages`` 0) the correction warpgroup stores O itself.  A mixin of
:class:`~cutedsl_attn.sm100.prefill.kernel.Sm100PrefillKernel`, whose attributes it reads.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync

from ...common import ptx
from ...common import softmax as sm
from ...common.constants import LOG2E, NEG_INF
from ...common.smem import sw128_offset
from ...common.tcgen05 import fence_after_sync, fence_before_sync, state_at
from ...planning.prefill import W_Q_START
from . import config as C
from .softmax import _plus


def _st_shared_v4(addr, w0, w1, w2, w3):
    """16-byte shared store (Int32 shared-window byte address, 16-byte aligned)."""
    cute.arch.inline_ptx("st.shared.v4.b32 [{$r0}], { {$r1}, {$r2}, {$r3}, {$r4} };",
                         read_only_args=[Int32(addr), Int32(w0), Int32(w1), Int32(w2), Int32(w3)])


class Epilogue:
    """The correction warpgroup's last step of a Q tile (:meth:`_epilogue`) and the epilogue warp
    (:meth:`_epilogue_warp`)."""

    @cute.jit
    def _epilogue(self, pipe_o, pipe_stats, pipe_epi, s_stats, s_lse, sO_addr, mWork, wi, kvh, mO, mLSE, mSinks,
                  output_scale, row0, qo_len, n_blk, row, t: cutlass.Constexpr, tiled_ld, tLtO, tLcO, nb, ns, ne):
        """Normalise Q tile ``t``'s row ``row`` (sinks folded in, output scale in fp32) and hand it, 16-bit, with
        its LSE to the epilogue warp (``ne``: tiles staged before this one); without staging buffers store it
        (16-byte stores) and its LSE here; a row past the request is not written."""
        TM, DV, G, QT = self.TM, self.DV, self.G, self.QT
        CH, EPI, NC = self.CH, self.EPI, self.DV // C.EPI_COLS
        st_state = state_at(QT, _plus(ns, n_blk) * QT + t, False)
        pipe_stats.consumer_wait(st_state)
        l = s_stats[t * TM + row, 0]
        m = s_stats[t * TM + row, 1]
        pipe_stats.consumer_release(st_state)
        pr = row0 + t * TM + row
        head = kvh * G + pr % G
        sink_l2 = Float32(NEG_INF)
        if const_expr(self.use_sinks):
            sink_l2 = mSinks[head] * Float32(LOG2E)
        factor, lse = sm.finalize_row(m, l, sink_l2)
        factor = factor * output_scale
        o_state = state_at(QT, _plus(nb, n_blk - 1) * QT + t, False)
        if n_blk > 0:
            pipe_o.consumer_wait(o_state)  # the last P V is done
            fence_after_sync()
        if const_expr(EPI == 0):
            live = pr < qo_len * G
            tok = mWork[wi, W_Q_START] + pr // G
            row_addr = mO.iterator.toint() + ((Int64(tok) * mO.shape[1] + head) * DV) * 2
            for c in cutlass.range_constexpr(DV // CH):
                rO = self._o_chunk(tiled_ld, tLtO, tLcO, c * CH, n_blk)
                if live:
                    for q in cutlass.range_constexpr(CH // 8):
                        w = [self._scaled_pair(rO, 8 * q + 2 * h, factor) for h in range(4)]
                        ptx.st_global_v4_b32(row_addr + (c * CH + 8 * q) * 2, w[0], w[1], w[2], w[3])
            if live:
                mLSE[tok, head] = lse
        else:
            for e in cutlass.range_constexpr(NC):
                epi_state = state_at(EPI, ne * (QT * NC) + t * NC + e, True)
                pipe_epi.producer_acquire(epi_state)  # the epilogue warp has stored this buffer's last tile
                buf = sO_addr + epi_state.index * (TM * C.EPI_COLS * 2)
                for c in cutlass.range_constexpr(C.EPI_COLS // CH):
                    rO = self._o_chunk(tiled_ld, tLtO, tLcO, e * C.EPI_COLS + c * CH, n_blk)
                    for q in cutlass.range_constexpr(CH // 8):
                        w = [self._scaled_pair(rO, 8 * q + 2 * h, factor) for h in range(4)]
                        _st_shared_v4(buf + sw128_offset(row, (c * CH + 8 * q) // 8, TM), w[0], w[1], w[2], w[3])
                if const_expr(e == 0):
                    s_lse[epi_state.index * TM + row] = lse
                ptx.fence_proxy_async_shared()  # (the TMA store reads the buffer through the async proxy)
                pipe_epi.producer_commit(epi_state)
        if n_blk > 0:
            fence_before_sync()
            pipe_o.consumer_release(o_state)

    @cute.jit
    def _o_chunk(self, tiled_ld, tLtO, tLcO, col: cutlass.Constexpr, n_blk):
        """This thread's O row, columns ``col .. col + CH``, from TMEM (zeros for a tile of no KV block)."""
        rO = cute.make_rmem_tensor(tLcO.shape, Float32)
        if n_blk > 0:
            cute.copy(tiled_ld, cute.make_tensor(tLtO.iterator + col, tLtO.layout), rO)
            cute.arch.fence_view_async_tmem_load()
        else:
            rO.fill(0.0)
        return rO

    @cute.jit
    def _scaled_pair(self, rO, e: cutlass.Constexpr, factor):
        """``rO[e], rO[e + 1]`` times ``factor`` as one word of two 16-bit values; an exact 0 where ``factor`` is 0
        (a row that saw no key), whatever the accumulator holds."""
        ok = factor != Float32(0.0)
        o0 = Float32(cutlass.select_(ok, rO[e] * factor, Float32(0.0)))
        o1 = Float32(cutlass.select_(ok, rO[e + 1] * factor, Float32(0.0)))
        return ptx.pack2(o0, o1, self.dtype)

    # ------------------------------------------------------------------ epilogue warp
    @cute.jit
    def _epilogue_warp(self, tma_atom_O, tma_O, sO, sO_addr, s_lse, pipe_epi, mWork, mO, mLSE, wi, kvh, row0,
                       qo_len, lane, ne):
        """Store work row ``wi``'s staged O tiles and their LSE (``ne``: tiles staged before this one): per Q tile
        and ``EPI_COLS`` columns, one TMA box when all 128 rows are the request's, else the live rows' 16-byte
        stores (lane ``l`` copies chunk ``l % 8`` of rows ``4 k + l // 8``); then the buffer goes back to the
        correction warpgroup."""
        TM, DV, G, QT, EPI = self.TM, self.DV, self.G, self.QT, self.EPI
        NC = DV // C.EPI_COLS
        q_start = mWork[wi, W_Q_START]
        gO = cute.flat_divide(cute.domain_offset(((0, q_start), 0, 0), tma_O), (TM, C.EPI_COLS))
        tOsO, tOgO = cpasync.tma_partition(tma_atom_O, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                                           cute.group_modes(gO, 0, 2))
        live_rows = qo_len * G
        hq = mO.shape[1]
        for t in cutlass.range_constexpr(QT):
            r0 = row0 + t * TM
            for e in cutlass.range_constexpr(NC):
                epi_state = state_at(EPI, ne * (QT * NC) + t * NC + e, False)
                pipe_epi.consumer_wait(epi_state)
                if r0 + TM <= live_rows:
                    with cute.arch.elect_one():  # (one lane issues the box and waits for its reads)
                        cute.copy(tma_atom_O, tOsO[None, epi_state.index], tOgO[None, r0 // TM, e, kvh])
                        cute.arch.cp_async_bulk_commit_group()
                        cute.arch.cp_async_bulk_wait_group(0, read=True)  # the buffer is read: it may be refilled
                else:
                    buf = sO_addr + epi_state.index * (TM * C.EPI_COLS * 2)
                    ch = lane % 8
                    for k in cutlass.range(TM // 4, unroll=4):
                        r = 4 * k + lane // 8
                        pr = r0 + r
                        if pr < live_rows:
                            w = ptx.ld_shared_v4_b32(buf + sw128_offset(r, ch, TM))
                            tok = q_start + pr // G
                            addr = mO.iterator.toint() + ((Int64(tok) * hq + kvh * G + pr % G) * DV
                                                          + e * C.EPI_COLS + 8 * ch) * 2
                            ptx.st_global_v4_b32(addr, w[0], w[1], w[2], w[3])
                if const_expr(e == 0):
                    for k in cutlass.range_constexpr(TM // 32):
                        pr = r0 + 32 * k + lane
                        if pr < live_rows:
                            mLSE[q_start + pr // G, kvh * G + pr % G] = s_lse[epi_state.index * TM + 32 * k + lane]
                pipe_epi.consumer_release(epi_state)
