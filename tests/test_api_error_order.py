"""Which error comes first: a wrong shape or dtype is reported as such (the argument and its rule) whatever the
device, and only inputs that pass every shape and dtype check are refused for being off CUDA, in the entry point's
own argument names (``api._common.check_one_device`` up front, ``check_devices`` before planning).  Host tensors
and no ``CUTEDSL_ATTN_ARCH`` (the state of a new user's first call on a machine without a GPU, or with host tensors
on a GPU machine); cross-compiling (``CUTEDSL_ATTN_ARCH`` set, no GPU), the launch's refusal names the entry point
that was called, not the wrapper it plans through."""

import re

import pytest
import torch

import cutedsl_attn as ca
from cutedsl_attn import dispatch
from cutedsl_attn.api import _common
from cutedsl_attn.attention import prims_ts

from _api_inputs import (  # pytest puts tests/ on sys.path
    BF16, E4M3, EntryRefusesDevice, context_args, prims_ts_args, single_decode_args, single_prefill_args, trtllm_args,
    trtllm_mla_args, xqa_args, xqa_mla_args,
)


@pytest.fixture
def host_launch(monkeypatch):
    """Cross-compiling without a GPU: host tensors pass the checks; the (fake) kernel entry refuses them."""
    monkeypatch.setenv("CUTEDSL_ATTN_ARCH", "sm_90a")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dispatch, "get_compiled", lambda name, cfg, build: EntryRefusesDevice())
    monkeypatch.setattr(dispatch, "_CHOICES", {})


def _device_error(where, names):
    """The regex of the up-front device refusal: the entry point, then its own argument names."""
    rule = "must be a CUDA tensor" if len(names) == 1 else "must be CUDA tensors"
    return rf"^{re.escape(where)}: {re.escape(', '.join(names))} {rule}, got cpu$"


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
    args = xqa_mla_args()
    args.update(change)
    with pytest.raises(exc, match=match):
        ca.xqa_mla(**args)


def test_xqa_mla_device_error_names_its_own_arguments(no_target, no_compile):
    with pytest.raises(ValueError, match=_device_error("xqa_mla", XQA_MLA_NAMES)):
        ca.xqa_mla(**xqa_mla_args())


def test_xqa_mla_host_launch_names_xqa_mla(host_launch):
    with pytest.raises(ValueError, match=_launch_error("xqa_mla")) as ei:
        ca.xqa_mla(**xqa_mla_args())
    assert "query" not in str(ei.value) and "kv_cache and" not in str(ei.value)  # not trtllm MLA's names


# ----------------------------------------------------------------------------- single_decode_with_kv_cache
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
    args = single_decode_args()
    args.update(change)
    with pytest.raises(exc, match=match):
        ca.single_decode_with_kv_cache(**args)


def test_single_decode_device_error_names_its_own_arguments(no_target, no_compile):
    with pytest.raises(ValueError, match=_device_error("single_decode_with_kv_cache", ["q", "k", "v"])):
        ca.single_decode_with_kv_cache(**single_decode_args())


def test_single_decode_host_launch_names_single_decode(host_launch):
    with pytest.raises(ValueError, match=_launch_error("single_decode_with_kv_cache")):
        ca.single_decode_with_kv_cache(**single_decode_args())


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
@pytest.mark.parametrize("change,exc,match", [
    (dict(q=torch.randn(5, 8, 32).to(BF16)), ValueError, r"^q head_dim 32 != k head_dim 64$"),
    (dict(q=torch.randn(5, 8, 64)), NotImplementedError, r"^q/k/v dtypes must match \(got torch.float32, "),
    (dict(v=torch.randn(39, 2, 64).to(BF16)), ValueError, r"^k and v must agree on \[kv_len, num_kv_heads\]"),
    (dict(custom_mask=torch.ones(5, 39, dtype=torch.bool)), ValueError,
     r"^custom_mask must have shape \[qo_len, kv_len\] = \(5, 40\), got \(5, 39\)$"),
])
def test_single_prefill_reports_shapes_and_dtypes_before_the_device(no_target, no_compile, change, exc, match):
    args = single_prefill_args()
    args.update(change)
    with pytest.raises(exc, match=match):
        ca.single_prefill_with_kv_cache(**args)


def test_single_prefill_device_error_names_its_own_arguments(no_target, no_compile):
    with pytest.raises(ValueError, match=_device_error("single_prefill_with_kv_cache", ["q", "k", "v"])):
        ca.single_prefill_with_kv_cache(**single_prefill_args())


def test_single_prefill_host_launch_names_single_prefill(host_launch):
    with pytest.raises(ValueError, match=_launch_error("single_prefill_with_kv_cache")):
        ca.single_prefill_with_kv_cache(**single_prefill_args())


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
    args = trtllm_mla_args()
    args.update(change)
    with pytest.raises(exc, match=match):
        ca.trtllm_batch_decode_with_kv_cache_mla(**args)


def test_trtllm_mla_device_error_names_its_own_arguments(no_target, no_compile):
    with pytest.raises(ValueError, match=_device_error("trtllm_batch_decode_with_kv_cache_mla", TRTLLM_MLA_NAMES)):
        ca.trtllm_batch_decode_with_kv_cache_mla(**trtllm_mla_args())


def test_trtllm_mla_host_launch_names_trtllm_mla(host_launch):
    with pytest.raises(ValueError, match=_launch_error("trtllm_batch_decode_with_kv_cache_mla")):
        ca.trtllm_batch_decode_with_kv_cache_mla(**trtllm_mla_args())


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


# ----------------------------------------------------------------------------- trtllm / xqa
TRTLLM_NAMES = ["query", "kv_cache", "workspace_buffer", "block_tables"]


@pytest.mark.parametrize("change,exc,match", [
    (dict(query=torch.randn(2, 8, 64)), NotImplementedError, r"^query dtype torch.float32 is not supported"),
    (dict(query=torch.randn(2, 8, 32).to(BF16)), ValueError, r"^query head_dim 32 != the KV cache's 64$"),
    (dict(query=torch.randn(2, 3, 64).to(BF16)), ValueError,
     r"^num_qo_heads \(3\) must be a multiple of num_kv_heads \(2\)$"),
    (dict(query=torch.randn(2, 8, 72).to(BF16), kv_cache=torch.randn(6, 2, 2, 16, 72).to(BF16)),
     NotImplementedError, r"^head_dim=72 is not supported"),
    (dict(kv_cache=torch.randn(6, 2, 2, 16, 64).half()), ValueError,
     r"^the KV cache dtype \(torch.float16\) must be the query's"),
    (dict(block_tables=torch.arange(6).view(2, 3)), ValueError, r"^block_tables must be int32, got torch.int64$"),
    (dict(block_tables=torch.arange(2, dtype=torch.int32).view(2, 1)), ValueError,
     r"^block_tables is too narrow for seq_lens: .* needs 3 columns, block_tables has 1$"),
    (dict(out=torch.empty(2, 8, 32, dtype=BF16)), ValueError, r"^out must have shape \(2, 8, 64\), got \(2, 8, 32\)$"),
    (dict(out=torch.empty(2, 8, 64).half()), NotImplementedError, r"^output dtype torch.float16 is not supported"),
    (dict(lse=torch.empty(2, 8, dtype=torch.float16)), ValueError,
     r"^The dtype of lse \(torch.float16\) does not match the expected torch.float32$"),
    (dict(lse=torch.empty(2, 4)), ValueError, r"^lse must have shape \(2, 8\), got \(2, 4\)$"),
    (dict(sinks=torch.zeros(8, dtype=torch.float16)), ValueError, r"^sinks must be float32"),
    (dict(workspace_buffer=None), TypeError, r"^workspace_buffer must be a torch.Tensor, got NoneType$"),
])
def test_trtllm_decode_reports_shapes_and_dtypes_before_the_device(no_target, no_compile, change, exc, match):
    args = trtllm_args()
    args.update(change)
    with pytest.raises(exc, match=match):
        ca.trtllm_batch_decode_with_kv_cache(**args)


def test_trtllm_decode_device_error_names_its_own_arguments(no_target, no_compile):
    with pytest.raises(ValueError, match=_device_error("trtllm_batch_decode_with_kv_cache", TRTLLM_NAMES)):
        ca.trtllm_batch_decode_with_kv_cache(**trtllm_args())
    args = trtllm_args()
    args["kv_cache"] = tuple(args["kv_cache"].unbind(1))
    args["lse"] = torch.empty(2, 8)
    names = ["query", "kv_cache[0]", "kv_cache[1]", "workspace_buffer", "block_tables", "lse"]
    with pytest.raises(ValueError, match=_device_error("trtllm_batch_decode_with_kv_cache", names)):
        ca.trtllm_batch_decode_with_kv_cache(**args)


def test_trtllm_decode_names_a_cache_on_another_device_first(no_target, no_compile):
    args = trtllm_args(hq=3)  # a shape error too: the mixed devices come first
    args["kv_cache"] = (args["kv_cache"][:, 0], torch.empty(6, 2, 16, 64, dtype=BF16, device="meta"))
    with pytest.raises(ValueError, match=r"^trtllm_batch_decode_with_kv_cache: kv_cache\[1\] is on meta but query is "
                                         r"on cpu"):
        ca.trtllm_batch_decode_with_kv_cache(**args)


@pytest.mark.parametrize("q_len", [1, 2])
def test_trtllm_decode_host_launch_names_trtllm_decode(host_launch, q_len):
    args = trtllm_args(q_rows=2 * q_len)  # two rows a request: the prefill kernel, through another wrapper
    with pytest.raises(ValueError, match=_launch_error("trtllm_batch_decode_with_kv_cache")):
        ca.trtllm_batch_decode_with_kv_cache(**args, q_len_per_req=q_len)


@pytest.mark.parametrize("change,exc,match", [
    (dict(query=torch.randn(7, 8, 32).to(BF16)), ValueError, r"^query head_dim 32 != the KV cache's 64$"),
    (dict(query=torch.randn(7, 8, 72).to(BF16), kv_cache=torch.randn(6, 2, 2, 16, 72).to(BF16)),
     NotImplementedError, r"^head_dim=72 is not supported"),
    (dict(query=torch.randn(7, 8, 64).half()), ValueError, r"^the KV cache dtype \(torch.bfloat16\) must be the"),
    (dict(block_tables=torch.arange(6).view(2, 3)), ValueError, r"^block_tables must be int32, got torch.int64$"),
    (dict(block_tables=torch.arange(4, dtype=torch.int32).view(2, 2)), ValueError,
     r"^block_tables is too narrow for seq_lens"),
    (dict(cum_seq_lens_kv=torch.tensor([0, 20, 52], dtype=torch.int32)), ValueError,
     r"^cum_seq_lens_kv \[0, 20, 52\] must be the prefix sums of seq_lens \[20, 33\]$"),
    (dict(out=torch.empty(7, 8, 32, dtype=BF16)), ValueError, r"^out must have shape \(7, 8, 64\), got \(7, 8, 32\)$"),
    (dict(lse=torch.empty(8, 7)), ValueError, r"^lse must have shape \(7, 8\), got \(8, 7\)$"),
    (dict(sinks=torch.zeros(3)), ValueError, r"^sinks must hold one value per query head \(8\)"),
])
def test_trtllm_context_reports_shapes_and_dtypes_before_the_device(no_target, no_compile, change, exc, match):
    args = context_args()
    args.update(change)
    with pytest.raises(exc, match=match):
        ca.trtllm_batch_context_with_kv_cache(**args)


def test_trtllm_context_device_error_names_its_own_arguments(no_target, no_compile):
    with pytest.raises(ValueError, match=_device_error("trtllm_batch_context_with_kv_cache", TRTLLM_NAMES)):
        ca.trtllm_batch_context_with_kv_cache(**context_args())


def test_trtllm_context_host_launch_names_trtllm_context(host_launch):
    with pytest.raises(ValueError, match=_launch_error("trtllm_batch_context_with_kv_cache")) as ei:
        ca.trtllm_batch_context_with_kv_cache(**context_args())
    assert "Wrapper" not in str(ei.value)  # not the wrapper it plans through


XQA_NAMES = ["q", "k_cache", "v_cache", "page_table", "output", "workspace_buffer", "semaphores"]


@pytest.mark.parametrize("change,exc,match", [
    (dict(q=torch.randn(2, 1, 8, 64)), NotImplementedError, r"^q dtype torch.float32 is not supported"),
    (dict(output=torch.empty(2, 1, 8, 32, dtype=BF16)), ValueError,
     r"^output must have shape \(2, 1, 8, 64\), got \(2, 1, 8, 32\)$"),
    (dict(output=torch.empty(2, 1, 8, 64).half()), ValueError,
     r"^output dtype \(torch.float16\) must be q's \(torch.bfloat16\)$"),
    (dict(v_cache=torch.randn(6, 16, 2, 64).half()), ValueError, r"^k_cache and v_cache must have the same dtype"),
    (dict(k_cache=torch.randn(6, 16, 2, 72).to(BF16), v_cache=torch.randn(6, 16, 2, 72).to(BF16)), ValueError,
     r"^q head_dim 64 != the caches' 72$"),
    (dict(page_table=torch.arange(6).view(2, 3)), ValueError, r"^page_table must be int32, got torch.int64$"),
    (dict(page_table=torch.arange(2, dtype=torch.int32).view(2, 1)), ValueError,
     r"^page_table is too narrow for seq_lens: .* needs 3 columns, page_table has 1$"),
    (dict(sinks=torch.zeros(8)), ValueError, r"^sinks must have shape \(2, 4\), got \(8,\)$"),
    (dict(num_kv_heads=4), ValueError, r"^the caches \(NHD, shape \(6, 16, 2, 64\)\) have page_size 16 and 2 kv"),
])
def test_xqa_reports_shapes_and_dtypes_before_the_device(no_target, no_compile, change, exc, match):
    args = xqa_args()
    args.update(change)
    with pytest.raises(exc, match=match):
        ca.xqa(**args)


def test_xqa_device_error_names_its_own_arguments(no_target, no_compile):
    with pytest.raises(ValueError, match=_device_error("xqa", XQA_NAMES)):
        ca.xqa(**xqa_args())


def test_xqa_host_launch_names_xqa(host_launch):
    with pytest.raises(ValueError, match=_launch_error("xqa")) as ei:
        ca.xqa(**xqa_args())
    assert "Wrapper" not in str(ei.value)


# ----------------------------------------------------------------------------- prims_ts
PRIMS_TS_NAMES = ["q", "paged_kv_cache", "block_tables", "seq_lens_kv"]


@pytest.mark.parametrize("change,exc,match", [
    (dict(q=torch.randn(2, 8, 64)), NotImplementedError, r"^q dtype torch.float32 is not supported by prims_ts"),
    (dict(q=torch.randn(2, 8, 32).to(BF16)), ValueError, r"^q head_dim 32 differs from the cache's 64$"),
    (dict(q=torch.randn(2, 3, 64).to(BF16)), ValueError, r"^num_qo_heads \(3\) must be a multiple of num_kv_heads"),
    (dict(q=torch.randn(2, 8, 72).to(BF16), paged_kv_cache=torch.randn(6, 2, 2, 16, 72).to(BF16)),
     NotImplementedError, r"^head_dim=72 is not supported"),
    (dict(paged_kv_cache=torch.randn(6, 2, 16, 64).to(BF16)), ValueError, r"^paged_kv_cache must be \[pages, 2, "),
    (dict(block_tables=torch.arange(6).view(2, 3)), ValueError, r"^block_tables must be int32, got torch.int64$"),
    (dict(block_tables=torch.arange(3, dtype=torch.int32).view(1, 3)), ValueError,
     r"^block_tables must have 2 rows \(the batch size\), got 1$"),
    (dict(seq_lens_kv=torch.tensor([20, 33])), ValueError, r"^seq_lens_kv must be int32, got torch.int64$"),
    (dict(seq_lens_kv=torch.tensor([20, 49], dtype=torch.int32)), ValueError, r"^seq_lens_kv must lie in \[0, "),
    (dict(out=torch.empty(2, 8, 32, dtype=BF16)), ValueError, r"^out must have shape \(2, 8, 64\), got \(2, 8, 32\)$"),
    (dict(out=torch.empty(2, 8, 64).half()), NotImplementedError,
     r"^mixed dtypes \(q torch.bfloat16, kv torch.bfloat16, out torch.float16\) are not supported"),
    (dict(out=torch.empty(2, 8, 64).half(), out_dtype=BF16), ValueError,
     r"^out dtype torch.float16 differs from out_dtype torch.bfloat16$"),
    (dict(bmm1_scale=0.0), ValueError, r"^bmm1_scale must be finite and > 0"),
    (dict(workspace_buffer="ws"), TypeError, r"^workspace_buffer must be a torch.Tensor, got str$"),
])
def test_prims_ts_reports_shapes_and_dtypes_before_the_device(no_target, no_compile, change, exc, match):
    args = prims_ts_args()
    args.update(change)
    with pytest.raises(exc, match=match):
        prims_ts.batch_decode_with_paged_kv_cache(**args)


def test_prims_ts_device_error_names_its_own_arguments(no_target, no_compile):
    f = prims_ts.batch_decode_with_paged_kv_cache
    with pytest.raises(ValueError, match=_device_error("batch_decode_with_paged_kv_cache", PRIMS_TS_NAMES)):
        f(**prims_ts_args())
    args = prims_ts_args()
    args.update(paged_kv_cache=tuple(args["paged_kv_cache"].unbind(1)), out=torch.empty(2, 8, 64, dtype=BF16))
    names = ["q", "paged_kv_cache[0]", "paged_kv_cache[1]", "block_tables", "seq_lens_kv", "out"]
    with pytest.raises(ValueError, match=_device_error("batch_decode_with_paged_kv_cache", names)):
        f(**args)
    empty = prims_ts_args()  # an empty batch is refused as well (nothing launches, but the rule is the same)
    empty.update(q=empty["q"][:0], block_tables=empty["block_tables"][:0], seq_lens_kv=empty["seq_lens_kv"][:0])
    with pytest.raises(ValueError, match=_device_error("batch_decode_with_paged_kv_cache", PRIMS_TS_NAMES)):
        f(**empty)


@pytest.mark.parametrize("seq_len_q", [1, 2])
def test_prims_ts_host_launch_names_prims_ts(host_launch, seq_len_q):
    args = prims_ts_args()
    if seq_len_q > 1:  # token-major rows: the prefill kernel, through another wrapper
        args["q"] = torch.randn(2, seq_len_q, 8, 64).to(BF16)
    with pytest.raises(ValueError, match=_launch_error("batch_decode_with_paged_kv_cache")):
        prims_ts.batch_decode_with_paged_kv_cache(**args, seq_len_q=seq_len_q)


def _ts_plan(w, device="cpu", head_dim=64, q_data_type=BF16, **kw):
    w.plan(device, 2, 8, 2, head_dim, 16, 48, q_data_type=q_data_type, **kw)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(head_dim=72), NotImplementedError, r"^head_dim=72 is not supported"),
    (dict(q_data_type=torch.float32), NotImplementedError, r"^q dtype torch.float32 is not supported"),
    (dict(seq_lens=torch.tensor([20, 33])), ValueError, r"^seq_lens must be int32, got torch.int64$"),
    (dict(seq_lens=torch.tensor([20, 33, 4], dtype=torch.int32)), ValueError, r"^seq_lens must have shape \[2\]"),
    (dict(workspace_buffer=torch.zeros(1 << 20, dtype=torch.uint8, device="meta")), ValueError,
     r"^workspace_buffer is on meta, expected cpu$"),
])
def test_ts_wrapper_plan_reports_arguments_before_the_device(no_target, no_compile, kw, exc, match):
    with pytest.raises(exc, match=match):
        _ts_plan(prims_ts.BatchDecodePagedTSWrapper(), **kw)


@pytest.mark.parametrize("kw", [{}, dict(max_seq_len_q=2), dict(seq_lens=torch.tensor([20, 33], dtype=torch.int32))])
def test_ts_wrapper_plan_device_error_names_its_device(no_target, no_compile, kw):
    # not the error of the decode / prefill wrapper it plans through (their float_workspace_buffer)
    with pytest.raises(ValueError, match=r"^BatchDecodePagedTSWrapper.plan: device must be a CUDA device, got cpu$"):
        _ts_plan(prims_ts.BatchDecodePagedTSWrapper(), **kw)


def _host_planned_ts_wrapper(monkeypatch, **kw):
    """A wrapper planned on the host while cross-compiling, then run without the target."""
    monkeypatch.setenv("CUTEDSL_ATTN_ARCH", "sm_90a")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    w = prims_ts.BatchDecodePagedTSWrapper()
    _ts_plan(w, **kw)
    monkeypatch.delenv("CUTEDSL_ATTN_ARCH")
    a = prims_ts_args()
    return w, a["q"], a["paged_kv_cache"], a["seq_lens_kv"], a["block_tables"]


@pytest.mark.parametrize("change,match", [
    (dict(q=torch.randn(2, 8, 32).to(BF16)), r"^q must have shape \(2, 8, 64\), got \(2, 8, 32\)$"),
    (dict(q=torch.randn(2, 8, 64).half()), r"^q dtype torch.float16 differs from the planned q_data_type"),
    (dict(cache=torch.randn(6, 2, 2, 8, 64).to(BF16)), r"^paged_kv_cache has \(num_kv_heads, page_size, head_dim\)"),
    (dict(lens=torch.tensor([20, 33])), r"^seq_lens must be int32, got torch.int64$"),
    (dict(table=torch.arange(6).view(2, 3)), r"^block_tables must be int32, got torch.int64$"),
    (dict(table=torch.arange(4, dtype=torch.int32).view(2, 2)), r"^block_tables has 2 columns: too few pages"),
    (dict(out=torch.empty(2, 8, 32, dtype=BF16)), r"^out must have shape \(2, 8, 64\), got \(2, 8, 32\)$"),
])
def test_ts_wrapper_run_reports_shapes_and_dtypes_before_the_device(monkeypatch, rec, change, match):
    w, q, cache, lens, table = _host_planned_ts_wrapper(monkeypatch)
    q, cache, lens, table = (change.get(n, x) for n, x in (("q", q), ("cache", cache), ("lens", lens),
                                                             ("table", table)))
    with pytest.raises(ValueError, match=match):
        w.run(q, cache, lens, table, out=change.get("out"))
    assert rec.calls == []


def test_ts_wrapper_run_device_error_names_its_own_arguments(monkeypatch, rec):
    w, q, cache, lens, table = _host_planned_ts_wrapper(monkeypatch)
    with pytest.raises(ValueError, match=_device_error("BatchDecodePagedTSWrapper.run",
                                                       ["q", "paged_kv_cache", "seq_lens", "block_tables"])):
        w.run(q, cache, lens, table)
    names = ["q", "paged_kv_cache[0]", "paged_kv_cache[1]", "seq_lens", "block_tables", "out"]
    with pytest.raises(ValueError, match=_device_error("BatchDecodePagedTSWrapper.run", names)):
        w.run(q, tuple(cache.unbind(1)), lens, table, out=torch.empty(2, 8, 64, dtype=BF16))
    assert rec.calls == []


@pytest.mark.parametrize("sq", [1, 2])
def test_ts_wrapper_host_launch_names_the_ts_wrapper(host_launch, sq):
    w = prims_ts.BatchDecodePagedTSWrapper()
    _ts_plan(w, max_seq_len_q=sq)
    a = prims_ts_args()
    q = a["q"] if sq == 1 else torch.randn(2, sq, 8, 64).to(BF16)
    with pytest.raises(ValueError, match=_launch_error("BatchDecodePagedTSWrapper.run")):
        w.run(q, a["paged_kv_cache"], a["seq_lens_kv"], a["block_tables"])
