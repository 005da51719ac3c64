"""CPU tests of the ``backend="cudnn"`` prefill path (no GPU, no cuDNN needed).

* validation: every unsupported feature raises ``NotImplementedError`` naming it at ``plan()``
  (or at ``run()`` for run-only arguments), malformed arguments ``ValueError``/``TypeError``,
  a missing cudnn-frontend ``ImportError`` naming ``nvidia-cudnn-frontend``;
* bucketing and the frozen graph key;
* the graph declaration (dims, strides, ragged offsets, mask and paging attributes), built
  against a recording stand-in for the ``cudnn`` module;
* the plan/run glue end to end: ``run_graph`` is replaced by a float64 *emulator* of cuDNN's
  SDPA semantics that reads every bound tensor exactly as the graph declares it (ragged element
  offsets, strides, seq lengths, block table, padding mask, bottom-right diagonal, band) and
  writes NaN into rows with no visible key, so the results checked against ``cutedsl_attn.ref``
  also exercise the offsets/tables/fix-ups this package computes.

Tests that need the real ``cudnn`` package skip when it is not importable.
"""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import pytest
import torch

import cutedsl_attn as ca
from cutedsl_attn import ref
from cutedsl_attn.api import cudnn as api_cudnn
from cutedsl_attn.cudnn import prefill as cp

BF16, FP16 = torch.bfloat16, torch.float16
Ragged = ca.BatchPrefillWithRaggedKVCacheWrapper
Paged = ca.BatchPrefillWithPagedKVCacheWrapper
LN2 = math.log(2.0)


def ws(nbytes=1 << 16):
    return torch.zeros(nbytes, dtype=torch.uint8)


def indptr(lens):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


# ============================================================================= a stand-in cudnn module
class FakeTensor:
    def __init__(self, name, dim=None, stride=None, data_type=None, uid=None):
        self.name, self.dim, self.stride, self.data_type, self.uid = name, dim, stride, data_type, uid
        self.ragged = None
        self.output = False

    def set_ragged_offset(self, t):
        self.ragged = t
        return self

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


class FakeGraph:
    instances: list = []

    def __init__(self, **kw):
        self.kw = kw
        self.tensors = {}
        self.sdpa_kw = None
        self.built = None
        self.outputs = None
        FakeGraph.instances.append(self)

    def tensor(self, name, dim, stride, data_type, uid):
        t = FakeTensor(name, list(dim), list(stride), data_type, uid)
        self.tensors[name] = t
        return t

    def sdpa(self, name, **kw):
        self.sdpa_kw = kw
        self.outputs = (FakeTensor("O"), FakeTensor("Stats") if kw["generate_stats"] else None)
        return list(self.outputs)

    def build(self, modes):
        self.built = modes

    def get_workspace_size(self):
        return 4096


class NotSupported(Exception):
    pass


def fake_cudnn_module():
    dt = types.SimpleNamespace(HALF="HALF", BFLOAT16="BFLOAT16", FLOAT="FLOAT", INT32="INT32", INT64="INT64")
    return types.SimpleNamespace(
        pygraph=FakeGraph, data_type=dt, diagonal_alignment=types.SimpleNamespace(BOTTOM_RIGHT="BR", TOP_LEFT="TL"),
        heur_mode=types.SimpleNamespace(A="A", FALLBACK="FALLBACK"), cudnnGraphNotSupportedError=NotSupported,
        backend_version=lambda: 91900, __version__="1.32.0", create_handle=lambda: "handle",
        set_stream=lambda h, s: None, destroy_handle=lambda h: None,
    )


@pytest.fixture
def fake_cudnn(monkeypatch):
    """The cudnn module replaced by a recorder; the handle helper needs no GPU."""
    FakeGraph.instances = []
    monkeypatch.setattr(cp, "_cudnn_mod", fake_cudnn_module())
    monkeypatch.setattr(cp, "_handle", lambda device: "handle")
    cp.clear_graph_cache()
    yield
    cp.clear_graph_cache()


# ============================================================================= the cuDNN emulator
UID = cp._UID


class Emulator:
    """Stands in for :func:`cutedsl_attn.cudnn.prefill.run_graph`: float64 SDPA with cuDNN's declared
    semantics, reading each bound tensor through the key's declared layout.  Records every call."""

    def __init__(self):
        self.calls = []

    def __call__(self, key, *, q, k, v, out, stats, seq_len_q, seq_len_kv, q_offsets, o_offsets, k_offsets=None,
                 v_offsets=None, stats_offsets=None, block_table=None, workspace=None, workspace_owner=None):
        self.calls.append(dict(key=key, q=q, k=k, v=v, out=out, stats=stats, seq_len_q=seq_len_q,
                               seq_len_kv=seq_len_kv, q_offsets=q_offsets, o_offsets=o_offsets, k_offsets=k_offsets,
                               v_offsets=v_offsets, stats_offsets=stats_offsets, block_table=block_table))
        B, Hq, Hkv = key.batch, key.num_qo_heads, key.num_kv_heads
        Dqk, Dvo = key.head_dim_qk, key.head_dim_vo
        # what the graph would assume about the bound tensors
        assert key.q_strides == (q.stride(0), q.stride(1)) and q.stride(2) == 1
        assert key.o_strides == (out.stride(0), out.stride(1)) and out.stride(2) == 1
        assert key.dtype == q.dtype == k.dtype == v.dtype == out.dtype
        for t in (seq_len_q, seq_len_kv):
            assert t.dtype == torch.int32 and tuple(t.shape) == (B, 1, 1, 1)
        offs = [q_offsets, o_offsets] + ([] if key.paged else [k_offsets, v_offsets])
        if key.return_lse and key.packed_lse:
            offs.append(stats_offsets)
        for t in offs:
            assert t.dtype == key.offset_dtype and t.numel() == B + 1
        if key.return_lse:
            assert stats.dtype == torch.float32 and stats.is_contiguous()
        if key.paged:
            assert block_table.dtype == torch.int32 and tuple(block_table.shape) == (B, 1, key.table_width, 1)
            assert key.k_layout == (tuple(k.shape), tuple(k.stride()))
            ps = k.shape[2]
        else:
            assert key.k_layout == (k.stride(0), k.stride(1)) and key.v_layout == (v.stride(0), v.stride(1))
        lq, lkv = seq_len_q.reshape(-1).tolist(), seq_len_kv.reshape(-1).tolist()
        qo, oo = q_offsets.reshape(-1).tolist(), o_offsets.reshape(-1).tolist()
        group = Hq // Hkv
        for b in range(B):
            sq, skv = lq[b], lkv[b]
            assert 0 <= sq <= key.max_q and 0 <= skv <= key.max_kv
            if sq == 0:
                continue
            qb = torch.as_strided(q, (sq, Hq, Dqk), (q.stride(0), q.stride(1), 1), q.storage_offset() + qo[b])
            if key.paged:
                pages = block_table[b, 0, :, 0].tolist()
                kt = [k[pages[j // ps], :, j % ps] for j in range(skv)]
                vt = [v[pages[j // ps], :, j % ps] for j in range(skv)]
                kb = torch.stack(kt) if kt else torch.zeros(0, Hkv, Dqk, dtype=k.dtype)
                vb = torch.stack(vt) if vt else torch.zeros(0, Hkv, Dvo, dtype=v.dtype)
            else:
                ko, vo = k_offsets.reshape(-1).tolist(), v_offsets.reshape(-1).tolist()
                kb = torch.as_strided(k, (skv, Hkv, Dqk), (k.stride(0), k.stride(1), 1), k.storage_offset() + ko[b])
                vb = torch.as_strided(v, (skv, Hkv, Dvo), (v.stride(0), v.stride(1), 1), v.storage_offset() + vo[b])
            kx = kb.double().repeat_interleave(group, 1)
            vx = vb.double().repeat_interleave(group, 1)
            s = torch.einsum("qhd,khd->hqk", qb.double(), kx) * key.sm_scale
            i = torch.arange(sq).reshape(sq, 1)
            j = torch.arange(skv).reshape(1, skv)
            vis = torch.ones(sq, skv, dtype=torch.bool)
            if key.causal:  # bottom-right diagonal anchored at this request's actual lengths
                vis &= j <= i + (skv - sq)
                if key.window_left >= 0:  # diagonal_band_left_bound = window_left + 1
                    vis &= j > i + (skv - sq) - (key.window_left + 1)
            s = s.masked_fill(~vis, float("-inf"))
            lse = torch.logsumexp(s, -1)  # [Hq, sq], natural log
            o = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vx)
            empty = ~vis.any(-1)  # engine garbage in rows with no visible key
            o[empty] = float("nan")
            lse[:, empty] = float("nan")
            torch.as_strided(out, (sq, Hq, Dvo), (out.stride(0), out.stride(1), 1),
                             out.storage_offset() + oo[b]).copy_(o)
            if key.return_lse:
                so = stats_offsets.reshape(-1).tolist()[b] if key.packed_lse else b * key.max_q * Hq
                torch.as_strided(stats, (sq, Hq), (Hq, 1), stats.storage_offset() + so).copy_(lse.t())
        return None


@pytest.fixture
def emu(monkeypatch, fake_cudnn):
    e = Emulator()
    monkeypatch.setattr(cp, "run_graph", e)
    monkeypatch.setattr(api_cudnn, "_require_cuda", lambda device: None)
    return e


def rel_err(x, y):
    x, y = x.double(), y.double()
    return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()


def check_close(out, lse, o_ref, lse_ref, what=""):
    assert not torch.isnan(out).any(), f"{what}: NaN in out"
    assert rel_err(out, o_ref) <= 1e-2, f"{what}: out rel err {rel_err(out, o_ref)}"
    fin = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), fin), f"{what}: LSE -inf pattern"
    assert (lse[~fin] == float("-inf")).all()
    if fin.any():
        assert (lse[fin].double() - lse_ref[fin]).abs().max().item() < 1e-3, what
    if (~fin).any():
        assert (out[~fin] == 0).all(), f"{what}: rows with no visible key must be 0"


# ============================================================================= bucketing and the key
def test_bucket_batch():
    assert [cp.bucket_batch(b) for b in (0, 1, 2, 3, 4, 5, 8, 9, 1000)] == [1, 1, 2, 4, 4, 8, 8, 16, 1024]
    with pytest.raises(ValueError):
        cp.bucket_batch(-1)


def test_bucket_seq_len():
    m = cp.SEQ_LEN_BUCKET_MIN
    assert cp.bucket_seq_len(0) == m and cp.bucket_seq_len(1) == m and cp.bucket_seq_len(m) == m
    assert cp.bucket_seq_len(m + 1) == 2 * m
    assert cp.bucket_seq_len(4000) == 4096 and cp.bucket_seq_len(4096) == 4096 and cp.bucket_seq_len(4097) == 8192
    with pytest.raises(ValueError):
        cp.bucket_seq_len(-3)


def key_kwargs(**over):
    kw = dict(device_index=0, dtype=BF16, batch=4, max_q=128, max_kv=256, num_qo_heads=32, num_kv_heads=8,
              head_dim_qk=128, head_dim_vo=128, sm_scale=0.125, causal=True, window_left=-1, return_lse=True,
              packed_lse=True, q_strides=(4096, 128), o_strides=(4096, 128), paged=False,
              k_layout=(1024, 128), v_layout=(1024, 128))
    kw.update(over)
    return kw


def test_key_frozen_hashable_and_equal():
    a, b = cp.PrefillGraphKey(**key_kwargs()), cp.PrefillGraphKey(**key_kwargs())
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != cp.PrefillGraphKey(**key_kwargs(causal=False))
    assert a != cp.PrefillGraphKey(**key_kwargs(sm_scale=0.1))
    assert a != cp.PrefillGraphKey(**key_kwargs(q_strides=(8192, 128)))
    with pytest.raises(Exception):  # frozen
        a.batch = 8


@pytest.mark.parametrize("over", [dict(dtype=torch.float32), dict(num_kv_heads=5), dict(window_left=3, causal=False),
                                  dict(paged=True, table_width=0), dict(batch=0), dict(offset_dtype=torch.int16)])
def test_key_rejects_bad_fields(over):
    with pytest.raises(ValueError):
        cp.PrefillGraphKey(**key_kwargs(**over))


def test_describe_batch_ragged():
    qo, kv = [5, 0, 70, 3], [9, 4, 200, 0]
    lay = cp.describe_batch(indptr(qo), torch.tensor(kv), causal=True, kv_starts=indptr(kv)[:-1])
    assert lay.batch == 4 and lay.graph_batch == 4 and lay.max_q == 128 and lay.max_kv == 256
    assert lay.qo_lens.tolist() == qo and lay.kv_lens.tolist() == kv
    assert lay.q_indptr.tolist() == indptr(qo).tolist() and lay.kv_indptr.tolist() == indptr(kv).tolist()
    # request 3 (qo 3, kv 0): all its rows are empty; no causal row of the others is empty
    assert lay.empty_rows.tolist() == [75, 76, 77]
    assert lay.active and lay.page_starts is None and lay.table_width == 0


def test_describe_batch_pads_to_bucket():
    qo, kv = [3, 20, 1], [10, 5, 1]
    lay = cp.describe_batch(indptr(qo), torch.tensor(kv), causal=True, kv_starts=indptr(kv)[:-1])
    assert lay.graph_batch == 4
    assert lay.qo_lens.tolist() == [3, 20, 1, 0] and lay.kv_lens.tolist() == [10, 5, 1, 0]
    assert lay.q_indptr.tolist() == [0, 3, 23, 24, 24] and lay.kv_indptr.tolist() == [0, 10, 15, 16, 16]
    # causal, qo 20 > kv 5: the first 15 rows of request 1 see no key
    assert lay.empty_rows.tolist() == list(range(3, 18))
    nc = cp.describe_batch(indptr(qo), torch.tensor(kv), causal=False, kv_starts=indptr(kv)[:-1])
    assert nc.empty_rows.numel() == 0
    exact = cp.describe_batch(indptr(qo), torch.tensor(kv), causal=True, kv_starts=indptr(kv)[:-1], bucket=False)
    assert (exact.graph_batch, exact.max_q, exact.max_kv) == (3, 20, 10)


def test_describe_batch_inactive_and_empty():
    lay = cp.describe_batch(indptr([2, 0]), torch.tensor([0, 7]), causal=False, kv_starts=torch.tensor([0, 0]))
    assert not lay.active and lay.empty_rows.tolist() == [0, 1]
    empty = cp.describe_batch(indptr([]), torch.zeros(0, dtype=torch.int64), causal=True,
                              kv_starts=torch.zeros(0, dtype=torch.int64))
    assert empty.batch == 0 and empty.graph_batch == 1 and not empty.active


def test_describe_batch_paged_and_dense_table():
    ps = 16
    kv = [33, 0, 16, 100]
    npages = [-(-x // ps) for x in kv]
    flat = torch.tensor([7, 3, 9, 4, 1, 2, 8, 0, 5, 6, 11], dtype=torch.int32)
    starts = indptr(npages)[:-1].to(torch.int64)
    lay = cp.describe_batch(indptr([1, 2, 3, 4]), torch.tensor(kv), causal=True, page_starts=starts, page_size=ps)
    assert lay.kv_indptr is None and lay.page_size == ps and lay.table_width == lay.max_kv // ps == 8
    t = cp.dense_block_table(flat, lay.page_starts, lay.kv_lens, ps, lay.table_width)
    assert t.dtype == torch.int32 and tuple(t.shape) == (4, 1, 8, 1)
    t = t.reshape(4, 8)
    for b, n in enumerate(npages):
        s = int(starts[b])
        assert t[b, :n].tolist() == flat[s:s + n].tolist()
        assert (t[b, n:] == 0).all()


def test_describe_batch_needs_one_kv_form():
    with pytest.raises(ValueError, match="exactly one"):
        cp.describe_batch(indptr([1]), torch.tensor([1]), causal=True)
    with pytest.raises(ValueError, match="page_size"):
        cp.describe_batch(indptr([1]), torch.tensor([1]), causal=True, page_starts=torch.tensor([0]), page_size=0)


# ============================================================================= the graph declaration
def test_build_ragged_graph_declaration(fake_cudnn):
    key = cp.PrefillGraphKey(**key_kwargs(window_left=7))
    g = cp.get_graph(key)
    fg = g.graph
    assert g.workspace_size == 4096 and fg.built == ["A", "FALLBACK"]
    assert fg.kw["io_data_type"] == "BFLOAT16" and fg.kw["compute_data_type"] == "FLOAT"
    B, Sq, Skv = 4, 128, 256
    q, k, v = fg.tensors["q"], fg.tensors["k"], fg.tensors["v"]
    assert q.dim == [B, 32, Sq, 128] and q.stride == [Sq * 4096, 128, 4096, 1]
    assert k.dim == [B, 8, Skv, 128] and k.stride == [Skv * 1024, 128, 1024, 1]
    for t, off in ((q, "q_offsets"), (k, "k_offsets"), (v, "v_offsets")):
        assert t.ragged is fg.tensors[off]
        assert fg.tensors[off].dim == [B + 1, 1, 1, 1] and fg.tensors[off].data_type == "INT64"
    kw = fg.sdpa_kw
    assert kw["use_padding_mask"] is True and kw["generate_stats"] is True and kw["attn_scale"] == 0.125
    assert kw["seq_len_q"] is fg.tensors["seq_len_q"] and fg.tensors["seq_len_q"].data_type == "INT32"
    assert kw["diagonal_alignment"] == "BR" and kw["diagonal_band_right_bound"] == 0
    assert kw["diagonal_band_left_bound"] == 8  # FlashInfer window_left=7 keeps 8 keys
    assert "paged_attention_k_table" not in kw and "paged_attention_max_seq_len_kv" not in kw
    o, stats = fg.outputs
    assert o.output and o.dim == [B, 32, Sq, 128] and o.stride == [Sq * 4096, 128, 4096, 1]
    assert o.ragged is fg.tensors["o_offsets"] and o.uid == int(UID.O)
    assert stats.output and stats.dim == [B, 32, Sq, 1] and stats.stride == [Sq * 32, 1, 32, 1]
    assert stats.data_type == "FLOAT" and stats.ragged is fg.tensors["stats_offsets"]
    # cached: the same key does not build again
    assert cp.get_graph(cp.PrefillGraphKey(**key_kwargs(window_left=7))) is g
    assert cp.graph_cache_info()["builds"] == 1 and cp.graph_cache_info()["hits"] == 1


def test_build_paged_noncausal_graph_declaration(fake_cudnn):
    kshape, kstride = (50, 8, 16, 64), (16 * 8 * 64, 64, 8 * 64, 1)  # an NHD pool as its HND view
    key = cp.PrefillGraphKey(**key_kwargs(head_dim_qk=64, head_dim_vo=64, causal=False, return_lse=False,
                                          q_strides=(2048, 64), o_strides=(2048, 64), paged=True,
                                          k_layout=(kshape, kstride), v_layout=(kshape, kstride), table_width=16))
    fg = cp.get_graph(key).graph
    k = fg.tensors["k_cache"]
    assert k.dim == list(kshape) and k.stride == list(kstride) and k.ragged is None
    tk = fg.tensors["block_table_k"]
    assert tk.dim == [4, 1, 16, 1] and tk.data_type == "INT32"
    kw = fg.sdpa_kw
    assert kw["paged_attention_k_table"] is tk and kw["paged_attention_v_table"] is fg.tensors["block_table_v"]
    assert kw["paged_attention_max_seq_len_kv"] == 256
    assert "diagonal_alignment" not in kw and "diagonal_band_right_bound" not in kw
    assert kw["generate_stats"] is False and fg.outputs[1] is None
    assert "stats_offsets" not in fg.tensors


def test_build_unsupported_graph_is_not_implemented(fake_cudnn, monkeypatch):
    def refuse(self, modes):
        raise NotSupported("no engine")

    monkeypatch.setattr(FakeGraph, "build", refuse)
    with pytest.raises(NotImplementedError, match="no engine for this prefill graph"):
        cp.get_graph(cp.PrefillGraphKey(**key_kwargs()))


# ============================================================================= wrappers: validation
WRAPPERS = [Ragged, Paged]


def plan_ragged(w, qo=(5, 9), kv=(7, 9), hq=8, hkv=2, d=64, **kw):
    kw.setdefault("q_data_type", BF16)
    w.plan(indptr(qo), indptr(kv), hq, hkv, d, **kw)


def plan_paged(w, qo=(5, 9), kv=(7, 30), hq=8, hkv=2, d=64, ps=16, **kw):
    npages = [-(-x // ps) for x in kv]
    last = torch.tensor([x - (n - 1) * ps for x, n in zip(kv, npages)], dtype=torch.int32)
    kw.setdefault("q_data_type", BF16)
    w.plan(indptr(qo), indptr(npages), torch.arange(sum(npages), dtype=torch.int32), last, hq, hkv, d, ps, **kw)


PLAN = {Ragged: plan_ragged, Paged: plan_paged}


@pytest.mark.parametrize("cls", WRAPPERS)
def test_ctor_accepts_cudnn(cls):
    w = cls(ws(), "NHD", backend="cudnn")
    assert not w.is_cuda_graph_enabled


@pytest.mark.parametrize("cls", WRAPPERS)
def test_ctor_cudnn_rejects_cuda_graph(cls):
    buf = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="use_cuda_graph"):
        if cls is Ragged:
            cls(ws(), "NHD", use_cuda_graph=True, qo_indptr_buf=buf, kv_indptr_buf=buf, backend="cudnn")
        else:
            cls(ws(), "NHD", use_cuda_graph=True, qo_indptr_buf=buf, paged_kv_indptr_buf=buf,
                paged_kv_indices_buf=buf, paged_kv_last_page_len_buf=buf[:2], backend="cudnn")


@pytest.mark.parametrize("cls", WRAPPERS)
@pytest.mark.parametrize("kw,match", [
    (dict(custom_mask=torch.ones(5 * 7 + 9 * 9, dtype=torch.bool)), "custom mask"),
    (dict(packed_custom_mask=torch.zeros(20, dtype=torch.uint8)), "custom mask"),
    (dict(pos_encoding_mode="ROPE_LLAMA"), "RoPE"),
    (dict(pos_encoding_mode="ALIBI"), "ALiBi"),
    (dict(logits_soft_cap=30.0), "soft cap"),
    (dict(window_left=16), "window"),
    (dict(use_fp16_qk_reduction=True), "use_fp16_qk_reduction"),
    (dict(q_data_type=torch.float8_e4m3fn), "fp8"),
    (dict(q_data_type=BF16, kv_data_type=torch.float8_e4m3fn), "fp8"),
    (dict(q_data_type=BF16, kv_data_type=FP16), "mixed dtypes"),
    (dict(q_data_type=torch.float32), "float32"),
])
def test_plan_unsupported_features(cls, kw, match):
    w = cls(ws(), "NHD", backend="cudnn")
    if "custom_mask" in kw and cls is Paged:
        kw = dict(custom_mask=torch.ones(5 * 7 + 9 * 30, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match=match):
        PLAN[cls](w, **kw)


@pytest.mark.parametrize("cls", WRAPPERS)
def test_plan_bad_values(cls):
    w = cls(ws(), "NHD", backend="cudnn")
    with pytest.raises(KeyError, match="pos_encoding_mode"):
        PLAN[cls](w, pos_encoding_mode="ROPE")
    with pytest.raises(ValueError, match="window_left"):
        PLAN[cls](w, window_left=-2)
    with pytest.raises(TypeError, match="sm_scale"):
        PLAN[cls](w, sm_scale="x")
    with pytest.raises(ValueError, match="num_kv_heads"):
        PLAN[cls](w, hq=6, hkv=4)


@pytest.mark.skipif(cp.cudnn_available(), reason="cudnn-frontend is installed")
@pytest.mark.parametrize("cls", WRAPPERS)
def test_plan_without_cudnn_is_import_error(cls):
    w = cls(ws(), "NHD", backend="cudnn")
    with pytest.raises(ImportError, match="nvidia-cudnn-frontend"):
        PLAN[cls](w)


@pytest.mark.parametrize("cls", WRAPPERS)
def test_plan_on_cpu_is_value_error(cls, fake_cudnn):
    w = cls(ws(), "NHD", backend="cudnn")
    with pytest.raises(ValueError, match="CUDA"):
        PLAN[cls](w)


def test_run_before_plan():
    w = Ragged(ws(), "NHD", backend="cudnn")
    with pytest.raises(RuntimeError, match="plan"):
        w.run(torch.zeros(1, 8, 64), torch.zeros(1, 2, 64), torch.zeros(1, 2, 64))


def test_pyproject_has_cudnn_extra():
    import tomllib

    meta = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    extras = meta["project"]["optional-dependencies"]
    assert any(r.startswith("nvidia-cudnn-frontend") for r in extras["cudnn"])


def test_exported():
    assert "cudnn_batch_prefill_with_kv_cache" in ca.__all__
    assert ca.cudnn_batch_prefill_with_kv_cache is api_cudnn.cudnn_batch_prefill_with_kv_cache


def test_lazy_import():
    """Importing the package does not import cudnn-frontend (a fresh interpreter)."""
    import subprocess

    code = "import sys, cutedsl_attn; assert 'cudnn' not in sys.modules, 'cudnn imported eagerly'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=str(Path(__file__).resolve().parents[1]))
    assert r.returncode == 0, r.stderr[-2000:]


# ============================================================================= wrappers end to end (emulated cuDNN)
def make_ragged(qo, kv, hq, hkv, d, dtype, layout, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(qo), hq, d, generator=g).to(dtype)
    k = torch.randn(sum(kv), hkv, d, generator=g).to(dtype)
    v = torch.randn(sum(kv), hkv, d, generator=g).to(dtype)
    k_in, v_in = (k, v) if layout == "NHD" else (k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous())
    return q, k, v, k_in, v_in


def test_ragged_hnd_not_implemented(fake_cudnn):
    w = Ragged(ws(), "HND", backend="cudnn")
    with pytest.raises(NotImplementedError, match="HND"):
        plan_ragged(w)


@pytest.mark.parametrize("layout", ["NHD"])
@pytest.mark.parametrize("causal,window", [(True, -1), (False, -1), (True, 6)])
def test_ragged_emulated_vs_oracle(emu, layout, causal, window):
    qo, kv = [5, 0, 70, 3, 12], [9, 4, 40, 0, 3]  # empty q, q > kv (causal empty rows), empty kv
    hq, hkv, d = 8, 2, 64
    q, k, v, k_in, v_in = make_ragged(qo, kv, hq, hkv, d, BF16, layout, 0)
    w = Ragged(ws(), layout, backend="cudnn")
    w.plan(indptr(qo), indptr(kv), hq, hkv, d, causal=causal, window_left=window, q_data_type=BF16, sm_scale=0.1)
    out = torch.full((sum(qo), hq, d), float("nan"), dtype=BF16)
    lse = torch.full((sum(qo), hq), float("nan"))
    r = w.run(q, k_in, v_in, out=out, lse=lse, return_lse=True)
    assert r[0] is out and r[1] is lse
    o_ref, lse_ref = ref.ragged_prefill(q, k, v, indptr(qo), indptr(kv), causal=causal, window_left=window,
                                        sm_scale=0.1)
    check_close(out, lse, o_ref, lse_ref, f"{layout} causal={causal} window={window}")
    key = emu.calls[-1]["key"]
    assert key.batch == 8 and key.max_q == 128 and key.max_kv == 128 and key.window_left == window
    assert key.packed_lse and key.return_lse and not key.paged


def test_ragged_lse_base_layout_and_scales(emu):
    qo, kv = [7, 20], [7, 31]
    q, k, v, _, _ = make_ragged(qo, kv, 4, 4, 128, FP16, "NHD", 1)
    w = Ragged(ws(), "NHD", backend="cudnn")
    w.plan(indptr(qo), indptr(kv), 4, 4, 128, causal=True, q_data_type=FP16)
    o_ref, lse_ref = ref.ragged_prefill(q, k, v, indptr(qo), indptr(kv), causal=True, sm_scale=0.5 / math.sqrt(128))
    out, lse = w.run(q, k, v, return_lse=True, lse_base="ln", lse_layout="HN", q_scale=0.5, v_scale=2.0,
                     o_scale=4.0)
    assert lse.shape == (4, 27)
    check_close(out.double() * 2.0, lse.t() / LN2, o_ref, lse_ref)
    assert emu.calls[-1]["key"].sm_scale == pytest.approx(0.5 / math.sqrt(128))
    # no LSE requested: the graph is built without Stats
    o2 = w.run(q, k, v, q_scale=0.5)
    assert not emu.calls[-1]["key"].return_lse and emu.calls[-1]["stats"] is None
    assert rel_err(o2, o_ref) < 1e-2


def test_ragged_noncontiguous_q_and_out(emu):
    qo, kv = [6, 10], [8, 10]
    hq, hkv, d = 4, 2, 64
    q_full, k, v, _, _ = make_ragged(qo, kv, 2 * hq, hkv, d, BF16, "NHD", 2)
    q = q_full[:, :hq]  # a head slice: token stride 2 * hq * d
    out_full = torch.full((16, 2 * hq, d), float("nan"), dtype=BF16)
    out = out_full[:, hq:]
    w = Ragged(ws(), "NHD", backend="cudnn")
    w.plan(indptr(qo), indptr(kv), hq, hkv, d, causal=True, q_data_type=BF16)
    w.run(q, k, v, out=out)
    o_ref, lse_ref = ref.ragged_prefill(q, k, v, indptr(qo), indptr(kv), causal=True)
    assert rel_err(out, o_ref) < 1e-2
    key = emu.calls[-1]["key"]
    assert key.q_strides == (2 * hq * d, d) and key.o_strides == (2 * hq * d, d)
    assert emu.calls[-1]["q_offsets"].reshape(-1)[:3].tolist() == [0, 6 * 2 * hq * d, 16 * 2 * hq * d]


def test_ragged_all_rows_empty_skips_graph(emu):
    w = Ragged(ws(), "NHD", backend="cudnn")
    w.plan(indptr([3, 2]), indptr([0, 0]), 4, 4, 64, causal=True, q_data_type=BF16)
    q = torch.randn(5, 4, 64).to(BF16)
    out, lse = w.run(q, torch.zeros(0, 4, 64, dtype=BF16), torch.zeros(0, 4, 64, dtype=BF16), return_lse=True)
    assert not emu.calls and (out == 0).all() and (lse == float("-inf")).all()


def test_replan_same_bucket_reuses_key(emu):
    """Two batches in one bucket give the same graph key: the cached graph is reused across plans."""
    w = Ragged(ws(), "NHD", backend="cudnn")
    keys = []
    for qo, kv in (([5, 9, 30], [7, 9, 50]), ([1, 100, 2], [120, 100, 3])):
        q, k, v, _, _ = make_ragged(qo, kv, 8, 2, 64, BF16, "NHD", 3)
        w.plan(indptr(qo), indptr(kv), 8, 2, 64, causal=True, q_data_type=BF16)
        w.run(q, k, v)
        keys.append(emu.calls[-1]["key"])
    assert keys[0] == keys[1]


def make_paged(qo, kv, hq, hkv, d, ps, dtype, layout, seed, spare=5):
    g = torch.Generator().manual_seed(seed)
    npages = [-(-x // ps) for x in kv]
    pool = sum(npages) + spare
    indices = torch.randperm(pool, generator=g)[: sum(npages)].to(torch.int32)
    last = torch.tensor([x - (n - 1) * ps if n else 0 for x, n in zip(kv, npages)], dtype=torch.int32)
    shape = (pool, 2, ps, hkv, d) if layout == "NHD" else (pool, 2, hkv, ps, d)
    cache = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(sum(qo), hq, d, generator=g).to(dtype)
    return q, cache, indptr(npages), indices, last


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("ps", [16, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_paged_emulated_vs_oracle(emu, layout, ps, causal):
    qo, kv = [5, 0, 70, 3, 1], [9, 4, 200, 0, 65]
    hq, hkv, d = 8, 2, 64
    q, cache, kv_ip, idx, last = make_paged(qo, kv, hq, hkv, d, ps, BF16, layout, 4)
    w = Paged(ws(), layout, backend="cudnn")
    w.plan(indptr(qo), kv_ip, idx, last, hq, hkv, d, ps, causal=causal, q_data_type=BF16)
    out, lse = w.run(q, cache, return_lse=True)
    o_ref, lse_ref = ref.paged_prefill(q, cache, None, indptr(qo), kv_ip, idx, last, kv_layout=layout,
                                       causal=causal)
    check_close(out, lse, o_ref, lse_ref, f"{layout} ps={ps} causal={causal}")
    key = emu.calls[-1]["key"]
    assert key.paged and key.table_width == key.max_kv // ps


def test_paged_block_tables_and_tuple_cache(emu):
    qo, kv = [4, 17, 2], [30, 17, 100]
    ps, hq, hkv, d = 16, 8, 8, 128
    q, cache, kv_ip, idx, last = make_paged(qo, kv, hq, hkv, d, ps, BF16, "NHD", 5)
    bt, seq = ref.csr_to_block_tables(kv_ip, idx, last, ps)
    bt = torch.cat([bt, torch.full((3, 2), 999, dtype=torch.int32)], 1)  # a wider table, garbage tail
    w = Paged(ws(), "NHD", backend="cudnn")
    w.plan(indptr(qo), None, None, None, hq, hkv, d, ps, causal=True, q_data_type=BF16, block_tables=bt,
           seq_lens=seq)
    out, lse = w.run(q, (cache[:, 0], cache[:, 1]), return_lse=True)
    o_ref, lse_ref = ref.paged_prefill(q, cache, None, indptr(qo), kv_ip, idx, last, causal=True)
    check_close(out, lse, o_ref, lse_ref)


def test_run_only_features_not_implemented(emu):
    w = Ragged(ws(), "NHD", backend="cudnn")
    q, k, v, _, _ = make_ragged([3], [3], 4, 4, 64, BF16, "NHD", 6)
    w.plan(indptr([3]), indptr([3]), 4, 4, 64, q_data_type=BF16)
    with pytest.raises(NotImplementedError, match="sinks"):
        w.run(q, k, v, sinks=torch.zeros(4))
    with pytest.raises(NotImplementedError, match="enable_pdl"):
        w.run(q, k, v, enable_pdl=True)
    with pytest.raises(NotImplementedError, match="fp8"):
        w.run(q, k, v, k_scale=torch.ones(1))
    with pytest.raises(ValueError, match="lse_base"):
        w.run(q, k, v, lse_base="e")
    with pytest.raises(ValueError, match="lse_layout"):
        w.run(q, k, v, lse_layout="TN")
    with pytest.raises(ValueError, match="out"):
        w.run(q, k, v, out=torch.zeros(3, 4, 32, dtype=BF16))
    with pytest.raises(ValueError, match="dtype of q"):
        w.run(q.half(), k, v)
    with pytest.raises(NotImplementedError, match="forward"):
        with pytest.warns(DeprecationWarning):
            w.forward(q, k, v)
    assert not emu.calls


# ============================================================================= the raw function
def raw_problem(qo, kv, hq, hkv, d, seed, ps=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(qo), hq, d, generator=g).to(BF16)
    if ps is None:
        k = torch.randn(sum(kv), hkv, d, generator=g).to(BF16)
        v = torch.randn(sum(kv), hkv, d, generator=g).to(BF16)
        return q, k, v
    return (q,) + make_paged(qo, kv, hq, hkv, d, ps, BF16, "NHD", seed)[1:]


def lens4(x):
    return torch.tensor(x, dtype=torch.int32).reshape(-1, 1, 1, 1)


@pytest.mark.parametrize("units", ["elements", "tokens"])
@pytest.mark.parametrize("packed", [False, True])
def test_raw_ragged_emulated(emu, units, packed):
    qo, kv = [5, 12, 3, 0], [9, 4, 0, 6]
    hq, hkv, d = 8, 2, 64
    q, k, v = raw_problem(qo, kv, hq, hkv, d, 7)
    qi, ki = indptr(qo), indptr(kv)
    if units == "elements":
        offs = dict(batch_offsets_q=qi * hq * d, batch_offsets_o=qi * hq * d, batch_offsets_k=ki * hkv * d,
                    batch_offsets_v=ki * hkv * d)
        if packed:
            offs["batch_offsets_stats"] = qi * hq
        lens = dict(actual_seq_lens_q=lens4(qo), actual_seq_lens_kv=lens4(kv))
    else:
        offs = dict(batch_offsets_q=qi, batch_offsets_k=ki)
        if packed:
            offs["batch_offsets_stats"] = qi
        lens = {}
    out, lse = ca.cudnn_batch_prefill_with_kv_cache(
        q, k, v, 0.125, ws(), max_token_per_sequence=16, max_sequence_kv=12, causal=True, return_lse=True,
        batch_offsets_units=units, **offs, **lens)
    o_ref, lse_ref = ref.ragged_prefill(q, k, v, qi, ki, causal=True, sm_scale=0.125)
    assert lse.shape == (4, 16, hq)  # FlashInfer allocates the padded shape
    if packed:
        lse_rows = lse.reshape(-1, hq)[: sum(qo)]
    else:
        lse_rows = torch.cat([lse[b, :n] for b, n in enumerate(qo)])
    check_close(out, lse_rows, o_ref, lse_ref, f"{units} packed={packed}")
    key = emu.calls[-1]["key"]
    assert (key.batch, key.max_q, key.max_kv, key.packed_lse) == (4, 16, 12, packed)


def test_raw_paged_emulated_ln_and_given_out(emu):
    qo, kv = [3, 40], [50, 20]
    hq, hkv, d, ps = 8, 8, 64, 16
    q, cache, kv_ip, idx, last = raw_problem(qo, kv, hq, hkv, d, 8, ps=ps)
    bt, seq = ref.csr_to_block_tables(kv_ip, idx, last, ps)
    k_hnd, v_hnd = cache[:, 0].transpose(1, 2), cache[:, 1].transpose(1, 2)  # NHD pool as HND views
    out = torch.full((43, hq, d), float("nan"), dtype=BF16)
    lse = torch.full((43, hq), float("nan"))
    r = ca.cudnn_batch_prefill_with_kv_cache(
        q, k_hnd, v_hnd, 1 / 8, ws(), max_token_per_sequence=40, max_sequence_kv=50, actual_seq_lens_q=lens4(qo),
        actual_seq_lens_kv=seq.reshape(-1, 1, 1, 1), block_tables=bt, causal=True, return_lse=True,
        batch_offsets_q=indptr(qo), batch_offsets_stats=indptr(qo), batch_offsets_units="tokens", out=out, lse=lse,
        lse_base="ln")
    assert r[0] is out and r[1] is lse
    o_ref, lse_ref = ref.paged_prefill(q, cache, None, indptr(qo), kv_ip, idx, last, causal=True, sm_scale=1 / 8)
    check_close(out, lse / LN2, o_ref, lse_ref)  # q 40 > kv 20: 20 causal empty rows in request 1


def test_raw_validation():
    q = torch.zeros(4, 8, 64, dtype=BF16)
    k = v = torch.zeros(4, 2, 64, dtype=BF16)
    base = dict(max_token_per_sequence=4, max_sequence_kv=4, causal=True, return_lse=False,
                actual_seq_lens_q=lens4([2, 2]), actual_seq_lens_kv=lens4([2, 2]))
    f = ca.cudnn_batch_prefill_with_kv_cache

    def call(**kw):
        a = dict(base)
        a.update(kw)
        return f(q, k, v, 0.1, ws(), **a)

    with pytest.raises(ValueError, match="lse_base"):
        call(lse_base="e")
    with pytest.raises(ValueError, match="batch_offsets_units"):
        call(batch_offsets_units="bytes")
    with pytest.raises(ValueError, match="actual_seq_lens_q"):
        call(actual_seq_lens_q=None)
    with pytest.raises(ValueError, match="actual_seq_lens_kv"):
        call(actual_seq_lens_kv=None)
    with pytest.raises(NotImplementedError, match="fp8"):
        call(q_scale=torch.ones(1, 1, 1, 1))
    with pytest.raises(NotImplementedError, match="cubin"):
        call(backend="cubin")
    with pytest.raises(ValueError, match="backend"):
        call(backend="fa2")
    with pytest.raises(NotImplementedError, match="o_data_type"):
        call(o_data_type=torch.float16)
    with pytest.raises(ValueError, match="batch_offsets_q and batch_offsets_o are required"):
        call()
    with pytest.raises(ValueError, match="lse must have shape"):
        call(return_lse=True, lse=torch.zeros(4, 8))
    with pytest.raises(ValueError, match="block_tables"):
        f(q, torch.zeros(3, 2, 16, 64, dtype=BF16), torch.zeros(3, 2, 16, 64, dtype=BF16), 0.1, ws(), **base)
    with pytest.raises(TypeError, match="scale"):
        f(q, k, v, None, ws(), **base)
    with pytest.raises(TypeError):
        f(q, k, v, 0.1, ws(), max_token_per_sequence=4, max_sequence_kv=4, return_lse=False)  # causal required
    with pytest.raises(ValueError, match="CUDA"):  # all arguments valid, but on the CPU
        call(batch_offsets_q=indptr([2, 2]) * 512, batch_offsets_o=indptr([2, 2]) * 512,
             batch_offsets_k=indptr([2, 2]) * 128, batch_offsets_v=indptr([2, 2]) * 128)


def test_row_mask():
    m = api_cudnn._row_mask(torch.tensor([0, 5, 5, 9]), torch.tensor([2, 0, 3, 4]), 11)
    assert m.tolist() == [True, True, False, False, False, True, True, True, False, True, True]
