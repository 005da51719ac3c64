"""SM90 (Hopper) prefill / append attention: TMA + wgmma, warp-specialised.  The kernel entry and ``compile``.

A tile is ``tile_m = 64 * num_wg`` packed query rows of one request and one kv head (the work table of
:mod:`cutedsl_attn.planning.prefill`, shared with the portable kernel); packed row ``r`` is token ``r // group``
of query head ``kv_head * group + r % group``.  The CTA is a producer warpgroup (:class:`Producer`: Q hand-over,
K/V loads) and ``num_wg`` consumer warpgroups of 64 rows each (:class:`Mainloop` with :class:`BlockSoftmax`,
then :class:`TileEpilogue`); :class:`~cutedsl_attn.common.scheduler.TileScheduler` says which tile a CTA runs.
The producer gives its registers to the consumers (``setmaxnreg``, :attr:`Config.registers`).

Conventions (FlashInfer's, as the portable kernel): bottom-right causal, ``window_left = w`` keeps ``w + 1``
keys, soft cap ``cap * tanh(s / cap)`` on scaled logits, sinks in natural-log units, LSE base 2, empty rows give
O = 0 and LSE = -inf.  The softmax scale must be > 0 unless a soft cap or ``score_mod`` is used
(:attr:`Config.positive_scale_only`).  Results depend only on the K/V rows a request owns.
"""

from __future__ import annotations

import dataclasses
import types

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ...common import masks, ptx
from ...common.scheduler import TileScheduler
from ...compile.arch import compile_options
from ...compile.fake import prefill_tensors
from ...planning.prefill import W_BATCH, W_KV_LEN, W_KV_START, W_QO_LEN, W_ROW0, WORK_COLS
from .barriers import Barrier, barrier_id
from .block_softmax import BlockSoftmax
from .config import Config, Epilogue, LoopOrder, Softmax, TileInfo
from .epilogue import TileEpilogue
from .mainloop import Mainloop
from .producer import INFO_COLS, Producer


class Sm90PrefillKernel(Producer, Mainloop, BlockSoftmax, TileEpilogue):
    """The CuTe DSL SM90 prefill kernel of one :class:`Config` (its roles are the mixins; build with ``compile``)."""

    def __init__(self, cfg: Config):
        p, t = cfg.problem, cfg.tiles
        self.cfg = cfg
        self.dtype = cfg.cutlass_dtype
        self.DQ, self.DV, self.G = p.head_dim_qk, p.head_dim_vo, p.group_size
        self.TM, self.TN, self.S, self.QS = cfg.tile_m, t.tile_n, t.num_stages, t.q_stages
        self.NWG = t.num_wg
        self.NCT = 128 * t.num_wg  # consumer threads
        self.num_threads, self.registers = cfg.num_threads, cfg.registers
        self.paged = p.page_size > 0
        self.page_size, self.page_rows = p.page_size, cfg.page_rows
        self.mask_causal = p.causal and not p.use_custom_mask  # a custom mask replaces causal (FlashInfer)
        self.use_window, self.use_soft_cap, self.use_sinks = p.use_window, p.use_soft_cap, p.use_sinks
        self.use_custom_mask, self.score_mod = p.use_custom_mask, p.score_mod
        self.pingpong = t.pingpong
        self.num_ctas, self.head_section_mib = cfg.num_ctas, cfg.head_section_mib
        self.loop_split = t.loop_order is not LoopOrder.FA3
        self.v_wait_late = t.loop_order is LoopOrder.SPLIT_LATE_V
        self.stale_max = t.softmax is Softmax.STALE
        self.p_tail, self.p_wait_lead, self.pins_pv_wait = t.p_tail, t.p_wait_lead, cfg.pins_pv_wait
        self.rescale_threshold, self.rescale_o_before_pv = t.rescale_threshold, t.rescale_o_before_pv
        self.smem_epilogue = t.epilogue is not Epilogue.REGS
        self.tma_epilogue = t.epilogue is Epilogue.SMEM_TMA
        self.tile_info_smem = t.tile_info in (TileInfo.SMEM, TileInfo.SMEM_EARLY)
        self.epi_coords_early = t.tile_info in (TileInfo.GLOBAL_EARLY, TileInfo.SMEM_EARLY)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mIdx: cute.Tensor, mWork: cute.Tensor,
                 mO: cute.Tensor, mLSE: cute.Tensor, mMask: cute.Tensor, mSinks: cute.Tensor,
                 sm_scale: Float32, soft_cap: Float32, window_left: Int32, output_scale: Float32, stream):
        DQ, DV, TM, TN, S = self.DQ, self.DV, self.TM, self.TN, self.S
        dt = self.dtype
        K_MAJOR = cute.nvgpu.OperandMajorMode.K
        MN_MAJOR = cute.nvgpu.OperandMajorMode.MN
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            dt, dt, K_MAJOR, K_MAJOR, Float32, atom_layout_mnk=(TM // 64, 1, 1), tiler_mn=(64, TN))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            dt, dt, K_MAJOR, MN_MAJOR, Float32, atom_layout_mnk=(TM // 64, 1, 1), tiler_mn=(64, DV),
            a_source=warpgroup.OperandSource.RMEM)
        QS = self.QS
        sQ_layout_st = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TM, TN, DQ), dt, QS)
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TM, TN, DQ), dt, S)
        # V tile (tile_n, DV), DV contiguous, as TMA writes it; the P V GEMM reads its transpose
        # (DV, tile_n) as an MN-major B operand
        sV_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TM, TN, DV), dt, S)
        sQ_layout = cute.select(sQ_layout_st, mode=[0, 1])  # one stage: the TMA box
        if const_expr(QS > 1):
            sQ_layout_k = sQ_layout_st
        else:
            sQ_layout_k = sQ_layout

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        hkv = mK.shape[2 if self.paged else 1]
        # Q as ((group, tokens), dim, kv_heads): packed row r of a tile is token r // G of query head
        # kv_head * G + r % G, so one TMA box of (tile_m, dim) loads the tile's packed rows
        G = self.G
        mQ_t = cute.make_tensor(mQ.iterator, cute.make_layout(
            ((G, mQ.shape[0]), DQ, hkv), stride=((mQ.stride[1], mQ.stride[0]), 1, G * mQ.stride[1])))
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(g2s, mQ_t, sQ_layout, ((G, TM // G), DQ), 1)
        tma_atom_K = tma_K = tma_atom_V = tma_V = None
        if const_expr(self.paged and self.page_rows > 0):
            # paged K/V as (row in page, dim, kv_heads, pages); one box = page_rows rows of one page
            R = self.page_rows
            mK_t = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2, 0]))
            mV_t = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[1, 3, 2, 0]))
            sKb = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TM, R, DQ), dt, 1)
            sVb = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TM, R, DV), dt, 1)
            tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(g2s, mK_t, cute.select(sKb, mode=[0, 1]), (R, DQ), 1)
            tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(g2s, mV_t, cute.select(sVb, mode=[0, 1]), (R, DV), 1)
        if const_expr(not self.paged):
            # K/V as (tokens, dim, kv_heads) for the TMA (dim contiguous)
            mK_t = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[0, 2, 1]))
            mV_t = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[0, 2, 1]))
            tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(g2s, mK_t, cute.select(sK_layout, mode=[0, 1]), (TN, DQ), 1)
            tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(g2s, mV_t, cute.select(sV_layout, mode=[0, 1]), (TN, DV), 1)
        tma_atom_O = tma_O = None
        # (a kernel argument either way; only the TMA epilogue reads it)
        sO_layout = cute.select(sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (16, 16, DV), dt, 1), mode=[0, 1])
        if const_expr(self.tma_epilogue):
            # O as ((group, tokens), dim, kv_heads) like Q; one store = a warp's 16 packed rows x head_dim_vo
            # from its staging rows (common.epilogue.staged_offset: 16 x 64 boxes, 128-byte swizzle)
            mO_t = cute.make_tensor(mO.iterator, cute.make_layout(
                ((G, mO.shape[0]), DV, hkv), stride=((mO.stride[1], mO.stride[0]), 1, G * mO.stride[1])))
            tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mO_t, sO_layout,
                                                            ((G, 16 // G), DV), 1)

        @cute.struct
        class SharedStorage:
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * S]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * S]
            # (+ 1: pins_pv_wait's dummy mbarrier, arrived on and never waited for)
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * QS + (1 if self.pins_pv_wait else 0)]
            # per Q stage, the tile handed over with it (-1: none left) [and its work-table fields: TileInfo.SMEM*]
            s_tile: cute.struct.MemRange[Int32, 8 * QS if self.tile_info_smem else 2]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout_k)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_layout)], 1024]
            # ragged: the mbarrier a V block past the request's end lands on before its tail rows are zeroed
            mbar_v_tail: cute.struct.MemRange[cutlass.Int64, 0 if self.paged else 1]

        self.shared_storage = SharedStorage
        self.k_bytes = TN * DQ * 2
        self.v_bytes = TN * DV * 2
        self.q_bytes = TM * DQ * 2
        grid = TileScheduler.grid(mWork.shape[0], hkv, self.num_ctas)
        self.kernel(mQ, mK, mV, mIdx, tma_Q, tma_K, tma_V, tma_O, tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O, mWork,
                    mO, mLSE, mSinks, mMask, sm_scale, soft_cap, window_left, output_scale, sQ_layout_k, sK_layout,
                    sV_layout, sO_layout, tiled_mma_qk, tiled_mma_pv).launch(
            grid=grid, block=(self.num_threads, 1, 1), smem=SharedStorage.size_in_bytes(), stream=stream,
        )

    @cute.kernel
    def kernel(self, mQ, mK, mV, mIdx, tma_Q, tma_K, tma_V, tma_O, tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O,
               mWork, mO, mLSE, mSinks, mMask, sm_scale: Float32, soft_cap: Float32, window_left: Int32,
               output_scale: Float32, sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sO_layout: cute.ComposedLayout, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma):
        """Device entry: one CTA per (work row, kv head) tile, or (``num_ctas > 0``) a persistent CTA that
        takes tiles from an atomic counter."""
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_Q)
            if const_expr(not self.paged or self.page_rows > 0):
                cpasync.prefetch_descriptor(tma_atom_K)
                cpasync.prefetch_descriptor(tma_atom_V)
        one = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.NWG)  # lane 0 of each warp
        # Q and the tile index: q_stages buffers, filled by the producer's TMA, freed after the tile's last S GEMM
        # (with a staged epilogue after it)
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=self.QS, producer_group=one,
            consumer_group=consumer_warps, tx_count=self.q_bytes, defer_sync=True)
        if const_expr(not self.paged):
            pipe_k = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.S, producer_group=one,
                consumer_group=consumer_warps, tx_count=self.k_bytes, defer_sync=True)
            pipe_v = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.S, producer_group=one,
                consumer_group=consumer_warps, tx_count=self.v_bytes, defer_sync=True)
        else:
            # paged: all 128 producer threads arrive on a stage's full barrier, when their cp.async copies
            # of a gathered block land (cp.async.mbarrier.arrive.noinc) or, for a block loaded by TMA per
            # page, right away (one of them expects the bytes); every consumer thread releases
            producers = pipeline.CooperativeGroup(pipeline.Agent.Thread, 128)
            consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.NCT)
            pipe_k = pipeline.PipelineCpAsync.create(
                barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.S, producer_group=producers,
                consumer_group=consumers, defer_sync=True)
            pipe_v = pipeline.PipelineCpAsync.create(
                barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.S, producer_group=producers,
                consumer_group=consumers, defer_sync=True)
        pin_bar = None
        if const_expr(self.pins_pv_wait):
            pin_bar = storage.mbar_q.data_ptr() + 2 * self.QS
            if warp_idx == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_init(pin_bar, 1)
            cute.arch.mbarrier_init_fence()
        v_bar = None
        if const_expr(not self.paged):
            v_bar = storage.mbar_v_tail.data_ptr()
            if warp_idx == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_init(v_bar, 1)
            cute.arch.mbarrier_init_fence()
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        s_tile = storage.s_tile.get_tensor(cute.make_layout(2))

        # one kv head's K+V bytes per token turn the section budget into tokens
        sched = TileScheduler(mWork, mK, paged=self.paged,
                              section_tokens=(self.head_section_mib << 20) // ((self.DQ + self.DV) * 2))
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.registers[1])
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.QS)
            if const_expr(not self.paged):
                if warp_idx == 0:
                    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.S)
                    v_phase = Int32(0)
                    t = sched.first_tile(bx, by)
                    while t < sched.num_tiles:
                        wi, kvh = sched.coords(t)
                        b, blk_lo, n_blk = self._tile(mWork, wi, window_left)
                        if b >= 0:
                            self._hand_over(pipe_q, q_state, s_tile, t, tma_atom_Q, tma_Q, sQ, mWork, wi, kvh, mMask)
                            q_state.advance()
                        if const_expr(self.num_ctas > 0):
                            # claimed once this tile has started (its Q handed over): the atomic's latency hides
                            # behind the K/V loads
                            claim = sched.claim_begin(mWork)
                        if b >= 0:
                            state, v_phase = self._produce(
                                tma_K, tma_V, tma_atom_K, tma_atom_V, sK, sV, pipe_k, pipe_v, kvh, mWork[wi, W_KV_START],
                                mWork[wi, W_KV_LEN], blk_lo, n_blk, state,
                                (v_bar, v_phase, storage.sV.data_ptr().toint()))
                        t = sched.num_tiles  # one tile per CTA
                        if const_expr(self.num_ctas > 0):
                            t = sched.claim_end(mWork, claim)
                    self._hand_over(pipe_q, q_state, s_tile, Int32(-1), tma_atom_Q, tma_Q, sQ, mWork, 0, 0, mMask)
            else:
                wi = bx
                b, blk_lo, n_blk = self._tile(mWork, wi, window_left)
                if b >= 0:
                    if warp_idx == 0:
                        self._hand_over(pipe_q, q_state, s_tile, sched.first_tile(bx, by), tma_atom_Q, tma_Q, sQ,
                                        mWork, wi, by)
                        q_state.advance()
                    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.S)
                    self._produce_paged(mK, mV, mIdx, storage.sK.data_ptr().toint(), storage.sV.data_ptr().toint(),
                                        pipe_k, pipe_v, by, mWork[wi, W_KV_START], mWork[wi, W_KV_LEN], blk_lo,
                                        n_blk, tidx, state, tma_K, tma_V, tma_atom_K, tma_atom_V, sK, sV)
                if warp_idx == 0:
                    self._hand_over(pipe_q, q_state, s_tile, Int32(-1), tma_atom_Q, tma_Q, sQ, mWork, 0, 0)
        else:
            cute.arch.setmaxregister_increase(self.registers[0])
            ctid = tidx - 128
            wg = cute.arch.make_warp_uniform(ctid // 128)
            if const_expr(self.pingpong):
                if wg == self.NWG - 1:  # the first warpgroup issues first
                    cute.arch.barrier_arrive(barrier_id=barrier_id(Barrier.TURN, 0, self.NWG), number_of_threads=256)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.S)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.QS)
            pipe_q.consumer_wait(q_state)
            t = s_tile[self._slot(q_state)]
            while t >= 0:
                self._stamp(mMask, t, 4 * wg, ctid % 128 == 0)
                self._stamp_cta(mMask, t, bx, ctid)
                wi, kvh = sched.coords(t)
                b, blk_lo, n_blk = self._tile(mWork, wi, window_left, s_tile, q_state)
                self._stamp_fine(mMask, t, 14, ctid)
                # opaque per tile: keeps LLVM from hoisting the per-thread addresses out of the tile loop
                state = self._consume(sched, mO, tma_O, tma_atom_O, sO_layout, mLSE, mSinks, mMask, sQ,
                                      storage.sQ.data_ptr().toint(), sK, sV, pipe_q, q_state, s_tile, pipe_k, pipe_v,
                                      tiled_mma_qk, tiled_mma_pv, mWork, t, wi, kvh, blk_lo, n_blk, sm_scale,
                                      soft_cap, window_left, output_scale, ptx.opaque_i32(ctid), ptx.opaque_i32(wg), state,
                                      pin_bar)
                q_state.advance()
                pipe_q.consumer_wait(q_state)
                t = s_tile[self._slot(q_state)]

    # ------------------------------------------------------------------ the tile's fields (every role)
    def _q_index(self, q_state):
        """The Q stage's index (trace-time 0 with one stage)."""
        return q_state.index if const_expr(self.QS > 1) else 0

    def _slot(self, q_state):
        """Where the Q stage's tile index sits in ``s_tile`` (its work-table fields follow with
        ``TileInfo.SMEM*``: ``INFO_COLS``)."""
        if const_expr(self.tile_info_smem):
            return self._q_index(q_state) * 8
        return self._q_index(q_state)

    def _field(self, mWork, wi, col, s_tile=None, q_state=None):
        """Work-table field ``col`` of work row ``wi``: from ``s_tile`` where the producer copied it
        (``TileInfo.SMEM*`` and a Q stage given), else from global memory."""
        if const_expr(self.tile_info_smem and s_tile is not None):
            return s_tile[self._slot(q_state) + 1 + INFO_COLS.index(col)]
        return mWork[wi, col]

    @cute.jit
    def _tile(self, mWork, wi, window_left, s_tile=None, q_state=None):
        """(request, KV block range) of work row ``wi``: blocks ``[blk_lo, blk_lo + n_blk)`` hold every KV
        token some row of the tile can see; ``b < 0`` marks a padding row.  (Consumers pass their Q stage's
        ``s_tile``: :meth:`_field`.)"""
        f = lambda col: self._field(mWork, wi, col, s_tile, q_state)  # noqa: E731
        b = f(W_BATCH)
        blk_lo, n_blk = masks.kv_block_range(f(W_ROW0), f(W_QO_LEN), f(W_KV_LEN), window_left,
                                             self.G, self.TM, self.TN, self.mask_causal, self.use_window)
        return b, blk_lo, n_blk

    # ------------------------------------------------------------------ trace hooks
    # No code here: perf/trace_prefill.py's subclass writes per-tile %clock64 stamps from them.
    def _stamp(self, mMask, t, slot: int, pred):
        """Consumer warpgroup events of tile ``t`` (slot ``4 wg + 0..3``: start, first S done, last P V done, end)."""

    def _stamp_fine(self, mMask, t, slot: int, tid):
        """Finer events of consumer warpgroup 0 (slots 8..11 and 14, 15)."""

    def _stamp_hand_over(self, mMask, t):
        """The producer handing tile ``t``'s Q over (``t < 0``: the end marker)."""

    def _stamp_cta(self, mMask, t, bx, ctid):
        """Which CTA ran tile ``t``."""


def _fake_spec(cfg: Config):
    """What :func:`cutedsl_attn.compile.fake.prefill_tensors` reads: the problem's fields and the element type."""
    p = cfg.problem
    return types.SimpleNamespace(**{f.name: getattr(p, f.name) for f in dataclasses.fields(p)},
                                 cutlass_dtype=cfg.cutlass_dtype)


def build(kernel: Sm90PrefillKernel, cfg: Config, *, keep_ptx_dir: str | None = None, keep_cubin: bool = False):
    """Compile ``kernel`` (a :class:`Sm90PrefillKernel` of ``cfg``, or a subclass) from fake tensors; see ``compile``."""
    from cutlass.cute.runtime import make_fake_stream

    opts = compile_options(cfg.problem.arch, keep_ptx_dir=keep_ptx_dir, keep_cubin=keep_cubin)
    return cute.compile(
        kernel, *prefill_tensors(_fake_spec(cfg), WORK_COLS), Float32(1.0), Float32(0.0),
        Int32(-1), Float32(1.0), make_fake_stream(use_tvm_ffi_env_stream=True), options=opts,
    )
