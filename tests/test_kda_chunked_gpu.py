"""GPU tests of the chunked KDA / GDN-2 kernel (:mod:`cutedsl_attn.portable.kda_chunked`) against the float64
oracles of ``cutedsl_attn.ref.delta_family`` (and, tighter, its float32 algorithm reference
``cutedsl_attn.ref.kda_chunked``), launched directly and through the public API with
``CUTEDSL_ATTN_GDN_KERNEL=chunked``.

Fresh random inputs every run; outputs and written states NaN-poisoned before each launch.
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from cutedsl_attn.api import delta_family as api  # noqa: E402
from cutedsl_attn.compile import get_compiled, target_arch  # noqa: E402
from cutedsl_attn.planning.gdn import (  # noqa: E402
    FLAG_HAS_BETA, FLAG_HAS_G, FLAG_HAS_INITIAL_STATE, FLAG_INITIAL_INDICES, FLAG_OUTPUT_INDICES, FLAG_WRITE_STATE,
    GdnArgs, GdnProblem,
)
from cutedsl_attn.portable import kda_chunked as chk  # noqa: E402
from cutedsl_attn.ref import delta_family as rd  # noqa: E402
from cutedsl_attn.ref import kda_chunked as rk  # noqa: E402

DEV = torch.device("cuda")
TOL_O = 1e-2  # 16-bit output rounding
TOL_SC = 5e-3  # fp32 state of a chunked kernel: the state and V' enter the MMAs rounded to 16 bits
TOL_S16 = 1e-2  # bf16 state rounding
TOL_ALGO = 3e-3  # against the float32 reference of the same algorithm (ex2.approx, accumulation order)
LENS = [0, 1, 15, 16, 17, 63, 64, 65, 1000, 4097]
NAN = float("nan")


def rel(x, y):
    x, y = x.detach().double().cpu(), y.detach().double().cpu()
    assert torch.isfinite(x).all(), "non-finite values (a NaN-poisoned element was not written)"
    return ((x - y).norm() / max(y.norm().item(), 1e-30)).item()


def cu_of(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)


def gates(kind, shape):
    u = torch.rand(shape, device=DEV)
    if kind == "mild":
        return -u * 0.5
    if kind == "strong":  # spans past the factored limit: the direct diagonal blocks
        return -u * 30.0
    if kind == "huge":
        return -u * 1e4
    if kind == "safe":  # the benchmark's: -5 sigmoid(x), the safe gate's range with lower_bound = -5
        return -5.0 * torch.sigmoid(torch.randn(shape, device=DEV))
    g = -u * 2.0
    g[torch.rand(shape, device=DEV) < 0.1] = -math.inf
    return g


def inputs(lens, hq, hk, hv, K=128, V=128, gate="mild", gdn2=False, dtype=torch.bfloat16):
    T, ho = sum(lens), max(hq, hv)
    d = dict(q=torch.randn(T, hq, K, device=DEV).to(dtype), k=torch.randn(T, hk, K, device=DEV).to(dtype),
             v=torch.randn(T, hv, V, device=DEV).to(dtype), g=gates(gate, (T, ho, K)), cu=cu_of(lens))
    if gdn2:
        d["b"], d["w"] = torch.rand(T, ho, K, device=DEV), torch.rand(T, ho, V, device=DEV) + 0.5
    else:
        d["beta"] = torch.rand(T, ho, device=DEV)
    return d


def oracle(d, h0, l2norm=True):
    """(output, final state) of the float64 oracle on the GPU; ``h0`` ``[N, HO, V, K]`` or None."""
    if "b" in d:
        return rd.chunk_gated_delta_rule2(d["q"], d["k"], d["v"], d["g"], d["b"], d["w"], initial_state=h0,
                                          output_final_state=True, cu_seqlens=d["cu"],
                                          use_qk_l2norm_in_kernel=l2norm)
    n = d["cu"].shape[0] - 1
    st = (torch.zeros(n, d["v"].shape[1], d["v"].shape[2], d["q"].shape[2], device=DEV, dtype=torch.float64)
          if h0 is None else h0.double().clone())
    o, _ = rd.recurrent_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=st, cu_seqlens=d["cu"],
                            use_qk_l2norm_in_kernel=l2norm)
    return o, st


def run_direct(d, *, h0=None, ht=None, h0_idx=None, ht_idx=None, l2norm=True, state_dtype="float32", tiles=None):
    """Launch the kernel straight (compile cache, :func:`chk.launch`); returns the NaN-poisoned, written output."""
    q, k, v = d["q"], d["k"], d["v"]
    T, hq, K = q.shape
    hk, hv, V = k.shape[1], v.shape[1], v.shape[2]
    ho = max(hq, hv)
    gdn2 = "b" in d
    p = GdnProblem(dtype="bfloat16" if q.dtype == torch.bfloat16 else "float16", head_dim_k=K, head_dim_v=V,
                   state_dtype=state_dtype, gate_domain="log", use_qk_l2norm=l2norm, gate_per_channel=True,
                   erase_write_gates=gdn2, arch=target_arch(DEV))
    cfg = chk.Config(p, tiles or chk.default_tiles(p, num_sms=132, chains=(d["cu"].shape[0] - 1) * ho))
    fn = get_compiled(chk.NAME, cfg, chk.compile)
    sdt = torch.float32 if state_dtype == "float32" else torch.bfloat16
    dummy_s = torch.empty(1, ho, V, K, device=DEV, dtype=sdt)
    i32 = torch.empty(1, device=DEV, dtype=torch.int32)
    beta = torch.cat([d["b"], d["w"]], -1).contiguous() if gdn2 else d["beta"].contiguous()
    flags = (FLAG_HAS_G | FLAG_HAS_BETA | (FLAG_HAS_INITIAL_STATE if h0 is not None else 0)
             | (FLAG_WRITE_STATE if ht is not None else 0) | (FLAG_INITIAL_INDICES if h0_idx is not None else 0)
             | (FLAG_OUTPUT_INDICES if ht_idx is not None else 0))
    out = torch.full((T, ho, V), NAN, device=DEV, dtype=q.dtype)
    args = GdnArgs(q, k, v, d["g"].contiguous(), beta, d["cu"], h0 if h0 is not None else dummy_s,
                   h0_idx if h0_idx is not None else i32, ht if ht is not None else dummy_s,
                   ht_idx if ht_idx is not None else i32, out, 1.0 / math.sqrt(K), ho // hq, ho // hk, ho // hv,
                   flags)
    chk.launch(fn, cfg, args)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("gate", ["mild", "strong", "huge", "inf"])
@pytest.mark.parametrize("mode", ["kda", "gdn2"])
def test_direct_vs_oracle_varlen(mode, gate):
    heads = (2, 2, 4) if mode == "kda" else (4, 2, 2)  # KDA: GVA; GDN-2: GQA
    d = inputs(LENS, *heads, gate=gate, gdn2=mode == "gdn2")
    n, ho = len(LENS), max(heads[0], heads[2])
    h0 = torch.randn(n, ho, 128, 128, device=DEV) * 0.1
    o_ref, s_ref = oracle(d, h0)
    ht = torch.full_like(h0, NAN)
    o = run_direct(d, h0=h0, ht=ht)
    assert rel(o, o_ref) < TOL_O and rel(ht, s_ref) < TOL_SC
    assert torch.equal(ht[0], h0[0])  # a zero-length sequence: final state = initial state


@pytest.mark.parametrize("mode", ["kda", "gdn2"])
@pytest.mark.parametrize("gate,D", [("mild", 64), ("strong", 64), ("safe", 128)])
def test_direct_vs_float32_algorithm(mode, gate, D):
    lens = [1, 17, 64, 65, 200]
    d = inputs(lens, 1, 1, 2, K=D, V=D, gate=gate, gdn2=mode == "gdn2")
    h0 = torch.randn(len(lens), 2, D, D, device=DEV) * 0.1
    ht = torch.full_like(h0, NAN)
    o = run_direct(d, h0=h0, ht=ht)
    cpu = {k: v.cpu() for k, v in d.items()}
    if mode == "gdn2":
        o_a, s_a = rk.kda_chunked(cpu["q"], cpu["k"], cpu["v"], cpu["g"], cpu["b"], w=cpu["w"], erase_write=True,
                                  initial_state=h0.cpu(), cu_seqlens=cpu["cu"], use_qk_l2norm=True)
    else:
        o_a, s_a = rk.kda_chunked(cpu["q"], cpu["k"], cpu["v"], cpu["g"], cpu["beta"], initial_state=h0.cpu(),
                                  cu_seqlens=cpu["cu"], use_qk_l2norm=True)
    assert rel(o, o_a) < TOL_ALGO and rel(ht, s_a) < TOL_ALGO


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dims", [(128, 128), (64, 64), (64, 128)])
def test_direct_pools_in_place_no_l2norm(state_dtype, dims):
    K, V = dims
    lens = [65, 0, 300, 16]
    d = inputs(lens, 2, 2, 4, K=K, V=V)
    d["k"] = (d["k"].float() / d["k"].float().norm(dim=-1, keepdim=True)).bfloat16()  # bounded without l2norm
    d["q"] = (d["q"].float() / math.sqrt(K)).bfloat16()
    sdt = torch.float32 if state_dtype == "float32" else torch.bfloat16
    pool = (torch.randn(9, 4, V, K, device=DEV) * 0.1).to(sdt)
    idx = torch.tensor([7, 2, 0, 5], device=DEV, dtype=torch.int32)
    before = pool.clone()
    o_ref, s_ref = oracle(d, pool[idx.long()].double(), l2norm=False)
    o = run_direct(d, h0=pool, ht=pool, h0_idx=idx, ht_idx=idx, l2norm=False, state_dtype=state_dtype)
    tol_s = TOL_SC if state_dtype == "float32" else TOL_S16
    assert rel(o, o_ref) < TOL_O and rel(pool[idx.long()], s_ref) < tol_s
    others = [r for r in range(9) if r not in idx.tolist()]
    assert torch.equal(pool[others], before[others])  # rows no sequence owns stay untouched
    assert torch.equal(pool[2], before[2])  # the zero-length sequence's row: its initial state, rewritten as is


def test_direct_no_initial_state_tiles_and_zero_gate_is_ungated():
    lens = [130, 64]
    d = inputs(lens, 2, 2, 2, gdn2=True)
    d["g"] = torch.zeros_like(d["g"])
    o_ref, s_ref = oracle(d, None)
    for tiles in (chk.Tiles(64, 4), chk.Tiles(32, 8), chk.Tiles(64, 8)):
        ht = torch.full((2, 2, 128, 128), NAN, device=DEV)
        o = run_direct(d, ht=ht, tiles=tiles)
        assert rel(o, o_ref) < TOL_O and rel(ht, s_ref) < TOL_SC, tiles
    ungated = rd.chunk_gated_delta_rule2(d["q"], d["k"], d["v"], None, d["b"], d["w"], cu_seqlens=d["cu"],
                                         use_qk_l2norm_in_kernel=True)
    assert rel(o, ungated) < TOL_O



@pytest.mark.parametrize("prep_ctas", [2, 3])
@pytest.mark.parametrize("gate", ["mild", "strong"])
def test_rolled_prep_levels_agree(gate, prep_ctas):
    """The portable kernel's prep at ``prep_rolled`` 0, 1 and 2 (run-time loops, the same per-element operations
    in the same order) gives the same bits; "strong" gates reach the direct diagonal blocks."""
    import dataclasses

    lens = [0, 1, 17, 64, 65, 300]
    d = inputs(lens, 2, 2, 4, gate=gate)
    h0 = torch.randn(len(lens), 4, 128, 128, device=DEV) * 0.1
    p = GdnProblem(dtype="bfloat16", head_dim_k=128, head_dim_v=128, gate_domain="log", use_qk_l2norm=True,
                   gate_per_channel=True, arch=target_arch(DEV))
    base = chk.default_tiles(p, num_sms=132, chains=len(lens) * 4)
    outs = []
    for level in (0, 1, 2):
        ht = torch.full_like(h0, NAN)
        o = run_direct(d, h0=h0, ht=ht, tiles=dataclasses.replace(base, prep_ctas=prep_ctas, prep_rolled=level))
        outs.append((o, ht))
    for o, ht in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(ht, outs[0][1])
    o_ref, s_ref = oracle(d, h0)
    assert rel(outs[2][0], o_ref) < TOL_O and rel(outs[2][1], s_ref) < TOL_SC


@pytest.mark.parametrize("case", ["strong_fp16", "huge_bf16_no_l2norm"])
def test_compact_prep_layout_equals_the_wide_one(case):
    """``prep_ctas=3`` (the compact KDA prep layout: e formed from k and beta, buffers reused) computes exactly
    what ``prep_ctas=2`` does; strong gates take the direct diagonal blocks, which re-read q from global."""
    import dataclasses

    gate, dt, l2 = {"strong_fp16": ("strong", torch.float16, True),
                    "huge_bf16_no_l2norm": ("huge", torch.bfloat16, False)}[case]
    lens = [0, 1, 17, 64, 65, 300]
    d = inputs(lens, 2, 2, 4, gate=gate, dtype=dt)
    if not l2:  # bounded without l2norm
        d["k"] = (d["k"].float() / d["k"].float().norm(dim=-1, keepdim=True)).to(dt)
        d["q"] = (d["q"].float() / math.sqrt(128)).to(dt)
    h0 = torch.randn(len(lens), 4, 128, 128, device=DEV) * 0.1
    p = GdnProblem(dtype="bfloat16" if dt == torch.bfloat16 else "float16", head_dim_k=128, head_dim_v=128,
                   gate_domain="log", use_qk_l2norm=l2, gate_per_channel=True, arch=target_arch(DEV))
    base = chk.default_tiles(p, num_sms=132, chains=len(lens) * 4)
    outs = []
    for pc in (2, 3):
        ht = torch.full_like(h0, NAN)
        o = run_direct(d, h0=h0, ht=ht, l2norm=l2, tiles=dataclasses.replace(base, prep_ctas=pc))
        outs.append((o, ht))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    o_ref, s_ref = oracle(d, h0, l2norm=l2)
    assert rel(outs[1][0], o_ref) < TOL_O and rel(outs[1][1], s_ref) < TOL_SC

def test_api_fixed_length_equals_packed(chunked):
    B, T, H, HV = 2, 1000, 2, 2
    q, k = (torch.randn(B, T, H, 128, device=DEV).bfloat16() for _ in range(2))
    v = torch.randn(B, T, HV, 128, device=DEV).bfloat16()
    g = (-torch.rand(B, T, HV, 128, device=DEV)).bfloat16()
    beta = torch.rand(B, T, HV, device=DEV).bfloat16()
    h0 = torch.randn(B, HV, 128, 128, device=DEV) * 0.1
    st_f, st_p = h0.clone(), h0.clone()
    o_f, _ = api.recurrent_kda(q, k, v, g, beta, initial_state=st_f)
    flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    o_p, _ = api.recurrent_kda(*flat, initial_state=st_p, cu_seqlens=cu_of([T] * B))
    assert chunked and torch.equal(o_f.reshape(o_p.shape), o_p) and torch.equal(st_f, st_p)
    one = [x[:1] for x in (q, k, v, g, beta)]
    s1, s2 = h0[:1].clone(), h0[:1].clone()
    o1, _ = api.recurrent_kda(*one, initial_state=s1)
    o2, _ = api.recurrent_kda(*one, initial_state=s2, cu_seqlens=cu_of([T]))
    assert torch.equal(o1, o2) and torch.equal(s1, s2)


# ------------------------------------------------------------------ through the public API
@pytest.fixture
def chunked(monkeypatch):
    """Force this kernel through ``CUTEDSL_ATTN_GDN_KERNEL`` (the value dispatch names it by: ``kda_chunked``, or
    ``chunked`` where that value serves the per-channel problems too) and record that it launched."""
    from cutedsl_attn.dispatch import gdn_choice

    probe = GdnProblem(dtype="bfloat16", head_dim_k=128, head_dim_v=128, gate_domain="log", use_qk_l2norm=True,
                       gate_per_channel=True, arch=target_arch(DEV))
    for value in ("kda_chunked", "chunked"):
        monkeypatch.setenv("CUTEDSL_ATTN_GDN_KERNEL", value)
        try:
            if gdn_choice(probe)[0] is chk:
                break
        except (ValueError, NotImplementedError):
            pass
    else:
        pytest.fail("no CUTEDSL_ATTN_GDN_KERNEL value routes KDA / GDN-2 prefill to portable.kda_chunked")
    calls = []
    real = chk.launch

    def spy(fn, cfg, args):
        calls.append(cfg)
        real(fn, cfg, args)

    monkeypatch.setattr(chk, "launch", spy)
    return calls


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_api_recurrent_kda_in_place(chunked, state_dtype):
    H, HV = 2, 4
    T = sum(LENS)
    q = torch.randn(1, T, H, 128, device=DEV).bfloat16()
    k = torch.randn(1, T, H, 128, device=DEV).bfloat16()
    v = torch.randn(1, T, HV, 128, device=DEV).bfloat16()
    g = (-torch.rand(1, T, HV, 128, device=DEV) * 0.5).bfloat16()
    beta = torch.rand(1, T, HV, device=DEV).bfloat16()
    cu = cu_of(LENS)
    h0 = (torch.randn(len(LENS), HV, 128, 128, device=DEV) * 0.1).to(state_dtype)
    ref_state = h0.double()
    o_ref, _ = rd.recurrent_kda(q, k, v, g, beta, initial_state=ref_state, cu_seqlens=cu)
    out = torch.full(tuple(v.shape), NAN, device=DEV, dtype=torch.bfloat16)
    o, s = api.recurrent_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, output=out,
                             output_final_state=True)
    assert chunked, "the chunked kernel did not run"
    assert o is out and s is h0
    assert rel(o, o_ref) < TOL_O
    assert rel(h0, ref_state) < (TOL_SC if state_dtype == torch.float32 else TOL_S16)


def test_api_recurrent_kda_safe_gate_logits(chunked):
    H, HV, T = 2, 4, 333
    q, k = (torch.randn(1, T, H, 128, device=DEV).bfloat16() for _ in range(2))
    v = torch.randn(1, T, HV, 128, device=DEV).bfloat16()
    g = torch.randn(1, T, HV, 128, device=DEV).bfloat16()
    beta = torch.randn(1, T, HV, device=DEV).bfloat16()
    A_log, dt_bias = torch.rand(HV, device=DEV) - 0.5, torch.randn(HV * 128, device=DEV) * 0.5
    extra = dict(A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True,
                 cu_seqlens=cu_of([5, 0, 64, 264]), output_final_state=True)
    o, fin = api.recurrent_kda(q, k, v, g, beta, **extra)
    o_ref, f_ref = rd.recurrent_kda(q, k, v, g, beta, **extra)
    assert chunked and rel(o, o_ref) < TOL_O and rel(fin, f_ref) < TOL_SC


def test_api_gdn2_fixed_and_packed(chunked):
    lens = [0, 17, 64, 1000]
    d = inputs(lens, 2, 2, 4, gdn2=True)
    h0 = torch.randn(len(lens), 4, 128, 128, device=DEV) * 0.1
    o_ref, s_ref = oracle(d, h0)
    out = torch.full((sum(lens), 4, 128), NAN, device=DEV, dtype=torch.bfloat16)
    st = torch.full_like(h0, NAN)
    o, s = api.chunk_gated_delta_rule2(d["q"], d["k"], d["v"], d["g"], d["b"], d["w"], initial_state=h0,
                                       output_final_state=True, cu_seqlens=d["cu"], use_qk_l2norm_in_kernel=True,
                                       output=out, output_state=st, backend="cute")
    assert chunked and o is out and s is st
    assert rel(o, o_ref) < TOL_O and rel(s, s_ref) < TOL_SC
