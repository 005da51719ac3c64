"""Target-architecture selection for CuTe DSL compiles.

Which GPU architecture a kernel is compiled for is decided here, once, for the
whole package:

* ``CUTEDSL_ATTN_ARCH`` (env) wins. It lets a machine without a GPU
  cross-compile (and fill the disk cache) for a Hopper or Blackwell target.
* Otherwise the compute capability of the current (or given) CUDA device.

The architecture is handed to ``cute.compile`` **per call** through
:func:`compile_options` (``--gpu-arch sm_90a``). Measured on DSL 4.8.1: one
process can compile the same kernel for ``sm_90a`` and then ``sm_100a``, the
option does not leak into later compiles, and in-kernel arch checks
(``BaseDSL.get_arch_enum()``, used by wgmma/tcgen05/TMA atoms) read it. Setting
``CUTE_DSL_ARCH`` in ``os.environ`` after the DSL has initialised has **no**
effect (the DSL reads it once), so this module never touches the environment.

This module imports nothing from the rest of ``cutedsl_attn`` and imports
``torch`` lazily.
"""

from __future__ import annotations

import os
import shlex
from typing import Optional

__all__ = [
    "ARCH_ENV_VAR",
    "SUPPORTED_ARCHS",
    "normalize_arch",
    "target_arch",
    "device_arch",
    "arch_major",
    "is_cross_compiling",
    "compile_options",
    "dsl_cuda_flavor",
]

#: Environment variable that overrides the detected target architecture.
ARCH_ENV_VAR = "CUTEDSL_ATTN_ARCH"

#: Canonical target names, in order of generation.
SUPPORTED_ARCHS = ("sm_90a", "sm_100a", "sm_103a")

# Accepted spellings (lower-cased, stripped) -> canonical target.
_ALIASES = {
    "sm_90a": "sm_90a",
    "hopper": "sm_90a",
    "sm90": "sm_90a",
    "sm_100a": "sm_100a",
    "blackwell": "sm_100a",
    "sm100": "sm_100a",
    "sm_103a": "sm_103a",
    "sm103": "sm_103a",
}

# Compute capability -> canonical target.
_CAPABILITY_TO_ARCH = {
    (9, 0): "sm_90a",
    (10, 0): "sm_100a",
    (10, 3): "sm_103a",
}

_ARCH_MAJOR = {"sm_90a": 90, "sm_100a": 100, "sm_103a": 103}


def _allowed_text() -> str:
    return ", ".join(repr(a) for a in _ALIASES)


def normalize_arch(arch: str) -> str:
    """Return the canonical target name for an architecture spelling.

    Args:
        arch: ``"sm_90a"``, ``"sm_100a"``, ``"sm_103a"`` or one of the keywords
            ``"hopper"``/``"sm90"`` (-> ``sm_90a``), ``"blackwell"``/``"sm100"``
            (-> ``sm_100a``), ``"sm103"`` (-> ``sm_103a``). Case and surrounding
            whitespace are ignored.

    Returns:
        One of :data:`SUPPORTED_ARCHS`.

    Raises:
        ValueError: the spelling is not one of the accepted values (the message
            lists them and names ``CUTEDSL_ATTN_ARCH``).
    """
    if not isinstance(arch, str):
        raise ValueError(
            f"architecture must be a string, got {type(arch).__name__}; "
            f"allowed values (also for {ARCH_ENV_VAR}): {_allowed_text()}"
        )
    canon = _ALIASES.get(arch.strip().lower())
    if canon is None:
        raise ValueError(
            f"unsupported architecture {arch!r} (from {ARCH_ENV_VAR} or an explicit "
            f"arch argument); allowed values: {_allowed_text()}"
        )
    return canon


def _env_arch() -> Optional[str]:
    raw = os.environ.get(ARCH_ENV_VAR)
    if raw is None or raw.strip() == "":
        return None
    return normalize_arch(raw)


def _cuda_available() -> bool:
    try:
        import torch
    except Exception:  # pragma: no cover - torch is a hard dependency
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def device_arch(device=None) -> Optional[str]:
    """Return the architecture string of a CUDA device, or ``None`` without CUDA.

    Unlike :func:`target_arch` this never consults ``CUTEDSL_ATTN_ARCH`` and
    never raises for unsupported GPUs: it reports what the hardware is, as
    ``"sm_<major><minor>"`` with an ``a`` suffix for major >= 9 (the DSL's
    convention), e.g. ``"sm_90a"``, ``"sm_100a"``, ``"sm_80"``.

    Args:
        device: a ``torch.device``, index or string; ``None`` = current device.

    Returns:
        The device architecture string, or ``None`` when no CUDA device is
        available.
    """
    if not _cuda_available():
        return None
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    known = _CAPABILITY_TO_ARCH.get((major, minor))
    if known is not None:
        return known
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def target_arch(device=None) -> str:
    """Return the architecture that kernels should be compiled for.

    Resolution order:

    1. env ``CUTEDSL_ATTN_ARCH`` (see :func:`normalize_arch` for spellings);
    2. the compute capability of ``device`` (or the current CUDA device):
       (9, 0) -> ``sm_90a``, (10, 0) -> ``sm_100a``, (10, 3) -> ``sm_103a``.

    Args:
        device: a ``torch.device``, index or string; ``None`` = current device.
            Ignored when the env var is set.

    Returns:
        One of :data:`SUPPORTED_ARCHS`.

    Raises:
        ValueError: ``CUTEDSL_ATTN_ARCH`` holds an unknown value.
        NotImplementedError: the GPU's compute capability is not supported
            (the message lists the supported ones).
        RuntimeError: no CUDA device and ``CUTEDSL_ATTN_ARCH`` unset (set it to
            cross-compile on a machine without a GPU).
    """
    env = _env_arch()
    if env is not None:
        return env
    if not _cuda_available():
        raise RuntimeError(
            "no CUDA device is available to pick a target architecture; set "
            f"{ARCH_ENV_VAR} (one of {', '.join(SUPPORTED_ARCHS)}, or hopper/blackwell) "
            "to cross-compile without a GPU"
        )
    import torch

    cap = tuple(torch.cuda.get_device_capability(device))
    arch = _CAPABILITY_TO_ARCH.get(cap)
    if arch is None:
        supported = ", ".join(f"{c[0]}.{c[1]} ({a})" for c, a in _CAPABILITY_TO_ARCH.items())
        raise NotImplementedError(
            f"compute capability {cap[0]}.{cap[1]} is not supported by cutedsl_attn; "
            f"supported: {supported}"
        )
    return arch


def arch_major(arch: str) -> int:
    """Return the SM number of an architecture: 90, 100 or 103.

    Args:
        arch: any spelling accepted by :func:`normalize_arch`.

    Returns:
        ``90`` for ``sm_90a``, ``100`` for ``sm_100a``, ``103`` for ``sm_103a``.

    Raises:
        ValueError: unknown architecture.
    """
    return _ARCH_MAJOR[normalize_arch(arch)]


def is_cross_compiling() -> bool:
    """Whether compiled kernels cannot run on this machine's current GPU.

    True when no CUDA device is present, or when ``CUTEDSL_ATTN_ARCH`` is set
    to an architecture different from the current device's. Reads
    ``CUTEDSL_ATTN_ARCH``.

    Returns:
        ``True`` if compiling for a target other than the local device.

    Raises:
        ValueError: ``CUTEDSL_ATTN_ARCH`` holds an unknown value.
    """
    env = _env_arch()
    dev = device_arch()
    if dev is None:
        return True
    return env is not None and env != dev


def compile_options(arch: str, *, tvm_ffi: bool = True, keep_ptx_dir=None,
                    keep_cubin: bool = False) -> str:
    """Build the ``options=`` string for ``cute.compile`` targeting ``arch``.

    Example: ``cute.compile(fn, *fake_args, options=compile_options("sm_90a"))``
    gives ``"--gpu-arch sm_90a --enable-tvm-ffi"``. The target is per call: the
    same process may compile for several architectures.

    Args:
        arch: any spelling accepted by :func:`normalize_arch`.
        tvm_ffi: add ``--enable-tvm-ffi`` (the callable then takes torch
            tensors directly and can be exported/loaded by the disk cache).
        keep_ptx_dir: if given, add ``--keep-ptx --dump-dir <dir>``; the
            directory is created (the DSL silently writes nothing into a missing
            one). The PTX lands in ``<dir>/cutlass_<fn>_<arg types>.<arch>.ptx``.
        keep_cubin: also keep the cubin (``--keep-cubin``) in ``keep_ptx_dir``
            (for ``cuobjdump --dump-sass``); requires ``keep_ptx_dir``.

    Returns:
        The option string.

    Raises:
        ValueError: unknown architecture, or ``keep_cubin`` without a dump dir.
    """
    parts = ["--gpu-arch", normalize_arch(arch)]
    if tvm_ffi:
        parts.append("--enable-tvm-ffi")
    if keep_cubin and keep_ptx_dir is None:
        raise ValueError("keep_cubin=True needs keep_ptx_dir (the dump directory)")
    if keep_ptx_dir is not None:
        d = os.path.abspath(os.fspath(keep_ptx_dir))
        os.makedirs(d, exist_ok=True)
        parts.append("--keep-ptx")
        if keep_cubin:
            parts.append("--keep-cubin")
        parts += ["--dump-dir", shlex.quote(d)]
    return " ".join(parts)


def dsl_cuda_flavor() -> int:
    """CUDA major version of the DSL's compiler libraries in use (``nvidia-cutlass-dsl-libs-cu12`` / ``-cu13``).

    The DSL ships one compiler build per CUDA major (``cutlass/_mlir/_mlir_libs/_cutlass_ir.cu<N>...so``) and
    loads the newest one the driver supports (the newest installed when there is no driver); each bundles its
    own NVVM and ptxas, so the same kernel can schedule differently under another flavor.  Imports
    ``cutlass`` (about a second the first time).

    Returns:
        ``12`` or ``13`` (the ``N`` of the loaded ``_cutlass_ir.cu<N>`` module).

    Raises:
        RuntimeError: the loaded compiler module's name does not carry a flavor.
    """
    import re
    import sys

    import cutlass  # noqa: F401 - loads the compiler module of the chosen flavor

    mod = sys.modules.get("cutlass._mlir._mlir_libs._cutlass_ir")
    m = re.search(r"_cutlass_ir\.cu(\d+)\.", os.path.basename(getattr(mod, "__file__", "") or ""))
    if m is None:
        raise RuntimeError(f"cannot tell the DSL's CUDA flavor from its compiler module {mod!r}")
    return int(m.group(1))
