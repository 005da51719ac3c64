"""GPU tests of the trtllm / xqa entry points against the float64 oracle (``cutedsl_attn.ref``).

Every case builds a scattered paged cache whose spare pages, unused slots of each last page and block-table
columns past a request's pages hold NaN (pages full of NaN), NaN-poisons ``out`` / ``lse`` / xqa's ``output``,
and compares with ``ref.paged_prefill`` on the same cache values (fp8 caches widened exactly to float64), the
scales mapped as the module's table says: trtllm ``sm_scale = bmm1_scale``, ``output x bmm2_scale``; xqa
``sm_scale = q_scale * (kv_scale if fp8) / sqrt(D)``, ``output x kv_scale`` (fp8).
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from cutedsl_attn import ref
from cutedsl_attn.api.trtllm import trtllm_batch_context_with_kv_cache, trtllm_batch_decode_with_kv_cache, xqa
from cutedsl_attn.ref.paged import block_tables_to_csr
from _checks import TOL, check  # noqa: E402

DEV = torch.device("cuda")
BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
NAN = float("nan")


def make_cache(kv_lens, page_size, hkv, d, dtype, layout, gen, *, spare_pages=4, extra_cols=2):
    """A 5-D ``[pages, 2, ...]`` cache in ``layout`` (NaN where no request owns a slot), a block table whose
    columns past each request's pages point at NaN spare pages, and the CSR form of the same table."""
    npages = [-(-L // page_size) for L in kv_lens]
    total = sum(npages) + spare_pages
    perm = torch.randperm(total, generator=gen)
    spare = perm[sum(npages):]
    x = torch.randn(total, 2, page_size, hkv, d, generator=gen)
    x[spare] = NAN
    width = max(npages) + extra_cols
    table = torch.empty(len(kv_lens), width, dtype=torch.int32)
    off = 0
    for b, n in enumerate(npages):
        table[b, :n] = perm[off: off + n]
        table[b, n:] = spare[torch.randint(len(spare), (width - n,), generator=gen)]
        if n:
            x[int(perm[off + n - 1]), :, kv_lens[b] - (n - 1) * page_size:] = NAN
        off += n
    if layout == "HND":
        x = x.transpose(2, 3).contiguous()
    cache = x.to(dtype)
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32)
    csr = block_tables_to_csr(table, seq_lens, page_size)
    return cache, table, seq_lens, csr


def oracle(q, cache, csr, q_lens, layout, *, sm_scale, out_scale, **kw):
    """float64 ``(o * out_scale, lse)`` of ``q`` rows (``q_lens`` per request) over the paged cache."""
    qo = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    c = cache.cpu().to(torch.float32) if cache.dtype == FP8 else cache.cpu()  # fp8 widens exactly
    o, lse = ref.paged_prefill(q.cpu(), c, None, qo, *csr, kv_layout=layout, sm_scale=sm_scale, **kw)
    return o * out_scale, lse


def poisoned(shape, dtype):
    return torch.full(shape, NAN, dtype=dtype, device=DEV)


def ws():
    return torch.zeros(64 << 20, dtype=torch.uint8, device=DEV)


DECODE_CASES = [
    # (kv_lens, page_size, hkv, group, d, dtype, layout, q_len, window_left, sinks, tuple_cache)
    ([37, 1, 300, 0], 16, 2, 4, 128, BF16, "HND", 1, -1, False, False),
    ([37, 1, 300, 64], 16, 2, 4, 128, BF16, "NHD", 1, 31, True, True),
    ([1000, 129], 32, 1, 8, 64, FP16, "HND", 1, 100, True, False),
    ([4096], 64, 8, 1, 128, BF16, "NHD", 1, -1, False, False),
    ([37, 4, 300], 16, 2, 4, 128, BF16, "HND", 4, -1, False, False),
    ([37, 5, 300], 16, 2, 4, 128, FP16, "NHD", 4, 20, True, True),
    ([2000, 8], 64, 4, 2, 256, BF16, "HND", 4, 1023, False, False),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[str(i) for i in range(len(DECODE_CASES))])
def test_trtllm_decode(case):
    lens, ps, hkv, group, d, dt, layout, q_len, wl, use_sinks, as_tuple = case
    gen = torch.Generator().manual_seed(1)
    cache, table, seq_lens, csr = make_cache(lens, ps, hkv, d, dt, layout, gen)
    hq, B = hkv * group, len(lens)
    q = torch.randn(B * q_len, hq, d, generator=gen).to(dt)
    sinks = torch.randn(hq, generator=gen) if use_sinks else None
    bmm1, bmm2 = 0.7 / math.sqrt(d), 1.7
    o_ref, lse_ref = oracle(q, cache, csr, [q_len] * B, layout, sm_scale=bmm1, out_scale=bmm2, causal=True,
                            window_left=wl, sinks=sinks)
    cache_d = cache.to(DEV)
    kv = (cache_d[:, 0], cache_d[:, 1]) if as_tuple else cache_d
    out, lse = poisoned((B * q_len, hq, d), dt), poisoned((B * q_len, hq), torch.float32)
    res = trtllm_batch_decode_with_kv_cache(
        q.to(DEV), kv, ws(), table.to(DEV), seq_lens.to(torch.uint32).to(DEV), max(lens), bmm1_scale=bmm1,
        bmm2_scale=bmm2, window_left=wl, out=out, sinks=None if sinks is None else sinks.to(DEV),
        kv_layout=layout, q_len_per_req=q_len, lse=lse, return_lse=True)
    assert res[0] is out and res[1] is lse
    torch.cuda.synchronize()
    check(out.cpu(), lse.cpu(), o_ref, lse_ref, dt, f"trtllm decode {case}")


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("window_left", [-1, 63])
def test_trtllm_decode_fp8_kv(layout, window_left):
    gen = torch.Generator().manual_seed(2)
    lens, ps, hkv, group, d = [129, 1, 2000, 64], 16, 2, 4, 128
    cache, table, seq_lens, csr = make_cache(lens, ps, hkv, d, FP8, layout, gen)
    hq, B = hkv * group, len(lens)
    q = torch.randn(B, hq, d, generator=gen).to(BF16)
    k_scale, v_scale = 0.8, 1.3
    bmm1, bmm2 = k_scale / math.sqrt(d), v_scale
    o_ref, lse_ref = oracle(q, cache, csr, [1] * B, layout, sm_scale=bmm1, out_scale=bmm2, window_left=window_left)
    out = poisoned((B, hq, d), BF16)
    _, lse = trtllm_batch_decode_with_kv_cache(
        q.to(DEV), cache.to(DEV), ws(), table.to(DEV), seq_lens.to(DEV), max(lens), bmm1_scale=bmm1,
        bmm2_scale=bmm2, window_left=window_left, out=out, kv_layout=layout, return_lse=True)
    torch.cuda.synchronize()
    check(out.cpu(), lse.cpu(), o_ref, lse_ref, BF16, f"trtllm decode fp8 {layout} {window_left}")


XQA_CASES = [
    # (kv_lens, page_size, hkv, group, d, kv dtype, q dtype, layout, sliding_win_size, sinks)
    ([37, 1, 300], 16, 2, 4, 128, BF16, BF16, "NHD", 0, False),
    ([37, 1, 300], 32, 2, 4, 128, FP16, FP16, "HND", 16, True),
    ([1000, 2], 64, 1, 8, 64, FP8, BF16, "NHD", 0, True),
    ([1000, 2], 128, 4, 2, 128, FP8, FP16, "HND", 100, False),
]


@pytest.mark.parametrize("case", XQA_CASES, ids=[str(i) for i in range(len(XQA_CASES))])
def test_xqa_in_place(case):
    lens, ps, hkv, group, d, kv_dt, q_dt, layout, win, use_sinks = case
    gen = torch.Generator().manual_seed(3)
    cache, table, seq_lens, csr = make_cache(lens, ps, hkv, d, kv_dt, layout, gen)
    hq, B = hkv * group, len(lens)
    q = torch.randn(B, 1, hq, d, generator=gen).to(q_dt)
    sinks = torch.randn(hkv, group, generator=gen) if use_sinks else None
    q_scale, kv_scale = 1.4, 0.9
    kv = kv_scale if kv_dt == FP8 else 1.0
    o_ref, lse_ref = oracle(q[:, 0], cache, csr, [1] * B, layout, sm_scale=q_scale * kv / math.sqrt(d),
                            out_scale=kv, window_left=win - 1, sinks=None if sinks is None else sinks.reshape(-1))
    cache_d = cache.to(DEV)
    output = poisoned((B, 1, hq, d), q_dt)
    xqa(q.to(DEV), cache_d[:, 0], cache_d[:, 1], table.to(DEV), seq_lens.to(torch.uint32).to(DEV).reshape(B, 1),
        output, ws(), torch.zeros(1 << 20, dtype=torch.uint32, device=DEV), hkv, ps,
        sinks=None if sinks is None else sinks.to(DEV), q_scale=q_scale, kv_scale=kv_scale, sliding_win_size=win,
        kv_layout=layout)
    torch.cuda.synchronize()
    assert not output.isnan().any(), "xqa output not written in place"
    tol = TOL[q_dt]
    err = (output[:, 0].cpu().double() - o_ref).norm() / o_ref.norm()
    assert err <= tol, f"xqa {case}: rel err {err}"


def pack_mask_u16(bits):
    """bool ``[B, q_len, q_len]`` draft mask -> xqa's uint16 ``[B, q_len, ceil(q_len/32)*2]``."""
    B, n, _ = bits.shape
    words = -(-n // 32)
    m = torch.zeros(B, n, words * 2, dtype=torch.int64)
    for j in range(n):
        m[:, :, 2 * (j // 32) + (j % 32) // 16] |= bits[:, :, j].long() << (j % 16)
    return m.to(torch.int32).to(torch.uint16)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("tree", [False, True])
def test_xqa_spec_decode(layout, tree):
    gen = torch.Generator().manual_seed(4)
    lens, ps, hkv, group, d, n = [40, 4, 300], 16, 2, 4, 128, 4
    cache, table, seq_lens, csr = make_cache(lens, ps, hkv, d, BF16, layout, gen)
    hq, B = hkv * group, len(lens)
    q = torch.randn(B, 1, n, hq, d, generator=gen).to(BF16)
    bits = torch.tril(torch.ones(n, n, dtype=torch.bool)).expand(B, n, n).clone()
    if tree:  # a draft tree: some rows do not see every earlier draft token
        bits &= torch.rand(B, n, n, generator=gen) < 0.6
        bits |= torch.eye(n, dtype=torch.bool)
    masks = []
    for b, L in enumerate(lens):
        m = torch.ones(n, L, dtype=torch.bool)
        m[:, L - n:] = bits[b]
        masks.append(m.reshape(-1))
    sm = 1.0 / math.sqrt(d)
    o_ref, lse_ref = oracle(q.reshape(B * n, hq, d), cache, csr, [n] * B, layout, sm_scale=sm, out_scale=1.0,
                            custom_mask=torch.cat(masks))
    cache_d = cache.to(DEV)
    output = poisoned((B, 1, n, hq, d), BF16)
    xqa(q.to(DEV), cache_d[:, 0], cache_d[:, 1], table.to(DEV), seq_lens.to(DEV).reshape(B, 1), output, ws(),
        torch.zeros(16, dtype=torch.uint32, device=DEV), hkv, ps, kv_layout=layout, q_seq_len=n,
        mask=pack_mask_u16(bits).to(DEV))
    torch.cuda.synchronize()
    assert not output.isnan().any()
    err = (output.reshape(B * n, hq, d).cpu().double() - o_ref).norm() / o_ref.norm()
    assert err <= TOL[BF16], f"xqa spec decode: rel err {err}"


CONTEXT_CASES = [
    # (q_lens, kv_lens, page_size, hkv, group, d, dtype, layout, causal, window_left, sinks)
    ([5, 1, 130], [20, 1, 500], 16, 2, 4, 128, BF16, "HND", True, -1, False),
    ([5, 1, 130], [20, 1, 500], 16, 2, 4, 128, FP16, "NHD", True, 63, True),
    ([64, 3], [64, 700], 64, 1, 8, 64, BF16, "HND", False, -1, True),
    ([300], [300], 32, 4, 1, 128, BF16, "NHD", True, 127, False),
]


@pytest.mark.parametrize("case", CONTEXT_CASES, ids=[str(i) for i in range(len(CONTEXT_CASES))])
def test_trtllm_context(case):
    q_lens, kv_lens, ps, hkv, group, d, dt, layout, causal, wl, use_sinks = case
    gen = torch.Generator().manual_seed(5)
    cache, table, seq_lens, csr = make_cache(kv_lens, ps, hkv, d, dt, layout, gen)
    hq, B = hkv * group, len(kv_lens)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dt)
    sinks = torch.randn(hq, generator=gen) if use_sinks else None
    bmm1, bmm2 = 0.9 / math.sqrt(d), 0.6
    o_ref, lse_ref = oracle(q, cache, csr, q_lens, layout, sm_scale=bmm1, out_scale=bmm2, causal=causal,
                            window_left=wl, sinks=sinks)
    cq = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    ckv = torch.tensor([0] + torch.tensor(kv_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    out, lse = poisoned((sum(q_lens), hq, d), dt), poisoned((sum(q_lens), hq), torch.float32)
    trtllm_batch_context_with_kv_cache(
        q.to(DEV), cache.to(DEV), ws(), table.to(DEV), seq_lens.to(DEV), max(q_lens), max(kv_lens), bmm1, bmm2, B,
        cq, ckv, window_left=wl, out=out, kv_layout=layout, sinks=None if sinks is None else sinks.to(DEV),
        causal=causal, lse=lse)
    torch.cuda.synchronize()
    check(out.cpu(), lse.cpu(), o_ref, lse_ref, dt, f"trtllm context {case}")


@pytest.mark.parametrize("q_len", [1, 4])
def test_trtllm_decode_strided_query(q_len):
    # q as the query slice of a packed QKV projection (free token and head strides, head_dim contiguous)
    gen = torch.Generator().manual_seed(6)
    lens, ps, hkv, group, d = [100, 37, 513], 16, 2, 4, 128
    cache, table, seq_lens, csr = make_cache(lens, ps, hkv, d, BF16, "HND", gen)
    hq, B = hkv * group, len(lens)
    qkv = torch.randn(B * q_len, hq + 2 * hkv, d, generator=gen).to(BF16)
    q = qkv[:, :hq]
    bmm1 = 1.0 / math.sqrt(d)
    o_ref, lse_ref = oracle(q.contiguous(), cache, csr, [q_len] * B, "HND", sm_scale=bmm1, out_scale=1.0,
                            causal=True)
    q_dev = qkv.to(DEV)[:, :hq]
    assert not q_dev.is_contiguous()
    out, lse = poisoned((B * q_len, hq, d), BF16), poisoned((B * q_len, hq), torch.float32)
    trtllm_batch_decode_with_kv_cache(q_dev, cache.to(DEV), ws(), table.to(DEV), seq_lens.to(DEV), max(lens),
                                      bmm1_scale=bmm1, out=out, q_len_per_req=q_len, lse=lse)
    torch.cuda.synchronize()
    check(out.cpu(), lse.cpu(), o_ref, lse_ref, BF16, f"trtllm decode strided q, q_len {q_len}")
