"""FlashInfer's ``flashinfer.attention.prims_ts`` decode: ``batch_decode_with_paged_kv_cache`` (one-shot) and
``BatchDecodePagedTSWrapper`` (plan once, run per layer, capturable), over fixed row-strided page tables.

Shapes (FlashInfer's contract, no hidden transpose):

* one query row per request (``seq_len_q == 1``): q / out ``[B, Hq, D]``;
* fixed ``seq_len_q = SQ > 1``: q / out token-major ``[B, SQ, Hq, D]``;
* packed: q / out ``[total_q, Hq, D]`` with int32 ``qo_indptr [B + 1]`` (per-request lengths may differ,
  each at most ``max_seq_len_q``).

K/V: HND only, combined ``[pages, 2, Hkv, page_size, D]`` or a ``(k, v)`` tuple of ``[pages, Hkv, page_size,
D]``; ``block_tables [B, C]`` int32 whose rows are contiguous (the row stride may exceed ``C``); ``seq_lens
[B]`` int32 KV lengths.  ``mask_type="dense"`` (the default, also for ``SQ > 1``): every query row sees all
of its request's keys; ``"causal"``: bottom-right causal (row ``i`` of ``q_len`` sees keys ``<= kv_len -
q_len + i``), which needs ``q_len <= kv_len``.  ``window_left = w`` (causal only) keeps the diagonal key and
the ``w`` keys before it.  ``bmm1_scale`` is the softmax scale (default ``1/sqrt(D)``); ``bmm2_scale``
multiplies the output in fp32 before the rounding to the output dtype (the scale table of
:mod:`cutedsl_attn.api.trtllm`).

Dtypes: fp16 -> fp16 and bf16 -> bf16 (q, K/V and the output of one dtype), and fp16 / bf16 queries over a
``torch.float8_e4m3fn`` cache (output of q's dtype) in every query layout; an fp8 cache's per-tensor dequantisation
scales are folded by the caller into ``bmm1_scale`` (``k_scale``) and ``bmm2_scale`` (``v_scale``), as in
FlashInfer.

Kernels: one query row per request runs this package's paged decode kernel (split-KV); more rows run the
paged prefill kernel (query heads of a kv head packed into MMA rows, non-causal for the dense mask); both read
fp8 caches.
FlashInfer serves these entry points on SM100 only; here they run wherever those kernels run.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..api._common import (canonical_dtype, check_devices, check_head_dim, check_heads, check_int, check_one_device,
                           check_tensor, check_window_left, host_tensors_reach_launch)
from ..api.decode import BatchDecodeWithPagedKVCacheWrapper
from ..api.prefill_paged import MultiRowDecodePrefillWrapper
from ..planning import decode as _pd
from ..planning import prefill as _pp

__all__ = ["MASK_TYPES", "BatchDecodePagedTSWrapper", "batch_decode_with_paged_kv_cache"]

MASK_TYPES = ("dense", "causal")
_FP32_MAX = 3.4028234663852886e38
_E4M3 = torch.float8_e4m3fn
_16BIT = (torch.float16, torch.bfloat16)
_MAX_KV_LEN = 2**31 - 1 - 255


# ----------------------------------------------------------------------------- argument checks
def check_scale(name: str, value, *, default: float | None = None) -> float:
    """A finite, positive Python scalar representable in fp32 (``default`` for None).

    Raises TypeError (a tensor, a bool, a non-number) / ValueError (nan, inf, <= 0, beyond fp32)."""
    if value is None and default is not None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a Python float (a finite positive scalar), got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value}")
    if value > _FP32_MAX or float(torch.tensor(value, dtype=torch.float32)) == 0.0:
        raise ValueError(f"{name}={value} is not representable in float32")
    return value


def check_kv_layout(kv_layout) -> None:
    """HND only: ``"NHD"`` raises NotImplementedError, anything else ValueError."""
    if kv_layout == "HND":
        return
    if kv_layout == "NHD":
        raise NotImplementedError("kv_layout='NHD' is not supported by prims_ts decode; supported: 'HND' "
                                  "(pass an NHD pool to BatchDecodeWithPagedKVCacheWrapper(kv_layout='NHD'))")
    raise ValueError(f"kv_layout must be 'HND', got {kv_layout!r}")


def check_mask(mask_type, window_left) -> int:
    """``mask_type`` in :data:`MASK_TYPES`; ``window_left >= 0`` only with ``"causal"``.  Returns window_left."""
    if mask_type not in MASK_TYPES:
        raise ValueError(f"mask_type must be one of {MASK_TYPES}, got {mask_type!r}")
    window_left = check_window_left(window_left)
    if window_left >= 0 and mask_type != "causal":
        raise ValueError(f"window_left={window_left} requires mask_type='causal' (a window is a band below the "
                         "causal diagonal); got mask_type='dense'")
    return window_left


def cache_geometry(paged_kv_cache) -> tuple:
    """``(k, v, num_kv_heads, page_size, head_dim, dtype)`` of an HND cache: a combined 5-D ``[pages, 2, Hkv,
    page_size, D]`` tensor or a ``(k, v)`` tuple of 4-D ``[pages, Hkv, page_size, D]``.  Raises TypeError /
    ValueError naming ``paged_kv_cache``."""
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError("paged_kv_cache as a tuple must be (k_cache, v_cache)")
        k, v = paged_kv_cache
        check_tensor("k_cache", k, ndim=4)
        check_tensor("v_cache", v, ndim=4)
    else:
        check_tensor("paged_kv_cache", paged_kv_cache)
        if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            raise ValueError("paged_kv_cache must be [pages, 2, num_kv_heads, page_size, head_dim] (HND) or a "
                             f"(k, v) tuple of [pages, num_kv_heads, page_size, head_dim], got "
                             f"{tuple(paged_kv_cache.shape)}")
        k, v = paged_kv_cache.unbind(1)
    if k.shape != v.shape:
        raise ValueError(f"k and v caches must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype != v.dtype:
        raise NotImplementedError(f"k and v caches of different dtypes ({k.dtype}, {v.dtype}) are not supported")
    _, hkv, ps, d = k.shape
    return k, v, int(hkv), int(ps), int(d), k.dtype


def cache_entries(paged_kv_cache) -> list:
    """``(name, tensor)`` pairs of ``paged_kv_cache`` (one tensor or a ``(k, v)`` tuple), for the device checks."""
    if isinstance(paged_kv_cache, (tuple, list)):
        return [(f"paged_kv_cache[{i}]", t) for i, t in enumerate(paged_kv_cache)]
    return [("paged_kv_cache", paged_kv_cache)]


def check_block_tables(block_tables, batch_size: int, device) -> torch.Tensor:
    """``[B, C]`` int32 on ``device`` whose rows are contiguous (row stride >= C allowed)."""
    check_tensor("block_tables", block_tables, ndim=2)
    if block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    if block_tables.shape[0] != batch_size:
        raise ValueError(f"block_tables must have {batch_size} rows (the batch size), got {block_tables.shape[0]}")
    if block_tables.shape[1] < 1:
        raise ValueError("block_tables needs at least one column")
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError("each row of block_tables must be contiguous (stride 1 along the columns); rows may be "
                         f"padded apart, got strides {block_tables.stride()}")
    if block_tables.shape[0] > 1 and block_tables.stride(0) < block_tables.shape[1]:
        raise ValueError(f"block_tables rows overlap (row stride {block_tables.stride(0)} < "
                         f"{block_tables.shape[1]} columns)")
    if block_tables.device != device:
        raise ValueError(f"block_tables is on {block_tables.device}, expected {device}")
    return block_tables


def check_seq_lens(name: str, seq_lens, batch_size: int, device) -> torch.Tensor:
    """``[B]`` int32 on ``device``, contiguous."""
    check_tensor(name, seq_lens, ndim=1)
    if seq_lens.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {seq_lens.dtype}")
    if seq_lens.shape[0] != batch_size:
        raise ValueError(f"{name} must have shape [{batch_size}], got {tuple(seq_lens.shape)}")
    if seq_lens.device != device:
        raise ValueError(f"{name} is on {seq_lens.device}, expected {device}")
    if not seq_lens.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return seq_lens


def check_qo_indptr(qo_indptr, device) -> torch.Tensor:
    """int32 ``[B + 1]`` on ``device``; returns its host copy (int64), checked from 0 and non-decreasing."""
    check_tensor("qo_indptr", qo_indptr, ndim=1)
    if qo_indptr.dtype != torch.int32:
        raise ValueError(f"qo_indptr must be int32, got {qo_indptr.dtype}")
    if qo_indptr.shape[0] < 2:
        raise ValueError(f"qo_indptr must have B + 1 >= 2 entries, got {qo_indptr.shape[0]}")
    if qo_indptr.device != device:
        raise ValueError(f"qo_indptr is on {qo_indptr.device}, expected {device}")
    h = qo_indptr.to("cpu", torch.int64)
    if int(h[0]) != 0 or bool((h[1:] < h[:-1]).any()):
        raise ValueError("qo_indptr must start at 0 and be non-decreasing")
    return h


def query_mode(seq_len_q, qo_indptr, max_seq_len_q):
    """``(packed, max_seq_len_q)`` from the one-shot's query arguments: fixed mode needs
    ``max_seq_len_q`` None or equal to ``seq_len_q``; packed mode derives ``max_seq_len_q`` from ``qo_indptr`` once
    when neither it nor a non-default ``seq_len_q`` gives it (both given: they must agree)."""
    seq_len_q = check_int("seq_len_q", seq_len_q, 1)
    if max_seq_len_q is not None:
        max_seq_len_q = check_int("max_seq_len_q", max_seq_len_q, 1)
    if qo_indptr is None:
        if max_seq_len_q is not None and max_seq_len_q != seq_len_q:
            raise ValueError(f"max_seq_len_q ({max_seq_len_q}) must equal seq_len_q ({seq_len_q}) without qo_indptr")
        return False, seq_len_q
    if max_seq_len_q is not None and seq_len_q != 1 and seq_len_q != max_seq_len_q:
        raise ValueError(f"with qo_indptr, seq_len_q ({seq_len_q}) is an alias of max_seq_len_q ({max_seq_len_q}) "
                         "and must agree with it")
    if max_seq_len_q is None and seq_len_q != 1:
        max_seq_len_q = seq_len_q
    return True, max_seq_len_q  # None: derived from qo_indptr by the caller


_SERVED_DTYPES = ("float16 -> float16 and bfloat16 -> bfloat16 (q, K/V and the output of one dtype), or a float16 / "
                  "bfloat16 q over a float8_e4m3fn K/V cache (output of q's dtype)")


def _check_dtypes(q_dt, kv_dt, o_dt) -> None:
    """q and the output fp16 / bf16 and equal; K/V q's dtype or fp8 e4m3.  NotImplementedError otherwise."""
    for n, dt in (("q", q_dt), ("kv", kv_dt), ("out", o_dt)):
        if dt not in _16BIT and not (n == "kv" and dt == _E4M3):
            raise NotImplementedError(f"{n} dtype {dt} is not supported by prims_ts decode here; supported: "
                                      f"{_SERVED_DTYPES}")
    if q_dt != o_dt or kv_dt not in (q_dt, _E4M3):
        raise NotImplementedError(f"mixed dtypes (q {q_dt}, kv {kv_dt}, out {o_dt}) are not supported; supported: "
                                  f"{_SERVED_DTYPES}")


def _workspace_bytes(batch_size: int, num_qo_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """The decode kernel's split-KV partials in CUDA-graph mode: its fixed work-row count times one fp32 row and LSE
    per query head (``planning.decode.max_items`` at 32 CTAs per SM, the occupancy cap)."""
    from .. import dispatch

    rows = _pd.max_items(batch_size, num_kv_heads, dispatch.num_sms() * 32)
    return rows * num_qo_heads * (head_dim + 1) * 4 + 1024


# ----------------------------------------------------------------------------- the wrapper
class BatchDecodePagedTSWrapper:
    """Plan-once paged decode over fixed page tables (FlashInfer's ``BatchDecodePagedTSWrapper``).

    ``plan()`` is host work (before any capture); ``run()`` does no host synchronisation when the lengths are
    owned by the plan or bound at run as a device tensor, and replays in a CUDA graph: the page table and the
    runtime lengths are copied on the device into buffers of fixed address at every run, so a captured ``run``
    follows the new contents of the caller's ``block_tables`` / ``seq_lens`` at each replay.

    Length ownership (always enforced): ``plan(seq_lens=...)`` keeps those lengths (read on the host at plan; the
    decode kernel then splits long requests), and ``run`` must get ``seq_lens=None``; ``plan(seq_lens=None)`` means
    ``run`` gets a stable int32 device ``seq_lens [B]`` every call (each <= the planned ``max_kv_len``; one work
    item per request, the lengths written into the work table on the device).

    Packed queries (``plan(packed_query=True)``): ``run(qo_indptr=...)`` is read on the host when it changes the
    planned rows (outside a capture); under capture the rows of the last eager run are replayed, so capture after
    one eager run with the same ``qo_indptr``.

    Args:
      kv_layout: ``"HND"`` (``"NHD"``: NotImplementedError, else ValueError).
    """

    _launch_entry = "BatchDecodePagedTSWrapper.run"  # a host launch's error names it (the one-shot: its own)

    def __init__(self, kv_layout: str = "HND") -> None:
        check_kv_layout(kv_layout)
        self._kv_layout = kv_layout
        self._plan = None
        self._inner = None
        self._inner_key = None
        self._workspace = None
        self._graph = True  # fixed buffer addresses (capturable runs); the one-shot call plans without them

    # ------------------------------------------------------------------ plan
    def plan(self, device, batch_size: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             max_kv_len: int, *, max_seq_len_q: int = 1, packed_query: bool = False, q_data_type=torch.float16,
             k_data_type=None, v_data_type=None, kv_data_type=None, o_data_type=None, mask_type: str = "dense",
             window_left: int = -1, seq_lens: torch.Tensor | None = None, workspace_buffer: torch.Tensor | None = None,
             storage_page_size: int | None = None, split_kv: bool = True, validate: bool = True,
             initialize_workspace: bool = True) -> None:
        """Plan a batch of ``batch_size`` requests.

        Args:
          device: the CUDA device (``torch.device`` or a string).
          batch_size, num_qo_heads, num_kv_heads, head_dim, page_size: geometry (``num_qo_heads % num_kv_heads ==
            0``, group <= 16; head_dim 32/64/128/256).
          max_kv_len: the longest KV a request can hold (``1 .. 2**31 - 256``); the page table is read for
            ``ceil(max_kv_len / page_size)`` columns.
          max_seq_len_q: query rows per request (packed: the capacity).  packed_query: ``run`` takes ``qo_indptr``.
          q_data_type, k_data_type, v_data_type, kv_data_type, o_data_type: float16 or bfloat16, all one dtype
            (k/v/kv/o default to q's), or K/V torch.float8_e4m3fn under a float16 / bfloat16 q (k, v and kv must
            agree; the output has q's dtype).
          mask_type, window_left: see the module docstring (window only with ``"causal"``).
          seq_lens: int32 ``[batch_size]`` lengths owned by the plan (read on the host now), or None (``run`` binds
            them).
          workspace_buffer: a uint8 device buffer for the split-KV partials (None: allocated).
          storage_page_size: None or ``page_size`` (no page-size conversion).  split_kv: False plans one work item
            per request.  validate, initialize_workspace: accepted (checks always run; no workspace state).

        Raises:
          TypeError / ValueError: malformed arguments, lengths above ``max_kv_len``, causal lengths shorter than the
            query rows; ``device`` not CUDA (after every other check; a host device passes only when cross-compiling
            without a GPU).  NotImplementedError: NHD, dtypes (float8_e5m2, fp8 q or output, mixed 16-bit), head_dim,
            group size, a storage page size differing.
        """
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # tensors carry an index: compare like with like
            device = torch.device("cuda", torch.cuda.current_device())
        B = check_int("batch_size", batch_size, 1)
        Hq = check_int("num_qo_heads", num_qo_heads, 1)
        Hkv = check_int("num_kv_heads", num_kv_heads, 1)
        D = check_int("head_dim", head_dim, 1)
        ps = check_int("page_size", page_size, 1)
        max_kv = check_int("max_kv_len", max_kv_len, 1)
        if max_kv > _MAX_KV_LEN:
            raise ValueError(f"max_kv_len must be <= {_MAX_KV_LEN}, got {max_kv}")
        sq = check_int("max_seq_len_q", max_seq_len_q, 1)
        check_head_dim(D)
        check_heads(Hq, Hkv)
        if storage_page_size is not None and check_int("storage_page_size", storage_page_size, 1) != ps:
            raise NotImplementedError(f"storage_page_size={storage_page_size} != page_size={ps} is not supported")
        for n, x in (("packed_query", packed_query), ("split_kv", split_kv), ("validate", validate),
                     ("initialize_workspace", initialize_workspace)):
            if not isinstance(x, bool):
                raise TypeError(f"{n} must be a bool, got {type(x).__name__}")
        check_kv_layout(self._kv_layout)
        wl = check_mask(mask_type, window_left)
        q_dt = canonical_dtype("q_data_type", q_data_type) or torch.float16
        kv_dt, kv_name = canonical_dtype("kv_data_type", kv_data_type), "kv_data_type"
        for n, x in (("k_data_type", k_data_type), ("v_data_type", v_data_type)):
            x = canonical_dtype(n, x)
            if x is not None and kv_dt is not None and x != kv_dt:  # name the argument that set kv_dt
                raise ValueError(f"{n}={x} disagrees with {kv_name}={kv_dt} (K and V must have one dtype)")
            if kv_dt is None and x is not None:
                kv_dt, kv_name = x, n
        kv_dt = kv_dt or q_dt
        o_dt = canonical_dtype("o_data_type", o_data_type) or q_dt
        _check_dtypes(q_dt, kv_dt, o_dt)
        if B * sq * Hq >= 2**31:
            raise ValueError(f"batch_size * max_seq_len_q * num_qo_heads must be < 2**31, got {B * sq * Hq}")
        fixed = seq_lens is not None
        if fixed:
            check_seq_lens("seq_lens", seq_lens, B, device)
            lens = seq_lens.to("cpu", torch.int64)
            if bool((lens < 0).any()) or int(lens.max()) > max_kv:
                raise ValueError(f"seq_lens must lie in [0, max_kv_len={max_kv}], got min {int(lens.min())}, "
                                 f"max {int(lens.max())}")
            if mask_type == "causal" and not packed_query and int(lens.min()) < sq:
                raise ValueError(f"mask_type='causal' needs every seq_len >= the query rows ({sq}); "
                                 f"got min {int(lens.min())}")
        else:
            lens = torch.full((B,), max_kv, dtype=torch.int64)
        if workspace_buffer is not None:
            check_tensor("workspace_buffer", workspace_buffer, device=device)
        # every argument is checked by now (seq_lens and workspace_buffer against device): device must be CUDA,
        # here rather than in the wrapper planned through, which would name its own arguments
        if device.type != "cuda" and not host_tensors_reach_launch():
            raise ValueError(f"BatchDecodePagedTSWrapper.plan: device must be a CUDA device, got {device}")
        multirow = packed_query or sq > 1
        C = -(-max_kv // ps)
        key = (device, B, Hq, Hkv, D, ps, C, q_dt, kv_dt, multirow, mask_type, wl, fixed, split_kv, self._graph,
               None if workspace_buffer is None else workspace_buffer.data_ptr())
        if key != self._inner_key:
            self._inner = self._make_inner(device, B, Hq, Hkv, D, C, multirow, workspace_buffer)
            self._inner_key = key
        self._plan = dict(device=device, B=B, Hq=Hq, Hkv=Hkv, D=D, ps=ps, max_kv=max_kv, C=C, sq=sq,
                          packed=packed_query, multirow=multirow, mask_type=mask_type, window_left=wl, dtype=q_dt,
                          kv_dtype=kv_dt, fixed=fixed, lens=lens, split_kv=split_kv, qo_host=None)
        # packed rows are known at the first run; until then every request is planned with its capacity
        self._plan_inner(torch.arange(B + 1, dtype=torch.int64) * sq if multirow else None,
                         check_causal=not packed_query)
        p = self._plan
        if packed_query:
            p["qo_host"] = None

    def _make_inner(self, device, B, Hq, Hkv, D, C, multirow, workspace_buffer):
        """The wrapper behind the plan: in CUDA-graph mode (fixed buffer addresses across re-plans and runs) unless
        planned for one call."""
        i32 = dict(dtype=torch.int32, device=device)
        if workspace_buffer is None:
            need = 1024 if multirow else _workspace_bytes(B, Hq, Hkv, D)
            if self._workspace is None or self._workspace.numel() < need or self._workspace.device != device:
                self._workspace = torch.empty(need, dtype=torch.uint8, device=device)
            workspace_buffer = self._workspace
        self._table = torch.zeros((B, C), **i32)  # the page table the kernels read, refreshed at every run
        if not self._graph:
            cls = MultiRowDecodePrefillWrapper if multirow else BatchDecodeWithPagedKVCacheWrapper
            inner = cls(workspace_buffer, "HND", backend="cute")
        elif multirow:
            inner = MultiRowDecodePrefillWrapper(
                workspace_buffer, "HND", use_cuda_graph=True, qo_indptr_buf=torch.empty(B + 1, **i32),
                paged_kv_indptr_buf=torch.empty(B + 1, **i32), paged_kv_indices_buf=torch.empty(B * C, **i32),
                paged_kv_last_page_len_buf=torch.empty(B, **i32), backend="cute")
        else:
            inner = BatchDecodeWithPagedKVCacheWrapper(
                workspace_buffer, "HND", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.empty(B + 1, **i32), paged_kv_indices_buffer=torch.empty(B * C, **i32),
                paged_kv_last_page_len_buffer=torch.empty(B, **i32), backend="cute")
        inner._launch_entry = self._launch_entry  # a host launch's error names this entry point, not the inner one
        return inner

    def _plan_inner(self, qo_host, check_causal: bool = True) -> None:
        p = self._plan
        lens32 = p["lens"].to(torch.int32)
        if p["multirow"]:
            if p["mask_type"] == "causal" and p["fixed"] and check_causal:
                short = (p["lens"] < (qo_host[1:] - qo_host[:-1])).nonzero()
                if short.numel():
                    b = int(short[0])
                    raise ValueError(f"mask_type='causal' needs q_len <= kv_len per request; request {b} has q_len "
                                     f"{int(qo_host[b + 1] - qo_host[b])} > kv_len {int(p['lens'][b])}")
            self._inner.plan(qo_host.to(torch.int32).to(p["device"]), None, None, None, p["Hq"], p["Hkv"], p["D"],
                             p["ps"], causal=p["mask_type"] == "causal", sm_scale=1.0, window_left=p["window_left"],
                             q_data_type=p["dtype"], kv_data_type=p["kv_dtype"], block_tables=self._table,
                             seq_lens=lens32)
            p["qo_host"] = qo_host
        else:
            self._inner.plan(None, None, None, p["Hq"], p["Hkv"], p["D"], p["ps"], window_left=p["window_left"],
                             q_data_type=p["dtype"], kv_data_type=p["kv_dtype"], sm_scale=1.0,
                             block_tables=self._table, seq_lens=lens32,
                             disable_split_kv=not (p["fixed"] and p["split_kv"]))
        p["inner_table"] = self._inner._plan["indices"]  # the inner plan's flat page ids (a fixed-address buffer)
        p["inner_work"] = self._inner._plan["work"]

    # ------------------------------------------------------------------ run
    def run(self, q: torch.Tensor, paged_kv_cache, seq_lens: torch.Tensor | None, block_tables: torch.Tensor, *,
            kv_scale_factors=None, qo_indptr: torch.Tensor | None = None, bmm1_scale: float | None = None,
            bmm2_scale: float = 1.0, out: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
        """Attention for the planned batch.

        Args:
          q: ``[B, Hq, D]`` (one row), ``[B, SQ, Hq, D]`` (fixed rows) or ``[total_q, Hq, D]`` (packed).
          paged_kv_cache: HND combined ``[pages, 2, Hkv, page_size, D]`` or a ``(k, v)`` tuple, of the planned K/V
            dtype (fp8: strides multiples of 16 elements).
          seq_lens: None when the plan owns the lengths, else int32 ``[B]`` on the device (ValueError otherwise).
          block_tables: int32 ``[B, C]``, rows contiguous; ``C * page_size`` must cover the planned lengths (runtime
            lengths: ``max_kv_len``).
          kv_scale_factors: must be None (NVFP4 / fp8 scale factors are not served: NotImplementedError).
          qo_indptr: int32 ``[B + 1]``, required iff the plan is packed.
          bmm1_scale, bmm2_scale: softmax scale (default ``1/sqrt(D)``) and output scale (fp32, before rounding);
            an fp8 cache's ``k_scale`` / ``v_scale`` folded in by the caller.
          out: optional output of the query's shape and the planned output dtype.

        Returns: the output (``out`` when given).

        Raises:
          RuntimeError: run before plan.  TypeError / ValueError: the ownership rule, shapes, dtypes, devices,
          scales; the tensors not on one CUDA device (after the shape and dtype checks).  NotImplementedError:
          ``kv_scale_factors``.
        """
        p = self._plan
        if p is None:
            raise RuntimeError("plan() must be called before run()")
        devices = [("q", q), *cache_entries(paged_kv_cache), ("seq_lens", seq_lens), ("block_tables", block_tables),
                   ("qo_indptr", qo_indptr), ("out", out)]
        check_one_device("BatchDecodePagedTSWrapper.run", devices)  # CUDA once the shapes and dtypes are checked
        if kv_scale_factors is not None:
            raise NotImplementedError("kv_scale_factors (NVFP4 / fp8 KV scale factors) is not supported; "
                                      "supported: float16 / bfloat16 and per-tensor float8_e4m3fn caches (fold "
                                      "the scales into bmm1_scale / bmm2_scale)")
        if p["fixed"] and seq_lens is not None:
            raise ValueError("seq_lens was given to plan(), so run() must get seq_lens=None (the plan owns the lengths)")
        if not p["fixed"] and seq_lens is None:
            raise ValueError("plan() was called without seq_lens, so run() needs the runtime seq_lens [B] int32 tensor")
        dev, B, Hq, D = p["device"], p["B"], p["Hq"], p["D"]
        s1 = check_scale("bmm1_scale", bmm1_scale, default=1.0 / math.sqrt(D))
        s2 = check_scale("bmm2_scale", bmm2_scale)
        k, v, hkv, ps, d, kv_dt = cache_geometry(paged_kv_cache)
        if (hkv, ps, d) != (p["Hkv"], p["ps"], D):
            raise ValueError(f"paged_kv_cache has (num_kv_heads, page_size, head_dim) = {(hkv, ps, d)}, planned "
                             f"{(p['Hkv'], p['ps'], D)}")
        if kv_dt != p["kv_dtype"]:
            raise ValueError(f"paged_kv_cache dtype {kv_dt} differs from the planned K/V dtype {p['kv_dtype']}")
        check_tensor("q", q)
        if q.dtype != p["dtype"]:
            raise ValueError(f"q dtype {q.dtype} differs from the planned q_data_type {p['dtype']}")
        if q.device != dev:
            raise ValueError(f"q is on {q.device}, the plan on {dev}")
        if p["packed"]:
            if qo_indptr is None:
                raise ValueError("the plan is packed (packed_query=True): run() needs qo_indptr")
            check_tensor("q", q, ndim=3)
            shape = (int(q.shape[0]), Hq, D)
        else:
            if qo_indptr is not None:
                raise ValueError("qo_indptr selects packed queries; plan with packed_query=True to pass it")
            shape = (B, Hq, D) if p["sq"] == 1 else (B, p["sq"], Hq, D)
        check_tensor("q", q, shape=shape)
        check_block_tables(block_tables, B, dev)
        if block_tables.shape[1] * ps < (p["max_kv"] if not p["fixed"] else int(p["lens"].max())):
            raise ValueError(f"block_tables has {block_tables.shape[1]} columns: too few pages for "
                             f"{'max_kv_len' if not p['fixed'] else 'the planned seq_lens'} at page_size {ps}")
        if seq_lens is not None:
            check_seq_lens("seq_lens", seq_lens, B, dev)
        if out is not None:
            check_tensor("out", out, shape=shape, dtype=p["dtype"], device=dev)
        qo_host = None  # the packed rows, read on the host outside a capture
        if p["packed"] and not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            qo_host = check_qo_indptr(qo_indptr, dev)
            if qo_host.numel() != B + 1:
                raise ValueError(f"qo_indptr must have B + 1 = {B + 1} entries, got {qo_host.numel()}")
            if int(qo_host[-1]) != q.shape[0]:
                raise ValueError(f"q has {q.shape[0]} rows but qo_indptr[-1] = {int(qo_host[-1])}")
            if int((qo_host[1:] - qo_host[:-1]).max()) > p["sq"]:
                raise ValueError(f"a request of qo_indptr has more than max_seq_len_q = {p['sq']} rows")
        check_devices("BatchDecodePagedTSWrapper.run", devices)
        if qo_host is not None and (p["qo_host"] is None or not torch.equal(qo_host, p["qo_host"])):
            self._plan_inner(qo_host)
        self._refresh(block_tables, seq_lens)
        q3 = q.reshape(-1, Hq, D)
        o3 = None if out is None else out.view(-1, Hq, D) if out.is_contiguous() else None
        cache = (k, v)
        r = self._inner.run(q3, cache, q_scale=s1, v_scale=s2, out=o3)
        if out is not None and o3 is None:
            out.copy_(r.view(shape))
            return out
        return out if out is not None else r.view(shape)

    def _refresh(self, block_tables, seq_lens) -> None:
        """Device-side copies into the inner plan's fixed buffers (capturable): the first ``C`` columns of the page
        table and, for runtime lengths, the work table's length columns."""
        p = self._plan
        C = p["C"]
        c = min(C, block_tables.shape[1])
        p["inner_table"].view(p["B"], C)[:, :c].copy_(block_tables[:, :c])
        if seq_lens is None:
            return
        work = p["inner_work"]
        if p["multirow"]:
            b = work[:, _pp.W_BATCH]
            L = seq_lens[b.clamp(min=0).long()]
            work[:, _pp.W_KV_LEN] = torch.where(b >= 0, L, work[:, _pp.W_KV_LEN])
            return
        b = work[:, _pd.W_BATCH]
        L = torch.where(b >= 0, seq_lens[b.clamp(min=0).long()], torch.zeros_like(b))
        wl = p["window_left"]
        start = (L - 1 - wl).clamp(min=0) if wl >= 0 else torch.zeros_like(L)
        work[:, _pd.W_TOK_START] = start
        work[:, _pd.W_TOK_END] = L
        work[:, _pd.W_KV_LEN] = L


# ----------------------------------------------------------------------------- one-shot
def batch_decode_with_paged_kv_cache(
    q: torch.Tensor,
    paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    block_tables: torch.Tensor,
    seq_lens_kv: torch.Tensor,
    *,
    seq_len_q: int = 1,
    qo_indptr: torch.Tensor | None = None,
    max_seq_len_q: int | None = None,
    mask_type: str = "dense",
    window_left: int = -1,
    kv_layout: str = "HND",
    bmm1_scale: float | None = None,
    bmm2_scale: float = 1.0,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    kv_scale_factors=None,
    page_size: int | None = None,
    split_kv: bool = True,
    workspace_buffer: torch.Tensor | None = None,
    max_kv_len: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """One-shot fixed or packed-query paged decode from fixed page tables (FlashInfer's
    ``flashinfer.attention.prims_ts.batch_decode_with_paged_kv_cache``).

    Args:
      q: ``[B, Hq, D]`` (``seq_len_q == 1``), token-major ``[B, SQ, Hq, D]`` (fixed ``seq_len_q = SQ > 1``), or
        packed ``[total_q, Hq, D]`` with ``qo_indptr``; float16 or bfloat16, last dim contiguous.
      paged_kv_cache: HND ``[pages, 2, Hkv, page_size, D]`` or a ``(k, v)`` tuple of ``[pages, Hkv, page_size, D]``
        in q's dtype or torch.float8_e4m3fn (strides multiples of 16 elements).
      block_tables: int32 ``[B, C]`` page ids; rows contiguous, the row stride may exceed ``C``.
      seq_lens_kv: int32 ``[B]`` KV lengths on q's device, read on the host (a device synchronisation): this
        call is not CUDA-graph capturable -- plan a :class:`BatchDecodePagedTSWrapper` before capture instead.
      seq_len_q: fixed query rows per request; with ``qo_indptr`` a non-default value aliases ``max_seq_len_q``
        (they must agree).
      qo_indptr: int32 ``[B + 1]`` cumulative query offsets (packed mode).
      max_seq_len_q: packed rows-per-request capacity (derived from ``qo_indptr`` once when omitted); in fixed
        mode it must equal ``seq_len_q``.
      mask_type: ``"dense"`` (default, every row sees all keys) or ``"causal"`` (bottom-right).
      window_left: left window (``-1`` disables); requires ``mask_type="causal"``.
      kv_layout: ``"HND"`` only.
      bmm1_scale: softmax scale, default ``1/sqrt(D)``; bmm2_scale: output scale (fp32, before rounding); an fp8
        cache's ``k_scale`` / ``v_scale`` folded in by the caller.
      out: optional output (q's shape, ``out_dtype``).  out_dtype: default ``out.dtype`` or q's dtype; it must
        equal q's dtype here.
      kv_scale_factors, page_size, split_kv, workspace_buffer, max_kv_len, validate: FlashInfer 0.7.4's extras:
        ``kv_scale_factors`` must be None; ``page_size`` must match the cache's; ``max_kv_len`` bounds the lengths.

    Returns: the attention output, shaped as q (an empty batch, ``B = 0``, returns an empty one, ``out`` when
    given, after the same checks).

    Raises:
      TypeError / ValueError: malformed arguments (each named), a mask / window / length rule broken, the
        tensors not on one CUDA device (before any planning, after the shape and dtype checks).
      NotImplementedError: ``kv_layout="NHD"``, dtypes other than fp16 -> fp16 / bf16 -> bf16 (either over an
        fp8 e4m3 cache), head_dim, GQA group above 16, ``kv_scale_factors``.
    """
    check_kv_layout(kv_layout)
    wl = check_mask(mask_type, window_left)
    check_tensor("q", q)
    devices = [("q", q), *cache_entries(paged_kv_cache), ("block_tables", block_tables), ("seq_lens_kv", seq_lens_kv),
               ("qo_indptr", qo_indptr), ("out", out), ("workspace_buffer", workspace_buffer)]
    check_one_device("batch_decode_with_paged_kv_cache", devices)  # CUDA once the shapes and dtypes are checked
    if kv_scale_factors is not None:
        raise NotImplementedError("kv_scale_factors (NVFP4 / fp8 KV scale factors) is not supported; supported: "
                                  "float16 / bfloat16 and per-tensor float8_e4m3fn caches (fold the scales into "
                                  "bmm1_scale / bmm2_scale)")
    packed, sq = query_mode(seq_len_q, qo_indptr, max_seq_len_q)
    _, _, hkv, ps, d, kv_dt = cache_geometry(paged_kv_cache)
    if page_size is not None and check_int("page_size", page_size, 1) != ps:
        raise ValueError(f"page_size={page_size} differs from the cache's page size {ps}")
    dev = q.device
    if packed:
        qo_host = check_qo_indptr(qo_indptr, dev)
        B = qo_host.numel() - 1
        q_lens = qo_host[1:] - qo_host[:-1]
        derived = int(q_lens.max()) if B else 1
        if sq is None:
            sq = max(1, derived)
        elif derived > sq:
            raise ValueError(f"qo_indptr holds a request of {derived} rows, more than max_seq_len_q={sq}")
        check_tensor("q", q, ndim=3)
        if int(qo_host[-1]) != q.shape[0]:
            raise ValueError(f"q has {q.shape[0]} rows but qo_indptr[-1] = {int(qo_host[-1])}")
    else:
        if q.dim() != (3 if sq == 1 else 4) or (sq > 1 and q.shape[1] != sq):
            want = "[B, Hq, D]" if sq == 1 else f"[B, {sq}, Hq, D] (token-major)"
            raise ValueError(f"q must be {want} for seq_len_q={sq}, got {tuple(q.shape)}")
        B = int(q.shape[0])
    Hq, D = int(q.shape[-2]), int(q.shape[-1])
    if D != d:
        raise ValueError(f"q head_dim {D} differs from the cache's {d}")
    check_head_dim(D)
    check_heads(Hq, hkv)
    o_dt = out_dtype if out_dtype is not None else (out.dtype if out is not None else q.dtype)
    if out is not None and out.dtype != o_dt:
        raise ValueError(f"out dtype {out.dtype} differs from out_dtype {o_dt}")
    _check_dtypes(q.dtype, kv_dt, o_dt)
    check_block_tables(block_tables, B, dev)
    lens = check_seq_lens("seq_lens_kv", seq_lens_kv, B, dev)
    host = lens.to("cpu", torch.int64)
    cap = block_tables.shape[1] * ps
    if max_kv_len is None:
        max_kv = max(1, int(host.max()) if B else 1)
    else:
        max_kv = check_int("max_kv_len", max_kv_len, 1)
    if B and (int(host.min()) < 0 or int(host.max()) > min(cap, max_kv)):
        raise ValueError(f"seq_lens_kv must lie in [0, min(block_tables capacity {cap}, max_kv_len {max_kv})]")
    if mask_type == "causal" and B:
        q_lens = (qo_host[1:] - qo_host[:-1]) if packed else torch.full((B,), sq, dtype=torch.int64)
        if bool((host < q_lens).any()):
            b = int((host < q_lens).nonzero()[0])
            raise ValueError(f"mask_type='causal' needs q_len <= kv_len per request; request {b} has q_len "
                             f"{int(q_lens[b])} > kv_len {int(host[b])}")
    check_scale("bmm1_scale", bmm1_scale, default=1.0 / math.sqrt(D))
    check_scale("bmm2_scale", bmm2_scale)
    if out is not None:
        check_tensor("out", out, shape=q.shape, dtype=o_dt)
    if workspace_buffer is not None:
        check_tensor("workspace_buffer", workspace_buffer)
    check_devices("batch_decode_with_paged_kv_cache", devices)
    if B == 0:  # nothing to launch (a zero-size grid is not launchable): an empty output, as trtllm's decode
        return torch.empty(q.shape, dtype=o_dt, device=dev) if out is None else out
    w = BatchDecodePagedTSWrapper(kv_layout)
    w._graph = False  # one call: no padded CUDA-graph grid, split-KV tiles as the decode wrapper plans them
    w._launch_entry = "batch_decode_with_paged_kv_cache"
    w.plan(dev, B, Hq, hkv, D, ps, max_kv, max_seq_len_q=sq, packed_query=packed, q_data_type=q.dtype,
           kv_data_type=kv_dt, mask_type=mask_type, window_left=wl, seq_lens=lens, workspace_buffer=workspace_buffer,
           split_kv=split_kv)
    return w.run(q, paged_kv_cache, None, block_tables, qo_indptr=qo_indptr, bmm1_scale=bmm1_scale,
                 bmm2_scale=bmm2_scale, out=out)
