"""GPU tests of the launch contract every kernel keeps (KERNELS.md), through the public API:

* results depend only on the data a request owns: spare K/V rows past ``kv_indptr[-1]``, unused page slots and
  the outputs are NaN-poisoned before each launch (``_checks.check_poisoned``), for decode, ragged prefill (the
  SM90 kernel and the portable one) and paged prefill;
* the output scale (``v_scale / o_scale``) is applied in fp32 before the 16-bit rounding;
* every launch is a torch custom op: ``torch.compile(fullgraph=True)`` equals eager for ``wrapper.run()``, and
  the ``single_*`` functions wrapped in a user's custom op compile with ``mode="reduce-overhead"`` (CUDA graphs)
  without leaving tensors in the graph pool (as FlashInfer's ``test_single_decode_torch_compile_cuda_graph`` /
  ``test_single_prefill_torch_compile_cuda_graph``);
* CUDA-graph capture of ``run()`` still replays correctly.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import cutedsl_attn as ca  # noqa: E402
from cutedsl_attn import ref  # noqa: E402
from _checks import check_poisoned, rel_err, used_page_slots  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16

# the regression batch of the spare-rows defect: three requests, 32 / 8 heads, d128
REG_LENS = (300, 40, 250)
SPARE = 37


def indptr(lens, device=DEV):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)


def gen():
    seed = torch.seed() % (2**31)
    return torch.Generator().manual_seed(seed), seed


def rnd(shape, g, dtype=BF16):
    return torch.randn(shape, generator=g).to(dtype).to(DEV)


# ============================================================================= NaN-poisoned spare rows
@pytest.mark.parametrize("kernel", ["auto", "portable"])
@pytest.mark.parametrize("causal", [True, False])
def test_ragged_prefill_ignores_spare_kv_rows(monkeypatch, kernel, causal):
    """K/V buffers longer than kv_indptr[-1] with NaN past the end: no NaN reaches any output, on the SM90 kernel
    (auto) and the portable one."""
    if kernel == "portable":
        monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_KERNEL", "portable")
    g, seed = gen()
    hq, hkv, d = 32, 8, 128
    tq, tk = sum(REG_LENS), sum(REG_LENS)
    q = rnd((tq, hq, d), g)
    k, v = rnd((tk + SPARE, hkv, d), g), rnd((tk + SPARE, hkv, d), g)
    qo, kv = indptr(REG_LENS), indptr(REG_LENS)
    w = ca.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(16, dtype=torch.uint8, device=DEV), "NHD")
    w.plan(qo, kv, hq, hkv, d, causal=causal, q_data_type=BF16)
    out = torch.empty(tq, hq, d, dtype=BF16, device=DEV)
    lse = torch.empty(tq, hq, device=DEV)
    check_poisoned(
        lambda: w.run(q, k, v, out=out, lse=lse),
        out=out, lse=lse, dtype=BF16, what=f"seed {seed} ragged {kernel} causal={causal}",
        oracle=lambda: tuple(x.cpu() for x in ref.ragged_prefill(q, k[:tk], v[:tk], qo.cpu(), kv.cpu(),
                                                                  causal=causal)),
        ragged_kv=(k, v), kv_end=tk)


def _paged(lens, page_size, hkv, d, g, spare_pages=5):
    """A scattered CSR page table with spare pages; ``cache`` ``[pages, 2, page_size, Hkv, D]``."""
    npages = [-(-L // page_size) for L in lens]
    pool = sum(npages) + spare_pages
    indices = torch.randperm(pool, generator=g)[: sum(npages)].to(torch.int32)
    last = torch.tensor([L - (n - 1) * page_size for L, n in zip(lens, npages)], dtype=torch.int32)
    cache = rnd((pool, 2, page_size, hkv, d), g)
    return indptr(npages, "cpu"), indices, last, cache


@pytest.mark.parametrize("causal", [True, False])
def test_paged_prefill_ignores_unused_page_slots(causal):
    g, seed = gen()
    hq, hkv, d, ps = 32, 8, 128, 16
    kv_ip, indices, last, cache = _paged(REG_LENS, ps, hkv, d, g)
    tq = sum(REG_LENS)
    q = rnd((tq, hq, d), g)
    qo = indptr(REG_LENS)
    w = ca.BatchPrefillWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8, device=DEV), "NHD")
    w.plan(qo, kv_ip.to(DEV), indices.to(DEV), last.to(DEV), hq, hkv, d, ps, causal=causal, q_data_type=BF16)
    out = torch.empty(tq, hq, d, dtype=BF16, device=DEV)
    lse = torch.empty(tq, hq, device=DEV)
    k_cache, v_cache = cache[:, 0], cache[:, 1]
    check_poisoned(
        lambda: w.run(q, (k_cache, v_cache), out=out, lse=lse),
        out=out, lse=lse, dtype=BF16, what=f"seed {seed} paged prefill causal={causal}",
        oracle=lambda: tuple(x.cpu() for x in ref.paged_prefill(q.cpu(), k_cache.cpu(), v_cache.cpu(), qo.cpu(),
                                                                 kv_ip, indices, last, causal=causal)),
        paged_kv=(k_cache, v_cache), used_slots=used_page_slots(kv_ip, indices, last, cache.shape[0], ps))


@pytest.mark.parametrize("split", [False, True])
def test_decode_ignores_unused_page_slots(split):
    g, seed = gen()
    hq, hkv, d, ps = 32, 8, 128, 16
    lens = (3000, 40, 250) if split else REG_LENS
    kv_ip, indices, last, cache = _paged(lens, ps, hkv, d, g)
    q = rnd((len(lens), hq, d), g)
    w = ca.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=DEV), "NHD")
    w.plan(kv_ip.to(DEV), indices.to(DEV), last.to(DEV), hq, hkv, d, ps, q_data_type=BF16,
           disable_split_kv=not split)
    out = torch.empty(len(lens), hq, d, dtype=BF16, device=DEV)
    lse = torch.empty(len(lens), hq, device=DEV)
    k_cache, v_cache = cache[:, 0], cache[:, 1]
    check_poisoned(
        lambda: w.run(q, (k_cache, v_cache), out=out, lse=lse),
        out=out, lse=lse, dtype=BF16, what=f"seed {seed} decode split={split}",
        oracle=lambda: ref.paged_decode(q.cpu(), k_cache.cpu(), v_cache.cpu(), kv_ip, indices, last),
        paged_kv=(k_cache, v_cache), used_slots=used_page_slots(kv_ip, indices, last, cache.shape[0], ps))


# ============================================================================= the output scale
@pytest.mark.parametrize("which", ["decode", "ragged_sm90", "ragged_portable"])
def test_output_scale_in_fp32(monkeypatch, which):
    """FlashInfer's scale-forwarding property: out(v_scale=s) against out(1) * s within atol 1e-3, rtol 1e-2 on
    every element (one rounding of o * s, not of round(o) * s)."""
    if which == "ragged_portable":
        monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_KERNEL", "portable")
    g, _ = gen()
    hq, hkv, d, s = 8, 2, 128, 0.37
    if which == "decode":
        kv_ip, indices, last, cache = _paged((700, 33), 16, hkv, d, g)
        q = rnd((2, hq, d), g)
        w = ca.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16 << 20, dtype=torch.uint8, device=DEV), "NHD")
        w.plan(kv_ip.to(DEV), indices.to(DEV), last.to(DEV), hq, hkv, d, 16, q_data_type=BF16)
        base, scaled = w.run(q, cache), w.run(q, cache, v_scale=s)
    else:
        lens = (64, 200)
        q, k, v = rnd((sum(lens), hq, d), g), rnd((sum(lens), hkv, d), g), rnd((sum(lens), hkv, d), g)
        w = ca.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(16, dtype=torch.uint8, device=DEV), "NHD")
        w.plan(indptr(lens), indptr(lens), hq, hkv, d, causal=True, q_data_type=BF16)
        base, scaled = w.run(q, k, v), w.run(q, k, v, v_scale=s * 2.0, o_scale=2.0)
    torch.testing.assert_close(scaled.float(), base.float() * s, atol=1e-3, rtol=1e-2)


# ============================================================================= torch.compile and CUDA graphs
def test_compiled_ragged_run_equals_eager():
    g, _ = gen()
    hq, hkv, d = 32, 8, 128
    q, k, v = rnd((sum(REG_LENS), hq, d), g), rnd((sum(REG_LENS), hkv, d), g), rnd((sum(REG_LENS), hkv, d), g)
    w = ca.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(16, dtype=torch.uint8, device=DEV), "NHD")
    w.plan(indptr(REG_LENS), indptr(REG_LENS), hq, hkv, d, causal=True, q_data_type=BF16)
    eager_o, eager_lse = w.run(q, k, v, return_lse=True)
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: w.run(q, k, v, return_lse=True), fullgraph=True)
    for _ in range(2):
        o, lse = f(q, k, v)
        torch.testing.assert_close(o, eager_o, atol=0, rtol=0)
        torch.testing.assert_close(lse, eager_lse, atol=0, rtol=0)


def test_compiled_decode_run_equals_eager():
    g, _ = gen()
    hq, hkv, d = 32, 8, 128
    kv_ip, indices, last, cache = _paged((3000, 40, 250, 1), 16, hkv, d, g)
    q = rnd((4, hq, d), g)
    w = ca.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=DEV), "NHD")
    w.plan(kv_ip.to(DEV), indices.to(DEV), last.to(DEV), hq, hkv, d, 16, q_data_type=BF16)
    eager = w.run(q, cache, v_scale=0.5)
    torch._dynamo.reset()
    f = torch.compile(lambda q, c: w.run(q, c, v_scale=0.5), fullgraph=True)
    for _ in range(2):
        torch.testing.assert_close(f(q, cache), eager, atol=0, rtol=0)


def test_cuda_graph_capture_of_run_still_replays():
    g, _ = gen()
    hq, hkv, d, B = 16, 4, 128, 3
    lens = (300, 40, 250)
    kv_ip, indices, last, cache = _paged(lens, 16, hkv, d, g, spare_pages=40)
    q = rnd((B, hq, d), g)
    bufs = dict(paged_kv_indptr_buffer=torch.empty(B + 1, dtype=torch.int32, device=DEV),
                paged_kv_indices_buffer=torch.empty(cache.shape[0], dtype=torch.int32, device=DEV),
                paged_kv_last_page_len_buffer=torch.empty(B, dtype=torch.int32, device=DEV))
    w = ca.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=DEV), "NHD",
                                              use_cuda_graph=True, **bufs)
    w.plan(kv_ip.to(DEV), indices.to(DEV), last.to(DEV), hq, hkv, d, 16, q_data_type=BF16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = w.run(q, cache)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(q, cache, out=out)
    for lens2 in (lens, (17, 290, 5)):
        kv2, idx2, last2, _ = _paged(lens2, 16, hkv, d, g, spare_pages=cache.shape[0] - sum(-(-L // 16)
                                                                                              for L in lens2))
        w.plan(kv2.to(DEV), idx2.to(DEV), last2.to(DEV), hq, hkv, d, 16, q_data_type=BF16)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        o_ref, _ = ref.paged_decode(q.cpu(), cache[:, 0].cpu(), cache[:, 1].cpu(), kv2, idx2, last2)
        assert rel_err(out.cpu(), o_ref) <= 1e-2


# A user's custom op around a single_* call, compiled with CUDA graphs (reduce-overhead): as FlashInfer's public
# tests.  Registered at import (module level), where torch.compile expects library registrations.
@torch.library.custom_op("cutedsl_attn_contract::single_decode", mutates_args=())
def _user_single_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return ca.single_decode_with_kv_cache(q, k, v)


@_user_single_decode.register_fake
def _(q, k, v):
    return torch.empty_like(q)


@torch.library.custom_op("cutedsl_attn_contract::single_prefill", mutates_args=())
def _user_single_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return ca.single_prefill_with_kv_cache(q, k, v, causal=True)


@_user_single_prefill.register_fake
def _(q, k, v):
    return q.new_empty(q.shape[:2] + v.shape[-1:])


@pytest.mark.parametrize("which", ["decode", "prefill"])
def test_single_torch_compile_cuda_graph(which):
    """Three calls of the compiled function (warm-up, capture, replay) with fresh inputs: no "tensor(s) in the
    cudagraph pool not tracked as outputs" (the single_* functions keep no device state across calls), and each
    output equals the eager call's."""
    op = torch.ops.cutedsl_attn_contract.single_decode if which == "decode" else \
        torch.ops.cutedsl_attn_contract.single_prefill
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: op(q, k, v), mode="reduce-overhead", fullgraph=True)
    g, seed = gen()
    kv_len, hq, hkv, d = 256, 8, 8, 128
    for i in range(3):
        q = rnd((hq, d) if which == "decode" else (128, hq, d), g, torch.float16)
        k, v = rnd((kv_len, hkv, d), g, torch.float16), rnd((kv_len, hkv, d), g, torch.float16)
        o = f(q, k, v).clone()  # a replay's output is overwritten by the next replay
        torch.cuda.synchronize()
        eager = op(q, k, v)
        assert o.shape == eager.shape
        torch.testing.assert_close(o, eager, atol=1e-3, rtol=1e-3, msg=f"seed {seed} call {i}")
