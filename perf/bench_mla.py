"""MLA decode benchmark (absorbed form, page 64): cutedsl_attn's ``BatchMLAPagedAttentionWrapper`` (bf16) and, when
installed, FlashInfer's fa3 / fa2 MLA in the same process; fp8 e4m3 rows through
``trtllm_batch_decode_with_kv_cache_mla``.

Method: bench_decode.py's timer (L2 flushed by a 512 MiB memset before every call, the GPU sleeping while the
host queues the call so host launch time is excluded, CUDA events, median of 20).  FLOPs and bytes as
FlashMLA's ``benchmark/bench_flash_mla.py`` counts them: FLOPs = 2 * s_q * sum(s_k) * h_q * (d + d_v), bytes =
2 * (sum(s_k) * h_kv * d + b * s_q * h_q * (d + d_v)) with d = 576, d_v = 512, h_kv = 1.

Rows: (a) 128 heads, B 64 and 132, kv 4096 and 8192, qo_len 1 (compute-bound on the H200); (b) the same with
qo_len 2 (MTP: two query rows per request, bottom-right causal; FLOPs count both rows, s_q = 2); (c) 16 heads (TP8),
B 128, kv 8192 (memory-bound), against the read ceiling of the same run; (d) B 1, kv 32768, 128 heads (split-KV),
its time against the bytes-only time (its bytes at the read ceiling of the same run, ``*_over_bytes_only``);
(e) the rows of (a) and (c) with fp8 e4m3 q and cache (bf16 O, FlashInfer's trtllm fp8 form) and (c) with a
bf16 q over the fp8 cache.  The trtllm entry point plans on the host per call (it reads ``seq_lens``), so an fp8
row plans once and times the kernel launch of that plan with the same timer.  fp8 bytes count 1 per cached /
fp8-query element and 2 per output element; FLOPs as above.

``--kernel`` picks our bf16 kernel (``CUTEDSL_ATTN_MLA_KERNEL``): ``sm90`` (the automatic choice on sm_90a),
``portable`` or ``both`` (the default: each timed on the same inputs; ``ours_*`` columns are the first of them,
the SM90 one, ``<kernel>_*`` columns each, ``sm90_vs_portable_relerr`` the difference of their outputs); fp8 rows
the same (``<kernel>_kernel`` names the kernel that ran).  ``--variants`` times extra tiles
(``CUTEDSL_ATTN_MLA_TUNE`` values) of the SM90 kernel when it is timed (else of the portable one) on every bf16 row
(``v[...]_*`` columns: time, TFLOP/s, relative error against the default tiles, the plan's work items and longest
piece; ``v[...]_error`` the reason a variant refuses a row, e.g. ``swap_ab=1`` past its ``tile_n`` packed rows:
time it on row c, 16 heads).  A variant may also hold the planner's split keys (``split_waves``: 0 the modelled
split, the default; > 0 pieces filling that many waves of CTAs; ``split_min_tokens``: the shortest piece, a
multiple of 64), e.g. ``--rows d --kernel sm90 --no-peers --variants 'split_waves=1;split_waves=2;split_waves=4'``
(row d, one request of 32768 tokens on 132 SMs: 64, 128, 256 pieces), alone or with tiles fields
(``'merge_kernel=0,split_waves=2'``).  ``--rows`` keeps some row tags.

Usage:  python perf/bench_mla.py [--out DIR] [--quick] [--kernel portable|sm90|both] [--rows a,b,c,d,e]
        [--variants 'key=value,...;key=value,...'] [--no-peers]
Prints a Markdown table (the last thing printed) and writes JSON to DIR.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import read_ceiling, timed  # noqa: E402
from mla_peers import FI_BACKENDS, flashinfer_mla  # noqa: E402

DEV = torch.device("cuda")
DT = torch.bfloat16
DC, DR, PS = 512, 64, 64
SM_SCALE = 1.0 / math.sqrt(128 + 64)
# (tag, heads, batch, kv_len, qo_len)
ROWS = [("a", 128, 64, 4096, 1), ("a", 128, 64, 8192, 1), ("a", 128, 132, 4096, 1), ("a", 128, 132, 8192, 1),
        ("b", 128, 64, 4096, 2), ("b", 128, 64, 8192, 2), ("b", 128, 132, 4096, 2), ("b", 128, 132, 8192, 2),
        ("c", 16, 128, 8192, 1), ("d", 128, 1, 32768, 1)]
E4M3 = torch.float8_e4m3fn
FP8_ROWS = [("e", 128, 64, 4096, E4M3), ("e", 128, 64, 8192, E4M3), ("e", 128, 132, 4096, E4M3),
            ("e", 128, 132, 8192, E4M3), ("e", 16, 128, 8192, E4M3), ("e", 16, 128, 8192, DT)]


def make(B, L, H, gen, s_q=1):
    npg = -(-L // PS)
    total = B * npg
    ckv = torch.randn((total, PS, DC), dtype=DT, device=DEV)
    kpe = torch.randn((total, PS, DR), dtype=DT, device=DEV)
    q_nope = torch.randn((B * s_q, H, DC), dtype=DT, device=DEV)
    q_pe = torch.randn((B * s_q, H, DR), dtype=DT, device=DEV)
    qo_indptr = torch.arange(B + 1, dtype=torch.int32, device=DEV) * s_q
    kv_indptr = torch.arange(B + 1, dtype=torch.int32, device=DEV) * npg
    kv_indices = torch.randperm(total, generator=gen).to(torch.int32).to(DEV)
    kv_lens = torch.full((B,), L, dtype=torch.int32, device=DEV)
    return q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_lens


def flops_bytes(B, L, H, s_q=1):
    d, dv = DC + DR, DC
    flops = 2 * s_q * B * L * H * (d + dv)
    nbytes = 2 * (B * L * 1 * d + B * s_q * H * (d + dv))
    return flops, nbytes


def fp8_bytes(B, L, H, q_bytes, s_q=1):
    """Bytes of an fp8-cache row: the cache once (1 byte an element), q at ``q_bytes``, O in bf16."""
    d, dv = DC + DR, DC
    return B * L * d + B * s_q * H * (d * q_bytes + dv * 2)


def bench_fp8(H, B, L, q_dtype, gen, ws, timed_fn):
    """One fp8-cache row through trtllm_batch_decode_with_kv_cache_mla: (plan-once launch seconds, relative error
    of O against the bf16 wrapper on the same values, the kernel's NAME, O)."""
    from cutedsl_attn.api import mla_trtllm
    from cutedsl_attn.api.mla import BatchMLAPagedAttentionWrapper
    from cutedsl_attn.dispatch import mla_launch

    npg = -(-L // PS)
    total = B * npg
    kv = (torch.randn((total, PS, DC + DR), device=DEV) / 2).to(E4M3)
    query = torch.randn((B, 1, H, DC + DR), device=DEV).to(q_dtype)
    bt = torch.randperm(total, generator=gen).to(torch.int32).view(B, npg).to(DEV)
    seq_lens = torch.full((B,), L, dtype=torch.int32, device=DEV)
    out = torch.empty((B, 1, H, DC), dtype=torch.bfloat16, device=DEV)
    module, cfg, args, _, _, n = mla_trtllm._prepare(query, kv, ws, 128, DC, DR, bt, seq_lens, L, out, SM_SCALE,
                                                     1.0, None, False, None)
    assert n > 0
    t = timed_fn(lambda: mla_launch(module, cfg, args))
    # the same values in bf16 through the wrapper (e4m3 is exact in bf16)
    kv16, q16 = kv.to(DT), query.to(DT).view(B, H, DC + DR)
    w = BatchMLAPagedAttentionWrapper(ws)
    w.plan(torch.arange(B + 1, dtype=torch.int32, device=DEV), torch.arange(B + 1, dtype=torch.int32, device=DEV) * npg,
           bt.view(-1), seq_lens, H, DC, DR, PS, False, SM_SCALE, DT, DT)
    o16 = w.run(q16[..., :DC], q16[..., DC:], kv16[..., :DC], kv16[..., DC:])
    err = ((out.view(B, H, DC).float() - o16.float()).norm() / o16.float().norm()).item()
    return t, err, module.NAME, out


def main():
    global PS
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--variants", default="", help="extra tiles / split plans of our kernel (the SM90 one when "
                    "timed), ';'-separated CUTEDSL_ATTN_MLA_TUNE values, e.g. 'schedule=1;merge_kernel=0' or "
                    "'split_waves=2;split_waves=4,split_min_tokens=128'")
    ap.add_argument("--no-peers", action="store_true", help="skip FlashInfer's fa3 / fa2 MLA")
    ap.add_argument("--kernel", choices=("auto", "portable", "sm90", "both"), default="both",
                    help="our bf16 MLA kernel (CUTEDSL_ATTN_MLA_KERNEL); both: time each on the same inputs")
    ap.add_argument("--page", type=int, default=PS, help="page size of every row (default 64)")
    ap.add_argument("--rows", default="a,b,c,d,e", help="row tags to run, comma-separated (a b c d: bf16, e: fp8)")
    args = ap.parse_args()
    PS = args.page
    from cutedsl_attn.api.mla import BatchMLAPagedAttentionWrapper

    kernels = ("sm90", "portable") if args.kernel == "both" else (args.kernel,)
    tags = set(args.rows.split(","))
    if not tags <= set("abcde"):
        ap.error(f"--rows takes tags among a,b,c,d,e, got {args.rows!r}")
    tuned = "sm90" if "sm90" in kernels else kernels[0]  # the kernel --variants tune
    env_before = os.environ.get("CUTEDSL_ATTN_MLA_KERNEL")

    gen = torch.Generator().manual_seed(0)
    rd, cp = read_ceiling()
    print(f"read ceiling {rd:.3f} TB/s, copy {cp:.3f} TB/s")
    a, bm = (torch.randn(8192, 8192, dtype=DT, device=DEV) for _ in range(2))
    gemm_tf = 2 * 8192**3 / timed(lambda: a @ bm, reps=5) / 1e12  # the compute ceiling of the same run
    del a, bm
    print(f"bf16 matmul 8192^3: {gemm_tf:.0f} TFLOP/s")
    ws = torch.empty(256 << 20, dtype=torch.int8, device=DEV)
    results = []
    for (tag, H, B, L, s_q) in [r for r in (ROWS[:2] if args.quick else ROWS) if r[0] in tags]:
        causal = s_q > 1  # MTP rows: the later draft token sees one more key
        q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_lens = make(B, L, H, gen, s_q)
        fl, nb = flops_bytes(B, L, H, s_q)
        row = dict(row=tag, heads=H, batch=B, kv_len=L, s_q=s_q, page=PS, q="bf16", kv="bf16",
                   bytes_only_us=nb / (rd * 1e12) * 1e6)
        outs = {}
        for kname in kernels:
            os.environ["CUTEDSL_ATTN_MLA_KERNEL"] = kname
            w = BatchMLAPagedAttentionWrapper(ws)
            w.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, H, DC, DR, PS, causal, SM_SCALE, DT, DT)
            out = torch.empty((B * s_q, H, DC), dtype=DT, device=DEV)
            t = timed(lambda: w.run(q_nope, q_pe, ckv, kpe, out=out))
            row.update({f"{kname}_us": t * 1e6, f"{kname}_tflops": fl / t / 1e12, f"{kname}_tbs": nb / t / 1e12,
                        f"{kname}_split_tokens": w._plan["split_tokens"], f"{kname}_work": w._plan["num_work"],
                        f"{kname}_module": w._plan["module"].NAME,
                        f"{kname}_over_bytes_only": t * 1e6 / row["bytes_only_us"]})
            if not outs:
                row.update(ours_kernel=kname, ours_us=t * 1e6, ours_tflops=fl / t / 1e12, ours_tbs=nb / t / 1e12,
                           ours_split_tokens=w._plan["split_tokens"], ours_work=w._plan["num_work"],
                           ours_over_bytes_only=t * 1e6 / row["bytes_only_us"])
            outs[kname] = out.clone()
        if len(outs) == 2:
            a, b = outs["sm90"].float(), outs["portable"].float()
            row["sm90_vs_portable_relerr"] = ((a - b).norm() / b.norm()).item()
        ref_o = outs[kernels[0]]
        os.environ["CUTEDSL_ATTN_MLA_KERNEL"] = tuned
        for var in [v for v in args.variants.split(";") if v]:
            os.environ["CUTEDSL_ATTN_MLA_TUNE"] = var
            try:  # a variant refusing the row (swap_ab=1 past tile_n packed rows, at plan time): kept as text
                wv = BatchMLAPagedAttentionWrapper(ws)
                wv.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, H, DC, DR, PS, causal, SM_SCALE, DT, DT)
                ov = wv.run(q_nope, q_pe, ckv, kpe)
            except ValueError as e:
                row[f"v[{var}]_error"] = str(e)
                continue
            finally:
                os.environ.pop("CUTEDSL_ATTN_MLA_TUNE")
            row[f"v[{var}]_work"] = wv._plan["num_work"]
            row[f"v[{var}]_split_tokens"] = wv._plan["split_tokens"]
            row[f"v[{var}]_relerr"] = ((ov.float() - ref_o.float()).norm() / ref_o.float().norm()).item()
            tv = timed(lambda: wv.run(q_nope, q_pe, ckv, kpe, out=ov))
            row[f"v[{var}]_us"] = tv * 1e6
            row[f"v[{var}]_tflops"] = fl / tv / 1e12
            row[f"v[{var}]_over_{tuned}"] = tv / (row[f"{tuned}_us"] * 1e-6)
        for be in () if args.no_peers else FI_BACKENDS:  # FlashInfer fa3 / fa2 MLA; the reason kept when absent
            frun, why = flashinfer_mla(be, q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_lens,
                                       sm_scale=SM_SCALE, causal=causal)
            if frun is None:
                row[f"fi_{be}_error"] = why
                continue
            fo = frun()
            row[f"fi_{be}_relerr"] = ((fo.float() - ref_o.float()).norm() / ref_o.float().norm()).item()
            tf = timed(lambda: frun(out=fo))
            row.update({f"fi_{be}_us": tf * 1e6, f"fi_{be}_tflops": fl / tf / 1e12, f"fi_{be}_tbs": nb / tf / 1e12,
                        f"fi_{be}_over_bytes_only": tf * 1e6 / row["bytes_only_us"]})
        if "fi_fa3_us" in row:
            row["fa3_over_ours_time"] = row["fi_fa3_us"] / row["ours_us"]
        row["read_ceiling_tbs"] = rd
        row["gemm_tflops"] = gemm_tf
        row["ours_over_gemm"] = row["ours_tflops"] / gemm_tf
        results.append(row)
        print(row, flush=True)
        del q_nope, q_pe, ckv, kpe
        torch.cuda.empty_cache()

    bf16_us = {(r["heads"], r["batch"], r["kv_len"]): r["ours_us"] for r in results if r["s_q"] == 1}
    for (tag, H, B, L, q_dtype) in [r for r in (FP8_ROWS[:1] if args.quick else FP8_ROWS) if "e" in tags]:
        fl, _ = flops_bytes(B, L, H)
        nb = fp8_bytes(B, L, H, 1 if q_dtype == E4M3 else 2)
        row = dict(row=tag, heads=H, batch=B, kv_len=L, s_q=1, page=PS, q="fp8" if q_dtype == E4M3 else "bf16",
                   kv="fp8", read_ceiling_tbs=rd)
        outs = {}
        seed = int(torch.randint(1 << 30, (1,), generator=gen))
        for kname in kernels:
            os.environ["CUTEDSL_ATTN_MLA_KERNEL"] = kname
            torch.manual_seed(seed)  # the same cache, query and page table for each kernel
            t, err, name, o = bench_fp8(H, B, L, q_dtype, torch.Generator().manual_seed(seed), ws, timed)
            outs[kname] = o
            row.update({f"{kname}_us": t * 1e6, f"{kname}_tflops": fl / t / 1e12, f"{kname}_tbs": nb / t / 1e12,
                        f"{kname}_kernel": name, f"{kname}_fp8_vs_bf16_relerr": err})
            if "ours_us" not in row:
                row.update(ours_kernel=name, ours_us=t * 1e6, ours_tflops=fl / t / 1e12, ours_tbs=nb / t / 1e12,
                           fp8_vs_bf16_relerr=err)
        if len(outs) == 2:
            a, b = outs["sm90"].float(), outs["portable"].float()
            row["sm90_vs_portable_relerr"] = ((a - b).norm() / b.norm()).item()
        if (H, B, L) in bf16_us:
            row["bf16_over_fp8_time"] = bf16_us[(H, B, L)] / row["ours_us"]
        results.append(row)
        print(row, flush=True)
        del outs
        torch.cuda.empty_cache()

    if env_before is None:
        os.environ.pop("CUTEDSL_ATTN_MLA_KERNEL", None)
    else:
        os.environ["CUTEDSL_ATTN_MLA_KERNEL"] = env_before
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_mla.json"), "w") as f:
        json.dump(dict(read_ceiling_tbs=rd, copy_tbs=cp, gemm_tflops=gemm_tf, rows=results), f, indent=1)
    variant_cols = [c for v in args.variants.split(";") if v for c in (f"v[{v}]_work", f"v[{v}]_over_{tuned}")]
    cols = ["row", "heads", "batch", "kv_len", "s_q", "q", "kv", "ours_kernel", "ours_work", "ours_us", "ours_tflops",
            "ours_tbs",
            *(["portable_tflops", "sm90_tflops", "sm90_vs_portable_relerr"] if len(kernels) == 2 else []),
            "read_ceiling_tbs", "gemm_tflops", "ours_over_gemm", "bytes_only_us", "ours_over_bytes_only", *variant_cols,
            "bf16_over_fp8_time", "fp8_vs_bf16_relerr", "fi_fa3_us", "fi_fa3_tflops", "fa3_over_ours_time",
            "fi_fa2_us", "fi_fa2_tflops"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
