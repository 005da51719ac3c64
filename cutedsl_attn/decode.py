"""``flashinfer.decode``'s path: the decode entry points of this package under the module FlashInfer users import."""

from .api.decode import (
    BatchDecodeWithPagedKVCacheWrapper,
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
    single_decode_with_kv_cache,
)
from .api.trtllm import trtllm_batch_decode_with_kv_cache

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
           "single_decode_with_kv_cache", "trtllm_batch_decode_with_kv_cache"]
