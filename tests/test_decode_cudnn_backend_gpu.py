"""GPU tests of ``backend="cudnn"`` / ``"auto"`` on ``BatchDecodeWithPagedKVCacheWrapper`` against the float64
oracle ``cutedsl_attn.ref``.

Fresh random inputs every run (the seed is in every failure message); ``out`` / ``lse`` poisoned with NaN;
one-row decode on cuDNN also with NaN in every slot a request does not own (cuDNN's one-row graph reads only
owned keys; its multi-row graph does not, so those cases keep finite slots); CUDA-graph capture, then replays
after re-plans with new lengths and pages (the cuDNN graph and its buffers kept).

Needs a CUDA GPU and an importable ``cudnn`` (cudnn-frontend); skipped otherwise.  Written for the H200 +
cuDNN 9.19 + cudnn-frontend 1.32 image.
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from cutedsl_attn.cudnn import decode as cd  # noqa: E402

if not cd.cudnn_available():
    pytest.skip("needs cudnn-frontend (pip install 'cutedsl-attn[cudnn]')", allow_module_level=True)

import cutedsl_attn as ca  # noqa: E402
from cutedsl_attn import dispatch, ref  # noqa: E402
from _checks import NAN, TOL, check, rel_err  # noqa: E402

DEV = torch.device("cuda")
BF16, FP16 = torch.bfloat16, torch.float16


def new_gen():
    seed = torch.seed() % (2**31)
    return torch.Generator().manual_seed(seed), seed


def make(lens, hq, hkv, d, ps, dtype, gen, *, layout="HND", m=1, strict_nan=True, total=None, width=None):
    """CSR + block table over a pool that is NaN everywhere a request owns no slot (``strict_nan``; else only
    unlisted pages are NaN and listed pages are fully finite); q ``[B * m, hq, d]``."""
    B = len(lens)
    npg = [-(-n // ps) for n in lens]
    total = sum(npg) + 4 if total is None else total
    width = max(npg) + 1 if width is None else width
    if m > 1:  # cuDNN's multi-row graph reads whole 128-key tiles: columns of valid pages up to that boundary
        width = max(width, -(-(-(-max(lens) // 128) * 128) // ps))
    perm = torch.randperm(total, generator=gen).to(torch.int32)
    used = perm[:sum(npg)]
    shape = (total, 2, hkv, ps, d) if layout == "HND" else (total, 2, ps, hkv, d)
    cache = torch.full(shape, NAN, dtype=dtype)
    vals = torch.randn(shape, generator=gen).to(dtype)
    table = torch.zeros(B, width, dtype=torch.int32)
    o = 0
    for b, (n, L) in enumerate(zip(npg, lens)):
        pages = used[o:o + n]
        o += n
        table[b, :n] = pages
        table[b, n:] = pages[0] if n else int(perm[-1])
        for i, pg in enumerate(pages.tolist()):
            k = min(ps, L - i * ps) if strict_nan else ps
            if layout == "HND":
                cache[pg, :, :, :k] = vals[pg, :, :, :k]
            else:
                cache[pg, :, :k] = vals[pg, :, :k]
    if not strict_nan:  # the multi-row graph reads past a length: every listed page finite
        cache[table.unique().long()] = vals[table.unique().long()]
    indptr = torch.tensor([0] + torch.tensor(npg).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([L - (n - 1) * ps for L, n in zip(lens, npg)], dtype=torch.int32)
    q = torch.randn(B * m, hq, d, generator=gen).to(dtype)
    return dict(cache=cache.to(DEV), table=table.to(DEV), lens=torch.tensor(lens, dtype=torch.int32, device=DEV),
                indptr=indptr.to(DEV), indices=used.to(DEV), last=last.to(DEV), q=q.to(DEV), hq=hq, hkv=hkv, d=d,
                ps=ps, layout=layout, m=m, host=dict(cache=cache, indptr=indptr, indices=used, last=last, q=q))


def oracle(p, **kw):
    h = p["host"]
    kw = dict(kv_layout=p["layout"], **kw)
    if p["m"] == 1:
        return ref.paged_decode(h["q"], h["cache"], None, h["indptr"], h["indices"], h["last"], **kw)
    B = len(h["last"])
    qo = torch.arange(B + 1, dtype=torch.int32) * p["m"]
    return ref.paged_prefill(h["q"], h["cache"], None, qo, h["indptr"], h["indices"], h["last"], causal=True, **kw)


def wrapper(layout, backend, **kw):
    return ca.BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=DEV), layout,
                                                 backend=backend, **kw)


def run_poisoned(w, p, **kw):
    out = torch.full((p["q"].shape[0], p["hq"], p["d"]), NAN, dtype=p["q"].dtype, device=DEV)
    lse = torch.full((p["q"].shape[0], p["hq"]), NAN, dtype=torch.float32, device=DEV)
    w.run(p["q"], p["cache"], out=out, lse=lse, return_lse=True, **kw)
    return out, lse


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("table", [False, True])
@pytest.mark.parametrize("heads", [(32, 8), (8, 1)])
def test_cudnn_one_row_vs_oracle_nan_in_unowned_slots(dtype, layout, table, heads):
    gen, seed = new_gen()
    lens = torch.randint(1, 900, (6,), generator=gen).tolist()
    p = make(lens, heads[0], heads[1], 128, 16, dtype, gen, layout=layout)
    w = wrapper(layout, "cudnn")
    if table:
        w.plan(None, None, None, p["hq"], p["hkv"], p["d"], p["ps"], q_data_type=dtype, block_tables=p["table"],
               seq_lens=p["lens"])
    else:
        w.plan(p["indptr"], p["indices"], p["last"], p["hq"], p["hkv"], p["d"], p["ps"], q_data_type=dtype)
    assert w._plan["cudnn"] is not None
    out, lse = run_poisoned(w, p)
    o_ref, lse_ref = oracle(p)
    check(out, lse, o_ref, lse_ref, dtype, f"seed {seed} {layout} table={table} {heads}")


@pytest.mark.parametrize("window_left", [-1, 100])
def test_cudnn_multirow_and_window_vs_oracle(window_left):
    gen, seed = new_gen()
    lens = torch.randint(4, 700, (5,), generator=gen).tolist()
    p = make(lens, 32, 8, 128, 16, BF16, gen, m=4, strict_nan=False)
    w = wrapper("HND", "cudnn", use_tensor_cores=True)
    w.plan(p["indptr"], p["indices"], p["last"], 32, 8, 128, 16, q_data_type=BF16, q_len_per_req=4,
           window_left=window_left)
    out, lse = run_poisoned(w, p)
    o_ref, lse_ref = oracle(p, window_left=window_left)
    check(out, lse, o_ref, lse_ref, BF16, f"seed {seed} m=4 window {window_left}")


def test_auto_rule_rows_route_and_agree():
    """A row the rule gives to cuDNN and one it keeps: both correct, on the backend the rule names."""
    gen, seed = new_gen()
    big = make([4096] * 64, 32, 8, 128, 16, BF16, gen, strict_nan=False)
    w = wrapper("HND", "auto")
    w.plan(big["indptr"], big["indices"], big["last"], 32, 8, 128, 16, q_data_type=BF16)
    assert w._plan.get("cudnn") is not None
    out, lse = run_poisoned(w, big)
    o_ref, lse_ref = oracle(big)
    check(out, lse, o_ref, lse_ref, BF16, f"seed {seed} auto large")
    w.run(big["q"], big["cache"], sinks=torch.zeros(32, device=DEV))  # handed to the CuTe DSL kernel
    small = make([8192], 32, 8, 128, 16, BF16, gen)
    w.plan(small["indptr"], small["indices"], small["last"], 32, 8, 128, 16, q_data_type=BF16)
    assert w._plan.get("cudnn") is None
    out, lse = run_poisoned(w, small)
    check(out, lse, *oracle(small), BF16, f"seed {seed} auto small")


def test_cuda_graph_replay_after_replans():
    gen, seed = new_gen()
    B, hq, hkv, d, ps, width, total = 8, 32, 8, 128, 16, 40, 8 * 40 + 3
    p = make([600] * B, hq, hkv, d, ps, BF16, gen, width=width, total=total)
    w = wrapper("HND", "cudnn", use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.zeros(B + 1, dtype=torch.int32, device=DEV),
                paged_kv_indices_buffer=torch.zeros(total, dtype=torch.int32, device=DEV),
                paged_kv_last_page_len_buffer=torch.zeros(B, dtype=torch.int32, device=DEV))
    w.plan(None, None, None, hq, hkv, d, ps, q_data_type=BF16, block_tables=p["table"], seq_lens=p["lens"])
    q_buf, cache = p["q"].clone(), p["cache"].clone()
    out = torch.full((B, hq, d), NAN, dtype=BF16, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        w.run(q_buf, cache, out=out)  # builds the cuDNN graph eagerly: a capture cannot build it
    torch.cuda.current_stream().wait_stream(s)
    builds = cd.graph_cache_info()["builds"]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q_buf, cache, out=out)
    assert cd.graph_cache_info()["builds"] == builds
    for r in range(3):
        lens = torch.randint(1, width * ps + 1, (B,), generator=gen).tolist()
        nxt = make(lens, hq, hkv, d, ps, BF16, gen, width=width, total=total)
        w.plan(None, None, None, hq, hkv, d, ps, q_data_type=BF16, block_tables=nxt["table"], seq_lens=nxt["lens"])
        q_buf.copy_(nxt["q"])
        cache.copy_(nxt["cache"])
        out.fill_(NAN)
        g.replay()
        torch.cuda.synchronize()
        e = rel_err(out, oracle(nxt)[0])
        assert not torch.isnan(out).any() and e <= TOL[BF16], f"seed {seed} replay {r}: {e}"
    assert cd.graph_cache_info()["builds"] == builds


def test_split_controls_keep_our_kernel():
    gen, seed = new_gen()
    p = make([300, 40, 900], 32, 8, 128, 16, BF16, gen)
    w = wrapper("HND", "cudnn")
    w.plan(p["indptr"], p["indices"], p["last"], 32, 8, 128, 16, q_data_type=BF16, fixed_split_size=4)
    assert w._plan.get("cudnn") is None
    out, lse = run_poisoned(w, p)
    check(out, lse, *oracle(p), BF16, f"seed {seed} fixed_split_size")
    assert dispatch.decode_backend("cudnn", batch_size=3, keep_split_controls=True) == "cute"
    assert math.isfinite(float(out.float().abs().max()))
