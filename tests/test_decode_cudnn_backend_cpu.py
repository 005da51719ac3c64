"""CPU tests of ``backend="cudnn"`` / ``"auto"`` on ``BatchDecodeWithPagedKVCacheWrapper`` (no GPU, no cuDNN).

* the auto rule, ``dispatch.decode_backend``, as a table of cases (every condition flips it);
* explicit ``"cudnn"``: the features it refuses and the missing frontend, each before any launch;
  ``fixed_split_size`` / ``disable_split_kv`` keep the CuTe DSL kernel;
* the call end to end on a stand-in ``cudnn`` module (graphs built and cached by ``cutedsl_attn.cudnn.decode``)
  with ``run_graph`` replaced by the float64 emulator of ``test_cudnn_decode_cpu``, against ``cutedsl_attn.ref``:
  CSR and block tables, one and several rows, the base-2 LSE; compatible re-plans keep the graph (one build),
  CUDA-graph mode keeps the table / length buffers and the graph key across re-plans;
* ``"auto"`` hands sinks, ``v_scale`` and (in CUDA-graph mode) CSR tables to the CuTe DSL kernel.
"""

from __future__ import annotations

import math

import pytest
import torch

import cutedsl_attn as ca
from cutedsl_attn import dispatch, ref
from cutedsl_attn.api import _decode_cudnn
from cutedsl_attn.cudnn import decode as cd

from test_cudnn_decode_cpu import Emulator, fake_cudnn  # noqa: F401 -- the stand-in cudnn module (a fixture)

BF16, FP16 = torch.bfloat16, torch.float16
GiB = 1 << 30


pytestmark = pytest.mark.usefixtures("cross_compile_sm90")  # tests/conftest.py


# ============================================================================= the rule
BIG = dict(batch_size=16, max_kv_len=32768, kv_bytes=2 * GiB, head_dim=128, cudnn_importable=True, arch="sm_90a")
RULE = [
    ({}, "cudnn"),
    (dict(batch_size=128, max_kv_len=8192, kv_bytes=8 * GiB), "cudnn"),
    (dict(batch_size=15), "cute"),
    (dict(batch_size=64, max_kv_len=4096, kv_bytes=GiB * 3 // 2), "cudnn"),
    (dict(batch_size=1, max_kv_len=8192, kv_bytes=GiB // 32), "cute"),
    (dict(max_kv_len=4095), "cute"),
    (dict(kv_bytes=GiB - 1), "cute"),
    (dict(batch_size=64, max_kv_len=4096, kv_bytes=GiB), "cudnn"),  # a 0.26 ms kernel: cuDNN 1.03x faster
    (dict(batch_size=64, max_kv_len=4096, kv_bytes=GiB // 2), "cute"),  # cuDNN's ~0.2 ms host path dominates
    (dict(head_dim=64), "cute"),
    (dict(q_len_per_req=2), "cute"),
    (dict(features=("sinks",)), "cute"),
    (dict(features=("window",)), "cute"),
    (dict(features=("soft_cap",)), "cute"),
    (dict(features=("rope",)), "cute"),
    (dict(features=("alibi",)), "cute"),
    (dict(features=("fp8_kv",)), "cute"),
    (dict(features=("empty_request",)), "cute"),
    (dict(keep_split_controls=True), "cute"),
    (dict(cudnn_importable=False), "cute"),
    (dict(arch="sm_100a"), "cute"),
    (dict(cuda_graph=True), "cute"),
    (dict(cuda_graph=True, caller_block_table=True), "cudnn"),
]


@pytest.mark.parametrize("over,want", RULE, ids=[str(r[0]) for r in RULE])
def test_auto_rule(over, want):
    assert dispatch.decode_backend("auto", **dict(BIG, **over)) == want


def test_explicit_names():
    assert dispatch.decode_backend("auto") == "cute" and dispatch.decode_backend("cute") == "cute"
    assert dispatch.decode_backend("cudnn") == "cudnn"
    assert dispatch.decode_backend("cute", **BIG) == "cute"
    assert dispatch.decode_backend("cudnn", **dict(BIG, batch_size=1, q_len_per_req=4)) == "cudnn"
    assert dispatch.decode_backend("cudnn", **dict(BIG, keep_split_controls=True)) == "cute"
    with pytest.raises(NotImplementedError, match="not available"):
        dispatch.decode_backend("fa2")
    with pytest.raises(ValueError, match="unknown backend"):
        dispatch.decode_backend("nope", **BIG)


def test_rule_constants_are_the_documented_ones():
    r = dispatch.DECODE_AUTO_CUDNN
    assert (r["min_batch"], r["min_max_kv_len"], r["min_kv_bytes"], r["head_dims"]) == (16, 4096, GiB, (128,))
    assert set(r["unserved"]) == {"rope", "alibi", "soft_cap", "fp8_kv", "sinks", "window",
                                  "empty_request"}


# ============================================================================= a problem
def problem(lens=(40, 17, 64), hq=8, hkv=2, d=64, ps=16, dtype=BF16, layout="HND", m=1, seed=0):
    """CSR + dense block table over a pool whose unused pages hold NaN; q ``[B * m, hq, d]``."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    npg = [-(-n // ps) for n in lens]
    pool = sum(npg) + 3
    perm = torch.randperm(pool, generator=g).to(torch.int32)
    used = perm[:sum(npg)]
    shape = (pool, 2, hkv, ps, d) if layout == "HND" else (pool, 2, ps, hkv, d)
    cache = torch.randn(shape, generator=g).to(dtype)
    cache[perm[sum(npg):].long()] = float("nan")
    width = max(npg) + 1
    table = torch.full((B, width), int(used[0]), dtype=torch.int32)
    o = 0
    for b, n in enumerate(npg):
        table[b, :n] = used[o:o + n]
        o += n
    indptr = torch.tensor([0] + torch.tensor(npg).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([n - (k - 1) * ps for n, k in zip(lens, npg)], dtype=torch.int32)
    q = torch.randn(B * m, hq, d, generator=g).to(dtype)
    return dict(cache=cache, table=table, lens=torch.tensor(lens, dtype=torch.int32), indptr=indptr, indices=used,
                last=last, q=q, hq=hq, hkv=hkv, d=d, ps=ps, layout=layout, m=m, dtype=dtype)


def plan_args(p):
    return (p["indptr"], p["indices"], p["last"], p["hq"], p["hkv"], p["d"], p["ps"])


def oracle(p, *, window_left=-1, sm_scale=None, sinks=None):
    kv = dict(kv_layout=p["layout"], window_left=window_left, sm_scale=sm_scale, sinks=sinks)
    if p["m"] == 1:
        return ref.paged_decode(p["q"], p["cache"], None, p["indptr"], p["indices"], p["last"], **kv)
    qo = torch.arange(len(p["lens"]) + 1, dtype=torch.int32) * p["m"]
    return ref.paged_prefill(p["q"], p["cache"], None, qo, p["indptr"], p["indices"], p["last"], causal=True, **kv)


def close(out, o_ref, what=""):
    assert not torch.isnan(out).any(), what
    e = ((out.double() - o_ref).norm() / o_ref.norm()).item()
    assert e < 1e-2, (what, e)


class CountingEmulator(Emulator):
    """``run_graph``'s stand-in: fetches (builds on a miss) the key's graph from the real cache, then emulates."""

    def __call__(self, key, **kw):
        cd.get_graph(key)
        return super().__call__(key, **kw)


@pytest.fixture
def emu(monkeypatch, fake_cudnn):  # noqa: F811
    e = CountingEmulator()
    monkeypatch.setattr(cd, "run_graph", e)
    monkeypatch.setattr(_decode_cudnn, "_on_cuda", lambda t: True)
    return e


def ws():
    return torch.zeros(8 << 20, dtype=torch.uint8)


# ============================================================================= explicit cudnn
def test_ctor_accepts_cudnn():
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "HND", backend="cudnn")
    assert w._backend == "cudnn"


def test_explicit_without_frontend_names_versions_and_server(monkeypatch, rec):
    def missing():
        raise ImportError("No module named 'cudnn'")

    monkeypatch.setattr(cd, "require_cudnn", missing)
    p = problem()
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "HND", backend="cudnn")
    with pytest.raises(NotImplementedError) as ei:
        w.plan(*plan_args(p), q_data_type=BF16)
    for s in ("cudnn-frontend not installed", "nvidia-cudnn-frontend", "backend='cute'"):
        assert s in str(ei.value)
    # the batch-invariance controls keep the CuTe DSL kernel, frontend or not
    w.plan(*plan_args(p), q_data_type=BF16, disable_split_kv=True)
    w.run(p["q"], p["cache"])
    assert rec.last[0].name == "paged_decode" and "cudnn" not in w._plan


@pytest.mark.parametrize("kw,match", [(dict(pos_encoding_mode="ROPE_LLAMA"), "ROPE_LLAMA"),
                                      (dict(pos_encoding_mode="ALIBI"), "ALIBI"),
                                      (dict(logits_soft_cap=30.0), "logits_soft_cap"),
                                      (dict(kv_data_type=torch.float8_e4m3fn), "fp8")])
def test_explicit_refuses_unserved_features(emu, kw, match):
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "HND", backend="cudnn")
    with pytest.raises(NotImplementedError, match=match) as ei:
        w.plan(*plan_args(problem()), q_data_type=BF16, **kw)
    assert "backend='cute'" in str(ei.value) and not emu.keys


@pytest.mark.parametrize("table", [False, True])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_explicit_one_row_vs_oracle_and_graph_reuse(emu, table, layout):
    p = problem(layout=layout)
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), layout, backend="cudnn")
    kw = dict(block_tables=p["table"], seq_lens=p["lens"]) if table else {}
    args = (None, None, None, *plan_args(p)[3:]) if table else plan_args(p)
    w.plan(*args, q_data_type=BF16, **kw)
    out, lse = w.run(p["q"], p["cache"], return_lse=True)
    o_ref, lse_ref = oracle(p)
    close(out, o_ref, "first")
    assert (lse.double() - lse_ref).abs().max() < 1e-3  # base 2
    # a compatible re-plan: other lengths and pages, same bucket -> the cached graph
    p2 = problem(lens=(33, 30, 50), layout=layout, seed=3)
    kw2 = dict(block_tables=p2["table"], seq_lens=p2["lens"]) if table else {}
    w.plan(*((None, None, None, *plan_args(p2)[3:]) if table else plan_args(p2)), q_data_type=BF16, **kw2)
    close(w.run(p2["q"], p2["cache"], return_lse=True)[0], oracle(p2)[0], "re-plan")
    assert emu.keys[0] == emu.keys[1] and cd.graph_cache_info()["builds"] == 1


def test_replan_with_same_options_builds_once(emu):
    p = problem()
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "HND", backend="cudnn")
    for lens in ((40, 17, 64), (41, 18, 60), (1, 2, 3)):
        q = problem(lens=(40, 17, 64))
        lens_t = torch.tensor(lens, dtype=torch.int32)
        w.plan(None, None, None, 8, 2, 64, 16, q_data_type=BF16, block_tables=q["table"], seq_lens=lens_t)
        out = w.run(q["q"], q["cache"])
        qq = dict(q, lens=lens_t)
        qq["indptr"], qq["indices"], qq["last"] = ref.block_tables_to_csr(q["table"], lens_t, 16)
        close(out, oracle(qq)[0], str(lens))
    assert cd.graph_cache_info()["builds"] == 1 and len({k for k in emu.keys}) == 1


def test_explicit_window_and_scales(emu):
    p = problem()
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "HND", backend="cudnn")
    w.plan(*plan_args(p), q_data_type=BF16, window_left=7, sm_scale=0.2)
    out = w.run(p["q"], p["cache"], q_scale=0.5, k_scale=2.0)
    close(out, oracle(p, window_left=7, sm_scale=0.2)[0])
    assert emu.keys[-1].sm_scale == pytest.approx(0.2) and emu.keys[-1].window_left == 7
    with pytest.raises(NotImplementedError, match="v_scale"):
        w.run(p["q"], p["cache"], v_scale=0.5)
    with pytest.raises(ValueError, match="q"):
        w.run(p["q"][:2], p["cache"])
    with pytest.raises(ValueError, match="window_left"):
        w.run(p["q"], p["cache"], window_left=3)


def test_explicit_multirow_pads_the_table_to_the_128_key_tile(emu):
    p = problem(m=4)
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "HND", use_tensor_cores=True, backend="cudnn")
    w.plan(*plan_args(p), q_data_type=BF16, q_len_per_req=4)
    assert w._plan["cudnn"].table.shape == (3, 8)  # 128 keys / page 16
    out = w.run(p["q"], p["cache"])
    close(out, oracle(p)[0], "multirow")
    with pytest.raises(ValueError, match="kv_len must be >= q_len_per_req"):
        w.plan(*plan_args(problem(lens=(3, 17, 64))), q_data_type=BF16, q_len_per_req=4)


# ============================================================================= auto
@pytest.fixture
def small_rule(monkeypatch):
    """The auto rule's thresholds shrunk to this file's batch (the conditions themselves unchanged)."""
    monkeypatch.setitem(dispatch.DECODE_AUTO_CUDNN, "min_batch", 3)
    monkeypatch.setitem(dispatch.DECODE_AUTO_CUDNN, "min_max_kv_len", 64)
    monkeypatch.setitem(dispatch.DECODE_AUTO_CUDNN, "min_kv_bytes", 1)
    monkeypatch.setitem(dispatch.DECODE_AUTO_CUDNN, "head_dims", (64,))


def test_auto_takes_cudnn_and_hands_back_sinks_and_v_scale(emu, small_rule, rec):
    p = problem()
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "HND")
    w.plan(*plan_args(p), q_data_type=BF16)
    assert w._plan["cudnn"] is not None and not w._plan["cudnn"].explicit
    close(w.run(p["q"], p["cache"]), oracle(p)[0])
    assert len(emu.keys) == 1 and not rec.calls
    w.run(p["q"], p["cache"], sinks=torch.zeros(8))
    w.run(p["q"], p["cache"], v_scale=0.5)
    assert len(emu.keys) == 1 and len(rec.calls) == 2 and rec.last[0].name == "paged_decode"
    # the rule's other inputs flip it back
    for kw in (dict(window_left=5), dict(fixed_split_size=2), dict(logits_soft_cap=5.0)):
        w.plan(*plan_args(p), q_data_type=BF16, **kw)
        assert "cudnn" not in w._plan, kw
    w.plan(*plan_args(problem(lens=(40, 17, 63))), q_data_type=BF16)
    assert "cudnn" not in w._plan  # max kv below the threshold
    w.plan(None, None, None, 8, 2, 64, 16, q_data_type=BF16, block_tables=p["table"],
           seq_lens=torch.tensor([0, 17, 64], dtype=torch.int32))
    assert "cudnn" not in w._plan  # an empty request: ours writes O = 0 / LSE = -inf


def test_auto_without_frontend_keeps_ours(monkeypatch, small_rule, rec):
    monkeypatch.setattr(dispatch.backends, "DECODE_AUTO_CUDNN", dict(dispatch.DECODE_AUTO_CUDNN))
    import cutedsl_attn.cudnn.prefill as cp

    monkeypatch.setattr(cp, "cudnn_available", lambda: False)
    p = problem()
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "HND")
    w.plan(*plan_args(p), q_data_type=BF16)
    assert "cudnn" not in w._plan
    w.run(p["q"], p["cache"])
    assert rec.last[0].name == "paged_decode"


# ============================================================================= CUDA-graph mode
def graph_wrapper(B, backend, max_pages=64):
    i32 = dict(dtype=torch.int32)
    return ca.BatchDecodeWithPagedKVCacheWrapper(
        ws(), "HND", use_cuda_graph=True, backend=backend, paged_kv_indptr_buffer=torch.zeros(B + 1, **i32),
        paged_kv_indices_buffer=torch.zeros(max_pages, **i32), paged_kv_last_page_len_buffer=torch.zeros(B, **i32))


def test_graph_mode_auto_needs_a_caller_block_table(emu, small_rule):
    p = problem()
    w = graph_wrapper(3, "auto")
    w.plan(*plan_args(p), q_data_type=BF16)
    assert "cudnn" not in w._plan  # a CSR-built table cannot grow once captured
    w2 = graph_wrapper(3, "auto")
    w2.plan(None, None, None, 8, 2, 64, 16, q_data_type=BF16, block_tables=p["table"], seq_lens=p["lens"])
    assert w2._plan["cudnn"] is not None


def test_graph_mode_replans_keep_buffers_and_key(emu):
    p = problem()
    w = graph_wrapper(3, "cudnn")
    w.plan(None, None, None, 8, 2, 64, 16, q_data_type=BF16, block_tables=p["table"], seq_lens=p["lens"])
    c0 = w._plan["cudnn"]
    out = w.run(p["q"], p["cache"])
    close(out, oracle(p)[0])
    assert c0.max_kv == p["table"].shape[1] * 16  # the table's capacity: re-plans never move the key
    lens2 = torch.tensor([70, 1, 5], dtype=torch.int32)
    w.plan(None, None, None, 8, 2, 64, 16, q_data_type=BF16, block_tables=p["table"], seq_lens=lens2)
    c1 = w._plan["cudnn"]
    assert c1.table.data_ptr() == c0.table.data_ptr() and c1.seq_lens.data_ptr() == c0.seq_lens.data_ptr()
    assert torch.equal(c1.seq_lens, lens2)
    w.run(p["q"], p["cache"])
    assert emu.keys[0] == emu.keys[1] and cd.graph_cache_info()["builds"] == 1
    wide = torch.cat([p["table"], p["table"]], 1)
    with pytest.raises(ValueError, match="cannot grow"):
        w.plan(None, None, None, 8, 2, 64, 16, q_data_type=BF16, block_tables=wide, seq_lens=p["lens"])


def test_graph_mode_csr_table_is_padded_to_the_first_width(emu):
    p = problem()
    w = graph_wrapper(3, "cudnn")
    w.plan(*plan_args(p), q_data_type=BF16)
    width = w._plan["cudnn"].table.shape[1]
    p2 = problem(lens=(5, 17, 20), seed=1)
    if p2["cache"].shape != p["cache"].shape:
        p2 = dict(p2, cache=p["cache"])
    w.plan(*plan_args(p2), q_data_type=BF16)
    assert w._plan["cudnn"].table.shape[1] == width
    with pytest.raises(ValueError, match="cannot grow"):
        w.plan(*plan_args(problem(lens=(40, 17, 200))), q_data_type=BF16)


def test_decode_backend_is_the_one_rule():
    # the wrapper module holds no threshold of its own
    import inspect

    src = inspect.getsource(_decode_cudnn) + inspect.getsource(ca.BatchDecodeWithPagedKVCacheWrapper)
    assert "4096" not in src and "min_batch" not in src
    assert dispatch.DECODE_AUTO_CUDNN["min_kv_bytes"] == GiB
