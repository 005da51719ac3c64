"""CPU tests of ``trtllm_batch_decode_with_kv_cache_mla`` / ``xqa_mla``: FlashInfer's signatures, named errors
before any launch, and what reaches the kernel (strided views of the query and the combined cache, the fused
scales in MlaArgs, the plan) with the launch stubbed; the MLA kernel's ``launch`` argument order.  fp8 caches
and ``xqa_mla``'s scales and errors: tests/test_mla_fp8_cpu.py."""

import inspect
import re

import pytest
import torch

from cutedsl_attn.api import mla_trtllm as api
from cutedsl_attn.planning.mla import MlaArgs
from cutedsl_attn.portable import mla_decode as md

E = inspect.Parameter.empty
D = 576
SEED = "/work/shared/seeds/003_4f3e061cc5ac210e.txt"

# FlashInfer 0.7.2's signature (flashinfer.mla / flashinfer.decode)
TRTLLM_MLA_PARAMS = [
    ("query", E), ("kv_cache", E), ("workspace_buffer", E), ("qk_nope_head_dim", E), ("kv_lora_rank", E),
    ("qk_rope_head_dim", E), ("block_tables", E), ("seq_lens", E), ("max_seq_len", E), ("sparse_mla_top_k", 0),
    ("out", None), ("bmm1_scale", 1.0), ("bmm2_scale", 1.0), ("sinks", None),
    ("skip_softmax_threshold_scale_factor", None), ("enable_pdl", None), ("backend", "auto"), ("is_var_seq", True),
    ("uses_shared_paged_kv_idx", True), ("lse", None), ("return_lse", False), ("cute_dsl_impl", "auto"),
    ("kv_scale_format", "auto"), ("cum_seq_lens_q", None), ("max_q_len", None),
    ("multi_ctas_kv_counter_buffer", None), ("sparse_mla_top_k_lens", None), ("enable_dcp", False),
    ("cp_world", 1), ("cp_rank", 0), ("causal_seqlens_kv_global", None), ("use_fp16_softmax", None),
    ("return_lse_base", None)]
XQA_MLA_PARAMS = [
    ("q", E), ("k_cache", E), ("v_cache", E), ("page_table", E), ("seq_lens", E), ("output", E),
    ("workspace_buffer", E), ("semaphores", E), ("page_size", E), ("q_scale", 1.0), ("kv_scale", 1.0),
    ("sm_count", None), ("enable_pdl", None)]


def _params(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_signatures_match_flashinfer_and_seed():
    assert _params(api.trtllm_batch_decode_with_kv_cache_mla) == TRTLLM_MLA_PARAMS
    assert _params(api.xqa_mla) == XQA_MLA_PARAMS
    try:
        seed = open(SEED, encoding="utf-8").read()
    except OSError:
        pytest.skip("seed text not present")
    assert "trtllm_batch_decode_with_kv_cache_mla(query, ...)" in seed
    assert "xqa_mla(q, k_cache, v_cache, page_table, ...)" in seed
    # the seed's xqa_mla parameter list, in its order
    doc = seed[seed.index("xqa_mla(q, k_cache"):]
    doc = doc[: doc.index("flashinfer.prefill")]
    named = re.findall(r":param (\w+):", doc)
    assert named == [n for n, _ in XQA_MLA_PARAMS]


@pytest.fixture
def cross(monkeypatch):
    monkeypatch.setenv("CUTEDSL_ATTN_ARCH", "sm_90a")


def _case(B=3, q_len=1, H=16, PS=32, lens=(40, 0, 64), pages=8, dtype=torch.bfloat16):
    """Inputs on the CPU: block table rows are distinct page ids, unused columns -1."""
    max_pages = 3
    bt = torch.full((B, max_pages), -1, dtype=torch.int32)
    nxt = 0
    for b, L in enumerate(lens):
        for j in range(-(-L // PS)):
            bt[b, j] = nxt
            nxt += 1
    return dict(query=torch.randn(B, q_len, H, D).to(dtype), kv_cache=torch.randn(pages, PS, D).to(dtype),
                workspace_buffer=torch.zeros(1 << 24, dtype=torch.uint8), qk_nope_head_dim=128, kv_lora_rank=512,
                qk_rope_head_dim=64, block_tables=bt, seq_lens=torch.tensor(lens, dtype=torch.int32),
                max_seq_len=max(lens, default=0))


@pytest.fixture
def launched(monkeypatch):
    """Stub the launch: record (module, cfg, args) instead of running the kernel."""
    calls = []
    monkeypatch.setattr(api, "_launch", lambda module, cfg, args: calls.append((module, cfg, args)))
    return calls


def test_scales_views_and_plan_reach_mla_args(cross, launched):
    a = _case(q_len=2)
    out, lse = api.trtllm_batch_decode_with_kv_cache_mla(**a, bmm1_scale=0.125, bmm2_scale=0.5, return_lse=True)
    (module, cfg, args), = launched
    assert isinstance(args, MlaArgs) and module is md
    assert args.sm_scale == 0.125 and args.output_scale == 0.5  # bmm1 as the logit multiplier, bmm2 on O
    assert cfg.problem.causal and cfg.problem.page_size == 32 and cfg.problem.dtype == "bfloat16"
    q, kv = a["query"], a["kv_cache"]
    # no copies: q_nope / q_pe / ckv / kpe are views of the caller's storage
    assert args.q_nope.data_ptr() == q.data_ptr() and args.q_pe.data_ptr() == q.data_ptr() + 512 * 2
    assert args.q_nope.shape == (6, 16, 512) and args.q_pe.shape == (6, 16, 64)
    assert args.q_nope.stride() == (16 * D, D, 1)
    assert args.ckv.data_ptr() == kv.data_ptr() and args.kpe.data_ptr() == kv.data_ptr() + 512 * 2
    assert args.ckv.shape == (8, 32, 512) and args.kpe.shape == (8, 32, 64) and args.ckv.stride() == (32 * D, D, 1)
    assert args.out.data_ptr() == out.data_ptr() and out.shape == (3, 2, 16, 512)
    assert args.lse.data_ptr() == lse.data_ptr() and lse.shape == (6, 16)
    assert args.indices.shape == (9,) and args.num_row_tiles == 2  # 2 tokens x 16 heads
    assert int(args.counters.abs().sum()) == 0
    # the work table covers every request's [0, seq_len) with its q rows
    w = args.work[(args.work[:, 0] >= 0)]
    for b, L in enumerate((40, 0, 64)):
        mine = w[w[:, 0] == b]
        assert int(mine[:, 2].max()) == L and (mine[:, -1] == 2).all() and (mine[:, -2] == 2 * b).all()


@pytest.mark.parametrize("backend", ["trtllm-gen", "xqa", "cute"])
def test_flashinfer_backend_names_run_our_kernel(cross, launched, backend):
    """FlashInfer's trtllm-gen / xqa names run the same plan and kernel as ``auto`` (as the trtllm decode entry)."""
    a = _case()
    api.trtllm_batch_decode_with_kv_cache_mla(**a, backend=backend)
    api.trtllm_batch_decode_with_kv_cache_mla(**a)
    (m1, c1, a1), (m2, c2, a2) = launched
    assert m1 is m2 and c1 == c2 and torch.equal(a1.work, a2.work)


def test_decode_defaults_and_4d_cache(cross, launched):
    a = _case(q_len=1, PS=64, lens=(64, 100, 1))
    a["kv_cache"] = a["kv_cache"].view(8, 1, 64, D)
    bt = torch.tensor([[3, -1, -1], [0, 5, -1], [7, -1, -1]], dtype=torch.int32)
    out = api.trtllm_batch_decode_with_kv_cache_mla(**dict(a, block_tables=bt))
    (_, cfg, args), = launched
    assert args.sm_scale == 1.0 and args.output_scale == 1.0 and not cfg.problem.causal
    assert out.shape == (3, 1, 16, 512) and args.ckv.shape == (8, 64, 512)
    assert args.indices.tolist()[:2] == [3, -1]  # flat row-major table; rows start at b * max_pages


def test_tensor_scales_and_lse_base(cross, launched):
    a = _case()
    lse = torch.full((3, 1, 16), 2.0)
    api.trtllm_batch_decode_with_kv_cache_mla(**a, bmm1_scale=torch.tensor([0.25]), bmm2_scale=torch.tensor(2.0),
                                              lse=lse, return_lse_base="basee")
    (_, _, args), = launched
    assert args.sm_scale == 0.25 and args.output_scale == 2.0
    assert torch.allclose(lse, torch.full_like(lse, 2.0 * 0.6931471805599453))  # stub wrote nothing; scaled to ln


def test_counter_buffer(cross, launched):
    a = _case()
    buf = torch.zeros(64, dtype=torch.uint8)
    api.trtllm_batch_decode_with_kv_cache_mla(**a, multi_ctas_kv_counter_buffer=buf)
    (_, _, args), = launched
    assert args.counters.data_ptr() == buf.data_ptr() and args.counters.dtype == torch.int32
    with pytest.raises(ValueError, match="multi_ctas_kv_counter_buffer"):
        api.trtllm_batch_decode_with_kv_cache_mla(**a, multi_ctas_kv_counter_buffer=torch.zeros(2, dtype=torch.uint8))


def _bad(**change):
    a = _case()
    a.update(change)
    return a


@pytest.mark.parametrize("change,exc,match", [
    (dict(kv_lora_rank=256), NotImplementedError, "kv_lora_rank=512 with qk_rope_head_dim=64"),
    (dict(qk_rope_head_dim=32), NotImplementedError, "kv_lora_rank=512 with qk_rope_head_dim=64"),
    (dict(qk_nope_head_dim=0), ValueError, "qk_nope_head_dim"),
    (dict(query=torch.randn(3, 1, 16, 512).bfloat16()), ValueError, "576"),
    (dict(query=torch.randn(3, 16, D).bfloat16()), ValueError, "query must be 4-D"),
    (dict(query=torch.randn(2, 1, 16, D).bfloat16()), ValueError, "query.shape\\[0\\]"),
    (dict(query=torch.randn(3, 1, 16, D).half()), NotImplementedError, "one dtype"),
    (dict(query=torch.randn(3, 1, 16, D)), NotImplementedError, "float32"),
    (dict(query=torch.randn(3, 1, 16, D).to(torch.float8_e4m3fn)), NotImplementedError, "fp8 query needs an fp8"),
    (dict(kv_cache=torch.randn(8, 32, D).to(torch.float8_e5m2)), NotImplementedError, "float8_e5m2"),
    (dict(kv_cache=torch.randn(8, 32, 512).bfloat16()), ValueError, "kv_cache must be"),
    (dict(kv_cache=torch.randn(8, 2, 32, D).bfloat16()), ValueError, "4-D kv_cache"),
    (dict(kv_cache=torch.randn(8, 128, D).bfloat16()), NotImplementedError, "page_size=128"),
    (dict(kv_cache=torch.randn(8, 32, 2 * D).bfloat16()[..., ::2]), ValueError, "contiguous last"),
    (dict(query=torch.randn(3, 1, 16, D + 4).bfloat16()[..., 4:]), ValueError, "16-byte aligned"),
    (dict(block_tables=torch.zeros(3, 3, dtype=torch.int64)), ValueError, "block_tables must be int32"),
    (dict(block_tables=torch.zeros(3, 1, dtype=torch.int32)), ValueError,
     r"too narrow.*needs \d+ columns, block_tables has 1"),
    (dict(block_tables=torch.tensor([[0, 1, -1], [0, 0, 0], [2, 9, 0]], dtype=torch.int32)), ValueError,
     "page id 9"),
    (dict(block_tables=torch.tensor([[0, -3, -1], [0, 0, 0], [2, 3, 0]], dtype=torch.int32)), ValueError,
     "page id -3"),
    (dict(seq_lens=torch.tensor([40, 0], dtype=torch.int32)), ValueError, "seq_lens must have shape"),
    (dict(seq_lens=torch.tensor([40, -1, 64], dtype=torch.int32)), ValueError, "seq_lens must be >= 0"),
    (dict(max_seq_len=50), ValueError, "exceeds max_seq_len"),
    (dict(bmm1_scale=float("inf")), ValueError, "bmm1_scale must be finite"),
    (dict(bmm2_scale="1"), TypeError, "bmm2_scale"),
    (dict(bmm2_scale=torch.tensor([1.0], dtype=torch.float64)), TypeError, "float32"),
    (dict(out=torch.empty(3, 1, 16, 512, dtype=torch.float16)), ValueError, "dtype of out"),
    (dict(out=torch.empty(3, 1, 16, 64, dtype=torch.bfloat16)), ValueError, "out must have shape"),
    (dict(lse=torch.empty(3, 8)), ValueError, "lse must have shape"),
    (dict(lse=torch.empty(16, 3).t()), ValueError, "lse must be contiguous"),
    (dict(workspace_buffer=torch.zeros(64, dtype=torch.uint8)), ValueError, "workspace_buffer holds"),
    (dict(backend="cute-dsl"), NotImplementedError, "'auto', 'cute', 'trtllm-gen', 'xqa'"),
    (dict(backend="sparse"), NotImplementedError, "'auto', 'cute'"),
    (dict(backend="fa3"), ValueError, "backend must be one of"),
    (dict(sparse_mla_top_k=2048), NotImplementedError, "sparse_mla_top_k"),
    (dict(sinks=[torch.zeros(16)]), NotImplementedError, "sinks"),
    (dict(sinks=torch.zeros(16)), NotImplementedError, r"sinks=a tensor of shape \(16,\) is not supported"),
    (dict(skip_softmax_threshold_scale_factor=1.0), NotImplementedError, "skip_softmax"),
    (dict(uses_shared_paged_kv_idx=False), NotImplementedError, "uses_shared_paged_kv_idx"),
    (dict(cum_seq_lens_q=torch.tensor([0, 1, 2, 3], dtype=torch.int32)), NotImplementedError, "cum_seq_lens_q"),
    (dict(cute_dsl_impl="modular"), NotImplementedError, "cute_dsl_impl"),
    (dict(enable_dcp=True), NotImplementedError, "enable_dcp"),
    (dict(cp_world=2), NotImplementedError, "cp_world"),
    (dict(use_fp16_softmax=True), NotImplementedError, "use_fp16_softmax"),
    (dict(return_lse_base="ln"), ValueError, "return_lse_base"),
])
def test_named_errors_before_launch(cross, launched, change, exc, match):
    with pytest.raises(exc, match=match):
        api.trtllm_batch_decode_with_kv_cache_mla(**_bad(**change))
    assert launched == []


def test_unmergeable_out_refused(cross, launched):
    a = _case(q_len=2)
    out = torch.empty(2, 3, 16, 512, dtype=torch.bfloat16).transpose(0, 1)  # [B, q_len] strides not mergeable
    with pytest.raises(ValueError, match="mergeable"):
        api.trtllm_batch_decode_with_kv_cache_mla(**a, out=out)
    assert launched == []


def test_cpu_tensors_refused_at_launch(cross):
    with pytest.raises(ValueError, match="CUDA tensors"):
        api.trtllm_batch_decode_with_kv_cache_mla(**_case())


def test_empty_batch_launches_nothing(cross, launched):
    a = _case(B=0, lens=())
    a.update(block_tables=torch.zeros(0, 3, dtype=torch.int32), max_seq_len=0)
    out = api.trtllm_batch_decode_with_kv_cache_mla(**a)
    assert out.shape == (0, 1, 16, 512) and launched == []


def test_kernel_launch_passes_output_scale_in_order():
    got = []
    args = MlaArgs(*range(11), 0.3, 7, output_scale=0.5)
    md.launch(lambda *a: got.append(a), None, args)
    assert got == [tuple(range(11)) + (0.3, 0.5, 7)]
    assert MlaArgs(*range(11), 0.3, 7).output_scale == 1.0


def _xqa_mla_case(B=2, PS=32):
    """xqa_mla's inputs on the CPU: fp8 e4m3 q and one combined cache (v_cache = k_cache), 128 heads."""
    cache = (torch.randn(4, PS, D) / 4).to(torch.float8_e4m3fn)
    return dict(q=torch.randn(B, 1, 128, D).to(torch.float8_e4m3fn), k_cache=cache, v_cache=cache,
                page_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                seq_lens=torch.tensor([[40], [64]], dtype=torch.uint32),
                output=torch.empty(B, 1, 128, 512, dtype=torch.bfloat16),
                workspace_buffer=torch.zeros(1 << 26, dtype=torch.uint8),
                semaphores=torch.zeros(64, dtype=torch.uint32), page_size=PS)


def test_enable_pdl_true_is_not_served(cross, launched):
    # as the decode entry points: PDL is refused, never accepted and ignored
    with pytest.raises(NotImplementedError, match="enable_pdl=True is not supported"):
        api.trtllm_batch_decode_with_kv_cache_mla(**_case(), enable_pdl=True)
    with pytest.raises(NotImplementedError, match="enable_pdl=True is not supported"):
        api.xqa_mla(**_xqa_mla_case(), enable_pdl=True)
    assert launched == []
    for pdl in (None, False):
        api.trtllm_batch_decode_with_kv_cache_mla(**_case(), enable_pdl=pdl)
        api.xqa_mla(**_xqa_mla_case(), enable_pdl=pdl)
    assert len(launched) == 4


def test_numpy_scales_are_reals(cross, launched):
    np = pytest.importorskip("numpy")
    api.trtllm_batch_decode_with_kv_cache_mla(**_case(), bmm1_scale=np.float32(0.25), bmm2_scale=np.float64(2.0))
    api.xqa_mla(**_xqa_mla_case(), q_scale=np.float32(0.5), kv_scale=np.float32(0.25))
    (_, _, a1), (_, _, a2) = launched
    assert (a1.sm_scale, a1.output_scale) == (0.25, 2.0) and (a2.sm_scale, a2.output_scale) == (0.125, 0.25)
    assert all(type(x) is float for x in (a1.sm_scale, a1.output_scale, a2.sm_scale, a2.output_scale))
    with pytest.raises(TypeError, match="bmm1_scale"):
        api.trtllm_batch_decode_with_kv_cache_mla(**_case(), bmm1_scale=True)
