"""Cross-compile the paged-decode kernel without a GPU and check its PTX; the CLI and the demo's CPU path.

Each config is compiled once per target (``sm_90a``, ``sm_100a``) through
``cutedsl_attn.inspect.ptx`` (memoised in-process); a compile costs ~1-2 s on CI.
The assertions state what the portable kernel is built from: warp-level
``mma.sync.m16n8k16`` tensor-core MMAs of the right input type, ``ldmatrix``
(``.trans`` for V), ``cp.async.cg`` global->shared copies, an ``atom.global.add``
split-KV counter, and no local-memory traffic (no spilled arrays) up to head_dim 128.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cutedsl_attn as ca
from cutedsl_attn import inspect as ci
from cutedsl_attn.planning.prefill import PrefillProblem
from cutedsl_attn.sm90.prefill import Config as Sm90Config
from cutedsl_attn.sm90.prefill import Tiles, default_tiles, override_tiles
from cutedsl_attn.sm90.prefill.config import Epilogue, LoopOrder, Softmax, TileInfo

REPO = Path(__file__).resolve().parent.parent
ARCHS = ("sm_90a", "sm_100a")

CONFIGS = {
    "bf16_hd128_ps16_g4": dict(dtype="bfloat16", head_dim=128, page_size=16, group_size=4),
    "fp16_hd64_ps1_g1_w2s4": dict(dtype="float16", head_dim=64, page_size=1, group_size=1, num_warps=2,
                                  num_stages=4),
    "bf16_hd256_g8_sinks_cap": dict(dtype="bfloat16", head_dim=256, page_size=16, group_size=8, use_sinks=True,
                                    use_soft_cap=True),
    "bf16_hd128_rope": dict(dtype="bfloat16", head_dim=128, page_size=16, group_size=4,
                            pos_encoding_mode="ROPE_LLAMA"),
    "fp16_hd64_alibi_g2": dict(dtype="float16", head_dim=64, page_size=16, group_size=2, pos_encoding_mode="ALIBI"),
    "bf16_hd32_g1": dict(dtype="bfloat16", head_dim=32, page_size=16, group_size=1),
}


def _env():
    env = dict(os.environ)
    env.pop("CUTEDSL_ATTN_ARCH", None)
    env["CUDA_VISIBLE_DEVICES"] = ""  # behave as on a machine without a GPU
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# ----------------------------------------------------------------------------- PTX of each config
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_decode_ptx(name, arch):
    cfg = CONFIGS[name]
    text = ci.ptx("decode", arch, **cfg)
    s = ci.instruction_summary(text)
    ab = "bf16" if cfg["dtype"] == "bfloat16" else "f16"
    other = "f16" if ab == "bf16" else "bf16"

    assert re.search(rf"^\.target\s+{arch}\s*$", text, re.M), "wrong or missing .target"
    assert len(re.findall(r"^\.(?:visible\s+)?\.entry\s+\S*PagedDecodeKernel", text, re.M)) == 1
    nw = cfg.get("num_warps", 4)
    assert re.search(rf"\.reqntid\s+{32 * nw}, 1, 1", text), "block size does not match num_warps"
    # tensor cores: m16n8k16, fp32 accumulate, inputs of the config's dtype only
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32" in text
    assert f".{other}.{other}.f32" not in text
    assert s["mma.sync"] == s[f"mma.sync.{ab}"] >= cfg["head_dim"] // 8 * 2
    # Q K^T and P V both have D/8 n-tiles of 8: as many mma.sync for each
    assert s["mma.sync"] % (cfg["head_dim"] // 8) == 0
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in text
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in text
    assert 0 < s["ldmatrix.trans"] < s["ldmatrix"]
    assert re.search(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+\], 16", text), "16-byte cp.async.cg"
    assert s["cp.async"] > 0 and s["cp.async.commit_group"] > 0 and s["cp.async.wait_group"] > 0
    assert "atom.global.add" in text and s["atom.global.add"] >= 1
    assert s["ex2"] > 0 and s["bar.sync"] > 0 and s["shfl.sync"] > 0
    # nothing Hopper/Blackwell-specific in the portable kernel
    assert s["wgmma"] == s["tcgen05"] == s["cp.async.bulk.tensor"] == 0
    if cfg["head_dim"] <= 128:
        assert s["ld.local"] == 0 and s["st.local"] == 0, "local-memory traffic (spilled arrays)"
        assert not re.search(r"^\s*\.local\b", text, re.M), "local-memory array declared"


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_ptx_feature_code(arch):
    base = ci.instruction_summary(ci.ptx("decode", arch, **CONFIGS["bf16_hd128_ps16_g4"]))
    rope = ci.instruction_summary(ci.ptx("decode", arch, **CONFIGS["bf16_hd128_rope"]))
    capped = ci.ptx("decode", arch, **CONFIGS["bf16_hd256_g8_sinks_cap"])
    assert base["sin/cos"] == 0 and rope["sin/cos"] > 0, "ROPE_LLAMA rotates q and k (sin/cos)"
    assert base["tanh"] == 0
    cs = ci.instruction_summary(capped)
    assert cs["tanh"] > 0 or cs["ex2"] > base["ex2"], "soft cap needs a tanh"


def test_same_config_both_archs_differ_only_in_target():
    a, b = (ci.ptx("decode", arch, **CONFIGS["bf16_hd32_g1"]) for arch in ARCHS)
    assert ci.instruction_summary(a)["mma.sync"] == ci.instruction_summary(b)["mma.sync"]
    assert ".target sm_90a" in a and ".target sm_100a" in b


def test_ptx_is_memoised():
    cfg = CONFIGS["bf16_hd32_g1"]
    assert ci.ptx("decode", "sm_90a", **cfg) is ci.ptx("decode", "hopper", **cfg)


@pytest.mark.parametrize("want_cubin", [False, True])
def test_inspect_compile_artifacts(want_cubin):
    """inspect's own compile-and-read step (the session's tests reach ``ci.ptx`` / ``ci.resources`` through the
    shared builds of ``tests/_builds.py``): the PTX, and the cubin only when asked for, the same PTX as the
    shared build's (up to the module-numbered shared-memory symbol)."""
    cfg = ci.config("decode", "sm_100a", **CONFIGS["bf16_hd32_g1"])
    text, cubin = ci._compile_artifacts(cfg, want_cubin=want_cubin)
    assert re.search(r"^\.target\s+sm_100a\s*$", text, re.M)
    assert (cubin is not None and cubin[:4] == b"\x7fELF") if want_cubin else cubin is None
    norm = lambda t: re.sub(r"__dynamic_shmem__\d+", "SHMEM", t)  # noqa: E731
    assert norm(text) == norm(ci.ptx("decode", "sm_100a", **CONFIGS["bf16_hd32_g1"]))


# ----------------------------------------------------------------------------- inspect API errors (no compile)
def test_config_defaults_and_arch():
    cfg = ci.config("decode", "blackwell")
    pr = cfg.problem
    assert (pr.dtype, pr.head_dim, pr.page_size, pr.group_size, pr.arch) == ("bfloat16", 128, 16, 4, "sm_100a")
    assert ci.config("decode", "sm_90a", dtype="fp16", head_dim=256).tiles.num_stages == 2
    # prefill: head_dim_vo defaults to head_dim_qk, except 192 (DeepSeek's 192/128), as the CLI
    assert ci.config("prefill", "sm_90a", head_dim_qk=192).problem.head_dim_vo == 128
    assert ci.config("prefill", "sm_90a", head_dim_qk=64).problem.head_dim_vo == 64
    assert ci.config("prefill", "sm_90a", head_dim_qk=192, head_dim_vo=64, kernel="portable").problem.head_dim_vo == 64


@pytest.mark.parametrize("kw,exc,match", [
    (dict(op="attention"), ValueError, "op"),
    (dict(arch="sm_80"), ValueError, "sm_80"),
    (dict(head_dims=128), TypeError, "head_dims"),
    (dict(dtype="float32"), ValueError, "dtype"),
    (dict(head_dim=48), ValueError, "head_dim"),
    (dict(group_size=17), ValueError, "group_size"),
    (dict(pos_encoding_mode="XPOS"), ValueError, "pos_encoding_mode"),
    (dict(num_warps=3), ValueError, "num_warps"),
    (dict(page_size="16"), ValueError, "page_size"),
])
def test_ptx_bad_arguments(kw, exc, match):
    op = kw.pop("op", "decode")
    arch = kw.pop("arch", "sm_90a")
    with pytest.raises(exc, match=match):
        ci.ptx(op, arch, **kw)


def test_sass_without_tools_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(ci, "_find_tool", lambda name: None)
    with pytest.raises(RuntimeError, match="cuobjdump"):
        ci.sass("decode", "sm_90a")


def test_cubin_builds_without_gpu():
    """sass() disassembles the cubin kept by --keep-cubin; the cubin itself needs no GPU or toolkit."""
    cubin = ci._cubin_cached(ci.config("decode", "sm_100a", **CONFIGS["bf16_hd32_g1"]))
    assert isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF" and len(cubin) > 1000


@pytest.mark.skipif(ci._find_tool("cuobjdump") is None and ci._find_tool("nvdisasm") is None,
                    reason="no cuobjdump/nvdisasm here")
def test_sass_with_tools():
    text = ci.sass("decode", "sm_90a", **CONFIGS["bf16_hd32_g1"])
    assert "HMMA" in text and "LDSM" in text


@pytest.mark.skipif(ci._find_tool("cuobjdump") is None and ci._find_tool("nvdisasm") is None,
                    reason="no cuobjdump/nvdisasm here")
@pytest.mark.parametrize("keys", [dict(causal=True), dict(causal=False, page_size=16), dict(head_dim_qk=256)])
def test_sm90_prefill_wgmma_not_serialised(keys):
    """ptxas silently serialises every wgmma of a kernel (a wait after each one) when it cannot prove the
    accumulators untouched between issue and wait, a large slowdown.  The SASS must keep the pipeline: one wait
    per wait_group point of the source (4, and the stale softmax's redo), not one per HGMMA."""
    text = ci.sass("prefill", "sm_90a", dtype="bfloat16", group_size=4, kernel="sm90", **keys)
    cfg = ci.config("prefill", "sm_90a", dtype="bfloat16", group_size=4, kernel="sm90", **keys)
    hgmma = len(re.findall(r"\bHGMMA\.", text))
    waits = len(re.findall(r"WARPGROUP\.DEPBAR", text))
    assert hgmma >= 16 and waits <= 4 + (cfg.tiles.softmax is Softmax.STALE), (hgmma, waits)  # (+ the redo's wait)


# ----------------------------------------------------------------------------- instruction_summary (synthetic)
SYNTH = """
//
// Generated by NVIDIA NVVM Compiler
.version 9.4
.target sm_100a
.visible .entry k(
\t.param .u64 p0
)
{
\t.reg .pred \t%p<3>;
\t.reg .b32 \t%r<10>;
$L__BB0_1:
\t// begin inline asm
\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 { %r1, %r2, %r3, %r4 }, { %r1, %r2, %r3, %r4 }, { %r1, %r2 }, { %r1, %r2, %r3, %r4 };
\t// end inline asm
\t@%p1 ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 { %r1, %r2, %r3, %r4 }, [%r5];
\t@!%p2 bra \t$L__BB0_1;
\tcp.async.cg.shared.global [%r1], [%rd1], 16, %r2; cp.async.commit_group;
\tcp.async.wait_group 0;
\tcp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2, %r3}], [%r4];
\twgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%r1}, %rd1, %rd2, p, 1, 1, 1, 1;
\twgmma.fence.sync.aligned;
\ttcgen05.mma.cta_group::1.kind::f16 [%r1], %rd1, %rd2, %r2, p;
\ttcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%r1], 32;
\tld.local.u32 %r1, [%rd1]; st.local.u32 [%rd1], %r1;
\tatom.global.add.u32 %r1, [%rd1], 1;
\tatom.shared.add.u32 %r1, [%r2], 1;
\t{ .reg .b32 t; ex2.approx.ftz.f32 %r1, %r2; }
\tshfl.sync.bfly.b32 %r1, %r2, 1, 31, -1;
\tbar.sync \t0;
\tld.global.nc.v4.u32 {%r1, %r2, %r3, %r4}, [%rd1];
\tst.shared.f32 [%r1], %r2;
\t/* mma.sync.aligned.m16n8k16 in a block comment */
\tret;
}
"""


def test_instruction_summary_synthetic():
    s = ci.instruction_summary(SYNTH)
    assert list(s) == list(ci.SUMMARY_KEYS)
    expect = {
        "mma.sync": 1, "mma.sync.bf16": 1, "mma.sync.f16": 0, "ldmatrix": 1, "ldmatrix.trans": 1, "cp.async": 1,
        "cp.async.commit_group": 1, "cp.async.wait_group": 1, "cp.async.bulk.tensor": 1, "wgmma": 1,
        "tcgen05": 2, "tcgen05.mma": 1, "ld.local": 1, "st.local": 1, "atom": 2, "atom.global.add": 1, "ex2": 1,
        "shfl.sync": 1, "bar.sync": 1, "ld.global": 1, "st.shared": 1, "ret": 1,
    }
    for k, v in expect.items():
        assert s[k] == v, (k, s[k], v)
    # bra, wgmma.fence and the .reg inside the braces are instructions/directives not in the table
    assert s["total"] == 21


def test_instruction_summary_rejects_non_text():
    with pytest.raises(TypeError):
        ci.instruction_summary(b".target sm_90a")


def test_format_summary():
    txt = ci.format_summary(ci.instruction_summary(SYNTH))
    assert "mma.sync" in txt and "total" in txt and "mma.sync.f16" not in txt


# ----------------------------------------------------------------------------- command line and demo (subprocess)
def _run(args, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_cli_ptx_prints_ptx():
    r = _run(["-m", "cutedsl_attn", "ptx", "decode", "--head-dim", "32", "--page-size", "16", "--group-size", "1",
              "--dtype", "bfloat16", "--arch", "sm_100a"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"^\.target sm_100a$", r.stdout, re.M)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in r.stdout
    assert r.stdout.lstrip().startswith("//")


def test_cli_help_and_errors(capsys):
    """``--help`` and the refusals, in-process (``python -m cutedsl_attn`` itself: :func:`test_cli_ptx_prints_ptx`)."""
    from cutedsl_attn.__main__ import build_parser, main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "ptx" in out and "demo" in out and "sass" in out
    h = build_parser().format_help()
    assert "ptx" in h and "demo" in h
    assert main(["ptx", "decode", "--head-dim", "48"]) == 2  # bad config: clear error, no traceback
    with pytest.raises(SystemExit):
        main(["ptx", "attention"])  # not a kernel family
    assert main(["ptx", "mla", "--num-warps", "4"]) == 2  # decode-only flag on mla
    assert main(["ptx", "gdn", "--window"]) == 2
    assert main(["ptx", "gdn", "--causal", "--page-size", "16"]) == 2  # flags gdn does not read: refused
    assert main(["ptx", "mla", "--head-dim", "64"]) == 2 and main(["ptx", "mla", "--sinks"]) == 2
    assert main(["ptx", "gdn", "--head-dim", "64", "--summary"]) == 0
    assert main(["ptx", "mla", "--dtype", "fp8", "--kv-dtype", "fp8", "--summary"]) == 0
    assert main(["ptx", "prefill", "--num-warps", "8"]) == 2  # decode-only flag on prefill
    assert main(["ptx", "decode", "--causal"]) == 2  # prefill-only flag on decode
    assert main(["ptx", "decode", "--kernel", "sm90"]) == 2
    assert main(["ptx", "decode", "--head-dim", "32", "--group-size", "1", "--summary"]) == 0
    assert main(["sass", "decode", "--summary"]) == 2  # (ptx only: refused, not silently ignored)


def test_cli_arch_default_from_env(monkeypatch):
    """``--arch`` defaults to ``CUTEDSL_ATTN_ARCH`` where set (the README's cross-compile switch), else sm_90a."""
    from cutedsl_attn.__main__ import build_parser

    sub = ["ptx", "decode"]
    monkeypatch.delenv("CUTEDSL_ATTN_ARCH", raising=False)
    assert build_parser().parse_args(sub).arch == "sm_90a"
    monkeypatch.setenv("CUTEDSL_ATTN_ARCH", "sm_100a")
    assert build_parser().parse_args(sub).arch == "sm_100a"
    assert build_parser().parse_args([*sub, "--arch", "sm_90a"]).arch == "sm_90a"


def test_run_return_lse_documented():
    """Every wrapper's ``run_return_lse`` is ``run(..., return_lse=True)`` with a docstring of its own."""
    for cls in (ca.BatchDecodeWithPagedKVCacheWrapper, ca.BatchPrefillWithRaggedKVCacheWrapper,
                ca.BatchPrefillWithPagedKVCacheWrapper):
        doc = cls.run_return_lse.__doc__
        assert doc and "return_lse=True" in doc and "base 2" in doc and ":meth:`run`" in doc, cls


def test_demo_cpu_path():
    r = _run(["-m", "cutedsl_attn", "demo"], timeout=600)
    out = r.stdout
    assert r.returncode == 0, (out + r.stderr)[-4000:]
    assert "No CUDA GPU" in out
    for arch in ARCHS:
        assert f"PASS: cross-compile for {arch}" in out
    assert "PTX instruction summary" in out
    assert re.search(r"^\s+mma\.sync\s+\d+\s+\d+", out, re.M)
    assert re.search(r"^\s+ld\.local\s+0\s+0", out, re.M)
    assert "split-KV plan" in out and "ALL PASS" in out


# ----------------------------------------------------------------------------- prefill kernel
PREFILL_CONFIGS = {  # the portable kernel (the SM90 one has its own tests below)
    "bf16_hd128_g4_causal": dict(dtype="bfloat16", head_dim_qk=128, group_size=4, causal=True, kernel="portable"),
    "fp16_hd192_128_paged16_mask_sinks": dict(dtype="float16", head_dim_qk=192, head_dim_vo=128, group_size=1,
                                              page_size=16, use_custom_mask=True, use_sinks=True,
                                              use_window=True, use_soft_cap=True, kernel="portable"),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", list(PREFILL_CONFIGS))
def test_prefill_ptx(name, arch):
    cfg = PREFILL_CONFIGS[name]
    text = ci.ptx("prefill", arch, **cfg)
    s = ci.instruction_summary(text)
    ab = "bf16" if cfg["dtype"] == "bfloat16" else "f16"
    dqk = cfg["head_dim_qk"]
    dvo = cfg.get("head_dim_vo", dqk)
    assert re.search(rf"^\.target\s+{arch}\s*$", text, re.M)
    assert len(re.findall(r"^\.(?:visible\s+)?\.entry\s+\S*PrefillKernel", text, re.M)) == 1
    mma = re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(\w+)\.(\w+)\.f32", text)
    # per 64-token tile and warp: QK (dqk/16 k-steps x 8 n-tiles) + PV (4 k-steps x dvo/8 n-tiles)
    assert len(mma) == (dqk // 16) * 8 + 4 * (dvo // 8)
    assert all(a == ab and b == ab for a, b in mma)
    assert len(re.findall(r"ldmatrix\.sync\.aligned\.m8n8\.x4\.trans\.shared\.b16", text)) == 4 * (dvo // 16)
    assert s.get("cp.async", 0) > 0 and "cp.async.cg.shared.global" in text
    assert s.get("ld.local", 0) == 0 and s.get("st.local", 0) == 0, "register spills"


# ----------------------------------------------------------------------------- SM90 prefill kernel
SM90_PREFILL_CONFIGS = {
    # name: (config keys, tile_n, consumer warpgroups) -- the defaults of sm90.prefill.default_tiles
    "bf16_hd128_g4_causal": (dict(dtype="bfloat16", head_dim_qk=128, group_size=4, causal=True), 80, 3),
    "fp16_hd64_full_softcap_sinks": (dict(dtype="float16", head_dim_qk=64, group_size=1, use_soft_cap=True,
                                          use_sinks=True), 128, 2),
    "bf16_hd64_g8_causal": (dict(dtype="bfloat16", head_dim_qk=64, group_size=8, causal=True), 128, 3),
    "bf16_hd256_window": (dict(dtype="bfloat16", head_dim_qk=256, group_size=2, causal=True, use_window=True), 64, 2),
    "bf16_hd256_causal": (dict(dtype="bfloat16", head_dim_qk=256, group_size=1, causal=True), 80, 2),
    "bf16_hd192_128_g8": (dict(dtype="bfloat16", head_dim_qk=192, head_dim_vo=128, group_size=8, causal=True), 128,
                          2),
}


@pytest.mark.parametrize("name", list(SM90_PREFILL_CONFIGS))
def test_sm90_prefill_ptx(name):
    """The dispatch layer picks the SM90 kernel on sm_90a; its PTX is warp-specialised TMA + wgmma."""
    keys, tile_n, num_wg = SM90_PREFILL_CONFIGS[name]
    cfg = ci.config("prefill", "sm_90a", **keys)
    assert isinstance(cfg, Sm90Config) and cfg.tiles.tile_n == tile_n and cfg.tile_m == 64 * num_wg
    text = ci.ptx("prefill", "sm_90a", **keys)
    s = ci.instruction_summary(text)
    ab = "bf16" if keys["dtype"] == "bfloat16" else "f16"
    dqk = keys["head_dim_qk"]
    dvo = keys.get("head_dim_vo", dqk)
    assert re.search(r"^\.target\s+sm_90a\s*$", text, re.M)
    assert re.search(rf"\.reqntid\s+{128 * (num_wg + 1)}, 1, 1", text), "1 producer + num_wg consumer warpgroups"
    qk = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tile_n}k16\.f32\.{ab}\.{ab}", text)
    pv = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{dvo}k16\.f32\.{ab}\.{ab}", text)
    # each GEMM is issued in two places (first block, main loop; three with loop_split's two main loops), S once
    # more with stale_max (the redo of an unmasked block); QK: dqk/16 k-steps, PV: tile_n/16
    places = 3 if (cfg.tiles.loop_order is not LoopOrder.FA3) else 2
    qk_places = places + (cfg.tiles.softmax is Softmax.STALE)
    if tile_n != dvo:
        assert len(qk) == qk_places * (dqk // 16) and len(pv) == places * (tile_n // 16)
    else:
        assert len(qk) == qk_places * (dqk // 16) + places * (tile_n // 16)
    # the stale softmax where measured faster: the plain three-warpgroup problems (ragged; d64, d128)
    assert (cfg.tiles.softmax is Softmax.STALE) == (num_wg == 3)
    assert ("bar.red.or.pred" in text) == (cfg.tiles.softmax is Softmax.STALE)  # the warpgroup agrees on a redo (a warpgroup GEMM)
    assert (cfg.tiles.loop_order is not LoopOrder.FA3) == (dqk == 64 and num_wg == 3)  # FlashAttention's loop order where it measured faster (d64)
    # conditional rescaling (O rescaled while S runs, except at d256) where it measured faster: d64 / d128 plain
    # ragged with three warpgroups, d256 plain ragged
    assert cfg.tiles.rescale_threshold == (8 if name in ("bf16_hd128_g4_causal", "bf16_hd64_g8_causal",
                                                   "bf16_hd256_causal") else 0)
    assert cfg.tiles.rescale_o_before_pv == (cfg.tiles.rescale_threshold == 8)
    # the epilogue: staged through shared memory (stmatrix, whole-row 16-byte stores) at head_dim 128 causal
    # with ragged K/V (and two Q stages) and at head_dim 256 without a window -- of these configs -- else
    # straight from registers (32-bit stores)
    staged = len(re.findall(r"stmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16", text))
    assert (cfg.tiles.epilogue is not Epilogue.REGS) == (name in ("bf16_hd128_g4_causal", "bf16_hd256_causal"))
    assert cfg.tiles.q_stages == (2 if name == "bf16_hd128_g4_causal" else 1)
    # (and there a warp whose 16 staged rows lie in the request stores them by TMA, one box per 64 columns)
    assert (cfg.tiles.epilogue is Epilogue.SMEM_TMA) == (name == "bf16_hd128_g4_causal")
    if (cfg.tiles.epilogue is not Epilogue.REGS):
        assert staged == dvo // 16 and len(re.findall(r"st\.global\.v4\.b32", text)) == 16 * dvo // 8 // 32
    else:
        assert staged == 0 and len(re.findall(r"st\.global\.u32", text)) >= 2 * (dvo // 8)
    assert s["mma.sync"] == 0 and s["tcgen05"] == 0
    # Q, K and V arrive by TMA, one box per 64 columns (the 128-byte swizzle atom), V issued in two places (a
    # block past the request's end lands on its own mbarrier, to have its tail rows zeroed); O leaves by TMA with
    # the SMEM_TMA epilogue
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.\dd", text)) == 2 * (dqk // 64) + dvo // 64 * (
        2 + (cfg.tiles.epilogue is Epilogue.SMEM_TMA))
    assert "st.shared.v4.b32 [%r" in text and "mbarrier.arrive.expect_tx" in text
    assert "mbarrier.try_wait.parity" in text or "mbarrier.try_wait" in text
    consumer, producer = cfg.registers
    assert (consumer, producer) == {2: (240, 24), 3: (160, 32)}[num_wg]
    assert 128 * (num_wg * consumer + producer) <= 65536
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{producer};", text)
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{consumer};", text)
    # ping-pong hand-off between the consumer warpgroups, except at head_dim 256 (FA4's tiles there)
    assert cfg.tiles.pingpong == (name != "bf16_hd256_causal")
    # conditional rescaling: O rescaled behind a warp vote on the row factors
    assert ("vote.sync.any.pred" in text) == (cfg.tiles.rescale_threshold > 0)
    if cfg.tiles.pingpong:
        assert "bar.arrive" in text
    assert s.get("ld.local", 0) == 0 and s.get("st.local", 0) == 0, "register spills"


@pytest.mark.parametrize("num_wg,head_dim", [(2, 128), (2, 256), (3, 64), (3, 128)])
def test_sm90_prefill_setmaxnreg_fits_launch_registers(num_wg, head_dim):
    """``setmaxnreg`` only moves registers inside the CTA's launch allocation: the consumers' increase waits
    until the producer's decrease has freed enough (a budget above it hangs), so (consumer, producer) must fit
    the launch count times the threads.  The launch count read from the cubin is the largest multiple of 8
    that fits 65536 registers."""
    keys = dict(dtype="bfloat16", head_dim_qk=head_dim, group_size=1, causal=True, kernel="sm90")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUTEDSL_ATTN_PREFILL_TUNE", f"num_wg={num_wg},tile_n=80")
        cfg = ci.config("prefill", "sm_90a", **keys)
        res = ci.resources("prefill", "sm_90a", **keys)
    threads = 128 * (num_wg + 1)
    assert cfg.tiles.num_wg == num_wg and res["registers"] == 65536 // threads // 8 * 8, res
    consumer, producer = cfg.registers
    assert consumer % 8 == 0 and producer % 8 == 0 and 24 <= producer <= consumer <= 256
    assert 128 * (num_wg * consumer + producer) <= res["registers"] * threads
    assert res["stack_bytes"] == 0, res


@pytest.mark.parametrize("page_size,keys", [
    (16, dict(dtype="bfloat16", head_dim_qk=128, group_size=4, causal=True)),
    (1, dict(dtype="float16", head_dim_qk=192, head_dim_vo=128, group_size=1, use_window=True, use_sinks=True)),
])
def test_sm90_prefill_paged_ptx(page_size, keys):
    """Paged K/V: the producer warpgroup gathers the block at the request's end (every block for page size
    1) with cp.async and arrives on the stage mbarrier, the consumers ordering those generic-proxy writes
    before their wgmma reads; with page size 16 the full blocks load by TMA, one box per page."""
    cfg = ci.config("prefill", "sm_90a", **keys, page_size=page_size)
    assert isinstance(cfg, Sm90Config) and cfg.registers == (232, 40)
    text = ci.ptx("prefill", "sm_90a", **keys, page_size=page_size)
    s = ci.instruction_summary(text)
    assert "cp.async.mbarrier.arrive.noinc" in text and "cp.async.cg.shared.global" in text
    tma = re.findall(r"cp\.async\.bulk\.tensor\.(\d)d", text)
    dqk, dvo = keys["head_dim_qk"], keys.get("head_dim_vo", keys["head_dim_qk"])
    R = cfg.page_rows  # full blocks: one TMA box per page (and per 64 columns); none for page size 1
    assert R == {16: 16, 1: 0}[page_size]
    assert len(tma) == dqk // 64 + (cfg.tiles.tile_n // R * (dqk // 64 + dvo // 64) if R else 0), tma
    assert "fence.proxy.async" in text
    assert s["wgmma"] > 0 and s["mma.sync"] == 0
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+40;", text)
    assert ci.resources("prefill", "sm_90a", **keys, page_size=page_size)["stack_bytes"] == 0


@pytest.mark.parametrize("name", ["bf16_hd128_g4_causal", "bf16_hd256_window", "bf16_hd64_g8_causal",
                                  "bf16_hd256_causal"])
def test_sm90_prefill_no_spills(name):
    """The assembled SM90 kernel keeps everything in registers (stack frame 0), read from its cubin."""
    keys, _, num_wg = SM90_PREFILL_CONFIGS[name]
    res = ci.resources("prefill", "sm_90a", **keys)
    assert res["stack_bytes"] == 0, res
    # 65536 registers / (128 * (num_wg + 1)) threads at launch; setmaxnreg rebalances them (reported too)
    assert res["registers"] == {2: 168, 3: 128}[num_wg], res
    assert (res["consumer_registers"], res["producer_registers"]) == {2: (240, 24), 3: (160, 32)}[num_wg], res


@pytest.mark.parametrize("keys", [
    dict(dtype="float16", head_dim_qk=64, group_size=1, use_soft_cap=True),
    dict(dtype="bfloat16", head_dim_qk=64, group_size=4, causal=True, use_window=True),
    dict(dtype="bfloat16", head_dim_qk=64, group_size=16, causal=True, use_sinks=True, page_size=16),
    dict(dtype="float16", head_dim_qk=128, group_size=1, causal=True, use_soft_cap=True, use_window=True,
         use_sinks=True),
    dict(dtype="bfloat16", head_dim_qk=128, group_size=2, use_sinks=True, use_window=True, page_size=1),
    dict(dtype="bfloat16", head_dim_qk=128, group_size=16, causal=True, page_size=64),
    dict(dtype="bfloat16", head_dim_qk=128, group_size=8, causal=True),
    dict(dtype="float16", head_dim_qk=128, group_size=1, page_size=16),
], ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_sm90_prefill_default_tiles_never_spill(keys):
    """default_tiles picks the larger tiles (3 warpgroups at d64; at d128 three warpgroups x tile_n 80 for ragged
    K/V (with two Q stages where causal), two x tile_n 176 for paged K/V) only where they fit the registers:
    with a window or a soft cap they spilled 16-224 B, so
    those problems keep the smaller tiles; with pages of 32 tokens or more tile_n 128 (whole pages per
    block: K/V by TMA)."""
    cfg = ci.config("prefill", "sm_90a", kernel="sm90", **keys)
    small = (keys.get("use_window") or keys.get("use_soft_cap")
             or (keys["head_dim_qk"] == 128 and keys.get("page_size", 0) in (32, 64, 128)))
    two_q = keys.get("page_size", 0) == 0 and keys.get("causal", False)  # two Q stages + staged epilogue
    # ragged K/V at head_dim 128: three warpgroups x tile_n 80; paged: two x 176
    big = ((80, 3) if keys.get("page_size", 0) == 0 else (176, 2)) if keys["head_dim_qk"] == 128 else (128, 3)
    assert (cfg.tiles.tile_n, cfg.tiles.num_wg) == ((128, 2) if small else big), cfg
    assert (cfg.tiles.q_stages, (cfg.tiles.epilogue is not Epilogue.REGS)) == ((2, True) if two_q and not small and keys["head_dim_qk"] == 128
                                                 else (1, False)), cfg
    res = ci.resources("prefill", "sm_90a", kernel="sm90", **keys)
    assert res["stack_bytes"] == 0, res


# the ptxas whose schedules the SASS tests below were measured with (named in the PTX header of the DSL's NVVM,
# whose libraries ship that ptxas): nvidia-cutlass-dsl-libs-cu13
MEASURED_TOOLCHAIN = "Cuda compilation tools, release 13.4, V13.4.59"


def _require_measured_toolchain(ptx_text):
    """Skip a SASS schedule assertion on a toolchain other than :data:`MEASURED_TOOLCHAIN` (another ptxas
    schedules differently; the assertion states that one's schedule)."""
    m = re.search(r"Cuda compilation tools, release [\w.]+, V[\w.]+", ptx_text)
    found = m.group(0) if m else "an unnamed toolchain"
    if found != MEASURED_TOOLCHAIN:
        pytest.skip(f"SASS schedule measured with '{MEASURED_TOOLCHAIN}' (nvidia-cutlass-dsl-libs-cu13); this DSL "
                    f"compiles with '{found}'")


def _main_loop_overlap(text):
    """(FFMA, MUFU) the SASS issues between the main loop's wait for S (``WARPGROUP.DEPBAR.LE gsb0, 0x1``)
    and its wait for P V (``... 0x0``): the softmax work that runs while P V is in flight."""
    body = text.split("WARPGROUP.DEPBAR.LE gsb0, 0x1", 1)[1].split("WARPGROUP.DEPBAR.LE gsb0, 0x0", 1)[0]
    return len(re.findall(r"\bFFMA\b", body)), len(re.findall(r"\bMUFU\.EX2\b", body))


@pytest.mark.skipif(ci._find_tool("cuobjdump") is None and ci._find_tool("nvdisasm") is None,
                    reason="no cuobjdump/nvdisasm here")
@pytest.mark.parametrize("name", ["bf16_hd128_g4_causal", "bf16_hd256_window", "bf16_hd192_128_g8",
                                  "bf16_hd256_causal"])
def test_sm90_prefill_softmax_overlaps_pv(name, monkeypatch):
    """Intra-warpgroup overlap as measured best: ptxas keeps the wait for P V right behind the K stage's
    mbarrier arrive, which the main loop issues after the softmax, so at least half the block's scaling FFMAs
    and some exponentials sit before the wait (released right after the wait for S, ptxas put that wait ahead
    of every one; pinned to the row sums, all of them went before it: both measured slower).  The d256
    default's conditional rescaling (a warp-vote branch in the loop) leaves no exponential before the wait, as
    measured best: checked here without it too.  Ragged d128 takes three warpgroups at 160 registers, where
    ptxas keeps none there with the exact softmax; with the stale softmax (the default) an unmasked block has
    no row max to wait for and every exponential goes before the wait.  The two-warpgroup schedule (paged K/V,
    a score_mod, a window or a soft cap) is checked with those tiles.  A schedule of one ptxas:
    :func:`_require_measured_toolchain`."""
    keys, tile_n, _ = SM90_PREFILL_CONFIGS[name]
    _require_measured_toolchain(ci.ptx("prefill", "sm_90a", **keys))
    if name == "bf16_hd256_causal":
        monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_TUNE", "rescale_threshold=0")
    if name == "bf16_hd128_g4_causal":
        # three warpgroups, stale softmax: the main loop's masked (exact) and unmasked (stale) softmax, all of the
        # latter's tile_n / 2 exponentials per thread before the wait
        assert ci.config("prefill", "sm_90a", **keys).tiles.softmax is Softmax.STALE
        ffma, mufu = _main_loop_overlap(ci.sass("prefill", "sm_90a", **keys))
        assert ffma >= tile_n // 2 and mufu >= tile_n // 2, (ffma, mufu)
        monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_TUNE", "softmax=exact")
        assert _main_loop_overlap(ci.sass("prefill", "sm_90a", **keys)) == (0, 0)
        tile_n = 160
        monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_TUNE", "num_wg=2,tile_n=160,rescale_threshold=0,"
                                                        "rescale_o_before_pv=0,softmax=exact")
    text = ci.sass("prefill", "sm_90a", **keys)
    assert text.count("WARPGROUP.DEPBAR.LE gsb0, 0x1") == 1, "one wait_group(1): the main loop's wait for S"
    ffma, mufu = _main_loop_overlap(text)
    assert ffma >= tile_n // 4 and mufu >= 4, (ffma, mufu)  # tile_n / 2 scores per thread
    if name == "bf16_hd256_causal":  # the default's schedule as measured best: no exponential before the wait
        monkeypatch.delenv("CUTEDSL_ATTN_PREFILL_TUNE")
        assert _main_loop_overlap(ci.sass("prefill", "sm_90a", **keys))[1] == 0


def _unmasked_loop_p(text):
    """SASS of the d64 default's unmasked (stale) main loop, from its wait for S to its redo agreement
    (``BAR.RED.OR``), then the fast path (the agreement's branch over the redo) to the loop's back edge:
    (F2FP and MUFU.EX2 issued after the wait for P V and before the agreement, F2FP on the fast path, MUFU.EX2
    before the wait for P V, the mbarrier arrives before that wait)."""
    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]
    names = [t for _, t in ins]
    for k, t in enumerate(names):
        if "BAR.RED.OR" not in t:
            continue
        start = max(i for i in range(k) if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in names[i])
        body = names[start:k]
        if any("HGMMA" in x for x in body):
            continue
        pv = [i for i, x in enumerate(body) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in x]
        after_pv = body[pv[0]:] if pv else []
        # the fast path: where the first branch after the agreement goes, to the next backward branch
        target = int(re.search(r"BRA\s+(?:`\(\S+\)\s*)?0x([0-9a-f]+)", next(x for x in names[k:] if "BRA" in x)).group(1), 16)
        fast = []
        for a, x in ins:
            if a >= target:
                fast.append(x)
                m = re.search(r"BRA\s+0x([0-9a-f]+)", x)
                if m and int(m.group(1), 16) < a:
                    break
        before_pv = body[:pv[0]] if pv else body
        return (sum(bool(re.search(r"\bF2FP\b", x)) for x in after_pv),
                sum(bool(re.search(r"\bMUFU\.EX2\b", x)) for x in after_pv),
                sum(bool(re.search(r"\bF2FP\b", x)) for x in fast),
                sum(bool(re.search(r"\bMUFU\.EX2\b", x)) for x in before_pv),
                [x for x in before_pv if "SYNCS.ARRIVE" in x])
    raise AssertionError("no unmasked loop with a redo agreement")


@pytest.mark.skipif(ci._find_tool("cuobjdump") is None and ci._find_tool("nvdisasm") is None,
                    reason="no cuobjdump/nvdisasm here")
def test_sm90_prefill_p_tail_converts_during_softmax(monkeypatch):
    """``p_tail`` (the head_dim 64 default): the unmasked loop waits for the previous P V while its exponentials
    run and converts P there (14 of 16 n8 tiles: 28 ``F2FP``, exponentials still to come after the wait), leaving
    2 tiles (4 ``F2FP``) for after the redo agreement; without it all 32 come after the softmax.
    ``p_wait_lead=4`` pins that wait late with an arrive on a dummy mbarrier predicated on the running row sums
    (at least 40 of the 64 exponentials before it); the only arrive before the wait is that one -- at the
    dummy's constant offset behind the K, V and Q barriers -- so the V stage is released after the wait, never
    while P V still reads it.  Unpinned, ptxas hoists the wait behind the first few exponentials.  A schedule of
    one ptxas: :func:`_require_measured_toolchain`."""
    keys = dict(dtype="bfloat16", head_dim_qk=64, group_size=1, causal=True)
    _require_measured_toolchain(ci.ptx("prefill", "sm_90a", **keys))
    cfg = ci.config("prefill", "sm_90a", **keys)
    t = cfg.tiles
    assert t.softmax is Softmax.STALE and t.loop_order is LoopOrder.SPLIT_LATE_V
    assert (t.p_tail, t.p_wait_lead, t.tile_n) == (2, 4, 128) and cfg.pins_pv_wait
    f2fp, mufu, tail, before, arrives = _unmasked_loop_p(ci.sass("prefill", "sm_90a", **keys))
    assert f2fp == 28 and mufu >= 8 and tail == 4 and before >= 40, (f2fp, mufu, tail, before)
    dummy = 8 * (4 * t.num_stages + 2 * t.q_stages)  # mbar_k, mbar_v (2 per stage), mbar_q, then the dummy
    assert len(arrives) == 1 and re.search(rf"\[UR\d+\+{hex(dummy)}\]", arrives[0]), arrives
    monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_TUNE", "p_wait_lead=0")
    assert not ci.config("prefill", "sm_90a", **keys).pins_pv_wait
    f2fp, mufu, tail, before, arrives = _unmasked_loop_p(ci.sass("prefill", "sm_90a", **keys))
    assert f2fp == 28 and tail == 4 and before <= 16 and not arrives, (f2fp, mufu, tail, before, arrives)
    monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_TUNE", "p_tail=0,p_wait_lead=0")
    f2fp, mufu, tail, before, arrives = _unmasked_loop_p(ci.sass("prefill", "sm_90a", **keys))
    assert f2fp == 0 and tail == 32, (f2fp, mufu, tail)
    for bad in ("p_tail=16", "p_wait_lead=-1"):
        monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_TUNE", bad)
        with pytest.raises(ValueError, match=bad.split("=")[0]):
            ci.config("prefill", "sm_90a", **keys)


@pytest.mark.skipif(ci._find_tool("cuobjdump") is None and ci._find_tool("nvdisasm") is None,
                    reason="no cuobjdump/nvdisasm here")
@pytest.mark.parametrize("tune,page_size", [("num_ctas=132", 0), ("rescale_o_before_pv=1", 0),
                                            ("pingpong=0,num_wg=3", 0), ("rescale_o_before_pv=1", 16),
                                            ("epilogue=smem_tma", 0), ("epilogue=smem_tma,num_wg=3,tile_info=smem", 0)])
def test_sm90_prefill_tuning_options_keep_pipeline(monkeypatch, tune, page_size):
    """The tuning options (CUTEDSL_ATTN_PREFILL_TUNE) build spill-free kernels whose wgmma pipeline survives
    ptxas.  The persistent variant's first version failed both (LLVM hoisted per-thread addresses out of
    the tile loop and duplicated the P conversion; see common.ptx.opaque_i32 and BlockSoftmax._to_p)."""
    monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_TUNE", tune)
    keys = dict(dtype="bfloat16", head_dim_qk=128 if "num_wg" not in tune else 64, group_size=4, causal=True,
                page_size=page_size)
    cfg = ci.config("prefill", "sm_90a", **keys)
    assert isinstance(cfg, Sm90Config)
    if "num_ctas" in tune:
        assert cfg.num_ctas == 132
        ptx = ci.ptx("prefill", "sm_90a", **keys)
        assert "%nctaid.x" in ptx and "atom.global.add.u32" in ptx, "tiles claimed from an atomic counter"
    if "smem_tma" in tune:  # a warp's staged rows leave by TMA, one lane issuing, reads waited for
        assert (cfg.tiles.epilogue is Epilogue.SMEM_TMA)
        ptx = ci.ptx("prefill", "sm_90a", **keys)
        stores = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx)
        assert len(stores) == cfg.problem.head_dim_vo // 64
        assert "cp.async.bulk.wait_group.read" in ptx
        # issued under `lane == 0` (CuTe DSL 4.8.1 emits the store unpredicated, no elect of its own): were a
        # DSL upgrade to add an elect.sync inside that one-lane branch, it would hang -- fail here first
        before = ptx.split(stores[0], 1)[0].rsplit("bar.warp.sync", 1)[1]
        assert "elect.sync" not in before
    text = ci.sass("prefill", "sm_90a", **keys)
    # one wait per GEMM site: first block, the main loop (two waits; loop_split: two main loops), last P V, and
    # stale_max's redo of a block, p_tail's wait inside the unmasked loop's softmax
    assert len(re.findall(r"WARPGROUP\.DEPBAR", text)) <= (6 if (cfg.tiles.loop_order is not LoopOrder.FA3) else 4) + (cfg.tiles.softmax is Softmax.STALE) + (cfg.tiles.p_tail > 0)
    assert len(re.findall(r"\bHGMMA\.", text)) >= 16
    assert ci.resources("prefill", "sm_90a", **keys)["stack_bytes"] == 0


@pytest.mark.parametrize("page_size,head_dim,tile_n,page_rows", [
    (16, 128, 176, 16),   # 11 pages per block
    (64, 128, 128, 64),   # 176 and 64 do not divide: tile_n 128, 2 pages per block
    (128, 256, 64, 64),   # 2 blocks per page
    (32, 64, 128, 32),    # three warpgroups keep tile_n 128
    (44, 128, 176, 0),    # 44 divides 176 but a 44-row box is not whole swizzle atoms: gather
    (48, 128, 176, 0),    # neither 176 nor 128 works with 48: gather, tiles unchanged
    (8, 128, 176, 0),     # pages under 16 tokens: gather
])
def test_sm90_paged_tile_choice(page_size, head_dim, tile_n, page_rows):
    """Paged K/V: the default tiles make full blocks whole pages (or part of one) where that gives TMA boxes of
    whole 8-row swizzle atoms; other page sizes keep the tiles and gather."""
    cfg = ci.config("prefill", "sm_90a", kernel="sm90", dtype="bfloat16", head_dim_qk=head_dim, group_size=4,
                    causal=True, page_size=page_size)
    assert (cfg.tiles.tile_n, cfg.page_rows) == (tile_n, page_rows), cfg


def test_sm90_paged_odd_page_size_builds_with_gather():
    """A page size whose box would not be whole swizzle atoms (44 rows) builds the gather path: TMA only for Q."""
    keys = dict(dtype="bfloat16", head_dim_qk=128, group_size=4, causal=True, page_size=44)
    text = ci.ptx("prefill", "sm_90a", kernel="sm90", **keys)
    assert len(re.findall(r"cp\.async\.bulk\.tensor", text)) == 2 and "cp.async.cg.shared.global" in text


def test_sm90_prefill_persistent_needs_ragged_kv(monkeypatch):
    """The persistent grid claims tiles in the producer warp, which the paged gather does not have to itself,
    and the kv-head sections of the tile order read K's token count, which paged K/V lacks: paged problems
    ignore ``num_ctas`` and ``head_section_mib`` (so one tuning setting serves a process with both), ragged ones
    take them; ``head_section_mib`` is range-checked."""
    ragged = PrefillProblem(dtype="bfloat16", head_dim_qk=128, head_dim_vo=128, group_size=1)
    paged = PrefillProblem(dtype="bfloat16", head_dim_qk=128, head_dim_vo=128, group_size=1, page_size=16)
    tiles = Tiles(num_ctas=132, head_section_mib=32)
    assert (Sm90Config(ragged, tiles).num_ctas, Sm90Config(ragged, tiles).head_section_mib) == (132, 32)
    assert (Sm90Config(paged, tiles).num_ctas, Sm90Config(paged, tiles).head_section_mib) == (0, 0)
    assert default_tiles(paged, num_sms=132).num_ctas == 0 and default_tiles(ragged, num_sms=100).num_ctas == 100
    monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_TUNE", "num_ctas=100,tile_n=128")
    keys = dict(dtype="bfloat16", head_dim_qk=128, group_size=1)
    assert ci.config("prefill", "sm_90a", **keys).num_ctas == 100
    cfg = ci.config("prefill", "sm_90a", **keys, page_size=16)
    assert (cfg.num_ctas, cfg.tiles.tile_n) == (0, 128)
    for bad in (-1, 1025):
        with pytest.raises(ValueError, match=r"head_section_mib must be in 0\.\.1024"):
            Sm90Config(ragged, Tiles(head_section_mib=bad))


def test_sm90_prefill_head_dim_256_tiles():
    """head_dim 256 takes FlashAttention-4's SM90 tiles and conditional rescaling where they were timed -- plain
    problems with ragged K/V -- and the ping-pong tiles of 64 (staged epilogue) with paged K/V;
    ``rescale_threshold`` (log2 units) is range-checked: P <= 2^threshold must fit float16."""
    def tiles(**kw):
        return default_tiles(PrefillProblem(dtype="bfloat16", head_dim_qk=256, head_dim_vo=256, group_size=1,
                                            causal=True, **kw), num_sms=132)

    assert tiles() == Tiles(tile_n=80, pingpong=False, rescale_o_before_pv=True, rescale_threshold=8,
                            epilogue=Epilogue.SMEM)
    for ps in (1, 16, 32, 48, 128):
        assert tiles(page_size=ps) == Tiles(tile_n=64, epilogue=Epilogue.SMEM)
    assert tiles(use_window=True) == Tiles(tile_n=64)
    p = PrefillProblem(dtype="bfloat16", head_dim_qk=256, head_dim_vo=256, group_size=1)
    assert Sm90Config(p, Tiles(tile_n=64, rescale_threshold=15)).tiles.rescale_threshold == 15
    for bad in (-1, 16, True):
        with pytest.raises(ValueError, match="rescale_threshold"):
            Sm90Config(p, Tiles(tile_n=64, rescale_threshold=bad))


def test_sm90_prefill_stale_max_config():
    """The stale softmax is the default where it measured faster -- the plain three-warpgroup problems with ragged
    K/V (d64, d128 causal and full, GQA) -- and not at head_dim 256 (equal), for paged K/V, windows, soft caps,
    score_mods or custom masks (untimed or refused); it is refused where the block's logits are not
    ``sm_scale * q.k`` (soft cap, score_mod) or every block is masked (custom mask); ``p_tail`` / ``p_wait_lead``
    only with it and a split loop."""
    def problem(d, g=1, **kw):
        return PrefillProblem(dtype="bfloat16", head_dim_qk=d, head_dim_vo=d, group_size=g, **kw)

    for d, g, causal in ((64, 1, True), (64, 8, False), (128, 1, True), (128, 4, True), (128, 1, False)):
        assert default_tiles(problem(d, g, causal=causal), num_sms=132).softmax is Softmax.STALE, (d, g, causal)
    for d, kw in ((256, {}), (128, dict(page_size=16)), (64, dict(page_size=16)), (128, dict(use_window=True)),
                  (128, dict(use_soft_cap=True)), (64, dict(score_mod=lambda s, b, h, q, k: s)),
                  (128, dict(use_custom_mask=True))):
        assert default_tiles(problem(d, causal=not kw.get("use_custom_mask"), **kw), num_sms=132).softmax \
            is Softmax.EXACT, (d, kw)
    stale = Tiles(softmax=Softmax.STALE)
    assert Sm90Config(problem(128, use_window=True, page_size=16), stale).tiles.softmax is Softmax.STALE
    for bad in (dict(use_soft_cap=True), dict(score_mod=lambda s, b, h, q, k: s), dict(use_custom_mask=True)):
        with pytest.raises(ValueError, match="softmax=stale needs"):
            Sm90Config(problem(128, **bad), stale)
    with pytest.raises(ValueError, match="softmax must be a Softmax"):
        Sm90Config(problem(128), Tiles(softmax="stale"))
    for bad in (Tiles(p_tail=2), Tiles(softmax=Softmax.STALE, p_tail=2),
                Tiles(loop_order=LoopOrder.SPLIT, p_wait_lead=4)):
        with pytest.raises(ValueError, match="p_tail / p_wait_lead"):
            Sm90Config(problem(64), bad)


def test_sm90_prefill_head_sections_default():
    """The tile order by sections of kv heads (32 MiB of K+V) is the default where it was measured faster: causal
    problems on the persistent grid (ragged K/V, head_dim <= 128); not for full attention, head_dim 256 (one CTA
    per tile), paged K/V (no token count of K) or a custom mask (which replaces causal)."""
    def mib(d, g=1, **kw):
        p = PrefillProblem(dtype="bfloat16", head_dim_qk=d, head_dim_vo=d, group_size=g, **kw)
        return default_tiles(p, num_sms=132).head_section_mib

    for d, g, kw in ((128, 1, {}), (128, 4, {}), (64, 1, {}), (128, 4, dict(use_window=True))):
        assert mib(d, g, causal=True, **kw) == 32
    for d, kw in ((128, dict(causal=False)), (256, dict(causal=True)), (128, dict(causal=True, page_size=16)),
                  (128, dict(use_custom_mask=True)), (64, dict(causal=False))):
        assert mib(d, **kw) == 0


def test_prefill_tune_env(monkeypatch):
    """The tuning hook: ``override_tiles`` parses integer, boolean and enum fields (a member's lowercase name) and
    names the key and its allowed values for a bad item; dispatch applies CUTEDSL_ATTN_PREFILL_TUNE through it."""
    t = override_tiles(Tiles(), {"tile_n": " 128", "pingpong": "false", "num_ctas": "8", "epilogue": "smem_tma",
                                 "loop_order": "SPLIT_late_v", "softmax": "stale", "tile_info": "smem_early"})
    assert t == Tiles(tile_n=128, pingpong=False, num_ctas=8, epilogue=Epilogue.SMEM_TMA,
                      loop_order=LoopOrder.SPLIT_LATE_V, softmax=Softmax.STALE, tile_info=TileInfo.SMEM_EARLY)
    assert override_tiles(t, {}) == t
    for key, val, msg in (("pingpong", "2", "pingpong takes 0/1/true/false"), ("tile_n", "x", "tile_n takes an integer"),
                          ("epilogue", "tma", r"epilogue takes one of \['regs', 'smem', 'smem_tma'\]"),
                          ("causal", "1", "'causal' is not a tuning field"), ("ex2_poly", "3", "not a tuning field"),
                          ("trace", "1", "not a tuning field"), ("k_release_early", "1", "not a tuning field")):
        with pytest.raises(ValueError, match=msg):
            override_tiles(Tiles(), {key: val})
    keys = dict(dtype="bfloat16", head_dim_qk=128, group_size=1)
    monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_TUNE", " tile_n=128, pingpong=false,num_ctas=8,")
    cfg = ci.config("prefill", "sm_90a", **keys)
    assert (cfg.tiles.tile_n, cfg.tiles.pingpong, cfg.num_ctas) == (128, False, 8)
    monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_TUNE", "epilogue=tma")
    with pytest.raises(ValueError, match="epilogue"):
        ci.config("prefill", "sm_90a", **keys)
    # an override that does not fit this problem is refused by the config, naming the rule
    monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_TUNE", "tile_n=128")
    with pytest.raises(ValueError, match="shared memory"):
        ci.config("prefill", "sm_90a", **{**keys, "head_dim_qk": 256})
    # the staged epilogue off takes its TMA store with it (one enum), whatever the default was
    monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_TUNE", "epilogue=regs,q_stages=1,tile_n=176")
    cfg = ci.config("prefill", "sm_90a", **dict(keys, group_size=4, causal=True))
    assert (cfg.tiles.epilogue, cfg.tiles.tile_n) == (Epilogue.REGS, 176)


def test_prefill_tuning_fields():
    """Every field of ``Tiles`` is a tuning field (derived from the dataclass, no hand-kept list); each takes its
    default's type; a staged epilogue needs head_dim_vo <= head_dim_qk (it writes O into Q's rows); early epilogue
    coordinates only with the register epilogue."""
    from dataclasses import fields

    from cutedsl_attn.sm90.prefill import TUNING_FIELDS

    assert TUNING_FIELDS == tuple(f.name for f in fields(Tiles))
    assert {"tile_n", "q_stages", "epilogue", "loop_order", "softmax", "tile_info"} <= set(TUNING_FIELDS)
    assert not {"trace", "ex2_poly", "k_release_early", "claim_after_q"} & set(TUNING_FIELDS)
    p = PrefillProblem(dtype="bfloat16", head_dim_qk=128, head_dim_vo=128, group_size=1)
    p64 = PrefillProblem(dtype="bfloat16", head_dim_qk=64, head_dim_vo=128, group_size=1)
    for f in fields(Tiles):
        wrong = 2 if isinstance(f.default, bool) else True
        with pytest.raises(ValueError, match=f"{f.name} must be"):
            Sm90Config(p, Tiles(**{f.name: wrong}))
    with pytest.raises(ValueError, match="q_stages must be 1 or 2"):
        Sm90Config(p, Tiles(q_stages=3))
    with pytest.raises(ValueError, match="head_dim_vo <= head_dim_qk"):
        Sm90Config(p64, Tiles(epilogue=Epilogue.SMEM))
    with pytest.raises(ValueError, match="num_wg must be 2 or 3"):
        Sm90Config(p, Tiles(num_wg=4, tile_n=64))
    assert Sm90Config(p, Tiles(num_wg=3, tile_n=80)).tile_m == 192
    with pytest.raises(ValueError, match="shared memory"):  # two Q stages at tile_n 176 do not fit
        Sm90Config(p, Tiles(q_stages=2, tile_n=176))
    with pytest.raises(ValueError, match="needs epilogue=regs"):
        Sm90Config(p, Tiles(epilogue=Epilogue.SMEM, tile_info=TileInfo.SMEM_EARLY))
    with pytest.raises(TypeError, match="PrefillProblem and a Tiles"):
        Sm90Config(p, dict(tile_n=128))


@pytest.mark.parametrize("keys", [dict(head_dim_qk=128, group_size=4, causal=True),
                                  dict(head_dim_qk=64, group_size=8, causal=True),
                                  dict(head_dim_qk=128, group_size=4, page_size=1, use_custom_mask=True)],
                         ids=["hd128_staged", "hd64", "hd128_paged1_mask"])
def test_sm90_prefill_tile_info_smem_ptx(monkeypatch, keys):
    """``tile_info=smem`` (on at head_dim 64, with early epilogue coordinates): the consumers' scalar reads of the
    work table (global ``ld`` of 32-bit fields) move to shared memory -- fewer global loads, more shared ones,
    same GEMMs, no spills."""
    keys = dict(dtype="bfloat16", **keys)
    ldg = r"ld\.global(\.nc)?\.[bsu]32"
    want = TileInfo.SMEM_EARLY if keys["head_dim_qk"] == 64 else TileInfo.GLOBAL
    assert ci.config("prefill", "sm_90a", **keys).tiles.tile_info is want
    monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_TUNE", "tile_info=global")
    off = ci.ptx("prefill", "sm_90a", **keys)
    monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_TUNE", "tile_info=smem")
    assert ci.config("prefill", "sm_90a", **keys).tiles.tile_info is TileInfo.SMEM
    on = ci.ptx("prefill", "sm_90a", **keys)
    assert len(re.findall(ldg, on)) < len(re.findall(ldg, off))
    assert len(re.findall(r"ld\.shared", on)) > len(re.findall(r"ld\.shared", off))
    assert len(re.findall(r"wgmma\.mma_async", on)) == len(re.findall(r"wgmma\.mma_async", off))
    assert ci.resources("prefill", "sm_90a", **keys)["stack_bytes"] == 0




def test_sm90_prefill_trace_kernel_ptx():
    """The per-tile ``%clock64`` trace is a perf tool's kernel subclass (perf/trace_prefill.py fills the kernel's
    empty trace hooks): stamps at the tile's start, first S GEMM, last P V and epilogue (consumers), finer ones in
    warpgroup 0 with two consumer warpgroups and the Q hand-over (producer); the product kernel has none."""
    sys.path.insert(0, str(REPO / "perf"))
    try:
        import trace_prefill as tp
    finally:
        sys.path.pop(0)
    import glob
    import tempfile

    keys = dict(dtype="bfloat16", head_dim_qk=128, group_size=4, causal=True)
    assert "%clock64" not in ci.ptx("prefill", "sm_90a", **keys)
    prob = PrefillProblem(head_dim_vo=128, **keys)
    for over, stamps in (({}, 5), (dict(num_wg="2", tile_n="160"), 11)):
        cfg = Sm90Config(prob, override_tiles(default_tiles(prob, num_sms=132), over))
        with tempfile.TemporaryDirectory() as d:
            tp.build(tp.TracedKernel(cfg), cfg, keep_ptx_dir=d)
            (path,) = glob.glob(os.path.join(d, "*.ptx"))
            text = open(path).read()
        assert text.count("%clock64") == stamps and len(re.findall(r"st\.global\.u64", text)) >= stamps


@pytest.mark.parametrize("keys", [dict(head_dim_qk=128, group_size=4), dict(head_dim_qk=64, group_size=8, page_size=16),
                                  dict(head_dim_qk=192, head_dim_vo=128, group_size=1, use_window=True)],
                         ids=["hd128_ragged", "hd64_paged16", "hd192_window"])
def test_sm90_prefill_custom_mask_ptx(keys):
    """Custom masks run on the SM90 kernel: two warpgroups x tile_n 64 (tile_n 128 spilled 240 B), every
    block masked from one byte of the packed mask per score element (``ld.global`` u8), the causal flag
    ignored (the mask replaces it), still TMA + wgmma, no spills (head_dim 256 spills 16-40 B, below)."""
    keys = dict(dtype="bfloat16", causal=False, use_custom_mask=True, **keys)
    cfg = ci.config("prefill", "sm_90a", **keys)
    assert isinstance(cfg, Sm90Config) and (cfg.tiles.tile_n, cfg.tiles.num_wg) == (64, 2), cfg
    text = ci.ptx("prefill", "sm_90a", **keys)
    # one mask byte per score: 2 places (first block, main loop) x 2 rows x tile_n / 4 values per thread
    assert len(re.findall(r"ld\.global(\.\w+)*\.[bu]8", text)) == 2 * 2 * cfg.tiles.tile_n // 4
    assert "wgmma.mma_async" in text and "cp.async.bulk.tensor" in text
    # the mask replaces causal (FlashInfer; the portable kernel too): a causal flag changes nothing
    assert ci.ptx("prefill", "sm_90a", **{**keys, "causal": True}) == text
    plain = ci.ptx("prefill", "sm_90a", **{**keys, "use_custom_mask": False}, kernel="sm90")
    assert not re.search(r"ld\.global(\.\w+)*\.[bu]8", plain)
    assert ci.resources("prefill", "sm_90a", **keys)["stack_bytes"] == 0


@pytest.mark.parametrize("tune", ["loop_order=split", "loop_order=split_late_v,softmax=exact"])
def test_sm90_prefill_loop_order_variants_build(monkeypatch, tune):
    """FlashAttention's main-loop orders (the d64 default uses ``split_late_v``): a split loop issues the main
    loop's GEMMs in two loops (masked blocks, then the rest: 3 places for S and for P V instead of 2); every
    order builds without spills for causal, window + soft cap and paged problems."""
    keys = dict(dtype="bfloat16", head_dim_qk=128, group_size=4, causal=True)
    base = ci.ptx("prefill", "sm_90a", **keys)
    monkeypatch.setenv("CUTEDSL_ATTN_PREFILL_TUNE", tune)
    cfg = ci.config("prefill", "sm_90a", **keys)
    assert cfg.tiles.loop_order is not LoopOrder.FA3
    text = ci.ptx("prefill", "sm_90a", **keys)
    places = 3
    qk = len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{cfg.tiles.tile_n}k16", text))
    pv = len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16", text))
    stale = cfg.tiles.softmax is Softmax.STALE
    assert (qk, pv) == ((places + stale) * 8, places * cfg.tiles.tile_n // 16), (qk, pv)  # (+ the redo's S)
    assert text != base
    for extra in (dict(), dict(use_window=True, use_soft_cap=True), dict(page_size=16)):
        assert ci.resources("prefill", "sm_90a", **{**keys, **extra})["stack_bytes"] == 0, extra


@pytest.mark.parametrize("page_size", [0, 1, 16])
def test_sm90_prefill_custom_mask_hd256_spill_bound(page_size):
    """At head_dim 256 (O alone is 128 registers per consumer thread) a custom mask spills 16-40 B even at
    tile_n 64 (the documented exception; ragged / gather / TMA pages); the bound keeps it from growing."""
    keys = dict(dtype="bfloat16", head_dim_qk=256, group_size=1, use_custom_mask=True, page_size=page_size)
    cfg = ci.config("prefill", "sm_90a", **keys)
    assert isinstance(cfg, Sm90Config) and cfg.tiles.tile_n == 64
    assert ci.resources("prefill", "sm_90a", **keys)["stack_bytes"] <= 48




def test_cubin_resources_rejects_non_elf():
    with pytest.raises(ValueError, match="ELF"):
        ci.cubin_resources(b"not a cubin at all")


def test_sm90_prefill_routing():
    """What the SM90 kernel does not serve goes to the portable kernel; it never builds for Blackwell."""
    from cutedsl_attn.sm90.prefill import unsupported_reason

    base = dict(dtype="bfloat16", head_dim_qk=128, group_size=4)
    assert isinstance(ci.config("prefill", "sm_90a", **base, page_size=16), Sm90Config)
    assert isinstance(ci.config("prefill", "sm_90a", **base, use_custom_mask=True), Sm90Config)
    for over in (dict(pos_encoding_mode="ROPE_LLAMA"),
                 dict(pos_encoding_mode="ALIBI"), dict(group_size=3), dict(head_dim_qk=32)):
        cfg = ci.config("prefill", "sm_90a", **{**base, **over})
        assert not isinstance(cfg, Sm90Config), over
    assert not isinstance(ci.config("prefill", "sm_100a", **base), Sm90Config)
    assert not isinstance(ci.config("prefill", "sm_90a", **base, kernel="portable"), Sm90Config)
    with pytest.raises(ValueError, match="SM90 prefill kernel cannot serve"):
        ci.config("prefill", "sm_90a", **base, pos_encoding_mode="ALIBI", kernel="sm90")
    p = PrefillProblem(dtype="bfloat16", head_dim_qk=128, head_dim_vo=128, group_size=1)
    assert unsupported_reason(p) is None
    assert "portable" in unsupported_reason(PrefillProblem(**{**p.__dict__, "pos_encoding_mode": "ALIBI"}))
    assert "divide 128" in unsupported_reason(PrefillProblem(**{**p.__dict__, "group_size": 3}))
    with pytest.raises(ValueError, match="sm_90a only"):
        Sm90Config(PrefillProblem(**{**p.__dict__, "arch": "sm_100a"}), Tiles())
    with pytest.raises(ValueError, match="shared memory"):
        Sm90Config(PrefillProblem(**{**p.__dict__, "head_dim_qk": 256, "head_dim_vo": 256}),
                   Tiles(tile_n=128, num_stages=3))


# ----------------------------------------------------------------------------- prefill positional encodings
# Portable-kernel configs built directly (the API routes every ROPE_LLAMA / ALIBI problem to this kernel).
PREFILL_POS_BASE = dict(dtype="bfloat16", head_dim_qk=128, head_dim_vo=128, group_size=4, page_size=16, causal=True)


def _prefill_pos_ptx(arch, mode, **over):
    from cutedsl_attn.planning.prefill import PrefillProblem
    from cutedsl_attn.portable import prefill as pf

    problem = PrefillProblem(**{**PREFILL_POS_BASE, **over}, pos_encoding_mode=mode, arch=arch)
    return ci._ptx_cached(pf.Config(problem, pf.default_tiles(problem, num_sms=132)))


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_ptx_pos_encodings(arch):
    texts = {mode: _prefill_pos_ptx(arch, mode) for mode in ("NONE", "ROPE_LLAMA", "ALIBI")}
    s = {mode: ci.instruction_summary(t) for mode, t in texts.items()}
    for mode, t in texts.items():
        assert re.search(rf"^\.target\s+{arch}\s*$", t, re.M), mode
        assert len(re.findall(r"^\.(?:visible\s+)?\.entry\s+\S*PrefillKernel", t, re.M)) == 1
        # the entry takes 16 parameters: 10 tensors (struct params) and 6 scalars (the last the output scale)
        entry = re.search(r"\.entry\s+\S+\(\s*(.*?)\)", t, re.S).group(1)
        assert entry.count(".param") == 16, mode
        # tensor-core work identical in every mode: QK (8 k-steps x 8 n-tiles) + PV (4 k-steps x 16 n-tiles)
        assert s[mode]["mma.sync"] == s[mode]["mma.sync.bf16"] == 8 * 8 + 4 * 16, mode
        assert s[mode]["ld.local"] == 0 and s[mode]["st.local"] == 0, f"{mode}: register spills"
        assert s[mode]["wgmma"] == s[mode]["tcgen05"] == 0
    # NONE and ALIBI compute no rotation; ROPE_LLAMA rotates Q once and each K tile (sin/cos), behind two
    # extra CTA barriers (after the Q pass and after each K pass)
    assert s["NONE"]["sin/cos"] == s["ALIBI"]["sin/cos"] == 0
    assert s["ROPE_LLAMA"]["sin/cos"] > 0 and s["ROPE_LLAMA"]["bar.sync"] == s["NONE"]["bar.sync"] + 2
    assert "cvt.rni.f32.f32" in texts["ROPE_LLAMA"] and "cvt.rni.f32.f32" not in texts["NONE"]  # range reduction
    # ALIBI: same exponentials as NONE (the bias is an FMA on the logit), a few more instructions
    assert s["ALIBI"]["ex2"] == s["NONE"]["ex2"] and s["ALIBI"]["total"] > s["NONE"]["total"]


def test_prefill_ptx_rope_hd192_and_alibi_ragged():
    # head_dim 192/128: Q re-read from smem per tile and a per-pair frequency (D/2 = 96 does not divide the
    # 128 threads); ALIBI on a ragged fp16 group-1 config with a window
    rope = ci.instruction_summary(_prefill_pos_ptx("sm_100a", "ROPE_LLAMA", dtype="float16", head_dim_qk=192,
                                                   group_size=1, page_size=0))
    assert rope["sin/cos"] > 0 and rope["mma.sync"] == rope["mma.sync.f16"] == 12 * 8 + 4 * 16
    alibi = ci.instruction_summary(_prefill_pos_ptx("sm_100a", "ALIBI", dtype="float16", head_dim_qk=64,
                                                    head_dim_vo=64, group_size=1, page_size=0, use_window=True))
    assert alibi["sin/cos"] == 0 and alibi["ld.local"] == alibi["st.local"] == 0
    assert alibi["mma.sync"] == 4 * 8 + 4 * 8


def test_prefill_config_pos_encoding_mode():
    from cutedsl_attn.planning.prefill import PrefillProblem
    from cutedsl_attn.portable import prefill as pf

    with pytest.raises(ValueError, match="pos_encoding_mode"):
        PrefillProblem(dtype="bfloat16", head_dim_qk=128, head_dim_vo=128, group_size=1, pos_encoding_mode="XPOS")
    base = dict(dtype="bfloat16", head_dim_qk=128, head_dim_vo=128, group_size=1)
    assert PrefillProblem(**base).pos_encoding_mode == "NONE"
    cfgs = {pf.Config(PrefillProblem(**base, pos_encoding_mode=m), pf.Tiles()) for m in ("NONE", "ROPE_LLAMA", "ALIBI")}
    assert len(cfgs) == 3


def _make_bias(c):
    def bias(score, batch_idx, head_idx, q_idx, kv_idx):
        return score - c * (q_idx - kv_idx) + 0.125 * head_idx - 0.5 * batch_idx
    return bias


def _f32_hex(v: float) -> str:
    import struct
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]


@pytest.mark.parametrize("arch,kernel", [("sm_90a", "sm90"), ("sm_100a", "portable")])
def test_score_mod_traced_into_prefill(arch, kernel):
    """A user score_mod (a Python closure) is traced into the prefill kernel: the SM90 kernel for sm_90a (still
    wgmma + TMA) and the portable one for sm_100a (mma.sync); the closure's value is in the PTX and in the
    compile key (another value, another kernel), and no score_mod means no such code."""
    keys = dict(dtype="bfloat16", head_dim_qk=128, group_size=4, causal=True, kernel=kernel)
    b1, b2 = _make_bias(0.03), _make_bias(0.07)
    c1, c2 = ci.config("prefill", arch, score_mod=b1, **keys), ci.config("prefill", arch, score_mod=b2, **keys)
    assert isinstance(c1, Sm90Config) == (kernel == "sm90")
    assert getattr(c1, "problem", c1).score_mod is b1 and c1 != c2
    from cutedsl_attn.compile.cache import config_key
    assert config_key(c1) != config_key(c2)
    assert config_key(c1) == config_key(ci.config("prefill", arch, score_mod=_make_bias(0.03), **keys))
    t1 = ci.ptx("prefill", arch, score_mod=b1, **keys)
    t0 = ci.ptx("prefill", arch, **keys)
    assert _f32_hex(0.03) in t1 and _f32_hex(0.07) not in t1 and _f32_hex(0.03) not in t0
    # q_idx - kv_idx, head_idx and batch_idx converted to float per score
    assert t1.count("cvt.rn.f32.s32") > t0.count("cvt.rn.f32.s32") + 32
    if kernel == "sm90":
        assert "wgmma.mma_async" in t1 and "cp.async.bulk.tensor" in t1
        # head_dim 128: three warpgroups x tile_n 80 with the conditional rescaling (measured faster),
        # without spills for this score_mod
        t = c1.tiles
        assert (t.num_wg, t.tile_n, t.rescale_threshold, t.softmax) == (3, 80, 8, Softmax.EXACT)
        assert ci.resources("prefill", arch, score_mod=b1, **keys)["stack_bytes"] == 0
    else:
        assert "mma.sync.aligned.m16n8k16" in t1


def test_untraceable_score_mod_is_a_named_type_error(monkeypatch):
    """A score_mod with a Python branch on its arguments cannot be traced: the compile (first use) raises TypeError
    naming the score_mod, not the DSL's own error class."""
    from cutedsl_attn import dispatch

    monkeypatch.setenv("CUTEDSL_ATTN_ARCH", "sm_90a")

    def branchy(score, b, h, q, k):
        return score if q > k else score - 1.0

    p = dispatch.prefill_problem(dtype="bfloat16", head_dim_qk=128, head_dim_vo=128, group_size=4, causal=True,
                                 score_mod=branchy)
    with pytest.raises(TypeError, match="score_mod 'branchy' could not be traced"):
        dispatch.prefill_choice(p).fn


# ----------------------------------------------------------------------------- inspect ops: fp8 prefill, MLA, GDN
def test_config_prefill_kv_dtype():
    """``kv_dtype`` reaches the PrefillProblem: an fp8 paged cache builds the portable kernel on every arch (the SM90
    kernel reads 16-bit K/V); the query's own dtype is the 16-bit problem (one compile key)."""
    fp8 = ci.config("prefill", "sm_90a", page_size=16, kv_dtype="fp8")
    assert fp8.problem.kv_dtype == "float8_e4m3fn" and not isinstance(fp8, Sm90Config)
    assert ci.config("prefill", "sm_90a", page_size=16, kv_dtype="bfloat16") == ci.config("prefill", "sm_90a",
                                                                                         page_size=16)
    assert ci.config("prefill", "sm_100a", page_size=16, kv_dtype="float8_e4m3fn").problem.kv_fp8
    with pytest.raises(NotImplementedError, match="paged"):
        ci.config("prefill", "sm_90a", kv_dtype="fp8")  # ragged K/V
    with pytest.raises(ValueError, match="kv_dtype"):
        ci.config("prefill", "sm_90a", page_size=16, kv_dtype="float8_e5m2")


def test_config_mla_and_gdn():
    from cutedsl_attn import dispatch
    from cutedsl_attn.planning.gdn import GdnProblem
    from cutedsl_attn.planning.mla import MlaProblem
    from cutedsl_attn.portable import gdn_chunked, gdn_recurrent, mla_decode

    m = ci.config("mla", "blackwell")
    assert isinstance(m, mla_decode.Config)
    assert m.problem == MlaProblem(dtype="bfloat16", page_size=64, arch="sm_100a")
    assert m == dispatch.mla_choice(m.problem)[1]  # dispatch's tiles
    m8 = ci.config("mla", "sm_90a", dtype="fp8", kv_dtype="fp8", page_size=1, causal=True)
    assert m8.problem.q_fp8 and m8.problem.kv_fp8 and (m8.problem.page_size, m8.problem.causal) == (1, True)
    assert ci.config("mla", "sm_90a", kv_dtype="float8_e4m3fn").problem.kv_dtype == "float8_e4m3fn"
    g = ci.config("gdn", "sm_90a")
    assert g.__class__.__module__ == "cutedsl_attn.sm90.gdn_chunked"  # GDN prefill on sm_90a: the wgmma kernel
    assert isinstance(ci.config("gdn", "sm_100a"), gdn_chunked.Config)  # elsewhere the portable one
    assert g.problem == GdnProblem(dtype="bfloat16", head_dim_k=128, head_dim_v=128, arch="sm_90a")
    assert g == dispatch.gdn_choice(g.problem)[1]
    assert ci.config("gdn", "sm_90a", chains=4) == dispatch.gdn_choice(g.problem, chains=4)[1]
    for keys in (dict(decode=True), dict(state_k_major=True), dict(gate_per_channel=True, gate_domain="linear")):
        assert isinstance(ci.config("gdn", "sm_100a", **keys), gdn_recurrent.Config), keys
    kda = ci.config("gdn", "sm_100a", gate_per_channel=True)  # KDA / GDN-2 take log gates: the chunked kernel
    assert kda.problem.gate_domain == "log" and kda.__class__.__module__ == "cutedsl_attn.portable.kda_chunked"
    gdp = ci.config("gdn", "sm_100a", num_householder=2)  # Gated DeltaProduct: GDN on the expanded timeline
    assert isinstance(gdp, gdn_chunked.Config) and gdp.problem.num_householder == 1


@pytest.mark.parametrize("op,kw,exc,match", [
    ("mla", dict(page_size=65), ValueError, "page_size"),
    ("mla", dict(dtype="float32"), ValueError, "dtype"),
    ("mla", dict(dtype="fp8", kv_dtype="bfloat16"), ValueError, "kv_dtype"),  # an fp8 q over 16-bit caches
    ("mla", dict(head_dim=128), TypeError, "head_dim"),
    ("mla", dict(causal=1), TypeError, "causal"),
    ("gdn", dict(head_dim_k=32), ValueError, "head_dim"),
    ("gdn", dict(gate_domain="exp"), ValueError, "gate_domain"),
    ("gdn", dict(chains=0), ValueError, "chains"),
    ("gdn", dict(use_qk_l2norm="yes"), TypeError, "use_qk_l2norm"),
    ("gdn", dict(page_size=16), TypeError, "page_size"),
])
def test_config_mla_gdn_bad_arguments(op, kw, exc, match):
    with pytest.raises(exc, match=match):
        ci.config(op, "sm_90a", **kw)


def test_gdn_forced_kernel_refusal_is_a_value_error(monkeypatch):
    from cutedsl_attn.dispatch import gdn

    monkeypatch.setenv(gdn.GDN_KERNEL_ENV, "chunked")
    with pytest.raises(ValueError, match="chunked"):  # a problem of its family it cannot serve
        ci.config("gdn", "sm_90a", state_k_major=True)
    assert ci.config("gdn", "sm_90a", decode=True).__class__.__module__.endswith("gdn_recurrent")  # outside it


@pytest.mark.parametrize("arch", ARCHS)
def test_inspect_ptx_fp8_prefill_mla_gdn(arch):
    """The new ops cross-compile for each target, no tcgen05 and no local memory: the portable kernels on
    mma.sync (e4m3 widened by cvt where a cache is fp8); on sm_90a the SM90 ones on wgmma: GDN's prep and main
    kernel, MLA's fp8 path at page 64 and its 16-bit gathered path at page 32 (the choice for 64 heads and more:
    inspect knows no head count), each with the split-KV merge kernel."""
    texts = {
        "prefill_fp8": ci.ptx("prefill", arch, page_size=16, causal=True, kv_dtype="fp8"),
        "mla": ci.ptx("mla", arch, page_size=32),  # page 32: the SM90 gathered path on sm_90a, else portable
        "mla_fp8_p32": ci.ptx("mla", arch, page_size=32, kv_dtype="fp8"),
        "mla_fp8": ci.ptx("mla", arch, kv_dtype="fp8"),  # page 64: the SM90 kernel on sm_90a
        "gdn": ci.ptx("gdn", arch),
    }
    sm90 = {"gdn", "mla_fp8", "mla"} if arch == "sm_90a" else set()
    for name, t in texts.items():
        s = ci.instruction_summary(t)
        assert re.search(rf"^\.target\s+{arch}\s*$", t, re.M), name
        assert s["tcgen05"] == 0, name
        assert (s["wgmma"] > 0) == (name in sm90), name
        assert (s["mma.sync"] > 0) == (name not in sm90), name  # sm_90a: GDN's prep on wgmma too (prep = 1)
        assert s["ld.local"] == s["st.local"] == 0, name
        assert t.count(".entry") == (2 if name == "gdn" or name in sm90 else 1), name
        assert ("cvt.rn.f16x2.e4m3x2" in t) == ("fp8" in name), name


def test_decode_config_takes_the_fp8_cache_and_the_sm100_kernel():
    """inspect builds what a B200 would run: the fp8 decode kernel, and the tcgen05 one on request."""
    import cutedsl_attn.inspect as ci

    f8 = ci.config("decode", "sm_90a", kv_dtype="fp8")
    assert f8.problem.kv_dtype == "float8_e4m3fn"
    sm = ci.config("decode", "sm_100a", kernel="sm100")
    assert type(sm).__module__.startswith("cutedsl_attn.sm100.decode")
    assert type(ci.config("decode", "sm_100a")).__module__.startswith("cutedsl_attn.portable")  # no B200: portable
    with pytest.raises(ValueError, match="cannot serve"):
        ci.config("decode", "sm_90a", kernel="sm100")
    with pytest.raises(ValueError, match="decode kernel"):
        ci.config("decode", "sm_90a", kernel="sm90")


def test_cubin_resources_of_a_two_kernel_launch():
    """The chunked GDN function launches two kernels: each is reported by name, and the summary takes the larger."""
    import cutedsl_attn.inspect as ci

    cubin = ci._cubin_cached(ci.config("gdn", "sm_90a", use_qk_l2norm=True))
    per = ci.cubin_kernel_resources(cubin)
    assert len(per) == 2 and {"prep", "main"} == {n for k in per for n in ("prep", "main") if f"_{n}_" in k}, per
    assert all(v["stack_bytes"] == 0 and 0 < v["registers"] <= 255 for v in per.values())
    assert ci.cubin_resources(cubin) == {k: max(v[k] for v in per.values()) for k in ("registers", "stack_bytes")}
