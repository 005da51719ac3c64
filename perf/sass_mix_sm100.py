"""SASS instruction mix of the SM100 / SM103 tcgen05 kernels beside FlashAttention-4's SM100 forward kernel, all
cross-compiled on the CPU for the same problem (no GPU needed; nothing here runs a kernel).

    python perf/sass_mix_sm100.py                       # decode and prefill, sm_100a and sm_103a
    python perf/sass_mix_sm100.py --problem decode --arch sm_100a
    python perf/sass_mix_sm100.py --peers /tmp/peers    # FA4 already unpacked there (else from .devdeps/peers)

Problems (bf16, 32 query / 8 kv heads, head_dim 128):

* ``decode``: one query token per request, paged K/V of 64-token pages.  Ours: ``cutedsl_attn.sm100.decode`` at its
  default tiles.  FA4 has no decode kernel: its forward kernel with ``seqlen_q = 1``, ``pack_gqa=True`` (the 4
  query heads of a kv head share one M tile), the page table (64-token pages: its ``cp.async`` path, pages !=
  ``tile_n``), no split (``num_splits=1``).
* ``prefill``: causal, ragged (``cu_seqlens``) with GQA packing.  Ours: ``cutedsl_attn.sm100.prefill`` with one and
  two Q tiles (two: FA4's layout), each one CTA per tile and persistent (``num_ctas=148``); FA4's forward kernel
  as its interface configures it (two Q stages; not persistent for varlen).

Per kernel: static counts over the whole kernel (every role, prologue and epilogue), then the same categories
inside the "softmax loop" (of the innermost loops of the SASS, a backward branch's range, holding any MUFU.EX2,
the one holding the most) and the "MMA loop" (the same for UTC*MMA): for a kernel whose block loop is rolled
once per role these are the counts per KV block (per Q tile and block where two Q tiles are traced apart).

FA4 is imported from the unpacked peers bundle with three shims for this machine, none changing its device code:
``quack``'s package ``__init__`` is skipped (it imports triton for autotuning), ``einops`` stubbed when missing
(only FA4's test references use it), ``cutlass.utils.HardwareInfo`` answering 148 SMs (no driver), and register
tensors' ``.to(dtype)`` (newer DSLs have it) supplied where the installed DSL lacks it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

NUM_SMS = 148
HQ, HKV, D = 32, 8, 128
PAGE = 64

# category -> predicate on the SASS mnemonic (without its lowercase suffixes)
CATEGORIES = {
    "UTC*MMA": lambda op: re.match(r"UTC\w*MMA", op) is not None,
    "MUFU.EX2": lambda op: op == "MUFU.EX2",
    "FFMA2": lambda op: op.startswith("FFMA2"),
    "FFMA": lambda op: op == "FFMA" or (op.startswith("FFMA.") and not op.startswith("FFMA2")),
    "FMUL2/FADD2": lambda op: op.startswith(("FMUL2", "FADD2")),
    "LDTM": lambda op: op.startswith("LDTM"),
    "STTM": lambda op: op.startswith("STTM"),
    "SYNCS (mbarrier)": lambda op: op.startswith("SYNCS"),
    "UTCBAR (commit)": lambda op: op.startswith("UTCBAR"),
    "BAR (named)": lambda op: op.startswith("BAR."),
    "LDGSTS": lambda op: op.startswith("LDGSTS"),
    "UTMALDG": lambda op: op.startswith("UTMALDG"),
    "UTMASTG": lambda op: op.startswith("UTMASTG"),  # O out by TMA (our epilogue warp, FA4's when it has one)
    "STG.128": lambda op: op.startswith("STG") and ".128" in op,  # O out by 16-byte stores
}
LOOP_COLUMNS = ("UTC*MMA", "MUFU.EX2", "FFMA2", "FFMA", "LDTM", "STTM", "SYNCS (mbarrier)", "UTCBAR (commit)")

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")


# ----------------------------------------------------------------------------- SASS
def sass_of(cubin: str) -> str:
    from cutedsl_attn.inspect import _find_tool

    tool = _find_tool("cuobjdump")
    if tool is None:
        raise SystemExit("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    return subprocess.run([tool, "--dump-sass", cubin], check=True, capture_output=True, text=True).stdout


def parse(text: str):
    """``[(address, mnemonic, operands)]`` of the SASS, the mnemonic without lowercase suffixes (``LDTM.x32`` ->
    ``LDTM``)."""
    out = []
    for m in _LINE.finditer(text):
        op = ".".join(p for p in m.group(2).split(".") if p and not p[0].islower())
        out.append((int(m.group(1), 16), op, m.group(3)))
    return out


def mix(instrs) -> dict[str, int]:
    counts = {k: 0 for k in CATEGORIES}
    for _, op, _ in instrs:
        for k, pred in CATEGORIES.items():
            if pred(op):
                counts[k] += 1
    counts["instructions"] = len(instrs)
    return counts


def loops(instrs):
    """The address ranges ``[target, branch]`` of every backward branch before the kernel's last ``EXIT`` (a loop
    body with its back edge; after it, ptxas's out-of-line wait retries branch back without being loops)."""
    end = max((a for a, op, _ in instrs if op == "EXIT"), default=max(a for a, _, _ in instrs))
    out = []
    for addr, op, args in instrs:
        if op.startswith("BRA") and addr < end:
            m = re.search(r"0x([0-9a-f]+)", args)
            if m and int(m.group(1), 16) <= addr:
                out.append((int(m.group(1), 16), addr))
    return out


def hot_loop(instrs, category: str):
    """The counts inside the loop of the most ``category`` instructions among the innermost loops holding any
    (a loop that holds another such loop is not innermost); None: no loop holds one."""
    spans = [(lo, hi) for lo, hi in loops(instrs) if mix([x for x in instrs if lo <= x[0] <= hi])[category]]
    inner = [(lo, hi) for lo, hi in spans
             if not any((a, b) != (lo, hi) and lo <= a and b <= hi for a, b in spans)]
    best = None
    for lo, hi in inner:
        c = mix([x for x in instrs if lo <= x[0] <= hi])
        if best is None or c[category] > best[category]:
            best = c
    return best


def setmaxnreg(text: str) -> list[int]:
    return sorted({int(x, 16) for x in re.findall(r"USETMAXREG\.\S+\s+(?:UP\d+,\s*)?(0x[0-9a-f]+)", text)},
                  reverse=True)


# ----------------------------------------------------------------------------- our kernels
def _cubin_in(out: str, needle: str = "") -> str:
    found = [c for c in glob.glob(f"{out}/*.cubin") if needle in os.path.basename(c)]
    if len(found) != 1:
        raise RuntimeError(f"expected one cubin matching {needle!r} in {out}, got {found}")
    return found[0]


def ours_decode(arch: str, tmp: str) -> tuple[str, str]:
    from cutedsl_attn.planning.decode import DecodeProblem
    from cutedsl_attn.sm100 import decode as K

    p = DecodeProblem(dtype="bfloat16", head_dim=D, page_size=PAGE, group_size=HQ // HKV, arch=arch)
    t = K.default_tiles(p, num_sms=NUM_SMS)
    out = tempfile.mkdtemp(dir=tmp)
    K.compile(K.Config(p, t), keep_ptx_dir=out, keep_cubin=True)
    return _cubin_in(out), f"ours decode (kv_stages={t.kv_stages})"


def ours_prefill(arch: str, tmp: str, num_ctas: int, q_tiles: int) -> tuple[str, str]:
    from cutedsl_attn.planning.prefill import PrefillProblem
    from cutedsl_attn.sm100 import prefill as K

    p = PrefillProblem(dtype="bfloat16", head_dim_qk=D, head_dim_vo=D, group_size=HQ // HKV, causal=True, arch=arch)
    t = dataclasses.replace(K.default_tiles(p, num_sms=NUM_SMS), q_tiles=q_tiles, num_ctas=num_ctas)
    out = tempfile.mkdtemp(dir=tmp)
    K.compile(K.Config(p, t), keep_ptx_dir=out, keep_cubin=True)
    grid = f"persistent num_ctas={num_ctas}" if num_ctas else "one CTA per tile"
    return _cubin_in(out), f"ours prefill q_tiles={q_tiles}, {grid}"


# ----------------------------------------------------------------------------- FlashAttention-4
def _peers_dir(peers: str | None, tmp: str) -> str:
    if peers:
        return peers
    bundle = os.path.join(REPO, ".devdeps", "peers", "deps.tar.xz")
    if not os.path.exists(bundle):
        raise SystemExit(f"no FA4: {bundle} missing (pass --peers DIR of an unpacked bundle)")
    d = os.path.join(tmp, "peers")
    with tarfile.open(bundle) as tf:
        tf.extractall(d, filter="data")
    return d


_FA4 = {}


def _import_fa4(peers: str):
    if "iface" in _FA4:
        return _FA4["iface"]
    sys.path.insert(0, peers)
    quack = types.ModuleType("quack")
    quack.__path__ = [os.path.join(peers, "quack")]
    sys.modules.setdefault("quack", quack)  # (its __init__ imports triton-based autotuning the fwd kernel never uses)
    try:
        import einops  # noqa: F401
    except ImportError:
        ein = types.ModuleType("einops")
        ein.rearrange = ein.repeat = None  # (FA4's test references only)
        sys.modules["einops"] = ein
    import cutlass.cute as cute
    import cutlass.cute.tensor as ct
    import cutlass.utils

    if not hasattr(ct._Tensor, "to"):
        def _to(self, dtype, loc=None, ip=None):
            out = cute.make_rmem_tensor_like(self, dtype)
            out.store(self.load().to(dtype))
            return out
        ct._Tensor.to = _to

    class _HardwareInfo:  # the cross-compile target's SM count (no driver on this machine)
        def __init__(self, *a, **k):
            pass

        def get_device_multiprocessor_count(self):
            return NUM_SMS

        def get_max_active_clusters(self, cluster_size=1):
            return NUM_SMS // cluster_size

    cutlass.utils.HardwareInfo = _HardwareInfo
    os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", str(NUM_SMS))
    import flash_attn.cute.flash_fwd_sm100 as fwd
    import flash_attn.cute.interface as iface
    import flash_attn.cute.tile_scheduler as ts

    if hasattr(ts, "HardwareInfo"):
        ts.HardwareInfo = _HardwareInfo
    seen = _FA4.setdefault("kwargs", [])
    init = fwd.FlashAttentionForwardSm100.__init__

    def spy(self, *a, **kw):
        # the kernel reads the target arch in its constructor (sm_103's native ex2): the build's, not the default
        from cutlass.base_dsl import Arch
        from cutlass.cutlass_dsl import BaseDSL

        dsl = BaseDSL._get_dsl()
        dsl.get_arch_enum = lambda: Arch.from_string(_FA4["arch"])
        try:
            init(self, *a, **kw)
        finally:
            del dsl.get_arch_enum
        seen.append(kw)
    fwd.FlashAttentionForwardSm100.__init__ = spy
    _FA4["iface"] = iface
    return iface


@contextlib.contextmanager
def _compile_for(arch: str, out: str):
    """``cute.compile`` with the target arch and the PTX / cubin kept in ``out`` (FA4 passes its own options)."""
    import cutlass.cute as cute

    from cutedsl_attn.compile.arch import compile_options

    orig = cute.compile

    def patched(*a, options="", **kw):
        extra = compile_options(arch, tvm_ffi=False, keep_ptx_dir=out, keep_cubin=True)
        return orig(*a, options=f"{options} {extra}", **kw)
    cute.compile = patched
    try:
        yield
    finally:
        cute.compile = orig


def fa4(arch: str, problem: str, peers: str, tmp: str) -> tuple[str, str]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    iface = _import_fa4(peers)
    iface._flash_attn_fwd.compile_cache = {}  # (one build per arch)
    _FA4["kwargs"].clear()
    _FA4["arch"] = arch
    out = tempfile.mkdtemp(dir=tmp)
    bf = torch.bfloat16
    with _compile_for(arch, out), FakeTensorMode(allow_non_fake_inputs=True):
        if problem == "decode":
            B, pages = 64, 4096
            q = torch.empty(B, 1, HQ, D, dtype=bf, device="cuda")
            k = torch.empty(pages, PAGE, HKV, D, dtype=bf, device="cuda")
            v = torch.empty(pages, PAGE, HKV, D, dtype=bf, device="cuda")
            pt = torch.empty(B, 64, dtype=torch.int32, device="cuda")
            used = torch.empty(B, dtype=torch.int32, device="cuda")
            iface._flash_attn_fwd(q, k, v, page_table=pt, seqused_k=used, pack_gqa=True, num_splits=1,
                                  _arch=int(arch[3:6]))
        else:
            B, T = 8, 8 * 2048
            q = torch.empty(T, HQ, D, dtype=bf, device="cuda")
            k = torch.empty(T, HKV, D, dtype=bf, device="cuda")
            v = torch.empty(T, HKV, D, dtype=bf, device="cuda")
            cu = torch.empty(B + 1, dtype=torch.int32, device="cuda")
            iface._flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=2048, max_seqlen_k=2048,
                                  causal=True, pack_gqa=True, _arch=int(arch[3:6]))
    kw = _FA4["kwargs"][-1] if _FA4["kwargs"] else {}
    keys = ("m_block_size", "n_block_size", "q_stage", "pack_gqa", "is_static_persistent", "paged_kv_non_tma",
            "is_split_kv", "use_2cta_instrs")
    desc = ", ".join(f"{k}={kw[k]}" for k in keys if k in kw)
    return _cubin_in(out, "FlashAttentionForwardSm100"), f"FA4 fwd ({desc})"


# ----------------------------------------------------------------------------- report
def row(label, counts, cols):
    return "| " + label + " | " + " | ".join(str(counts[c]) for c in cols) + " |"


def report(problem: str, arch: str, kernels: list[tuple[str, str]]):
    whole_cols = ("UTC*MMA", "MUFU.EX2", "FFMA2", "FFMA", "FMUL2/FADD2", "LDTM", "STTM", "SYNCS (mbarrier)",
                  "UTCBAR (commit)", "BAR (named)", "LDGSTS", "UTMALDG", "UTMASTG", "STG.128", "instructions")
    print(f"\n#### {problem}, {arch}: whole kernel (static counts)\n")
    print("| kernel | " + " | ".join(whole_cols) + " | setmaxnreg |")
    print("|---" * (len(whole_cols) + 2) + "|")
    parsed = []
    for cubin, label in kernels:
        text = sass_of(cubin)
        ins = parse(text)
        parsed.append((label, ins))
        regs = " / ".join(str(r) for r in setmaxnreg(text)) or "-"
        print(row(label, mix(ins), whole_cols)[:-1] + f"| {regs} |")
    for name, cat in (("softmax loop (innermost, most MUFU.EX2)", "MUFU.EX2"),
                      ("MMA loop (innermost, most UTC*MMA)", "UTC*MMA")):
        print(f"\n#### {problem}, {arch}: {name}\n")
        print("| kernel | " + " | ".join(LOOP_COLUMNS) + " | instructions |")
        print("|---" * (len(LOOP_COLUMNS) + 2) + "|")
        for label, ins in parsed:
            c = hot_loop(ins, cat)
            print(row(label, c, LOOP_COLUMNS + ("instructions",)) if c else f"| {label} | (no loop holds one) |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", nargs="+", default=["sm_100a", "sm_103a"], choices=["sm_100a", "sm_103a"])
    ap.add_argument("--problem", default="all", choices=["decode", "prefill", "all"])
    ap.add_argument("--peers", default=None, help="an unpacked .devdeps/peers bundle (default: unpack it)")
    ap.add_argument("--no-fa4", action="store_true", help="our kernels only")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sass_mix_") as tmp:
        peers = None if a.no_fa4 else _peers_dir(a.peers, tmp)
        for problem in (("decode", "prefill") if a.problem == "all" else (a.problem,)):
            for arch in a.arch:
                ks = [ours_decode(arch, tmp)] if problem == "decode" else [
                    ours_prefill(arch, tmp, n, q) for q in (1, 2) for n in (0, NUM_SMS)]
                if peers:
                    ks.append(fa4(arch, problem, peers, tmp))
                report(problem, arch, ks)


if __name__ == "__main__":
    main()
