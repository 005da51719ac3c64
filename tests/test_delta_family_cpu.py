"""CPU tests of GDN-2, Gated DeltaProduct and KDA: the float64 oracles against independent plain-Python loops and
against each other (reductions to GDN), KDA's gates and in-place state, the APIs' validation and their launch
arguments (through a float64 emulation of the kernel's contract), the cuDNN entry points' signatures, and each
kernel variant's PTX for sm_90a / sm_100a."""

import glob
import inspect
import math
import re
import warnings

import pytest
import torch

from cutedsl_attn.ref import delta_family as rd
from cutedsl_attn.ref import gdn as rg

LENS = [0, 1, 15, 16, 17, 63, 64, 65]


# ---------------------------------------------------------------------------- independent loops (V-major lists)
def _norm(x):
    r = 1.0 / math.sqrt(sum(e * e for e in x) + 1e-6)
    return [e * r for e in x]


def loop(q, k, v, cu, h0, scale, *, decay=None, erase=None, write=None, beta=None, alpha=None, n_h=1, l2=False):
    """One head layout (HO heads, q/k/v already at HO heads), operational order: decay, delta, update, readout.
    ``decay[t][o]`` a list of K log gates; ``erase``/``write`` per-channel lists; ``beta[e][o]`` scalars;
    ``alpha[t][o]`` linear scalar gates (first sub-step); ``n_h`` sub-steps a token."""
    T, ho, K = len(q), len(q[0]), len(q[0][0])
    V = len(v[0][0])
    out = [[[0.0] * V for _ in range(ho)] for _ in range(T)]
    finals = []
    for n in range(len(cu) - 1):
        fin = []
        for o in range(ho):
            H = [[0.0] * K for _ in range(V)] if h0 is None else [list(r) for r in h0[n][o]]
            for t in range(cu[n], cu[n + 1]):
                qt = _norm(q[t][o]) if l2 else q[t][o]
                for j in range(n_h):
                    e = t * n_h + j
                    kt = _norm(k[e][o]) if l2 else k[e][o]
                    vt = v[e][o]
                    if decay is not None:
                        H = [[H[i][c] * math.exp(decay[t][o][c]) for c in range(K)] for i in range(V)]
                    if alpha is not None and j == 0:
                        H = [[alpha[t][o] * x for x in row] for row in H]
                    bk = kt if erase is None else [erase[t][o][c] * kt[c] for c in range(K)]
                    for i in range(V):
                        hk = sum(H[i][c] * bk[c] for c in range(K))
                        if write is not None:
                            u = write[t][o][i] * vt[i] - hk
                        else:
                            b = 1.0 if beta is None else beta[e][o]
                            u = b * (vt[i] - hk)
                        H[i] = [H[i][c] + u * kt[c] for c in range(K)]
                out[t][o] = [scale * sum(H[i][c] * qt[c] for c in range(K)) for i in range(V)]
            fin.append(H)
        finals.append(fin)
    return torch.tensor(out, dtype=torch.float64), torch.tensor(finals, dtype=torch.float64)


def cu_of(lens):
    c = [0]
    for L in lens:
        c.append(c[-1] + L)
    return torch.tensor(c)


def rnd(*shape, gen, scale=1.0):
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def unit(x):
    return x / x.norm(dim=-1, keepdim=True)


def rel(a, b):
    return ((a.double() - b.double()).norm() / max(b.double().norm(), 1e-30)).item()


# ---------------------------------------------------------------------------- oracles vs loops
@pytest.mark.parametrize("l2", [False, True])
def test_gdn2_oracle_matches_loop(l2):
    gen = torch.Generator().manual_seed(1)
    T, ho, K, V = sum(LENS), 2, 4, 3
    q, k, v = rnd(T, ho, K, gen=gen), unit(rnd(T, ho, K, gen=gen)), rnd(T, ho, V, gen=gen)
    g = -torch.rand(T, ho, K, generator=gen, dtype=torch.float64) * 0.3
    b = torch.rand(T, ho, K, generator=gen, dtype=torch.float64)
    w = torch.rand(T, ho, V, generator=gen, dtype=torch.float64) + 0.5
    h0 = rnd(len(LENS), ho, V, K, gen=gen, scale=0.3)
    cu = cu_of(LENS)
    o, s = rd.chunk_gated_delta_rule2(q, k, v, g, b, w, scale=0.6, initial_state=h0, output_final_state=True,
                                      cu_seqlens=cu, use_qk_l2norm_in_kernel=l2)
    o2, s2 = loop(q.tolist(), k.tolist(), v.tolist(), cu.tolist(), h0.tolist(), 0.6, decay=g.tolist(),
                  erase=b.tolist(), write=w.tolist(), l2=l2)
    assert o.dtype == torch.float64 and torch.allclose(o, o2, atol=1e-10) and torch.allclose(s, s2, atol=1e-10)


@pytest.mark.parametrize("n_h", [1, 2, 3])
def test_gdp_oracle_matches_loop(n_h):
    gen = torch.Generator().manual_seed(2)
    lens = [0, 1, 15, 17, 33]
    T, ho, K, V = sum(lens), 2, 4, 3
    q = rnd(T, ho, K, gen=gen)
    k, v = unit(rnd(T * n_h, ho, K, gen=gen)), rnd(T * n_h, ho, V, gen=gen)
    alpha = torch.rand(T, ho, generator=gen, dtype=torch.float64) * 0.5 + 0.5
    beta = torch.rand(T * n_h, ho, generator=gen, dtype=torch.float64)
    h0 = rnd(len(lens), ho, V, K, gen=gen, scale=0.3)
    cu = cu_of(lens)
    o, s = rd.chunk_gated_delta_product(q, k, v, alpha, beta, n_h, scale=0.5, initial_state=h0,
                                        output_final_state=True, cu_seqlens=cu)
    o2, s2 = loop(q.tolist(), k.tolist(), v.tolist(), cu.tolist(), h0.tolist(), 0.5, alpha=alpha.tolist(),
                  beta=beta.tolist(), n_h=n_h)
    assert torch.allclose(o, o2, atol=1e-10) and torch.allclose(s, s2, atol=1e-10)


def test_gdp_is_gdn_on_the_expanded_timeline():
    """GDP = GDN over the sub-token rows with the gate on sub-step 0 (1 elsewhere), read at the last sub-step."""
    gen = torch.Generator().manual_seed(3)
    lens, n_h = [3, 0, 5], 3
    T, K, V = sum(lens), 4, 4
    q = rnd(T, 1, K, gen=gen)
    k, v = unit(rnd(T * n_h, 1, K, gen=gen)), rnd(T * n_h, 2, V, gen=gen)
    alpha = torch.rand(T, 2, generator=gen, dtype=torch.float64) * 0.5 + 0.5
    beta = torch.rand(T * n_h, 2, generator=gen, dtype=torch.float64)
    h0 = rnd(3, 2, V, K, gen=gen)
    cu = cu_of(lens)
    o, s = rd.chunk_gated_delta_product(q, k, v, alpha, beta, n_h, initial_state=h0, output_final_state=True,
                                        cu_seqlens=cu)
    g_exp = torch.ones(T * n_h, 2, dtype=torch.float64)
    g_exp[::n_h] = alpha
    o_exp, s_exp = rg.chunk_gated_delta_rule(q.repeat_interleave(n_h, 0), k, v, g_exp, beta, initial_state=h0,
                                             output_final_state=True, cu_seqlens=cu * n_h)
    assert torch.allclose(o, o_exp[n_h - 1::n_h], atol=1e-12) and torch.allclose(s, s_exp, atol=1e-12)
    o1 = rd.chunk_gated_delta_product(q, k[::n_h], v[::n_h], alpha, beta[::n_h], 1, initial_state=h0, cu_seqlens=cu)
    assert torch.allclose(o1, rg.chunk_gated_delta_rule(q, k[::n_h], v[::n_h], alpha, beta[::n_h], initial_state=h0,
                                                        cu_seqlens=cu), atol=1e-12)


def kda_inputs(lens, H=1, HV=2, K=4, V=4, seed=4, raw=False):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k, v = rnd(T, H, K, gen=gen), rnd(T, H, K, gen=gen), rnd(T, HV, V, gen=gen)
    g = rnd(T, HV, K, gen=gen) if raw else -torch.rand(T, HV, K, generator=gen, dtype=torch.float64) * 0.4
    beta = torch.rand(T, HV, generator=gen, dtype=torch.float64)
    h0 = rnd(len(lens), HV, V, K, gen=gen, scale=0.3)
    return q, k, v, g, beta, cu_of(lens), h0


def test_kda_oracle_matches_loop():
    q, k, v, g, beta, cu, h0 = kda_inputs(LENS)
    before = h0.clone()
    o, s = rd.recurrent_kda(q, k, v, g, beta, scale=0.7, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    rep = lambda x: x.repeat_interleave(2, 1).tolist()  # noqa: E731 -- q / k heads shared by HV / H value heads
    o2, s2 = loop(rep(q), rep(k), v.tolist(), cu.tolist(), before.tolist(), 0.7, decay=g.tolist(),
                  beta=beta.tolist(), l2=True)
    assert s is h0 and torch.allclose(o, o2, atol=1e-10) and torch.allclose(h0, s2, atol=1e-10)


def test_zero_gates_are_the_ungated_rule():
    gen = torch.Generator().manual_seed(5)
    lens = [4, 0, 9]
    T, K, V = sum(lens), 4, 4
    q, k, v = rnd(T, 1, K, gen=gen), unit(rnd(T, 1, K, gen=gen)), rnd(T, 2, V, gen=gen)
    beta = torch.rand(T, 2, generator=gen, dtype=torch.float64)
    h0 = rnd(3, 2, V, K, gen=gen)
    cu = cu_of(lens)
    ungated = rg.chunk_gated_delta_rule(q, k, v, None, beta, initial_state=h0, cu_seqlens=cu)
    # GDN-2 with g = 0 and erase = write = beta broadcast
    o = rd.chunk_gated_delta_rule2(q, k, v, torch.zeros(T, 2, K), beta[..., None].expand(T, 2, K),
                                   beta[..., None].expand(T, 2, V), initial_state=h0, cu_seqlens=cu)
    assert torch.allclose(o, ungated, atol=1e-12)
    # GDP alpha = 1, one update
    assert torch.allclose(rd.chunk_gated_delta_product(q, k, v, torch.ones(T, 2), beta, 1, initial_state=h0,
                                                       cu_seqlens=cu), ungated, atol=1e-12)
    # KDA g = 0 (no l2 norm, so it is the same rule)
    o, _ = rd.recurrent_kda(q, k, v, torch.zeros(T, 2, K), beta, scale=0.5, initial_state=h0.clone(),
                            cu_seqlens=cu, use_qk_l2norm_in_kernel=False)
    assert torch.allclose(o, ungated, atol=1e-12)
    # a channel-constant KDA gate is GDN's log gate, and the gate changes the result
    gl = -torch.rand(T, 2, generator=gen, dtype=torch.float64)
    o, _ = rd.recurrent_kda(q, k, v, gl[..., None].expand(T, 2, K), beta, scale=0.5, initial_state=h0.clone(),
                            cu_seqlens=cu, use_qk_l2norm_in_kernel=False)
    want = rg.chunk_gated_delta_rule(q, k, v, gl, beta, initial_state=h0, cu_seqlens=cu, gate_domain="log")
    assert torch.allclose(o, want, atol=1e-12) and rel(o, ungated) > 1e-3


def test_gdn2_with_scalar_erase_write_is_kda():
    q, k, v, g, beta, cu, h0 = kda_inputs([7, 5], H=2, HV=2)
    T = q.shape[0]
    a = rd.chunk_gated_delta_rule2(q, k, v, g, beta[..., None].expand(T, 2, 4), beta[..., None].expand(T, 2, 4),
                                   initial_state=h0, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, scale=0.5)
    b, _ = rd.recurrent_kda(q, k, v, g, beta, initial_state=h0.clone(), cu_seqlens=cu, scale=0.5)
    assert torch.allclose(a, b, atol=1e-12)


def test_kda_gates():
    gen = torch.Generator().manual_seed(6)
    g = rnd(5, 2, 4, gen=gen, scale=3)
    A_log, dt_bias = rnd(2, gen=gen), rnd(8, gen=gen)
    x = g + dt_bias.reshape(2, 4)
    a = torch.exp(A_log)[:, None]
    want = -a * torch.log1p(torch.exp(x))
    assert torch.allclose(rd.kda_gate(g, A_log, dt_bias), want, atol=1e-12)
    safe = rd.kda_gate(g, A_log, dt_bias, lower_bound=-5.0)
    assert torch.allclose(safe, -5.0 / (1 + torch.exp(-a * x)), atol=1e-12)
    assert (safe >= -5.0).all() and (safe < 0).all()
    from cutedsl_attn.api.delta_family import kda_gate_fp32
    assert torch.allclose(kda_gate_fp32(g.float(), A_log.float(), dt_bias.float(), -5.0).double(), safe, atol=1e-5)
    assert torch.allclose(kda_gate_fp32(g.float(), A_log.float(), dt_bias.float(), None).double(), want, atol=1e-5)
    # the oracle's in-kernel gate and beta sigmoid equal passing the transformed values
    q, k, v, graw, blogit, cu, h0 = kda_inputs([6, 3], raw=True)
    A_log, dt_bias = rnd(2, gen=gen) * 0.3, rnd(2, 4, gen=gen)
    o1, s1 = rd.recurrent_kda(q, k, v, graw, blogit, A_log, dt_bias, initial_state=h0.clone(), cu_seqlens=cu,
                              use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True, output_final_state=True)
    o2, s2 = rd.recurrent_kda(q, k, v, rd.kda_gate(graw, A_log, dt_bias, -5.0), torch.sigmoid(blogit),
                              initial_state=h0.clone(), cu_seqlens=cu, output_final_state=True)
    assert torch.allclose(o1, o2, atol=1e-12) and torch.allclose(s1, s2, atol=1e-12)
    with pytest.raises(ValueError, match="A_log and dt_bias"):
        rd.recurrent_kda(q, k, v, graw, blogit, A_log, None, cu_seqlens=cu, use_gate_in_kernel=True)


def test_kda_in_place_state_semantics():
    q, k, v, g, beta, cu, h0 = kda_inputs([3, 0, 4])
    before = h0.clone()
    o, s = rd.recurrent_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    assert s is None and not torch.equal(h0, before) and torch.equal(h0[1], before[1])  # advanced, empty kept
    _, fin = rd.recurrent_kda(q, k, v, g, beta, initial_state=before.clone(), cu_seqlens=cu, output_final_state=True)
    assert torch.equal(fin, h0)
    frozen = before.clone()
    o2, s2 = rd.recurrent_kda(q, k, v, g, beta, initial_state=frozen, cu_seqlens=cu, disable_state_update=True)
    assert s2 is None and torch.equal(frozen, before) and torch.equal(o2, o)
    # a pool: rows ssm_state_indices; a read-only source pool
    pool = torch.zeros(6, 2, 4, 4, dtype=torch.float64)
    idx = torch.tensor([5, 0, 2])
    pool[idx] = before
    _, p = rd.recurrent_kda(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu, ssm_state_indices=idx,
                            output_final_state=True)
    assert p is pool and torch.equal(pool[idx], h0) and torch.equal(pool[[1, 3, 4]], torch.zeros(3, 2, 4, 4))
    src = torch.zeros(4, 2, 4, 4, dtype=torch.float64)
    src[[3, 1, 0]] = before
    dst = torch.zeros(3, 2, 4, 4, dtype=torch.float64)
    o3, _ = rd.recurrent_kda(q, k, v, g, beta, initial_state=dst, initial_state_source=src,
                             initial_state_indices=torch.tensor([3, 1, 0]), cu_seqlens=cu)
    assert torch.equal(o3, o) and torch.equal(dst, h0)
    # a fixed-length batch [B, T, ...] is B sequences
    qb, kb, vb, gb, bb = (x[:6].reshape(2, 3, *x.shape[1:]) for x in (q, k, v, g, beta))
    ob, sb = rd.recurrent_kda(qb, kb, vb, gb, bb, initial_state=before[:2].clone(), output_final_state=True)
    op_, sp = rd.recurrent_kda(q[:6], k[:6], v[:6], g[:6], beta[:6], initial_state=before[:2].clone(),
                               cu_seqlens=torch.tensor([0, 3, 6]), output_final_state=True)
    assert ob.shape == (2, 3, 2, 4) and torch.equal(ob.reshape(6, 2, 4), op_) and torch.equal(sb, sp)


# ---------------------------------------------------------------------------- API validation
api = pytest.importorskip("cutedsl_attn.api.delta_family")
gapi = pytest.importorskip("cutedsl_attn.api.gdn")
CUDA_ONLY = "CUDA tensors"


def gdn2_in(T=8, hq=2, hk=2, hv=4, K=64, V=64):
    ho = max(hq, hv)
    return dict(q=torch.randn(T, hq, K).bfloat16(), k=torch.randn(T, hk, K).bfloat16(),
                v=torch.randn(T, hv, V).bfloat16(), g=-torch.rand(T, ho, K), beta=torch.rand(T, ho, K),
                w=torch.rand(T, ho, V), cu_seqlens=torch.tensor([0, 3, T], dtype=torch.int32))


def gdp_in(T=6, n=2, K=64):
    return dict(q=torch.randn(T, 2, K).bfloat16(), k=torch.randn(T * n, 2, K).bfloat16(),
                v=torch.randn(T * n, 4, K).bfloat16(), g=torch.rand(T, 4), beta=torch.rand(T * n, 4),
                num_householder=n, cu_seqlens=torch.tensor([0, 2, T], dtype=torch.int32))


def kda_in(B=3, T=1, H=2, HV=4, K=64):
    return dict(q=torch.randn(B, T, H, K).bfloat16(), k=torch.randn(B, T, H, K).bfloat16(),
                v=torch.randn(B, T, HV, K).bfloat16(), g=-torch.rand(B, T, HV, K).bfloat16(),
                beta=torch.rand(B, T, HV).bfloat16())


def test_valid_calls_reach_the_device_check():
    for fn, kw in ((api.chunk_gated_delta_rule2, gdn2_in()), (api.chunk_gated_delta_product, gdp_in()),
                   (api.recurrent_kda, kda_in())):
        with pytest.raises(ValueError, match=CUDA_ONLY):
            fn(**kw)
    st = torch.zeros(3, 4, 64, 64)
    with pytest.raises(ValueError, match=CUDA_ONLY):
        api.recurrent_kda(**kda_in(), initial_state=st, ssm_state_indices=None, output_final_state=True)
    with pytest.raises(ValueError, match=CUDA_ONLY):
        api.recurrent_kda(**kda_in(), initial_state=torch.zeros(7, 4, 64, 64),
                          ssm_state_indices=torch.tensor([6, 0, 2]))
    for fn, kw in ((api.chunk_gated_delta_rule2, gdn2_in()), (api.chunk_gated_delta_product, gdp_in()),
                   (api.recurrent_kda, {**kda_in(), "cu_seqlens": None})):
        with pytest.raises(ValueError, match=CUDA_ONLY):  # through the cudnn entry points' own checks
            fn(**kw, backend="cudnn")
    with pytest.raises(ValueError, match=CUDA_ONLY):
        gapi.chunk_gated_delta_rule(**{k: v for k, v in gdn2_in().items() if k not in ("g", "beta", "w")},
                                    backend="cudnn")


@pytest.mark.parametrize("fn,kw,over,exc,pattern", [
    ("gdn2", {}, dict(backend="triton"), ValueError, "backend"),
    ("gdn2", {}, dict(cu_seqlens=None), ValueError, "cu_seqlens is required"),
    ("gdn2", {}, dict(g=torch.rand(8, 4, 64)), ValueError, "natural-log decay"),
    ("gdn2", {}, dict(g=-torch.rand(8, 4)), ValueError, r"g must be \[8, 4, 64\]"),
    ("gdn2", {}, dict(w=torch.rand(8, 4, 32)), ValueError, r"w must be \[8, 4, 64\]"),
    ("gdn2", {}, dict(beta=torch.rand(8, 4, 64).to(torch.int32)), ValueError, "beta must be one of"),
    ("gdn2", {}, dict(k=torch.randn(8, 3, 64).bfloat16()), ValueError, "GVA"),
    ("gdn2", {}, dict(v=torch.randn(8, 4, 64).half()), ValueError, "q's dtype"),
    ("gdn2", {}, dict(q=torch.randn(8, 2, 64)), ValueError, "bfloat16 or float16"),
    ("gdn2", {}, dict(cu_seqlens=torch.tensor([0, 5, 3], dtype=torch.int32)), ValueError, "non-decreasing"),
    ("gdn2", {}, dict(initial_state=torch.zeros(2, 4, 64, 64, dtype=torch.float16)), ValueError, "float32 or bf"),
    ("gdn2", dict(K=96, V=96), dict(g=None, beta=None, w=None), NotImplementedError, r"served: K, V in"),
    ("gdp", {}, dict(num_householder=0), ValueError, "num_householder"),
    ("gdp", {}, dict(num_householder=True), ValueError, "num_householder"),
    ("gdp", {}, dict(g=torch.rand(6, 4) + 1), ValueError, r"alpha in \[0, 1\]"),
    ("gdp", {}, dict(beta=torch.rand(6, 4)), ValueError, r"beta must be \[12, 4\]"),
    ("gdp", {}, dict(k=torch.randn(6, 2, 64).bfloat16()), ValueError, "T \\* num_householder"),
    ("gdp", {}, dict(cu_seqlens=None), ValueError, "cu_seqlens is required"),
    ("gdp", dict(n=9), {}, NotImplementedError, "num_householder=9"),
])
def test_family_argument_errors(fn, kw, over, exc, pattern):
    base = gdn2_in(**kw) if fn == "gdn2" else gdp_in(**kw)
    f = api.chunk_gated_delta_rule2 if fn == "gdn2" else api.chunk_gated_delta_product
    with pytest.raises(exc, match=pattern):
        f(**{**base, **over})


def test_state_aliasing_errors():
    st = torch.zeros(2, 4, 64, 64)
    with pytest.raises(ValueError, match="must not alias"):
        api.chunk_gated_delta_rule2(**gdn2_in(), initial_state=st, output_state=st)
    with pytest.raises(ValueError, match="must not alias"):
        api.chunk_gated_delta_product(**gdp_in(), initial_state=st, output_state=st[:])
    from cutedsl_attn.api import cudnn_linear as cl
    kw = gdn2_in()
    with pytest.raises(ValueError, match="must not alias"):
        cl.cudnn_chunk_gated_delta_rule2(**kw, initial_state=st, output_state=st)
    kq = kda_in(B=1, T=5)
    with pytest.raises(ValueError, match="must not alias"):
        cl.cudnn_recurrent_kda(**kq, cu_seqlens=torch.tensor([0, 2, 5]), initial_state=st, output_state=st)


@pytest.mark.parametrize("over,exc,pattern", [
    (dict(backend="cute-dsl"), NotImplementedError, r"backend='cute-dsl' is not served.*served: 'auto', 'cute'"),
    (dict(backend="cake"), NotImplementedError, r"backend='cake' is not served.*'cudnn'"),
    (dict(backend="small-bh"), NotImplementedError, "backend='small-bh'"),
    (dict(backend="triton"), ValueError, "backend must be 'auto', 'cute' or 'cudnn'"),
    (dict(num_spec_tokens=2), NotImplementedError, "num_spec_tokens"),
    (dict(state_checkpoints=torch.zeros(1)), NotImplementedError, "state_checkpoints"),
    (dict(checkpoint_every_n_tokens=64), NotImplementedError, "checkpoint_every_n_tokens"),
    (dict(kg_cache=torch.zeros(1)), NotImplementedError, "kg_cache"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(4)), ValueError, "A_log and dt_bias"),
    (dict(lower_bound=1.0), ValueError, "lower_bound"),
    (dict(disable_state_update=True, output_final_state=True), ValueError, "disable_state_update"),
    (dict(initial_state_source=torch.zeros(3, 4, 64, 64)), ValueError,
     "initial_state_source needs initial_state_indices"),
    (dict(initial_state_indices=torch.tensor([0, 1, 2])), ValueError,
     "initial_state_indices needs initial_state_source"),
    (dict(v=torch.randn(3, 1, 3, 64).bfloat16()), ValueError, "multiple of H"),
    (dict(g=torch.rand(3, 1, 4, 64).bfloat16()), ValueError, "natural-log decay"),
    (dict(beta=torch.rand(3, 1, 2).bfloat16()), ValueError, r"beta must be \[3, 4\]"),
    (dict(initial_state=torch.zeros(2, 4, 64, 64)), ValueError, "N = 3 rows"),
    (dict(ssm_state_indices=torch.tensor([0, 1, 2])), ValueError, "needs initial_state"),
    (dict(initial_state=torch.zeros(4, 4, 64, 64), ssm_state_indices=torch.tensor([0, 0, 2])), ValueError,
     "unique"),
    (dict(initial_state=torch.zeros(4, 4, 64, 64), ssm_state_indices=torch.tensor([0, 1, 4])), ValueError,
     r"in \[0, 4\)"),
    (dict(initial_state=torch.zeros(3, 4, 64, 64), initial_state_source=torch.zeros(3, 4, 64, 64).bfloat16(),
          initial_state_indices=torch.tensor([0, 1, 2])), ValueError, "initial_state's dtype"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(4), dt_bias=torch.zeros(10)), ValueError, "dt_bias"),
    (dict(output=torch.empty(3, 1, 4, 32).bfloat16()), ValueError, "output must be"),
    (dict(backend="cudnn", ssm_state_indices=torch.tensor([0, 1, 2])), NotImplementedError,
     "cudnn.*ssm_state_indices"),
    (dict(backend="cudnn", disable_state_update=True), NotImplementedError, "cudnn.*disable_state_update"),
    # a reshape of a strided output would be a copy that cuDNN writes instead of the caller's tensor
    (dict(backend="cudnn", output=torch.empty(3, 1, 64, 4).bfloat16().transpose(2, 3)), ValueError,
     "output must be contiguous"),
])
def test_kda_argument_errors(over, exc, pattern):
    with pytest.raises(exc, match=pattern):
        api.recurrent_kda(**{**kda_in(), **over})


def test_kda_source_pool_overlap_and_cudnn_checks():
    st = torch.zeros(6, 4, 64, 64)
    with pytest.raises(ValueError, match="must not overlap"):
        api.recurrent_kda(**kda_in(), initial_state=st[:3], initial_state_source=st[2:],
                          initial_state_indices=torch.tensor([0, 1, 2]))
    from cutedsl_attn.api import cudnn_linear as cl
    kw = kda_in(B=1, T=4, H=4, HV=2)
    with pytest.raises(NotImplementedError, match="H=4 > HV=2"):
        cl.cudnn_recurrent_kda(**kw, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="cu_seqlens is required"):
        cl.cudnn_recurrent_kda(**kda_in(B=1, T=4))
    with pytest.raises(ValueError, match="A_log and dt_bias"):
        cl.cudnn_recurrent_kda(**kda_in(B=1, T=4), cu_seqlens=torch.tensor([0, 4]), use_gate_in_kernel=True)
    with pytest.raises(NotImplementedError, match="state_indices"):
        gapi.chunk_gated_delta_rule(**{k: v for k, v in gdn2_in().items() if k not in ("g", "beta", "w")},
                                    backend="cudnn", state_indices=torch.tensor([0, 1]))
    with pytest.raises(NotImplementedError, match="use_cp=True"):
        gapi.chunk_gated_delta_rule(**{k: v for k, v in gdn2_in().items() if k not in ("g", "beta", "w")},
                                    backend="cudnn", use_cp=True)


@pytest.mark.parametrize("fn,flag", [
    ("gdn2", "output_final_state"), ("gdn2", "use_qk_l2norm_in_kernel"),
    ("gdp", "output_final_state"), ("gdp", "use_qk_l2norm_in_kernel"),
    ("kda", "output_final_state"), ("kda", "use_qk_l2norm_in_kernel"), ("kda", "use_gate_in_kernel"),
    ("kda", "beta_is_logit"), ("kda", "disable_state_update"),
])
@pytest.mark.parametrize("backend", ["auto", "cudnn"])
def test_family_non_bool_flags_are_refused(fn, flag, backend):
    f, kw = {"gdn2": (api.chunk_gated_delta_rule2, gdn2_in()), "gdp": (api.chunk_gated_delta_product, gdp_in()),
             "kda": (api.recurrent_kda, kda_in())}[fn]
    with pytest.raises(TypeError, match=f"{flag} must be a bool"):
        f(**kw, **{flag: "no"}, backend=backend)


@pytest.mark.parametrize("name,flags", [
    ("cudnn_chunk_gated_delta_rule", ("output_final_state", "use_qk_l2norm_in_kernel", "batch_invariant")),
    ("cudnn_chunk_gated_delta_rule2", ("output_final_state", "use_qk_l2norm_in_kernel", "batch_invariant")),
    ("cudnn_chunk_gated_delta_product", ("output_final_state", "use_qk_l2norm_in_kernel", "batch_invariant")),
    ("cudnn_recurrent_kda", ("output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                             "beta_is_logit", "batch_invariant")),
])
def test_cudnn_non_bool_flags_are_refused(name, flags):
    from cutedsl_attn.api import cudnn_linear as cl
    kw = {"cudnn_chunk_gated_delta_rule": {k: v for k, v in gdn2_in().items() if k not in ("g", "beta", "w")},
          "cudnn_chunk_gated_delta_rule2": gdn2_in(), "cudnn_chunk_gated_delta_product": gdp_in(),
          "cudnn_recurrent_kda": {**kda_in(B=1, T=4), "cu_seqlens": torch.tensor([0, 4])}}[name]
    for flag in flags:
        with pytest.raises(TypeError, match=f"{flag} must be a bool"):
            getattr(cl, name)(**kw, **{flag: 1})


def test_family_outputs_overlapping_inputs_are_refused():
    from cutedsl_attn.api import cudnn_linear as cl
    kw = gdn2_in()  # output [8, 4, 64] has v's shape
    st = torch.zeros(2, 4, 64, 64)
    w_in_st = st.view(-1)[:8 * 4 * 64].view(8, 4, 64)
    for backend in ("cute", "cudnn"):
        with pytest.raises(ValueError, match="chunk_gated_delta_rule2: output must not overlap v"):
            api.chunk_gated_delta_rule2(**kw, output=kw["v"], backend=backend)
        with pytest.raises(ValueError, match="output_state must not overlap w"):
            api.chunk_gated_delta_rule2(**{**kw, "w": w_in_st}, output_state=st, backend=backend)
    with pytest.raises(ValueError, match="cudnn_chunk_gated_delta_rule2: output must not overlap v"):
        cl.cudnn_chunk_gated_delta_rule2(**kw, output=kw["v"])
    with pytest.raises(ValueError, match="cudnn_chunk_gated_delta_rule: output must not overlap initial_state"):
        cl.cudnn_chunk_gated_delta_rule(**{k: v for k, v in kw.items() if k not in ("g", "beta", "w")},
                                        initial_state=st, output=st.view(-1).view(torch.bfloat16)[:2048].view(
                                            8, 4, 64))
    kp = gdp_in()  # output [6, 4, 64]; v [12, 4, 64]
    with pytest.raises(ValueError, match="chunk_gated_delta_product: output must not overlap v"):
        api.chunk_gated_delta_product(**kp, output=kp["v"][6:])
    with pytest.raises(ValueError, match="cudnn_chunk_gated_delta_product: output must not overlap k"):
        cl.cudnn_chunk_gated_delta_product(**{**kp, "k": kp["v"][:, :2]}, output=kp["v"][:6])
    with pytest.raises(ValueError, match=CUDA_ONLY):  # a separate buffer is fine
        api.chunk_gated_delta_product(**kp, output=torch.empty(6, 4, 64, dtype=torch.bfloat16))


def test_kda_outputs_overlapping_inputs_are_refused():
    from cutedsl_attn.api import cudnn_linear as cl
    kq = kda_in()
    st = torch.zeros(3, 4, 64, 64)
    g_in_st = st.view(-1).view(torch.bfloat16)[:3 * 4 * 64].view(3, 1, 4, 64)
    for backend in ("cute", "cudnn"):
        with pytest.raises(ValueError, match="recurrent_kda: output must not overlap v"):
            api.recurrent_kda(**kq, output=kq["v"], backend=backend)
    with pytest.raises(ValueError, match="initial_state must not overlap g"):  # the state is written in place
        api.recurrent_kda(**{**kq, "g": g_in_st}, initial_state=st)
    with pytest.raises(ValueError, match=CUDA_ONLY):  # disable_state_update: the state is only read
        api.recurrent_kda(**{**kq, "g": g_in_st}, initial_state=st, disable_state_update=True)
    with pytest.raises(ValueError, match="output must not overlap initial_state"):
        api.recurrent_kda(**kq, initial_state=st, output=st.view(-1).view(torch.bfloat16)[:3 * 4 * 64].view(
            3, 1, 4, 64))
    kc = {**kda_in(B=1, T=4), "cu_seqlens": torch.tensor([0, 4])}
    with pytest.raises(ValueError, match="cudnn_recurrent_kda: output must not overlap v"):
        cl.cudnn_recurrent_kda(**kc, output=kc["v"])
    st1 = torch.zeros(1, 4, 64, 64)
    with pytest.raises(ValueError, match="cudnn_recurrent_kda: initial_state must not overlap q"):
        cl.cudnn_recurrent_kda(**{**kc, "q": st1.view(-1).view(torch.bfloat16)[:4 * 2 * 64].view(1, 4, 2, 64)},
                               initial_state=st1)


def test_kda_gate_parameters_without_the_in_kernel_gate_are_unused():
    """FlashInfer's A_log / dt_bias / lower_bound parametrise only the in-kernel gate: without it they are
    documented as unused (still type-checked), and the call proceeds."""
    assert "are not used" in api.recurrent_kda.__doc__
    with pytest.raises(ValueError, match=CUDA_ONLY):
        api.recurrent_kda(**kda_in(), A_log=torch.zeros(4), dt_bias=torch.zeros(4 * 64), lower_bound=-5.0)
    with pytest.raises(ValueError, match="lower_bound"):
        api.recurrent_kda(**kda_in(), lower_bound=2.0)


@pytest.mark.parametrize("fn", ["gdn2", "gdp"])
def test_family_unknown_backend_is_a_value_error(fn):
    f, kw = (api.chunk_gated_delta_rule2, gdn2_in()) if fn == "gdn2" else (api.chunk_gated_delta_product, gdp_in())
    with pytest.raises(ValueError, match="backend must be 'auto', 'cute' or 'cudnn'"):
        f(**kw, backend="flashinfer")  # FlashInfer serves these only through cuDNN: no other name exists


# ---------------------------------------------------------------------------- cuDNN signatures (the seeds)
SEED_SIGS = {
    "cudnn_recurrent_kda": "q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None, "
                           "output_final_state=False, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False, "
                           "lower_bound=None, cu_seqlens=None, beta_is_logit=False, output=None, output_state=None, "
                           "batch_invariant=False",
    "cudnn_chunk_gated_delta_rule": "q, k, v, g=None, beta=None, scale=None, initial_state=None, "
                                    "output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False, "
                                    "output=None, output_state=None, batch_invariant=False",
    "cudnn_chunk_gated_delta_rule2": "q, k, v, g=None, beta=None, w=None, scale=None, initial_state=None, "
                                     "output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False, "
                                     "output=None, output_state=None, batch_invariant=False",
    "cudnn_chunk_gated_delta_product": "q, k, v, g=None, beta=None, num_householder=1, scale=None, "
                                       "initial_state=None, output_final_state=False, cu_seqlens=None, "
                                       "use_qk_l2norm_in_kernel=False, output=None, output_state=None, "
                                       "batch_invariant=False",
}


@pytest.mark.parametrize("name", sorted(SEED_SIGS))
def test_cudnn_signatures_match_the_seeds(name):
    from cutedsl_attn.api import cudnn_linear as cl
    assert str(inspect.signature(getattr(cl, name)))[1:-1] == SEED_SIGS[name]


def test_public_signatures_are_flashinfers():
    s2 = str(inspect.signature(api.chunk_gated_delta_rule2))
    assert s2.startswith("(q, k, v, g=None, beta=None, w=None, scale=None, initial_state=None, "
                         "output_final_state=False, cu_seqlens=None") and s2.endswith("*, backend='auto')")
    sp = str(inspect.signature(api.chunk_gated_delta_product))
    assert "num_householder=1, scale=None" in sp
    sk = list(inspect.signature(api.recurrent_kda).parameters)
    ref = list(inspect.signature(rd.recurrent_kda).parameters)
    assert sk == ref + ["backend"]  # the oracle: the public signature minus backend


def test_decline_message_names_op_decision_and_cute():
    from cutedsl_attn.cudnn import linear_attention as la
    key = la.graph_key("chunk_gated_delta_rule2", {"q": torch.zeros(4, 2, 128, dtype=torch.bfloat16)}, scale=1.0,
                       use_qk_l2norm=False)
    msg = la.decline_message(key, "gdn2_frost: gdn2_frost requires SM100 / SM103 / SM107 (found 90)")
    for part in ("chunk_gated_delta_rule2", "gdn2_frost requires SM100", "cuDNN", "cudnn-frontend",
                 "backend='cute'"):
        assert part in msg


# ---------------------------------------------------------------------------- API -> launch (emulated kernel)
def emulate_launch(problem, args, device_index=None):
    """The recurrent kernel's contract on GdnArgs for every family variant, in float64."""
    from cutedsl_attn.planning import gdn as pg

    f, n_h = args.flags, problem.num_householder
    cu = args.cu_seqlens.tolist()
    ho, V = args.output.shape[1], args.output.shape[2]
    K = args.q.shape[2]
    for n in range(len(cu) - 1):
        for oh in range(ho):
            H = torch.zeros(V, K, dtype=torch.float64)
            if f & pg.FLAG_HAS_INITIAL_STATE:
                row = int(args.initial_state_indices[n]) if f & pg.FLAG_INITIAL_INDICES else n
                H = args.initial_state[row, oh].double().clone()
            for e in range(cu[n] * n_h, cu[n + 1] * n_h):
                t = e // n_h
                qt = args.q[t, oh // args.q_group].double()
                kt = args.k[e, oh // args.k_group].double()
                vt = args.v[e, oh // args.v_group].double()
                if problem.use_qk_l2norm:
                    qt = qt * torch.rsqrt((qt * qt).sum() + 1e-6)
                    kt = kt * torch.rsqrt((kt * kt).sum() + 1e-6)
                a = torch.ones(K, dtype=torch.float64)
                if f & pg.FLAG_HAS_G and e % n_h == 0:
                    gv = args.g[t, oh].double()
                    a = a * (torch.exp(gv) if problem.gate_domain == "log" else gv)
                H = H * a[None, :]
                if problem.erase_write_gates:
                    bw = args.beta[e, oh].double()
                    u = bw[K:] * vt - H @ (bw[:K] * kt)
                else:
                    b = float(args.beta[e, oh]) if f & pg.FLAG_HAS_BETA else 1.0
                    u = b * (vt - H @ kt)
                H = H + u[:, None] * kt[None, :]
                if e % n_h == n_h - 1:
                    args.output[t, oh] = (args.scale * (H @ qt)).to(args.output.dtype)
            if f & pg.FLAG_WRITE_STATE:
                row = int(args.output_state_indices[n]) if f & pg.FLAG_OUTPUT_INDICES else n
                args.output_state[row, oh] = H.to(args.output_state.dtype)


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(api, "gdn_launch", emulate_launch)
    monkeypatch.setattr(gapi, "_require_cuda", lambda device: None)
    monkeypatch.setattr(gapi, "gdn_arch", lambda device=None: "sm_90a")


def test_api_plumbing_gdn2(emulated):
    kw = gdn2_in(T=9, hq=1, hk=1, hv=2, K=64, V=64)
    kw["cu_seqlens"] = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    kw["k"] = unit(kw["k"].float()).bfloat16()
    h0 = torch.randn(3, 2, 64, 64) * 0.1
    o, s = api.chunk_gated_delta_rule2(**kw, initial_state=h0, output_final_state=True)
    o_ref, s_ref = rd.chunk_gated_delta_rule2(**kw, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.bfloat16 and rel(o, o_ref) < 1e-2 and rel(s, s_ref) < 1e-5
    o = api.chunk_gated_delta_rule2(kw["q"], kw["k"], kw["v"], cu_seqlens=kw["cu_seqlens"], w=kw["w"])
    assert rel(o, rd.chunk_gated_delta_rule2(kw["q"], kw["k"], kw["v"], w=kw["w"], cu_seqlens=kw["cu_seqlens"])) < 1e-2


def test_api_plumbing_gdp(emulated):
    kw = gdp_in(T=5, n=3)
    kw["cu_seqlens"] = torch.tensor([0, 2, 5], dtype=torch.int32)
    kw["k"] = unit(kw["k"].float()).bfloat16()
    o, s = api.chunk_gated_delta_product(**kw, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = rd.chunk_gated_delta_product(**kw, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel(o, o_ref) < 1e-2 and rel(s, s_ref) < 1e-5


def test_api_plumbing_kda_prefill_and_decode_pools(emulated):
    kw = kda_in(B=1, T=7, H=1, HV=2)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    st = torch.randn(2, 2, 64, 64) * 0.1
    before = st.clone()
    o, s = api.recurrent_kda(**kw, cu_seqlens=cu, initial_state=st)
    o_ref, _ = rd.recurrent_kda(**kw, cu_seqlens=cu, initial_state=before.clone())
    s_ref = before.clone()
    rd.recurrent_kda(**kw, cu_seqlens=cu, initial_state=s_ref)
    assert s is None and rel(o, o_ref) < 1e-2 and rel(st, s_ref) < 1e-5
    # safe gate + logits
    A_log, dt_bias = torch.rand(2) - 0.5, torch.randn(2 * 64)
    graw = torch.randn(1, 7, 2, 64).bfloat16()
    bl = torch.randn(1, 7, 2).bfloat16()
    o, fin = api.recurrent_kda(kw["q"], kw["k"], kw["v"], graw, bl, A_log, dt_bias, cu_seqlens=cu,
                               use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True, output_final_state=True)
    o_ref, f_ref = rd.recurrent_kda(kw["q"], kw["k"], kw["v"], graw, bl, A_log, dt_bias, cu_seqlens=cu,
                                    use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True,
                                    output_final_state=True)
    assert fin.dtype == torch.float32 and rel(o, o_ref) < 1e-2 and rel(fin, f_ref) < 1e-5
    # [T, H, K] without cu_seqlens: one sequence
    o3, _ = api.recurrent_kda(kw["q"][0], kw["k"][0], kw["v"][0], kw["g"][0], kw["beta"][0])
    assert o3.shape == (7, 2, 64) and rel(o3, rd.recurrent_kda(kw["q"][0], kw["k"][0], kw["v"][0], kw["g"][0],
                                                               kw["beta"][0])[0]) < 1e-2
    # decode T = 1 with a bf16 pool and a read-only source pool
    kd = kda_in(B=3, T=1, H=2, HV=4)
    pool = (torch.randn(5, 4, 64, 64) * 0.1).bfloat16()
    idx = torch.tensor([4, 0, 2])
    ref_pool = pool.double()
    o, p = api.recurrent_kda(**kd, initial_state=pool, ssm_state_indices=idx, output_final_state=True)
    o_ref, _ = rd.recurrent_kda(**kd, initial_state=ref_pool, ssm_state_indices=idx)
    assert p is pool and o.shape == (3, 1, 4, 64) and rel(o, o_ref) < 1e-2 and rel(pool.double(), ref_pool) < 1e-2
    src = torch.randn(4, 4, 64, 64) * 0.1
    dst = torch.zeros(3, 4, 64, 64)
    o, _ = api.recurrent_kda(**kd, initial_state=dst, initial_state_source=src,
                             initial_state_indices=torch.tensor([3, 1, 0]))
    ref_dst = torch.zeros(3, 4, 64, 64, dtype=torch.float64)
    o_ref, _ = rd.recurrent_kda(**kd, initial_state=ref_dst, initial_state_source=src,
                                initial_state_indices=torch.tensor([3, 1, 0]))
    assert rel(o, o_ref) < 1e-2 and rel(dst, ref_dst) < 1e-5


# ---------------------------------------------------------------------------- PTX of each variant
VARIANTS = {
    "gdn2": dict(gate_per_channel=True, erase_write_gates=True, gate_domain="log"),
    "gdn2_l2norm_bf16_state": dict(gate_per_channel=True, erase_write_gates=True, gate_domain="log",
                                   use_qk_l2norm=True, state_dtype="bfloat16"),
    "kda": dict(gate_per_channel=True, gate_domain="log", use_qk_l2norm=True),
    "kda_decode_bf16_state": dict(gate_per_channel=True, gate_domain="log", use_qk_l2norm=True, decode=True,
                                  state_dtype="bfloat16"),
    "gdp3": dict(num_householder=3),
}


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_family_kernel_ptx(tmp_path, arch, variant):
    rec = pytest.importorskip("cutedsl_attn.portable.gdn_recurrent")
    from cutedsl_attn.planning.gdn import GdnProblem
    p = GdnProblem(dtype="bfloat16", head_dim_k=128, head_dim_v=128, arch=arch, **VARIANTS[variant])
    cfg = rec.Config(p, rec.default_tiles(p, num_sms=132))
    rec.compile(cfg, keep_ptx_dir=str(tmp_path))
    (path,) = glob.glob(str(tmp_path / "*.ptx"))
    ptx = open(path).read()
    assert re.search(rf"\.target\s+{arch}", ptx)
    t = cfg.tiles
    R, KL = t.rows_per_lane, 128 // t.lanes_per_row
    n_red = 2 * R + (3 if p.use_qk_l2norm else 1)
    assert ptx.count("shfl.sync.bfly") == int(math.log2(t.lanes_per_row)) * n_red * t.prefetch
    assert ".local" not in ptx  # state and prefetched tokens stay in registers
    if p.gate_per_channel:  # one exp2 a gate column a token, in the prologue's block and the loop's next block
        assert ptx.count("ex2.approx") == 2 * KL * t.prefetch
        assert "ld.global.nc.v4.f32" in ptx or KL < 4
    else:
        assert "ex2.approx" not in ptx  # linear alpha
    assert "wgmma" not in ptx and "tcgen05" not in ptx


def test_family_problem_rules():
    from cutedsl_attn.planning.gdn import GdnProblem
    base = dict(dtype="bfloat16", head_dim_k=128, head_dim_v=128)
    with pytest.raises(ValueError, match="needs gate_per_channel"):
        GdnProblem(**base, erase_write_gates=True)
    with pytest.raises(ValueError, match="scalar gates only"):
        GdnProblem(**base, num_householder=2, gate_per_channel=True)
    with pytest.raises(ValueError, match="num_householder"):
        GdnProblem(**base, num_householder=9)
    with pytest.raises(TypeError):
        GdnProblem(**base, gate_per_channel=1)
    rec = pytest.importorskip("cutedsl_attn.portable.gdn_recurrent")
    gdn = GdnProblem(**base)
    kda = GdnProblem(**base, gate_per_channel=True, gate_domain="log")
    assert rec.default_tiles(gdn, num_sms=132).prefetch == 4 and rec.default_tiles(kda, num_sms=132).prefetch == 2


# ---------------------------------------------------------------------------- cuDNN wrappers -> graph (stubbed)
@pytest.fixture
def cudnn_calls(monkeypatch):
    """The cuDNN wrappers with the device check off and the graph run replaced by a recorder that writes the
    oracle's results into the bound outputs (KDA) or zeros (the others)."""
    from cutedsl_attn.api import cudnn_linear as cl
    calls = []

    def run(op, q, k, v, g, beta, cu_seqlens, o, final, initial_state, **kw):
        calls.append(dict(op=op, q=q, g=g, beta=beta, o=o, final=final, initial_state=initial_state, **kw))
        if op == "cudnn_recurrent_kda":
            res, fin = rd.recurrent_kda(q, k, v, g, beta, kw["a_log"], kw["dt_bias"], kw["scale"],
                                        None if initial_state is None else initial_state.clone(),
                                        output_final_state=True, use_qk_l2norm_in_kernel=kw["use_qk_l2norm"],
                                        use_gate_in_kernel=kw["safe_gate"], lower_bound=kw["gate_lower_bound"],
                                        cu_seqlens=cu_seqlens, beta_is_logit=kw["use_beta_sigmoid"])
            o.copy_(res)
            if final is not None:
                final.copy_(fin)
        else:
            o.zero_()
            if final is not None:
                final.zero_()

    monkeypatch.setattr(cl, "_require_cuda", lambda device: None)
    monkeypatch.setattr(cl, "_run", run)
    return cl, calls


def test_cudnn_wrappers_gate_domains_and_pass_through(cudnn_calls):
    cl, calls = cudnn_calls
    kw = gdn2_in()
    st = torch.zeros(2, 4, 64, 64, dtype=torch.bfloat16)
    o, s = cl.cudnn_chunk_gated_delta_rule2(**kw, initial_state=st, output_final_state=True)
    c = calls[-1]
    assert c["gate_domain"] == "log" and c["initial_state"] is st and s.dtype == torch.bfloat16
    assert c["beta"].dtype == torch.bfloat16 and c["w"].dtype == torch.bfloat16 and c["g"] is kw["g"]
    base = {k: v for k, v in kw.items() if k not in ("g", "beta", "w")}
    o = cl.cudnn_chunk_gated_delta_rule(**base, g=torch.rand(8, 4))
    assert calls[-1]["gate_domain"] == "linear" and calls[-1]["final"] is None and isinstance(o, torch.Tensor)
    assert calls[-1]["beta"].dtype == torch.float32 and torch.equal(calls[-1]["beta"], torch.ones(8, 4))
    cl.cudnn_chunk_gated_delta_product(**gdp_in(n=3))
    assert calls[-1]["gate_domain"] == "linear" and calls[-1]["num_householder"] == 3
    assert calls[-1]["scale"] == 1 / 8  # 1 / sqrt(64)


def test_cudnn_kda_in_place_state_and_fp16_gate_warning(cudnn_calls):
    cl, calls = cudnn_calls
    kw = kda_in(B=1, T=9, H=1, HV=2)
    cu = torch.tensor([0, 4, 9])
    st = torch.randn(2, 2, 64, 64) * 0.1
    before = st.clone()
    o, s = cl.cudnn_recurrent_kda(**kw, cu_seqlens=cu, initial_state=st)
    assert s is None and calls[-1]["initial_state"] is st and not torch.equal(st, before)
    ref = before.clone()
    o_ref, _ = rd.recurrent_kda(**kw, cu_seqlens=cu, initial_state=ref)
    assert o.shape == kw["v"].shape and rel(o, o_ref) < 1e-2 and rel(st, ref) < 1e-6
    out_state = torch.empty(2, 2, 64, 64)
    st2 = before.clone()
    _, s2 = cl.cudnn_recurrent_kda(**kw, cu_seqlens=cu, initial_state=st2, output_state=out_state,
                                   output_final_state=True)
    assert s2 is out_state and torch.equal(st2, before) and rel(out_state, ref) < 1e-6
    c = calls[-1]
    assert c["gate_domain"] == "log" and c["use_qk_l2norm"] and not c["safe_gate"]
    A_log, dt_bias = torch.zeros(2), torch.zeros(128)
    cl.cudnn_recurrent_kda(**kw, cu_seqlens=cu, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                           lower_bound=-5.0)
    c = calls[-1]
    assert c["safe_gate"] and c["gate_lower_bound"] == -5.0 and c["dt_bias"].shape == (2, 64)
    with pytest.warns(RuntimeWarning, match="float16 log gates"):
        cl.cudnn_recurrent_kda(**{**kw, "q": kw["q"].half(), "k": kw["k"].half(), "v": kw["v"].half(),
                                  "g": torch.full((1, 9, 2, 64), -0.5).half(), "beta": kw["beta"].half()},
                               cu_seqlens=cu)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # alpha >= 0.9: no warning
        cl.cudnn_recurrent_kda(**{**kw, "q": kw["q"].half(), "k": kw["k"].half(), "v": kw["v"].half(),
                                  "g": torch.full((1, 9, 2, 64), -0.05).half(), "beta": kw["beta"].half()},
                               cu_seqlens=cu)


def test_graph_key_bakes_layouts():
    from cutedsl_attn.cudnn import linear_attention as la
    qkv = torch.zeros(8, 3 * 2, 128, dtype=torch.bfloat16)
    dense = torch.zeros(8, 2, 128, dtype=torch.bfloat16)
    kw = dict(scale=0.1, use_qk_l2norm=True)
    a = la.graph_key("recurrent_kda", {"q": qkv[:, :2]}, **kw)
    b = la.graph_key("recurrent_kda", {"q": dense}, **kw)
    c = la.graph_key("recurrent_kda", {"q": dense.clone()}, **kw)
    assert a != b and b == c and hash(b) == hash(c)
    assert la.graph_key("recurrent_kda", {"q": dense}, scale=0.2, use_qk_l2norm=True) != b
    with pytest.raises(ValueError, match="op must be"):
        la.graph_key("mamba2", {"q": dense}, **kw)


def test_frontend_accepts_the_graphs_on_a_simulated_hopper(monkeypatch):
    """With cudnn-frontend importable (no GPU): the graphs :mod:`cutedsl_attn.cudnn.linear_attention` declares pass
    the frontend's validation and engine planning with the device reported as SM90 -- KDA gets the Hopper engine,
    GDN-2 is declined naming the FROST engine's SM100 requirement and ``backend='cute'``."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the GPU tests build these graphs for real")
    cudnn = pytest.importorskip("cudnn")
    buffers = pytest.importorskip("cudnn.frost.buffers")
    from cutedsl_attn.cudnn import linear_attention as la
    monkeypatch.setattr(buffers, "current_sm", lambda: 90)
    monkeypatch.setattr(la, "_handle", lambda device: None)
    T, H, HV, K = 40, 2, 4, 128
    bf = dict(dtype=torch.bfloat16)
    bound = dict(q=torch.zeros(T, H, K, **bf), k=torch.zeros(T, H, K, **bf), v=torch.zeros(T, HV, K, **bf),
                 g=torch.zeros(T, HV, K, **bf), beta=torch.zeros(T, HV, **bf), a_log=torch.zeros(HV),
                 dt_bias=torch.zeros(HV, K), cu_seqlens=torch.tensor([0, 10, T], dtype=torch.int32),
                 initial_state=torch.zeros(2, HV, K, K, **bf), O=torch.zeros(T, HV, K, **bf),
                 final_state=torch.zeros(2, HV, K, K, **bf))
    key = la.graph_key("recurrent_kda", bound, scale=0.1, use_qk_l2norm=True, use_beta_sigmoid=True, safe_gate=True,
                       gate_lower_bound=-5.0)
    lg = la._build(key)
    assert lg.graph.get_plan_name_at_index(0).startswith("kda_hopper")
    b2 = dict(bound, a_log=None, dt_bias=None, beta=torch.zeros(T, HV, K, **bf), w=torch.zeros(T, HV, K, **bf))
    with pytest.raises(NotImplementedError, match="gdn2_frost.*SM100.*backend='cute'"):
        la._build(la.graph_key("chunk_gated_delta_rule2", b2, scale=0.1, use_qk_l2norm=False))
    assert issubclass(cudnn.cudnnGraphNotSupportedError, Exception)


def test_custom_op_under_torch_compile(monkeypatch):
    """Under torch.compile the launch is ``cutedsl_attn::gdn_recurrent`` (traced with its fake, run for real):
    same results as eager, the in-place state (one tensor as initial and output state) included."""
    from cutedsl_attn.dispatch import gdn as d
    from cutedsl_attn.planning import gdn as pg
    launches = []
    monkeypatch.setattr(d, "_gdn_launch_direct", lambda module, cfg, args: (launches.append(cfg.problem),
                                                                 emulate_launch(cfg.problem, args)))
    p = pg.GdnProblem(dtype="bfloat16", head_dim_k=64, head_dim_v=64, gate_per_channel=True, gate_domain="log",
                      use_qk_l2norm=True)
    assert d._gdn_problem_of(d._gdn_problem_key(p)) == p
    T, H = 5, 2
    q, k, v = (torch.randn(T, H, 64).bfloat16() for _ in range(3))
    g, beta, cu = -torch.rand(T, H, 64), torch.rand(T, H), torch.tensor([0, 2, 5], dtype=torch.int32)
    flags = pg.FLAG_HAS_G | pg.FLAG_HAS_BETA | pg.FLAG_HAS_INITIAL_STATE | pg.FLAG_WRITE_STATE

    def f(q, k, v, g, beta, cu, st, out):
        i32 = torch.empty(1, dtype=torch.int32)
        d.gdn_launch(p, pg.GdnArgs(q, k, v, g, beta, cu, st, i32, st, i32, out, 0.125, 1, 1, 1, flags))
        return out.float() * 2

    st1 = torch.randn(2, H, 64, 64) * 0.1
    st2 = st1.clone()
    o1, o2 = torch.zeros(T, H, 64).bfloat16(), torch.zeros(T, H, 64).bfloat16()
    r1 = f(q, k, v, g, beta, cu, st1, o1)
    torch._dynamo.reset()
    r2 = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, g, beta, cu, st2, o2)
    assert launches == [p, p] and torch.equal(r1, r2) and torch.equal(st1, st2) and torch.equal(o1, o2)
    assert not torch.equal(st1, torch.zeros_like(st1)) and hasattr(torch.ops.cutedsl_attn, "gdn_recurrent")
    # schema (declared mutations), fake tensor and functionalization checks on a call with separate states
    i32 = torch.zeros(1, dtype=torch.int32)
    args = (q, k, v, g, beta, cu, st1.clone(), i32, torch.zeros_like(st1), i32, torch.zeros(T, H, 64).bfloat16(),
            0.125, 1, 1, 1, flags, d._gdn_problem_key(p))
    torch.library.opcheck(torch.ops.cutedsl_attn.gdn_recurrent.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
