"""Paged K/V helpers of the oracle: CSR page tables <-> block tables, a paged cache gathered into
contiguous per-request K/V (FlashInfer's layouts: NHD / HND pages, ``last_page_len`` per request), and fp8
caches dequantised with their per-tensor scales."""

from __future__ import annotations

from typing import Tuple

import torch

from ._checks import _check_float_tensor, _check_int_tensor, _check_ndim, _check_kv_layout, _indptr_list

__all__ = ["block_tables_to_csr", "csr_to_block_tables", "dequantize_kv_cache", "paged_kv_to_contiguous"]


def dequantize_kv_cache(cache: torch.Tensor, scale=1.0, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``cache.to(dtype) * scale``: an fp8 (or any float) K or V cache as the values attention reads.

    FlashInfer's per-tensor ``k_scale`` multiplies the logits and ``v_scale`` the output; both are linear, so
    attention over the dequantised cache with scale 1 is the same math.  Unused page slots keep whatever
    they held (NaN stays NaN: the oracle never gathers them).

    Args:
        cache: float tensor of any shape (typically torch.float8_e4m3fn ``[pages, page_size, Hkv, D]``).
        scale: python number, or a one-element float tensor (any device).
        dtype: torch.float32 or torch.float64 (default).

    Returns:
        A new tensor of ``cache``'s shape and device in ``dtype``.

    Raises:
        TypeError: ``cache`` not a float tensor, ``scale`` not a number or one-element float tensor, ``dtype``
            not float32 / float64.
        ValueError: ``scale`` not finite.
    """
    _check_float_tensor("cache", cache)
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or not scale.is_floating_point():
            raise TypeError(f"scale must be a number or a one-element float tensor, got {scale.dtype} "
                            f"of shape {tuple(scale.shape)}")
        scale = float(scale.reshape(()).item())
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a number or a one-element float tensor, got {type(scale).__name__}")
    if scale != scale or scale in (float("inf"), float("-inf")):
        raise ValueError(f"scale must be finite, got {scale}")
    return cache.to(dtype) * float(scale)


def block_tables_to_csr(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Convert a dense block table (trtllm/xqa/cuDNN style) to FlashInfer CSR.

    Convention (FlashInfer's page table): request ``b`` uses the first
    ``npages_b = ceil(seq_lens[b] / page_size)`` entries of ``block_tables[b]`` (the tail
    is ignored); CSR ``indptr`` counts pages, ``last_page_len[b] =
    seq_lens[b] - (npages_b - 1) * page_size`` in ``[1, page_size]``, and ``0`` for an
    empty request (0 pages).

    Args:
        block_tables: integer ``[B, max_pages]`` physical page ids.
        seq_lens: integer ``[B]`` KV lengths in tokens (``>= 0``).
        page_size: tokens per page (python int ``>= 1``).

    Returns:
        ``(indptr [B+1], indices [indptr[-1]], last_page_len [B])``, all int32 on
        ``block_tables``' device.

    Raises:
        TypeError: non-integer tensors or ``page_size``.
        ValueError: wrong ndim, batch mismatch, ``page_size < 1``, negative seq_lens, or a
            sequence needing more pages than ``block_tables`` has columns.
    """
    _check_int_tensor("block_tables", block_tables)
    _check_int_tensor("seq_lens", seq_lens)
    _check_ndim("block_tables", block_tables, 2, "[batch_size, max_pages]")
    _check_ndim("seq_lens", seq_lens, 1, "[batch_size]")
    page_size = _check_page_size(page_size)
    B, max_pages = block_tables.shape
    if seq_lens.shape[0] != B:
        raise ValueError(
            f"seq_lens must have batch_size={B} entries (block_tables rows), got {seq_lens.shape[0]}"
        )
    lens = [int(x) for x in seq_lens.tolist()]
    dev = block_tables.device
    indptr = [0]
    rows = []
    last = []
    for b, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"seq_lens must be >= 0, got seq_lens[{b}]={n}")
        npages = (n + page_size - 1) // page_size
        if npages > max_pages:
            raise ValueError(
                f"seq_lens[{b}]={n} needs {npages} pages of size {page_size} but "
                f"block_tables has only {max_pages} columns"
            )
        rows.append(block_tables[b, :npages].to(torch.int32))
        indptr.append(indptr[-1] + npages)
        last.append(n - (npages - 1) * page_size if npages > 0 else 0)
    indices = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int32, device=dev)
    return (
        torch.tensor(indptr, dtype=torch.int32, device=dev),
        indices.to(device=dev, dtype=torch.int32),
        torch.tensor(last, dtype=torch.int32, device=dev),
    )


def csr_to_block_tables(
    indptr: torch.Tensor,
    indices: torch.Tensor,
    last_page_len: torch.Tensor,
    page_size: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Convert a FlashInfer CSR page table to a dense block table plus seq_lens.

    Inverse of :func:`block_tables_to_csr` (FlashInfer's page-table convention):
    ``seq_lens[b] = max(npages_b - 1, 0) * page_size + last_page_len[b]``
    (``flashinfer.page.get_seq_lens``) and row ``b`` of the table lists request ``b``'s
    pages in order.  The table has ``max_b npages_b`` columns (possibly 0); unused tail
    entries are filled with 0 (consumers must ignore them).

    Args:
        indptr: integer ``[B+1]`` page offsets (CSR, in pages).
        indices: integer ``[indptr[-1]]`` (or longer) physical page ids.
        last_page_len: integer ``[B]``, in ``[1, page_size]`` (``0`` for a 0-page request).
        page_size: tokens per page (python int ``>= 1``).

    Returns:
        ``(block_tables [B, max_pages], seq_lens [B])``, int32 on ``indptr``'s device.

    Raises:
        TypeError: non-integer tensors or ``page_size``.
        ValueError: malformed CSR (see :func:`paged_decode`).
    """
    ptr, _, lens = _csr_lists(indptr, indices, last_page_len, page_size)
    B = len(lens)
    dev = indptr.device
    npages = [ptr[b + 1] - ptr[b] for b in range(B)]
    width = max(npages) if npages else 0
    table = torch.zeros(B, width, dtype=torch.int32, device=dev)
    idx = indices.to(device=dev, dtype=torch.int32)
    for b in range(B):
        if npages[b]:
            table[b, : npages[b]] = idx[ptr[b] : ptr[b + 1]]
    return table, torch.tensor(lens, dtype=torch.int32, device=dev)


def _check_page_size(page_size) -> int:
    if isinstance(page_size, bool) or not isinstance(page_size, int):
        raise TypeError(f"page_size must be an int, got {type(page_size).__name__}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    return page_size


def _csr_lists(indptr, indices, last_page_len, page_size):
    """Validate a CSR page table; return (indptr list, indices list, kv_len list)."""
    page_size = _check_page_size(page_size)
    ptr = _indptr_list("kv_indptr", indptr)
    _check_int_tensor("kv_indices", indices)
    _check_int_tensor("kv_last_page_len", last_page_len)
    _check_ndim("kv_indices", indices, 1, "[num_used_pages]")
    _check_ndim("kv_last_page_len", last_page_len, 1, "[batch_size]")
    B = len(ptr) - 1
    if last_page_len.shape[0] != B:
        raise ValueError(
            f"kv_last_page_len must have batch_size={B} entries (len(kv_indptr)-1), "
            f"got {last_page_len.shape[0]}"
        )
    if indices.shape[0] < ptr[-1]:
        raise ValueError(
            f"kv_indices must have at least kv_indptr[-1]={ptr[-1]} entries, got {indices.shape[0]}"
        )
    last = [int(x) for x in last_page_len.tolist()]
    lens = []
    for b in range(B):
        npages = ptr[b + 1] - ptr[b]
        if npages == 0:
            if last[b] != 0:
                raise ValueError(
                    f"request {b} has 0 pages so kv_last_page_len[{b}] must be 0, got {last[b]}"
                )
            lens.append(0)
        else:
            if not 1 <= last[b] <= page_size:
                raise ValueError(
                    f"kv_last_page_len[{b}] must be in [1, page_size={page_size}], got {last[b]}"
                )
            lens.append((npages - 1) * page_size + last[b])
    return ptr, [int(x) for x in indices[: ptr[-1]].tolist()], lens


def _unpack_paged_cache(k_cache, v_cache, kv_layout):
    """Return (k4, v4) each 4-D in ``kv_layout``; see :func:`paged_decode`."""
    _check_kv_layout(kv_layout)

    def expand4(name, x):
        # page_size == 1 caches may drop the page dim (FlashInfer `_unpack_paged_kv_cache`).
        _check_float_tensor(name, x)
        if x.dim() == 3:
            return x.unsqueeze(1 if kv_layout == "NHD" else 2)
        if x.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D [num_pages, page_size, Hkv, D] (NHD) or "
                f"[num_pages, Hkv, page_size, D] (HND), got shape {tuple(x.shape)}"
            )
        return x

    if v_cache is not None:
        return expand4("k_cache", k_cache), expand4("v_cache", v_cache)
    if isinstance(k_cache, (tuple, list)):
        if len(k_cache) != 2:
            raise ValueError(f"paged kv cache tuple must be (k_cache, v_cache), got {len(k_cache)} items")
        return expand4("k_cache", k_cache[0]), expand4("v_cache", k_cache[1])
    _check_float_tensor("paged_kv_cache", k_cache)
    x = k_cache
    if x.dim() == 4:  # combined cache with page_size == 1 and the page dim dropped
        x = x.unsqueeze(2 if kv_layout == "NHD" else 3)
    if x.dim() != 5 or x.shape[1] != 2:
        raise ValueError(
            "combined paged kv cache must be 5-D [num_pages, 2, page_size, Hkv, D] (NHD) or "
            f"[num_pages, 2, Hkv, page_size, D] (HND), got shape {tuple(k_cache.shape)}"
        )
    return x[:, 0], x[:, 1]


def paged_kv_to_contiguous(
    k_cache,
    v_cache,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    *,
    kv_layout: str = "NHD",
    k_scale=None,
    v_scale=None,
):
    """Gather each request's K/V out of a paged cache into contiguous NHD tensors.

    Token ``t`` of request ``b`` lives at page ``kv_indices[kv_indptr[b] + t // page_size]``,
    slot ``t % page_size`` (FlashInfer's page-table convention).  Cache forms as in
    :func:`paged_decode`.  ``k_scale`` / ``v_scale`` (None: leave that cache as it is) dequantise
    the gathered K / V to float64 (:func:`dequantize_kv_cache`): an fp8 cache as its values.

    Returns:
        ``(ks, vs)``: python lists of length ``B`` with ``ks[b]`` ``[kv_len_b, Hkv, Dqk]``
        and ``vs[b]`` ``[kv_len_b, Hkv, Dvo]`` (cache dtype, float64 where scaled; cache device, NHD).

    Raises:
        TypeError / ValueError / KeyError: see :func:`paged_decode` and :func:`dequantize_kv_cache`.
    """
    k4, v4 = _unpack_paged_cache(k_cache, v_cache, kv_layout)
    if kv_layout == "HND":
        k4 = k4.transpose(1, 2)
        v4 = v4.transpose(1, 2)
    # now [num_pages, page_size, Hkv, D]
    if k4.shape[:3] != v4.shape[:3]:
        raise ValueError(
            "k_cache and v_cache must agree on [num_pages, page_size, Hkv] "
            f"(after layout {kv_layout}), got {tuple(k4.shape[:3])} and {tuple(v4.shape[:3])}"
        )
    if k4.device != v4.device:
        raise ValueError(f"k_cache and v_cache must be on the same device, got {k4.device}, {v4.device}")
    num_pages, page_size = k4.shape[0], k4.shape[1]
    ptr, idx, lens = _csr_lists(kv_indptr, kv_indices, kv_last_page_len, int(page_size))
    for t, p in enumerate(idx):
        if not 0 <= p < num_pages:
            raise ValueError(f"kv_indices[{t}]={p} is out of range [0, num_pages={num_pages})")
    ks, vs = [], []
    for b in range(len(lens)):
        pages = torch.tensor(idx[ptr[b] : ptr[b + 1]], dtype=torch.long, device=k4.device)
        ntok = pages.numel() * page_size
        kb = k4.index_select(0, pages).reshape(ntok, *k4.shape[2:])[: lens[b]]
        vb = v4.index_select(0, pages).reshape(ntok, *v4.shape[2:])[: lens[b]]
        ks.append(kb if k_scale is None else dequantize_kv_cache(kb, k_scale))
        vs.append(vb if v_scale is None else dequantize_kv_cache(vb, v_scale))
    return ks, vs
