"""The SM100 / SM103 (Blackwell) prefill kernel: TMA + tcgen05.mma with S, P and O in tensor memory.

Cross-compiled for ``sm_100a`` / ``sm_103a`` and checked on the CPU (PTX instruction mix, SASS resources, the TMEM
plan); never run on Blackwell hardware yet, so nothing routes to it without a first-use check on a real device.

The kernel contract (what dispatch uses): :data:`NAME`, :class:`Tiles` and :class:`Config` (``Config(problem,
tiles)``, the compile key), :func:`unsupported_reason`, :func:`default_tiles`, :func:`compile` and :func:`launch`.
Modules: ``config`` (dataclasses, TMEM plan, warp roles, shared memory), ``kernel`` (the device code: load, MMA
and correction warps, the tile loop), ``softmax`` (the softmax warpgroups: logits, masks, online softmax),
``epilogue`` (the final O tile: normalised by the correction warpgroup into shared memory, stored by the epilogue
warp), ``paged`` (paged K/V loads).
"""

from __future__ import annotations

import dataclasses

from ...planning.prefill import PrefillArgs, PrefillProblem
from ...compile.tiles import override_int_fields
from .config import (Config, Tiles, default_tile_n, page_rows, tmem_alloc_cols, tmem_plan, tmem_plan_reason,
                     unsupported_reason)

NAME = "prefill_sm100"

__all__ = ["NAME", "Tiles", "Config", "TUNING_FIELDS", "unsupported_reason", "default_tiles", "override_tiles",
           "compile", "launch", "tmem_plan", "tmem_plan_reason", "tmem_alloc_cols", "page_rows"]

TUNING_FIELDS = tuple(f.name for f in dataclasses.fields(Tiles))  # the keys override_tiles takes


def default_tiles(problem: PrefillProblem, *, num_sms: int) -> Tiles:
    """The tiles for ``problem``; ``num_sms``: the GPU's SM count, the persistent grid's size.

    Not measured (no Blackwell GPU yet): 128-token KV blocks and a rescale threshold of 8 as FlashAttention-4's
    SM100 kernel; three K/V stages at head_dim 64, two at 128 (three leave no room for the O staging buffer)
    and 192/128; head_dim 256: 64-token blocks (the TMEM plan) and two stages of 64 KiB beside Q's 64 KiB; one Q
    tile per CTA (``q_tiles=2``, FA4's two softmax warpgroups with P aliased in S, is built and checked the same
    way but has more to go wrong on a first run).
    The grid, FA4's rule for fixed-length batches: persistent (``num_ctas = num_sms``) without a causal mask or
    a window, where every tile of a request sees all its keys, so tiles dealt round-robin in the work table's
    order (requests longest first) keep the SMs even and each CTA's next tile overlaps its last one's epilogue;
    one CTA per tile (``num_ctas=0``) with causal or a window, whose tiles differ in cost along the diagonal and
    which the hardware's block scheduler balances best in the table's longest-first order (FA4's LPT
    scheduler is not persistent either).  (FA4 keeps ragged batches on one CTA per tile; this kernel's tiles
    are always a ragged work table's, so the rule reads the mask alone.)
    ``problem`` must be one the kernel serves (:func:`unsupported_reason` is None); ValueError for ``num_sms``
    not a positive int.
    """
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 1:
        raise ValueError(f"num_sms must be a positive int, got {num_sms!r}")
    # the rule: tiles of equal cost (no causal, no window) balance under a static round-robin, others do not
    persistent = not (problem.causal or problem.use_window)
    num_ctas = num_sms if persistent else 0
    if default_tile_n(problem) == 64:  # S, P and O of 256 columns fit TMEM with 64-token blocks only (tmem_plan)
        return Tiles(tile_n=64, kv_stages=2, rescale_threshold=8, num_ctas=num_ctas)
    return Tiles(tile_n=128, kv_stages=3 if problem.head_dim_qk <= 64 else 2, rescale_threshold=8,
                 num_ctas=num_ctas)


def override_tiles(tiles: Tiles, items: dict[str, str]) -> Tiles:
    """``tiles`` with the fields named in ``items`` (field name -> decimal text, a tuning hook's parsed items)
    replaced; ValueError naming the key for an unknown field or a non-integer value (``Config`` then checks the
    combination)."""
    return override_int_fields(tiles, items)


def compile(cfg: Config, *, keep_ptx_dir: str | None = None, keep_cubin: bool = False):
    """Compile the kernel for ``cfg`` from fake tensors (no GPU needed); one build serves every batch, length and
    head count.

    ``keep_ptx_dir``: also write the PTX there (``keep_cubin``: and the cubin; needs ``keep_ptx_dir``).
    Returns the tvm-ffi callable that :func:`launch` calls (it launches on torch's current stream).
    Raises ValueError for ``keep_cubin`` without ``keep_ptx_dir``; the DSL's errors for a failed build.
    """
    from .kernel import build

    return build(cfg, keep_ptx_dir=keep_ptx_dir, keep_cubin=keep_cubin)


def launch(fn, cfg: Config, args: PrefillArgs) -> None:
    """Run the compiled ``fn`` (:func:`compile` of ``cfg``) on one launch's :class:`PrefillArgs` (the only code that
    knows its argument order: the SM90 kernel's).  ``args.sm_scale`` must be > 0 unless the problem has a soft
    cap or ``score_mod`` (``Config.positive_scale_only``; the caller checks); ``mask``, ``soft_cap``,
    ``window_left`` and (paged K/V: ``k`` / ``v`` ``[pages, page_size, kv_heads, D]``) ``indices`` are read where
    the problem uses them, the positional-encoding fields never (the kernel refuses those problems)."""
    fn(args.q, args.k, args.v, args.indices, args.work, args.out, args.lse, args.mask, args.sinks, args.sm_scale,
       args.soft_cap, args.window_left, args.output_scale)
