"""SM100 / SM103 (Blackwell) paged GQA decode: tcgen05.mma with swap-AB, S^T and O^T accumulators in TMEM.

One CTA per (kv head, work item) of :mod:`cutedsl_attn.planning.decode`'s work table (a token range of one
request, the whole request or a split-KV piece).  The query heads of the kv head's group ride the MMA N
dimension (padded to 16), the KV tokens its M, so a group of 1..16 heads fills a 128-row tile:

* S^T = K Q^T: K block (128 tokens x head_dim, K-major) as the A operand, Q (16 heads x head_dim) as B, the
  fp32 128 x 16 result in one of two TMEM buffers;
* O^T += V^T P^T: V block (head_dim x 128 tokens, MN-major: V rows are head_dim-contiguous) as A, P^T
  (16 heads x 128 tokens) as B from shared memory (only A may come from TMEM), O^T (head_dim x 16) in TMEM.

Roles (:class:`~cutedsl_attn.sm100.decode.config.Roles`):

* page-table warp: copies the page id of each token of block ``i`` (clamped to the item's last token) from the
  request's page indices into stage ``i % PAGE_TABLE_STAGES`` of a shared-memory ring (4-byte ``cp.async``,
  lane ``l`` tokens ``l, l + 32, ..``), up to :data:`~cutedsl_attn.sm100.decode.config.PAGE_TABLE_STAGES`
  blocks ahead of the load warpgroup (``PipelineCpAsync``: a stage is full once every lane's copies have
  landed, free once every load thread has read its ids), so no K / V gather waits on a global read of the page
  table;
* load warpgroup: two threads per token of each 128-token block read its page id from the ring and gather its K
  and V rows by ``cp.async`` (16 bytes at a time, zero-filled past the item's end; 64-bit page offsets) straight
  into the MMA's swizzled operand layouts; a stage is published (``PipelineAsyncUmma``) once its group has
  landed and is fenced for the async proxy; Q (heads past the group zero) rides the first group.  An fp8
  (e4m3) cache lands in a staging ring instead and each thread widens the pieces it loaded to f16
  (``cvt.rn.f16x2.e4m3x2``, exact) into the operand layouts before publishing; both MMAs then run in f16 (a
  bf16 q rounded to f16 once, as the portable kernel does; the caller folds ``k_scale`` into ``sm_scale`` and
  ``v_scale`` into ``output_scale``);
* MMA warp: S^T of block ``i + 1`` is issued before O^T's update with block ``i``, so the softmax warpgroup
  works on one block while the tensor core scores the next (``PipelineUmmaAsync`` to the softmax warpgroup);
  it owns the TMEM allocation;
* softmax warpgroup: thread ``r`` loads token ``r``'s 16 scores (``tcgen05.ld``), masks tokens past the item,
  takes each head's block max across the 128 tokens (``redux.sync`` and shared memory), exponentiates
  (``ex2``), writes its P^T column to shared memory, rescales O^T in TMEM once the previous O^T update is done
  (skipped when no head's max moved), and at the end normalises O^T (sinks, output scale) and stores O and the
  base-2 LSE, or the fp32 split-KV partial.

A split request's partials are merged by the last CTA of (request, kv head) to finish, in the same launch, by
the merge the portable decode kernel also runs (:func:`cutedsl_attn.common.splitkv.merge_splits`), so the work
table, partial buffers and counters are the portable kernel's.  Conventions: LSE base 2 over the visible keys
and the sink, empty items O = 0 and LSE = -inf (or the sink's), ``output_scale`` in fp32 before the rounding.
"""

from __future__ import annotations

import re

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import tcgen05

from ...common import ptx, splitkv
from ...common import softmax as sm
from ...common.constants import LOG2E, NEG_INF
from ...common.tcgen05 import fence_after_sync, fence_before_sync, state_at
from ...compile.arch import compile_options
from ...compile.fake import decode_tensors
from ...planning.decode import (
    W_BATCH, W_NUM_SPLITS, W_PAGE_OFF, W_PART_BASE, W_SPLIT_IDX, W_TOK_END, W_TOK_START, WORK_COLS,
)
from . import config as C
from .config import Config


def _cp_async_4(smem_addr, gmem_addr):
    """``cp.async.ca.shared.global`` of 4 bytes (Int32 shared-window byte address, Int64 global address)."""
    cute.arch.inline_ptx("cp.async.ca.shared.global [{$r0}], [{$r1}], 4;",
                         read_only_args=[Int32(smem_addr), Int64(gmem_addr)])


def _st_shared_v4(addr, w0, w1, w2, w3):
    """16-byte shared store (Int32 shared-window byte address, 16-byte aligned)."""
    cute.arch.inline_ptx("st.shared.v4.b32 [{$r0}], { {$r1}, {$r2}, {$r3}, {$r4} };",
                         read_only_args=[Int32(addr), Int32(w0), Int32(w1), Int32(w2), Int32(w3)])


def swizzle_bits(layout) -> tuple[int, int, int]:
    """``(B, M, S)`` of a composed shared-memory layout's swizzle (``S<B,M,S>``, acting on byte offsets)."""
    m = re.fullmatch(r"S<(\d+),(\d+),(\d+)>", str(layout.inner))
    if m is None:
        raise ValueError(f"expected a swizzle S<B,M,S> as the inner layout, got {layout.inner}")
    return int(m[1]), int(m[2]), int(m[3])


def operand_addr(base, layout, row, col, stage):
    """The shared-window byte address of element (``row``, ``col``) of stage ``stage`` of an MMA operand tile in
    ``layout`` (:func:`make_mmas`' layouts, ``((rows, 16), 1, cols / 16, stages)`` of 16-bit elements, ``row``
    on M / N and ``col`` on K): the outer layout's offset in bytes, then the swizzle on it (the buffer is
    1024-byte aligned, so swizzling the offset is swizzling the address).  All-static arguments give an int."""
    bb, mm, ss = swizzle_bits(layout)
    off = cute.crd2idx(((row, col % 16), 0, col // 16, stage), layout.outer)
    off = off * 2 if isinstance(off, int) else Int32(off) * 2
    return base + (off ^ ((off & (((1 << bb) - 1) << (mm + ss))) >> ss))


def make_mmas(cfg: Config):
    """``(qk_mma, pv_mma, layouts)`` of ``cfg`` (call while tracing): the tiled MMAs of S^T = K Q^T (M = 128
    tokens, N = 16 heads, both operands K-major) and O^T = V^T P^T (M = head_dim, N = 16 heads, both operands
    MN-major: V rows and P^T columns are contiguous along M and N), and the shared-memory layouts ``sK``
    (``kv_stages`` stages), ``sQ`` (one), ``sV`` (``kv_stages``) and ``sP`` (two)."""
    D, TK, HN, S = cfg.problem.head_dim, C.TILE_KV, C.HEAD_TILE, cfg.tiles.kv_stages
    dt = cfg.mma_dtype
    K_MAJOR = cute.nvgpu.OperandMajorMode.K
    MN_MAJOR = cute.nvgpu.OperandMajorMode.MN
    one_cta = tcgen05.CtaGroup.ONE
    qk_mma = sm100_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, K_MAJOR, Float32, one_cta, (TK, HN))
    pv_mma = sm100_utils.make_trivial_tiled_mma(dt, dt, MN_MAJOR, MN_MAJOR, Float32, one_cta, (D, HN))
    layouts = dict(
        sK=sm100_utils.make_smem_layout_a(qk_mma, (TK, HN, D), dt, S),
        sQ=sm100_utils.make_smem_layout_b(qk_mma, (TK, HN, D), dt, 1),
        sV=sm100_utils.make_smem_layout_a(pv_mma, (D, HN, TK), dt, S),
        sP=sm100_utils.make_smem_layout_b(pv_mma, (D, HN, TK), dt, 2),
    )
    return qk_mma, pv_mma, layouts


def _shared_storage(mbarriers, HN, dt, sK_layout, sQ_layout, sV_layout, sP_layout, SB, kv_fp8):
    """The kernel's shared storage (built outside the traced function: its fields depend on the cache dtype);
    ``mbarriers`` is :func:`config.mbarrier_plan`'s table (two mbarriers a stage)."""

    MR, AL = cute.struct.MemRange, cute.struct.Align
    S = mbarriers["kv"][0]
    fields = {f"mbar_{name}": MR[cutlass.Int64, 2 * stages] for name, (stages, _, _) in mbarriers.items()}
    fields.update({
        "tmem_base": Int32,
        "s_red": MR[Float32, 2 * 4 * HN],  # per-warp block maxima, two blocks in flight
        "s_sum": MR[Float32, 4 * HN],  # per-warp row sums
        "s_row": MR[Float32, 2 * HN],  # the split merge's per-row max and weight
        "s_flag": MR[Float32, 4],  # the split merge's verdict
        "sPT": AL[MR[Int32, mbarriers["pt"][0] * C.TILE_KV], 16],  # page id of each token, a ring of blocks
        "sQ": AL[MR[dt, cute.cosize(sQ_layout)], 1024],
        "sP": AL[MR[dt, cute.cosize(sP_layout)], 1024],
        "sK": AL[MR[dt, cute.cosize(sK_layout)], 1024],
        "sV": AL[MR[dt, cute.cosize(sV_layout)], 1024],
    })
    if kv_fp8:  # the fp8 rows as loaded, widened into sK / sV by the threads that loaded them
        fields["sKs"] = AL[MR[cutlass.Uint8, S * SB], 1024]
        fields["sVs"] = AL[MR[cutlass.Uint8, S * SB], 1024]
    SharedStorage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
    return SharedStorage


class Sm100DecodeKernel:
    """The CuTe DSL SM100 decode kernel of one :class:`Config` (build with :func:`build`).  The split-KV merge
    (:func:`cutedsl_attn.common.splitkv.merge_splits`) runs on every thread of the CTA after the roles join."""

    def __init__(self, cfg: Config):
        p = cfg.problem
        self.cfg, self.problem = cfg, p
        self.dtype = cfg.cutlass_dtype
        self.mma_dtype = cfg.mma_dtype
        self.kv_fp8 = p.kv_fp8
        self.q_to_f16 = p.kv_fp8 and p.dtype == "bfloat16"
        self.RB = cfg.staging_row_bytes
        self.SB = -(-(C.TILE_KV * self.RB) // 1024) * 1024  # bytes of one staging stage of K (or V)
        self.D, self.G, self.PS = p.head_dim, p.group_size, p.page_size
        self.S = cfg.tiles.kv_stages
        self.TK, self.HN = C.TILE_KV, C.HEAD_TILE
        self.roles = cfg.roles
        self.NT = cfg.num_threads  # the merge's thread count: the whole CTA
        self.tmem = cfg.tmem
        self.tmem_cols = cfg.tmem_cols
        self.smem_size = None  # the traced SharedStorage's bytes (checked against the config's budget)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mIdx: cute.Tensor, mWork: cute.Tensor,
                 mO: cute.Tensor, mLSE: cute.Tensor, mPO: cute.Tensor, mPLSE: cute.Tensor, mCnt: cute.Tensor,
                 mSinks: cute.Tensor, mAlibi: cute.Tensor, sm_scale: Float32, soft_cap: Float32,
                 rope_rcp_scale: Float32, rope_log2_theta: Float32, output_scale: Float32, stream):
        HN, SB, kv_fp8 = self.HN, self.SB, self.kv_fp8
        dt = self.mma_dtype
        qk_mma, pv_mma, L = make_mmas(self.cfg)
        sK_layout, sQ_layout, sV_layout, sP_layout = L["sK"], L["sQ"], L["sV"], L["sP"]

        SharedStorage = _shared_storage(self.cfg.mbarriers, HN, dt, sK_layout, sQ_layout, sV_layout, sP_layout, SB,
                                        kv_fp8)
        self.shared_storage = SharedStorage
        self.smem_size = SharedStorage.size_in_bytes()
        self.kernel(mQ, mK, mV, mIdx, mWork, mO, mLSE, mPO, mPLSE, mCnt, mSinks, sm_scale, output_scale, qk_mma,
                    pv_mma, sK_layout, sQ_layout, sV_layout, sP_layout).launch(
            # kv heads fastest: the CTAs reading one request's heads run side by side (the portable kernel's grid)
            grid=(mK.shape[2], mWork.shape[0], 1), block=(self.roles.num_threads, 1, 1),
            smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, mQ, mK, mV, mIdx, mWork, mO, mLSE, mPO, mPLSE, mCnt, mSinks, sm_scale: Float32,
               output_scale: Float32, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, sK_layout: cute.ComposedLayout,
               sQ_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout):
        """Device entry: one CTA per (kv head ``blockIdx.x``, work item ``blockIdx.y``)."""
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        kvh, wi, _ = cute.arch.block_idx()
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        R = self.roles

        MB = self.cfg.mbarriers

        def make(kind, name, barriers):
            stages, full, empty = MB[name]
            return kind.create(num_stages=stages, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, full),
                               consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, empty),
                               barrier_storage=barriers.data_ptr(), defer_sync=True)

        # K / V stages: the load warpgroup -> MMA (released by the O^T update's commit)
        pipe_kv = make(pipeline.PipelineAsyncUmma, "kv", storage.mbar_kv)
        # S^T buffers: MMA -> softmax (released once the scores are in registers)
        pipe_s = make(pipeline.PipelineUmmaAsync, "s", storage.mbar_s)
        # P^T buffers in shared memory: softmax -> MMA (a commit also says O^T is rescaled for this block)
        pipe_p = make(pipeline.PipelineAsyncUmma, "p", storage.mbar_p)
        # O^T: MMA -> softmax (an update done; released once O^T is rescaled for the next one)
        pipe_o = make(pipeline.PipelineUmmaAsync, "o", storage.mbar_o)
        # page ids: the page-table warp's cp.async -> the load warpgroup (released once read into registers)
        # arrivals: full 32 (one cp.async.mbarrier.arrive.noinc a page-table lane), empty 128 (one a load thread)
        pipe_pt = make(pipeline.PipelineCpAsync, "pt", storage.mbar_pt)
        tmem = cutlass.memory.TmemAllocator(
            storage.tmem_base.ptr, barrier_for_retrieve=pipeline.NamedBarrier(C.BAR_TMEM_ALLOC, 32 + 128),
            allocator_warp_id=R.mma_warp)
        free_bar = pipeline.NamedBarrier(C.BAR_TMEM_FREE, 32 + 128)
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()

        b = mWork[wi, W_BATCH]
        t0 = mWork[wi, W_TOK_START]
        t1 = mWork[wi, W_TOK_END]
        n_blk = cutlass.select_(b >= 0, (t1 - t0 + self.TK - 1) // self.TK, Int32(0))
        n_splits = mWork[wi, W_NUM_SPLITS]
        head0 = kvh * self.G
        sK_addr = storage.sK.data_ptr().toint()
        if warp < R.load_warps[0]:
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            if b >= 0:
                self._softmax(tmem_ptr, qk_mma, storage, sP_layout, pipe_s, pipe_p, pipe_o, mWork, mO, mLSE, mPO,
                              mPLSE, mSinks, sm_scale, output_scale, wi, b, t0, t1, n_blk, head0, tidx)
            free_bar.arrive_and_wait()
        elif warp < R.mma_warp:
            if n_blk > 0:
                self._load(mQ, mK, mV, storage, sK_layout, sQ_layout, sV_layout, pipe_kv, pipe_pt, kvh, b, t0, t1,
                           n_blk, head0, tidx - 32 * R.load_warps[0])
        elif warp == R.mma_warp:
            tmem.allocate(self.tmem_cols)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            tmem.relinquish_alloc_permit()
            if n_blk > 0:
                self._mma(tmem_ptr, qk_mma, pv_mma, storage, sK_layout, sQ_layout, sV_layout, sP_layout, pipe_kv,
                          pipe_s, pipe_p, pipe_o, n_blk)
            free_bar.arrive_and_wait()
            tmem.free(tmem_ptr)
        else:
            if n_blk > 0:
                self._page_table(mIdx, storage, pipe_pt, mWork[wi, W_PAGE_OFF], t0, t1, n_blk,
                                 tidx - 32 * R.page_table_warp)
        if b >= 0:
            if n_splits > 1:
                # the last CTA of (request, kv head) merges the partials; the K / V ring holds its LSE table
                splitkv.merge_splits(mO, mLSE, mPO, mPLSE, mCnt, mSinks, storage.s_row.data_ptr().toint(),
                                     storage.s_flag.data_ptr().toint(), sK_addr, b, kvh, mK.shape[2],
                                     mWork[wi, W_PART_BASE], n_splits, head0, output_scale, tidx, head_dim=self.D,
                                     group_size=self.G, num_threads=self.NT, use_sinks=self.problem.use_sinks)

    # ------------------------------------------------------------------ TMEM views
    def _tmem_128x16(self, tmem_ptr, qk_mma, name):
        """Region ``name`` of the TMEM plan as a (128 lanes, 16 columns) fp32 accumulator (the S^T shape; O^T is
        read and rescaled through the same view, lane ``l`` holding row :func:`config.o_lane`)."""
        thr = qk_mma.get_slice(0)
        frag = thr.make_fragment_C(thr.partition_shape_C((self.TK, self.HN)))
        return cute.make_tensor(tmem_ptr + self.tmem[name][0], frag.layout)

    # ------------------------------------------------------------------ page-table warp
    @cute.jit
    def _page_table(self, mIdx, storage, pipe_pt, page_off, t0, t1, n_blk, lane):
        """Lane ``lane`` of the page-table warp: for every block ``i``, once the load warpgroup has freed ring stage
        ``i % PAGE_TABLE_STAGES``, the page ids of tokens ``lane, lane + 32, ..`` of the block (clamped to the
        item's last token ``t1 - 1``: the load threads zero-fill those rows) from ``mIdx[page_off + tok //
        page_size]`` into the stage by 4-byte ``cp.async``; the stage's full barrier completes once every lane's
        copies have landed (``cp.async.mbarrier.arrive.noinc``).  The lane then waits for its last copies."""
        TK, PS, PT = self.TK, self.PS, C.PAGE_TABLE_STAGES
        sPT_addr = storage.sPT.data_ptr().toint()
        idx_base = mIdx.iterator.toint()
        for i in cutlass.range(n_blk, unroll=1):
            state = state_at(PT, i, True)
            pipe_pt.producer_acquire(state)
            for j in cutlass.range_constexpr(TK // 32):
                row = lane + 32 * j
                tok_c = cutlass.min(t0 + i * TK + row, t1 - 1)
                _cp_async_4(sPT_addr + (state.index * TK + row) * 4, idx_base + Int64(page_off + tok_c // PS) * 4)
            pipe_pt.producer_commit(state)
        cute.arch.inline_ptx("cp.async.wait_all;")  # no copy of this warp outlives its role

    # ------------------------------------------------------------------ load warpgroup
    @cute.jit
    def _load(self, mQ, mK, mV, storage, sK_layout, sQ_layout, sV_layout, pipe_kv, pipe_pt, kvh, b, t0, t1, n_blk,
              head0, r):
        """Thread ``r`` of the load warpgroup: Q's 16-byte pieces ``r, r + 128, ..`` (heads past the group
        zero-filled), then tokens ``r // 2`` and ``r // 2 + 64`` of every block ``i``: their page ids from the
        page-table warp's ring (stage ``i % PAGE_TABLE_STAGES``, freed as soon as read), then the even (``r``
        even) or odd 16-byte pieces of their K and V rows by ``cp.async`` (zero-filled past ``t1``, the address
        clamped to the item's last token; the page offset in 64 bits); block ``i`` is published once block
        ``i + 1`` is in flight (``cp.async.wait_group 1``) and fenced for the MMA's async proxy; with two stages
        it is published before block ``i + 1``'s stage is acquired (that stage is freed only after block ``i``
        is consumed)."""
        D, G, TK, HN, S, PS, PT = self.D, self.G, self.TK, self.HN, self.S, self.PS, C.PAGE_TABLE_STAGES
        sPT_addr = storage.sPT.data_ptr().toint()
        sQ_addr = storage.sQ.data_ptr().toint()
        sK_addr = storage.sK.data_ptr().toint()
        sV_addr = storage.sV.data_ptr().toint()
        q_base = mQ.iterator.toint()
        k_base = mK.iterator.toint()
        v_base = mV.iterator.toint()
        cpr = D // 8  # 16-byte pieces per row
        for it in cutlass.range_constexpr(HN * cpr // 128):
            idx = it * 128 + r
            h = idx // cpr
            c = idx % cpr
            head = head0 + cutlass.min(h, G - 1)
            src = q_base + (Int64(b) * mQ.stride[0] + Int64(head) * mQ.stride[1] + c * 8) * 2
            ptx.cp_async_16(operand_addr(sQ_addr, sQ_layout, h, c * 8, 0), src, cutlass.select_(h < G, 16, 0))
        if const_expr(self.kv_fp8):
            sKs_addr = storage.sKs.data_ptr().toint()
            sVs_addr = storage.sVs.data_ptr().toint()
        half = r % 2  # two threads per row, each every other 16-byte piece: a warp reads whole 32-byte sectors
        for i in cutlass.range(n_blk, unroll=1):
            pt_state = state_at(PT, i, False)
            pipe_pt.consumer_wait(pt_state)
            pages = [ptx.ld_shared_b32(sPT_addr + (pt_state.index * TK + r // 2 + 64 * j) * 4) for j in range(2)]
            pipe_pt.consumer_release(pt_state)
            state = state_at(S, i, True)
            if const_expr(S == 2):
                # two stages: block i reuses block i-2's stage, which the MMA warp frees only after block i-1 is
                # published, so block i-1 goes out before this acquire (publishing after it would deadlock)
                if i > 0:
                    ptx.cp_async_wait(0)
                    if const_expr(self.kv_fp8):
                        self._widen(storage, sK_layout, sQ_layout, sV_layout, i - 1, r)
                    ptx.fence_proxy_async_shared()
                    pipe_kv.producer_commit(state_at(S, i - 1, True))
            pipe_kv.producer_acquire(state)
            for j in cutlass.range_constexpr(2):
                row = r // 2 + 64 * j
                tok = t0 + i * TK + row
                nbytes = cutlass.select_(tok < t1, 16, 0)
                slot = cutlass.min(tok, t1 - 1) % PS
                page = pages[j]
                koff = Int64(page) * mK.stride[0] + Int64(slot) * mK.stride[1] + Int64(kvh) * mK.stride[2]
                voff = Int64(page) * mV.stride[0] + Int64(slot) * mV.stride[1] + Int64(kvh) * mV.stride[2]
                if const_expr(self.kv_fp8):
                    for cc in cutlass.range_constexpr(D // 32):
                        pc = 2 * cc + half  # this thread's 16-byte pieces (16 elements) of the row
                        dst = state.index * self.SB + row * self.RB + pc * 16
                        ptx.cp_async_16(sKs_addr + dst, k_base + koff + pc * 16, nbytes)
                        ptx.cp_async_16(sVs_addr + dst, v_base + voff + pc * 16, nbytes)
                else:
                    for cc in cutlass.range_constexpr(cpr // 2):
                        col = (2 * cc + half) * 8
                        ptx.cp_async_16(operand_addr(sK_addr, sK_layout, row, col, state.index),
                                        k_base + (koff + col) * 2, nbytes)
                        ptx.cp_async_16(operand_addr(sV_addr, sV_layout, col, row, state.index),
                                        v_base + (voff + col) * 2, nbytes)
            ptx.cp_async_commit()
            if const_expr(S > 2) and i > 0:
                ptx.cp_async_wait(1)
                if const_expr(self.kv_fp8):
                    self._widen(storage, sK_layout, sQ_layout, sV_layout, i - 1, r)
                ptx.fence_proxy_async_shared()
                pipe_kv.producer_commit(state_at(S, i - 1, True))
        ptx.cp_async_wait(0)
        if const_expr(self.kv_fp8):
            self._widen(storage, sK_layout, sQ_layout, sV_layout, n_blk - 1, r)
        ptx.fence_proxy_async_shared()
        pipe_kv.producer_commit(state_at(S, n_blk - 1, True))

    @cute.jit
    def _widen(self, storage, sK_layout, sQ_layout, sV_layout, j, r):
        """fp8 cache: thread ``r``'s own pieces of block ``j`` (landed: its cp.async group is complete), e4m3 ->
        f16 from the staging ring into the operand layouts, 16 elements (two 16-byte stores) a piece; with block
        0 also its Q pieces, bf16 -> f16 in place for a bf16 query."""
        D, HN, S = self.D, self.HN, self.S
        sK_addr = storage.sK.data_ptr().toint()
        sV_addr = storage.sV.data_ptr().toint()
        stage = j % S
        base = stage * self.SB
        for jj in cutlass.range_constexpr(2):
            row = r // 2 + 64 * jj
            for cc in cutlass.range_constexpr(D // 32):
                pc = 2 * cc + r % 2
                src = base + row * self.RB + pc * 16
                for name in cutlass.range_constexpr(2):
                    w = ptx.ld_shared_v4_b32((storage.sKs if name == 0 else storage.sVs).data_ptr().toint() + src)
                    h = [ptx.e4m3x4_to_f16x2(w[q]) for q in range(4)]  # elements 4 q .. 4 q + 3
                    for e8 in cutlass.range_constexpr(2):
                        if const_expr(name == 0):
                            dst = operand_addr(sK_addr, sK_layout, row, pc * 16 + 8 * e8, stage)
                        else:
                            dst = operand_addr(sV_addr, sV_layout, pc * 16 + 8 * e8, row, stage)
                        _st_shared_v4(dst, h[2 * e8][0], h[2 * e8][1], h[2 * e8 + 1][0], h[2 * e8 + 1][1])
        if const_expr(self.q_to_f16):
            if j == 0:
                sQ_addr = storage.sQ.data_ptr().toint()
                cpr = D // 8
                for it in cutlass.range_constexpr(HN * cpr // 128):
                    idx = it * 128 + r
                    addr = operand_addr(sQ_addr, sQ_layout, idx // cpr, (idx % cpr) * 8, 0)
                    w = ptx.ld_shared_v4_b32(addr)
                    _st_shared_v4(addr, ptx.bf16x2_to_f16x2(w[0]), ptx.bf16x2_to_f16x2(w[1]),
                                  ptx.bf16x2_to_f16x2(w[2]), ptx.bf16x2_to_f16x2(w[3]))

    # ------------------------------------------------------------------ MMA warp
    @cute.jit
    def _mma(self, tmem_ptr, qk_mma, pv_mma, storage, sK_layout, sQ_layout, sV_layout, sP_layout, pipe_kv, pipe_s,
             pipe_p, pipe_o, n_blk):
        """Per step ``i``: S^T_i = K_i Q^T into S buffer ``i % 2`` (once the softmax has read block ``i - 2``'s),
        then O^T += V_{i-1}^T P_{i-1}^T (once P_{i-1} is written and O^T rescaled); the update's commit frees the
        K / V stage and the P buffer."""
        S = self.S
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        qk_thr = qk_mma.get_slice(0)
        pv_thr = pv_mma.get_slice(0)
        tSrK = qk_thr.make_fragment_A(sK)
        tSrQ = qk_thr.make_fragment_B(sQ)
        tOrV = pv_thr.make_fragment_A(sV)
        tOrP = pv_thr.make_fragment_B(sP)
        tStS0 = self._tmem_128x16(tmem_ptr, qk_mma, "S0")
        s_cols = self.tmem["S1"][0] - self.tmem["S0"][0]
        o_frag = pv_thr.make_fragment_C(pv_thr.partition_shape_C((self.D, self.HN)))
        tOtO = cute.make_tensor(tmem_ptr + self.tmem["O"][0], o_frag.layout)
        for i in cutlass.range(n_blk + 1, unroll=1):
            if i < n_blk:
                kv_state = state_at(S, i, False)
                s_state = state_at(2, i, True)
                pipe_kv.consumer_wait(kv_state)
                ptx.fence_proxy_async_shared()  # fenced on both sides of the barrier (the writers fenced too)
                pipe_s.producer_acquire(s_state)
                fence_after_sync()
                tStS = cute.make_tensor(tStS0.iterator + s_state.index * s_cols, tStS0.layout)
                for k in cutlass.range_constexpr(cute.size(tSrK, mode=[2])):
                    qk_mma.set(tcgen05.Field.ACCUMULATE, k != 0)
                    cute.gemm(qk_mma, tStS, tSrK[None, None, k, kv_state.index], tSrQ[None, None, k, 0], tStS)
                pipe_s.producer_commit(s_state)
            if i > 0:
                kv_state = state_at(S, i - 1, False)
                p_state = state_at(2, i - 1, False)
                o_state = state_at(1, i - 1, True)
                pipe_p.consumer_wait(p_state)
                ptx.fence_proxy_async_shared()
                pipe_o.producer_acquire(o_state)
                fence_after_sync()
                for k in cutlass.range_constexpr(cute.size(tOrV, mode=[2])):
                    pv_mma.set(tcgen05.Field.ACCUMULATE, (i > 1) | (k != 0))
                    cute.gemm(pv_mma, tOtO, tOrV[None, None, k, kv_state.index], tOrP[None, None, k, p_state.index],
                              tOtO)
                pipe_o.producer_commit(o_state)
                pipe_p.consumer_release(p_state)
                pipe_kv.consumer_release(kv_state)

    # ------------------------------------------------------------------ softmax warpgroup
    @cute.jit
    def _softmax(self, tmem_ptr, qk_mma, storage, sP_layout, pipe_s, pipe_p, pipe_o, mWork, mO, mLSE, mPO, mPLSE,
                 mSinks, sm_scale, output_scale, wi, b, t0, t1, n_blk, head0, r):
        """Thread ``r`` owns token ``r`` of every block (TMEM lane ``r`` of S^T) and lane ``r`` of O^T; every thread
        keeps the 16 heads' running max (log2 units, identical across threads) and its own tokens' share of the
        running sums (reduced once, at the end)."""
        TK, HN = self.TK, self.HN
        lane = r % 32
        w = r // 32
        tS0 = self._tmem_128x16(tmem_ptr, qk_mma, "S0")
        tO = self._tmem_128x16(tmem_ptr, qk_mma, "O")
        ld = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(HN)),
                                                        Float32), tS0)
        st = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(HN)),
                                                        Float32), tO)
        thr_ld = ld.get_slice(r)
        thr_st = st.get_slice(r)
        tLtS0 = thr_ld.partition_S(tS0)
        tLtO = thr_ld.partition_S(tO)
        tStO = thr_st.partition_D(tO)
        qk_thr = qk_mma.get_slice(0)
        frag_shape = thr_ld.partition_D(qk_thr.partition_C(cute.make_identity_tensor((TK, HN)))).shape
        s_cols = self.tmem["S1"][0] - self.tmem["S0"][0]
        sP_addr = storage.sP.data_ptr().toint()
        red = storage.s_red.data_ptr().toint()
        bar = pipeline.NamedBarrier(C.BAR_SOFTMAX, 128)

        scale_log2 = sm_scale * Float32(LOG2E)
        row_max = cute.make_rmem_tensor((HN,), Float32)
        row_sum = cute.make_rmem_tensor((HN,), Float32)
        alpha = cute.make_rmem_tensor((HN,), Float32)
        row_max.fill(NEG_INF)
        row_sum.fill(0.0)
        for i in cutlass.range(n_blk, unroll=1):
            s_state = state_at(2, i, False)
            rS = cute.make_rmem_tensor(frag_shape, Float32)
            pipe_s.consumer_wait(s_state)
            fence_after_sync()
            cute.copy(ld, cute.make_tensor(tLtS0.iterator + s_state.index * s_cols, tLtS0.layout), rS)
            cute.arch.fence_view_async_tmem_load()
            fence_before_sync()
            pipe_s.consumer_release(s_state)
            live = t0 + i * TK + r < t1
            buf = red + (i % 2) * (4 * HN * 4)
            for h in cutlass.range_constexpr(HN):
                rS[h] = Float32(cutlass.select_(live, rS[h] * scale_log2, Float32(NEG_INF)))
                mx = cute.arch.warp_redux_sync(rS[h], "fmax")
                if lane == 0:
                    ptx.st_shared_f32(buf + (w * HN + h) * 4, mx)
            bar.arrive_and_wait()
            grow = Float32(0.0)
            for h in cutlass.range_constexpr(HN):
                wm = [ptx.ld_shared_f32(buf + (k * HN + h) * 4) for k in range(4)]  # the four warps' maxima
                m_blk = cute.arch.fmax(cute.arch.fmax(wm[0], wm[1]), cute.arch.fmax(wm[2], wm[3]))
                m_new = cute.arch.fmax(row_max[h], m_blk)
                m_use = Float32(cutlass.select_(m_new == Float32(NEG_INF), Float32(0.0), m_new))
                alpha[h] = ptx.ex2(row_max[h] - m_use)
                grow = cute.arch.fmax(grow, m_new - row_max[h])
                row_max[h] = m_new
                rS[h] = ptx.ex2(rS[h] - m_use)
                row_sum[h] = row_sum[h] * alpha[h] + rS[h]
            p_state = state_at(2, i, True)
            pipe_p.producer_acquire(p_state)  # the O^T update that read this P buffer last is done
            words = [ptx.pack2(rS[2 * j], rS[2 * j + 1], self.mma_dtype) for j in range(HN // 2)]
            for half in cutlass.range_constexpr(2):
                _st_shared_v4(operand_addr(sP_addr, sP_layout, 8 * half, r, p_state.index),
                              words[4 * half], words[4 * half + 1], words[4 * half + 2], words[4 * half + 3])
            ptx.fence_proxy_async_shared()
            if i > 0:
                o_state = state_at(1, i - 1, False)
                pipe_o.consumer_wait(o_state)
                fence_after_sync()
                if grow > Float32(0.0):  # some head's max moved (the same verdict in every thread)
                    rO = cute.make_rmem_tensor(frag_shape, Float32)
                    cute.copy(ld, tLtO, rO)
                    cute.arch.fence_view_async_tmem_load()
                    for h in cutlass.range_constexpr(HN):
                        rO[h] = rO[h] * alpha[h]
                    cute.copy(st, rO, tStO)
                    cute.arch.fence_view_async_tmem_store()
                fence_before_sync()
                pipe_o.consumer_release(o_state)
            pipe_p.producer_commit(p_state)
        self._epilogue(ld, tLtO, frag_shape, pipe_o, storage, row_max, row_sum, mWork, mO, mLSE, mPO, mPLSE, mSinks,
                       output_scale, wi, b, n_blk, head0, r, lane, w, bar)

    @cute.jit
    def _epilogue(self, ld, tLtO, frag_shape, pipe_o, storage, row_max, row_sum, mWork, mO, mLSE, mPO, mPLSE, mSinks,
                  output_scale, wi, b, n_blk, head0, r, lane, w, bar):
        """The heads' sums over the 128 threads, then thread ``r`` writes row ``d`` (:func:`config.o_lane`) of each
        head's O (normalised, sinks folded in, output scale in fp32; one work item) or its fp32 partial and
        partial LSE (split-KV: sinks and output scale join in the merge); thread 0 writes the LSEs."""
        D, G, HN = self.D, self.G, self.HN
        tot = storage.s_sum.data_ptr().toint()
        for h in cutlass.range_constexpr(HN):
            s = row_sum[h]
            for k in cutlass.range_constexpr(5):
                s = s + cute.arch.shuffle_sync_bfly(s, offset=1 << k)
            if lane == 0:
                ptx.st_shared_f32(tot + (w * HN + h) * 4, s)
        bar.arrive_and_wait()
        rO = cute.make_rmem_tensor(frag_shape, Float32)
        if n_blk > 0:
            pipe_o.consumer_wait(state_at(1, n_blk - 1, False))  # the last O^T update is done
            fence_after_sync()
            cute.copy(ld, tLtO, rO)
            cute.arch.fence_view_async_tmem_load()
        else:
            rO.fill(0.0)
        d = r
        has_row = r < D
        if const_expr(D == 64):
            d = 16 * w + lane
            has_row = lane < 16
        n_splits = mWork[wi, W_NUM_SPLITS]
        final = n_splits == 1
        part = mWork[wi, W_PART_BASE] + mWork[wi, W_SPLIT_IDX]
        for h in cutlass.range_constexpr(G):
            ws = [ptx.ld_shared_f32(tot + (k * HN + h) * 4) for k in range(4)]  # the four warps' sums
            l_tot = (ws[0] + ws[1]) + (ws[2] + ws[3])
            sink_l2 = Float32(NEG_INF)
            if const_expr(self.problem.use_sinks):
                if final:
                    sink_l2 = mSinks[head0 + h] * Float32(LOG2E)
            factor, lse = sm.finalize_row(row_max[h], l_tot, sink_l2)
            o = Float32(cutlass.select_(factor != Float32(0.0), rO[h] * factor, Float32(0.0)))
            if final:
                if has_row:
                    mO[b, head0 + h, d] = (o * output_scale).to(self.dtype)
                if r == 0:
                    mLSE[b, head0 + h] = lse
            else:
                if has_row:
                    mPO[part, head0 + h, d] = o
                if r == 0:
                    mPLSE[part, head0 + h] = lse


def build(cfg: Config, *, keep_ptx_dir: str | None = None, keep_cubin: bool = False):
    """Compile the kernel of ``cfg`` from the decode fake tensors (:func:`cutedsl_attn.compile.fake.decode_tensors`,
    the portable decode kernel's arguments; see the package's ``compile``).  Raises RuntimeError when the traced
    shared storage exceeds the config's budget."""
    from cutlass.cute.runtime import make_fake_stream

    opts = compile_options(cfg.arch, keep_ptx_dir=keep_ptx_dir, keep_cubin=keep_cubin)
    kern = Sm100DecodeKernel(cfg)
    fn = cute.compile(
        kern, *decode_tensors(cfg, WORK_COLS), Float32(1.0), Float32(0.0), Float32(1.0), Float32(1.0), Float32(1.0),
        make_fake_stream(use_tvm_ffi_env_stream=True), options=opts,
    )
    if kern.smem_size is None or kern.smem_size > cfg.smem_bytes:
        raise RuntimeError(f"SM100 decode: the kernel's shared storage ({kern.smem_size} B) exceeds the config's "
                           f"budget ({cfg.smem_bytes} B)")
    return fn
