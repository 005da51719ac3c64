"""cuDNN frontend graphs for paged batch decode (SDPA forward, ``s_q = q_len_per_req``), the graph side of
``cudnn_batch_decode_with_kv_cache``.

One SDPA forward node per graph (FlashInfer's paged-decode graph recipe, with cudnn-frontend 1.32's SDPA
attributes and support rules):

* Q ``[B * m, Hq, D]`` (``m = q_len_per_req``, a request's rows consecutive) is declared as the strided
  4-D view ``(B, Hq, m, D)`` with strides ``(m * s_row, s_head, s_row, 1)``: no copy, any row/head
  stride (a slice of a packed QKV projection), no ragged offsets.
* K/V: the caches as ``(num_pages, Hkv, page_size, D)`` with the caller's strides (an NHD pool is its
  ``transpose(1, 2)`` view), a dense block table ``(B, 1, P, 1)`` int32 bound to both
  ``paged_attention_k_table`` and ``paged_attention_v_table``, and ``paged_attention_max_seq_len_kv``
  = the declared maximum KV length (:func:`bucket_max_kv`).
* ``use_padding_mask=True`` with int32 ``seq_len_q`` (all ``m``) and ``seq_len_kv`` tensors
  ``(B, 1, 1, 1)`` (cuDNN's paged caches need both).
* ``m > 1`` or a window: FlashInfer's bottom-right causal diagonal, ``diagonal_alignment=BOTTOM_RIGHT``
  with ``diagonal_band_right_bound=0``; ``window_left=w`` is ``diagonal_band_left_bound=w+1`` (cuDNN's
  bound counts the diagonal).  Sinks: ``sink_token`` fp32 ``(1, Hq, 1, 1)``.
* O is bound to a contiguous ``[B * m, Hq, Dvo]`` buffer (``(B, Hq, m, Dvo)`` with strides
  ``(m * Hq * Dvo, Dvo, Hq * Dvo, 1)``); Stats to a contiguous fp32 ``[B * m, Hq]`` buffer (natural
  log, ``max + ln sum exp`` of the scaled scores, the sink included; the caller multiplies by
  :data:`LOG2E` for FlashInfer's base 2).
* ``attn_scale`` is a Python float baked into the graph.

Graphs are cached process-wide by :class:`DecodeGraphKey`: device, every tensor's dtype, shape and
strides (q's 4-D view, both caches, the block table), head counts and dims, page size, batch size,
``q_len_per_req``, the *bucketed* maximum KV length, scale, window, sink / LSE presence and the
CUDA-graph flag.  KV lengths and block-table contents are device data bound at execute, so changing them
(a decode step) reuses the graph; ``max_sequence_kv`` only moves the key when it crosses a power of two.

Bottom layer: imports nothing from ``cutedsl_attn`` above ``cudnn/`` (the handle, dtype map and import
helpers are shared with :mod:`cutedsl_attn.cudnn.prefill`).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

import torch

from .prefill import LOG2E, GraphCache, _cudnn_dtype, _handle, _next_pow2, cudnn_available, require_cudnn

__all__ = [
    "LOG2E",
    "SEQ_KV_BUCKET_MIN",
    "DecodeGraph",
    "DecodeGraphKey",
    "bucket_max_kv",
    "clear_graph_cache",
    "cudnn_available",
    "decline_message",
    "get_graph",
    "graph_cache_info",
    "graph_key",
    "q_graph_view",
    "require_cudnn",
    "bind_map",
    "run_graph",
    "seq_len_q_tensor",
    "versions",
]

#: smallest declared maximum KV length: short batches share one graph
SEQ_KV_BUCKET_MIN = 128

#: who serves what cuDNN declines (quoted in every decline message)
SERVED_BY = ("BatchDecodeWithPagedKVCacheWrapper with backend='cute' (or the default 'auto'): this package's CuTe "
             "DSL decode kernel, which serves fp16 and bf16, return_lse, window_left, sinks and q_len_per_req > 1")


def bucket_max_kv(max_sequence_kv: int, capacity: int) -> int:
    """Declared maximum KV length of the graph: the next power of two of ``max_sequence_kv`` (at least
    :data:`SEQ_KV_BUCKET_MIN`), capped at the block table's ``capacity`` (``pages_per_seq * page_size``,
    which no request can exceed)."""
    if max_sequence_kv < 1 or capacity < 1:
        raise ValueError(f"max_sequence_kv and capacity must be >= 1, got {max_sequence_kv}, {capacity}")
    return min(max(SEQ_KV_BUCKET_MIN, _next_pow2(int(max_sequence_kv))), int(capacity))


def versions() -> str:
    """``"cuDNN <backend>, cudnn-frontend <version>"`` as loaded in this process (the frontend named as
    not installed when ``import cudnn`` fails; the backend then from torch)."""
    try:
        cudnn = require_cudnn()
    except ImportError:
        v = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        return f"cuDNN {_fmt_backend(v)}, cudnn-frontend not installed"
    try:
        bv = cudnn.backend_version()
    except Exception:  # noqa: BLE001 -- libcudnn missing: report what is known
        bv = None
    return f"cuDNN {_fmt_backend(bv)}, cudnn-frontend {getattr(cudnn, '__version__', '?')}"


def _fmt_backend(v) -> str:
    if not v:
        return "unknown"
    v = int(v)
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 10000 else str(v)


# ----------------------------------------------------------------------------- graph key
@dataclasses.dataclass(frozen=True)
class DecodeGraphKey:
    """Everything one cuDNN decode graph bakes in; the graph-cache key.

    Attributes:
      device_index: CUDA device ordinal.
      dtype, kv_dtype: q/o dtype and k/v cache dtype (float16 / bfloat16; equal today).
      batch: B (requests).  q_len_per_req: m (query rows per request).
      num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, page_size: geometry.
      q_layout: ``(dims, strides)`` of q's 4-D ``(B, Hq, m, D)`` view.
      k_layout, v_layout: ``(shape, strides)`` of the ``(num_pages, Hkv, page_size, D)`` caches.
      table_width: block-table columns P (the table is bound contiguous, ``(B, 1, P, 1)``).
      max_kv: declared maximum KV length (:func:`bucket_max_kv`).
      sm_scale: softmax scale (``attn_scale``, baked as a float).
      window_left: FlashInfer's left window (-1: off).  sinks: a ``sink_token`` input.
      return_lse: the graph writes Stats.  cuda_graph: built with ``is_cuda_graph_replay_expected``.
    """

    device_index: int
    dtype: torch.dtype
    kv_dtype: torch.dtype
    batch: int
    q_len_per_req: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_vo: int
    page_size: int
    q_layout: tuple
    k_layout: tuple
    v_layout: tuple
    table_width: int
    max_kv: int
    sm_scale: float
    window_left: int
    sinks: bool
    return_lse: bool
    cuda_graph: bool = False

    def __post_init__(self):
        for n in ("dtype", "kv_dtype"):
            if getattr(self, n) not in (torch.float16, torch.bfloat16):
                raise ValueError(f"cuDNN decode graphs take float16/bfloat16, got {n}={getattr(self, n)}")
        for n in ("batch", "q_len_per_req", "num_qo_heads", "num_kv_heads", "head_dim_qk", "head_dim_vo",
                  "page_size", "table_width", "max_kv"):
            if getattr(self, n) < 1:
                raise ValueError(f"{n} must be >= 1, got {getattr(self, n)}")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(f"num_qo_heads ({self.num_qo_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.window_left < -1:
            raise ValueError(f"window_left must be >= -1, got {self.window_left}")
        if self.max_kv > self.table_width * self.page_size:
            raise ValueError(f"max_kv ({self.max_kv}) exceeds the block table's capacity "
                             f"({self.table_width} pages x {self.page_size})")

    @property
    def causal(self) -> bool:
        """The graph carries the bottom-right diagonal (multi-token rows, or a window's right edge)."""
        return self.q_len_per_req > 1 or self.window_left >= 0


def q_graph_view(q: torch.Tensor, q_len_per_req: int) -> torch.Tensor:
    """q ``[B * m, Hq, D]`` as the ``(B, Hq, m, D)`` strided view cuDNN reads (no copy, any strides)."""
    m = int(q_len_per_req)
    return q.unflatten(0, (q.shape[0] // m, m)).transpose(1, 2)


def graph_key(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, table_width: int,
              max_sequence_kv: int, sm_scale: float, q_len_per_req: int = 1, window_left: int = -1,
              sinks: bool = False, return_lse: bool = False, cuda_graph: bool = False) -> DecodeGraphKey:
    """The cache key for a call on these tensors (tensor-free beyond shapes/strides/dtypes: runs on CPU).

    ``q``: ``[B * m, Hq, D]`` as given (its strides are keyed through :func:`q_graph_view`); ``k_cache`` /
    ``v_cache``: ``(num_pages, Hkv, page_size, D)`` views; ``table_width``: block-table columns.
    """
    m = int(q_len_per_req)
    qv = q_graph_view(q, m)
    ps = int(k_cache.shape[2])
    dev = q.device.index if q.device.type == "cuda" else 0
    return DecodeGraphKey(
        device_index=dev or 0, dtype=q.dtype, kv_dtype=k_cache.dtype, batch=int(qv.shape[0]), q_len_per_req=m,
        num_qo_heads=int(q.shape[1]), num_kv_heads=int(k_cache.shape[1]), head_dim_qk=int(q.shape[2]),
        head_dim_vo=int(v_cache.shape[3]), page_size=ps,
        q_layout=(tuple(qv.shape), tuple(qv.stride())),
        k_layout=(tuple(k_cache.shape), tuple(k_cache.stride())),
        v_layout=(tuple(v_cache.shape), tuple(v_cache.stride())),
        table_width=int(table_width), max_kv=bucket_max_kv(max_sequence_kv, int(table_width) * ps),
        sm_scale=float(sm_scale), window_left=int(window_left), sinks=bool(sinks), return_lse=bool(return_lse),
        cuda_graph=bool(cuda_graph),
    )


def decline_message(key: DecodeGraphKey, reason: str = "") -> str:
    """Why cuDNN does not serve ``key``: the features asked for, the loaded versions, what serves it."""
    feats = [f"{key.dtype} decode", f"q_len_per_req={key.q_len_per_req}",
             f"GQA {key.num_qo_heads}/{key.num_kv_heads}", f"head_dim {key.head_dim_qk}/{key.head_dim_vo}",
             f"page_size {key.page_size}"]
    if key.window_left >= 0:
        feats.append(f"window_left={key.window_left}")
    if key.sinks:
        feats.append("attention sinks" + (" at q_len_per_req == 1 (cuDNN's backend engines decline a sink in "
                                          "decode-only mode; cudnn-frontend >= 1.30 serves it only with its "
                                          "SM100 FROST engine)" if key.q_len_per_req == 1 else ""))
    if key.return_lse:
        feats.append("return_lse")
    msg = (f"the loaded cuDNN stack ({versions()}) has no engine for this decode graph: {', '.join(feats)}. "
           f"Served instead by {SERVED_BY}.")
    return msg + (f" cuDNN said: {reason}" if reason else "")


# ----------------------------------------------------------------------------- graphs and their cache
class _UID(enum.IntEnum):
    Q = 1
    K = 2
    V = 3
    O = 10  # noqa: E741
    STATS = 11
    SEQ_LEN_Q = 20
    SEQ_LEN_KV = 21
    TABLE_K = 40
    TABLE_V = 41
    SINKS = 50


class DecodeGraph:
    """One built cuDNN decode graph and its workspace size (bytes)."""

    __slots__ = ("key", "graph", "workspace_size")

    def __init__(self, key: DecodeGraphKey, graph, workspace_size: int):
        self.key = key
        self.graph = graph
        self.workspace_size = int(workspace_size)


_GRAPHS = GraphCache()
# constant seq_len_q tensors, never evicted: a captured CUDA graph keeps reading them
_SEQ_LEN_Q: dict = {}


def graph_cache_info() -> dict:
    """``{"builds": ..., "hits": ..., "size": ...}`` since import (or the last :func:`clear_graph_cache`)."""
    return _GRAPHS.info()


def clear_graph_cache() -> None:
    """Drop every cached decode graph and reset the counters (the seq_len_q constants stay)."""
    _GRAPHS.clear()


def seq_len_q_tensor(device: torch.device, batch: int, q_len_per_req: int) -> torch.Tensor:
    """The int32 ``(B, 1, 1, 1)`` tensor of ``q_len_per_req``, one per (device, B, m), kept for the process."""
    k = (device.index or 0, int(batch), int(q_len_per_req))
    t = _SEQ_LEN_Q.get(k)
    if t is None:
        t = torch.full((batch, 1, 1, 1), q_len_per_req, dtype=torch.int32, device=device)
        _SEQ_LEN_Q[k] = t
    return t


def _build(key: DecodeGraphKey) -> DecodeGraph:
    cudnn = require_cudnn()
    device = torch.device("cuda", key.device_index)
    handle = _handle(device)
    io = _cudnn_dtype(cudnn, key.dtype)
    kv_io = _cudnn_dtype(cudnn, key.kv_dtype)
    f32, i32 = cudnn.data_type.FLOAT, cudnn.data_type.INT32
    B, m, Hq, Dvo, P = key.batch, key.q_len_per_req, key.num_qo_heads, key.head_dim_vo, key.table_width

    kw = dict(name="cutedsl_attn_decode", io_data_type=io, intermediate_data_type=f32, compute_data_type=f32,
              handle=handle)
    if key.cuda_graph:
        try:
            g = cudnn.pygraph(**kw, is_cuda_graph_replay_expected=True)
        except TypeError:  # frontends before the keyword: it only steers python-engine heuristics
            g = cudnn.pygraph(**kw)
    else:
        g = cudnn.pygraph(**kw)

    (q_dim, q_stride), (k_shape, k_stride), (v_shape, v_stride) = key.q_layout, key.k_layout, key.v_layout
    q = g.tensor(name="q", dim=list(q_dim), stride=list(q_stride), data_type=io, uid=int(_UID.Q))
    k = g.tensor(name="k_cache", dim=list(k_shape), stride=list(k_stride), data_type=kv_io, uid=int(_UID.K))
    v = g.tensor(name="v_cache", dim=list(v_shape), stride=list(v_stride), data_type=kv_io, uid=int(_UID.V))
    tk = g.tensor(name="block_table_k", dim=[B, 1, P, 1], stride=[P, P, 1, 1], data_type=i32, uid=int(_UID.TABLE_K))
    tv = g.tensor(name="block_table_v", dim=[B, 1, P, 1], stride=[P, P, 1, 1], data_type=i32, uid=int(_UID.TABLE_V))
    seq_q = g.tensor(name="seq_len_q", dim=[B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32,
                     uid=int(_UID.SEQ_LEN_Q))
    seq_kv = g.tensor(name="seq_len_kv", dim=[B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32,
                      uid=int(_UID.SEQ_LEN_KV))
    extra = {}
    if key.causal:
        extra = dict(diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT, diagonal_band_right_bound=0)
        if key.window_left >= 0:
            extra["diagonal_band_left_bound"] = key.window_left + 1
    if key.sinks:
        extra["sink_token"] = g.tensor(name="sinks", dim=[1, Hq, 1, 1], stride=[Hq, 1, 1, 1], data_type=f32,
                                       uid=int(_UID.SINKS))
    o, stats = g.sdpa(
        name="sdpa", q=q, k=k, v=v, attn_scale=float(key.sm_scale), generate_stats=bool(key.return_lse),
        use_padding_mask=True, seq_len_q=seq_q, seq_len_kv=seq_kv, paged_attention_k_table=tk,
        paged_attention_v_table=tv, paged_attention_max_seq_len_kv=key.max_kv, compute_data_type=f32, **extra,
    )
    o.set_output(True).set_dim([B, Hq, m, Dvo]).set_stride([m * Hq * Dvo, Dvo, Hq * Dvo, 1]).set_data_type(io)
    o.set_uid(int(_UID.O))
    if key.return_lse:
        stats.set_output(True).set_dim([B, Hq, m, 1]).set_stride([m * Hq, 1, Hq, 1]).set_data_type(f32)
        stats.set_uid(int(_UID.STATS))
    try:
        g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    except cudnn.cudnnGraphNotSupportedError as e:
        raise NotImplementedError(decline_message(key, str(e))) from e
    return DecodeGraph(key, g, g.get_workspace_size())


def get_graph(key: DecodeGraphKey, *, build: bool = True) -> Optional[DecodeGraph]:
    """The cached graph for ``key``, built on a miss (``build=False``: None on a miss).

    Raises:
      ImportError: cudnn-frontend missing.  NotImplementedError: no cuDNN engine serves the graph
      (:func:`decline_message`; ``cudnnGraphNotSupportedError`` chained).
    """
    return _GRAPHS.get(key, _build if build else None)


def bind_map(key: DecodeGraphKey, *, q, k, v, out, stats, seq_len_q, seq_len_kv, block_table, sinks) -> dict:
    """``{uid: tensor}`` for ``execute``: each tensor viewed (no copy) with exactly the dims and strides the graph
    declares -- ``out`` as ``(B, Hq, m, Dvo)``, ``stats`` as ``(B, Hq, m, 1)``, lengths ``(B, 1, 1, 1)``, the
    table ``(B, 1, P, 1)``, sinks ``(1, Hq, 1, 1)``.  Inputs as :func:`run_graph` takes them."""
    B, m, Hq, P = key.batch, key.q_len_per_req, key.num_qo_heads, key.table_width
    binds = {
        int(_UID.Q): q, int(_UID.K): k, int(_UID.V): v,
        int(_UID.O): out.unflatten(0, (B, m)).transpose(1, 2),
        int(_UID.SEQ_LEN_Q): seq_len_q.reshape(B, 1, 1, 1), int(_UID.SEQ_LEN_KV): seq_len_kv.reshape(B, 1, 1, 1),
        int(_UID.TABLE_K): block_table.reshape(B, 1, P, 1), int(_UID.TABLE_V): block_table.reshape(B, 1, P, 1),
    }
    if key.return_lse:
        binds[int(_UID.STATS)] = stats.unflatten(0, (B, m)).transpose(1, 2).unsqueeze(-1)
    if key.sinks:
        binds[int(_UID.SINKS)] = sinks.reshape(1, Hq, 1, 1)
    return binds


def run_graph(key: DecodeGraphKey, *, q, k, v, out, stats, seq_len_kv, block_table, sinks=None,
              workspace=None) -> DecodeGraph:
    """Fetch/build the graph for ``key`` and execute it once on torch's current stream.

    Tensors are bound by pointer and must have the layouts the key declares: ``q`` the 4-D view of
    :func:`q_graph_view`, ``out`` contiguous ``[B * m, Hq, Dvo]``, ``stats`` contiguous fp32 ``[B * m, Hq]``
    or None, ``seq_len_kv`` contiguous int32 with B entries, ``block_table`` contiguous int32 ``[B, P]``,
    ``sinks`` contiguous fp32 ``[Hq]`` or None.  ``workspace``: used when it holds the graph's workspace;
    otherwise a buffer is allocated for the call.  During CUDA-graph capture the graph must already be
    cached (``RuntimeError`` otherwise: building is host work that capture cannot hold).
    """
    device = torch.device("cuda", key.device_index)
    with torch.cuda.device(device):
        capturing = torch.cuda.is_current_stream_capturing()
        graph = get_graph(key, build=not capturing)
        if graph is None:
            raise RuntimeError("cudnn_batch_decode_with_kv_cache: this call's cuDNN graph is not built yet and "
                               "cannot be built during CUDA-graph capture; run the same call once before "
                               f"capturing ({key})")
        binds = bind_map(key, q=q, k=k, v=v, out=out, stats=stats,
                         seq_len_q=seq_len_q_tensor(device, key.batch, key.q_len_per_req), seq_len_kv=seq_len_kv,
                         block_table=block_table, sinks=sinks)
        need = graph.workspace_size
        ws = workspace
        if need > 0 and (ws is None or ws.numel() * ws.element_size() < need or not ws.is_contiguous()):
            ws = torch.empty(need, dtype=torch.uint8, device=device)
        graph.graph.execute(binds, ws, handle=_handle(device))
    return graph
