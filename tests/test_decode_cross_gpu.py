"""GPU cross-check of every decode entry point and backend on the same random inputs (``tests/_decode_cross.py``).

Each case builds one paged K/V pool (NaN in the spare pages, the slots past each length and the block-table
columns past each request's pages), runs it through the decode wrapper (``backend="cute"`` and ``"cudnn"``),
``single_decode_with_kv_cache`` (each request alone, contiguous K/V), ``trtllm_batch_decode_with_kv_cache`` (HND
and NHD), ``xqa`` (NHD and HND), ``attention.prims_ts.batch_decode_with_paged_kv_cache`` and
``cudnn_batch_decode_with_kv_cache`` with NaN-poisoned outputs, each with its own scale convention mapped from
one softmax scale, and compares O and the base-2 LSE with the float64 oracle.  A route outside a combination is
recorded, never skipped silently: no argument in its signature (checked), its documented refusal (exception and
message checked) or cuDNN's documented decline.  Run with ``-s`` to see every route's outcome.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from _decode_cross import BF16, FP8, FP16, Spec, run_all  # noqa: E402

CASES = {
    "plain": Spec(kv_lens=(37, 1, 300, 0, 129)),
    "gqa8_1_page64": Spec(kv_lens=(513, 64, 1000, 2), num_qo_heads=8, num_kv_heads=1, page_size=64),
    "fp16_d64": Spec(kv_lens=(200, 17, 0, 1025), num_qo_heads=16, num_kv_heads=4, head_dim=64, dtype=FP16),
    "fp8_kv": Spec(kv_lens=(129, 1, 2000, 64, 0), kv_dtype=FP8, k_scale=0.45, v_scale=1.6),
    "window": Spec(kv_lens=(1000, 129, 37, 5000), page_size=32, window_left=100),
    "sinks": Spec(kv_lens=(300, 37, 1500), sinks=True),
    "q_len3": Spec(kv_lens=(40, 300, 1025, 3), q_len=3),
    "q_len4_fp8_window_fp16": Spec(kv_lens=(1025, 64, 2048), num_qo_heads=16, num_kv_heads=2, page_size=64,
                                   dtype=FP16, kv_dtype=FP8, k_scale=0.6, v_scale=1.4, window_left=63, q_len=4),
    "q_len2_sinks_page64": Spec(kv_lens=(70, 2, 900), page_size=64, sinks=True, q_len=2),
    "page1": Spec(kv_lens=(37, 1, 0, 500), page_size=1),
    "soft_cap_fp16": Spec(kv_lens=(100, 7, 900), dtype=FP16, soft_cap=30.0),
}

#: routes that serve every case they get (no refusal, no missing argument, no decline)
ALWAYS = ("wrapper_cute",)


@pytest.mark.parametrize("name", list(CASES))
def test_every_decode_entry_point_agrees_with_the_oracle(name):
    spec = CASES[name]
    outcomes = run_all(spec)
    print(f"\n{name}: {spec.short()}")
    for route, what in outcomes.items():
        print(f"  {route:14s} {what}")
    for route in ALWAYS:
        assert outcomes[route].startswith("ok"), (route, outcomes[route])
    if not spec.soft_cap:  # trtllm serves everything else: windows, sinks, fp8, q_len_per_req, page size 1
        assert outcomes["trtllm_hnd"].startswith("ok") and outcomes["trtllm_nhd"].startswith("ok"), outcomes
    if spec.dtype == BF16 and spec.kv_dtype is None and not spec.sinks and spec.q_len == 1 and spec.page_size >= 16:
        from cutedsl_attn.cudnn.decode import cudnn_available

        if cudnn_available():  # cuDNN serves the plain one-row bf16 problems
            assert outcomes["cudnn"].startswith("ok"), outcomes["cudnn"]
    ran = [r for r, what in outcomes.items() if what.startswith("ok")]
    assert len(ran) >= 2, f"only {ran} ran: nothing was cross-checked"
