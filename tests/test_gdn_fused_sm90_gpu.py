"""GPU tests of the fused SM90 GDN kernel (opt-in: ``CUTEDSL_ATTN_GDN_KERNEL=fused_sm90``) against the float64
oracle and against the two-kernel SM90 chunked kernel.  Needs an SM90 GPU (H100 / H200).

Fresh random inputs every run, outputs and states poisoned with NaN before each launch, relative Frobenius
error against ``cutedsl_attn.ref.chunk_gated_delta_rule`` (token-serial, float64) on the same rounded inputs.
The fused kernel runs the two-kernel path's consumer code on the prep's values computed by the same device
functions, so the two paths are expected to agree bit for bit.
"""

import os

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the fused SM90 GDN kernel needs an SM90 GPU", allow_module_level=True)

from cutedsl_attn.api import gdn as api  # noqa: E402
from cutedsl_attn.dispatch import gdn as dg  # noqa: E402
from cutedsl_attn.ref.gdn import chunk_gated_delta_rule as oracle  # noqa: E402
from cutedsl_attn.sm90 import gdn_fused as fused  # noqa: E402

DEV = torch.device("cuda")
TOL_O = 1e-2  # 16-bit output rounding
TOL_SC = 5e-3  # fp32 state: the MMAs take the state and V' rounded to 16 bits (FlashInfer's tolerance)
TOL_S16 = 1e-2  # bf16 state rounding
LENS = [0, 1, 63, 64, 65, 1000, 4097]


LAUNCHES = []  # configs of the fused kernel's launches (the dispatcher calls fused.launch)


@pytest.fixture(autouse=True)
def _fused_kernel(monkeypatch):
    # the dispatcher's forced entry (a no-op once dispatch lists fused_sm90 itself)
    monkeypatch.setitem(dg._FORCED, "fused_sm90", fused)
    launch = fused.launch

    def counted(fn, cfg, args):
        LAUNCHES.append(cfg)
        launch(fn, cfg, args)

    monkeypatch.setattr(fused, "launch", counted)
    if "fused_sm90" not in dg._GDN_KERNELS:
        monkeypatch.setattr(dg, "_GDN_KERNELS", (*dg._GDN_KERNELS, "fused_sm90"))
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_KERNEL", "fused_sm90")
    monkeypatch.delenv("CUTEDSL_ATTN_GDN_TUNE", raising=False)


def rel(x, y):
    x, y = x.double(), y.double()
    assert torch.isfinite(x).all(), "non-finite values (a NaN-poisoned element was not written)"
    return ((x - y).norm() / max(y.norm().item(), 1e-30)).item()


def make(lens, hq, hk, hv, K, V, *, dtype=torch.bfloat16, init=True, state_dtype=torch.float32, l2norm=False,
         gate_lo=0.5):
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
    h0 = (torch.randn(len(lens), ho, V, K, device=DEV) * 0.1).to(state_dtype) if init else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu, initial_state=h0, use_qk_l2norm_in_kernel=l2norm)


def run(kw, *, state_dtype=torch.float32, **extra):
    T, ho, V = kw["v"].shape[0], max(kw["q"].shape[1], kw["v"].shape[1]), kw["v"].shape[2]
    K = kw["q"].shape[2]
    n = kw["cu_seqlens"].shape[0] - 1
    out = torch.full((T, ho, V), float("nan"), device=DEV, dtype=kw["q"].dtype)
    st = torch.full((n, ho, V, K), float("nan"), device=DEV, dtype=state_dtype)
    n_launches = len(LAUNCHES)
    # use_cp=False: the context-parallel path would run the two-kernel split entries, not the fused kernel
    o, s = api.chunk_gated_delta_rule(**kw, output=out, output_state=st, output_final_state=True, use_cp=False,
                                      **extra)
    assert o is out and s is st
    fused_forced = os.environ.get("CUTEDSL_ATTN_GDN_KERNEL") == "fused_sm90"
    assert len(LAUNCHES) == n_launches + fused_forced  # the fused kernel ran (and only when forced)
    return o, s


def test_dispatch_runs_the_fused_kernel():
    from cutedsl_attn.dispatch import gdn_choice
    from cutedsl_attn.planning.gdn import GdnProblem

    module, cfg = gdn_choice(GdnProblem(dtype="bfloat16", head_dim_k=128, head_dim_v=128))
    assert module is fused and isinstance(cfg, fused.Config)


@pytest.mark.parametrize("dims", [(128, 128), (64, 64), (64, 128), (128, 64)])
@pytest.mark.parametrize("heads", [(4, 4, 8), (8, 4, 4), (2, 2, 2)])  # GVA, GQA, MHA
def test_vs_oracle(dims, heads):
    K, V = dims
    init = heads != (2, 2, 2)
    # l2norm on the GQA case at K = V = 128, everywhere else (fewer distinct kernels to compile)
    kw = make(LENS, *heads, K, V, init=init, l2norm=heads == (8, 4, 4) or dims != (128, 128))
    o, s = run(kw)
    o_ref, s_ref = oracle(**kw, output_final_state=True)
    assert rel(o, o_ref) < TOL_O
    assert rel(s, s_ref) < TOL_SC
    if K == V and init:  # a transposed state is far off: the check is not vacuous
        assert rel(s.transpose(-1, -2), s_ref) > 0.1
    # a length-0 sequence writes its initial state (zeros without one) as its final state
    want = kw["initial_state"][0].float() if init else torch.zeros_like(s[0], dtype=torch.float32)
    assert torch.equal(s[0].float(), want)


def test_three_stages(monkeypatch):
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_TUNE", "tile_v=64,num_stages=3")  # fits shared memory at K = 64
    kw = make(LENS + [130], 2, 2, 4, 64, 64, l2norm=True)
    o, s = run(kw)
    o_ref, s_ref = oracle(**kw, output_final_state=True)
    assert rel(o, o_ref) < TOL_O and rel(s, s_ref) < TOL_SC


@pytest.mark.parametrize("case", ["gva_l2norm", "gqa", "v64_l2norm"])
def test_two_prep_warpgroups(monkeypatch, case):
    """Prep warpgroups 0 and 1 take the even and the odd chunks (their own work rows and named barriers)."""
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_TUNE", "prep_warpgroups=2")
    heads, V = {"gva_l2norm": ((4, 4, 8), 128), "gqa": ((8, 4, 4), 128), "v64_l2norm": ((2, 2, 4), 64)}[case]
    kw = make(LENS, *heads, 128, V, l2norm=case != "gqa")
    o, s = run(kw)
    o_ref, s_ref = oracle(**kw, output_final_state=True)
    assert rel(o, o_ref) < TOL_O and rel(s, s_ref) < TOL_SC
    want = kw["initial_state"][0]  # the length-0 sequence
    assert torch.equal(s[0], want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_many_short_and_one_long(dtype):
    kw = make([3, 17, 1, 0, 9] * 4 + [4097], 2, 2, 4, 128, 128, dtype=dtype, gate_lo=0.9)
    o, s = run(kw)
    o_ref, s_ref = oracle(**kw, output_final_state=True)
    assert rel(o, o_ref) < TOL_O and rel(s, s_ref) < TOL_SC


def test_bf16_state():
    kw = make(LENS, 2, 2, 4, 128, 128, state_dtype=torch.bfloat16)
    o, s = run(kw, state_dtype=torch.bfloat16)
    o_ref, s_ref = oracle(**kw, output_final_state=True)
    assert s.dtype == torch.bfloat16
    assert rel(o, o_ref) < TOL_O and rel(s, s_ref) < TOL_S16


def test_log_gates_and_no_initial_state():
    kw = make(LENS, 2, 2, 4, 64, 64, gate_lo=0.0, init=False)
    kw_log = dict(kw, g=torch.log(kw["g"].clamp_min(1e-6)))
    o, s = run(kw_log, gate_domain="log")
    o_ref, s_ref = oracle(**kw, output_final_state=True)
    assert rel(o, o_ref) < TOL_O and rel(s, s_ref) < TOL_SC


def test_ungated_equals_delta_rule():
    """g = 1 everywhere and no g at all give the same result (the ungated delta rule); so do a zero initial
    state and none."""
    kw = make([65, 4097, 1], 2, 2, 4, 128, 128)
    o1, s1 = run(dict(kw, g=torch.ones_like(kw["g"])))
    o2, s2 = run(dict(kw, g=None))
    o_ref, s_ref = oracle(**dict(kw, g=None), output_final_state=True)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    assert rel(o2, o_ref) < TOL_O and rel(s2, s_ref) < TOL_SC
    o3, s3 = run(dict(kw, initial_state=torch.zeros_like(kw["initial_state"])))
    o4, s4 = run(dict(kw, initial_state=None))
    assert torch.equal(o3, o4) and torch.equal(s3, s4)  # a zero initial state equals none


def test_state_pool_in_place():
    lens = [5, 0, 70, 1]
    kw = make(lens, 2, 2, 4, 128, 128)
    pool = torch.randn(9, 4, 128, 128, device=DEV) * 0.1
    idx = torch.tensor([7, 2, 0, 5], device=DEV, dtype=torch.int32)
    before = pool.clone()
    n_launches = len(LAUNCHES)
    o, s = api.chunk_gated_delta_rule(**dict(kw, initial_state=pool), state_indices=idx, output_state=pool,
                                      output_final_state=True, use_cp=False)
    o_ref, s_ref = oracle(**dict(kw, initial_state=before[idx.long()]), output_final_state=True)
    assert len(LAUNCHES) == n_launches + 1
    assert s is pool and rel(o, o_ref) < TOL_O and rel(s[idx.long()], s_ref) < TOL_SC
    others = [r for r in range(9) if r not in idx.tolist()]
    assert torch.equal(s[others], before[others])  # rows no sequence owns are untouched


@pytest.mark.parametrize("prep", [1, 2])
@pytest.mark.parametrize("l2norm", [True, False])
def test_bitwise_equal_to_two_kernel_path(monkeypatch, l2norm, prep):
    """The same consumer code on the same prep values (same device functions, same roundings): the fused
    kernel and gdn_chunked_sm90 at the same 64-row slices agree bit for bit."""
    kw = make([200, 77, 4097, 0, 1, 64], 4, 4, 8, 128, 128, l2norm=l2norm)
    outs = []
    for kern, tune in (("fused_sm90", f"prep_warpgroups={prep}"), ("chunked_sm90", "tile_v=64,num_stages=2")):
        monkeypatch.setenv("CUTEDSL_ATTN_GDN_KERNEL", kern)
        monkeypatch.setenv("CUTEDSL_ATTN_GDN_TUNE", tune)
        o, s = run(kw)
        outs.append((o.clone(), s.clone()))
    assert rel(outs[0][0], outs[1][0]) < TOL_O / 4 and rel(outs[0][1], outs[1][1]) < TOL_SC / 4
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("prep", [1, 2])
def test_loop_of_calls_on_ragged_batch(monkeypatch, prep):
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_TUNE", f"prep_warpgroups={prep}")
    lens = [37, 0, 5, 129, 64, 1, 12]
    st = torch.randn(len(lens), 4, 128, 128, device=DEV) * 0.1
    st_ref = st.double()
    for _ in range(100):  # a public SM100 GDN kernel deadlocked in such a loop
        kw = make(lens, 2, 2, 4, 128, 128, init=False)
        o, st = run(dict(kw, initial_state=st))
        o_ref, st_ref = oracle(**dict(kw, initial_state=st_ref), output_final_state=True)
        assert rel(o, o_ref) < TOL_O
    torch.cuda.synchronize()
    assert rel(st, st_ref) < TOL_SC


@pytest.mark.parametrize("prep", [1, 2])
def test_strongly_correlated_keys(monkeypatch, prep):
    """Correlated keys, beta in (0.5, 1), little decay: the far blocks of each chunk's T = (I + A)^-1 carry ~10%
    of its norm, so a wrong block of the prep warpgroup's inverse (its barriers) would be ~0.1 off here."""
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_TUNE", f"prep_warpgroups={prep}")
    lens = [64, 200, 31, 4097]
    kw = make(lens, 2, 2, 4, 128, 128, l2norm=True)
    T = kw["k"].shape[0]
    base = torch.randn(1, 2, 128, device=DEV)
    kw["k"] = (base + 0.5 * torch.randn(T, 2, 128, device=DEV)).to(torch.bfloat16)
    kw["beta"] = torch.rand(T, 4, device=DEV) * 0.5 + 0.5
    kw["g"] = torch.rand(T, 4, device=DEV) * 0.05 + 0.95
    o, s = run(kw)
    o_ref, s_ref = oracle(**kw, output_final_state=True)
    assert rel(o, o_ref) < 2 * TOL_O and rel(s, s_ref) < 3 * TOL_SC
