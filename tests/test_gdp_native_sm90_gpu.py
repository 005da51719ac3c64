"""GPU tests of Gated DeltaProduct on the SM90 chunked GDN kernel without the expansion's copies (the default:
``Config.expand_rows``, the kernel reads q / g and writes the output on the tokens' timeline) against the
expansion (``CUTEDSL_ATTN_GDP_NATIVE=0``) and the float64 oracle.

The native path runs the same kernels with the same tiles on the same shared-memory contents (zero-filled q rows
where the expansion has zero rows, the identity gate converted as the expansion's identity entries are), so its
output and final state equal the expansion's bit for bit; both are also compared with
``cutedsl_attn.ref.chunk_gated_delta_product`` (token-serial, float64) by relative Frobenius error.  Fresh random
inputs every run; outputs and states poisoned with NaN before each launch, the output inside a NaN buffer whose
guard rows before and after it must stay NaN (no store outside ``[T, HO, V]``).  The inputs sit in NaN buffers
too (rows past their ends, q's next head): a read past a tensor's rows or of another head shows as a non-finite
output.
"""

import contextlib

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from cutedsl_attn.api import delta_family as api  # noqa: E402
from cutedsl_attn.api import gdn as gapi  # noqa: E402
from cutedsl_attn.dispatch import gdn as d  # noqa: E402
from cutedsl_attn.planning.gdn import (  # noqa: E402
    FLAG_HAS_BETA, FLAG_HAS_G, FLAG_HAS_INITIAL_STATE, FLAG_WRITE_STATE, GdnProblem,
)
from cutedsl_attn.ref import delta_family as rd  # noqa: E402
from cutedsl_attn.sm90 import gdn_chunked as sm90  # noqa: E402

DEV = torch.device("cuda")
TOL_O = 1e-2  # 16-bit output rounding (tests/test_gdp_chunked_gpu.py's tolerances)
TOL_S = 5e-3  # fp32 state: the chunked kernel's MMAs take the state rounded to 16 bits
TOL_S16 = 1e-2  # bf16 state rounding
LENS = [0, 1, 31, 32, 33, 1000]
GUARD = 64  # NaN rows after the output, which the kernel must not write

if d.gdn_arch(DEV) != "sm_90a":
    pytest.skip("the native path is the SM90 chunked kernel's (needs sm_90a)", allow_module_level=True)


def rel(x, y):
    x, y = x.double(), y.double()
    assert torch.isfinite(x).all(), "non-finite values (a NaN-poisoned element was not written)"
    return ((x - y).norm() / max(y.norm().item(), 1e-30)).item()


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), device=DEV, dtype=dtype)


def guarded(x):
    """``x`` copied to the front of a NaN buffer of GUARD more rows: the returned view (``x``'s shape and strides)
    is followed by NaN rows."""
    buf = torch.full((x.shape[0] + GUARD, *x.shape[1:]), float("nan"), device=DEV, dtype=x.dtype)
    buf[: x.shape[0]] = x
    return buf[: x.shape[0]]


def inputs(lens, n, hq=2, hk=2, hv=4, K=128, V=128, *, l2norm=False, init=True, state_dtype=torch.float32,
           dtype=torch.bfloat16):
    """Random GDP inputs (tests/test_gdp_chunked_gpu.py's distributions): alpha in [0.5, 1], unit k rows unless
    the kernel normalises them; q a head slice of a wider tensor (strided rows, as a caller's view may be) whose
    extra head is NaN; every input followed by NaN rows (:func:`guarded`)."""
    T, ho = sum(lens), max(hq, hv)
    k = torch.randn(T * n, hk, K, device=DEV)
    q = torch.full((T, hq + 1, K), float("nan"), device=DEV, dtype=dtype)
    q[:, :hq] = torch.randn(T, hq, K, device=DEV).to(dtype)
    return dict(q=guarded(q)[:, :hq], k=guarded((k if l2norm else k / k.norm(dim=-1, keepdim=True)).to(dtype)),
                v=guarded(torch.randn(T * n, hv, V, device=DEV).to(dtype)),
                alpha=guarded(torch.rand(T, ho, device=DEV) * 0.5 + 0.5),
                beta=guarded(torch.rand(T * n, ho, device=DEV)), n=n, l2norm=l2norm,
                cu=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV),
                h0=(torch.randn(len(lens), ho, V, K, device=DEV) * 0.1).to(state_dtype) if init else None,
                state_dtype=state_dtype)


def oracle(kw):
    return rd.chunk_gated_delta_product(kw["q"], kw["k"], kw["v"], kw["alpha"], kw["beta"], num_householder=kw["n"],
                                        scale=kw["q"].shape[2] ** -0.5, initial_state=kw["h0"],
                                        output_final_state=True, cu_seqlens=kw["cu"],
                                        use_qk_l2norm_in_kernel=kw["l2norm"])


@contextlib.contextmanager
def _env(monkeypatch, native: bool, tune: str | None):
    with monkeypatch.context() as m:
        m.delenv(d.GDN_KERNEL_ENV, raising=False)
        m.setenv(d.GDP_NATIVE_ENV, "1" if native else "0")
        if tune:
            m.setenv(d.GDN_TUNE_ENV, tune)
        else:
            m.delenv(d.GDN_TUNE_ENV, raising=False)
        cfgs = []
        direct = d._gdn_launch_direct

        def spy(module, cfg, args):
            cfgs.append(cfg)
            direct(module, cfg, args)

        m.setattr(d, "_gdn_launch_direct", spy)
        yield cfgs


def launch(monkeypatch, kw, *, native: bool, gate_domain="linear", tune=None):
    """One GDP launch through :func:`cutedsl_attn.dispatch.gdn.gdn_launch` (the API's launch, its log-gate form
    too): ``(output, final state, the configs launched)``."""
    q, k, v, n = kw["q"], kw["k"], kw["v"], kw["n"]
    T, hq, K = q.shape
    hk, hv, V = k.shape[1], v.shape[1], v.shape[2]
    ho, n_seq = max(hq, hv), kw["cu"].shape[0] - 1
    g = kw["alpha"] if gate_domain == "linear" else guarded(torch.log(kw["alpha"]))
    assert g.dtype == torch.float32 and g.is_contiguous()  # handed over as is: its NaN rows stay behind it
    buf = poisoned((GUARD + T + GUARD, ho, V), q.dtype)
    out, ht = buf[GUARD:GUARD + T], poisoned((n_seq, ho, V, K), kw["state_dtype"])
    flags = FLAG_HAS_G | FLAG_HAS_BETA | FLAG_WRITE_STATE | (FLAG_HAS_INITIAL_STATE if kw["h0"] is not None else 0)
    args = gapi._prefill_args(q, k, v, g, kw["beta"], kw["cu"], kw["h0"], ht, None, out, K ** -0.5, hq, hk, hv,
                              flags)
    problem = GdnProblem(dtype="bfloat16" if q.dtype == torch.bfloat16 else "float16", head_dim_k=K, head_dim_v=V,
                         state_dtype="bfloat16" if kw["state_dtype"] == torch.bfloat16 else "float32",
                         gate_domain=gate_domain, use_qk_l2norm=kw["l2norm"], arch="sm_90a", num_householder=n)
    with _env(monkeypatch, native, tune) as cfgs:
        d.gdn_launch(problem, args)
    torch.cuda.synchronize()
    assert torch.isnan(buf[:GUARD]).all() and torch.isnan(buf[GUARD + T:]).all(), "a store outside the output's rows"
    return out, ht, cfgs


def _check_routes(cfgs, native: bool, n: int):
    assert [c.expand_rows for c in cfgs if isinstance(c, sm90.Config)] == [n if native else 1] * len(cfgs)


@pytest.mark.parametrize("tile_v", [64, 128])
@pytest.mark.parametrize("init", [True, False])
@pytest.mark.parametrize("gate_domain", ["linear", "log"])
@pytest.mark.parametrize("n", [2, 3])
def test_native_equals_expansion_and_oracle(monkeypatch, n, gate_domain, init, tile_v):
    kw = inputs(LENS, n, init=init, l2norm=n == 3)
    o_ref, s_ref = oracle(kw)
    tune = f"tile_v={tile_v}"
    o_e, s_e, c_e = launch(monkeypatch, kw, native=False, gate_domain=gate_domain, tune=tune)
    o_n, s_n, c_n = launch(monkeypatch, kw, native=True, gate_domain=gate_domain, tune=tune)
    _check_routes(c_e, False, n)
    _check_routes(c_n, True, n)
    assert c_n[0].tiles == c_e[0].tiles and c_n[0].tiles.tile_v == tile_v  # the same tiles: the same operations
    assert torch.equal(o_n, o_e) and torch.equal(s_n, s_e)
    assert rel(o_n, o_ref) < TOL_O and rel(s_n, s_ref) < TOL_S


def test_native_long_sequence_bf16_state_no_initial_state(monkeypatch):
    kw = inputs([4097, 5], 2, init=False, l2norm=True, state_dtype=torch.bfloat16)
    o_ref, s_ref = oracle(kw)
    o_e, s_e, _ = launch(monkeypatch, kw, native=False)
    o_n, s_n, cfgs = launch(monkeypatch, kw, native=True)
    _check_routes(cfgs, True, 2)
    assert s_n.dtype == torch.bfloat16 and torch.equal(o_n, o_e) and torch.equal(s_n, s_e)
    assert rel(o_n, o_ref) < TOL_O and rel(s_n, s_ref) < TOL_S16


def test_native_many_heads_k64(monkeypatch):
    """Many chains (128 = N HO: the 128-row default tiles at K = V = 128) and K = 64 (its 64-row default) with
    GQA q heads."""
    for dims, heads in (((128, 128), (32, 32, 32)), ((64, 128), (4, 2, 2))):
        kw = inputs([513, 64, 1, 200], 2, *heads, *dims)
        o_ref, s_ref = oracle(kw)
        o_e, s_e, _ = launch(monkeypatch, kw, native=False)
        o_n, s_n, cfgs = launch(monkeypatch, kw, native=True)
        _check_routes(cfgs, True, 2)
        assert torch.equal(o_n, o_e) and torch.equal(s_n, s_e)
        assert rel(o_n, o_ref) < TOL_O and rel(s_n, s_ref) < TOL_S


@pytest.mark.parametrize("n,heads,dims,dtype", [
    (4, (2, 2, 4), (128, 128), torch.bfloat16),  # chunk starts multiples of n: the run-time row test still
    (8, (4, 1, 1), (128, 128), torch.bfloat16),  # eight tokens a chunk; GQA q heads over one k / v head
    (3, (1, 1, 4), (64, 64), torch.float16),  # fp16 io, K = 64 (four q pieces a thread), q shared by 4 heads
    (5, (2, 2, 2), (64, 128), torch.bfloat16),  # a token's rows across chunk boundaries at many offsets
])
def test_native_other_updates_dims_fp16(monkeypatch, n, heads, dims, dtype):
    """Other update counts (the generic readout test), head layouts, K = 64 and fp16: bit-equal to the expansion,
    tails and empty sequences (mid-batch too) included."""
    kw = inputs([0, 1, 7, 0, 8, 9, 300], n, *heads, *dims, l2norm=True, dtype=dtype)
    o_ref, s_ref = oracle(kw)
    o_e, s_e, c_e = launch(monkeypatch, kw, native=False)
    o_n, s_n, c_n = launch(monkeypatch, kw, native=True)
    _check_routes(c_e, False, n)
    _check_routes(c_n, True, n)
    assert o_n.dtype == dtype and torch.equal(o_n, o_e) and torch.equal(s_n, s_e)
    assert rel(o_n, o_ref) < TOL_O and rel(s_n, s_ref) < TOL_S


def test_native_falls_back_for_tma(monkeypatch):
    kw = inputs([33, 1000], 2)
    o_ref, s_ref = oracle(kw)
    o, s, cfgs = launch(monkeypatch, kw, native=True, tune="tma=1")
    _check_routes(cfgs, False, 2)
    assert cfgs[0].tiles.tma == 1 and rel(o, o_ref) < TOL_O and rel(s, s_ref) < TOL_S


@pytest.mark.parametrize("gates", ["both", "no_g", "no_beta"])
def test_native_through_the_api(monkeypatch, gates):
    """``chunk_gated_delta_product`` end to end (its argument checks, absent gates as flags) with the switch on and
    off: bit-equal, and the oracle."""
    kw = inputs(LENS, 2, l2norm=True)
    g = None if gates == "no_g" else kw["alpha"]
    beta = None if gates == "no_beta" else kw["beta"]
    call = dict(q=kw["q"], k=kw["k"], v=kw["v"], g=g, beta=beta, num_householder=2, initial_state=kw["h0"],
                cu_seqlens=kw["cu"], use_qk_l2norm_in_kernel=True)
    res = {}
    for native in (False, True):
        out = poisoned((kw["q"].shape[0], 4, 128), torch.bfloat16)
        st = poisoned((len(LENS), 4, 128, 128), torch.float32)
        with _env(monkeypatch, native, None) as cfgs:
            o, s = api.chunk_gated_delta_product(**call, output=out, output_state=st, output_final_state=True,
                                                 backend="cute")
        torch.cuda.synchronize()
        _check_routes(cfgs, native, 2)
        res[native] = (o, s)
    assert torch.equal(res[True][0], res[False][0]) and torch.equal(res[True][1], res[False][1])
    o_ref, s_ref = rd.chunk_gated_delta_product(**call, output_final_state=True)
    assert rel(res[True][0], o_ref) < TOL_O and rel(res[True][1], s_ref) < TOL_S


def test_native_cuda_graph_replay(monkeypatch):
    kw = inputs([1000, 65, 0, 31], 3)
    call = dict(q=kw["q"], k=kw["k"], v=kw["v"], g=kw["alpha"], beta=kw["beta"], num_householder=3,
                initial_state=kw["h0"], cu_seqlens=kw["cu"])
    T = kw["q"].shape[0]
    out, st = poisoned((T, 4, 128), torch.bfloat16), poisoned((4, 4, 128, 128), torch.float32)
    with _env(monkeypatch, True, None) as cfgs:
        api.chunk_gated_delta_product(**call, output=out, output_state=st, backend="cute")  # compile outside
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            api.chunk_gated_delta_product(**call, output=out, output_state=st, backend="cute")
    _check_routes(cfgs, True, 3)
    for _ in range(2):
        kw["q"].copy_(torch.randn_like(kw["q"]))
        out.fill_(float("nan"))
        st.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        o_ref, s_ref = rd.chunk_gated_delta_product(**call, output_final_state=True)
        assert rel(out, o_ref) < TOL_O and rel(st, s_ref) < TOL_S
