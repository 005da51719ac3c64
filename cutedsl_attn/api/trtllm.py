"""TensorRT-LLM-style entry points of FlashInfer on this package's kernels: ``trtllm_batch_decode_with_kv_cache``
(``flashinfer.decode``), ``xqa`` (``flashinfer.xqa``) and ``trtllm_batch_context_with_kv_cache``
(``flashinfer.prefill``), with FlashInfer 0.7.2's signatures.

Each call plans through a decode or paged-prefill wrapper made for it and dropped after it (as
``single_decode_with_kv_cache``), so no device tensor outlives the call.  Planning reads ``seq_lens`` (and
``cum_seq_lens_q``, a spec-decode ``mask``, tensor scales) on the host: these calls synchronise and are not
capturable in a CUDA graph; capture the wrappers' ``run()`` instead.

Scales: every entry point reduces to the kernels' two scalars, the softmax scale ``sm_scale`` (the logit
multiplier, ``s = sm_scale * q.k``, ``q.k`` on the cache's stored values: an fp8 cache is only widened) and
``output_scale`` (an fp32 factor on the normalised output, applied in the kernel's epilogue before the rounding to
16 bits).  The one table of this package's decode entry points, the same for one query row per request (the decode
kernel) and several (the prefill kernel), for a 16-bit and an fp8 e4m3 cache:

    entry point                           sm_scale                           output_scale
    ------------------------------------  ---------------------------------  ------------------------------
    trtllm_batch_decode_with_kv_cache     bmm1_scale                         bmm2_scale
    trtllm_batch_context_with_kv_cache    bmm1_scale                         bmm2_scale
    xqa, cache of q's dtype               q_scale / sqrt(D)                  1
    xqa, float8_e4m3fn cache              q_scale * kv_scale / sqrt(D)       kv_scale
    prims_ts (function and wrapper)       bmm1_scale (default 1/sqrt(D))     bmm2_scale
    decode wrapper run()                  sm_scale * q_scale * k_scale       v_scale

``bmm1_scale`` is FlashInfer's fused ``q_scale * k_scale * sm_scale`` (default 1.0: no implicit ``1/sqrt(D)``),
``bmm2_scale`` its ``v_scale / o_scale`` (an fp8 cache's dequantisation scales are folded into them by the caller,
as in FlashInfer); tensor scales (one element) are read on the host.
``o_scale`` (trtllm) and ``rcp_out_scale`` (xqa) scale an fp8 output, which is not served: ``o_scale`` must be
1.0 (its value for a 16-bit output is already in ``bmm2_scale``); ``rcp_out_scale`` is ignored for a 16-bit
output, as xqa does.

Conventions (FlashInfer's): LSE is base 2; ``window_left=w`` keeps ``w+1`` keys (xqa's ``sliding_win_size`` counts
the current key: ``window_left = sliding_win_size - 1``); sinks are natural-log logits, not scaled by
``sm_scale``; several query rows per request are bottom-right causal; an empty request gives O = 0, LSE = -inf.
"""

from __future__ import annotations

import math
import numbers

import torch

from ._common import (canonical_dtype, check_bool, check_devices, check_float, check_head_dim, check_heads, check_int,
                      check_kv_layout, check_one_device, check_optional_bool, check_tensor)
from ._pagetable import check_table_width
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .prefill_paged import BatchPrefillWithPagedKVCacheWrapper, MultiRowDecodePrefillWrapper

__all__ = ["trtllm_batch_decode_with_kv_cache", "trtllm_batch_context_with_kv_cache", "xqa"]

FP8 = torch.float8_e4m3fn
_16BIT = (torch.float16, torch.bfloat16)
XQA_PAGE_SIZES = (16, 32, 64, 128)
TRTLLM_DECODE_BACKENDS = ("auto", "xqa", "trtllm-gen")
TRTLLM_CONTEXT_BACKENDS = ("trtllm-gen", "cake")


# ----------------------------------------------------------------------------- argument checks
def _scalar(name: str, x, *, positive: bool) -> float:
    """A scale: a Python number or a one-element tensor (read on the host), finite (and > 0 if ``positive``)."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or not x.dtype.is_floating_point:
            raise ValueError(f"{name} as a tensor must hold one floating-point element, got {x.dtype} "
                             f"{tuple(x.shape)}")
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a float or a one-element tensor, got {type(x).__name__}")
    return check_float(name, x, positive=positive)  # finite, and > 0 if positive


def _not_capturing(name: str) -> None:
    """RuntimeError inside a CUDA stream capture: planning reads lengths on the host (a synchronising copy)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{name} plans on the host (it reads seq_lens) and cannot run inside a CUDA-graph "
                           "capture; capture a planned wrapper's run() instead")


def _unserved(**options) -> None:
    """NotImplementedError naming the first option given a value this package does not serve."""
    for what, given in options.items():
        if given:
            raise NotImplementedError(f"{what} is not supported")


def _split_kv_cache(kv_cache, kv_layout: str):
    """``(k_cache, v_cache)`` 4-D tensors in ``kv_layout`` from a tuple or a 5-D ``[pages, 1 or 2, ...]`` tensor
    (dim 1 of size 1: K and V share storage)."""
    if isinstance(kv_cache, (tuple, list)):
        if len(kv_cache) != 2:
            raise ValueError(f"kv_cache as a tuple must be (k_cache, v_cache), got {len(kv_cache)} tensors")
        k, v = kv_cache
        check_tensor("k_cache", k, ndim=4)
        check_tensor("v_cache", v, ndim=4)
    else:
        check_tensor("kv_cache", kv_cache)
        if kv_cache.dim() != 5 or kv_cache.shape[1] not in (1, 2):
            raise ValueError("kv_cache must be a (k_cache, v_cache) tuple of 4-D tensors or one 5-D tensor "
                             f"[num_pages, 1 or 2, ...], got shape {tuple(kv_cache.shape)}")
        k = kv_cache[:, 0]
        v = kv_cache[:, 1] if kv_cache.shape[1] == 2 else k
    if k.shape != v.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype != v.dtype:
        raise ValueError(f"k_cache and v_cache must have the same dtype, got {k.dtype} and {v.dtype}")
    page_size, hkv = (k.shape[1], k.shape[2]) if kv_layout == "NHD" else (k.shape[2], k.shape[1])
    return k, v, int(page_size), int(hkv), int(k.shape[3])


def _check_query(name: str, q, *, ndim: int) -> None:
    check_tensor(name, q, ndim=ndim)
    if q.dtype not in _16BIT:
        raise NotImplementedError(f"{name} dtype {q.dtype} is not supported; supported: torch.float16, "
                                  "torch.bfloat16")


def _check_bools(**flags) -> None:
    """``TypeError`` naming the first of ``flags`` (name -> value) that is not a Python bool."""
    for name, value in flags.items():
        check_bool(name, value)


def _check_kv_dtype(k, q_dtype, *, fp8_unserved_in: str | None = None) -> None:
    """The cache's dtype must be q's or torch.float8_e4m3fn (NotImplementedError for fp8 in the entry point
    ``fp8_unserved_in`` names, for NVFP4; ValueError otherwise)."""
    if k.dtype == q_dtype:
        return
    if k.dtype == FP8:
        if fp8_unserved_in is None:
            return
        raise NotImplementedError(f"a torch.float8_e4m3fn KV cache in {fp8_unserved_in} is not supported (served "
                                  "there: the query's dtype); trtllm_batch_decode_with_kv_cache and xqa serve fp8 "
                                  "KV caches")
    if k.dtype == torch.uint8:
        raise NotImplementedError("a uint8 (NVFP4) KV cache is not supported; served: the query's dtype and "
                                  "torch.float8_e4m3fn")
    raise ValueError(f"the KV cache dtype ({k.dtype}) must be the query's ({q_dtype}) or torch.float8_e4m3fn")


def _host_lens(name: str, t, batch: int | None) -> torch.Tensor:
    """An integer length tensor ``[B]`` (any device, uint32 allowed) as host int32, checked >= 0."""
    check_tensor(name, t)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    if t.dim() != 1 or (batch is not None and t.shape[0] != batch):
        raise ValueError(f"{name} must have shape [{'batch_size' if batch is None else batch}], "
                         f"got {tuple(t.shape)}")
    h = t.to("cpu").to(torch.int64)
    if (h < 0).any() or (h > 2**31 - 1).any():
        raise ValueError(f"{name} must be in [0, 2**31 - 1]")
    return h.to(torch.int32)


def _check_page_table(name: str, table: torch.Tensor, kv_lens: torch.Tensor, page_size: int) -> None:
    """``name`` (a 2-D table whose rows are checked by the caller) int32 and wide enough for ``kv_lens`` at
    ``page_size``: the planned wrapper's rules, checked here in the entry point's names before the device check."""
    if table.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {table.dtype}")
    check_table_width(name, table, kv_lens, page_size)


def _check_outputs(out, lse, shape, dtype) -> None:
    """``out`` (``shape``, ``dtype``) and ``lse`` (fp32 ``shape[:2]``) when given: the planned wrapper's run()
    rules, checked here before the device check so that a wrong shape or dtype is reported as such."""
    if out is not None:
        check_tensor("out", out, shape=shape, dtype=dtype)
    if lse is not None:
        check_tensor("lse", lse, shape=tuple(shape[:2]), dtype=torch.float32)


def _check_sinks(sinks, hq: int, device):
    if sinks is None:
        return None
    check_tensor("sinks", sinks)
    if sinks.dtype != torch.float32:
        raise ValueError(f"sinks must be float32, got {sinks.dtype}")
    if sinks.numel() != hq:
        raise ValueError(f"sinks must hold one value per query head ({hq}), got shape {tuple(sinks.shape)}")
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device}, expected {device}")
    return sinks.reshape(hq) if sinks.is_contiguous() else sinks.reshape(hq).contiguous()


def _check_out_dtype(out_dtype, out, q_dtype):
    """The output dtype (``out_dtype``, else ``out``'s, else q's): it must be q's (no conversion is fused)."""
    if isinstance(out_dtype, str) and out_dtype.lower() == "nvfp4":
        raise NotImplementedError("out_dtype='nvfp4' (NVFP4 output) is not supported; served: the query's dtype")
    dt = canonical_dtype("out_dtype", out_dtype)
    if dt is None:
        dt = out.dtype if isinstance(out, torch.Tensor) else q_dtype
    if dt != q_dtype:
        raise NotImplementedError(f"output dtype {dt} is not supported with a {q_dtype} query; the output has the "
                                  "query's dtype")
    return dt


def _unpack_spec_mask(mask, batch: int, q_len: int, kv_lens: torch.Tensor) -> torch.Tensor:
    """xqa's bit-packed uint16 ``[B, q_len, ceil(q_len/32)*2]`` draft mask (bit ``j`` of row ``i``, little-endian
    32-bit words: draft row ``i`` sees draft token ``j``) as the prefill wrapper's flat bool ``custom_mask``:
    each request's ``[q_len, kv_len]`` rows, every key before the draft tokens visible."""
    words16 = -(-q_len // 32) * 2
    check_tensor("mask", mask, shape=(batch, q_len, words16))
    if mask.dtype not in (torch.uint16, torch.int16):
        raise ValueError(f"mask must be torch.uint16 (bit-packed), got {mask.dtype}")
    m = mask.to("cpu").view(torch.int16).to(torch.int64) & 0xFFFF
    words = m[..., 0::2] | (m[..., 1::2] << 16)  # [B, q_len, ceil(q_len/32)]
    j = torch.arange(q_len)
    bits = ((words[..., j // 32] >> (j % 32)) & 1).bool()  # [B, q_len(row), q_len(draft col)]
    parts = []
    for b in range(batch):
        L = int(kv_lens[b])
        row = torch.ones(q_len, L, dtype=torch.bool)
        row[:, L - q_len:] = bits[b]
        parts.append(row.reshape(-1))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)


def _counter_buffer(buf, device) -> None:
    """``multi_ctas_kv_counter_buffer``: None or a tensor on ``device`` (trtllm-gen's counters; unused here)."""
    if buf is not None:
        check_tensor("multi_ctas_kv_counter_buffer", buf, device=device)


def _cache_entries(name: str, cache):
    """``(name, tensor)`` pairs of a cache given as one tensor or a ``(k, v)`` tuple, for :func:`check_devices`."""
    if isinstance(cache, (tuple, list)):
        return [(f"{name}[{i}]", t) for i, t in enumerate(cache)]
    return [(name, cache)]


def _workspace(workspace_buffer, name: str = "workspace_buffer") -> torch.Tensor:
    check_tensor(name, workspace_buffer)
    return workspace_buffer.view(torch.uint8).reshape(-1)


# ----------------------------------------------------------------------------- one planned launch
def _run_paged(q, k, v, *, kv_layout, block_tables, kv_lens, q_lens, page_size, sm_scale, output_scale, window_left,
               sinks, out, lse, return_lse, workspace, where, custom_mask=None):
    """Plan and run one batch on the decode kernel (one query row per request, no mask) or on the paged prefill
    kernel (bottom-right causal rows, or a custom mask); ``q_lens``: host int32 ``[B]`` rows per request.  Both
    read a cache of q's dtype or torch.float8_e4m3fn.  ``where``: the entry point a host launch's error names."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[2] if kv_layout == "NHD" else k.shape[1]
    cache = (k, v)
    if custom_mask is None and bool((q_lens == 1).all()):
        w = BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout, use_tensor_cores=True, backend="cute")
        w._launch_entry = where
        w.plan(None, None, None, hq, hkv, d, page_size, window_left=window_left, q_data_type=q.dtype,
               kv_data_type=k.dtype, sm_scale=sm_scale, block_tables=block_tables, seq_lens=kv_lens)
        return w.run(q, cache, v_scale=output_scale, out=out, lse=lse, return_lse=return_lse, sinks=sinks)
    qo_indptr = torch.zeros(q_lens.numel() + 1, dtype=torch.int32)
    qo_indptr[1:] = torch.cumsum(q_lens, 0)
    w = MultiRowDecodePrefillWrapper(workspace, kv_layout, backend="cute")
    w._launch_entry = where
    w.plan(qo_indptr, None, None, None, hq, hkv, d, page_size, custom_mask=custom_mask, causal=custom_mask is None,
           sm_scale=sm_scale, window_left=window_left, q_data_type=q.dtype, kv_data_type=k.dtype,
           block_tables=block_tables, seq_lens=kv_lens)
    return w.run(q, cache, v_scale=output_scale, out=out, lse=lse, return_lse=return_lse, sinks=sinks)


# ----------------------------------------------------------------------------- trtllm decode
def trtllm_batch_decode_with_kv_cache(
    query, kv_cache, workspace_buffer, block_tables, seq_lens, max_seq_len, bmm1_scale=1.0, bmm2_scale=1.0,
    window_left=-1, out=None, out_dtype=None, o_sf_scale=None, o_sf_vec_size=None, sinks=None, kv_layout="HND",
    enable_pdl=None, backend="auto", q_len_per_req=1, o_scale=1.0, mask=None, max_q_len=None, cum_seq_lens_q=None,
    skip_softmax_threshold_scale_factor=None, kv_cache_sf=None, uses_shared_paged_kv_idx=True, lse=None,
    return_lse=False, bmm1_scale_log2=None, multi_ctas_kv_counter_buffer=None,
    enable_block_sparse_attention=False, cp_world=1, cp_rank=0, causal_seqlens_kv_global=None,
    bf16q_fp8kv_transform_mode=None, request_order=None, request_order_plan=None,
):
    """Paged decode with TensorRT-LLM's fused scales (FlashInfer's ``flashinfer.decode`` function).

    Args:
      query: ``[B * q_len_per_req, Hq, D]`` fp16/bf16 (rows of a request consecutive), last dim contiguous; or
        ragged ``[cum_seq_lens_q[-1], Hq, D]`` with ``cum_seq_lens_q`` / ``max_q_len`` and ``q_len_per_req=None``.
      kv_cache: ``(k_cache, v_cache)`` each ``[pages, Hkv, page_size, D]`` (HND) / ``[pages, page_size, Hkv, D]``
        (NHD), or one 5-D ``[pages, 1 or 2, ...]`` tensor (1: K and V share storage); any strides with a
        contiguous last dim; q's dtype or torch.float8_e4m3fn (strides multiples of 16 elements).
      workspace_buffer: uint8 on the device; holds the split-KV partials (``ValueError`` if too small).
      block_tables: int32 ``[B, max_pages]``; seq_lens: ``[B]`` KV lengths (int32 or uint32, any device).
      max_seq_len: >= every ``seq_lens`` (``ValueError`` otherwise).
      bmm1_scale: the softmax scale ``q_scale * k_scale * sm_scale`` (default 1.0: no ``1/sqrt(D)``), > 0.
      bmm2_scale: the output factor ``v_scale / o_scale``, applied in fp32 before the rounding.
        Both: floats or one-element tensors (read on the host).
      window_left: inclusive left window (``w`` keeps ``w+1`` keys), -1 disables.
      out: optional ``[num_tokens, Hq, D]`` in the output dtype; out_dtype: None or q's dtype.
      sinks: optional fp32 ``[Hq]`` natural-log sink logits.
      kv_layout: ``"HND"`` (default) or ``"NHD"``.
      backend: ``"auto"``, ``"xqa"`` or ``"trtllm-gen"``: all run this package's kernels with trtllm-gen's scale
        semantics above (FlashInfer's xqa route, ``auto`` on SM90, folds ``bmm2_scale`` into the logits for a 16-bit
        cache: the two agree only when ``bmm2_scale == 1`` there).
      q_len_per_req: rows per request; > 1 is bottom-right causal (every seq_len >= q_len_per_req) and runs the
        prefill kernel.  mask: xqa's bit-packed uint16 draft mask ``[B, q_len, ceil(q_len/32)*2]`` for those rows
        (see :func:`xqa`), replacing the causal draft block; None: causal.  Ignored for one row per request (as
        FlashInfer).  FlashInfer uses ``mask`` on its xqa route only (``backend="xqa"``, and ``"auto"`` on SM90):
        its trtllm-gen kernel ignores it and runs the rows bottom-right causal.  Here ``"auto"`` and ``"xqa"``
        honour it on every arch (FlashInfer's ``"auto"`` on SM100 is trtllm-gen, which would not), and
        ``backend="trtllm-gen"`` with a mask and several rows raises NotImplementedError rather than answer
        differently from FlashInfer's trtllm-gen (pass ``mask=None`` for its causal rows).
      o_scale: must be 1.0 (it scales an fp8 output, not served).
      lse: optional fp32 ``[num_tokens, Hq]`` (written, base 2); return_lse: also return it.
      multi_ctas_kv_counter_buffer: None or a tensor on the query's device (``TypeError`` / ``ValueError``
        otherwise, as FlashInfer documents it); accepted and unused: the split-KV merge keeps its own counters.

    Returns:
      ``out``, or ``(out, lse)`` when ``return_lse``.

    Raises:
      TypeError / ValueError: malformed arguments (each message names it), before any launch; the tensors the
        kernel reads or writes not on one CUDA device, before any planning (a wrong shape or dtype is reported
        first, whatever the device).
      RuntimeError: called inside a CUDA-graph capture (the host planning cannot be captured).
      KeyError: unknown ``backend`` or ``kv_layout`` (as FlashInfer).
      NotImplementedError: NVFP4 output (``out_dtype="nvfp4"``, ``o_sf_scale``, ``o_sf_vec_size``) or KV
        (``kv_cache_sf``), ``o_scale != 1``, ``enable_pdl=True``, ``skip_softmax_threshold_scale_factor``,
        ``uses_shared_paged_kv_idx=False``, ``bmm1_scale_log2``, block-sparse attention, context-parallel decode
        (``cp_world``, ``causal_seqlens_kv_global``), ``bf16q_fp8kv_transform_mode``, ``request_order`` /
        ``request_order_plan``, other dtypes, ``mask`` with ragged queries, ``mask`` with several rows per
        request and ``backend="trtllm-gen"``.
    """
    _not_capturing("trtllm_batch_decode_with_kv_cache")
    _check_bools(uses_shared_paged_kv_idx=uses_shared_paged_kv_idx, return_lse=return_lse,
                 enable_block_sparse_attention=enable_block_sparse_attention)
    check_optional_bool("enable_pdl", enable_pdl)
    if backend not in TRTLLM_DECODE_BACKENDS:
        raise KeyError(f"Backend {backend} not supported; supported: {TRTLLM_DECODE_BACKENDS}")
    check_kv_layout(kv_layout)
    _unserved(**{
        "o_sf_scale (NVFP4 output)": o_sf_scale is not None, "o_sf_vec_size (NVFP4 output)": o_sf_vec_size is not None,
        "kv_cache_sf (NVFP4 KV cache)": kv_cache_sf is not None, "enable_pdl=True (PDL)": bool(enable_pdl),
        "skip_softmax_threshold_scale_factor (skip-softmax)": skip_softmax_threshold_scale_factor is not None,
        "uses_shared_paged_kv_idx=False (separate K/V page tables)": uses_shared_paged_kv_idx is False,
        "bmm1_scale_log2 (pass bmm1_scale)": bmm1_scale_log2 is not None,
        "enable_block_sparse_attention=True (block-sparse attention)": bool(enable_block_sparse_attention),
        "cp_world != 1 (context-parallel decode)": cp_world != 1,
        "causal_seqlens_kv_global (context-parallel decode)": causal_seqlens_kv_global is not None,
        "bf16q_fp8kv_transform_mode": bf16q_fp8kv_transform_mode is not None,
        "request_order": request_order is not None, "request_order_plan": request_order_plan is not None,
    })
    if cp_rank != 0:
        raise ValueError(f"cp_rank must be 0 with cp_world=1, got {cp_rank!r}")
    _check_query("query", query, ndim=3)
    # the tensors the kernel reads and writes (seq_lens / cum_seq_lens_q may be on the host: planning reads them):
    # one device now, CUDA once the shapes and dtypes are checked
    devices = [("query", query), *_cache_entries("kv_cache", kv_cache), ("workspace_buffer", workspace_buffer),
               ("block_tables", block_tables), ("out", out), ("lse", lse), ("sinks", sinks),
               ("multi_ctas_kv_counter_buffer", multi_ctas_kv_counter_buffer)]
    check_one_device("trtllm_batch_decode_with_kv_cache", devices)
    if _scalar("o_scale", 1.0 if o_scale is None else o_scale, positive=True) != 1.0:
        raise NotImplementedError("o_scale != 1.0 is not supported: it scales an fp8 output (not served); fold "
                                  "1/o_scale into bmm2_scale")
    sm_scale = _scalar("bmm1_scale", bmm1_scale, positive=True)
    output_scale = _scalar("bmm2_scale", bmm2_scale, positive=False)
    k, v, page_size, hkv, d = _split_kv_cache(kv_cache, kv_layout)
    check_tensor("block_tables", block_tables, ndim=2)
    B = block_tables.shape[0]
    kv_lens = _host_lens("seq_lens", seq_lens, B)
    max_seq_len = check_int("max_seq_len", max_seq_len, 0)
    if B and int(kv_lens.max()) > max_seq_len:
        raise ValueError(f"max_seq_len ({max_seq_len}) is below the longest seq_lens ({int(kv_lens.max())})")
    _check_page_table("block_tables", block_tables, kv_lens, page_size)
    n, hq = query.shape[0], query.shape[1]
    if query.shape[2] != d:
        raise ValueError(f"query head_dim {query.shape[2]} != the KV cache's {d}")
    check_head_dim(d)
    check_heads(hq, hkv)
    if cum_seq_lens_q is not None or max_q_len is not None:
        if cum_seq_lens_q is None or max_q_len is None:
            raise ValueError("cum_seq_lens_q and max_q_len must be given together")
        if q_len_per_req not in (None, 1):
            raise ValueError("ragged queries (cum_seq_lens_q) need q_len_per_req=None")
        cq = _host_lens("cum_seq_lens_q", cum_seq_lens_q, B + 1)
        q_lens = cq[1:] - cq[:-1]
        if int(cq[0]) != 0 or (q_lens < 0).any() or int(cq[-1]) != n:
            raise ValueError(f"cum_seq_lens_q must start at 0, be non-decreasing and end at query.shape[0] = {n}")
        max_q_len = check_int("max_q_len", max_q_len, 1)
        if B and int(q_lens.max()) > max_q_len:
            raise ValueError(f"max_q_len ({max_q_len}) is below the longest query ({int(q_lens.max())})")
        q_len = None
    else:
        q_len = check_int("q_len_per_req", q_len_per_req, 1)
        if n != B * q_len:
            raise ValueError(f"query must have batch_size * q_len_per_req = {B} * {q_len} rows, got {n}")
        q_lens = torch.full((B,), q_len, dtype=torch.int32)
    short = (kv_lens < q_lens) & (q_lens > 1)  # one row per request may see an empty KV (O = 0)
    if short.any():
        b = int(short.nonzero()[0])
        raise ValueError(f"every seq_lens must be >= its query rows; request {b} has {int(kv_lens[b])} keys for "
                         f"{int(q_lens[b])} rows")
    multirow = bool((q_lens != 1).any())
    _check_kv_dtype(k, query.dtype)
    _check_out_dtype(out_dtype, out, query.dtype)
    _check_outputs(out, lse, tuple(query.shape), query.dtype)
    sinks = _check_sinks(sinks, hq, query.device)
    _counter_buffer(multi_ctas_kv_counter_buffer, query.device)
    workspace = _workspace(workspace_buffer)
    custom_mask = None
    if mask is not None and multirow:
        if q_len is None:
            raise NotImplementedError("mask with ragged queries (cum_seq_lens_q) is not supported")
        if backend == "trtllm-gen":
            raise NotImplementedError(
                "mask with q_len_per_req > 1 and backend='trtllm-gen' is not supported: FlashInfer's trtllm-gen "
                "ignores mask (its rows are bottom-right causal) and this package would apply it, a different "
                "answer; pass mask=None for trtllm-gen's causal rows, or backend='xqa' / 'auto' for xqa's draft mask")
        custom_mask = _unpack_spec_mask(mask, B, q_len, kv_lens)
    check_devices("trtllm_batch_decode_with_kv_cache", devices)
    return _run_paged(query, k, v, kv_layout=kv_layout, block_tables=block_tables, kv_lens=kv_lens, q_lens=q_lens,
                      page_size=page_size, sm_scale=sm_scale, output_scale=output_scale, window_left=window_left,
                      sinks=sinks, out=out, lse=lse, return_lse=return_lse, workspace=workspace,
                      where="trtllm_batch_decode_with_kv_cache", custom_mask=custom_mask)


# ----------------------------------------------------------------------------- xqa
def xqa(q, k_cache, v_cache, page_table, seq_lens, output, workspace_buffer, semaphores, num_kv_heads, page_size,
        sinks=None, q_scale=1.0, kv_scale=1.0, sliding_win_size=0, kv_layout="NHD", sm_count=None, enable_pdl=None,
        rcp_out_scale=1.0, q_seq_len=1, mask=None, *, q_cu_seq_lens=None, k_sf_cache=None, v_sf_cache=None):
    """XQA paged decode, in place (FlashInfer's ``flashinfer.xqa``; returns None).

    Args:
      q: ``[B, 1, Hq, D]`` or, for speculative decoding (``q_seq_len > 1``), ``[B, 1, q_seq_len, Hq, D]``; fp16/bf16.
      k_cache, v_cache: ``[pages, page_size, Hkv, D]`` (NHD, the default) or ``[pages, Hkv, page_size, D]`` (HND);
        q's dtype or torch.float8_e4m3fn (also with ``q_seq_len > 1``).
      page_table: int32 ``[B, pages_per_seq]``; seq_lens: ``[B, 1]`` (uint32 or int32) KV lengths.
      output: like q (same shape and dtype), written in place.
      workspace_buffer: uint8 on the device (holds the split-KV partials); semaphores: accepted, unused.
      num_kv_heads, page_size: must match the caches; page_size in {16, 32, 64, 128}.
      sinks: optional fp32 ``[Hkv, Hq / Hkv]`` natural-log sink logits.
      q_scale, kv_scale: softmax scale ``q_scale * (kv_scale if the cache is fp8 else 1) / sqrt(D)``; an fp8 cache's
        output is multiplied by ``kv_scale`` (fp32, before the rounding).  Floats or one-element tensors.
      sliding_win_size: keys kept, the current one included (0: no window); not with ``q_seq_len > 1``.
      kv_layout: ``"NHD"`` or ``"HND"``.  sm_count: accepted, unused.  rcp_out_scale: ignored (16-bit output).
      q_seq_len: draft rows per request; > 1 needs ``mask``: uint16 ``[B, q_seq_len, ceil(q_seq_len/32)*2]``,
        bit-packed little-endian 32-bit words, bit ``j`` of row ``i`` set when draft row ``i`` sees draft token
        ``j`` (the last ``q_seq_len`` keys); every earlier key is visible.  Served on the prefill kernel.

    Raises:
      TypeError / ValueError: malformed arguments (each message names it), before any launch; the tensors the
        kernel reads or writes not on one CUDA device, before any planning (a wrong shape or dtype is reported
        first, whatever the device).
      RuntimeError: called inside a CUDA-graph capture.  KeyError: bad ``kv_layout``.
      NotImplementedError: beam width > 1, ragged ``q_cu_seq_lens``, NVFP4 KV (``k_sf_cache`` / ``v_sf_cache``),
        ``enable_pdl=True``, fp8 output, a sliding window with ``q_seq_len > 1``, other dtypes.
    """
    _not_capturing("xqa")
    check_optional_bool("enable_pdl", enable_pdl)
    check_kv_layout(kv_layout)
    _unserved(**{"q_cu_seq_lens (ragged speculative decoding)": q_cu_seq_lens is not None,
                 "k_sf_cache / v_sf_cache (NVFP4 KV cache)": k_sf_cache is not None or v_sf_cache is not None,
                 "enable_pdl=True (PDL)": bool(enable_pdl)})
    q_seq_len = check_int("q_seq_len", q_seq_len, 1)
    _check_query("q", q, ndim=4 if q_seq_len == 1 else 5)
    devices = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("page_table", page_table), ("output", output),
               ("workspace_buffer", workspace_buffer), ("semaphores", semaphores), ("sinks", sinks)]
    check_one_device("xqa", devices)  # CUDA once the shapes and dtypes are checked
    if q.shape[1] != 1:
        raise NotImplementedError(f"beam width {q.shape[1]} is not supported; supported: 1")
    if q_seq_len > 1 and q.shape[2] != q_seq_len:
        raise ValueError(f"q must have shape [B, 1, q_seq_len={q_seq_len}, Hq, D], got {tuple(q.shape)}")
    check_tensor("output", output, shape=q.shape)
    if output.dtype != q.dtype:
        if output.dtype == FP8:
            raise NotImplementedError("an fp8 output is not supported; the output has the query's dtype")
        raise ValueError(f"output dtype ({output.dtype}) must be q's ({q.dtype})")
    if sm_count is not None:
        check_int("sm_count", sm_count, 1)
    check_tensor("semaphores", semaphores)
    _scalar("rcp_out_scale", rcp_out_scale, positive=True)
    k, v, ps, hkv, d = _split_kv_cache((k_cache, v_cache), kv_layout)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, 1)
    page_size = check_int("page_size", page_size, 1)
    if page_size not in XQA_PAGE_SIZES:
        raise ValueError(f"page_size must be one of {XQA_PAGE_SIZES}, got {page_size}")
    if (ps, hkv) != (page_size, num_kv_heads):
        raise ValueError(f"the caches ({kv_layout}, shape {tuple(k.shape)}) have page_size {ps} and {hkv} kv heads; "
                         f"page_size={page_size}, num_kv_heads={num_kv_heads} were given")
    B, hq = q.shape[0], q.shape[-2]
    if q.shape[-1] != d:
        raise ValueError(f"q head_dim {q.shape[-1]} != the caches' {d}")
    if hq % hkv:
        raise ValueError(f"the query heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    check_head_dim(d)
    check_heads(hq, hkv)
    _check_kv_dtype(k, q.dtype)
    fp8 = k.dtype == FP8
    check_tensor("page_table", page_table, ndim=2)
    if page_table.shape[0] != B:
        raise ValueError(f"page_table must have B = {B} rows, got {page_table.shape[0]}")
    check_tensor("seq_lens", seq_lens)
    if seq_lens.shape not in ((B, 1), (B,)):
        raise ValueError(f"seq_lens must have shape [B, beam_width] = [{B}, 1], got {tuple(seq_lens.shape)}")
    kv_lens = _host_lens("seq_lens", seq_lens.reshape(-1), B)
    _check_page_table("page_table", page_table, kv_lens, page_size)
    if sinks is not None:
        check_tensor("sinks", sinks, shape=(hkv, hq // hkv))
    sinks = _check_sinks(sinks, hq, q.device)
    sliding_win_size = check_int("sliding_win_size", sliding_win_size, 0)
    qs = _scalar("q_scale", q_scale, positive=True)
    kvs = _scalar("kv_scale", kv_scale, positive=True)
    sm_scale = qs * (kvs if fp8 else 1.0) / math.sqrt(d)
    output_scale = kvs if fp8 else 1.0
    custom_mask = None
    if q_seq_len > 1:
        if mask is None:
            raise ValueError("mask is required when q_seq_len > 1 (speculative decoding)")
        if sliding_win_size:
            raise NotImplementedError("sliding_win_size with q_seq_len > 1 is not supported")
        if B and (kv_lens < q_seq_len).any():
            raise ValueError(f"every seq_lens must be >= q_seq_len ({q_seq_len})")
        custom_mask = _unpack_spec_mask(mask, B, q_seq_len, kv_lens)
    workspace = _workspace(workspace_buffer)
    check_devices("xqa", devices)
    q3 = q.reshape(B * q_seq_len, hq, d)
    o3 = output.view(B * q_seq_len, hq, d) if output.is_contiguous() else None
    res = _run_paged(q3, k, v, kv_layout=kv_layout, block_tables=page_table, kv_lens=kv_lens,
                     q_lens=torch.full((B,), q_seq_len, dtype=torch.int32), page_size=page_size, sm_scale=sm_scale,
                     output_scale=output_scale, window_left=sliding_win_size - 1, sinks=sinks, out=o3, lse=None,
                     return_lse=False, workspace=workspace, where="xqa", custom_mask=custom_mask)
    if o3 is None:  # a strided output: the kernel wrote a contiguous copy (rounded and scaled already)
        output.copy_(res.view(output.shape))
    return None


# ----------------------------------------------------------------------------- trtllm context
def trtllm_batch_context_with_kv_cache(
    query, kv_cache, workspace_buffer, block_tables, seq_lens, max_q_len, max_kv_len, bmm1_scale, bmm2_scale,
    batch_size, cum_seq_lens_q, cum_seq_lens_kv, window_left=-1, out=None, out_dtype=None, o_sf_scale=None,
    o_sf_vec_size=None, kv_layout="HND", enable_pdl=None, sinks=None, kv_cache_sf=None,
    skip_softmax_threshold_scale_factor=None, uses_shared_paged_kv_idx=True, causal=True, lse=None, return_lse=False,
    multi_ctas_kv_counter_buffer=None, use_fp16_softmax=None, uses_spcompress=None, backend="trtllm-gen",
):
    """Ragged-query prefill over a paged KV cache with fused scales (FlashInfer's ``flashinfer.prefill`` function),
    on this package's paged prefill kernel (FlashInfer has no Hopper kernel for it).

    Args:
      query: ``[cum_seq_lens_q[-1], Hq, D]`` fp16/bf16, last dim contiguous.
      kv_cache: as :func:`trtllm_batch_decode_with_kv_cache` (16-bit, q's dtype).
      workspace_buffer: uint8 on the device (kept for compatibility).
      block_tables: int32 ``[batch_size, max_pages]``; seq_lens: ``[batch_size]`` KV lengths (new tokens included).
      max_q_len, max_kv_len: >= the longest query / KV.  batch_size: ``len(seq_lens)``.
      bmm1_scale, bmm2_scale: as :func:`trtllm_batch_decode_with_kv_cache` (softmax scale and fp32 output factor).
      cum_seq_lens_q, cum_seq_lens_kv: ``[batch_size + 1]`` prefix sums (tokens); ``cum_seq_lens_kv`` must agree
        with ``seq_lens``.
      window_left: inclusive left window (needs ``causal``).  causal: bottom-right (default True).
      out, out_dtype, sinks, lse, return_lse: as :func:`trtllm_batch_decode_with_kv_cache`.
      backend: ``"trtllm-gen"`` or ``"cake"`` (both this package's kernel).
      multi_ctas_kv_counter_buffer: None or a tensor on the query's device; accepted and unused (no split-KV).

    Returns:
      ``out``, or ``(out, lse)`` when ``return_lse``.

    Raises:
      TypeError / ValueError: malformed arguments (each message names it), other ``backend`` names, the tensors
        the kernel reads or writes not on one CUDA device (before any planning, after the shape and dtype checks).
      RuntimeError: called inside a CUDA-graph capture.  KeyError: bad ``kv_layout``.
      NotImplementedError: ``window_left >= 0`` with ``causal=False``, NVFP4 output / KV, ``enable_pdl=True``,
        skip-softmax, separate K/V page tables, ``use_fp16_softmax``, ``uses_spcompress``, an fp8 KV cache.
    """
    _not_capturing("trtllm_batch_context_with_kv_cache")
    _check_bools(uses_shared_paged_kv_idx=uses_shared_paged_kv_idx, causal=causal, return_lse=return_lse)
    for n, x in (("enable_pdl", enable_pdl), ("use_fp16_softmax", use_fp16_softmax),
                 ("uses_spcompress", uses_spcompress)):
        check_optional_bool(n, x)
    if backend not in TRTLLM_CONTEXT_BACKENDS:
        raise ValueError(f"backend must be one of {TRTLLM_CONTEXT_BACKENDS}, got {backend!r}")
    check_kv_layout(kv_layout)
    _unserved(**{
        "o_sf_scale (NVFP4 output)": o_sf_scale is not None, "o_sf_vec_size (NVFP4 output)": o_sf_vec_size is not None,
        "kv_cache_sf (NVFP4 KV cache)": kv_cache_sf is not None, "enable_pdl=True (PDL)": bool(enable_pdl),
        "skip_softmax_threshold_scale_factor (skip-softmax)": skip_softmax_threshold_scale_factor is not None,
        "uses_shared_paged_kv_idx=False (separate K/V page tables)": uses_shared_paged_kv_idx is False,
        "use_fp16_softmax=True": bool(use_fp16_softmax), "uses_spcompress=True": bool(uses_spcompress),
    })
    if not causal and window_left is not None and not isinstance(window_left, bool) and window_left >= 0:
        raise NotImplementedError("window_left >= 0 with causal=False is not supported")
    _check_query("query", query, ndim=3)
    devices = [("query", query), *_cache_entries("kv_cache", kv_cache), ("workspace_buffer", workspace_buffer),
               ("block_tables", block_tables), ("out", out), ("lse", lse), ("sinks", sinks),
               ("multi_ctas_kv_counter_buffer", multi_ctas_kv_counter_buffer)]
    check_one_device("trtllm_batch_context_with_kv_cache", devices)  # CUDA once the shapes and dtypes are checked
    sm_scale = _scalar("bmm1_scale", bmm1_scale, positive=True)
    output_scale = _scalar("bmm2_scale", bmm2_scale, positive=False)
    k, v, page_size, hkv, d = _split_kv_cache(kv_cache, kv_layout)
    batch_size = check_int("batch_size", batch_size, 0)
    check_tensor("block_tables", block_tables, ndim=2)
    if block_tables.shape[0] != batch_size:
        raise ValueError(f"block_tables must have batch_size = {batch_size} rows, got {block_tables.shape[0]}")
    kv_lens = _host_lens("seq_lens", seq_lens, batch_size)
    cq = _host_lens("cum_seq_lens_q", cum_seq_lens_q, batch_size + 1)
    ckv = _host_lens("cum_seq_lens_kv", cum_seq_lens_kv, batch_size + 1)
    q_lens = cq[1:] - cq[:-1]
    if int(cq[0]) != 0 or (q_lens < 0).any() or int(cq[-1]) != query.shape[0]:
        raise ValueError("cum_seq_lens_q must start at 0, be non-decreasing and end at query.shape[0] = "
                         f"{query.shape[0]}")
    if int(ckv[0]) != 0 or not torch.equal(ckv[1:] - ckv[:-1], kv_lens):
        raise ValueError(f"cum_seq_lens_kv {ckv.tolist()} must be the prefix sums of seq_lens {kv_lens.tolist()}")
    if query.shape[2] != d:
        raise ValueError(f"query head_dim {query.shape[2]} != the KV cache's {d}")
    _check_page_table("block_tables", block_tables, kv_lens, page_size)
    check_head_dim(d)
    check_heads(query.shape[1], hkv)
    for name, hint, lens in (("max_q_len", max_q_len, q_lens), ("max_kv_len", max_kv_len, kv_lens)):
        hint = check_int(name, hint, 0)
        if batch_size and int(lens.max()) > hint:
            raise ValueError(f"{name} ({hint}) is below the longest length ({int(lens.max())})")
    _check_kv_dtype(k, query.dtype, fp8_unserved_in="trtllm_batch_context_with_kv_cache")
    _check_out_dtype(out_dtype, out, query.dtype)
    _check_outputs(out, lse, tuple(query.shape), query.dtype)
    sinks = _check_sinks(sinks, query.shape[1], query.device)
    _counter_buffer(multi_ctas_kv_counter_buffer, query.device)
    workspace = _workspace(workspace_buffer)
    check_devices("trtllm_batch_context_with_kv_cache", devices)
    qo_indptr = cq
    hq = query.shape[1]
    w = BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout, backend="cute")
    w._launch_entry = "trtllm_batch_context_with_kv_cache"
    w.plan(qo_indptr, None, None, None, hq, hkv, d, page_size, causal=causal, sm_scale=sm_scale,
           window_left=window_left, q_data_type=query.dtype, kv_data_type=k.dtype, block_tables=block_tables,
           seq_lens=kv_lens)
    return w.run(query, (k, v), v_scale=output_scale, out=out, lse=lse, return_lse=return_lse, sinks=sinks)
