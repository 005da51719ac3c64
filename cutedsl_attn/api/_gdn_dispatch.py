"""Kernel choice for the gated delta rule ops (to be merged into ``cutedsl_attn.dispatch``).

Today one kernel serves every GDN problem on every arch: the token-serial recurrent kernel
(:mod:`cutedsl_attn.portable.gdn_recurrent`), the right algorithm for the decode step and the stand-in for
prefill until the chunked kernels exist.
"""

from __future__ import annotations

import functools

import torch

from ..compile import get_compiled
from ..planning.gdn import GdnArgs, GdnProblem
from ..portable import gdn_recurrent as _rec


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


def gdn_launch(problem: GdnProblem, args: GdnArgs, *, device_index: int | None = None) -> None:
    """Compile (cached in memory and on disk) the chosen kernel and launch it on the current stream."""
    module, cfg = gdn_choice(problem, device_index=device_index)
    fn = get_compiled(module.NAME, cfg, module.compile)
    module.launch(fn, cfg, args)
