"""SM90 MLA decode kernel: the producer warpgroup's loads, the consumer warpgroups' main loop, epilogue and merge.

Roles (384 threads, one CTA per (64-row tile, work item), registers rebalanced by ``setmaxnreg``):

* producer warpgroup (warps 0..3): gathers the tile's 64 packed Q rows ``[q_nope | q_pe]`` with ``cp.async``
  (zero past the request's rows; through registers, widened to f16, for an fp8 q or a bf16 q over fp8 caches),
  then streams the item's 64-token blocks: block ``n`` (tokens from ``(t0 // 64 + n) * 64``) into stage ``n % 2``.
  Page size 64: 9 TMA boxes of 64 x 64 of one page, or for the page holding the request's end a ``cp.async``
  gather that zeroes the slots past ``kv_len`` (unused page slots may hold NaN; a zero P would not cancel them in
  P V).  Smaller pages and fp8 caches: every block gathered row by row (:mod:`cutedsl_attn.sm90.mla.loads`: each
  row's own page; 16-bit rows by ``cp.async``, fp8 bytes ``cp.async``-staged in the stage and widened in place
  (``Tiles.fp8_loads = 0``: through registers), rows outside the item zeroed);
* consumer warpgroup ``w`` (0, 1) owns O's columns ``[256 w, 256 w + 256)`` (128 fp32 registers) and the blocks
  ``n % 2 == w``.  For its block ``n`` it computes S = Q K^T (wgmma, both operands in shared memory), takes the
  running max ``m_{n-1}`` the other warpgroup published with block ``n - 1``, runs the softmax step, publishes
  ``m_n`` and P_n (16-bit, written over the block's kpe columns, which only S read) and signals the other
  warpgroup (a named barrier); both then add ``P_n V_n`` to their half of O, the owner with P from registers,
  the other from the shared tile.  The softmax steps thus form one chain alternating between the warpgroups,
  and while one runs its softmax the tensor cores run the other's S of the next block and both halves of
  P V of the previous one: per iteration a warpgroup applies the factor of block ``n - 1``, issues S_n and then
  ``P_{n-1} V_{n-1}``, waits for S_n only, runs the softmax, and issues ``P_n V_n`` once the first P V is done
  (``Tiles.schedule`` 0, signal first).  With ``Tiles.schedule`` 1 (S first) a warpgroup issues the part of S_n
  over the other half and kpe (freed by the other warpgroup's P V of block ``n - 2``) before it waits for
  ``m_{n-1}``, the own half (freed by its own P V of block ``n - 2``) after ``P_{n-1} V_{n-1}``, and waits for
  that P V before its softmax, so the other block's stage reloads while the softmax runs; the producer then loads
  each stage's groups in that order.  Both halves of O and the row sums take the same factors, so the row sums add
  up at the end.

Each stage has three release groups (ckv columns 0..255, 256..511, kpe / P), each a full and an empty mbarrier;
a group is reloaded once its last reader is done (half ``w`` after warpgroup ``w``'s P V, the kpe / P chunk
after the other warpgroup's).  Tokens outside ``[tok_start, tok_end)`` of the work item (a page shared with
the neighbouring split) are masked in S, and so are keys past a row's bottom-right causal limit.  Split items
write fp32 partials; the last CTA of a (request, row tile) merges them in the same launch
(:func:`cutedsl_attn.common.splitkv.last_to_arrive` elects it), or with ``Tiles.merge_kernel`` a second kernel of
the same launch does (:mod:`cutedsl_attn.sm90.mla.merge`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ...common import ptx, splitkv
from ...common.constants import LOG2E, NEG_INF
from ...common.smem import sw128_offset, transpose_view
from ...planning.decode import (
    W_BATCH, W_KV_LEN, W_NUM_SPLITS, W_PAGE_OFF, W_PART_BASE, W_SPLIT_IDX, W_TOK_END, W_TOK_START,
)
from ...planning.mla import HEAD_DIM_CKV, W_Q_START, W_QO_LEN
from .config import (BLOCK_N, CHUNK_COLS, D_QK, GROUP_CHUNKS, NUM_CHUNKS, NUM_GROUPS, SCHEDULE_S_FIRST, TILE_M, V_HALF,
                     Config)
from .loads import ProducerLoads
from .merge import MERGE_CTAS_PER_TILE, MERGE_THREADS, SplitMerge

CONSUMER_BAR = 1  # named barrier of the two consumer warpgroups (256 threads); 0 is __syncthreads
SIGNAL_BAR = 2  # 2 + w: warpgroup w has published m_n and P_n of its block n (arrive by w, sync by the other)
CHUNK_BYTES = BLOCK_N * CHUNK_COLS * 2  # 8 KiB: one 64 x 64 16-bit chunk
ROWS_PER_CHUNK_COL = D_QK // 8  # 72 16-byte pieces per 576-wide row


def _opaque_zero():
    """0.0 from an instruction the compiler keeps where it is and does not merge with another."""
    return cute.arch.inline_ptx("mov.b32 {$w0}, 0;", write_only_types=[Float32])


def _mul_pinned(a, b):
    """``a * b`` in an instruction the compiler keeps in program order with the wgmma issue around it (a plain
    multiply of O sinks past the next wgmma.fence towards the P V that reads it, and ptxas then serialises the
    GEMMs)."""
    return cute.arch.inline_ptx("mul.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32],
                                read_only_args=[Float32(a), Float32(b)])


class MlaSm90Kernel(SplitMerge, ProducerLoads):
    """CuTe DSL SM90 MLA decode of one :class:`~cutedsl_attn.sm90.mla.config.Config` (build with ``compile``)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.dtype = cfg.mma_dtype  # the wgmmas' and shared memory's
        self.o_dtype = cfg.cutlass_dtype
        self.gather = cfg.gather
        self.kv_fp8 = cfg.problem.kv_fp8
        self.q_fp8 = cfg.problem.q_fp8
        self.page_size = cfg.problem.page_size
        self.S = cfg.tiles.num_stages
        self.registers = cfg.registers
        self.causal = cfg.problem.causal
        self.schedule = cfg.tiles.schedule
        self.merge_kernel = cfg.tiles.merge_kernel

    def _stage_layouts_and_tma(self, mCkv, mKpe):
        """(sQ layout, stage ring layout, TMA atom / tensor of ckv, of kpe) of the kernel entry (traced inside
        ``__call__``; the atoms None for gathered blocks), shared by the swapped-AB entry."""
        dt = self.dtype
        sQ_layout = cute.select(sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TILE_M, BLOCK_N, D_QK), dt, 1),
                                mode=[0, 1])
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TILE_M, BLOCK_N, D_QK), dt, self.S)
        box = cute.select(sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TILE_M, BLOCK_N, CHUNK_COLS), dt, 1),
                          mode=[0, 1])
        tma_atom_c, tma_c, tma_atom_p, tma_p = None, None, None, None  # (gathered blocks: no TMA)
        if const_expr(not self.gather):
            g2s = cpasync.CopyBulkTensorTileG2SOp()
            # the caches as (slot in page, dim, page): one box = one page's 64 slots x 64 columns
            mCkv_t = cute.make_tensor(mCkv.iterator, cute.select(mCkv.layout, mode=[1, 2, 0]))
            mKpe_t = cute.make_tensor(mKpe.iterator, cute.select(mKpe.layout, mode=[1, 2, 0]))
            tma_atom_c, tma_c = cpasync.make_tiled_tma_atom(g2s, mCkv_t, box, (BLOCK_N, CHUNK_COLS), 1)
            tma_atom_p, tma_p = cpasync.make_tiled_tma_atom(g2s, mKpe_t, box, (BLOCK_N, CHUNK_COLS), 1)
        return sQ_layout, sK_layout, tma_atom_c, tma_c, tma_atom_p, tma_p

    @cute.jit
    def __call__(self, mQn: cute.Tensor, mQp: cute.Tensor, mCkv: cute.Tensor, mKpe: cute.Tensor, mIdx: cute.Tensor,
                 mWork: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mPO: cute.Tensor, mPLSE: cute.Tensor,
                 mCnt: cute.Tensor, sm_scale: Float32, output_scale: Float32, num_tiles: Int32, stream):
        dt = self.dtype
        K_MAJOR = cute.nvgpu.OperandMajorMode.K
        MN_MAJOR = cute.nvgpu.OperandMajorMode.MN
        mma_qk = sm90_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, K_MAJOR, Float32, atom_layout_mnk=(1, 1, 1),
                                                   tiler_mn=(TILE_M, BLOCK_N))
        mma_rs = sm90_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, MN_MAJOR, Float32, atom_layout_mnk=(1, 1, 1),
                                                   tiler_mn=(TILE_M, V_HALF), a_source=warpgroup.OperandSource.RMEM)
        mma_ss = sm90_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, MN_MAJOR, Float32, atom_layout_mnk=(1, 1, 1),
                                                   tiler_mn=(TILE_M, V_HALF))
        sQ_layout, sK_layout, tma_atom_c, tma_c, tma_atom_p, tma_p = self._stage_layouts_and_tma(mCkv, mKpe)

        @cute.struct
        class SharedStorage:
            mbar_full: cute.struct.MemRange[cutlass.Int64, 2 * NUM_GROUPS]
            mbar_empty: cute.struct.MemRange[cutlass.Int64, 2 * NUM_GROUPS]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 1]
            flag: cute.struct.MemRange[Float32, 4]
            s_max: cute.struct.MemRange[Float32, 2 * TILE_M]  # [block n % 2][row]: the running max after block n
            s_sum: cute.struct.MemRange[Float32, 2 * TILE_M]  # [warpgroup][row]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(mQn, mQp, mCkv, mKpe, mIdx, mWork, mO, mLSE, mPO, mPLSE, mCnt, tma_atom_c, tma_c, tma_atom_p,
                    tma_p, sm_scale, output_scale, sQ_layout, sK_layout, mma_qk, mma_rs, mma_ss).launch(
            grid=(num_tiles, mWork.shape[0], 1), block=(self.cfg.num_threads, 1, 1),
            smem=SharedStorage.size_in_bytes(), stream=stream)
        if const_expr(self.merge_kernel):
            self.merge(mO, mLSE, mPO, mPLSE, mWork, output_scale).launch(
                grid=(num_tiles * MERGE_CTAS_PER_TILE, mPLSE.shape[0], 1), block=(MERGE_THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mQn, mQp, mCkv, mKpe, mIdx, mWork, mO, mLSE, mPO, mPLSE, mCnt, tma_atom_c, tma_c, tma_atom_p,
               tma_p, sm_scale: Float32, output_scale: Float32, sQ_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, mma_qk: cute.TiledMma, mma_rs: cute.TiledMma, mma_ss: cute.TiledMma):
        """Device entry: one CTA per (64-row tile, work item); see the module docstring."""
        tidx, _, _ = cute.arch.thread_idx()
        tile, wi, _ = cute.arch.block_idx()
        n_tiles, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        full = storage.mbar_full.data_ptr()
        empty = storage.mbar_empty.data_ptr()
        q_bar = storage.mbar_q.data_ptr()
        if warp_idx == 0:
            if const_expr(not self.gather):
                cpasync.prefetch_descriptor(tma_atom_c)
                cpasync.prefetch_descriptor(tma_atom_p)
            with cute.arch.elect_one():
                for i in cutlass.range_constexpr(2 * NUM_GROUPS):
                    cute.arch.mbarrier_init(full + i, 128)  # the producer's 128 threads
                    cute.arch.mbarrier_init(empty + i, 128)  # the one consumer warpgroup that reads it last
                cute.arch.mbarrier_init(q_bar, 128)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sQ_addr = storage.sQ.data_ptr().toint()
        sK_addr = storage.sK.data_ptr().toint()

        H = mQn.shape[1]
        if (mWork[wi, W_BATCH] >= 0) & (tile * TILE_M < mWork[wi, W_QO_LEN] * H):
            # each role reads the work-table fields it needs and hands back the shared base the split-KV merge
            # uses (values held across the roles would spill)
            s_after = Int32(0)
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(self.registers[1])
                self._producer(mQn, mQp, mCkv, mKpe, mIdx, mWork, wi, tile, tma_atom_c, tma_c, tma_atom_p, tma_p,
                               sK, sQ_addr, sK_addr, full, empty, q_bar, tidx)
                s_after = ptx.opaque_i32(sK_addr)
            else:
                cute.arch.setmaxregister_increase(self.registers[0])
                ctid = tidx - 128
                w = cute.arch.make_warp_uniform(ctid // 128)
                s_after = self._consume(mO, mLSE, mPO, mPLSE, mWork, wi, tile, sQ, sK, sK_addr, full, empty, q_bar,
                                        storage, mma_qk, mma_rs, mma_ss, sm_scale * LOG2E, output_scale,
                                        ptx.opaque_i32(ctid), w)
            if const_expr(not self.merge_kernel):  # (else the merge kernel of the same launch merges)
                n_splits = mWork[wi, W_NUM_SPLITS]
                if n_splits > 1:
                    is_last, cnt_addr = splitkv.last_to_arrive(
                        mCnt, mWork[wi, W_BATCH], n_tiles, tile, n_splits,
                        s_after + (storage.flag.data_ptr().toint() - sK_addr), tidx)
                    if is_last:
                        if warp_idx >= 4:
                            self._merge(mO, mLSE, mPO, mPLSE, mWork, wi, tile, s_after, cnt_addr, output_scale,
                                        tidx - 128)

    # ------------------------------------------------------------------ producer warpgroup
    @cute.jit
    def _producer(self, mQn, mQp, mCkv, mKpe, mIdx, mWork, wi, tile, tma_atom_c, tma_c, tma_atom_p, tma_p, sK,
                  sQ_addr, sK_addr, full, empty, q_bar, tid):
        """The producer warpgroup: Q, then the item's pages."""
        H = mQn.shape[1]
        rows = mWork[wi, W_QO_LEN] * H
        if const_expr(self.cfg.widen_q):
            self._load_q_widen(mQn, mQp, sQ_addr, q_bar, mWork[wi, W_Q_START], tile * TILE_M, rows, H, tid)
        else:
            self._load_q(mQn, mQp, sQ_addr, q_bar, mWork[wi, W_Q_START], tile * TILE_M, rows, H, tid)
        t0 = mWork[wi, W_TOK_START]
        t1 = mWork[wi, W_TOK_END]
        pg0 = t0 // BLOCK_N
        n_blk = Int32(cutlass.select_(t1 > t0, (t1 - 1) // BLOCK_N - pg0 + 1, 0))
        if const_expr(self.gather):
            self._produce_rows(mCkv, mKpe, mIdx, sK_addr, full, empty, mWork[wi, W_PAGE_OFF], pg0, n_blk, t0, t1,
                               tid)
        else:
            self._produce(mCkv, mKpe, mIdx, tma_atom_c, tma_c, tma_atom_p, tma_p, sK, sK_addr, full, empty,
                          mWork[wi, W_PAGE_OFF], pg0, n_blk, mWork[wi, W_KV_LEN], tid)
        ptx.cp_async_wait(0)  # no producer thread leaves with its tail-page copies still in flight

    @cute.jit
    def _load_q(self, mQn, mQp, sQ_addr, q_bar, q_start, row0, rows, H, tid):
        """The tile's 64 packed Q rows (row ``r``: token ``q_start + (row0 + r) // H``, head ``(row0 + r) % H``;
        zero past ``rows``) -> sQ by ``cp.async``; every producer thread arrives on ``q_bar`` as its copies land."""
        qn = mQn.iterator.toint()
        qp = mQp.iterator.toint()
        for it in cutlass.range(TILE_M * ROWS_PER_CHUNK_COL // 128, unroll=1):
            idx = it * 128 + tid
            r = idx // ROWS_PER_CHUNK_COL
            c16 = idx % ROWS_PER_CHUNK_COL
            pr = row0 + r
            pr_c = cutlass.min(pr, rows - 1)
            tok = q_start + pr_c // H
            h = pr_c % H
            nope = c16 < HEAD_DIM_CKV // 8
            src = Int64(cutlass.select_(
                nope, qn + (Int64(tok) * mQn.stride[0] + Int64(h) * mQn.stride[1]) * 2 + c16 * 16,
                qp + (Int64(tok) * mQp.stride[0] + Int64(h) * mQp.stride[1]) * 2 + (c16 - HEAD_DIM_CKV // 8) * 16))
            ptx.cp_async_16(sQ_addr + sw128_offset(r, c16, TILE_M), src, cutlass.select_(pr < rows, 16, 0))
        cute.arch.cp_async_mbarrier_arrive_noinc(q_bar)

    @cute.jit
    def _produce(self, mCkv, mKpe, mIdx, tma_atom_c, tma_c, tma_atom_p, tma_p, sK, sK_addr, full, empty, page_off,
                 pg0, n_blk, kv_len, tid):
        """Blocks in pairs (block ``2 j + c`` -> stage ``c``), each stage's three groups as their last reader
        releases them (empty mbarrier, parity of the pair ``j``)."""
        for j in cutlass.range((n_blk + 1) // 2, unroll=1):
            for c in cutlass.range_constexpr(2):
                n = 2 * j + c
                if n < n_blk:
                    pg = pg0 + n
                    page = mIdx[page_off + pg]
                    tail = (pg + 1) * BLOCK_N > kv_len  # the page past the request's end: gathered, zero-filled
                    for g in self._load_order(c):
                        cute.arch.mbarrier_wait(empty + (c * NUM_GROUPS + g), (j % 2) ^ 1)
                        bar = full + (c * NUM_GROUPS + g)
                        if tail:
                            self._gather_group(mCkv, mKpe, sK_addr + c * self.cfg.stage_bytes, g, page,
                                               kv_len - pg * BLOCK_N, tid)
                            cute.arch.cp_async_mbarrier_arrive_noinc(bar)
                        else:
                            self._tma_group(tma_atom_c, tma_c, tma_atom_p, tma_p, sK, c, g, page, bar)
                            cute.arch.mbarrier_arrive(bar)

    def _load_order(self, c: int) -> tuple:
        """The order stage ``c``'s groups are loaded in: the order the schedule frees them (signal first: the
        owner's own half first, as its S reads them)."""
        if self.schedule == SCHEDULE_S_FIRST:
            return (1 - c, NUM_GROUPS - 1, c)
        return (0, 1, 2) if c == 0 else (1, 0, 2)

    @cute.jit
    def _tma_group(self, tma_atom_c, tma_c, tma_atom_p, tma_p, sK, c: cutlass.Constexpr, g: cutlass.Constexpr, page,
                   bar):
        """Warp 0: expect the group's bytes on ``bar`` and issue its 64 x 64 boxes of page ``page`` into stage
        ``c`` (every lane of the warp: the copy elects its issuing lane)."""
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_expect_tx(bar, len(GROUP_CHUNKS[g]) * CHUNK_BYTES)
            for k in GROUP_CHUNKS[g]:
                if const_expr(k < NUM_CHUNKS - 1):
                    src = cute.local_tile(tma_c[None, None, page], (BLOCK_N, CHUNK_COLS), (0, k))
                    atom = tma_atom_c
                else:
                    src = cute.local_tile(tma_p[None, None, page], (BLOCK_N, CHUNK_COLS), (0, 0))
                    atom = tma_atom_p
                dst = cute.local_tile(sK[None, None, c], (BLOCK_N, CHUNK_COLS), (0, k))
                tXs, tXg = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                                                 cute.group_modes(src, 0, 2))
                cute.copy(atom, tXg, tXs, tma_bar_ptr=bar)

    # ------------------------------------------------------------------ consumer warpgroups
    @cute.jit
    def _consume(self, mO, mLSE, mPO, mPLSE, mWork, wi, tile, sQ, sK, sK_addr, full, empty, q_bar, storage, mma_qk,
                 mma_rs, mma_ss, sc, output_scale, ctid, w):
        """Consumer warpgroup ``w``: the blocks, then its half of O (module docstring).  Returns the stages' shared
        address (opaque: the kernel's copy of it is not held across this role)."""
        dt = self.dtype
        H = mO.shape[1]
        rows = mWork[wi, W_QO_LEN] * H
        row0 = tile * TILE_M
        t0 = mWork[wi, W_TOK_START]
        t1 = mWork[wi, W_TOK_END]
        pg0 = t0 // BLOCK_N
        n_blk = Int32(cutlass.select_(t1 > t0, (t1 - 1) // BLOCK_N - pg0 + 1, 0))
        sl_qk = mma_qk.get_slice(0)
        sl_rs = mma_rs.get_slice(0)
        sl_ss = mma_ss.get_slice(0)
        tSrQ = sl_qk.make_fragment_A(sl_qk.partition_A(sQ))
        tSrK = sl_qk.make_fragment_B(sl_qk.partition_B(sK))
        # this warpgroup's 256 columns of V (= ckv) in both stages, as P V's (dims, tokens) B operand
        sVt = cute.local_tile(transpose_view(sK), (V_HALF, BLOCK_N, self.S), (w, 0, 0))
        tOrV_rs = sl_rs.make_fragment_B(sl_rs.partition_B(sVt))
        tOrV_ss = sl_ss.make_fragment_B(sl_ss.partition_B(sVt))
        # the other warpgroup's P: its block's kpe chunk, rows = query rows, columns = tokens
        sP = cute.local_tile(sK, (TILE_M, BLOCK_N, self.S), (0, NUM_CHUNKS - 1, 0))
        tOsP = sl_ss.make_fragment_A(sl_ss.partition_A(sP))
        acc_S = cute.make_rmem_tensor(sl_qk.partition_shape_C((TILE_M, BLOCK_N)), Float32)
        acc_O = cute.make_rmem_tensor(sl_rs.partition_shape_C((TILE_M, V_HALF)), Float32)
        tOrP = sl_rs.make_fragment_A(sl_rs.partition_shape_A((TILE_M, BLOCK_N)))
        s = cute.make_tensor(acc_S.iterator, cute.make_layout(BLOCK_N // 2))  # flat: [4 n8 + 2 h + e]
        o = cute.make_tensor(acc_O.iterator, cute.make_layout(V_HALF // 2))
        p_words = cute.make_tensor(cute.recast_ptr(tOrP.iterator, dtype=Int32), cute.make_layout(BLOCK_N // 4))
        # zeros the compiler cannot fold into one value: 160 copies of one register, placed after the first
        # GEMM's wgmma.fence, would serialise every wgmma of the kernel
        for e in cutlass.range_constexpr(V_HALF // 2):
            o[e] = _opaque_zero()
        for e in cutlass.range_constexpr(BLOCK_N // 2):
            s[e] = _opaque_zero()

        tid = ctid % 128
        lane = tid % 32
        warp = tid // 32
        g = lane // 4
        t = lane % 4
        other = 1 - w
        row_m = cute.make_rmem_tensor((2,), Float32)
        row_l = cute.make_rmem_tensor((2,), Float32)
        scale = cute.make_rmem_tensor((2,), Float32)
        for h in cutlass.range_constexpr(2):
            row_m[h] = Float32(NEG_INF)
            row_l[h] = Float32(0.0)
        mx = cute.make_rmem_tensor((2,), Float32)  # the block's row maxima, then the max in use
        s_max = storage.s_max.data_ptr().toint()
        s_sum = storage.s_sum.data_ptr().toint()
        p_own = sK_addr + w * self.cfg.stage_bytes + (NUM_CHUNKS - 1) * CHUNK_BYTES

        cute.arch.mbarrier_wait(q_bar, 0)
        cute.arch.fence_view_async_shared()  # Q came through cp.async (generic proxy), wgmma reads it (async)
        # the mask: keys [t0, t1) of the item and, causal, key <= diag + (packed row) // H (bottom-right)
        diag = mWork[wi, W_KV_LEN] - mWork[wi, W_QO_LEN] if const_expr(self.causal) else Int32(0)
        lims = (t0, t1 - 1, diag, row0, rows, H, warp, g, t)
        blk = (sc, pg0, lims, s_max, p_own, dt)
        if const_expr(self.schedule == SCHEDULE_S_FIRST):
            self._loop_s_first(s, o, p_words, row_m, row_l, scale, mx, acc_S, acc_O, tSrQ, tSrK, tOrP, tOrV_rs,
                               tOsP, tOrV_ss, mma_qk, mma_rs, mma_ss, full, empty, s_max, n_blk, w, warp, g, blk)
        else:
            if (w == 0) & (n_blk > 0):  # block 0: no block before it
                self._issue_s(mma_qk, acc_S, tSrQ, tSrK, full, 0, 0, (0, 1, 2))
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                self._own_block(s, p_words, row_m, row_l, scale, mx, 0, w, blk)
                self._issue_pv(mma_rs, acc_O, tOrP, tOrV_rs, w)  # (O is still 0: no factor)
            # iteration i: the other warpgroup's block n - 1 (P from shared memory), then the own block n = 2 i + w
            # (the wgmma waits and commits do not depend on which blocks exist: ptxas then sees no wgmma in flight where
            # an accumulator is written and keeps the GEMMs asynchronous)
            for i in cutlass.range(1 - w, (n_blk + 2 - w) // 2, unroll=1):
                n = 2 * i + w
                has_own = n < n_blk
                warpgroup.wait_group(0)
                if i >= 1:  # the own P V of block n - 2 is done with its half w: its stage reloads for block n
                    cute.arch.mbarrier_arrive(empty + (w * NUM_GROUPS + w))
                # the other warpgroup published m_{n-1} and P_{n-1}: O and the sums take the same factor here (before
                # S_n is issued: a register write to an accumulator inside a wgmma stage would serialise them)
                cute.arch.barrier(barrier_id=SIGNAL_BAR + other, number_of_threads=256)
                for h in cutlass.range_constexpr(2):
                    m_new = ptx.ld_shared_f32(s_max + (((n - 1) % 2) * TILE_M + warp * 16 + g + 8 * h) * 4)
                    m_use = Float32(cutlass.select_(m_new == Float32(NEG_INF), Float32(0.0), m_new))
                    scale[h] = ptx.ex2(row_m[h] - m_use)
                    row_m[h] = m_new
                    row_l[h] = row_l[h] * scale[h]
                for e in cutlass.range_constexpr(V_HALF // 2):
                    o[e] = _mul_pinned(o[e], scale[(e // 2) % 2])
                # S_n, then P_{n-1} V_{n-1}: the softmax of block n runs while this P V and the other warpgroup's
                # P_{n-1} V_{n-1} do
                if has_own:  # (the own half first: the other half and the kpe chunk are freed later)
                    if w == 0:
                        self._issue_s(mma_qk, acc_S, tSrQ, tSrK, full, 0, i % 2, (0, 1, 2))
                        warpgroup.commit_group()
                    else:
                        self._issue_s(mma_qk, acc_S, tSrQ, tSrK, full, 1, i % 2, (1, 0, 2))
                        warpgroup.commit_group()
                cute.arch.mbarrier_wait(full + (other * NUM_GROUPS + w), ((n - 1) // 2) % 2)
                cute.arch.fence_view_async_shared()
                self._issue_pv(mma_ss, acc_O, tOsP, tOrV_ss, other)
                warpgroup.wait_group(1)  # S_n (without an own block: nothing S reads; P V waited for below)
                if has_own:
                    self._own_block(s, p_words, row_m, row_l, scale, mx, n, w, blk)
                warpgroup.wait_group(0)
                # P_{n-1} V_{n-1} is done with the other block's half w and its P
                cute.arch.mbarrier_arrive(empty + (other * NUM_GROUPS + w))
                cute.arch.mbarrier_arrive(empty + (other * NUM_GROUPS + NUM_GROUPS - 1))
                if has_own:
                    for e in cutlass.range_constexpr(V_HALF // 2):
                        o[e] = _mul_pinned(o[e], scale[(e // 2) % 2])
                    self._issue_pv(mma_rs, acc_O, tOrP, tOrV_rs, w)
        warpgroup.wait_group(0)
        part = mWork[wi, W_PART_BASE] + mWork[wi, W_SPLIT_IDX]
        self._epilogue(mO, mLSE, mPO, mPLSE, o, row_m, row_l, s_sum, mWork[wi, W_Q_START], row0, rows, H, part,
                       mWork[wi, W_NUM_SPLITS] == 1, output_scale, w, warp, g, t)
        return ptx.opaque_i32(sK_addr)

    @cute.jit
    def _loop_s_first(self, s, o, p_words, row_m, row_l, scale, mx, acc_S, acc_O, tSrQ, tSrK, tOrP, tOrV_rs, tOsP,
                      tOrV_ss, mma_qk, mma_rs, mma_ss, full, empty, s_max, n_blk, w, warp, g, blk):
        """:data:`SCHEDULE_S_FIRST`: per iteration S_n's other-half and kpe groups are issued before the wait for
        the other warpgroup's m_{n-1} (they were freed by that warpgroup's P V of block n - 2), its own-half group
        (freed by the own P V of block n - 2 just before) after P_{n-1} V_{n-1}; P_{n-1} V_{n-1} is waited for
        before the softmax, so the other block's stage reloads while the softmax runs."""
        other = 1 - w
        if (w == 0) & (n_blk > 0):  # block 0: no block before it
            self._issue_s(mma_qk, acc_S, tSrQ, tSrK, full, 0, 0, (1, 2, 0))
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            self._own_block(s, p_words, row_m, row_l, scale, mx, 0, w, blk)
            self._issue_pv(mma_rs, acc_O, tOrP, tOrV_rs, w)  # (O is still 0: no factor)
        for i in cutlass.range(1 - w, (n_blk + 2 - w) // 2, unroll=1):
            n = 2 * i + w
            has_own = n < n_blk
            warpgroup.wait_group(0)
            if i >= 1:  # the own P V of block n - 2 is done with its half w: its stage reloads for block n
                cute.arch.mbarrier_arrive(empty + (w * NUM_GROUPS + w))
            if has_own:  # S_n over the other half and kpe (then O's factor: S does not accumulate into O)
                if w == 0:
                    self._issue_s(mma_qk, acc_S, tSrQ, tSrK, full, 0, i % 2, (1, 2))
                    warpgroup.commit_group()
                else:
                    self._issue_s(mma_qk, acc_S, tSrQ, tSrK, full, 1, i % 2, (0, 2))
                    warpgroup.commit_group()
            cute.arch.barrier(barrier_id=SIGNAL_BAR + other, number_of_threads=256)
            for h in cutlass.range_constexpr(2):
                m_new = ptx.ld_shared_f32(s_max + (((n - 1) % 2) * TILE_M + warp * 16 + g + 8 * h) * 4)
                m_use = Float32(cutlass.select_(m_new == Float32(NEG_INF), Float32(0.0), m_new))
                scale[h] = ptx.ex2(row_m[h] - m_use)
                row_m[h] = m_new
                row_l[h] = row_l[h] * scale[h]
            for e in cutlass.range_constexpr(V_HALF // 2):
                o[e] = _mul_pinned(o[e], scale[(e // 2) % 2])
            cute.arch.mbarrier_wait(full + (other * NUM_GROUPS + w), ((n - 1) // 2) % 2)
            cute.arch.fence_view_async_shared()
            self._issue_pv(mma_ss, acc_O, tOsP, tOrV_ss, other)
            if has_own:  # the rest of S_n: the own half
                if w == 0:
                    self._issue_s(mma_qk, acc_S, tSrQ, tSrK, full, 0, i % 2, (0,), True)
                else:
                    self._issue_s(mma_qk, acc_S, tSrQ, tSrK, full, 1, i % 2, (1,), True)
            warpgroup.commit_group()  # (an empty group without an own block: the waits stay the same)
            warpgroup.wait_group(1)
            # P_{n-1} V_{n-1} is done with the other block's half w and its P
            cute.arch.mbarrier_arrive(empty + (other * NUM_GROUPS + w))
            cute.arch.mbarrier_arrive(empty + (other * NUM_GROUPS + NUM_GROUPS - 1))
            warpgroup.wait_group(0)
            if has_own:
                self._own_block(s, p_words, row_m, row_l, scale, mx, n, w, blk)
                for e in cutlass.range_constexpr(V_HALF // 2):
                    o[e] = _mul_pinned(o[e], scale[(e // 2) % 2])
                self._issue_pv(mma_rs, acc_O, tOrP, tOrV_rs, w)

    @cute.jit
    def _issue_s(self, mma_qk, acc_S, tSrQ, tSrK, full, w: cutlass.Constexpr, parity, order: cutlass.Constexpr,
                 accumulate: cutlass.Constexpr = False):
        """Issue S = Q K^T of the own stage ``w``, group by group (in ``order``) as the groups land (full
        mbarriers, ``parity``); ``accumulate``: add to S (the rest of a block whose first groups are issued);
        the caller commits."""
        warpgroup.fence()
        atom = cute.make_mma_atom(mma_qk.op)
        atom.set(warpgroup.Field.ACCUMULATE, accumulate)
        for gi in order:
            cute.arch.mbarrier_wait(full + (w * NUM_GROUPS + gi), parity)
            cute.arch.fence_view_async_shared()  # (a gathered page came through cp.async)
            for k in cutlass.range_constexpr(GROUP_CHUNKS[gi][0] * 4, (GROUP_CHUNKS[gi][-1] + 1) * 4):
                cute.gemm(atom, acc_S, tSrQ[None, None, k], tSrK[None, None, k, w], acc_S)
                atom.set(warpgroup.Field.ACCUMULATE, True)

    @cute.jit
    def _issue_pv(self, mma, acc_O, tA, tB, stage):
        """Issue and commit O_w += P V over the 64 tokens of ``stage`` (P: registers or shared memory)."""
        warpgroup.fence()
        atom = cute.make_mma_atom(mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, True)
        for k in cutlass.range_constexpr(BLOCK_N // 16):
            cute.gemm(atom, acc_O, tA[None, None, k, stage] if const_expr(cute.rank(tA) == 4) else tA[None, None, k],
                      tB[None, None, k, stage], acc_O)
        warpgroup.commit_group()

    @cute.jit
    def _own_block(self, s, p_words, row_m, row_l, scale, mx, n, w, blk):
        """The own block ``n`` once its S is in: the softmax step, P -> the A fragment of the own P V and -> the
        block's kpe chunk (read by S_n only), m_n -> shared memory, then the signal to the other warpgroup.  O's
        factor (``scale``) is the caller's to apply, once no wgmma in flight accumulates into O."""
        sc, pg0, lims, s_max, p_own, dt = blk
        warp, g, t = lims[6:]
        self._softmax(s, p_words, row_m, row_l, scale, mx, sc, (pg0 + n) * BLOCK_N, lims)
        # (addresses from an opaque row: hoisted out of the block loop, the 16 of them would stay live and spill)
        gx = ptx.opaque_i32(g)
        for h in cutlass.range_constexpr(2):
            r = warp * 16 + g + 8 * h
            if t == 0:
                ptx.st_shared_f32(s_max + ((n % 2) * TILE_M + r) * 4, row_m[h])
            row = p_own + (warp * 16 + gx + 8 * h) * 128 + t * 4
            for n8 in cutlass.range_constexpr(BLOCK_N // 8):
                ptx.st_shared_b32(row + ((n8 ^ gx) * 16), p_words[n8 * 2 + h])  # (r % 8 == g)
        ptx.fence_proxy_async_shared()
        cute.arch.barrier_arrive(barrier_id=SIGNAL_BAR + w, number_of_threads=256)

    @cute.jit
    def _softmax(self, s, p_words, row_m, row_l, scale, mx, sc, blk0, lims):
        """The own block's S (raw ``q.k`` in the accumulator, ``s[4 n8 + 2 h + e]``, only read: a register write
        to an accumulator while the other P V is in flight would serialise the wgmmas) -> P as the 16-bit A
        fragment ``p_words``: scaled to log2 units, masked (``lims``: the item's keys ``[t0, t_last]``, with
        ``causal`` also keys past ``diag + row // H``) where the block reaches past either end, the running max
        ``row_m`` moved on (``scale``: the factor of O and ``row_l``), ``row_l`` += the lane's part of the row
        sums."""
        t0, t_last, diag, row0, rows, H, warp, g, t = lims
        edge = (blk0 < t0) | (blk0 + BLOCK_N - 1 > t_last)
        if const_expr(self.causal):  # (the tile's first row sees the fewest keys)
            edge = edge | (blk0 + BLOCK_N - 1 > diag + row0 // H)
        if edge:  # (a block at either end of the item, or crossing a causal row)
            self._softmax_step(s, p_words, row_m, row_l, scale, mx, sc, blk0, lims, True)
        else:
            self._softmax_step(s, p_words, row_m, row_l, scale, mx, sc, blk0, lims, False)

    @cute.jit
    def _softmax_step(self, s, p_words, row_m, row_l, scale, mx, sc, blk0, lims, masked: cutlass.Constexpr):
        """:meth:`_softmax` with the mask (``masked``) or without."""
        dt = self.dtype
        t0, t_last, diag, row0, rows, H, warp, g, t = lims
        lim = [t_last, t_last]
        if const_expr(masked and self.causal):
            for h in cutlass.range_constexpr(2):
                pr = cutlass.min(row0 + warp * 16 + g + 8 * h, rows - 1)
                lim[h] = cutlass.min(t_last, diag + pr // H)

        def logit(i):
            x = s[i] * sc
            if const_expr(masked):
                tok = blk0 + (i // 4) * 8 + 2 * t + i % 2
                x = Float32(cutlass.select_((tok >= t0) & (tok <= lim[(i // 2) % 2]), x, Float32(NEG_INF)))
            return x

        for h in cutlass.range_constexpr(2):
            m = logit(2 * h)
            for i in cutlass.range_constexpr(1, BLOCK_N // 4):
                m = cute.arch.fmax(m, logit((i // 2) * 4 + 2 * h + i % 2))
            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=1))
            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=2))
            m_new = cute.arch.fmax(row_m[h], m)
            m_use = Float32(cutlass.select_(m_new == Float32(NEG_INF), Float32(0.0), m_new))
            scale[h] = ptx.ex2(row_m[h] - m_use)
            row_m[h] = m_new
            mx[h] = m_use
        tot = [Float32(0.0), Float32(0.0)]
        for i2 in cutlass.range_constexpr(BLOCK_N // 4):  # word i2: row i2 % 2, columns 2 t, 2 t + 1 of n8 i2 // 2
            h = i2 % 2
            p0 = ptx.ex2(logit(2 * i2) - mx[h])
            p1 = ptx.ex2(logit(2 * i2 + 1) - mx[h])
            tot[h] = tot[h] + (p0 + p1)
            p_words[i2] = ptx.pack2(p0, p1, dt)
        for h in cutlass.range_constexpr(2):
            row_l[h] = row_l[h] * scale[h] + tot[h]

    @cute.jit
    def _epilogue(self, mO, mLSE, mPO, mPLSE, o, row_m, row_l, s_sum, q_start, row0, rows, H, part, final,
                  output_scale, w, warp, g, t):
        """Row sums of both warpgroups -> O's half ``w`` / l (x ``output_scale``, 16-bit; or the fp32 partial of
        a split item) and, from warpgroup 0, the base-2 LSE."""
        dt = self.o_dtype
        for h in cutlass.range_constexpr(2):
            x = row_l[h]
            x = x + cute.arch.shuffle_sync_bfly(x, offset=1)
            row_l[h] = x + cute.arch.shuffle_sync_bfly(x, offset=2)
            if t == 0:
                ptx.st_shared_f32(s_sum + (w * TILE_M + warp * 16 + g + 8 * h) * 4, row_l[h])
        cute.arch.barrier(barrier_id=CONSUMER_BAR, number_of_threads=256)
        o_base = mO.iterator.toint()
        for h in cutlass.range_constexpr(2):
            r = warp * 16 + g + 8 * h
            pr = row0 + r
            if pr < rows:
                l = ptx.ld_shared_f32(s_sum + r * 4) + ptx.ld_shared_f32(s_sum + (TILE_M + r) * 4)
                inv = Float32(cutlass.select_(l > Float32(0.0), ptx.rcp(l), Float32(0.0)))
                inv = inv * Float32(cutlass.select_(final, output_scale, Float32(1.0)))
                lse = Float32(cutlass.select_(l > Float32(0.0), row_m[h] + ptx.lg2(l), Float32(NEG_INF)))
                tok = q_start + pr // H
                hh = pr % H
                row_addr = o_base + (Int64(tok) * mO.stride[0] + Int64(hh) * mO.stride[1]) * 2
                for n8 in cutlass.range_constexpr(V_HALF // 8):
                    col = w * V_HALF + n8 * 8 + 2 * t
                    v0 = o[n8 * 4 + 2 * h] * inv
                    v1 = o[n8 * 4 + 2 * h + 1] * inv
                    if final:
                        ptx.st_global_u32(row_addr + col * 2, ptx.pack2(v0, v1, dt))
                    else:
                        mPO[part, pr, col] = v0
                        mPO[part, pr, col + 1] = v1
                if (w == 0) & (t == 0):
                    if final:
                        mLSE[tok, hh] = lse
                    else:
                        mPLSE[part, pr] = lse

    @cute.jit
    def _merge(self, mO, mLSE, mPO, mPLSE, mWork, wi, tile, sBuf, cnt_addr, output_scale, ctid):
        """Split-KV, the last CTA of (request, row tile): the consumer warpgroups merge every piece's partial into
        O (x ``output_scale``, folded into the fp32 weights, kept in the stages at ``sBuf``) and the LSE."""
        dt = self.o_dtype
        H = mO.shape[1]
        rows = mWork[wi, W_QO_LEN] * H
        row0 = tile * TILE_M
        q_start = mWork[wi, W_Q_START]
        part0 = mWork[wi, W_PART_BASE]
        n_splits = mWork[wi, W_NUM_SPLITS]
        ptx.fence_gpu()
        R = mPO.shape[1]
        plse_base = mPLSE.iterator.toint()
        po_base = mPO.iterator.toint()
        if ctid < TILE_M:
            pr = row0 + ctid
            if pr < rows:
                big_m = Float32(NEG_INF)
                for p in cutlass.range(n_splits, unroll=1):
                    x = ptx.ld_global_cg_f32(plse_base + (Int64(part0 + p) * R + pr) * 4)
                    ptx.st_shared_f32(sBuf + (p * TILE_M + ctid) * 4, x)
                    big_m = cute.arch.fmax(big_m, x)
                m_use = Float32(cutlass.select_(big_m == Float32(NEG_INF), Float32(0.0), big_m))
                tot = Float32(0.0)
                for p in cutlass.range(n_splits, unroll=1):
                    tot = tot + ptx.ex2(ptx.ld_shared_f32(sBuf + (p * TILE_M + ctid) * 4) - m_use)
                inv = Float32(cutlass.select_(tot > Float32(0.0), ptx.rcp(tot), Float32(0.0))) * output_scale
                for p in cutlass.range(n_splits, unroll=1):
                    a = sBuf + (p * TILE_M + ctid) * 4
                    ptx.st_shared_f32(a, ptx.ex2(ptx.ld_shared_f32(a) - m_use) * inv)
                mLSE[q_start + pr // H, pr % H] = Float32(
                    cutlass.select_(tot > Float32(0.0), m_use + ptx.lg2(tot), Float32(NEG_INF)))
        cute.arch.barrier(barrier_id=CONSUMER_BAR, number_of_threads=256)
        o_base = mO.iterator.toint()
        for e in cutlass.range(TILE_M * (HEAD_DIM_CKV // 4) // 256, unroll=1):
            vi = ctid + e * 256
            r = vi // (HEAD_DIM_CKV // 4)
            c4 = vi % (HEAD_DIM_CKV // 4)
            pr = row0 + r
            if pr < rows:
                o0 = Float32(0.0)
                o1 = Float32(0.0)
                o2 = Float32(0.0)
                o3 = Float32(0.0)
                for p in cutlass.range(n_splits, unroll=4):
                    wgt = ptx.ld_shared_f32(sBuf + (p * TILE_M + r) * 4)
                    x = ptx.ld_global_cg_v4_f32(po_base + ((Int64(part0 + p) * R + pr) * HEAD_DIM_CKV + c4 * 4) * 4)
                    o0 = o0 + wgt * x[0]
                    o1 = o1 + wgt * x[1]
                    o2 = o2 + wgt * x[2]
                    o3 = o3 + wgt * x[3]
                addr = o_base + (Int64(q_start + pr // H) * mO.stride[0] + Int64(pr % H) * mO.stride[1]
                                 + c4 * 4) * 2
                ptx.st_global_u32(addr, ptx.pack2(o0, o1, dt))
                ptx.st_global_u32(addr + 4, ptx.pack2(o2, o3, dt))
        if ctid == 0:
            ptx.st_global_u32(cnt_addr, 0)
