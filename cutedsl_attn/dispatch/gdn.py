"""Kernel choice and launch of the gated delta rule family (part of :mod:`cutedsl_attn.dispatch`, which re-exports
its public names).

One kernel module serves GDN, GDN-2, Gated DeltaProduct and KDA on every arch today: the token-serial recurrent
kernel (its variants chosen by GdnProblem fields), the right algorithm for the decode step and the stand-in for
prefill until the chunked kernels exist.  Under torch.compile the launch is the custom op
cutedsl_attn::gdn_recurrent; eager calls launch directly.
"""

from __future__ import annotations

import ast
import dataclasses

import torch

from ..compile import get_compiled, target_arch
from ..planning.gdn import GdnArgs, GdnProblem
from ..portable import gdn_recurrent as _rec
from . import num_sms

_GDN_FIELDS = tuple(f.name for f in dataclasses.fields(GdnProblem))


def gdn_choice(problem: GdnProblem, *, device_index: int | None = None):
    """``(kernel module, config)`` serving ``problem``.

    Raises NotImplementedError naming what is served when no kernel serves the problem.
    """
    reason = _rec.unsupported_reason(problem)
    if reason is not None:
        raise NotImplementedError(f"gated delta rule: {reason}")
    return _rec, _rec.Config(problem, _rec.default_tiles(problem, num_sms=num_sms(device_index)))


def _gdn_launch_direct(module, cfg, args: GdnArgs) -> None:
    fn = get_compiled(module.NAME, cfg, module.compile)
    module.launch(fn, cfg, args)


# the state pool may be both initial_state and output_state (an in-place update): both are declared mutated
@torch.library.custom_op("cutedsl_attn::gdn_recurrent", mutates_args=("initial_state", "output_state", "output"))
def _gdn_recurrent_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      cu_seqlens: torch.Tensor, initial_state: torch.Tensor, initial_state_indices: torch.Tensor,
                      output_state: torch.Tensor, output_state_indices: torch.Tensor, output: torch.Tensor,
                      scale: float, q_group: int, k_group: int, v_group: int, flags: int, key: str) -> None:
    module, cfg = gdn_choice(_gdn_problem_of(key), device_index=q.device.index)
    _gdn_launch_direct(module, cfg, GdnArgs(q, k, v, g, beta, cu_seqlens, initial_state, initial_state_indices, output_state,
                             output_state_indices, output, scale, q_group, k_group, v_group, flags))


@_gdn_recurrent_op.register_fake
def _(q, k, v, g, beta, cu_seqlens, initial_state, initial_state_indices, output_state, output_state_indices,
      output, scale, q_group, k_group, v_group, flags, key) -> None:
    return None


def _gdn_problem_key(problem: GdnProblem) -> str:
    """The problem as the custom op's string argument (built from constants: traceable without side effects)."""
    return ";".join(f"{name}={getattr(problem, name)!r}" for name in _GDN_FIELDS)


def _gdn_problem_of(key: str) -> GdnProblem:
    return GdnProblem(**{name: ast.literal_eval(val) for name, val in (kv.split("=", 1) for kv in key.split(";"))})


def gdn_launch(problem: GdnProblem, args: GdnArgs, *, device_index: int | None = None) -> None:
    """Compile (cached in memory and on disk) the chosen kernel and launch it on the current stream."""
    if torch.compiler.is_compiling():
        _gdn_recurrent_op(*args, _gdn_problem_key(problem))
        return
    _gdn_launch_direct(*gdn_choice(problem, device_index=device_index), args)


def gdn_arch(device=None) -> str:
    """The compile target of a GDN-family problem on ``device`` (``CUTEDSL_ATTN_ARCH`` or the device's)."""
    return target_arch(device)
