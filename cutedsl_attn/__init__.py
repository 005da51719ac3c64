"""cutedsl_attn: attention kernels for PyTorch written in CUTLASS's Python CuTe DSL.

FlashInfer-shaped public API (switch ``import flashinfer`` for ``import cutedsl_attn``
for the functions listed in ``__all__``).  Kernels are compiled at run time for the
current GPU (or ``CUTEDSL_ATTN_ARCH`` when cross-compiling) and cached in memory and
on disk.  What runs where is the README's table: every kernel marked verified there ran on an NVIDIA
H200 (SM90) against the float64 oracle; SM100/SM103 builds are cross-compiled and checked only.

Every kernel launch is a torch custom op ``cutedsl_attn::<kernel NAME>`` (``prefill_sm90``, ``prefill_sm100``,
``prefill_portable``, ``paged_decode``, ``paged_decode_sm100``, ``gdn_chunked``, ``gdn_chunked_sm90``,
``gdn_fused_sm90``, ``kda_chunked``, ``kda_chunked_sm90``, ``gdn_recurrent``, ``mla_decode_portable``,
``mla_decode_sm90``, and the split GDN kernels' context-parallel runs ``gdn_chunked_cp`` /
``gdn_chunked_sm90_cp``; the ``single_*`` functions are ``cutedsl_attn::single_prefill`` /
``cutedsl_attn::single_decode``): ``torch.compile(fullgraph=True)`` traces through a wrapper's ``run()`` and the
``single_*`` functions, and the profiler shows the kernel by that name.
"""

__version__ = "0.1.0"

from .api.cascade import merge_state, merge_state_in_place, merge_states
from .api.cudnn import cudnn_batch_prefill_with_kv_cache
from .api.cudnn_decode import cudnn_batch_decode_with_kv_cache
from .api.cudnn_linear import (
    cudnn_chunk_gated_delta_product,
    cudnn_chunk_gated_delta_rule,
    cudnn_chunk_gated_delta_rule2,
    cudnn_recurrent_kda,
)
from .api.decode import (
    BatchDecodeWithPagedKVCacheWrapper,
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
    single_decode_with_kv_cache,
)
from .api.delta_family import chunk_gated_delta_product, chunk_gated_delta_rule2, recurrent_kda
from .api.mla import BatchMLAPagedAttentionWrapper
from .api.mla_trtllm import trtllm_batch_decode_with_kv_cache_mla, xqa_mla
from .api.gdn import chunk_gated_delta_rule, gated_delta_rule_decode, gated_delta_rule_decode_pretranspose
from .api.prefill import (
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    single_prefill_with_kv_cache,
    single_prefill_with_kv_cache_return_lse,
)
from .api.quantization import packbits, segment_packbits
from .api.trtllm import trtllm_batch_context_with_kv_cache, trtllm_batch_decode_with_kv_cache
from . import attention  # noqa: E402  (flashinfer.attention.prims_ts's path)
from .attention.prims_ts import BatchDecodePagedTSWrapper
from .xqa import xqa  # noqa: E402  (the name then refers to the function, as flashinfer.xqa does)
from . import cudnn as _cudnn_path  # noqa: E402  (flashinfer.cudnn's path, see below)

# flashinfer.cudnn's entry points on cutedsl_attn.cudnn, the graph builders' package: attached from this top layer,
# since the bottom-layer package may import nothing above it
_CUDNN_ENTRY_POINTS = {f.__name__: f for f in (
    cudnn_batch_decode_with_kv_cache, cudnn_batch_prefill_with_kv_cache, cudnn_chunk_gated_delta_rule,
    cudnn_chunk_gated_delta_rule2, cudnn_chunk_gated_delta_product, cudnn_recurrent_kda)}
for _name, _fn in _CUDNN_ENTRY_POINTS.items():
    setattr(_cudnn_path, _name, _fn)
_cudnn_path.__all__ = sorted(_CUDNN_ENTRY_POINTS)
del _name, _fn

__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper",
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
    "single_decode_with_kv_cache",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
    "cudnn_batch_prefill_with_kv_cache",
    "cudnn_batch_decode_with_kv_cache",
    "BatchMLAPagedAttentionWrapper",
    "trtllm_batch_decode_with_kv_cache_mla",
    "xqa_mla",
    "chunk_gated_delta_rule",
    "gated_delta_rule_decode",
    "gated_delta_rule_decode_pretranspose",
    "chunk_gated_delta_rule2",
    "chunk_gated_delta_product",
    "recurrent_kda",
    "cudnn_chunk_gated_delta_rule",
    "cudnn_chunk_gated_delta_rule2",
    "cudnn_chunk_gated_delta_product",
    "cudnn_recurrent_kda",
    "packbits",
    "segment_packbits",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "trtllm_batch_decode_with_kv_cache",
    "trtllm_batch_context_with_kv_cache",
    "xqa",
    "BatchDecodePagedTSWrapper",
]
