"""Run one decode configuration a few times (for ncu / compute-sanitizer), e.g.

    ncu --clock-control none -k regex:kernel -s 2 -c 1 --section WarpStateStats python perf/probe_decode.py 1 8192 16
    python perf/probe_decode.py 64 4096 16 fp8      # fp8 e4m3 K/V cache, k_scale = v_scale = 1
"""

import sys

import torch

import cutedsl_attn as ca

B, L, PS = (int(x) for x in sys.argv[1:4])
KV_FP8 = len(sys.argv) > 4 and sys.argv[4] == "fp8"
HQ, HKV, D = 32, 8, 128
dev = torch.device("cuda")
npg = -(-L // PS)
cache = torch.randn((B * npg, 2, PS, HKV, D), dtype=torch.bfloat16, device=dev)
q = torch.randn((B, HQ, D), dtype=torch.bfloat16, device=dev)
indptr = torch.arange(B + 1, dtype=torch.int32, device=dev) * npg
indices = torch.randperm(B * npg, device=dev).to(torch.int32)
last = torch.full((B,), L - (npg - 1) * PS, dtype=torch.int32, device=dev)
w = ca.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=dev), "NHD")
if KV_FP8:
    cache = cache.to(torch.float8_e4m3fn)
w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=torch.bfloat16,
       kv_data_type=cache.dtype)
for _ in range(3):
    o = w.run(q, cache)
torch.cuda.synchronize()
print("ok", o.float().norm().item())
