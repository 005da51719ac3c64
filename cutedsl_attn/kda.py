"""``flashinfer.kda``'s path: ``recurrent_kda``, prefill and the T = 1 decode step (see
:mod:`cutedsl_attn.api.delta_family`)."""

from .api.delta_family import recurrent_kda

__all__ = ["recurrent_kda"]
