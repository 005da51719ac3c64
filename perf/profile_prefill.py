"""Run one prefill problem through our kernel and FlashAttention-4 once each (after a warm-up), for ncu.

Usage (on the GPU machine):
  ncu --clock-control none -k regex:"Sm90Prefill|flash|Flash" --section SpeedOfLight --section WarpStateStats \\
      python perf/profile_prefill.py [--hq 32 --hkv 32 --d 128 --len 8192 --batch 2 --causal 1]
A development aid; timings belong to perf/bench_prefill.py.
"""

from __future__ import annotations

import argparse

import torch

import cutedsl_attn as ca


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=32)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--causal", type=int, default=1)
    ap.add_argument("--no-fa4", action="store_true")
    a = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    total = a.len * a.batch
    q = torch.randn(total, a.hq, a.d, dtype=dt, device=dev)
    k = torch.randn(total, a.hkv, a.d, dtype=dt, device=dev)
    v = torch.randn(total, a.hkv, a.d, dtype=dt, device=dev)
    indptr = torch.arange(0, total + 1, a.len, dtype=torch.int32, device=dev)
    w = ca.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=dev))
    w.plan(indptr, indptr, a.hq, a.hkv, a.d, causal=bool(a.causal), q_data_type=dt)
    o = w.run(q, k, v)
    w.run(q, k, v, out=o)
    if not a.no_fa4:
        from flash_attn.cute import flash_attn_varlen_func

        def fa4():
            return flash_attn_varlen_func(q, k, v, cu_seqlens_q=indptr, cu_seqlens_k=indptr, max_seqlen_q=a.len,
                                          max_seqlen_k=a.len, causal=bool(a.causal))
        fa4()
        fa4()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
