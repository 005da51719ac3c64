"""CPU tests of the SM90 chunked KDA / GDN-2 kernel: its contract and its PTX / cubin (cross-compiled for sm_90a;
the kernel needs an H200 to run), and that the per-channel branch leaves the SM90 GDN main kernel's code alone."""

import dataclasses
import glob
import re
import shutil
import subprocess

import pytest

from _builds import build  # (tests/ is on sys.path)
from cutedsl_attn.compile.cubin import cubin_kernel_resources
from cutedsl_attn.inspect import _find_tool
from cutedsl_attn.planning.gdn import CHUNK, GdnProblem

kda90 = pytest.importorskip("cutedsl_attn.sm90.kda_chunked")
gdn90 = pytest.importorskip("cutedsl_attn.sm90.gdn_chunked")


def _problem(**kw):
    base = dict(dtype="bfloat16", head_dim_k=128, head_dim_v=128, gate_domain="log", gate_per_channel=True,
                use_qk_l2norm=True)
    return GdnProblem(**{**base, **kw})


def test_unsupported_and_config_rules():
    assert kda90.NAME == "kda_chunked_sm90"
    assert kda90.unsupported_reason(_problem()) is None
    assert kda90.unsupported_reason(_problem(erase_write_gates=True, head_dim_k=64, state_dtype="bfloat16")) is None
    assert "portable chunked per-channel kernel" in kda90.unsupported_reason(_problem(arch="sm_100a"))
    for kw, word in ((dict(gate_per_channel=False), "per-channel"), (dict(gate_domain="linear"), "log gates"),
                     (dict(decode=True), "decode"), (dict(state_k_major=True), "V-major")):
        assert word in kda90.unsupported_reason(_problem(**kw)), kw
    with pytest.raises(TypeError):
        kda90.unsupported_reason("kda")
    with pytest.raises(ValueError, match="cannot serve"):
        kda90.Config(_problem(gate_per_channel=False), kda90.Tiles())
    with pytest.raises(ValueError, match="tile_v 128 must divide head_dim_v 64"):
        kda90.Config(_problem(head_dim_v=64), kda90.Tiles(tile_v=128))
    with pytest.raises(TypeError):
        kda90.Config(_problem(), object())
    assert kda90.TUNING_FIELDS == ("tile_v", "num_stages", "prep_ctas", "tma", "prep_rolled")
    assert kda90.Tiles().tma == 0 and kda90.override_tiles(kda90.Tiles(), {"tma": "1"}) == kda90.Tiles(tma=1)
    with pytest.raises(ValueError, match="tma"):
        kda90.Tiles(tma=2)
    with pytest.raises(TypeError, match="tma"):
        kda90.Tiles(tma=True)
    assert kda90.Config(_problem(), kda90.Tiles(tma=1)) != kda90.Config(_problem(), kda90.Tiles())  # compile key
    assert kda90.Config(_problem(), kda90.Tiles(tma=1)).main_smem_bytes == \
        kda90.Config(_problem(), kda90.Tiles()).main_smem_bytes  # the same ring
    assert kda90.override_tiles(kda90.Tiles(), {"num_stages": "3"}).num_stages == 3
    assert kda90.override_tiles(kda90.Tiles(), {"prep_ctas": "3"}) == kda90.Tiles(prep_ctas=3)
    for bad in (dict(tile_v=32), dict(num_stages=4), dict(prep_ctas=4)):
        with pytest.raises(ValueError):
            kda90.Tiles(**bad)
    with pytest.raises(TypeError):
        kda90.Tiles(prep_ctas=3.0)
    with pytest.raises(ValueError, match="prep_ctas 3"):
        kda90.Config(_problem(erase_write_gates=True), kda90.Tiles(prep_ctas=3))
    # the GDN kernel's tile rules (the same main kernel)
    for chains, tv in ((256, 128), (99, 128), (98, 64), (8, 64)):
        assert kda90.default_tiles(_problem(), num_sms=132, chains=chains) == kda90.Tiles(tile_v=tv, prep_ctas=3)
    assert kda90.default_tiles(_problem(head_dim_k=64), num_sms=132) == kda90.Tiles(tile_v=64, prep_ctas=3)
    # GDN-2's erase gates do not fit the compact layout: its default is the two-CTA one; both rolled
    t2 = kda90.default_tiles(_problem(erase_write_gates=True), num_sms=132)
    assert (t2.prep_ctas, t2.prep_rolled, kda90.Tiles().prep_rolled) == (2, 1, 1)
    assert kda90.default_tiles(_problem(dtype="float16"), num_sms=132).prep_ctas == 2  # see VARIANTS' fp16 note
    for K in (64, 128):
        for tv in (64, 128):
            for st in (2, 3):
                cfg = kda90.Config(_problem(head_dim_k=K), kda90.Tiles(tile_v=tv, num_stages=st))
                assert cfg.main_smem_bytes <= 227 * 1024 and cfg.num_wg == tv // 64
                assert cfg.f_bytes == (2 * CHUNK + K) * 4
                gcfg = gdn90.Config(_problem(head_dim_k=K, gate_per_channel=False),
                                    gdn90.Tiles(tile_v=tv, num_stages=st))
                assert cfg.stage_bytes == gcfg.stage_bytes + (K - CHUNK) * 4  # F: K gates in place of C


VARIANTS = {
    "kda_k128_l2norm_128x2": (dict(), (128, 2)),
    "kda_k128_l2norm_128x2_prep3": (dict(), (128, 2, 3)),
    # fp16's compact prep unrolled: rolled it spills 48 B at the 168-register cap, so default_tiles keeps fp16
    # on the two-CTA layout
    "kda_k64_v64_fp16_64x2_prep3": (dict(dtype="float16", head_dim_k=64, head_dim_v=64, use_qk_l2norm=False),
                                    (64, 2, 3, 0)),
    "gdn2_k128_bf16state_64x3": (dict(erase_write_gates=True, state_dtype="bfloat16"), (64, 3)),
    "kda_k64_v64_fp16_64x2": (dict(dtype="float16", head_dim_k=64, head_dim_v=64, use_qk_l2norm=False), (64, 2)),
    "gdn2_k64_v128_64x3": (dict(erase_write_gates=True, head_dim_k=64), (64, 3)),
    "kda_k128_128x3": (dict(use_qk_l2norm=False), (128, 3)),
}


def _compile(module, cfg, tmp_path):
    """(PTX, cubin resources) of ``cfg``, compiled once a session (``_builds.build``: several tests here build the
    same configuration); the cubin is copied to ``tmp_path`` for :func:`_prep_sass_instructions`."""
    b = build(module.compile, cfg)
    tmp_path.mkdir(exist_ok=True)
    shutil.copy(b.cubin_path, tmp_path)
    return b.ptx, cubin_kernel_resources(b.cubin)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_sm90_kda_kernel_ptx_and_cubin(tmp_path, variant):
    kw, (tv, st, *pc) = VARIANTS[variant]
    p = _problem(**kw)
    cfg = kda90.Config(p, kda90.Tiles(tile_v=tv, num_stages=st, prep_ctas=pc[0] if pc else 2, prep_rolled=pc[1] if pc[1:] else 1))
    ptx, res = _compile(kda90, cfg, tmp_path)
    assert re.search(r"\.target\s+sm_90a", ptx)
    entries = re.findall(r"\.entry\s+(\S+)\(", ptx)
    assert len(entries) == 2 and "prep" in entries[0] and "main" in entries[1]  # one function, two kernels
    prep, main = ptx.split(".entry")[1], ptx.split(".entry")[2]
    ab = "bf16" if p.dtype == "bfloat16" else "f16"
    K, C = p.head_dim_k, CHUNK
    # the GDN SM90 kernel's wgmma counts (one rolled chunk loop: the static count is the count per chunk)
    n64 = len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.{ab}\.{ab}", main))
    nk = len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{K}k16\.f32\.{ab}\.{ab}", main))
    if K == 64:
        assert n64 == 2 * (K // 16) + 2 * (C // 16) and nk == n64
    else:
        assert n64 == 2 * (K // 16) + C // 16 and nk == C // 16
    assert "wgmma" not in prep and "mma.sync.aligned.m16n8k16" in prep  # the per-channel prep on mma.sync
    # the prep's diagonal-block bounds as running maxima, T by 16 x 16 blocks (a warp sync in the diagonal step)
    assert "max.f32" in prep and "bar.warp.sync" in prep
    assert not re.search(r"bar(rier)?\.sync(\.aligned)?\s+1,", prep)
    assert "mma.sync" not in main
    assert sorted(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", main)) == ["0", "0", "1"]
    assert "cp.async.cg.shared.global" in main and "cp.async.mbarrier.arrive.noinc" in main
    assert "fence.proxy.async" in main
    # qf and kf (C / 8 pairs each), then 2^G_last per K column pair of the thread (K / 8 pairs)
    assert len(re.findall(r"ld\.shared\.v2\.f32", main)) == 2 * (C // 8) + K // 8
    assert ("setmaxnreg.dec" in main and "setmaxnreg.inc" in main) == (tv == 128)
    assert ".local" not in ptx
    assert len(res) == 2
    for name, r in res.items():
        assert r["stack_bytes"] == 0, (name, r)  # no spills
    prep_res = [r for n, r in res.items() if "prep" in n][0]
    ctas = cfg.tiles.prep_ctas  # the prep's CTAs an SM, by shared memory and by registers
    assert ctas * (cfg.prep_smem_bytes + 1024) <= 228 * 1024 and ctas * 128 * prep_res["registers"] <= 65536
    assert bool(re.search(r"\.minnctapersm\s+3", prep)) == (ctas == 3)
    main_res = [r for n, r in res.items() if "main" in n][0]
    assert main_res["registers"] <= 65536 // (128 * (1 + tv // 64))  # launchable before setmaxnreg


@pytest.mark.parametrize("K", [64, 128])
def test_gdn_main_kernel_keeps_the_scalar_decay(tmp_path, K):
    """The per-channel branch is compile-time: the GDN main kernel still decays by one scalar a chunk and loads a
    3 C-float F; the KDA main kernel differs from it only where F and the decay are handled."""
    gdn_ptx, _ = _compile(gdn90, gdn90.Config(_problem(head_dim_k=K, gate_per_channel=False),
                                              gdn90.Tiles(tile_v=64, num_stages=2)), tmp_path / "gdn")
    kda_ptx, _ = _compile(kda90, kda90.Config(_problem(head_dim_k=K), kda90.Tiles(tile_v=64, num_stages=2)),
                          tmp_path / "kda")
    g_main, k_main = gdn_ptx.split(".entry")[2], kda_ptx.split(".entry")[2]
    C = CHUNK
    assert len(re.findall(r"ld\.shared\.v2\.f32", g_main)) == 2 * (C // 8)
    assert len(re.findall(r"ld\.shared\.v2\.f32", k_main)) == 2 * (C // 8) + K // 8
    wg = r"wgmma\.mma_async[^;]*;"
    assert [re.sub(r"%\w+", "", x) for x in re.findall(wg, g_main)] == \
           [re.sub(r"%\w+", "", x) for x in re.findall(wg, k_main)]  # the same GEMMs in the same order


@pytest.mark.parametrize("gdn2", [False, True])
def test_launch_tensors_mirror_the_portable_kernels(gdn2):
    import torch

    from cutedsl_attn.planning.gdn import FLAG_HAS_BETA, FLAG_HAS_G, GdnArgs
    from cutedsl_attn.portable import kda_chunked as chk

    lens, ho, K, V = [0, 65, 3], 4, 64, 128
    T = sum(lens)
    cu = torch.tensor([0, 0, 65, 68], dtype=torch.int32)
    q, k = torch.zeros(T, 2, K, dtype=torch.bfloat16), torch.zeros(T, 2, K, dtype=torch.bfloat16)
    v = torch.zeros(T, ho, V, dtype=torch.bfloat16)
    g = torch.zeros(T, ho, K)
    beta = torch.zeros(T, ho, K + V) if gdn2 else torch.zeros(T, ho)
    s = torch.zeros(3, ho, V, K)
    i32 = torch.zeros(1, dtype=torch.int32)

    def args(g, beta):
        return GdnArgs(q, k, v, g, beta, cu, s, i32, s, i32, torch.empty(T, ho, V, dtype=torch.bfloat16), 0.125,
                       2, 2, 1, FLAG_HAS_G | FLAG_HAS_BETA)

    p = _problem(head_dim_k=K, erase_write_gates=gdn2)
    cfg = kda90.Config(p, kda90.Tiles(tile_v=64))
    mine = kda90.launch_tensors(args(g, beta), cfg)
    theirs = chk.launch_tensors(args(g, beta), chk.Config(p, chk.Tiles()))
    assert [tuple(x.shape) for x in mine] == [tuple(x.shape) for x in theirs]
    assert [x.dtype for x in mine] == [x.dtype for x in theirs]
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])  # the same chunk plan
    assert tuple(mine[-1].shape[-1:]) == (cfg.f_bytes // 4,)
    with pytest.raises(ValueError, match="g must be"):
        kda90.launch_tensors(args(torch.zeros(T, ho), beta), cfg)
    with pytest.raises(ValueError, match="beta must be"):
        kda90.launch_tensors(args(g, torch.zeros(T, ho, 3)), cfg)


TMA_VARIANTS = {
    "kda_k128_l2norm_128x2": (dict(), (128, 2)),
    "kda_k64_v64_fp16_64x3_prep3": (dict(dtype="float16", head_dim_k=64, head_dim_v=64, use_qk_l2norm=False),
                                    (64, 3, 3, 0)),  # unrolled: as VARIANTS' fp16 compact prep
    "gdn2_k128_bf16state_64x3": (dict(erase_write_gates=True, state_dtype="bfloat16"), (64, 3)),
    "gdn2_k64_v128_64x2": (dict(erase_write_gates=True, head_dim_k=64), (64, 2)),
}


def _unnamed(entry):
    """One ``.entry`` chunk of a PTX file with its kernel's name (which spells the configuration) replaced."""
    name = re.match(r"\s*([\w$]+)\(", entry).group(1)
    return entry.replace(name, "KERNEL")


def _cp_async_16(text):
    """The ``cp.async`` copies of 16 bytes: (all, those whose source size is a register: zero-filling rows)."""
    copies = re.findall(r"cp\.async\.cg\.shared\.global[^;]*;", text)
    return copies, [c for c in copies if re.search(r",\s*%r\w*;", c)]


@pytest.mark.parametrize("variant", sorted(TMA_VARIANTS))
def test_sm90_kda_kernel_tma_ptx_and_cubin(tmp_path, variant):
    """``tma = 1``: W, Aqk and full chunks' Qg / Kd as TMA boxes on the stage's expect-tx mbarrier; U, the row
    factors and a tail chunk's rows stay cp.async; the prep kernel and the GEMMs are those of ``tma = 0``."""
    kw, (tv, st, *pc) = TMA_VARIANTS[variant]
    p = _problem(**kw)
    tiles = kda90.Tiles(tile_v=tv, num_stages=st, prep_ctas=pc[0] if pc else 2, prep_rolled=pc[1] if pc[1:] else 1)
    ptx1, res = _compile(kda90, kda90.Config(p, dataclasses.replace(tiles, tma=1)), tmp_path / "tma")
    ptx0, _ = _compile(kda90, kda90.Config(p, tiles), tmp_path / "cp")
    assert re.search(r"\.target\s+sm_90a", ptx1)
    prep1, main1 = ptx1.split(".entry")[1], ptx1.split(".entry")[2]
    prep0, main0 = ptx0.split(".entry")[1], ptx0.split(".entry")[2]
    K = p.head_dim_k
    assert "cp.async.bulk.tensor" not in ptx0 and "cp.async.bulk.tensor" not in prep1
    # one box per 128-byte swizzle span (64 columns): W, Qg and Kd K / 64 each, Aqk one
    boxes = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global\.tile\.mbarrier::complete_tx", main1)
    assert len(boxes) == 3 * (K // 64) + 1, boxes
    assert "mbarrier.arrive.expect_tx" in main1
    copies1, zfill1 = _cp_async_16(main1)
    copies0, zfill0 = _cp_async_16(main0)
    assert copies1 and zfill1 and zfill0  # U / F and a tail chunk's Qg / Kd rows (zero past the end) by cp.async
    assert len(copies1) < len(copies0)
    assert "cp.async.mbarrier.arrive.noinc" in main1 and "fence.proxy.async" in main1
    assert _unnamed(prep1) == _unnamed(prep0)  # the prep kernel: untouched
    wg = r"wgmma\.mma_async[^;]*;"
    assert [re.sub(r"%\w+", "", x) for x in re.findall(wg, main1)] == \
           [re.sub(r"%\w+", "", x) for x in re.findall(wg, main0)]  # the same GEMMs in the same order
    assert sorted(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", main1)) == ["0", "0", "1"]
    assert ("setmaxnreg.dec" in main1 and "setmaxnreg.inc" in main1) == (tv == 128)
    assert ".local" not in ptx1
    for name, r in res.items():
        assert r["stack_bytes"] == 0, (name, r)  # no spills
    main_res = [r for n, r in res.items() if "main" in n][0]
    assert main_res["registers"] <= 65536 // (128 * (1 + tv // 64))  # launchable before setmaxnreg


@pytest.mark.parametrize("prep_ctas", [2, 3])
def test_sm90_kda_prep_rolled_ptx_and_cubin(tmp_path, prep_ctas):
    """``prep_rolled = 1``: the prep's column-block steps (``_decay_cols``) and Qg / Kd steps (``_decay_out``) as
    run-time loops, each step's exp2s once instead of once a step; the same MMAs, no spills, the registers and CTAs
    an SM of the unrolled prep at most; the main kernel untouched.  The default is the rolled prep (1)."""
    assert kda90.Tiles().prep_rolled == 1
    assert kda90.override_tiles(kda90.Tiles(), {"prep_rolled": "0"}) == kda90.Tiles(prep_rolled=0)
    with pytest.raises(TypeError, match="prep_rolled"):
        kda90.Tiles(prep_rolled=True)
    with pytest.raises(ValueError, match="prep_rolled"):
        kda90.Tiles(prep_rolled=3)
    p = _problem()
    cfg1 = kda90.Config(p, kda90.Tiles(prep_ctas=prep_ctas, prep_rolled=1))
    ptx1, res1 = _compile(kda90, cfg1, tmp_path / "rolled")
    ptx0, res0 = _compile(kda90, kda90.Config(p, kda90.Tiles(prep_ctas=prep_ctas, prep_rolled=0)),
                          tmp_path / "unrolled")
    prep1, main1 = ptx1.split(".entry")[1], ptx1.split(".entry")[2]
    prep0, main0 = ptx0.split(".entry")[1], ptx0.split(".entry")[2]
    K, sub = p.head_dim_k, 16
    steps = sub * (K // 8) // 32  # _decay_cols' (and _decay_out's) steps: 8 at K = 128
    ex2 = r"ex2\.approx\.ftz\.f32"
    # 7 column blocks of 8 exp2 a step (4 diagonal, 3 earlier); Qg / Kd: 16 a step (the compact layout: 8 + 16, two
    # calls), each now once instead of `steps` times
    per_step = 7 * 8 + (16 if prep_ctas == 2 else 24)
    assert len(re.findall(ex2, prep0)) - len(re.findall(ex2, prep1)) == per_step * (steps - 1)
    mma = r"mma\.sync\.aligned\.m16n8k16[^;]*;"
    assert len(re.findall(mma, prep1)) == len(re.findall(mma, prep0))
    assert _unnamed(main1) == _unnamed(main0)  # the main kernel: untouched
    assert ".local" not in ptx1
    for name, r in res1.items():
        assert r["stack_bytes"] == 0, (name, r)  # no spills
    reg1 = [r for n, r in res1.items() if "prep" in n][0]["registers"]
    reg0 = [r for n, r in res0.items() if "prep" in n][0]["registers"]
    assert reg1 <= reg0 and prep_ctas * 128 * reg1 <= 65536
    assert bool(re.search(r"\.minnctapersm\s+3", prep1)) == (prep_ctas == 3)


def _prep_sass_instructions(tmp_path) -> int:
    """SASS instructions of the prep kernel in the cubin that :func:`_compile` kept in ``tmp_path``."""
    (cub,) = glob.glob(str(tmp_path / "*.cubin"))
    text = subprocess.run([_find_tool("cuobjdump"), "--dump-sass", cub], capture_output=True, text=True,
                          check=True).stdout
    (fn,) = [f for f in re.split(r"\n\s+Function : ", text)[1:] if "prep" in f.split("\n")[0]]
    return len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S", fn, re.M))


# SASS instructions of the level-2 prep, bf16 K = V = 128 l2norm (measured 3336 / 3888 with the sm_90a ptxas of
# nvidia-cutlass-dsl's CUDA 13.4; level 1: 6648 / 6888): the GDN preps' ~4000 (64 KB), which do not stall on
# instruction fetch
ROLLED2_MAX_SASS = {2: 3700, 3: 4300}


@pytest.mark.skipif(_find_tool("cuobjdump") is None, reason="no cuobjdump here")
@pytest.mark.parametrize("prep_ctas", [2, 3])
def test_sm90_kda_prep_rolled2_ptx_and_cubin(tmp_path, prep_ctas):
    """``prep_rolled = 2``: on top of level 1 the l2 norms, the cumulative decay, the loads, the gate products,
    the inverse's merges, the W / U k-steps and the direct diagonal blocks as run-time loops of one copy of the
    step: fewer copies of the MMAs and exp2s, the l2 norm's rsqrt
    once a step of ``NORM_BATCH`` rows, no spills, the CTAs an SM of level 1, about half of level 1's SASS; the
    main kernel untouched."""
    from cutedsl_attn.common.kda_prep_rolled import NORM_BATCH

    assert kda90.override_tiles(kda90.Tiles(), {"prep_rolled": "2"}) == kda90.Tiles(prep_rolled=2)
    p = _problem()
    ptx2, res2 = _compile(kda90, kda90.Config(p, kda90.Tiles(prep_ctas=prep_ctas, prep_rolled=2)), tmp_path / "r2")
    ptx1, res1 = _compile(kda90, kda90.Config(p, kda90.Tiles(prep_ctas=prep_ctas, prep_rolled=1)), tmp_path / "r1")
    prep2, main2 = ptx2.split(".entry")[1], ptx2.split(".entry")[2]
    prep1, main1 = ptx1.split(".entry")[1], ptx1.split(".entry")[2]
    ex2 = r"ex2\.approx\.ftz\.f32"
    # the exp2 phases were rolled at level 1; the direct diagonal's loop body (16 exp2s) now once, not twice
    assert len(re.findall(ex2, prep2)) == len(re.findall(ex2, prep1)) - 16
    mma = r"mma\.sync\.aligned\.m16n8k16[^;]*;"
    # W / U: 4 column halves x 4 guarded k-steps of 8 MMAs -> one k-step in each of the two loops
    assert len(re.findall(mma, prep2)) == len(re.findall(mma, prep1)) - (4 * 4 - 2) * 8
    cp = r"cp\.async\.cg\.shared\.global"
    assert len(re.findall(cp, prep2)) < len(re.findall(cp, prep1))
    assert len(re.findall(r"rsqrt\.approx", prep1)) == 2 * 16
    assert len(re.findall(r"rsqrt\.approx", prep2)) == 2 * NORM_BATCH
    assert _unnamed(main2) == _unnamed(main1)  # the main kernel: untouched
    assert ".local" not in ptx2
    for name, r in res2.items():
        assert r["stack_bytes"] == 0, (name, r)  # no spills
    reg2 = [r for n, r in res2.items() if "prep" in n][0]["registers"]
    assert prep_ctas * 128 * reg2 <= 65536 and (prep_ctas == 2 or reg2 <= 168)
    assert bool(re.search(r"\.minnctapersm\s+3", prep2)) == (prep_ctas == 3)
    n2, n1 = _prep_sass_instructions(tmp_path / "r2"), _prep_sass_instructions(tmp_path / "r1")
    assert n2 <= ROLLED2_MAX_SASS[prep_ctas] and n2 < 0.65 * n1, (n2, n1)
