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
    (16-row tiles of the longest request), ``rows`` = max qo_len x num_heads (``part_o``'s second dim)."""

    work: torch.Tensor
    num_work: int
    num_partials: int
    split_tokens: int
    row_tiles: int
    rows: int


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
                  tile_m: int = TILE_M) -> int:
    """The most work items :func:`plan_mla`'s split heuristic makes for ``batch_size`` requests of at most
    ``num_row_tiles`` 16-row tiles (CUDA-graph buffers: pass it as ``num_rows``), with the same ``num_sms``,
    ``ctas_per_sm`` and ``tile_m`` as the plan.  Raises like :func:`kernel_row_tiles`."""
    return max_items(batch_size, kernel_row_tiles(num_row_tiles, tile_m), max(1, num_sms * ctas_per_sm))


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
) -> MlaWorkPlan:
    """Build the MLA work table: :func:`~cutedsl_attn.planning.decode.plan_paged_decode`'s split-KV items (the
    row tiles play the kv heads' part: each tile of a request sees the same pieces) plus each item's
    ``q_start`` and ``qo_len``.

    Args:
      qo_lens, kv_lens, q_starts, page_offsets: ``[B]`` (CPU, any int dtype): query rows, KV tokens, first
        query row and first ``kv_indices`` entry of each request.
      num_heads, page_size: the problem's.
      num_sms, ctas_per_sm: CTAs one wave holds (the split heuristic fills it); ``ctas_per_sm`` counts CTAs
        of the kernel that runs the plan.
      disable_split_kv: one work item per request.
      num_rows: pad the table to this many rows (CUDA-graph mode); ValueError if the plan needs more.
      max_splits_per_request: the kernel's merge limit (ValueError above it).
      fixed_row_tiles: the grid's x extent (CUDA-graph mode keeps the first plan's); ValueError when the
        batch's longest request needs more.
      tile_m: query rows of one CTA of the kernel that runs the plan (a positive multiple of 16; 16: the
        portable kernel's): the split heuristic counts ``ceil(row_tiles * 16 / tile_m)`` CTAs per work item.
        The table, ``row_tiles`` and ``rows`` stay in 16-row tiles whatever it is.

    Raises TypeError / ValueError for a bad ``tile_m``, and the ValueErrors above.
    """
    _check_tile_m(tile_m)
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
    wp = plan_paged_decode(kv_lens, page_offsets, num_kv_heads=kernel_row_tiles(tiles, tile_m), page_size=page_size,
                           num_sms=num_sms, ctas_per_sm=ctas_per_sm, disable_split_kv=disable_split_kv,
                           num_rows=num_rows, max_splits_per_request=max_splits_per_request)
    b = wp.work[:, 0].to(torch.int64)
    real = b >= 0
    bi = b.clamp(min=0)
    extra = torch.zeros((wp.work.shape[0], 2), dtype=torch.int32)
    if qo.numel():
        extra[:, 0] = torch.where(real, qs[bi], torch.zeros_like(bi)).to(torch.int32)
        extra[:, 1] = torch.where(real, qo[bi], torch.zeros_like(bi)).to(torch.int32)
    work = torch.cat([wp.work, extra], dim=1).contiguous()
    return MlaWorkPlan(work=work, num_work=wp.num_work, num_partials=wp.num_partials, split_tokens=wp.split_tokens,
                       row_tiles=tiles, rows=tiles * TILE_M)
