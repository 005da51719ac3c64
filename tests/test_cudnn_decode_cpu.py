"""CPU tests of ``cudnn_batch_decode_with_kv_cache`` (no GPU, no cuDNN needed).

* the signature against FlashInfer's documented one (names, order, kinds, defaults);
* every validation error, raised before anything would launch;
* the graph key: layouts, strides and dtypes move it, KV lengths and block-table contents do not,
  ``max_sequence_kv`` only across a power of two (capped at the table's capacity);
* the graph declaration, built against a recording stand-in for the ``cudnn`` module, and the
  decline message (feature, versions, what serves it);
* the call end to end with ``run_graph`` replaced by a float64 emulator of cuDNN's paged SDPA that
  reads every bound tensor through the declared layout and writes natural-log Stats, checked
  against ``cutedsl_attn.ref`` -- which also checks the base-2 LSE conversion.
"""

from __future__ import annotations

import ast
import inspect
import math
import types
from pathlib import Path

import pytest
import torch

from cutedsl_attn import ref
from cutedsl_attn.api import cudnn_decode as api
from cutedsl_attn.cudnn import decode as cd
from cutedsl_attn.cudnn import prefill as cp

BF16, FP16 = torch.bfloat16, torch.float16
fn = api.cudnn_batch_decode_with_kv_cache
P_, K_ = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY

# FlashInfer's documented signature of flashinfer.cudnn.cudnn_batch_decode_with_kv_cache
SEED = [
    ("q", P_, inspect.Parameter.empty), ("k_cache", P_, inspect.Parameter.empty),
    ("v_cache", P_, inspect.Parameter.empty), ("scale", P_, inspect.Parameter.empty),
    ("workspace_buffer", P_, inspect.Parameter.empty), ("max_sequence_kv", K_, inspect.Parameter.empty),
    ("actual_seq_lens_kv", K_, None), ("block_tables", K_, None), ("is_cuda_graph_compatible", K_, False),
    ("batch_offsets_q", K_, None), ("batch_offsets_o", K_, None), ("batch_offsets_k", K_, None),
    ("batch_offsets_v", K_, None), ("out", K_, None), ("return_lse", K_, False), ("lse", K_, None),
    ("q_len_per_req", K_, 1), ("window_left", K_, -1), ("sinks", K_, None),
]


def test_signature_matches_seed():
    got = [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
    assert got == SEED


def test_decode_builder_imports_nothing_above_cudnn():
    tree = ast.parse(Path(cd.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module.split(".")[0] != "cutedsl_attn" or \
                (node.level == 1 and node.module == "prefill"), ast.dump(node)
        elif isinstance(node, ast.Import):
            assert all(a.name.split(".")[0] != "cutedsl_attn" for a in node.names)


# ============================================================================= a problem
def problem(B=3, m=1, hq=8, hkv=2, d=64, ps=16, lens=(40, 17, 64), width=5, dtype=BF16, layout="HND", seed=0,
            spare=4):
    """q ``[B*m, hq, d]``; caches as the ``(pages, hkv, ps, d)`` view (``layout="NHD"``: a transposed view of an
    NHD pool); pages shuffled, spare pages and table tails pointing at NaN-filled pages."""
    g = torch.Generator().manual_seed(seed)
    npg = [-(-n // ps) for n in lens]
    if m > 1:  # the multi-row graph reads whole 128-key tiles: table columns up to that boundary
        width = max(width, -(-(-(-max(lens) // 128) * 128) // ps))
    total = sum(npg) + spare
    perm = torch.randperm(total, generator=g).to(torch.int32)
    used, unused = perm[:sum(npg)], perm[sum(npg):]
    shape = (total, ps, hkv, d) if layout == "NHD" else (total, hkv, ps, d)
    kp = torch.randn(shape, generator=g).to(dtype)
    vp = torch.randn(shape, generator=g).to(dtype)
    kp[unused.long()] = float("nan")
    vp[unused.long()] = float("nan")
    table = torch.full((B, width), int(unused[0]), dtype=torch.int32)
    o = 0
    for b, n in enumerate(npg):
        table[b, :n] = used[o:o + n]
        o += n
    q = torch.randn(B * m, hq, d, generator=g).to(dtype)
    kv = (kp.transpose(1, 2), vp.transpose(1, 2)) if layout == "NHD" else (kp, vp)
    return dict(q=q, k=kv[0], v=kv[1], pools=(kp, vp), table=table, lens=torch.tensor(lens, dtype=torch.int32),
                ps=ps, layout=layout, m=m)


def call_kwargs(p, **over):
    kw = dict(q=p["q"], k_cache=p["k"], v_cache=p["v"], scale=0.125, workspace_buffer=torch.zeros(64, dtype=torch.uint8),
              max_sequence_kv=int(p["lens"].max()), actual_seq_lens_kv=p["lens"], block_tables=p["table"],
              is_cuda_graph_compatible=False, batch_offsets_q=None, batch_offsets_o=None, batch_offsets_k=None,
              batch_offsets_v=None, out=None, return_lse=False, lse=None, q_len_per_req=p["m"], window_left=-1,
              sinks=None)
    kw.update(over)
    return kw


def prepare(p, **over):
    kw = call_kwargs(p, **over)
    args = [kw.pop(n) for n in ("q", "k_cache", "v_cache", "scale", "workspace_buffer")]
    return api.prepare_call(*args, **kw)


def oracle(p, *, scale=0.125, window_left=-1, sinks=None):
    indptr, indices, last = ref.block_tables_to_csr(p["table"], p["lens"], p["ps"])
    kp, vp = p["pools"]
    kw = dict(kv_layout=p["layout"], sm_scale=scale, window_left=window_left, sinks=sinks)
    if p["m"] == 1:
        return ref.paged_decode(p["q"], kp, vp, indptr, indices, last, **kw)
    B = p["table"].shape[0]
    qo = torch.arange(B + 1, dtype=torch.int32) * p["m"]
    return ref.paged_prefill(p["q"], kp, vp, qo, indptr, indices, last, causal=True, **kw)


# ============================================================================= validation
@pytest.fixture
def no_frontend(monkeypatch):
    def missing():
        raise ImportError("No module named 'cudnn'")

    monkeypatch.setattr(cd, "require_cudnn", missing)


def test_valid_call_without_frontend_names_what_serves_it(no_frontend):
    p = problem()
    with pytest.raises(NotImplementedError) as ei:
        fn(**call_kwargs(p))
    msg = str(ei.value)
    for s in ("cudnn-frontend not installed", "nvidia-cudnn-frontend", "bf16-only", "cubin",
              "BatchDecodeWithPagedKVCacheWrapper", "backend='cute'", "fp16"):
        assert s in msg, (s, msg)
    assert isinstance(ei.value.__cause__, ImportError)


def test_valid_call_on_cpu_tensors_is_value_error(monkeypatch):
    monkeypatch.setattr(cd, "require_cudnn", lambda: types.SimpleNamespace())
    with pytest.raises(ValueError, match="CUDA device"):
        fn(**call_kwargs(problem()))


META = torch.device("meta")

BAD = [
    (dict(q_len_per_req=0), ValueError, "q_len_per_req must be >= 1"),
    (dict(q_len_per_req=2.0), TypeError, "q_len_per_req must be an int"),
    (dict(q_len_per_req=2), ValueError, r"batch_size \* q_len_per_req"),
    (dict(q="q"), TypeError, "q must be a torch.Tensor"),
    (dict(q=torch.zeros(3, 8, 64, dtype=torch.float32)), ValueError, "only supports torch.float16 and torch.bfloat16"),
    (dict(q=torch.zeros(3, 8, 64, dtype=FP16)), ValueError, "share one dtype"),
    (dict(k_cache=torch.zeros(8, 2, 16, dtype=BF16)), ValueError, "k_cache must be 4-D"),
    (dict(v_cache=torch.zeros(9, 2, 16, 64, dtype=BF16)), ValueError, "must agree on"),
    (dict(k_cache=torch.zeros(13, 2, 16, 32, dtype=BF16)), ValueError, "k_cache head_dim"),
    (dict(q=torch.zeros(3, 7, 64, dtype=BF16)), ValueError, "multiple of num_heads_kv"),
    (dict(scale=None), TypeError, "scale .*required"),
    (dict(scale="x"), TypeError, "scale must be a float"),
    (dict(scale=float("nan")), ValueError, "scale must be finite"),
    (dict(max_sequence_kv=0), ValueError, "max_sequence_kv must be >= 1"),
    (dict(max_sequence_kv=None), TypeError, "max_sequence_kv must be an int"),
    (dict(window_left=-2), ValueError, "window_left must be >= -1"),
    (dict(is_cuda_graph_compatible=1), TypeError, "is_cuda_graph_compatible must be a bool"),
    (dict(return_lse=None), TypeError, "return_lse must be a bool"),
    (dict(workspace_buffer=torch.zeros(8, dtype=torch.uint8, device=META)), ValueError, "workspace_buffer is on"),
    (dict(block_tables=None), ValueError, "block_tables is required"),
    (dict(block_tables=torch.zeros(3, 5, dtype=torch.int64)), ValueError, "block_tables must be int32"),
    (dict(block_tables=torch.zeros(2, 5, dtype=torch.int32)), ValueError, "block_tables must have shape"),
    (dict(block_tables=torch.zeros(3, 5, dtype=torch.int32, device=META)), ValueError, "block_tables is on"),
    (dict(actual_seq_lens_kv=torch.zeros(3)), ValueError, "actual_seq_lens_kv must be int32"),
    (dict(actual_seq_lens_kv=torch.zeros(4, dtype=torch.int32)), ValueError, "actual_seq_lens_kv must have shape"),
    (dict(actual_seq_lens_kv=torch.zeros(3, 1, dtype=torch.int32)), ValueError, "actual_seq_lens_kv must have shape"),
    (dict(actual_seq_lens_kv=torch.zeros(3, dtype=torch.int32, device=META)), ValueError, "on the device"),
    (dict(actual_seq_lens_kv=None, max_sequence_kv=81), ValueError, "capacity"),
    (dict(sinks=torch.zeros(8, dtype=BF16)), ValueError, "sinks"),
    (dict(sinks=torch.zeros(4)), ValueError, "sinks must have shape"),
    (dict(out=torch.zeros(3, 8, 32, dtype=BF16)), ValueError, "out must have shape"),
    (dict(out=torch.zeros(3, 8, 64, dtype=FP16)), ValueError, "dtype of out"),
    (dict(out=torch.zeros(8, 3, 64, dtype=BF16).transpose(0, 1)), ValueError, "out must be contiguous"),
    (dict(return_lse=True, lse=torch.zeros(3, 8, dtype=torch.float64)), ValueError, "dtype of lse"),
    (dict(return_lse=True, lse=torch.zeros(3, 4)), ValueError, "lse must have shape"),
    (dict(return_lse=True, lse=torch.zeros(8, 3).t()), ValueError, "lse must be contiguous"),
    (dict(batch_offsets_q=torch.zeros(3)), ValueError, "batch_offsets_q must be int32 or int64"),
    (dict(batch_offsets_o=torch.zeros(5, dtype=torch.int32)), ValueError, "batch_offsets_o must have shape"),
    (dict(batch_offsets_k=torch.zeros(3, dtype=torch.int32, device=META)), ValueError, "batch_offsets_k is on"),
    (dict(batch_offsets_q=torch.tensor([0, 256, 1024], dtype=torch.int32)), NotImplementedError, "non-dense"),
    (dict(batch_offsets_o=torch.tensor([0, 1, 2, 3])), NotImplementedError, "non-dense"),
    (dict(batch_offsets_v=torch.tensor([0, 10, 20])), NotImplementedError, "block table addresses K/V"),
]


@pytest.mark.parametrize("over,exc,match", BAD, ids=[f"{i}-{b[2][:24]}" for i, b in enumerate(BAD)])
def test_validation_errors(over, exc, match, no_frontend):
    with pytest.raises(exc, match=match):
        fn(**call_kwargs(problem(), **over))


def test_fp8_and_head_dims_not_implemented(no_frontend):
    p = problem()
    if hasattr(torch, "float8_e4m3fn"):
        k8 = p["k"].to(torch.float8_e4m3fn)
        with pytest.raises(NotImplementedError, match="fp8"):
            fn(**call_kwargs(p, k_cache=k8, v_cache=k8))
    p = problem(d=12, hq=2, hkv=1)
    with pytest.raises(NotImplementedError, match="head_dim_qk=12"):
        fn(**call_kwargs(p))
    p = problem(d=264, hq=2, hkv=1)
    with pytest.raises(NotImplementedError, match="<= 256"):
        fn(**call_kwargs(p))


def test_dense_offsets_accepted():
    p = problem(m=2, lens=(40, 17, 64))
    B, rows = 3, 6
    qs = p["q"].stride(0)
    for dt in (torch.int32, torch.int64):
        for n in (B, B + 1):
            c = prepare(p, batch_offsets_q=(torch.arange(n) * 2 * qs).to(dt),
                        batch_offsets_o=(torch.arange(n) * 2 * 8 * 64).to(dt),
                        batch_offsets_k=torch.zeros(n, dtype=dt), batch_offsets_v=torch.zeros(n, dtype=dt))
            assert c.out.shape == (rows, 8, 64)


def test_dense_offsets_follow_q_batch_stride():
    p = problem()
    qkv = torch.randn(3, (8 + 2 + 2) * 64).to(BF16)
    q = qkv[:, :8 * 64].view(3, 8, 64)  # a packed-QKV slice: row stride 12 * 64
    prepare(p, q=q, batch_offsets_q=torch.arange(3) * 12 * 64)
    with pytest.raises(NotImplementedError, match="non-dense"):
        prepare(p, q=q, batch_offsets_q=torch.arange(3) * 8 * 64)


def test_gpu_offsets_during_capture_are_refused():
    with pytest.raises(ValueError, match="CUDA-graph capture"):
        api.check_dense_offsets("batch_offsets_q", torch.zeros(3, dtype=torch.int32, device=META), batch_size=3,
                                step=0, device=META, capturing=True)


# ============================================================================= the graph key
def key_of(p, **over):
    return prepare(p, **over).key


def test_key_layouts_and_dtypes_move_it():
    base = key_of(problem())
    assert key_of(problem()) == base and hash(key_of(problem())) == hash(base)
    nhd = key_of(problem(layout="NHD"))
    assert nhd != base and nhd.k_layout[0] == base.k_layout[0] and nhd.k_layout[1] != base.k_layout[1]
    assert key_of(problem(dtype=FP16)) != base
    p = problem()
    qkv = torch.randn(3, 12 * 64).to(BF16)
    strided = key_of(p, q=qkv[:, :8 * 64].view(3, 8, 64))
    assert strided != base and strided.q_layout[0] == base.q_layout[0]
    assert key_of(problem(width=6)) != base  # table width: rows walked with another stride
    for over in (dict(scale=0.25), dict(window_left=3), dict(return_lse=True), dict(is_cuda_graph_compatible=True),
                 dict(sinks=torch.zeros(8))):
        assert key_of(p, **over) != base, over
    assert key_of(problem(m=2, lens=(40, 17, 64))) != key_of(problem(B=6, lens=(40, 17, 64, 1, 2, 3)))


def test_key_ignores_lengths_and_table_contents():
    p = problem()
    base = key_of(p)
    q = problem(seed=5)
    assert key_of(q) == base  # other values, other page ids, same layouts
    assert key_of(p, actual_seq_lens_kv=torch.tensor([1, 2, 3], dtype=torch.int32)) == base
    assert key_of(p, actual_seq_lens_kv=torch.tensor([1, 2, 3], dtype=torch.int64)) == base
    assert key_of(p, actual_seq_lens_kv=torch.tensor([1, 2, 3], dtype=torch.int32).reshape(3, 1, 1, 1)) == base
    assert key_of(p, max_sequence_kv=5) == base  # 64 -> bucket 128 -> capped 80 either way


def test_key_max_kv_buckets():
    p = problem(lens=(300, 17, 64), width=40)  # capacity 640
    k = lambda n: key_of(p, max_sequence_kv=n).max_kv  # noqa: E731
    assert [k(n) for n in (1, 128, 129, 256, 257, 300, 512, 513, 639, 10_000)] == \
        [128, 128, 256, 256, 512, 512, 512, 640, 640, 640]
    assert cd.bucket_max_kv(5, 48) == 48 and cd.bucket_max_kv(1000, 4096) == 1024
    with pytest.raises(ValueError):
        cd.bucket_max_kv(0, 16)


def test_key_rejects_bad_fields():
    good = key_of(problem())
    import dataclasses
    for over in (dict(dtype=torch.float32), dict(batch=0), dict(num_kv_heads=3), dict(window_left=-2),
                 dict(max_kv=10_000)):
        with pytest.raises(ValueError):
            dataclasses.replace(good, **over)
    assert not good.causal and dataclasses.replace(good, window_left=0).causal
    assert dataclasses.replace(good, q_len_per_req=2).causal


def test_unaligned_q_is_copied_dense():
    p = problem()
    q = torch.randn(3, 8, 65).to(BF16)[:, :, 1:]  # misaligned base pointer and 65-element rows
    c = prepare(p, q=q)
    assert c.key.q_layout[1] == (512, 64, 512, 1)
    assert torch.equal(c.q[:, :, 0], q)


# ============================================================================= a stand-in cudnn module
class FakeTensor:
    def __init__(self, name, dim=None, stride=None, data_type=None, uid=None):
        self.name, self.dim, self.stride, self.data_type, self.uid = name, dim, stride, data_type, uid
        self.output = False

    def set_output(self, v):
        self.output = v
        return self

    def set_dim(self, d):
        self.dim = list(d)
        return self

    def set_stride(self, s):
        self.stride = list(s)
        return self

    def set_data_type(self, d):
        self.data_type = d
        return self

    def set_uid(self, u):
        self.uid = u
        return self


class NotSupported(Exception):
    pass


class FakeGraph:
    refuse = None

    def __init__(self, **kw):
        self.kw, self.tensors, self.sdpa_kw, self.built = kw, {}, None, None

    def tensor(self, name, dim, stride, data_type, uid):
        self.tensors[name] = FakeTensor(name, list(dim), list(stride), data_type, uid)
        return self.tensors[name]

    def sdpa(self, name, **kw):
        self.sdpa_kw = kw
        self.outputs = [FakeTensor("O"), FakeTensor("Stats") if kw["generate_stats"] else None]
        return list(self.outputs)

    def build(self, modes):
        if FakeGraph.refuse:
            raise NotSupported(FakeGraph.refuse)
        self.built = modes

    def get_workspace_size(self):
        return 1024


@pytest.fixture
def fake_cudnn(monkeypatch):
    dt = types.SimpleNamespace(HALF="HALF", BFLOAT16="BFLOAT16", FLOAT="FLOAT", INT32="INT32", INT64="INT64")
    mod = types.SimpleNamespace(
        pygraph=FakeGraph, data_type=dt, diagonal_alignment=types.SimpleNamespace(BOTTOM_RIGHT="BR"),
        heur_mode=types.SimpleNamespace(A="A", FALLBACK="FALLBACK"), cudnnGraphNotSupportedError=NotSupported,
        backend_version=lambda: 91900, __version__="1.32.0")
    monkeypatch.setattr(cp, "_cudnn_mod", mod)
    monkeypatch.setattr(cd, "_handle", lambda device: "handle")
    FakeGraph.refuse = None
    cd.clear_graph_cache()
    yield mod
    cd.clear_graph_cache()


def test_build_plain_decode_declaration(fake_cudnn):
    p = problem(layout="NHD")
    key = key_of(p, return_lse=True)
    g = cd.get_graph(key)
    fg = g.graph
    assert g.workspace_size == 1024 and fg.built == ["A", "FALLBACK"] and "is_cuda_graph_replay_expected" not in fg.kw
    assert fg.kw["io_data_type"] == "BFLOAT16" and fg.kw["compute_data_type"] == "FLOAT"
    q, k = fg.tensors["q"], fg.tensors["k_cache"]
    assert q.dim == [3, 8, 1, 64] and q.stride == [512, 64, 512, 1]
    assert k.dim == list(p["k"].shape) and k.stride == list(p["k"].stride())  # the NHD pool's transposed view
    tk = fg.tensors["block_table_k"]
    assert tk.dim == [3, 1, 5, 1] and tk.stride == [5, 5, 1, 1] and tk.data_type == "INT32"
    kw = fg.sdpa_kw
    assert kw["paged_attention_k_table"] is tk and kw["paged_attention_v_table"] is fg.tensors["block_table_v"]
    assert kw["paged_attention_max_seq_len_kv"] == 80 and kw["use_padding_mask"] is True
    assert kw["seq_len_q"] is fg.tensors["seq_len_q"] and kw["seq_len_kv"] is fg.tensors["seq_len_kv"]
    assert kw["attn_scale"] == 0.125 and kw["generate_stats"] is True
    assert not {"diagonal_alignment", "diagonal_band_left_bound", "sink_token"} & set(kw)
    o, stats = fg.outputs
    assert o.output and o.dim == [3, 8, 1, 64] and o.stride == [512, 64, 512, 1] and o.data_type == "BFLOAT16"
    assert stats.dim == [3, 8, 1, 1] and stats.stride == [8, 1, 8, 1] and stats.data_type == "FLOAT"
    assert cd.get_graph(key_of(p, return_lse=True)) is g
    assert cd.graph_cache_info() == dict(builds=1, hits=1, size=1)


def test_build_multi_token_window_sinks_declaration(fake_cudnn):
    p = problem(m=4, lens=(40, 17, 64))
    key = key_of(p, window_left=9, sinks=torch.zeros(8), is_cuda_graph_compatible=True)
    fg = cd.get_graph(key).graph
    assert fg.kw["is_cuda_graph_replay_expected"] is True
    assert fg.tensors["q"].dim == [3, 8, 4, 64] and fg.tensors["q"].stride == [4 * 512, 64, 512, 1]
    kw = fg.sdpa_kw
    assert kw["diagonal_alignment"] == "BR" and kw["diagonal_band_right_bound"] == 0
    assert kw["diagonal_band_left_bound"] == 10  # window_left=9 keeps 10 keys, the diagonal included
    s = fg.tensors["sinks"]
    assert kw["sink_token"] is s and s.dim == [1, 8, 1, 1] and s.data_type == "FLOAT"
    o = fg.outputs[0]
    assert o.dim == [3, 8, 4, 64] and o.stride == [4 * 512, 64, 512, 1]  # contiguous [B*4, 8, 64]
    assert fg.outputs[1] is None


def test_decline_names_feature_versions_and_server(fake_cudnn):
    FakeGraph.refuse = "decode only mode, i.e. s_q == 1, not supported with sink_token"
    with pytest.raises(NotImplementedError) as ei:
        cd.get_graph(key_of(problem(), sinks=torch.zeros(8)))
    msg = str(ei.value)
    for s in ("attention sinks at q_len_per_req == 1", "cuDNN 9.19.0", "cudnn-frontend 1.32.0",
              "BatchDecodeWithPagedKVCacheWrapper", "backend='cute'", "not supported with sink_token"):
        assert s in msg, (s, msg)
    assert isinstance(ei.value.__cause__, NotSupported) and cd.graph_cache_info()["size"] == 0


def test_get_graph_without_build_is_none_on_miss(fake_cudnn):
    key = key_of(problem())
    assert cd.get_graph(key, build=False) is None
    g = cd.get_graph(key)
    assert cd.get_graph(key, build=False) is g


def test_seq_len_q_constant_is_kept():
    t = cd.seq_len_q_tensor(torch.device("cpu"), 3, 4)
    assert t is cd.seq_len_q_tensor(torch.device("cpu"), 3, 4)
    assert t.dtype == torch.int32 and t.shape == (3, 1, 1, 1) and (t == 4).all()


# ============================================================================= emulated end to end
class Emulator:
    """Stands in for :func:`cutedsl_attn.cudnn.decode.run_graph`: float64 paged SDPA with cuDNN's declared
    semantics, reading each tensor through the key's layouts; Stats in natural log."""

    def __init__(self):
        self.keys = []

    def __call__(self, key, *, q, k, v, out, stats, seq_len_kv, block_table, sinks=None, workspace=None):
        self.keys.append(key)
        B, m, Hq, Hkv, Dvo = key.batch, key.q_len_per_req, key.num_qo_heads, key.num_kv_heads, key.head_dim_vo
        assert key.q_layout == (tuple(q.shape), tuple(q.stride()))
        assert key.k_layout == (tuple(k.shape), tuple(k.stride())) and key.v_layout == (tuple(v.shape), tuple(v.stride()))
        assert out.is_contiguous() and out.shape == (B * m, Hq, Dvo) and out.dtype == key.dtype
        assert seq_len_kv.dtype == torch.int32 and seq_len_kv.is_contiguous() and seq_len_kv.numel() == B
        assert block_table.dtype == torch.int32 and block_table.is_contiguous()
        assert block_table.shape == (B, key.table_width)
        assert (sinks is not None) == key.sinks and (stats is not None) == key.return_lse
        ps, group = key.page_size, Hq // Hkv
        for b in range(B):
            skv = int(seq_len_kv[b])
            assert m <= skv <= key.max_kv
            pages = block_table[b].tolist()
            kb = torch.stack([k[pages[j // ps], :, j % ps] for j in range(skv)]).double().repeat_interleave(group, 1)
            vb = torch.stack([v[pages[j // ps], :, j % ps] for j in range(skv)]).double().repeat_interleave(group, 1)
            s = torch.einsum("hqd,khd->hqk", q[b].double(), kb) * key.sm_scale  # q[b]: (Hq, m, D)
            i, j = torch.arange(m).reshape(m, 1), torch.arange(skv).reshape(1, skv)
            vis = torch.ones(m, skv, dtype=torch.bool)
            if key.causal:
                vis &= j <= i + skv - m
                if key.window_left >= 0:
                    vis &= j > i + skv - m - (key.window_left + 1)
            s = s.masked_fill(~vis, float("-inf"))
            if sinks is not None:
                s = torch.cat([s, sinks.double().reshape(Hq, 1, 1).expand(Hq, m, 1)], -1)
                vb = torch.cat([vb, torch.zeros(1, Hq, Dvo, dtype=vb.dtype)])
            out[b * m:(b + 1) * m] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vb).to(out.dtype)
            if stats is not None:
                stats[b * m:(b + 1) * m] = torch.logsumexp(s, -1).t().float()


@pytest.fixture
def emu(monkeypatch):
    e = Emulator()
    monkeypatch.setattr(cd, "run_graph", e)
    return e


def run_emulated(p, **over):
    return api.execute_call(prepare(p, **over))


def check_close(out, o_ref, lse=None, lse_ref=None, what=""):
    assert not torch.isnan(out).any(), what
    e = ((out.double() - o_ref).norm() / o_ref.norm()).item()
    assert e < 1e-2, (what, e)
    if lse is not None:
        assert (lse.double() - lse_ref).abs().max().item() < 1e-3, what


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("heads", [(8, 2), (4, 1)])
def test_emulated_vs_oracle(emu, m, layout, heads):
    p = problem(m=m, hq=heads[0], hkv=heads[1], layout=layout, lens=(40, 17, 64))
    out, lse = run_emulated(p, return_lse=True)
    o_ref, lse_ref = oracle(p)
    check_close(out, o_ref, lse, lse_ref, f"m={m} {layout} {heads}")


@pytest.mark.parametrize("m", [1, 4])
def test_emulated_window_and_sinks(emu, m):
    p = problem(m=m, lens=(40, 17, 64))
    sinks = torch.randn(8)
    out, lse = run_emulated(p, window_left=5, sinks=sinks, return_lse=True)
    o_ref, lse_ref = oracle(p, window_left=5, sinks=sinks)
    check_close(out, o_ref, lse, lse_ref, f"m={m} window+sinks")


def test_emulated_lse_is_base_2_and_given_buffers_are_used(emu):
    p = problem()
    out = torch.full((3, 8, 64), float("nan"), dtype=BF16)
    lse = torch.full((3, 8), float("nan"))
    r = run_emulated(p, out=out, lse=lse, return_lse=True)
    assert r[0] is out and r[1] is lse
    o_ref, lse_ref = oracle(p)
    check_close(out, o_ref, lse, lse_ref)
    # the conversion itself: natural-log stats times log2(e) are log2 of the same sum
    s = torch.randn(5, 40, dtype=torch.float64)
    assert torch.allclose(torch.logsumexp(s, -1) * cd.LOG2E, torch.log2(torch.exp(s).sum(-1)))
    assert math.isclose(cd.LOG2E, 1 / math.log(2)) and math.isclose(cd.LOG2E, ref.LOG2E)
    assert run_emulated(p, lse=lse) is not None and isinstance(run_emulated(p), torch.Tensor)


def test_emulated_strided_q_and_reused_key_with_new_lengths(emu):
    p = problem(lens=(40, 17, 64))
    qkv = torch.randn(3, 12 * 64).to(BF16)
    q = qkv[:, :8 * 64].view(3, 8, 64)
    p["q"] = q
    out = run_emulated(p)
    check_close(out, oracle(p)[0], what="QKV slice")
    p2 = dict(p, lens=torch.tensor([33, 30, 50], dtype=torch.int32))
    out2 = run_emulated(p2)
    check_close(out2, oracle(p2)[0], what="new lengths")
    assert emu.keys[0] == emu.keys[1]


def test_emulated_lengths_default_to_max_sequence_kv(emu):
    p = problem(lens=(48, 48, 48))
    out = run_emulated(p, actual_seq_lens_kv=None, max_sequence_kv=48)
    check_close(out, oracle(p)[0])


@pytest.mark.parametrize("m,extra", [(1, {}), (4, dict(return_lse=True, window_left=3)),
                                     (2, dict(return_lse=True, sinks=torch.zeros(8)))])
def test_bound_views_match_the_declaration(fake_cudnn, m, extra):
    """What ``execute`` binds has exactly the dims and strides the graph declares, uid by uid."""
    for layout in ("HND", "NHD"):
        c = prepare(problem(m=m, layout=layout, lens=(40, 17, 64)), **extra)
        fg = cd.get_graph(c.key).graph
        declared = {t.uid: t for t in list(fg.tensors.values()) + [t for t in fg.outputs if t is not None]}
        binds = cd.bind_map(c.key, q=c.q, k=c.k_cache, v=c.v_cache, out=c.out, stats=c.lse,
                            seq_len_q=cd.seq_len_q_tensor(torch.device("cpu"), c.key.batch, m),
                            seq_len_kv=c.seq_lens_kv, block_table=c.block_table, sinks=c.sinks)
        assert set(binds) == set(declared)
        for uid, t in binds.items():
            d = declared[uid]
            assert list(t.shape) == d.dim and list(t.stride()) == d.stride, (d.name, t.shape, t.stride(), d.dim, d.stride)
        assert binds[int(cd._UID.O)].data_ptr() == c.out.data_ptr()


def test_multirow_needs_table_columns_up_to_the_128_key_tile():
    # cuDNN's q_len_per_req > 1 graph reads whole 128-key tiles: a table narrower than that is refused up front
    p = problem(m=2)
    narrow = p["table"][:, :5].contiguous()
    with pytest.raises(ValueError, match="block_tables has 5 columns.*needs >= 8"):
        prepare(p, block_tables=narrow)

