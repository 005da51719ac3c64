"""fp8 e4m3 K/V caches for the decode entry points' requests of several query rows, on the CPU: the prefill problem's
``kv_dtype`` (validation, compile key, the kernel choice), the portable prefill kernel's fp8 build (shared memory,
fake tensors, the PTX of sm_90a / sm_100a cross-compiles), the entry points' scale algebra through the recorded
launches (trtllm ``q_len_per_req > 1``, xqa spec-decode, prims_ts in every query layout), and the float64 oracle
on the dequantised cache for the public trtllm sliding-window case (bf16 q, fp8 KV, q_len 8, window 1023)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from _builds import build  # (tests/ is on sys.path)

from cutedsl_attn import dispatch, ref
from cutedsl_attn.api.prefill_paged import BatchPrefillWithPagedKVCacheWrapper, MultiRowDecodePrefillWrapper
from cutedsl_attn.api.trtllm import trtllm_batch_decode_with_kv_cache, xqa
from cutedsl_attn.attention import prims_ts as ts
from cutedsl_attn.compile.fake import prefill_tensors
from cutedsl_attn.compile.keys import config_key
from cutedsl_attn.planning import prefill as pp
from cutedsl_attn.planning.prefill import PrefillProblem
from cutedsl_attn.portable import prefill as pf
from cutedsl_attn.ref.paged import dequantize_kv_cache
from cutedsl_attn.sm90 import prefill as sm90

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
E4M3 = "float8_e4m3fn"

pytestmark = pytest.mark.usefixtures("cross_compile_sm90")  # plans build for sm_90a (tests/conftest.py)


def _problem(**over):
    kw = dict(dtype="bfloat16", head_dim_qk=128, head_dim_vo=128, group_size=4, page_size=16, causal=True,
              kv_dtype=E4M3)
    kw.update(over)
    return PrefillProblem(**kw)


# ----------------------------------------------------------------------------- the problem and its key
def test_kv_dtype_validation():
    base = PrefillProblem("bfloat16", 128, 128, 4, page_size=16)
    assert base.kv_dtype == "" and not base.kv_fp8
    assert _problem().kv_fp8
    # the query's dtype spelled out is the 16-bit cache: the same problem, the same key
    assert PrefillProblem("float16", 64, 64, 8, page_size=1, kv_dtype="float16") == PrefillProblem(
        "float16", 64, 64, 8, page_size=1)
    with pytest.raises(ValueError, match="kv_dtype"):
        _problem(kv_dtype="int8")
    with pytest.raises(ValueError, match="kv_dtype"):
        _problem(dtype="float16", kv_dtype="bfloat16")
    with pytest.raises(TypeError, match="kv_dtype"):
        _problem(kv_dtype=None)
    with pytest.raises(NotImplementedError, match="float8_e4m3fn"):
        _problem(kv_dtype="float8_e5m2")
    with pytest.raises(NotImplementedError, match="paged"):
        _problem(page_size=0)  # ragged fp8 K/V is not served


def test_compile_key_carries_kv_dtype():
    tiles = pf.Tiles()
    base = pf.Config(dataclasses.replace(_problem(), kv_dtype=""), tiles)
    fp8 = pf.Config(_problem(), tiles)
    assert config_key(base) != config_key(fp8)
    assert "kv_dtype=''" in config_key(base) and f"kv_dtype='{E4M3}'" in config_key(fp8)
    # the custom-op key (KernelChoice.graph_key) and the memo of the choice see it too
    c8 = dispatch.prefill_choice(_problem(arch="sm_90a"))
    c16 = dispatch.prefill_choice(dataclasses.replace(_problem(arch="sm_90a"), kv_dtype=""))
    assert c8 != c16 and E4M3 in c8.graph_key and E4M3 not in c16.graph_key
    assert dispatch.prefill_problem(dtype=BF16, head_dim_qk=128, head_dim_vo=128, group_size=4, page_size=16,
                                    kv_dtype=FP8, arch="sm_90a").kv_dtype == E4M3
    assert dispatch.prefill_problem(dtype=BF16, head_dim_qk=128, head_dim_vo=128, group_size=4, page_size=16,
                                    kv_dtype=BF16, arch="sm_90a").kv_dtype == ""


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_fp8_runs_the_portable_kernel(arch):
    p = _problem(arch=arch)
    assert pf.unsupported_reason(p) is None
    assert "fp8" in sm90.unsupported_reason(_problem(arch="sm_90a"))
    assert dispatch.prefill_choice(p).name == pf.NAME
    assert dispatch.prefill_choice(p, kernel="sm90").name == pf.NAME  # never the SM90 kernel
    assert dispatch.prefill_choice(p, kernel="sm100").name == pf.NAME  # nor the tcgen05 one
    if arch == "sm_90a":  # the 16-bit twin keeps the SM90 kernel
        assert dispatch.prefill_choice(dataclasses.replace(p, kv_dtype="")).name == sm90.NAME


@pytest.mark.parametrize("d", [32, 64, 128, 256])
@pytest.mark.parametrize("num_warps", [4, 8])
def test_shared_memory_fits(d, num_warps):
    tiles = pf.Tiles(num_warps=num_warps)
    cfg = pf.Config(_problem(head_dim_qk=d, head_dim_vo=d), tiles)
    r16 = 2 * d + 16
    assert cfg.staging_row_bytes_qk == cfg.staging_row_bytes_vo == d + 16
    want = cfg.tile_m * r16 + tiles.tile_n * 2 * r16 + 2 * tiles.tile_n * 2 * (d + 16)
    assert cfg.smem_bytes == want <= 227 * 1024
    base = pf.Config(dataclasses.replace(_problem(head_dim_qk=d, head_dim_vo=d), kv_dtype=""), tiles)
    assert base.smem_bytes == cfg.tile_m * r16 + 2 * tiles.tile_n * 2 * r16  # 16-bit rows unchanged
    assert cfg.kv_cutlass_dtype.__name__ == "Float8E4M3FN" and base.kv_cutlass_dtype is base.cutlass_dtype


def test_fake_tensors():
    q, k, v = prefill_tensors(pf.Config(_problem(), pf.Tiles()), pp.WORK_COLS)[:3]
    assert q.element_type.__name__ == "BFloat16"
    assert k.element_type.__name__ == v.element_type.__name__ == "Float8E4M3FN"


# ----------------------------------------------------------------------------- PTX of cross-compiled builds
def _ptx(problem):
    cfg = pf.Config(problem, pf.default_tiles(problem, num_sms=132))
    return cfg, build(pf.compile, cfg).ptx  # (one compile per Config in the session: _builds.build)


@pytest.mark.parametrize("arch,dtype,d,feature", [
    ("sm_90a", "bfloat16", 128, "window"),
    ("sm_90a", "float16", 64, "mask"),
    ("sm_100a", "bfloat16", 128, "window"),
    ("sm_100a", "float16", 256, "none"),
])
def test_fp8_ptx(arch, dtype, d, feature):
    p = _problem(arch=arch, dtype=dtype, head_dim_qk=d, head_dim_vo=d, use_window=feature == "window",
                 use_custom_mask=feature == "mask", causal=feature != "mask")
    cfg, ptx = _ptx(p)
    t = cfg.tiles
    assert f".target {arch}" in ptx
    # the widening: per tile, tile_n * D / 4 words of K and of V over the CTA's threads, two cvt each
    words = 2 * t.tile_n * d // 4 // cfg.num_threads
    assert ptx.count("cvt.rn.f16x2.e4m3x2") == 2 * words
    assert ptx.count("ld.shared.b32") >= words and ptx.count("st.shared.b32") >= 2 * words
    ab = "bf16" if dtype == "bfloat16" else "f16"
    other = "f16" if dtype == "bfloat16" else "bf16"
    # the MMAs run in q's dtype on the widened tile, read by ldmatrix as for a 16-bit cache
    assert ptx.count(f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32") == (d // 16) * (t.tile_n // 8) + (
        t.tile_n // 16) * (d // 8)
    assert f".{other}.{other}" not in ptx and "ldmatrix" in ptx
    assert ("cvt.rn.bf16x2.f32" in ptx) == (dtype == "bfloat16")
    assert "cp.async.cg.shared.global" in ptx or "cp.async.ca.shared.global" in ptx


def test_16bit_ptx_has_no_e4m3():
    _, ptx = _ptx(dataclasses.replace(_problem(), kv_dtype=""))
    assert "e4m3" not in ptx and "ldmatrix" in ptx


# ----------------------------------------------------------------------------- the entry points' scale algebra
B, HQ, HKV, D, PS, PAGES = 3, 8, 2, 64, 16, 20


def _ws():
    return torch.zeros(8 << 20, dtype=torch.uint8)


def _table():
    return torch.randperm(PAGES)[:12].to(torch.int32).reshape(B, 4)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_trtllm_multirow_fp8(rec, layout):
    q_len, lens = 8, torch.tensor([37, 8, 50], dtype=torch.int32)
    shape = (PAGES, 2, HKV, PS, D) if layout == "HND" else (PAGES, 2, PS, HKV, D)
    cache = torch.randn(shape).to(FP8)
    k_scale, v_scale, sm = 0.6, 1.8, 1 / math.sqrt(D)
    out = trtllm_batch_decode_with_kv_cache(torch.randn(B * q_len, HQ, D).to(BF16), cache, _ws(), _table(), lens, 64,
                                            bmm1_scale=sm * k_scale, bmm2_scale=v_scale, window_left=31,
                                            kv_layout=layout, q_len_per_req=q_len)
    cfg, a = rec.last
    assert cfg.name == pf.NAME and cfg.kv_dtype == E4M3 and cfg.causal and cfg.use_window
    assert a["k"].dtype == a["v"].dtype == FP8 and a["q"].dtype == BF16
    assert a["sm_scale"] == pytest.approx(sm * k_scale, rel=1e-12) and a["output_scale"] == pytest.approx(v_scale)
    assert a["window_left"] == 31 and (out.float() == torch.tensor(v_scale).to(BF16).float()).all()
    live = a["work"][a["work"][:, pp.W_BATCH] >= 0]
    assert (live[:, pp.W_QO_LEN] == q_len).all()


def test_xqa_spec_decode_fp8(rec):
    n = 4
    k, v = (torch.randn(PAGES, PS, HKV, D).to(FP8) for _ in range(2))
    q = torch.randn(B, 1, n, HQ, D).to(FP16)
    lens = torch.tensor([[37], [4], [50]], dtype=torch.int32)
    bits = torch.tril(torch.ones(n, n, dtype=torch.int64))
    mask = torch.zeros(B, n, 2, dtype=torch.int64)
    for j in range(n):
        mask[:, :, 0] |= bits[:, j] << j
    output = torch.full_like(q, float("nan"))
    xqa(q, k, v, _table(), lens, output, _ws(), torch.zeros(4, dtype=torch.uint32), HKV, PS, q_scale=1.5,
        kv_scale=0.4, q_seq_len=n, mask=mask.to(torch.int32).to(torch.uint16))
    cfg, a = rec.last
    assert cfg.name == pf.NAME and cfg.kv_dtype == E4M3 and cfg.use_custom_mask and a["k"].dtype == FP8
    assert a["sm_scale"] == pytest.approx(1.5 * 0.4 / math.sqrt(D), rel=1e-12)
    assert a["output_scale"] == pytest.approx(0.4) and (output.float() == torch.tensor(0.4).to(FP16).float()).all()


def _ts_case(sq=1):
    cache = torch.randn(PAGES, 2, HKV, PS, D).to(FP8)
    q = torch.randn((B, HQ, D) if sq == 1 else (B, sq, HQ, D)).to(BF16)
    return q, cache, _table(), torch.tensor([5, 40, 37], dtype=torch.int32)


@pytest.mark.parametrize("layout", ["sq1", "fixed", "packed"])
def test_prims_ts_fp8_every_layout(rec, layout):
    q, cache, table, lens = _ts_case(sq=4 if layout == "fixed" else 1)
    kw = dict(bmm1_scale=0.1 * 0.7, bmm2_scale=1.25)
    if layout == "packed":
        q = torch.randn(6, HQ, D).to(BF16)
        kw["qo_indptr"] = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    elif layout == "fixed":
        kw["seq_len_q"] = 4
    out = ts.batch_decode_with_paged_kv_cache(q, cache, table, lens, mask_type="causal", **kw)
    cfg, a = rec.last
    assert cfg.name == ("paged_decode" if layout == "sq1" else pf.NAME) and cfg.kv_dtype == E4M3
    assert a["k"].dtype == FP8 and out.shape == q.shape and out.dtype == BF16
    assert a["sm_scale"] == pytest.approx(0.07, rel=1e-6) and a["output_scale"] == 1.25


def test_prims_ts_wrapper_fp8(rec):
    q, cache, table, lens = _ts_case(sq=2)
    w = ts.BatchDecodePagedTSWrapper()
    w.plan("cpu", B, HQ, HKV, D, PS, 64, max_seq_len_q=2, q_data_type=BF16, kv_data_type=FP8, seq_lens=lens)
    out = w.run(q, cache, None, table, bmm1_scale=0.2, bmm2_scale=3.0)
    cfg, a = rec.last
    assert cfg.name == pf.NAME and cfg.kv_dtype == E4M3 and (out == 3.0).all()
    with pytest.raises(ValueError, match="planned K/V dtype"):
        w.run(q, cache.to(BF16), None, table)
    # k / v data types agree with kv_data_type, the output has q's dtype
    w.plan("cpu", B, HQ, HKV, D, PS, 64, q_data_type=FP16, k_data_type=FP8, v_data_type=FP8, seq_lens=lens)
    w.run(q[:, 0].to(FP16).contiguous(), cache, None, table)
    assert rec.last[0].name == "paged_decode" and rec.last[0].kv_dtype == E4M3


@pytest.mark.parametrize("kw,exc,match", [
    (dict(kv_data_type=torch.float8_e5m2), NotImplementedError, "kv dtype"),
    (dict(q_data_type=FP8, kv_data_type=FP8), NotImplementedError, "q dtype"),
    (dict(kv_data_type=FP8, o_data_type=FP8), NotImplementedError, "out dtype"),
    (dict(kv_data_type=FP8, o_data_type=FP16), NotImplementedError, "mixed dtypes"),
    (dict(kv_data_type=FP8, k_data_type=BF16), ValueError, "k_data_type"),
])
def test_prims_ts_fp8_dtype_errors(rec, kw, exc, match):
    kw = {"q_data_type": BF16, **kw}
    with pytest.raises(exc, match=match):
        ts.BatchDecodePagedTSWrapper().plan("cpu", B, HQ, HKV, D, PS, 64, max_seq_len_q=2, **kw)
    assert rec.calls == []


# ----------------------------------------------------------------------------- the prefill wrappers
def _plan(w, **kw):
    qo = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
    w.plan(qo, None, None, None, HQ, HKV, D, PS, causal=True, q_data_type=BF16, block_tables=_table(),
           seq_lens=torch.tensor([5, 40, 37], dtype=torch.int32), **kw)


def test_public_paged_prefill_still_refuses_fp8(rec):
    with pytest.raises(NotImplementedError, match="kv_data_type"):
        _plan(BatchPrefillWithPagedKVCacheWrapper(_ws(), "NHD"), kv_data_type=FP8)


def test_multirow_wrapper_checks_the_cache_dtype(rec):
    w = MultiRowDecodePrefillWrapper(_ws(), "NHD")
    _plan(w, kv_data_type=FP8)
    q = torch.randn(6, HQ, D).to(BF16)
    with pytest.raises(ValueError, match="kv_data_type"):
        w.run(q, torch.randn(PAGES, 2, PS, HKV, D).to(BF16))
    w.run(q, torch.randn(PAGES, 2, PS, HKV, D).to(FP8), k_scale=0.5, v_scale=2.0)
    cfg, a = rec.last
    assert cfg.kv_dtype == E4M3 and a["output_scale"] == 2.0
    assert a["sm_scale"] == pytest.approx(0.5 / math.sqrt(D), rel=1e-12)
    # a failed plan keeps the previous one (fp8) whole; a 16-bit re-plan reads 16-bit caches again
    with pytest.raises(ValueError):
        _plan(w, kv_data_type=FP8, window_left=-5)
    w.run(q, torch.randn(PAGES, 2, PS, HKV, D).to(FP8))
    _plan(w)
    w.run(q, torch.randn(PAGES, 2, PS, HKV, D).to(BF16))
    assert rec.last[0].kv_dtype == "" and rec.last[0].name == sm90.NAME
    with pytest.raises(NotImplementedError, match="cudnn"):
        _plan(MultiRowDecodePrefillWrapper(_ws(), "NHD", backend="cudnn"), kv_data_type=FP8)


# ----------------------------------------------------------------------------- the oracle, public trtllm case
def test_oracle_sliding_window_fp8_multirow():
    """ref.paged_prefill on the dequantised fp8 cache = float64 attention written out by hand for the public trtllm
    case (bf16 q, q_len 8, window_left 1023: each row keeps its 1024 latest keys, bottom-right causal) at
    seq_len 1025, 1031 and 1100: the first keys fall out of the window."""
    gen = torch.Generator().manual_seed(0)
    ps, hkv, group, d, q_len, wl = 16, 1, 2, 64, 8, 1023
    lens = [1025, 1031, 1100]
    npg = [-(-L // ps) for L in lens]
    perm = torch.randperm(sum(npg) + 1, generator=gen)
    indices = perm[: sum(npg)].to(torch.int32)
    indptr = torch.tensor([0] + torch.tensor(npg).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([L - (n - 1) * ps for L, n in zip(lens, npg)], dtype=torch.int32)
    k8, v8 = ((torch.randn(sum(npg) + 1, ps, hkv, d, generator=gen) * 2).to(FP8) for _ in range(2))
    q = torch.randn(len(lens) * q_len, hkv * group, d, generator=gen).to(BF16)
    qo = torch.arange(len(lens) + 1, dtype=torch.int32) * q_len
    k_scale, v_scale, sm = 0.3, 1.7, 1 / math.sqrt(d)
    o, lse = ref.paged_prefill(q, dequantize_kv_cache(k8, k_scale), dequantize_kv_cache(v8, v_scale), qo, indptr,
                               indices, last, sm_scale=sm, causal=True, window_left=wl)
    for b, L in enumerate(lens):
        kr = torch.stack([k8[int(indices[indptr[b] + t // ps]), t % ps] for t in range(L)]).double()[:, 0]
        vr = torch.stack([v8[int(indices[indptr[b] + t // ps]), t % ps] for t in range(L)]).double()[:, 0]
        for i in range(q_len):
            pos = L - q_len + i
            keys = torch.arange(max(0, pos - wl), pos + 1)
            assert keys.numel() == min(wl + 1, pos + 1)
            s = q[b * q_len + i].double() @ kr[keys].T * (sm * k_scale)  # [Hq, keys]: the kernel's fused scale
            p = torch.softmax(s, -1)
            torch.testing.assert_close(o[b * q_len + i], p @ vr[keys] * v_scale, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(lse[b * q_len + i], torch.logsumexp(s, -1) / math.log(2), rtol=1e-12,
                                       atol=1e-12)


def test_custom_op_carries_the_fp8_problem(rec):
    """The prefill custom op (what torch.compile traces) finds the fp8 kernel by its key and hands it the e4m3
    caches; opcheck's fake-tensor check passes with them (its schema check does arithmetic torch's CPU build lacks
    for float8_e4m3fn)."""
    c = dispatch.prefill_choice(_problem(head_dim_qk=64, head_dim_vo=64, arch="sm_90a"))
    q, k, v = torch.randn(6, 8, 64).to(BF16), torch.randn(4, 16, 2, 64).to(FP8), torch.randn(4, 16, 2, 64).to(FP8)
    out, lse = torch.empty(6, 8, 64, dtype=BF16), torch.empty(6, 8)
    args = (q, k, v, torch.arange(4, dtype=torch.int32), torch.zeros(2, 8, dtype=torch.int32), out, lse,
            torch.zeros(1, dtype=torch.uint8), torch.zeros(1), torch.zeros(1), 0.125, 0.0, -1, 1.0, 13.0, 0.5,
            c.graph_key)
    torch.ops.cutedsl_attn.prefill_portable(*args)
    name, cfg, a = rec.calls[-1]
    assert name == pf.NAME and cfg == c.cfg and cfg.problem.kv_fp8 and a.k is k and a.v.dtype == FP8
    torch.library.opcheck(torch.ops.cutedsl_attn.prefill_portable.default, args,
                          test_utils=("test_faketensor",))
