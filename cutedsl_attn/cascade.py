"""``flashinfer.cascade``'s path: the attention-state merges (see :mod:`cutedsl_attn.api.cascade`)."""

from .api.cascade import merge_state, merge_state_in_place, merge_states

__all__ = ["merge_state", "merge_state_in_place", "merge_states"]
