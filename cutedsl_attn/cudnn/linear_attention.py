"""cuDNN frontend graphs for the delta-rule family: one ``gdn`` / ``gdn2`` / ``gdp`` / ``kda`` node a graph.

The linear-attention nodes of cudnn-frontend (>= 1.29, the release whose nodes take ``gate_domain``) are served
by the frontend's own Python engines: FROST (CuTe DSL, SM100 / SM103 / SM107) for every family, and for KDA also
the Hopper engines ``kda_hopper_cuda`` / ``kda_hopper`` (SM90).  On SM90 a GDN / GDN-2 / GDP graph has no engine:
the build raises ``cudnnGraphNotSupportedError`` carrying each engine's reason, which :func:`get_graph` turns
into a NotImplementedError naming the op, that decision, the GPU, the versions and ``backend="cute"``.

Every tensor crosses as it is: shapes, strides and dtypes are declared from the caller's tensors (the state
V-major ``[N, HO, V, K]``, fp32 or bf16, with no copy), so they are all part of the cache key
(:class:`LinearGraphKey`), with the scale, the flags and the gate domain (``"linear"`` for GDN / GDP alpha,
``"log"`` for GDN-2 / KDA).

Bottom layer: imports nothing from ``cutedsl_attn`` above ``cudnn/``.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

import torch

from .decode import versions
from .prefill import GraphCache, _cudnn_dtype, _handle, require_cudnn

__all__ = ["FAMILIES", "MIN_FRONTEND", "LinearGraphKey", "clear_graph_cache", "decline_message", "get_graph",
           "graph_cache_info", "graph_key", "layout", "require_linear_attention", "run_graph"]

#: the graph node of each op
FAMILIES = {"chunk_gated_delta_rule": "gdn", "chunk_gated_delta_rule2": "gdn2",
            "chunk_gated_delta_product": "gdp", "recurrent_kda": "kda"}

#: the first frontend whose linear-attention nodes take ``gate_domain``
MIN_FRONTEND = (1, 29)


class _UID(enum.IntEnum):
    Q = 1
    K = 2
    V = 3
    G = 10
    BETA = 11
    W = 12
    CU_SEQLENS = 100
    A_LOG = 150
    DT_BIAS = 151
    INITIAL_STATE = 200
    O = 1000  # noqa: E741
    FINAL_STATE = 1001


_PORTS = (("q", _UID.Q), ("k", _UID.K), ("v", _UID.V), ("g", _UID.G), ("beta", _UID.BETA), ("w", _UID.W),
          ("cu_seqlens", _UID.CU_SEQLENS), ("a_log", _UID.A_LOG), ("dt_bias", _UID.DT_BIAS),
          ("initial_state", _UID.INITIAL_STATE))


def layout(t: Optional[torch.Tensor]):
    """``(shape, strides, dtype)`` of ``t`` (None for None): what a graph bakes in of a tensor."""
    return None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype)


@dataclasses.dataclass(frozen=True)
class LinearGraphKey:
    """Everything one linear-attention graph bakes in; the graph-cache key.

    ``op``: the public op (a key of :data:`FAMILIES`); ``device_index``; ``tensors``: ``(port, layout)`` of
    every bound tensor (q, k, v, g, beta, w, cu_seqlens, a_log, dt_bias, initial_state, O, final_state; absent
    ones omitted); ``num_householder`` (GDP); ``scale``; ``use_qk_l2norm``, ``use_beta_sigmoid``, ``safe_gate``,
    ``gate_lower_bound`` (KDA), ``batch_invariant``, ``gate_domain``.
    """

    op: str
    device_index: int
    tensors: tuple
    num_householder: Optional[int]
    scale: float
    use_qk_l2norm: bool
    use_beta_sigmoid: bool
    safe_gate: bool
    gate_lower_bound: Optional[float]
    batch_invariant: bool
    gate_domain: str

    @property
    def family(self) -> str:
        return FAMILIES[self.op]

    def layout_of(self, port: str):
        return dict(self.tensors).get(port)


def graph_key(op: str, bound: dict, *, num_householder=None, scale: float, use_qk_l2norm: bool,
              use_beta_sigmoid: bool = False, safe_gate: bool = False, gate_lower_bound=None,
              batch_invariant: bool = False, gate_domain: str = "log") -> LinearGraphKey:
    """The key of the graph that runs ``op`` on ``bound`` (``{port: tensor or None}``, ports as
    :class:`LinearGraphKey`; ``"O"`` and ``"final_state"`` are the outputs)."""
    if op not in FAMILIES:
        raise ValueError(f"op must be one of {sorted(FAMILIES)}, got {op!r}")
    if gate_domain not in ("linear", "log"):
        raise ValueError(f"gate_domain must be 'linear' or 'log', got {gate_domain!r}")
    tensors = tuple((p, layout(t)) for p, t in bound.items() if t is not None)
    return LinearGraphKey(op=op, device_index=bound["q"].device.index or 0, tensors=tensors,
                          num_householder=None if num_householder is None else int(num_householder),
                          scale=float(scale), use_qk_l2norm=bool(use_qk_l2norm),
                          use_beta_sigmoid=bool(use_beta_sigmoid), safe_gate=bool(safe_gate),
                          gate_lower_bound=None if gate_lower_bound is None else float(gate_lower_bound),
                          batch_invariant=bool(batch_invariant), gate_domain=gate_domain)


def require_linear_attention():
    """The ``cudnn`` module, with linear-attention nodes.

    Raises:
        ImportError: cudnn-frontend is not installed.
        RuntimeError: the frontend predates :data:`MIN_FRONTEND`.
    """
    cudnn = require_cudnn()
    try:
        ver = tuple(int(x) for x in cudnn.__version__.split(".")[:2])
    except (AttributeError, ValueError):
        return cudnn
    if ver < MIN_FRONTEND:
        raise RuntimeError(f"cuDNN linear attention needs cudnn-frontend >= {'.'.join(map(str, MIN_FRONTEND))} "
                           f"(the release whose gdn / gdn2 / gdp / kda nodes take gate_domain), found "
                           f"{cudnn.__version__}; pip install -U 'nvidia-cudnn-frontend[cutedsl]'")
    return cudnn


def _gpu(device_index: int) -> str:
    try:
        major, minor = torch.cuda.get_device_capability(device_index)
        return f"{torch.cuda.get_device_name(device_index)} (sm_{major}{minor})"
    except Exception:  # noqa: BLE001 -- no CUDA: name what is known
        return f"cuda:{device_index}"


_WHERE = {
    "gdn": "cuDNN's GDN engines are SM100-family only (on SM90 only its KDA engines exist).",
    "gdn2": "cuDNN's GDN-2 engines are SM100-family only (on SM90 only its KDA engines exist).",
    "gdp": "cuDNN's GDP engines are SM100-family only (on SM90 only its KDA engines exist).",
    "kda": "cuDNN's KDA engines: FROST on the SM100 family, kda_hopper_cuda / kda_hopper on SM90 (bf16, D = 128, "
           "Hq == Hk, HV a multiple of Hq).",
}


def decline_message(key: LinearGraphKey, reason: str = "") -> str:
    """Why cuDNN does not serve ``key``: the op, cuDNN's engine decision, the GPU, the versions, what serves it."""
    q = key.layout_of("q")
    feats = f"{key.family} node, q {list(q[0])} {q[2]}".replace("torch.", "") if q else key.family
    msg = (f"{key.op}: cuDNN has no engine for this graph ({feats}, gate_domain={key.gate_domain!r}) on "
           f"{_gpu(key.device_index)} with {versions()}. cuDNN's engine decision: "
           f"{reason or 'no plan'}. {_WHERE[key.family]} Served instead by backend='cute' (this package's CuTe "
           f"DSL kernels; backend='auto' picks them).")
    return msg


# ----------------------------------------------------------------------------- graphs and their cache
@dataclasses.dataclass
class LinearGraph:
    key: LinearGraphKey
    graph: object
    workspace_size: int


_GRAPHS = GraphCache()
_WORKSPACES: dict = {}


def graph_cache_info() -> dict:
    """``{"size", "builds", "hits"}`` of the process-wide graph cache."""
    return _GRAPHS.info()


def clear_graph_cache() -> None:
    """Drop every cached graph and reset the counters."""
    _GRAPHS.clear()


def _build(key: LinearGraphKey) -> LinearGraph:
    cudnn = require_linear_attention()
    device = torch.device("cuda", key.device_index)
    handle = _handle(device)
    q_layout = key.layout_of("q")
    g = cudnn.pygraph(name=f"cutedsl_attn_{key.family}", io_data_type=_cudnn_dtype(cudnn, q_layout[2]),
                      intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT,
                      handle=handle)
    ports = {}
    for port, uid in _PORTS:
        lay = key.layout_of(port)
        if lay is None or (port == "w" and key.family != "gdn2"):
            continue
        shape, stride, dt = lay
        ports[port] = g.tensor(name=port, dim=list(shape), stride=list(stride),
                               data_type=_cudnn_dtype(cudnn, dt)).set_uid(int(uid))
    fs_layout = key.layout_of("final_state")
    attrs = dict(scale=key.scale, output_final_state=fs_layout is not None, use_qk_l2norm=key.use_qk_l2norm,
                 use_beta_sigmoid=key.use_beta_sigmoid, safe_gate=key.safe_gate, batch_invariant=key.batch_invariant,
                 gate_domain=key.gate_domain, name=key.family)
    if key.family in ("kda", "gdn2"):
        attrs["gate_lower_bound"] = key.gate_lower_bound
    if key.family == "gdp":
        attrs["num_householder"] = key.num_householder
    try:
        return _declare_and_build(cudnn, g, key, ports, attrs, fs_layout)
    except cudnn.cudnnGraphNotSupportedError as e:
        raise NotImplementedError(decline_message(key, str(e))) from e


def _declare_and_build(cudnn, g, key, ports, attrs, fs_layout) -> LinearGraph:
    o, fs, _ = getattr(g, key.family)(**ports, **attrs)
    o_shape, o_stride, o_dt = key.layout_of("O")
    o.set_uid(int(_UID.O)).set_output(True).set_dim(list(o_shape)).set_stride(list(o_stride))
    o.set_data_type(_cudnn_dtype(cudnn, o_dt))
    if fs is not None:
        f_shape, f_stride, f_dt = fs_layout
        fs.set_uid(int(_UID.FINAL_STATE)).set_output(True).set_dim(list(f_shape)).set_stride(list(f_stride))
        fs.set_data_type(_cudnn_dtype(cudnn, f_dt))
    g.build([cudnn.heur_mode.A])
    return LinearGraph(key, g, int(g.get_workspace_size()))


def get_graph(key: LinearGraphKey) -> LinearGraph:
    """The cached graph for ``key``, built on a miss.

    Raises:
        ImportError / RuntimeError: cudnn-frontend missing or too old (:func:`require_linear_attention`).
        NotImplementedError: no cuDNN engine serves the graph (:func:`decline_message`; the frontend's
            ``cudnnGraphNotSupportedError`` chained).
    """
    return _GRAPHS.get(key, _build)


def _workspace(device: torch.device, size: int) -> torch.Tensor:
    ws = _WORKSPACES.get(device.index)
    if ws is None or ws.numel() < size:
        ws = _WORKSPACES[device.index] = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
    return ws


_UID_OF = {"q": _UID.Q, "k": _UID.K, "v": _UID.V, "g": _UID.G, "beta": _UID.BETA, "w": _UID.W,
           "cu_seqlens": _UID.CU_SEQLENS, "a_log": _UID.A_LOG, "dt_bias": _UID.DT_BIAS,
           "initial_state": _UID.INITIAL_STATE, "O": _UID.O, "final_state": _UID.FINAL_STATE}


def run_graph(key: LinearGraphKey, bound: dict) -> None:
    """Build (cached) and execute the graph of ``key`` on torch's current stream with ``bound``
    (``{port: tensor}``, the tensors ``key`` was made from)."""
    lg = get_graph(key)
    q = bound["q"]
    handle = _handle(q.device)
    var_map = {int(_UID_OF[p]): t for p, t in bound.items() if t is not None and (p != "w" or key.family == "gdn2")}
    lg.graph.execute(var_map, _workspace(q.device, lg.workspace_size), handle=handle)
