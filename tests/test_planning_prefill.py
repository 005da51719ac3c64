"""CPU tests of the prefill planner (``cutedsl_attn.planning.prefill``).

Work-table row: ``[b, row0, qo_len, kv_len, q_start, kv_start_or_page_off, mask_off, 0]``,
one row per (request, tile of ``tile_m`` packed rows), packed row ``r`` = query token
``r // group_size``.  Invariants checked on every plan (``check_plan``):

* every packed row ``[0, qo_len * group_size)`` of every request lies in exactly one tile;
  ``row0`` is a multiple of ``tile_m``; requests with ``qo_len == 0`` have no tile;
* the other columns repeat the request's values (last column 0);
* tiles are ordered request by request (descending total work of the request), within a request
  by descending work (visible KV tokens, ``tile_kv_range``); requests of equal total work form one
  group ordered by tile work, ties by (request, row); padding rows (``b = -1``) come last and the table has ``num_rows`` rows
  (CUDA-graph mode) or ``max(num_work, 1)``;
* ``tile_kv_range`` is exactly the union of the keys the tile's rows can see (brute force
  against FlashInfer's bottom-right causal / window convention).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cutedsl_attn.planning.prefill import (
    PAD_ROW,
    WORK_COLS,
    max_tiles,
    num_tiles,
    plan_prefill,
    tile_kv_range,
)


def check_plan(work, num_work, qo, kv, qs, ks, mo, G, TM, *, num_rows=None, causal=False, window_left=-1):
    assert work.dtype == torch.int32 and work.dim() == 2 and work.shape[1] == WORK_COLS
    assert work.device.type == "cpu"
    rows = work.tolist()
    expect_rows = num_rows if num_rows is not None else max(num_work, 1)
    assert len(rows) == expect_rows
    items, pads = rows[:num_work], rows[num_work:]
    assert all(tuple(r) == PAD_ROW for r in pads), pads
    covered = {b: [] for b in range(len(qo))}
    for r in items:
        b, row0, q_len, k_len, q_start, k_start, m_off, zero = r
        assert 0 <= b < len(qo)
        assert (q_len, k_len, q_start, k_start, m_off, zero) == (qo[b], kv[b], qs[b], ks[b], mo[b], 0)
        assert row0 % TM == 0 and 0 <= row0 < qo[b] * G
        covered[b].extend(range(row0, min(row0 + TM, qo[b] * G)))
    for b in range(len(qo)):
        assert sorted(covered[b]) == list(range(qo[b] * G)), f"request {b}: packed rows not covered exactly once"
    assert num_work == sum(num_tiles(q, G, TM) for q in qo)
    costs = []
    for r in items:
        lo, hi = tile_kv_range(r[1], r[2], r[3], group_size=G, tile_m=TM, causal=causal, window_left=window_left)
        costs.append(max(hi - lo, 0))
    req_work = {}
    for r, c in zip(items, costs):
        req_work[r[0]] = req_work.get(r[0], 0) + c
    keys = [(-req_work[r[0]], -c, r[0], r[1]) for r, c in zip(items, costs)]
    assert keys == sorted(keys), "tiles are not ordered request-major by descending work"


def plan_and_check(qo, kv, G, TM, *, qs=None, ks=None, mo=None, **kw):
    B = len(qo)
    qs = qs if qs is not None else [sum(qo[:b]) for b in range(B)]
    ks = ks if ks is not None else [sum(kv[:b]) for b in range(B)]
    work, n = plan_prefill(qo, kv, qs, ks, mo, group_size=G, tile_m=TM, **kw)
    check_plan(work, n, qo, kv, qs, ks, mo if mo is not None else [0] * B, G, TM,
               num_rows=kw.get("num_rows"), causal=kw.get("causal", False), window_left=kw.get("window_left", -1))
    return work, n


@pytest.mark.parametrize("qo,kv,G,TM", [
    ([1], [1], 1, 64),
    ([5, 0, 300, 64, 65], [7, 10, 17, 64, 0], 4, 64),
    ([4096], [4096], 8, 64),
    ([17, 1, 33], [1000, 2, 0], 16, 128),
    ([3, 3, 3], [3, 3, 3], 5, 16),
    ([1000, 2000], [4000, 2000], 1, 64),
])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window_left", [-1, 0, 37])
def test_plan_invariants(qo, kv, G, TM, causal, window_left):
    plan_and_check(qo, kv, G, TM, causal=causal, window_left=window_left)


def test_columns_carry_starts_and_mask_offsets():
    qo, kv = [5, 20, 3], [9, 40, 0]
    qs, ks, mo = [100, 105, 125], [7, 1000, 5], [0, 48, 6448]
    work, n = plan_and_check(qo, kv, 4, 16, qs=qs, ks=ks, mo=mo)
    assert n == 2 + 5 + 1


def test_causal_orders_lower_tiles_first():
    # one request, qo == kv: with bottom-right causal each later tile sees more keys
    work, n = plan_and_check([256], [256], 1, 64, causal=True)
    assert [r[1] for r in work.tolist()] == [192, 128, 64, 0]
    # without causal every tile sees everything: ties keep row order
    work, n = plan_and_check([256], [256], 1, 64)
    assert [r[1] for r in work.tolist()] == [0, 64, 128, 192]


def test_request_major_order():
    # request 1 has the most work in total: all its tiles come first, its longest (causal: last) tile first,
    # even though request 0's single tile sees more keys than most of request 1's
    work, n = plan_and_check([64, 512], [1000, 512], 1, 64, causal=True)  # tile work 1000 vs 512, 448, ..., 64
    assert [(r[0], r[1]) for r in work.tolist()] == [(1, 64 * i) for i in range(7, -1, -1)] + [(0, 0)]


def test_equal_requests_interleave_by_tile_work():
    # a uniform batch: both requests' tiles by descending work, request 0 first on ties
    work, n = plan_and_check([128, 128], [128, 128], 1, 64, causal=True)
    assert [(r[0], r[1]) for r in work.tolist()] == [(0, 64), (1, 64), (0, 0), (1, 0)]


def test_longest_kv_first_across_requests():
    work, n = plan_and_check([10, 10, 10], [5, 500, 50], 1, 64)
    assert [r[0] for r in work.tolist()] == [1, 2, 0]


def test_window_orders_by_visible_keys():
    # request 0: 1 query row, 5000 keys; request 1: 64 rows, 100 keys
    work, _ = plan_and_check([1, 64], [5000, 100], 1, 64)
    assert [r[0] for r in work.tolist()] == [0, 1]  # 5000 vs 100 visible keys
    work, _ = plan_and_check([1, 64], [5000, 100], 1, 64, window_left=15)
    assert [r[0] for r in work.tolist()] == [1, 0]  # 16 vs 79 visible keys
    assert tile_kv_range(0, 1, 5000, group_size=1, tile_m=64, window_left=15) == (4984, 5000)
    assert tile_kv_range(0, 64, 100, group_size=1, tile_m=64, window_left=15) == (21, 100)


def test_empty_batch_and_empty_requests():
    work, n = plan_prefill([], [], [], [], None, group_size=4, tile_m=64)
    assert n == 0 and work.tolist() == [list(PAD_ROW)]
    work, n = plan_and_check([0, 0], [10, 0], 4, 64)
    assert n == 0 and work.shape == (1, WORK_COLS)


def test_kv_len_zero_still_gets_tiles():
    work, n = plan_and_check([3], [0], 8, 16)
    assert n == 2 and all(r[3] == 0 for r in work.tolist())


@pytest.mark.parametrize("extra", [0, 1, 7])
def test_padding_rows(extra):
    qo, kv = [5, 70, 1], [5, 70, 900]
    n_need = sum(num_tiles(q, 4, 64) for q in qo)
    work, n = plan_and_check(qo, kv, 4, 64, num_rows=n_need + extra)
    assert n == n_need and work.shape[0] == n_need + extra


def test_padding_does_not_fit():
    with pytest.raises(ValueError, match="work rows"):
        plan_prefill([100], [100], [0], [0], group_size=4, tile_m=64, num_rows=6)


def test_max_tiles_bound_is_tight_enough():
    # the bound used for CUDA-graph buffers
    assert max_tiles(0, 0, 4, 64) == 1
    assert max_tiles(64, 1, 1, 64) == 2
    for qo in ([1] * 9, [63, 1], [64, 64], [65]):
        assert sum(num_tiles(q, 3, 64) for q in qo) <= max_tiles(sum(qo), len(qo), 3, 64)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), min_size=0, max_size=8),
    G=st.integers(1, 16),
    TM=st.sampled_from([16, 32, 64, 128]),
    causal=st.booleans(),
    window_left=st.integers(-1, 50),
    pad=st.integers(0, 3),
)
def test_property_cover_and_order(lens, G, TM, causal, window_left, pad):
    qo = [a for a, _ in lens]
    kv = [b for _, b in lens]
    bound = max_tiles(sum(qo), len(qo), G, TM)
    plan_and_check(qo, kv, G, TM, causal=causal, window_left=window_left)
    plan_and_check(qo, kv, G, TM, causal=causal, window_left=window_left, num_rows=bound + pad)


@settings(max_examples=100, deadline=None)
@given(qo=st.integers(1, 40), kv=st.integers(0, 40), G=st.integers(1, 5), TM=st.sampled_from([4, 8, 16]),
       causal=st.booleans(), window_left=st.integers(-1, 12))
def test_tile_kv_range_is_union_of_visible_keys(qo, kv, G, TM, causal, window_left):
    for row0 in range(0, qo * G, TM):
        vis = set()
        for r in range(row0, min(row0 + TM, qo * G)):
            i = r // G
            pos = i + kv - qo
            for j in range(kv):
                if causal and j > pos:
                    continue
                if window_left >= 0 and j < pos - window_left:
                    continue
                vis.add(j)
        lo, hi = tile_kv_range(row0, qo, kv, group_size=G, tile_m=TM, causal=causal, window_left=window_left)
        assert vis == set(range(lo, hi)), (row0, lo, hi, sorted(vis))


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("kw,exc,match", [
    (dict(kv_lens=[1]), ValueError, "kv_lens"),
    (dict(q_starts=[0, 1, 2]), ValueError, "q_starts"),
    (dict(mask_bit_offsets=[0]), ValueError, "mask_bit_offsets"),
    (dict(qo_lens=[1, -1]), ValueError, r"qo_lens\[1\]"),
    (dict(kv_starts=[0, -5]), ValueError, "kv_starts"),
    (dict(mask_bit_offsets=[0, 2**31]), ValueError, "int32"),
    (dict(qo_lens=[1, 2**31]), ValueError, "int32"),
    (dict(qo_lens=[1.5, 2]), TypeError, "qo_lens"),
    (dict(qo_lens=torch.tensor([1.0, 2.0])), TypeError, "qo_lens"),
    (dict(qo_lens=torch.tensor([[1, 2]])), ValueError, "qo_lens"),
    (dict(qo_lens="12"), TypeError, "qo_lens"),
    (dict(group_size=0), ValueError, "group_size"),
    (dict(tile_m=0), ValueError, "tile_m"),
    (dict(group_size=2.0), TypeError, "group_size"),
    (dict(num_rows=1.0), TypeError, "num_rows"),
])
def test_validation(kw, exc, match):
    args = dict(qo_lens=[1, 2], kv_lens=[3, 4], q_starts=[0, 1], kv_starts=[0, 3], mask_bit_offsets=None,
                group_size=1, tile_m=64)
    args.update(kw)
    with pytest.raises(exc, match=match):
        plan_prefill(args.pop("qo_lens"), args.pop("kv_lens"), args.pop("q_starts"), args.pop("kv_starts"),
                     args.pop("mask_bit_offsets"), **args)


def test_group_times_qo_overflow():
    with pytest.raises(ValueError, match="group_size"):
        plan_prefill([2**28], [1], [0], [0], group_size=16, tile_m=64)


def test_tensor_inputs_equal_list_inputs():
    qo, kv = [5, 0, 77], [6, 3, 100]
    a = plan_prefill(qo, kv, [0, 5, 5], [0, 6, 9], [0, 0, 0], group_size=2, tile_m=32, causal=True)
    b = plan_prefill(torch.tensor(qo, dtype=torch.int32), torch.tensor(kv), torch.tensor([0, 5, 5]),
                     torch.tensor([0, 6, 9], dtype=torch.int64), None, group_size=2, tile_m=32, causal=True)
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
