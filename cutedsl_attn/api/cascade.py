"""Attention-state merging (``flashinfer.cascade`` API): ``merge_state``,
``merge_state_in_place``, ``merge_states``.

An attention *state* for a set of keys is the pair ``(v, s)``: ``v`` the softmax-
normalised output over those keys and ``s`` its base-2 log-sum-exp
(``s = log2(sum_j exp(logit_j))``, FlashInfer's LSE convention).  Merging states of two disjoint key sets gives the state of their
union::

    m  = max(s_a, s_b);  w_a = 2^(s_a - m);  w_b = 2^(s_b - m)
    v  = (w_a * v_a + w_b * v_b) / (w_a + w_b)
    s  = m + log2(w_a + w_b)

A state with ``s = -inf`` is empty (no visible key) and contributes nothing, even if its
``v`` holds garbage (NaN/inf); merging only empty states gives ``v = 0``, ``s = -inf``
with no NaN.

Implementation: plain torch ops computed in float32 (FlashInfer's documented
behaviour, implemented here without a custom kernel yet); works on CPU and CUDA.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["merge_state", "merge_state_in_place", "merge_states"]


# ----------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------
def _check_v(name: str, v) -> None:
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(v).__name__}")
    if not v.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype, got {v.dtype}")


def _check_s(name: str, s) -> None:
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(s).__name__}")
    if not s.is_floating_point():
        raise TypeError(
            f"{name} must have a floating-point dtype (base-2 LSE, float32), got {s.dtype}"
        )


def _check_pair(v_name, v, s_name, s) -> None:
    _check_v(v_name, v)
    _check_s(s_name, s)
    if v.dim() != 3:
        raise ValueError(f"{v_name} must be 3-D [n, H, D], got shape {tuple(v.shape)}")
    if s.dim() != 2:
        raise ValueError(f"{s_name} must be 2-D [n, H], got shape {tuple(s.shape)}")
    if tuple(s.shape) != tuple(v.shape[:2]):
        raise ValueError(
            f"{s_name} shape {tuple(s.shape)} must equal {v_name}.shape[:2] = {tuple(v.shape[:2])}"
        )
    if s.device != v.device:
        raise ValueError(
            f"{s_name} must be on the same device as {v_name}, got {s.device} and {v.device}"
        )


def _check_two_states(a_names, a, b_names, b) -> None:
    (va_n, sa_n), (va, sa) = a_names, a
    (vb_n, sb_n), (vb, sb) = b_names, b
    _check_pair(va_n, va, sa_n, sa)
    _check_pair(vb_n, vb, sb_n, sb)
    if tuple(va.shape) != tuple(vb.shape):
        raise ValueError(
            f"{va_n} and {vb_n} must have the same shape [n, H, D], got "
            f"{tuple(va.shape)} and {tuple(vb.shape)}"
        )
    if va.dtype != vb.dtype:
        raise TypeError(f"{va_n} and {vb_n} must have the same dtype, got {va.dtype} and {vb.dtype}")
    if va.device != vb.device:
        raise ValueError(
            f"{va_n} and {vb_n} must be on the same device, got {va.device} and {vb.device}"
        )


# ----------------------------------------------------------------------------------
# math (float32)
# ----------------------------------------------------------------------------------
def _merge_stack(v: torch.Tensor, s: torch.Tensor, dim: int):
    """Merge states stacked along ``dim`` (v ``[..., D]``, s = v.shape[:-1]); float32 out."""
    v32 = v.to(torch.float32)
    s32 = s.to(torch.float32)
    m = s32.amax(dim=dim, keepdim=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp2(s32 - m_safe)  # 0 for s = -inf
    live = w > 0
    w = torch.where(live, w, torch.zeros_like(w))
    contrib = torch.where(live.unsqueeze(-1), w.unsqueeze(-1) * v32, torch.zeros_like(v32))
    num = contrib.sum(dim=dim)
    den = w.sum(dim=dim)
    nonempty = den > 0
    v_out = num / torch.where(nonempty, den, torch.ones_like(den)).unsqueeze(-1)
    s_out = torch.where(
        nonempty,
        m.squeeze(dim) + torch.log2(torch.where(nonempty, den, torch.ones_like(den))),
        torch.full_like(den, float("-inf")),
    )
    return v_out, s_out


# ----------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------
def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states (``flashinfer.cascade.merge_state``).

    Torch-implemented (float32 math, no custom kernel yet).  Convention: FlashInfer's, base-2 LSE.

    Args:
        v_a: ``[n, H, D]`` attention output over key set A (any float dtype).
        s_a: ``[n, H]`` base-2 LSE of A (float32 expected; other float dtypes are cast).
        v_b: ``[n, H, D]`` output over a disjoint key set B (same shape/dtype/device as
            ``v_a``).
        s_b: ``[n, H]`` base-2 LSE of B.

    Returns:
        ``(v, s)``: ``v`` ``[n, H, D]`` in ``v_a``'s dtype, ``s`` ``[n, H]`` float32; the
        state of A u B.  Rows where both ``s`` are ``-inf``: ``v = 0``, ``s = -inf``.

    Raises:
        TypeError: an argument is not a tensor, a ``v`` or ``s`` is not floating point, or
            ``v_a.dtype != v_b.dtype``.
        ValueError: ``v_*`` not 3-D, ``s_*`` not 2-D, ``s_*.shape != v_*.shape[:2]``,
            ``v_a.shape != v_b.shape``, or tensors on different devices.
    """
    _check_two_states(("v_a", "s_a"), (v_a, s_a), ("v_b", "s_b"), (v_b, s_b))
    v, s = _merge_stack(
        torch.stack([v_a, v_b], dim=1),
        torch.stack([s_a.to(torch.float32), s_b.to(torch.float32)], dim=1),
        dim=1,
    )
    return v.to(v_a.dtype), s


def merge_state_in_place(
    v: torch.Tensor,
    s: torch.Tensor,
    v_other: torch.Tensor,
    s_other: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
) -> None:
    """Merge ``(v_other, s_other)`` into ``(v, s)`` in place
    (``flashinfer.cascade.merge_state_in_place``).

    Torch-implemented (float32 math, no custom kernel yet).  Convention: FlashInfer's.  Rows with ``mask[i] == False`` are left
    untouched (no host sync, CUDA-graph friendly).

    Args:
        v: ``[n, H, D]`` float, updated in place.
        s: ``[n, H]`` float32 base-2 LSE, updated in place.
        v_other: ``[n, H, D]`` same dtype/device as ``v``.
        s_other: ``[n, H]`` float (cast to float32).
        mask: optional bool ``[n]`` on ``v``'s device selecting rows to merge.

    Returns:
        ``None``.

    Raises:
        TypeError: non-tensor / non-float arguments, ``s`` not float32 (it is written in
            place), ``v_other.dtype != v.dtype``, ``mask`` not bool.
        ValueError: shape/ndim mismatches (as :func:`merge_state`), ``mask`` not ``[n]``,
            or any tensor on a different device.
    """
    _check_two_states(("v", "s"), (v, s), ("v_other", "s_other"), (v_other, s_other))
    if s.dtype != torch.float32:
        raise TypeError(f"s must be float32 (it is updated in place), got {s.dtype}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor [n], got dtype {mask.dtype}")
        if tuple(mask.shape) != (v.shape[0],):
            raise ValueError(
                f"mask must have shape [n] = [{v.shape[0]}], got {tuple(mask.shape)}"
            )
        if mask.device != v.device:
            raise ValueError(
                f"mask must be on the same device as v, got {mask.device} and {v.device}"
            )
    v_new, s_new = _merge_stack(
        torch.stack([v, v_other], dim=1),
        torch.stack([s, s_other.to(torch.float32)], dim=1),
        dim=1,
    )
    v_new = v_new.to(v.dtype)
    if mask is not None:
        v_new = torch.where(mask[:, None, None], v_new, v)
        s_new = torch.where(mask[:, None], s_new, s)
    v.copy_(v_new)
    s.copy_(s_new)


def merge_states(v: torch.Tensor, s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge ``num_states`` attention states per row (``flashinfer.cascade.merge_states``).

    Torch-implemented (float32 math, no custom kernel yet).  Convention: FlashInfer's, base-2 LSE; empty states (``s = -inf``) contribute
    nothing; ``num_states == 0`` or all-empty rows give ``v = 0``, ``s = -inf``.

    Args:
        v: ``[n, num_states, H, D]`` any float dtype.
        s: ``[n, num_states, H]`` base-2 LSE (float32 expected; other floats are cast).

    Returns:
        ``(v [n, H, D]`` in ``v``'s dtype, ``s [n, H]`` float32``)``.

    Raises:
        TypeError: non-tensor or non-float ``v``/``s``.
        ValueError: ``v`` not 4-D, ``s`` not 3-D, ``s.shape != v.shape[:3]``, or different
            devices.
    """
    _check_v("v", v)
    _check_s("s", s)
    if v.dim() != 4:
        raise ValueError(f"v must be 4-D [n, num_states, H, D], got shape {tuple(v.shape)}")
    if s.dim() != 3:
        raise ValueError(f"s must be 3-D [n, num_states, H], got shape {tuple(s.shape)}")
    if tuple(s.shape) != tuple(v.shape[:3]):
        raise ValueError(
            f"s shape {tuple(s.shape)} must equal v.shape[:3] = {tuple(v.shape[:3])}"
        )
    if s.device != v.device:
        raise ValueError(f"s must be on the same device as v, got {s.device} and {v.device}")
    n, num_states, H, D = v.shape
    if num_states == 0:
        return (
            torch.zeros(n, H, D, dtype=v.dtype, device=v.device),
            torch.full((n, H), float("-inf"), dtype=torch.float32, device=v.device),
        )
    v_out, s_out = _merge_stack(v, s, dim=1)
    return v_out.to(v.dtype), s_out
