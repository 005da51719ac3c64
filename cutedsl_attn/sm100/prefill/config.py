"""The SM100 prefill kernel's configuration: tiles (:class:`Tiles`), the compile key (:class:`Config`), the TMEM
column plan, the warp roles with their register budgets, the output staging buffers, and the one list of what the
kernel refuses.

Pure Python (no device code): the tile math here is what the CPU tests assert.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...common.dtypes import element_type
from ...common.tcgen05 import tmem_alloc_cols, tmem_plan_reason
from ...planning.prefill import PrefillProblem

ARCHS = ("sm_100a", "sm_103a")
HEAD_DIMS = ((64, 64), (128, 128), (192, 128), (256, 256))  # (head_dim_qk, head_dim_vo)
TILE_M = 128  # packed query rows of one Q tile: the M of one tcgen05 (cta_group::1) MMA
SMEM_LIMIT = 227 * 1024
REGISTER_FILE = 64 * 1024
EPI_COLS = 64  # O columns of one staging buffer: one 128-byte swizzle atom a row, one TMA store box
EPI_PRODUCERS = 128  # arrivals on a staging buffer's full mbarrier: every correction thread (one row each)
EPI_CONSUMERS = 32  # arrivals on its empty mbarrier: every lane of the epilogue warp


@dataclass(frozen=True)
class Roles:
    """The warp roles of a CTA with ``q_tiles`` Q tiles and the registers per thread of each after setmaxnreg.

    Softmax warpgroup ``t`` owns Q tile ``t``; the correction warpgroup serves every tile; the MMA, load and
    epilogue warps share a warpgroup with an idle warp (setmaxnreg acts per warpgroup, so the epilogue warp has
    the ``other`` budget: it only moves bytes).  Warp ``w`` reaches TMEM lanes ``32 (w % 4) ..``, so softmax warp
    ``4 t + k`` and correction warp ``k`` own the same rows of their tiles; the epilogue warp never touches TMEM
    (it stores the O tiles the correction warpgroup staged in shared memory, :attr:`Config.epi_stages`).
    ``persistent``: the roles of a persistent grid (``Tiles.num_ctas > 0``), whose budgets may differ.
    """

    q_tiles: int
    persistent: bool = False

    @property
    def softmax_warps(self) -> tuple[int, ...]:
        return tuple(range(4 * self.q_tiles))

    @property
    def correction_warps(self) -> tuple[int, ...]:
        return tuple(range(4 * self.q_tiles, 4 * self.q_tiles + 4))

    @property
    def mma_warp(self) -> int:
        return 4 * self.q_tiles + 4

    @property
    def load_warp(self) -> int:
        return self.mma_warp + 1

    @property
    def epilogue_warp(self) -> int:
        return self.mma_warp + 2

    @property
    def idle_warps(self) -> tuple[int, ...]:
        return (self.mma_warp + 3,)

    @property
    def num_warps(self) -> int:
        return 4 * self.q_tiles + 8

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    @property
    def registers(self) -> dict[str, int]:
        """softmax / correction / other registers per thread: the softmax row (tile_n fp32 scores) needs the most;
        the warpgroups' sum (x 128 threads) must fit the registers the CTA launched with, which setmaxnreg only
        moves between them (two softmax warpgroups: FA4's budget).  ``other`` is the MMA, load and epilogue
        warps' warpgroup: the epilogue warp holds a tile's coordinates and one 16-byte chunk at a time."""
        # (a persistent grid carries its tile loop's counts through every role: ptxas spills them in the correction
        # warpgroup at 112 / 64, in the MMA and load warps at 32 with two Q tiles)
        if self.q_tiles == 1:
            return {"softmax": 224, "correction": 128 if self.persistent else 112, "other": 48}
        if self.persistent:
            return {"softmax": 200, "correction": 72, "other": 40}
        return {"softmax": 208, "correction": 64, "other": 32}


# named barrier ids (0 is __syncthreads)
BAR_TMEM_ALLOC = 1  # the MMA warp's TMEM allocation published to the softmax and correction warpgroups
BAR_TMEM_FREE = 2  # the correction warpgroup's last TMEM read, before the MMA warp frees the columns
# The mbarrier pipelines, producer -> consumer (arrivals on a stage's full / empty barrier): Q, K, V: TMA -> MMA
# (1 / 1); S: MMA -> softmax (1 / 128); P: softmax -> MMA (128 / 1); O: MMA -> correction (1 / 128); row
# statistics: softmax -> correction (128 / 128); staged O: correction -> epilogue warp (EPI_PRODUCERS /
# EPI_CONSUMERS); the V tail block: TMA (1).  A tcgen05.commit or a TMA transaction is one arrival.


@dataclass(frozen=True)
class Tiles:
    """What the SM100 prefill kernel chooses for a problem.

    ``tile_n``: KV tokens per block, the N of S = Q K^T and the K of O += P V (64 or 128);
    ``kv_stages``: depth of the K ring and of the V ring in shared memory (2 or 3);
    ``q_tiles``: Q tiles of 128 packed rows per CTA (1, or 2 with two softmax warpgroups taking turns on the
    tensor core, FlashAttention-4's layout);
    ``rescale_threshold`` (log2 units, 0..15; 0: the exact running max): a row's max is only raised when a block's
    max exceeds it by more than this, so O is rescaled rarely (FlashAttention-4's conditional rescaling; P then
    reaches up to ``2^threshold``, which 16 bits hold for threshold <= 15);
    ``num_ctas``: 0 for one CTA per (work row, kv head) tile, else a persistent grid of ``min(num_ctas, tiles)``
    CTAs, CTA ``i`` running tiles ``i, i + grid, i + 2 grid, ..`` (a static schedule: every role of the CTA derives
    the same sequence) with its TMEM allocated once and every pipeline's count carried from tile to tile (the
    package's ``default_tiles`` holds the rule which grid a problem gets).
    """

    tile_n: int = 128
    kv_stages: int = 2
    rescale_threshold: int = 8
    q_tiles: int = 1
    num_ctas: int = 0


def tmem_plan(tile_n: int, head_dim_vo: int, q_tiles: int = 1) -> dict[str, tuple[int, int]]:
    """The TMEM columns of each accumulator, ``name -> (first column, columns)``.

    One Q tile: ``S0``/``S1`` are two fp32 score buffers of ``tile_n`` columns (the MMA warp writes block
    ``i + 1``'s scores while the softmax warpgroup reads block ``i``'s), ``O`` the fp32 output accumulator
    (``head_dim_vo`` columns), ``P0``/``P1`` the 16-bit probabilities of the two S buffers (two per 32-bit
    column), read by the P V MMA as its A operand from TMEM; no region overlaps another.

    Two Q tiles: ``S0``/``S1`` and ``O0``/``O1`` belong to tiles 0 and 1; ``P0``/``P1`` lie in the upper half of
    their own tile's S buffer (:data:`TMEM_ALIASES`): the softmax warpgroup has all of S in registers before it
    writes P there, and the MMA warp issues tile ``t``'s P V before its next Q K^T, which tcgen05's in-order
    execution keeps behind the P V's reads.  Every region starts on a multiple of 32 columns.

    The 512 columns of an SM: head_dim_vo 64 and 128 fit with ``tile_n`` 128 (one Q tile: 2 * 128 + 128 + 2 * 64 =
    512 at 128, with 192/128 too); 256 fits one Q tile with ``tile_n`` 64 (2 * 64 + 256 + 2 * 32 = 448), not
    ``tile_n`` 128 (640) nor two Q tiles (two O of 256 alone fill 512): :func:`tmem_plan_reason` refuses those.
    """
    if q_tiles == 1:
        return {
            "S0": (0, tile_n),
            "S1": (tile_n, tile_n),
            "O": (2 * tile_n, head_dim_vo),
            "P0": (2 * tile_n + head_dim_vo, tile_n // 2),
            "P1": (2 * tile_n + head_dim_vo + tile_n // 2, tile_n // 2),
        }
    return {
        "S0": (0, tile_n),
        "S1": (tile_n, tile_n),
        "O0": (2 * tile_n, head_dim_vo),
        "O1": (2 * tile_n + head_dim_vo, head_dim_vo),
        "P0": (tile_n // 2, tile_n // 2),
        "P1": (tile_n + tile_n // 2, tile_n // 2),
    }


def tmem_aliases(q_tiles: int) -> dict[str, str]:
    """Regions of :func:`tmem_plan` that live inside another by design (``alias -> host``)."""
    return {} if q_tiles == 1 else {"P0": "S0", "P1": "S1"}


def page_rows(page_size: int, tile_n: int) -> int:
    """Rows of one K/V TMA box for paged K/V, ``min(page_size, tile_n)``, where whole blocks load one box per
    page (or per block inside a page): ``page_size >= 16``, one of ``tile_n`` / ``page_size`` divides the other,
    and the box is whole 8-row swizzle atoms (each box then starts on a 1 KiB boundary of the 128-byte swizzle);
    else 0 (the load warp gathers such blocks with cp.async)."""
    r = min(page_size, tile_n)
    if page_size >= 16 and (tile_n % page_size == 0 or page_size % tile_n == 0) and r % 8 == 0:
        return r
    return 0


def default_tile_n(problem: PrefillProblem) -> int:
    """The KV block of the package's ``default_tiles``: 64 at head_dim_vo 256 (the TMEM plan), else 128."""
    return 64 if problem.head_dim_vo == 256 else 128


def unsupported_reason(problem: PrefillProblem) -> str | None:
    """Why the SM100 prefill kernel cannot serve ``problem``, or None (the arch test included).

    Serves bf16/fp16 with head_dim_qk/head_dim_vo 64/64, 128/128, 192/128 and 256/256 (256: one Q tile
    of ``tile_n`` 64, :func:`tmem_plan`), causal (bottom-right) or not, a sliding window (``window_left``), a soft
    cap, custom masks (which replace causal), a ``score_mod`` (not with a soft cap), sinks, any ``group_size``
    dividing 128, on ``sm_100a`` / ``sm_103a``; ragged or paged K/V (any page size: one TMA box per page where
    :func:`page_rows` allows, a cp.async gather otherwise; not at head_dim 256).  Refuses paged head_dim 256, fp8
    K/V caches and positional encodings.
    """
    p = problem
    if p.arch not in ARCHS:
        return f"the SM100 prefill kernel builds for sm_100a / sm_103a only, got arch {p.arch!r}"
    if (p.head_dim_qk, p.head_dim_vo) not in HEAD_DIMS:
        return (f"head_dim_qk/head_dim_vo must be one of {', '.join(f'{a}/{b}' for a, b in HEAD_DIMS)}, got "
                f"{p.head_dim_qk}/{p.head_dim_vo}")
    if p.kv_dtype:
        return f"kv_dtype {p.kv_dtype!r} (an fp8 K/V cache) is served by the portable kernel"
    if p.page_size > 0 and p.head_dim_vo == 256:
        # (ptxas spills the KV block count across the roles' setmaxnreg: the resource gate refuses it)
        return "paged K/V at head_dim 256 is served by the portable kernel (the SM100 build spills)"
    if p.score_mod is not None and (not callable(p.score_mod) or p.use_soft_cap):
        return "score_mod must be a callable, and not combined with a soft cap (fold the cap into the score_mod)"
    if p.pos_encoding_mode != "NONE":
        return "positional encodings (RoPE / ALiBi) are served by the portable kernel"
    if TILE_M % p.group_size:
        return f"group_size must divide {TILE_M} (the query heads of a token share one MMA tile), got {p.group_size}"
    return None


def _tiles_reason(p: PrefillProblem, t: Tiles) -> str | None:
    for f in dataclasses.fields(Tiles):
        v = getattr(t, f.name)
        if isinstance(v, bool) or not isinstance(v, int):
            return f"{f.name} must be an int, got {v!r}"
    if t.tile_n not in (64, 128):
        return f"tile_n must be 64 or 128, got {t.tile_n}"
    if t.kv_stages not in (2, 3):
        return f"kv_stages must be 2 or 3, got {t.kv_stages}"
    if t.q_tiles not in (1, 2):
        return f"q_tiles must be 1 or 2, got {t.q_tiles}"
    if t.num_ctas < 0:
        return f"num_ctas must be >= 0 (0: one CTA per tile), got {t.num_ctas}"
    if not 0 <= t.rescale_threshold <= 15:
        return f"rescale_threshold must be in 0..15 (P <= 2^threshold must fit 16 bits), got {t.rescale_threshold}"
    if t.q_tiles == 2 and p.head_dim_qk > 128:
        # (ptxas spills the Q descriptors of 2 x head_dim_qk / 16 K steps out of the MMA warp's 32 registers)
        return f"q_tiles=2 serves head_dim_qk <= 128 (the MMA warp's register budget), got {p.head_dim_qk}"
    return tmem_plan_reason(tmem_plan(t.tile_n, p.head_dim_vo, t.q_tiles), tmem_aliases(t.q_tiles))


@dataclass(frozen=True)
class Config:
    """The compile key of the SM100 prefill kernel: a problem and the tiles chosen for it.

    Raises TypeError when the halves are not a :class:`PrefillProblem` and a :class:`Tiles`; ValueError naming
    the reason when the kernel cannot serve ``problem`` (:func:`unsupported_reason`) or ``tiles`` do not fit it
    (field ranges, the TMEM plan, shared memory).
    """

    problem: PrefillProblem
    tiles: Tiles

    def __post_init__(self):
        if not isinstance(self.problem, PrefillProblem) or not isinstance(self.tiles, Tiles):
            raise TypeError(f"Config(problem, tiles) takes a PrefillProblem and a Tiles, got "
                            f"{type(self.problem).__name__} and {type(self.tiles).__name__}")
        reason = unsupported_reason(self.problem) or _tiles_reason(self.problem, self.tiles)
        if reason is None and self.smem_bytes > SMEM_LIMIT:
            reason = f"needs {self.smem_bytes} B of shared memory (> {SMEM_LIMIT})"
        if reason:
            raise ValueError(f"SM100 prefill: {reason}")

    @property
    def cutlass_dtype(self):
        """The CuTe DSL element type of q, k, v and o."""
        return element_type(self.problem.dtype)

    @property
    def tile_m(self) -> int:
        """Packed query rows per CTA (the work table's tile): 128 per Q tile."""
        return TILE_M * self.tiles.q_tiles

    @property
    def roles(self) -> Roles:
        """The warp roles and their register budgets."""
        return Roles(self.tiles.q_tiles, self.tiles.num_ctas > 0)

    @property
    def positive_scale_only(self) -> bool:
        """Whether the launch needs ``sm_scale > 0``: without a soft cap or ``score_mod`` the row max is taken on
        raw ``q.k`` and the scale folded in after."""
        return not (self.problem.use_soft_cap or self.problem.score_mod is not None)

    @property
    def page_rows(self) -> int:
        """Rows of one paged K/V TMA box (:func:`page_rows`; 0 for ragged K/V)."""
        return page_rows(self.problem.page_size, self.tiles.tile_n) if self.problem.page_size > 0 else 0

    @property
    def tmem(self) -> dict[str, tuple[int, int]]:
        """The TMEM column plan (:func:`tmem_plan`)."""
        return tmem_plan(self.tiles.tile_n, self.problem.head_dim_vo, self.tiles.q_tiles)

    @property
    def tmem_cols(self) -> int:
        """TMEM columns allocated per CTA."""
        return tmem_alloc_cols(self.tmem)

    @property
    def epi_stages(self) -> int:
        """Staging buffers of ``128 x EPI_COLS`` 16-bit O values between the correction warpgroup and the epilogue
        warp: two where shared memory holds them (the correction warpgroup fills one while the epilogue warp
        stores the other), else one; 0 where not even one fits (head_dim 128 with three 128-token K/V stages):
        the correction warpgroup then stores O itself and the epilogue warp idles."""
        for n in (2, 1):
            if self._smem(n) <= SMEM_LIMIT:
                return n
        return 0

    @property
    def smem_bytes(self) -> int:
        """Shared memory of the kernel's storage: the mbarriers, the TMEM base address, the per-row statistics and
        the staged rows' LSE (padded to the 1 KiB alignment of the buffers), then Q, the K and V rings and the O
        staging buffers (:attr:`epi_stages`)."""
        return self._smem(self.epi_stages)

    def _smem(self, epi_stages: int) -> int:
        p, t, e = self.problem, self.tiles, 2
        qt = t.q_tiles
        n_mbar = 2 * qt + 4 * t.kv_stages + 4 + 4 + 2 * qt + 2 * qt + 1 + 2 * epi_stages
        head = -(-(8 * n_mbar + 4 + 4 * 2 * TILE_M * qt + 4 * TILE_M * epi_stages) // 1024) * 1024
        q = TILE_M * t.q_tiles * p.head_dim_qk * e
        kv = t.kv_stages * t.tile_n * (p.head_dim_qk + p.head_dim_vo) * e
        return head + q + kv + epi_stages * TILE_M * EPI_COLS * e
