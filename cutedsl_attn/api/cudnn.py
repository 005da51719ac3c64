"""The ``backend="cudnn"`` prefill path: :func:`cudnn_batch_prefill_with_kv_cache` (FlashInfer 0.7.2's
``flashinfer.cudnn_batch_prefill_with_kv_cache``) and the glue the
prefill wrappers (``BatchPrefillWithRaggedKVCacheWrapper`` / ``BatchPrefillWithPagedKVCacheWrapper``
with ``backend="cudnn"``) call from ``plan()`` and ``run()``.

Every call here runs one cuDNN frontend graph (``cudnn.pygraph`` with one SDPA forward node; the
graphs, their cache and the handle live in :mod:`cutedsl_attn.cudnn.prefill`).  The ``cudnn``
package (cudnn-frontend, the optional ``cudnn`` extra of this package) is imported lazily: a
wrapper's ``plan()`` and the function raise ``ImportError`` naming ``nvidia-cudnn-frontend`` when
it is missing.

Conventions (FlashInfer's, each with its source):

* causal is bottom-right aligned: key ``j`` is visible to row ``i`` of a request iff
  ``j <= i + kv_len - qo_len`` (FlashInfer's cuDNN path passes
  ``use_causal_mask_bottom_right=causal``); rows with no visible key give O = 0 and LSE = -inf;
* ``window_left=w`` keeps ``w+1`` keys (the diagonal included) = cuDNN's
  ``diagonal_band_left_bound=w+1``; only together with ``causal`` here;
* the LSE is base 2 by default: cuDNN's Stats are natural-log and are multiplied by ``log2(e)``
  (FlashInfer ``cudnn/prefill.py``; ``lse_base="ln"`` keeps them as written);
* the wrappers' LSE is packed tokens-major ``[qo_indptr[-1], Hq]`` (FlashInfer's wrapper passes
  ``batch_offsets_stats``); the raw function's default LSE is padded ``[B, max_token_per_sequence,
  Hq]`` unless ``batch_offsets_stats`` is given;
* the raw function's ``batch_offsets_*`` are in **elements** by default
  (``batch_offsets_units="elements"``), token indptrs with ``"tokens"``.

Wrapper graphs: ``plan()`` does host work only (validation, lengths, the dense block table gathered
on the device from the CSR arrays, ragged offsets); the first ``run()`` of a new graph key builds the
cuDNN graph (tens of ms to ~1 s), later plans whose *bucketed* key matches (batch size rounded up to
a power of two with zero-length padding requests, maximum lengths to a power of two >= 128) reuse
it.  The >= 128 floor also keeps every wrapper graph off cuDNN's ``s_q == 1`` decode path, whose
GQA LSE FlashInfer's wrappers route around (NVBug 6783545, cuDNN 9.26/9.27).  Not served by the
wrappers with ``backend="cudnn"``: CUDA-graph mode, the deprecated ``forward()``, a ragged
``kv_layout="HND"`` (as FlashInfer), and the features listed in :func:`plan_wrapper`.

Status: written against cudnn-frontend 1.32.0 and the cuDNN 9.19 runtime of torch 2.11+cu130 on
SM90; verified on an NVIDIA H200 against the float64 oracle.
"""

from __future__ import annotations

import numbers

import torch

from ..common.constants import LN2 as _LN2
from ..cudnn import prefill as cp
from ._common import (
    LSE_BASES,
    canonical_dtype,
    check_float,
    check_int,
    check_lse_options,
    check_pos_encoding_mode,
    check_sm_scale,
    check_tensor,
    check_window_left,
    run_scale,
)

__all__ = ["cudnn_batch_prefill_with_kv_cache"]

_FP8 = tuple(d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d)


# ----------------------------------------------------------------------------- small checks
def _check_16b(name: str, t: torch.Tensor) -> None:
    """Innermost dim contiguous; base pointer and the other strides 16-byte aligned (cuDNN's TMA loads)."""
    if t.numel() == 0:
        return
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {tuple(t.stride())}")
    es = t.element_size()
    if t.data_ptr() % 16 or any((s * es) % 16 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1):
        raise ValueError(f"{name} must be 16-byte aligned in its base pointer and every non-last stride "
                         f"(strides {tuple(t.stride())})")


def _scale(name: str, x) -> float:
    return run_scale(name, x, where=" by backend='cudnn'")


def _check_dtype_triplet(q_dt, kv_dt, o_dt) -> torch.dtype:
    for n, dt in (("q_data_type", q_dt), ("kv_data_type", kv_dt), ("o_data_type", o_dt)):
        if dt in _FP8:
            raise NotImplementedError(f"{n}={dt}: fp8 is not supported by backend='cudnn' (float16/bfloat16 only)")
        if dt not in (torch.float16, torch.bfloat16):
            raise NotImplementedError(f"{n}={dt} is not supported by backend='cudnn'; supported: torch.float16, "
                                      "torch.bfloat16")
    if not (q_dt == kv_dt == o_dt):
        raise NotImplementedError(f"mixed dtypes (q={q_dt}, kv={kv_dt}, o={o_dt}) are not supported by "
                                  "backend='cudnn'; q, kv and o must match")
    return q_dt


def _require_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(f"backend='cudnn' runs on a CUDA device; the tensors/workspace are on {device}")


# ----------------------------------------------------------------------------- wrapper glue
def check_wrapper_init(use_cuda_graph: bool) -> None:
    """``__init__`` checks of a prefill wrapper with ``backend="cudnn"``."""
    if use_cuda_graph:
        raise NotImplementedError("use_cuda_graph=True is not supported with backend='cudnn' (plan-owned cuDNN "
                                  "metadata is reallocated per plan); use backend='auto'")


def plan_wrapper(w, *, qo_h, kv_lens, kv_starts, total_kv, page_size, flat_indices, table, num_qo_heads,
                 num_kv_heads, head_dim_qk, head_dim_vo, custom_mask, packed_custom_mask, causal, pos_encoding_mode,
                 use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, q_data_type, kv_data_type,
                 o_data_type, non_blocking, graph_copies=(), rope_scale=None, rope_theta=None, **extra) -> None:
    """``plan()`` of a prefill wrapper with ``backend="cudnn"`` (called with the arguments of the wrapper's
    shared plan step, after the index arrays were parsed and validated there).

    Validates the options cuDNN's graph cannot express -- every one raises ``NotImplementedError``
    naming the feature: custom masks, RoPE / ALiBi (``pos_encoding_mode``), ``logits_soft_cap``, a
    window without ``causal``, ``use_fp16_qk_reduction``, fp8 / mixed dtypes, a ragged wrapper with
    ``kv_layout="HND"`` (FlashInfer's cuDNN ragged path rejects it too) -- then imports cudnn
    (``ImportError`` if missing), requires a CUDA device, and builds the plan-time device metadata
    (seq lengths, dense block table, offsets).  The graph itself is fetched from / built into the
    process-wide cache on the first ``run()`` of a new layout and reused by later plans with the same
    bucketed key.  Sets ``w._plan``.
    """
    for n, x in extra.items():  # options added to the shared plan step later: reject any that is set
        unset = (x is None or x is False or (isinstance(x, str) and x == "NONE")
                 or (isinstance(x, (int, float)) and not isinstance(x, bool) and x == 0))
        if not unset:
            raise NotImplementedError(f"{n}={x!r} is not supported by backend='cudnn'")
    if custom_mask is not None or packed_custom_mask is not None:
        raise NotImplementedError("custom_mask / packed_custom_mask (custom masks) are not supported by "
                                  "backend='cudnn'")
    check_pos_encoding_mode(pos_encoding_mode)
    # rope_scale / rope_theta are validated whatever the mode, as on the CuTe path
    check_float("rope_scale", rope_scale, positive=True)
    check_float("rope_theta", rope_theta, positive=True)
    if pos_encoding_mode != "NONE":
        raise NotImplementedError(f"pos_encoding_mode={pos_encoding_mode!r} (RoPE / ALiBi positional encoding) is "
                                  "not supported by backend='cudnn'; supported: 'NONE'")
    if use_fp16_qk_reduction:
        raise NotImplementedError("use_fp16_qk_reduction=True is not supported by backend='cudnn'")
    if logits_soft_cap is not None:
        if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, numbers.Real):
            raise TypeError(f"logits_soft_cap must be a float or None, got {type(logits_soft_cap).__name__}")
        if logits_soft_cap != 0:
            raise NotImplementedError("logits_soft_cap (soft cap) is not supported by backend='cudnn'")
    window_left = check_window_left(window_left)
    if window_left >= 0 and not causal:
        raise NotImplementedError("window_left >= 0 without causal=True (a non-causal sliding window) is not "
                                  "supported by backend='cudnn'")
    scale = check_sm_scale(sm_scale, head_dim_qk)
    q_dt = canonical_dtype("q_data_type", q_data_type) or torch.float16
    dt = _check_dtype_triplet(q_dt, canonical_dtype("kv_data_type", kv_data_type) or q_dt,
                              canonical_dtype("o_data_type", o_data_type) or q_dt)
    num_qo_heads = check_int("num_qo_heads", num_qo_heads, 1)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, 1)
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    for n, d in (("head_dim_qk", head_dim_qk), ("head_dim_vo", head_dim_vo)):
        if d % 8 or d > 256:
            raise NotImplementedError(f"{n}={d} is not supported by backend='cudnn' (multiple of 8, <= 256)")
    paged = page_size > 0
    if not paged and w._kv_layout != "NHD":  # as FlashInfer's ragged cuDNN path (prefill.py run)
        raise NotImplementedError("kv_layout='HND' is not supported by the ragged wrapper with backend='cudnn' "
                                  "(ragged K/V must be tokens-major NHD)")
    cp.require_cudnn()
    _require_cuda(w.device)

    if paged:
        layout = cp.describe_batch(qo_h, kv_lens, causal=bool(causal), page_starts=kv_starts, page_size=page_size)
    else:
        layout = cp.describe_batch(qo_h, kv_lens, causal=bool(causal), kv_starts=kv_starts)
    plan = cp.PrefillPlan(layout, device=w.device, dtype=dt, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                          head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, causal=bool(causal),
                          window_left=window_left, flat_pages=flat_indices if paged else None,
                          non_blocking=non_blocking)
    total_q = int(qo_h[-1])
    w._plan = dict(
        B=layout.batch, total_q=total_q, total_kv=total_kv, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, page_size=page_size,
        group=num_qo_heads // num_kv_heads, dtype=dt, causal=bool(causal), use_mask=False, window_left=window_left,
        soft_cap=0.0, sm_scale=scale, pos_encoding_mode="NONE", cudnn=plan,
    )


def run_wrapper(w, q, k, v, *, q_scale, k_scale, v_scale, o_scale, out, lse, return_lse, lse_base, lse_layout,
                sinks, enable_pdl, kv_cache_sf):
    """``run()`` of a prefill wrapper with ``backend="cudnn"`` (after the wrapper checked q and k/v against the
    plan).  ``k``/``v``: ragged ``[total_kv, Hkv, D]`` NHD-ordered views; paged ``[pages, page_size, Hkv, D]``
    NHD-ordered views (passed to cuDNN as ``(pages, Hkv, page_size, D)`` permuted views, no copy).

    Returns ``out`` or ``(out, lse)`` as the wrappers' ``run`` documents.  Raises ``NotImplementedError`` for
    ``sinks``, ``enable_pdl=True`` and ``kv_cache_sf``; ``ValueError`` for bad ``lse_base``/``lse_layout``,
    ``out``/``lse`` of the wrong shape/dtype/device/layout.
    """
    p = w._plan
    plan: cp.PrefillPlan = p["cudnn"]
    if sinks is not None:
        raise NotImplementedError("sinks (attention sinks) are not supported by backend='cudnn'")
    if enable_pdl:
        raise NotImplementedError("enable_pdl=True is not supported by backend='cudnn'")
    if kv_cache_sf is not None:
        raise NotImplementedError("kv_cache_sf (NVFP4 KV) is not supported by backend='cudnn'")
    check_lse_options(lse_base, lse_layout)
    TQ, Hq, Dvo, dt = p["total_q"], p["num_qo_heads"], p["head_dim_vo"], p["dtype"]
    dev = w.device
    if out is None:
        out = torch.empty((TQ, Hq, Dvo), dtype=dt, device=dev)
    else:
        check_tensor("out", out, shape=(TQ, Hq, Dvo), dtype=dt, device=dev)
    lse_shape = (TQ, Hq) if lse_layout == "NH" else (Hq, TQ)
    if lse is not None:
        check_tensor("lse", lse, shape=lse_shape, dtype=torch.float32, device=dev)
        if not lse.is_contiguous():
            raise ValueError("lse must be contiguous")
    sm_scale = p["sm_scale"] * _scale("q_scale", q_scale) * _scale("k_scale", k_scale)
    o_div = _scale("o_scale", o_scale)
    if o_div == 0.0:
        raise ValueError("o_scale must be nonzero (the output is divided by it)")
    o_factor = _scale("v_scale", v_scale) / o_div
    want_lse = return_lse or lse is not None
    lse_out = lse
    if want_lse and lse_out is None:
        lse_out = torch.empty(lse_shape, dtype=torch.float32, device=dev)
    lse_nh = None
    if want_lse:
        lse_nh = lse_out if lse_layout == "NH" else torch.empty((TQ, Hq), dtype=torch.float32, device=dev)
    if plan.paged:
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # -> (pages, Hkv, page_size, D)
    for n, t in (("q", q), (w._k_names[0], k), (w._k_names[1], v), ("out", out)):
        _check_16b(n, t)
    plan.run(q, k, v, out, lse_nh, sm_scale=sm_scale, workspace=w._workspace, workspace_owner=w)
    if o_factor != 1.0:
        out.mul_(o_factor)
    if want_lse:
        if lse_base == "log2":
            lse_nh.mul_(cp.LOG2E)
        if lse_layout == "HN":
            lse_out.copy_(lse_nh.t())
    return (out, lse_out) if return_lse else out


# ----------------------------------------------------------------------------- the raw function
def _int_lens(name: str, t, B: int, device) -> torch.Tensor:
    check_tensor(name, t)
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    if t.numel() != B:
        raise ValueError(f"{name} must have batch_size = {B} entries (shape (batch_size, 1, 1, 1)), "
                         f"got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected q's device {device}")
    return t.reshape(B, 1, 1, 1).to(torch.int32).contiguous()


def _indptr(name: str, t, B: int, device) -> torch.Tensor:
    check_tensor(name, t)
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.numel() != B + 1:
        raise ValueError(f"{name} must have batch_size + 1 = {B + 1} entries, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected q's device {device}")
    return t.reshape(-1).to(torch.int64)


def _row_mask(starts: torch.Tensor, counts: torch.Tensor, n_rows: int) -> torch.Tensor:
    """bool ``[n_rows]``: rows ``starts[b] .. starts[b] + counts[b] - 1`` of every ``b`` (device ops, no sync)."""
    dev = starts.device
    delta = torch.zeros(n_rows + 1, dtype=torch.int32, device=dev)
    s = starts.clamp(0, n_rows)
    e = (starts + counts).clamp(0, n_rows)
    ones = torch.ones_like(s, dtype=torch.int32)
    delta.index_add_(0, s, ones)
    delta.index_add_(0, e, -ones)
    return delta.cumsum(0)[:n_rows] > 0


def cudnn_batch_prefill_with_kv_cache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    workspace_buffer: torch.Tensor,
    *,
    max_token_per_sequence: int,
    max_sequence_kv: int,
    actual_seq_lens_q: torch.Tensor | None = None,
    actual_seq_lens_kv: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
    causal: bool,
    return_lse: bool,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    batch_offsets_q: torch.Tensor | None = None,
    batch_offsets_o: torch.Tensor | None = None,
    batch_offsets_k: torch.Tensor | None = None,
    batch_offsets_v: torch.Tensor | None = None,
    batch_offsets_stats: torch.Tensor | None = None,
    batch_offsets_units: str = "elements",
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    is_cuda_graph_compatible: bool = False,
    backend: str | None = None,
    o_data_type: torch.dtype | None = None,
    lse_base: str = "log2",
):
    """Batched prefill attention over a paged or ragged KV, one cuDNN frontend SDPA graph
    (FlashInfer 0.7.2's ``flashinfer.cudnn_batch_prefill_with_kv_cache``).

    Args:
      q: packed queries ``[total_q, Hq, Dqk]`` fp16/bf16 (request ``b``'s rows consecutive), last dim
        contiguous, 16-byte aligned strides.
      k_cache, v_cache: paged ``[num_pages, Hkv, page_size, Dqk|Dvo]`` (HND *shape*; any strides with a
        contiguous last dim, so an NHD pool passes as ``pool.transpose(1, 2)``) together with
        ``block_tables``; or ragged ``[total_kv, Hkv, Dqk|Dvo]`` (tokens-major) without it.  q's dtype.
      scale: softmax scale (no default; typically ``1/sqrt(Dqk)``), baked into the cached graph.
      workspace_buffer: device buffer for cuDNN's workspace (128 MiB is plenty); when smaller than the
        graph needs, a buffer is allocated for the call instead.
      max_token_per_sequence, max_sequence_kv: declared maxima ``S_q`` / ``S_kv`` (>= every length; the
        graph is built for exactly these, and the padded LSE is ``[B, max_token_per_sequence, Hq]``).
      actual_seq_lens_q, actual_seq_lens_kv: per-request lengths ``(B, 1, 1, 1)`` (or ``(B,)``), integer,
        on q's device.  May be omitted with ``batch_offsets_units="tokens"``: then derived from
        ``batch_offsets_q`` (q) and ``batch_offsets_k`` (kv; for a paged KV these offsets only give
        the lengths, as in FlashInfer).
      block_tables: ``[B, pages_per_seq]`` int32 on q's device (paged KV); row ``b`` lists the pages of
        request ``b`` in order.
      causal: bottom-right causal mask (keyword-only, required).
      return_lse: also return the LSE (keyword-only, required).
      q_scale, k_scale, v_scale: fp8 scales -- fp8 is not supported (``NotImplementedError`` unless None).
      batch_offsets_q, batch_offsets_o, batch_offsets_k, batch_offsets_v, batch_offsets_stats: ``(B+1,)``
        int32/int64 cumulative offsets on q's device, in ``batch_offsets_units``.  Elements:
        ``token_offset * Hq * Dqk`` for q, ``* Hq * Dvo`` for out, ``* Hkv * D`` for k/v, ``* Hq`` for
        the stats; tokens: plain indptrs (``o`` defaults to ``q``, ``v`` to ``k``).  q/o offsets are
        required when ``B > 1`` (packed tensors cannot be addressed without them; ``ValueError``).  A
        ragged K/V without offsets is read in the padded layout (request ``b`` at token
        ``b * max_sequence_kv``), as FlashInfer declares it.  ``batch_offsets_k/v`` are ignored for a
        paged KV.  ``batch_offsets_stats`` makes the LSE packed (``lse`` may then be
        ``[total_q, Hq]``).
      batch_offsets_units: ``"elements"`` (default) or ``"tokens"`` (``ValueError`` otherwise).
      out: optional ``[total_q, Hq, Dvo]`` output (q's dtype, last dim contiguous).
      lse: optional float32 contiguous LSE, ``[B, max_token_per_sequence, Hq]`` or, with
        ``batch_offsets_stats``, ``[total_q, Hq]``.  Allocated (padded shape) when None and
        ``return_lse``.
      is_cuda_graph_compatible: accepted and ignored.  A call reads no host data and synchronises
        nothing, so it can be captured once its cuDNN graph is cached (call it once before capturing).
      backend: None or ``"cudnn"``; FlashInfer's ``"cubin"`` fallback is not provided
        (``NotImplementedError``): every cuDNN path here is a cuDNN frontend graph.
      o_data_type: None or q's dtype (``NotImplementedError`` otherwise).
      lse_base: ``"log2"`` (default, FlashInfer's base-2 LSE) or ``"ln"`` (cuDNN's natural-log stats).

    Returns:
      ``(out, lse)`` -- ``out`` ``[total_q, Hq, Dvo]``; ``lse`` as above (fp32), or None without
      ``return_lse``.  Rows with no visible key (causal rows ``i < qo_len - kv_len``, all rows of a
      request with ``kv_len == 0``) are O = 0, LSE = -inf; padded LSE rows at or beyond a request's
      ``qo_len`` are left as cuDNN writes them (unspecified, as in FlashInfer).

    Raises:
      TypeError / ValueError: malformed arguments (each message names the argument).
      NotImplementedError: fp8 scales/dtypes, ``o_data_type`` other than q's, ``backend="cubin"``,
        head dims not a multiple of 8 or above 256, a graph no cuDNN engine serves.
      ImportError: cudnn-frontend is not installed.

    Notes: the graph is cached by (device, dtype, B, ``S_q``, ``S_kv``, heads, head dims, scale, causal,
    LSE form, tensor strides, page-table width); a new combination builds a graph (tens of ms).  Rows
    without a visible key are fixed by a few small device ops plus one masked pass over ``out`` (no
    host synchronisation).  Verified on an NVIDIA H200 against the float64 oracle.
    """
    # ---- FlashInfer's checks first (same order)
    if lse_base not in LSE_BASES:
        raise ValueError(f"lse_base must be one of {LSE_BASES}, got {lse_base!r}")
    if batch_offsets_units not in ("elements", "tokens"):
        raise ValueError(f"batch_offsets_units must be 'elements' or 'tokens', got {batch_offsets_units!r}")
    tokens = batch_offsets_units == "tokens"
    check_tensor("q", q)
    if actual_seq_lens_q is not None:
        check_tensor("actual_seq_lens_q", actual_seq_lens_q)
        B = actual_seq_lens_q.shape[0]
    elif tokens and batch_offsets_q is not None:
        check_tensor("batch_offsets_q", batch_offsets_q)
        B = batch_offsets_q.reshape(-1).shape[0] - 1
    else:
        raise ValueError('actual_seq_lens_q may be omitted only with batch_offsets_units="tokens" and '
                         "batch_offsets_q set")
    if actual_seq_lens_kv is None and not (tokens and batch_offsets_k is not None):
        raise ValueError('actual_seq_lens_kv may be omitted only with batch_offsets_units="tokens" and '
                         "batch_offsets_k set (non-paged KV)")
    if B < 1:
        raise ValueError(f"batch_size must be >= 1, got {B}")
    # ---- what this package does not serve
    for n, x in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)):
        if x is not None:
            raise NotImplementedError(f"{n} (fp8 scales) is not supported by cudnn_batch_prefill_with_kv_cache")
    if backend not in (None, "cudnn"):
        if backend == "cubin":
            raise NotImplementedError("backend='cubin' (FlashInfer's precompiled cuDNN kernels) is not provided; "
                                      "every cuDNN path here is a cuDNN frontend graph (backend=None)")
        raise ValueError(f"backend must be None or 'cudnn', got {backend!r}")
    if not isinstance(causal, bool) or not isinstance(return_lse, bool):
        raise TypeError("causal and return_lse must be bool")
    check_tensor("k_cache", k_cache)
    check_tensor("v_cache", v_cache)
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D [total_q, num_heads_qo, head_dim_qk], got shape {tuple(q.shape)}")
    for n, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype in _FP8:
            raise NotImplementedError(f"{n} dtype {t.dtype}: fp8 is not supported by backend='cudnn'")
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"{n} must be torch.float16 or torch.bfloat16, got {t.dtype}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    o_dt = canonical_dtype("o_data_type", o_data_type) or q.dtype
    if o_dt != q.dtype:
        raise NotImplementedError(f"o_data_type={o_dt} different from q's dtype {q.dtype} is not supported")
    if scale is None:
        raise TypeError("scale (the softmax scale) is required, e.g. 1 / sqrt(head_dim_qk)")
    scale = check_float("scale", scale, positive=False)
    max_q = check_int("max_token_per_sequence", max_token_per_sequence, 1)
    max_kv = check_int("max_sequence_kv", max_sequence_kv, 1)
    total_q, Hq, Dqk = q.shape
    paged = block_tables is not None
    if paged:
        if k_cache.dim() != 4 or v_cache.dim() != 4:
            raise ValueError("with block_tables, k_cache/v_cache must be 4-D [num_pages, num_heads_kv, page_size, "
                             f"head_dim], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
        check_tensor("block_tables", block_tables, ndim=2)
        if block_tables.dtype != torch.int32:
            raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
        if block_tables.shape[0] != B:
            raise ValueError(f"block_tables must have batch_size = {B} rows, got {block_tables.shape[0]}")
        if k_cache.shape[:3] != v_cache.shape[:3]:
            raise ValueError(f"k_cache and v_cache must agree on [num_pages, num_heads_kv, page_size], got "
                             f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    else:
        if k_cache.dim() != 3 or v_cache.dim() != 3:
            raise ValueError("without block_tables, k_cache/v_cache must be 3-D [total_kv, num_heads_kv, head_dim] "
                             f"(4-D paged caches need block_tables), got {tuple(k_cache.shape)} and "
                             f"{tuple(v_cache.shape)}")
        if k_cache.shape[:2] != v_cache.shape[:2]:
            raise ValueError(f"k_cache and v_cache must agree on [total_kv, num_heads_kv], got "
                             f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    Hkv, Dvo = k_cache.shape[1], v_cache.shape[-1]
    if k_cache.shape[-1] != Dqk:
        raise ValueError(f"k_cache head_dim {k_cache.shape[-1]} != q head_dim {Dqk}")
    if Hq % Hkv:
        raise ValueError(f"num_heads_qo ({Hq}) must be a multiple of num_heads_kv ({Hkv})")
    for n, d in (("head_dim_qk", Dqk), ("head_dim_vo", Dvo)):
        if d % 8 or d > 256:
            raise NotImplementedError(f"{n}={d} is not supported by backend='cudnn' (multiple of 8, <= 256)")
    dev = q.device
    for n, t in (("k_cache", k_cache), ("v_cache", v_cache), ("workspace_buffer", workspace_buffer)):
        check_tensor(n, t)
        if t.device != dev:
            raise ValueError(f"{n} is on {t.device}, expected q's device {dev}")
    if paged and block_tables.device != dev:
        raise ValueError(f"block_tables is on {block_tables.device}, expected q's device {dev}")
    # ---- outputs
    if return_lse and lse is None:
        lse = torch.empty((B, max_q, Hq), dtype=torch.float32, device=dev)
    if lse is not None:
        padded = (B, max_q, Hq)
        packed_ok = batch_offsets_stats is not None and tuple(lse.shape) == (total_q, Hq)
        if tuple(lse.shape) != padded and not packed_ok:
            raise ValueError("lse must have shape (num_sequences, max_token_per_sequence, h_qo)"
                             + (" or, with batch_offsets_stats, (num_tokens, h_qo)"
                                if batch_offsets_stats is not None else "")
                             + f"; got {tuple(lse.shape)}")
        check_tensor("lse", lse, dtype=torch.float32, device=dev)
        if not lse.is_contiguous():
            raise ValueError("lse must be contiguous")
    if out is None:
        out = torch.empty((total_q, Hq, Dvo), dtype=q.dtype, device=dev)
    else:
        check_tensor("out", out, shape=(total_q, Hq, Dvo), dtype=q.dtype, device=dev)
    if tokens:
        if batch_offsets_o is None:
            batch_offsets_o = batch_offsets_q
        if batch_offsets_v is None:
            batch_offsets_v = batch_offsets_k
    if B > 1 and (batch_offsets_q is None or batch_offsets_o is None):
        raise ValueError(
            "batch_offsets_q and batch_offsets_o are required when batch_size > 1: packed q/out cannot be "
            "addressed without ragged offsets. Pass cumulative element offsets of shape (batch_size + 1,), "
            'e.g. cumsum([0, *actual_seq_lens_q]) * num_qo_heads * head_dim, or token-unit indptrs with '
            'batch_offsets_units="tokens".'
        )
    _require_cuda(dev)
    cp.require_cudnn()
    for n, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        _check_16b(n, t)

    # ---- device metadata (no host synchronisation)
    def elems(name, t, tok_stride):
        if t is None:
            return None
        t = _indptr(name, t, B, dev)
        return t * tok_stride if tokens else t

    q_off = elems("batch_offsets_q", batch_offsets_q, q.stride(0))
    o_off = elems("batch_offsets_o", batch_offsets_o, out.stride(0))
    if q_off is None:  # B == 1: the only request starts at 0
        q_off = torch.zeros(2, dtype=torch.int64, device=dev)
    if o_off is None:
        o_off = torch.zeros(2, dtype=torch.int64, device=dev)
    if actual_seq_lens_q is not None:
        seq_q = _int_lens("actual_seq_lens_q", actual_seq_lens_q, B, dev)
    else:
        ip = _indptr("batch_offsets_q", batch_offsets_q, B, dev)
        seq_q = (ip[1:] - ip[:-1]).to(torch.int32).reshape(B, 1, 1, 1)
    k_off = v_off = None
    if actual_seq_lens_kv is not None:
        seq_kv = _int_lens("actual_seq_lens_kv", actual_seq_lens_kv, B, dev)
    else:
        ip = _indptr("batch_offsets_k", batch_offsets_k, B, dev)
        seq_kv = (ip[1:] - ip[:-1]).to(torch.int32).reshape(B, 1, 1, 1)
    table = None
    if paged:
        table = block_tables.reshape(B, 1, block_tables.shape[1], 1).contiguous()
        k_layout = (tuple(k_cache.shape), tuple(k_cache.stride()))
        v_layout = (tuple(v_cache.shape), tuple(v_cache.stride()))
    else:
        padded_kv = torch.arange(B + 1, dtype=torch.int64, device=dev) * max_kv
        k_off = elems("batch_offsets_k", batch_offsets_k, k_cache.stride(0))
        v_off = elems("batch_offsets_v", batch_offsets_v, v_cache.stride(0))
        if k_off is None:
            k_off = padded_kv * k_cache.stride(0)
        if v_off is None:
            v_off = padded_kv * v_cache.stride(0)
        k_layout = (k_cache.stride(0), k_cache.stride(1))
        v_layout = (v_cache.stride(0), v_cache.stride(1))
    stats_off = None
    packed_lse = batch_offsets_stats is not None
    if return_lse and packed_lse:
        stats_off = elems("batch_offsets_stats", batch_offsets_stats, Hq)
    key = cp.PrefillGraphKey(
        device_index=dev.index or 0, dtype=q.dtype, batch=B,
        max_q=max_q, max_kv=max_kv, num_qo_heads=Hq, num_kv_heads=Hkv, head_dim_qk=Dqk, head_dim_vo=Dvo,
        sm_scale=scale, causal=causal, window_left=-1, return_lse=return_lse, packed_lse=packed_lse,
        q_strides=(q.stride(0), q.stride(1)), o_strides=(out.stride(0), out.stride(1)), paged=paged,
        k_layout=k_layout, v_layout=v_layout, table_width=block_tables.shape[1] if paged else 0,
    )
    if total_q == 0:
        return out, (lse if return_lse else None)
    r = lambda t: t.reshape(-1, 1, 1, 1)  # noqa: E731
    cp.run_graph(
        key, q=q, k=k_cache, v=v_cache, out=out, stats=lse if return_lse else None, seq_len_q=seq_q,
        seq_len_kv=seq_kv, q_offsets=r(q_off), o_offsets=r(o_off), k_offsets=None if paged else r(k_off),
        v_offsets=None if paged else r(v_off), stats_offsets=None if stats_off is None else r(stats_off),
        block_table=table, workspace=workspace_buffer,
    )
    # rows with no visible key -> O = 0, LSE = -inf (device-side, whatever the engine wrote there)
    lq = seq_q.reshape(-1).to(torch.int64)
    lkv = seq_kv.reshape(-1).to(torch.int64)
    n_empty = torch.where(lkv <= 0, lq, (lq - lkv).clamp(min=0) if causal else torch.zeros_like(lq))
    o_rows = torch.div(o_off[:-1], out.stride(0), rounding_mode="floor")
    out.masked_fill_(_row_mask(o_rows, n_empty, total_q).reshape(-1, 1, 1), 0)
    if return_lse:
        if packed_lse:
            s_rows = torch.div(stats_off[:-1], Hq, rounding_mode="floor")
            lse.view(-1, Hq).masked_fill_(_row_mask(s_rows, n_empty, lse.numel() // Hq).reshape(-1, 1),
                                          float("-inf"))
        else:
            m = torch.arange(max_q, device=dev).reshape(1, max_q) < n_empty.reshape(B, 1)
            lse.masked_fill_(m.reshape(B, max_q, 1), float("-inf"))
        if lse_base == "log2":
            lse.mul_(cp.LOG2E)
    return out, (lse if return_lse else None)
