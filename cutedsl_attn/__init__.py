"""cutedsl_attn: attention kernels for PyTorch written in CUTLASS's Python CuTe DSL.

FlashInfer-shaped public API (switch ``import flashinfer`` for ``import cutedsl_attn``
for the functions listed in ``__all__``).  Kernels are compiled at run time for the
current GPU (or ``CUTEDSL_ATTN_ARCH`` when cross-compiling) and cached in memory and
on disk.  What was run where: the decode and prefill kernels (portable CuTe DSL) and the
SM90 prefill kernel (TMA + wgmma) are run and verified on an NVIDIA H200 (SM90); SM100/SM103
builds are cross-compiled and PTX-checked only.

Every kernel launch is a torch custom op (``cutedsl_attn::prefill_sm90``, ``cutedsl_attn::prefill_portable``,
``cutedsl_attn::paged_decode``; the ``single_*`` functions are ``cutedsl_attn::single_prefill`` /
``cutedsl_attn::single_decode``): ``torch.compile(fullgraph=True)`` traces through a wrapper's ``run()`` and the
``single_*`` functions, and the profiler shows the kernel by that name.
"""

__version__ = "0.1.0"

from .api.cascade import merge_state, merge_state_in_place, merge_states
from .api.cudnn import cudnn_batch_prefill_with_kv_cache
from .api.decode import (
    BatchDecodeWithPagedKVCacheWrapper,
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
    single_decode_with_kv_cache,
)
from .api.prefill import (
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    single_prefill_with_kv_cache,
    single_prefill_with_kv_cache_return_lse,
)
from .api.quantization import packbits, segment_packbits

__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper",
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
    "single_decode_with_kv_cache",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
    "cudnn_batch_prefill_with_kv_cache",
    "packbits",
    "segment_packbits",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
]
