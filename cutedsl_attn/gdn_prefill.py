"""``flashinfer.gdn_prefill``'s path: ``chunk_gated_delta_rule`` (see :mod:`cutedsl_attn.api.gdn`)."""

from .api.gdn import chunk_gated_delta_rule

__all__ = ["chunk_gated_delta_rule"]
