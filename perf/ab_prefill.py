"""Interleaved A/B timing of prefill variants on one benchmark case (development aid for small differences).

``perf/bench_prefill.py`` times each variant once, one after the other; differences of a few percent
between variants timed minutes apart can be order effects (clocks, power).  Here every variant is timed
``--reps`` calls per round, round-robin for ``--rounds`` rounds in one process (same inputs, L2 flushed
before every call: :class:`cutedsl_attn.timing.KernelTimer`), and the median over all its calls is
reported with the spread of its per-round medians.

Variants (``;``-separated): ``default`` (our kernel as dispatched), a ``CUTEDSL_ATTN_PREFILL_TUNE`` string
such as ``tile_n=128,num_ctas=0``, ``fa4`` (FlashAttention-4 ``flash_attn.cute``), ``fi`` (FlashInfer
0.7.2 ragged, ``backend="fa3"``; head_dim 128 only).

Usage: python perf/ab_prefill.py --case varlen --variants "default;epilogue=smem;fa4;fi" [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from bench_prefill import DEV, case_inputs, case_slug, fa4_call, fi_call, find_case, flops, plan_ours

from cutedsl_attn.timing import KernelTimer, paired_ratio


def build(variant, q, k, v, indptr, lens, hq, hkv, d, causal, ws):
    """A no-argument callable running ``variant`` on the case's tensors."""
    if variant == "fa4":
        return fa4_call(q, k, v, indptr, lens, causal)
    if variant == "fi":
        return fi_call(ws, q, k, v, indptr, hq, hkv, d, causal)
    # "default" means the dispatch defaults (any CUTEDSL_ATTN_PREFILL_TUNE of the process unset for the plan)
    w = plan_ours(torch.empty(256 << 20, dtype=torch.uint8, device=DEV), indptr, hq, hkv, d, causal,
                  {"CUTEDSL_ATTN_PREFILL_TUNE": None if variant == "default" else variant})
    o = w.run(q, k, v)
    return lambda: w.run(q, k, v, out=o)


def main():
    if not torch.cuda.is_available():
        raise SystemExit(f"{os.path.basename(__file__)}: needs a CUDA GPU (timings run on the device)")
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True, help="a word of one perf/bench_prefill.py case name")
    ap.add_argument("--variants", default="default;fa4")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sleep", type=int, default=4_000_000,
                    help="GPU sleep cycles before each timed call (default ~2 ms; 400000 drifted, RESULTS session 5)")
    a = ap.parse_args()
    timer = KernelTimer(DEV, sleep_cycles=a.sleep)
    name, lens, hq, hkv, d, causal = find_case(a.case)
    lens, q, k, v, indptr = case_inputs(lens, hq, hkv, d)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    variants = [x.strip() for x in a.variants.split(";") if x.strip()]
    fns = {}
    for var in variants:
        try:
            fns[var] = build(var, q, k, v, indptr, lens, hq, hkv, d, causal, ws)
            fns[var]()
        except Exception as e:  # noqa: BLE001
            print(f"{var}: unavailable ({repr(e)[:200]})")
    per_call = timer.interleaved(fns, a.rounds, a.reps)  # round-robin, the order reversed every other round
    samples = {var: [t for rnd in per_call[var] for t in rnd] for var in fns}
    rounds = {var: [statistics.median(rnd) for rnd in per_call[var]] for var in fns}
    host = {}
    for var in fns:  # host time per call (enqueue only): must stay well below the sleep before a timed call
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # keep the GPU busy so the queue never blocks the host
        t0 = time.perf_counter()
        for _ in range(10):
            fns[var]()
        host[var] = (time.perf_counter() - t0) / 10
        torch.cuda.synchronize()
    fl = flops(lens, hq, d, d, causal)
    base = statistics.median(samples[variants[0]]) if variants[0] in samples else None
    print(f"\n{name}: {a.rounds} rounds x {a.reps} calls, interleaved ({torch.cuda.get_device_name()})")
    print("| variant | median ms | TFLOP/s | round medians min-max ms | vs first | paired vs first | host us/call |")
    print("|---|---|---|---|---|---|---|")
    res = {}
    for var in fns:
        m = statistics.median(samples[var])
        res[var] = dict(median_ms=m * 1e3, rounds_ms=[x * 1e3 for x in rounds[var]], host_us=host[var] * 1e6)
        rel = f"{m / base:.3f}" if base else "n/a"
        paired = paired_ratio(rounds[var], rounds[variants[0]]) if base else None
        res[var]["paired_vs_first"] = paired
        print(f"| {var} | {m * 1e3:.3f} | {fl / m / 1e12:.0f} | {min(rounds[var]) * 1e3:.3f}-"
              f"{max(rounds[var]) * 1e3:.3f} | {rel} | {'n/a' if paired is None else f'{paired:.3f}'} | "
              f"{host[var] * 1e6:.0f} |")
    print("(vs first: median time / the first variant's; paired: median over rounds of the round-median ratio; "
          "< 1 is faster)")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"ab_{case_slug(a.case)}.json"), "w") as f:
        json.dump(dict(case=name, results=res), f, indent=1)


if __name__ == "__main__":
    main()
