"""GPU tests of the prims_ts decode entry points against the float64 oracle ``cutedsl_attn.ref``.

Fresh random inputs every run (the seed is in every failure message).  The cache pool is NaN everywhere a request
owns no slot (unused pages, slots past each length, table tails pointing at a NaN page), the page table is
row-strided (padding between rows), ``out`` is poisoned with NaN.  Covered: one row ``[B, Hq, D]``, fixed rows
``[B, SQ, Hq, D]`` dense and causal, packed rows with ``qo_indptr`` (derived capacity), windows, combined and
separate K/V, ``bmm1_scale`` / ``bmm2_scale``, GQA / MQA, fp16 / bf16; ``BatchDecodePagedTSWrapper`` captured
in a CUDA graph and replayed with new page tables and (runtime-bound) lengths.
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from cutedsl_attn import ref  # noqa: E402
from cutedsl_attn.attention import prims_ts as ts  # noqa: E402
from _checks import NAN, TOL, rel_err  # noqa: E402

DEV = torch.device("cuda")
BF16, FP16 = torch.bfloat16, torch.float16


def new_gen():
    seed = torch.seed() % (2**31)
    return torch.Generator().manual_seed(seed), seed


def make(lens, hq, hkv, d, ps, dtype, gen, *, width=None, pitch_extra=3, total=None):
    """HND pool (NaN outside owned slots), a row-strided ``[B, width]`` table, lengths."""
    B = len(lens)
    npg = [-(-n // ps) for n in lens]
    width = max(npg) + 1 if width is None else width
    total = sum(npg) + 3 if total is None else total
    perm = torch.randperm(total, generator=gen).to(torch.int32)
    nan_page = int(perm[-1])
    cache = torch.full((total, 2, hkv, ps, d), NAN, dtype=dtype)
    vals = torch.randn(cache.shape, generator=gen).to(dtype)
    store = torch.full((B, width + pitch_extra), -7, dtype=torch.int32)  # padding between rows
    o = 0
    for b, (n, L) in enumerate(zip(npg, lens)):
        pages = perm[o:o + n]
        o += n
        store[b, :n] = pages
        store[b, n:width] = nan_page
        for i, pg in enumerate(pages.tolist()):
            k = min(ps, L - i * ps)
            cache[pg, :, :, :k] = vals[pg, :, :, :k]
    table_host = store[:, :width]
    store_dev = store.to(DEV)
    return dict(cache=cache.to(DEV), cache_host=cache, table=store_dev[:, :width], table_host=table_host,
                lens=torch.tensor(lens, dtype=torch.int32, device=DEV), lens_host=torch.tensor(lens), ps=ps, hq=hq,
                hkv=hkv, d=d, dtype=dtype, width=width, total=total)


def oracle(p, q_host, qo_host, *, causal, window_left=-1, sm_scale=None):
    indptr, indices, last = ref.block_tables_to_csr(p["table_host"].contiguous(), p["lens_host"], p["ps"])
    o, _ = ref.paged_prefill(q_host, p["cache_host"], None, qo_host, indptr, indices, last, kv_layout="HND",
                             causal=causal, window_left=window_left, sm_scale=sm_scale)
    return o


def check(out, o_ref, dtype, what, scale=1.0):
    assert not torch.isnan(out).any(), f"{what}: NaN / unwritten output"
    e = rel_err(out.float().cpu() / scale, o_ref)
    assert e <= TOL[dtype], f"{what}: rel err {e}"


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("heads", [(32, 8), (8, 1)])
@pytest.mark.parametrize("combined", [True, False])
def test_one_row(dtype, heads, combined):
    gen, seed = new_gen()
    lens = torch.randint(1, 1500, (7,), generator=gen).tolist()
    p = make(lens, heads[0], heads[1], 128, 16, dtype, gen)
    q = torch.randn(7, heads[0], 128, generator=gen).to(dtype)
    out = torch.full_like(q, NAN).to(DEV)
    cache = p["cache"] if combined else tuple(p["cache"].unbind(1))
    r = ts.batch_decode_with_paged_kv_cache(q.to(DEV), cache, p["table"], p["lens"], bmm1_scale=0.07,
                                            bmm2_scale=0.5, out=out)
    assert r is out
    o_ref = oracle(p, q, torch.arange(8, dtype=torch.int32), causal=False, sm_scale=0.07)
    check(out, o_ref * 0.5, dtype, f"seed {seed} one row {heads} combined={combined}")


@pytest.mark.parametrize("mask", ["dense", "causal"])
@pytest.mark.parametrize("sq", [2, 5])
def test_fixed_rows_token_major(mask, sq):
    gen, seed = new_gen()
    lens = torch.randint(sq, 900, (5,), generator=gen).tolist()
    p = make(lens, 32, 8, 128, 64, BF16, gen)
    q = torch.randn(5, sq, 32, 128, generator=gen).to(BF16)
    out = ts.batch_decode_with_paged_kv_cache(q.to(DEV), p["cache"], p["table"], p["lens"], seq_len_q=sq,
                                              mask_type=mask)
    assert out.shape == (5, sq, 32, 128)
    o_ref = oracle(p, q.reshape(-1, 32, 128), torch.arange(6, dtype=torch.int32) * sq, causal=mask == "causal")
    check(out.reshape(-1, 32, 128), o_ref, BF16, f"seed {seed} sq={sq} {mask}")


@pytest.mark.parametrize("window_left", [-1, 63])
def test_packed_rows_causal_window(window_left):
    gen, seed = new_gen()
    q_lens = [3, 1, 4, 2, 0, 4]
    lens = [max(ql, n) for ql, n in zip(q_lens, torch.randint(1, 700, (6,), generator=gen).tolist())]
    p = make(lens, 16, 4, 64, 16, FP16, gen)
    qo = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(qo[-1]), 16, 64, generator=gen).to(FP16)
    out = ts.batch_decode_with_paged_kv_cache(q.to(DEV), p["cache"], p["table"], p["lens"], qo_indptr=qo.to(DEV),
                                              mask_type="causal", window_left=window_left)
    o_ref = oracle(p, q, qo, causal=True, window_left=window_left)
    check(out, o_ref, FP16, f"seed {seed} packed window {window_left}")


@pytest.mark.parametrize("bind", ["plan", "run"])
@pytest.mark.parametrize("sq", [1, 3])
def test_wrapper_cuda_graph_replay(bind, sq):
    """Plan, capture ``run``, then replay with new tables (and, bound at run, new lengths) in the same buffers."""
    gen, seed = new_gen()
    B, hq, hkv, d, ps, max_kv = 6, 32, 8, 128, 16, 1024
    width, total = max_kv // ps, B * (max_kv // ps) + 3
    lens = torch.randint(sq, max_kv + 1, (B,), generator=gen).tolist()
    p = make(lens, hq, hkv, d, ps, BF16, gen, width=width, total=total)
    w = ts.BatchDecodePagedTSWrapper()
    w.plan(DEV, B, hq, hkv, d, ps, max_kv, max_seq_len_q=sq, q_data_type=BF16, mask_type="causal",
           seq_lens=p["lens"] if bind == "plan" else None)
    shape = (B, hq, d) if sq == 1 else (B, sq, hq, d)
    q_buf = torch.randn(shape, generator=gen).to(BF16).to(DEV)
    cache, table, seq = p["cache"].clone(), p["table"].clone(), p["lens"].clone()
    out = torch.full(shape, NAN, dtype=BF16, device=DEV)
    run_lens = None if bind == "plan" else seq

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        w.run(q_buf, cache, run_lens, table, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q_buf, cache, run_lens, table, out=out)
    for r in range(3):
        new_lens = lens if bind == "plan" else torch.randint(sq, max_kv + 1, (B,), generator=gen).tolist()
        nxt = make(new_lens, hq, hkv, d, ps, BF16, gen, width=width, total=total)
        qn = torch.randn(shape, generator=gen).to(BF16)
        cache.copy_(nxt["cache"])
        table.copy_(nxt["table"])
        seq.copy_(nxt["lens"])
        q_buf.copy_(qn)
        out.fill_(NAN)
        g.replay()
        torch.cuda.synchronize()
        o_ref = oracle(nxt, qn.reshape(-1, hq, d), torch.arange(B + 1, dtype=torch.int32) * sq, causal=True)
        check(out.reshape(-1, hq, d), o_ref, BF16, f"seed {seed} bind={bind} sq={sq} replay {r}")


def test_default_scale_is_inv_sqrt_d():
    gen, seed = new_gen()
    p = make([300, 17], 8, 8, 64, 16, BF16, gen)
    q = torch.randn(2, 8, 64, generator=gen).to(BF16)
    out = ts.batch_decode_with_paged_kv_cache(q.to(DEV), p["cache"], p["table"], p["lens"])
    o_ref = oracle(p, q, torch.arange(3, dtype=torch.int32), causal=False, sm_scale=1 / math.sqrt(64))
    check(out, o_ref, BF16, f"seed {seed} default scale")
