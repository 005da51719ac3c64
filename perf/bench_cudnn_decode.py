"""cuDNN paged decode (``cudnn_batch_decode_with_kv_cache``) vs our ``BatchDecodeWithPagedKVCacheWrapper``
(``backend="cute"``, the CuTe DSL decode kernel), same process, same problems.

Method and problems as perf/bench_decode.py (its helpers are imported): 32/8 heads, head_dim 128, bf16, one
NHD pool ``[pages, 2, page_size, Hkv, D]`` with shuffled pages; cuDNN reads the same pool as its
``(pages, Hkv, page_size, D)`` transposed view through the dense block table.  Before every timed call the
L2 is flushed and the GPU sleeps ~1 ms (longer than cuDNN's host path) while the host queues the call (host
launch cost excluded); median of
``--reps``.  With ``--rounds N`` both are also timed interleaved, N rounds of one call each (the order
reversed every other round), and the ratio is the median of the paired per-round ratios.  Host time per
call (no sync) is reported apart.

Usage:  python perf/bench_cudnn_decode.py [--out DIR] [--rounds 20] [--reps 20]
Prints one JSON line per row and a Markdown table last; writes DIR/bench_cudnn_decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import DEV, HKV, D, _long_timer, host_time, make_problem, planned, read_ceiling  # noqa: E402

from cutedsl_attn.timing import paired_ratio  # noqa: E402

SHAPES = [(64, 4096, 16), (128, 8192, 64), (1, 8192, 16)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=20, help="interleaved rounds (0: skip the paired ratio)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    from cutedsl_attn.api.cudnn_decode import cudnn_batch_decode_with_kv_cache
    from cutedsl_attn.cudnn import decode as cd

    print(cd.versions(), "|", torch.cuda.get_device_name())
    gen = torch.Generator().manual_seed(0)
    rd, cp = read_ceiling()
    print(f"read ceiling {rd:.3f} TB/s, copy {cp:.3f} TB/s")
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    ws_cudnn = torch.empty(128 << 20, dtype=torch.uint8, device=DEV)
    scale = D ** -0.5
    rows = []
    for (B, L, ps) in SHAPES:
        q, cache, indptr, indices, last = make_problem(B, L, ps, gen)
        npg = -(-L // ps)
        kv_bytes = 2 * B * L * HKV * D * 2
        row = dict(batch=B, kv_len=L, page=ps)
        w = planned(ws, indptr, indices, last, ps)  # backend="cute": "auto" may take cuDNN on these rows
        out = torch.empty_like(q)
        out_c = torch.empty_like(q)
        k_view, v_view = cache[:, 0].transpose(1, 2), cache[:, 1].transpose(1, 2)  # (pages, Hkv, ps, D), no copy
        table = indices.view(B, npg)
        lens = torch.full((B,), L, dtype=torch.int32, device=DEV)

        def ours():
            w.run(q, cache, out=out)

        def cudnn():
            cudnn_batch_decode_with_kv_cache(q, k_view, v_view, scale, ws_cudnn, max_sequence_kv=L,
                                             actual_seq_lens_kv=lens, block_tables=table, out=out_c)

        try:
            cudnn()
        except Exception as e:  # noqa: BLE001 -- report the row without cuDNN
            print(f"({B}, {L}, {ps}) cuDNN failed: {e!r}"[:400])
            cudnn = None
        ours()
        torch.cuda.synchronize()
        t = _long_timer(ours, reps=args.reps)
        row.update(ours_us=t * 1e6, ours_tbs=kv_bytes / t / 1e12, ours_host_us=host_time(ours) * 1e6)
        if cudnn is not None:
            row["relerr_vs_ours"] = ((out_c.float() - out.float()).norm() / out.float().norm()).item()
            tc = _long_timer(cudnn, reps=args.reps)
            row.update(cudnn_us=tc * 1e6, cudnn_tbs=kv_bytes / tc / 1e12, cudnn_host_us=host_time(cudnn) * 1e6,
                       cudnn_over_ours=tc / t)
            if args.rounds:
                series = {k: [statistics.median(c) for c in v]
                          for k, v in _long_timer.interleaved({"ours": ours, "cudnn": cudnn}, args.rounds).items()}
                row["paired_cudnn_over_ours"] = paired_ratio(series["cudnn"], series["ours"])
                row["paired_ours_us"] = statistics.median(series["ours"]) * 1e6
                row["paired_cudnn_us"] = statistics.median(series["cudnn"]) * 1e6
        row["cudnn_graph_builds"] = cd.graph_cache_info()["builds"]
        rows.append(row)
        print(json.dumps(row))
        del cache
        torch.cuda.empty_cache()
    res = dict(gpu=torch.cuda.get_device_name(), versions=cd.versions(), read_tbs=rd, copy_tbs=cp, rows=rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_cudnn_decode.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nGPU {res['gpu']}; {res['versions']}; read ceiling {rd:.2f} TB/s")
    print("| (B, kv_len, page) | ours us | ours TB/s | cuDNN us | cuDNN TB/s | cuDNN / ours | paired | host us ours / cuDNN |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        def f(k, fmt="{:.1f}"):
            return fmt.format(r[k]) if k in r else "n/a"
        print(f"| ({r['batch']}, {r['kv_len']}, {r['page']}) | {f('ours_us')} | {f('ours_tbs', '{:.2f}')} | "
              f"{f('cudnn_us')} | {f('cudnn_tbs', '{:.2f}')} | {f('cudnn_over_ours', '{:.2f}x')} | "
              f"{f('paired_cudnn_over_ours', '{:.2f}x')} | {f('ours_host_us')} / {f('cudnn_host_us')} |")
    print("(cuDNN / ours = cuDNN time / our time: > 1 means ours is faster)")


if __name__ == "__main__":
    main()
