"""CPU tests of the dispatch layer's launch contract: kernel choices, the torch custom ops (schema, fake tensors,
``torch.library.opcheck``), ``torch.compile(fullgraph=True)`` through ``run()`` and the ``single_*`` functions,
the profiler name, and the CUDA-graph signature.

The compiled kernels are stubs (``_kernel_stubs``): the real kernel modules' ``launch`` orders the arguments, the
stub records them and writes O = ``output_scale``, LSE = 0.5.
"""

from __future__ import annotations

import math

import pytest
import torch

import cutedsl_attn as ca
from cutedsl_attn import dispatch
from cutedsl_attn.planning.decode import DecodeArgs
from cutedsl_attn.planning.prefill import PrefillArgs


BF16 = torch.bfloat16
OPS = ("prefill_sm90", "prefill_portable", "paged_decode")


pytestmark = pytest.mark.usefixtures("cross_compile_sm90")  # tests/conftest.py


def indptr(lens):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


QO, KV = (5, 0, 70, 3), (9, 4, 200, 0)


def ragged():
    w = ca.BatchPrefillWithRaggedKVCacheWrapper(torch.zeros(1 << 20, dtype=torch.uint8), "NHD")
    w.plan(indptr(QO), indptr(KV), 8, 2, 64, causal=True, q_data_type=BF16)
    q = torch.randn(sum(QO), 8, 64).to(BF16)
    k, v = torch.randn(sum(KV), 2, 64).to(BF16), torch.randn(sum(KV), 2, 64).to(BF16)
    return w, q, k, v


def decode(lens=(37, 1, 300, 16), ps=16):
    npages = [-(-L // ps) for L in lens]
    last = torch.tensor([L - (n - 1) * ps for L, n in zip(lens, npages)], dtype=torch.int32)
    w = ca.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8 << 20, dtype=torch.uint8), "NHD")
    w.plan(indptr(npages), torch.arange(sum(npages), dtype=torch.int32), last, 8, 2, 64, ps, q_data_type=BF16)
    cache = torch.randn(sum(npages), 2, ps, 2, 64).to(BF16)
    return w, torch.randn(len(lens), 8, 64).to(BF16), cache


def prefill_choice(kernel="auto", **kw):
    kw = dict(dict(dtype=BF16, head_dim_qk=64, head_dim_vo=64, group_size=4, causal=True), **kw)
    return dispatch.prefill_choice(dispatch.prefill_problem(**kw), kernel=kernel)


# ============================================================================= choices
def test_kernel_modules_follow_the_contract():
    for name, m in dispatch.KERNEL_MODULES.items():
        assert m.NAME == name
        for attr in ("Tiles", "Config", "unsupported_reason", "default_tiles", "override_tiles", "compile", "launch"):
            assert callable(getattr(m, attr)), (name, attr)


def test_prefill_choice_names_and_keys():
    c = prefill_choice()
    assert c.name == "prefill_sm90" and dispatch.kernel_module(c.cfg) is c.module and c.tile_m == c.cfg.tile_m
    assert c.graph_key.startswith("prefill_sm90:") and c.graph_key == prefill_choice().graph_key
    assert c == prefill_choice() and hash(c) == hash(prefill_choice())
    p = prefill_choice(pos_encoding_mode="ALIBI")
    assert p.name == "prefill_portable" and p.graph_key != c.graph_key
    assert prefill_choice(kernel="portable").name == "prefill_portable"
    assert dispatch.prefill_choice(c.problem, positive_scale=False).name == "prefill_portable"
    with pytest.raises(ValueError, match="kernel must be"):
        prefill_choice(kernel="sm80")
    with pytest.raises(TypeError):
        dispatch.kernel_module(object())


def test_prefill_env_hooks(monkeypatch):
    monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_KERNEL", "portable")
    assert prefill_choice().name == "prefill_portable" and prefill_choice(kernel="sm90").name == "prefill_sm90"
    monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_KERNEL", "fast")
    with pytest.raises(ValueError, match="CUTEDSL_ATTN_PREFILL_KERNEL"):
        prefill_choice()
    monkeypatch.delenv("CUTEDSL_ATTN_PREFILL_KERNEL")
    monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_TUNE", "tile_n=64")
    assert prefill_choice().tiles.tile_n == 64
    for bad in ("tile_n", "warp_size=3", "tile_n=abc"):
        monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_TUNE", bad)
        with pytest.raises(ValueError, match="CUTEDSL_ATTN_PREFILL_TUNE"):
            prefill_choice()
    monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_TUNE", "warp_size=3")  # checked whichever kernel serves
    with pytest.raises(ValueError, match="CUTEDSL_ATTN_PREFILL_TUNE"):
        prefill_choice(pos_encoding_mode="ALIBI")


def test_decode_choice_and_env_hooks(monkeypatch):
    p = dispatch.decode_problem(dtype=BF16, head_dim=128, page_size=16, group_size=4)
    c, s = dispatch.decode_choice(p), dispatch.decode_choice(p, split=True)
    assert c.name == s.name == "paged_decode" and c != s  # split-KV: the wider CTAs
    monkeypatch.setenv("CUTEDSL_ATTN_DECODE_TUNE", "2,4")
    assert (dispatch.decode_choice(p).tiles.num_warps, dispatch.decode_choice(p).tiles.num_stages) == (2, 4)
    monkeypatch.setenv("CUTEDSL_ATTN_DECODE_TUNE", "num_stages=5")
    assert dispatch.decode_choice(p).tiles.num_stages == 5
    for bad in ("2", "num_warps=3", "depth=2"):
        monkeypatch.setenv("CUTEDSL_ATTN_DECODE_TUNE", bad)
        with pytest.raises(ValueError, match="CUTEDSL_ATTN_DECODE_TUNE|num_warps"):
            dispatch.decode_choice(p)


def test_with_sinks_is_the_same_kernel_with_sinks():
    c = prefill_choice()
    s = c.with_sinks()
    assert s.problem.use_sinks and s.tiles == c.tiles and s.name == c.name and s is c.with_sinks()
    assert s.with_sinks() is s and not c.problem.use_sinks


def test_positive_scale_only_refused_before_launch(rec):
    c = prefill_choice()
    assert c.cfg.positive_scale_only
    w, q, k, v = ragged()
    args = PrefillArgs(q, k, v, *([torch.zeros(1)] * 7), -0.1, 0.0, -1, 1.0, 1.0, 1.0)
    with pytest.raises(NotImplementedError, match="positive softmax scale"):
        c.launch(args)
    assert rec.calls == []


def test_backends():
    assert dispatch.prefill_backend("auto") == dispatch.prefill_backend("cute") == "cute"
    assert dispatch.prefill_backend("cudnn") == "cudnn"
    with pytest.raises(NotImplementedError, match="fa3"):
        dispatch.prefill_backend("fa3")
    with pytest.raises(ValueError, match="unknown backend"):
        dispatch.prefill_backend("nope")
    assert dispatch.decode_backend("auto") == "cute"
    assert dispatch.decode_backend("cudnn") == "cudnn"


def test_callable_key():
    def bias(score, b, h, q_idx, kv_idx):
        return score + 0.5 * (kv_idx - q_idx)

    assert dispatch.callable_key(bias) == dispatch.callable_key(bias)

    class Obj:
        def __call__(self, *a):
            return a[0]

    with pytest.raises(TypeError):
        dispatch.callable_key(Obj())


def test_graph_signature():
    c = prefill_choice()
    sig = dispatch.graph_signature(c, causal=True, sm_scale=0.125)
    assert sig == {"causal": True, "sm_scale": 0.125, "kernel": c.graph_key}
    assert dispatch.graph_signature(None, causal=True) == {"causal": True}
    assert dispatch.graph_signature(c, causal=True, sm_scale=0.125) != dispatch.graph_signature(
        prefill_choice(kernel="portable"), causal=True, sm_scale=0.125)


# ============================================================================= custom ops
def _prefill_op_args(name):
    c = prefill_choice(kernel="portable" if name == "prefill_portable" else "auto")
    assert c.name == name
    q, k, v = torch.randn(6, 8, 64).to(BF16), torch.randn(9, 2, 64).to(BF16), torch.randn(9, 2, 64).to(BF16)
    work = torch.zeros(2, 8, dtype=torch.int32)
    out, lse = torch.empty(6, 8, 64, dtype=BF16), torch.empty(6, 8)
    dummy_i, dummy_u8, dummy_f = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.uint8), torch.zeros(1)
    args = (q, k, v, dummy_i, work, out, lse, dummy_u8, dummy_f, torch.zeros(1), 0.125, 0.0, -1, 1.0, 13.0, 0.5,
            c.graph_key)
    return c, args


def _decode_op_args():
    c = dispatch.decode_choice(dispatch.decode_problem(dtype=BF16, head_dim=64, page_size=16, group_size=4))
    q, kc = torch.randn(2, 8, 64).to(BF16), torch.randn(4, 16, 2, 64).to(BF16)
    ws = torch.zeros(4096, dtype=torch.float32)
    args = (q, kc, kc.clone(), torch.arange(4, dtype=torch.int32), torch.zeros(2, 8, dtype=torch.int32),
            torch.empty(2, 8, 64, dtype=BF16), torch.empty(2, 8), ws[:1024].view(2, 8, 64), ws[2048:2064].view(2, 8),
            torch.zeros(4, dtype=torch.int32), torch.zeros(1), torch.zeros(1), 0.125, 0.0, 1.0, 13.0, 2.0,
            c.graph_key)
    return c, args


@pytest.mark.parametrize("name", OPS)
def test_custom_op_schema_mutations(name):
    op = getattr(torch.ops.cutedsl_attn, name).default
    mutated = {a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    want = {"prefill_sm90": {"out", "lse", "work"}, "prefill_portable": {"out", "lse"},
            "paged_decode": {"out", "lse", "part_o", "part_lse", "counters"}}[name]
    assert mutated == want
    assert op._schema.arguments[-1].name == "key" and str(op._schema.returns) == "[]"


@pytest.mark.parametrize("name", OPS)
def test_custom_op_runs_the_kernel_by_key(rec, name):
    c, args = _decode_op_args() if name == "paged_decode" else _prefill_op_args(name)
    getattr(torch.ops.cutedsl_attn, name)(*args)
    rname, cfg, a = rec.calls[-1]
    assert rname == name and cfg == c.cfg and a.out is args[5] and torch.all(a.out == a.output_scale)
    assert isinstance(a, DecodeArgs if name == "paged_decode" else PrefillArgs)
    with pytest.raises(RuntimeError, match="no kernel choice"):
        getattr(torch.ops.cutedsl_attn, name)(*args[:-1], "prefill_sm90:unknown")


@pytest.mark.parametrize("name", OPS)
def test_custom_op_opcheck(rec, name):
    """torch.library.opcheck: schema (declared mutations), fake tensor and functionalization checks."""
    _, args = _decode_op_args() if name == "paged_decode" else _prefill_op_args(name)
    torch.library.opcheck(getattr(torch.ops.cutedsl_attn, name).default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("name", OPS)
def test_custom_op_fake_tensor_mode(rec, name):
    """Under FakeTensorMode the op runs its fake implementation: no kernel launch, no data touched."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, args = _decode_op_args() if name == "paged_decode" else _prefill_op_args(name)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        assert getattr(torch.ops.cutedsl_attn, name)(*fake) is None
    assert rec.calls == []


# ============================================================================= torch.compile
def _graph_ops(fn, *inputs):
    """Compile ``fn`` with fullgraph=True through a backend that records the graph's call targets."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True, backend=backend)(*inputs)
    return out, seen


def test_compile_ragged_run_is_one_custom_op(rec):
    w, q, k, v = ragged()
    eager = w.run(q, k, v, return_lse=True, v_scale=0.5)
    n = len(rec.calls)
    (o, lse), ops = _graph_ops(lambda q, k, v: w.run(q, k, v, return_lse=True, v_scale=0.5), q, k, v)
    assert "cutedsl_attn.prefill_sm90.default" in ops
    assert len(rec.calls) == n + 1 and rec.calls[-1][2].output_scale == 0.5
    assert torch.equal(o, eager[0]) and torch.equal(lse, eager[1])


def test_compile_decode_run_is_one_custom_op(rec):
    w, q, cache = decode()
    eager = w.run(q, cache, v_scale=2.0)
    o, ops = _graph_ops(lambda q, c: w.run(q, c, v_scale=2.0), q, cache)
    assert "cutedsl_attn.paged_decode.default" in ops and torch.equal(o, eager)


def test_compile_aot_eager_functionalizes_the_mutations(rec):
    """aot_eager functionalizes the ops' mutations (decode: partials are two views of one workspace)."""
    w, q, cache = decode(lens=(3000, 5))  # split-KV: the partials are used
    torch._dynamo.reset()
    o = torch.compile(lambda q, c: w.run(q, c), fullgraph=True, backend="aot_eager")(q, cache)
    assert torch.equal(o, torch.ones_like(o))
    wr, qr, k, v = ragged()
    o2 = torch.compile(lambda q, k, v: wr.run(q, k, v), fullgraph=True, backend="aot_eager")(qr, k, v)
    assert torch.equal(o2, torch.ones_like(o2))


def test_compile_single_functions(rec):
    q, k, v = torch.randn(8, 64).to(BF16), torch.randn(40, 2, 64).to(BF16), torch.randn(40, 2, 64).to(BF16)
    o, ops = _graph_ops(lambda q, k, v: ca.single_decode_with_kv_cache(q, k, v, v_scale=2.0), q, k, v)
    assert "cutedsl_attn.single_decode.default" in ops and o.shape == (8, 64) and torch.all(o == 2.0)
    qp = torch.randn(7, 8, 64).to(BF16)
    (o, lse), ops = _graph_ops(lambda q, k, v: ca.single_prefill_with_kv_cache(q, k, v, causal=True,
                                                                               return_lse=True), qp, k, v)
    assert "cutedsl_attn.single_prefill.default" in ops and o.shape == (7, 8, 64) and lse.shape == (7, 8)
    eager = ca.single_prefill_with_kv_cache(qp, k, v, causal=True, return_lse=True)
    assert torch.equal(o, eager[0]) and torch.equal(lse, eager[1])


def test_single_op_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.empty(8, 64, dtype=BF16), torch.empty(2, 40, 64, dtype=BF16), torch.empty(2, 40, 64, dtype=BF16)
        o, lse = torch.ops.cutedsl_attn.single_decode(q, k, v, "HND", "NONE", False, None, None, None, -1, None,
                                                      None, None, None)
        assert o.shape == (8, 64) and lse.shape == (8,) and lse.dtype == torch.float32
        qp = torch.empty(7, 8, 64, dtype=BF16)
        vp = torch.empty(40, 2, 32, dtype=BF16)
        o, lse = torch.ops.cutedsl_attn.single_prefill(qp, torch.empty(40, 2, 64, dtype=BF16), vp, None, None, True,
                                                       "NHD", "NONE", False, None, -1, None, None, None, "auto", None,
                                                       None, None)
        assert o.shape == (7, 8, 32) and lse.shape == (7, 8)


# ============================================================================= the profiler name
def test_profiler_shows_the_kernel_name(rec):
    w, q, k, v = ragged()
    w.run(q, k, v)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        w.run(q, k, v)
    names = {e.name for e in prof.events()}
    assert "cutedsl_attn::prefill_sm90" in names


def test_eager_launch_skips_the_dispatcher(rec, monkeypatch):
    """Eager run() goes straight to the kernel module's launch (no custom-op dispatch on the hot path)."""
    w, q, k, v = ragged()
    called = []
    monkeypatch.setattr(dispatch, "_launch_by_key", lambda key, args: called.append(key))
    w.run(q, k, v)
    assert called == [] and len(rec.calls) == 1
    assert math.isclose(rec.calls[0][2].sm_scale, 1 / 8)
