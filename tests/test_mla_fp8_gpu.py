"""GPU tests of fp8 e4m3 MLA (``trtllm_batch_decode_with_kv_cache_mla`` with fp8 caches, ``xqa_mla``) against the
float64 oracle ``cutedsl_attn.ref.mla_paged_attention`` on the dequantised data.

Fresh random inputs every run; outputs and LSE poisoned with NaN before each call; NaN (e4m3 0x7F) in every
page slot no request owns.  The oracle sees exactly the fp8 values (widened, then the per-tensor scales as the
API documents them: ``bmm1_scale`` / ``q_scale * kv_scale`` on the logits, ``bmm2_scale`` / ``kv_scale`` on O).
fp8 data are exact in the kernel's f16 MMAs, so the tolerance is the 16-bit one (P in f16, O rounded once).
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from cutedsl_attn import ref  # noqa: E402
from cutedsl_attn.api.mla_trtllm import trtllm_batch_decode_with_kv_cache_mla, xqa_mla  # noqa: E402

DEV = torch.device("cuda")
E4M3 = torch.float8_e4m3fn
DC, DR = 512, 64
D = DC + DR
TOL_O = 1e-2
TOL_LSE = 2e-2
SM_SCALE = 1.0 / math.sqrt(128 + 64)
_WS = None


def workspace():
    global _WS
    if _WS is None:
        _WS = torch.zeros(256 << 20, dtype=torch.uint8, device=DEV)
    return _WS


def rel(x, y):
    x, y = x.double(), y.double()
    assert torch.isfinite(x).all(), "non-finite values (a NaN-poisoned element was not written, or NaN leaked)"
    return ((x - y).norm() / max(y.norm().item(), 1e-30)).item()


def make(seq_lens, q_len, H, PS, *, q_dtype=E4M3, kv_dtype=E4M3, spare_pages=5, page_base=0, amp=0.5):
    """query, combined cache (NaN in unused slots and pages), block table (random distinct pages from
    ``page_base``, -1 past each request's pages) and seq_lens.  Values ``amp * N(0, 1)`` rounded to the dtypes."""
    B = len(seq_lens)
    npages = [-(-L // PS) for L in seq_lens]
    max_pages = max(npages + [1]) + 1
    n = sum(npages) + spare_pages
    ids = (torch.randperm(n, device=DEV) + page_base).to(torch.int32)
    bt = torch.full((B, max_pages), -1, dtype=torch.int32, device=DEV)
    kv = torch.empty((page_base + n, PS, D), dtype=kv_dtype, device=DEV)
    # fp8 rows are written through a byte view (e4m3 0x7F is NaN): indexed stores need no fp8 kernels
    raw = kv.view(torch.uint8) if kv_dtype == E4M3 else kv
    raw.fill_(0x7F if kv_dtype == E4M3 else float("nan"))
    pos = 0
    for b, L in enumerate(seq_lens):
        if L == 0:
            continue
        pg = ids[pos: pos + npages[b]]
        pos += npages[b]
        bt[b, : npages[b]] = pg
        rows = torch.randn(npages[b] * PS, D, device=DEV) * amp
        rows[L:] = float("nan")
        src = rows.view(-1, PS, D).to(kv_dtype)
        raw[pg.long()] = src.view(torch.uint8) if kv_dtype == E4M3 else src
    query = (torch.randn(B, q_len, H, D, device=DEV) * amp * 2).to(q_dtype)
    return query, kv, bt, torch.tensor(seq_lens, dtype=torch.int32, device=DEV)


def oracle(query, kv, bt, seq_lens, PS, *, sm_scale, out_scale):
    """The float64 oracle on the CPU over the used pages only (gathered through a uint8 view, widened exactly)."""
    B, q_len, H, _ = query.shape
    lens = seq_lens.cpu().tolist()
    npages = [-(-L // PS) for L in lens]
    pages = torch.cat([bt[b, : npages[b]].cpu() for b in range(B)] + [torch.zeros(0, dtype=torch.int32)])
    used, compact = torch.unique(pages, return_inverse=True)
    rows = kv.view(torch.uint8)[used.to(DEV).long()].view(kv.dtype) if kv.dtype == E4M3 else kv[used.to(DEV).long()]
    kv_c = rows.float().cpu()
    kv_indptr = torch.tensor([0] + torch.tensor(npages, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
    q = query.float().cpu().reshape(B * q_len, H, D)
    o, lse = ref.mla_paged_attention(q[..., :DC], q[..., DC:], kv_c[..., :DC], kv_c[..., DC:],
                                     torch.arange(B + 1, dtype=torch.int32) * q_len, kv_indptr,
                                     compact.to(torch.int32), seq_lens.cpu(), sm_scale=sm_scale, causal=q_len > 1)
    return (o * out_scale).view(B, q_len, H, DC), lse.view(B * q_len, H)


def check_trtllm(seq_lens, q_len, H, PS, *, q_dtype=E4M3, bmm1=SM_SCALE, bmm2=1.0, page_base=0, kv_4d=False):
    query, kv, bt, sl = make(seq_lens, q_len, H, PS, q_dtype=q_dtype, page_base=page_base)
    B = len(seq_lens)
    out_dtype = torch.bfloat16 if q_dtype == E4M3 else q_dtype
    out = torch.full((B, q_len, H, DC), float("nan"), dtype=out_dtype, device=DEV)
    lse = torch.full((B * q_len, H), float("nan"), dtype=torch.float32, device=DEV)
    cache = kv.unsqueeze(1) if kv_4d else kv
    o, l = trtllm_batch_decode_with_kv_cache_mla(query, cache, workspace(), 128, 512, 64, bt, sl, max(seq_lens),
                                                 out=out, bmm1_scale=bmm1, bmm2_scale=bmm2, lse=lse, return_lse=True)
    assert o is out and l is lse
    o_ref, lse_ref = oracle(query, kv, bt, sl, PS, sm_scale=bmm1, out_scale=bmm2)
    o, l = o.cpu(), l.cpu()
    assert rel(o, o_ref) < TOL_O
    empty = torch.isinf(lse_ref)
    assert torch.equal(torch.isinf(l) & (l < 0), empty), "LSE -inf exactly on the rows that see no key"
    assert (o.reshape(B * q_len, H, DC)[empty] == 0).all()
    if (~empty).any():
        assert (l.double()[~empty] - lse_ref[~empty]).abs().max().item() < TOL_LSE
    return query, kv, bt, sl, o


@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("H", [128, 16])
@pytest.mark.parametrize("PS", [32, 64])
@pytest.mark.parametrize("q_dtype", [E4M3, torch.bfloat16])
def test_trtllm_fp8_matches_oracle(q_dtype, PS, H, q_len):
    # page boundaries, an empty request, a one-token request (with q_len 2 its first row sees no key)
    check_trtllm([1, PS - 1, PS, PS + 1, 2 * PS, 0, 63, 64, 65, 1000], q_len, H, PS, q_dtype=q_dtype)


def test_trtllm_fp8_small_pages_and_fp16_query():
    check_trtllm([1, 15, 16, 17, 300], 1, 32, 16, q_dtype=torch.float16)
    check_trtllm([5, 70, 0], 2, 64, 1, q_dtype=E4M3, kv_4d=True)


@pytest.mark.parametrize("tune", ["tile_n=16,num_stages=6", "tile_n=32,num_stages=3"])
def test_trtllm_fp8_other_tiles(monkeypatch, tune):
    # the portable kernel's tiles: 16-token chunks widen two lanes a row; a 3-deep ring keeps one chunk in flight
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_KERNEL", "portable")
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_TUNE", tune)
    check_trtllm([1, 31, 33, 0, 700], 2, 16, 32, q_dtype=E4M3)
    check_trtllm([5000], 1, 128, 64, q_dtype=torch.bfloat16)


@pytest.mark.parametrize("q_len,H,PS", [(1, 128, 64), (2, 16, 32)])
def test_trtllm_fp8_long_split_kv(q_len, H, PS):
    check_trtllm([8192, 4000], q_len, H, PS)
    check_trtllm([32768], q_len, H, PS)


@pytest.mark.parametrize("lens", [[70, 3, 500], [16384]])  # one work item per request, and a split request
def test_trtllm_fp8_scales(lens):
    # fp8 per-tensor scales fused as FlashInfer documents: bmm1 = q_scale * k_scale * sm_scale, bmm2 = v * o
    q_scale, k_scale, v_scale, o_scale = 0.5, 2.0, 1.5, 0.25
    check_trtllm(lens, 1, 128, 64, bmm1=q_scale * k_scale * SM_SCALE, bmm2=v_scale * o_scale)
    check_trtllm(lens, 2, 16, 32, bmm1=-0.02, bmm2=3.0)


def test_fp8_and_bf16_kernels_agree_on_the_same_values():
    """The fp8 path and the 16-bit path over the same (exactly representable) values give the same O to 16-bit
    rounding."""
    lens = [100, 2049, 0, 64]
    query, kv, bt, sl, o8 = check_trtllm(lens, 1, 128, 64)
    o16 = trtllm_batch_decode_with_kv_cache_mla(query.to(torch.bfloat16), kv.to(torch.bfloat16), workspace(), 128,
                                                512, 64, bt, sl, max(lens), bmm1_scale=SM_SCALE)
    assert rel(o8, o16.cpu()) < TOL_O


def test_page_ids_past_32_bit_offsets_fp8():
    """Page ids whose ``page_id * page_stride`` passes 2^32 (elements and bytes: 1 byte per element), page 32 x
    576 wide, in fp8 and in bf16 through the combined cache."""
    PS = 32
    stride = PS * D
    base = (1 << 32) // stride + 7
    lens = [100, 4096, 33]
    n = sum(-(-L // PS) for L in lens) + 5
    free, _ = torch.cuda.mem_get_info()
    for q_dtype, es in ((E4M3, 1), (torch.bfloat16, 2)):
        need = (base + n) * stride * es
        if need + (4 << 30) > min(free, 40 << 30):
            pytest.skip(f"needs {need / 2**30:.1f} GiB for the cache; {free / 2**30:.1f} GiB free (limit 40 GiB)")
        query, kv, bt, sl = make(lens, 1, 128, PS, q_dtype=q_dtype, kv_dtype=q_dtype, page_base=base)
        assert int(bt[bt >= 0].min()) * stride >= 1 << 32
        out = torch.full((3, 1, 128, DC), float("nan"), dtype=torch.bfloat16, device=DEV)
        trtllm_batch_decode_with_kv_cache_mla(query, kv, workspace(), 128, 512, 64, bt, sl, max(lens), out=out,
                                              bmm1_scale=SM_SCALE)
        o_ref, _ = oracle(query, kv, bt, sl, PS, sm_scale=SM_SCALE, out_scale=1.0)
        assert rel(out.cpu(), o_ref) < TOL_O
        del query, kv, out
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- xqa_mla
def check_xqa(seq_lens, PS, *, q_scale=1.0, kv_scale=1.0, form="4d", sm_count=None):
    B = len(seq_lens)
    query, kv, bt, sl = make(seq_lens, 1, 128, PS)
    pages = kv.shape[0]
    cache = {"4d": kv.view(pages, PS, 1, D), "3d": kv, "2d": kv.view(pages * PS, D)}[form]
    bt = torch.where(bt < 0, torch.zeros_like(bt), bt)  # xqa's table: unused columns hold any valid id
    out = torch.full((B, 1, 128, DC), float("nan"), dtype=torch.bfloat16, device=DEV)
    sem = torch.zeros(2 * B + 4, dtype=torch.uint32, device=DEV)
    r = xqa_mla(query, cache, cache, bt, sl.to(torch.uint32).view(B, 1), out, workspace(), sem, PS,
                q_scale=q_scale, kv_scale=kv_scale, sm_count=sm_count)
    assert r is None
    o_ref, _ = oracle(query, kv, bt, sl, PS, sm_scale=q_scale * kv_scale, out_scale=kv_scale)
    assert rel(out.cpu(), o_ref) < TOL_O


@pytest.mark.parametrize("kv_scale", [1.0, 0.5])
@pytest.mark.parametrize("q_scale", [1.0, 0.5])
@pytest.mark.parametrize("PS", [32, 64])
def test_xqa_mla_matches_oracle(PS, q_scale, kv_scale):
    # FlashInfer's test_xqa_mla grid: seq_len {2, 15, 256, 514, 2048}, batch 1 and 2; its q_scale is the logit
    # multiplier with the softmax scale folded in
    for lens in ([2], [15, 256], [514, 2048]):
        check_xqa(lens, PS, q_scale=q_scale * SM_SCALE, kv_scale=kv_scale)


@pytest.mark.parametrize("form", ["2d", "3d"])
def test_xqa_mla_cache_forms_and_split(form):
    check_xqa([16384, 3, 0], 64, q_scale=SM_SCALE, kv_scale=0.75, form=form)
    check_xqa([4096], 32, q_scale=SM_SCALE, form=form, sm_count=16)
