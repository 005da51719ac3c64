"""CPU tests of the SM90 GDN prep kernel (``cutedsl_attn.sm90.gdn_prep``): its serving rules and its PTX / cubin
cross-compiled for sm_90a (the kernel needs an H200 to run): the wgmma counts of the design, no mma.sync, no
local memory, registers and shared memory for four CTAs an SM, and (with nvdisasm) an unserialised wgmma pipeline."""

import glob
import re
import subprocess
from collections import Counter

import pytest

from cutedsl_attn.compile.cubin import cubin_kernel_resources
from cutedsl_attn.common.gdn_launch import compile_kernel
from cutedsl_attn.common.gdn_prep import PREP_CTAS_PER_SM
from cutedsl_attn.planning.gdn import CHUNK, GdnProblem
from cutedsl_attn.sm90 import gdn_prep as p90


def _problem(**kw):
    return GdnProblem(**{**dict(dtype="bfloat16", head_dim_k=128, head_dim_v=128), **kw})


def test_unsupported_rules():
    assert p90.unsupported_reason(_problem()) is None
    assert p90.unsupported_reason(_problem(head_dim_k=64, gate_domain="log", use_qk_l2norm=True)) is None
    assert "sm_90a only" in p90.unsupported_reason(_problem(arch="sm_100a"))
    for kw in (dict(gate_per_channel=True), dict(num_householder=2)):
        assert "GDN" in p90.unsupported_reason(_problem(**kw))
    with pytest.raises(TypeError):
        p90.unsupported_reason("gdn")
    with pytest.raises(ValueError, match="cannot serve"):
        p90.GdnPrepSm90Kernel(_problem(arch="sm_100a"))
    # four CTAs an SM by shared memory (1 KiB reserved a CTA)
    for k in (64, 128):
        for v in (64, 128):
            assert PREP_CTAS_PER_SM * (p90.prep_sm90_smem_bytes(k, v) + 1024) <= p90.SMEM_PER_SM


VARIANTS = {
    "k128_bf16_l2norm": dict(use_qk_l2norm=True),
    "k128_bf16": dict(),
    "k128_fp16_log": dict(dtype="float16", gate_domain="log"),
    "k64_v64_bf16_l2norm": dict(head_dim_k=64, head_dim_v=64, use_qk_l2norm=True),
    "k64_v128_fp16_l2norm": dict(dtype="float16", head_dim_k=64, use_qk_l2norm=True),
    "k128_v64_bf16_l2norm": dict(head_dim_v=64, use_qk_l2norm=True),
}


def _nvdisasm():
    from cutedsl_attn import inspect as ci

    return ci._find_tool("nvdisasm")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prep_sm90_ptx_and_cubin(tmp_path, variant):
    p = _problem(**VARIANTS[variant])
    K, V, C = p.head_dim_k, p.head_dim_v, CHUNK
    kernel = p90.GdnPrepSm90Kernel(p)
    compile_kernel(kernel, p, str(tmp_path), True)
    (path,) = glob.glob(str(tmp_path / "*.ptx"))
    ptx = open(path).read()
    assert re.search(r"\.target\s+sm_90a", ptx)
    entries = re.findall(r"\.entry\s+(\S+)\(", ptx)
    assert len(entries) == 1 and "prep_sm90" in entries[0]
    ab = "bf16" if p.dtype == "bfloat16" else "f16"
    # Q K^T and K K^T: K / 16 m64n64k16 each; W and U: C / 16 m64n{K}k16 / m64n{V}k16
    want = Counter({"m64n64k16": 2 * (K // 16)})
    want[f"m64n{K}k16"] += C // 16
    want[f"m64n{V}k16"] += C // 16
    got = Counter(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)\.f32\.{ab}\.{ab}", ptx))
    assert got == want, got
    assert sum(got.values()) == 2 * (K // 16) + 2 * (C // 16)
    assert "mma.sync" not in ptx and "ldmatrix" not in ptx  # every chunk product on wgmma
    # K K^T in flight while Aqk is formed (wait 1), then Aqk's K K^T, W and U waits
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)
    assert sorted(waits) == ["0", "0", "0", "1"], waits
    assert len(re.findall(r"fence\.proxy\.async", ptx)) == 2  # q / k, then v: generic writes before wgmma
    assert len(re.findall(r"cp\.async\.cg\.shared\.global", ptx)) == C * (2 * K + V) // 8 // 128
    # Aqk, W, U out in 16-byte rows (no 4-byte scratch stores); F as fp32 words
    assert len(re.findall(r"st\.global\.v4\.b32", ptx)) == C * (C + K + V) // 8 // 128
    assert "st.global.u32" not in ptx and "st.global.b32" not in ptx
    assert ".local" not in ptx
    assert kernel.p90_smem_bytes <= p90.prep_sm90_smem_bytes(K, V)
    (cub,) = glob.glob(str(tmp_path / "*.cubin"))
    blob = open(cub, "rb").read()
    res = cubin_kernel_resources(blob)
    assert len(res) == 1
    r = next(iter(res.values()))
    print(variant, r, "smem", kernel.p90_smem_bytes)
    assert r["stack_bytes"] == 0, r  # no spills
    assert r["registers"] <= 65536 // (128 * PREP_CTAS_PER_SM), r  # four CTAs an SM
    tool = _nvdisasm()
    if tool is not None:
        cub_path = tmp_path / "k.cubin"
        cub_path.write_bytes(blob)
        sass = subprocess.run([str(tool), str(cub_path)], capture_output=True, text=True, check=True).stdout
        assert len(re.findall(r"\bHGMMA\.", sass)) == sum(got.values())
        # ptxas kept the pipeline: one wait per wait_group of the source, not one per HGMMA
        assert len(re.findall(r"WARPGROUP\.DEPBAR", sass)) <= len(waits)
