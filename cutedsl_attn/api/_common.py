"""Argument checks and conversions shared by the FlashInfer-shaped API functions.

Every check raises before any kernel launch: ``TypeError`` for a wrong Python
type, ``ValueError`` for a wrong value, shape, dtype or device (as FlashInfer's
``check_shape_dtype_device``), ``NotImplementedError`` for a
documented FlashInfer feature this package does not serve yet (the message says
what is supported).
"""

from __future__ import annotations

import os

import torch

SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")

_DTYPE_NAMES = {
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "float": torch.float32,
    "float8_e4m3fn": getattr(torch, "float8_e4m3fn", None), "float8_e5m2": getattr(torch, "float8_e5m2", None),
}


def canonical_dtype(name: str, value) -> torch.dtype | None:
    """Accept a torch dtype or FlashInfer's string spelling ("float16", "bfloat16", ...)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.replace("torch.", "")
        if key in _DTYPE_NAMES and _DTYPE_NAMES[key] is not None:
            return _DTYPE_NAMES[key]
    raise TypeError(f"{name} must be a torch.dtype or a dtype name such as 'bfloat16', got {value!r}")


def check_kv_layout(kv_layout: str) -> str:
    if kv_layout not in ("NHD", "HND"):
        raise KeyError(f"Invalid kv_layout {kv_layout!r}: must be 'NHD' or 'HND' (as FlashInfer)")
    return kv_layout


def check_pos_encoding_mode(mode: str) -> str:
    if mode not in POS_ENCODING_MODES:
        raise KeyError(f"Invalid pos_encoding_mode {mode!r}: must be one of {POS_ENCODING_MODES}")
    return mode


def check_head_dim(head_dim: int) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(f"head_dim={head_dim} is not supported; supported: {SUPPORTED_HEAD_DIMS}")


def check_heads(num_qo_heads: int, num_kv_heads: int) -> int:
    if num_qo_heads <= 0 or num_kv_heads <= 0:
        raise ValueError(f"num_qo_heads and num_kv_heads must be positive, got {num_qo_heads}, {num_kv_heads}")
    if num_qo_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    group = num_qo_heads // num_kv_heads
    if group > 16:
        raise NotImplementedError(
            f"num_qo_heads / num_kv_heads = {num_qo_heads} / {num_kv_heads} = {group} query heads per kv head (GQA group size) "
            "is not supported; supported: 1..16"
        )
    return group


def check_int(name: str, value, minimum: int | None = None) -> int:
    """An integer argument (Python or numpy int, not bool): ``TypeError`` otherwise, ``ValueError`` below ``minimum``."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_bool(name: str, value) -> bool:
    """A Python ``bool`` argument (FlashInfer documents these as ``bool``): ``TypeError`` naming ``name`` for any
    other type, so that a string such as ``"False"`` or an int is never taken as truthy."""
    if type(value) is not bool:
        raise TypeError(f"{name} must be a bool (True or False), got {value!r} of type {type(value).__name__}")
    return value


def check_optional_bool(name: str, value) -> bool | None:
    """None or a Python ``bool`` (an option whose None means "the default"): ``TypeError`` otherwise."""
    return None if value is None else check_bool(name, value)


def check_float(name: str, value, *, positive: bool) -> float | None:
    """A finite real argument or None (Python/numpy float or int, or a 0-d tensor)."""
    import math
    import numbers

    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


#: FlashInfer's run-time LSE options (``lse_base`` / ``lse_layout`` of the prefill wrappers' ``run``).
LSE_BASES = ("log2", "ln")
LSE_LAYOUTS = ("NH", "HN")
_INT32_MAX = 2**31 - 1
_FLOAT32_MAX = 3.4e38


def check_lse_options(lse_base, lse_layout) -> None:
    """``ValueError`` unless ``lse_base`` is in :data:`LSE_BASES` and ``lse_layout`` in :data:`LSE_LAYOUTS`."""
    if lse_base not in LSE_BASES:
        raise ValueError(f"lse_base must be one of {LSE_BASES}, got {lse_base!r}")
    if lse_layout not in LSE_LAYOUTS:
        raise ValueError(f"lse_layout must be one of {LSE_LAYOUTS}, got {lse_layout!r}")


def run_scale(name: str, x, *, where: str = "") -> float:
    """A ``q_scale``/``k_scale``/``v_scale``/``o_scale`` of ``run()``: None -> 1.0, else a finite real number
    (Python or numpy, not a bool, as :func:`check_float`; ``TypeError`` for another type, ``ValueError`` for
    nan/inf); a tensor (fp8 calibration) raises ``NotImplementedError`` (``where`` names the backend in that
    message)."""
    import math
    import numbers

    if x is None:
        return 1.0
    if isinstance(x, torch.Tensor):
        raise NotImplementedError(f"{name} as a tensor (fp8 calibration) is not supported{where}; pass a float")
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a float or None, got {type(x).__name__}")
    if not math.isfinite(float(x)):
        raise ValueError(f"{name} must be finite, got {x}")
    return float(x)


def check_window_left(window_left) -> int:
    """``window_left``: an int in [-1, int32 max] (-1 = no window); ``TypeError`` / ``ValueError`` otherwise."""
    window_left = check_int("window_left", window_left, -1)
    if window_left > _INT32_MAX:
        raise ValueError(f"window_left must fit int32 (<= {_INT32_MAX}), got {window_left}")
    return window_left


def check_sm_scale(sm_scale, head_dim_qk: int) -> float:
    """The softmax scale of a prefill or decode plan: None -> ``1/sqrt(head_dim_qk)`` (FlashInfer's default), else
    a real number (Python or numpy, not a bool) that is finite in float32, of any sign (``TypeError`` /
    ``ValueError`` otherwise)."""
    import math
    import numbers

    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim_qk)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale must be a float or None, got {type(sm_scale).__name__}")
    scale = float(sm_scale)
    if not math.isfinite(scale) or abs(scale) > _FLOAT32_MAX:
        raise ValueError(f"sm_scale must be finite in float32, got {sm_scale}")
    return scale


def indptr_host(name: str, t, *, length: int | None = None) -> torch.Tensor:
    """A validated int32 ``[B+1]`` offset array (from 0, non-decreasing), read to the CPU as int64.

    Raises TypeError for a non-tensor, ValueError naming ``name`` for another dtype, length or ndim, a first
    entry other than 0, or a decrease."""
    check_tensor(name, t, ndim=1)
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {t.dtype}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} must have B+1 = {length} entries, got {t.shape[0]}")
    if t.shape[0] < 1:
        raise ValueError(f"{name} must have at least one entry (batch_size + 1)")
    h = t.to("cpu", torch.int64)
    if int(h[0]) != 0:  # as FlashInfer: offsets start at 0
        raise ValueError(f"{name}[0] must be 0, got {int(h[0])}")
    if (h[1:] < h[:-1]).any():
        raise ValueError(f"{name} must be non-decreasing")
    return h


def csr_kv_lens(indptr, last_page_len, B: int, page_size: int, *,
                names=("paged_kv_indptr", "paged_kv_last_page_len"), batch_name: str | None = None):
    """``(indptr on the host, kv_lens)`` of a CSR page table after validating ``indptr`` (``[B+1]`` int32,
    non-decreasing, from 0) and ``last_page_len`` (``[B]`` int32, in ``[1, page_size]`` for a request with
    pages, 0 for a request without); ``kv_len_b = (npages_b - 1) * page_size + last_page_len_b``.  ``names``:
    the two arguments' names in the caller's API (FlashInfer's prefill names by default); ``batch_name``:
    where ``B`` comes from (None: ``len(last_page_len)``, so a length mismatch names both arrays)."""
    from ..planning.decode import kv_lens_from_csr

    ip_name, lpl_name = names
    check_tensor(ip_name, indptr, ndim=1)
    check_tensor(lpl_name, last_page_len, ndim=1)
    if batch_name is None and indptr.shape[0] != last_page_len.shape[0] + 1:
        raise ValueError(f"the lengths of {ip_name} ({indptr.shape[0]}) and {lpl_name} ({last_page_len.shape[0]}) "
                         f"disagree: {ip_name} must have len({lpl_name}) + 1 entries (one request per "
                         f"{lpl_name} entry)")
    if batch_name is not None and indptr.shape[0] != B + 1:
        raise ValueError(f"{ip_name} must have B+1 = {B + 1} entries (B = {batch_name}), got {indptr.shape[0]}")
    ip_h = indptr_host(ip_name, indptr, length=B + 1)
    if last_page_len.dtype != torch.int32:
        raise ValueError(f"{lpl_name} must be int32, got {last_page_len.dtype}")
    if last_page_len.shape[0] != B:
        where = "" if batch_name is None else f" (B = {batch_name})"
        raise ValueError(f"{lpl_name} must have B = {B} entries{where}, got {last_page_len.shape[0]}")
    lpl_h = last_page_len.to("cpu", torch.int64)
    npages = ip_h[1:] - ip_h[:-1]
    empty = (npages == 0) & (lpl_h != 0)
    if empty.any():  # it would read as kv_len 0 while its last_page_len claims tokens
        b = int(empty.nonzero()[0])
        raise ValueError(f"{lpl_name}[{b}] = {int(lpl_h[b])} but request {b} has no page ({ip_name}[{b}] == "
                         f"{ip_name}[{b + 1}]): {lpl_name} must be 0 for a request with no page")
    bad = (npages > 0) & ((lpl_h < 1) | (lpl_h > page_size))
    if bad.any():
        b = int(bad.nonzero()[0])
        raise ValueError(f"{lpl_name}[{b}] = {int(lpl_h[b])} is outside [1, page_size={page_size}] "
                         "(0 only for a request with no page)")
    return ip_h, kv_lens_from_csr(ip_h, lpl_h, page_size)


def check_tensor(name: str, t, *, dtype=None, ndim=None, device=None, shape=None) -> None:
    """``t`` a tensor of ``dtype`` / ``ndim`` / ``shape`` on ``device`` (each None: any), TypeError / ValueError
    naming ``name`` otherwise; the device is checked last, so a wrong shape or dtype is reported as such."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"The dtype of {name} ({t.dtype}) does not match the expected {dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


_ARCH_ENV = "CUTEDSL_ATTN_ARCH"  # compile/arch.py's variable (api/ does not import compile/)


def host_tensors_reach_launch() -> bool:
    """Whether tensors on the host pass :func:`check_devices`: only when cross-compiling on a machine without a
    GPU (``CUTEDSL_ATTN_ARCH`` set), where plans are built and inspected on host tensors and the launch itself
    refuses them (:func:`host_launch_error`)."""
    return bool(os.environ.get(_ARCH_ENV, "").strip()) and not torch.cuda.is_available()


def check_one_device(where: str, tensors, *, device=None):
    """The first half of :func:`check_devices`: the tensors on one device, CUDA or not (an entry point calls it
    first, checks shapes and dtypes, then calls :func:`check_devices` with the same pairs before planning, so a
    wrong shape or dtype is reported as such whatever the device).  Arguments as :func:`check_devices`.

    Returns:
      ``(named, device)``: the tensor entries ``[(name, tensor)]`` and their one device (None: no tensor).

    Raises:
      ValueError: two of them on different devices, naming both and their devices.
    """
    named = [(n, t) for n, t in tensors if isinstance(t, torch.Tensor)]
    if not named:
        return named, None
    ref_name, ref = (None, torch.device(device)) if device is not None else (named[0][0], named[0][1].device)
    for n, t in named:
        if t.device != ref:
            other = f"{ref_name} is on {ref}" if ref_name is not None else f"the others are on {ref}"
            raise ValueError(f"{where}: {n} is on {t.device} but {other}: every tensor must be on one CUDA device")
    return named, ref


def check_devices(where: str, tensors, *, device=None) -> None:
    """The tensors a kernel reads or writes, on one CUDA device, checked before any planning or compiling.

    Args:
      where: the entry point's name, for the messages.
      tensors: ``(name, tensor or None)`` pairs in the entry point's own argument names; None entries are
        skipped (absent optional arguments), as are non-tensors (their own checks name them).
      device: the device they must all be on (a wrapper's workspace device); None: the first tensor's.

    Raises:
      ValueError: two of them on different devices (naming both and their devices), or a device that is not
        CUDA (naming every argument; host tensors pass only where :func:`host_tensors_reach_launch`).
    """
    named, ref = check_one_device(where, tensors, device=device)
    if ref is not None and ref.type != "cuda" and not host_tensors_reach_launch():
        rule = "must be a CUDA tensor" if len(named) == 1 else "must be CUDA tensors"
        raise ValueError(f"{where}: {', '.join(n for n, _ in named)} {rule}, got {ref}")


def host_launch_error(where: str, device) -> ValueError:
    """The error of a launch reached with host tensors (only when cross-compiling without a GPU, see
    :func:`host_tensors_reach_launch`): the same rule as :func:`check_devices`."""
    return ValueError(f"{where}: the inputs must be CUDA tensors to launch, got {device} (host tensors pass the "
                      f"checks only to build plans when cross-compiling without a GPU, {_ARCH_ENV} set)")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}")
    es = t.element_size()
    if t.data_ptr() % 16 or any((s * es) % 16 for s in t.stride()[:-1] if t.dim() > 1):
        raise ValueError(f"{name} must be 16-byte aligned in its base pointer and every non-last stride")


def split_paged_kv_cache(paged_kv_cache, kv_layout: str):
    """(k, v) as 4-D ``[pages, page_size, H, D]`` views for NHD, from FlashInfer's accepted forms.

    Accepts a tuple ``(k_cache, v_cache)`` of 4-D tensors, or one 5-D tensor
    ``[pages, 2, ...]``; NHD ``[pages, page_size, H, D]`` or HND ``[pages, H, page_size, D]``.
    With page_size 1 a 3-D tuple / 4-D combined cache is accepted (the page dim is
    added).  HND inputs are returned as permuted NHD-ordered views (no copy).
    """
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError("paged_kv_cache tuple must be (k_cache, v_cache)")
        k, v = paged_kv_cache
        check_tensor("k_cache", k)
        check_tensor("v_cache", v)
        if k.dim() == 3 and v.dim() == 3:  # page_size 1: [pages, H, D] in either layout
            return k.unsqueeze(1), v.unsqueeze(1)
    else:
        check_tensor("paged_kv_cache", paged_kv_cache)
        c = paged_kv_cache
        if c.dim() == 4 and c.shape[1] == 2:  # page_size 1: [pages, 2, H, D] in either layout
            return c[:, 0].unsqueeze(1), c[:, 1].unsqueeze(1)
        if c.dim() != 5 or c.shape[1] != 2:
            raise ValueError(
                f"paged_kv_cache must be a (k, v) tuple or a 5-D tensor [pages, 2, ...], got shape {tuple(c.shape)}"
            )
        k, v = c.unbind(1)
    if k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"k/v caches must be 4-D, got {tuple(k.shape)} and {tuple(v.shape)}")
    if kv_layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v


def paged_kv_views(paged_kv_cache, kv_layout: str, *, page_size: int, num_kv_heads: int, head_dims, dtype, device):
    """(k, v) NHD-ordered 4-D views of a paged cache in any FlashInfer form, checked against a plan.

    ``head_dims`` is ``(head_dim_qk, head_dim_vo)``.  A ``(k_cache, v_cache)`` tuple in NHD
    needs no view (the lowest host cost).  Raises ``ValueError`` naming ``k_cache``/``v_cache``.
    """
    c = paged_kv_cache
    if (type(c) is tuple and len(c) == 2 and kv_layout == "NHD" and isinstance(c[0], torch.Tensor)
            and isinstance(c[1], torch.Tensor) and c[0].dim() == 4 and c[1].dim() == 4):
        k, v = c
    else:
        k, v = split_paged_kv_cache(c, kv_layout)
    for n, t, d in (("k_cache", k, head_dims[0]), ("v_cache", v, head_dims[1])):
        if t.dtype != dtype:
            raise ValueError(f"The dtype of {n} ({t.dtype}) does not match the kv_data_type specified in plan ({dtype})")
        if t.shape[1:] != (page_size, num_kv_heads, d):
            raise ValueError(f"{n} has shape {tuple(t.shape)} (as NHD), expected [pages, {page_size}, "
                             f"{num_kv_heads}, {d}] for kv_layout={kv_layout}")
        if t.device != device:
            raise ValueError(f"the kv cache is on {t.device}, expected {device}")
    return k, v


def return_lse_method(lse_shape: str):
    """A wrapper's ``run_return_lse`` (FlashInfer's name): ``run(..., return_lse=True)`` with a docstring of its
    own (a ``functools.partialmethod`` shows none in ``help()``); ``lse_shape`` names the LSE's shape."""

    def run_return_lse(self, *args, **kwargs):
        return self.run(*args, return_lse=True, **kwargs)

    run_return_lse.__doc__ = (
        "``run(*args, return_lse=True, **kwargs)``, as FlashInfer's ``run_return_lse``: returns ``(out, lse)``, "
        f"``lse`` float32 ``{lse_shape}``, base 2 as in FlashInfer (where :meth:`run` takes ``lse_base``, as it "
        "says).\n\n"
        "Arguments, shapes, dtypes and the errors raised: see :meth:`run` (passing ``return_lse`` here is a "
        "``TypeError``).")
    return run_return_lse
