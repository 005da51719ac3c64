"""``flashinfer.mla``'s path: the MLA wrapper and the trtllm / xqa MLA functions (:mod:`cutedsl_attn.api.mla`,
:mod:`cutedsl_attn.api.mla_trtllm`)."""

from .api.mla import BatchMLAPagedAttentionWrapper
from .api.mla_trtllm import trtllm_batch_decode_with_kv_cache_mla, xqa_mla

__all__ = ["BatchMLAPagedAttentionWrapper", "trtllm_batch_decode_with_kv_cache_mla", "xqa_mla"]
