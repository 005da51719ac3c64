"""GDN prep kernels alone: the shared SM80-class prep (``common.gdn_prep``, launched through the SM90 chunked
module's prep-only entry) against the SM90 wgmma prep (``sm90.gdn_prep``), on rows (a), (b), (c), (e) of
``perf/bench_gdn.py`` (bf16 q/k/v, K = V = 128, fp32 linear gates and beta, l2norm in kernel).

Method (cutedsl_attn.timing.KernelTimer): the L2 flushed before every timed call, CUDA events, median of
``--reps``; then ``--rounds`` interleaved rounds of both (order reversed every other round) and the paired ratio
of their round medians (> 1: the SM90 prep is faster).  Each launch writes the scratch only (the chunk plan and
the allocation are outside the timed call).  The memory floor is the prep's bytes (q / k / v rows once a head,
the gates, W / U / Aqk / F written) at the measured read bandwidth.  Also the scratches' relative differences
(W, U, Aqk) and the largest F difference.

Usage: python perf/bench_gdn_prep.py [--rows a,b,c,e] [--reps 20] [--rounds 7] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gdn import PREFILL, prefill_inputs  # noqa: E402  (the rows of the GDN benchmark)

from cutedsl_attn.api import gdn as api  # noqa: E402
from cutedsl_attn.planning import gdn as pg  # noqa: E402
from cutedsl_attn.sm90 import gdn_chunked as chk90  # noqa: E402
from cutedsl_attn.sm90 import gdn_prep as p90  # noqa: E402
from cutedsl_attn.timing import KernelTimer, paired_ratio, read_bandwidth  # noqa: E402

C = pg.CHUNK


def rel(x, y):
    x, y = x.double(), y.double()
    return ((x - y).norm() / max(y.norm().item(), 1e-30)).item()


def prep_bytes(args, n_chunks: int, K: int, V: int) -> int:
    """Bytes the prep must move: q / k / v rows once per input head, g and beta, W / U / Aqk / F of the real
    chunks."""
    T, hq, hk, hv, ho = args.q.shape[0], args.q.shape[1], args.k.shape[1], args.v.shape[1], args.output.shape[1]
    reads = T * ((hq + hk) * K + hv * V) * 2 + T * ho * 8
    writes = n_chunks * ho * (C * (K + V + C) * 2 + 3 * C * 4)
    return reads + writes


def bench_row(timer, name, bw, reps, rounds):
    B, L, hqk, hv = PREFILL[name]
    q, k, v, g, beta, cu = prefill_inputs(B, L, hqk, hv)
    problem, args, _ = api._plan_prefill(q, k, v, g, beta, None, None, True, cu, True, None, None, None, None, 0,
                                         False, None, None, "auto", None, "linear")
    K, V = problem.head_dim_k, problem.head_dim_v
    cfg = chk90.Config(problem, chk90.default_tiles(problem, num_sms=132))
    fn_old = chk90.compile_prep(cfg)
    fn_new = p90.compile(problem)
    s_old = pg.chunked_launch_tensors(args, K, V)
    s_new = pg.chunked_launch_tensors(args, K, V)
    for s in (s_old, s_new):
        for x in s[2:]:
            x.fill_(float("nan"))

    def old():
        chk90.launch_prep(fn_old, cfg, args, s_old)

    def new():
        p90.launch(fn_new, args, s_new)

    old()
    new()
    torch.cuda.synchronize()
    real = s_new[0][:, 2] > 0
    n_chunks = int(real.sum().item())
    row = dict(row=name, B=B, L=L, T=q.shape[0], heads=f"{hqk}/{hv}", chunks=n_chunks)
    for nm, i in (("W", 2), ("U", 3), ("Aqk", 4)):
        row[f"rel_{nm}"] = rel(s_new[i][real], s_old[i][real])
    row["max_abs_F"] = (s_new[5][real] - s_old[5][real]).abs().max().item()
    row["old_ms"] = timer(old, reps=reps) * 1e3
    row["new_ms"] = timer(new, reps=reps) * 1e3
    times = timer.interleaved({"old": old, "new": new}, rounds=rounds, calls=3)
    med = {kk: [sorted(r)[len(r) // 2] for r in vv] for kk, vv in times.items()}
    row["old_over_new_paired"] = paired_ratio(med["old"], med["new"])
    row["floor_ms"] = prep_bytes(args, n_chunks, K, V) / bw * 1e3
    row["new_floor_share"] = row["floor_ms"] / row["new_ms"]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="a,b,c,e", help="rows of perf/bench_gdn.py, comma-separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None, help="directory for bench_gdn_prep.json")
    a = ap.parse_args()
    rows = [r for r in a.rows.split(",") if r]
    for r in rows:
        if r not in PREFILL or r == "d":
            raise SystemExit(f"--rows: unknown or unsupported row {r!r} (a, b, c, e)")
    timer = KernelTimer()
    bw = read_bandwidth(timer)
    print(f"read bandwidth {bw / 1e12:.2f} TB/s")
    out = []
    print("| row | heads | chunks | old prep ms | SM90 prep ms | old / SM90 (paired) | floor ms | floor / SM90 "
          "| rel W / U / Aqk | max abs F |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        x = bench_row(timer, r, bw, a.reps, a.rounds)
        out.append(x)
        print(f"| ({r}) | {x['heads']} | {x['chunks']} | {x['old_ms']:.3f} | {x['new_ms']:.3f} | "
              f"{x['old_over_new_paired']:.2f}x | {x['floor_ms']:.3f} | {100 * x['new_floor_share']:.0f}% | "
              f"{x['rel_W']:.1e} / {x['rel_U']:.1e} / {x['rel_Aqk']:.1e} | {x['max_abs_F']:.1e} |", flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "bench_gdn_prep.json"), "w") as f:
            json.dump(dict(read_bandwidth=bw, rows=out), f, indent=1)


if __name__ == "__main__":
    main()
