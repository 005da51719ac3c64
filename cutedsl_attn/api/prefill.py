"""FlashInfer-shaped prefill / append API: ``single_prefill_with_kv_cache`` (+ ``_return_lse``),
``BatchPrefillWithRaggedKVCacheWrapper``, ``BatchPrefillWithPagedKVCacheWrapper``.

Signatures, argument names, defaults and conventions follow FlashInfer 0.7.2
(``flashinfer.prefill``):
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

What runs where (``cutedsl_attn.dispatch.prefill_choice`` decides, once per ``plan()``):
on SM90 the TMA + wgmma kernel (``cutedsl_attn.sm90.prefill``: a producer warpgroup (TMA for
ragged K/V and for paged blocks of whole pages, a cp.async gather for the rest) and two or three
wgmma consumer warpgroups, 128 or 192 packed rows per CTA) serves ragged and paged KV, custom masks
included, without positional encoding, head_dim >= 64 and a group size dividing 128; everything else runs
the portable CuTe DSL prefill kernel (``cutedsl_attn.portable.prefill``: ``cp.async`` +
``ldmatrix`` + ``mma.sync``, 64 packed rows per CTA).  Both pack the query heads of a kv
head into the MMA rows and both are verified on an NVIDIA H200 (SM90); on SM100/SM103 the
portable kernel is only cross-compiled and PTX-checked.  ``backend="cudnn"`` runs cuDNN
frontend graphs instead (``cutedsl_attn.api.cudnn``).  There is no split-KV: each CTA
reads the whole visible KV range of its rows, so results do not depend on the batch
composition.
"""

from __future__ import annotations

import functools
import math

import torch

from .. import dispatch
from ._common import (canonical_dtype, check_bool, check_devices, check_int, check_kv_layout, check_one_device,
                      check_tensor, indptr_host, return_lse_method, run_scale)
from ._graph import check_graph_buffer, staged_host_copies
from ._prefill_base import (
    _BatchPrefillBase,
    _check_head_dims,
    _check_lengths_hint,
    _check_max_hint,
    _check_split_options,
    _reject_multi_item,
)
from .prefill_paged import BatchPrefillWithPagedKVCacheWrapper

__all__ = [
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
]


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
            check_graph_buffer("qo_indptr_buf", qo_indptr_buf, self.device)
            check_graph_buffer("kv_indptr_buf", kv_indptr_buf, self.device)
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
        check_bool("non_blocking", non_blocking)
        check_bool("disable_split_kv", disable_split_kv)
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
            o_scale: divides it (``v_scale / o_scale`` applied in the kernel's fp32 epilogue, before the rounding).
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


# ----------------------------------------------------------------------------- single request
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
      k_scale: float multiplied into ``sm_scale``.  v_scale: float multiplying the output (in the kernel's fp32 epilogue).
      score_mod: keyword only, this package's extension: as :meth:`BatchPrefillWithRaggedKVCacheWrapper.plan`
        (``batch_idx`` is 0).

    Returns:
      ``o`` ``[qo_len, num_qo_heads, head_dim_vo]`` in q's dtype, or ``(o, lse)``.

    Raises:
      TypeError, ValueError: malformed arguments (naming them), e.g. ``rope_scale``/``rope_theta``
      not a finite value > 0; q / k / v (and a mask) not on one CUDA device, before any planning.  KeyError: bad
      ``kv_layout`` or ``pos_encoding_mode``.
      NotImplementedError: the unsupported options above, head dims, group > 16, ALIBI with a
      soft cap, ``score_mod`` with a soft cap or ALIBI (a bad ``score_mod``: ``TypeError``).

    Served by a :class:`BatchPrefillWithRaggedKVCacheWrapper` of one request made, planned and dropped on every
    call (host work, no synchronisation; no device state outlives the call).  Under ``torch.compile`` the call
    is the custom op ``cutedsl_attn::single_prefill`` (not with a ``score_mod``: ``NotImplementedError``).
    """
    check_kv_layout(kv_layout)
    for n, x in (("causal", causal), ("use_fp16_qk_reduction", use_fp16_qk_reduction), ("return_lse", return_lse)):
        check_bool(n, x)
    if backend == "cudnn":
        raise NotImplementedError("single_prefill_with_kv_cache: backend='cudnn' is served by the batch prefill "
                                  f"wrappers (cuDNN frontend graphs), not here; supported here: {dispatch.PREFILL_BACKENDS}")
    dispatch.prefill_backend(backend)
    for n, x in (("scale_q", scale_q), ("scale_k", scale_k), ("scale_v", scale_v)):
        if x is not None:
            raise NotImplementedError(f"{n} (fp8 per-head scales) is not supported")
    if kv_cache_sf is not None:
        raise NotImplementedError("kv_cache_sf (NVFP4 KV) is not supported")
    if torch.compiler.is_compiling():  # plan() is host work: the whole call is one custom op in the graph
        if score_mod is not None:
            raise NotImplementedError("single_prefill_with_kv_cache with a score_mod under torch.compile is not "
                                      "supported; plan a BatchPrefillWithRaggedKVCacheWrapper outside the compiled "
                                      "region and compile its run()")
        o, lse = _single_prefill_op(q, k, v, custom_mask, packed_custom_mask, causal, kv_layout, pos_encoding_mode,
                                    use_fp16_qk_reduction, _opt_float(sm_scale), window_left,
                                    _opt_float(logits_soft_cap), _opt_float(rope_scale), _opt_float(rope_theta),
                                    backend, _opt_float(k_scale), _opt_float(v_scale),
                                    canonical_dtype("o_dtype", o_dtype))
        return (o, lse) if return_lse else o
    return _single_prefill(q, k, v, o_dtype=o_dtype, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask,
                           causal=causal, kv_layout=kv_layout, pos_encoding_mode=pos_encoding_mode,
                           use_fp16_qk_reduction=use_fp16_qk_reduction, sm_scale=sm_scale, window_left=window_left,
                           logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
                           return_lse=return_lse, k_scale=k_scale, v_scale=v_scale, score_mod=score_mod)


def _opt_float(x):
    """A scale argument as the custom op's ``float?`` (None stays None; other types are checked eagerly)."""
    return None if x is None else float(x)


def _single_prefill(q, k, v, *, o_dtype, custom_mask, packed_custom_mask, causal, kv_layout, pos_encoding_mode,
                    use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta,
                    return_lse, k_scale, v_scale, score_mod):
    """The eager body of :func:`single_prefill_with_kv_cache` (its checks after the backend's)."""
    check_tensor("q", q, ndim=3)
    check_tensor("k", k, ndim=3)
    check_tensor("v", v, ndim=3)
    devices = [("q", q), ("k", k), ("v", v), ("custom_mask", custom_mask), ("packed_custom_mask", packed_custom_mask)]
    check_one_device("single_prefill_with_kv_cache", devices)  # CUDA once the shapes and dtypes are checked
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
    check_devices("single_prefill_with_kv_cache", devices)
    # a wrapper per call, dropped after it: no device tensor outlives the call (a CUDA-graph pool, e.g. of
    # torch.compile's reduce-overhead mode, must hold only the outputs)
    w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(16, dtype=torch.uint8, device=q.device), "NHD")
    w._launch_entry = "single_prefill_with_kv_cache"
    # k_scale joins the softmax scale at plan time, so the kernel choice sees the effective scale
    ks = run_scale("k_scale", k_scale)
    if ks != 1.0 and isinstance(sm_scale, (int, float, type(None))) and not isinstance(sm_scale, bool):
        sm_scale = (1.0 / math.sqrt(dqk) if sm_scale is None else float(sm_scale)) * ks
        k_scale = None
    with staged_host_copies():  # the same call may be captured next (CUDA graphs)
        w.plan(
            torch.tensor([0, qo_len], dtype=torch.int32), torch.tensor([0, kv_len], dtype=torch.int32), hq, hkv, dqk,
            head_dim_vo=dvo, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
            pos_encoding_mode=pos_encoding_mode, use_fp16_qk_reduction=use_fp16_qk_reduction, window_left=window_left,
            logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
            q_data_type=q.dtype, score_mod=score_mod,
        )
    return w.run(q, k, v, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)


@torch.library.custom_op("cutedsl_attn::single_prefill", mutates_args=())
def _single_prefill_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, custom_mask: torch.Tensor | None,
                       packed_custom_mask: torch.Tensor | None, causal: bool, kv_layout: str, pos_encoding_mode: str,
                       use_fp16_qk_reduction: bool, sm_scale: float | None, window_left: int,
                       logits_soft_cap: float | None, rope_scale: float | None, rope_theta: float | None,
                       backend: str, k_scale: float | None, v_scale: float | None,
                       o_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    return _single_prefill(q, k, v, o_dtype=o_dtype, custom_mask=custom_mask,
                           packed_custom_mask=packed_custom_mask, causal=causal, kv_layout=kv_layout,
                           pos_encoding_mode=pos_encoding_mode, use_fp16_qk_reduction=use_fp16_qk_reduction,
                           sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap,
                           rope_scale=rope_scale, rope_theta=rope_theta, return_lse=True, k_scale=k_scale,
                           v_scale=v_scale, score_mod=None)


@_single_prefill_op.register_fake
def _(q, k, v, custom_mask, packed_custom_mask, causal, kv_layout, pos_encoding_mode, use_fp16_qk_reduction,
      sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta, backend, k_scale, v_scale, o_dtype):
    return (q.new_empty((q.shape[0], q.shape[1], v.shape[-1])),
            q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32))


single_prefill_with_kv_cache_return_lse = functools.partial(single_prefill_with_kv_cache, return_lse=True)
single_prefill_with_kv_cache_return_lse.__doc__ = """:func:`single_prefill_with_kv_cache` with ``return_lse=True``:
returns ``(o [qo_len, Hq, head_dim_vo], lse [qo_len, Hq])`` (base-2 LSE, float32).  Same arguments."""
