"""CPU tests of the SM90 MLA decode kernel: its contract, the dispatch default and its PTX / cubin / SASS
(cross-compiled for sm_90a; the kernel needs an H200 to run)."""

import glob
import re
import subprocess

import pytest
import torch

from cutedsl_attn.compile.cubin import cubin_kernel_resources
from cutedsl_attn.planning.mla import MlaProblem

sm90 = pytest.importorskip("cutedsl_attn.sm90.mla")


def _problem(**kw):
    return MlaProblem(**{**dict(dtype="bfloat16", page_size=64), **kw})


def test_unsupported_and_config_rules():
    assert sm90.unsupported_reason(_problem()) is None
    assert sm90.unsupported_reason(_problem(dtype="float16", causal=True)) is None
    for kw, word in ((dict(arch="sm_100a"), "sm_90a only"), (dict(page_size=16), "page_size"),
                     (dict(page_size=1), "page_size"), (dict(kv_dtype="float8_e4m3fn"), "fp8"),
                     (dict(dtype="float8_e4m3fn", kv_dtype="float8_e4m3fn"), "fp8")):
        reason = sm90.unsupported_reason(_problem(**kw))
        assert reason is not None and word in reason and "portable kernel" in reason, (kw, reason)
    with pytest.raises(TypeError):
        sm90.unsupported_reason("mla")
    with pytest.raises(ValueError, match="cannot serve"):
        sm90.Config(_problem(page_size=32), sm90.Tiles())
    with pytest.raises(TypeError):
        sm90.Config(_problem(), object())
    with pytest.raises(ValueError, match="num_stages"):
        sm90.Tiles(num_stages=3)
    with pytest.raises(ValueError, match="consumer_registers"):
        sm90.Tiles(consumer_registers=256)
    with pytest.raises(TypeError):
        sm90.Tiles(num_stages=2.0)
    for field, bad in (("schedule", 2), ("schedule", -1), ("merge_kernel", 2)):
        with pytest.raises(ValueError, match=field):
            sm90.Tiles(**{field: bad})
    with pytest.raises(TypeError):
        sm90.Tiles(merge_kernel=True)
    assert sm90.TUNING_FIELDS == ("num_stages", "consumer_registers", "schedule", "merge_kernel")
    assert (sm90.Tiles().schedule, sm90.Tiles().merge_kernel) == (0, 0)  # field defaults: signal first, in-kernel merge
    assert sm90.override_tiles(sm90.Tiles(), {"schedule": "1", "merge_kernel": "1"}) == sm90.Tiles(schedule=1,
                                                                                                     merge_kernel=1)
    assert sm90.override_tiles(sm90.Tiles(), {"consumer_registers": "240"}).consumer_registers == 240
    with pytest.raises(ValueError):
        sm90.override_tiles(sm90.Tiles(), {"tile_n": "32"})
    assert sm90.default_tiles(_problem(), num_sms=132) == sm90.Tiles(merge_kernel=1)
    cfg = sm90.Config(_problem(), sm90.Tiles())
    assert cfg.smem_bytes <= 227 * 1024 and cfg.num_threads == 384 and cfg.tile_m == 64
    c, p = cfg.registers
    # setmaxnreg moves registers within the CTA's launch pool (168 x 384): an inc beyond it blocks forever
    assert 256 * c + 128 * p <= 168 * 384 and c % 8 == 0 and p % 8 == 0 and p >= 24
    assert (c, p) == (232, 40)
    for regs, prod in ((216, 56), (224, 56), (232, 40), (240, 24)):
        c, p = sm90.Config(_problem(), sm90.Tiles(consumer_registers=regs)).registers
        assert (c, p) == (regs, prod) and 256 * c + 128 * p <= 168 * 384
    # the plan's 16-row tiles -> this kernel's 64-row tiles
    assert [sm90.num_tiles(n) for n in (1, 4, 5, 8, 16)] == [1, 1, 2, 2, 4]


def test_dispatch_default_and_fallbacks(monkeypatch):
    from cutedsl_attn import dispatch as d
    from cutedsl_attn.portable import mla_decode as md

    p = _problem()
    monkeypatch.delenv("CUTEDSL_ATTN_MLA_KERNEL", raising=False)
    monkeypatch.delenv("CUTEDSL_ATTN_MLA_TUNE", raising=False)
    # the automatic choice on sm_90a: the SM90 kernel wherever it serves the problem
    for env in (None, "auto", "sm90"):
        if env is None:
            monkeypatch.delenv("CUTEDSL_ATTN_MLA_KERNEL", raising=False)
        else:
            monkeypatch.setenv("CUTEDSL_ATTN_MLA_KERNEL", env)
        module, cfg = d.mla_choice(p)
        assert module is sm90 and isinstance(cfg, sm90.Config) and cfg.tiles == sm90.Tiles(merge_kernel=1), env
        for kw in (dict(causal=True), dict(dtype="float16"), dict(dtype="float16", causal=True)):
            assert d.mla_choice(_problem(**kw))[0] is sm90, (env, kw)
        # what the SM90 kernel does not serve falls back to the portable kernel
        for kw in (dict(page_size=16), dict(page_size=1), dict(page_size=32), dict(page_size=63),
                   dict(kv_dtype="float8_e4m3fn"), dict(dtype="float8_e4m3fn", kv_dtype="float8_e4m3fn"),
                   dict(arch="sm_100a"), dict(arch="sm_103a")):
            assert d.mla_choice(_problem(**kw))[0] is md, (env, kw)
    lim = d.mla_limits(module, cfg)
    assert lim["ctas_per_sm"] == 1 and lim["tile_m"] == 64  # one 64-row CTA per SM
    assert lim["max_splits_per_request"] == cfg.max_splits_per_request >= 128
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_KERNEL", "portable")  # forces the portable kernel
    assert d.mla_choice(p)[0] is md and d.mla_choice(_problem(causal=True))[0] is md
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_KERNEL", "sm90")
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_TUNE", "consumer_registers=240")
    assert d.mla_choice(p)[1].tiles == sm90.Tiles(consumer_registers=240, merge_kernel=1)
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_TUNE", "tile_n=16")
    with pytest.raises(ValueError, match="CUTEDSL_ATTN_MLA_TUNE"):
        d.mla_choice(p)
    monkeypatch.delenv("CUTEDSL_ATTN_MLA_TUNE")
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_KERNEL", "auto")
    assert d.mla_choice(p)[0].NAME == "mla_decode_sm90"
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_KERNEL", "fa3")
    with pytest.raises(ValueError, match="CUTEDSL_ATTN_MLA_KERNEL"):
        d.mla_choice(p)
    # under torch.compile the SM90 launch is its own custom op, writing what the portable one writes
    schema = torch.ops.cutedsl_attn.mla_decode_sm90.default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"out", "lse", "part_o", "part_lse", "counters"}
    assert sm90.NAME == "mla_decode_sm90"


def test_launch_argument_order():
    """``launch`` passes MlaArgs in the compiled entry's order, the grid's x extent in 64-row tiles."""
    from cutedsl_attn.planning.mla import MlaArgs

    seen = {}

    def fn(*a):
        seen["args"] = a

    names = ("q_nope", "q_pe", "ckv", "kpe", "indices", "work", "out", "lse", "part_o", "part_lse", "counters")
    args = MlaArgs(*names, 0.5, 8, 2.0)
    sm90.launch(fn, sm90.Config(_problem(), sm90.Tiles()), args)
    assert seen["args"] == (*names, 0.5, 2.0, 2)


def _nvdisasm():
    from cutedsl_attn import inspect as ci

    return ci._find_tool("nvdisasm")


VARIANTS = {
    "bf16": (dict(), dict()),
    "bf16_causal": (dict(causal=True), dict()),
    "fp16": (dict(dtype="float16"), dict()),
    "bf16_224": (dict(), dict(consumer_registers=224)),
    "bf16_s_first": (dict(), dict(schedule=1)),
    "bf16_causal_s_first_merge_kernel": (dict(causal=True), dict(schedule=1, merge_kernel=1)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_sm90_kernel_ptx_and_cubin(tmp_path, variant):
    kw, tiles = VARIANTS[variant]
    p = _problem(**kw)
    cfg = sm90.Config(p, sm90.Tiles(**tiles))
    merge_kernel = cfg.tiles.merge_kernel == 1
    sm90.compile(cfg, keep_ptx_dir=str(tmp_path), keep_cubin=True)
    (path,) = glob.glob(str(tmp_path / "*.ptx"))
    ptx = open(path).read()
    assert re.search(r"\.target\s+sm_90a", ptx)
    # the main kernel, and with merge_kernel the split-KV merge kernel of the same launch
    assert len(re.findall(r"\.entry\s+(\S+)\(", ptx)) == (2 if merge_kernel else 1)
    # the in-kernel merge's counter (atomic add) exists only without the merge kernel
    assert ("atom.global.add" in ptx or "red.global.add" in ptx) != merge_kernel
    ab = "bf16" if p.dtype == "bfloat16" else "f16"
    # S = Q K^T of a 64-token block: 36 k16 steps over [ckv | kpe]; O half += P V over 64 tokens: 4 k16 steps.
    # S is issued at three sites (warpgroup 0's block 0; in the loop, one per warpgroup: each reads its own half of
    # the block first), the own P V at two (block 0, the loop), the other's P V at one.
    s_mma = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.{ab}\.{ab}\s", ptx)
    pv = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.{ab}\.{ab}\s+([^;]*);", ptx)
    assert len(s_mma) == 3 * 36 and len(pv) == 3 * 4
    # the RS form takes P as four 32-bit registers ({%r..}), the SS form a second descriptor (%rd)
    n_rs = sum(1 for x in pv if re.match(r"\{[^}]*\}\s*,\s*\{\s*%r", x))
    assert n_rs == 2 * 4, pv[:2]
    assert "mma.sync" not in ptx
    assert "wgmma.fence.sync.aligned" in ptx and "wgmma.commit_group.sync.aligned" in ptx
    waits = sorted(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx))
    assert waits.count("1") == 1 and waits.count("0") >= 2
    # loads: 9 TMA boxes per page and stage (8 of ckv, 1 of kpe), the cp.async gather of the last page and Q
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::\w+\.global", ptx)) == 2 * 9
    assert "cp.async.cg.shared.global" in ptx and "cp.async.mbarrier.arrive.noinc" in ptx
    assert "mbarrier.try_wait" in ptx or "mbarrier.test_wait" in ptx
    assert "fence.proxy.async" in ptx  # cp.async / st.shared ordered before wgmma's reads
    c, pr = cfg.registers
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{pr}\b", ptx)
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{c}\b", ptx)
    assert "bar.sync" in ptx or "barrier.sync" in ptx  # the consumer warpgroups' named barrier
    assert ".local" not in ptx
    (cub,) = glob.glob(str(tmp_path / "*.cubin"))
    res = cubin_kernel_resources(open(cub, "rb").read())
    assert len(res) == (2 if merge_kernel else 1)
    assert all(x["stack_bytes"] == 0 for x in res.values()), res
    r = max(res.values(), key=lambda x: x["registers"])  # the main kernel (the merge kernel needs far fewer)
    assert r["stack_bytes"] == 0, r  # no spills
    assert r["registers"] <= 65536 // cfg.num_threads  # launchable before setmaxnreg
    # setmaxnreg redistributes the CTA's launch pool: the budgets must fit it, or an inc waits forever
    assert 256 * c + 128 * pr <= r["registers"] * cfg.num_threads, (c, pr, r["registers"])
    tool = _nvdisasm()
    if tool is None:
        pytest.skip("no nvdisasm (pip install nvidia-cuda-nvdisasm) for the SASS checks")
    sass = subprocess.run([tool, "-c", cub], check=True, capture_output=True, text=True).stdout
    assert not re.search(r"\b(STL|LDL)\b", sass)  # no local-memory spills
    hgmma = re.findall(r"HGMMA\.64x(\d+)x16\.F32\b", sass)
    assert hgmma.count("64") == 3 * 36 and hgmma.count("256") == 3 * 4
    # the GEMMs stay asynchronous: ptxas inserts no wait of its own between them (few warpgroup waits in all)
    assert len(re.findall(r"WARPGROUP\.DEPBAR", sass)) <= 6


def test_launch_traces_as_the_sm90_custom_op(monkeypatch):
    """Under torch.compile(fullgraph=True) the SM90 launch is cutedsl_attn::mla_decode_sm90 (its fake for tracing),
    run for real after, with the SM90 kernel and the output scale."""
    from cutedsl_attn.dispatch import mla as d
    from cutedsl_attn.planning.mla import MlaArgs

    monkeypatch.setenv("CUTEDSL_ATTN_MLA_KERNEL", "sm90")
    monkeypatch.delenv("CUTEDSL_ATTN_MLA_TUNE", raising=False)
    seen = []
    monkeypatch.setattr(d, "_mla_launch_direct", lambda module, cfg, args: (seen.append((module, args.output_scale)),
                                                                             args.out.fill_(1.0)))
    module, cfg = d.mla_choice(_problem())
    assert module is sm90
    t = lambda *s: torch.zeros(*s)  # noqa: E731

    def f(out):
        args = MlaArgs(t(2, 64, 512), t(2, 64, 64), t(4, 64, 512), t(4, 64, 64), torch.zeros(4, dtype=torch.int32),
                       torch.zeros(2, 10, dtype=torch.int32), out, t(2, 64), t(1, 64, 512), t(1, 64),
                       torch.zeros(8, dtype=torch.int32), 0.1, 4, 0.5)
        d.mla_launch(module, cfg, args)
        return out * 2

    torch._dynamo.reset()
    r = torch.compile(f, backend="aot_eager", fullgraph=True)(torch.zeros(2, 64, 512))
    assert seen == [(sm90, 0.5)] and torch.equal(r, torch.full((2, 64, 512), 2.0))


def test_portable_custom_op_keeps_the_portable_kernel(monkeypatch):
    """A launch traced as cutedsl_attn::mla_decode_portable (its plan made for the portable kernel's 16-row tiles
    and split limits) runs the portable kernel even where the automatic choice is now the SM90 one."""
    from cutedsl_attn.dispatch import mla as d
    from cutedsl_attn.planning.mla import MlaArgs
    from cutedsl_attn.portable import mla_decode as md

    monkeypatch.delenv("CUTEDSL_ATTN_MLA_KERNEL", raising=False)
    monkeypatch.delenv("CUTEDSL_ATTN_MLA_TUNE", raising=False)
    seen = []
    monkeypatch.setattr(d, "_mla_launch_direct", lambda module, cfg, args: seen.append((module, cfg)))
    p = _problem()
    assert d.mla_choice(p)[0] is sm90
    t = lambda *s: torch.zeros(*s)  # noqa: E731
    args = MlaArgs(t(2, 16, 512), t(2, 16, 64), t(4, 64, 512), t(4, 64, 64), torch.zeros(4, dtype=torch.int32),
                   torch.zeros(2, 10, dtype=torch.int32), t(2, 16, 512), t(2, 16), t(1, 16, 512), t(1, 16),
                   torch.zeros(2, dtype=torch.int32), 0.1, 1, 1.0)
    key = ";".join(f"{n}={getattr(p, n)!r}" for n in d._MLA_FIELDS)
    d._mla_op(*args, key)
    d._mla_sm90_op(*args, key)
    assert [m for m, _ in seen] == [md, sm90]
    assert isinstance(seen[0][1], md.Config) and seen[0][1].problem == p


def test_load_order_follows_the_schedule():
    """The producer loads a stage's release groups (ckv half 0, ckv half 1, kpe / P) in the order the consumer
    schedule frees them, so it never waits on a group freed later while an earlier-freed one waits behind it:
    signal first, the owner's half first (as its S reads them); S first, the other half and kpe (freed by the
    other warpgroup's P V) before the owner's half (freed by its own P V, read last by S)."""
    from cutedsl_attn.sm90.mla.kernel import MlaSm90Kernel

    k0 = MlaSm90Kernel(sm90.Config(_problem(), sm90.Tiles()))
    k1 = MlaSm90Kernel(sm90.Config(_problem(), sm90.Tiles(schedule=1)))
    assert [k0._load_order(c) for c in (0, 1)] == [(0, 1, 2), (1, 0, 2)]
    assert [k1._load_order(c) for c in (0, 1)] == [(1, 2, 0), (0, 2, 1)]
