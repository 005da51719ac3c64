"""The SM100 decode kernel's configuration: tiles (:class:`Tiles`), the compile key (:class:`Config`), the TMEM
column plan, the warp roles, the mbarrier pipelines, the shared-memory budget and the one list of what the kernel
refuses.

Pure Python (no device code): the tile math here is what the CPU tests assert.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import cutlass

from ...common.dtypes import element_type
from ...common.tcgen05 import TMEM_COLS, tmem_alloc_cols, tmem_plan_reason
from ...planning.decode import DecodeProblem

ARCHS = ("sm_100a", "sm_103a")
HEAD_DIMS = (64, 128)
TILE_KV = 128  # KV tokens per block: the M of S^T = K Q^T (one cta_group::1 tcgen05 MMA)
HEAD_TILE = 16  # query heads of a group on the MMA N (padded): the smallest N of an M=128 f16 MMA
SMEM_LIMIT = 227 * 1024
REGISTER_FILE = 64 * 1024
KV_STAGES = (2, 3, 4, 5, 6)
PAGE_TABLE_STAGES = 4  # page-id ring depth: the page-table warp runs up to 4 KV blocks ahead of the load warpgroup

# named barrier ids (0 is __syncthreads)
BAR_TMEM_ALLOC = 1  # the MMA warp's TMEM allocation published to the softmax warpgroup
BAR_SOFTMAX = 2  # the softmax warpgroup's cross-warp reductions (block max, final sum)
BAR_TMEM_FREE = 3  # the softmax warpgroup's last TMEM read, before the MMA warp frees the columns


@dataclass(frozen=True)
class Roles:
    """The warp roles of a CTA: the softmax warpgroup (warps 0-3: thread ``r`` owns KV token ``r`` of a block in
    S^T and TMEM lane ``r`` of O^T; warp ``w`` reaches TMEM lanes ``32 w ..``), the load warpgroup (warps 4-7:
    threads ``2 t`` and ``2 t + 1`` gather token rows ``t`` and ``t + 64`` of K and V with ``cp.async`` from the
    page ids the page-table warp staged), the MMA warp (warp 8: one thread issues every tcgen05.mma; it owns the
    TMEM allocation) and the page-table warp (warp 9: copies each block's 128 page ids, one per token, from the
    request's page indices into a shared-memory ring :data:`PAGE_TABLE_STAGES` blocks deep).  No ``setmaxnreg``
    (warps 8-9 are half a warpgroup): every role runs within the launch budget, :attr:`launch_registers`."""

    softmax_warps: tuple[int, ...] = (0, 1, 2, 3)
    load_warps: tuple[int, ...] = (4, 5, 6, 7)
    mma_warp: int = 8
    page_table_warp: int = 9

    @property
    def num_warps(self) -> int:
        return self.page_table_warp + 1

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    @property
    def launch_registers(self) -> int:
        """Registers a thread may use at launch: the register file over the CTA's threads, in the
        allocation's 8-register steps (200 for 320 threads)."""
        return REGISTER_FILE // self.num_threads // 8 * 8


@dataclass(frozen=True)
class Tiles:
    """What the SM100 decode kernel chooses for a problem.

    ``kv_stages``: depth of the shared-memory ring of 128-token K and V blocks (2..6, within shared memory);
    the query heads ride the MMA N dimension (:data:`HEAD_TILE`) and a KV block its M (:data:`TILE_KV`),
    both fixed by the swap-AB design.
    """

    kv_stages: int = 3


def tmem_plan(head_dim: int) -> dict[str, tuple[int, int]]:
    """The TMEM columns of each accumulator, ``name -> (first column, columns)``.

    ``S0`` / ``S1``: two fp32 S^T buffers (128 token lanes x :data:`HEAD_TILE` head columns; the MMA warp
    writes block ``i + 1``'s scores while the softmax warpgroup reads block ``i``'s); ``O``: the fp32 O^T
    accumulator (``head_dim`` lanes x :data:`HEAD_TILE` columns; an M=64 accumulator occupies lanes 0-15 of
    each 32-lane quarter).  Every region starts on a multiple of 32 columns; none overlaps another.
    ``head_dim`` does not change the columns (it is the lane extent)."""
    del head_dim
    return {"S0": (0, HEAD_TILE), "S1": (32, HEAD_TILE), "O": (64, HEAD_TILE)}


def mbarrier_plan(kv_stages: int, roles: Roles) -> dict[str, tuple[int, int, int]]:
    """The kernel's mbarrier pipelines, ``name -> (stages, full-barrier arrivals, empty-barrier arrivals)``: every
    producer / consumer thread arrives once a use, the MMA warp's one issuing thread once (a tcgen05.commit).

    ``kv``: K / V stages, the load warpgroup -> MMA; ``s``: S^T buffers, MMA -> softmax; ``p``: P^T buffers,
    softmax -> MMA; ``o``: O^T, MMA -> softmax; ``pt``: the page-id ring, the page-table warp (one
    ``cp.async.mbarrier.arrive.noinc`` a lane, counted once its copies land) -> the load warpgroup."""
    loaders, softmax = 32 * len(roles.load_warps), 32 * len(roles.softmax_warps)
    return {"kv": (kv_stages, loaders, 1), "s": (2, 1, softmax), "p": (2, softmax, 1), "o": (1, 1, softmax),
            "pt": (PAGE_TABLE_STAGES, 32, loaders)}


def o_lane(head_dim: int, lane: int) -> int | None:
    """The row ``d`` of O^T that TMEM lane ``lane`` (0..127) holds, or None for an unused lane: lane ``l`` is
    row ``l`` at head_dim 128; at head_dim 64 (an M=64 accumulator) rows ``16 q .. 16 q + 15`` sit in lanes
    ``32 q .. 32 q + 15``."""
    if head_dim == 128:
        return lane
    q, r = divmod(lane, 32)
    return 16 * q + r if r < 16 else None


def unsupported_reason(problem: DecodeProblem) -> str | None:
    """Why the SM100 decode kernel cannot serve ``problem``, or None (the arch test included).

    Serves bf16/fp16 queries with a K/V cache of the same dtype or fp8 e4m3, head_dim 64 or 128, any page size,
    group sizes 1..16, sinks, split-KV, on ``sm_100a`` / ``sm_103a``.  Refuses soft caps, RoPE / ALiBi and
    head_dim 32 / 256 (the portable kernel serves them).  Raises TypeError when ``problem`` is not a
    DecodeProblem.
    """
    p = problem
    if not isinstance(p, DecodeProblem):
        raise TypeError(f"problem must be a DecodeProblem, got {type(p).__name__}")
    if p.arch not in ARCHS:
        return f"the SM100 decode kernel builds for sm_100a / sm_103a only, got arch {p.arch!r}"
    if p.head_dim not in HEAD_DIMS:
        return f"head_dim must be one of {HEAD_DIMS} (the M of the O^T = V^T P^T MMA), got {p.head_dim}"
    if p.use_soft_cap:
        return "soft caps are not served by the SM100 decode kernel yet"
    if p.pos_encoding_mode != "NONE":
        return "positional encodings (RoPE / ALiBi) are served by the portable decode kernel"
    if p.group_size > HEAD_TILE:
        return f"group_size must be <= {HEAD_TILE} (the heads of a group share one MMA N), got {p.group_size}"
    return None


def _tiles_reason(t: Tiles) -> str | None:
    for f in dataclasses.fields(Tiles):
        v = getattr(t, f.name)
        if isinstance(v, bool) or not isinstance(v, int):
            return f"{f.name} must be an int, got {v!r}"
    if t.kv_stages not in KV_STAGES:
        return f"kv_stages must be in {KV_STAGES[0]}..{KV_STAGES[-1]}, got {t.kv_stages}"
    return None


@dataclass(frozen=True)
class Config:
    """The compile key of the SM100 decode kernel: a :class:`DecodeProblem` and the tiles chosen for it.

    Everything else (batch, lengths, pages, kv heads, strides, NHD / HND, scales, window) is a run-time
    argument, as for the portable decode kernel.  Raises TypeError when the halves are not a DecodeProblem and
    a :class:`Tiles`; ValueError naming the reason when the kernel cannot serve ``problem``
    (:func:`unsupported_reason`) or ``tiles`` do not fit it (field ranges, the TMEM plan, shared memory).
    """

    problem: DecodeProblem
    tiles: Tiles

    def __post_init__(self):
        if not isinstance(self.problem, DecodeProblem) or not isinstance(self.tiles, Tiles):
            raise TypeError(f"Config(problem, tiles) takes a DecodeProblem and an SM100 decode Tiles, got "
                            f"{type(self.problem).__name__} and {type(self.tiles).__name__}")
        reason = unsupported_reason(self.problem) or _tiles_reason(self.tiles) or tmem_plan_reason(self.tmem)
        if reason is None and self.smem_bytes > SMEM_LIMIT:
            reason = f"needs {self.smem_bytes} B of shared memory (> {SMEM_LIMIT}): use fewer kv_stages"
        if reason:
            raise ValueError(f"SM100 decode: {reason}")

    @property
    def arch(self) -> str:
        return self.problem.arch

    @property
    def cutlass_dtype(self):
        """The CuTe DSL element type of q, k, v and o."""
        return element_type(self.problem.dtype)

    @property
    def kv_cutlass_dtype(self):
        """The CuTe DSL element type of k and v."""
        return cutlass.Float8E4M3FN if self.problem.kv_fp8 else self.cutlass_dtype

    @property
    def mma_dtype(self):
        """The 16-bit type both MMAs run in: f16 for an fp8 cache (e4m3 widens exactly to f16; a bf16 q is
        rounded to f16 once, as the portable kernel does), else q's."""
        return cutlass.Float16 if self.problem.kv_fp8 else self.cutlass_dtype

    @property
    def kv_elem_bytes(self) -> int:
        """Bytes of one K / V element."""
        return 1 if self.problem.kv_fp8 else 2

    @property
    def staging_row_bytes(self) -> int:
        """Bytes of one fp8 K / V row in the staging ring (one 16-byte pad: rows start 4 banks apart, so the
        conversion's 16-byte loads of 8 consecutive rows hit distinct banks); 0 for a 16-bit cache."""
        return self.problem.head_dim + 16 if self.problem.kv_fp8 else 0

    @property
    def roles(self) -> Roles:
        return Roles()

    @property
    def num_threads(self) -> int:
        return self.roles.num_threads

    @property
    def mbarriers(self) -> dict[str, tuple[int, int, int]]:
        """The mbarrier pipelines (:func:`mbarrier_plan`)."""
        return mbarrier_plan(self.tiles.kv_stages, self.roles)

    @property
    def tmem(self) -> dict[str, tuple[int, int]]:
        """The TMEM column plan (:func:`tmem_plan`)."""
        return tmem_plan(self.problem.head_dim)

    @property
    def tmem_cols(self) -> int:
        """TMEM columns allocated per CTA (a power of two >= 32)."""
        return tmem_alloc_cols(self.tmem)

    @property
    def operand_stage_bytes(self) -> int:
        """Shared-memory bytes of one K + V stage in the MMA's 16-bit operand layouts."""
        return 2 * TILE_KV * self.problem.head_dim * 2

    @property
    def stage_bytes(self) -> int:
        """Shared-memory bytes of one K + V ring stage: the operands, and for an fp8 cache the rows as loaded
        (1024-byte aligned)."""
        return self.operand_stage_bytes + 2 * (-(-(TILE_KV * self.staging_row_bytes) // 1024) * 1024)

    @property
    def smem_kv_bytes(self) -> int:
        return self.tiles.kv_stages * self.stage_bytes

    @property
    def smem_bytes(self) -> int:
        """The kernel's shared storage: mbarriers, TMEM base, reduction scratch, the merge's row statistics and the
        page-id ring (padded to the 1 KiB alignment of the operand buffers), then Q, the two P buffers and the
        K / V rings."""
        n_mbar = sum(2 * stages for stages, _, _ in self.mbarriers.values())
        head = 8 * n_mbar + 4 + 4 * (2 * 4 * HEAD_TILE + 4 * HEAD_TILE) + 8 * HEAD_TILE + 16
        head += 16 + 4 * PAGE_TABLE_STAGES * TILE_KV  # the page-id ring (16-byte aligned Int32)
        head = -(-head // 1024) * 1024
        q = HEAD_TILE * self.problem.head_dim * 2
        p = -(-(2 * TILE_KV * HEAD_TILE * 2) // 1024) * 1024
        q = -(-q // 1024) * 1024
        return head + q + p + self.smem_kv_bytes

    @property
    def max_splits_per_request(self) -> int:
        """Most pieces a split request may have: the merge keeps one fp32 LSE per piece and query head in the
        K ring's shared memory (the planner's ``max_splits_per_request``)."""
        return (self.tiles.kv_stages * self.operand_stage_bytes // 2 // 4) // self.problem.group_size

    @property
    def positive_scale_only(self) -> bool:
        """False: the scores are scaled before the running max, any ``sm_scale`` sign works."""
        return False
