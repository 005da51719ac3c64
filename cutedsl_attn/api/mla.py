"""FlashInfer-shaped MLA API: ``BatchMLAPagedAttentionWrapper`` (``flashinfer.mla``).

MLA with weight absorption (DeepSeek V2/V3/R1): ``s = sm_scale * (q_nope . ckv + q_pe . kpe)``,
``o = softmax(s) . ckv``; one latent KV head serves every query head.  LSE is base 2 (natural log with
``return_lse_base_on_e``); causal is bottom-right; empty requests give O = 0 and LSE = -inf; ``sm_scale`` is
taken as given (DeepSeek uses the pre-absorption head dim, ``1 / sqrt(128 + 64)``).

What runs where (:func:`cutedsl_attn.dispatch.mla_choice`, its module docstring has the rules): on SM90 the
SM90 CuTe DSL MLA kernel (TMA + ``wgmma``, query rows packed into 64-row tiles, or on the N dimension for at most
16 packed rows a request) at page size 64 and, from 64 query heads, at the smaller page sizes dividing 64 (16-bit
caches); the portable one (``mma.sync``, 16-row tiles) elsewhere; on SM100/SM103 (cross-compiled only) the
portable one.  The SM90 kernel merges split-KV partials in a second kernel.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..common.constants import LN2 as _LN2
from ..dispatch import mla_choice, mla_launch, mla_limits, mla_problem, num_sms
from ..planning.mla import TILE_M as PLAN_TILE_M
from ..planning.mla import HEAD_DIM_CKV, HEAD_DIM_KPE, MlaArgs, max_work_rows, plan_mla
from ._common import (canonical_dtype, check_bool, check_devices, check_int, check_last_dim_contiguous,
                      check_tensor, indptr_host)
from ._graph import FixedBuffers, check_graph_buffer

_BACKENDS = ("auto", "cute")
_FLASHINFER_BACKENDS = ("fa2", "fa3", "cutlass", "cutile", "trtllm-gen", "xqa", "cute-dsl", "cute-dsl-monolithic",
                        "cute-dsl-modular")
MAX_PAGE_SIZE = 64


def _check_backend(backend) -> str:
    if backend in _BACKENDS:
        return backend
    if backend in _FLASHINFER_BACKENDS:
        raise NotImplementedError(f"backend={backend!r} is not served; MLA backends here: 'auto', 'cute' "
                                  "(the CuTe DSL kernel)")
    raise ValueError(f"backend must be one of {_BACKENDS} (FlashInfer's {_FLASHINFER_BACKENDS} are not served), "
                     f"got {backend!r}")


def _check_dtype(name: str, value) -> torch.dtype:
    dt = canonical_dtype(name, value)
    if dt is None:
        raise TypeError(f"{name} must be given (a torch dtype)")
    if dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        # FlashInfer's documented wrapper takes 16-bit q and caches (its run() has no q / k / v scales)
        raise NotImplementedError(f"{name}={dt} is not supported by BatchMLAPagedAttentionWrapper (16-bit q and "
                                  "caches only, as FlashInfer's documented wrapper); fp8 e4m3 MLA caches are served "
                                  "by trtllm_batch_decode_with_kv_cache_mla (bmm1_scale / bmm2_scale carry the "
                                  "scales) and xqa_mla")
    if dt not in (torch.float16, torch.bfloat16):
        raise NotImplementedError(f"{name}={dt} is not supported; MLA serves torch.bfloat16 and torch.float16 "
                                  "(q and the caches of one dtype)")
    return dt


class BatchMLAPagedAttentionWrapper:
    """Batched MLA over a paged latent cache (FlashInfer's wrapper, same arguments).

    ``plan()`` once per batch (host work: reads the index arrays to the CPU), then ``run()`` per layer (no host
    synchronisation; capturable in a CUDA graph when ``use_cuda_graph=True``).

    Args:
      float_workspace_buffer: a CUDA tensor (any dtype), 16-byte aligned; holds the fp32 split-KV partials
        (128 MiB recommended, as FlashInfer).
      use_cuda_graph: fixed batch size; ``plan()`` writes the page table into the four buffers below, whose
        addresses a captured ``run()`` keeps.
      qo_indptr, kv_indptr, kv_indices, kv_len_arr: int32 CUDA buffers (CUDA-graph mode only): ``[B+1]``,
        ``[B+1]``, ``[max_pages]``, ``[B]``.
      backend: ``"auto"`` or ``"cute"``; FlashInfer's other names raise NotImplementedError.

    Raises:
      TypeError / ValueError: bad workspace or CUDA-graph buffers, unknown backend.
      NotImplementedError: a FlashInfer backend this package does not serve.
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool = False,
                 qo_indptr: torch.Tensor | None = None, kv_indptr: torch.Tensor | None = None,
                 kv_indices: torch.Tensor | None = None, kv_len_arr: torch.Tensor | None = None,
                 backend: str = "auto") -> None:
        self._backend = _check_backend(backend)
        check_bool("use_cuda_graph", use_cuda_graph)
        check_tensor("float_workspace_buffer", float_workspace_buffer)
        if float_workspace_buffer.data_ptr() % 16:
            raise ValueError("float_workspace_buffer must be 16-byte aligned")
        self._workspace = float_workspace_buffer.reshape(-1).view(torch.uint8)
        self.device = float_workspace_buffer.device
        self._use_cuda_graph = bool(use_cuda_graph)
        if self._use_cuda_graph:
            check_graph_buffer("kv_len_arr", kv_len_arr, self.device)
            B = kv_len_arr.shape[0]
            check_graph_buffer("qo_indptr", qo_indptr, self.device, length=B + 1)
            check_graph_buffer("kv_indptr", kv_indptr, self.device, length=B + 1)
            check_graph_buffer("kv_indices", kv_indices, self.device)
            self._fixed_batch_size = B
        else:
            self._fixed_batch_size = None
        self._qo_indptr_buf, self._kv_indptr_buf = qo_indptr, kv_indptr
        self._kv_indices_buf, self._kv_len_arr_buf = kv_indices, kv_len_arr
        self._bufs = FixedBuffers(self.device, fixed=self._use_cuda_graph)
        self._counters = None
        self._graph_sig = None
        self._lse_scratch = None  # the LSE the kernel writes when the caller asks for none
        self._plan = None

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    # ------------------------------------------------------------------ plan
    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             kv_len_arr: torch.Tensor, num_heads: int, head_dim_ckv: int, head_dim_kpe: int, page_size: int,
             causal: bool, sm_scale: float, q_data_type: torch.dtype, kv_data_type: torch.dtype,
             use_profiler: bool = False) -> None:
        """Plan an MLA batch.

        Args:
          qo_indptr: int32 ``[B+1]`` query-row offsets (``[0, 1, ..., B]`` for decode), from 0, non-decreasing.
          kv_indptr: int32 ``[B+1]`` page offsets into ``kv_indices``.
          kv_indices: int32 page ids, ``>= kv_indptr[-1]`` entries, on the wrapper's device.
          kv_len_arr: int32 ``[B]`` KV lengths in tokens; request ``b`` has exactly
            ``ceil(kv_len_arr[b] / page_size)`` pages.
          num_heads: query heads (>= 1).  head_dim_ckv / head_dim_kpe: 512 / 64 (NotImplementedError otherwise).
          page_size: 1..64.  causal: bottom-right causal mask for multi-token rows.
          sm_scale: the softmax scale, taken as given (finite).
          q_data_type, kv_data_type: torch.bfloat16 or torch.float16, equal (fp8 raises NotImplementedError
            naming the trtllm / xqa MLA entry points, which serve fp8 e4m3 caches).
          use_profiler: must be False (NotImplementedError).

        Raises:
          TypeError / ValueError: malformed arguments (the message names the argument and rule).
          NotImplementedError: head dims, dtypes, page sizes or features not served (the message says what is).
        """
        if check_bool("use_profiler", use_profiler):
            raise NotImplementedError("use_profiler=True is not supported (no in-kernel profiler)")
        num_heads = check_int("num_heads", num_heads, 1)
        head_dim_ckv = check_int("head_dim_ckv", head_dim_ckv, 1)
        head_dim_kpe = check_int("head_dim_kpe", head_dim_kpe, 1)
        if (head_dim_ckv, head_dim_kpe) != (HEAD_DIM_CKV, HEAD_DIM_KPE):
            raise NotImplementedError(
                f"head_dim_ckv={head_dim_ckv}, head_dim_kpe={head_dim_kpe} is not supported; MLA serves "
                f"head_dim_ckv={HEAD_DIM_CKV} with head_dim_kpe={HEAD_DIM_KPE} (DeepSeek V2/V3/R1)")
        page_size = check_int("page_size", page_size, 1)
        if page_size > MAX_PAGE_SIZE:
            raise NotImplementedError(f"page_size={page_size} is not supported; MLA serves page sizes "
                                      f"1..{MAX_PAGE_SIZE}")
        check_bool("causal", causal)
        if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real) or not math.isfinite(sm_scale):
            raise ValueError(f"sm_scale must be a finite float, got {sm_scale!r}")
        q_dt = _check_dtype("q_data_type", q_data_type)
        kv_dt = _check_dtype("kv_data_type", kv_data_type)
        if q_dt != kv_dt:
            raise NotImplementedError(f"q_data_type={q_dt} with kv_data_type={kv_dt} is not supported; q and the "
                                      "caches must have one dtype")

        # --- the index arrays, validated on the host
        check_tensor("kv_len_arr", kv_len_arr, ndim=1)
        if kv_len_arr.dtype != torch.int32:
            raise ValueError(f"kv_len_arr must be int32, got {kv_len_arr.dtype}")
        B = kv_len_arr.shape[0]
        qo_h = indptr_host("qo_indptr", qo_indptr, length=B + 1)
        kv_h = indptr_host("kv_indptr", kv_indptr, length=B + 1)
        check_tensor("kv_indices", kv_indices, ndim=1)
        if kv_indices.dtype != torch.int32:
            raise ValueError(f"kv_indices must be int32, got {kv_indices.dtype}")
        if int(kv_h[-1]) > kv_indices.shape[0]:
            raise ValueError(f"kv_indptr[-1] ({int(kv_h[-1])}) exceeds len(kv_indices) ({kv_indices.shape[0]})")
        lens = kv_len_arr.to("cpu", torch.int64)
        npages = kv_h[1:] - kv_h[:-1]
        need = (lens + page_size - 1) // page_size
        bad = (lens < 0) | (need != npages)
        if bad.any():
            b = int(bad.nonzero()[0])
            raise ValueError(f"kv_len_arr[{b}] = {int(lens[b])} disagrees with kv_indptr: request {b} needs "
                             f"ceil(kv_len / page_size) = {int(need[b])} pages of {page_size}, kv_indptr gives it "
                             f"{int(npages[b])}")
        idx_h = kv_indices[: int(kv_h[-1])].to("cpu", torch.int64)
        if idx_h.numel() and int(idx_h.min()) < 0:
            raise ValueError("kv_indices must be >= 0")
        max_page = int(idx_h.max()) if idx_h.numel() else -1
        qo_lens = qo_h[1:] - qo_h[:-1]
        if self._use_cuda_graph:
            if B != self._fixed_batch_size:
                raise ValueError(f"The batch size should be fixed in cudagraph mode, the runtime batch size {B} "
                                 f"mismatches the batch size set during initialization {self._fixed_batch_size}")
            if int(kv_h[-1]) > self._kv_indices_buf.shape[0]:
                raise ValueError(f"kv_indices ({int(kv_h[-1])} pages) does not fit the constructor's kv_indices "
                                 f"buffer ({self._kv_indices_buf.shape[0]})")

        # every argument is checked by now; the index arrays may be on the host, the workspace the kernel writes not
        check_devices("BatchMLAPagedAttentionWrapper.plan", [("float_workspace_buffer", self._workspace)])
        dev_index = self.device.index if self.device.type == "cuda" else None
        problem = mla_problem(dtype=q_dt, page_size=page_size, causal=causal, device_index=dev_index)
        max_q = int(qo_lens.max()) if B else 1
        module, cfg = mla_choice(problem, device_index=dev_index, num_heads=num_heads, max_qo_len=max_q,
                                 cuda_graph=self._use_cuda_graph)
        lim = mla_limits(module, cfg)
        sms = num_sms(dev_index)
        fixed_tiles = None
        num_rows = None
        if self._use_cuda_graph:
            # a captured run() keeps the kernel, its grid, scalars and tensor shapes
            sig = dict(num_heads=num_heads, page_size=page_size, causal=causal, dtype=q_dt, cfg=cfg,
                       sm_scale=float(sm_scale), tokens=int(qo_h[-1]), split=lim["split"])
            if self._graph_sig is None:
                sig["row_tiles"] = -(-max_q * num_heads // 16)
            else:
                changed = [k for k, v in sig.items() if self._graph_sig[k] != v]
                if changed:
                    raise ValueError(f"in CUDA-graph mode a re-plan must keep the first plan's {', '.join(changed)}")
                sig = self._graph_sig
            fixed_tiles = sig["row_tiles"]
            num_rows = max_work_rows(B, fixed_tiles, num_sms=sms, ctas_per_sm=lim["ctas_per_sm"],
                                     tile_m=lim["tile_m"], split=lim["split"])
        wp = plan_mla(qo_lens, lens, qo_h[:-1], kv_h[:-1], num_heads=num_heads, page_size=page_size, num_sms=sms,
                      ctas_per_sm=lim["ctas_per_sm"], tile_m=lim["tile_m"], num_rows=num_rows,
                      max_splits_per_request=lim["max_splits_per_request"], fixed_row_tiles=fixed_tiles,
                      split=lim["split"])
        tile_n = getattr(cfg.tiles, "tile_n", 0) if getattr(cfg.tiles, "swap_ab", 0) else 0
        if tile_n and wp.row_tiles * PLAN_TILE_M > tile_n:  # refused at plan time, not at run()
            raise ValueError(f"CUTEDSL_ATTN_MLA_TUNE's swap_ab=1 holds at most tile_n={tile_n} packed query rows "
                             f"(qo_len x num_heads) a request, the plan has {wp.row_tiles * PLAN_TILE_M}")
        n_part = wp.work.shape[0] if self._use_cuda_graph else max(1, wp.num_partials)
        R = wp.rows
        po_bytes = n_part * R * HEAD_DIM_CKV * 4
        off = (po_bytes + 255) // 256 * 256
        if off + n_part * R * 4 > self._workspace.numel():
            raise ValueError(f"float_workspace_buffer holds {self._workspace.numel()} bytes, the plan needs "
                             f"{off + n_part * R * 4} (split-KV partials: {n_part} pieces x {R} rows x "
                             f"({HEAD_DIM_CKV} + 1) fp32); give a larger buffer")
        n_cnt = max(1, B * wp.row_tiles)

        # --- device buffers (fixed addresses in CUDA-graph mode); every check is done by now
        if self._use_cuda_graph:
            self._graph_sig = sig
        if self._use_cuda_graph:
            self._qo_indptr_buf.copy_(qo_indptr, non_blocking=True)
            self._kv_indptr_buf.copy_(kv_indptr, non_blocking=True)
            self._kv_len_arr_buf.copy_(kv_len_arr, non_blocking=True)
            self._kv_indices_buf[: int(kv_h[-1])].copy_(kv_indices[: int(kv_h[-1])], non_blocking=True)
            indices = self._kv_indices_buf
        else:
            indices = kv_indices if kv_indices.device == self.device else kv_indices.to(self.device)
        work = self._bufs.copy("work", wp.work, non_blocking=True)
        if self._counters is None or self._counters.numel() < n_cnt:
            if self._use_cuda_graph and self._counters is not None:
                raise ValueError("the split-KV counter buffer cannot grow in CUDA-graph mode")
            self._counters = torch.zeros(n_cnt, dtype=torch.int32, device=self.device)
        T = int(qo_h[-1])
        if self._lse_scratch is None or self._lse_scratch.shape != (T, num_heads):
            self._lse_scratch = torch.empty((T, num_heads), dtype=torch.float32, device=self.device)
        ws = self._workspace
        part_o = ws[:po_bytes].view(torch.float32).view(n_part, R, HEAD_DIM_CKV)
        part_lse = ws[off: off + n_part * R * 4].view(torch.float32).view(n_part, R)
        self._plan = dict(B=B, tokens=T, lse_scratch=self._lse_scratch, num_heads=num_heads, page_size=page_size,
                          dtype=q_dt, sm_scale=float(sm_scale), max_page=max_page, module=module, cfg=cfg,
                          indices=indices,
                          work=work, part_o=part_o, part_lse=part_lse, row_tiles=wp.row_tiles,
                          split_tokens=wp.split_tokens, num_work=wp.num_work)

    # ------------------------------------------------------------------ run
    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
            profiler_buffer: torch.Tensor | None = None, kv_len: torch.Tensor | None = None,
            page_table: torch.Tensor | None = None, return_lse_base_on_e: bool = False):
        """MLA for the planned batch.

        Args:
          q_nope: ``[tokens, num_heads, 512]``, q_pe: ``[tokens, num_heads, 64]`` (tokens = ``qo_indptr[-1]``),
            the planned dtype, last dim contiguous, 16-byte aligned strides.
          ckv_cache: ``[num_pages, page_size, 512]``, kpe_cache: ``[num_pages, page_size, 64]`` (same pages and
            page size), the planned dtype, last dim contiguous; every planned page id must be < num_pages.
          out: optional ``[tokens, num_heads, 512]`` output in q's dtype, last dim contiguous.
          lse: optional float32 ``[tokens, num_heads]`` contiguous, written (base 2, natural log with
            ``return_lse_base_on_e``).
          return_lse: also return the LSE (a new tensor unless ``lse`` is given).
          profiler_buffer, kv_len, page_table: not supported (NotImplementedError unless None).

        Returns:
          ``out``, or ``(out, lse)`` when ``return_lse``.

        Raises:
          RuntimeError: run before plan.  TypeError / ValueError: shape, dtype, device, layout or page-id
          mismatch with the plan.  NotImplementedError: the unsupported options above.
        """
        p = self._plan
        if p is None:
            raise RuntimeError("plan() must be called before run()")
        check_bool("return_lse", return_lse)
        check_bool("return_lse_base_on_e", return_lse_base_on_e)
        if profiler_buffer is not None:
            raise NotImplementedError("profiler_buffer is not supported (no in-kernel profiler)")
        if kv_len is not None or page_table is not None:
            raise NotImplementedError("kv_len / page_table (FlashInfer's cutlass backend inputs) are not supported; "
                                      "the page table comes from plan()")
        T, H, dt, dev = p["tokens"], p["num_heads"], p["dtype"], self.device
        for name, t, d in (("q_nope", q_nope, HEAD_DIM_CKV), ("q_pe", q_pe, HEAD_DIM_KPE)):
            check_tensor(name, t, shape=(T, H, d), device=dev)
            if t.dtype != dt:
                raise ValueError(f"The dtype of {name} ({t.dtype}) does not match the q_data_type of plan ({dt})")
            check_last_dim_contiguous(name, t)
        for name, t, d in (("ckv_cache", ckv_cache, HEAD_DIM_CKV), ("kpe_cache", kpe_cache, HEAD_DIM_KPE)):
            check_tensor(name, t, ndim=3, device=dev)
            if t.dtype != dt:
                raise ValueError(f"The dtype of {name} ({t.dtype}) does not match the kv_data_type of plan ({dt})")
            if t.shape[1] != p["page_size"] or t.shape[2] != d:
                raise ValueError(f"{name} must be [num_pages, page_size={p['page_size']}, {d}], got {tuple(t.shape)}")
            check_last_dim_contiguous(name, t)
        if kpe_cache.shape[0] != ckv_cache.shape[0]:
            raise ValueError(f"ckv_cache ({ckv_cache.shape[0]} pages) and kpe_cache ({kpe_cache.shape[0]} pages) "
                             "must have the same number of pages")
        if p["max_page"] >= ckv_cache.shape[0]:
            raise ValueError(f"kv_indices holds page id {p['max_page']}, outside the cache's "
                             f"{ckv_cache.shape[0]} pages")
        if out is None:
            out = torch.empty((T, H, HEAD_DIM_CKV), dtype=dt, device=dev)
        else:
            check_tensor("out", out, shape=(T, H, HEAD_DIM_CKV), dtype=dt, device=dev)
            check_last_dim_contiguous("out", out)
        visible_lse = return_lse or lse is not None
        if lse is None:
            lse = torch.empty((T, H), dtype=torch.float32, device=dev) if return_lse else p["lse_scratch"]
        else:
            check_tensor("lse", lse, shape=(T, H), dtype=torch.float32, device=dev)
            if not lse.is_contiguous():
                raise ValueError("lse must be contiguous")
        if T and p["num_work"]:  # an empty batch launches nothing (a zero-size grid is not launchable)
            if dev.type != "cuda":
                raise ValueError(f"q_nope, q_pe, the caches and the workspace must be CUDA tensors to launch, "
                                 f"got {dev}")
            args = MlaArgs(q_nope, q_pe, ckv_cache, kpe_cache, p["indices"], p["work"], out, lse, p["part_o"],
                           p["part_lse"], self._counters, p["sm_scale"], p["row_tiles"], output_scale=1.0)
            with torch.cuda.device(dev):
                mla_launch(p["module"], p["cfg"], args)
        if return_lse_base_on_e and visible_lse:
            lse.mul_(_LN2)
        return (out, lse) if return_lse else out

    forward = run
