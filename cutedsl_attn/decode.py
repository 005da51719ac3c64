"""``flashinfer.decode``'s path: the decode entry points of this package under the module FlashInfer users import
(FlashInfer's aliases here included: ``cudnn_batch_decode_with_kv_cache``,
``trtllm_batch_decode_with_kv_cache_mla``)."""

from .api.cudnn_decode import cudnn_batch_decode_with_kv_cache
from .api.decode import (
    BatchDecodeWithPagedKVCacheWrapper,
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
    single_decode_with_kv_cache,
)
from .api.mla_trtllm import trtllm_batch_decode_with_kv_cache_mla
from .api.trtllm import trtllm_batch_decode_with_kv_cache

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
           "single_decode_with_kv_cache", "trtllm_batch_decode_with_kv_cache", "cudnn_batch_decode_with_kv_cache",
           "trtllm_batch_decode_with_kv_cache_mla"]
