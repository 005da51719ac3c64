"""GPU tests of ``cudnn_batch_decode_with_kv_cache`` (cuDNN frontend paged-decode graphs) against the float64
oracle ``cutedsl_attn.ref``.

Fresh random inputs every run (the seed is in every failure message); ``out`` and ``lse`` are poisoned with
NaN before each call; the cache pools start as NaN and only the pages a block table lists are filled (so
pages outside the tables are NaN); ``test_nan_in_slots_past_length`` also leaves the slots past each
request's length and the table tails NaN.  O is compared by relative Frobenius error (bf16 <= 1e-2, fp16
<= 4e-3), the LSE (base 2) by abs err < 2e-2 (``tests/_checks.py``).

Needs a CUDA GPU and an importable ``cudnn`` (cudnn-frontend); skipped otherwise.  Written for the H200 +
torch 2.11+cu130 (cuDNN 9.19) + cudnn-frontend 1.32 image.  Run with ``-rs -s``: a cuDNN decline within the
contract is a skip (or, for a sink at q_len_per_req == 1, a run of the decode wrapper it names) with cuDNN's
message printed.
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
from cutedsl_attn import ref  # noqa: E402
from cutedsl_attn.api.cudnn_decode import cudnn_batch_decode_with_kv_cache as decode  # noqa: E402
from _checks import TOL, check, rel_err  # noqa: E402

DEV = torch.device("cuda")
BF16, FP16 = torch.bfloat16, torch.float16
NAN = float("nan")
_WS = {}


def workspace():
    if "ws" not in _WS:
        _WS["ws"] = torch.empty(128 << 20, dtype=torch.uint8, device=DEV)
    return _WS["ws"]


def new_gen():
    seed = torch.seed() % (2**31)
    return torch.Generator().manual_seed(seed), seed


def make(B, m, hq, hkv, d, ps, dtype, gen, *, lens=None, max_len=700, layout="HND", strict_nan=False, spare=5,
         extra_cols=2, q=None, width=None, total=None):
    """A paged problem: NaN pools with only the listed pages filled (``strict_nan``: only each request's valid
    slots, table tails pointing at a NaN page); q ``[B*m, hq, d]``; caches as ``(pages, hkv, ps, d)`` views.
    ``width`` / ``total`` fix the table width and the pool's page count (default: just enough + spares)."""
    if lens is None:
        lens = torch.randint(max(m, 1), max_len + 1, (B,), generator=gen).tolist()
    npg = [-(-n // ps) for n in lens]
    total = sum(npg) + spare if total is None else total
    if width is None:
        width = max(npg) + extra_cols
        if m > 1:  # the multi-row graph reads whole 128-key tiles: table columns up to that boundary
            width = max(width, -(-(-(-max(lens) // 128) * 128) // ps))
    assert total > sum(npg) and width >= max(npg)
    perm = torch.randperm(total, generator=gen)
    nan_page = int(perm[-1])
    table = torch.zeros(B, width, dtype=torch.int32)
    valid = torch.zeros(total, ps, dtype=torch.bool)
    o = 0
    for b, n in enumerate(npg):
        pages = perm[o:o + n]
        o += n
        table[b, :n] = pages.to(torch.int32)
        table[b, n:] = nan_page if strict_nan else int(pages[0])
        for t, pg in enumerate(pages.tolist()):
            valid[pg, : (min(ps, lens[b] - t * ps) if strict_nan else ps)] = True
    shape = (total, ps, hkv, d) if layout == "NHD" else (total, hkv, ps, d)
    vmask = valid.reshape(total, ps, 1, 1) if layout == "NHD" else valid.reshape(total, 1, ps, 1)
    kp = torch.where(vmask, torch.randn(shape, generator=gen), torch.tensor(NAN)).to(dtype).to(DEV)
    vp = torch.where(vmask, torch.randn(shape, generator=gen), torch.tensor(NAN)).to(dtype).to(DEV)
    if q is None:
        q = torch.randn(B * m, hq, d, generator=gen).to(dtype).to(DEV)
    k, v = (kp.transpose(1, 2), vp.transpose(1, 2)) if layout == "NHD" else (kp, vp)
    return dict(q=q, k=k, v=v, pools=(kp, vp), table=table.to(DEV), lens=torch.tensor(lens, dtype=torch.int32).to(DEV),
                ps=ps, layout=layout, m=m, B=B)


def oracle(p, *, scale, window_left=-1, sinks=None):
    indptr, indices, last = ref.block_tables_to_csr(p["table"].cpu(), p["lens"].reshape(-1).cpu(), p["ps"])
    kp, vp = p["pools"]
    kw = dict(kv_layout=p["layout"], sm_scale=scale, window_left=window_left, sinks=sinks)
    if p["m"] == 1:
        return ref.paged_decode(p["q"], kp, vp, indptr, indices, last, **kw)
    qo = torch.arange(p["B"] + 1, dtype=torch.int32) * p["m"]
    return ref.paged_prefill(p["q"], kp, vp, qo, indptr, indices, last, causal=True, **kw)


def run(p, *, scale=None, return_lse=True, window_left=-1, sinks=None, max_sequence_kv=None, **kw):
    rows, hq, d = p["q"].shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.full((rows, hq, p["v"].shape[-1]), NAN, dtype=p["q"].dtype, device=DEV)
    lse = torch.full((rows, hq), NAN, dtype=torch.float32, device=DEV) if return_lse else None
    r = decode(p["q"], p["k"], p["v"], scale, workspace(),
               max_sequence_kv=int(p["lens"].max()) if max_sequence_kv is None else max_sequence_kv,
               actual_seq_lens_kv=p["lens"], block_tables=p["table"], out=out, return_lse=return_lse, lse=lse,
               q_len_per_req=p["m"], window_left=window_left, sinks=sinks, **kw)
    torch.cuda.synchronize()
    if return_lse:
        assert r[0] is out and r[1] is lse
    else:
        assert r is out
    return out, lse, scale


def compare(p, what, **kw):
    out, lse, scale = run(p, **kw)
    o_ref, lse_ref = oracle(p, scale=scale, window_left=kw.get("window_left", -1), sinks=kw.get("sinks"))
    if lse is None:
        assert not torch.isnan(out).any(), f"{what}: NaN / unwritten output"
        e = rel_err(out, o_ref)
        assert e <= TOL[out.dtype], f"{what}: output rel err {e}"
        return e
    return check(out, lse, o_ref, lse_ref, out.dtype, what)


def test_versions():
    """cuDNN loaded by the frontend is the one torch uses (two libcudnn copies exist on the device image)."""
    cudnn = cd.require_cudnn()
    print(f"{cd.versions()}; torch cuDNN {torch.backends.cudnn.version()}, GPU {torch.cuda.get_device_name()}")
    assert cudnn.backend_version() == torch.backends.cudnn.version()


# ----------------------------------------------------------------------------- the main matrix
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("ps", [16, 64])
@pytest.mark.parametrize("heads", [(32, 8), (32, 1)], ids=["gqa32-8", "mqa32-1"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_decode_vs_oracle(dtype, heads, ps, m):
    gen, seed = new_gen()
    p = make(9, m, heads[0], heads[1], 128, ps, dtype, gen)
    compare(p, f"seed {seed} {dtype} {heads} ps={ps} m={m}", return_lse=(ps == 16))


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("window_left", [0, 37, 300])
def test_window_left(m, window_left):
    gen, seed = new_gen()
    p = make(7, m, 32, 8, 128, 16, BF16, gen, max_len=900)
    compare(p, f"seed {seed} window_left={window_left} m={m}", window_left=window_left)


def test_multi_token_window_and_sinks():
    gen, seed = new_gen()
    p = make(6, 4, 32, 8, 128, 16, BF16, gen)
    sinks = torch.randn(32, generator=gen).to(DEV)
    try:
        compare(p, f"seed {seed} q_len 4 window sinks", window_left=100, sinks=sinks)
    except NotImplementedError as e:  # a decline is within the contract when it says what serves the call
        msg = str(e)
        for s in ("window_left=100", "attention sinks", "cuDNN 9.", "BatchDecodeWithPagedKVCacheWrapper"):
            assert s in msg, (s, msg)
        pytest.skip(f"cuDNN declines a window with sinks at q_len_per_req 4: {msg}")


@pytest.mark.parametrize("m", [1, 2, 4])
def test_sinks_served_or_declined_clearly(m):
    """A sink at q_len_per_req >= 2 is served on 9.13+; at q_len_per_req == 1 only the SM100 FROST engine serves
    it, so on the H200 the call raises naming the feature, the versions and what serves it -- which then must
    give the oracle's answer."""
    gen, seed = new_gen()
    p = make(5, m, 32, 8, 128, 16, BF16, gen)
    sinks = (torch.randn(32, generator=gen) * 2).to(DEV)
    try:
        compare(p, f"seed {seed} sinks m={m}", sinks=sinks)
        return
    except NotImplementedError as e:
        msg = str(e)
        print(f"m={m}: cuDNN declined: {msg}")
        assert m == 1, f"cuDNN declined a sink at q_len_per_req={m}: {msg}"
        for s in ("attention sinks at q_len_per_req == 1", "cuDNN 9.", "cudnn-frontend 1.",
                  "BatchDecodeWithPagedKVCacheWrapper", "backend='cute'"):
            assert s in msg, (s, msg)
    # what the message names serves the same problem
    indptr, indices, last = ref.block_tables_to_csr(p["table"].cpu(), p["lens"].reshape(-1).cpu(), p["ps"])
    w = ca.BatchDecodeWithPagedKVCacheWrapper(workspace(), "HND", backend="cute")
    w.plan(indptr.to(DEV), indices.to(DEV), last.to(DEV), 32, 8, 128, 16, q_data_type=BF16)
    out, lse = w.run(p["q"], (p["k"], p["v"]), sinks=sinks, return_lse=True)
    o_ref, lse_ref = oracle(p, scale=1 / math.sqrt(128), sinks=sinks)
    check(out, lse, o_ref, lse_ref, BF16, f"seed {seed} sinks on the CuTe DSL decode wrapper")


# ----------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("m", [1, 4])
def test_strided_q_from_packed_qkv(m):
    gen, seed = new_gen()
    B, hq, hkv, d = 8, 32, 8, 128
    qkv = torch.randn(B * m, (hq + 2 * hkv) * d, generator=gen).to(BF16).to(DEV)
    q = qkv[:, : hq * d].view(B * m, hq, d)
    assert q.stride(0) == (hq + 2 * hkv) * d
    p = make(B, m, hq, hkv, d, 16, BF16, gen, q=q)
    compare(p, f"seed {seed} QKV slice m={m}")
    compare(dict(p, q=q.contiguous()), f"seed {seed} the same q contiguous m={m}")  # another graph, same answer


@pytest.mark.parametrize("ps", [16, 64])
def test_nhd_cache_as_transposed_view(ps):
    gen, seed = new_gen()
    p = make(8, 1, 32, 8, 128, ps, BF16, gen, layout="NHD")
    assert not p["k"].is_contiguous() and p["k"].shape[1] == 8
    compare(p, f"seed {seed} NHD view ps={ps}")


@pytest.mark.parametrize("m,ps", [(1, 16), (1, 64), pytest.param(4, 64, marks=pytest.mark.xfail(
    strict=True, reason="cuDNN 9.19's multi-row graph reads K/V up to the next 128-key boundary past each "
    "request's length (documented limitation of cudnn_batch_decode_with_kv_cache)"))])
def test_nan_in_slots_past_length(m, ps):
    """Slots past each request's length in its last page, and the table columns past its pages, hold NaN."""
    gen, seed = new_gen()
    p = make(9, m, 32, 8, 128, ps, BF16, gen, strict_nan=True)
    compare(p, f"seed {seed} NaN past the lengths m={m} ps={ps}")


def test_lengths_layouts_and_default():
    gen, seed = new_gen()
    p = make(6, 1, 32, 8, 128, 16, BF16, gen)
    e0 = compare(p, f"seed {seed} int32 [B]")
    compare(dict(p, lens=p["lens"].reshape(-1, 1, 1, 1)), f"seed {seed} int32 [B,1,1,1]")
    compare(dict(p, lens=p["lens"].to(torch.int64)), f"seed {seed} int64")
    full = make(4, 1, 32, 8, 128, 16, BF16, gen, lens=[200] * 4)
    out = torch.full_like(full["q"], NAN)
    decode(full["q"], full["k"], full["v"], 1 / math.sqrt(128), workspace(), max_sequence_kv=200,
           block_tables=full["table"], out=out)
    assert rel_err(out, oracle(full, scale=1 / math.sqrt(128))[0]) <= TOL[BF16] and e0 <= TOL[BF16]


def test_scale_is_honoured():
    gen, seed = new_gen()
    p = make(5, 1, 32, 8, 128, 16, FP16, gen)
    compare(p, f"seed {seed} scale 0.3", scale=0.3)


# ----------------------------------------------------------------------------- offsets
def test_dense_offsets_on_gpu_and_ragged_refused_before_launch():
    gen, seed = new_gen()
    p = make(6, 2, 32, 8, 128, 16, BF16, gen)
    qs, rows = p["q"].stride(0), p["q"].shape[0]
    dense = dict(batch_offsets_q=(torch.arange(7, device=DEV) * 2 * qs).to(torch.int32),
                 batch_offsets_o=torch.arange(6, device=DEV) * 2 * 32 * 128,
                 batch_offsets_k=torch.zeros(6, dtype=torch.int32, device=DEV))
    compare(p, f"seed {seed} dense offsets", **dense)
    out = torch.full((rows, 32, 128), NAN, dtype=BF16, device=DEV)
    ragged = torch.tensor([0, 3, 6, 9, 10, 12], dtype=torch.int32, device=DEV) * qs
    with pytest.raises(NotImplementedError, match="non-dense"):
        decode(p["q"], p["k"], p["v"], 0.1, workspace(), max_sequence_kv=int(p["lens"].max()),
               actual_seq_lens_kv=p["lens"], block_tables=p["table"], out=out, q_len_per_req=2,
               batch_offsets_q=ragged)
    torch.cuda.synchronize()
    assert torch.isnan(out).all(), "nothing may run before the offsets are refused"


# ----------------------------------------------------------------------------- graph reuse and CUDA graphs
def test_cached_graph_reused_with_changed_lengths_and_tables():
    gen, seed = new_gen()
    B, ps = 8, 16
    total = B * 19 + 3
    p = make(B, 1, 32, 8, 128, ps, BF16, gen, lens=[300] * B, width=19, total=total)
    compare(p, f"seed {seed} first", max_sequence_kv=300)
    builds = cd.graph_cache_info()["builds"]
    for step in range(3):  # new lengths, page ids and values; max_sequence_kv in the same bucket (257..304)
        lens = torch.randint(1, 300, (B,), generator=gen).tolist()
        q = make(B, 1, 32, 8, 128, ps, BF16, gen, lens=lens, width=19, total=total)
        compare(q, f"seed {seed} step {step}", max_sequence_kv=257 + 20 * step)
    assert cd.graph_cache_info()["builds"] == builds, "changed lengths / tables must reuse the graph"


@pytest.mark.parametrize("m", [1, 4])
def test_cuda_graph_capture_and_replay(m):
    """Capture one call, then replay it with new q, lengths, block-table contents and cache pages written into
    the captured buffers."""
    gen, seed = new_gen()
    B, hq, hkv, d, ps, width = 8, 32, 8, 128, 16, 40  # 640 keys: whole 128-key tiles of the 600 planned
    total = B * width + 3
    p = make(B, m, hq, hkv, d, ps, BF16, gen, lens=[600] * B, width=width, total=total)
    q_buf, lens_buf, table_buf = p["q"].clone(), p["lens"].clone(), p["table"].clone()
    out = torch.full((B * m, hq, d), NAN, dtype=BF16, device=DEV)
    lse = torch.full((B * m, hq), NAN, dtype=torch.float32, device=DEV)
    scale = 1 / math.sqrt(d)

    def step():
        decode(q_buf, p["k"], p["v"], scale, workspace(), max_sequence_kv=600, actual_seq_lens_kv=lens_buf,
               block_tables=table_buf, is_cuda_graph_compatible=True, out=out, return_lse=True, lse=lse,
               q_len_per_req=m)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # builds the graph eagerly: a capture cannot build it
    torch.cuda.current_stream().wait_stream(s)
    builds = cd.graph_cache_info()["builds"]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    assert cd.graph_cache_info()["builds"] == builds
    for r in range(3):
        lens = torch.randint(m, 601, (B,), generator=gen).tolist()
        nxt = make(B, m, hq, hkv, d, ps, BF16, gen, lens=lens, width=width, total=total)
        for dst, src in zip(p["pools"], nxt["pools"]):
            dst.copy_(src)
        q_buf.copy_(nxt["q"])
        table_buf.copy_(nxt["table"])
        lens_buf.copy_(nxt["lens"])
        out.fill_(NAN)
        lse.fill_(NAN)
        g.replay()
        torch.cuda.synchronize()
        o_ref, lse_ref = oracle(nxt, scale=scale)
        check(out, lse, o_ref, lse_ref, BF16, f"seed {seed} replay {r} m={m}")


def test_build_during_capture_is_refused():
    gen, _ = new_gen()
    p = make(3, 1, 32, 8, 128, 16, BF16, gen)
    cd.clear_graph_cache()
    out, ws, mx = torch.empty_like(p["q"]), workspace(), int(p["lens"].max())  # no host read inside the capture
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="before capturing"):
        with torch.cuda.graph(g):
            decode(p["q"], p["k"], p["v"], 0.1, ws, max_sequence_kv=mx,
                   actual_seq_lens_kv=p["lens"], block_tables=p["table"], out=out, is_cuda_graph_compatible=True)
