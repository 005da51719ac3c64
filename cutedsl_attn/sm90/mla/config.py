"""What the SM90 MLA decode kernel chooses (:class:`Tiles`), its compile key (:class:`Config`) and what it serves
(:func:`unsupported_reason`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import cutlass

from ...common.dtypes import element_type
from ...compile.tiles import check_int_fields, override_int_fields
from ...planning.mla import HEAD_DIM_CKV, HEAD_DIM_KPE, MlaProblem

NAME = "mla_decode_sm90"

SMEM_LIMIT = 227 * 1024  # dynamic shared memory one CTA may use on sm_90a
TILE_M = 64  # packed query rows per CTA: the M of one warpgroup's wgmma
BLOCK_N = 64  # KV tokens per block: one page of 64 tokens, or 64 // page_size smaller ones
D_QK = HEAD_DIM_CKV + HEAD_DIM_KPE  # 576
CHUNK_COLS = 64  # columns of one 128-byte-swizzled smem chunk (one TMA box)
NUM_CHUNKS = D_QK // CHUNK_COLS  # 9: chunks 0..3 = O's left half, 4..7 its right half, 8 = kpe (then P)
V_HALF = HEAD_DIM_CKV // 2  # 256 columns of O per consumer warpgroup
NUM_GROUPS = 3  # release groups of a stage: ckv left half, ckv right half, kpe / P
GROUP_CHUNKS = ((0, 1, 2, 3), (4, 5, 6, 7), (8,))
SWAP_TILE_N = (16, 32)  # query rows on the wgmma N dimension of the swapped form (Tiles.swap_ab)
PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64)  # a 64-token block spans 64 // page_size whole pages
#: registers a thread launches with (384 threads share the 64 Ki file in multiples of 8): setmaxnreg moves registers
#: within the CTA's 168 x 384 pool, so the warpgroups' budgets must sum to it, not to 64 Ki (an inc that cannot be
#: met blocks forever)
LAUNCH_REGISTERS = 65536 // 384 // 8 * 8


#: consumer schedules (:attr:`Tiles.schedule`); the kernel module's docstring describes both
SCHEDULE_SIGNAL_FIRST = 0  # wait for the other warpgroup's m_{n-1}, apply its factor, then issue S_n and P V
SCHEDULE_S_FIRST = 1  # issue S_n (the groups freed first) before that wait, its own-half group after P_{n-1} V

#: how the producer brings fp8 cache bytes in (:attr:`Tiles.fp8_loads`; the loads module's docstring has both)
FP8_LOADS_REGISTERS = 0  # 16-byte ld.global.nc into registers, four in flight per thread
FP8_LOADS_STAGED = 1  # cp.async of a whole block into the stage's own slots, widened in place


@dataclass(frozen=True)
class Tiles:
    """What the kernel chooses: ``num_stages`` KV blocks resident (2: Q's 72 KiB and two 72 KiB blocks fill the
    227 KiB of shared memory; one block per consumer warpgroup), ``consumer_registers`` per consumer thread after
    ``setmaxnreg`` (the producer warpgroup gets what is left of the CTA's launch pool, ``LAUNCH_REGISTERS`` x 384,
    at most 56), ``schedule`` the consumers' order per block (:data:`SCHEDULE_SIGNAL_FIRST` or
    :data:`SCHEDULE_S_FIRST`; the producer loads a stage's groups in the order that schedule frees them),
    ``merge_kernel`` where split-KV partials are merged (0: by the last CTA of a (request, row tile) to finish;
    1: by a second kernel of the same launch, 64 CTAs a row tile: :mod:`cutedsl_attn.sm90.mla.merge`),
    ``fp8_loads`` how fp8 caches are loaded (:data:`FP8_LOADS_STAGED`: ``cp.async`` into the stage, widened in
    place; :data:`FP8_LOADS_REGISTERS`: 16-byte loads into registers, widened on the way, which needs the
    producer's 56 registers of ``consumer_registers`` 224 or less not to spill; unused by 16-bit caches),
    ``swap_ab`` 1 for the small-head form (:mod:`cutedsl_attn.sm90.mla.swapab`: the packed query rows on the
    wgmma N dimension, ``tile_n`` of them, 16 or 32; all ``q_len x heads`` rows of a request must fit one tile,
    checked at launch; 16-bit caches only; ``tile_n`` 0 there means 32), 0 for the rows on M (``tile_n`` then
    stays 0).

    Raises TypeError for a non-int field, ValueError for a value out of range.
    """

    num_stages: int = 2
    consumer_registers: int = 232
    schedule: int = SCHEDULE_SIGNAL_FIRST
    merge_kernel: int = 0
    fp8_loads: int = FP8_LOADS_STAGED
    swap_ab: int = 0
    tile_n: int = 0

    def __post_init__(self):
        check_int_fields(self)
        if self.num_stages != 2:
            raise ValueError(f"num_stages must be 2 (one 64-token block per consumer warpgroup; a third does not "
                             f"fit next to Q), got {self.num_stages}")
        if self.consumer_registers not in (216, 224, 232, 240):
            raise ValueError(f"consumer_registers must be one of 216, 224, 232, 240, got {self.consumer_registers}")
        if self.merge_kernel not in (0, 1):
            raise ValueError(f"merge_kernel must be 0 (the last CTA merges) or 1 (a merge kernel), got "
                             f"{self.merge_kernel}")
        if self.fp8_loads not in (FP8_LOADS_REGISTERS, FP8_LOADS_STAGED):
            raise ValueError(f"fp8_loads must be {FP8_LOADS_REGISTERS} (registers) or {FP8_LOADS_STAGED} (staged "
                             f"in the stage), got {self.fp8_loads}")
        if self.swap_ab not in (0, 1):
            raise ValueError(f"swap_ab must be 0 (query rows on the wgmma M) or 1 (on N), got {self.swap_ab}")
        if not self.swap_ab and self.tile_n != 0:
            raise ValueError(f"tile_n (the query rows on the wgmma N) applies to swap_ab=1 only, got tile_n "
                             f"{self.tile_n} with swap_ab 0")
        if self.swap_ab and self.tile_n == 0:
            object.__setattr__(self, "tile_n", SWAP_TILE_N[-1])  # (one compile key for the derived and given 32)
        if self.swap_ab and self.tile_n not in SWAP_TILE_N:
            raise ValueError(f"tile_n must be one of {SWAP_TILE_N} (or 0: 32) with swap_ab=1, got {self.tile_n}")
        if self.schedule not in (SCHEDULE_SIGNAL_FIRST, SCHEDULE_S_FIRST):
            raise ValueError(f"schedule must be {SCHEDULE_SIGNAL_FIRST} (signal first) or {SCHEDULE_S_FIRST} "
                             f"(S first), got {self.schedule}")


TUNING_FIELDS = tuple(f.name for f in fields(Tiles))


def override_tiles(tiles: Tiles, items: dict[str, str]) -> Tiles:
    """``tiles`` with the fields named in ``items`` (field name -> decimal text) replaced; ValueError naming an
    unknown key or a non-integer value, :class:`Tiles`' errors for one out of range."""
    return override_int_fields(tiles, items)


def unsupported_reason(problem: MlaProblem) -> str | None:
    """Why the SM90 MLA kernel cannot serve ``problem``, or None.  It serves sm_90a, any head count and query
    length, causal or not, with 16-bit q / o over caches of q's dtype at page size 64 (TMA pages); page sizes
    1, 2, 4, .., 32 (gathered pages) and fp8 e4m3 caches / q (widened to f16 on load).
    Raises TypeError when ``problem`` is not an MlaProblem."""
    if not isinstance(problem, MlaProblem):
        raise TypeError(f"problem must be an MlaProblem, got {type(problem).__name__}")
    if problem.arch != "sm_90a":
        return f"the SM90 MLA kernel runs on sm_90a only, got {problem.arch!r} (the portable kernel serves it)"
    if problem.page_size not in PAGE_SIZES:
        return (f"the SM90 MLA kernel serves page_size {PAGE_SIZES} (whole pages per 64-token block), got "
                f"{problem.page_size} (the portable kernel serves it)")
    return None


def default_tiles(problem: MlaProblem, *, num_sms: int) -> Tiles:
    """The default tiles (``num_sms`` unused: the planner fills the GPU by splitting):

    ==============================  ==========================================================================
    16-bit caches                   two 64-token stages, 232 consumer registers (O half 128 + S 32 + P 16),
                                    split-KV partials merged by the merge kernel (4.5x the in-kernel merge at
                                    batch 1, 32768 tokens; within 1-3% elsewhere)
    fp8 caches                      the same, the fp8 bytes staged in the stage by ``cp.async`` (a block in
                                    flight in no registers: the producer's 40 suffice)
    ==============================  ==========================================================================
    """
    return Tiles(merge_kernel=1)


@dataclass(frozen=True)
class Config:
    """Compile-time configuration of the SM90 MLA kernel (its cache key): the problem and the tiles.

    Raises TypeError for ``tiles`` of another type, ValueError with :func:`unsupported_reason`'s reason.
    """

    problem: MlaProblem
    tiles: Tiles

    def __post_init__(self):
        if not isinstance(self.tiles, Tiles):
            raise TypeError(f"tiles must be an SM90 MLA Tiles, got {type(self.tiles).__name__}")
        reason = unsupported_reason(self.problem)
        if reason is not None:
            raise ValueError(f"the SM90 MLA kernel cannot serve this problem: {reason}")
        if self.tiles.swap_ab and self.problem.kv_fp8:
            raise ValueError("Tiles.swap_ab=1 serves caches of q's 16-bit dtype, not fp8 caches (swap_ab=0 does)")
        if self.smem_bytes > SMEM_LIMIT:
            raise ValueError(f"{self.tiles} needs {self.smem_bytes} bytes of shared memory, more than {SMEM_LIMIT}")

    @property
    def arch(self) -> str:
        return self.problem.arch

    @property
    def cutlass_dtype(self):
        """o's 16-bit type (q's, bf16 for an fp8 q)."""
        return element_type(self.problem.out_dtype)

    @property
    def q_cutlass_dtype(self):
        return cutlass.Float8E4M3FN if self.problem.q_fp8 else self.cutlass_dtype

    @property
    def kv_cutlass_dtype(self):
        return cutlass.Float8E4M3FN if self.problem.kv_fp8 else self.cutlass_dtype

    @property
    def mma_dtype(self):
        """The 16-bit type of the wgmmas and of Q / K / V / P in shared memory: f16 under fp8 caches (e4m3 widens
        exactly to f16; the portable kernel's choice), else q's."""
        return cutlass.Float16 if self.problem.kv_fp8 else self.cutlass_dtype

    @property
    def gather(self) -> bool:
        """Whether the producer loads every block row by row (small pages, fp8 caches) instead of TMA pages."""
        return self.problem.page_size < BLOCK_N or self.problem.kv_fp8

    @property
    def widen_q(self) -> bool:
        """Whether Q passes through registers to become :attr:`mma_dtype` (fp8 q; bf16 q over fp8 caches)."""
        return self.problem.q_fp8 or (self.problem.kv_fp8 and self.problem.dtype == "bfloat16")

    @property
    def num_threads(self) -> int:
        """A producer warpgroup and two consumer warpgroups."""
        return 3 * 128

    @property
    def registers(self) -> tuple[int, int]:
        """(consumer, producer) registers per thread after ``setmaxnreg`` (multiples of 8, within the CTA's launch
        pool of ``LAUNCH_REGISTERS`` x 384)."""
        c = self.tiles.consumer_registers
        return c, min(56, (LAUNCH_REGISTERS * 384 - 256 * c) // 128 // 8 * 8)

    @property
    def tile_m(self) -> int:
        return TILE_M

    @property
    def q_bytes(self) -> int:
        return TILE_M * D_QK * 2

    @property
    def stage_bytes(self) -> int:
        return BLOCK_N * D_QK * 2

    @property
    def smem_bytes(self) -> int:
        """Q, the stages, 1 KiB alignment slack and the barriers / row exchanges."""
        swap = 4 * 1024 if self.tiles.swap_ab else 0  # the swapped form's cross-warp column exchanges
        return self.q_bytes + self.tiles.num_stages * self.stage_bytes + 1024 + 2048 + swap

    @property
    def max_splits_per_request(self) -> int:
        """Most pieces a split request may have: the merge keeps one fp32 weight per (piece, row) in the stages."""
        return self.tiles.num_stages * self.stage_bytes // (TILE_M * 4)

