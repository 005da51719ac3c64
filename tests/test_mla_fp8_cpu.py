"""CPU tests of fp8 e4m3 MLA: the problem's ``kv_dtype`` (validation, one key per kernel), the scale algebra of
``trtllm_batch_decode_with_kv_cache_mla`` / ``xqa_mla`` against FlashInfer's own reference formulas (launch
stubbed, the float64 oracle run with the scales that reach the kernel), named errors before any launch, the
wrapper's fp8 refusal, and the fp8 kernel cross-compiled for sm_90a / sm_100a with PTX assertions (e4m3
widening, f16 mma.sync, 64-bit page offsets)."""

import glob
import math
import re

import pytest
import torch

from cutedsl_attn import ref
from cutedsl_attn.api import mla as api_mla
from cutedsl_attn.api import mla_trtllm as api
from cutedsl_attn.compile.keys import config_key
from cutedsl_attn.planning.mla import MlaProblem
from cutedsl_attn.portable import mla_decode as md

E4M3 = torch.float8_e4m3fn
DC, DR = 512, 64
D = DC + DR


@pytest.fixture
def cross(monkeypatch):
    monkeypatch.setenv("CUTEDSL_ATTN_ARCH", "sm_90a")


@pytest.fixture
def launched(monkeypatch):
    """Stub the launch: record (module, cfg, args) instead of running the kernel."""
    calls = []
    monkeypatch.setattr(api, "_launch", lambda module, cfg, args: calls.append((module, cfg, args)))
    return calls


# ---------------------------------------------------------------------------------------------- the problem
def test_kv_dtype_field():
    bf = MlaProblem("bfloat16", 64)
    assert bf.kv_dtype == "" and not bf.kv_fp8 and not bf.q_fp8 and bf.out_dtype == "bfloat16"
    # q's own dtype spelled out is the same problem (one compile key)
    assert MlaProblem("bfloat16", 64, kv_dtype="bfloat16") == bf
    assert config_key(MlaProblem("bfloat16", 64, kv_dtype="bfloat16")) == config_key(bf)
    kv8 = MlaProblem("bfloat16", 64, kv_dtype="float8_e4m3fn")
    assert kv8.kv_fp8 and not kv8.q_fp8 and kv8.out_dtype == "bfloat16" and config_key(kv8) != config_key(bf)
    h8 = MlaProblem("float16", 16, kv_dtype="float8_e4m3fn")
    assert h8.kv_fp8 and h8.out_dtype == "float16"
    q8 = MlaProblem("float8_e4m3fn", 32)
    assert q8.q_fp8 and q8.kv_fp8 and q8.out_dtype == "bfloat16" and q8.kv_dtype == ""
    assert MlaProblem("float8_e4m3fn", 32, kv_dtype="float8_e4m3fn") == q8


@pytest.mark.parametrize("kw,exc,match", [
    (dict(dtype="float8_e4m3fn", kv_dtype="bfloat16"), ValueError, "fp8 q needs fp8 caches"),
    (dict(dtype="bfloat16", kv_dtype="float16"), ValueError, "kv_dtype must be"),
    (dict(dtype="bfloat16", kv_dtype="float8_e5m2"), NotImplementedError, "float8_e5m2"),
    (dict(dtype="float8_e5m2"), NotImplementedError, "float8_e5m2"),
    (dict(dtype="bfloat16", kv_dtype=None), TypeError, "kv_dtype must be a str"),
    (dict(dtype="float32"), ValueError, "dtype must be"),
])
def test_kv_dtype_errors(kw, exc, match):
    with pytest.raises(exc, match=match):
        MlaProblem(page_size=64, **kw)


def test_fp8_tiles_and_shared_memory():
    for pb in (MlaProblem("bfloat16", 64, kv_dtype="float8_e4m3fn"), MlaProblem("float8_e4m3fn", 1)):
        t = md.default_tiles(pb, num_sms=132)
        cfg = md.Config(pb, t)
        assert cfg.kv_row_bytes == D + 16 and cfg.smem_widen_bytes == 2 * t.tile_n * cfg.row_bytes
        assert cfg.smem_bytes <= md.SMEM_LIMIT
        assert cfg.mma_dtype.__name__ == "Float16"
    # a 16-bit problem keeps its layout: no widened tiles, 16-bit ring rows
    cfg = md.Config(MlaProblem("bfloat16", 64), md.Tiles())
    assert cfg.smem_widen_bytes == 0 and cfg.kv_row_bytes == cfg.row_bytes


# ---------------------------------------------------------------------------------------------- trtllm MLA
def _case(B=3, q_len=1, H=16, PS=32, lens=(40, 0, 64), pages=8, q_dtype=torch.bfloat16, kv_dtype=E4M3,
          gen=None):
    gen = gen or torch.Generator().manual_seed(0)
    bt = torch.full((B, 3), -1, dtype=torch.int32)
    nxt = 0
    for b, L in enumerate(lens):
        for j in range(-(-L // PS)):
            bt[b, j] = nxt
            nxt += 1
    return dict(query=torch.randn(B, q_len, H, D, generator=gen).to(q_dtype),
                kv_cache=(torch.randn(pages, PS, D, generator=gen) / 2).to(kv_dtype),
                workspace_buffer=torch.zeros(1 << 24, dtype=torch.uint8), qk_nope_head_dim=128, kv_lora_rank=512,
                qk_rope_head_dim=64, block_tables=bt, seq_lens=torch.tensor(lens, dtype=torch.int32),
                max_seq_len=max(lens, default=0))


def flashinfer_torch_reference_mla(query, kv_cache, block_tables, seq_lens, softmax_scale, output_scale, PS):
    """FlashInfer's ``torch_reference_mla`` (tests/attention/test_trtllm_gen_mla.py), decode rows, float64."""
    B, q_len, H, _ = query.shape
    kv = kv_cache.reshape(-1, D).double()
    outs = []
    for b in range(B):
        L = int(seq_lens[b])
        if L == 0:
            outs.append(torch.zeros(q_len, H, DC, dtype=torch.float64))
            continue
        idx = torch.cat([torch.arange(int(p) * PS, int(p) * PS + PS) for p in block_tables[b, : -(-L // PS)]])[:L]
        lat, rope = kv[idx, :DC], kv[idx, DC:]
        q = query[b].double()
        s = (torch.einsum("qhd,kd->qhk", q[..., :DC], lat) + torch.einsum("qhd,kd->qhk", q[..., DC:], rope))
        outs.append(torch.einsum("qhk,kd->qhd", torch.softmax(s * softmax_scale, -1), lat) * output_scale)
    return torch.stack(outs)


def _oracle_from_args(args, cfg, query, kv_cache, block_tables, seq_lens, PS):
    """The float64 oracle over the dequantised data with exactly the scales the kernel receives."""
    B, q_len, H, _ = query.shape
    lens = seq_lens.tolist()
    npages = [-(-L // PS) for L in lens]
    kv_indptr = torch.tensor([0] + torch.tensor(npages).cumsum(0).tolist(), dtype=torch.int32)
    kv_indices = torch.cat([block_tables[b, : npages[b]] for b in range(B)])
    q = query.reshape(B * q_len, H, D)
    o, _ = ref.mla_paged_attention(q[..., :DC], q[..., DC:], kv_cache[..., :DC], kv_cache[..., DC:],
                                   torch.arange(B + 1, dtype=torch.int32) * q_len, kv_indptr, kv_indices,
                                   seq_lens, sm_scale=args.sm_scale, causal=cfg.problem.causal)
    return (o * args.output_scale).view(B, q_len, H, DC)


def test_trtllm_fp8_kernel_by_head_count(cross, launched):
    """On sm_90a an fp8 cache at page 64 runs the SM90 kernel from FP8_SM90_MIN_HEADS query heads and the portable
    one below (the entry point passes its head count to dispatch); page 32 stays on the portable kernel."""
    from cutedsl_attn import dispatch as d
    from cutedsl_attn.sm90 import mla as sm90

    for H, PS, want in ((128, 64, sm90), (d.FP8_SM90_MIN_HEADS, 64, sm90), (16, 64, md), (128, 32, md)):
        launched.clear()
        api.trtllm_batch_decode_with_kv_cache_mla(**_case(H=H, PS=PS, lens=(40, 0, 64)), bmm1_scale=0.1)
        (module, _, _), = launched
        assert module is want, (H, PS, module.NAME)


@pytest.mark.parametrize("q_dtype,kv_dtype,out_dtype", [
    (E4M3, E4M3, torch.bfloat16), (torch.bfloat16, E4M3, torch.bfloat16), (torch.float16, E4M3, torch.float16)])
def test_trtllm_fp8_problem_views_and_scales(cross, launched, q_dtype, kv_dtype, out_dtype):
    a = _case(q_dtype=q_dtype, kv_dtype=kv_dtype)
    # fp8 q / k / v per-tensor scales fused as FlashInfer documents them
    q_scale, k_scale, v_scale, o_scale = 0.5, 1.5, 0.75, 2.0
    bmm1 = q_scale * k_scale / math.sqrt(128 + 64)
    bmm2 = v_scale * o_scale
    out = api.trtllm_batch_decode_with_kv_cache_mla(**a, bmm1_scale=bmm1, bmm2_scale=bmm2)
    (module, cfg, args), = launched
    assert module is md and out.dtype == out_dtype and args.out.dtype == out_dtype
    assert cfg.problem.kv_fp8 and cfg.problem.q_fp8 == (q_dtype == E4M3)
    assert cfg.problem.out_dtype == str(out_dtype).replace("torch.", "")
    assert args.sm_scale == bmm1 and args.output_scale == bmm2  # nothing else multiplies in
    kv, q = a["kv_cache"], a["query"]
    assert args.ckv.dtype == E4M3 and args.ckv.data_ptr() == kv.data_ptr()
    assert args.kpe.data_ptr() == kv.data_ptr() + DC  # 1 byte per element: kpe starts 512 bytes in
    assert args.ckv.stride() == (32 * D, D, 1)
    assert args.q_nope.data_ptr() == q.data_ptr() and args.q_nope.dtype == q_dtype
    # the scale algebra: FlashInfer's reference on the dequantised values = our oracle with the kernel's scales
    fi = flashinfer_torch_reference_mla(q, kv, a["block_tables"], a["seq_lens"], bmm1, bmm2, 32)
    ours = _oracle_from_args(args, cfg, q, kv, a["block_tables"], a["seq_lens"], 32)
    torch.testing.assert_close(ours, fi, rtol=1e-10, atol=1e-12)


def test_trtllm_fp8_multirow_is_causal(cross, launched):
    a = _case(q_len=2, q_dtype=E4M3)
    api.trtllm_batch_decode_with_kv_cache_mla(**a, bmm1_scale=0.1, bmm2_scale=0.5, return_lse=True)
    (_, cfg, args), = launched
    assert cfg.problem.causal and cfg.problem.q_fp8 and args.num_row_tiles == 2


@pytest.mark.parametrize("change,exc,match", [
    (dict(query=torch.randn(3, 1, 16, D).to(E4M3), kv_cache=torch.randn(8, 32, D).bfloat16()),
     NotImplementedError, "fp8 query needs an fp8 cache"),
    (dict(kv_cache=torch.randn(8, 32, D).to(torch.float8_e5m2)), NotImplementedError, "float8_e5m2"),
    (dict(query=torch.randn(3, 1, 16, D).to(torch.float8_e5m2)), NotImplementedError, "float8_e5m2"),
    (dict(query=torch.randn(3, 1, 16, D).to(E4M3), out=torch.empty(3, 1, 16, DC, dtype=torch.float16)),
     ValueError, "dtype of out"),
    (dict(kv_cache=torch.randn(8, 32, D + 8).to(E4M3)[..., 8:]), ValueError, "16-byte aligned"),
])
def test_trtllm_fp8_named_errors(cross, launched, change, exc, match):
    a = _case()
    a.update(change)
    with pytest.raises(exc, match=match):
        api.trtllm_batch_decode_with_kv_cache_mla(**a)
    assert launched == []


# ---------------------------------------------------------------------------------------------- xqa_mla
def _xqa_case(B=2, PS=32, lens=(40, 64), pages=6, form="4d", gen=None):
    gen = gen or torch.Generator().manual_seed(1)
    npg = max(-(-L // PS) for L in lens)
    pt = torch.zeros(B, npg, dtype=torch.int32)
    nxt = 0
    for b, L in enumerate(lens):
        for j in range(-(-L // PS)):
            pt[b, j] = nxt
            nxt += 1
    cache3 = (torch.randn(pages, PS, D, generator=gen) / 4).to(E4M3)
    cache = {"2d": cache3.view(-1, D), "3d": cache3, "4d": cache3.view(pages, PS, 1, D)}[form]
    return dict(q=torch.randn(B, 1, 128, D, generator=gen).to(E4M3), k_cache=cache, v_cache=cache,
                page_table=pt, seq_lens=torch.tensor(lens, dtype=torch.uint32).view(B, 1),
                output=torch.empty(B, 1, 128, DC, dtype=torch.bfloat16),
                workspace_buffer=torch.zeros(1 << 26, dtype=torch.uint8),
                semaphores=torch.zeros(64, dtype=torch.uint32), page_size=PS)


def flashinfer_xqa_ref_attention(q, k, v, q_scale, kv_scale):
    """FlashInfer's ``ref_attention`` (tests/attention/test_xqa.py) as ``test_xqa_mla`` calls it:
    ``q_scale * sqrt(576)`` passed in, ``qk_scale = q_scale * kv_scale / sqrt(576)``, O x ``kv_scale``."""
    qk_scale = (q_scale * math.sqrt(D)) * kv_scale / math.sqrt(D)
    s = q.double() @ k.double().T * qk_scale
    x = torch.exp(s - s.max(-1, keepdim=True).values)
    return (x @ v[:, :DC].double()) * kv_scale / x.sum(-1, keepdim=True)


@pytest.mark.parametrize("form", ["2d", "3d", "4d"])
@pytest.mark.parametrize("q_scale,kv_scale", [(1.0, 1.0), (0.5, 0.25), (0.07, 2.0)])
def test_xqa_mla_scales_and_views(cross, launched, form, q_scale, kv_scale):
    a = _xqa_case(form=form)
    assert api.xqa_mla(**a, q_scale=q_scale, kv_scale=kv_scale) is None
    (module, cfg, args), = launched
    assert module is md and cfg.problem.q_fp8 and cfg.problem.out_dtype == "bfloat16" and not cfg.problem.causal
    assert args.sm_scale == q_scale * kv_scale and args.output_scale == kv_scale
    assert args.out.data_ptr() == a["output"].data_ptr() and args.out.shape == (2, 128, DC)
    assert args.ckv.shape == (6, 32, DC) and args.kpe.data_ptr() == a["k_cache"].data_ptr() + DC
    # FlashInfer's own reference formula == our oracle with the scales the kernel receives
    kv3 = a["k_cache"].reshape(6, 32, D)
    ours = _oracle_from_args(args, cfg, a["q"], kv3, a["page_table"], a["seq_lens"].view(-1).to(torch.int32), 32)
    for b, L in enumerate((40, 64)):
        rows = torch.cat([torch.arange(int(p) * 32, int(p) * 32 + 32) for p in a["page_table"][b, : -(-L // 32)]])
        k = kv3.reshape(-1, D)[rows[:L]]
        fi = flashinfer_xqa_ref_attention(a["q"][b, 0], k, k, q_scale, kv_scale)
        torch.testing.assert_close(ours[b, 0], fi, rtol=1e-9, atol=1e-12)


def test_xqa_mla_tensor_scales_and_sm_count(cross, launched, monkeypatch):
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_KERNEL", "portable")  # its 16-row tiles: 8 tiles of 128 heads
    a = _xqa_case(B=1, lens=(8192,), pages=256, PS=32)
    api.xqa_mla(**a, q_scale=torch.tensor([0.5]), kv_scale=torch.tensor(0.25), sm_count=8)
    api.xqa_mla(**a)
    (_, _, few), (_, _, many) = launched
    assert few.sm_scale == 0.125 and few.output_scale == 0.25
    # sm_count is the SM count the split heuristic fills: 8 SMs hold the 8 row tiles, no split
    n_few = int((few.work[:, 0] >= 0).sum())
    n_many = int((many.work[:, 0] >= 0).sum())
    assert n_few == 1 and n_many > 1


def _xqa_bad(**change):
    a = _xqa_case()
    a.update(change)
    return a


@pytest.mark.parametrize("change,exc,match", [
    (dict(q=torch.randn(2, 1, 128, D).bfloat16()), ValueError, "q must be torch.float8_e4m3fn"),
    (dict(k_cache=torch.randn(6, 32, D).bfloat16()), ValueError, "k_cache must be torch.float8_e4m3fn"),
    (dict(q=torch.randn(2, 1, 64, D).to(E4M3)), ValueError, "exactly 128 query heads"),
    (dict(q=torch.randn(2, 2, 128, D).to(E4M3)), NotImplementedError, "beam_width=2"),
    (dict(q=torch.randn(2, 1, 128, DC).to(E4M3)), ValueError, "576"),
    (dict(v_cache=(torch.randn(6, 32, 1, D) / 4).to(E4M3)), NotImplementedError, "storage of its own"),
    (dict(k_cache=torch.randn(6, 16, 1, D).to(E4M3)), ValueError, "k_cache must be"),
    (dict(k_cache=torch.randn(70, D).to(E4M3)), ValueError, "whole pages"),
    (dict(page_size=128), NotImplementedError, "page_size=128"),
    (dict(output=torch.empty(2, 1, 128, DC, dtype=torch.float16)), ValueError, "dtype of output"),
    (dict(output=torch.empty(2, 1, 128, D, dtype=torch.bfloat16)), ValueError, "output must have shape"),
    (dict(page_table=torch.tensor([[0, 1], [2, 9]], dtype=torch.int32)), ValueError, "page id 9"),
    (dict(page_table=torch.zeros(2, 2, dtype=torch.int64)), ValueError, "int32"),
    (dict(seq_lens=torch.tensor([40, 100], dtype=torch.int32)), ValueError, "too narrow"),
    (dict(workspace_buffer=torch.zeros(64, dtype=torch.uint8)), ValueError, "workspace_buffer holds"),
    (dict(semaphores=None), TypeError, "semaphores"),
    (dict(q_scale=float("nan")), ValueError, "q_scale must be finite"),
    (dict(kv_scale=torch.tensor([1.0, 2.0])), ValueError, "kv_scale tensor must hold one value"),
    (dict(sm_count=0), ValueError, "sm_count"),
    (dict(enable_pdl="yes"), TypeError, "enable_pdl"),
])
def test_xqa_mla_named_errors(cross, launched, change, exc, match):
    with pytest.raises(exc, match=match):
        api.xqa_mla(**_xqa_bad(**change))
    assert launched == []


def test_xqa_mla_v_view_of_k_accepted(cross, launched):
    a = _xqa_case(form="3d")
    api.xqa_mla(**dict(a, v_cache=a["k_cache"][..., :DC]))
    assert len(launched) == 1


def test_xqa_mla_cpu_tensors_refused_at_launch(cross):
    with pytest.raises(ValueError, match="CUDA tensors"):
        api.xqa_mla(**_xqa_case())


# ---------------------------------------------------------------------------------------------- the wrapper
def test_wrapper_refuses_fp8_with_a_pointer(cross):
    w = api_mla.BatchMLAPagedAttentionWrapper(torch.empty(1 << 20, dtype=torch.int8))
    args = dict(qo_indptr=torch.arange(2, dtype=torch.int32), kv_indptr=torch.tensor([0, 1], dtype=torch.int32),
                kv_indices=torch.zeros(1, dtype=torch.int32), kv_len_arr=torch.tensor([4], dtype=torch.int32),
                num_heads=16, head_dim_ckv=DC, head_dim_kpe=DR, page_size=4, causal=False, sm_scale=0.1,
                q_data_type=torch.bfloat16, kv_data_type=E4M3)
    with pytest.raises(NotImplementedError, match="trtllm_batch_decode_with_kv_cache_mla"):
        w.plan(**args)
    with pytest.raises(NotImplementedError, match="BatchMLAPagedAttentionWrapper"):
        w.plan(**dict(args, q_data_type=E4M3))


# ---------------------------------------------------------------------------------------------- PTX
def page_offsets_are_64_bit(ptx: str) -> int:
    """How many page ids the kernel multiplies by a cache's page stride in 64 bits: each page id is loaded by
    ``ld.global.s32`` straight into a 64-bit register that meets the ckv / kpe page stride (the 64-bit kernel
    parameter at +16 of tensors 2 and 3) in a ``mul.lo.s64`` / ``mad.lo.s64``.  AssertionError if a page id
    is used in 32-bit arithmetic."""
    strides = set()
    for m in re.finditer(r"ld\.param\.b64\s+(%rd\d+), \[\w+_param_([23])\+16\];", ptx):
        strides.add(m.group(1))
    assert len(strides) == 2, "the ckv / kpe page strides are 64-bit parameters"
    pages = re.findall(r"ld\.global\.(?:nc\.)?s32\s+(%rd\d+), \[", ptx)
    assert pages, "page ids load into 64-bit registers"
    n = 0
    for p in pages:
        uses = re.findall(rf"(mul|mad)\.lo\.s64\s+%rd\d+, (%rd\d+), {re.escape(p)}\b", ptx)
        uses += re.findall(rf"(mul|mad)\.lo\.s64\s+%rd\d+, {re.escape(p)}, (%rd\d+)\b", ptx)
        if any(s in strides for _, s in uses):
            n += 1
        assert not re.search(rf"cvt\.u?32\.[us]64\s+%r\d+, {re.escape(p)}\b", ptx), "a page id truncated to 32 bits"
    return n


@pytest.mark.parametrize("arch,dtype,kv_dtype,page_size,causal,tiles", [
    ("sm_90a", "bfloat16", "float8_e4m3fn", 64, False, None),
    ("sm_90a", "float8_e4m3fn", "", 32, False, None),
    ("sm_100a", "float8_e4m3fn", "", 64, True, None),
    ("sm_100a", "float16", "float8_e4m3fn", 1, False, None),
    ("sm_90a", "bfloat16", "float8_e4m3fn", 16, True, md.Tiles(tile_n=16, num_stages=6)),
])
def test_fp8_ptx_and_resources(tmp_path, arch, dtype, kv_dtype, page_size, causal, tiles):
    from cutedsl_attn.inspect import cubin_resources

    pb = MlaProblem(dtype, page_size, causal=causal, arch=arch, kv_dtype=kv_dtype)
    tiles = tiles or md.default_tiles(pb, num_sms=132)
    cfg = md.Config(pb, tiles)
    md.compile(cfg, keep_ptx_dir=str(tmp_path), keep_cubin=True)
    ptx = open(glob.glob(str(tmp_path / "*.ptx"))[0]).read()
    cubin = open(glob.glob(str(tmp_path / "*.cubin"))[0], "rb").read()
    tn = tiles.tile_n
    # both MMAs in f16 (e4m3 widens exactly): S 9 k16 steps x tile_n/8 n8 tiles, P V tile_n/16 x 16
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") == 9 * (tn // 8) + (tn // 16) * 16
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16" not in ptx
    # the e4m3 widening: a warp's 144 columns of tile_n rows, 4 bytes an e4m3x4 conversion, over 32 lanes; plus
    # 9 pieces of 8 bytes per thread of an fp8 q
    n_cvt = len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2 %r\d+, l; cvt\.rn\.f16x2\.e4m3x2 %r\d+, h;", ptx))
    assert n_cvt == 2 * (tn * 18 // 32) + (2 * 9 if pb.q_fp8 else 0), n_cvt
    assert "bar.warp.sync" in ptx  # a warp's widened columns are visible to its own ldmatrix
    assert ptx.count("cp.async.cg.shared.global") > 0 and "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
    assert ".local" not in ptx and "wgmma" not in ptx and "tcgen05" not in ptx
    # a bf16 q's A fragments are rounded to f16 in registers (36 of them), an f16 / fp8 q needs none
    n_q16 = ptx.count("and.b32 h, ")
    assert n_q16 == (36 if dtype == "bfloat16" else 0)
    # O is stored in its 16-bit type: bf16 for an fp8 q
    ab = "bf16" if pb.out_dtype == "bfloat16" else "f16"
    assert f"cvt.rn.{ab}x2.f32" in ptx
    assert page_offsets_are_64_bit(ptx) >= 1
    res = cubin_resources(cubin)
    assert res["stack_bytes"] == 0, res
    assert res["registers"] <= 255, res


def test_16bit_page_offsets_are_64_bit(tmp_path):
    cfg = md.Config(MlaProblem("bfloat16", 32), md.Tiles())
    md.compile(cfg, keep_ptx_dir=str(tmp_path))
    ptx = open(glob.glob(str(tmp_path / "*.ptx"))[0]).read()
    assert page_offsets_are_64_bit(ptx) >= 1
    assert "cvt.rn.f16x2.e4m3x2" not in ptx and "bar.warp.sync" not in ptx


@pytest.mark.parametrize("pb", [MlaProblem("float8_e4m3fn", 32), MlaProblem("bfloat16", 64, kv_dtype="float8_e4m3fn")])
def test_custom_op_key_carries_the_cache_dtype(monkeypatch, pb):
    # under torch.compile the launch is cutedsl_attn::mla_decode_portable, keyed by the problem's fields
    from cutedsl_attn.dispatch import mla as d
    from cutedsl_attn.planning.mla import MlaArgs

    seen = []
    monkeypatch.setattr(d, "_mla_launch_direct", lambda module, cfg, args: seen.append(cfg.problem))
    from cutedsl_attn.portable import mla_decode as md

    cfg = md.Config(pb, md.default_tiles(pb, num_sms=132))
    qd = E4M3 if pb.q_fp8 else torch.bfloat16
    args = MlaArgs(torch.zeros(2, 16, DC, dtype=qd), torch.zeros(2, 16, DR, dtype=qd),
                   torch.zeros(4, pb.page_size, DC, dtype=E4M3), torch.zeros(4, pb.page_size, DR, dtype=E4M3),
                   torch.zeros(4, dtype=torch.int32), torch.zeros(2, 10, dtype=torch.int32),
                   torch.zeros(2, 16, DC, dtype=torch.bfloat16), torch.zeros(2, 16), torch.zeros(1, 16, DC),
                   torch.zeros(1, 16), torch.zeros(2, dtype=torch.int32), 0.1, 1, 0.5)
    d._mla_op(*args, d._key_of_config(cfg))
    assert seen == [pb]
