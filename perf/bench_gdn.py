"""Gated delta rule benchmark: cutedsl_attn's chunked prefill kernel (and the recurrent one) vs fla (Triton) and
FlashInfer, same process.

Prefill rows (bf16 q/k/v, K = V = 128, fp32 gates and state, ``use_qk_l2norm_in_kernel=True``, final state
requested): (a) 32/32 heads, 1 x 32768; (b) 16 q/k / 32 v heads, 4 x 8192; (c) 16/16 heads, 8 x 8192;
(d) 2 q/k / 8 v heads, 1 x 65536 (TP8-sized); (e) 16/16 heads, 64 sequences of 128..8192 tokens (seeded).
Decode rows: B = 64 / 128 / 256 sequences, 32 heads, K = V = 128, fp32 state updated per step.

Method (cutedsl_attn.timing.KernelTimer): a 512 MiB memset flushes the L2 before every timed call, the GPU
sleeps so the host has queued the call, CUDA events bracket it, median of 10.  Our rows time the kernel
launch (the chunk plan and scratch allocation included; the API's checks are done once, outside the timed
call); peers are timed through their public functions.  The HBM bound is the bytes the op must move (q, k, v,
gates, o, the final state) at the measured read bandwidth.  ``--recurrent`` also times the token-serial
recurrent kernel (the decode kernel) on the prefill rows.

Usage: python perf/bench_gdn.py [--quick] [--out DIR] [--tiles "tv,warps,prefetch,lanes;..."]
[--sm90 ["tv,stages[,tma[,persistent[,prep]]];..."]] [--cp ["P,..."]] [--cp-tiles "tv,..."] [--cp-rounds N]
[--no-peers] [--gdp] [--fused "p,..."]
(peers are skipped cleanly when not importable; ``--tiles`` also times those recurrent-kernel tiles on the
prefill rows, ``ours_<tiles>_ms``, next to the default's; ``--sm90`` times the SM90 chunked kernel (auto's
choice on sm_90a), its default tiles or those given (``tma``, ``persistent`` and ``prep`` 0 when left out;
``prep`` 1: the SM90 prep on wgmma), ``sm90_<tile_v>x<stages>[_tma][_p<persistent>][_prep90]_ms``, and its
output's error against the default's).
``ours_ms`` is the plain launch (one chain a sequence and head); every row also records the segment count
``use_cp="auto"`` takes (``cp_auto_segments``, 1: the plain launch).  ``--cp`` times the context-parallel path
(one prep shared by three main-kernel runs) with the segments the forced path plans, or each count given,
interleaved with the plain launch (``plain_interleaved_ms``, ``cp<P>_ms``: round medians of ``--cp-rounds``
rounds, a long GPU sleep so the host has queued the path's launches and its chain), its error against the plain
launch (output and final state) and its device time by phase from the torch profiler (``cp<P>_phases_us``:
prep, the transition / offset / outputs runs, the rest: chain, copies, fills); ``--cp-tiles`` repeats the CP
timings with each main-kernel ``tile_v`` forced (``cp<P>_tv<tile_v>_ms``, ``CUTEDSL_ATTN_GDN_TUNE``).
``--fused`` times the opt-in fused SM90 kernel
(``sm90.gdn_fused``) with each ``prep_warpgroups`` given (``fused_p<p>_ms``, its error against the default's).
``--no-peers`` skips fla and FlashInfer (no Triton / JIT compile time).  ``--gdp`` adds the Gated DeltaProduct
row (f): n = 2, 32 heads, 4 x 8192, against fla's ``chunk_gated_delta_product`` (Triton) when importable.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics

import torch

os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")  # fla's own Triton kernels, not FlashQLA

from cutedsl_attn.api import gdn as api  # noqa: E402
from cutedsl_attn.dispatch import gdn_choice, gdn_launch  # noqa: E402
from cutedsl_attn.dispatch.gdn import GDN_TUNE_ENV, gdn_cp_segments, gdn_launch_cp  # noqa: E402
from cutedsl_attn.planning import gdn as pg  # noqa: E402
from cutedsl_attn.compile import get_compiled  # noqa: E402
from cutedsl_attn.portable import gdn_chunked as chk  # noqa: E402
from cutedsl_attn.portable import gdn_recurrent as rec  # noqa: E402
from cutedsl_attn.sm90 import gdn_chunked as chk90  # noqa: E402
from cutedsl_attn.sm90 import gdn_fused as fused90  # noqa: E402
from cutedsl_attn.timing import KernelTimer, read_bandwidth  # noqa: E402

DEV = torch.device("cuda")
D = 128
PREFILL = {"a": (1, 32768, 32, 32), "b": (4, 8192, 16, 32), "c": (8, 8192, 16, 16), "d": (1, 65536, 2, 8),
           "e": (64, 0, 16, 16)}  # B, L (0: varlen 128..8192), H_qk, H_v
DECODE_B = (64, 128, 256)
DECODE_H = 32


def peers():
    found = {}
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

        found["fla"] = fla_chunk
    except Exception as e:  # noqa: BLE001
        print("fla chunk_gated_delta_rule unavailable:", e)
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_rec

        found["fla_recurrent"] = fla_rec
    except Exception as e:  # noqa: BLE001
        print("fla fused_recurrent_gated_delta_rule unavailable:", e)
    try:
        from flashinfer.gdn_prefill import chunk_gated_delta_rule as fi_chunk

        found["flashinfer"] = fi_chunk
    except Exception as e:  # noqa: BLE001
        print("flashinfer.gdn_prefill unavailable:", e)
    return found


def rel(x, y):
    x, y = x.double(), y.double()
    return ((x - y).norm() / max(y.norm().item(), 1e-30)).item()


def row_lens(B, L):
    if L:
        return [L] * B
    g = torch.Generator().manual_seed(1234)
    return torch.randint(128, 8193, (B,), generator=g).tolist()


def prefill_inputs(B, L, hqk, hv):
    lens = row_lens(B, L)
    T = sum(lens)
    q = torch.randn(T, hqk, D, device=DEV).bfloat16()
    k = torch.randn(T, hqk, D, device=DEV).bfloat16()
    v = torch.randn(T, hv, D, device=DEV).bfloat16()
    g = torch.rand(T, hv, device=DEV) * 0.1 + 0.9  # linear alpha
    beta = torch.rand(T, hv, device=DEV)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=DEV, dtype=torch.int32)
    return q, k, v, g, beta, cu


def prefill_bytes(B, L, hqk, hv):
    T = sum(row_lens(B, L))
    return T * (2 * hqk * D * 2 + hv * D * 2 + hv * D * 2 + 2 * hv * 4) + B * hv * D * D * 4


def _tuned(tune: str, fn):
    """``fn`` run with ``CUTEDSL_ATTN_GDN_TUNE=tune`` ("" : the default tiles), the variable restored after."""
    def call():
        old = os.environ.get(GDN_TUNE_ENV)
        os.environ[GDN_TUNE_ENV] = tune
        try:
            fn()
        finally:
            if old is None:
                del os.environ[GDN_TUNE_ENV]
            else:
                os.environ[GDN_TUNE_ENV] = old
    return call


def cp_phases(fn, reps=3):
    """Device microseconds a call of ``fn`` spends by phase of the context-parallel path (torch profiler): the
    prep, the transition / offset / outputs main-kernel runs (in launch order), the rest (chain, fills, copies)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    out = dict(prep=0.0, transition=0.0, offset=0.0, outputs=0.0, rest=0.0)
    mains = 0
    for e in kernels:
        us = e.time_range.elapsed_us()
        if e.name.startswith("kernel_cutlass_prep"):
            out["prep"] += us
        elif e.name.startswith("kernel_cutlass_main"):
            out[("transition", "offset", "outputs")[mains % 3]] += us
            mains += 1
        else:
            out["rest"] += us
    return {k: round(v / reps, 1) for k, v in out.items()}


def bench_cp(row, problem, args, o, st, o_default, counts, tiles, rounds):
    """The context-parallel path at each segment count (and ``tile_v`` variant) interleaved with the plain launch:
    round medians, errors against the plain launch, phases (see the module docstring)."""
    st_default = st.clone()
    cp_timer = KernelTimer(DEV, sleep_cycles=8_000_000)  # ~4 ms: the host queues the whole path first
    fns = {"plain_interleaved": lambda: gdn_launch(problem, args)}
    for tv in [0, *tiles]:
        sfx, tune = ("", "") if tv == 0 else (f"_tv{tv}", f"tile_v={tv}")
        for P in counts:
            fn = _tuned(tune, lambda P=P: gdn_launch_cp(problem, args, P))
            fn()  # compiles outside the timing
            torch.cuda.synchronize()
            row[f"rel_err_cp{P}{sfx}_vs_plain_o"] = rel(o, o_default)
            row[f"rel_err_cp{P}{sfx}_vs_plain_state"] = rel(st, st_default)
            fns[f"cp{P}{sfx}"] = fn
            try:
                row[f"cp{P}{sfx}_phases_us"] = cp_phases(fn)
            except Exception as e:  # noqa: BLE001  (the profiler's event API differs across torch versions)
                print(f"cp{P}{sfx} phases unavailable:", e)
    times = cp_timer.interleaved(fns, rounds=rounds)
    for name, per_round in times.items():
        row[f"{name}_ms"] = statistics.median(min(r) for r in per_round) * 1e3


def bench_prefill(timer, found, rows_wanted, bw, variants=(), recurrent=False, chunked_tiles=(), sm90_tiles=(),
                  cp=None, cp_tiles=(), cp_rounds=7, fused=()):
    rows = []
    for name in rows_wanted:
        B, L, hqk, hv = PREFILL[name]
        q, k, v, g, beta, cu = prefill_inputs(B, L, hqk, hv)
        T = q.shape[0]
        varlen = L == 0
        problem, args, (o, st) = api._plan_prefill(
            q, k, v, g, beta, None, None, True, cu, True, None, None, None, None, 0, "auto", None, None, "auto",
            None, "linear")
        gdn_launch(problem, args)
        torch.cuda.synchronize()
        row = dict(row=name, B=B, L=L, T=T, heads=f"{hqk}/{hv}",
                   ours_ms=timer(lambda: gdn_launch(problem, args), reps=10) * 1e3)
        bound_ms = prefill_bytes(B, L, hqk, hv) / bw * 1e3
        row["hbm_bound_ms"] = bound_ms
        module, cfg = gdn_choice(problem, chains=B * max(hqk, hv))
        row["kernel"] = f"{module.NAME} {cfg.tiles}"
        o_default = o.clone()
        row["cp_auto_segments"] = gdn_cp_segments(problem, args, "auto")
        if cp is not None:  # the context-parallel path: the planned segments, or each count asked for
            bench_cp(row, problem, args, o, st, o_default, cp or [gdn_cp_segments(problem, args, True)], cp_tiles,
                     cp_rounds)
            gdn_launch(problem, args)  # the plain launch's outputs again for the peers' comparisons
        for tv, nw in chunked_tiles:
            c2 = chk.Config(problem, chk.Tiles(tile_v=tv, num_warps=nw))
            fn = get_compiled(chk.NAME, c2, chk.compile)
            row[f"chunked_{tv}x{nw}_ms"] = timer(lambda: chk.launch(fn, c2, args), reps=10) * 1e3
        for tv, ns, tma, pers, prep in sm90_tiles:  # the SM90 chunked kernel; tv 0: its default tiles
            t90 = chk90.default_tiles(problem, num_sms=132, chains=B * max(hqk, hv)) if tv == 0 else \
                chk90.Tiles(tile_v=tv, num_stages=ns, tma=tma, persistent=pers, prep=prep)
            c4 = chk90.Config(problem, t90)
            fn = get_compiled(chk90.NAME, c4, chk90.compile)
            key = (f"sm90_{t90.tile_v}x{t90.num_stages}" + ("_tma" if t90.tma else "") +
                   (f"_p{t90.persistent}" if t90.persistent else "") + ("_prep90" if t90.prep else ""))
            row[key + "_ms"] = timer(lambda: chk90.launch(fn, c4, args), reps=10) * 1e3
            row[f"rel_err_{key}_vs_default_o"] = rel(o, o_default)
            gdn_launch(problem, args)  # the default kernel's outputs again for the peers' comparisons
        for pw in fused:  # the opt-in fused SM90 kernel with pw prep warpgroups
            c5 = fused90.Config(problem, fused90.Tiles(prep_warpgroups=pw))
            try:
                fn = get_compiled(fused90.NAME, c5, fused90.compile)
                fused90.launch(fn, c5, args)
                torch.cuda.synchronize()
                row[f"rel_err_fused_p{pw}_vs_default_o"] = rel(o, o_default)
                row[f"fused_p{pw}_ms"] = timer(lambda: fused90.launch(fn, c5, args), reps=10) * 1e3
            except (ValueError, NotImplementedError) as e:
                print(f"fused p{pw} row {name}: {e}"[:300])
            gdn_launch(problem, args)
        if recurrent and name in ("b", "c"):
            c3 = rec.Config(problem, rec.default_tiles(problem, num_sms=132))
            fn = get_compiled(rec.NAME, c3, rec.compile)
            row["recurrent_ms"] = timer(lambda: rec.launch(fn, c3, args), reps=3) * 1e3
            rec.launch(fn, c3, args)
            row["rel_err_chunked_vs_recurrent_o"] = rel(o_default, o)
        for tv, nw, pf, lanes in variants:
            cfg = rec.Config(problem, rec.Tiles(tile_v=tv, num_warps=nw, prefetch=pf, lanes_per_row=lanes))
            fn = get_compiled(rec.NAME, cfg, rec.compile)
            key = f"ours_{tv}_{nw}_{pf}_{lanes}"
            row[key + "_ms"] = timer(lambda: rec.launch(fn, cfg, args), reps=10) * 1e3
            row[key + "_rel_err_vs_default"] = rel(o, o_default)
        if "fla" in found:
            f = found["fla"]
            if varlen:  # fla's varlen form: one batch row, cu_seqlens
                qf, kf, vf = (x.unsqueeze(0) for x in (q, k, v))
                gf, bf = torch.log(g).unsqueeze(0), beta.unsqueeze(0)
                extra = dict(cu_seqlens=cu.to(torch.int64))
            else:
                qf, kf, vf = (x.view(B, L, *x.shape[1:]) for x in (q, k, v))
                gf = torch.log(g).view(B, L, hv)
                bf = beta.view(B, L, hv)
                extra = {}

            def fla_call():
                return f(qf, kf, vf, gf, bf, scale=1 / math.sqrt(D), output_final_state=True,
                         use_qk_l2norm_in_kernel=True, **extra)

            try:
                of, sf = fla_call()
                row["fla_ms"] = timer(fla_call, reps=10) * 1e3
                row["rel_err_vs_fla_o"] = rel(o.reshape(of.shape), of)
                row["rel_err_vs_fla_state"] = rel(st, sf.transpose(-1, -2))
            except Exception as e:  # noqa: BLE001
                print(f"fla row {name} failed:", e)
        if "flashinfer" in found:
            f = found["flashinfer"]

            def fi_call():
                return f(q, k, v, g, beta, None, None, True, cu.to(torch.int64), True)

            try:
                oi, _ = fi_call()
                row["flashinfer_ms"] = timer(fi_call, reps=10) * 1e3
                row["rel_err_vs_flashinfer_o"] = rel(o, oi)
            except Exception as e:  # noqa: BLE001
                print(f"flashinfer row {name} failed:", e)
        rows.append(row)
        print(row, flush=True)
        del q, k, v, g, beta, o, st, args
        torch.cuda.empty_cache()
    return rows


GDP = (4, 8192, 32, 2)  # B, L, heads (q = k = v), num_householder


def bench_gdp(timer, bw):
    """Row (f): Gated DeltaProduct, n = 2 (k / v / beta on the expanded timeline), the chunked kernel."""
    B, L, H, n = GDP
    T = B * L
    q = torch.randn(T, H, D, device=DEV).bfloat16()
    k = torch.randn(T * n, H, D, device=DEV).bfloat16()
    v = torch.randn(T * n, H, D, device=DEV).bfloat16()
    g = torch.rand(T, H, device=DEV) * 0.1 + 0.9  # linear alpha
    beta = torch.rand(T * n, H, device=DEV)
    cu = torch.arange(0, T + 1, L, device=DEV, dtype=torch.int32)
    o = torch.empty(T, H, D, device=DEV, dtype=torch.bfloat16)
    st = torch.empty(B, H, D, D, device=DEV, dtype=torch.float32)
    problem = pg.GdnProblem(dtype="bfloat16", head_dim_k=D, head_dim_v=D, use_qk_l2norm=True, num_householder=n,
                            arch=api.gdn_arch(DEV))
    flags = pg.FLAG_HAS_G | pg.FLAG_HAS_BETA | pg.FLAG_WRITE_STATE
    args = api._prefill_args(q, k, v, g, beta, cu, None, st, None, o, 1 / math.sqrt(D), H, H, H, flags)
    gdn_launch(problem, args)
    torch.cuda.synchronize()
    module, cfg = gdn_choice(problem, chains=B * H)
    row = dict(row="f", B=B, L=L, T=T, heads=f"{H}/{H} GDP n={n}", kernel=f"{module.NAME} {cfg.tiles}",
               ours_ms=timer(lambda: gdn_launch(problem, args), reps=10) * 1e3)
    nbytes = T * (H * D * 2 * 2 + n * (2 * H * D * 2 + H * 4) + H * 4) + B * H * D * D * 4
    row["hbm_bound_ms"] = nbytes / bw * 1e3
    try:
        from fla.ops.gated_delta_product import chunk_gated_delta_product as fla_gdp
    except Exception as e:  # noqa: BLE001
        print("fla chunk_gated_delta_product unavailable:", e)
        fla_gdp = None
    if fla_gdp is not None:
        qf, kf, vf = q.view(B, L, H, D), k.view(B, L * n, H, D), v.view(B, L * n, H, D)
        gf, bf = torch.log(g).view(B, L, H), beta.view(B, L * n, H)

        def fla_call():
            return fla_gdp(qf, kf, vf, gf, bf, num_householder=n, scale=1 / math.sqrt(D), output_final_state=True,
                           use_qk_l2norm_in_kernel=True)

        try:
            of, sf = fla_call()
            row["fla_ms"] = timer(fla_call, reps=10) * 1e3
            row["rel_err_vs_fla_o"] = rel(o.view(of.shape), of)
            row["rel_err_vs_fla_state"] = rel(st, sf.transpose(-1, -2))
        except Exception as e:  # noqa: BLE001
            print("fla GDP row failed:", e)
    print(row, flush=True)
    return row


def bench_decode(timer, found, batches):
    rows = []
    H = DECODE_H
    for B in batches:
        q = torch.randn(B, 1, H, D, device=DEV).bfloat16()
        k = torch.randn(B, 1, H, D, device=DEV).bfloat16()
        v = torch.randn(B, 1, H, D, device=DEV).bfloat16()
        alpha = torch.rand(B, H, device=DEV) * 0.1 + 0.9
        beta = torch.rand(B, H, device=DEV)
        state = torch.randn(B, H, D, D, device=DEV) * 0.05
        out = torch.empty(B, H, D, device=DEV, dtype=torch.bfloat16)
        flat = [x.view(B, H, D) for x in (q, k, v)]
        problem, args = api._plan_in_place(flat, alpha, beta, api._cu_steps(B, 1, DEV), state, None, None, out,
                                           None, True)
        t = timer(lambda: gdn_launch(problem, args), reps=10)
        nbytes = 2 * state.numel() * 4  # the state is read and written once a step
        row = dict(B=B, heads=H, ours_us=t * 1e6, ours_tbs=nbytes / t / 1e12)
        if "fla_recurrent" in found:
            f = found["fla_recurrent"]
            h0 = state.transpose(-1, -2).contiguous()
            gl = torch.log(alpha).view(B, 1, H)
            bl = beta.view(B, 1, H)

            def fla_call():
                return f(q, k, v, gl, bl, scale=1 / math.sqrt(D), initial_state=h0, output_final_state=True,
                         use_qk_l2norm_in_kernel=True)

            tf = timer(fla_call, reps=10)
            row["fla_us"] = tf * 1e6
            row["fla_tbs"] = nbytes / tf / 1e12
        rows.append(row)
        print(row, flush=True)
    return rows


def table(prefill, decode):
    lines = ["| row | B x L | heads qk/v | ours ms | CP ms (P) | Mtok/s | fla ms | FlashInfer ms | fla / ours"
             " | FlashInfer / ours | HBM bound ms | bound / ours |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in prefill:
        tok = r["T"]
        fla, fi = r.get("fla_ms"), r.get("flashinfer_ms")
        cps = sorted((v, k[2:-3]) for k, v in r.items() if k.startswith("cp") and k.endswith("_ms"))
        cp_cell = f"{cps[0][0]:.3f} ({cps[0][1]})" if cps else "-"
        cells = [f"({r['row']})", f"{r['B']} x {r['L'] or 'varlen'}", r["heads"], f"{r['ours_ms']:.3f}", cp_cell,
                 f"{tok / r['ours_ms'] / 1e3:.2f}", f"{fla:.3f}" if fla else "-", f"{fi:.3f}" if fi else "-",
                 f"{fla / r['ours_ms']:.2f}x" if fla else "-", f"{fi / r['ours_ms']:.2f}x" if fi else "-",
                 f"{r['hbm_bound_ms']:.3f}", f"{r['hbm_bound_ms'] / r['ours_ms']:.1%}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| decode B | heads | ours us | ours TB/s | fla us | fla TB/s | fla / ours |",
              "|---|---|---|---|---|---|---|"]
    for r in decode:
        fla = r.get("fla_us")
        lines.append(f"| {r['B']} | {r['heads']} | {r['ours_us']:.1f} | {r['ours_tbs']:.2f} | "
                     + (f"{fla:.1f} | {r['fla_tbs']:.2f} | {fla / r['ours_us']:.2f} |" if fla else "- | - | - |"))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="row (c) and one decode batch only")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiles", default="", help="extra recurrent tiles 'tile_v,num_warps,prefetch,lanes;...'")
    ap.add_argument("--chunked-tiles", default="", help="extra chunked tiles 'tile_v,num_warps;...'")
    ap.add_argument("--recurrent", action="store_true", help="also time the recurrent kernel on rows (b), (c)")
    ap.add_argument("--sm90", nargs="?", const="default", default="",
                    help="also time the SM90 chunked kernel: its default tiles, or "
                         "'tile_v,num_stages[,tma[,persistent[,prep]]];...'")
    ap.add_argument("--rows", default="", help="prefill rows, e.g. 'a,c' (default: all; 'none': no GDN row)")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--cp", nargs="?", const="plan", default="",
                    help="also time the context-parallel path: its planned segments, or 'P,...' segment counts")
    ap.add_argument("--cp-tiles", default="", help="also time the CP path with these main-kernel tile_v, 'tv,...'")
    ap.add_argument("--cp-rounds", type=int, default=7, help="interleaved rounds of the CP timings")
    ap.add_argument("--no-peers", action="store_true", help="skip fla and FlashInfer")
    ap.add_argument("--fused", default="", help="also time the fused SM90 kernel with these prep_warpgroups, 'p,...'")
    ap.add_argument("--gdp", action="store_true", help="add the Gated DeltaProduct row (f): n = 2, 32 heads, 4 x 8192")
    a = ap.parse_args()
    variants = [tuple(int(x) for x in v.split(",")) for v in a.tiles.split(";") if v.strip()]
    ctiles = [tuple(int(x) for x in v.split(",")) for v in a.chunked_tiles.split(";") if v.strip()]
    # 'tv,stages[,tma[,persistent[,prep]]]' (tma, persistent and prep 0 when left out)
    sm90 = [(0, 0, 0, 0, 0)] if a.sm90 == "default" else [(*(int(x) for x in v.split(",")), 0, 0, 0)[:5]
                                                          for v in a.sm90.split(";") if v.strip()]
    torch.manual_seed(0)
    timer = KernelTimer(DEV)
    bw = read_bandwidth(timer)
    print(f"read bandwidth {bw / 1e12:.3f} TB/s")
    found = {} if a.no_peers else peers()
    rows = [] if a.rows == "none" else a.rows.split(",") if a.rows else (["c"] if a.quick else list(PREFILL))
    cp = None if not a.cp else ([] if a.cp == "plan" else [int(x) for x in a.cp.split(",") if x.strip()])
    cp_tiles = [int(x) for x in a.cp_tiles.split(",") if x.strip()]
    prefill = bench_prefill(timer, found, rows, bw, variants, a.recurrent, ctiles, sm90, cp, cp_tiles, a.cp_rounds,
                            tuple(int(x) for x in a.fused.split(",") if x.strip()))
    if a.gdp:
        prefill.append(bench_gdp(timer, bw))
    decode = [] if a.no_decode else bench_decode(timer, found, DECODE_B[:1] if a.quick else DECODE_B)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_gdn.json"), "w") as fh:
        json.dump(dict(read_tbs=bw / 1e12, prefill=prefill, decode=decode), fh, indent=1)
    print(table(prefill, decode))
    for r in prefill:  # the kernel chosen, tile variants and the recurrent kernel, if any
        extra = {k: v if isinstance(v, dict) else round(v, 4) for k, v in r.items()
                 if (k.startswith(("ours_", "chunked_", "sm90_", "recurrent", "cp", "plain_")) or
                     k.startswith("rel_err")) and k != "ours_ms"}
        print(f"({r['row']}) {r['kernel']} {r['ours_ms']:.3f} ms; {extra}")


if __name__ == "__main__":
    main()
