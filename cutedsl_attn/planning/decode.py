"""Host-side planning for paged decode: request lengths -> a work table of (request, token range) items.

Pure Python/torch on the CPU; imports nothing above it.  ``plan()`` of the decode
wrapper calls :func:`plan_paged_decode` once per batch; ``run()`` only launches.

Work-table row (int32, ``WORK_COLS`` columns, the contract with
``cutedsl_attn.portable.paged_decode``)::

    [batch_idx, tok_start, tok_end, kv_len, page_off, num_splits, part_base, split_idx]

``batch_idx = -1`` marks a padding row (CUDA-graph mode launches a fixed grid).
Tokens ``[tok_start, tok_end)`` of request ``batch_idx`` are read; token ``t`` lives
in page ``indices[page_off + t // page_size]`` at slot ``t % page_size``.  A request
split into ``num_splits > 1`` items writes fp32 partials ``part_base + split_idx``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

WORK_COLS = 8
W_BATCH, W_TOK_START, W_TOK_END, W_KV_LEN, W_PAGE_OFF, W_NUM_SPLITS, W_PART_BASE, W_SPLIT_IDX = range(8)
CHUNK = 16  # tokens per warp iteration in the decode kernel: one m16n8k16 K-extent of P V

DTYPES = ("bfloat16", "float16")
KV_DTYPES = ("", "float8_e4m3fn")  # "": the cache has the query's dtype
POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")
HEAD_DIMS = (32, 64, 128, 256)


@dataclass(frozen=True)
class DecodeProblem:
    """What a paged-decode caller fixes at ``plan()`` (the problem half of a decode kernel's config and key).

    ``dtype`` ``"bfloat16"`` / ``"float16"`` (q and o; k and v too unless ``kv_dtype`` says otherwise);
    ``kv_dtype`` the K/V cache's element type: ``""`` (the default) or ``dtype`` itself (normalised to ``""``)
    for a 16-bit cache, ``"float8_e4m3fn"`` for an fp8 cache whose per-tensor ``k_scale`` / ``v_scale`` the
    caller folds into ``sm_scale`` and ``output_scale`` (:class:`DecodeArgs`); ``head_dim`` one of
    :data:`HEAD_DIMS`; ``page_size`` >= 1; ``group_size`` query heads per kv head, 1..16; ``arch`` the compile
    target.  Batch, lengths, page count, kv heads, strides, layout (NHD / HND), scales and the window are
    run-time arguments (:class:`DecodeArgs`).  Raises TypeError / ValueError as
    :class:`cutedsl_attn.planning.prefill.PrefillProblem` (``kv_dtype`` included); NotImplementedError for
    ``kv_dtype="float8_e5m2"``.
    """

    dtype: str
    head_dim: int
    page_size: int
    group_size: int
    pos_encoding_mode: str = "NONE"
    use_soft_cap: bool = False
    use_sinks: bool = False
    arch: str = "sm_90a"
    kv_dtype: str = ""

    def __post_init__(self):
        for name in ("head_dim", "page_size", "group_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {v!r}")
        for name in ("use_soft_cap", "use_sinks"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'bfloat16' or 'float16', got {self.dtype!r}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if not 1 <= self.group_size <= 16:
            raise ValueError(f"group_size must be in [1, 16], got {self.group_size}")
        if self.pos_encoding_mode not in POS_ENCODING_MODES:
            raise ValueError(f"pos_encoding_mode must be one of {POS_ENCODING_MODES}, got {self.pos_encoding_mode!r}")
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

    @property
    def kv_fp8(self) -> bool:
        """Whether the K/V cache is fp8 e4m3 (1 byte per element)."""
        return self.kv_dtype == "float8_e4m3fn"


class DecodeArgs(NamedTuple):
    """One paged-decode launch's tensors and scalars (the decode kernel's ``launch`` orders them).

    q ``[B, Hq, D]``; k / v ``[pages, page_size, Hkv, D]`` (NHD, or an HND cache as a permuted view) of q's
    dtype or, for a problem with ``kv_dtype="float8_e4m3fn"``, torch.float8_e4m3fn (rows 16-byte aligned);
    ``indices`` int32 flat page ids; ``work`` int32 ``[W, WORK_COLS]`` (:func:`plan_paged_decode`); ``out``
    ``[B, Hq, D]`` (written); ``lse`` fp32 ``[B, Hq]`` base 2 (written); ``part_o`` fp32 ``[P, Hq, D]`` and
    ``part_lse`` fp32 ``[P, Hq]`` split-KV partials; ``counters`` int32 per (request, kv head), left at 0;
    ``sinks`` / ``alibi_slopes`` fp32 ``[Hq]`` (1-element dummies when unused); ``sm_scale``, ``soft_cap`` (0:
    none), ``rope_rcp_scale``, ``rope_log2_theta`` and ``output_scale`` (FlashInfer's ``v_scale / o_scale``, applied in fp32 before the 16-bit rounding).
    For an fp8 cache ``sm_scale`` is ``sm_scale * q_scale * k_scale`` (and ``output_scale`` carries ``v_scale``):
    the kernel only widens e4m3 to 16 bits.
    """

    q: Any
    k: Any
    v: Any
    indices: Any
    work: Any
    out: Any
    lse: Any
    part_o: Any
    part_lse: Any
    counters: Any
    sinks: Any
    alibi_slopes: Any
    sm_scale: float
    soft_cap: float
    rope_rcp_scale: float
    rope_log2_theta: float
    output_scale: float


@dataclass(frozen=True)
class DecodeWorkPlan:
    """Result of :func:`plan_paged_decode`.

    ``work`` is a CPU int32 tensor ``[num_rows, WORK_COLS]`` (``num_rows >= num_work``;
    rows past ``num_work`` are padding with ``batch_idx = -1``).  ``num_partials`` is
    the number of fp32 partial rows (per query head) split-KV needs.
    """

    work: torch.Tensor
    num_work: int
    num_partials: int
    split_tokens: int  # 0 when no request was split
    kv_lens: torch.Tensor  # CPU int32 [B]


def kv_lens_from_csr(indptr: torch.Tensor, last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """kv_len[b] = max(npages-1, 0)*page_size + last_page_len[b] (0 for a request with no page).

    As ``flashinfer.page.get_seq_lens``.  CPU int64 result.
    """
    npages = (indptr[1:] - indptr[:-1]).to(torch.int64)
    lens = (npages - 1).clamp(min=0) * page_size + last_page_len.to(torch.int64)
    return torch.where(npages > 0, lens, torch.zeros_like(lens))


CTA_OVERHEAD_TOKENS = 64  # fixed cost of one CTA (Q load, prologue, merges) in token-equivalents


def split_pieces(length: int, split: int) -> list[int]:
    """Token counts of the pieces a request of ``length`` tokens is cut into for ``split`` (0: none).

    The pieces are evened out and rounded up to multiples of ``CHUNK`` (the last may be shorter).
    """
    if split <= 0 or length <= split:
        return [length]
    n = -(-length // split)
    per = -(-(-(-length // n)) // CHUNK) * CHUNK
    n = -(-length // per)
    return [min(per, length - i * per) for i in range(n)]


def _pieces_summary(lengths: list[int], split: int) -> tuple[int, int]:
    """``(number of pieces, longest piece)`` of :func:`split_pieces` over ``lengths``, without the lists."""
    count, biggest = 0, 0
    for length in lengths:
        if split <= 0 or length <= split:
            count += 1
            biggest = max(biggest, length)
            continue
        n = -(-length // split)
        per = -(-(-(-length // n)) // CHUNK) * CHUNK
        count += -(-length // per)
        biggest = max(biggest, per)
    return count, biggest


def _lpt_makespan(pieces: list[int], workers: int) -> int:
    """Makespan of longest-first greedy scheduling of ``pieces`` (+ per-CTA overhead) on ``workers``."""
    if len(pieces) <= workers:
        return max(pieces) + CTA_OVERHEAD_TOKENS
    heap = [0] * workers
    for x in sorted(pieces, reverse=True):
        heapq.heapreplace(heap, heap[0] + x + CTA_OVERHEAD_TOKENS)
    return max(heap)


def choose_num_splits(
    eff_lens: list[int], num_kv_heads: int, slots: int, *, min_split: int = 64, max_splits: int = 128,
    min_waves: float = 0.0,
) -> int:
    """Split length in tokens (0 = no split) that minimises the modelled decode time.

    Every kv head sees the same pieces, so the model schedules one head's pieces on
    ``slots // num_kv_heads`` workers, longest first (the kernel's work table is
    ordered that way), each piece costing its tokens plus ``CTA_OVERHEAD_TOKENS``.
    Candidates cut the longest request into 1, 2, ... pieces (multiples of ``CHUNK``,
    at least ``min_split`` tokens, at most ``max_items`` work items); the fewest
    pieces within 2% of the best makespan wins.  ``min_waves`` > 0 (a tuning knob)
    only accepts splits giving at least that many waves of CTAs.
    """
    if not eff_lens:
        return 0
    longest = max(eff_lens)
    workers = max(1, slots // max(1, num_kv_heads))
    limit = max_items(len(eff_lens), num_kv_heads, slots)
    cands: list[tuple[int, int, int]] = [(_lpt_makespan(list(eff_lens), workers), len(eff_lens), 0)]
    if longest > min_split:
        last_split = None
        for n in range(2, max_splits + 1):
            split = max(min_split, -(-longest // n))
            split = -(-split // CHUNK) * CHUNK
            if split == last_split:  # the same pieces as the previous candidate: the earlier one stands
                continue
            last_split = split
            count, biggest = _pieces_summary(eff_lens, split)
            if count > limit:
                break
            if count <= workers:  # one wave: the makespan is the longest piece (what _lpt_makespan returns)
                cands.append((biggest + CTA_OVERHEAD_TOKENS, count, split))
            else:
                pieces = [p for L in eff_lens for p in split_pieces(L, split)]
                cands.append((_lpt_makespan(pieces, workers), count, split))
            if split == min_split:
                break
    best = min(c[0] for c in cands)
    for ms, items, split in cands:
        if ms <= 1.02 * best and items * num_kv_heads >= min_waves * slots:
            return split
    return cands[-1][2] if min_waves > 0 else 0


def plan_paged_decode(
    kv_lens: torch.Tensor,
    page_offsets: torch.Tensor,
    *,
    num_kv_heads: int,
    page_size: int,
    window_left: int = -1,
    num_sms: int = 132,
    ctas_per_sm: int = 2,
    fixed_split_tokens: int | None = None,
    disable_split_kv: bool = False,
    num_rows: int | None = None,
    max_splits_per_request: int | None = None,
    min_waves: float = 0.0,
) -> DecodeWorkPlan:
    """Build the decode work table.

    Args:
      kv_lens: ``[B]`` tokens in each request's KV (CPU, any int dtype).
      page_offsets: ``[B]`` index into the flat page-id array where request b's pages start.
      num_kv_heads, page_size: the cache's; ``num_kv_heads`` is a grid dimension.
      window_left: FlashInfer's inclusive left window (``w`` keeps ``w+1`` keys); keys
        before ``kv_len-1-w`` are never read.  ``-1`` disables.
      num_sms, ctas_per_sm: the GPU's SM count and the kernel's occupancy; together the
        number of CTAs one wave holds, which the split heuristic fills.
      fixed_split_tokens: split every request into pieces of about this many tokens
        (FlashInfer's ``fixed_split_size``, converted to tokens by the caller); pieces are
        evened out within the request and rounded up to multiples of 16 tokens, so a
        request's split never depends on the rest of the batch.
      disable_split_kv: never split (one work item per request).
      num_rows: pad the table to this many rows (CUDA-graph mode); ``ValueError`` if the
        plan needs more.
      min_waves: see :func:`choose_num_splits`.
      max_splits_per_request: the kernel's limit on pieces per request (its merge keeps
        one LSE per piece and query head in shared memory); ``ValueError`` above it.

    Items are ordered longest first so the longest run starts earliest.
    """
    kv_lens = kv_lens.to(torch.int64).cpu()
    page_offsets = page_offsets.to(torch.int64).cpu()
    B = int(kv_lens.numel())
    lens = kv_lens.tolist()
    starts = [max(0, L - 1 - window_left) if window_left >= 0 else 0 for L in lens]
    eff = [L - s for L, s in zip(lens, starts)]
    if disable_split_kv:
        split = 0
    elif fixed_split_tokens is not None:
        split = int(fixed_split_tokens)
        if split <= 0:
            raise ValueError(f"fixed_split_size must be positive, got {fixed_split_tokens}")
    else:
        split = choose_num_splits(eff, num_kv_heads, max(1, num_sms * ctas_per_sm), min_waves=min_waves)

    rows: list[list[int]] = []
    part = 0
    for b in range(B):
        L, s0, n_eff = lens[b], starts[b], eff[b]
        pieces = split_pieces(n_eff, split)
        n = len(pieces)
        if n == 1:
            rows.append([b, s0, L, L, int(page_offsets[b]), 1, 0, 0])
            continue
        if max_splits_per_request is not None and n > max_splits_per_request:
            raise ValueError(
                f"request {b} ({n_eff} tokens) would be split into {n} pieces of {pieces[0]} tokens; the kernel "
                f"merges at most {max_splits_per_request}: use a larger fixed_split_size"
            )
        a = s0
        for i, plen in enumerate(pieces):
            rows.append([b, a, a + plen, L, int(page_offsets[b]), n, part, i])
            a += plen
        part += n
    rows.sort(key=lambda r: r[2] - r[1], reverse=True)
    num_work = len(rows)
    if num_rows is not None:
        if num_work > num_rows:
            raise ValueError(
                f"the plan needs {num_work} work items but the CUDA-graph buffers hold {num_rows}; "
                "construct the wrapper with a larger batch or use fixed_split_size"
            )
        rows.extend([[-1, 0, 0, 0, 0, 1, 0, 0]] * (num_rows - num_work))
    work = torch.tensor(rows, dtype=torch.int32).reshape(-1, WORK_COLS)
    return DecodeWorkPlan(work=work, num_work=num_work, num_partials=part, split_tokens=split,
                          kv_lens=kv_lens.to(torch.int32))


def max_items(batch_size: int, num_kv_heads: int, slots: int) -> int:
    """Upper bound on the work items the automatic split heuristic produces (CUDA-graph buffers)."""
    return batch_size + 2 * -(-slots // max(1, num_kv_heads))


def occupancy(smem_bytes: int, num_threads: int, smem_per_sm: int = 228 * 1024) -> int:
    """CTAs per SM allowed by shared memory (1 KiB reserved per CTA) and threads."""
    return max(1, min(smem_per_sm // (smem_bytes + 1024), 2048 // num_threads, 32))
