"""fp8 e4m3 K/V decode vs bf16 decode of the same tokens: the paged decode kernel through dispatch, same process.

Method and helpers as perf/bench_decode.py (imported): 32/8 heads, head_dim 128, bf16 q, one NHD pool
``[pages, 2, page_size, Hkv, D]`` with shuffled pages, and the same pool cast to torch.float8_e4m3fn.  Before
every timed call the L2 is flushed and the GPU sleeps while the host queues the call (host launch cost
excluded); median of ``--reps``.  TB/s counts the K/V bytes the kernel must read (1 byte an element for fp8,
2 for bf16); the read ceiling is a plain read measured in the same run.  ``--variants "4,5;8,4"`` also times
fp8 with those (warps, stages) tiles (``CUTEDSL_ATTN_DECODE_TUNE``).

Usage:  python perf/bench_fp8_decode.py [--out DIR] [--reps 20] [--variants "w,s;..."]
Prints one JSON line per row and a Markdown table last; writes DIR/bench_fp8_decode.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import DEV, DT, HKV, HQ, D, make_problem, read_ceiling, timed  # noqa: E402

SHAPES = [(64, 4096, 16), (128, 8192, 64), (1, 8192, 16)]
FP8 = "float8_e4m3fn"


def decode_launcher(q, k, v, indptr, indices, last, page_size, *, kv_dtype=""):
    """A zero-argument launch of the decode kernel (split-KV as dispatch plans it) on the NHD ``k`` / ``v``
    views ``[pages, page_size, Hkv, D]``, and the ``out`` it writes."""
    from cutedsl_attn import dispatch
    from cutedsl_attn.planning.decode import DecodeArgs, kv_lens_from_csr

    B = q.shape[0]
    problem = dataclasses.replace(
        dispatch.decode_problem(dtype=q.dtype, head_dim=D, page_size=page_size, group_size=HQ // HKV),
        kv_dtype=kv_dtype)
    choice, wp = dispatch.decode_schedule(problem, kv_lens_from_csr(indptr, last, page_size), indptr[:-1],
                                          num_kv_heads=HKV)
    n_part = max(1, wp.num_partials)
    out = torch.empty((B, HQ, D), dtype=q.dtype, device=DEV)
    dummy = torch.zeros(1, dtype=torch.float32, device=DEV)
    args = DecodeArgs(q, k, v, indices, wp.work.to(DEV), out, torch.empty((B, HQ), dtype=torch.float32, device=DEV),
                      torch.empty((n_part, HQ, D), dtype=torch.float32, device=DEV),
                      torch.empty((n_part, HQ), dtype=torch.float32, device=DEV),
                      torch.zeros(B * HKV, dtype=torch.int32, device=DEV), dummy, dummy, 1 / math.sqrt(D), 0.0, 1.0,
                      math.log2(1e4), 1.0)
    choice.launch(args)  # compile / load before timing
    torch.cuda.synchronize()
    return (lambda: choice.launch(args)), out, choice, wp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", default="", help="extra fp8 'warps,stages' tiles, e.g. '4,5;8,4'")
    args = ap.parse_args()

    gen = torch.Generator().manual_seed(0)
    rd, cp = read_ceiling()
    print(f"read ceiling {rd:.3f} TB/s, copy {cp:.3f} TB/s")
    rows = []
    for (B, L, ps) in SHAPES:
        q, cache, indptr, indices, last = make_problem(B, L, ps, gen)
        cache8 = cache.to(torch.float8_e4m3fn)
        elems = 2 * B * L * HKV * D
        row = dict(batch=B, kv_len=L, page=ps)
        f16, o16, c16, wp16 = decode_launcher(q, cache[:, 0], cache[:, 1], indptr, indices, last, ps)
        f8, o8, c8, wp8 = decode_launcher(q, cache8[:, 0], cache8[:, 1], indptr, indices, last, ps, kv_dtype=FP8)
        # the same tokens: fp8 against bf16 on the cache widened back (exact), so only P / O rounding differs
        w16, ow, _, _ = decode_launcher(q, cache8[:, 0].to(DT), cache8[:, 1].to(DT), indptr, indices, last, ps)
        w16()
        torch.cuda.synchronize()
        row["fp8_vs_bf16_relerr"] = ((o8.float() - ow.float()).norm() / ow.float().norm()).item()
        t16 = timed(f16, reps=args.reps)
        t8 = timed(f8, reps=args.reps)
        row.update(bf16_us=t16 * 1e6, bf16_tbs=elems * 2 / t16 / 1e12, fp8_us=t8 * 1e6, fp8_tbs=elems / t8 / 1e12,
                   speedup=t16 / t8, bf16_tiles=str(c16.tiles), fp8_tiles=str(c8.tiles),
                   bf16_split=wp16.split_tokens, fp8_split=wp8.split_tokens)
        for var in [x for x in args.variants.split(";") if x]:
            os.environ["CUTEDSL_ATTN_DECODE_TUNE"] = var
            try:
                fv, _, _, _ = decode_launcher(q, cache8[:, 0], cache8[:, 1], indptr, indices, last, ps, kv_dtype=FP8)
            finally:
                os.environ.pop("CUTEDSL_ATTN_DECODE_TUNE")
            row[f"fp8_{var}_us"] = timed(fv, reps=args.reps) * 1e6
        rows.append(row)
        print(json.dumps(row))
        del cache, cache8
        torch.cuda.empty_cache()
    res = dict(gpu=torch.cuda.get_device_name(), read_tbs=rd, copy_tbs=cp, rows=rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_fp8_decode.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nGPU {res['gpu']}; read ceiling {rd:.2f} TB/s (copy {cp:.2f})")
    print("| (B, kv_len, page) | bf16 us | bf16 TB/s | fp8 us | fp8 TB/s | fp8 % read ceiling | bf16 / fp8 time |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| ({r['batch']}, {r['kv_len']}, {r['page']}) | {r['bf16_us']:.1f} | {r['bf16_tbs']:.2f} | "
              f"{r['fp8_us']:.1f} | {r['fp8_tbs']:.2f} | {100 * r['fp8_tbs'] / rd:.0f}% | {r['speedup']:.2f}x |")


if __name__ == "__main__":
    main()
