"""Split-KV merge in the same launch (device code): the election of the CTA that merges a row group's partials
(:func:`last_to_arrive`) and the paged decode kernels' merge of a request's partials (:func:`merge_splits`)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64, const_expr

from . import ptx
from .constants import LOG2E, NEG_INF


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


@cute.jit
def merge_splits(mO, mLSE, mPO, mPLSE, mCnt, mSinks, sRow, sFlag, sBuf, b, kvh, num_kv_heads, part0, n_splits,
                 head0, output_scale, tidx, *, head_dim: int, group_size: int, num_threads: int, use_sinks: bool):
    """Split-KV merge of a paged decode kernel: the last of the ``n_splits`` CTAs of (request ``b``, kv head
    ``kvh``) to finish merges every piece's partial and writes O (times ``output_scale``) and the base-2 LSE.

    ``mO`` ``[batch, Hq, head_dim]`` (16-bit, its element type is O's), ``mLSE`` ``[batch, Hq]`` fp32,
    ``mPO`` ``[parts, Hq, head_dim]`` / ``mPLSE`` ``[parts, Hq]`` the fp32 partials (pieces ``part0 ..
    part0 + n_splits - 1``, unnormalised O and base-2 LSE), ``mCnt`` the int32 ``[batch * num_kv_heads]``
    counters (:func:`last_to_arrive`), ``mSinks`` fp32 ``[Hq]`` (read with ``use_sinks``).  Shared memory,
    Int32 shared-window byte addresses: ``sRow`` two fp32 per query head of the group, ``sFlag`` one fp32,
    ``sBuf`` ``n_splits * group_size`` fp32 (a K/V ring the CTA is done with).  The group's heads are
    ``head0 .. head0 + group_size - 1``; every one of the CTA's ``num_threads`` threads calls it (``tidx``)."""
    D, G, NT = head_dim, group_size, num_threads
    hq_total = mO.shape[1]
    is_last, cnt_addr = last_to_arrive(mCnt, b, num_kv_heads, kvh, n_splits, sFlag, tidx)
    if is_last:
        ptx.fence_gpu()
        plse_base = mPLSE.iterator.toint()
        po_base = mPO.iterator.toint()
        n_lse = n_splits * G
        # (1) every partial LSE of the group -> smem, all threads, independent loads
        for e in cutlass.range((n_lse + NT - 1 - tidx) // NT, unroll=4):
            li = tidx + e * NT
            ptx.st_shared_f32(sBuf + li * 4, ptx.ld_global_cg_f32(
                plse_base + (Int64(part0 + li // G) * hq_total + head0 + li % G) * 4))
        cute.arch.sync_threads()
        # (2) per row: max, denominator (with the sink), LSE
        if tidx < G:
            big_m = Float32(NEG_INF)
            for p in cutlass.range(n_splits, unroll=4):
                big_m = cute.arch.fmax(big_m, ptx.ld_shared_f32(sBuf + (p * G + tidx) * 4))
            sink_l2 = Float32(NEG_INF)
            if const_expr(use_sinks):
                sink_l2 = mSinks[head0 + tidx] * LOG2E
            m_all = cute.arch.fmax(big_m, sink_l2)
            m_use = Float32(cutlass.select_(m_all == Float32(NEG_INF), Float32(0.0), m_all))
            tot = ptx.ex2(sink_l2 - m_use)
            for p in cutlass.range(n_splits, unroll=4):
                tot = tot + ptx.ex2(ptx.ld_shared_f32(sBuf + (p * G + tidx) * 4) - m_use)
            inv = Float32(cutlass.select_(tot > Float32(0.0), ptx.rcp(tot), Float32(0.0)))
            ptx.st_shared_f32(sRow + tidx * 8, m_use)
            ptx.st_shared_f32(sRow + tidx * 8 + 4, inv * output_scale)  # the scale joins the merge weights
            mLSE[b, head0 + tidx] = Float32(cutlass.select_(tot > Float32(0.0), m_use + ptx.lg2(tot), Float32(NEG_INF)))
        cute.arch.sync_threads()
        # (3) LSE -> merge weights in place
        for e in cutlass.range((n_lse + NT - 1 - tidx) // NT, unroll=1):
            li = tidx + e * NT
            r = li % G
            ptx.st_shared_f32(sBuf + li * 4, ptx.ex2(ptx.ld_shared_f32(sBuf + li * 4) - ptx.ld_shared_f32(sRow + r * 8))
                              * ptx.ld_shared_f32(sRow + r * 8 + 4))
        cute.arch.sync_threads()
        # (4) O = sum_p w_p O_p, 4 columns per thread, loads unrolled so several are in flight
        for e in cutlass.range((G * (D // 4) + NT - 1 - tidx) // NT, unroll=1):
            vi = tidx + e * NT
            r = vi // (D // 4)
            c4 = vi % (D // 4)
            o0 = Float32(0.0)
            o1 = Float32(0.0)
            o2 = Float32(0.0)
            o3 = Float32(0.0)
            for p in cutlass.range(n_splits, unroll=8):
                wgt = ptx.ld_shared_f32(sBuf + (p * G + r) * 4)
                x = ptx.ld_global_cg_v4_f32(po_base + ((Int64(part0 + p) * hq_total + head0 + r) * D + c4 * 4) * 4)
                o0 = o0 + wgt * x[0]
                o1 = o1 + wgt * x[1]
                o2 = o2 + wgt * x[2]
                o3 = o3 + wgt * x[3]
            mO[b, head0 + r, c4 * 4] = o0.to(mO.element_type)
            mO[b, head0 + r, c4 * 4 + 1] = o1.to(mO.element_type)
            mO[b, head0 + r, c4 * 4 + 2] = o2.to(mO.element_type)
            mO[b, head0 + r, c4 * 4 + 3] = o3.to(mO.element_type)
        if tidx == 0:
            ptx.st_global_u32(cnt_addr, 0)
