"""The prep kernel of the chunked gated delta rule (GDN) for SM90 (Hopper): the chunk products on ``wgmma``.

Same math and the same scratch contract as :mod:`cutedsl_attn.common.gdn_prep` (``W`` ``[nc, HO, C, K]``, ``U``
``[nc, HO, C, V]``, ``Aqk`` ``[nc, HO, C, C]`` in the io dtype, ``F`` ``[nc, HO, 3, C]`` fp32, every row written),
so either prep feeds the SM90 main kernel.  One CTA (one warpgroup, 128 threads) per (64-token chunk, output
head), a 1-D grid with the heads of a chunk adjacent (GVA heads share q / k rows in L2), four CTAs an SM:

1. ``cp.async`` of the chunk's q, k rows (one group) and v rows (a second group, first read by ``U``) into
   128-byte-swizzled (C, D) tiles (the K_SW128 layout of :func:`cutlass.utils.hopper_helpers.make_smem_layout_b`),
   zero past the chunk's end; the gates into fp32 rows;
2. the cumulative log2 decay (warp 0) and the l2 normalisers of q and k (every warp its 16 rows, in place);
3. ``Q K^T`` and ``K K^T``: SS ``wgmma`` m64n64k16 over K (both operands K-major), the decay, beta and masks on
   the fp32 accumulators in registers; ``Aqk`` staged as 16-bit in the swizzled tile over Q and stored in 16-byte
   rows, ``A`` written fp32 over Q for :meth:`GdnPrep._invert_blocks` (its padded-row contract unchanged);
4. ``W = (T diag(beta gamma)) K`` and ``U = (T diag(beta)) V``: RS ``wgmma`` m64nDk16 over the chunk's tokens,
   the A operands ``T diag(.)`` rounded to the io dtype straight into registers from the fp32 ``T^T``, B = K / V
   read MN-major from the same tiles; each result staged 16-bit over its (dead) operand tile, stored in 16-byte
   rows;
5. the row factors ``F``.

Per chunk and head at K = V = 128: ``2 K / 16 + 2 C / 16`` = 24 wgmma (4.2 MFLOP); 48 KiB of q / k / v read,
40 KiB of W, U, Aqk and 768 B of F written.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..common import ptx
from ..common.dtypes import element_type
from ..common.gdn_launch import compile_kernel, launch_prep
from ..common.gdn_prep import (
    PREP_CTAS_PER_SM, PREP_SMEM_CARVEOUT, PREP_THREADS, GdnPrep, _normalise_batch, row_pitches,
)
from ..common.smem import sw128_offset, transpose_view
from ..planning.gdn import CHUNK, GdnArgs, GdnProblem, chunked_launch_tensors
from .gdn_rows import GdnSm90Rows

NAME = "gdn_prep_sm90"
ARCH = "sm_90a"
#: the 228 KiB of an SM less 1 KiB reserved a CTA, shared by PREP_CTAS_PER_SM CTAs
SMEM_PER_SM = 228 * 1024


def prep_sm90_smem_bytes(head_dim_k: int, head_dim_v: int) -> int:
    """Shared memory of one SM90 prep CTA: the Q tile (A / T^T in fp32 take its place, padded rows), the K and V
    tiles (each 1 KiB aligned) and five fp32 rows (51456 B at K = V = 128), plus the allocator's alignment slack."""
    c = CHUNK
    _rk, _rv, _rc, ra = row_pitches(head_dim_k, head_dim_v)
    q = max(c * head_dim_k * 2, c * ra)
    q = -(-q // 1024) * 1024
    return q + c * head_dim_k * 2 + c * head_dim_v * 2 + 5 * c * 4 + 1024


def unsupported_reason(problem: GdnProblem) -> str | None:
    """Why the SM90 prep kernel cannot serve ``problem``, or None: it serves the GDN prep (scalar gates, one update
    a token, K and V in 64 / 128) on ``sm_90a``; :mod:`cutedsl_attn.common.gdn_prep` serves it on every arch.

    Raises TypeError when ``problem`` is not a GdnProblem."""
    if not isinstance(problem, GdnProblem):
        raise TypeError(f"problem must be a GdnProblem, got {type(problem).__name__}")
    if problem.arch != ARCH:
        return f"arch {problem.arch}: the SM90 prep kernel is built for {ARCH} only"
    if problem.gate_per_channel or problem.erase_write_gates or problem.num_householder != 1:
        return "the SM90 prep kernel serves GDN (scalar gates, one update a token) only"
    if problem.head_dim_k not in (64, 128) or problem.head_dim_v not in (64, 128):
        return f"head dims {problem.head_dim_k}/{problem.head_dim_v}: served K, V in 64, 128"
    return None


class GdnPrepSm90(GdnSm90Rows, GdnPrep):
    """The SM90 prep kernel (``prep_sm90``, launched by :meth:`launch_prep_sm90`); a mixin over
    :class:`~cutedsl_attn.common.gdn_prep.GdnPrep` (the l2-norm batch, ``_a_tile``, ``_invert_blocks``), which
    sets the same attributes: ``C``, ``K``, ``V``, ``RA`` (the fp32 row pitch of A), ``io``, ``log_gate``,
    ``l2norm``, and over :class:`~cutedsl_attn.sm90.gdn_rows.GdnSm90Rows` (q and the gates on an expanded
    timeline when the kernel sets ``expand_rows``).  Its own methods carry a ``_p90`` prefix (no clash with a
    main kernel's)."""

    #: issue K K^T before the Q K^T accumulator is consumed (two 64 x 64 fp32 accumulators live at once)
    p90_overlap_kk = True

    @cute.jit
    def launch_prep_sm90(self, mQ, mK, mV, mG, mBeta, mChunks, mW, mU, mAqk, mF, scale: Float32, q_group: Int32,
                         k_group: Int32, v_group: Int32, flags: Int32, stream):
        """Launch ``prep_sm90`` (traced inside a ``cute.jit`` call) over ``mChunks.shape[0] * HO`` CTAs: the
        tensors and scalars of :meth:`GdnPrep.prep` (``HO = mW.shape[1]``)."""
        C, K, V, dt = self.C, self.K, self.V, self.io
        K_MAJOR = cute.nvgpu.OperandMajorMode.K
        MN_MAJOR = cute.nvgpu.OperandMajorMode.MN
        rmem = warpgroup.OperandSource.RMEM
        # Q K^T and K K^T: (C, C) over K, both operands K-major tiles
        mma_kk = sm90_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, K_MAJOR, Float32, atom_layout_mnk=(1, 1, 1),
                                                   tiler_mn=(64, C))
        # W and U: (C, K / V) over the chunk's tokens, A = the scaled T from registers, B = K / V read MN-major
        mma_w = sm90_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, MN_MAJOR, Float32, atom_layout_mnk=(1, 1, 1),
                                                  tiler_mn=(64, K), a_source=rmem)
        mma_u = sm90_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, MN_MAJOR, Float32, atom_layout_mnk=(1, 1, 1),
                                                  tiler_mn=(64, V), a_source=rmem)
        s_ck = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (64, C, K), dt, 1)
        s_cv = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (64, C, V), dt, 1)
        # A (fp32, padded rows) over Q: the pad past Q's tile keeps the K tile 1 KiB aligned
        q_pad = -(-(C * self.RA) // 1024) * 1024 - C * K * 2

        @cute.struct
        class PrepStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(s_ck)], 1024]
            sQpad: cute.struct.MemRange[cutlass.Int8, q_pad]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(s_ck)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(s_cv)], 1024]
            sRows: cute.struct.Align[cute.struct.MemRange[Float32, 5 * C], 16]

        self.p90_storage = PrepStorage
        self.p90_smem_bytes = PrepStorage.size_in_bytes()
        if const_expr(self.p90_smem_bytes > prep_sm90_smem_bytes(K, V)):  # a Python check while traced
            raise ValueError(f"the SM90 prep's shared storage is {self.p90_smem_bytes} B, over its estimate "
                             f"{prep_sm90_smem_bytes(K, V)} B")
        self.prep_sm90(mQ, mK, mV, mG, mBeta, mChunks, mW, mU, mAqk, mF, scale, q_group, k_group, v_group, flags,
                       s_ck, s_cv, mma_kk, mma_w, mma_u).launch(
            grid=(mChunks.shape[0] * mW.shape[1], 1, 1), block=(PREP_THREADS, 1, 1),
            smem=PrepStorage.size_in_bytes(), stream=stream, min_blocks_per_mp=PREP_CTAS_PER_SM,
            preferred_smem_carveout=PREP_SMEM_CARVEOUT)

    @cute.kernel
    def prep_sm90(self, mQ, mK, mV, mG, mBeta, mChunks, mW, mU, mAqk, mF, scale: Float32, q_group: Int32,
                  k_group: Int32, v_group: Int32, flags: Int32, s_ck: cute.ComposedLayout, s_cv: cute.ComposedLayout,
                  mma_kk: cute.TiledMma, mma_w: cute.TiledMma, mma_u: cute.TiledMma):
        """One CTA per (chunk, output head): ``W``, ``U``, ``Aqk`` and the row factors of the chunk."""
        C, K, V = self.C, self.K, self.V
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        HO = mW.shape[1]
        c = bid // HO
        ho = bid - c * HO
        lane = tidx % 32
        warp = tidx // 32
        g = lane // 4
        t = lane % 4
        storage = cutlass.memory.SmemAllocator().allocate(self.p90_storage)
        tok0 = mChunks[c, 1]
        ln = mChunks[c, 2]
        if ln > 0:
            sQ = storage.sQ.get_tensor(s_ck.outer, swizzle=s_ck.inner)
            sK = storage.sK.get_tensor(s_ck.outer, swizzle=s_ck.inner)
            sV = storage.sV.get_tensor(s_cv.outer, swizzle=s_cv.inner)
            aQ = storage.sQ.data_ptr().toint()
            aK = storage.sK.data_ptr().toint()
            aV = storage.sV.data_ptr().toint()
            sA = aQ  # A (then T^T) replaces Q once Aqk is out
            sG = storage.sRows.data_ptr().toint()
            sB = sG + C * 4
            sRq = sB + C * 4
            sRk = sRq + C * 4
            sBG = sRk + C * 4  # beta gamma
            self._p90_load_q(mQ, aQ, tok0, ln, ho // q_group, tidx)
            self._p90_load_rows(mK, aK, K, tok0, ln, ho // k_group, tidx)
            ptx.cp_async_commit()
            # V is first read by the U GEMM: it lands while Aqk, K K^T and the inverse are computed
            self._p90_load_rows(mV, aV, V, tok0, ln, ho // v_group, tidx)
            ptx.cp_async_commit()
            self._p90_gates(mG, mBeta, sG, sB, tok0, ln, ho, flags, tidx)
            ptx.cp_async_wait(1)
            cute.arch.sync_threads()

            # cumulative log2 decay (warp 0) and the l2 normalisers (every warp, its 16 rows of q and k)
            if warp == 0:
                self._cumsum_gates(sG, sB, sBG, lane)
            self._p90_normalise_rows(aQ, sRq, warp, lane)
            self._p90_normalise_rows(aK, sRk, warp, lane)
            ptx.fence_proxy_async_shared()  # cp.async and l2-norm writes (generic proxy) -> wgmma reads
            cute.arch.sync_threads()
            blk = Int64(c) * HO + ho
            r0 = warp * 16
            gr = cute.make_rmem_tensor((2,), Float32)
            br = cute.make_rmem_tensor((2,), Float32)
            for h in cutlass.range_constexpr(2):
                gr[h] = ptx.ld_shared_f32(sG + (r0 + g + 8 * h) * 4)
                br[h] = ptx.ld_shared_f32(sB + (r0 + g + 8 * h) * 4)

            # Q K^T and K K^T (accumulator element 4 j + 2 h + e: row r0 + g + 8 h, column 8 j + 2 t + e)
            thr = mma_kk.get_slice(tidx)
            tSrQ = thr.make_fragment_A(thr.partition_A(sQ))
            tSrKa = thr.make_fragment_A(thr.partition_A(sK))
            tSrKb = thr.make_fragment_B(thr.partition_B(sK))
            acc_s = cute.make_rmem_tensor(thr.partition_shape_C((64, C)), Float32)
            acc_a = cute.make_rmem_tensor(thr.partition_shape_C((64, C)), Float32)
            fS = cute.make_tensor(acc_s.iterator, cute.make_layout(cute.size(acc_s)))
            fA = cute.make_tensor(acc_a.iterator, cute.make_layout(cute.size(acc_a)))
            self._p90_gemm(mma_kk, acc_s, tSrQ[None, None, None, 0], tSrKb[None, None, None, 0])
            if const_expr(self.p90_overlap_kk):
                self._p90_gemm(mma_kk, acc_a, tSrKa[None, None, None, 0], tSrKb[None, None, None, 0])
                warpgroup.wait_group(1)
            else:
                warpgroup.wait_group(0)
            cute.arch.sync_threads()  # every warp's Q K^T has read Q: its tile takes Aqk
            self._p90_stage_aqk(aQ, fS, sG, gr, r0, scale, g, t)
            cute.arch.sync_threads()
            self._p90_store_tile(aQ, C, mAqk.iterator.toint() + blk * (C * C * 2), tidx)
            if const_expr(not self.p90_overlap_kk):
                self._p90_gemm(mma_kk, acc_a, tSrKa[None, None, None, 0], tSrKb[None, None, None, 0])
            warpgroup.wait_group(0)
            cute.arch.sync_threads()  # every thread stored its Aqk rows: A takes the tile
            # A = strict_tril(diag(beta) K K^T . Gamma) -> sA (fp32); right of the diagonal block never read
            for i in cutlass.range_constexpr(C // 8):
                if i <= 2 * warp + 1:
                    self._a_tile(sA, sG, fA, br, gr, r0, i, g, t)
            cute.arch.sync_threads()

            # T = (I + A)^-1 by 16 x 16 blocks (fp32, T^T left in sA)
            self._invert_blocks(sA, tidx)
            ptx.cp_async_wait(0)
            ptx.fence_proxy_async_shared()  # the V rows (cp.async) -> the U GEMM
            cute.arch.sync_threads()

            # W = (T diag(beta gamma)) K, U = (T diag(beta)) V; the scaled T rounded to the io dtype
            thr_w = mma_w.get_slice(tidx)
            thr_u = mma_u.get_slice(tidx)
            tWrT = thr_w.make_fragment_A(thr_w.partition_shape_A((64, C)))
            tUrT = thr_u.make_fragment_A(thr_u.partition_shape_A((64, C)))
            self._p90_t_frag(tWrT, sA, sBG, r0, warp, g, t)
            tWsK = thr_w.make_fragment_B(thr_w.partition_B(transpose_view(sK)))
            tUsV = thr_u.make_fragment_B(thr_u.partition_B(transpose_view(sV)))
            acc_w = cute.make_rmem_tensor(thr_w.partition_shape_C((64, K)), Float32)
            self._p90_gemm(mma_w, acc_w, tWrT, tWsK[None, None, None, 0])
            warpgroup.wait_group(0)
            cute.arch.sync_threads()  # every warp's W GEMM has read K: its tile takes W
            self._p90_stage(aK, cute.make_tensor(acc_w.iterator, cute.make_layout(cute.size(acc_w))), K, r0, g, t)
            # built after W is out: one 16-bit T fragment and one accumulator live at a time (no spills)
            self._p90_t_frag(tUrT, sA, sB, r0, warp, g, t)
            acc_u = cute.make_rmem_tensor(thr_u.partition_shape_C((64, V)), Float32)
            self._p90_gemm(mma_u, acc_u, tUrT, tUsV[None, None, None, 0])
            cute.arch.sync_threads()
            self._p90_store_tile(aK, K, mW.iterator.toint() + blk * (C * K * 2), tidx)  # under the U GEMM
            warpgroup.wait_group(0)
            cute.arch.sync_threads()  # every warp's U GEMM has read V
            self._p90_stage(aV, cute.make_tensor(acc_u.iterator, cute.make_layout(cute.size(acc_u))), V, r0, g, t)
            cute.arch.sync_threads()
            self._p90_store_tile(aV, V, mU.iterator.toint() + blk * (C * V * 2), tidx)
            self._row_factors(mF, sG, sRq, sRk, blk, ln, scale, tidx)

    # ------------------------------------------------------------------ phases
    @cute.jit
    def _p90_load_rows(self, mX, s_dst, D: cutlass.Constexpr, tok0, ln, head, tidx):
        """cp.async rows ``tok0 .. tok0 + C`` of head ``head`` of ``mX`` ``[T, H, D]`` into a swizzled (C, D)
        tile, zero past ``ln`` (the source address stays in bounds: row ``tok0``)."""
        cpr = D // 8
        base = mX.iterator.toint()
        for it in cutlass.range_constexpr((self.C * cpr) // PREP_THREADS):
            idx = it * PREP_THREADS + tidx
            r = idx // cpr
            col = idx % cpr
            ok = r < ln
            tok = cutlass.select_(ok, tok0 + r, tok0)
            goff = Int64(tok) * mX.stride[0] + Int64(head) * mX.stride[1] + col * 8
            ptx.cp_async_16(s_dst + sw128_offset(r, col, self.C), base + goff * 2, cutlass.select_(ok, 16, 0))

    @cute.jit
    def _p90_normalise_rows(self, sX, sR, warp, lane):
        """l2-normalise this warp's 16 rows of the swizzled tile at ``sX`` in place and record the fp32
        normalisers in ``sR`` (1 without l2norm); each lane's ``K / 32`` elements sit inside one 16-byte chunk."""
        if const_expr(self.l2norm):
            e = self.K // 32  # elements a lane
            rows = [sX + sw128_offset(warp * 16 + rr, (lane * e) // 8, self.C) + ((lane * e * 2) % 16)
                    for rr in range(16)]
            norms = _normalise_batch(rows, self.K, self.io)
            if lane == 0:
                for rr in cutlass.range_constexpr(16):
                    ptx.st_shared_f32(sR + (warp * 16 + rr) * 4, norms[rr])
        else:
            if lane == 0:
                for rr in cutlass.range_constexpr(16):
                    ptx.st_shared_f32(sR + (warp * 16 + rr) * 4, Float32(1.0))

    @cute.jit
    def _p90_gemm(self, tiled_mma, acc, tA, tB):
        """Issue one warpgroup GEMM into a fresh accumulator (k-blocks unrolled) and commit it; the caller waits."""
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, False)
        for k in cutlass.range_constexpr(cute.size(tA.shape[2])):
            cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def _p90_stage_aqk(self, s_tile, fS, sG, gr, r0, scale, g, t):
        """``Aqk = scale tril(Q K^T . Gamma)`` (diagonal kept) of the thread's accumulator elements -> the swizzled
        (C, C) 16-bit tile at ``s_tile``; the 8-column tiles above the slab's diagonal are zeros."""
        C = self.C
        for j in cutlass.range_constexpr(C // 8):
            s0 = j * 8 + 2 * t
            w = cute.make_rmem_tensor((2,), Int32)
            w[0] = Int32(0)
            w[1] = Int32(0)
            if j * 8 < r0 + 16:
                gs = ptx.ld_shared_v2_f32(sG + s0 * 4)
                for h in cutlass.range_constexpr(2):
                    r = r0 + g + 8 * h
                    v0 = scale * fS[4 * j + 2 * h] * ptx.ex2(gr[h] - gs[0])
                    v1 = scale * fS[4 * j + 2 * h + 1] * ptx.ex2(gr[h] - gs[1])
                    v0 = cutlass.select_(s0 <= r, v0, Float32(0.0))
                    v1 = cutlass.select_(s0 + 1 <= r, v1, Float32(0.0))
                    w[h] = ptx.pack2(v0, v1, self.io)
            for h in cutlass.range_constexpr(2):
                ptx.st_shared_b32(s_tile + sw128_offset(r0 + g + 8 * h, j, C) + 4 * t, w[h])

    @cute.jit
    def _p90_t_frag(self, tArT, sA, sD, r0, warp, g, t):
        """The A fragment of the W (or U) GEMM: ``T diag(d)`` rounded to the io dtype, ``T`` read from the fp32
        ``T^T`` in ``sA``, ``d`` the fp32 row at ``sD`` (beta gamma, or beta).  Word ``2 j + h``: row
        ``r0 + g + 8 h``, columns ``8 j + 2 t, +1``; the 16-column blocks right of the slab's own block are zero
        (T is lower triangular; ``sA`` holds other values there)."""
        RA = self.RA
        words = cute.make_tensor(cute.recast_ptr(tArT.iterator, dtype=Int32), cute.make_layout(cute.size(tArT) // 2))
        for j in cutlass.range_constexpr(self.C // 8):
            s = j * 8 + 2 * t
            d = ptx.ld_shared_v2_f32(sD + s * 4)
            live = (j // 2) <= warp
            for h in cutlass.range_constexpr(2):
                x = sA + s * RA + (r0 + g + 8 * h) * 4
                w = ptx.pack2(ptx.ld_shared_f32(x) * d[0], ptx.ld_shared_f32(x + RA) * d[1], self.io)
                words[2 * j + h] = cutlass.select_(live, w, Int32(0))

    @cute.jit
    def _p90_stage(self, s_tile, fAcc, D: cutlass.Constexpr, r0, g, t):
        """A (C, D) fp32 accumulator (element ``4 j + 2 h + e``: row ``r0 + g + 8 h``, column ``8 j + 2 t + e``)
        -> the swizzled (C, D) 16-bit tile at ``s_tile`` (conflict-free: a warp's 8 rows hit 8 distinct chunks)."""
        for j in cutlass.range_constexpr(D // 8):
            for h in cutlass.range_constexpr(2):
                ptx.st_shared_b32(s_tile + sw128_offset(r0 + g + 8 * h, j, self.C) + 4 * t,
                                  ptx.pack2(fAcc[4 * j + 2 * h], fAcc[4 * j + 2 * h + 1], self.io))

    @cute.jit
    def _p90_store_tile(self, s_tile, D: cutlass.Constexpr, g_base, tidx):
        """The swizzled (C, D) 16-bit tile at ``s_tile`` -> the row-major ``[C, D]`` block at ``g_base``, 16 bytes a
        thread and store, consecutive threads along a row."""
        cpr = D // 8
        for it in cutlass.range_constexpr((self.C * cpr) // PREP_THREADS):
            idx = it * PREP_THREADS + tidx
            r = idx // cpr
            col = idx % cpr
            w = ptx.ld_shared_v4_b32(s_tile + sw128_offset(r, col, self.C))
            ptx.st_global_v4_b32(g_base + (Int64(r) * D + col * 8) * 2, w[0], w[1], w[2], w[3])


class GdnPrepSm90Kernel(GdnPrepSm90):
    """The SM90 prep alone, with the chunked GDN kernels' compiled-function signature (the main kernel's
    arguments accepted and unused), so :func:`~cutedsl_attn.common.gdn_launch.launch_prep` launches it.  Build
    with :func:`compile`.

    Raises TypeError / ValueError for a ``problem`` :func:`unsupported_reason` refuses."""

    def __init__(self, problem: GdnProblem):
        reason = unsupported_reason(problem)
        if reason is not None:
            raise ValueError(f"the SM90 GDN prep kernel cannot serve this problem: {reason}")
        self.problem = problem
        self.io = element_type(problem.dtype)
        self.K, self.V, self.C = problem.head_dim_k, problem.head_dim_v, CHUNK
        self.RK, self.RV, self.RC, self.RA = row_pitches(problem.head_dim_k, problem.head_dim_v)
        self.log_gate = problem.gate_domain == "log"
        self.l2norm = problem.use_qk_l2norm

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
                 mCu: cute.Tensor, mChunks: cute.Tensor, mChunkOff: cute.Tensor, mH0: cute.Tensor,
                 mH0Idx: cute.Tensor, mHt: cute.Tensor, mHtIdx: cute.Tensor, mO: cute.Tensor, mW: cute.Tensor,
                 mU: cute.Tensor, mAqk: cute.Tensor, mF: cute.Tensor, scale: Float32, q_group: Int32,
                 k_group: Int32, v_group: Int32, flags: Int32, stream):
        self.launch_prep_sm90(mQ, mK, mV, mG, mBeta, mChunks, mW, mU, mAqk, mF, scale, q_group, k_group, v_group,
                              flags, stream)


def compile(problem: GdnProblem, *, keep_ptx_dir: str | None = None, keep_cubin: bool = False):
    """Compile :class:`GdnPrepSm90Kernel` for ``problem`` from fake tensors (no GPU needed); returns the tvm-ffi
    callable, launched by :func:`launch` (the chunked kernels' argument order).  Raises ValueError for a problem
    it does not serve, or ``keep_cubin`` without a ``keep_ptx_dir``."""
    return compile_kernel(GdnPrepSm90Kernel(problem), problem, keep_ptx_dir, keep_cubin)


def prep_tensors(args: GdnArgs, problem: GdnProblem) -> tuple:
    """``(chunks, chunk_offsets, W, U, Aqk, F)``: the chunk plan and the scratch of ``args``' sequences
    (:func:`~cutedsl_attn.planning.gdn.chunked_launch_tensors`, device tensors, no host sync)."""
    return chunked_launch_tensors(args, problem.head_dim_k, problem.head_dim_v)


def launch(fn, args: GdnArgs, scratch: tuple) -> None:
    """Launch :func:`compile`'s ``fn`` on torch's current stream: the prep of ``args``' chunks into ``scratch``
    (:func:`prep_tensors`)."""
    launch_prep(fn, None, args, scratch)
