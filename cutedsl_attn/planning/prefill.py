"""Host-side planning for batch prefill: request lengths -> a work table of (request, row tile) items.

Pure Python/torch on the CPU; imports nothing above it.  ``plan()`` of the prefill
wrappers calls :func:`plan_prefill` once per batch; ``run()`` only launches.

The kernel (``cutedsl_attn.portable.prefill``) packs the query heads that share a kv
head into its MMA rows: packed row ``r`` of request ``b`` is query token
``r // group_size`` (global row ``q_start + r // group_size``) and query head
``kv_head * group_size + r % group_size``.  A request with ``qo_len`` tokens has
``qo_len * group_size`` packed rows, cut into tiles of ``tile_m`` rows; the launch grid
is ``(num_kv_heads, num_rows)``, one CTA per (kv head, work row).

Work-table row (int32, ``WORK_COLS`` columns, the contract with the kernel)::

    [b, row0, qo_len, kv_len, q_start, kv_start_or_page_off, mask_off, sched]

* ``b``: request index; ``-1`` marks a padding row (skipped by the kernel; CUDA-graph
  mode launches a fixed grid).
* ``row0``: first packed row of the tile, a multiple of ``tile_m``; the tile covers
  packed rows ``[row0, min(row0 + tile_m, qo_len * group_size))``.
* ``qo_len``, ``kv_len``: the request's query and KV token counts.
* ``q_start``: the request's first row in ``q`` / ``o`` / ``lse`` (``qo_indptr[b]``).
* ``kv_start_or_page_off``: first KV token of the request in the ragged ``k``/``v``
  (``kv_indptr[b]``), or, for a paged cache, the offset of the request's page list in the
  flat page-id array (``kv_indptr[b]`` of the CSR table, ``b * max_pages`` of a block table).
* ``mask_off``: BIT offset of the request's packed custom mask (``mask_indptr[b] * 8`` for
  a segment-packed mask); 0 when no custom mask is used.
* last column (``W_SCHED``): 0.  ``work[0, W_SCHED]`` is the tile counter of the persistent SM90
  kernel (``Sm90PrefillConfig.num_ctas > 0``): its CTAs claim tiles with an atomic add on it and the
  launch's last claim resets it to 0, so it reads 0 between launches; two launches sharing one work
  table must not run concurrently.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch

WORK_COLS = 8
W_BATCH, W_ROW0, W_QO_LEN, W_KV_LEN, W_Q_START, W_KV_START, W_MASK_OFF, W_SCHED = range(8)
PAD_ROW = (-1, 0, 0, 0, 0, 0, 0, 0)
_INT32_MAX = 2**31 - 1


DTYPES = ("bfloat16", "float16")
KV_DTYPES = ("", "float8_e4m3fn")  # "": the K/V cache has the query's dtype
POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")
HEAD_DIMS_QK = (32, 64, 128, 192, 256)
HEAD_DIMS_VO = (32, 64, 128, 256)


@dataclass(frozen=True)
class PrefillProblem:
    """What a prefill caller fixes at ``plan()`` (the problem half of every prefill kernel's config and compile key).

    Every prefill kernel module (``cutedsl_attn.portable.prefill``, ``cutedsl_attn.sm90.prefill``) takes this and
    answers ``unsupported_reason(problem)``; its own tile/tuning dataclass is the other half of its config.
    Lengths, head counts, strides, ``sm_scale``, the soft-cap value, ``window_left``, the RoPE parameters and
    the output scale are run-time arguments (:class:`PrefillArgs`), so one compiled kernel serves them all.

    ``dtype``: ``"bfloat16"`` or ``"float16"`` (q and o; k and v too unless ``kv_dtype`` says otherwise);
    ``kv_dtype``: the K/V cache's element type, ``""`` (the default) or ``dtype`` itself (normalised to ``""``: one
    compile key) for a 16-bit cache, ``"float8_e4m3fn"`` for an fp8 paged cache whose per-tensor ``k_scale`` /
    ``v_scale`` the caller folds into ``sm_scale`` and ``output_scale`` (:class:`PrefillArgs`), as for
    :class:`cutedsl_attn.planning.decode.DecodeProblem`; ``page_size`` 0 means ragged K/V; ``causal`` is
    FlashInfer's bottom-right alignment and is False whenever ``use_custom_mask`` (the mask replaces it);
    ``score_mod``: a Python callable traced into the logits (its source, closures and globals are part of the
    key); ``arch``: the compile target (``"sm_90a"``, ``"sm_100a"``, ``"sm_103a"``).

    Raises TypeError for a non-int size or a non-str ``kv_dtype``, ValueError for a value outside the ranges above,
    NotImplementedError for ``kv_dtype="float8_e5m2"`` and for an fp8 cache with ragged K/V (``page_size`` 0).
    """

    dtype: str
    head_dim_qk: int
    head_dim_vo: int
    group_size: int
    page_size: int = 0
    causal: bool = False
    use_window: bool = False
    use_soft_cap: bool = False
    use_sinks: bool = False
    use_custom_mask: bool = False
    pos_encoding_mode: str = "NONE"
    score_mod: Any = None
    arch: str = "sm_90a"
    kv_dtype: str = ""

    def __post_init__(self):
        for name in ("head_dim_qk", "head_dim_vo", "group_size", "page_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):  # a cache key: no 4.0 for 4
                raise TypeError(f"{name} must be an int, got {v!r}")
        for name in ("causal", "use_window", "use_soft_cap", "use_sinks", "use_custom_mask"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'bfloat16' or 'float16', got {self.dtype!r}")
        if self.head_dim_qk not in HEAD_DIMS_QK or self.head_dim_vo not in HEAD_DIMS_VO:
            raise ValueError(f"head_dim_qk must be one of {HEAD_DIMS_QK} and head_dim_vo one of {HEAD_DIMS_VO}, "
                             f"got {self.head_dim_qk}/{self.head_dim_vo}")
        if not 1 <= self.group_size <= 16:
            raise ValueError(f"group_size must be in [1, 16], got {self.group_size}")
        if self.page_size < 0:
            raise ValueError(f"page_size must be >= 0 (0 = ragged), got {self.page_size}")
        if self.pos_encoding_mode not in POS_ENCODING_MODES:
            raise ValueError(f"pos_encoding_mode must be one of {POS_ENCODING_MODES}, got {self.pos_encoding_mode!r}")
        if self.score_mod is not None and (not callable(self.score_mod) or self.use_soft_cap
                                           or self.pos_encoding_mode == "ALIBI"):
            raise ValueError("score_mod must be a callable, and not combined with a soft cap or ALiBi (fold them "
                             "into the score_mod)")
        if not isinstance(self.kv_dtype, str):
            raise TypeError(f"kv_dtype must be a str, got {self.kv_dtype!r}")
        if self.kv_dtype == self.dtype:
            object.__setattr__(self, "kv_dtype", "")  # one spelling of a 16-bit cache: one compile key
        if self.kv_dtype == "float8_e5m2":
            raise NotImplementedError("kv_dtype 'float8_e5m2' is not supported; fp8 K/V caches must be "
                                      "'float8_e4m3fn' (or the cache has the query's dtype: kv_dtype '')")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be '' (the query's dtype), {self.dtype!r} or 'float8_e4m3fn', "
                             f"got {self.kv_dtype!r}")
        if self.kv_fp8 and self.page_size == 0:
            raise NotImplementedError("an fp8 (float8_e4m3fn) K/V cache is served paged (page_size >= 1) only, "
                                      "not as ragged K/V")

    @property
    def kv_fp8(self) -> bool:
        """Whether the K/V cache is fp8 e4m3 (1 byte per element)."""
        return self.kv_dtype == "float8_e4m3fn"


class PrefillArgs(NamedTuple):
    """One prefill launch's tensors and scalars, in the names of the API (each kernel's ``launch`` orders them).

    q ``[total_q, Hq, head_dim_qk]``; k / v ``[total_kv, Hkv, D]`` (ragged, NHD or an HND view) or
    ``[pages, page_size, Hkv, D]`` (paged), of q's dtype or, for a problem with ``kv_dtype="float8_e4m3fn"``,
    torch.float8_e4m3fn (rows and strides 16-byte aligned); ``indices`` int32 flat page ids (a 1-element dummy
    when ragged); ``work`` int32 ``[W, WORK_COLS]`` from :func:`plan_prefill`; ``out`` ``[total_q, Hq, head_dim_vo]`` (16-bit,
    written); ``lse`` fp32 ``[total_q, Hq]``, base 2 (written); ``mask`` uint8 packed custom-mask bits (dummy
    without one); ``sinks`` fp32 ``[Hq]`` (dummy without); ``alibi_slopes`` fp32 ``[Hq]`` (dummy without ALiBi).
    ``sm_scale``: the logit scale (``sm_scale * q_scale * k_scale``: an fp8 cache's ``k_scale`` is folded here, the
    kernel only widens e4m3); ``soft_cap``: 0 or the cap;
    ``window_left``: -1 or the window; ``rope_rcp_scale`` / ``rope_log2_theta``: ``1 / rope_scale`` and
    ``log2(rope_theta)``; ``output_scale``: the factor applied to the normalised output in fp32 before it is
    rounded to 16 bits (FlashInfer's ``v_scale / o_scale``; an fp8 cache's ``v_scale`` is folded here).
    """

    q: Any
    k: Any
    v: Any
    indices: Any
    work: Any
    out: Any
    lse: Any
    mask: Any
    sinks: Any
    alibi_slopes: Any
    sm_scale: float
    soft_cap: float
    window_left: int
    rope_rcp_scale: float
    rope_log2_theta: float
    output_scale: float


def _int(name: str, x) -> int:
    if isinstance(x, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(x)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(x).__name__}") from None


def _int_list(name: str, x) -> list[int]:
    """A 1-D integer sequence / tensor as a python list (CPU copy for a tensor)."""
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise TypeError(f"{name} must have an integer dtype, got {x.dtype}")
        if x.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
        return [int(v) for v in x.tolist()]
    if isinstance(x, (str, bytes)) or not isinstance(x, Sequence):
        raise TypeError(f"{name} must be a 1-D integer tensor or sequence, got {type(x).__name__}")
    return [_int(f"{name}[{i}]", v) for i, v in enumerate(x)]


def num_tiles(qo_len: int, group_size: int, tile_m: int) -> int:
    """Row tiles of one request: ``ceil(qo_len * group_size / tile_m)`` (0 for an empty request)."""
    return -(-(qo_len * group_size) // tile_m)


def max_tiles(total_q: int, batch_size: int, group_size: int, tile_m: int) -> int:
    """Upper bound on the tiles of any batch of ``batch_size`` requests with ``total_q`` query tokens.

    ``sum_b ceil(q_b * G / tile_m) <= ceil(total_q * G / tile_m) + batch_size``; at least 1.
    Used to size the fixed work table of CUDA-graph mode.
    """
    return max(1, -(-(total_q * group_size) // tile_m) + batch_size)


def tile_kv_range(row0: int, qo_len: int, kv_len: int, *, group_size: int, tile_m: int, causal: bool = False,
                  window_left: int = -1) -> tuple[int, int]:
    """KV tokens ``[lo, hi)`` that some row of the tile starting at packed row ``row0`` can see.

    FlashInfer conventions: query token ``i`` sits at position ``i + kv_len - qo_len``
    (bottom-right); causal keeps keys ``j <= pos``; ``window_left = w >= 0`` keeps keys
    ``j >= pos - w``.  The range is empty (``lo >= hi``) when no row sees a key.
    """
    first_tok = row0 // group_size
    last_tok = (min(row0 + tile_m, qo_len * group_size) - 1) // group_size
    hi = kv_len
    if causal:
        hi = min(kv_len, last_tok + kv_len - qo_len + 1)
    lo = 0
    if window_left >= 0:
        lo = max(first_tok + kv_len - qo_len - window_left, 0)
    return lo, max(hi, 0)


def plan_prefill(
    qo_lens,
    kv_lens,
    q_starts,
    kv_starts,
    mask_bit_offsets=None,
    *,
    group_size: int,
    tile_m: int,
    num_rows: int | None = None,
    causal: bool = False,
    window_left: int = -1,
) -> tuple[torch.Tensor, int]:
    """Build the prefill work table (see the module docstring for the row layout).

    Args:
      qo_lens, kv_lens: ``[B]`` query / KV token counts per request (>= 0), CPU int tensors
        or python sequences.
      q_starts: ``[B]`` first row of each request in ``q``/``o`` (``qo_indptr[:-1]``).
      kv_starts: ``[B]`` first KV token (ragged) or page-list offset (paged) per request.
      mask_bit_offsets: ``[B]`` bit offsets of each request's packed custom mask, or None
        (all 0).
      group_size: query heads per kv head (packed rows per query token), >= 1.
      tile_m: packed rows per CTA (the kernel config's ``tile_m``), >= 1.
      num_rows: pad the table with ``b = -1`` rows to exactly this many rows (CUDA-graph
        mode, where the grid is fixed); ``ValueError`` if the plan needs more.
      causal, window_left: only used to order the tiles (the kernel derives each tile's
        KV range itself): with causal masking a tile further down a request sees more
        keys, with a window fewer.

    Returns:
      ``(work, num_work)``: ``work`` is a CPU int32 tensor ``[W, WORK_COLS]`` whose first
      ``num_work`` rows are the tiles, request by request in descending order of the
      request's work (visible KV tokens summed over its tiles), each request's tiles by
      descending work -- requests of equal work as one group, their tiles interleaved by
      work, ties by request then row -- so the busiest requests start first (a long tile of
      a request with little work in total can start late) and the CTAs in flight share a few
      requests' K/V in L2; the rest are padding rows.  ``W = num_rows`` when given, else ``max(num_work, 1)`` (a batch with
      no query row still gets one padding row, so a grid is never empty).

    Every packed row ``r in [0, qo_len * group_size)`` of every request lies in exactly
    one tile; requests with ``qo_len == 0`` get no tile; requests with ``kv_len == 0`` get
    tiles (their rows are written as O = 0, LSE = -inf).

    Raises:
      TypeError: non-integer inputs.  ValueError: length mismatch, negative values,
      ``group_size``/``tile_m`` < 1, a value that does not fit int32, or more tiles than
      ``num_rows``.
    """
    qo = _int_list("qo_lens", qo_lens)
    kv = _int_list("kv_lens", kv_lens)
    qs = _int_list("q_starts", q_starts)
    ks = _int_list("kv_starts", kv_starts)
    mo = [0] * len(qo) if mask_bit_offsets is None else _int_list("mask_bit_offsets", mask_bit_offsets)
    G = _int("group_size", group_size)
    TM = _int("tile_m", tile_m)
    window_left = _int("window_left", window_left)
    if G < 1:
        raise ValueError(f"group_size must be >= 1, got {G}")
    if TM < 1:
        raise ValueError(f"tile_m must be >= 1, got {TM}")
    B = len(qo)
    for name, vals in (("kv_lens", kv), ("q_starts", qs), ("kv_starts", ks), ("mask_bit_offsets", mo)):
        if len(vals) != B:
            raise ValueError(f"{name} must have {B} entries (len(qo_lens)), got {len(vals)}")
    for name, vals in (("qo_lens", qo), ("kv_lens", kv), ("q_starts", qs), ("kv_starts", ks),
                       ("mask_bit_offsets", mo)):
        for b, x in enumerate(vals):
            if x < 0:
                raise ValueError(f"{name}[{b}] must be >= 0, got {x}")
            if x > _INT32_MAX:
                raise ValueError(f"{name}[{b}] = {x} does not fit the int32 work table")
    for b in range(B):
        if qo[b] * G > _INT32_MAX:
            raise ValueError(f"request {b}: qo_len * group_size = {qo[b] * G} does not fit int32")

    tiles: list[tuple[int, int, int]] = []  # (cost, b, row0)
    for b in range(B):
        for t in range(num_tiles(qo[b], G, TM)):
            row0 = t * TM
            lo, hi = tile_kv_range(row0, qo[b], kv[b], group_size=G, tile_m=TM, causal=causal,
                                   window_left=window_left)
            tiles.append((max(hi - lo, 0), b, row0))
    req_work = [0] * B
    for cost, b, _ in tiles:
        req_work[b] += cost
    # request-major: the requests by descending total work, each one's tiles by descending work; the CTAs
    # in flight then share one request's K/V through L2 (ordered by tile work alone, the tiles in flight
    # came from dozens of requests of a ragged batch, whose K/V did not fit L2).  Requests of equal work
    # (a uniform batch) form one group whose tiles interleave by work.
    tiles.sort(key=lambda x: (-req_work[x[1]], -x[0], x[1], x[2]))
    rows = [[b, row0, qo[b], kv[b], qs[b], ks[b], mo[b], 0] for _, b, row0 in tiles]
    num_work = len(rows)
    if num_rows is not None:
        num_rows = _int("num_rows", num_rows)
        if num_work > num_rows:
            raise ValueError(
                f"the plan needs {num_work} work rows (tiles of {TM} packed rows) but the CUDA-graph work "
                f"table holds {num_rows}; re-create the wrapper for the larger batch"
            )
        rows.extend([list(PAD_ROW)] * (num_rows - num_work))
    elif num_work == 0:
        rows.append(list(PAD_ROW))
    work = torch.tensor(rows, dtype=torch.int32).reshape(-1, WORK_COLS)
    return work, num_work
