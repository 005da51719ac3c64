"""Host side shared by the chunked delta-rule kernel modules.

The two chunked GDN modules (:mod:`cutedsl_attn.portable.gdn_chunked`, :mod:`cutedsl_attn.sm90.gdn_chunked`) share
one compiled-function signature (:func:`compile_kernel`), the chunk plan and scratch, and the launches of the whole
op, of the prep alone and of a main-only run on a prep's scratch (:func:`launch`, :func:`prep_tensors`,
:func:`launch_prep`, :func:`launch_main`, re-exported by each as its own).  The two per-channel (KDA / GDN-2)
modules (:mod:`cutedsl_attn.portable.kda_chunked`, :mod:`cutedsl_attn.sm90.kda_chunked`) share theirs
(:func:`compile_kda_kernel`, :func:`kda_launch_tensors`, :func:`kda_launch`).  A kernel object with ``takes_plan``
(the SM90 main kernel on a persistent grid, ``Tiles.persistent``) takes two more arguments after the scratch: the
work order (:func:`~cutedsl_attn.planning.gdn.plan_sequences`, built at launch from the chunk offsets) and the
grid size (:func:`work_plan`).
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..compile.arch import compile_options
from ..compile.fake import gdn_chunked_tensors, kda_chunked_tensors
from .dtypes import element_type
from ..planning.gdn import (
    CHUNK, GdnArgs, GdnProblem, chunked_launch_tensors, kda_chunked_launch_tensors, plan_sequences,
)
from ..planning.gdn_cp import main_run_args


def compile_kernel(kernel, p: GdnProblem, keep_ptx_dir: str | None, keep_cubin: bool):
    """``cute.compile`` of a chunked GDN kernel object for ``p`` from fake tensors in the compiled function's
    order (:func:`cutedsl_attn.compile.fake.gdn_chunked_tensors`; no GPU needed).  Raises ValueError for
    ``keep_cubin`` without a ``keep_ptx_dir``."""
    fake = gdn_chunked_tensors(element_type(p.dtype), _state_type(p), p.head_dim_k, p.head_dim_v, CHUNK)
    if getattr(kernel, "takes_plan", False):
        from cutlass.cute.runtime import make_fake_compact_tensor

        fake = (*fake, make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=4), Int32(1))
    return _compile(kernel, p, fake, keep_ptx_dir, keep_cubin)


def compile_kda_kernel(kernel, p: GdnProblem, keep_ptx_dir: str | None, keep_cubin: bool):
    """:func:`compile_kernel` for a per-channel (KDA / GDN-2) chunked kernel object, its fake tensors
    (:func:`cutedsl_attn.compile.fake.kda_chunked_tensors`) in its compiled function's order."""
    fake = kda_chunked_tensors(element_type(p.dtype), _state_type(p), p.head_dim_k, p.head_dim_v, CHUNK,
                               p.erase_write_gates)
    return _compile(kernel, p, fake, keep_ptx_dir, keep_cubin)


def _state_type(p: GdnProblem):
    return cutlass.BFloat16 if p.state_dtype == "bfloat16" else Float32


def _compile(kernel, p: GdnProblem, fake: tuple, keep_ptx_dir, keep_cubin):
    from cutlass.cute.runtime import make_fake_stream

    opts = compile_options(p.arch, keep_ptx_dir=keep_ptx_dir, keep_cubin=keep_cubin)
    return cute.compile(kernel, *fake, Float32(1.0), Int32(1), Int32(1), Int32(1), Int32(0),
                        make_fake_stream(use_tvm_ffi_env_stream=True), options=opts)


def kda_launch_tensors(args: GdnArgs, cfg) -> tuple:
    """The chunk plan and the prep's scratch of a per-channel launch
    (:func:`cutedsl_attn.planning.gdn.kda_chunked_launch_tensors`); ValueError for g / beta of the wrong shapes."""
    return kda_chunked_launch_tensors(args, cfg.problem)


def kda_launch(fn, cfg, args: GdnArgs) -> None:
    """Plan the chunks and allocate the scratch (:func:`kda_launch_tensors`), then launch ``fn`` (a per-channel
    module's ``compile``) on torch's current stream.  ``args``: KDA / GDN-2 :class:`GdnArgs` (``g``
    ``[T, HO, K]``, ``beta`` ``[T, HO]`` or ``[T, HO, K + V]``)."""
    chunks, chunk_off, qg, kd, w, u, aqk, f = kda_launch_tensors(args, cfg)
    fn(args.q, args.k, args.v, args.g, args.beta, args.cu_seqlens, chunks, chunk_off, args.initial_state,
       args.initial_state_indices, args.output_state, args.output_state_indices, args.output, qg, kd, w, u, aqk,
       f, args.scale, args.q_group, args.k_group, args.v_group, args.flags)


def launch(fn, cfg, args: GdnArgs) -> None:
    """Plan the chunks and allocate the prep kernel's scratch
    (:func:`~cutedsl_attn.planning.gdn.chunked_launch_tensors`: device tensors, no host sync), with
    ``cfg.tiles.persistent`` the work plan too (:func:`work_plan`), then launch ``fn`` (the module's ``compile``)
    on torch's current stream."""
    p = cfg.problem
    scratch = chunked_launch_tensors(args, p.head_dim_k, p.head_dim_v)
    _call(fn, args, scratch, work_plan(cfg, args, scratch[1]))


def _call(fn, args: GdnArgs, scratch: tuple, plan=None) -> None:
    chunks, chunk_off, w, u, aqk, f = scratch
    extra = () if plan is None else plan
    fn(args.q, args.k, args.v, args.g, args.beta, args.cu_seqlens, chunks, chunk_off, args.initial_state,
       args.initial_state_indices, args.output_state, args.output_state_indices, args.output, w, u, aqk, f,
       *extra, args.scale, args.q_group, args.k_group, args.v_group, args.flags)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


def work_plan(cfg, args: GdnArgs, chunk_offsets):
    """The persistent main kernel's ``(order, grid)`` for ``cfg`` (a config whose ``tiles`` may have
    ``persistent``), or None when ``persistent`` is 0 or absent: ``order`` the sequences longest first
    (:func:`~cutedsl_attn.planning.gdn.plan_sequences` on ``chunk_offsets``' device, no host sync) and ``grid``
    = min(work items, the cap): with ``persistent`` 1 the SM count of ``args.q``'s device times
    ``cfg.main_ctas_per_sm``, with ``n >= 2`` n.  Work items = N x HO x (head_dim_v / tile_v), from shapes."""
    persistent = getattr(cfg.tiles, "persistent", 0)
    if not persistent:
        return None
    ctas = persistent
    if persistent == 1:
        import torch

        dev = args.q.device
        ctas = _num_sms(torch.cuda.current_device() if dev.index is None else dev.index) * cfg.main_ctas_per_sm
    items = (chunk_offsets.shape[0] - 1) * args.output.shape[1] * (cfg.problem.head_dim_v // cfg.tiles.tile_v)
    return plan_sequences(chunk_offsets), max(1, min(items, ctas))


def prep_tensors(args: GdnArgs, cfg) -> tuple:
    """The chunk plan and the prep's scratch of ``args``' sequences
    (:func:`~cutedsl_attn.planning.gdn.chunked_launch_tensors`), shared by :func:`launch_prep` and
    :func:`launch_main`."""
    return chunked_launch_tensors(args, cfg.problem.head_dim_k, cfg.problem.head_dim_v)


def launch_prep(fn, cfg, args: GdnArgs, scratch: tuple) -> None:
    """Launch the module's ``compile_prep`` ``fn`` on torch's current stream: the prep of ``args``' chunks (q, k,
    v, the gates, ``args.flags``' gate bits) into ``scratch`` (:func:`prep_tensors`)."""
    _call(fn, args, scratch)


def launch_main(fn, mcfg, args: GdnArgs, scratch: tuple) -> None:
    """Launch the module's ``compile_main`` ``fn`` on torch's current stream over ``scratch`` (a
    :func:`launch_prep` of the same chunks: the same ``cu_seqlens``): ``args`` as :func:`launch`'s for
    ``mcfg.config.problem`` (the transition run: states ``[*, HO, K, K]``); ``args.v`` is never read,
    ``args.output`` written by the outputs run only (:func:`~cutedsl_attn.planning.gdn_cp.main_run_args`)."""
    args, scratch = main_run_args(mcfg.run, args, scratch, mcfg.config.problem.head_dim_v)
    _call(fn, args, scratch, work_plan(mcfg.config, args, scratch[1]))
