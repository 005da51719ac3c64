"""The prep kernel of the chunked per-channel-decay delta rule (KDA, GDN-2): one CTA per (64-token chunk, output
head), every chunk at once, on SM80-class instructions (``cp.async``, ``ldmatrix``, ``mma.sync``).  Its scratch
feeds the chunked GDN main kernel (:mod:`cutedsl_attn.portable.gdn_chunked`, per-channel branch).

Per chunk (``G_r`` the cumulative log2 decay per key channel from the chunk's start, each token's log2 gate
floored at ``GATE_FLOOR_LOG2``; ``e`` the erase key: ``beta k`` for KDA, ``b * k`` for GDN-2; ``x`` the written
value: ``beta v`` / ``w * v``; ``k``, ``q`` l2-normalised when asked)::

    A   = [e_r . (k_s 2^(G_r - G_s))]_{s < r}       T = (I + A)^-1
    Aqk = scale [q_r . (k_s 2^(G_r - G_s))]_{s <= r}
    W   = T (e 2^G)       U = T x       Qg = q 2^G       Kd = k 2^(G_last - G)

``A`` and ``Aqk`` go by 16-token sub-chunks, warp ``i`` owning rows ``16 i ..`` against the reference
``p = 16 i - 1``: row operands ``e_r 2^(G_r - G_p)``, ``q_r 2^(G_r - G_p)`` (factors ``<= 1``; built as MMA
fragments in registers) times column operands ``k_s 2^(G_p - G_s)`` (``<= 1`` for the earlier sub-chunks;
through a 16-row buffer a warp, which v takes over afterwards: two CTAs an SM at K = V = 128).  On the
diagonal block the column factor exceeds 1; where it would pass ``2^limit``
(:func:`cutedsl_attn.ref.kda_chunked.diag_limit`) or the operand would overflow the io dtype, the warp
recomputes that 16 x 16 block directly in fp32 with ``2^min(G_r - G_s, 0)`` per channel.  No factor ever
overflows, so any gate the API accepts (``g <= 0``, ``-inf`` included) gives a finite, exact result.

The scratch contract (``nc`` chunks of the plan, ``HO`` output heads, ``C = 64``):

* ``W`` ``[nc, HO, C, K]``, ``U`` ``[nc, HO, C, V]``, ``Aqk`` ``[nc, HO, C, C]``: io dtype, every row written;
* ``Qg``, ``Kd`` ``[T, HO, K]`` io dtype, token-major (the main kernel reads them as its q / k, zero past a
  chunk's end);
* ``F`` ``[nc, HO, 2 C + K]`` fp32: ``scale`` (0 past the end), 1 (0 past the end), ``2^G_last`` per channel.

:class:`KdaPrep` is a mixin over :class:`~cutedsl_attn.common.gdn_prep.GdnPrep` (whose GEMMs, loaders,
normaliser and inverse it reuses); the kernel class sets ``C``, ``K``, ``V``, ``RK``, ``RV``, ``RC``, ``RA``,
``io``, ``l2norm``, ``erase_write``, ``diag_limit``, ``io_max`` and launches ``self.prep`` with
``PREP_THREADS`` threads and :func:`prep_smem_bytes` bytes.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from . import ptx
from .constants import LOG2E
from .gdn_prep import GdnPrep, _ld_shared_v4_f32, _st_f32, _st_shared_v4_b32
from ..planning.gdn import CHUNK, FLAG_HAS_BETA, FLAG_HAS_G

SUB = 16  # tokens a sub-chunk: one warp's 16-row slab
GATE_FLOOR_LOG2 = -200.0  # 2^-200 is 0 in fp32: flooring changes nothing and keeps G finite (no inf - inf)
PREP_THREADS = 128
IO_MAX = {"bfloat16": 3.0e38, "float16": 65000.0}  # the largest operand the diagonal block's factored path writes
DIAG_LIMIT = {"bfloat16": 96.0, "float16": 4.0}  # log2; ref.kda_chunked.diag_limit (the CPU test checks)

_inline = cute.arch.inline_ptx


def row_pitch_g(head_dim_k: int) -> int:
    """Bytes of one fp32 row of G in shared memory (16-byte pad)."""
    return 4 * head_dim_k + 16


def prep_smem_bytes(head_dim_k: int, head_dim_v: int) -> int:
    """Dynamic shared memory of one prep CTA: q (A, fp32, takes its place), k (then T), e (16-bit), G (fp32),
    the four warps' column blocks (then v) and three fp32 vectors; two CTAs an SM fit at K = V = 128."""
    rk, rv, ra = 2 * head_dim_k + 16, 2 * head_dim_v + 16, 4 * (CHUNK + 4)
    c = CHUNK
    return c * max(rk, ra) + 2 * c * rk + c * row_pitch_g(head_dim_k) + max(4 * SUB * rk, c * rv) + 3 * c * 4


def _ld_nc_v4_f32(addr):
    return _inline("ld.global.nc.v4.f32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];", write_only_types=[Float32] * 4,
                   read_only_args=[Int64(addr)])


def _g8(addr) -> list:
    """Eight fp32 at a 16-byte aligned shared address."""
    return list(_ld_shared_v4_f32(addr)) + list(_ld_shared_v4_f32(addr + 16))


def _x8(addr, io) -> list:
    """Eight 16-bit values at a 16-byte aligned shared address, widened to fp32."""
    out = []
    for wd in ptx.ld_shared_v4_b32(addr):
        lo, hi = ptx.unpack2(wd, io)
        out += [lo, hi]
    return out


def _st8(addr, vals, io):
    _st_shared_v4_b32(addr, [ptx.pack2(vals[2 * q], vals[2 * q + 1], io) for q in range(4)])


class KdaPrep(GdnPrep):
    """The per-channel prep kernel (``prep``); a mixin, see the module docstring."""

    @cute.kernel
    def prep(self, mQ, mK, mV, mG, mBeta, mChunks, mQg, mKd, mW, mU, mAqk, mF, scale: Float32, q_group: Int32,
             k_group: Int32, v_group: Int32, flags: Int32):
        """One CTA per (chunk, output head): ``W``, ``U``, ``Aqk``, ``Qg``, ``Kd`` and ``F`` of the chunk."""
        C, K, V, RK, RV, RC, RA, io = self.C, self.K, self.V, self.RK, self.RV, self.RC, self.RA, self.io
        RG = row_pitch_g(K)
        tidx, _, _ = cute.arch.thread_idx()
        c, ho, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        g = lane // 4
        t = lane % 4
        HO = mW.shape[1]
        tok0 = mChunks[c, 1]
        ln = mChunks[c, 2]
        if ln > 0:
            smem = cute.arch.get_dyn_smem(cutlass.Int8, alignment=128).toint()
            sQ = smem
            sA = smem  # A (fp32) takes q's place once Qg is written
            sK = sQ + C * max(RK, RA)
            sT = sK  # T takes k's place once Kd is written
            sE = sK + C * RK
            sG = sE + C * RK
            sBuf = sG + C * RG  # the warps' column operands, then v (loaded once they are done)
            sV = sBuf
            sRq = sBuf + max(4 * SUB * RK, C * RV)
            sRk = sRq + C * 4
            sB = sRk + C * 4
            qh = ho // q_group
            kh = ho // k_group
            vh = ho // v_group
            self._load_rows(mQ, sQ, RK, K, tok0, ln, qh, tidx, PREP_THREADS)
            self._load_rows(mK, sK, RK, K, tok0, ln, kh, tidx, PREP_THREADS)
            self._load_gates(mG, sG, RG, tok0, ln, ho, HO, flags, tidx)
            ptx.cp_async_commit()
            if const_expr(not self.erase_write):
                if tidx < C:
                    b = Float32(0.0)  # beta = 0 past the chunk's end
                    if tidx < ln:
                        b = Float32(1.0)
                        if (flags & FLAG_HAS_BETA) != 0:
                            b = mBeta[tok0 + tidx, ho]
                    ptx.st_shared_f32(sB + tidx * 4, b)
            ptx.cp_async_wait(0)
            cute.arch.sync_threads()

            # l2 normalisers (each warp its 16 rows of q and k); cumulative log2 decay (a thread a channel)
            self._normalise_rows(sQ, sRq, warp, lane)
            self._normalise_rows(sK, sRk, warp, lane)
            if tidx < K:
                run = Float32(0.0)
                for r in cutlass.range_constexpr(C):
                    x = ptx.ld_shared_f32(sG + r * RG + tidx * 4)
                    run = run + cutlass.max(x * Float32(LOG2E), Float32(GATE_FLOOR_LOG2))
                    ptx.st_shared_f32(sG + r * RG + tidx * 4, run)
            cute.arch.sync_threads()
            self._gate_rows(mBeta, sK, sE, self.RK, K, 0, sB, tok0, ln, ho, HO, flags, tidx, PREP_THREADS)
            cute.arch.sync_threads()

            # this warp's 16 rows of A and Aqk, one 16-column block at a time (blocks past the diagonal are 0):
            # the row operands as MMA fragments in registers, the column block through the warp's buffer
            r0 = warp * SUB
            p = r0 - 1
            bufK = sBuf + warp * (SUB * RK)
            acc_kk = [cute.make_rmem_tensor((8,), Float32) for _ in range(C // SUB)]
            acc_qk = [cute.make_rmem_tensor((8,), Float32) for _ in range(C // SUB)]
            bad = cute.make_rmem_tensor((1,), Float32)
            bad[0] = Float32(0.0)
            for j in cutlass.range_constexpr(C // SUB):
                for e in cutlass.range_constexpr(8):
                    acc_kk[j][e] = Float32(0.0)
                    acc_qk[j][e] = Float32(0.0)
                if j <= warp:
                    bj = self._decay_cols(bufK - j * SUB * RK, sK, sG, j * SUB, p, lane)
                    bad[0] = cutlass.select_(warp == j, bj, bad[0])
                    cute.arch.sync_warp()
                    self._mma_rows(acc_kk[j], acc_qk[j], sE, sQ, sG, RG, r0, p, bufK, lane)
                    cute.arch.sync_warp()
            if cute.arch.vote_any_sync(bad[0] > Float32(0.0)):
                dkk = cute.make_rmem_tensor((8,), Float32)
                dqk = cute.make_rmem_tensor((8,), Float32)
                self._diag_direct(dkk, dqk, sE, sQ, sK, sG, RG, r0, g, t)
                for j in cutlass.range_constexpr(C // SUB):
                    if warp == j:
                        for e in cutlass.range_constexpr(8):
                            acc_kk[j][e] = dkk[e]
                            acc_qk[j][e] = dqk[e]
            cute.arch.sync_threads()  # every warp is done with the raw rows and its buffer

            # v into the buffers' place (its load overlaps what follows); Qg, Kd -> token-major scratch, e 2^G
            # in place (the W operand), the row factors
            self._load_rows(mV, sV, RV, V, tok0, ln, vh, tidx, PREP_THREADS)
            ptx.cp_async_commit()
            self._decay_out(mQg, mKd, sQ, sE, sK, sG, RG, tok0, ln, ho, HO, tidx)
            blk = Int64(c) * HO + ho
            if tidx < C:
                f_base = mF.iterator.toint() + blk * ((2 * C + K) * 4)
                ok = tidx < ln
                _st_f32(f_base + tidx * 4, cutlass.select_(ok, scale, Float32(0.0)))
                _st_f32(f_base + (C + tidx) * 4, cutlass.select_(ok, Float32(1.0), Float32(0.0)))
                for d0 in cutlass.range_constexpr(0, K, C):
                    gl = ptx.ld_shared_f32(sG + (C - 1) * RG + (d0 + tidx) * 4)
                    _st_f32(f_base + (2 * C + d0 + tidx) * 4, ptx.ex2(gl))
            cute.arch.sync_threads()  # q and k are dead: A and T take their place

            aqk_base = mAqk.iterator.toint() + blk * (C * C * 2)
            for j in cutlass.range_constexpr(C // SUB):
                for jj in cutlass.range_constexpr(2):
                    s0 = j * SUB + jj * 8 + 2 * t
                    for h in cutlass.range_constexpr(2):
                        r = r0 + g + 8 * h
                        for e2 in cutlass.range_constexpr(2):
                            val = acc_kk[j][4 * jj + 2 * h + e2]
                            ptx.st_shared_f32(sA + r * RA + (s0 + e2) * 4,
                                              cutlass.select_(s0 + e2 < r, val, Float32(0.0)))
                        v0 = cutlass.select_(s0 <= r, scale * acc_qk[j][4 * jj + 2 * h], Float32(0.0))
                        v1 = cutlass.select_(s0 + 1 <= r, scale * acc_qk[j][4 * jj + 2 * h + 1], Float32(0.0))
                        ptx.st_global_u32(aqk_base + (r * C + s0) * 2, ptx.pack2(v0, v1, io))
            ptx.cp_async_wait(0)
            cute.arch.sync_threads()

            # warps 0-1 invert (I + A); warps 2-3 meanwhile scale v by the write gate (KDA: beta) in place
            if tidx < C:
                self._invert_column(sA, sT, tidx)
            else:
                self._gate_rows(mBeta, sV, sV, RV, V, K, sB, tok0, ln, ho, HO, flags, tidx - C, PREP_THREADS - C)
            cute.arch.sync_threads()

            # W = T (e 2^G), U = T x -> chunk-major scratch
            accw = cute.make_rmem_tensor(((K // 8) * 4,), Float32)
            for i in cutlass.range_constexpr((K // 8) * 4):
                accw[i] = Float32(0.0)
            self._gemm_nn(accw, sT, RC, r0, sE, RK, 0, K // 8, C // 16, warp, lane)
            self._store_rows(mW.iterator.toint() + blk * (C * K * 2), accw, K, r0, g, t)
            accu = cute.make_rmem_tensor(((V // 8) * 4,), Float32)
            for i in cutlass.range_constexpr((V // 8) * 4):
                accu[i] = Float32(0.0)
            self._gemm_nn(accu, sT, RC, r0, sV, RV, 0, V // 8, C // 16, warp, lane)
            self._store_rows(mU.iterator.toint() + blk * (C * V * 2), accu, V, r0, g, t)

    @cute.jit
    def _load_gates(self, mG, sG, RG: cutlass.Constexpr, tok0, ln, ho, HO, flags, tidx):
        """cp.async the chunk's log gates ``[C, K]`` fp32 (contiguous ``[T, HO, K]``) into sG; 0 past ``ln`` and
        without g."""
        K = self.K
        cpr = K // 4
        base = mG.iterator.toint()
        has_g = (flags & FLAG_HAS_G) != 0
        for it in cutlass.range_constexpr((self.C * cpr) // PREP_THREADS):
            idx = it * PREP_THREADS + tidx
            r = idx // cpr
            col = idx % cpr
            ok = (r < ln) & has_g
            row = cutlass.select_(ok, Int64(tok0 + r) * HO + ho, Int64(0))
            ptx.cp_async_16(sG + r * RG + col * 16, base + (row * K + col * 4) * 4, cutlass.select_(ok, 16, 0))

    @cute.jit
    def _gate_rows(self, mBeta, src, dst, RB: cutlass.Constexpr, D: cutlass.Constexpr, off: cutlass.Constexpr, sB,
                   tok0, ln, ho, HO, flags, idx0, nthreads: cutlass.Constexpr):
        """``dst = gate * src`` over the chunk's ``[C, D]`` 16-bit rows (io dtype, fp32 math): KDA's beta a row
        (sB), or GDN-2's gates ``beta[t, ho, off .. off + D]`` of ``[T, HO, K + V]`` (erase: ``off = 0``,
        write: ``off = K``; 1 without beta)."""
        K, V, io = self.K, self.V, self.io
        has_b = (flags & FLAG_HAS_BETA) != 0
        base = mBeta.iterator.toint()
        cpr = D // 8
        for it in cutlass.range_constexpr((self.C * cpr) // nthreads):
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

    @cute.jit
    def _mma_rows(self, acc_kk, acc_qk, sE, sQ, sG, RG: cutlass.Constexpr, r0, p, bufK, lane):
        """acc_kk += E_rows bufK^T and acc_qk += Q_rows bufK^T over K (two n8 tiles: the buffer's 16 rows), the
        row operands ``e_r 2^(G_r - G_p)`` and ``q_r 2^(G_r - G_p)`` of rows ``r0 .. r0 + 16`` (``G_p = 0`` for
        ``p < 0``; factors ``<= 1``) built as ``mma.m16n8k16`` A fragments in registers, a k-step at a time,
        rounded to the io dtype."""
        RK, io = self.RK, self.io
        m = lane // 8
        g = lane // 4
        t = lane % 4
        gp_row = sG + cutlass.max(p, 0) * RG
        for kk in cutlass.range_constexpr(self.K // 16):
            fe, fq = [], []
            for q in cutlass.range_constexpr(4):
                r = r0 + g + 8 * (q % 2)
                col = kk * 16 + 8 * (q // 2) + 2 * t
                gr = ptx.ld_shared_v2_f32(sG + r * RG + col * 4)
                gp = ptx.ld_shared_v2_f32(gp_row + col * 4)
                f0 = ptx.ex2(gr[0] - cutlass.select_(p >= 0, gp[0], Float32(0.0)))
                f1 = ptx.ex2(gr[1] - cutlass.select_(p >= 0, gp[1], Float32(0.0)))
                e0, e1 = ptx.unpack2(ptx.ld_shared_b32(sE + r * RK + col * 2), io)
                q0, q1 = ptx.unpack2(ptx.ld_shared_b32(sQ + r * RK + col * 2), io)
                fe.append(ptx.pack2(e0 * f0, e1 * f1, io))
                fq.append(ptx.pack2(q0 * f0, q1 * f1, io))
            b = ptx.ldmatrix_x4(bufK + ((m // 2) * 8 + lane % 8) * RK + (kk * 16 + (m % 2) * 8) * 2)
            for jj in cutlass.range_constexpr(2):
                for which in cutlass.range_constexpr(2):
                    a = fe if which == 0 else fq
                    acc = acc_kk if which == 0 else acc_qk
                    cc = ptx.mma_m16n8k16((a[0], a[1], a[2], a[3]), (b[2 * jj], b[2 * jj + 1]),
                                          (acc[4 * jj], acc[4 * jj + 1], acc[4 * jj + 2], acc[4 * jj + 3]), io)
                    for e in cutlass.range_constexpr(4):
                        acc[4 * jj + e] = cc[e]

    @cute.jit
    def _decay_cols(self, dst, sK, sG, s0, p, lane):
        """One warp: rows ``s0 .. s0 + 16`` of sK times ``2^min(G_p - G_s, limit)`` into ``dst + s RK``.
        Returns how far this lane's elements exceed the factored path's bounds (``> 0``: recompute the block
        directly): the exponent past ``limit``, or an operand past the io dtype's range."""
        K, RK, io = self.K, self.RK, self.io
        RG = row_pitch_g(K)
        lim = Float32(self.diag_limit)
        cpr = K // 8
        gp_row = sG + cutlass.max(p, 0) * RG
        bad = Float32(-1.0)
        for it in cutlass.range_constexpr((SUB * cpr) // 32):
            ci = it * 32 + lane
            s = s0 + ci // cpr
            col = ci % cpr
            gs = _g8(sG + s * RG + col * 32)
            gp = _g8(gp_row + col * 32)
            x = _x8(sK + s * RK + col * 16, io)
            out = []
            for e in cutlass.range_constexpr(8):
                xe = cutlass.select_(p >= 0, gp[e], Float32(0.0)) - gs[e]
                bad = cutlass.max(bad, xe - lim)
                y = x[e] * ptx.ex2(cutlass.min(xe, lim))
                bad = cutlass.max(bad, cutlass.max(y, -y) - Float32(self.io_max))
                out.append(y)
            _st8(dst + s * RK + col * 16, out, io)
        return bad

    @cute.jit
    def _diag_direct(self, dkk, dqk, sE, sQ, sK, sG, RG: cutlass.Constexpr, r0, g, t):
        """This thread's 8 entries (its C fragments of the two n8 tiles) of the warp's diagonal 16 x 16 block
        of ``e_r . k_s 2^(G_r - G_s)`` and ``q_r . k_s 2^(G_r - G_s)``, directly in fp32 (exponents clamped to
        ``<= 0``: the entries above the diagonal, masked later, stay finite)."""
        RK, io = self.RK, self.io
        for e in cutlass.range_constexpr(8):
            dkk[e] = Float32(0.0)
            dqk[e] = Float32(0.0)
        for d2 in cutlass.range(self.K // 2, unroll=2):
            d = d2 * 2
            gr, er, qr = [], [], []
            for h in cutlass.range_constexpr(2):
                r = r0 + g + 8 * h
                gr.append(ptx.ld_shared_v2_f32(sG + r * RG + d * 4))
                er.append(ptx.unpack2(ptx.ld_shared_b32(sE + r * RK + d * 2), io))
                qr.append(ptx.unpack2(ptx.ld_shared_b32(sQ + r * RK + d * 2), io))
            gs, ks = [], []
            for cc in cutlass.range_constexpr(4):
                s = r0 + 8 * (cc // 2) + 2 * t + cc % 2
                gs.append(ptx.ld_shared_v2_f32(sG + s * RG + d * 4))
                ks.append(ptx.unpack2(ptx.ld_shared_b32(sK + s * RK + d * 2), io))
            for jj in cutlass.range_constexpr(2):
                for h in cutlass.range_constexpr(2):
                    for e2 in cutlass.range_constexpr(2):
                        cc = 2 * jj + e2
                        i = 4 * jj + 2 * h + e2
                        for dd in cutlass.range_constexpr(2):
                            kf = ks[cc][dd] * ptx.ex2(cutlass.min(gr[h][dd] - gs[cc][dd], Float32(0.0)))
                            dkk[i] = dkk[i] + er[h][dd] * kf
                            dqk[i] = dqk[i] + qr[h][dd] * kf

    @cute.jit
    def _decay_out(self, mQg, mKd, sQ, sE, sK, sG, RG: cutlass.Constexpr, tok0, ln, ho, HO, tidx):
        """Every thread: ``q 2^G`` and ``k 2^(G_last - G)`` (rows ``< ln``) -> rows ``tok0 ..`` of head ``ho``
        of the token-major ``[T, HO, K]`` scratch; sE times ``2^G`` in place (the W operand)."""
        K, RK, io, C = self.K, self.RK, self.io, self.C
        cpr = K // 8
        gl_row = sG + (C - 1) * RG
        qg_base = mQg.iterator.toint()
        kd_base = mKd.iterator.toint()
        for it in cutlass.range_constexpr((C * cpr) // PREP_THREADS):
            ci = it * PREP_THREADS + tidx
            r = ci // cpr
            col = ci % cpr
            gr = _g8(sG + r * RG + col * 32)
            gl = _g8(gl_row + col * 32)
            f = [ptx.ex2(gr[e]) for e in range(8)]
            x = _x8(sE + r * RK + col * 16, io)
            _st8(sE + r * RK + col * 16, [x[e] * f[e] for e in range(8)], io)
            xq = _x8(sQ + r * RK + col * 16, io)
            wq = [ptx.pack2(xq[2 * i] * f[2 * i], xq[2 * i + 1] * f[2 * i + 1], io) for i in range(4)]
            xk = _x8(sK + r * RK + col * 16, io)
            wk = [ptx.pack2(xk[2 * i] * ptx.ex2(gl[2 * i] - gr[2 * i]),
                            xk[2 * i + 1] * ptx.ex2(gl[2 * i + 1] - gr[2 * i + 1]), io) for i in range(4)]
            if r < ln:
                off = ((Int64(tok0 + r) * HO + ho) * K + col * 8) * 2
                ptx.st_global_v4_b32(qg_base + off, wq[0], wq[1], wq[2], wq[3])
                ptx.st_global_v4_b32(kd_base + off, wk[0], wk[1], wk[2], wk[3])
