"""CPU checks of the SM100 decode kernel's page-table warp (``cutedsl_attn.sm100.decode``), which no GPU here runs.

The page-table warp copies each KV block's page ids (one per token) from the request's page indices into a
shared-memory ring :data:`config.PAGE_TABLE_STAGES` blocks deep; the load warpgroup reads them from there, so no
K / V gather waits on a global read of the page table.  Checked without a GPU:

* the roles: a tenth warp of its own, the CTA's 320 threads within the register file at the launch budget;
* the mbarrier plan (:func:`config.mbarrier_plan`): every pipeline's arrival counts follow from the roles, and in
  the PTX of served configurations (both archs, page sizes 1 / 3 / 16 / 64, fp8 caches) each ``mbarrier.init``
  at each offset of the shared storage has the plan's count;
* data flow in the PTX: the page indices (the kernel's ``mIdx`` argument) are read only by the page-table
  warp's ``TILE_KV / 32`` 4-byte ``cp.async`` a lane and block, never by an ``ld.global``, and no K / V gather
  address depends on a register loaded from them; the two page ids a load thread reads from the ring are
  widened to 64 bits before any arithmetic (``page * page_stride`` beyond 2^32 does not wrap);
* the ring's handshake (page-table warp -> load warpgroup -> MMA warp -> softmax warpgroup, in the kernel's order
  of waits and arrivals) completes for every stage count and item length, and the model does find the deadlock
  of publishing a two-stage ring's block after acquiring the next stage.
"""

import functools
import re

import pytest
from _builds import build  # (tests/ is on sys.path)

from cutedsl_attn.planning.decode import DecodeProblem
from cutedsl_attn.sm100 import decode as K
from cutedsl_attn.sm100.decode import config as C

ARCHS = ("sm_100a", "sm_103a")
IDX_PARAM = 3  # mIdx: the fourth kernel argument (q, k, v, indices, work, ...)

SERVED = [dict(arch=a, d=d, ps=ps, g=g, dtype=dt, kv=kv) for a in ARCHS for d, ps, g, dt, kv in (
    (128, 16, 4, "bfloat16", ""), (64, 1, 8, "float16", ""), (128, 64, 1, "bfloat16", ""),
    (128, 3, 5, "bfloat16", ""), (128, 16, 4, "bfloat16", "float8_e4m3fn"), (64, 1, 8, "float16", "float8_e4m3fn"))]


def _id(kw):
    return f"{kw['arch']}-d{kw['d']}-ps{kw['ps']}-g{kw['g']}-{kw['dtype']}" + ("-fp8kv" if kw["kv"] else "")


@functools.lru_cache(maxsize=None)
def _build(key):
    kw = dict(key)
    p = DecodeProblem(dtype=kw["dtype"], head_dim=kw["d"], page_size=kw["ps"], group_size=kw["g"], arch=kw["arch"],
                      kv_dtype=kw["kv"])
    cfg = K.Config(p, K.default_tiles(p, num_sms=148))
    return cfg, build(K.compile, cfg).ptx  # (shared with test_sm100_decode_cpu's builds)


def built(kw):
    return _build(tuple(sorted(kw.items())))


# ----------------------------------------------------------------------------- a PTX reader
_REG = re.compile(r"%[a-z]+\d+")
# an instruction: at a line's start or after "{" / ";" (inline asm keeps its instructions on one line)
_INSN = re.compile(r"(?:^|[{;])[ \t]*(?:@!?%\w+\s+)?([a-z][\w.:]*)[ \t]+([^;]*);", re.M)
_NO_DEST = ("st.", "cp.async", "bra", "bar.", "barrier", "fence", "tcgen05", "red.", "prefetch", "mbarrier.init",
            "mbarrier.try_wait", "ret", "exit")


def instructions(ptx: str) -> list[tuple[str, list[str], list[str], str]]:
    """``(opcode, destination registers, source registers, operand text)`` of every instruction of ``ptx``."""
    out = []
    for op, ops in _INSN.findall(ptx):
        if op.startswith(".") or op in ("reg", "param"):
            continue
        if op.startswith(_NO_DEST):
            out.append((op, [], _REG.findall(ops), ops))
            continue
        first, _, rest = ops.partition("}") if ops.lstrip().startswith("{") else ops.partition(",")
        out.append((op, _REG.findall(first), _REG.findall(rest), ops))
    return out


def tainted(insns, seeds) -> set[str]:
    """The registers whose value depends on a register of ``seeds`` (through arithmetic, and through a load from
    an address that does), to a fixpoint (loop-carried registers are assigned more than once)."""
    t = set(seeds)
    while True:
        n = len(t)
        for _, dst, src, _ in insns:
            if dst and any(s in t for s in src):
                t.update(dst)
        if len(t) == n:
            return t


def address_regs(ops: str) -> list[str]:
    """The registers of the first ``[...]`` operand (a memory address)."""
    m = re.search(r"\[([^\]]*)\]", ops)
    return _REG.findall(m.group(1)) if m else []


def source_address_regs(op: str, ops: str) -> list[str]:
    """The registers of a copy's global source address (the second ``[...]`` of a cp.async)."""
    addrs = re.findall(r"\[([^\]]*)\]", ops)
    return _REG.findall(addrs[1]) if op.startswith("cp.async.c") and len(addrs) > 1 else []


def mbarrier_inits(ptx: str) -> dict[int, int]:
    """Byte offset (from the first initialised mbarrier) -> arrival count of every ``mbarrier.init``."""
    imm = dict(re.findall(r"mov\.b32\s+(%r\d+),\s*(\d+);", ptx))
    adds = {d: (b, int(o)) for d, b, o in re.findall(r"add\.s32\s+(%r\d+),\s*(%r\d+),\s*(-?\d+);", ptx)}
    inits = re.findall(r"mbarrier\.init\.shared(?:::cta)?\.b64\s+\[(%r\d+)(?:\+(\d+))?\],\s*(%r\d+|\d+);", ptx)
    assert inits, "no mbarrier.init in the PTX (the reader is stale)"
    base = inits[0][0]
    out = {}
    for reg, off, count in inits:
        off = int(off or 0)
        if reg != base:
            b, o = adds[reg]
            assert b == base, f"mbarrier address {reg} is not the storage base plus a constant"
            off += o
        assert off not in out, f"mbarrier at offset {off} initialised twice"
        out[off] = int(imm.get(count, count))
    return out


def planned_inits(cfg) -> dict[int, int]:
    """What :func:`mbarrier_inits` should read: the plan's pipelines in storage order, each its full barriers
    (one a stage, the producers' count) then its empty ones (the consumers')."""
    out, off = {}, 0
    for stages, full, empty in cfg.mbarriers.values():
        for count in (full, empty):
            for _ in range(stages):
                out[off] = count
                off += 8
    return out


# ============================================================================= roles, plan
def test_page_table_warp_is_a_warp_of_its_own_within_the_register_file():
    r = C.Roles()
    warps = (*r.softmax_warps, *r.load_warps, r.mma_warp, r.page_table_warp)
    assert sorted(warps) == list(range(r.num_warps)) and r.num_warps == 10 and r.num_threads == 320
    # the launch budget: the largest multiple of 8 registers that 320 threads fit in the 64 Ki register file
    assert r.launch_registers == 200
    assert r.launch_registers * r.num_threads <= C.REGISTER_FILE < (r.launch_registers + 8) * r.num_threads


def test_mbarrier_plan_counts_follow_from_the_roles():
    r = C.Roles()
    for s in C.KV_STAGES:
        plan = C.mbarrier_plan(s, r)
        assert plan == {"kv": (s, 128, 1), "s": (2, 1, 128), "p": (2, 128, 1), "o": (1, 1, 128),
                        "pt": (C.PAGE_TABLE_STAGES, 32, 128)}
    cfg = K.Config(DecodeProblem(dtype="bfloat16", head_dim=128, page_size=16, group_size=4, arch="sm_100a"),
                   K.Tiles(kv_stages=3))
    assert cfg.mbarriers == C.mbarrier_plan(3, cfg.roles)
    assert C.PAGE_TABLE_STAGES >= 2  # one stage filling while the load warpgroup reads another


def test_the_ring_fits_the_shared_memory_budget_of_every_default():
    for d in (64, 128):
        for kv in ("", "float8_e4m3fn"):
            p = DecodeProblem(dtype="bfloat16", head_dim=d, page_size=16, group_size=4, arch="sm_100a", kv_dtype=kv)
            cfg = K.Config(p, K.default_tiles(p, num_sms=148))
            ring = 4 * C.PAGE_TABLE_STAGES * C.TILE_KV
            assert cfg.smem_bytes <= C.SMEM_LIMIT
            assert cfg.smem_bytes >= ring + cfg.smem_kv_bytes


# ============================================================================= the PTX
@pytest.mark.parametrize("kw", SERVED, ids=_id)
def test_every_mbarrier_is_initialised_with_the_plans_count(kw):
    cfg, ptx = built(kw)
    assert mbarrier_inits(ptx) == planned_inits(cfg)
    # the page-table warp arrives through its copies, once a lane and block; the load warpgroup frees a stage
    assert ptx.count("cp.async.mbarrier.arrive.noinc.shared") == 1
    assert ptx.count("cp.async.wait_all") == 1


@pytest.mark.parametrize("kw", SERVED, ids=_id)
def test_only_the_page_table_warp_reads_the_page_indices(kw):
    cfg, ptx = built(kw)
    insns = instructions(ptx)
    seeds = [d for op, dst, _, ops in insns if op.startswith("ld.param") and f"_param_{IDX_PARAM}" in ops
             for d in dst]
    assert seeds, "the page indices' pointer is not loaded (the reader is stale)"
    t = tainted(insns, seeds)
    reads = [(op, ops) for op, _, _, ops in insns
             if (op.startswith("ld.global") and any(r in t for r in address_regs(ops)))
             or any(r in t for r in source_address_regs(op, ops))]
    assert reads and all(op == "cp.async.ca.shared.global" and ops.rstrip().endswith(", 4") for op, ops in reads), reads
    assert len(reads) == C.TILE_KV // 32  # 4 tokens a lane and block (one rolled loop)
    # the K / V gathers' (16-byte cp.async) addresses come from the ring, not from a global read of page ids
    gathers = [ops for op, _, _, ops in insns if op == "cp.async.cg.shared.global"]
    assert gathers and not any(r in t for ops in gathers for r in source_address_regs("cp.async.cg", ops))


@pytest.mark.parametrize("kw", SERVED, ids=_id)
def test_page_ids_are_widened_to_64_bits_before_any_arithmetic(kw):
    _, ptx = built(kw)
    insns = instructions(ptx)
    uses = {}
    for op, _, src, _ in insns:
        for s in src:
            uses.setdefault(s, []).append(op)
    # the ring reads: the 32-bit shared loads whose value is sign-extended to 64 bits
    pages = [dst[0] for op, dst, _, _ in insns
             if op == "ld.shared.b32" and dst and "cvt.s64.s32" in uses.get(dst[0], ())]
    assert len(pages) == 2, pages  # tokens r // 2 and r // 2 + 64 of each block
    for reg in pages:
        assert set(uses[reg]) == {"cvt.s64.s32"}, (reg, uses[reg])


# ============================================================================= the handshake, modelled
def _agents(n_blk, S, PT, publish_before_acquire=True):
    """The kernel's waits (``need``: pipeline use count that must be reached) and arrivals (``done``), role by role
    and in its order (kernel.py's ``_page_table``, ``_load``, ``_mma``, ``_softmax``); ``X+`` counts commits of
    pipeline X, ``X-`` its releases."""

    def page_table():
        for i in range(n_blk):
            yield "need", "pt-", i - PT + 1
            yield "done", "pt+"

    def load():
        for i in range(n_blk):
            yield "need", "pt+", i + 1
            yield "done", "pt-"
            if S == 2 and i > 0 and publish_before_acquire:
                yield "done", "kv+"
            yield "need", "kv-", i - S + 1
            if S == 2 and i > 0 and not publish_before_acquire:
                yield "done", "kv+"
            if S > 2 and i > 0:
                yield "done", "kv+"
        yield "done", "kv+"

    def mma():
        for i in range(n_blk + 1):
            if i < n_blk:
                yield "need", "kv+", i + 1
                yield "need", "s-", i - 2 + 1
                yield "done", "s+"
            if i > 0:
                yield "need", "p+", i
                yield "need", "o-", i - 1
                yield "done", "o+"
                yield "done", "p-"
                yield "done", "kv-"

    def softmax():
        for i in range(n_blk):
            yield "need", "s+", i + 1
            yield "done", "s-"
            yield "need", "p-", i - 2 + 1
            if i > 0:
                yield "need", "o+", i
                yield "done", "o-"
            yield "done", "p+"
        yield "need", "o+", n_blk

    return [page_table(), load(), mma(), softmax()]


def _runs_to_completion(agents) -> bool:
    """Step every agent as far as its waits allow, round robin, until all finish (True) or none can move (a
    deadlock: the counts only grow, so no schedule would get further)."""
    count, pending = {}, [None] * len(agents)
    live = set(range(len(agents)))
    while live:
        moved = False
        for a in sorted(live):
            while True:
                step = pending[a] or next(agents[a], None)
                if step is None:
                    live.discard(a)
                    break
                if step[0] == "need" and count.get(step[1], 0) < step[2]:
                    pending[a] = step
                    break
                pending[a] = None
                moved = True
                if step[0] == "done":
                    count[step[1]] = count.get(step[1], 0) + 1
        if not moved and live:
            return False
    return True


@pytest.mark.parametrize("S", C.KV_STAGES)
def test_the_handshake_completes_for_every_ring_depth_and_length(S):
    for n_blk in range(1, 12):
        for pt in (1, 2, C.PAGE_TABLE_STAGES):
            assert _runs_to_completion(_agents(n_blk, S, pt)), (S, pt, n_blk)


def test_the_model_finds_the_two_stage_deadlock():
    assert not _runs_to_completion(_agents(3, 2, C.PAGE_TABLE_STAGES, publish_before_acquire=False))
    assert _runs_to_completion(_agents(2, 2, C.PAGE_TABLE_STAGES, publish_before_acquire=False))
