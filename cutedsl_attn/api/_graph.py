"""CUDA-graph bookkeeping shared by the decode and prefill wrappers: caller buffers, wrapper-owned buffers of
fixed address, the re-plan signature check, and host-to-device copies that a stream capture may record.

A captured graph replays the kernels, scalars and buffer addresses of its capture; ``plan()`` afterwards may
only rewrite buffer contents (lengths, page ids, work tables).
"""

from __future__ import annotations

import contextlib
import threading

import torch


def check_graph_buffer(name: str, t, device, *, dtype=torch.int32, length: int | None = None) -> None:
    """A caller-provided CUDA-graph buffer: a 1-D ``dtype`` tensor on ``device`` (of ``length`` entries when given).

    Raises ValueError naming ``name``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor when use_cuda_graph=True")
    if t.dtype != dtype or t.device != device:
        raise ValueError(f"{name} must be {dtype} on {device}, got {t.dtype} on {t.device}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} must have {length} entries, got {t.shape[0]}")


def changed_keys(first: dict, now: dict) -> list[str]:
    """The keys of two graph signatures (``cutedsl_attn.dispatch.graph_signature``) whose values differ."""
    return [k for k in now if first.get(k) != now[k]] + [k for k in first if k not in now]


class FixedBuffers:
    """Wrapper-owned device buffers that keep their address across plans (CUDA-graph mode) or are re-made per
    plan (``fixed=False``).  ``copy(name, src)`` writes a host or device tensor into the buffer ``name``
    (allocated on first use with ``src``'s shape and dtype) and returns the view of ``src``'s rows."""

    def __init__(self, device, fixed: bool):
        self.device, self.fixed, self._bufs = device, fixed, {}

    def get(self, name: str):
        return self._bufs.get(name)

    def copy(self, name: str, src: torch.Tensor, *, non_blocking: bool, grow_error: str | None = None):
        """``src`` on the device; in fixed mode inside the buffer ``name``.  Raises ValueError(``grow_error``)
        when ``src`` has more rows than the fixed buffer."""
        if not self.fixed:
            return to_device(src, self.device, non_blocking)
        buf = self._bufs.get(name)
        if buf is None:
            buf = self._bufs[name] = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        elif src.shape[0] > buf.shape[0] or src.shape[1:] != buf.shape[1:]:
            raise ValueError(grow_error or f"{name} grew beyond the first plan's size (not allowed in CUDA-graph mode)")
        view = buf[: src.shape[0]]
        view.copy_(pinned_if_capturing(src), non_blocking=non_blocking)
        return view


_PINNED: dict = {}  # (dtype, shape, bytes) -> pinned host tensor, never freed: a captured copy reads it at replay
_PINNED_MAX = 4096
_STAGING = threading.local()


@contextlib.contextmanager
def staged_host_copies():
    """Inside, host tables copied to the device (work tables, masks, slopes) are kept pinned by content, so the
    same call inside a later stream capture (``torch.compile``'s ``reduce-overhead`` warms up, then captures)
    finds them: a captured copy reads its source at every replay, a copy from pageable memory cannot be
    captured, and pinning memory during a capture may be refused."""
    prev = getattr(_STAGING, "on", False)
    _STAGING.on = True
    try:
        yield
    finally:
        _STAGING.on = prev


def pinned_if_capturing(t: torch.Tensor) -> torch.Tensor:
    """``t``, or (a host tensor during a CUDA stream capture, or inside :func:`staged_host_copies`) an immutable
    pinned copy of it that lives as long as the process.  Raises RuntimeError when a capture needs a table that
    was not staged and CUDA refuses to pin memory during the capture (warm up the call before capturing)."""
    if t.device.type != "cpu" or not torch.cuda.is_available():
        return t
    capturing = torch.cuda.is_current_stream_capturing()
    if not capturing and not getattr(_STAGING, "on", False):
        return t
    t = t.contiguous()
    key = (t.dtype, tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
    p = _PINNED.get(key)
    if p is None:
        if len(_PINNED) >= _PINNED_MAX and not capturing:
            return t
        try:
            p = t.pin_memory()
        except RuntimeError as e:
            raise RuntimeError(f"cutedsl_attn: a host table this capture needs could not be pinned during the capture "
                               f"({e}); run the call once before capturing it") from None
        _PINNED[key] = p
    return p


def to_device(t: torch.Tensor, device, non_blocking: bool) -> torch.Tensor:
    """``t`` on ``device`` (a capturable copy during a stream capture, :func:`pinned_if_capturing`)."""
    if t.device == device:
        return t
    return pinned_if_capturing(t).to(device, non_blocking=non_blocking)
