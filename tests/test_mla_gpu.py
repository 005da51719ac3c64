"""GPU tests of ``BatchMLAPagedAttentionWrapper`` against the float64 oracle, under the automatic kernel choice
(the SM90 kernel for 16-bit page-64 problems on an sm_90 GPU, the portable one otherwise) and with the portable
kernel forced (``CUTEDSL_ATTN_MLA_KERNEL=portable``); every plan is checked to have chosen the expected kernel.

Fresh random inputs every run; outputs and LSE poisoned with NaN before each launch; NaN in every page slot
no request owns; relative Frobenius error of O and absolute error of the LSE against
``cutedsl_attn.ref.mla_paged_attention`` on the same 16-bit inputs.
"""

import math
import os

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from cutedsl_attn import ref  # noqa: E402
from cutedsl_attn.api.mla import BatchMLAPagedAttentionWrapper  # noqa: E402

DEV = torch.device("cuda")
DC, DR = 512, 64
TOL_O = 1e-2  # 16-bit P and output rounding
TOL_LSE = 2e-2
SM_SCALE = 1.0 / math.sqrt(128 + 64)  # DeepSeek's pre-absorption head dim
_WS = None


# tests whose problems all have a page size the SM90 kernel does not serve: "auto" would repeat the portable run
_PAGE_SIZE_OF = {"test_batch_sweep_empty_requests": 16, "test_float16_and_negative_scale": 16,
                 "test_seed_example": 1, "test_lse_base_e": 16, "test_cuda_graph_replay_after_replan": 16,
                 "test_page_ids_past_32_bit_offsets": 32}


@pytest.fixture(autouse=True, params=["auto", "portable"])
def mla_kernel(request, monkeypatch):
    """``CUTEDSL_ATTN_MLA_KERNEL`` of the test: the automatic choice, or the portable kernel forced."""
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_KERNEL", request.param)
    monkeypatch.delenv("CUTEDSL_ATTN_MLA_TUNE", raising=False)
    callspec = getattr(request.node, "callspec", None)
    ps = callspec.params.get("PS") if callspec is not None else None
    ps = _PAGE_SIZE_OF.get(request.node.originalname, ps)
    if request.param == "auto" and ps is not None and ps != 64:
        pytest.skip(f"page_size {ps}: the automatic choice is the portable kernel, run by the portable variant")
    return request.param


def expected_kernel(PS, dtype):
    """The kernel the plan must choose under this test's ``CUTEDSL_ATTN_MLA_KERNEL``."""
    from cutedsl_attn.compile import target_arch

    sm90 = (os.environ["CUTEDSL_ATTN_MLA_KERNEL"] != "portable" and target_arch(DEV) == "sm_90a" and PS == 64
            and dtype in (torch.bfloat16, torch.float16))
    return "mla_decode_sm90" if sm90 else "mla_decode_portable"


def workspace():
    global _WS
    if _WS is None:
        _WS = torch.empty(256 << 20, dtype=torch.int8, device=DEV)
    return _WS


def rel(x, y):
    x, y = x.double(), y.double()
    assert torch.isfinite(x).all(), "non-finite values (a NaN-poisoned element was not written, or NaN leaked)"
    return ((x - y).norm() / max(y.norm().item(), 1e-30)).item()


def make(qo_lens, kv_lens, H, PS, *, dtype=torch.bfloat16, gen=None, spare_pages=5, page_base=0, ckv=None,
         kpe=None):
    """Random q, paged caches with NaN in every unused slot, and the CSR arrays (int32 on the GPU).  Pages are
    a random permutation of ``page_base + [0, n)``; ``ckv`` / ``kpe`` given: write into those caches."""
    B = len(kv_lens)
    npages = [-(-L // PS) for L in kv_lens]
    n = sum(npages) + spare_pages
    ids = (torch.randperm(n, device=DEV) + page_base).to(torch.int32)
    kv_indptr = torch.tensor([0] + torch.tensor(npages).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    kv_indices = ids[: int(kv_indptr[-1])].contiguous()
    qo_indptr = torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    T = int(qo_indptr[-1])
    q_nope = torch.randn(T, H, DC, device=DEV).to(dtype)
    q_pe = torch.randn(T, H, DR, device=DEV).to(dtype)
    if ckv is None:
        P = page_base + n
        ckv = torch.full((P, PS, DC), float("nan"), device=DEV, dtype=dtype)
        kpe = torch.full((P, PS, DR), float("nan"), device=DEV, dtype=dtype)
    for b in range(B):  # each request's tokens, NaN left in the tail of its last page
        L = kv_lens[b]
        if L == 0:
            continue
        pg = kv_indices[int(kv_indptr[b]): int(kv_indptr[b + 1])].long()
        c = torch.randn(len(pg) * PS, DC, device=DEV)
        r = torch.randn(len(pg) * PS, DR, device=DEV)
        c[L:] = float("nan")
        r[L:] = float("nan")
        ckv[pg] = c.view(-1, PS, DC).to(dtype)
        kpe[pg] = r.view(-1, PS, DR).to(dtype)
    kv_len_arr = torch.tensor(kv_lens, dtype=torch.int32, device=DEV)
    return q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_len_arr


def check(case, H, PS, *, causal=False, dtype=torch.bfloat16, sm_scale=SM_SCALE, wrapper=None):
    q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_len_arr = case
    w = wrapper or BatchMLAPagedAttentionWrapper(workspace())
    w.plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, H, DC, DR, PS, causal, sm_scale, dtype, dtype)
    assert w._plan["module"].NAME == expected_kernel(PS, dtype), w._plan["module"].NAME
    out = torch.full((q_nope.shape[0], H, DC), float("nan"), dtype=dtype, device=DEV)
    lse = torch.full((q_nope.shape[0], H), float("nan"), dtype=torch.float32, device=DEV)
    o, l = w.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, return_lse=True)
    assert o is out and l is lse
    o_ref, lse_ref = ref.mla_paged_attention(q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_len_arr,
                                             sm_scale=sm_scale, causal=causal)
    assert rel(o, o_ref) < TOL_O
    empty = torch.isinf(lse_ref)
    assert torch.equal(torch.isinf(l) & (l < 0), empty), "LSE -inf exactly on the rows that see no key"
    assert (o[empty] == 0).all()
    if (~empty).any():
        assert (l.double()[~empty] - lse_ref[~empty]).abs().max().item() < TOL_LSE
    return w


@pytest.mark.parametrize("H", [16, 64, 128])
@pytest.mark.parametrize("PS", [1, 16, 32, 64])
def test_decode_lengths(H, PS):
    lens = [1, 15, 16, 17, PS, PS + 1, 2 * PS - 1, 0, 63, 64, 65, 1000]
    check(make([1] * len(lens), lens, H, PS), H, PS)


@pytest.mark.parametrize("B,PS,H,max_len", [(1, 64, 128, 4096), (1, 16, 16, 4096), (2, 1, 128, 4096),
                                             (64, 64, 16, 4096), (64, 16, 128, 4096), (1, 32, 128, 32768),
                                             (256, 64, 32, 256)])
def test_long_and_split(B, PS, H, max_len):
    g = torch.Generator().manual_seed(B * 131 + PS)
    lens = torch.randint(1, max_len + 1, (B,), generator=g).tolist()
    lens[0] = max_len
    check(make([1] * B, lens, H, PS), H, PS)


def test_batch_sweep_empty_requests():
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(0, 300, (33,), generator=g).tolist()
    lens[3] = lens[10] = 0
    check(make([1] * 33, lens, 64, 16), 64, 16)


@pytest.mark.parametrize("qo_lens,kv_lens,H,PS", [
    ([2, 3, 4], [9, 100, 4096], 128, 64),
    ([4, 1, 2], [4, 33, 2], 16, 1),
    ([3, 2], [2, 0], 16, 16),  # rows that see no key (causal) and an empty request
    ([2] * 16, [512] * 16, 64, 16),
])
@pytest.mark.parametrize("causal", [True, False])
def test_multi_token_rows(qo_lens, kv_lens, H, PS, causal):
    check(make(qo_lens, kv_lens, H, PS), H, PS, causal=causal)


def test_float16_and_negative_scale():
    case = make([1, 1, 2], [70, 3, 40], 16, 16, dtype=torch.float16)
    check(case, 16, 16, dtype=torch.float16, causal=True)
    check(case, 16, 16, dtype=torch.float16, sm_scale=-0.05)


def test_seed_example():
    """FlashInfer's documented example, as written (114 requests x 999 tokens, 128 heads, page 1)."""
    num_local_heads, batch_size, head_dim_ckv, head_dim_kpe, page_size = 128, 114, 512, 64, 1
    mla_wrapper = BatchMLAPagedAttentionWrapper(torch.empty(128 * 1024 * 1024, dtype=torch.int8).to(0))
    q_indptr = torch.arange(0, batch_size + 1).to(0).int()
    kv_lens = torch.full((batch_size,), 999, dtype=torch.int32).to(0)
    kv_indptr = torch.arange(0, batch_size + 1).to(0).int() * 999
    kv_indices = torch.arange(0, batch_size * 999).to(0).int()
    q_nope = torch.randn(batch_size * 1, num_local_heads, head_dim_ckv, dtype=torch.bfloat16, device="cuda")
    q_pe = torch.zeros(batch_size * 1, num_local_heads, head_dim_kpe, dtype=torch.bfloat16, device="cuda")
    ckv = torch.randn(batch_size * 999, 1, head_dim_ckv, dtype=torch.bfloat16, device="cuda")
    kpe = torch.zeros(batch_size * 999, 1, head_dim_kpe, dtype=torch.bfloat16, device="cuda")
    sm_scale = 1.0 / ((128 + 64) ** 0.5)
    mla_wrapper.plan(q_indptr, kv_indptr, kv_indices, kv_lens, num_local_heads, head_dim_ckv, head_dim_kpe,
                     page_size, False, sm_scale, q_nope.dtype, ckv.dtype)
    o = mla_wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=False)
    assert o.shape == torch.Size([114, 128, 512])
    o_ref, _ = ref.mla_paged_attention(q_nope, q_pe, ckv, kpe, q_indptr, kv_indptr, kv_indices, kv_lens,
                                       sm_scale=sm_scale)
    assert rel(o, o_ref) < TOL_O


def test_lse_base_e():
    case = make([1, 1], [50, 700], 16, 16)
    w = check(case, 16, 16)
    _, lse2 = w.run(*case[:4], return_lse=True)
    _, lse_e = w.run(*case[:4], return_lse=True, return_lse_base_on_e=True)
    torch.testing.assert_close(lse_e, lse2 * math.log(2.0), rtol=1e-6, atol=1e-6)


def test_cuda_graph_replay_after_replan():
    B, H, PS, max_pages = 8, 128, 16, 8 * 300
    i32 = dict(dtype=torch.int32, device=DEV)
    bufs = dict(qo_indptr=torch.zeros(B + 1, **i32), kv_indptr=torch.zeros(B + 1, **i32),
                kv_indices=torch.zeros(max_pages, **i32), kv_len_arr=torch.zeros(B, **i32))
    w = BatchMLAPagedAttentionWrapper(workspace(), use_cuda_graph=True, **bufs)
    g = torch.Generator().manual_seed(11)
    lens1 = torch.randint(1, 2000, (B,), generator=g).tolist()
    case = make([1] * B, lens1, H, PS, spare_pages=max_pages)
    q_nope, q_pe, ckv, kpe = case[:4]
    ckv.nan_to_num_(0.0)  # later page maps own any slot; the NaN-tail rule is tested without graphs
    kpe.nan_to_num_(0.0)
    w.plan(*case[4:], H, DC, DR, PS, False, SM_SCALE, torch.bfloat16, torch.bfloat16)
    out = torch.empty(B, H, DC, dtype=torch.bfloat16, device=DEV)
    lse = torch.empty(B, H, dtype=torch.float32, device=DEV)
    w.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse)  # warm-up: compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse)
    for lens in (lens1, torch.randint(1, 4097, (B,), generator=g).tolist(), [0, 1, 2, 3, 4000, 17, 16, 15]):
        npages = [-(-L // PS) for L in lens]
        kv_indptr = torch.tensor([0] + torch.tensor(npages).cumsum(0).tolist(), **i32)
        kv_indices = torch.randperm(ckv.shape[0], device=DEV)[: int(kv_indptr[-1])].to(torch.int32)
        kv_len_arr = torch.tensor(lens, **i32)
        qo_indptr = torch.arange(B + 1, **i32)
        w.plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, H, DC, DR, PS, False, SM_SCALE, torch.bfloat16,
               torch.bfloat16)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        o_ref, lse_ref = ref.mla_paged_attention(q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices,
                                                 kv_len_arr, sm_scale=SM_SCALE)
        assert rel(out, o_ref) < TOL_O
        fin = torch.isfinite(lse_ref)
        assert (lse.double()[fin] - lse_ref[fin]).abs().max().item() < TOL_LSE
        assert torch.isinf(lse[~fin]).all()


def test_page_ids_past_32_bit_offsets():
    """Page ids whose ``page_id * page_stride`` (elements and bytes) passes 2^32 (page size 32 x 512 wide)."""
    PS = 32
    stride = PS * DC
    base = (1 << 32) // stride + 7  # above 2^32 elements, hence above 2^32 bytes too
    lens = [100, 4096, 33]
    n = sum(-(-L // PS) for L in lens) + 2
    need = (base + n) * PS * (DC + DR) * 2
    free, _ = torch.cuda.mem_get_info()
    if need + (4 << 30) > min(free, 40 << 30):
        pytest.skip(f"needs {need / 2**30:.1f} GiB for the caches; {free / 2**30:.1f} GiB free (limit 40 GiB)")
    ckv = torch.empty((base + n, PS, DC), dtype=torch.bfloat16, device=DEV)
    kpe = torch.empty((base + n, PS, DR), dtype=torch.bfloat16, device=DEV)
    ckv[base:] = float("nan")
    kpe[base:] = float("nan")
    case = make([1, 1, 1], lens, 128, PS, page_base=base, spare_pages=2, ckv=ckv, kpe=kpe)
    assert int(case[6].min()) * stride >= 1 << 32
    # the oracle gathers only the used pages: pass it the tail of the cache with ids rebased
    q_nope, q_pe, _, _, qo_indptr, kv_indptr, kv_indices, kv_len_arr = case
    w = BatchMLAPagedAttentionWrapper(workspace())
    w.plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, 128, DC, DR, PS, False, SM_SCALE, torch.bfloat16,
           torch.bfloat16)
    out = torch.full((3, 128, DC), float("nan"), dtype=torch.bfloat16, device=DEV)
    w.run(q_nope, q_pe, ckv, kpe, out=out)
    o_ref, _ = ref.mla_paged_attention(q_nope, q_pe, ckv[base:], kpe[base:], qo_indptr, kv_indptr,
                                       kv_indices - base, kv_len_arr, sm_scale=SM_SCALE)
    assert rel(out, o_ref) < TOL_O
