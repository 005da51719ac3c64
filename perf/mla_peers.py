"""FlashInfer MLA peers for the MLA benchmark: FlashInfer's ``BatchMLAPagedAttentionWrapper`` with
``backend="fa3"`` (SM90 wgmma kernel) or ``backend="fa2"`` (SM80-class kernel), planned on the same tensors
``bench_mla.make`` builds (absorbed MLA, split query ``q_nope``/``q_pe`` and split paged caches).

FlashInfer JIT-compiles these modules with nvcc on first use.  Where that is disabled
(``FLASHINFER_DISABLE_JIT=1``, as on a machine without nvcc) the modules must be installed as AOT modules
(``flashinfer/data/aot/<name>/<name>.so``); a missing one makes ``flashinfer_mla`` return ``(None, reason)``
instead of raising, so a benchmark records why the peer is absent and carries on.

Usage::

    run, why = flashinfer_mla("fa3", q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_lens,
                              causal=False, sm_scale=sm_scale)
    if run is not None:
        out = run()           # allocates the output
        run(out=out)          # writes into ``out`` (what a timer should call)
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

__all__ = ["FI_BACKENDS", "flashinfer_mla"]

FI_BACKENDS = ("fa3", "fa2")
_WORKSPACE_BYTES = 128 << 20
_workspaces: Dict[torch.device, torch.Tensor] = {}


def _workspace(device: torch.device) -> torch.Tensor:
    # One FlashInfer float workspace per device, apart from the caller's: its split-KV partials must not
    # overwrite a buffer another wrapper planned into.
    ws = _workspaces.get(device)
    if ws is None:
        ws = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _workspaces[device] = ws
    return ws


def flashinfer_mla(
    backend: str,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_len_arr: torch.Tensor,
    *,
    sm_scale: float,
    causal: bool = False,
    ckv_scale: Optional[float] = None,
    kpe_scale: Optional[float] = None,
    workspace: Optional[torch.Tensor] = None,
) -> Tuple[Optional[Callable[..., torch.Tensor]], str]:
    """Plan FlashInfer's MLA wrapper once and return a callable that runs the planned kernel.

    Args:
        backend: ``"fa3"`` or ``"fa2"``.
        q_nope: ``[tokens, num_heads, 512]`` bf16 (``tokens = qo_indptr[-1]``; qo_len 1 or more per request).
        q_pe: ``[tokens, num_heads, 64]``, q_nope's dtype.
        ckv_cache: ``[pages, page_size, 512]`` bf16, or fp8 e4m3 (then q must be bf16); may be a view of a
            combined ``[pages, page_size, 576]`` cache.
        kpe_cache: ``[pages, page_size, 64]``, ckv_cache's dtype.
        qo_indptr, kv_indptr: int32 ``[B + 1]`` (query rows, page offsets into ``kv_indices``).
        kv_indices: int32 page ids.
        kv_len_arr: int32 ``[B]`` KV lengths in tokens.
        sm_scale: softmax scale, taken as given.
        causal: bottom-right causal mask (matters for qo_len > 1).
        ckv_scale, kpe_scale: per-tensor dequantisation scales of an fp8 cache (default 1.0); must be None
            for a bf16 cache.
        workspace: FlashInfer's float workspace; default a 128 MiB buffer kept per device by this module.

    Returns:
        ``(run, "")`` where ``run(out=None)`` launches the planned kernel and returns ``out``
        (``[tokens, num_heads, 512]``, q's dtype); or ``(None, reason)`` when FlashInfer does not import, the
        backend's module is missing (JIT disabled and no AOT module) or the backend rejects the problem, or
        the first launch fails.

    Raises:
        ValueError: ``backend`` not in ``FI_BACKENDS``, tensors that are not 3-D or disagree in heads / head
            dims / page size, or fp8 scales given for a bf16 cache.
    """
    if backend not in FI_BACKENDS:
        raise ValueError(f"backend must be one of {FI_BACKENDS}, got {backend!r}")
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D, got shape {tuple(t.shape)}")
    tokens, num_heads, head_dim_ckv = q_nope.shape
    head_dim_kpe = q_pe.shape[2]
    pages, page_size, _ = ckv_cache.shape
    if q_pe.shape[:2] != (tokens, num_heads):
        raise ValueError(f"q_pe {tuple(q_pe.shape)} must match q_nope's [tokens, heads] {(tokens, num_heads)}")
    if ckv_cache.shape[2] != head_dim_ckv or tuple(kpe_cache.shape) != (pages, page_size, head_dim_kpe):
        raise ValueError(f"ckv_cache {tuple(ckv_cache.shape)} / kpe_cache {tuple(kpe_cache.shape)} must be "
                         f"[pages, page_size, {head_dim_ckv}] / [pages, page_size, {head_dim_kpe}]")
    kv_fp8 = ckv_cache.dtype == torch.float8_e4m3fn
    if not kv_fp8 and (ckv_scale is not None or kpe_scale is not None):
        raise ValueError("ckv_scale / kpe_scale apply to an fp8 e4m3 cache only")
    scales = dict(ckv_scale=1.0 if ckv_scale is None else ckv_scale,
                  kpe_scale=1.0 if kpe_scale is None else kpe_scale) if kv_fp8 else {}

    try:
        import flashinfer
        import flashinfer.mla  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "peer absent", with its reason
        return None, f"flashinfer unavailable: {type(e).__name__}: {str(e)[:200]}"

    ws = _workspace(q_nope.device) if workspace is None else workspace
    try:
        w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend=backend)
        w.plan(metadata=flashinfer.mla.MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, kv_len_arr),
               num_heads=num_heads, head_dim_ckv=head_dim_ckv, head_dim_kpe=head_dim_kpe, page_size=page_size,
               causal=causal, sm_scale=sm_scale, q_data_type=q_nope.dtype, kv_data_type=ckv_cache.dtype,
               query_layout="split", kv_cache_layout="split",
               scale_mode="kv-per-tensor" if kv_fp8 else "default")

        def run(out: Optional[torch.Tensor] = None) -> torch.Tensor:
            return w.run(query=(q_nope, q_pe), kv_cache=(ckv_cache, kpe_cache), out=out, **scales)

        run()
        torch.cuda.synchronize(q_nope.device)
    except Exception as e:  # noqa: BLE001 - missing AOT module, unsupported shape or launch failure
        return None, f"flashinfer {backend}: {type(e).__name__}: {str(e)[:300]}"
    return run, ""
