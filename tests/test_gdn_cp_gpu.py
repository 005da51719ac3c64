"""GPU tests of the context-parallel (split-sequence) GDN prefill path against the plain launch and the float64
oracle.

Fresh random inputs every run, outputs and states poisoned with NaN before each launch, relative Frobenius
error against ``cutedsl_attn.ref.chunk_gated_delta_rule`` (token-serial, float64) on the same rounded inputs.
Gates are kept weak (alpha near 1, small beta) so the state carries across segment boundaries: a wrong chain
(a transition or offset off, a segment started from the wrong state) is far off, which each test checks.
The path runs the chunked kernel's prep once and its main kernel alone three times on that scratch (the
transition with U = 0, the offset, the outputs); the split tests count those launches.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from cutedsl_attn.api import gdn as api  # noqa: E402
from cutedsl_attn.dispatch import gdn as d  # noqa: E402
from cutedsl_attn.planning import gdn as pg  # noqa: E402
from cutedsl_attn.planning import gdn_cp as pcp  # noqa: E402
from cutedsl_attn.planning.gdn_cp import MainRun, cp_segment_offsets  # noqa: E402
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


def plan(kw, use_cp, **extra):
    """``(problem, args, (o, state))`` of the public call (its checks and allocations), not launched."""
    ex = {"output": None, "output_state": None, "state_indices": None, **extra}
    return api._plan_prefill(
        kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], None, kw["initial_state"], True, kw["cu_seqlens"],
        kw["use_qk_l2norm_in_kernel"], ex["output"], ex["output_state"], None, None, 0, use_cp, ex["state_indices"],
        None, "auto", None, "linear")


def segments(kw, use_cp):
    problem, args, _ = plan(kw, use_cp)
    return d.gdn_cp_segments(problem, args, use_cp)


@pytest.fixture
def counted(monkeypatch):
    """The path's launches by kind (``prep``, the main-only runs, ``full``), the real kernels still run."""
    seen = []
    prep, main, full = d._cp_prep_direct, d._cp_main_direct, d._gdn_launch_direct
    monkeypatch.setattr(d, "_cp_prep_direct", lambda m, c, a, s: (seen.append(("prep", m.NAME)), prep(m, c, a, s)))
    monkeypatch.setattr(d, "_cp_main_direct", lambda m, c, a, s: (seen.append((c.run.value, m.NAME)),
                                                                 main(m, c, a, s)))
    monkeypatch.setattr(d, "_gdn_launch_direct", lambda m, c, a: (seen.append(("full", m.NAME)), full(m, c, a)))
    return seen


def launch_cp(kw, P, state_dtype=torch.float32, **extra):
    """``gdn_launch_cp`` with ``P`` segments a sequence into NaN-poisoned output / state; returns them."""
    T, ho, V, K = kw["q"].shape[0], max(kw["q"].shape[1], kw["v"].shape[1]), kw["v"].shape[2], kw["q"].shape[2]
    n = kw["cu_seqlens"].shape[0] - 1
    out, st = poisoned((T, ho, V), kw["q"].dtype), poisoned((n, ho, V, K), state_dtype)
    problem, args, _ = plan(kw, True, output=out, output_state=st, **extra)
    d.gdn_launch_cp(problem, args, P, device_index=DEV.index)
    return out, st


@pytest.mark.parametrize("T", [65536, 4097])
@pytest.mark.parametrize("init", [True, False])
def test_one_long_sequence_tp8_heads(T, init):
    kw = make([T], 2, 2, 8, init=init)  # 2 q/k heads, 8 v heads (GVA): a TP8-sized layer
    assert segments(kw, True) >= 2
    if T == 65536 and torch.cuda.get_device_properties(DEV).multi_processor_count == 132:
        # auto keeps the plain launch while CP_AUTO is off; on, one wave of 16 segments x 8 heads of 128-row CTAs
        assert segments(kw, "auto") == (16 if pcp.CP_AUTO else 1)
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


def test_recurrent_kernel_through_the_split(monkeypatch, counted):
    # a kernel without main-only entries (the forced recurrent one) runs the three phases as full launches
    monkeypatch.setenv(d.GDN_KERNEL_ENV, "recurrent")
    kw = make([4097], 2, 2, 8)
    o_ref, s_ref = oracle(**kw, output_final_state=True)
    o, s = run(kw, True)
    assert [k for k, _ in counted] == ["full"] * 3 and all(n == "gdn_recurrent" for _, n in counted)
    assert rel(o, o_ref) < TOL_O and rel(s, s_ref) < 2e-3


SPLIT_LENS = [37, 4097, 65, 1, 0, 130, 2000, 64]  # short and long, lengths off and on chunk multiples, empty


@pytest.mark.parametrize("P", [2, 4, 8, 16])
def test_shared_prep_split_counts_and_matches_the_plain_launch(counted, P):
    kw = make(SPLIT_LENS, 2, 2, 8)  # GVA, initial states
    o_ref, s_ref = oracle(**kw, output_final_state=True)
    o, s = launch_cp(kw, P)
    kinds = [k for k, _ in counted]
    assert kinds == ["prep", "transition", "state", "output"], kinds  # one prep, three main-only runs
    assert len({name for _, name in counted}) == 1
    counted.clear()
    o_pl, s_pl = run(kw, False)
    assert [k for k, _ in counted] == ["full"]
    assert rel(o, o_ref) < TOL_O and rel(s, s_ref) < TOL_S
    assert rel(o, o_pl) < TOL_CP and rel(s, s_pl) < TOL_CP
    assert torch.equal(s[4].cpu(), kw["initial_state"][4].cpu())  # the empty sequence keeps its state


@pytest.mark.parametrize("kernel", ["chunked", "chunked_sm90"])
@pytest.mark.parametrize("dims", [(128, 128), (64, 128), (128, 64), (64, 64)])
def test_shared_prep_split_on_each_chunked_kernel(counted, monkeypatch, kernel, dims):
    monkeypatch.setenv(d.GDN_KERNEL_ENV, kernel)
    kw = make(SPLIT_LENS, 2, 2, 4, *dims, init=dims[0] == dims[1])
    o_ref, s_ref = oracle(**kw, output_final_state=True)
    o, s = launch_cp(kw, 4)
    assert [k for k, _ in counted] == ["prep", "transition", "state", "output"]
    assert all(name == "gdn_" + kernel for _, name in counted)
    assert rel(o, o_ref) < TOL_O and rel(s, s_ref) < TOL_S


def test_shared_prep_split_no_initial_state_pool_bf16(counted):
    kw = make(SPLIT_LENS, 8, 2, 2, pool=11, state_dtype=torch.bfloat16)  # GQA, a bf16 pool
    idx = torch.tensor([10, 3, 0, 7, 1, 9, 5, 2], device=DEV, dtype=torch.int32)
    before = kw["initial_state"].clone()
    o_ref, s_ref = oracle(**{**kw, "initial_state": before}, state_indices=idx, output_final_state=True)
    T = kw["q"].shape[0]
    out, pool = poisoned((T, 8, 128), torch.bfloat16), kw["initial_state"]
    problem, args, _ = plan(kw, True, output=out, output_state=pool, state_indices=idx)
    d.gdn_launch_cp(problem, args, 8, device_index=DEV.index)  # in place on the pool
    assert rel(out, o_ref) < TOL_O and rel(pool[idx.long()], s_ref) < TOL_S
    assert torch.equal(pool[[4, 6, 8]], before[[4, 6, 8]])  # rows no sequence owns
    kw0 = make(SPLIT_LENS, 2, 2, 8, init=False)
    o_ref0, s_ref0 = oracle(**kw0, output_final_state=True)
    o0, s0 = launch_cp(kw0, 8)
    assert rel(o0, o_ref0) < TOL_O and rel(s0, s_ref0) < TOL_S


@pytest.mark.parametrize("kernel", ["chunked", "chunked_sm90"])
def test_main_only_runs_on_one_prep(monkeypatch, kernel):
    """The entries one by one: the transition run (U = 0) from the identity is the oracle's state from the
    identity with v = 0, the offset run the oracle's from zeros, neither writes an output; the outputs run from
    the true starts equals the plain launch."""
    monkeypatch.setenv(d.GDN_KERNEL_ENV, kernel)
    kw = make([4097, 130], 2, 2, 8, init=False)
    problem, args, _ = plan(kw, False, output=poisoned((4227, 8, 128), torch.bfloat16))
    module, cfg = d.gdn_choice(problem, device_index=DEV.index, chains=16)
    scratch = module.prep_tensors(args, cfg)
    d._cp_launch_prep(module, cfg, args, scratch)
    both = pg.FLAG_HAS_INITIAL_STATE | pg.FLAG_WRITE_STATE
    gates = args.flags & (pg.FLAG_HAS_G | pg.FLAG_HAS_BETA)
    eye = torch.eye(128, device=DEV).expand(2, 8, 128, 128).contiguous()
    m = eye.clone()
    d._cp_launch_main(module, module.MainConfig(cfg, MainRun.TRANSITION),
                      args._replace(initial_state=m, output_state=m, flags=gates | both), scratch)
    b = poisoned((2, 8, 128, 128), torch.float32)
    d._cp_launch_main(module, module.MainConfig(cfg, MainRun.STATE),
                      args._replace(initial_state=b, output_state=b, flags=gates | pg.FLAG_WRITE_STATE), scratch)
    torch.cuda.synchronize()
    assert torch.isnan(args.output).all()  # the state-only runs never write outputs
    _, m_ref = oracle(**{**kw, "v": torch.zeros_like(kw["v"]), "initial_state": eye}, output_final_state=True)
    _, b_ref = oracle(**kw, output_final_state=True)
    assert rel(m, m_ref) < TOL_S and rel(b, b_ref) < TOL_S
    h0 = torch.randn(2, 8, 128, 128, device=DEV) * 0.5
    ht = poisoned((2, 8, 128, 128), torch.float32)
    d._cp_launch_main(module, module.MainConfig(cfg, MainRun.OUTPUT),
                      args._replace(initial_state=h0, output_state=ht, flags=gates | both), scratch)
    o_ref, s_ref = oracle(**{**kw, "initial_state": h0}, output_final_state=True)
    assert rel(args.output, o_ref) < TOL_O and rel(ht, s_ref) < TOL_S
    o_pl, s_pl = run({**kw, "initial_state": h0}, False)
    assert torch.equal(args.output, o_pl) and torch.equal(ht, s_pl)  # the same prep, the same main kernel


def test_torch_compile_runs_the_split_through_its_custom_op(counted):
    kw = make([4097, 130], 2, 2, 8)
    T = kw["q"].shape[0]
    problem, args, _ = plan(kw, True, output=poisoned((T, 8, 128), torch.bfloat16),
                            output_state=poisoned((2, 8, 128, 128), torch.float32))

    def f(q, k, v, h0, ht, out):
        d.gdn_launch_cp(problem, args._replace(q=q, k=k, v=v, initial_state=h0, output_state=ht, output=out), 4)
        return out.float() * 2

    ins = [kw["q"], kw["k"], kw["v"], kw["initial_state"]]
    o1, o2 = poisoned((T, 8, 128), torch.bfloat16), poisoned((T, 8, 128), torch.bfloat16)
    s1, s2 = poisoned((2, 8, 128, 128), torch.float32), poisoned((2, 8, 128, 128), torch.float32)
    r1 = f(*ins, s1, o1)
    torch._dynamo.reset()
    r2 = torch.compile(f, backend="aot_eager", fullgraph=True)(*ins, s2, o2)
    torch.cuda.synchronize()
    assert [k for k, _ in counted] == ["prep", "transition", "state", "output"] * 2
    assert torch.equal(r1, r2) and torch.equal(s1, s2)
    o_ref, s_ref = oracle(**kw, output_final_state=True)
    assert rel(o1, o_ref) < TOL_O and rel(s1, s_ref) < TOL_S
