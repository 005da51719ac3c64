"""``backend="cudnn"`` (and ``"auto"`` where it resolves to cuDNN) of ``BatchDecodeWithPagedKVCacheWrapper``: the
plan's dense block table and KV lengths on the device, and the run on the cuDNN decode graph of
:mod:`cutedsl_attn.api.cudnn_decode` (``prepare_call`` / ``execute_call``, graphs cached by shape key).

Compatible re-plans (same geometry, dtypes, table width and length bucket) keep the prepared graph: lengths and
page ids are device data bound at execute.  In CUDA-graph mode the table and lengths live in wrapper buffers of
fixed address, the graph declares the table's full capacity as its maximum KV length (a re-plan never moves the
graph key), and the graph is built at the first eager run (run once before capturing).
"""

from __future__ import annotations

import dataclasses

import torch

from .. import dispatch
from ..cudnn import decode as cd
from . import cudnn_decode as _cdd
from ._common import run_scale
from ._graph import to_device

#: returned by :func:`run` when ``"auto"`` hands the call back to the CuTe DSL kernel planned beside it
DECLINED = object()

_UNSERVED = {"rope": "pos_encoding_mode='ROPE_LLAMA'", "alibi": "pos_encoding_mode='ALIBI'",
             "soft_cap": "logits_soft_cap", "fp8_kv": "an fp8 KV cache",
             # an empty request's row is not defined by the graph (cudnn_batch_decode_with_kv_cache leaves such
             # rows to the caller: its actual_seq_lens_kv are device data it does not read back)
             "empty_request": "a request with no KV (kv length 0)"}


@dataclasses.dataclass
class CudnnDecodePlan:
    """The cuDNN side of a decode plan: ``table`` int32 ``[B, P]`` and ``seq_lens`` int32 ``[B]`` on the device,
    the declared ``max_kv``, ``q_len`` rows per request, the planned ``sm_scale`` and ``window_left``, and whether
    cuDNN was asked for (``explicit``) or chosen by ``"auto"``."""

    table: torch.Tensor
    seq_lens: torch.Tensor
    max_kv: int
    q_len: int
    sm_scale: float
    window_left: int
    explicit: bool


def require_frontend(what: str) -> None:
    """NotImplementedError (naming the versions and what serves the decode instead) when cudnn-frontend is missing."""
    try:
        cd.require_cudnn()
    except ImportError as e:
        raise NotImplementedError(
            f"{what} needs the cuDNN frontend Python package ({cd.versions()}; pip install 'cutedsl-attn[cudnn]', "
            f"i.e. nvidia-cudnn-frontend). The same decode is served by {cd.SERVED_BY}.") from e


def check_features(features) -> None:
    """NotImplementedError for a plan feature cuDNN's decode graph does not serve (explicit ``backend="cudnn"``)."""
    bad = [_UNSERVED[f] for f in features if f in _UNSERVED]
    if bad:
        raise NotImplementedError(
            f"backend='cudnn' does not serve {', '.join(bad)} (cuDNN's decode graph has no RoPE, ALiBi, soft cap, "
            f"fp8 KV or empty requests; {cd.versions()}); served by {cd.SERVED_BY}")


def resolve(wrapper, kv_lens, num_kv_heads, head_dim, q_dt, kv_dt, pos_encoding_mode, cap, window_left, q_len,
            split_controls, use_table) -> str:
    """``"cute"`` or ``"cudnn"`` for a decode plan (the rule is ``dispatch.decode_backend``); in CUDA-graph mode
    the first plan's (a capture keeps it).  Explicit ``"cudnn"`` raises NotImplementedError for features it does
    not serve and without the frontend."""
    feats = [f for f, on in (("rope", pos_encoding_mode == "ROPE_LLAMA"), ("alibi", pos_encoding_mode == "ALIBI"),
                             ("soft_cap", cap > 0), ("fp8_kv", kv_dt != q_dt), ("window", window_left >= 0),
                             # a request with no key: ours writes O = 0 and LSE = -inf, cuDNN leaves its own values
                             ("empty_request", bool(kv_lens.numel()) and int(kv_lens.min()) == 0)) if on]
    if wrapper._backend == "cudnn" and not split_controls:
        check_features(feats)
        require_frontend("BatchDecodeWithPagedKVCacheWrapper(backend='cudnn')")
    n = int(kv_lens.numel())
    backend = dispatch.decode_backend(
        wrapper._backend, batch_size=n, max_kv_len=int(kv_lens.max()) if n else 0,
        kv_bytes=int(kv_lens.sum()) * num_kv_heads * head_dim * 2 * kv_dt.itemsize, head_dim=head_dim,
        q_len_per_req=q_len, features=feats, keep_split_controls=split_controls, cuda_graph=wrapper._use_cuda_graph,
        caller_block_table=use_table)
    if wrapper._use_cuda_graph:
        wrapper._frozen_backend = wrapper._frozen_backend or backend
        backend = wrapper._frozen_backend
    return backend


def _dense_table(use_table, flat, page_offsets, kv_lens, page_size: int, width: int, device) -> torch.Tensor:
    """``[B, width]`` int32 page ids on ``device``: request b's pages in order, the tail padded with its first page
    (any valid id: cuDNN's one-row graph never reads past a length, its multi-row graph reads whole key tiles)."""
    B = kv_lens.numel()
    if use_table and flat.numel() == B * width:
        return flat.view(B, width)
    n = (kv_lens + page_size - 1) // page_size
    cols = torch.arange(width, dtype=torch.int64).reshape(1, width)
    idx = page_offsets.reshape(B, 1) + torch.minimum(cols, (n - 1).clamp(min=0).reshape(B, 1))
    if flat.numel() == 0:
        return torch.zeros((B, width), dtype=torch.int32, device=device)
    idx = idx.clamp(0, flat.numel() - 1)
    return flat[to_device(idx.reshape(-1), device, True)].view(B, width)


def plan(wrapper, *, explicit: bool, use_table: bool, flat, page_offsets, kv_lens, page_size: int, q_len: int,
         sm_scale: float, window_left: int, non_blocking: bool) -> CudnnDecodePlan:
    """The cuDNN half of ``plan()``: the dense table (the caller's, or one built from CSR) and the lengths, in
    the wrapper's fixed buffers in CUDA-graph mode.

    Raises ValueError when, in CUDA-graph mode, the table would be wider than the first plan's (pass
    ``block_tables`` of a fixed width)."""
    kv_lens = kv_lens.to(torch.int64)
    B = kv_lens.numel()
    need = int(-(-kv_lens.max() // page_size)) if B else 1
    width = max(1, flat.numel() // max(B, 1) if use_table else need)
    max_kv = max(1, int(kv_lens.max()) if B else 1)
    if q_len > 1:  # cuDNN's multi-row graph reads whole 128-key tiles: table columns up to that boundary
        tile = _cdd._MULTIROW_KV_TILE
        width = max(width, -(-(-(-max_kv // tile) * tile) // page_size))
    fixed = wrapper._use_cuda_graph
    buf = wrapper._bufs.get("cudnn_table") if fixed else None
    if buf is not None:
        if width > buf.shape[1]:
            raise ValueError(f"the cuDNN block table needs {width} columns, more than the first plan's "
                             f"{buf.shape[1]}: in CUDA-graph mode it cannot grow (pass block_tables of a fixed width)")
        width = buf.shape[1]
    table = _dense_table(use_table, flat, page_offsets, kv_lens, page_size, width, wrapper.device)
    lens32 = kv_lens.to(torch.int32)
    if fixed:
        table = wrapper._bufs.copy("cudnn_table", table, non_blocking=non_blocking)
        seq_lens = wrapper._bufs.copy("cudnn_seq_lens", lens32, non_blocking=non_blocking)
        max_kv = width * page_size  # the graph key stays put across re-plans (a captured graph keeps it)
    else:
        table = table if table.is_contiguous() else table.contiguous()
        seq_lens = to_device(lens32, wrapper.device, non_blocking)
    return CudnnDecodePlan(table, seq_lens, max_kv, q_len, sm_scale, window_left, explicit)


def _on_cuda(t: torch.Tensor) -> bool:
    """Whether ``t`` is on a CUDA device (the one seam CPU tests replace to run the call on an emulated graph)."""
    return t.device.type == "cuda"


def run(wrapper, cp: CudnnDecodePlan, q, paged_kv_cache, *, q_scale, k_scale, v_scale, out, lse, return_lse, sinks):
    """The decode on cuDNN's graph, or :data:`DECLINED` when ``"auto"`` leaves this call to the CuTe DSL kernel:
    sinks or a ``v_scale`` (the graph has no output scale), or a capture whose graph is not built yet.

    Raises (explicit ``"cudnn"``): NotImplementedError for a ``v_scale`` other than 1 and for graphs cuDNN
    declines (a sink at one row per request on cuDNN 9.19); ValueError / TypeError as
    ``cudnn_batch_decode_with_kv_cache``; RuntimeError for a graph that would be built during capture."""
    vs = run_scale("v_scale", v_scale)
    if not cp.explicit and (sinks is not None or vs != 1.0):
        return DECLINED
    if vs != 1.0:
        raise NotImplementedError(f"v_scale={v_scale} is not supported with backend='cudnn' (cuDNN's decode graph has "
                                  f"no output scale); served by {cd.SERVED_BY}")
    k, v = wrapper._split_cache(paged_kv_cache)  # NHD-ordered views; cuDNN takes their (pages, H, page, D) view
    scale = cp.sm_scale * run_scale("q_scale", q_scale) * run_scale("k_scale", k_scale)
    call = _cdd.prepare_call(
        q, k.transpose(1, 2), v.transpose(1, 2), scale, wrapper._workspace, max_sequence_kv=cp.max_kv,
        actual_seq_lens_kv=cp.seq_lens, block_tables=cp.table, is_cuda_graph_compatible=wrapper._use_cuda_graph,
        batch_offsets_q=None, batch_offsets_o=None, batch_offsets_k=None, batch_offsets_v=None, out=out,
        return_lse=bool(return_lse), lse=lse if return_lse else None, q_len_per_req=cp.q_len,
        window_left=cp.window_left, sinks=sinks)
    capturing = q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not cp.explicit and capturing and cd.get_graph(call.key, build=False) is None:
        return DECLINED
    if not _on_cuda(q):
        raise ValueError(f"backend='cudnn' runs on a CUDA device; q is on {q.device}")
    return _cdd.execute_call(call)
