"""``flashinfer.kda_decode``'s path: ``recurrent_kda`` (the same function as :mod:`cutedsl_attn.kda`'s)."""

from .api.delta_family import recurrent_kda

__all__ = ["recurrent_kda"]
