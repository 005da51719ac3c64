"""CPU tests of the trtllm / xqa entry points (``cutedsl_attn.api.trtllm``): signatures against FlashInfer 0.7.2's,
every validation error before any launch, and the scale table of every decode entry point (trtllm / xqa, the decode
wrapper's ``run(q_scale, k_scale, v_scale)`` on either backend, ``single_decode_with_kv_cache``, prims_ts'
``bmm1_scale`` / ``bmm2_scale``, ``cudnn_batch_decode_with_kv_cache``: what reaches the kernel's ``DecodeArgs`` /
``PrefillArgs``, ``sm_scale`` and ``output_scale``, through the compiled-kernel recorder of ``_kernel_stubs``, or
the cuDNN graph key's ``sm_scale``).
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from cutedsl_attn.api import trtllm
from cutedsl_attn.api.trtllm import trtllm_batch_context_with_kv_cache, trtllm_batch_decode_with_kv_cache, xqa


BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
P_ = inspect.Parameter
_REQ = P_.empty

# FlashInfer 0.7.2's signatures (name, default; _REQ: required); the keyword-only names after "*"
DECODE_SIG = [
    ("query", _REQ), ("kv_cache", _REQ), ("workspace_buffer", _REQ), ("block_tables", _REQ), ("seq_lens", _REQ),
    ("max_seq_len", _REQ), ("bmm1_scale", 1.0), ("bmm2_scale", 1.0), ("window_left", -1), ("out", None),
    ("out_dtype", None), ("o_sf_scale", None), ("o_sf_vec_size", None), ("sinks", None), ("kv_layout", "HND"),
    ("enable_pdl", None), ("backend", "auto"), ("q_len_per_req", 1), ("o_scale", 1.0), ("mask", None),
    ("max_q_len", None), ("cum_seq_lens_q", None), ("skip_softmax_threshold_scale_factor", None),
    ("kv_cache_sf", None), ("uses_shared_paged_kv_idx", True), ("lse", None), ("return_lse", False),
    ("bmm1_scale_log2", None), ("multi_ctas_kv_counter_buffer", None), ("enable_block_sparse_attention", False),
    ("cp_world", 1), ("cp_rank", 0), ("causal_seqlens_kv_global", None), ("bf16q_fp8kv_transform_mode", None),
    ("request_order", None), ("request_order_plan", None),
]
XQA_SIG = [
    ("q", _REQ), ("k_cache", _REQ), ("v_cache", _REQ), ("page_table", _REQ), ("seq_lens", _REQ), ("output", _REQ),
    ("workspace_buffer", _REQ), ("semaphores", _REQ), ("num_kv_heads", _REQ), ("page_size", _REQ), ("sinks", None),
    ("q_scale", 1.0), ("kv_scale", 1.0), ("sliding_win_size", 0), ("kv_layout", "NHD"), ("sm_count", None),
    ("enable_pdl", None), ("rcp_out_scale", 1.0), ("q_seq_len", 1), ("mask", None),
    "*", ("q_cu_seq_lens", None), ("k_sf_cache", None), ("v_sf_cache", None),
]
CONTEXT_SIG = [
    ("query", _REQ), ("kv_cache", _REQ), ("workspace_buffer", _REQ), ("block_tables", _REQ), ("seq_lens", _REQ),
    ("max_q_len", _REQ), ("max_kv_len", _REQ), ("bmm1_scale", _REQ), ("bmm2_scale", _REQ), ("batch_size", _REQ),
    ("cum_seq_lens_q", _REQ), ("cum_seq_lens_kv", _REQ), ("window_left", -1), ("out", None), ("out_dtype", None),
    ("o_sf_scale", None), ("o_sf_vec_size", None), ("kv_layout", "HND"), ("enable_pdl", None), ("sinks", None),
    ("kv_cache_sf", None), ("skip_softmax_threshold_scale_factor", None), ("uses_shared_paged_kv_idx", True),
    ("causal", True), ("lse", None), ("return_lse", False), ("multi_ctas_kv_counter_buffer", None),
    ("use_fp16_softmax", None), ("uses_spcompress", None), ("backend", "trtllm-gen"),
]


@pytest.mark.parametrize("fn,expected", [(trtllm_batch_decode_with_kv_cache, DECODE_SIG), (xqa, XQA_SIG),
                                         (trtllm_batch_context_with_kv_cache, CONTEXT_SIG)],
                         ids=["trtllm_decode", "xqa", "trtllm_context"])
def test_signature_matches_flashinfer(fn, expected):
    params = list(inspect.signature(fn).parameters.values())
    kind = P_.POSITIONAL_OR_KEYWORD
    want = []
    for e in expected:
        if e == "*":
            kind = P_.KEYWORD_ONLY
            continue
        want.append((e[0], kind, e[1]))
    got = [(p.name, p.kind, p.default) for p in params]
    assert got == want


def test_public_names():
    assert set(trtllm.__all__) == {"trtllm_batch_decode_with_kv_cache", "trtllm_batch_context_with_kv_cache", "xqa"}


# ----------------------------------------------------------------------------- fixtures
pytestmark = pytest.mark.usefixtures("cross_compile_sm90")  # tests/conftest.py


B, HQ, HKV, D, PS, PAGES = 3, 8, 2, 64, 16, 20
LENS = [37, 1, 50]


def ws():
    return torch.zeros(8 << 20, dtype=torch.uint8)


def table():
    return torch.randperm(PAGES)[:12].to(torch.int32).reshape(B, 4)


def dec_case(layout="HND", dtype=BF16, q_len=1, lens=None, combined=True):
    lens = torch.tensor(lens or [max(L, q_len) for L in LENS], dtype=torch.int32)
    shape = (PAGES, 2, HKV, PS, D) if layout == "HND" else (PAGES, 2, PS, HKV, D)
    cache = torch.randn(shape).to(dtype)
    if not combined:
        cache = (cache[:, 0], cache[:, 1])
    q = torch.randn(B * q_len, HQ, D).to(dtype)
    return dict(query=q, kv_cache=cache, workspace_buffer=ws(), block_tables=table(), seq_lens=lens,
                max_seq_len=64, kv_layout=layout)


def decode(layout="HND", dtype=BF16, q_len=1, lens=None, combined=True, **kw):
    args = dec_case(layout, dtype, q_len, lens, combined)
    args.update(kw)
    args.setdefault("q_len_per_req", q_len)
    return trtllm_batch_decode_with_kv_cache(**args)


def xqa_case(layout="NHD", kv_dtype=BF16, q_seq_len=1):
    shape = (PAGES, PS, HKV, D) if layout == "NHD" else (PAGES, HKV, PS, D)
    k, v = (torch.randn(shape).to(kv_dtype) for _ in range(2))
    qshape = (B, 1, HQ, D) if q_seq_len == 1 else (B, 1, q_seq_len, HQ, D)
    q = torch.randn(qshape).to(BF16)
    lens = torch.tensor([max(L, q_seq_len) for L in LENS], dtype=torch.int32).to(torch.uint32).reshape(B, 1)
    return dict(q=q, k_cache=k, v_cache=v, page_table=table(), seq_lens=lens, output=torch.empty_like(q),
                workspace_buffer=ws(), semaphores=torch.zeros(16, dtype=torch.uint32), num_kv_heads=HKV,
                page_size=PS, kv_layout=layout, q_seq_len=q_seq_len)


def causal_mask_u16(q_len):
    """xqa's packed draft mask of a lower-triangular (causal) draft block: ``[B, q_len, ceil(q_len/32)*2]``."""
    words = -(-q_len // 32)
    m = torch.zeros(B, q_len, words * 2, dtype=torch.int64)
    for i in range(q_len):
        for j in range(i + 1):
            m[:, i, 2 * (j // 32) + (j % 32) // 16] |= 1 << (j % 16)
    return m.to(torch.int32).to(torch.uint16)


CTX_Q_LENS, CTX_KV_LENS = [5, 1, 10], [20, 1, 50]


def ctx_case(layout="HND"):
    shape = (PAGES, 2, HKV, PS, D) if layout == "HND" else (PAGES, 2, PS, HKV, D)
    cq = torch.tensor([0] + torch.tensor(CTX_Q_LENS).cumsum(0).tolist(), dtype=torch.int32)
    ckv = torch.tensor([0] + torch.tensor(CTX_KV_LENS).cumsum(0).tolist(), dtype=torch.int32)
    return dict(query=torch.randn(int(cq[-1]), HQ, D).to(BF16), kv_cache=torch.randn(shape).to(BF16),
                workspace_buffer=ws(), block_tables=table(), seq_lens=torch.tensor(CTX_KV_LENS, dtype=torch.int32),
                max_q_len=10, max_kv_len=50, bmm1_scale=0.125, bmm2_scale=1.0, batch_size=B, cum_seq_lens_q=cq,
                cum_seq_lens_kv=ckv, kv_layout=layout)


# ----------------------------------------------------------------------------- the scale table
# the scale table of every decode entry point, row by row: (entry point, its scale arguments, the kernel's sm_scale,
# its output_scale).  What the launch receives is read off the recorded DecodeArgs / PrefillArgs (the CuTe DSL
# kernels) or off the cuDNN graph key (``attn_scale``; cuDNN's graph has no output scale: 1).
WRAPPER_SCALES = dict(sm_scale=0.2, q_scale=2.0, k_scale=3.0, v_scale=1.5)
SCALE_TABLE = [
    ("trtllm_decode", dict(bmm1_scale=0.05, bmm2_scale=1.5), 0.05, 1.5),
    ("trtllm_decode_multirow", dict(bmm1_scale=0.05, bmm2_scale=1.5), 0.05, 1.5),
    ("trtllm_context", dict(bmm1_scale=0.05, bmm2_scale=1.5), 0.05, 1.5),
    ("xqa_16bit", dict(q_scale=2.0, kv_scale=3.0), 2.0 / math.sqrt(D), 1.0),
    ("xqa_fp8", dict(q_scale=2.0, kv_scale=3.0), 6.0 / math.sqrt(D), 3.0),
    # plan(sm_scale), run(q_scale, k_scale, v_scale): sm_scale * q_scale * k_scale, v_scale
    ("wrapper_run", WRAPPER_SCALES, 1.2, 1.5),
    ("wrapper_run_fp8", WRAPPER_SCALES, 1.2, 1.5),
    ("wrapper_run_multirow", WRAPPER_SCALES, 1.2, 1.5),
    ("wrapper_run_default", {}, 1 / math.sqrt(D), 1.0),
    ("wrapper_cudnn", dict(sm_scale=0.2, q_scale=2.0, k_scale=3.0), 1.2, 1.0),
    ("single_decode", WRAPPER_SCALES, 1.2, 1.5),
    ("single_decode_fp8", WRAPPER_SCALES, 1.2, 1.5),
    ("single_decode_default", {}, 1 / math.sqrt(D), 1.0),
    ("prims_ts", dict(bmm1_scale=0.05, bmm2_scale=1.5), 0.05, 1.5),
    ("prims_ts_multirow", dict(bmm1_scale=0.05, bmm2_scale=1.5), 0.05, 1.5),
    ("prims_ts_default", {}, 1 / math.sqrt(D), 1.0),
    ("prims_ts_wrapper", dict(bmm1_scale=0.05, bmm2_scale=1.5), 0.05, 1.5),
    ("cudnn_decode", dict(scale=0.3), 0.3, 1.0),
]


class GraphRecorder:
    """Stands in for ``cutedsl_attn.cudnn.decode.run_graph``: records each graph key, writes O = 1 (the graph has
    no output scale) and natural-log Stats of 0.5."""

    def __init__(self):
        self.keys = []

    def __call__(self, key, *, out, stats, **_):
        self.keys.append(key)
        out.fill_(1.0)
        if stats is not None:
            stats.fill_(0.5)


@pytest.fixture
def graph_rec(monkeypatch):
    import types

    from cutedsl_attn.api import _decode_cudnn
    from cutedsl_attn.cudnn import decode as cd

    g = GraphRecorder()
    monkeypatch.setattr(cd, "run_graph", g)
    monkeypatch.setattr(cd, "require_cudnn", lambda: types.SimpleNamespace())  # no frontend: the graph is never built
    monkeypatch.setattr(_decode_cudnn, "_on_cuda", lambda t: True)
    return g


def _csr_plan_args(lens, page_size=PS):
    npg = [-(-L // page_size) for L in lens]
    indptr = torch.tensor([0] + torch.tensor(npg).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([L - (n - 1) * page_size for L, n in zip(lens, npg)], dtype=torch.int32)
    return indptr, torch.randperm(PAGES)[:int(indptr[-1])].to(torch.int32), last


def _scale_entry(entry, scales, graph_rec):
    """Run ``entry`` with ``scales``; returns ``(sm_scale, output_scale, out)`` as the launch received them."""
    from cutedsl_attn.api import cudnn_decode
    from cutedsl_attn.api.decode import BatchDecodeWithPagedKVCacheWrapper
    from cutedsl_attn.api.single_decode import single_decode_with_kv_cache
    from cutedsl_attn.attention import prims_ts

    if entry in ("trtllm_decode", "trtllm_decode_multirow"):
        return None, None, decode(q_len=4 if entry.endswith("multirow") else 1, **scales)
    if entry == "trtllm_context":
        return None, None, trtllm_batch_context_with_kv_cache(**{**ctx_case(), **scales})
    if entry.startswith("xqa"):
        c = xqa_case(kv_dtype=FP8 if entry == "xqa_fp8" else BF16)
        xqa(**c, **scales)
        return None, None, c["output"]
    plan_kw = {k: v for k, v in scales.items() if k == "sm_scale"}
    run_kw = {k: v for k, v in scales.items() if k != "sm_scale"}
    if entry.startswith("wrapper"):
        q_len = 4 if entry == "wrapper_run_multirow" else 1
        kv_dt = FP8 if entry == "wrapper_run_fp8" else BF16
        cache = torch.randn(PAGES, 2, PS, HKV, D).to(kv_dt)
        w = BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", use_tensor_cores=True,
                                               backend="cudnn" if entry == "wrapper_cudnn" else "cute")
        w.plan(*_csr_plan_args([max(L, q_len) for L in LENS]), HQ, HKV, D, PS, q_data_type=BF16, kv_data_type=kv_dt,
               q_len_per_req=q_len, **plan_kw)
        out = w.run(torch.randn(B * q_len, HQ, D).to(BF16), cache, **run_kw)
        if entry == "wrapper_cudnn":
            return graph_rec.keys[-1].sm_scale, 1.0, out
        return None, None, out
    if entry.startswith("single_decode"):
        kv_dt = FP8 if entry.endswith("fp8") else BF16
        k, v = (torch.randn(50, HKV, D).to(kv_dt) for _ in range(2))
        return None, None, single_decode_with_kv_cache(torch.randn(HQ, D).to(BF16), k, v, **plan_kw, **run_kw)
    if entry.startswith("prims_ts"):
        cache = torch.randn(PAGES, 2, HKV, PS, D).to(BF16)
        lens = torch.tensor([max(L, 3) for L in LENS], dtype=torch.int32)
        if entry == "prims_ts_wrapper":
            w = prims_ts.BatchDecodePagedTSWrapper()
            w.plan("cpu", B, HQ, HKV, D, PS, 64, q_data_type=BF16)
            return None, None, w.run(torch.randn(B, HQ, D).to(BF16), cache, lens, table(), **scales)
        sq = 3 if entry == "prims_ts_multirow" else 1
        q = torch.randn((B, HQ, D) if sq == 1 else (B, sq, HQ, D)).to(BF16)
        return None, None, prims_ts.batch_decode_with_paged_kv_cache(q, cache, table(), lens, seq_len_q=sq,
                                                                     mask_type="causal", **scales)
    assert entry == "cudnn_decode"
    # the public function's body short of its CUDA-device check: every validation, then the graph's execution
    p = dec_case()
    k, v = p["kv_cache"][:, 0], p["kv_cache"][:, 1]  # HND [pages, Hkv, page_size, D]
    call = cudnn_decode.prepare_call(
        p["query"], k, v, scales["scale"], p["workspace_buffer"], max_sequence_kv=64, actual_seq_lens_kv=p["seq_lens"],
        block_tables=p["block_tables"], is_cuda_graph_compatible=False, batch_offsets_q=None, batch_offsets_o=None,
        batch_offsets_k=None, batch_offsets_v=None, out=None, return_lse=False, lse=None, q_len_per_req=1,
        window_left=-1, sinks=None)
    out = cudnn_decode.execute_call(call)
    return graph_rec.keys[-1].sm_scale, 1.0, out


@pytest.mark.parametrize("entry,scales,sm,out_scale", SCALE_TABLE, ids=[r[0] for r in SCALE_TABLE])
def test_scale_table(rec, graph_rec, entry, scales, sm, out_scale):
    got_sm, got_out, out = _scale_entry(entry, scales, graph_rec)
    if got_sm is None:  # a CuTe DSL kernel: the recorded launch arguments
        cfg, a = rec.last
        got_sm, got_out = a["sm_scale"], a["output_scale"]
        assert cfg.name == ("paged_decode" if entry.split("_")[-1] not in ("multirow", "context") else "prefill_sm90")
    assert got_sm == pytest.approx(sm, rel=1e-6) and got_out == pytest.approx(out_scale, rel=1e-12)
    assert (out.float() == torch.tensor(out_scale).to(out.dtype).float()).all()  # written once, in the kernel


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("q_len", [1, 4])
def test_trtllm_decode_scales(rec, layout, q_len):
    # sm_scale = bmm1_scale (no 1/sqrt(D)), output_scale = bmm2_scale; written by the kernel, never by out.mul_
    out = decode(layout=layout, q_len=q_len, bmm1_scale=0.3, bmm2_scale=2.5)
    cfg, args = rec.last
    assert cfg.name == ("paged_decode" if q_len == 1 else "prefill_sm90")
    assert args["sm_scale"] == pytest.approx(0.3) and args["output_scale"] == pytest.approx(2.5)
    assert (out == 2.5).all()  # the stub writes output_scale: nothing rescales the rounded output afterwards
    if q_len > 1:
        assert cfg.causal
        live = args["work"][args["work"][:, 0] >= 0]
        assert (live[:, 2] == q_len).all()  # qo_len column


def test_trtllm_decode_default_scale_has_no_rsqrt_d(rec):
    decode()
    assert rec.last[1]["sm_scale"] == 1.0 and rec.last[1]["output_scale"] == 1.0


def test_trtllm_decode_tensor_scales_read_on_host(rec):
    decode(bmm1_scale=torch.tensor([0.25]), bmm2_scale=torch.tensor(0.5))
    assert rec.last[1]["sm_scale"] == 0.25 and rec.last[1]["output_scale"] == 0.5


def test_trtllm_decode_fp8_kv(rec):
    args = dec_case()
    args["kv_cache"] = args["kv_cache"].to(FP8)
    trtllm_batch_decode_with_kv_cache(**args, bmm1_scale=0.1 * 0.7, bmm2_scale=1.3)
    cfg, a = rec.last
    assert cfg.kv_dtype == "float8_e4m3fn" and a["k"].dtype == FP8
    assert a["sm_scale"] == pytest.approx(0.07) and a["output_scale"] == pytest.approx(1.3)


@pytest.mark.parametrize("fp8", [False, True])
def test_xqa_scales(rec, fp8):
    c = xqa_case(kv_dtype=FP8 if fp8 else BF16)
    assert xqa(**c, q_scale=2.0, kv_scale=3.0) is None
    cfg, a = rec.last
    kv = 3.0 if fp8 else 1.0
    assert a["sm_scale"] == pytest.approx(2.0 * kv / math.sqrt(D))
    assert a["output_scale"] == pytest.approx(kv)
    assert (c["output"] == kv).all()  # in place


def test_xqa_rcp_out_scale_ignored_for_16bit_output(rec):
    xqa(**xqa_case(), rcp_out_scale=0.5)
    assert rec.last[1]["output_scale"] == 1.0


def test_context_scales(rec):
    out, lse = trtllm_batch_context_with_kv_cache(**{**ctx_case(), "bmm1_scale": 0.2, "bmm2_scale": 3.0},
                                                 return_lse=True)
    cfg, a = rec.last
    assert cfg.name == "prefill_sm90" and cfg.causal
    assert a["sm_scale"] == pytest.approx(0.2) and a["output_scale"] == pytest.approx(3.0)
    assert out.shape == (sum(CTX_Q_LENS), HQ, D) and lse.shape == (sum(CTX_Q_LENS), HQ)


# ----------------------------------------------------------------------------- what reaches the kernel
def test_trtllm_decode_window_sinks_lse(rec):
    sinks = torch.randn(HQ)
    out, lse = decode(window_left=9, sinks=sinks, return_lse=True)
    cfg, a = rec.last
    assert cfg.use_sinks and torch.equal(a["sinks"], sinks)
    assert out.shape == (B, HQ, D) and lse.shape == (B, HQ) and (lse == 0.5).all()
    starts = {int(r[0]): int(r[1]) for r in a["work"] if r[0] >= 0 and r[7] == 0}
    assert starts[2] == 50 - 1 - 9  # window_left=9 keeps 10 keys


def test_trtllm_decode_lse_buffer_written_without_return(rec):
    lse = torch.full((B, HQ), float("nan"))
    out = decode(lse=lse)
    assert isinstance(out, torch.Tensor) and (lse == 0.5).all()


@pytest.mark.parametrize("combined", [True, False])
def test_trtllm_decode_cache_forms(rec, combined):
    decode(layout="NHD", combined=combined)
    a = rec.last[1]
    assert a["k"].shape[1:] == (PS, HKV, D)  # NHD-ordered view reaches the kernel


def test_trtllm_decode_shared_kv_storage(rec):
    args = dec_case()
    args["kv_cache"] = args["kv_cache"][:, :1]
    trtllm_batch_decode_with_kv_cache(**args)
    a = rec.last[1]
    assert a["k"].data_ptr() == a["v"].data_ptr()


def test_trtllm_decode_ragged_q(rec):
    args = dec_case(q_len=1)
    cq = torch.tensor([0, 2, 3, 7], dtype=torch.int32)
    args["query"] = torch.randn(7, HQ, D).to(BF16)
    out = trtllm_batch_decode_with_kv_cache(**args, q_len_per_req=None, cum_seq_lens_q=cq, max_q_len=4)
    cfg, a = rec.last
    assert cfg.name == "prefill_sm90" and out.shape == (7, HQ, D)


def test_spec_mask_unpacking():
    m = causal_mask_u16(4)
    kv_lens = torch.tensor([6, 4, 9], dtype=torch.int32)
    flat = trtllm._unpack_spec_mask(m, B, 4, kv_lens)
    off = 0
    for L in kv_lens.tolist():
        seg = flat[off: off + 4 * L].reshape(4, L)
        off += 4 * L
        expect = torch.ones(4, L, dtype=torch.bool)
        expect[:, L - 4:] = torch.tril(torch.ones(4, 4, dtype=torch.bool))
        assert torch.equal(seg, expect)
    assert off == flat.numel()


def test_spec_mask_second_word():
    # q_len 40: draft column 35 lives in the second 32-bit word (uint16 index 2)
    m = torch.zeros(B, 40, 4, dtype=torch.int32)
    m[:, :, 2] = 1 << 3
    flat = trtllm._unpack_spec_mask(m.to(torch.uint16), B, 40, torch.tensor([40, 40, 40]))
    seg = flat[: 40 * 40].reshape(40, 40)
    assert seg[:, 35].all() and seg.sum() == 40


def test_xqa_spec_decode_uses_custom_mask(rec):
    c = xqa_case(q_seq_len=4)
    xqa(**c, mask=causal_mask_u16(4))
    cfg, a = rec.last
    assert cfg.name == "prefill_sm90" and cfg.use_custom_mask and not cfg.causal
    assert c["output"].shape == (B, 1, 4, HQ, D) and (c["output"] == 1.0).all()


def test_xqa_sinks_layout_and_window(rec):
    sinks = torch.randn(HKV, HQ // HKV)
    xqa(**xqa_case(layout="HND"), sinks=sinks, sliding_win_size=10)
    a = rec.last[1]
    assert torch.equal(a["sinks"], sinks.reshape(HQ))  # query head h = kv head * group + g
    starts = {int(r[0]): int(r[1]) for r in a["work"] if r[0] >= 0 and r[7] == 0}
    assert starts[2] == 50 - 10  # sliding_win_size counts the current key


def test_xqa_strided_output_written(rec):
    c = xqa_case()
    big = torch.full((B, 1, HQ, 2 * D), float("nan"), dtype=BF16)
    c["output"] = big[..., :D]
    xqa(**c)
    assert (big[..., :D] == 1.0).all() and big[..., D:].isnan().all()


def test_context_window_and_sinks(rec):
    sinks = torch.randn(HQ)
    trtllm_batch_context_with_kv_cache(**ctx_case(layout="NHD"), window_left=3, sinks=sinks)
    cfg, a = rec.last
    assert cfg.use_window and cfg.use_sinks and a["window_left"] == 3


def test_context_non_causal(rec):
    trtllm_batch_context_with_kv_cache(**ctx_case(), causal=False)
    assert not rec.last[0].causal


# ----------------------------------------------------------------------------- validation (nothing launched)
DECODE_ERRORS = [
    (dict(backend="fa2"), KeyError, "Backend"),
    (dict(kv_layout="hnd"), KeyError, "kv_layout"),
    (dict(out_dtype="nvfp4"), NotImplementedError, "nvfp4"),
    (dict(o_sf_scale=1.0), NotImplementedError, "o_sf_scale"),
    (dict(o_sf_vec_size=16), NotImplementedError, "o_sf_vec_size"),
    (dict(kv_cache_sf=(1, 2)), NotImplementedError, "kv_cache_sf"),
    (dict(enable_pdl=True), NotImplementedError, "PDL"),
    (dict(skip_softmax_threshold_scale_factor=0.1), NotImplementedError, "skip-softmax"),
    (dict(uses_shared_paged_kv_idx=False), NotImplementedError, "uses_shared_paged_kv_idx"),
    (dict(bmm1_scale_log2=1.0), NotImplementedError, "bmm1_scale_log2"),
    (dict(enable_block_sparse_attention=True), NotImplementedError, "block-sparse"),
    (dict(cp_world=2), NotImplementedError, "context-parallel"),
    (dict(causal_seqlens_kv_global=torch.zeros(3)), NotImplementedError, "context-parallel"),
    (dict(bf16q_fp8kv_transform_mode="x"), NotImplementedError, "bf16q_fp8kv_transform_mode"),
    (dict(request_order=torch.zeros(3)), NotImplementedError, "request_order"),
    (dict(request_order_plan=object()), NotImplementedError, "request_order_plan"),
    (dict(cp_rank=1), ValueError, "cp_rank"),
    (dict(o_scale=0.5), NotImplementedError, "o_scale"),
    (dict(bmm1_scale=0.0), ValueError, "bmm1_scale"),
    (dict(bmm1_scale=float("nan")), ValueError, "bmm1_scale"),
    (dict(bmm1_scale="1"), TypeError, "bmm1_scale"),
    (dict(bmm2_scale=float("inf")), ValueError, "bmm2_scale"),
    (dict(bmm2_scale=torch.ones(2)), ValueError, "bmm2_scale"),
    (dict(max_seq_len=10), ValueError, "max_seq_len"),
    (dict(max_seq_len=1.5), TypeError, "max_seq_len"),
    (dict(q_len_per_req=0), ValueError, "q_len_per_req"),
    (dict(q_len_per_req=2), ValueError, "q_len_per_req"),
    (dict(out_dtype=torch.float16), NotImplementedError, "output dtype"),
    (dict(out=torch.empty(B, HQ, D, dtype=torch.float16)), NotImplementedError, "output dtype"),
    (dict(sinks=torch.zeros(HQ, dtype=torch.float64)), ValueError, "sinks"),
    (dict(sinks=torch.zeros(HQ + 1)), ValueError, "sinks"),
    (dict(window_left=-2), ValueError, "window_left"),
    (dict(seq_lens=torch.tensor([1.0, 2.0, 3.0])), ValueError, "seq_lens"),
    (dict(seq_lens=torch.tensor([1, 2], dtype=torch.int32)), ValueError, "seq_lens"),
    (dict(seq_lens=torch.tensor([-1, 2, 3], dtype=torch.int32)), ValueError, "seq_lens"),
    (dict(block_tables=torch.zeros(B, 4)), ValueError, "block_tables"),
    (dict(block_tables=torch.zeros(B, 1, dtype=torch.int32)), ValueError, "block_tables"),
    (dict(block_tables=torch.zeros(B * 4, dtype=torch.int32)), ValueError, "block_tables"),
    (dict(query=torch.zeros(B, HQ, D, dtype=torch.float32)), NotImplementedError, "query"),
    (dict(query=torch.zeros(B, HQ, 32, dtype=BF16)), ValueError, "head_dim"),
    (dict(query=torch.zeros(B, 3, D, dtype=BF16)), ValueError, "multiple"),
    (dict(query=[1, 2]), TypeError, "query"),
    (dict(kv_cache=torch.zeros(PAGES, 3, HKV, PS, D, dtype=BF16)), ValueError, "kv_cache"),
    (dict(kv_cache=torch.zeros(PAGES, HKV, PS, D, dtype=BF16)), ValueError, "kv_cache"),
    (dict(kv_cache=(torch.zeros(PAGES, HKV, PS, D, dtype=BF16),)), ValueError, "kv_cache"),
    (dict(kv_cache=(torch.zeros(PAGES, HKV, PS, D, dtype=BF16), torch.zeros(PAGES, HKV, PS, D))), ValueError,
     "dtype"),
    (dict(kv_cache=torch.zeros(PAGES, 2, HKV, PS, D, dtype=torch.float16)), ValueError, "dtype"),
    (dict(kv_cache=torch.zeros(PAGES, 2, HKV, PS, D, dtype=torch.uint8)), NotImplementedError, "NVFP4"),
    (dict(workspace_buffer=None), TypeError, "workspace_buffer"),
    (dict(mask=torch.zeros(1)), None, None),  # ignored with one row per request
]


@pytest.mark.parametrize("kw,exc,match", DECODE_ERRORS, ids=[f"{i}" for i in range(len(DECODE_ERRORS))])
def test_trtllm_decode_errors(rec, kw, exc, match):
    args = dec_case()
    args.update(kw)
    if exc is None:
        trtllm_batch_decode_with_kv_cache(**args)
        assert len(rec.calls) == 1
        return
    with pytest.raises(exc, match=match):
        trtllm_batch_decode_with_kv_cache(**args)
    assert rec.calls == []


def test_trtllm_decode_multirow_errors(rec):
    args = dec_case(q_len=4, lens=[37, 3, 50])
    with pytest.raises(ValueError, match="request 1 has 3 keys"):
        trtllm_batch_decode_with_kv_cache(**args, q_len_per_req=4)
    args = dec_case(q_len=1)
    with pytest.raises(ValueError, match="cum_seq_lens_q and max_q_len"):
        trtllm_batch_decode_with_kv_cache(**args, cum_seq_lens_q=torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="cum_seq_lens_q"):
        trtllm_batch_decode_with_kv_cache(**args, q_len_per_req=None, max_q_len=1,
                                          cum_seq_lens_q=torch.tensor([0, 1, 2, 4]))
    with pytest.raises(ValueError, match="max_q_len"):
        trtllm_batch_decode_with_kv_cache(**args, q_len_per_req=None, max_q_len=1,
                                          cum_seq_lens_q=torch.tensor([0, 0, 1, 3]))
    assert rec.calls == []


def test_trtllm_decode_empty_request_allowed(rec):
    decode(lens=[0, 5, 9])
    assert len(rec.calls) == 1


XQA_ERRORS = [
    (dict(kv_layout="nhd"), KeyError, "kv_layout"),
    (dict(q_cu_seq_lens=torch.zeros(4)), NotImplementedError, "q_cu_seq_lens"),
    (dict(k_sf_cache=torch.zeros(1)), NotImplementedError, "NVFP4"),
    (dict(enable_pdl=True), NotImplementedError, "PDL"),
    (dict(page_size=8), ValueError, "page_size"),
    (dict(page_size=32), ValueError, "page_size"),
    (dict(num_kv_heads=4), ValueError, "num_kv_heads"),
    (dict(num_kv_heads=0), ValueError, "num_kv_heads"),
    (dict(q_scale=0.0), ValueError, "q_scale"),
    (dict(kv_scale="2"), TypeError, "kv_scale"),
    (dict(rcp_out_scale=float("nan")), ValueError, "rcp_out_scale"),
    (dict(sliding_win_size=-1), ValueError, "sliding_win_size"),
    (dict(sm_count=0), ValueError, "sm_count"),
    (dict(semaphores=None), TypeError, "semaphores"),
    (dict(sinks=torch.zeros(HQ)), ValueError, "sinks"),
    (dict(sinks=torch.zeros(HKV, HQ // HKV, dtype=torch.float16)), ValueError, "sinks"),
    (dict(seq_lens=torch.zeros(B, 2, dtype=torch.int32)), ValueError, "seq_lens"),
    (dict(page_table=torch.zeros(B + 1, 4, dtype=torch.int32)), ValueError, "page_table"),
    (dict(output=torch.empty(B, 1, HQ, D, dtype=torch.float16)), ValueError, "output"),
    (dict(output=torch.empty(B, 1, HQ, D, dtype=FP8)), NotImplementedError, "fp8 output"),
    (dict(output=torch.empty(B, 1, HQ + 1, D, dtype=BF16)), ValueError, "output"),
    (dict(q=torch.zeros(B, 2, HQ, D, dtype=BF16), output=torch.zeros(B, 2, HQ, D, dtype=BF16)),
     NotImplementedError, "beam width"),
    (dict(q=torch.zeros(B, 1, HQ, D, dtype=torch.float32)), NotImplementedError, "q dtype"),
    (dict(v_cache=torch.zeros(PAGES, PS, HKV, D, dtype=torch.float16)), ValueError, "dtype"),
    (dict(q_seq_len=2), ValueError, "q"),
]


@pytest.mark.parametrize("kw,exc,match", XQA_ERRORS, ids=[f"{i}" for i in range(len(XQA_ERRORS))])
def test_xqa_errors(rec, kw, exc, match):
    c = xqa_case()
    c.update(kw)
    with pytest.raises(exc, match=match):
        xqa(**c)
    assert rec.calls == []


def test_xqa_spec_decode_errors(rec):
    c = xqa_case(q_seq_len=4)
    with pytest.raises(ValueError, match="mask is required"):
        xqa(**c)
    with pytest.raises(ValueError, match="mask"):
        xqa(**c, mask=causal_mask_u16(4)[:, :3])
    with pytest.raises(ValueError, match="uint16"):
        xqa(**c, mask=torch.zeros(B, 4, 2, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="sliding_win_size"):
        xqa(**c, mask=causal_mask_u16(4), sliding_win_size=8)
    c["seq_lens"] = torch.tensor([[3], [9], [9]], dtype=torch.int32)
    with pytest.raises(ValueError, match="q_seq_len"):
        xqa(**c, mask=causal_mask_u16(4))
    assert rec.calls == []


CONTEXT_ERRORS = [
    (dict(backend="auto"), ValueError, "backend"),
    (dict(kv_layout="x"), KeyError, "kv_layout"),
    (dict(causal=False, window_left=4), NotImplementedError, "causal=False"),
    (dict(causal=1), TypeError, "causal"),
    (dict(out_dtype="nvfp4"), NotImplementedError, "nvfp4"),
    (dict(o_sf_scale=1.0), NotImplementedError, "o_sf_scale"),
    (dict(kv_cache_sf=(1, 2)), NotImplementedError, "kv_cache_sf"),
    (dict(enable_pdl=True), NotImplementedError, "PDL"),
    (dict(skip_softmax_threshold_scale_factor=1.0), NotImplementedError, "skip-softmax"),
    (dict(uses_shared_paged_kv_idx=False), NotImplementedError, "uses_shared_paged_kv_idx"),
    (dict(use_fp16_softmax=True), NotImplementedError, "use_fp16_softmax"),
    (dict(uses_spcompress=True), NotImplementedError, "uses_spcompress"),
    (dict(bmm1_scale=-1.0), ValueError, "bmm1_scale"),
    (dict(batch_size=2), ValueError, "batch_size"),
    (dict(cum_seq_lens_q=torch.tensor([0, 5, 6, 15], dtype=torch.int32)), ValueError, "cum_seq_lens_q"),
    (dict(cum_seq_lens_q=torch.tensor([1, 5, 6, 16], dtype=torch.int32)), ValueError, "cum_seq_lens_q"),
    (dict(cum_seq_lens_kv=torch.tensor([0, 20, 21, 70], dtype=torch.int32)), ValueError, "cum_seq_lens_kv"),
    (dict(max_q_len=5), ValueError, "max_q_len"),
    (dict(max_kv_len=49), ValueError, "max_kv_len"),
    (dict(out=torch.empty(16, HQ, D, dtype=torch.float16)), NotImplementedError, "output dtype"),
    (dict(sinks=torch.zeros(3)), ValueError, "sinks"),
]


@pytest.mark.parametrize("kw,exc,match", CONTEXT_ERRORS, ids=[f"{i}" for i in range(len(CONTEXT_ERRORS))])
def test_context_errors(rec, kw, exc, match):
    c = ctx_case()
    c.update(kw)
    with pytest.raises(exc, match=match):
        trtllm_batch_context_with_kv_cache(**c)
    assert rec.calls == []


def test_context_fp8_kv_not_served(rec):
    c = ctx_case()
    c["kv_cache"] = c["kv_cache"].to(FP8)
    with pytest.raises(NotImplementedError, match="float8_e4m3fn.*trtllm_batch_context_with_kv_cache"):
        trtllm_batch_context_with_kv_cache(**c)
    assert rec.calls == []


@pytest.mark.parametrize("entry", ["decode", "xqa", "context"])
def test_capture_refused(rec, monkeypatch, entry):
    # the host planning (seq_lens read on the host) cannot run inside a CUDA stream capture
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="capture"):
        if entry == "decode":
            decode()
        elif entry == "xqa":
            xqa(**xqa_case())
        else:
            trtllm_batch_context_with_kv_cache(**ctx_case())
    assert rec.calls == []


# ----------------------------------------------------------------------------- bool arguments are bools
@pytest.mark.parametrize("kw", [dict(return_lse="no"), dict(enable_pdl="False"), dict(uses_shared_paged_kv_idx=1),
                                dict(enable_block_sparse_attention=0)])
def test_trtllm_decode_bool_options_must_be_bool(rec, kw):
    with pytest.raises(TypeError, match=f"{next(iter(kw))} must be a bool"):
        decode(**kw)
    assert rec.calls == []


@pytest.mark.parametrize("kw", [dict(causal="False"), dict(return_lse=0), dict(enable_pdl="no"),
                                dict(uses_shared_paged_kv_idx="yes"), dict(use_fp16_softmax=0),
                                dict(uses_spcompress="False")])
def test_context_bool_options_must_be_bool(rec, kw):
    with pytest.raises(TypeError, match=f"{next(iter(kw))} must be a bool"):
        trtllm_batch_context_with_kv_cache(**ctx_case(), **kw)
    assert rec.calls == []


def test_xqa_enable_pdl_must_be_bool(rec):
    with pytest.raises(TypeError, match="enable_pdl must be a bool"):
        xqa(**xqa_case(), enable_pdl="False")
    assert rec.calls == []


# ----------------------------------------------------------------------------- multi_ctas_kv_counter_buffer, mask
@pytest.mark.parametrize("entry", ["decode", "context"])
def test_counter_buffer_type_checked_and_unused(rec, entry):
    run = (lambda **kw: decode(**kw)) if entry == "decode" else (
        lambda **kw: trtllm_batch_context_with_kv_cache(**ctx_case(), **kw))
    with pytest.raises(TypeError, match="multi_ctas_kv_counter_buffer must be a torch.Tensor"):
        run(multi_ctas_kv_counter_buffer="junk")
    with pytest.raises(ValueError, match="multi_ctas_kv_counter_buffer is on meta"):
        run(multi_ctas_kv_counter_buffer=torch.zeros(8, dtype=torch.int32, device="meta"))
    assert rec.calls == []
    buf = torch.full((8,), 7, dtype=torch.int32)
    run(multi_ctas_kv_counter_buffer=buf)
    run()
    (_, _, with_buf), (_, _, without) = rec.calls
    assert torch.equal(buf, torch.full((8,), 7, dtype=torch.int32))  # unused: never written
    assert all(x is not buf for x in with_buf)
    assert torch.equal(with_buf.work, without.work)


def test_trtllm_gen_mask_with_rows_not_served(rec):
    # FlashInfer uses mask on its xqa route only; its trtllm-gen kernel runs the rows causal whatever the mask
    m = causal_mask_u16(4)
    m[:, 3] = 1  # the last draft row sees draft token 0 only: not the causal block
    with pytest.raises(NotImplementedError, match="backend='trtllm-gen'.*ignores mask"):
        decode(q_len=4, mask=m, backend="trtllm-gen")
    assert rec.calls == []
    decode(q_len=4, backend="trtllm-gen")  # no mask: bottom-right causal, as FlashInfer's trtllm-gen
    cfg, _ = rec.last
    assert cfg.causal and not cfg.use_custom_mask
    for backend in ("auto", "xqa"):  # xqa's semantics: the draft mask replaces the causal block
        decode(q_len=4, mask=m, backend=backend)
        cfg, _ = rec.last
        assert cfg.use_custom_mask and not cfg.causal
    decode(mask=m, backend="trtllm-gen")  # one row per request: mask ignored, as FlashInfer
    assert rec.last[0].name == "paged_decode"
