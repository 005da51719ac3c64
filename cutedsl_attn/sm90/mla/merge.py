"""The SM90 MLA kernel's separate split-KV merge (``Tiles.merge_kernel`` = 1): a second kernel of the same launch.

The in-kernel merge (the default) leaves all of a (request, 64-row tile)'s pieces to the last CTA to finish: it
reads ``n_splits x 64 x 512`` fp32 partials alone, which one SM's load bandwidth bounds once a request is split
into many pieces (few requests over long contexts).  This kernel spreads that read over
:data:`MERGE_CTAS_PER_TILE` CTAs per 64-row tile: CTA ``(x, y)`` merges rows ``16 q .. 16 q + 15`` and columns
``32 c .. 32 c + 31`` of tile ``x // MERGE_CTAS_PER_TILE`` for the split requests whose first piece's work item
``wi`` has ``wi % grid_y == y`` (``grid_y`` = the partial slots; below two no request is split and every CTA
exits at once).  One thread per (row, 4 columns);
the weights ``exp2(lse_p - max) / sum`` are recomputed per thread from the partial LSEs (L1-resident).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64

from ...common import ptx
from ...common.constants import NEG_INF
from ...planning.decode import W_BATCH, W_NUM_SPLITS, W_PART_BASE, W_SPLIT_IDX
from ...planning.mla import HEAD_DIM_CKV, W_Q_START, W_QO_LEN
from .config import TILE_M

MERGE_THREADS = 128
MERGE_ROWS = 16  # rows of one merge CTA
MERGE_COLS = 32  # columns of one merge CTA: a thread per (row, 4 columns)
MERGE_CTAS_PER_TILE = (TILE_M // MERGE_ROWS) * (HEAD_DIM_CKV // MERGE_COLS)  # 64


class SplitMerge:
    """Mixin of :class:`~cutedsl_attn.sm90.mla.kernel.MlaSm90Kernel`: the merge kernel (``self.o_dtype`` O's type)."""

    @cute.kernel
    def merge(self, mO, mLSE, mPO, mPLSE, mWork, output_scale: Float32):
        """Device entry: see the module docstring."""
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        _, n_y, _ = cute.arch.grid_dim()
        dt = self.o_dtype
        H = mO.shape[1]
        R = mPO.shape[1]
        tile = bx // MERGE_CTAS_PER_TILE
        quarter = (bx // (HEAD_DIM_CKV // MERGE_COLS)) % (TILE_M // MERGE_ROWS)
        c4 = (bx % (HEAD_DIM_CKV // MERGE_COLS)) * (MERGE_COLS // 4) + tidx % (MERGE_COLS // 4)
        r = tile * TILE_M + quarter * MERGE_ROWS + tidx // (MERGE_COLS // 4)
        plse_base = mPLSE.iterator.toint()
        po_base = mPO.iterator.toint()
        o_base = mO.iterator.toint()
        # (fewer than two partial slots: no request is split; with split requests a CTA visits ceil(W / slots) items)
        for wi in cutlass.range(by, cutlass.select_(n_y >= 2, mWork.shape[0], 0), n_y, unroll=1):
            n_splits = mWork[wi, W_NUM_SPLITS]
            rows = mWork[wi, W_QO_LEN] * H
            if (mWork[wi, W_BATCH] >= 0) & (n_splits > 1) & (mWork[wi, W_SPLIT_IDX] == 0) & (r < rows):
                part0 = mWork[wi, W_PART_BASE]
                big_m = Float32(NEG_INF)
                for p in cutlass.range(n_splits, unroll=4):
                    big_m = cute.arch.fmax(big_m, ptx.ld_global_cg_f32(plse_base + (Int64(part0 + p) * R + r) * 4))
                m_use = Float32(cutlass.select_(big_m == Float32(NEG_INF), Float32(0.0), big_m))
                tot = Float32(0.0)
                for p in cutlass.range(n_splits, unroll=4):
                    tot = tot + ptx.ex2(ptx.ld_global_cg_f32(plse_base + (Int64(part0 + p) * R + r) * 4) - m_use)
                inv = Float32(cutlass.select_(tot > Float32(0.0), ptx.rcp(tot), Float32(0.0))) * output_scale
                o0 = Float32(0.0)
                o1 = Float32(0.0)
                o2 = Float32(0.0)
                o3 = Float32(0.0)
                for p in cutlass.range(n_splits, unroll=8):
                    row = Int64(part0 + p) * R + r
                    wgt = ptx.ex2(ptx.ld_global_cg_f32(plse_base + row * 4) - m_use)
                    x = ptx.ld_global_cg_v4_f32(po_base + (row * HEAD_DIM_CKV + c4 * 4) * 4)
                    o0 = o0 + wgt * x[0]
                    o1 = o1 + wgt * x[1]
                    o2 = o2 + wgt * x[2]
                    o3 = o3 + wgt * x[3]
                tok = mWork[wi, W_Q_START] + r // H
                addr = o_base + (Int64(tok) * mO.stride[0] + Int64(r % H) * mO.stride[1] + c4 * 4) * 2
                ptx.st_global_u32(addr, ptx.pack2(o0 * inv, o1 * inv, dt))
                ptx.st_global_u32(addr + 4, ptx.pack2(o2 * inv, o3 * inv, dt))
                if c4 == 0:
                    mLSE[tok, r % H] = Float32(cutlass.select_(tot > Float32(0.0), m_use + ptx.lg2(tot),
                                                               Float32(NEG_INF)))
