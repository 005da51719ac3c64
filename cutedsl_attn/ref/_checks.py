"""Argument checks shared by the oracle's modules (errors name the argument and the rule)."""

from __future__ import annotations

import torch

_POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")
_KV_LAYOUTS = ("NHD", "HND")
_ORACLE_DTYPES = (torch.float32, torch.float64)


def _check_float_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype, got {x.dtype}")


def _check_int_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype, got {x.dtype}")


def _check_ndim(name: str, x: torch.Tensor, ndim: int, shape_doc: str) -> None:
    if x.dim() != ndim:
        raise ValueError(
            f"{name} must be {ndim}-D {shape_doc}, got shape {tuple(x.shape)}"
        )


def _check_pos_encoding_mode(mode) -> str:
    if mode not in _POS_ENCODING_MODES:
        # FlashInfer raises KeyError("Invalid pos_encoding_mode ...") (flashinfer/utils.py)
        raise KeyError(
            f"Invalid pos_encoding_mode {mode!r}; expected one of {_POS_ENCODING_MODES}"
        )
    return mode


def _check_kv_layout(kv_layout) -> str:
    if kv_layout not in _KV_LAYOUTS:
        # FlashInfer raises KeyError("Invalid kv_layout ...") (flashinfer/utils.py)
        raise KeyError(f"Invalid kv_layout {kv_layout!r}; expected one of {_KV_LAYOUTS}")
    return kv_layout


def _check_oracle_dtype(dtype) -> torch.dtype:
    if dtype not in _ORACLE_DTYPES:
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    return dtype


def _indptr_list(name: str, indptr: torch.Tensor) -> list:
    _check_int_tensor(name, indptr)
    _check_ndim(name, indptr, 1, "[batch_size + 1]")
    if indptr.numel() < 1:
        raise ValueError(f"{name} must have at least one element (batch_size + 1)")
    vals = [int(x) for x in indptr.tolist()]
    if vals[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {vals[0]}")
    for a, b in zip(vals[:-1], vals[1:]):
        if b < a:
            raise ValueError(f"{name} must be non-decreasing, got {vals}")
    return vals
