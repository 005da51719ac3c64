"""cuDNN frontend graphs for batched prefill attention (SDPA forward), the ``backend="cudnn"`` path.

Every ``backend="cudnn"`` call in this package runs one cuDNN frontend graph (``cudnn.pygraph``)
holding a single SDPA forward node; there is no other fallback behind it.  This module owns the
graph construction, the graph cache, the cuDNN handle and the plan-time device metadata; the
FlashInfer-shaped argument handling lives in :mod:`cutedsl_attn.api.cudnn`.

Graph layout (the cuDNN conventions, read from
cudnn-frontend 1.32's ``_pygraph.py`` / ``node/sdpa_support_surface.h`` and its
``52_sdpa_with_paged_caches`` sample):

* Q ``[total_q, Hq, Dqk]`` (tokens-major, "THD") is declared as the 4-D tensor
  ``(B, Hq, S_q, Dqk)`` with strides ``(S_q * tok, head, tok, 1)`` plus a *ragged offset*
  tensor ``(B+1, 1, 1, 1)`` of **element** offsets (``token_offset * tok``); the declared batch
  stride is only a placeholder, cuDNN addresses request ``b`` from its ragged offset.  O (same
  form, ``Dvo``) and, for a packed LSE, Stats ``(B, Hq, S_q, 1)`` with strides
  ``(S_q * Hq, 1, Hq, 1)`` get their own ragged offsets (``token_offset * Hq``).
* Ragged K/V: the same THD form with their own offsets.  Paged K/V: the caches as
  ``(num_pages, Hkv, page_size, D)`` (an NHD cache is passed as its permuted view, any strides),
  a dense block table ``(B, 1, P, 1)`` int32 bound to both ``paged_attention_k_table`` and
  ``paged_attention_v_table``, and ``paged_attention_max_seq_len_kv = S_kv``.
* ``use_padding_mask=True`` with int32 ``seq_len_q`` / ``seq_len_kv`` tensors ``(B, 1, 1, 1)``
  (both mandatory for ragged offsets and for paged caches).
* Causal = FlashInfer's bottom-right diagonal (key ``j`` visible to row ``i`` iff
  ``j <= i + kv_len - qo_len``, per request): ``diagonal_alignment=BOTTOM_RIGHT`` with
  ``diagonal_band_right_bound=0``; cuDNN anchors the diagonal at each request's actual
  ``(seq_len_q[b], seq_len_kv[b])``.  FlashInfer's ``window_left=w`` (keeps ``w+1`` keys, the
  diagonal included) is ``diagonal_band_left_bound=w+1`` on that same alignment; a window
  without ``causal`` is not mapped (``NotImplementedError`` in the API layer).
* ``attn_scale`` is a Python float baked into the graph; Stats are natural-log
  (``max + ln sum exp``) fp32, the API layer multiplies by ``log2(e)`` for FlashInfer's base-2
  LSE.

Graphs are cached process-wide by :class:`PrefillGraphKey` (frozen, hashable): everything the
graph bakes -- device, dtype, the *bucketed* batch size and maximum lengths, head counts and dims,
scale, mask, LSE form, the strides of every bound tensor, the page-table width.  Batch size and
maximum lengths are rounded up (:func:`bucket_batch`, :func:`bucket_seq_len`) so serving batches
of changing composition reuse a handful of graphs; padding requests have zero lengths.

Rows with no visible key (causal rows of a request with ``qo_len > kv_len``, every row of a
request with ``kv_len == 0``) are written here after the graph as O = 0 and Stats = -inf,
FlashInfer's contract, whatever the engine leaves there.

Written against cudnn-frontend 1.32.0 with the cuDNN 9.19 backend of torch 2.11+cu130; verified on an
NVIDIA H200 against the float64 oracle.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import enum
import math
import threading
from typing import Optional

import torch

__all__ = [
    "INSTALL_HINT",
    "LOG2E",
    "SEQ_LEN_BUCKET_MIN",
    "BatchLayout",
    "PrefillGraph",
    "PrefillGraphKey",
    "PrefillPlan",
    "bucket_batch",
    "bucket_seq_len",
    "clear_graph_cache",
    "cudnn_available",
    "describe_batch",
    "get_graph",
    "graph_cache_info",
    "require_cudnn",
    "run_graph",
]

#: multiply a natural-log LSE (cuDNN Stats) by this to get FlashInfer's base-2 LSE
LOG2E = 1.0 / math.log(2.0)

#: smallest declared maximum sequence length: keeps short batches off cuDNN's ``s_q == 1``
#: decode-only path and makes every short batch share one graph
SEQ_LEN_BUCKET_MIN = 128

#: graphs kept in the process-wide cache (FIFO eviction beyond this)
GRAPH_CACHE_SIZE = 128

#: dtype of the ragged-offset tensors (cuDNN accepts INT32 and INT64; INT64 never overflows)
OFFSET_DTYPE = torch.int64

INSTALL_HINT = (
    "backend='cudnn' runs cuDNN frontend graphs and needs the cuDNN frontend Python package: "
    "pip install 'cutedsl-attn[cudnn]' (i.e. nvidia-cudnn-frontend), plus the cuDNN runtime "
    "(torch's CUDA wheels ship it)"
)


# ----------------------------------------------------------------------------- the cudnn module
_cudnn_mod = None
_cudnn_import_error: Optional[BaseException] = None


def require_cudnn():
    """The imported ``cudnn`` (cudnn-frontend) module; imported lazily on first use.

    Raises:
      ImportError: the package is missing or fails to import (message names
        ``nvidia-cudnn-frontend`` and the ``cudnn`` extra; the cause is chained).
    """
    global _cudnn_mod, _cudnn_import_error
    if _cudnn_mod is not None:
        return _cudnn_mod
    try:
        import cudnn  # noqa: PLC0415 -- optional dependency
    except Exception as e:  # ImportError, or OSError/RuntimeError from loading libcudnn
        _cudnn_import_error = e
        raise ImportError(f"{INSTALL_HINT} (import cudnn failed: {type(e).__name__}: {e})") from e
    _cudnn_mod = cudnn
    return cudnn


def cudnn_available() -> bool:
    """Whether ``import cudnn`` (cudnn-frontend) works in this process."""
    try:
        require_cudnn()
        return True
    except ImportError:
        return False


# ----------------------------------------------------------------------------- bucketing
def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def bucket_batch(batch_size: int) -> int:
    """Declared batch size of the graph for ``batch_size`` requests: the next power of two (>= 1)."""
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    return _next_pow2(max(int(batch_size), 1))


def bucket_seq_len(n: int) -> int:
    """Declared maximum sequence length for an actual maximum ``n``: the next power of two, at least
    :data:`SEQ_LEN_BUCKET_MIN`."""
    if n < 0:
        raise ValueError(f"sequence length must be >= 0, got {n}")
    return max(SEQ_LEN_BUCKET_MIN, _next_pow2(int(n)))


# ----------------------------------------------------------------------------- graph key
@dataclasses.dataclass(frozen=True)
class PrefillGraphKey:
    """Everything one cuDNN prefill graph bakes in; the graph-cache key.

    Attributes:
      device_index: CUDA device ordinal.
      dtype: q/k/v/o dtype (``torch.float16`` or ``torch.bfloat16``).
      batch: declared batch size B (the seq-len and offset tensors have B / B+1 rows).
      max_q, max_kv: declared maximum query / KV lengths (``S_q``, ``S_kv``; for paged K/V also
        ``paged_attention_max_seq_len_kv``).
      num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo: attention geometry.
      sm_scale: softmax scale (``attn_scale``, baked as a float).
      causal: bottom-right causal diagonal.  window_left: FlashInfer's left window (-1: off;
        needs ``causal``).
      return_lse: the graph writes Stats.  packed_lse: Stats are tokens-major ``[total_q, Hq]``
        with a ragged offset (else padded ``[B, S_q, Hq]``).
      q_strides, o_strides: ``(token, head)`` element strides of q and out (last dim contiguous).
      paged: K/V are paged caches.  k_layout / v_layout: ragged: ``(token, head)`` strides;
        paged: ``(shape, strides)`` of the ``(num_pages, Hkv, page_size, D)`` view.
      table_width: block-table columns (paged), 0 for ragged.
      offset_dtype: dtype of the ragged-offset tensors.
    """

    device_index: int
    dtype: torch.dtype
    batch: int
    max_q: int
    max_kv: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_vo: int
    sm_scale: float
    causal: bool
    window_left: int
    return_lse: bool
    packed_lse: bool
    q_strides: tuple
    o_strides: tuple
    paged: bool
    k_layout: tuple
    v_layout: tuple
    table_width: int = 0
    offset_dtype: torch.dtype = OFFSET_DTYPE

    def __post_init__(self):
        if self.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"cuDNN prefill graphs take float16/bfloat16, got {self.dtype}")
        for n in ("batch", "max_q", "max_kv", "num_qo_heads", "num_kv_heads", "head_dim_qk", "head_dim_vo"):
            if getattr(self, n) < 1:
                raise ValueError(f"{n} must be >= 1, got {getattr(self, n)}")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(f"num_qo_heads ({self.num_qo_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.window_left >= 0 and not self.causal:
            raise ValueError("window_left needs causal=True in a cuDNN prefill graph")
        if self.paged and self.table_width < 1:
            raise ValueError("a paged graph needs table_width >= 1")
        if self.offset_dtype not in (torch.int32, torch.int64):
            raise ValueError(f"offset_dtype must be int32 or int64, got {self.offset_dtype}")


# ----------------------------------------------------------------------------- handles
_TLS = threading.local()
_ALL_HANDLES: list = []
_HANDLES_LOCK = threading.Lock()


def _handle(device: torch.device):
    """This thread's cuDNN handle for ``device`` (a handle must not be shared across threads),
    bound to torch's current stream on that device."""
    cudnn = require_cudnn()
    handles = getattr(_TLS, "handles", None)
    if handles is None:
        handles = _TLS.handles = {}
    h = handles.get(device.index)
    if h is None:
        with torch.cuda.device(device):
            h = cudnn.create_handle()
        handles[device.index] = h
        with _HANDLES_LOCK:
            _ALL_HANDLES.append(h)
    cudnn.set_stream(h, torch.cuda.current_stream(device).cuda_stream)
    return h


@atexit.register
def _destroy_handles() -> None:
    with _HANDLES_LOCK:
        hs, _ALL_HANDLES[:] = list(_ALL_HANDLES), []
    for h in hs:
        try:
            _cudnn_mod.destroy_handle(h)
        except Exception:  # noqa: BLE001 -- CUDA may already be torn down at exit
            pass


# ----------------------------------------------------------------------------- graph construction
class _UID(enum.IntEnum):
    Q = 1
    K = 2
    V = 3
    O = 10  # noqa: E741
    STATS = 11
    SEQ_LEN_Q = 20
    SEQ_LEN_KV = 21
    Q_OFFSETS = 30
    K_OFFSETS = 31
    V_OFFSETS = 32
    O_OFFSETS = 33
    STATS_OFFSETS = 34
    TABLE_K = 40
    TABLE_V = 41


class PrefillGraph:
    """One built cuDNN graph and its workspace size (bytes)."""

    __slots__ = ("key", "graph", "workspace_size")

    def __init__(self, key: PrefillGraphKey, graph, workspace_size: int):
        self.key = key
        self.graph = graph
        self.workspace_size = int(workspace_size)


class GraphCache:
    """A process-wide LRU of built cuDNN graphs (at most :data:`GRAPH_CACHE_SIZE`), shared by every graph builder
    of this package: a hit is a dict lookup, builds are serialised under a lock (a racing builder's graph wins)."""

    def __init__(self):
        self._graphs: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self._stats = {"builds": 0, "hits": 0}

    def get(self, key, build):
        """The graph for ``key``: cached, else ``build(key)`` (None as ``build``: None on a miss)."""
        g = self._graphs.get(key)
        if g is not None:
            self._stats["hits"] += 1
            return g
        if build is None:
            return None
        with self._lock:
            g = self._graphs.get(key)
            if g is None:
                g = build(key)
                self._stats["builds"] += 1
                self._graphs[key] = g
                while len(self._graphs) > GRAPH_CACHE_SIZE:
                    self._graphs.popitem(last=False)
            else:
                self._stats["hits"] += 1
        return g

    def info(self) -> dict:
        """``{"builds": ..., "hits": ..., "size": ...}`` since import (or the last :meth:`clear`)."""
        return dict(self._stats, size=len(self._graphs))

    def clear(self) -> None:
        """Drop every cached graph and reset the counters."""
        with self._lock:
            self._graphs.clear()
            self._stats.update(builds=0, hits=0)


_GRAPHS = GraphCache()


def graph_cache_info() -> dict:
    """``{"builds": ..., "hits": ..., "size": ...}`` since import (or the last :func:`clear_graph_cache`)."""
    return _GRAPHS.info()


def clear_graph_cache() -> None:
    """Drop every cached graph and reset the counters."""
    _GRAPHS.clear()


def _cudnn_dtype(cudnn, dt: torch.dtype):
    return {
        torch.float16: cudnn.data_type.HALF,
        torch.bfloat16: cudnn.data_type.BFLOAT16,
        torch.float32: cudnn.data_type.FLOAT,
        torch.int32: cudnn.data_type.INT32,
        torch.int64: cudnn.data_type.INT64,
    }[dt]


def _build(key: PrefillGraphKey) -> PrefillGraph:
    cudnn = require_cudnn()
    device = torch.device("cuda", key.device_index)
    handle = _handle(device)
    io = _cudnn_dtype(cudnn, key.dtype)
    f32 = cudnn.data_type.FLOAT
    i32 = cudnn.data_type.INT32
    off_dt = _cudnn_dtype(cudnn, key.offset_dtype)
    B, Sq, Skv = key.batch, key.max_q, key.max_kv
    Hq, Hkv, Dqk, Dvo = key.num_qo_heads, key.num_kv_heads, key.head_dim_qk, key.head_dim_vo

    g = cudnn.pygraph(name="cutedsl_attn_prefill", io_data_type=io, intermediate_data_type=f32,
                      compute_data_type=f32, handle=handle)

    def offsets(name: str, uid: _UID):
        return g.tensor(name=name, dim=[B + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=off_dt, uid=int(uid))

    q_tok, q_head = key.q_strides
    q = g.tensor(name="q", dim=[B, Hq, Sq, Dqk], stride=[Sq * q_tok, q_head, q_tok, 1], data_type=io,
                 uid=int(_UID.Q))
    q.set_ragged_offset(offsets("q_offsets", _UID.Q_OFFSETS))
    paged_kw = {}
    if key.paged:
        (k_shape, k_stride), (v_shape, v_stride) = key.k_layout, key.v_layout
        k = g.tensor(name="k_cache", dim=list(k_shape), stride=list(k_stride), data_type=io, uid=int(_UID.K))
        v = g.tensor(name="v_cache", dim=list(v_shape), stride=list(v_stride), data_type=io, uid=int(_UID.V))
        P = key.table_width
        tk = g.tensor(name="block_table_k", dim=[B, 1, P, 1], stride=[P, P, 1, 1], data_type=i32,
                      uid=int(_UID.TABLE_K))
        tv = g.tensor(name="block_table_v", dim=[B, 1, P, 1], stride=[P, P, 1, 1], data_type=i32,
                      uid=int(_UID.TABLE_V))
        paged_kw = dict(paged_attention_k_table=tk, paged_attention_v_table=tv,
                        paged_attention_max_seq_len_kv=Skv)
    else:
        (k_tok, k_head), (v_tok, v_head) = key.k_layout, key.v_layout
        k = g.tensor(name="k", dim=[B, Hkv, Skv, Dqk], stride=[Skv * k_tok, k_head, k_tok, 1], data_type=io,
                     uid=int(_UID.K))
        v = g.tensor(name="v", dim=[B, Hkv, Skv, Dvo], stride=[Skv * v_tok, v_head, v_tok, 1], data_type=io,
                     uid=int(_UID.V))
        k.set_ragged_offset(offsets("k_offsets", _UID.K_OFFSETS))
        v.set_ragged_offset(offsets("v_offsets", _UID.V_OFFSETS))
    seq_q = g.tensor(name="seq_len_q", dim=[B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32,
                     uid=int(_UID.SEQ_LEN_Q))
    seq_kv = g.tensor(name="seq_len_kv", dim=[B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32,
                      uid=int(_UID.SEQ_LEN_KV))
    mask_kw = {}
    if key.causal:
        mask_kw = dict(diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT, diagonal_band_right_bound=0)
        if key.window_left >= 0:
            mask_kw["diagonal_band_left_bound"] = key.window_left + 1
    o, stats = g.sdpa(
        name="sdpa", q=q, k=k, v=v, attn_scale=float(key.sm_scale), generate_stats=bool(key.return_lse),
        use_padding_mask=True, seq_len_q=seq_q, seq_len_kv=seq_kv, compute_data_type=f32, **mask_kw, **paged_kw,
    )
    o_tok, o_head = key.o_strides
    o.set_output(True).set_dim([B, Hq, Sq, Dvo]).set_stride([Sq * o_tok, o_head, o_tok, 1]).set_data_type(io)
    o.set_uid(int(_UID.O))
    o.set_ragged_offset(offsets("o_offsets", _UID.O_OFFSETS))
    if key.return_lse:
        stats.set_output(True).set_dim([B, Hq, Sq, 1]).set_stride([Sq * Hq, 1, Hq, 1]).set_data_type(f32)
        stats.set_uid(int(_UID.STATS))
        if key.packed_lse:
            stats.set_ragged_offset(offsets("stats_offsets", _UID.STATS_OFFSETS))
    try:
        g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    except cudnn.cudnnGraphNotSupportedError as e:
        raise NotImplementedError(
            f"cuDNN (backend {cudnn.backend_version()}, frontend {cudnn.__version__}) has no engine for this "
            f"prefill graph ({key}): {e}"
        ) from e
    return PrefillGraph(key, g, g.get_workspace_size())


def get_graph(key: PrefillGraphKey) -> PrefillGraph:
    """The cached graph for ``key``, built (validate, plans, ``heur_mode.A`` then ``FALLBACK``) on a miss.

    Raises:
      ImportError: cudnn-frontend missing.  NotImplementedError: no cuDNN engine serves the graph
      (``cudnnGraphNotSupportedError`` chained).
    """
    return _GRAPHS.get(key, _build)


def run_graph(key: PrefillGraphKey, *, q, k, v, out, stats, seq_len_q, seq_len_kv, q_offsets, o_offsets,
              k_offsets=None, v_offsets=None, stats_offsets=None, block_table=None, workspace=None,
              workspace_owner=None) -> PrefillGraph:
    """Fetch/build the graph for ``key`` and execute it once on torch's current stream.

    Every tensor is bound by pointer (the key carries the declared layouts; callers build the key from
    these same tensors).  ``workspace``: a device buffer used when it holds at least the graph's
    workspace size; otherwise a buffer is taken from ``workspace_owner`` (an object whose
    ``_cudnn_workspace`` attribute keeps a grown buffer) or allocated for this call.
    """
    device = torch.device("cuda", key.device_index)
    with torch.cuda.device(device):
        graph = get_graph(key)
    binds = {
        int(_UID.Q): q, int(_UID.K): k, int(_UID.V): v, int(_UID.O): out,
        int(_UID.SEQ_LEN_Q): seq_len_q, int(_UID.SEQ_LEN_KV): seq_len_kv,
        int(_UID.Q_OFFSETS): q_offsets, int(_UID.O_OFFSETS): o_offsets,
    }
    if key.paged:
        binds[int(_UID.TABLE_K)] = block_table
        binds[int(_UID.TABLE_V)] = block_table
    else:
        binds[int(_UID.K_OFFSETS)] = k_offsets
        binds[int(_UID.V_OFFSETS)] = v_offsets
    if key.return_lse:
        binds[int(_UID.STATS)] = stats
        if key.packed_lse:
            binds[int(_UID.STATS_OFFSETS)] = stats_offsets
    need = graph.workspace_size
    ws = workspace
    if need > 0 and (ws is None or ws.numel() * ws.element_size() < need or not ws.is_contiguous()):
        ws = getattr(workspace_owner, "_cudnn_workspace", None) if workspace_owner is not None else None
        if ws is None or ws.numel() < need or ws.device != device:
            ws = torch.empty(need, dtype=torch.uint8, device=device)
            if workspace_owner is not None:
                workspace_owner._cudnn_workspace = ws
    handle = _handle(device)
    with torch.cuda.device(device):
        graph.graph.execute(binds, ws, handle=handle)
    return graph


# ----------------------------------------------------------------------------- plan-time metadata
@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """Host description of one planned batch, padded to the declared (bucketed) graph batch.

    Attributes (CPU tensors, int64):
      batch: the real number of requests B.  graph_batch: declared batch (>= B; requests B.. have
        zero lengths).  max_q, max_kv: declared maximum lengths.
      qo_lens, kv_lens: ``[graph_batch]`` lengths (tokens).
      q_indptr: ``[graph_batch + 1]`` token offsets of each request's rows in q / out / lse.
      kv_indptr: ragged: ``[graph_batch + 1]`` token offsets into k / v; paged: None.
      page_starts: paged: ``[graph_batch]`` offset of each request's first page id in the flat
        page-id array; None for ragged.  page_size, table_width: paged geometry (0 when ragged).
      empty_rows: token indices (into q / out / lse) of the rows that see no key.
      active: some row sees at least one key (otherwise the graph need not run).
    """

    batch: int
    graph_batch: int
    max_q: int
    max_kv: int
    qo_lens: torch.Tensor
    kv_lens: torch.Tensor
    q_indptr: torch.Tensor
    kv_indptr: Optional[torch.Tensor]
    page_starts: Optional[torch.Tensor]
    page_size: int
    table_width: int
    empty_rows: torch.Tensor
    active: bool


def _pad(t: torch.Tensor, n: int, value: int) -> torch.Tensor:
    if t.shape[0] >= n:
        return t
    return torch.cat([t, torch.full((n - t.shape[0],), value, dtype=t.dtype)])


def describe_batch(qo_indptr: torch.Tensor, kv_lens: torch.Tensor, *, causal: bool, kv_starts=None,
                   page_starts=None, page_size: int = 0, bucket: bool = True) -> BatchLayout:
    """Host metadata of a batch from FlashInfer-style host arrays (CPU, int64).

    Args:
      qo_indptr: ``[B+1]`` query-row offsets (tokens).
      kv_lens: ``[B]`` KV lengths (tokens).
      causal: bottom-right causal (decides which rows see no key).
      kv_starts: ragged: ``[B]`` token offset of each request's KV rows (``kv_indptr[:-1]``).
      page_starts, page_size: paged: ``[B]`` offset of each request's first page id in the flat page-id
        array (CSR ``indptr[:-1]``, or ``b * width`` for a dense block table) and the page size.
      bucket: round the graph batch and maximum lengths up (:func:`bucket_batch`,
        :func:`bucket_seq_len`); False declares the exact values (at least 1).

    Exactly one of ``kv_starts`` / ``page_starts`` must be given.
    """
    if (kv_starts is None) == (page_starts is None):
        raise ValueError("give exactly one of kv_starts (ragged) and page_starts (paged)")
    qo_indptr = qo_indptr.to("cpu", torch.int64).reshape(-1)
    kv_lens = kv_lens.to("cpu", torch.int64).reshape(-1)
    B = qo_indptr.shape[0] - 1
    if kv_lens.shape[0] != B:
        raise ValueError(f"kv_lens must have B = {B} entries, got {kv_lens.shape[0]}")
    qo_lens = qo_indptr[1:] - qo_indptr[:-1]
    mq = int(qo_lens.max()) if B else 0
    mkv = int(kv_lens.max()) if B else 0
    if bucket:
        gb, Sq, Skv = bucket_batch(B), bucket_seq_len(mq), bucket_seq_len(mkv)
    else:
        gb, Sq, Skv = max(B, 1), max(mq, 1), max(mkv, 1)
    end_q = int(qo_indptr[-1])
    q_indptr = _pad(qo_indptr, gb + 1, end_q)
    kv_indptr = None
    ps_pad = None
    width = 0
    if kv_starts is not None:
        kv_starts = kv_starts.to("cpu", torch.int64).reshape(-1)
        if kv_starts.shape[0] != B:
            raise ValueError(f"kv_starts must have B = {B} entries, got {kv_starts.shape[0]}")
        end_kv = int(kv_starts[-1] + kv_lens[-1]) if B else 0
        kv_indptr = _pad(torch.cat([kv_starts, torch.tensor([end_kv])]), gb + 1, end_kv)
        page_size = 0
    else:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1 for a paged batch, got {page_size}")
        page_starts = page_starts.to("cpu", torch.int64).reshape(-1)
        if page_starts.shape[0] != B:
            raise ValueError(f"page_starts must have B = {B} entries, got {page_starts.shape[0]}")
        ps_pad = _pad(page_starts, gb, 0)
        width = -(-Skv // page_size)
    # rows that see no key: every row of a request with no KV; with the bottom-right causal diagonal
    # the first qo_len - kv_len rows of a request with more queries than keys
    n_empty = torch.where(kv_lens <= 0, qo_lens, (qo_lens - kv_lens).clamp(min=0) if causal
                          else torch.zeros_like(qo_lens))
    rows = [torch.arange(int(s), int(s) + int(n)) for s, n in zip(qo_indptr[:-1].tolist(), n_empty.tolist()) if n]
    empty_rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
    active = bool(((qo_lens > 0) & (kv_lens > 0)).any()) if B else False
    return BatchLayout(
        batch=B, graph_batch=gb, max_q=Sq, max_kv=Skv, qo_lens=_pad(qo_lens, gb, 0), kv_lens=_pad(kv_lens, gb, 0),
        q_indptr=q_indptr, kv_indptr=kv_indptr, page_starts=ps_pad, page_size=page_size, table_width=width,
        empty_rows=empty_rows, active=active,
    )


def dense_block_table(flat_pages: torch.Tensor, page_starts: torch.Tensor, kv_lens: torch.Tensor, page_size: int,
                      width: int) -> torch.Tensor:
    """The ``(B, 1, width, 1)`` int32 block table cuDNN reads, gathered on ``flat_pages``' device.

    Row ``b`` lists ``flat_pages[page_starts[b] : page_starts[b] + ceil(kv_lens[b] / page_size)]``; the
    tail of each row is page 0 (never read: cuDNN stops at ``seq_len_kv``).  ``page_starts`` and
    ``kv_lens`` are ``[B]`` int64 (any device; copied to ``flat_pages``' device).
    """
    dev = flat_pages.device
    B = page_starts.shape[0]
    starts = page_starts.to(dev, torch.int64).reshape(B, 1)
    npages = ((kv_lens.to(dev, torch.int64) + page_size - 1) // page_size).reshape(B, 1)
    cols = torch.arange(width, device=dev, dtype=torch.int64).reshape(1, width)
    sentinel = flat_pages.numel()
    gather = torch.where(cols < npages, starts + cols, torch.full_like(starts + cols, sentinel))
    ext = torch.cat([flat_pages.reshape(-1).to(torch.int32), torch.zeros(1, dtype=torch.int32, device=dev)])
    return ext.index_select(0, gather.reshape(-1)).reshape(B, 1, width, 1).contiguous()


class PrefillPlan:
    """Plan-time device state of one batch for the wrappers: seq-len tensors, block table, cached
    ragged-offset tensors, rows with no visible key.  :meth:`run` binds it to a graph.

    Args:
      layout: :func:`describe_batch` result.
      device: the CUDA device.  dtype: q/k/v/o dtype.
      num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo: geometry.
      causal, window_left: mask (window needs causal).
      flat_pages: paged: the int32 flat page-id array on ``device`` (CSR ``indices`` or a flattened dense
        block table), read through ``layout.page_starts``.
      non_blocking: host-to-device copies are asynchronous.
    """

    def __init__(self, layout: BatchLayout, *, device, dtype, num_qo_heads, num_kv_heads, head_dim_qk,
                 head_dim_vo, causal, window_left, flat_pages=None, non_blocking=True):
        self.layout = layout
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_qo_heads, self.num_kv_heads = int(num_qo_heads), int(num_kv_heads)
        self.head_dim_qk, self.head_dim_vo = int(head_dim_qk), int(head_dim_vo)
        self.causal, self.window_left = bool(causal), int(window_left)
        self.paged = layout.page_starts is not None
        gb = layout.graph_batch
        nb = dict(non_blocking=non_blocking)
        self.seq_len_q = layout.qo_lens.to(torch.int32).reshape(gb, 1, 1, 1).to(self.device, **nb)
        self.seq_len_kv = layout.kv_lens.to(torch.int32).reshape(gb, 1, 1, 1).to(self.device, **nb)
        self.block_table = None
        if self.paged:
            if flat_pages is None:
                raise ValueError("a paged plan needs flat_pages")
            self.block_table = dense_block_table(flat_pages, layout.page_starts, layout.kv_lens, layout.page_size,
                                                 layout.table_width)
        self.empty_rows = layout.empty_rows.to(self.device, **nb) if layout.empty_rows.numel() else None
        self._offsets: dict = {}
        self._non_blocking = non_blocking

    def offsets(self, which: str, multiplier: int) -> torch.Tensor:
        """Element offsets ``indptr * multiplier`` (``which``: "q" or "kv"), ``(B+1, 1, 1, 1)`` on the device;
        cached per multiplier."""
        t = self._offsets.get((which, multiplier))
        if t is None:
            ip = self.layout.q_indptr if which == "q" else self.layout.kv_indptr
            t = (ip * int(multiplier)).to(OFFSET_DTYPE).reshape(-1, 1, 1, 1).to(
                self.device, non_blocking=self._non_blocking)
            self._offsets[(which, multiplier)] = t
        return t

    def graph_key(self, q, k, v, out, *, sm_scale: float, return_lse: bool) -> PrefillGraphKey:
        """The cache key for running this plan on these tensors (``k``/``v``: ragged ``[T, Hkv, D]`` NHD-ordered;
        paged ``(num_pages, Hkv, page_size, D)`` views)."""
        lay = self.layout
        if self.paged:
            k_layout = (tuple(k.shape), tuple(k.stride()))
            v_layout = (tuple(v.shape), tuple(v.stride()))
        else:
            k_layout = (k.stride(0), k.stride(1))
            v_layout = (v.stride(0), v.stride(1))
        return PrefillGraphKey(
            device_index=self.device.index or 0,
            dtype=self.dtype, batch=lay.graph_batch, max_q=lay.max_q, max_kv=lay.max_kv,
            num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, head_dim_qk=self.head_dim_qk,
            head_dim_vo=self.head_dim_vo, sm_scale=float(sm_scale), causal=self.causal,
            window_left=self.window_left, return_lse=bool(return_lse), packed_lse=True,
            q_strides=(q.stride(0), q.stride(1)), o_strides=(out.stride(0), out.stride(1)), paged=self.paged,
            k_layout=k_layout, v_layout=v_layout, table_width=lay.table_width,
        )

    def run(self, q, k, v, out, lse, *, sm_scale: float, workspace=None, workspace_owner=None) -> None:
        """Execute the plan: ``out`` ``[total_q, Hq, Dvo]`` and, when ``lse`` (``[total_q, Hq]`` fp32,
        contiguous) is given, the natural-log Stats into it.  Rows with no visible key get O = 0 and
        LSE = -inf.  ``k``/``v`` as :meth:`graph_key`."""
        lay = self.layout
        if int(lay.q_indptr[-1]) == 0:
            return
        if not lay.active:  # no row sees a key: nothing for cuDNN to do
            out.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))
            return
        key = self.graph_key(q, k, v, out, sm_scale=sm_scale, return_lse=lse is not None)
        kw = {}
        if not self.paged:
            kw = dict(k_offsets=self.offsets("kv", k.stride(0)), v_offsets=self.offsets("kv", v.stride(0)))
        run_graph(
            key, q=q, k=k, v=v, out=out, stats=lse, seq_len_q=self.seq_len_q, seq_len_kv=self.seq_len_kv,
            q_offsets=self.offsets("q", q.stride(0)), o_offsets=self.offsets("q", out.stride(0)),
            stats_offsets=self.offsets("q", self.num_qo_heads) if lse is not None else None,
            block_table=self.block_table, workspace=workspace, workspace_owner=workspace_owner, **kw,
        )
        if self.empty_rows is not None:
            out.index_fill_(0, self.empty_rows, 0)
            if lse is not None:
                lse.index_fill_(0, self.empty_rows, float("-inf"))
