"""CPU tests of the chunked KDA / GDN-2 kernel: its float32 chunked reference (the kernel's algorithm, sub-chunk
references and operand roundings) against the float64 oracles, its contract, and its PTX (cross-compiled)."""

import glob
import math
import re

import pytest
import torch

from cutedsl_attn.compile.cubin import cubin_kernel_resources
from cutedsl_attn.planning.gdn import CHUNK, GdnProblem
from cutedsl_attn.ref import delta_family as rd
from cutedsl_attn.ref import kda_chunked as rk

LENS = [0, 1, 15, 16, 17, 63, 64, 65, 200]
# per-token natural-log decay magnitudes: mild (the factored diagonal path), strong (spans past the limit: the
# direct diagonal blocks), far below fp32's exponent range, and -inf sprinkled in
GATES = ["mild", "strong", "huge", "inf"]


def _rel(x, y):
    x, y = x.double(), y.double()
    assert torch.isfinite(x).all(), "non-finite values"
    return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()


def _gates(kind, shape, gen):
    u = torch.rand(shape, generator=gen)
    if kind == "mild":
        return -u * 0.5
    if kind == "strong":
        return -u * 30.0
    if kind == "huge":
        return -u * 1e4
    g = -u * 2.0
    g[torch.rand(shape, generator=gen) < 0.1] = -math.inf
    return g


def _inputs(lens, H, HV, K, V, dtype, gen):
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(T, H, K, generator=gen).to(dtype)
    k = torch.randn(T, H, K, generator=gen).to(dtype)
    v = torch.randn(T, HV, V, generator=gen).to(dtype)
    h0 = torch.randn(len(lens), HV, V, K, generator=gen) * 0.3
    return T, cu, q, k, v, h0


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("mode", ["kda", "gdn2"])
def test_chunked_reference_matches_the_oracle(mode, gate):
    gen = torch.Generator().manual_seed(hash((mode, gate)) % 1000)
    H, HV, K, V = 1, 2, 64, 64
    T, cu, q, k, v, h0 = _inputs(LENS, H, HV, K, V, torch.bfloat16, gen)
    g = _gates(gate, (T, HV, K), gen)
    if mode == "kda":
        beta = torch.rand(T, HV, generator=gen)
        o, s = rk.kda_chunked(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, use_qk_l2norm=True)
        ro, rs = rd.recurrent_kda(q, k, v, g, beta, initial_state=h0.double().clone(), output_final_state=True,
                                  cu_seqlens=cu)
    else:
        b, w = torch.rand(T, HV, K, generator=gen), torch.rand(T, HV, V, generator=gen) + 0.5
        o, s = rk.kda_chunked(q, k, v, g, b, w=w, erase_write=True, initial_state=h0, cu_seqlens=cu,
                              use_qk_l2norm=True)
        ro, rs = rd.chunk_gated_delta_rule2(q, k, v, g, b, w, initial_state=h0, output_final_state=True,
                                            cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    assert _rel(o, ro) < 1e-2 and _rel(s, rs) < 5e-3
    # the zero-length sequence keeps its initial state
    assert torch.equal(s[0], h0[0])


def test_chunked_reference_fp16_gva_no_l2norm_bf16_state_k_ne_v():
    gen = torch.Generator().manual_seed(3)
    H, HV, K, V = 2, 4, 64, 128
    lens = [17, 130, 64]
    T, cu, q, k, v, h0 = _inputs(lens, H, HV, K, V, torch.float16, gen)
    k = (k.float() / k.float().norm(dim=-1, keepdim=True)).half()
    for gate in ("mild", "strong"):
        g = _gates(gate, (T, HV, K), gen)
        beta = torch.rand(T, HV, generator=gen)
        o, s = rk.kda_chunked(q, k, v, g, beta, initial_state=h0.bfloat16(), cu_seqlens=cu,
                              state_dtype=torch.bfloat16)
        ro, rs = rd.recurrent_kda(q, k, v, g, beta, initial_state=h0.bfloat16().double(), output_final_state=True,
                                  cu_seqlens=cu, use_qk_l2norm_in_kernel=False)
        assert _rel(o, ro) < 4e-3 and _rel(s, rs) < 1e-2  # fp16 io, bf16 state


def test_chunked_reference_zero_gate_is_ungated_and_defaults():
    gen = torch.Generator().manual_seed(5)
    T, cu, q, k, v, h0 = _inputs([65], 1, 1, 64, 64, torch.bfloat16, gen)
    b = torch.rand(T, 1, 64, generator=gen)
    o0, s0 = rk.kda_chunked(q, k, v, torch.zeros(T, 1, 64), b, erase_write=True, cu_seqlens=cu, use_qk_l2norm=True)
    o1, s1 = rk.kda_chunked(q, k, v, None, b, erase_write=True, cu_seqlens=cu, use_qk_l2norm=True)
    assert torch.equal(o0, o1) and torch.equal(s0, s1)
    with pytest.raises(ValueError, match="erase_write"):
        rk.kda_chunked(q, k, v, None, b, w=torch.ones(T, 1, 64))


def test_constants_match_the_kernel():
    from cutedsl_attn.common import kda_prep

    assert kda_prep.GATE_FLOOR_LOG2 == rk.GATE_FLOOR_LOG2 and kda_prep.SUB == rk.SUB and rk.CHUNK == CHUNK
    assert kda_prep.DIAG_LIMIT == {"bfloat16": rk.diag_limit(torch.bfloat16), "float16": rk.diag_limit(torch.float16)}
    assert kda_prep.IO_MAX == {"bfloat16": rk._IO_MAX[torch.bfloat16], "float16": rk._IO_MAX[torch.float16]}


chk = pytest.importorskip("cutedsl_attn.portable.kda_chunked")


def _problem(**kw):
    return GdnProblem(**{**dict(dtype="bfloat16", head_dim_k=128, head_dim_v=128, gate_domain="log",
                                gate_per_channel=True), **kw})


def test_unsupported_and_config_rules():
    assert chk.unsupported_reason(_problem()) is None
    assert chk.unsupported_reason(_problem(erase_write_gates=True, head_dim_k=64)) is None
    for kw, word in ((dict(decode=True), "decode"), (dict(state_k_major=True), "V-major"),
                     (dict(gate_per_channel=False), "per-channel"), (dict(gate_domain="linear"), "log")):
        assert word in chk.unsupported_reason(_problem(**kw))
    with pytest.raises(TypeError):
        chk.unsupported_reason("kda")
    with pytest.raises(ValueError, match="cannot serve"):
        chk.Config(_problem(decode=True), chk.Tiles())
    with pytest.raises(TypeError):
        chk.Config(_problem(), "tiles")
    # the compact prep layout for bf16 KDA, the two-CTA one for GDN-2 (no room for the erase gates) and fp16
    assert chk.default_tiles(_problem(), num_sms=132, chains=128) == chk.Tiles(tile_v=64, num_warps=4, prep_ctas=3)
    for p in (_problem(erase_write_gates=True), _problem(dtype="float16")):
        assert chk.default_tiles(p, num_sms=132, chains=128) == chk.Tiles(tile_v=64, num_warps=4, prep_ctas=2)
    assert chk.TUNING_FIELDS == ("tile_v", "num_warps", "prep_ctas", "prep_rolled")
    assert (chk.Tiles(64, 4).prep_ctas, chk.Tiles(64, 4).prep_rolled) == (2, 1)
    with pytest.raises(ValueError, match="prep_rolled"):
        chk.Tiles(prep_rolled=3)
    with pytest.raises(ValueError, match="prep_ctas 3"):
        chk.Config(_problem(erase_write_gates=True), chk.Tiles(prep_ctas=3))
    with pytest.raises(ValueError):
        chk.Tiles(prep_ctas=1)
    # the compact layout: three CTAs an SM at K = V = 128 (228 KiB an SM, 1 KiB reserved a CTA)
    assert 3 * (chk.Config(_problem(), chk.Tiles(prep_ctas=3)).prep_smem_bytes + 1024) <= 228 * 1024
    for p in (_problem(), _problem(head_dim_k=64, erase_write_gates=True)):
        cfg = chk.Config(p, chk.Tiles())
        assert cfg.main_smem_bytes <= 227 * 1024 and cfg.prep_smem_bytes <= 227 * 1024


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("variant", ["kda_d128_l2norm_64x4", "gdn2_d128_32x8_bf16state", "kda_k64_v128_fp16_64x8",
                                     "kda_d128_l2norm_64x4_prep3"])
def test_kernel_ptx(tmp_path, arch, variant):
    if variant == "kda_d128_l2norm_64x4":
        p, t = _problem(use_qk_l2norm=True, arch=arch), chk.Tiles(64, 4)
    elif variant == "kda_d128_l2norm_64x4_prep3":
        p, t = _problem(use_qk_l2norm=True, arch=arch), chk.Tiles(64, 4, prep_ctas=3)
    elif variant == "gdn2_d128_32x8_bf16state":
        p, t = _problem(state_dtype="bfloat16", erase_write_gates=True, use_qk_l2norm=True, arch=arch), \
            chk.Tiles(32, 8)
    else:
        p, t = _problem(dtype="float16", head_dim_k=64, arch=arch), chk.Tiles(64, 8)
    chk.compile(chk.Config(p, t), keep_ptx_dir=str(tmp_path), keep_cubin=True)
    (path,) = glob.glob(str(tmp_path / "*.ptx"))
    ptx = open(path).read()
    assert re.search(rf"\.target\s+{arch}", ptx)
    entries = re.findall(r"\.entry\s+(\S+)\(", ptx)
    assert len(entries) == 2 and "prep" in entries[0] and "main" in entries[1]
    prep, main = ptx.split(".entry")[1], ptx.split(".entry")[2]
    ab = "bf16" if p.dtype == "bfloat16" else "f16"
    K, V, C = p.head_dim_k, p.head_dim_v, CHUNK
    n_mma = lambda s: len(re.findall(rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{ab}\.{ab}\.f32", s))
    # prep: e / q rows against four 16-column blocks (two n8 tiles each, over K), then T W and T U (over C)
    assert n_mma(prep) == 4 * 2 * 2 * (K // 16) + (K // 8 + V // 8) * (C // 16)
    cb = t.tile_v // (t.num_warps // 4)
    ns = K // (t.num_warps // (t.tile_v // 16))
    assert n_mma(main) == 2 * (cb // 8) * (K // 16) + (cb // 8) * (C // 16) + (ns // 8) * (C // 16)
    assert "cp.async.cg.shared.global" in prep and "cp.async.cg.shared.global" in main
    assert "ldmatrix.sync.aligned.m8n8.x4.trans" in main
    assert "vote.sync.any" in prep  # the warp-uniform choice of the direct diagonal block
    assert ".local" not in ptx  # accumulators, the row fragments and the state slice stay in registers
    assert "rsqrt.approx" in prep if p.use_qk_l2norm else "rsqrt.approx" not in prep
    # the diagonal block's bounds as running maxima (max.f32, not a compare-and-select chain); T by 16 x 16
    # blocks (a warp sync in the diagonal step, whose blocks are one warp's lanes each; then the merge phases'
    # CTA barriers; no partial named barrier, which racecheck miscounted)
    assert "max.f32" in prep and "abs.f32" in prep
    assert "bar.warp.sync" in prep and not re.search(r"bar(rier)?\.sync(\.aligned)?\s+1,", prep)
    assert len(re.findall(r"bar\.sync|barrier\.sync", prep)) >= 12
    (cub,) = glob.glob(str(tmp_path / "*.cubin"))
    res = cubin_kernel_resources(open(cub, "rb").read())
    assert len(res) == 2 and all(r["stack_bytes"] == 0 for r in res.values()), res  # ptxas spilled nothing
    prep_regs = [r["registers"] for n, r in res.items() if "prep" in n][0]
    # the layout's prep CTAs an SM, by shared memory and by registers (65536 an SM, 128 threads a CTA)
    ctas = t.prep_ctas
    assert ctas * (chk.Config(p, t).prep_smem_bytes + 1024) <= 228 * 1024 and ctas * 128 * prep_regs <= 65536
    assert bool(re.search(r"\.minnctapersm\s+3", prep)) == (ctas == 3)


def test_launch_tensors_shapes_and_argument_checks():
    from cutedsl_attn.planning.gdn import FLAG_HAS_BETA, FLAG_HAS_G, GdnArgs

    T, H, HO, K, V = 130, 2, 4, 128, 64
    lens = [0, 65, 65]
    cu = torch.tensor([0, 0, 65, 130], dtype=torch.int32)
    q = torch.zeros(T, H, K, dtype=torch.bfloat16)
    v = torch.zeros(T, HO, V, dtype=torch.bfloat16)
    out = torch.empty(T, HO, V, dtype=torch.bfloat16)
    d = torch.empty(1)

    def args(g, beta):
        return GdnArgs(q, q, v, g, beta, cu, d, d, d, d, out, 1.0, 2, 2, 1, FLAG_HAS_G | FLAG_HAS_BETA)

    for ew in (False, True):
        cfg = chk.Config(_problem(head_dim_v=V, erase_write_gates=ew), chk.Tiles())
        beta = torch.zeros(T, HO, K + V) if ew else torch.zeros(T, HO)
        chunks, off, qg, kd, w, u, aqk, f = chk.launch_tensors(args(torch.zeros(T, HO, K), beta), cfg)
        nc = T // CHUNK + len(lens)
        assert chunks.shape == (nc, 4) and off.tolist() == [0, 0, 2, 4]
        assert qg.shape == kd.shape == (T, HO, K) and qg.dtype == torch.bfloat16
        assert w.shape == (nc, HO, CHUNK, K) and u.shape == (nc, HO, CHUNK, V) and aqk.shape == (nc, HO, CHUNK, CHUNK)
        assert f.shape == (nc, HO, 2 * CHUNK + K) and f.dtype == torch.float32
        with pytest.raises(ValueError, match="g must be"):
            chk.launch_tensors(args(torch.zeros(T, HO), beta), cfg)
        with pytest.raises(ValueError, match="beta must be"):
            chk.launch_tensors(args(torch.zeros(T, HO, K), torch.zeros(T, HO, K)), cfg)
