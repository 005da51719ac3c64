"""Per-tile timeline of the SM90 prefill kernel on one benchmark case (development aid).

Plans the case of ``perf/bench_prefill.py`` with ``CUTEDSL_ATTN_PREFILL_TUNE`` = the variant, builds that plan's
configuration as :class:`TracedKernel` (the SM90 kernel with its trace hooks filled in: ``%clock64`` stamps per tile
written into its mask argument, here a buffer of 128 bytes per tile), runs it with the L2 flushed, and reports where
a CTA's time goes, in SM cycles summed over CTAs (consumer warpgroups 0 and 1): per tile the wait before it starts
(its Q landing), the first S GEMM, the main loop to the last P V, the epilogue.  Ragged K/V without a custom mask
only (the mask argument is free there).

Usage: python perf/trace_prefill.py --case varlen [--variants "default;q_stages=2"]
"""

from __future__ import annotations

import argparse
import json
import math
import os

import cutlass
import cutlass.cute as cute
import torch
from cutlass import const_expr

from cutedsl_attn.common import ptx
from cutedsl_attn.planning.prefill import PrefillArgs, tile_kv_range
from cutedsl_attn.sm90 import prefill as sm90_prefill
from cutedsl_attn.sm90.prefill.kernel import Sm90PrefillKernel, build

from bench_prefill import DEV, case_inputs, case_slug, find_case, plan_ours, timed


class TracedKernel(Sm90PrefillKernel):
    """The SM90 prefill kernel writing ``%clock64`` stamps into 64-bit slots of tile ``t``'s 128-byte record in the
    mask argument: slots ``4 wg + 0..3`` consumer warpgroup ``wg`` at the tile's start (Q landed), its first S GEMM
    done, its last P V done, its epilogue done; 12 the CTA index (32-bit); 13 the producer handing Q over; with two
    consumer warpgroups, warpgroup 0's finer events: 8..11 the epilogue's coordinates loaded, its barrier passed, O
    staged, O stored; 14 the tile's block range known; 15 the first S GEMM's turn taken."""

    def _record_addr(self, mMask, t, slot: int):
        return mMask.iterator.toint() + t * 128 + slot * 8

    @cute.jit
    def _stamp(self, mMask, t, slot: cutlass.Constexpr, pred):
        if pred:
            ptx.stamp_clock64(self._record_addr(mMask, t, slot))

    @cute.jit
    def _stamp_fine(self, mMask, t, slot: cutlass.Constexpr, tid):
        if const_expr(self.NWG == 2):
            self._stamp(mMask, t, slot, tid == 0)  # consumer thread 0: warpgroup 0

    @cute.jit
    def _stamp_hand_over(self, mMask, t):
        if t >= 0:
            self._stamp(mMask, t, 13, cute.arch.lane_idx() == 0)

    @cute.jit
    def _stamp_cta(self, mMask, t, bx, ctid):
        if ctid == 0:
            ptx.st_global_u32(self._record_addr(mMask, t, 12), bx)


def trace(variant, q, k, v, indptr, hq, hkv, d, causal):
    w = plan_ours(torch.empty(256 << 20, dtype=torch.uint8, device=DEV), indptr, hq, hkv, d, causal,
                  {"CUTEDSL_ATTN_PREFILL_TUNE": None if variant == "default" else variant})
    cfg = w._plan["cfg"]
    if not isinstance(cfg, sm90_prefill.Config) or cfg.problem.page_size or cfg.problem.use_custom_mask:
        raise SystemExit(f"{variant}: planned {type(cfg).__name__}, not the SM90 kernel on ragged K/V without a mask")
    if cfg.tiles.num_wg > 3:  # slots 4 wg + 0..3 of a 16-slot record; 12 and 13: CTA, hand-over
        raise SystemExit("the trace records at most three consumer warpgroups")
    fn = build(TracedKernel(cfg), cfg)
    work = w._plan["work"].to(DEV)
    tiles = work.shape[0] * hkv
    buf = torch.zeros(tiles * 128, dtype=torch.uint8, device=DEV)
    out = torch.empty(q.shape[0], hq, cfg.problem.head_dim_vo, dtype=q.dtype, device=DEV)
    lse = torch.empty(q.shape[0], hq, dtype=torch.float32, device=DEV)
    dummy_i, dummy_f = torch.zeros(1, dtype=torch.int32, device=DEV), torch.zeros(1, dtype=torch.float32, device=DEV)
    args = PrefillArgs(q=q, k=k, v=v, indices=dummy_i, work=work, out=out, lse=lse, mask=buf, sinks=dummy_f,
                       alibi_slopes=dummy_f, sm_scale=1.0 / math.sqrt(d), soft_cap=0.0, window_left=-1,
                       rope_rcp_scale=1.0, rope_log2_theta=0.0, output_scale=1.0)
    sm90_prefill.launch(fn, cfg, args)
    buf.zero_()
    timed(lambda: sm90_prefill.launch(fn, cfg, args), reps=3)  # the benchmark's timing: L2 flushed, 2 ms sleep
    torch.cuda.synchronize()
    rec = buf.view(torch.int64).view(tiles, 16).cpu()
    return w, rec, block_steps(w, hkv)


def block_steps(w, hkv):
    """KV blocks summed over the plan's tiles (every kv head), from its work table: the main loop of a tile
    with n blocks runs n - 1 steps (S of block i + 1 with P V of block i)."""
    cfg = w._plan["cfg"]
    p = cfg.problem
    work = w._plan["work"].cpu().tolist()
    total = 0
    for b, row0, qo_len, kv_len, *_ in work:
        if b < 0:
            continue
        lo, hi = tile_kv_range(row0, qo_len, kv_len, group_size=p.group_size, tile_m=cfg.tile_m, causal=p.causal)
        if hi > lo:
            total += -(-hi // cfg.tiles.tile_n) - lo // cfg.tiles.tile_n
    return total * hkv


def analyse(rec, blocks=0):
    rec = rec[rec[:, 0] != 0]  # tiles that ran (padding work rows have no record)
    cta = (rec[:, 12] & 0xFFFFFFFF)
    out = dict(tiles=int(rec.shape[0]))
    tot = dict(wait=0, first_s=0, main=0, epi=0, busy=0, hand_lead=0)
    n_gap = 0
    for c in cta.unique().tolist():
        r = rec[cta == c]
        r = r[torch.argsort(r[:, 0])]
        start = torch.minimum(r[:, 0], r[:, 4])
        end = torch.maximum(r[:, 3], r[:, 7])
        tot["busy"] += int(end[-1] - start[0])
        tot["first_s"] += int(((r[:, 1] - r[:, 0]) + (r[:, 5] - r[:, 4])).sum()) // 2
        tot["main"] += int(((r[:, 2] - r[:, 1]) + (r[:, 6] - r[:, 5])).sum()) // 2
        tot["epi"] += int(((r[:, 3] - r[:, 2]) + (r[:, 7] - r[:, 6])).sum()) // 2
        if r.shape[0] > 1:
            tot["wait"] += int((start[1:] - end[:-1]).clamp(min=0).sum())
            tot["hand_lead"] += int((start[1:] - r[1:, 13]).sum())
            n_gap += r.shape[0] - 1
    busy = tot["busy"]
    for key in ("wait", "first_s", "main", "epi"):
        out[key + "_frac"] = round(tot[key] / busy, 4)
    out["per_tile_cycles"] = {key: round(tot[key] / max(1, out["tiles"]), 1) for key in ("wait", "first_s", "main", "epi")}
    out["q_issue_to_start_cycles"] = round(tot["hand_lead"] / max(1, n_gap), 1)
    out["ctas"] = int(cta.unique().numel())
    fine = rec[(rec[:, 8] != 0) & (rec[:, 14] != 0)]
    if fine.shape[0]:  # the finer stamps of warpgroup 0 (two consumer warpgroups): mean cycles per tile
        segs = dict(start_to_range=(0, 14), range_to_turn=(14, 15), turn_to_s_done=(15, 1), pv_done_to_coords=(2, 8),
                    coords_to_barrier=(8, 9), barrier_to_staged=(9, 10), staged_to_stored=(10, 11),
                    stored_to_end=(11, 3))
        out["wg0_segments"] = {k: round(float((fine[:, j] - fine[:, i]).double().mean()), 1) for k, (i, j) in segs.items()}
        # warpgroup 1 after warpgroup 0 at the tile's start, first S done, last P V done, epilogue done
        out["wg1_lag"] = {k: round(float((fine[:, 4 + i] - fine[:, i]).double().mean()), 1)
                          for k, i in (("start", 0), ("s_done", 1), ("pv_done", 2), ("end", 3))}
    if blocks:  # main loop cycles per step (S of the next block + P V of this one, both warpgroups)
        out["blocks_per_tile"] = round(blocks / max(1, out["tiles"]), 2)
        out["main_cycles_per_step"] = round(tot["main"] / max(1, blocks - out["tiles"]), 1)
    return out


def main():
    if not torch.cuda.is_available():
        raise SystemExit(f"{os.path.basename(__file__)}: needs a CUDA GPU (timings run on the device)")
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    ap.add_argument("--variants", default="default")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    name, lens, hq, hkv, d, causal = find_case(a.case)
    lens, q, k, v, indptr = case_inputs(lens, hq, hkv, d)
    res = {}
    for var in [x.strip() for x in a.variants.split(";") if x.strip()]:
        w, rec, blocks = trace(var, q, k, v, indptr, hq, hkv, d, causal)
        res[var] = analyse(rec, blocks)
        print(name, var, json.dumps(res[var]), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"trace_{case_slug(a.case)}.json"), "w") as f:
        json.dump(dict(case=name, results=res), f, indent=1)


if __name__ == "__main__":
    main()
