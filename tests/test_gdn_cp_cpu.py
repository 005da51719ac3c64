"""CPU tests of the dispatch-level reuses of the chunked GDN kernel: the context-parallel (split-sequence) plan and
Gated DeltaProduct on the expanded timeline.

* the segment offsets (``planning/gdn_cp.py``) on host tensors: whole chunks, in order, balanced;
* the segment count rule (one wave, FlashInfer's ``N * HO * 2 < num_SMs``, more segments than runs);
* the algorithm: per-segment float64 oracle runs (the transition from the identity with ``v = 0``, the offset
  from zeros), chained by ``cp_chain``, then rerun from the chained starts, equal the whole-sequence oracle;
* the plumbing: ``chunk_gated_delta_rule(use_cp=True)`` and ``chunk_gated_delta_product`` through dispatch with
  the kernel launches emulated in float64 (the GdnArgs contract; the context-parallel path's prep once and its
  main-only runs on the prep's scratch), against the oracle;
* the main-only and prep-only entries cross-compiled (sm_90a, and the portable kernel for sm_100a): what each
  run reads, computes and stores, in the PTX.
"""

import dataclasses
import math
import re

import pytest
import torch
from _builds import build  # (tests/ is on sys.path)

from cutedsl_attn import ref
from cutedsl_attn.api import delta_family as dapi
from cutedsl_attn.api import gdn as api
from cutedsl_attn.dispatch import gdn as d
from cutedsl_attn.planning import gdn as pg
from cutedsl_attn.planning import gdn_cp as pcp
from cutedsl_attn.planning.gdn_cp import MainRun, cp_chain, cp_num_segments, cp_segment_offsets, main_run_args

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
    monkeypatch.setattr(pcp, "CP_AUTO", False)
    assert cp_num_segments(1, 8, 65536, forced=False, **kw) == 1  # CP_AUTO off: auto keeps the plain launch
    monkeypatch.setattr(pcp, "CP_AUTO", True)  # the rule auto applies once the path pays
    # row (d) on these 32-row slices: 4 x 8 chains x 4 slices = 128 CTAs; 4 < 2 x 3 runs: auto keeps the plain
    assert cp_num_segments(1, 8, 65536, forced=False, **kw) == 1
    assert cp_num_segments(1, 8, 65536, forced=True, **kw) == 4
    wide = dict(kw, ctas_of_chains=lambda chains: chains)  # one CTA a chain: up to 16 segments of 8 heads
    assert cp_num_segments(1, 8, 65536, forced=False, **wide) == 16
    assert cp_num_segments(8, 16, 65536, forced=False, **wide) == 1  # N * HO * 2 >= num_SMs: no split
    assert cp_num_segments(1, 8, 32768, forced=False, **wide) == 16  # CP_AUTO_MIN_CHUNKS = 512 chunks
    assert cp_num_segments(1, 8, 32767, forced=False, **wide) == 1  # shorter: auto keeps the plain launch
    assert cp_num_segments(1, 16, 32768, forced=False, **wide) == 8  # 8 x 16 chains fill the wave
    assert cp_num_segments(1, 32, 32768, forced=False, **wide) == 1  # 4 segments < 2 x 3 runs: plain
    assert cp_num_segments(1, 8, 4096, forced=True, **kw) == 4  # forced: 16 chunks a segment
    assert cp_num_segments(1, 8, 4095, forced=True, **kw) == 3  # 63 chunks: 3 segments of >= 16 chunks
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
def emulate(module, cfg, args, run=MainRun.OUTPUT):
    """The kernels' GdnArgs contract (GDN, V-major state) in float64, tokens in order; ``run``: what a main-only
    launch computes (``TRANSITION``: v read as zeros, the U = 0 of its prep; outputs only for ``OUTPUT``)."""
    p, f = cfg.problem, args.flags
    assert p.num_householder == 1 and not p.state_k_major
    cu = args.cu_seqlens.tolist()
    ho, V, K = args.output.shape[1], args.output.shape[2], args.q.shape[2]
    assert args.v.shape[2] == V == p.head_dim_v and K == p.head_dim_k
    assert args.initial_state.shape[-2:] == (V, K) and args.output_state.shape[-2:] == (V, K)
    for n in range(len(cu) - 1):
        for oh in range(ho):
            H = torch.zeros(V, K, dtype=torch.float64)
            if f & pg.FLAG_HAS_INITIAL_STATE:
                H = args.initial_state[int(args.initial_state_indices[n]) if f & pg.FLAG_INITIAL_INDICES else n,
                                       oh].double().clone()
            for t in range(cu[n], cu[n + 1]):
                qt, kt = args.q[t, oh // args.q_group].double(), args.k[t, oh // args.k_group].double()
                vt = torch.zeros(V, dtype=torch.float64) if run is MainRun.TRANSITION else \
                    args.v[t, oh // args.v_group].double()  # the main kernel never reads v itself
                if p.use_qk_l2norm:
                    qt = qt * torch.rsqrt((qt * qt).sum() + 1e-6)
                    kt = kt * torch.rsqrt((kt * kt).sum() + 1e-6)
                a = float(args.g[t, oh]) if f & pg.FLAG_HAS_G else 1.0
                a = math.exp(a) if (f & pg.FLAG_HAS_G and p.gate_domain == "log") else a
                b = float(args.beta[t, oh]) if f & pg.FLAG_HAS_BETA else 1.0
                H = a * H
                H = H + (b * (vt - H @ kt))[:, None] * kt[None, :]
                if run is MainRun.OUTPUT:
                    args.output[t, oh] = (args.scale * (H @ qt)).to(args.output.dtype)
            if f & pg.FLAG_WRITE_STATE:
                row = int(args.output_state_indices[n]) if f & pg.FLAG_OUTPUT_INDICES else n
                args.output_state[row, oh] = H.to(args.output_state.dtype)


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def check_signature(p, args, scratch):
    """What the compiled chunked functions declare (compile/fake.gdn_chunked_tensors) for problem ``p``: the
    static head dims, the dtypes, the ranks (a launch with another shape fails at the call)."""
    K, V, C, io = p.head_dim_k, p.head_dim_v, pg.CHUNK, DTYPES[p.dtype]
    sd = DTYPES[p.state_dtype]
    for name, t, shape, dt in (("q", args.q, (None, None, K), io), ("k", args.k, (None, None, K), io),
                               ("v", args.v, (None, None, V), io), ("g", args.g, (None, None), torch.float32),
                               ("beta", args.beta, (None, None), torch.float32),
                               ("cu_seqlens", args.cu_seqlens, (None,), torch.int32),
                               ("initial_state", args.initial_state, (None, None, V, K), sd),
                               ("initial_state_indices", args.initial_state_indices, (None,), torch.int32),
                               ("output_state", args.output_state, (None, None, V, K), sd),
                               ("output_state_indices", args.output_state_indices, (None,), torch.int32),
                               ("output", args.output, (None, None, V), io),
                               ("chunks", scratch[0], (None, 4), torch.int32),
                               ("chunk_offsets", scratch[1], (None,), torch.int32),
                               ("W", scratch[2], (None, None, C, K), io), ("U", scratch[3], (None, None, C, V), io),
                               ("Aqk", scratch[4], (None, None, C, C), io),
                               ("F", scratch[5], (None, None, 3, C), torch.float32)):
        assert t.dtype == dt and t.dim() == len(shape), (name, t.dtype, tuple(t.shape))
        assert all(w is None or w == got for w, got in zip(shape, t.shape)), (name, tuple(t.shape), shape)


class Launches(list):
    """The emulated launches, in order: ``(kind, module name, problem, args)``; kind ``full`` (prep + main),
    ``prep`` or the main-only run's ``MainRun`` value (``transition`` / ``state`` / ``output``).  A main-only run
    must use the scratch of the last prep (the same tensors) over the same segments."""

    eager = True  # main-only runs get the prep's very scratch tensors

    def kinds(self):
        return [kind for kind, *_ in self]


@pytest.fixture
def launches(monkeypatch):
    seen = Launches()
    prepped = {}

    def full(m, cfg, args):
        seen.append(("full", m.NAME, cfg.problem, args))
        emulate(m, cfg, args)

    def prep(m, cfg, args, scratch):
        assert m.NAME_PREP == m.NAME + "_prep" and isinstance(cfg, m.Config)
        chunks, chunk_off, w, u, aqk, f = scratch
        assert w.shape[-1] == cfg.problem.head_dim_k and u.shape[-1] == cfg.problem.head_dim_v == args.v.shape[2]
        assert torch.equal(chunk_off, pg.plan_chunks(args.cu_seqlens, args.q.shape[0])[1])
        check_signature(cfg.problem, args, scratch)
        prepped.update(scratch=scratch, cu=args.cu_seqlens, problem=cfg.problem)
        seen.append(("prep", m.NAME, cfg.problem, args))

    def main(m, mcfg, args, scratch):
        assert isinstance(mcfg, m.MainConfig) and torch.equal(args.cu_seqlens, prepped["cu"])
        # the prep's scratch itself (traced, functionalization may hand the op copies of the tensors it writes)
        shared = [t.data_ptr() for t in scratch] == [t.data_ptr() for t in prepped["scratch"]]
        assert shared or not seen.eager
        want = dataclasses.replace(prepped["problem"], head_dim_v=prepped["problem"].head_dim_k) \
            if mcfg.run is MainRun.TRANSITION else prepped["problem"]
        assert mcfg.config.problem == want
        run_args, run_scratch = main_run_args(mcfg.run, args, scratch, want.head_dim_v)  # what the kernel sees
        check_signature(want, run_args, run_scratch)
        assert (run_scratch[3] is scratch[2]) == (mcfg.run is MainRun.TRANSITION)
        seen.append((mcfg.run.value, m.NAME, mcfg.config.problem, args))
        emulate(m, mcfg.config, run_args, mcfg.run)

    monkeypatch.setattr(d, "_gdn_launch_direct", full)
    monkeypatch.setattr(d, "_cp_prep_direct", prep)
    monkeypatch.setattr(d, "_cp_main_direct", main)
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
    # one prep, then the main kernel alone three times on its scratch
    assert launches.kinds() == ["prep", "transition", "state", "output"]
    assert all(name == "gdn_chunked_sm90" for _, name, _, _ in launches)
    assert [p.head_dim_v for _, _, p, _ in launches] == [V, K, V, V]
    assert all(p.state_dtype == "float32" for _, _, p, _ in launches)
    P = launches[0][3].cu_seqlens.shape[0] // N  # N P + 1 offsets
    assert P >= 2 and all(a.cu_seqlens.shape[0] == N * P + 1 for *_, a in launches)
    # plain and context-parallel agree; no initial state
    launches.clear()
    o2, s2 = api.chunk_gated_delta_rule(**kw, output_final_state=True, use_cp=True)
    o3, s3 = api.chunk_gated_delta_rule(**kw, output_final_state=True, use_cp=False)
    assert launches.kinds() == ["prep", "transition", "state", "output", "full"]
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
    assert launches.kinds() == ["full", "full"] and all(a.cu_seqlens.shape[0] == 2 for *_, a in launches)
    problem = pg.GdnProblem(dtype="bfloat16", head_dim_k=128, head_dim_v=128)
    T = 65536
    args = pg.GdnArgs(torch.empty(T, 2, 128), None, None, None, None, torch.zeros(2, dtype=torch.int32), None, None,
                      None, None, torch.empty(T, 8, 128), 1.0, 4, 4, 1, 0)
    monkeypatch.setattr(pcp, "CP_AUTO", False)
    assert d.gdn_cp_segments(problem, args, "auto") == 1  # CP_AUTO off: the plain launch
    monkeypatch.setattr(pcp, "CP_AUTO", True)
    # row (d) on 132 SMs: 16 segments x 8 heads of 128-row CTAs (128 chains fill 3/4 of a wave) are one wave;
    # 9-12 segments would take 64-row CTAs, two a chain (144-192 CTAs), 8 segments 128 of them
    assert d.gdn_cp_segments(problem, args, "auto") == 16
    assert d.gdn_cp_segments(problem, args, False) == 1
    with pytest.raises(NotImplementedError, match="use_cp=True"):
        d.gdn_cp_segments(pg.GdnProblem(dtype="bfloat16", head_dim_k=128, head_dim_v=128, decode=True), args, True)
    for bad in (0, 1, "yes", None):
        with pytest.raises(ValueError, match="use_cp"):
            d.gdn_cp_segments(problem, args, bad)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_gdp_runs_the_chunked_kernel_on_the_expanded_timeline(launches, monkeypatch, n):
    # the expansion itself (the SM90 kernel's native rows, its default, are tests/test_gdp_native_sm90_cpu.py's)
    monkeypatch.setenv(d.GDP_NATIVE_ENV, "0")
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
    (kind, name, p, a), = launches
    assert kind == "full" and name == "gdn_chunked_sm90" and p.num_householder == 1
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
    """Traced (fullgraph), the prep and the main-only runs are the custom op cutedsl_attn::gdn_chunked_sm90_cp and
    the chain plain torch: the same launches and results as eager."""
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
    launches.eager = False
    r2 = torch.compile(f, backend="aot_eager", fullgraph=True)(*ins, h0, ht2, o2)
    assert launches.kinds() == ["prep", "transition", "state", "output"] * 2
    assert torch.equal(r1, r2) and torch.equal(ht1, ht2)
    o_ref, s_ref = ref.chunk_gated_delta_rule(*ins[:5], scale=0.125, initial_state=h0, cu_seqlens=ins[5],
                                              output_final_state=True)
    assert rel(o1, o_ref) < 1e-2 and rel(ht1, s_ref) < 1e-5


def test_cp_chain_matches_the_plain_recurrence():
    gen = torch.Generator().manual_seed(5)
    N, P, HO, V, K = 2, 5, 3, 8, 4
    h0 = torch.randn(N, HO, V, K, generator=gen)
    m = torch.randn(N, P, HO, K, K, generator=gen, dtype=torch.float64) * 0.5
    b = torch.randn(N, P, HO, V, K, generator=gen, dtype=torch.float64)
    starts, final = cp_chain(h0, m.float(), b.float())
    s = h0.double()
    for j in range(P):
        assert torch.allclose(starts[:, j], s, rtol=1e-12, atol=1e-12)
        s = s @ m.float().double()[:, j] + b.float().double()[:, j]
    assert starts.shape == (N, P, HO, V, K) and final.dtype == torch.float64 and torch.allclose(final, s)


def test_cp_forced_kernel_without_main_only_entries_takes_full_launches(launches, monkeypatch):
    monkeypatch.setenv(d.GDN_KERNEL_ENV, "recurrent")
    kw = _bf([200, 70], 1, 1, 2, 64, 128)
    h0 = torch.randn(2, 2, 128, 64) * 0.3
    o, s = api.chunk_gated_delta_rule(**kw, initial_state=h0, output_final_state=True, use_cp=True)
    o_ref, s_ref = ref.chunk_gated_delta_rule(**kw, initial_state=h0, output_final_state=True)
    assert launches.kinds() == ["full"] * 3 and all(name == "gdn_recurrent" for _, name, _, _ in launches)
    assert [p.head_dim_v for _, _, p, _ in launches] == [64, 128, 128]
    assert rel(o, o_ref) < 1e-2 and rel(s, s_ref) < 1e-5


def test_cp_prep_config_does_not_depend_on_the_split(launches, monkeypatch):
    """One compiled prep serves every segment count (its config carries the problem's default tiles), while the
    main runs take the tiles of their chain count."""
    kw = _bf([8192], 2, 2, 8, 128, 128)
    problem, args, _ = api._plan_prefill(
        kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], None, None, True, kw["cu_seqlens"], True, None, None, None,
        None, 0, True, None, None, "auto", None, "linear")
    seen = []
    monkeypatch.setattr(d, "_cp_prep_direct", lambda m, cfg, a, sc: seen.append(cfg))
    monkeypatch.setattr(d, "_cp_main_direct", lambda m, mcfg, a, sc: seen.append(mcfg))
    d.gdn_launch_cp(problem, args, 2)
    d.gdn_launch_cp(problem, args, 16)
    prep2, *mains2, prep16 = seen[:5]
    mains16 = seen[5:]
    assert prep2 == prep16 and isinstance(prep2, d._chunked_sm90.Config)
    for mains, tv in ((mains2, 64), (mains16, 128)):  # 16 chains: 64 rows; 128 chains: 128 rows
        assert [m.run for m in mains] == [MainRun.TRANSITION, MainRun.STATE, MainRun.OUTPUT]
        assert {m.config.tiles.tile_v for m in mains} == {tv}


def test_main_config_contract():
    from cutedsl_attn.compile.keys import config_arch, config_key
    from cutedsl_attn.portable import gdn_chunked as pc
    from cutedsl_attn.sm90 import gdn_chunked as s9

    p = pg.GdnProblem(dtype="bfloat16", head_dim_k=128, head_dim_v=128)
    for mod in (s9, pc):
        cfg = mod.Config(p, mod.default_tiles(p, num_sms=132))
        keys = {config_key(mod.MainConfig(cfg, run)) for run in MainRun}
        assert len(keys) == 3 and config_arch(mod.MainConfig(cfg, MainRun.STATE)) == "sm_90a"
        assert mod.MainConfig(cfg).run is MainRun.OUTPUT
        with pytest.raises(TypeError, match="run"):
            mod.MainConfig(cfg, "state")
        with pytest.raises(TypeError, match="config"):
            mod.MainConfig(p, MainRun.STATE)
        assert mod.NAME_PREP == mod.NAME + "_prep" and mod.NAME_MAIN == mod.NAME + "_main"
    with pytest.raises(TypeError, match="gdn_chunked_sm90 Config"):
        s9.MainConfig(pc.Config(p, pc.Tiles()), MainRun.STATE)


def test_main_run_args():
    T, ho, K, V = 10, 4, 64, 128
    args = pg.GdnArgs(torch.empty(T, 2, K), torch.empty(T, 2, K), torch.empty(T, 4, V), None, None, None, None, None,
                      None, None, torch.empty(T, ho, V), 1.0, 2, 2, 1, 0)
    scratch = tuple(torch.empty(1) for _ in range(6))
    a, sc = main_run_args(MainRun.OUTPUT, args, scratch, V)
    assert a is args and sc is scratch
    a, sc = main_run_args(MainRun.STATE, args, scratch, V)
    assert a.output.shape == (1, ho, V) and a.v is args.v and sc is scratch
    a, sc = main_run_args(MainRun.TRANSITION, args, scratch, K)
    assert a.output.shape == (1, ho, K) and a.v is args.k and sc[3] is scratch[2] and sc[:3] == scratch[:3]


# ---------------------------------------------------------------------------- the split entries' PTX
def _ptx(compile_fn, cfg):
    text = build(compile_fn, cfg).ptx  # (shared with the kernel modules' own PTX tests)
    entries = re.findall(r"\.entry\s+([A-Za-z_$][\w$]*)", text)
    # each kernel's text from its .entry to its closing brace (column 0)
    bodies = {name: text.split(".entry")[i + 1].rsplit("\n}\n", 1)[0] for i, name in enumerate(entries)}
    return text, bodies


def _normalised(body):
    """Kernel names, the module-numbered shared-memory symbol and block labels made position-free."""
    body = re.sub(r"__dynamic_shmem__\d+", "SHMEM", re.sub(r"kernel_\w+", "KERNEL", body))
    return re.sub(r"\$L__BB\d+_", "$L__BB_", body)  # block labels carry the kernel's index in its module


@pytest.mark.parametrize("mod_name,arch,tiles", [("sm90", "sm_90a", (64, 2)), ("sm90", "sm_90a", (128, 2)),
                                                 ("portable", "sm_100a", (32, 8))])
def test_split_entries_ptx(mod_name, arch, tiles):
    from cutedsl_attn.portable import gdn_chunked as pc
    from cutedsl_attn.sm90 import gdn_chunked as s9

    mod = s9 if mod_name == "sm90" else pc
    p = pg.GdnProblem(dtype="bfloat16", head_dim_k=128, head_dim_v=128, use_qk_l2norm=True, arch=arch)
    t = mod.Tiles(tile_v=tiles[0], num_stages=tiles[1]) if mod is s9 else mod.Tiles(tile_v=tiles[0],
                                                                                    num_warps=tiles[1])
    cfg = mod.Config(p, t)
    _, plain = _ptx(mod.compile, cfg)
    (plain_prep, plain_main) = plain.values()
    text, prep = _ptx(mod.compile_prep, cfg)
    assert re.search(rf"\.target\s+{arch}", text) and len(prep) == 1
    assert "prep" in next(iter(prep)) and _normalised(next(iter(prep.values()))) == _normalised(plain_prep)
    got = {}
    for run in MainRun:
        text, main = _ptx(mod.compile_main, mod.MainConfig(cfg, run))
        assert len(main) == 1 and "main" in next(iter(main)) and ".local" not in text
        got[run] = next(iter(main.values()))
    # the outputs run is the plain launch's main kernel, instruction for instruction
    assert _normalised(got[MainRun.OUTPUT]) == _normalised(plain_main)
    cp_async = {run: b.count("cp.async.cg.shared.global") for run, b in got.items()}
    # no q / Aqk loads without outputs, no U loads in the transition run
    assert cp_async[MainRun.OUTPUT] > cp_async[MainRun.STATE] > cp_async[MainRun.TRANSITION]
    if mod is s9:
        K, C = 128, pg.CHUNK
        for run, body in got.items():
            n64 = len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16\.bf16", body))
            nk = len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{K}k16\.f32\.bf16\.bf16", body))
            waits = sorted(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", body))
            u_reads = body.count("ld.shared.u16")
            o_stores = body.count("st.global.b16")
            if run is MainRun.OUTPUT:
                assert (n64, nk, waits) == (2 * (K // 16) + C // 16, C // 16, ["0", "0", "1"])
                assert u_reads and o_stores
            else:  # X^T and the state update only: nothing in flight at the first wait
                assert (n64, nk, waits) == (K // 16, C // 16, ["0", "0"]) and o_stores == 0
                assert bool(u_reads) == (run is MainRun.STATE)
    else:
        mma = {run: len(re.findall(r"mma\.sync\.aligned\.m16n8k16", b)) for run, b in got.items()}
        assert mma[MainRun.STATE] == mma[MainRun.TRANSITION] < mma[MainRun.OUTPUT]
        assert got[MainRun.OUTPUT].count("st.global") > 0
        for run in (MainRun.STATE, MainRun.TRANSITION):
            # the final state's stores only (st.global.v2.f32), no output rows (st.global.u32 / b32)
            assert not re.search(r"st\.global\.(u32|b32)", got[run])
        assert "ld.shared.b32" in got[MainRun.STATE] and "ld.shared.b32" not in got[MainRun.TRANSITION]
