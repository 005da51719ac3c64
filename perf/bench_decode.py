"""Paged-decode benchmark: cutedsl_attn vs FlashInfer 0.7.2 and FlashAttention-4, same process.

Method (see ../shared/reference/h200_anchors.md): before every timed call the L2 is
flushed (512 MiB memset) and the GPU sleeps ~200 us so the host has queued the
call; CUDA events bracket the call; median of 20.  Bandwidth = K+V bytes / time.
The ceiling is a plain 4 GiB read measured in the same run.

Usage:  python perf/bench_decode.py [--out DIR] [--quick]
Prints a Markdown table (the last thing printed) and writes JSON to DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from cutedsl_attn.timing import KernelTimer, copy_bandwidth, read_bandwidth

SHAPES = [(64, 4096, 16), (64, 4096, 64), (128, 8192, 64), (16, 32768, 64), (1, 8192, 16), (8, 2048, 16)]
HQ, HKV, D = 32, 8, 128
DT = torch.bfloat16
DEV = torch.device("cuda")

_timer = KernelTimer(DEV)  # allocates its L2-flush buffer on first use


def timed(fn, reps=20):
    return _timer(fn, reps=reps)


def read_ceiling():
    return read_bandwidth(_timer) / 1e12, copy_bandwidth(_timer) / 1e12


def make_problem(B, L, ps, gen):
    npg = -(-L // ps)
    total = B * npg
    perm = torch.randperm(total, generator=gen).to(torch.int32)
    cache = torch.randn((total, 2, ps, HKV, D), dtype=DT, device=DEV)
    q = torch.randn((B, HQ, D), dtype=DT, device=DEV)
    indptr = torch.arange(B + 1, dtype=torch.int32) * npg
    last = torch.full((B,), L - (npg - 1) * ps, dtype=torch.int32)
    return q, cache, indptr, perm.to(DEV), last


def host_time(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(ts)


def compile_times():
    """Cold compile and warm disk-cache load of the decode kernel, each in a fresh process."""
    d = tempfile.mkdtemp(prefix="cda_cache_")
    code = (
        "import time,torch;t=time.perf_counter();"
        "from cutedsl_attn import dispatch;"
        f"choice=dispatch.decode_choice(dispatch.decode_problem(dtype=torch.bfloat16, head_dim={D}, page_size=16, "
        f"group_size={HQ // HKV}));"
        "t1=time.perf_counter();choice.fn;print(time.perf_counter()-t1)"  # .fn: compiled, or loaded from disk
    )
    env = dict(os.environ, CUTEDSL_ATTN_CACHE_DIR=d)
    out = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        out.append(float(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else float("nan"))
        if r.returncode:
            print(r.stderr[-2000:], file=sys.stderr)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--variants", default="", help="extra 'warps,stages[,min_waves]' configs of our kernel, e.g. '4,2;8,3,4'")
    args = ap.parse_args()
    import cutedsl_attn as ca

    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001
        flashinfer = None
        print("flashinfer unavailable:", e)
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001
        flash_attn_varlen_func = None
        print("FA4 unavailable:", e)

    gen = torch.Generator().manual_seed(0)
    rd, cp = read_ceiling()
    print(f"read ceiling {rd:.3f} TB/s, copy {cp:.3f} TB/s")
    cold, warm = compile_times()
    rows = []
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    for (B, L, ps) in SHAPES[:2] if args.quick else SHAPES:
        q, cache, indptr, indices, last = make_problem(B, L, ps, gen)
        kv_bytes = 2 * B * L * HKV * D * 2
        row = dict(batch=B, kv_len=L, page=ps)
        w = ca.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(indptr.to(DEV), indices, last.to(DEV), HQ, HKV, D, ps, q_data_type=DT)
        out = torch.empty_like(q)
        t = timed(lambda: w.run(q, cache, out=out))
        row["ours_us"] = t * 1e6
        row["ours_tbs"] = kv_bytes / t / 1e12
        row["ours_host_us"] = host_time(lambda: w.run(q, cache, out=out)) * 1e6
        ref_o = out.clone()
        for var in [v for v in args.variants.split(";") if v]:
            parts = var.split(",")
            os.environ["CUTEDSL_ATTN_DECODE_TUNE"] = ",".join(parts[:2])
            if len(parts) > 2:
                os.environ["CUTEDSL_ATTN_DECODE_MIN_WAVES"] = parts[2]
            wv = ca.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
            wv.plan(indptr.to(DEV), indices, last.to(DEV), HQ, HKV, D, ps, q_data_type=DT)
            os.environ.pop("CUTEDSL_ATTN_DECODE_TUNE")
            os.environ.pop("CUTEDSL_ATTN_DECODE_MIN_WAVES", None)
            ov = wv.run(q, cache)
            row[f"v{var}_relerr"] = ((ov.float() - ref_o.float()).norm() / ref_o.float().norm()).item()
            row[f"v{var}_us"] = timed(lambda: wv.run(q, cache, out=ov)) * 1e6
        if flashinfer is not None:
            for tc in (True, False):
                name = "fi_tc" if tc else "fi_cc"
                try:
                    fw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
                    fw.plan(indptr.to(DEV), indices, last.to(DEV), HQ, HKV, D, ps, q_data_type=DT, kv_data_type=DT)
                    fo = fw.run(q, cache)
                    row[name + "_relerr"] = ((fo.float() - ref_o.float()).norm() / ref_o.float().norm()).item()
                    row[name + "_us"] = timed(lambda: fw.run(q, cache)) * 1e6
                    if tc:
                        row["fi_host_us"] = host_time(lambda: fw.run(q, cache)) * 1e6
                except Exception as e:  # noqa: BLE001
                    print(name, "failed:", repr(e)[:300])
        if flash_attn_varlen_func is not None:
            try:
                npg = -(-L // ps)
                page_table = indices.view(B, npg)
                cu_q = torch.arange(B + 1, dtype=torch.int32, device=DEV)
                seqused = torch.full((B,), L, dtype=torch.int32, device=DEV)
                kc, vc = cache[:, 0], cache[:, 1]

                def fa4():
                    return flash_attn_varlen_func(q, kc, vc, cu_seqlens_q=cu_q, max_seqlen_q=1, seqused_k=seqused,
                                                  page_table=page_table, causal=False)
                fo = fa4()
                fo = fo[0] if isinstance(fo, tuple) else fo
                row["fa4_relerr"] = ((fo.float() - ref_o.float()).norm() / ref_o.float().norm()).item()
                row["fa4_us"] = timed(fa4) * 1e6
            except Exception as e:  # noqa: BLE001
                print("fa4 failed:", repr(e)[:300])
        rows.append(row)
        print(json.dumps(row))
        del cache
        torch.cuda.empty_cache()
    res = dict(gpu=torch.cuda.get_device_name(), read_tbs=rd, copy_tbs=cp, cold_compile_s=cold,
               warm_load_s=warm, rows=rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_decode.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nGPU {res['gpu']}; read ceiling {rd:.2f} TB/s (copy {cp:.2f}); "
          f"decode kernel cold compile {cold:.2f} s, warm disk load {warm * 1e3:.1f} ms")
    print("| (B, kv_len, page) | ours us | ours TB/s | % read ceiling | vs FI tc | vs FI cc | vs FA4 | host us ours / FI |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        def ratio(k):
            return f"{r[k] / r['ours_us']:.2f}x" if k in r else "n/a"
        print(f"| ({r['batch']}, {r['kv_len']}, {r['page']}) | {r['ours_us']:.1f} | {r['ours_tbs']:.2f} | "
              f"{100 * r['ours_tbs'] / rd:.0f}% | {ratio('fi_tc_us')} | {ratio('fi_cc_us')} | {ratio('fa4_us')} | "
              f"{r['ours_host_us']:.1f} / {r.get('fi_host_us', float('nan')):.1f} |")
    print("(ratios are peer time / our time: > 1 means we are faster)")
    if args.variants:
        print("variants (warps,stages): us")
        for r in rows:
            print((r["batch"], r["kv_len"], r["page"]), {k: round(v, 1) for k, v in r.items() if k.startswith("v") and k.endswith("_us")})


if __name__ == "__main__":
    main()
