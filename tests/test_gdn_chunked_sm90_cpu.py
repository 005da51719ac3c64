"""CPU tests of the SM90 chunked GDN kernel: its contract, the dispatch opt-in and its PTX / cubin (cross-compiled
for sm_90a; the kernel needs an H200 to run)."""

import itertools
import re

import pytest
from _builds import build  # (tests/ is on sys.path)

from cutedsl_attn.compile.cubin import cubin_kernel_resources
from cutedsl_attn.planning.gdn import CHUNK, GdnProblem

sm90 = pytest.importorskip("cutedsl_attn.sm90.gdn_chunked")


def _problem(**kw):
    return GdnProblem(**{**dict(dtype="bfloat16", head_dim_k=128, head_dim_v=128), **kw})


def test_unsupported_and_config_rules():
    assert sm90.unsupported_reason(_problem()) is None
    assert sm90.unsupported_reason(_problem(head_dim_k=64, head_dim_v=128, use_qk_l2norm=True)) is None
    assert "portable chunked kernel" in sm90.unsupported_reason(_problem(arch="sm_100a"))
    for kw, word in ((dict(decode=True), "decode"), (dict(state_k_major=True), "V-major"),
                     (dict(gate_per_channel=True), "GDN"), (dict(erase_write_gates=True, gate_per_channel=True), "GDN"),
                     (dict(num_householder=2), "GDN")):
        assert word in sm90.unsupported_reason(_problem(**kw))
    with pytest.raises(TypeError):
        sm90.unsupported_reason("gdn")
    with pytest.raises(ValueError, match="cannot serve"):
        sm90.Config(_problem(arch="sm_100a"), sm90.Tiles())
    with pytest.raises(ValueError, match="tile_v 128 must divide head_dim_v 64"):
        sm90.Config(_problem(head_dim_v=64), sm90.Tiles(tile_v=128))
    with pytest.raises(ValueError, match="tile_v"):
        sm90.Tiles(tile_v=32)
    with pytest.raises(ValueError, match="num_stages"):
        sm90.Tiles(num_stages=4)
    with pytest.raises(TypeError):
        sm90.Tiles(tile_v=64.0)
    with pytest.raises(TypeError):
        sm90.Config(_problem(), object())
    assert sm90.override_tiles(sm90.Tiles(), {"num_stages": "3"}).num_stages == 3
    with pytest.raises(ValueError):
        sm90.override_tiles(sm90.Tiles(), {"num_warps": "8"})
    assert sm90.TUNING_FIELDS == ("tile_v", "num_stages", "tma", "persistent", "prep")
    assert sm90.Tiles().tma == 0 and sm90.override_tiles(sm90.Tiles(), {"tma": "1"}).tma == 1
    with pytest.raises(ValueError, match="tma"):
        sm90.Tiles(tma=2)
    with pytest.raises(TypeError):
        sm90.Tiles(tma=True)
    assert sm90.Config(_problem(), sm90.Tiles(tma=1)) != sm90.Config(_problem(), sm90.Tiles())  # compile key
    assert sm90.default_tiles(_problem(), num_sms=132, chains=256) == sm90.Tiles(tile_v=128, prep=1)
    assert sm90.default_tiles(_problem(), num_sms=132, chains=8) == sm90.Tiles(tile_v=64, prep=1)
    for chains, tv in ((128, 128), (99, 128), (98, 64), (32, 64)):  # 128 rows from 3/4 of a wave of chains
        assert sm90.default_tiles(_problem(), num_sms=132, chains=chains) == sm90.Tiles(tile_v=tv, prep=1), chains
    assert sm90.default_tiles(_problem(head_dim_v=64), num_sms=132) == sm90.Tiles(tile_v=64, prep=1)
    assert sm90.default_tiles(_problem(head_dim_k=64), num_sms=132) == sm90.Tiles(tile_v=64, prep=1)
    for tv in (64, 128):
        for st in (2, 3):
            cfg = sm90.Config(_problem(), sm90.Tiles(tile_v=tv, num_stages=st))
            assert cfg.main_smem_bytes <= 227 * 1024 and cfg.num_wg == tv // 64


def test_dispatch_opt_in(monkeypatch):
    from cutedsl_attn.dispatch import gdn as dg
    from cutedsl_attn.dispatch import gdn_choice
    from cutedsl_attn.portable import gdn_chunked as chk

    p = _problem()
    monkeypatch.delenv("CUTEDSL_ATTN_GDN_KERNEL", raising=False)
    assert gdn_choice(p)[0] is sm90  # the default on sm_90a
    assert gdn_choice(_problem(arch="sm_100a"))[0] is chk
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_KERNEL", "chunked_sm90")
    module, cfg = gdn_choice(p, chains=1000)
    assert module is sm90 and isinstance(cfg, sm90.Config) and cfg.tiles == sm90.Tiles(tile_v=128, prep=1)
    assert gdn_choice(p, chains=4)[1].tiles.tile_v == 64
    assert gdn_choice(_problem(decode=True))[0].NAME == "gdn_recurrent"  # outside its family: automatic
    with pytest.raises(NotImplementedError, match="sm_90a only.*portable chunked kernel"):
        gdn_choice(_problem(arch="sm_100a"))
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_TUNE", "tile_v=64,num_stages=3")
    assert gdn_choice(p)[1].tiles == sm90.Tiles(tile_v=64, num_stages=3, prep=1)
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_TUNE", "tma=1")
    assert gdn_choice(p, chains=1000)[1].tiles == sm90.Tiles(tile_v=128, tma=1, prep=1)
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_TUNE", "num_warps=8")  # the portable kernels' field: this one untouched
    assert gdn_choice(p, chains=1000)[1].tiles == sm90.Tiles(tile_v=128, prep=1)
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_TUNE", "num_warp=8")  # no delta-rule kernel's field
    with pytest.raises(ValueError, match="CUTEDSL_ATTN_GDN_TUNE"):
        gdn_choice(p)
    assert "gdn_chunked_sm90" in dg._OPS and sm90.NAME == "gdn_chunked_sm90"


VARIANTS = {
    "k128_l2norm_128x2": (dict(use_qk_l2norm=True), (128, 2)),
    "k128_bf16state_log_64x3": (dict(state_dtype="bfloat16", gate_domain="log"), (64, 3)),
    "k64_v64_fp16_64x2": (dict(dtype="float16", head_dim_k=64, head_dim_v=64), (64, 2)),
    "k64_v128_l2norm_64x3": (dict(head_dim_k=64, use_qk_l2norm=True), (64, 3)),
    "k128_128x3": (dict(), (128, 3)),
    "k128_v64_64x2": (dict(head_dim_v=64), (64, 2)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_sm90_kernel_ptx_and_cubin(variant):
    kw, (tv, st) = VARIANTS[variant]
    p = _problem(**kw)
    cfg = sm90.Config(p, sm90.Tiles(tile_v=tv, num_stages=st))
    b = build(sm90.compile, cfg)
    ptx = b.ptx
    assert re.search(r"\.target\s+sm_90a", ptx)
    entries = re.findall(r"\.entry\s+(\S+)\(", ptx)
    assert len(entries) == 2 and "prep" in entries[0] and "main" in entries[1]  # one function, two kernels
    prep, main = ptx.split(".entry")[1], ptx.split(".entry")[2]
    ab = "bf16" if p.dtype == "bfloat16" else "f16"
    K, C = p.head_dim_k, CHUNK
    # the main loop is one rolled chunk loop: the static wgmma count is the count per chunk
    n64 = len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.{ab}\.{ab}", main))
    nk = len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{K}k16\.f32\.{ab}\.{ab}", main))
    if K == 64:  # X^T, Y^T (K / 16 each), O^T (C / 16) and the state update (C / 16) are all n64
        assert n64 == 2 * (K // 16) + 2 * (C // 16) and nk == n64
    else:
        assert n64 == 2 * (K // 16) + C // 16 and nk == C // 16
    # prep = 0 (the Tiles field's default; default_tiles picks 1): the shared prep kernel on mma.sync
    assert "wgmma" not in prep and "mma.sync.aligned.m16n8k16" in prep
    assert "mma.sync" not in main
    assert "wgmma.fence.sync.aligned" in main and "wgmma.commit_group.sync.aligned" in main
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", main)
    assert sorted(waits) == ["0", "0", "1"]  # X^T consumed while Y^T is in flight; then two full waits
    assert "cp.async.cg.shared.global" in main and "cp.async.mbarrier.arrive.noinc" in main
    assert "cp.async.bulk.tensor" not in ptx  # tma = 0: every load a cp.async
    assert "mbarrier.try_wait" in main or "mbarrier.test_wait" in main
    assert "fence.proxy.async" in main  # cp.async writes ordered before wgmma's reads
    # two consumer warpgroups (384 threads) rebalance registers; one (256 threads) needs no setmaxnreg
    assert ("setmaxnreg.dec" in main and "setmaxnreg.inc" in main) == (tv == 128)
    assert ".local" not in ptx
    res = cubin_kernel_resources(b.cubin)
    assert len(res) == 2
    for name, r in res.items():
        assert r["stack_bytes"] == 0, (name, r)  # no spills
    main_res = [r for n, r in res.items() if "main" in n][0]
    assert main_res["registers"] <= 65536 // (128 * (1 + tv // 64))  # launchable before setmaxnreg


TMA_VARIANTS = {
    "k128_bf16_128x2": (dict(use_qk_l2norm=True), (128, 2)),
    "k128_fp16_64x3": (dict(dtype="float16"), (64, 3)),
    "k64_bf16_64x2": (dict(head_dim_k=64, head_dim_v=64), (64, 2)),
    "k64_fp16_64x3": (dict(dtype="float16", head_dim_k=64, head_dim_v=64, state_dtype="bfloat16"), (64, 3)),
}


@pytest.mark.parametrize("variant", sorted(TMA_VARIANTS))
def test_sm90_kernel_tma_ptx_and_cubin(variant):
    """``tma = 1``: W / Aqk and full chunks' q / k rows as TMA boxes on an expect-tx mbarrier; the tail chunk's
    q / k rows, U and the row factors stay cp.async."""
    kw, (tv, st) = TMA_VARIANTS[variant]
    p = _problem(**kw)
    cfg = sm90.Config(p, sm90.Tiles(tile_v=tv, num_stages=st, tma=1))
    b = build(sm90.compile, cfg)
    ptx = b.ptx
    prep, main = ptx.split(".entry")[1], ptx.split(".entry")[2]
    assert "cp.async.bulk.tensor" not in prep
    # one box per 128-byte swizzle span (64 columns): W and q / k K / 64 each, Aqk one
    boxes = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global\.tile\.mbarrier::complete_tx", main)
    assert len(boxes) == 3 * (p.head_dim_k // 64) + 1, boxes
    assert "mbarrier.arrive.expect_tx" in main
    assert "cp.async.cg.shared.global" in main and "cp.async.mbarrier.arrive.noinc" in main  # tail rows, U, F
    assert ".local" not in ptx
    assert ("setmaxnreg.dec" in main and "setmaxnreg.inc" in main) == (tv == 128)
    res = cubin_kernel_resources(b.cubin)
    for name, r in res.items():
        assert r["stack_bytes"] == 0, (name, r)
    main_res = [r for n, r in res.items() if "main" in n][0]
    assert main_res["registers"] <= 65536 // (128 * (1 + tv // 64))  # launchable before setmaxnreg


def test_persistent_tiles_rules(monkeypatch):
    from cutedsl_attn.dispatch import gdn_choice
    from cutedsl_attn.sm90 import kda_chunked as kda

    assert sm90.Tiles().persistent == 0
    assert sm90.override_tiles(sm90.Tiles(), {"persistent": "1"}).persistent == 1
    assert sm90.Tiles(persistent=sm90.MAX_PERSISTENT_CTAS).persistent == sm90.MAX_PERSISTENT_CTAS
    for bad in (-1, sm90.MAX_PERSISTENT_CTAS + 1):
        with pytest.raises(ValueError, match="persistent"):
            sm90.Tiles(persistent=bad)
    for bad in (True, 1.0, "1"):
        with pytest.raises(TypeError, match="persistent"):
            sm90.Tiles(persistent=bad)
    assert sm90.Config(_problem(), sm90.Tiles(persistent=1)) != sm90.Config(_problem(), sm90.Tiles())
    assert sm90.default_tiles(_problem(), num_sms=132, chains=1000).persistent == 0  # opt-in
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_KERNEL", "chunked_sm90")
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_TUNE", "persistent=1")
    assert gdn_choice(_problem(), chains=1000)[1].tiles == sm90.Tiles(tile_v=128, persistent=1, prep=1)
    # one CTA an SM for every served configuration: 168+ registers a thread, or shared memory, fill the SM
    for kw, tv, st in ((dict(), 128, 2), (dict(), 64, 3), (dict(head_dim_k=64, head_dim_v=64), 64, 2)):
        assert sm90.Config(_problem(**kw), sm90.Tiles(tile_v=tv, num_stages=st)).main_ctas_per_sm == 1
    # the per-channel subclass's Tiles have no persistent field: the one-CTA-an-item grid
    kcfg = kda.Config(_problem(gate_per_channel=True, gate_domain="log"), kda.Tiles())
    assert not hasattr(kcfg.tiles, "persistent") and not kda.KdaChunkedSm90Kernel(kcfg).persistent
    assert not getattr(kda.KdaChunkedSm90Kernel(kcfg), "takes_plan", False)


def _offsets(lens):
    import torch

    nch = [(n + CHUNK - 1) // CHUNK for n in lens]
    return torch.tensor([0] + list(itertools.accumulate(nch)), dtype=torch.int32), nch


def test_plan_sequences_longest_first_stable():
    import torch

    from cutedsl_attn.planning.gdn import plan_chunks, plan_sequences

    lens = [0, 1, 63, 64, 65, 4097, 0, 130, 64, 1, 8192, 200]
    off, nch = _offsets(lens)
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    assert torch.equal(plan_chunks(cu, sum(lens))[1], off)  # the kernel's chunk offsets
    order = plan_sequences(off)
    assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(len(lens)))
    keys = [(-nch[i], i) for i in order.tolist()]
    assert keys == sorted(keys)  # chunk count descending, ties in id order; lengths 0 last
    assert order.tolist()[-2:] == [0, 6]


@pytest.mark.parametrize("items,grid", [(1, 1), (7, 7), (20, 7), (21, 7), (14, 7), (1000, 132), (1024, 132),
                                        (3, 2), (97, 5)])
def test_persistent_walk_covers_items_once_longest_first(items, grid):
    from cutedsl_attn.planning.gdn import persistent_walk

    walks = [persistent_walk(items, grid, b) for b in range(grid)]
    assert sorted(sum(walks, [])) == list(range(items))  # every item once
    for w in walks:
        assert w == sorted(w)  # positions ascending: each CTA's items longest first
    assert max(map(len, walks)) - min(map(len, walks)) <= 1
    with pytest.raises(ValueError):
        persistent_walk(items, items + 1, 0)
    with pytest.raises(ValueError):
        persistent_walk(items, grid, grid)


def test_persistent_walk_balances_a_ragged_batch():
    """Row (e)-like: 64 sequences of 128..8192 tokens x 16 heads on 132 CTAs; the snake deal keeps every CTA's
    chunk total within one longest item of every other's (the one-CTA-an-item grid's last wave is not)."""
    import random

    import torch

    from cutedsl_attn.planning.gdn import persistent_walk, plan_sequences

    rng = random.Random(0)
    lens = [rng.randint(128, 8192) for _ in range(64)] + [0, 1, 65]
    off, nch = _offsets(lens)
    heads, grid = 16, 132
    order = plan_sequences(off).tolist()
    items = len(lens) * heads
    loads = [sum(nch[order[p // heads]] + 1 for p in persistent_walk(items, grid, b)) for b in range(grid)]
    assert max(loads) - min(loads) <= max(nch) + 1


def _cpu_args(lens, ho=4, K=128, V=128):
    import torch

    from cutedsl_attn.planning.gdn import GdnArgs

    T, n = sum(lens), len(lens)
    x = torch.zeros(T, ho, K, dtype=torch.bfloat16)
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    st = torch.zeros(n, ho, V, K)
    idx = torch.zeros(1, dtype=torch.int32)
    return GdnArgs(x, x, torch.zeros(T, ho, V, dtype=torch.bfloat16), torch.ones(T, ho), torch.ones(T, ho), cu, st,
                   idx, st, idx, torch.zeros(T, ho, V, dtype=torch.bfloat16), 1.0, 1, 1, 1, 0)


def test_launch_hands_the_plan_to_the_persistent_kernel():
    import torch

    from cutedsl_attn.common import gdn_launch

    lens = [5, 0, 200, 64]
    args = _cpu_args(lens)
    calls = []
    for tiles, grid in ((sm90.Tiles(), None), (sm90.Tiles(persistent=5), 5), (sm90.Tiles(tile_v=64, persistent=3), 3),
                        (sm90.Tiles(tile_v=64, persistent=1000), 4 * 4 * 2)):
        calls.clear()
        cfg = sm90.Config(_problem(), tiles)
        sm90.launch(lambda *a: calls.append(a), cfg, args)
        (a,) = calls
        if grid is None:
            assert len(a) == 22 and gdn_launch.work_plan(cfg, args, a[7]) is None
            continue
        assert len(a) == 24 and a[18] == grid  # after the scratch: the order, then the grid size
        assert a[17].dtype == torch.int32 and a[17].tolist() == [2, 0, 3, 1]  # longest first, length 0 last
        main_calls = []
        mcfg = sm90.MainConfig(cfg, sm90.MainRun.STATE)
        sm90.launch_main(lambda *a: main_calls.append(a), mcfg, args, sm90.prep_tensors(args, cfg))
        assert len(main_calls[0]) == 24 and main_calls[0][18] == grid


PERSISTENT_VARIANTS = {
    "k128_l2norm_128x2": (dict(use_qk_l2norm=True), (128, 2, 0)),
    "k128_bf16state_64x3_tma": (dict(state_dtype="bfloat16"), (64, 3, 1)),
    "k64_v64_fp16_64x2": (dict(dtype="float16", head_dim_k=64, head_dim_v=64), (64, 2, 0)),
}


@pytest.mark.parametrize("variant", sorted(PERSISTENT_VARIANTS))
def test_sm90_persistent_ptx_and_cubin(variant):
    """``persistent = 1``: the same per-chunk wgmma code in one more (item) loop over a 1-D grid, no local memory,
    and the registers the assumed CTAs an SM leave."""
    kw, (tv, st, tma) = PERSISTENT_VARIANTS[variant]
    p = _problem(**kw)
    cfg = sm90.Config(p, sm90.Tiles(tile_v=tv, num_stages=st, tma=tma, persistent=1))
    b = build(sm90.compile, cfg)
    ptx = b.ptx
    entries = re.findall(r"\.entry\s+(\S+)\(", ptx)
    assert len(entries) == 2 and "Persistent" in entries[1]
    prep, main = ptx.split(".entry")[1], ptx.split(".entry")[2]
    ab = "bf16" if p.dtype == "bfloat16" else "f16"
    K, C = p.head_dim_k, CHUNK
    n64 = len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.{ab}\.{ab}", main))
    nk = len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{K}k16\.f32\.{ab}\.{ab}", main))
    if K == 64:
        assert n64 == 2 * (K // 16) + 2 * (C // 16) and nk == n64
    else:
        assert n64 == 2 * (K // 16) + C // 16 and nk == C // 16
    assert sorted(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", main)) == ["0", "0", "1"]
    assert "%nctaid.x" in main and "%ctaid.y" not in main  # the walk reads the grid size; a 1-D grid
    assert ("cp.async.bulk.tensor" in main) == bool(tma)
    assert ".local" not in ptx
    res = cubin_kernel_resources(b.cubin)
    assert all(r["stack_bytes"] == 0 for r in res.values()), res
    main_res = [r for n, r in res.items() if "main" in n][0]
    threads = 128 * (1 + tv // 64)
    assert sm90.MAIN_MIN_REGS <= main_res["registers"] <= 65536 // threads
    assert main_res["registers"] * threads * cfg.main_ctas_per_sm <= 65536


def test_sm90_persistent_main_only_compiles():
    """The context-parallel path's main-only entry on a persistent grid: the main kernel alone, final states only."""
    cfg = sm90.Config(_problem(), sm90.Tiles(tile_v=64, persistent=1))
    ptx = build(sm90.compile_main, sm90.MainConfig(cfg, sm90.MainRun.STATE)).ptx
    entries = re.findall(r"\.entry\s+(\S+)\(", ptx)
    assert len(entries) == 1 and "main" in entries[0] and "PersistentMain" in entries[0]
    assert "%nctaid.x" in ptx and ".local" not in ptx


def test_prep_tiles_rules(monkeypatch):
    from cutedsl_attn.dispatch import gdn_choice
    from cutedsl_attn.sm90 import gdn_fused, kda_chunked as kda

    assert sm90.Tiles().prep == 0 and sm90.override_tiles(sm90.Tiles(), {"prep": "1"}).prep == 1
    with pytest.raises(ValueError, match="prep must be 0 or 1, got 2"):
        sm90.Tiles(prep=2)
    for bad in (True, 1.0, "1"):
        with pytest.raises(TypeError, match="prep"):
            sm90.Tiles(prep=bad)
    assert sm90.Config(_problem(), sm90.Tiles(prep=1)) != sm90.Config(_problem(), sm90.Tiles())  # compile key
    assert sm90.default_tiles(_problem(), num_sms=132, chains=1000).prep == 1  # the default: the wgmma prep
    assert sm90.default_tiles(_problem(), num_sms=132, chains=4).prep == 1
    assert sm90.GdnChunkedSm90Kernel(sm90.Config(_problem(), sm90.Tiles(prep=1))).use_prep_sm90
    assert not sm90.GdnChunkedSm90Kernel(sm90.Config(_problem(), sm90.Tiles())).use_prep_sm90
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_KERNEL", "chunked_sm90")
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_TUNE", "prep=0")  # the shared mma.sync prep, still selectable
    assert gdn_choice(_problem(), chains=1000)[1].tiles == sm90.Tiles(tile_v=128, prep=0)
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_TUNE", "prep=2")
    with pytest.raises(ValueError, match="CUTEDSL_ATTN_GDN_TUNE"):
        gdn_choice(_problem(), chains=1000)
    # the subclasses' Tiles have no prep field: their own prep
    kcfg = kda.Config(_problem(gate_per_channel=True, gate_domain="log"), kda.Tiles())
    assert not hasattr(kcfg.tiles, "prep") and not kda.KdaChunkedSm90Kernel(kcfg).use_prep_sm90
    assert "prep" not in gdn_fused.TUNING_FIELDS


def _prep_sm90_checks(prep, ab, K, V):
    """The SM90 prep's entry: its wgmma products (Q K^T, K K^T over K; W, U over the chunk), no mma.sync."""
    C = CHUNK
    assert "prep_sm90" in prep.split("(")[0]
    want = {"m64n64k16": 2 * (K // 16)}
    want[f"m64n{K}k16"] = want.get(f"m64n{K}k16", 0) + C // 16
    want[f"m64n{V}k16"] = want.get(f"m64n{V}k16", 0) + C // 16
    got = {}
    for m in re.findall(rf"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)\.f32\.{ab}\.{ab}", prep):
        got[m] = got.get(m, 0) + 1
    assert got == want, got
    assert "mma.sync" not in prep and "ldmatrix" not in prep


PREP_SM90_VARIANTS = {
    "k128_l2norm_128x2": (dict(use_qk_l2norm=True), (128, 2, 0, 0)),
    "k64_v128_fp16_log_64x3_tma": (dict(dtype="float16", head_dim_k=64, gate_domain="log"), (64, 3, 1, 0)),
    "k128_v64_64x2_persistent": (dict(head_dim_v=64), (64, 2, 0, 1)),
}


@pytest.mark.parametrize("variant", sorted(PREP_SM90_VARIANTS))
def test_sm90_kernel_prep_sm90_ptx_and_cubin(variant):
    """``prep = 1``: the prep entry is the SM90 prep on wgmma (no mma.sync); the main kernel's PTX is the one of
    the same tiles with ``prep = 0``; no local memory, no stack."""
    kw, (tv, st, tma, pers) = PREP_SM90_VARIANTS[variant]
    p = _problem(**kw)
    ab = "bf16" if p.dtype == "bfloat16" else "f16"
    texts = {}
    for prep_kind in (0, 1):
        cfg = sm90.Config(p, sm90.Tiles(tile_v=tv, num_stages=st, tma=tma, persistent=pers, prep=prep_kind))
        texts[prep_kind] = build(sm90.compile, cfg).ptx
    ptx = texts[1]
    assert re.search(r"\.target\s+sm_90a", ptx)
    entries = re.findall(r"\.entry\s+(\S+)\(", ptx)
    assert len(entries) == 2 and "prep_sm90" in entries[0] and "main" in entries[1]
    _prep_sm90_checks(ptx.split(".entry")[1], ab, p.head_dim_k, p.head_dim_v)
    # the main kernel unchanged by the prep's choice (up to the number of its dynamic shared memory symbol)
    main0, main1 = (re.sub(r"__dynamic_shmem__\d+", "__dynamic_shmem__", t.split(".entry")[2]) for t in (texts[0], ptx))
    assert "mma.sync" not in main1
    assert main1 == main0
    assert ".local" not in ptx
    res = cubin_kernel_resources(build(sm90.compile, cfg).cubin)  # (cfg: the prep = 1 build)
    assert len(res) == 2 and all(r["stack_bytes"] == 0 for r in res.values()), res


def test_sm90_prep_only_entry_honours_prep():
    """The context-parallel path's prep-only entry (:func:`compile_prep`) launches the prep ``Tiles.prep`` names."""
    p = _problem(use_qk_l2norm=True)
    for prep_kind in (0, 1):
        ptx = build(sm90.compile_prep, sm90.Config(p, sm90.Tiles(prep=prep_kind))).ptx
        entries = re.findall(r"\.entry\s+(\S+)\(", ptx)
        assert len(entries) == 1 and ".local" not in ptx
        if prep_kind:
            _prep_sm90_checks(ptx.split(".entry")[1], "bf16", 128, 128)
        else:
            assert "wgmma" not in ptx and "mma.sync.aligned.m16n8k16" in ptx
