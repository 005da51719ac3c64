"""score_mod benchmark: a Python score_mod traced into our prefill kernel vs FlashAttention-4's score_mod and
PyTorch FlexAttention (``torch.compile(flex_attention)``), same process, same inputs.

The score_mod is a relative-position bias, ``score - 0.004 * (q_idx - kv_idx)`` (ALiBi-like, one slope), on
scaled logits -- the same function for all three (FlexAttention's ``score_mod`` has our signature; FA4's takes
vectors and two more arguments, so it gets its own two-line twin).  Causal masking by each library's own
mechanism (ours and FA4's ``causal``, FlexAttention's block mask).  Also timed: our kernel without the
score_mod (what the score_mod costs).

Timing as perf/bench_prefill.py ``--rounds``: L2 flushed, 2 ms GPU sleep before each call, every variant
once per round, interleaved; ratios are the median of the per-round peer / ours ratios.  FLOPs as FlashInfer's
benchmarks (causal: average visible keys).

Usage: python perf/bench_score_mod.py [--rounds 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from bench_prefill import DEV, DT, flops, plan_ours

from cutedsl_attn.timing import KernelTimer, paired_ratio

SLOPE = 0.004
CASES = [("B2x8192 h32 d128 causal", 2, 8192, 32, 128), ("B2x8192 h64 d64 causal", 2, 8192, 64, 64)]


def rel_bias(score, batch_idx, head_idx, q_idx, kv_idx):
    """Ours and FlexAttention's score_mod (the same signature)."""
    return score - SLOPE * (q_idx - kv_idx)


def fa4_bias_fn():
    import cutlass
    import cutlass.cute as cute

    @cute.jit
    def fa4_bias(score, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return score - SLOPE * (q_idx - kv_idx).to(cutlass.Float32)

    return fa4_bias


def main():
    if not torch.cuda.is_available():
        raise SystemExit(f"{os.path.basename(__file__)}: needs a CUDA GPU")
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cases", default="", help="only the cases whose name contains one of these ';'-separated words")
    ap.add_argument("--tune", default="", help="';'-separated CUTEDSL_ATTN_PREFILL_TUNE settings of extra 'ours' variants")
    a = ap.parse_args()
    timer = KernelTimer(DEV, sleep_cycles=4_000_000)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    results = []
    words = [x for x in a.cases.split(";") if x]
    for name, B, L, H, D in CASES:
        if words and not any(w in name for w in words):
            continue
        torch.manual_seed(0)
        q = torch.randn(B * L, H, D, dtype=DT, device=DEV)
        k = torch.randn(B * L, H, D, dtype=DT, device=DEV)
        v = torch.randn(B * L, H, D, dtype=DT, device=DEV)
        indptr = torch.arange(0, (B + 1) * L, L, dtype=torch.int32, device=DEV)
        fns, outs, errs = {}, {}, {}

        def ours(score_mod, tune=""):
            w = plan_ours(ws, indptr, H, H, D, True, {"CUTEDSL_ATTN_PREFILL_TUNE": tune} if tune else None,
                          score_mod=score_mod)
            o = w.run(q, k, v)
            return (lambda: w.run(q, k, v, out=o)), o, w._plan["choice"].name

        fns["ours"], outs["ours"], kern = ours(rel_bias)
        fns["ours, no score_mod"], _, _ = ours(None)
        for tune in [x for x in a.tune.split(";") if x.strip()]:
            try:
                fns[f"ours {tune}"], outs[f"ours {tune}"], _ = ours(rel_bias, tune)
            except Exception as e:  # noqa: BLE001 -- e.g. a setting this head_dim does not take
                errs[f"ours {tune}"] = f"{type(e).__name__}: {str(e)[:200]}"
        try:
            from flash_attn.cute import flash_attn_varlen_func

            fb = fa4_bias_fn()
            fa = lambda: flash_attn_varlen_func(q, k, v, cu_seqlens_q=indptr, cu_seqlens_k=indptr,  # noqa: E731
                                                max_seqlen_q=L, max_seqlen_k=L, causal=True, score_mod=fb)
            r = fa()
            outs["FA4"] = r[0] if isinstance(r, tuple) else r
            fns["FA4"] = fa
        except Exception as e:  # noqa: BLE001 -- a peer that does not run is reported, not fatal
            errs["FA4"] = f"{type(e).__name__}: {str(e)[:200]}"
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            q4, k4, v4 = (x.view(B, L, H, D).transpose(1, 2).contiguous() for x in (q, k, v))
            bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, B=None, H=None, Q_LEN=L, KV_LEN=L, device=DEV)
            flex = torch.compile(flex_attention)
            fl = lambda: flex(q4, k4, v4, score_mod=rel_bias, block_mask=bm)  # noqa: E731
            outs["FlexAttention"] = fl().transpose(1, 2).reshape(B * L, H, D)
            fns["FlexAttention"] = fl
        except Exception as e:  # noqa: BLE001
            errs["FlexAttention"] = f"{type(e).__name__}: {str(e)[:200]}"
        torch.cuda.synchronize()
        ref = outs["ours"].float()
        rel = {n: float((o.float() - ref).norm() / ref.norm()) for n, o in outs.items() if n != "ours"}
        t = timer.interleaved(fns, rounds=a.rounds)
        per = {n: [x[0] for x in s] for n, s in t.items()}  # one call per round
        med = {n: statistics.median(p) for n, p in per.items()}
        fl_count = flops([L] * B, H, D, D, True)
        row = dict(case=name, kernel=kern, ms={n: round(m * 1e3, 3) for n, m in med.items()},
                   tflops={n: round(fl_count / m / 1e12) for n, m in med.items()},
                   ratio_vs_ours={n: round(paired_ratio(per[n], per["ours"]), 3) for n in per if n != "ours"},
                   rel_diff_vs_ours=rel, errors=errs)
        results.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"bench_score_mod{'_' + '_'.join(words) if words else ''}.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), rounds=a.rounds, results=results), f, indent=1)
    print(f"\nscore_mod = score - {SLOPE} * (q_idx - kv_idx), bf16, causal, {a.rounds} interleaved rounds "
          f"({torch.cuda.get_device_name()}); ratio = median of peer / ours per round (> 1: ours faster)")
    print("| case | ours ms (TFLOP/s) | no score_mod | FA4 score_mod | FlexAttention | rel. diff FA4 / Flex |")
    print("|---|---|---|---|---|---|")
    for r in results:
        def cell(n):
            if n not in r["ms"]:
                return "n/a (" + r["errors"].get(n, "")[:60] + ")"
            return f"{r['ms'][n]} ({r['ratio_vs_ours'][n]}x)"
        rd = " / ".join(f"{r['rel_diff_vs_ours'].get(n, float('nan')):.1e}" for n in ("FA4", "FlexAttention"))
        print(f"| {r['case']} | {r['ms']['ours']} ({r['tflops']['ours']}) | {cell('ours, no score_mod')} | "
              f"{cell('FA4')} | {cell('FlexAttention')} | {rd} |")


if __name__ == "__main__":
    main()
