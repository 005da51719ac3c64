"""FlashInfer-shaped prefill / append API: ``single_prefill_with_kv_cache`` (+ ``_return_lse``),
``BatchPrefillWithRaggedKVCacheWrapper``, ``BatchPrefillWithPagedKVCacheWrapper``.

Signatures, argument names, defaults and conventions follow FlashInfer 0.7.2
(``flashinfer.prefill``; summarised in ``flashinfer_api.md`` sections 1, 2.8, 2.11, 2.12):
causal is bottom-right aligned (key ``j`` is visible to query row ``i`` iff
``j <= i + kv_len - qo_len``); ``window_left=w`` keeps ``w+1`` keys; a custom mask
(``False`` = masked) replaces ``causal``; ``logits_soft_cap`` applies
``cap * tanh(s / cap)`` to the scaled logits; ``sm_scale`` defaults to
``1/sqrt(head_dim_qk)``; sinks are natural-log logits not scaled by ``sm_scale``,
included in the softmax denominator and in the LSE; the LSE is base 2 (``lse_base="ln"``
converts); rows with no visible key give O = 0 and LSE = -inf.

Positional encodings (``pos_encoding_mode``), applied inside the kernel; query token ``i``
of a request sits at position ``pos_i = i + kv_len - qo_len``, key ``j`` at ``j``:
``"ROPE_LLAMA"`` rotates q and k (non-interleaved "rotate half", pairs ``(d, d + D/2)``,
``freq_d = rope_theta^(-2d/D) / rope_scale``, defaults ``rope_scale=1``,
``rope_theta=1e4``; FlashInfer's ``prefill.cuh``); ``"ALIBI"`` adds
``slope_h * (j - pos_i)`` to the scaled logit, with FlashInfer's
``get_alibi_slopes(num_qo_heads)``.  FlashInfer's FA2 kernel uses ``j - i`` (the un-offset
row index) instead: a per-row constant, so the output is the same and only the LSE differs,
by ``slope_h * (kv_len - qo_len) * log2(e)``; ``j - pos_i`` is what the decode kernel and
the oracle (``cutedsl_attn.ref``) use.  ALIBI together with ``logits_soft_cap`` is not
served (FlashInfer's kernel applies ``sm_scale`` twice in that combination).

What runs where (``cutedsl_attn.dispatch.prefill_config`` decides, once per ``plan()``):
on SM90 the TMA + wgmma kernel (``cutedsl_attn.sm90.prefill``: a producer warpgroup (TMA for
ragged K/V and for paged blocks of whole pages, a cp.async gather for the rest) and two or three
wgmma consumer warpgroups, 128 or 192 packed rows per CTA (four and 256 as a tuning option)) serves
ragged and paged KV, custom masks included, without positional encoding, head_dim >= 64 and a group size
dividing 128; everything else
runs the portable CuTe DSL prefill kernel (``cutedsl_attn.portable.prefill``: ``cp.async`` +
``ldmatrix`` + ``mma.sync``, 64 packed rows per CTA).  Both pack the query heads of a kv
head into the MMA rows and both are verified on an NVIDIA H200 (SM90); on SM100/SM103 the
portable kernel is only cross-compiled and PTX-checked.  ``backend="cudnn"`` runs cuDNN
frontend graphs instead (``cutedsl_attn.api.cudnn``).  There is no split-KV: each CTA
reads the whole visible KV range of its rows, so results do not depend on the batch
composition.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import threading
import warnings

import torch

from .. import dispatch
from ..compile.cache import config_key, hash_callable
from ..planning.prefill import max_tiles, plan_prefill
from ..ref.attention import alibi_slopes
from ._common import (
    canonical_dtype,
    check_float,
    check_heads,
    check_int,
    check_kv_layout,
    check_lse_options,
    check_pos_encoding_mode,
    check_sm_scale,
    check_tensor,
    check_window_left,
    csr_kv_lens,
    indptr_host,
    kernel_entry_error,
    paged_kv_views,
    return_lse_method,
    run_scale,
)
from .quantization import segment_packbits

__all__ = [
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
]

SUPPORTED_HEAD_DIMS_QK = (32, 64, 128, 192, 256)
SUPPORTED_HEAD_DIMS_VO = (32, 64, 128, 256)
_LN2 = math.log(2.0)

_SUPPORTED_BACKENDS = ("auto", "cute")
_FLASHINFER_BACKENDS = ("fa2", "fa3", "cudnn", "trtllm-gen", "cute-dsl", "cute-dsl-prims", "cutlass", "fmha_v2",
                        "cutile")


# ----------------------------------------------------------------------------- shared checks
def _check_backend(backend: str) -> None:
    if backend not in _SUPPORTED_BACKENDS:
        if backend in _FLASHINFER_BACKENDS:
            raise NotImplementedError(
                f"backend={backend!r} is not available in cutedsl_attn; supported: {_SUPPORTED_BACKENDS}"
            )
        raise ValueError(f"unknown backend {backend!r}; supported: {_SUPPORTED_BACKENDS}")


def _trace_buffer(cfg, work, num_kv_heads, device, mask):
    """The kernel's mask argument: for a ``trace`` config (development traces, perf/trace_prefill.py) a zeroed
    buffer of 128 bytes per tile of ``work`` -- the stamps would write past the 1-byte dummy -- else ``mask``."""
    if getattr(cfg, "trace", False):
        return torch.zeros(work.shape[0] * num_kv_heads * 128, dtype=torch.uint8, device=device)
    return mask


def _check_head_dims(head_dim_qk, head_dim_vo) -> tuple[int, int]:
    head_dim_qk = check_int("head_dim_qk", head_dim_qk)
    head_dim_vo = head_dim_qk if head_dim_vo is None else check_int("head_dim_vo", head_dim_vo)
    if head_dim_qk not in SUPPORTED_HEAD_DIMS_QK:
        raise NotImplementedError(
            f"head_dim_qk={head_dim_qk} is not supported; supported: {SUPPORTED_HEAD_DIMS_QK}"
        )
    if head_dim_vo not in SUPPORTED_HEAD_DIMS_VO:
        raise NotImplementedError(
            f"head_dim_vo={head_dim_vo} is not supported; supported: {SUPPORTED_HEAD_DIMS_VO}"
        )
    return head_dim_qk, head_dim_vo


def _check_dtypes(q_data_type, kv_data_type, o_data_type) -> torch.dtype:
    q_dt = canonical_dtype("q_data_type", q_data_type) or torch.float16
    kv_dt = canonical_dtype("kv_data_type", kv_data_type) or q_dt
    o_dt = canonical_dtype("o_data_type", o_data_type) or q_dt
    for n, dt in (("q_data_type", q_dt), ("kv_data_type", kv_dt), ("o_data_type", o_dt)):
        if dt not in (torch.float16, torch.bfloat16):
            raise NotImplementedError(f"{n}={dt} is not supported; supported: torch.float16, torch.bfloat16")
    if not (q_dt == kv_dt == o_dt):
        raise NotImplementedError(
            f"mixed dtypes (q={q_dt}, kv={kv_dt}, o={o_dt}) are not supported; q, kv and o must match"
        )
    return q_dt


def _check_options(pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale,
                   head_dim_qk, rope_scale=None, rope_theta=None) -> tuple[int, float, float, float, float]:
    """(window_left, soft_cap, sm_scale, rope_rcp_scale, rope_log2_theta) after validating the shared plan
    options.  ``rope_scale``/``rope_theta`` (None -> 1.0 / 1e4) are checked whatever the mode."""
    check_pos_encoding_mode(pos_encoding_mode)
    rs = check_float("rope_scale", rope_scale, positive=True)
    rt = check_float("rope_theta", rope_theta, positive=True)
    rope_rcp_scale = 1.0 / (1.0 if rs is None else rs)
    rope_log2_theta = math.log2(1e4 if rt is None else rt)
    if not math.isfinite(rope_rcp_scale) or rope_rcp_scale == 0.0:
        raise ValueError(f"rope_scale must be a finite value > 0 whose reciprocal is finite, got {rope_scale}")
    if use_fp16_qk_reduction:
        raise NotImplementedError("use_fp16_qk_reduction=True is not supported (q.k is reduced in fp32)")
    window_left = check_window_left(window_left)
    if logits_soft_cap is not None and (isinstance(logits_soft_cap, bool)
                                        or not isinstance(logits_soft_cap, numbers.Real)):
        raise TypeError(f"logits_soft_cap must be a float or None, got {type(logits_soft_cap).__name__}")
    cap = float(logits_soft_cap) if logits_soft_cap else 0.0
    if cap < 0 or not math.isfinite(cap):
        raise ValueError(f"logits_soft_cap must be a finite value >= 0, got {logits_soft_cap}")
    scale = check_sm_scale(sm_scale, head_dim_qk)
    if cap > 0 and pos_encoding_mode == "ALIBI":
        # FlashInfer's FA2 variant multiplies by sm_scale twice in this combination (variants.cuh)
        raise NotImplementedError("logits_soft_cap together with pos_encoding_mode='ALIBI' is not supported")
    return window_left, cap, scale, rope_rcp_scale, rope_log2_theta


def _check_score_mod(score_mod, backend) -> None:
    """``TypeError`` for a ``score_mod`` that is not callable or has no stable compile key; ``NotImplementedError``
    with the cuDNN backend.  The options it cannot combine with: :func:`_check_score_mod_options`."""
    if score_mod is None:
        return
    if not callable(score_mod):
        raise TypeError(f"score_mod must be a callable or None, got {type(score_mod).__name__}")
    try:
        hash_callable(score_mod)  # its compile key: a callable without a stable one fails here, not in run()
    except TypeError as e:
        raise TypeError(f"score_mod: {e}") from None
    if backend == "cudnn":
        raise NotImplementedError("score_mod is not supported with backend='cudnn' (use 'auto' or 'cute')")


def _check_score_mod_options(score_mod, cap, pos_encoding_mode) -> None:
    """``NotImplementedError`` for a ``score_mod`` with a soft cap or ALiBi (validated options)."""
    if score_mod is None:
        return
    if cap > 0:
        raise NotImplementedError("score_mod together with logits_soft_cap is not supported; apply the cap inside "
                                  "the score_mod (cap * cute.math.tanh(score / cap))")
    if pos_encoding_mode == "ALIBI":
        raise NotImplementedError("score_mod together with pos_encoding_mode='ALIBI' is not supported; add the "
                                  "bias inside the score_mod (slope * (kv_idx - q_idx): q_idx is the query's "
                                  "bottom-right position)")


def _takes_pos_args(cfg) -> bool:
    """Whether the kernel of ``cfg`` takes the positional-encoding arguments (``alibi_slopes`` after ``sinks``;
    ``rope_rcp_scale``, ``rope_log2_theta`` after ``window_left``): the configs that have a
    ``pos_encoding_mode`` field (the portable kernel, ``cutedsl_attn.portable.prefill.compile``)."""
    return any(f.name == "pos_encoding_mode" for f in dataclasses.fields(cfg))


def _reject_multi_item(prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr) -> None:
    for n, x in (("prefix_len_ptr", prefix_len_ptr), ("token_pos_in_items_ptr", token_pos_in_items_ptr),
                 ("max_item_len_ptr", max_item_len_ptr)):
        if x is not None:
            raise NotImplementedError(f"{n} (multi-item scoring) is not supported")
    if token_pos_in_items_len:
        raise NotImplementedError("token_pos_in_items_len (multi-item scoring) is not supported; leave it 0")


def _check_split_options(fixed_split_size) -> None:
    if fixed_split_size is not None:
        if isinstance(fixed_split_size, bool) or not isinstance(fixed_split_size, int) or fixed_split_size <= 0:
            raise ValueError(f"fixed_split_size must be a positive number of pages, got {fixed_split_size!r}")


def _check_lengths_hint(name: str, t, expect: torch.Tensor) -> None:
    """``seq_lens``-style hints (cuDNN-only arguments in FlashInfer): must agree with the offsets."""
    if t is None:
        return
    check_tensor(name, t)
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    h = t.to("cpu", torch.int64).reshape(-1)
    if h.shape != expect.shape or not torch.equal(h, expect):
        raise ValueError(f"{name} ({h.tolist()}) disagrees with the lengths given by the index arrays "
                         f"({expect.tolist()})")


def _check_max_hint(name: str, value, actual: int) -> None:
    if value is None:
        return
    value = check_int(name, value)
    if value < actual:
        raise ValueError(f"{name}={value} is smaller than the actual maximum length {actual}")


def _check_graph_buffer(name, t, device, *, dtype=torch.int32, length=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor when use_cuda_graph=True")
    if t.dtype != dtype or t.device != device:
        raise ValueError(f"{name} must be {dtype} on {device}, got {t.dtype} on {t.device}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} must have {length} entries, got {t.shape[0]}")


# ----------------------------------------------------------------------------- the wrappers
class _BatchPrefillBase:
    """Plan/run machinery shared by the ragged and paged wrappers (not public)."""

    _paged = False
    _k_names = ("k", "v")

    def _init_common(self, float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args, jit_kwargs,
                     variant_owns_mask) -> None:
        check_kv_layout(kv_layout)
        if backend == "cudnn":  # cuDNN frontend graphs: cutedsl_attn/api/cudnn.py
            from .cudnn import check_wrapper_init
            check_wrapper_init(use_cuda_graph)
        else:
            _check_backend(backend)
        if jit_args is not None:
            raise NotImplementedError("jit_args is not supported; kernels are extended through their Python config")
        if jit_kwargs is not None:
            raise NotImplementedError("jit_kwargs is not supported (it only applies with jit_args)")
        if variant_owns_mask:
            raise NotImplementedError("variant_owns_mask=True is not supported (it requires jit_args)")
        check_tensor("float_workspace_buffer", float_workspace_buffer)
        if float_workspace_buffer.data_ptr() % 16:
            raise ValueError("float_workspace_buffer must be 16-byte aligned")
        self._kv_layout = kv_layout
        self._use_cuda_graph = bool(use_cuda_graph)
        self._backend = backend
        self._workspace = float_workspace_buffer
        self.device = float_workspace_buffer.device
        self._plan = None
        self._kernels: dict[bool, object] = {}
        # wrapper-owned buffers; in CUDA-graph mode allocated once (fixed addresses)
        self._work_dev = None
        self._graph_rows = None
        self._graph_tile_m = None
        self._graph_sig = None  # the first CUDA-graph plan's kernel and scalars (frozen afterwards)
        self._max_total_num_rows = None
        self._lse_scratch = None
        self._table_buf = None
        self._dummy_i32 = None
        self._dummy_u8 = None
        self._dummy_f32 = None
        self._alibi_buf = None

    def _check_mask_buffers(self, custom_mask_buf, mask_indptr_buf, batch_size) -> None:
        if not self._use_cuda_graph:
            return
        if custom_mask_buf is not None:
            _check_graph_buffer("custom_mask_buf", custom_mask_buf, self.device, dtype=torch.uint8)
        if mask_indptr_buf is not None:
            _check_graph_buffer("mask_indptr_buf", mask_indptr_buf, self.device, length=batch_size + 1)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None) -> None:
        """Swap the float workspace.  The prefill kernel has no split-KV and keeps nothing in the
        workspace, so the current plan stays valid; ``int_workspace_buffer`` is unused (the wrapper
        keeps its small int buffers, the work table, itself)."""
        check_tensor("float_workspace_buffer", float_workspace_buffer, device=self.device)
        if float_workspace_buffer.data_ptr() % 16:
            raise ValueError("float_workspace_buffer must be 16-byte aligned")
        self._workspace = float_workspace_buffer

    def end_forward(self) -> None:
        """No-op (FlashInfer compatibility)."""

    # ------------------------------------------------------------------ plan (shared part)
    def _plan_common(self, *, qo_h, kv_lens, kv_starts, total_kv, page_size, flat_indices, table, num_qo_heads,
                     num_kv_heads,
                     head_dim_qk, head_dim_vo, custom_mask, packed_custom_mask, causal, pos_encoding_mode,
                     use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta,
                     q_data_type, kv_data_type, o_data_type, non_blocking, graph_copies, score_mod=None) -> None:
        """Everything after the index arrays are parsed: options, mask, config, work table, buffers.

        ``flat_indices``: the flat page-id array the kernel reads (None when ragged); ``table``:
        it is a dense block table (copied into a wrapper-owned buffer in CUDA-graph mode).
        ``graph_copies``: ``[(dst_buffer, src_tensor), ...]`` of the caller-visible CUDA-graph
        buffers, written only after every check has passed (a rejected plan leaves them intact).
        """
        _check_score_mod(score_mod, self._backend)
        if self._backend == "cudnn":  # cuDNN frontend graphs (cutedsl_attn/api/cudnn.py) take every argument
            kw = dict(locals())
            kw.pop("score_mod")
            del kw["self"]
            from .cudnn import plan_wrapper
            return plan_wrapper(self, **kw)
        window_left, cap, scale, rope_rcp_scale, rope_log2_theta = _check_options(
            pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale, head_dim_qk,
            rope_scale, rope_theta)
        _check_score_mod_options(score_mod, cap, pos_encoding_mode)
        dt = _check_dtypes(q_data_type, kv_data_type, o_data_type)
        num_qo_heads = check_int("num_qo_heads", num_qo_heads)
        num_kv_heads = check_int("num_kv_heads", num_kv_heads)
        group = check_heads(num_qo_heads, num_kv_heads)
        B = qo_h.shape[0] - 1
        qo_lens = qo_h[1:] - qo_h[:-1]
        total_q = int(qo_h[-1])
        if self._use_cuda_graph:
            if B != self._fixed_batch_size:
                raise ValueError(
                    f"The batch size should be fixed in cudagraph mode, the runtime batch size {B} "
                    f"mismatches the batch size set during initialization {self._fixed_batch_size}"
                )
            if self._max_total_num_rows is not None and total_q > self._max_total_num_rows:
                raise ValueError(
                    f"The total number of rows in qo_indptr {total_q} in cuda graph mode cannot exceed the "
                    f"number of rows set during the first plan {self._max_total_num_rows}"
                )
            if self._plan is not None:
                p0 = self._plan
                if (num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo) != (
                        p0["num_qo_heads"], p0["num_kv_heads"], p0["head_dim_qk"], p0["head_dim_vo"]):
                    raise ValueError("num_qo_heads/num_kv_heads/head dims cannot change between plans in "
                                     "CUDA-graph mode")

        # --- custom mask -> packed little-endian bits, per-request byte segments
        use_mask = custom_mask is not None or packed_custom_mask is not None
        mask_bits = None
        packed = None
        if use_mask:
            n_elem = qo_lens * kv_lens
            seg_bytes = (n_elem + 7) // 8
            byte_ptr = torch.zeros(B + 1, dtype=torch.int64)
            byte_ptr[1:] = torch.cumsum(seg_bytes, 0)
            if packed_custom_mask is not None:  # wins over custom_mask (FlashInfer)
                check_tensor("packed_custom_mask", packed_custom_mask, ndim=1)
                if packed_custom_mask.dtype != torch.uint8:
                    raise ValueError(f"packed_custom_mask must be uint8, got {packed_custom_mask.dtype}")
                if packed_custom_mask.shape[0] != int(byte_ptr[-1]):
                    raise ValueError(
                        f"packed_custom_mask has {packed_custom_mask.shape[0]} bytes; the batch needs "
                        f"sum_b ceil(qo_len_b * kv_len_b / 8) = {int(byte_ptr[-1])} (segment_packbits(custom_mask, "
                        "mask_indptr, bitorder='little'), each request padded to whole bytes)"
                    )
                packed = packed_custom_mask
            else:
                check_tensor("custom_mask", custom_mask)
                if custom_mask.dtype != torch.bool:
                    raise ValueError(f"custom_mask must be torch.bool, got {custom_mask.dtype}")
                need = int(n_elem.sum()) if B else 0
                if custom_mask.numel() != need:
                    raise ValueError(
                        f"custom_mask must have sum_b qo_len_b * kv_len_b = {need} elements, got {custom_mask.numel()}"
                    )
                elem_ptr = torch.zeros(B + 1, dtype=torch.int64)
                elem_ptr[1:] = torch.cumsum(n_elem, 0)
                packed, _ = segment_packbits(custom_mask.reshape(-1), elem_ptr, bitorder="little")
            mask_bits = byte_ptr[:-1] * 8

        # the shape part of the kernel choice (kept for forward()'s re-dispatch) and the options part
        cfg_kw = dict(dtype=dt, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, group_size=group,
                      page_size=page_size, use_sinks=False, use_custom_mask=use_mask, score_mod=score_mod)
        cfg = dispatch.prefill_config(
            **cfg_kw, causal=bool(causal) and not use_mask, use_window=window_left >= 0, use_soft_cap=cap > 0,
            pos_encoding_mode=pos_encoding_mode, positive_scale=scale > 0,
        )
        tile_m = cfg.tile_m
        if use_mask and self._use_cuda_graph:
            if not isinstance(self._custom_mask_buf, torch.Tensor):
                raise ValueError("custom_mask_buf must be a torch.Tensor in cuda graph mode if a custom mask is used")
            if not isinstance(self._mask_indptr_buf, torch.Tensor):
                raise ValueError("mask_indptr_buf must be a torch.Tensor in cuda graph mode if a custom mask is used")
            if packed.shape[0] > self._custom_mask_buf.shape[0]:
                raise ValueError(
                    f"the packed custom mask ({packed.shape[0]} bytes) does not fit custom_mask_buf "
                    f"({self._custom_mask_buf.shape[0]} bytes)"
                )
        num_rows = None
        if self._use_cuda_graph:
            # a captured graph replays the kernel and the scalars of the plan it was captured after: only
            # the lengths (work table, indices, mask bits) may change between plans
            sig = dict(causal=bool(causal), window_left=window_left, logits_soft_cap=cap, sm_scale=scale,
                       pos_encoding_mode=pos_encoding_mode, rope_scale=1.0 / rope_rcp_scale,
                       rope_theta=2.0 ** rope_log2_theta, custom_mask=use_mask,
                       score_mod=None if score_mod is None else hash_callable(score_mod), kernel=config_key(cfg))
            if self._graph_sig is None:
                self._graph_sig = sig
            elif sig != self._graph_sig:
                changed = [k for k in sig if sig[k] != self._graph_sig[k] and k != "kernel"] or ["the kernel choice"]
                raise ValueError(
                    f"in CUDA-graph mode plan() may only change lengths; {', '.join(changed)} changed since the "
                    "first plan (a captured graph would replay the old kernel and scalars); create a new wrapper"
                )
            if self._graph_rows is None:
                max_rows = total_q
                num_rows = max_tiles(max_rows, B, group, tile_m)
            else:
                max_rows, num_rows = self._max_total_num_rows, self._graph_rows
        work, num_work = plan_prefill(
            qo_lens, kv_lens, qo_h[:-1], kv_starts, mask_bits, group_size=group, tile_m=tile_m, num_rows=num_rows,
            causal=cfg.causal, window_left=window_left,
        )
        if self._use_cuda_graph and table and self._table_buf is not None \
                and flat_indices.numel() > self._table_buf.numel():
            raise ValueError("block_tables grew beyond the first plan's size (not allowed in CUDA-graph mode)")

        # --- device buffers: every check is done by now
        dev = self.device
        if self._dummy_i32 is None:
            self._dummy_i32 = torch.zeros(1, dtype=torch.int32, device=dev)
            self._dummy_u8 = torch.zeros(1, dtype=torch.uint8, device=dev)
            self._dummy_f32 = torch.zeros(1, dtype=torch.float32, device=dev)
        for dst, src in graph_copies:
            dst[: src.shape[0]].copy_(src, non_blocking=non_blocking)
        indices = self._dummy_i32
        if flat_indices is not None:
            indices = flat_indices
            if self._use_cuda_graph and table:
                # a dense block table: copied into a wrapper-owned buffer of fixed address
                if self._table_buf is None:
                    self._table_buf = torch.empty_like(flat_indices)
                self._table_buf[: flat_indices.numel()].copy_(flat_indices, non_blocking=non_blocking)
                indices = self._table_buf
        mask = self._dummy_u8
        if use_mask:
            if self._use_cuda_graph:
                self._custom_mask_buf[: packed.shape[0]].copy_(packed, non_blocking=non_blocking)
                self._mask_indptr_buf.copy_(byte_ptr.to(torch.int32), non_blocking=non_blocking)
                mask = self._custom_mask_buf
            else:
                mask = packed.to(dev, non_blocking=non_blocking)
                if mask.numel() == 0:
                    mask = self._dummy_u8
        mask = _trace_buffer(cfg, work, num_kv_heads, dev, mask)
        if self._use_cuda_graph:
            if self._work_dev is None:
                self._graph_rows, self._graph_tile_m, self._max_total_num_rows = num_rows, tile_m, max_rows
                self._work_dev = torch.empty_like(work, device=dev)
                self._lse_scratch = torch.empty((max(max_rows, 1), num_qo_heads), dtype=torch.float32, device=dev)
            self._work_dev.copy_(work, non_blocking=non_blocking)
            work_dev = self._work_dev
        else:
            work_dev = work.to(dev, non_blocking=non_blocking)
            if self._lse_scratch is None or self._lse_scratch.shape != (total_q, num_qo_heads):
                self._lse_scratch = torch.empty((total_q, num_qo_heads), dtype=torch.float32, device=dev)
        alibi = self._alibi_slopes(pos_encoding_mode, num_qo_heads, non_blocking)
        self._plan = dict(
            B=B, total_q=total_q, total_kv=total_kv,
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo,
            page_size=page_size, group=group, dtype=dt, causal=bool(causal), use_mask=use_mask,
            window_left=window_left, soft_cap=cap, sm_scale=scale, cfg=cfg, work=work_dev, num_work=num_work,
            indices=indices, mask=mask, lse_scratch=self._lse_scratch[:total_q],
            pos_encoding_mode=pos_encoding_mode, alibi=alibi, rope_rcp_scale=rope_rcp_scale,
            rope_log2_theta=rope_log2_theta, pos_args=_takes_pos_args(cfg),
            replan=dict(qo_lens=qo_lens, kv_lens=kv_lens, q_starts=qo_h[:-1], kv_starts=kv_starts,
                        mask_bits=mask_bits, cfg_kw=cfg_kw),
        )
        self._kernels = {}

    def _alibi_slopes(self, pos_encoding_mode, num_qo_heads, non_blocking):
        """The kernel's ALiBi slopes argument: FlashInfer's slopes in a wrapper-owned ``[Hq]`` fp32 buffer
        (kept across plans: a fixed address in CUDA-graph mode), or the 1-element dummy."""
        if pos_encoding_mode != "ALIBI":
            return self._dummy_f32
        if self._alibi_buf is None or self._alibi_buf.shape[0] != num_qo_heads:
            self._alibi_buf = torch.empty(num_qo_heads, dtype=torch.float32, device=self.device)
        self._alibi_buf.copy_(alibi_slopes(num_qo_heads), non_blocking=non_blocking)
        return self._alibi_buf

    def _kernel(self, use_sinks: bool):
        k = self._kernels.get(use_sinks)
        if k is None:
            cfg = self._plan["cfg"]
            if use_sinks:
                cfg = dataclasses.replace(cfg, use_sinks=True)
            k = self._kernels[use_sinks] = dispatch.prefill_kernel(cfg)
        return k

    def _override_options(self, causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap,
                          sm_scale, rope_scale, rope_theta) -> None:
        """The deprecated ``forward`` API: its options replace the planned ones (FlashInfer semantics)."""
        warnings.warn("forward()/forward_return_lse() are deprecated (as in FlashInfer); use run()/run_return_lse()",
                      DeprecationWarning, stacklevel=3)
        p = self._plan
        if p is None:
            raise RuntimeError("plan() must be called before forward()")
        if self._backend == "cudnn":
            raise NotImplementedError("the deprecated forward()/forward_return_lse() are not supported with "
                                      "backend='cudnn'; plan() with the options, then run()")
        window_left, cap, scale, rope_rcp_scale, rope_log2_theta = _check_options(
            pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale, p["head_dim_qk"],
            rope_scale, rope_theta)
        rp = p["replan"]
        _check_score_mod_options(rp["cfg_kw"]["score_mod"], cap, pos_encoding_mode)
        cfg = dispatch.prefill_config(
            **rp["cfg_kw"], causal=bool(causal) and not p["use_mask"], use_window=window_left >= 0,
            use_soft_cap=cap > 0, pos_encoding_mode=pos_encoding_mode, positive_scale=scale > 0)
        if cfg != p["cfg"]:
            self._kernels = {}
        if cfg.tile_m != p["cfg"].tile_m:
            # another kernel with another tile height: a new work table
            if self._use_cuda_graph:
                raise ValueError("forward() options that change the kernel are not allowed in CUDA-graph mode")
            work, num_work = plan_prefill(
                rp["qo_lens"], rp["kv_lens"], rp["q_starts"], rp["kv_starts"], rp["mask_bits"],
                group_size=cfg.group_size, tile_m=cfg.tile_m, causal=cfg.causal, window_left=window_left)
            p.update(work=work.to(self.device), num_work=num_work)
        p["mask"] = _trace_buffer(cfg, p["work"], p["num_kv_heads"], self.device, p["mask"])
        alibi = self._alibi_slopes(pos_encoding_mode, p["num_qo_heads"], True)
        p.update(cfg=cfg, causal=bool(causal), window_left=window_left, soft_cap=cap, sm_scale=scale,
                 pos_encoding_mode=pos_encoding_mode, alibi=alibi, rope_rcp_scale=rope_rcp_scale,
                 rope_log2_theta=rope_log2_theta, pos_args=_takes_pos_args(cfg))

    # ------------------------------------------------------------------ run (shared part)
    def _launch(self, q, k, v, *, q_scale, k_scale, v_scale, o_scale, out, lse, return_lse, lse_base, lse_layout,
                sinks, enable_pdl, kv_cache_sf):
        """Cheap checks of the rest against the plan (q and k/v are checked by the caller), then one kernel
        launch (no host synchronisation)."""
        if self._backend == "cudnn":  # cuDNN frontend graphs: cutedsl_attn/api/cudnn.py
            from .cudnn import run_wrapper
            return run_wrapper(self, q, k, v, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, o_scale=o_scale,
                               out=out, lse=lse, return_lse=return_lse, lse_base=lse_base, lse_layout=lse_layout,
                               sinks=sinks, enable_pdl=enable_pdl, kv_cache_sf=kv_cache_sf)
        p = self._plan
        if enable_pdl:
            raise NotImplementedError("enable_pdl=True is not supported (no programmatic dependent launch yet)")
        if kv_cache_sf is not None:
            raise NotImplementedError("kv_cache_sf (NVFP4 KV) is not supported")
        check_lse_options(lse_base, lse_layout)
        TQ, Hq, Dvo, dt = p["total_q"], p["num_qo_heads"], p["head_dim_vo"], p["dtype"]
        if out is None:
            out = torch.empty((TQ, Hq, Dvo), dtype=dt, device=self.device)
        else:
            check_tensor("out", out, shape=(TQ, Hq, Dvo), dtype=dt, device=self.device)
        lse_shape = (TQ, Hq) if lse_layout == "NH" else (Hq, TQ)
        if lse is not None:
            check_tensor("lse", lse, shape=lse_shape, dtype=torch.float32, device=self.device)
        if sinks is not None:
            check_tensor("sinks", sinks, shape=(Hq,), device=self.device)
            if sinks.dtype != torch.float32:
                raise ValueError(f"sinks must be float32, got {sinks.dtype}")
        sm_scale = p["sm_scale"] * run_scale("q_scale", q_scale) * run_scale("k_scale", k_scale)
        if sm_scale <= 0.0 and getattr(p["cfg"], "positive_scale_only", False):
            raise NotImplementedError(
                f"q_scale * k_scale <= 0 (sm_scale * q_scale * k_scale = {sm_scale}) is not supported by the "
                "SM90 prefill kernel this plan chose (it needs a positive softmax scale); fold the sign into "
                "sm_scale at plan() (a plan with sm_scale <= 0 runs the portable kernel) or set "
                "CUTEDSL_ATTN_PREFILL_KERNEL=portable before plan()"
            )
        o_div = run_scale("o_scale", o_scale)
        if o_div == 0.0:
            raise ValueError("o_scale must be nonzero (the output is divided by it)")
        o_factor = run_scale("v_scale", v_scale) / o_div

        want_lse = return_lse or lse is not None
        if lse_layout == "NH":
            lse_k = lse if lse is not None else (
                torch.empty(lse_shape, dtype=torch.float32, device=self.device) if return_lse else p["lse_scratch"])
            lse_out = lse_k
        else:  # the kernel writes [tokens, heads]; staged in the wrapper's scratch, transposed after
            lse_k = p["lse_scratch"]
            lse_out = lse
            if lse_out is None and return_lse:
                lse_out = torch.empty(lse_shape, dtype=torch.float32, device=self.device)
        if TQ > 0 or self._use_cuda_graph:
            fn = self._kernels.get(sinks is not None) or self._kernel(sinks is not None)
            tensors = (q, k, v, p["indices"], p["work"], out, lse_k, p["mask"],
                       self._dummy_f32 if sinks is None else sinks)
            try:
                if p["pos_args"]:  # the portable kernel: + ALiBi slopes, RoPE 1/scale and log2(theta)
                    fn(*tensors, p["alibi"], sm_scale, p["soft_cap"], p["window_left"], p["rope_rcp_scale"],
                       p["rope_log2_theta"])
                else:  # a kernel without positional encodings (the SM90 kernel's signature)
                    fn(*tensors, sm_scale, p["soft_cap"], p["window_left"])
            except ValueError as e:  # the tvm-ffi entry's layout checks, in FlashInfer's names
                raise self._entry_error(e) from None
            except Exception:
                if q.device.type != "cuda":
                    raise ValueError(
                        f"q, k, v and the workspace must be CUDA tensors to launch, got {q.device}"
                    ) from None
                raise
        if o_factor != 1.0:
            out.mul_(o_factor)
        if want_lse:
            if lse_layout == "NH":
                if lse_base == "ln":
                    lse_out.mul_(_LN2)
            elif lse_base == "ln":
                torch.mul(lse_k.t(), _LN2, out=lse_out)
            else:
                lse_out.copy_(lse_k.t())
        return (out, lse_out) if return_lse else out

    def _check_q(self, q) -> None:
        p = self._plan
        TQ, Hq, Dqk, dt = p["total_q"], p["num_qo_heads"], p["head_dim_qk"], p["dtype"]
        if not isinstance(q, torch.Tensor) or q.shape != (TQ, Hq, Dqk):
            check_tensor("q", q, ndim=3)
            raise ValueError(f"q must have shape [qo_indptr[-1], num_qo_heads, head_dim_qk] = {(TQ, Hq, Dqk)}, "
                             f"got {tuple(q.shape)}")
        if q.dtype != dt:
            raise ValueError(f"The dtype of q ({q.dtype}) does not match the q_data_type specified in plan ({dt})")
        if q.device != self.device:
            raise ValueError(f"q is on {q.device}, the wrapper on {self.device}")

    def _entry_error(self, e: ValueError) -> ValueError:
        k_name, v_name = self._k_names
        return kernel_entry_error(
            e, {0: "q", 1: k_name, 2: v_name, 3: "indices", 4: "work", 5: "out", 6: "lse", 7: "custom_mask", 8: "sinks",
                9: "alibi_slopes"},
            {"mQ": "q", "mK": k_name, "mV": v_name, "mO": "out", "mLSE": "lse", "mSinks": "sinks", "mIdx": "indices",
             "mMask": "custom_mask", "mAlibi": "alibi_slopes"})


class BatchPrefillWithRaggedKVCacheWrapper(_BatchPrefillBase):
    """Batched prefill / append attention over ragged (contiguous) K/V (FlashInfer's wrapper, same arguments).

    ``plan()`` once per batch (host work: reads the index arrays to the CPU, packs the
    custom mask, builds the work table; not capturable), then ``run()`` per layer (no host
    synchronisation; capturable in a CUDA graph when ``use_cuda_graph=True``).  The runs of one
    plan must not overlap in time (one wrapper's ``run()`` on two streams at once, or a replayed
    graph of it beside a direct call): on SM90 at head_dim <= 128 the persistent kernel's CTAs claim
    tiles from a counter in the plan's work table, which each launch leaves at 0 for the next.

    Args:
      float_workspace_buffer: uint8 tensor on the device, 16-byte aligned.  Kept for
        FlashInfer compatibility (128 MiB recommended there); this kernel has no split-KV
        and does not use it.
      kv_layout: ``"NHD"`` (k ``[total_kv, Hkv, D]``) or ``"HND"`` (k ``[Hkv, total_kv, D]``,
        served as a permuted view, no copy); bad value -> ``KeyError``.
      use_cuda_graph: fixed batch size and buffer addresses; needs ``qo_indptr_buf`` and
        ``kv_indptr_buf`` (int32 ``[B+1]`` on the device), plus ``custom_mask_buf`` (uint8,
        large enough for every plan's packed mask) and ``mask_indptr_buf`` (int32 ``[B+1]``)
        for plans with a custom mask.  The first plan fixes the maximum ``qo_indptr[-1]``.
      backend: ``"auto"`` or ``"cute"`` (both the CuTe DSL kernel), or ``"cudnn"`` (a cuDNN
        frontend SDPA graph, :mod:`cutedsl_attn.api.cudnn`; needs ``nvidia-cudnn-frontend``, no
        CUDA-graph mode, custom masks / RoPE / ALiBi / soft cap / non-causal window / sinks / fp8
        raise ``NotImplementedError``); FlashInfer's other names raise ``NotImplementedError``.
      jit_args, jit_kwargs, variant_owns_mask: not supported (``NotImplementedError``).

    Raises:
      KeyError: bad ``kv_layout``.  TypeError / ValueError: bad workspace or CUDA-graph buffers.
      NotImplementedError: unsupported backend, ``jit_args``, ``jit_kwargs``, ``variant_owns_mask``.
    """

    _k_names = ("k", "v")

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None,
        kv_indptr_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None,
        mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args=None,
        jit_kwargs=None,
        variant_owns_mask: bool = False,
    ) -> None:
        self._init_common(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args, jit_kwargs,
                          variant_owns_mask)
        if self._use_cuda_graph:
            _check_graph_buffer("qo_indptr_buf", qo_indptr_buf, self.device)
            _check_graph_buffer("kv_indptr_buf", kv_indptr_buf, self.device)
            self._fixed_batch_size = qo_indptr_buf.shape[0] - 1
            if kv_indptr_buf.shape[0] != qo_indptr_buf.shape[0]:
                raise ValueError(
                    f"The length of kv_indptr_buf ({kv_indptr_buf.shape[0]}) should be the same as qo_indptr_buf "
                    f"({qo_indptr_buf.shape[0]})"
                )
            self._check_mask_buffers(custom_mask_buf, mask_indptr_buf, self._fixed_batch_size)
        else:
            self._fixed_batch_size = None
        self._qo_indptr_buf = qo_indptr_buf
        self._kv_indptr_buf = kv_indptr_buf
        self._custom_mask_buf = custom_mask_buf
        self._mask_indptr_buf = mask_indptr_buf

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        head_dim_vo: int | None = None,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        non_blocking: bool = True,
        prefix_len_ptr: torch.Tensor | None = None,
        token_pos_in_items_ptr: torch.Tensor | None = None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr: torch.Tensor | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
        seq_lens: torch.Tensor | None = None,
        seq_lens_q: torch.Tensor | None = None,
        max_token_per_sequence: int | None = None,
        max_sequence_kv: int | None = None,
        v_indptr: torch.Tensor | None = None,
        o_indptr: torch.Tensor | None = None,
        uniform_q_len: int | None = None,
        *,
        score_mod=None,
    ) -> None:
        """Plan a ragged prefill batch (FlashInfer semantics; see the module and class docstrings).

        Args:
          qo_indptr: int32 ``[B+1]`` query-row offsets (tokens), non-decreasing; request ``b`` owns
            rows ``qo_indptr[b]:qo_indptr[b+1]`` of ``q``/``out``/``lse`` (any device; read on the host).
          kv_indptr: int32 ``[B+1]`` KV-row offsets (tokens) into ``k``/``v``, non-decreasing.
          num_qo_heads, num_kv_heads: ``num_qo_heads % num_kv_heads == 0``, group <= 16.
          head_dim_qk: 32, 64, 128, 192 or 256.  head_dim_vo: 32, 64, 128 or 256 (default
            ``head_dim_qk``; e.g. 192/128 for MLA prefill).  Any pair compiles; pairs verified on
            the H200: equal dims 32-256 and 192/128.
          custom_mask: bool, the concatenation of each request's row-major ``[qo_len_b, kv_len_b]``
            mask (``sum_b qo_len_b * kv_len_b`` elements, ``False`` = masked); packed here with
            ``segment_packbits(..., bitorder="little")``.  Replaces ``causal``.
          packed_custom_mask: uint8, that packed form (each request's bits padded to whole
            bytes: ``sum_b ceil(qo_len_b * kv_len_b / 8)`` bytes); wins over ``custom_mask``.  For
            one request it equals ``packbits(mask, bitorder="little")``.
          causal: bottom-right causal mask (ignored with a custom mask).
          pos_encoding_mode: ``"NONE"``, ``"ROPE_LLAMA"`` or ``"ALIBI"``, applied in the kernel (other
            strings: ``KeyError``, as FlashInfer).  Query token ``i`` of a request is at position
            ``i + kv_len - qo_len``, key ``j`` at ``j``.  ``ROPE_LLAMA``: non-interleaved ("rotate
            half") RoPE of q and k, pairs ``(d, d + D/2)``, ``freq_d = rope_theta^(-2d/D) / rope_scale``.
            ``ALIBI``: ``slope_h * (j - (i + kv_len - qo_len))`` added to the scaled logit, slopes of
            FlashInfer's ``get_alibi_slopes(num_qo_heads)``; the output equals FlashInfer's, the LSE
            differs from FlashInfer's (which uses ``j - i``) by ``slope_h * (kv_len - qo_len) * log2 e``
            (see the module docstring).  ``ALIBI`` with ``logits_soft_cap > 0``: ``NotImplementedError``.
          use_fp16_qk_reduction: must be False (``NotImplementedError``).
          window_left: inclusive left window, ``w`` keeps ``w+1`` keys; -1 disables.
          logits_soft_cap: ``cap*tanh(s/cap)`` on scaled logits when > 0; None/0 disables.
          sm_scale: softmax scale, default ``1/sqrt(head_dim_qk)``.
          rope_scale, rope_theta: RoPE interpolation factor and base (None -> 1.0 and 1e4), used with
            ``"ROPE_LLAMA"``; always validated: a finite value > 0 (``ValueError`` otherwise, ``TypeError``
            for a non-number).
          q_data_type, kv_data_type, o_data_type: fp16/bf16, all equal (kv and o default to q,
            q to float16 as in FlashInfer).  fp8: ``NotImplementedError``.
          non_blocking: host-to-device copies of the plan are asynchronous.
          prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr:
            multi-item scoring, not supported (``NotImplementedError`` unless None/0).
          fixed_split_size, disable_split_kv: accepted (a positive ``fixed_split_size`` is
            validated); the kernel never splits the KV, so results are batch-invariant anyway.
          seq_lens, seq_lens_q, max_token_per_sequence, max_sequence_kv, v_indptr, o_indptr:
            cuDNN-backend hints in FlashInfer; accepted when consistent with ``qo_indptr`` /
            ``kv_indptr`` (``ValueError`` otherwise).
          uniform_q_len: optional hint; if given every request must have that many query rows.
          score_mod: this package's extension (not in FlashInfer; FlashAttention-4's ``score_mod``), keyword only:
            a Python callable ``score_mod(score, batch_idx, head_idx, q_idx, kv_idx) -> score`` traced into the
            kernel (no C++), applied to every logit ``score = sm_scale * q.k`` (natural-log units, as the
            oracle's) before the masks; ``batch_idx`` the request, ``head_idx`` the query head, ``kv_idx`` the
            key (from the request's first) and ``q_idx`` the query's position on that axis, ``i + kv_len -
            qo_len`` for its token ``i`` (FlashInfer's bottom-right alignment, as causal; the token index when
            ``qo_len == kv_len``), so ``kv_idx - q_idx`` is ALiBi's distance.  The kernel calls it with CuTe DSL
            scalars (Float32 score, Int32 indices): Python arithmetic, ``cutlass.select_`` / ``cutlass.min`` /
            ``cutlass.max`` and ``cute.math`` functions work; Python's ``min`` / ``max`` / ``if`` on a score do
            not trace, ``**`` on an Int32 crashes the DSL 4.8.1 compiler (write ``x * x``), and integer ``//`` /
            ``%`` of negative values truncate (C) where the oracle floors (Python).  Its source, closure values
            and referenced globals (values, user functions and the attributes of user modules it names) are part
            of the compile key, re-derived at every plan: a change compiles anew.  Returning ``-inf`` hides a key.
            Not with ``logits_soft_cap`` or ``ALIBI`` (``NotImplementedError``: fold them into the function) nor
            ``backend="cudnn"``.  Verified on the H200 with the SM90 and the portable kernels.

        Raises:
          TypeError, ValueError: malformed arguments (each message names the argument), CUDA-graph
            limits (batch size, total rows, mask buffer size); a ``score_mod`` that is not callable or has no
            stable compile key (``TypeError``: e.g. an object with ``__call__``; give it ``__cute_hash__``).
          KeyError: unknown ``pos_encoding_mode``.
          NotImplementedError: the unsupported options above, head dims, group > 16, ALIBI with a soft cap,
            ``score_mod`` with a soft cap, ALIBI or the cuDNN backend.
        """
        qo_h = indptr_host("qo_indptr", qo_indptr)
        B = qo_h.shape[0] - 1
        kv_h = indptr_host("kv_indptr", kv_indptr, length=B + 1)
        _reject_multi_item(prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr)
        _check_split_options(fixed_split_size)
        head_dim_qk, head_dim_vo = _check_head_dims(head_dim_qk, head_dim_vo)
        qo_lens = qo_h[1:] - qo_h[:-1]
        kv_lens = kv_h[1:] - kv_h[:-1]
        _check_lengths_hint("seq_lens", seq_lens, kv_lens)
        _check_lengths_hint("seq_lens_q", seq_lens_q, qo_lens)
        _check_max_hint("max_token_per_sequence", max_token_per_sequence, int(qo_lens.max()) if B else 0)
        _check_max_hint("max_sequence_kv", max_sequence_kv, int(kv_lens.max()) if B else 0)
        for n, t, ref in (("v_indptr", v_indptr, kv_h), ("o_indptr", o_indptr, qo_h)):
            if t is not None:
                h = indptr_host(n, t, length=B + 1)
                if not torch.equal(h, ref):
                    raise NotImplementedError(
                        f"{n} different from {'kv_indptr' if n == 'v_indptr' else 'qo_indptr'} is not supported"
                    )
        if uniform_q_len is not None:
            u = check_int("uniform_q_len", uniform_q_len)
            if B and (qo_lens != u).any():
                raise ValueError(f"uniform_q_len={u} but the requests have {qo_lens.tolist()} query rows")
        copies = []
        if self._use_cuda_graph:
            copies = [(self._qo_indptr_buf, qo_indptr), (self._kv_indptr_buf, kv_indptr)]
        self._plan_common(
            qo_h=qo_h, kv_lens=kv_lens, kv_starts=kv_h[:-1], total_kv=int(kv_h[-1]), page_size=0, flat_indices=None,
            table=False,
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo,
            custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
            pos_encoding_mode=pos_encoding_mode, use_fp16_qk_reduction=use_fp16_qk_reduction, sm_scale=sm_scale,
            window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
            q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type, non_blocking=non_blocking,
            graph_copies=copies, score_mod=score_mod,
        )

    begin_forward = plan

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *args,
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        o_scale: float | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        lse_base: str = "log2",
        lse_layout: str = "NH",
        enable_pdl: bool | None = None,
        kv_cache_sf=None,
        sinks: torch.Tensor | None = None,
    ):
        """Prefill attention for the planned ragged batch.

        Args:
          q: ``[qo_indptr[-1], num_qo_heads, head_dim_qk]`` in the planned dtype, last dim contiguous.
          k: ``[total_kv, num_kv_heads, head_dim_qk]`` (NHD) or ``[num_kv_heads, total_kv, head_dim_qk]``
            (HND) with ``total_kv >= kv_indptr[-1]``; any strides with a contiguous last dim.
          v: like ``k`` with ``head_dim_vo``.
          q_scale, k_scale: floats multiplied into ``sm_scale``; v_scale: multiplies the output;
            o_scale: divides it (one extra elementwise op when ``v_scale / o_scale != 1``).
            (FlashInfer's FA2 path ignores these for 16-bit inputs; here they always apply.)
          out: optional ``[qo_indptr[-1], Hq, head_dim_vo]`` output in q's dtype (contiguous).
          lse: optional float32 LSE output, ``[qo_indptr[-1], Hq]`` (``lse_layout="NH"``) or
            ``[Hq, qo_indptr[-1]]`` (``"HN"``), contiguous; filled whenever given.
          return_lse: also return the LSE.
          lse_base: ``"log2"`` (default) or ``"ln"``.  lse_layout: ``"NH"`` (default) or ``"HN"``
            (the kernel writes NH into a wrapper buffer, then one transpose copy).
          enable_pdl: only None/False (``NotImplementedError``).  kv_cache_sf: must be None.
          sinks: extension (not in FlashInfer's ragged ``run``): optional float32 ``[num_qo_heads]``
            sink logits, as the paged wrapper's ``run(sinks=...)``.

        Returns:
          ``out``, or ``(out, lse)`` when ``return_lse``.

        Raises:
          RuntimeError: run before plan.  TypeError: extra positional arguments.  ValueError:
          shape, dtype, device or layout mismatch with the plan, bad ``lse_base``/``lse_layout``.
          NotImplementedError: the unsupported options above.
        """
        p = self._plan
        if p is None:
            raise RuntimeError("plan() must be called before run()")
        if args:
            raise TypeError("run() takes no extra positional arguments (custom-kernel args are not supported)")
        self._check_q(q)
        k, v = self._check_kv(k, v)
        return self._launch(q, k, v, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, o_scale=o_scale, out=out,
                            lse=lse, return_lse=return_lse, lse_base=lse_base, lse_layout=lse_layout, sinks=sinks,
                            enable_pdl=enable_pdl, kv_cache_sf=kv_cache_sf)

    def _check_kv(self, k, v):
        p = self._plan
        for n, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                check_tensor(n, t, ndim=3)
        if self._kv_layout == "HND":
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        for n, t, d in (("k", k, p["head_dim_qk"]), ("v", v, p["head_dim_vo"])):
            if t.dtype != p["dtype"]:
                raise ValueError(f"The dtype of {n} ({t.dtype}) does not match the kv_data_type specified in plan "
                                 f"({p['dtype']})")
            if t.shape[1:] != (p["num_kv_heads"], d) or t.shape[0] < p["total_kv"]:
                raise ValueError(
                    f"{n} has shape {tuple(t.shape)} (as NHD), expected [>= kv_indptr[-1] = {p['total_kv']}, "
                    f"{p['num_kv_heads']}, {d}] for kv_layout={self._kv_layout}"
                )
            if t.device != self.device:
                raise ValueError(f"{n} is on {t.device}, expected {self.device}")
        return k, v

    run_return_lse = return_lse_method("[total_q, num_qo_heads]")

    def forward(self, q, k, v, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, window_left=-1,
                logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None):
        """Deprecated (FlashInfer): ``run(q, k, v)`` after replacing the planned ``causal``, ``pos_encoding_mode``,
        ``window_left``, ``logits_soft_cap``, ``sm_scale``, ``rope_scale`` and ``rope_theta`` with these arguments
        (defaults included)."""
        self._override_options(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap,
                               sm_scale, rope_scale, rope_theta)
        return self.run(q, k, v)

    def forward_return_lse(self, q, k, v, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
                           window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None):
        """Deprecated (FlashInfer): :meth:`forward` returning ``(out, lse)``."""
        self._override_options(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap,
                               sm_scale, rope_scale, rope_theta)
        return self.run_return_lse(q, k, v)


class BatchPrefillWithPagedKVCacheWrapper(_BatchPrefillBase):
    """Batched prefill / append attention over a paged KV cache (FlashInfer's wrapper, same arguments).

    ``plan()`` once per batch (host work: reads the page table and offsets to the CPU,
    packs the custom mask, builds the work table; not capturable), then ``run()`` per layer
    (no host synchronisation; capturable in a CUDA graph when ``use_cuda_graph=True``, and a
    captured graph stays valid across re-plans of the same batch size).

    Args:
      float_workspace_buffer: uint8 tensor on the device, 16-byte aligned (kept for FlashInfer
        compatibility; this kernel has no split-KV and does not use it).
      kv_layout: ``"NHD"`` (``[pages, page_size, Hkv, D]``) or ``"HND"``
        (``[pages, Hkv, page_size, D]``, served as a permuted view); bad value -> ``KeyError``.
      use_cuda_graph: fixed batch size and buffer addresses; needs ``qo_indptr_buf`` (``[B+1]``),
        ``paged_kv_indptr_buf`` (``[B+1]``), ``paged_kv_indices_buf`` (``[max_pages]``) and
        ``paged_kv_last_page_len_buf`` (``[B]``), int32 on the device, plus
        ``custom_mask_buf``/``mask_indptr_buf`` for plans with a custom mask.  The first plan
        fixes the maximum ``qo_indptr[-1]``.
      backend: ``"auto"`` or ``"cute"``, or ``"cudnn"`` (as the ragged wrapper); FlashInfer's other
        names raise ``NotImplementedError``.
      jit_args, jit_kwargs, variant_owns_mask: not supported (``NotImplementedError``).

    Raises:
      KeyError: bad ``kv_layout``.  TypeError / ValueError: bad workspace or CUDA-graph buffers.
      NotImplementedError: unsupported backend, ``jit_args``, ``jit_kwargs``, ``variant_owns_mask``.
    """

    _paged = True
    _k_names = ("k_cache", "v_cache")

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None,
        paged_kv_indptr_buf: torch.Tensor | None = None,
        paged_kv_indices_buf: torch.Tensor | None = None,
        paged_kv_last_page_len_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None,
        mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args=None,
        jit_kwargs=None,
        variant_owns_mask: bool = False,
    ) -> None:
        self._init_common(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args, jit_kwargs,
                          variant_owns_mask)
        if self._use_cuda_graph:
            for n, b in (("qo_indptr_buf", qo_indptr_buf), ("paged_kv_indptr_buf", paged_kv_indptr_buf),
                         ("paged_kv_indices_buf", paged_kv_indices_buf),
                         ("paged_kv_last_page_len_buf", paged_kv_last_page_len_buf)):
                _check_graph_buffer(n, b, self.device)
            self._fixed_batch_size = qo_indptr_buf.shape[0] - 1
            if paged_kv_indptr_buf.shape[0] != self._fixed_batch_size + 1:
                raise ValueError("The length of paged_kv_indptr_buf should be batch_size + 1 "
                                 f"(len(qo_indptr_buf) = {qo_indptr_buf.shape[0]})")
            if paged_kv_last_page_len_buf.shape[0] != self._fixed_batch_size:
                raise ValueError("The length of paged_kv_last_page_len_buf should be batch_size "
                                 f"(len(qo_indptr_buf) - 1 = {self._fixed_batch_size})")
            self._check_mask_buffers(custom_mask_buf, mask_indptr_buf, self._fixed_batch_size)
        else:
            self._fixed_batch_size = None
        self._qo_indptr_buf = qo_indptr_buf
        self._paged_kv_indptr_buf = paged_kv_indptr_buf
        self._paged_kv_indices_buf = paged_kv_indices_buf
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buf
        self._custom_mask_buf = custom_mask_buf
        self._mask_indptr_buf = mask_indptr_buf

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor | None,
        paged_kv_indices: torch.Tensor | None,
        paged_kv_last_page_len: torch.Tensor | None,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: int | None = None,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        non_blocking: bool = True,
        prefix_len_ptr: torch.Tensor | None = None,
        token_pos_in_items_ptr: torch.Tensor | None = None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        seq_lens_q: torch.Tensor | None = None,
        block_tables: torch.Tensor | None = None,
        max_token_per_sequence: int | None = None,
        max_sequence_kv: int | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
        uniform_q_len: int | None = None,
        *,
        score_mod=None,
    ) -> None:
        """Plan a paged prefill batch (FlashInfer semantics; see the module and class docstrings).

        Args:
          qo_indptr: int32 ``[B+1]`` query-row offsets (tokens), non-decreasing.
          paged_kv_indptr: int32 ``[B+1]`` page-table CSR offsets (in pages), non-decreasing.
          paged_kv_indices: int32 ``[paged_kv_indptr[-1]]`` physical page ids, on the wrapper's device.
          paged_kv_last_page_len: int32 ``[B]``, in ``[1, page_size]`` (0 only for a request with no
            page); ``kv_len_b = (npages_b - 1) * page_size + last_page_len_b``.
          num_qo_heads, num_kv_heads: ``num_qo_heads % num_kv_heads == 0``, group <= 16.
          head_dim_qk: 32, 64, 128, 192 or 256.  page_size: any value >= 1.
          head_dim_vo: 32, 64, 128 or 256 (default ``head_dim_qk``).
          custom_mask, packed_custom_mask, causal, pos_encoding_mode, use_fp16_qk_reduction,
            sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta, q/kv/o_data_type,
            non_blocking, multi-item scoring arguments, fixed_split_size, disable_split_kv,
            max_token_per_sequence, uniform_q_len, score_mod (keyword only; this package's extension): as
            :meth:`BatchPrefillWithRaggedKVCacheWrapper.plan`.
          block_tables, seq_lens: dense page table ``[B, max_pages]`` int32 on the device and
            ``[B]`` KV lengths (tokens); used instead of the CSR arrays when ``block_tables`` is
            given (then those three may be None; if ``paged_kv_indptr`` and
            ``paged_kv_last_page_len`` are given too, the KV lengths they describe must equal
            ``seq_lens``: ``ValueError`` otherwise).  With the CSR arrays alone, a given
            ``seq_lens`` must agree with them.
          seq_lens_q: optional ``[B]`` query lengths; must agree with ``qo_indptr``.
          max_sequence_kv: optional hint, >= the longest KV.

        Raises:
          TypeError, ValueError: malformed arguments (each message names the argument), CUDA-graph
            limits (batch size, total rows, indices / mask buffer sizes).
          KeyError: unknown ``pos_encoding_mode``.
          NotImplementedError: as the ragged wrapper's ``plan``.
        """
        qo_h = indptr_host("qo_indptr", qo_indptr)
        B = qo_h.shape[0] - 1
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        _reject_multi_item(prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr)
        _check_split_options(fixed_split_size)
        head_dim_qk, head_dim_vo = _check_head_dims(head_dim_qk, head_dim_vo)
        copies = []
        if block_tables is not None:
            if seq_lens is None:
                raise ValueError("block_tables and seq_lens must be given together")
            check_tensor("block_tables", block_tables, ndim=2)
            if block_tables.dtype != torch.int32:
                raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
            block_tables = block_tables.to(self.device, non_blocking=non_blocking)  # as FlashInfer: host ok
            if block_tables.shape[0] != B:
                raise ValueError(f"block_tables must have B = len(qo_indptr) - 1 = {B} rows, "
                                 f"got {block_tables.shape[0]}")
            check_tensor("seq_lens", seq_lens, ndim=1)
            if seq_lens.dtype.is_floating_point or seq_lens.dtype == torch.bool:
                raise ValueError(f"seq_lens must be an integer tensor, got {seq_lens.dtype}")
            if seq_lens.shape[0] != B:
                raise ValueError(f"seq_lens must have shape [{B}], got {tuple(seq_lens.shape)}")
            kv_lens = seq_lens.to("cpu", torch.int64)
            if (kv_lens < 0).any():
                raise ValueError("seq_lens must be >= 0")
            if paged_kv_indptr is not None and paged_kv_last_page_len is not None:
                # both forms given: block_tables/seq_lens serve the launch; the CSR form must not disagree
                _, csr_lens = csr_kv_lens(paged_kv_indptr, paged_kv_last_page_len, B, page_size)
                if not torch.equal(csr_lens, kv_lens):
                    raise ValueError(
                        f"seq_lens {kv_lens.tolist()} disagree with the KV lengths of the CSR page table "
                        f"(paged_kv_indptr/paged_kv_last_page_len: {csr_lens.tolist()}); pass one form, or both "
                        "describing the same batch")
            if B and int(kv_lens.max()) > block_tables.shape[1] * page_size:
                raise ValueError("block_tables is too narrow for seq_lens: need ceil(seq_len/page_size) columns")
            flat = (block_tables if block_tables.is_contiguous() else block_tables.contiguous()).reshape(-1)
            page_offsets = torch.arange(B, dtype=torch.int64) * block_tables.shape[1]
            if self._use_cuda_graph:
                copies = [(self._qo_indptr_buf, qo_indptr)]
        else:
            for n, t in (("paged_kv_indptr", paged_kv_indptr), ("paged_kv_indices", paged_kv_indices),
                         ("paged_kv_last_page_len", paged_kv_last_page_len)):
                check_tensor(n, t, ndim=1)
                if t.dtype != torch.int32:
                    raise ValueError(f"{n} must be int32, got {t.dtype}")
            # as FlashInfer 0.7.2: page indices on the host (or another device) are copied to the wrapper's
            paged_kv_indices = paged_kv_indices.to(self.device, non_blocking=non_blocking)
            ip_h, kv_lens = csr_kv_lens(paged_kv_indptr, paged_kv_last_page_len, B, page_size)
            if int(ip_h[-1]) > paged_kv_indices.shape[0]:
                raise ValueError(f"paged_kv_indptr[-1] ({int(ip_h[-1])}) exceeds len(paged_kv_indices) "
                                 f"({paged_kv_indices.shape[0]})")
            _check_lengths_hint("seq_lens", seq_lens, kv_lens)
            page_offsets = ip_h[:-1]
            flat = paged_kv_indices
            if self._use_cuda_graph:
                if paged_kv_indices.shape[0] > self._paged_kv_indices_buf.shape[0]:
                    raise ValueError(
                        f"The length of paged_kv_indices ({paged_kv_indices.shape[0]}) exceeds "
                        f"paged_kv_indices_buf ({self._paged_kv_indices_buf.shape[0]})"
                    )
                copies = [(self._qo_indptr_buf, qo_indptr), (self._paged_kv_indptr_buf, paged_kv_indptr),
                          (self._paged_kv_last_page_len_buf, paged_kv_last_page_len),
                          (self._paged_kv_indices_buf, paged_kv_indices)]
                flat = self._paged_kv_indices_buf
        qo_lens = qo_h[1:] - qo_h[:-1]
        _check_lengths_hint("seq_lens_q", seq_lens_q, qo_lens)
        _check_max_hint("max_token_per_sequence", max_token_per_sequence, int(qo_lens.max()) if B else 0)
        _check_max_hint("max_sequence_kv", max_sequence_kv, int(kv_lens.max()) if B else 0)
        if uniform_q_len is not None:
            u = check_int("uniform_q_len", uniform_q_len)
            if B and (qo_lens != u).any():
                raise ValueError(f"uniform_q_len={u} but the requests have {qo_lens.tolist()} query rows")
        self._plan_common(
            qo_h=qo_h, kv_lens=kv_lens, kv_starts=page_offsets, total_kv=0, page_size=page_size, flat_indices=flat,
            table=block_tables is not None,
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo,
            custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
            pos_encoding_mode=pos_encoding_mode, use_fp16_qk_reduction=use_fp16_qk_reduction, sm_scale=sm_scale,
            window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
            q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type, non_blocking=non_blocking,
            graph_copies=copies, score_mod=score_mod,
        )

    begin_forward = plan

    def _split_cache(self, paged_kv_cache):
        """(k, v) NHD-ordered views of the cache, validated against the plan."""
        p = self._plan
        return paged_kv_views(paged_kv_cache, self._kv_layout, page_size=p["page_size"],
                              num_kv_heads=p["num_kv_heads"], head_dims=(p["head_dim_qk"], p["head_dim_vo"]),
                              dtype=p["dtype"], device=self.device)

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache,
        *args,
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        lse_base: str = "log2",
        lse_layout: str = "NH",
        enable_pdl: bool | None = None,
        window_left: int | None = None,
        sinks: torch.Tensor | None = None,
        kv_cache_sf=None,
        skip_softmax_threshold_scale_factor: float | None = None,
        use_fp16_softmax: bool | None = None,
        uses_spcompress: bool | None = None,
    ):
        """Prefill attention for the planned paged batch.

        Args:
          q: ``[qo_indptr[-1], num_qo_heads, head_dim_qk]`` in the planned dtype, last dim contiguous.
          paged_kv_cache: ``(k_cache, v_cache)`` 4-D tensors or one 5-D tensor ``[pages, 2, ...]``
            (then ``head_dim_vo == head_dim_qk``) in the wrapper's ``kv_layout``; 3-D / 4-D forms
            for page size 1; any strides with a contiguous last dim.
          q_scale, k_scale: floats multiplied into ``sm_scale``; v_scale: multiplies the output.
          out, lse, return_lse, lse_base, lse_layout: as
            :meth:`BatchPrefillWithRaggedKVCacheWrapper.run`.
          window_left: if given it must equal the planned value.
          sinks: optional float32 ``[num_qo_heads]`` per-head sink logits (natural log, not scaled
            by ``sm_scale``), included in the softmax denominator and the LSE.
          enable_pdl, kv_cache_sf, skip_softmax_threshold_scale_factor, use_fp16_softmax,
            uses_spcompress: not supported (``NotImplementedError`` unless None/False).

        Returns:
          ``out`` ``[qo_indptr[-1], Hq, head_dim_vo]``, or ``(out, lse)`` when ``return_lse``.

        Raises:
          RuntimeError: run before plan.  TypeError: extra positional arguments.  ValueError:
          shape, dtype, device or layout mismatch with the plan.  NotImplementedError: the
          unsupported options above.
        """
        p = self._plan
        if p is None:
            raise RuntimeError("plan() must be called before run()")
        if args:
            raise TypeError("run() takes no extra positional arguments (custom-kernel args are not supported)")
        if skip_softmax_threshold_scale_factor is not None:
            raise NotImplementedError("skip_softmax_threshold_scale_factor is not supported")
        if use_fp16_softmax:
            raise NotImplementedError("use_fp16_softmax=True (trtllm-gen only) is not supported")
        if uses_spcompress:
            raise NotImplementedError("uses_spcompress=True (trtllm-gen only) is not supported")
        if window_left is not None and window_left != p["window_left"]:
            raise ValueError(f"window_left={window_left} at run() differs from plan() ({p['window_left']})")
        self._check_q(q)
        k, v = self._split_cache(paged_kv_cache)
        return self._launch(q, k, v, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, o_scale=None, out=out,
                            lse=lse, return_lse=return_lse, lse_base=lse_base, lse_layout=lse_layout, sinks=sinks,
                            enable_pdl=enable_pdl, kv_cache_sf=kv_cache_sf)

    run_return_lse = return_lse_method("[total_q, num_qo_heads]")

    def forward(self, q, paged_kv_cache, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
                k_scale=None, v_scale=None, window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
                rope_theta=None):
        """Deprecated (FlashInfer): ``run(q, paged_kv_cache, k_scale=, v_scale=)`` after replacing the planned
        ``causal``, ``pos_encoding_mode``, ``window_left``, ``logits_soft_cap``, ``sm_scale``, ``rope_scale`` and
        ``rope_theta`` with these arguments (defaults included)."""
        self._override_options(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap,
                               sm_scale, rope_scale, rope_theta)
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale)

    def forward_return_lse(self, q, paged_kv_cache, causal=False, pos_encoding_mode="NONE",
                           use_fp16_qk_reduction=False, k_scale=None, v_scale=None, window_left=-1,
                           logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None):
        """Deprecated (FlashInfer): :meth:`forward` returning ``(out, lse)``."""
        self._override_options(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap,
                               sm_scale, rope_scale, rope_theta)
        return self.run_return_lse(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale)


# ----------------------------------------------------------------------------- single request
_single_state = threading.local()  # one wrapper per (thread, device, dtype): plan() + run() per call


def single_prefill_with_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale_q: torch.Tensor | None = None,
    scale_k: torch.Tensor | None = None,
    scale_v: torch.Tensor | None = None,
    o_dtype: torch.dtype | None = None,
    custom_mask: torch.Tensor | None = None,
    packed_custom_mask: torch.Tensor | None = None,
    causal: bool = False,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    use_fp16_qk_reduction: bool = False,
    sm_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    rope_scale: float | None = None,
    rope_theta: float | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    kv_cache_sf=None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    *,
    score_mod=None,
):
    """Prefill / append attention of one request against a contiguous KV (FlashInfer's function).

    Args:
      q: ``[qo_len, num_qo_heads, head_dim_qk]`` fp16/bf16, last dim contiguous.
      k: ``[kv_len, num_kv_heads, head_dim_qk]`` (NHD) or ``[num_kv_heads, kv_len, head_dim_qk]``
        (HND), q's dtype, last dim contiguous.  v: like ``k`` with ``head_dim_vo``.
      scale_q, scale_k, scale_v: fp8 per-head scales, not supported (``NotImplementedError``).
      o_dtype: None or q's dtype (other dtypes: ``NotImplementedError``).
      custom_mask: bool ``[qo_len, kv_len]`` (``False`` = masked; replaces ``causal``), packed
        here with ``packbits(..., bitorder="little")``.
      packed_custom_mask: uint8 ``[ceil(qo_len * kv_len / 8)]``, that packed form; wins over
        ``custom_mask``.
      causal: bottom-right causal mask (rows with no visible key give O = 0, LSE = -inf).
      kv_layout: ``"NHD"`` or ``"HND"`` (``KeyError`` otherwise).
      pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap,
        rope_scale, rope_theta: as :meth:`BatchPrefillWithRaggedKVCacheWrapper.plan`
        (``"ROPE_LLAMA"``: q row ``i`` at position ``i + kv_len - qo_len``, key ``j`` at ``j``;
        ``"ALIBI"``: bias ``slope_h * (j - (i + kv_len - qo_len))``, FlashInfer's slopes).
      backend: ``"auto"`` or ``"cute"``; ``"fa2"``/``"fa3"``: ``NotImplementedError``.
      return_lse: also return the base-2 LSE ``[qo_len, num_qo_heads]`` (float32).
      kv_cache_sf: NVFP4 scale factors, not supported (``NotImplementedError``).
      k_scale: float multiplied into ``sm_scale``.  v_scale: float multiplying the output.
      score_mod: keyword only, this package's extension: as :meth:`BatchPrefillWithRaggedKVCacheWrapper.plan`
        (``batch_idx`` is 0).

    Returns:
      ``o`` ``[qo_len, num_qo_heads, head_dim_vo]`` in q's dtype, or ``(o, lse)``.

    Raises:
      TypeError, ValueError: malformed arguments (naming them), e.g. ``rope_scale``/``rope_theta``
      not a finite value > 0.  KeyError: bad ``kv_layout`` or ``pos_encoding_mode``.
      NotImplementedError: the unsupported options above, head dims, group > 16, ALIBI with a
      soft cap, ``score_mod`` with a soft cap or ALIBI (a bad ``score_mod``: ``TypeError``).

    Served by a cached :class:`BatchPrefillWithRaggedKVCacheWrapper` (one request), planned on
    every call (host work, no synchronisation).
    """
    check_kv_layout(kv_layout)
    if backend == "cudnn":
        raise NotImplementedError("single_prefill_with_kv_cache: backend='cudnn' is served by the batch prefill "
                                  f"wrappers (cuDNN frontend graphs), not here; supported here: {_SUPPORTED_BACKENDS}")
    _check_backend(backend)
    for n, x in (("scale_q", scale_q), ("scale_k", scale_k), ("scale_v", scale_v)):
        if x is not None:
            raise NotImplementedError(f"{n} (fp8 per-head scales) is not supported")
    if kv_cache_sf is not None:
        raise NotImplementedError("kv_cache_sf (NVFP4 KV) is not supported")
    check_tensor("q", q, ndim=3)
    check_tensor("k", k, ndim=3)
    check_tensor("v", v, ndim=3)
    if kv_layout == "HND":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must agree on [kv_len, num_kv_heads], got {tuple(k.shape)} and {tuple(v.shape)}")
    qo_len, hq, dqk = q.shape
    kv_len, hkv, dvo = k.shape[0], k.shape[1], v.shape[2]
    if k.shape[2] != dqk:
        raise ValueError(f"q head_dim {dqk} != k head_dim {k.shape[2]}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise NotImplementedError(f"q/k/v dtypes must match (got {q.dtype}, {k.dtype}, {v.dtype})")
    if o_dtype is not None and canonical_dtype("o_dtype", o_dtype) != q.dtype:
        raise NotImplementedError(f"o_dtype={o_dtype} differs from q's dtype {q.dtype}; not supported")
    if custom_mask is not None and packed_custom_mask is None:
        check_tensor("custom_mask", custom_mask)
        if custom_mask.shape != (qo_len, kv_len) and custom_mask.shape != (qo_len * kv_len,):
            raise ValueError(f"custom_mask must have shape [qo_len, kv_len] = {(qo_len, kv_len)}, "
                             f"got {tuple(custom_mask.shape)}")
        custom_mask = custom_mask.reshape(-1)
    dev = q.device
    key = (dev, q.dtype)
    cache = getattr(_single_state, "wrappers", None)
    if cache is None:
        cache = _single_state.wrappers = {}
    w = cache.get(key)
    if w is None:
        w = cache[key] = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(16, dtype=torch.uint8, device=dev), "NHD")
    # k_scale joins the softmax scale at plan time, so the kernel choice sees the effective scale
    ks = run_scale("k_scale", k_scale)
    if ks != 1.0 and isinstance(sm_scale, (int, float, type(None))) and not isinstance(sm_scale, bool):
        sm_scale = (1.0 / math.sqrt(dqk) if sm_scale is None else float(sm_scale)) * ks
        k_scale = None
    w.plan(
        torch.tensor([0, qo_len], dtype=torch.int32), torch.tensor([0, kv_len], dtype=torch.int32), hq, hkv, dqk,
        head_dim_vo=dvo, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
        pos_encoding_mode=pos_encoding_mode, use_fp16_qk_reduction=use_fp16_qk_reduction, window_left=window_left,
        logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
        q_data_type=q.dtype, score_mod=score_mod,
    )
    return w.run(q, k, v, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)


single_prefill_with_kv_cache_return_lse = functools.partial(single_prefill_with_kv_cache, return_lse=True)
single_prefill_with_kv_cache_return_lse.__doc__ = """:func:`single_prefill_with_kv_cache` with ``return_lse=True``:
returns ``(o [qo_len, Hq, head_dim_vo], lse [qo_len, Hq])`` (base-2 LSE, float32).  Same arguments."""
