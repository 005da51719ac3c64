"""Kernel choice and launch of the gated delta rule family (part of :mod:`cutedsl_attn.dispatch`, which re-exports
its public names).

GDN prefill (scalar gates, a V-major state) runs the chunked kernel (:mod:`cutedsl_attn.portable.gdn_chunked`) on
every arch; the decode step, GDN-2, Gated DeltaProduct, KDA and a K-major state run the token-serial recurrent
kernel (its variants chosen by GdnProblem fields).  ``CUTEDSL_ATTN_GDN_KERNEL`` = ``auto`` (default) /
``chunked`` / ``chunked_sm90`` / ``recurrent`` forces one (``chunked`` and ``chunked_sm90`` raise
NotImplementedError naming what they serve when they cannot serve the problem); ``chunked_sm90`` is the opt-in
SM90 wgmma main kernel (:mod:`cutedsl_attn.sm90.gdn_chunked`), never chosen by ``auto``.
``CUTEDSL_ATTN_GDN_TUNE`` = ``"key=value,..."`` overrides the chosen kernel's tiles (its ``TUNING_FIELDS``).
Under torch.compile the launch is the custom op cutedsl_attn::gdn_chunked, cutedsl_attn::gdn_chunked_sm90 or
cutedsl_attn::gdn_recurrent (by the kernel chosen); eager calls launch directly.
"""

from __future__ import annotations

import ast
import dataclasses
import os

import torch

from ..compile import get_compiled, target_arch
from ..planning.gdn import GdnArgs, GdnProblem
from ..portable import gdn_chunked as _chunked
from ..portable import gdn_recurrent as _rec
from ..sm90 import gdn_chunked as _chunked_sm90
from . import _override, _parse_tune, num_sms

GDN_KERNEL_ENV = "CUTEDSL_ATTN_GDN_KERNEL"
GDN_TUNE_ENV = "CUTEDSL_ATTN_GDN_TUNE"
_GDN_KERNELS = ("auto", "chunked", "chunked_sm90", "recurrent")

_GDN_FIELDS = tuple(f.name for f in dataclasses.fields(GdnProblem))


def gdn_choice(problem: GdnProblem, *, device_index: int | None = None, chains: int | None = None):
    """``(kernel module, config)`` serving ``problem``: the chunked kernel where it applies (prefill of GDN), the
    recurrent kernel otherwise, unless ``CUTEDSL_ATTN_GDN_KERNEL`` forces one (``chunked_sm90`` only that way).
    ``chains``: N * HO of the launch (the default tiles depend on it; None: a large launch).

    Raises NotImplementedError naming what is served when no kernel (or not the forced one) serves the problem;
    ValueError for a bad ``CUTEDSL_ATTN_GDN_KERNEL`` / ``CUTEDSL_ATTN_GDN_TUNE``.
    """
    forced = os.environ.get(GDN_KERNEL_ENV, "auto") or "auto"
    if forced not in _GDN_KERNELS:
        raise ValueError(f"{GDN_KERNEL_ENV} must be one of {_GDN_KERNELS}, got {forced!r}")
    module = None
    if forced == "chunked_sm90":
        reason = _chunked_sm90.unsupported_reason(problem)
        if reason is not None:
            raise NotImplementedError(f"gated delta rule ({GDN_KERNEL_ENV}=chunked_sm90): {reason}")
        module = _chunked_sm90
    elif forced != "recurrent":
        reason = _chunked.unsupported_reason(problem)
        if reason is None:
            module = _chunked
        elif forced == "chunked":
            raise NotImplementedError(f"gated delta rule ({GDN_KERNEL_ENV}=chunked): {reason}")
    if module is None:
        reason = _rec.unsupported_reason(problem)
        if reason is not None:
            raise NotImplementedError(f"gated delta rule: {reason}")
        module = _rec
    tiles = module.default_tiles(problem, num_sms=num_sms(device_index), chains=chains)
    tune = os.environ.get(GDN_TUNE_ENV, "")
    if tune.strip():
        tiles = _override(module, GDN_TUNE_ENV, tune, tiles, _parse_tune(GDN_TUNE_ENV, tune, module.TUNING_FIELDS))
    return module, module.Config(problem, tiles)


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
for _name in ("gdn_recurrent", "gdn_chunked", "gdn_chunked_sm90"):
    _OPS[_name] = torch.library.custom_op(f"cutedsl_attn::{_name}", _gdn_op, mutates_args=_MUTATES)
    _OPS[_name].register_fake(_gdn_fake)


def _gdn_problem_key(problem: GdnProblem) -> str:
    """The problem as the custom op's string argument (built from constants: traceable without side effects)."""
    return ";".join(f"{name}={getattr(problem, name)!r}" for name in _GDN_FIELDS)


def _gdn_problem_of(key: str) -> GdnProblem:
    return GdnProblem(**{name: ast.literal_eval(val) for name, val in (kv.split("=", 1) for kv in key.split(";"))})


def _chains(cu_seqlens, output) -> int:
    return (cu_seqlens.shape[0] - 1) * output.shape[1]


def gdn_launch(problem: GdnProblem, args: GdnArgs, *, device_index: int | None = None) -> None:
    """Compile (cached in memory and on disk) the chosen kernel and launch it on the current stream."""
    chains = _chains(args.cu_seqlens, args.output)
    if torch.compiler.is_compiling():
        module, _ = gdn_choice(problem, device_index=device_index, chains=chains)
        _OPS[module.NAME](*args, _gdn_problem_key(problem))
        return
    _gdn_launch_direct(*gdn_choice(problem, device_index=device_index, chains=chains), args)


def gdn_arch(device=None) -> str:
    """The compile target of a GDN-family problem on ``device`` (``CUTEDSL_ATTN_ARCH`` or the device's)."""
    return target_arch(device)
