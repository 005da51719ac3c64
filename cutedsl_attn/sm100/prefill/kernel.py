"""SM100 / SM103 (Blackwell) prefill / append attention: TMA + tcgen05.mma with TMEM accumulators, warp-specialised.

One CTA per (work row, kv head): ``128 * q_tiles`` packed query rows of one request (the work table of
:mod:`cutedsl_attn.planning.prefill`; packed row ``r`` is token ``r // group`` of query head
``kv_head * group + r % group``), the KV blocks some row of it sees (``masks.kv_block_range``: none right of
the causal diagonal or the request's end, none left of the sliding window) right to left (the masked ones
first).  With ``Tiles.num_ctas > 0`` a persistent grid instead: CTA ``i`` runs tiles ``i, i + gridDim.x, ..``
(:class:`~cutedsl_attn.common.scheduler.TileScheduler`, static), each role looping over them with its TMEM and
barriers set up once and every pipeline's use count carried from tile to tile.  Roles
(:class:`~cutedsl_attn.sm100.prefill.config.Roles`):

* load warp: TMA of the Q tiles (once) and of the K and V blocks into two rings (``PipelineTmaUmma`` each; paged
  K/V: one box per page, its id from the page table, into the same layout); a V block running past the request
  lands on its own mbarrier and has its tail rows zeroed before the MMA reads it;
* MMA warp (one elected thread): S = Q K^T into TMEM (``PipelineUmmaAsync`` to the softmax warpgroups) and
  O += P V with P read from TMEM (``PipelineAsyncUmma`` from the softmax warpgroups, ``PipelineUmmaAsync`` to the
  correction warpgroup); it owns the TMEM allocation.  One Q tile: two S buffers, block ``i + 1``'s scores
  computed while the softmax works on block ``i``; two Q tiles: the tiles take turns on the tensor core;
* softmax warpgroup per Q tile (one thread per row, :mod:`.softmax`): ``tcgen05.ld`` of its S row, the soft cap
  or ``score_mod``, the masks (sequence end, causal, window, custom mask), online max / sum, ``ex2``, the 16-bit
  P written back with ``tcgen05.st``; each block's rescale factor to the correction warpgroup through shared
  memory (``PipelineAsync``);
* correction warpgroup: rescales O in TMEM between P V GEMMs, then normalises the final O (sinks, output scale)
  into shared-memory staging buffers with the base-2 LSE (:mod:`.epilogue`) and moves on to the next tile;
* epilogue warp: stores the staged O tiles (a TMA box per buffer; 16-byte stores of the live rows where a tile
  runs past its request) and the LSE.

Conventions as the other prefill kernels: bottom-right causal, ``window_left = w`` keeps ``w + 1`` keys, the soft
cap ``cap * tanh(s / cap)`` on scaled logits, custom masks as FlashInfer's packed little-endian bits (replacing
causal), LSE base 2, empty rows O = 0 and LSE = -inf, ``sm_scale > 0`` unless a soft cap or ``score_mod`` is
used (:attr:`Config.positive_scale_only`); K/V rows past a request never reach an output.
"""

from __future__ import annotations

import dataclasses
import types

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.tensor_utils import LayoutEnum

from ...common import masks, ptx
from ...common.scheduler import TileScheduler
from ...common.tcgen05 import fence_after_sync, fence_before_sync, state_at
from ...compile.arch import compile_options
from ...compile.fake import prefill_tensors
from ...planning.prefill import W_BATCH, W_KV_LEN, W_KV_START, W_Q_START, W_QO_LEN, W_ROW0, WORK_COLS
from . import config as C
from .config import Config
from .epilogue import Epilogue
from .paged import PagedKV
from .softmax import SoftmaxWarpgroup, _plus


class Sm100PrefillKernel(SoftmaxWarpgroup, PagedKV, Epilogue):
    """The CuTe DSL SM100 prefill kernel of one :class:`Config` (build with ``compile``)."""

    def __init__(self, cfg: Config):
        p, t = cfg.problem, cfg.tiles
        self.cfg = cfg
        self.dtype = cfg.cutlass_dtype
        self.DQ, self.DV, self.G = p.head_dim_qk, p.head_dim_vo, p.group_size
        self.TM, self.TN, self.S = C.TILE_M, t.tile_n, t.kv_stages  # TM: rows of one Q tile (the MMA's M)
        self.QT, self.CTA_M = t.q_tiles, cfg.tile_m
        self.roles = cfg.roles
        self.CH = 32 if self.QT == 1 else 16  # O columns per correction tcgen05.ld / st (registers: its budget)
        self.causal, self.use_sinks = p.causal, p.use_sinks
        self.mask_causal = p.causal and not p.use_custom_mask  # a custom mask replaces causal (FlashInfer)
        self.use_window, self.use_soft_cap = p.use_window, p.use_soft_cap
        self.use_custom_mask, self.score_mod = p.use_custom_mask, p.score_mod
        self.paged, self.page_size, self.page_rows = p.page_size > 0, p.page_size, cfg.page_rows
        self.gather = self.paged and self.page_rows == 0  # pages that no whole TMA box fits: cp.async
        self.rescale_threshold = t.rescale_threshold
        self.num_ctas = t.num_ctas
        self.tmem = cfg.tmem
        self.tmem_cols = cfg.tmem_cols
        self.EPI = cfg.epi_stages  # O staging buffers (0: the correction warpgroup stores O itself)
        self.smem_bytes = cfg.smem_bytes

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mIdx: cute.Tensor, mWork: cute.Tensor,
                 mO: cute.Tensor, mLSE: cute.Tensor, mMask: cute.Tensor, mSinks: cute.Tensor,
                 sm_scale: Float32, soft_cap: Float32, window_left: Int32, output_scale: Float32, stream):
        DQ, DV, TM, TN, S, G = self.DQ, self.DV, self.TM, self.TN, self.S, self.G
        dt = self.dtype
        K_MAJOR = cute.nvgpu.OperandMajorMode.K
        MN_MAJOR = cute.nvgpu.OperandMajorMode.MN
        one_cta = tcgen05.CtaGroup.ONE
        self.qk_tiler = (TM, TN, DQ)
        self.pv_tiler = (TM, DV, TN)
        qk_mma = sm100_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, K_MAJOR, Float32, one_cta, (TM, TN))
        # P (A) from TMEM, K-major; V (B) as (head_dim, tokens): head_dim contiguous, MN-major
        pv_mma = sm100_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, MN_MAJOR, Float32, one_cta, (TM, DV),
                                                    tcgen05.OperandSource.TMEM)
        sQ_layout = sm100_utils.make_smem_layout_a(qk_mma, self.qk_tiler, dt, self.QT)  # one stage per Q tile
        sK_layout = sm100_utils.make_smem_layout_b(qk_mma, self.qk_tiler, dt, S)
        sV_layout = sm100_utils.make_smem_layout_b(pv_mma, self.pv_tiler, dt, S)
        tP_layout = sm100_utils.make_smem_layout_a(pv_mma, self.pv_tiler, dt, 1)
        EPI = self.EPI
        sO_layout = None  # (TM, EPI_COLS, EPI): O rows K-major with the 128-byte swizzle, as the TMA store reads
        if const_expr(EPI > 0):
            sO_layout = sm100_utils.make_smem_layout_epi(dt, LayoutEnum.ROW_MAJOR, (TM, C.EPI_COLS), EPI)

        hkv = mK.shape[2 if self.paged else 1]
        # Q as ((group, tokens), dim, kv_heads): one M=128 box of a tile is its packed rows (GQA packing)
        mQ_t = cute.make_tensor(mQ.iterator, cute.make_layout(
            ((G, mQ.shape[0]), DQ, hkv), stride=((mQ.stride[1], mQ.stride[0]), 1, G * mQ.stride[1])))
        if const_expr(not self.paged):
            mK_t = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[0, 2, 1]))  # (tokens, dim, kv_heads)
            mV_t = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[2, 0, 1]))  # (dim, tokens, kv_heads)
        g2s = cpasync.CopyBulkTensorTileG2SOp(one_cta)
        vmnk = (1, 1, 1, 1)
        tma_atom_Q, tma_Q = cute.nvgpu.make_tiled_tma_atom_A(
            g2s, mQ_t, cute.select(sQ_layout, mode=[0, 1, 2]), self.qk_tiler, qk_mma, vmnk)
        if const_expr(self.gather):  # (no K / V atoms: the load warp gathers from the page tensors themselves)
            tma_atom_K, tma_K, tma_atom_V, tma_V = None, mK, None, mV
        elif const_expr(self.paged):
            tma_atom_K, tma_K, tma_atom_V, tma_V = self._paged_tma(mK, mV)
        else:
            tma_atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_B(
                g2s, mK_t, cute.select(sK_layout, mode=[0, 1, 2]), self.qk_tiler, qk_mma, vmnk)
            tma_atom_V, tma_V = cute.nvgpu.make_tiled_tma_atom_B(
                g2s, mV_t, cute.select(sV_layout, mode=[0, 1, 2]), self.pv_tiler, pv_mma, vmnk)
        tma_atom_O, tma_O = None, None
        if const_expr(EPI > 0):
            # O as Q: ((group, tokens), dim, kv_heads), one box of a Q tile's packed rows and EPI_COLS columns
            mO_t = cute.make_tensor(mO.iterator, cute.make_layout(
                ((G, mO.shape[0]), DV, hkv), stride=((mO.stride[1], mO.stride[0]), 1, G * mO.stride[1])))
            tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mO_t,
                                                            cute.select(sO_layout, mode=[0, 1]), (TM, C.EPI_COLS))
        self.q_bytes = TM * DQ * 2
        self.k_bytes = TN * DQ * 2
        self.v_bytes = TN * DV * 2

        SharedStorage = _shared_storage(dt, self.QT, S, EPI, cute.cosize(sQ_layout), cute.cosize(sK_layout),
                                        cute.cosize(sV_layout), cute.cosize(sO_layout) if const_expr(EPI > 0) else 0)
        if const_expr(SharedStorage.size_in_bytes() != self.smem_bytes):  # (Config.smem_bytes: the host check)
            raise ValueError(f"shared storage {SharedStorage.size_in_bytes()} B != the config's {self.smem_bytes} B")
        self.shared_storage = SharedStorage
        # a second pair of tiled MMAs for Q tile 1: the MMA warp sets their ACCUMULATE field inside its per-tile
        # branches, and a tiled MMA mutated in one branch cannot be used in another
        qk_mma1 = sm100_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, K_MAJOR, Float32, one_cta, (TM, TN))
        pv_mma1 = sm100_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, MN_MAJOR, Float32, one_cta, (TM, DV),
                                                     tcgen05.OperandSource.TMEM)
        # the feature arguments the problem reads (SoftmaxWarpgroup._features), no others
        feat = tuple(x for x, on in ((mMask, self.use_custom_mask), (soft_cap, self.use_soft_cap),
                                     (window_left, self.use_window), (mIdx, self.paged)) if on)
        self.kernel(tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, tma_atom_O, tma_O, mWork, mO, mLSE,
                    mSinks, sm_scale, output_scale, qk_mma, pv_mma, qk_mma1, pv_mma1, sQ_layout, sK_layout, sV_layout,
                    tP_layout, sO_layout, feat).launch(
            grid=TileScheduler.grid(mWork.shape[0], hkv, self.num_ctas), block=(self.roles.num_threads, 1, 1),
            # (.minnctapersm: without it ptxas ignores setmaxnreg)
            smem=SharedStorage.size_in_bytes(), stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, tma_atom_O, tma_O, mWork, mO, mLSE,
               mSinks, sm_scale: Float32, output_scale: Float32, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma,
               qk_mma1: cute.TiledMma, pv_mma1: cute.TiledMma, sQ_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout, tP_layout: cute.ComposedLayout,
               sO_layout, feat):
        """Device entry: one CTA per (work row ``blockIdx.x``, kv head ``blockIdx.y``), or a persistent CTA
        (:meth:`_tiles`); ``feat``: the custom mask, soft cap, window and page-table arguments the problem uses,
        in that order."""
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        wi, kvh, _ = cute.arch.block_idx()
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        R = self.roles
        if warp == R.load_warp:
            cpasync.prefetch_descriptor(tma_atom_Q)
            if const_expr(not self.gather):
                cpasync.prefetch_descriptor(tma_atom_K)
                cpasync.prefetch_descriptor(tma_atom_V)

        def group(n):
            return pipeline.CooperativeGroup(pipeline.Agent.Thread, n)

        QT = self.QT
        # pipeline counts: Q tile t's j-th use of a per-tile pipeline is count j * QT + t (see state_at)
        pipe_q = pipeline.PipelineTmaUmma.create(num_stages=QT, producer_group=group(1), consumer_group=group(1),
                                                 tx_count=self.q_bytes, barrier_storage=storage.mbar_q.data_ptr(),
                                                 defer_sync=True)
        pipe_k = pipeline.PipelineTmaUmma.create(num_stages=self.S, producer_group=group(1),
                                                 consumer_group=group(1), tx_count=self.k_bytes,
                                                 barrier_storage=storage.mbar_k.data_ptr(), defer_sync=True)
        pipe_v = pipeline.PipelineTmaUmma.create(num_stages=self.S, producer_group=group(1),
                                                 consumer_group=group(1), tx_count=self.v_bytes,
                                                 barrier_storage=storage.mbar_v.data_ptr(), defer_sync=True)
        # S buffers: MMA -> softmax (128 threads release a buffer once its scores are in registers); one Q tile:
        # S0 / S1 alternate over the blocks, two: S_t is tile t's
        pipe_s = pipeline.PipelineUmmaAsync.create(num_stages=2, producer_group=group(1), consumer_group=group(128),
                                                   barrier_storage=storage.mbar_s.data_ptr(), defer_sync=True)
        # P buffers: softmax -> MMA (released by the P V GEMM's commit)
        pipe_p = pipeline.PipelineAsyncUmma.create(num_stages=2, producer_group=group(128), consumer_group=group(1),
                                                   barrier_storage=storage.mbar_p.data_ptr(), defer_sync=True)
        # O: MMA -> correction (a P V GEMM done; released once O is rescaled for the next one)
        pipe_o = pipeline.PipelineUmmaAsync.create(num_stages=QT, producer_group=group(1), consumer_group=group(128),
                                                   barrier_storage=storage.mbar_o.data_ptr(), defer_sync=True)
        # row statistics: softmax -> correction through s_stats
        pipe_stats = pipeline.PipelineAsync.create(num_stages=QT, producer_group=group(128),
                                                   consumer_group=group(128),
                                                   barrier_storage=storage.mbar_stats.data_ptr(), defer_sync=True)
        # staged O: correction -> epilogue warp (released once the epilogue warp has stored the buffer)
        pipe_epi = None
        if const_expr(self.EPI > 0):
            pipe_epi = pipeline.PipelineAsync.create(num_stages=self.EPI, producer_group=group(C.EPI_PRODUCERS),
                                                     consumer_group=group(C.EPI_CONSUMERS),
                                                     barrier_storage=storage.mbar_epi.data_ptr(), defer_sync=True)
        v_bar = storage.mbar_v_tail.data_ptr()
        if warp == R.load_warp:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(v_bar, 1)
        cute.arch.mbarrier_init_fence()
        tmem = cutlass.memory.TmemAllocator(
            storage.tmem_base.ptr, barrier_for_retrieve=pipeline.NamedBarrier(C.BAR_TMEM_ALLOC, 32 + 128 * QT + 128),
            allocator_warp_id=R.mma_warp)
        free_bar = pipeline.NamedBarrier(C.BAR_TMEM_FREE, 32 + 128)
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        s_stats = storage.s_stats.get_tensor(cute.make_layout((self.TM * QT, 2), stride=(1, self.TM * QT)))
        sO, sO_addr, s_lse = None, None, None
        if const_expr(self.EPI > 0):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
            sO_addr = storage.sO.data_ptr().toint()
            s_lse = storage.s_lse.get_tensor(cute.make_layout(self.TM * self.EPI))

        window_left = self._features(feat)[2]
        tile = None  # (one CTA per tile: this CTA's, read once for every role)
        if const_expr(self.num_ctas == 0):
            tile = (wi, kvh, *self._tile(mWork, wi, window_left))
        hkv = tma_K.shape[2]  # (the kv heads in every K view: ragged, paged, gathered)
        regs = R.registers
        if warp < R.correction_warps[0]:
            cute.arch.setmaxregister_increase(regs["softmax"])
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self._tiles("softmax", tile, hkv, mWork, window_left, (
                tmem_ptr, qk_mma, s_stats, pipe_s, pipe_p, pipe_stats, sm_scale, feat, mWork, warp), tidx)
        elif warp < R.mma_warp:
            cute.arch.setmaxregister_decrease(regs["correction"])
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self._tiles("correction", tile, hkv, mWork, window_left, (
                tmem_ptr, pv_mma, s_stats, pipe_o, pipe_stats, pipe_epi, s_lse, sO_addr, mWork, mO, mLSE, mSinks,
                output_scale), tidx)
            free_bar.arrive_and_wait()
        else:  # the MMA, load and epilogue warps (traced last: the MMA mutates the tiled MMAs inside its loop)
            cute.arch.setmaxregister_decrease(regs["other"])
            if const_expr(self.EPI > 0):
                if warp == R.epilogue_warp:
                    cpasync.prefetch_descriptor(tma_atom_O)
                    self._tiles("epilogue", tile, hkv, mWork, window_left, (
                        tma_atom_O, tma_O, sO, sO_addr, s_lse, pipe_epi, mWork, mO, mLSE), tidx)
            if warp == R.load_warp:
                self._tiles("load", tile, hkv, mWork, window_left, (
                    tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, sQ, sK, sV, pipe_q, pipe_k, pipe_v, v_bar,
                    qk_mma, pv_mma, mWork, storage, feat), tidx)
            if warp == R.mma_warp:
                tmem.allocate(self.tmem_cols)
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(Float32)
                tmem.relinquish_alloc_permit()
                self._tiles("mma", tile, hkv, mWork, window_left, (
                    tmem_ptr, (qk_mma, qk_mma1), (pv_mma, pv_mma1), tP_layout, sQ, sK, sV, pipe_q, pipe_k, pipe_v,
                    pipe_s, pipe_p, pipe_o), tidx)
                free_bar.arrive_and_wait()
                tmem.free(tmem_ptr)

    # ------------------------------------------------------------------ tiles of a CTA
    @cute.jit
    def _tiles(self, role: cutlass.Constexpr, tile, hkv, mWork, window_left, args, tidx):
        """Run ``role`` on the CTA's tile (``tile``: (work row, kv head, :meth:`_tile`'s fields)), or, on a
        persistent grid (``hkv`` kv heads), on tiles ``blockIdx.x, + gridDim.x, ..`` with the pipeline counts
        carried over, ``cnt`` = (KV blocks so far, tiles whose Q was loaded, softmax messages per Q tile, V tail
        blocks, tiles whose O was staged): each role derives them from the same tiles, so producers and consumers
        agree on every stage and phase."""
        if const_expr(self.num_ctas == 0):
            self._role(role, args, tile, (0, 0, 0, 0, 0), tidx)
        else:
            per_thread = role in ("softmax", "correction")
            # (made here, after the role's setmaxnreg: the tile count computed in the prologue stays live into
            # every role, and ptxas spills it for the low-budget ones)
            sched = TileScheduler(mWork, None, paged=self.paged, num_kv_heads=hkv)
            bx, _, _ = cute.arch.block_idx()
            t = sched.first_tile(bx, 0)
            nb, nq, ns, nt, ne = Int32(0), Int32(0), Int32(0), Int32(0), Int32(0)
            while t < sched.num_tiles:
                wi, kvh = sched.coords(t)
                # (the tile's fields are warp-uniform: ptxas may keep them in uniform registers)
                b, row0, qo_len, kv_len, blk_lo, n_blk = (
                    cute.arch.make_warp_uniform(x) for x in self._tile(mWork, wi, window_left))
                # (softmax / correction: the thread index opaque per tile, so LLVM does not hoist the per-thread
                # TMEM and global addresses out of the tile loop and keep them live through it)
                tid = ptx.opaque_i32(tidx) if const_expr(per_thread) else tidx
                self._role(role, args, (wi, kvh, b, row0, qo_len, kv_len, blk_lo, n_blk), (nb, nq, ns, nt, ne), tid)
                tail = (n_blk > 0) & (kv_len - (blk_lo + n_blk - 1) * self.TN < self.TN)
                nq = nq + cutlass.select_(n_blk > 0, Int32(1), Int32(0))
                ns = ns + cutlass.select_(b >= 0, n_blk + 1, Int32(0))
                nt = nt + cutlass.select_(tail, Int32(1), Int32(0))
                if const_expr(role in ("correction", "epilogue")):
                    ne = ne + cutlass.select_(b >= 0, Int32(1), Int32(0))
                nb = nb + n_blk
                t = sched.next_static(t)

    @cute.jit
    def _role(self, role: cutlass.Constexpr, args, tile, cnt, tidx):
        """One tile of ``role`` (``"softmax"``, ``"correction"``, ``"epilogue"``, ``"load"``, ``"mma"``; ``args``:
        the kernel's values it reads, as :meth:`kernel` packs them; ``tidx``: the thread index); a padding row
        (``b < 0``) or a tile of no KV block runs only the roles that still write its output."""
        wi, kvh, b, row0, qo_len, kv_len, blk_lo, n_blk = tile
        if const_expr(role == "softmax"):
            tmem_ptr, qk_mma, s_stats, pipe_s, pipe_p, pipe_stats, sm_scale, feat, mWork, warp = args
            if b >= 0:
                sm_args = (tmem_ptr, qk_mma, s_stats, pipe_s, pipe_p, pipe_stats, sm_scale, feat, mWork, wi, b, kvh,
                           row0, qo_len, kv_len, blk_lo, n_blk)
                if const_expr(self.QT == 1):
                    self._softmax(*sm_args, tidx, 0, cnt)
                else:
                    wg = warp // 4
                    if wg == 0:
                        self._softmax(*sm_args, tidx, 0, cnt)
                    else:
                        self._softmax(*sm_args, tidx - 128, 1, cnt)
        if const_expr(role == "correction"):
            tmem_ptr, pv_mma, s_stats, pipe_o, pipe_stats, pipe_epi, s_lse, sO_addr, mWork, mO, mLSE, mSinks, \
                output_scale = args
            if b >= 0:
                self._correction(tmem_ptr, pv_mma, s_stats, pipe_o, pipe_stats, pipe_epi, s_lse, sO_addr, mWork, wi,
                                 kvh, mO, mLSE, mSinks, output_scale, row0, qo_len, n_blk, tidx - 128 * self.QT, cnt)
        if const_expr(role == "epilogue"):
            if b >= 0:
                self._epilogue_warp(*args, wi, kvh, row0, qo_len, cute.arch.lane_idx(), cnt[4])
        if const_expr(role == "load"):
            if n_blk > 0:
                self._load(*args[:16], wi, kvh, kv_len, blk_lo, n_blk, *args[16:], cnt)
        if const_expr(role == "mma"):
            if n_blk > 0:
                self._mma(*args, n_blk, cnt)

    @cute.jit
    def _tile(self, mWork, wi, window_left):
        """Work row ``wi``'s fields and its KV block range (blocks no row sees are skipped: before the causal
        diagonal, past the request, left of the sliding window): ``(b, row0, qo_len, kv_len, blk_lo, n_blk)``,
        ``n_blk`` 0 for a padding row (``b < 0``)."""
        b = mWork[wi, W_BATCH]
        row0 = mWork[wi, W_ROW0]
        qo_len = mWork[wi, W_QO_LEN]
        kv_len = mWork[wi, W_KV_LEN]
        blk_lo, n_blk = masks.kv_block_range(row0, qo_len, kv_len, window_left, self.G, self.CTA_M, self.TN,
                                             self.mask_causal, self.use_window)
        n_blk = cutlass.select_(b >= 0, n_blk, Int32(0))
        return b, row0, qo_len, kv_len, blk_lo, n_blk

    # ------------------------------------------------------------------ TMEM views
    def _tmem_S(self, tmem_ptr, qk_mma, name):
        """The (128, tile_n) fp32 score buffer ``name`` (``"S0"`` / ``"S1"``) of the TMEM plan."""
        thr = qk_mma.get_slice(0)
        frag = thr.make_fragment_C(thr.partition_shape_C((self.TM, self.TN)))
        return cute.make_tensor(tmem_ptr + self.tmem[name][0], frag.layout)

    def _tmem_O(self, tmem_ptr, pv_mma, t: int):
        """Q tile ``t``'s (128, head_dim_vo) fp32 output accumulator."""
        thr = pv_mma.get_slice(0)
        frag = thr.make_fragment_C(thr.partition_shape_C((self.TM, self.DV)))
        return cute.make_tensor(tmem_ptr + self.tmem["O" if self.QT == 1 else f"O{t}"][0], frag.layout)

    def _tmem_P_operand(self, tmem_ptr, pv_mma, tP_layout, name):
        """P buffer ``name`` as the P V GEMM's TMEM A operand (16-bit, two per column)."""
        thr = pv_mma.get_slice(0)
        tOrP = thr.make_fragment_A(cute.make_tensor(tmem_ptr, tP_layout.outer))[None, None, None, 0]
        return cute.make_tensor(cute.recast_ptr(tmem_ptr + self.tmem[name][0], dtype=tOrP.element_type),
                                tOrP.layout)

    # ------------------------------------------------------------------ load warp
    @cute.jit
    def _load(self, tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, sQ, sK, sV, pipe_q, pipe_k, pipe_v,
              v_bar, qk_mma, pv_mma, mWork, wi, kvh, kv_len, blk_lo, n_blk, storage, feat, cnt):
        """TMA Q once and the K / V blocks ``blk_lo + n_blk - 1 .. blk_lo`` (right to left) into their rings (paged
        K/V: one box per page, :meth:`_load_pages`); ``cnt``: the counts before this tile (:meth:`_tiles`)."""
        nb, nq, _, nt, _ = cnt
        TM, TN, DQ, DV = self.TM, self.TN, self.DQ, self.DV
        qk_thr = qk_mma.get_slice(0)
        pv_thr = pv_mma.get_slice(0)
        gQ = cute.flat_divide(cute.domain_offset(((0, mWork[wi, W_Q_START]), 0, 0), tma_Q), (TM, DQ))
        tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3),
                                           cute.group_modes(qk_thr.partition_A(gQ), 0, 3))
        kv_start = mWork[wi, W_KV_START]  # (paged: the request's first entry of the page table)
        if const_expr(not self.paged):
            gK = cute.flat_divide(cute.domain_offset((kv_start, 0, 0), tma_K), (TN, DQ))
            tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3),
                                               cute.group_modes(qk_thr.partition_B(gK), 0, 3))
            gV = cute.flat_divide(cute.domain_offset((0, kv_start, 0), tma_V), (DV, TN))
            tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 3),
                                               cute.group_modes(pv_thr.partition_B(gV), 0, 3))
        else:
            mIdx = self._features(feat)[3]
            sK_rows, sV_rows = self._rows_view(storage.sK, DQ), self._rows_view(storage.sV, DV)
        q_args = (pipe_q, tma_atom_Q, tQgQ, tQsQ, mWork, wi, kvh, nq)
        if const_expr(self.num_ctas == 0):
            self._load_q(*q_args)
        rows = kv_len - (blk_lo + n_blk - 1) * TN  # rows of the first (rightmost) block inside the request
        for i in cutlass.range(n_blk, unroll=1):
            n = blk_lo + n_blk - 1 - i
            state = state_at(self.S, _plus(nb, i), True)
            if const_expr(self.gather):
                self._gather_block(pipe_k, state, tma_K, mIdx, storage.sK.data_ptr().toint(), DQ, kv_start, n * TN,
                                   kv_len, kvh)
                self._gather_block(pipe_v, state, tma_V, mIdx, storage.sV.data_ptr().toint(), DV, kv_start, n * TN,
                                   kv_len, kvh)
            else:
                pipe_k.producer_acquire(state)
                if const_expr(self.paged):
                    self._load_pages(tma_atom_K, tma_K, sK_rows, pipe_k.producer_get_barrier(state), mIdx, kv_start,
                                     n * TN, kv_len, kvh, state.index)
                else:
                    cute.copy(tma_atom_K, tKgK[None, n, 0, kvh], tKsK[None, state.index],
                              tma_bar_ptr=pipe_k.producer_get_barrier(state))
                if (i == 0) & (rows < TN):
                    # the tail block: land on v_bar, zero rows past the request, then complete the stage by an arrive
                    pipe_v.sync_object_empty.wait(state.index, state.phase)
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive_and_expect_tx(v_bar, self.v_bytes)
                    if const_expr(self.paged):
                        self._load_pages(tma_atom_V, tma_V, sV_rows, v_bar, mIdx, kv_start, n * TN, kv_len, kvh,
                                         state.index)
                    else:
                        cute.copy(tma_atom_V, tVgV[None, 0, n, kvh], tVsV[None, state.index], tma_bar_ptr=v_bar)
                    cute.arch.mbarrier_wait(v_bar, nt & 1)  # (the tile's tail: one per tile that has one)
                    self._zero_v_rows(sV, state.index, rows)
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive(pipe_v.sync_object_full.get_barrier(state.index))
                else:
                    pipe_v.producer_acquire(state)
                    if const_expr(self.paged):
                        self._load_pages(tma_atom_V, tma_V, sV_rows, pipe_v.producer_get_barrier(state), mIdx, kv_start,
                                         n * TN, kv_len, kvh, state.index)
                    else:
                        cute.copy(tma_atom_V, tVgV[None, 0, n, kvh], tVsV[None, state.index],
                                  tma_bar_ptr=pipe_v.producer_get_barrier(state))
            if const_expr(self.num_ctas > 0):
                # persistent: Q waits for the previous tile's last MMA to free its stage; the first K / V block
                # goes out before it, while that tile still computes
                if i == 0:
                    self._load_q(*q_args)

    @cute.jit
    def _load_q(self, pipe_q, tma_atom_Q, tQgQ, tQsQ, mWork, wi, kvh, nq):
        """TMA work row ``wi``'s Q tiles into their stages once the MMA released them (``nq``: the tiles whose Q
        this CTA loaded before)."""
        for t in cutlass.range_constexpr(self.QT):
            q_state = state_at(self.QT, nq * self.QT + t, True)
            pipe_q.producer_acquire(q_state)
            cute.copy(tma_atom_Q, tQgQ[None, mWork[wi, W_ROW0] // self.TM + t, 0, kvh], tQsQ[None, t],
                      tma_bar_ptr=pipe_q.producer_get_barrier(q_state))

    # ------------------------------------------------------------------ MMA warp
    @cute.jit
    def _mma(self, tmem_ptr, qk_mmas, pv_mmas, tP_layout, sQ, sK, sV, pipe_q, pipe_k, pipe_v, pipe_s, pipe_p,
             pipe_o, n_blk, cnt):
        """One Q tile: S_i = Q K_i^T into S buffer ``i % 2``, then O += P_{i-1} V_{i-1} (the next block's scores are
        computed while the softmax warpgroup works on this one's).  Two Q tiles, per block ``i``: for ``t`` = 0, 1,
        O_t += P_t(i-1) V_{i-1}, then S_t = Q_t K_i^T (tile ``t``'s P lives in S_t, so its P V goes first; the
        tensor core works on one tile while the other tile's softmax runs).  ``cnt``: the counts before this tile
        (:meth:`_tiles`)."""
        QT = self.QT
        qk_mma, pv_mma = qk_mmas[0], pv_mmas[0]
        qk_thr = qk_mma.get_slice(0)
        pv_thr = pv_mma.get_slice(0)
        tSrQ = qk_thr.make_fragment_A(sQ)
        tSrK = qk_thr.make_fragment_B(sK)
        tOrV = pv_thr.make_fragment_B(sV)
        tStS0 = self._tmem_S(tmem_ptr, qk_mma, "S0")
        tOrP0 = self._tmem_P_operand(tmem_ptr, pv_mma, tP_layout, "P0")
        tOtO = [self._tmem_O(tmem_ptr, pv_mma, t) for t in range(QT)]
        s_cols, p_cols = self.tmem["S1"][0] - self.tmem["S0"][0], self.tmem["P1"][0] - self.tmem["P0"][0]
        nb, nq, _, _, _ = cnt
        q0 = nq * QT
        for t in cutlass.range_constexpr(QT):
            pipe_q.consumer_wait(state_at(QT, q0 + t, False))
        for i in cutlass.range(n_blk + 1, unroll=1):
            k_state = state_at(self.S, _plus(nb, i), False)
            v_state = state_at(self.S, _plus(nb, i - 1), False)
            if i < n_blk:
                pipe_k.consumer_wait(k_state)
            if i > 0:
                pipe_v.consumer_wait(v_state)
            for t in cutlass.range_constexpr(QT):
                if const_expr(QT == 1):
                    if i < n_blk:
                        self._issue_qk(qk_mmas[0], pipe_s, state_at(2, _plus(nb, i), True), tStS0, s_cols, tSrQ,
                                       tSrK, k_state, 0)
                if i > 0:
                    p_state = state_at(2, _plus(nb, i - 1) * QT + t, False)
                    o_state = state_at(QT, _plus(nb, i - 1) * QT + t, True)
                    pipe_p.consumer_wait(p_state)
                    pipe_o.producer_acquire(o_state)
                    fence_after_sync()
                    tOrP = cute.make_tensor(cute.recast_ptr(tmem_ptr + self.tmem["P0"][0] + p_state.index * p_cols,
                                                            dtype=tOrP0.element_type), tOrP0.layout)
                    self._gemm_pv(pv_mmas[t], tOtO[t], tOrP, tOrV, v_state.index, i > 1)
                    pipe_o.producer_commit(o_state)
                    pipe_p.consumer_release(p_state)
                if const_expr(QT == 2):
                    if i < n_blk:
                        self._issue_qk(qk_mmas[t], pipe_s, state_at(2, _plus(nb, i) * QT + t, True), tStS0, s_cols,
                                       tSrQ, tSrK, k_state, t)
            if i < n_blk:
                pipe_k.consumer_release(k_state)
            if i > 0:
                pipe_v.consumer_release(v_state)
        for t in cutlass.range_constexpr(QT):
            pipe_q.consumer_release(state_at(QT, q0 + t, False))

    @cute.jit
    def _issue_qk(self, qk_mma, pipe_s, s_state, tStS0, s_cols, tSrQ, tSrK, k_state, q_stage: cutlass.Constexpr):
        """S (buffer ``s_state.index``) = Q (stage ``q_stage``) K^T, then signal the softmax warpgroup."""
        pipe_s.producer_acquire(s_state)
        fence_after_sync()
        tStS = cute.make_tensor(tStS0.iterator + s_state.index * s_cols, tStS0.layout)
        self._gemm_qk(qk_mma, tStS, tSrQ, tSrK, k_state.index, q_stage)
        pipe_s.producer_commit(s_state)

    @cute.jit
    def _gemm_qk(self, qk_mma, tStS, tSrQ, tSrK, k_stage, q_stage: cutlass.Constexpr):
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            qk_mma.set(tcgen05.Field.ACCUMULATE, k != 0)
            cute.gemm(qk_mma, tStS, tSrQ[None, None, k, q_stage], tSrK[None, None, k, k_stage], tStS)

    @cute.jit
    def _gemm_pv(self, pv_mma, tOtO, tOrP, tOrV, v_stage, accumulate):
        for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            pv_mma.set(tcgen05.Field.ACCUMULATE, accumulate | (k != 0))
            cute.gemm(pv_mma, tOtO, tOrP[None, None, k], tOrV[None, None, k, v_stage], tOtO)

    # ------------------------------------------------------------------ correction warpgroup
    @cute.jit
    def _correction(self, tmem_ptr, pv_mma, s_stats, pipe_o, pipe_stats, pipe_epi, s_lse, sO_addr, mWork, wi, kvh,
                    mO, mLSE, mSinks, output_scale, row0, qo_len, n_blk, ctid, cnt):
        """Thread ``ctid`` owns TMEM lane ``lane``, i.e. packed row ``row0 + 128 t + lane`` of every Q tile ``t``:
        between P V GEMMs it scales the row of O_t by the softmax warpgroup's factor (skipped when the whole
        warp's factors are 1), then normalises it and hands it with its base-2 LSE to the epilogue warp
        (:meth:`_epilogue`; ``cnt``: the counts before this tile, :meth:`_tiles`)."""
        nb, _, ns, _, ne = cnt
        TM, DV, QT = self.TM, self.DV, self.QT
        CH = self.CH
        tOtO0 = self._tmem_O(tmem_ptr, pv_mma, 0)
        pv_thr = pv_mma.get_slice(0)
        tOtO_c = cute.make_tensor(tOtO0.iterator, cute.composition(tOtO0.layout, cute.make_layout((TM, CH))))
        cO = pv_thr.partition_C(cute.make_identity_tensor((TM, DV)))
        cO_c = cute.make_tensor(cO.iterator, cute.composition(cO.layout, cute.make_layout((TM, CH))))
        tiled_ld = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(CH)), Float32), tOtO_c)
        tiled_st = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(CH)), Float32), tOtO_c)
        thr_ld = tiled_ld.get_slice(ctid)
        thr_st = tiled_st.get_slice(ctid)
        tLtO = thr_ld.partition_S(tOtO_c)
        tStO = thr_st.partition_D(tOtO_c)
        tLcO = thr_ld.partition_D(cO_c)
        o_cols = 0 if QT == 1 else self.tmem["O1"][0] - self.tmem["O0"][0]  # O_t at O_0 + t * o_cols
        row = tLcO[0][0]  # this thread's TMEM lane
        for i in cutlass.range(n_blk, unroll=1):
            for t in cutlass.range_constexpr(QT):
                st_state = state_at(QT, _plus(ns, i) * QT + t, False)
                pipe_stats.consumer_wait(st_state)
                alpha = s_stats[t * TM + row, 0]
                pipe_stats.consumer_release(st_state)
                if i > 0:
                    self._rescale(pipe_o, state_at(QT, _plus(nb, i - 1) * QT + t, False), alpha, tiled_ld,
                                  tiled_st,
                                  cute.make_tensor(tLtO.iterator + t * o_cols, tLtO.layout),
                                  cute.make_tensor(tStO.iterator + t * o_cols, tStO.layout), tLcO)
        for t in cutlass.range_constexpr(QT):
            self._epilogue(pipe_o, pipe_stats, pipe_epi, s_stats, s_lse, sO_addr, mWork, wi, kvh, mO, mLSE, mSinks,
                           output_scale, row0, qo_len, n_blk, row, t, tiled_ld,
                           cute.make_tensor(tLtO.iterator + t * o_cols, tLtO.layout), tLcO, nb, ns, ne)

    @cute.jit
    def _rescale(self, pipe_o, o_state, alpha, tiled_ld, tiled_st, tLtO, tStO, tLcO):
        """Once the P V GEMM before is done, scale this thread's O row by ``alpha`` in TMEM (skipped when every
        factor of the warp is 1), then let the next P V GEMM accumulate."""
        CH = self.CH
        pipe_o.consumer_wait(o_state)
        fence_after_sync()
        if cute.arch.vote_any_sync(alpha != Float32(1.0)):
            for c in cutlass.range_constexpr(self.DV // CH):
                rO = cute.make_rmem_tensor(tLcO.shape, Float32)
                cute.copy(tiled_ld, cute.make_tensor(tLtO.iterator + c * CH, tLtO.layout), rO)
                cute.arch.fence_view_async_tmem_load()
                for e in cutlass.range_constexpr(0, cute.size(rO), 2):
                    rO[e], rO[e + 1] = cute.arch.mul_packed_f32x2((rO[e], rO[e + 1]), (alpha, alpha))
                cute.copy(tiled_st, rO, cute.make_tensor(tStO.iterator + c * CH, tStO.layout))
            cute.arch.fence_view_async_tmem_store()
        fence_before_sync()
        pipe_o.consumer_release(o_state)


def _shared_storage(dt, QT: int, S: int, EPI: int, q_elems: int, k_elems: int, v_elems: int, o_elems: int):
    """The kernel's shared storage (a plain function: the DSL would stage the ``if`` of a traced class body)."""
    R, A, TM = cute.struct.MemRange, cute.struct.Align, C.TILE_M
    fields = dict(mbar_q=R[cutlass.Int64, 2 * QT], mbar_k=R[cutlass.Int64, 2 * S], mbar_v=R[cutlass.Int64, 2 * S],
                  mbar_s=R[cutlass.Int64, 4], mbar_p=R[cutlass.Int64, 4], mbar_o=R[cutlass.Int64, 2 * QT],
                  mbar_stats=R[cutlass.Int64, 2 * QT], mbar_v_tail=R[cutlass.Int64, 1])
    if EPI > 0:
        fields["mbar_epi"] = R[cutlass.Int64, 2 * EPI]
    fields["tmem_base"] = Int32
    # per row: the block's O rescale factor, or (final message) the row sum and the log2-unit row max
    fields["s_stats"] = R[Float32, 2 * TM * QT]
    if EPI > 0:
        fields["s_lse"] = R[Float32, TM * EPI]  # the staged rows' LSE, per buffer
    fields.update(sQ=A[R[dt, q_elems], 1024], sK=A[R[dt, k_elems], 1024], sV=A[R[dt, v_elems], 1024])
    if EPI > 0:
        fields["sO"] = A[R[dt, o_elems], 1024]
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


def _fake_spec(cfg: Config):
    """What :func:`cutedsl_attn.compile.fake.prefill_tensors` reads: the problem's fields and the element type."""
    p = cfg.problem
    return types.SimpleNamespace(**{f.name: getattr(p, f.name) for f in dataclasses.fields(p)},
                                 cutlass_dtype=cfg.cutlass_dtype)


def build(cfg: Config, *, keep_ptx_dir: str | None = None, keep_cubin: bool = False):
    """Compile the kernel of ``cfg`` from fake tensors (see the package's ``compile``)."""
    from cutlass.cute.runtime import make_fake_stream

    opts = compile_options(cfg.problem.arch, keep_ptx_dir=keep_ptx_dir, keep_cubin=keep_cubin)
    return cute.compile(
        Sm100PrefillKernel(cfg), *prefill_tensors(_fake_spec(cfg), WORK_COLS), Float32(1.0), Float32(0.0),
        Int32(-1), Float32(1.0), make_fake_stream(use_tvm_ffi_env_stream=True), options=opts,
    )
