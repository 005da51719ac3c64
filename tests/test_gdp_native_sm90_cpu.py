"""CPU tests of Gated DeltaProduct on the SM90 chunked GDN kernel without the expansion's copies
(``Config.expand_rows``, :mod:`cutedsl_attn.sm90.gdn_rows`): the config and compile-key rules, the PTX of the
native configs (cross-compiled for sm_90a) against the plain ones, the launch's chunk plan over k's expanded
rows, and the dispatch's routing (native by default, ``CUTEDSL_ATTN_GDP_NATIVE=0`` the expansion; stubbed
compiles: no GPU)."""

import dataclasses
import itertools
import re

import pytest
import torch

from cutedsl_attn.compile.cubin import cubin_kernel_resources
from cutedsl_attn.compile.keys import config_key
from cutedsl_attn.planning.gdn import (
    CHUNK, FLAG_HAS_BETA, FLAG_HAS_G, FLAG_HAS_INITIAL_STATE, FLAG_WRITE_STATE, GdnArgs, GdnProblem,
)

sm90 = pytest.importorskip("cutedsl_attn.sm90.gdn_chunked")

from _builds import build  # noqa: E402 (tests/ is on sys.path): one compile per configuration a session


def _problem(**kw):
    return GdnProblem(**{**dict(dtype="bfloat16", head_dim_k=128, head_dim_v=128), **kw})


def _tiles(tile_v=128, **kw):
    return sm90.Tiles(tile_v=tile_v, prep=1, **kw)


# ---------------------------------------------------------------------------- config
def test_config_rules_and_compile_key():
    p = _problem()
    assert sm90.Config(p, _tiles()).expand_rows == 1  # the default: the tokens' timeline
    assert sm90.Config(p, _tiles()) == sm90.Config(p, _tiles(), expand_rows=1)
    native = sm90.Config(p, _tiles(), expand_rows=2)
    assert native != sm90.Config(p, _tiles()) and native != sm90.Config(p, _tiles(), expand_rows=3)
    assert "expand_rows=2" in config_key(native) and config_key(native) != config_key(sm90.Config(p, _tiles()))
    assert sm90.Config(p, _tiles(64, num_stages=3), expand_rows=8).expand_rows == 8
    for bad in (0, 9, -1):
        with pytest.raises(ValueError, match="expand_rows must be in"):
            sm90.Config(p, _tiles(), expand_rows=bad)
    for bad in (True, 2.0, "2"):
        with pytest.raises(TypeError, match="expand_rows must be an int"):
            sm90.Config(p, _tiles(), expand_rows=bad)
    # what the native path lacks: TMA boxes, the persistent grid, the shared mma.sync prep
    for tiles in (_tiles(tma=1), _tiles(persistent=1), _tiles(persistent=4), sm90.Tiles(prep=0)):
        sm90.Config(p, tiles)  # fine on the tokens' timeline
        with pytest.raises(ValueError, match="needs tma = 0, persistent = 0 and prep = 1"):
            sm90.Config(p, tiles, expand_rows=2)
    # the split entries plan the chunks over q's rows: refused before any compile
    with pytest.raises(ValueError, match="compile_prep: expand_rows 2"):
        sm90.compile_prep(native)
    with pytest.raises(ValueError, match="compile_main: expand_rows 2"):
        sm90.compile_main(sm90.MainConfig(native, sm90.MainRun.STATE))
    assert "expand_rows" not in sm90.TUNING_FIELDS  # a problem fact, not a tile: CUTEDSL_ATTN_GDN_TUNE cannot set it


# ---------------------------------------------------------------------------- PTX
def _entries(ptx):
    parts = ptx.split(".entry")
    assert len(parts) == 3, "one function, two kernels (the prep, the main kernel)"
    return parts[1], parts[2]


def _count(pattern, text):
    return len(re.findall(pattern, text))


SRC_SIZE = r"selp\.b32\s+%r\d+, 16, 0, %p\d+;"  # a cp.async's zero-fill size, chosen by a predicate
PARITY = r"and\.b32\s+%r\d+, %r\d+, 1;"  # r % 2 of an expanded row (n = 2)

NATIVE_VARIANTS = {
    "k128_bf16_128x2_n2": (dict(), 128, 2),
    "k128_l2norm_log_64x2_n3": (dict(use_qk_l2norm=True, gate_domain="log"), 64, 3),
    "k64_v128_fp16_bf16state_64x2_n2": (dict(dtype="float16", head_dim_k=64, state_dtype="bfloat16"), 64, 2),
}


@pytest.mark.parametrize("variant", sorted(NATIVE_VARIANTS))
def test_native_ptx_against_the_plain_kernel(variant):
    """expand_rows n: the same wgmma code and k / v / scratch loads; q pieces zero-filled by their own row test,
    the gate of a token's first row, and (n = 2) half the output stores, statically (the readout rows are the odd
    ones); no local memory, no stack, the plain kernel's register budget."""
    kw, tv, n = NATIVE_VARIANTS[variant]
    p = _problem(**kw)
    plain, native = (build(sm90.compile, sm90.Config(p, _tiles(tv), expand_rows=e)) for e in (1, n))
    prep1, main1 = _entries(plain.ptx)
    prepn, mainn = _entries(native.ptx)
    assert re.search(r"\.target\s+sm_90a", native.ptx) and ".local" not in native.ptx
    for a, b in ((prep1, prepn), (main1, mainn)):
        assert _count(r"wgmma\.mma_async", a) == _count(r"wgmma\.mma_async", b) > 0
        assert _count(r"cp\.async\.cg\.shared\.global", a) == _count(r"cp\.async\.cg\.shared\.global", b)
    # the prep's q tile: (C K / 8) / 128 pieces a thread, each zero-filled by its own predicate (row and token)
    q_pieces = CHUNK * p.head_dim_k // 8 // 128
    assert _count(SRC_SIZE, prepn) == _count(SRC_SIZE, prep1) + q_pieces
    # one gate load and conversion a thread either way (the identity rows convert 1 / 0 exactly as a copy's)
    assert _count(r"lg2\.approx", prepn) == _count(r"lg2\.approx", prep1) == int(p.gate_domain == "linear")
    stores1, storesn = _count(r"st\.global\.b16", main1), _count(r"st\.global\.b16", mainn)
    assert stores1 == 2 * (CHUNK // 8) * 2  # two rows of each of the thread's 16 token columns
    if n == 2:
        assert storesn == stores1 // 2  # only the odd columns (e = 1) are readout rows: the others are not emitted
        assert _count(PARITY, prepn) >= q_pieces + 1  # each q piece's row and the gate's row
    else:
        assert storesn == stores1  # a run-time row test (t0 % n varies by chunk)
        assert _count(r"mul\.hi\.u32", prepn) > _count(r"mul\.hi\.u32", prep1)  # r // n by a constant
    res1, resn = cubin_kernel_resources(plain.cubin), cubin_kernel_resources(native.cubin)
    assert len(resn) == 2 and all(r["stack_bytes"] == 0 for r in resn.values()), resn
    main_res = [r for k, r in resn.items() if "main" in k][0]
    assert main_res["registers"] <= 65536 // (128 * (1 + tv // 64))  # launchable before setmaxnreg
    assert prepn != prep1 and mainn != main1


def test_plain_config_has_no_row_mapping():
    """expand_rows = 1 traces today's code: no parity tests in the main kernel, every column stored, the q and k
    pieces of the prep sharing their zero-fill predicates (the PTX is byte-identical to the kernel before the
    field: checked by md5 when the field was added)."""
    prep, main = _entries(build(sm90.compile, sm90.Config(_problem(), _tiles())).ptx)
    assert _count(r"st\.global\.b16", main) == 32 and _count(PARITY, main) == 0
    assert _count(SRC_SIZE, prep) == CHUNK * 128 // 8 // 128


# ---------------------------------------------------------------------------- launch
def _gdp_args(lens, n, ho=4, K=128, V=128, flags=FLAG_HAS_G | FLAG_HAS_BETA | FLAG_WRITE_STATE):
    T, N = sum(lens), len(lens)
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    x = torch.zeros(T * n, ho, K, dtype=torch.bfloat16)
    st = torch.zeros(N, ho, V, K)
    idx = torch.zeros(1, dtype=torch.int32)
    return GdnArgs(torch.zeros(T, ho, K, dtype=torch.bfloat16), x, torch.zeros(T * n, ho, V, dtype=torch.bfloat16),
                   torch.ones(T, ho), torch.ones(T * n, ho), cu, st, idx, st, idx,
                   torch.zeros(T, ho, V, dtype=torch.bfloat16), 1.0, 1, 1, 1, flags)


def test_native_launch_plans_the_expanded_rows():
    lens, n = [5, 0, 200, 64, 33], 3
    args = _gdp_args(lens, n)
    calls = []
    cfg = sm90.Config(_problem(), _tiles(), expand_rows=n)
    sm90.launch(lambda *a: calls.append(a), cfg, args._replace(cu_seqlens=args.cu_seqlens * n))
    (a,) = calls
    assert len(a) == 22  # no persistent plan
    assert a[0] is args.q and a[1] is args.k and a[3] is args.g and a[12] is args.output  # on their own timelines
    chunks, chunk_off = a[6], a[7]
    T = sum(lens)
    assert chunks.shape[0] == T * n // CHUNK + len(lens)  # the plan's bound over k's T n rows
    want = [-(-ln * n // CHUNK) for ln in lens]
    assert (chunk_off[1:] - chunk_off[:-1]).tolist() == want
    rows = chunks[: sum(want)]
    assert rows[:, 2].sum().item() == T * n
    assert rows[0, 1].item() == 0 and rows[1, 1].item() == 5 * n  # sequence 2 starts at token 5's first row
    assert a[13].shape[0] == chunks.shape[0]  # W: one block a planned chunk
    with pytest.raises(ValueError, match="expand_rows 3: k must have 3 x q's"):
        sm90.launch(lambda *a: None, cfg, args._replace(k=args.k[:-1]))
    with pytest.raises(ValueError, match="the output q's"):
        sm90.launch(lambda *a: None, cfg, args._replace(output=args.output[:-1]))
    with pytest.raises(ValueError, match="expand_rows 3: k must have"):
        sm90.launch(lambda *a: None, cfg, args._replace(v=args.v[:-1]))
    # a gate off its timeline (the expansion's [T n, HO] g, a token-timeline beta) is refused before the launch
    with pytest.raises(ValueError, match=r"g must be \[T, HO\]"):
        sm90.launch(lambda *a: None, cfg, args._replace(g=torch.ones(T * n, 4)))
    with pytest.raises(ValueError, match=r"beta must be \[T n, HO\]"):
        sm90.launch(lambda *a: None, cfg, args._replace(beta=torch.ones(T, 4)))
    # absent gates are 1-element dummies: not checked
    calls.clear()
    sm90.launch(lambda *a: calls.append(a), cfg, args._replace(g=torch.ones(1, 1), beta=torch.ones(1, 1),
                                                               flags=FLAG_WRITE_STATE))
    assert len(calls) == 1


def _kernel_rows(chunks, n):
    """What the kernels' row arithmetic (:mod:`cutedsl_attn.sm90.gdn_rows`) does over a chunk table, in Python:
    the tokens the consumer threads store (``_store_o_rows``: lane column ``t``, tile ``jj``, column ``e``; at
    n = 2 the even columns are dropped at compile time), the (expanded row, token) pairs of the q rows loaded
    (``_q_row_copy``) and the tokens whose gate is read (``_p90_gates``)."""
    stored, q_rows, g_toks = [], [], []
    for tok0, ln in chunks:
        for t in range(4):
            for jj in range(CHUNK // 8):
                for e in range(2):
                    if n == 2 and e == 0:
                        continue
                    s = jj * 8 + 2 * t + e
                    tok, sub = divmod(tok0 + s, n)
                    if s < ln and (n == 2 or sub == n - 1):
                        stored.append(tok)
        for r in range(ln):
            tok, sub = divmod(tok0 + r, n)
            if sub == n - 1:
                q_rows.append((tok0 + r, tok))
            if sub == 0:
                g_toks.append(tok)
    return stored, q_rows, g_toks


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_row_maps_over_the_chunk_plan(n):
    """Over the chunk plan of ``cu_seqlens * n`` (tails, empty sequences, chunk starts that are not multiples of
    n = 3, 5): every token's output stored exactly once (the n = 2 compile-time drop of the even columns needs
    even chunk starts), its q loaded at its last row only and its gate read at its first row only."""
    from cutedsl_attn.planning.gdn import plan_chunks

    gen = torch.Generator().manual_seed(n)
    for lens in ([0, 1, 31, 32, 33, 0, 1000], torch.randint(0, 200, (12,), generator=gen).tolist(), [0]):
        T = sum(lens)
        cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
        chunks, _ = plan_chunks(cu * n, T * n)
        real = [(int(a), int(b)) for a, b in chunks[:, 1:3].tolist() if b > 0]
        if n in (2, 4, 8):
            assert all(tok0 % n == 0 for tok0, _ in real)  # the sequences start on token boundaries
        stored, q_rows, g_toks = _kernel_rows(real, n)
        assert sorted(stored) == list(range(T))
        assert sorted(q_rows) == [(t * n + n - 1, t) for t in range(T)]
        assert sorted(g_toks) == list(range(T))


# ---------------------------------------------------------------------------- dispatch
@pytest.fixture
def recorded(monkeypatch):
    """Every compile dispatch asks for (the kernel's name and config) and each call of the stub it returns (the
    positional arguments); the env switches start unset."""
    from cutedsl_attn.dispatch import gdn as d

    for var in (d.GDN_KERNEL_ENV, d.GDN_TUNE_ENV, d.GDP_NATIVE_ENV):
        monkeypatch.delenv(var, raising=False)
    log = []

    def fake_compiled(name, cfg, build_fn):
        return lambda *a: log.append((name, cfg, a))

    monkeypatch.setattr(d, "get_compiled", fake_compiled)
    return d, log


def _gdp_problem(n, **kw):
    return _problem(num_householder=n, **kw)


@pytest.mark.parametrize("n", [2, 3])
def test_dispatch_native_by_default_expansion_when_off(recorded, monkeypatch, n):
    d, log = recorded
    lens = [1, 31, 0, 1000]
    args = _gdp_args(lens, n)
    T = sum(lens)
    for switch in (None, "", "1"):  # the default (unset), empty and on: the native rows
        if switch is not None:
            monkeypatch.setenv(d.GDP_NATIVE_ENV, switch)
        log.clear()
        d.gdn_launch(_gdp_problem(n), args)
        ((name, cfg, a),) = log
        assert name == sm90.NAME and cfg.expand_rows == n and cfg.problem.num_householder == 1
        assert cfg.tiles == sm90.default_tiles(cfg.problem, num_sms=132, chains=len(lens) * 4)  # the same tiles
        assert a[0] is args.q and a[3] is args.g and a[12] is args.output  # no copies
        assert a[5].tolist() == (args.cu_seqlens * n).tolist()
    monkeypatch.setenv(d.GDP_NATIVE_ENV, "0")
    log.clear()
    d.gdn_launch(_gdp_problem(n), args)
    ((name, cfg, a),) = log
    assert name == sm90.NAME and cfg.expand_rows == 1 and cfg.problem.num_householder == 1
    assert a[0].shape[0] == T * n and a[12].shape[0] == T * n  # q_e and o_e on the expanded timeline


@pytest.mark.parametrize("env,value", [("CUTEDSL_ATTN_GDN_TUNE", "tma=1"), ("CUTEDSL_ATTN_GDN_TUNE", "persistent=4"),
                                       ("CUTEDSL_ATTN_GDN_TUNE", "prep=0"), ("CUTEDSL_ATTN_GDN_KERNEL", "chunked"),
                                       ("CUTEDSL_ATTN_GDN_KERNEL", "fused_sm90")])
def test_dispatch_falls_back_where_the_native_path_lacks(recorded, monkeypatch, env, value):
    """The switch on, but tiles or a kernel the native path does not serve: the expansion (never the native
    config on another kernel)."""
    d, log = recorded
    monkeypatch.setenv(d.GDP_NATIVE_ENV, "1")
    monkeypatch.setenv(env, value)
    args = _gdp_args([33, 64], 2)
    d.gdn_launch(_gdp_problem(2), args)
    ((name, cfg, a),) = log
    assert getattr(cfg, "expand_rows", 1) == 1 and a[0].shape[0] == 2 * args.q.shape[0]


def test_dispatch_switch_value_and_other_paths(recorded, monkeypatch):
    d, log = recorded
    args = _gdp_args([33], 2)
    monkeypatch.setenv(d.GDP_NATIVE_ENV, "yes")
    with pytest.raises(ValueError, match="CUTEDSL_ATTN_GDP_NATIVE must be 0 or 1"):
        d.gdn_launch(_gdp_problem(2), args)
    assert not log  # refused before any launch
    monkeypatch.setenv(d.GDP_NATIVE_ENV, "1")
    served = dataclasses.replace(_gdp_problem(2), num_householder=1)
    assert d._gdp_native(served, args, 2, None).expand_rows == 2
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        assert d._gdp_native(served, args, 2, None) is None  # the custom op's key is the problem: expansion
    # GDN itself (n = 1) never takes the expanded path
    gdn_args = _gdp_args([33], 1)
    d.gdn_launch(_problem(), gdn_args)
    ((_, cfg, a),) = log
    assert cfg.expand_rows == 1 and a[0] is gdn_args.q
    # a problem the SM90 kernel leaves to the recurrent kernel (the decode step) is untouched by the switch
    log.clear()
    d.gdn_launch(_gdp_problem(2, decode=True), _gdp_args([3], 2))
    assert log[0][0] == "gdn_recurrent"
    # a bad value is refused on every Gated DeltaProduct route (here the recurrent kernel), before any launch;
    # GDN (n = 1) does not read the switch
    monkeypatch.setenv(d.GDP_NATIVE_ENV, "true")
    log.clear()
    with pytest.raises(ValueError, match="CUTEDSL_ATTN_GDP_NATIVE must be 0 or 1"):
        d.gdn_launch(_gdp_problem(2, decode=True), _gdp_args([3], 2))
    with monkeypatch.context() as m:
        m.setenv(d.GDN_KERNEL_ENV, "recurrent")
        with pytest.raises(ValueError, match="CUTEDSL_ATTN_GDP_NATIVE must be 0 or 1"):
            d.gdn_launch(_gdp_problem(2), _gdp_args([33], 2))
    assert not log
    d.gdn_launch(_problem(), _gdp_args([33], 1))
    assert log[0][1].expand_rows == 1


def _emulated_kernel(expand_rows, log_gate, l2norm):
    """The chunked kernel's contract in float64 on its positional arguments, walking the chunk table: expanded row
    ``r`` reads k / v / beta row ``r``, q and g of token ``r // n`` (zero q off a readout row, identity gate off a
    token's first row) and writes the output of token ``r // n`` on a readout row
    (:mod:`cutedsl_attn.sm90.gdn_rows`)."""
    n = expand_rows

    def kernel(q, k, v, g, beta, cu, chunks, chunk_off, h0, h0_idx, ht, ht_idx, out, w, u, aqk, f, scale, qg, kg,
               vg, flags):
        ho, K = out.shape[1], q.shape[2]
        for s in range(cu.shape[0] - 1):
            for oh in range(ho):
                H = h0[s, oh].double().clone() if flags & FLAG_HAS_INITIAL_STATE else torch.zeros(
                    out.shape[2], K, dtype=torch.float64)
                for c in range(int(chunk_off[s]), int(chunk_off[s + 1])):
                    assert int(chunks[c, 0]) == s
                    tok0, ln = int(chunks[c, 1]), int(chunks[c, 2])
                    for r in range(tok0, tok0 + ln):
                        t, sub = divmod(r, n)
                        qt = q[t, oh // qg].double() * (sub == n - 1)
                        kt = k[r, oh // kg].double()
                        if l2norm:
                            qt, kt = (x * torch.rsqrt((x * x).sum() + 1e-6) for x in (qt, kt))
                        a = 1.0
                        if flags & FLAG_HAS_G and sub == 0:
                            a = float(g[t, oh].exp()) if log_gate else float(g[t, oh])
                        b = float(beta[r, oh]) if flags & FLAG_HAS_BETA else 1.0
                        H = a * H
                        H = H + b * (v[r, oh // vg].double() - H @ kt)[:, None] * kt[None, :]
                        if sub == n - 1:
                            out[t, oh] = (scale * (H @ qt)).to(out.dtype)
                if flags & FLAG_WRITE_STATE:
                    ht[s, oh] = H.to(ht.dtype)

    return kernel


@pytest.mark.parametrize("n,gate_domain,l2norm", [(2, "linear", False), (3, "log", True)])
def test_native_contract_matches_the_oracle_and_the_expansion(monkeypatch, n, gate_domain, l2norm):
    """What the dispatch hands the native kernel, run by a float64 emulation of the row mapping, is Gated
    DeltaProduct (the oracle) and the expansion's result."""
    from cutedsl_attn.dispatch import gdn as d
    from cutedsl_attn.ref import delta_family as rd

    for var in (d.GDN_KERNEL_ENV, d.GDN_TUNE_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(d, "get_compiled", lambda name, cfg, b: _emulated_kernel(
        getattr(cfg, "expand_rows", 1), cfg.problem.gate_domain == "log", cfg.problem.use_qk_l2norm))
    gen = torch.Generator().manual_seed(0)
    lens, ho, K = [0, 1, 31, 3], 2, 64
    T, N = sum(lens), len(lens)
    q = torch.randn(T, ho, K, generator=gen).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(T * n, ho, K, generator=gen), dim=-1).bfloat16()
    v = torch.randn(T * n, ho, K, generator=gen).bfloat16()
    alpha = torch.rand(T, ho, generator=gen) * 0.5 + 0.5
    beta = torch.rand(T * n, ho, generator=gen)
    h0 = torch.randn(N, ho, K, K, generator=gen) * 0.1
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    o_ref, s_ref = rd.chunk_gated_delta_product(q, k, v, alpha, beta, num_householder=n, scale=K ** -0.5,
                                                initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                                use_qk_l2norm_in_kernel=l2norm)
    g = alpha if gate_domain == "linear" else alpha.log()
    flags = FLAG_HAS_G | FLAG_HAS_BETA | FLAG_WRITE_STATE | FLAG_HAS_INITIAL_STATE
    p = _problem(head_dim_k=K, head_dim_v=K, gate_domain=gate_domain, use_qk_l2norm=l2norm, num_householder=n)
    res = {}
    for native in ("0", "1"):
        monkeypatch.setenv(d.GDP_NATIVE_ENV, native)
        out, st = torch.full((T, ho, K), float("nan")).bfloat16(), torch.full((N, ho, K, K), float("nan"))
        d.gdn_launch(p, GdnArgs(q, k, v, g, beta, cu, h0, torch.zeros(1, dtype=torch.int32), st,
                                torch.zeros(1, dtype=torch.int32), out, K ** -0.5, 1, 1, 1, flags))
        res[native] = out, st
    for out, st in res.values():
        assert torch.isfinite(out.float()).all()
        assert (out.double() - o_ref).norm() / o_ref.norm() < 1e-2
        assert (st.double() - s_ref).norm() / s_ref.norm() < 1e-6
    assert torch.equal(res["0"][0], res["1"][0]) and torch.equal(res["0"][1], res["1"][1])
