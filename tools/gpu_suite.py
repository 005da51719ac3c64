"""Run the GPU tests (``-m gpu``) of the given files in parallel pytest shards and print one summary.

    python tools/gpu_suite.py --shards 6 --log-dir /tmp/gpu tests/test_prefill_gpu.py tests/test_decode_gpu.py

The test ids are collected once, dealt round-robin to the shards (compiles are CPU-bound, so shards overlap one
another's compiles and launches), each shard runs as its own pytest process with its log in ``--log-dir``, and
the summary lists every failure and error by test id.  Exit status: 0 when every shard passed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time


def collect(files: list[str], extra: list[str]) -> list[str]:
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "gpu", *extra, *files],
                       capture_output=True, text=True)
    ids = [line.strip() for line in r.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        print(r.stdout[-3000:], r.stderr[-3000:])
    return ids


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--shards", type=int, default=6)
    ap.add_argument("--log-dir", default="/tmp/gpu_suite")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds before the shards are stopped")
    ap.add_argument("-k", default=None)
    args = ap.parse_args(argv)
    os.makedirs(args.log_dir, exist_ok=True)
    extra = ["-k", args.k] if args.k else []
    ids = collect(args.files, extra)
    shards = [ids[i:: args.shards] for i in range(args.shards)]
    procs = []
    t0 = time.time()
    for i, shard in enumerate(shards):
        if not shard:
            continue
        log = open(os.path.join(args.log_dir, f"shard{i}.log"), "w")
        p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", *shard],
                             stdout=log, stderr=subprocess.STDOUT)
        procs.append((i, p, log))
    for i, p, log in procs:
        left = max(1.0, args.timeout - (time.time() - t0))
        try:
            p.wait(timeout=left)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()
    passed = failed = skipped = errors = 0
    bad = []
    for i, p, _ in procs:
        text = open(os.path.join(args.log_dir, f"shard{i}.log")).read()
        tail = "\n".join(text.splitlines()[-3:])
        m = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", tail)}
        passed += m.get("passed", 0)
        failed += m.get("failed", 0)
        skipped += m.get("skipped", 0)
        errors += m.get("error", 0) + m.get("errors", 0)
        bad += [line for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))]
        if p.returncode not in (0, 1, 5) and not m:
            bad.append(f"shard {i}: exit {p.returncode} (killed at the timeout?)")
    print(f"{len(ids)} collected in {len(procs)} shards, {time.time() - t0:.0f} s: "
          f"{passed} passed, {failed} failed, {skipped} skipped, {errors} errors")
    for line in bad:
        print(line[:400])
    return 0 if not bad and failed == 0 and errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
