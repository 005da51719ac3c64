"""CPU tests of the dispatch-level reuses of the chunked GDN kernel: the context-parallel (split-sequence) plan and
Gated DeltaProduct on the expanded timeline.

* the segment offsets (``planning/gdn_cp.py``) on host tensors: whole chunks, in order, balanced;
* the segment count rule (one wave, FlashInfer's ``N * HO * 2 < num_SMs``, more segments than runs);
* the algorithm: per-segment float64 oracle runs (the transition from the identity with ``v = 0``, the offset
  from zeros), chained by ``cp_chain``, then rerun from the chained starts, equal the whole-sequence oracle;
* the plumbing: ``chunk_gated_delta_rule(use_cp=True)`` and ``chunk_gated_delta_product`` through dispatch with
  the kernel launch emulated in float64 (the GdnArgs contract), against the oracle.
"""

import math

import pytest
import torch

from cutedsl_attn import ref
from cutedsl_attn.api import delta_family as dapi
from cutedsl_attn.api import gdn as api
from cutedsl_attn.dispatch import gdn as d
from cutedsl_attn.planning import gdn as pg
from cutedsl_attn.planning import gdn_cp as pcp
from cutedsl_attn.planning.gdn_cp import cp_chain, cp_num_segments, cp_segment_offsets

LENS = [0, 1, 63, 64, 65, 1000, 4097]


def rel(x, y):
    x, y = x.double(), y.double()
    return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()


def cu_of(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


# ---------------------------------------------------------------------------- segments
@pytest.mark.parametrize("P", [1, 2, 3, 4, 7])
def test_segment_offsets_are_whole_chunks_in_order(P):
    cu = cu_of(LENS)
    seg = cp_segment_offsets(cu, P)
    assert seg.dtype == torch.int32 and seg.shape == (len(LENS) * P + 1,)
    s = seg.tolist()
    assert s[0] == 0 and s[-1] == sum(LENS) and all(a <= b for a, b in zip(s, s[1:]))
    for n, L in enumerate(LENS):
        b = s[n * P:(n + 1) * P + 1]
        assert b[0] == cu[n] and b[-1] == cu[n + 1]
        lens = [y - x for x, y in zip(b, b[1:])]
        assert all(x % pg.CHUNK == 0 for x in lens[:-1]), (L, lens)  # only a sequence's last segment is ragged
        chunks = [math.ceil(x / pg.CHUNK) for x in lens]
        assert sum(chunks) == math.ceil(L / pg.CHUNK) and max(chunks) - min(chunks) <= 1, (L, chunks)


def test_segment_offsets_refuse_bad_counts():
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="segments"):
            cp_segment_offsets(cu_of([5]), bad)


def _ctas(v=128):
    # the portable chunked kernel's default: 32-row slices below chains * 2 = 132, 64-row ones from there
    return lambda chains: chains * (v // (32 if chains * 2 < 132 else 64))


def test_segment_count_rule(monkeypatch):
    kw = dict(num_sms=132, ctas_of_chains=_ctas(), runs=3)
    assert cp_num_segments(1, 8, 65536, forced=False, **kw) == 1  # CP_AUTO off: auto keeps the plain launch
    monkeypatch.setattr(pcp, "CP_AUTO", True)  # the rule auto applies once the path pays
    assert cp_num_segments(1, 8, 65536, forced=False, **kw) == 4  # row (d): 4 x 8 chains x 4 slices = 128 CTAs
    assert cp_num_segments(1, 8, 65536, forced=True, **kw) == 4
    assert cp_num_segments(8, 16, 65536, forced=False, **kw) == 1  # N * HO * 2 >= num_SMs: no split
    assert cp_num_segments(1, 8, 4096, forced=False, **kw) == 4  # 16 chunks a segment
    assert cp_num_segments(1, 8, 4095, forced=False, **kw) == 1  # shorter segments do not pay for the extra runs
    assert cp_num_segments(1, 8, 100, forced=True, **kw) == 2  # forced: at least two segments
    assert cp_num_segments(2, 8, 65536, forced=False, **kw) == 1  # the wave fits 2 segments, not more than 3 runs
    assert cp_num_segments(2, 8, 65536, forced=False, num_sms=132, ctas_of_chains=_ctas(), runs=1) == 2
    with pytest.raises(NotImplementedError, match="use_cp=True"):
        cp_num_segments(pg.MAX_SEQS, 1, 10 ** 6, forced=True, **kw)


# ---------------------------------------------------------------------------- the algorithm, float64 oracle
def _inputs(T, hq, hk, hv, K, V, seed=0, log=False):
    gen = torch.Generator().manual_seed(seed)
    ho = max(hq, hv)
    q = torch.randn(T, hq, K, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(T, hk, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(T, hv, V, generator=gen, dtype=torch.float64)
    g = torch.rand(T, ho, generator=gen, dtype=torch.float64) * 0.2 + 0.8
    beta = torch.rand(T, ho, generator=gen, dtype=torch.float64)
    return q, k, v, (torch.log(g) if log else g), beta


@pytest.mark.parametrize("heads,dims,l2,log", [((1, 1, 2), (16, 8), False, False), ((4, 2, 2), (8, 16), True, True),
                                               ((2, 2, 2), (16, 16), False, False)])
@pytest.mark.parametrize("P", [2, 3])
def test_affine_chaining_matches_the_whole_sequence_oracle(heads, dims, l2, log, P):
    (hq, hk, hv), (K, V) = heads, dims
    lens = [300, 0, 70]
    T, ho, N = sum(lens), max(hq, hv), len(lens)
    q, k, v, g, beta = _inputs(T, hq, hk, hv, K, V, log=log)
    cu = cu_of(lens)
    h0 = torch.randn(N, ho, V, K, dtype=torch.float64) * 0.3
    common = dict(use_qk_l2norm_in_kernel=l2, gate_domain="log" if log else "linear", output_final_state=True)
    o_ref, s_ref = ref.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, **common)

    seg = cp_segment_offsets(cu, P).tolist()
    eye = torch.eye(K, dtype=torch.float64).expand(1, ho, K, K)
    trans, offs = [], []
    for s, e in zip(seg, seg[1:]):
        sl = slice(s, e)
        _, m = ref.chunk_gated_delta_rule(q[sl], k[sl], torch.zeros(e - s, hv, K, dtype=torch.float64), g[sl],
                                          beta[sl], initial_state=eye, **common)
        _, b = ref.chunk_gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], **common)
        trans.append(m[0])
        offs.append(b[0])
    starts, final = cp_chain(h0, torch.stack(trans).view(N, P, ho, K, K), torch.stack(offs).view(N, P, ho, V, K))
    assert starts.dtype == torch.float64 and torch.equal(starts[:, 0], h0)
    assert rel(final, s_ref) < 1e-12
    o = torch.empty_like(o_ref)
    for i, (s, e) in enumerate(zip(seg, seg[1:])):
        sl = slice(s, e)
        h_in = starts.reshape(N * P, ho, V, K)[i:i + 1]
        o[sl] = ref.chunk_gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], initial_state=h_in, **common)[0]
    assert rel(o, o_ref) < 1e-12


# ---------------------------------------------------------------------------- plumbing, emulated kernel
def emulate(module, cfg, args):
    """The kernels' GdnArgs contract (GDN, V-major state) in float64, tokens in order."""
    p, f = cfg.problem, args.flags
    assert p.num_householder == 1 and not p.state_k_major
    cu = args.cu_seqlens.tolist()
    ho, V, K = args.output.shape[1], args.output.shape[2], args.q.shape[2]
    assert args.v.shape[2] == V == p.head_dim_v and K == p.head_dim_k
    for n in range(len(cu) - 1):
        for oh in range(ho):
            H = torch.zeros(V, K, dtype=torch.float64)
            if f & pg.FLAG_HAS_INITIAL_STATE:
                H = args.initial_state[int(args.initial_state_indices[n]) if f & pg.FLAG_INITIAL_INDICES else n,
                                       oh].double().clone()
            for t in range(cu[n], cu[n + 1]):
                qt, kt = args.q[t, oh // args.q_group].double(), args.k[t, oh // args.k_group].double()
                vt = args.v[t, oh // args.v_group].double()
                if p.use_qk_l2norm:
                    qt = qt * torch.rsqrt((qt * qt).sum() + 1e-6)
                    kt = kt * torch.rsqrt((kt * kt).sum() + 1e-6)
                a = float(args.g[t, oh]) if f & pg.FLAG_HAS_G else 1.0
                a = math.exp(a) if (f & pg.FLAG_HAS_G and p.gate_domain == "log") else a
                b = float(args.beta[t, oh]) if f & pg.FLAG_HAS_BETA else 1.0
                H = a * H
                H = H + (b * (vt - H @ kt))[:, None] * kt[None, :]
                args.output[t, oh] = (args.scale * (H @ qt)).to(args.output.dtype)
            if f & pg.FLAG_WRITE_STATE:
                row = int(args.output_state_indices[n]) if f & pg.FLAG_OUTPUT_INDICES else n
                args.output_state[row, oh] = H.to(args.output_state.dtype)


@pytest.fixture
def launches(monkeypatch):
    seen = []
    monkeypatch.setattr(d, "_gdn_launch_direct", lambda m, cfg, args: (seen.append((m.NAME, cfg.problem, args)),
                                                                       emulate(m, cfg, args)))
    monkeypatch.setattr(api, "_require_cuda", lambda device: None)
    monkeypatch.setattr(api, "gdn_arch", lambda device=None: "sm_90a")
    monkeypatch.delenv(d.GDN_KERNEL_ENV, raising=False)
    monkeypatch.delenv(d.GDN_TUNE_ENV, raising=False)
    return seen


def _bf(lens, hq, hk, hv, K, V, seed=0):
    q, k, v, g, beta = _inputs(sum(lens), hq, hk, hv, K, V, seed=seed)
    return dict(q=q.bfloat16(), k=k.bfloat16(), v=v.bfloat16(), g=g.float(), beta=beta.float(), cu_seqlens=cu_of(lens))


@pytest.mark.parametrize("heads,dims,state", [((1, 1, 2), (64, 64), torch.float32),
                                              ((2, 1, 1), (64, 128), torch.bfloat16),
                                              ((1, 1, 2), (128, 64), torch.float32)])
def test_cp_through_the_api_matches_the_oracle(launches, heads, dims, state):
    (hq, hk, hv), (K, V) = heads, dims
    lens = [200, 0, 70]
    ho, N = max(hq, hv), len(lens)
    kw = _bf(lens, hq, hk, hv, K, V)
    h0 = (torch.randn(N, ho, V, K) * 0.3).to(state)
    o, s = api.chunk_gated_delta_rule(**kw, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                      use_cp=True)
    o_ref, s_ref = ref.chunk_gated_delta_rule(**kw, initial_state=h0, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
    assert s.dtype == state and rel(o, o_ref) < 1e-2 and rel(s, s_ref) < (1e-2 if state == torch.bfloat16 else 1e-5)
    runs = [(name, p) for name, p, _ in launches]
    shared = K + V in pg.HEAD_DIMS
    assert len(runs) == (2 if shared else 3) and all(name == "gdn_chunked_sm90" for name, _ in runs)
    widths = [p.head_dim_v for _, p in runs]
    assert widths == ([K + V, V] if shared else [K, V, V])
    assert all(p.state_dtype == "float32" for _, p in runs)
    P = launches[0][2].cu_seqlens.shape[0] // N  # N P + 1 offsets
    assert P >= 2 and all(a.cu_seqlens.shape[0] == N * P + 1 for _, _, a in launches)
    # plain and context-parallel agree; no initial state
    launches.clear()
    o2, s2 = api.chunk_gated_delta_rule(**kw, output_final_state=True, use_cp=True)
    o3, s3 = api.chunk_gated_delta_rule(**kw, output_final_state=True, use_cp=False)
    assert len(launches) == (2 if shared else 3) + 1
    assert rel(o2, o3) < 1e-2 and rel(s2, s3) < 1e-5


def test_cp_with_a_state_pool_in_place(launches):
    lens = [130, 5]
    kw = _bf(lens, 1, 1, 2, 64, 64, seed=3)
    pool = torch.randn(5, 2, 64, 64) * 0.3
    idx = torch.tensor([3, 1], dtype=torch.int32)
    before = pool.clone()
    o, s = api.chunk_gated_delta_rule(**kw, initial_state=pool, output_state=pool, state_indices=idx,
                                      output_final_state=True, use_cp=True)
    o_ref, s_ref = ref.chunk_gated_delta_rule(**kw, initial_state=before, state_indices=idx, output_final_state=True)
    assert s is pool and rel(o, o_ref) < 1e-2 and rel(pool[idx.long()], s_ref) < 1e-5
    others = [0, 2, 4]
    assert torch.equal(pool[others], before[others])  # rows no sequence owns are untouched


def test_cp_auto_and_false_choose_as_documented(launches, monkeypatch):
    kw = _bf([300], 1, 1, 1, 64, 64)
    api.chunk_gated_delta_rule(**kw)  # auto: 5 chunks cannot make segments of 16 chunks
    api.chunk_gated_delta_rule(**kw, use_cp=False)
    assert len(launches) == 2 and all(a.cu_seqlens.shape[0] == 2 for _, _, a in launches)
    problem = pg.GdnProblem(dtype="bfloat16", head_dim_k=128, head_dim_v=128)
    T = 65536
    args = pg.GdnArgs(torch.empty(T, 2, 128), None, None, None, None, torch.zeros(2, dtype=torch.int32), None, None,
                      None, None, torch.empty(T, 8, 128), 1.0, 4, 4, 1, 0)
    assert d.gdn_cp_segments(problem, args, "auto") == 1  # CP_AUTO off: the plain launch
    monkeypatch.setattr(pcp, "CP_AUTO", True)
    assert d.gdn_cp_segments(problem, args, "auto") >= 4  # row (d) on 132 SMs: a one-wave split of 8 chains
    assert d.gdn_cp_segments(problem, args, False) == 1
    with pytest.raises(NotImplementedError, match="use_cp=True"):
        d.gdn_cp_segments(pg.GdnProblem(dtype="bfloat16", head_dim_k=128, head_dim_v=128, decode=True), args, True)
    for bad in (0, 1, "yes", None):
        with pytest.raises(ValueError, match="use_cp"):
            d.gdn_cp_segments(problem, args, bad)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_gdp_runs_the_chunked_kernel_on_the_expanded_timeline(launches, monkeypatch, n):
    monkeypatch.setattr(dapi._g, "_require_cuda", lambda device: None)
    monkeypatch.setattr(dapi._g, "gdn_arch", lambda device=None: "sm_90a")
    lens = [0, 1, 5, 3]
    T, ho = sum(lens), 2
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(T, 1, 64, generator=gen).bfloat16()
    k = torch.randn(T * n, 1, 64, generator=gen).bfloat16()
    v = torch.randn(T * n, 2, 64, generator=gen).bfloat16()
    g, beta = torch.rand(T, ho, generator=gen) * 0.5 + 0.5, torch.rand(T * n, ho, generator=gen)
    h0 = torch.randn(len(lens), ho, 64, 64, generator=gen) * 0.3
    kw = dict(q=q, k=k, v=v, g=g, beta=beta, num_householder=n, cu_seqlens=cu_of(lens), initial_state=h0,
              output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = dapi.chunk_gated_delta_product(**kw, backend="cute")
    o_ref, s_ref = ref.chunk_gated_delta_product(**kw)
    assert rel(o, o_ref) < 1e-2 and rel(s, s_ref) < 1e-5
    (name, p, a), = launches
    assert name == "gdn_chunked_sm90" and p.num_householder == 1
    assert a.q.shape[0] == T * n and a.output.shape[0] == T * n
    assert torch.equal(a.cu_seqlens, cu_of(lens) * n)
    if n > 1:
        assert torch.equal(a.q[n - 1::n], q) and not a.q[0::n].any()
        assert torch.equal(a.g[0::n], g) and bool((a.g[1::n] == 1).all())
    monkeypatch.setenv(d.GDN_KERNEL_ENV, "recurrent")
    problem = pg.GdnProblem(dtype="bfloat16", head_dim_k=64, head_dim_v=64, num_householder=max(n, 2))
    assert d.gdn_choice(problem)[0].NAME == "gdn_recurrent"
    assert d.gdn_choice(problem)[1].problem == problem


def test_cp_under_torch_compile(launches):
    """Traced (fullgraph), the three phases are the custom op cutedsl_attn::gdn_chunked and the chain plain torch:
    the same results as eager."""
    kw = _bf([150, 40], 1, 1, 2, 64, 128)
    problem = pg.GdnProblem(dtype="bfloat16", head_dim_k=64, head_dim_v=128, arch="sm_90a")
    flags = pg.FLAG_HAS_G | pg.FLAG_HAS_BETA | pg.FLAG_HAS_INITIAL_STATE | pg.FLAG_WRITE_STATE
    h0 = torch.randn(2, 2, 128, 64) * 0.3

    def f(q, k, v, g, beta, cu, h0, ht, out):
        i32 = torch.empty(1, dtype=torch.int32)
        d.gdn_launch_cp(problem, pg.GdnArgs(q, k, v, g, beta, cu, h0, i32, ht, i32, out, 0.125, 2, 2, 1, flags), 2)
        return out.float() * 2

    ins = [kw[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")]
    ht1, ht2 = torch.zeros(2, 2, 128, 64), torch.zeros(2, 2, 128, 64)
    o1, o2 = torch.zeros(190, 2, 128).bfloat16(), torch.zeros(190, 2, 128).bfloat16()
    r1 = f(*ins, h0, ht1, o1)
    torch._dynamo.reset()
    r2 = torch.compile(f, backend="aot_eager", fullgraph=True)(*ins, h0, ht2, o2)
    assert len(launches) == 6 and torch.equal(r1, r2) and torch.equal(ht1, ht2)
    o_ref, s_ref = ref.chunk_gated_delta_rule(*ins[:5], scale=0.125, initial_state=h0, cu_seqlens=ins[5],
                                              output_final_state=True)
    assert rel(o1, o_ref) < 1e-2 and rel(ht1, s_ref) < 1e-5
