"""The prep kernel of the chunked gated delta rule (GDN): one CTA per (64-token chunk, output head), every chunk
at once, on SM80-class instructions (``cp.async``, ``ldmatrix``, ``mma.sync``).  Shared by the chunked kernels'
main kernels (the portable one and the SM90 one), which read its scratch.

Per chunk (cumulative log2 decay ``G_r``, ``gamma_r = 2^G_r``, ``Gamma_rs = 2^(G_r - G_s)``; ``k``, ``q``
l2-normalised when asked)::

    A   = strict_tril(diag(beta) K K^T . Gamma)           T = (I + A)^-1 (unit lower triangular)
    W   = T diag(beta gamma) K       U = T diag(beta) V  Aqk = scale tril(Q K^T . Gamma)  (diagonal kept)

``T`` is computed in fp32 by 16 x 16 blocks (the diagonal blocks by forward substitution, then two levels of
merges, every thread busy: :meth:`GdnPrep._invert_blocks`); the ``W`` / ``U`` products take ``T diag(beta
gamma)`` and ``T diag(beta)`` rounded to the io dtype (K and V enter as loaded, k l2-normalised).

The scratch contract (``nc`` chunks of the plan, ``HO`` output heads, ``C = 64``):

* ``W`` ``[nc, HO, C, K]``, ``U`` ``[nc, HO, C, V]``, ``Aqk`` ``[nc, HO, C, C]``: io dtype, row-major, every
  row written (rows past the chunk's end are finite: beta is 0 there);
* ``F`` ``[nc, HO, 3, C]`` fp32: ``scale * rq * gamma`` (0 past the end), ``rk * gamma_last / gamma`` (0 past
  the end), ``gamma_last`` (every entry) -- ``rq``, ``rk`` the l2 normalisers, 1 without l2norm.

:class:`GdnPrep` is a mixin: the kernel class using it sets ``C``, ``K``, ``V``, ``RK``, ``RV``, ``RC``, ``RA``
(shared-memory row pitches in bytes: :func:`row_pitches`), ``io`` (the CuTe element type), ``log_gate``,
``l2norm`` and launches ``self.prep`` with ``PREP_THREADS`` threads and :func:`prep_smem_bytes` bytes (four
CTAs an SM fit with ``min_blocks_per_mp=PREP_CTAS_PER_SM`` and ``preferred_smem_carveout=PREP_SMEM_CARVEOUT``,
which cap the registers at 128 a thread).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from . import ptx
from .constants import LOG2E
from ..planning.gdn import CHUNK, FLAG_HAS_BETA, FLAG_HAS_G

L2NORM_EPS = 1e-6
LINEAR_GATE_FLOOR = 1e-30  # alpha = 0 becomes 2^-100: a finite log2 (no inf - inf in the decay differences)
PREP_THREADS = 128
#: prep CTAs an SM the launch asks for (``min_blocks_per_mp``: 128 registers a thread; the shared memory fits 4)
PREP_CTAS_PER_SM = 4
#: the prep launch's preferred shared-memory carveout (percent): the most shared memory, for 4 CTAs an SM
PREP_SMEM_CARVEOUT = 100

_inline = cute.arch.inline_ptx


def row_pitches(head_dim_k: int, head_dim_v: int) -> tuple[int, int, int, int]:
    """(RK, RV, RC, RA): the prep kernel's shared-memory row pitches in bytes (16-bit rows of K, V and C
    elements padded by 16 bytes for conflict-free ldmatrix; fp32 rows of A, 16-byte aligned)."""
    return 2 * head_dim_k + 16, 2 * head_dim_v + 16, 2 * CHUNK + 16, 4 * (CHUNK + 4)


def prep_smem_bytes(head_dim_k: int, head_dim_v: int) -> int:
    """Dynamic shared memory of one prep CTA: Q (A, fp32, takes its place once Aqk is written, then T^T), K, V
    and five fp32 rows (53504 B at K = V = 128: four CTAs an SM)."""
    rk, rv, _rc, ra = row_pitches(head_dim_k, head_dim_v)
    c = CHUNK
    return c * max(rk, ra) + c * rk + c * rv + 5 * c * 4


def _ld_shared_v4_f32(addr):
    return _inline("ld.shared.v4.f32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];", write_only_types=[Float32] * 4,
                   read_only_args=[Int32(addr)])


def _st_shared_v4_f32(addr, a, b, c, d):
    _inline("st.shared.v4.f32 [{$r0}], { {$r1}, {$r2}, {$r3}, {$r4} };",
            read_only_args=[Int32(addr), Float32(a), Float32(b), Float32(c), Float32(d)])


def _st_shared_v2_f32(addr, a, b):
    _inline("st.shared.v2.f32 [{$r0}], { {$r1}, {$r2} };", read_only_args=[Int32(addr), Float32(a), Float32(b)])


def _st_f32(addr, a):
    _inline("st.global.f32 [{$r0}], {$r1};", read_only_args=[Int64(addr), Float32(a)])


def _rsqrt(x):
    return _inline("rsqrt.approx.ftz.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[Float32(x)])


def _st_shared_v2_b32(addr, a, b):
    _inline("st.shared.v2.b32 [{$r0}], { {$r1}, {$r2} };", read_only_args=[Int32(addr), Int32(a), Int32(b)])


def _st_shared_v4_b32(addr, words):
    _inline("st.shared.v4.b32 [{$r0}], { {$r1}, {$r2}, {$r3}, {$r4} };",
            read_only_args=[Int32(addr)] + [Int32(w) for w in words])


def _normalise_batch(addrs, K: int, io) -> list:
    """One warp: each 16-bit row at ``addrs`` (this lane's ``K / 32`` elements of it) times
    ``rsqrt(sum x^2 + eps)`` in place; returns the normalisers (fp32, every lane).  All loads first, the
    butterflies of all rows interleaved, then the stores."""
    words = [list(ptx.ld_shared_v2_b32(a)) if K == 128 else [ptx.ld_shared_b32(a)] for a in addrs]
    vals = []
    for ws in words:
        v = []
        for wd in ws:
            v += list(ptx.unpack2(wd, io))
        vals.append(v)
    ss = []
    for v in vals:
        acc = v[0] * v[0]
        for x in v[1:]:
            acc = acc + x * x
        ss.append(acc)
    for sh in range(5):
        ss = [x + cute.arch.shuffle_sync_bfly(x, offset=16 >> sh) for x in ss]
    norms = [_rsqrt(x + Float32(L2NORM_EPS)) for x in ss]
    for a, v, rn in zip(addrs, vals, norms):
        packed = [ptx.pack2(v[2 * j] * rn, v[2 * j + 1] * rn, io) for j in range(len(v) // 2)]
        if K == 128:
            _st_shared_v2_b32(a, packed[0], packed[1])
        else:
            ptx.st_shared_b32(a, packed[0])
    return norms


class GdnPrep:
    """The prep kernel (``prep``) and the warp-level ``mma.sync`` GEMMs on shared memory it uses (also used by
    the portable main kernel); a mixin, see the module docstring."""

    #: False: the grid is ``(chunks, HO)``.  True: a 1-D grid of ``chunks * HO`` CTAs, the heads of a chunk
    #: adjacent, so the output heads sharing a q / k head (GVA) read its rows from L2 rather than DRAM.
    prep_heads_fastest = False

    # ================================================================== warp-level GEMMs on shared memory
    # Each computes a 16-row slab: acc[4 i + e] is C-fragment element e of n8 tile i (ptx module docstring).
    @cute.jit
    def _gemm_nt(self, acc, sA, RA: cutlass.Constexpr, a_row0, sB, RB: cutlass.Constexpr, b_row0,
                 n_tiles: cutlass.Constexpr, k_steps: cutlass.Constexpr, lane):
        """acc += A[a_row0:+16, :] B[b_row0:, :]^T; A ``[M, k]`` and B ``[n, k]`` row-major 16-bit."""
        m = lane // 8
        for kk in cutlass.range_constexpr(k_steps):
            a = ptx.ldmatrix_x4(sA + (a_row0 + (m % 2) * 8 + lane % 8) * RA + (kk * 16 + (m // 2) * 8) * 2)
            for j2 in cutlass.range_constexpr(n_tiles // 2):
                b = ptx.ldmatrix_x4(sB + (b_row0 + j2 * 16 + (m // 2) * 8 + lane % 8) * RB
                                    + (kk * 16 + (m % 2) * 8) * 2)
                for jj in cutlass.range_constexpr(2):
                    i = 2 * j2 + jj
                    c = ptx.mma_m16n8k16(a, (b[2 * jj], b[2 * jj + 1]),
                                         (acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]), self.io)
                    for e in cutlass.range_constexpr(4):
                        acc[4 * i + e] = c[e]

    @cute.jit
    def _mma_nn_step(self, acc, a, sB, RB: cutlass.Constexpr, kt: cutlass.Constexpr, n0,
                     n_tiles: cutlass.Constexpr, lane):
        m = lane // 8
        for dp in cutlass.range_constexpr(n_tiles // 2):
            b = ptx.ldmatrix_x4(sB + (kt * 16 + (m % 2) * 8 + lane % 8) * RB + (n0 + (2 * dp + m // 2) * 8) * 2,
                                trans=True)
            for jj in cutlass.range_constexpr(2):
                i = 2 * dp + jj
                c = ptx.mma_m16n8k16(a, (b[2 * jj], b[2 * jj + 1]),
                                     (acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]), self.io)
                for e in cutlass.range_constexpr(4):
                    acc[4 * i + e] = c[e]

    @cute.jit
    def _gemm_nn(self, acc, sA, RA: cutlass.Constexpr, a_row0, sB, RB: cutlass.Constexpr, n0,
                 n_tiles: cutlass.Constexpr, k_steps: cutlass.Constexpr, k_last, lane):
        """acc += A[a_row0:+16, :] B[:, n0:]; A ``[M, k]`` and B ``[k, n]`` row-major 16-bit; k-steps past
        ``k_last`` (a warp-uniform run-time bound: A is zero there) are skipped."""
        m = lane // 8
        for kt in cutlass.range_constexpr(k_steps):
            if kt <= k_last:
                a = ptx.ldmatrix_x4(sA + (a_row0 + (m % 2) * 8 + lane % 8) * RA + (kt * 16 + (m // 2) * 8) * 2)
                self._mma_nn_step(acc, a, sB, RB, kt, n0, n_tiles, lane)

    @cute.kernel
    def prep(self, mQ, mK, mV, mG, mBeta, mChunks, mW, mU, mAqk, mF, scale: Float32, q_group: Int32,
             k_group: Int32, v_group: Int32, flags: Int32):
        """One CTA per (chunk, output head): ``W``, ``U``, ``Aqk`` and the row factors of the chunk."""
        C, K, V, RK, RV, RA = self.C, self.K, self.V, self.RK, self.RV, self.RA
        tidx, _, _ = cute.arch.thread_idx()
        HO = mW.shape[1]
        c, ho, _ = cute.arch.block_idx()
        if const_expr(self.prep_heads_fastest):
            bid = c
            c = bid // HO
            ho = bid - c * HO
        lane = tidx % 32
        warp = tidx // 32
        g = lane // 4
        t = lane % 4
        tok0 = mChunks[c, 1]
        ln = mChunks[c, 2]
        if ln > 0:
            smem = cute.arch.get_dyn_smem(cutlass.Int8, alignment=128).toint()
            sQ = smem
            sA = smem  # A replaces Q once Aqk is written
            sK = sQ + C * max(RK, RA)
            sV = sK + C * RK
            sG = sV + C * RV
            sB = sG + C * 4
            sRq = sB + C * 4
            sRk = sRq + C * 4
            sBG = sRk + C * 4  # beta gamma
            qh = ho // q_group
            kh = ho // k_group
            vh = ho // v_group
            self._load_rows(mQ, sQ, RK, K, tok0, ln, qh, tidx, PREP_THREADS)
            self._load_rows(mK, sK, RK, K, tok0, ln, kh, tidx, PREP_THREADS)
            ptx.cp_async_commit()
            # V is first read by the U GEMM: it lands while Aqk, K K^T and the inverse are computed
            self._load_rows(mV, sV, RV, V, tok0, ln, vh, tidx, PREP_THREADS)
            ptx.cp_async_commit()
            self._gates_to_smem(mG, mBeta, sG, sB, tok0, ln, ho, flags, tidx)
            ptx.cp_async_wait(1)
            cute.arch.sync_threads()

            # cumulative log2 decay (warp 0) and the l2 normalisers (every warp, its 16 rows of q and k)
            if warp == 0:
                self._cumsum_gates(sG, sB, sBG, lane)
            self._normalise_rows(sQ, sRq, warp, lane)
            self._normalise_rows(sK, sRk, warp, lane)
            cute.arch.sync_threads()
            blk = Int64(c) * HO + ho

            r0 = warp * 16
            gr = cute.make_rmem_tensor((2,), Float32)
            br = cute.make_rmem_tensor((2,), Float32)
            for h in cutlass.range_constexpr(2):
                gr[h] = ptx.ld_shared_f32(sG + (r0 + g + 8 * h) * 4)
                br[h] = ptx.ld_shared_f32(sB + (r0 + g + 8 * h) * 4)
            # Aqk = scale tril(Q K^T . Gamma) -> global, then K K^T (one accumulator live at a time); then
            # A = strict_tril(diag(beta) K K^T . Gamma) -> sA (fp32, over Q)
            self._aqk_rows(mAqk, sQ, sK, sG, blk, r0, scale, lane)
            cute.arch.sync_warp()  # the K K^T loads stay below: the two accumulators are not live at once
            acc = cute.make_rmem_tensor(((C // 8) * 4,), Float32)
            for i in cutlass.range_constexpr((C // 8) * 4):
                acc[i] = Float32(0.0)
            self._gemm_nt(acc, sK, RK, r0, sK, RK, 0, C // 8, K // 16, lane)
            cute.arch.sync_threads()  # every warp is done with Q
            for i in cutlass.range_constexpr(C // 8):
                if i <= 2 * warp + 1:  # A right of the diagonal block is never read (the inverse writes T^T there)
                    self._a_tile(sA, sG, acc, br, gr, r0, i, g, t)
            cute.arch.sync_threads()

            # T = (I + A)^-1 by 16 x 16 blocks (fp32, T^T left in sA)
            self._invert_blocks(sA, tidx)
            ptx.cp_async_wait(0)
            cute.arch.sync_threads()

            # W = (T diag(beta gamma)) K, U = (T diag(beta)) V -> global (io dtype); the scaled T rounded to it
            # 64 columns at a time: 32 accumulators live, not 64 (128 registers a thread without spills)
            for nh in cutlass.range_constexpr(K // 64):
                accw = cute.make_rmem_tensor((32,), Float32)
                for i in cutlass.range_constexpr(32):
                    accw[i] = Float32(0.0)
                self._gemm_t_nn(accw, sA, sBG, sK, RK, r0, nh * 64, warp, lane)
                self._store_slab(mW.iterator.toint() + blk * (C * K * 2), accw, K, nh * 64, r0, g, t)
            for nh in cutlass.range_constexpr(V // 64):
                accu = cute.make_rmem_tensor((32,), Float32)
                for i in cutlass.range_constexpr(32):
                    accu[i] = Float32(0.0)
                self._gemm_t_nn(accu, sA, sB, sV, RV, r0, nh * 64, warp, lane)
                self._store_slab(mU.iterator.toint() + blk * (C * V * 2), accu, V, nh * 64, r0, g, t)

            # row factors: scale rq gamma (the Q S^T rows), rk gamma_last / gamma (the state-update rows)
            self._row_factors(mF, sG, sRq, sRk, blk, ln, scale, tidx)


    @cute.jit
    def _gates_to_smem(self, mG, mBeta, sG, sB, tok0, ln, ho, flags, tidx):
        """log2 alpha (0, i.e. alpha = 1, past the chunk's end) and beta (0 past the end) of the chunk's tokens
        -> the fp32 rows at ``sG``, ``sB`` (threads ``tidx < C``)."""
        if tidx < self.C:
            lg = Float32(0.0)
            b = Float32(0.0)
            if tidx < ln:
                b = Float32(1.0)
                if (flags & FLAG_HAS_BETA) != 0:
                    b = mBeta[tok0 + tidx, ho]
                if (flags & FLAG_HAS_G) != 0:
                    x = mG[tok0 + tidx, ho]
                    if const_expr(self.log_gate):
                        lg = x * Float32(LOG2E)
                    else:
                        lg = ptx.lg2(cutlass.max(x, Float32(LINEAR_GATE_FLOOR)))
            ptx.st_shared_f32(sG + tidx * 4, lg)
            ptx.st_shared_f32(sB + tidx * 4, b)

    @cute.jit
    def _cumsum_gates(self, sG, sB, sBG, lane):
        """One warp: ``sG`` <- its inclusive prefix sum (the cumulative log2 decay G), ``sBG`` <- beta 2^G."""
        x0 = ptx.ld_shared_f32(sG + (2 * lane) * 4)
        x1 = ptx.ld_shared_f32(sG + (2 * lane + 1) * 4)
        s = x0 + x1
        for sh in cutlass.range_constexpr(5):
            y = cute.arch.shuffle_sync_up(s, offset=1 << sh)
            if lane >= (1 << sh):
                s = s + y
        ptx.st_shared_f32(sG + (2 * lane) * 4, s - x1)
        ptx.st_shared_f32(sG + (2 * lane + 1) * 4, s)
        b2 = ptx.ld_shared_v2_f32(sB + (2 * lane) * 4)
        _st_shared_v2_f32(sBG + (2 * lane) * 4, b2[0] * ptx.ex2(s - x1), b2[1] * ptx.ex2(s))

    @cute.jit
    def _row_factors(self, mF, sG, sRq, sRk, blk, ln, scale, tidx):
        """F of scratch block ``blk``: ``scale rq gamma`` and ``rk gamma_last / gamma`` (0 past the chunk's end),
        ``gamma_last`` (threads ``tidx < C``)."""
        C = self.C
        if tidx < C:
            gl = ptx.ld_shared_f32(sG + (ln - 1) * 4)
            gt = ptx.ld_shared_f32(sG + tidx * 4)
            ok = tidx < ln
            qf = cutlass.select_(ok, scale * ptx.ld_shared_f32(sRq + tidx * 4) * ptx.ex2(gt), Float32(0.0))
            kf = cutlass.select_(ok, ptx.ld_shared_f32(sRk + tidx * 4) * ptx.ex2(gl - gt), Float32(0.0))
            f_base = mF.iterator.toint() + blk * (3 * C * 4)
            _st_f32(f_base + tidx * 4, qf)
            _st_f32(f_base + (C + tidx) * 4, kf)
            _st_f32(f_base + (2 * C + tidx) * 4, ptx.ex2(gl))
    @cute.jit
    def _aqk_rows(self, mAqk, sQ, sK, sG, blk, r0, scale, lane):
        """Rows ``r0 .. r0 + 16`` of ``Aqk = scale tril(Q K^T . Gamma)`` (diagonal kept) -> global, io dtype."""
        C, K, RK, io = self.C, self.K, self.RK, self.io
        g = lane // 4
        t = lane % 4
        gr = cute.make_rmem_tensor((2,), Float32)
        for h in cutlass.range_constexpr(2):
            gr[h] = ptx.ld_shared_f32(sG + (r0 + g + 8 * h) * 4)
        acc = cute.make_rmem_tensor(((C // 8) * 4,), Float32)
        for i in cutlass.range_constexpr((C // 8) * 4):
            acc[i] = Float32(0.0)
        self._gemm_nt(acc, sQ, RK, r0, sK, RK, 0, C // 8, K // 16, lane)
        # keeps the decay loads below after the GEMM: hoisted, their 64 factors would stay live across it and spill
        cute.arch.sync_warp()
        # this thread's first element: the rest are constant offsets from it (immediates of the stores)
        aqk_base = mAqk.iterator.toint() + blk * (C * C * 2) + Int64((r0 + g) * C + 2 * t) * 2
        for i in cutlass.range_constexpr(C // 8):
            if i * 8 < r0 + 16:
                s0 = i * 8 + 2 * t
                gs = ptx.ld_shared_v2_f32(sG + s0 * 4)
                for h in cutlass.range_constexpr(2):
                    r = r0 + g + 8 * h
                    v0 = scale * acc[4 * i + 2 * h] * ptx.ex2(gr[h] - gs[0])
                    v1 = scale * acc[4 * i + 2 * h + 1] * ptx.ex2(gr[h] - gs[1])
                    v0 = cutlass.select_(s0 <= r, v0, Float32(0.0))
                    v1 = cutlass.select_(s0 + 1 <= r, v1, Float32(0.0))
                    ptx.st_global_u32(aqk_base + (8 * h * C + 8 * i) * 2, ptx.pack2(v0, v1, io))
            else:  # the tile is above the slab's diagonal: zeros, no decays to compute
                for h in cutlass.range_constexpr(2):
                    ptx.st_global_u32(aqk_base + (8 * h * C + 8 * i) * 2, Int32(0))

    @cute.jit
    def _a_tile(self, sA, sG, acc, br, gr, r0, i: cutlass.Constexpr, g, t):
        """n8 tile ``i`` of the slab's ``A = strict_tril(diag(beta) K K^T . Gamma)`` -> sA (fp32)."""
        s0 = i * 8 + 2 * t
        gs = ptx.ld_shared_v2_f32(sG + s0 * 4)
        for e in cutlass.range_constexpr(4):
            h = e // 2
            r = r0 + g + 8 * h
            s = s0 + e % 2
            val = br[h] * acc[4 * i + e] * ptx.ex2(gr[h] - gs[e % 2])
            ptx.st_shared_f32(sA + r * self.RA + s * 4, cutlass.select_(s < r, val, Float32(0.0)))

    @cute.jit
    def _load_rows(self, mX, s_dst, RB: cutlass.Constexpr, D: cutlass.Constexpr, tok0, ln, head, tidx,
                   nthreads: cutlass.Constexpr):
        """cp.async rows ``tok0 .. tok0 + C`` of head ``head`` of ``mX`` ``[T, H, D]`` into smem, zero past ``ln``."""
        cpr = D // 8
        base = mX.iterator.toint()
        for it in cutlass.range_constexpr((self.C * cpr) // nthreads):
            idx = it * nthreads + tidx
            r = idx // cpr
            col = idx % cpr
            ok = r < ln
            tok = cutlass.select_(ok, tok0 + r, tok0)
            goff = Int64(tok) * mX.stride[0] + Int64(head) * mX.stride[1] + col * 8
            ptx.cp_async_16(s_dst + r * RB + col * 16, base + goff * 2, cutlass.select_(ok, 16, 0))

    @cute.jit
    def _normalise_rows(self, sX, sR, warp, lane):
        """l2-normalise this warp's 16 rows of ``sX`` in place (rounded to the io dtype) and record the fp32
        normalisers in ``sR`` (1 without l2norm).  The 16 rows go as one batch (loads, then interleaved
        butterflies, then stores): 16 independent reductions instead of a chain of 16."""
        if const_expr(self.l2norm):
            rows = [sX + (warp * 16 + rr) * self.RK + lane * (self.K // 32) * 2 for rr in range(16)]
            norms = _normalise_batch(rows, self.K, self.io)
            if lane == 0:
                for rr in cutlass.range_constexpr(16):
                    ptx.st_shared_f32(sR + (warp * 16 + rr) * 4, norms[rr])
        else:
            if lane == 0:
                for rr in cutlass.range_constexpr(16):
                    ptx.st_shared_f32(sR + (warp * 16 + rr) * 4, Float32(1.0))

    @cute.jit
    def _invert_column(self, sA, sT, j):
        """Column ``j`` of ``T = (I + A)^-1`` by forward substitution in fp32 (``A`` strictly lower triangular in
        ``sA``), rounded to the io dtype into ``sT``.  Entries of ``A`` at or above the diagonal are zero, so a
        vector load may run past ``s = r - 1``: those products are 0 * 0."""
        C, RA = self.C, self.RA
        col = cute.make_rmem_tensor((C,), Float32)
        part = cute.make_rmem_tensor((4,), Float32)  # four partial sums: the chain per row is ~r / 4 deep
        for r in cutlass.range_constexpr(C):
            col[r] = Float32(0.0)
        for r in cutlass.range_constexpr(C):
            part[0] = cutlass.select_(j == r, Float32(1.0), Float32(0.0))
            for e in cutlass.range_constexpr(1, 4):
                part[e] = Float32(0.0)
            for s4 in cutlass.range_constexpr((r + 3) // 4):
                a4 = _ld_shared_v4_f32(sA + r * RA + s4 * 16)
                for e in cutlass.range_constexpr(4):
                    if const_expr(4 * s4 + e < r):
                        part[e] = part[e] - a4[e] * col[4 * s4 + e]
            col[r] = (part[0] + part[1]) + (part[2] + part[3])
        for r in cutlass.range_constexpr(C):
            ptx.st_shared_u16(sT + r * self.RC + j * 2, ptx.f32_to_16(col[r], self.io))

    @cute.jit
    def _invert_blocks(self, sA, tidx):
        """``T = (I + A)^-1`` in fp32 by 16 x 16 blocks (all 128 threads).  ``sA`` holds the strictly lower
        triangular ``A`` on entry and ``T^T`` in its upper triangle on exit (diagonal blocks whole: the W / U
        GEMMs read their ``T`` operand from there); the products of the merges read both operands along
        contiguous rows:

        1. the four diagonal blocks by forward substitution, one thread a column (threads 0-63, a block's 16
           columns in one warp, so a warp sync orders its reads before its writes); each column then overwrites
           row ``j`` of its block (``T^T``);
        2. ``R = A_{b+1,b} T_bb`` (b = 0, 2) into ``A_{b+1,b}``'s slot; 3. ``T_{b+1,b} = -T_{b+1,b+1} R``;
        4. ``R = A_{H1,H0} T_H0`` on the 32-row halves into ``A_{H1,H0}``'s slot; 5. ``T_{H1,H0} = -T_H1 R``.

        The blocks below the diagonal of ``T^T`` hold step 2's ``R`` afterwards, so steps 4 and 5 start their
        sums past them."""
        RA = self.RA
        warp = tidx // 32
        half = warp // 2  # warp-uniform
        i = tidx % 64
        # ---- 1. diagonal blocks
        col = cute.make_rmem_tensor((16,), Float32)
        part = cute.make_rmem_tensor((4,), Float32)  # four partial sums: the chain per row is ~r / 4 deep
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
            cute.arch.sync_warp()  # a block's 16 columns are lanes of one warp: the warp read the block's A
            for q in cutlass.range_constexpr(4):
                _st_shared_v4_f32(d0 + j * RA + q * 16, col[4 * q], col[4 * q + 1], col[4 * q + 2], col[4 * q + 3])
        cute.arch.sync_threads()
        # ---- 2. R = A_{b+1,b} T_bb, b = 2 half: thread (row r, columns 4 cg .. 4 cg + 3)
        b0 = half * 32  # first row / column of block b
        r = i // 4
        cg = i % 4
        acc = cute.make_rmem_tensor((8,), Float32)
        for e in cutlass.range_constexpr(8):
            acc[e] = Float32(0.0)
        for q in cutlass.range_constexpr(4):
            a4 = _ld_shared_v4_f32(sA + (b0 + 16 + r) * RA + (b0 + 4 * q) * 4)
            for cc in cutlass.range_constexpr(4):
                t4 = _ld_shared_v4_f32(sA + (b0 + 4 * cg + cc) * RA + (b0 + 4 * q) * 4)
                for e in cutlass.range_constexpr(4):
                    acc[cc] = acc[cc] + a4[e] * t4[e]
        cute.arch.sync_threads()  # every thread read its A rows
        _st_shared_v4_f32(sA + (b0 + 16 + r) * RA + (b0 + 4 * cg) * 4, acc[0], acc[1], acc[2], acc[3])
        cute.arch.sync_threads()
        # ---- 3. T_{b+1,b} = -T_{b+1,b+1} R: thread (columns 2 cp .., rows 2 rp ..) of T^T's block (b, b+1)
        cp = i % 8
        rp = i // 8
        for e in cutlass.range_constexpr(4):
            acc[e] = Float32(0.0)
        for s in cutlass.range_constexpr(16):
            rv = ptx.ld_shared_v2_f32(sA + (b0 + 16 + s) * RA + (b0 + 2 * cp) * 4)
            tv = ptx.ld_shared_v2_f32(sA + (b0 + 16 + s) * RA + (b0 + 16 + 2 * rp) * 4)
            for cc in cutlass.range_constexpr(2):
                for rr in cutlass.range_constexpr(2):
                    acc[2 * cc + rr] = acc[2 * cc + rr] + rv[cc] * tv[rr]
        for cc in cutlass.range_constexpr(2):
            _st_shared_v2_f32(sA + (b0 + 2 * cp + cc) * RA + (b0 + 16 + 2 * rp) * 4, -acc[2 * cc], -acc[2 * cc + 1])
        cute.arch.sync_threads()
        # ---- 4. R = A_{H1,H0} T_H0 (32 x 32): thread (rows 4 rq .., columns 16 half + 2 cp ..)
        rq = i // 8
        c0 = half * 16 + 2 * cp
        for e in cutlass.range_constexpr(8):
            acc[e] = Float32(0.0)
        if half == 0:  # T_H0's columns 16.. start at row 16
            self._merge_r32(acc, sA, c0, rq, 0)
        self._merge_r32(acc, sA, c0, rq, 1)
        cute.arch.sync_threads()  # every thread read its A rows
        for rr in cutlass.range_constexpr(4):
            _st_shared_v2_f32(sA + (32 + 4 * rq + rr) * RA + c0 * 4, acc[2 * rr], acc[2 * rr + 1])
        cute.arch.sync_threads()
        # ---- 5. T_{H1,H0} = -T_H1 R: thread (columns 2 cp2 .., rows 16 half + 4 rq2 ..) of T^T's upper right
        cp2 = i % 16
        r0 = half * 16 + 4 * (i // 16)
        for e in cutlass.range_constexpr(8):
            acc[e] = Float32(0.0)
        self._merge_t32(acc, sA, cp2, r0, 0)
        if half == 1:  # T_H1's rows 16.. only for its columns 16..
            self._merge_t32(acc, sA, cp2, r0, 1)
        for cc in cutlass.range_constexpr(2):
            _st_shared_v4_f32(sA + (2 * cp2 + cc) * RA + (32 + r0) * 4, -acc[4 * cc], -acc[4 * cc + 1],
                              -acc[4 * cc + 2], -acc[4 * cc + 3])

    @cute.jit
    def _gemm_t_nn(self, acc, sA, sD, sB, RB: cutlass.Constexpr, r0, n0: cutlass.Constexpr, warp, lane):
        """acc += (T diag(d))[r0:+16, :] B[:, n0:+64]; ``T`` read from the fp32 ``T^T`` that
        :meth:`_invert_blocks` leaves in ``sA``, times the fp32 row ``d`` at ``sD`` and rounded to the io dtype
        into A fragments; B ``[C, n]`` row-major 16-bit; the k-steps past the slab's own block (``warp``) are
        zero and skipped."""
        RA, io = self.RA, self.io
        g = lane // 4
        t = lane % 4
        for kt in cutlass.range_constexpr(self.C // 16):
            if kt <= warp:
                a = []
                for q in cutlass.range_constexpr(4):  # fragment q: rows + 8 (q % 2), columns + 8 (q // 2)
                    s = kt * 16 + (q // 2) * 8 + 2 * t
                    d = ptx.ld_shared_v2_f32(sD + s * 4)
                    x = sA + s * RA + (r0 + g + (q % 2) * 8) * 4
                    a.append(ptx.pack2(ptx.ld_shared_f32(x) * d[0], ptx.ld_shared_f32(x + RA) * d[1], io))
                self._mma_nn_step(acc, a, sB, RB, kt, n0, 8, lane)

    @cute.jit
    def _merge_r32(self, acc, sA, c0, rq, sh: cutlass.Constexpr):
        """Step 4 of :meth:`_invert_blocks` over ``s`` in 16-row half ``sh``: ``acc[2 rr + cc] +=
        A[32 + 4 rq + rr, s] T^T[c0 + cc, s]``."""
        RA = self.RA
        for s4 in cutlass.range_constexpr(4 * sh, 4 * sh + 4):
            t0 = _ld_shared_v4_f32(sA + c0 * RA + s4 * 16)
            t1 = _ld_shared_v4_f32(sA + (c0 + 1) * RA + s4 * 16)
            for rr in cutlass.range_constexpr(4):
                a4 = _ld_shared_v4_f32(sA + (32 + 4 * rq + rr) * RA + s4 * 16)
                for e in cutlass.range_constexpr(4):
                    acc[2 * rr] = acc[2 * rr] + a4[e] * t0[e]
                    acc[2 * rr + 1] = acc[2 * rr + 1] + a4[e] * t1[e]

    @cute.jit
    def _merge_t32(self, acc, sA, cp2, r0, sh: cutlass.Constexpr):
        """Step 5 of :meth:`_invert_blocks` over ``s`` in 16-row half ``sh``: ``acc[4 cc + rr] +=
        R[s, 2 cp2 + cc] T^T_H1[s, r0 + rr]``."""
        RA = self.RA
        for s in cutlass.range_constexpr(16 * sh, 16 * sh + 16):
            rv = ptx.ld_shared_v2_f32(sA + (32 + s) * RA + (2 * cp2) * 4)
            tv = _ld_shared_v4_f32(sA + (32 + s) * RA + (32 + r0) * 4)
            for cc in cutlass.range_constexpr(2):
                for rr in cutlass.range_constexpr(4):
                    acc[4 * cc + rr] = acc[4 * cc + rr] + rv[cc] * tv[rr]

    @cute.jit
    def _store_slab(self, base, acc, D: cutlass.Constexpr, n0: cutlass.Constexpr, r0, g, t):
        """A 16-row slab of eight n8 C-fragment tiles -> rows ``r0 ..``, columns ``n0 .. n0 + 64`` of a ``[C, D]``
        io-dtype block at ``base``, from one per-thread address (the stores' offsets are immediates)."""
        p = base + Int64((r0 + g) * D + 2 * t) * 2
        for i in cutlass.range_constexpr(8):
            for h in cutlass.range_constexpr(2):
                ptx.st_global_u32(p + (8 * h * D + n0 + 8 * i) * 2,
                                  ptx.pack2(acc[4 * i + 2 * h], acc[4 * i + 2 * h + 1], self.io))

    @cute.jit
    def _store_rows(self, base, acc, D: cutlass.Constexpr, r0, g, t):
        """A 16-row slab of C fragments -> rows ``r0 ..`` of a ``[C, D]`` io-dtype block at ``base``."""
        for i in cutlass.range_constexpr(D // 8):
            for h in cutlass.range_constexpr(2):
                r = r0 + g + 8 * h
                ptx.st_global_u32(base + (r * D + i * 8 + 2 * t) * 2,
                                  ptx.pack2(acc[4 * i + 2 * h], acc[4 * i + 2 * h + 1], self.io))
