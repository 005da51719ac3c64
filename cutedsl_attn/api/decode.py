"""FlashInfer-shaped decode API: ``single_decode_with_kv_cache``, ``BatchDecodeWithPagedKVCacheWrapper``,
``CUDAGraphBatchDecodeWithPagedKVCacheWrapper``.

Signatures, argument names, defaults and conventions follow FlashInfer 0.7.2
(``flashinfer.decode``): LSE is base 2; ``window_left=w`` keeps ``w+1`` keys;
``sm_scale`` defaults to ``1/sqrt(head_dim)``; sinks are natural-log logits not
scaled by ``sm_scale``; empty requests give O = 0 and LSE = -inf.

What runs where: the kernel behind these calls is the portable CuTe DSL paged
decode (``cutedsl_attn.portable.paged_decode``), run and verified on an NVIDIA
H200 (SM90); on SM100/SM103 it is only cross-compiled and PTX-checked.
"""

from __future__ import annotations

import math
import warnings

import torch

from .. import dispatch
from ..planning.alibi import get_alibi_slopes
from ..planning.decode import DecodeArgs
from ._common import (
    check_bool,
    check_head_dim,
    check_heads,
    check_kv_layout,
    check_pos_encoding_mode,
    check_float,
    check_int,
    check_optional_bool,
    check_sm_scale,
    check_devices,
    check_one_device,
    check_tensor,
    check_window_left,
    csr_kv_lens,
    host_launch_error,
    paged_kv_views,
    return_lse_method,
    run_scale,
)
from . import _decode_cudnn
from ._decode_plan import decode_graph_signature, plan_dtypes
from ._graph import FixedBuffers, pinned_if_capturing, staged_host_copies, to_device
from ._pagetable import from_block_tables, from_csr
from ._prefill_base import _check_lengths_hint
from .prefill_paged import MultiRowDecodePrefillWrapper  # q_len_per_req > 1 plans through it (fp8 caches too)

# the kernel arguments (DecodeArgs fields) in the names of FlashInfer's decode wrapper
_ARG_NAMES = {"k": "k_cache", "v": "v_cache"}
_PLAN_POSITIONAL = (
    "pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type", "o_data_type",
    "data_type", "sm_scale", "rope_scale", "rope_theta", "non_blocking", "block_tables", "seq_lens",
    "fixed_split_size", "disable_split_kv", "q_len_per_req",
)


class BatchDecodeWithPagedKVCacheWrapper:
    """Batched decode attention over a paged KV cache (FlashInfer's wrapper, same arguments).

    ``plan()`` once per batch (host work, reads the page table to the CPU, not
    capturable), then ``run()`` per layer (no host synchronisation; capturable in a
    CUDA graph when ``use_cuda_graph=True``).

    Args:
      float_workspace_buffer: uint8 CUDA tensor, 16-byte aligned; holds the fp32
        split-KV partials (128 MiB recommended, as FlashInfer).
      kv_layout: ``"NHD"`` (``[pages, page_size, Hkv, D]``) or ``"HND"``
        (``[pages, Hkv, page_size, D]``); bad value -> ``KeyError``.
      use_cuda_graph: fixed batch size and buffers; requires the three buffers below.
      use_tensor_cores: accepted for compatibility; the kernel always uses tensor
        cores (``mma.sync``) with the query heads of a group packed into MMA rows.
      paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer:
        int32 CUDA buffers (CUDA-graph mode): ``[B+1]``, ``[max_pages]``, ``[B]``.
      backend: ``"cute"`` (the CuTe DSL kernel), ``"cudnn"`` (cuDNN's paged decode graph, as
        ``cudnn_batch_decode_with_kv_cache``: CSR or block tables, ``q_len_per_req >= 1``, windows, return_lse;
        no RoPE, ALiBi, soft cap, fp8 KV, empty requests or ``v_scale``; needs cudnn-frontend; with ``q_len_per_req > 1`` cuDNN
        reads K/V slots past a request's length up to the next 128 keys, which must hold finite values) or
        ``"auto"``: the CuTe DSL kernel, or cuDNN where ``dispatch.decode_backend`` measured it faster (one row
        per request, large batch and long KV, no sinks / window / soft cap / RoPE / ALiBi / fp8; in CUDA-graph
        mode only with ``block_tables``; a call with sinks or ``v_scale``, or a capture before the cuDNN graph
        was built, runs the CuTe DSL kernel planned beside it).  ``fixed_split_size`` / ``disable_split_kv``
        keep the CuTe DSL kernel for every name.  cuDNN graphs are cached by shape: compatible re-plans keep
        them; build one with an eager ``run()`` before capturing.  FlashInfer's other backend names raise
        ``NotImplementedError``.
      jit_args: not supported (``NotImplementedError``); extend kernels through
        their Python config instead.

    Raises:
      TypeError / ValueError: bad workspace, missing CUDA-graph buffers.
      NotImplementedError: unsupported backend or ``jit_args``.
    """

    _launch_entry = "BatchDecodeWithPagedKVCacheWrapper.run"  # a host launch's error names it (single decode: its own)

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args=None,
    ) -> None:
        check_kv_layout(kv_layout)
        check_bool("use_cuda_graph", use_cuda_graph)
        check_bool("use_tensor_cores", use_tensor_cores)
        dispatch.decode_backend(backend)
        self._frozen_backend = None  # CUDA-graph mode: the backend of the first plan (a capture keeps it)
        if jit_args is not None:
            raise NotImplementedError("jit_args is not supported; kernels are extended through their Python config")
        check_tensor("float_workspace_buffer", float_workspace_buffer)
        if float_workspace_buffer.data_ptr() % 16:
            raise ValueError("float_workspace_buffer must be 16-byte aligned")
        self._kv_layout = kv_layout
        self._use_cuda_graph = bool(use_cuda_graph)
        self._use_tensor_cores = bool(use_tensor_cores)
        self._backend = backend
        self._workspace = float_workspace_buffer.view(torch.uint8).reshape(-1)
        self.device = float_workspace_buffer.device
        if use_cuda_graph:
            for n, b in (("paged_kv_indptr_buffer", paged_kv_indptr_buffer),
                         ("paged_kv_indices_buffer", paged_kv_indices_buffer),
                         ("paged_kv_last_page_len_buffer", paged_kv_last_page_len_buffer)):
                if not isinstance(b, torch.Tensor):
                    raise ValueError(f"{n} must be a torch.Tensor when use_cuda_graph=True")
                if b.dtype != torch.int32 or b.device != self.device:
                    raise ValueError(f"{n} must be int32 on {self.device}")
            if len(paged_kv_indptr_buffer) != len(paged_kv_last_page_len_buffer) + 1:
                raise ValueError(
                    "The length of paged_kv_indptr_buffer should be len(paged_kv_last_page_len_buffer) + 1"
                )
            self._fixed_batch_size = len(paged_kv_last_page_len_buffer)
        else:
            self._fixed_batch_size = None
        self._indptr_buf = paged_kv_indptr_buffer
        self._indices_buf = paged_kv_indices_buffer
        self._last_page_len_buf = paged_kv_last_page_len_buffer
        self._plan = None
        self._bufs = FixedBuffers(self.device, fixed=self._use_cuda_graph)
        self._counters = None
        self._graph_sig = None
        self._multirow = None
        self._dummy = None
        self._slopes = None
        self._lse_scratch = None

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None) -> None:
        """Swap the float workspace (re-``plan()`` afterwards).  ``int_workspace_buffer`` is unused here:
        the wrapper keeps its small int buffers (work table, split counters) itself."""
        check_tensor("float_workspace_buffer", float_workspace_buffer, device=self.device)
        self._workspace = float_workspace_buffer.view(torch.uint8).reshape(-1)
        self._plan = None

    # ------------------------------------------------------------------ plan
    def plan(
        self,
        indptr: torch.Tensor | None,
        indices: torch.Tensor | None,
        last_page_len: torch.Tensor | None,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *args,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        window_right: int = 0,
        logits_soft_cap: float | None = None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        data_type=None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        non_blocking: bool = True,
        block_tables: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
        q_len_per_req: int = 1,
        is_causal: bool | None = None,
    ) -> None:
        """Plan a decode batch (FlashInfer semantics; see the class docstring).

        Args:
          indptr: int32 ``[B+1]`` page-table CSR offsets (in pages), non-decreasing.
          indices: int32 ``[indptr[-1]]`` physical page ids, on the wrapper's device.
          last_page_len: int32 ``[B]``, in ``[1, page_size]`` (0 only for a request with no page).
          num_qo_heads, num_kv_heads: ``num_qo_heads % num_kv_heads == 0``, group <= 16.
          head_dim: 32, 64, 128 or 256.  page_size: any value >= 1.
          pos_encoding_mode: ``"NONE"``, ``"ROPE_LLAMA"`` (rotate-half, q at ``kv_len-1``,
            k at its position) or ``"ALIBI"`` (FlashInfer's slopes).
          window_left: inclusive left window, ``w`` keeps ``w+1`` keys; -1 disables.
          window_right: must be 0 (decode has no keys to the right).
          logits_soft_cap: ``cap*tanh(s/cap)`` on scaled logits when > 0; None/0 disables.
          q_data_type, kv_data_type, o_data_type, data_type: fp16/bf16, all equal, or ``kv_data_type``
            ``torch.float8_e4m3fn`` under a 16-bit q and o (an e4m3 cache, widened in the kernel, with per-tensor
            ``k_scale`` / ``v_scale`` at ``run()``; every ``q_len_per_req``; no ``ROPE_LLAMA`` at one row per
            request) (kv and o default to q; ``q_data_type`` defaults to float16; the deprecated ``data_type``, as
            in FlashInfer, only fills whichever of q/kv is unset).
          sm_scale: softmax scale, default ``1/sqrt(head_dim)``: a real number (or a one-element tensor, read
            to the host) finite in float32, of any sign, 0 included, as the prefill wrappers' ``plan()`` (the
            decode kernels scale the logits before the running max; ``run()``'s ``q_scale * k_scale`` may be
            negative too).
          rope_scale, rope_theta: RoPE parameters (defaults 1.0 and 1e4).
          block_tables, seq_lens: dense page table ``[B, max_pages]`` int32 and ``[B]`` lengths
            (tokens); used instead of the CSR arrays when given (then indptr/indices/last_page_len
            may be None; if ``indptr`` and ``last_page_len`` are given too, the KV lengths they
            describe must equal ``seq_lens``: ``ValueError`` otherwise).  With the CSR arrays alone, a
            given ``seq_lens`` must agree with them.
          non_blocking, disable_split_kv, is_causal (None or a bool): Python bools (``TypeError``
            otherwise, as every bool argument of this package).
          fixed_split_size: split every request into pieces of about this many pages (pieces are
            evened out within a request and rounded up to 16-token multiples; the split of a request
            does not depend on the rest of the batch).
          disable_split_kv: one CTA per (request, kv head), no split-KV.
            With ``q_len_per_req > 1`` neither changes the schedule (still checked; they still keep the CuTe
            DSL kernel over cuDNN): the multi-row path, the prefill kernel, never splits the KV, so its
            results are batch-invariant anyway.
          q_len_per_req: query rows per request (speculative/MTP verify); > 1 needs
            ``use_tensor_cores=True`` (``ValueError`` otherwise, as FlashInfer), is bottom-right causal,
            requires every kv_len >= q_len_per_req (``ValueError``) and runs the prefill kernel.
          is_causal: None or True; False with q_len_per_req > 1 raises ``NotImplementedError`` (for
            one row per request causal changes nothing).

        Raises:
          TypeError, ValueError: malformed arguments (each message names the argument), ``sm_scale`` not finite
            in float32, a workspace off CUDA (before any compile; allowed when cross-compiling without a GPU).
          NotImplementedError: mixed dtypes other than an e4m3 cache, head_dim, group > 16, window_right != 0,
            soft cap together with ALIBI (q_len_per_req > 1 runs the prefill kernel, which serves
            ROPE_LLAMA and ALIBI too); with backend="cudnn" (unless fixed_split_size / disable_split_kv
            keep the CuTe DSL kernel): RoPE, ALiBi, a soft cap, an fp8 cache, a request with no KV, or no
            cudnn-frontend.
        """
        if args:
            if len(args) > len(_PLAN_POSITIONAL):
                raise TypeError(f"plan() takes at most {7 + len(_PLAN_POSITIONAL)} positional arguments")
            warnings.warn(
                "Passing plan() options after page_size positionally is deprecated (as in FlashInfer); use keywords",
                DeprecationWarning, stacklevel=2,
            )
            loc = locals()
            vals = {n: loc[n] for n in _PLAN_POSITIONAL}
            vals.update(dict(zip(_PLAN_POSITIONAL, args)))
            (pos_encoding_mode, window_left, logits_soft_cap, q_data_type, kv_data_type, o_data_type, data_type,
             sm_scale, rope_scale, rope_theta, non_blocking, block_tables, seq_lens, fixed_split_size,
             disable_split_kv, q_len_per_req) = (vals[n] for n in _PLAN_POSITIONAL)
        check_pos_encoding_mode(pos_encoding_mode)
        check_bool("non_blocking", non_blocking)
        check_bool("disable_split_kv", disable_split_kv)
        check_optional_bool("is_causal", is_causal)
        num_qo_heads = check_int("num_qo_heads", num_qo_heads, 1)
        num_kv_heads = check_int("num_kv_heads", num_kv_heads, 1)
        head_dim = check_int("head_dim", head_dim, 1)
        page_size = check_int("page_size", page_size, 1)
        check_head_dim(head_dim)
        group = check_heads(num_qo_heads, num_kv_heads)
        sm_scale = check_sm_scale(check_float("sm_scale", sm_scale, positive=False), head_dim)  # any sign
        rope_scale = check_float("rope_scale", rope_scale, positive=True)
        rope_theta = check_float("rope_theta", rope_theta, positive=True)
        if fixed_split_size is not None:
            fixed_split_size = check_int("fixed_split_size", fixed_split_size, 1)
        if isinstance(q_len_per_req, bool) or not isinstance(q_len_per_req, int) or q_len_per_req < 1:
            raise ValueError(f"q_len_per_req must be an int >= 1, got {q_len_per_req!r}")
        if q_len_per_req > 1:
            if not self._use_tensor_cores:
                raise ValueError(
                    "q_len_per_req > 1 requires use_tensor_cores=True (as FlashInfer: the CUDA-core decode "
                    "kernel serves one query row per request)"
                )
            if is_causal is False:
                raise NotImplementedError(
                    "is_causal=False with q_len_per_req > 1 is not supported: multi-row decode is bottom-right causal"
                )
        # with one query row per request, bottom-right causal keeps every key: is_causal changes nothing
        if window_right != 0:
            raise NotImplementedError("window_right != 0 is not supported (decode sees no keys to the right)")
        window_left = check_window_left(window_left)
        cap = check_float("logits_soft_cap", logits_soft_cap, positive=False) or 0.0
        if cap < 0:
            raise ValueError(f"logits_soft_cap must be >= 0 (0 or None disables it), got {logits_soft_cap}")
        if cap > 0 and pos_encoding_mode == "ALIBI":
            raise NotImplementedError("logits_soft_cap together with ALIBI is not supported")

        q_dt, kv_dt, o_dt = plan_dtypes(q_data_type, kv_data_type, o_data_type, data_type)

        # --- page table: CSR or dense block table -> (kv_lens, page_offsets, flat indices); as the paged
        # prefill wrapper, block_tables serves the launch when given, and a CSR form given beside it must agree
        use_table = block_tables is not None or (seq_lens is not None and indptr is None)
        if use_table:
            kv_lens, page_offsets, flat = from_block_tables(block_tables, seq_lens, page_size, self.device,
                                                            non_blocking)
            if indptr is not None or last_page_len is not None:
                _, csr_lens = csr_kv_lens(indptr, last_page_len, kv_lens.shape[0], page_size,
                                          names=("indptr", "last_page_len"), batch_name="len(seq_lens)")
                if not torch.equal(csr_lens, kv_lens):
                    raise ValueError(
                        f"seq_lens {kv_lens.tolist()} (with block_tables) disagree with the KV lengths of the CSR "
                        f"page table (indptr/last_page_len: {csr_lens.tolist()}); pass one form, or both "
                        "describing the same batch")
        else:
            _, kv_lens, page_offsets, flat = from_csr(indptr, indices, last_page_len, page_size, self.device,
                                                      non_blocking, names=("indptr", "indices", "last_page_len"))
            _check_lengths_hint("seq_lens", seq_lens, kv_lens, "the CSR page table (indptr/last_page_len)")
            if self._use_cuda_graph and flat.shape[0] > self._indices_buf.shape[0]:
                raise ValueError(
                    f"indices ({flat.shape[0]}) does not fit paged_kv_indices_buffer ({self._indices_buf.shape[0]})"
                )
        B = kv_lens.shape[0]
        if self._use_cuda_graph and B != self._fixed_batch_size:
            raise ValueError(
                f"The batch size should be fixed in cudagraph mode, the runtime batch size {B} "
                f"mismatches the batch size set during initialization {self._fixed_batch_size}"
            )

        # every argument is checked by now; the index tensors may be on the host, the workspace the kernel writes not
        check_devices("BatchDecodeWithPagedKVCacheWrapper.plan", [("float_workspace_buffer", self._workspace)])
        backend = _decode_cudnn.resolve(self, kv_lens, num_kv_heads, head_dim, q_dt, kv_dt, pos_encoding_mode, cap,
                                        window_left, q_len_per_req, fixed_split_size is not None or disable_split_kv,
                                        use_table)
        cudnn_kw = dict(use_table=use_table, flat=flat, page_offsets=page_offsets, kv_lens=kv_lens,
                        page_size=page_size, q_len=q_len_per_req, window_left=window_left, non_blocking=non_blocking,
                        sm_scale=float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim))
        if backend == "cudnn" and self._backend == "cudnn":
            if kv_lens.numel() and int(kv_lens.min()) < q_len_per_req:
                raise ValueError(f"every kv_len must be >= q_len_per_req ({q_len_per_req})")
            self._multirow = None
            self._plan = dict(cudnn=_decode_cudnn.plan(self, explicit=True, **cudnn_kw), B=B, q_len=q_len_per_req,
                              num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              page_size=page_size, dtype=q_dt, kv_dtype=kv_dt, window_left=window_left)
            return
        if q_len_per_req > 1:
            if kv_lens.numel() and int(kv_lens.min()) < q_len_per_req:
                b = int((kv_lens < q_len_per_req).nonzero()[0])
                raise ValueError(
                    f"every kv_len must be >= q_len_per_req ({q_len_per_req}); request {b} has {int(kv_lens[b])}"
                )
            if self._use_cuda_graph:
                self._freeze_signature(decode_graph_signature(None, num_qo_heads, num_kv_heads, head_dim, page_size,
                                                              q_dt, pos_encoding_mode, cap, q_len_per_req, use_table))
            self._plan_multirow(
                B, q_len_per_req, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                block_tables, seq_lens, causal=True, pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale,
                window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale,
                rope_theta=rope_theta, q_data_type=q_dt, kv_data_type=kv_dt, o_data_type=o_dt,
                non_blocking=non_blocking)
            return
        self._multirow = None

        problem = dispatch.decode_problem(dtype=q_dt, head_dim=head_dim, page_size=page_size, group_size=group,
                                          pos_encoding_mode=pos_encoding_mode, use_soft_cap=cap > 0,
                                          kv_dtype="" if kv_dt == q_dt else kv_dt)
        choice, wp = dispatch.decode_schedule(
            problem, kv_lens, page_offsets, num_kv_heads=num_kv_heads, window_left=window_left,
            fixed_split_tokens=fixed_split_size * page_size if fixed_split_size else None,
            disable_split_kv=disable_split_kv, cuda_graph=self._use_cuda_graph,
            device_index=self.device.index if self.device.type == "cuda" else None)
        if self._use_cuda_graph:
            # a captured graph keeps the kernel, its grid size and the buffers of its capture
            self._freeze_signature(decode_graph_signature(choice, num_qo_heads, num_kv_heads, head_dim, page_size,
                                                          q_dt, pos_encoding_mode, cap, q_len_per_req, use_table))
        table_buf = self._bufs.get("block_tables")
        if self._use_cuda_graph and use_table and table_buf is not None and flat.numel() > table_buf.numel():
            raise ValueError("block_tables grew beyond the first plan's size (not allowed in CUDA-graph mode)")
        n_rows = wp.work.shape[0]
        n_part = n_rows if self._use_cuda_graph else max(1, wp.num_partials)
        n_cnt = max(1, B * num_kv_heads)
        if self._use_cuda_graph and self._counters is not None and self._counters.numel() < n_cnt:
            raise ValueError("the split-KV counter buffer cannot grow in CUDA-graph mode")
        need = n_part * num_qo_heads * (head_dim + 1) * 4 + 256
        if need > self._workspace.numel():
            raise ValueError(
                f"float_workspace_buffer holds {self._workspace.numel()} bytes, the plan needs {need}"
            )

        # --- device buffers (fixed addresses in CUDA-graph mode); every check is done by now
        flat, work_dev, part_o, part_lse, slopes = self._plan_buffers(
            flat, wp, use_table, indptr, last_page_len, B, n_part, n_cnt, num_qo_heads, head_dim, pos_encoding_mode,
            non_blocking)
        self._plan = dict(
            B=B, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
            group=group, dtype=q_dt, kv_dtype=kv_dt, pos_encoding_mode=pos_encoding_mode, window_left=window_left, soft_cap=cap,
            sm_scale=float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim),
            rope_rcp_scale=1.0 / float(rope_scale if rope_scale is not None else 1.0),
            rope_log2_theta=math.log2(float(rope_theta if rope_theta is not None else 1e4)),
            indices=flat, work=work_dev, part_o=part_o, part_lse=part_lse, slopes=slopes, dummy=self._dummy,
            lse_scratch=self._lse_scratch,
            choice=choice, cfg=choice.cfg, kv_lens=wp.kv_lens, num_work=wp.num_work, split_tokens=wp.split_tokens,
        )
        if backend == "cudnn":  # "auto" chose cuDNN; the CuTe DSL plan above serves what it hands back
            self._plan["cudnn"] = _decode_cudnn.plan(self, explicit=False, **cudnn_kw)

    begin_forward = plan

    def _plan_buffers(self, flat, wp, use_table, indptr, last_page_len, B, n_part, n_cnt, num_qo_heads, head_dim,
                      pos_encoding_mode, non_blocking):
        """The plan's device buffers: ``(indices, work, part_o, part_lse, alibi_slopes)``; in CUDA-graph mode the
        wrapper's of fixed address (the caller's page-table buffers, the work table, counters, slopes)."""
        if self._use_cuda_graph:
            if use_table:
                flat = self._bufs.copy("block_tables", flat, non_blocking=non_blocking)
            else:
                self._indices_buf[: flat.shape[0]].copy_(flat, non_blocking=non_blocking)
                self._indptr_buf.copy_(indptr, non_blocking=non_blocking)
                self._last_page_len_buf.copy_(last_page_len, non_blocking=non_blocking)
                flat = self._indices_buf
        work_dev = self._bufs.copy("work", wp.work, non_blocking=non_blocking)
        if self._counters is None or self._counters.numel() < n_cnt:
            self._counters = torch.zeros(n_cnt, dtype=torch.int32, device=self.device)
        ws = self._workspace
        po_bytes = n_part * num_qo_heads * head_dim * 4
        part_o = ws[:po_bytes].view(torch.float32).view(n_part, num_qo_heads, head_dim)
        off = (po_bytes + 255) // 256 * 256
        part_lse = ws[off: off + n_part * num_qo_heads * 4].view(torch.float32).view(n_part, num_qo_heads)

        # wrapper-owned, allocated once per shape so captured graphs keep valid addresses
        if self._dummy is None:
            self._dummy = torch.zeros(1, dtype=torch.float32, device=self.device)
        dummy = self._dummy
        if pos_encoding_mode == "ALIBI":
            if self._slopes is None or self._slopes.numel() != num_qo_heads:
                self._slopes = torch.empty(num_qo_heads, dtype=torch.float32, device=self.device)
            self._slopes.copy_(pinned_if_capturing(get_alibi_slopes(num_qo_heads)), non_blocking=non_blocking)
            slopes = self._slopes
        else:
            slopes = dummy
        if self._lse_scratch is None or self._lse_scratch.shape != (B, num_qo_heads):
            self._lse_scratch = torch.empty((B, num_qo_heads), dtype=torch.float32, device=self.device)
        return flat, work_dev, part_o, part_lse, slopes

    def _freeze_signature(self, sig: dict) -> None:
        if self._graph_sig is None:
            self._graph_sig = sig
        elif sig != self._graph_sig:
            raise ValueError(
                "in CUDA-graph mode num_qo_heads, num_kv_heads, head_dim, page_size, dtypes, pos_encoding_mode, "
                "whether a soft cap is used, q_len_per_req and the page-table form (CSR or block_tables) "
                f"cannot change between plans: first plan {self._graph_sig}, now {sig}"
            )

    def _plan_multirow(self, B, q_len, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                       page_size, block_tables, seq_lens, **plan_kw):
        """q_len_per_req > 1 (speculative / MTP verify): the prefill kernel with the query heads of a kv head
        packed into MMA rows, bottom-right causal, as FlashInfer's tensor-core decode does; an fp8 e4m3 cache
        (``plan_kw["kv_data_type"]``) on the portable prefill kernel through :class:`MultiRowDecodePrefillWrapper`,
        whose ``run()`` takes the same ``q_scale`` / ``k_scale`` / ``v_scale`` algebra as this wrapper's."""
        qo_indptr = torch.arange(B + 1, dtype=torch.int32) * q_len
        if self._multirow is None:
            gbuf = {}
            if self._use_cuda_graph:
                gbuf = dict(qo_indptr_buf=torch.empty(B + 1, dtype=torch.int32, device=self.device),
                            paged_kv_indptr_buf=self._indptr_buf, paged_kv_indices_buf=self._indices_buf,
                            paged_kv_last_page_len_buf=self._last_page_len_buf)
            self._multirow = MultiRowDecodePrefillWrapper(self._workspace, self._kv_layout, backend="cute",
                                                          use_cuda_graph=self._use_cuda_graph, **gbuf)
            self._multirow._launch_entry = self._launch_entry  # a host launch names the entry point called
        self._multirow.plan(to_device(qo_indptr, self.device, True), indptr, indices, last_page_len, num_qo_heads,
                            num_kv_heads, head_dim, page_size, block_tables=block_tables, seq_lens=seq_lens,
                            **plan_kw)
        self._plan = dict(multirow=True, B=B, q_len=q_len, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, window_left=plan_kw["window_left"])

    def _split_cache(self, paged_kv_cache):
        """(k, v) NHD-ordered views of the cache, validated against the plan."""
        p = self._plan
        return paged_kv_views(paged_kv_cache, self._kv_layout, page_size=p["page_size"],
                              num_kv_heads=p["num_kv_heads"], head_dims=(p["head_dim"], p["head_dim"]),
                              dtype=p.get("kv_dtype", p["dtype"]), device=self.device)

    # ------------------------------------------------------------------ run
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
        enable_pdl: bool | None = None,
        window_left: int | None = None,
        sinks: torch.Tensor | None = None,
        q_len_per_req: int | None = None,
        skip_softmax_threshold_scale_factor: float | None = None,
        kv_cache_sf=None,
    ):
        """Decode attention for the planned batch.

        Args:
          q: ``[B * q_len_per_req, num_qo_heads, head_dim]`` in the planned dtype, last dim contiguous
            (rows of one request consecutive).
          paged_kv_cache: ``(k_cache, v_cache)`` 4-D tensors or one 5-D tensor ``[pages, 2, ...]``
            in the wrapper's ``kv_layout``; any strides with a contiguous last dim.
          q_scale, k_scale: multiply ``sm_scale``; v_scale: multiplies the output (in the kernel's fp32
            epilogue, before the rounding to q's dtype).  Floats.
          out: optional output in q's dtype (contiguous): ``[B, Hq, D]``, ``[B * q_len_per_req, Hq, D]`` (rows
            of one request consecutive, as q) for a plan with ``q_len_per_req > 1``.
          lse: optional float32 (contiguous) base-2 log-sum-exp: ``[B, Hq]``, ``[B * q_len_per_req, Hq]`` with
            ``q_len_per_req > 1``.
          return_lse: also return the LSE.
          window_left: if given it must equal the planned value.
          sinks: optional float32 ``[num_qo_heads]`` per-head sink logits (natural log,
            not scaled by sm_scale), included in the softmax denominator and the LSE.
          q_len_per_req: deprecated at run() (as FlashInfer); if given it must equal the planned value.
          enable_pdl, skip_softmax_threshold_scale_factor, kv_cache_sf: not supported
            (``NotImplementedError`` unless None/False).
          On cuDNN (``backend="cudnn"``): ``v_scale`` other than 1 raises ``NotImplementedError`` (its graph has
          no output scale), as does a sink at one row per request where the loaded cuDNN declines it; a call whose
          graph is not built yet cannot be captured (``RuntimeError``: run it once eagerly first).

        Returns:
          ``out`` ``[B, Hq, D]`` (``[B * q_len_per_req, Hq, D]``), or ``(out, lse)`` when ``return_lse``, ``lse``
          ``[B, Hq]`` (``[B * q_len_per_req, Hq]``).

        Raises:
          RuntimeError: run before plan.  ValueError/TypeError: shape, dtype, device or layout
          mismatch with the plan; a workspace or tensors off CUDA (host tensors are planned, not launched, only
          when cross-compiling without a GPU).  NotImplementedError: unsupported options above.
        """
        p = self._plan
        if p is None:
            raise RuntimeError("plan() must be called before run()")
        if args:
            raise TypeError("run() takes no extra positional arguments (custom-kernel args are not supported)")
        devices = self._run_devices(q, paged_kv_cache, out, lse, sinks)
        check_bool("return_lse", return_lse)
        if check_optional_bool("enable_pdl", enable_pdl):
            raise NotImplementedError("enable_pdl=True is not supported (no programmatic dependent launch yet)")
        if skip_softmax_threshold_scale_factor is not None:
            raise NotImplementedError("skip_softmax_threshold_scale_factor is not supported")
        if kv_cache_sf is not None:
            raise NotImplementedError("kv_cache_sf (NVFP4 KV) is not supported")
        if q_len_per_req is not None and q_len_per_req != p.get("q_len", 1):
            raise ValueError(f"q_len_per_req={q_len_per_req} does not match the planned value {p.get('q_len', 1)}")
        if window_left is not None and window_left != p["window_left"]:
            raise ValueError(f"window_left={window_left} at run() differs from plan() ({p['window_left']})")
        if p.get("cudnn") is not None:
            shape = (p["B"] * p.get("q_len", 1), p["num_qo_heads"], p["head_dim"])
            check_tensor("q", q, shape=shape, dtype=p["dtype"], device=self.device)
            check_devices("BatchDecodeWithPagedKVCacheWrapper.run", devices)
            r = _decode_cudnn.run(self, p["cudnn"], q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale,
                                  v_scale=v_scale, out=out, lse=lse, return_lse=return_lse, sinks=sinks)
            if r is not _decode_cudnn.DECLINED:
                return r
        if p.get("multirow"):
            shape = (p["B"] * p["q_len"], p["num_qo_heads"], p["head_dim"])
            if not isinstance(q, torch.Tensor) or q.shape != shape:
                check_tensor("q", q, shape=shape)
            check_devices("BatchDecodeWithPagedKVCacheWrapper.run", devices)
            return self._multirow.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out,
                                      lse=lse, return_lse=return_lse, sinks=sinks)
        B, Hq, D, dt = p["B"], p["num_qo_heads"], p["head_dim"], p["dtype"]
        # Cheap checks here; alignment and unit last-dim strides are checked by the
        # compiled kernel's tvm-ffi entry before the launch (ValueError, translated below).
        if not isinstance(q, torch.Tensor) or q.shape != (B, Hq, D):
            check_tensor("q", q, shape=(B, Hq, D))
        if q.dtype != dt:
            raise ValueError(f"The dtype of q ({q.dtype}) does not match the q_data_type specified in plan ({dt})")
        if q.device != self.device:
            raise ValueError(f"q is on {q.device}, the wrapper on {self.device}")
        k, v = self._split_cache(paged_kv_cache)
        if out is None:
            out = torch.empty((B, Hq, D), dtype=dt, device=self.device)
        else:
            check_tensor("out", out, shape=(B, Hq, D), dtype=dt, device=self.device)
        if lse is None:
            lse = torch.empty((B, Hq), dtype=torch.float32, device=self.device) if return_lse else p["lse_scratch"]
        else:
            check_tensor("lse", lse, shape=(B, Hq), dtype=torch.float32, device=self.device)
        if sinks is not None:
            check_tensor("sinks", sinks, shape=(Hq,), device=self.device)
            if sinks.dtype != torch.float32:
                raise ValueError(f"sinks must be float32, got {sinks.dtype}")
        sm_scale = p["sm_scale"]
        output_scale = 1.0  # v_scale, applied in the kernel's fp32 epilogue
        if q_scale is not None or k_scale is not None or v_scale is not None:
            sm_scale *= run_scale("q_scale", q_scale) * run_scale("k_scale", k_scale)
            output_scale = run_scale("v_scale", v_scale)
        check_devices("BatchDecodeWithPagedKVCacheWrapper.run", devices)
        if B == 0:  # an empty batch: nothing to launch (a zero-size grid is not launchable)
            return (out, lse) if return_lse else out
        if self.device.index is not None and self.device.index != torch.cuda.current_device():
            with torch.cuda.device(self.device):
                return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out,
                                lse=lse, return_lse=return_lse, window_left=window_left, sinks=sinks)
        choice = p["choice"] if sinks is None else p["choice"].with_sinks()
        args = DecodeArgs(q, k, v, p["indices"], p["work"], out, lse, p["part_o"], p["part_lse"], self._counters,
                          p["dummy"] if sinks is None else sinks, p["slopes"], sm_scale, p["soft_cap"],
                          p["rope_rcp_scale"], p["rope_log2_theta"], output_scale)
        try:
            choice.launch(args)
        except Exception as e:
            # host tensors reach a launch only when cross-compiling without a GPU: the entry or the launch refuses
            # them, by device (a layout complaint of the entry keeps its own message)
            entry = isinstance(e, dispatch.KernelEntryError)
            if q.device.type != "cuda" and (not isinstance(e, (ValueError, NotImplementedError))
                                            or entry and "device_type" in str(e)):
                raise host_launch_error(self._launch_entry, q.device) from None
            if entry:  # the compiled entry's layout checks, in FlashInfer's names
                raise e.named(_ARG_NAMES) from None
            raise
        return (out, lse) if return_lse else out

    def _run_devices(self, q, paged_kv_cache, out, lse, sinks) -> list:
        """run()'s ``(name, tensor)`` pairs, checked on one device now and by ``check_devices`` once the shapes
        and dtypes are; only with a host workspace (none: a CUDA one is checked against each tensor)."""
        if self.device.type == "cuda":
            return []
        cache = paged_kv_cache if isinstance(paged_kv_cache, torch.Tensor) else None
        pairs = [("float_workspace_buffer", self._workspace), ("q", q), ("paged_kv_cache", cache), ("out", out),
                 ("lse", lse), ("sinks", sinks)]
        check_one_device("BatchDecodeWithPagedKVCacheWrapper.run", pairs)
        return pairs

    run_return_lse = return_lse_method("[batch_size, num_qo_heads]")
    forward = run
    forward_return_lse = run_return_lse

    def end_forward(self) -> None:
        """No-op (FlashInfer compatibility)."""


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    """:class:`BatchDecodeWithPagedKVCacheWrapper` with ``use_cuda_graph=True`` (FlashInfer's signature).

    ``plan()`` is host work and cannot be captured; ``run()`` can, and a captured
    graph stays valid across re-plans of the same batch size (new lengths, new
    pages): the work table, split counters and partial buffers keep their addresses.

    Args:
      workspace_buffer, kv_layout, use_tensor_cores: as :class:`BatchDecodeWithPagedKVCacheWrapper`.
      indptr_buffer: int32 CUDA ``[B+1]``; indices_buffer: int32 CUDA ``[max_pages]``;
      last_page_len_buffer: int32 CUDA ``[B]`` -- the fixed batch size ``B`` and page capacity of every
      later ``plan()``, which copies the CSR page table into them.

    Raises:
      TypeError / ValueError: as the base class for bad or missing buffers (e.g. ``len(indptr_buffer) !=
      len(last_page_len_buffer) + 1``).
    """

    def __init__(
        self,
        workspace_buffer: torch.Tensor,
        indptr_buffer: torch.Tensor,
        indices_buffer: torch.Tensor,
        last_page_len_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_tensor_cores: bool = False,
    ) -> None:
        super().__init__(
            workspace_buffer, kv_layout, use_cuda_graph=True, use_tensor_cores=use_tensor_cores,
            paged_kv_indptr_buffer=indptr_buffer, paged_kv_indices_buffer=indices_buffer,
            paged_kv_last_page_len_buffer=last_page_len_buffer,
        )


from .single_decode import single_decode_with_kv_cache  # noqa: E402,F401  (FlashInfer's module)
