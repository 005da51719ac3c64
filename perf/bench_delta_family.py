"""Per-channel-decay delta rule benchmark: our chunked KDA / GDN-2 kernels vs fla and cuDNN, same process.

Ours: the portable and the SM90 chunked kernels (and the token-serial recurrent kernel); peers: fla's Triton
``chunk_kda`` / ``chunk_gdn2`` and cuDNN's KDA graph.

Rows (bf16 q/k/v, K = V = 128, fp32 per-channel log gates and state, ``use_qk_l2norm_in_kernel=True``, final
state written, no initial state): ``kda_32h``: KDA, 32 heads, 4 x 8192; ``kda_64h``: KDA, 64 heads, 2 x 16384;
``gdn2_32h``: GDN-2, 32 heads, 4 x 8192.  Gates ``g = -5 sigmoid(x)`` (the safe gate's range with
``lower_bound = -5``), beta / erase / write gates uniform in (0, 1).

Method (cutedsl_attn.timing.KernelTimer, as perf/bench_gdn.py): a 512 MiB memset flushes the L2 before every
timed call, the GPU sleeps so the host has queued the call, CUDA events bracket it, median of 10.  Our rows
time the kernel launch (the chunk plan and scratch allocation included; the API's checks are done once,
outside the timed call); fla is timed through its public function (``FLA_DISABLE_BACKEND_DISPATCH=1``: its own
Triton kernels).  Each row also records the relative error of our output and final state against fla's / cuDNN's
and, with both of our kernels, between them (the same inputs).  Where the time goes: each of our kernels' two
launches (``prep``, ``main``) timed by the torch profiler over ``--profile-reps`` flushed calls
(``<kernel>_prep_us`` / ``<kernel>_main_us``, device time a call).

Usage: python perf/bench_delta_family.py [--rows kda_32h,kda_64h,gdn2_32h] [--kernel portable|sm90|both]
[--sm90-tiles "128,2;64,2;128,2,1"] [--prep-ctas 2,3] [--fla] [--recurrent] [--cudnn] [--profile-reps 3]
[--out FILE.jsonl] (``--kernel``: which of our chunked kernels, default both (the SM90 one needs sm_90a);
``--sm90-tiles``: the SM90 kernel's ``tile_v,num_stages[,tma]`` variants (``tma`` 0 when left out; 1: the TMA
loads of ``Tiles.tma``, label suffix ``_tma``), the first the headline (default: its default tiles);
``--prep-ctas``: the prep kernel's layouts (``Tiles.prep_ctas``; 3, the compact one, on the KDA rows only, label
suffix ``_p3``); ``--fla`` times fla (its Triton autotune is the slow part of a run),
``--recurrent`` the recurrent kernel on the same launch arguments, ``--cudnn`` cuDNN's KDA graph through
``recurrent_kda(backend="cudnn")`` on the KDA rows; peers are skipped cleanly when not importable or declining).
Prints a Markdown table and one JSON line a row.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os

import torch

os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")  # fla's own Triton kernels, not FlashKDA / FlashQLA

from cutedsl_attn.compile import get_compiled, target_arch  # noqa: E402
from cutedsl_attn.planning.gdn import (  # noqa: E402
    FLAG_HAS_BETA, FLAG_HAS_G, FLAG_WRITE_STATE, GdnArgs, GdnProblem,
)
from cutedsl_attn.portable import gdn_recurrent as rec  # noqa: E402
from cutedsl_attn.portable import kda_chunked as chk  # noqa: E402
from cutedsl_attn.sm90 import kda_chunked as k90  # noqa: E402
from cutedsl_attn.timing import KernelTimer  # noqa: E402

DEV = torch.device("cuda")
D = 128
ROWS = {"kda_32h": ("kda", 4, 8192, 32), "kda_64h": ("kda", 2, 16384, 64), "gdn2_32h": ("gdn2", 4, 8192, 32)}


def fla_peers():
    found = {}
    try:
        from fla.ops.kda import chunk_kda

        found["kda"] = chunk_kda
    except Exception as e:  # noqa: BLE001
        print("fla chunk_kda unavailable:", e)
    try:
        from fla.ops.gdn2 import chunk_gdn2

        found["gdn2"] = chunk_gdn2
    except Exception as e:  # noqa: BLE001
        print("fla chunk_gdn2 unavailable:", e)
    return found


def rel(x, y):
    x, y = x.double(), y.double()
    return ((x - y).norm() / max(y.norm().item(), 1e-30)).item()


def make_inputs(op, B, L, H):
    T = B * L
    d = dict(q=torch.randn(T, H, D, device=DEV).bfloat16(), k=torch.randn(T, H, D, device=DEV).bfloat16(),
             v=torch.randn(T, H, D, device=DEV).bfloat16(),
             g=-5.0 * torch.sigmoid(torch.randn(T, H, D, device=DEV)),
             cu=torch.arange(0, T + 1, L, device=DEV, dtype=torch.int32))
    if op == "gdn2":
        d["b"], d["w"] = torch.rand(T, H, D, device=DEV), torch.rand(T, H, D, device=DEV)
    else:
        d["beta"] = torch.rand(T, H, device=DEV)
    return d


def launch_args(op, d, B, H):
    """(problem, GdnArgs, output, final state) of our launch: final state written, no initial state."""
    T = d["q"].shape[0]
    problem = GdnProblem(dtype="bfloat16", head_dim_k=D, head_dim_v=D, gate_domain="log", use_qk_l2norm=True,
                         gate_per_channel=True, erase_write_gates=op == "gdn2", arch=target_arch(DEV))
    beta = torch.cat([d["b"], d["w"]], -1).contiguous() if op == "gdn2" else d["beta"]
    out = torch.empty(T, H, D, device=DEV, dtype=torch.bfloat16)
    ht = torch.empty(B, H, D, D, device=DEV)
    dummy = torch.empty(1, H, D, D, device=DEV)
    i32 = torch.empty(1, device=DEV, dtype=torch.int32)
    args = GdnArgs(d["q"], d["k"], d["v"], d["g"], beta, d["cu"], dummy, i32, ht, i32, out, 1.0 / math.sqrt(D),
                   1, 1, 1, FLAG_HAS_G | FLAG_HAS_BETA | FLAG_WRITE_STATE)
    return problem, args, out, ht


def _call_filtered(fn, *pos, **kw):
    """``fn(*pos, **kw)`` with the keywords ``fn`` does not take left out (fla's signatures vary by version)."""
    params = inspect.signature(fn).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        kw = {k: v for k, v in kw.items() if k in params}
    return fn(*pos, **kw)


def launch_split(timer, launch, reps):
    """Device microseconds a call of each of the launch's kernels (``{"prep": us, "main": us}``), from the torch
    profiler over ``reps`` calls, the L2 flushed before each (as the timer does)."""
    from torch.profiler import ProfilerActivity, profile

    launch()
    torch.cuda.synchronize()
    flush = getattr(timer, "_flush", None)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if flush is not None:
                flush.zero_()
            launch()
        torch.cuda.synchronize()
    out = {}
    for evt in prof.key_averages():
        total = getattr(evt, "device_time_total", None)
        if total is None:
            total = getattr(evt, "cuda_time_total", 0.0)
        for part in ("prep", "main"):
            if f"kernel_cutlass_{part}_" in evt.key:
                out[part] = out.get(part, 0.0) + total / reps
    return out


def _variants(kernel, problem, B, H, sm90_tiles, prep_ctas):
    """[(label, module, config)] of our chunked kernels to time: ``kernel`` in portable / sm90 / both, each prep
    layout of ``prep_ctas`` the problem admits (label suffix ``_p3`` for the compact one; GDN-2 takes 2 only)."""
    out = []
    layouts = [pc for pc in prep_ctas if pc == 2 or not problem.erase_write_gates]
    if kernel in ("portable", "both"):
        base = chk.default_tiles(problem, num_sms=132, chains=B * H)
        for pc in layouts:
            out.append(("portable" + ("" if pc == 2 else f"_p{pc}"), chk,
                        chk.Config(problem, dataclasses.replace(base, prep_ctas=pc))))
    if kernel in ("sm90", "both"):
        if k90.unsupported_reason(problem) is not None:
            print(f"sm90 skipped: {k90.unsupported_reason(problem)}")
        else:
            tiles = sm90_tiles or [k90.default_tiles(problem, num_sms=132, chains=B * H)]
            for i, t in enumerate(tiles):
                for pc in layouts:
                    label = (("sm90" if i == 0 else f"sm90_{t.tile_v}x{t.num_stages}" + ("_tma" if t.tma else ""))
                             + ("" if pc == 2 else f"_p{pc}"))
                    out.append((label, k90, k90.Config(problem, dataclasses.replace(t, prep_ctas=pc))))
    return out


def bench_row(timer, name, found, recurrent, cudnn, kernel="both", sm90_tiles=None, profile_reps=3,
              prep_ctas=(2, 3)):
    op, B, L, H = ROWS[name]
    d = make_inputs(op, B, L, H)
    problem, args, out, ht = launch_args(op, d, B, H)
    row = dict(row=name, op=op, B=B, L=L, heads=H)
    results = {}
    for label, mod, cfg in _variants(kernel, problem, B, H, sm90_tiles, prep_ctas):
        fn = get_compiled(mod.NAME, cfg, mod.compile)

        def call(mod=mod, fn=fn, cfg=cfg):
            mod.launch(fn, cfg, args)

        row[f"{label}_kernel"] = f"{mod.NAME} {cfg.tiles}"
        row[f"{label}_ms"] = timer(call, reps=10) * 1e3
        if profile_reps > 0:
            for part, us in launch_split(timer, call, profile_reps).items():
                row[f"{label}_{part}_us"] = us
        out.fill_(float("nan"))
        ht.fill_(float("nan"))
        call()
        torch.cuda.synchronize()
        results[label] = (out.clone(), ht.clone())
    if not results:
        raise SystemExit("no kernel of --kernel serves this GPU")
    head = "sm90" if "sm90" in results else "portable"
    row["ours_ms"] = row[f"{head}_ms"]
    row["kernel"] = row[f"{head}_kernel"]
    o_ours, s_ours = results[head]
    for label, (o2, s2) in results.items():
        if label != head:
            row[f"rel_err_{label}_vs_{head}_o"] = rel(o2, o_ours)
            row[f"rel_err_{label}_vs_{head}_state"] = rel(s2, s_ours)
    if recurrent:
        c2 = rec.Config(problem, rec.default_tiles(problem, num_sms=132))
        f2 = get_compiled(rec.NAME, c2, rec.compile)
        row["recurrent_ms"] = timer(lambda: rec.launch(f2, c2, args), reps=3) * 1e3
        rec.launch(f2, c2, args)
        torch.cuda.synchronize()
        row["rel_err_chunked_vs_recurrent_o"] = rel(o_ours, out)
        row["rel_err_chunked_vs_recurrent_state"] = rel(s_ours, ht)
    if op in found:
        q, k, v, g = (x.view(B, L, *x.shape[1:]) for x in (d["q"], d["k"], d["v"], d["g"]))
        gates = (d["beta"].view(B, L, H),) if op == "kda" else (d["b"].view(B, L, H, D), d["w"].view(B, L, H, D))

        def fla_call():
            return _call_filtered(found[op], q, k, v, g, *gates, scale=1 / math.sqrt(D), output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)

        try:
            of, sf = fla_call()
            row["fla_ms"] = timer(fla_call, reps=10) * 1e3
            row["rel_err_vs_fla_o"] = rel(o_ours.view(of.shape), of)
            row["rel_err_vs_fla_state"] = rel(s_ours, sf.transpose(-1, -2))
            row["speedup_vs_fla"] = row["fla_ms"] / row["ours_ms"]
        except Exception as e:  # noqa: BLE001
            print(f"fla row {name} failed:", e)
    if op == "kda" and cudnn:  # cuDNN's KDA graph through our public API (its SM90 engine on Hopper)
        from cutedsl_attn.api import delta_family as api

        flat = [x.unsqueeze(0) for x in (d["q"], d["k"], d["v"], d["g"], d["beta"])]

        def cudnn_call():
            return api.recurrent_kda(*flat, cu_seqlens=d["cu"], output_final_state=True, backend="cudnn")

        try:
            oc, sc = cudnn_call()
            row["cudnn_ms"] = timer(cudnn_call, reps=10) * 1e3
            row["rel_err_vs_cudnn_o"] = rel(o_ours.view(oc.shape), oc)
            row["rel_err_vs_cudnn_state"] = rel(s_ours, sc)
            row["speedup_vs_cudnn"] = row["cudnn_ms"] / row["ours_ms"]
        except Exception as e:  # noqa: BLE001
            print(f"cudnn row {name} failed:", e)
    print(json.dumps(row), flush=True)
    return row


def table(rows):
    cols = ["row", "op", "B", "L", "heads", "ours_ms"]
    for r in rows:  # every kernel variant's total and its prep / main split, in the order they ran
        cols += [c for c in r if (c.endswith("_ms") or c.endswith("_us")) and c not in cols
                 and c.split("_")[0] in ("portable", "sm90")]
    cols += ["recurrent_ms", "fla_ms", "speedup_vs_fla", "cudnn_ms", "speedup_vs_cudnn", "rel_err_vs_fla_o",
             "rel_err_vs_fla_state", "rel_err_vs_cudnn_o"]
    cols += sorted({c for r in rows for c in r if c.startswith("rel_err_") and "_vs_sm90" in c or
                    c.startswith("rel_err_") and "_vs_portable" in c})
    cols += ["kernel"]
    cols = [c for c in cols if any(c in r for r in rows)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            x = r.get(c, "")
            cells.append(f"{x:.4g}" if isinstance(x, float) else str(x))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows of " + ", ".join(ROWS))
    ap.add_argument("--kernel", default="both", choices=["portable", "sm90", "both"],
                    help="which of our chunked kernels to time (both: the same inputs, their outputs compared)")
    ap.add_argument("--sm90-tiles", default="",
                    help='SM90 kernel tile variants "tile_v,num_stages[,tma];..." (tma 0 when left out; the first '
                         "is the headline; default: its default tiles)")
    ap.add_argument("--prep-ctas", default="2,3",
                    help="prep layouts to time, by CTAs an SM (2: the default; 3: the compact KDA layout)")
    ap.add_argument("--profile-reps", type=int, default=3,
                    help="flushed calls the torch profiler splits into prep / main time (0: no split)")
    ap.add_argument("--fla", action="store_true", help="also time fla's Triton kernels (slow: their autotune)")
    ap.add_argument("--recurrent", action="store_true", help="also time the token-serial recurrent kernel")
    ap.add_argument("--cudnn", action="store_true", help="also time cuDNN's KDA graph (backend='cudnn') on KDA rows")
    ap.add_argument("--out", default=None, help="append the JSON lines to this file")
    a = ap.parse_args()
    names = [n.strip() for n in a.rows.split(",") if n.strip()]
    for n in names:
        if n not in ROWS:
            raise SystemExit(f"unknown row {n!r}; rows: {', '.join(ROWS)}")
    sm90_tiles = []
    for item in (x.strip() for x in a.sm90_tiles.split(";")):
        if item:
            vals = [int(x) for x in item.split(",")]
            if len(vals) not in (2, 3):
                raise SystemExit(f"--sm90-tiles item {item!r}: want tile_v,num_stages[,tma]")
            tv, st, tma = (*vals, 0)[:3]
            sm90_tiles.append(k90.Tiles(tile_v=tv, num_stages=st, tma=tma))
    prep_ctas = tuple(int(x) for x in a.prep_ctas.split(",") if x.strip())
    if 2 not in prep_ctas:
        raise SystemExit("--prep-ctas must include 2 (the default layout: the headline and the GDN-2 rows)")
    torch.manual_seed(0)
    timer = KernelTimer()
    found = fla_peers() if a.fla else {}
    rows = []
    for n in names:
        rows.append(bench_row(timer, n, found, a.recurrent, a.cudnn, a.kernel, sm90_tiles, a.profile_reps,
                              prep_ctas))
        torch.cuda.empty_cache()
    print()
    print(table(rows))
    if a.out:
        with open(a.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
