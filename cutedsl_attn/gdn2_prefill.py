"""``flashinfer.gdn2_prefill``'s path: ``chunk_gated_delta_rule2`` (see :mod:`cutedsl_attn.api.delta_family`)."""

from .api.delta_family import chunk_gated_delta_rule2

__all__ = ["chunk_gated_delta_rule2"]
