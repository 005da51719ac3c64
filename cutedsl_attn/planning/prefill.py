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
from typing import Sequence

import torch

WORK_COLS = 8
W_BATCH, W_ROW0, W_QO_LEN, W_KV_LEN, W_Q_START, W_KV_START, W_MASK_OFF, W_SCHED = range(8)
PAD_ROW = (-1, 0, 0, 0, 0, 0, 0, 0)
_INT32_MAX = 2**31 - 1


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
