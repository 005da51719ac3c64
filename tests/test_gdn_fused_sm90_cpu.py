"""CPU tests of the fused SM90 GDN kernel: its contract and its PTX / cubin (cross-compiled for sm_90a; the kernel
needs an H200 to run): one kernel, the consumer's wgmma chain and the prep's mma.sync GEMMs in it, the mbarrier
ring's arrival counts, the named barriers, no spills, registers and shared memory within one CTA's share."""

import glob
import re

import cutlass.cute as cute
import pytest

from cutedsl_attn.compile.cubin import cubin_kernel_resources
from cutedsl_attn.planning.gdn import CHUNK, GdnProblem

fused = pytest.importorskip("cutedsl_attn.sm90.gdn_fused")
chunked = pytest.importorskip("cutedsl_attn.sm90.gdn_chunked")


def _problem(**kw):
    return GdnProblem(**{**dict(dtype="bfloat16", head_dim_k=128, head_dim_v=128), **kw})


def _linear_value(ptx):
    """A function of a PTX register name -> ``(coef, root, const)``: its value as ``coef * root + const`` when it is
    built by single-definition ``add`` / ``shl`` / ``mul.lo`` / ``mov`` instructions with immediates from one
    other register ``root`` (the register itself as the root otherwise)."""
    defs = {}
    for op, dst, args in re.findall(r"^\s*(add\.[su]32|shl\.b32|mul\.lo\.[su]32|mov\.[bu]32)\s+(%r\d+),\s*([^;]*);",
                                    ptx, re.M):
        defs.setdefault(dst, []).append((op, [a.strip() for a in args.split(",")]))

    def val(x, depth=0):
        if re.fullmatch(r"-?\d+", x):
            return 0, None, int(x)
        d = defs.get(x)
        if d is None or len(d) != 1 or depth > 16:
            return 1, x, 0
        op, a = d[0]
        if op.startswith("mov"):
            return val(a[0], depth + 1)
        u, v = val(a[0], depth + 1), val(a[1], depth + 1)
        if op.startswith("add"):
            if u[1] is not None and v[1] is not None:
                return 1, x, 0
            return u[0] + v[0], u[1] or v[1], u[2] + v[2]
        if v[1] is not None:
            return 1, x, 0
        k = (1 << v[2]) if op.startswith("shl") else v[2]
        return u[0] * k, u[1], u[2] * k

    return val


def test_serves_what_the_two_kernel_path_serves():
    cases = [dict(), dict(head_dim_k=64, head_dim_v=128, use_qk_l2norm=True), dict(arch="sm_100a"),
             dict(decode=True), dict(state_k_major=True), dict(gate_per_channel=True),
             dict(erase_write_gates=True, gate_per_channel=True), dict(num_householder=2),
             dict(state_dtype="bfloat16", gate_domain="log"), dict(dtype="float16", head_dim_k=64, head_dim_v=64)]
    for kw in cases:
        assert fused.unsupported_reason(_problem(**kw)) == chunked.unsupported_reason(_problem(**kw)), kw
    assert fused.unsupported_reason(_problem()) is None
    with pytest.raises(TypeError):
        fused.unsupported_reason("gdn")


def test_prep_barrier_ids_are_distinct():
    ids = [fused.prep_barrier_id(w) for w in (0, 1)]
    assert len(set(ids)) == len(ids) and 0 not in ids and 1 not in ids and max(ids) < 16


def test_prep_barrier_redirect_maps_the_inverse_barriers_and_restores(monkeypatch):
    """Inside the redirect the shared inverse's CTA barrier is the prep warpgroup's 128-thread one; named
    barriers pass through; the original comes back, also after an exception."""
    calls = []

    def barrier(*, barrier_id=None, number_of_threads=None, **kw):
        calls.append((barrier_id, number_of_threads))

    def sync_threads(**kw):
        calls.append("cta")

    monkeypatch.setattr(cute.arch, "barrier", barrier)
    monkeypatch.setattr(cute.arch, "sync_threads", sync_threads)
    with fused._PrepWarpgroupBarriers(fused.prep_barrier_id(1)):
        cute.arch.sync_threads()
        cute.arch.barrier(barrier_id=1, number_of_threads=64)
        cute.arch.barrier(barrier_id=9, number_of_threads=32)
    cute.arch.sync_threads()
    assert calls == [(3, fused.PREP_THREADS), (1, 64), (9, 32), "cta"]
    with pytest.raises(RuntimeError):
        with fused._PrepWarpgroupBarriers(2):
            raise RuntimeError("traced code failed")
    assert cute.arch.sync_threads is sync_threads and cute.arch.barrier is barrier


def test_traced_storage_checked_against_the_config():
    fused._check_storage(1000, 2000)
    with pytest.raises(ValueError, match="shared storage"):
        fused._check_storage(2001, 2000)
    with pytest.raises(ValueError, match="shared storage"):
        fused._check_storage(fused.SMEM_LIMIT + 16, 10 ** 6)


def test_tiles_and_config_rules():
    with pytest.raises(ValueError, match="cannot serve"):
        fused.Config(_problem(arch="sm_100a"), fused.Tiles())
    with pytest.raises(ValueError, match="tile_v must be 64"):
        fused.Tiles(tile_v=128)
    with pytest.raises(ValueError, match="num_stages"):
        fused.Tiles(num_stages=4)
    with pytest.raises(ValueError, match="prep_warpgroups"):
        fused.Tiles(prep_warpgroups=3)
    assert fused.Config(_problem(), fused.Tiles(prep_warpgroups=2)).smem_bytes <= fused.SMEM_LIMIT
    assert fused.Config(_problem(), fused.Tiles(prep_warpgroups=2)).threads == 384
    with pytest.raises(ValueError, match="prep_warpgroups 2 needs head_dim_k 128"):
        fused.Config(_problem(head_dim_k=64), fused.Tiles(prep_warpgroups=2))
    with pytest.raises(TypeError):
        fused.Tiles(tile_v=64.0)
    with pytest.raises(TypeError):
        fused.Config(_problem(), chunked.Tiles(tile_v=64))
    with pytest.raises(ValueError, match="shared memory"):  # three stages fit at K = 64 only
        fused.Config(_problem(), fused.Tiles(num_stages=3))
    assert fused.Config(_problem(head_dim_k=64), fused.Tiles(num_stages=3)).smem_bytes <= fused.SMEM_LIMIT
    assert fused.TUNING_FIELDS == ("tile_v", "num_stages", "prep_warpgroups")
    assert fused.override_tiles(fused.Tiles(), {"num_stages": "3"}).num_stages == 3
    with pytest.raises(ValueError):
        fused.override_tiles(fused.Tiles(), {"num_warps": "8"})
    for kw in (dict(), dict(head_dim_k=64), dict(head_dim_v=64)):
        for chains in (None, 4, 1000):
            t = fused.default_tiles(_problem(**kw), num_sms=132, chains=chains)
            assert t == fused.Tiles(tile_v=64, num_stages=2)
            assert fused.Config(_problem(**kw), t).smem_bytes <= fused.SMEM_LIMIT
    cfg = fused.Config(_problem(), fused.Tiles())
    # the consumer's stage is the two-kernel kernel's stage at the same width (same bytes, same offsets)
    assert cfg.stage_bytes == chunked.Config(_problem(), chunked.Tiles(tile_v=64)).stage_bytes
    assert cfg.num_wg == 1 and cfg.row_u == 2 * 64 + 16


VARIANTS = {  # problem fields, (num_stages, prep_warpgroups)
    "k128_l2norm_x2": (dict(use_qk_l2norm=True), (2, 1)),
    "k128_bf16state_log_x2": (dict(state_dtype="bfloat16", gate_domain="log"), (2, 1)),
    "k64_v64_fp16_x3": (dict(dtype="float16", head_dim_k=64, head_dim_v=64), (3, 1)),
    "k64_v128_l2norm_x2": (dict(head_dim_k=64, use_qk_l2norm=True), (2, 1)),
    "k128_v64_x2": (dict(head_dim_v=64), (2, 1)),
    "k128_l2norm_x2_prep2": (dict(use_qk_l2norm=True), (2, 2)),
    "k128_bf16state_x2_prep2": (dict(state_dtype="bfloat16"), (2, 2)),
    "k128_v64_log_x2_prep2": (dict(head_dim_v=64, gate_domain="log"), (2, 2)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fused_kernel_ptx_and_cubin(tmp_path, variant):
    kw, (st, npw) = VARIANTS[variant]
    p = _problem(**kw)
    cfg = fused.Config(p, fused.Tiles(tile_v=64, num_stages=st, prep_warpgroups=npw))
    fused.compile(cfg, keep_ptx_dir=str(tmp_path), keep_cubin=True)
    (path,) = glob.glob(str(tmp_path / "*.ptx"))
    ptx = open(path).read()
    assert re.search(r"\.target\s+sm_90a", ptx)
    entries = re.findall(r"\.entry\s+(\S+)\(", ptx)
    assert len(entries) == 1 and "fused" in entries[0]  # one kernel: no prep launch, no scratch
    ab = "bf16" if p.dtype == "bfloat16" else "f16"
    K, C = p.head_dim_k, CHUNK
    # the consumer: the two-kernel main kernel's wgmma chain a chunk (one rolled chunk loop)
    n64 = len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.{ab}\.{ab}", ptx))
    nk = len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{K}k16\.f32\.{ab}\.{ab}", ptx))
    if K == 64:
        assert n64 == 2 * (K // 16) + 2 * (C // 16) and nk == n64
    else:
        assert n64 == 2 * (K // 16) + C // 16 and nk == C // 16
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)
    assert sorted(waits) == ["0", "0", "1"]
    # the prep a chunk (one rolled loop): Aqk and K K^T (K / 16 k-steps x 8 n8 tiles each), W (K / 64 halves of
    # 32) and U's 64-column V-slice (32)
    mma = len(re.findall(rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{ab}\.{ab}\.f32", ptx))
    assert mma == 2 * (K // 16) * 8 + (K // 64) * 32 + 32
    assert "ldmatrix.sync.aligned" in ptx and "cp.async.cg.shared.global" in ptx
    assert "cp.async.mbarrier.arrive" not in ptx  # the stages are filled by the prep threads' own stores
    # the ring: full / empty mbarrier per stage, each initialised to 128 arrivals (prep WG / consumer WG)
    inits = re.findall(r"mbarrier\.init\.shared\.b64\s+\[[^\]]+\],\s*(%r\d+|\d+);", ptx)
    assert len(inits) == 2 * st
    for reg in set(inits):
        assert reg.isdigit() and int(reg) == 128 or re.search(rf"mov\.b32\s+{re.escape(reg)},\s*128;", ptx), reg
    assert "mbarrier.try_wait" in ptx and "mbarrier.arrive" in ptx
    assert "fence.proxy.async.shared::cta" in ptx  # generic st.shared / cp.async -> wgmma reads
    # barriers: the CTA-wide one only at the mbarrier initialisation; each prep warpgroup's own 128-thread one
    # (id 2 for one prep warpgroup; 2 + w from a register for two); the inverse's diagonal step syncs its warp;
    # nothing that waits for the consumer after the initialisation
    bars = re.findall(r"\bbar(?:rier)?\.sync(?:\.aligned)?\s+([^;]*);", ptx)
    named = sorted(set(re.sub(r"%r\d+", "R", b.replace(" ", "").replace("\t", "")) for b in bars))
    assert named == (["0", "2,128"] if npw == 1 else ["0", "R,128"]), named
    if npw == 2:  # the id from a register: 2 + w of one warpgroup index w
        val = _linear_value(ptx)
        ids = {(n, val(reg)) for reg, n in re.findall(r"\bbar(?:rier)?\.sync(?:\.aligned)?\s+(%r\d+),\s*(\d+);", ptx)}
        roots = {v[1] for _n, v in ids}
        assert len(roots) == 1 and None not in roots, ids
        assert {(n, v[0], v[2]) for n, v in ids} == {("128", 1, 2)}, ids
    assert sum(1 for b in bars if b.strip() == "0") == 1
    # a chunk's prep: 6 barriers of its own around the 6 of the shared inverse (one missing is a race), and the
    # inverse's warp sync
    assert sum(1 for b in bars if b.replace(" ", "").endswith(",128")) == 12, bars
    assert "bar.warp.sync" in ptx
    assert ".local" not in ptx
    (cub,) = glob.glob(str(tmp_path / "*.cubin"))
    res = cubin_kernel_resources(open(cub, "rb").read())
    assert len(res) == 1
    (r,) = res.values()
    assert r["stack_bytes"] == 0, r  # no spills
    # launchable: every thread's launch registers from the CTA's pool
    assert r["registers"] * cfg.threads <= fused.LAUNCH_POOL, r
    dec = [int(x) for x in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+);", ptx)]
    inc = [int(x) for x in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+);", ptx)]
    if npw == 1:
        assert not dec and not inc  # 256 threads: every thread keeps up to 255 registers, no rebalancing
    else:
        # the budgets after setmaxnreg must fit the pool the CTA launched with, or setmaxnreg.inc waits forever
        assert dec == [fused.PREP_REGS] and inc == [fused.CONSUMER_REGS] == [chunked.CONSUMER_REGS]
        assert 128 * npw * fused.PREP_REGS + 128 * fused.CONSUMER_REGS <= r["registers"] * cfg.threads, r
    assert cfg.smem_bytes <= fused.SMEM_LIMIT


def test_contract_and_dispatch_opt_in(monkeypatch):
    """The kernel contract's names, and the dispatcher's forced choice once ``fused_sm90`` is listed (listed here
    the way dispatch lists it: one ``_FORCED`` entry)."""
    from cutedsl_attn.dispatch import gdn as dg
    from cutedsl_attn.dispatch import gdn_choice

    assert fused.NAME == "gdn_fused_sm90"
    for attr in ("Tiles", "Config", "unsupported_reason", "default_tiles", "override_tiles", "compile", "launch"):
        assert callable(getattr(fused, attr)), attr
    monkeypatch.setitem(dg._FORCED, "fused_sm90", fused)
    if "fused_sm90" not in dg._GDN_KERNELS:
        monkeypatch.setattr(dg, "_GDN_KERNELS", (*dg._GDN_KERNELS, "fused_sm90"))
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_KERNEL", "fused_sm90")
    monkeypatch.delenv("CUTEDSL_ATTN_GDN_TUNE", raising=False)
    module, cfg = gdn_choice(_problem(), chains=1000)
    assert module is fused and cfg == fused.Config(_problem(), fused.Tiles())
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_TUNE", "prep_warpgroups=2")
    assert gdn_choice(_problem())[1].tiles == fused.Tiles(prep_warpgroups=2)
    monkeypatch.delenv("CUTEDSL_ATTN_GDN_TUNE")
    assert gdn_choice(_problem(decode=True))[0].NAME == "gdn_recurrent"  # outside its family: automatic
    with pytest.raises(NotImplementedError, match="sm_90a only"):
        gdn_choice(_problem(arch="sm_100a"))


@pytest.mark.parametrize("stages,preps", [(2, 1), (3, 1), (2, 2)])
def test_ring_schedule_model(stages, preps):
    """A host model of the kernel's ring: prep warpgroup w starts at fill w (index w, producer phase 1) and steps
    P fills a chunk; the consumer takes every chunk in order.  mbarriers as phase counters (``try_wait.parity p``
    passes once the phase of parity p completed), random interleavings: every chunk reaches the consumer from its
    own stage, no wait passes on an older phase, nothing deadlocks, for chunk counts 0 .. 9."""
    import random

    class Mbar:
        def __init__(self):
            self.done = 0  # completed phases

        def ready(self, parity):
            return self.done % 2 != parity

    def advance(st):
        i, ph = st[0] + 1, st[1]
        return (0, ph ^ 1) if i == stages else (i, ph)

    rng = random.Random(1234)
    for nch in range(10):
        for _ in range(30):
            full, empty = [Mbar() for _ in range(stages)], [Mbar() for _ in range(stages)]
            buf = [None] * stages
            agents = {}
            for w in range(preps):
                agents[w] = dict(todo=list(range(w, nch, preps)), st=(w, 1))
            agents["c"] = dict(todo=list(range(nch)), st=(0, 0))
            got = []
            while any(a["todo"] for a in agents.values()):
                runnable = []
                for name, a in agents.items():
                    if a["todo"]:
                        i, ph = a["st"]
                        if (full[i] if name == "c" else empty[i]).ready(ph):
                            runnable.append(name)
                assert runnable, f"deadlock at nch={nch}"
                name = rng.choice(runnable)
                a = agents[name]
                j = a["todo"].pop(0)
                i = a["st"][0]
                if name == "c":
                    assert buf[i] == j, (nch, j, buf)  # the chunk's own fill, not an older or newer one
                    buf[i] = None
                    got.append(j)
                    empty[i].done += 1  # the consumer warpgroup's 128 arrivals complete the phase
                    a["st"] = advance(a["st"])
                else:
                    assert buf[i] is None and j % stages == i  # the stage was released; chunk j in stage j % S
                    buf[i] = j
                    full[i].done += 1  # the prep warpgroup's 128 arrivals
                    for _ in range(preps):
                        a["st"] = advance(a["st"])
            assert got == list(range(nch))
