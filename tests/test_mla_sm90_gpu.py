"""GPU tests of the SM90 MLA decode kernel against the float64 oracle: its automatic choice on sm_90a (page 64:
16-bit caches by TMA, fp8 caches from 64 query heads) with ``CUTEDSL_ATTN_MLA_KERNEL`` unset, and its gathered
pages (sizes dividing 64) and fp8 caches at any head count with ``CUTEDSL_ATTN_MLA_KERNEL=sm90`` (every test
asserts the SM90 kernel ran).

Through ``BatchMLAPagedAttentionWrapper``,
through ``trtllm_batch_decode_with_kv_cache_mla`` (one combined cache: strided ckv / kpe views), and by a direct
launch of the compiled kernel.  Fresh random inputs every run; outputs and LSE poisoned with NaN before each
launch; NaN in every page slot no request owns; relative Frobenius error of O and absolute error of the base-2
LSE against ``cutedsl_attn.ref.mla_paged_attention`` on the same 16-bit inputs.  Needs an sm_90 GPU.
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the SM90 MLA kernel needs an sm_90 GPU", allow_module_level=True)

from cutedsl_attn import ref  # noqa: E402
from cutedsl_attn.api.mla import BatchMLAPagedAttentionWrapper  # noqa: E402

DEV = torch.device("cuda")
DC, DR = 512, 64
PS = 64
TOL_O = 1e-2  # 16-bit P and output rounding
TOL_LSE = 2e-2
SM_SCALE = 1.0 / math.sqrt(128 + 64)  # DeepSeek's pre-absorption head dim
_WS = None


@pytest.fixture(autouse=True)
def automatic_choice(monkeypatch):
    monkeypatch.delenv("CUTEDSL_ATTN_MLA_KERNEL", raising=False)
    monkeypatch.delenv("CUTEDSL_ATTN_MLA_TUNE", raising=False)


def workspace():
    global _WS
    if _WS is None:
        _WS = torch.empty(512 << 20, dtype=torch.int8, device=DEV)
    return _WS


def rel(x, y):
    x, y = x.double(), y.double()
    assert torch.isfinite(x).all(), "non-finite values (a NaN-poisoned element was not written, or NaN leaked)"
    return ((x - y).norm() / max(y.norm().item(), 1e-30)).item()


def make(qo_lens, kv_lens, H, *, dtype=torch.bfloat16, spare_pages=5, page_base=0, ckv=None, kpe=None, ps=PS):
    """Random q, ``ps``-token paged caches with NaN in every slot no request owns (spare pages included), the CSR
    arrays (int32, GPU); pages are a random permutation of ``page_base + [0, n)``."""
    B = len(kv_lens)
    npages = [-(-L // ps) for L in kv_lens]
    n = sum(npages) + spare_pages
    ids = (torch.randperm(n, device=DEV) + page_base).to(torch.int32)
    kv_indptr = torch.tensor([0] + torch.tensor(npages, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32,
                             device=DEV)
    kv_indices = ids[: int(kv_indptr[-1])].contiguous()
    qo_indptr = torch.tensor([0] + torch.tensor(qo_lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32,
                             device=DEV)
    T = int(qo_indptr[-1])
    q_nope = torch.randn(T, H, DC, device=DEV).to(dtype)
    q_pe = torch.randn(T, H, DR, device=DEV).to(dtype)
    if ckv is None:
        ckv = torch.full((page_base + n, ps, DC), float("nan"), device=DEV, dtype=dtype)
        kpe = torch.full((page_base + n, ps, DR), float("nan"), device=DEV, dtype=dtype)
    for b in range(B):
        L = kv_lens[b]
        if L == 0:
            continue
        pg = kv_indices[int(kv_indptr[b]): int(kv_indptr[b + 1])].long()
        c = torch.randn(len(pg) * ps, DC, device=DEV)
        r = torch.randn(len(pg) * ps, DR, device=DEV)
        c[L:] = float("nan")  # the tail of the last page: no request owns it
        r[L:] = float("nan")
        ckv[pg] = c.view(-1, ps, DC).to(dtype)
        kpe[pg] = r.view(-1, ps, DR).to(dtype)
    return q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, torch.tensor(kv_lens, dtype=torch.int32,
                                                                                   device=DEV)


def _compare(o, l, o_ref, lse_ref):
    assert rel(o, o_ref) < TOL_O
    empty = torch.isinf(lse_ref)
    assert torch.equal(torch.isinf(l) & (l < 0), empty), "LSE -inf exactly on the rows that see no key"
    assert (o[empty] == 0).all()
    if (~empty).any():
        assert (l.double()[~empty] - lse_ref[~empty]).abs().max().item() < TOL_LSE


def check(case, H, *, causal=False, dtype=torch.bfloat16, sm_scale=SM_SCALE, expect_split=None):
    q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_len_arr = case
    w = BatchMLAPagedAttentionWrapper(workspace())
    w.plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, H, DC, DR, ckv.shape[1], causal, sm_scale, dtype, dtype)
    assert w._plan["module"].NAME == "mla_decode_sm90", "the automatic choice is not the SM90 kernel"
    if expect_split is not None:
        assert (w._plan["split_tokens"] > 0) == expect_split, w._plan["split_tokens"]
    T = q_nope.shape[0]
    out = torch.full((T, H, DC), float("nan"), dtype=dtype, device=DEV)
    lse = torch.full((T, H), float("nan"), dtype=torch.float32, device=DEV)
    o, l = w.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, return_lse=True)
    assert o is out and l is lse
    o_ref, lse_ref = ref.mla_paged_attention(q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_len_arr,
                                             sm_scale=sm_scale, causal=causal)
    _compare(o, l, o_ref, lse_ref)
    return w, out, lse


@pytest.mark.parametrize("H", [64, 128])
def test_decode_lengths(H):
    # page boundaries, one token, an empty request, a partial last page (NaN tail), long contexts
    lens = [1, 63, 64, 65, 0, 127, 128, 129, 4096, 8192, 1000]
    check(make([1] * len(lens), lens, H), H)


@pytest.mark.parametrize("B", [1, 2, 3, 64, 131, 132])
@pytest.mark.parametrize("H", [64, 128])
def test_batch_sweep(B, H):
    g = torch.Generator().manual_seed(B * 7 + H)
    lens = torch.randint(1, 4097, (B,), generator=g).tolist()
    if B > 2:
        lens[1] = 0  # an empty request in the batch
    check(make([1] * B, lens, H), H)


@pytest.mark.parametrize("B,H", [(64, 128), (132, 128)])
@pytest.mark.parametrize("L", [4096, 8192])
def test_benchmark_shapes(B, H, L):
    """The compute-bound benchmark rows: every request at the same length."""
    check(make([1] * B, [L] * B, H, spare_pages=3), H)


@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("lens", [[32768], [16384, 100], [8192, 8191, 65], [32767, 0, 4097]])
def test_split_kv(H, lens):
    """Few requests, long contexts: the planner splits them (pieces start inside pages) and the last CTA of a
    (request, row tile) merges the partials in the same launch."""
    check(make([1] * len(lens), lens, H), H, expect_split=True)


@pytest.mark.parametrize("H", [16, 32, 96])
def test_head_counts_off_the_tile(H):
    """Head counts that leave rows of the 64-row tile unused (served, with idle MMA rows)."""
    check(make([1] * 5, [1, 64, 65, 3000, 0], H), H)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("qo_lens,kv_lens,H", [([2, 3, 4], [9, 100, 4096], 128), ([2] * 8, [512] * 8, 64),
                                               ([4, 1, 2], [3, 64, 1], 32), ([2, 4], [1, 2], 128)])
def test_multi_token_rows(qo_lens, kv_lens, H, causal):
    """Rows of several query tokens packed (token-major) into the 64-row tiles; causal bottom-right (the last
    case has rows that see no key: O = 0, LSE = -inf)."""
    check(make(qo_lens, kv_lens, H), H, causal=causal)


def test_float16_and_negative_scale():
    case = make([1, 1, 2], [70, 3, 4000], 128, dtype=torch.float16)
    check(case, 128, dtype=torch.float16, causal=True)
    check(case, 128, dtype=torch.float16, sm_scale=-0.05)


@pytest.mark.parametrize("tune", ["schedule=1", "merge_kernel=0", "split_waves=4", "merge_kernel=0,split_waves=4",
                                  "split_waves=0.5,split_min_tokens=256"])
def test_tuning_variants(monkeypatch, tune):
    """The Tiles variants off the default (the S-first consumer schedule, the split-KV merge by the last CTA
    instead of the merge kernel) against the oracle: page boundaries, empty and long requests, split-KV, a head count
    off the tile, a second run of a split plan, and for the schedule causal multi-token rows (the merge kernel
    does not see the mask: one causal build fewer)."""
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_TUNE", tune)
    check(make([1] * 7, [1, 63, 64, 65, 0, 4096, 1000], 128), 128)
    case = make([1, 1, 1], [32768, 100, 8191], 128)
    w, out, lse = check(case, 128, expect_split=True)
    out2, lse2 = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    w.run(*case[:4], out=out2, lse=lse2, return_lse=True)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    check(make([1, 1], [20000, 9000], 64), 64, expect_split=True)
    check(make([2, 3], [20000, 5000], 64), 64, expect_split=True)  # split multi-token rows (token-major rows)
    check(make([1] * 5, [1, 64, 65, 3000, 0], 16), 16)
    if tune == "schedule=1":
        check(make([2, 3, 4], [9, 100, 4096], 128), 128, causal=True)
        check(make([2, 4], [1, 2], 128), 128, causal=True)  # rows that see no key


def test_rerun_reuses_counters():
    """Split-KV counters are reset by the merging CTA: a second run of the same plan is right too."""
    case = make([1, 1], [20000, 9000], 128)
    w, out, lse = check(case, 128, expect_split=True)
    out2 = torch.full_like(out, float("nan"))
    lse2 = torch.full_like(lse, float("nan"))
    w.run(*case[:4], out=out2, lse=lse2, return_lse=True)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


def test_matches_portable_kernel(monkeypatch):
    """The same batch through both kernels: both within tolerance of each other (and of the oracle above)."""
    case = make([1] * 6, [5, 64, 700, 4096, 0, 129], 128)
    _, out, lse = check(case, 128)
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_KERNEL", "portable")
    w = BatchMLAPagedAttentionWrapper(workspace())
    w.plan(*case[4:], 128, DC, DR, PS, False, SM_SCALE, torch.bfloat16, torch.bfloat16)
    assert w._plan["module"].NAME == "mla_decode_portable"
    o_p, l_p = w.run(*case[:4], return_lse=True)
    assert rel(out, o_p) < TOL_O
    fin = torch.isfinite(l_p)
    assert torch.equal(fin, torch.isfinite(lse)) and (lse[fin] - l_p[fin]).abs().max().item() < TOL_LSE


def test_direct_launch():
    """The kernel module's own compile / launch on a hand-built plan (the custom op's path without the API)."""
    from cutedsl_attn.compile import get_compiled
    from cutedsl_attn.dispatch import mla_choice, mla_limits, mla_problem
    from cutedsl_attn.planning.mla import MlaArgs, plan_mla
    from cutedsl_attn.sm90 import mla as sm90

    H = 128
    lens = [4096, 1, 0, 200, 32000]
    q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_len_arr = make([1] * len(lens), lens, H)
    module, cfg = mla_choice(mla_problem(dtype=torch.bfloat16, page_size=PS, causal=False))
    assert module is sm90
    lim = mla_limits(module, cfg)
    qo_h, kv_h = qo_indptr.cpu(), kv_indptr.cpu()
    wp = plan_mla(qo_h[1:] - qo_h[:-1], kv_len_arr.cpu(), qo_h[:-1], kv_h[:-1], num_heads=H, page_size=PS,
                  num_sms=torch.cuda.get_device_properties(0).multi_processor_count, **lim)
    assert wp.num_partials > 0  # the long request is split
    T = q_nope.shape[0]
    out = torch.full((T, H, DC), float("nan"), dtype=torch.bfloat16, device=DEV)
    lse = torch.full((T, H), float("nan"), dtype=torch.float32, device=DEV)
    part_o = torch.full((wp.num_partials, wp.rows, DC), float("nan"), device=DEV)
    part_lse = torch.full((wp.num_partials, wp.rows), float("nan"), device=DEV)
    counters = torch.zeros(len(lens) * wp.row_tiles, dtype=torch.int32, device=DEV)
    fn = get_compiled(module.NAME, cfg, module.compile)
    module.launch(fn, cfg, MlaArgs(q_nope, q_pe, ckv, kpe, kv_indices, wp.work.to(DEV), out, lse, part_o, part_lse,
                                   counters, SM_SCALE, wp.row_tiles, 0.5))
    torch.cuda.synchronize()
    assert (counters == 0).all(), "the merging CTA resets its counter"
    o_ref, lse_ref = ref.mla_paged_attention(q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_len_arr,
                                             sm_scale=SM_SCALE)
    _compare(out, lse, o_ref * 0.5, lse_ref)  # output_scale multiplies O, not the LSE


@pytest.mark.parametrize("q_len", [1, 2])
def test_trtllm_entry(q_len):
    """``trtllm_batch_decode_with_kv_cache_mla``: one combined ``[pages, 64, 576]`` cache (ckv / kpe are strided
    views of it: the TMA boxes read 1152-byte rows), fused bmm scales, block tables padded with -1."""
    from cutedsl_attn.api.mla_trtllm import trtllm_batch_decode_with_kv_cache_mla

    H, D = 128, DC + DR
    seq_lens = [1, 64, 65, 0, 5000, 20000]
    B = len(seq_lens)
    npages = [-(-L // PS) for L in seq_lens]
    n = sum(npages) + 3
    ids = torch.randperm(n, device=DEV).to(torch.int32)
    bt = torch.full((B, max(npages) + 1), -1, dtype=torch.int32, device=DEV)
    kv = torch.full((n, PS, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    pos = 0
    for b, L in enumerate(seq_lens):
        if L:
            pg = ids[pos: pos + npages[b]]
            pos += npages[b]
            bt[b, : npages[b]] = pg
            rows = torch.randn(npages[b] * PS, D, device=DEV)
            rows[L:] = float("nan")
            kv[pg.long()] = rows.view(-1, PS, D).to(torch.bfloat16)
    query = torch.randn(B, q_len, H, D, device=DEV).to(torch.bfloat16)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    out = torch.full((B, q_len, H, DC), float("nan"), dtype=torch.bfloat16, device=DEV)
    bmm1, bmm2 = 0.04, 1.5
    o = trtllm_batch_decode_with_kv_cache_mla(query, kv, workspace(), 128, 512, 64, bt, sl, max(seq_lens), out=out,
                                              bmm1_scale=bmm1, bmm2_scale=bmm2)
    o = o[0] if isinstance(o, tuple) else o
    kv_indptr = torch.tensor([0] + torch.tensor(npages).cumsum(0).tolist(), dtype=torch.int32)
    kv_indices = torch.cat([bt[b, : npages[b]].cpu() for b in range(B)])
    q = query.reshape(B * q_len, H, D)
    o_ref, _ = ref.mla_paged_attention(q[..., :DC], q[..., DC:], kv[..., :DC], kv[..., DC:],
                                       torch.arange(B + 1, dtype=torch.int32) * q_len, kv_indptr, kv_indices,
                                       sl.cpu(), sm_scale=bmm1, causal=q_len > 1)
    assert rel(o.reshape(B * q_len, H, DC), o_ref.to(DEV) * bmm2) < TOL_O


def test_page_ids_past_32_bit_offsets():
    """Page ids whose ``page_id * page_stride`` passes 2^32 elements (TMA coordinates and gather addresses)."""
    stride = PS * DC
    base = (1 << 32) // stride + 7
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
    q_nope, q_pe, _, _, qo_indptr, kv_indptr, kv_indices, kv_len_arr = make([1, 1, 1], lens, 128, page_base=base,
                                                                            spare_pages=2, ckv=ckv, kpe=kpe)
    assert int(kv_indices.min()) * stride >= 1 << 32
    w = BatchMLAPagedAttentionWrapper(workspace())
    w.plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, 128, DC, DR, PS, False, SM_SCALE, torch.bfloat16,
           torch.bfloat16)
    assert w._plan["module"].NAME == "mla_decode_sm90"
    out = torch.full((3, 128, DC), float("nan"), dtype=torch.bfloat16, device=DEV)
    w.run(q_nope, q_pe, ckv, kpe, out=out)
    o_ref, _ = ref.mla_paged_attention(q_nope, q_pe, ckv[base:], kpe[base:], qo_indptr, kv_indptr,
                                       kv_indices - base, kv_len_arr, sm_scale=SM_SCALE)
    assert rel(out, o_ref) < TOL_O


@pytest.mark.parametrize("tune", ["", "merge_kernel=0", "split_waves=4", "merge_kernel=0,split_waves=4"])
def test_cuda_graph_replay_after_replan(monkeypatch, tune):
    """CUDA-graph mode: a fixed grid (padding work rows exit at once), re-planned lengths replayed, split-KV
    counters left at 0 by the merging CTAs (or, with the merge kernel, its grid over every work row)."""
    if tune:
        monkeypatch.setenv("CUTEDSL_ATTN_MLA_TUNE", tune)
    B, H, max_pages = 8, 128, 8 * 130
    i32 = dict(dtype=torch.int32, device=DEV)
    bufs = dict(qo_indptr=torch.zeros(B + 1, **i32), kv_indptr=torch.zeros(B + 1, **i32),
                kv_indices=torch.zeros(max_pages, **i32), kv_len_arr=torch.zeros(B, **i32))
    w = BatchMLAPagedAttentionWrapper(workspace(), use_cuda_graph=True, **bufs)
    g = torch.Generator().manual_seed(12)
    lens1 = torch.randint(1, 4000, (B,), generator=g).tolist()
    case = make([1] * B, lens1, H, spare_pages=max_pages)
    q_nope, q_pe, ckv, kpe = case[:4]
    ckv.nan_to_num_(0.0)  # later page maps own any slot; the NaN-tail rule is tested without graphs
    kpe.nan_to_num_(0.0)
    w.plan(*case[4:], H, DC, DR, PS, False, SM_SCALE, torch.bfloat16, torch.bfloat16)
    assert w._plan["module"].NAME == "mla_decode_sm90"
    out = torch.empty(B, H, DC, dtype=torch.bfloat16, device=DEV)
    lse = torch.empty(B, H, dtype=torch.float32, device=DEV)
    w.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse)  # warm-up: compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse)
    for lens in (lens1, [8000, 1, 0, 64, 65, 3000, 8100, 2], [0] * 7 + [8192]):
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
        _compare(out, lse, o_ref, lse_ref)


# ------------------------------------------------------------------ small pages and fp8 (gathered blocks)
@pytest.fixture
def forced_sm90(monkeypatch):
    """The SM90 kernel wherever it serves: auto keeps pages below 64, and fp8 below 64 heads, on the portable one."""
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_KERNEL", "sm90")


SMALL_PAGES = [1, 16, 32]


@pytest.mark.usefixtures("forced_sm90")
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("ps", SMALL_PAGES)
def test_small_pages_lengths(ps, H):
    # one token, page and block boundaries (a block spans 64 / ps pages), an empty request, NaN tails, 5000
    lens = sorted({1, max(1, ps - 1), ps, ps + 1, 2 * ps + 1, 63, 64, 65, 127, 128, 129, 1000, 5000}) + [0]
    check(make([1] * len(lens), lens, H, ps=ps), H)


@pytest.mark.usefixtures("forced_sm90")
@pytest.mark.parametrize("ps", [2, 4, 8])
def test_other_page_sizes_dividing_64(ps):
    check(make([1] * 6, [1, ps + 1, 64, 65, 3000, 0], 64, ps=ps), 64)


@pytest.mark.usefixtures("forced_sm90")
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("ps", SMALL_PAGES)
@pytest.mark.parametrize("lens", [[32768], [16384, 100], [8192, 8191, 65]])
def test_small_pages_split_kv(ps, H, lens):
    """Split pieces start inside blocks (16-token multiples): the rows before a piece's start are zeroed."""
    check(make([1] * len(lens), lens, H, ps=ps), H, expect_split=True)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("ps", SMALL_PAGES)
@pytest.mark.parametrize("qo_lens,kv_lens,H", [([2, 3, 1, 2], [9, 100, 1, 4096], 128), ([2, 4], [1, 2], 128),
                                               ([2] * 4, [513] * 4, 16)])
@pytest.mark.usefixtures("forced_sm90")
def test_small_pages_multi_token_rows(qo_lens, kv_lens, H, ps, causal):
    check(make(qo_lens, kv_lens, H, ps=ps), H, causal=causal)


@pytest.mark.usefixtures("forced_sm90")
@pytest.mark.parametrize("tune", ["schedule=1", "merge_kernel=0"])
def test_small_pages_tuning_variants(monkeypatch, tune):
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_TUNE", tune)
    check(make([1] * 6, [1, 15, 16, 17, 0, 4096], 128, ps=16), 128)
    check(make([1, 1], [20000, 9000], 128, ps=1), 128, expect_split=True)
    check(make([2, 3], [50, 3000], 64, ps=32, dtype=torch.float16), 64, causal=True, dtype=torch.float16)


@pytest.mark.usefixtures("forced_sm90")
def test_small_pages_match_page_64():
    """The same tokens in 16-token pages (gathered) and in 64-token pages (TMA): the same O to rounding."""
    lens = [5, 64, 700, 4096, 0, 129]
    case16 = make([1] * len(lens), lens, 128, ps=16)
    _, out16, lse16 = check(case16, 128)
    q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_len_arr = case16
    # regroup each request's 16-token pages into 64-token pages (NaN past its end)
    ckv64, kpe64, ind64, ptr64 = [], [], [], [0]
    for b, L in enumerate(lens):
        pg = kv_indices[int(kv_indptr[b]): int(kv_indptr[b + 1])].long()
        n64 = -(-L // 64)
        c = torch.full((n64 * 64, DC), float("nan"), dtype=torch.bfloat16, device=DEV)
        r = torch.full((n64 * 64, DR), float("nan"), dtype=torch.bfloat16, device=DEV)
        c[:L] = ckv[pg].reshape(-1, DC)[:L]
        r[:L] = kpe[pg].reshape(-1, DR)[:L]
        ind64 += list(range(len(ckv64), len(ckv64) + n64))
        ckv64 += list(c.view(n64, 64, DC))
        kpe64 += list(r.view(n64, 64, DR))
        ptr64.append(ptr64[-1] + n64)
    i32 = dict(dtype=torch.int32, device=DEV)
    case64 = (q_nope, q_pe, torch.stack(ckv64), torch.stack(kpe64), qo_indptr, torch.tensor(ptr64, **i32),
              torch.tensor(ind64, **i32), kv_len_arr)
    _, out64, lse64 = check(case64, 128)
    assert rel(out16, out64) < TOL_O
    fin = torch.isfinite(lse64)
    assert torch.equal(fin, torch.isfinite(lse16)) and (lse16[fin] - lse64[fin]).abs().max().item() < TOL_LSE


@pytest.mark.usefixtures("forced_sm90")
@pytest.mark.parametrize("ps", [1, 32])
def test_small_pages_trtllm_entry(ps, launched):
    """The combined ``[pages, ps, 576]`` cache: ckv / kpe rows gathered by stride (1152-byte rows)."""
    from cutedsl_attn.api.mla_trtllm import trtllm_batch_decode_with_kv_cache_mla

    H, D = 128, DC + DR
    seq_lens = [1, 63, 64, 65, 0, 5000]
    B = len(seq_lens)
    npages = [-(-L // ps) for L in seq_lens]
    n = sum(npages) + 3
    ids = torch.randperm(n, device=DEV).to(torch.int32)
    bt = torch.full((B, max(npages) + 1), -1, dtype=torch.int32, device=DEV)
    kv = torch.full((n, ps, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    pos = 0
    for b, L in enumerate(seq_lens):
        if L:
            pg = ids[pos: pos + npages[b]]
            pos += npages[b]
            bt[b, : npages[b]] = pg
            rows = torch.randn(npages[b] * ps, D, device=DEV)
            rows[L:] = float("nan")
            kv[pg.long()] = rows.view(-1, ps, D).to(torch.bfloat16)
    query = torch.randn(B, 2, H, D, device=DEV).to(torch.bfloat16)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    out = torch.full((B, 2, H, DC), float("nan"), dtype=torch.bfloat16, device=DEV)
    o = trtllm_batch_decode_with_kv_cache_mla(query, kv, workspace(), 128, 512, 64, bt, sl, max(seq_lens), out=out,
                                              bmm1_scale=0.04, bmm2_scale=1.5)
    assert launched == ["mla_decode_sm90"]
    o = o[0] if isinstance(o, tuple) else o
    kv_indptr = torch.tensor([0] + torch.tensor(npages).cumsum(0).tolist(), dtype=torch.int32)
    kv_indices = torch.cat([bt[b, : npages[b]].cpu() for b in range(B)])
    q = query.reshape(B * 2, H, D)
    o_ref, _ = ref.mla_paged_attention(q[..., :DC], q[..., DC:], kv[..., :DC], kv[..., DC:],
                                       torch.arange(B + 1, dtype=torch.int32) * 2, kv_indptr, kv_indices,
                                       sl.cpu(), sm_scale=0.04, causal=True)
    assert rel(o.reshape(B * 2, H, DC), o_ref.to(DEV) * 1.5) < TOL_O


@pytest.mark.usefixtures("forced_sm90")
@pytest.mark.parametrize("ps", [1, 32])
def test_small_pages_page_ids_past_32_bit_offsets(ps):
    """Page ids whose ``page_id * page_stride`` passes 2^32 elements (the page ids times the stride in 64 bits)."""
    stride = ps * DC
    base = (1 << 32) // stride + 7
    lens = [100, 4096, 33]
    n = sum(-(-L // ps) for L in lens) + 2
    need = (base + n) * ps * (DC + DR) * 2
    free, _ = torch.cuda.mem_get_info()
    if need + (4 << 30) > min(free, 40 << 30):
        pytest.skip(f"needs {need / 2**30:.1f} GiB for the caches; {free / 2**30:.1f} GiB free (limit 40 GiB)")
    ckv = torch.empty((base + n, ps, DC), dtype=torch.bfloat16, device=DEV)
    kpe = torch.empty((base + n, ps, DR), dtype=torch.bfloat16, device=DEV)
    ckv[base:] = float("nan")
    kpe[base:] = float("nan")
    q_nope, q_pe, _, _, qo_indptr, kv_indptr, kv_indices, kv_len_arr = make(
        [1, 1, 1], lens, 128, page_base=base, spare_pages=2, ckv=ckv, kpe=kpe, ps=ps)
    assert int(kv_indices.min()) * stride >= 1 << 32
    w = BatchMLAPagedAttentionWrapper(workspace())
    w.plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, 128, DC, DR, ps, False, SM_SCALE, torch.bfloat16,
           torch.bfloat16)
    assert w._plan["module"].NAME == "mla_decode_sm90"
    out = torch.full((3, 128, DC), float("nan"), dtype=torch.bfloat16, device=DEV)
    w.run(q_nope, q_pe, ckv, kpe, out=out)
    o_ref, _ = ref.mla_paged_attention(q_nope, q_pe, ckv[base:], kpe[base:], qo_indptr, kv_indptr,
                                       kv_indices - base, kv_len_arr, sm_scale=SM_SCALE)
    assert rel(out, o_ref) < TOL_O
    del ckv, kpe
    torch.cuda.empty_cache()


@pytest.fixture
def launched(monkeypatch):
    """The NAMEs of the MLA kernels the dispatch layer launches during the test (its launch, wrapped)."""
    from cutedsl_attn.dispatch import mla as d

    seen, real = [], d._mla_launch_direct

    def spy(module, cfg, args):
        seen.append(module.NAME)
        real(module, cfg, args)

    monkeypatch.setattr(d, "_mla_launch_direct", spy)
    return seen


# fp8 caches through the trtllm / xqa entry points (the fp8 tests' inputs, oracle and tolerances)
@pytest.mark.usefixtures("forced_sm90")
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("ps", [1, 16, 32, 64])
@pytest.mark.parametrize("q_dtype", ["e4m3", "bfloat16", "float16"])
def test_fp8_kv_matches_oracle(q_dtype, ps, H, q_len, launched):
    from test_mla_fp8_gpu import E4M3, check_trtllm  # (tests/ is on sys.path)

    qd = {"e4m3": E4M3, "bfloat16": torch.bfloat16, "float16": torch.float16}[q_dtype]
    check_trtllm([1, max(1, ps - 1), ps, ps + 1, 0, 63, 64, 65, 1000, 5000], q_len, H, ps, q_dtype=qd)
    assert launched == ["mla_decode_sm90"]


@pytest.mark.usefixtures("forced_sm90")
@pytest.mark.parametrize("q_len,H,ps", [(1, 128, 64), (2, 16, 32), (1, 128, 1)])
def test_fp8_kv_split_kv_and_scales(q_len, H, ps, launched):
    from test_mla_fp8_gpu import SM_SCALE as S, check_trtllm

    check_trtllm([8192, 4000], q_len, H, ps)
    check_trtllm([32768], q_len, H, ps)
    # fp8 per-tensor scales fused as FlashInfer documents: bmm1 = q_scale * k_scale * sm_scale, bmm2 = v * o
    check_trtllm([70, 3, 500], q_len, H, ps, bmm1=0.5 * 2.0 * S, bmm2=1.5 * 0.25)
    check_trtllm([16384], q_len, H, ps, bmm1=-0.02, bmm2=3.0)
    assert set(launched) == {"mla_decode_sm90"}


@pytest.mark.usefixtures("forced_sm90")
@pytest.mark.parametrize("tune", ["fp8_loads=0,consumer_registers=224", "schedule=1", "merge_kernel=0"])
def test_fp8_tuning_variants(monkeypatch, tune, launched):
    """fp8 bytes through registers instead of staged in the stage, and the other Tiles variants, over fp8."""
    from test_mla_fp8_gpu import E4M3, check_trtllm

    monkeypatch.setenv("CUTEDSL_ATTN_MLA_TUNE", tune)
    check_trtllm([1, 15, 16, 17, 0, 63, 64, 65, 5000], 2, 128, 16, q_dtype=E4M3)
    check_trtllm([1, 64, 65, 0, 3000], 1, 16, 64, q_dtype=torch.bfloat16)
    check_trtllm([32768], 1, 128, 1, q_dtype=torch.bfloat16)
    assert set(launched) == {"mla_decode_sm90"}


@pytest.mark.usefixtures("forced_sm90")
@pytest.mark.parametrize("ps", [32, 64])
def test_fp8_xqa_mla(ps, launched):
    from test_mla_fp8_gpu import SM_SCALE as S, check_xqa

    for lens in ([2], [15, 256], [514, 2048], [16384, 3, 0]):
        check_xqa(lens, ps, q_scale=0.5 * S, kv_scale=0.75)
    assert set(launched) == {"mla_decode_sm90"}


@pytest.mark.usefixtures("forced_sm90")
def test_fp8_kv_page_ids_past_32_bit_offsets(launched):
    """fp8 page 32 x 576 bytes: page ids past 2^32 / stride (1 byte per element)."""
    from test_mla_fp8_gpu import D as D8, E4M3, SM_SCALE as S, make as make8, oracle

    ps = 32
    stride = ps * D8
    base = (1 << 32) // stride + 7
    lens = [100, 4096, 33]
    n = sum(-(-L // ps) for L in lens) + 5
    free, _ = torch.cuda.mem_get_info()
    if (base + n) * stride + (4 << 30) > min(free, 40 << 30):
        pytest.skip(f"needs {(base + n) * stride / 2**30:.1f} GiB for the cache")
    from cutedsl_attn.api.mla_trtllm import trtllm_batch_decode_with_kv_cache_mla

    query, kv, bt, sl = make8(lens, 1, 128, ps, q_dtype=E4M3, kv_dtype=E4M3, page_base=base)
    assert int(bt[bt >= 0].min()) * stride >= 1 << 32
    out = torch.full((3, 1, 128, DC), float("nan"), dtype=torch.bfloat16, device=DEV)
    trtllm_batch_decode_with_kv_cache_mla(query, kv, workspace(), 128, 512, 64, bt, sl, max(lens), out=out,
                                          bmm1_scale=S)
    assert launched == ["mla_decode_sm90"]
    o_ref, _ = oracle(query, kv, bt, sl, ps, sm_scale=S, out_scale=1.0)
    assert rel(out.cpu(), o_ref) < TOL_O


# ------------------------------------------------------------------ the small-head form (Tiles.swap_ab)
def _swap_env(monkeypatch, tune="swap_ab=1"):
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_KERNEL", "sm90")
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_TUNE", tune)


def check_swap(case, H, **kw):
    """:func:`check` asserting the swapped kernel ran (the plan's tiles carry swap_ab 1)."""
    w, out, lse = check(case, H, **kw)
    assert w._plan["cfg"].tiles.swap_ab == 1, w._plan["cfg"].tiles
    return w, out, lse


SWAP_LENS = [1, 15, 16, 17, 63, 64, 65, 0, 127, 128, 129, 1000, 5000]  # page / block boundaries, an empty request


@pytest.mark.parametrize("tune", ["swap_ab=1", "swap_ab=1,tile_n=16"])
@pytest.mark.parametrize("ps", [64, 16])
@pytest.mark.parametrize("H", [16, 32])
def test_swap_ab_decode_lengths(monkeypatch, H, ps, tune):
    """q_len 1 at 16 and 32 heads (32 on tile_n 16 is refused: its own test), TMA pages and gathered ones."""
    if H > 16 and "tile_n=16" in tune:
        pytest.skip("32 packed rows do not fit tile_n 16")
    _swap_env(monkeypatch, tune)
    check_swap(make([1] * len(SWAP_LENS), SWAP_LENS, H, ps=ps), H)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("ps", [64, 16])
def test_swap_ab_two_token_rows(monkeypatch, ps, causal):
    """q_len 2 x 16 heads = 32 packed rows (token-major), causal bottom-right or not, mixed with q_len 1."""
    _swap_env(monkeypatch)
    check_swap(make([2, 1, 2, 2, 2], [9, 100, 0, 65, 4096], 16, ps=ps), 16, causal=causal)
    if causal:
        check_swap(make([2, 2], [1, 2], 16, ps=ps), 16, causal=True)  # a first row that sees no key


@pytest.mark.parametrize("tune", ["swap_ab=1", "swap_ab=1,merge_kernel=0", "swap_ab=1,tile_n=16,schedule=1"])
@pytest.mark.parametrize("ps", [64, 16])
def test_swap_ab_split_kv(monkeypatch, ps, tune):
    """Split-KV partials of the swapped epilogue through both merges (the merge kernel, the last CTA), a second
    run of the same plan bit-equal (the counters reset), 32 heads and split causal two-token rows."""
    _swap_env(monkeypatch, tune)
    case = make([1, 1, 1], [32768, 100, 8191], 16, ps=ps)
    w, out, lse = check_swap(case, 16, expect_split=True)
    out2, lse2 = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    w.run(*case[:4], out=out2, lse=lse2, return_lse=True)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    check_swap(make([1], [20000], 16, ps=ps), 16, expect_split=True)
    if "tile_n=16" not in tune:
        check_swap(make([1, 1], [20000, 9000], 32, ps=ps), 32, expect_split=True)
        check_swap(make([2, 1], [20000, 5000], 16, ps=ps), 16, causal=True, expect_split=True)


def test_swap_ab_float16_and_matches_default(monkeypatch):
    """float16, a negative scale; the same batch through swap_ab 0 within tolerance of swap_ab 1."""
    _swap_env(monkeypatch)
    case = make([1, 1, 2], [70, 3, 4000], 16, dtype=torch.float16)
    check_swap(case, 16, dtype=torch.float16, causal=True)
    check_swap(case, 16, dtype=torch.float16, sm_scale=-0.05)
    case = make([1] * 6, [5, 64, 700, 4096, 0, 129], 32)
    _, out, lse = check_swap(case, 32)
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_TUNE", "swap_ab=0")
    w = BatchMLAPagedAttentionWrapper(workspace())
    w.plan(*case[4:], 32, DC, DR, PS, False, SM_SCALE, torch.bfloat16, torch.bfloat16)
    assert w._plan["cfg"].tiles.swap_ab == 0
    o0, l0 = w.run(*case[:4], return_lse=True)
    assert rel(out, o0) < TOL_O
    fin = torch.isfinite(l0)
    assert torch.equal(fin, torch.isfinite(lse)) and (lse[fin] - l0[fin]).abs().max().item() < TOL_LSE


@pytest.mark.parametrize("tune,H,q_len", [("swap_ab=1", 32, 2), ("swap_ab=1", 64, 1), ("swap_ab=1,tile_n=16", 32, 1)])
def test_swap_ab_refuses_rows_past_tile_n(monkeypatch, tune, H, q_len):
    """More packed rows than tile_n: a ValueError naming tile_n at plan time, before any launch."""
    _swap_env(monkeypatch, tune)
    case = make([q_len, q_len], [100, 300], H)
    w = BatchMLAPagedAttentionWrapper(workspace())
    with pytest.raises(ValueError, match="tile_n"):
        w.plan(*case[4:], H, DC, DR, PS, False, SM_SCALE, torch.bfloat16, torch.bfloat16)
