"""Kernel choice for the gated delta rule ops (to be merged into ``cutedsl_attn.dispatch``).

Today one kernel module serves every problem of the delta-rule family (GDN, GDN-2, Gated DeltaProduct, KDA) on
every arch: the token-serial recurrent kernel (:mod:`cutedsl_attn.portable.gdn_recurrent`, its variants selected
by :class:`GdnProblem` fields), the right algorithm for the decode step and the stand-in for prefill until the
chunked kernels exist.  Under ``torch.compile`` the launch is the custom op ``cutedsl_attn::gdn_recurrent``
(a fake implementation for tracing); eager calls launch directly.
"""

from __future__ import annotations

import ast
import dataclasses
import functools

import torch

from ..compile import get_compiled
from ..planning.gdn import GdnArgs, GdnProblem
from ..portable import gdn_recurrent as _rec

_FIELDS = tuple(f.name for f in dataclasses.fields(GdnProblem))


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int | None) -> int:
    if not torch.cuda.is_available():
        return 132  # H100 SXM / H200 when cross-compiling
    idx = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_properties(idx).multi_processor_count


def gdn_choice(problem: GdnProblem, *, device_index: int | None = None):
    """``(kernel module, config)`` serving ``problem``.

    Raises NotImplementedError naming what is served when no kernel serves the problem.
    """
    reason = _rec.unsupported_reason(problem)
    if reason is not None:
        raise NotImplementedError(f"gated delta rule: {reason}")
    return _rec, _rec.Config(problem, _rec.default_tiles(problem, num_sms=_num_sms(device_index)))


def _launch(module, cfg, args: GdnArgs) -> None:
    fn = get_compiled(module.NAME, cfg, module.compile)
    module.launch(fn, cfg, args)


# the state pool may be both initial_state and output_state (an in-place update): both are declared mutated
@torch.library.custom_op("cutedsl_attn::gdn_recurrent", mutates_args=("initial_state", "output_state", "output"))
def _gdn_recurrent_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      cu_seqlens: torch.Tensor, initial_state: torch.Tensor, initial_state_indices: torch.Tensor,
                      output_state: torch.Tensor, output_state_indices: torch.Tensor, output: torch.Tensor,
                      scale: float, q_group: int, k_group: int, v_group: int, flags: int, key: str) -> None:
    module, cfg = gdn_choice(_problem_of(key), device_index=q.device.index)
    _launch(module, cfg, GdnArgs(q, k, v, g, beta, cu_seqlens, initial_state, initial_state_indices, output_state,
                             output_state_indices, output, scale, q_group, k_group, v_group, flags))


@_gdn_recurrent_op.register_fake
def _(q, k, v, g, beta, cu_seqlens, initial_state, initial_state_indices, output_state, output_state_indices,
      output, scale, q_group, k_group, v_group, flags, key) -> None:
    return None


def _problem_key(problem: GdnProblem) -> str:
    """The problem as the custom op's string argument (built from constants: traceable without side effects)."""
    return ";".join(f"{name}={getattr(problem, name)!r}" for name in _FIELDS)


def _problem_of(key: str) -> GdnProblem:
    return GdnProblem(**{name: ast.literal_eval(val) for name, val in (kv.split("=", 1) for kv in key.split(";"))})


def gdn_launch(problem: GdnProblem, args: GdnArgs, *, device_index: int | None = None) -> None:
    """Compile (cached in memory and on disk) the chosen kernel and launch it on the current stream."""
    if torch.compiler.is_compiling():
        _gdn_recurrent_op(*args, _problem_key(problem))
        return
    _launch(*gdn_choice(problem, device_index=device_index), args)
