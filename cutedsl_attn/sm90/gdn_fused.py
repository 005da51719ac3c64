"""Fused chunked gated delta rule (GDN) prefill for SM90 (Hopper): one kernel in which a prep warpgroup computes
each chunk's ``W``, ``U``, ``Aqk`` and row factors straight into the shared-memory stages that the wgmma consumer
warpgroup of :mod:`cutedsl_attn.sm90.gdn_chunked` reads, so no scratch goes through global memory.

One CTA per (V-slice of ``tile_v = 64`` state rows, output head, sequence), ``128 (P + 1)`` threads:

* warpgroups ``0 .. P - 1`` (``Tiles.prep_warpgroups`` P = 1 or 2), the prep warpgroups: warpgroup ``w`` takes
  chunks ``w, w + P, ..`` of the sequence; per chunk it waits for the chunk's ring stage, ``cp.async``-es the
  chunk's raw q / k rows into the stage's 128-byte-swizzled tiles (zero past the sequence: what the consumer's
  ``Y^T`` and state update read), and q / k / the V-slice of v into its own padded work rows, then runs the prep
  of :mod:`cutedsl_attn.common.gdn_prep` (cumulative decay, l2 normalisers, ``Aqk``, ``A``, the blockwise 16 x 16
  inverse, ``W = T diag(beta gamma) K``, ``U = T diag(beta) V``; warp-level ``mma.sync`` on shared memory) and
  stores ``W`` / ``Aqk`` into the stage's swizzled tiles, the V-slice of ``U`` and the row factors into its
  padded rows -- the bytes the two-kernel path's producer would have copied from the scratch;
* the last warpgroup, the consumer: :meth:`GdnChunkedSm90Kernel._consume` unchanged (the fp32 state in
  registers, 24 wgmma a chunk at K = 128), so the two paths compute the same values.

While the consumer runs chunk ``c`` the prep warpgroups compute the next chunks into the other stages (chunk
``c`` in stage ``c % num_stages``; ``num_stages >= P``, so no parity wait can alias an older phase).  Barriers:
``full[s]`` (128 arrivals: every thread of the prep warpgroup filling it, after its stores and a proxy fence)
and ``empty[s]`` (128 arrivals: every consumer thread, after its last wgmma of the stage retired), one pair a
stage; prep warpgroup ``w`` synchronises itself on named barrier ``2 + 2 w`` (128 threads) and, in the
inverse's diagonal step, ``3 + 2 w`` (64 threads); barrier 0 (the CTA) is used once, after the mbarrier
initialisation.  Registers: with P = 1 (256 threads) every thread keeps the launch count (up to 255), no
``setmaxnreg``; with P = 2 (384 threads, 168 at launch) the prep warpgroups drop to 136 and the consumer rises to
232: ``2 * 128 * 136 + 128 * 232 = 384 * 168``, the CTA's launch pool.

Semantics as :mod:`cutedsl_attn.sm90.gdn_chunked`: rows past a sequence's end are zero-filled before any GEMM
reads them, a sequence of length 0 writes its initial state (zeros without one) as its final state, each CTA
reads its state slice before it writes it (an in-place pool update is race-free), GVA / GQA head grouping,
fused l2norm, linear or log gates, fp32 or bf16 state.  ``tile_v`` is 64 only: a second consumer warpgroup
would leave ``65536 - 2 * 128 * 232`` registers, 48 a thread, for a prep warpgroup, which needs about 128.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..common import ptx
from ..common.gdn_prep import row_pitches
from ..common.smem import sw128_offset
from ..compile.arch import compile_options
from ..compile.fake import gdn_chunked_tensors
from ..compile.tiles import override_int_fields
from ..common.dtypes import element_type
from ..planning.gdn import CHUNK, GdnArgs, GdnProblem
from . import gdn_chunked as _chunked

NAME = "gdn_fused_sm90"
ARCH = "sm_90a"
SMEM_LIMIT = 227 * 1024
#: registers a CTA may launch with (the SM's register file share of one CTA)
LAUNCH_POOL = 65536
PREP_THREADS = 128
# two prep warpgroups (384 threads, 168 registers each at launch): registers a thread after setmaxnreg,
# 2 * 128 * PREP_REGS + 128 * CONSUMER_REGS = 64512 = 384 * 168, the launch pool of the CTA
PREP_REGS = 136
CONSUMER_REGS = _chunked.CONSUMER_REGS


@dataclass(frozen=True)
class Tiles:
    """What the fused kernel's CTA chooses: ``tile_v`` state rows it owns (64: one consumer warpgroup),
    ``num_stages`` of the chunk ring the prep warpgroups fill (2 or 3; 3 fits shared memory at K = 64 only) and
    ``prep_warpgroups`` (1 or 2: two prep the chunks alternately, each with its own work rows and barriers).

    Raises TypeError for a non-int field, ValueError for another value.
    """

    tile_v: int = 64
    num_stages: int = 2
    prep_warpgroups: int = 1

    def __post_init__(self):
        for name in ("tile_v", "num_stages", "prep_warpgroups"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {v!r}")
        if self.tile_v != 64:
            raise ValueError(f"tile_v must be 64 (one consumer warpgroup beside the prep warpgroup), got "
                             f"{self.tile_v}")
        if self.num_stages not in (2, 3):
            raise ValueError(f"num_stages must be 2 or 3, got {self.num_stages}")
        if self.prep_warpgroups not in (1, 2):
            raise ValueError(f"prep_warpgroups must be 1 or 2, got {self.prep_warpgroups}")


TUNING_FIELDS = tuple(f.name for f in dataclasses.fields(Tiles))


def unsupported_reason(problem: GdnProblem) -> str | None:
    """Why the fused SM90 kernel cannot serve ``problem``, or None.  It serves exactly what the two-kernel SM90
    chunked kernel serves (GDN prefill: scalar gates, one update a token, a V-major state, K and V in 64 / 128,
    ``sm_90a``); the reasons are that kernel's.

    Raises TypeError when ``problem`` is not a GdnProblem.
    """
    return _chunked.unsupported_reason(problem)


@dataclass(frozen=True)
class Config:
    """The fused kernel's compile key: ``Config(problem, tiles)``.

    Raises TypeError for a ``tiles`` of another type, ValueError with :func:`unsupported_reason`'s reason or when
    the stages and the prep's work rows exceed shared memory, for two prep warpgroups at ``head_dim_k`` 64.
    """

    problem: GdnProblem
    tiles: Tiles

    def __post_init__(self):
        if not isinstance(self.tiles, Tiles):
            raise TypeError(f"tiles must be a gdn_fused_sm90 Tiles, got {type(self.tiles).__name__}")
        reason = unsupported_reason(self.problem)
        if reason is not None:
            raise ValueError(f"the fused SM90 GDN kernel cannot serve this problem: {reason}")
        if self.tiles.prep_warpgroups == 2 and self.problem.head_dim_k != 128:
            raise ValueError("prep_warpgroups 2 needs head_dim_k 128: at 64 ptxas drops the setmaxnreg rebalancing "
                             "(168 registers a thread) and spills")
        if self.smem_bytes > SMEM_LIMIT:
            raise ValueError(f"num_stages {self.tiles.num_stages} x prep_warpgroups {self.tiles.prep_warpgroups} at "
                             f"head_dim_k {self.problem.head_dim_k} needs {self.smem_bytes} B of shared memory "
                             f"(> {SMEM_LIMIT})")

    @property
    def arch(self) -> str:
        return self.problem.arch

    @property
    def num_wg(self) -> int:
        """Consumer warpgroups: 64 state rows each."""
        return self.tiles.tile_v // 64

    @property
    def threads(self) -> int:
        """Threads a CTA: the prep warpgroups, then the consumer warpgroup."""
        return 128 * (self.tiles.prep_warpgroups + self.num_wg)

    @property
    def row_u(self) -> int:
        """Bytes per shared row of U's and v's V-slice (16-byte pad: conflict-free ldmatrix and column reads)."""
        return 2 * self.tiles.tile_v + 16

    @property
    def stage_bytes(self) -> int:
        """One stage: swizzled q, k, W (C x K), Aqk (C x C), U's V-slice rows and the three fp32 factor rows."""
        c, k = CHUNK, self.problem.head_dim_k
        return 3 * c * k * 2 + c * c * 2 + c * self.row_u + 3 * c * 4

    @property
    def prep_bytes(self) -> int:
        """The prep warpgroup's work rows: q (then A, then T^T), k, the V-slice of v, five fp32 rows."""
        rk, _rv, _rc, ra = row_pitches(self.problem.head_dim_k, self.problem.head_dim_v)
        return CHUNK * max(rk, ra) + CHUNK * rk + CHUNK * self.row_u + 5 * CHUNK * 4

    @property
    def smem_bytes(self) -> int:
        """The ring (each swizzled buffer 1 KiB aligned), the work rows of each prep warpgroup, the mbarriers and
        alignment slack."""
        return self.tiles.num_stages * self.stage_bytes + self.tiles.prep_warpgroups * self.prep_bytes + 2 * 1024


def default_tiles(problem: GdnProblem, *, num_sms: int, chains: int | None = None) -> Tiles:
    """The default tiles (``num_sms`` and ``chains`` = N * HO are accepted for the dispatcher's interface and do
    not change them):

    ==========================  ===========================================================================
    every problem               64 state rows (the only width whose register budgets fit one CTA) and two
                                stages: the prep of chunk c + 1 runs beside chunk c, one chunk ahead
    ==========================  ===========================================================================
    """
    return Tiles(tile_v=64, num_stages=2)


def override_tiles(tiles: Tiles, items: dict[str, str]) -> Tiles:
    """``tiles`` with the fields named in ``items`` (field name -> decimal text) replaced; ValueError naming the key
    for an unknown field or a non-integer value, and the Tiles checks for a refused value."""
    return override_int_fields(tiles, items)


def prep_barrier_id(w):
    """The named barrier of prep warpgroup ``w`` (its 128 threads).  Barrier 0 is the CTA's (used once, at the
    mbarrier initialisation); 1 is left unused."""
    return 2 + w


class _PrepWarpgroupBarriers:
    """While active, ``cute.arch.sync_threads`` traces as the prep warpgroup's 128-thread named barrier: the
    shared inverse (:meth:`GdnPrep._invert_blocks`) synchronises "the CTA", which here is one prep warpgroup (a
    CTA-wide barrier would wait for warpgroups that never arrive; a shared id would mix two prep warpgroups'
    threads)."""

    def __init__(self, bar):
        self.bar = bar

    def __enter__(self):
        self._sync = cute.arch.sync_threads
        orig, bar = cute.arch.barrier, self.bar

        def sync_threads(**kw):
            orig(barrier_id=bar, number_of_threads=PREP_THREADS, **kw)

        cute.arch.sync_threads = sync_threads
        return self

    def __exit__(self, *exc):
        cute.arch.sync_threads = self._sync
        return False


def _check_storage(nbytes: int, cfg_bytes: int) -> None:
    """The traced shared storage against the config's estimate (a plain Python check while the kernel is traced:
    a CTA over the limit would fail only at launch)."""
    if nbytes > min(SMEM_LIMIT, cfg_bytes):
        raise ValueError(f"the fused kernel's shared storage is {nbytes} B, over its config's {cfg_bytes} B or the "
                         f"{SMEM_LIMIT} B limit")


def _prep_sync(bar):
    """Named barrier ``bar`` over one prep warpgroup's 128 threads."""
    cute.arch.barrier(barrier_id=bar, number_of_threads=PREP_THREADS)


class GdnFusedSm90Kernel(_chunked.GdnChunkedSm90Kernel):
    """CuTe DSL fused SM90 chunked GDN (one kernel: a prep warpgroup and the wgmma consumer of
    :class:`~cutedsl_attn.sm90.gdn_chunked.GdnChunkedSm90Kernel`); see the module docstring.  Build with
    :func:`compile`."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.PREP_BYTES = cfg.prep_bytes
        self.P = cfg.tiles.prep_warpgroups
        self.THREADS = cfg.threads
        self.SMEM_BYTES = cfg.smem_bytes

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
                 mCu: cute.Tensor, mH0: cute.Tensor, mH0Idx: cute.Tensor, mHt: cute.Tensor, mHtIdx: cute.Tensor,
                 mO: cute.Tensor, scale: Float32, q_group: Int32, k_group: Int32, v_group: Int32, flags: Int32,
                 stream):
        C, K, S, dt = self.C, self.K, self.S, self.io
        K_MAJOR = cute.nvgpu.OperandMajorMode.K
        MN_MAJOR = cute.nvgpu.OperandMajorMode.MN
        rmem = warpgroup.OperandSource.RMEM
        # the consumer's MMAs and stage layouts, exactly as the two-kernel main kernel builds them
        mma_x = sm90_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, K_MAJOR, Float32, atom_layout_mnk=(1, 1, 1),
                                                  tiler_mn=(64, C), a_source=rmem)
        mma_s = sm90_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, MN_MAJOR, Float32, atom_layout_mnk=(1, 1, 1),
                                                  tiler_mn=(64, K), a_source=rmem)
        s_ck = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (64, C, K), dt, S)
        s_cc = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (64, C, C), dt, S)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, 2 * S]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(s_ck)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(s_ck)], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(s_ck)], 1024]
            sAqk: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(s_cc)], 1024]
            sU: cute.struct.Align[cute.struct.MemRange[cutlass.Int8, S * C * self.RU], 16]
            sF: cute.struct.Align[cute.struct.MemRange[Float32, S * (self.F_BYTES // 4)], 16]
            sP: cute.struct.Align[cute.struct.MemRange[cutlass.Int8, self.P * self.PREP_BYTES], 128]

        self.shared_storage = SharedStorage
        _check_storage(SharedStorage.size_in_bytes(), self.SMEM_BYTES)
        self.fused(mQ, mK, mV, mG, mBeta, mCu, mH0, mH0Idx, mHt, mHtIdx, mO, scale, q_group, k_group, v_group,
                   flags, s_ck, s_cc, mma_x, mma_s).launch(
            grid=(self.NVB * mO.shape[1], mCu.shape[0] - 1, 1), block=(self.THREADS, 1, 1),
            smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def fused(self, mQ, mK, mV, mG, mBeta, mCu, mH0, mH0Idx, mHt, mHtIdx, mO, scale: Float32, q_group: Int32,
              k_group: Int32, v_group: Int32, flags: Int32, s_ck: cute.ComposedLayout, s_cc: cute.ComposedLayout,
              mma_x: cute.TiledMma, mma_s: cute.TiledMma):
        """One CTA per (V-slice, output head, sequence): the first ``P`` warpgroups prep the chunks (warpgroup
        ``w`` chunks ``w, w + P, ..``), the last one walks them."""
        tidx, _, _ = cute.arch.thread_idx()
        bx, n, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        vb = bx % self.NVB
        ho = bx // self.NVB
        v0 = vb * self.BV
        bos = mCu[n]
        eos = mCu[n + 1]
        nch = (eos - bos + (self.C - 1)) // self.C
        # full[s]: the 128 threads of the prep warpgroup filling stage s arrive; empty[s]: the 128 consumer threads
        producers = pipeline.CooperativeGroup(pipeline.Agent.Thread, PREP_THREADS)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, 128 * self.NWG)
        pipe = pipeline.PipelineAsync.create(barrier_storage=storage.mbar.data_ptr(), num_stages=self.S,
                                             producer_group=producers, consumer_group=consumers, defer_sync=True)
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()
        if warp_idx < 4 * self.P:
            w = 0  # the prep warpgroup
            if const_expr(self.P > 1):
                cute.arch.setmaxregister_decrease(PREP_REGS)
                w = cute.arch.make_warp_uniform(warp_idx // 4)
            bar = prep_barrier_id(w)
            # chunk w is the ring's fill w (w < num_stages: the first pass, producer phase 1); the state then
            # steps over the other prep warpgroups' fills, P a chunk.  The thread index goes through an opaque mov
            # every chunk: the shared-memory addresses derived from it are recomputed in the loop instead of being
            # hoisted out of it and kept live (spilled) across the prep
            state = pipeline.PipelineState(self.S, Int32(w), Int32(w), Int32(1))
            for j in cutlass.range(w, nch, self.P, unroll=1):
                t0 = bos + j * self.C
                pipe.producer_acquire(state)
                self._prep_chunk(mQ, mK, mV, mG, mBeta, storage, state.index, t0, cutlass.min(eos - t0, self.C),
                                 ho, v0, scale, q_group, k_group, v_group, flags, ptx.opaque_i32(tidx - 128 * w),
                                 w, bar)
                cute.arch.fence_view_async_shared()  # generic st.shared -> the consumer's wgmma (async proxy)
                pipe.producer_commit(state)
                for _ in cutlass.range_constexpr(self.P):
                    state.advance()
        else:
            if const_expr(self.P > 1):
                cute.arch.setmaxregister_increase(CONSUMER_REGS)
            ctid = tidx - 128 * self.P
            wg = cute.arch.make_warp_uniform(ctid // 128)
            sQ = storage.sQ.get_tensor(s_ck.outer, swizzle=s_ck.inner)
            sK = storage.sK.get_tensor(s_ck.outer, swizzle=s_ck.inner)
            sW = storage.sW.get_tensor(s_ck.outer, swizzle=s_ck.inner)
            sAqk = storage.sAqk.get_tensor(s_cc.outer, swizzle=s_cc.inner)
            self._consume(mH0, mH0Idx, mHt, mHtIdx, mO, flags, sQ, sK, sW, sAqk, storage.sU.data_ptr().toint(),
                          storage.sF.data_ptr().toint(), pipe, mma_x, mma_s, n, ho, v0 + wg * 64, wg, bos, eos,
                          nch, ptx.opaque_i32(ctid % 128))

    # ================================================================== the prep warpgroup
    @cute.jit
    def _prep_chunk(self, mQ, mK, mV, mG, mBeta, storage, stage, t0, ln, ho, v0, scale, q_group, k_group, v_group,
                    flags, tid, w, bar):
        """The prep of the chunk of tokens ``t0 .. t0 + ln`` (``ln`` >= 1) into ring stage ``stage`` (acquired
        by the caller) by prep warpgroup ``w`` (thread ``tid`` of it, named barrier ``bar``): the
        steps and roundings of :meth:`GdnPrep.prep`, its outputs stored in shared memory in the layouts the
        consumer reads."""
        C, K, RK, RA, RU = self.C, self.K, self.RK, self.RA, self.RU
        lane = tid % 32
        warp = tid // 32
        g = lane // 4
        t = lane % 4
        tile_ck = C * K * 2
        st_q = storage.sQ.data_ptr().toint() + stage * tile_ck
        st_k = storage.sK.data_ptr().toint() + stage * tile_ck
        st_w = storage.sW.data_ptr().toint() + stage * tile_ck
        st_aqk = storage.sAqk.data_ptr().toint() + stage * (C * C * 2)
        st_u = storage.sU.data_ptr().toint() + stage * (C * RU)
        st_f = storage.sF.data_ptr().toint() + stage * self.F_BYTES
        sQ = storage.sP.data_ptr().toint() + w * self.PREP_BYTES
        sA = sQ  # A replaces Q once Aqk is written
        sK = sQ + C * max(RK, RA)
        sV = sK + C * RK
        sG = sV + C * RU
        sB = sG + C * 4
        sRq = sB + C * 4
        sRk = sRq + C * 4
        sBG = sRk + C * 4  # beta gamma
        qh = ho // q_group
        kh = ho // k_group
        vh = ho // v_group
        # every prep thread is done with the previous chunk's work rows before they are overwritten
        _prep_sync(bar)
        # the consumer's raw q / k tiles (zero past ln), then the prep's own rows
        self._load_qk_rows(mQ, st_q, t0, ln, qh, tid)
        self._load_qk_rows(mK, st_k, t0, ln, kh, tid)
        self._load_rows(mQ, sQ, RK, K, t0, ln, qh, tid, PREP_THREADS)
        self._load_rows(mK, sK, RK, K, t0, ln, kh, tid, PREP_THREADS)
        ptx.cp_async_commit()
        # V is first read by the U GEMM: it lands while Aqk, K K^T and the inverse are computed
        self._load_v_slice(mV, sV, t0, ln, vh, v0, tid)
        ptx.cp_async_commit()
        self._gates_to_smem(mG, mBeta, sG, sB, t0, ln, ho, flags, tid)
        ptx.cp_async_wait(1)
        _prep_sync(bar)

        # cumulative log2 decay (warp 0) and the l2 normalisers (every warp, its 16 rows of q and k)
        if warp == 0:
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
            ptx.st_shared_f32(sBG + (2 * lane) * 4, b2[0] * ptx.ex2(s - x1))
            ptx.st_shared_f32(sBG + (2 * lane + 1) * 4, b2[1] * ptx.ex2(s))
        self._normalise_rows(sQ, sRq, warp, lane)
        self._normalise_rows(sK, sRk, warp, lane)
        _prep_sync(bar)

        r0 = warp * 16
        gr = cute.make_rmem_tensor((2,), Float32)
        br = cute.make_rmem_tensor((2,), Float32)
        for h in cutlass.range_constexpr(2):
            gr[h] = ptx.ld_shared_f32(sG + (r0 + g + 8 * h) * 4)
            br[h] = ptx.ld_shared_f32(sB + (r0 + g + 8 * h) * 4)
        # Aqk -> the stage, then K K^T (one accumulator live at a time); then A -> sA (fp32, over Q)
        self._aqk_rows_smem(st_aqk, sQ, sK, sG, r0, scale, lane)
        cute.arch.sync_warp()  # the K K^T loads stay below: the two accumulators are not live at once
        acc = cute.make_rmem_tensor(((C // 8) * 4,), Float32)
        for i in cutlass.range_constexpr((C // 8) * 4):
            acc[i] = Float32(0.0)
        self._gemm_nt(acc, sK, RK, r0, sK, RK, 0, C // 8, K // 16, lane)
        _prep_sync(bar)  # every warp is done with Q
        for i in cutlass.range_constexpr(C // 8):
            if i <= 2 * warp + 1:  # A right of the diagonal block is never read (the inverse writes T^T there)
                self._a_tile(sA, sG, acc, br, gr, r0, i, g, t)
        _prep_sync(bar)

        # T = (I + A)^-1 by 16 x 16 blocks (fp32, T^T left in sA), synchronising the prep warpgroup only
        self._invert_blocks_wg(sA, tid, bar)
        ptx.cp_async_wait(0)
        _prep_sync(bar)

        # W = (T diag(beta gamma)) K -> the stage's swizzled tile; U's V-slice = (T diag(beta)) V -> its rows
        for nh in cutlass.range_constexpr(K // 64):
            accw = cute.make_rmem_tensor((32,), Float32)
            for i in cutlass.range_constexpr(32):
                accw[i] = Float32(0.0)
            self._gemm_t_nn(accw, sA, sBG, sK, RK, r0, nh * 64, warp, lane)
            self._store_slab_sw(st_w, accw, nh * 64, r0, g, t)
        for nh in cutlass.range_constexpr(self.BV // 64):
            accu = cute.make_rmem_tensor((32,), Float32)
            for i in cutlass.range_constexpr(32):
                accu[i] = Float32(0.0)
            self._gemm_t_nn(accu, sA, sB, sV, RU, r0, nh * 64, warp, lane)
            self._store_slab_rows(st_u, accu, RU, nh * 64, r0, g, t)

        # row factors: scale rq gamma (the Q S^T rows), rk gamma_last / gamma (the state-update rows), gamma_last
        if tid < C:
            gl = ptx.ld_shared_f32(sG + (ln - 1) * 4)
            gt = ptx.ld_shared_f32(sG + tid * 4)
            ok = tid < ln
            qf = cutlass.select_(ok, scale * ptx.ld_shared_f32(sRq + tid * 4) * ptx.ex2(gt), Float32(0.0))
            kf = cutlass.select_(ok, ptx.ld_shared_f32(sRk + tid * 4) * ptx.ex2(gl - gt), Float32(0.0))
            ptx.st_shared_f32(st_f + tid * 4, qf)
            ptx.st_shared_f32(st_f + (C + tid) * 4, kf)
            ptx.st_shared_f32(st_f + (2 * C + tid) * 4, ptx.ex2(gl))

    def _invert_blocks_wg(self, sA, tid, bar):
        """:meth:`GdnPrep._invert_blocks` traced with its barriers over the prep warpgroup (a plain Python
        method: runs while the kernel is traced)."""
        with _PrepWarpgroupBarriers(bar):
            self._invert_blocks(sA, tid)

    @cute.jit
    def _load_v_slice(self, mV, s_dst, t0, ln, vh, v0, tid):
        """cp.async columns ``v0 .. v0 + tile_v`` of rows ``t0 .. t0 + C`` of head ``vh`` of ``mV`` ``[T, H, V]``
        into padded rows (pitch ``RU``), zero past ``ln`` (the source address stays in bounds: row ``t0``)."""
        cpr = self.BV // 8
        base = mV.iterator.toint()
        for it in cutlass.range_constexpr((self.C * cpr) // PREP_THREADS):
            idx = it * PREP_THREADS + tid
            r = idx // cpr
            col = idx % cpr
            ok = r < ln
            tok = cutlass.select_(ok, t0 + r, t0)
            goff = Int64(tok) * mV.stride[0] + Int64(vh) * mV.stride[1] + v0 + col * 8
            ptx.cp_async_16(s_dst + r * self.RU + col * 16, base + goff * 2, cutlass.select_(ok, 16, 0))

    @cute.jit
    def _aqk_rows_smem(self, s_aqk, sQ, sK, sG, r0, scale, lane):
        """Rows ``r0 .. r0 + 16`` of ``Aqk = scale tril(Q K^T . Gamma)`` (diagonal kept) -> the stage's swizzled
        (C, C) tile, io dtype: :meth:`GdnPrep._aqk_rows`'s values, stored where the consumer reads them."""
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
                    ptx.st_shared_b32(s_aqk + sw128_offset(r, i, CHUNK) + 4 * t, ptx.pack2(v0, v1, io))
            else:  # the tile is above the slab's diagonal: zeros, no decays to compute
                for h in cutlass.range_constexpr(2):
                    ptx.st_shared_b32(s_aqk + sw128_offset(r0 + g + 8 * h, i, CHUNK) + 4 * t, Int32(0))

    @cute.jit
    def _store_slab_sw(self, s_tile, acc, n0: cutlass.Constexpr, r0, g, t):
        """A 16-row slab of eight n8 C-fragment tiles -> rows ``r0 ..``, columns ``n0 .. n0 + 64`` of a swizzled
        (C, D) io-dtype tile (the layout :func:`~cutedsl_attn.common.smem.sw128_offset` describes)."""
        for i in cutlass.range_constexpr(8):
            for h in cutlass.range_constexpr(2):
                ptx.st_shared_b32(s_tile + sw128_offset(r0 + g + 8 * h, n0 // 8 + i, CHUNK) + 4 * t,
                                  ptx.pack2(acc[4 * i + 2 * h], acc[4 * i + 2 * h + 1], self.io))

    @cute.jit
    def _store_slab_rows(self, s_rows, acc, pitch: cutlass.Constexpr, n0: cutlass.Constexpr, r0, g, t):
        """A 16-row slab of eight n8 C-fragment tiles -> rows ``r0 ..``, columns ``n0 .. n0 + 64`` of padded
        io-dtype rows of ``pitch`` bytes."""
        for i in cutlass.range_constexpr(8):
            for h in cutlass.range_constexpr(2):
                ptx.st_shared_b32(s_rows + (r0 + g + 8 * h) * pitch + (n0 + 8 * i + 2 * t) * 2,
                                  ptx.pack2(acc[4 * i + 2 * h], acc[4 * i + 2 * h + 1], self.io))


def _fake_args(p: GdnProblem) -> tuple:
    """Fake tensors in the compiled function's order: those of
    :func:`cutedsl_attn.compile.fake.gdn_chunked_tensors` less the chunk plan and the scratch."""
    sdt = cutlass.BFloat16 if p.state_dtype == "bfloat16" else Float32
    t = gdn_chunked_tensors(element_type(p.dtype), sdt, p.head_dim_k, p.head_dim_v, CHUNK)
    q, k, v, g, beta, cu, _chunks, _chunk_off, h0, h0_idx, ht, ht_idx, o = t[:13]
    return q, k, v, g, beta, cu, h0, h0_idx, ht, ht_idx, o


def compile(cfg: Config, *, keep_ptx_dir: str | None = None, keep_cubin: bool = False):
    """Compile :class:`GdnFusedSm90Kernel` (one kernel) for ``cfg`` from fake tensors (no GPU needed).  Returns
    the tvm-ffi callable; call it through :func:`launch`.  Raises ValueError for ``keep_cubin`` without a
    ``keep_ptx_dir``."""
    from cutlass.cute.runtime import make_fake_stream

    opts = compile_options(cfg.problem.arch, keep_ptx_dir=keep_ptx_dir, keep_cubin=keep_cubin)
    return cute.compile(GdnFusedSm90Kernel(cfg), *_fake_args(cfg.problem), Float32(1.0), Int32(1), Int32(1),
                        Int32(1), Int32(0), make_fake_stream(use_tvm_ffi_env_stream=True), options=opts)


def launch(fn, cfg: Config, args: GdnArgs) -> None:
    """Launch ``fn`` (from :func:`compile`) on torch's current stream: one kernel, no chunk plan and no scratch
    (each CTA walks its sequence's chunks from ``cu_seqlens``)."""
    fn(args.q, args.k, args.v, args.g, args.beta, args.cu_seqlens, args.initial_state, args.initial_state_indices,
       args.output_state, args.output_state_indices, args.output, args.scale, args.q_group, args.k_group,
       args.v_group, args.flags)
