"""Prefill kernel probe: each kernel variant vs the oracle (float32), and its time.

Runs ragged (or ``--paged``) batches through the prefill wrappers once per kernel
choice (``CUTEDSL_ATTN_PREFILL_KERNEL`` = ``auto`` (SM90 where it applies) and
``portable``, plus ``--variants`` of the SM90 tiles), prints the relative error against
the package's oracle (``cutedsl_attn.ref``, float32 on the GPU) and the kernel
time (L2 flushed, launch cost excluded).  A development aid; the verdicts live in
``tests/test_prefill_gpu.py`` and ``perf/bench_prefill.py``.

Usage: python perf/probe_prefill.py [--quick] [--paged PAGE_SIZE] [--only NAMES] [--variants "k=v,...;..."]
"""

from __future__ import annotations

import argparse
import os

import torch

from cutedsl_attn import ref as oracle
from cutedsl_attn.timing import KernelTimer

DEV = torch.device("cuda")
# the benchmark's varlen mix (perf/bench_prefill.py): 64 request lengths in [128, 4096], fixed seed
VARLEN = torch.randint(128, 4097, (64,), generator=torch.Generator().manual_seed(0)).tolist()
VARIANTS = ["auto", "portable"]


def to_paged(k, v, kv, page_size):
    """The ragged K/V of each request copied into shuffled pages of a paged NHD cache (CSR page table)."""
    B = len(kv) - 1
    n_pages = [-(-(kv[b + 1] - kv[b]) // page_size) for b in range(B)]
    total = sum(n_pages)
    perm = torch.randperm(total)
    cache = torch.zeros(total, 2, page_size, k.shape[1], k.shape[2], dtype=k.dtype, device=k.device)
    indices, indptr, last, p0 = [], [0], [], 0
    for b in range(B):
        L = kv[b + 1] - kv[b]
        ids = perm[p0: p0 + n_pages[b]]
        p0 += n_pages[b]
        for i, pid in enumerate(ids.tolist()):
            t0, t1 = kv[b] + i * page_size, min(kv[b] + (i + 1) * page_size, kv[b + 1])
            cache[pid, 0, : t1 - t0] = k[t0:t1]
            cache[pid, 1, : t1 - t0] = v[t0:t1]
        indices += ids.tolist()
        indptr.append(indptr[-1] + n_pages[b])
        last.append(L - (n_pages[b] - 1) * page_size if L else 0)
    i32 = dict(dtype=torch.int32)
    return dict(cache=cache, indices=torch.tensor(indices, **i32), indptr=torch.tensor(indptr, **i32),
                last=torch.tensor(last, **i32))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--paged", type=int, default=0, help="page size: run the paged wrapper (0: ragged)")
    ap.add_argument("--only", default="", help="comma-separated substrings of the case names to run")
    ap.add_argument("--variants", default="", help="extra CUTEDSL_ATTN_PREFILL_TUNE settings, ';'-separated")
    ap.add_argument("--no-portable", action="store_true", help="skip the portable kernel (saves time on big cases)")
    args = ap.parse_args()
    global VARIANTS
    VARIANTS = ["auto"] + ([] if args.no_portable else ["portable"]) + [v for v in args.variants.split(";") if v]
    import cutedsl_attn as ca

    timer = KernelTimer(DEV)
    g = torch.Generator(device="cpu").manual_seed(int.from_bytes(os.urandom(4), "little"))
    cases = [
        # name, qo_lens, kv_lens, hq, hkv, dqk, dvo, causal, extra
        ("d128 causal 2x1024", [1024, 1024], [1024, 1024], 16, 16, 128, 128, True, {}),
        ("d128 full ragged", [1, 77, 300, 0, 513], [5, 77, 900, 3, 1000], 8, 8, 128, 128, False, {}),
        ("d128 causal gqa4 ragged", [1, 77, 300, 129], [5, 200, 300, 1000], 32, 8, 128, 128, True, {}),
        ("d64 causal", [700, 1200], [700, 1500], 8, 8, 64, 64, True, {}),
        ("d256 causal", [700, 333], [700, 800], 4, 4, 256, 256, True, {}),
        ("d192/128 causal", [400, 640], [500, 640], 8, 8, 192, 128, True, {}),
        ("d128 window 100", [600], [900], 8, 2, 128, 128, True, {"window_left": 100}),
        ("d128 softcap 30", [500], [700], 8, 8, 128, 128, False, {"logits_soft_cap": 30.0}),
        ("d128 gqa8 causal", [333, 1000], [333, 1000], 32, 4, 128, 128, True, {}),
    ]
    perf_cases = [] if args.quick else [
        ("B2x8192 h32 d128 causal", [8192] * 2, [8192] * 2, 32, 32, 128, 128, True, {}),
        ("B2x8192 h32 d128 full", [8192] * 2, [8192] * 2, 32, 32, 128, 128, False, {}),
        ("B2x8192 h32/8 d128 causal", [8192] * 2, [8192] * 2, 32, 8, 128, 128, True, {}),
        ("B2x8192 h64 d64 causal", [8192] * 2, [8192] * 2, 64, 64, 64, 64, True, {}),
        ("B2x8192 h16 d256 causal", [8192] * 2, [8192] * 2, 16, 16, 256, 256, True, {}),
        ("varlen 64x[128,4096] h32/8 causal", VARLEN, VARLEN, 32, 8, 128, 128, True, {}),
    ]
    for name, qo_l, kv_l, hq, hkv, dqk, dvo, causal, extra in cases + perf_cases:
        if args.only and not any(o in name for o in args.only.split(",")):
            continue
        qo = [0]
        kv = [0]
        for a, b in zip(qo_l, kv_l):
            qo.append(qo[-1] + a)
            kv.append(kv[-1] + b)
        q = torch.randn(qo[-1], hq, dqk, generator=g).to(DEV, torch.bfloat16)
        k = torch.randn(kv[-1], hkv, dqk, generator=g).to(DEV, torch.bfloat16)
        v = torch.randn(kv[-1], hkv, dvo, generator=g).to(DEV, torch.bfloat16)
        scale = dqk ** -0.5
        big = qo[-1] > 4096
        # the package's oracle in float32 on the GPU (float64 would be slow at these sizes)
        ref = None if big else oracle.ragged_prefill(
            q, k, v, torch.tensor(qo), torch.tensor(kv), causal=causal, window_left=extra.get("window_left", -1),
            logits_soft_cap=extra.get("logits_soft_cap"), sm_scale=scale, dtype=torch.float32)[0]
        paged = to_paged(k, v, kv, args.paged) if args.paged else None
        res = {}
        for kern in VARIANTS:
            os.environ["CUTEDSL_ATTN_PREFILL_KERNEL"] = "portable" if kern == "portable" else "auto"
            if kern not in ("auto", "portable"):
                os.environ["CUTEDSL_ATTN_PREFILL_TUNE"] = kern
            else:
                os.environ.pop("CUTEDSL_ATTN_PREFILL_TUNE", None)
            ws = torch.empty(1 << 20, dtype=torch.uint8, device=DEV)
            try:
                if args.paged:
                    w = ca.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
                    w.plan(torch.tensor(qo, dtype=torch.int32), paged["indptr"], paged["indices"], paged["last"],
                           hq, hkv, dqk, args.paged, head_dim_vo=dvo, causal=causal, q_data_type=torch.bfloat16,
                           **extra)
                else:
                    w = ca.BatchPrefillWithRaggedKVCacheWrapper(ws)
                    w.plan(torch.tensor(qo, dtype=torch.int32), torch.tensor(kv, dtype=torch.int32), hq, hkv, dqk,
                           head_dim_vo=dvo, causal=causal, q_data_type=torch.bfloat16, **extra)
            except ValueError as e:  # a tuning variant this problem cannot take
                res[kern] = ("n/a", float("nan"), None, float("nan"))
                print(f"  {kern}: {e}"[:160])
                continue
            kind = "sm90" if type(w._plan["cfg"]).__module__.startswith("cutedsl_attn.sm90") else "port"
            out = torch.full((qo[-1], hq, dvo), float("nan"), dtype=torch.bfloat16, device=DEV)
            run = (lambda: w.run(q, paged["cache"], out=out)) if args.paged else (lambda: w.run(q, k, v, out=out))
            run()
            torch.cuda.synchronize()
            err = float("nan")
            if ref is not None:
                err = ((out.float() - ref).norm() / ref.norm()).item()
            elif kern != "auto" and res["auto"][2] is not None:
                err = ((out.float() - res["auto"][2].float()).norm() / out.float().norm()).item()
            t = timer(run, reps=5 if big else 10)
            res[kern] = (kind, t, out.clone(), err)
        ka, ta, _, ea = res["auto"]
        others = " ".join(f"| {k} {res[k][1] * 1e3:7.3f} ms err {res[k][3]:.1e}" for k in VARIANTS[1:])
        print(f"{name:26s} {ka[:5]} err {ea:.2e} {ta * 1e3:7.3f} ms {others}", flush=True)
    os.environ.pop("CUTEDSL_ATTN_PREFILL_KERNEL", None)


if __name__ == "__main__":
    main()
