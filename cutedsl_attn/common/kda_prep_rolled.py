"""The run-time-loop forms of the per-channel prep's phases (``Tiles.prep_rolled = 2``): one copy of each step
in a ``cutlass.range(..., unroll=1)`` loop where :mod:`cutedsl_attn.common.kda_prep` (and the
:class:`~cutedsl_attn.common.gdn_prep.GdnPrep` phases it reuses) unroll them: the q / k / G loads, the l2 norms,
the cumulative decay, the gate products, steps 2-5 of the inverse, the W / U k-steps (also the three guarded
copies of them) and the direct diagonal blocks' channel loop.  The unrolled prep's 160 KB of straight-line code
stalls on instruction fetch; level 1 (the column blocks and Qg / Kd rolled) is 106 KB, level 2 54 KB (63 KB in
the compact layout).
Every step keeps the per-element operations and the order of every accumulation of the unrolled one, so the
outputs are bit-identical to levels 0 and 1.

The ``*_r`` methods dispatch (level 2 the loop, a lower level the unrolled phase unchanged); the ``*_steps``
ones are level 2's loops, dispatched from :class:`~cutedsl_attn.common.kda_prep.KdaPrep`.  The phases whose
register fragments are indexed by the step stay unrolled: the row operands (``_row_frags``), the column-block
accumulators (``_a_phase``, ``_store_a``) and the diagonal blocks' substitution (step 1 of the inverse).
Rolling ``_a_phase`` with its accumulators selected by the block index saves another ~370 instructions at
``prep_ctas = 2`` but spills 80 B at the compact layout's 168 registers.  A mixin over
:class:`~cutedsl_attn.common.gdn_prep.GdnPrep`; :class:`~cutedsl_attn.common.kda_prep.KdaPrep` derives from it
and the kernel class sets ``rolled``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64, const_expr

from . import ptx
from .constants import LOG2E
from .gdn_prep import (
    PREP_THREADS, GdnPrep, _ld_shared_v4_f32, _normalise_batch, _st_shared_v2_f32, _st_shared_v4_b32, _st_shared_v4_f32,
)
from ..planning.gdn import FLAG_HAS_BETA, FLAG_HAS_G

_inline = cute.arch.inline_ptx
NORM_BATCH = 4  # q rows (and as many k rows) of one l2-norm step: 8 butterflies in flight, 1/4 of the code


def _ld_nc_v4_f32(addr):
    return _inline("ld.global.nc.v4.f32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];", write_only_types=[Float32] * 4,
                   read_only_args=[Int64(addr)])


def _x8(addr, io) -> list:
    """Eight 16-bit values at a 16-byte aligned shared address, widened to fp32."""
    out = []
    for wd in ptx.ld_shared_v4_b32(addr):
        lo, hi = ptx.unpack2(wd, io)
        out += [lo, hi]
    return out


def _st8(addr, vals, io):
    _st_shared_v4_b32(addr, [ptx.pack2(vals[2 * q], vals[2 * q + 1], io) for q in range(4)])


class KdaPrepRolled(GdnPrep):
    """The rolled prep steps (a mixin, see the module docstring)."""

    #: the prep's loop level (``Tiles.prep_rolled``): 0 unrolled, 1 the column-block and Qg / Kd phases rolled,
    #: 2 every phase this module rolls as well; set by the kernel class
    rolled = 0

    @cute.jit
    def _normalise_qk_r(self, sQ, sRq, sK, sRk, warp, lane):
        """:meth:`GdnPrep._normalise_rows` of this warp's q rows, then its k rows; level 2 (with l2norm) runs
        both as one run-time loop of ``NORM_BATCH`` rows of q and of k a step (the same per-row operations,
        ``2 NORM_BATCH`` butterflies in flight)."""
        if const_expr(self.rolled >= 2 and self.l2norm):
            K, RK = self.K, self.RK
            for b in cutlass.range(16 // NORM_BATCH, unroll=1):
                row0 = warp * 16 + b * NORM_BATCH
                rows = [sX + (row0 + rr) * RK + lane * (K // 32) * 2 for sX in (sQ, sK) for rr in range(NORM_BATCH)]
                norms = _normalise_batch(rows, K, self.io)
                if lane == 0:
                    for rr in cutlass.range_constexpr(NORM_BATCH):
                        ptx.st_shared_f32(sRq + (row0 + rr) * 4, norms[rr])
                        ptx.st_shared_f32(sRk + (row0 + rr) * 4, norms[NORM_BATCH + rr])
        else:
            self._normalise_rows(sQ, sRq, warp, lane)
            self._normalise_rows(sK, sRk, warp, lane)

    @cute.jit
    def _cumsum_steps(self, sG, RG: cutlass.Constexpr, floor: cutlass.Constexpr, tidx):
        """The rolled cumulative log2 decay (a thread a channel, 8 rows a step: the step's loads first), each
        token's gate floored at ``floor``; the running sum in the loop's order, as the unrolled one."""
        if tidx < self.K:
            run = Float32(0.0)
            for r8 in cutlass.range(self.C // 8, unroll=1):
                base = sG + r8 * (8 * RG) + tidx * 4
                xs = [ptx.ld_shared_f32(base + i * RG) for i in range(8)]
                for i in cutlass.range_constexpr(8):
                    run = run + cutlass.max(xs[i] * Float32(LOG2E), Float32(floor))
                    ptx.st_shared_f32(base + i * RG, run)

    @cute.jit
    def _gate_rows_r(self, mBeta, src, dst, RB: cutlass.Constexpr, D: cutlass.Constexpr, off: cutlass.Constexpr,
                     sB, tok0, ln, ho, HO, flags, idx0, nthreads: cutlass.Constexpr):
        """:meth:`~cutedsl_attn.common.kda_prep.KdaPrep._gate_rows` as a run-time loop (its arguments)."""
        if const_expr(self.rolled >= 2):
            K, V, io = self.K, self.V, self.io
            has_b = (flags & FLAG_HAS_BETA) != 0
            base = mBeta.iterator.toint()
            cpr = D // 8
            for it in cutlass.range((self.C * cpr) // nthreads, unroll=1):
                idx = it * nthreads + idx0
                r = idx // cpr
                col = idx % cpr
                x = _x8(src + r * RB + col * 16, io)
                if const_expr(self.erase_write):
                    tok = cutlass.select_(r < ln, tok0 + r, tok0)
                    addr = base + ((Int64(tok) * HO + ho) * (K + V) + off + col * 8) * 4
                    bv = list(_ld_nc_v4_f32(addr)) + list(_ld_nc_v4_f32(addr + 16))
                    for e in cutlass.range_constexpr(8):
                        bv[e] = cutlass.select_(has_b, bv[e], Float32(1.0))
                    _st8(dst + r * RB + col * 16, [x[e] * bv[e] for e in range(8)], io)
                else:
                    b = ptx.ld_shared_f32(sB + r * 4)
                    _st8(dst + r * RB + col * 16, [x[e] * b for e in range(8)], io)
        else:
            self._gate_rows(mBeta, src, dst, RB, D, off, sB, tok0, ln, ho, HO, flags, idx0, nthreads)

    @cute.jit
    def _load_rows_r(self, mX, s_dst, RB: cutlass.Constexpr, D: cutlass.Constexpr, tok0, ln, head, tidx,
                     nthreads: cutlass.Constexpr):
        """:meth:`GdnPrep._load_rows` as a run-time loop (its arguments)."""
        if const_expr(self.rolled >= 2):
            cpr = D // 8
            base = mX.iterator.toint()
            for it in cutlass.range((self.C * cpr) // nthreads, unroll=1):
                idx = it * nthreads + tidx
                r = idx // cpr
                col = idx % cpr
                ok = r < ln
                tok = cutlass.select_(ok, tok0 + r, tok0)
                goff = Int64(tok) * mX.stride[0] + Int64(head) * mX.stride[1] + col * 8
                ptx.cp_async_16(s_dst + r * RB + col * 16, base + goff * 2, cutlass.select_(ok, 16, 0))
        else:
            self._load_rows(mX, s_dst, RB, D, tok0, ln, head, tidx, nthreads)

    @cute.jit
    def _load_gates_steps(self, mG, sG, RG: cutlass.Constexpr, tok0, ln, ho, HO, flags, tidx):
        """The rolled cp.async of the chunk's log gates (:meth:`~cutedsl_attn.common.kda_prep.KdaPrep._load_gates`)."""
        K = self.K
        cpr = K // 4
        base = mG.iterator.toint()
        has_g = (flags & FLAG_HAS_G) != 0
        for it in cutlass.range((self.C * cpr) // PREP_THREADS, unroll=1):
            idx = it * PREP_THREADS + tidx
            r = idx // cpr
            col = idx % cpr
            ok = (r < ln) & has_g
            row = cutlass.select_(ok, Int64(tok0 + r) * HO + ho, Int64(0))
            ptx.cp_async_16(sG + r * RG + col * 16, base + (row * K + col * 4) * 4, cutlass.select_(ok, 16, 0))

    # ------------------------------------------------------------------ T = (I + A)^-1
    @cute.jit
    def _invert_blocks_r(self, sA, tidx):
        """:meth:`GdnPrep._invert_blocks` with its steps 2-5 as run-time loops over the summed index (the
        same sums in the same order); step 1 (the diagonal blocks' substitution, a register column indexed by
        the row) stays unrolled."""
        if const_expr(self.rolled >= 2):
            self._invert_rolled(sA, tidx)
        else:
            self._invert_blocks(sA, tidx)

    @cute.jit
    def _invert_rolled(self, sA, tidx):
        RA = self.RA
        warp = tidx // 32
        half = warp // 2  # warp-uniform
        i = tidx % 64
        # ---- 1. diagonal blocks (as GdnPrep._invert_blocks)
        col = cute.make_rmem_tensor((16,), Float32)
        part = cute.make_rmem_tensor((4,), Float32)
        if tidx < 64:
            j = tidx % 16
            blk = tidx // 16
            d0 = sA + blk * 16 * RA + blk * 64
            for r in cutlass.range_constexpr(16):
                part[0] = cutlass.select_(j == r, Float32(1.0), Float32(0.0))
                for e in cutlass.range_constexpr(1, 4):
                    part[e] = Float32(0.0)
                for s4 in cutlass.range_constexpr((r + 3) // 4):
                    a4 = _ld_shared_v4_f32(d0 + r * RA + s4 * 16)
                    for e in cutlass.range_constexpr(4):
                        if const_expr(4 * s4 + e < r):
                            part[e] = part[e] - a4[e] * col[4 * s4 + e]
                col[r] = (part[0] + part[1]) + (part[2] + part[3])
            cute.arch.sync_warp()  # a block's columns are one warp's lanes
            for q in cutlass.range_constexpr(4):
                _st_shared_v4_f32(d0 + j * RA + q * 16, col[4 * q], col[4 * q + 1], col[4 * q + 2], col[4 * q + 3])
        cute.arch.sync_threads()
        # ---- 2. R = A_{b+1,b} T_bb
        b0 = half * 32
        r = i // 4
        cg = i % 4
        acc = cute.make_rmem_tensor((8,), Float32)
        for e in cutlass.range_constexpr(8):
            acc[e] = Float32(0.0)
        for q in cutlass.range(4, unroll=1):
            a4 = _ld_shared_v4_f32(sA + (b0 + 16 + r) * RA + (b0 + 4 * q) * 4)
            for cc in cutlass.range_constexpr(4):
                t4 = _ld_shared_v4_f32(sA + (b0 + 4 * cg + cc) * RA + (b0 + 4 * q) * 4)
                for e in cutlass.range_constexpr(4):
                    acc[cc] = acc[cc] + a4[e] * t4[e]
        cute.arch.sync_threads()
        _st_shared_v4_f32(sA + (b0 + 16 + r) * RA + (b0 + 4 * cg) * 4, acc[0], acc[1], acc[2], acc[3])
        cute.arch.sync_threads()
        # ---- 3. T_{b+1,b} = -T_{b+1,b+1} R
        cp = i % 8
        rp = i // 8
        for e in cutlass.range_constexpr(4):
            acc[e] = Float32(0.0)
        for s4 in cutlass.range(4, unroll=1):  # 4 rows a step: the step's loads issue together
            for ss in cutlass.range_constexpr(4):
                s = s4 * 4 + ss
                rv = ptx.ld_shared_v2_f32(sA + (b0 + 16 + s) * RA + (b0 + 2 * cp) * 4)
                tv = ptx.ld_shared_v2_f32(sA + (b0 + 16 + s) * RA + (b0 + 16 + 2 * rp) * 4)
                for cc in cutlass.range_constexpr(2):
                    for rr in cutlass.range_constexpr(2):
                        acc[2 * cc + rr] = acc[2 * cc + rr] + rv[cc] * tv[rr]
        for cc in cutlass.range_constexpr(2):
            _st_shared_v2_f32(sA + (b0 + 2 * cp + cc) * RA + (b0 + 16 + 2 * rp) * 4, -acc[2 * cc], -acc[2 * cc + 1])
        cute.arch.sync_threads()
        # ---- 4. R = A_{H1,H0} T_H0: s4 over both 16-row halves for half 0, the second one only for half 1
        rq = i // 8
        c0 = half * 16 + 2 * cp
        for e in cutlass.range_constexpr(8):
            acc[e] = Float32(0.0)
        for s4 in cutlass.range(cutlass.select_(half == 0, 0, 4), 8, unroll=1):
            t0 = _ld_shared_v4_f32(sA + c0 * RA + s4 * 16)
            t1 = _ld_shared_v4_f32(sA + (c0 + 1) * RA + s4 * 16)
            for rr in cutlass.range_constexpr(4):
                a4 = _ld_shared_v4_f32(sA + (32 + 4 * rq + rr) * RA + s4 * 16)
                for e in cutlass.range_constexpr(4):
                    acc[2 * rr] = acc[2 * rr] + a4[e] * t0[e]
                    acc[2 * rr + 1] = acc[2 * rr + 1] + a4[e] * t1[e]
        cute.arch.sync_threads()
        for rr in cutlass.range_constexpr(4):
            _st_shared_v2_f32(sA + (32 + 4 * rq + rr) * RA + c0 * 4, acc[2 * rr], acc[2 * rr + 1])
        cute.arch.sync_threads()
        # ---- 5. T_{H1,H0} = -T_H1 R: s over the first 16-row half, and the second one for half 1
        cp2 = i % 16
        r0 = half * 16 + 4 * (i // 16)
        for e in cutlass.range_constexpr(8):
            acc[e] = Float32(0.0)
        for s4 in cutlass.range(cutlass.select_(half == 1, 8, 4), unroll=1):  # 4 rows a step
            for ss in cutlass.range_constexpr(4):
                s = s4 * 4 + ss
                rv = ptx.ld_shared_v2_f32(sA + (32 + s) * RA + (2 * cp2) * 4)
                tv = _ld_shared_v4_f32(sA + (32 + s) * RA + (32 + r0) * 4)
                for cc in cutlass.range_constexpr(2):
                    for rr in cutlass.range_constexpr(4):
                        acc[4 * cc + rr] = acc[4 * cc + rr] + rv[cc] * tv[rr]
        for cc in cutlass.range_constexpr(2):
            _st_shared_v4_f32(sA + (2 * cp2 + cc) * RA + (32 + r0) * 4, -acc[4 * cc], -acc[4 * cc + 1],
                              -acc[4 * cc + 2], -acc[4 * cc + 3])

    # ------------------------------------------------------------------ W, U
    @cute.jit
    def _w_u_steps(self, mW, mU, sA, sOnes, sWop, sV, blk, warp, lane):
        """The rolled ``W = T (e 2^G)``, ``U = T x`` (:meth:`~cutedsl_attn.common.kda_prep.KdaPrep._w_u`): the
        64-column halves and the k-steps ``kt <= warp`` as run-time loops (the same MMAs in the same order)."""
        C, K, V, RK, RV = self.C, self.K, self.V, self.RK, self.RV
        g = lane // 4
        t = lane % 4
        r0 = warp * 16
        for nh in cutlass.range(K // 64, unroll=1):
            accw = cute.make_rmem_tensor((32,), Float32)
            for i in cutlass.range_constexpr(32):
                accw[i] = Float32(0.0)
            self._t_nn_steps(accw, sA, sOnes, sWop, RK, r0, nh * 64, warp, lane)
            self._slab_out(mW.iterator.toint() + blk * (C * K * 2), accw, K, nh * 64, r0, g, t)
        for nh in cutlass.range(V // 64, unroll=1):
            accu = cute.make_rmem_tensor((32,), Float32)
            for i in cutlass.range_constexpr(32):
                accu[i] = Float32(0.0)
            self._t_nn_steps(accu, sA, sOnes, sV, RV, r0, nh * 64, warp, lane)
            self._slab_out(mU.iterator.toint() + blk * (C * V * 2), accu, V, nh * 64, r0, g, t)

    @cute.jit
    def _t_nn_steps(self, acc, sA, sD, sB, RB: cutlass.Constexpr, r0, n0, warp, lane):
        """:meth:`GdnPrep._gemm_t_nn` with its k-steps ``kt <= warp`` a run-time loop and a run-time ``n0``."""
        RA, io = self.RA, self.io
        g = lane // 4
        t = lane % 4
        m = lane // 8
        for kt in cutlass.range(warp + 1, unroll=1):
            a = []
            for q in cutlass.range_constexpr(4):
                s = kt * 16 + (q // 2) * 8 + 2 * t
                d = ptx.ld_shared_v2_f32(sD + s * 4)
                x = sA + s * RA + (r0 + g + (q % 2) * 8) * 4
                a.append(ptx.pack2(ptx.ld_shared_f32(x) * d[0], ptx.ld_shared_f32(x + RA) * d[1], io))
            for dp in cutlass.range_constexpr(4):
                b = ptx.ldmatrix_x4(sB + (kt * 16 + (m % 2) * 8 + lane % 8) * RB + (n0 + (2 * dp + m // 2) * 8) * 2,
                                    trans=True)
                for jj in cutlass.range_constexpr(2):
                    i = 2 * dp + jj
                    c = ptx.mma_m16n8k16(a, (b[2 * jj], b[2 * jj + 1]),
                                         (acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]), io)
                    for e in cutlass.range_constexpr(4):
                        acc[4 * i + e] = c[e]

    @cute.jit
    def _slab_out(self, base, acc, D: cutlass.Constexpr, n0, r0, g, t):
        """:meth:`GdnPrep._store_slab` with a run-time ``n0``."""
        p = base + Int64((r0 + g) * D + 2 * t + n0) * 2
        for i in cutlass.range_constexpr(8):
            for h in cutlass.range_constexpr(2):
                ptx.st_global_u32(p + (8 * h * D + 8 * i) * 2,
                                  ptx.pack2(acc[4 * i + 2 * h], acc[4 * i + 2 * h + 1], self.io))
