"""The SM90 (Hopper) MLA decode kernel: TMA + wgmma, a producer and two consumer warpgroups splitting O.

The kernel contract (what dispatch uses): :data:`NAME`, :class:`Tiles`, :class:`Config` (``Config(problem,
tiles)``, the compile key), :func:`unsupported_reason`, :func:`default_tiles`, :func:`override_tiles` with
:data:`TUNING_FIELDS`, :func:`compile` and :func:`launch`.  Modules: ``config`` (the dataclasses), ``kernel``
(roles, main loop, epilogue, in-kernel split-KV merge), ``loads`` (the producer's row-gathered blocks of small
pages and fp8 caches, Q widened to f16), ``merge`` (the separate split-KV merge kernel of ``Tiles.merge_kernel``),
``swapab`` (the consumer side of ``Tiles.swap_ab``: up to 32 packed query rows on the wgmma N dimension).

Conventions (FlashInfer's MLA, as the portable kernel): logits ``sm_scale * (q_nope . ckv + q_pe . kpe)``, LSE
base 2, causal bottom-right, empty rows give O = 0 and LSE = -inf, ``output_scale`` applied in fp32 before the
16-bit rounding; page offsets are 64-bit products.  fp8 e4m3 caches (and an fp8 q) are widened exactly to f16 on
load and both GEMMs run in f16 (a bf16 q rounded to f16), as in the portable kernel; scales stay the caller's
(``sm_scale``, ``output_scale``).  The work table is :func:`cutedsl_attn.planning.mla.plan_mla`'s
(16-row tiles); this kernel runs 64-row tiles, ``ceil(16 * num_row_tiles / 64)`` of them per work item.
"""

from __future__ import annotations

from cutlass import Float32, Int32
import cutlass.cute as cute

from ...compile.arch import compile_options
from ...compile.fake import mla_tensors
from ...planning.mla import TILE_M as PLAN_TILE_M
from ...planning.mla import MLA_WORK_COLS, MlaArgs
from .config import (NAME, TILE_M, TUNING_FIELDS, Config, Tiles, default_tiles, override_tiles,
                     unsupported_reason)
from .kernel import MlaSm90Kernel
from .swapab import MlaSm90SwapAbKernel

__all__ = ["NAME", "Tiles", "Config", "unsupported_reason", "default_tiles", "override_tiles", "TUNING_FIELDS",
           "compile", "launch", "num_tiles"]


def num_tiles(num_row_tiles: int) -> int:
    """This kernel's 64-row tiles over the plan's ``num_row_tiles`` 16-row tiles (the grid's x extent)."""
    return max(1, -(-num_row_tiles * PLAN_TILE_M // TILE_M))


def compile(cfg: Config, *, keep_ptx_dir: str | None = None, keep_cubin: bool = False):
    """Compile the kernel for ``cfg`` from fake tensors (no GPU needed); tensor-free, so one build serves every
    batch, head count, length and page count.  ``keep_ptx_dir`` / ``keep_cubin``: keep the PTX / cubin there
    (ValueError for ``keep_cubin`` without a dir).  Returns the tvm-ffi callable :func:`launch` calls."""
    from cutlass.cute.runtime import make_fake_stream

    opts = compile_options(cfg.arch, keep_ptx_dir=keep_ptx_dir, keep_cubin=keep_cubin)
    kernel = MlaSm90SwapAbKernel(cfg) if cfg.tiles.swap_ab else MlaSm90Kernel(cfg)
    return cute.compile(kernel, *mla_tensors(cfg, MLA_WORK_COLS), Float32(1.0), Float32(1.0), Int32(1),
                        make_fake_stream(use_tvm_ffi_env_stream=True), options=opts)


def launch(fn, cfg: Config, args: MlaArgs) -> None:
    """Launch ``fn`` (:func:`compile` of ``cfg``) on torch's current stream over ``num_tiles(args.num_row_tiles)``
    x ``args.work.shape[0]`` CTAs; the only code that knows its argument order.  ``args``: an
    :class:`~cutedsl_attn.planning.mla.MlaArgs` (``part_o`` / ``part_lse`` rows, ``counters`` as the plan sized
    them: this kernel's tiles cover no more rows or counters than the plan's); ``counters`` must read 0.
    Raises ValueError, before the launch, when ``cfg.tiles.swap_ab`` is 1 and the plan's packed rows
    (``num_row_tiles`` 16-row tiles: the longest request's ``q_len x heads``) do not fit ``cfg.tiles.tile_n``."""
    (q_nope, q_pe, ckv, kpe, indices, work, out, lse, part_o, part_lse, counters, sm_scale, num_row_tiles,
     output_scale) = args
    if cfg.tiles.swap_ab and num_row_tiles * PLAN_TILE_M > cfg.tiles.tile_n:
        raise ValueError(f"Tiles.swap_ab=1 holds at most tile_n={cfg.tiles.tile_n} packed query rows (q_len x "
                         f"heads) a request, the plan has {num_row_tiles * PLAN_TILE_M}; use swap_ab=0 or a "
                         f"larger tile_n")
    fn(q_nope, q_pe, ckv, kpe, indices, work, out, lse, part_o, part_lse, counters, sm_scale, output_scale,
       num_tiles(num_row_tiles))
