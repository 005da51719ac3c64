"""The instruction summary of PTX text (:func:`instruction_summary`, :func:`format_summary`,
:data:`SUMMARY_KEYS`): opcode counts by family, what ``python -m cutedsl_attn ptx --summary`` prints.  Pure text
processing; :mod:`cutedsl_attn.inspect` re-exports it beside the compile-side tools.
"""

from __future__ import annotations

import re
from collections import Counter


#: Keys of :func:`instruction_summary`, in display order, with what each counts.
SUMMARY_KEYS = {
    "mma.sync": "warp-level tensor-core MMA (mma.sync.aligned.*, SM80 class)",
    "mma.sync.bf16": "  of which bf16 inputs",
    "mma.sync.f16": "  of which f16 inputs",
    "wgmma": "warpgroup MMA (wgmma.mma_async, SM90)",
    "tcgen05": "5th-gen tensor-core ops (tcgen05.*, SM100)",
    "tcgen05.mma": "  of which tcgen05.mma",
    "ldmatrix": "ldmatrix (all)",
    "ldmatrix.trans": "  of which .trans",
    "stmatrix": "stmatrix",
    "cp.async": "async global->shared copies (cp.async.ca/cg, SM80 class)",
    "cp.async.commit_group": "cp.async.commit_group",
    "cp.async.wait_group": "cp.async.wait_group / wait_all",
    "cp.async.bulk": "bulk async copies (cp.async.bulk.*, TMA class, non-tensor)",
    "cp.async.bulk.tensor": "TMA tensor copies (cp.async.bulk.tensor.*)",
    "mbarrier": "mbarrier.*",
    "ld.global": "global loads (ld.global.*)",
    "st.global": "global stores (st.global.*)",
    "ld.shared": "shared loads (ld.shared.*)",
    "st.shared": "shared stores (st.shared.*)",
    "ld.local": "local-memory loads (ld.local: stack/spill traffic in PTX)",
    "st.local": "local-memory stores (st.local)",
    "atom": "atomics (atom.*)",
    "atom.global.add": "  of which atom.global.add",
    "red": "reductions without return (red.*)",
    "shfl.sync": "warp shuffles (shfl.sync.*)",
    "bar.sync": "CTA barriers (bar.sync / barrier.sync)",
    "fence": "memory fences (fence.*, membar.*)",
    "ex2": "ex2.approx (exp2)",
    "lg2": "lg2.approx",
    "rcp": "rcp.*",
    "tanh": "tanh.approx",
    "sin/cos": "sin.approx / cos.approx",
    "cvt": "conversions (cvt.*)",
    "ret": "kernel exits (ret / exit)",
    "total": "all instructions",
}

_LABEL = re.compile(r"^[$%]?[A-Za-z_][\w$]*:(?!:)")  # PTX identifiers have no dots; "::" is a qualifier
_PRED = re.compile(r"^@!?%\w+\s+")


def _mnemonics(ptx_text: str):
    """Yield the opcode (with modifiers) of every instruction statement in ``ptx_text``."""
    text = re.sub(r"/\*.*?\*/", " ", ptx_text, flags=re.S)
    for line in text.splitlines():
        line = line.split("//", 1)[0]
        for stmt in line.split(";"):
            s = stmt.strip().lstrip("{}").strip()
            while _LABEL.match(s):
                s = _LABEL.sub("", s, count=1).strip()
            if not s or s[0] in ".{}()[" or s.startswith(("$", "//")):
                continue  # directives (.reg, .param, .version, ...), braces, stray operands
            s = _PRED.sub("", s)
            op = s.split(None, 1)[0].rstrip(",")
            if not op or not (op[0].isalpha()):
                continue
            yield op


def instruction_summary(ptx_text: str) -> dict[str, int]:
    """Static counts of the PTX instructions that matter for attention kernels.

    Counts instruction *statements* in the text (a loop body counts once, however
    often it runs), after stripping comments, labels and predicates; directives
    (``.reg``, ``.param``, ...) are not instructions.

    Args:
      ptx_text: a PTX module, e.g. from :func:`ptx`.

    Returns:
      ``dict`` with every key of :data:`SUMMARY_KEYS` (0 when absent), in that
      order: ``mma.sync`` (and its ``.bf16`` / ``.f16`` split), ``wgmma``,
      ``tcgen05``, ``ldmatrix`` (``ldmatrix.trans``), ``cp.async`` (element copies,
      not commit/wait or bulk), ``cp.async.bulk.tensor``, ``ld.local``/``st.local``
      (local memory: a PTX-level sign of register arrays spilled to the stack; the
      register allocator's own spills only show in SASS as ``LDL``/``STL``),
      ``atom`` (``atom.global.add``), ``ex2``, ... and ``total``.

    Raises:
      TypeError: ``ptx_text`` is not a ``str``.
    """
    if not isinstance(ptx_text, str):
        raise TypeError(f"ptx_text must be a str, got {type(ptx_text).__name__}")
    counts = dict.fromkeys(SUMMARY_KEYS, 0)
    c = Counter(_mnemonics(ptx_text))
    for op, n in c.items():
        parts = op.split(".")
        head = parts[0]
        counts["total"] += n
        if op.startswith("mma.sync") or head == "mma":
            counts["mma.sync"] += n
            if "bf16" in parts:
                counts["mma.sync.bf16"] += n
            elif "f16" in parts:
                counts["mma.sync.f16"] += n
        elif head == "wgmma":
            if op.startswith("wgmma.mma_async"):
                counts["wgmma"] += n
        elif head == "tcgen05":
            counts["tcgen05"] += n
            if op.startswith("tcgen05.mma"):
                counts["tcgen05.mma"] += n
        elif head == "ldmatrix":
            counts["ldmatrix"] += n
            if "trans" in parts:
                counts["ldmatrix.trans"] += n
        elif head == "stmatrix":
            counts["stmatrix"] += n
        elif op.startswith("cp.async.bulk.tensor"):
            counts["cp.async.bulk.tensor"] += n
        elif op.startswith("cp.async.bulk"):
            if not any(p in ("commit_group", "wait_group", "wait_group.read") for p in parts):
                counts["cp.async.bulk"] += n
        elif op.startswith("cp.async.commit_group"):
            counts["cp.async.commit_group"] += n
        elif op.startswith(("cp.async.wait_group", "cp.async.wait_all")):
            counts["cp.async.wait_group"] += n
        elif op.startswith(("cp.async.ca", "cp.async.cg")):
            counts["cp.async"] += n
        elif head == "mbarrier":
            counts["mbarrier"] += n
        elif head in ("ld", "st") and len(parts) > 1:
            space = next((p for p in parts[1:] if p in ("global", "shared", "local", "param", "const")), None)
            key = f"{head}.{space}"
            if key in counts:
                counts[key] += n
        elif head == "atom":
            counts["atom"] += n
            if len(parts) > 2 and parts[1] == "global" and "add" in parts:
                counts["atom.global.add"] += n
        elif head == "red":
            counts["red"] += n
        elif head == "shfl":
            counts["shfl.sync"] += n
        elif op.startswith(("bar.sync", "barrier.sync", "bar.cta.sync", "barrier.cta.sync")) or op == "bar.sync":
            counts["bar.sync"] += n
        elif head in ("fence", "membar"):
            counts["fence"] += n
        elif head == "ex2":
            counts["ex2"] += n
        elif head == "lg2":
            counts["lg2"] += n
        elif head == "rcp":
            counts["rcp"] += n
        elif head == "tanh":
            counts["tanh"] += n
        elif head in ("sin", "cos"):
            counts["sin/cos"] += n
        elif head == "cvt":
            counts["cvt"] += n
        elif head in ("ret", "exit"):
            counts["ret"] += n
    return counts


def format_summary(summary: dict[str, int], *, nonzero_only: bool = True) -> str:
    """A two-column text table of :func:`instruction_summary` output."""
    rows = [(k, v) for k, v in summary.items() if v or not nonzero_only or k == "total"]
    w = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"  {k:<{w}}  {v:>6}" for k, v in rows)
