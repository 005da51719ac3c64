"""FlashInfer's one-call MLA decode entry points: ``trtllm_batch_decode_with_kv_cache_mla`` and ``xqa_mla``.

``trtllm_batch_decode_with_kv_cache_mla`` takes the TRT-LLM layout: query ``[B, q_len, H, 576]`` (``q_nope``
then ``q_pe`` in one row), one combined cache ``[pages, page_size, 576]`` (``ckv`` = first 512 columns, ``kpe``
= last 64 of the same rows), a dense block table and ``seq_lens``, and fused scales: ``bmm1_scale`` multiplies
the logits as given (``q_scale * k_scale * sm_scale``, no implicit ``1/sqrt(d)``), ``bmm2_scale`` multiplies
O in fp32 before the 16-bit rounding.  Multi-token rows (``q_len > 1``) are bottom-right causal.  The cache is
bf16 / fp16 (query of the same dtype) or fp8 e4m3 (query fp8 e4m3, O bf16, as FlashInfer's; or a 16-bit
query, O in its dtype): fp8 values are widened exactly in the kernel and the per-tensor scales live only in
``bmm1_scale`` / ``bmm2_scale``.  ``xqa_mla`` is the fp8 e4m3 form with ``q_scale`` / ``kv_scale``: logits
``q_scale * kv_scale * (q . k)`` (no ``1/sqrt(d)``) and O times ``kv_scale``.  Both run the MLA kernels
``BatchMLAPagedAttentionWrapper`` runs, chosen by :func:`cutedsl_attn.dispatch.mla_choice` with the query's head
count (on Hopper too, where FlashInfer routes them to SM100 / SM120-only kernels); the query and cache are
passed as strided views, never copied.

Each call plans on the host (it reads ``seq_lens`` and the used part of ``block_tables`` to the CPU), so it
synchronises with the device and cannot be captured in a CUDA graph; capture
``BatchMLAPagedAttentionWrapper(use_cuda_graph=True)`` instead.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..common.constants import LN2 as _LN2
from ..dispatch import mla_choice, mla_launch, mla_limits, mla_problem, num_sms
from ..planning.mla import HEAD_DIM_CKV, HEAD_DIM_KPE, MlaArgs, plan_mla
from ._common import (
    check_bool, check_devices, check_int, check_last_dim_contiguous, check_one_device, check_optional_bool,
    check_tensor, host_launch_error,
)
from ._pagetable import from_block_tables

__all__ = ["trtllm_batch_decode_with_kv_cache_mla", "xqa_mla"]

#: "trtllm-gen" / "xqa": FlashInfer's kernel names, run on this package's MLA kernel (as the trtllm decode entry does)
_BACKENDS = ("auto", "cute", "trtllm-gen", "xqa")
_FLASHINFER_BACKENDS = ("cute-dsl", "sparse")
_DTYPES = (torch.bfloat16, torch.float16)
_E4M3 = torch.float8_e4m3fn
MAX_PAGE_SIZE = 64
XQA_MLA_HEADS = 128
_PDL = "enable_pdl=True is not supported (no programmatic dependent launch yet); pass None or False"
_SERVED = ("served: bf16 (or fp16) query and cache of one dtype, a bf16 / fp16 query over an fp8 e4m3 cache, "
           "or fp8 e4m3 query and cache (bf16 out); kv_lora_rank 512, qk_rope_head_dim 64, page sizes 1..64")


def _check_backend(backend) -> None:
    if backend in _BACKENDS:
        return
    if backend in _FLASHINFER_BACKENDS:
        raise NotImplementedError(f"backend={backend!r} is not served; trtllm_batch_decode_with_kv_cache_mla "
                                  "backends here: 'auto', 'cute', 'trtllm-gen', 'xqa' (all the CuTe DSL MLA kernel)")
    raise ValueError(f"backend must be one of {_BACKENDS + _FLASHINFER_BACKENDS}, got {backend!r}")


def _fused_scale(name: str, x) -> float:
    """A finite real (Python or numpy, not a bool), or a one-element float32 tensor (read to the host)."""
    if isinstance(x, torch.Tensor):
        if x.dtype != torch.float32:
            raise TypeError(f"{name} tensor must have dtype torch.float32, got {x.dtype}")
        if x.numel() != 1:
            raise ValueError(f"{name} tensor must hold one value, got shape {tuple(x.shape)}")
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a float or a one-element float32 tensor, got {type(x).__name__}")
    if not math.isfinite(float(x)):
        raise ValueError(f"{name} must be finite, got {x}")
    return float(x)


def _out_dtype(q_dt: torch.dtype, kv_dt: torch.dtype) -> torch.dtype:
    """O's dtype for a (query, cache) dtype pair; NotImplementedError naming what is served otherwise."""
    for name, dt in (("query", q_dt), ("kv_cache", kv_dt)):
        if dt not in _DTYPES + (_E4M3,):
            raise NotImplementedError(f"{name} dtype {dt} is not supported; {_SERVED}")
    if q_dt == _E4M3:
        if kv_dt != _E4M3:
            raise NotImplementedError(f"query {q_dt} with kv_cache {kv_dt} is not supported (an fp8 query needs "
                                      f"an fp8 cache); {_SERVED}")
        return torch.bfloat16
    if kv_dt not in (q_dt, _E4M3):
        raise NotImplementedError(f"query {q_dt} with kv_cache {kv_dt} is not supported (a 16-bit query needs a "
                                  f"cache of one dtype, or fp8); {_SERVED}")
    return q_dt


def _not_served(**options) -> None:
    """NotImplementedError for the first option not at its served value (name -> (value, served value))."""
    for name, (value, ok) in options.items():
        if (value is not None) if ok is None else (isinstance(value, torch.Tensor) or value != ok):
            shown = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
            raise NotImplementedError(f"{name}={shown} is not supported (only {ok!r}); {_SERVED}")


def _flat_view(name: str, t: torch.Tensor, shape) -> torch.Tensor:
    try:
        return t.view(*shape)
    except RuntimeError:
        raise ValueError(f"{name} must have mergeable batch and q_len dims (viewable as {tuple(shape)} without a "
                         f"copy), got strides {t.stride()}") from None


def _check_used_pages(name: str, table: torch.Tensor, kv_lens: torch.Tensor, page_size: int, num_pages: int):
    """ValueError naming ``name`` when a page a request uses (its first ``ceil(len / page_size)`` columns) is
    outside ``[0, num_pages)``; columns past them are never read."""
    need = (kv_lens + page_size - 1) // page_size
    used = table.to("cpu")[torch.arange(table.shape[1]).view(1, -1) < need.view(-1, 1)]
    bad = used[(used < 0) | (used >= num_pages)]
    if bad.numel():
        raise ValueError(f"{name} holds page id {int(bad[0])} for a used page, outside the cache's "
                         f"[0, {num_pages}) pages")


def _prepare(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim, block_tables,
             seq_lens, max_seq_len, out, bmm1_scale, bmm2_scale, lse, return_lse, multi_ctas_kv_counter_buffer,
             devices):
    """Validate, plan and build the launch: ``(module, cfg, args, out, lse_or_None, num_work)``; ``devices`` the
    ``(name, tensor)`` pairs that must be on one CUDA device, checked once shapes and dtypes are."""
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
    dt = _out_dtype(query.dtype, kv_cache.dtype)
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
    _check_used_pages("block_tables", block_tables, kv_lens, page_size, num_pages)

    T = B * q_len
    q = _flat_view("query", query, (T, H, d_qk))
    out_shape = (B, q_len, H, HEAD_DIM_CKV)
    if out is None:
        out = torch.empty(out_shape, dtype=dt, device=dev)
    else:
        check_tensor("out", out, shape=out_shape, dtype=dt, device=dev)  # q's dtype, bf16 for an fp8 query
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
    check_devices("trtllm_batch_decode_with_kv_cache_mla", devices)

    if T == 0:
        return None, None, None, out, lse, 0
    module, cfg, args, num_work = _plan_args(q, kv_cache, kv_lens, page_off, flat, q_len, o, lse_k, bmm1, bmm2,
                                             workspace_buffer, multi_ctas_kv_counter_buffer)
    return module, cfg, args, out, lse, num_work


def _plan_args(q, kv_cache, kv_lens, page_off, flat, q_len, o, lse_k, bmm1, bmm2, workspace_buffer,
               counter_buffer, sms=None):
    """The kernel choice, plan and launch arguments of validated inputs: q ``[B * q_len, H, 576]``, kv_cache
    ``[pages, page_size, 576]``, o ``[B * q_len, H, 512]``; ``sms`` the SM count the split heuristic fills
    (None: the device's).  Returns ``(module, cfg, args, num_work)``; ValueError for a short workspace or
    counter buffer."""
    dev = q.device
    B, H, page_size = kv_lens.shape[0], q.shape[1], kv_cache.shape[1]
    q_nope, q_pe = q[..., :HEAD_DIM_CKV], q[..., HEAD_DIM_CKV:]  # strided views: the kernel reads rows by stride
    ckv, kpe = kv_cache[..., :HEAD_DIM_CKV], kv_cache[..., HEAD_DIM_CKV:]
    dev_index = dev.index if dev.type == "cuda" else None
    module, cfg = mla_choice(mla_problem(dtype=q.dtype, kv_dtype=kv_cache.dtype, page_size=page_size,
                                         causal=q_len > 1, device_index=dev_index), device_index=dev_index,
                           num_heads=H, max_qo_len=q_len)
    lim = mla_limits(module, cfg)
    wp = plan_mla(torch.full((B,), q_len, dtype=torch.int64), kv_lens, torch.arange(B, dtype=torch.int64) * q_len,
                  page_off, num_heads=H, page_size=page_size, num_sms=num_sms(dev_index) if sms is None else sms,
                  ctas_per_sm=lim["ctas_per_sm"], tile_m=lim["tile_m"],
                  max_splits_per_request=lim["max_splits_per_request"], split=lim["split"])
    n_part, R = max(1, wp.num_partials), wp.rows
    po_bytes = n_part * R * HEAD_DIM_CKV * 4
    off = (po_bytes + 255) // 256 * 256
    ws = workspace_buffer.reshape(-1).view(torch.uint8)
    if off + n_part * R * 4 > ws.numel():
        raise ValueError(f"workspace_buffer holds {ws.numel()} bytes, this call needs {off + n_part * R * 4} "
                         "(split-KV partials)")
    n_cnt = max(1, B * wp.row_tiles)
    if counter_buffer is None:
        counters = torch.zeros(n_cnt, dtype=torch.int32, device=dev)
    else:
        cb = counter_buffer
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
    return module, cfg, args, wp.num_work


def _launch(module, cfg, args: MlaArgs) -> None:
    dev = args.q_nope.device
    if dev.type != "cuda":  # host tensors pass the checks only when cross-compiling without a GPU
        raise host_launch_error("trtllm_batch_decode_with_kv_cache_mla", dev)
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
      query: ``[B, q_len, H, 576]`` bf16, fp16 or fp8 e4m3, ``q_nope`` then ``q_pe``; last dim contiguous,
        16-byte aligned strides, ``B`` and ``q_len`` mergeable without a copy.
      kv_cache: ``[num_pages, page_size, 576]`` or ``[num_pages, 1, page_size, 576]``, ``ckv`` then ``kpe`` in
        each row: query's dtype, or fp8 e4m3 (under any served query); last dim contiguous, 16-byte aligned
        strides; page_size 1..64.
      workspace_buffer: a tensor on query's device, contiguous, 16-byte aligned: the fp32 split-KV partials.
      qk_nope_head_dim: >= 1, not used (the caller folds it into ``bmm1_scale``).
      kv_lora_rank, qk_rope_head_dim: 512 and 64 (NotImplementedError otherwise).
      block_tables: int32 ``[B, max_pages]``: request ``b``'s pages in order (a host table is copied).
      seq_lens: integer ``[B]`` KV lengths, ``<= max_seq_len`` and ``<= max_pages * page_size``.
      max_seq_len: int >= 0.
      out: optional ``[B, q_len, H, 512]`` in query's dtype (bf16 for an fp8 query; written), last dim
        contiguous.
      bmm1_scale: the logit multiplier, taken as given (fp8: ``q_scale * k_scale * sm_scale``); bmm2_scale:
        multiplies O in fp32 before rounding (fp8: ``v_scale * o_scale``).  Each a float or a one-element
        float32 tensor (read to the host).
      lse: optional float32 ``[B * q_len, H]`` or ``[B, q_len, H]`` contiguous, written.
      return_lse: also return the LSE (``lse``, or a new ``[B * q_len, H]`` tensor).
      return_lse_base: None or ``"base2"`` (base 2), ``"basee"`` (natural log).
      multi_ctas_kv_counter_buffer: optional zero-initialised contiguous buffer for the split-KV counters (left
        zero by the kernel); None: a fresh zeroed one per call.
      enable_pdl: None or False (True: NotImplementedError, no programmatic dependent launch here, as the
        decode entry points).  is_var_seq: accepted, no effect.
      backend: ``"auto"``, ``"cute"``, or FlashInfer's ``"trtllm-gen"`` / ``"xqa"``, all run on this package's MLA
        kernel; ``"cute-dsl"`` and ``"sparse"`` raise NotImplementedError.
      sparse_mla_top_k (0), sinks, skip_softmax_threshold_scale_factor, uses_shared_paged_kv_idx (True),
      cute_dsl_impl / kv_scale_format ("auto"), cum_seq_lens_q, max_q_len, sparse_mla_top_k_lens, enable_dcp
      (False), cp_world (1), cp_rank (0), causal_seqlens_kv_global, use_fp16_softmax (None/False): only those
      values are served (NotImplementedError otherwise).

    Returns:
      ``out`` ``[B, q_len, H, 512]``, or ``(out, lse)`` when ``return_lse``.

    Raises:
      TypeError / ValueError: shapes, dtypes, devices, strides, page ids or lengths that disagree (the message
      names the argument and rule).  NotImplementedError: other head dims, dtype pairs (fp8 e5m2, an fp8
      query over a 16-bit cache, fp32), page sizes, backends or options, ``enable_pdl=True`` (the message says
      what is served).
      All raised before any launch.
    """
    _check_backend(backend)
    devices = [("query", query), ("kv_cache", kv_cache), ("workspace_buffer", workspace_buffer),
               ("block_tables", block_tables), ("out", out), ("lse", lse),
               ("multi_ctas_kv_counter_buffer", multi_ctas_kv_counter_buffer)]
    # one device now; CUDA once the shapes and dtypes are checked (a wrong shape is reported as such anywhere)
    check_one_device("trtllm_batch_decode_with_kv_cache_mla", devices)
    for n, x in (("is_var_seq", is_var_seq), ("uses_shared_paged_kv_idx", uses_shared_paged_kv_idx),
                 ("return_lse", return_lse), ("enable_dcp", enable_dcp)):
        check_bool(n, x)
    if check_optional_bool("enable_pdl", enable_pdl):
        raise NotImplementedError(_PDL)
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
        seq_lens, max_seq_len, out, bmm1_scale, bmm2_scale, lse, return_lse, multi_ctas_kv_counter_buffer, devices)
    if num_work:
        _launch(module, cfg, args)
    if return_lse_base == "basee" and lse is not None:
        lse.mul_(_LN2)
    return (out, lse) if return_lse else out


def _xqa_cache(name: str, t, page_size: int, widths) -> torch.Tensor:
    """``[pages, page_size, W]`` view of an xqa MLA cache given as ``[pages * page_size, W]``, ``[pages,
    page_size, W]`` or ``[pages, page_size, 1, W]`` / ``[pages, 1, page_size, W]`` (one kv head)."""
    check_tensor(name, t)
    if t.shape[-1] not in widths:
        raise ValueError(f"{name}'s last dim must be {' or '.join(map(str, widths))}, got {tuple(t.shape)}")
    if t.dim() == 2:
        if t.shape[0] % page_size:
            raise ValueError(f"{name} [total_num_cache_heads, head_dim] must hold whole pages of {page_size} rows, "
                             f"got {tuple(t.shape)}")
        return _flat_view(name, t, (t.shape[0] // page_size, page_size, t.shape[1]))
    if t.dim() == 4 and t.shape[2] == 1 and t.shape[1] == page_size:
        return t[:, :, 0]
    if t.dim() == 4 and t.shape[1] == 1 and t.shape[2] == page_size:
        return t[:, 0]
    if t.dim() == 3 and t.shape[1] == page_size:
        return t
    raise ValueError(f"{name} must be [pages * {page_size}, D], [pages, {page_size}, D] or [pages, {page_size}, "
                     f"1, D] (page_size {page_size}, one kv head), got {tuple(t.shape)}")


def xqa_mla(q, k_cache, v_cache, page_table, seq_lens, output, workspace_buffer, semaphores, page_size,
            q_scale=1.0, kv_scale=1.0, sm_count=None, enable_pdl=None) -> None:
    """FlashInfer's XQA MLA decode: fp8 e4m3 q and caches, bf16 output, 128 heads, one query token (absorbed
    form, on the same kernel as ``trtllm_batch_decode_with_kv_cache_mla``).

    ``s = q_scale * kv_scale * (q_nope . ckv_j + q_pe . kpe_j)`` (no implicit ``1/sqrt(d)``: the caller folds
    the softmax scale into ``q_scale``), ``o = kv_scale * softmax(s) . ckv`` in fp32, rounded to bf16 once.  V
    is the first 512 columns of the K rows (MLA's latent), so ``v_cache`` must be ``k_cache`` itself or a view
    of its storage.  Plans on the host per call (reads ``seq_lens`` and ``page_table``): it synchronises and is
    not CUDA-graph capturable.

    Args:
      q: ``[B, 1, 128, 576]`` torch.float8_e4m3fn (beam width 1), last dim contiguous, 16-byte aligned strides.
      k_cache: torch.float8_e4m3fn ``[total_num_cache_heads, 576]`` (``pages * page_size`` rows), ``[pages,
        page_size, 576]`` or ``[pages, page_size, 1, 576]``; last dim contiguous, 16-byte aligned strides.
      v_cache: ``k_cache`` (or a view of the same rows, last dim 576 or 512).
      page_table: int32 ``[B, pages_per_seq]``.  seq_lens: ``[B, 1]`` (or ``[B]``) uint32 / int32.
      output: ``[B, 1, 128, 512]`` bf16, last dim contiguous; written.
      workspace_buffer: a tensor on q's device, contiguous, 16-byte aligned: the fp32 split-KV partials.
      semaphores: a tensor on q's device; not used (the split-KV counters are fresh per call).
      page_size: 1..64 (FlashInfer's 128: NotImplementedError).
      q_scale, kv_scale: floats or one-element float32 tensors (read to the host).
      sm_count: SMs the split-KV heuristic fills (None: the device's).
      enable_pdl: None or False (True: NotImplementedError).

    Raises:
      TypeError / ValueError: dtypes, shapes, head count, devices, strides, page ids or lengths that disagree (the
      message names the argument and rule).  NotImplementedError: beam width > 1, page size 128, a ``v_cache``
      with storage of its own, ``enable_pdl=True``.  All raised before any launch.
    """
    check_tensor("q", q, ndim=4)
    devices = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("page_table", page_table), ("output", output),
               ("workspace_buffer", workspace_buffer), ("semaphores", semaphores)]
    check_one_device("xqa_mla", devices)  # CUDA once the shapes and dtypes are checked
    dev = q.device
    page_size = check_int("page_size", page_size, 1)
    if page_size > MAX_PAGE_SIZE:
        raise NotImplementedError(f"page_size={page_size} is not supported; xqa_mla serves page sizes "
                                  f"1..{MAX_PAGE_SIZE}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, device=dev)
        if t.dtype != _E4M3:
            raise ValueError(f"{name} must be torch.float8_e4m3fn (xqa_mla takes fp8 e4m3 q and caches; bf16 MLA "
                             f"decode is trtllm_batch_decode_with_kv_cache_mla), got {t.dtype}")
    d_qk = HEAD_DIM_CKV + HEAD_DIM_KPE
    B, beam, H, dq = q.shape
    if dq != d_qk:
        raise ValueError(f"q's last dim must be {d_qk} (512 + 64), got {tuple(q.shape)}")
    if beam != 1:
        raise NotImplementedError(f"beam_width={beam} is not supported (only 1)")
    if H != XQA_MLA_HEADS:
        raise ValueError(f"xqa_mla needs exactly {XQA_MLA_HEADS} query heads, got {H}")
    kv = _xqa_cache("k_cache", k_cache, page_size, (d_qk,))
    vv = _xqa_cache("v_cache", v_cache, page_size, (d_qk, HEAD_DIM_CKV))
    if vv.data_ptr() != kv.data_ptr() or vv.shape[:2] != kv.shape[:2] or vv.stride()[:2] != kv.stride()[:2]:
        raise NotImplementedError("a v_cache with storage of its own is not supported: absorbed MLA reads V as the "
                                  "first 512 columns of k_cache's rows; pass k_cache (or a view of it) as v_cache")
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("k_cache", kv)
    check_tensor("output", output, shape=(B, 1, H, HEAD_DIM_CKV), dtype=torch.bfloat16, device=dev)
    check_last_dim_contiguous("output", output)
    check_tensor("semaphores", semaphores, device=dev)
    check_tensor("workspace_buffer", workspace_buffer, device=dev)
    if not workspace_buffer.is_contiguous() or workspace_buffer.data_ptr() % 16:
        raise ValueError("workspace_buffer must be contiguous and 16-byte aligned")
    q_sc = _fused_scale("q_scale", q_scale)
    kv_sc = _fused_scale("kv_scale", kv_scale)
    sms = None if sm_count is None else check_int("sm_count", sm_count, 1)
    if check_optional_bool("enable_pdl", enable_pdl):
        raise NotImplementedError(_PDL)
    check_tensor("seq_lens", seq_lens)
    if seq_lens.dim() == 2 and seq_lens.shape[1] == 1:
        seq_lens = seq_lens[:, 0]
    if seq_lens.dtype == getattr(torch, "uint32", None):
        seq_lens = seq_lens.to(torch.int64)
    try:
        kv_lens, page_off, flat = from_block_tables(page_table, seq_lens, page_size, dev, True, batch_size=B,
                                                    batch_name="q.shape[0]")
    except ValueError as e:  # the shared checks name trtllm's argument
        raise ValueError(str(e).replace("block_tables", "page_table")) from None
    _check_used_pages("page_table", page_table, kv_lens, page_size, kv.shape[0])
    check_devices("xqa_mla", devices)
    if B == 0:
        return None
    lse = torch.empty((B, H), dtype=torch.float32, device=dev)
    module, cfg, args, num_work = _plan_args(_flat_view("q", q, (B, H, d_qk)), kv, kv_lens, page_off, flat, 1,
                                             _flat_view("output", output, (B, H, HEAD_DIM_CKV)), lse, q_sc * kv_sc,
                                             kv_sc, workspace_buffer, None, sms)
    if num_work:
        try:
            _launch(module, cfg, args)
        except ValueError:
            if dev.type != "cuda":  # the launch's host refusal, in this entry point's name
                raise host_launch_error("xqa_mla", dev) from None
            raise
    return None
