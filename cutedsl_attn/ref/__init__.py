"""Float64 torch reference ("oracle") implementations, FlashInfer conventions.

Bottom of the import graph: imports only torch and its own submodules.
"""

from .attention import (
    LOG2E,
    alibi_slopes,
    apply_rope_llama,
    attention,
    block_tables_to_csr,
    csr_to_block_tables,
    paged_decode,
    paged_kv_to_contiguous,
    paged_prefill,
    ragged_prefill,
)

__all__ = [
    "LOG2E",
    "alibi_slopes",
    "apply_rope_llama",
    "attention",
    "block_tables_to_csr",
    "csr_to_block_tables",
    "paged_decode",
    "paged_kv_to_contiguous",
    "paged_prefill",
    "ragged_prefill",
]

from .gdn import chunk_gated_delta_rule, gdn_head_maps  # noqa: E402

__all__ += ["chunk_gated_delta_rule", "gdn_head_maps"]

from .delta_family import chunk_gated_delta_product, chunk_gated_delta_rule2, kda_gate, recurrent_kda  # noqa: E402

__all__ += ["chunk_gated_delta_product", "chunk_gated_delta_rule2", "kda_gate", "recurrent_kda"]

from .mla import mla_paged_attention  # noqa: E402

__all__ += ["mla_paged_attention"]
