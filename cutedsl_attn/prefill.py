"""``flashinfer.prefill``'s path: the prefill entry points of this package under the module FlashInfer users import
(FlashInfer's alias ``cudnn_batch_prefill_with_kv_cache`` included)."""

from .api.cudnn import cudnn_batch_prefill_with_kv_cache
from .api.prefill import (
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    single_prefill_with_kv_cache,
    single_prefill_with_kv_cache_return_lse,
)
from .api.trtllm import trtllm_batch_context_with_kv_cache

__all__ = ["BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper",
           "single_prefill_with_kv_cache", "single_prefill_with_kv_cache_return_lse",
           "trtllm_batch_context_with_kv_cache", "cudnn_batch_prefill_with_kv_cache"]
