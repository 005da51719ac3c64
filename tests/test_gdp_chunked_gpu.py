"""GPU tests of Gated DeltaProduct on the chunked GDN kernel (GDN on the expanded timeline of ``T n`` rows) against
the float64 oracle, the recurrent kernel (``CUTEDSL_ATTN_GDN_KERNEL=recurrent``) and GDN itself at n = 1.

Fresh random inputs every run, outputs and states poisoned with NaN before each launch, relative Frobenius
error against ``cutedsl_attn.ref.chunk_gated_delta_product`` (token-serial, float64) on the same rounded inputs.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from cutedsl_attn.api import delta_family as api  # noqa: E402
from cutedsl_attn.api import gdn as gapi  # noqa: E402
from cutedsl_attn.dispatch import gdn as d  # noqa: E402
from cutedsl_attn.planning.gdn import GdnProblem  # noqa: E402
from cutedsl_attn.ref import delta_family as rd  # noqa: E402

DEV = torch.device("cuda")
TOL_O = 1e-2  # 16-bit output rounding
TOL_S = 5e-3  # fp32 state: the chunked kernel's MMAs take the state rounded to 16 bits (as GDN prefill)
TOL_S16 = 1e-2  # bf16 state rounding
TOL_REC = 1e-3  # fp32 state of the recurrent kernel
LENS = [0, 1, 63, 64, 65, 1000]


def rel(x, y):
    x, y = x.double(), y.double()
    assert torch.isfinite(x).all(), "non-finite values (a NaN-poisoned element was not written)"
    return ((x - y).norm() / max(y.norm().item(), 1e-30)).item()


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), device=DEV, dtype=dtype)


def gdp_inputs(lens, n, hq, hk, hv, K=128, V=128, *, state_dtype=torch.float32, l2norm=False, init=True):
    T, ho = sum(lens), max(hq, hv)
    k = torch.randn(T * n, hk, K, device=DEV)
    return dict(q=torch.randn(T, hq, K, device=DEV).bfloat16(),
                k=(k if l2norm else k / k.norm(dim=-1, keepdim=True)).bfloat16(),
                v=torch.randn(T * n, hv, V, device=DEV).bfloat16(), g=torch.rand(T, ho, device=DEV) * 0.5 + 0.5,
                beta=torch.rand(T * n, ho, device=DEV), num_householder=n,
                cu_seqlens=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV),
                initial_state=(torch.randn(len(lens), ho, V, K, device=DEV) * 0.1).to(state_dtype) if init else None,
                use_qk_l2norm_in_kernel=l2norm)


def run(kw, state_dtype=torch.float32):
    T, ho, V, K = kw["q"].shape[0], max(kw["q"].shape[1], kw["v"].shape[1]), kw["v"].shape[2], kw["q"].shape[2]
    n_seq = kw["cu_seqlens"].shape[0] - 1
    out, st = poisoned((T, ho, V), torch.bfloat16), poisoned((n_seq, ho, V, K), state_dtype)
    o, s = api.chunk_gated_delta_product(**kw, output=out, output_state=st, output_final_state=True, backend="cute")
    assert o is out and s is st
    return o, s


def test_auto_routes_gdp_to_the_chunked_kernel(monkeypatch):
    monkeypatch.delenv(d.GDN_KERNEL_ENV, raising=False)
    p = GdnProblem(dtype="bfloat16", head_dim_k=128, head_dim_v=128, num_householder=2, arch=d.gdn_arch(DEV))
    module, cfg = d.gdn_choice(p)
    assert module.NAME in ("gdn_chunked", "gdn_chunked_sm90") and cfg.problem.num_householder == 1
    monkeypatch.setenv(d.GDN_KERNEL_ENV, "recurrent")
    module, cfg = d.gdn_choice(p)
    assert module.NAME == "gdn_recurrent" and cfg.problem == p


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("heads,dims", [((2, 2, 4), (128, 128)), ((4, 2, 2), (64, 64)), ((2, 2, 4), (64, 128))])
def test_gdp_vs_oracle(n, heads, dims):
    kw = gdp_inputs(LENS, n, *heads, *dims, l2norm=heads == (4, 2, 2))
    o_ref, s_ref = rd.chunk_gated_delta_product(**kw, output_final_state=True)
    o, s = run(kw)
    assert rel(o, o_ref) < TOL_O and rel(s, s_ref) < TOL_S
    if dims[0] == dims[1]:
        assert rel(s.transpose(-1, -2), s_ref) > 0.1  # orientation pinned (K == V hides a transpose)


def test_gdp_long_bf16_state_no_initial_state():
    kw = gdp_inputs([4097, 5], 2, 2, 2, 4, state_dtype=torch.bfloat16, init=False, l2norm=True)
    o_ref, s_ref = rd.chunk_gated_delta_product(**kw, output_final_state=True)
    o, s = run(kw, torch.bfloat16)
    assert s.dtype == torch.bfloat16 and rel(o, o_ref) < TOL_O and rel(s, s_ref) < TOL_S16


def test_one_update_equals_gdn_and_alpha_one_is_ungated():
    kw = gdp_inputs(LENS, 1, 2, 2, 4)
    o1, s1 = run(kw)
    gd = {k: kw[k] for k in ("q", "k", "v", "g", "beta", "cu_seqlens", "initial_state", "use_qk_l2norm_in_kernel")}
    o2, s2 = gapi.chunk_gated_delta_rule(**gd, output_final_state=True)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)  # n = 1 is the same GDN launch
    kw2 = gdp_inputs(LENS, 2, 2, 2, 4)
    ones = api.chunk_gated_delta_product(**{**kw2, "g": torch.ones_like(kw2["g"])}, backend="cute")
    none = api.chunk_gated_delta_product(**{**kw2, "g": None}, backend="cute")
    assert rel(ones, none) < 1e-6
    assert rel(none, rd.chunk_gated_delta_product(**{**kw2, "g": None})) < TOL_O


def test_recurrent_kernel_stays_selectable(monkeypatch):
    kw = gdp_inputs(LENS, 3, 2, 2, 4, l2norm=True)
    o_ref, s_ref = rd.chunk_gated_delta_product(**kw, output_final_state=True)
    o_c, s_c = run(kw)
    monkeypatch.setenv(d.GDN_KERNEL_ENV, "recurrent")
    o_r, s_r = run(kw)
    assert rel(o_r, o_ref) < TOL_O and rel(s_r, s_ref) < TOL_REC
    assert rel(o_c, o_r) < TOL_O and rel(s_c, s_r) < TOL_S


def test_cuda_graph_replay():
    kw = gdp_inputs([1000, 65], 2, 2, 2, 4)
    out, st = poisoned((1065, 4, 128), torch.bfloat16), poisoned((2, 4, 128, 128), torch.float32)
    api.chunk_gated_delta_product(**kw, output=out, output_state=st, backend="cute")  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        api.chunk_gated_delta_product(**kw, output=out, output_state=st, backend="cute")
    for _ in range(2):
        kw["q"].copy_(torch.randn_like(kw["q"]))
        out.fill_(float("nan"))
        st.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        o_ref, s_ref = rd.chunk_gated_delta_product(**kw, output_final_state=True)
        assert rel(out, o_ref) < TOL_O and rel(st, s_ref) < TOL_S
