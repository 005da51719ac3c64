"""Plan-time helpers of ``BatchDecodeWithPagedKVCacheWrapper.plan`` (:mod:`cutedsl_attn.api.decode`): the plan's
dtypes from FlashInfer's dtype arguments, and the CUDA-graph signature a captured ``run()`` depends on."""

from __future__ import annotations

import torch

from .. import dispatch
from ._common import canonical_dtype

__all__ = ["decode_graph_signature", "plan_dtypes"]


def plan_dtypes(q_data_type, kv_data_type, o_data_type, data_type):
    """``(q, kv, o)`` torch dtypes of a decode plan (FlashInfer's defaults: q float16, kv and o q's; the deprecated
    ``data_type`` fills only the unset q / kv).  NotImplementedError for mixed dtypes other than an fp8 e4m3 cache
    under fp16/bf16 q and o."""
    q_dt = canonical_dtype("q_data_type", q_data_type)
    kv_dt = canonical_dtype("kv_data_type", kv_data_type)
    o_dt = canonical_dtype("o_data_type", o_data_type)
    d_dt = canonical_dtype("data_type", data_type)
    if d_dt is not None:
        q_dt = q_dt if q_dt is not None else d_dt
        kv_dt = kv_dt if kv_dt is not None else d_dt
    q_dt = q_dt or torch.float16
    kv_dt = kv_dt or q_dt
    o_dt = o_dt or q_dt
    for n, dt in (("q_data_type", q_dt), ("kv_data_type", kv_dt), ("o_data_type", o_dt)):
        if dt not in (torch.float16, torch.bfloat16) and not (n == "kv_data_type" and dt == torch.float8_e4m3fn):
            raise NotImplementedError(f"{n}={dt} is not supported; supported: torch.float16, torch.bfloat16"
                                      + (" (and torch.float8_e4m3fn for kv_data_type)" if n == "kv_data_type" else ""))
    if not (q_dt == o_dt and kv_dt in (q_dt, torch.float8_e4m3fn)):
        hint = (" (q_data_type defaults to float16 and the deprecated data_type only fills unset dtypes, "
                "as in FlashInfer: pass q_data_type)" if d_dt is not None else "")
        raise NotImplementedError(
            f"mixed dtypes (q={q_dt}, kv={kv_dt}, o={o_dt}) are not supported; q and o must match, and kv must match "
            f"them or be torch.float8_e4m3fn{hint}"
        )
    return q_dt, kv_dt, o_dt


def decode_graph_signature(choice, num_qo_heads, num_kv_heads, head_dim, page_size, dtype, pos_encoding_mode, cap,
                           q_len_per_req, use_table) -> dict:
    """What a captured ``run()`` keeps from its plan (``dispatch.graph_signature``: the kernel and these scalars; a
    CUDA-graph re-plan must give the same); ``choice`` None for the multi-row path (the prefill wrapper's)."""
    return dispatch.graph_signature(
        choice, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
        dtype=dtype, pos_encoding_mode=pos_encoding_mode, soft_cap=cap > 0, q_len_per_req=q_len_per_req,
        page_table="block_tables" if use_table else "csr")
