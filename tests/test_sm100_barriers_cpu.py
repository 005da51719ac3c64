"""CPU checks of the named barriers of the SM100 tcgen05 kernels (``cutedsl_attn.sm100.prefill`` / ``.decode``).

A CTA has 16 hardware barriers; barrier 0 is ``__syncthreads`` (``bar.sync 0``, every thread).  Each kernel's
``config`` declares its named barrier ids (``BAR_*``); the warps that arrive at each follow from the config's warp
roles (:data:`ARRIVALS`).  Checked here without a GPU:

* the declared ids are distinct within a kernel, none is 0, all are below 16;
* the thread count of each id is a multiple of 32 (whole warps; ``bar.sync`` requires it) and is the count of the
  warps that arrive, a subset of the CTA's warps, for every role layout (one / two Q tiles, persistent);
* the kernel source builds every ``NamedBarrier`` from a declared ``BAR_*`` constant, and uses each of them;
* in the PTX of served configurations (prefill with one and two Q tiles, both persistent; decode), every
  ``bar.sync`` / ``bar.arrive`` / ``bar.red`` / ``barrier.*`` instruction has an immediate id and a count the
  config declares (id 0: the whole CTA), and every declared barrier is there;
* the prefill kernel's mbarriers: every ``mbarrier.init`` of the PTX, in order, with the arrival count its pipeline
  has (:func:`prefill_mbarrier_counts`: TMA and ``tcgen05.commit`` producers arrive once, a warpgroup of one
  thread per row 128 times, the epilogue warp's lanes 32 times).
"""

import dataclasses
import functools
import pathlib
import re

import pytest
from _builds import build  # (tests/ is on sys.path)

from cutedsl_attn.planning.decode import DecodeProblem
from cutedsl_attn.planning.prefill import PrefillProblem
from cutedsl_attn.sm100 import decode as DK
from cutedsl_attn.sm100 import prefill as PK
from cutedsl_attn.sm100.decode import config as DC
from cutedsl_attn.sm100.prefill import config as PC

HW_BARRIERS = 16
_SM100 = pathlib.Path(PK.__file__).resolve().parent.parent


def declared(config_module) -> dict[str, int]:
    """``BAR_*`` name -> id of a kernel's config module."""
    return {n: v for n, v in vars(config_module).items() if n.startswith("BAR_")}


def prefill_arrivals(roles) -> dict[int, tuple[int, ...]]:
    """Barrier id -> the warps that arrive: the TMEM address reaches every warp that reads or writes TMEM (the
    softmax and correction warpgroups) from the MMA warp that allocates it; the free waits for the correction
    warpgroup's last TMEM read (the softmax warpgroups' last accesses precede the MMA warp's last P V)."""
    return {PC.BAR_TMEM_ALLOC: roles.softmax_warps + roles.correction_warps + (roles.mma_warp,),
            PC.BAR_TMEM_FREE: roles.correction_warps + (roles.mma_warp,)}


def decode_arrivals(roles) -> dict[int, tuple[int, ...]]:
    """Barrier id -> the warps that arrive: the TMEM address from the MMA warp to the softmax warpgroup (the only
    TMEM reader), the softmax warpgroup's cross-warp reductions, and the free after its last TMEM read."""
    return {DC.BAR_TMEM_ALLOC: roles.softmax_warps + (roles.mma_warp,),
            DC.BAR_SOFTMAX: roles.softmax_warps,
            DC.BAR_TMEM_FREE: roles.softmax_warps + (roles.mma_warp,)}


PREFILL_ROLES = [PC.Roles(q, persistent) for q in (1, 2) for persistent in (False, True)]
ARRIVALS = [("prefill", PC, prefill_arrivals, r) for r in PREFILL_ROLES] + [
    ("decode", DC, decode_arrivals, DC.Roles())]


@pytest.mark.parametrize("module", [PC, DC], ids=["prefill", "decode"])
def test_declared_ids_are_distinct_nonzero_and_within_the_hardware(module):
    ids = declared(module)
    assert ids, "no named barrier declared"
    assert len(set(ids.values())) == len(ids), f"two names share an id: {ids}"
    for name, bar_id in ids.items():
        assert isinstance(bar_id, int) and not isinstance(bar_id, bool), name
        assert 0 < bar_id < HW_BARRIERS, f"{name} = {bar_id}: ids 1..15 (0 is __syncthreads)"


@pytest.mark.parametrize("kernel, module, arrivals, roles", ARRIVALS,
                         ids=[f"{k}-{getattr(r, 'q_tiles', '')}{'-persistent' if getattr(r, 'persistent', 0) else ''}"
                              for k, _, _, r in ARRIVALS])
def test_each_barrier_counts_the_whole_warps_that_arrive(kernel, module, arrivals, roles):
    table = arrivals(roles)
    assert set(table) == set(declared(module).values()), "every declared barrier has its arriving warps"
    for bar_id, warps in table.items():
        assert len(set(warps)) == len(warps) and set(warps) <= set(range(roles.num_warps)), (bar_id, warps)
        count = 32 * len(warps)
        assert count % 32 == 0 and 0 < count <= roles.num_threads
        # a barrier of the whole CTA would be bar 0's job; a named one leaves some warp free to run ahead
        assert count < roles.num_threads, f"barrier {bar_id} spans the CTA"
    if kernel == "prefill":  # the load, epilogue and idle warps never touch TMEM
        idle = {roles.load_warp, roles.epilogue_warp, *roles.idle_warps}
        assert not any(idle & set(w) for w in table.values())
    else:
        assert not any(set(roles.load_warps) & set(w) for w in table.values())


@pytest.mark.parametrize("kernel, module", [("prefill", PC), ("decode", DC)])
def test_kernel_source_builds_every_named_barrier_from_a_declared_id(kernel, module):
    src = "\n".join(p.read_text() for p in sorted((_SM100 / kernel).glob("*.py")) if p.name != "config.py")
    first_args = re.findall(r"NamedBarrier\(\s*([^,()]+)\s*,", src)
    assert first_args, "no NamedBarrier in the kernel"
    names = declared(module)
    for arg in first_args:
        m = re.fullmatch(r"C\.(BAR_\w+)", arg.strip())
        assert m and m.group(1) in names, f"NamedBarrier({arg}, ..): ids come from config.BAR_*"
    assert {re.fullmatch(r"C\.(BAR_\w+)", a.strip()).group(1) for a in first_args} == set(names), "an unused id"
    # no barrier around NamedBarrier: the DSL's raw barrier calls, ptx.barrier_or, inline-asm bar / barrier text
    assert not re.search(r"arch\.barrier(_arrive)?\(|barrier_or\(|[\"']\s*bar(rier)?\.(sync|arrive|red)", src)


# ----------------------------------------------------------------------------- the PTX
# (at a line's start or after "{" / ";": an inline-asm block keeps its instructions on one line)
_BAR = re.compile(r"(?:^|[{;])\s*(?:@!?%?\w+\s+)?((?:bar|barrier)(?:\.[\w:]+)*)(?:\s+([^;]*))?;", re.M)


def barrier_uses(ptx: str) -> list[tuple[str, str, str | None]]:
    """``(mnemonic, id operand, count operand or None)`` of every CTA barrier instruction (``bar.warp.sync`` is a
    warp's, not a CTA barrier, and is left out)."""
    uses = []
    for mnem, ops in _BAR.findall(ptx):
        if mnem.startswith("bar.warp"):
            continue
        args = [a.strip() for a in ops.split(",")]  # (barrier.cluster.* has no operand: [""])
        if ".red" in mnem:  # bar.red.op.type d, a{, b}, {!}c
            uses.append((mnem, args[1], args[2] if len(args) == 4 else None))
        else:  # bar{.cta}.sync / arrive, barrier{.cta}.sync / arrive: a{, b}
            uses.append((mnem, args[0], args[1] if len(args) > 1 else None))
    return uses


def _prefill_cfg(q, num_ctas):
    p = PrefillProblem(dtype="bfloat16", head_dim_qk=128, head_dim_vo=128, group_size=4, causal=True,
                       arch="sm_100a")
    return PK.Config(p, dataclasses.replace(PK.default_tiles(p, num_sms=148), q_tiles=q, num_ctas=num_ctas)), PK


def _decode_cfg():
    p = DecodeProblem(dtype="bfloat16", head_dim=128, page_size=16, group_size=4, arch="sm_100a")
    return DK.Config(p, DK.default_tiles(p, num_sms=148)), DK


def _prefill_unstaged_cfg():
    """Three 128-token K/V stages at head_dim 128: no staging buffer fits, no epilogue warp pipeline."""
    cfg, k = _prefill_cfg(1, 148)
    return PK.Config(cfg.problem, dataclasses.replace(cfg.tiles, kv_stages=3)), k


BUILDS = {"prefill-q1": lambda: _prefill_cfg(1, 0), "prefill-q2": lambda: _prefill_cfg(2, 0),
          "prefill-q1-persistent": lambda: _prefill_cfg(1, 148), "prefill-q2-persistent": lambda: _prefill_cfg(2, 148),
          "prefill-q1-unstaged": _prefill_unstaged_cfg, "decode": _decode_cfg}


@functools.lru_cache(maxsize=None)
def built(name):
    cfg, kernel = BUILDS[name]()
    return cfg, build(kernel.compile, cfg).ptx  # (shared with the kernels' own PTX tests)


def barrier_problems(ptx: str, table: dict, num_threads: int) -> list[str]:
    """What in ``ptx`` disagrees with ``table`` (barrier id -> arriving warps) for a CTA of ``num_threads``: an
    instruction with a register id, an undeclared id, a count other than the table's (id 0: other than the
    whole CTA), a cluster barrier; a declared barrier that never occurs."""
    counts = {bar_id: str(32 * len(warps)) for bar_id, warps in table.items()}
    nt, seen, problems = str(num_threads), set(), []
    uses = barrier_uses(ptx)
    if not uses:
        return ["no barrier found in the PTX (the parser is stale)"]
    for mnem, bar_id, count in uses:
        if mnem.startswith("barrier.cluster"):
            problems.append(f"{mnem}: these kernels launch no cluster")
        elif not bar_id.isdigit():
            problems.append(f"{mnem} {bar_id}: a barrier id is an immediate")
        elif int(bar_id) == 0:
            if count not in (None, nt):
                problems.append(f"{mnem} 0, {count}: barrier 0 is the whole CTA ({nt} threads)")
        elif int(bar_id) not in counts:
            problems.append(f"{mnem} {bar_id}: not a declared barrier id ({sorted(counts)})")
        elif count != counts[int(bar_id)]:
            problems.append(f"{mnem} {bar_id}, {count}: the config's roles say {counts[int(bar_id)]} threads")
        else:
            seen.add(int(bar_id))
    problems += [f"declared barrier {b} is not in the PTX" for b in sorted(set(counts) - seen)]
    return problems


@pytest.mark.parametrize("name", list(BUILDS))
def test_every_barrier_in_the_ptx_is_declared(name):
    cfg, ptx = built(name)
    if name.startswith("prefill"):
        assert cfg.tiles.q_tiles == int(name[9]) and (cfg.tiles.num_ctas > 0) == ("persistent" in name or
                                                                                 "unstaged" in name)
        table = prefill_arrivals(cfg.roles)
    else:
        table = decode_arrivals(cfg.roles)
    assert barrier_problems(ptx, table, cfg.roles.num_threads) == []


def test_the_check_catches_each_disagreement():
    table = {1: (0, 1, 2, 3, 8), 2: (0, 1, 2, 3)}  # 160 and 128 threads of a 288-thread CTA
    good = ["bar.sync 0;", "bar.sync 1, 160;", "bar.sync 2, 128;", "bar.arrive 2, 128;", "bar.sync 0, 288;"]
    assert barrier_problems("\n".join(good), table, 288) == []
    for bad, needle in (("bar.sync 1, 128;", "roles say 160"), ("bar.sync 3, 64;", "not a declared"),
                        ("bar.sync %r4, 128;", "an immediate"), ("bar.sync 0, 128;", "whole CTA"),
                        ("barrier.cluster.arrive.aligned;", "no cluster")):
        got = barrier_problems("\n".join(good + [bad]), table, 288)
        assert len(got) == 1 and needle in got[0], (bad, got)
    assert barrier_problems("bar.sync 0;\nbar.sync 1, 160;", table, 288) == ["declared barrier 2 is not in the PTX"]


def test_the_parser_reads_every_barrier_form():
    text = "\n".join(["\tbar.sync \t0;", "\tbar.sync \t1, 288;", "\t@%p1 bar.arrive 2, 160;",
                      "\tbarrier.sync.aligned 3, 64;", "\t{ .reg .pred q; bar.red.or.pred q, 4, 96, %p3; }",
                      "\tbar.warp.sync \t-1;", "\tbarrier.cluster.wait;",
                      "\tmbarrier.try_wait.parity.shared::cta.b64 %p4, [%r1], %r2;"])
    assert barrier_uses(text) == [("bar.sync", "0", None), ("bar.sync", "1", "288"), ("bar.arrive", "2", "160"),
                                  ("barrier.sync.aligned", "3", "64"), ("bar.red.or.pred", "4", "96"),
                                  ("barrier.cluster.wait", "", None)]


# ----------------------------------------------------------------------------- the prefill kernel's mbarriers
def prefill_mbarrier_counts(cfg) -> list[tuple[str, int]]:
    """``(pipeline, arrival count)`` of each mbarrier of the SM100 prefill kernel in the order it initialises
    them: each pipeline's full barriers (one per stage), then its empty ones.  Q, K and V: the TMA (one
    arrive with its byte count) and the MMA warp's ``tcgen05.commit``; S: the MMA's commit, then the 128 softmax
    threads; P: the 128 softmax threads, then the P V commit; O: the commit, then the 128 correction threads;
    the row statistics: 128 softmax, 128 correction threads; the O staging buffers: the 128 correction
    threads (``EPI_PRODUCERS``), then the epilogue warp's 32 lanes (``EPI_CONSUMERS``); the V tail: the TMA."""
    q, s, e = cfg.tiles.q_tiles, cfg.tiles.kv_stages, cfg.epi_stages
    pipes = [("q", q, 1, 1), ("k", s, 1, 1), ("v", s, 1, 1), ("s", 2, 1, 128), ("p", 2, 128, 1), ("o", q, 1, 128),
             ("stats", q, 128, 128), ("epi", e, PC.EPI_PRODUCERS, PC.EPI_CONSUMERS)]
    out = []
    for name, stages, full, empty in pipes:
        out += [(f"{name}.full", full)] * stages + [(f"{name}.empty", empty)] * stages
    return out + [("v_tail", 1)]


_MOV = re.compile(r"mov\.b32\s+(%r\d+),\s*(\d+);")
_INIT = re.compile(r"mbarrier\.init\.shared(?:::cta)?\.b64\s+\[[^\]]+\],\s*(%r\d+|\d+);")


def mbarrier_init_counts(ptx: str) -> list[int]:
    """The arrival count of every ``mbarrier.init`` in ``ptx``, in order (an immediate, or the register the last
    ``mov.b32`` before it set)."""
    regs, counts = {}, []
    for line in ptx.splitlines():
        m = _MOV.search(line)
        if m:
            regs[m.group(1)] = int(m.group(2))
        m = _INIT.search(line)
        if m:
            v = m.group(1)
            counts.append(int(v) if v.isdigit() else regs[v])
    return counts


@pytest.mark.parametrize("name", [n for n in BUILDS if n.startswith("prefill")])
def test_prefill_mbarriers_have_their_pipelines_arrival_counts(name):
    cfg, ptx = built(name)
    want = prefill_mbarrier_counts(cfg)
    assert mbarrier_init_counts(ptx) == [n for _, n in want]
    assert (cfg.epi_stages == 0) == name.endswith("unstaged")
    # the staging pipeline is the only one the epilogue warp's lanes arrive on
    assert [k for k, n in want if n == 32] == ["epi.empty"] * cfg.epi_stages


def test_the_mbarrier_parser_reads_immediates_and_registers():
    text = "mov.b32 %r5, 128;\nmbarrier.init.shared.b64 [%r1], %r5;\nmbarrier.init.shared::cta.b64 [%r1+8], 32;"
    assert mbarrier_init_counts(text) == [128, 32]
