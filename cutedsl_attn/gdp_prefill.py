"""``flashinfer.gdp_prefill``'s path: ``chunk_gated_delta_product`` (see :mod:`cutedsl_attn.api.delta_family`)."""

from .api.delta_family import chunk_gated_delta_product

__all__ = ["chunk_gated_delta_product"]
