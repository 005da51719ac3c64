"""The SM100 / SM103 (Blackwell) paged GQA decode kernel: swap-AB tcgen05.mma (a group's query heads on the MMA
N dimension), S^T and O^T in tensor memory, a page-table warp staging each KV block's page ids in shared memory
ahead of the ``cp.async`` K / V gathers (16-bit or fp8 e4m3 caches, the latter widened to f16 in shared
memory), split-KV merged in the same launch.

Cross-compiled for ``sm_100a`` / ``sm_103a`` and checked on the CPU (PTX instruction mix and data flow, SASS
resources, the TMEM and mbarrier plans); never run on Blackwell hardware yet, so nothing may route to it
without a first-use check on a real device.

The kernel contract (what dispatch uses): :data:`NAME`, :class:`Tiles` and :class:`Config` (``Config(problem,
tiles)``, the compile key), :func:`unsupported_reason`, :func:`default_tiles`, :func:`override_tiles`,
:data:`TUNING_FIELDS`, :func:`compile` and :func:`launch` (the portable decode kernel's
:class:`~cutedsl_attn.planning.decode.DecodeArgs`, work table, partial buffers and counters).  Modules:
``config`` (dataclasses, TMEM plan, roles, mbarrier plan, refusals), ``kernel`` (the device code).
"""

from __future__ import annotations

import dataclasses

from ...compile.tiles import override_int_fields
from ...planning.decode import DecodeArgs, DecodeProblem
from .config import Config, Roles, Tiles, o_lane, tmem_plan, unsupported_reason

NAME = "paged_decode_sm100"

__all__ = ["NAME", "Tiles", "Config", "Roles", "TUNING_FIELDS", "unsupported_reason", "default_tiles",
           "override_tiles", "compile", "launch", "tmem_plan", "o_lane"]

TUNING_FIELDS = tuple(f.name for f in dataclasses.fields(Tiles))  # the keys override_tiles takes


def default_tiles(problem: DecodeProblem, *, num_sms: int, split: bool = False) -> Tiles:
    """The tiles for ``problem`` (``num_sms`` and ``split`` are unused: the planner fills the GPU by splitting).

    Not measured (no Blackwell GPU yet): three 128-token K / V stages at head_dim 128 (64 KiB each), four at 64,
    the bytes in flight of the portable kernel's split-KV configuration and more; an fp8 cache's stages also
    hold the rows as loaded, so one fewer fits (two at 128, three at 64).
    ``problem`` must be one the kernel serves (:func:`unsupported_reason` is None).
    """
    del num_sms, split
    return Tiles(kv_stages=(3 if problem.head_dim >= 128 else 4) - int(problem.kv_fp8))


def override_tiles(tiles: Tiles, items: dict[str, str]) -> Tiles:
    """``tiles`` with the fields named in ``items`` (field name -> decimal text, a tuning hook's parsed items)
    replaced; ValueError naming the key for an unknown field or a non-integer value (``Config`` then checks the
    combination)."""
    return override_int_fields(tiles, items)


def compile(cfg: Config, *, keep_ptx_dir: str | None = None, keep_cubin: bool = False):
    """Compile the kernel for ``cfg`` from fake tensors (no GPU needed); one build serves every batch, length,
    page count and head count.

    ``keep_ptx_dir``: also write the PTX there (``keep_cubin``: and the cubin; needs ``keep_ptx_dir``).
    Returns the tvm-ffi callable that :func:`launch` calls (it launches on torch's current stream).
    Raises ValueError for ``keep_cubin`` without ``keep_ptx_dir``; the DSL's errors for a failed build.
    """
    from .kernel import build

    return build(cfg, keep_ptx_dir=keep_ptx_dir, keep_cubin=keep_cubin)


def launch(fn, cfg: Config, args: DecodeArgs) -> None:
    """Run the compiled ``fn`` (:func:`compile` of ``cfg``) on one launch's :class:`DecodeArgs` (the only code
    that knows its argument order: the portable decode kernel's).  ``counters`` must read 0 (the kernel leaves
    them so).  ``soft_cap``, the RoPE scalars and ``alibi_slopes`` are passed but not read (the kernel refuses
    those problems)."""
    (q, k, v, indices, work, out, lse, part_o, part_lse, counters, sinks, alibi_slopes, sm_scale, soft_cap,
     rope_rcp_scale, rope_log2_theta, output_scale) = args
    fn(q, k, v, indices, work, out, lse, part_o, part_lse, counters, sinks, alibi_slopes, sm_scale, soft_cap,
       rope_rcp_scale, rope_log2_theta, output_scale)
