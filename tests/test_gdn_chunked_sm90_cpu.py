"""CPU tests of the SM90 chunked GDN kernel: its contract, the dispatch opt-in and its PTX / cubin (cross-compiled
for sm_90a; the kernel needs an H200 to run)."""

import glob
import re

import pytest

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
    assert sm90.TUNING_FIELDS == ("tile_v", "num_stages", "tma")
    assert sm90.Tiles().tma == 0 and sm90.override_tiles(sm90.Tiles(), {"tma": "1"}).tma == 1
    with pytest.raises(ValueError, match="tma"):
        sm90.Tiles(tma=2)
    with pytest.raises(TypeError):
        sm90.Tiles(tma=True)
    assert sm90.Config(_problem(), sm90.Tiles(tma=1)) != sm90.Config(_problem(), sm90.Tiles())  # compile key
    assert sm90.default_tiles(_problem(), num_sms=132, chains=256) == sm90.Tiles(tile_v=128)
    assert sm90.default_tiles(_problem(), num_sms=132, chains=8) == sm90.Tiles(tile_v=64)
    for chains, tv in ((128, 128), (99, 128), (98, 64), (32, 64)):  # 128 rows from 3/4 of a wave of chains
        assert sm90.default_tiles(_problem(), num_sms=132, chains=chains) == sm90.Tiles(tile_v=tv), chains
    assert sm90.default_tiles(_problem(head_dim_v=64), num_sms=132) == sm90.Tiles(tile_v=64)
    assert sm90.default_tiles(_problem(head_dim_k=64), num_sms=132) == sm90.Tiles(tile_v=64)
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
    assert module is sm90 and isinstance(cfg, sm90.Config) and cfg.tiles == sm90.Tiles(tile_v=128)
    assert gdn_choice(p, chains=4)[1].tiles.tile_v == 64
    assert gdn_choice(_problem(decode=True))[0].NAME == "gdn_recurrent"  # outside its family: automatic
    with pytest.raises(NotImplementedError, match="sm_90a only.*portable chunked kernel"):
        gdn_choice(_problem(arch="sm_100a"))
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_TUNE", "tile_v=64,num_stages=3")
    assert gdn_choice(p)[1].tiles == sm90.Tiles(tile_v=64, num_stages=3)
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_TUNE", "tma=1")
    assert gdn_choice(p, chains=1000)[1].tiles == sm90.Tiles(tile_v=128, tma=1)
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_TUNE", "num_warps=8")
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
def test_sm90_kernel_ptx_and_cubin(tmp_path, variant):
    kw, (tv, st) = VARIANTS[variant]
    p = _problem(**kw)
    cfg = sm90.Config(p, sm90.Tiles(tile_v=tv, num_stages=st))
    sm90.compile(cfg, keep_ptx_dir=str(tmp_path), keep_cubin=True)
    (path,) = glob.glob(str(tmp_path / "*.ptx"))
    ptx = open(path).read()
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
    assert "wgmma" not in prep and "mma.sync.aligned.m16n8k16" in prep  # the shared prep kernel unchanged
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
    (cub,) = glob.glob(str(tmp_path / "*.cubin"))
    res = cubin_kernel_resources(open(cub, "rb").read())
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
def test_sm90_kernel_tma_ptx_and_cubin(tmp_path, variant):
    """``tma = 1``: W / Aqk and full chunks' q / k rows as TMA boxes on an expect-tx mbarrier; the tail chunk's
    q / k rows, U and the row factors stay cp.async."""
    kw, (tv, st) = TMA_VARIANTS[variant]
    p = _problem(**kw)
    cfg = sm90.Config(p, sm90.Tiles(tile_v=tv, num_stages=st, tma=1))
    sm90.compile(cfg, keep_ptx_dir=str(tmp_path), keep_cubin=True)
    (path,) = glob.glob(str(tmp_path / "*.ptx"))
    ptx = open(path).read()
    prep, main = ptx.split(".entry")[1], ptx.split(".entry")[2]
    assert "cp.async.bulk.tensor" not in prep
    # one box per 128-byte swizzle span (64 columns): W and q / k K / 64 each, Aqk one
    boxes = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global\.tile\.mbarrier::complete_tx", main)
    assert len(boxes) == 3 * (p.head_dim_k // 64) + 1, boxes
    assert "mbarrier.arrive.expect_tx" in main
    assert "cp.async.cg.shared.global" in main and "cp.async.mbarrier.arrive.noinc" in main  # tail rows, U, F
    assert ".local" not in ptx
    assert ("setmaxnreg.dec" in main and "setmaxnreg.inc" in main) == (tv == 128)
    (cub,) = glob.glob(str(tmp_path / "*.cubin"))
    res = cubin_kernel_resources(open(cub, "rb").read())
    for name, r in res.items():
        assert r["stack_bytes"] == 0, (name, r)
    main_res = [r for n, r in res.items() if "main" in n][0]
    assert main_res["registers"] <= 65536 // (128 * (1 + tv // 64))  # launchable before setmaxnreg
