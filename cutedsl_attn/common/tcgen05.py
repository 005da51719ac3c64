"""Helpers of the tcgen05 (SM100 / SM103) kernels: pipeline states derived from a use count, the tcgen05
thread-sync fences (device code), and the tensor-memory column plan checks their configs run on the host.

A TMEM plan is ``name -> (first column, columns)``: the accumulator regions a kernel carves out of the SM's
tensor memory (128 lanes x :data:`TMEM_COLS` 32-bit columns).
"""

from __future__ import annotations

import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32

TMEM_COLS = 512  # columns of the SM's tensor memory (128 lanes x 32 bits each)


def state_at(stages: int, count, producer: bool):
    """The pipeline state of the ``count``-th use of a ``stages``-deep pipeline (derived, not carried: a state
    advanced inside a dynamic branch would escape it); ``producer`` starts on the opposite phase."""
    count = Int32(count)
    phase = (count // stages) & 1
    return pipeline.PipelineState(stages, count, count % stages, phase ^ 1 if producer else phase)


def fence_after_sync():
    """``tcgen05.fence::after_thread_sync``: this thread's later tcgen05 operations are ordered after the barrier
    wait just passed (and so after the tcgen05 operations other threads fenced before arriving)."""
    cute.arch.inline_ptx("tcgen05.fence::after_thread_sync;")


def fence_before_sync():
    """``tcgen05.fence::before_thread_sync``: this thread's earlier tcgen05 operations are ordered before the
    barrier arrive that follows."""
    cute.arch.inline_ptx("tcgen05.fence::before_thread_sync;")


def tmem_alloc_cols(plan: dict[str, tuple[int, int]]) -> int:
    """Columns to allocate for ``plan``: the end of its last region rounded up to a power of two >= 32 (what
    ``tcgen05.alloc`` accepts)."""
    end = max(a + n for a, n in plan.values())
    cols = 32
    while cols < end:
        cols *= 2
    return cols


def tmem_plan_reason(plan: dict[str, tuple[int, int]], aliases: dict[str, str] | None = None) -> str | None:
    """Why ``plan`` is not a valid TMEM plan, or None: a region empty or not starting on a multiple of 32
    columns, two regions overlapping (an ``aliases`` entry, ``alias -> host``, must instead lie inside its
    host), or more than :data:`TMEM_COLS` columns."""
    aliases = aliases or {}
    for k, (a, n) in plan.items():
        if a % 32 or a < 0 or n <= 0:
            return f"TMEM region {k} = [{a}, {a + n}) must be non-empty and start on a multiple of 32 columns"
    for k, host in aliases.items():
        if k not in plan or host not in plan:
            return f"TMEM alias {k} -> {host} names a region missing from the plan"
        (a, n), (ha, hn) = plan[k], plan[host]
        if a < ha or a + n > ha + hn:
            return f"TMEM region {k} = [{a}, {a + n}) must lie inside {host} = [{ha}, {ha + hn})"
    spans = sorted((a, a + n, k) for k, (a, n) in plan.items() if k not in aliases)
    for (a0, e0, k0), (a1, e1, k1) in zip(spans, spans[1:]):
        if a1 < e0:
            return f"TMEM regions {k0} = [{a0}, {e0}) and {k1} = [{a1}, {e1}) overlap"
    for k, (a, n) in plan.items():
        for j, (b, m) in plan.items():
            if k in aliases and j != aliases[k] and j != k and a < b + m and b < a + n:
                return f"TMEM region {k} = [{a}, {a + n}) overlaps {j} = [{b}, {b + m})"
    end = max(a + n for a, n in plan.values())
    if end > TMEM_COLS:
        return f"the TMEM plan needs {end} columns (> {TMEM_COLS})"
    return None
