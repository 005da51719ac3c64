"""CPU checks of the SM100 / SM103 prefill kernel's persistent grid (``Tiles.num_ctas > 0``), which no GPU here runs.

Each persistent build is compared with the same problem's one-CTA-per-tile build (``num_ctas=0``):

* a loop over tiles around every role's work: each MMA, exponential, TMEM load / store, commit, K/V load and O
  store of the SASS sits in exactly one loop more than in the one-tile build (loops: the backward branches of the
  kernel body, before its last ``EXIT``; ptxas's out-of-line wait stubs after it are not loops), Q's TMA inside
  the block loop's first iteration (after the first K / V block), while the TMEM allocation stays outside it
  (once per CTA); the grid is 1-D and the next tile ``+ gridDim.x``;
* the static instruction counts per KV block unchanged (tcgen05.mma in the PTX, UTCHMMA, MUFU.EX2, LDTM, STTM in
  the SASS), no spills, the persistent roles' ``setmaxnreg`` budgets (the correction warpgroup's larger, and with
  two Q tiles the MMA / load warps': they carry the loop's counts), shared memory and TMEM columns within the
  SM's limits;
* the default grid (``default_tiles``): persistent without causal or a window, one CTA per tile with them;
* the ``num_ctas`` field's rules, that its value never reaches the device code (a small grid runs the default
  build's code), and that the first-use self-check's problem gives each CTA of a small persistent grid several
  tiles (its GPU half, marked ``gpu``, runs that check on a Blackwell GPU only).
"""

import dataclasses
import re

import pytest
import torch

from cutedsl_attn.planning.prefill import PrefillProblem, plan_prefill
from cutedsl_attn.sm100 import prefill as K
from cutedsl_attn.sm100.prefill import config as C
from test_sm100_prefill_cpu import built, count_prefix, problem, rel_bias, sass_counts  # (tests/ is on sys.path)

NUM_CTAS = 148

# one of each kind of build, both archs: one / two Q tiles, the head dims, paged (TMA boxes and the cp.async
# gather), the softmax-side features
PERSISTENT = [
    dict(arch="sm_100a", d=128, causal=True, g=4, dtype="bfloat16", sinks=False, q=1),
    dict(arch="sm_103a", d=64, causal=False, g=8, dtype="bfloat16", sinks=True, q=1),
    dict(arch="sm_103a", d=64, causal=False, g=8, dtype="bfloat16", sinks=True, q=2),
    dict(arch="sm_100a", d=128, causal=True, g=4, dtype="bfloat16", sinks=False, q=2),
    dict(arch="sm_103a", d=128, causal=True, g=1, dtype="float16", sinks=True, q=1),
    dict(arch="sm_100a", d=256, causal=True, g=4, dtype="bfloat16", sinks=False, q=1),
    dict(arch="sm_103a", d=192, dv=128, causal=False, g=4, dtype="bfloat16", sinks=True, q=1),
    dict(arch="sm_100a", d=128, causal=True, g=4, dtype="bfloat16", sinks=False, q=1, page_size=16),
    dict(arch="sm_103a", d=128, causal=True, g=4, dtype="bfloat16", sinks=False, q=1, page_size=1),
    dict(arch="sm_103a", d=128, causal=True, g=4, dtype="bfloat16", sinks=False, q=2, page_size=1, use_soft_cap=True),
    dict(arch="sm_100a", d=128, causal=True, g=4, dtype="bfloat16", sinks=True, q=2, page_size=16, use_window=True,
         use_soft_cap=True),
    dict(arch="sm_103a", d=128, causal=False, g=4, dtype="bfloat16", sinks=False, q=1, use_window=True,
         use_custom_mask=True, use_soft_cap=True),
]


def _id(kw):
    extra = "".join(f"-{k}{v}" for k, v in sorted(kw.items()) if k not in ("arch", "d", "causal", "g", "dtype", "q"))
    return f"{kw['arch']}-d{kw['d']}-{'causal' if kw['causal'] else 'full'}-g{kw['g']}-{kw['dtype']}-q{kw['q']}{extra}"


def persistent(kw):
    """(cfg, ptx, cubin, dump dir) of the persistent build of an entry (``num_ctas`` 148)."""
    return built({**kw, "num_ctas": NUM_CTAS})


def one_tile(kw):
    """The same entry with one CTA per tile (``num_ctas`` 0)."""
    return built({**kw, "num_ctas": 0})


def _sass_text(kw):
    return sass_counts(kw)[1]


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")


def loop_depths(text):
    """``[(mnemonic, loops holding it)]`` of a kernel's SASS: a loop is a backward branch's address range, among
    the branches before the last ``EXIT`` (after it, ptxas puts out-of-line wait retries that branch back)."""
    ins = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in _LINE.finditer(text)]
    end = max(a for a, op, _ in ins if op == "EXIT")
    loops = []
    for a, op, args in ins:
        m = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") and a < end else None
        if m and int(m.group(1), 16) <= a:
            loops.append((int(m.group(1), 16), a))
    return [(op, sum(lo <= a <= hi for lo, hi in loops)) for a, op, _ in ins]


def depths_of(text, prefix):
    return sorted(d for op, d in loop_depths(text) if op == prefix or op.startswith(prefix + "."))


# every role's work: MMA warp (UTCHMMA, its commits), softmax (MUFU.EX2, the S loads and P stores), correction
# (O's TMEM loads, its 16-byte stores into the staging buffers), epilogue warp (the TMA store, the ragged tiles'
# 16-byte O stores), load warp (TMA or cp.async)
ROLE_OPS = ("UTCHMMA", "UTCBAR", "MUFU.EX2", "LDTM", "STTM", "STS.128", "UTMASTG", "STG.E.128")


@pytest.mark.parametrize("kw", PERSISTENT, ids=_id)
def test_a_loop_over_tiles_around_every_role(kw):
    cfg, ptx, _, _ = persistent(kw)
    base_cfg, base_ptx, _, _ = one_tile(kw)
    assert cfg.tiles.num_ctas == NUM_CTAS and base_cfg.tiles.num_ctas == 0 and cfg.epi_stages > 0
    text = _sass_text({**kw, "num_ctas": NUM_CTAS})
    base_text = _sass_text({**kw, "num_ctas": 0})
    load = "LDGSTS" if cfg.page_rows == 0 and kw.get("page_size") else "UTMALDG"
    for op in ROLE_OPS + ((load,) if load == "LDGSTS" else ()):
        base = depths_of(base_text, op)
        assert base, f"{op} missing from the one-tile build"
        assert depths_of(text, op) == [d + 1 for d in base], f"{op} is not inside one more loop"
    # Q's TMA (the one-tile build's only loads outside the block loop): issued in the first block's iteration,
    # after that block's K and V (it waits for the previous tile's last MMA)
    base = depths_of(base_text, "UTMALDG")
    assert depths_of(text, "UTMALDG") == sorted(d + 1 if d else 2 for d in base) and 0 in base
    # TMEM allocated once per CTA, outside the tile loop
    assert depths_of(text, "UTCATOMSWS") == depths_of(base_text, "UTCATOMSWS") != []
    for op in ("tcgen05.alloc", "tcgen05.dealloc", "tcgen05.relinquish_alloc_permit"):
        assert ptx.count(op) == base_ptx.count(op) == 1
    # a 1-D grid: the kv head comes from the tile index, the next tile is gridDim.x further
    assert "%nctaid.x" in ptx and "%nctaid.x" not in base_ptx
    assert "%ctaid.y" in base_ptx and "%ctaid.y" not in ptx


@pytest.mark.parametrize("kw", PERSISTENT, ids=_id)
def test_per_block_mix_and_resources_unchanged(kw):
    from cutedsl_attn.inspect import cubin_resources

    cfg, ptx, cubin, _ = persistent(kw)
    base_cfg, base_ptx, _, _ = one_tile(kw)
    assert ptx.count("tcgen05.mma") == base_ptx.count("tcgen05.mma") == cfg.tiles.q_tiles * (
        cfg.problem.head_dim_qk // 16 + cfg.tiles.tile_n // 16)
    assert ptx.count("ex2.approx") == base_ptx.count("ex2.approx")
    counts, text = sass_counts({**kw, "num_ctas": NUM_CTAS})
    base_counts, _ = sass_counts({**kw, "num_ctas": 0})
    for op in ("UTCHMMA", "LDTM", "STTM", "UTCBAR", "UTMASTG"):
        assert count_prefix(counts, op) == count_prefix(base_counts, op), op
    assert counts.get("MUFU.EX2", 0) == base_counts.get("MUFU.EX2", 0)
    res = cubin_resources(cubin)
    assert res["stack_bytes"] == 0, f"stack frame {res['stack_bytes']} B: spills or a local array"
    assert count_prefix(counts, "LDL") == 0 and count_prefix(counts, "STL") == 0
    assert res["registers"] * cfg.roles.num_threads <= C.REGISTER_FILE
    got = sorted(int(x, 16) for x in re.findall(r"USETMAXREG\.\S+\s+(?:UP\d+,\s*)?(0x[0-9a-f]+)", text))
    assert got == sorted(cfg.roles.registers.values())
    assert cfg.roles == C.Roles(cfg.tiles.q_tiles, True) and base_cfg.roles == C.Roles(cfg.tiles.q_tiles)
    assert cfg.smem_bytes == base_cfg.smem_bytes <= C.SMEM_LIMIT
    assert cfg.tmem == base_cfg.tmem and cfg.tmem_cols == base_cfg.tmem_cols <= 512


def _problem(**kw):
    return PrefillProblem(**{**dict(dtype="bfloat16", head_dim_qk=128, head_dim_vo=128, group_size=4,
                                    arch="sm_100a"), **kw})


@pytest.mark.parametrize("kw, persistent_grid", [
    (dict(), True), (dict(causal=True), False), (dict(use_window=True), False),
    (dict(causal=True, use_window=True), False), (dict(use_custom_mask=True), True),
    (dict(page_size=16), True), (dict(page_size=1, use_soft_cap=True), True), (dict(use_sinks=True), True),
    (dict(head_dim_qk=256, head_dim_vo=256), True), (dict(head_dim_qk=192, causal=True), False),
    (dict(head_dim_qk=64, head_dim_vo=64, group_size=8), True), (dict(score_mod=rel_bias, causal=True), False),
])
def test_default_grid_is_persistent_without_causal_or_window(kw, persistent_grid):
    """The default grid rule (``default_tiles``): a persistent grid of one CTA per SM where every tile of a
    request sees all of its keys, one CTA per tile where causal or a window make the tiles' costs differ."""
    p = _problem(**kw)
    for sms in (148, 132):
        t = K.default_tiles(p, num_sms=sms)
        assert t.num_ctas == (sms if persistent_grid else 0)
        assert K.Config(p, t).roles == C.Roles(t.q_tiles, persistent_grid)
    for bad in (0, -1, True, 148.0):
        with pytest.raises(ValueError, match="num_sms"):
            K.default_tiles(p, num_sms=bad)


def test_the_grid_size_never_reaches_the_device_code():
    """A persistent build's PTX is the same for any ``num_ctas > 0`` (the grid is set on the host; the device
    code reads ``gridDim.x``), so a small grid (the self-check's, :data:`SELFCHECK_CTAS`) runs the default
    build's code."""
    kw = PERSISTENT[1]

    def normalised(ptx):
        for i, name in enumerate(dict.fromkeys(re.findall(r"\.entry\s+([A-Za-z_$][\w$]*)", ptx))):
            ptx = ptx.replace(name, f"KERNEL{i}")
        return ptx

    small, big = built({**kw, "num_ctas": SELFCHECK_CTAS}), persistent(kw)
    assert small[0].tiles.num_ctas == SELFCHECK_CTAS and big[0].tiles.num_ctas == NUM_CTAS
    assert normalised(small[1]) == normalised(big[1])


def test_num_ctas_field():
    p = problem()
    assert "num_ctas" in K.TUNING_FIELDS
    assert K.Config(p, K.Tiles(num_ctas=1)).tiles.num_ctas == 1
    assert K.override_tiles(K.Tiles(), {"num_ctas": "296"}).num_ctas == 296
    with pytest.raises(ValueError, match="num_ctas"):
        K.Config(p, K.Tiles(num_ctas=-1))
    with pytest.raises(ValueError, match="num_ctas must be an int"):
        K.Config(p, K.Tiles(num_ctas=True))
    assert K.Config(p, K.Tiles(num_ctas=148, q_tiles=2)).roles == C.Roles(2, True)
    from cutedsl_attn.compile.keys import config_key

    assert config_key(K.Config(p, K.Tiles(num_ctas=148))) != config_key(K.Config(p, K.Tiles()))


@pytest.mark.parametrize("q", (1, 2))
def test_persistent_register_plan(q):
    """The persistent roles' budgets: within the register file, the softmax above and the others below the launch
    share, the correction warpgroup's (and with two Q tiles the MMA / load warps') above the one-tile plan's."""
    r, one = C.Roles(q, True), C.Roles(q)
    regs = r.registers
    assert (q * regs["softmax"] + regs["correction"] + regs["other"]) * 128 <= C.REGISTER_FILE
    assert regs["softmax"] > (C.REGISTER_FILE // r.num_threads) // 8 * 8 > regs["correction"] > regs["other"]
    assert all(v % 8 == 0 and 24 <= v <= 256 for v in regs.values())
    assert regs["correction"] > one.registers["correction"] and r.num_warps == one.num_warps


# ----------------------------------------------------------------------------- the first-use self-check
SELFCHECK_CTAS = 3  # a grid small enough that every CTA of the check's problem runs several tiles
SELFCHECK_CASES = [
    dict(causal=True),
    dict(causal=True, q_tiles=2),
    dict(group_size=1, use_sinks=True),
    dict(use_sinks=True, page_size=16),
    dict(causal=True, use_window=True, use_soft_cap=True),
]


def _selfcheck_choice(arch, case):
    from cutedsl_attn import dispatch

    case = dict(case)
    q_tiles = case.pop("q_tiles", 1)
    p = dispatch.prefill_problem(**dict(dict(dtype=torch.bfloat16, head_dim_qk=128, head_dim_vo=128, group_size=4,
                                             arch=arch), **case))
    t = dataclasses.replace(K.default_tiles(p, num_sms=148), q_tiles=q_tiles, num_ctas=SELFCHECK_CTAS)
    return dispatch.KernelChoice(K, p, t), p


@pytest.mark.parametrize("case", SELFCHECK_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_selfcheck_problem_gives_each_cta_several_tiles(case):
    """The check's batch (``cutedsl_attn.selfcheck``) planned with the persistent choice's ``tile_m`` has at
    least twice :data:`SELFCHECK_CTAS` tiles, so each CTA carries its pipelines over tile boundaries."""
    from cutedsl_attn import selfcheck as sc

    choice, p = _selfcheck_choice("sm_100a", case)
    qo_ip = torch.tensor([0] + torch.tensor(sc._QO_LENS).cumsum(0).tolist())
    work, num_rows = plan_prefill(sc._QO_LENS, sc._KV_LENS, qo_ip[:-1], qo_ip[:-1], None,
                                  group_size=p.group_size, tile_m=choice.tile_m, causal=p.causal,
                                  window_left=50 if p.use_window else -1)
    assert work.shape[0] * sc._NUM_KV_HEADS >= 2 * SELFCHECK_CTAS


@pytest.mark.gpu
@pytest.mark.parametrize("case", SELFCHECK_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_selfcheck_passes_the_persistent_grid(case):
    """On a Blackwell GPU: the first-use check (``check_prefill``: the kernel against the portable kernel and the
    oracle, outputs poisoned) passes a persistent build of three CTAs."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() not in ((10, 0), (10, 3)):
        pytest.skip("needs an SM100 / SM103 (Blackwell) GPU")
    from cutedsl_attn import dispatch
    from cutedsl_attn import selfcheck as sc
    from cutedsl_attn.compile.arch import device_arch

    choice, p = _selfcheck_choice(device_arch(), case)
    v = sc.check_prefill(choice, dispatch.prefill_choice(p, kernel="portable"))
    assert v.passed, v
