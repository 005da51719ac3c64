"""Named barrier ids of the SM90 prefill CTA (``bar.sync`` / ``bar.arrive`` / ``bar.red`` ids 0..15)."""

from __future__ import annotations

import enum


class Barrier(enum.IntEnum):
    """Each kind is a range of ``num_wg`` consecutive ids, one per consumer warpgroup, from :data:`FIRST_ID` on in
    this order (id 0 is ``__syncthreads``, the pipelines' init sync; 1 is left free)."""

    TURN = 0  # ping-pong: warpgroup wg waits on its id for its turn to issue GEMMs (256 threads: it and the previous)
    EPILOGUE = 1  # the warpgroup's 128 threads are past their last S GEMM: its Q rows may be overwritten by O
    ANY = 2  # bar.red.or over the warpgroup's 128 threads (the stale softmax's redo vote)


FIRST_ID = 2


def barrier_id(kind: Barrier, wg, num_wg: int):
    """The hardware id of barrier ``kind`` of consumer warpgroup ``wg`` (a Python or DSL int) of ``num_wg``."""
    return FIRST_ID + kind * num_wg + wg
