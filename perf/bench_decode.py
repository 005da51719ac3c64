"""Paged-decode benchmark: cutedsl_attn vs FlashInfer 0.7.2, FlashAttention-4 and cuDNN, same process.

Method (see ../shared/reference/h200_anchors.md): before every timed call the L2 is flushed (512 MiB memset) and
the GPU sleeps so the host has queued the call; CUDA events bracket the call; median of ``--reps``.  Bandwidth =
K+V bytes / time; the ceiling is a plain 4 GiB read measured in the same run.  Problems: 32/8 heads, head_dim 128,
bf16, one NHD pool ``[pages, 2, page_size, Hkv, D]`` with shuffled pages.  Sections (all run by default):

* main: our decode kernel (``backend="cute"``) against FlashInfer (tensor / CUDA cores), FA4 and the cuDNN backend
  of the same wrapper (``backend="cudnn"``, same inputs; skipped with the reason when ``import cudnn`` fails).
  cuDNN's host path is longer than the default sleep, so ours and cuDNN are compared with a ~1 ms sleep,
  interleaved for ``--rounds`` rounds (ratio: the median of the paired per-round ratios).
* fp8: e4m3 KV rows (perf/bench_fp8_decode.py's: 64 x 4096 page 16, 128 x 8192 page 64, 1 x 8192 page 16): TB/s
  of cache bytes, share of the read ceiling, time against our bf16 decode of the same tokens (bf16 / fp8 time).
* entry (rows ``ENTRY_SHAPES``: 1 x 8192 page 16, 64 x 4096 page 16, 128 x 8192 page 64): the same problem
  through ``BatchDecodeWithPagedKVCacheWrapper.run()``, ``trtllm_batch_decode_with_kv_cache``,
  ``xqa``, ``attention.prims_ts.batch_decode_with_paged_kv_cache`` and ``single_decode_with_kv_cache`` (B = 1, its
  contiguous KV: page size 1).  Kernel time: CUDA events around each CuTe DSL launch inside the call (dispatch's
  ``KernelChoice.launch`` wrapped), each launch after an L2 flush and a GPU sleep that covers its own host launch,
  so the entry points' planning and host synchronisations are left out; host cost: wall time of one call with the
  GPU idle, reported apart; also CUDA events around the whole call (long sleep), where planning done after a host
  synchronisation shows.  Ratio: the entry point's kernel time over the wrapper's, paired per round; the last
  column is the worst ratio of the row against ``ENTRY_TARGET``.
* auto: ``backend="auto"`` vs ``"cute"`` vs ``"cudnn"`` on the main rows: end to end (a loop of 200 calls, host and
  device, L2 not flushed) and device only (as the main section, long sleep), which backend "auto" took, and auto's
  time over the better of the other two (the rule is ``dispatch.DECODE_AUTO_CUDNN``).

Usage:  python perf/bench_decode.py [--out DIR] [--quick] [--auto] [--only main,fp8,entry,auto] [--reps 20]
                                    [--rounds 10] [--variants "w,s[,min_waves];..."]
``--quick``: one shape per section (a smoke test; no compile-time subprocesses; the entry points on the B = 1
shape only).  ``--auto``: only the auto A/B.  Prints one JSON line per row
and the tables last; writes DIR/bench_decode.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from cutedsl_attn.timing import KernelTimer, copy_bandwidth, paired_ratio, read_bandwidth

SHAPES = [(64, 4096, 16), (64, 4096, 64), (128, 8192, 64), (16, 32768, 64), (1, 8192, 16), (8, 2048, 16)]
#: the entry section's rows: one request (where single_decode_with_kv_cache joins) and the two large batches
ENTRY_SHAPES = [(1, 8192, 16), (64, 4096, 16), (128, 8192, 64)]
ENTRY_TARGET = 1.03  # each entry point's kernel time over the wrapper's on the same problem
HQ, HKV, D = 32, 8, 128
DT = torch.bfloat16
DEV = torch.device("cuda")
SECTIONS = ("main", "fp8", "entry", "auto")
LONG_SLEEP = 2_000_000  # ~1 ms of GPU sleep: longer than cuDNN's ~200 us host path per call

_timer = KernelTimer(DEV)  # allocates its L2-flush buffer on first use
_long_timer = KernelTimer(DEV, sleep_cycles=LONG_SLEEP)


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
    """Median wall time of one call in a loop without synchronisation (the host cost of a call that does not sync)."""
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


def host_time_idle(fn, n=50):
    """Median wall time of one call started on an idle GPU (its own synchronisations wait only for itself)."""
    fn()
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(ts)


def loop_time(fn, n=200):
    """End to end seconds per call of ``n`` calls back to back (host and device), one synchronisation at the end."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


class LaunchTimer:
    """Device time of the CuTe DSL kernel launches inside a call: ``KernelChoice.launch`` wrapped (while
    :meth:`installed`) so that each launch runs after an L2 flush and a GPU sleep covering its own host launch,
    between two CUDA events.  What the call does before its launch (planning, page-table reads, host
    synchronisations) is not counted."""

    def __init__(self, sleep_cycles=400_000):
        self.sleep_cycles = sleep_cycles
        self._flush = None
        self._pairs = []

    @contextlib.contextmanager
    def installed(self):
        from cutedsl_attn import dispatch

        real = dispatch.KernelChoice.launch
        if self._flush is None:
            self._flush = torch.empty(512 << 20, dtype=torch.uint8, device=DEV)

        def launch(choice, args):
            self._flush.zero_()
            torch.cuda._sleep(self.sleep_cycles)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            real(choice, args)
            b.record()
            self._pairs.append((a, b))

        dispatch.KernelChoice.launch = launch
        try:
            yield self
        finally:
            dispatch.KernelChoice.launch = real

    def one(self, fn) -> float:
        """Seconds of the launches of one ``fn()`` call (inside :meth:`installed`)."""
        self._pairs = []
        fn()
        torch.cuda.synchronize()
        if not self._pairs:
            raise RuntimeError("the call launched no CuTe DSL kernel")
        return sum(a.elapsed_time(b) for a, b in self._pairs) * 1e-3

    def interleaved(self, fns: dict, rounds: int) -> dict:
        """``{name: [seconds per round]}``, one call of each per round, the order reversed every other round."""
        names = list(fns)
        for k in names:  # warm-up: compile / load, first-touch allocations
            self.one(fns[k])
            self.one(fns[k])
        out = {k: [] for k in names}
        for r in range(rounds):
            for k in names if r % 2 == 0 else names[::-1]:
                out[k].append(self.one(fns[k]))
        return out


def cudnn_unavailable() -> str | None:
    """Why the cuDNN frontend cannot be used here, or None."""
    try:
        import cudnn  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"import cudnn failed: {e!r}"[:300]
    return None


def relerr(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


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


def planned(ws, indptr, indices, last, ps, *, backend="cute"):
    """Our decode wrapper planned on a bench problem (CSR page table)."""
    import cutedsl_attn as ca

    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
    w.plan(indptr.to(DEV), indices, last.to(DEV), HQ, HKV, D, ps, q_data_type=DT)
    return w


# ----------------------------------------------------------------------------- main section
def main_row(B, L, ps, gen, ws, args, peers, cudnn_reason):
    q, cache, indptr, indices, last = make_problem(B, L, ps, gen)
    kv_bytes = 2 * B * L * HKV * D * 2
    row = dict(batch=B, kv_len=L, page=ps)
    w = planned(ws, indptr, indices, last, ps)
    out = torch.empty_like(q)

    def ours():
        w.run(q, cache, out=out)

    t = timed(ours, reps=args.reps)
    row.update(ours_us=t * 1e6, ours_tbs=kv_bytes / t / 1e12, ours_host_us=host_time(ours) * 1e6)
    ref_o = out.clone()
    for var in [v for v in args.variants.split(";") if v]:
        parts = var.split(",")
        os.environ["CUTEDSL_ATTN_DECODE_TUNE"] = ",".join(parts[:2])
        if len(parts) > 2:
            os.environ["CUTEDSL_ATTN_DECODE_MIN_WAVES"] = parts[2]
        try:
            wv = planned(ws, indptr, indices, last, ps)
        finally:
            os.environ.pop("CUTEDSL_ATTN_DECODE_TUNE")
            os.environ.pop("CUTEDSL_ATTN_DECODE_MIN_WAVES", None)
        ov = wv.run(q, cache)
        row[f"v{var}_relerr"] = relerr(ov, ref_o)
        row[f"v{var}_us"] = timed(lambda: wv.run(q, cache, out=ov), reps=args.reps) * 1e6
    flashinfer, fa4 = peers
    if flashinfer is not None:
        for tc in (True, False):
            name = "fi_tc" if tc else "fi_cc"
            try:
                fw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
                fw.plan(indptr.to(DEV), indices, last.to(DEV), HQ, HKV, D, ps, q_data_type=DT, kv_data_type=DT)
                fo = fw.run(q, cache)
                row[name + "_relerr"] = relerr(fo, ref_o)
                row[name + "_us"] = timed(lambda: fw.run(q, cache), reps=args.reps) * 1e6
                if tc:
                    row["fi_host_us"] = host_time(lambda: fw.run(q, cache)) * 1e6
            except Exception as e:  # noqa: BLE001
                print(name, "failed:", repr(e)[:300])
    if fa4 is not None:
        try:
            npg = -(-L // ps)
            page_table = indices.view(B, npg)
            cu_q = torch.arange(B + 1, dtype=torch.int32, device=DEV)
            seqused = torch.full((B,), L, dtype=torch.int32, device=DEV)
            kc, vc = cache[:, 0], cache[:, 1]

            def fa4_call():
                return fa4(q, kc, vc, cu_seqlens_q=cu_q, max_seqlen_q=1, seqused_k=seqused, page_table=page_table,
                           causal=False)
            fo = fa4_call()
            fo = fo[0] if isinstance(fo, tuple) else fo
            row["fa4_relerr"] = relerr(fo, ref_o)
            row["fa4_us"] = timed(fa4_call, reps=args.reps) * 1e6
        except Exception as e:  # noqa: BLE001
            print("fa4 failed:", repr(e)[:300])
    if cudnn_reason is None:
        try:
            wc = planned(ws, indptr, indices, last, ps, backend="cudnn")  # calls run in turn: one workspace
            out_c = torch.empty_like(q)

            def cudnn():
                wc.run(q, cache, out=out_c)

            cudnn()
            torch.cuda.synchronize()
            row["cudnn_relerr"] = relerr(out_c, ref_o)
            series = _long_timer.interleaved({"ours": ours, "cudnn": cudnn}, args.rounds)
            med = {k: [statistics.median(c) for c in v] for k, v in series.items()}
            row.update(cudnn_us=statistics.median(med["cudnn"]) * 1e6,
                       paired_ours_us=statistics.median(med["ours"]) * 1e6, cudnn_over_ours=paired_ratio(med["cudnn"], med["ours"]), cudnn_host_us=host_time(cudnn) * 1e6)
        except Exception as e:  # noqa: BLE001
            print(f"({B}, {L}, {ps}) cuDNN backend failed: {e!r}"[:400])
    return row


def main_table(rows, rd):
    print("| (B, kv_len, page) | ours us | ours TB/s | % read ceiling | vs FI tc | vs FI cc | vs FA4 | vs cuDNN |"
          " host us ours / FI / cuDNN |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def ratio(k):
            return f"{r[k] / r['ours_us']:.2f}x" if k in r else "n/a"
        cud = f"{r['cudnn_over_ours']:.2f}x" if "cudnn_over_ours" in r else "n/a"
        print(f"| ({r['batch']}, {r['kv_len']}, {r['page']}) | {r['ours_us']:.1f} | {r['ours_tbs']:.2f} | "
              f"{100 * r['ours_tbs'] / rd:.0f}% | {ratio('fi_tc_us')} | {ratio('fi_cc_us')} | {ratio('fa4_us')} | "
              f"{cud} | {r['ours_host_us']:.1f} / {r.get('fi_host_us', float('nan')):.1f} / "
              f"{r.get('cudnn_host_us', float('nan')):.1f} |")
    print("(ratios are peer time / our time: > 1 means we are faster; vs cuDNN: the paired ratio of the wrapper's "
          "cuDNN backend)")


# ----------------------------------------------------------------------------- entry points
def entry_points(q, cache, indices, B, L, ps, ws):
    """``{name: zero-argument call}`` of every decode entry point on one problem (bf16 NHD pool, CSR ``indices``
    of ``B`` requests of ``L`` tokens), and ``{name: its output}``; ``"wrapper"`` is planned once here."""
    import cutedsl_attn as ca
    from cutedsl_attn.attention import prims_ts

    npg = -(-L // ps)
    table = indices.view(B, npg)
    lens = torch.full((B,), L, dtype=torch.int32, device=q.device)
    indptr = torch.arange(B + 1, dtype=torch.int32) * npg
    last = torch.full((B,), L - (npg - 1) * ps, dtype=torch.int32)
    w = ca.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="cute")
    w.plan(indptr.to(q.device), indices, last.to(q.device), HQ, HKV, D, ps, q_data_type=q.dtype)
    outs = {k: torch.empty_like(q) for k in ("wrapper", "trtllm", "xqa", "prims_ts")}
    sem = torch.zeros(1, dtype=torch.int32, device=q.device)
    hnd = cache.transpose(2, 3)  # [pages, 2, Hkv, page_size, D]: the same pool as HND views, no copy
    fns = {
        "wrapper": lambda: w.run(q, cache, out=outs["wrapper"]),
        "trtllm": lambda: ca.trtllm_batch_decode_with_kv_cache(q, cache, ws, table, lens, L, bmm1_scale=D ** -0.5,
                                                               kv_layout="NHD", out=outs["trtllm"]),
        "xqa": lambda: ca.xqa(q.view(B, 1, HQ, D), cache[:, 0], cache[:, 1], table, lens.view(B, 1),
                              outs["xqa"].view(B, 1, HQ, D), ws, sem, HKV, ps, kv_layout="NHD"),
        "prims_ts": lambda: prims_ts.batch_decode_with_paged_kv_cache(q, hnd, table, lens, kv_layout="HND",
                                                                      workspace_buffer=ws, out=outs["prims_ts"]),
    }
    if B == 1:  # the request's tokens as one contiguous KV (a copy made once): page size 1 in the kernel
        kc = cache[indices.long(), 0].reshape(npg * ps, HKV, D)[:L]
        vc = cache[indices.long(), 1].reshape(npg * ps, HKV, D)[:L]
        outs["single"] = torch.empty_like(q)
        fns["single"] = lambda: outs["single"][0].copy_(ca.single_decode_with_kv_cache(q[0], kc, vc))
    return fns, outs


def entry_row(B, L, ps, gen, ws, args):
    q, cache, indptr, indices, last = make_problem(B, L, ps, gen)
    fns, outs = entry_points(q, cache, indices, B, L, ps, ws)
    row = dict(batch=B, kv_len=L, page=ps)
    failed = []
    for k, fn in list(fns.items()):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 -- report the others
            print(f"({B}, {L}, {ps}) {k} failed: {e!r}"[:400])
            failed.append(k)
            fns.pop(k)
    torch.cuda.synchronize()
    if "wrapper" not in fns:
        return row | dict(failed=failed)
    lt = LaunchTimer()
    with lt.installed():
        series = lt.interleaved(fns, args.rounds)
    for k in fns:
        row[f"{k}_kernel_us"] = statistics.median(series[k]) * 1e6
        row[f"{k}_over_wrapper"] = paired_ratio(series[k], series["wrapper"])
        row[f"{k}_host_us"] = host_time_idle(fns[k]) * 1e6
        # events around the whole call (long sleep): the planning after a host synchronisation shows up here
        row[f"{k}_call_us"] = _long_timer(fns[k], reps=args.reps) * 1e6
        row[f"{k}_relerr"] = relerr(outs[k], outs["wrapper"])
    row["failed"] = failed
    return row


ENTRIES = ("wrapper", "trtllm", "xqa", "prims_ts", "single")


def entry_table(rows):
    print("entry points: kernel us (launches only; paired ratio to run()) / call us (events around the call) / "
          "host us per call (idle GPU)")
    print("| (B, kv_len, page) | " + " | ".join(ENTRIES) + f" | worst kernel ratio (<= {ENTRY_TARGET}) |")
    print("|---|" + "---|" * (len(ENTRIES) + 1))
    for r in rows:
        cells = []
        ratios = {k: r[f"{k}_over_wrapper"] for k in ENTRIES if k != "wrapper" and f"{k}_over_wrapper" in r}
        for k in ENTRIES:
            if f"{k}_kernel_us" not in r:
                cells.append("failed" if k in r.get("failed", ()) else "n/a")
                continue
            cells.append(f"{r[f'{k}_kernel_us']:.1f} ({r[f'{k}_over_wrapper']:.3f}x) / {r[f'{k}_call_us']:.1f} / "
                         f"{r[f'{k}_host_us']:.0f}")
        if ratios:
            worst = max(ratios, key=ratios.get)
            verdict = "ok" if ratios[worst] <= ENTRY_TARGET else "OVER"
            cells.append(f"{ratios[worst]:.3f}x ({worst}, {verdict})")
        else:
            cells.append("n/a")
        print(f"| ({r['batch']}, {r['kv_len']}, {r['page']}) | " + " | ".join(cells) + " |")
    print("(single: B = 1 only, its KV contiguous, i.e. page size 1 in the kernel; host us: wall time of one call, "
          "GPU idle)")


# ----------------------------------------------------------------------------- auto A/B
def auto_row(B, L, ps, gen, ws, args, cudnn_reason):
    q, cache, indptr, indices, last = make_problem(B, L, ps, gen)
    row = dict(batch=B, kv_len=L, page=ps)
    fns, outs = {}, {}
    for backend in ("auto", "cute", "cudnn"):
        if backend == "cudnn" and cudnn_reason is not None:
            continue
        w = planned(ws, indptr, indices, last, ps, backend=backend)  # the calls run in turn: one workspace
        if backend == "auto":
            row["auto_picked"] = "cudnn" if w._plan.get("cudnn") is not None else "cute"  # the plan's cuDNN half
        o = outs[backend] = torch.empty_like(q)
        fns[backend] = (lambda w=w, o=o: w.run(q, cache, out=o))
    for k, fn in fns.items():
        fn()
    torch.cuda.synchronize()
    for k in fns:
        row[f"{k}_relerr"] = relerr(outs[k], outs["cute"])
    e2e = {k: [] for k in fns}
    for r in range(args.e2e_rounds):  # loops of each, interleaved
        for k in fns if r % 2 == 0 else list(fns)[::-1]:
            e2e[k].append(loop_time(fns[k], n=200))
    dev = {k: [statistics.median(c) for c in v] for k, v in _long_timer.interleaved(fns, args.rounds).items()}
    for k in fns:
        row[f"{k}_e2e_us"] = statistics.median(e2e[k]) * 1e6
        row[f"{k}_dev_us"] = statistics.median(dev[k]) * 1e6
    others = [k for k in fns if k != "auto"]
    best_e2e = min(others, key=lambda k: row[f"{k}_e2e_us"])
    best_dev = min(others, key=lambda k: row[f"{k}_dev_us"])
    row.update(auto_over_best_e2e=row["auto_e2e_us"] / row[f"{best_e2e}_e2e_us"], best_e2e=best_e2e,
               auto_over_best_dev=paired_ratio(dev["auto"], dev[best_dev]), best_dev=best_dev)
    return row


def auto_table(rows):
    print("backend A/B: end to end us per call (200-call loop) / device us; auto / best of cute and cudnn")
    print("| (B, kv_len, page) | auto took | auto | cute | cudnn | auto / best e2e | auto / best device |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        def c(k):
            return f"{r[f'{k}_e2e_us']:.1f} / {r[f'{k}_dev_us']:.1f}" if f"{k}_e2e_us" in r else "n/a"
        print(f"| ({r['batch']}, {r['kv_len']}, {r['page']}) | {r['auto_picked']} | {c('auto')} | {c('cute')} | "
              f"{c('cudnn')} | {r['auto_over_best_e2e']:.3f}x ({r['best_e2e']}) | "
              f"{r['auto_over_best_dev']:.3f}x ({r['best_dev']}) |")


# ----------------------------------------------------------------------------- driver
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="one shape per section (smoke test)")
    ap.add_argument("--auto", action="store_true", help="only the backend A/B (auto vs cute vs cudnn)")
    ap.add_argument("--only", default="", help=f"comma-separated sections of {SECTIONS} (default: all)")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per median")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved rounds of the paired ratios")
    ap.add_argument("--e2e-rounds", type=int, default=3, help="interleaved 200-call loops of each backend (auto A/B)")
    ap.add_argument("--variants", default="", help="extra 'warps,stages[,min_waves]' configs of our kernel, "
                                                   "e.g. '4,2;8,3,4' (main section)")
    args = ap.parse_args(argv)
    sections = [s.strip() for s in args.only.split(",") if s.strip()] or list(SECTIONS)
    if args.auto:
        sections = ["auto"]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        ap.error(f"--only: unknown sections {bad}; choose from {SECTIONS}")
    args.sections = sections
    return args


def main():
    args = parse_args()
    sys.modules.setdefault("bench_decode", sys.modules[__name__])  # bench_fp8_decode imports these helpers
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    shapes = SHAPES[:1] if args.quick else SHAPES
    cudnn_reason = cudnn_unavailable()
    if cudnn_reason:
        print(f"cuDNN column skipped: {cudnn_reason}")
    gen = torch.Generator().manual_seed(0)
    rd, cp = read_ceiling()
    print(f"read ceiling {rd:.3f} TB/s, copy {cp:.3f} TB/s")
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    res = dict(gpu=torch.cuda.get_device_name(), read_tbs=rd, copy_tbs=cp, cudnn_skipped=cudnn_reason)
    t0 = time.perf_counter()
    if "main" in args.sections:
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
        if not args.quick:
            res["cold_compile_s"], res["warm_load_s"] = compile_times()
        res["main"] = []
        for (B, L, ps) in shapes:
            res["main"].append(main_row(B, L, ps, gen, ws, args, (flashinfer, flash_attn_varlen_func), cudnn_reason))
            print(json.dumps(res["main"][-1]))
            torch.cuda.empty_cache()
        res["main_s"] = time.perf_counter() - t0
    if "fp8" in args.sections:
        from bench_fp8_decode import SHAPES as FP8_SHAPES, fp8_row

        res["fp8"] = []
        for (B, L, ps) in FP8_SHAPES[:1] if args.quick else FP8_SHAPES:
            res["fp8"].append(fp8_row(B, L, ps, gen, reps=args.reps, read_tbs=rd))
            print(json.dumps(res["fp8"][-1]))
            torch.cuda.empty_cache()
    if "entry" in args.sections:
        res["entry"] = []
        # --quick: the one-request shape, where single_decode_with_kv_cache joins the entry points
        for (B, L, ps) in ENTRY_SHAPES[:1] if args.quick else ENTRY_SHAPES:
            res["entry"].append(entry_row(B, L, ps, gen, ws, args))
            print(json.dumps(res["entry"][-1]))
            torch.cuda.empty_cache()
    if "auto" in args.sections:
        res["auto"] = []
        for (B, L, ps) in shapes:
            res["auto"].append(auto_row(B, L, ps, gen, ws, args, cudnn_reason))
            print(json.dumps(res["auto"][-1]))
            torch.cuda.empty_cache()
    res["total_s"] = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_decode.json"), "w") as f:
        json.dump(res, f, indent=1)

    print(f"\nGPU {res['gpu']}; read ceiling {rd:.2f} TB/s (copy {cp:.2f}); {res['total_s']:.0f} s")
    if "cold_compile_s" in res:
        print(f"decode kernel cold compile {res['cold_compile_s']:.2f} s, warm disk load "
              f"{res['warm_load_s'] * 1e3:.1f} ms")
    if cudnn_reason:
        print(f"cuDNN skipped: {cudnn_reason}")
    if res.get("main"):
        main_table(res["main"], rd)
        if args.variants:
            print("variants (warps,stages): us")
            for r in res["main"]:
                print((r["batch"], r["kv_len"], r["page"]),
                      {k: round(v, 1) for k, v in r.items() if k.startswith("v") and k.endswith("_us")})
    if res.get("fp8"):
        from bench_fp8_decode import fp8_table

        fp8_table(res["fp8"], rd)
    if res.get("entry"):
        entry_table(res["entry"])
    if res.get("auto"):
        auto_table(res["auto"])


if __name__ == "__main__":
    main()
