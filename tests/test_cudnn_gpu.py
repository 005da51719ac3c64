"""GPU tests of the ``backend="cudnn"`` prefill path (cuDNN frontend graphs) against the float64 oracle.

Fresh random inputs every run (the seed is in every failure message); ``out`` and ``lse`` are
poisoned with NaN before each call; O is compared with ``cutedsl_attn.ref`` (float64, on the GPU)
by relative Frobenius error (bf16 <= 1e-2, fp16 <= 4e-3), the LSE by its -inf pattern (rows
with no visible key) and its finite values (base 2, abs err < 2e-2).

Needs a CUDA GPU and an importable ``cudnn`` (cudnn-frontend); skipped otherwise.  Written for
the H200 + torch 2.11+cu130 (cuDNN 9.19) + cudnn-frontend 1.32 image; they pass there.
About 20 distinct cuDNN graphs are built (tens of ms to ~1 s each).
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from cutedsl_attn.cudnn import prefill as cp  # noqa: E402

if not cp.cudnn_available():
    pytest.skip("needs cudnn-frontend (pip install 'cutedsl-attn[cudnn]')", allow_module_level=True)

import cutedsl_attn as ca  # noqa: E402
from cutedsl_attn import ref  # noqa: E402
from _checks import check  # noqa: E402

DEV = torch.device("cuda")
BF16, FP16 = torch.bfloat16, torch.float16
LN2 = math.log(2.0)

# qo != kv, qo > kv (causal: the first qo - kv rows see nothing), an empty request (qo 0), a request
# with an empty KV (qo 5, kv 0), one long request
MIXED_QO = [1, 17, 300, 0, 64, 1000, 5, 130]
MIXED_KV = [1, 300, 17, 50, 64, 2048, 0, 130]


def new_gen():
    seed = torch.seed() % (2**31)
    return torch.Generator().manual_seed(seed), seed


def indptr(lens):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


def workspace(nbytes=128 << 20):
    return torch.empty(nbytes, dtype=torch.uint8, device=DEV)


def test_versions():
    """cuDNN loaded by the frontend is the one torch uses (two libcudnn copies exist on the device image)."""
    cudnn = cp.require_cudnn()
    print(f"cudnn-frontend {cudnn.__version__}, cuDNN backend {cudnn.backend_version()}, "
          f"torch cuDNN {torch.backends.cudnn.version()}, GPU {torch.cuda.get_device_name()}")
    assert cudnn.backend_version() == torch.backends.cudnn.version()


# ----------------------------------------------------------------------------- ragged wrapper
def run_ragged(qo, kv, hkv, group, d, dtype, layout="NHD", *, causal, window_left=-1, sm_scale=None):
    gen, seed = new_gen()
    hq = hkv * group
    q = torch.randn(sum(qo), hq, d, generator=gen).to(dtype).to(DEV)
    k = torch.randn(sum(kv), hkv, d, generator=gen).to(dtype).to(DEV)
    v = torch.randn(sum(kv), hkv, d, generator=gen).to(dtype).to(DEV)
    k_in, v_in = (k, v) if layout == "NHD" else (k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous())
    w = ca.BatchPrefillWithRaggedKVCacheWrapper(workspace(), layout, backend="cudnn")
    w.plan(indptr(qo).to(DEV), indptr(kv).to(DEV), hq, hkv, d, causal=causal, window_left=window_left,
           sm_scale=sm_scale, q_data_type=dtype)
    out = torch.full((sum(qo), hq, d), float("nan"), dtype=dtype, device=DEV)
    lse = torch.full((sum(qo), hq), float("nan"), dtype=torch.float32, device=DEV)
    w.run(q, k_in, v_in, out=out, lse=lse)
    torch.cuda.synchronize()
    o_ref, lse_ref = ref.ragged_prefill(q, k, v, indptr(qo), indptr(kv), causal=causal, window_left=window_left,
                                        sm_scale=sm_scale)
    return check(out, lse, o_ref, lse_ref, dtype, f"seed {seed} ragged {layout} causal={causal} d={d}")


@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_ragged_gqa_32_8(d, causal):
    run_ragged(MIXED_QO, MIXED_KV, 8, 4, d, BF16, causal=causal)


def test_ragged_random_lengths_fp16():
    gen, _ = new_gen()
    qo = torch.randint(1, 700, (6,), generator=gen).tolist()
    kv = [q + int(x) for q, x in zip(qo, torch.randint(0, 900, (6,), generator=gen))]
    run_ragged(qo, kv, 8, 4, 128, FP16, causal=True)


def test_ragged_causal_window():
    run_ragged([40, 300, 7], [40, 600, 100], 8, 4, 128, BF16, causal=True, window_left=31)


def test_ragged_lse_base_and_layout():
    gen, seed = new_gen()
    qo, kv = [33, 200], [50, 200]
    hq, hkv, d = 32, 8, 128
    q = torch.randn(sum(qo), hq, d, generator=gen).to(BF16).to(DEV)
    k = torch.randn(sum(kv), hkv, d, generator=gen).to(BF16).to(DEV)
    v = torch.randn(sum(kv), hkv, d, generator=gen).to(BF16).to(DEV)
    w = ca.BatchPrefillWithRaggedKVCacheWrapper(workspace(1 << 10), "NHD", backend="cudnn")  # tiny: own workspace
    w.plan(indptr(qo).to(DEV), indptr(kv).to(DEV), hq, hkv, d, causal=True, q_data_type=BF16)
    out, lse_hn = w.run(q, k, v, return_lse=True, lse_base="ln", lse_layout="HN")
    torch.cuda.synchronize()
    o_ref, lse_ref = ref.ragged_prefill(q, k, v, indptr(qo), indptr(kv), causal=True)
    check(out, lse_hn.t() / LN2, o_ref, lse_ref, BF16, f"seed {seed} lse ln/HN")


def test_plan_reuses_graph():
    """Re-planning a batch of the same bucketed shape reuses the cached graph (no rebuild)."""
    run_ragged([5, 9, 30], [7, 9, 50], 8, 4, 128, BF16, causal=True)
    before = cp.graph_cache_info()
    run_ragged([1, 100, 2], [120, 100, 3], 8, 4, 128, BF16, causal=True)  # same buckets: B 4, S_q/S_kv 128
    after = cp.graph_cache_info()
    assert after["builds"] == before["builds"], "a re-plan within the same buckets rebuilt the graph"
    assert after["hits"] > before["hits"]


# ----------------------------------------------------------------------------- paged wrapper
def make_paged(qo, kv, hq, hkv, d, ps, dtype, layout, gen, spare=7):
    npages = [-(-x // ps) for x in kv]
    pool = sum(npages) + spare
    indices = torch.randperm(pool, generator=gen)[: sum(npages)].to(torch.int32)
    last = torch.tensor([x - (n - 1) * ps if n else 0 for x, n in zip(kv, npages)], dtype=torch.int32)
    shape = (pool, 2, ps, hkv, d) if layout == "NHD" else (pool, 2, hkv, ps, d)
    cache = torch.randn(shape, generator=gen).to(dtype).to(DEV)
    q = torch.randn(sum(qo), hq, d, generator=gen).to(dtype).to(DEV)
    return q, cache, indptr(npages), indices, last


@pytest.mark.parametrize("ps,layout", [(16, "NHD"), (64, "HND")])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", [128, 64])
def test_paged_gqa_32_8(ps, layout, causal, d):
    gen, seed = new_gen()
    hq, hkv = 32, 8
    q, cache, kv_ip, idx, last = make_paged(MIXED_QO, MIXED_KV, hq, hkv, d, ps, BF16, layout, gen)
    w = ca.BatchPrefillWithPagedKVCacheWrapper(workspace(), layout, backend="cudnn")
    w.plan(indptr(MIXED_QO).to(DEV), kv_ip.to(DEV), idx.to(DEV), last.to(DEV), hq, hkv, d, ps, causal=causal,
           q_data_type=BF16)
    out = torch.full((sum(MIXED_QO), hq, d), float("nan"), dtype=BF16, device=DEV)
    lse = torch.full((sum(MIXED_QO), hq), float("nan"), dtype=torch.float32, device=DEV)
    w.run(q, cache, out=out, lse=lse)
    torch.cuda.synchronize()
    o_ref, lse_ref = ref.paged_prefill(q, cache, None, indptr(MIXED_QO), kv_ip, idx, last, kv_layout=layout,
                                       causal=causal)
    check(out, lse, o_ref, lse_ref, BF16, f"seed {seed} paged ps={ps} {layout} causal={causal} d={d}")


def test_paged_block_tables_tuple_cache():
    gen, seed = new_gen()
    qo, kv = [4, 170, 2, 33], [300, 170, 1000, 20]
    hq, hkv, d, ps = 32, 8, 128, 16
    q, cache, kv_ip, idx, last = make_paged(qo, kv, hq, hkv, d, ps, BF16, "NHD", gen)
    bt, seq = ref.csr_to_block_tables(kv_ip, idx, last, ps)
    w = ca.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD", backend="cudnn")
    w.plan(indptr(qo).to(DEV), None, None, None, hq, hkv, d, ps, causal=True, q_data_type=BF16,
           block_tables=bt.to(DEV), seq_lens=seq.to(DEV))
    lse = torch.full((sum(qo), hq), float("nan"), dtype=torch.float32, device=DEV)
    out = w.run(q, (cache[:, 0], cache[:, 1]), lse=lse)
    torch.cuda.synchronize()
    o_ref, lse_ref = ref.paged_prefill(q, cache, None, indptr(qo), kv_ip, idx, last, causal=True)
    check(out, lse, o_ref, lse_ref, BF16, f"seed {seed} paged block_tables")


def test_sinks_not_implemented():
    w = ca.BatchPrefillWithRaggedKVCacheWrapper(workspace(1 << 10), "NHD", backend="cudnn")
    w.plan(indptr([4]).to(DEV), indptr([4]).to(DEV), 4, 4, 64, q_data_type=BF16)
    q = torch.randn(4, 4, 64, device=DEV, dtype=BF16)
    k = torch.randn(4, 4, 64, device=DEV, dtype=BF16)
    with pytest.raises(NotImplementedError, match="sinks"):
        w.run(q, k, k, sinks=torch.zeros(4, device=DEV))


# ----------------------------------------------------------------------------- the raw function
@pytest.mark.parametrize("units", ["elements", "tokens"])
def test_raw_ragged(units):
    gen, seed = new_gen()
    qo, kv = [17, 300, 1, 64], [300, 17, 40, 64]
    hq, hkv, d = 32, 8, 128
    q = torch.randn(sum(qo), hq, d, generator=gen).to(BF16).to(DEV)
    k = torch.randn(sum(kv), hkv, d, generator=gen).to(BF16).to(DEV)
    v = torch.randn(sum(kv), hkv, d, generator=gen).to(BF16).to(DEV)
    qi, ki = indptr(qo).to(DEV), indptr(kv).to(DEV)
    lens = dict(actual_seq_lens_q=torch.tensor(qo, dtype=torch.int32, device=DEV).reshape(-1, 1, 1, 1),
                actual_seq_lens_kv=torch.tensor(kv, dtype=torch.int32, device=DEV).reshape(-1, 1, 1, 1))
    if units == "elements":
        offs = dict(batch_offsets_q=qi * hq * d, batch_offsets_o=qi * hq * d, batch_offsets_k=ki * hkv * d,
                    batch_offsets_v=ki * hkv * d)
    else:
        offs = dict(batch_offsets_q=qi, batch_offsets_k=ki)
        lens = {}
    out = torch.full((sum(qo), hq, d), float("nan"), dtype=BF16, device=DEV)
    lse = torch.full((4, 300, hq), float("nan"), dtype=torch.float32, device=DEV)
    o, l = ca.cudnn_batch_prefill_with_kv_cache(
        q, k, v, 1 / math.sqrt(d), workspace(), max_token_per_sequence=300, max_sequence_kv=300, causal=True,
        return_lse=True, out=out, lse=lse, batch_offsets_units=units, **offs, **lens)
    torch.cuda.synchronize()
    assert o is out and l is lse
    o_ref, lse_ref = ref.ragged_prefill(q, k, v, indptr(qo), indptr(kv), causal=True)
    lse_rows = torch.cat([lse[b, :n] for b, n in enumerate(qo)])  # padded LSE
    check(out, lse_rows, o_ref, lse_ref, BF16, f"seed {seed} raw ragged {units}")


def test_raw_paged_packed_lse():
    gen, seed = new_gen()
    qo, kv = [100, 5, 64], [50, 700, 64]
    hq, hkv, d, ps = 32, 8, 64, 64
    q, cache, kv_ip, idx, last = make_paged(qo, kv, hq, hkv, d, ps, BF16, "NHD", gen)
    bt, seq = ref.csr_to_block_tables(kv_ip, idx, last, ps)
    k_hnd, v_hnd = cache[:, 0].transpose(1, 2), cache[:, 1].transpose(1, 2)  # NHD pool as HND-shaped views
    out = torch.full((sum(qo), hq, d), float("nan"), dtype=BF16, device=DEV)
    lse = torch.full((sum(qo), hq), float("nan"), dtype=torch.float32, device=DEV)
    qi = indptr(qo).to(DEV)
    ca.cudnn_batch_prefill_with_kv_cache(
        q, k_hnd, v_hnd, 0.1, workspace(), max_token_per_sequence=100, max_sequence_kv=700,
        actual_seq_lens_q=torch.tensor(qo, dtype=torch.int32, device=DEV).reshape(-1, 1, 1, 1),
        actual_seq_lens_kv=seq.to(DEV).reshape(-1, 1, 1, 1), block_tables=bt.to(DEV), causal=True, return_lse=True,
        batch_offsets_q=qi, batch_offsets_stats=qi, batch_offsets_units="tokens", out=out, lse=lse)
    torch.cuda.synchronize()
    o_ref, lse_ref = ref.paged_prefill(q, cache, None, indptr(qo), kv_ip, idx, last, causal=True, sm_scale=0.1)
    check(out, lse, o_ref, lse_ref, BF16, f"seed {seed} raw paged packed LSE")
