"""FlashInfer's ``single_decode_with_kv_cache``: one query token against a contiguous KV (16-bit, or an fp8 e4m3
cache with per-tensor scales), served by the paged decode wrapper over a page-size-1 view (a wrapper made, planned
and dropped per call; the custom op ``cutedsl_attn::single_decode`` under ``torch.compile``)."""

from __future__ import annotations

import torch

from ._common import (check_bool, check_devices, check_float, check_head_dim, check_heads, check_kv_layout,
                      check_one_device, check_tensor, run_scale)
from ._graph import staged_host_copies
from .decode import BatchDecodeWithPagedKVCacheWrapper

__all__ = ["single_decode_with_kv_cache"]

_Q_DTYPES = (torch.float16, torch.bfloat16)
_FP8_KV = torch.float8_e4m3fn  # the one fp8 cache type the decode kernel reads


def single_decode_with_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    use_tensor_cores: bool = False,
    q_scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    sm_scale: float | None = None,
    rope_scale: float | None = None,
    rope_theta: float | None = None,
    return_lse: bool = False,
):
    """Decode one query token against a contiguous KV (FlashInfer's ``single_decode_with_kv_cache``).

    Args:
      q: ``[num_qo_heads, head_dim]`` fp16/bf16.
      k, v: ``[kv_len, num_kv_heads, head_dim]`` (NHD) or ``[num_kv_heads, kv_len, head_dim]`` (HND), last dim
        contiguous; both q's dtype, or both ``torch.float8_e4m3fn`` (an fp8 cache, dequantised on load: the
        kernel reads one byte per element, widens it exactly to f16 and keeps the softmax in fp32).
      q_scale, k_scale: floats multiplying the softmax scale (``sm_scale * q_scale * k_scale`` on the raw
        q . k; for an fp8 cache ``k_scale`` is its per-tensor dequantisation scale).  v_scale: a float
        multiplying the output in the kernel's fp32 epilogue, before the rounding to q's dtype (the fp8 V
        cache's dequantisation scale).  None: 1.
      Other arguments as :meth:`BatchDecodeWithPagedKVCacheWrapper.plan` / ``run``.

    Returns:
      o ``[num_qo_heads, head_dim]`` in q's dtype, or ``(o, lse[num_qo_heads])`` (base-2 LSE of the logits
      ``sm_scale * q_scale * k_scale * q . k``).

    The KV is served as a paged cache of page size 1 over the contiguous rows (no copy), by a wrapper made,
    planned and dropped on every call (no device state outlives the call).  Under ``torch.compile`` the call
    is the custom op ``cutedsl_attn::single_decode``.

    Raises:
      KeyError: ``kv_layout`` not NHD/HND (as FlashInfer).  TypeError / ValueError: a non-tensor or wrongly
      shaped q / k / v, q / k / v not on one CUDA device (before any planning), k and v shapes differing, q's head_dim not k's, a scale that is not a finite float; the
      checks of :meth:`BatchDecodeWithPagedKVCacheWrapper.plan` / ``run`` (head dims, head counts, window).
      NotImplementedError: a q dtype other than fp16/bf16; k and v of different dtypes; a cache dtype other
      than q's or ``torch.float8_e4m3fn`` (``torch.float8_e5m2`` included); a scale given as a tensor;
      ``pos_encoding_mode="ROPE_LLAMA"`` with an fp8 cache; what the wrapper does not serve.
    """
    check_kv_layout(kv_layout)
    check_bool("use_tensor_cores", use_tensor_cores)
    check_bool("return_lse", return_lse)
    # the custom op's ``float?`` arguments, checked as run() / plan() check them (a string never becomes a float)
    q_scale, k_scale, v_scale = (None if x is None else run_scale(n, x)
                                 for n, x in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)))
    logits_soft_cap, sm_scale, rope_scale, rope_theta = (
        check_float(n, x, positive=False) for n, x in (("logits_soft_cap", logits_soft_cap), ("sm_scale", sm_scale),
                                                       ("rope_scale", rope_scale), ("rope_theta", rope_theta)))
    if torch.compiler.is_compiling():  # plan() is host work: the whole call is one custom op in the graph
        o, lse = _single_decode_op(q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale,
                                   v_scale, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)
        return (o, lse) if return_lse else o
    o, lse = _single_decode(q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale, v_scale,
                            window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)
    return (o, lse) if return_lse else o


def _kv_data_type(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """The plan's ``kv_data_type``: q's dtype (a 16-bit cache) or ``torch.float8_e4m3fn``; NotImplementedError
    naming the dtypes for anything else."""
    if q.dtype not in _Q_DTYPES:
        raise NotImplementedError(f"q dtype {q.dtype} is not supported; supported: torch.float16, torch.bfloat16")
    if k.dtype != v.dtype:
        raise NotImplementedError(
            f"k and v dtypes must match (got {k.dtype}, {v.dtype}): single_decode_with_kv_cache serves k and v of "
            f"q's dtype ({q.dtype}) or both {_FP8_KV}")
    if k.dtype not in (q.dtype, _FP8_KV):
        raise NotImplementedError(
            f"a {k.dtype} KV with a {q.dtype} q is not supported: single_decode_with_kv_cache serves k and v of q's "
            f"dtype, or an fp8 cache of {_FP8_KV} (per-tensor k_scale / v_scale)")
    return k.dtype


def _single_decode(q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale, v_scale, window_left,
                   logits_soft_cap, sm_scale, rope_scale, rope_theta):
    """The eager body of :func:`single_decode_with_kv_cache`: ``(o [Hq, D], lse [Hq])``."""
    check_tensor("q", q, ndim=2)
    check_tensor("k", k, ndim=3)
    check_tensor("v", v, ndim=3)
    devices = [("q", q), ("k", k), ("v", v)]
    check_one_device("single_decode_with_kv_cache", devices)  # CUDA once the shapes and dtypes are checked
    if kv_layout == "HND":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    kv_len, hkv, d = k.shape
    hq = q.shape[0]
    if q.shape[1] != d:
        raise ValueError(f"q head_dim {q.shape[1]} != k head_dim {d}")
    kv_dt = _kv_data_type(q, k, v)
    check_head_dim(d)
    check_heads(hq, hkv)
    check_devices("single_decode_with_kv_cache", devices)
    dev = q.device
    # a wrapper, workspace and page ids per call, dropped after it: no device tensor outlives the call (a
    # CUDA-graph pool, e.g. of torch.compile's reduce-overhead mode, must hold only the outputs)
    ws = torch.empty(_single_workspace_bytes(kv_len, hq, d), dtype=torch.uint8, device=dev)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    wrapper._launch_entry = "single_decode_with_kv_cache"  # a host launch's error names this entry point
    indptr = torch.tensor([0, kv_len], dtype=torch.int32)
    last = torch.tensor([1 if kv_len > 0 else 0], dtype=torch.int32)
    with staged_host_copies():  # the same call may be captured next (CUDA graphs)
        wrapper.plan(
            indptr, torch.arange(max(kv_len, 1), dtype=torch.int32, device=dev), last, hq, hkv, d, 1,
            pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
            q_data_type=q.dtype, kv_data_type=kv_dt, sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
        )
    o, lse = wrapper.run(q.unsqueeze(0), (k.unsqueeze(1), v.unsqueeze(1)), q_scale=q_scale, k_scale=k_scale,
                         v_scale=v_scale, return_lse=True)
    return o[0], lse[0]


def _single_workspace_bytes(kv_len: int, hq: int, d: int) -> int:
    """Split-KV partials for one request: at most one piece per 16 tokens (``CHUNK``), 128 pieces."""
    pieces = min(128, max(1, -(-kv_len // 16)))
    return pieces * hq * (d + 1) * 4 + 512


@torch.library.custom_op("cutedsl_attn::single_decode", mutates_args=())
def _single_decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layout: str, pos_encoding_mode: str,
                      use_tensor_cores: bool, q_scale: float | None, k_scale: float | None, v_scale: float | None,
                      window_left: int, logits_soft_cap: float | None, sm_scale: float | None,
                      rope_scale: float | None, rope_theta: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    o, lse = _single_decode(q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale, v_scale,
                            window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)
    return o, lse


@_single_decode_op.register_fake
def _(q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale, v_scale, window_left,
      logits_soft_cap, sm_scale, rope_scale, rope_theta):
    return torch.empty_like(q), q.new_empty((q.shape[0],), dtype=torch.float32)
