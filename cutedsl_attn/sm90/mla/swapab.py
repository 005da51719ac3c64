"""The SM90 MLA kernel's small-head form (``Tiles.swap_ab``): the packed query rows on the wgmma N dimension.

With 16-32 packed rows (``q_len x heads``) a 64-row M tile is mostly padding; here the roles swap:

* ``S^T = K Q^T``: M = the block's 64 tokens (A = the stage, K-major over the 576 columns), N = ``tile_n`` query
  rows (B = the first ``tile_n`` rows of sQ, K-major), 36 k16 steps;
* the softmax runs down each column (a query row): a thread holds two tokens of ``tile_n / 4`` columns, the 8
  lanes of a column reduce by shuffles, the 4 warps through ``x_max`` in shared memory (one named barrier of the
  warpgroup), then P^T (16-bit) is written over the first ``tile_n`` rows of the block's kpe chunk (rows = query
  rows, columns = tokens: the K-major B operand), fenced and published by a second barrier;
* ``O^T += V^T P^T``: M = the 512 ckv columns (A = the stage's ckv read MN-major, 8 M tiles), N = ``tile_n``,
  K = the 64 tokens (4 k16 steps), O^T in registers (``4 tile_n`` fp32 a thread).

The producer warpgroup and its loads are the kernel's (block ``n`` into stage ``n % 2``).  Consumer warpgroup
``w`` takes the blocks ``n % 2 == w`` whole, as an independent online softmax over its half of the item's
blocks (no signal between the warpgroups), and releases all three groups of its stage after its O^T GEMM.  The
epilogue merges the two halves: warpgroup 1 leaves its O^T (in its own register order), its column maxima and
row sums in shared memory (its stage is dead by then), warpgroup 0 adds them with the LSE weights and writes O
transposed back to ``[rows, 512]`` (16-bit, or the fp32 partial of a split item in the layout the merges read)
and the base-2 LSE.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup

from ...common import ptx
from ...common.constants import NEG_INF
from ...common.smem import transpose_view
from ...planning.decode import W_NUM_SPLITS, W_PART_BASE, W_SPLIT_IDX, W_TOK_END, W_TOK_START, W_KV_LEN
from ...planning.mla import HEAD_DIM_CKV, W_Q_START, W_QO_LEN
from .config import BLOCK_N, D_QK, GROUP_CHUNKS, NUM_CHUNKS, NUM_GROUPS, TILE_M, Config
from .kernel import CHUNK_BYTES, CONSUMER_BAR, MlaSm90Kernel, _mul_pinned, _opaque_zero
from .merge import MERGE_CTAS_PER_TILE, MERGE_THREADS

SWAP_BAR = 4  # 4 + w: the 128 threads of consumer warpgroup w (column maxima exchanged, P^T written)
NUM_WARPS = 4  # warps of a consumer warpgroup: 16 of the block's 64 tokens each
M_TILES = HEAD_DIM_CKV // 64  # 8 wgmma M tiles of O^T


def pt_offset(col, warp, g, h):
    """Byte offset, in the block's kpe chunk, of P^T's element (query row ``col``, token ``16 warp + g + 8 h``):
    the 128-byte swizzled rows of the TMA boxes (``sw128_offset``), rows = query rows, 64 tokens a row.  Plain
    ints or DSL integers."""
    return col * 128 + (((2 * warp + h) ^ (col % 8)) * 16) + g * 2


def _st_global_u16(addr, v):
    """Store the low 16 bits of ``v`` to a global byte address (Int64)."""
    cute.arch.inline_ptx("st.global.u16 [{$r0}], {$r1};", read_only_args=[Int64(addr), Int32(v)])


class MlaSm90SwapAbKernel(MlaSm90Kernel):
    """The kernel of a :class:`~cutedsl_attn.sm90.mla.config.Config` with ``Tiles.swap_ab`` 1 (module docstring):
    the kernel entry, producer and split-KV merges of :class:`MlaSm90Kernel`, its own GEMMs and consumer side."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.tile_n = cfg.tiles.tile_n

    @cute.jit
    def __call__(self, mQn: cute.Tensor, mQp: cute.Tensor, mCkv: cute.Tensor, mKpe: cute.Tensor, mIdx: cute.Tensor,
                 mWork: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mPO: cute.Tensor, mPLSE: cute.Tensor,
                 mCnt: cute.Tensor, sm_scale: Float32, output_scale: Float32, num_tiles: Int32, stream):
        dt = self.dtype
        N = self.tile_n
        K_MAJOR = cute.nvgpu.OperandMajorMode.K
        MN_MAJOR = cute.nvgpu.OperandMajorMode.MN
        # S^T = K Q^T (both K-major) and O^T = V^T P^T (V^T MN-major: the stage's ckv rows are tokens)
        mma_st = sm90_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, K_MAJOR, Float32, atom_layout_mnk=(1, 1, 1),
                                                   tiler_mn=(BLOCK_N, N))
        mma_ot = sm90_utils.make_trivial_tiled_mma(dt, dt, MN_MAJOR, K_MAJOR, Float32, atom_layout_mnk=(1, 1, 1),
                                                   tiler_mn=(64, N))
        # the shared layouts and TMA boxes of the kernel (the producer is the same)
        sQ_layout, sK_layout, tma_atom_c, tma_c, tma_atom_p, tma_p = self._stage_layouts_and_tma(mCkv, mKpe)

        @cute.struct
        class SharedStorage:
            mbar_full: cute.struct.MemRange[cutlass.Int64, 2 * NUM_GROUPS]
            mbar_empty: cute.struct.MemRange[cutlass.Int64, 2 * NUM_GROUPS]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 1]
            flag: cute.struct.MemRange[Float32, 4]
            x_max: cute.struct.MemRange[Float32, 2 * NUM_WARPS * N]  # [warpgroup][warp][column]: block maxima
            x_sum: cute.struct.MemRange[Float32, 2 * NUM_WARPS * N]  # [warpgroup][warp][column]: the row sums
            x_m: cute.struct.MemRange[Float32, N]  # warpgroup 1's running maxima at the end
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(mQn, mQp, mCkv, mKpe, mIdx, mWork, mO, mLSE, mPO, mPLSE, mCnt, tma_atom_c, tma_c, tma_atom_p,
                    tma_p, sm_scale, output_scale, sQ_layout, sK_layout, mma_st, mma_ot, mma_ot).launch(
            grid=(num_tiles, mWork.shape[0], 1), block=(self.cfg.num_threads, 1, 1),
            smem=SharedStorage.size_in_bytes(), stream=stream, min_blocks_per_mp=1)
        if const_expr(self.merge_kernel):
            self.merge(mO, mLSE, mPO, mPLSE, mWork, output_scale).launch(
                grid=(num_tiles * MERGE_CTAS_PER_TILE, mPLSE.shape[0], 1), block=(MERGE_THREADS, 1, 1), stream=stream)

    # ------------------------------------------------------------------ consumer warpgroups
    @cute.jit
    def _consume(self, mO, mLSE, mPO, mPLSE, mWork, wi, tile, sQ, sK, sK_addr, full, empty, q_bar, storage, mma_st,
                 mma_ot, mma_unused, sc, output_scale, ctid, w):
        """Consumer warpgroup ``w``: its blocks ``n % 2 == w`` (S^T, the column softmax, O^T), then the merged
        epilogue.  ``mma_unused``: the kernel entry's third GEMM slot.  Returns the stages' shared address."""
        N = self.tile_n
        NC = N // 4  # columns a thread holds: 8 n8 + 2 t + e for n8 < N / 8, e < 2
        H = mO.shape[1]
        rows = mWork[wi, W_QO_LEN] * H
        row0 = tile * TILE_M  # (0: the launch refuses rows past tile_n)
        t0 = mWork[wi, W_TOK_START]
        t1 = mWork[wi, W_TOK_END]
        pg0 = t0 // BLOCK_N
        n_blk = Int32(cutlass.select_(t1 > t0, (t1 - 1) // BLOCK_N - pg0 + 1, 0))
        sl_st = mma_st.get_slice(0)
        sl_ot = mma_ot.get_slice(0)
        tSrK = sl_st.make_fragment_A(sl_st.partition_A(sK))
        tSrQ = sl_st.make_fragment_B(sl_st.partition_B(cute.local_tile(sQ, (N, D_QK), (0, 0))))
        # V^T: the stage's ckv columns as (dims, tokens); P^T: the first N rows of the kpe chunk (rows, tokens)
        sVt = cute.local_tile(transpose_view(sK), (HEAD_DIM_CKV, BLOCK_N, self.S), (0, 0, 0))
        tOrV = sl_ot.make_fragment_A(sl_ot.partition_A(sVt))
        sPt = cute.local_tile(sK, (N, BLOCK_N, self.S), (0, NUM_CHUNKS - 1, 0))
        tOrP = sl_ot.make_fragment_B(sl_ot.partition_B(sPt))
        acc_S = cute.make_rmem_tensor(sl_st.partition_shape_C((BLOCK_N, N)), Float32)
        acc_O = cute.make_rmem_tensor(sl_ot.partition_shape_C((HEAD_DIM_CKV, N)), Float32)
        s = cute.make_tensor(acc_S.iterator, cute.make_layout(N // 2))  # flat: [4 n8 + 2 h + e]
        o = cute.make_tensor(acc_O.iterator, cute.make_layout(M_TILES * N // 2))  # [mt N / 2 + 4 n8 + 2 h + e]
        for e in cutlass.range_constexpr(M_TILES * N // 2):
            o[e] = _opaque_zero()
        for e in cutlass.range_constexpr(N // 2):
            s[e] = _opaque_zero()

        tid = ctid % 128
        lane = tid % 32
        warp = tid // 32
        g = lane // 4
        t = lane % 4
        row_m = cute.make_rmem_tensor((NC,), Float32)
        row_l = cute.make_rmem_tensor((NC,), Float32)
        for c in cutlass.range_constexpr(NC):
            row_m[c] = Float32(NEG_INF)
            row_l[c] = Float32(0.0)
        x_max = storage.x_max.data_ptr().toint() + w * (NUM_WARPS * N * 4)
        p_own = sK_addr + w * self.cfg.stage_bytes + (NUM_CHUNKS - 1) * CHUNK_BYTES

        cute.arch.mbarrier_wait(q_bar, 0)
        cute.arch.fence_view_async_shared()  # Q came through cp.async (generic proxy), wgmma reads it (async)
        diag = mWork[wi, W_KV_LEN] - mWork[wi, W_QO_LEN] if const_expr(self.causal) else Int32(0)
        lims = (t0, t1 - 1, diag, row0, rows, H, warp, g, t)
        for i in cutlass.range((n_blk - w + 1) // 2, unroll=1):
            n = 2 * i + w
            if w == 0:
                self._issue_st(mma_st, acc_S, tSrK, tSrQ, full, 0, i % 2)
            else:
                self._issue_st(mma_st, acc_S, tSrK, tSrQ, full, 1, i % 2)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            self._softmax_t(s, o, row_m, row_l, sc, (pg0 + n) * BLOCK_N, lims, x_max, p_own, w)
            warpgroup.fence()
            atom = cute.make_mma_atom(mma_ot.op)
            atom.set(warpgroup.Field.ACCUMULATE, True)
            for k in cutlass.range_constexpr(BLOCK_N // 16):
                if w == 0:
                    cute.gemm(atom, acc_O, tOrV[None, None, k, 0], tOrP[None, None, k, 0], acc_O)
                else:
                    cute.gemm(atom, acc_O, tOrV[None, None, k, 1], tOrP[None, None, k, 1], acc_O)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            for gi in cutlass.range_constexpr(NUM_GROUPS):  # the whole stage is the own block's: reload it
                cute.arch.mbarrier_arrive(empty + (w * NUM_GROUPS + gi))
        part = mWork[wi, W_PART_BASE] + mWork[wi, W_SPLIT_IDX]
        self._epilogue_t(mO, mLSE, mPO, mPLSE, o, row_m, row_l, storage, sK_addr, mWork[wi, W_Q_START], row0, rows,
                         H, part, mWork[wi, W_NUM_SPLITS] == 1, output_scale, w, tid, warp, g, t)
        return ptx.opaque_i32(sK_addr)

    @cute.jit
    def _issue_st(self, mma_st, acc_S, tSrK, tSrQ, full, w: cutlass.Constexpr, parity):
        """Issue S^T = K Q^T of stage ``w``, group by group as the producer loads them (full mbarriers,
        ``parity``); the caller commits."""
        warpgroup.fence()
        atom = cute.make_mma_atom(mma_st.op)
        atom.set(warpgroup.Field.ACCUMULATE, False)
        for gi in self._load_order(w):
            cute.arch.mbarrier_wait(full + (w * NUM_GROUPS + gi), parity)
            cute.arch.fence_view_async_shared()  # (a gathered page came through cp.async)
            for k in cutlass.range_constexpr(GROUP_CHUNKS[gi][0] * 4, (GROUP_CHUNKS[gi][-1] + 1) * 4):
                cute.gemm(atom, acc_S, tSrK[None, None, k, w], tSrQ[None, None, k], acc_S)
                atom.set(warpgroup.Field.ACCUMULATE, True)

    @cute.jit
    def _softmax_t(self, s, o, row_m, row_l, sc, blk0, lims, x_max, p_own, w):
        """The block's S^T (raw ``q.k``, ``s[4 n8 + 2 h + e]``: token ``16 warp + g + 8 h``, column
        ``8 n8 + 2 t + e``) -> P^T in the kpe chunk at ``p_own``; the columns' running maxima ``row_m`` and the
        lane's row sums ``row_l`` moved on, O^T scaled by the factor.  Ends with P^T fenced for wgmma and the
        warpgroup's barrier passed."""
        t0, t_last, diag, row0, rows, H, warp, g, t = lims
        edge = (blk0 < t0) | (blk0 + BLOCK_N - 1 > t_last)
        if const_expr(self.causal):  # (the tile's first row sees the fewest keys)
            edge = edge | (blk0 + BLOCK_N - 1 > diag + row0 // H)
        if edge:
            self._softmax_t_step(s, o, row_m, row_l, sc, blk0, lims, x_max, p_own, w, True)
        else:
            self._softmax_t_step(s, o, row_m, row_l, sc, blk0, lims, x_max, p_own, w, False)

    @cute.jit
    def _softmax_t_step(self, s, o, row_m, row_l, sc, blk0, lims, x_max, p_own, w, masked: cutlass.Constexpr):
        """:meth:`_softmax_t` with the mask (``masked``) or without."""
        N = self.tile_n
        NC = N // 4
        t0, t_last, diag, row0, rows, H, warp, g, t = lims
        lim = [t_last] * NC
        if const_expr(masked and self.causal):
            for c in cutlass.range_constexpr(NC):
                pr = cutlass.min(row0 + (c // 2) * 8 + 2 * t + c % 2, rows - 1)
                lim[c] = cutlass.min(t_last, diag + pr // H)

        def logit(h, c):
            x = s[(c // 2) * 4 + 2 * h + c % 2] * sc
            if const_expr(masked):
                tok = blk0 + warp * 16 + g + 8 * h
                x = Float32(cutlass.select_((tok >= t0) & (tok <= lim[c]), x, Float32(NEG_INF)))
            return x

        for c in cutlass.range_constexpr(NC):  # the warp's column maxima over its 16 tokens
            m = cute.arch.fmax(logit(0, c), logit(1, c))
            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=4))
            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=8))
            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=16))
            if g == 0:
                ptx.st_shared_f32(x_max + (warp * N + (c // 2) * 8 + 2 * t + c % 2) * 4, m)
        cute.arch.barrier(barrier_id=SWAP_BAR + w, number_of_threads=128)
        scale = [Float32(1.0)] * NC
        mx = [Float32(0.0)] * NC
        for c in cutlass.range_constexpr(NC):
            col = (c // 2) * 8 + 2 * t + c % 2
            m = ptx.ld_shared_f32(x_max + col * 4)
            for wp in cutlass.range_constexpr(1, NUM_WARPS):
                m = cute.arch.fmax(m, ptx.ld_shared_f32(x_max + (wp * N + col) * 4))
            m_new = cute.arch.fmax(row_m[c], m)
            m_use = Float32(cutlass.select_(m_new == Float32(NEG_INF), Float32(0.0), m_new))
            scale[c] = ptx.ex2(row_m[c] - m_use)
            row_m[c] = m_new
            mx[c] = m_use
        # P^T (rows = columns of S^T, 64 tokens a 128-byte swizzled row): token k at 16-byte piece k // 8 ^ row % 8
        for c in cutlass.range_constexpr(NC):
            col = (c // 2) * 8 + 2 * t + c % 2
            tot = Float32(0.0)
            for h in cutlass.range_constexpr(2):
                p = ptx.ex2(logit(h, c) - mx[c])
                tot = tot + p
                ptx.st_shared_u16(p_own + pt_offset(col, warp, g, h), ptx.f32_to_16(p, self.dtype))
            row_l[c] = row_l[c] * scale[c] + tot
        for mt in cutlass.range_constexpr(M_TILES):
            for c in cutlass.range_constexpr(NC):
                for h in cutlass.range_constexpr(2):
                    e = mt * (N // 2) + (c // 2) * 4 + 2 * h + c % 2
                    o[e] = _mul_pinned(o[e], scale[c])
        ptx.fence_proxy_async_shared()  # st.shared of P^T before wgmma's reads
        cute.arch.barrier(barrier_id=SWAP_BAR + w, number_of_threads=128)

    @cute.jit
    def _epilogue_t(self, mO, mLSE, mPO, mPLSE, o, row_m, row_l, storage, sK_addr, q_start, row0, rows, H, part,
                    final, output_scale, w, tid, warp, g, t):
        """Both warpgroups' halves -> O (x ``output_scale``, 16-bit; or the fp32 partial ``mPO[part, row, :]`` of
        a split item) and the base-2 LSE, written by warpgroup 0; warpgroup 1's O^T goes through its stage."""
        N = self.tile_n
        NC = N // 4
        x_sum = storage.x_sum.data_ptr().toint()
        x_m = storage.x_m.data_ptr().toint()
        o1 = sK_addr + self.cfg.stage_bytes  # stage 1: warpgroup 1's, dead once its blocks are done
        for c in cutlass.range_constexpr(NC):
            col = (c // 2) * 8 + 2 * t + c % 2
            x = row_l[c]
            x = x + cute.arch.shuffle_sync_bfly(x, offset=4)
            x = x + cute.arch.shuffle_sync_bfly(x, offset=8)
            x = x + cute.arch.shuffle_sync_bfly(x, offset=16)
            if g == 0:
                ptx.st_shared_f32(x_sum + ((w * NUM_WARPS + warp) * N + col) * 4, x)
                if (w == 1) & (warp == 0):
                    ptx.st_shared_f32(x_m + col * 4, row_m[c])
        if w == 1:  # (warpgroup 0's thread tid holds the same elements: no layout needed)
            for e in cutlass.range_constexpr(M_TILES * N // 2):
                ptx.st_shared_f32(o1 + (e * 128 + tid) * 4, o[e])
        cute.arch.barrier(barrier_id=CONSUMER_BAR, number_of_threads=256)
        if w == 0:
            dt = self.o_dtype
            o_base = mO.iterator.toint()
            for c in cutlass.range_constexpr(NC):
                col = (c // 2) * 8 + 2 * t + c % 2
                pr = row0 + col
                if pr < rows:
                    l0 = Float32(0.0)
                    l1 = Float32(0.0)
                    for wp in cutlass.range_constexpr(NUM_WARPS):
                        l0 = l0 + ptx.ld_shared_f32(x_sum + (wp * N + col) * 4)
                        l1 = l1 + ptx.ld_shared_f32(x_sum + ((NUM_WARPS + wp) * N + col) * 4)
                    m0 = row_m[c]
                    m1 = ptx.ld_shared_f32(x_m + col * 4)
                    m = cute.arch.fmax(m0, m1)
                    m_use = Float32(cutlass.select_(m == Float32(NEG_INF), Float32(0.0), m))
                    a0 = ptx.ex2(m0 - m_use)
                    a1 = ptx.ex2(m1 - m_use)
                    l = l0 * a0 + l1 * a1
                    inv = Float32(cutlass.select_(l > Float32(0.0), ptx.rcp(l), Float32(0.0)))
                    inv = inv * Float32(cutlass.select_(final, output_scale, Float32(1.0)))
                    lse = Float32(cutlass.select_(l > Float32(0.0), m_use + ptx.lg2(l), Float32(NEG_INF)))
                    f0 = a0 * inv
                    f1 = a1 * inv
                    tok = q_start + pr // H
                    hh = pr % H
                    row_addr = o_base + (Int64(tok) * mO.stride[0] + Int64(hh) * mO.stride[1]) * 2
                    for mt in cutlass.range_constexpr(M_TILES):
                        for h in cutlass.range_constexpr(2):
                            e = mt * (N // 2) + (c // 2) * 4 + 2 * h + c % 2
                            d = mt * 64 + warp * 16 + g + 8 * h
                            v = o[e] * f0 + ptx.ld_shared_f32(o1 + (e * 128 + tid) * 4) * f1
                            if final:
                                _st_global_u16(row_addr + d * 2, ptx.f32_to_16(v, dt))
                            else:
                                mPO[part, pr, d] = v
                    if (warp == 0) & (g == 0):
                        if final:
                            mLSE[tok, hh] = lse
                        else:
                            mPLSE[part, pr] = lse
