"""FlashInfer-shaped bit packing: ``packbits`` and ``segment_packbits`` (``flashinfer.quantization``).

Signatures, defaults and semantics follow FlashInfer 0.7.2: each packs a binary-valued
1-D array into ``uint8`` with ``numpy.packbits`` semantics (``bitorder="big"`` by
default: the first element goes to the most significant bit; ``"little"``: to the
least significant bit; the last byte is zero-padded).  The custom masks of the
prefill wrappers are packed with ``bitorder="little"`` (bit ``off % 8`` of byte
``off // 8`` holds element ``off``).

Plain torch (no kernel launch of this package's own), so it runs on CPU and CUDA
tensors alike; ``segment_packbits`` reads ``indptr`` on the host (a device
synchronisation when it lives on a GPU), like FlashInfer's.
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["packbits", "segment_packbits"]

_BITORDERS = ("big", "little")


def _check_bits(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype.is_floating_point or x.dtype.is_complex:
        # numpy.packbits: "Expected an input array of integer or boolean data type"
        raise TypeError(f"{name} must have a boolean or integer dtype (binary-valued), got {x.dtype}")
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")


def _check_bitorder(bitorder) -> None:
    if bitorder not in _BITORDERS:
        raise ValueError(f"bitorder must be 'big' or 'little', got {bitorder!r}")


def _pack_padded(bits: torch.Tensor, bitorder: str) -> torch.Tensor:
    """Pack a bool tensor whose length is a multiple of 8 into uint8."""
    shifts = torch.arange(8, dtype=torch.int32, device=bits.device)
    if bitorder == "big":
        shifts = 7 - shifts
    words = bits.view(-1, 8).to(torch.int32) << shifts
    return words.sum(dim=1, dtype=torch.int32).to(torch.uint8)


def packbits(x: torch.Tensor, bitorder: str = "big") -> torch.Tensor:
    """Pack the elements of a binary-valued 1-D array into bits of a uint8 array (``numpy.packbits``).

    Args:
      x: 1-D bool or integer tensor (nonzero = 1), any device.
      bitorder: ``"big"`` (default, as FlashInfer and numpy: element ``8k`` is bit 7 of
        byte ``k``) or ``"little"`` (element ``8k`` is bit 0 of byte ``k``).

    Returns:
      uint8 tensor ``[(len(x) + 7) // 8]`` on ``x``'s device; the last byte is zero-padded.

    Raises:
      TypeError: ``x`` is not a tensor or has a floating/complex dtype.
      ValueError: ``x`` is not 1-D, or ``bitorder`` is neither ``"big"`` nor ``"little"``.
    """
    _check_bits("x", x)
    _check_bitorder(bitorder)
    n = x.shape[0]
    nbytes = (n + 7) // 8
    bits = torch.zeros(nbytes * 8, dtype=torch.bool, device=x.device)
    bits[:n] = x != 0
    return _pack_padded(bits, bitorder)


def segment_packbits(
    x: torch.Tensor, indptr: torch.Tensor, bitorder: str = "big"
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pack each segment ``x[indptr[i]:indptr[i+1]]`` separately into whole bytes (FlashInfer semantics).

    Segment ``i`` is packed as ``packbits(x[indptr[i]:indptr[i+1]], bitorder)`` and stored at
    ``y[new_indptr[i]:new_indptr[i+1]]``, so every segment starts on a byte boundary.

    Args:
      x: 1-D bool or integer tensor (nonzero = 1) with ``indptr[-1]`` elements.
      indptr: integer ``[B + 1]`` segment offsets into ``x`` (elements), non-decreasing,
        ``indptr[0] >= 0``; any device (read on the host).
      bitorder: ``"big"`` (default) or ``"little"`` (what the prefill custom masks use).

    Returns:
      ``(y, new_indptr)``: ``y`` uint8 ``[new_indptr[-1]]`` on ``x``'s device;
      ``new_indptr`` int32 ``[B + 1]`` on ``indptr``'s device, in bytes, starting at 0, with
      ``new_indptr[i+1] - new_indptr[i] == (indptr[i+1] - indptr[i] + 7) // 8``.

    Raises:
      TypeError: ``x``/``indptr`` not tensors, ``x`` floating, ``indptr`` not integer.
      ValueError: wrong ndim, empty ``indptr``, negative or decreasing offsets,
        ``indptr[-1] != len(x)``, bad ``bitorder``.
    """
    _check_bits("x", x)
    if not isinstance(indptr, torch.Tensor):
        raise TypeError(f"indptr must be a torch.Tensor, got {type(indptr).__name__}")
    if indptr.dtype.is_floating_point or indptr.dtype.is_complex or indptr.dtype == torch.bool:
        raise TypeError(f"indptr must have an integer dtype, got {indptr.dtype}")
    if indptr.dim() != 1 or indptr.shape[0] < 1:
        raise ValueError(f"indptr must be 1-D with batch_size + 1 >= 1 entries, got shape {tuple(indptr.shape)}")
    _check_bitorder(bitorder)
    ptr = indptr.to("cpu", torch.int64)
    seg = ptr[1:] - ptr[:-1]
    if int(ptr[0]) < 0:
        raise ValueError(f"indptr[0] must be >= 0, got {int(ptr[0])}")
    if (seg < 0).any():
        raise ValueError("indptr must be non-decreasing")
    if int(ptr[-1]) != x.shape[0]:
        raise ValueError(f"indptr[-1] ({int(ptr[-1])}) must equal len(x) ({x.shape[0]})")
    nbytes = (seg + 7) // 8
    new_ptr = torch.zeros(ptr.shape[0], dtype=torch.int64)
    new_ptr[1:] = torch.cumsum(nbytes, 0)
    total = int(new_ptr[-1])
    dev = x.device
    bits = torch.zeros(total * 8, dtype=torch.bool, device=dev)
    used = int(ptr[-1] - ptr[0])
    if used:
        # element e of segment i goes to bit 8 * new_ptr[i] + (e - ptr[i])
        shift = (8 * new_ptr[:-1] - ptr[:-1]).to(dev)
        pos = torch.arange(int(ptr[0]), int(ptr[-1]), device=dev) + torch.repeat_interleave(shift, seg.to(dev), output_size=used)
        bits[pos] = x[int(ptr[0]):] != 0
    return _pack_padded(bits, bitorder), new_ptr.to(device=indptr.device, dtype=torch.int32)
