"""Chunked gated delta rule (GDN) prefill for SM90 (Hopper): a prep kernel (:func:`default_tiles` picks the SM90
one on ``wgmma``, :mod:`cutedsl_attn.sm90.gdn_prep`; ``Tiles.prep = 0``, the field's default, the shared
``mma.sync`` one), then a main kernel on ``wgmma`` with the fp32 state in a consumer warpgroup's accumulator
registers.

Per chunk of ``C = 64`` tokens (the prep kernel's scratch, :mod:`cutedsl_attn.common.gdn_prep`: ``W``, ``U``,
``Aqk`` in the io dtype, the fp32 row factors ``qf = scale rq gamma``, ``kf = rk gamma_last / gamma`` and
``gamma_last``), each consumer warpgroup owns 64 state rows ``S [64 (V), K]`` and computes, transposed so that
every product has the state rows as its M dimension::

    X^T  = S W^T                       (M = 64 state rows, N = C, k = K; A = S from registers)
    Y^T  = S Q^T                       (the same, B = Q)
    V'^T = U^T - X^T                   (registers)
    O^T  = Y^T diag(qf) + V'^T Aqk^T   (A = V'^T from registers, B = Aqk)
    S   <- gamma_last S + (V'^T diag(kf)) K   (A from registers, B = K read MN-major)

so ``S`` (rounded to the io dtype for the MMA, as fla and FlashInfer do), ``V'^T`` and ``V'^T diag(kf)`` are
A operands straight from the accumulator registers (the accumulator and the 16-bit A fragment share their
register order) and no state copy goes through shared memory.  Per chunk a warpgroup issues
``2 K / 16 + 2 C / 16`` wgmma instructions (24 at K = 128).

The CTA is a producer warpgroup (``cp.async`` of the next chunks' q / k rows, zero past the sequence, and of the
scratch blocks into the 128-byte-swizzled layouts wgmma reads, on a ring of ``num_stages`` stages with
mbarriers; ``Tiles.tma = 1``: W, Aqk and full chunks' q / k rows as TMA boxes on the same mbarriers, a tail
chunk's rows ``cp.async``, which zero-fills past the sequence inside a ragged batch where TMA would not) and
``tile_v / 64`` consumer warpgroups; one CTA per (V-slice of ``tile_v`` rows, output head, sequence), or
(``Tiles.persistent``, :mod:`cutedsl_attn.sm90.gdn_persistent`) a grid of about one CTA an SM, each walking
its items longest first on one ring.  A sequence of length 0 writes its initial state (zeros without one) as its
final state.  Each CTA reads its state slice before it writes it and no two CTAs share one, so an in-place pool
update is race-free.
Served: what the portable chunked kernel serves (GDN, scalar gates, K and V in 64 / 128, a V-major fp32 / bf16
state), compiled for ``sm_90a`` only; Gated DeltaProduct as GDN on its expanded timeline, either on the dispatch's
expanded copies of q / g / the output or (``Config.expand_rows``) with the rows mapped in the kernels
(:mod:`cutedsl_attn.sm90.gdn_rows`).  The per-channel members (KDA, GDN-2) run this main kernel behind their own
prep (:mod:`cutedsl_attn.sm90.kda_chunked`: a compile-time branch decays the state per K column).
The two kernels also compile apart (:func:`compile_prep`, :func:`compile_main` with a
:class:`~cutedsl_attn.planning.gdn_cp.MainRun`): the context-parallel path runs one prep and then the main kernel
alone several times on its scratch, two of those runs computing final states only (no q / Aqk reads, no outputs;
the transition run without U).
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
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..common import ptx
from ..common.dtypes import element_type
from ..common.gdn_launch import compile_kernel, launch_main, launch_prep, prep_tensors  # noqa: F401
from ..common.smem import sw128_offset, transpose_view
from ..common.gdn_prep import (
    PREP_CTAS_PER_SM, PREP_SMEM_CARVEOUT, PREP_THREADS, prep_smem_bytes, row_pitches,
)
from ..compile.tiles import override_int_fields
from ..planning import gdn_cp
from ..planning.gdn import (
    CHUNK, FLAG_HAS_INITIAL_STATE, FLAG_INITIAL_INDICES, FLAG_OUTPUT_INDICES, FLAG_WRITE_STATE, MAX_HOUSEHOLDER,
    GdnProblem,
)
from ..planning.gdn_cp import MainRun
from .gdn_loads import GdnSm90Loads
from .gdn_persistent import GdnSm90PlanCall, GdnSm90Persistent
from .gdn_prep import GdnPrepSm90
from .gdn_rows import compile_expanded, launch  # noqa: F401

NAME = "gdn_chunked_sm90"
#: cache names of the split entry points (the prep alone, the main kernel alone: :func:`compile_prep`,
#: :func:`compile_main`), which the context-parallel path launches once and several times on one scratch
NAME_PREP = NAME + "_prep"
NAME_MAIN = NAME + "_main"
ARCH = "sm_90a"
SMEM_LIMIT = 227 * 1024
# two consumer warpgroups: registers a thread after setmaxnreg (one consumer warpgroup: 256 threads, no rebalancing)
CONSUMER_REGS = 232
PRODUCER_REGS = 40  # the cp.async address arithmetic of rolled loops

MAX_PERSISTENT_CTAS = 65535  # Tiles.persistent as a CTA cap
SM_SMEM_BYTES = 228 * 1024  # shared memory an SM (1 KiB of it reserved a CTA)
MAIN_MIN_REGS = 168  # registers a main-kernel thread takes at the least (ptxas, the served configurations)


@dataclass(frozen=True)
class Tiles:
    """What the SM90 chunked kernel's main CTA chooses: ``tile_v`` state rows (V-slice) it owns, 64 per consumer
    warpgroup (64 or 128), ``num_stages`` of the chunk ring (2 or 3), and ``tma``: 0 loads every block with
    ``cp.async``, 1 loads W, Aqk and the q / k rows of full chunks with TMA boxes (a sequence's tail chunk keeps
    ``cp.async``, which zero-fills its rows past the sequence).  ``persistent``: 0 one CTA per work item
    (V-slice, output head, sequence); 1 a grid of ``min(items, num_sms * Config.main_ctas_per_sm)`` CTAs, each
    walking its share of the items longest first (:func:`~cutedsl_attn.planning.gdn.persistent_walk`);
    ``n >= 2`` the same with at most ``n`` CTAs (a fixed grid: several items a CTA at any size).  ``prep``: 0 the
    shared prep kernel (:mod:`cutedsl_attn.common.gdn_prep`, ``mma.sync``), 1 the SM90 prep kernel
    (:mod:`cutedsl_attn.sm90.gdn_prep`, the chunk products on ``wgmma``); both write the same scratch.

    Raises TypeError for a non-int field, ValueError for another value.
    """

    tile_v: int = 128
    num_stages: int = 2
    tma: int = 0
    persistent: int = 0
    prep: int = 0

    def __post_init__(self):
        for name in ("tile_v", "num_stages", "tma", "persistent", "prep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {v!r}")
        if self.tile_v not in (64, 128):
            raise ValueError(f"tile_v must be 64 or 128, got {self.tile_v}")
        if self.num_stages not in (2, 3):
            raise ValueError(f"num_stages must be 2 or 3, got {self.num_stages}")
        if self.tma not in (0, 1):
            raise ValueError(f"tma must be 0 or 1, got {self.tma}")
        if not 0 <= self.persistent <= MAX_PERSISTENT_CTAS:
            raise ValueError(f"persistent must be in [0, {MAX_PERSISTENT_CTAS}], got {self.persistent}")
        if self.prep not in (0, 1):
            raise ValueError(f"prep must be 0 or 1, got {self.prep}")


TUNING_FIELDS = tuple(f.name for f in dataclasses.fields(Tiles))


def unsupported_reason(problem: GdnProblem) -> str | None:
    """Why the SM90 chunked kernel cannot serve ``problem``, or None.  It serves GDN prefill (scalar gates, one
    update a token, a V-major state, K and V in 64 / 128) on ``sm_90a``; the portable chunked kernel serves the
    same problems on every arch, the recurrent kernel the rest of the family.

    Raises TypeError when ``problem`` is not a GdnProblem.
    """
    if not isinstance(problem, GdnProblem):
        raise TypeError(f"problem must be a GdnProblem, got {type(problem).__name__}")
    if problem.arch != ARCH:
        return (f"arch {problem.arch}: the SM90 chunked kernel is built for {ARCH} only (the portable chunked "
                "kernel serves GDN prefill on every arch)")
    if problem.gate_per_channel or problem.erase_write_gates or problem.num_householder != 1:
        return "the SM90 chunked kernel serves GDN (scalar gates, one update a token) only"
    if problem.state_k_major:
        return "the SM90 chunked kernel reads and writes a V-major state only"
    if problem.decode:
        return "the decode step (a few tokens a sequence) runs the recurrent kernel"
    if problem.head_dim_k not in (64, 128) or problem.head_dim_v not in (64, 128):
        return f"head dims {problem.head_dim_k}/{problem.head_dim_v}: served K, V in 64, 128"
    return None


@dataclass(frozen=True)
class Config:
    """The SM90 chunked kernel's compile key: ``Config(problem, tiles, expand_rows)``.

    ``expand_rows`` n > 1: the problem runs on an expanded timeline of n rows a token (Gated DeltaProduct): k /
    v / beta and ``cu_seqlens`` (n times the tokens' offsets) on it, q / g / the output on the tokens' timeline,
    the rows mapped in the kernels (:mod:`cutedsl_attn.sm90.gdn_rows`); it needs ``tma = 0``, ``persistent = 0``
    and the SM90 prep (``prep = 1``).

    Raises TypeError for a ``tiles`` of another type or a non-int ``expand_rows``, ValueError with
    :func:`unsupported_reason`'s reason, when ``tile_v`` does not divide ``head_dim_v``, the ring exceeds shared
    memory, or ``expand_rows`` is outside ``[1, MAX_HOUSEHOLDER]`` or > 1 with tiles it does not support.
    """

    problem: GdnProblem
    tiles: Tiles
    expand_rows: int = 1

    def __post_init__(self):
        if not isinstance(self.tiles, Tiles):
            raise TypeError(f"tiles must be a gdn_chunked_sm90 Tiles, got {type(self.tiles).__name__}")
        n = self.expand_rows
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"expand_rows must be an int, got {n!r}")
        if not 1 <= n <= MAX_HOUSEHOLDER:
            raise ValueError(f"expand_rows must be in [1, {MAX_HOUSEHOLDER}], got {n}")
        t = self.tiles
        if n > 1 and (t.tma or t.persistent or t.prep != 1):
            raise ValueError(f"expand_rows {n} needs tma = 0, persistent = 0 and prep = 1, got {t}")
        reason = unsupported_reason(self.problem)
        if reason is not None:
            raise ValueError(f"the SM90 chunked GDN kernel cannot serve this problem: {reason}")
        if self.problem.head_dim_v % self.tiles.tile_v:
            raise ValueError(f"tile_v {self.tiles.tile_v} must divide head_dim_v {self.problem.head_dim_v}")
        if self.main_smem_bytes > SMEM_LIMIT:
            raise ValueError(f"tile_v {self.tiles.tile_v} x num_stages {self.tiles.num_stages} needs "
                             f"{self.main_smem_bytes} B of shared memory (> {SMEM_LIMIT})")

    @property
    def arch(self) -> str:
        return self.problem.arch

    @property
    def num_wg(self) -> int:
        """Consumer warpgroups: 64 state rows each."""
        return self.tiles.tile_v // 64

    @property
    def row_u(self) -> int:
        """Bytes per shared row of U's V-slice (16-byte pad: the lanes' column reads hit distinct banks)."""
        return 2 * self.tiles.tile_v + 16

    @property
    def stage_bytes(self) -> int:
        c, k = CHUNK, self.problem.head_dim_k
        return 3 * c * k * 2 + c * c * 2 + c * self.row_u + 3 * c * 4

    @property
    def main_smem_bytes(self) -> int:
        """The ring (each swizzled buffer 1 KiB aligned), the mbarriers and the allocator's alignment slack."""
        return self.tiles.num_stages * self.stage_bytes + 2 * 1024

    @property
    def main_ctas_per_sm(self) -> int:
        """Main CTAs an SM holds (the persistent grid's multiple of the SM count): what shared memory and the
        register file (:data:`MAIN_MIN_REGS` a thread) fit, at least one."""
        regs = 65536 // (128 * (1 + self.num_wg) * MAIN_MIN_REGS)
        return max(1, min(regs, SM_SMEM_BYTES // (self.main_smem_bytes + 1024)))


@dataclass(frozen=True)
class MainConfig(gdn_cp.MainConfig):
    """The compile key of :func:`compile_main` (:class:`cutedsl_attn.planning.gdn_cp.MainConfig` of this
    kernel's :class:`Config`)."""

    CONFIG = Config
    KERNEL = NAME


def default_tiles(problem: GdnProblem, *, num_sms: int, chains: int | None = None) -> Tiles:
    """The default tiles for ``chains`` = N * HO (sequence, head) chains on ``num_sms`` SMs (None: many).
    Measured on the H200 (K = V = 128):

    ====================================  =====================================================================
    ``head_dim_v == 64``                  64 state rows (one consumer warpgroup)
    ``head_dim_k == 64``                  64 rows: two warpgroups spill a few registers at K = 64 (ptxas drops
                                          the setmaxnreg rebalancing and keeps 168 a thread)
    ``4 chains >= 3 num_sms``             128 rows: two consumer warpgroups share the chunk's loads, and three
                                          quarters of a wave of them already keeps the memory system busy
    fewer chains                          64 rows: twice the CTAs of a chain (faster with one long sequence
                                          of few heads)
    every problem                         the SM90 prep on wgmma (``prep = 1``): faster than the shared prep,
                                          the same scratch bit for bit
    ====================================  =====================================================================
    """
    # the measurements: perf/RESULTS.md, "Gated delta rule family"
    if 64 in (problem.head_dim_k, problem.head_dim_v) or (chains is not None and chains * 4 < num_sms * 3):
        return Tiles(tile_v=64, num_stages=2, prep=1)
    return Tiles(tile_v=128, num_stages=2, prep=1)


def override_tiles(tiles: Tiles, items: dict[str, str]) -> Tiles:
    """``tiles`` with the fields named in ``items`` (field name -> decimal text) replaced; ValueError naming the key
    for an unknown field or a non-integer value, and the Tiles checks for a refused value."""
    return override_int_fields(tiles, items)


class GdnChunkedSm90Kernel(GdnPrepSm90, GdnSm90Loads, GdnSm90Persistent):
    """CuTe DSL SM90 chunked GDN (a prep kernel, ``default_tiles``' the SM90 wgmma one, + the wgmma main kernel);
    see the module docstring.
    Build with :func:`compile`."""

    prep_heads_fastest = True  # the prep's 1-D grid: GVA heads sharing q / k rows run side by side

    def __init__(self, cfg: Config):
        p = cfg.problem
        self.cfg = cfg
        self.io = element_type(p.dtype)
        self.bf16_state = p.state_dtype == "bfloat16"
        self.K, self.V, self.C = p.head_dim_k, p.head_dim_v, CHUNK
        self.RK, self.RV, self.RC, self.RA = row_pitches(p.head_dim_k, p.head_dim_v)
        self.log_gate = p.gate_domain == "log"
        self.l2norm = p.use_qk_l2norm
        self.BV = cfg.tiles.tile_v
        self.NVB = p.head_dim_v // self.BV
        self.NWG = cfg.num_wg
        self.S = cfg.tiles.num_stages
        self.RU = cfg.row_u
        # the per-channel subclass (sm90.kda_chunked) decays the state per K column; F grows by K gates
        self.per_channel = False
        self.F_BYTES = 3 * CHUNK * 4
        # a main-only launch (GdnChunkedSm90MainKernel) may skip the outputs and the q / Aqk / U reads
        self.write_output = True
        self.zero_u = False
        # the fused kernel's Tiles has no TMA option (KDA's has): cp.async loads
        self.tma = getattr(cfg.tiles, "tma", 0) == 1
        self.persistent = getattr(cfg.tiles, "persistent", 0) > 0
        # the subclasses' Tiles (KDA, the fused kernel) have no prep option: they launch their own prep
        self.use_prep_sm90 = getattr(cfg.tiles, "prep", 0) == 1
        # the subclasses' configs (KDA, the fused kernel) have no expanded timeline
        self.expand_rows = getattr(cfg, "expand_rows", 1)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
                 mCu: cute.Tensor, mChunks: cute.Tensor, mChunkOff: cute.Tensor, mH0: cute.Tensor,
                 mH0Idx: cute.Tensor, mHt: cute.Tensor, mHtIdx: cute.Tensor, mO: cute.Tensor, mW: cute.Tensor,
                 mU: cute.Tensor, mAqk: cute.Tensor, mF: cute.Tensor, scale: Float32, q_group: Int32,
                 k_group: Int32, v_group: Int32, flags: Int32, stream):
        self._launch_prep(mQ, mK, mV, mG, mBeta, mChunks, mO, mW, mU, mAqk, mF, scale, q_group, k_group, v_group,
                          flags, stream)
        self._launch_main(mQ, mK, mCu, mChunkOff, mH0, mH0Idx, mHt, mHtIdx, mO, mW, mU, mAqk, mF, q_group, k_group,
                          flags, stream)

    @cute.jit
    def _launch_prep(self, mQ, mK, mV, mG, mBeta, mChunks, mO, mW, mU, mAqk, mF, scale, q_group, k_group, v_group,
                     flags, stream):
        """Launch the prep kernel (traced inside ``__call__``): one CTA per (chunk, output head); the shared one,
        or (``Tiles.prep = 1``) the SM90 one on wgmma."""
        if const_expr(self.use_prep_sm90):
            self.launch_prep_sm90(mQ, mK, mV, mG, mBeta, mChunks, mW, mU, mAqk, mF, scale, q_group, k_group,
                                  v_group, flags, stream)
        else:
            self.prep(mQ, mK, mV, mG, mBeta, mChunks, mW, mU, mAqk, mF, scale, q_group, k_group, v_group,
                      flags).launch(grid=(mChunks.shape[0] * mO.shape[1], 1, 1), block=(PREP_THREADS, 1, 1),
                                    smem=prep_smem_bytes(self.K, self.V), stream=stream,
                                    min_blocks_per_mp=PREP_CTAS_PER_SM, preferred_smem_carveout=PREP_SMEM_CARVEOUT)

    @cute.jit
    def _launch_main(self, mQ, mK, mCu, mChunkOff, mH0, mH0Idx, mHt, mHtIdx, mO, mW, mU, mAqk, mF, q_group, k_group,
                     flags, stream, mPlan=None, num_ctas=None):
        """Launch the main kernel (traced inside ``__call__``): the MMAs, the swizzled stage layouts, the shared
        storage; ``mQ`` / ``mK`` are the q / k the chunk products read (the per-channel prep's Qg / Kd there);
        ``mPlan`` / ``num_ctas``: the persistent grid's sequence order
        (:func:`~cutedsl_attn.planning.gdn.plan_sequences`) and size (``Tiles.persistent``)."""
        if const_expr(self.persistent and mPlan is None):
            raise ValueError("Tiles.persistent needs the plan tensor: build the kernel with compile / compile_main")
        C, K, S, dt = self.C, self.K, self.S, self.io
        K_MAJOR = cute.nvgpu.OperandMajorMode.K
        MN_MAJOR = cute.nvgpu.OperandMajorMode.MN
        rmem = warpgroup.OperandSource.RMEM
        # X^T, Y^T, O^T: (64 state rows, C) from an A in registers and a K-major B (W, Q, Aqk rows)
        mma_x = sm90_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, K_MAJOR, Float32, atom_layout_mnk=(1, 1, 1),
                                                  tiler_mn=(64, C), a_source=rmem)
        # the state update: (64 state rows, K) over the chunk's tokens; B = the K rows read MN-major
        mma_s = sm90_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, MN_MAJOR, Float32, atom_layout_mnk=(1, 1, 1),
                                                  tiler_mn=(64, K), a_source=rmem)
        # (C, K) and (C, C) row-major tiles, the K_SW128 atom (as sw128_offset writes them), one per stage
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

        self.shared_storage = SharedStorage
        tma_args = self._tma_atoms(mQ, mK, mW, mAqk, s_ck, s_cc)
        grid = (self.NVB * mO.shape[1], mCu.shape[0] - 1, 1)
        if const_expr(self.persistent):
            grid = (num_ctas, 1, 1)
        self.main(mQ, mK, mCu, mChunkOff, mH0, mH0Idx, mHt, mHtIdx, mO, mW, mU, mAqk, mF, q_group, k_group, flags,
                  s_ck, s_cc, mma_x, mma_s, *tma_args, mPlan).launch(
            grid=grid, block=(128 * (1 + self.NWG), 1, 1), smem=SharedStorage.size_in_bytes(), stream=stream)

    def _tma_atoms(self, mQ, mK, mW, mAqk, s_ck, s_cc):
        """The main kernel's TMA atoms and coordinate tensors (called while :meth:`_launch_main` traces): with
        ``Tiles.tma = 1`` ``(atom_Q, tma_Q, atom_K, tma_K, atom_W, tma_W, atom_A, tma_A)``, one box = one stage's
        (C, K) or (C, C) tile; eight Nones otherwise.  The per-channel subclass's Qg / Kd ([T, HO, K], as q / k)
        take the same atoms."""
        C, K = self.C, self.K
        tma_args = (None,) * 8
        if const_expr(self.tma):
            g2s = cpasync.CopyBulkTensorTileG2SOp()
            box_ck, box_cc = cute.select(s_ck, mode=[0, 1]), cute.select(s_cc, mode=[0, 1])
            # q / k as (tokens, K, heads), the scratch as (rows, cols, heads, chunks): one box = one stage tile
            mQ_t = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[0, 2, 1]))
            mK_t = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[0, 2, 1]))
            mW_t = cute.make_tensor(mW.iterator, cute.select(mW.layout, mode=[2, 3, 1, 0]))
            mA_t = cute.make_tensor(mAqk.iterator, cute.select(mAqk.layout, mode=[2, 3, 1, 0]))
            tma_args = (*cpasync.make_tiled_tma_atom(g2s, mQ_t, box_ck, (C, K), 1),
                        *cpasync.make_tiled_tma_atom(g2s, mK_t, box_ck, (C, K), 1),
                        *cpasync.make_tiled_tma_atom(g2s, mW_t, box_ck, (C, K), 1),
                        *cpasync.make_tiled_tma_atom(g2s, mA_t, box_cc, (C, C), 1))
        return tma_args

    # ================================================================== main kernel
    @cute.kernel
    def main(self, mQ, mK, mCu, mChunkOff, mH0, mH0Idx, mHt, mHtIdx, mO, mW, mU, mAqk, mF, q_group: Int32,
             k_group: Int32, flags: Int32, s_ck: cute.ComposedLayout, s_cc: cute.ComposedLayout,
             mma_x: cute.TiledMma, mma_s: cute.TiledMma, tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_W, tma_W,
             tma_atom_A, tma_A, mPlan):
        """One CTA per (V-slice, output head, sequence), or (``Tiles.persistent``) per share of the walk over
        ``mPlan``'s order, its items one after the other on one ring: warpgroup 0 loads, the others consume."""
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        if const_expr(self.persistent):
            walk = self._walk(mCu, mO, bx)
        else:
            n = by
            vb = bx % self.NVB
            ho = bx // self.NVB
            v0 = vb * self.BV
            bos = mCu[n]
            eos = mCu[n + 1]
            c0 = mChunkOff[n]
            nch = mChunkOff[n + 1] - c0
        # every producer thread arrives when its cp.async copies land (noinc); every consumer thread releases
        # (with TMA, one more arrival: the elected thread's arrive.expect_tx of the stage's TMA bytes)
        producers = pipeline.CooperativeGroup(pipeline.Agent.Thread, 128 + int(self.tma))
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, 128 * self.NWG)
        pipe = pipeline.PipelineCpAsync.create(barrier_storage=storage.mbar.data_ptr(), num_stages=self.S,
                                               producer_group=producers, consumer_group=consumers, defer_sync=True)
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()
        tma = (tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_W, tma_W, tma_atom_A, tma_A)
        if warp_idx < 4:
            if const_expr(self.NWG > 1):  # 384 threads: 168 registers each at launch
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if const_expr(self.persistent):
                # both roles walk the same items, so the ring's state at an item's start follows from the chunks
                # before it (no hand-over between the warpgroups)
                done = Int32(0)
                for r in cutlass.range(walk[0], unroll=1):
                    _n, h_i, v_i, bos_i, eos_i, c_i, nch_i = self._walk_item(mPlan, mCu, mChunkOff, walk, r, bx)
                    self._produce(mQ, mK, mW, mU, mAqk, mF, storage, pipe, self._ring_state(done, 1), c_i, nch_i,
                                  bos_i, eos_i, h_i, v_i, q_group, k_group, tidx, warp_idx, s_ck, s_cc, *tma)
                    done += nch_i
            else:
                self._produce(mQ, mK, mW, mU, mAqk, mF, storage, pipe,
                              pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.S), c0, nch, bos,
                              eos, ho, v0, q_group, k_group, tidx, warp_idx, s_ck, s_cc, *tma)
        else:
            if const_expr(self.NWG > 1):
                cute.arch.setmaxregister_increase(CONSUMER_REGS)
            ctid = tidx - 128
            wg = cute.arch.make_warp_uniform(ctid // 128)
            sQ = storage.sQ.get_tensor(s_ck.outer, swizzle=s_ck.inner)
            sK = storage.sK.get_tensor(s_ck.outer, swizzle=s_ck.inner)
            sW = storage.sW.get_tensor(s_ck.outer, swizzle=s_ck.inner)
            sAqk = storage.sAqk.get_tensor(s_cc.outer, swizzle=s_cc.inner)
            if const_expr(self.persistent):
                done = Int32(0)
                for r in cutlass.range(walk[0], unroll=1):
                    n_i, h_i, v_i, bos_i, eos_i, _c, nch_i = self._walk_item(mPlan, mCu, mChunkOff, walk, r, bx)
                    self._consume(mH0, mH0Idx, mHt, mHtIdx, mO, flags, sQ, sK, sW, sAqk,
                                  storage.sU.data_ptr().toint(), storage.sF.data_ptr().toint(), pipe, mma_x, mma_s,
                                  n_i, h_i, v_i + wg * 64, wg, bos_i, eos_i, nch_i, ptx.opaque_i32(ctid % 128),
                                  self._ring_state(done, 0))
                    done += nch_i
            else:
                self._consume(mH0, mH0Idx, mHt, mHtIdx, mO, flags, sQ, sK, sW, sAqk, storage.sU.data_ptr().toint(),
                              storage.sF.data_ptr().toint(), pipe, mma_x, mma_s, n, ho, v0 + wg * 64, wg, bos, eos,
                              nch, ptx.opaque_i32(ctid % 128))

    @cute.jit
    def _produce(self, mQ, mK, mW, mU, mAqk, mF, storage, pipe, state, c0, nch, bos, eos, ho, v0, q_group, k_group,
                 tidx, warp_idx, s_ck, s_cc, tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_W, tma_W, tma_atom_A,
                 tma_A):
        """Producer warpgroup: load chunks ``c0 .. c0 + nch`` (tokens ``bos .. eos``) of head ``ho``'s V-slice
        ``v0`` into the ring from pipeline state ``state`` on."""
        for j in cutlass.range(nch, unroll=1):
            pipe.producer_acquire(state)
            t0 = bos + j * self.C
            if const_expr(self.tma):
                self._load_chunk_tma(mQ, mK, mW, mU, mF, storage, pipe, state, c0 + j, t0,
                                     cutlass.min(eos - t0, self.C), ho // q_group, ho // k_group, ho, v0, tidx,
                                     warp_idx, s_ck, s_cc, tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_W,
                                     tma_W, tma_atom_A, tma_A)
            else:
                self._load_chunk(mQ, mK, mW, mU, mAqk, mF, storage, state.index, c0 + j, t0,
                                 cutlass.min(eos - t0, self.C), ho // q_group, ho // k_group, ho, v0, tidx)
            pipe.producer_commit(state)
            state.advance()

    @cute.jit
    def _gemm(self, tiled_mma, acc, tA, tB, zero_init: cutlass.Constexpr):
        """Issue one warpgroup GEMM (k-blocks unrolled) and commit it; the caller waits."""
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for k in cutlass.range_constexpr(cute.size(tA.shape[2])):
            cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def _to16(self, acc, frag):
        """fp32 accumulator -> the 16-bit A fragment of the next GEMM (same register order), two values a cvt."""
        n = cute.size(acc)
        flat = cute.make_tensor(acc.iterator, cute.make_layout(n))
        words = cute.make_tensor(cute.recast_ptr(frag.iterator, dtype=Int32), cute.make_layout(n // 2))
        for i in cutlass.range_constexpr(n // 2):
            words[i] = ptx.pack2(flat[2 * i], flat[2 * i + 1], self.io)

    @cute.jit
    def _consume(self, mH0, mH0Idx, mHt, mHtIdx, mO, flags, sQ, sK, sW, sAqk, sU_base, sF_base, pipe, mma_x, mma_s,
                 n, ho, vw, wg, bos, eos, nch, tid, state=None):
        """One consumer warpgroup: state rows ``vw .. vw + 64`` of head ``ho``, the chunks of sequence ``n``, from
        the ring's pipeline state ``state`` on (None: the ring's start).
        Accumulator element ``4 j + 2 h + e`` of a thread is row ``16 warp + g + 8 h``, column ``8 j + 2 t + e``."""
        C, K, V, RU, io = self.C, self.K, self.V, self.RU, self.io
        HO = mO.shape[1]
        lane = tid % 32
        warp = tid // 32
        g = lane // 4
        t = lane % 4
        thr_x = mma_x.get_slice(tid)
        thr_s = mma_s.get_slice(tid)
        tXrW = thr_x.make_fragment_B(thr_x.partition_B(sW))
        tXrQ = thr_x.make_fragment_B(thr_x.partition_B(sQ))
        tXrA = thr_x.make_fragment_B(thr_x.partition_B(sAqk))
        tSrK = thr_s.make_fragment_B(thr_s.partition_B(transpose_view(sK)))
        acc_S = cute.make_rmem_tensor(thr_s.partition_shape_C((64, K)), Float32)
        acc_X = cute.make_rmem_tensor(thr_x.partition_shape_C((64, C)), Float32)
        acc_O = cute.make_rmem_tensor(thr_x.partition_shape_C((64, C)), Float32)
        tXrS = thr_x.make_fragment_A(thr_x.partition_shape_A((64, K)))  # S, 16-bit: A of X^T and Y^T
        tOrP = thr_x.make_fragment_A(thr_x.partition_shape_A((64, C)))  # V'^T: A of O^T
        tSrP = thr_s.make_fragment_A(thr_s.partition_shape_A((64, C)))  # V'^T diag(kf): A of the update
        fS = cute.make_tensor(acc_S.iterator, cute.make_layout(cute.size(acc_S)))
        fX = cute.make_tensor(acc_X.iterator, cute.make_layout(cute.size(acc_X)))
        fO = cute.make_tensor(acc_O.iterator, cute.make_layout(cute.size(acc_O)))
        wP = cute.make_tensor(cute.recast_ptr(tOrP.iterator, dtype=Int32), cute.make_layout(cute.size(tOrP) // 2))
        wD = cute.make_tensor(cute.recast_ptr(tSrP.iterator, dtype=Int32), cute.make_layout(cute.size(tSrP) // 2))

        acc_S.fill(0.0)
        if (flags & FLAG_HAS_INITIAL_STATE) != 0:
            row = n
            if (flags & FLAG_INITIAL_INDICES) != 0:
                row = mH0Idx[n]
            self._state_io(mH0, fS, Int64(row) * HO + ho, vw, warp, g, t, False)
        self._to16(acc_S, tXrS)

        if const_expr(state is None):
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.S)
        o_base = mO.iterator.toint()
        o_tok = Int64(HO) * (V * 2)  # bytes a token of O
        vl = wg * 64 + warp * 16 + g  # the thread's first row within the CTA's V-slice (U's columns)
        for j in cutlass.range(nch, unroll=1):
            t0 = bos + j * C
            ln = cutlass.min(eos - t0, C)
            pipe.consumer_wait(state)
            cute.arch.fence_view_async_shared()  # cp.async (generic proxy) writes -> wgmma (async proxy) reads
            idx = state.index
            self._gemm(mma_x, acc_X, tXrS, tXrW[None, None, None, idx], True)
            if const_expr(self.write_output):
                self._gemm(mma_x, acc_O, tXrS, tXrQ[None, None, None, idx], True)
                warpgroup.wait_group(1)
            else:
                warpgroup.wait_group(0)
            sU = sU_base + idx * (C * RU)
            sF = sF_base + idx * self.F_BYTES
            # V'^T = U^T - X^T (-> A of O^T) and V'^T diag(kf) (-> A of the state update)
            for jj in cutlass.range_constexpr(C // 8):
                s0 = jj * 8 + 2 * t
                kf = ptx.ld_shared_v2_f32(sF + (C + s0) * 4)
                for h in cutlass.range_constexpr(2):
                    if const_expr(self.zero_u):  # the transition run: v = 0, so U = T diag(beta) V = 0
                        p0 = -fX[4 * jj + 2 * h]
                        p1 = -fX[4 * jj + 2 * h + 1]
                    else:
                        col = (vl + 8 * h) * 2
                        u0 = ptx.b16_to_f32(ptx.ld_shared_u16(sU + s0 * RU + col), io)
                        u1 = ptx.b16_to_f32(ptx.ld_shared_u16(sU + (s0 + 1) * RU + col), io)
                        p0 = u0 - fX[4 * jj + 2 * h]
                        p1 = u1 - fX[4 * jj + 2 * h + 1]
                    if const_expr(self.write_output):
                        wP[2 * jj + h] = ptx.pack2(p0, p1, io)
                    wD[2 * jj + h] = ptx.pack2(p0 * kf[0], p1 * kf[1], io)
            if const_expr(self.write_output):
                warpgroup.wait_group(0)
                # O^T = Y^T diag(qf) + V'^T Aqk^T
                for jj in cutlass.range_constexpr(C // 8):
                    qf = ptx.ld_shared_v2_f32(sF + (jj * 8 + 2 * t) * 4)
                    for h in cutlass.range_constexpr(2):
                        for e in cutlass.range_constexpr(2):
                            fO[4 * jj + 2 * h + e] = fO[4 * jj + 2 * h + e] * qf[e]
                self._gemm(mma_x, acc_O, tOrP, tXrA[None, None, None, idx], False)
            # S = gamma_last S + (V'^T diag(kf)) K   (per channel: S D(2^G_last) + (V'^T diag(kf)) Kd)
            if const_expr(self.per_channel):
                # S [V, K] sits untransposed in acc_S (M = state rows, N = K columns): element 4 j + 2 h + e is
                # K column 8 j + 2 t + e, so D(2^G_last) on the right scales each element by its column's factor
                for jj in cutlass.range_constexpr(K // 8):
                    gl2 = ptx.ld_shared_v2_f32(sF + (2 * C + jj * 8 + 2 * t) * 4)
                    for h in cutlass.range_constexpr(2):
                        for e in cutlass.range_constexpr(2):
                            fS[4 * jj + 2 * h + e] = fS[4 * jj + 2 * h + e] * gl2[e]
            else:
                gl = ptx.ld_shared_f32(sF + 2 * C * 4)
                for i in cutlass.range_constexpr(cute.size(acc_S)):
                    fS[i] = fS[i] * gl
            self._gemm(mma_s, acc_S, tSrP, tSrK[None, None, None, idx], False)
            warpgroup.wait_group(0)
            pipe.consumer_release(state)
            state.advance()
            if const_expr(self.write_output):  # O^T -> O rows t0 + r (< ln; on an expanded timeline the readouts)
                self._store_o_rows(fO, o_base, o_tok, HO, t0, ln, ho, vw, warp, g, t)
            self._to16(acc_S, tXrS)

        if (flags & FLAG_WRITE_STATE) != 0:
            row = n
            if (flags & FLAG_OUTPUT_INDICES) != 0:
                row = mHtIdx[n]
            self._state_io(mHt, fS, Int64(row) * HO + ho, vw, warp, g, t, True)


class GdnChunkedSm90PrepKernel(GdnChunkedSm90Kernel):
    """The prep kernel alone (the main kernel's arguments accepted and unused): its scratch serves the main-only
    launches of :class:`GdnChunkedSm90MainKernel`.  Build with :func:`compile_prep`."""

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
                 mCu: cute.Tensor, mChunks: cute.Tensor, mChunkOff: cute.Tensor, mH0: cute.Tensor,
                 mH0Idx: cute.Tensor, mHt: cute.Tensor, mHtIdx: cute.Tensor, mO: cute.Tensor, mW: cute.Tensor,
                 mU: cute.Tensor, mAqk: cute.Tensor, mF: cute.Tensor, scale: Float32, q_group: Int32,
                 k_group: Int32, v_group: Int32, flags: Int32, stream):
        self._launch_prep(mQ, mK, mV, mG, mBeta, mChunks, mO, mW, mU, mAqk, mF, scale, q_group, k_group, v_group,
                          flags, stream)


class GdnChunkedSm90MainKernel(GdnChunkedSm90Kernel):
    """The main kernel alone, over a prep's scratch (the prep's arguments accepted and unused), computing what
    ``MainConfig.run`` names.  Build with :func:`compile_main`."""

    runs_prep = False  # the persistent entry (GdnSm90PlanCall) launches the main kernel alone

    def __init__(self, mcfg: MainConfig):
        super().__init__(mcfg.config)
        self.write_output = mcfg.run is MainRun.OUTPUT
        self.zero_u = mcfg.run is MainRun.TRANSITION

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
                 mCu: cute.Tensor, mChunks: cute.Tensor, mChunkOff: cute.Tensor, mH0: cute.Tensor,
                 mH0Idx: cute.Tensor, mHt: cute.Tensor, mHtIdx: cute.Tensor, mO: cute.Tensor, mW: cute.Tensor,
                 mU: cute.Tensor, mAqk: cute.Tensor, mF: cute.Tensor, scale: Float32, q_group: Int32,
                 k_group: Int32, v_group: Int32, flags: Int32, stream):
        self._launch_main(mQ, mK, mCu, mChunkOff, mH0, mH0Idx, mHt, mHtIdx, mO, mW, mU, mAqk, mF, q_group, k_group,
                          flags, stream)


class GdnChunkedSm90PersistentKernel(GdnSm90PlanCall, GdnChunkedSm90Kernel):
    """:class:`GdnChunkedSm90Kernel` on a persistent grid.  Build with :func:`compile`."""


class GdnChunkedSm90PersistentMainKernel(GdnSm90PlanCall, GdnChunkedSm90MainKernel):
    """:class:`GdnChunkedSm90MainKernel` on a persistent grid.  Build with :func:`compile_main`."""


def compile(cfg: Config, *, keep_ptx_dir: str | None = None, keep_cubin: bool = False):
    """Compile :class:`GdnChunkedSm90Kernel` (prep + main kernels, one function) for ``cfg`` from fake tensors (no
    GPU needed; with ``cfg.expand_rows`` > 1 q's row count apart from k's:
    :func:`~cutedsl_attn.sm90.gdn_rows.compile_expanded`).  Returns the tvm-ffi callable; call it through
    :func:`launch`.  Raises ValueError for ``keep_cubin`` without a ``keep_ptx_dir``."""
    if cfg.expand_rows > 1:
        return compile_expanded(GdnChunkedSm90Kernel(cfg), cfg, keep_ptx_dir, keep_cubin)
    kernel = GdnChunkedSm90PersistentKernel if cfg.tiles.persistent else GdnChunkedSm90Kernel
    return compile_kernel(kernel(cfg), cfg.problem, keep_ptx_dir, keep_cubin)


def _refuse_expanded(cfg: Config, entry: str) -> None:
    if cfg.expand_rows > 1:  # their launches plan the chunks over q's rows
        raise ValueError(f"{entry}: expand_rows {cfg.expand_rows} runs through compile / launch only")


def compile_prep(cfg: Config, *, keep_ptx_dir: str | None = None, keep_cubin: bool = False):
    """Compile the prep kernel alone (:class:`GdnChunkedSm90PrepKernel`, cache name :data:`NAME_PREP`) for
    ``cfg``; call it through :func:`launch_prep`.  Errors as :func:`compile`'s, and ValueError for
    ``cfg.expand_rows`` > 1."""
    _refuse_expanded(cfg, "compile_prep")
    return compile_kernel(GdnChunkedSm90PrepKernel(cfg), cfg.problem, keep_ptx_dir, keep_cubin)


def compile_main(mcfg: MainConfig, *, keep_ptx_dir: str | None = None, keep_cubin: bool = False):
    """Compile the main kernel alone (:class:`GdnChunkedSm90MainKernel`, cache name :data:`NAME_MAIN`) for
    ``mcfg``; call it through :func:`launch_main`.  Errors as :func:`compile`'s, and ValueError for
    ``mcfg.config.expand_rows`` > 1."""
    _refuse_expanded(mcfg.config, "compile_main")
    kernel = GdnChunkedSm90PersistentMainKernel if mcfg.config.tiles.persistent else GdnChunkedSm90MainKernel
    return compile_kernel(kernel(mcfg), mcfg.config.problem, keep_ptx_dir, keep_cubin)
