"""CPU tests of the prefill API's argument handling (no GPU, no kernel compile).

Every documented error of ``BatchPrefillWithRaggedKVCacheWrapper``,
``BatchPrefillWithPagedKVCacheWrapper`` (constructor, ``plan``, ``run``) and
``single_prefill_with_kv_cache`` must raise the documented exception type, with a message
naming the argument, before any kernel launch.  The compiled kernels behind
``dispatch.KernelChoice`` are replaced by a recorder (``_kernel_stubs``), so these tests also check what
a *valid* call hands to the kernel (the ``PrefillArgs`` tensors and scalars, the problem, the work table,
the packed mask) and that an invalid call never reaches it.

Wrappers, workspaces and all tensors live on the CPU; ``plan()`` needs a target
architecture for its kernel config, given through ``CUTEDSL_ATTN_ARCH``.
"""

from __future__ import annotations

import gc
import math
import re
import weakref

import pytest
import torch

import cutedsl_attn as ca
from cutedsl_attn import dispatch
from cutedsl_attn.api import prefill as api_prefill
from cutedsl_attn.api.quantization import packbits, segment_packbits
from cutedsl_attn.planning.prefill import PAD_ROW, WORK_COLS, max_tiles, plan_prefill

from _kernel_stubs import (  # pytest puts tests/ on sys.path
    BAD_PAGED_CACHE_SHAPES, EntryRejects, Recorder, bad_cache_tuples, bad_paged_cache)

BF16, FP16 = torch.bfloat16, torch.float16
LN2 = math.log(2.0)
Ragged = ca.BatchPrefillWithRaggedKVCacheWrapper
Paged = ca.BatchPrefillWithPagedKVCacheWrapper


# ----------------------------------------------------------------------------- fixtures and helpers
pytestmark = pytest.mark.usefixtures("cross_compile_sm90")  # tests/conftest.py


def ws(nbytes=1 << 20):
    return torch.zeros(nbytes, dtype=torch.uint8)


def indptr(lens):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


QO, KV = (5, 0, 70, 3), (9, 4, 200, 0)  # an empty request (qo 0), qo > kv (request 3), qo != kv


def ragged_problem(qo=QO, kv=KV, hq=8, hkv=2, dqk=64, dvo=None, dtype=BF16, layout="NHD"):
    dvo = dvo or dqk
    tq, tk = sum(qo), sum(kv)
    kshape = (tk, hkv, dqk) if layout == "NHD" else (hkv, tk, dqk)
    vshape = (tk, hkv, dvo) if layout == "NHD" else (hkv, tk, dvo)
    return dict(qo_indptr=indptr(qo), kv_indptr=indptr(kv), q=torch.randn(tq, hq, dqk).to(dtype),
                k=torch.randn(kshape).to(dtype), v=torch.randn(vshape).to(dtype), hq=hq, hkv=hkv, dqk=dqk, dvo=dvo,
                dtype=dtype, qo=list(qo), kv=list(kv), layout=layout)


def ragged_args(p):
    return (p["qo_indptr"], p["kv_indptr"], p["hq"], p["hkv"], p["dqk"])


def planned_ragged(p=None, *, wrapper_kw=None, **plan_kw):
    p = p or ragged_problem()
    w = Ragged(ws(), p["layout"], **(wrapper_kw or {}))
    plan_kw.setdefault("q_data_type", p["dtype"])
    if p["dvo"] != p["dqk"]:
        plan_kw.setdefault("head_dim_vo", p["dvo"])
    w.plan(*ragged_args(p), **plan_kw)
    return w, p


def csr(lens, page_size, *, spare=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    npages = [-(-L // page_size) for L in lens]
    pool = sum(npages) + spare
    indices = torch.randperm(pool, generator=g)[: sum(npages)].to(torch.int32)
    last = torch.tensor([L - (n - 1) * page_size if n else 0 for L, n in zip(lens, npages)], dtype=torch.int32)
    return indptr(npages), indices, last, pool


def paged_problem(qo=QO, kv=KV, hq=8, hkv=2, d=64, ps=16, dtype=BF16, layout="NHD"):
    kv_indptr, indices, last, pool = csr(list(kv), ps)
    shape = (pool, 2, ps, hkv, d) if layout == "NHD" else (pool, 2, hkv, ps, d)
    return dict(qo_indptr=indptr(qo), kv_indptr=kv_indptr, indices=indices, last=last,
                cache=torch.randn(shape).to(dtype), q=torch.randn(sum(qo), hq, d).to(dtype), hq=hq, hkv=hkv, d=d,
                ps=ps, dtype=dtype, qo=list(qo), kv=list(kv), layout=layout)


def paged_args(p):
    return (p["qo_indptr"], p["kv_indptr"], p["indices"], p["last"], p["hq"], p["hkv"], p["d"], p["ps"])


def planned_paged(p=None, *, wrapper_kw=None, **plan_kw):
    p = p or paged_problem()
    w = Paged(ws(), p["layout"], **(wrapper_kw or {}))
    plan_kw.setdefault("q_data_type", p["dtype"])
    w.plan(*paged_args(p), **plan_kw)
    return w, p


def expected_work(qo, kv, kv_starts, group, *, mask_bits=None, causal=False, window_left=-1, num_rows=None,
                  tile_m=64):
    """The work table plan() must produce; ``tile_m`` is the planned kernel's (64: portable, 128: SM90)."""
    work, n = plan_prefill(qo, kv, indptr(qo)[:-1], kv_starts, mask_bits, group_size=group, tile_m=tile_m,
                           num_rows=num_rows, causal=causal, window_left=window_left)
    return work, n


def flat_mask(qo, kv, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(sum(a * b for a, b in zip(qo, kv)), generator=g) > 0.4


# ============================================================================= constructors
WRAPPERS = [Ragged, Paged]


@pytest.mark.parametrize("cls", WRAPPERS)
@pytest.mark.parametrize("layout", ["nhd", "NDH", "", None])
def test_ctor_bad_kv_layout(cls, layout):
    with pytest.raises(KeyError, match="kv_layout"):
        cls(ws(), layout)


@pytest.mark.parametrize("cls", WRAPPERS)
@pytest.mark.parametrize("backend", ["fa2", "fa3", "trtllm-gen", "cute-dsl", "cute-dsl-prims", "cutlass"])
def test_ctor_flashinfer_backend_not_available(cls, backend):
    with pytest.raises(NotImplementedError, match="backend"):
        cls(ws(), "NHD", backend=backend)


@pytest.mark.parametrize("cls", WRAPPERS)
def test_ctor_unknown_backend(cls):
    with pytest.raises(ValueError, match="backend"):
        cls(ws(), "NHD", backend="triton-magic")


@pytest.mark.parametrize("cls", WRAPPERS)
@pytest.mark.parametrize("backend", ["auto", "cute"])
def test_ctor_supported_backends(cls, backend):
    w = cls(ws(), "HND", backend=backend)
    assert not w.is_cuda_graph_enabled


@pytest.mark.parametrize("cls", WRAPPERS)
@pytest.mark.parametrize("kw,match", [(dict(jit_args=["x"]), "jit_args"), (dict(jit_kwargs={"a": 1}), "jit_kwargs"),
                                      (dict(variant_owns_mask=True), "variant_owns_mask")])
def test_ctor_jit_options(cls, kw, match):
    with pytest.raises(NotImplementedError, match=match):
        cls(ws(), "NHD", **kw)


@pytest.mark.parametrize("cls", WRAPPERS)
def test_ctor_workspace_type_and_alignment(cls):
    with pytest.raises(TypeError, match="float_workspace_buffer"):
        cls(bytearray(1024), "NHD")
    with pytest.raises(ValueError, match="float_workspace_buffer"):
        cls(ws()[1:], "NHD")


def ragged_graph_buffers(B, mask_bytes=None):
    bufs = dict(qo_indptr_buf=torch.zeros(B + 1, dtype=torch.int32), kv_indptr_buf=torch.zeros(B + 1, dtype=torch.int32))
    if mask_bytes is not None:
        bufs.update(custom_mask_buf=torch.zeros(mask_bytes, dtype=torch.uint8),
                    mask_indptr_buf=torch.zeros(B + 1, dtype=torch.int32))
    return bufs


def paged_graph_buffers(B, max_pages=64, mask_bytes=None):
    bufs = dict(qo_indptr_buf=torch.zeros(B + 1, dtype=torch.int32),
                paged_kv_indptr_buf=torch.zeros(B + 1, dtype=torch.int32),
                paged_kv_indices_buf=torch.zeros(max_pages, dtype=torch.int32),
                paged_kv_last_page_len_buf=torch.zeros(B, dtype=torch.int32))
    if mask_bytes is not None:
        bufs.update(custom_mask_buf=torch.zeros(mask_bytes, dtype=torch.uint8),
                    mask_indptr_buf=torch.zeros(B + 1, dtype=torch.int32))
    return bufs


@pytest.mark.parametrize("missing", ["qo_indptr_buf", "kv_indptr_buf"])
def test_ctor_ragged_graph_needs_buffers(missing):
    bufs = ragged_graph_buffers(4)
    bufs[missing] = None
    with pytest.raises(ValueError, match=missing):
        Ragged(ws(), "NHD", use_cuda_graph=True, **bufs)


@pytest.mark.parametrize("missing", ["qo_indptr_buf", "paged_kv_indptr_buf", "paged_kv_indices_buf",
                                     "paged_kv_last_page_len_buf"])
def test_ctor_paged_graph_needs_buffers(missing):
    bufs = paged_graph_buffers(4)
    bufs[missing] = None
    with pytest.raises(ValueError, match=missing):
        Paged(ws(), "NHD", use_cuda_graph=True, **bufs)


@pytest.mark.parametrize("name", ["qo_indptr_buf", "kv_indptr_buf"])
def test_ctor_graph_buffer_dtype(name):
    bufs = ragged_graph_buffers(4)
    bufs[name] = bufs[name].long()
    with pytest.raises(ValueError, match=name):
        Ragged(ws(), "NHD", use_cuda_graph=True, **bufs)


def test_ctor_graph_buffer_lengths():
    bufs = ragged_graph_buffers(4)
    bufs["kv_indptr_buf"] = bufs["kv_indptr_buf"][:-1]
    with pytest.raises(ValueError, match="kv_indptr_buf"):
        Ragged(ws(), "NHD", use_cuda_graph=True, **bufs)
    for name in ("paged_kv_indptr_buf", "paged_kv_last_page_len_buf"):
        bufs = paged_graph_buffers(4)
        bufs[name] = bufs[name][:-1]
        with pytest.raises(ValueError, match=name):
            Paged(ws(), "NHD", use_cuda_graph=True, **bufs)


def test_ctor_graph_mask_buffers_checked_when_given():
    bufs = ragged_graph_buffers(4, mask_bytes=64)
    bufs["custom_mask_buf"] = bufs["custom_mask_buf"].to(torch.int32)
    with pytest.raises(ValueError, match="custom_mask_buf"):
        Ragged(ws(), "NHD", use_cuda_graph=True, **bufs)
    bufs = paged_graph_buffers(4, mask_bytes=64)
    bufs["mask_indptr_buf"] = bufs["mask_indptr_buf"][:-1]
    with pytest.raises(ValueError, match="mask_indptr_buf"):
        Paged(ws(), "NHD", use_cuda_graph=True, **bufs)


@pytest.mark.parametrize("cls", WRAPPERS)
def test_graph_buffers_ignored_without_cuda_graph(rec, cls):
    # FlashInfer: the graph buffers take effect only with use_cuda_graph=True; without it they are neither checked
    # (a list, a wrong dtype or length is accepted) nor written, and the launch is that of a wrapper without them
    p = ragged_problem() if cls is Ragged else paged_problem()
    names = ((("qo_indptr_buf", "kv_indptr_buf") if cls is Ragged else
              ("qo_indptr_buf", "paged_kv_indptr_buf", "paged_kv_indices_buf", "paged_kv_last_page_len_buf"))
             + ("custom_mask_buf", "mask_indptr_buf"))
    bufs = {n: torch.full((2,), -7, dtype=torch.int64) for n in names}
    bufs["qo_indptr_buf"] = [1, 2]
    mask = flat_mask(p["qo"], p["kv"])
    launches = []
    for kw in (bufs, {}):
        w = cls(ws(), "NHD", **kw)
        assert not w.is_cuda_graph_enabled
        if cls is Ragged:
            w.plan(*ragged_args(p), q_data_type=BF16, custom_mask=mask)
            w.run(p["q"], p["k"], p["v"])
        else:
            w.plan(*paged_args(p), q_data_type=BF16, custom_mask=mask)
            w.run(p["q"], p["cache"])
        launches.append(rec.calls[-1][2])
    with_bufs, without = launches
    for n in names[1:]:
        assert torch.equal(bufs[n], torch.full((2,), -7, dtype=torch.int64)), f"{n} was written"
    assert bufs["qo_indptr_buf"] == [1, 2]
    for field in ("work", "mask", "indices"):
        assert torch.equal(getattr(with_bufs, field), getattr(without, field)), field
        assert all(getattr(with_bufs, field) is not b for b in bufs.values())


# ============================================================================= plan(): shared options
def _ragged_plan_raises(exc, match, p=None, args=None, **kw):
    p = p or ragged_problem()
    w = Ragged(ws(), "NHD")
    kw.setdefault("q_data_type", p["dtype"])
    with pytest.raises(exc, match=match):
        w.plan(*(args or ragged_args(p)), **kw)
    return w


def _paged_plan_raises(exc, match, p=None, args=None, **kw):
    p = p or paged_problem()
    w = Paged(ws(), "NHD")
    kw.setdefault("q_data_type", p["dtype"])
    with pytest.raises(exc, match=match):
        w.plan(*(args or paged_args(p)), **kw)
    return w


def _replace_ragged(p, **kw):
    a = dict(zip(("qo_indptr", "kv_indptr", "hq", "hkv", "dqk"), ragged_args(p)))
    a.update(kw)
    return tuple(a.values())


def _replace_paged(p, **kw):
    a = dict(zip(("qo_indptr", "kv_indptr", "indices", "last", "hq", "hkv", "d", "ps"), paged_args(p)))
    a.update(kw)
    return tuple(a.values())


BOTH_PLANS = ["ragged", "paged"]


def _plan_raises_either(which, exc, match, **kw):
    return (_ragged_plan_raises if which == "ragged" else _paged_plan_raises)(exc, match, **kw)


@pytest.mark.parametrize("which", BOTH_PLANS)
@pytest.mark.parametrize("hq,hkv", [(12, 8), (8, 3), (0, 1), (8, 0), (-8, 2)])
def test_plan_bad_heads(which, hq, hkv):
    if which == "ragged":
        p = ragged_problem()
        _ragged_plan_raises(ValueError, "num_qo_heads", p, _replace_ragged(p, hq=hq, hkv=hkv))
    else:
        p = paged_problem()
        _paged_plan_raises(ValueError, "num_qo_heads", p, _replace_paged(p, hq=hq, hkv=hkv))


def test_plan_heads_type():
    p = ragged_problem()
    _ragged_plan_raises(TypeError, "num_qo_heads", p, _replace_ragged(p, hq=8.0))


def test_plan_group_too_large():
    p = ragged_problem()
    _ragged_plan_raises(NotImplementedError, "group size", p, _replace_ragged(p, hq=64, hkv=2))


@pytest.mark.parametrize("d", [16, 48, 96, 512])
def test_plan_unsupported_head_dim_qk(d):
    p = ragged_problem()
    _ragged_plan_raises(NotImplementedError, "head_dim_qk", p, _replace_ragged(p, dqk=d))
    p = paged_problem()
    _paged_plan_raises(NotImplementedError, "head_dim_qk", p, _replace_paged(p, d=d))


@pytest.mark.parametrize("d", [48, 192, 512])
def test_plan_unsupported_head_dim_vo(d):
    _ragged_plan_raises(NotImplementedError, "head_dim_vo", head_dim_vo=d)
    _paged_plan_raises(NotImplementedError, "head_dim_vo", head_dim_vo=d)


def test_plan_head_dim_type():
    p = ragged_problem()
    _ragged_plan_raises(TypeError, "head_dim_qk", p, _replace_ragged(p, dqk="64"))
    _ragged_plan_raises(TypeError, "head_dim_vo", head_dim_vo=64.0)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(q_data_type=BF16, kv_data_type=FP16), NotImplementedError, "dtype"),
    (dict(q_data_type=FP16, o_data_type=BF16), NotImplementedError, "dtype"),
    (dict(q_data_type=torch.float8_e4m3fn), NotImplementedError, "q_data_type"),
    (dict(q_data_type=BF16, kv_data_type=torch.float8_e4m3fn), NotImplementedError, "kv_data_type"),
    (dict(q_data_type="float8_e5m2"), NotImplementedError, "q_data_type"),
    (dict(q_data_type=torch.float32), NotImplementedError, "q_data_type"),
    (dict(q_data_type="int8"), TypeError, "q_data_type"),
    (dict(q_data_type=BF16, o_data_type="nonsense"), TypeError, "o_data_type"),
])
@pytest.mark.parametrize("which", BOTH_PLANS)
def test_plan_dtypes(which, kw, exc, match):
    _plan_raises_either(which, exc, match, **kw)


@pytest.mark.parametrize("which", BOTH_PLANS)
def test_plan_alibi_with_soft_cap_not_served(which):
    _plan_raises_either(which, NotImplementedError, "logits_soft_cap", pos_encoding_mode="ALIBI", logits_soft_cap=30.0)


@pytest.mark.parametrize("which", BOTH_PLANS)
@pytest.mark.parametrize("name,value,exc", [
    ("rope_scale", 0.0, ValueError), ("rope_scale", -2.0, ValueError), ("rope_scale", float("inf"), ValueError),
    ("rope_scale", float("nan"), ValueError), ("rope_scale", 1e-320, ValueError), ("rope_scale", "2", TypeError),
    ("rope_theta", 0.0, ValueError), ("rope_theta", -1e4, ValueError), ("rope_theta", float("inf"), ValueError),
    ("rope_theta", True, TypeError), ("rope_theta", [1e4], TypeError),
])
@pytest.mark.parametrize("mode", ["ROPE_LLAMA", "NONE"])
def test_plan_bad_rope_params(which, name, value, exc, mode):
    # validated whatever the mode (as the decode wrapper does); the message names the argument
    _plan_raises_either(which, exc, name, pos_encoding_mode=mode, **{name: value})


@pytest.mark.parametrize("mode", ["ROPE", "rope_llama", "alibi", ""])
def test_plan_bad_pos_encoding_mode(mode):
    _ragged_plan_raises(KeyError, "pos_encoding_mode", pos_encoding_mode=mode)


@pytest.mark.parametrize("which", BOTH_PLANS)
def test_plan_fp16_qk_reduction(which):
    _plan_raises_either(which, NotImplementedError, "use_fp16_qk_reduction", use_fp16_qk_reduction=True)


@pytest.mark.parametrize("wl,exc", [(-2, ValueError), (2**31, ValueError), (1.5, TypeError), ("3", TypeError),
                                    (True, TypeError)])
def test_plan_bad_window_left(wl, exc):
    _ragged_plan_raises(exc, "window_left", window_left=wl)
    _paged_plan_raises(exc, "window_left", window_left=wl)


def test_plan_numpy_scalars_and_bool_soft_cap():
    import numpy as np

    w, p = planned_ragged(window_left=np.int64(5), logits_soft_cap=np.float32(3.0))
    assert w._plan["window_left"] == 5 and w._plan["soft_cap"] == 3.0
    _ragged_plan_raises(TypeError, "logits_soft_cap", logits_soft_cap=True)


def test_plan_soft_cap_and_sm_scale():
    _ragged_plan_raises(ValueError, "logits_soft_cap", logits_soft_cap=-1.0)
    _ragged_plan_raises(ValueError, "logits_soft_cap", logits_soft_cap=float("inf"))
    _ragged_plan_raises(TypeError, "logits_soft_cap", logits_soft_cap="30")
    _ragged_plan_raises(TypeError, "sm_scale", sm_scale="0.1")
    _ragged_plan_raises(ValueError, "sm_scale", sm_scale=float("nan"))


@pytest.mark.parametrize("which", BOTH_PLANS)
@pytest.mark.parametrize("kw,match", [
    (dict(prefix_len_ptr=torch.zeros(4, dtype=torch.int32)), "prefix_len_ptr"),
    (dict(token_pos_in_items_ptr=torch.zeros(8, dtype=torch.int16)), "token_pos_in_items_ptr"),
    (dict(token_pos_in_items_len=20), "token_pos_in_items_len"),
    (dict(max_item_len_ptr=torch.zeros(4, dtype=torch.int16)), "max_item_len_ptr"),
])
def test_plan_multi_item_scoring_not_served(which, kw, match):
    _plan_raises_either(which, NotImplementedError, match, **kw)


@pytest.mark.parametrize("which", BOTH_PLANS)
@pytest.mark.parametrize("fs", [0, -4, 2.5])
def test_plan_fixed_split_size_not_positive(which, fs):
    _plan_raises_either(which, ValueError, "fixed_split_size", fixed_split_size=fs)


def test_plan_split_options_accepted(rec):
    for kw in (dict(fixed_split_size=8), dict(disable_split_kv=True)):
        w, p = planned_ragged(**kw)
        w.run(p["q"], p["k"], p["v"])
    assert len(rec.calls) == 2


def test_plan_ragged_hints():
    p = ragged_problem()
    _ragged_plan_raises(ValueError, "seq_lens", seq_lens=torch.tensor([9, 4, 200, 1]))
    _ragged_plan_raises(ValueError, "seq_lens_q", seq_lens_q=torch.tensor([5, 0, 70, 4]))
    _ragged_plan_raises(ValueError, "seq_lens", seq_lens=torch.tensor([9.0, 4.0, 200.0, 0.0]))
    _ragged_plan_raises(ValueError, "max_token_per_sequence", max_token_per_sequence=69)
    _ragged_plan_raises(ValueError, "max_sequence_kv", max_sequence_kv=199)
    _ragged_plan_raises(TypeError, "max_sequence_kv", max_sequence_kv="200")
    _ragged_plan_raises(NotImplementedError, "v_indptr", v_indptr=indptr([9, 4, 100, 100]))
    _ragged_plan_raises(NotImplementedError, "o_indptr", o_indptr=indptr([5, 1, 69, 3]))
    _ragged_plan_raises(ValueError, "o_indptr", o_indptr=p["qo_indptr"][:-1])
    _ragged_plan_raises(ValueError, "uniform_q_len", uniform_q_len=5)


def test_plan_ragged_hints_accepted_when_consistent(rec):
    p = ragged_problem()
    w, _ = planned_ragged(p, seq_lens=torch.tensor(KV, dtype=torch.int32), seq_lens_q=torch.tensor(QO),
                          max_token_per_sequence=70, max_sequence_kv=1000, v_indptr=p["kv_indptr"],
                          o_indptr=p["qo_indptr"], rope_scale=2.0, rope_theta=5e5)
    w.run(p["q"], p["k"], p["v"])
    w, _ = planned_ragged(ragged_problem(qo=(4, 4), kv=(9, 1)), uniform_q_len=4)
    assert len(rec.calls) == 1


# ============================================================================= plan(): ragged index arrays
@pytest.mark.parametrize("name", ["qo_indptr", "kv_indptr"])
def test_plan_ragged_indptr_dtype_type_ndim(name):
    p = ragged_problem()
    _ragged_plan_raises(ValueError, name, p, _replace_ragged(p, **{name: p[name].long()}))
    _ragged_plan_raises(TypeError, name, p, _replace_ragged(p, **{name: p[name].tolist()}))
    _ragged_plan_raises(ValueError, name, p, _replace_ragged(p, **{name: p[name].view(1, -1)}))


@pytest.mark.parametrize("name", ["qo_indptr", "kv_indptr"])
def test_plan_ragged_indptr_values(name):
    p = ragged_problem()
    bad = p[name].clone()
    bad[2], bad[3] = int(bad[3]) + 1, int(bad[2])
    _ragged_plan_raises(ValueError, "non-decreasing", p, _replace_ragged(p, **{name: bad}))
    bad = p[name].clone()
    bad[0] = -1
    _ragged_plan_raises(ValueError, name, p, _replace_ragged(p, **{name: bad}))


def test_plan_ragged_indptr_lengths_differ():
    p = ragged_problem()
    _ragged_plan_raises(ValueError, "kv_indptr", p, _replace_ragged(p, kv_indptr=p["kv_indptr"][:-1]))
    _ragged_plan_raises(ValueError, "qo_indptr", p, _replace_ragged(p, qo_indptr=p["qo_indptr"][:0]))


# ============================================================================= plan(): custom mask
@pytest.mark.parametrize("which", BOTH_PLANS)
def test_plan_custom_mask_errors(which):
    m = flat_mask(QO, KV)
    _plan_raises_either(which, ValueError, "custom_mask", custom_mask=m[:-1])
    _plan_raises_either(which, ValueError, "custom_mask", custom_mask=m.to(torch.uint8))
    _plan_raises_either(which, TypeError, "custom_mask", custom_mask=m.tolist())
    packed, _ = segment_packbits(m, indptr([a * b for a, b in zip(QO, KV)]), "little")
    _plan_raises_either(which, ValueError, "packed_custom_mask", packed_custom_mask=packed[:-1])
    _plan_raises_either(which, ValueError, "packed_custom_mask", packed_custom_mask=packed.to(torch.int8))
    _plan_raises_either(which, ValueError, "packed_custom_mask", packed_custom_mask=packed.view(1, -1))
    # FlashInfer's whole-batch packbits() form (no per-request byte padding) is rejected when its length
    # differs (here 3 bytes for two 3x3 masks instead of 2 + 2)
    m2 = flat_mask((3, 3), (3, 3))
    prob = ragged_problem(qo=(3, 3), kv=(3, 3)) if which == "ragged" else paged_problem(qo=(3, 3), kv=(3, 3))
    _plan_raises_either(which, ValueError, "packed_custom_mask", p=prob, packed_custom_mask=packbits(m2, "little"))


# ============================================================================= plan(): paged page table
@pytest.mark.parametrize("ps", [0, -16, 2.0])
def test_plan_bad_page_size(ps):
    p = paged_problem()
    _paged_plan_raises(ValueError, "page_size", p, _replace_paged(p, ps=ps))


@pytest.mark.parametrize("bad", [0, 17, -1])
def test_plan_last_page_len_outside_range(bad):
    p = paged_problem()
    last = p["last"].clone()
    last[2] = bad
    _paged_plan_raises(ValueError, "paged_kv_last_page_len", p, _replace_paged(p, last=last))


def test_plan_zero_page_request_last_page_len(rec):
    p = paged_problem(qo=(3, 2), kv=(0, 5))
    w, _ = planned_paged(p)
    w.run(p["q"], p["cache"])
    assert len(rec.calls) == 1
    last = p["last"].clone()
    last[0] = 17
    _paged_plan_raises(ValueError, "paged_kv_last_page_len", p, _replace_paged(p, last=last))


def test_plan_paged_indptr_errors():
    p = paged_problem()
    ip = p["kv_indptr"].clone()
    ip[1], ip[2] = int(ip[2]), int(ip[1])
    _paged_plan_raises(ValueError, "paged_kv_indptr", p, _replace_paged(p, kv_indptr=ip))
    _paged_plan_raises(ValueError, "paged_kv_indptr", p, _replace_paged(p, kv_indptr=p["kv_indptr"][:-1]))
    _paged_plan_raises(ValueError, "paged_kv_indices", p, _replace_paged(p, indices=p["indices"][:-2]))
    _paged_plan_raises(ValueError, "paged_kv_last_page_len", p, _replace_paged(p, last=p["last"][:-1]))
    _paged_plan_raises(ValueError, "qo_indptr", p, _replace_paged(p, qo_indptr=p["qo_indptr"].long()))


@pytest.mark.parametrize("name,arg", [("kv_indptr", "paged_kv_indptr"), ("indices", "paged_kv_indices"),
                                      ("last", "paged_kv_last_page_len")])
def test_plan_page_table_dtype_type_ndim(name, arg):
    p = paged_problem()
    _paged_plan_raises(ValueError, arg, p, _replace_paged(p, **{name: p[name].long()}))
    _paged_plan_raises(TypeError, arg, p, _replace_paged(p, **{name: p[name].tolist()}))
    _paged_plan_raises(ValueError, arg, p, _replace_paged(p, **{name: p[name].view(1, -1)}))
    _paged_plan_raises(TypeError, arg, p, _replace_paged(p, **{name: None}))


def test_plan_indices_on_other_device_are_copied(rec):
    # as FlashInfer 0.7.2: page indices on the host / another device are copied to the wrapper's device
    p = paged_problem()
    w = Paged(ws(), "NHD")
    w.device = torch.device("meta")  # pretend the wrapper lives elsewhere
    w.plan(*paged_args(p), q_data_type=BF16)
    assert w._plan["indices"].device.type == "meta"


def test_plan_seq_lens_must_agree_with_csr(rec):
    p = paged_problem()
    _paged_plan_raises(ValueError, "seq_lens", seq_lens=torch.tensor([9, 4, 199, 0], dtype=torch.int32))
    w, _ = planned_paged(p, seq_lens=torch.tensor(KV, dtype=torch.int32))
    w.run(p["q"], p["cache"])
    assert len(rec.calls) == 1


def _bt_args(p):
    return (p["qo_indptr"], None, None, None, p["hq"], p["hkv"], p["d"], p["ps"])


def test_plan_block_tables_errors():
    p = paged_problem()  # longest request 200 tokens = 13 pages of 16
    sl = torch.tensor(KV, dtype=torch.int32)
    bt = torch.zeros(4, 16, dtype=torch.int32)
    _paged_plan_raises(ValueError, "seq_lens", p, _bt_args(p), block_tables=bt)
    _paged_plan_raises(TypeError, "paged_kv_indptr", p, _bt_args(p), seq_lens=sl)
    _paged_plan_raises(ValueError, "block_tables", p, _bt_args(p), block_tables=bt[:, :12], seq_lens=sl)
    _paged_plan_raises(ValueError, "block_tables", p, _bt_args(p), block_tables=bt.long(), seq_lens=sl)
    _paged_plan_raises(ValueError, "block_tables", p, _bt_args(p), block_tables=bt.reshape(-1), seq_lens=sl)
    _paged_plan_raises(ValueError, "block_tables", p, _bt_args(p), block_tables=bt[:3], seq_lens=sl)
    _paged_plan_raises(ValueError, "seq_lens", p, _bt_args(p), block_tables=bt, seq_lens=sl[:3])
    _paged_plan_raises(ValueError, "seq_lens", p, _bt_args(p), block_tables=bt,
                       seq_lens=torch.tensor([1, -1, 2, 3], dtype=torch.int32))
    _paged_plan_raises(ValueError, "seq_lens", p, _bt_args(p), block_tables=bt, seq_lens=sl.float())


def test_plan_paged_hints():
    _paged_plan_raises(ValueError, "seq_lens_q", seq_lens_q=torch.tensor([5, 0, 70, 2]))
    _paged_plan_raises(ValueError, "max_token_per_sequence", max_token_per_sequence=10)
    _paged_plan_raises(ValueError, "max_sequence_kv", max_sequence_kv=100)
    _paged_plan_raises(ValueError, "uniform_q_len", uniform_q_len=3)


# ============================================================================= run(): errors
def _run_raises(exc, match, rec, w=None, p=None, **kw):
    if w is None:
        w, p = planned_ragged()
    q = kw.pop("q", p["q"])
    with pytest.raises(exc, match=match):
        if isinstance(w, Ragged):
            w.run(q, kw.pop("k", p["k"]), kw.pop("v", p["v"]), **kw)
        else:
            w.run(q, kw.pop("cache", p["cache"]), **kw)
    assert rec.calls == [], "an invalid run() reached the kernel"


@pytest.mark.parametrize("cls", WRAPPERS)
def test_run_before_plan(rec, cls):
    w = cls(ws(), "NHD")
    p = ragged_problem() if cls is Ragged else paged_problem()
    _run_raises(RuntimeError, "plan", rec, w, p)


@pytest.mark.parametrize("which", BOTH_PLANS)
@pytest.mark.parametrize("bad", ["rows", "heads", "dim", "ndim", "dtype", "type"])
def test_run_q(rec, which, bad):
    w, p = planned_ragged() if which == "ragged" else planned_paged()
    q = p["q"]
    q = {"rows": q[:-1], "heads": q[:, :-1], "dim": torch.zeros(q.shape[0], 8, 128, dtype=BF16), "ndim": q[0],
         "dtype": q.to(FP16), "type": q.tolist()}[bad]
    _run_raises(TypeError if bad == "type" else ValueError, "q", rec, w, p, q=q)


@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("bad", ["rows", "heads", "dim", "ndim", "dtype", "type"])
def test_run_ragged_kv(rec, name, bad):
    w, p = planned_ragged()
    t = p[name]
    t = {"rows": t[:-1], "heads": t[:, :1], "dim": torch.zeros(t.shape[0], 2, 128, dtype=BF16), "ndim": t[0],
         "dtype": t.to(FP16), "type": t.tolist()}[bad]
    _run_raises(TypeError if bad == "type" else ValueError, rf"\b{name}\b", rec, w, p, **{name: t})


def test_run_ragged_kv_longer_than_needed_is_fine(rec):
    w, p = planned_ragged()
    k = torch.cat([p["k"], p["k"][:3]])
    w.run(p["q"], k, torch.cat([p["v"], p["v"][:3]]))
    assert rec.last[1]["k"] is k


def test_run_ragged_hnd_layout_mismatch(rec):
    w, p = planned_ragged(ragged_problem(layout="HND"))
    _run_raises(ValueError, r"\bk\b", rec, w, p, k=p["k"].transpose(0, 1).contiguous(),
                v=p["v"].transpose(0, 1).contiguous())


@pytest.mark.parametrize("what", BAD_PAGED_CACHE_SHAPES)
def test_run_paged_cache_shape(rec, what):
    w, p = planned_paged()
    _run_raises(ValueError, "cache", rec, w, p, cache=bad_paged_cache(p["cache"], what))


def test_run_paged_cache_forms_and_dtypes(rec):
    w, p = planned_paged()
    for exc, match, cache in bad_cache_tuples(p["cache"][:, 0], p["cache"][:, 1]):
        _run_raises(exc, match, rec, w, p, cache=cache)


@pytest.mark.parametrize("which", BOTH_PLANS)
@pytest.mark.parametrize("bad", ["shape", "dtype", "type"])
def test_run_out(rec, which, bad):
    w, p = planned_ragged() if which == "ragged" else planned_paged()
    q = p["q"]
    out = {"shape": torch.empty(q.shape[0], 8, 32, dtype=BF16), "dtype": torch.empty_like(q, dtype=FP16),
           "type": q.tolist()}[bad]
    _run_raises(TypeError if bad == "type" else ValueError, "out", rec, w, p, out=out)


@pytest.mark.parametrize("layout,bad", [("NH", "shape"), ("NH", "dtype"), ("HN", "nh_shape"), ("NH", "hn_shape")])
def test_run_lse(rec, layout, bad):
    w, p = planned_ragged()
    T, H = p["q"].shape[:2]
    lse = {"shape": torch.empty(T, H, 1), "dtype": torch.empty(T, H, dtype=BF16), "nh_shape": torch.empty(T, H),
           "hn_shape": torch.empty(H, T)}[bad]
    _run_raises(ValueError, "lse", rec, w, p, lse=lse, lse_layout=layout, return_lse=True)


@pytest.mark.parametrize("which", BOTH_PLANS)
@pytest.mark.parametrize("bad", ["shape", "dtype", "2d", "type"])
def test_run_sinks(rec, which, bad):
    w, p = planned_ragged() if which == "ragged" else planned_paged()
    sinks = {"shape": torch.zeros(4), "dtype": torch.zeros(8, dtype=BF16), "2d": torch.zeros(2, 4),
             "type": [0.0] * 8}[bad]
    _run_raises(TypeError if bad == "type" else ValueError, "sinks", rec, w, p, sinks=sinks)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(enable_pdl=True), NotImplementedError, "enable_pdl"),
    (dict(kv_cache_sf=torch.zeros(1)), NotImplementedError, "kv_cache_sf"),
    (dict(lse_base="e"), ValueError, "lse_base"),
    (dict(lse_layout="TN"), ValueError, "lse_layout"),
    (dict(q_scale=torch.ones(1)), NotImplementedError, "q_scale"),
    (dict(k_scale="2"), TypeError, "k_scale"),
    (dict(v_scale=torch.ones(1)), NotImplementedError, "v_scale"),
])
@pytest.mark.parametrize("which", BOTH_PLANS)
def test_run_unsupported_options(rec, which, kw, exc, match):
    w, p = planned_ragged() if which == "ragged" else planned_paged()
    _run_raises(exc, match, rec, w, p, **kw)


def test_run_ragged_o_scale(rec):
    _run_raises(TypeError, "o_scale", rec, o_scale="1")
    _run_raises(ValueError, "o_scale", rec, o_scale=0.0)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(skip_softmax_threshold_scale_factor=0.5), NotImplementedError, "skip_softmax_threshold_scale_factor"),
    (dict(use_fp16_softmax=True), NotImplementedError, "use_fp16_softmax"),
    (dict(uses_spcompress=True), NotImplementedError, "uses_spcompress"),
    (dict(window_left=10), ValueError, "window_left"),
])
def test_run_paged_unsupported_options(rec, kw, exc, match):
    w, p = planned_paged()
    _run_raises(exc, match, rec, w, p, **kw)


def test_run_window_left_differs_from_plan(rec):
    w, p = planned_paged(window_left=50)
    _run_raises(ValueError, "window_left", rec, w, p, window_left=49)
    _run_raises(ValueError, "window_left", rec, w, p, window_left=-1)
    w.run(p["q"], p["cache"], window_left=50)  # the planned value is fine
    assert len(rec.calls) == 1


def test_run_extra_positional(rec):
    w, p = planned_ragged()
    with pytest.raises(TypeError):
        w.run(p["q"], p["k"], p["v"], 1.0)
    w, p = planned_paged()
    with pytest.raises(TypeError):
        w.run(p["q"], p["cache"], torch.ones(8))
    assert rec.calls == []


def _rejected_or_handed_over(rec, w, p, name, bad):
    """Layout problems (unit last-dim stride, 16-byte alignment, contiguous out/lse) are checked either
    by run() itself or by the compiled kernel's tvm-ffi entry, which rejects them with a ValueError
    before the launch.  On the CPU the entry is replaced by the recorder, so: run() either raises a
    ValueError naming the argument, or hands the offending tensor itself (not a silent copy) over."""
    kw = {name: bad} if name in ("out", "lse") else {}
    q = bad if name == "q" else p["q"]
    k = bad if name == "k" else p["k"]
    try:
        w.run(q, k, p["v"], **kw)
    except ValueError as e:
        assert rec.calls == [], "an invalid run() reached the kernel"
        assert name in str(e)
        return
    a = rec.last[1]
    t = a[name]
    assert t.data_ptr() == bad.data_ptr() and t.stride() == bad.stride()


def test_run_layout_problems_reach_the_entry_unchanged(rec):
    w, p = planned_ragged()
    T = p["q"].shape[0]
    _rejected_or_handed_over(rec, w, p, "q", torch.zeros(T, 8, 128, dtype=BF16)[:, :, ::2])
    _rejected_or_handed_over(rec, w, p, "q", torch.zeros(T * 8 * 64 + 1, dtype=BF16)[1:].view(T, 8, 64))
    _rejected_or_handed_over(rec, w, p, "k", torch.zeros(p["k"].shape[:-1] + (128,), dtype=BF16)[..., ::2])
    _rejected_or_handed_over(rec, w, p, "out", torch.empty(8, T, 64, dtype=BF16).transpose(0, 1))
    _rejected_or_handed_over(rec, w, p, "lse", torch.empty(8, T).t())


def _EntryRejects(arg_index, pname):
    return EntryRejects(arg_index, pname, "mQ: Tensor, mK: Tensor, mV: Tensor, mIdx: Tensor, mWork: Tensor, mO: Tensor, "
                                          "mLSE: Tensor, mMask: Tensor, mSinks: Tensor")


@pytest.mark.parametrize("which", BOTH_PLANS)
@pytest.mark.parametrize("arg_index,pname,uname", [
    (0, "mQ", "q"), (1, "mK", "k"), (2, "mV", "v"), (5, "mO", "out"), (6, "mLSE", "lse"), (8, "mSinks", "sinks")])
def test_run_kernel_entry_errors_name_the_argument(monkeypatch, which, arg_index, pname, uname):
    _EntryRejects(arg_index, pname).install(monkeypatch)
    if which == "paged" and uname in ("k", "v"):
        uname += "_cache"
    w, p = planned_ragged() if which == "ragged" else planned_paged()
    with pytest.raises(ValueError) as ei:
        if which == "ragged":
            w.run(p["q"], p["k"], p["v"])
        else:
            w.run(p["q"], p["cache"])
    head = str(ei.value).split(" when calling", 1)[0]
    assert re.search(rf"\b{uname}\b", head), head


# ============================================================================= run(): valid launches
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_ragged_valid_launch(rec, layout):
    p = ragged_problem(layout=layout)
    w, _ = planned_ragged(p)
    out = w.run(p["q"], p["k"], p["v"])
    assert len(rec.calls) == 1
    cfg, a = rec.last
    T, hq, hkv, d = p["q"].shape[0], p["hq"], p["hkv"], p["dqk"]
    assert (cfg.dtype, cfg.head_dim_qk, cfg.head_dim_vo, cfg.group_size, cfg.page_size) == ("bfloat16", d, d, 4, 0)
    assert (cfg.causal, cfg.use_window, cfg.use_soft_cap, cfg.use_sinks, cfg.use_custom_mask, cfg.arch) == (
        False, False, False, False, False, "sm_90a")
    assert a["q"] is p["q"]
    for n in ("k", "v"):
        src = p[n] if layout == "NHD" else p[n].transpose(0, 1)
        assert a[n].shape == (sum(KV), hkv, d) and a[n].data_ptr() == src.data_ptr() and a[n].stride() == src.stride()
    assert a["indices"].dtype == torch.int32 and a["indices"].numel() == 1  # ragged: dummy
    work, n = expected_work(QO, KV, indptr(KV)[:-1], 4, tile_m=cfg.tile_m)
    assert a["work"].dtype == torch.int32 and a["work"].shape[1] == WORK_COLS
    assert torch.equal(a["work"], work) and w._plan["num_work"] == n
    assert a["out"] is out and out.shape == (T, hq, d) and out.dtype == BF16 and out.is_contiguous()
    assert a["lse"].shape == (T, hq) and a["lse"].dtype == torch.float32 and a["lse"].is_contiguous()
    assert a["mask"].dtype == torch.uint8 and a["mask"].numel() == 1
    assert a["sinks"].dtype == torch.float32 and a["sinks"].numel() == 1
    assert math.isclose(a["sm_scale"], 1 / math.sqrt(d), rel_tol=1e-12)
    assert a["soft_cap"] == 0.0 and a["window_left"] == -1
    assert torch.equal(out, torch.ones_like(out))


def test_ragged_head_dim_vo_192_128(rec):
    p = ragged_problem(dqk=192, dvo=128, hq=4, hkv=4)
    w, _ = planned_ragged(p, causal=True)
    out, lse = w.run_return_lse(p["q"], p["k"], p["v"])
    cfg, a = rec.last
    assert (cfg.head_dim_qk, cfg.head_dim_vo, cfg.group_size, cfg.causal) == (192, 128, 1, True)
    assert out.shape == (sum(QO), 4, 128) and lse.shape == (sum(QO), 4)
    assert math.isclose(a["sm_scale"], 1 / math.sqrt(192), rel_tol=1e-12)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("form", ["combined", "tuple"])
def test_paged_valid_launch(rec, layout, form):
    p = paged_problem(layout=layout)
    w, _ = planned_paged(p, causal=True, window_left=33, logits_soft_cap=20.0, sm_scale=0.2)
    cache = p["cache"] if form == "combined" else (p["cache"][:, 0], p["cache"][:, 1])
    out = w.run(p["q"], cache)
    cfg, a = rec.last
    assert (cfg.page_size, cfg.group_size, cfg.causal, cfg.use_window, cfg.use_soft_cap) == (16, 4, True, True, True)
    pool = p["cache"].shape[0]
    for n, idx in (("k", 0), ("v", 1)):
        src = p["cache"][:, idx] if layout == "NHD" else p["cache"][:, idx].transpose(1, 2)
        assert a[n].shape == (pool, 16, 2, 64) and a[n].data_ptr() == src.data_ptr() and a[n].stride() == src.stride()
    assert a["indices"] is p["indices"]
    work, _ = expected_work(QO, KV, p["kv_indptr"][:-1], 4, causal=True, window_left=33, tile_m=cfg.tile_m)
    assert torch.equal(a["work"], work)
    assert (a["sm_scale"], a["soft_cap"], a["window_left"]) == (0.2, 20.0, 33)
    assert out.shape == p["q"].shape


def test_paged_page_size_one_forms(rec):
    p = paged_problem(qo=(3, 9), kv=(4, 1), ps=1)
    w, _ = planned_paged(p)
    k, v = p["cache"][:, 0], p["cache"][:, 1]
    w.run(p["q"], (k, v))
    w.run(p["q"], (k[:, 0], v[:, 0]))  # 3-D [pages, H, D]
    w.run(p["q"], p["cache"][:, :, 0])  # 4-D combined [pages, 2, H, D]
    for i in range(3):
        assert rec.named(i)[1]["k"].shape == (p["cache"].shape[0], 1, 2, 64)


def test_paged_block_tables(rec):
    p = paged_problem()
    table = torch.full((4, 20), 7, dtype=torch.int32)
    w = Paged(ws(), "NHD")
    w.plan(*_bt_args(p), q_data_type=BF16, block_tables=table, seq_lens=torch.tensor(KV, dtype=torch.int32))
    w.run(p["q"], p["cache"])
    cfg, a = rec.last
    assert a["indices"].data_ptr() == table.data_ptr() and a["indices"].numel() == 80
    work, _ = expected_work(QO, KV, torch.arange(4) * 20, 4, tile_m=cfg.tile_m)
    assert torch.equal(a["work"], work)


def test_paged_head_dim_vo_tuple(rec):
    p = paged_problem(d=192)
    w = Paged(ws(), "NHD")
    w.plan(*paged_args(p), head_dim_vo=128, q_data_type=BF16)
    k = p["cache"][:, 0]
    v = torch.randn(k.shape[:-1] + (128,)).to(BF16)
    out = w.run(p["q"], (k, v))
    cfg, a = rec.last
    assert (cfg.head_dim_qk, cfg.head_dim_vo) == (192, 128) and out.shape[-1] == 128 and a["v"] is v
    with pytest.raises(ValueError, match="v_cache"):
        w.run(p["q"], (k, k))  # a V cache with head_dim_qk
    with pytest.raises(ValueError, match="v_cache"):
        w.run(p["q"], p["cache"])  # one combined tensor cannot hold head_dim_vo != head_dim_qk
    assert len(rec.calls) == 1


@pytest.mark.parametrize("which", BOTH_PLANS)
@pytest.mark.parametrize("packed", [False, True])
def test_custom_mask_reaches_kernel_packed_little(rec, which, packed):
    m = flat_mask(QO, KV)
    elems = indptr([a * b for a, b in zip(QO, KV)])
    ref_packed, byte_ptr = segment_packbits(m, elems, "little")
    kw = dict(packed_custom_mask=ref_packed) if packed else dict(custom_mask=m)
    w, p = planned_ragged(causal=True, **kw) if which == "ragged" else planned_paged(causal=True, **kw)
    if which == "ragged":
        w.run(p["q"], p["k"], p["v"])
        kv_starts = indptr(KV)[:-1]
    else:
        w.run(p["q"], p["cache"])
        kv_starts = p["kv_indptr"][:-1]
    cfg, a = rec.last
    assert cfg.use_custom_mask and not cfg.causal  # the mask replaces causal: one kernel for both
    assert torch.equal(a["mask"], ref_packed)
    work, _ = expected_work(QO, KV, kv_starts, 4, mask_bits=byte_ptr[:-1].long() * 8, tile_m=cfg.tile_m)
    assert torch.equal(a["work"], work)
    # mask_off is a bit offset, each request on a byte boundary
    offs = {r[0]: r[6] for r in a["work"].tolist()}
    assert all(offs[b] == 8 * int(byte_ptr[b]) for b in offs)


def test_packed_custom_mask_wins(rec):
    m = flat_mask(QO, KV)
    packed, _ = segment_packbits(~m, indptr([a * b for a, b in zip(QO, KV)]), "little")
    w, p = planned_ragged(custom_mask=m, packed_custom_mask=packed)
    w.run(p["q"], p["k"], p["v"])
    assert torch.equal(rec.last[1]["mask"], packed)


def test_custom_mask_any_shape_with_right_numel(rec):
    m = flat_mask((4,), (6,))
    w, p = planned_ragged(ragged_problem(qo=(4,), kv=(6,)), custom_mask=m.view(4, 6))
    w.run(p["q"], p["k"], p["v"])
    assert torch.equal(rec.last[1]["mask"], packbits(m, "little"))


def test_scales(rec):
    w, p = planned_ragged(sm_scale=0.3)
    out = w.run(p["q"], p["k"], p["v"], q_scale=0.5, k_scale=3.0, v_scale=2.0, o_scale=4.0)
    _, a = rec.last
    assert math.isclose(a["sm_scale"], 0.3 * 0.5 * 3.0, rel_tol=1e-12)
    assert torch.equal(out, torch.full_like(out, 0.5))  # v_scale / o_scale multiplies the kernel output
    w, p = planned_paged()
    out = w.run(p["q"], p["cache"], q_scale=2.0, v_scale=3.0)
    assert math.isclose(rec.last[1]["sm_scale"], 2.0 / 8.0, rel_tol=1e-12)
    assert torch.equal(out, torch.full_like(out, 3.0))


@pytest.mark.parametrize("which", BOTH_PLANS)
def test_sinks_select_sink_kernel(rec, which):
    w, p = planned_ragged() if which == "ragged" else planned_paged()
    sinks = torch.randn(p["hq"])
    args = (p["q"], p["k"], p["v"]) if which == "ragged" else (p["q"], p["cache"])
    w.run(*args)
    w.run(*args, sinks=sinks)
    w.run(*args, sinks=sinks)
    assert [c.use_sinks for c in rec.cfgs] == [False, True]  # one kernel per variant, cached per plan
    cfg, a = rec.last
    assert cfg.use_sinks and a["sinks"] is sinks
    assert rec.named(0)[1]["sinks"] is not sinks and rec.named(0)[1]["sinks"].numel() == 1  # the dummy


@pytest.mark.parametrize("layout", ["NH", "HN"])
@pytest.mark.parametrize("base", ["log2", "ln"])
def test_lse_layout_and_base(rec, layout, base):
    w, p = planned_ragged()
    T, H = p["q"].shape[:2]
    out, lse = w.run(p["q"], p["k"], p["v"], return_lse=True, lse_layout=layout, lse_base=base)
    want = 0.5 * (LN2 if base == "ln" else 1.0)
    assert lse.shape == ((T, H) if layout == "NH" else (H, T)) and lse.is_contiguous()
    assert torch.allclose(lse, torch.full_like(lse, want), rtol=0, atol=1e-7)
    _, a = rec.last
    if layout == "NH":
        assert a["lse"] is lse
    else:  # staged in the wrapper's [tokens, heads] buffer
        assert a["lse"].shape == (T, H) and a["lse"].data_ptr() != lse.data_ptr()
    given = torch.empty_like(lse)
    r = w.run(p["q"], p["k"], p["v"], return_lse=True, lse=given, lse_layout=layout, lse_base=base)
    assert r[1] is given and torch.allclose(given, lse)


def test_lse_given_without_return_lse_is_filled(rec):
    w, p = planned_ragged()
    lse = torch.zeros(p["q"].shape[:2])
    out = w.run(p["q"], p["k"], p["v"], lse=lse)
    assert isinstance(out, torch.Tensor) and rec.last[1]["lse"] is lse and torch.all(lse == 0.5)


def test_lse_scratch_when_not_returned(rec):
    w, p = planned_ragged()
    w.run(p["q"], p["k"], p["v"])
    w.run(p["q"], p["k"], p["v"])
    a0, a1 = rec.named(0)[1], rec.named(1)[1]
    assert a0["lse"].data_ptr() == a1["lse"].data_ptr()  # wrapper-owned, reused


def test_given_out_and_aliases(rec):
    w, p = planned_ragged()
    out = torch.empty_like(p["q"])
    r = w.run_return_lse(p["q"], p["k"], p["v"], out=out)
    assert r[0] is out and isinstance(r, tuple)
    assert api_prefill.BatchPrefillWithRaggedKVCacheWrapper.begin_forward is Ragged.plan
    assert Paged.begin_forward is Paged.plan
    w.end_forward()
    w, p = planned_paged()
    r = w.run_return_lse(p["q"], p["cache"])
    assert isinstance(r, tuple) and r[1].shape == p["q"].shape[:2]


def test_dtype_names_and_defaults(rec):
    p = ragged_problem(dtype=FP16)
    w = Ragged(ws(), "NHD")
    w.plan(*ragged_args(p))  # q_data_type defaults to float16
    w.run(p["q"], p["k"], p["v"])
    w.plan(*ragged_args(ragged_problem()), q_data_type="bfloat16", kv_data_type="bf16", o_data_type=BF16)
    assert rec.cfgs[0].dtype == "float16" and w._plan["choice"].problem.dtype == "bfloat16"
    with pytest.raises(ValueError, match="q"):
        w.run(p["q"], p["k"], p["v"])


def test_empty_batch_skips_launch(rec):
    p = ragged_problem(qo=(0, 0), kv=(5, 0))
    w, _ = planned_ragged(p)
    out, lse = w.run(p["q"], p["k"], p["v"], return_lse=True)
    assert out.shape == (0, 8, 64) and lse.shape == (0, 8) and rec.calls == []


def test_replan_changes_kernel(rec):
    w, p = planned_ragged()
    w.run(p["q"], p["k"], p["v"])
    p2 = ragged_problem(qo=(7,), kv=(7,), hq=4, hkv=4, dqk=128, dtype=FP16)
    w.plan(*ragged_args(p2), q_data_type=FP16, causal=True)
    w.run(p2["q"], p2["k"], p2["v"])
    assert [(c.head_dim_qk, c.group_size, c.dtype, c.causal) for c in rec.cfgs] == [
        (64, 4, "bfloat16", False), (128, 1, "float16", True)]
    with pytest.raises(ValueError, match="q"):
        w.run(p["q"], p["k"], p["v"])
    assert len(rec.calls) == 2


def test_reset_workspace_keeps_plan(rec):
    w, p = planned_ragged()
    w.reset_workspace_buffer(ws(2 << 20), torch.zeros(1024, dtype=torch.uint8))
    w.run(p["q"], p["k"], p["v"])
    assert len(rec.calls) == 1
    with pytest.raises(TypeError, match="float_workspace_buffer"):
        w.reset_workspace_buffer(None)


def test_deprecated_forward_overrides_plan_options(rec):
    w, p = planned_ragged(causal=True, window_left=20)
    with pytest.warns(DeprecationWarning, match="forward"):
        w.forward(p["q"], p["k"], p["v"])  # FlashInfer: forward's defaults (causal=False, ...) replace the plan's
    cfg, a = rec.last
    assert not cfg.causal and not cfg.use_window and a["window_left"] == -1
    with pytest.warns(DeprecationWarning):
        o, lse = w.forward_return_lse(p["q"], p["k"], p["v"], causal=True, logits_soft_cap=5.0, sm_scale=0.1)
    cfg, a = rec.last
    assert cfg.causal and cfg.use_soft_cap and (a["soft_cap"], a["sm_scale"]) == (5.0, 0.1)
    w, p = planned_paged()
    with pytest.warns(DeprecationWarning):
        w.forward(p["q"], p["cache"], causal=True, v_scale=2.0)
    assert rec.last[0].causal
    with pytest.warns(DeprecationWarning):
        w.forward(p["q"], p["cache"], pos_encoding_mode="ROPE_LLAMA", rope_theta=5e5)
    cfg, a = rec.last
    assert cfg.pos_encoding_mode == "ROPE_LLAMA" and math.isclose(a["rope_log2_theta"], math.log2(5e5))
    with pytest.warns(DeprecationWarning), pytest.raises(KeyError, match="pos_encoding_mode"):
        w.forward(p["q"], p["cache"], pos_encoding_mode="XPOS")
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="rope_scale"):
        w.forward(p["q"], p["cache"], pos_encoding_mode="ROPE_LLAMA", rope_scale=-1.0)


def test_run_does_not_keep_caller_tensors_alive(rec):
    w, p = planned_paged()
    cache = p.pop("cache")
    ref = weakref.ref(cache)
    w.run(p["q"], (cache[:, 0], cache[:, 1]))
    rec.calls.clear()
    del cache
    gc.collect()
    assert ref() is None


# ============================================================================= CUDA-graph mode
def test_graph_ragged_replan_keeps_buffers(rec):
    B = 4
    bufs = ragged_graph_buffers(B)
    w = Ragged(ws(), "NHD", use_cuda_graph=True, **bufs)
    tm = dispatch.prefill_choice(dispatch.prefill_problem(dtype=BF16, head_dim_qk=64, head_dim_vo=64, group_size=4,
                                                          causal=True)).tile_m
    n_rows = max_tiles(sum(QO), B, 4, tm)
    works = []
    problems = [ragged_problem(), ragged_problem(qo=(1, 40, 30, 7), kv=(100, 40, 1, 7)),  # same total rows (78)
                ragged_problem(qo=(1, 1, 1, 1), kv=(1, 1, 1, 1))]  # fewer rows are fine
    for p in problems:
        w.plan(*ragged_args(p), q_data_type=BF16, causal=True)
        w.run(p["q"], p["k"], p["v"])
        works.append(rec.last[1]["work"].clone())
        exp, n = expected_work(p["qo"], p["kv"], indptr(p["kv"])[:-1], 4, causal=True, num_rows=n_rows, tile_m=tm)
        assert torch.equal(works[-1], exp) and w._plan["num_work"] == n
        assert all(tuple(r) == PAD_ROW for r in works[-1][n:].tolist())
        assert torch.equal(bufs["qo_indptr_buf"], p["qo_indptr"]) and torch.equal(bufs["kv_indptr_buf"], p["kv_indptr"])
    args = [rec.named(i)[1] for i in range(3)]
    for n in ("work", "lse"):
        assert len({a[n].data_ptr() for a in args}) == 1, f"{n} moved between plans"
    assert all(a["work"].shape == (n_rows, WORK_COLS) for a in args)


def test_graph_ragged_limits():
    bufs = ragged_graph_buffers(4)
    w = Ragged(ws(), "NHD", use_cuda_graph=True, **bufs)
    with pytest.raises(ValueError, match="batch size"):
        w.plan(*ragged_args(ragged_problem(qo=(1, 2, 3), kv=(1, 2, 3))), q_data_type=BF16)
    w.plan(*ragged_args(ragged_problem()), q_data_type=BF16)
    before = {k: v.clone() for k, v in bufs.items()}
    with pytest.raises(ValueError, match="total number of rows"):
        w.plan(*ragged_args(ragged_problem(qo=(5, 0, 70, 4), kv=KV)), q_data_type=BF16)
    with pytest.raises(ValueError, match="num_qo_heads"):
        w.plan(*ragged_args(ragged_problem(hq=16, hkv=4)), q_data_type=BF16)
    assert all(torch.equal(before[k], bufs[k]) for k in bufs), "a rejected plan clobbered the graph buffers"


def test_graph_custom_mask_buffers(rec):
    m = flat_mask(QO, KV)
    need = sum((a * b + 7) // 8 for a, b in zip(QO, KV))
    w = Ragged(ws(), "NHD", use_cuda_graph=True, **ragged_graph_buffers(4))
    with pytest.raises(ValueError, match="custom_mask_buf"):
        w.plan(*ragged_args(ragged_problem()), q_data_type=BF16, custom_mask=m)
    bufs = ragged_graph_buffers(4, mask_bytes=need - 1)
    w = Ragged(ws(), "NHD", use_cuda_graph=True, **bufs)
    with pytest.raises(ValueError, match="custom_mask_buf"):
        w.plan(*ragged_args(ragged_problem()), q_data_type=BF16, custom_mask=m)
    bufs = ragged_graph_buffers(4, mask_bytes=need + 10)
    w = Ragged(ws(), "NHD", use_cuda_graph=True, **bufs)
    p = ragged_problem()
    w.plan(*ragged_args(p), q_data_type=BF16, custom_mask=m)
    w.run(p["q"], p["k"], p["v"])
    packed, byte_ptr = segment_packbits(m, indptr([a * b for a, b in zip(QO, KV)]), "little")
    _, a = rec.last
    assert a["mask"] is bufs["custom_mask_buf"] and torch.equal(a["mask"][:need], packed)
    assert torch.equal(bufs["mask_indptr_buf"], byte_ptr)


def test_graph_paged_replan_keeps_buffers(rec):
    B = 4
    bufs = paged_graph_buffers(B, max_pages=64)
    w = Paged(ws(), "NHD", use_cuda_graph=True, **bufs)
    p = paged_problem()
    w.plan(*paged_args(p), q_data_type=BF16)
    w.run(p["q"], p["cache"])
    p2 = paged_problem(qo=(20, 20, 20, 18), kv=(300, 1, 0, 20))
    p2["cache"] = torch.randn(64, 2, 16, 2, 64).to(BF16)
    w.plan(*paged_args(p2), q_data_type=BF16)
    w.run(p2["q"], p2["cache"])
    (_, a1), (_, a2) = rec.named(0), rec.named(1)
    for n in ("indices", "work", "lse"):
        assert a1[n].data_ptr() == a2[n].data_ptr(), f"{n} moved between plans"
    assert a2["indices"] is bufs["paged_kv_indices_buf"]
    assert torch.equal(bufs["paged_kv_indices_buf"][: p2["indices"].numel()], p2["indices"])
    for n, src in (("qo_indptr_buf", "qo_indptr"), ("paged_kv_indptr_buf", "kv_indptr"),
                   ("paged_kv_last_page_len_buf", "last")):
        assert torch.equal(bufs[n], p2[src])
    tm = w._plan["choice"].tile_m
    work, _ = expected_work(p2["qo"], p2["kv"], p2["kv_indptr"][:-1], 4, num_rows=max_tiles(sum(QO), B, 4, tm),
                            tile_m=tm)
    assert torch.equal(a2["work"], work)


def test_graph_paged_indices_do_not_fit():
    w = Paged(ws(), "NHD", use_cuda_graph=True, **paged_graph_buffers(4, max_pages=8))
    with pytest.raises(ValueError, match="paged_kv_indices_buf"):
        w.plan(*paged_args(paged_problem()), q_data_type=BF16)


def test_graph_paged_block_tables_use_owned_buffer(rec):
    w = Paged(ws(), "NHD", use_cuda_graph=True, **paged_graph_buffers(4))
    p = paged_problem()
    sl = torch.tensor(KV, dtype=torch.int32)
    t1 = torch.arange(4 * 16, dtype=torch.int32).view(4, 16)
    w.plan(*_bt_args(p), q_data_type=BF16, block_tables=t1, seq_lens=sl)
    w.run(p["q"], p["cache"])
    t2 = t1.flip(0).contiguous()
    w.plan(*_bt_args(p), q_data_type=BF16, block_tables=t2, seq_lens=sl)
    w.run(p["q"], p["cache"])
    (_, a1), (_, a2) = rec.named(0), rec.named(1)
    assert a1["indices"].data_ptr() == a2["indices"].data_ptr() != t2.data_ptr()
    assert torch.equal(a2["indices"], t2.reshape(-1))
    with pytest.raises(ValueError, match="block_tables"):
        w.plan(*_bt_args(p), q_data_type=BF16, block_tables=torch.zeros(4, 17, dtype=torch.int32), seq_lens=sl)


# ============================================================================= single_prefill_with_kv_cache
def _single(qo_len=37, kv_len=50, hq=8, hkv=2, dqk=64, dvo=None, dtype=BF16, layout="NHD"):
    dvo = dvo or dqk
    q = torch.randn(qo_len, hq, dqk).to(dtype)
    ks = (kv_len, hkv, dqk) if layout == "NHD" else (hkv, kv_len, dqk)
    vs = (kv_len, hkv, dvo) if layout == "NHD" else (hkv, kv_len, dvo)
    return q, torch.randn(ks).to(dtype), torch.randn(vs).to(dtype)


@pytest.mark.parametrize("case,exc,match", [
    ("layout", KeyError, "kv_layout"),
    ("q2d", ValueError, "q"),
    ("k2d", ValueError, "k"),
    ("kv_len", ValueError, "k and v"),
    ("head_dim", ValueError, "head_dim"),
    ("dtype", NotImplementedError, "dtype"),
    ("q_type", TypeError, "q"),
    ("pos", KeyError, "pos_encoding_mode"),
    ("rope_scale", ValueError, "rope_scale"),
    ("rope_theta", ValueError, "rope_theta"),
    ("alibi_cap", NotImplementedError, "logits_soft_cap"),
    ("heads", ValueError, "num_qo_heads"),
    ("group", NotImplementedError, "group"),
    ("d48", NotImplementedError, "head_dim_qk"),
    ("scale_q", NotImplementedError, "scale_q"),
    ("scale_v", NotImplementedError, "scale_v"),
    ("kv_cache_sf", NotImplementedError, "kv_cache_sf"),
    ("o_dtype", NotImplementedError, "o_dtype"),
    ("fa2", NotImplementedError, "backend"),
    ("fa3", NotImplementedError, "backend"),
    ("cudnn", NotImplementedError, "backend='cudnn' is served by the batch prefill wrappers"),
    ("backend", ValueError, "backend"),
    ("fp16_qk", NotImplementedError, "use_fp16_qk_reduction"),
    ("mask_shape", ValueError, "custom_mask"),
    ("mask_dtype", ValueError, "custom_mask"),
    ("packed_len", ValueError, "packed_custom_mask"),
    ("window", ValueError, "window_left"),
])
def test_single_errors(rec, case, exc, match):
    q, k, v = _single()
    kw = {}
    if case == "layout":
        kw["kv_layout"] = "BAD"
    elif case == "q2d":
        q = q[0]
    elif case == "k2d":
        k = k[0]
    elif case == "kv_len":
        v = v[:-1]
    elif case == "head_dim":
        q = torch.randn(37, 8, 128).to(BF16)
    elif case == "dtype":
        k = k.to(FP16)
    elif case == "q_type":
        q = q.tolist()
    elif case == "pos":
        kw["pos_encoding_mode"] = "XPOS"
    elif case == "rope_scale":
        kw.update(pos_encoding_mode="ROPE_LLAMA", rope_scale=0.0)
    elif case == "rope_theta":
        kw.update(pos_encoding_mode="ROPE_LLAMA", rope_theta=float("nan"))
    elif case == "alibi_cap":
        kw.update(pos_encoding_mode="ALIBI", logits_soft_cap=5.0)
    elif case == "heads":
        q = torch.randn(37, 9, 64).to(BF16)
    elif case == "group":
        q, k, v = _single(hq=34, hkv=2)
    elif case == "d48":
        q, k, v = _single(dqk=48)
    elif case in ("scale_q", "scale_v"):
        kw[case] = torch.ones(8)
    elif case == "kv_cache_sf":
        kw[case] = (torch.ones(1), torch.ones(1))
    elif case == "o_dtype":
        kw[case] = torch.float32
    elif case in ("fa2", "fa3", "cudnn"):
        kw["backend"] = case
    elif case == "backend":
        kw["backend"] = "magic"
    elif case == "fp16_qk":
        kw["use_fp16_qk_reduction"] = True
    elif case == "mask_shape":
        kw["custom_mask"] = torch.ones(37, 49, dtype=torch.bool)
    elif case == "mask_dtype":
        kw["custom_mask"] = torch.ones(37, 50, dtype=torch.int32)
    elif case == "packed_len":
        kw["packed_custom_mask"] = torch.zeros(10, dtype=torch.uint8)
    elif case == "window":
        kw["window_left"] = -3
    with pytest.raises(exc, match=match):
        ca.single_prefill_with_kv_cache(q, k, v, **kw)
    assert rec.calls == []


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_valid_launch(rec, layout):
    q, k, v = _single(qo_len=37, kv_len=20, layout=layout)  # qo > kv with causal: the first 17 rows see nothing
    o, lse = ca.single_prefill_with_kv_cache(q, k, v, kv_layout=layout, causal=True, sm_scale=0.2, k_scale=2.0,
                                             v_scale=3.0, logits_soft_cap=7.0, window_left=5, return_lse=True,
                                             o_dtype=BF16)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (37, 8) and lse.dtype == torch.float32
    assert torch.equal(o, torch.full_like(o, 3.0))
    cfg, a = rec.last
    assert (cfg.page_size, cfg.group_size, cfg.causal, cfg.use_soft_cap, cfg.use_window) == (0, 4, True, True, True)
    assert a["q"] is q
    kn = k if layout == "NHD" else k.transpose(0, 1)
    assert a["k"].shape == (20, 2, 64) and a["k"].data_ptr() == k.data_ptr() and a["k"].stride() == kn.stride()
    assert math.isclose(a["sm_scale"], 0.4, rel_tol=1e-12) and (a["soft_cap"], a["window_left"]) == (7.0, 5)
    work, _ = expected_work([37], [20], [0], 4, causal=True, window_left=5, tile_m=cfg.tile_m)
    assert torch.equal(a["work"], work)
    o2 = ca.single_prefill_with_kv_cache(q, k, v, kv_layout=layout)
    assert o2.shape == q.shape and math.isclose(rec.last[1]["sm_scale"], 1 / 8, rel_tol=1e-12)
    assert not rec.last[0].causal


def test_single_return_lse_partial_and_mask(rec):
    q, k, v = _single(qo_len=11, kv_len=13, dqk=128, dvo=64, hq=4, hkv=4)
    m = torch.rand(11, 13) > 0.5
    o, lse = ca.single_prefill_with_kv_cache_return_lse(q, k, v, custom_mask=m, causal=True)
    assert o.shape == (11, 4, 64) and lse.shape == (11, 4)
    cfg, a = rec.last
    assert cfg.use_custom_mask and not cfg.causal and (cfg.head_dim_qk, cfg.head_dim_vo) == (128, 64)
    assert torch.equal(a["mask"], packbits(m.reshape(-1), "little"))
    ca.single_prefill_with_kv_cache(q, k, v, packed_custom_mask=packbits(m.reshape(-1), "little"))
    assert torch.equal(rec.last[1]["mask"], a["mask"])
    ca.single_prefill_with_kv_cache(q, k, v, custom_mask=m.reshape(-1))
    assert torch.equal(rec.last[1]["mask"], a["mask"])


def test_single_empty_kv(rec):
    q, k, v = _single(qo_len=3, kv_len=0)
    o = ca.single_prefill_with_kv_cache(q, k, v, causal=True)
    assert o.shape == q.shape
    _, a = rec.last
    assert [r[3] for r in a["work"].tolist()] == [0]


def test_public_names():
    for n in ("BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper",
              "single_prefill_with_kv_cache", "single_prefill_with_kv_cache_return_lse"):
        assert n in ca.__all__ and getattr(ca, n) is getattr(api_prefill, n)


# ============================================================================= positional encodings (ROPE_LLAMA, ALIBI)
def _alibi_ref(hq):
    from cutedsl_attn.ref import alibi_slopes

    return alibi_slopes(hq).float()


@pytest.mark.parametrize("which", BOTH_PLANS)
def test_pos_rope_valid_launch(rec, which):
    w, p = (planned_ragged if which == "ragged" else planned_paged)(
        pos_encoding_mode="ROPE_LLAMA", rope_scale=4.0, rope_theta=5e5, causal=True)
    w.run(p["q"], p["k"], p["v"]) if which == "ragged" else w.run(p["q"], p["cache"])
    cfg, a = rec.last
    assert cfg.pos_encoding_mode == "ROPE_LLAMA" and cfg.causal
    assert a["rope_rcp_scale"] == 0.25 and math.isclose(a["rope_log2_theta"], math.log2(5e5), rel_tol=1e-15)
    assert a["alibi_slopes"].numel() == 1 and a["alibi_slopes"].dtype == torch.float32  # not read by a RoPE kernel
    # the defaults (FlashInfer): rope_scale 1, rope_theta 1e4
    w, p = (planned_ragged if which == "ragged" else planned_paged)(pos_encoding_mode="ROPE_LLAMA")
    w.run(p["q"], p["k"], p["v"]) if which == "ragged" else w.run(p["q"], p["cache"])
    _, a = rec.last
    assert a["rope_rcp_scale"] == 1.0 and math.isclose(a["rope_log2_theta"], math.log2(1e4), rel_tol=1e-15)


@pytest.mark.parametrize("which", BOTH_PLANS)
@pytest.mark.parametrize("hq,hkv", [(8, 2), (12, 4), (5, 5)])
def test_pos_alibi_valid_launch(rec, which, hq, hkv):
    mk = ragged_problem if which == "ragged" else paged_problem
    w, p = (planned_ragged if which == "ragged" else planned_paged)(mk(hq=hq, hkv=hkv), pos_encoding_mode="ALIBI",
                                                                   causal=True, window_left=7)
    w.run(p["q"], p["k"], p["v"]) if which == "ragged" else w.run(p["q"], p["cache"])
    cfg, a = rec.last
    assert cfg.pos_encoding_mode == "ALIBI" and cfg.group_size == hq // hkv and cfg.use_window
    # FlashInfer's get_alibi_slopes(num_qo_heads), natural-log units, indexed by the query head
    assert a["alibi_slopes"].dtype == torch.float32 and torch.equal(a["alibi_slopes"], _alibi_ref(hq))
    assert (a["rope_rcp_scale"], a["rope_log2_theta"]) == (1.0, math.log2(1e4))
    # a re-plan with the same heads keeps the slopes buffer; NONE hands the kernel the dummy
    ptr = a["alibi_slopes"].data_ptr()
    w.plan(*(ragged_args(p) if which == "ragged" else paged_args(p)), q_data_type=BF16, pos_encoding_mode="ALIBI")
    w.run(p["q"], p["k"], p["v"]) if which == "ragged" else w.run(p["q"], p["cache"])
    assert rec.last[1]["alibi_slopes"].data_ptr() == ptr


def test_pos_modes_are_compile_keys(rec):
    p = paged_problem()
    cfgs = []
    for mode in ("NONE", "ROPE_LLAMA", "ALIBI"):
        w, _ = planned_paged(p, pos_encoding_mode=mode)
        w.run(p["q"], p["cache"])
        cfgs.append(rec.last[0])
    # NONE is served by the SM90 kernel on sm_90a (its config has no positional-encoding field)
    assert [getattr(c, "pos_encoding_mode", "NONE") for c in cfgs] == ["NONE", "ROPE_LLAMA", "ALIBI"]
    assert len(set(cfgs)) == 3
    assert rec.named(0)[1]["alibi_slopes"].numel() == 1 and rec.named(1)[1]["alibi_slopes"].numel() == 1  # dummies


def test_pos_alibi_graph_mode_keeps_slopes_address(rec):
    bufs = paged_graph_buffers(4)
    w = Paged(ws(), "NHD", use_cuda_graph=True, **bufs)
    ptrs = []
    for kv in (KV, (9, 40, 100, 3)):
        p = paged_problem(kv=kv)
        w.plan(*paged_args(p), q_data_type=BF16, pos_encoding_mode="ALIBI", causal=True)
        w.run(p["q"], p["cache"])
        ptrs.append(rec.last[1]["alibi_slopes"].data_ptr())
        assert torch.equal(rec.last[1]["alibi_slopes"], _alibi_ref(p["hq"]))
    assert ptrs[0] == ptrs[1]


@pytest.mark.parametrize("mode", ["ROPE_LLAMA", "ALIBI"])
def test_pos_single_prefill(rec, mode):
    q, k, v = _single(qo_len=37, kv_len=50, hq=8, hkv=2, dqk=128)
    o, lse = ca.single_prefill_with_kv_cache_return_lse(q, k, v, causal=True, pos_encoding_mode=mode,
                                                        rope_scale=2.0, rope_theta=1e6)
    assert o.shape == q.shape and lse.shape == (37, 8)
    cfg, a = rec.last
    assert cfg.pos_encoding_mode == mode and cfg.causal
    assert a["rope_rcp_scale"] == 0.5 and math.isclose(a["rope_log2_theta"], math.log2(1e6), rel_tol=1e-15)
    if mode == "ALIBI":
        assert torch.equal(a["alibi_slopes"], _alibi_ref(8))


def test_pos_encoding_positional_plan_argument(rec):
    # FlashInfer's positional order: ..., custom_mask, packed_custom_mask, causal, pos_encoding_mode
    p = ragged_problem()
    w = Ragged(ws(), "NHD")
    w.plan(*ragged_args(p), None, None, None, True, "ALIBI", q_data_type=BF16)
    w.run(p["q"], p["k"], p["v"])
    assert rec.last[0].pos_encoding_mode == "ALIBI" and rec.last[0].causal


def test_pos_rejected_plan_never_launches(rec):
    for kw in (dict(pos_encoding_mode="ALIBI", logits_soft_cap=1.0), dict(pos_encoding_mode="rope"),
               dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=-1.0)):
        w = Ragged(ws(), "NHD")
        with pytest.raises((NotImplementedError, KeyError, ValueError)):
            w.plan(*ragged_args(ragged_problem()), q_data_type=BF16, **kw)
        with pytest.raises(RuntimeError, match="plan"):
            w.run(torch.zeros(1), torch.zeros(1), torch.zeros(1))
    assert rec.calls == []


def test_pos_kernel_without_pos_args(rec):
    """The SM90 kernel (no positional encodings) gets the dummy slopes; the deprecated forward() switching to ALiBi
    re-dispatches to the portable kernel and re-plans the work table for its tile height."""
    w, p = planned_ragged(causal=True)
    w.run(p["q"], p["k"], p["v"])
    cfg, a = rec.last
    assert cfg.name == "prefill_sm90" and a["alibi_slopes"].numel() == 1
    with pytest.warns(DeprecationWarning):
        w.forward(p["q"], p["k"], p["v"], causal=True, pos_encoding_mode="ALIBI")
    cfg, a = rec.last
    assert cfg.name == "prefill_portable" and cfg.pos_encoding_mode == "ALIBI" and a["alibi_slopes"].numel() == 8
    work, n = expected_work(QO, KV, indptr(KV)[:-1], 4, causal=True, tile_m=cfg.tile_m)
    assert torch.equal(a["work"], work) and w._plan["num_work"] == n
    with pytest.warns(DeprecationWarning):
        w.forward(p["q"], p["k"], p["v"], causal=True, window_left=3)
    cfg, a = rec.last
    assert cfg.name == "prefill_sm90" and cfg.use_window
    assert torch.equal(a["work"], expected_work(QO, KV, indptr(KV)[:-1], 4, causal=True, window_left=3,
                                                tile_m=cfg.tile_m)[0])


# ============================================================================= kernel choice (SM90 vs portable)
def test_sm90_kernel_chosen_and_portable_forced(rec, monkeypatch):
    """On sm_90a the dispatch layer plans the SM90 kernel (192-row tiles at head_dim 64 and for ragged K/V at
    128, else 128) for ragged and paged problems it serves, the portable kernel (64-row tiles) for what it does
    not; the env override forces portable."""
    w, p = planned_ragged()
    assert w._plan["choice"].name == "prefill_sm90" and w._plan["choice"].tile_m == 192
    w, p = planned_ragged(ragged_problem(dqk=128))
    assert w._plan["choice"].name == "prefill_sm90" and w._plan["choice"].tile_m == 192
    w, p = planned_ragged(ragged_problem(dqk=128), logits_soft_cap=30.0)
    assert w._plan["choice"].name == "prefill_sm90" and w._plan["choice"].tile_m == 128
    w, p = planned_ragged(pos_encoding_mode="ALIBI")
    assert w._plan["choice"].name == "prefill_portable" and w._plan["choice"].tile_m == 64
    monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_KERNEL", "portable")
    w, p = planned_ragged()
    assert w._plan["choice"].name == "prefill_portable"


@pytest.mark.parametrize("sm_scale", [-0.125, 0.0])
def test_non_positive_sm_scale_plans_portable(rec, sm_scale):
    """The SM90 kernel folds the scale into the exponent after the row max of the raw logits (needs a scale
    > 0): a planned sm_scale <= 0 runs the portable kernel instead."""
    w, p = planned_ragged(sm_scale=sm_scale)
    w.run(p["q"], p["k"], p["v"])
    cfg, a = rec.last
    assert cfg.name == "prefill_portable" and a["sm_scale"] == sm_scale


def test_sm90_negative_run_scale_raises(rec):
    """A positive planned scale made non-positive by q_scale/k_scale at run() would be a silent wrong answer
    on the SM90 kernel: run() refuses before launching (with a soft cap the scale is applied first: fine)."""
    w, p = planned_ragged(sm_scale=0.125)
    n = len(rec.calls)
    with pytest.raises(NotImplementedError, match="q_scale \\* k_scale"):
        w.run(p["q"], p["k"], p["v"], k_scale=-1.0)
    assert len(rec.calls) == n
    w, p = planned_ragged(sm_scale=0.125, logits_soft_cap=5.0)
    w.run(p["q"], p["k"], p["v"], k_scale=-1.0)
    assert len(rec.calls) == n + 1 and rec.last[0].name == "prefill_sm90"


def test_single_prefill_k_scale_joins_the_plan_scale(rec):
    q = torch.randn(7, 8, 64).to(BF16)
    k = torch.randn(9, 2, 64).to(BF16)
    ca.single_prefill_with_kv_cache(q, k, k.clone(), k_scale=-2.0)
    cfg, a = rec.last
    assert cfg.name == "prefill_portable" and math.isclose(a["sm_scale"], -2.0 / 8.0)


# ============================================================================= review fixes
def test_graph_mode_freezes_kernel_and_scalars(rec):
    """A captured graph replays the first plan's kernel and scalars: a later plan may change lengths only."""
    bufs = ragged_graph_buffers(4)
    w = Ragged(ws(), "NHD", use_cuda_graph=True, **bufs)
    w.plan(*ragged_args(ragged_problem()), q_data_type=BF16, causal=True)
    w.plan(*ragged_args(ragged_problem(qo=(1, 40, 30, 7), kv=(100, 40, 1, 7))), q_data_type=BF16, causal=True)
    for over, name in ((dict(causal=False), "causal"), (dict(causal=True, sm_scale=0.3), "sm_scale"),
                       (dict(causal=True, window_left=7), "window_left"),
                       (dict(causal=True, logits_soft_cap=3.0), "logits_soft_cap"),
                       (dict(causal=True, pos_encoding_mode="ALIBI"), "pos_encoding_mode")):
        with pytest.raises(ValueError, match=name):
            w.plan(*ragged_args(ragged_problem()), q_data_type=BF16, **over)


def test_paged_block_tables_and_csr_must_agree(rec):
    p = paged_problem()
    table = torch.full((4, 20), 7, dtype=torch.int32)
    w = Paged(ws(), "NHD")
    bad = torch.tensor(KV, dtype=torch.int32) + 1
    with pytest.raises(ValueError, match="seq_lens .* disagree"):
        w.plan(*paged_args(p), q_data_type=BF16, block_tables=table, seq_lens=bad)
    w.plan(*paged_args(p), q_data_type=BF16, block_tables=table, seq_lens=torch.tensor(KV, dtype=torch.int32))


@pytest.mark.parametrize("name", ["q_scale", "k_scale", "v_scale", "o_scale"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_run_scales_must_be_finite(rec, name, value):
    w, p = planned_ragged()
    with pytest.raises(ValueError, match=name):
        w.run(p["q"], p["k"], p["v"], **{name: value})


def test_window_left_must_fit_int32(rec):
    with pytest.raises(ValueError, match="window_left"):
        planned_ragged(window_left=2**31)


def test_single_prefill_keeps_no_wrapper(rec):
    """single_prefill_with_kv_cache makes, plans and drops a wrapper per call: no device state outlives a call (a
    CUDA-graph pool must hold only a captured call's outputs), and two threads never share one."""
    q = torch.randn(7, 8, 64).to(BF16)
    k = torch.randn(9, 2, 64).to(BF16)
    made = []
    real_init = Ragged.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        made.append(weakref.ref(self))

    Ragged.__init__ = init
    try:
        ca.single_prefill_with_kv_cache(q, k, k.clone())
        ca.single_prefill_with_kv_cache(q, k, k.clone())
    finally:
        Ragged.__init__ = real_init
    gc.collect()
    assert len(made) == 2 and all(r() is None for r in made)
    assert not hasattr(api_prefill, "_single_state")


# ============================================================================= score_mod (this package's extension)
def _bias(score, b, h, q_idx, kv_idx):
    return score - 0.02 * (q_idx - kv_idx) + 0.1 * h


def test_score_mod_reaches_both_kernels(rec):
    """plan(score_mod=...) puts the callable into the kernel config (and so its compile key): the SM90 kernel where
    it applies (every logit scaled before the max), the portable one elsewhere
    (head_dim 32); the paged wrapper and single_prefill_with_kv_cache take it too."""
    w, p = planned_ragged(causal=True, score_mod=_bias)
    w.run(p["q"], p["k"], p["v"])
    cfg = rec.last[0]
    assert cfg.name == "prefill_sm90" and cfg.score_mod is _bias and cfg.causal
    # head_dim 64: three warpgroups x tile_n 128 and FlashAttention's loop order, as without one (perf/RESULTS.md)
    assert not cfg.positive_scale_only and (cfg.tile_n, cfg.num_wg, cfg.loop_order.name) == (128, 3, "SPLIT_LATE_V")
    p128 = ragged_problem(dqk=128)
    w, _ = planned_ragged(p128, causal=True, score_mod=_bias)
    w.run(p128["q"], p128["k"], p128["v"])
    # head_dim 128: three warpgroups x tile_n 80 with the conditional rescaling, no staging, no stale_max
    c128 = rec.last[0]
    assert (c128.tile_n, c128.num_wg, c128.rescale_threshold, c128.epilogue.name, c128.softmax.name) == (
        80, 3, 8, "REGS", "EXACT")
    p32 = ragged_problem(dqk=32)
    w, _ = planned_ragged(p32, score_mod=_bias)
    w.run(p32["q"], p32["k"], p32["v"])
    assert rec.last[0].name == "prefill_portable" and rec.last[0].score_mod is _bias
    wp, pp = planned_paged(score_mod=_bias)
    wp.run(pp["q"], pp["cache"])
    assert rec.last[0].score_mod is _bias and rec.last[0].page_size == 16
    q, k = torch.randn(7, 8, 64).to(BF16), torch.randn(9, 2, 64).to(BF16)
    ca.single_prefill_with_kv_cache(q, k, k.clone(), score_mod=_bias)
    assert rec.last[0].score_mod is _bias
    w, p = planned_ragged(causal=True)  # no score_mod: none in the config
    w.run(p["q"], p["k"], p["v"])
    assert rec.last[0].score_mod is None


@pytest.mark.parametrize("kw,exc,match", [
    (dict(score_mod=1.5), TypeError, "score_mod must be a callable"),
    (dict(score_mod=_bias, logits_soft_cap=5.0), NotImplementedError, "score_mod together with logits_soft_cap"),
    (dict(score_mod=_bias, pos_encoding_mode="ALIBI"), NotImplementedError, "score_mod together with pos_encoding"),
])
def test_score_mod_errors(rec, kw, exc, match):
    _ragged_plan_raises(exc, match, **kw)
    _paged_plan_raises(exc, match, **kw)
    assert rec.calls == []


def test_score_mod_not_with_cudnn_or_a_forward_soft_cap(rec):
    p = ragged_problem()
    w = Ragged(ws(), "NHD", backend="cudnn")
    with pytest.raises(NotImplementedError, match="score_mod is not supported with backend='cudnn'"):
        w.plan(*ragged_args(p), q_data_type=BF16, score_mod=_bias)
    w, p = planned_ragged(score_mod=_bias)
    with pytest.warns(DeprecationWarning), pytest.raises(NotImplementedError, match="score_mod together with"):
        w.forward(p["q"], p["k"], p["v"], logits_soft_cap=3.0)
    assert rec.calls == []


def _make_bias(c):
    def bias(score, b, h, q_idx, kv_idx):
        return score - c * (q_idx - kv_idx)
    return bias


def test_score_mod_without_stable_key_fails_at_plan(rec):
    """A callable object has no stable compile key: plan() raises TypeError naming score_mod (not run())."""
    class RelBias:
        def __call__(self, score, b, h, q_idx, kv_idx):
            return score

    _ragged_plan_raises(TypeError, "score_mod: cannot derive a stable hash", score_mod=RelBias())
    ok = RelBias()
    ok.__cute_hash__ = "rel-bias-v1"  # FA4's convention: an explicit key
    w, p = planned_ragged(score_mod=ok)
    w.run(p["q"], p["k"], p["v"])
    assert rec.last[0].score_mod is ok


def test_score_mod_cuda_graph_replan(rec):
    """CUDA-graph mode: re-planning with an equal score_mod (a new function object of the same source and closure
    values) is a length-only change; another closure value is refused, naming score_mod."""
    p = ragged_problem()
    w = Ragged(ws(), "NHD", use_cuda_graph=True, **ragged_graph_buffers(len(QO)))
    w.plan(*ragged_args(p), q_data_type=BF16, causal=True, score_mod=_make_bias(0.1))
    w.plan(*ragged_args(p), q_data_type=BF16, causal=True, score_mod=_make_bias(0.1))
    with pytest.raises(ValueError, match="score_mod"):
        w.plan(*ragged_args(p), q_data_type=BF16, causal=True, score_mod=_make_bias(0.2))


# ============================================================================= the launch contract
@pytest.mark.parametrize("name", ["qo_indptr", "kv_indptr"])
def test_plan_ragged_indptr_must_start_at_zero(rec, name):
    """FlashInfer requires offsets from 0: a shifted indptr is a ValueError naming it, before any launch."""
    p = ragged_problem()
    p[name] = p[name] + 3
    w = Ragged(ws(), "NHD")
    with pytest.raises(ValueError, match=rf"{name}\[0\] must be 0"):
        w.plan(*ragged_args(p), q_data_type=BF16)
    assert rec.calls == [] and w._plan is None


@pytest.mark.parametrize("name", ["qo_indptr", "paged_kv_indptr"])
def test_plan_paged_indptr_must_start_at_zero(rec, name):
    p = paged_problem()
    key = "kv_indptr" if name == "paged_kv_indptr" else name
    p[key] = p[key] + 1
    w = Paged(ws(), "NHD")
    with pytest.raises(ValueError, match=rf"{name}\[0\] must be 0"):
        w.plan(*paged_args(p), q_data_type=BF16)
    assert rec.calls == []


@pytest.mark.parametrize("which", BOTH_PLANS)
def test_output_scale_is_a_kernel_argument(monkeypatch, which):
    """v_scale / o_scale reach the kernel as ``output_scale`` (applied in its fp32 epilogue); the API does not
    scale the 16-bit output afterwards (a second rounding)."""
    rec = Recorder().install(monkeypatch)
    for m in dispatch.KERNEL_MODULES.values():  # a kernel that writes O = 1 whatever the output scale
        monkeypatch.setattr(m, "launch", lambda fn, cfg, args: (rec.calls.append((None, cfg, args)),
                                                                args.out.fill_(1.0)))
    w, p = planned_ragged() if which == "ragged" else planned_paged()
    kw = dict(v_scale=3.0, o_scale=4.0) if which == "ragged" else dict(v_scale=3.0)
    out = w.run(p["q"], p["k"], p["v"], **kw) if which == "ragged" else w.run(p["q"], p["cache"], **kw)
    assert rec.last[1]["output_scale"] == (0.75 if which == "ragged" else 3.0)
    assert torch.equal(out, torch.ones_like(out))


def test_ragged_kv_passed_as_given(rec):
    """K/V with spare rows past kv_indptr[-1] reach the kernel as the caller's tensors (no slice, no copy): each
    kernel ignores rows past a request's end."""
    p = ragged_problem()
    k = torch.randn(sum(KV) + 17, 2, 64).to(BF16)
    v = torch.randn(sum(KV) + 17, 2, 64).to(BF16)
    w, _ = planned_ragged(p)
    w.run(p["q"], k, v)
    a = rec.last[1]
    assert a["k"] is k and a["v"] is v


def test_graph_signature_names_what_changed(rec):
    """CUDA-graph mode: the re-plan signature is dispatch.graph_signature of the choice and the plan scalars; a
    changed scalar is named, a changed kernel alone (same scalars) is "the kernel choice"."""
    B = 4
    w = Ragged(ws(), "NHD", use_cuda_graph=True, **ragged_graph_buffers(B))
    p = ragged_problem()
    w.plan(*ragged_args(p), q_data_type=BF16, causal=True)
    sig = w._graph_sig
    assert sig == dispatch.graph_signature(w._plan["choice"], **{k: v for k, v in sig.items() if k != "kernel"})
    assert sig["kernel"] == w._plan["choice"].graph_key and sig["causal"] is True
    with pytest.raises(ValueError, match="logits_soft_cap changed"):
        w.plan(*ragged_args(p), q_data_type=BF16, causal=True, logits_soft_cap=3.0)
    w.plan(*ragged_args(p), q_data_type=BF16, causal=True)  # the same plan again is fine


def test_dispatch_choice_is_the_launch_seam(rec):
    """The API hands dispatch a PrefillArgs; the kernel module's launch orders it for the compiled callable (the
    stub counts the positional arguments: SM90 12, portable 16)."""
    w, p = planned_ragged(causal=True)
    w.run(p["q"], p["k"], p["v"])
    w2, _ = planned_ragged(p, pos_encoding_mode="ROPE_LLAMA")
    w2.run(p["q"], p["k"], p["v"])
    assert [rec.named(i)[0].name for i in range(2)] == ["prefill_sm90", "prefill_portable"]
    assert rec.positional[-1] == 16 and rec.positional[0] in (12, 13)  # SM90: + output_scale once converted


@pytest.mark.parametrize("score_mod", [lambda s: s, lambda s, b, h, q_idx: s, lambda s, b, h, q_idx, kv_idx, x: s])
def test_score_mod_signature_checked_at_plan(rec, score_mod):
    """A score_mod that cannot take (score, batch_idx, head_idx, q_idx, kv_idx) fails in plan(), naming it."""
    match = r"score_mod must accept 5 positional arguments \(score, batch_idx, head_idx, q_idx, kv_idx\)"
    _ragged_plan_raises(TypeError, match, score_mod=score_mod)
    _paged_plan_raises(TypeError, match, score_mod=score_mod)
    assert rec.calls == []


def test_score_mod_signature_with_defaults_or_varargs_accepted(rec):
    w, p = planned_ragged(score_mod=lambda s, b, h, q_idx, kv_idx, c=2.0: s)
    w.run(p["q"], p["k"], p["v"])
    w, p = planned_ragged(score_mod=lambda s, *idx: s)
    w.run(p["q"], p["k"], p["v"])
    assert len(rec.calls) == 2


# ============================================================================= bool arguments are bools
@pytest.mark.parametrize("cls", WRAPPERS)
@pytest.mark.parametrize("name,value", [("use_cuda_graph", "False"), ("variant_owns_mask", 0)])
def test_ctor_bool_options_must_be_bool(cls, name, value):
    with pytest.raises(TypeError, match=f"{name} must be a bool"):
        cls(ws(), "NHD", **{name: value})


@pytest.mark.parametrize("which", BOTH_PLANS)
@pytest.mark.parametrize("name,value", [("causal", "False"), ("causal", 1), ("use_fp16_qk_reduction", "no"),
                                        ("disable_split_kv", "yes"), ("non_blocking", 0)])
def test_plan_bool_options_must_be_bool(rec, which, name, value):
    """A string or int is never taken as a truthy bool (e.g. causal="False" planning a causal mask)."""
    _plan_raises_either(which, TypeError, f"{name} must be a bool", **{name: value})
    assert rec.cfgs == []


@pytest.mark.parametrize("cls", WRAPPERS)
@pytest.mark.parametrize("name,value", [("return_lse", "no"), ("enable_pdl", "False")])
def test_run_bool_options_must_be_bool(rec, cls, name, value):
    w, p = planned_ragged() if cls is Ragged else planned_paged()
    _run_raises(TypeError, f"{name} must be a bool", rec, w, p, **{name: value})


def test_forward_causal_must_be_bool(rec):
    w, p = planned_ragged()
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="causal must be a bool"):
        w.forward(p["q"], p["k"], p["v"], causal="True")
    assert rec.calls == []


@pytest.mark.parametrize("name,value", [("causal", "False"), ("use_fp16_qk_reduction", 0), ("return_lse", "no")])
def test_single_prefill_bool_options_must_be_bool(rec, name, value):
    q, k = torch.randn(7, 8, 64).to(BF16), torch.randn(9, 2, 64).to(BF16)
    with pytest.raises(TypeError, match=f"{name} must be a bool"):
        ca.single_prefill_with_kv_cache(q, k, k.clone(), **{name: value})
    assert rec.calls == []


def test_paged_csr_lengths_disagree_names_batch_source():
    p = paged_problem()
    ip = torch.cat([p["kv_indptr"], p["kv_indptr"][-1:]])
    _paged_plan_raises(ValueError, r"paged_kv_indptr must have B\+1 = \d+ entries \(B = len\(qo_indptr\) - 1\)", p,
                       _replace_paged(p, kv_indptr=ip))


def test_plan_page_less_request_needs_last_page_len_zero():
    p = paged_problem(qo=(3, 2), kv=(0, 5))
    last = p["last"].clone()
    last[0] = 5
    _paged_plan_raises(ValueError, r"paged_kv_last_page_len\[0\] = 5 .*must be 0 for a request with no page", p,
                       _replace_paged(p, last=last))


@pytest.mark.parametrize("name,value", [("use_fp16_softmax", 0), ("uses_spcompress", "False")])
def test_paged_run_optional_bools_must_be_bool(rec, name, value):
    w, p = planned_paged()
    _run_raises(TypeError, f"{name} must be a bool", rec, w, p, **{name: value})
