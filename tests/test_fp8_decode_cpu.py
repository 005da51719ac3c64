"""fp8 e4m3 K/V caches in the paged decode kernel, on the CPU: the problem field and compile key, the
fragment lane mapping (emulated mma.m16n8k16), shared-memory bank arithmetic, the PTX and resources of
cross-compiled builds, and the oracle's dequantisation."""

import dataclasses
import math

import pytest
import torch
from _builds import build  # (tests/ is on sys.path)

from cutedsl_attn.compile.fake import decode_tensors
from cutedsl_attn.compile.keys import config_key
from cutedsl_attn.planning.decode import WORK_COLS, DecodeProblem
from cutedsl_attn.portable import paged_decode as pd
from cutedsl_attn import ref
from cutedsl_attn.ref.paged import dequantize_kv_cache, paged_kv_to_contiguous

FP8 = "float8_e4m3fn"


def _problem(**over):
    kw = dict(dtype="bfloat16", head_dim=128, page_size=16, group_size=4, kv_dtype=FP8)
    kw.update(over)
    return DecodeProblem(**kw)


# ----------------------------------------------------------------------------- problem and key
def test_kv_dtype_validation():
    assert DecodeProblem("bfloat16", 128, 16, 4).kv_dtype == ""
    assert not DecodeProblem("bfloat16", 128, 16, 4).kv_fp8
    assert _problem().kv_fp8
    # the query's dtype spelled out is the 16-bit cache: same problem, same key
    p = DecodeProblem("float16", 64, 1, 8, kv_dtype="float16")
    assert p == DecodeProblem("float16", 64, 1, 8) and p.kv_dtype == ""
    with pytest.raises(ValueError, match="kv_dtype"):
        _problem(kv_dtype="int8")
    with pytest.raises(ValueError, match="kv_dtype"):
        _problem(dtype="float16", kv_dtype="bfloat16")
    with pytest.raises(TypeError, match="kv_dtype"):
        _problem(kv_dtype=None)
    with pytest.raises(NotImplementedError, match="float8_e4m3fn"):
        _problem(kv_dtype="float8_e5m2")


def test_compile_key_differs():
    base = pd.Config(DecodeProblem("bfloat16", 128, 16, 4), pd.Tiles())
    fp8 = pd.Config(_problem(), pd.Tiles())
    assert config_key(base) != config_key(fp8)
    assert "kv_dtype=''" in config_key(base) and f"kv_dtype='{FP8}'" in config_key(fp8)
    assert config_key(pd.Config(dataclasses.replace(_problem(), kv_dtype=""), pd.Tiles())) == config_key(base)


def test_unsupported_and_config():
    assert pd.unsupported_reason(_problem()) is None
    assert pd.unsupported_reason(_problem(pos_encoding_mode="ALIBI")) is None
    why = pd.unsupported_reason(_problem(pos_encoding_mode="ROPE_LLAMA"))
    assert "ROPE_LLAMA" in why and "fp8" in why
    with pytest.raises(ValueError, match="ROPE_LLAMA"):
        pd.Config(_problem(pos_encoding_mode="ROPE_LLAMA"), pd.Tiles())
    for d in (32, 64, 128, 256):
        cfg = pd.Config(_problem(head_dim=d), pd.Tiles())
        assert cfg.row_bytes == d + 16 and cfg.q_row_bytes == 2 * d + 16
        assert cfg.smem_q_bytes == 16 * (2 * d + 16)
        assert cfg.kv_cutlass_dtype.__name__ == "Float8E4M3FN" and cfg.mma_dtype.__name__ == "Float16"
        base = pd.Config(DecodeProblem("bfloat16", d, 16, 4), pd.Tiles())
        assert base.row_bytes == base.q_row_bytes == 2 * d + 16 and base.mma_dtype.__name__ == "BFloat16"
    # fp8 tiles (measured): 2 stages unsplit, 3 split (and at head_dim 256); the 16-bit defaults are unchanged
    assert pd.default_tiles(_problem(), num_sms=132) == pd.Tiles(4, 2)
    assert pd.default_tiles(_problem(), num_sms=132, split=True) == pd.Tiles(8, 3)
    assert pd.default_tiles(_problem(head_dim=256), num_sms=132) == pd.Tiles(4, 3)
    assert pd.default_tiles(DecodeProblem("bfloat16", 128, 16, 4), num_sms=132) == pd.Tiles(4, 3)
    for d in (64, 128, 256):
        for split in (False, True):
            pd.Config(_problem(head_dim=d), pd.default_tiles(_problem(head_dim=d), num_sms=132, split=split))


def test_fake_tensors_fp8():
    q, k, v = decode_tensors(pd.Config(_problem(), pd.Tiles()), WORK_COLS)[:3]
    assert q.element_type.__name__ == "BFloat16"
    assert k.element_type.__name__ == "Float8E4M3FN" and v.element_type.__name__ == "Float8E4M3FN"


# ----------------------------------------------------------------------------- lane mapping, emulated
def _mma(a_regs, b_regs):
    """m16n8k16 on per-lane registers (lists of 32 lanes; a register is a (lo, hi) pair of numbers), with the
    PTX ISA fragment layouts; returns C[16, 8]."""
    A = torch.zeros(16, 16, dtype=torch.float64)
    B = torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for r, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            A[row, col], A[row, col + 1] = a_regs[lane][r]
        for r, k0 in enumerate([2 * t, 2 * t + 8]):
            B[k0, g], B[k0 + 1, g] = b_regs[lane][r]
    return A @ B


def _word(row_vals, byte0):
    """The four elements a 32-bit load of an fp8 row returns from element ``byte0``."""
    return [row_vals[byte0 + i].item() for i in range(4)]


def _prmt(a, b, sel):
    src = a + b  # bytes 0-3: a, 4-7: b
    return [src[(sel >> (4 * i)) & 0xF] for i in range(4)]


@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_fragment_mapping_emulated(d):
    """The kernel's fp8 loads (module docstring) give S = Q K^T and, after the merge's column permutation,
    O = P V for one 16-token chunk."""
    gen = torch.Generator().manual_seed(d)
    Q = torch.randn(16, d, generator=gen, dtype=torch.float64)
    K = torch.randn(16, d, generator=gen, dtype=torch.float64)
    V = torch.randn(16, d, generator=gen, dtype=torch.float64)
    P = torch.rand(16, 16, generator=gen, dtype=torch.float64)
    # S: a = _q_frag_fp8, b = the 32-bit load of K row j*8+g at 16 kk + 4t
    S = torch.zeros(16, 16, dtype=torch.float64)
    for kk in range(d // 16):
        a = []
        for lane in range(32):
            g, t = lane // 4, lane % 4
            lo, hi = _word(Q[g], 16 * kk + 4 * t), _word(Q[g + 8], 16 * kk + 4 * t)
            a.append([(lo[0], lo[1]), (hi[0], hi[1]), (lo[2], lo[3]), (hi[2], hi[3])])
        for j in range(2):
            b = []
            for lane in range(32):
                g, t = lane // 4, lane % 4
                w = _word(K[j * 8 + g], 16 * kk + 4 * t)
                b.append([(w[0], w[1]), (w[2], w[3])])
            S[:, 8 * j: 8 * j + 8] += _mma(a, b)
    torch.testing.assert_close(S, Q @ K.T)
    # O: a = P (p_as_a_operand: natural layout), b from the prmt-paired V words; the merge writes tile dd,
    # column n (= 2t + e % 2) to d = 32 (dd // 4) + 4 n + dd % 4
    a = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        a.append([(P[g, 2 * t].item(), P[g, 2 * t + 1].item()), (P[g + 8, 2 * t].item(), P[g + 8, 2 * t + 1].item()),
                  (P[g, 2 * t + 8].item(), P[g, 2 * t + 9].item()),
                  (P[g + 8, 2 * t + 8].item(), P[g + 8, 2 * t + 9].item())])
    O = torch.full((16, d), float("nan"), dtype=torch.float64)
    for q4 in range(d // 32):
        b_tiles = {dd: [] for dd in range(4 * q4, 4 * q4 + 4)}
        for lane in range(32):
            g, t = lane // 4, lane % 4
            w0, w1, w8, w9 = (_word(V[r], 32 * q4 + 4 * g) for r in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9))
            for h, sel in enumerate((0x5140, 0x7362)):
                x01, x89 = _prmt(w0, w1, sel), _prmt(w8, w9, sel)
                for i in range(2):
                    b_tiles[4 * q4 + 2 * h + i].append([(x01[2 * i], x01[2 * i + 1]), (x89[2 * i], x89[2 * i + 1])])
        for dd, b in b_tiles.items():
            C = _mma(a, b)
            for n in range(8):
                O[:, 32 * (dd // 4) + 4 * n + dd % 4] = C[:, n]
    torch.testing.assert_close(O, P @ V)


@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_fp8_shared_loads_conflict_free(d):
    """The K loads (8 rows x 16 bytes) and each V load (rows 2t (+1, +8, +9), 32 bytes each) of a warp touch
    32 distinct 4-byte banks with the kernel's row pitch."""
    rb = pd.Config(_problem(head_dim=d), pd.Tiles()).row_bytes
    for kk in range(d // 16):
        banks = {((lane // 4) * rb + kk * 16 + 4 * (lane % 4)) // 4 % 32 for lane in range(32)}
        assert len(banks) == 32, (d, kk)
    for q4 in range(d // 32):
        for r in (0, 1, 8, 9):
            banks = {((2 * (lane % 4) + r) * rb + 32 * q4 + 4 * (lane // 4)) // 4 % 32 for lane in range(32)}
            assert len(banks) == 32, (d, q4, r)


# ----------------------------------------------------------------------------- PTX and resources
def _build(problem, tiles):
    """(PTX, cubin) of one config (one compile per Config in the session: :func:`_builds.build`)."""
    b = build(pd.compile, pd.Config(problem, tiles))
    return b.ptx, b.cubin


@pytest.mark.parametrize("arch,dtype,d,split", [("sm_90a", "bfloat16", 128, False), ("sm_90a", "bfloat16", 128, True),
                                                ("sm_100a", "float16", 128, True), ("sm_90a", "float16", 256, False),
                                                ("sm_100a", "bfloat16", 64, False)])
def test_fp8_ptx_and_resources(arch, dtype, d, split):
    from cutedsl_attn.inspect import cubin_resources

    problem = _problem(arch=arch, dtype=dtype, head_dim=d, group_size=8, use_sinks=True)
    ptx, cubin = _build(problem, pd.default_tiles(problem, num_sms=132, split=split))
    assert f".target {arch}" in ptx
    assert "cvt.rn.f16x2.e4m3x2" in ptx
    assert "ldmatrix" not in ptx  # Q, K and V fragments all come from ld.shared of the permuted layouts
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx and ".bf16.bf16" not in ptx
    # one MMA per (k block, n8 tile) of S and per n8 tile of O, in the main loop
    assert ptx.count("mma.sync.aligned.m16n8k16") == (d // 16) * 2 + d // 8
    assert ("shl.b32 l" in ptx) == (dtype == "bfloat16")  # bf16 q converted to f16 once
    res = cubin_resources(cubin)
    assert res["stack_bytes"] == 0, res
    assert res["registers"] <= 255


def test_16bit_ptx_keeps_ldmatrix():
    ptx, _ = _build(DecodeProblem("bfloat16", 128, 16, 4), pd.Tiles())
    assert "ldmatrix" in ptx and "e4m3" not in ptx and ".bf16.bf16" in ptx


# ----------------------------------------------------------------------------- oracle
def test_dequantize_kv_cache():
    x = torch.randn(5, 16, 2, 64).to(torch.float8_e4m3fn)
    y = dequantize_kv_cache(x, 0.37)
    assert y.dtype == torch.float64 and y.shape == x.shape
    torch.testing.assert_close(y, x.to(torch.float64) * 0.37, rtol=0, atol=0)
    assert dequantize_kv_cache(x, torch.tensor([2.0])).equal(x.double() * 2)
    assert dequantize_kv_cache(x, 1, dtype=torch.float32).dtype == torch.float32
    with pytest.raises(TypeError, match="scale"):
        dequantize_kv_cache(x, "1")
    with pytest.raises(TypeError, match="scale"):
        dequantize_kv_cache(x, torch.ones(2))
    with pytest.raises(ValueError, match="finite"):
        dequantize_kv_cache(x, math.inf)
    with pytest.raises(TypeError, match="cache"):
        dequantize_kv_cache(torch.zeros(3, dtype=torch.int32))


def test_oracle_fp8_decode_matches_float64_math():
    """ref.paged_decode on the dequantised fp8 cache = float64 attention written out by hand with FlashInfer's
    scale algebra (k_scale in the logits, v_scale on the output); NaN in unused slots never reaches it."""
    gen = torch.Generator().manual_seed(0)
    ps, hkv, group, d = 16, 2, 4, 64
    hq = hkv * group
    lens = [1, 37, 16]
    npg = [-(-L // ps) for L in lens]
    total = sum(npg) + 2
    perm = torch.randperm(total, generator=gen)
    indices = perm[: sum(npg)].to(torch.int32)
    indptr = torch.tensor([0] + torch.tensor(npg).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([L - (n - 1) * ps for L, n in zip(lens, npg)], dtype=torch.int32)
    k8 = (torch.randn(total, ps, hkv, d, generator=gen) * 2).to(torch.float8_e4m3fn)
    v8 = (torch.randn(total, ps, hkv, d, generator=gen) * 2).to(torch.float8_e4m3fn)
    nan8 = torch.tensor(float("nan")).to(torch.float8_e4m3fn)
    k8[perm[sum(npg):]] = nan8  # spare pages
    v8[perm[sum(npg):]] = nan8
    for b, L in enumerate(lens):  # unused slots of each last page
        pg = int(indices[indptr[b + 1] - 1])
        k8[pg, int(last[b]):] = nan8
        v8[pg, int(last[b]):] = nan8
    q = torch.randn(len(lens), hq, d, generator=gen).to(torch.bfloat16)
    k_scale, v_scale, sm_scale = 0.7, 1.9, 1 / math.sqrt(d)
    o, lse = ref.paged_decode(q, dequantize_kv_cache(k8, k_scale), dequantize_kv_cache(v8, v_scale), indptr,
                              indices, last, sm_scale=sm_scale)
    ks, vs = paged_kv_to_contiguous(k8, v8, indptr, indices, last, k_scale=k_scale, v_scale=v_scale)
    assert ks[1].dtype == torch.float64 and not any(torch.isnan(x).any() for x in ks + vs)
    for b, L in enumerate(lens):
        kb = ks[b].repeat_interleave(group, dim=1)  # [L, Hq, d]
        vb = vs[b].repeat_interleave(group, dim=1)
        # the same numbers from the raw fp8 values and the fused scales of the kernel's arguments
        kr = torch.stack([k8[int(indices[indptr[b] + t // ps]), t % ps] for t in range(L)]).double()
        vr = torch.stack([v8[int(indices[indptr[b] + t // ps]), t % ps] for t in range(L)]).double()
        s = torch.einsum("hd,jhd->hj", q[b].double(), kr.repeat_interleave(group, dim=1)) * (sm_scale * k_scale)
        p = torch.softmax(s, dim=-1)
        o_hand = torch.einsum("hj,jhd->hd", p, vr.repeat_interleave(group, dim=1)) * v_scale
        torch.testing.assert_close(o[b], o_hand, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[b], torch.logsumexp(s, -1) / math.log(2), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(kb, kr.repeat_interleave(group, dim=1) * k_scale, rtol=0, atol=0)
        torch.testing.assert_close(vb, vr.repeat_interleave(group, dim=1) * v_scale, rtol=0, atol=0)
    # without scales the gather keeps the cache's dtype (existing behaviour)
    ks0, _ = paged_kv_to_contiguous(k8, v8, indptr, indices, last)
    assert ks0[0].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("ctas", [5, 6])
def test_min_ctas_per_sm_caps_registers(ctas):
    """``Tiles.min_ctas_per_sm``: the kernel carries ``.minnctapersm`` and ptxas fits that many CTAs of its
    threads in the SM's 64K registers (spilling if it must: a tuning experiment, timed by
    ``perf/bench_fp8_decode.py``); the default tiles carry no such hint."""
    from cutedsl_attn.inspect import cubin_resources

    problem = _problem(arch="sm_90a", dtype="bfloat16", head_dim=128, group_size=8)
    base = pd.default_tiles(problem, num_sms=132, split=False)
    ptx0, _ = _build(problem, base)
    assert ".minnctapersm" not in ptx0
    tiles = dataclasses.replace(base, min_ctas_per_sm=ctas)
    ptx, cubin = _build(problem, tiles)
    assert f".minnctapersm {ctas}" in ptx
    res = cubin_resources(cubin)
    threads = 32 * tiles.num_warps
    assert res["registers"] * threads * ctas <= 65536, res


def test_min_ctas_per_sm_validation():
    with pytest.raises(ValueError, match="min_ctas_per_sm"):
        pd.Tiles(min_ctas_per_sm=33)
    assert pd.override_tiles(pd.Tiles(), {"min_ctas_per_sm": "5"}).min_ctas_per_sm == 5
    assert "min_ctas_per_sm" in pd.TUNING_FIELDS
