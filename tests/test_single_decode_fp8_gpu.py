"""GPU tests of ``single_decode_with_kv_cache`` on an fp8 e4m3 K/V against the float64 oracle on the dequantised
cache (run on an H200).

Every buffer the call allocates with ``torch.empty`` (output, LSE, the split-KV workspace) starts poisoned: NaN for
float tensors, 0xFF bytes (a float32 NaN) for the uint8 workspace; the K/V rows past ``kv_len`` hold NaN (k and v
are views of longer buffers).  Inputs are fresh random values each run (the seed is in the failure message).
"""

import contextlib
import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import cutedsl_attn as ca  # noqa: E402
from cutedsl_attn import ref  # noqa: E402
from cutedsl_attn.ref.paged import dequantize_kv_cache  # noqa: E402
from _checks import TOL, rel_err  # noqa: E402

DEV = torch.device("cuda")
FP8 = torch.float8_e4m3fn
NAN = float("nan")
#: the kernel on the quantised cache against the oracle on the values before quantisation (e4m3 keeps 3 mantissa
#: bits: about 2.7% rms per element, averaged down by the softmax and P V sums), as tests/test_fp8_decode_gpu.py
FP8_NOISE_TOL = 6e-2


@contextlib.contextmanager
def poisoned_empty():
    """``torch.empty`` returning NaN-filled float tensors and 0xFF-filled uint8 ones; yields the data pointers of
    the tensors it poisoned (so a test can check that its output was among them)."""
    real = torch.empty
    ptrs = set()

    def empty(*size, **kw):
        t = real(*size, **kw)
        if t.is_floating_point():
            t.fill_(NAN)
        elif t.dtype == torch.uint8:
            t.fill_(255)
        else:
            return t
        ptrs.add(t.data_ptr())
        return t

    torch.empty = empty
    try:
        yield ptrs
    finally:
        torch.empty = real


def make_kv(kv_len, hkv, d, layout, gen, *, pad=37, amp=2.0):
    """float32 K/V values ``[kv_len, Hkv, D]`` (NHD order), and their fp8 copies in ``layout`` as views of longer
    device buffers whose rows past ``kv_len`` are NaN."""
    k32 = torch.randn(kv_len, hkv, d, generator=gen) * amp
    v32 = torch.randn(kv_len, hkv, d, generator=gen) * amp
    views = []
    for x in (k32, v32):
        big = torch.full((kv_len + pad, hkv, d), NAN).to(FP8)
        big[:kv_len] = x.to(FP8)
        if layout == "NHD":
            views.append(big.to(DEV)[:kv_len])
        else:
            views.append(big.transpose(0, 1).contiguous().to(DEV)[:, :kv_len])  # [Hkv, kv_len + pad, D] rows
    return k32, v32, views[0], views[1]


def nhd(x, layout):
    return x if layout == "NHD" else x.transpose(0, 1)


def oracle(q, k, v, layout, *, k_scale, v_scale, q_scale=1.0, sm_scale=None, **kw):
    """float64 single decode on the dequantised ``k`` / ``v`` (fp8 or float32, ``layout``): ``(o [Hq, D], lse)``."""
    d = q.shape[-1]
    scale = (1.0 / math.sqrt(d) if sm_scale is None else sm_scale) * q_scale
    o, lse = ref.attention(q.cpu()[None], dequantize_kv_cache(nhd(k, layout).cpu(), k_scale),
                           dequantize_kv_cache(nhd(v, layout).cpu(), v_scale), sm_scale=scale, **kw)
    return o[0], lse[0]


def run_poisoned(q, k, v, layout, **kw):
    """The call with its allocations poisoned; checks that O and LSE were poisoned buffers and were fully written."""
    with poisoned_empty() as ptrs:
        o, lse = ca.single_decode_with_kv_cache(q, k, v, kv_layout=layout, return_lse=True, **kw)
    torch.cuda.synchronize()
    assert o.data_ptr() in ptrs and lse.data_ptr() in ptrs, "the output buffers were not poisoned"
    o, lse = o.cpu(), lse.cpu()
    assert not torch.isnan(o).any(), "NaN / unwritten output"
    assert not torch.isnan(lse).any(), "NaN / unwritten LSE"
    return o, lse


def check(o, lse, o_ref, lse_ref, tol, what):
    e = rel_err(o, o_ref)
    assert e <= tol, f"{what}: output rel err {e}"
    fin = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse.double()), fin), f"{what}: LSE -inf pattern differs"
    if fin.any():
        dl = (lse.double()[fin] - lse_ref[fin]).abs().max().item()
        assert dl < 2e-2, f"{what}: LSE abs err {dl}"
    return e


CASES = [
    # (kv_len, hq, hkv, d, q dtype, layout)
    (1, 32, 8, 128, torch.bfloat16, "NHD"),
    (77, 32, 8, 128, torch.bfloat16, "HND"),
    (3000, 32, 8, 128, torch.bfloat16, "NHD"),  # one request: the plan splits the KV (partials in the workspace)
    (3000, 32, 8, 128, torch.float16, "HND"),
    (513, 8, 1, 64, torch.float16, "NHD"),
    (1000, 16, 16, 256, torch.bfloat16, "HND"),
    (4097, 64, 4, 128, torch.bfloat16, "HND"),
    (33, 4, 4, 32, torch.float16, "NHD"),
]


@pytest.mark.parametrize("kv_len,hq,hkv,d,q_dt,layout", CASES)
def test_single_decode_fp8_vs_oracle(kv_len, hq, hkv, d, q_dt, layout):
    seed = torch.seed() % (2**31)
    gen = torch.Generator().manual_seed(seed)
    k32, v32, k8, v8 = make_kv(kv_len, hkv, d, layout, gen)
    q = torch.randn(hq, d, generator=gen).to(q_dt)
    scales = dict(q_scale=1.3, k_scale=0.37, v_scale=1.7)  # != 1: all three reach the kernel's scalars
    o, lse = run_poisoned(q.to(DEV), k8, v8, layout, **scales)
    assert o.shape == (hq, d) and o.dtype == q_dt and lse.shape == (hq,)
    what = f"seed {seed} ({kv_len}, {hq}/{hkv}, d{d}, {q_dt}, {layout})"
    o_ref, lse_ref = oracle(q, k8, v8, layout, **scales)
    check(o, lse, o_ref, lse_ref, TOL[q_dt], what + " vs dequantised oracle")
    # quantisation noise only: the oracle on the float32 values the cache was quantised from
    o_hi, _ = oracle(q, k32, v32, "NHD", **scales)
    assert rel_err(o, o_hi) <= FP8_NOISE_TOL, what + " vs unquantised oracle"


@pytest.mark.parametrize("feature", ["sm_scale", "soft_cap", "window", "alibi"])
def test_single_decode_fp8_features(feature):
    seed = torch.seed() % (2**31)
    gen = torch.Generator().manual_seed(seed)
    kv_len, hq, hkv, d, layout = 1500, 32, 8, 128, "NHD"
    k32, v32, k8, v8 = make_kv(kv_len, hkv, d, layout, gen)
    q = torch.randn(hq, d, generator=gen).to(torch.bfloat16)
    run_kw = {"sm_scale": dict(sm_scale=0.03), "soft_cap": dict(logits_soft_cap=4.0),
              "window": dict(window_left=1023), "alibi": dict(pos_encoding_mode="ALIBI")}[feature]
    o, lse = run_poisoned(q.to(DEV), k8, v8, layout, k_scale=0.8, v_scale=0.5, **run_kw)
    o_ref, lse_ref = oracle(q, k8, v8, layout, k_scale=0.8, v_scale=0.5, **run_kw)  # the oracle's names
    check(o, lse, o_ref, lse_ref, TOL[torch.bfloat16], f"seed {seed} {feature}")


def test_single_decode_fp8_matches_16bit_on_exact_values():
    """e4m3 values are exact in bf16: the fp8 call and the 16-bit call on the widened cache agree to the rounding
    of P (f16 against bf16) and of O."""
    gen = torch.Generator().manual_seed(5)
    for layout in ("NHD", "HND"):
        _, _, k8, v8 = make_kv(2000, 8, 128, layout, gen)
        q = torch.randn(32, 128, generator=gen).to(torch.bfloat16).to(DEV)
        o8, lse8 = ca.single_decode_with_kv_cache(q, k8, v8, kv_layout=layout, k_scale=0.5, v_scale=2.0,
                                                  return_lse=True)
        o16, lse16 = ca.single_decode_with_kv_cache(q, k8.to(torch.bfloat16), v8.to(torch.bfloat16),
                                                    kv_layout=layout, k_scale=0.5, v_scale=2.0, return_lse=True)
        assert rel_err(o8, o16) < 6e-3, layout
        assert (lse8.cpu() - lse16.cpu()).abs().max().item() < 1e-2, layout


def test_single_decode_fp8_empty_kv():
    q = torch.randn(8, 64, device=DEV).to(torch.bfloat16)
    big = torch.full((5, 2, 64), NAN, device=DEV).to(FP8)  # zero rows of a NaN buffer: none may be read
    o, lse = run_poisoned(q, big[:0], big[:0], "NHD", k_scale=2.0)
    assert torch.all(o == 0) and torch.all(lse == float("-inf"))
