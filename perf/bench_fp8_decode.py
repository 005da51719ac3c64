"""fp8 e4m3 K/V decode vs bf16 decode of the same tokens: the paged decode kernel through dispatch, same process.

Method and helpers as perf/bench_decode.py (imported): 32/8 heads, head_dim 128, bf16 q, one NHD pool
``[pages, 2, page_size, Hkv, D]`` with shuffled pages, and the same pool cast to torch.float8_e4m3fn.  Before
every timed call the L2 is flushed and the GPU sleeps while the host queues the call (host launch cost
excluded); median of ``--reps``.  TB/s counts the K/V bytes the kernel must read (1 byte an element for fp8,
2 for bf16); the read ceiling is a plain read measured in the same run.

``--variants`` sweeps the fp8 kernel's tiles (``portable.paged_decode.Tiles``: ``num_warps`` x ``num_stages``,
set through dispatch's ``CUTEDSL_ATTN_DECODE_TUNE`` hook, which overrides the split and the unsplit choice
alike): ``all`` (the default when the flag is given without a value) is every combination ``Tiles`` and the
shared-memory limit accept; or a list ``"w,s[,min_waves[,min_ctas_per_sm]];..."`` (``min_waves``:
``CUTEDSL_ATTN_DECODE_MIN_WAVES``, the planner's split floor, empty for the default; ``min_ctas_per_sm``: the
``Tiles`` register cap, e.g. ``4,3,,5``).  The variants' kernels are compiled first in ``--jobs`` parallel processes into the
disk cache, then timed one after the other; the best variant of each shape is printed last.

Usage:  python perf/bench_fp8_decode.py [--out DIR] [--reps 20] [--variants [all | "w,s[,m[,c]];..."]] [--jobs 8]
Prints one JSON line per row and Markdown tables last; writes DIR/bench_fp8_decode.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import math
import multiprocessing
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import DEV, DT, HKV, HQ, D, make_problem, read_ceiling, timed  # noqa: E402

SHAPES = [(64, 4096, 16), (128, 8192, 64), (1, 8192, 16)]
FP8 = "float8_e4m3fn"
TUNE_ENV, MIN_WAVES_ENV = "CUTEDSL_ATTN_DECODE_TUNE", "CUTEDSL_ATTN_DECODE_MIN_WAVES"


def fp8_problem(page_size, *, q_dtype=DT, kv_dtype=FP8):
    from cutedsl_attn import dispatch

    return dataclasses.replace(
        dispatch.decode_problem(dtype=q_dtype, head_dim=D, page_size=page_size, group_size=HQ // HKV),
        kv_dtype=kv_dtype)


def decode_launcher(q, k, v, indptr, indices, last, page_size, *, kv_dtype=""):
    """A zero-argument launch of the decode kernel (split-KV as dispatch plans it) on the NHD ``k`` / ``v``
    views ``[pages, page_size, Hkv, D]``, and the ``out`` it writes."""
    from cutedsl_attn import dispatch
    from cutedsl_attn.planning.decode import DecodeArgs, kv_lens_from_csr

    B = q.shape[0]
    problem = fp8_problem(page_size, q_dtype=q.dtype, kv_dtype=kv_dtype)
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


def relerr(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def fp8_row(B, L, ps, gen, *, reps, read_tbs, keep_inputs=False):
    """One fp8 row: the fp8 kernel and the bf16 kernel on the same tokens (``read_tbs``: the run's read ceiling).
    With ``keep_inputs`` also returns ``(q, cache8, indptr, indices, last, o8)`` for variant timing."""
    q, cache, indptr, indices, last = make_problem(B, L, ps, gen)
    cache8 = cache.to(torch.float8_e4m3fn)
    del cache  # bf16 runs on the fp8 values widened back (exact): the same tokens and bytes, only P / O rounding differ
    k16, v16 = cache8[:, 0].to(DT), cache8[:, 1].to(DT)
    elems = 2 * B * L * HKV * D
    row = dict(batch=B, kv_len=L, page=ps)
    f16, o16, c16, wp16 = decode_launcher(q, k16, v16, indptr, indices, last, ps)
    f8, o8, c8, wp8 = decode_launcher(q, cache8[:, 0], cache8[:, 1], indptr, indices, last, ps, kv_dtype=FP8)
    row["fp8_vs_bf16_relerr"] = relerr(o8, o16)
    t16 = timed(f16, reps=reps)
    t8 = timed(f8, reps=reps)
    row.update(bf16_us=t16 * 1e6, bf16_tbs=elems * 2 / t16 / 1e12, fp8_us=t8 * 1e6, fp8_tbs=elems / t8 / 1e12,
               fp8_read_share=elems / t8 / 1e12 / read_tbs, speedup=t16 / t8, bf16_tiles=str(c16.tiles),
               fp8_tiles=str(c8.tiles), bf16_split=wp16.split_tokens, fp8_split=wp8.split_tokens)
    del f16, o16, k16, v16
    if keep_inputs:
        return row, (q, cache8, indptr, indices, last, o8)
    return row


def fp8_table(rows, read_tbs):
    print(f"fp8 e4m3 KV vs bf16 KV, same tokens (read ceiling {read_tbs:.2f} TB/s)")
    print("| (B, kv_len, page) | bf16 us | bf16 TB/s | fp8 us | fp8 TB/s | fp8 % read ceiling | bf16 / fp8 time |"
          " fp8 tiles |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| ({r['batch']}, {r['kv_len']}, {r['page']}) | {r['bf16_us']:.1f} | {r['bf16_tbs']:.2f} | "
              f"{r['fp8_us']:.1f} | {r['fp8_tbs']:.2f} | {100 * r['fp8_read_share']:.0f}% | {r['speedup']:.2f}x | "
              f"{r['fp8_tiles']} |")


# ----------------------------------------------------------------------------- variants
def parse_variants(spec: str, page_size: int):
    """``[(num_warps, num_stages, min_waves or None[, min_ctas_per_sm])]`` of a ``--variants`` value for the fp8 problem at
    ``page_size``: ``all`` -> every ``Tiles`` the kernel's Config accepts there."""
    from cutedsl_attn.portable import paged_decode as pd

    if spec.strip() == "all":
        out = []
        for w in (1, 2, 4, 8):
            for s in range(2, 7):
                try:
                    pd.Config(fp8_problem(page_size), pd.Tiles(num_warps=w, num_stages=s))
                except ValueError:  # over the shared-memory limit
                    continue
                out.append((w, s, None))
        return out
    out = []
    for item in (x.strip() for x in spec.split(";") if x.strip()):
        parts = [p.strip() for p in item.split(",")]
        if len(parts) not in (2, 3, 4):
            raise SystemExit(f"--variants item {item!r} is not 'warps,stages[,min_waves[,min_ctas_per_sm]]'")
        mw = float(parts[2]) if len(parts) > 2 and parts[2] else None
        out.append((int(parts[0]), int(parts[1]), mw, int(parts[3])) if len(parts) == 4 else
                   (int(parts[0]), int(parts[1]), mw))
    return out


def _compile_worker(items):
    """Compile ``[(problem fields, tiles fields)]`` of the decode kernel into the disk cache (a fresh process)."""
    from cutedsl_attn import dispatch
    from cutedsl_attn.planning.decode import DecodeProblem
    from cutedsl_attn.portable import paged_decode as pd

    t = time.perf_counter()
    for pf, tf in items:
        dispatch.KernelChoice(pd, DecodeProblem(**pf), pd.Tiles(**tf)).fn
    return len(items), time.perf_counter() - t


def precompile(page_sizes, variants, jobs):
    """Compile every variant's fp8 kernel at each page size in ``jobs`` processes (the disk cache carries them
    to this process); returns the wall seconds, or None when nothing was compiled in parallel."""
    from cutedsl_attn.compile.cache import disk_cache_enabled

    if jobs <= 1 or not disk_cache_enabled():
        return None
    tiles = sorted({(v[0], v[1], v[3] if len(v) > 3 else 0) for v in variants})
    items = [(dataclasses.asdict(fp8_problem(ps)), dict(num_warps=w, num_stages=s, min_ctas_per_sm=c))
             for ps in page_sizes for w, s, c in tiles]
    if not items:
        return None
    had_arch = "CUTEDSL_ATTN_ARCH" in os.environ
    os.environ.setdefault("CUTEDSL_ATTN_ARCH", fp8_problem(page_sizes[0]).arch)  # workers: this target, no GPU
    chunks = [items[i::jobs] for i in range(min(jobs, len(items)))]
    t = time.perf_counter()
    try:
        with cf.ProcessPoolExecutor(len(chunks), mp_context=multiprocessing.get_context("spawn")) as ex:
            list(ex.map(_compile_worker, chunks))
    except Exception as e:  # noqa: BLE001 -- the timing loop compiles what is missing
        print(f"parallel precompile failed ({e!r:.300}); compiling in this process")
    finally:
        if not had_arch:
            os.environ.pop("CUTEDSL_ATTN_ARCH")
    return time.perf_counter() - t


def time_variants(inputs, ps, variants, *, reps):
    """``{label: (us, relerr vs the default fp8 output)}`` of every variant on one shape's fp8 inputs."""
    q, cache8, indptr, indices, last, o_default = inputs
    res = {}
    for v in variants:
        w, s, mw = v[:3]
        c = v[3] if len(v) > 3 else 0
        label = f"{w},{s}" + (f",{mw:g}" if mw is not None else "") + (f",ctas{c}" if c else "")
        os.environ[TUNE_ENV] = f"num_warps={w},num_stages={s}" + (f",min_ctas_per_sm={c}" if c else "")
        if mw is not None:
            os.environ[MIN_WAVES_ENV] = str(mw)
        try:
            fv, ov, cv, wpv = decode_launcher(q, cache8[:, 0], cache8[:, 1], indptr, indices, last, ps, kv_dtype=FP8)
            res[label] = dict(us=timed(fv, reps=reps) * 1e6, relerr=relerr(ov, o_default), split=wpv.split_tokens)
        except (ValueError, NotImplementedError) as e:
            print(f"variant {label}: {e}"[:300])
        finally:
            os.environ.pop(TUNE_ENV, None)
            os.environ.pop(MIN_WAVES_ENV, None)
    return res


def variants_table(rows):
    print("fp8 tile variants (num_warps,num_stages[,min_waves][,ctasN]): us; best per shape")
    print("| (B, kv_len, page) | default tiles, us | best variant | best us | default / best | all (us) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        v = r.get("variants") or {}
        if not v:
            continue
        best = min(v, key=lambda k: v[k]["us"])
        allv = " ".join(f"{k}:{x['us']:.1f}" for k, x in sorted(v.items(), key=lambda kv: kv[1]["us"]))
        print(f"| ({r['batch']}, {r['kv_len']}, {r['page']}) | {r['fp8_tiles']} {r['fp8_us']:.1f} | {best} | "
              f"{v[best]['us']:.1f} | {r['fp8_us'] / v[best]['us']:.3f}x | {allv} |")
    # one default for every shape: the variants timed on all of them, by the geometric mean of their time over
    # the default tiles' time
    timed_rows = [r for r in rows if r.get("variants")]
    common = set.intersection(*(set(r["variants"]) for r in timed_rows)) if timed_rows else set()
    score = {k: math.exp(sum(math.log(r["variants"][k]["us"] / r["fp8_us"]) for r in timed_rows) / len(timed_rows))
             for k in common}
    if score:
        top = sorted(score, key=score.get)[:3]
        print("best over all shapes (geomean of variant / default time): "
              + ", ".join(f"{k} {score[k]:.3f}" for k in top))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", nargs="?", const="all", default="",
                    help="fp8 tiles to sweep: 'all' (every valid num_warps x num_stages) or 'w,s[,min_waves[,min_ctas_per_sm]];...'")
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                    help="processes compiling the variants before timing (1: compile while timing)")
    ap.add_argument("--quick", action="store_true", help="the first shape only")
    args = ap.parse_args()

    shapes = SHAPES[:1] if args.quick else SHAPES
    gen = torch.Generator().manual_seed(0)
    rd, cp = read_ceiling()
    print(f"read ceiling {rd:.3f} TB/s, copy {cp:.3f} TB/s")
    variants = {ps: parse_variants(args.variants, ps) for ps in {s[2] for s in shapes}} if args.variants else {}
    if variants:
        allv = sorted({v for vs in variants.values() for v in vs}, key=str)
        t = precompile(sorted(variants), allv, args.jobs)
        if t is not None:
            print(f"precompiled {len(allv)} variants x {len(variants)} page sizes in {t:.1f} s ({args.jobs} jobs)")
    rows = []
    for (B, L, ps) in shapes:
        row, inputs = fp8_row(B, L, ps, gen, reps=args.reps, read_tbs=rd, keep_inputs=True)
        if variants:
            row["variants"] = time_variants(inputs, ps, variants[ps], reps=args.reps)
        rows.append(row)
        print(json.dumps(row))
        del inputs
        torch.cuda.empty_cache()
    res = dict(gpu=torch.cuda.get_device_name(), read_tbs=rd, copy_tbs=cp, rows=rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_fp8_decode.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nGPU {res['gpu']}; read ceiling {rd:.2f} TB/s (copy {cp:.2f})")
    fp8_table(rows, rd)
    if variants:
        variants_table(rows)


if __name__ == "__main__":
    main()
