"""FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` (conventions: :mod:`cutedsl_attn.api.prefill`), and
:class:`MultiRowDecodePrefillWrapper`, the same wrapper with fp8 e4m3 caches, on which the decode entry points plan
their requests of several query rows."""

from __future__ import annotations

import torch

from ._common import (canonical_dtype, check_bool, check_int, check_optional_bool, csr_kv_lens, indptr_host,
                      paged_kv_views, return_lse_method)
from ._graph import check_graph_buffer
from ._pagetable import from_block_tables, from_csr
from ._prefill_base import (
    _PAGED_NAMES,
    _BatchPrefillBase,
    _check_head_dims,
    _check_lengths_hint,
    _check_max_hint,
    _check_split_options,
    _reject_multi_item,
)

__all__ = ["BatchPrefillWithPagedKVCacheWrapper"]


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
    _arg_names = _PAGED_NAMES
    #: K/V cache dtypes plan() takes besides the query's (none: fp8 prefill is not served on this public wrapper)
    _fp8_kv_dtypes: tuple = ()
    _kv_fp8 = None  # the planned fp8 cache dtype; None: the cache has the query's dtype

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
                check_graph_buffer(n, b, self.device)
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
        check_bool("non_blocking", non_blocking)
        check_bool("disable_split_kv", disable_split_kv)
        qo_h = indptr_host("qo_indptr", qo_indptr)
        B = qo_h.shape[0] - 1
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        _reject_multi_item(prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr)
        _check_split_options(fixed_split_size)
        head_dim_qk, head_dim_vo = _check_head_dims(head_dim_qk, head_dim_vo)
        copies = []
        if block_tables is not None:
            kv_lens, page_offsets, flat = from_block_tables(block_tables, seq_lens, page_size, self.device,
                                                            non_blocking, batch_size=B)
            if paged_kv_indptr is not None and paged_kv_last_page_len is not None:
                # both forms given: block_tables/seq_lens serve the launch; the CSR form must not disagree
                _, csr_lens = csr_kv_lens(paged_kv_indptr, paged_kv_last_page_len, B, page_size,
                                         batch_name="len(qo_indptr) - 1")
                if not torch.equal(csr_lens, kv_lens):
                    raise ValueError(
                        f"seq_lens {kv_lens.tolist()} disagree with the KV lengths of the CSR page table "
                        f"(paged_kv_indptr/paged_kv_last_page_len: {csr_lens.tolist()}); pass one form, or both "
                        "describing the same batch")
            if self._use_cuda_graph:
                copies = [(self._qo_indptr_buf, qo_indptr)]
        else:
            # as FlashInfer 0.7.2: page indices on the host (or another device) are copied to the wrapper's
            _, kv_lens, page_offsets, flat = from_csr(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                                                      page_size, self.device, non_blocking, batch_size=B)
            _check_lengths_hint("seq_lens", seq_lens, kv_lens)
            if self._use_cuda_graph:
                if flat.shape[0] > self._paged_kv_indices_buf.shape[0]:
                    raise ValueError(
                        f"The length of paged_kv_indices ({flat.shape[0]}) exceeds "
                        f"paged_kv_indices_buf ({self._paged_kv_indices_buf.shape[0]})"
                    )
                copies = [(self._qo_indptr_buf, qo_indptr), (self._paged_kv_indptr_buf, paged_kv_indptr),
                          (self._paged_kv_last_page_len_buf, paged_kv_last_page_len),
                          (self._paged_kv_indices_buf, flat)]
                flat = self._paged_kv_indices_buf
        kv_fp8 = self._planned_fp8_cache(kv_data_type)
        qo_lens = qo_h[1:] - qo_h[:-1]
        _check_lengths_hint("seq_lens_q", seq_lens_q, qo_lens)
        _check_max_hint("max_token_per_sequence", max_token_per_sequence, int(qo_lens.max()) if B else 0)
        _check_max_hint("max_sequence_kv", max_sequence_kv, int(kv_lens.max()) if B else 0)
        if uniform_q_len is not None:
            u = check_int("uniform_q_len", uniform_q_len)
            if B and (qo_lens != u).any():
                raise ValueError(f"uniform_q_len={u} but the requests have {qo_lens.tolist()} query rows")
        prev, self._kv_fp8 = self._kv_fp8, kv_fp8  # read by _choose; kept only when the plan succeeds
        try:
            self._plan_common(
                qo_h=qo_h, kv_lens=kv_lens, kv_starts=page_offsets, total_kv=0, page_size=page_size,
                flat_indices=flat, table=block_tables is not None, num_qo_heads=num_qo_heads,
                num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, custom_mask=custom_mask,
                packed_custom_mask=packed_custom_mask, causal=causal, pos_encoding_mode=pos_encoding_mode,
                use_fp16_qk_reduction=use_fp16_qk_reduction, sm_scale=sm_scale, window_left=window_left,
                logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
                q_data_type=q_data_type, kv_data_type=None if kv_fp8 is not None else kv_data_type,
                o_data_type=o_data_type, non_blocking=non_blocking, graph_copies=copies, score_mod=score_mod,
            )
        except BaseException:
            self._kv_fp8 = prev
            raise

    begin_forward = plan

    def _planned_fp8_cache(self, kv_data_type):
        """``kv_data_type`` when it is one of :attr:`_fp8_kv_dtypes` (an fp8 cache this wrapper serves), else None
        (the shared checks then require the query's dtype).  NotImplementedError for one with ``backend="cudnn"``."""
        if not self._fp8_kv_dtypes:
            return None
        dt = canonical_dtype("kv_data_type", kv_data_type)
        if dt not in self._fp8_kv_dtypes:
            return None
        if self._cudnn:
            raise NotImplementedError(f"kv_data_type={dt} is not supported with backend='cudnn'; backend='cute' "
                                      "serves it")
        return dt

    def _choose(self, problem_kw, *options):
        if self._kv_fp8 is not None:
            problem_kw = dict(problem_kw, kv_dtype=self._kv_fp8)
        return super()._choose(problem_kw, *options)

    def _split_cache(self, paged_kv_cache):
        """(k, v) NHD-ordered views of the cache, validated against the plan."""
        p = self._plan
        return paged_kv_views(paged_kv_cache, self._kv_layout, page_size=p["page_size"],
                              num_kv_heads=p["num_kv_heads"], head_dims=(p["head_dim_qk"], p["head_dim_vo"]),
                              dtype=self._kv_fp8 or p["dtype"], device=self.device)

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
          q_scale, k_scale: floats multiplied into ``sm_scale``; v_scale: multiplies the output (in the kernel's
            fp32 epilogue, before the rounding).
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
        if check_optional_bool("use_fp16_softmax", use_fp16_softmax):
            raise NotImplementedError("use_fp16_softmax=True (trtllm-gen only) is not supported")
        if check_optional_bool("uses_spcompress", uses_spcompress):
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


class MultiRowDecodePrefillWrapper(BatchPrefillWithPagedKVCacheWrapper):
    """:class:`BatchPrefillWithPagedKVCacheWrapper` that also plans ``kv_data_type=torch.float8_e4m3fn`` caches
    under fp16/bf16 queries (the portable prefill kernel widens e4m3 in shared memory): the wrapper the decode
    entry points' requests of several query rows plan on (``trtllm_batch_decode_with_kv_cache`` with
    ``q_len_per_req > 1``, ``xqa`` with ``q_seq_len > 1``, prims_ts decode with ``seq_len_q > 1`` or packed rows).

    Arguments, shapes and errors: the base class's.  An fp8 plan's ``run()`` takes e4m3 caches of the plan's
    layout (strides multiples of 16 elements); per-tensor ``k_scale`` multiplies ``sm_scale`` and ``v_scale`` the
    output (fp32, before the rounding), as for a 16-bit cache.  ``backend="cudnn"`` with an fp8 cache raises
    NotImplementedError.
    """

    _fp8_kv_dtypes = (torch.float8_e4m3fn,)
