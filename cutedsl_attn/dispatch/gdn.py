"""Kernel choice and launch of the gated delta rule family (part of :mod:`cutedsl_attn.dispatch`, which re-exports
its public names).

GDN prefill (scalar gates, a V-major state) runs a chunked kernel: on ``sm_90a`` the SM90 wgmma main kernel
(:mod:`cutedsl_attn.sm90.gdn_chunked`), elsewhere the portable one (:mod:`cutedsl_attn.portable.gdn_chunked`), and so
does Gated DeltaProduct, as GDN on its expanded timeline (:func:`gdn_launch`); KDA and GDN-2 prefill (per-channel
log gates) run the chunked kernel's per-channel variant (on ``sm_90a`` :mod:`cutedsl_attn.sm90.kda_chunked`, elsewhere
:mod:`cutedsl_attn.portable.kda_chunked`); the decode
step and a K-major state run the token-serial recurrent kernel (its variants chosen by GdnProblem fields).
``CUTEDSL_ATTN_GDN_KERNEL`` = ``auto`` (default) / ``chunked`` (the portable chunked kernel) / ``chunked_sm90`` /
``fused_sm90`` (one SM90 kernel: prep warpgroups feeding the wgmma state loop, opt-in) / ``kda_chunked`` /
``kda_chunked_sm90`` (the SM90 per-channel kernel) /
``recurrent`` forces one for the problems of its family (the chunked GDN kernels: GDN and GDP
prefill; ``kda_chunked``: KDA and GDN-2 prefill; ``recurrent``: all), raising NotImplementedError naming what it
serves when it cannot serve such a problem; other problems keep the automatic choice.
``CUTEDSL_ATTN_GDN_TUNE`` = ``"key=value,..."`` overrides the tiles of the kernels that have the fields named
(:func:`gdn_tuned_tiles`: each item applies to every chosen kernel whose ``TUNING_FIELDS`` have its key).
Gated DeltaProduct on the SM90 chunked kernel (``tma = 0``, not persistent, the SM90 prep) runs without the
expansion's copies: the kernel reads q and g and writes the output on the tokens' timeline while it walks the
expanded one (its ``Config.expand_rows``); ``CUTEDSL_ATTN_GDP_NATIVE=0`` turns that off (the expansion), and other
kernels and tiles, and torch.compile, keep the expansion.  Few
long sequences on few heads may take the context-parallel path (:func:`gdn_cp_segments`, :func:`gdn_launch_cp`): the
chosen kernel run over segments of each sequence (``use_cp=True``; ``"auto"`` takes it where
:func:`cutedsl_attn.planning.gdn_cp` says it pays: long sequences that cannot fill the SMs).
Under torch.compile the launch is the custom op cutedsl_attn::gdn_chunked, cutedsl_attn::gdn_chunked_sm90,
cutedsl_attn::gdn_fused_sm90, cutedsl_attn::kda_chunked, cutedsl_attn::kda_chunked_sm90 or cutedsl_attn::gdn_recurrent (by the kernel chosen), and the
context-parallel path's prep and main-only runs cutedsl_attn::gdn_chunked_cp / cutedsl_attn::gdn_chunked_sm90_cp; eager
calls launch directly.
"""

from __future__ import annotations

import ast
import dataclasses
import os

import torch

from ..compile import get_compiled, target_arch
from ..planning.gdn import (
    FLAG_HAS_BETA, FLAG_HAS_G, FLAG_HAS_INITIAL_STATE, FLAG_INITIAL_INDICES, FLAG_OUTPUT_INDICES, FLAG_WRITE_STATE,
    HEAD_DIMS, GdnArgs, GdnProblem,
)
from ..planning.gdn_cp import CP_RUNS, MainRun, cp_chain, cp_num_segments, cp_segment_offsets
from ..portable import gdn_chunked as _chunked
from ..portable import gdn_recurrent as _rec
from ..portable import kda_chunked as _kda_chunked
from ..sm90 import gdn_chunked as _chunked_sm90
from ..sm90 import gdn_fused as _fused_sm90
from ..sm90 import kda_chunked as _kda_chunked_sm90
from . import _override, _parse_tune, num_sms

GDN_KERNEL_ENV = "CUTEDSL_ATTN_GDN_KERNEL"
GDN_TUNE_ENV = "CUTEDSL_ATTN_GDN_TUNE"
GDP_NATIVE_ENV = "CUTEDSL_ATTN_GDP_NATIVE"

# A new kernel is one entry in _FORCED (its CUTEDSL_ATTN_GDN_KERNEL value; its custom op follows) and, when auto
# may take it, one in _AUTO (before the kernels it should win over for the problems its unsupported_reason admits).
#: the kernel each forced ``CUTEDSL_ATTN_GDN_KERNEL`` value names
_FORCED = {"chunked": _chunked, "chunked_sm90": _chunked_sm90, "fused_sm90": _fused_sm90, "kda_chunked": _kda_chunked,
           "kda_chunked_sm90": _kda_chunked_sm90, "recurrent": _rec}  # fused_sm90: opt-in (slower, see RESULTS)
#: what ``auto`` tries, in order, before the recurrent kernel (the first that serves the problem runs it)
# the SM90 kernels refuse other archs, the kda_* kernels scalar gates and the GDN ones per-channel gates
_AUTO = (_chunked_sm90, _chunked, _kda_chunked_sm90, _kda_chunked)
_GDN_KERNELS = ("auto", *_FORCED)
#: kernels that run Gated DeltaProduct as GDN on the expanded timeline (GdnProblem.num_householder = 1)
_EXPANDS = (_chunked, _chunked_sm90, _fused_sm90)

_GDN_FIELDS = tuple(f.name for f in dataclasses.fields(GdnProblem))


def _served(module, problem: GdnProblem) -> GdnProblem:
    """The problem ``module`` compiles for ``problem``: Gated DeltaProduct becomes GDN for the chunked kernels."""
    if problem.num_householder > 1 and module in _EXPANDS:
        return dataclasses.replace(problem, num_householder=1)
    return problem


def _reason(module, problem: GdnProblem) -> str | None:
    return module.unsupported_reason(_served(module, problem))


def _forced_applies(name: str, problem: GdnProblem) -> bool:
    """Whether a ``CUTEDSL_ATTN_GDN_KERNEL`` value applies to ``problem``: ``recurrent`` to every problem, the
    per-channel kernels (``kda_*``) to prefill with per-channel gates (KDA, GDN-2), the other chunked kernels to
    prefill with scalar gates (GDN, GDP); problems outside a forced kernel's family keep the automatic choice."""
    if name == "recurrent":
        return True
    if problem.decode:
        return False
    return problem.gate_per_channel == name.startswith("kda")


def gdn_choice(problem: GdnProblem, *, device_index: int | None = None, chains: int | None = None):
    """``(kernel module, config)`` serving ``problem``: the first kernel of the auto list that serves it (the
    chunked kernel: GDN prefill, and Gated DeltaProduct as GDN on the expanded timeline, its config then holding
    ``num_householder=1``; on ``sm_90a`` the SM90 chunked kernel), the recurrent kernel otherwise, unless
    ``CUTEDSL_ATTN_GDN_KERNEL`` forces one for the problems of its family (:func:`_forced_applies`; e.g.
    ``chunked`` leaves the decode step and KDA on their automatic kernels).  ``chains``: N * HO of the launch (the default tiles depend on it; None: a
    large launch).

    Raises NotImplementedError naming what is served when no kernel (or not the forced one, for a problem of its
    family: ``chunked_sm90`` off sm_90a, a K-major state forced onto a chunked kernel) serves the problem;
    ValueError for a bad ``CUTEDSL_ATTN_GDN_KERNEL`` / ``CUTEDSL_ATTN_GDN_TUNE`` (:func:`gdn_tuned_tiles`).
    """
    forced = os.environ.get(GDN_KERNEL_ENV, "auto") or "auto"
    if forced not in _GDN_KERNELS:
        raise ValueError(f"{GDN_KERNEL_ENV} must be one of {_GDN_KERNELS}, got {forced!r}")
    if forced != "auto" and _forced_applies(forced, problem):
        module = _FORCED[forced]
    else:
        module = next((m for m in _AUTO if _reason(m, problem) is None), _rec)
    reason = _reason(module, problem)
    if reason is not None:
        where = "" if module is _rec else f" ({GDN_KERNEL_ENV}={forced})"
        raise NotImplementedError(f"gated delta rule{where}: {reason}")
    served = _served(module, problem)
    default = module.default_tiles(served, num_sms=num_sms(device_index), chains=chains)
    tiles = gdn_tuned_tiles(module, default)
    try:
        return module, module.Config(served, tiles)
    except ValueError as e:  # a tuned combination this problem refuses (shared memory, GDN-2's prep layout)
        if tiles == default:
            raise
        raise ValueError(f"{e} (with {GDN_TUNE_ENV}={os.environ.get(GDN_TUNE_ENV)!r}; for this problem the default "
                         f"tiles are {default})") from None


def gdn_tuned_tiles(module, tiles):
    """``tiles`` (of the delta-rule kernel ``module``) with the ``CUTEDSL_ATTN_GDN_TUNE`` items that name its fields.

    The rule: the variable is read for every delta-rule problem of the process, and the kernels' tiles differ,
    so each ``key=value`` item applies to each kernel whose ``TUNING_FIELDS`` have ``key`` and leaves the others
    untouched (``prep_ctas=3`` tunes the per-channel kernels of KDA / GDN-2 and not GDN's; ``persistent=1`` the
    SM90 chunked GDN kernel alone; ``tile_v`` every kernel); a kernel that has none of the keys keeps ``tiles``.
    A key must name a field of at least one delta-rule kernel (one ``CUTEDSL_ATTN_GDN_KERNEL`` can force).

    Raises ValueError naming the variable for an item that is not ``key=value``, a key no delta-rule kernel has
    (the message lists the fields there are), or a value the kernel refuses (e.g. ``tile_v=48``; ``prep_ctas=3``
    on GDN-2, whose erase gates refuse it: raised by :func:`gdn_choice`, which names the variable too).
    """
    tune = os.environ.get(GDN_TUNE_ENV, "")
    if not tune.strip():
        return tiles
    # every kernel's fields, read now: a test may list another kernel in _FORCED
    fields = tuple(dict.fromkeys(f for m in _FORCED.values() for f in m.TUNING_FIELDS))
    items = _parse_tune(GDN_TUNE_ENV, tune, fields)
    own = {key: val for key, val in items.items() if key in module.TUNING_FIELDS}
    return _override(module, GDN_TUNE_ENV, tune, tiles, own) if own else tiles


def _gdn_launch_direct(module, cfg, args: GdnArgs) -> None:
    fn = get_compiled(module.NAME, cfg, module.compile)
    module.launch(fn, cfg, args)


def _gdn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            cu_seqlens: torch.Tensor, initial_state: torch.Tensor, initial_state_indices: torch.Tensor,
            output_state: torch.Tensor, output_state_indices: torch.Tensor, output: torch.Tensor,
            scale: float, q_group: int, k_group: int, v_group: int, flags: int, key: str) -> None:
    module, cfg = gdn_choice(_gdn_problem_of(key), device_index=q.device.index, chains=_chains(cu_seqlens, output))
    _gdn_launch_direct(module, cfg, GdnArgs(q, k, v, g, beta, cu_seqlens, initial_state, initial_state_indices,
                                            output_state, output_state_indices, output, scale, q_group, k_group,
                                            v_group, flags))


def _gdn_fake(q, k, v, g, beta, cu_seqlens, initial_state, initial_state_indices, output_state, output_state_indices,
              output, scale, q_group, k_group, v_group, flags, key) -> None:
    return None


# the state pool may be both initial_state and output_state (an in-place update): both are declared mutated
_MUTATES = ("initial_state", "output_state", "output")
_OPS = {}
for _name in (m.NAME for m in _FORCED.values()):
    _OPS[_name] = torch.library.custom_op(f"cutedsl_attn::{_name}", _gdn_op, mutates_args=_MUTATES)
    _OPS[_name].register_fake(_gdn_fake)


def _gdn_problem_key(problem: GdnProblem) -> str:
    """The problem as the custom op's string argument (built from constants: traceable without side effects)."""
    return ";".join(f"{name}={getattr(problem, name)!r}" for name in _GDN_FIELDS)


def _gdn_problem_of(key: str) -> GdnProblem:
    return GdnProblem(**{name: ast.literal_eval(val) for name, val in (kv.split("=", 1) for kv in key.split(";"))})


def _chains(cu_seqlens, output) -> int:
    return (cu_seqlens.shape[0] - 1) * output.shape[1]


def _run(problem: GdnProblem, args: GdnArgs, device_index) -> None:
    """One launch of the kernel :func:`gdn_choice` picks (``problem`` as that kernel serves it)."""
    chains = _chains(args.cu_seqlens, args.output)
    module, cfg = gdn_choice(problem, device_index=device_index, chains=chains)
    if torch.compiler.is_compiling():
        _OPS[module.NAME](*args, _gdn_problem_key(cfg.problem))
        return
    _gdn_launch_direct(module, cfg, args)


def gdn_launch(problem: GdnProblem, args: GdnArgs, *, device_index: int | None = None) -> None:
    """Compile (cached in memory and on disk) the chosen kernel and launch it on the current stream.

    Gated DeltaProduct (``problem.num_householder`` n > 1) on a chunked kernel runs as GDN on the expanded
    timeline of ``T n`` rows: q at row ``t n + n - 1`` (zeros elsewhere, which the l2 norm keeps zero), the gate
    at row ``t n`` (identity elsewhere), ``cu_seqlens * n``, the output read back from rows ``n - 1 :: n``
    (scratch ``[T n, Hq, K]`` and ``[T n, HO, V]`` in q's dtype, allocated on the current stream).  On the SM90
    chunked kernel at ``tma = 0`` (not persistent, the SM90 prep), unless ``CUTEDSL_ATTN_GDP_NATIVE=0``, the
    kernel maps those rows itself (``Config.expand_rows = n``): no scratch copies, the same output and state bit
    for bit.  Raises ValueError for another value of the switch (for every Gated DeltaProduct launch, whichever
    kernel serves it).
    """
    if problem.num_householder > 1:
        _gdp_switch()  # a bad value is refused on every route, not only where the native path would run
    module, cfg = gdn_choice(problem, device_index=device_index, chains=_chains(args.cu_seqlens, args.output))
    if cfg.problem.num_householder != problem.num_householder:
        _launch_expanded(problem, cfg.problem, args, device_index)
        return
    _run(problem, args, device_index)


def _gdp_switch() -> bool:
    """Whether ``CUTEDSL_ATTN_GDP_NATIVE`` is on (unset and ``""`` mean on: the native rows are the default);
    ValueError for a value other than unset, ``""``, ``"0"``, ``"1"``."""
    switch = os.environ.get(GDP_NATIVE_ENV, "")
    if switch not in ("", "0", "1"):
        raise ValueError(f"{GDP_NATIVE_ENV} must be 0 or 1, got {switch!r}")
    return switch != "0"


def _gdp_native(served: GdnProblem, args: GdnArgs, n: int, device_index):
    """The SM90 chunked kernel's config reading q / g and writing the output on the tokens' timeline
    (``Config.expand_rows = n``), or None for the expansion: ``CUTEDSL_ATTN_GDP_NATIVE=0``, under torch.compile
    (the custom op's key holds the problem, not the config), or a chosen kernel or tiles the native path lacks
    (another kernel, ``tma = 1``, ``persistent``, the shared prep).

    Raises ValueError for a ``CUTEDSL_ATTN_GDP_NATIVE`` other than unset, ``""``, ``"0"``, ``"1"``."""
    if not _gdp_switch() or torch.compiler.is_compiling():
        return None
    module, cfg = gdn_choice(served, device_index=device_index, chains=_chains(args.cu_seqlens, args.output))
    t = cfg.tiles
    if module is not _chunked_sm90 or t.tma or t.persistent or t.prep != 1:
        return None
    return dataclasses.replace(cfg, expand_rows=n)


def _launch_expanded(problem: GdnProblem, served: GdnProblem, args: GdnArgs, device_index) -> None:
    n = problem.num_householder
    native = _gdp_native(served, args, n, device_index)
    if native is not None:  # the same kernels and tiles, q / g / the output on the tokens' rows
        _gdn_launch_direct(_chunked_sm90, native, args._replace(cu_seqlens=args.cu_seqlens * n))
        return
    q, out = args.q, args.output
    T, ho, V = q.shape[0], out.shape[1], out.shape[2]
    q_e = q.new_empty(T, n, q.shape[1], q.shape[2])  # each row written once: zeros, then the token's q
    q_e[:, :n - 1].zero_()
    q_e[:, n - 1] = q  # the readout follows the token's last update
    q_e = q_e.view(T * n, q.shape[1], q.shape[2])
    g_e = args.g
    if args.flags & FLAG_HAS_G:
        identity = 1.0 if problem.gate_domain == "linear" else 0.0
        g_e = torch.empty(T, n, ho, device=q.device, dtype=torch.float32)
        g_e[:, 1:].fill_(identity)
        g_e[:, 0] = args.g  # the decay acts before the token's first update only
        g_e = g_e.view(T * n, ho)
    o_e = torch.empty(T * n, ho, V, device=q.device, dtype=out.dtype)
    _run(served, args._replace(q=q_e, g=g_e, cu_seqlens=args.cu_seqlens * n, output=o_e), device_index)
    out.copy_(o_e[n - 1::n])


# ---------------------------------------------------------------------------- context parallel
def _cp_reason(problem: GdnProblem) -> str | None:
    if problem.decode or problem.state_k_major or problem.gate_per_channel or problem.erase_write_gates or \
            problem.num_householder != 1:
        return "the context-parallel path serves GDN prefill (scalar gates, one update a token, a V-major state)"
    return None


def _cp_shared_run(problem: GdnProblem) -> bool:
    """Whether one run yields both the transition and the offset (width K + V served: K = V = 64)."""
    return problem.head_dim_k + problem.head_dim_v in HEAD_DIMS


def gdn_cp_segments(problem: GdnProblem, args: GdnArgs, use_cp, *, device_index: int | None = None) -> int:
    """Segments a sequence for the context-parallel path of a GDN prefill launch (1: the plain launch), from
    host-known shapes only (N, HO, T, the SM count: no sync).

    ``use_cp`` (FlashInfer's): ``False`` never; ``True`` always (at least 2 segments); ``"auto"``: 1 while
    :data:`cutedsl_attn.planning.gdn_cp.CP_AUTO` is off, else when FlashInfer's SM90 rule holds
    (``N * HO * 2 < num_SMs``) and a one-wave split gives each sequence more segments than the path makes
    main-kernel runs (:data:`~cutedsl_attn.planning.gdn_cp.CP_RUNS`,
    :func:`cutedsl_attn.planning.gdn_cp.cp_num_segments`).

    Raises NotImplementedError for ``use_cp=True`` on a problem the path does not serve (the decode step, the
    rest of the delta-rule family, a K-major state) or a batch too large to split; ValueError for a ``use_cp``
    other than ``"auto"``, True, False.
    """
    if not (use_cp is False or use_cp is True or use_cp == "auto"):
        raise ValueError(f"use_cp must be 'auto', True or False, got {use_cp!r}")
    if use_cp is False:
        return 1
    reason = _cp_reason(problem)
    if reason is not None:
        if use_cp is True:
            raise NotImplementedError(f"use_cp=True: {reason}")
        return 1
    n_seq, ho, T = args.cu_seqlens.shape[0] - 1, args.output.shape[1], args.q.shape[0]
    sms = num_sms(device_index)
    V = problem.head_dim_v
    chosen = []  # the kernel, looked up only once a split is considered

    def ctas_of_chains(chains: int) -> int:
        if not chosen:
            chosen.append(gdn_choice(problem, device_index=device_index, chains=n_seq * ho)[0])
        return chains * -(-V // chosen[0].default_tiles(problem, num_sms=sms, chains=chains).tile_v)

    return cp_num_segments(n_seq, ho, T, num_sms=sms, ctas_of_chains=ctas_of_chains, runs=CP_RUNS,
                           forced=use_cp is True)


def gdn_launch_cp(problem: GdnProblem, args: GdnArgs, segments: int, *, device_index: int | None = None) -> None:
    """GDN prefill, context parallel: each of the N sequences cut into ``segments`` = P runs of whole chunks
    (:func:`~cutedsl_attn.planning.gdn_cp.cp_segment_offsets`, on the device), then

    0. the chunked kernel's prep once over all the segments' chunks (the segments start on chunk boundaries, so
       they are the sequences' chunks): W, U, Aqk and the row factors in one scratch;
    1. its main kernel alone over the N P segments as independent sequences, twice on that scratch: from the
       identity with ``U = 0`` (``v = 0``: the transition ``M`` ``[K, K]``) and from zeros (the offset ``B``
       ``[V, K]``), fp32 final states only (:class:`~cutedsl_attn.planning.gdn_cp.MainRun`);
    2. the chain ``H_in(j) = H_in(j - 1) M(j - 1) + B(j - 1)`` in float64 (small batched matmuls);
    3. the main kernel over the segments from their true starting states (fp32), writing ``args.output``; each
       sequence's final state is the chain's last, written to ``args.output_state`` (its pool rows with
       ``FLAG_OUTPUT_INDICES``) in its dtype when ``FLAG_WRITE_STATE``.

    With a kernel that has no main-only entry (``CUTEDSL_ATTN_GDN_KERNEL=recurrent``), steps 0-1 and 3 are full
    launches of the chosen kernel instead (each with its own prep; the transition and the offset one run of width
    K + V where it is served, K = V = 64).  Under torch.compile the prep and the main-only runs are the custom op
    ``cutedsl_attn::<kernel>_cp`` (the full launches their kernel's op), the chain plain torch.

    ``args`` as :func:`gdn_launch`'s for a GDN prefill problem.  No host sync (CUDA-graph safe); scratch (the
    prep's, the segment states ``[N P, HO, K, K]`` and ``[N P, HO, V, K]`` fp32 and their float64 chain)
    allocated on the current stream.  The kernel's state MMAs take 16-bit copies of ``M`` as they do of the
    state (the identity is exact), so outputs and final states agree with the float64 oracle as the plain
    launch does (about 5e-3 relative in bf16), within 1e-2.

    Raises NotImplementedError for a problem the path does not serve; ValueError for ``segments`` < 1.
    """
    reason = _cp_reason(problem)
    if reason is not None:
        raise NotImplementedError(reason)
    P = segments
    seg_cu = cp_segment_offsets(args.cu_seqlens, P)  # ValueError for a bad count, before any launch
    n_seq, ho = args.cu_seqlens.shape[0] - 1, args.output.shape[1]
    fp32_state = dataclasses.replace(problem, state_dtype="float32")
    chains = n_seq * P * ho
    module, cfg = gdn_choice(fp32_state, device_index=device_index, chains=chains)
    t_module, t_cfg = gdn_choice(dataclasses.replace(fp32_state, head_dim_v=problem.head_dim_k),
                                 device_index=device_index, chains=chains)
    if t_module is not module or module.NAME not in _CP_SPLIT:
        trans, offs = _cp_full_runs_states(problem, args, seg_cu, P, device_index)
        _cp_finish(module, None, cfg, args, seg_cu, P, trans, offs, None, device_index)
        return
    gates = args.flags & (FLAG_HAS_G | FLAG_HAS_BETA)
    both = FLAG_HAS_INITIAL_STATE | FLAG_WRITE_STATE
    dev, f32, K, V, ns = args.q.device, torch.float32, problem.head_dim_k, problem.head_dim_v, n_seq * P
    seg = _cp_seg_args(args, seg_cu, gates)
    # the prep does not depend on the main kernel's tiles: one compiled prep serves every split (the chosen prep)
    prep_tiles = module.default_tiles(cfg.problem, num_sms=num_sms(device_index))
    if hasattr(cfg.tiles, "prep"):
        prep_tiles = dataclasses.replace(prep_tiles, prep=cfg.tiles.prep)
    prep_cfg = module.Config(cfg.problem, prep_tiles)
    scratch = module.prep_tensors(seg, prep_cfg)
    offs = torch.empty(ns, ho, V, K, device=dev, dtype=f32)
    _cp_launch_prep(module, prep_cfg, seg._replace(initial_state=offs, output_state=offs), scratch)  # not read
    trans = torch.zeros(ns, ho, K, K, device=dev, dtype=f32)
    trans.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    _cp_launch_main(module, module.MainConfig(t_cfg, MainRun.TRANSITION),
                    seg._replace(initial_state=trans, output_state=trans, flags=gates | both), scratch)
    _cp_launch_main(module, module.MainConfig(cfg, MainRun.STATE),
                    seg._replace(initial_state=offs, output_state=offs, flags=gates | FLAG_WRITE_STATE), scratch)
    _cp_finish(module, module.MainConfig(cfg, MainRun.OUTPUT), cfg, args, seg_cu, P, trans, offs, scratch,
               device_index)


def _cp_seg_args(args: GdnArgs, seg_cu, flags: int) -> GdnArgs:
    """``args`` over the segments (the states filled in per run: each CTA reads its rows before it writes them)."""
    i32 = torch.empty(1, device=args.q.device, dtype=torch.int32)
    return GdnArgs(args.q, args.k, args.v, args.g, args.beta, seg_cu, i32, i32, i32, i32, args.output, args.scale,
                   args.q_group, args.k_group, args.v_group, flags)


def _cp_launch_prep(module, cfg, args: GdnArgs, scratch: tuple) -> None:
    """The split kernel's prep alone into ``scratch`` (traced: its custom op)."""
    if torch.compiler.is_compiling():
        _CP_OPS[module.NAME](*args[:11], *scratch, *args[11:], _cp_key(module, cfg, "prep"))
        return
    _cp_prep_direct(module, cfg, args, scratch)


def _cp_launch_main(module, mcfg, args: GdnArgs, scratch: tuple) -> None:
    """The split kernel's main kernel alone on ``scratch``, the run ``mcfg.run`` (traced: its custom op)."""
    if torch.compiler.is_compiling():
        _CP_OPS[module.NAME](*args[:11], *scratch, *args[11:], _cp_key(module, mcfg.config, mcfg.run.value))
        return
    _cp_main_direct(module, mcfg, args, scratch)


def _cp_prep_direct(module, cfg, args: GdnArgs, scratch: tuple) -> None:
    fn = get_compiled(module.NAME_PREP, cfg, module.compile_prep)
    module.launch_prep(fn, cfg, args, scratch)


def _cp_main_direct(module, mcfg, args: GdnArgs, scratch: tuple) -> None:
    fn = get_compiled(module.NAME_MAIN, mcfg, module.compile_main)
    module.launch_main(fn, mcfg, args, scratch)


#: the kernels with split entries (the prep alone, the main kernel alone), by name
_CP_SPLIT = {m.NAME: m for m in (_chunked, _chunked_sm90)}


def _cp_key(module, cfg, part: str) -> str:
    """The custom op's string argument: the problem, the tiles and the part (``prep`` or a MainRun value)."""
    tiles = ",".join(f"{f}={getattr(cfg.tiles, f)}" for f in module.TUNING_FIELDS)
    return f"{_gdn_problem_key(cfg.problem)}|{tiles}|{part}"


def _cp_part(module, args: GdnArgs, scratch: tuple, key: str) -> None:
    """The launch a :func:`_cp_key` names (the custom op's eager body)."""
    problem_key, tiles_key, part = key.split("|")
    tiles = module.override_tiles(module.Tiles(), dict(kv.split("=", 1) for kv in tiles_key.split(",")))
    cfg = module.Config(_gdn_problem_of(problem_key), tiles)
    if part == "prep":
        _cp_prep_direct(module, cfg, args, scratch)
    else:
        _cp_main_direct(module, module.MainConfig(cfg, MainRun(part)), args, scratch)


def _cp_op_of(name: str):
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           cu_seqlens: torch.Tensor, initial_state: torch.Tensor, initial_state_indices: torch.Tensor,
           output_state: torch.Tensor, output_state_indices: torch.Tensor, output: torch.Tensor,
           chunks: torch.Tensor, chunk_offsets: torch.Tensor, w: torch.Tensor, u: torch.Tensor, aqk: torch.Tensor,
           f: torch.Tensor, scale: float, q_group: int, k_group: int, v_group: int, flags: int, key: str) -> None:
        _cp_part(_CP_SPLIT[name], GdnArgs(q, k, v, g, beta, cu_seqlens, initial_state, initial_state_indices,
                                          output_state, output_state_indices, output, scale, q_group, k_group,
                                          v_group, flags), (chunks, chunk_offsets, w, u, aqk, f), key)
    return op


def _cp_fake(*args, **kwargs) -> None:
    return None


# one op a split kernel, for the prep (writes the scratch) and the main-only runs (write the states, the output)
_CP_OPS = {}
for _name in _CP_SPLIT:
    _CP_OPS[_name] = torch.library.custom_op(f"cutedsl_attn::{_name}_cp", _cp_op_of(_name),
                                             mutates_args=(*_MUTATES, "w", "u", "aqk", "f"))
    _CP_OPS[_name].register_fake(_cp_fake)


def _cp_full_runs_states(problem: GdnProblem, args: GdnArgs, seg_cu, P: int, device_index):
    """``(M, B)`` of every segment by full launches (each with its prep): one run of width K + V where it is
    served (rows ``[0, K)`` of the state give M, rows ``[K, K + V)`` give B), two runs otherwise."""
    q, v = args.q, args.v
    dev, f32 = q.device, torch.float32
    T, K, V = q.shape[0], problem.head_dim_k, problem.head_dim_v
    ho, ns = args.output.shape[1], (args.cu_seqlens.shape[0] - 1) * P
    fp32_state = dataclasses.replace(problem, state_dtype="float32")
    gates = args.flags & (FLAG_HAS_G | FLAG_HAS_BETA)
    both = FLAG_HAS_INITIAL_STATE | FLAG_WRITE_STATE

    def seg_args(v_run, state, o_run, v_group, flags):  # one state tensor in and out: each CTA owns its rows
        return _cp_seg_args(args, seg_cu, flags)._replace(v=v_run, initial_state=state, output_state=state,
                                                          output=o_run, v_group=v_group)

    if _cp_shared_run(problem):
        w = K + V
        v_run = torch.cat([v.new_zeros(T, v.shape[1], K), v], dim=-1)
        st = torch.zeros(ns, ho, w, K, device=dev, dtype=f32)
        st[:, :, :K].diagonal(dim1=-2, dim2=-1).fill_(1.0)
        o_run = torch.empty(T, ho, w, device=dev, dtype=args.output.dtype)
        _run(dataclasses.replace(fp32_state, head_dim_v=w), seg_args(v_run, st, o_run, args.v_group, gates | both),
             device_index)
        return st[:, :, :K], st[:, :, K:]
    trans = torch.zeros(ns, ho, K, K, device=dev, dtype=f32)
    trans.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    v_zero = v.new_zeros(T, 1, K)  # one zero head, read by every output head (v_group = HO)
    o_m = args.output if K == V else torch.empty(T, ho, K, device=dev, dtype=args.output.dtype)  # rewritten later
    _run(dataclasses.replace(fp32_state, head_dim_v=K), seg_args(v_zero, trans, o_m, ho, gates | both),
         device_index)
    offs = torch.empty(ns, ho, V, K, device=dev, dtype=f32)
    _run(fp32_state, seg_args(v, offs, args.output, args.v_group, gates | FLAG_WRITE_STATE), device_index)
    return trans, offs


def _cp_finish(module, mcfg, cfg, args: GdnArgs, seg_cu, P: int, trans, offs, scratch, device_index) -> None:
    """Steps 2-3 of :func:`gdn_launch_cp`: chain the segments, run the outputs from the true starts (the main
    kernel alone on ``scratch`` with ``mcfg``, else a full launch), write the final states."""
    n_seq, ho, V, K = args.cu_seqlens.shape[0] - 1, args.output.shape[1], cfg.problem.head_dim_v, \
        cfg.problem.head_dim_k
    dev, f32 = args.q.device, torch.float32
    if args.flags & FLAG_HAS_INITIAL_STATE:
        h0 = args.initial_state
        h0 = (h0.index_select(0, args.initial_state_indices.to(torch.int64)) if args.flags & FLAG_INITIAL_INDICES
              else h0[:n_seq])
    else:
        h0 = torch.zeros(n_seq, ho, V, K, device=dev, dtype=f32)
    starts, final = cp_chain(h0, trans.reshape(n_seq, P, ho, K, K), offs.reshape(n_seq, P, ho, V, K))
    s3 = torch.empty(n_seq * P, ho, V, K, device=dev, dtype=f32)
    s3.view(n_seq, P, ho, V, K).copy_(starts)
    seg = _cp_seg_args(args, seg_cu, (args.flags & (FLAG_HAS_G | FLAG_HAS_BETA)) | FLAG_HAS_INITIAL_STATE)
    seg = seg._replace(initial_state=s3, output_state=s3)
    if mcfg is None:
        _run(cfg.problem, seg, device_index)
    else:
        _cp_launch_main(module, mcfg, seg, scratch)
    if args.flags & FLAG_WRITE_STATE:
        ht = args.output_state
        fin = final.to(ht.dtype)
        if args.flags & FLAG_OUTPUT_INDICES:
            ht.index_copy_(0, args.output_state_indices.to(torch.int64), fin)
        else:
            ht[:n_seq].copy_(fin)


def gdn_arch(device=None) -> str:
    """The compile target of a GDN-family problem on ``device`` (``CUTEDSL_ATTN_ARCH`` or the device's)."""
    return target_arch(device)
