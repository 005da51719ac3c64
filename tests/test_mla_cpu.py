"""CPU tests of MLA: the float64 oracle against an independent loop, the wrapper's signature (FlashInfer's
seed) and its input validation, the planner, and the kernel's PTX / resources for sm_90a and sm_100a."""

import glob
import inspect
import math

import pytest
import torch

from cutedsl_attn import ref
from cutedsl_attn.api import mla as api
from cutedsl_attn.planning.decode import WORK_COLS, plan_paged_decode
from cutedsl_attn.planning.mla import (
    MLA_WORK_COLS, W_QO_LEN, W_Q_START, MlaProblem, MlaSplit, kernel_row_tiles, max_work_rows, plan_mla, row_tiles,
)
from cutedsl_attn.portable import mla_decode as md

DC, DR = 512, 64


def loop_mla(q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_lens, sm_scale, causal):
    """Row by row, key by key, in float64: an independent statement of the absorbed MLA."""
    T, H, _ = q_nope.shape
    PS = ckv.shape[1]
    o = torch.zeros(T, H, DC, dtype=torch.float64)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64)
    for b in range(len(kv_lens)):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        L = int(kv_lens[b])
        pages = kv_indices[int(kv_indptr[b]): int(kv_indptr[b + 1])].tolist()
        n_q = q1 - q0
        for i in range(n_q):
            for h in range(H):
                logits, vals = [], []
                for j in range(L):
                    if causal and j > i + L - n_q:
                        continue
                    page, slot = pages[j // PS], j % PS
                    c = ckv[page, slot].double()
                    s = (q_nope[q0 + i, h].double() @ c + q_pe[q0 + i, h].double() @ kpe[page, slot].double())
                    logits.append(s.item() * sm_scale)
                    vals.append(c)
                if not logits:
                    continue
                mx = max(logits)
                w = [math.exp(x - mx) for x in logits]
                tot = sum(w)
                o[q0 + i, h] = sum(wi * v for wi, v in zip(w, vals)) / tot
                lse[q0 + i, h] = (mx + math.log(tot)) / math.log(2.0)
    return o, lse


def make_case(qo_lens, kv_lens, H, PS, *, gen, nan_slots=True, dtype=torch.float32):
    B = len(kv_lens)
    npages = [-(-L // PS) for L in kv_lens]
    total = sum(npages) + 3
    perm = torch.randperm(total, generator=gen)
    kv_indptr = torch.tensor([0] + list(torch.tensor(npages).cumsum(0).tolist()), dtype=torch.int32)
    kv_indices = perm[: int(kv_indptr[-1])].to(torch.int32)
    qo_indptr = torch.tensor([0] + list(torch.tensor(qo_lens).cumsum(0).tolist()), dtype=torch.int32)
    T = int(qo_indptr[-1])
    q_nope = torch.randn(T, H, DC, generator=gen).to(dtype)
    q_pe = torch.randn(T, H, DR, generator=gen).to(dtype)
    ckv = torch.randn(total, PS, DC, generator=gen).to(dtype) / 8
    kpe = torch.randn(total, PS, DR, generator=gen).to(dtype) / 8
    if nan_slots:  # every slot no request owns
        used = torch.zeros(total, PS, dtype=torch.bool)
        for b in range(B):
            for j in range(kv_lens[b]):
                used[int(kv_indices[int(kv_indptr[b]) + j // PS]), j % PS] = True
        ckv[~used] = float("nan")
        kpe[~used] = float("nan")
    return q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, torch.tensor(kv_lens, dtype=torch.int32)


@pytest.mark.parametrize("qo_lens,kv_lens,H,PS,causal", [
    ([1, 1, 1], [5, 0, 17], 3, 1, False),
    ([1, 1], [16, 33], 2, 16, False),
    ([3, 2, 1], [7, 2, 9], 2, 4, True),
    ([2, 4], [5, 3], 1, 3, True),  # request 1: its first query row sees no key (O = 0, LSE = -inf)
    ([2, 0, 1], [6, 4, 0], 2, 2, False),
])
def test_oracle_matches_loop(qo_lens, kv_lens, H, PS, causal):
    gen = torch.Generator().manual_seed(sum(kv_lens) + H)
    case = make_case(qo_lens, kv_lens, H, PS, gen=gen)
    sm_scale = 1.0 / math.sqrt(128 + 64)
    o, lse = ref.mla_paged_attention(*case, sm_scale=sm_scale, causal=causal)
    o2, lse2 = loop_mla(*case, sm_scale, causal)
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, o2, rtol=1e-10, atol=1e-12)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse2))
    fin = torch.isfinite(lse2)
    torch.testing.assert_close(lse[fin], lse2[fin], rtol=1e-10, atol=1e-12)
    # rows that see nothing: O = 0, LSE = -inf
    assert (o[torch.isinf(lse)] == 0).all()


def test_oracle_causal_decode_row_equals_noncausal():
    gen = torch.Generator().manual_seed(3)
    case = make_case([1, 1], [9, 4], 4, 2, gen=gen)
    a = ref.mla_paged_attention(*case, sm_scale=0.1, causal=True)
    b = ref.mla_paged_attention(*case, sm_scale=0.1, causal=False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_oracle_errors():
    gen = torch.Generator().manual_seed(0)
    q_nope, q_pe, ckv, kpe, qo, kvp, idx, lens = make_case([1], [4], 2, 2, gen=gen)
    with pytest.raises(ValueError, match="kv_len_arr"):
        ref.mla_paged_attention(q_nope, q_pe, ckv, kpe, qo, kvp, idx, lens + 1, sm_scale=1.0)
    with pytest.raises(ValueError, match="kpe_cache"):
        ref.mla_paged_attention(q_nope, q_pe, ckv, kpe[:, :1], qo, kvp, idx, lens, sm_scale=1.0)
    with pytest.raises(TypeError, match="kv_indices"):
        ref.mla_paged_attention(q_nope, q_pe, ckv, kpe, qo, kvp, idx.float(), lens, sm_scale=1.0)


# ---------------------------------------------------------------------------------------------- the wrapper
def _params(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def test_signature_matches_seed():
    E = inspect.Parameter.empty
    assert _params(api.BatchMLAPagedAttentionWrapper.__init__) == [
        ("float_workspace_buffer", E), ("use_cuda_graph", False), ("qo_indptr", None), ("kv_indptr", None),
        ("kv_indices", None), ("kv_len_arr", None), ("backend", "auto")]
    assert _params(api.BatchMLAPagedAttentionWrapper.plan) == [
        ("qo_indptr", E), ("kv_indptr", E), ("kv_indices", E), ("kv_len_arr", E), ("num_heads", E),
        ("head_dim_ckv", E), ("head_dim_kpe", E), ("page_size", E), ("causal", E), ("sm_scale", E),
        ("q_data_type", E), ("kv_data_type", E), ("use_profiler", False)]
    assert _params(api.BatchMLAPagedAttentionWrapper.run) == [
        ("q_nope", E), ("q_pe", E), ("ckv_cache", E), ("kpe_cache", E), ("out", None), ("lse", None),
        ("return_lse", False), ("profiler_buffer", None), ("kv_len", None), ("page_table", None),
        ("return_lse_base_on_e", False)]


@pytest.fixture
def cross(monkeypatch):
    monkeypatch.setenv("CUTEDSL_ATTN_ARCH", "sm_90a")


def _plan_args(B=3, L=5, PS=2, H=8):
    npg = -(-L // PS)
    return dict(qo_indptr=torch.arange(B + 1, dtype=torch.int32),
                kv_indptr=torch.arange(B + 1, dtype=torch.int32) * npg,
                kv_indices=torch.arange(B * npg, dtype=torch.int32),
                kv_len_arr=torch.full((B,), L, dtype=torch.int32), num_heads=H, head_dim_ckv=DC, head_dim_kpe=DR,
                page_size=PS, causal=False, sm_scale=0.1, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)


def _wrapper(**kw):
    return api.BatchMLAPagedAttentionWrapper(torch.empty(1 << 24, dtype=torch.int8), **kw)


def test_backends():
    _wrapper(backend="cute")
    for name in ("fa2", "fa3", "cutlass", "trtllm-gen", "xqa"):
        with pytest.raises(NotImplementedError, match="'auto', 'cute'"):
            _wrapper(backend=name)
    with pytest.raises(ValueError, match="backend"):
        _wrapper(backend="nope")


@pytest.mark.parametrize("change,exc,match", [
    (dict(head_dim_ckv=128), NotImplementedError, "head_dim_ckv=512 with head_dim_kpe=64"),
    (dict(head_dim_kpe=32), NotImplementedError, "head_dim_ckv=512 with head_dim_kpe=64"),
    (dict(page_size=128), NotImplementedError, "page sizes 1..64"),
    (dict(q_data_type=torch.float16), NotImplementedError, "one dtype"),
    (dict(q_data_type=torch.float32, kv_data_type=torch.float32), NotImplementedError, "bfloat16"),
    (dict(kv_len_arr=torch.tensor([5, 7, 5], dtype=torch.int32)), ValueError, "kv_len_arr\\[1\\] = 7 disagrees"),
    (dict(kv_len_arr=torch.tensor([5, 2, 5], dtype=torch.int32)), ValueError, "kv_len_arr\\[1\\] = 2 disagrees"),
    (dict(kv_len_arr=torch.tensor([5, 5], dtype=torch.int32)), ValueError, "qo_indptr"),
    (dict(kv_indices=torch.arange(5, dtype=torch.int32)), ValueError, "kv_indices"),
    (dict(kv_indptr=torch.tensor([0, 3, 2, 9], dtype=torch.int32)), ValueError, "non-decreasing"),
    (dict(qo_indptr=torch.arange(4, dtype=torch.int64)), ValueError, "qo_indptr must be int32"),
    (dict(num_heads=0), ValueError, "num_heads"),
    (dict(sm_scale=float("nan")), ValueError, "sm_scale"),
    (dict(causal=1), TypeError, "causal"),
    (dict(use_profiler=True), NotImplementedError, "use_profiler"),
])
def test_plan_validation(cross, change, exc, match):
    args = _plan_args()
    args.update(change)
    with pytest.raises(exc, match=match):
        _wrapper().plan(**args)


def test_run_validation(cross):
    w = _wrapper()
    B, L, PS, H = 3, 5, 2, 8
    with pytest.raises(RuntimeError, match="plan"):
        w.run(None, None, None, None)
    w.plan(**_plan_args(B, L, PS, H))
    bf = torch.bfloat16
    qn, qp = torch.zeros(B, H, DC, dtype=bf), torch.zeros(B, H, DR, dtype=bf)
    ckv, kpe = torch.zeros(9, PS, DC, dtype=bf), torch.zeros(9, PS, DR, dtype=bf)
    with pytest.raises(ValueError, match="q_nope must have shape"):
        w.run(qn[:, :4], qp, ckv, kpe)
    with pytest.raises(ValueError, match="dtype of q_pe"):
        w.run(qn, qp.half(), ckv, kpe)
    with pytest.raises(ValueError, match="ckv_cache must be"):
        w.run(qn, qp, ckv.view(18, 1, DC), kpe)
    with pytest.raises(ValueError, match="same number of pages"):
        w.run(qn, qp, ckv, kpe[:8])
    with pytest.raises(ValueError, match="page id 8"):
        w.run(qn, qp, ckv[:8], kpe[:8])
    with pytest.raises(ValueError, match="contiguous last"):
        w.run(qn, qp, torch.zeros(9, PS, 2 * DC, dtype=bf)[..., ::2], kpe)
    with pytest.raises(NotImplementedError, match="profiler_buffer"):
        w.run(qn, qp, ckv, kpe, profiler_buffer=torch.zeros(1))
    with pytest.raises(ValueError, match="out must have shape"):
        w.run(qn, qp, ckv, kpe, out=torch.zeros(B, H, DR, dtype=bf))
    with pytest.raises(ValueError, match="CUDA tensors"):
        w.run(qn, qp, ckv, kpe)


def test_empty_batch_launches_nothing(cross, monkeypatch):
    calls = []
    monkeypatch.setattr(api, "mla_launch", lambda *a: calls.append(a))
    w = _wrapper()
    args = _plan_args()
    args.update(qo_indptr=torch.zeros(1, dtype=torch.int32), kv_indptr=torch.zeros(1, dtype=torch.int32),
                kv_indices=torch.zeros(0, dtype=torch.int32), kv_len_arr=torch.zeros(0, dtype=torch.int32))
    w.plan(**args)
    bf = torch.bfloat16
    qn, qp = torch.zeros(0, 8, DC, dtype=bf), torch.zeros(0, 8, DR, dtype=bf)
    out, lse = w.run(qn, qp, torch.zeros(4, 2, DC, dtype=bf), torch.zeros(4, 2, DR, dtype=bf), return_lse=True)
    assert out.shape == (0, 8, DC) and lse.shape == (0, 8) and calls == []


@pytest.mark.parametrize("name,value", [("return_lse", "no"), ("return_lse_base_on_e", 1)])
def test_run_bool_options_must_be_bool(cross, name, value):
    w = _wrapper()
    w.plan(**_plan_args())
    bf = torch.bfloat16
    with pytest.raises(TypeError, match=f"{name} must be a bool"):
        w.run(torch.zeros(3, 8, DC, dtype=bf), torch.zeros(3, 8, DR, dtype=bf), torch.zeros(9, 2, DC, dtype=bf),
              torch.zeros(9, 2, DR, dtype=bf), **{name: value})


def test_bool_options_must_be_bool(cross):
    with pytest.raises(TypeError, match="use_cuda_graph must be a bool"):
        _wrapper(use_cuda_graph="False")
    args = _plan_args()
    for name, value in (("causal", "False"), ("use_profiler", 0)):
        with pytest.raises(TypeError, match=f"{name} must be a bool"):
            _wrapper().plan(**{**args, name: value})


def test_cuda_graph_buffers_required():
    with pytest.raises(ValueError, match="kv_len_arr"):
        _wrapper(use_cuda_graph=True)
    B = 2
    i32 = dict(dtype=torch.int32)
    with pytest.raises(ValueError, match="qo_indptr must have 3 entries"):
        _wrapper(use_cuda_graph=True, qo_indptr=torch.zeros(B, **i32), kv_indptr=torch.zeros(B + 1, **i32),
                 kv_indices=torch.zeros(8, **i32), kv_len_arr=torch.zeros(B, **i32))


def test_cuda_graph_plan_keeps_buffers(cross):
    B, L, PS, H = 3, 5, 2, 8
    i32 = dict(dtype=torch.int32)
    bufs = dict(qo_indptr=torch.zeros(B + 1, **i32), kv_indptr=torch.zeros(B + 1, **i32),
                kv_indices=torch.zeros(64, **i32), kv_len_arr=torch.zeros(B, **i32))
    w = _wrapper(use_cuda_graph=True, **bufs)
    w.plan(**_plan_args(B, L, PS, H))
    work0 = w._plan["work"].data_ptr()
    assert torch.equal(bufs["kv_len_arr"], torch.full((B,), L, **i32))
    assert w._plan["indices"].data_ptr() == bufs["kv_indices"].data_ptr()
    w.plan(**_plan_args(B, 7, PS, H))
    assert w._plan["work"].data_ptr() == work0
    assert torch.equal(bufs["kv_len_arr"], torch.full((B,), 7, **i32))
    with pytest.raises(ValueError, match="batch size should be fixed"):
        w.plan(**_plan_args(B + 1, L, PS, H))
    with pytest.raises(ValueError, match="num_heads"):
        w.plan(**_plan_args(B, L, PS, 16))
    with pytest.raises(ValueError, match="sm_scale"):
        w.plan(**dict(_plan_args(B, L, PS, H), sm_scale=0.2))


# ---------------------------------------------------------------------------------------------- planning
def test_plan_mla_columns_and_splits():
    qo = torch.tensor([1, 1, 1])
    kv = torch.tensor([4096, 0, 10])
    qs = torch.tensor([0, 1, 2])
    po = torch.tensor([0, 4096, 4096])
    wp = plan_mla(qo, kv, qs, po, num_heads=128, page_size=1, num_sms=132, ctas_per_sm=1)
    assert wp.work.shape[1] == MLA_WORK_COLS and wp.row_tiles == 8 and wp.rows == 128
    rows = wp.work[: wp.num_work]
    assert rows[:, 0].tolist().count(0) > 1  # the long request is split (3 requests cannot fill 132 SMs)
    for r in rows.tolist():
        assert r[W_Q_START] == qs[r[0]] and r[W_QO_LEN] == 1
    for b, L in enumerate(kv.tolist()):  # each request's pieces cover [0, kv_len) exactly
        pieces = sorted((r[1], r[2]) for r in rows.tolist() if r[0] == b)
        assert pieces[0][0] == 0 and pieces[-1][1] == L
        assert all(a[1] == c[0] for a, c in zip(pieces, pieces[1:]))
    one = plan_mla(qo, kv, qs, po, num_heads=16, page_size=1, disable_split_kv=True)
    assert one.num_work == 3 and one.num_partials == 0 and one.row_tiles == 1


def test_plan_mla_multirow_tiles_and_padding():
    wp = plan_mla(torch.tensor([2, 3]), torch.tensor([8, 9]), torch.tensor([0, 2]), torch.tensor([0, 8]),
                  num_heads=16, page_size=4, num_rows=40, disable_split_kv=True)
    assert wp.row_tiles == 3 and wp.rows == 48  # 3 query tokens x 16 heads
    assert wp.work.shape == (40, MLA_WORK_COLS) and (wp.work[wp.num_work:, 0] == -1).all()
    with pytest.raises(ValueError, match="row tiles"):
        plan_mla(torch.tensor([4]), torch.tensor([8]), torch.tensor([0]), torch.tensor([0]), num_heads=16,
                 page_size=4, fixed_row_tiles=3)


def _batch(B, H, PS, max_q, seed):
    """A random batch's ``(qo_lens, kv_lens, q_starts, page_offsets)`` (CPU int64)."""
    g = torch.Generator().manual_seed(seed)
    qo = torch.randint(1, max_q + 1, (B,), generator=g)
    kv = torch.tensor([0, 1, 63, 100, 777, 4096, 20000])[torch.randint(0, 7, (B,), generator=g)]
    pages = (kv + PS - 1) // PS
    return qo, kv, torch.cumsum(qo, 0) - qo, torch.cumsum(pages, 0) - pages


PLAN_GRID = [(B, H, PS, max_q, sms, cps) for B in (1, 3, 37) for H in (8, 16, 64, 128) for PS in (1, 64)
             for max_q in (1, 4) for sms, cps in ((132, 1), (132, 4), (78, 2))]


def _same_plan(a, b):
    return torch.equal(a.work, b.work) and all(getattr(a, f) == getattr(b, f) for f in
                                               ("num_work", "num_partials", "split_tokens", "row_tiles", "rows"))


def test_plan_mla_16_row_tiles_plan_the_16_row_tiles():
    """The default ``tile_m`` (16, the portable kernel's) plans the table of the paged-decode planner with one
    "kv head" per 16-row tile, plus each item's q_start / qo_len: the portable kernel's plans."""
    for i, (B, H, PS, max_q, sms, cps) in enumerate(PLAN_GRID):
        qo, kv, qs, po = _batch(B, H, PS, max_q, seed=i)
        for dis in (False, True):
            kw = dict(num_heads=H, page_size=PS, num_sms=sms, ctas_per_sm=cps, disable_split_kv=dis)
            wp = plan_mla(qo, kv, qs, po, **kw)
            assert _same_plan(wp, plan_mla(qo, kv, qs, po, tile_m=16, **kw))
            rt = row_tiles(int(qo.max()), H)
            ref_plan = plan_paged_decode(kv, po, num_kv_heads=rt, page_size=PS, num_sms=sms, ctas_per_sm=cps,
                                         disable_split_kv=dis)
            assert torch.equal(wp.work[:, :WORK_COLS], ref_plan.work), (B, H, PS, max_q, sms, cps, dis)
            assert (wp.num_work, wp.num_partials, wp.split_tokens) == (
                ref_plan.num_work, ref_plan.num_partials, ref_plan.split_tokens)
            assert wp.row_tiles == rt and wp.rows == 16 * rt
            b = wp.work[:, 0].long()
            assert torch.equal(wp.work[:, W_Q_START].long(), qs[b]) and torch.equal(wp.work[:, W_QO_LEN].long(), qo[b])


def test_plan_mla_tile_m_counts_the_kernels_ctas():
    """``tile_m`` 64 (the SM90 kernel's) splits as if each work item were ``ceil(rows / 64)`` CTAs: where the
    rows are whole 64-row tiles that is the 16-row plan over 4x the CTA slots (the same plan), and below 64 rows
    a work item is one CTA, not four, so it splits less; the table and its 16-row units are unchanged."""
    for i, (B, H, PS, max_q, sms, cps) in enumerate(PLAN_GRID):
        qo, kv, qs, po = _batch(B, H, PS, max_q, seed=100 + i)
        kw = dict(num_heads=H, page_size=PS, num_sms=sms)
        wp = plan_mla(qo, kv, qs, po, ctas_per_sm=cps, tile_m=64, **kw)
        rt = row_tiles(int(qo.max()), H)
        ref_plan = plan_paged_decode(kv, po, num_kv_heads=-(-rt // 4), page_size=PS, num_sms=sms, ctas_per_sm=cps)
        assert torch.equal(wp.work[:, :WORK_COLS], ref_plan.work) and wp.split_tokens == ref_plan.split_tokens
        assert wp.row_tiles == rt and wp.rows == 16 * rt and kernel_row_tiles(rt, 64) == -(-rt // 4)
        if rt % 4 == 0:  # whole 64-row tiles
            assert _same_plan(wp, plan_mla(qo, kv, qs, po, ctas_per_sm=4 * cps, **kw))
    # 8 requests of 16 heads on 132 SMs: one 64-row CTA per piece, so the split fills one wave of 132 CTAs
    # (counting four 16-row tiles per SM would fill 4 x 132 slots with those CTAs)
    qo, kv = torch.ones(8, dtype=torch.int64), torch.full((8,), 8192)
    qs, po = torch.arange(8), torch.arange(8) * 128
    sm90 = plan_mla(qo, kv, qs, po, num_heads=16, page_size=64, num_sms=132, ctas_per_sm=1, tile_m=64)
    x4 = plan_mla(qo, kv, qs, po, num_heads=16, page_size=64, num_sms=132, ctas_per_sm=4)
    assert 66 < sm90.num_work <= 132 < x4.num_work


@pytest.mark.parametrize("tile_m", [16, 64])
def test_max_work_rows_bounds_the_plan(tile_m):
    for i, (B, H, PS, max_q, sms, cps) in enumerate(PLAN_GRID):
        qo, kv, qs, po = _batch(B, H, PS, max_q, seed=200 + i)
        rt = row_tiles(max_q, H)  # the CUDA-graph plan's fixed extent: the batch's longest possible request
        n = max_work_rows(B, rt, num_sms=sms, ctas_per_sm=cps, tile_m=tile_m)
        wp = plan_mla(qo, kv, qs, po, num_heads=H, page_size=PS, num_sms=sms, ctas_per_sm=cps, tile_m=tile_m,
                      num_rows=n, fixed_row_tiles=rt)
        assert wp.work.shape == (n, MLA_WORK_COLS) and wp.num_work <= n and wp.row_tiles == rt


@pytest.mark.parametrize("tile_m, exc", [(0, ValueError), (-64, ValueError), (24, ValueError), (8, ValueError),
                                         (64.0, TypeError), (True, TypeError), ("64", TypeError)])
def test_plan_mla_tile_m_errors(tile_m, exc):
    qo, kv, qs, po = _batch(2, 16, 64, 1, seed=0)
    with pytest.raises(exc, match="tile_m"):
        plan_mla(qo, kv, qs, po, num_heads=16, page_size=64, tile_m=tile_m)
    with pytest.raises(exc, match="tile_m"):
        max_work_rows(2, 1, num_sms=132, ctas_per_sm=1, tile_m=tile_m)


def test_mla_limits_name_the_kernels_tile():
    """dispatch.mla_limits gives the planner each kernel's own CTAs per SM and query rows per CTA."""
    from cutedsl_attn import dispatch as d
    from cutedsl_attn.sm90 import mla as mla90

    p = MlaProblem(dtype="bfloat16", page_size=64)
    cfg = md.Config(p, md.default_tiles(p, num_sms=132))
    lim = d.mla_limits(md, cfg)
    assert lim["tile_m"] == 16 and lim["ctas_per_sm"] == max(1, 228 * 1024 // (cfg.smem_bytes + 1024))
    cfg90 = mla90.Config(p, mla90.Tiles())
    lim90 = d.mla_limits(mla90, cfg90)
    assert lim90["tile_m"] == 64 and lim90["ctas_per_sm"] == 1  # one 64-row CTA per SM by shared memory
    assert lim90["max_splits_per_request"] == cfg90.max_splits_per_request


# ---------------------------------------------------------------------------------------------- wave-filling split
def _check_wave_plan(wp, kv, po, *, budget, min_tokens, max_splits):
    """Every request's pieces cover [0, kv_len) once, in whole 64-token blocks of at least min_tokens / 64, with
    consistent split columns; the grid stays within the CTA budget (or one item per request)."""
    rows = wp.work[: wp.num_work].tolist()
    assert (wp.work[wp.num_work:, 0] == -1).all()
    assert [r[2] - r[1] for r in rows] == sorted((r[2] - r[1] for r in rows), reverse=True)  # longest first
    parts = []
    for b, L in enumerate(kv.tolist()):
        mine = sorted((r for r in rows if r[0] == b), key=lambda r: r[1])
        n = len(mine)
        assert mine[0][1] == 0 and mine[-1][2] == L and all(a[2] == c[1] for a, c in zip(mine, mine[1:]))
        assert all(r[3] == L and r[4] == po[b] and r[5] == n for r in mine)
        if n == 1:
            assert mine[0][7] == 0
            continue
        assert n <= max_splits and [r[7] for r in mine] == list(range(n))
        assert all(r[6] == mine[0][6] for r in mine)
        parts += [mine[0][6] + i for i in range(n)]
        for r in mine:  # non-empty, whole blocks (a request's last block may be partial), min_tokens / 64 of them
            assert r[2] > r[1] and r[1] % 64 == 0 and -(-(r[2] - r[1]) // 64) >= min_tokens // 64
        assert wp.split_tokens >= max(r[2] - r[1] for r in mine)
    assert sorted(parts) == list(range(wp.num_partials))
    assert wp.num_work <= max(len(kv), budget)  # the grid: k_tiles x num_work CTAs within the waves asked for


WAVE_SPLITS = [MlaSplit(waves, m) for waves in (0.5, 1, 2, 4) for m in (64, 128, 256)]


@pytest.mark.parametrize("tile_m", [16, 64])
def test_wave_split_pieces_cover_each_request_once(tile_m):
    for i, (B, H, PS, max_q, sms, cps) in enumerate(PLAN_GRID[::3]):
        qo, kv, qs, po = _batch(B, H, PS, max_q, seed=300 + i)
        kt = kernel_row_tiles(row_tiles(int(qo.max()), H), tile_m)
        for sp in WAVE_SPLITS:
            budget = int(sp.waves * sms * cps) // kt
            for cap in (576, 3):
                wp = plan_mla(qo, kv, qs, po, num_heads=H, page_size=PS, num_sms=sms, ctas_per_sm=cps,
                              tile_m=tile_m, split=sp, max_splits_per_request=cap)
                _check_wave_plan(wp, kv, po.tolist(), budget=budget, min_tokens=sp.min_tokens, max_splits=cap)
                b = wp.work[:, 0].long().clamp(min=0)
                assert torch.equal(wp.work[: wp.num_work, W_Q_START].long(), qs[b][: wp.num_work])
            # CUDA-graph mode: max_work_rows bounds the table of the same split
            n = max_work_rows(B, row_tiles(max_q, H), num_sms=sms, ctas_per_sm=cps, tile_m=tile_m, split=sp)
            wp = plan_mla(qo, kv, qs, po, num_heads=H, page_size=PS, num_sms=sms, ctas_per_sm=cps, tile_m=tile_m,
                          split=sp, num_rows=n, fixed_row_tiles=row_tiles(max_q, H), max_splits_per_request=576)
            assert wp.work.shape[0] == n


def test_wave_split_row_d_fills_the_waves():
    """Row (d) of perf/bench_mla.py: one request of 32768 tokens, 128 heads, 132 SMs.  The SM90 kernel (one 64-row
    CTA per SM, 2 of them per work item) gets 64 / 128 / 256 pieces for 1 / 2 / 4 waves (33 for half a wave rounds
    to 32 pieces of 1024), the portable one (16-row tiles: 8 a work item) a quarter of those; waves 0 is the
    modelled plan (64 pieces of 512 on the SM90 kernel)."""
    one = (torch.tensor([1]), torch.tensor([32768]), torch.tensor([0]), torch.tensor([0]))
    kw = dict(num_heads=128, page_size=64, num_sms=132, ctas_per_sm=1)
    for tile_m, want in ((64, {0.5: 32, 1: 64, 2: 128, 4: 256}), (16, {1: 16, 2: 32, 4: 64, 8: 128})):
        base = plan_mla(*one, tile_m=tile_m, **kw)
        assert _same_plan(base, plan_mla(*one, tile_m=tile_m, split=MlaSplit(), **kw))
        for waves, n in want.items():
            wp = plan_mla(*one, tile_m=tile_m, split=MlaSplit(waves), max_splits_per_request=576, **kw)
            assert wp.num_work == wp.num_partials == n and wp.split_tokens == 32768 // n, (tile_m, waves)
            assert (wp.work[:, 2] - wp.work[:, 1] == 32768 // n).all()
            assert kernel_row_tiles(8, tile_m) * n <= waves * 132
    assert plan_mla(*one, tile_m=64, **kw).num_work == 64
    # the shortest pieces: 256 tokens (128 pieces) at 4 waves; the kernel's merge limit caps the count
    assert plan_mla(*one, tile_m=64, split=MlaSplit(4, 256), **kw).num_work == 128
    assert plan_mla(*one, tile_m=64, split=MlaSplit(4), max_splits_per_request=100, **kw).num_work == 100
    assert plan_mla(*one, tile_m=64, split=MlaSplit(4), disable_split_kv=True, **kw).num_work == 1


def test_wave_split_counts_are_the_fewest_blocks_that_fit():
    """wave_split_counts' bisection against a linear scan over the piece length in blocks; even_pieces' cuts."""
    from cutedsl_attn.planning.mla import even_pieces, wave_split_counts

    g = torch.Generator().manual_seed(7)
    for _ in range(100):
        B = int(torch.randint(1, 6, (1,), generator=g))
        lens = torch.randint(0, 40000, (B,), generator=g).tolist()
        budget = int(torch.randint(1, 300, (1,), generator=g))
        minb = int(torch.randint(1, 5, (1,), generator=g))
        nbs = [-(-L // 64) for L in lens]

        def scan(pb):
            return [max(1, min(-(-nb // pb), nb // minb)) for nb in nbs]

        want = [1] * B if budget <= B else scan(next(pb for pb in range(minb, 10**6) if sum(scan(pb)) <= budget))
        c = wave_split_counts(lens, budget, 64 * minb, None)
        assert c == want and sum(c) <= max(B, budget)
        for L, n in zip(lens, c):
            p = even_pieces(L, n)
            assert sum(p) == L and len(p) == n and (n == 1 or min(p) > 0)
            assert max(-(-x // 64) for x in p) - min(-(-x // 64) for x in p) <= 1  # even to one block
    assert wave_split_counts([], 10, 128, None) == [] and wave_split_counts([5000, 9000], 2, 128, None) == [1, 1]
    with pytest.raises(ValueError, match="non-empty pieces"):
        even_pieces(100, 3)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(waves=-1), ValueError, "split_waves"), (dict(waves=float("nan")), ValueError, "split_waves"),
    (dict(waves=float("inf")), ValueError, "split_waves"), (dict(waves=True), TypeError, "split_waves"),
    (dict(waves="2"), TypeError, "split_waves"), (dict(min_tokens=100), ValueError, "split_min_tokens"),
    (dict(min_tokens=0), ValueError, "split_min_tokens"), (dict(min_tokens=128.0), TypeError, "split_min_tokens"),
    (dict(min_tokens=False), TypeError, "split_min_tokens")])
def test_split_errors(kw, exc, match):
    with pytest.raises(exc, match=match):
        MlaSplit(**kw)


def test_split_knob_through_dispatch_and_the_wrapper(cross, monkeypatch):
    from cutedsl_attn import dispatch as d
    from cutedsl_attn.sm90 import mla as mla90

    assert MlaSplit(2) == MlaSplit(2.0) and MlaSplit.from_items({"split_waves": "2", "x": "1"}) == MlaSplit(2)
    with pytest.raises(TypeError, match="split must be an MlaSplit"):
        plan_mla(*(torch.tensor([1]),) * 2, torch.tensor([0]), torch.tensor([0]), num_heads=8, page_size=1,
                 split=2)
    p = MlaProblem("bfloat16", 64)
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_KERNEL", "sm90")
    monkeypatch.setenv(d.MLA_TUNE_ENV, "split_waves=2")  # a plan key: the tiles (and the compile key) stay
    m, cfg = d.mla_choice(p)
    assert cfg.tiles == mla90.default_tiles(p, num_sms=132) and d.mla_limits(m, cfg)["split"] == MlaSplit(2)
    monkeypatch.setenv(d.MLA_TUNE_ENV, "merge_kernel=0,split_waves=0.5,split_min_tokens=256")
    m, cfg = d.mla_choice(p)
    assert cfg.tiles.merge_kernel == 0 and d.mla_limits(m, cfg)["split"] == MlaSplit(0.5, 256)
    for bad in ("split_waves=-1", "split_waves=two", "split_min_tokens=96", "split_min_tokens=1.5"):
        monkeypatch.setenv(d.MLA_TUNE_ENV, bad)
        with pytest.raises(ValueError, match="CUTEDSL_ATTN_MLA_TUNE"):
            d.mla_limits(m, cfg)
    monkeypatch.delenv(d.MLA_TUNE_ENV)
    from cutedsl_attn.dispatch.mla import DEFAULT_SPLIT

    assert d.mla_limits(m, cfg)["split"] == DEFAULT_SPLIT == MlaSplit()
    # the wrapper: the split reaches the plan, the workspace is checked against its partials, and a CUDA-graph
    # re-plan must keep it (the fixed table is sized by it)
    B, L, PS, H = 1, 32768, 64, 128
    args = _plan_args(B, L, PS, H)
    i32 = dict(dtype=torch.int32)
    bufs = dict(qo_indptr=torch.zeros(B + 1, **i32), kv_indptr=torch.zeros(B + 1, **i32),
                kv_indices=torch.zeros(512, **i32), kv_len_arr=torch.zeros(B, **i32))
    for waves, pieces in ((0, 64), (4, 256)):
        monkeypatch.setenv(d.MLA_TUNE_ENV, f"split_waves={waves}")
        w = api.BatchMLAPagedAttentionWrapper(torch.empty(256 << 20, dtype=torch.int8))
        w.plan(**args)
        assert w._plan["num_work"] == pieces and w._plan["part_o"].shape == (pieces, H, DC)
        need = pieces * H * (DC + 1) * 4
        with pytest.raises(ValueError, match=f"float_workspace_buffer holds .* needs {need} "):
            api.BatchMLAPagedAttentionWrapper(torch.empty(need - 4, dtype=torch.int8)).plan(**args)
        g = api.BatchMLAPagedAttentionWrapper(torch.empty(256 << 20, dtype=torch.int8), use_cuda_graph=True, **bufs)
        g.plan(**args)
        rows = max_work_rows(B, 8, num_sms=132, ctas_per_sm=1, tile_m=64, split=MlaSplit(waves))
        assert g._plan["num_work"] == pieces and g._plan["work"].shape[0] == rows >= pieces
        monkeypatch.setenv(d.MLA_TUNE_ENV, f"split_waves={waves + 1}")
        with pytest.raises(ValueError, match="split"):
            g.plan(**args)


def test_problem_and_tiles_errors():
    with pytest.raises(NotImplementedError, match="head_dim_ckv=512"):
        MlaProblem("bfloat16", 1, head_dim_ckv=256)
    with pytest.raises(ValueError, match="page_size"):
        MlaProblem("bfloat16", 65)
    with pytest.raises(ValueError, match="dtype"):
        MlaProblem("float32", 1)
    with pytest.raises(ValueError, match="tile_n"):
        md.Tiles(tile_n=64)
    with pytest.raises(ValueError, match="num_warps"):
        md.Tiles(num_warps=8)
    with pytest.raises(ValueError, match="shared memory"):
        md.Config(MlaProblem("bfloat16", 1), md.Tiles(tile_n=32, num_stages=6))
    assert md.unsupported_reason(MlaProblem("bfloat16", 1, arch="sm_80")) is not None


# ---------------------------------------------------------------------------------------------- PTX
@pytest.mark.parametrize("arch,dtype,page_size,causal,tiles", [
    ("sm_90a", "bfloat16", 1, False, md.Tiles()),
    ("sm_100a", "bfloat16", 64, False, md.Tiles()),
    ("sm_90a", "float16", 16, True, md.Tiles(tile_n=16, num_stages=4)),
])
def test_ptx_and_resources(tmp_path, arch, dtype, page_size, causal, tiles):
    from cutedsl_attn.inspect import cubin_resources

    cfg = md.Config(MlaProblem(dtype, page_size, causal=causal, arch=arch), tiles)
    md.compile(cfg, keep_ptx_dir=str(tmp_path), keep_cubin=True)
    ptx = open(glob.glob(str(tmp_path / "*.ptx"))[0]).read()
    cubin = open(glob.glob(str(tmp_path / "*.cubin"))[0], "rb").read()
    ab = "bf16" if dtype == "bfloat16" else "f16"
    # S: 9 k16 steps x tile_n/8 n8 tiles; P V: tile_n/16 k16 steps x 16 n8 tiles of the warp's 128 columns
    n_mma = 9 * (tiles.tile_n // 8) + (tiles.tile_n // 16) * 16
    assert ptx.count(f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32") == n_mma
    assert "cp.async.cg.shared.global" in ptx and "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
    assert ".local" not in ptx and "wgmma" not in ptx and "tcgen05" not in ptx
    assert "mul.wide.s32" in ptx or "mul.lo.s64" in ptx  # 64-bit page offsets
    res = cubin_resources(cubin)
    assert res["stack_bytes"] == 0, res
    assert res["registers"] <= 255, res


def test_tuning_hook(monkeypatch):
    from cutedsl_attn import dispatch as d

    monkeypatch.setenv("CUTEDSL_ATTN_MLA_KERNEL", "portable")  # the portable kernel's tuning (sm_90a: SM90's)
    pb = MlaProblem("bfloat16", 16)
    assert d.mla_choice(pb)[1].tiles == md.default_tiles(pb, num_sms=132)
    monkeypatch.setenv(d.MLA_TUNE_ENV, "tile_n=16,num_stages=4")
    assert d.mla_choice(pb)[1].tiles == md.Tiles(tile_n=16, num_stages=4)
    monkeypatch.setenv(d.MLA_TUNE_ENV, "tile_n=64")
    with pytest.raises(ValueError, match="CUTEDSL_ATTN_MLA_TUNE"):
        d.mla_choice(pb)
    monkeypatch.setenv(d.MLA_TUNE_ENV, "warps")
    with pytest.raises(ValueError, match="key=value"):
        d.mla_choice(pb)


def test_custom_op_registered_with_its_mutations():
    # under torch.compile the MLA launch is cutedsl_attn::mla_decode_portable; the schema names what it writes
    from cutedsl_attn import dispatch  # noqa: F401  (registers the op)

    schema = torch.ops.cutedsl_attn.mla_decode_portable.default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"out", "lse", "part_o", "part_lse", "counters"}


def test_launch_traces_as_the_custom_op(monkeypatch):
    # under torch.compile(fullgraph=True) the launch is the custom op (its fake for tracing), run for real after
    from cutedsl_attn.dispatch import mla as d
    from cutedsl_attn.planning.mla import MlaArgs

    seen = []
    monkeypatch.setattr(d, "_mla_launch_direct", lambda module, cfg, args: (seen.append(args.output_scale),
                                                                             args.out.fill_(1.0)))
    pb = MlaProblem("bfloat16", 16)
    module, cfg = d.mla_choice(pb)
    t = lambda *s: torch.zeros(*s)  # noqa: E731

    def f(out):
        args = MlaArgs(t(2, 16, 512), t(2, 16, 64), t(4, 16, 512), t(4, 16, 64), torch.zeros(4, dtype=torch.int32),
                       torch.zeros(2, 8, dtype=torch.int32), out, t(2, 16), t(1, 16, 512), t(1, 16),
                       torch.zeros(2, dtype=torch.int32), 0.1, 1, 0.5)
        d.mla_launch(module, cfg, args)
        return out * 2

    torch._dynamo.reset()
    r = torch.compile(f, backend="aot_eager", fullgraph=True)(torch.zeros(2, 16, 512))
    assert seen == [0.5] and torch.equal(r, torch.full((2, 16, 512), 2.0))



def test_numpy_scalars_are_real_numbers():
    """A numpy float passes every check a Python float passes (MLA's sm_scale; bools stay refused)."""
    import numpy as np

    from cutedsl_attn.api import mla

    def plan(scale):
        w = mla.BatchMLAPagedAttentionWrapper(torch.empty(8, dtype=torch.uint8))
        i32 = dict(dtype=torch.int32)
        return w.plan(torch.tensor([0, 1], **i32), torch.tensor([0, 1], **i32), torch.tensor([0], **i32),
                      torch.tensor([1], **i32), 16, 512, 64, 1, False, scale, torch.bfloat16, torch.bfloat16)

    for bad in (True, np.float32("nan"), "0.1"):
        with pytest.raises(ValueError, match="sm_scale"):
            plan(bad)
    try:
        plan(np.float32(0.1))
    except Exception as e:  # noqa: BLE001 -- a later check (no GPU here) may stop it, never the scale's
        assert "sm_scale" not in str(e), e
