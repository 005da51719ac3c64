"""Prefill benchmark: cutedsl_attn vs FlashAttention-4, FlashInfer 0.7.2 (ragged fa3) and cuDNN SDPA, same process.

Timing as perf/bench_decode.py (L2 flushed, GPU sleep before each call, CUDA events,
median), with a 2 ms sleep (see ``_timer``).  FLOPs as FlashInfer's benchmarks: full = 2*H*(Dqk+Dvo)*Lq*Lkv per request,
causal = H*(Dqk+Dvo)*Lq*(2*Lkv - Lq).  The ceiling is a bf16 8192^3 torch matmul in
the same run.

``--tune "k=v,...;..."`` also times our kernel under each ``CUTEDSL_ATTN_PREFILL_TUNE`` setting
(tuning experiments, same process); ``--no-portable`` skips the portable kernel's share.  ``--rounds R``
times ours and the peers of a case interleaved instead (:meth:`cutedsl_attn.timing.KernelTimer.interleaved`:
R rounds of one call each, the order reversed every other round) and reports the medians and the paired
ratios (median over rounds of peer / ours; on the H200 every kernel's time on the varlen mix drifted by up
to 10% within a second, so one-after-the-other medians can differ by more than the kernels do:
perf/RESULTS.md, "Prefill: SM90 kernel").

Usage: python perf/bench_prefill.py [--out DIR] [--quick] [--no-portable] [--tune SETTINGS] [--cases WORDS]
                                    [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from cutedsl_attn.timing import KernelTimer, paired_ratio

DEV = torch.device("cuda")
DT = torch.bfloat16
# 2 ms of GPU sleep before each timed call (4M cycles; the reference method's 200 us measured our kernel and FA4
# 5-20% slower and drifting between rounds, perf/RESULTS.md "Prefill: SM90 kernel"); allocates its L2-flush buffer
_timer = KernelTimer(DEV, sleep_cycles=4_000_000)


def timed(fn, reps=10):
    return _timer(fn, reps=reps)


def flops(lens, hq, dqk, dvo, causal):
    tot = 0
    for L in lens:
        tot += hq * (dqk + dvo) * L * (2 * L - L) if causal else 2 * hq * (dqk + dvo) * L * L
    return tot


CASES = [
    # name, lens, hq, hkv, d, causal
    ("B2x8192 h32 d128 causal", [8192] * 2, 32, 32, 128, True),
    ("B2x8192 h32 d128 full", [8192] * 2, 32, 32, 128, False),
    ("B2x8192 h32/8 d128 causal", [8192] * 2, 32, 8, 128, True),
    ("B2x8192 h64 d64 causal", [8192] * 2, 64, 64, 64, True),
    ("B2x8192 h16 d256 causal", [8192] * 2, 16, 16, 256, True),
    ("varlen 64x[128,4096] h32/8 d128 causal", None, 32, 8, 128, True),
]


def find_case(word):
    """The one case of :data:`CASES` whose name contains ``word``; ``SystemExit`` naming them all otherwise
    (the ``--case`` argument of perf/ab_prefill.py and perf/trace_prefill.py)."""
    found = [c for c in CASES if word in c[0]]
    if len(found) != 1:
        raise SystemExit(f"--case {word!r} must name exactly one of {[c[0] for c in CASES]}; matched "
                         f"{[c[0] for c in found]}")
    return found[0]


def case_slug(word):
    """``word`` (a ``--case`` argument) as part of a file name: spaces to ``_``, the ``/`` of ``h32/8`` to ``-``."""
    return word.replace(" ", "_").replace("/", "-")


def case_inputs(lens, hq, hkv, d):
    """``(lens, q, k, v, indptr)`` of a case: ``lens`` as given, or for the varlen mix (``None``) 64 lengths
    in [128, 4096] drawn from seed 0; random bf16 Q/K/V (NHD, ragged) and the shared indptr."""
    if lens is None:
        lens = torch.randint(128, 4097, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    total = sum(lens)
    q = torch.randn(total, hq, d, dtype=DT, device=DEV)
    k = torch.randn(total, hkv, d, dtype=DT, device=DEV)
    v = torch.randn(total, hkv, d, dtype=DT, device=DEV)
    indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    return lens, q, k, v, indptr


def plan_ours(ws, indptr, hq, hkv, d, causal, env=None, **plan_kw):
    """Our ragged wrapper planned on the case, with ``env`` (environment variable -> value, e.g.
    ``{"CUTEDSL_ATTN_PREFILL_TUNE": "tile_n=128"}``; ``None`` / ``""`` unsets one: the dispatch defaults)
    in force for the plan only, the previous values restored after; ``plan_kw`` (e.g. ``score_mod``) go to
    ``plan()``."""
    import cutedsl_attn as ca

    env = env or {}
    saved = {key: os.environ.pop(key, None) for key in env}
    try:
        for key, val in env.items():
            if val:
                os.environ[key] = val
        w = ca.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
        w.plan(indptr, indptr, hq, hkv, d, causal=causal, q_data_type=DT, **plan_kw)
    finally:
        for key, val in saved.items():
            os.environ.pop(key, None)
            if val is not None:
                os.environ[key] = val
    return w


def fa4_call(q, k, v, indptr, lens, causal):
    """FlashAttention-4 (``flash_attn.cute``) varlen forward on the case, as a no-argument callable."""
    from flash_attn.cute import flash_attn_varlen_func

    mx = max(lens)
    return lambda: flash_attn_varlen_func(q, k, v, cu_seqlens_q=indptr, cu_seqlens_k=indptr, max_seqlen_q=mx,
                                          max_seqlen_k=mx, causal=causal)


def fi_call(ws, q, k, v, indptr, hq, hkv, d, causal):
    """FlashInfer 0.7.2's ragged prefill (``backend="fa3"``) on the case, planned, as a no-argument callable."""
    import flashinfer

    fw = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3")
    fw.plan(indptr, indptr, hq, hkv, d, causal=causal, q_data_type=DT)
    return lambda: fw.run(q, k, v)


def main():
    if not torch.cuda.is_available():
        raise SystemExit(f"{os.path.basename(__file__)}: needs a CUDA GPU (timings run on the device)")
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-portable", action="store_true")
    ap.add_argument("--tune", default="", help="extra CUTEDSL_ATTN_PREFILL_TUNE settings, ';'-separated")
    ap.add_argument("--cases", default="", help="only the cases whose name contains one of these ';'-separated words")
    ap.add_argument("--rounds", type=int, default=0,
                    help="> 0: time ours and the peers interleaved over this many rounds of one call (paired ratios)")
    args = ap.parse_args()
    tunes = [x for x in args.tune.split(";") if x]

    try:
        import flash_attn.cute  # noqa: F401
        have_fa4 = True
    except Exception as e:  # noqa: BLE001
        have_fa4 = False
        print("FA4 unavailable:", e)
    try:
        import flashinfer  # noqa: F401
        have_fi = True
    except Exception as e:  # noqa: BLE001
        have_fi = False
        print("flashinfer unavailable:", e)

    a = torch.randn(8192, 8192, dtype=DT, device=DEV)
    bm = torch.randn(8192, 8192, dtype=DT, device=DEV)
    t = timed(lambda: a @ bm, reps=5)
    gemm_tf = 2 * 8192**3 / t / 1e12
    del a, bm
    print(f"bf16 matmul 8192^3: {gemm_tf:.0f} TFLOP/s")
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    rows = []
    cases = CASES[:2] if args.quick else CASES
    if args.cases:
        cases = [c for c in cases if any(w in c[0] for w in args.cases.split(";"))]
    for name, lens, hq, hkv, d, causal in cases:
        lens, q, k, v, indptr = case_inputs(lens, hq, hkv, d)
        fl = flops(lens, hq, d, d, causal)
        row = dict(case=name, tflop=fl / 1e12)
        w = plan_ours(ws, indptr, hq, hkv, d, causal)
        o = w.run(q, k, v)
        fns = {"ours": lambda: w.run(q, k, v, out=o)}  # (with --rounds: timed below, with the peers)
        if not args.rounds:
            t = timed(fns["ours"])
            row["ours_ms"], row["ours_tf"] = t * 1e3, fl / t / 1e12
        row["ours_kernel"] = w._plan["choice"].name
        for tune in tunes:
            try:
                wt = plan_ours(ws, indptr, hq, hkv, d, causal, {"CUTEDSL_ATTN_PREFILL_TUNE": tune})
                ot = wt.run(q, k, v)
                row[f"tune[{tune}]_relerr"] = ((ot.float() - o.float()).norm() / o.float().norm()).item()
                row[f"tune[{tune}]_ms"] = timed(lambda: wt.run(q, k, v, out=ot)) * 1e3
            except Exception as e:  # noqa: BLE001
                print(f"tune {tune} failed:", repr(e)[:300])
        if not args.no_portable:  # the portable kernel's share
            wp = plan_ours(ws, indptr, hq, hkv, d, causal, {"CUTEDSL_ATTN_PREFILL_KERNEL": "portable"})
            op = wp.run(q, k, v)
            row["portable_relerr"] = ((op.float() - o.float()).norm() / o.float().norm()).item()
            row["portable_ms"] = timed(lambda: wp.run(q, k, v, out=op), reps=3) * 1e3
        if have_fa4:
            try:
                fa4 = fa4_call(q, k, v, indptr, lens, causal)
                fo = fa4()
                fo = fo[0] if isinstance(fo, tuple) else fo
                row["fa4_relerr"] = ((fo.float() - o.float()).norm() / o.float().norm()).item()
                fns["fa4"] = fa4
            except Exception as e:  # noqa: BLE001
                print("fa4 failed:", repr(e)[:300])
        if have_fi and d == 128:
            try:
                fi = fi_call(ws, q, k, v, indptr, hq, hkv, d, causal)
                fo = fi()
                row["fi_relerr"] = ((fo.float() - o.float()).norm() / o.float().norm()).item()
                fns["fi"] = fi
            except Exception as e:  # noqa: BLE001
                print("flashinfer failed:", repr(e)[:300])
        if len(set(lens)) == 1:
            try:
                B, L = len(lens), lens[0]
                qs = q.view(B, L, hq, d).transpose(1, 2)
                ks = k.view(B, L, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1)
                vs = v.view(B, L, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1)
                from torch.nn.attention import SDPBackend, sdpa_kernel

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
                cudnn()
                fns["cudnn"] = cudnn
            except Exception as e:  # noqa: BLE001
                print("cudnn sdpa failed:", repr(e)[:300])
        if args.rounds:  # interleaved: medians, and each peer's paired ratio to ours
            series = {k: [statistics.median(c) for c in v] for k, v in _timer.interleaved(fns, args.rounds).items()}
            for key, ts in series.items():
                row[f"{key}_ms"] = statistics.median(ts) * 1e3
                if key != "ours":
                    row[f"{key}_paired"] = paired_ratio(ts, series["ours"])
            row["ours_tf"] = fl / (row["ours_ms"] * 1e-3) / 1e12
            row["rounds"] = args.rounds
        else:
            for key in ("fa4", "fi", "cudnn"):
                if key in fns:
                    row[f"{key}_ms"] = timed(fns[key]) * 1e3
        rows.append(row)
        print(json.dumps(row))
        del q, k, v
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_prefill.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), gemm_tflops=gemm_tf, rows=rows), f, indent=1)
    print(f"\nGPU {torch.cuda.get_device_name()}; bf16 GEMM ceiling {gemm_tf:.0f} TFLOP/s"
          + (f"; ours and the peers interleaved over {args.rounds} rounds (ratios: median of paired per-round ratios)"
             if args.rounds else ""))
    print("| case | ours ms | ours TFLOP/s | % GEMM | vs FA4 | vs FI fa3 | vs cuDNN | portable kernel / ours |"
          + "".join(f" tune[{t}] ms |" for t in tunes))
    print("|---|---|---|---|---|---|---|---|" + "---|" * len(tunes))
    for r in rows:
        def ratio(k):
            if k not in r:
                return "n/a"
            paired = r.get(k.replace("_ms", "_paired"))  # (--rounds: the paired ratio)
            if paired is not None:
                return f"{paired:.3f}x ({r[k]:.3f})"
            return f"{r[k] / r['ours_ms']:.2f}x ({r[k]:.3f})"
        print(f"| {r['case']} | {r['ours_ms']:.3f} | {r['ours_tf']:.0f} | {100 * r['ours_tf'] / gemm_tf:.0f}% | "
              f"{ratio('fa4_ms')} | {ratio('fi_ms')} | {ratio('cudnn_ms')} | {ratio('portable_ms')} |"
              + "".join(f" {r.get(f'tune[{t}]_ms', float('nan')):.3f} (err {r.get(f'tune[{t}]_relerr', float('nan')):.0e}) |"
                        for t in tunes))
    print("(ratios are peer time / our time: > 1 means we are faster)")


if __name__ == "__main__":
    main()
