"""Float64/float32 torch oracle ("ref") for softmax attention, FlashInfer conventions.

This module is the numerical ground truth that every kernel in ``cutedsl_attn`` is
tested against.  It is deliberately simple: dense score matrices, one request at a
time, computed in float64 by default.  It runs on CPU and CUDA tensors alike (all
intermediate tensors live on ``q``'s device).

It sits at the bottom of the import graph: it imports only ``torch``, the standard
library and its sibling modules (``paged``: page-table helpers; ``_checks``), never anything
else from ``cutedsl_attn``.

Conventions (source: FlashInfer 0.7.2, ``include/flashinfer/attention/variants.cuh``,
``prefill.cuh``, ``decode.cuh`` and ``flashinfer/utils.py``):

* Layout NHD: q ``[qo_len, Hq, Dqk]``, k ``[kv_len, Hkv, Dqk]``, v ``[kv_len, Hkv, Dvo]``.
* GQA: query head ``h`` reads kv head ``h // (Hq // Hkv)``.
* Logits: ``s_ij = sm_scale * <q_i, k_j>``, ``sm_scale`` defaulting to ``1/sqrt(Dqk)``;
  then the soft cap ``cap * tanh(s / cap)`` (if ``logits_soft_cap > 0``); then the ALiBi
  bias ``slope_h * (j - i_abs)``.
* ``i_abs = i + kv_len - qo_len`` is the absolute position of query row ``i``
  (bottom-right alignment).  Causal keeps ``j <= i_abs``; ``window_left = w >= 0`` keeps
  ``j >= i_abs - w``; a custom mask replaces the causal mask.
* LSE is base 2: ``lse = log2(sum_j exp(s_ij)) = logsumexp(s) * log2(e)``.
* A row with no visible key (and no sink) gives ``o = 0`` and ``lse = -inf``.
"""

from __future__ import annotations

import math
import operator
from typing import Optional, Tuple

import torch

from ._checks import _check_float_tensor, _check_ndim, _check_oracle_dtype, _check_pos_encoding_mode, _indptr_list
from .paged import block_tables_to_csr, csr_to_block_tables, paged_kv_to_contiguous

__all__ = [
    "LOG2E",
    "alibi_slopes",
    "apply_rope_llama",
    "attention",
    "paged_decode",
    "ragged_prefill",
    "paged_prefill",
    "block_tables_to_csr",
    "csr_to_block_tables",
    "paged_kv_to_contiguous",
]

#: log2(e); multiply a natural-log LSE by this to get FlashInfer's base-2 LSE.
LOG2E = 1.0 / math.log(2.0)


# ----------------------------------------------------------------------------------
# positional encodings
# ----------------------------------------------------------------------------------
def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi slopes, identical to FlashInfer's ``flashinfer.utils.get_alibi_slopes``.

    Let ``n`` be the largest power of two ``<= num_heads``.  The first ``n`` slopes are
    ``2^(-8/n * k)`` for ``k = 1..n``; the remaining ``num_heads - n`` slopes are
    ``2^(-4/n * k)`` for odd ``k = 1, 3, 5, ...`` (the odd-interleaved slopes of the
    ``2n``-head sequence, as in Press et al., "Train Short, Test Long", ALiBi).

    Args:
        num_heads: number of query heads ``H`` (python int, ``>= 1``).

    Returns:
        ``Tensor[float32]`` of shape ``[num_heads]`` on the CPU; slope ``h`` is the bias
        per unit of key distance for query head ``h`` (bias = ``slope_h * (j - i_abs)``,
        natural-log logit units).

    Raises:
        TypeError: ``num_heads`` is not an int.
        ValueError: ``num_heads < 1``.
    """
    if isinstance(num_heads, bool):
        raise TypeError("num_heads must be an int, got bool")
    try:
        num_heads = operator.index(num_heads)
    except TypeError:
        raise TypeError(f"num_heads must be an int, got {type(num_heads).__name__}") from None
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    n = 1 << (num_heads.bit_length() - 1)
    base = torch.arange(1, n + 1, dtype=torch.float64)
    slopes = torch.pow(2.0, -8.0 / n * base)
    if n < num_heads:
        extra = torch.arange(1, 2 * (num_heads - n), 2, dtype=torch.float64)
        slopes = torch.cat([slopes, torch.pow(2.0, -4.0 / n * extra)])
    return slopes.to(torch.float32)


def apply_rope_llama(
    x: torch.Tensor,
    positions: torch.Tensor,
    rope_scale: float = 1.0,
    rope_theta: float = 1e4,
) -> torch.Tensor:
    """Apply LLaMA-style (non-interleaved, "rotate half") RoPE along the last dim.

    FlashInfer ``pos_encoding_mode="ROPE_LLAMA"`` semantics (``pos_enc.cuh``): for
    ``d in [0, D/2)`` the pair ``(x[..., d], x[..., d + D/2])`` is rotated by angle
    ``pos * freq_d`` with ``freq_d = (1 / rope_scale) * rope_theta^(-2d/D)``::

        out[d]       = x[d] * cos - x[d + D/2] * sin
        out[d + D/2] = x[d + D/2] * cos + x[d] * sin

    Args:
        x: float tensor ``[..., n, H, D]`` (token dim third from last, heads second from
            last, head dim last; ``D`` even).
        positions: ``[n]`` token positions (any real/int dtype, any device; may be
            negative).  Row ``t`` of ``x`` is rotated by position ``positions[t]``.
        rope_scale: position interpolation factor (positions are divided by it).
        rope_theta: RoPE base.

    Returns:
        Tensor with ``x``'s shape, dtype and device.  Angles and products are computed in
        float64.

    Raises:
        TypeError: ``x`` is not a floating tensor or ``positions`` is not a tensor.
        ValueError: ``x.dim() < 3``, odd ``D``, ``positions`` not ``[n]`` matching
            ``x.shape[-3]``.
    """
    _check_float_tensor("x", x)
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
    if x.dim() < 3:
        raise ValueError(f"x must be [..., n, H, D] (>= 3-D), got shape {tuple(x.shape)}")
    D = x.shape[-1]
    if D % 2 != 0:
        raise ValueError(f"RoPE needs an even head dim, got D={D}")
    n = x.shape[-3]
    if positions.dim() != 1 or positions.shape[0] != n:
        raise ValueError(
            f"positions must be [n] with n = x.shape[-3] = {n}, got shape {tuple(positions.shape)}"
        )
    half = D // 2
    dev = x.device
    d = torch.arange(half, dtype=torch.float64, device=dev)
    freq = (1.0 / float(rope_scale)) * torch.pow(
        torch.tensor(float(rope_theta), dtype=torch.float64, device=dev), -2.0 * d / D
    )
    pos = positions.to(device=dev, dtype=torch.float64)
    ang = pos[:, None] * freq[None, :]  # [n, half]
    cos = torch.cos(ang)[:, None, :]  # [n, 1, half] broadcast over heads
    sin = torch.sin(ang)[:, None, :]
    xf = x.to(torch.float64)
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


# ----------------------------------------------------------------------------------
# single-request attention
# ----------------------------------------------------------------------------------
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window_left: int = -1,
    logits_soft_cap: Optional[float] = None,
    sm_scale: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    pos_encoding_mode: str = "NONE",
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
    custom_mask: Optional[torch.Tensor] = None,
    score_mod=None,
    batch_idx: int = 0,
    dtype: torch.dtype = torch.float64,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference softmax attention for ONE request (FlashInfer FA2 semantics).

    Source of the conventions: FlashInfer 0.7.2's attention variants, prefill and decode kernels and its
    sink-attention reference.  Let ``i`` index query rows
    (``0..qo_len-1``), ``j`` keys (``0..kv_len-1``) and ``i_abs = i + kv_len - qo_len``.

    1. ROPE_LLAMA: q row ``i`` is rotated at position ``i_abs``, key ``j`` at ``j``
       (:func:`apply_rope_llama`, with ``rope_scale``/``rope_theta`` defaulting to
       1.0/1e4).
    2. ``s_ij = sm_scale * <q_i, k_j>`` (``sm_scale`` default ``1/sqrt(Dqk)``), with query
       head ``h`` reading kv head ``h // (Hq // Hkv)`` (GQA).
    3. Soft cap, if ``logits_soft_cap > 0``: ``s = cap * tanh(s / cap)`` (``None`` or
       ``<= 0`` disables it, like FlashInfer).
    4. ALIBI: ``s += slope_h * (j - i_abs)`` with :func:`alibi_slopes`.  The bias is
       added after the soft cap (FlashInfer's kernel adds it before the tanh but then
       applies ``sm_scale`` twice when both are enabled, so that combination has no
       reliable upstream meaning; this oracle follows the project spec order).
    4b. ``score_mod`` (this package's extension, as FlashAttention-4's): ``s = score_mod(s, batch_idx, h, i, j)``
       called once with broadcasting tensors -- ``s`` ``[Hq, qo_len, kv_len]`` in ``dtype``, and int64
       ``batch_idx`` (0-d), ``h`` ``[Hq, 1, 1]``, ``i_abs`` ``[1, qo_len, 1]`` (the query's bottom-right
       position, as the kernels' ``q_idx``) and ``j`` ``[1, 1, kv_len]``, with torch's default dtype set to
       ``dtype`` during the call (so ``0.1 * (j - i_abs)`` is computed in ``dtype``); its result must
       broadcast to ``s``'s shape.  The kernels pass Int32 scalars and compute in float32; integer ``//`` and
       ``%`` of negative values differ there (C's truncation vs Python's floor).
    5. Visibility: ``custom_mask[i, j]`` (``False`` = masked) if given, which replaces
       ``causal``; else ``j <= i_abs`` if ``causal`` (bottom-right aligned); else all keys.
       ``window_left = w >= 0`` additionally requires ``j >= i_abs - w`` (so at most
       ``w + 1`` keys, diagonal included; applies with or without causal / custom mask).
       Masked logits are ``-inf``.
    6. Sinks: ``sinks[h]`` is one extra logit in natural-log units (NOT multiplied by
       ``sm_scale``) appended to every row's softmax with a zero value row; it is
       included in the LSE.
    7. ``p = softmax(s)``, ``o_i = sum_j p_ij v_j``,
       ``lse_i = log2(sum_j exp(s_ij) [+ exp(sink_h)]) = logsumexp * log2(e)``.
       Rows with no visible key: ``o = 0`` and ``lse = -inf`` (with a sink:
       ``lse = sink_h * log2(e)``, ``o = 0``).

    Args:
        q: ``[qo_len, Hq, Dqk]`` float (any float dtype, NHD).
        k: ``[kv_len, Hkv, Dqk]`` float (NHD); ``Hq % Hkv == 0``.
        v: ``[kv_len, Hkv, Dvo]`` float (NHD); ``Dvo`` may differ from ``Dqk``.
        causal: bottom-right causal mask (ignored when ``custom_mask`` is given).
        window_left: ``-1`` disables; ``w >= 0`` keeps keys ``j >= i_abs - w``.
        logits_soft_cap: soft-cap value (``None``/``<=0`` disables).
        sm_scale: python float logit scale; ``None`` -> ``1/sqrt(Dqk)``.
        sinks: ``[Hq]`` float tensor (any device) of sink logits, or ``None``.
        pos_encoding_mode: ``"NONE"``, ``"ROPE_LLAMA"`` or ``"ALIBI"``.
        rope_scale, rope_theta: RoPE parameters (``None`` -> 1.0, 1e4).
        custom_mask: bool ``[qo_len, kv_len]`` (``True`` = visible), any device.
        score_mod: callable or None (step 4b); the kernels trace the same callable with CuTe DSL scalars, so
            one written with Python arithmetic serves both.
        batch_idx: the request's index passed to ``score_mod``.
        dtype: compute/output dtype, ``torch.float64`` (default) or ``torch.float32``.

    Returns:
        ``(o, lse)``: ``o`` ``[qo_len, Hq, Dvo]`` and ``lse`` ``[qo_len, Hq]`` (base 2), both
        in ``dtype`` on ``q``'s device.

    Raises:
        TypeError: non-tensor or non-float q/k/v/sinks, non-bool custom_mask, bad ``dtype``, a non-callable
            ``score_mod``.
        ValueError: wrong ndim/shape (head counts, head dims, kv lengths, mask or sink
            shape), ``Hq % Hkv != 0``, tensors on different devices, ``window_left < -1``,
            odd ``Dqk`` with ROPE_LLAMA.
        KeyError: unknown ``pos_encoding_mode``.
    """
    _validate_qkv(q, k, v)
    _check_pos_encoding_mode(pos_encoding_mode)
    _check_oracle_dtype(dtype)
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be callable or None, got {type(score_mod).__name__}")
    qo_len, kv_len = q.shape[0], k.shape[0]
    if custom_mask is not None:
        if not isinstance(custom_mask, torch.Tensor):
            raise TypeError(
                f"custom_mask must be a torch.Tensor, got {type(custom_mask).__name__}"
            )
        if custom_mask.dtype != torch.bool:
            raise TypeError(f"custom_mask must be torch.bool, got {custom_mask.dtype}")
        if tuple(custom_mask.shape) != (qo_len, kv_len):
            raise ValueError(
                f"custom_mask must be [qo_len, kv_len] = {(qo_len, kv_len)}, "
                f"got {tuple(custom_mask.shape)}"
            )
    return _attention_core(
        q,
        k,
        v,
        causal=causal,
        window_left=_check_window_left(window_left),
        logits_soft_cap=logits_soft_cap,
        sm_scale=sm_scale,
        sinks=_check_sinks(sinks, q.shape[1]),
        pos_encoding_mode=pos_encoding_mode,
        rope_scale=rope_scale,
        rope_theta=rope_theta,
        custom_mask=custom_mask,
        score_mod=score_mod,
        batch_idx=batch_idx,
        dtype=dtype,
    )


def _validate_qkv(q, k, v) -> None:
    _check_float_tensor("q", q)
    _check_float_tensor("k", k)
    _check_float_tensor("v", v)
    _check_ndim("q", q, 3, "[qo_len, Hq, Dqk]")
    _check_ndim("k", k, 3, "[kv_len, Hkv, Dqk] (NHD)")
    _check_ndim("v", v, 3, "[kv_len, Hkv, Dvo] (NHD)")
    if k.device != q.device or v.device != q.device:
        raise ValueError(
            f"q, k, v must be on the same device, got {q.device}, {k.device}, {v.device}"
        )
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must have the same kv_len, got {k.shape[0]} and {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(
            f"k and v must have the same num_kv_heads, got {k.shape[1]} and {v.shape[1]}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q and k must have the same head_dim_qk, got {q.shape[2]} and {k.shape[2]}"
        )
    hq, hkv = q.shape[1], k.shape[1]
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(
            f"num_qo_heads ({hq}) must be a multiple of num_kv_heads ({hkv}) (GQA)"
        )


def _check_window_left(window_left) -> int:
    if isinstance(window_left, bool) or not isinstance(window_left, int):
        raise TypeError(f"window_left must be an int, got {type(window_left).__name__}")
    if window_left < -1:
        raise ValueError(f"window_left must be -1 (disabled) or >= 0, got {window_left}")
    return window_left


def _check_sinks(sinks, num_qo_heads: int):
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor, got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must have a floating-point dtype, got {sinks.dtype}")
    if tuple(sinks.shape) != (num_qo_heads,):
        raise ValueError(
            f"sinks must be [num_qo_heads] = [{num_qo_heads}], got {tuple(sinks.shape)}"
        )
    return sinks


def _attention_core(
    q,
    k,
    v,
    *,
    causal,
    window_left,
    logits_soft_cap,
    sm_scale,
    sinks,
    pos_encoding_mode,
    rope_scale,
    rope_theta,
    custom_mask,
    dtype,
    score_mod=None,
    batch_idx=0,
):
    """Validated single-request attention; see :func:`attention`."""
    dev = q.device
    qo_len, hq, dqk = q.shape
    kv_len, hkv, _ = k.shape
    group = hq // hkv

    qf = q.to(dtype)
    kf = k.to(dtype)
    vf = v.to(dtype)

    offset = kv_len - qo_len
    i_abs = torch.arange(qo_len, device=dev, dtype=torch.int64) + offset  # [qo]
    j_idx = torch.arange(kv_len, device=dev, dtype=torch.int64)  # [kv]

    if pos_encoding_mode == "ROPE_LLAMA":
        if dqk % 2 != 0:
            raise ValueError(f"ROPE_LLAMA needs an even head_dim_qk, got {dqk}")
        rs = 1.0 if rope_scale is None else float(rope_scale)
        rt = 1e4 if rope_theta is None else float(rope_theta)
        qf = apply_rope_llama(qf, i_abs, rs, rt)
        kf = apply_rope_llama(kf, j_idx, rs, rt)

    if group > 1:
        kf = kf.repeat_interleave(group, dim=1)
        vf = vf.repeat_interleave(group, dim=1)

    scale = 1.0 / math.sqrt(dqk) if sm_scale is None else float(sm_scale)
    s = torch.einsum("ihd,jhd->hij", qf, kf) * scale  # [Hq, qo, kv]

    if logits_soft_cap is not None and float(logits_soft_cap) > 0:
        cap = float(logits_soft_cap)
        s = cap * torch.tanh(s / cap)

    rel = (j_idx[None, :] - i_abs[:, None]).to(dtype)  # [qo, kv] = j - i_abs
    if pos_encoding_mode == "ALIBI":
        slopes = alibi_slopes(hq).to(device=dev, dtype=dtype)
        s = s + slopes[:, None, None] * rel[None]
    if score_mod is not None:
        # int64 indices; torch's default dtype is ``dtype`` during the call, so an int tensor times a python
        # float (a bias) is computed in ``dtype`` too, not float32
        saved = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            s = score_mod(s, torch.tensor(int(batch_idx), device=dev), torch.arange(hq, device=dev)[:, None, None],
                          i_abs[None, :, None], j_idx[None, None, :])
        finally:
            torch.set_default_dtype(saved)
        s = torch.as_tensor(s, dtype=dtype, device=dev).expand(hq, qo_len, kv_len)

    if custom_mask is not None:
        visible = custom_mask.to(device=dev, dtype=torch.bool)
    elif causal:
        visible = rel <= 0
    else:
        visible = torch.ones(qo_len, kv_len, dtype=torch.bool, device=dev)
    if window_left >= 0:
        visible = visible & (rel >= -window_left)
    s = s.masked_fill(~visible[None], float("-inf"))

    if sinks is not None:
        sink_col = sinks.to(device=dev, dtype=dtype)[:, None, None].expand(hq, qo_len, 1)
        lse_nat = torch.logsumexp(torch.cat([s, sink_col], dim=-1), dim=-1)  # [Hq, qo]
    else:
        lse_nat = torch.logsumexp(s, dim=-1)  # [Hq, qo]; -inf for empty rows

    finite = torch.isfinite(lse_nat)
    safe_lse = torch.where(finite, lse_nat, torch.zeros_like(lse_nat))
    p = torch.exp(s - safe_lse[..., None])  # exp(-inf) = 0 for masked entries
    p = torch.where(finite[..., None], p, torch.zeros_like(p))
    o = torch.einsum("hij,jhd->ihd", p, vf)  # [qo, Hq, Dvo]
    lse = (lse_nat * LOG2E).transpose(0, 1).contiguous()  # [qo, Hq]
    return o.contiguous(), lse


# ----------------------------------------------------------------------------------
# batched wrappers
# ----------------------------------------------------------------------------------
_BATCH_KW = (
    "causal",
    "window_left",
    "logits_soft_cap",
    "sm_scale",
    "sinks",
    "pos_encoding_mode",
    "rope_scale",
    "rope_theta",
    "custom_mask",
    "score_mod",
    "dtype",
)


def _batched_attention(q_segments, ks, vs, kw):
    """Run :func:`attention` per request; ``custom_mask`` is the flattened concatenation."""
    unknown = set(kw) - set(_BATCH_KW)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {sorted(unknown)}")
    kw = dict(kw)
    dtype = _check_oracle_dtype(kw.get("dtype", torch.float64))
    mask = kw.pop("custom_mask", None)
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"custom_mask must be a torch.Tensor, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            raise TypeError(f"custom_mask must be torch.bool, got {mask.dtype}")
        if mask.dim() != 1:
            raise ValueError(
                "custom_mask must be 1-D: the concatenation of each request's row-major "
                f"[qo_len_b, kv_len_b] mask, got shape {tuple(mask.shape)}"
            )
        need = sum(qb.shape[0] * kb.shape[0] for qb, kb in zip(q_segments, ks))
        if mask.shape[0] != need:
            raise ValueError(
                f"custom_mask must have sum_b qo_len_b*kv_len_b = {need} elements, got {mask.shape[0]}"
            )
    os_, lses = [], []
    moff = 0
    for b, (qb, kb, vb) in enumerate(zip(q_segments, ks, vs)):
        mb = None
        if mask is not None:
            n = qb.shape[0] * kb.shape[0]
            mb = mask[moff : moff + n].reshape(qb.shape[0], kb.shape[0])
            moff += n
        o, lse = attention(qb, kb.to(qb.device), vb.to(qb.device), custom_mask=mb, batch_idx=b, **kw)
        os_.append(o)
        lses.append(lse)
    return os_, lses, dtype


def _cat(parts, empty_shape, dtype, device):
    if parts:
        return torch.cat(parts, dim=0)
    return torch.zeros(empty_shape, dtype=dtype, device=device)


def paged_decode(
    q: torch.Tensor,
    k_cache,
    v_cache,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    *,
    kv_layout: str = "NHD",
    **attention_kwargs,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference batch decode over a paged KV cache (``BatchDecodeWithPagedKVCacheWrapper``).

    One query token per request at absolute position ``kv_len_b - 1`` (FlashInfer decode
    convention, also used for RoPE/ALiBi).  Page table is FlashInfer CSR
    (FlashInfer's page-table convention): ``kv_indptr[B+1]`` in pages, ``kv_indices``
    physical page ids, ``kv_last_page_len[B]`` in ``[1, page_size]`` (``0`` for a 0-page
    request); ``kv_len_b = (npages_b - 1) * page_size + kv_last_page_len[b]``.  A request
    with 0 pages yields ``o = 0`` and ``lse = -inf`` (``sink * log2 e`` with a sink).

    Cache forms (section 1.1), selected by what is passed:

    * ``k_cache``, ``v_cache`` both 4-D: ``[num_pages, page_size, Hkv, D]`` (NHD) or
      ``[num_pages, Hkv, page_size, D]`` (HND); 3-D means ``page_size == 1`` with the
      page dim dropped.
    * ``v_cache=None`` and ``k_cache=(k, v)`` a tuple of such tensors.
    * ``v_cache=None`` and ``k_cache`` one 5-D tensor ``[num_pages, 2, page_size, Hkv, D]``
      (NHD) / ``[num_pages, 2, Hkv, page_size, D]`` (HND), ``[:, 0]`` = K, ``[:, 1]`` = V
      (4-D ``[num_pages, 2, Hkv, D]`` for ``page_size == 1``).

    Args:
        q: ``[B, Hq, D]`` float.
        k_cache, v_cache: see above (any float dtype, same device as ``q`` or movable).
        kv_indptr, kv_indices, kv_last_page_len: integer CSR tensors (any device).
        kv_layout: ``"NHD"`` (default) or ``"HND"``.
        **attention_kwargs: forwarded to :func:`attention` (``window_left``,
            ``logits_soft_cap``, ``sm_scale``, ``sinks``, ``pos_encoding_mode``,
            ``rope_scale``, ``rope_theta``, ``dtype``, ``causal`` (a no-op for one row),
            ``custom_mask`` as a flattened bool of ``sum_b kv_len_b`` elements).

    Returns:
        ``(o [B, Hq, Dvo], lse [B, Hq])`` in ``dtype`` (float64 default), base-2 LSE.

    Raises:
        KeyError: invalid ``kv_layout`` / ``pos_encoding_mode``.
        TypeError: non-float q/caches, non-integer page-table tensors, unknown kwargs.
        ValueError: shape mismatches, malformed CSR (indptr not starting at 0 or
            decreasing, ``last_page_len`` outside ``[1, page_size]``, nonzero
            ``last_page_len`` for a 0-page request, page index out of range).
    """
    _check_float_tensor("q", q)
    _check_ndim("q", q, 3, "[batch_size, Hq, D]")
    ks, vs = paged_kv_to_contiguous(
        k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout=kv_layout
    )
    B = len(ks)
    if q.shape[0] != B:
        raise ValueError(
            f"q must have batch_size={B} rows (len(kv_indptr)-1), got {q.shape[0]}"
        )
    q_segments = [q[b : b + 1] for b in range(B)]
    os_, lses, dtype = _batched_attention(q_segments, ks, vs, attention_kwargs)
    dvo = vs[0].shape[-1] if vs else q.shape[-1]
    hq = q.shape[1]
    o = _cat(os_, (0, hq, dvo), dtype, q.device)
    lse = _cat(lses, (0, hq), dtype, q.device)
    return o, lse


def ragged_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    **attention_kwargs,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference batch prefill over ragged (contiguous, NHD) K/V
    (``BatchPrefillWithRaggedKVCacheWrapper``).

    Request ``b`` owns query rows ``qo_indptr[b]:qo_indptr[b+1]`` and KV rows
    ``kv_indptr[b]:kv_indptr[b+1]`` (token units, section 1.2) and is computed with
    :func:`attention` (so causal/window/RoPE/ALiBi positions are per request,
    bottom-right aligned).

    Args:
        q: ``[total_q, Hq, Dqk]``; k: ``[total_kv, Hkv, Dqk]``; v: ``[total_kv, Hkv, Dvo]``.
        qo_indptr, kv_indptr: integer ``[B+1]`` prefix sums starting at 0.
        **attention_kwargs: as :func:`attention`; ``custom_mask`` is the 1-D bool
            concatenation of each request's row-major ``[qo_len_b, kv_len_b]`` mask
            (FlashInfer ``custom_mask`` before bit packing).

    Returns:
        ``(o [total_q, Hq, Dvo], lse [total_q, Hq])`` in ``dtype``, base-2 LSE.

    Raises:
        TypeError / ValueError / KeyError: as :func:`attention`, plus malformed indptrs,
        ``len(qo_indptr) != len(kv_indptr)``, ``qo_indptr[-1] != total_q`` or
        ``kv_indptr[-1] != total_kv``.
    """
    _validate_qkv(q, k, v)
    qp = _indptr_list("qo_indptr", qo_indptr)
    kp = _indptr_list("kv_indptr", kv_indptr)
    if len(qp) != len(kp):
        raise ValueError(
            f"qo_indptr and kv_indptr must have the same length, got {len(qp)} and {len(kp)}"
        )
    if qp[-1] != q.shape[0]:
        raise ValueError(f"qo_indptr[-1]={qp[-1]} must equal q.shape[0]={q.shape[0]}")
    if kp[-1] != k.shape[0]:
        raise ValueError(f"kv_indptr[-1]={kp[-1]} must equal k.shape[0]={k.shape[0]}")
    B = len(qp) - 1
    q_segments = [q[qp[b] : qp[b + 1]] for b in range(B)]
    ks = [k[kp[b] : kp[b + 1]] for b in range(B)]
    vs = [v[kp[b] : kp[b + 1]] for b in range(B)]
    os_, lses, dtype = _batched_attention(q_segments, ks, vs, attention_kwargs)
    o = _cat(os_, (0, q.shape[1], v.shape[2]), dtype, q.device)
    lse = _cat(lses, (0, q.shape[1]), dtype, q.device)
    return o, lse


def paged_prefill(
    q: torch.Tensor,
    k_cache,
    v_cache,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    *,
    kv_layout: str = "NHD",
    **attention_kwargs,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference batch prefill over a paged KV cache (``BatchPrefillWithPagedKVCacheWrapper``).

    Query rows of request ``b`` are ``q[qo_indptr[b]:qo_indptr[b+1]]``; its KV comes from
    the CSR page table exactly as in :func:`paged_decode` (same cache forms and
    ``kv_layout``).  Each request is computed with :func:`attention`.

    Args:
        q: ``[total_q, Hq, Dqk]`` float.
        k_cache, v_cache: paged cache (see :func:`paged_decode`).
        qo_indptr: integer ``[B+1]`` query-token offsets.
        kv_indptr, kv_indices, kv_last_page_len: CSR page table.
        kv_layout: ``"NHD"`` or ``"HND"``.
        **attention_kwargs: as :func:`ragged_prefill`.

    Returns:
        ``(o [total_q, Hq, Dvo], lse [total_q, Hq])`` in ``dtype``, base-2 LSE.

    Raises:
        as :func:`paged_decode` and :func:`ragged_prefill`.
    """
    _check_float_tensor("q", q)
    _check_ndim("q", q, 3, "[total_q, Hq, Dqk]")
    ks, vs = paged_kv_to_contiguous(
        k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout=kv_layout
    )
    qp = _indptr_list("qo_indptr", qo_indptr)
    if len(qp) - 1 != len(ks):
        raise ValueError(
            f"qo_indptr and kv_indptr must have the same length, got {len(qp)} and {len(ks) + 1}"
        )
    if qp[-1] != q.shape[0]:
        raise ValueError(f"qo_indptr[-1]={qp[-1]} must equal q.shape[0]={q.shape[0]}")
    B = len(ks)
    q_segments = [q[qp[b] : qp[b + 1]] for b in range(B)]
    os_, lses, dtype = _batched_attention(q_segments, ks, vs, attention_kwargs)
    dvo = vs[0].shape[-1] if vs else q.shape[-1]
    o = _cat(os_, (0, q.shape[1], dvo), dtype, q.device)
    lse = _cat(lses, (0, q.shape[1]), dtype, q.device)
    return o, lse
