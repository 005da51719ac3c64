"""Online softmax on ``mma.m16n8k16`` accumulator fragments, shared by every kernel.

Called while a CuTe DSL kernel is traced (plain Python helpers: their loops unroll at
trace time, and they hold no dynamic control flow).  A warp's S tile is ``n_tiles`` n8 tiles
of the C fragment (``sacc[4*n + e]``: rows ``g`` for ``e`` in {0, 1}, ``g + 8`` for
``e`` in {2, 3}, see :mod:`cutedsl_attn.common.ptx`); each lane keeps the running
max ``row_m[h]`` and a thread-local partial sum ``row_l[h]`` for its two rows
``h = 0`` (row g) and ``h = 1`` (row g + 8).  Logits are already in log2 units (the
softmax scale times log2 e is folded in before), so every exponential is one
``ex2``.  A fully masked row keeps ``m = -inf`` and contributes nothing (the
``-inf - -inf`` case is guarded).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import ptx

from .constants import LOG2E, NEG_INF


def _finite_or_zero(x):
    return Float32(cutlass.select_(x == Float32(NEG_INF), Float32(0.0), x))


def logit_scales(sm_scale, soft_cap, use_soft_cap: bool, use_score_mod: bool = False):
    """``(sc_in, sc_out)`` with which a raw ``q.k`` becomes a log2-unit logit ``sc_out * f(sc_in * q.k)``:
    ``f`` the identity and ``(sm_scale * log2 e, 1)`` without a soft cap, ``f = tanh`` and
    ``(sm_scale / cap, cap * log2 e)`` with one (FlashInfer's ``cap * tanh(s / cap)`` on scaled logits),
    ``f`` the user's ``score_mod`` and ``(sm_scale, log2 e)`` with one (:func:`score_mod_logit`)."""
    if use_score_mod:
        return sm_scale, Float32(LOG2E)
    if use_soft_cap:
        return sm_scale / soft_cap, soft_cap * LOG2E
    return sm_scale * LOG2E, Float32(1.0)


def score_mod_logit(score_mod, raw, sc_in, batch_idx, head_idx, q_idx, kv_idx):
    """The natural-log-unit logit of one score under a user ``score_mod`` (traced into the kernel, as
    FlashAttention-4's ``score_mod``): ``score_mod(sm_scale * q.k, batch_idx, head_idx, q_idx, kv_idx)`` with
    ``sc_in = sm_scale`` from :func:`logit_scales`, whose ``sc_out = log2 e`` the caller applies (or folds into
    the exponent: :func:`online_softmax_step`'s ``logit_scale``).  The callable gets a Float32 score (natural-log
    units, as the oracle's logits) and Int32 indices: the request, the query head, the query's position and the
    key's, on the key axis of the request (query token ``i`` at ``i + kv_len - qo_len``, FlashInfer's bottom-right
    alignment; key ``j`` at ``j``); masks are applied to its result afterwards."""
    return Float32(score_mod(raw * sc_in, batch_idx, head_idx, q_idx, kv_idx))


def online_softmax_step(sacc, n_tiles: int, row_m, row_l, scale, logit_scale=None, max_slack: int = 0):
    """Turn ``sacc`` (logits, -inf where masked) into probabilities in place.

    Without ``logit_scale`` the logits are already in log2 units.  With it (a positive
    Float32, e.g. ``sm_scale * log2(e)``) they are raw ``q.k`` products: the running max is
    kept in log2 units and each probability is one ``fma`` + ``ex2``
    (``2^(s * logit_scale - m)``), saving the separate scaling pass.  ``logit_scale`` must
    be > 0 (the max of the raw values is the max of the scaled ones).

    ``max_slack`` (log2 units, 0: exact): a row keeps its running max while the block's max exceeds it by
    at most this much, so its factor stays exactly 1 (the caller may then skip the rescale of O); the
    probabilities of that row then reach ``2^max_slack`` instead of 1, and its sum and LSE use the same
    max, so O / l and the LSE are unchanged (FlashAttention-4's conditional rescaling uses 8); at most 15, so
    P fits float16.

    Updates ``row_m``/``row_l`` (log2 units) and writes the factor ``scale[h]`` by which the
    output accumulator rows must be multiplied (see :func:`rescale_rows`).
    """
    if not 0 <= max_slack <= 15:  # P <= 2^max_slack must fit the 16-bit P (float16 max 65504)
        raise ValueError(f"max_slack must be in 0..15, got {max_slack}")
    for h in range(2):
        vals = [sacc[4 * n + 2 * h + e] for n in range(n_tiles) for e in range(2)]
        mx = _tree(vals, cute.arch.fmax)  # independent partial maxima: a short dependency chain
        mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1))
        mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=2))
        if logit_scale is not None:
            mx = mx * logit_scale
        m_new = cute.arch.fmax(row_m[h], mx)
        if max_slack:
            # (a first finite max: inf > slack; no finite max yet: NaN, not <= slack -- both take m_new)
            m_new = cutlass.select_(m_new - row_m[h] <= Float32(max_slack), row_m[h], m_new)
        m_use = _finite_or_zero(m_new)
        scale[h] = ptx.ex2(row_m[h] - m_use)
        row_m[h] = m_new
        ps = []
        for n in range(n_tiles):
            for e in range(2):
                if logit_scale is not None:
                    p = ptx.ex2(sacc[4 * n + 2 * h + e] * logit_scale - m_use)
                else:
                    p = ptx.ex2(sacc[4 * n + 2 * h + e] - m_use)
                sacc[4 * n + 2 * h + e] = p
                ps.append(p)
        row_l[h] = row_l[h] * scale[h] + _tree(ps, lambda a, b: a + b)


STALE_MAX_LIMIT = 15  # log2 bound on a thread's partial row sum in stale_max_step: P < 2^15 fits float16


def stale_max_step(sacc, n_tiles: int, row_m, row_l, scale, logit_scale, any_fn, after_tile=None,
                   running_sums: bool = False):
    """The online softmax step of a block known to be unmasked, against the running max as it stands (no
    max of this block): ``2^(s * logit_scale - m)`` in place, then the thread's partial row sums are checked.

    The softmax is exact for any reference ``m`` that O, the sums and the LSE share; the max only keeps P
    from overflowing (and a reference from an earlier block's exact max keeps underflow as in the exact
    step). A thread whose partial sum of a row (an upper bound of each of its probabilities of that row)
    reaches ``2^STALE_MAX_LIMIT`` or is inf -- also a row without a finite max yet (``m = -inf``) -- marks the
    block, and ``any_fn`` (a Boolean -> Boolean OR over every thread that takes part in the redo: a warpgroup-wide
    reduction where the redo issues a warpgroup GEMM, which a warp issuing it alone would hang) combines the
    marks. Returns that uniform Boolean: True means nothing was committed
    (``row_l`` unchanged) and ``sacc`` no longer holds S, so the caller computes S again and runs
    :func:`online_softmax_step`. Otherwise the block's sums are added and ``scale`` is exactly 1 (O keeps
    its scale); ``row_m`` never changes here. Saves the row max (``max`` per score and two shuffles per row)
    ahead of the exponentials; ``logit_scale`` > 0 as in :func:`online_softmax_step`.

    ``after_tile``: called with ``n`` and (with ``running_sums``, else None) the two rows' sums so far once the
    probabilities of n8 tile ``n`` (both rows) are in ``sacc``, the tiles in order -- the caller's hook to convert
    them while the rest are computed."""
    def exp_at(n, h, e):
        p = ptx.ex2(sacc[4 * n + 2 * h + e] * logit_scale - row_m[h])
        sacc[4 * n + 2 * h + e] = p
        return p

    if after_tile is None:  # row by row
        l_blk = [_tree([exp_at(n, h, e) for n in range(n_tiles) for e in range(2)], lambda a, b: a + b)
                 for h in range(2)]
    elif running_sums:  # n8 tile by n8 tile (both rows), each row's sum running along (the hook gets it)
        l_blk = [None, None]
        for n in range(n_tiles):
            for h in range(2):
                pair = exp_at(n, h, 0) + exp_at(n, h, 1)
                l_blk[h] = pair if n == 0 else l_blk[h] + pair
            after_tile(n, l_blk)
    else:  # n8 tile by n8 tile (both rows), the hook after each; the sums at the end
        ps = ([], [])
        for n in range(n_tiles):
            for h in range(2):
                ps[h].extend(exp_at(n, h, e) for e in range(2))
            after_tile(n, None)
        l_blk = [_tree(ps[h], lambda a, b: a + b) for h in range(2)]
    limit = Float32(float(2 ** STALE_MAX_LIMIT))
    ok = (l_blk[0] < limit) & (l_blk[1] < limit)  # (NaN is not ok either)
    redo = any_fn(Int32(cutlass.select_(ok, Int32(0), Int32(1))) != Int32(0))
    for h in range(2):
        row_l[h] = Float32(cutlass.select_(redo, row_l[h], row_l[h] + l_blk[h]))
        scale[h] = Float32(1.0)
    return redo


def _tree(vals, op, lanes: int = 4):
    """Reduce ``vals`` with ``op`` through ``lanes`` independent partial results (instruction-level
    parallelism: a dependency chain of ``len(vals) / lanes`` instead of ``len(vals)``), then pairwise."""
    part = list(vals[:lanes])
    for i in range(lanes, len(vals)):
        part[i % lanes] = op(part[i % lanes], vals[i])
    while len(part) > 1:
        part = [op(part[i], part[i + 1]) if i + 1 < len(part) else part[i] for i in range(0, len(part), 2)]
    return part[0]


def rescale_rows(acc, n_tiles: int, scale):
    """Multiply the accumulator's row g by ``scale[0]`` and row g + 8 by ``scale[1]``."""
    for n in range(n_tiles):
        for e in range(4):
            acc[4 * n + e] = acc[4 * n + e] * scale[e // 2]


def quad_sum_rows(row_l):
    """Reduce the thread-local row sums over the 4 lanes that share a row."""
    for h in range(2):
        x = row_l[h]
        x = x + cute.arch.shuffle_sync_bfly(x, offset=1)
        x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
        row_l[h] = x


def p_as_a_operand(sacc, k_step: int, dtype):
    """The probabilities of n8 tiles ``2*k_step`` and ``2*k_step + 1`` as the A fragment of a k16 MMA."""
    b = 8 * k_step
    return (
        ptx.pack2(sacc[b], sacc[b + 1], dtype),
        ptx.pack2(sacc[b + 2], sacc[b + 3], dtype),
        ptx.pack2(sacc[b + 4], sacc[b + 5], dtype),
        ptx.pack2(sacc[b + 6], sacc[b + 7], dtype),
    )


def finalize_row(m, l, sink_log2):
    """(factor, lse) for a row with running max ``m`` and full sum ``l`` (log2 units).

    ``sink_log2`` is the sink logit in log2 units (``-inf`` for none): it joins the
    denominator with a zero value row.  ``factor`` multiplies the unnormalised output
    (``sum_j 2^(s_j - m) v_j``); ``lse`` is base 2; a row with nothing visible gives
    factor 0 and lse -inf (or the sink).
    """
    m_use = _finite_or_zero(cute.arch.fmax(m, sink_log2))
    w_keys = ptx.ex2(m - m_use)
    tot = l * w_keys + ptx.ex2(sink_log2 - m_use)
    pos = tot > Float32(0.0)
    factor = Float32(cutlass.select_(pos, ptx.rcp(tot), Float32(0.0))) * w_keys
    lse = Float32(cutlass.select_(pos, m_use + ptx.lg2(tot), Float32(NEG_INF)))
    return factor, lse


class SoftmaxState:
    """The online-softmax state of a lane's two rows of an ``m16n8`` C fragment (rows ``g`` and ``g + 8``).

    ``row_max``: the running max (log2 units, ``-inf`` before any visible key); ``row_sum``: the thread-partial
    sum of the probabilities against it (:meth:`quad_sum` reduces it over the row's 4 lanes); ``scale``: the
    factor of the last step, by which the O accumulator rows must be multiplied (:meth:`rescale`). Three
    2-element fp32 register tensors, allocated where the state is made (call inside a kernel).
    """

    def __init__(self):
        self.row_max = cute.make_rmem_tensor((2,), Float32)
        self.row_sum = cute.make_rmem_tensor((2,), Float32)
        self.scale = cute.make_rmem_tensor((2,), Float32)

    # immutable to the DSL's dynamic control flow (which treats a method call as a write): the tensors are
    # defined where the state is made and only their elements change, so nothing needs carrying
    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    def reset_row(self, h: int):
        """Row ``h`` before its first block: max ``-inf``, sum 0."""
        self.row_max[h] = Float32(NEG_INF)
        self.row_sum[h] = Float32(0.0)

    def online_step(self, sacc, n_tiles: int, logit_scale=None, max_slack: int = 0):
        """:func:`online_softmax_step` on this state."""
        online_softmax_step(sacc, n_tiles, self.row_max, self.row_sum, self.scale, logit_scale, max_slack)

    def stale_step(self, sacc, n_tiles: int, logit_scale, any_fn, after_tile=None, running_sums: bool = False):
        """:func:`stale_max_step` on this state; returns its redo flag."""
        return stale_max_step(sacc, n_tiles, self.row_max, self.row_sum, self.scale, logit_scale, any_fn,
                              after_tile, running_sums)

    def rescale(self, acc, n_tiles: int):
        """:func:`rescale_rows` of ``acc`` by the last step's factors."""
        rescale_rows(acc, n_tiles, self.scale)

    def quad_sum(self):
        """:func:`quad_sum_rows`: the full row sums, once the last block is in."""
        quad_sum_rows(self.row_sum)
