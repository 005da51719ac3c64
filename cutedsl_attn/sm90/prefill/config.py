"""The SM90 prefill kernel's configuration: the tile choices (:class:`Tiles`) and the compile key (:class:`Config`).

The problem half is :class:`cutedsl_attn.planning.prefill.PrefillProblem` (what the caller fixes); this module
holds what the kernel chooses, with coupled choices folded into enums so that an impossible combination cannot
be written, and the one list of what the kernel refuses (:func:`unsupported_reason`, :meth:`Config.__post_init__`).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass


from ...common.dtypes import element_type
from ...planning.prefill import PrefillProblem

SMEM_LIMIT = 227 * 1024
HEAD_DIMS_QK = (64, 128, 192, 256)
HEAD_DIMS_VO = (64, 128, 256)


class Epilogue(enum.Enum):
    """How O leaves the consumer registers."""

    REGS = "regs"  # 4-byte global stores straight from the accumulator
    SMEM = "smem"  # staged (stmatrix) in the warpgroup's own Q rows, then whole-row 16-byte stores
    SMEM_TMA = "smem_tma"  # staged, then one TMA store per 64 columns for a warp whose 16 rows lie in the request


class LoopOrder(enum.Enum):
    """Order of the main loop (FlashAttention's variants)."""

    FA3 = "fa3"  # one loop; V waited for before the ping-pong turn; masks where a block needs them
    SPLIT = "split"  # the masked blocks (sequence end, causal diagonal) in their own loop, the rest without mask code
    SPLIT_LATE_V = "split_late_v"  # SPLIT, and V waited for inside the turn, after issuing S


class Softmax(enum.Enum):
    """The online softmax of the blocks the main loop knows to be unmasked."""

    EXACT = "exact"  # row max first, then the exponentials
    STALE = "stale"  # against the running max as it stands; a warpgroup redoes the block where a row sum overflows


class TileInfo(enum.Enum):
    """Where the consumers read a tile's work-table fields."""

    GLOBAL = "global"  # from the work table in global memory, when needed
    GLOBAL_EARLY = "global_early"  # the epilogue's coordinates read right after the main loop (behind the last P V)
    SMEM = "smem"  # copied next to the tile index in shared memory by the producer
    SMEM_EARLY = "smem_early"  # SMEM, and the epilogue's coordinates read there before the Q stage's release


@dataclass(frozen=True)
class Tiles:
    """What the SM90 prefill kernel chooses for a problem (:func:`default_tiles` gives the measured default).

    ``tile_n``: KV tokens per block (a multiple of 16 in [64, 192]); ``num_stages``: K/V ring depth (2, 3);
    ``num_wg``: consumer warpgroups of 64 query rows each (2, 3); ``pingpong``: the consumer warpgroups take
    turns issuing GEMMs; ``q_stages``: Q buffers (2 lets the next tile's Q load during this one's epilogue);
    ``num_ctas``: 0 for one CTA per tile, else a persistent grid of ``min(num_ctas, tiles)`` CTAs claiming
    tiles from an atomic counter (ragged K/V; paged problems ignore it); ``head_section_mib``: ragged K/V tiles
    go out in sections of kv heads whose K+V fit this many MiB (0: one head at a time; paged problems ignore it);
    ``loop_order`` / ``softmax`` / ``epilogue`` / ``tile_info``: the enums above; ``p_tail`` (``STALE`` with a
    ``SPLIT*`` loop): the unmasked loop waits for the previous P V once all but the last ``p_tail`` n8 tiles of
    exponentials are issued and converts those P words while the rest run; ``p_wait_lead``: that wait pinned
    this many n8 tiles earlier by an arrive on a dummy mbarrier; ``rescale_threshold`` (log2 units, 0..15): a
    row's max may grow this much before O is rescaled; ``rescale_o_before_pv``: O is rescaled while the S GEMM
    runs (else after the P V GEMM completes).
    """

    tile_n: int = 128
    num_stages: int = 2
    num_wg: int = 2
    pingpong: bool = True
    q_stages: int = 1
    num_ctas: int = 0
    head_section_mib: int = 0
    loop_order: LoopOrder = LoopOrder.FA3
    softmax: Softmax = Softmax.EXACT
    p_tail: int = 0
    p_wait_lead: int = 0
    rescale_threshold: int = 0
    rescale_o_before_pv: bool = False
    epilogue: Epilogue = Epilogue.REGS
    tile_info: TileInfo = TileInfo.GLOBAL


TUNING_FIELDS = tuple(f.name for f in dataclasses.fields(Tiles))


def _page_rows(page_size: int, tile_n: int) -> int:
    """``min(page_size, tile_n)`` when full blocks of paged K/V can load by TMA, one box of that many rows per
    page (or per block): ``page_size >= 16``, one of ``tile_n`` / ``page_size`` divides the other, and the box
    is whole 8-row swizzle atoms (so each box starts on a 1 KiB boundary of the 128-byte swizzle); else 0."""
    r = min(page_size, tile_n)
    if page_size >= 16 and (tile_n % page_size == 0 or page_size % tile_n == 0) and r % 8 == 0:
        return r
    return 0


def unsupported_reason(problem: PrefillProblem) -> str | None:
    """Why the SM90 prefill kernel cannot serve ``problem``, or None (the arch test included).

    Serves bf16/fp16 with head_dim_qk 64/128/192/256 and head_dim_vo 64/128/256, ragged or paged K/V, causal,
    sliding window, soft cap, sinks, custom masks and a ``score_mod``, on ``sm_90a``; not positional encodings
    (RoPE / ALiBi: the portable kernel), not fp8 K/V caches (the portable kernel) and not a ``group_size`` that
    does not divide 128.
    """
    if not str(problem.arch).startswith("sm_90"):
        return f"the SM90 kernel builds for sm_90a only, got arch {problem.arch!r}"
    if problem.kv_dtype:
        return f"kv_dtype {problem.kv_dtype!r} (an fp8 K/V cache) is served by the portable kernel"
    if problem.head_dim_qk not in HEAD_DIMS_QK or problem.head_dim_vo not in HEAD_DIMS_VO:
        return (f"head_dim_qk must be 64/128/192/256 and head_dim_vo 64/128/256, got "
                f"{problem.head_dim_qk}/{problem.head_dim_vo}")
    if problem.pos_encoding_mode != "NONE":
        return "positional encodings are served by the portable kernel"
    if problem.score_mod is not None and (not callable(problem.score_mod) or problem.use_soft_cap):
        return "score_mod must be a callable, and not combined with a soft cap (fold the cap into the score_mod)"
    if 128 % problem.group_size != 0:
        return f"group_size must divide 128, got {problem.group_size}"
    return None


def _tiles_reason(p: PrefillProblem, t: Tiles) -> str | None:
    """Why ``t`` cannot serve ``p`` (field types, ranges, shared memory), or None."""
    for f in dataclasses.fields(Tiles):
        v, want = getattr(t, f.name), type(f.default)
        if want is bool or want is int:  # bool fields take bools, int ones ints (not bools)
            if (want is bool) != isinstance(v, bool) or not isinstance(v, int):
                return f"{f.name} must be {'a bool' if want is bool else 'an int'}, got {v!r}"
        elif not isinstance(v, want):
            return f"{f.name} must be a {want.__name__}, got {v!r}"
    if not 64 <= t.tile_n <= 192 or t.tile_n % 16:
        return f"tile_n must be a multiple of 16 in [64, 192], got {t.tile_n}"
    if t.num_stages not in (2, 3):
        return f"num_stages must be 2 or 3, got {t.num_stages}"
    if t.num_wg not in (2, 3) or (64 * t.num_wg) % p.group_size:
        return f"num_wg must be 2 or 3 with 64 * num_wg a multiple of group_size, got {t.num_wg}"
    if t.q_stages not in (1, 2):
        return f"q_stages must be 1 or 2, got {t.q_stages}"
    if not 0 <= t.rescale_threshold <= 15:  # P <= 2^threshold must fit float16 (max 65504)
        return f"rescale_threshold must be in 0..15, got {t.rescale_threshold}"
    if t.softmax is Softmax.STALE and (p.use_soft_cap or p.score_mod is not None or p.use_custom_mask):
        return "softmax=stale needs logits scaled by sm_scale alone (no soft cap or score_mod) and no custom mask"
    if (t.p_tail or t.p_wait_lead) and (t.softmax is not Softmax.STALE or t.loop_order is LoopOrder.FA3):
        return "p_tail / p_wait_lead shape the stale softmax of a split loop: need softmax=stale and loop_order split*"
    if t.p_wait_lead < 0:
        return f"p_wait_lead must be >= 0, got {t.p_wait_lead}"
    if not 0 <= t.p_tail < t.tile_n // 8:
        return f"p_tail (n8 tiles of P converted after the softmax) must be in 0..{t.tile_n // 8 - 1}, got {t.p_tail}"
    if t.epilogue is not Epilogue.REGS and p.head_dim_vo > p.head_dim_qk:
        return "a staged epilogue writes O into the Q rows: needs head_dim_vo <= head_dim_qk"
    if t.epilogue is Epilogue.SMEM_TMA and 16 % p.group_size:
        return f"epilogue=smem_tma stores a warp's 16 rows as whole query tokens: needs group_size | 16, got {p.group_size}"
    if t.epilogue is not Epilogue.REGS and t.tile_info in (TileInfo.GLOBAL_EARLY, TileInfo.SMEM_EARLY):
        return "tile_info=*_early reads the epilogue's coordinates before the Q release: needs epilogue=regs"
    if not 0 <= t.head_section_mib <= 1024:
        return f"head_section_mib must be in 0..1024, got {t.head_section_mib}"
    if t.num_ctas < 0:
        return f"num_ctas must be >= 0, got {t.num_ctas}"
    return None


@dataclass(frozen=True)
class Config:
    """The compile key of the SM90 prefill kernel: a problem and the tiles chosen for it.

    Raises ValueError naming the reason when the kernel cannot serve ``problem`` (:func:`unsupported_reason`)
    or ``tiles`` do not fit it (a field's type or range, shared memory); TypeError when the halves are not a
    :class:`PrefillProblem` and a :class:`Tiles`.
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
            raise ValueError(f"SM90 prefill: {reason}")

    @property
    def cutlass_dtype(self):
        """The CuTe DSL element type of q, k, v and o."""
        return element_type(self.problem.dtype)

    @property
    def tile_m(self) -> int:
        """Packed query rows per tile: 64 per consumer warpgroup."""
        return 64 * self.tiles.num_wg

    @property
    def num_threads(self) -> int:
        """Threads per CTA: a producer warpgroup and ``num_wg`` consumer warpgroups."""
        return 128 * (self.tiles.num_wg + 1)

    @property
    def positive_scale_only(self) -> bool:
        """Whether the launch needs ``sm_scale > 0``: without a soft cap or ``score_mod`` the scale is folded into
        the exponent after the row max of the raw logits, which is the max of the scaled ones only then."""
        return not (self.problem.use_soft_cap or self.problem.score_mod is not None)

    @property
    def registers(self) -> tuple[int, int]:
        """(consumer, producer) registers per thread after ``setmaxnreg``."""
        if self.tiles.num_wg == 3:
            return (160, 32)
        return (232, 40) if self.problem.page_size > 0 else (240, 24)  # the cp.async gather needs producer registers

    @property
    def page_rows(self) -> int:
        """Rows of one K/V TMA box for paged K/V: ``min(page_size, tile_n)`` where ``page_size >= 16``, a block of
        ``tile_n`` tokens is whole pages or lies inside one page, and the box is whole 8-row swizzle atoms; else 0
        (every block gathered with cp.async)."""
        return _page_rows(self.problem.page_size, self.tiles.tile_n)

    @property
    def num_ctas(self) -> int:
        """CTAs of the persistent grid (0: one CTA per tile); ragged K/V only."""
        return self.tiles.num_ctas if self.problem.page_size == 0 else 0

    @property
    def head_section_mib(self) -> int:
        """The kv-head section budget of the tile order (0: one head at a time); ragged K/V only."""
        return self.tiles.head_section_mib if self.problem.page_size == 0 else 0

    @property
    def pins_pv_wait(self) -> bool:
        """Whether the unmasked loop's mid-softmax wait for P V is pinned (``p_wait_lead``; its dummy mbarrier)."""
        return self.tiles.p_tail > 0 and self.tiles.p_wait_lead > 0 and not self.problem.use_window

    @property
    def smem_bytes(self) -> int:
        """Shared memory of Q, the K/V rings and the barriers (each buffer 1 KiB aligned)."""
        p, t, e = self.problem, self.tiles, 2
        q = t.q_stages * self.tile_m * p.head_dim_qk * e
        k = t.num_stages * t.tile_n * p.head_dim_qk * e
        v = t.num_stages * t.tile_n * p.head_dim_vo * e
        return 1024 + q + k + v + 1024


def _parse(name: str, text: str, default):
    """One ``CUTEDSL_ATTN_PREFILL_TUNE`` value for field ``name`` (typed like its ``default``)."""
    text = text.strip()
    if isinstance(default, bool):
        if text.lower() not in ("0", "1", "true", "false"):
            raise ValueError(f"{name} takes 0/1/true/false, got {text!r}")
        return text.lower() in ("1", "true")
    if isinstance(default, enum.Enum):
        names = [m.name.lower() for m in type(default)]
        if text.lower() not in names:
            raise ValueError(f"{name} takes one of {names}, got {text!r}")
        return type(default)[text.upper()]
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} takes an integer, got {text!r}") from None


def override_tiles(tiles: Tiles, items: dict[str, str]) -> Tiles:
    """``tiles`` with the fields named in ``items`` replaced (the tuning hook: ``{"tile_n": "128", "epilogue":
    "smem"}``): int fields take integers, bool fields ``0/1/true/false``, enum fields a member's lowercase name.

    Raises ValueError naming the key and its allowed values for a key outside :data:`TUNING_FIELDS` or a value
    that does not parse; ranges and combinations are checked by :class:`Config`.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(Tiles)}
    out = {}
    for key, text in items.items():
        if key not in defaults:
            raise ValueError(f"{key!r} is not a tuning field of the SM90 prefill kernel; fields: {TUNING_FIELDS}")
        out[key] = _parse(key, str(text), defaults[key])
    return dataclasses.replace(tiles, **out)
