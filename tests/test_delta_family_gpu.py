"""GPU tests of GDN-2, Gated DeltaProduct and KDA (the recurrent CuTe DSL kernel's family variants, and cuDNN
where its engines run) against the float64 oracles of ``cutedsl_attn.ref``.

Fresh random inputs every run, outputs and states poisoned with NaN before each launch, relative Frobenius error
against the token-serial oracle on the same rounded inputs.  One helper, :func:`cross_check`, runs the same inputs
through ``backend="cute"``, ``backend="cudnn"`` (where cuDNN's engine accepts the graph) and the oracle.
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from cutedsl_attn.api import cudnn_linear as cl  # noqa: E402
from cutedsl_attn.api import delta_family as api  # noqa: E402
from cutedsl_attn.api import gdn as gapi  # noqa: E402
from cutedsl_attn.cudnn.prefill import cudnn_available  # noqa: E402
from cutedsl_attn.ref import delta_family as rd  # noqa: E402
from cutedsl_attn.ref import gdn as rg  # noqa: E402

DEV = torch.device("cuda")
TOL_O = 1e-2  # 16-bit output rounding
TOL_S32 = 1e-3  # fp32 state
TOL_S16 = 1e-2  # bf16 state rounding
TOL_SC = 5e-3  # fp32 state of the chunked kernels (GDP, GDN-2, KDA prefill): their MMAs take 16-bit state copies
TOL_CUDNN = 5e-2  # cuDNN's chunked engines (16-bit MMA operands) against the serial oracle (FlashInfer's bound)
LENS = [0, 1, 15, 16, 17, 63, 64, 65]
LONG = [1000, 4097]
SM90 = torch.cuda.get_device_capability()[0] == 9


def rel(x, y):
    x, y = x.double(), y.double()
    assert torch.isfinite(x).all(), "non-finite values (a NaN-poisoned element was not written)"
    return ((x - y).norm() / max(y.norm().item(), 1e-30)).item()


def nan(shape, dtype):
    return torch.full(shape, float("nan"), device=DEV, dtype=dtype)


def cu_of(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)


def unit(x):
    return x / x.norm(dim=-1, keepdim=True)


def gdn2_inputs(lens, hq, hk, hv, K=128, V=128, dtype=torch.bfloat16, state_dtype=torch.float32, init=True,
                l2norm=False, g_dtype=torch.float32):
    T, ho = sum(lens), max(hq, hv)
    k = torch.randn(T, hk, K, device=DEV)
    return dict(q=torch.randn(T, hq, K, device=DEV).to(dtype), k=(k if l2norm else unit(k)).to(dtype),
                v=torch.randn(T, hv, V, device=DEV).to(dtype),
                g=(-torch.rand(T, ho, K, device=DEV) * 0.3).to(g_dtype), beta=torch.rand(T, ho, K, device=DEV),
                w=torch.rand(T, ho, V, device=DEV) + 0.5, cu_seqlens=cu_of(lens),
                initial_state=(torch.randn(len(lens), ho, V, K, device=DEV) * 0.1).to(state_dtype) if init else None,
                use_qk_l2norm_in_kernel=l2norm)


def gdp_inputs(lens, n, hq, hk, hv, K=128, V=128, state_dtype=torch.float32, l2norm=False):
    T, ho = sum(lens), max(hq, hv)
    k = torch.randn(T * n, hk, K, device=DEV)
    return dict(q=torch.randn(T, hq, K, device=DEV).bfloat16(), k=(k if l2norm else unit(k)).bfloat16(),
                v=torch.randn(T * n, hv, V, device=DEV).bfloat16(), g=torch.rand(T, ho, device=DEV) * 0.5 + 0.5,
                beta=torch.rand(T * n, ho, device=DEV), num_householder=n, cu_seqlens=cu_of(lens),
                initial_state=(torch.randn(len(lens), ho, V, K, device=DEV) * 0.1).to(state_dtype),
                use_qk_l2norm_in_kernel=l2norm)


def kda_inputs(lens, H, HV, K=128, V=128, state_dtype=torch.float32, raw=False):
    T = sum(lens)
    g = torch.randn(T, HV, K, device=DEV) if raw else -torch.rand(T, HV, K, device=DEV) * 0.5
    return dict(q=torch.randn(1, T, H, K, device=DEV).bfloat16(), k=torch.randn(1, T, H, K, device=DEV).bfloat16(),
                v=torch.randn(1, T, HV, V, device=DEV).bfloat16(), g=g[None].bfloat16(),
                beta=torch.rand(1, T, HV, device=DEV).bfloat16(), cu_seqlens=cu_of(lens),
                initial_state=(torch.randn(len(lens), HV, V, K, device=DEV) * 0.1).to(state_dtype))


def _cudnn_accepts(fn, kw):
    """Run ``fn`` (a cuDNN path); None when cuDNN is missing or declines the graph."""
    if not cudnn_available():
        return None
    try:
        return fn(**kw)
    except NotImplementedError as e:
        assert "backend='cute'" in str(e)
        return None


def cross_check(op, kw, *, tol_o=TOL_O, tol_s=TOL_S32):
    """The same inputs through ``cute``, ``cudnn`` (where accepted) and the oracle; outputs and final states
    NaN-poisoned first.  Returns the backends that ran."""
    fn = getattr(api, op)
    ref = getattr(rd, op)
    T = kw["q"].shape[-3]
    ho = max(kw["q"].shape[-2], kw["v"].shape[-2])
    V, K = kw["v"].shape[-1], kw["q"].shape[-1]
    n = kw["cu_seqlens"].shape[0] - 1
    sdt = kw["initial_state"].dtype if kw.get("initial_state") is not None else torch.float32
    o_ref, s_ref = ref(**kw, output_final_state=True)
    ran = []
    for backend in ("cute", "cudnn"):
        out, st = nan((T, ho, V), kw["q"].dtype), nan((n, ho, V, K), sdt)
        call = lambda **c: fn(**kw, **c)  # noqa: E731
        if backend == "cudnn":
            res = _cudnn_accepts(call, dict(output=out, output_state=st, output_final_state=True, backend="cudnn"))
            if res is None:
                continue
        else:
            res = call(output=out, output_state=st, output_final_state=True, backend="cute")
        o, s = res
        assert o is out and s is st
        lim_o, lim_s = (TOL_CUDNN, TOL_CUDNN) if backend == "cudnn" else (tol_o, tol_s)
        assert rel(o, o_ref) < lim_o, backend
        assert rel(s, s_ref) < lim_s, backend
        if K == V and kw.get("initial_state") is not None:
            assert rel(s.transpose(-1, -2), s_ref) > 0.1  # orientation pinned (K == V hides a transpose)
        ran.append(backend)
    return ran


# ---------------------------------------------------------------------------- GDN-2
@pytest.mark.parametrize("heads", [(2, 2, 4), (4, 2, 2)])  # GVA, GQA
@pytest.mark.parametrize("dims", [(128, 128), (64, 64), (64, 128)])
def test_gdn2_vs_oracle(heads, dims):
    K, V = dims
    kw = gdn2_inputs(LENS + LONG[:1], *heads, K=K, V=V, l2norm=heads == (4, 2, 2))
    assert "cute" in cross_check("chunk_gated_delta_rule2", kw, tol_s=TOL_SC)


def test_gdn2_long_bf16_state_and_16bit_gates():
    kw = gdn2_inputs([3, 4097, 0, 17], 2, 2, 4, state_dtype=torch.bfloat16, g_dtype=torch.bfloat16)
    kw["beta"] = kw["beta"].bfloat16()
    cross_check("chunk_gated_delta_rule2", kw, tol_s=TOL_S16)


def test_gdn2_defaults_are_the_ungated_rule():
    kw = gdn2_inputs(LENS, 2, 2, 4)
    base = {k: kw[k] for k in ("q", "k", "v", "cu_seqlens", "initial_state")}
    a = api.chunk_gated_delta_rule2(**base, backend="cute")
    b = api.chunk_gated_delta_rule2(**base, g=torch.zeros_like(kw["g"]), beta=torch.ones_like(kw["beta"]),
                                    w=torch.ones_like(kw["w"]), backend="cute")
    c = gapi.chunk_gated_delta_rule(**base)  # GDN with alpha = beta = 1
    assert torch.equal(a, b) and rel(a, c) < TOL_O
    assert rel(a, rg.chunk_gated_delta_rule(**base)) < TOL_O


def test_gdn2_fixed_length_equals_one_sequence_and_auto_on_hopper():
    kw = gdn2_inputs([77], 2, 2, 2)
    o1 = api.chunk_gated_delta_rule2(**kw, backend="cute")
    o2 = api.chunk_gated_delta_rule2(**{**kw, "q": kw["q"][None], "k": kw["k"][None], "v": kw["v"][None]},
                                     backend="cute")
    assert o2.shape == (1,) + o1.shape and torch.equal(o2[0], o1)
    if SM90:  # cuDNN has no GDN-2 engine on Hopper: auto serves it with our kernel
        assert torch.equal(api.chunk_gated_delta_rule2(**kw), o1)


# ---------------------------------------------------------------------------- GDP
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("heads", [(2, 2, 4), (4, 2, 2)])
def test_gdp_vs_oracle(n, heads):
    kw = gdp_inputs(LENS + LONG[:1], n, *heads, l2norm=heads == (4, 2, 2))
    assert "cute" in cross_check("chunk_gated_delta_product", kw, tol_s=TOL_SC)  # the chunked kernel's MMA state


def test_gdp_long_and_bf16_state():
    kw = gdp_inputs([4097, 5], 2, 2, 2, 4, state_dtype=torch.bfloat16)
    cross_check("chunk_gated_delta_product", kw, tol_s=TOL_S16)


def test_gdp_one_update_is_gdn_and_alpha_one_is_ungated():
    kw = gdp_inputs(LENS, 1, 2, 2, 4)
    a = api.chunk_gated_delta_product(**kw, backend="cute")
    gd = {k: kw[k] for k in ("q", "k", "v", "g", "beta", "cu_seqlens", "initial_state")}
    assert rel(a, gapi.chunk_gated_delta_rule(**gd)) < TOL_O
    kw2 = gdp_inputs(LENS, 2, 2, 2, 4)
    ones = api.chunk_gated_delta_product(**{**kw2, "g": torch.ones_like(kw2["g"])}, backend="cute")
    none = api.chunk_gated_delta_product(**{**kw2, "g": None}, backend="cute")
    assert torch.equal(ones, none)


# ---------------------------------------------------------------------------- KDA
@pytest.mark.parametrize("heads", [(2, 2), (2, 8)])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_kda_prefill_vs_oracle_in_place(heads, state_dtype):
    kw = kda_inputs(LENS + LONG, *heads, state_dtype=state_dtype)
    h0 = kw["initial_state"]
    ref_state = h0.double()
    o_ref, _ = rd.recurrent_kda(**{**kw, "initial_state": ref_state})
    out = nan(tuple(kw["v"].shape), torch.bfloat16)
    o, s = api.recurrent_kda(**kw, output=out)
    assert o is out and s is None  # the state is advanced in place; only the return is gated
    assert rel(o, o_ref) < TOL_O
    assert rel(h0, ref_state) < (TOL_SC if state_dtype == torch.float32 else TOL_S16)
    assert rel(h0.transpose(-1, -2), ref_state) > 0.1


@pytest.mark.parametrize("dims", [(64, 128), (128, 64)])
def test_kda_k_not_v(dims):
    K, V = dims
    kw = kda_inputs([17, 0, 65, 300], 2, 4, K=K, V=V)
    ref_state = kw["initial_state"].double()
    o_ref, _ = rd.recurrent_kda(**{**kw, "initial_state": ref_state})
    o, _ = api.recurrent_kda(**kw)
    assert rel(o, o_ref) < TOL_O and rel(kw["initial_state"], ref_state) < TOL_SC


def test_kda_safe_gate_logits_and_no_state():
    kw = kda_inputs([5, 0, 64, 65, 333], 2, 4, raw=True)
    A_log, dt_bias = torch.rand(4, device=DEV) - 0.5, torch.randn(4 * 128, device=DEV) * 0.5
    kw["beta"] = torch.randn_like(kw["beta"])
    extra = dict(A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True)
    kw.pop("initial_state")
    o, fin = api.recurrent_kda(**kw, **extra, output_final_state=True)
    o_ref, f_ref = rd.recurrent_kda(**kw, **extra, output_final_state=True)
    assert fin.dtype == torch.float32 and rel(o, o_ref) < TOL_O and rel(fin, f_ref) < TOL_SC
    o2, _ = api.recurrent_kda(**kw, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True)  # softplus gate
    o2_ref, _ = rd.recurrent_kda(**kw, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True)
    assert rel(o2, o2_ref) < TOL_O


def test_kda_zero_gate_is_the_ungated_rule_and_fixed_length_matches_packed():
    kw = kda_inputs([40, 40, 40], 2, 2)
    kw["k"] = unit(kw["k"].float()).bfloat16()  # unit keys: the rule without the l2 norm stays bounded
    zero = dict(kw, g=torch.zeros_like(kw["g"]), initial_state=kw["initial_state"].clone())
    o, _ = api.recurrent_kda(**zero, use_qk_l2norm_in_kernel=False)
    T = 120
    beta = kw["beta"][0].float()
    o_gdn = gapi.chunk_gated_delta_rule(kw["q"][0], kw["k"][0], kw["v"][0], None, beta, scale=1 / math.sqrt(128),
                                        initial_state=kw["initial_state"], cu_seqlens=kw["cu_seqlens"])
    assert rel(o[0], o_gdn) < TOL_O and o.shape == (1, T, 2, 128)
    batched = {k: (v.reshape(3, 40, *v.shape[2:]) if k in ("q", "k", "v", "g", "beta") else v)
               for k, v in kw.items() if k != "cu_seqlens"}
    st_b, st_p = kw["initial_state"].clone(), kw["initial_state"].clone()
    ob, _ = api.recurrent_kda(**{**batched, "initial_state": st_b})
    op, _ = api.recurrent_kda(**{**kw, "initial_state": st_p})
    assert torch.equal(ob.reshape(op.shape), op) and torch.equal(st_b, st_p)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_kda_decode_pools(state_dtype):
    B, H, HV = 48, 2, 8
    q = torch.randn(B, 1, H, 128, device=DEV).bfloat16()
    k = torch.randn(B, 1, H, 128, device=DEV).bfloat16()
    v = torch.randn(B, 1, HV, 128, device=DEV).bfloat16()
    g = (-torch.rand(B, 1, HV, 128, device=DEV) * 0.5).bfloat16()
    beta = torch.rand(B, 1, HV, device=DEV).bfloat16()
    pool = (torch.randn(2 * B, HV, 128, 128, device=DEV) * 0.1).to(state_dtype)
    idx = torch.randperm(2 * B, device=DEV)[:B].int()
    ref_pool = pool.double()
    untouched = torch.ones(2 * B, dtype=torch.bool, device=DEV)
    untouched[idx.long()] = False
    before = pool[untouched].clone()
    out = nan((B, 1, HV, 128), torch.bfloat16)
    o, p = api.recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx, output=out,
                             output_final_state=True)
    o_ref, _ = rd.recurrent_kda(q, k, v, g, beta, initial_state=ref_pool, ssm_state_indices=idx)
    tol = TOL_S32 if state_dtype == torch.float32 else TOL_S16
    assert o is out and p is pool and rel(o, o_ref) < TOL_O and rel(pool, ref_pool) < tol
    assert torch.equal(pool[untouched], before)
    # a read-only source pool; the final state lands in initial_state
    src = (torch.randn(B + 3, HV, 128, 128, device=DEV) * 0.1).to(state_dtype)
    src_idx = torch.randperm(B + 3, device=DEV)[:B].int()
    src_before = src.clone()
    dst = nan((B, HV, 128, 128), state_dtype)
    o, _ = api.recurrent_kda(q, k, v, g, beta, initial_state=dst, initial_state_source=src,
                             initial_state_indices=src_idx)
    ref_dst = torch.zeros(B, HV, 128, 128, device=DEV, dtype=torch.float64)
    o_ref, _ = rd.recurrent_kda(q, k, v, g, beta, initial_state=ref_dst, initial_state_source=src.double(),
                                initial_state_indices=src_idx)
    assert torch.equal(src, src_before) and rel(o, o_ref) < TOL_O and rel(dst, ref_dst) < tol
    frozen = pool.clone()
    o3, s3 = api.recurrent_kda(q, k, v, g, beta, initial_state=frozen, ssm_state_indices=idx,
                               disable_state_update=True)
    assert s3 is None and torch.equal(frozen, pool)


# ---------------------------------------------------------------------------- cuDNN
needs_cudnn = pytest.mark.skipif(not cudnn_available(), reason="cudnn-frontend not importable")


@needs_cudnn
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_cudnn_recurrent_kda_vs_oracle(state_dtype):
    """cuDNN's KDA engines (on SM90 its Hopper engines) against the oracle, T not a multiple of the chunk."""
    kw = kda_inputs([1, 15, 17, 63, 65, 1000, 4097], 2, 4, state_dtype=state_dtype)
    h0 = kw["initial_state"]
    ref_state = h0.double()
    o_ref, _ = rd.recurrent_kda(**{**kw, "initial_state": ref_state})
    out = nan(tuple(kw["v"].shape), torch.bfloat16)
    o, s = cl.cudnn_recurrent_kda(**kw, output=out, output_final_state=True)
    assert s is h0 and s.dtype == state_dtype  # advanced in place, in its dtype
    assert rel(o, o_ref) < TOL_CUDNN and rel(h0, ref_state) < TOL_CUDNN
    assert rel(h0.transpose(-1, -2), ref_state) > 0.1
    # the routed call: backend="cudnn" agrees, "auto" never picks cuDNN for KDA
    kw2 = kda_inputs([300, 77], 2, 4)
    o_c, _ = api.recurrent_kda(**{**kw2, "initial_state": kw2["initial_state"].clone()}, backend="cudnn")
    o_a, _ = api.recurrent_kda(**{**kw2, "initial_state": kw2["initial_state"].clone()})
    o_k, _ = api.recurrent_kda(**{**kw2, "initial_state": kw2["initial_state"].clone()}, backend="cute")
    assert torch.equal(o_a, o_k) and rel(o_c, o_k) < TOL_CUDNN


@needs_cudnn
def test_cudnn_recurrent_kda_safe_gate_and_separate_output_state():
    kw = kda_inputs([33, 200], 2, 2, raw=True)
    A_log, dt_bias = torch.rand(2, device=DEV) - 0.5, torch.randn(2 * 128, device=DEV) * 0.5
    h0 = kw["initial_state"]
    before = h0.clone()
    st = nan(tuple(h0.shape), torch.float32)
    extra = dict(A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True, lower_bound=-5.0)
    o, s = cl.cudnn_recurrent_kda(**kw, **extra, output_state=st, output_final_state=True)
    o_ref, s_ref = rd.recurrent_kda(**{**kw, "initial_state": before.clone()}, **extra, output_final_state=True)
    assert s is st and torch.equal(h0, before)  # output_state given: initial_state untouched
    assert rel(o, o_ref) < TOL_CUDNN and rel(st, s_ref) < TOL_CUDNN


@needs_cudnn
@pytest.mark.skipif(not SM90, reason="the decline is SM90's (cuDNN's GDN / GDN-2 / GDP engines are SM100-family)")
@pytest.mark.parametrize("op", ["cudnn_chunk_gated_delta_rule", "cudnn_chunk_gated_delta_rule2",
                                "cudnn_chunk_gated_delta_product"])
def test_cudnn_gdn_family_declines_on_hopper(op):
    if op == "cudnn_chunk_gated_delta_product":
        kw = gdp_inputs([40, 9], 2, 2, 2, 2)
    else:
        kw = gdn2_inputs([40, 9], 2, 2, 2)
        if op == "cudnn_chunk_gated_delta_rule":
            kw.pop("w")
            kw["g"], kw["beta"] = torch.rand(49, 2, device=DEV), torch.rand(49, 2, device=DEV)
    with pytest.raises(NotImplementedError) as e:
        getattr(cl, op)(**kw, output_final_state=True)
    msg = str(e.value)
    for part in (op.replace("cudnn_", ""), "engine decision", "sm_90", "cuDNN", "cudnn-frontend", "backend='cute'"):
        assert part in msg, (part, msg)
    # the public op with backend="cudnn" says the same; "auto" runs our kernel
    if op == "cudnn_chunk_gated_delta_rule":
        with pytest.raises(NotImplementedError, match="backend='cute'"):
            gapi.chunk_gated_delta_rule(**kw, backend="cudnn")
    else:
        fn = getattr(api, op.replace("cudnn_", ""))
        with pytest.raises(NotImplementedError, match="backend='cute'"):
            fn(**kw, backend="cudnn")
        assert torch.isfinite(fn(**kw)).all()
