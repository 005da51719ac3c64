"""CPU checks of the SM100 / SM103 tcgen05 prefill kernel (``cutedsl_attn.sm100.prefill``), which no GPU here runs.

* every served configuration cross-compiles for ``sm_100a`` and ``sm_103a`` (trace, verifier, TMA and shared
  memory errors fail here);
* the PTX is the design's: tcgen05.mma / ld / st / alloc / dealloc, TMA (``cp.async.bulk.tensor``), mbarriers;
  no wgmma, no mma.sync;
* resource gate on the cubin: no stack (spills), the three ``setmaxnreg`` budgets honoured by ptxas
  (``USETMAXREG`` in the SASS, their sum within the register file);
* SASS shape per KV block: UTCHMMA, MUFU.EX2, LDTM, STTM counts as the design says;
* the output path: the correction warpgroup stages the normalised O tile in shared memory (16-byte
  ``st.shared``, the 128-byte swizzle that the TMA store box reads), the epilogue warp stores it with
  ``cp.async.bulk.tensor`` shared -> global (one box per staging buffer) or, for a tile running past its request,
  16-byte stores of the live rows; the staging layout is the swizzle the correction warpgroup writes, element for
  element; with no room for a buffer the correction warpgroup stores O itself;
* paged K/V: one TMA box per page (``cp.async.bulk.tensor.4d`` over the page tensor, a page-id load each), into a
  (token, dim) view of the rings that is element for element the MMA operands' layout;
* the softmax-side features (sliding window, soft cap, custom mask, ``score_mod``) compile for both archs and are in
  the code: one ``tanh`` per score, the window's lower bound compare per score, the packed mask's byte loads per
  row and block, the traced ``score_mod``'s constant; spill-free within the same register budgets;
* the TMEM column plan (no overlap, within 512 columns), the shared-memory plan (the model is the kernel's struct:
  its build refuses a mismatch), the warp roles, the kernel contract, and every refused feature.

A matrix entry builds with the package's default tiles (the persistent grid without causal or a window), its
Q tiles and tile_n as the entry says; ``num_ctas`` in an entry overrides the grid.
"""

import dataclasses
import functools
import re

import pytest
from _builds import build, sass  # (tests/ is on sys.path)

from cutedsl_attn.planning.prefill import PrefillArgs, PrefillProblem
from cutedsl_attn.sm100 import prefill as K
from cutedsl_attn.sm100.prefill import config as C
from cutedsl_attn.common.smem import sw128_offset

ARCHS = ("sm_100a", "sm_103a")


def problem(arch="sm_100a", d=128, causal=False, g=4, dtype="bfloat16", sinks=False, q=None, dv=None, tn=None,
            **kw):
    """The PrefillProblem of a matrix entry (``q`` / ``tn`` / ``num_ctas`` / ``st``: its Q tiles, tile_n, grid and
    K/V stages, read by :func:`_build`; ``dv``: head_dim_vo where it differs from ``d``)."""
    kw.pop("num_ctas", None)
    kw.pop("st", None)
    return PrefillProblem(dtype=dtype, head_dim_qk=d, head_dim_vo=d if dv is None else dv, group_size=g,
                          causal=causal, use_sinks=sinks, arch=arch, **kw)


# the served matrix: both archs x head dims x causal, with the dtypes, group sizes and sinks spread over it, for
# one Q tile per CTA (the default) and two (two softmax warpgroups)
SERVED = [
    dict(arch=a, d=d, causal=c, g=g, dtype=dt, sinks=s, q=1)
    for a in ARCHS for d in (64, 128) for c in (False, True)
    for (g, dt, s) in (((4, "bfloat16", False), (1, "float16", True)) if d == 128 else ((8, "bfloat16", True),))
] + [
    dict(arch=a, d=d, causal=c, g=g, dtype=dt, sinks=s, q=2)
    for a in ARCHS for d in (64, 128) for c in (False, True)
    for (g, dt, s) in (((4, "bfloat16", False),) if c or d == 64 else ((4, "bfloat16", False), (1, "float16", True)))
]


def rel_bias(score, batch_idx, head_idx, q_idx, kv_idx):
    """A score_mod of Python arithmetic (traced with the DSL's scalars); 0.004 is the constant the PTX shows."""
    return score - 0.004 * (q_idx - kv_idx) + 0.25 * head_idx


REL_BIAS_CONST = "0f3B83126F"  # 0.004 as a PTX fp32 immediate

# the softmax-side features over both archs, both head dims and one / two Q tiles (each with the matrix's base
# fields), and their combinations
FEATURES = [
    dict(arch=a, d=d, causal=c, g=g, dtype=dt, sinks=s, q=q, **f)
    for (a, d, c, g, dt, s, q, f) in (
        ("sm_100a", 128, True, 4, "bfloat16", False, 1, dict(use_window=True)),
        ("sm_103a", 64, False, 8, "bfloat16", True, 2, dict(use_window=True)),
        ("sm_100a", 128, True, 4, "bfloat16", False, 2, dict(use_soft_cap=True)),
        ("sm_103a", 64, False, 1, "float16", True, 1, dict(use_soft_cap=True)),
        ("sm_100a", 128, False, 4, "bfloat16", False, 1, dict(use_custom_mask=True)),
        ("sm_103a", 128, True, 2, "float16", False, 2, dict(use_custom_mask=True)),
        ("sm_100a", 64, True, 4, "bfloat16", False, 1, dict(score_mod=rel_bias)),
        ("sm_103a", 128, True, 4, "bfloat16", True, 2, dict(score_mod=rel_bias)),
        ("sm_100a", 128, True, 4, "bfloat16", True, 1, dict(use_window=True, use_soft_cap=True)),
        ("sm_103a", 128, False, 4, "bfloat16", False, 1, dict(use_window=True, use_custom_mask=True,
                                                              use_soft_cap=True)),
        ("sm_100a", 64, True, 8, "float16", False, 2, dict(use_window=True, score_mod=rel_bias)),
    )
]
# paged K/V: pages smaller than, equal to and larger than the block, both archs, one / two Q tiles, 192/128,
# with the softmax-side features
PAGED = [
    dict(arch="sm_100a", d=128, causal=True, g=4, dtype="bfloat16", sinks=False, q=1, page_size=16),
    dict(arch="sm_103a", d=128, causal=False, g=1, dtype="float16", sinks=True, q=1, page_size=128),
    dict(arch="sm_100a", d=64, causal=True, g=8, dtype="bfloat16", sinks=False, q=2, page_size=256),
    dict(arch="sm_103a", d=64, causal=False, g=4, dtype="bfloat16", sinks=False, q=1, page_size=32),
    dict(arch="sm_100a", d=192, dv=128, causal=True, g=1, dtype="bfloat16", sinks=False, q=1, page_size=64),
    dict(arch="sm_100a", d=128, causal=True, g=4, dtype="bfloat16", sinks=True, q=2, page_size=16, use_window=True,
         use_soft_cap=True),
    dict(arch="sm_103a", d=128, causal=False, g=4, dtype="bfloat16", sinks=False, q=1, page_size=64,
         use_custom_mask=True),
]
# pages no whole TMA box fits (page_rows 0): the cp.async gather
GATHERED = [
    dict(arch="sm_100a", d=128, causal=True, g=4, dtype="bfloat16", sinks=False, q=1, page_size=1),
    dict(arch="sm_103a", d=64, causal=False, g=8, dtype="float16", sinks=True, q=2, page_size=8),
    dict(arch="sm_100a", d=192, dv=128, causal=True, g=1, dtype="bfloat16", sinks=False, q=1, page_size=48,
         use_window=True),
    dict(arch="sm_103a", d=128, causal=True, g=4, dtype="bfloat16", sinks=False, q=2, page_size=1, use_soft_cap=True),
]
_FEATURE_NAMES = ("use_window", "use_soft_cap", "use_custom_mask", "score_mod")


# head_dim 256 (one Q tile, 64-token blocks) and 192/128 (one Q tile; also with 64-token blocks)
HEAD_DIMS = [
    dict(arch="sm_100a", d=256, causal=True, g=4, dtype="bfloat16", sinks=False, q=1),
    dict(arch="sm_103a", d=256, causal=False, g=1, dtype="float16", sinks=True, q=1),
    dict(arch="sm_100a", d=192, dv=128, causal=True, g=1, dtype="bfloat16", sinks=False, q=1),
    dict(arch="sm_103a", d=192, dv=128, causal=False, g=4, dtype="bfloat16", sinks=True, q=1),
    dict(arch="sm_100a", d=192, dv=128, causal=True, g=4, dtype="bfloat16", sinks=False, q=1, tn=64),
]
FEATURES += [
    dict(arch="sm_100a", d=256, causal=True, g=4, dtype="bfloat16", sinks=True, q=1, use_window=True,
         use_soft_cap=True),
    dict(arch="sm_103a", d=192, dv=128, causal=True, g=1, dtype="float16", sinks=False, q=1, use_custom_mask=True),
]


def _id(kw):
    feats = "".join(f"-{n.replace('use_', '')}" for n in _FEATURE_NAMES if kw.get(n))
    dims = f"d{kw['d']}" + (f"_{kw['dv']}" if kw.get("dv") else "")
    return f"{kw['arch']}-{dims}-{'causal' if kw['causal'] else 'full'}-g{kw['g']}-{kw['dtype']}" + (
        "-sinks" if kw["sinks"] else "") + f"-q{kw['q']}" + (f"-n{kw['tn']}" if kw.get("tn") else "") + (
        f"-p{kw['page_size']}" if kw.get("page_size") else "") + feats + (
        f"-ctas{kw['num_ctas']}" if "num_ctas" in kw else "") + (f"-s{kw['st']}" if "st" in kw else "")


NUM_SMS = 148  # the default_tiles' SM count (a B200's)


def tiles_for(p, q, tn=None, num_ctas=None):
    t = dataclasses.replace(K.default_tiles(p, num_sms=NUM_SMS), q_tiles=q)
    t = t if tn is None else dataclasses.replace(t, tile_n=tn)
    return t if num_ctas is None else dataclasses.replace(t, num_ctas=num_ctas)


@functools.lru_cache(maxsize=None)
def _config(key):
    """The Config of one matrix entry (``key``: its sorted items)."""
    kw = dict(key)
    p = problem(**kw)
    t = tiles_for(p, kw["q"], kw.get("tn"), kw.get("num_ctas"))
    return K.Config(p, t if "st" not in kw else dataclasses.replace(t, kv_stages=kw["st"]))


def _build(key):
    """(cfg, ptx text, cubin bytes, dump dir) of one served configuration: one compile per Config in the session
    (:func:`_builds.build`: entries that name the same Config, e.g. a feature's base problem with its default
    ``num_ctas`` spelled out, and other files' builds share it)."""
    cfg = _config(key)
    b = build(K.compile, cfg)
    return cfg, b.ptx, b.cubin, b.dump_dir


def built(kw):
    return _build(tuple(sorted(kw.items())))


def _sass(key):
    return sass(K.compile, _config(key))


def sass_counts(kw):
    """Opcode (mnemonic up to its first ``.``-suffix kept whole) -> count in the kernel's SASS."""
    text = _sass(tuple(sorted(kw.items())))
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text)
    counts = {}
    for op in ops:
        counts[op] = counts.get(op, 0) + 1
    return counts, text


def count_prefix(counts, prefix):
    return sum(n for op, n in counts.items() if op == prefix or op.startswith(prefix + "."))


# ============================================================================= compile + PTX mix
@pytest.mark.parametrize("kw", SERVED + HEAD_DIMS + FEATURES + PAGED + GATHERED, ids=_id)
def test_compiles_with_the_tcgen05_instruction_mix(kw):
    cfg, ptx, _, _ = built(kw)
    assert f".target {kw['arch']}" in ptx
    for needed in ("tcgen05.mma", "tcgen05.ld", "tcgen05.st", "tcgen05.alloc", "tcgen05.dealloc",
                   "tcgen05.commit", "cp.async.bulk.tensor", "mbarrier", "setmaxnreg"):
        assert needed in ptx, f"{needed} missing from the PTX"
    for banned in ("wgmma", "mma.sync"):
        assert banned not in ptx, f"{banned} in an SM100 kernel"
    # one tcgen05.mma per 16-wide K step: Q K^T over head_dim_qk, P V over tile_n, per Q tile
    assert ptx.count("tcgen05.mma") == cfg.tiles.q_tiles * (cfg.problem.head_dim_qk // 16 + cfg.tiles.tile_n // 16)
    # P is read from TMEM by the P V GEMM (the A operand in brackets, not a shared-memory descriptor)
    assert re.search(r"tcgen05\.mma\.cta_group::1\.kind::f16\S* \[%r\d+\], \[%r\d+\]", ptx)


# head_dim 128 with three 128-token K/V stages leaves no room for a staging buffer: the correction warpgroup
# stores O itself (one CTA per tile and persistent)
UNSTAGED = [
    dict(arch="sm_100a", d=128, causal=True, g=4, dtype="bfloat16", sinks=True, q=1, st=3),
    dict(arch="sm_103a", d=128, causal=False, g=4, dtype="bfloat16", sinks=False, q=1, st=3),
]
_ZERO_V4 = re.compile(r"st\.shared\.v4\.b32 \[[^\]]+\], \{0, 0, 0, 0\}")  # (the V tail / gather zero fill)


@pytest.mark.parametrize("kw", SERVED + HEAD_DIMS + FEATURES + PAGED + GATHERED + UNSTAGED, ids=_id)
def test_o_leaves_through_the_epilogue_warp(kw):
    """Each correction thread writes its row of every Q tile into the staging buffers (``head_dim_vo / 8``
    16-byte ``st.shared``, fenced for the async proxy once per buffer); the epilogue warp stores each buffer as
    one TMA box (``cp.async.bulk.tensor`` shared::cta -> global, waited for its reads before the buffer is
    handed back) or, for a tile past its request's end, copies the live rows with 16-byte loads and stores (a
    loop over 4-row groups unrolled by 4), and stores the LSE (one 4-byte store per lane and 32 rows).  Without
    staging buffers: the correction warpgroup's ``head_dim_vo / 8`` 16-byte global stores and one LSE store."""
    cfg, ptx, _, _ = built(kw)
    q, nc, dv = cfg.tiles.q_tiles, cfg.problem.head_dim_vo // C.EPI_COLS, cfg.problem.head_dim_vo
    bulk_stores = len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx))
    staged = len(re.findall(r"st\.shared\.v4\.b32", ptx)) - len(_ZERO_V4.findall(ptx))
    read_waits = len(re.findall(r"cp\.async\.bulk\.wait_group\.read\s+0;", ptx))
    g_stores, lse_stores = ptx.count("st.global.v4.b32"), ptx.count("st.global.b32")
    if cfg.epi_stages == 0:
        assert kw.get("st") == 3 and cfg.problem.head_dim_vo == 128
        assert (bulk_stores, staged, read_waits, g_stores, lse_stores) == (0, 0, 0, q * dv // 8, q)
        return
    assert bulk_stores == read_waits == q * nc
    assert staged == q * dv // 8
    assert ptx.count("fence.proxy.async.shared::cta") >= q * nc + 1  # (+ the V tail's zeroed rows)
    assert ptx.count("ld.shared.v4.b32") == g_stores == q * nc * 4
    assert lse_stores == q * C.TILE_M // 32


@pytest.mark.parametrize("kw", [SERVED[0], SERVED[-1], HEAD_DIMS[0], UNSTAGED[0]], ids=_id)
def test_sass_tma_store_per_staging_buffer(kw):
    """In the SASS: one UTMASTG per Q tile and ``EPI_COLS`` columns (none without staging buffers), the
    correction warpgroup's STS.128 into the buffers, the epilogue warp's STG.E.128 for the ragged tiles."""
    cfg, _, _, _ = built(kw)
    counts, _ = sass_counts(kw)
    q, nc = cfg.tiles.q_tiles, cfg.problem.head_dim_vo // C.EPI_COLS
    assert count_prefix(counts, "UTMASTG") == (q * nc if cfg.epi_stages else 0)
    assert count_prefix(counts, "STG.E.128") > 0
    if cfg.epi_stages:
        assert count_prefix(counts, "STS.128") >= q * cfg.problem.head_dim_vo // 8


def _staging_layout_agrees(stages):
    """Whether the staging buffers' layout (what the TMA store box reads) puts 16-byte chunk ``c`` of row ``r``
    of buffer ``s`` where the correction warpgroup writes it: :func:`sw128_offset` plus ``s`` buffers."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass.tensor_utils import LayoutEnum

    bad = []

    @cute.jit
    def check_staging():  # (a name of its own: the DSL finds a nested function's source by its name)
        sO = sm100_utils.make_smem_layout_epi(cutlass.BFloat16, LayoutEnum.ROW_MAJOR, (C.TILE_M, C.EPI_COLS),
                                              stages)
        bad.append(str(sO.inner))
        for st in cutlass.range_constexpr(stages):
            for r in cutlass.range_constexpr(C.TILE_M):
                for c in cutlass.range_constexpr(C.EPI_COLS // 8):
                    x = 2 * cute.crd2idx((r, 8 * c, st), sO.outer)  # unswizzled byte offset, then S<3,4,3>
                    want = sw128_offset(r, c, C.TILE_M) + st * C.TILE_M * C.EPI_COLS * 2
                    if cutlass.const_expr(x ^ ((x >> 3) & 0x70) != want):
                        bad.append((st, r, c, x, want))

    check_staging()
    swizzle = bad.pop(0)
    return bad + ([] if swizzle == "S<3,4,3>" else [swizzle])


def test_staging_buffers_are_the_layout_the_correction_warps_write():
    assert _staging_layout_agrees(2) == []


def test_staging_buffers_in_the_shared_memory_plan():
    """Two 16 KiB buffers where they fit beside Q and the K/V rings, else one, else none (head_dim 128 with three
    128-token stages, the correction warpgroup storing O itself); each buffer adds its two mbarriers and its
    rows' LSE to the head; the model is the kernel's struct (its build raises on a mismatch)."""
    want = {(64, 64, 128, 3, 1): 2, (64, 64, 128, 3, 2): 2, (128, 128, 128, 2, 1): 2, (128, 128, 128, 2, 2): 1,
            (128, 128, 128, 3, 1): 0, (128, 128, 64, 3, 1): 2, (192, 128, 128, 2, 1): 1, (256, 256, 64, 2, 1): 2}
    for (dq, dv, tn, st, q), n in want.items():
        cfg = K.Config(problem(d=dq, dv=dv), K.Tiles(tile_n=tn, kv_stages=st, q_tiles=q))
        assert cfg.epi_stages == n, (dq, dv, tn, st, q)
        assert cfg.smem_bytes == cfg._smem(n) <= C.SMEM_LIMIT
        if n < 2:
            assert cfg._smem(n + 1) > C.SMEM_LIMIT
        if n:
            assert cfg._smem(n) - cfg._smem(n - 1) >= C.TILE_M * C.EPI_COLS * 2
    for kw in SERVED + HEAD_DIMS + PAGED:  # every default build stages its O
        p = problem(**kw)
        assert K.Config(p, tiles_for(p, kw["q"], kw.get("tn"))).epi_stages > 0, _id(kw)


# ============================================================================= resource gate
@pytest.mark.parametrize("kw", SERVED + HEAD_DIMS + FEATURES + PAGED + GATHERED + UNSTAGED, ids=_id)
def test_resources_no_spills_and_register_budgets(kw):
    from cutedsl_attn.inspect import cubin_resources

    cfg, ptx, cubin, _ = built(kw)
    roles = cfg.roles
    res = cubin_resources(cubin)
    assert res["stack_bytes"] == 0, f"stack frame {res['stack_bytes']} B: spills or a local array"
    assert res["registers"] * roles.num_threads <= C.REGISTER_FILE
    # ptxas drops setmaxnreg (with only an info line) when it cannot tell the entry register count: the kernel
    # must carry .minnctapersm, and the SASS must hold one USETMAXREG per warp role with the planned budget
    assert ".minnctapersm 1" in ptx
    counts, text = sass_counts(kw)
    got = sorted(int(x, 16) for x in re.findall(r"USETMAXREG\.\S+\s+(?:UP\d+,\s*)?(0x[0-9a-f]+)", text))
    assert got == sorted(roles.registers.values()), f"setmaxnreg values in SASS {got} != plan {roles.registers}"
    # setmaxnreg moves registers within the CTA's launch pool (ptxas's count x threads): the warpgroups' budgets
    # (softmax per Q tile, correction, the MMA / load / epilogue warps') must fit it
    regs = roles.registers
    assert 128 * (cfg.tiles.q_tiles * regs["softmax"] + regs["correction"] + regs["other"]) <= (
        res["registers"] * roles.num_threads)
    assert count_prefix(counts, "LDL") == 0 and count_prefix(counts, "STL") == 0


@pytest.mark.parametrize("q", (1, 2))
def test_register_plan_fits_the_register_file(q):
    r = C.Roles(q)
    regs = r.registers
    assert (q * regs["softmax"] + regs["correction"] + regs["other"]) * 128 <= C.REGISTER_FILE
    launch = (C.REGISTER_FILE // r.num_threads) // 8 * 8  # what ptxas can give every thread at launch
    assert regs["softmax"] > launch > regs["correction"] > regs["other"]
    for v in regs.values():
        assert v % 8 == 0 and 24 <= v <= 256
    assert len(r.softmax_warps) == 4 * q and len(r.correction_warps) == 4
    assert sorted((*r.softmax_warps, *r.correction_warps, r.mma_warp, r.load_warp, r.epilogue_warp,
                   *r.idle_warps)) == list(range(r.num_warps))
    # setmaxnreg is per warpgroup: the MMA, load and epilogue warps share the "other" budget
    assert r.num_warps % 4 == 0 and r.mma_warp // 4 == r.load_warp // 4 == r.epilogue_warp // 4
    assert r.num_warps == 4 * q + 8 and len(r.idle_warps) == 1
    # TMEM lane access: warp w reaches lanes 32 (w % 4) ..; softmax and correction warp k own the same rows
    assert [w % 4 for w in r.softmax_warps] == [0, 1, 2, 3] * q
    assert [w % 4 for w in r.correction_warps] == [0, 1, 2, 3]


# ============================================================================= SASS shape per KV block
@pytest.mark.parametrize("kw", [k for k in SERVED + HEAD_DIMS if not k["sinks"]], ids=_id)
def test_sass_instruction_mix_per_kv_block(kw):
    """The kernel has one rolled loop per role over the KV blocks (each Q tile's softmax and its rescale and
    epilogue code are traced once per tile), so the static counts are one block's plus the epilogue's, per Q
    tile: UTCHMMA = head_dim / 16 (S) + tile_n / 16 (P V); MUFU.EX2 = tile_n (P) + 1 (O's factor) + 2 (the LSE's
    sum and max terms); LDTM = S in x32 loads + O twice (rescale, epilogue) in loads of 32 (one Q tile) or 16
    columns; STTM = P in x16 stores (32 columns of 16-bit values each) + O once (rescale)."""
    cfg, _, _, _ = built(kw)
    counts, _ = sass_counts(kw)
    d, tn, q = cfg.problem.head_dim_vo, cfg.tiles.tile_n, cfg.tiles.q_tiles
    ch = 32 if q == 1 else 16
    assert count_prefix(counts, "UTCHMMA") == q * (cfg.problem.head_dim_qk // 16 + tn // 16)
    assert counts.get("MUFU.EX2", 0) == q * (tn + 3)
    assert count_prefix(counts, "LDTM") == q * (tn // 32 + 2 * (d // ch))
    assert count_prefix(counts, "STTM") == q * (tn // 32 + d // ch)
    assert count_prefix(counts, "HMMA") == 0 and count_prefix(counts, "HGMMA") == 0
    assert count_prefix(counts, "UTMALDG") > 0
    assert count_prefix(counts, "UTCBAR") > 0  # tcgen05.commit: MMA completion onto mbarriers


def _base(kw):
    """``kw`` without its softmax-side features (the same problem and grid otherwise: a window's default grid is
    one CTA per tile)."""
    return {**{k: v for k, v in kw.items() if k not in _FEATURE_NAMES}, "num_ctas": built(kw)[0].tiles.num_ctas}


def _setp_count(ptx):
    return len(re.findall(r"^\s*setp\.", ptx, flags=re.M))


@pytest.mark.parametrize("kw", FEATURES, ids=_id)
def test_features_are_in_the_code(kw):
    """Against the same problem without the features: a soft cap is one ``tanh.approx`` per score of each Q tile
    (none without); the window is at least one more compare per score (its lower bound) and its block range;
    a custom mask is ``tile_n / 8 + 1`` byte loads of the packed bits per row and block (none without); the
    ``score_mod`` is traced in (its constant in the PTX); the exponentials stay one per score."""
    cfg, ptx, _, _ = built(kw)
    _, base, _, _ = built(_base(kw))
    tn, q = cfg.tiles.tile_n, cfg.tiles.q_tiles
    assert ptx.count("tanh.approx.f32") == (q * tn if kw.get("use_soft_cap") else 0)
    assert base.count("tanh.approx") == 0
    bytes_loaded = len(re.findall(r"ld\.global\S*\.[bu]8\b", ptx))
    assert bytes_loaded == (q * (tn // 8 + 1) if kw.get("use_custom_mask") else 0)
    if kw.get("use_window"):
        assert _setp_count(ptx) >= _setp_count(base) + q * tn
    assert (REL_BIAS_CONST in ptx) == bool(kw.get("score_mod")) and REL_BIAS_CONST not in base
    assert ptx.count("ex2.approx") == base.count("ex2.approx")


@pytest.mark.parametrize("kw", [k for k in FEATURES if k.get("use_soft_cap")], ids=_id)
def test_sass_soft_cap_is_one_mufu_tanh_per_score(kw):
    cfg, _, _, _ = built(kw)
    counts, _ = sass_counts(kw)
    q, tn = cfg.tiles.q_tiles, cfg.tiles.tile_n
    assert counts.get("MUFU.TANH", 0) == q * tn
    assert counts.get("MUFU.EX2", 0) == sass_counts(_base(kw))[0].get("MUFU.EX2", 0)


@pytest.mark.parametrize("kw", PAGED, ids=_id)
def test_paged_kv_loads_one_tma_box_per_page(kw):
    """Against the same problem on ragged K/V: each K / V load becomes a loop of ``tile_n / page_rows`` boxes
    (one per page, its id read from the page table) over the 4-D page tensor; the MMA and the softmax are
    untouched."""
    cfg, ptx, _, _ = built(kw)
    _, base, _, _ = built({k: v for k, v in kw.items() if k != "page_size"})
    tn, r = cfg.tiles.tile_n, cfg.page_rows
    assert r == min(kw["page_size"], tn) and r % 8 == 0
    # the page loop is rolled: per load site (K, the V tail, V) one box per 64-column atom, as on ragged K/V, and
    # one page-id load from the page table
    boxes = len(re.findall(r"cp\.async\.bulk\.tensor", ptx))
    assert boxes == len(re.findall(r"cp\.async\.bulk\.tensor", base))
    assert "cp.async.bulk.tensor.4d" in ptx  # (row in page, dim, kv head, page)
    assert len(re.findall(r"ld\.global\.b32", ptx)) == len(re.findall(r"ld\.global\.b32", base)) + 3
    assert ptx.count("tcgen05.mma") == base.count("tcgen05.mma")
    assert ptx.count("ex2.approx") == base.count("ex2.approx")


@pytest.mark.parametrize("kw", GATHERED, ids=_id)
def test_small_pages_are_gathered_with_cp_async(kw):
    """Pages that no whole TMA box fits: K and V are gathered by the load warp (16-byte ``cp.async``, zero-filled past
    the request: one rolled loop per operand), waited for and fenced for the MMA's async proxy; the
    only TMA left is Q's; the MMA and the softmax are untouched."""
    cfg, ptx, _, _ = built(kw)
    _, base, _, _ = built({k: v for k, v in kw.items() if k != "page_size"})
    dq, dv = cfg.problem.head_dim_qk, cfg.problem.head_dim_vo
    assert cfg.page_rows == 0
    assert len(re.findall(r"cp\.async\.cg\.shared\.global", ptx)) == 2  # (a rolled loop per operand)
    assert ptx.count("cp.async.wait_group") == 2 and ptx.count("fence.proxy.async.shared::cta") >= 2
    boxes = len(re.findall(r"cp\.async\.bulk\.tensor", ptx))
    assert boxes == len(re.findall(r"cp\.async\.bulk\.tensor", base)) - (dq // 64 + 2 * dv // 64)
    assert ptx.count("tcgen05.mma") == base.count("tcgen05.mma")
    assert ptx.count("ex2.approx") == base.count("ex2.approx")


def _ring_layouts_agree(tn, d, stages):
    """Whether the K ring (the Q K^T MMA's K-major B operand) and the V ring (the P V MMA's MN-major B operand)
    put every (token, dim, stage) element where the (token, dim) view the page boxes land in puts it."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import Float32
    from cutlass.cute.nvgpu import tcgen05
    from cutlass.tensor_utils import LayoutEnum

    dt = cutlass.BFloat16
    k_major, mn_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
    one = tcgen05.CtaGroup.ONE
    bad = []

    @cute.jit
    def check():
        qk = sm100_utils.make_trivial_tiled_mma(dt, dt, k_major, k_major, Float32, one, (128, tn))
        pv = sm100_utils.make_trivial_tiled_mma(dt, dt, k_major, mn_major, Float32, one, (128, d),
                                                tcgen05.OperandSource.TMEM)
        sK = sm100_utils.make_smem_layout_b(qk, (128, tn, d), dt, stages)
        sV = sm100_utils.make_smem_layout_b(pv, (128, d, tn), dt, stages)
        rows = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (128, tn, d), dt, stages)
        # (trace-time Python: constexpr loops and branches, so the DSL does not turn them into device control flow)
        bad.append(("swizzle", str(sK.inner), str(sV.inner), str(rows.inner)))
        for st in cutlass.range_constexpr(stages):
            for r in cutlass.range_constexpr(tn):
                for c in cutlass.range_constexpr(0, d + 7, 8):
                    c = cutlass.const_expr(min(c, d - 1))  # each 16-byte chunk's first element, and the last one
                    want = cute.crd2idx((r, c, st), rows.outer)
                    # MMA coordinates: K ((token, dim % 16), 0, dim // 16); V ((dim, token % 16), 0, token // 16)
                    k = cute.crd2idx((r + tn * (c % 16), 0, c // 16, st), sK.outer)
                    v = cute.crd2idx((c + d * (r % 16), 0, r // 16, st), sV.outer)
                    # the gather's byte offset of the chunk: the 128-byte swizzle (S<3,4,3> on byte addresses)
                    # of the unswizzled offset
                    x = 2 * cute.crd2idx((r, c // 8 * 8, 0), rows.outer)
                    g = sw128_offset(r, c // 8, tn)
                    if cutlass.const_expr(k != want or v != want or g != x ^ ((x >> 3) & 0x70)):
                        bad.append((st, r, c, k, v, want, g, x))

    check()
    swizzles = bad.pop(0)
    return bad + ([] if len(set(swizzles[1:])) == 1 else [swizzles])


@pytest.mark.parametrize("tn,d", ((128, 64), (128, 128), (64, 128), (128, 192), (64, 192)))
def test_page_boxes_land_where_the_mma_reads(tn, d):
    """The paged loads write K and V through a (token, dim, stage) view of the rings (``_rows_view``; the gather
    through :func:`cutedsl_attn.common.smem.sw128_offset`, its swizzled byte offsets); it must be the MMA operands' own layout,
    element for element (192 stands for the K ring of 192/128)."""
    assert _ring_layouts_agree(tn, d, 2) == []


def test_positive_scale_only_without_soft_cap_or_score_mod():
    assert K.Config(problem(), K.Tiles()).positive_scale_only
    assert K.Config(problem(use_window=True, use_custom_mask=True), K.Tiles()).positive_scale_only
    assert not K.Config(problem(use_soft_cap=True), K.Tiles()).positive_scale_only
    assert not K.Config(problem(score_mod=rel_bias), K.Tiles()).positive_scale_only


def test_exact_rescaling_builds_the_same_mix():
    """rescale_threshold=0 (the exact running max) compiles to the same tcgen05 / MUFU mix, spill-free."""
    from cutedsl_attn.inspect import cubin_resources

    p = problem(arch="sm_100a", d=128, causal=True)
    b = build(K.compile, K.Config(p, K.Tiles(rescale_threshold=0)))
    assert b.ptx.count("tcgen05.mma") == 16 and b.ptx.count("ex2.approx") == 128 + 3
    assert cubin_resources(b.cubin)["stack_bytes"] == 0


# ============================================================================= TMEM plan
@pytest.mark.parametrize("tile_n", (64, 128))
@pytest.mark.parametrize("dv", (64, 128))
def test_tmem_plan_one_q_tile_regions_disjoint_and_within_512(tile_n, dv):
    plan = K.tmem_plan(tile_n, dv)
    assert set(plan) == {"S0", "S1", "O", "P0", "P1"}
    assert K.tmem_plan_reason(plan) is None and C.tmem_aliases(1) == {}
    spans = sorted((a, a + n) for a, n in plan.values())
    for (a0, e0), (a1, _) in zip(spans, spans[1:]):
        assert e0 <= a1
    assert spans[-1][1] <= 512
    assert plan["S0"][1] == plan["S1"][1] == tile_n and plan["O"][1] == dv
    assert plan["P0"][1] == plan["P1"][1] == tile_n // 2  # 16-bit P, two per 32-bit column
    cols = K.tmem_alloc_cols(plan)
    assert cols >= spans[-1][1] and cols & (cols - 1) == 0 and 32 <= cols <= 512


@pytest.mark.parametrize("tile_n", (64, 128))
@pytest.mark.parametrize("dv", (64, 128))
def test_tmem_plan_two_q_tiles(tile_n, dv):
    """S0/S1/O0/O1 disjoint within 512 columns; P_t inside its own S_t's upper half (written once S_t is in
    registers), overlapping nothing else."""
    plan = K.tmem_plan(tile_n, dv, 2)
    aliases = C.tmem_aliases(2)
    assert set(plan) == {"S0", "S1", "O0", "O1", "P0", "P1"} and aliases == {"P0": "S0", "P1": "S1"}
    assert K.tmem_plan_reason(plan, aliases) is None
    spans = sorted((a, a + n) for k, (a, n) in plan.items() if k not in aliases)
    for (a0, e0), (a1, _) in zip(spans, spans[1:]):
        assert e0 <= a1
    assert spans[-1][1] <= 512
    for t in (0, 1):
        (pa, pn), (sa, sn) = plan[f"P{t}"], plan[f"S{t}"]
        assert pn == tile_n // 2 and sa + sn // 2 == pa and pa + pn == sa + sn
    # the same plan without its aliases declared is refused
    assert "overlap" in K.tmem_plan_reason(plan)


def test_tmem_plan_reason_catches_overlap_misalignment_and_overflow():
    assert "overlap" in K.tmem_plan_reason({"S0": (0, 128), "P0": (64, 64)})
    assert "multiple of 32" in K.tmem_plan_reason({"S0": (0, 128), "O": (136, 64)})
    assert "512" in K.tmem_plan_reason({"S0": (0, 256), "O": (256, 288)})
    assert "inside" in K.tmem_plan_reason({"S0": (0, 128), "P0": (96, 64)}, {"P0": "S0"})
    assert "overlaps" in K.tmem_plan_reason({"S0": (0, 128), "P0": (64, 64), "P1": (96, 32)},
                                            {"P0": "S0", "P1": "S0"})
    assert "missing" in K.tmem_plan_reason({"S0": (0, 128)}, {"P0": "S0"})


def test_config_carries_the_plan_and_fits_shared_memory():
    for d in (64, 128):
        for q in (1, 2):
            p = problem(d=d)
            cfg = K.Config(p, tiles_for(p, q))
            assert cfg.tmem == K.tmem_plan(cfg.tiles.tile_n, d, q) and cfg.tmem_cols <= 512
            assert cfg.smem_bytes <= C.SMEM_LIMIT and cfg.tile_m == 128 * q
    for d in (64, 128):
        for t in (K.Tiles(tile_n=n, kv_stages=s) for n in (64, 128) for s in (2, 3)):
            assert K.Config(problem(d=d), t).smem_bytes <= C.SMEM_LIMIT
    with pytest.raises(ValueError, match="shared memory"):
        K.Config(problem(d=128), K.Tiles(tile_n=128, kv_stages=3, q_tiles=2))


def test_config_refuses_what_shared_memory_cannot_hold(monkeypatch):
    monkeypatch.setattr(C, "SMEM_LIMIT", 160 * 1024)
    with pytest.raises(ValueError, match="shared memory"):
        K.Config(problem(d=128), K.Tiles(tile_n=128, kv_stages=3))


# ============================================================================= contract
def test_contract_surface():
    assert K.NAME == "prefill_sm100"
    for name in ("Tiles", "Config", "unsupported_reason", "default_tiles", "compile", "launch"):
        assert callable(getattr(K, name))
    t = K.default_tiles(problem(), num_sms=148)
    assert dataclasses.is_dataclass(t) and t.__dataclass_params__.frozen
    assert K.Config(problem(), t).tile_m == 128


def test_config_rejects_bad_tiles_and_types():
    with pytest.raises(ValueError, match="tile_n"):
        K.Config(problem(), K.Tiles(tile_n=96))
    with pytest.raises(ValueError, match="kv_stages"):
        K.Config(problem(), K.Tiles(kv_stages=4))
    with pytest.raises(ValueError, match="int"):
        K.Config(problem(), K.Tiles(tile_n=True))
    with pytest.raises(ValueError, match="rescale_threshold"):
        K.Config(problem(), K.Tiles(rescale_threshold=16))
    with pytest.raises(ValueError, match="q_tiles"):
        K.Config(problem(), K.Tiles(q_tiles=3))
    with pytest.raises(TypeError):
        K.Config(problem(), object())
    with pytest.raises(ValueError, match="sm_100a"):
        K.Config(problem(arch="sm_90a"), K.Tiles())


def test_launch_passes_the_sm90_argument_order():
    seen = []
    args = PrefillArgs(q="q", k="k", v="v", indices="idx", work="work", out="o", lse="lse", mask="mask",
                       sinks="sinks", alibi_slopes="alibi", sm_scale=0.5, soft_cap=0.0, window_left=-1,
                       rope_rcp_scale=1.0, rope_log2_theta=13.0, output_scale=0.25)
    K.launch(lambda *a: seen.append(a), K.Config(problem(), K.Tiles()), args)
    assert seen == [("q", "k", "v", "idx", "work", "o", "lse", "mask", "sinks", 0.5, 0.0, -1, 0.25)]


def test_served_problems_have_no_reason():
    for a in ARCHS:
        for d in (64, 128):
            for c in (False, True):
                for g in (1, 2, 4, 8, 16):
                    for dt in ("bfloat16", "float16"):
                        assert K.unsupported_reason(problem(arch=a, d=d, causal=c, g=g, dtype=dt, sinks=c)) is None
    for kw in FEATURES:
        kw = dict(kw)
        del kw["q"]
        assert K.unsupported_reason(problem(**kw)) is None


REFUSED = [
    (dict(arch="sm_90a"), "sm_100a"),
    (dict(page_size=16, d=256), "head_dim 256"),
    (dict(page_size=16, kv_dtype="float8_e4m3fn"), "fp8"),
    (dict(pos_encoding_mode="ROPE_LLAMA"), "positional"),
    (dict(pos_encoding_mode="ALIBI"), "positional"),
    (dict(g=3), "group_size"),
]


@pytest.mark.parametrize("kw,needle", REFUSED, ids=[n for _, n in REFUSED])
def test_unsupported_reason_names_each_refused_feature(kw, needle):
    reason = K.unsupported_reason(problem(**kw))
    assert reason is not None and needle in reason
    with pytest.raises(ValueError, match="SM100 prefill"):
        K.Config(problem(**kw), K.Tiles())


def test_head_dims_served_and_refused():
    """64/64, 128/128, 192/128, 256/256 served; other pairs refused naming the served ones.  head_dim 256 takes
    64-token blocks: with 128 (S0 + S1 + O + P = 640 columns) or two Q tiles (two O of 256) TMEM overflows."""
    for dq, dv in ((64, 64), (128, 128), (192, 128), (256, 256)):
        assert K.unsupported_reason(problem(d=dq, dv=dv)) is None
    for dq, dv in ((128, 64), (256, 128), (64, 128), (32, 32)):
        reason = K.unsupported_reason(problem(d=dq, dv=dv))
        assert reason is not None and "192/128" in reason and f"{dq}/{dv}" in reason
    p = problem(d=256)
    t = K.default_tiles(p, num_sms=148)
    assert t.tile_n == 64 and t.q_tiles == 1 and K.Config(p, t).tmem_cols == 512
    assert K.tmem_plan_reason(K.Config(p, t).tmem) is None
    with pytest.raises(ValueError, match="512"):
        K.Config(p, dataclasses.replace(t, tile_n=128))
    assert "512" in K.tmem_plan_reason(K.tmem_plan(64, 256, 2), C.tmem_aliases(2))  # two O of 256 columns
    p = problem(d=192, dv=128)
    t = K.default_tiles(p, num_sms=148)
    assert K.Config(p, t).tmem_cols == 512 and t.tile_n == 128
    with pytest.raises(ValueError, match="q_tiles=2"):  # the MMA warp's 32 registers spill 2 x 12 descriptors
        K.Config(p, dataclasses.replace(t, q_tiles=2, tile_n=64))
    with pytest.raises(ValueError, match="q_tiles=2"):
        K.Config(problem(d=256), K.Tiles(tile_n=64, q_tiles=2))
