"""CPU tests of the chunked GDN kernel: its contract, the chunk plan, dispatch and its PTX (cross-compiled)."""

import glob
import re

import pytest
import torch

from cutedsl_attn.planning.gdn import CHUNK, GdnProblem, plan_chunks

chk = pytest.importorskip("cutedsl_attn.portable.gdn_chunked")


def _problem(**kw):
    return GdnProblem(**{**dict(dtype="bfloat16", head_dim_k=128, head_dim_v=128), **kw})


def test_plan_chunks_matches_a_python_loop():
    g = torch.Generator().manual_seed(0)
    for lens in ([0, 1, 63, 64, 65, 4097], [5], [0, 0, 0], [128, 0, 1, 200] * 3):
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        T = int(cu[-1])
        chunks, off = plan_chunks(cu, T)
        want = []
        for n, ln in enumerate(lens):
            for j in range((ln + CHUNK - 1) // CHUNK):
                t0 = int(cu[n]) + j * CHUNK
                want.append((n, t0, min(CHUNK, int(cu[n + 1]) - t0)))
        assert chunks.dtype == torch.int32 and off.dtype == torch.int32
        assert chunks.shape == (T // CHUNK + len(lens), 4)  # the bound is known from shapes only
        assert off.tolist() == [0] + torch.tensor([(x + CHUNK - 1) // CHUNK for x in lens]).cumsum(0).tolist()
        real = [tuple(r[:3]) for r in chunks.tolist()[:len(want)]]
        assert real == want
        assert all(r[2] == 0 for r in chunks.tolist()[len(want):])  # spare rows: no tokens (their CTAs exit)
    del g


def test_unsupported_and_config_rules():
    assert chk.unsupported_reason(_problem()) is None
    assert chk.unsupported_reason(_problem(head_dim_k=64, head_dim_v=128, use_qk_l2norm=True)) is None
    for kw, word in ((dict(decode=True), "decode"), (dict(state_k_major=True), "V-major"),
                     (dict(gate_per_channel=True), "GDN"), (dict(num_householder=2), "GDN")):
        assert word in chk.unsupported_reason(_problem(**kw))
    with pytest.raises(TypeError):
        chk.unsupported_reason("gdn")
    with pytest.raises(ValueError, match="cannot serve"):
        chk.Config(_problem(decode=True), chk.Tiles())
    with pytest.raises(ValueError, match="tile_v"):
        chk.Tiles(tile_v=16)
    with pytest.raises(ValueError, match="num_warps"):
        chk.Tiles(num_warps=2)
    with pytest.raises(TypeError):
        chk.Tiles(tile_v=64.0)
    assert chk.override_tiles(chk.Tiles(), {"tile_v": "32"}).tile_v == 32
    # wide tiles when the chains fill the GPU, narrow and more warps for one long sequence
    assert chk.default_tiles(_problem(), num_sms=132, chains=128) == chk.Tiles(tile_v=64, num_warps=4)
    assert chk.default_tiles(_problem(), num_sms=132, chains=8) == chk.Tiles(tile_v=32, num_warps=8)
    cfg = chk.Config(_problem(), chk.Tiles())
    assert cfg.main_smem_bytes <= 227 * 1024 and cfg.prep_smem_bytes <= 113 * 1024  # 2 prep CTAs an SM


def test_dispatch_env(monkeypatch):
    from cutedsl_attn.dispatch import gdn_choice
    from cutedsl_attn.portable import gdn_recurrent as rec

    assert gdn_choice(_problem())[0].NAME == "gdn_chunked_sm90"  # sm_90a: the wgmma main kernel
    p = _problem(arch="sm_100a")
    assert gdn_choice(p)[0] is chk
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_KERNEL", "recurrent")
    assert gdn_choice(p)[0] is rec
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_KERNEL", "chunked")
    assert gdn_choice(_problem(decode=True))[0] is rec  # outside the chunked kernel's family: automatic
    assert gdn_choice(_problem(gate_per_channel=True, gate_domain="log"))[0].NAME == "kda_chunked_sm90"
    assert gdn_choice(_problem(gate_per_channel=True, gate_domain="log", arch="sm_100a"))[0].NAME == "kda_chunked"
    with pytest.raises(NotImplementedError, match="V-major"):
        gdn_choice(_problem(state_k_major=True))
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_KERNEL", "fast")
    with pytest.raises(ValueError, match="CUTEDSL_ATTN_GDN_KERNEL"):
        gdn_choice(p)
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_KERNEL", "auto")
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_TUNE", "tile_v=32,num_warps=8")
    assert gdn_choice(p, chains=1000)[1].tiles == chk.Tiles(tile_v=32, num_warps=8)
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_TUNE", "tile_v=48")
    with pytest.raises(ValueError, match="CUTEDSL_ATTN_GDN_TUNE"):
        gdn_choice(p)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("variant", ["d128_l2norm_64x4", "d128_32x8_bf16state_log", "k64_v128_fp16_64x8"])
def test_chunked_kernel_ptx(tmp_path, arch, variant):
    if variant == "d128_l2norm_64x4":
        p, t = _problem(use_qk_l2norm=True, arch=arch), chk.Tiles(64, 4)
    elif variant == "d128_32x8_bf16state_log":
        p, t = _problem(state_dtype="bfloat16", gate_domain="log", arch=arch), chk.Tiles(32, 8)
    else:
        p, t = _problem(dtype="float16", head_dim_k=64, arch=arch), chk.Tiles(64, 8)
    cfg = chk.Config(p, t)
    chk.compile(cfg, keep_ptx_dir=str(tmp_path))
    (path,) = glob.glob(str(tmp_path / "*.ptx"))
    ptx = open(path).read()
    assert re.search(rf"\.target\s+{arch}", ptx)
    entries = re.findall(r"\.entry\s+(\S+)\(", ptx)
    assert len(entries) == 2 and "prep" in entries[0] and "main" in entries[1]  # one function, two kernels
    prep, main = ptx.split(".entry")[1], ptx.split(".entry")[2]
    ab = "bf16" if p.dtype == "bfloat16" else "f16"
    K, V, C = p.head_dim_k, p.head_dim_v, CHUNK
    n_mma = lambda s: len(re.findall(rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{ab}\.{ab}\.f32", s))
    # prep, a 16-row slab a warp: K K^T and Q K^T (C columns over K), then T W and T U (over C)
    assert n_mma(prep) == 2 * (C // 8) * (K // 16) + (K // 8 + V // 8) * (C // 16)
    # main, per warp: W S^T and Q S^T, Aqk V', then the state update
    cb = t.tile_v // (t.num_warps // 4)
    ns = K // (t.num_warps // (t.tile_v // 16))
    assert n_mma(main) == 2 * (cb // 8) * (K // 16) + (cb // 8) * (C // 16) + (ns // 8) * (C // 16)
    assert "cp.async.cg.shared.global" in main and "ldmatrix.sync.aligned.m8n8.x4.trans" in main
    assert ".local" not in ptx  # the state slice and T's column stay in registers
    assert "rsqrt.approx" in prep if p.use_qk_l2norm else "rsqrt.approx" not in prep
