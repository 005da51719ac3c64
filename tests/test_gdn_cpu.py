"""CPU tests of the gated delta rule: the oracles against each other and an independent loop, the API's
validation (every rule raises before a launch), planning, and the recurrent kernel's PTX for sm_90a / sm_100a."""

import dataclasses
import glob
import math
import re

import pytest
import torch

from cutedsl_attn.ref import gdn as rg

torch.set_default_dtype(torch.float32)


# ---------------------------------------------------------------------------- an independent loop
def python_loop(q, k, v, g, beta, cu, h0, scale, l2norm=False, log_gate=False):
    """Plain-Python float loop in the operational order (decay, delta, update, readout), V-major state."""
    T, hq, K = q.shape
    hk, hv, V = k.shape[1], v.shape[1], v.shape[2]
    ho = max(hq, hv)
    ql, kl, vl = q.tolist(), k.tolist(), v.tolist()
    out = [[[0.0] * V for _ in range(ho)] for _ in range(T)]
    finals = []
    for n in range(len(cu) - 1):
        fin_n = []
        for o in range(ho):
            H = [[0.0] * K for _ in range(V)] if h0 is None else [list(r) for r in h0[n][o].tolist()]
            for t in range(cu[n], cu[n + 1]):
                qt = ql[t][o // (ho // hq)]
                kt = kl[t][o // (ho // hk)]
                vt = vl[t][o // (ho // hv)]
                if l2norm:
                    rq = 1.0 / math.sqrt(sum(x * x for x in qt) + 1e-6)
                    rk = 1.0 / math.sqrt(sum(x * x for x in kt) + 1e-6)
                    qt = [x * rq for x in qt]
                    kt = [x * rk for x in kt]
                a = 1.0 if g is None else float(g[t][o])
                if log_gate:
                    a = math.exp(a)
                b = 1.0 if beta is None else float(beta[t][o])
                H = [[a * x for x in row] for row in H]
                for i in range(V):
                    u = b * (vt[i] - sum(H[i][j] * kt[j] for j in range(K)))
                    H[i] = [H[i][j] + u * kt[j] for j in range(K)]
                out[t][o] = [scale * sum(H[i][j] * qt[j] for j in range(K)) for i in range(V)]
            fin_n.append(H)
        finals.append(fin_n)
    return torch.tensor(out, dtype=torch.float64), torch.tensor(finals, dtype=torch.float64)


def make(lens, hq, hk, hv, K, V, *, seed=0, init=True, normalize_k=True):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    ho = max(hq, hv)
    q = torch.randn(T, hq, K, generator=gen, dtype=torch.float64)
    k = torch.randn(T, hk, K, generator=gen, dtype=torch.float64)
    if normalize_k:
        k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(T, hv, V, generator=gen, dtype=torch.float64)
    g = torch.rand(T, ho, generator=gen, dtype=torch.float64) * 0.6 + 0.4
    beta = torch.rand(T, ho, generator=gen, dtype=torch.float64)
    cu = [0]
    for L in lens:
        cu.append(cu[-1] + L)
    h0 = torch.randn(len(lens), ho, V, K, generator=gen, dtype=torch.float64) * 0.3 if init else None
    return q, k, v, g, beta, torch.tensor(cu), h0


def rel(a, b):
    return ((a.double() - b.double()).norm() / max(b.double().norm(), 1e-30)).item()


@pytest.mark.parametrize("heads", [(1, 1, 2), (2, 1, 1), (1, 1, 1)])  # GVA, GQA, MHA
@pytest.mark.parametrize("l2norm", [False, True])
def test_serial_oracle_matches_python_loop(heads, l2norm):
    hq, hk, hv = heads
    lens = [0, 1, 5, 3]
    q, k, v, g, beta, cu, h0 = make(lens, hq, hk, hv, 4, 3, seed=1)
    o, s = rg.chunk_gated_delta_rule(q, k, v, g, beta, scale=0.7, initial_state=h0, output_final_state=True,
                                     cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm)
    o_ref, s_ref = python_loop(q, k, v, g.tolist(), beta.tolist(), cu.tolist(), h0, 0.7, l2norm=l2norm)
    assert o.dtype == torch.float64 and o.shape == (sum(lens), max(hq, hv), 3)
    assert torch.allclose(o, o_ref, atol=1e-12, rtol=1e-12)
    assert torch.allclose(s, s_ref, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("heads", [(2, 2, 4), (4, 2, 2)])
@pytest.mark.parametrize("chunk_size", [64, 16])
def test_chunked_matches_serial(heads, chunk_size):
    lens = [0, 1, 63, 64, 65, 130]
    q, k, v, g, beta, cu, h0 = make(lens, *heads, 16, 8, seed=2)
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o1, s1 = rg.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    o2, s2 = rg.chunk_gated_delta_rule(q, k, v, g, beta, method="chunked", chunk_size=chunk_size, **kw)
    assert o2.dtype == torch.float32
    assert rel(o2, o1) < 1e-5 and rel(s2, s1) < 1e-5


def test_chunked_strong_decay_and_zero_alpha_stay_finite():
    q, k, v, g, beta, cu, h0 = make([70], 1, 1, 2, 8, 8, seed=3)
    g = g * 0.05
    g[10] = 0.0  # alpha = 0 resets the state: the chunked form floors it at 1e-10 (finite logs)
    o1, s1 = rg.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o2, s2 = rg.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                       method="chunked")
    assert torch.isfinite(o2).all() and rel(o2, o1) < 1e-4 and rel(s2, s1) < 1e-4


def test_alpha_one_is_ungated_delta_rule():
    q, k, v, g, beta, cu, h0 = make([9, 4], 1, 1, 2, 4, 4, seed=4)
    ones = torch.ones_like(g)
    a = rg.chunk_gated_delta_rule(q, k, v, ones, beta, initial_state=h0, cu_seqlens=cu)
    b = rg.chunk_gated_delta_rule(q, k, v, None, beta, initial_state=h0, cu_seqlens=cu)
    c, _ = python_loop(q, k, v, None, beta.tolist(), cu.tolist(), h0, 0.5)
    assert torch.equal(a, b)
    assert torch.allclose(a, c, atol=1e-12)
    # the gate changes the result (the comparison is not vacuous)
    assert rel(rg.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu), a) > 1e-3


def test_zero_initial_state_equals_none_and_empty_sequence_keeps_state():
    q, k, v, g, beta, cu, h0 = make([0, 7, 0, 3], 2, 2, 2, 4, 4, seed=5)
    a, sa = rg.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros_like(h0), cu_seqlens=cu,
                                      output_final_state=True)
    b, sb = rg.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
    assert torch.equal(a, b) and torch.equal(sa, sb)
    _, s = rg.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, output_final_state=True)
    assert torch.equal(s[0], h0[0]) and torch.equal(s[2], h0[2])
    assert not torch.equal(s[1], h0[1])


def test_log_and_linear_gate_domains_agree():
    q, k, v, g, beta, cu, h0 = make([12, 5], 1, 1, 2, 4, 4, seed=6)
    for method in ("serial", "chunked"):
        a = rg.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, method=method)
        b = rg.chunk_gated_delta_rule(q, k, v, torch.log(g), beta, initial_state=h0, cu_seqlens=cu,
                                      gate_domain="log", method=method)
        assert rel(b, a) < 1e-6


def test_l2norm_flag_equals_prenormalised_inputs():
    q, k, v, g, beta, cu, h0 = make([6, 6], 1, 1, 2, 8, 4, seed=7, normalize_k=False)
    a = rg.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    qn = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    kn = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    b = rg.chunk_gated_delta_rule(qn, kn, v, g, beta, initial_state=h0, cu_seqlens=cu)
    assert torch.allclose(a, b, atol=1e-13)


def test_gqa_equals_explicit_head_expansion():
    q, k, v, g, beta, cu, h0 = make([5, 8], 4, 2, 2, 4, 4, seed=8)
    a = rg.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    b = rg.chunk_gated_delta_rule(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), g, beta,
                                  initial_state=h0, cu_seqlens=cu)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="GVA"):
        rg.chunk_gated_delta_rule(q, k[:, :1].repeat(1, 3, 1), v, g, beta, cu_seqlens=cu)


def test_state_pool_rows_and_leading_batch_dim():
    q, k, v, g, beta, cu, h0 = make([3, 0, 4], 1, 1, 2, 4, 4, seed=9)
    pool = torch.randn(6, 2, 4, 4, dtype=torch.float64)
    idx = torch.tensor([4, 0, 2])
    out_pool = pool.clone()
    o, s = rg.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool, state_indices=idx, cu_seqlens=cu,
                                     output_state=out_pool, output_final_state=True)
    o2, s2 = rg.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool[idx], cu_seqlens=cu,
                                       output_final_state=True)
    assert s is out_pool and torch.equal(o, o2)
    assert torch.equal(out_pool[idx], s2) and torch.equal(out_pool[[1, 3, 5]], pool[[1, 3, 5]])
    o3 = rg.chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], initial_state=pool[idx],
                                   cu_seqlens=cu)
    assert o3.shape == (1,) + o2.shape and torch.equal(o3[0], o2)


# ---------------------------------------------------------------------------- API validation
api = pytest.importorskip("cutedsl_attn.api.gdn")
dapi = pytest.importorskip("cutedsl_attn.api.gdn_decode")
CUDA_ONLY = "CUDA tensors"  # every valid CPU call ends here, after all other checks


def inputs(T=8, hq=2, hk=2, hv=4, K=64, V=64, n=2):
    q = torch.randn(T, hq, K).bfloat16()
    k = torch.randn(T, hk, K).bfloat16()
    v = torch.randn(T, hv, V).bfloat16()
    ho = max(hq, hv)
    g = torch.rand(T, ho) * 0.5 + 0.5
    beta = torch.rand(T, ho)
    cu = torch.tensor([0, 3, T], dtype=torch.int32) if n == 2 else torch.tensor([0, T], dtype=torch.int32)
    return dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu)


def call(**over):
    kw = inputs()
    kw.update(over)
    return api.chunk_gated_delta_rule(**kw)


def test_valid_call_reaches_the_device_check():
    with pytest.raises(ValueError, match=CUDA_ONLY):
        call()
    st = torch.zeros(2, 4, 64, 64)
    with pytest.raises(ValueError, match=CUDA_ONLY):
        call(initial_state=st, output_final_state=True, gate_domain="log", g=-torch.rand(8, 4))
    with pytest.raises(ValueError, match=CUDA_ONLY):  # in-place pool update: the same tensor with state_indices
        pool = torch.zeros(5, 4, 64, 64)
        call(initial_state=pool, output_state=pool, state_indices=torch.tensor([3, 1]), output_final_state=True)


@pytest.mark.parametrize("over,exc,pattern", [
    (dict(backend="cudnn", state_indices=torch.tensor([0, 1])), NotImplementedError, "cudnn.*state_indices"),
    (dict(backend="triton"), ValueError, "backend"),
    (dict(use_cp=True), ValueError, CUDA_ONLY),  # served (context parallel): refused here only for CPU tensors
    (dict(use_cp="yes"), ValueError, "use_cp"),
    (dict(state_checkpoints=torch.zeros(1)), NotImplementedError, "checkpoint"),
    (dict(checkpoint_every_n_tokens=64), NotImplementedError, "checkpoint"),
    (dict(_cp_chunk_len=64), NotImplementedError, "_cp_chunk_len"),
    (dict(gate_domain="exp"), ValueError, "gate_domain"),
    (dict(q=[1, 2]), TypeError, "q must be a torch.Tensor"),
    (dict(state_indices=torch.tensor([0, 1])), ValueError, "state_indices needs initial_state or output_state"),
    (dict(g=torch.full((8, 4), 0.5), gate_domain="log"), ValueError, "log-space decay <= 0"),
    (dict(g=torch.full((8, 4), float("nan")), gate_domain="log"), ValueError, "log-space decay <= 0"),
])
def test_argument_errors(over, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call(**over)


def test_head_dims_not_served():
    with pytest.raises(NotImplementedError, match=r"served: K, V in \(64, 128\)"):
        api.chunk_gated_delta_rule(**inputs(K=96))
    with pytest.raises(NotImplementedError, match="V=32"):
        api.chunk_gated_delta_rule(**inputs(V=32))


def test_layout_dtype_device_errors():
    kw = inputs()
    with pytest.raises(ValueError, match="q must be bfloat16 or float16"):
        call(q=kw["q"].float(), k=kw["k"].float(), v=kw["v"].float())
    with pytest.raises(ValueError, match="k must have q's dtype"):
        call(k=kw["k"].half())
    with pytest.raises(ValueError, match="contiguous last dim"):
        call(q=torch.randn(8, 64, 2).bfloat16().transpose(1, 2))
    with pytest.raises(ValueError, match="multiples of 8"):
        call(q=torch.randn(8, 2, 65).bfloat16()[:, :, :64])
    with pytest.raises(ValueError, match="share T"):
        call(v=kw["v"][:7])
    with pytest.raises(ValueError, match="GVA"):
        call(k=torch.randn(8, 4, 64).bfloat16(), v=torch.randn(8, 3, 64).bfloat16())
    with pytest.raises(ValueError, match="g must be \\[T, HO\\]"):
        call(g=torch.rand(8, 2))
    with pytest.raises(ValueError, match="beta must be float32"):
        call(beta=torch.rand(8, 4).bfloat16())
    with pytest.raises(ValueError, match="must be on"):
        call(k=torch.empty(8, 2, 64, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(ValueError, match="V-major"):  # a K-major state of a K != V problem
        api.chunk_gated_delta_rule(**inputs(K=64, V=128), initial_state=torch.zeros(2, 4, 64, 128))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        call(initial_state=torch.zeros(2, 4, 64, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="N = 2 rows"):
        call(initial_state=torch.zeros(3, 4, 64, 64))
    with pytest.raises(ValueError, match="output must be a contiguous"):
        call(output=torch.empty(8, 4, 64))


@pytest.mark.parametrize("alpha", [-0.1, 1.5, float("nan")])
def test_linear_alpha_out_of_range(alpha):
    g = torch.rand(8, 4)
    g[5, 2] = alpha
    with pytest.raises(ValueError, match=r"alpha in \[0, 1\]"):
        call(g=g)


def test_log_space_gates_with_linear_domain_are_refused():
    with pytest.raises(ValueError, match="gate_domain='log'"):
        call(g=torch.log(torch.rand(8, 4) * 0.5 + 0.4))


def test_cu_seqlens_errors():
    kw = inputs()
    with pytest.raises(ValueError, match="cu_seqlens is required"):
        api.chunk_gated_delta_rule(kw["q"].view(2, 4, 2, 64), kw["k"].view(2, 4, 2, 64), kw["v"].view(2, 4, 4, 64))
    with pytest.raises(ValueError, match="non-decreasing"):
        call(cu_seqlens=torch.tensor([0, 5, 3, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="non-decreasing from 0 to T"):
        call(cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match="int32/int64"):
        call(cu_seqlens=torch.tensor([0.0, 8.0]))
    with pytest.raises(ValueError, match="max_seqlen"):
        call(max_seqlen=2)
    with pytest.raises(ValueError, match=CUDA_ONLY):
        call(max_seqlen=5)


def test_state_aliasing_and_pool_errors():
    st = torch.zeros(2, 4, 64, 64)
    with pytest.raises(ValueError, match="must not alias"):
        call(initial_state=st, output_state=st)
    big = torch.zeros(3, 4, 64, 64)
    with pytest.raises(ValueError, match="must not alias"):  # an overlapping view
        call(initial_state=big[:2], output_state=big[1:])
    pool = torch.zeros(5, 4, 64, 64)
    with pytest.raises(ValueError, match="unique"):
        call(initial_state=pool, output_state=pool, state_indices=torch.tensor([2, 2]))
    with pytest.raises(ValueError, match=r"in \[0, 5\)"):
        call(initial_state=pool, output_state=pool, state_indices=torch.tensor([1, 5]))
    with pytest.raises(ValueError, match="explicit output_state"):
        call(initial_state=pool, state_indices=torch.tensor([1, 2]), output_final_state=True)
    with pytest.raises(ValueError, match="1-D int32/int64 tensor of 2"):
        call(initial_state=pool, output_state=pool, state_indices=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="initial_state's dtype"):
        call(initial_state=st, output_state=torch.zeros(2, 4, 64, 64, dtype=torch.bfloat16))


def test_decode_validation():
    B, H, HV, K = 3, 2, 4, 64
    q = torch.randn(B, 1, H, K).bfloat16()
    k = torch.randn(B, 1, H, K).bfloat16()
    v = torch.randn(B, 1, HV, K).bfloat16()
    A_log, dt_bias = torch.zeros(HV), torch.zeros(HV)
    a, b = torch.randn(B, 1, HV), torch.randn(B, 1, HV)
    st = torch.zeros(B, HV, K, K)
    with pytest.raises(ValueError, match=CUDA_ONLY):
        api.gated_delta_rule_decode_pretranspose(q, k, v, st, A_log, a, dt_bias, b)
    with pytest.raises(ValueError, match="exactly one"):
        api.gated_delta_rule_decode_pretranspose(q, k, v, st, A_log, a, dt_bias, b, initial_state=st)
    with pytest.raises(ValueError, match="a must be"):
        api.gated_delta_rule_decode_pretranspose(q, k, v, st, A_log, a[:, :, :2], dt_bias, b)
    pool = torch.zeros(6, HV, K, K)
    with pytest.raises(ValueError, match="unique"):
        api.gated_delta_rule_decode_pretranspose(q, k, v, None, A_log, a, dt_bias, b, initial_state=pool,
                                                 initial_state_indices=torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="same sequence"):
        api.gated_delta_rule_decode_pretranspose(q, k, v, None, A_log, a, dt_bias, b, initial_state=pool,
                                                 initial_state_indices=torch.tensor([0, 1, 2]),
                                                 output_state_indices=torch.tensor([1, 3, 4]))
    with pytest.raises(ValueError, match="output_state_indices must be unique"):
        api.gated_delta_rule_decode_pretranspose(q, k, v, None, A_log, a, dt_bias, b, initial_state=pool,
                                                 initial_state_indices=torch.tensor([0, 1, 2]),
                                                 output_state_indices=torch.tensor([3, 3, 4]))
    with pytest.raises(ValueError, match="same sequence"):  # a shared read row one of the sharers writes
        api.gated_delta_rule_decode_pretranspose(q, k, v, None, A_log, a, dt_bias, b, initial_state=pool,
                                                 initial_state_indices=torch.tensor([0, 0, 1]),
                                                 output_state_indices=torch.tensor([0, 3, 4]))
    # two sequences forking from one read row, each writing its own: the checks pass (then the CPU refusal)
    with pytest.raises(ValueError, match=CUDA_ONLY):
        api.gated_delta_rule_decode_pretranspose(q, k, v, None, A_log, a, dt_bias, b, initial_state=pool,
                                                 initial_state_indices=torch.tensor([0, 0, 1]),
                                                 output_state_indices=torch.tensor([3, 4, 5]))
    with pytest.raises(NotImplementedError, match="served"):
        api.gated_delta_rule_decode_pretranspose(q[..., :32], k[..., :32], v[..., :32], st[..., :32, :32],
                                                 A_log, a, dt_bias, b)


@pytest.mark.parametrize("flag", ["output_final_state", "use_qk_l2norm_in_kernel"])
@pytest.mark.parametrize("value", ["no", 1, None])
@pytest.mark.parametrize("backend", ["auto", "cudnn"])
def test_non_bool_flags_are_refused(flag, value, backend):
    with pytest.raises(TypeError, match=f"{flag} must be a bool"):
        call(**{flag: value}, backend=backend)


def test_decode_non_bool_flag_is_refused():
    B, H, K = 2, 2, 64
    q, k, v = (torch.randn(B, 1, H, K).bfloat16() for _ in range(3))
    A_log, dt_bias, a, b = torch.zeros(H), torch.zeros(H), torch.randn(B, 1, H), torch.randn(B, 1, H)
    for fn in (api.gated_delta_rule_decode_pretranspose, api.gated_delta_rule_decode):
        with pytest.raises(TypeError, match="use_qk_l2norm must be a bool"):
            fn(q, k, v, torch.zeros(B, H, K, K), A_log, a, dt_bias, b, use_qk_l2norm="no")


def test_outputs_overlapping_inputs_are_refused():
    kw = inputs(hv=2)  # HO = Hq, V = K: output has q's shape
    for name in ("q", "k", "v"):
        with pytest.raises(ValueError, match=f"output must not overlap {name}"):
            api.chunk_gated_delta_rule(**kw, output=kw[name])
    buf = torch.zeros(8 * 2 * 64 + 8 * 2 * 64, dtype=torch.bfloat16)
    q_in_buf = buf[:8 * 2 * 64].view(8, 2, 64)
    with pytest.raises(ValueError, match="output must not overlap q"):  # a view into q's storage, offset
        api.chunk_gated_delta_rule(**{**kw, "q": q_in_buf}, output=buf[64:64 + 8 * 2 * 64].view(8, 2, 64))
    with pytest.raises(ValueError, match=CUDA_ONLY):  # disjoint halves of one buffer are fine
        api.chunk_gated_delta_rule(**{**kw, "q": q_in_buf}, output=buf[8 * 2 * 64:].view(8, 2, 64))
    st = torch.zeros(2, 2, 64, 64)
    with pytest.raises(ValueError, match="output_state must not overlap k"):  # k viewed from the state's bytes
        api.chunk_gated_delta_rule(**{**kw, "k": st.view(-1).view(torch.bfloat16)[:8 * 2 * 64].view(8, 2, 64)},
                                   output_state=st)
    with pytest.raises(ValueError, match="output_state must not overlap g"):
        api.chunk_gated_delta_rule(**{**kw, "g": st.view(-1)[:16].view(8, 2).fill_(0.5)}, output_state=st)
    with pytest.raises(ValueError, match="output must not overlap initial_state"):
        api.chunk_gated_delta_rule(**kw, initial_state=st, output=st.view(-1).view(torch.bfloat16)[:1024].view(
            8, 2, 64))
    with pytest.raises(ValueError, match="output must not overlap q"):  # the cuDNN route checks it too
        api.chunk_gated_delta_rule(**kw, output=kw["q"], backend="cudnn")


def test_decode_outputs_overlapping_inputs_are_refused():
    B, H, K = 2, 2, 64
    q, k, v = (torch.randn(B, 1, H, K).bfloat16() for _ in range(3))
    A_log, dt_bias, a, b = torch.zeros(H), torch.zeros(H), torch.randn(B, 1, H), torch.randn(B, 1, H)
    st = torch.zeros(B, H, K, K)
    for fn in (api.gated_delta_rule_decode_pretranspose, api.gated_delta_rule_decode):
        with pytest.raises(ValueError, match="output must not overlap q"):
            fn(q, k, v, st, A_log, a, dt_bias, b, output=q)
        with pytest.raises(ValueError, match="state must not overlap v"):
            fn(q, k, st.view(-1).view(torch.bfloat16)[:B * H * K].view(B, 1, H, K), st, A_log, a, dt_bias, b)
    pool = torch.zeros(4, H, K, K)
    with pytest.raises(ValueError, match="output must not overlap initial_state"):
        api.gated_delta_rule_decode_pretranspose(q, k, v, None, A_log, a, dt_bias, b, initial_state=pool,
                                                 initial_state_indices=torch.tensor([0, 1]),
                                                 output=pool.view(-1).view(torch.bfloat16)[:B * H * K].view(
                                                     B, 1, H, K))


@pytest.mark.parametrize("backend", ["flashinfer", "cake_gdn"])
def test_flashinfer_only_backends_are_not_served(backend):
    with pytest.raises(NotImplementedError, match=f"backend='{backend}' is not served.*'auto', 'cute'.*'cudnn'"):
        call(backend=backend)


def test_signature_is_flashinfers_with_keyword_only_gate_domain():
    import inspect
    params = inspect.signature(api.chunk_gated_delta_rule).parameters
    assert list(params)[:20] == [
        "q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "cu_seqlens",
        "use_qk_l2norm_in_kernel", "output", "output_state", "state_checkpoints", "checkpoint_cu_starts",
        "checkpoint_every_n_tokens", "use_cp", "state_indices", "_cp_chunk_len", "backend", "max_seqlen"]
    assert params["gate_domain"].kind is inspect.Parameter.KEYWORD_ONLY
    kw = inputs()
    args = [kw[n] for n in ("q", "k", "v", "g", "beta")] + [None, None, False, kw["cu_seqlens"]] + [None] * 11
    with pytest.raises(TypeError):  # a 21st positional (gate_domain) is refused
        api.chunk_gated_delta_rule(*args, "log")


def test_use_cp_accepts_only_auto_true_false():
    for bad in (0, "", None):
        with pytest.raises(ValueError, match="use_cp"):
            call(use_cp=bad)


def test_api_layer_does_not_import_compile():
    import pathlib
    for mod in ("gdn.py", "gdn_decode.py", "delta_family.py", "cudnn_linear.py"):
        text = (pathlib.Path(api.__file__).parent / mod).read_text()
        assert not re.search(r"from \.\.compile\b|import cutedsl_attn\.compile", text), mod


def test_decode_gates_formula():
    A_log = torch.tensor([0.3, -0.2])
    dt_bias = torch.tensor([0.1, 0.5])
    a = torch.randn(2, 1, 2)
    b = torch.randn(2, 1, 2)
    alpha, beta = dapi._decode_gates(A_log, a, dt_bias, b, 2, 1, 2, torch.device("cpu"))
    want = torch.exp(-torch.exp(A_log) * torch.log1p(torch.exp(a + dt_bias))).reshape(2, 2)
    assert torch.allclose(alpha, want, atol=1e-6) and torch.allclose(beta, torch.sigmoid(b).reshape(2, 2))


# ---------------------------------------------------------------------------- planning
from cutedsl_attn.planning.gdn import GdnProblem  # noqa: E402


def test_problem_and_config_rules():
    p = GdnProblem(dtype="bfloat16", head_dim_k=128, head_dim_v=128)
    with pytest.raises(TypeError):
        GdnProblem(dtype="bfloat16", head_dim_k=128.0, head_dim_v=128)
    for bad in (dict(dtype="float32"), dict(head_dim_k=96), dict(state_dtype="float16"), dict(gate_domain="exp"),
                dict(arch="sm_80")):
        with pytest.raises(ValueError):
            GdnProblem(**{**dict(dtype="bfloat16", head_dim_k=128, head_dim_v=128), **bad})
    rec = pytest.importorskip("cutedsl_attn.portable.gdn_recurrent")
    assert rec.NAME == "gdn_recurrent" and rec.unsupported_reason(p) is None
    t = rec.default_tiles(p, num_sms=132)
    assert 128 % t.tile_v == 0 and t.rows_per_lane in (1, 2, 4, 8)
    with pytest.raises(ValueError, match="columns a lane"):
        rec.Config(p, rec.Tiles(tile_v=32, num_warps=4, lanes_per_row=4))  # 32 columns a lane
    with pytest.raises(ValueError):
        rec.Tiles(tile_v=4, num_warps=4, lanes_per_row=16)  # half a row a lane group
    with pytest.raises(ValueError):
        rec.Tiles(tile_v=12, num_warps=4)
    with pytest.raises(ValueError):
        rec.Tiles(tile_v=64, num_warps=4)  # 16 rows a warp
    with pytest.raises(ValueError):
        rec.Tiles(prefetch=3)
    assert t.prefetch > 1  # prefill hides the load latency over a block of tokens
    assert rec.default_tiles(GdnProblem(dtype="bfloat16", head_dim_k=128, head_dim_v=128, decode=True),
                             num_sms=132).prefetch == 1
    from cutedsl_attn.dispatch import gdn_choice
    from cutedsl_attn.portable import gdn_chunked as chk
    mod, cfg = gdn_choice(p)  # prefill of GDN: a chunked kernel (on sm_90a the wgmma one)
    assert mod.NAME == ("gdn_chunked_sm90" if p.arch == "sm_90a" else "gdn_chunked") and cfg.problem == p
    p100 = dataclasses.replace(p, arch="sm_100a")
    assert gdn_choice(p100)[0] is chk
    pd = GdnProblem(dtype="bfloat16", head_dim_k=128, head_dim_v=128, decode=True)
    mod, cfg = gdn_choice(pd)  # the decode step: the recurrent kernel
    assert mod is rec and cfg.problem == pd and cfg.tiles == rec.default_tiles(pd, num_sms=132)


# ---------------------------------------------------------------------------- PTX
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("variant", ["fp32_state", "bf16_state_l2norm_log_d64", "k_major_decode_k128_v64"])
def test_recurrent_kernel_ptx(tmp_path, arch, variant):
    rec = pytest.importorskip("cutedsl_attn.portable.gdn_recurrent")
    if variant == "fp32_state":
        p = GdnProblem(dtype="bfloat16", head_dim_k=128, head_dim_v=128, arch=arch)
    elif variant == "bf16_state_l2norm_log_d64":
        p = GdnProblem(dtype="float16", head_dim_k=64, head_dim_v=64, state_dtype="bfloat16", gate_domain="log",
                       use_qk_l2norm=True, arch=arch)
    else:
        p = GdnProblem(dtype="bfloat16", head_dim_k=128, head_dim_v=64, use_qk_l2norm=True, decode=True,
                       state_k_major=True, arch=arch)
    cfg = rec.Config(p, rec.default_tiles(p, num_sms=132))
    rec.compile(cfg, keep_ptx_dir=str(tmp_path))
    (path,) = glob.glob(str(tmp_path / "*.ptx"))
    ptx = open(path).read()
    assert re.search(rf"\.target\s+{arch}", ptx)
    R = cfg.tiles.rows_per_lane
    n_red = 2 * R + (3 if p.use_qk_l2norm else 1)
    rounds = int(math.log2(cfg.tiles.lanes_per_row))
    assert ptx.count("shfl.sync.bfly") == rounds * n_red * cfg.tiles.prefetch  # one butterfly a token
    assert ".local" not in ptx  # the state slice stays in registers
    assert "ld.global.nc" in ptx  # q / k / v through the read-only path
    if p.state_dtype == "float32":
        assert "ld.global.v4.f32" in ptx and "st.global.v4.f32" in ptx
    else:
        assert "cvt.rn.bf16x2.f32" in ptx and "rsqrt.approx" in ptx and "ex2.approx" in ptx
    if p.state_k_major:  # R consecutive v of one k column a load (R = 4 fp32 here)
        assert cfg.tiles.rows_per_lane == 4 and cfg.tiles.prefetch == 1
    assert "wgmma" not in ptx and "tcgen05" not in ptx


# ---------------------------------------------------------------------------- API -> launch plumbing
def emulate_launch(problem, args, device_index=None):
    """The recurrent kernel's contract on GdnArgs, written out in float64 (no GPU): checks what the API passes."""
    from cutedsl_attn.planning import gdn as pg

    f = args.flags
    cu = args.cu_seqlens.tolist()
    ho, V = args.output.shape[1], args.output.shape[2]
    K = args.q.shape[2]
    for n in range(len(cu) - 1):
        for oh in range(ho):
            H = torch.zeros(V, K, dtype=torch.float64)
            if f & pg.FLAG_HAS_INITIAL_STATE:
                row = int(args.initial_state_indices[n]) if f & pg.FLAG_INITIAL_INDICES else n
                H = args.initial_state[row, oh].double().clone()
                H = H.t().contiguous() if problem.state_k_major else H
            for t in range(cu[n], cu[n + 1]):
                qt = args.q[t, oh // args.q_group].double()
                kt = args.k[t, oh // args.k_group].double()
                vt = args.v[t, oh // args.v_group].double()
                if problem.use_qk_l2norm:
                    qt = qt * torch.rsqrt((qt * qt).sum() + 1e-6)
                    kt = kt * torch.rsqrt((kt * kt).sum() + 1e-6)
                a = float(args.g[t, oh]) if f & pg.FLAG_HAS_G else 1.0
                a = math.exp(a) if (f & pg.FLAG_HAS_G and problem.gate_domain == "log") else a
                b = float(args.beta[t, oh]) if f & pg.FLAG_HAS_BETA else 1.0
                H = a * H
                u = b * (vt - H @ kt)
                H = H + u[:, None] * kt[None, :]
                args.output[t, oh] = (args.scale * (H @ qt)).to(args.output.dtype)
            if f & pg.FLAG_WRITE_STATE:
                row = int(args.output_state_indices[n]) if f & pg.FLAG_OUTPUT_INDICES else n
                args.output_state[row, oh] = (H.t() if problem.state_k_major else H).to(args.output_state.dtype)


@pytest.fixture
def emulated(monkeypatch):
    for mod in (api, dapi):  # the prefill's module and the decode step's
        monkeypatch.setattr(mod, "gdn_launch", emulate_launch)
        monkeypatch.setattr(mod, "_require_cuda", lambda device: None)
    monkeypatch.setattr(api, "gdn_arch", lambda device=None: "sm_90a")  # read by api._problem, decode's too


def bf(lens, hq, hk, hv, K=64, V=64, seed=0, pool=0):
    gen = torch.Generator().manual_seed(seed)
    T, ho = sum(lens), max(hq, hv)
    q = torch.randn(T, hq, K, generator=gen).bfloat16()
    k = torch.randn(T, hk, K, generator=gen)
    k = (k / k.norm(dim=-1, keepdim=True)).bfloat16()
    v = torch.randn(T, hv, V, generator=gen).bfloat16()
    g = torch.rand(T, ho, generator=gen) * 0.5 + 0.5
    beta = torch.rand(T, ho, generator=gen)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    h0 = torch.randn(pool or len(lens), ho, V, K, generator=gen) * 0.1
    return q, k, v, g, beta, cu, h0


@pytest.mark.parametrize("heads", [(1, 1, 2), (2, 1, 1)])
def test_api_plumbing_prefill(emulated, heads):
    q, k, v, g, beta, cu, h0 = bf([2, 0, 3], *heads)
    o, s = api.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                      use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = rg.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                             cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert rel(o, o_ref) < 1e-2 and rel(s, s_ref) < 1e-6
    # no gates, no state, log domain, scale
    o = api.chunk_gated_delta_rule(q, k, v, None, None, cu_seqlens=cu, scale=0.3)
    assert rel(o, rg.chunk_gated_delta_rule(q, k, v, cu_seqlens=cu, scale=0.3)) < 1e-2
    o = api.chunk_gated_delta_rule(q, k, v, torch.log(g), beta, cu_seqlens=cu, gate_domain="log")
    assert rel(o, rg.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)) < 1e-2


def test_api_plumbing_pools_and_bf16_state(emulated):
    q, k, v, g, beta, cu, pool = bf([2, 0, 3], 1, 1, 2, pool=6)
    idx = torch.tensor([5, 1, 3])
    before = pool.clone()
    o, s = api.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool, output_state=pool, state_indices=idx,
                                      output_final_state=True, cu_seqlens=cu)
    o_ref, s_ref = rg.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=before[idx], output_final_state=True,
                                             cu_seqlens=cu)
    assert s is pool and rel(s[idx], s_ref) < 1e-6 and torch.equal(s[[0, 2, 4]], before[[0, 2, 4]])
    assert torch.equal(s[1], before[1])  # the empty sequence keeps its row
    st16 = before[:3].bfloat16()
    o, s = api.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=st16, output_final_state=True, cu_seqlens=cu)
    assert s.dtype == torch.bfloat16 and rel(s, rg.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=st16, output_final_state=True, cu_seqlens=cu)[1]) < 1e-2


def test_api_plumbing_empty_batch_and_single_sequence(emulated):
    q, k, v, g, beta, cu, h0 = bf([4], 1, 1, 1)
    o = api.chunk_gated_delta_rule(q, k, v, g, beta)  # no cu_seqlens: one sequence
    assert rel(o, rg.chunk_gated_delta_rule(q, k, v, g, beta)) < 1e-2
    e = torch.empty(0, 1, 64).bfloat16()
    o, s = api.chunk_gated_delta_rule(e, e, e, cu_seqlens=torch.tensor([0, 0], dtype=torch.int32),
                                      initial_state=h0, output_final_state=True)
    assert o.shape == (0, 1, 64) and torch.equal(s, h0)


def test_api_plumbing_decode(emulated):
    B, H, HV, D = 3, 1, 2, 64
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, 1, H, D, generator=gen).bfloat16()
    k = torch.randn(B, 1, H, D, generator=gen).bfloat16()
    v = torch.randn(B, 1, HV, D, generator=gen).bfloat16()
    A_log, dt_bias = torch.rand(HV, generator=gen) - 1, torch.rand(HV, generator=gen)
    a, b = torch.randn(B, 1, HV, generator=gen), torch.randn(B, 1, HV, generator=gen)
    st = torch.randn(B, HV, D, D, generator=gen) * 0.1
    before = st.clone()
    o, s = api.gated_delta_rule_decode_pretranspose(q, k, v, st, A_log, a, dt_bias, b)
    alpha, beta = dapi._decode_gates(A_log, a, dt_bias, b, B, 1, HV, torch.device("cpu"))
    o_ref, s_ref = rg.chunk_gated_delta_rule(q[:, 0], k[:, 0], v[:, 0], alpha, beta, initial_state=before,
                                             cu_seqlens=torch.arange(B + 1), use_qk_l2norm_in_kernel=True,
                                             output_final_state=True)
    assert s is st and o.shape == (B, 1, HV, D) and rel(o[:, 0], o_ref) < 1e-2 and rel(st, s_ref) < 1e-6
    pool = torch.zeros(5, HV, D, D)
    pool[[4, 0, 2]] = before
    o2, p2 = api.gated_delta_rule_decode_pretranspose(q, k, v, None, A_log, a, dt_bias, b, initial_state=pool,
                                                      initial_state_indices=torch.tensor([4, 0, 2]))
    assert p2 is pool and torch.equal(o2, o) and torch.equal(pool[[4, 0, 2]], st)
    kmaj = before.transpose(-1, -2).contiguous()
    o3, s3 = api.gated_delta_rule_decode(q, k, v, kmaj, A_log, a, dt_bias, b)
    assert s3 is kmaj and torch.equal(o3, o) and torch.equal(kmaj.transpose(-1, -2), st)
    with pytest.raises(ValueError, match="K-major"):  # a V-major state of a K != V problem
        api.gated_delta_rule_decode(q, k, v[..., :32].repeat(1, 1, 1, 4)[..., :128], torch.zeros(B, HV, 128, 64),
                                    A_log, a, dt_bias, b)


# ---------------------------------------------------------------------------- decode scale and output checks
def decode_inputs(B=2, H=2, K=64):
    q, k, v = (torch.randn(B, 1, H, K).bfloat16() for _ in range(3))
    return dict(q=q, k=k, v=v, state=torch.zeros(B, H, K, K), A_log=torch.zeros(H), a=torch.randn(B, 1, H),
                dt_bias=torch.zeros(H), b=torch.randn(B, 1, H))


DECODE_FNS = [api.gated_delta_rule_decode_pretranspose, api.gated_delta_rule_decode]


@pytest.mark.parametrize("fn", DECODE_FNS)
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), "0.5", True, torch.tensor(0.5)])
def test_decode_scale_checked_as_prefill(fn, scale):
    with pytest.raises(ValueError, match="scale must be a finite float"):
        call(scale=scale)
    with pytest.raises(ValueError, match="scale must be a finite float"):
        fn(**decode_inputs(), scale=scale)


@pytest.mark.parametrize("fn", DECODE_FNS)
def test_decode_output_checked_as_prefill(fn):
    kw = decode_inputs()
    with pytest.raises(ValueError, match=r"output must be on cpu \(q's device\), got meta"):
        fn(**kw, output=torch.empty(2, 1, 2, 64, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(ValueError, match=r"output must be a contiguous \[B, T, HO, V\]"):
        fn(**kw, output=torch.empty(2, 1, 2, 128, dtype=torch.bfloat16)[..., :64])
    with pytest.raises(ValueError, match=r"output must be a contiguous .*bfloat16 tensor, got torch.float32"):
        fn(**kw, output=torch.empty(2, 1, 2, 64))
    with pytest.raises(ValueError, match=CUDA_ONLY):  # a good buffer reaches the device check
        fn(**kw, output=torch.empty(2, 1, 2, 64, dtype=torch.bfloat16))


def test_numpy_scale_and_max_seqlen_accepted():
    np = pytest.importorskip("numpy")
    with pytest.raises(ValueError, match=CUDA_ONLY):
        call(scale=np.float32(0.5), max_seqlen=np.int64(5))
    with pytest.raises(ValueError, match=CUDA_ONLY):
        call(max_seqlen=np.int32(8))
    for fn in DECODE_FNS:
        with pytest.raises(ValueError, match=CUDA_ONLY):
            fn(**decode_inputs(), scale=np.float64(0.25))
    for bad in (np.int64(2), np.float64(5.0), True, 5.0, "5"):
        with pytest.raises(ValueError, match="max_seqlen must be an int"):
            call(max_seqlen=bad)


def test_api_plumbing_scales_reach_the_launch(emulated, monkeypatch):
    np = pytest.importorskip("numpy")
    seen = []
    for mod in (api, dapi):
        monkeypatch.setattr(mod, "gdn_launch", lambda problem, args, device_index=None: seen.append(args.scale))
    api.chunk_gated_delta_rule(**inputs(), scale=np.float32(0.5), max_seqlen=np.int64(5))
    api.chunk_gated_delta_rule(**inputs(), scale=0)  # 0: FlashInfer's default 1 / sqrt(K)
    for fn in DECODE_FNS:
        fn(**decode_inputs(), scale=np.float32(0.25))
        fn(**decode_inputs())
    assert seen == [0.5, 0.125, 0.25, 0.125, 0.25, 0.125]
    assert all(type(s) is float for s in seen)


def test_prefill_kernel_choice_as_documented(emulated, monkeypatch):
    # the docstring's routing: prefill -> chunked, decode -> recurrent, CUTEDSL_ATTN_GDN_KERNEL forces one;
    # max_seqlen changes neither the problem nor the launch arguments
    from cutedsl_attn.dispatch import gdn_choice
    from cutedsl_attn.portable import gdn_chunked as chk
    from cutedsl_attn.portable import gdn_recurrent as recur
    planned = []
    for mod in (api, dapi):
        monkeypatch.setattr(mod, "gdn_launch", lambda problem, args, device_index=None: planned.append((problem,
                                                                                                       args)))
    kw = inputs()
    api.chunk_gated_delta_rule(**kw)
    api.chunk_gated_delta_rule(**kw, max_seqlen=5)
    (p0, a0), (p1, a1) = planned
    assert p0 == p1
    for name, x in a0._asdict().items():
        y = getattr(a1, name)
        if name in ("q", "k", "v", "g", "beta", "cu_seqlens"):
            assert torch.equal(x, y), name
        elif isinstance(x, torch.Tensor):  # buffers allocated per call
            assert x.shape == y.shape and x.dtype == y.dtype, name
        else:
            assert x == y, name
    api.gated_delta_rule_decode_pretranspose(**decode_inputs())
    pdec = planned[-1][0]
    monkeypatch.delenv("CUTEDSL_ATTN_GDN_KERNEL", raising=False)
    assert gdn_choice(p0)[0].NAME == "gdn_chunked_sm90" and gdn_choice(pdec)[0] is recur  # p0 on sm_90a
    assert gdn_choice(dataclasses.replace(p0, arch="sm_100a"))[0] is chk
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_KERNEL", "recurrent")
    assert gdn_choice(p0)[0] is recur
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_KERNEL", "chunked")
    assert gdn_choice(p0)[0] is chk
    assert gdn_choice(pdec)[0] is recur  # the decode step is outside the chunked kernels' family: kept automatic
    with pytest.raises(NotImplementedError, match="CUTEDSL_ATTN_GDN_KERNEL=chunked.*V-major"):
        gdn_choice(dataclasses.replace(p0, state_k_major=True))  # inside it, a problem it cannot serve raises
    doc = api.chunk_gated_delta_rule.__doc__
    for phrase in ("WY / UT form", "5e-3", "CUTEDSL_ATTN_GDN_KERNEL", "reaches neither kernel"):
        assert phrase in doc, phrase
