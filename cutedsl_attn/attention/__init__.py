"""FlashInfer's ``flashinfer.attention`` namespace: ``prims_ts`` (fixed / packed-query paged decode)."""

from . import prims_ts
from .prims_ts import BatchDecodePagedTSWrapper, batch_decode_with_paged_kv_cache

__all__ = ["BatchDecodePagedTSWrapper", "batch_decode_with_paged_kv_cache", "prims_ts"]
