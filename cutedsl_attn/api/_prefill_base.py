"""The plan / run machinery shared by the prefill wrappers (ragged and paged; decode's multi-row path plans through
the paged one): option checks, the kernel choice, the work table, the wrapper-owned buffers and the launch.

Conventions and the public signatures: :mod:`cutedsl_attn.api.prefill`.
"""

from __future__ import annotations

import math
import numbers
import warnings

import torch

from ..common.constants import LN2 as _LN2
from .. import dispatch
from ..planning.alibi import get_alibi_slopes
from ..planning.prefill import PrefillArgs, max_tiles, plan_prefill
from ._common import (
    canonical_dtype,
    check_bool,
    check_devices,
    check_float,
    check_heads,
    check_int,
    check_kv_layout,
    check_lse_options,
    check_pos_encoding_mode,
    check_sm_scale,
    check_optional_bool,
    check_tensor,
    check_window_left,
    host_launch_error,
    run_scale,
)
from ._graph import FixedBuffers, changed_keys, check_graph_buffer, pinned_if_capturing, to_device
from ._mask import pack_custom_mask

SUPPORTED_HEAD_DIMS_QK = (32, 64, 128, 192, 256)
SUPPORTED_HEAD_DIMS_VO = (32, 64, 128, 256)

# the kernel arguments (PrefillArgs fields) in the names of FlashInfer's ragged / paged wrappers
_RAGGED_NAMES = {"mask": "custom_mask"}
_PAGED_NAMES = {"k": "k_cache", "v": "v_cache", "mask": "custom_mask"}


# ----------------------------------------------------------------------------- shared checks

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
        dispatch.callable_key(score_mod)  # its compile key: a callable without a stable one fails here, not in run()
    except TypeError as e:
        raise TypeError(f"score_mod: {e}") from None
    _check_score_mod_signature(score_mod)
    if backend == "cudnn":
        raise NotImplementedError("score_mod is not supported with backend='cudnn' (use 'auto' or 'cute')")


_SCORE_MOD_ARGS = "(score, batch_idx, head_idx, q_idx, kv_idx)"


def _check_score_mod_signature(score_mod) -> None:
    """``TypeError`` unless ``score_mod`` can be called with the five positional arguments
    ``(score, batch_idx, head_idx, q_idx, kv_idx)`` (checked at plan time, not at the first compile)."""
    import inspect

    try:
        sig = inspect.signature(score_mod)
    except (TypeError, ValueError):  # a builtin without a signature: left to the compile
        return
    try:
        sig.bind(*range(5))
    except TypeError as e:
        raise TypeError(f"score_mod must accept 5 positional arguments {_SCORE_MOD_ARGS}, got a callable with "
                        f"signature {sig} ({e})") from None


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


def _check_lengths_hint(name: str, t, expect: torch.Tensor, against: str = "the index arrays") -> None:
    """``seq_lens``-style hints (cuDNN-only arguments in FlashInfer): must agree with the offsets (``against``
    names the arrays they come from)."""
    if t is None:
        return
    check_tensor(name, t)
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    h = t.to("cpu", torch.int64).reshape(-1)
    if h.shape != expect.shape or not torch.equal(h, expect):
        raise ValueError(f"{name} ({h.tolist()}) disagrees with the lengths given by {against} "
                         f"({expect.tolist()})")


def _check_max_hint(name: str, value, actual: int) -> None:
    if value is None:
        return
    value = check_int(name, value)
    if value < actual:
        raise ValueError(f"{name}={value} is smaller than the actual maximum length {actual}")


# ----------------------------------------------------------------------------- the wrappers
class _BatchPrefillBase:
    """Plan/run machinery shared by the ragged and paged wrappers (not public)."""

    _paged = False
    _arg_names = _RAGGED_NAMES
    _launch_entry = None  # the entry point a host launch's error names (None: this wrapper's run)

    def _init_common(self, float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args, jit_kwargs,
                     variant_owns_mask) -> None:
        check_kv_layout(kv_layout)
        check_bool("use_cuda_graph", use_cuda_graph)
        check_bool("variant_owns_mask", variant_owns_mask)
        self._cudnn = dispatch.prefill_backend(backend) == "cudnn"
        if self._cudnn:  # cuDNN frontend graphs: cutedsl_attn/api/cudnn.py
            from .cudnn import check_wrapper_init
            check_wrapper_init(use_cuda_graph)
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
        # wrapper-owned buffers; in CUDA-graph mode allocated once (fixed addresses)
        self._bufs = FixedBuffers(self.device, fixed=self._use_cuda_graph)
        self._graph_rows = None
        self._graph_tile_m = None
        self._graph_sig = None  # the first CUDA-graph plan's kernel and scalars (frozen afterwards)
        self._max_total_num_rows = None
        self._lse_scratch = None
        self._dummy_i32 = None
        self._dummy_u8 = None
        self._dummy_f32 = None
        self._alibi_buf = None

    def _check_mask_buffers(self, custom_mask_buf, mask_indptr_buf, batch_size) -> None:
        if not self._use_cuda_graph:
            return
        if custom_mask_buf is not None:
            check_graph_buffer("custom_mask_buf", custom_mask_buf, self.device, dtype=torch.uint8)
        if mask_indptr_buf is not None:
            check_graph_buffer("mask_indptr_buf", mask_indptr_buf, self.device, length=batch_size + 1)

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
                     num_kv_heads, head_dim_qk, head_dim_vo, custom_mask, packed_custom_mask, causal,
                     pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale,
                     rope_theta, q_data_type, kv_data_type, o_data_type, non_blocking, graph_copies,
                     score_mod=None) -> None:
        """Everything after the index arrays are parsed: options, mask, kernel choice, work table, buffers.

        ``flat_indices``: the flat page-id array the kernel reads (None when ragged); ``table``:
        it is a dense block table (copied into a wrapper-owned buffer in CUDA-graph mode).
        ``graph_copies``: ``[(dst_buffer, src_tensor), ...]`` of the caller-visible CUDA-graph
        buffers, written only after every check has passed (a rejected plan leaves them intact).
        """
        check_bool("causal", causal)
        check_bool("use_fp16_qk_reduction", use_fp16_qk_reduction)
        check_bool("non_blocking", non_blocking)
        _check_score_mod(score_mod, "cudnn" if self._cudnn else "cute")
        if self._cudnn:  # cuDNN frontend graphs (cutedsl_attn/api/cudnn.py)
            from .cudnn import plan_wrapper
            return plan_wrapper(
                self, qo_h=qo_h, kv_lens=kv_lens, kv_starts=kv_starts, total_kv=total_kv, page_size=page_size,
                flat_indices=flat_indices, table=table, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, custom_mask=custom_mask,
                packed_custom_mask=packed_custom_mask, causal=causal, pos_encoding_mode=pos_encoding_mode,
                use_fp16_qk_reduction=use_fp16_qk_reduction, sm_scale=sm_scale, window_left=window_left,
                logits_soft_cap=logits_soft_cap, q_data_type=q_data_type, kv_data_type=kv_data_type,
                o_data_type=o_data_type, non_blocking=non_blocking, graph_copies=graph_copies,
                rope_scale=rope_scale, rope_theta=rope_theta)
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
            self._check_graph_batch(B, total_q, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo)
        packed, byte_ptr = pack_custom_mask(custom_mask, packed_custom_mask, qo_lens, kv_lens)
        use_mask = packed is not None
        mask_bits = byte_ptr[:-1] * 8 if use_mask else None

        # the shape part of the problem (kept for forward()'s re-dispatch) and the options part
        problem_kw = dict(dtype=dt, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, group_size=group,
                          page_size=page_size, use_custom_mask=use_mask, score_mod=score_mod)
        # every argument is checked by now; the index arrays may be on the host, the workspace the kernel writes not
        check_devices(f"{type(self).__name__}.plan", [("float_workspace_buffer", self._workspace)])
        choice = self._choose(problem_kw, causal, window_left, cap, pos_encoding_mode, scale)
        tile_m = choice.tile_m
        if use_mask and self._use_cuda_graph:
            self._check_graph_mask(packed)
        num_rows = None
        if self._use_cuda_graph:
            # a captured graph replays the kernel and the scalars of the plan it was captured after: only
            # the lengths (work table, indices, mask bits) may change between plans
            self._freeze_signature(dispatch.graph_signature(
                choice, causal=bool(causal), window_left=window_left, logits_soft_cap=cap, sm_scale=scale,
                pos_encoding_mode=pos_encoding_mode, rope_scale=1.0 / rope_rcp_scale,
                rope_theta=2.0 ** rope_log2_theta, custom_mask=use_mask,
                score_mod=None if score_mod is None else dispatch.callable_key(score_mod)))
            if self._graph_rows is None:
                max_rows = total_q
                num_rows = max_tiles(max_rows, B, group, tile_m)
            else:
                max_rows, num_rows = self._max_total_num_rows, self._graph_rows
        work, num_work = plan_prefill(
            qo_lens, kv_lens, qo_h[:-1], kv_starts, mask_bits, group_size=group, tile_m=tile_m, num_rows=num_rows,
            causal=choice.problem.causal, window_left=window_left,
        )
        table_buf = self._bufs.get("block_tables")
        if self._use_cuda_graph and table and table_buf is not None and flat_indices.numel() > table_buf.numel():
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
            if self._use_cuda_graph and table:  # a dense block table: a wrapper-owned buffer of fixed address
                indices = self._bufs.copy("block_tables", flat_indices, non_blocking=non_blocking)
        mask = self._dummy_u8
        if use_mask:
            if self._use_cuda_graph:
                self._custom_mask_buf[: packed.shape[0]].copy_(pinned_if_capturing(packed), non_blocking=non_blocking)
                self._mask_indptr_buf.copy_(byte_ptr.to(torch.int32), non_blocking=non_blocking)
                mask = self._custom_mask_buf
            elif packed.numel():
                mask = to_device(packed, dev, non_blocking)
        work_dev = self._bufs.copy("work", work, non_blocking=non_blocking)
        if self._use_cuda_graph:
            if self._graph_rows is None:
                self._graph_rows, self._graph_tile_m, self._max_total_num_rows = num_rows, tile_m, max_rows
                self._lse_scratch = torch.empty((max(max_rows, 1), num_qo_heads), dtype=torch.float32, device=dev)
        elif self._lse_scratch is None or self._lse_scratch.shape != (total_q, num_qo_heads):
            self._lse_scratch = torch.empty((total_q, num_qo_heads), dtype=torch.float32, device=dev)
        alibi = self._alibi_slopes(pos_encoding_mode, num_qo_heads, non_blocking)
        self._plan = dict(
            B=B, total_q=total_q, total_kv=total_kv,
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo,
            page_size=page_size, group=group, dtype=dt, causal=bool(causal), use_mask=use_mask,
            window_left=window_left, soft_cap=cap, sm_scale=scale, choice=choice, cfg=choice.cfg, work=work_dev,
            num_work=num_work,
            indices=indices, mask=mask, lse_scratch=self._lse_scratch[:total_q],
            pos_encoding_mode=pos_encoding_mode, alibi=alibi, rope_rcp_scale=rope_rcp_scale,
            rope_log2_theta=rope_log2_theta,
            replan=dict(qo_lens=qo_lens, kv_lens=kv_lens, q_starts=qo_h[:-1], kv_starts=kv_starts,
                        mask_bits=mask_bits, problem_kw=problem_kw),
        )

    def _choose(self, problem_kw, causal, window_left, cap, pos_encoding_mode, scale):
        """The kernel choice for the shape part ``problem_kw`` of a plan and its validated options."""
        problem = dispatch.prefill_problem(
            **problem_kw, causal=bool(causal) and not problem_kw["use_custom_mask"], use_window=window_left >= 0,
            use_soft_cap=cap > 0, pos_encoding_mode=pos_encoding_mode)
        return dispatch.prefill_choice(problem, positive_scale=scale > 0)

    def _check_graph_batch(self, B, total_q, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo) -> None:
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

    def _check_graph_mask(self, packed) -> None:
        if not isinstance(self._custom_mask_buf, torch.Tensor):
            raise ValueError("custom_mask_buf must be a torch.Tensor in cuda graph mode if a custom mask is used")
        if not isinstance(self._mask_indptr_buf, torch.Tensor):
            raise ValueError("mask_indptr_buf must be a torch.Tensor in cuda graph mode if a custom mask is used")
        if packed.shape[0] > self._custom_mask_buf.shape[0]:
            raise ValueError(
                f"the packed custom mask ({packed.shape[0]} bytes) does not fit custom_mask_buf "
                f"({self._custom_mask_buf.shape[0]} bytes)"
            )

    def _freeze_signature(self, sig: dict) -> None:
        if self._graph_sig is None:
            self._graph_sig = sig
        elif sig != self._graph_sig:
            changed = [k for k in changed_keys(self._graph_sig, sig) if k != "kernel"] or ["the kernel choice"]
            raise ValueError(
                f"in CUDA-graph mode plan() may only change lengths; {', '.join(changed)} changed since the "
                "first plan (a captured graph would replay the old kernel and scalars); create a new wrapper"
            )

    def _alibi_slopes(self, pos_encoding_mode, num_qo_heads, non_blocking):
        """The kernel's ALiBi slopes argument: FlashInfer's slopes in a wrapper-owned ``[Hq]`` fp32 buffer
        (kept across plans: a fixed address in CUDA-graph mode), or the 1-element dummy."""
        if pos_encoding_mode != "ALIBI":
            return self._dummy_f32
        if self._alibi_buf is None or self._alibi_buf.shape[0] != num_qo_heads:
            self._alibi_buf = torch.empty(num_qo_heads, dtype=torch.float32, device=self.device)
        self._alibi_buf.copy_(pinned_if_capturing(get_alibi_slopes(num_qo_heads)), non_blocking=non_blocking)
        return self._alibi_buf

    def _override_options(self, causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap,
                          sm_scale, rope_scale, rope_theta) -> None:
        """The deprecated ``forward`` API: its options replace the planned ones (FlashInfer semantics)."""
        warnings.warn("forward()/forward_return_lse() are deprecated (as in FlashInfer); use run()/run_return_lse()",
                      DeprecationWarning, stacklevel=3)
        check_bool("causal", causal)
        check_bool("use_fp16_qk_reduction", use_fp16_qk_reduction)
        p = self._plan
        if p is None:
            raise RuntimeError("plan() must be called before forward()")
        if self._cudnn:
            raise NotImplementedError("the deprecated forward()/forward_return_lse() are not supported with "
                                      "backend='cudnn'; plan() with the options, then run()")
        window_left, cap, scale, rope_rcp_scale, rope_log2_theta = _check_options(
            pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale, p["head_dim_qk"],
            rope_scale, rope_theta)
        rp = p["replan"]
        _check_score_mod_options(rp["problem_kw"]["score_mod"], cap, pos_encoding_mode)
        choice = self._choose(rp["problem_kw"], causal, window_left, cap, pos_encoding_mode, scale)
        if choice.tile_m != p["choice"].tile_m:
            # another kernel with another tile height: a new work table
            if self._use_cuda_graph:
                raise ValueError("forward() options that change the kernel are not allowed in CUDA-graph mode")
            work, num_work = plan_prefill(
                rp["qo_lens"], rp["kv_lens"], rp["q_starts"], rp["kv_starts"], rp["mask_bits"],
                group_size=p["group"], tile_m=choice.tile_m, causal=choice.problem.causal, window_left=window_left)
            p.update(work=to_device(work, self.device, True), num_work=num_work)
        alibi = self._alibi_slopes(pos_encoding_mode, p["num_qo_heads"], True)
        p.update(choice=choice, cfg=choice.cfg, causal=bool(causal), window_left=window_left, soft_cap=cap, sm_scale=scale,
                 pos_encoding_mode=pos_encoding_mode, alibi=alibi, rope_rcp_scale=rope_rcp_scale,
                 rope_log2_theta=rope_log2_theta)

    # ------------------------------------------------------------------ run (shared part)
    def _launch(self, q, k, v, *, q_scale, k_scale, v_scale, o_scale, out, lse, return_lse, lse_base, lse_layout,
                sinks, enable_pdl, kv_cache_sf):
        """Cheap checks of the rest against the plan (q and k/v are checked by the caller), then one kernel
        launch (no host synchronisation)."""
        check_bool("return_lse", return_lse)
        check_optional_bool("enable_pdl", enable_pdl)
        if self._cudnn:  # cuDNN frontend graphs: cutedsl_attn/api/cudnn.py
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
        sm_scale = p["sm_scale"]
        output_scale = 1.0  # v_scale / o_scale, applied in the kernel's fp32 epilogue
        if q_scale is not None or k_scale is not None or v_scale is not None or o_scale is not None:
            sm_scale *= run_scale("q_scale", q_scale) * run_scale("k_scale", k_scale)
            o_div = run_scale("o_scale", o_scale)
            if o_div == 0.0:
                raise ValueError("o_scale must be nonzero (the output is divided by it)")
            output_scale = run_scale("v_scale", v_scale) / o_div

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
            choice = p["choice"] if sinks is None else p["choice"].with_sinks()
            args = PrefillArgs(q, k, v, p["indices"], p["work"], out, lse_k, p["mask"],
                               self._dummy_f32 if sinks is None else sinks, p["alibi"], sm_scale, p["soft_cap"],
                               p["window_left"], p["rope_rcp_scale"], p["rope_log2_theta"], output_scale)
            try:
                choice.launch(args)
            except Exception as e:
                # host tensors reach a launch only when cross-compiling without a GPU: the entry or the launch refuses
                # them, by device (a layout complaint of the entry keeps its own message)
                entry = isinstance(e, dispatch.KernelEntryError)
                if q.device.type != "cuda" and not isinstance(e, NotImplementedError) and (
                        not entry or "device_type" in str(e)):
                    raise host_launch_error(self._launch_entry or f"{type(self).__name__}.run", q.device) from None
                if entry:  # the compiled entry's layout checks, in FlashInfer's names
                    raise e.named(self._arg_names) from None
                raise
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
