"""The softmax-attention entry points refuse tensors that are not on one CUDA device up front: a ValueError naming
the entry point's own arguments, before any planning or compiling (``api._common.check_devices``).  Host tensors
pass only when cross-compiling on a machine without a GPU (``CUTEDSL_ATTN_ARCH`` set), where plans are built on
them and the launch refuses them with one message (``api._common.host_launch_error``)."""

import pytest
import torch

import cutedsl_attn as ca
from cutedsl_attn import dispatch
from cutedsl_attn.api import _common
from cutedsl_attn.attention import prims_ts

from _api_inputs import (  # pytest puts tests/ on sys.path
    BF16, EntryRefusesDevice, context_args, prims_ts_args, single_decode_args, single_prefill_args, trtllm_args,
    trtllm_mla_args, xqa_args, xqa_mla_args,
)


@pytest.fixture
def gpu_host(monkeypatch):
    """A GPU machine (torch.cuda.is_available() True) with the target set: host tensors are refused up front."""
    monkeypatch.setenv("CUTEDSL_ATTN_ARCH", "sm_90a")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


# (entry point, its arguments, the argument names the message must list)
ENTRY_POINTS = {
    "single_decode_with_kv_cache": (ca.single_decode_with_kv_cache, single_decode_args, ("q", "k", "v")),
    "single_prefill_with_kv_cache": (ca.single_prefill_with_kv_cache, single_prefill_args, ("q", "k", "v")),
    "trtllm_batch_decode_with_kv_cache": (ca.trtllm_batch_decode_with_kv_cache, trtllm_args,
                                          ("query", "kv_cache", "workspace_buffer", "block_tables")),
    "trtllm_batch_context_with_kv_cache": (ca.trtllm_batch_context_with_kv_cache, context_args,
                                           ("query", "kv_cache", "workspace_buffer", "block_tables")),
    "xqa": (ca.xqa, xqa_args, ("q", "k_cache", "v_cache", "page_table", "output", "workspace_buffer")),
    "batch_decode_with_paged_kv_cache": (prims_ts.batch_decode_with_paged_kv_cache, prims_ts_args,
                                         ("q", "paged_kv_cache", "block_tables", "seq_lens_kv")),
    "trtllm_batch_decode_with_kv_cache_mla": (ca.trtllm_batch_decode_with_kv_cache_mla, trtllm_mla_args,
                                              ("query", "kv_cache", "workspace_buffer", "block_tables")),
    "xqa_mla": (ca.xqa_mla, xqa_mla_args, ("q", "k_cache", "v_cache", "page_table", "output", "workspace_buffer",
                                             "semaphores")),
}


def _assert_refused(where, fn, args, names):
    with pytest.raises(ValueError, match="must be CUDA tensors") as ei:
        fn(**args)
    msg = str(ei.value)
    assert msg.startswith(f"{where}: "), msg
    listed = msg.split(": ", 1)[1].split(" must be", 1)[0].split(", ")
    assert set(names) <= set(listed), (names, msg)
    assert "CUTEDSL_ATTN_ARCH" not in msg  # the input is the problem, not the missing target


@pytest.mark.parametrize("where", sorted(ENTRY_POINTS))
def test_host_tensors_refused_without_a_target(no_target, no_compile, where):
    fn, make, names = ENTRY_POINTS[where]
    _assert_refused(where, fn, make(), names)


@pytest.mark.parametrize("where", sorted(ENTRY_POINTS))
def test_host_tensors_refused_on_a_gpu_machine_before_compiling(gpu_host, no_compile, where):
    fn, make, names = ENTRY_POINTS[where]
    _assert_refused(where, fn, make(), names)


def test_two_devices_named():
    q, k = torch.zeros(2), torch.zeros(2, device="meta")
    with pytest.raises(ValueError, match=r"^f: k is on meta but q is on cpu: every tensor must be on one CUDA"):
        _common.check_devices("f", [("q", q), ("out", None), ("k", k)])
    with pytest.raises(ValueError, match=r"^w: q is on meta but the others are on cpu"):
        _common.check_devices("w", [("q", k)], device=torch.device("cpu"))


@pytest.mark.parametrize("where,arg", [("single_decode_with_kv_cache", "v"), ("trtllm_batch_decode_with_kv_cache",
                                                                             "workspace_buffer"),
                                       ("xqa", "output"), ("batch_decode_with_paged_kv_cache", "block_tables")])
def test_entry_points_name_the_argument_on_another_device(no_compile, where, arg):
    fn, make, _ = ENTRY_POINTS[where]
    args = make()
    args[arg] = torch.empty(args[arg].shape, dtype=args[arg].dtype, device="meta")
    first = "query" if "query" in args else "q"
    with pytest.raises(ValueError, match=rf"^{where}: {arg} is on meta but {first} is on cpu"):
        fn(**args)


def test_host_tensors_still_plan_when_cross_compiling(monkeypatch, rec):
    """The CPU API tests' mode: CUTEDSL_ATTN_ARCH set, no GPU; the (stubbed) launch receives the host tensors."""
    monkeypatch.setenv("CUTEDSL_ATTN_ARCH", "sm_90a")
    ca.single_decode_with_kv_cache(**single_decode_args())
    assert len(rec.calls) == 1


# ----------------------------------------------------------------------------- the decode wrapper's run()
def _planned_wrapper():
    w = ca.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8 << 20, dtype=torch.uint8), "NHD")
    indptr = torch.tensor([0, 2, 5], dtype=torch.int32)
    w.plan(indptr, torch.arange(5, dtype=torch.int32), torch.tensor([4, 16], dtype=torch.int32), 8, 2, 64, 16,
           q_data_type=BF16)
    return w, torch.randn(2, 8, 64).to(BF16), torch.randn(6, 2, 16, 2, 64).to(BF16)


def test_wrapper_run_refuses_a_host_workspace(monkeypatch, rec):
    monkeypatch.setenv("CUTEDSL_ATTN_ARCH", "sm_90a")
    w, q, cache = _planned_wrapper()  # plan() takes host index tensors and, cross-compiling, a host workspace
    monkeypatch.delenv("CUTEDSL_ATTN_ARCH")
    with pytest.raises(ValueError, match=r"^BatchDecodeWithPagedKVCacheWrapper.run: float_workspace_buffer, q, "
                                         r"paged_kv_cache must be CUDA tensors"):
        w.run(q, cache)
    assert rec.calls == []


def test_wrapper_plan_refuses_a_host_workspace_before_compiling(gpu_host, no_compile):
    w = ca.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8 << 20, dtype=torch.uint8), "NHD")
    with pytest.raises(ValueError, match=r"^BatchDecodeWithPagedKVCacheWrapper.plan: float_workspace_buffer must be "
                                         r"a CUDA tensor, got cpu"):
        w.plan(torch.tensor([0, 2], dtype=torch.int32), torch.arange(2, dtype=torch.int32),
               torch.tensor([4], dtype=torch.int32), 8, 2, 64, 16, q_data_type=BF16)


def test_wrapper_launch_of_host_tensors_says_so(monkeypatch, cross_compile_sm90):
    monkeypatch.setattr(dispatch, "get_compiled", lambda name, cfg, build: EntryRefusesDevice())
    monkeypatch.setattr(dispatch, "_CHOICES", {})
    w, q, cache = _planned_wrapper()
    with pytest.raises(ValueError, match=r"^BatchDecodeWithPagedKVCacheWrapper.run: the inputs must be CUDA "
                                         r"tensors to launch, got cpu"):
        w.run(q, cache)
