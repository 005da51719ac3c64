"""GPU tests of the context-parallel (split-sequence) GDN prefill path against the plain launch and the float64
oracle.

Fresh random inputs every run, outputs and states poisoned with NaN before each launch, relative Frobenius
error against ``cutedsl_attn.ref.chunk_gated_delta_rule`` (token-serial, float64) on the same rounded inputs.
Gates are kept weak (alpha near 1, small beta) so the state carries across segment boundaries: a wrong chain
(a transition or offset off, a segment started from the wrong state) is far off, which each test checks.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from cutedsl_attn.api import gdn as api  # noqa: E402
from cutedsl_attn.dispatch import gdn as d  # noqa: E402
from cutedsl_attn.ref.gdn import chunk_gated_delta_rule as oracle  # noqa: E402

DEV = torch.device("cuda")
TOL_O = 1e-2  # 16-bit output rounding
TOL_S = 1e-2  # the chunked kernel's 16-bit state MMA operands, through the segments' transitions and the chain
TOL_CP = 1e-2  # context parallel against the plain launch


def rel(x, y):
    x, y = x.double(), y.double()
    assert torch.isfinite(x).all(), "non-finite values (a NaN-poisoned element was not written)"
    return ((x - y).norm() / max(y.norm().item(), 1e-30)).item()


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), device=DEV, dtype=dtype)


def make(lens, hq, hk, hv, K=128, V=128, *, init=True, state_dtype=torch.float32, l2norm=True, pool=0):
    T, ho = sum(lens), max(hq, hv)
    k = torch.randn(T, hk, K, device=DEV)
    k = (k if l2norm else k / k.norm(dim=-1, keepdim=True)).bfloat16()
    rows = pool or len(lens)
    return dict(q=torch.randn(T, hq, K, device=DEV).bfloat16(), k=k, v=torch.randn(T, hv, V, device=DEV).bfloat16(),
                g=1 - torch.rand(T, ho, device=DEV) * 1e-4, beta=torch.rand(T, ho, device=DEV) * 0.01,
                cu_seqlens=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV),
                initial_state=(torch.randn(rows, ho, V, K, device=DEV) * 0.5).to(state_dtype) if init else None,
                use_qk_l2norm_in_kernel=l2norm)


def run(kw, use_cp, *, state_dtype=torch.float32, **extra):
    T, ho, V, K = kw["q"].shape[0], max(kw["q"].shape[1], kw["v"].shape[1]), kw["v"].shape[2], kw["q"].shape[2]
    n = kw["cu_seqlens"].shape[0] - 1
    out, st = poisoned((T, ho, V), kw["q"].dtype), poisoned((n, ho, V, K), state_dtype)
    o, s = api.chunk_gated_delta_rule(**kw, output=out, output_state=st, output_final_state=True, use_cp=use_cp,
                                      **extra)
    assert o is out and s is st
    return o, s


def segments(kw, use_cp):
    problem, args, _ = api._plan_prefill(
        kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], None, kw["initial_state"], True, kw["cu_seqlens"],
        kw["use_qk_l2norm_in_kernel"], None, None, None, None, 0, use_cp, None, None, "auto", None, "linear")
    return d.gdn_cp_segments(problem, args, use_cp)


@pytest.mark.parametrize("T", [65536, 4097])
@pytest.mark.parametrize("init", [True, False])
def test_one_long_sequence_tp8_heads(T, init):
    kw = make([T], 2, 2, 8, init=init)  # 2 q/k heads, 8 v heads (GVA): a TP8-sized layer
    assert segments(kw, True) >= 2
    if T == 65536 and torch.cuda.get_device_properties(DEV).multi_processor_count == 132:
        assert segments(kw, "auto") == 1  # auto keeps the plain launch while planning.gdn_cp.CP_AUTO is off
    o_ref, s_ref = oracle(**kw, output_final_state=True)
    o_cp, s_cp = run(kw, True)
    o_pl, s_pl = run(kw, False)
    assert rel(o_cp, o_ref) < TOL_O and rel(s_cp, s_ref) < TOL_S
    assert rel(o_pl, o_ref) < TOL_O
    assert rel(o_cp, o_pl) < TOL_CP and rel(s_cp, s_pl) < TOL_CP
    # not vacuous: the plain path's segment-local answer (each segment from zeros) is far off
    P = segments(kw, True)
    from cutedsl_attn.planning.gdn_cp import cp_segment_offsets
    seg = cp_segment_offsets(kw["cu_seqlens"], P)
    local = api.chunk_gated_delta_rule(**{**kw, "cu_seqlens": seg, "initial_state": None}, use_cp=False)
    assert rel(local, o_ref) > 0.05


@pytest.mark.parametrize("dims", [(64, 64), (64, 128), (128, 64)])
@pytest.mark.parametrize("heads", [(2, 2, 8), (8, 2, 2)])  # GVA, GQA
def test_head_dims_and_groupings(dims, heads):
    kw = make([0, 4097, 1, 0, 1000], *heads, *dims, l2norm=heads == (8, 2, 2))
    o_ref, s_ref = oracle(**kw, output_final_state=True)
    o, s = run(kw, True)
    assert rel(o, o_ref) < TOL_O and rel(s, s_ref) < TOL_S
    assert torch.equal(s[[0, 3]].cpu(), kw["initial_state"][[0, 3]].cpu())  # empty sequences keep their state


def test_bf16_state_and_no_state_returned():
    kw = make([4097, 300], 2, 2, 8, state_dtype=torch.bfloat16)
    o_ref, s_ref = oracle(**kw, output_final_state=True)
    o, s = run(kw, True, state_dtype=torch.bfloat16)
    assert s.dtype == torch.bfloat16 and rel(o, o_ref) < TOL_O and rel(s, s_ref) < TOL_S
    o2 = api.chunk_gated_delta_rule(**kw, use_cp=True)  # no state written or returned
    assert isinstance(o2, torch.Tensor) and rel(o2, o_ref) < TOL_O


@pytest.mark.parametrize("in_place", [True, False])
def test_state_pool(in_place):
    kw = make([4097, 2000], 2, 2, 8, pool=6)
    idx = torch.tensor([4, 1], device=DEV, dtype=torch.int32)
    pool = kw["initial_state"]
    before = pool.clone()
    o_ref, s_ref = oracle(**{**kw, "initial_state": before}, state_indices=idx, output_final_state=True)
    dst = pool if in_place else poisoned(pool.shape, pool.dtype)
    out = poisoned(kw["v"].shape[:1] + (8, 128), torch.bfloat16)
    o, s = api.chunk_gated_delta_rule(**kw, output=out, output_state=dst, state_indices=idx, output_final_state=True,
                                      use_cp=True)
    assert s is dst and rel(o, o_ref) < TOL_O and rel(dst[idx.long()], s_ref) < TOL_S
    if in_place:
        others = [0, 2, 3, 5]
        assert torch.equal(pool[others], before[others])


def test_cuda_graph_replay():
    kw = make([4097, 1000], 2, 2, 8)
    out = poisoned((5097, 8, 128), torch.bfloat16)
    st = poisoned((2, 8, 128, 128), torch.float32)
    api.chunk_gated_delta_rule(**kw, output=out, output_state=st, use_cp=True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        api.chunk_gated_delta_rule(**kw, output=out, output_state=st, use_cp=True)
    for _ in range(2):
        kw["q"].copy_(torch.randn_like(kw["q"]))
        kw["v"].copy_(torch.randn_like(kw["v"]))
        out.fill_(float("nan"))
        st.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        o_ref, s_ref = oracle(**kw, output_final_state=True)
        assert rel(out, o_ref) < TOL_O and rel(st, s_ref) < TOL_S


def test_recurrent_kernel_through_the_split(monkeypatch):
    # the path is kernel-agnostic: the forced recurrent kernel runs the same three phases
    monkeypatch.setenv(d.GDN_KERNEL_ENV, "recurrent")
    kw = make([4097], 2, 2, 8)
    o_ref, s_ref = oracle(**kw, output_final_state=True)
    o, s = run(kw, True)
    assert rel(o, o_ref) < TOL_O and rel(s, s_ref) < 2e-3
