"""GPU tests of fp8 e4m3 K/V caches on the decode entry points' requests of several query rows (the portable prefill
kernel, widening e4m3 in shared memory), against the float64 oracle on the dequantised cache (run on an H200).

Fresh random inputs every run (the seed is in every failure message).  Every cache is scattered over its pool with
NaN wherever no request owns a slot (spare pages, the slots past each length, block-table columns past a
request's pages); outputs and LSE are NaN-poisoned before each call.  The scales follow the one table of
``cutedsl_attn.api.trtllm``: the oracle reads ``k_cache * k_scale`` and ``v_cache * v_scale`` with the unscaled
softmax scale, the entry points get them folded (trtllm ``bmm1_scale = sm_scale * k_scale``, ``bmm2_scale =
v_scale``; xqa ``q_scale``, ``kv_scale``; prims_ts ``bmm1_scale`` / ``bmm2_scale``).  Covered: trtllm
``q_len_per_req > 1`` (the public sliding-window case: bf16 q, q_len 8, window 1023, seq_len from 1025 up), xqa
spec-decode with its bit-packed mask, prims_ts in every query layout and its wrapper replayed in a CUDA graph, and
the fp8 kernel against the 16-bit portable kernel on the widened cache (the same values: bit-identical).
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from cutedsl_attn import dispatch, ref  # noqa: E402
from cutedsl_attn.api.prefill_paged import MultiRowDecodePrefillWrapper  # noqa: E402
from cutedsl_attn.api.trtllm import trtllm_batch_decode_with_kv_cache, xqa  # noqa: E402
from cutedsl_attn.attention import prims_ts as ts  # noqa: E402
from cutedsl_attn.ref.paged import block_tables_to_csr, dequantize_kv_cache  # noqa: E402
from _checks import NAN, TOL, rel_err  # noqa: E402

DEV = torch.device("cuda")
BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
#: fp8 noise: the kernel on the quantised cache against the oracle on the values before quantisation (e4m3 keeps 3
#: mantissa bits: about 2.7% rms relative error per element, averaged down by the softmax and P V sums)
FP8_NOISE_TOL = 6e-2


def new_gen():
    seed = torch.seed() % (2**31)
    return torch.Generator().manual_seed(seed), seed


def make_cache(kv_lens, page_size, hkv, d, layout, gen, *, spare_pages=4, extra_cols=2, amp=2.0):
    """A float32 5-D ``[pages, 2, ...]`` cache in ``layout`` (NaN where no request owns a slot), a block table
    whose columns past each request's pages point at NaN spare pages, and the CSR form of the same table."""
    npages = [-(-L // page_size) for L in kv_lens]
    total = sum(npages) + spare_pages
    perm = torch.randperm(total, generator=gen)
    spare = perm[sum(npages):]
    x = torch.randn(total, 2, page_size, hkv, d, generator=gen) * amp
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
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32)
    return x, table, seq_lens, block_tables_to_csr(table, seq_lens, page_size)


def oracle(q, cache, csr, q_lens, layout, *, k_scale, v_scale, sm_scale, **kw):
    """float64 ``(o, lse)`` of ``q`` rows (``q_lens`` per request) over ``cache`` (fp8 or float32) dequantised with
    ``k_scale`` / ``v_scale``, softmax scale ``sm_scale``."""
    qo = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    c = cache.cpu()
    k, v = dequantize_kv_cache(c[:, 0], k_scale), dequantize_kv_cache(c[:, 1], v_scale)
    return ref.paged_prefill(q.cpu(), k, v, qo, *csr, kv_layout=layout, sm_scale=sm_scale, **kw)


def poisoned(shape, dtype):
    return torch.full(shape, NAN, dtype=dtype, device=DEV)


def ws():
    return torch.zeros(64 << 20, dtype=torch.uint8, device=DEV)


def check(out, lse, o_ref, lse_ref, dtype, what, tol=None):
    """O within ``tol`` (default the dtype's) of the oracle, nothing left NaN, LSE within 2e-2, empty rows 0."""
    out = out.detach().cpu()
    assert not torch.isnan(out).any(), f"{what}: NaN / unwritten output"
    e = rel_err(out, o_ref)
    assert e <= (TOL[dtype] if tol is None else tol), f"{what}: output rel err {e}"
    if lse is not None:
        lse = lse.detach().cpu().double()
        assert not torch.isnan(lse).any(), f"{what}: NaN / unwritten LSE"
        fin = torch.isfinite(lse_ref)
        assert torch.equal(torch.isfinite(lse), fin), f"{what}: LSE -inf pattern differs"
        if fin.any():
            dl = (lse[fin] - lse_ref[fin]).abs().max().item()
            assert dl < 2e-2, f"{what}: LSE abs err {dl}"
    return e


# ----------------------------------------------------------------------------- trtllm, q_len_per_req > 1
TRTLLM_CASES = [
    # (kv_lens, page_size, hkv, group, d, q dtype, layout, q_len, window_left, sinks, tuple_cache)
    # the public trtllm bug: bf16 q, fp8 KV, q_len 8, window 1023, seq_len from 1025 up
    ([1025, 1026, 1031, 1032, 1033, 1100, 2047, 2048, 4096, 5000], 16, 8, 4, 128, BF16, "HND", 8, 1023, False,
     False),
    ([1025, 1027, 1040, 1536, 3000], 64, 8, 4, 128, BF16, "NHD", 8, 1023, False, True),
    ([1025, 1029, 2100], 32, 2, 8, 128, BF16, "HND", 8, 1023, True, False),
    ([8, 37, 300, 1000], 1, 2, 4, 64, FP16, "NHD", 4, -1, False, False),
    ([40, 700, 9], 32, 4, 2, 256, BF16, "HND", 3, -1, True, True),
    ([129, 64, 2000], 64, 2, 8, 128, FP16, "HND", 5, 100, True, False),
    ([16, 17, 250], 16, 1, 16, 32, BF16, "NHD", 2, 7, False, False),
]


@pytest.mark.parametrize("case", TRTLLM_CASES, ids=[str(i) for i in range(len(TRTLLM_CASES))])
def test_trtllm_multirow_fp8(case):
    lens, ps, hkv, group, d, dt, layout, q_len, wl, use_sinks, as_tuple = case
    gen, seed = new_gen()
    x, table, seq_lens, csr = make_cache(lens, ps, hkv, d, layout, gen)
    cache = x.to(FP8)
    hq, B = hkv * group, len(lens)
    q = torch.randn(B * q_len, hq, d, generator=gen).to(dt)
    sinks = torch.randn(hq, generator=gen) if use_sinks else None
    k_scale, v_scale, sm = 0.45, 1.6, 1 / math.sqrt(d)
    kw = dict(causal=True, window_left=wl, sinks=sinks)
    o_ref, lse_ref = oracle(q, cache, csr, [q_len] * B, layout, k_scale=k_scale, v_scale=v_scale, sm_scale=sm, **kw)
    cache_d = cache.to(DEV)
    kv = (cache_d[:, 0], cache_d[:, 1]) if as_tuple else cache_d
    out, lse = poisoned((B * q_len, hq, d), dt), poisoned((B * q_len, hq), torch.float32)
    trtllm_batch_decode_with_kv_cache(
        q.to(DEV), kv, ws(), table.to(DEV), seq_lens.to(torch.uint32).to(DEV), max(lens), bmm1_scale=sm * k_scale,
        bmm2_scale=v_scale, window_left=wl, out=out, sinks=None if sinks is None else sinks.to(DEV),
        kv_layout=layout, q_len_per_req=q_len, lse=lse, return_lse=True)
    torch.cuda.synchronize()
    what = f"seed {seed} trtllm fp8 {case[1:]}"
    check(out, lse, o_ref, lse_ref, dt, f"{what} vs the dequantised oracle")
    # quantisation noise only: the oracle on the float32 values the cache was quantised from
    o_hi, _ = oracle(q, x, csr, [q_len] * B, layout, k_scale=k_scale, v_scale=v_scale, sm_scale=sm, **kw)
    check(out, None, o_hi, None, dt, f"{what} vs the unquantised oracle", tol=FP8_NOISE_TOL)


@pytest.mark.parametrize("dt,layout", [(BF16, "HND"), (FP16, "NHD")])
def test_fp8_kernel_equals_16bit_kernel_on_widened_cache(monkeypatch, dt, layout):
    """e4m3 widens exactly to q's dtype: the fp8 build and the 16-bit portable build on the widened cache read the
    same values through the same main loop, so they agree bit for bit (the sliding-window case, NaN slots in
    both)."""
    gen, seed = new_gen()
    lens, ps, hkv, group, d, q_len, wl = [1025, 1031, 2048, 3000], 16, 4, 4, 128, 8, 1023
    x, table, seq_lens, _ = make_cache(lens, ps, hkv, d, layout, gen)
    cache8 = x.to(FP8).to(DEV)
    hq, B = hkv * group, len(lens)
    q = torch.randn(B * q_len, hq, d, generator=gen).to(dt).to(DEV)
    args = (ws(), table.to(DEV), seq_lens.to(DEV), max(lens))
    kw = dict(bmm1_scale=0.07, bmm2_scale=1.3, window_left=wl, kv_layout=layout, q_len_per_req=q_len,
              return_lse=True)
    out8, lse8 = trtllm_batch_decode_with_kv_cache(q, cache8, *args, **kw)
    monkeypatch.setenv(dispatch.PREFILL_KERNEL_ENV, "portable")  # the 16-bit twin of the same kernel
    out16, lse16 = trtllm_batch_decode_with_kv_cache(q, cache8.to(dt), *args, **kw)
    torch.cuda.synchronize()
    assert not torch.isnan(out8).any()
    diff = (out8.float() - out16.float()).abs().max().item()
    assert torch.equal(out8, out16), f"seed {seed}: fp8 and widened 16-bit outputs differ by up to {diff}"
    assert torch.equal(lse8, lse16), f"seed {seed}: LSE differs"


# ----------------------------------------------------------------------------- xqa spec-decode
def pack_mask_u16(bits):
    """bool ``[B, q_len, q_len]`` draft mask -> xqa's uint16 ``[B, q_len, ceil(q_len/32)*2]``."""
    B, n, _ = bits.shape
    words = -(-n // 32)
    m = torch.zeros(B, n, words * 2, dtype=torch.int64)
    for j in range(n):
        m[:, :, 2 * (j // 32) + (j % 32) // 16] |= bits[:, :, j].long() << (j % 16)
    return m.to(torch.int32).to(torch.uint16)


@pytest.mark.parametrize("layout,dt,n,tree", [("NHD", BF16, 4, False), ("HND", BF16, 7, True),
                                             ("NHD", FP16, 33, True), ("HND", FP16, 2, False)])
def test_xqa_spec_decode_fp8(layout, dt, n, tree):
    gen, seed = new_gen()
    lens, ps, hkv, group, d = [max(n, 40), n, 1300], 64, 2, 8, 128
    x, table, seq_lens, csr = make_cache(lens, ps, hkv, d, layout, gen)
    cache = x.to(FP8)
    hq, B = hkv * group, len(lens)
    q = torch.randn(B, 1, n, hq, d, generator=gen).to(dt)
    bits = torch.tril(torch.ones(n, n, dtype=torch.bool)).expand(B, n, n).clone()
    if tree:  # a draft tree: some rows do not see every earlier draft token
        bits &= torch.rand(B, n, n, generator=gen) < 0.6
        bits |= torch.eye(n, dtype=torch.bool)
    masks = []
    for b, L in enumerate(lens):
        m = torch.ones(n, L, dtype=torch.bool)
        m[:, L - n:] = bits[b]
        masks.append(m.reshape(-1))
    q_scale, kv_scale = 1.3, 0.7
    # xqa: logits q_scale * kv_scale / sqrt(D) on the stored values, output x kv_scale
    o_ref, lse_ref = oracle(q.reshape(B * n, hq, d), cache, csr, [n] * B, layout, k_scale=kv_scale,
                            v_scale=kv_scale, sm_scale=q_scale / math.sqrt(d), custom_mask=torch.cat(masks))
    cache_d = cache.to(DEV)
    output = poisoned((B, 1, n, hq, d), dt)
    xqa(q.to(DEV), cache_d[:, 0], cache_d[:, 1], table.to(DEV), seq_lens.to(torch.uint32).to(DEV).reshape(B, 1),
        output, ws(), torch.zeros(16, dtype=torch.uint32, device=DEV), hkv, ps, q_scale=q_scale, kv_scale=kv_scale,
        kv_layout=layout, q_seq_len=n, mask=pack_mask_u16(bits).to(DEV))
    torch.cuda.synchronize()
    check(output.reshape(B * n, hq, d), None, o_ref, None, dt, f"seed {seed} xqa fp8 {layout} n={n} tree={tree}")


# ----------------------------------------------------------------------------- prims_ts, every query layout
def ts_cache(lens, hq, hkv, d, ps, gen):
    """An HND fp8 pool (NaN outside owned slots), a row-strided block table (padding between rows), the CSR form."""
    x, table, seq_lens, csr = make_cache(lens, ps, hkv, d, "HND", gen)
    store = torch.full((len(lens), table.shape[1] + 3), -7, dtype=torch.int32)
    store[:, :table.shape[1]] = table
    return x, x.to(FP8), store.to(DEV)[:, :table.shape[1]], seq_lens, csr


@pytest.mark.parametrize("layout,mask,wl", [("sq1", "dense", -1), ("fixed", "dense", -1), ("fixed", "causal", -1),
                                           ("packed", "causal", 63), ("packed", "dense", -1)])
@pytest.mark.parametrize("dt", [BF16, FP16])
def test_prims_ts_fp8(layout, mask, wl, dt):
    gen, seed = new_gen()
    sq = 5 if layout == "fixed" else 1
    q_lens = [sq] * 6 if layout != "packed" else [3, 1, 4, 2, 0, 4]
    lens = [max(ql, n) for ql, n in zip(q_lens, torch.randint(1, 1500, (6,), generator=gen).tolist())]
    hq, hkv, d, ps = 32, 8, 128, 16
    x, cache, table, seq_lens, csr = ts_cache(lens, hq, hkv, d, ps, gen)
    k_scale, v_scale, sm = 0.6, 1.4, 1 / math.sqrt(d)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dt)
    o_ref, _ = oracle(q, cache, csr, q_lens, "HND", k_scale=k_scale, v_scale=v_scale, sm_scale=sm,
                      causal=mask == "causal", window_left=wl)
    kw = dict(bmm1_scale=sm * k_scale, bmm2_scale=v_scale, mask_type=mask, window_left=wl)
    if layout == "fixed":
        qd, kw["seq_len_q"] = q.reshape(6, sq, hq, d).to(DEV), sq
    elif layout == "packed":
        qd = q.to(DEV)
        kw["qo_indptr"] = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32).to(DEV)
    else:
        qd = q.to(DEV)
    out = poisoned(qd.shape, dt)
    r = ts.batch_decode_with_paged_kv_cache(qd, cache.to(DEV), table, seq_lens.to(DEV), out=out, **kw)
    torch.cuda.synchronize()
    assert r is out
    check(out.reshape(-1, hq, d), None, o_ref, None, dt, f"seed {seed} prims_ts fp8 {layout} {mask} {wl}")


@pytest.mark.parametrize("sq", [1, 3])
def test_prims_ts_wrapper_fp8_cuda_graph(sq):
    """Plan once with runtime-bound lengths, capture run(), replay with new lengths and new cache contents (NaN in
    every slot past the new lengths and in the pages no request owns)."""
    gen, seed = new_gen()
    B, hq, hkv, d, ps, max_kv = 4, 16, 4, 128, 16, 2048
    x, cache, table, _, _ = ts_cache([max_kv] * B, hq, hkv, d, ps, gen)  # each row's pages cover max_kv
    table_host = table.cpu()
    cache_d = cache.to(DEV)
    lens_d = torch.tensor([max_kv, 1500, 700, sq], dtype=torch.int32, device=DEV)
    w = ts.BatchDecodePagedTSWrapper()
    w.plan(DEV, B, hq, hkv, d, ps, max_kv, max_seq_len_q=sq, q_data_type=BF16, kv_data_type=FP8,
           mask_type="causal")
    qd = torch.randn((B, hq, d) if sq == 1 else (B, sq, hq, d), generator=gen).to(BF16).to(DEV)
    out = poisoned(qd.shape, BF16)
    w.run(qd, cache_d, lens_d, table, bmm1_scale=0.05, bmm2_scale=0.8, out=out)  # compiled and warm
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(qd, cache_d, lens_d, table, bmm1_scale=0.05, bmm2_scale=0.8, out=out)
    npg = max_kv // ps
    for it in range(2):
        new_lens = [max(sq, int(n)) for n in torch.randint(1, max_kv + 1, (B,), generator=gen)]
        fresh = torch.randn(cache.shape, generator=gen) * 2  # HND [pages, 2, Hkv, page_size, D]
        owned = torch.zeros(cache.shape[0], dtype=torch.bool)
        owned[table_host[:, :npg].reshape(-1).long()] = True
        fresh[~owned] = NAN
        for b, L in enumerate(new_lens):
            for c in range(L // ps, npg):
                fresh[int(table_host[b, c]), :, :, max(0, L - c * ps):] = NAN
        cache_d.copy_(fresh.to(FP8).to(DEV))
        lens_d.copy_(torch.tensor(new_lens, dtype=torch.int32))
        out.fill_(NAN)
        g.replay()
        torch.cuda.synchronize()
        csr = block_tables_to_csr(table_host.contiguous(), torch.tensor(new_lens, dtype=torch.int32), ps)
        o_ref, _ = oracle(qd.reshape(-1, hq, d), cache_d, csr, [sq] * B, "HND", k_scale=1.0, v_scale=0.8,
                          sm_scale=0.05, causal=True)
        check(out.reshape(-1, hq, d), None, o_ref, None, BF16, f"seed {seed} replay {it} sq={sq} lens {new_lens}")


# ----------------------------------------------------------------------------- the wrapper's other options
@pytest.mark.parametrize("feature", ["rope", "soft_cap", "alibi"])
def test_multirow_wrapper_fp8_options(feature):
    """Options the multi-row wrapper plans with an fp8 cache (RoPE rotates the widened K tile in shared memory)."""
    gen, seed = new_gen()
    lens, ps, hkv, group, d, q_len = [300, 1025, 64], 16, 2, 4, 128, 6
    x, table, seq_lens, csr = make_cache(lens, ps, hkv, d, "NHD", gen)
    cache = x.to(FP8)
    hq, B = hkv * group, len(lens)
    q = torch.randn(B * q_len, hq, d, generator=gen).to(BF16)
    opt = dict(rope=dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=5e5), soft_cap=dict(logits_soft_cap=8.0),
               alibi=dict(pos_encoding_mode="ALIBI"))[feature]
    k_scale, v_scale, sm = 0.5, 2.0, 1 / math.sqrt(d)
    o_ref, lse_ref = oracle(q, cache, csr, [q_len] * B, "NHD", k_scale=k_scale, v_scale=v_scale, sm_scale=sm,
                            causal=True, **opt)
    w = MultiRowDecodePrefillWrapper(ws(), "NHD", backend="cute")
    qo = (torch.arange(B + 1, dtype=torch.int32) * q_len).to(DEV)
    w.plan(qo, None, None, None, hq, hkv, d, ps, causal=True, sm_scale=sm, q_data_type=BF16, kv_data_type=FP8,
           block_tables=table.to(DEV), seq_lens=seq_lens.to(DEV), **opt)
    out, lse = poisoned((B * q_len, hq, d), BF16), poisoned((B * q_len, hq), torch.float32)
    w.run(q.to(DEV), cache.to(DEV), k_scale=k_scale, v_scale=v_scale, out=out, lse=lse)
    torch.cuda.synchronize()
    check(out, lse, o_ref, lse_ref, BF16, f"seed {seed} multirow wrapper fp8 {feature}")
