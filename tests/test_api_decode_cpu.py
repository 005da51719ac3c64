"""CPU tests of the decode API's argument handling (no GPU, no kernel compile).

Every documented error of ``BatchDecodeWithPagedKVCacheWrapper`` (constructor,
``plan``, ``run``) and ``single_decode_with_kv_cache`` must raise the documented
exception type, with a message naming the argument, before any kernel launch.
The compiled kernels behind ``dispatch.KernelChoice`` are replaced by a recorder (``_kernel_stubs``), so
these tests also check what a *valid* call hands to the kernel (tensor shapes,
scalars, the work table) and that an invalid call never reaches it.

Wrapper, workspace and all tensors live on the CPU; ``plan()`` needs a target
architecture for its kernel config, given through ``CUTEDSL_ATTN_ARCH``.
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch

import cutedsl_attn as ca
from cutedsl_attn import dispatch
from cutedsl_attn.api import decode as api_decode
from cutedsl_attn.planning.decode import WORK_COLS, kv_lens_from_csr, max_items, occupancy, plan_paged_decode
from cutedsl_attn import ref
from cutedsl_attn.planning.alibi import get_alibi_slopes as alibi_slopes

from _kernel_stubs import (  # pytest puts tests/ on sys.path
    BAD_PAGED_CACHE_SHAPES, EntryRejects, Recorder, bad_cache_tuples, bad_paged_cache)

BF16, FP16 = torch.bfloat16, torch.float16


# ----------------------------------------------------------------------------- fixtures and helpers
pytestmark = pytest.mark.usefixtures("cross_compile_sm90")  # tests/conftest.py


def csr(lens, page_size, *, spare=3, seed=0):
    """Scattered CSR page table for ``lens`` (int32 CPU tensors) and the pool size."""
    g = torch.Generator().manual_seed(seed)
    npages = [-(-L // page_size) for L in lens]
    pool = sum(npages) + spare
    indices = torch.randperm(pool, generator=g)[: sum(npages)].to(torch.int32)
    indptr = torch.tensor([0] + torch.tensor(npages, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([L - (n - 1) * page_size if n else 0 for L, n in zip(lens, npages)], dtype=torch.int32)
    return indptr, indices, last, pool


def ws(nbytes=8 << 20):
    return torch.zeros(nbytes, dtype=torch.uint8)


def problem(lens=(37, 1, 300, 16), hq=8, hkv=2, d=64, ps=16, dtype=BF16, layout="NHD"):
    indptr, indices, last, pool = csr(list(lens), ps)
    shape = (pool, 2, ps, hkv, d) if layout == "NHD" else (pool, 2, hkv, ps, d)
    cache = torch.randn(shape).to(dtype)
    q = torch.randn(len(lens), hq, d).to(dtype)
    return dict(indptr=indptr, indices=indices, last=last, cache=cache, q=q, hq=hq, hkv=hkv, d=d, ps=ps,
                dtype=dtype, lens=list(lens), layout=layout)


def planned(p=None, layout=None, **plan_kw):
    p = p or problem(layout=layout or "NHD")
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), p["layout"])
    plan_kw.setdefault("q_data_type", p["dtype"])
    w.plan(p["indptr"], p["indices"], p["last"], p["hq"], p["hkv"], p["d"], p["ps"], **plan_kw)
    return w, p


def plan_args(p):
    return (p["indptr"], p["indices"], p["last"], p["hq"], p["hkv"], p["d"], p["ps"])


def graph_buffers(batch, max_pages=64):
    return (torch.zeros(batch + 1, dtype=torch.int32), torch.zeros(max_pages, dtype=torch.int32),
            torch.zeros(batch, dtype=torch.int32))


# ----------------------------------------------------------------------------- constructor
@pytest.mark.parametrize("layout", ["nhd", "NDH", "", None])
def test_ctor_bad_kv_layout(layout):
    with pytest.raises(KeyError, match="kv_layout"):
        ca.BatchDecodeWithPagedKVCacheWrapper(ws(), layout)


@pytest.mark.parametrize("backend", ["fa2", "fa3", "trtllm-gen", "cute-dsl", "prims-ts", "xqa"])
def test_ctor_flashinfer_backend_not_available(backend):
    with pytest.raises(NotImplementedError, match="backend"):
        ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", backend=backend)


def test_ctor_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", backend="triton-magic")


@pytest.mark.parametrize("backend", ["auto", "cute"])
def test_ctor_supported_backends(backend):
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "HND", backend=backend, use_tensor_cores=True)
    assert w.use_tensor_cores and not w.is_cuda_graph_enabled


def test_ctor_jit_args():
    with pytest.raises(NotImplementedError, match="jit_args"):
        ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", jit_args=["x"])


def test_ctor_workspace_type_and_alignment():
    with pytest.raises(TypeError, match="float_workspace_buffer"):
        ca.BatchDecodeWithPagedKVCacheWrapper(bytearray(1024), "NHD")
    with pytest.raises(ValueError, match="float_workspace_buffer"):
        ca.BatchDecodeWithPagedKVCacheWrapper(ws()[1:], "NHD")


@pytest.mark.parametrize("missing", [0, 1, 2])
def test_ctor_cuda_graph_needs_buffers(missing):
    bufs = list(graph_buffers(4))
    bufs[missing] = None
    with pytest.raises(ValueError, match=["paged_kv_indptr_buffer", "paged_kv_indices_buffer",
                                          "paged_kv_last_page_len_buffer"][missing]):
        ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=bufs[0],
                                              paged_kv_indices_buffer=bufs[1],
                                              paged_kv_last_page_len_buffer=bufs[2])


def test_ctor_cuda_graph_buffer_dtype():
    ip, ix, lp = graph_buffers(4)
    with pytest.raises(ValueError, match="paged_kv_indices_buffer"):
        ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=ip,
                                              paged_kv_indices_buffer=ix.long(), paged_kv_last_page_len_buffer=lp)


def test_ctor_cuda_graph_mismatched_buffer_lengths():
    ip, ix, lp = graph_buffers(4)
    with pytest.raises(ValueError, match="paged_kv_indptr_buffer"):
        ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=ip[:-1],
                                              paged_kv_indices_buffer=ix, paged_kv_last_page_len_buffer=lp)
    with pytest.raises(ValueError, match="paged_kv_indptr_buffer"):
        ca.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws(), ip, ix, lp[:-1])


# ----------------------------------------------------------------------------- plan()
def _plan_raises(exc, match, p=None, args=None, **kw):
    p = p or problem()
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD")
    kw.setdefault("q_data_type", p["dtype"])
    with pytest.raises(exc, match=match):
        w.plan(*(args or plan_args(p)), **kw)
    return w, p


def _replace(p, **kw):
    a = dict(zip(("indptr", "indices", "last", "hq", "hkv", "d", "ps"), plan_args(p)))
    a.update(kw)
    return tuple(a.values())


@pytest.mark.parametrize("hq,hkv", [(12, 8), (8, 3), (5, 2)])
def test_plan_heads_not_multiple(hq, hkv):
    p = problem()
    _plan_raises(ValueError, "num_qo_heads", p, _replace(p, hq=hq, hkv=hkv))


@pytest.mark.parametrize("hq,hkv,name", [(0, 1, "num_qo_heads"), (8, 0, "num_kv_heads"), (-8, 2, "num_qo_heads")])
def test_plan_heads_not_positive(hq, hkv, name):
    p = problem()
    _plan_raises(ValueError, name, p, _replace(p, hq=hq, hkv=hkv))


def test_plan_group_too_large():
    p = problem()
    # the message says "GQA group size 32"; it does not spell num_qo_heads / num_kv_heads
    _plan_raises(NotImplementedError, "group size", p, _replace(p, hq=64, hkv=2))


@pytest.mark.parametrize("d", [16, 48, 96, 512])
def test_plan_unsupported_head_dim(d):
    p = problem()
    _plan_raises(NotImplementedError, "head_dim", p, _replace(p, d=d))


@pytest.mark.parametrize("ps", [0, -16])
def test_plan_bad_page_size(ps):
    p = problem()
    _plan_raises(ValueError, "page_size", p, _replace(p, ps=ps))


@pytest.mark.parametrize("bad", [0, 17, -1])
def test_plan_last_page_len_outside_range(bad):
    p = problem()
    last = p["last"].clone()
    last[2] = bad
    _plan_raises(ValueError, "last_page_len", p, _replace(p, last=last))


def test_plan_zero_page_request_allows_last_page_len_zero(rec):
    p = problem(lens=(0, 5, 0))
    w, _ = planned(p)
    o = w.run(p["q"], p["cache"])
    assert o.shape == p["q"].shape and len(rec.calls) == 1


def test_plan_non_monotone_indptr():
    p = problem()
    ip = p["indptr"].clone()
    a, b = int(ip[1]), int(ip[2])
    ip[1], ip[2] = b, a
    assert b > a
    _plan_raises(ValueError, "indptr", p, _replace(p, indptr=ip))


def test_plan_indptr_length():
    p = problem()
    _plan_raises(ValueError, "indptr", p, _replace(p, indptr=p["indptr"][:-1]))
    _plan_raises(ValueError, "indptr", p, _replace(p, indptr=torch.cat([p["indptr"], p["indptr"][-1:]])))


def test_plan_indptr_exceeds_indices():
    p = problem()
    _plan_raises(ValueError, "indices", p, _replace(p, indices=p["indices"][:-2]))


@pytest.mark.parametrize("name", ["indptr", "indices", "last"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_plan_page_table_dtype(name, dtype):
    p = problem()
    arg = {"last": "last_page_len"}.get(name, name)
    _plan_raises((TypeError, ValueError), arg, p, _replace(p, **{name: p[name].to(dtype)}))


@pytest.mark.parametrize("name", ["indptr", "indices", "last"])
def test_plan_page_table_not_tensor_or_wrong_ndim(name):
    p = problem()
    arg = {"last": "last_page_len"}.get(name, name)
    _plan_raises(TypeError, arg, p, _replace(p, **{name: p[name].tolist()}))
    _plan_raises(ValueError, arg, p, _replace(p, **{name: p[name].view(1, -1)}))


@pytest.mark.parametrize("kw,exc,match", [
    (dict(q_data_type=BF16, kv_data_type=FP16), NotImplementedError, "dtype"),
    (dict(q_data_type=FP16, o_data_type=BF16), NotImplementedError, "dtype"),
    (dict(q_data_type=torch.float8_e4m3fn), NotImplementedError, "q_data_type"),
    (dict(q_data_type=BF16, kv_data_type=torch.float8_e5m2), NotImplementedError, "kv_data_type"),
    (dict(q_data_type=BF16, kv_data_type=torch.float8_e4m3fn, o_data_type=FP16), NotImplementedError, "dtype"),
    (dict(q_data_type="float8_e5m2"), NotImplementedError, "q_data_type"),
    (dict(q_data_type=torch.float32), NotImplementedError, "q_data_type"),
    (dict(q_data_type="int8"), TypeError, "q_data_type"),
    (dict(q_data_type=BF16, kv_data_type="nonsense"), TypeError, "kv_data_type"),
])
def test_plan_dtypes(kw, exc, match):
    _plan_raises(exc, match, **kw)


@pytest.mark.parametrize("q_dt", [BF16, FP16])
def test_fp8_kv_cache_plans_and_runs(rec, q_dt):
    # an e4m3 cache under a 16-bit q: the problem carries the cache type, run() checks the cache against it
    p = problem(dtype=q_dt)
    fp8_cache = p["cache"].to(torch.float8_e4m3fn)
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD")
    w.plan(*plan_args(p), q_data_type=q_dt, kv_data_type=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_data_type"):
        w.run(p["q"], p["cache"])  # a 16-bit cache against an fp8 plan
    assert rec.calls == []
    w.run(p["q"], fp8_cache, k_scale=0.5, v_scale=2.0)
    cfg, args = rec.last
    assert cfg.problem.kv_dtype == "float8_e4m3fn" and cfg.problem.dtype == str(q_dt).replace("torch.", "")
    assert args["k"].dtype == torch.float8_e4m3fn and args["output_scale"] == 2.0
    assert args["sm_scale"] == pytest.approx(0.5 / math.sqrt(p["d"]))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("q_dt", [BF16, FP16])
def test_fp8_kv_cache_multirow_plans_and_runs(rec, q_dt, layout):
    # q_len_per_req > 1 over an e4m3 cache: the portable prefill kernel with an fp8 problem; run()'s scales follow
    # the decode wrapper's row of the scale table (sm_scale * q_scale * k_scale, output v_scale)
    p = problem(lens=(37, 3, 300, 16), dtype=q_dt, layout=layout)
    fp8_cache = p["cache"].to(torch.float8_e4m3fn)
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), layout, use_tensor_cores=True)
    w.plan(*plan_args(p), q_data_type=q_dt, kv_data_type=torch.float8_e4m3fn, q_len_per_req=2, sm_scale=0.25)
    q2 = p["q"].repeat_interleave(2, dim=0)
    with pytest.raises(ValueError, match="dtype"):
        w.run(q2, p["cache"])  # a 16-bit cache against an fp8 plan
    assert rec.calls == []
    out = w.run(q2, fp8_cache, q_scale=2.0, k_scale=0.5, v_scale=3.0)
    assert out.shape == q2.shape and out.dtype == q_dt
    cfg, args = rec.last
    assert cfg.name == "prefill_portable"  # the SM90 kernel reads 16-bit K/V
    assert cfg.problem.kv_dtype == "float8_e4m3fn" and cfg.problem.dtype == str(q_dt).replace("torch.", "")
    assert cfg.causal and cfg.group_size == p["hq"] // p["hkv"] and cfg.page_size == p["ps"]
    assert args["k"].dtype == torch.float8_e4m3fn and args["v"].dtype == torch.float8_e4m3fn
    assert args["sm_scale"] == pytest.approx(0.25 * 2.0 * 0.5)
    assert args["output_scale"] == pytest.approx(3.0)
    assert torch.equal(out, torch.full_like(out, 3.0))  # the recorder writes output_scale
    # without scales: the planned sm_scale, output scale 1
    w.run(q2, fp8_cache)
    _, args = rec.last
    assert args["sm_scale"] == pytest.approx(0.25) and args["output_scale"] == 1.0


def test_fp8_kv_cache_multirow_replan_to_16bit(rec):
    # one wrapper re-planned from an fp8 cache to a 16-bit one: the second plan reads 16-bit K/V again
    p = problem(lens=(37, 3, 300, 16))
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", use_tensor_cores=True)
    w.plan(*plan_args(p), q_data_type=BF16, kv_data_type=torch.float8_e4m3fn, q_len_per_req=3)
    q3 = p["q"].repeat_interleave(3, dim=0)
    w.run(q3, p["cache"].to(torch.float8_e4m3fn))
    assert rec.last[0].problem.kv_dtype == "float8_e4m3fn"
    w.plan(*plan_args(p), q_data_type=BF16, q_len_per_req=3)
    with pytest.raises(ValueError, match="dtype"):
        w.run(q3, p["cache"].to(torch.float8_e4m3fn))
    w.run(q3, p["cache"])
    assert rec.last[0].problem.kv_dtype == "" and rec.last[1]["k"].dtype == BF16


def test_fp8_kv_cache_multirow_cuda_graph_mode(rec):
    # CUDA-graph mode: re-plans of the fp8 plan keep the kernel; a 16-bit cache would be another kernel, which
    # a captured graph cannot replay (ValueError at plan time, naming what changed)
    p = problem(lens=(37, 3, 300, 16))
    ip, ix, lp = graph_buffers(4)
    w = ca.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws(), ip, ix, lp, "NHD", use_tensor_cores=True)
    w.plan(*plan_args(p), q_data_type=BF16, kv_data_type=torch.float8_e4m3fn, q_len_per_req=2)
    q2 = p["q"].repeat_interleave(2, dim=0)
    w.run(q2, p["cache"].to(torch.float8_e4m3fn), k_scale=0.5)
    first = rec.last[0]
    assert first.problem.kv_dtype == "float8_e4m3fn" and rec.last[1]["indices"] is ix  # the caller's buffer
    w.plan(*plan_args(p), q_data_type=BF16, kv_data_type=torch.float8_e4m3fn, q_len_per_req=2)
    w.run(q2, p["cache"].to(torch.float8_e4m3fn))
    assert rec.last[0] == first
    with pytest.raises(ValueError, match="kernel choice changed"):
        w.plan(*plan_args(p), q_data_type=BF16, q_len_per_req=2)


def test_fp8_kv_cache_multirow_cudnn_not_served():
    p = problem(lens=(37, 3, 300, 16))
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", use_tensor_cores=True, backend="cudnn")
    with pytest.raises(NotImplementedError, match="fp8|float8"):
        w.plan(*plan_args(p), q_data_type=BF16, kv_data_type=torch.float8_e4m3fn, q_len_per_req=2)


def test_plan_deprecated_data_type_alone_does_not_plan_bf16():
    # FlashInfer trap (flashinfer_api.md section 6.5): data_type fills only unset q/kv and
    # q_data_type defaults to float16, so data_type=bf16 alone cannot give a bf16 plan.
    p = problem()
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD")
    with pytest.raises((NotImplementedError, ValueError)):
        w.plan(*plan_args(p), data_type=BF16)
        w.run(p["q"], p["cache"])


def test_plan_data_type_fills_unset_q_and_kv(rec):
    p = problem()
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD")
    w.plan(*plan_args(p), q_data_type=None, data_type="bfloat16")
    w.run(p["q"], p["cache"])
    assert rec.last[0].dtype == "bfloat16"


def test_plan_q_len_per_req():
    # as FlashInfer: more than one query row per request needs the tensor-core path
    _plan_raises(ValueError, "use_tensor_cores", q_len_per_req=2)
    _plan_raises(ValueError, "q_len_per_req", q_len_per_req=0)


def test_plan_multirow_routes_to_prefill(rec):
    p = problem(lens=(37, 3, 300, 16))
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", use_tensor_cores=True)
    with pytest.raises(ValueError, match="kv_len must be >= q_len_per_req"):
        w.plan(*plan_args(p), q_data_type=BF16, q_len_per_req=4)
    with pytest.raises(NotImplementedError, match="is_causal=False"):
        w.plan(*plan_args(p), q_data_type=BF16, q_len_per_req=2, is_causal=False)
    w.plan(*plan_args(p), q_data_type=BF16, q_len_per_req=3)
    B, hq, d = p["q"].shape
    q3 = p["q"].repeat_interleave(3, dim=0)
    with pytest.raises(ValueError, match="q"):
        w.run(p["q"], p["cache"])  # B rows, but 3 per request were planned
    with pytest.raises(ValueError, match="q_len_per_req"):
        w.run(q3, p["cache"], q_len_per_req=2)
    out = w.run(q3, p["cache"])
    assert out.shape == (3 * B, hq, d)
    cfg, args = rec.last
    assert cfg.name.startswith("prefill_")
    assert cfg.causal and cfg.group_size == hq // p["hkv"] and cfg.page_size == 16
    work = args["work"].cpu()
    live = work[work[:, 0] >= 0]
    assert sorted(set(live[:, 0].tolist())) == list(range(B))  # every request has a tile
    assert (live[:, 2] == 3).all()  # qo_len column = q_len_per_req


@pytest.mark.parametrize("wr", [1, 7, -1])
def test_plan_window_right(wr):
    _plan_raises(NotImplementedError, "window_right", window_right=wr)


@pytest.mark.parametrize("wl,exc", [(-2, ValueError), (1.5, TypeError), ("3", TypeError), (True, TypeError)])
def test_plan_bad_window_left(wl, exc):
    _plan_raises(exc, "window_left", window_left=wl)


def test_plan_soft_cap_with_alibi():
    _plan_raises(NotImplementedError, "logits_soft_cap", pos_encoding_mode="ALIBI", logits_soft_cap=30.0)


def test_plan_negative_soft_cap():
    _plan_raises(ValueError, "logits_soft_cap", logits_soft_cap=-1.0)


@pytest.mark.parametrize("mode", ["ROPE", "rope_llama", "alibi", ""])
def test_plan_bad_pos_encoding_mode(mode):
    _plan_raises(KeyError, "pos_encoding_mode", pos_encoding_mode=mode)


@pytest.mark.parametrize("fs", [0, -4])
def test_plan_fixed_split_size_not_positive(fs):
    _plan_raises(ValueError, "fixed_split_size", fixed_split_size=fs)


def test_plan_workspace_too_small():
    p = problem(lens=(5000, 5000), hq=32, hkv=8, d=128)
    w = ca.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(4096, dtype=torch.uint8), "NHD")
    with pytest.raises(ValueError, match="float_workspace_buffer"):
        w.plan(*plan_args(p), q_data_type=BF16)


def test_plan_indices_on_other_device_are_copied(rec):
    # as FlashInfer 0.7.2: page indices (and block tables) given on another device are copied to the wrapper's
    p = problem()
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD")
    w.device = torch.device("meta")  # pretend the wrapper lives elsewhere
    w.plan(*plan_args(p), q_data_type=BF16)
    assert w._plan["indices"].device.type == "meta"


def test_plan_csr_with_agreeing_block_tables_or_seq_lens_accepted(rec):
    # as FlashInfer: block_tables / seq_lens beside the CSR table are optional overrides that must agree
    p = problem()
    bt, sl = ref.csr_to_block_tables(p["indptr"], p["indices"], p["last"], p["ps"])
    bt, sl = bt.to(torch.int32), sl.to(torch.int32)
    w, _ = planned(p, block_tables=bt, seq_lens=sl)
    assert torch.equal(w._plan["indices"], bt.reshape(-1))  # block_tables serves the launch
    w.run(p["q"], p["cache"])
    w2, _ = planned(p, seq_lens=sl)
    assert torch.equal(w2._plan["indices"], p["indices"])  # CSR serves; seq_lens agrees
    w2.run(p["q"], p["cache"])
    assert len(rec.calls) == 2
    assert torch.equal(torch.as_tensor(w._plan["kv_lens"]), torch.as_tensor(w2._plan["kv_lens"]))
    assert torch.as_tensor(w._plan["kv_lens"]).tolist() == p["lens"]


def test_plan_csr_with_disagreeing_seq_lens_rejected():
    p = problem()
    bt, sl = ref.csr_to_block_tables(p["indptr"], p["indices"], p["last"], p["ps"])
    bt, sl = bt.to(torch.int32), sl.to(torch.int32)
    bad = sl.clone()
    bad[0] += 1  # still within its 3 pages: only the CSR lengths disagree
    _plan_raises(ValueError, r"seq_lens .*indptr/last_page_len", p, block_tables=bt, seq_lens=bad)
    _plan_raises(ValueError, r"seq_lens .*indptr/last_page_len", p, seq_lens=bad)
    short = p["last"][:-1]
    _plan_raises(ValueError, "last_page_len", p, block_tables=bt, seq_lens=sl, args=_replace(p, last=short))


def test_plan_indptr_and_last_page_len_lengths_disagree():
    p = problem()
    args = _replace(p, indptr=torch.tensor([0, 2, 3], dtype=torch.int32), last=torch.tensor([5], dtype=torch.int32))
    w, _ = _plan_raises(ValueError, r"lengths of indptr \(3\) and last_page_len \(1\) disagree", p, args)


def test_plan_page_less_request_needs_last_page_len_zero():
    p = problem()
    args = _replace(p, indptr=torch.tensor([0, 0, 3], dtype=torch.int32),
                    last=torch.tensor([5, 16], dtype=torch.int32))
    _plan_raises(ValueError, r"last_page_len\[0\] = 5 .*must be 0 for a request with no page", p, args)


def test_run_empty_batch_launches_nothing(rec):
    p = problem()
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD")
    w.plan(torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
           p["hq"], p["hkv"], p["d"], p["ps"], q_data_type=p["dtype"])
    o, lse = w.run(p["q"][:0], p["cache"], return_lse=True)
    assert o.shape == (0, p["hq"], p["d"]) and lse.shape == (0, p["hq"])
    assert rec.calls == []


@pytest.mark.parametrize("name,value", [("use_tensor_cores", "no"), ("use_cuda_graph", 0)])
def test_ctor_bool_options_must_be_bool(name, value):
    with pytest.raises(TypeError, match=name):
        ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", **{name: value})


@pytest.mark.parametrize("name,value", [("disable_split_kv", "yes"), ("non_blocking", 1), ("is_causal", "False")])
def test_plan_bool_options_must_be_bool(name, value):
    _plan_raises(TypeError, name, **{name: value})


@pytest.mark.parametrize("name,value", [("return_lse", "no"), ("enable_pdl", 0)])
def test_run_bool_options_must_be_bool(rec, name, value):
    w, p = planned()
    with pytest.raises(TypeError, match=name):
        w.run(p["q"], p["cache"], **{name: value})
    assert rec.calls == []


@pytest.mark.parametrize("name,value", [("use_tensor_cores", "no"), ("return_lse", 1)])
def test_single_bool_options_must_be_bool(rec, name, value):
    q, k, v = _single()
    with pytest.raises(TypeError, match=name):
        ca.single_decode_with_kv_cache(q, k, v, **{name: value})
    assert rec.calls == []


@pytest.mark.parametrize("kw,exc,match", [
    (dict(sm_scale=float("nan")), ValueError, "sm_scale"),
    (dict(sm_scale="0.1"), TypeError, "sm_scale"),
    (dict(logits_soft_cap=float("inf")), ValueError, "logits_soft_cap"),
    (dict(rope_scale=0.0), ValueError, "rope_scale"),
    (dict(rope_theta=-1.0), ValueError, "rope_theta"),
    (dict(fixed_split_size=1.5), TypeError, "fixed_split_size"),
    (dict(fixed_split_size=0), ValueError, "fixed_split_size"),
])
def test_plan_bad_scalars(kw, exc, match):
    _plan_raises(exc, match, **kw)


@pytest.mark.parametrize("sm_scale", [-0.3, 0.0])
def test_plan_sm_scale_of_any_sign(rec, sm_scale):
    # as the prefill wrappers' plan(): the decode kernels scale the logits before the running max
    p = problem(lens=(37, 3, 300, 16))
    w, _ = planned(p, sm_scale=sm_scale)
    w.run(p["q"], p["cache"], k_scale=2.0)
    cfg, a = rec.last
    assert cfg.name == "paged_decode" and a["sm_scale"] == sm_scale * 2.0
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", use_tensor_cores=True)
    w.plan(*plan_args(p), q_data_type=BF16, q_len_per_req=2, sm_scale=sm_scale)
    w.run(p["q"].repeat_interleave(2, dim=0), p["cache"])
    cfg, a = rec.last
    assert cfg.name == "prefill_portable" and a["sm_scale"] == sm_scale  # the SM90 kernel needs sm_scale > 0
    _plan_raises(ValueError, "sm_scale", sm_scale=1e39)  # finite in float32, as check_sm_scale
    _plan_raises(TypeError, "sm_scale", sm_scale=True)
    doc = ca.BatchDecodeWithPagedKVCacheWrapper.plan.__doc__
    assert "of any sign" in doc


def test_run_numpy_scales_are_reals(rec):
    np = pytest.importorskip("numpy")
    p = problem()
    w, _ = planned(p, sm_scale=np.float32(0.25))
    w.run(p["q"], p["cache"], q_scale=np.float64(2.0), k_scale=np.float32(0.5), v_scale=np.float32(3.0))
    _, a = rec.last
    assert a["sm_scale"] == 0.25 and a["output_scale"] == 3.0 and type(a["sm_scale"]) is float
    for name in ("q_scale", "k_scale", "v_scale"):
        with pytest.raises(TypeError, match=f"{name} must be a float"):
            w.run(p["q"], p["cache"], **{name: True})
    ca.single_decode_with_kv_cache(*_single(), k_scale=np.float32(0.5))
    _, a = rec.last
    assert a["sm_scale"] == 0.5 / 8


def test_multirow_run_shapes_and_split_options(rec):
    # q_len_per_req > 1: out / lse / the return are [B * q_len, ...]; the split options change no launch
    p = problem(lens=(37, 3, 300, 16))
    B, hq, d = p["q"].shape
    q2 = p["q"].repeat_interleave(2, dim=0)
    works = []
    for kw in (dict(), dict(fixed_split_size=1), dict(disable_split_kv=True)):
        w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", use_tensor_cores=True)
        w.plan(*plan_args(p), q_data_type=BF16, q_len_per_req=2, **kw)
        out, lse = w.run(q2, p["cache"], return_lse=True)
        assert out.shape == (2 * B, hq, d) and lse.shape == (2 * B, hq)
        works.append(rec.last[1]["work"].cpu())
        o_buf, l_buf = torch.empty(2 * B, hq, d, dtype=BF16), torch.empty(2 * B, hq)
        r = w.run(q2, p["cache"], out=o_buf, lse=l_buf, return_lse=True)
        assert r[0] is o_buf and r[1] is l_buf
        with pytest.raises(ValueError, match="out"):
            w.run(q2, p["cache"], out=torch.empty(B, hq, d, dtype=BF16))
    assert all(torch.equal(wk, works[0]) for wk in works)
    plan_doc, run_doc = (getattr(ca.BatchDecodeWithPagedKVCacheWrapper, n).__doc__ for n in ("plan", "run"))
    assert "With ``q_len_per_req > 1`` neither changes the schedule" in plan_doc
    assert "[B * q_len_per_req, Hq, D]" in run_doc and "[B * q_len_per_req, Hq]" in run_doc


def test_plan_positional_options_deprecated(rec):
    p = problem()
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD")
    with pytest.warns(DeprecationWarning, match="positional"):
        #             pos_encoding_mode, window_left, logits_soft_cap, q_data_type
        w.plan(*plan_args(p), "ROPE_LLAMA", 20, 5.0, BF16)
    w.run(p["q"], p["cache"], window_left=20)
    cfg, a = rec.last
    assert cfg.pos_encoding_mode == "ROPE_LLAMA" and cfg.use_soft_cap and cfg.dtype == "bfloat16"
    assert a["soft_cap"] == 5.0
    with pytest.raises(ValueError, match="window_left"):
        w.run(p["q"], p["cache"], window_left=-1)


def test_plan_too_many_positional():
    p = problem()
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD")
    with pytest.raises(TypeError, match="positional"):
        w.plan(*plan_args(p), *([None] * 17))


def test_plan_block_tables_without_seq_lens():
    p = problem()
    bt = torch.zeros(4, 32, dtype=torch.int32)
    _plan_raises(ValueError, "block_tables", p, (None, None, None, p["hq"], p["hkv"], p["d"], p["ps"]),
                 block_tables=bt)
    _plan_raises(ValueError, "seq_lens", p, (None, None, None, p["hq"], p["hkv"], p["d"], p["ps"]),
                 seq_lens=torch.tensor(p["lens"], dtype=torch.int32))


def test_plan_block_tables_too_narrow():
    p = problem()  # longest request 300 tokens = 19 pages of 16
    bt = torch.zeros(4, 18, dtype=torch.int32)
    _plan_raises(ValueError, "block_tables", p, (None, None, None, p["hq"], p["hkv"], p["d"], p["ps"]),
                 block_tables=bt, seq_lens=torch.tensor(p["lens"], dtype=torch.int32))


def test_plan_block_tables_bad_shapes():
    p = problem()
    args = (None, None, None, p["hq"], p["hkv"], p["d"], p["ps"])
    sl = torch.tensor(p["lens"], dtype=torch.int32)
    _plan_raises((TypeError, ValueError), "block_tables", p, args, block_tables=torch.zeros(4, 32, dtype=torch.int64),
                 seq_lens=sl)
    _plan_raises(ValueError, "block_tables", p, args, block_tables=torch.zeros(4 * 32, dtype=torch.int32), seq_lens=sl)
    _plan_raises(ValueError, "seq_lens", p, args, block_tables=torch.zeros(3, 32, dtype=torch.int32), seq_lens=sl)
    _plan_raises(ValueError, "seq_lens", p, args, block_tables=torch.zeros(4, 32, dtype=torch.int32),
                 seq_lens=torch.tensor([1, -1, 2, 3], dtype=torch.int32))


def _graph_wrapper(batch, max_pages=64):
    ip, ix, lp = graph_buffers(batch, max_pages)
    return ca.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws(), ip, ix, lp, "NHD"), (ip, ix, lp)




def test_plan_cuda_graph_batch_size_change_before_any_plan():
    w, _ = _graph_wrapper(3)
    p = problem()  # batch 4
    with pytest.raises(ValueError, match="batch size"):
        w.plan(*plan_args(p), q_data_type=BF16)


def test_plan_cuda_graph_batch_size_change_keeps_buffers():
    w, (ip, ix, lp) = _graph_wrapper(4)
    p = problem()
    w.plan(*plan_args(p), q_data_type=BF16)
    before = (ip.clone(), ix.clone(), lp.clone())
    p2 = problem(lens=(10, 20, 30))
    with pytest.raises(ValueError, match="batch size"):
        w.plan(*plan_args(p2), q_data_type=BF16)
    assert all(torch.equal(a, b) for a, b in zip(before, (ip, ix, lp)))


def test_plan_cuda_graph_indices_do_not_fit():
    w, _ = _graph_wrapper(4, max_pages=8)
    p = problem()
    with pytest.raises(ValueError, match="paged_kv_indices_buffer"):
        w.plan(*plan_args(p), q_data_type=BF16)


def test_plan_cuda_graph_heads_cannot_change():
    w, _ = _graph_wrapper(4)
    p = problem()
    w.plan(*plan_args(p), q_data_type=BF16)
    p2 = problem(hq=16, hkv=4)
    with pytest.raises(ValueError, match="num_qo_heads"):
        w.plan(*plan_args(p2), q_data_type=BF16)


# ----------------------------------------------------------------------------- run(): errors
def _run_raises(exc, match, rec, w=None, p=None, q=None, cache=None, **kw):
    if w is None:
        w, p = planned()
    with pytest.raises(exc, match=match):
        w.run(p["q"] if q is None else q, p["cache"] if cache is None else cache, **kw)
    assert rec.calls == [], "an invalid run() reached the kernel"


def test_run_before_plan(rec):
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD")
    p = problem()
    with pytest.raises(RuntimeError, match="plan"):
        w.run(p["q"], p["cache"])
    assert rec.calls == []


@pytest.mark.parametrize("shape_change", ["batch", "heads", "dim", "ndim"])
def test_run_q_shape(rec, shape_change):
    w, p = planned()
    q = p["q"]
    q = {"batch": q[:-1], "heads": q[:, :-1], "dim": torch.zeros(4, 8, 32, dtype=BF16), "ndim": q[0]}[shape_change]
    _run_raises(ValueError, "q", rec, w, p, q=q)


def test_run_q_dtype(rec):
    w, p = planned()
    _run_raises(ValueError, "q", rec, w, p, q=p["q"].to(FP16))


def test_run_q_not_tensor(rec):
    w, p = planned()
    _run_raises(TypeError, "q", rec, w, p, q=p["q"].tolist())


def _rejected_or_handed_over(rec, w, p, name, bad):
    """Layout problems (unit last-dim stride, 16-byte alignment, contiguous out/lse) are checked
    either by run() itself or by the compiled kernel's tvm-ffi entry, which rejects them with a
    ValueError before the launch.  On the CPU the entry is replaced by the recorder, so: run()
    either raises a ValueError naming the argument, or hands the offending tensor itself (not a
    silent copy) to the kernel entry."""
    kw = {name: bad} if name in ("out", "lse") else {}
    try:
        w.run(p["q"] if name != "q" else bad, p["cache"] if name != "cache" else bad, **kw)
    except ValueError as e:
        assert rec.calls == [], "an invalid run() reached the kernel"
        assert {"cache": "k_cache"}.get(name, name) in str(e)
        return
    a = rec.last[1]
    if name == "cache":
        assert a["k"].data_ptr() == bad[:, 0].data_ptr() and a["k"].stride() == bad[:, 0].stride()
    else:
        t = a[name]
        assert t.data_ptr() == bad.data_ptr() and t.stride() == bad.stride()


def test_run_q_strided_last_dim(rec):
    w, p = planned()
    _rejected_or_handed_over(rec, w, p, "q", torch.zeros(4, 8, 128, dtype=BF16)[:, :, ::2])


def test_run_q_misaligned(rec):
    w, p = planned()
    _rejected_or_handed_over(rec, w, p, "q", torch.zeros(4 * 8 * 64 + 1, dtype=BF16)[1:].view(4, 8, 64))


def _EntryRejects(arg_index, pname):
    return EntryRejects(arg_index, pname, "mQ: Tensor, mK: Tensor, mV: Tensor, mIdx: Tensor, mWork: Tensor, mO: Tensor, "
                                          "mLSE: Tensor")


ENTRY_ARGS = [(0, "mQ", "q"), (1, "mK", "k_cache"), (2, "mV", "v_cache"), (5, "mO", "out"), (6, "mLSE", "lse")]


@pytest.mark.parametrize("arg_index,pname,uname", ENTRY_ARGS)
def test_run_kernel_entry_errors_name_the_argument(monkeypatch, arg_index, pname, uname):
    _EntryRejects(arg_index, pname).install(monkeypatch)
    _assert_entry_error_names(uname)


def _assert_entry_error_names(uname):
    """The head of the message (before the entry's long signature) names the FlashInfer argument."""
    w, p = planned()
    with pytest.raises(ValueError) as ei:
        w.run(p["q"], p["cache"])
    head = str(ei.value).split(" when calling", 1)[0]
    assert re.search(rf"\b{uname}\b", head), head
    assert "expected" in str(ei.value), "the entry's own reason is kept"


@pytest.mark.parametrize("arg_index,pname,uname", ENTRY_ARGS)
def test_run_kernel_entry_alignment_errors_name_the_argument(monkeypatch, arg_index, pname, uname):
    rej = _EntryRejects(arg_index, pname)
    rej.msg = (f"Misaligned Tensor data on argument #{arg_index} when calling: `__call__(mQ: Tensor([n0, n1, 64], "
               f"bfloat16), mK: Tensor([n2, 16, n3, 64], bfloat16), mV: Tensor([n2, 16, n3, 64], bfloat16), "
               f"mIdx: Tensor([n4], int32), mWork: Tensor([n5, 8], int32), mO: Tensor([n0, n1, 64], bfloat16), "
               f"mLSE: Tensor([n0, n1], float32), ...)`, expected data alignment=16 bytes")
    rej.install(monkeypatch)
    _assert_entry_error_names(uname)


@pytest.mark.parametrize("what", BAD_PAGED_CACHE_SHAPES)
def test_run_kv_cache_shape(rec, what):
    w, p = planned()
    _run_raises(ValueError, "cache", rec, w, p, cache=bad_paged_cache(p["cache"], what))


def test_run_kv_cache_tuple_forms_and_dtypes(rec):
    w, p = planned()
    for exc, match, cache in bad_cache_tuples(p["cache"][:, 0], p["cache"][:, 1]):
        _run_raises(exc, match, rec, w, p, cache=cache)


def test_run_kv_cache_strided_last_dim(rec):
    w, p = planned()
    big = torch.zeros(p["cache"].shape[:-1] + (128,), dtype=BF16)[..., ::2]
    _rejected_or_handed_over(rec, w, p, "cache", big)


@pytest.mark.parametrize("bad", ["shape", "dtype", "type"])
def test_run_out(rec, bad):
    w, p = planned()
    q = p["q"]
    out = {"shape": torch.empty(4, 8, 32, dtype=BF16), "dtype": torch.empty_like(q, dtype=FP16),
           "type": q.tolist()}[bad]
    _run_raises(TypeError if bad == "type" else ValueError, "out", rec, w, p, out=out)


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_run_lse(rec, bad):
    w, p = planned()
    lse = {"shape": torch.empty(4, 8, 1), "dtype": torch.empty(4, 8, dtype=BF16)}[bad]
    _run_raises(ValueError, "lse", rec, w, p, lse=lse)


def test_run_out_and_lse_not_contiguous(rec):
    w, p = planned()
    _rejected_or_handed_over(rec, w, p, "out", torch.empty(8, 4, 64, dtype=BF16).transpose(0, 1))
    rec.calls.clear()
    _rejected_or_handed_over(rec, w, p, "lse", torch.empty(8, 4).t())


@pytest.mark.parametrize("bad", ["shape", "dtype", "2d"])
def test_run_sinks(rec, bad):
    w, p = planned()
    sinks = {"shape": torch.zeros(4), "dtype": torch.zeros(8, dtype=BF16), "2d": torch.zeros(2, 4)}[bad]
    _run_raises(ValueError, "sinks", rec, w, p, sinks=sinks)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(enable_pdl=True), NotImplementedError, "enable_pdl"),
    (dict(kv_cache_sf=torch.zeros(1)), NotImplementedError, "kv_cache_sf"),
    (dict(skip_softmax_threshold_scale_factor=0.5), NotImplementedError, "skip_softmax_threshold_scale_factor"),
    (dict(q_len_per_req=2), ValueError, "q_len_per_req"),
    (dict(window_left=10), ValueError, "window_left"),
])
def test_run_unsupported_options(rec, kw, exc, match):
    _run_raises(exc, match, rec, **kw)


def test_run_window_left_differs_from_plan(rec):
    w, p = planned(window_left=50)
    _run_raises(ValueError, "window_left", rec, w, p, window_left=49)
    _run_raises(ValueError, "window_left", rec, w, p, window_left=-1)
    w.run(p["q"], p["cache"], window_left=50)  # the planned value is fine
    assert len(rec.calls) == 1


def test_run_extra_positional(rec):
    w, p = planned()
    with pytest.raises(TypeError):
        w.run(p["q"], p["cache"], 1.0)
    assert rec.calls == []


# ----------------------------------------------------------------------------- run(): valid launches
def _expected_work(p, window_left=-1, **kw):
    cfg = dispatch.decode_choice(dispatch.decode_problem(dtype=p["dtype"], head_dim=p["d"], page_size=p["ps"],
                                                         group_size=p["hq"] // p["hkv"], arch="sm_90a")).cfg
    kv_lens = kv_lens_from_csr(p["indptr"].long(), p["last"].long(), p["ps"])
    return plan_paged_decode(kv_lens, p["indptr"][:-1].long(), num_kv_heads=p["hkv"], page_size=p["ps"],
                             window_left=window_left, num_sms=dispatch.num_sms(None),
                             ctas_per_sm=occupancy(cfg.smem_bytes, cfg.num_threads), **kw)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_valid_run_reaches_kernel_with_right_arguments(rec, layout):
    p = problem(layout=layout)
    w, _ = planned(p)
    out = w.run(p["q"], p["cache"])
    assert len(rec.calls) == 1
    cfg, a = rec.last
    B, hq, hkv, d, ps = len(p["lens"]), p["hq"], p["hkv"], p["d"], p["ps"]
    assert (cfg.dtype, cfg.head_dim, cfg.page_size, cfg.group_size) == ("bfloat16", d, ps, hq // hkv)
    assert (cfg.pos_encoding_mode, cfg.use_soft_cap, cfg.use_sinks, cfg.arch) == ("NONE", False, False, "sm_90a")
    assert a["q"] is p["q"]
    pool = p["cache"].shape[0]
    for n, idx in (("k", 0), ("v", 1)):
        t = a[n]
        assert t.shape == (pool, ps, hkv, d) and t.stride(-1) == 1
        # the kernel sees an NHD-ordered view of the caller's memory, whatever the layout
        src = p["cache"][:, idx] if layout == "NHD" else p["cache"][:, idx].transpose(1, 2)
        assert t.data_ptr() == src.data_ptr() and t.stride() == src.stride()
    assert torch.equal(a["indices"], p["indices"])
    wp = _expected_work(p)
    assert a["work"].dtype == torch.int32 and a["work"].shape[1] == WORK_COLS
    assert torch.equal(a["work"].cpu(), wp.work)
    assert a["out"] is out and out.shape == (B, hq, d) and out.dtype == BF16 and out.is_contiguous()
    assert a["lse"].shape == (B, hq) and a["lse"].dtype == torch.float32
    n_part = max(1, wp.num_partials)
    assert a["part_o"].shape == (n_part, hq, d) and a["part_o"].dtype == torch.float32
    assert a["part_lse"].shape == (n_part, hq) and a["part_lse"].dtype == torch.float32
    assert a["counters"].dtype == torch.int32 and a["counters"].numel() >= B * hkv
    assert int(a["counters"].abs().sum()) == 0
    assert math.isclose(a["sm_scale"], 1 / math.sqrt(d), rel_tol=1e-12)
    assert a["soft_cap"] == 0.0 and a["rope_rcp_scale"] == 1.0
    assert math.isclose(a["rope_log2_theta"], math.log2(1e4), rel_tol=1e-12)
    assert torch.equal(out, torch.ones_like(out))  # what the recorder wrote


def test_valid_run_scalars(rec):
    p = problem()
    w, _ = planned(p, sm_scale=0.3, logits_soft_cap=25.0, pos_encoding_mode="ROPE_LLAMA", rope_scale=4.0,
                   rope_theta=5e5)
    o, lse = w.run(p["q"], p["cache"], q_scale=0.5, k_scale=3.0, v_scale=2.0, return_lse=True)
    cfg, a = rec.last
    assert cfg.pos_encoding_mode == "ROPE_LLAMA" and cfg.use_soft_cap
    assert math.isclose(a["sm_scale"], 0.3 * 0.5 * 3.0, rel_tol=1e-12)
    assert a["soft_cap"] == 25.0
    assert math.isclose(a["rope_rcp_scale"], 0.25, rel_tol=1e-12)
    assert math.isclose(a["rope_log2_theta"], math.log2(5e5), rel_tol=1e-12)
    assert torch.equal(o, torch.full_like(o, 2.0))  # v_scale multiplies the kernel's output
    assert lse is a["lse"] and torch.equal(lse, torch.full_like(lse, 0.5))


def test_valid_run_alibi_slopes(rec):
    p = problem()
    w, _ = planned(p, pos_encoding_mode="ALIBI")
    w.run(p["q"], p["cache"])
    cfg, a = rec.last
    assert cfg.pos_encoding_mode == "ALIBI" and not cfg.use_soft_cap
    assert a["alibi_slopes"].dtype == torch.float32
    assert torch.allclose(a["alibi_slopes"], alibi_slopes(p["hq"]).float())


def test_valid_run_window_left_in_work_table(rec):
    p = problem()
    w, _ = planned(p, window_left=20)
    w.run(p["q"], p["cache"])
    _, a = rec.last
    assert torch.equal(a["work"], _expected_work(p, window_left=20).work)


@pytest.mark.parametrize("kw", [dict(disable_split_kv=True), dict(fixed_split_size=2)])
def test_valid_run_split_options_in_work_table(rec, kw):
    p = problem(lens=(1000, 33, 700, 2))
    w, _ = planned(p, **kw)
    w.run(p["q"], p["cache"])
    _, a = rec.last
    exp = dict(disable_split_kv=True) if "disable_split_kv" in kw else dict(fixed_split_tokens=2 * p["ps"])
    assert torch.equal(a["work"], _expected_work(p, **exp).work)


def test_valid_run_sinks_selects_sink_kernel(rec):
    p = problem()
    w, _ = planned(p)
    sinks = torch.randn(p["hq"])
    w.run(p["q"], p["cache"])
    w.run(p["q"], p["cache"], sinks=sinks)
    w.run(p["q"], p["cache"], sinks=sinks)
    assert [c.use_sinks for c in rec.cfgs] == [False, True]  # one kernel per variant, cached
    cfg, a = rec.last
    assert cfg.use_sinks and a["sinks"] is sinks
    assert rec.named(0)[1]["sinks"] is not sinks and rec.named(0)[1]["sinks"].numel() == 1  # the dummy


def test_valid_run_given_out_and_lse_and_aliases(rec):
    p = problem()
    w, _ = planned(p)
    out = torch.empty_like(p["q"])
    lse = torch.empty(len(p["lens"]), p["hq"])
    r = w.run_return_lse(p["q"], p["cache"], out=out, lse=lse)
    assert r[0] is out and r[1] is lse
    assert w.forward(p["q"], p["cache"]).shape == out.shape
    assert isinstance(w.forward_return_lse(p["q"], p["cache"]), tuple)
    assert all(c[2].out.shape == out.shape for c in rec.calls)
    w.end_forward()


def test_valid_run_tuple_cache_and_page_size_one(rec):
    p = problem(lens=(3, 9, 1), ps=1)
    w, _ = planned(p)
    k, v = p["cache"][:, 0], p["cache"][:, 1]
    w.run(p["q"], (k, v))
    w.run(p["q"], (k[:, 0], v[:, 0]))  # page_size 1: 3-D [pages, H, D]
    w.run(p["q"], p["cache"][:, :, 0])  # page_size 1: 4-D combined [pages, 2, H, D]
    for i in range(len(rec.calls)):
        a = rec.named(i)[1]
        assert a["k"].shape == (p["cache"].shape[0], 1, p["hkv"], p["d"])


def test_replan_resets_kernel_and_buffers(rec):
    p = problem()
    w, _ = planned(p)
    w.run(p["q"], p["cache"])
    p2 = problem(lens=(5, 6), hq=4, hkv=4, d=128, dtype=FP16)
    w.plan(*plan_args(p2), q_data_type=FP16)
    w.run(p2["q"], p2["cache"])
    assert [(c.head_dim, c.group_size, c.dtype) for c in rec.cfgs] == [(64, 4, "bfloat16"), (128, 1, "float16")]
    with pytest.raises(ValueError, match="q"):
        w.run(p["q"], p["cache"])
    assert len(rec.calls) == 2


def test_reset_workspace_buffer_requires_replan(rec):
    w, p = planned()
    w.reset_workspace_buffer(ws(16 << 20))
    with pytest.raises(RuntimeError, match="plan"):
        w.run(p["q"], p["cache"])
    assert rec.calls == []


# ----------------------------------------------------------------------------- CUDA-graph mode
def test_cuda_graph_replan_keeps_kernel_buffers(rec):
    w, (ip, ix, lp) = _graph_wrapper(4, max_pages=256)
    p = problem()
    w.plan(*plan_args(p), q_data_type=BF16)
    w.run(p["q"], p["cache"])
    p2 = problem(lens=(700, 2, 90, 1000))
    p2["cache"] = torch.randn(256, 2, 16, 2, 64).to(BF16)
    w.plan(*plan_args(p2), q_data_type=BF16)
    w.run(p2["q"], p2["cache"])
    (_, a1), (_, a2) = rec.named(0), rec.named(1)
    for n in ("indices", "work", "part_o", "part_lse", "counters"):
        assert a1[n].data_ptr() == a2[n].data_ptr(), f"{n} moved between plans"
    assert a1["work"].shape == a2["work"].shape
    assert a1["indices"].data_ptr() == ix.data_ptr()
    assert torch.equal(ip, p2["indptr"]) and torch.equal(lp, p2["last"])
    assert torch.equal(ix[: p2["indices"].numel()], p2["indices"])
    # fixed grid: rows past the plan's items are padding (batch_idx -1, empty range)
    wp = _expected_work(p2, num_rows=a2["work"].shape[0])
    assert torch.equal(a2["work"], wp.work)
    pad = a2["work"][wp.num_work:]
    assert (pad[:, 0] == -1).all() and (pad[:, 1] == pad[:, 2]).all()
    n_rows = max_items(4, p2["hkv"], dispatch.num_sms(None) * occupancy(rec.cfgs[-1].smem_bytes, rec.cfgs[-1].num_threads))
    assert a2["work"].shape[0] == n_rows


def test_cuda_graph_replan_keeps_alibi_slopes(rec):
    w, _ = _graph_wrapper(4, max_pages=256)
    p = problem()
    keep = []
    for _ in range(3):
        w.plan(*plan_args(p), q_data_type=BF16, pos_encoding_mode="ALIBI")
        w.run(p["q"], p["cache"])
        keep.append(rec.last[1]["alibi_slopes"].data_ptr())
    assert len(set(keep)) == 1


# ----------------------------------------------------------------------------- single_decode_with_kv_cache
def _single(kv_len=40, hq=8, hkv=2, d=64, dtype=BF16, layout="NHD"):
    q = torch.randn(hq, d).to(dtype)
    shape = (kv_len, hkv, d) if layout == "NHD" else (hkv, kv_len, d)
    return q, torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


def test_single_bad_layout(rec):
    q, k, v = _single()
    with pytest.raises(KeyError, match="kv_layout"):
        ca.single_decode_with_kv_cache(q, k, v, kv_layout="BAD")
    assert rec.calls == []


@pytest.mark.parametrize("case,exc,match", [
    ("q3d", ValueError, "q"),
    ("k2d", ValueError, "k"),
    ("kv_shape", ValueError, "k and v"),
    ("head_dim", ValueError, "head_dim"),
    ("dtype", NotImplementedError, "dtype"),
    ("q_type", TypeError, "q"),
    ("pos", KeyError, "pos_encoding_mode"),
    ("heads", ValueError, "num_qo_heads"),
    ("group", NotImplementedError, "group"),
    ("d48", NotImplementedError, "head_dim"),
    ("cap_alibi", NotImplementedError, "logits_soft_cap"),
])
def test_single_errors(rec, case, exc, match):
    q, k, v = _single()
    kw = {}
    if case == "q3d":
        q = q[None]
    elif case == "k2d":
        k = k[0]
    elif case == "kv_shape":
        v = v[:-1]
    elif case == "head_dim":
        q = torch.randn(8, 128).to(BF16)
    elif case == "dtype":
        k = k.to(FP16)
    elif case == "q_type":
        q = q.tolist()
    elif case == "pos":
        kw["pos_encoding_mode"] = "XPOS"
    elif case == "heads":
        q = torch.randn(9, 64).to(BF16)
    elif case == "group":
        q, k, v = _single(hq=34, hkv=2)
    elif case == "d48":
        q, k, v = _single(d=48)
    elif case == "cap_alibi":
        kw.update(pos_encoding_mode="ALIBI", logits_soft_cap=10.0)
    with pytest.raises(exc, match=match):
        ca.single_decode_with_kv_cache(q, k, v, **kw)
    assert rec.calls == []


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_valid_launch(rec, layout):
    q, k, v = _single(kv_len=37, layout=layout)
    o, lse = ca.single_decode_with_kv_cache(q, k, v, kv_layout=layout, sm_scale=0.2, q_scale=2.0,
                                            logits_soft_cap=7.0, return_lse=True)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (q.shape[0],)
    cfg, a = rec.last
    assert cfg.page_size == 1 and cfg.group_size == 4 and cfg.use_soft_cap
    assert a["q"].shape == (1, 8, 64)
    kn = k if layout == "NHD" else k.transpose(0, 1)
    assert a["k"].shape == (37, 1, 2, 64) and a["k"].data_ptr() == k.data_ptr()
    assert a["k"][:, 0].stride() == kn.stride()
    assert math.isclose(a["sm_scale"], 0.4, rel_tol=1e-12) and a["soft_cap"] == 7.0
    work = a["work"]
    covered = sorted(t for r in work.tolist() if r[0] == 0 for t in range(r[1], r[2]))
    assert covered == list(range(37))
    idx = a["indices"]
    assert idx.numel() >= 37 and torch.equal(idx[:37], torch.arange(37, dtype=torch.int32))
    o2 = ca.single_decode_with_kv_cache(q, k, v, kv_layout=layout)
    assert o2.shape == q.shape
    assert math.isclose(rec.last[1]["sm_scale"], 1 / 8, rel_tol=1e-12)


def test_single_empty_kv(rec):
    q, k, v = _single(kv_len=0)
    o = ca.single_decode_with_kv_cache(q, k, v)
    assert o.shape == q.shape
    _, a = rec.last
    assert a["work"].tolist()[0][:3] == [0, 0, 0]


def test_no_warning_on_keyword_plan(rec):
    p = problem()
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        w.plan(*plan_args(p), q_data_type=BF16, pos_encoding_mode="NONE")
    assert api_decode.BatchDecodeWithPagedKVCacheWrapper.begin_forward is api_decode.BatchDecodeWithPagedKVCacheWrapper.plan


def test_cuda_graph_replan_keeps_lse_scratch(rec):
    w, _ = _graph_wrapper(4, max_pages=256)
    p = problem()
    keep = []
    for _ in range(3):
        w.plan(*plan_args(p), q_data_type=BF16)
        w.run(p["q"], p["cache"])
        keep.append(rec.last[1]["lse"].data_ptr())
    assert len(set(keep)) == 1


# ----------------------------------------------------------------------------- lifetime of caller tensors
def _cache_freed_after_run(rec, make_arg):
    import gc
    import weakref

    w, p = planned()
    cache = p.pop("cache")
    ref = weakref.ref(cache)
    w.run(p["q"], make_arg(cache))
    rec.calls.clear()
    del cache
    gc.collect()
    return ref() is None


def test_run_does_not_keep_tuple_cache_alive(rec):
    assert _cache_freed_after_run(rec, lambda c: (c[:, 0], c[:, 1]))


def test_run_does_not_keep_combined_cache_alive(rec):
    assert _cache_freed_after_run(rec, lambda c: c)


def test_cuda_graph_multirow_replan_and_frozen_signature():
    # re-planning a CUDA-graph wrapper every step is the point of graph mode; q_len_per_req,
    # page_size, dtype and the table form are frozen by the first plan (the captured kernel)
    ip, ix, lp = graph_buffers(2, 8)
    g = ca.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws(), ip, ix, lp, use_tensor_cores=True)
    indptr = torch.tensor([0, 2, 4], dtype=torch.int32)
    idx = torch.arange(4, dtype=torch.int32)
    lpl = torch.tensor([5, 16], dtype=torch.int32)
    for _ in range(2):
        g.plan(indptr, idx, lpl, 32, 8, 128, 16, q_len_per_req=2, q_data_type=BF16)
    with pytest.raises(ValueError, match="cannot change between plans"):
        g.plan(indptr, idx, lpl, 32, 8, 128, 16, q_len_per_req=1, q_data_type=BF16)
    with pytest.raises(ValueError, match="cannot change between plans"):
        g.plan(indptr, idx, lpl, 32, 8, 128, 16, q_len_per_req=2, q_data_type=torch.float16)
    bt, sl = ref.csr_to_block_tables(indptr, idx, lpl, 16)
    with pytest.raises(ValueError, match="cannot change between plans"):
        g.plan(None, None, None, 32, 8, 128, 16, q_len_per_req=2, q_data_type=BF16,
               block_tables=bt.to(torch.int32), seq_lens=sl.to(torch.int32))


# ----------------------------------------------------------------------------- the launch contract
def test_plan_indptr_must_start_at_zero(rec):
    """FlashInfer requires CSR offsets from 0: a shifted indptr is a ValueError naming it, before any launch."""
    p = problem()
    p["indptr"] = p["indptr"] + 1
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD")
    with pytest.raises(ValueError, match=r"indptr\[0\] must be 0"):
        w.plan(*plan_args(p), q_data_type=BF16)
    assert rec.calls == [] and w._plan is None


def test_output_scale_is_a_kernel_argument(monkeypatch):
    """v_scale reaches the kernel as ``output_scale`` (its fp32 epilogue); the API does not scale the 16-bit
    output afterwards."""
    rec = Recorder().install(monkeypatch)
    monkeypatch.setattr(dispatch.KERNEL_MODULES["paged_decode"], "launch",
                        lambda fn, cfg, args: (rec.calls.append((None, cfg, args)), args.out.fill_(1.0)))
    w, p = planned()
    out = w.run(p["q"], p["cache"], v_scale=2.5)
    assert rec.last[1]["output_scale"] == 2.5 and torch.equal(out, torch.ones_like(out))


def test_decode_graph_signature(rec):
    """CUDA-graph mode: the signature holds the plan's shape scalars and the kernel choice's graph key."""
    w, _ = _graph_wrapper(4, max_pages=256)
    p = problem()
    w.plan(*plan_args(p), q_data_type=BF16)
    sig = w._graph_sig
    assert sig["kernel"] == w._plan["choice"].graph_key and sig["page_table"] == "csr"
    w.plan(*plan_args(problem(lens=(3, 90, 16, 1))), q_data_type=BF16)  # lengths may change
    with pytest.raises(ValueError, match="cannot change between plans"):
        w.plan(*plan_args(p), q_data_type=BF16, pos_encoding_mode="ROPE_LLAMA")


def test_decode_min_waves_moves_to_dispatch(rec, monkeypatch):
    """CUTEDSL_ATTN_DECODE_MIN_WAVES is read by dispatch.decode_schedule (a number, else ValueError naming it)."""
    monkeypatch.setenv("CUTEDSL_ATTN_DECODE_MIN_WAVES", "lots")
    with pytest.raises(ValueError, match="CUTEDSL_ATTN_DECODE_MIN_WAVES"):
        planned()
    assert not hasattr(api_decode, "os")


def test_single_decode_keeps_no_wrapper(rec):
    """single_decode_with_kv_cache makes, plans and drops a wrapper per call (no device state outlives a call)."""
    import gc
    import weakref

    q, k, v = torch.randn(8, 64).to(BF16), torch.randn(40, 2, 64).to(BF16), torch.randn(40, 2, 64).to(BF16)
    made = []
    cls = ca.BatchDecodeWithPagedKVCacheWrapper
    real_init = cls.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        made.append(weakref.ref(self))

    cls.__init__ = init
    try:
        ca.single_decode_with_kv_cache(q, k, v)
        ca.single_decode_with_kv_cache(q, k, v)
    finally:
        cls.__init__ = real_init
    gc.collect()
    assert len(made) == 2 and all(r() is None for r in made)
