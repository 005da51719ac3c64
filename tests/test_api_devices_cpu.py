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

BF16 = torch.bfloat16


@pytest.fixture
def no_target(monkeypatch):
    """No GPU and no CUTEDSL_ATTN_ARCH: the state in which planning used to fail on the missing device."""
    monkeypatch.delenv("CUTEDSL_ATTN_ARCH", raising=False)


@pytest.fixture
def gpu_host(monkeypatch):
    """A GPU machine (torch.cuda.is_available() True) with the target set: host tensors are refused up front."""
    monkeypatch.setenv("CUTEDSL_ATTN_ARCH", "sm_90a")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


@pytest.fixture
def no_compile(monkeypatch):
    """Any compile is a test failure (the check comes before planning)."""
    def refuse(name, cfg, build):
        raise AssertionError(f"compiled {name} before the device check")

    monkeypatch.setattr(dispatch, "get_compiled", refuse)


def _single_decode_args():
    return dict(q=torch.randn(8, 64).to(BF16), k=torch.randn(40, 2, 64).to(BF16), v=torch.randn(40, 2, 64).to(BF16))


def _single_prefill_args():
    return dict(q=torch.randn(5, 8, 64).to(BF16), k=torch.randn(40, 2, 64).to(BF16), v=torch.randn(40, 2, 64).to(BF16))


def _trtllm_args(B=2, ps=16, hkv=2, d=64, pages=6):
    return dict(query=torch.randn(B, 8, d).to(BF16), kv_cache=torch.randn(pages, 2, hkv, ps, d).to(BF16),
                workspace_buffer=torch.zeros(8 << 20, dtype=torch.uint8),
                block_tables=torch.arange(B * 3, dtype=torch.int32).view(B, 3),
                seq_lens=torch.tensor([20, 33], dtype=torch.int32), max_seq_len=48, bmm1_scale=0.125)


def _context_args():
    a = _trtllm_args()
    a.pop("max_seq_len")
    a.update(query=torch.randn(7, 8, 64).to(BF16), max_q_len=4, max_kv_len=33, bmm2_scale=1.0, batch_size=2,
             cum_seq_lens_q=torch.tensor([0, 3, 7], dtype=torch.int32),
             cum_seq_lens_kv=torch.tensor([0, 20, 53], dtype=torch.int32))
    return a


def _xqa_args(B=2, ps=16, hkv=2, d=64, pages=6):
    return dict(q=torch.randn(B, 1, 8, d).to(BF16), k_cache=torch.randn(pages, ps, hkv, d).to(BF16),
                v_cache=torch.randn(pages, ps, hkv, d).to(BF16),
                page_table=torch.arange(B * 3, dtype=torch.int32).view(B, 3),
                seq_lens=torch.tensor([[20], [33]], dtype=torch.int32), output=torch.empty(B, 1, 8, d, dtype=BF16),
                workspace_buffer=torch.zeros(8 << 20, dtype=torch.uint8), semaphores=torch.zeros(8, dtype=torch.int32),
                num_kv_heads=hkv, page_size=ps)


def _prims_ts_args(B=2, ps=16, hkv=2, d=64, pages=6):
    return dict(q=torch.randn(B, 8, d).to(BF16), paged_kv_cache=torch.randn(pages, 2, hkv, ps, d).to(BF16),
                block_tables=torch.arange(B * 3, dtype=torch.int32).view(B, 3),
                seq_lens_kv=torch.tensor([20, 33], dtype=torch.int32))


def _trtllm_mla_args(B=2, ps=32, pages=4):
    return dict(query=torch.randn(B, 1, 16, 576).to(BF16), kv_cache=torch.randn(pages, ps, 576).to(BF16),
                workspace_buffer=torch.zeros(8 << 20, dtype=torch.uint8), qk_nope_head_dim=128, kv_lora_rank=512,
                qk_rope_head_dim=64, block_tables=torch.arange(B * 2, dtype=torch.int32).view(B, 2),
                seq_lens=torch.tensor([20, 33], dtype=torch.int32), max_seq_len=64)


def _xqa_mla_args(B=2, ps=32, pages=4):
    e4m3 = torch.float8_e4m3fn
    k_cache = torch.randn(pages, ps, 576).to(e4m3)
    return dict(q=torch.randn(B, 1, 128, 576).to(e4m3), k_cache=k_cache, v_cache=k_cache[..., :512],
                page_table=torch.arange(B * 2, dtype=torch.int32).view(B, 2),
                seq_lens=torch.tensor([[20], [33]], dtype=torch.int32),
                output=torch.empty(B, 1, 128, 512, dtype=BF16), workspace_buffer=torch.zeros(8 << 20, dtype=torch.uint8),
                semaphores=torch.zeros(8, dtype=torch.int32), page_size=ps)


# (entry point, its arguments, the argument names the message must list)
ENTRY_POINTS = {
    "single_decode_with_kv_cache": (ca.single_decode_with_kv_cache, _single_decode_args, ("q", "k", "v")),
    "single_prefill_with_kv_cache": (ca.single_prefill_with_kv_cache, _single_prefill_args, ("q", "k", "v")),
    "trtllm_batch_decode_with_kv_cache": (ca.trtllm_batch_decode_with_kv_cache, _trtllm_args,
                                          ("query", "kv_cache", "workspace_buffer", "block_tables")),
    "trtllm_batch_context_with_kv_cache": (ca.trtllm_batch_context_with_kv_cache, _context_args,
                                           ("query", "kv_cache", "workspace_buffer", "block_tables")),
    "xqa": (ca.xqa, _xqa_args, ("q", "k_cache", "v_cache", "page_table", "output", "workspace_buffer")),
    "batch_decode_with_paged_kv_cache": (prims_ts.batch_decode_with_paged_kv_cache, _prims_ts_args,
                                         ("q", "paged_kv_cache", "block_tables", "seq_lens_kv")),
    "trtllm_batch_decode_with_kv_cache_mla": (ca.trtllm_batch_decode_with_kv_cache_mla, _trtllm_mla_args,
                                              ("query", "kv_cache", "workspace_buffer", "block_tables")),
    "xqa_mla": (ca.xqa_mla, _xqa_mla_args, ("q", "k_cache", "v_cache", "page_table", "output", "workspace_buffer",
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
    ca.single_decode_with_kv_cache(**_single_decode_args())
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


class _EntryRefusesDevice:
    """A compiled kernel whose tvm-ffi entry refuses the host q (the disk-cache load's message)."""

    def __call__(self, *a):
        raise ValueError("Mismatched Tensor on argument #0 when calling: `__call__(mQ: Tensor, mK: Tensor)`, "
                         "expected device_type=cuda")


def test_wrapper_launch_of_host_tensors_says_so(monkeypatch, cross_compile_sm90):
    monkeypatch.setattr(dispatch, "get_compiled", lambda name, cfg, build: _EntryRefusesDevice())
    monkeypatch.setattr(dispatch, "_CHOICES", {})
    w, q, cache = _planned_wrapper()
    with pytest.raises(ValueError, match=r"^BatchDecodeWithPagedKVCacheWrapper.run: the inputs must be CUDA "
                                         r"tensors to launch, got cpu"):
        w.run(q, cache)
