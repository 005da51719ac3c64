"""Registers / spills of the SM90 prefill kernel builds (development aid; needs cuobjdump).

Usage: python perf/sm90_resources.py OUTDIR
"""
import os
import subprocess
import sys

from cutedsl_attn.sm90 import prefill as P

out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/sm90_res"
for dq, dv, nwg, tn, causal in [(128, 128, 2, 128, True), (64, 64, 2, 128, True), (256, 256, 2, 64, True)]:
    d = os.path.join(out, f"d{dq}_{nwg}_{int(causal)}")
    os.makedirs(d, exist_ok=True)
    cfg = P.Sm90PrefillConfig(dtype="bfloat16", head_dim_qk=dq, head_dim_vo=dv, group_size=1, causal=causal,
                              tile_n=tn, num_wg=nwg)
    P.compile(cfg, keep_ptx_dir=d, keep_cubin=True)
    for f in os.listdir(d):
        if f.endswith(".cubin"):
            r = subprocess.run(["cuobjdump", "-res-usage", os.path.join(d, f)], capture_output=True, text=True)
            lines = [x.strip() for x in r.stdout.splitlines() if "REG" in x or "STACK" in x]
            sass = subprocess.run(["cuobjdump", "-sass", os.path.join(d, f)], capture_output=True, text=True).stdout
            counts = {k: sass.count(k) for k in ("HGMMA", "WARPGROUP.DEPBAR", "WARPGROUP.ARRIVE", "MUFU.EX2", "STL")}
            print(f"d{dq} nwg{nwg} causal={causal}:", " | ".join(lines)[:200], counts, flush=True)
