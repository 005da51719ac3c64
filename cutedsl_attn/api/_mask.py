"""Custom-mask packing shared by the prefill wrappers (and decode's multi-row path through them)."""

from __future__ import annotations

import torch

from ._common import check_tensor
from .quantization import segment_packbits


def pack_custom_mask(custom_mask, packed_custom_mask, qo_lens: torch.Tensor, kv_lens: torch.Tensor):
    """``(packed, byte_ptr)`` of a batch's custom mask, or ``(None, None)`` without one.

    ``custom_mask``: bool, each request's row-major ``[qo_len_b, kv_len_b]`` concatenated (``False`` =
    masked); ``packed_custom_mask``: uint8, that mask packed little-endian per request, each padded to whole
    bytes (wins over ``custom_mask``, as FlashInfer).  ``qo_lens`` / ``kv_lens``: int64 ``[B]`` on the host.
    ``packed``: uint8 ``[sum_b ceil(qo_len_b * kv_len_b / 8)]``; ``byte_ptr``: int64 ``[B+1]`` request offsets
    in bytes (host).  Raises TypeError / ValueError naming the argument for a wrong type, dtype or size.
    """
    if custom_mask is None and packed_custom_mask is None:
        return None, None
    B = qo_lens.shape[0]
    n_elem = qo_lens * kv_lens
    byte_ptr = torch.zeros(B + 1, dtype=torch.int64)
    byte_ptr[1:] = torch.cumsum((n_elem + 7) // 8, 0)
    if packed_custom_mask is not None:
        check_tensor("packed_custom_mask", packed_custom_mask, ndim=1)
        if packed_custom_mask.dtype != torch.uint8:
            raise ValueError(f"packed_custom_mask must be uint8, got {packed_custom_mask.dtype}")
        if packed_custom_mask.shape[0] != int(byte_ptr[-1]):
            raise ValueError(
                f"packed_custom_mask has {packed_custom_mask.shape[0]} bytes; the batch needs "
                f"sum_b ceil(qo_len_b * kv_len_b / 8) = {int(byte_ptr[-1])} (segment_packbits(custom_mask, "
                "mask_indptr, bitorder='little'), each request padded to whole bytes)"
            )
        return packed_custom_mask, byte_ptr
    check_tensor("custom_mask", custom_mask)
    if custom_mask.dtype != torch.bool:
        raise ValueError(f"custom_mask must be torch.bool, got {custom_mask.dtype}")
    need = int(n_elem.sum()) if B else 0
    if custom_mask.numel() != need:
        raise ValueError(f"custom_mask must have sum_b qo_len_b * kv_len_b = {need} elements, got {custom_mask.numel()}")
    elem_ptr = torch.zeros(B + 1, dtype=torch.int64)
    elem_ptr[1:] = torch.cumsum(n_elem, 0)
    packed, _ = segment_packbits(custom_mask.reshape(-1), elem_ptr, bitorder="little")
    return packed, byte_ptr
