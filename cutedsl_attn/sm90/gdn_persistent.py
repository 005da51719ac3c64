"""The persistent grid of the SM90 chunked GDN main kernel (``Tiles.persistent`` of
:mod:`cutedsl_attn.sm90.gdn_chunked`): a grid of about one CTA an SM, each CTA walking its share of the work
items (V-slice, output head, sequence) longest first on one chunk ring.

:class:`GdnSm90Persistent` is a mixin of :class:`cutedsl_attn.sm90.gdn_chunked.GdnChunkedSm90Kernel`: the snake
walk over :func:`~cutedsl_attn.planning.gdn.plan_sequences`' order (:meth:`GdnSm90Persistent._walk`,
:meth:`GdnSm90Persistent._walk_item`, as :func:`~cutedsl_attn.planning.gdn.persistent_walk` computes it on the
host) and the ring's pipeline state at an item's start (:meth:`GdnSm90Persistent._ring_state`).  It reads the
kernel's ``S`` / ``NVB`` / ``BV`` attributes.  :class:`GdnSm90PlanCall` is the persistent kernels' entry (the
plan tensor and the grid size as two more arguments), placed before the kernel class in their bases.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr


class GdnSm90Persistent:
    """The persistent main kernel's walk over its work items; see the module docstring."""

    runs_prep = True  # the entry launches the prep before the main kernel (False: the main-only entry)

    def _ring_state(self, done, producer: int):
        """The ring's pipeline state after ``done`` (Int32) chunks: stage ``done % S``, the phase flipped each
        pass (a producer's starts at 1)."""
        passes = done // self.S
        return pipeline.PipelineState(self.S, done, done - passes * self.S, (passes % 2) ^ producer)

    @cute.jit
    def _walk(self, mCu, mO, cta):
        """``(CTA cta's item count, grid, items a sequence)`` of the snake walk
        (:func:`~cutedsl_attn.planning.gdn.persistent_walk`)."""
        grid, _, _ = cute.arch.grid_dim()
        per_seq = mO.shape[1] * self.NVB
        items = (mCu.shape[0] - 1) * per_seq
        full = items // grid
        edge = cutlass.select_(full % 2 == 0, cta, grid - 1 - cta)  # the last, partial round's direction
        return full + cutlass.select_(edge < items - full * grid, 1, 0), grid, per_seq

    @cute.jit
    def _walk_item(self, mPlan, mCu, mChunkOff, walk, r, cta):
        """Item ``r`` of CTA ``cta``'s walk: ``(sequence, head, first V row, bos, eos, first chunk, chunks)``;
        position ``p`` of the order is sequence ``mPlan[p // per_seq]``'s item ``p % per_seq = ho NVB + vb``."""
        _, grid, per_seq = walk
        p = r * grid + cutlass.select_(r % 2 == 0, cta, grid - 1 - cta)
        sp = p // per_seq
        rest = p - sp * per_seq
        n = mPlan[sp]
        ho = rest // self.NVB
        c0 = mChunkOff[n]
        return n, ho, (rest - ho * self.NVB) * self.BV, mCu[n], mCu[n + 1], c0, mChunkOff[n + 1] - c0


class GdnSm90PlanCall:
    """The persistent grid's entry (``Tiles.persistent``): the sequence order ``mPlan``
    (:func:`~cutedsl_attn.planning.gdn.plan_sequences`) and the grid size follow the prep's scratch."""

    takes_plan = True  # common.gdn_launch: two more arguments to compile and to launch

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
                 mCu: cute.Tensor, mChunks: cute.Tensor, mChunkOff: cute.Tensor, mH0: cute.Tensor,
                 mH0Idx: cute.Tensor, mHt: cute.Tensor, mHtIdx: cute.Tensor, mO: cute.Tensor, mW: cute.Tensor,
                 mU: cute.Tensor, mAqk: cute.Tensor, mF: cute.Tensor, mPlan: cute.Tensor, num_ctas: Int32,
                 scale: Float32, q_group: Int32, k_group: Int32, v_group: Int32, flags: Int32, stream):
        if const_expr(self.runs_prep):
            self._launch_prep(mQ, mK, mV, mG, mBeta, mChunks, mO, mW, mU, mAqk, mF, scale, q_group, k_group,
                              v_group, flags, stream)
        self._launch_main(mQ, mK, mCu, mChunkOff, mH0, mH0Idx, mHt, mHtIdx, mO, mW, mU, mAqk, mF, q_group, k_group,
                          flags, stream, mPlan, num_ctas)
