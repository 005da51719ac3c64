"""Host-side planning for MLA (absorbed form, one latent KV head shared by every query head).

Pure Python/torch on the CPU; imports only :mod:`.decode` (its split planner).  The query rows of a
request, ``qo_len x num_heads`` of them, are packed into 16-row MMA tiles (row ``r`` is query token
``r // num_heads``, head ``r % num_heads``); the grid is ``(row tiles, work items)``.

Work-table row (int32, :data:`MLA_WORK_COLS` columns, the contract with
``cutedsl_attn.portable.mla_decode``): the paged-decode columns of :mod:`.decode` followed by the request's
first query row and query length::

    [batch_idx, tok_start, tok_end, kv_len, page_off, num_splits, part_base, split_idx, q_start, qo_len]

``batch_idx = -1`` marks a padding row (CUDA-graph mode launches a fixed grid).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .decode import WORK_COLS, max_items, plan_paged_decode

MLA_WORK_COLS = WORK_COLS + 2
W_Q_START, W_QO_LEN = WORK_COLS, WORK_COLS + 1
TILE_M = 16  # query rows per CTA: the M of one mma.m16n8k16 tile
HEAD_DIM_CKV = 512
HEAD_DIM_KPE = 64
DTYPES = ("bfloat16", "float16", "float8_e4m3fn")
KV_DTYPES = ("", "float8_e4m3fn")  # "": the caches have q's dtype
SPLIT_ALIGN = 64  # tokens: the wave-filling cuts fall on the SM90 kernel's 64-token blocks (whole portable chunks)
SPLIT_FIELDS = ("split_waves", "split_min_tokens")  # MlaSplit's fields as tuning keys (CUTEDSL_ATTN_MLA_TUNE)


@dataclass(frozen=True)
class MlaProblem:
    """What an MLA caller fixes at ``plan()`` (the problem half of an MLA kernel's config and key).

    ``dtype`` q's element type: ``"bfloat16"`` / ``"float16"`` (o too) or ``"float8_e4m3fn"`` (o is bf16);
    ``kv_dtype`` the caches' element type: ``""`` (the default) or ``dtype`` itself (normalised to ``""``) for
    caches of q's dtype, ``"float8_e4m3fn"`` for fp8 caches under a 16-bit q.  fp8 data are plain e4m3 values:
    per-tensor q / k / v scales are the caller's, folded into ``sm_scale`` and ``output_scale``
    (:class:`MlaArgs`).  ``head_dim_ckv`` 512 and ``head_dim_kpe`` 64 (DeepSeek's, the only ones served);
    ``page_size`` 1..64; ``causal`` the bottom-right mask of multi-token rows; ``arch`` the compile target.
    Batch, heads, lengths, pages, strides and the scales are run-time arguments (:class:`MlaArgs`).

    Raises TypeError for a non-int / non-bool / non-str field, ValueError for a dtype or page size out of
    range (an fp8 q over 16-bit caches included), NotImplementedError for other head dims (naming the ones
    served) and for ``"float8_e5m2"``.
    """

    dtype: str
    page_size: int
    head_dim_ckv: int = HEAD_DIM_CKV
    head_dim_kpe: int = HEAD_DIM_KPE
    causal: bool = False
    arch: str = "sm_90a"
    kv_dtype: str = ""

    def __post_init__(self):
        for name in ("page_size", "head_dim_ckv", "head_dim_kpe"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {v!r}")
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be a bool, got {self.causal!r}")
        if not isinstance(self.kv_dtype, str):
            raise TypeError(f"kv_dtype must be a str, got {self.kv_dtype!r}")
        for name in ("dtype", "kv_dtype"):
            if getattr(self, name) == "float8_e5m2":
                raise NotImplementedError(f"{name} 'float8_e5m2' is not supported; fp8 MLA data must be "
                                          "'float8_e4m3fn'")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'bfloat16', 'float16' or 'float8_e4m3fn', got {self.dtype!r}")
        if self.kv_dtype == self.dtype:
            object.__setattr__(self, "kv_dtype", "")  # one spelling of caches of q's dtype: one compile key
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be '' (q's dtype), {self.dtype!r} or 'float8_e4m3fn', got "
                             f"{self.kv_dtype!r}" + (" (an fp8 q needs fp8 caches)" if self.q_fp8 else ""))
        if (self.head_dim_ckv, self.head_dim_kpe) != (HEAD_DIM_CKV, HEAD_DIM_KPE):
            raise NotImplementedError(
                f"head_dim_ckv={self.head_dim_ckv}, head_dim_kpe={self.head_dim_kpe} is not supported; MLA serves "
                f"head_dim_ckv={HEAD_DIM_CKV} with head_dim_kpe={HEAD_DIM_KPE} (DeepSeek V2/V3/R1)")
        if not 1 <= self.page_size <= 64:
            raise ValueError(f"page_size must be in [1, 64], got {self.page_size}")

    @property
    def q_fp8(self) -> bool:
        """Whether q is fp8 e4m3 (its caches are then fp8 too, o is bf16)."""
        return self.dtype == "float8_e4m3fn"

    @property
    def kv_fp8(self) -> bool:
        """Whether the ckv / kpe caches are fp8 e4m3 (1 byte per element)."""
        return self.kv_dtype == "float8_e4m3fn" or self.q_fp8

    @property
    def out_dtype(self) -> str:
        """o's element type: q's, bf16 for an fp8 q."""
        return "bfloat16" if self.q_fp8 else self.dtype


class MlaArgs(NamedTuple):
    """One MLA launch's tensors and scalars (the MLA kernel's ``launch`` orders them).

    q_nope ``[tokens, H, 512]`` and q_pe ``[tokens, H, 64]`` of the problem's ``dtype`` (last dim contiguous,
    16-byte aligned strides); ckv ``[pages, page_size, 512]`` and kpe ``[pages, page_size, 64]`` (same; fp8
    e4m3 for a problem with fp8 caches); ``indices`` int32 flat page ids; ``work`` int32 ``[W, MLA_WORK_COLS]``
    (:func:`plan_mla`); ``out`` ``[tokens, H, 512]`` of the problem's ``out_dtype`` (last dim contiguous,
    written); ``lse`` fp32 ``[tokens, H]`` base 2 contiguous (written); ``part_o`` fp32 ``[P, R, 512]`` and
    ``part_lse`` fp32 ``[P, R]`` split-KV partials (``R >= max qo_len x H``); ``counters`` int32, one per
    (request, row tile), left at 0; ``sm_scale`` the softmax scale; ``num_row_tiles`` the grid's x extent
    (:attr:`MlaWorkPlan.row_tiles`); ``output_scale`` multiplies O in fp32 before the 16-bit rounding
    (FlashInfer's ``v_scale / o_scale``, trtllm's ``bmm2_scale``).  With fp8 data ``sm_scale`` carries the
    q and k scales and ``output_scale`` the v scale: the kernel widens e4m3 exactly and applies no scale of
    its own.
    """

    q_nope: Any
    q_pe: Any
    ckv: Any
    kpe: Any
    indices: Any
    work: Any
    out: Any
    lse: Any
    part_o: Any
    part_lse: Any
    counters: Any
    sm_scale: float
    num_row_tiles: int
    output_scale: float = 1.0


@dataclass(frozen=True)
class MlaWorkPlan:
    """Result of :func:`plan_mla`: ``work`` CPU int32 ``[num_rows, MLA_WORK_COLS]`` (rows past ``num_work``
    are padding), ``num_partials`` fp32 partial rows split-KV needs, ``row_tiles`` the grid's x extent
    (16-row tiles of the longest request), ``rows`` = max qo_len x num_heads (``part_o``'s second dim),
    ``split_tokens`` the modelled split length (the longest piece under :class:`MlaSplit` ``waves`` > 0; 0: none
    split)."""

    work: torch.Tensor
    num_work: int
    num_partials: int
    split_tokens: int
    row_tiles: int
    rows: int


@dataclass(frozen=True)
class MlaSplit:
    """How :func:`plan_mla` cuts requests into split-KV pieces (plan only: no kernel reads it, so it is no part of
    a compile key).

    ``waves`` 0 (the default): the paged-decode planner's modelled split (one wave of CTAs for few long requests;
    the plans of before this field).  ``waves`` > 0: the grid (kernel row tiles x work items) is filled up to
    ``floor(waves x num_sms x ctas_per_sm)`` CTAs with the shortest pieces that fit (for few requests over long
    contexts: ``waves`` 2, 4 give two, four waves of shorter pieces); each split request is cut evenly into
    pieces of whole :data:`SPLIT_ALIGN`-token blocks, at least ``min_tokens / SPLIT_ALIGN`` of them (``min_tokens``
    a positive multiple of :data:`SPLIT_ALIGN`; a request's last block may be partial, and a request of fewer
    than twice that many blocks stays whole), and at most the kernel's ``max_splits_per_request`` pieces.

    Raises TypeError for a non-real ``waves`` / non-int ``min_tokens``, ValueError for a negative or non-finite
    ``waves`` or a ``min_tokens`` that is not a positive multiple of :data:`SPLIT_ALIGN`.
    """

    waves: float = 0.0
    min_tokens: int = 2 * SPLIT_ALIGN

    def __post_init__(self):
        if isinstance(self.waves, bool) or not isinstance(self.waves, numbers.Real):
            raise TypeError(f"split_waves must be a number, got {self.waves!r}")
        if not math.isfinite(self.waves) or self.waves < 0:
            raise ValueError(f"split_waves must be finite and >= 0 (0: the modelled split), got {self.waves!r}")
        object.__setattr__(self, "waves", float(self.waves))  # (one spelling of 2 and 2.0: one graph signature)
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int):
            raise TypeError(f"split_min_tokens must be an int, got {self.min_tokens!r}")
        if self.min_tokens <= 0 or self.min_tokens % SPLIT_ALIGN:
            raise ValueError(f"split_min_tokens must be a positive multiple of {SPLIT_ALIGN} tokens, got "
                             f"{self.min_tokens}")

    @classmethod
    def from_items(cls, items: dict[str, str], base: "MlaSplit | None" = None) -> "MlaSplit":
        """``base`` (default: ``MlaSplit()``) with the :data:`SPLIT_FIELDS` keys of ``items`` (key -> decimal
        text, other keys ignored) replaced.  Raises ValueError naming the key for text that is not a number (an
        integer for ``split_min_tokens``), and the constructor's errors."""
        base = cls() if base is None else base
        waves, min_tokens = base.waves, base.min_tokens
        try:
            if "split_waves" in items:
                waves = float(items["split_waves"])
            if "split_min_tokens" in items:
                min_tokens = int(items["split_min_tokens"])
        except ValueError:
            bad = {k: v for k, v in items.items() if k in SPLIT_FIELDS}
            raise ValueError(f"split_waves must be a number and split_min_tokens an integer, got {bad}") from None
        return cls(waves=waves, min_tokens=min_tokens)


def row_tiles(max_qo_len: int, num_heads: int) -> int:
    """16-row tiles of ``max_qo_len x num_heads`` packed query rows."""
    return max(1, -(-max_qo_len * num_heads // TILE_M))


def _check_tile_m(tile_m) -> int:
    if isinstance(tile_m, bool) or not isinstance(tile_m, int):
        raise TypeError(f"tile_m must be an int, got {tile_m!r}")
    if tile_m <= 0 or tile_m % TILE_M:
        raise ValueError(f"tile_m must be a positive multiple of {TILE_M}, got {tile_m}")
    return tile_m


def kernel_row_tiles(num_row_tiles: int, tile_m: int = TILE_M) -> int:
    """The ``tile_m``-row tiles (one CTA each per work item) covering ``num_row_tiles`` 16-row tiles.  Raises
    TypeError / ValueError for a ``tile_m`` that is not a positive int multiple of 16."""
    return max(1, -(-num_row_tiles * TILE_M // _check_tile_m(tile_m)))


def max_work_rows(batch_size: int, num_row_tiles: int, *, num_sms: int, ctas_per_sm: int,
                  tile_m: int = TILE_M, split: MlaSplit | None = None) -> int:
    """The most work items :func:`plan_mla` makes for ``batch_size`` requests of at most ``num_row_tiles`` 16-row
    tiles (CUDA-graph buffers: pass it as ``num_rows``), with the same ``num_sms``, ``ctas_per_sm``, ``tile_m``
    and ``split`` as the plan.  Raises like :func:`kernel_row_tiles`, TypeError for a ``split`` that is not an
    :class:`MlaSplit`."""
    split = _check_split(split)
    tiles = kernel_row_tiles(num_row_tiles, tile_m)
    slots = max(1, num_sms * ctas_per_sm)
    return max(max_items(batch_size, tiles, slots), _wave_budget(split, tiles, slots))


def _check_split(split) -> MlaSplit:
    if split is None:
        return MlaSplit()
    if not isinstance(split, MlaSplit):
        raise TypeError(f"split must be an MlaSplit, got {type(split).__name__}")
    return split


def _wave_budget(split: MlaSplit, kernel_tiles: int, slots: int) -> int:
    """Work items of ``kernel_tiles`` CTAs each that ``split.waves`` waves of ``slots`` CTAs hold (0: modelled)."""
    return int(split.waves * slots) // kernel_tiles if split.waves > 0 else 0


def wave_split_counts(lens: list[int], budget: int, min_tokens: int, max_splits: int | None) -> list[int]:
    """Pieces of each request (``lens`` tokens) under :class:`MlaSplit` ``waves`` > 0, counted in
    :data:`SPLIT_ALIGN`-token blocks (a request of ``L`` tokens spans ``NB = ceil(L / SPLIT_ALIGN)``): the fewest
    blocks ``pb`` a piece (at least ``min_tokens / SPLIT_ALIGN``) for which ``ceil(NB / pb)`` pieces a request,
    but at most ``NB // (min_tokens / SPLIT_ALIGN)`` and ``max_splits`` (None: no cap) and at least 1, add up to
    no more than ``budget`` work items.  All ones (no split) when ``budget`` does not exceed the batch."""
    ones = [1] * len(lens)
    if budget <= len(lens) or not lens:
        return ones
    min_blocks = min_tokens // SPLIT_ALIGN
    nbs = [-(-L // SPLIT_ALIGN) for L in lens]
    caps = [nb // min_blocks if max_splits is None else min(nb // min_blocks, max_splits) for nb in nbs]

    def counts(pb: int) -> list[int]:
        return [max(1, min(-(-nb // pb), c)) for nb, c in zip(nbs, caps)]

    lo, hi = min_blocks, max(min_blocks, max(nbs))  # at hi blocks every request is one piece: within the budget
    while lo < hi:  # the fewest blocks a piece whose counts fit (counts never grow with the piece length)
        mid = (lo + hi) // 2
        if sum(counts(mid)) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return counts(lo)


def even_pieces(length: int, n: int) -> list[int]:
    """``length`` tokens (``NB = ceil(length / SPLIT_ALIGN)`` blocks) cut into ``n <= NB`` pieces of whole
    :data:`SPLIT_ALIGN`-token blocks, ``ceil(NB / n)`` blocks for the first ``NB % n`` pieces and ``NB // n`` for the
    rest (the last one ends at ``length``, its last block partial): no piece is empty, none spans more blocks
    than ``ceil(NB / n)``.  Raises ValueError for ``n`` outside ``[1, NB]``."""
    nb = -(-length // SPLIT_ALIGN)
    if not 1 <= n <= max(1, nb):
        raise ValueError(f"{length} tokens ({nb} blocks of {SPLIT_ALIGN}) cannot be cut into {n} non-empty pieces")
    q, r = divmod(nb, n)
    cuts = [0]
    for i in range(n):
        cuts.append(min(length, cuts[-1] + (q + (i < r)) * SPLIT_ALIGN))
    return [b - a for a, b in zip(cuts, cuts[1:])]


def _wave_table(kv_lens: torch.Tensor, page_offsets: torch.Tensor, counts: list[int], num_rows: int | None):
    """The paged-decode table (:mod:`.decode`'s columns) of requests cut into ``counts`` :func:`even_pieces`, longest
    first; ``(work, num_work, num_partials, split_tokens)``."""
    lens = kv_lens.to(torch.int64).tolist()
    offs = page_offsets.to(torch.int64).tolist()
    rows: list[list[int]] = []
    part, longest = 0, 0
    for b, (L, n) in enumerate(zip(lens, counts)):
        if n == 1:
            rows.append([b, 0, L, L, offs[b], 1, 0, 0])
            continue
        a = 0
        for i, plen in enumerate(even_pieces(L, n)):
            rows.append([b, a, a + plen, L, offs[b], n, part, i])
            a += plen
            longest = max(longest, plen)
        part += n
    rows.sort(key=lambda r: r[2] - r[1], reverse=True)  # (stable) the longest pieces start first
    num_work = len(rows)
    if num_rows is not None:
        if num_work > num_rows:
            raise ValueError(f"the plan needs {num_work} work items but the CUDA-graph buffers hold {num_rows}")
        rows.extend([[-1, 0, 0, 0, 0, 1, 0, 0]] * (num_rows - num_work))
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, WORK_COLS), num_work, part, longest


def plan_mla(
    qo_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    q_starts: torch.Tensor,
    page_offsets: torch.Tensor,
    *,
    num_heads: int,
    page_size: int,
    num_sms: int = 132,
    ctas_per_sm: int = 1,
    disable_split_kv: bool = False,
    num_rows: int | None = None,
    max_splits_per_request: int | None = None,
    fixed_row_tiles: int | None = None,
    tile_m: int = TILE_M,
    split: MlaSplit | None = None,
) -> MlaWorkPlan:
    """Build the MLA work table: split-KV items in :mod:`.decode`'s columns, by default
    :func:`~cutedsl_attn.planning.decode.plan_paged_decode`'s (the kernel's row tiles play the kv heads' part: each
    tile of a request sees the same pieces), with ``split.waves`` > 0 the wave-filling cut of :class:`MlaSplit`,
    plus each item's ``q_start`` and ``qo_len``.

    Args:
      qo_lens, kv_lens, q_starts, page_offsets: ``[B]`` (CPU, any int dtype): query rows, KV tokens, first
        query row and first ``kv_indices`` entry of each request.
      num_heads, page_size: the problem's.
      num_sms, ctas_per_sm: CTAs one wave holds (the split heuristic fills it); ``ctas_per_sm`` counts CTAs
        of the kernel that runs the plan.
      disable_split_kv: one work item per request.
      num_rows: pad the table to this many rows (CUDA-graph mode); ValueError if the plan needs more.
      max_splits_per_request: the kernel's merge limit (the modelled split raises ValueError above it; the
        wave-filling cut stays within it).
      fixed_row_tiles: the grid's x extent (CUDA-graph mode keeps the first plan's); ValueError when the
        batch's longest request needs more.
      tile_m: query rows of one CTA of the kernel that runs the plan (a positive multiple of 16; 16: the
        portable kernel's): the split heuristic counts ``ceil(row_tiles * 16 / tile_m)`` CTAs per work item.
        The table, ``row_tiles`` and ``rows`` stay in 16-row tiles whatever it is.
      split: how long requests are cut (:class:`MlaSplit`; None: ``MlaSplit()``, the modelled split).  With
        ``split.waves`` > 0 the pieces fill up to ``floor(waves x num_sms x ctas_per_sm)`` CTAs
        (:func:`wave_split_counts`, :func:`even_pieces`); ``split_tokens`` is then the longest piece.

    Raises TypeError / ValueError for a bad ``tile_m``, TypeError for a ``split`` that is not an MlaSplit, and
    the ValueErrors above.
    """
    _check_tile_m(tile_m)
    split = _check_split(split)
    qo = qo_lens.to(torch.int64).cpu()
    qs = q_starts.to(torch.int64).cpu()
    max_q = int(qo.max()) if qo.numel() else 1
    tiles = row_tiles(max_q, num_heads)
    if fixed_row_tiles is not None:
        if tiles > fixed_row_tiles:
            raise ValueError(f"the plan needs {tiles} row tiles (qo_len {max_q} x {num_heads} heads) but the "
                             f"CUDA-graph plan was captured with {fixed_row_tiles}")
        tiles = fixed_row_tiles
    # the row tiles play the kv heads' part in the split heuristic: count the CTAs the kernel launches
    k_tiles = kernel_row_tiles(tiles, tile_m)
    slots = max(1, num_sms * ctas_per_sm)
    if split.waves > 0 and not disable_split_kv:
        kv_list = kv_lens.to(torch.int64).cpu().tolist()
        counts = wave_split_counts(kv_list, _wave_budget(split, k_tiles, slots), split.min_tokens,
                                   max_splits_per_request)
        table, num_work, num_partials, split_tokens = _wave_table(kv_lens.cpu(), page_offsets.cpu(), counts, num_rows)
    else:
        wp = plan_paged_decode(kv_lens, page_offsets, num_kv_heads=k_tiles, page_size=page_size, num_sms=num_sms,
                               ctas_per_sm=ctas_per_sm, disable_split_kv=disable_split_kv, num_rows=num_rows,
                               max_splits_per_request=max_splits_per_request)
        table, num_work, num_partials, split_tokens = wp.work, wp.num_work, wp.num_partials, wp.split_tokens
    b = table[:, 0].to(torch.int64)
    real = b >= 0
    bi = b.clamp(min=0)
    extra = torch.zeros((table.shape[0], 2), dtype=torch.int32)
    if qo.numel():
        extra[:, 0] = torch.where(real, qs[bi], torch.zeros_like(bi)).to(torch.int32)
        extra[:, 1] = torch.where(real, qo[bi], torch.zeros_like(bi)).to(torch.int32)
    work = torch.cat([table, extra], dim=1).contiguous()
    return MlaWorkPlan(work=work, num_work=num_work, num_partials=num_partials, split_tokens=split_tokens,
                       row_tiles=tiles, rows=tiles * TILE_M)
