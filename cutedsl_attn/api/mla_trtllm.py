"""FlashInfer's one-call MLA decode entry points: ``trtllm_batch_decode_with_kv_cache_mla`` and ``xqa_mla``.

``trtllm_batch_decode_with_kv_cache_mla`` takes the TRT-LLM layout: query ``[B, q_len, H, 576]`` (``q_nope``
then ``q_pe`` in one row), one combined cache ``[pages, page_size, 576]`` (``ckv`` = first 512 columns, ``kpe``
= last 64 of the same rows), a dense block table and ``seq_lens``, and fused scales: ``bmm1_scale`` multiplies
the logits as given (``q_scale * k_scale * sm_scale``, no implicit ``1/sqrt(d)``), ``bmm2_scale`` multiplies
O in fp32 before the 16-bit rounding.  Multi-token rows (``q_len > 1``) are bottom-right causal.  It runs the
same portable CuTe DSL MLA kernel as ``BatchMLAPagedAttentionWrapper`` (on Hopper too, where FlashInfer routes
it to an SM120-only XQA path); the query and cache are passed as strided views, never copied.

Each call plans on the host (it reads ``seq_lens`` and the used part of ``block_tables`` to the CPU), so it
synchronises with the device and cannot be captured in a CUDA graph; capture
``BatchMLAPagedAttentionWrapper(use_cuda_graph=True)`` instead.
"""

from __future__ import annotations

import math

import torch

from ..common.constants import LN2 as _LN2
from ..dispatch import mla_choice, mla_launch, mla_limits, mla_problem, num_sms
from ..planning.mla import HEAD_DIM_CKV, HEAD_DIM_KPE, MlaArgs, plan_mla
from ._common import check_bool, check_int, check_last_dim_contiguous, check_optional_bool, check_tensor
from ._pagetable import from_block_tables

__all__ = ["trtllm_batch_decode_with_kv_cache_mla", "xqa_mla"]

_BACKENDS = ("auto", "cute")
_FLASHINFER_BACKENDS = ("trtllm-gen", "xqa", "cute-dsl", "sparse")
_DTYPES = (torch.bfloat16, torch.float16)
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
MAX_PAGE_SIZE = 64
_SERVED = ("served: bf16 (or fp16) query and cache of one dtype, kv_lora_rank 512, qk_rope_head_dim 64, "
           "page sizes 1..64")


def _check_backend(backend) -> None:
    if backend in _BACKENDS:
        return
    if backend in _FLASHINFER_BACKENDS:
        raise NotImplementedError(f"backend={backend!r} is not served; trtllm_batch_decode_with_kv_cache_mla "
                                  "backends here: 'auto', 'cute' (the CuTe DSL MLA kernel)")
    raise ValueError(f"backend must be one of {_BACKENDS + _FLASHINFER_BACKENDS}, got {backend!r}")


def _fused_scale(name: str, x) -> float:
    """A finite float, or a one-element float32 tensor (read to the host)."""
    if isinstance(x, torch.Tensor):
        if x.dtype != torch.float32:
            raise TypeError(f"{name} tensor must have dtype torch.float32, got {x.dtype}")
        if x.numel() != 1:
            raise ValueError(f"{name} tensor must hold one value, got shape {tuple(x.shape)}")
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a float or a one-element float32 tensor, got {type(x).__name__}")
    if not math.isfinite(float(x)):
        raise ValueError(f"{name} must be finite, got {x}")
    return float(x)


def _not_served(**options) -> None:
    """NotImplementedError for the first option not at its served value (name -> (value, served value))."""
    for name, (value, ok) in options.items():
        if (value is not None) if ok is None else (isinstance(value, torch.Tensor) or value != ok):
            raise NotImplementedError(f"{name}={value!r} is not supported (only {ok!r}); {_SERVED}")


def _flat_view(name: str, t: torch.Tensor, shape) -> torch.Tensor:
    try:
        return t.view(*shape)
    except RuntimeError:
        raise ValueError(f"{name} must have mergeable batch and q_len dims (viewable as {tuple(shape)} without a "
                         f"copy), got strides {t.stride()}") from None


def _prepare(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim, block_tables,
             seq_lens, max_seq_len, out, bmm1_scale, bmm2_scale, lse, return_lse, multi_ctas_kv_counter_buffer):
    """Validate, plan and build the launch: ``(module, cfg, args, out, lse_or_None, num_work)``."""
    qk_nope_head_dim = check_int("qk_nope_head_dim", qk_nope_head_dim, 1)  # folded into bmm1_scale by the caller
    kv_lora_rank = check_int("kv_lora_rank", kv_lora_rank, 1)
    qk_rope_head_dim = check_int("qk_rope_head_dim", qk_rope_head_dim, 1)
    if (kv_lora_rank, qk_rope_head_dim) != (HEAD_DIM_CKV, HEAD_DIM_KPE):
        raise NotImplementedError(
            f"kv_lora_rank={kv_lora_rank}, qk_rope_head_dim={qk_rope_head_dim} is not supported; MLA serves "
            f"kv_lora_rank={HEAD_DIM_CKV} with qk_rope_head_dim={HEAD_DIM_KPE} (DeepSeek V2/V3/R1)")
    d_qk = HEAD_DIM_CKV + HEAD_DIM_KPE
    check_tensor("query", query, ndim=4)
    check_tensor("kv_cache", kv_cache)
    dev = query.device
    if kv_cache.device != dev:
        raise ValueError(f"kv_cache is on {kv_cache.device}, query on {dev}")
    for name, t in (("query", query), ("kv_cache", kv_cache)):
        if t.dtype in _FP8:
            raise NotImplementedError(f"{name} dtype {t.dtype} (fp8 MLA) is not supported: the MLA kernel has no "
                                      f"fp8 path yet; {_SERVED}")
        if t.dtype not in _DTYPES:
            raise NotImplementedError(f"{name} dtype {t.dtype} is not supported; {_SERVED}")
    if query.dtype != kv_cache.dtype:
        raise NotImplementedError(f"query {query.dtype} with kv_cache {kv_cache.dtype} is not supported; {_SERVED}")
    dt = query.dtype
    B, q_len, H, dq = query.shape
    if dq != d_qk:
        raise ValueError(f"query's last dim must be kv_lora_rank + qk_rope_head_dim = {d_qk}, got {dq}")
    if q_len < 1 or H < 1:
        raise ValueError(f"query must be [batch_size, q_len >= 1, num_heads >= 1, {d_qk}], got {tuple(query.shape)}")
    if kv_cache.dim() == 4:
        if kv_cache.shape[1] != 1:
            raise ValueError(f"a 4-D kv_cache must be [num_pages, 1, page_size, {d_qk}], got {tuple(kv_cache.shape)}")
        kv_cache = kv_cache[:, 0]
    if kv_cache.dim() != 3 or kv_cache.shape[2] != d_qk:
        raise ValueError(f"kv_cache must be [num_pages, page_size, {d_qk}] or [num_pages, 1, page_size, {d_qk}], "
                         f"got {tuple(kv_cache.shape)}")
    num_pages, page_size = kv_cache.shape[0], kv_cache.shape[1]
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        raise NotImplementedError(f"page_size={page_size} is not supported; {_SERVED}")
    check_last_dim_contiguous("query", query)
    check_last_dim_contiguous("kv_cache", kv_cache)
    max_seq_len = check_int("max_seq_len", max_seq_len, 0)
    bmm1 = _fused_scale("bmm1_scale", bmm1_scale)
    bmm2 = _fused_scale("bmm2_scale", bmm2_scale)
    check_tensor("workspace_buffer", workspace_buffer, device=dev)
    if not workspace_buffer.is_contiguous() or workspace_buffer.data_ptr() % 16:
        raise ValueError("workspace_buffer must be contiguous and 16-byte aligned")

    # --- the page table, read on the host (this is what makes a call non-capturable)
    kv_lens, page_off, flat = from_block_tables(block_tables, seq_lens, page_size, dev, True, batch_size=B,
                                                batch_name="query.shape[0]")
    if B and int(kv_lens.max()) > max_seq_len:
        b = int(kv_lens.argmax())
        raise ValueError(f"seq_lens[{b}] = {int(kv_lens[b])} exceeds max_seq_len = {max_seq_len}")
    need = (kv_lens + page_size - 1) // page_size
    used = block_tables.to("cpu")[torch.arange(block_tables.shape[1]).view(1, -1) < need.view(-1, 1)]
    bad = used[(used < 0) | (used >= num_pages)]
    if bad.numel():
        raise ValueError(f"block_tables holds page id {int(bad[0])} for a used page, outside the cache's "
                         f"[0, {num_pages}) pages")

    T = B * q_len
    q = _flat_view("query", query, (T, H, d_qk))
    q_nope, q_pe = q[..., :HEAD_DIM_CKV], q[..., HEAD_DIM_CKV:]  # strided views: the kernel reads rows by stride
    ckv, kpe = kv_cache[..., :HEAD_DIM_CKV], kv_cache[..., HEAD_DIM_CKV:]
    out_shape = (B, q_len, H, HEAD_DIM_CKV)
    if out is None:
        out = torch.empty(out_shape, dtype=dt, device=dev)
    else:
        check_tensor("out", out, shape=out_shape, dtype=dt, device=dev)
        check_last_dim_contiguous("out", out)
    o = _flat_view("out", out, (T, H, HEAD_DIM_CKV))
    if lse is not None:
        if tuple(lse.shape) not in ((T, H), (B, q_len, H)):
            raise ValueError(f"lse must have shape {(T, H)} or {(B, q_len, H)}, got {tuple(lse.shape)}")
        check_tensor("lse", lse, dtype=torch.float32, device=dev)
        if not lse.is_contiguous():
            raise ValueError("lse must be contiguous")
    elif return_lse:
        lse = torch.empty((T, H), dtype=torch.float32, device=dev)
    lse_k = lse.view(T, H) if lse is not None else torch.empty((T, H), dtype=torch.float32, device=dev)

    if T == 0:
        return None, None, None, out, lse, 0
    causal = q_len > 1
    dev_index = dev.index if dev.type == "cuda" else None
    module, cfg = mla_choice(mla_problem(dtype=dt, page_size=page_size, causal=causal, device_index=dev_index),
                             device_index=dev_index)
    lim = mla_limits(module, cfg)
    wp = plan_mla(torch.full((B,), q_len, dtype=torch.int64), kv_lens, torch.arange(B, dtype=torch.int64) * q_len,
                  page_off, num_heads=H, page_size=page_size, num_sms=num_sms(dev_index),
                  ctas_per_sm=lim["ctas_per_sm"], max_splits_per_request=lim["max_splits_per_request"])
    n_part, R = max(1, wp.num_partials), wp.rows
    po_bytes = n_part * R * HEAD_DIM_CKV * 4
    off = (po_bytes + 255) // 256 * 256
    ws = workspace_buffer.reshape(-1).view(torch.uint8)
    if off + n_part * R * 4 > ws.numel():
        raise ValueError(f"workspace_buffer holds {ws.numel()} bytes, this call needs {off + n_part * R * 4} "
                         "(split-KV partials)")
    n_cnt = max(1, B * wp.row_tiles)
    if multi_ctas_kv_counter_buffer is None:
        counters = torch.zeros(n_cnt, dtype=torch.int32, device=dev)
    else:
        cb = multi_ctas_kv_counter_buffer
        check_tensor("multi_ctas_kv_counter_buffer", cb, device=dev)
        if not cb.is_contiguous() or cb.data_ptr() % 4 or cb.numel() * cb.element_size() < 4 * n_cnt:
            raise ValueError(f"multi_ctas_kv_counter_buffer must be contiguous, 4-byte aligned and hold at least "
                             f"{4 * n_cnt} bytes (zero-initialised once; the kernel leaves it zero)")
        counters = cb.reshape(-1).view(torch.uint8)[: 4 * n_cnt].view(torch.int32)
    part_o = ws[:po_bytes].view(torch.float32).view(n_part, R, HEAD_DIM_CKV)
    part_lse = ws[off: off + n_part * R * 4].view(torch.float32).view(n_part, R)
    work = wp.work.to(dev, non_blocking=True) if dev.type == "cuda" else wp.work
    args = MlaArgs(q_nope, q_pe, ckv, kpe, flat, work, o, lse_k, part_o, part_lse, counters, bmm1, wp.row_tiles,
                   output_scale=bmm2)
    return module, cfg, args, out, lse, wp.num_work


def _launch(module, cfg, args: MlaArgs) -> None:
    dev = args.q_nope.device
    if dev.type != "cuda":
        raise ValueError(f"query, kv_cache and the workspace must be CUDA tensors to launch, got {dev}")
    with torch.cuda.device(dev):
        mla_launch(module, cfg, args)


def trtllm_batch_decode_with_kv_cache_mla(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    workspace_buffer: torch.Tensor,
    qk_nope_head_dim: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    sparse_mla_top_k: int = 0,
    out: torch.Tensor | None = None,
    bmm1_scale: float | torch.Tensor = 1.0,
    bmm2_scale: float | torch.Tensor = 1.0,
    sinks=None,
    skip_softmax_threshold_scale_factor: float | None = None,
    enable_pdl: bool | None = None,
    backend: str = "auto",
    is_var_seq: bool = True,
    uses_shared_paged_kv_idx: bool = True,
    lse: torch.Tensor | None = None,
    return_lse: bool = False,
    cute_dsl_impl: str = "auto",
    kv_scale_format: str = "auto",
    cum_seq_lens_q: torch.Tensor | None = None,
    max_q_len: int | None = None,
    multi_ctas_kv_counter_buffer: torch.Tensor | None = None,
    sparse_mla_top_k_lens: torch.Tensor | None = None,
    enable_dcp: bool = False,
    cp_world: int = 1,
    cp_rank: int = 0,
    causal_seqlens_kv_global: torch.Tensor | None = None,
    use_fp16_softmax: bool | None = None,
    return_lse_base: str | None = None,
):
    """MLA decode over a combined paged latent cache (FlashInfer's signature; absorbed form).

    ``s = bmm1_scale * (q_nope . ckv_j + q_pe . kpe_j)``, ``o = bmm2_scale * softmax(s) . ckv``; query row ``i``
    of a request with ``q_len`` rows sees keys ``j <= i + seq_len - q_len`` (bottom-right causal); a request with
    ``seq_len`` 0 gives O = 0 and LSE = -inf.  Plans on the host per call: it synchronises and is not
    CUDA-graph capturable (use ``BatchMLAPagedAttentionWrapper(use_cuda_graph=True)`` for graphs).

    Args:
      query: ``[B, q_len, H, 576]`` bf16 (or fp16), ``q_nope`` then ``q_pe``; last dim contiguous, 16-byte
        aligned strides, ``B`` and ``q_len`` mergeable without a copy.
      kv_cache: ``[num_pages, page_size, 576]`` or ``[num_pages, 1, page_size, 576]``, query's dtype, ``ckv``
        then ``kpe`` in each row; last dim contiguous, 16-byte aligned strides; page_size 1..64.
      workspace_buffer: a tensor on query's device, contiguous, 16-byte aligned: the fp32 split-KV partials.
      qk_nope_head_dim: >= 1, not used (the caller folds it into ``bmm1_scale``).
      kv_lora_rank, qk_rope_head_dim: 512 and 64 (NotImplementedError otherwise).
      block_tables: int32 ``[B, max_pages]``: request ``b``'s pages in order (a host table is copied).
      seq_lens: integer ``[B]`` KV lengths, ``<= max_seq_len`` and ``<= max_pages * page_size``.
      max_seq_len: int >= 0.
      out: optional ``[B, q_len, H, 512]`` in query's dtype (written), last dim contiguous.
      bmm1_scale: the logit multiplier, taken as given; bmm2_scale: multiplies O in fp32 before rounding.
        Each a float or a one-element float32 tensor (read to the host).
      lse: optional float32 ``[B * q_len, H]`` or ``[B, q_len, H]`` contiguous, written.
      return_lse: also return the LSE (``lse``, or a new ``[B * q_len, H]`` tensor).
      return_lse_base: None or ``"base2"`` (base 2), ``"basee"`` (natural log).
      multi_ctas_kv_counter_buffer: optional zero-initialised contiguous buffer for the split-KV counters (left
        zero by the kernel); None: a fresh zeroed one per call.
      enable_pdl, is_var_seq: accepted, no effect.
      backend: ``"auto"`` or ``"cute"``; FlashInfer's other names raise NotImplementedError.
      sparse_mla_top_k (0), sinks, skip_softmax_threshold_scale_factor, uses_shared_paged_kv_idx (True),
      cute_dsl_impl / kv_scale_format ("auto"), cum_seq_lens_q, max_q_len, sparse_mla_top_k_lens, enable_dcp
      (False), cp_world (1), cp_rank (0), causal_seqlens_kv_global, use_fp16_softmax (None/False): only those
      values are served (NotImplementedError otherwise).

    Returns:
      ``out`` ``[B, q_len, H, 512]``, or ``(out, lse)`` when ``return_lse``.

    Raises:
      TypeError / ValueError: shapes, dtypes, devices, strides, page ids or lengths that disagree (the message
      names the argument and rule).  NotImplementedError: fp8 query or cache, other head dims, dtypes, page
      sizes, backends or options (the message says what is served).  All raised before any launch.
    """
    _check_backend(backend)
    for n, x in (("is_var_seq", is_var_seq), ("uses_shared_paged_kv_idx", uses_shared_paged_kv_idx),
                 ("return_lse", return_lse), ("enable_dcp", enable_dcp)):
        check_bool(n, x)
    check_optional_bool("enable_pdl", enable_pdl)
    check_optional_bool("use_fp16_softmax", use_fp16_softmax)
    _not_served(sparse_mla_top_k=(sparse_mla_top_k, 0), sinks=(sinks, None),
                skip_softmax_threshold_scale_factor=(skip_softmax_threshold_scale_factor, None),
                uses_shared_paged_kv_idx=(uses_shared_paged_kv_idx, True), cute_dsl_impl=(cute_dsl_impl, "auto"),
                kv_scale_format=(kv_scale_format, "auto"), cum_seq_lens_q=(cum_seq_lens_q, None),
                max_q_len=(max_q_len, None), sparse_mla_top_k_lens=(sparse_mla_top_k_lens, None),
                enable_dcp=(enable_dcp, False), cp_world=(cp_world, 1), cp_rank=(cp_rank, 0),
                causal_seqlens_kv_global=(causal_seqlens_kv_global, None))
    if use_fp16_softmax:
        raise NotImplementedError(f"use_fp16_softmax={use_fp16_softmax!r} is not supported (softmax is fp32)")
    if return_lse_base not in (None, "base2", "basee"):
        raise ValueError(f"return_lse_base must be None, 'base2' or 'basee', got {return_lse_base!r}")
    module, cfg, args, out, lse, num_work = _prepare(
        query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim, block_tables,
        seq_lens, max_seq_len, out, bmm1_scale, bmm2_scale, lse, return_lse, multi_ctas_kv_counter_buffer)
    if num_work:
        _launch(module, cfg, args)
    if return_lse_base == "basee" and lse is not None:
        lse.mul_(_LN2)
    return (out, lse) if return_lse else out


def xqa_mla(q, k_cache, v_cache, page_table, seq_lens, output, workspace_buffer, semaphores, page_size,
            q_scale=1.0, kv_scale=1.0, sm_count=None, enable_pdl=None) -> None:
    """FlashInfer's XQA MLA decode (fp8 e4m3 q and caches, bf16 output, 128 heads): not served.

    FlashInfer's ``xqa_mla`` is fp8-only and this package has no fp8 MLA kernel yet.

    Raises:
      NotImplementedError: always, naming what is missing (fp8 MLA KV) and what is served instead.
    """
    raise NotImplementedError(
        "xqa_mla is not supported: it takes fp8 e4m3 q and caches and the MLA kernel has no fp8 path (fp8 MLA KV) "
        "yet; bf16 MLA decode is served by trtllm_batch_decode_with_kv_cache_mla and "
        "BatchMLAPagedAttentionWrapper")
