"""Float64 oracle of MLA (DeepSeek multi-head latent attention) in the absorbed form, FlashInfer conventions.

One latent KV head is shared by every query head (MQA): for query token ``i`` of a request and head ``h``,
``s_j = sm_scale * (q_nope[i, h] . ckv_j + q_pe[i, h] . kpe_j)``, ``o[i, h] = softmax(s) . ckv`` (V is the
compressed KV itself), ``lse[i, h] = log2(sum_j exp(s_j))`` (base 2).  Causal is bottom-right: query token
``i`` of a request with ``qo_len`` queries and ``kv_len`` keys sees keys ``j <= i + kv_len - qo_len``.  A row
that sees no key gives O = 0 and LSE = -inf.  Caches are paged: ``ckv_cache [pages, page_size, 512]``,
``kpe_cache [pages, page_size, 64]``; request ``b`` owns pages ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``
and its first ``kv_len_arr[b]`` tokens.  Unused page slots are never read (NaN there stays out).  fp8 e4m3
inputs are widened exactly (the dequantised values before any per-tensor scale: a caller's q / k / v scales go
into ``sm_scale`` and a multiplier of O, as the kernels take them).
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

__all__ = ["mla_paged_attention"]

_LOG2E = 1.0 / math.log(2.0)


def _host_ints(name: str, t, ndim: int = 1) -> list[int]:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    return t.to("cpu", torch.int64).tolist()


def mla_paged_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_len_arr: torch.Tensor,
    *,
    sm_scale: float,
    causal: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """MLA over a paged latent cache in float64 (any device; CPU is fine).

    Args:
        q_nope: ``[tokens, H, Dc]`` float, fp8 e4m3 included (Dc = head_dim_ckv, 512 for DeepSeek).
        q_pe: ``[tokens, H, Dr]`` float (Dr = head_dim_kpe, 64).
        ckv_cache: ``[pages, page_size, Dc]`` float.
        kpe_cache: ``[pages, page_size, Dr]`` float.
        qo_indptr: integer ``[B+1]``: request ``b``'s query tokens are rows ``qo_indptr[b]:qo_indptr[b+1]``.
        kv_indptr: integer ``[B+1]`` offsets into ``kv_indices``, in pages.
        kv_indices: integer page ids.
        kv_len_arr: integer ``[B]`` KV lengths in tokens, ``<= pages_b * page_size``.
        sm_scale: the softmax scale (taken as given).
        causal: bottom-right causal mask (matters only for ``qo_len > 1``).

    Returns:
        ``(o [tokens, H, Dc] float64, lse [tokens, H] float64, base 2)`` on ``q_nope``'s device.

    Raises:
        TypeError: non-tensor or non-integer index arrays.
        ValueError: shapes that disagree (heads, head dims, page sizes, batch), a decreasing indptr, a
            ``kv_len`` beyond the request's pages, or a page id outside the cache.
    """
    for n, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{n} must be a float torch.Tensor")
        if t.dim() != 3:
            raise ValueError(f"{n} must be 3-D, got shape {tuple(t.shape)}")
    T, H, Dc = q_nope.shape
    if q_pe.shape[:2] != (T, H):
        raise ValueError(f"q_pe {tuple(q_pe.shape)} must match q_nope's [tokens, heads] {(T, H)}")
    Dr = q_pe.shape[2]
    P, PS, _ = ckv_cache.shape
    if ckv_cache.shape[2] != Dc or tuple(kpe_cache.shape) != (P, PS, Dr):
        raise ValueError(f"ckv_cache {tuple(ckv_cache.shape)} / kpe_cache {tuple(kpe_cache.shape)} must be "
                         f"[pages, page_size, {Dc}] / [pages, page_size, {Dr}]")
    qo = _host_ints("qo_indptr", qo_indptr)
    kvp = _host_ints("kv_indptr", kv_indptr)
    idx = _host_ints("kv_indices", kv_indices)
    lens = _host_ints("kv_len_arr", kv_len_arr)
    B = len(lens)
    if len(qo) != B + 1 or len(kvp) != B + 1:
        raise ValueError(f"qo_indptr ({len(qo)}) and kv_indptr ({len(kvp)}) must have B+1 = {B + 1} entries")
    if qo[-1] > T:
        raise ValueError(f"qo_indptr[-1] = {qo[-1]} exceeds the {T} query rows")

    dev = q_nope.device
    o = torch.zeros((T, H, Dc), dtype=torch.float64, device=dev)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64, device=dev)
    for b in range(B):
        q0, q1, p0, p1, L = qo[b], qo[b + 1], kvp[b], kvp[b + 1], lens[b]
        if q1 < q0 or p1 < p0:
            raise ValueError(f"qo_indptr / kv_indptr must be non-decreasing (request {b})")
        if L < 0 or L > (p1 - p0) * PS:
            raise ValueError(f"kv_len_arr[{b}] = {L} is outside [0, {(p1 - p0) * PS}] (its pages x page_size)")
        n_q = q1 - q0
        if n_q == 0 or L == 0:
            continue
        pages = idx[p0: p0 + -(-L // PS)]
        if any(p < 0 or p >= P for p in pages):
            raise ValueError(f"request {b} has a page id outside [0, {P})")
        pid = torch.tensor(pages, dtype=torch.int64, device=dev)
        ckv = ckv_cache[pid].reshape(-1, Dc)[:L].to(torch.float64)  # [L, Dc]
        kpe = kpe_cache[pid].reshape(-1, Dr)[:L].to(torch.float64)
        qn = q_nope[q0:q1].to(torch.float64)  # [n_q, H, Dc]
        qp = q_pe[q0:q1].to(torch.float64)
        s = (torch.einsum("qhd,kd->qhk", qn, ckv) + torch.einsum("qhd,kd->qhk", qp, kpe)) * float(sm_scale)
        if causal:
            qi = torch.arange(n_q, device=dev).view(n_q, 1, 1)
            kj = torch.arange(L, device=dev).view(1, 1, L)
            s = s.masked_fill(kj > qi + (L - n_q), float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)  # natural log, -inf for a row with nothing visible
        seen = torch.isfinite(row_lse)
        p = torch.where(seen.unsqueeze(-1), torch.exp(s - row_lse.unsqueeze(-1)), torch.zeros_like(s))
        o[q0:q1] = torch.einsum("qhk,kd->qhd", p, ckv)
        lse[q0:q1] = torch.where(seen, row_lse * _LOG2E, torch.full_like(row_lse, float("-inf")))
    return o, lse
