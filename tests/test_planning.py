"""CPU tests of the split-KV decode planner (``cutedsl_attn.planning.decode``).

Work-table row: ``[batch_idx, tok_start, tok_end, kv_len, page_off, num_splits, part_base, split_idx]``.
Invariants checked on every plan (``check_plan``):

* every visible token of every request is read exactly once: per request, the items'
  ``[tok_start, tok_end)`` ranges are disjoint and their union is ``[window_start, kv_len)``;
* items are ordered longest first; padding rows (CUDA-graph mode) come last;
* a split request's pieces are multiples of 16 tokens except the last one;
* partial indices ``part_base + split_idx`` are unique, contiguous per request and cover
  ``range(num_partials)``; unsplit requests have ``num_splits = 1``;
* ``kv_len`` / ``page_off`` columns repeat the request's values.

Also: the wrapper's block-table path computes the same (kv_lens, page lookups) as the CSR
path of ``cutedsl_attn.ref.attention.block_tables_to_csr``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cutedsl_attn.planning.decode import (
    CHUNK,
    WORK_COLS,
    choose_num_splits,
    kv_lens_from_csr,
    max_items,
    plan_paged_decode,
)
from cutedsl_attn.ref import block_tables_to_csr, csr_to_block_tables


def window_start(L, window_left):
    return max(0, L - 1 - window_left) if window_left >= 0 else 0


def check_plan(wp, lens, offsets=None, window_left=-1, num_rows=None):
    """Assert every invariant of the module docstring; returns {b: [(start, end), ...]} in split order."""
    B = len(lens)
    offsets = list(range(0, 100 * B, 100)) if offsets is None else offsets
    work = wp.work
    assert work.dtype == torch.int32 and work.dim() == 2 and work.shape[1] == WORK_COLS
    rows = work.tolist()
    assert wp.num_work <= len(rows)
    if num_rows is not None:
        assert len(rows) == num_rows
    else:
        assert len(rows) == wp.num_work
    items, pads = rows[: wp.num_work], rows[wp.num_work:]
    for r in pads:
        assert r[0] == -1 and r[1] == r[2], f"bad padding row {r}"
    assert all(r[0] >= 0 for r in items)
    lengths = [r[2] - r[1] for r in items]
    assert lengths == sorted(lengths, reverse=True), "items are not ordered longest first"
    assert torch.equal(wp.kv_lens, torch.tensor(lens, dtype=torch.int32))

    per_req = {b: [] for b in range(B)}
    parts = []
    for b, s, e, kv_len, off, n, base, i in items:
        assert 0 <= b < B
        assert kv_len == lens[b] and off == offsets[b]
        assert 0 <= s <= e <= kv_len
        per_req[b].append((i, s, e, n, base))
    for b, its in per_req.items():
        assert its, f"request {b} has no work item"
        its.sort()
        n = its[0][3]
        assert all(x[3] == n for x in its) and len(its) == n, f"request {b}: num_splits disagrees"
        assert [x[0] for x in its] == list(range(n))
        if n == 1:
            assert its[0][4] == 0
        else:
            base = its[0][4]
            assert all(x[4] == base for x in its)
            parts.extend(range(base, base + n))
            for x in its[:-1]:
                assert (x[2] - x[1]) % CHUNK == 0 and x[2] > x[1], f"request {b}: piece {x} not a multiple of 16"
            assert its[-1][2] > its[-1][1]
        # coverage: consecutive, disjoint, exactly [window start, kv_len)
        cur = window_start(lens[b], window_left)
        for _, s, e, _, _ in its:
            assert s == cur, f"request {b}: gap/overlap at {s} (expected {cur})"
            cur = e
        assert cur == lens[b], f"request {b}: ends at {cur}, kv_len {lens[b]}"
    assert sorted(parts) == list(range(wp.num_partials)), "partial indices not unique/contiguous"
    if wp.num_partials == 0:
        assert all(len(v) == 1 for v in per_req.values())
    return {b: [(s, e) for _, s, e, _, _ in its] for b, its in per_req.items()}


def plan(lens, **kw):
    offsets = kw.pop("offsets", None)
    B = len(lens)
    offsets = list(range(0, 100 * B, 100)) if offsets is None else offsets
    return plan_paged_decode(torch.tensor(lens, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64),
                             **{"num_kv_heads": 8, "page_size": 16, **kw})


# ----------------------------------------------------------------------------- plan_paged_decode
def test_single_long_request_is_split():
    wp = plan([10000], num_kv_heads=8)
    check_plan(wp, [10000])
    assert wp.num_work > 1 and wp.split_tokens > 0 and wp.split_tokens % CHUNK == 0
    assert wp.num_partials == wp.num_work


def test_big_batch_is_not_split():
    lens = [1000] * 512  # 4096 CTAs already fill 132 SMs many times over
    wp = plan(lens, num_kv_heads=8)
    check_plan(wp, lens)
    assert wp.split_tokens == 0 and wp.num_work == 512 and wp.num_partials == 0


def test_mixed_batch_invariants():
    lens = [7016, 120, 3, 0, 64, 65, 2500, 17, 4096, 1]
    wp = plan(lens, num_kv_heads=2, num_sms=132, ctas_per_sm=3)
    check_plan(wp, lens)


def test_items_ordered_longest_first_and_splits_mult_of_16():
    lens = [5000, 4000, 333, 10]
    wp = plan(lens, num_kv_heads=1)
    spans = check_plan(wp, lens)
    assert len(spans[0]) > 1


def test_empty_requests_give_one_empty_item():
    lens = [0, 0, 5, 0]
    wp = plan(lens)
    spans = check_plan(wp, lens)
    for b in (0, 1, 3):
        assert spans[b] == [(0, 0)]
    assert wp.work.tolist()[-1][1:3] == [0, 0]  # empty items are the shortest


def test_all_empty_batch():
    wp = plan([0, 0])
    check_plan(wp, [0, 0])
    assert wp.split_tokens == 0


def test_empty_batch():
    wp = plan([])
    assert wp.num_work == 0 and wp.work.shape == (0, WORK_COLS)


@pytest.mark.parametrize("window_left", [0, 1, 15, 16, 100, 4999, 5000, 10**6])
def test_window_left_cuts_the_start(window_left):
    lens = [5000, 300, 1, 0, 17]
    wp = plan(lens, window_left=window_left, num_kv_heads=1)
    spans = check_plan(wp, lens, window_left=window_left)
    for b, L in enumerate(lens):
        assert spans[b][0][0] == window_start(L, window_left)
        # window_left = w keeps w + 1 keys
        assert spans[b][-1][1] - spans[b][0][0] == min(L, window_left + 1)


def test_window_left_minus_one_reads_everything():
    lens = [5000, 3]
    assert check_plan(plan(lens, window_left=-1), lens)[1] == [(0, 3)]


def test_disable_split_kv():
    lens = [100000, 5, 0]
    wp = plan(lens, disable_split_kv=True, num_kv_heads=1)
    spans = check_plan(wp, lens)
    assert wp.num_work == 3 and wp.num_partials == 0 and wp.split_tokens == 0
    assert spans[0] == [(0, 100000)]


@pytest.mark.parametrize("pages", [1, 4, 20])
def test_fixed_split(pages):
    lens = [1000, 33, 320, 321, 0]
    tokens = pages * 16
    wp = plan(lens, fixed_split_tokens=tokens)
    spans = check_plan(wp, lens)
    assert wp.split_tokens == tokens
    for b, L in enumerate(lens):
        # multiples of 16 tokens: exactly ceil(L / split) pieces, none longer than the split
        assert len(spans[b]) == max(1, math.ceil(L / tokens))
        assert all(e - s <= tokens for s, e in spans[b])


def test_fixed_split_is_batch_invariant():
    """With a fixed split, a request's pieces do not depend on the other requests."""
    lens = [1000, 33, 5000, 7]
    wp = plan(lens, fixed_split_tokens=64)
    spans = check_plan(wp, lens)
    for b, L in enumerate(lens):
        alone = check_plan(plan([L], fixed_split_tokens=64), [L])
        assert alone[0] == spans[b]


def test_fixed_split_not_positive():
    with pytest.raises(ValueError, match="fixed_split"):
        plan([100], fixed_split_tokens=0)
    with pytest.raises(ValueError, match="fixed_split"):
        plan([100], fixed_split_tokens=-16)


def test_max_splits_per_request():
    with pytest.raises(ValueError, match="fixed_split_size"):
        plan([10000], fixed_split_tokens=16, max_splits_per_request=100)
    check_plan(plan([1600], fixed_split_tokens=16, max_splits_per_request=100), [1600])


def test_padding_rows_for_cuda_graphs():
    lens = [3000, 20, 0]
    n = max_items(3, 8, 132 * 2)
    wp = plan(lens, num_rows=n)
    check_plan(wp, lens, num_rows=n)
    assert wp.work.shape[0] == n and wp.num_work < n
    assert (wp.work[wp.num_work:, 0] == -1).all()


def test_num_rows_too_small():
    with pytest.raises(ValueError, match="work items"):
        plan([10000, 10000], num_kv_heads=1, num_rows=2)
    with pytest.raises(ValueError):
        plan([1, 2, 3], num_rows=2)


def test_num_rows_exact_fit():
    wp = plan([1, 2, 3], num_rows=3, disable_split_kv=True)
    check_plan(wp, [1, 2, 3], num_rows=3)


def test_page_offsets_and_kv_len_columns():
    lens = [40, 9]
    wp = plan(lens, offsets=[7, 3], disable_split_kv=True)
    rows = sorted(wp.work.tolist())
    assert rows[0][3:5] == [40, 7] and rows[1][3:5] == [9, 3]


def test_inputs_any_int_dtype_and_device_cpu():
    a = plan_paged_decode(torch.tensor([300, 7], dtype=torch.int32), torch.tensor([0, 19], dtype=torch.int32),
                          num_kv_heads=8, page_size=16)
    b = plan_paged_decode(torch.tensor([300, 7]), torch.tensor([0, 19]), num_kv_heads=8, page_size=16)
    assert torch.equal(a.work, b.work) and a.kv_lens.dtype == torch.int32


# ----------------------------------------------------------------------------- choose_num_splits / max_items
def test_choose_num_splits_edge_cases():
    assert choose_num_splits([], 8, 264) == 0
    assert choose_num_splits([64, 10, 0], 8, 264) == 0  # nothing longer than min_split
    assert choose_num_splits([0], 8, 264) == 0


@pytest.mark.parametrize("lens,hkv,slots", [([10000], 8, 264), ([8000, 100, 100], 8, 264), ([65], 1, 264),
                                            ([100000], 1, 1000), ([3000] * 7, 4, 132)])
def test_choose_num_splits_properties(lens, hkv, slots):
    s = choose_num_splits(lens, hkv, slots)
    assert s == 0 or (s % CHUNK == 0 and s >= 64)
    if s:
        items = sum(max(1, -(-L // s)) for L in lens)
        assert items <= max_items(len(lens), hkv, slots)
        assert -(-max(lens) // s) <= 128


def test_choose_num_splits_fills_the_gpu():
    s = choose_num_splits([10000], 8, 264)
    items = -(-10000 // s)
    assert items * 8 >= 0.9 * 264 / 2  # at least about half a wave instead of 8 CTAs


def test_choose_num_splits_respects_min_split():
    s = choose_num_splits([200], 1, 10**4, min_split=64)
    assert s == 0 or s >= 64
    s = choose_num_splits([5000], 1, 10**4, min_split=1024)
    assert s == 0 or s >= 1024


def test_max_items_formula():
    assert max_items(48, 8, 264) == 48 + 2 * 33
    assert max_items(1, 3, 10) == 1 + 2 * 4
    assert max_items(5, 0, 10) == 5 + 20  # num_kv_heads clamped to 1


# ----------------------------------------------------------------------------- kv_lens_from_csr
def test_kv_lens_from_csr():
    indptr = torch.tensor([0, 3, 3, 4, 10], dtype=torch.int32)
    last = torch.tensor([5, 0, 16, 1], dtype=torch.int32)
    lens = kv_lens_from_csr(indptr, last, 16)
    assert lens.dtype == torch.int64 and lens.tolist() == [37, 0, 16, 81]


def test_kv_lens_from_csr_matches_ref():
    g = torch.Generator().manual_seed(1)
    for ps in (1, 5, 16):
        seq = torch.randint(0, 200, (20,), generator=g)
        bt = torch.randint(0, 1000, (20, -(-200 // ps)), generator=g, dtype=torch.int32)
        indptr, _, last = block_tables_to_csr(bt, seq, ps)
        assert kv_lens_from_csr(indptr, last, ps).tolist() == seq.tolist()


# ----------------------------------------------------------------------------- property test
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.one_of(st.integers(0, 40), st.integers(0, 20000)), min_size=1, max_size=40),
    hkv=st.sampled_from([1, 2, 4, 8, 32]),
    num_sms=st.sampled_from([1, 8, 132, 148]),
    ctas_per_sm=st.integers(1, 4),
    window_left=st.one_of(st.just(-1), st.integers(0, 3000)),
    mode=st.sampled_from(["auto", "graph", "fixed", "nosplit"]),
    fixed_pages=st.integers(1, 64),
)
def test_plan_properties(lens, hkv, num_sms, ctas_per_sm, window_left, mode, fixed_pages):
    B = len(lens)
    kw = dict(num_kv_heads=hkv, page_size=16, window_left=window_left, num_sms=num_sms, ctas_per_sm=ctas_per_sm)
    num_rows = None
    if mode == "graph":
        # CUDA-graph contract: the automatic split never needs more rows than max_items
        num_rows = max_items(B, hkv, num_sms * ctas_per_sm)
        kw["num_rows"] = num_rows
    elif mode == "fixed":
        kw["fixed_split_tokens"] = fixed_pages * 16
    elif mode == "nosplit":
        kw["disable_split_kv"] = True
    wp = plan(lens, **kw)
    check_plan(wp, lens, window_left=window_left, num_rows=num_rows)
    if mode == "nosplit":
        assert wp.num_work == B
    if mode in ("auto", "graph"):
        assert wp.num_work <= max_items(B, hkv, num_sms * ctas_per_sm)


# ----------------------------------------------------------------------------- CSR <-> block tables (wrapper)
def _resolved_pages(args, page_size):
    """(request, token) -> physical page, as the kernel reads it from the work table and flat indices."""
    indices, work = args.indices, args.work
    out = {}
    for b, s, e, kv_len, off, *_ in work.tolist():
        if b < 0:
            continue
        for t in range(s, e):
            out[(b, t)] = int(indices[off + t // page_size])
    return out


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window_left", [-1, 40])
def test_block_tables_equal_csr_in_wrapper(monkeypatch, page_size, window_left):
    import cutedsl_attn as ca

    monkeypatch.setenv("CUTEDSL_ATTN_ARCH", "sm_90a")
    from _kernel_stubs import Recorder

    rec = Recorder().install(monkeypatch)
    g = torch.Generator().manual_seed(3)
    seq_lens = torch.tensor([700, 0, 1, 33, 16, 250], dtype=torch.int32)
    width = -(-700 // page_size) + 2
    pool = 6 * width
    bt = torch.randperm(pool, generator=g)[: 6 * width].view(6, width).to(torch.int32)
    indptr, indices, last = block_tables_to_csr(bt, seq_lens, page_size)
    hq, hkv, d = 8, 2, 64
    q = torch.randn(6, hq, d).to(torch.bfloat16)
    cache = torch.randn(pool, 2, page_size, hkv, d).to(torch.bfloat16)
    ws = torch.zeros(8 << 20, dtype=torch.uint8)

    w1 = ca.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    w1.plan(indptr, indices, last, hq, hkv, d, page_size, q_data_type=torch.bfloat16, window_left=window_left)
    w1.run(q, cache)
    w2 = ca.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8 << 20, dtype=torch.uint8), "NHD")
    w2.plan(None, None, None, hq, hkv, d, page_size, q_data_type=torch.bfloat16, window_left=window_left,
            block_tables=bt, seq_lens=seq_lens)
    w2.run(q, cache)
    (_, _, a_csr), (_, _, a_bt) = rec.calls
    # same kv_lens in both work tables, same physical page for every token the kernel reads
    for a in (a_csr, a_bt):
        lens_seen = {r[0]: r[3] for r in a.work.tolist() if r[0] >= 0}
        assert [lens_seen[b] for b in range(6)] == seq_lens.tolist()
    p_csr, p_bt = _resolved_pages(a_csr, page_size), _resolved_pages(a_bt, page_size)
    assert p_csr == p_bt
    expect = {(b, t) for b in range(6) for t in range(window_start(int(seq_lens[b]), window_left),
                                                     int(seq_lens[b]))}
    assert set(p_csr) == expect
    for (b, t), page in p_csr.items():
        assert page == int(bt[b, t // page_size])
    # and the round trip through the ref converters is the identity on the used part
    bt2, sl2 = csr_to_block_tables(indptr, indices, last, page_size)
    assert torch.equal(sl2, seq_lens)
    for b in range(6):
        n = -(-int(seq_lens[b]) // page_size)
        assert torch.equal(bt2[b, :n], bt[b, :n])


def test_choose_num_splits_matches_the_plain_search():
    """The split search's shortcuts (one-wave candidates without piece lists, repeated splits skipped) choose
    exactly what the plain search over every candidate's pieces and LPT schedule chooses."""
    import random

    import cutedsl_attn.planning.decode as D

    def plain(eff_lens, num_kv_heads, slots, *, min_split=64, max_splits=128, min_waves=0.0):
        longest = max(eff_lens)
        workers = max(1, slots // max(1, num_kv_heads))
        limit = D.max_items(len(eff_lens), num_kv_heads, slots)
        cands = [(D._lpt_makespan(list(eff_lens), workers), len(eff_lens), 0)]
        if longest > min_split:
            for n in range(2, max_splits + 1):
                split = -(-max(min_split, -(-longest // n)) // D.CHUNK) * D.CHUNK
                pieces = [p for L in eff_lens for p in D.split_pieces(L, split)]
                if len(pieces) > limit:
                    break
                cands.append((D._lpt_makespan(pieces, workers), len(pieces), split))
                if split == min_split:
                    break
        best = min(c[0] for c in cands)
        for ms, items, split in cands:
            if ms <= 1.02 * best and items * num_kv_heads >= min_waves * slots:
                return split
        return cands[-1][2] if min_waves > 0 else 0

    rng = random.Random(0)
    for _ in range(600):
        B = rng.choice([1, 2, 3, 8, 16, 48, 128])
        lens = [rng.randint(0, 40000) if rng.random() < 0.3 else int(10 ** rng.uniform(0, 4.7)) for _ in range(B)]
        h, slots, mw = rng.choice([1, 2, 8, 16]), rng.choice([132, 264, 296]), rng.choice([0.0, 0.0, 1.0])
        assert D.choose_num_splits(lens, h, slots, min_waves=mw) == plain(lens, h, slots, min_waves=mw), (lens, h)
