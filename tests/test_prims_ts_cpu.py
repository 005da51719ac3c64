"""CPU tests of the prims_ts decode entry points (no GPU, no kernel compile).

* ``batch_decode_with_paged_kv_cache`` and ``BatchDecodePagedTSWrapper`` signatures against the seed (names,
  order, keyword-only split, defaults; FlashInfer 0.7.4's extra keywords after the seed's);
* every validation error, raised before anything launches;
* what a valid call hands to the kernel (recorded through ``_kernel_stubs``): which kernel (decode for one row,
  prefill for more; causal only for ``mask_type="causal"``), the softmax and output scales, the page table the
  kernel reads (a row-strided caller table copied into the plan's buffer), the runtime lengths written into the
  work table on the device, the length-ownership rule.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from cutedsl_attn.attention import prims_ts as ts
from cutedsl_attn.planning import decode as pd
from cutedsl_attn.planning import prefill as pp


BF16, FP16 = torch.bfloat16, torch.float16
E = inspect.Parameter.empty
P_, K_ = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY

SEED_ONE_SHOT = [
    ("q", P_, E), ("paged_kv_cache", P_, E), ("block_tables", P_, E), ("seq_lens_kv", P_, E),
    ("seq_len_q", K_, 1), ("qo_indptr", K_, None), ("max_seq_len_q", K_, None), ("mask_type", K_, "dense"),
    ("window_left", K_, -1), ("kv_layout", K_, "HND"), ("bmm1_scale", K_, None), ("bmm2_scale", K_, 1.0),
    ("out", K_, None), ("out_dtype", K_, None),
]
EXTRAS = ["kv_scale_factors", "page_size", "split_kv", "workspace_buffer", "max_kv_len", "validate"]
SEED_PLAN = ["self", "device", "batch_size", "num_qo_heads", "num_kv_heads", "head_dim", "page_size", "max_kv_len"]
SEED_PLAN_KW = dict(max_seq_len_q=1, packed_query=False, q_data_type=torch.float16, k_data_type=None,
                    v_data_type=None, kv_data_type=None, o_data_type=None, mask_type="dense", window_left=-1,
                    seq_lens=None, workspace_buffer=None, storage_page_size=None, split_kv=True, validate=True,
                    initialize_workspace=True)
SEED_RUN = ["self", "q", "paged_kv_cache", "seq_lens", "block_tables"]
SEED_RUN_KW = dict(kv_scale_factors=None, qo_indptr=None, bmm1_scale=None, bmm2_scale=1.0, out=None, validate=True)


pytestmark = pytest.mark.usefixtures("cross_compile_sm90")  # tests/conftest.py


def test_one_shot_signature_matches_seed():
    ps = list(inspect.signature(ts.batch_decode_with_paged_kv_cache).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ps[:len(SEED_ONE_SHOT)]] == SEED_ONE_SHOT
    assert [p.name for p in ps[len(SEED_ONE_SHOT):]] == EXTRAS
    assert all(p.kind == K_ for p in ps[len(SEED_ONE_SHOT):])


def test_wrapper_signatures_match_seed():
    assert list(inspect.signature(ts.BatchDecodePagedTSWrapper).parameters) == ["kv_layout"]
    assert inspect.signature(ts.BatchDecodePagedTSWrapper).parameters["kv_layout"].default == "HND"
    for fn, pos, kw in ((ts.BatchDecodePagedTSWrapper.plan, SEED_PLAN, SEED_PLAN_KW),
                        (ts.BatchDecodePagedTSWrapper.run, SEED_RUN, SEED_RUN_KW)):
        ps = inspect.signature(fn).parameters.values()
        assert [p.name for p in ps if p.kind == P_] == pos
        assert {p.name: p.default for p in ps if p.kind == K_} == kw


def test_package_path_is_flashinfers():
    import cutedsl_attn.attention as att

    assert att.prims_ts.batch_decode_with_paged_kv_cache is ts.batch_decode_with_paged_kv_cache
    assert att.BatchDecodePagedTSWrapper is ts.BatchDecodePagedTSWrapper


# ============================================================================= a problem
def problem(B=3, hq=8, hkv=2, d=64, ps=16, lens=(5, 100, 37), width=8, pitch=None, dtype=BF16, sq=1, seed=0,
            combined=True):
    """HND cache, a row-strided ``[B, width]`` table (row stride ``pitch``), q in the seed's shapes."""
    g = torch.Generator().manual_seed(seed)
    pages = B * width + 2
    cache = torch.randn(pages, 2, hkv, ps, d, generator=g).to(dtype)
    pitch = pitch or width
    store = torch.randperm(B * pitch + 4, generator=g).to(torch.int32) % pages
    table = store[:B * pitch].view(B, pitch)[:, :width]
    q = torch.randn((B, hq, d) if sq == 1 else (B, sq, hq, d), generator=g).to(dtype)
    return dict(cache=cache if combined else tuple(cache.unbind(1)), table=table, q=q,
                lens=torch.tensor(lens, dtype=torch.int32), B=B, hq=hq, hkv=hkv, d=d, ps=ps)


def call(p, **kw):
    return ts.batch_decode_with_paged_kv_cache(p["q"], p["cache"], p["table"], p["lens"], **kw)


# ============================================================================= routing and scales
def test_one_row_runs_the_decode_kernel_with_the_scales(rec):
    p = problem(pitch=11)
    out = call(p, bmm1_scale=0.3, bmm2_scale=0.5)
    cfg, args = rec.last
    assert cfg.name == "paged_decode" and out.shape == (3, 8, 64)
    assert math.isclose(args["sm_scale"], 0.3, rel_tol=1e-6) and args["output_scale"] == 0.5
    assert (out == 0.5).all()  # the stub writes output_scale: the output is the kernel's
    flat = args["indices"].view(3, -1)  # ceil(max seq_len / page_size) = 7 columns are read
    assert flat.shape == (3, 7) and torch.equal(flat, p["table"][:, :7])  # the row-strided table, row by row
    work = args["work"]
    live = work[work[:, pd.W_BATCH] >= 0]
    assert sorted(set(live[:, pd.W_BATCH].tolist())) == [0, 1, 2]
    for b, L in enumerate([5, 100, 37]):
        rows = live[live[:, pd.W_BATCH] == b]
        assert int(rows[:, pd.W_KV_LEN].max()) == L


def test_default_bmm1_scale_is_inv_sqrt_d(rec):
    call(problem())
    assert math.isclose(rec.last[1]["sm_scale"], 1 / math.sqrt(64), rel_tol=1e-6)
    assert rec.last[1]["output_scale"] == 1.0


@pytest.mark.parametrize("mask", ["dense", "causal"])
def test_fixed_rows_run_the_prefill_kernel_token_major(rec, mask):
    p = problem(sq=4)
    out = call(p, seq_len_q=4, mask_type=mask, bmm2_scale=2.0)
    cfg, args = rec.last
    assert cfg.name.startswith("prefill_") and cfg.causal == (mask == "causal")
    assert out.shape == (3, 4, 8, 64) and (out == 2.0).all()
    assert args["q"].shape == (12, 8, 64) and args["q"].data_ptr() == p["q"].data_ptr()  # a view, no transpose
    work = args["work"]
    live = work[work[:, pp.W_BATCH] >= 0]
    assert (live[:, pp.W_QO_LEN] == 4).all()
    assert sorted(set(live[:, pp.W_KV_LEN].tolist())) == [5, 37, 100]


def test_packed_rows_and_the_derived_capacity(rec):
    p = problem()
    q = torch.randn(6, 8, 64).to(BF16)
    qo = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    out = ts.batch_decode_with_paged_kv_cache(q, p["cache"], p["table"], p["lens"], qo_indptr=qo,
                                              mask_type="causal", window_left=3)
    cfg, args = rec.last
    assert out.shape == (6, 8, 64) and cfg.causal and args["window_left"] == 3
    live = args["work"][args["work"][:, pp.W_BATCH] >= 0]
    got = {int(r[pp.W_BATCH]): (int(r[pp.W_QO_LEN]), int(r[pp.W_Q_START])) for r in live}
    assert got == {0: (2, 0), 1: (3, 2), 2: (1, 5)}
    # seq_len_q as an alias of max_seq_len_q
    ts.batch_decode_with_paged_kv_cache(q, p["cache"], p["table"], p["lens"], qo_indptr=qo, seq_len_q=3)
    ts.batch_decode_with_paged_kv_cache(q, p["cache"], p["table"], p["lens"], qo_indptr=qo, seq_len_q=4,
                                        max_seq_len_q=4)


def test_separate_kv_and_out_buffers(rec):
    p = problem(combined=False)
    out = torch.full((3, 8, 64), float("nan"), dtype=BF16)
    r = call(p, out=out, out_dtype=BF16)
    assert r is out and (out == 1.0).all()
    p4 = problem(sq=2, combined=False)
    out4 = torch.empty(3, 2, 8, 64, dtype=BF16)
    assert call(p4, seq_len_q=2, out=out4) is out4


# ============================================================================= the wrapper
def test_wrapper_runtime_lengths_are_written_on_the_device(rec):
    p = problem()
    w = ts.BatchDecodePagedTSWrapper()
    w.plan("cpu", 3, 8, 2, 64, 16, 128, q_data_type=BF16)
    with pytest.raises(ValueError, match="needs the runtime seq_lens"):
        w.run(p["q"], p["cache"], None, p["table"])
    w.run(p["q"], p["cache"], p["lens"], p["table"])
    work = rec.last[1]["work"]
    live = work[work[:, pd.W_BATCH] >= 0]
    assert len(live) == 3 and (live[:, pd.W_NUM_SPLITS] == 1).all()  # one item per request
    got = {int(r[pd.W_BATCH]): (int(r[pd.W_TOK_START]), int(r[pd.W_TOK_END]), int(r[pd.W_KV_LEN])) for r in live}
    assert got == {0: (0, 5, 5), 1: (0, 100, 100), 2: (0, 37, 37)}
    new = torch.tensor([1, 128, 0], dtype=torch.int32)
    w.run(p["q"], p["cache"], new, p["table"])
    live = work[work[:, pd.W_BATCH] >= 0]
    got = {int(r[pd.W_BATCH]): int(r[pd.W_KV_LEN]) for r in live}
    assert got == {0: 1, 1: 128, 2: 0} and rec.last[1]["work"].data_ptr() == work.data_ptr()
    pad = work[work[:, pd.W_BATCH] < 0]
    assert (pad[:, pd.W_TOK_END] == 0).all()


def test_wrapper_runtime_lengths_with_a_window(rec):
    p = problem()
    w = ts.BatchDecodePagedTSWrapper()
    w.plan("cpu", 3, 8, 2, 64, 16, 128, q_data_type=BF16, mask_type="causal", window_left=9)
    w.run(p["q"], p["cache"], p["lens"], p["table"])
    live = rec.last[1]["work"][rec.last[1]["work"][:, pd.W_BATCH] >= 0]
    got = {int(r[pd.W_BATCH]): (int(r[pd.W_TOK_START]), int(r[pd.W_TOK_END])) for r in live}
    assert got == {0: (0, 5), 1: (90, 100), 2: (27, 37)}


def test_wrapper_runtime_lengths_multirow(rec):
    p = problem(sq=2)
    w = ts.BatchDecodePagedTSWrapper()
    w.plan("cpu", 3, 8, 2, 64, 16, 128, max_seq_len_q=2, q_data_type=BF16)
    w.run(p["q"], p["cache"], p["lens"], p["table"])
    live = rec.last[1]["work"][rec.last[1]["work"][:, pp.W_BATCH] >= 0]
    assert {int(r[pp.W_BATCH]): int(r[pp.W_KV_LEN]) for r in live} == {0: 5, 1: 100, 2: 37}


def test_wrapper_fixed_lengths_and_the_ownership_rule(rec):
    p = problem()
    w = ts.BatchDecodePagedTSWrapper()
    w.plan("cpu", 3, 8, 2, 64, 16, 128, q_data_type=BF16, seq_lens=p["lens"])
    with pytest.raises(ValueError, match="must get seq_lens=None"):
        w.run(p["q"], p["cache"], p["lens"], p["table"])
    w.run(p["q"], p["cache"], None, p["table"])
    t2 = torch.flip(p["table"], [0]).contiguous()
    w.run(p["q"], p["cache"], None, t2)  # the new table's contents reach the kernel's buffer
    assert torch.equal(rec.last[1]["indices"].view(3, -1), t2)


def test_wrapper_packed_replans_only_when_rows_change(rec):
    p = problem()
    w = ts.BatchDecodePagedTSWrapper()
    w.plan("cpu", 3, 8, 2, 64, 16, 128, max_seq_len_q=3, packed_query=True, q_data_type=BF16, seq_lens=p["lens"])
    q = torch.randn(6, 8, 64).to(BF16)
    qo = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="needs qo_indptr"):
        w.run(q, p["cache"], None, p["table"])
    w.run(q, p["cache"], None, p["table"], qo_indptr=qo)
    work = rec.last[1]["work"]
    w.run(q, p["cache"], None, p["table"], qo_indptr=qo)
    assert rec.last[1]["work"].data_ptr() == work.data_ptr()
    with pytest.raises(ValueError, match="max_seq_len_q"):
        w.run(torch.randn(7, 8, 64).to(BF16), p["cache"], None, p["table"],
              qo_indptr=torch.tensor([0, 4, 6, 7], dtype=torch.int32))


# ============================================================================= validation
BAD_ONE_SHOT = [
    (dict(kv_layout="NHD"), NotImplementedError, "kv_layout='NHD' is not supported"),
    (dict(kv_layout="hnd"), ValueError, "kv_layout must be 'HND'"),
    (dict(mask_type="full"), ValueError, "mask_type must be one of"),
    (dict(window_left=4), ValueError, "requires mask_type='causal'"),
    (dict(window_left=-2), ValueError, "window_left must be >= -1"),
    (dict(bmm1_scale=0.0), ValueError, "bmm1_scale must be finite and > 0"),
    (dict(bmm1_scale=float("inf")), ValueError, "bmm1_scale must be finite"),
    (dict(bmm1_scale=1e39), ValueError, "not representable in float32"),
    (dict(bmm1_scale=torch.tensor(0.5)), TypeError, "bmm1_scale must be a Python float"),
    (dict(bmm2_scale=True), TypeError, "bmm2_scale must be a Python float"),
    (dict(bmm2_scale=-1.0), ValueError, "bmm2_scale must be finite and > 0"),
    (dict(out_dtype=FP16), NotImplementedError, "not supported"),
    (dict(out_dtype=torch.float8_e4m3fn), NotImplementedError, "float8"),
    (dict(out=torch.zeros(3, 8, 32, dtype=BF16)), ValueError, "out must have shape"),
    (dict(out=torch.zeros(3, 8, 64, dtype=BF16), out_dtype=FP16), ValueError, "out dtype"),
    (dict(seq_len_q=0), ValueError, "seq_len_q must be >= 1"),
    (dict(seq_len_q=2), ValueError, "q must be"),
    (dict(max_seq_len_q=2), ValueError, "must equal seq_len_q"),
    (dict(kv_scale_factors=torch.ones(2)), NotImplementedError, "kv_scale_factors"),
    (dict(page_size=8), ValueError, "page_size=8 differs"),
    (dict(max_kv_len=50), ValueError, "seq_lens_kv must lie in"),
]


@pytest.mark.parametrize("over,exc,match", BAD_ONE_SHOT, ids=[f"{i}-{b[2][:20]}" for i, b in enumerate(BAD_ONE_SHOT)])
def test_one_shot_validation(rec, over, exc, match):
    with pytest.raises(exc, match=match):
        call(problem(), **over)
    assert not rec.calls


def test_one_shot_validation_of_tables_lengths_and_caches(rec):
    p = problem()
    bad = [
        (dict(table=p["table"].long()), ValueError, "block_tables must be int32"),
        (dict(table=p["table"][:2]), ValueError, "block_tables must have 3 rows"),
        (dict(table=p["table"].t().contiguous().t()), ValueError, "each row of block_tables must be contiguous"),
        (dict(table=p["table"][:, :2]), ValueError, "seq_lens_kv must lie in"),
        (dict(lens=p["lens"].long()), ValueError, "seq_lens_kv must be int32"),
        (dict(lens=p["lens"][:2]), ValueError, r"seq_lens_kv must have shape \[3\]"),
        (dict(lens=torch.tensor([5, -1, 3], dtype=torch.int32)), ValueError, "seq_lens_kv must lie in"),
        (dict(cache=p["cache"][:, 0]), ValueError, "paged_kv_cache must be"),
        (dict(cache=(p["cache"][:, 0], p["cache"][:, 1, :, :8])), ValueError, "one shape"),
        (dict(cache=p["cache"].to(FP16)), NotImplementedError, "mixed dtypes"),
        (dict(q=p["q"].float()), NotImplementedError, "not supported"),
        (dict(q=p["q"][:, :, :32]), ValueError, "head_dim 32 differs"),
        (dict(q=p["q"][:, :7]), ValueError, "multiple of num_kv_heads"),
    ]
    for over, exc, match in bad:
        with pytest.raises(exc, match=match):
            call(dict(p, **over))
    with pytest.raises(ValueError, match="mask_type='causal' needs q_len <= kv_len"):
        call(problem(sq=8), seq_len_q=8, mask_type="causal")
    call(problem(sq=8), seq_len_q=8)  # dense rows need no such bound
    assert len(rec.calls) == 1


def test_packed_validation(rec):
    p = problem()
    q = torch.randn(6, 8, 64).to(BF16)
    f = ts.batch_decode_with_paged_kv_cache
    qo = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="alias of max_seq_len_q"):
        f(q, p["cache"], p["table"], p["lens"], qo_indptr=qo, seq_len_q=3, max_seq_len_q=4)
    with pytest.raises(ValueError, match="more than max_seq_len_q=2"):
        f(q, p["cache"], p["table"], p["lens"], qo_indptr=qo, max_seq_len_q=2)
    with pytest.raises(ValueError, match="qo_indptr must be int32"):
        f(q, p["cache"], p["table"], p["lens"], qo_indptr=qo.long())
    with pytest.raises(ValueError, match="non-decreasing"):
        f(q, p["cache"], p["table"], p["lens"], qo_indptr=torch.tensor([0, 3, 2, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"qo_indptr\[-1\]"):
        f(q[:5], p["cache"], p["table"], p["lens"], qo_indptr=qo)
    with pytest.raises(ValueError, match="causal"):
        f(torch.randn(9, 8, 64).to(BF16), p["cache"], p["table"], p["lens"], mask_type="causal",
          qo_indptr=torch.tensor([0, 6, 8, 9], dtype=torch.int32))
    assert not rec.calls


def test_wrapper_validation(rec):
    w = ts.BatchDecodePagedTSWrapper()
    with pytest.raises(RuntimeError, match="plan"):
        w.run(torch.zeros(3, 8, 64, dtype=BF16), problem()["cache"], None, problem()["table"])
    with pytest.raises(NotImplementedError, match="NHD"):
        ts.BatchDecodePagedTSWrapper("NHD")
    with pytest.raises(ValueError, match="kv_layout"):
        ts.BatchDecodePagedTSWrapper("XYZ")
    plan = lambda **kw: w.plan("cpu", *kw.pop("pos", (3, 8, 2, 64, 16, 128)), **kw)  # noqa: E731
    for kw, exc, match in [
        (dict(pos=(0, 8, 2, 64, 16, 128)), ValueError, "batch_size must be >= 1"),
        (dict(pos=(3, 8, 3, 64, 16, 128)), ValueError, "multiple of num_kv_heads"),
        (dict(pos=(3, 8, 2, 48, 16, 128)), NotImplementedError, "head_dim=48"),
        (dict(pos=(3, 8, 2, 64, 16, 2**31)), ValueError, "max_kv_len must be <="),
        (dict(q_data_type=torch.float32), NotImplementedError, "not supported"),
        (dict(q_data_type=BF16, kv_data_type=FP16), NotImplementedError, "mixed dtypes"),
        (dict(k_data_type=BF16, kv_data_type=FP16), ValueError, "disagrees"),
        (dict(mask_type="dense", window_left=3), ValueError, "requires mask_type='causal'"),
        (dict(storage_page_size=32), NotImplementedError, "storage_page_size"),
        (dict(packed_query=1), TypeError, "packed_query must be a bool"),
        (dict(seq_lens=torch.tensor([1, 2, 200], dtype=torch.int32)), ValueError, "max_kv_len=128"),
        (dict(seq_lens=torch.tensor([1, 2], dtype=torch.int32)), ValueError, "seq_lens must have shape"),
        (dict(seq_lens=torch.tensor([1, 5, 9], dtype=torch.int32), max_seq_len_q=2, mask_type="causal"),
         ValueError, "causal"),
    ]:
        with pytest.raises(exc, match=match):
            plan(**kw)
    plan(q_data_type=BF16)
    p = problem()
    for args, kw, exc, match in [
        ((p["q"].to(FP16), p["cache"], p["lens"], p["table"]), {}, ValueError, "q dtype"),
        ((p["q"][:2], p["cache"], p["lens"], p["table"]), {}, ValueError, "q must have shape"),
        ((p["q"], p["cache"][:, :, :1], p["lens"], p["table"]), {}, ValueError, "num_kv_heads, page_size"),
        ((p["q"], p["cache"], p["lens"], p["table"]), dict(qo_indptr=torch.zeros(4, dtype=torch.int32)),
         ValueError, "packed_query=True"),
        ((p["q"], p["cache"], p["lens"], p["table"][:, :4]), {}, ValueError, "too few pages"),
        ((p["q"], p["cache"], p["lens"].long(), p["table"]), {}, ValueError, "seq_lens must be int32"),
        ((p["q"], p["cache"], p["lens"], p["table"]), dict(kv_scale_factors=1), NotImplementedError, "kv_scale"),
        ((p["q"], p["cache"], p["lens"], p["table"]), dict(bmm2_scale=0), ValueError, "bmm2_scale"),
    ]:
        with pytest.raises(exc, match=match):
            w.run(*args, **kw)
    assert not rec.calls


# ============================================================================= empty batch, dtype-argument names
@pytest.mark.parametrize("sq", [1, 3])
def test_one_shot_empty_batch_returns_an_empty_output(rec, sq):
    # as trtllm_batch_decode_with_kv_cache on the same input: an empty output, nothing launched
    p = problem(sq=sq)
    q, table, lens = p["q"][:0], p["table"][:0], p["lens"][:0]
    f = lambda **kw: ts.batch_decode_with_paged_kv_cache(q, p["cache"], table, lens, seq_len_q=sq, **kw)  # noqa
    out = f()
    assert out.shape == q.shape and out.dtype == BF16 and out.device == q.device
    buf = torch.empty(q.shape, dtype=BF16)
    assert f(out=buf, out_dtype=BF16) is buf
    assert f(out_dtype=BF16).dtype == BF16
    for kw, exc, match in [
        (dict(out=torch.empty((1,) + tuple(q.shape[1:]), dtype=BF16)), ValueError, "out must have shape"),
        (dict(out_dtype=FP16), NotImplementedError, "mixed dtypes"),
        (dict(bmm1_scale=float("nan")), ValueError, "bmm1_scale"),
        (dict(bmm2_scale="1"), TypeError, "bmm2_scale"),
        (dict(mask_type="full"), ValueError, "mask_type"),
    ]:
        with pytest.raises(exc, match=match):
            f(**kw)
    from cutedsl_attn.api.trtllm import trtllm_batch_decode_with_kv_cache
    ref = trtllm_batch_decode_with_kv_cache(q.reshape(0, 8, 64), tuple(p["cache"].unbind(1)),
                                            torch.zeros(1 << 20, dtype=torch.uint8), table, lens, 128,
                                            q_len_per_req=sq)
    assert ref.shape == (0, 8, 64)
    assert not rec.calls


def test_plan_dtype_mismatch_names_the_arguments_passed(rec):
    w = ts.BatchDecodePagedTSWrapper()
    plan = lambda **kw: w.plan("cpu", 3, 8, 2, 64, 16, 128, q_data_type=BF16, **kw)  # noqa: E731
    fp8 = torch.float8_e4m3fn
    with pytest.raises(ValueError, match=r"v_data_type=torch.bfloat16 disagrees with k_data_type=torch.float8"):
        plan(k_data_type=fp8, v_data_type=BF16)
    with pytest.raises(ValueError, match=r"k_data_type=torch.float8_e4m3fn disagrees with kv_data_type"):
        plan(kv_data_type=BF16, k_data_type=fp8)
    with pytest.raises(ValueError, match=r"v_data_type=torch.float8_e4m3fn disagrees with kv_data_type"):
        plan(kv_data_type=BF16, k_data_type=BF16, v_data_type=fp8)
    plan(k_data_type=fp8, v_data_type=fp8)  # agreeing: an fp8 plan
    assert w._plan["kv_dtype"] == fp8
    plan(v_data_type=fp8)
    assert w._plan["kv_dtype"] == fp8
