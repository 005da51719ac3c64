"""CPU checks of the real-model (all-MiniLM-L6-v2) decode fixture and of
``cutedsl_attn.realmodel.decode_cases``.

The reference here is the fixture's ``o``: the model's OWN fp32 attention
output (captured by tools/make_minilm_fixture.py), not something derived from
the stored q/K/V.  A float64 softmax attention computed from decode_cases'
paged cache -- gathering pages through the CSR table by hand -- must
reproduce it to within the rounding of the stored / requested dtype.

Error measure: rel = ||o_test - o_model||_2 / ||o_model||_2 over one request's
[12, 32] output.  Bounds (u = unit roundoff of the dtype the inputs are in):

* float16 (the storage dtype, so the cache is bit-exact to the fixture):
  u = 2**-11.  Rounding q, K and V to fp16 perturbs each by <= u relative, and
  the stored model output is itself rounded (<= u).  Score errors get
  amplified by the score magnitude, so we allow 8u = 2**-8 ~= 3.9e-3.
  Measured max is ~5.5e-4 (~1.1u), so this has ~7x headroom while still
  catching a wrong page, a wrong scale or a missing softmax term (>= 1e-1).
* bfloat16 (decode_cases' default): a further rounding to u = 2**-8; same 8u
  argument gives 2**-5 ~= 3.1e-2 (measured max ~5.8e-3).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from cutedsl_attn import realmodel
from cutedsl_attn.realmodel import decode_cases, load_minilm_decode_fixture, minilm_fixture_path

NUM_LAYERS, NUM_HEADS, HEAD_DIM = 6, 12, 32
BOUNDS = {torch.float16: 2.0**-8, torch.bfloat16: 2.0**-5, torch.float32: 2.0**-8}


@pytest.fixture(scope="module")
def fx():
    return load_minilm_decode_fixture()


def gather_request(case, b):
    """K, V [n, H, D] of request b, read from the paged cache through the CSR table."""
    indptr, indices, last = case["kv_indptr"], case["kv_indices"], case["kv_last_page_len"]
    ps = case["k_cache"].shape[1]
    ks, vs = [], []
    lo, hi = int(indptr[b]), int(indptr[b + 1])
    for j in range(lo, hi):
        page = int(indices[j])
        valid = int(last[b]) if j == hi - 1 else ps
        ks.append(case["k_cache"][page, :valid])
        vs.append(case["v_cache"][page, :valid])
    return torch.cat(ks), torch.cat(vs)


def attention_f64(q, k, v, scale):
    """q [H, D], k/v [n, H, D] -> [H, D]: softmax(q k^T * scale) v, float64, non-causal."""
    q, k, v = q.double(), k.double(), v.double()
    p = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * scale, dim=-1)
    return torch.einsum("hn,nhd->hd", p, v)


def rel(x, ref):
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def test_fixture_file_small_and_loads(fx):
    path = minilm_fixture_path()
    assert path.is_file()
    assert path.stat().st_size < 1_000_000, path.stat().st_size
    meta = fx["meta"]
    assert meta["model_name"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert meta["dtype"] in ("float16", "bfloat16")
    assert fx["k"].dtype == getattr(torch, meta["dtype"])
    assert (meta["num_layers"], meta["num_heads"], meta["head_dim"]) == (NUM_LAYERS, NUM_HEADS, HEAD_DIM)
    assert meta["sm_scale"] == pytest.approx(HEAD_DIM**-0.5)
    for key in ("model_package_version", "transformers_version", "date"):
        assert meta[key]
    # The generator verified its hooks: fp64 recompute from fp32 captures.
    assert meta["recompute_rel_err_fp32_capture_max"] < 1e-5


def test_fixture_sentences_and_shapes(fx):
    meta = fx["meta"]
    counts = meta["token_counts"]
    b = len(meta["sentences"])
    assert b >= 8 and len(counts) == b
    assert len(set(counts)) >= 6 and min(counts) <= 6 and max(counts) >= 16, counts
    t = sum(counts)
    assert fx["seq_indptr"].tolist() == [sum(counts[:i]) for i in range(b + 1)]
    assert fx["q"].shape == fx["o"].shape == (NUM_LAYERS, b, NUM_HEADS, HEAD_DIM)
    assert fx["k"].shape == fx["v"].shape == (NUM_LAYERS, t, NUM_HEADS, HEAD_DIM)
    assert fx["input_ids"].shape == (t,)
    assert fx["embeddings"].shape == (b, 384) and fx["embeddings"].dtype == torch.float32
    norms = fx["embeddings"].norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-4)
    for x in ("q", "k", "v", "o"):
        assert torch.isfinite(fx[x].float()).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_decode_reproduces_model_output(fx, dtype):
    bound = BOUNDS[dtype]
    worst = 0.0
    layers = 0
    for case in decode_cases(fx, page_size=16, dtype=dtype):
        layers += 1
        q, exp = case["q"], case["expected"]
        b = q.shape[0]
        assert q.shape == exp.shape == (b, NUM_HEADS, HEAD_DIM)
        assert q.dtype == case["k_cache"].dtype == dtype and exp.dtype == torch.float32
        assert case["k_cache"].shape[1:] == (16, NUM_HEADS, HEAD_DIM)
        for t in ("kv_indptr", "kv_indices", "kv_last_page_len"):
            assert case[t].dtype == torch.int32
        for i in range(b):
            k, v = gather_request(case, i)
            assert k.shape[0] == fx["meta"]["token_counts"][i]
            err = rel(attention_f64(q[i], k, v, case["sm_scale"]), exp[i])
            worst = max(worst, err)
            assert err < bound, f"layer {case['layer']} request {i}: rel err {err:.3e} >= {bound:.3e}"
    assert layers == NUM_LAYERS
    print(f"{dtype}: worst rel err {worst:.3e} (bound {bound:.3e})")


@pytest.mark.parametrize("page_size", [1, 5, 16, 32])
def test_paging_is_lossless_and_noncontiguous(fx, page_size):
    counts = fx["meta"]["token_counts"]
    indptr = fx["seq_indptr"].tolist()
    case = next(decode_cases(fx, page_size=page_size, dtype=fx["k"].dtype))
    kv_indptr, kv_indices, last = case["kv_indptr"], case["kv_indices"], case["kv_last_page_len"]
    num_pages = case["k_cache"].shape[0]
    n_used = int(kv_indptr[-1])
    assert kv_indices.numel() == n_used < num_pages  # spare pages exist
    assert len(set(kv_indices.tolist())) == n_used  # no page shared
    assert int(kv_indices.min()) >= 0 and int(kv_indices.max()) < num_pages
    assert ((last >= 1) & (last <= page_size)).all()
    assert case["kv_lens"].tolist() == counts
    # Non-contiguous: not laid out in ascending order, and no multi-page
    # request has consecutive ascending page ids.
    assert kv_indices.tolist() != sorted(kv_indices.tolist())
    multi = 0
    for b in range(len(counts)):
        pages = kv_indices[kv_indptr[b] : kv_indptr[b + 1]].tolist()
        assert (len(pages) - 1) * page_size + int(last[b]) == counts[b]
        if len(pages) > 1:
            multi += 1
            assert any(pages[j + 1] != pages[j] + 1 for j in range(len(pages) - 1)), pages
        # Bit-exact round trip of the real K/V through the page table.
        k, v = gather_request(case, b)
        assert torch.equal(k, fx["k"][0, indptr[b] : indptr[b + 1]])
        assert torch.equal(v, fx["v"][0, indptr[b] : indptr[b + 1]])
    if page_size <= 16:
        assert multi >= 1


def test_check_is_sensitive_to_wrong_pages(fx):
    """Reading pages in storage order instead of through the table must fail the bound."""
    case = next(decode_cases(fx, page_size=16, dtype=torch.float16))
    wrong = dict(case, kv_indices=torch.arange(case["kv_indices"].numel(), dtype=torch.int32))
    errs = []
    for i in range(case["q"].shape[0]):
        k, v = gather_request(wrong, i)
        errs.append(rel(attention_f64(case["q"][i], k, v, case["sm_scale"]), case["expected"][i]))
    assert max(errs) > 10 * BOUNDS[torch.float16]


def test_realmodel_imports_only_torch_and_stdlib():
    import sys

    tree = ast.parse(Path(realmodel.__file__).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    third_party = {r for r in roots if r not in sys.stdlib_module_names and r not in ("torch", "__future__")}
    assert not third_party, third_party


def test_missing_fixture_error_is_clear(monkeypatch, tmp_path):
    monkeypatch.setattr(realmodel, "minilm_fixture_path", lambda: tmp_path / "nope.pt")
    with pytest.raises(FileNotFoundError, match="make_minilm_fixture"):
        load_minilm_decode_fixture()
