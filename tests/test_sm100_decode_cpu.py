"""CPU checks of the SM100 / SM103 tcgen05 decode kernel (``cutedsl_attn.sm100.decode``), which no GPU here runs.

* every configuration of the decode GPU test matrix (page sizes 1 / 16 / 64, groups 1 / 4 / 8, head dims 64 /
  128; split and unsplit share one build: the split is a work-table property), with fp16 / bf16 queries, sinks
  and fp8 caches spread over it, cross-compiles for ``sm_100a`` and ``sm_103a``;
* the PTX is the design's: swap-AB tcgen05.mma (kind::f16, both operands shared-memory descriptors), tcgen05.ld
  / st, one tcgen05.alloc and one dealloc, tcgen05.commit onto mbarriers, cp.async gathers, the page-table
  warp's 4-byte cp.async of the page ids, redux.sync block maxima, the split-KV counter, the fp8 widening
  (``cvt.rn.f16x2.e4m3x2``) exactly for fp8 caches; no wgmma, mma.sync, ldmatrix, setmaxnreg;
* resource gate on the cubin: no stack (spills), registers within the launch budget of the CTA's 320 threads
  (every role runs within it: no setmaxnreg), no local loads / stores in the SASS, shared memory and TMEM
  within the SM's limits;
* SASS shape per KV block: UTCHMMA, LDTM, STTM, LDGSTS, MUFU.EX2 counts as the design says;
* trace-time tile math: the TMEM plan, the MMA partition shapes, the operand layouts' swizzles, the cp.async /
  st.shared address map of every operand tile (a bijection keeping 16-byte pieces whole), the TMEM lane of each
  O^T row; the kernel contract and every refused feature.
"""

import dataclasses
import functools
import re

import pytest
from _builds import build, sass  # (tests/ is on sys.path)

from cutedsl_attn.planning.decode import DecodeArgs, DecodeProblem, occupancy, plan_paged_decode
from cutedsl_attn.sm100 import decode as K
from cutedsl_attn.sm100.decode import config as C

ARCHS = ("sm_100a", "sm_103a")
# MUFU.EX2 of the split-KV merge (common to every configuration: the sink term, the unrolled max-weight loop
# and the weights), traced once per kernel
MERGE_EX2 = 7


def problem(arch="sm_100a", d=128, ps=16, g=4, dtype="bfloat16", sinks=False, kv="", **kw):
    return DecodeProblem(dtype=dtype, head_dim=d, page_size=ps, group_size=g, use_sinks=sinks, arch=arch, kv_dtype=kv,
                         **kw)


# the decode GPU test matrix's configurations, both archs (fp16 and sinks spread over it), the odd ones of
# tests/test_decode_gpu.py the kernel serves (page size 3 with 5 heads per group, 16 heads per group), and fp8
# caches (bf16 and fp16 queries)
SERVED = [
    dict(arch=a, d=d, ps=ps, g=g, dtype="float16" if g == 1 else "bfloat16", sinks=ps == 64, kv="")
    for a in ARCHS for d in (64, 128) for ps in (1, 16, 64) for g in (1, 4, 8)
] + [dict(arch=a, d=128, ps=ps, g=g, dtype="bfloat16", sinks=False, kv="") for a in ARCHS
     for ps, g in ((3, 5), (16, 16))] + [
    dict(arch=a, d=d, ps=ps, g=g, dtype=dt, sinks=ps == 1, kv="float8_e4m3fn") for a in ARCHS for d in (64, 128)
    for ps, g, dt in ((16, 4, "bfloat16"), (1, 8, "float16"))
]


def _id(kw):
    return (f"{kw['arch']}-d{kw['d']}-ps{kw['ps']}-g{kw['g']}-{kw['dtype']}" + ("-sinks" if kw["sinks"] else "")
            + ("-fp8kv" if kw["kv"] else ""))


def gathers(cfg):
    """cp.async per load thread and block (plus Q's pieces): 16-bit rows in 16-byte pieces of 8 elements straight
    into the operand layouts, fp8 rows in pieces of 16 elements into the staging ring; two rows per thread."""
    d = cfg.problem.head_dim
    q = C.HEAD_TILE * d // 8 // 128
    return q + (2 * 2 * d // 32 if cfg.problem.kv_fp8 else 2 * d // 8)


def shared_v4_stores(cfg):
    """st.shared.v4: P^T's two per block, and for an fp8 cache the widening (two 16-byte stores per 16-element
    piece, traced twice: in the loop and for the last block) and a bf16 query's conversion to f16 (traced twice)."""
    p = cfg.problem
    if not p.kv_fp8:
        return 2
    q = 2 * (C.HEAD_TILE * p.head_dim // 8 // 128) if p.dtype == "bfloat16" else 0
    return 2 + 2 * (2 * 2 * p.head_dim // 32 * 2) + q


@functools.lru_cache(maxsize=None)
def _config(key):
    kw = dict(key)
    p = problem(**kw)
    return K.Config(p, K.default_tiles(p, num_sms=148))


def _build(key):
    """(cfg, ptx text, cubin bytes, dump dir) of one configuration (one compile per Config in the session, shared
    with the other files' builds: :func:`_builds.build`)."""
    cfg = _config(key)
    b = build(K.compile, cfg)
    return cfg, b.ptx, b.cubin, b.dump_dir


def built(kw):
    return _build(tuple(sorted(kw.items())))


def _sass(key):
    return sass(K.compile, _config(key))


def sass_counts(kw):
    """Opcode (mnemonic with its ``.``-suffixes) -> count in the kernel's SASS."""
    text = _sass(tuple(sorted(kw.items())))
    counts = {}
    for op in re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text):
        counts[op] = counts.get(op, 0) + 1
    return counts


def count_prefix(counts, prefix):
    return sum(n for op, n in counts.items() if op == prefix or op.startswith(prefix + "."))


# ============================================================================= compile + PTX mix
@pytest.mark.parametrize("kw", SERVED, ids=_id)
def test_compiles_with_the_tcgen05_instruction_mix(kw):
    cfg, ptx, _, _ = built(kw)
    d = cfg.problem.head_dim
    assert f".target {kw['arch']}" in ptx
    for needed in ("tcgen05.mma", "tcgen05.ld", "tcgen05.st", "tcgen05.commit", "tcgen05.relinquish_alloc_permit",
                   "cp.async.cg.shared.global", "cp.async.wait_group", "mbarrier.try_wait", "redux.sync.max.f32",
                   "fence.proxy.async.shared::cta", "atom.global.add"):
        assert needed in ptx, f"{needed} missing from the PTX"
    for banned in ("wgmma", "mma.sync", "ldmatrix", "setmaxnreg", "ld.local", "st.local"):
        assert banned not in ptx, f"{banned} in the SM100 decode kernel"
    # one tcgen05.mma per 16-wide K step: S^T = K Q^T over head_dim, O^T = V^T P^T over the 128-token block
    assert ptx.count("tcgen05.mma.") == d // 16 + C.TILE_KV // 16
    # both operands of both GEMMs are shared-memory descriptors (P^T comes from shared memory: only A may be TMEM)
    mmas = re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f16\S* (\[%r\d+\]), (\S+), (\S+),", ptx)
    assert len(mmas) == d // 16 + C.TILE_KV // 16
    assert all(a.startswith("%rd") and b.startswith("%rd") for _, a, b in mmas)
    # TMEM: allocated once, freed once, by one warp; three 32x32b.x16 loads (S^T, O^T rescale, O^T epilogue),
    # one store (the rescale)
    assert ptx.count("tcgen05.alloc.") == 1 and ptx.count("tcgen05.dealloc.") == 1
    assert ptx.count("tcgen05.ld.sync.aligned.32x32b.x16.b32") == 3 == ptx.count("tcgen05.ld.")
    assert ptx.count("tcgen05.st.sync.aligned.32x32b.x16.b32") == 1 == ptx.count("tcgen05.st.")
    # four commits: S^T full, O^T full, P^T buffer free, K / V stage free
    assert ptx.count("tcgen05.commit.") == 4
    # the gathers: Q's 16-byte pieces over 128 threads, then half of two K and two V rows per thread and block
    assert ptx.count("cp.async.cg.shared.global") == gathers(cfg)
    # the page-table warp: one 4-byte page id a token, four tokens a lane and block
    assert ptx.count("cp.async.ca.shared.global") == C.TILE_KV // 32
    assert ptx.count("cp.async.mbarrier.arrive.noinc") == 1
    # P^T written as two 16-byte shared stores per thread and block (and the fp8 widening's)
    assert ptx.count("st.shared.v4.b32") == shared_v4_stores(cfg)
    assert ("cvt.rn.f16x2.e4m3x2" in ptx) == cfg.problem.kv_fp8
    if cfg.problem.kv_fp8:  # both MMAs in f16 whatever the query's dtype
        import cutlass

        assert cfg.mma_dtype is cutlass.Float16 and cfg.kv_cutlass_dtype is cutlass.Float8E4M3FN


@pytest.mark.parametrize("arch", ARCHS)
def test_split_and_unsplit_share_one_build(arch):
    """The split is a property of the work table (``num_splits`` per row), not of the compile key: the default
    tiles do not depend on it and the one build holds both the direct store and the merge."""
    p = problem(arch=arch)
    assert K.default_tiles(p, num_sms=148, split=True) == K.default_tiles(p, num_sms=148, split=False)
    _, ptx, _, _ = built(SERVED[0] | dict(arch=arch))
    assert "atom.global.add" in ptx and "ld.global.cg.v4.f32" in ptx  # the merge's counter and partial loads


# ============================================================================= resource gate
@pytest.mark.parametrize("kw", SERVED, ids=_id)
def test_resources_no_spills_within_the_register_file(kw):
    from cutedsl_attn.inspect import cubin_resources

    cfg, _, cubin, _ = built(kw)
    res = cubin_resources(cubin)
    assert res["stack_bytes"] == 0, f"stack frame {res['stack_bytes']} B: spills or a local array"
    assert res["registers"] <= cfg.roles.launch_registers  # no setmaxnreg: every role within the launch budget
    assert cfg.roles.launch_registers * cfg.num_threads <= C.REGISTER_FILE
    counts = sass_counts(kw)
    assert count_prefix(counts, "LDL") == 0 and count_prefix(counts, "STL") == 0
    assert cfg.smem_bytes <= C.SMEM_LIMIT and cfg.tmem_cols <= C.TMEM_COLS


# ============================================================================= SASS shape per KV block
@pytest.mark.parametrize("kw", SERVED, ids=_id)
def test_sass_instruction_mix_per_kv_block(kw):
    """One rolled loop per role over the KV blocks, so the static counts are one block's plus the epilogue's:
    UTCHMMA = head_dim / 16 + 8; LDTM 3 and STTM 1 (as the PTX); LDGSTS as :func:`gathers` and the
    page-table warp's four;
    CREDUX.MAX.F32 16 (each head's block max over a warp); MUFU.EX2 = 16 (P) + 16 (the heads' rescale
    factors) + 2 per group head (its final weight and sink term) + the merge's; UTCBAR 4 (the commits)."""
    cfg, _, _, _ = built(kw)
    counts = sass_counts(kw)
    d, g = cfg.problem.head_dim, cfg.problem.group_size
    assert count_prefix(counts, "UTCHMMA") == d // 16 + C.TILE_KV // 16
    assert count_prefix(counts, "LDTM") == 3 and count_prefix(counts, "STTM") == 1
    assert count_prefix(counts, "LDGSTS") == gathers(cfg) + C.TILE_KV // 32
    assert counts.get("CREDUX.MAX.F32", 0) == C.HEAD_TILE
    assert counts.get("MUFU.EX2", 0) == 2 * C.HEAD_TILE + 2 * g + MERGE_EX2
    assert count_prefix(counts, "UTCBAR") == 4
    assert count_prefix(counts, "HMMA") == 0 and count_prefix(counts, "HGMMA") == 0
    assert count_prefix(counts, "UTMALDG") == 0  # the gathers are cp.async (LDGSTS), not TMA


# ============================================================================= trace-time tile math
@functools.lru_cache(maxsize=None)
def _traced(d):
    """Facts about the tiled MMAs and layouts of a head_dim ``d`` config, gathered while tracing (no GPU)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32
    from cutlass.cute.nvgpu import tcgen05

    from cutedsl_attn.sm100.decode.kernel import make_mmas, operand_addr, swizzle_bits

    cfg = K.Config(problem(d=d), K.default_tiles(problem(d=d), num_sms=148))
    facts = {}

    @cute.jit
    def trace(x: Int32):
        qk, pv, L = make_mmas(cfg)
        qk_thr, pv_thr = qk.get_slice(0), pv.get_slice(0)
        facts["k_steps"] = {k: cute.size(v.outer, mode=[2]) for k, v in L.items()}
        facts["stages"] = {k: cute.size(v.outer, mode=[3]) for k, v in L.items()}
        facts["swizzle"] = {k: swizzle_bits(v) for k, v in L.items()}
        facts["cosize"] = {k: cute.cosize(v) for k, v in L.items()}
        facts["shape"] = {k: str(v.outer.shape) for k, v in L.items()}
        # every operand's address map over one stage: (rows on M / N, cols on K)
        dims = dict(sK=(C.TILE_KV, d), sQ=(C.HEAD_TILE, d), sV=(d, C.TILE_KV), sP=(C.HEAD_TILE, C.TILE_KV))
        facts["addr"] = {k: {(r, c): operand_addr(0, L[k], r, c, 1 if k in ("sK", "sV", "sP") else 0)
                             for r in range(dims[k][0]) for c in range(dims[k][1])} for k in dims}
        for name, thr, mn in (("qk", qk_thr, (C.TILE_KV, C.HEAD_TILE)), ("pv", pv_thr, (d, C.HEAD_TILE))):
            lay = thr.make_fragment_C(thr.partition_shape_C(mn)).layout
            facts[f"{name}_lane"] = {m: cute.crd2idx(((m, 0), 0, 0), lay) >> 16 for m in range(mn[0])}
            facts[f"{name}_col"] = {n: cute.crd2idx(((0, n), 0, 0), lay) & 0xFFFF for n in range(mn[1])}

        # the softmax's 32x32b.x16 TMEM load: thread t's register e is (token t, head e)
        tS = cute.make_tensor(cute.make_ptr(cutlass.Float32, 0, cute.AddressSpace.tmem, assumed_align=16),
                              qk_thr.make_fragment_C(qk_thr.partition_shape_C((C.TILE_KV, C.HEAD_TILE))).layout)
        ld = tcgen05.make_tmem_copy(cute.make_copy_atom(
            tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(C.HEAD_TILE)), cutlass.Float32), tS)
        ident = qk_thr.partition_C(cute.make_identity_tensor((C.TILE_KV, C.HEAD_TILE)))
        facts["ld_regs"] = {}
        for t in (0, 1, 31, 32, 77, 127):
            part = ld.get_slice(t).partition_D(ident)
            facts["ld_regs"][t] = [tuple(part[e]) for e in range(cute.size(part))]

    cute.compile(trace, Int32(0))
    return cfg, facts


@pytest.mark.parametrize("d", (64, 128))
def test_operand_layouts_and_mma_partitions(d):
    cfg, f = _traced(d)
    s = cfg.tiles.kv_stages
    # 16-element K steps: head_dim / 16 for S^T = K Q^T, 128 / 16 for O^T = V^T P^T
    assert f["k_steps"] == {"sK": d // 16, "sQ": d // 16, "sV": C.TILE_KV // 16, "sP": C.TILE_KV // 16}
    assert f["stages"] == {"sK": s, "sQ": 1, "sV": s, "sP": 2}
    # K-major K and Q tiles and the MN-major V tile are 128-byte swizzled; P^T (16 heads = 32 bytes) 32-byte
    assert f["swizzle"] == {"sK": (3, 4, 3), "sQ": (3, 4, 3), "sV": (3, 4, 3), "sP": (1, 4, 3)}
    assert f["cosize"] == {"sK": s * C.TILE_KV * d, "sQ": C.HEAD_TILE * d, "sV": s * C.TILE_KV * d,
                           "sP": 2 * C.TILE_KV * C.HEAD_TILE}


@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("name", ("sK", "sQ", "sV", "sP"))
def test_operand_address_map_is_a_bijection_of_whole_16_byte_pieces(d, name):
    """The addresses the cp.async gathers and the P^T stores write hit every 16-bit slot of the stage exactly once,
    and the 8 elements one 16-byte copy moves (along the operand's contiguous dimension: K for K / Q, M / N for
    V / P^T) are 8 consecutive slots starting on a 16-byte boundary."""
    cfg, f = _traced(d)
    addr = f["addr"][name]
    n = len(addr)
    stage = 1 if name in ("sK", "sV", "sP") else 0
    lo = stage * n * 2
    assert sorted(addr.values()) == list(range(lo, lo + 2 * n, 2))
    k_major = name in ("sK", "sQ")
    for (r, c), a in addr.items():
        if (c if k_major else r) % 8 == 0:
            assert a % 16 == 0
            for e in range(1, 8):
                assert addr[(r, c + e) if k_major else (r + e, c)] == a + 2 * e


@pytest.mark.parametrize("d", (64, 128))
def test_tmem_lanes_of_the_accumulators(d):
    """S^T: token ``m`` in TMEM lane ``m``, head ``n`` in column ``n`` (what the softmax's 32x32b loads assume);
    O^T: row ``d`` in the lane :func:`config.o_lane` names (at head_dim 64 the M=64 accumulator's lanes 0-15 of
    each 32-lane quarter), head ``n`` in column ``n``."""
    _, f = _traced(d)
    assert f["qk_lane"] == {m: m for m in range(C.TILE_KV)}
    assert f["qk_col"] == {n: n for n in range(C.HEAD_TILE)} == f["pv_col"]
    back = {C.o_lane(d, lane): lane for lane in range(128) if C.o_lane(d, lane) is not None}
    assert sorted(back) == list(range(d))
    assert f["pv_lane"] == back
    for t, regs in f["ld_regs"].items():
        assert regs == [(t, h) for h in range(C.HEAD_TILE)], t


def test_tmem_plan_regions_disjoint_aligned_and_within_512():
    for d in (64, 128):
        plan = K.tmem_plan(d)
        assert set(plan) == {"S0", "S1", "O"}
        from cutedsl_attn.common.tcgen05 import tmem_plan_reason

        assert tmem_plan_reason(plan) is None
        spans = sorted((a, a + n) for a, n in plan.values())
        for (a0, e0), (a1, _) in zip(spans, spans[1:]):
            assert e0 <= a1
        assert all(a % 32 == 0 and n == C.HEAD_TILE for a, n in plan.values())
        cfg = K.Config(problem(d=d), K.default_tiles(problem(d=d), num_sms=148))
        assert cfg.tmem == plan and cfg.tmem_cols == 128 and spans[-1][1] <= cfg.tmem_cols <= C.TMEM_COLS


def test_o_lane_mapping():
    assert [C.o_lane(128, lane) for lane in range(128)] == list(range(128))
    got = [C.o_lane(64, lane) for lane in range(128)]
    assert [x for x in got if x is not None] == list(range(64))
    assert all((x is None) == (lane % 32 >= 16) for lane, x in enumerate(got))


def test_roles_cover_the_cta_and_own_the_tmem_lanes():
    r = C.Roles()
    assert sorted((*r.softmax_warps, *r.load_warps, r.mma_warp, r.page_table_warp)) == list(range(r.num_warps))
    assert [w % 4 for w in r.softmax_warps] == [0, 1, 2, 3]  # warp w reaches TMEM lanes 32 (w % 4) ..
    assert r.num_threads == 320 and r.launch_registers == 200


# ============================================================================= shared memory, planning
def test_shared_memory_budget_and_the_planner():
    for d in (64, 128):
        p = problem(d=d)
        cfg = K.Config(p, K.default_tiles(p, num_sms=148))
        assert cfg.smem_bytes <= C.SMEM_LIMIT
        assert occupancy(cfg.smem_bytes, cfg.num_threads) >= 1
        assert cfg.max_splits_per_request >= 128
        import torch

        wp = plan_paged_decode(torch.tensor([5000, 7]), torch.tensor([0, 400]), num_kv_heads=8, page_size=16,
                               num_sms=148, ctas_per_sm=1, max_splits_per_request=cfg.max_splits_per_request)
        assert wp.num_work >= 2
    with pytest.raises(ValueError, match="shared memory"):
        K.Config(problem(d=128), K.Tiles(kv_stages=4))
    for d in (64, 128):  # an fp8 cache's stages also hold the rows as loaded: one stage fewer than 16-bit
        p8 = problem(d=d, kv="float8_e4m3fn")
        t8 = K.default_tiles(p8, num_sms=148)
        assert t8.kv_stages == K.default_tiles(problem(d=d), num_sms=148).kv_stages - 1
        assert K.Config(p8, t8).smem_bytes <= C.SMEM_LIMIT
        with pytest.raises(ValueError, match="shared memory"):
            K.Config(p8, K.Tiles(kv_stages=t8.kv_stages + 2))
    assert K.Config(problem(d=64), K.Tiles(kv_stages=6)).smem_bytes <= C.SMEM_LIMIT


# ============================================================================= contract
def test_contract_surface():
    assert K.NAME == "paged_decode_sm100"
    for name in ("Tiles", "Config", "unsupported_reason", "default_tiles", "override_tiles", "compile", "launch"):
        assert callable(getattr(K, name))
    assert K.TUNING_FIELDS == ("kv_stages",)
    t = K.default_tiles(problem(), num_sms=148)
    assert dataclasses.is_dataclass(t) and t.__dataclass_params__.frozen
    assert K.override_tiles(t, {"kv_stages": "2"}) == K.Tiles(kv_stages=2)
    with pytest.raises(ValueError):
        K.override_tiles(t, {"num_warps": "4"})
    cfg = K.Config(problem(), t)
    assert cfg.positive_scale_only is False and cfg.num_threads == 320


def test_config_rejects_bad_tiles_and_types():
    with pytest.raises(ValueError, match="kv_stages"):
        K.Config(problem(), K.Tiles(kv_stages=1))
    with pytest.raises(ValueError, match="kv_stages"):
        K.Config(problem(), K.Tiles(kv_stages=7))
    with pytest.raises(ValueError, match="int"):
        K.Config(problem(), K.Tiles(kv_stages=True))
    with pytest.raises(TypeError):
        K.Config(problem(), object())
    from cutedsl_attn.portable import paged_decode

    with pytest.raises(TypeError):
        K.Config(problem(), paged_decode.Tiles())
    with pytest.raises(ValueError, match="sm_100a"):
        K.Config(problem(arch="sm_90a"), K.Tiles())


def test_launch_passes_the_portable_argument_order():
    seen = []
    args = DecodeArgs(q="q", k="k", v="v", indices="idx", work="work", out="o", lse="lse", part_o="po",
                      part_lse="plse", counters="cnt", sinks="sinks", alibi_slopes="alibi", sm_scale=0.5,
                      soft_cap=0.0, rope_rcp_scale=1.0, rope_log2_theta=13.0, output_scale=0.25)
    K.launch(lambda *a: seen.append(a), K.Config(problem(), K.Tiles()), args)
    assert seen == [("q", "k", "v", "idx", "work", "o", "lse", "po", "plse", "cnt", "sinks", "alibi", 0.5, 0.0, 1.0,
                     13.0, 0.25)]


def test_served_problems_have_no_reason():
    for a in ARCHS:
        for d in (64, 128):
            for ps in (1, 3, 16, 64, 128):
                for g in (1, 2, 4, 8, 16):
                    for dt in ("bfloat16", "float16"):
                        p = problem(arch=a, d=d, ps=ps, g=g, dtype=dt, sinks=g == 8)
                        assert K.unsupported_reason(p) is None
    assert K.unsupported_reason(problem(dtype="bfloat16", kv="bfloat16")) is None  # a 16-bit cache spelled out
    for dt in ("bfloat16", "float16"):
        assert K.unsupported_reason(problem(dtype=dt, kv="float8_e4m3fn")) is None


REFUSED = [
    (dict(arch="sm_90a"), "sm_100a"),
    (dict(d=32), "head_dim"),
    (dict(d=256), "head_dim"),
    (dict(use_soft_cap=True), "soft cap"),
    (dict(pos_encoding_mode="ROPE_LLAMA"), "positional"),
    (dict(pos_encoding_mode="ALIBI"), "positional"),
]


@pytest.mark.parametrize("kw,needle", REFUSED, ids=[f"{n}-{i}" for i, (_, n) in enumerate(REFUSED)])
def test_unsupported_reason_names_each_refused_feature(kw, needle):
    reason = K.unsupported_reason(problem(**kw))
    assert reason is not None and needle in reason
    with pytest.raises(ValueError, match="SM100 decode"):
        K.Config(problem(**kw), K.Tiles())


def test_unsupported_reason_type_error():
    with pytest.raises(TypeError):
        K.unsupported_reason(object())


@pytest.mark.parametrize("kv_dtype,stages", [("float8_e4m3fn", 2), ("", 2), ("", 3)])
def test_two_stage_ring_publishes_before_it_acquires(kv_dtype, stages):
    """With two K/V stages block i reuses block i-2's stage, which the MMA warp frees only after consuming block
    i-1: the loader must publish block i-1 (wait_group 0) before acquiring block i's stage, or both sides wait on
    each other once an item has three blocks.  Three or more stages keep one block in flight (wait_group 1)."""
    from cutedsl_attn.planning.decode import DecodeProblem
    from cutedsl_attn.sm100 import decode as K

    p = DecodeProblem(dtype="bfloat16", head_dim=128, page_size=16, group_size=4, kv_dtype=kv_dtype, arch="sm_100a")
    ptx = build(K.compile, K.Config(p, K.Tiles(kv_stages=stages))).ptx
    if stages == 2:
        assert ptx.count("cp.async.wait_group 1") == 0 and ptx.count("cp.async.wait_group 0") == 2
    else:
        assert ptx.count("cp.async.wait_group 1") == 1 and ptx.count("cp.async.wait_group 0") == 1
