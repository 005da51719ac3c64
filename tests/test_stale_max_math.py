"""The SM90 prefill kernel's ``stale_max`` softmax (:func:`cutedsl_attn.common.softmax.stale_max_step` with the
exact :func:`~cutedsl_attn.common.softmax.online_softmax_step` as its redo), replayed block by block in float32
with torch for one warp's rows -- 16 rows, four lanes of partial sums each -- against float64 softmax(S) V.

What it pins down: the result does not depend on the stale reference (O, the sums and the LSE share it);
a block redoes exactly when some lane's partial row sum reaches ``2^STALE_MAX_LIMIT`` (inf included, so a
row without a finite max yet always redoes); P stays below 2^15 and fits float16; and keys whose logits
grow block after block (the kernel walks right to left) make blocks redo while flat logits do not."""

import math

import pytest
import torch

from cutedsl_attn.common.softmax import STALE_MAX_LIMIT

LANES = 4  # lanes sharing a row of the mma accumulator, each with its own partial row sum


def lane_sums(p):
    """(rows, LANES) partial sums: lane t of a quad holds columns 8j + 2t and 8j + 2t + 1 of its rows."""
    rows, n = p.shape
    return p.reshape(rows, n // 8, LANES, 2).sum((1, 3))


def replay(s_log2, v, tile_n, threshold=8, p_dtype=torch.float16):
    """Blocks of ``tile_n`` keys from the right; the first takes the exact step, the rest the stale step
    with the exact one as redo. ``s_log2``: (rows, keys) logits in log2 units (float32); returns (O, lse2,
    number of redone blocks, largest P)."""
    rows, n = s_log2.shape
    m = torch.full((rows,), -math.inf)
    l_part = torch.zeros(rows, LANES)
    o = torch.zeros(rows, v.shape[1])
    redos, p_max = 0, 0.0
    starts = list(range(0, n, tile_n))[::-1]
    for i, k0 in enumerate(starts):
        s = s_log2[:, k0:k0 + tile_n]
        vb = v[k0:k0 + tile_n]
        if i > 0:  # stale_max_step
            p = torch.exp2(s - m[:, None])
            part = lane_sums(p)
            if not bool((part < 2.0 ** STALE_MAX_LIMIT).all()):  # the warpgroup's OR (inf, NaN too): redo
                redos += 1
            else:
                l_part += part
                pq = p.to(p_dtype).float()
                p_max = max(p_max, float(p.max()))
                o += pq @ vb
                continue
        # online_softmax_step with max_slack = threshold
        mx = s.max(1).values
        m_new = torch.maximum(m, mx)
        keep = (m_new - m) <= threshold
        m_new = torch.where(keep, m, m_new)
        m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        scale = torch.exp2(m - m_use)
        p = torch.exp2(s - m_use[:, None])
        o = o * scale[:, None] + p.to(p_dtype).float() @ vb
        l_part = l_part * scale[:, None] + lane_sums(p)
        p_max = max(p_max, float(p.max()))
        m = m_new
    l = l_part.sum(1)
    return o / l[:, None], m + torch.log2(l), redos, p_max


def oracle(s_log2, v):
    s = s_log2.double()
    w = torch.softmax(s * math.log(2.0), dim=1)
    return w @ v.double(), torch.logsumexp(s * math.log(2.0), dim=1) / math.log(2.0)


def _inputs(gen, ramp, rows=16, n=1024, d=64):
    q = torch.randn(rows, d, generator=gen)
    k = torch.randn(n, d, generator=gen)
    k *= (1.0 + ramp * (1.0 - torch.arange(n) / n))[:, None]  # larger logits to the left (processed last)
    v = torch.randn(n, d, generator=gen)
    return (q @ k.T) * (0.5 * 1.4426950408889634), v


@pytest.mark.parametrize("ramp", [0.0, 3.0])
def test_stale_max_replay_matches_float64(ramp):
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    s_log2, v = _inputs(gen, ramp)
    o, lse, redos, p_max = replay(s_log2, v, 128)
    o_ref, lse_ref = oracle(s_log2, v)
    err = ((o.double() - o_ref).norm() / o_ref.norm()).item()
    assert err < 2e-3, (seed, err)  # float16 P rounding
    assert torch.allclose(lse.double(), lse_ref, atol=1e-3), seed
    assert p_max < 2.0 ** STALE_MAX_LIMIT <= 65504.0  # P fits float16 (and bfloat16)
    if ramp:
        assert redos >= 1, seed  # the max grows by tens of log2 units over the blocks


def test_stale_max_redo_counts():
    """Flat logits (std ~6 log2 units at sm_scale 0.5) rarely move the max 15 log2 units past the first block's
    (about 1% of draws do, a legitimate redo): fixed draws here, none redoing; keys ramping up 4x to the left
    redo most blocks."""
    counts = [replay(*_inputs(torch.Generator().manual_seed(seed), ramp), 128)[2]
              for ramp in (0.0, 3.0) for seed in range(5)]
    assert counts[:5] == [0] * 5 and min(counts[5:]) >= 3, counts


def test_stale_max_redo_rule():
    """A lane's partial sum reaching 2^15 redoes the block (all rows of the warp); a row with no finite max
    yet (m = -inf) gives inf and always redoes; a block whose logits drop far below the reference commits
    (its P underflows as in the exact step, relative to an exact earlier max)."""
    s = torch.zeros(16, 256)
    s[:, 128:] = 0.0  # first block: max 0
    s[:, :128] = -200.0  # far below: commits, contributes nothing
    o, lse, redos, _ = replay(s, torch.ones(256, 1), 128)
    assert redos == 0 and torch.allclose(lse, torch.full((16,), 7.0))  # log2(128) from the first block
    s[3, 5] = 15.5  # one key 2^15.5 above the reference: that lane's sum >= 2^15
    _, lse, redos, _ = replay(s, torch.ones(256, 1), 128)
    assert redos == 1 and abs(float(lse[3]) - math.log2(2.0 ** 15.5 + 128)) < 1e-4
    s[3, 5] = 14.0  # below the limit (with the lane's other 31 values at 2^-200): no redo
    _, _, redos, _ = replay(s, torch.ones(256, 1), 128)
    assert redos == 0
    # a row with no finite max when its first stale block comes (every key of the first block hidden): its
    # partial sums are inf, the block redoes, and the row ends with the second block's keys alone
    s = torch.zeros(16, 256)
    s[7, 128:] = -math.inf
    o, lse, redos, _ = replay(s, torch.ones(256, 1), 128)
    assert redos == 1 and abs(float(lse[7]) - 7.0) < 1e-5 and abs(float(lse[0]) - 8.0) < 1e-5
