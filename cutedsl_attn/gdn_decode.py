"""``flashinfer.gdn_decode``'s path: the gated delta rule's decode step (see :mod:`cutedsl_attn.api.gdn_decode`)."""

from .api.gdn_decode import gated_delta_rule_decode, gated_delta_rule_decode_pretranspose

__all__ = ["gated_delta_rule_decode", "gated_delta_rule_decode_pretranspose"]
