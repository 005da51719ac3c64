"""GPU tests of the paged decode kernel against the float64 oracle (run on an H200).

Fresh random inputs every run, outputs poisoned with NaN before each launch,
relative Frobenius error against ``cutedsl_attn.ref`` (float64).
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import cutedsl_attn as ca
from cutedsl_attn import ref
from _checks import TOL, rel_err  # noqa: E402

DEV = torch.device("cuda")


def make_batch(kv_lens, page_size, hkv, hq, d, dtype, layout, *, gen=None, spare_pages=7):
    """Random paged cache with pages scattered by a random permutation; CSR table."""
    npages = [(-(-L // page_size)) for L in kv_lens]
    total = sum(npages) + spare_pages
    perm = torch.randperm(total, generator=gen)
    indptr = torch.tensor([0] + list(torch.tensor(npages).cumsum(0).tolist()), dtype=torch.int32)
    indices = perm[: sum(npages)].to(torch.int32)
    last = torch.tensor([(L - (n - 1) * page_size) if n > 0 else 0 for L, n in zip(kv_lens, npages)], dtype=torch.int32)
    shape = (total, 2, page_size, hkv, d) if layout == "NHD" else (total, 2, hkv, page_size, d)
    cache = torch.randn(shape, generator=gen).to(dtype).to(DEV)
    q = torch.randn((len(kv_lens), hq, d), generator=gen).to(dtype).to(DEV)
    return q, cache, indptr, indices.to(DEV), last


def oracle(q, cache, indptr, indices, last, layout, **kw):
    o, lse = ref.paged_decode(q.cpu(), cache[:, 0].cpu(), cache[:, 1].cpu(), indptr, indices.cpu(), last,
                              kv_layout=layout, **kw)
    return o, lse


def run_and_check(kv_lens, page_size, hkv, group, d, dtype, layout, *, plan_kw=None, run_kw=None, ref_kw=None):
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    hq = hkv * group
    q, cache, indptr, indices, last = make_batch(kv_lens, page_size, hkv, hq, d, dtype, layout, gen=gen)
    ws = torch.empty(64 << 20, dtype=torch.uint8, device=DEV)
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws, layout)
    w.plan(indptr.to(DEV), indices, last.to(DEV), hq, hkv, d, page_size, q_data_type=dtype, **(plan_kw or {}))
    out = torch.full((len(kv_lens), hq, d), float("nan"), dtype=dtype, device=DEV)
    lse = torch.full((len(kv_lens), hq), float("nan"), dtype=torch.float32, device=DEV)
    w.run(q, cache, out=out, lse=lse, **(run_kw or {}))
    torch.cuda.synchronize()
    o_ref, lse_ref = oracle(q, cache, indptr, indices, last, layout, **(ref_kw or {}))
    assert not torch.isnan(out).any(), "unwritten output"
    e = rel_err(out.cpu(), o_ref)
    assert e <= TOL[dtype], f"output rel err {e}"
    lse_c = lse.cpu().double()
    fin = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse_c), fin), "LSE -inf pattern differs"
    if fin.any():
        assert (lse_c[fin] - lse_ref[fin]).abs().max().item() < 2e-2
    return e


def lens(n, lo, hi, seed=None):
    return torch.randint(lo, hi + 1, (n,)).tolist()


@pytest.mark.parametrize(
    "kv_lens,page_size,hkv,group,d,dtype,layout",
    [
        ([1], 1, 1, 1, 128, torch.bfloat16, "NHD"),
        (lens(7, 1, 300), 16, 2, 4, 128, torch.bfloat16, "NHD"),
        ([15, 16, 17, 31, 32, 33], 16, 2, 8, 64, torch.float16, "HND"),
        (lens(256, 1, 80), 16, 8, 4, 128, torch.bfloat16, "NHD"),
        ([32768, 5], 64, 8, 4, 128, torch.bfloat16, "NHD"),
        (lens(5, 1, 700), 64, 2, 1, 256, torch.bfloat16, "HND"),
        (lens(4, 1, 200), 1, 4, 4, 32, torch.float16, "NHD"),
        ([0] + lens(15, 1, 2000) + [0], 16, 2, 16, 128, torch.bfloat16, "NHD"),
        (lens(9, 1, 500), 3, 3, 5, 128, torch.bfloat16, "NHD"),
        (lens(33, 1000, 4000), 16, 8, 8, 128, torch.float16, "HND"),
    ],
)
def test_decode_sweep(kv_lens, page_size, hkv, group, d, dtype, layout):
    run_and_check(kv_lens, page_size, hkv, group, d, dtype, layout)


@pytest.mark.parametrize(
    "name,plan_kw,run_kw,ref_kw",
    [
        ("window", dict(window_left=37), {}, dict(window_left=37)),
        ("window0", dict(window_left=0), {}, dict(window_left=0)),
        ("softcap", dict(logits_soft_cap=7.0), {}, dict(logits_soft_cap=7.0)),
        ("sm_scale", dict(sm_scale=0.3), {}, dict(sm_scale=0.3)),
        ("alibi", dict(pos_encoding_mode="ALIBI"), {}, dict(pos_encoding_mode="ALIBI")),
        ("rope", dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=5e5, rope_scale=2.0), {},
         dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=5e5, rope_scale=2.0)),
        ("no_split", dict(disable_split_kv=True), {}, {}),
        ("fixed_split", dict(fixed_split_size=3), {}, {}),
    ],
)
def test_decode_features(name, plan_kw, run_kw, ref_kw):
    run_and_check([1, 100, 1777, 4099, 0, 9], 16, 4, 4, 128, torch.bfloat16, "NHD",
                  plan_kw=plan_kw, run_kw=run_kw, ref_kw=ref_kw)


def test_decode_sinks_and_scales():
    hq = 16
    sinks = (torch.randn(hq) * 2).to(DEV)
    run_and_check([1, 300, 5000, 0], 16, 4, 4, 128, torch.bfloat16, "NHD",
                  run_kw=dict(sinks=sinks, q_scale=0.5, k_scale=1.5),
                  ref_kw=dict(sinks=sinks.cpu(), sm_scale=0.75 / math.sqrt(128)))


def test_block_tables_input():
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    kvl = [5, 40, 333]
    q, cache, indptr, indices, last = make_batch(kvl, 16, 2, 8, 128, torch.bfloat16, "NHD", gen=gen)
    bt, sl = ref.csr_to_block_tables(indptr, indices.cpu(), last, 16)
    ws = torch.empty(32 << 20, dtype=torch.uint8, device=DEV)
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(None, None, None, 8, 2, 128, 16, q_data_type=torch.bfloat16,
           block_tables=bt.to(DEV, torch.int32), seq_lens=sl.to(DEV, torch.int32))
    o = w.run(q, cache)
    o_ref, _ = oracle(q, cache, indptr, indices, last, "NHD")
    assert rel_err(o.cpu(), o_ref) <= 1e-2


def test_single_decode():
    for layout in ("NHD", "HND"):
        for kv_len in (1, 77, 3000):
            q = torch.randn(32, 128, device=DEV, dtype=torch.bfloat16)
            shape = (kv_len, 8, 128) if layout == "NHD" else (8, kv_len, 128)
            k = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
            v = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
            o, lse = ca.single_decode_with_kv_cache(q, k, v, kv_layout=layout, return_lse=True)
            kk, vv = (k, v) if layout == "NHD" else (k.transpose(0, 1), v.transpose(0, 1))
            o_ref, lse_ref = ref.attention(q.cpu()[None], kk.cpu(), vv.cpu())
            assert rel_err(o.cpu(), o_ref[0]) <= 1e-2
            assert (lse.cpu().double() - lse_ref[0]).abs().max() < 2e-2


def test_cuda_graph_replay_after_replan():
    B, hkv, group, d, ps = 8, 4, 4, 128, 16
    hq = hkv * group
    max_pages = 4096
    ws = torch.empty(64 << 20, dtype=torch.uint8, device=DEV)
    indptr_buf = torch.empty(B + 1, dtype=torch.int32, device=DEV)
    indices_buf = torch.empty(max_pages, dtype=torch.int32, device=DEV)
    last_buf = torch.empty(B, dtype=torch.int32, device=DEV)
    w = ca.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, indptr_buf, indices_buf, last_buf, "NHD")
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    q, cache, indptr, indices, last = make_batch(lens(B, 1, 3000), ps, hkv, hq, d, torch.bfloat16, "NHD",
                                                 gen=gen, spare_pages=max_pages // 2)
    w.plan(indptr.to(DEV), indices, last.to(DEV), hq, hkv, d, ps, q_data_type=torch.bfloat16)
    out = torch.empty((B, hq, d), dtype=torch.bfloat16, device=DEV)
    lse = torch.empty((B, hq), dtype=torch.float32, device=DEV)
    w.run(q, cache, out=out, lse=lse)  # warm up (compile) outside capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        w.run(q, cache, out=out, lse=lse)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, cache, out=out, lse=lse)
    for trial in range(3):
        # new lengths (incl. long ones that split and an empty one), new pages, same batch size
        new_lens = lens(B, 0, 3000) if trial else [8000, 1, 0, 5, 2048, 17, 9000, 3]
        npg = [(-(-L // ps)) for L in new_lens]
        perm = torch.randperm(cache.shape[0], generator=gen)[: sum(npg)].to(torch.int32)
        indptr = torch.tensor([0] + torch.tensor(npg).cumsum(0).tolist(), dtype=torch.int32)
        last = torch.tensor([(L - (n - 1) * ps) if n else 0 for L, n in zip(new_lens, npg)], dtype=torch.int32)
        w.plan(indptr.to(DEV), perm.to(DEV), last.to(DEV), hq, hkv, d, ps, q_data_type=torch.bfloat16)
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        o_ref, lse_ref = oracle(q, cache, indptr, perm, last, "NHD")
        assert not torch.isnan(out).any()
        assert rel_err(out.cpu(), o_ref) <= 1e-2, trial


def test_real_activations_minilm():
    from cutedsl_attn._demo.realmodel import decode_cases, load_minilm_fixture

    fx = load_minilm_fixture()  # decode = each sentence's last token over all its keys
    n_layers = 0
    for case in decode_cases(fx, page_size=16, dtype=torch.bfloat16, device=DEV):
        ws = torch.empty(16 << 20, dtype=torch.uint8, device=DEV)
        w = ca.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        q = case["q"]
        w.plan(case["kv_indptr"], case["kv_indices"], case["kv_last_page_len"], q.shape[1], case["k_cache"].shape[2],
               q.shape[2], 16, q_data_type=torch.bfloat16, sm_scale=case["sm_scale"])
        o = w.run(q, (case["k_cache"], case["v_cache"]))
        e = rel_err(o.float().cpu(), case["expected"].cpu())
        assert e <= 1e-2, e
        n_layers += 1
    assert n_layers == 6


@pytest.mark.parametrize("q_len,group,window", [(2, 4, -1), (4, 8, 63), (3, 1, -1)])
def test_multirow_decode(q_len, group, window):
    """q_len_per_req > 1 (speculative verify): bottom-right causal rows through the prefill kernel."""
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    hkv, d, ps = 2, 128, 16
    hq = hkv * group
    kvl = [q_len, 37, 300, 1500]
    _, cache, indptr, indices, last = make_batch(kvl, ps, hkv, hq, d, torch.bfloat16, "NHD", gen=gen)
    q = torch.randn((len(kvl) * q_len, hq, d), generator=gen).to(torch.bfloat16).to(DEV)
    ws = torch.empty(32 << 20, dtype=torch.uint8, device=DEV)
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    w.plan(indptr.to(DEV), indices, last.to(DEV), hq, hkv, d, ps, q_data_type=torch.bfloat16,
           q_len_per_req=q_len, window_left=window)
    out = torch.full_like(q, float("nan"))
    o, lse = w.run(q, cache, out=out, return_lse=True)
    torch.cuda.synchronize()
    qo_indptr = torch.arange(len(kvl) + 1, dtype=torch.int32) * q_len
    o_ref, lse_ref = ref.paged_prefill(q.cpu(), cache[:, 0].cpu(), cache[:, 1].cpu(), qo_indptr, indptr,
                                       indices.cpu(), last, kv_layout="NHD", causal=True, window_left=window)
    assert not torch.isnan(out).any()
    assert rel_err(out.cpu(), o_ref) <= 1e-2
    assert (lse.cpu().double() - lse_ref).abs().max() < 2e-2
