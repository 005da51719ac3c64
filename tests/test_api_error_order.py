"""Which error comes first: a wrong shape or dtype is reported as such (the argument and its rule) whatever the
device, and only inputs that pass every shape and dtype check are refused for being off CUDA, in the entry point's
own argument names (``api._common.check_one_device`` up front, ``check_devices`` before planning).  Host tensors
and no ``CUTEDSL_ATTN_ARCH`` (the state of a new user's first call on a machine without a GPU, or with host tensors
on a GPU machine); cross-compiling (``CUTEDSL_ATTN_ARCH`` set, no GPU), the launch's refusal names the entry point
that was called, not the wrapper it plans through."""

import pytest
import torch

import cutedsl_attn as ca
from cutedsl_attn import dispatch
from cutedsl_attn.api import _common

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn


@pytest.fixture
def no_target(monkeypatch):
    """No CUTEDSL_ATTN_ARCH: host tensors are refused (on this machine and on a GPU one alike)."""
    monkeypatch.delenv("CUTEDSL_ATTN_ARCH", raising=False)


@pytest.fixture
def no_compile(monkeypatch):
    """Any compile is a test failure (every check comes before planning)."""
    def refuse(name, cfg, build):
        raise AssertionError(f"compiled {name} before the checks")

    monkeypatch.setattr(dispatch, "get_compiled", refuse)


class _EntryRefusesDevice:
    """A compiled kernel whose tvm-ffi entry refuses the host q (the disk-cache load's message)."""

    def __call__(self, *a):
        raise ValueError("Mismatched Tensor on argument #0 when calling: `__call__(mQ: Tensor, mK: Tensor)`, "
                         "expected device_type=cuda")


@pytest.fixture
def host_launch(monkeypatch):
    """Cross-compiling without a GPU: host tensors pass the checks; the (fake) kernel entry refuses them."""
    monkeypatch.setenv("CUTEDSL_ATTN_ARCH", "sm_90a")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dispatch, "get_compiled", lambda name, cfg, build: _EntryRefusesDevice())
    monkeypatch.setattr(dispatch, "_CHOICES", {})


def _device_error(where, names):
    """The regex of the up-front device refusal: the entry point, then its own argument names."""
    rule = "must be a CUDA tensor" if len(names) == 1 else "must be CUDA tensors"
    return rf"^{where}: {', '.join(names)} {rule}, got cpu$"


def _launch_error(where):
    return rf"^{where}: the inputs must be CUDA tensors to launch, got cpu"


# ----------------------------------------------------------------------------- _common
def test_check_tensor_reports_the_shape_before_the_device():
    t = torch.zeros(3, 4)
    with pytest.raises(ValueError, match=r"^x must have shape \(3, 5\), got \(3, 4\)$"):
        _common.check_tensor("x", t, shape=(3, 5), device=torch.device("meta"))
    with pytest.raises(ValueError, match=r"^The dtype of x \(torch.float32\) does not match the expected "):
        _common.check_tensor("x", t, dtype=BF16, device=torch.device("meta"))
    with pytest.raises(ValueError, match=r"^x is on cpu, expected meta$"):
        _common.check_tensor("x", t, shape=(3, 4), device=torch.device("meta"))


def test_check_one_device_names_a_mixed_pair_and_passes_host_tensors(no_target):
    q, k = torch.zeros(2), torch.zeros(2, device="meta")
    with pytest.raises(ValueError, match=r"^f: k is on meta but q is on cpu: every tensor must be on one CUDA"):
        _common.check_one_device("f", [("q", q), ("k", k)])
    named, dev = _common.check_one_device("f", [("q", q), ("out", None), ("n", 3)])
    assert [n for n, _ in named] == ["q"] and dev == torch.device("cpu")
    with pytest.raises(ValueError, match=_device_error("f", ["q"])):
        _common.check_devices("f", [("q", q), ("out", None)])


# ----------------------------------------------------------------------------- xqa_mla
XQA_MLA_NAMES = ["q", "k_cache", "v_cache", "page_table", "output", "workspace_buffer", "semaphores"]


def _xqa_mla_args(B=2, ps=32, pages=4):
    k_cache = torch.randn(pages, ps, 576).to(E4M3)
    return dict(q=torch.randn(B, 1, 128, 576).to(E4M3), k_cache=k_cache, v_cache=k_cache[..., :512],
                page_table=torch.arange(B * 2, dtype=torch.int32).view(B, 2),
                seq_lens=torch.tensor([[20], [33]], dtype=torch.int32),
                output=torch.empty(B, 1, 128, 512, dtype=BF16), workspace_buffer=torch.zeros(8 << 20, dtype=torch.uint8),
                semaphores=torch.zeros(8, dtype=torch.int32), page_size=ps)


@pytest.mark.parametrize("change,exc,match", [
    (dict(q=torch.randn(2, 1, 128, 576).to(BF16)), ValueError, r"^q must be torch.float8_e4m3fn "),
    (dict(q=torch.randn(2, 1, 64, 576).to(E4M3)), ValueError, r"^xqa_mla needs exactly 128 query heads, got 64$"),
    (dict(q=torch.randn(2, 1, 128, 512).to(E4M3)), ValueError, r"^q's last dim must be 576 \(512 \+ 64\)"),
    (dict(output=torch.empty(2, 1, 128, 256, dtype=BF16)), ValueError,
     r"^output must have shape \(2, 1, 128, 512\), got \(2, 1, 128, 256\)$"),
    (dict(output=torch.empty(2, 1, 128, 512)), ValueError, r"^The dtype of output \(torch.float32\) does not match"),
    (dict(v_cache=torch.randn(4, 32, 512).to(E4M3)), NotImplementedError,
     r"^a v_cache with storage of its own is not supported"),
])
def test_xqa_mla_reports_shapes_and_dtypes_before_the_device(no_target, no_compile, change, exc, match):
    args = _xqa_mla_args()
    args.update(change)
    with pytest.raises(exc, match=match):
        ca.xqa_mla(**args)


def test_xqa_mla_device_error_names_its_own_arguments(no_target, no_compile):
    with pytest.raises(ValueError, match=_device_error("xqa_mla", XQA_MLA_NAMES)):
        ca.xqa_mla(**_xqa_mla_args())


def test_xqa_mla_host_launch_names_xqa_mla(host_launch):
    with pytest.raises(ValueError, match=_launch_error("xqa_mla")) as ei:
        ca.xqa_mla(**_xqa_mla_args())
    assert "query" not in str(ei.value) and "kv_cache and" not in str(ei.value)  # not trtllm MLA's names


# ----------------------------------------------------------------------------- single_decode_with_kv_cache
def _single_decode_args():
    return dict(q=torch.randn(8, 64).to(BF16), k=torch.randn(40, 2, 64).to(BF16), v=torch.randn(40, 2, 64).to(BF16))


@pytest.mark.parametrize("change,exc,match", [
    (dict(q=torch.randn(8, 64)), NotImplementedError, r"^q dtype torch.float32 is not supported"),
    (dict(q=torch.randn(8, 32).to(BF16)), ValueError, r"^q head_dim 32 != k head_dim 64$"),
    (dict(q=torch.randn(1, 8, 64).to(BF16)), ValueError, r"^q must be 2-D, got shape \(1, 8, 64\)$"),
    (dict(k=torch.randn(40, 3, 64).to(BF16), v=torch.randn(40, 3, 64).to(BF16)), ValueError,
     r"^num_qo_heads \(8\) must be a multiple of num_kv_heads \(3\)$"),
    (dict(v=torch.randn(41, 2, 64).to(BF16)), ValueError, r"^k and v must have the same shape"),
    (dict(k=torch.randn(40, 2, 64).to(torch.float8_e5m2), v=torch.randn(40, 2, 64).to(torch.float8_e5m2)),
     NotImplementedError, r"^a torch.float8_e5m2 KV with a torch.bfloat16 q is not supported"),
])
def test_single_decode_reports_shapes_and_dtypes_before_the_device(no_target, no_compile, change, exc, match):
    args = _single_decode_args()
    args.update(change)
    with pytest.raises(exc, match=match):
        ca.single_decode_with_kv_cache(**args)


def test_single_decode_device_error_names_its_own_arguments(no_target, no_compile):
    with pytest.raises(ValueError, match=_device_error("single_decode_with_kv_cache", ["q", "k", "v"])):
        ca.single_decode_with_kv_cache(**_single_decode_args())


def test_single_decode_host_launch_names_single_decode(host_launch):
    with pytest.raises(ValueError, match=_launch_error("single_decode_with_kv_cache")):
        ca.single_decode_with_kv_cache(**_single_decode_args())


# ----------------------------------------------------------------------------- BatchDecodeWithPagedKVCacheWrapper
def _decode_plan(w, num_kv_heads=2, head_dim=64, q_data_type=BF16, **kw):
    w.plan(torch.tensor([0, 2, 5], dtype=torch.int32), torch.arange(5, dtype=torch.int32),
           torch.tensor([4, 16], dtype=torch.int32), 8, num_kv_heads, head_dim, 16, q_data_type=q_data_type, **kw)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(num_kv_heads=3), ValueError, r"^num_qo_heads \(8\) must be a multiple of num_kv_heads \(3\)$"),
    (dict(q_data_type=torch.float32), NotImplementedError, r"^q_data_type=torch.float32 is not supported"),
    (dict(head_dim=72), NotImplementedError, r"head_dim"),
])
def test_decode_wrapper_plan_reports_arguments_before_the_workspace_device(no_target, no_compile, kw, exc, match):
    w = ca.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8 << 20, dtype=torch.uint8), "NHD")
    with pytest.raises(exc, match=match):
        _decode_plan(w, **kw)


def test_decode_wrapper_plan_device_error_names_the_workspace(no_target, no_compile):
    w = ca.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8 << 20, dtype=torch.uint8), "NHD")
    with pytest.raises(ValueError, match=_device_error("BatchDecodeWithPagedKVCacheWrapper.plan",
                                                       ["float_workspace_buffer"])):
        _decode_plan(w)


def _host_planned_decode_wrapper(monkeypatch):
    """A wrapper planned on a host workspace while cross-compiling, then run without the target."""
    monkeypatch.setenv("CUTEDSL_ATTN_ARCH", "sm_90a")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    w = ca.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(8 << 20, dtype=torch.uint8), "NHD")
    _decode_plan(w)
    monkeypatch.delenv("CUTEDSL_ATTN_ARCH")
    return w, torch.randn(6, 2, 16, 2, 64).to(BF16)


@pytest.mark.parametrize("q,match", [
    (torch.randn(2, 8, 32).to(BF16), r"^q must have shape \(2, 8, 64\), got \(2, 8, 32\)$"),
    (torch.randn(2, 8, 64).half(), r"^The dtype of q \(torch.float16\) does not match the q_data_type"),
])
def test_decode_wrapper_run_reports_q_before_the_device(monkeypatch, rec, q, match):
    w, cache = _host_planned_decode_wrapper(monkeypatch)
    with pytest.raises(ValueError, match=match):
        w.run(q, cache)
    assert rec.calls == []


def test_decode_wrapper_run_device_error_names_the_callers_tensors(monkeypatch, rec):
    w, cache = _host_planned_decode_wrapper(monkeypatch)
    with pytest.raises(ValueError, match=_device_error("BatchDecodeWithPagedKVCacheWrapper.run",
                                                       ["float_workspace_buffer", "q", "paged_kv_cache"])):
        w.run(torch.randn(2, 8, 64).to(BF16), cache)
    assert rec.calls == []


# ----------------------------------------------------------------------------- prefill
def _single_prefill_args():
    return dict(q=torch.randn(5, 8, 64).to(BF16), k=torch.randn(40, 2, 64).to(BF16), v=torch.randn(40, 2, 64).to(BF16))


@pytest.mark.parametrize("change,exc,match", [
    (dict(q=torch.randn(5, 8, 32).to(BF16)), ValueError, r"^q head_dim 32 != k head_dim 64$"),
    (dict(q=torch.randn(5, 8, 64)), NotImplementedError, r"^q/k/v dtypes must match \(got torch.float32, "),
    (dict(v=torch.randn(39, 2, 64).to(BF16)), ValueError, r"^k and v must agree on \[kv_len, num_kv_heads\]"),
    (dict(custom_mask=torch.ones(5, 39, dtype=torch.bool)), ValueError,
     r"^custom_mask must have shape \[qo_len, kv_len\] = \(5, 40\), got \(5, 39\)$"),
])
def test_single_prefill_reports_shapes_and_dtypes_before_the_device(no_target, no_compile, change, exc, match):
    args = _single_prefill_args()
    args.update(change)
    with pytest.raises(exc, match=match):
        ca.single_prefill_with_kv_cache(**args)


def test_single_prefill_device_error_names_its_own_arguments(no_target, no_compile):
    with pytest.raises(ValueError, match=_device_error("single_prefill_with_kv_cache", ["q", "k", "v"])):
        ca.single_prefill_with_kv_cache(**_single_prefill_args())


def test_single_prefill_host_launch_names_single_prefill(host_launch):
    with pytest.raises(ValueError, match=_launch_error("single_prefill_with_kv_cache")):
        ca.single_prefill_with_kv_cache(**_single_prefill_args())


def test_prefill_wrapper_plan_reports_head_dim_before_the_workspace_device(no_target, no_compile):
    w = ca.BatchPrefillWithRaggedKVCacheWrapper(torch.zeros(8 << 20, dtype=torch.uint8), "NHD")
    indptr = (torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 5, 9], dtype=torch.int32))
    with pytest.raises(NotImplementedError, match=r"^head_dim_qk=63 is not supported"):
        w.plan(*indptr, 8, 2, 63, q_data_type=BF16)
    with pytest.raises(ValueError, match=_device_error("BatchPrefillWithRaggedKVCacheWrapper.plan",
                                                       ["float_workspace_buffer"])):
        w.plan(*indptr, 8, 2, 64, q_data_type=BF16)


# ----------------------------------------------------------------------------- MLA
TRTLLM_MLA_NAMES = ["query", "kv_cache", "workspace_buffer", "block_tables"]


def _trtllm_mla_args(B=2, ps=32, pages=4):
    return dict(query=torch.randn(B, 1, 16, 576).to(BF16), kv_cache=torch.randn(pages, ps, 576).to(BF16),
                workspace_buffer=torch.zeros(8 << 20, dtype=torch.uint8), qk_nope_head_dim=128, kv_lora_rank=512,
                qk_rope_head_dim=64, block_tables=torch.arange(B * 2, dtype=torch.int32).view(B, 2),
                seq_lens=torch.tensor([20, 33], dtype=torch.int32), max_seq_len=64)


@pytest.mark.parametrize("change,exc,match", [
    (dict(query=torch.randn(2, 1, 16, 512).to(BF16)), ValueError,
     r"^query's last dim must be kv_lora_rank \+ qk_rope_head_dim = 576, got 512$"),
    (dict(query=torch.randn(2, 1, 16, 576)), NotImplementedError, r"^query dtype torch.float32 is not supported"),
    (dict(kv_cache=torch.randn(4, 32, 512).to(BF16)), ValueError, r"^kv_cache must be \[num_pages, page_size, 576\]"),
    (dict(out=torch.empty(2, 1, 16, 256, dtype=BF16)), ValueError,
     r"^out must have shape \(2, 1, 16, 512\), got \(2, 1, 16, 256\)$"),
    (dict(seq_lens=torch.tensor([20, 60], dtype=torch.int32), max_seq_len=40), ValueError,
     r"^seq_lens\[1\] = 60 exceeds max_seq_len = 40$"),
])
def test_trtllm_mla_reports_shapes_and_dtypes_before_the_device(no_target, no_compile, change, exc, match):
    args = _trtllm_mla_args()
    args.update(change)
    with pytest.raises(exc, match=match):
        ca.trtllm_batch_decode_with_kv_cache_mla(**args)


def test_trtllm_mla_device_error_names_its_own_arguments(no_target, no_compile):
    with pytest.raises(ValueError, match=_device_error("trtllm_batch_decode_with_kv_cache_mla", TRTLLM_MLA_NAMES)):
        ca.trtllm_batch_decode_with_kv_cache_mla(**_trtllm_mla_args())


def test_trtllm_mla_host_launch_names_trtllm_mla(host_launch):
    with pytest.raises(ValueError, match=_launch_error("trtllm_batch_decode_with_kv_cache_mla")):
        ca.trtllm_batch_decode_with_kv_cache_mla(**_trtllm_mla_args())


def _mla_plan(w, head_dim_ckv=512, dtype=BF16):
    w.plan(torch.arange(3, dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32),
           torch.arange(2, dtype=torch.int32), torch.tensor([20, 30], dtype=torch.int32), 16, head_dim_ckv, 64, 32,
           False, 0.1, dtype, dtype)


@pytest.mark.parametrize("kw,match", [
    (dict(head_dim_ckv=256), r"^head_dim_ckv=256, head_dim_kpe=64 is not supported"),
    (dict(dtype=torch.float32), r"^q_data_type=torch.float32 is not supported"),
])
def test_mla_wrapper_plan_reports_arguments_before_the_workspace_device(no_target, no_compile, kw, match):
    w = ca.BatchMLAPagedAttentionWrapper(torch.zeros(8 << 20, dtype=torch.uint8))
    with pytest.raises(NotImplementedError, match=match):
        _mla_plan(w, **kw)


def test_mla_wrapper_plan_device_error_names_the_workspace(no_target, no_compile):
    w = ca.BatchMLAPagedAttentionWrapper(torch.zeros(8 << 20, dtype=torch.uint8))
    with pytest.raises(ValueError, match=_device_error("BatchMLAPagedAttentionWrapper.plan",
                                                       ["float_workspace_buffer"])):
        _mla_plan(w)
