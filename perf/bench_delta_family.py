"""Delta rule family benchmark: our chunked KDA / GDN-2 / Gated DeltaProduct kernels vs fla and cuDNN, same process.

Ours: the portable and the SM90 chunked kernels (and the token-serial recurrent kernel); peers: fla's Triton
``chunk_kda`` / ``chunk_gdn2`` / ``chunk_gated_delta_product`` and cuDNN's graphs.

Rows (bf16 q/k/v, K = V = 128, fp32 gates and state, ``use_qk_l2norm_in_kernel=True``, final state written, no
initial state): ``kda_32h``: KDA, 32 heads, 4 x 8192; ``kda_64h``: KDA, 64 heads, 2 x 16384; ``gdn2_32h``: GDN-2,
32 heads, 4 x 8192; ``gdp_32h``: Gated DeltaProduct (``num_householder = 2``), 32 heads, 4 x 8192.  Per-channel
log gates ``g = -5 sigmoid(x)`` (the safe gate's range with ``lower_bound = -5``), beta / erase / write gates
uniform in (0, 1).  GDP (the expanded timeline of :func:`cutedsl_attn.chunk_gated_delta_product`): q ``[T]``,
k / v / beta ``[T n]`` (token t's updates at rows ``t n .. t n + n - 1``), a scalar linear alpha ``[T, H]`` uniform
in (0.9, 1) (as perf/bench_gdn.py); fla takes the same tensors viewed ``[B, L (n), ...]`` with ``g = log alpha``
(its gate is log space, applied before the token's first update as ours), the state compared transposed (fla's
``[N, H, K, V]``, ours V-major).  GDP on a chunked kernel is GDN on the expanded timeline: its launch
(``cutedsl_attn.dispatch.gdn_launch``) maps the expanded rows in the SM90 kernel (its default,
``Config.expand_rows``) and elsewhere includes the expansion's scratch and copies (``<kernel>_rest_us``: the
time outside prep and main); ``rel_err_launch_vs_api_*`` compares that launch with the public
``chunk_gated_delta_product(backend="cute")`` on the same inputs.

Method (cutedsl_attn.timing.KernelTimer, as perf/bench_gdn.py): a 512 MiB memset flushes the L2 before every
timed call, the GPU sleeps (``--sleep-cycles``, ~2 ms) so the host has queued the whole call, CUDA events
bracket it, median of 10.  Our rows
time the kernel launch (the chunk plan and scratch allocation included; the API's checks are done once,
outside the timed call; GDP: ``gdn_launch`` with ``CUTEDSL_ATTN_GDN_KERNEL`` naming the kernel); fla is timed
through its public function (``FLA_DISABLE_BACKEND_DISPATCH=1``: its own Triton kernels).  Each row also
records the relative error of our output and final state against fla's / cuDNN's and, with both of our kernels,
between them (the same inputs).  Where the time goes: each of our kernels' two
launches (``prep``, ``main``) timed by the torch profiler over ``--profile-reps`` flushed calls
(``<kernel>_prep_us`` / ``<kernel>_main_us``, device time a call).

Usage: python perf/bench_delta_family.py [--rows kda_32h,kda_64h,gdn2_32h,gdp_32h] [--kernel portable|sm90|both]
[--sm90-tiles "128,2;64,2;128,2,1"] [--prep-ctas 2,3] [--fla] [--recurrent] [--cudnn] [--profile-reps 3]
[--out FILE.jsonl] [--dry-run] (``--kernel``: which of our chunked kernels, default both (the SM90 one needs sm_90a);
``--sm90-tiles``: the SM90 kernel's ``tile_v,num_stages[,tma[,prep_rolled]]`` variants (``tma`` 0 when left out; 1: the TMA
loads of ``Tiles.tma``, label suffix ``_tma``; ``prep_rolled`` 1 when left out, another level suffix ``_r<n>``), the
first the headline (default: its default tiles); ``--prep-ctas``: the prep kernel's layouts (``Tiles.prep_ctas``;
default each tiles' own; 3, the compact one, on the KDA rows only; label suffix ``_p<n>`` where not the tiles' own); ``--sm90-tiles`` and ``--prep-ctas`` 3 apply to the KDA / GDN-2 kernel only (GDP runs GDN's
chunked kernels on their default tiles); ``--fla`` times fla (its Triton autotune is the slow part of a run),
``--recurrent`` the recurrent kernel on the same launch arguments, ``--cudnn`` cuDNN's graphs through
``recurrent_kda`` / ``chunk_gated_delta_product(backend="cudnn")`` on the KDA and GDP rows; peers are skipped
cleanly when not importable or declining; ``--dry-run`` builds every row's inputs, our launch arguments and
fla's on the CPU at 128 tokens a sequence and prints their shapes: no GPU, nothing launched).
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
from cutedsl_attn.dispatch import gdn_choice, gdn_launch  # noqa: E402
from cutedsl_attn.dispatch.gdn import GDN_KERNEL_ENV  # noqa: E402
from cutedsl_attn.planning.gdn import (  # noqa: E402
    FLAG_HAS_BETA, FLAG_HAS_G, FLAG_WRITE_STATE, GdnArgs, GdnProblem,
)
from cutedsl_attn.portable import gdn_chunked as gdn_chk  # noqa: E402
from cutedsl_attn.portable import gdn_recurrent as rec  # noqa: E402
from cutedsl_attn.portable import kda_chunked as chk  # noqa: E402
from cutedsl_attn.sm90 import gdn_chunked as gdn90  # noqa: E402
from cutedsl_attn.sm90 import kda_chunked as k90  # noqa: E402
from cutedsl_attn.timing import KernelTimer  # noqa: E402

DEV = torch.device("cuda")
D = 128
ROWS = {"kda_32h": ("kda", 4, 8192, 32), "kda_64h": ("kda", 2, 16384, 64), "gdn2_32h": ("gdn2", 4, 8192, 32),
        "gdp_32h": ("gdp", 4, 8192, 32)}
GDP_N = 2  # num_householder of the GDP row
#: GDP's chunked kernels by label: (CUTEDSL_ATTN_GDN_KERNEL value, module)
GDP_KERNELS = {"portable": ("chunked", gdn_chk), "sm90": ("chunked_sm90", gdn90)}


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
    try:
        from fla.ops.gated_delta_product import chunk_gated_delta_product

        found["gdp"] = chunk_gated_delta_product
    except Exception as e:  # noqa: BLE001
        print("fla chunk_gated_delta_product unavailable:", e)
    return found


def rel(x, y):
    x, y = x.double(), y.double()
    return ((x - y).norm() / max(y.norm().item(), 1e-30)).item()


def make_inputs(op, B, L, H, device=DEV):
    """The row's inputs: q ``[T, H, D]`` (T = B L), k / v ``[T n, H, D]`` bf16 (n = GDP_N for GDP, else 1),
    the gates fp32 (KDA / GDN-2: per-channel log ``g`` ``[T, H, D]``; GDP: linear alpha ``g`` ``[T, H]``),
    ``beta`` ``[T n, H]`` (GDN-2: ``b`` / ``w`` ``[T, H, D]``), ``cu`` int32 ``[B + 1]`` over the real tokens."""
    T = B * L
    n = GDP_N if op == "gdp" else 1
    d = dict(q=torch.randn(T, H, D, device=device).bfloat16(), k=torch.randn(T * n, H, D, device=device).bfloat16(),
             v=torch.randn(T * n, H, D, device=device).bfloat16(),
             cu=torch.arange(0, T + 1, L, device=device, dtype=torch.int32))
    if op == "gdp":
        d["g"] = torch.rand(T, H, device=device) * 0.1 + 0.9
    else:
        d["g"] = -5.0 * torch.sigmoid(torch.randn(T, H, D, device=device))
    if op == "gdn2":
        d["b"], d["w"] = torch.rand(T, H, D, device=device), torch.rand(T, H, D, device=device)
    else:
        d["beta"] = torch.rand(T * n, H, device=device)
    return d


def launch_args(op, d, B, H, arch=None):
    """(problem, GdnArgs, output, final state) of our launch: final state written, no initial state (GDP: the
    arguments of ``chunk_gated_delta_product``'s launch, k / v / beta on the expanded timeline, the rest per real
    token; ``arch`` None: the GPU's)."""
    T, dev = d["q"].shape[0], d["q"].device
    gdp = op == "gdp"
    problem = GdnProblem(dtype="bfloat16", head_dim_k=D, head_dim_v=D, gate_domain="linear" if gdp else "log",
                         use_qk_l2norm=True, gate_per_channel=not gdp, erase_write_gates=op == "gdn2",
                         arch=arch or target_arch(dev), num_householder=GDP_N if gdp else 1)
    beta = torch.cat([d["b"], d["w"]], -1).contiguous() if op == "gdn2" else d["beta"]
    out = torch.empty(T, H, D, device=dev, dtype=torch.bfloat16)
    ht = torch.empty(B, H, D, D, device=dev)
    dummy = torch.empty(1, H, D, D, device=dev)
    i32 = torch.empty(1, device=dev, dtype=torch.int32)
    args = GdnArgs(d["q"], d["k"], d["v"], d["g"], beta, d["cu"], dummy, i32, ht, i32, out, 1.0 / math.sqrt(D),
                   1, 1, 1, FLAG_HAS_G | FLAG_HAS_BETA | FLAG_WRITE_STATE)
    return problem, args, out, ht


def fla_args(op, d, B, L, H):
    """(positional, keyword) arguments of fla's function for the row's inputs, as ``[B, L, ...]`` views of ours
    (no ``cu_seqlens``: equal lengths).  KDA: ``(q, k, v, g, beta)``; GDN-2: ``(q, k, v, g, b, w)``; GDP:
    ``(q, k, v, log alpha, beta)`` with k / v / beta ``[B, L n, ...]`` and ``num_householder`` (fla's gate is log
    space, applied at the token's first update; its q and output per real token, the readout after the last)."""
    n = GDP_N if op == "gdp" else 1
    q = d["q"].view(B, L, H, D)
    k, v = (x.view(B, L * n, H, D) for x in (d["k"], d["v"]))
    kw = dict(scale=1 / math.sqrt(D), output_final_state=True, use_qk_l2norm_in_kernel=True)
    if op == "gdp":
        return (q, k, v, torch.log(d["g"]).view(B, L, H), d["beta"].view(B, L * n, H)), dict(kw, num_householder=n)
    g = d["g"].view(B, L, H, D)
    gates = (d["beta"].view(B, L, H),) if op == "kda" else (d["b"].view(B, L, H, D), d["w"].view(B, L, H, D))
    return (q, k, v, g, *gates), kw


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
    """[(label, module, config)] of our chunked kernels to time: ``kernel`` in portable / sm90 / both; each tiles'
    own prep layout, or each layout of ``prep_ctas`` the problem admits (GDN-2 takes 2 only; label suffix
    ``_p<n>`` where it is not the tiles' own)."""
    out = []

    def layouts(t):
        pcs = [pc for pc in prep_ctas if pc == 2 or not problem.erase_write_gates]
        return pcs or [t.prep_ctas]

    if kernel in ("portable", "both"):
        base = chk.default_tiles(problem, num_sms=132, chains=B * H)
        for pc in layouts(base):
            out.append(("portable" + ("" if pc == base.prep_ctas else f"_p{pc}"), chk,
                        chk.Config(problem, dataclasses.replace(base, prep_ctas=pc))))
    if kernel in ("sm90", "both"):
        if k90.unsupported_reason(problem) is not None:
            print(f"sm90 skipped: {k90.unsupported_reason(problem)}")
        else:
            tiles = sm90_tiles or [k90.default_tiles(problem, num_sms=132, chains=B * H)]
            for i, t in enumerate(tiles):
                for pc in layouts(t):
                    label = (("sm90" if i == 0 else f"sm90_{t.tile_v}x{t.num_stages}" + ("_tma" if t.tma else "")
                              + ("" if t.prep_rolled == 1 else f"_r{t.prep_rolled}"))
                             + ("" if pc == t.prep_ctas else f"_p{pc}"))
                    out.append((label, k90, k90.Config(problem, dataclasses.replace(t, prep_ctas=pc))))
    return out


def _forced(value, fn):
    """``fn`` run with ``CUTEDSL_ATTN_GDN_KERNEL = value`` (the dispatch reads it at each launch)."""
    def call():
        old = os.environ.get(GDN_KERNEL_ENV)
        os.environ[GDN_KERNEL_ENV] = value
        try:
            return fn()
        finally:
            if old is None:
                os.environ.pop(GDN_KERNEL_ENV, None)
            else:
                os.environ[GDN_KERNEL_ENV] = old
    return call


def _gdp_calls(kernel, problem, args, B, H):
    """[(label, kernel description, call)] of GDP's launches: ``gdn_launch`` (GDN on ``T n`` rows: the SM90 kernel
    maps them itself, the portable one runs the expansion) with the portable / SM90 chunked kernel forced, as
    ``kernel`` asks and the arch serves."""
    out = []
    for label, (value, mod) in GDP_KERNELS.items():
        if kernel not in (label, "both"):
            continue
        reason = mod.unsupported_reason(dataclasses.replace(problem, num_householder=1))
        if reason is not None:
            print(f"gdp {label} skipped: {reason}")
            continue
        _, cfg = _forced(value, lambda: gdn_choice(problem, chains=B * H))()
        out.append((label, f"{mod.NAME} {cfg.tiles} on {GDP_N} x T rows",
                    _forced(value, lambda: gdn_launch(problem, args))))
    return out


def _kernel_calls(kernel, problem, args, B, H, sm90_tiles, prep_ctas):
    """[(label, kernel description, call)] of our chunked launches for the row."""
    if problem.num_householder > 1:
        return _gdp_calls(kernel, problem, args, B, H)
    out = []
    for label, mod, cfg in _variants(kernel, problem, B, H, sm90_tiles, prep_ctas):
        fn = get_compiled(mod.NAME, cfg, mod.compile)

        def call(mod=mod, fn=fn, cfg=cfg):
            mod.launch(fn, cfg, args)

        out.append((label, f"{mod.NAME} {cfg.tiles}", call))
    return out


def bench_row(timer, name, found, recurrent, cudnn, kernel="both", sm90_tiles=None, profile_reps=3,
              prep_ctas=()):
    op, B, L, H = ROWS[name]
    d = make_inputs(op, B, L, H)
    problem, args, out, ht = launch_args(op, d, B, H)
    row = dict(row=name, op=op, B=B, L=L, heads=H)
    results = {}
    for label, desc, call in _kernel_calls(kernel, problem, args, B, H, sm90_tiles, prep_ctas):
        row[f"{label}_kernel"] = desc
        row[f"{label}_ms"] = timer(call, reps=10) * 1e3
        if profile_reps > 0:
            split = launch_split(timer, call, profile_reps)
            for part, us in split.items():
                row[f"{label}_{part}_us"] = us
            if op == "gdp" and split:  # the expansion's scratch and copies around the two kernels
                row[f"{label}_rest_us"] = row[f"{label}_ms"] * 1e3 - sum(split.values())
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
    if op == "gdp":  # the launch above is the public function's: the same inputs, the same result
        import cutedsl_attn

        o_api, s_api = cutedsl_attn.chunk_gated_delta_product(
            d["q"], d["k"], d["v"], d["g"], d["beta"], num_householder=GDP_N, scale=1 / math.sqrt(D),
            output_final_state=True, cu_seqlens=d["cu"], use_qk_l2norm_in_kernel=True, backend="cute")
        row["rel_err_launch_vs_api_o"] = rel(o_ours, o_api)
        row["rel_err_launch_vs_api_state"] = rel(s_ours, s_api)
    if op in found:
        fla_pos, fla_kw = fla_args(op, d, B, L, H)

        def fla_call():
            return _call_filtered(found[op], *fla_pos, **fla_kw)

        try:
            of, sf = fla_call()
            row["fla_ms"] = timer(fla_call, reps=10) * 1e3
            row["rel_err_vs_fla_o"] = rel(o_ours.view(of.shape), of)
            row["rel_err_vs_fla_state"] = rel(s_ours, sf.transpose(-1, -2))
            row["speedup_vs_fla"] = row["fla_ms"] / row["ours_ms"]
        except Exception as e:  # noqa: BLE001
            print(f"fla row {name} failed:", e)
    if op in ("kda", "gdp") and cudnn:  # cuDNN's graphs through our public API (KDA: its SM90 engine on Hopper)
        from cutedsl_attn.api import delta_family as api

        flat = [x.unsqueeze(0) for x in (d["q"], d["k"], d["v"], d["g"], d["beta"])]

        def cudnn_call():
            if op == "gdp":
                return api.chunk_gated_delta_product(
                    *flat, num_householder=GDP_N, scale=1 / math.sqrt(D), output_final_state=True,
                    cu_seqlens=d["cu"], use_qk_l2norm_in_kernel=True, backend="cudnn")
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


def dry_run(names, L=128):
    """Every row's inputs, our launch arguments and fla's built on the CPU at ``L`` tokens a sequence (the row's
    B and heads): their shapes printed, nothing launched."""
    for name in names:
        op, B, _, H = ROWS[name]
        d = make_inputs(op, B, L, H, device=torch.device("cpu"))
        problem, args, _, ht = launch_args(op, d, B, H, arch=os.environ.get("CUTEDSL_ATTN_ARCH") or "sm_90a")
        fla_pos, fla_kw = fla_args(op, d, B, L, H)
        ours = {f: tuple(getattr(args, f).shape) for f in ("q", "k", "v", "g", "beta", "cu_seqlens", "output")}
        print(f"{name}: ours {ours}, final state {tuple(ht.shape)}, num_householder {problem.num_householder}, "
              f"gate_domain {problem.gate_domain}")
        extra = {k: v for k, v in fla_kw.items() if k != "scale"}
        print(f"{name}: fla {[tuple(x.shape) for x in fla_pos]} {extra}")


def table(rows):
    cols = ["row", "op", "B", "L", "heads", "ours_ms"]
    for r in rows:  # every kernel variant's total and its prep / main split, in the order they ran
        cols += [c for c in r if (c.endswith("_ms") or c.endswith("_us")) and c not in cols
                 and c.split("_")[0] in ("portable", "sm90")]
    cols += ["recurrent_ms", "fla_ms", "speedup_vs_fla", "cudnn_ms", "speedup_vs_cudnn", "rel_err_vs_fla_o",
             "rel_err_vs_fla_state", "rel_err_vs_cudnn_o", "rel_err_launch_vs_api_o"]
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
                    help='SM90 kernel tile variants "tile_v,num_stages[,tma[,prep_rolled]];..." (tma 0, prep_rolled 1 '
                         "when left out; the first is the headline; default: its default tiles)")
    ap.add_argument("--prep-ctas", default="",
                    help="prep layouts to time, by CTAs an SM (2; 3: the compact KDA layout; default: each "
                         "tiles' own, 3 for bf16 KDA and 2 for GDN-2)")
    ap.add_argument("--sleep-cycles", type=int, default=4_000_000,
                    help="GPU sleep before each timed call (~2 ms: a whole multi-launch call, ours or a peer's, is "
                         "queued before it starts, so the host's launch cost is outside the events)")
    ap.add_argument("--profile-reps", type=int, default=3,
                    help="flushed calls the torch profiler splits into prep / main time (0: no split)")
    ap.add_argument("--fla", action="store_true", help="also time fla's Triton kernels (slow: their autotune)")
    ap.add_argument("--recurrent", action="store_true", help="also time the token-serial recurrent kernel")
    ap.add_argument("--cudnn", action="store_true",
                    help="also time cuDNN's graphs (backend='cudnn') on the KDA and GDP rows")
    ap.add_argument("--out", default=None, help="append the JSON lines to this file")
    ap.add_argument("--dry-run", action="store_true",
                    help="build the rows' inputs and our / fla's arguments on the CPU (small L), print the shapes")
    a = ap.parse_args()
    names = [n.strip() for n in a.rows.split(",") if n.strip()]
    for n in names:
        if n not in ROWS:
            raise SystemExit(f"unknown row {n!r}; rows: {', '.join(ROWS)}")
    if a.dry_run:
        dry_run(names)
        return
    sm90_tiles = []
    for item in (x.strip() for x in a.sm90_tiles.split(";")):
        if item:
            vals = [int(x) for x in item.split(",")]
            if len(vals) not in (2, 3, 4):
                raise SystemExit(f"--sm90-tiles item {item!r}: want tile_v,num_stages[,tma[,prep_rolled]]")
            tv, st, tma, rolled = vals + [0, 1][len(vals) - 2:]  # tma 0, prep_rolled 1 when left out
            sm90_tiles.append(k90.Tiles(tile_v=tv, num_stages=st, tma=tma, prep_rolled=rolled))
    prep_ctas = tuple(int(x) for x in a.prep_ctas.split(",") if x.strip())
    torch.manual_seed(0)
    timer = KernelTimer(sleep_cycles=a.sleep_cycles)
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
