"""The SM90 (Hopper) prefill kernel: TMA + wgmma, warp-specialised, ragged or paged K/V.

The kernel contract (what dispatch uses): :data:`NAME`, :class:`Tiles` (what the kernel chooses) and
:class:`Config` (``Config(problem, tiles)``, the compile key), :func:`unsupported_reason`, :func:`default_tiles`,
:func:`override_tiles` with :data:`TUNING_FIELDS` (the tuning hook), :func:`compile` and :func:`launch`.
Modules: ``config`` (the dataclasses and enums), ``tiles`` (the default table), ``kernel`` (entry),
``producer``, ``mainloop``, ``block_softmax``, ``epilogue``, ``barriers``.
"""

from __future__ import annotations

from ...planning.prefill import PrefillArgs
from .config import TUNING_FIELDS, Config, Tiles, override_tiles, unsupported_reason
from .kernel import Sm90PrefillKernel, build
from .tiles import default_tiles

NAME = "prefill_sm90"

__all__ = ["NAME", "Tiles", "Config", "unsupported_reason", "default_tiles", "override_tiles", "TUNING_FIELDS",
           "compile", "launch"]


def compile(cfg: Config, *, keep_ptx_dir: str | None = None, keep_cubin: bool = False):
    """Compile the kernel for ``cfg`` from fake tensors (no GPU needed); tensor-free, so one build serves every
    batch, length, head count and page count.

    ``keep_ptx_dir``: also write the PTX there (``keep_cubin``: and the cubin; needs ``keep_ptx_dir``).
    Returns the tvm-ffi callable that :func:`launch` calls (it launches on torch's current stream).
    Raises ValueError for ``keep_cubin`` without ``keep_ptx_dir``; the DSL's errors for a failed build.
    """
    return build(Sm90PrefillKernel(cfg), cfg, keep_ptx_dir=keep_ptx_dir, keep_cubin=keep_cubin)


def launch(fn, cfg: Config, args: PrefillArgs) -> None:
    """Run the compiled ``fn`` (:func:`compile` of ``cfg``) on one launch's :class:`PrefillArgs` (the only code that
    knows its argument order).  ``args.output_scale`` multiplies the normalised O in fp32 before its 16-bit rounding.
    The positional-encoding fields of ``args`` are not read (the kernel has none);
    ``args.sm_scale`` must be > 0 where ``cfg.positive_scale_only`` (the caller checks, before the launch)."""
    fn(args.q, args.k, args.v, args.indices, args.work, args.out, args.lse, args.mask, args.sinks, args.sm_scale,
       args.soft_cap, args.window_left, args.output_scale)
