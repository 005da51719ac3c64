"""Split-KV merge in the same launch: the election of the CTA that merges a row's partials (device code)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64

from . import ptx


@cute.jit
def last_to_arrive(mCnt, row, cols, col, n_splits, sFlag, tidx):
    """``(is_last, cnt_addr)``: whether this CTA is the last of the ``n_splits`` writing partials of one row group
    (the one that merges), and the byte address of that group's counter, element ``(row, col)`` of the row-major
    ``[*, cols]`` int32 table ``mCnt``.  The CTA's partial stores are fenced first; thread 0 adds 1 to the counter
    and publishes the verdict in the shared float at ``sFlag``; every thread reads it back.  The merging CTA
    resets the counter to 0 after the merge (``cnt_addr``), which keeps the kernel CUDA-graph replayable."""
    ptx.fence_gpu()
    cute.arch.sync_threads()
    cnt_addr = mCnt.iterator.toint() + (Int64(row) * cols + col) * 4
    if tidx == 0:
        old = ptx.atomic_add_global_u32(cnt_addr, 1)
        ptx.st_shared_f32(sFlag, Float32(cutlass.select_(old == n_splits - 1, Float32(1.0), Float32(0.0))))
    cute.arch.sync_threads()
    return ptx.ld_shared_f32(sFlag) > Float32(0.5), cnt_addr
