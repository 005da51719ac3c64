"""``cudnn_batch_decode_with_kv_cache``: FlashInfer's ``flashinfer.cudnn_batch_decode_with_kv_cache`` (0.7.x),
paged batch decode on one cuDNN frontend SDPA graph (built and cached by :mod:`cutedsl_attn.cudnn.decode`).

The ``cudnn`` package (cudnn-frontend, this package's optional ``cudnn`` extra) is imported lazily; without
it the function raises ``NotImplementedError`` naming the missing frontend, the cuDNN version and what
serves the same decode here (FlashInfer falls back to bf16-only cubins instead, see the docstring).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..cudnn import decode as cd
from ._common import check_float, check_int, check_last_dim_contiguous, check_tensor, check_window_left

__all__ = ["cudnn_batch_decode_with_kv_cache"]

_FP8 = tuple(d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d)
_OFFSETS = ("batch_offsets_q", "batch_offsets_o", "batch_offsets_k", "batch_offsets_v")
_MULTIROW_KV_TILE = 128  # keys per tile of cuDNN 9.19's multi-row (q_len_per_req > 1) SDPA graph on the H200


def _aligned(t: torch.Tensor) -> bool:
    """Innermost stride 1, base pointer and the strides of non-trivial dims 16-byte aligned (cuDNN's loads)."""
    if t.stride(-1) != 1:
        return False
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and all((s * es) % 16 == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)


def _capturing(device) -> bool:
    """Whether torch's current stream on ``device`` is capturing a CUDA graph (False off CUDA)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _require_frontend() -> None:
    """``NotImplementedError`` (the ImportError chained) when cudnn-frontend cannot be imported."""
    try:
        cd.require_cudnn()
    except ImportError as e:
        raise NotImplementedError(
            f"cudnn_batch_decode_with_kv_cache needs the cuDNN frontend Python package ({cd.versions()}; "
            "pip install 'cutedsl-attn[cudnn]', i.e. nvidia-cudnn-frontend). FlashInfer falls back to bf16-only "
            f"precompiled cubins here; this package has no such fallback. The same decode is served by "
            f"{cd.SERVED_BY}."
        ) from e


def check_dense_offsets(name: str, offsets, *, batch_size: int, step: int, device, capturing: bool) -> None:
    """Accept ``batch_offsets_*`` only when it is what the dense graph addresses anyway.

    ``offsets``: None, or an int32/int64 1-D tensor of ``batch_size`` or ``batch_size + 1`` entries (CPU or
    ``device``).  Dense means ``offsets[b] == b * step`` (elements); ``step = 0`` for K/V (the block table
    addresses the cache, so every request's offset is the pool base).  A CUDA tensor is copied to the host
    to check it (one device synchronisation), which CUDA-graph capture cannot hold (``ValueError``).

    Raises:
      TypeError / ValueError: not a tensor, wrong dtype / shape / device, a CUDA tensor during capture.
      NotImplementedError: offsets that are not dense (ragged addressing is not served by this graph).
    """
    if offsets is None:
        return
    check_tensor(name, offsets)
    if offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {offsets.dtype}")
    if offsets.dim() != 1 or offsets.numel() not in (batch_size, batch_size + 1):
        raise ValueError(f"{name} must have shape ({batch_size},) or ({batch_size + 1},), got {tuple(offsets.shape)}")
    if offsets.device.type != "cpu" and offsets.device != device:
        raise ValueError(f"{name} is on {offsets.device}, expected q's device {device} or the CPU")
    if offsets.device.type != "cpu" and capturing:
        raise ValueError(f"{name} on the GPU cannot be checked during CUDA-graph capture (its values need a host "
                         "copy); pass None (dense) or a CPU tensor")
    host = offsets.to("cpu", torch.int64)
    want = torch.arange(host.numel(), dtype=torch.int64) * int(step)
    if not torch.equal(host, want):
        raise NotImplementedError(
            f"{name} with non-dense values is not supported by the cuDNN decode graph: request b must start at "
            f"element b * {step} ({'the pool base: the block table addresses K/V' if step == 0 else 'its dense position'}); "
            f"got {host[:8].tolist()}{'...' if host.numel() > 8 else ''}. Pass None.")


def _lens_kv(t, B: int, device, max_sequence_kv: int) -> torch.Tensor:
    if t is None:  # every request holds max_sequence_kv keys (FlashInfer's graph without a padding mask)
        return torch.full((B,), max_sequence_kv, dtype=torch.int32, device=device)
    check_tensor("actual_seq_lens_kv", t)
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"actual_seq_lens_kv must be int32 (or int64), got {t.dtype}")
    if t.numel() != B or (t.dim() != 1 and tuple(t.shape) != (B, 1, 1, 1)):
        raise ValueError(f"actual_seq_lens_kv must have shape ({B},) or ({B}, 1, 1, 1), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"actual_seq_lens_kv is on {t.device}, expected q's device {device} (the cuDNN graph "
                         "reads it on the device)")
    return t.reshape(B).to(torch.int32).contiguous()


def cudnn_batch_decode_with_kv_cache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    workspace_buffer: torch.Tensor,
    *,
    max_sequence_kv: int,
    actual_seq_lens_kv: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
    is_cuda_graph_compatible: bool = False,
    batch_offsets_q: torch.Tensor | None = None,
    batch_offsets_o: torch.Tensor | None = None,
    batch_offsets_k: torch.Tensor | None = None,
    batch_offsets_v: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    lse: torch.Tensor | None = None,
    q_len_per_req: int = 1,
    window_left: int = -1,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Batched decode attention over a paged KV cache on one cuDNN SDPA graph (FlashInfer's
    ``flashinfer.cudnn_batch_decode_with_kv_cache``, same signature and conventions).

    Args:
      q: ``[B * q_len_per_req, Hq, D]`` float16/bfloat16 (``[B, Hq, D]`` for one-token decode); the rows of
        one request are consecutive.  Any row / head strides (a slice of a packed QKV projection) with a
        contiguous, 16-byte aligned head_dim; other layouts are copied to a contiguous q first.
      k_cache, v_cache: ``[num_pages, Hkv, page_size, D]`` in q's dtype, any strides with a contiguous last
        dim and 16-byte aligned strides (an NHD pool ``[num_pages, page_size, Hkv, D]`` passes as its
        ``transpose(1, 2)`` view, no copy).  ``Hq % Hkv == 0`` (MHA, GQA, MQA); D a multiple of 8, <= 256.
      scale: the softmax scale (no default; typically ``1 / sqrt(D)``), baked into the cached graph.
      workspace_buffer: a device buffer for cuDNN's workspace (128 MiB is plenty); when it is smaller than
        the graph needs, a buffer is allocated for the call.
      max_sequence_kv: the largest KV length of the batch (an upper bound).  The graph declares the next
        power of two (at least 128), capped at the block table's capacity, so decode steps share a graph.
      actual_seq_lens_kv: ``[B]`` (or ``[B, 1, 1, 1]``) int32 KV lengths on q's device (int64 is converted,
        a device copy).  Each must be >= ``q_len_per_req`` and <= the table's capacity (device data, not
        checked: rows that see no key are left as cuDNN writes them).  None: every request holds
        ``max_sequence_kv`` keys.
      block_tables: ``[B, pages_per_seq]`` int32 on q's device, required; row b lists request b's pages in
        order (the tail is never read).  A non-contiguous table is copied.
      is_cuda_graph_compatible: the graph is built for CUDA-graph replay (part of the graph key).  Every
        call is capturable once its graph is cached: run it once eagerly, then capture; a call that would
        have to build a graph during capture raises ``RuntimeError``.
      batch_offsets_q, batch_offsets_o, batch_offsets_k, batch_offsets_v: per-request element offsets,
        int32/int64, ``[B]`` or ``[B + 1]``.  Only dense values are served (q: ``b * q_len_per_req *
        q.stride(0)``; o: ``b * q_len_per_req * Hq * D``; k/v: 0, the block table addresses the pool);
        anything else raises ``NotImplementedError`` before the launch, never a device assert.  Checking a
        CUDA tensor copies it to the host (a device synchronisation per call; not allowed during capture);
        pass None (recommended) or a CPU tensor to avoid it.
      out: optional contiguous ``[B * q_len_per_req, Hq, D]`` in q's dtype.
      return_lse: also return the LSE.
      lse: optional contiguous float32 ``[B * q_len_per_req, Hq]``, written when ``return_lse`` (ignored
        otherwise, as FlashInfer).
      q_len_per_req: query rows per request (>= 1).  Rows of one request see the bottom-right causal
        diagonal: row i sees keys ``0 .. kv_len - q_len_per_req + i``.
      window_left: FlashInfer's left window: a row sees its diagonal key and the ``window_left`` keys
        before it; -1 disables it.
      sinks: optional float32 ``[Hq]`` on q's device: per-head sink logits (natural-log units, not scaled
        by ``scale``) joining every row's softmax denominator with a zero value row.

    Returns:
      ``out`` ``[B * q_len_per_req, Hq, D]`` (q's dtype), or ``(out, lse)`` with ``return_lse``.  LSE
      convention (FlashInfer's): base 2, ``lse = log2(sum_j exp(scale * q . k_j))`` over the visible keys
      (the sink term included), i.e. cuDNN's natural-log Stats times ``log2(e)``; it feeds ``merge_state``.

    Raises:
      TypeError / ValueError: malformed arguments, each named (dtypes, shapes, devices, strides, lengths,
        offsets), before any launch.
      NotImplementedError: cudnn-frontend not importable; fp8 tensors; D not a multiple of 8 or above 256;
        non-dense ``batch_offsets_*``; a graph no cuDNN engine serves (on the H200 with cuDNN 9.19 a sink
        at ``q_len_per_req == 1``) -- each message names the feature, the cuDNN and frontend versions and
        what serves it here (``BatchDecodeWithPagedKVCacheWrapper``, the CuTe DSL decode kernel).
      RuntimeError: a graph would have to be built during CUDA-graph capture.

    Known cuDNN limitation (9.19, H200, ``q_len_per_req > 1``): the multi-row graph reads each request's K/V up
    to the next 128-key boundary past its length, so those slots must hold finite values (NaN or inf there
    reaches the output as ``0 * NaN``), and ``block_tables`` needs columns of valid page ids up to that boundary
    (checked: ValueError).  One-token decode reads only the request's own keys.  The CuTe DSL decode kernel
    behind ``BatchDecodeWithPagedKVCacheWrapper`` reads only owned slots in both cases.

    Difference from FlashInfer: without cudnn-frontend FlashInfer runs precompiled cuDNN cubins that serve
    bf16 one-token decode only (fp16, ``return_lse``, ``q_len_per_req > 1``, windows and sinks raise
    there).  This function has no cubin path; the fallback is the CuTe DSL decode kernel behind
    ``BatchDecodeWithPagedKVCacheWrapper``, which serves fp16 and bf16, ``return_lse``, windows and
    sinks.  Non-dense offsets raise here instead of FlashInfer's asynchronous device assertion.
    """
    call = prepare_call(
        q, k_cache, v_cache, scale, workspace_buffer, max_sequence_kv=max_sequence_kv,
        actual_seq_lens_kv=actual_seq_lens_kv, block_tables=block_tables,
        is_cuda_graph_compatible=is_cuda_graph_compatible, batch_offsets_q=batch_offsets_q,
        batch_offsets_o=batch_offsets_o, batch_offsets_k=batch_offsets_k, batch_offsets_v=batch_offsets_v, out=out,
        return_lse=return_lse, lse=lse, q_len_per_req=q_len_per_req, window_left=window_left, sinks=sinks)
    _require_frontend()
    if call.out.device.type != "cuda":
        raise ValueError(f"cudnn_batch_decode_with_kv_cache runs on a CUDA device; q is on {call.out.device}")
    return execute_call(call)


class DecodeCall(NamedTuple):
    """A validated call: the graph key and every tensor bound to the graph (``q`` as its 4-D view)."""

    key: cd.DecodeGraphKey
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    out: torch.Tensor
    lse: Optional[torch.Tensor]
    seq_lens_kv: torch.Tensor
    block_table: torch.Tensor
    sinks: Optional[torch.Tensor]
    workspace: torch.Tensor


def _check_qkv(q, k_cache, v_cache, m: int) -> tuple:
    """q ``[B * m, Hq, D]``, caches ``[pages, Hkv, page_size, D]`` of one fp16/bf16 dtype; returns
    ``(B, Hq, Hkv, D, Dvo, page_size)``."""
    check_tensor("q", q)
    if q.dim() != 3 or q.shape[0] % m:
        raise ValueError("q must have shape (batch_size * q_len_per_req, num_heads_qo, head_dim); got "
                         f"{tuple(q.shape)} with q_len_per_req={m}")
    check_tensor("k_cache", k_cache, ndim=4)
    check_tensor("v_cache", v_cache, ndim=4)
    for n, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype in _FP8:
            raise NotImplementedError(f"{n}.dtype={t.dtype}: fp8 is not supported by cudnn_batch_decode_with_kv_cache "
                                      "(torch.float16 and torch.bfloat16)")
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError("cudnn_batch_decode_with_kv_cache only supports torch.float16 and torch.bfloat16, "
                             f"got {n}.dtype={t.dtype}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    rows, Hq, D = q.shape
    if rows == 0:
        raise ValueError("q holds no request (shape[0] == 0)")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache and v_cache must agree on (num_pages, num_heads_kv, page_size), got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _, Hkv, page_size, Dk = k_cache.shape
    Dvo = v_cache.shape[3]
    if Dk != D:
        raise ValueError(f"k_cache head_dim ({Dk}) must equal q's head_dim ({D})")
    if Hq % Hkv:
        raise ValueError(f"num_heads_qo ({Hq}) must be a multiple of num_heads_kv ({Hkv})")
    for n, d in (("head_dim_qk", D), ("head_dim_vo", Dvo)):
        if d % 8 or d > 256:
            raise NotImplementedError(f"{n}={d} is not supported by cudnn_batch_decode_with_kv_cache "
                                      "(a multiple of 8, <= 256)")
    return rows // m, Hq, Hkv, D, Dvo, page_size


def _check_block_table(block_tables, B: int, device) -> torch.Tensor:
    """The ``[B, pages_per_seq]`` int32 table on ``device``, contiguous (a strided one is copied)."""
    if block_tables is None:
        raise ValueError("block_tables is required: the (batch_size, pages_per_seq) int32 page table of the paged "
                         "cache (cuDNN's paged decode graph reads K/V through it)")
    check_tensor("block_tables", block_tables, ndim=2)
    if block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    if block_tables.shape[0] != B or block_tables.shape[1] < 1:
        raise ValueError(f"block_tables must have shape (batch_size={B}, pages_per_seq >= 1), got "
                         f"{tuple(block_tables.shape)}")
    if block_tables.device != device:
        raise ValueError(f"block_tables is on {block_tables.device}, expected q's device {device}")
    return block_tables if block_tables.is_contiguous() else block_tables.contiguous()


def _outputs(out, lse, return_lse: bool, shape: tuple, dtype, device):
    """``out`` ``shape`` (contiguous, q's dtype) and, with ``return_lse``, ``lse`` ``shape[:2]`` fp32 (contiguous);
    allocated when None.  ``lse`` is None without ``return_lse``."""
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    else:
        check_tensor("out", out, shape=shape, dtype=dtype, device=device)
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
    if not return_lse:
        return out, None
    if lse is None:
        return out, torch.empty(shape[:2], dtype=torch.float32, device=device)
    check_tensor("lse", lse, shape=shape[:2], dtype=torch.float32, device=device)
    if not lse.is_contiguous():
        raise ValueError("lse must be contiguous")
    return out, lse


def prepare_call(q, k_cache, v_cache, scale, workspace_buffer, *, max_sequence_kv, actual_seq_lens_kv,
                 block_tables, is_cuda_graph_compatible, batch_offsets_q, batch_offsets_o, batch_offsets_k,
                 batch_offsets_v, out, return_lse, lse, q_len_per_req, window_left, sinks) -> DecodeCall:
    """Every check of :func:`cudnn_batch_decode_with_kv_cache` (same arguments, same errors) short of the
    frontend and the CUDA device, the outputs allocated and the graph key derived; runs on any device."""
    m = check_int("q_len_per_req", q_len_per_req, 1)
    B, Hq, Hkv, D, Dvo, page_size = _check_qkv(q, k_cache, v_cache, m)
    for n, x in (("is_cuda_graph_compatible", is_cuda_graph_compatible), ("return_lse", return_lse)):
        if not isinstance(x, bool):
            raise TypeError(f"{n} must be a bool, got {type(x).__name__}")
    if scale is None:
        raise TypeError("scale (the softmax scale) is required, e.g. 1 / sqrt(head_dim)")
    scale = check_float("scale", scale, positive=False)
    max_kv = check_int("max_sequence_kv", max_sequence_kv, 1)
    window_left = check_window_left(window_left)
    dev = q.device
    for n, t in (("k_cache", k_cache), ("v_cache", v_cache), ("workspace_buffer", workspace_buffer)):
        check_tensor(n, t)
        if t.device != dev:
            raise ValueError(f"{n} is on {t.device}, expected q's device {dev}")
    table = _check_block_table(block_tables, B, dev)
    if actual_seq_lens_kv is None and max_kv > table.shape[1] * page_size:
        raise ValueError(f"max_sequence_kv ({max_kv}) exceeds the block table's capacity ({table.shape[1]} "
                         f"pages x {page_size}); without actual_seq_lens_kv every request holds max_sequence_kv keys")
    if m > 1 and table.shape[1] * page_size < -(-max_kv // _MULTIROW_KV_TILE) * _MULTIROW_KV_TILE:
        # cuDNN's multi-row graph reads whole 128-key tiles: a narrower table would be read past its end
        need = -(-(-(-max_kv // _MULTIROW_KV_TILE) * _MULTIROW_KV_TILE) // page_size)
        raise ValueError(f"block_tables has {table.shape[1]} columns; with q_len_per_req > 1 cuDNN reads whole "
                         f"{_MULTIROW_KV_TILE}-key tiles, so it needs >= {need} columns of valid page ids for "
                         f"max_sequence_kv={max_kv} at page_size {page_size} (pad with any page id)")
    seq_kv = _lens_kv(actual_seq_lens_kv, B, dev, max_kv)
    if sinks is not None:
        check_tensor("sinks", sinks, dtype=torch.float32, shape=(Hq,), device=dev)
    out, lse = _outputs(out, lse, return_lse, (B * m, Hq, Dvo), q.dtype, dev)
    for n, t in (("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        check_last_dim_contiguous(n, t)
    capturing = _capturing(dev)
    for n, o, step in (("batch_offsets_q", batch_offsets_q, m * q.stride(0)),
                       ("batch_offsets_o", batch_offsets_o, m * Hq * Dvo),
                       ("batch_offsets_k", batch_offsets_k, 0), ("batch_offsets_v", batch_offsets_v, 0)):
        check_dense_offsets(n, o, batch_size=B, step=step, device=dev, capturing=capturing)
    if not _aligned(q):
        q = q.contiguous()  # cuDNN needs a dense, 16-byte aligned head_dim; FlashInfer copies such a q too
    key = cd.graph_key(q, k_cache, v_cache, table_width=table.shape[1], max_sequence_kv=max_kv, sm_scale=scale,
                       q_len_per_req=m, window_left=window_left, sinks=sinks is not None, return_lse=return_lse,
                       cuda_graph=is_cuda_graph_compatible)
    return DecodeCall(key, cd.q_graph_view(q, m), k_cache, v_cache, out, lse, seq_kv, table,
                      None if sinks is None else sinks.contiguous(), workspace_buffer)


def execute_call(call: DecodeCall):
    """Run a prepared call on its cuDNN graph; returns ``out`` or ``(out, lse)`` (base-2 LSE)."""
    cd.run_graph(call.key, q=call.q, k=call.k_cache, v=call.v_cache, out=call.out, stats=call.lse,
                 seq_len_kv=call.seq_lens_kv, block_table=call.block_table, sinks=call.sinks,
                 workspace=call.workspace)
    if call.lse is None:
        return call.out
    call.lse.mul_(cd.LOG2E)  # cuDNN's Stats are natural-log; FlashInfer's LSE is base 2
    return call.out, call.lse
