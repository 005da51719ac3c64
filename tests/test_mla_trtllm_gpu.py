"""GPU tests of ``trtllm_batch_decode_with_kv_cache_mla`` against the float64 oracle
``cutedsl_attn.ref.mla_paged_attention``, under the automatic kernel choice (the SM90 kernel for 16-bit page-64
caches on an sm_90 GPU, the portable one otherwise) and with the portable kernel forced
(``CUTEDSL_ATTN_MLA_KERNEL=portable``); every launch is checked to run the expected kernel.

TRT-LLM layout: query ``[B, q_len, H, 576]``, one combined cache ``[pages, page_size, 576]`` (``ckv | kpe``),
block tables + ``seq_lens``.  Fresh random inputs every run; outputs and LSE poisoned with NaN before each call;
NaN in every page slot no request owns; unused block-table columns hold -1.  The oracle sees the same 16-bit
data through CSR arrays built from the block table, ``sm_scale = bmm1_scale``, its O times ``bmm2_scale``.
"""

import math
import os

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from cutedsl_attn import ref  # noqa: E402
from cutedsl_attn.api.mla_trtllm import trtllm_batch_decode_with_kv_cache_mla  # noqa: E402

DEV = torch.device("cuda")
DC, DR = 512, 64
D = DC + DR
TOL_O = 1e-2  # 16-bit P and output rounding
TOL_LSE = 2e-2
BMM1 = 1.0 / math.sqrt(128 + 64)  # DeepSeek: sm_scale over the pre-absorption head dim, q/k scales 1
_WS = None


@pytest.fixture(autouse=True, params=["auto", "portable"])
def mla_kernel(request, monkeypatch):
    """``CUTEDSL_ATTN_MLA_KERNEL`` of the test (the automatic choice, or the portable kernel forced); records the
    kernel of every launch in ``launched``."""
    from cutedsl_attn.api import mla_trtllm

    monkeypatch.setenv("CUTEDSL_ATTN_MLA_KERNEL", request.param)
    monkeypatch.delenv("CUTEDSL_ATTN_MLA_TUNE", raising=False)
    callspec = getattr(request.node, "callspec", None)
    ps = callspec.params.get("PS") if callspec is not None else None
    if request.node.originalname == "test_default_out_and_lse_base_e":
        ps = 32
    if request.param == "auto" and ps is not None and ps != 64:
        pytest.skip(f"page_size {ps}: the automatic choice is the portable kernel, run by the portable variant")
    launched.clear()
    real = mla_trtllm.mla_launch
    monkeypatch.setattr(mla_trtllm, "mla_launch", lambda module, cfg, args: (launched.append(module.NAME),
                                                                             real(module, cfg, args)))
    return request.param


launched = []


def expected_kernel(PS, dtype):
    """The kernel a launch must run under this test's ``CUTEDSL_ATTN_MLA_KERNEL``."""
    from cutedsl_attn.compile import target_arch

    sm90 = (os.environ["CUTEDSL_ATTN_MLA_KERNEL"] != "portable" and target_arch(DEV) == "sm_90a" and PS == 64
            and dtype in (torch.bfloat16, torch.float16))
    return "mla_decode_sm90" if sm90 else "mla_decode_portable"


def workspace():
    global _WS
    if _WS is None:
        _WS = torch.zeros(256 << 20, dtype=torch.uint8, device=DEV)
    return _WS


def rel(x, y):
    x, y = x.double(), y.double()
    assert torch.isfinite(x).all(), "non-finite values (a NaN-poisoned element was not written, or NaN leaked)"
    return ((x - y).norm() / max(y.norm().item(), 1e-30)).item()


def make(seq_lens, q_len, H, PS, *, dtype=torch.bfloat16, spare_pages=5, q_pad=0):
    """query, combined cache (NaN in unused slots), block table (random distinct pages, -1 past each request's
    pages) and seq_lens.  ``q_pad`` > 0: the query is a strided view of a wider buffer."""
    B = len(seq_lens)
    npages = [-(-L // PS) for L in seq_lens]
    max_pages = max(npages + [1]) + 1
    n = sum(npages) + spare_pages
    ids = torch.randperm(n, device=DEV).to(torch.int32)
    bt = torch.full((B, max_pages), -1, dtype=torch.int32, device=DEV)
    kv = torch.full((n, PS, D), float("nan"), dtype=dtype, device=DEV)
    pos = 0
    for b, L in enumerate(seq_lens):
        if L == 0:
            continue
        pg = ids[pos: pos + npages[b]]
        pos += npages[b]
        bt[b, : npages[b]] = pg
        rows = torch.randn(npages[b] * PS, D, device=DEV)
        rows[L:] = float("nan")
        kv[pg.long()] = rows.view(-1, PS, D).to(dtype)
    qbuf = torch.randn(B, q_len, H, D + q_pad, device=DEV).to(dtype)
    query = qbuf[..., :D] if q_pad else qbuf
    return query, kv, bt, torch.tensor(seq_lens, dtype=torch.int32, device=DEV)


def oracle(query, kv, bt, seq_lens, PS, *, bmm1, bmm2):
    B, q_len, H, _ = query.shape
    lens = seq_lens.cpu().tolist()
    npages = [-(-L // PS) for L in lens]
    kv_indptr = torch.tensor([0] + torch.tensor(npages, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
    kv_indices = torch.cat([bt[b, : npages[b]].cpu() for b in range(B)] + [torch.zeros(0, dtype=torch.int32)])
    qo_indptr = torch.arange(B + 1, dtype=torch.int32) * q_len
    q = query.reshape(B * q_len, H, D)
    o, lse = ref.mla_paged_attention(q[..., :DC], q[..., DC:], kv[..., :DC], kv[..., DC:], qo_indptr, kv_indptr,
                                     kv_indices, seq_lens.cpu(), sm_scale=bmm1, causal=q_len > 1)
    return (o * bmm2).view(B, q_len, H, DC).cpu(), lse.view(B * q_len, H).cpu()


def check(seq_lens, q_len, H, PS, *, bmm1=BMM1, bmm2=1.0, kv_4d=False, q_pad=0, counter_buffer=None):
    query, kv, bt, sl = make(seq_lens, q_len, H, PS, q_pad=q_pad)
    B = len(seq_lens)
    out = torch.full((B, q_len, H, DC), float("nan"), dtype=query.dtype, device=DEV)
    lse = torch.full((B * q_len, H), float("nan"), dtype=torch.float32, device=DEV)
    cache = kv.unsqueeze(1) if kv_4d else kv
    o, l = trtllm_batch_decode_with_kv_cache_mla(
        query, cache, workspace(), 128, 512, 64, bt, sl, max(seq_lens), out=out, bmm1_scale=bmm1, bmm2_scale=bmm2,
        lse=lse, return_lse=True, multi_ctas_kv_counter_buffer=counter_buffer)
    assert o is out and l is lse
    assert launched and launched[-1] == expected_kernel(PS, query.dtype), launched
    o_ref, lse_ref = oracle(query, kv, bt, sl, PS, bmm1=bmm1, bmm2=bmm2)
    o, l = o.cpu(), l.cpu()
    assert rel(o, o_ref) < TOL_O
    empty = torch.isinf(lse_ref)
    assert torch.equal(torch.isinf(l) & (l < 0), empty), "LSE -inf exactly on the rows that see no key"
    assert (o.reshape(B * q_len, H, DC)[empty] == 0).all()
    if (~empty).any():
        assert (l.double()[~empty] - lse_ref[~empty]).abs().max().item() < TOL_LSE
    return query, kv, bt, sl


@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("H", [128, 16])
@pytest.mark.parametrize("PS", [32, 64])
def test_matches_oracle(q_len, H, PS):
    # page boundaries, an empty request, a one-token request (with q_len 2 its first row sees no key)
    lens = [1, PS - 1, PS, PS + 1, 2 * PS, 0, 63, 64, 65, 1000]
    check(lens, q_len, H, PS)


@pytest.mark.parametrize("q_len,H,PS", [(1, 128, 64), (2, 16, 32)])
def test_long_split_kv(q_len, H, PS):
    # few requests, long contexts: the planner splits KV and the kernel merges in the same launch
    check([8192, 4000], q_len, H, PS)
    check([32768], q_len, H, PS)


@pytest.mark.parametrize("bmm2", [0.5, 3.0, -0.25])
@pytest.mark.parametrize("lens", [[70, 3, 500], [16384]])  # one work item per request, and a split request
def test_bmm2_scale_applied_in_the_epilogue(bmm2, lens):
    check(lens, 1, 128, 64, bmm1=0.03, bmm2=bmm2)
    check(lens, 2, 16, 32, bmm1=-0.02, bmm2=bmm2)


def test_4d_cache_and_strided_query():
    check([100, 33, 0, 64], 2, 16, 64, kv_4d=True, q_pad=64)


def test_counter_buffer_reused_and_left_zero():
    buf = torch.zeros(1 << 16, dtype=torch.uint8, device=DEV)
    for _ in range(2):
        check([16384, 100], 1, 128, 64, counter_buffer=buf)
        torch.cuda.synchronize()
        assert int(buf.count_nonzero()) == 0


def test_default_out_and_lse_base_e():
    query, kv, bt, sl = make([50, 700], 1, 16, 32)
    o = trtllm_batch_decode_with_kv_cache_mla(query, kv, workspace(), 128, 512, 64, bt, sl, 700,
                                              bmm1_scale=BMM1)
    assert o.shape == (2, 1, 16, DC) and o.dtype == torch.bfloat16
    o_ref, lse_ref = oracle(query, kv, bt, sl, 32, bmm1=BMM1, bmm2=1.0)
    assert rel(o.cpu(), o_ref) < TOL_O
    _, lse_e = trtllm_batch_decode_with_kv_cache_mla(query, kv, workspace(), 128, 512, 64, bt, sl, 700,
                                                     bmm1_scale=BMM1, return_lse=True, return_lse_base="basee")
    assert lse_e.shape == (2, 16)
    assert (lse_e.double().cpu() - lse_ref * math.log(2.0)).abs().max().item() < TOL_LSE
