"""Page tables to the kernels' flat page-id array, shared by the decode and prefill wrappers.

A CSR table (``indptr`` in pages, flat ``indices``, ``last_page_len``) is used as given; a dense block table
``[B, max_pages]`` is flattened row-major, request ``b``'s pages starting at ``b * max_pages``.
"""

from __future__ import annotations

import torch

from ._common import check_tensor, csr_kv_lens
from ._graph import to_device


def check_table_width(name: str, table: torch.Tensor, kv_lens: torch.Tensor, page_size: int) -> None:
    """ValueError naming ``name`` when the 2-D page table ``table`` has fewer columns than the longest of
    ``kv_lens`` (host int64 lengths) needs at ``page_size``."""
    if kv_lens.numel() and int(kv_lens.max()) > table.shape[1] * page_size:
        need = -(-int(kv_lens.max()) // page_size)
        raise ValueError(f"{name} is too narrow for seq_lens: the longest sequence ({int(kv_lens.max())} tokens at "
                         f"page_size {page_size}) needs {need} columns, {name} has {table.shape[1]}")


def from_block_tables(block_tables, seq_lens, page_size: int, device, non_blocking: bool, *,
                      batch_size: int | None = None, batch_name: str = "len(qo_indptr) - 1"):
    """``(kv_lens, page_offsets, flat)`` of a dense block table: int64 host ``[B]`` lengths (``seq_lens``) and
    page-list offsets, and the flat int32 page ids on ``device``.

    ``batch_size``: the planned batch (``block_tables`` must have that many rows; None: its rows are the batch).
    Raises ValueError naming ``block_tables`` / ``seq_lens`` (given alone, wrong dtype / shape, negative
    lengths, a table too narrow for its lengths)."""
    if block_tables is None or seq_lens is None:
        raise ValueError("block_tables and seq_lens must be given together")
    check_tensor("block_tables", block_tables, ndim=2)
    if block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    block_tables = to_device(block_tables, device, non_blocking)  # as FlashInfer: a host table is copied
    B = block_tables.shape[0]
    if batch_size is not None and B != batch_size:
        raise ValueError(f"block_tables must have B = {batch_name} = {batch_size} rows, got {B}")
    check_tensor("seq_lens", seq_lens, ndim=1)
    if seq_lens.dtype.is_floating_point or seq_lens.dtype == torch.bool:
        raise ValueError(f"seq_lens must be an integer tensor, got {seq_lens.dtype}")
    if seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens must have shape [{B}], got {tuple(seq_lens.shape)}")
    kv_lens = seq_lens.to("cpu", torch.int64)
    if (kv_lens < 0).any():
        raise ValueError("seq_lens must be >= 0")
    check_table_width("block_tables", block_tables, kv_lens, page_size)
    flat = (block_tables if block_tables.is_contiguous() else block_tables.contiguous()).reshape(-1)
    return kv_lens, torch.arange(B, dtype=torch.int64) * block_tables.shape[1], flat


def from_csr(indptr, indices, last_page_len, page_size: int, device, non_blocking: bool, *,
             batch_size: int | None = None, batch_name: str = "len(qo_indptr) - 1",
             names=("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")):
    """``(indptr_host, kv_lens, page_offsets, flat)`` of a CSR page table: int64 host offsets ``[B+1]``, lengths
    and page-list offsets ``[B]``, and ``indices`` on ``device`` (copied there when elsewhere, as FlashInfer).

    ``batch_size`` None: ``len(last_page_len)`` (else ``batch_name`` says where it comes from).  ``names``: the
    three arguments' names in the caller's API.
    Raises TypeError / ValueError naming the argument (dtype int32, 1-D, offsets from 0 and non-decreasing,
    ``last_page_len`` in ``[1, page_size]`` (0 for a request with no page), ``indptr[-1] <= len(indices)``)."""
    ip_name, idx_name, lpl_name = names
    for n, t in ((ip_name, indptr), (idx_name, indices), (lpl_name, last_page_len)):
        check_tensor(n, t, ndim=1)
        if t.dtype != torch.int32:
            raise ValueError(f"{n} must be int32, got {t.dtype}")
    indices = to_device(indices, device, non_blocking)
    B = last_page_len.shape[0] if batch_size is None else batch_size
    ip_h, kv_lens = csr_kv_lens(indptr, last_page_len, B, page_size, names=(ip_name, lpl_name),
                                batch_name=None if batch_size is None else batch_name)
    if int(ip_h[-1]) > indices.shape[0]:
        raise ValueError(f"{ip_name}[-1] ({int(ip_h[-1])}) exceeds len({idx_name}) ({indices.shape[0]})")
    return ip_h, kv_lens, ip_h[:-1], indices
