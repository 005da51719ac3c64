"""GPU tests of ``BatchDecodeWithPagedKVCacheWrapper`` with ``q_len_per_req > 1`` over an fp8 e4m3 cache
(``kv_data_type=torch.float8_e4m3fn``: the portable prefill kernel, widening e4m3 in shared memory), against the
float64 oracle on the dequantised cache (run on an H200).

Fresh random inputs every run (the seed is in every failure message).  Every cache is scattered over its pool with
NaN wherever no request owns a slot (spare pages, the slots past each length, block-table columns past a request's
pages); outputs and LSE are NaN-poisoned before each call.  Scales as the decode wrapper's row of the table in
``cutedsl_attn.api.trtllm``: ``run(q_scale=, k_scale=, v_scale=)`` gives logits ``sm_scale * q_scale * k_scale *
q.k`` on the stored values and an output times ``v_scale``; the oracle reads ``k_cache * k_scale`` and ``v_cache *
v_scale`` with softmax scale ``sm_scale * q_scale``.
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import cutedsl_attn as ca  # noqa: E402
from _checks import NAN  # noqa: E402
from test_fp8_multirow_gpu import FP8_NOISE_TOL, check, make_cache, new_gen, oracle, poisoned, ws  # noqa: E402

DEV = torch.device("cuda")
BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
PS = 16
#: a length equal to q_len (set per case), page boundaries on both sides, a long request split over many pages
LENS = [16, 17, 32, 33, 250, 1500]


def _plan(w, csr, table, seq_lens, hq, hkv, d, dt, q_len, page_table, **kw):
    if page_table == "csr":
        indptr, indices, last = csr
        w.plan(indptr.to(DEV), indices.to(DEV), last.to(DEV), hq, hkv, d, PS, q_data_type=dt, kv_data_type=FP8,
               q_len_per_req=q_len, **kw)
    else:
        w.plan(None, None, None, hq, hkv, d, PS, q_data_type=dt, kv_data_type=FP8, q_len_per_req=q_len,
               block_tables=table.to(DEV), seq_lens=seq_lens.to(DEV), **kw)


@pytest.mark.parametrize("page_table", ["csr", "block_tables"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dt", [BF16, FP16])
@pytest.mark.parametrize("q_len", [2, 4])
def test_decode_wrapper_multirow_fp8(q_len, dt, layout, page_table):
    gen, seed = new_gen()
    lens = [q_len] + LENS
    hkv, group, d = 2, 4, 128
    hq, B = hkv * group, len(lens)
    x, table, seq_lens, csr = make_cache(lens, PS, hkv, d, layout, gen)
    cache = x.to(FP8)
    q = torch.randn(B * q_len, hq, d, generator=gen).to(dt)
    q_scale, k_scale, v_scale, sm = 1.2, 0.45, 1.6, 1 / math.sqrt(d)
    o_ref, lse_ref = oracle(q, cache, csr, [q_len] * B, layout, k_scale=k_scale, v_scale=v_scale,
                            sm_scale=sm * q_scale, causal=True)
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), layout, use_tensor_cores=True)
    _plan(w, csr, table, seq_lens, hq, hkv, d, dt, q_len, page_table)
    out, lse = poisoned((B * q_len, hq, d), dt), poisoned((B * q_len, hq), torch.float32)
    r = w.run(q.to(DEV), cache.to(DEV), q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse,
              return_lse=True)
    torch.cuda.synchronize()
    assert r[0] is out and r[1] is lse
    what = f"seed {seed} decode wrapper fp8 q_len={q_len} {dt} {layout} {page_table}"
    check(out, lse, o_ref, lse_ref, dt, f"{what} vs the dequantised oracle")
    # quantisation noise only: the oracle on the float32 values the cache was quantised from
    o_hi, _ = oracle(q, x, csr, [q_len] * B, layout, k_scale=k_scale, v_scale=v_scale, sm_scale=sm * q_scale,
                     causal=True)
    check(out, None, o_hi, None, dt, f"{what} vs the unquantised oracle", tol=FP8_NOISE_TOL)


@pytest.mark.parametrize("q_len", [2, 4])
def test_decode_wrapper_multirow_fp8_window_sinks(q_len):
    """A left window (keys dropped for the early rows but not the last) and per-head sinks over the fp8 cache."""
    gen, seed = new_gen()
    lens = [q_len, 40, 300, 1025]
    hkv, group, d, wl, layout = 4, 4, 128, 100, "HND"
    hq, B = hkv * group, len(lens)
    x, table, seq_lens, csr = make_cache(lens, PS, hkv, d, layout, gen)
    cache = x.to(FP8)
    q = torch.randn(B * q_len, hq, d, generator=gen).to(BF16)
    sinks = torch.randn(hq, generator=gen)
    k_scale, v_scale, sm = 0.7, 1.3, 0.09
    o_ref, lse_ref = oracle(q, cache, csr, [q_len] * B, layout, k_scale=k_scale, v_scale=v_scale, sm_scale=sm,
                            causal=True, window_left=wl, sinks=sinks)
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws(), layout, use_tensor_cores=True)
    _plan(w, csr, table, seq_lens, hq, hkv, d, BF16, q_len, "block_tables", window_left=wl, sm_scale=sm)
    out, lse = poisoned((B * q_len, hq, d), BF16), poisoned((B * q_len, hq), torch.float32)
    w.run(q.to(DEV), cache.to(DEV), k_scale=k_scale, v_scale=v_scale, out=out, lse=lse, return_lse=True,
          sinks=sinks.to(DEV))
    torch.cuda.synchronize()
    check(out, lse, o_ref, lse_ref, BF16, f"seed {seed} decode wrapper fp8 q_len={q_len} window {wl} sinks")


def test_decode_wrapper_multirow_fp8_cuda_graph_replay_after_replan():
    """CUDA-graph mode: plan, capture run(), re-plan new lengths and pages of the same batch size, replay (the
    graph keeps the plan buffers' addresses); NaN in every slot no request owns after the re-plan."""
    gen, seed = new_gen()
    B, q_len, hkv, group, d, layout, max_kv = 4, 3, 2, 8, 128, "NHD", 2000
    hq = hkv * group
    pool = B * -(-max_kv // PS) + 8  # one pool size for every batch below (the graph keeps its address)
    bufs = (torch.empty(B + 1, dtype=torch.int32, device=DEV), torch.empty(pool, dtype=torch.int32, device=DEV),
            torch.empty(B, dtype=torch.int32, device=DEV))
    w = ca.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws(), *bufs, kv_layout=layout, use_tensor_cores=True)

    def batch(lens):
        x, _, _, csr = make_cache(lens, PS, hkv, d, layout, gen, spare_pages=pool - sum(-(-L // PS) for L in lens))
        return x, csr

    x, csr = batch([q_len, 700, 33, max_kv])
    cache_d = x.to(FP8).to(DEV)
    _plan(w, csr, None, None, hq, hkv, d, BF16, q_len, "csr")
    q = torch.randn(B * q_len, hq, d, generator=gen).to(BF16).to(DEV)
    out = poisoned((B * q_len, hq, d), BF16)
    kw = dict(k_scale=0.5, v_scale=1.5, out=out)
    w.run(q, cache_d, **kw)  # compiled and warm outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, cache_d, **kw)
    for trial in range(2):
        new_lens = [max(q_len, int(n)) for n in torch.randint(1, max_kv + 1, (B,), generator=gen)]
        x, csr = batch(new_lens)
        cache_d.copy_(x.to(FP8).to(DEV))
        _plan(w, csr, None, None, hq, hkv, d, BF16, q_len, "csr")
        q.copy_(torch.randn(q.shape, generator=gen).to(BF16))
        out.fill_(NAN)
        g.replay()
        torch.cuda.synchronize()
        o_ref, _ = oracle(q, cache_d, csr, [q_len] * B, layout, k_scale=0.5, v_scale=1.5, sm_scale=1 / math.sqrt(d),
                          causal=True)
        check(out, None, o_ref, None, BF16, f"seed {seed} graph replay {trial} lens {new_lens}")
