"""CPU tests of ``single_decode_with_kv_cache`` on an fp8 e4m3 K/V (no GPU, no kernel compile).

The compiled decode kernel is a recorder (``_kernel_stubs``): these tests check what a valid call hands to the
kernel (the problem's cache type, the K/V views without a copy, the folded softmax and output scales) and that
every refused call raises the documented exception, naming the argument, before any launch.

Scale algebra of ``single_decode_with_kv_cache`` (the kernel sees the raw fp8 values):

=========================  =====================================================
kernel ``sm_scale``        ``(sm_scale or 1/sqrt(D)) * (q_scale or 1) * (k_scale or 1)``
kernel ``output_scale``    ``v_scale or 1`` (fp32 epilogue, before the rounding)
=========================  =====================================================
"""

from __future__ import annotations

import math

import pytest
import torch

import cutedsl_attn as ca

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn

pytestmark = pytest.mark.usefixtures("cross_compile_sm90")  # tests/conftest.py


def _single(kv_len=40, hq=8, hkv=2, d=64, dtype=BF16, kv_dtype=FP8, layout="NHD", seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (kv_len, hkv, d) if layout == "NHD" else (hkv, kv_len, d)
    q = torch.randn(hq, d, generator=g).to(dtype)
    return q, torch.randn(shape, generator=g).to(kv_dtype), torch.randn(shape, generator=g).to(kv_dtype)


# ----------------------------------------------------------------------------- valid calls
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("q_dt", [BF16, FP16])
def test_fp8_kv_reaches_the_fp8_kernel_without_a_copy(rec, layout, q_dt):
    q, k, v = _single(kv_len=37, dtype=q_dt, layout=layout)
    o, lse = ca.single_decode_with_kv_cache(q, k, v, kv_layout=layout, k_scale=0.5, v_scale=2.0, return_lse=True)
    assert o.shape == q.shape and o.dtype == q_dt and lse.shape == (8,) and lse.dtype == torch.float32
    cfg, a = rec.last
    assert cfg.problem.kv_dtype == "float8_e4m3fn" and cfg.problem.dtype == str(q_dt).replace("torch.", "")
    assert cfg.page_size == 1 and cfg.group_size == 4
    assert a["k"].dtype == FP8 and a["v"].dtype == FP8
    kn, vn = (k, v) if layout == "NHD" else (k.transpose(0, 1), v.transpose(0, 1))
    assert a["k"].shape == (37, 1, 2, 64) and a["k"].data_ptr() == k.data_ptr()
    assert a["v"].data_ptr() == v.data_ptr()
    assert a["k"][:, 0].stride() == kn.stride() and a["v"][:, 0].stride() == vn.stride()
    assert a["q"].shape == (1, 8, 64) and a["q"].dtype == q_dt
    covered = sorted(t for r in a["work"].tolist() if r[0] == 0 for t in range(r[1], r[2]))
    assert covered == list(range(37))
    # the recorder writes O = output_scale: v_scale reached the epilogue
    assert torch.all(o.float() == 2.0)


SCALES = [
    # (sm_scale, q_scale, k_scale, v_scale) -> kernel (sm_scale, output_scale), head_dim 64
    (dict(), (1 / 8, 1.0)),
    (dict(k_scale=0.25), (0.25 / 8, 1.0)),
    (dict(v_scale=3.0), (1 / 8, 3.0)),
    (dict(q_scale=2.0, k_scale=0.5, v_scale=0.7), (1 / 8, 0.7)),
    (dict(sm_scale=0.3, q_scale=1.5, k_scale=0.1, v_scale=4.0), (0.3 * 1.5 * 0.1, 4.0)),
    (dict(sm_scale=0.3, k_scale=-2.0), (-0.6, 1.0)),  # a negative dequantisation scale flips the logits
]


@pytest.mark.parametrize("kw,expect", SCALES)
def test_fp8_scale_algebra(rec, kw, expect):
    q, k, v = _single()
    ca.single_decode_with_kv_cache(q, k, v, **kw)
    _, a = rec.last
    assert math.isclose(a["sm_scale"], expect[0], rel_tol=1e-12)
    assert math.isclose(a["output_scale"], expect[1], rel_tol=1e-12)


def test_fp8_numpy_scales_are_reals(rec):
    # numpy scalars are numbers.Real, as check_float and trtllm's scales take them; a bool is not a scale
    np = pytest.importorskip("numpy")
    q, k, v = _single()
    ca.single_decode_with_kv_cache(q, k, v, sm_scale=np.float64(0.3), q_scale=np.float32(2.0),
                                   k_scale=np.float32(0.5), v_scale=np.float16(4.0))
    _, a = rec.last
    assert math.isclose(a["sm_scale"], 0.3, rel_tol=1e-7) and a["output_scale"] == 4.0
    assert type(a["sm_scale"]) is float and type(a["output_scale"]) is float
    n = len(rec.calls)
    for name in ("q_scale", "k_scale", "v_scale"):
        with pytest.raises(TypeError, match=f"{name} must be a float"):
            ca.single_decode_with_kv_cache(q, k, v, **{name: True})
    assert len(rec.calls) == n


def test_fp8_kv_16bit_kv_same_scales(rec):
    """The fp8 and the 16-bit cache fold the scales identically (only the cache type differs)."""
    kw = dict(sm_scale=0.2, q_scale=1.25, k_scale=0.4, v_scale=1.5)
    q, k, v = _single()
    ca.single_decode_with_kv_cache(q, k, v, **kw)
    cfg8, a8 = rec.last
    ca.single_decode_with_kv_cache(q, k.to(BF16), v.to(BF16), **kw)
    cfg16, a16 = rec.last
    assert cfg8.problem.kv_dtype == "float8_e4m3fn" and cfg16.problem.kv_dtype == ""
    assert a8["sm_scale"] == a16["sm_scale"] and a8["output_scale"] == a16["output_scale"]


def test_fp8_alibi_soft_cap_window_served(rec):
    q, k, v = _single(kv_len=100)
    ca.single_decode_with_kv_cache(q, k, v, pos_encoding_mode="ALIBI", window_left=31)
    cfg, a = rec.last
    assert cfg.problem.pos_encoding_mode == "ALIBI" and cfg.problem.kv_fp8
    assert a["alibi_slopes"].shape == (8,)
    covered = sorted(t for r in a["work"].tolist() if r[0] == 0 for t in range(r[1], r[2]))
    assert covered == list(range(100 - 32, 100))  # w + 1 keys, the current one included
    ca.single_decode_with_kv_cache(q, k, v, logits_soft_cap=20.0)
    cfg, a = rec.last
    assert cfg.use_soft_cap and a["soft_cap"] == 20.0


@pytest.mark.parametrize("d", [32, 128, 256])
def test_fp8_head_dims(rec, d):
    q, k, v = _single(d=d, hq=4, hkv=4)
    o = ca.single_decode_with_kv_cache(q, k, v)
    cfg, _ = rec.last
    assert o.shape == (4, d) and cfg.problem.head_dim == d and cfg.group_size == 1


def test_fp8_empty_kv(rec):
    q, k, v = _single(kv_len=0)
    o, lse = ca.single_decode_with_kv_cache(q, k, v, return_lse=True)
    assert o.shape == q.shape and lse.shape == (8,)
    assert rec.last[1]["work"].tolist()[0][:3] == [0, 0, 0]


def test_fp8_compiled_call_is_the_single_decode_op(rec):
    q, k, v = _single()
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    o = torch.compile(lambda q, k, v: ca.single_decode_with_kv_cache(q, k, v, k_scale=0.5, v_scale=3.0),
                      fullgraph=True, backend=backend)(q, k, v)
    assert "cutedsl_attn.single_decode.default" in seen
    assert torch.all(o.float() == 3.0) and rec.last[1]["k"].dtype == FP8


# ----------------------------------------------------------------------------- refused calls
@pytest.mark.parametrize("case,exc,match", [
    ("e5m2", NotImplementedError, "float8_e5m2.*float8_e4m3fn"),
    ("k_fp8_v_bf16", NotImplementedError, "k and v dtypes must match"),
    ("q_fp8", NotImplementedError, "q dtype"),
    ("fp16_kv_bf16_q", NotImplementedError, "float8_e4m3fn"),
    ("rope", NotImplementedError, "ROPE_LLAMA"),
    ("k_scale_tensor", NotImplementedError, "k_scale"),
    ("v_scale_str", TypeError, "v_scale"),
    ("q_scale_nan", ValueError, "q_scale"),
    ("sm_scale_str", TypeError, "sm_scale"),
    ("kv_shape", ValueError, "k and v"),
    ("group", NotImplementedError, "group"),
])
def test_fp8_refusals_before_launch(rec, case, exc, match):
    q, k, v = _single()
    kw = {}
    if case == "e5m2":
        k, v = k.float().to(torch.float8_e5m2), v.float().to(torch.float8_e5m2)
    elif case == "k_fp8_v_bf16":
        v = v.to(BF16)
    elif case == "q_fp8":
        q = q.to(FP8)
    elif case == "fp16_kv_bf16_q":
        k, v = k.to(FP16), v.to(FP16)
    elif case == "rope":
        kw["pos_encoding_mode"] = "ROPE_LLAMA"
    elif case == "k_scale_tensor":
        kw["k_scale"] = torch.tensor(0.5)
    elif case == "v_scale_str":
        kw["v_scale"] = "2.0"
    elif case == "q_scale_nan":
        kw["q_scale"] = float("nan")
    elif case == "sm_scale_str":
        kw["sm_scale"] = "0.1"
    elif case == "kv_shape":
        v = v[:-1]
    elif case == "group":
        q, k, v = _single(hq=34, hkv=2)
    with pytest.raises(exc, match=match):
        ca.single_decode_with_kv_cache(q, k, v, **kw)
    assert rec.calls == []


def test_fp8_scale_checks_also_under_compile(rec):
    """A scale the eager call refuses is refused before the custom op is traced, not turned into a float."""
    q, k, v = _single()
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: ca.single_decode_with_kv_cache(q, k, v, v_scale="2.0"), fullgraph=True,
                       backend="eager")
    with pytest.raises((TypeError, RuntimeError), match="v_scale"):  # dynamo reports the TypeError it saw
        fn(q, k, v)
    assert rec.calls == []
