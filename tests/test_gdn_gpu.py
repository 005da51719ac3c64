"""GPU tests of the gated delta rule ops (the chunked CuTe DSL kernel for prefill, the recurrent one for decode and
where forced) against the float64 oracle.

Fresh random inputs every run, outputs and states poisoned with NaN before each launch, relative Frobenius
error against ``cutedsl_attn.ref.chunk_gated_delta_rule`` (token-serial, float64) on the same rounded inputs.
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from cutedsl_attn.api import gdn as api  # noqa: E402
from cutedsl_attn.ref.gdn import chunk_gated_delta_rule as oracle  # noqa: E402

DEV = torch.device("cuda")
TOL_O = 1e-2  # 16-bit output rounding
TOL_S32 = 1e-3  # fp32 state, token-serial recurrent kernel (fp32 throughout)
TOL_S16 = 1e-2  # bf16 state rounding
TOL_SC = 5e-3  # fp32 state of the chunked kernel: its MMAs take the state and V' rounded to 16 bits (FlashInfer's)


def rel(x, y):
    x, y = x.double(), y.double()
    assert torch.isfinite(x).all(), "non-finite values (a NaN-poisoned element was not written)"
    return ((x - y).norm() / max(y.norm().item(), 1e-30)).item()


def make(lens, hq, hk, hv, K, V, *, dtype=torch.bfloat16, init=True, state_dtype=torch.float32, l2norm=False,
         gate_lo=0.5, pool=0):
    T = sum(lens)
    ho = max(hq, hv)
    q = torch.randn(T, hq, K, device=DEV).to(dtype)
    k = torch.randn(T, hk, K, device=DEV)
    if not l2norm:
        k = k / k.norm(dim=-1, keepdim=True)
    k = k.to(dtype)
    v = torch.randn(T, hv, V, device=DEV).to(dtype)
    g = torch.rand(T, ho, device=DEV) * (1 - gate_lo) + gate_lo
    beta = torch.rand(T, ho, device=DEV)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    rows = pool or len(lens)
    h0 = (torch.randn(rows, ho, V, K, device=DEV) * 0.1).to(state_dtype) if init else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu, initial_state=h0,
                use_qk_l2norm_in_kernel=l2norm)


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), device=DEV, dtype=dtype)


def run_both(kw, *, state_dtype=torch.float32, **extra):
    T, ho, V = kw["v"].shape[0], max(kw["q"].shape[1], kw["v"].shape[1]), kw["v"].shape[2]
    K = kw["q"].shape[2]
    n = kw["cu_seqlens"].shape[0] - 1
    out = poisoned((T, ho, V), kw["q"].dtype)
    st = poisoned((n, ho, V, K), state_dtype)
    o, s = api.chunk_gated_delta_rule(**kw, output=out, output_state=st, output_final_state=True, **extra)
    assert o is out and s is st
    o_ref, s_ref = oracle(**kw, output_final_state=True, **extra)
    return o, s, o_ref, s_ref


LENS = [0, 1, 63, 64, 65, 300]


@pytest.mark.parametrize("dims", [(128, 128), (64, 64), (64, 128), (128, 64)])
@pytest.mark.parametrize("heads", [(4, 4, 8), (8, 4, 4), (2, 2, 2)])  # GVA, GQA, MHA
def test_prefill_vs_oracle(dims, heads):
    K, V = dims
    init = heads != (2, 2, 2)
    kw = make(LENS, *heads, K, V, init=init, l2norm=heads == (8, 4, 4))
    o, s, o_ref, s_ref = run_both(kw)
    assert rel(o, o_ref) < TOL_O
    assert rel(s, s_ref) < TOL_SC
    # a transposed state (K != V) or a wrong head map is far off: the check is not vacuous
    if K == V and init:
        assert rel(s.transpose(-1, -2), s_ref) > 0.1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_many_short_and_one_long(dtype):
    lens = [3, 17, 1, 0, 9] * 4 + [4097]
    kw = make(lens, 2, 2, 4, 128, 128, dtype=dtype, gate_lo=0.9)
    o, s, o_ref, s_ref = run_both(kw)
    assert rel(o, o_ref) < TOL_O and rel(s, s_ref) < TOL_SC


def test_bf16_state():
    kw = make(LENS, 2, 2, 4, 128, 128, state_dtype=torch.bfloat16)
    o, s, o_ref, s_ref = run_both(kw, state_dtype=torch.bfloat16)
    assert s.dtype == torch.bfloat16
    assert rel(o, o_ref) < TOL_O and rel(s, s_ref) < TOL_S16


def test_log_gate_domain_and_strong_gates():
    kw = make(LENS, 2, 2, 4, 64, 64, gate_lo=0.0)
    o_lin, s_lin, o_ref, s_ref = run_both(kw)
    kw_log = dict(kw, g=torch.log(kw["g"].clamp_min(1e-6)))
    o_log, s_log, _, _ = run_both(kw_log, gate_domain="log")
    assert rel(o_lin, o_ref) < TOL_O and rel(o_log, o_ref) < TOL_O and rel(s_log, s_ref) < TOL_SC


def test_alpha_one_equals_ungated_and_zero_state_equals_none():
    kw = make(LENS, 2, 2, 4, 128, 128)
    a = api.chunk_gated_delta_rule(**dict(kw, g=torch.ones_like(kw["g"])))
    b = api.chunk_gated_delta_rule(**dict(kw, g=None))
    assert torch.equal(a, b)
    assert rel(b, oracle(**dict(kw, g=None))) < TOL_O
    c = api.chunk_gated_delta_rule(**dict(kw, initial_state=torch.zeros_like(kw["initial_state"])))
    d = api.chunk_gated_delta_rule(**dict(kw, initial_state=None))
    assert torch.equal(c, d)


def test_no_state_requested_and_allocated_outputs():
    kw = make(LENS, 2, 2, 4, 128, 128)
    o = api.chunk_gated_delta_rule(**kw)
    assert isinstance(o, torch.Tensor) and o.shape == (sum(LENS), 4, 128)
    o2, s2 = api.chunk_gated_delta_rule(**kw, output_final_state=True)
    assert s2.dtype == torch.float32 and s2.shape == (len(LENS), 4, 128, 128)
    o_ref, s_ref = oracle(**kw, output_final_state=True)
    assert rel(o, o_ref) < TOL_O and torch.equal(o, o2) and rel(s2, s_ref) < TOL_SC
    # 4-D input with a leading batch dim of 1 keeps it
    kw4 = {**kw, **{n: kw[n][None] for n in ("q", "k", "v", "g", "beta")}}
    o4 = api.chunk_gated_delta_rule(**kw4)
    assert o4.shape == (1,) + o.shape and torch.equal(o4[0], o)


@pytest.mark.parametrize("in_place", [False, True])
def test_state_pool(in_place):
    lens = [5, 0, 70, 1]
    kw = make(lens, 2, 2, 4, 128, 128, pool=9)
    pool = kw["initial_state"]
    idx = torch.tensor([7, 2, 0, 5], device=DEV, dtype=torch.int32)
    before = pool.clone()
    out_pool = pool if in_place else torch.full_like(pool, float("nan"))
    o, s = api.chunk_gated_delta_rule(**kw, state_indices=idx, output_state=out_pool, output_final_state=True)
    o_ref, s_ref = oracle(**dict(kw, initial_state=before[idx.long()]), output_final_state=True)
    assert s is out_pool
    assert rel(o, o_ref) < TOL_O and rel(s[idx.long()], s_ref) < TOL_SC
    others = [r for r in range(9) if r not in idx.tolist()]
    if in_place:
        assert torch.equal(s[others], before[others])  # rows no sequence owns are untouched
    else:
        assert torch.isnan(s[others]).all()


def test_fused_projection_views():
    T, H, D = 130, 4, 128
    buf = torch.randn(T, 3 * H * D + 8, device=DEV).bfloat16()
    q = buf[:, :H * D].view(T, H, D)
    k = buf[:, H * D:2 * H * D].view(T, H, D)
    v = buf[:, 2 * H * D:3 * H * D].view(T, H, D)
    g = torch.rand(T, H, device=DEV) * 0.5 + 0.5
    beta = torch.rand(T, H, device=DEV)
    cu = torch.tensor([0, 60, T], dtype=torch.int32, device=DEV)
    o = api.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    assert rel(o, oracle(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)) < TOL_O


def test_loop_of_calls_on_ragged_batch():
    lens = [37, 0, 5, 129, 64, 1, 12]
    st = (torch.randn(len(lens), 4, 128, 128, device=DEV) * 0.1)
    st_ref = st.double()
    for _ in range(100):  # a public SM100 GDN kernel deadlocked in such a loop
        kw = make(lens, 2, 2, 4, 128, 128, init=False)
        out = poisoned((sum(lens), 4, 128), torch.bfloat16)
        nxt = poisoned(st.shape, torch.float32)
        o, st = api.chunk_gated_delta_rule(**dict(kw, initial_state=st), output=out, output_state=nxt,
                                           output_final_state=True)
        o_ref, st_ref = oracle(**dict(kw, initial_state=st_ref), output_final_state=True)
        assert rel(o, o_ref) < TOL_O
    torch.cuda.synchronize()
    assert rel(st, st_ref) < TOL_SC


def decode_inputs(B, H, HV, K, V, T=1):
    q = torch.randn(B, T, H, K, device=DEV).bfloat16()
    k = torch.randn(B, T, H, K, device=DEV).bfloat16()
    v = torch.randn(B, T, HV, V, device=DEV).bfloat16()
    A_log = torch.rand(HV, device=DEV) - 1.0
    dt_bias = torch.rand(HV, device=DEV)
    a = torch.randn(B, T, HV, device=DEV).bfloat16()
    b = torch.randn(B, T, HV, device=DEV).bfloat16()
    return q, k, v, A_log, a, dt_bias, b


def decode_oracle(q, k, v, A_log, a, dt_bias, b, h0):
    B, T = q.shape[:2]
    alpha = torch.exp(-torch.exp(A_log.double()) * torch.nn.functional.softplus(a.double() + dt_bias.double()))
    beta = torch.sigmoid(b.double())
    cu = torch.arange(0, (B + 1) * T, T, device=DEV)
    flat = [x.reshape(B * T, *x.shape[2:]) for x in (q, k, v)]
    return oracle(*flat, alpha.reshape(B * T, -1), beta.reshape(B * T, -1), initial_state=h0, cu_seqlens=cu,
                  use_qk_l2norm_in_kernel=True, output_final_state=True)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3])
def test_decode_steps(state_dtype, T):
    B, H, HV, D = 8, 4, 8, 128
    state = (torch.randn(B, HV, D, D, device=DEV) * 0.1).to(state_dtype)
    ref_state = state.double()
    for _ in range(5):
        args = decode_inputs(B, H, HV, D, D, T)
        out = poisoned((B, T, HV, D), torch.bfloat16)
        o, s = api.gated_delta_rule_decode_pretranspose(*args[:3], state, *args[3:], output=out)
        assert o is out and s is state
        o_ref, ref_state = decode_oracle(*args, ref_state)
        assert rel(o.reshape(B * T, HV, D), o_ref) < TOL_O
        if state_dtype == torch.bfloat16:
            ref_state = ref_state.to(torch.bfloat16).double()  # the kernel rounds the state once a call
    assert rel(state, ref_state) < (TOL_S32 if state_dtype == torch.float32 else TOL_S16)


def test_decode_pool_and_k_major():
    B, H, HV, D = 6, 2, 8, 128
    pool = torch.randn(20, HV, D, D, device=DEV) * 0.1
    before = pool.clone()
    idx = torch.tensor([3, 11, 0, 19, 7, 8], device=DEV, dtype=torch.int32)
    args = decode_inputs(B, H, HV, D, D)
    o, s = api.gated_delta_rule_decode_pretranspose(*args[:3], None, *args[3:], initial_state=pool,
                                                    initial_state_indices=idx)
    o_ref, s_ref = decode_oracle(*args, before[idx.long()])
    assert s is pool and rel(o.reshape(B, HV, D), o_ref) < TOL_O and rel(pool[idx.long()], s_ref) < TOL_S32
    others = [r for r in range(20) if r not in idx.tolist()]
    assert torch.equal(pool[others], before[others])
    # K-major entry point: the same step on the transposed state
    kmaj = before[idx.long()].transpose(-1, -2).contiguous()
    o2, s2 = api.gated_delta_rule_decode(*args[:3], kmaj, *args[3:])
    assert s2 is kmaj and torch.equal(o2, o) and torch.equal(kmaj.transpose(-1, -2), pool[idx.long()])


def test_cuda_graph_replay():
    kw = make([5, 40, 0, 17], 2, 2, 4, 128, 128)
    out = poisoned((62, 4, 128), torch.bfloat16)
    st = poisoned((4, 4, 128, 128), torch.float32)
    api.chunk_gated_delta_rule(**kw, output=out, output_state=st)  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        api.chunk_gated_delta_rule(**kw, output=out, output_state=st)
    for _ in range(2):
        kw["q"].copy_(torch.randn_like(kw["q"]))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        o_ref, s_ref = oracle(**kw, output_final_state=True)
        assert rel(out, o_ref) < TOL_O and rel(st, s_ref) < TOL_SC


@pytest.mark.parametrize("dims", [(128, 128), (64, 128), (128, 64)])
@pytest.mark.parametrize("tiles", [(64, 4), (64, 8), (32, 4), (32, 8)])
def test_chunked_kernel_tiles(dims, tiles):
    """The chunked kernel directly, every tile shape, chunk tails (0, 1, 63, 64, 65, 4097 tokens) vs the oracle."""
    from cutedsl_attn.compile import get_compiled
    from cutedsl_attn.portable import gdn_chunked as chk

    K, V = dims
    if V % tiles[0]:
        pytest.skip("tile_v must divide V")
    lens = [0, 1, 63, 64, 65, 4097, 130]
    kw = make(lens, 2, 2, 4, K, V, l2norm=True)
    n, T = len(lens), sum(lens)
    out = poisoned((T, 4, V), torch.bfloat16)
    st = poisoned((n, 4, V, K), torch.float32)
    problem, args, _ = api._plan_prefill(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], None, kw["initial_state"],
                                         True, kw["cu_seqlens"], True, out, st, None, None, 0, "auto", None, None,
                                         "auto", None, "linear")
    cfg = chk.Config(problem, chk.Tiles(tile_v=tiles[0], num_warps=tiles[1]))
    chk.launch(get_compiled(chk.NAME, cfg, chk.compile), cfg, args)
    o_ref, s_ref = oracle(**kw, output_final_state=True)
    assert rel(out, o_ref) < TOL_O and rel(st, s_ref) < TOL_SC


def test_chunked_equals_recurrent(monkeypatch):
    """The two kernels agree with each other to the chunked kernel's rounding (a transposed state would not)."""
    kw = make([200, 77], 2, 2, 2, 128, 64)
    outs = []
    for kern in ("chunked", "recurrent"):
        monkeypatch.setenv("CUTEDSL_ATTN_GDN_KERNEL", kern)
        o, s, _, _ = run_both(kw)
        outs.append((o.clone(), s.clone()))
    assert rel(outs[0][0], outs[1][0]) < TOL_O and rel(outs[0][1], outs[1][1]) < TOL_SC


@pytest.mark.parametrize("dim,tiles", [(128, t) for t in [(16, 4, 1, 32), (16, 4, 2, 16), (8, 8, 4, 32),
                                                            (64, 8, 1, 32), (4, 4, 4, 32), (16, 4, 2, 8),
                                                            (32, 4, 4, 16), (16, 2, 1, 8), (32, 8, 2, 16)]]
                         + [(64, (32, 4, 4, 4)), (64, (16, 4, 2, 8))])
def test_recurrent_kernel_tiles(dim, tiles):
    """The kernel module directly, every tile shape (block tails of the prefetch included) vs the oracle."""

    from cutedsl_attn.compile import get_compiled
    from cutedsl_attn.portable import gdn_recurrent as rec

    kw = make(LENS + [7, 2], 2, 2, 4, dim, dim)
    n, T = len(LENS) + 2, sum(LENS) + 9
    out = poisoned((T, 4, dim), torch.bfloat16)
    st = poisoned((n, 4, dim, dim), torch.float32)
    problem, args, _ = api._plan_prefill(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], None, kw["initial_state"],
                                         True, kw["cu_seqlens"], False, out, st, None, None, 0, "auto", None, None,
                                         "auto", None, "linear")
    tv, nw, pf, lanes = tiles
    cfg = rec.Config(problem, rec.Tiles(tile_v=tv, num_warps=nw, prefetch=pf, lanes_per_row=lanes))
    rec.launch(get_compiled(rec.NAME, cfg, rec.compile), cfg, args)
    o_ref, s_ref = oracle(**kw, output_final_state=True)
    assert rel(out, o_ref) < TOL_O and rel(st, s_ref) < TOL_S32


@pytest.mark.parametrize("dims", [(128, 64), (64, 128)])
def test_decode_k_major_vs_oracle(dims):
    K, V = dims
    B, H, HV = 5, 2, 4
    state_v = torch.randn(B, HV, V, K, device=DEV) * 0.1
    kmaj = state_v.transpose(-1, -2).contiguous()  # [B, HV, K, V]
    args = decode_inputs(B, H, HV, K, V)
    o, s = api.gated_delta_rule_decode(*args[:3], kmaj, *args[3:])
    o_ref, s_ref = decode_oracle(*args, state_v.double())
    assert s is kmaj and rel(o.reshape(B, HV, V), o_ref) < TOL_O
    assert rel(kmaj.transpose(-1, -2), s_ref) < TOL_S32
