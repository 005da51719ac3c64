"""What the SM90 MLA decode kernel chooses (:class:`Tiles`), its compile key (:class:`Config`) and what it serves
(:func:`unsupported_reason`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ...common.dtypes import element_type
from ...compile.tiles import check_int_fields, override_int_fields
from ...planning.mla import HEAD_DIM_CKV, HEAD_DIM_KPE, MlaProblem

NAME = "mla_decode_sm90"

SMEM_LIMIT = 227 * 1024  # dynamic shared memory one CTA may use on sm_90a
TILE_M = 64  # packed query rows per CTA: the M of one warpgroup's wgmma
BLOCK_N = 64  # KV tokens per block: one page
D_QK = HEAD_DIM_CKV + HEAD_DIM_KPE  # 576
CHUNK_COLS = 64  # columns of one 128-byte-swizzled smem chunk (one TMA box)
NUM_CHUNKS = D_QK // CHUNK_COLS  # 9: chunks 0..3 = O's left half, 4..7 its right half, 8 = kpe (then P)
V_HALF = HEAD_DIM_CKV // 2  # 256 columns of O per consumer warpgroup
NUM_GROUPS = 3  # release groups of a stage: ckv left half, ckv right half, kpe / P
GROUP_CHUNKS = ((0, 1, 2, 3), (4, 5, 6, 7), (8,))
PAGE_SIZES = (64,)
#: registers a thread launches with (384 threads share the 64 Ki file in multiples of 8): setmaxnreg moves registers
#: within the CTA's 168 x 384 pool, so the warpgroups' budgets must sum to it, not to 64 Ki (an inc that cannot be
#: met blocks forever)
LAUNCH_REGISTERS = 65536 // 384 // 8 * 8


#: consumer schedules (:attr:`Tiles.schedule`); the kernel module's docstring describes both
SCHEDULE_SIGNAL_FIRST = 0  # wait for the other warpgroup's m_{n-1}, apply its factor, then issue S_n and P V
SCHEDULE_S_FIRST = 1  # issue S_n (the groups freed first) before that wait, its own-half group after P_{n-1} V


@dataclass(frozen=True)
class Tiles:
    """What the kernel chooses: ``num_stages`` KV blocks resident (2: Q's 72 KiB and two 72 KiB blocks fill the
    227 KiB of shared memory; one block per consumer warpgroup), ``consumer_registers`` per consumer thread after
    ``setmaxnreg`` (the producer warpgroup gets what is left of the CTA's launch pool, ``LAUNCH_REGISTERS`` x 384,
    at most 56), ``schedule`` the consumers' order per block (:data:`SCHEDULE_SIGNAL_FIRST` or
    :data:`SCHEDULE_S_FIRST`; the producer loads a stage's groups in the order that schedule frees them),
    ``merge_kernel`` where split-KV partials are merged (0: by the last CTA of a (request, row tile) to finish;
    1: by a second kernel of the same launch, 64 CTAs a row tile: :mod:`cutedsl_attn.sm90.mla.merge`).

    Raises TypeError for a non-int field, ValueError for a value out of range.
    """

    num_stages: int = 2
    consumer_registers: int = 232
    schedule: int = SCHEDULE_SIGNAL_FIRST
    merge_kernel: int = 0

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
        if self.schedule not in (SCHEDULE_SIGNAL_FIRST, SCHEDULE_S_FIRST):
            raise ValueError(f"schedule must be {SCHEDULE_SIGNAL_FIRST} (signal first) or {SCHEDULE_S_FIRST} "
                             f"(S first), got {self.schedule}")


TUNING_FIELDS = tuple(f.name for f in fields(Tiles))


def override_tiles(tiles: Tiles, items: dict[str, str]) -> Tiles:
    """``tiles`` with the fields named in ``items`` (field name -> decimal text) replaced; ValueError naming an
    unknown key or a non-integer value, :class:`Tiles`' errors for one out of range."""
    return override_int_fields(tiles, items)


def unsupported_reason(problem: MlaProblem) -> str | None:
    """Why the SM90 MLA kernel cannot serve ``problem``, or None.  It serves sm_90a, 16-bit q / o with caches of
    q's dtype, page size 64, any head count and query length, causal or not.  Raises TypeError when
    ``problem`` is not an MlaProblem."""
    if not isinstance(problem, MlaProblem):
        raise TypeError(f"problem must be an MlaProblem, got {type(problem).__name__}")
    if problem.arch != "sm_90a":
        return f"the SM90 MLA kernel runs on sm_90a only, got {problem.arch!r} (the portable kernel serves it)"
    if problem.q_fp8 or problem.kv_fp8:
        return "the SM90 MLA kernel serves 16-bit caches only, not fp8 (the portable kernel serves them)"
    if problem.page_size not in PAGE_SIZES:
        return (f"the SM90 MLA kernel serves page_size {PAGE_SIZES} (one TMA block per page), got "
                f"{problem.page_size} (the portable kernel serves it)")
    return None


def default_tiles(problem: MlaProblem, *, num_sms: int) -> Tiles:
    """The default tiles (``num_sms`` unused: the planner fills the GPU by splitting):

    ==============================  ==========================================================================
    every problem served            two 64-token stages, 232 consumer registers (O half 128 + S 32 + P 16),
                                    split-KV partials merged by the merge kernel (4.5x the in-kernel merge at
                                    batch 1, 32768 tokens; within 1-3% elsewhere)
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
        if self.smem_bytes > SMEM_LIMIT:
            raise ValueError(f"{self.tiles} needs {self.smem_bytes} bytes of shared memory, more than {SMEM_LIMIT}")

    @property
    def arch(self) -> str:
        return self.problem.arch

    @property
    def cutlass_dtype(self):
        """q's, the caches' and o's 16-bit type."""
        return element_type(self.problem.dtype)

    @property
    def q_cutlass_dtype(self):
        return self.cutlass_dtype

    @property
    def kv_cutlass_dtype(self):
        return self.cutlass_dtype

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
        return self.q_bytes + self.tiles.num_stages * self.stage_bytes + 1024 + 2048

    @property
    def max_splits_per_request(self) -> int:
        """Most pieces a split request may have: the merge keeps one fp32 weight per (piece, row) in the stages."""
        return self.tiles.num_stages * self.stage_bytes // (TILE_M * 4)

