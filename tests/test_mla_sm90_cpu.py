"""CPU tests of the SM90 MLA decode kernel: its contract, the dispatch default and its PTX / cubin / SASS
(cross-compiled for sm_90a; the kernel needs an H200 to run)."""

import re
import subprocess

import cutlass
import pytest
import torch
from _builds import build  # (tests/ is on sys.path)

from cutedsl_attn.compile.cubin import cubin_kernel_resources
from cutedsl_attn.planning.mla import MlaProblem

sm90 = pytest.importorskip("cutedsl_attn.sm90.mla")


def _problem(**kw):
    return MlaProblem(**{**dict(dtype="bfloat16", page_size=64), **kw})


def test_unsupported_and_config_rules():
    assert sm90.unsupported_reason(_problem()) is None
    assert sm90.unsupported_reason(_problem(dtype="float16", causal=True)) is None
    for kw, word in ((dict(arch="sm_100a"), "sm_90a only"), (dict(page_size=48), "page_size"),
                     (dict(page_size=3), "page_size")):
        reason = sm90.unsupported_reason(_problem(**kw))
        assert reason is not None and word in reason and "portable kernel" in reason, (kw, reason)
    with pytest.raises(TypeError):
        sm90.unsupported_reason("mla")
    with pytest.raises(ValueError, match="cannot serve"):
        sm90.Config(_problem(page_size=48), sm90.Tiles())
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
    assert sm90.TUNING_FIELDS == ("num_stages", "consumer_registers", "schedule", "merge_kernel", "fp8_loads",
                                  "swap_ab", "tile_n")
    with pytest.raises(ValueError, match="fp8_loads"):
        sm90.Tiles(fp8_loads=2)
    assert (sm90.Tiles().schedule, sm90.Tiles().merge_kernel) == (0, 0)  # field defaults: signal first, in-kernel merge
    assert sm90.override_tiles(sm90.Tiles(), {"schedule": "1", "merge_kernel": "1"}) == sm90.Tiles(schedule=1,
                                                                                                     merge_kernel=1)
    assert sm90.override_tiles(sm90.Tiles(), {"consumer_registers": "240"}).consumer_registers == 240
    with pytest.raises(ValueError):
        sm90.override_tiles(sm90.Tiles(), {"tile_m": "32"})
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
    # the automatic choice on sm_90a: the SM90 kernel at page 64
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
        for kw in (dict(page_size=63), dict(page_size=48), dict(arch="sm_100a"), dict(arch="sm_103a"),
                   dict(arch="sm_100a", kv_dtype="float8_e4m3fn")):
            assert d.mla_choice(_problem(**kw))[0] is md, (env, kw)
        for kw in (dict(page_size=16), dict(page_size=1), dict(page_size=32)):  # gathered pages: many heads
            assert d.mla_choice(_problem(**kw))[0] is sm90, (env, kw)
            assert d.mla_choice(_problem(**kw), num_heads=128)[0] is sm90, (env, kw)
            assert d.mla_choice(_problem(**kw), num_heads=16)[0] is (sm90 if env == "sm90" else md), (env, kw)
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
def test_sm90_kernel_ptx_and_cubin(variant):
    kw, tiles = VARIANTS[variant]
    p = _problem(**kw)
    cfg = sm90.Config(p, sm90.Tiles(**tiles))
    merge_kernel = cfg.tiles.merge_kernel == 1
    b = build(sm90.compile, cfg)
    ptx = b.ptx
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
    cub = b.cubin_path  # (for nvdisasm)
    res = cubin_kernel_resources(b.cubin)
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
    cfg_p = md.Config(p, md.default_tiles(p, num_sms=132))
    cfg_s = d.mla_choice(p, num_heads=16, max_qo_len=1)[1]
    assert cfg_s.tiles.swap_ab == 1
    d._mla_op(*args, d._key_of_config(cfg_p))
    d._mla_sm90_op(*args, d._key_of_config(cfg_s))
    assert [m for m, _ in seen] == [md, sm90]
    assert seen[0][1] == cfg_p and seen[1][1] == cfg_s  # the traced tiles, not a re-derived choice


def test_swap_ab_auto_rule(monkeypatch):
    """Auto takes the SM90 kernel's swapped form at 16-bit page 64 for at most SWAP_AB_MAX_ROWS packed query
    rows a request (measured: perf/RESULTS.md, MLA), never in CUDA-graph mode, fp8, small pages, or when
    CUTEDSL_ATTN_MLA_TUNE names swap_ab / tile_n."""
    from cutedsl_attn.dispatch import mla as d

    monkeypatch.delenv("CUTEDSL_ATTN_MLA_KERNEL", raising=False)
    monkeypatch.delenv("CUTEDSL_ATTN_MLA_TUNE", raising=False)
    p = _problem()
    tiles = lambda prob, **kw: d.mla_choice(prob, **kw)[1].tiles  # noqa: E731
    assert tiles(p, num_heads=16, max_qo_len=1).swap_ab == 1 and tiles(p, num_heads=16, max_qo_len=1).tile_n == 16
    assert tiles(p, num_heads=8, max_qo_len=2).swap_ab == 1
    for kw in (dict(num_heads=16, max_qo_len=2), dict(num_heads=32, max_qo_len=1), dict(num_heads=128, max_qo_len=1),
               dict(num_heads=16), dict(max_qo_len=1), dict(num_heads=16, max_qo_len=1, cuda_graph=True)):
        assert tiles(p, **kw).swap_ab == 0, kw
    assert d.mla_choice(_problem(page_size=16), num_heads=128, max_qo_len=1)[1].tiles.swap_ab == 0
    assert tiles(_problem(kv_dtype="float8_e4m3fn"), num_heads=128, max_qo_len=1).swap_ab == 0
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_TUNE", "swap_ab=0")
    assert tiles(p, num_heads=16, max_qo_len=1).swap_ab == 0
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_TUNE", "swap_ab=1,tile_n=32")
    assert tiles(p, num_heads=16, max_qo_len=1).tile_n == 32
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_KERNEL", "sm90")  # forced: the default tiles
    monkeypatch.delenv("CUTEDSL_ATTN_MLA_TUNE")
    assert tiles(p, num_heads=16, max_qo_len=1).swap_ab == 0


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


FP8 = "float8_e4m3fn"


def test_small_pages_and_fp8_routing(monkeypatch):
    """On sm_90a: fp8 caches / q at page 64 go to the SM90 kernel from FP8_SM90_MIN_HEADS heads (the portable
    kernel below, measured faster there); page sizes dividing 64 are served by the SM90 kernel's gathered path,
    chosen for 16-bit caches from SMALL_PAGE_SM90_MIN_HEADS heads (fp8 there and fewer heads: portable);
    page sizes that do not divide 64 and other archs go to the portable kernel."""
    from cutedsl_attn import dispatch as d
    from cutedsl_attn.portable import mla_decode as md

    monkeypatch.delenv("CUTEDSL_ATTN_MLA_KERNEL", raising=False)
    monkeypatch.delenv("CUTEDSL_ATTN_MLA_TUNE", raising=False)
    small = [dict(page_size=ps) for ps in (1, 2, 4, 8, 16, 32)] + [
        dict(kv_dtype=FP8, page_size=16), dict(dtype=FP8, kv_dtype=FP8, page_size=1, causal=True)]
    fp8_64 = [dict(kv_dtype=FP8), dict(dtype="float16", kv_dtype=FP8), dict(dtype=FP8, kv_dtype=FP8)]
    for kw in small + fp8_64:
        assert sm90.unsupported_reason(_problem(**kw)) is None, kw
    for kw in small:
        want = md if kw.get("kv_dtype") == FP8 else sm90
        assert d.mla_choice(_problem(**kw), num_heads=128)[0] is want, kw
        assert d.mla_choice(_problem(**kw), num_heads=d.SMALL_PAGE_SM90_MIN_HEADS - 1)[0] is md, kw
    for kw in fp8_64:
        assert d.mla_choice(_problem(**kw), num_heads=128)[0] is sm90, kw
        assert d.mla_choice(_problem(**kw), num_heads=16)[0] is md, kw  # few heads: the portable kernel
    assert d.mla_choice(_problem(kv_dtype=FP8), num_heads=d.FP8_SM90_MIN_HEADS)[0] is sm90
    assert d.mla_choice(_problem(), num_heads=16)[0] is sm90  # 16-bit caches at page 64: any head count
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_KERNEL", "sm90")  # forced: every problem the SM90 kernel serves
    for kw in small + fp8_64:
        module, cfg = d.mla_choice(_problem(**kw), num_heads=16)
        assert module is sm90, kw
        fp8 = cfg.problem.kv_fp8
        assert cfg.tiles == sm90.Tiles(merge_kernel=1) and cfg.tiles.fp8_loads == 1, kw  # fp8 staged in the stage
        assert cfg.gather and cfg.mma_dtype is (cutlass.Float16 if fp8 else cfg.cutlass_dtype)
        assert cfg.widen_q == (kw.get("dtype", "bfloat16") != "float16" and fp8)
        assert cfg.cutlass_dtype is {"float16": cutlass.Float16}.get(kw.get("dtype"), cutlass.BFloat16)  # o's
    assert not sm90.Config(_problem(), sm90.Tiles()).gather
    for ps in (3, 48, 63):  # not a divisor of 64: a block would straddle a page
        reason = sm90.unsupported_reason(_problem(page_size=ps))
        assert reason is not None and "page_size" in reason and "portable kernel" in reason
        assert d.mla_choice(_problem(page_size=ps))[0] is md
    assert "sm_90a only" in sm90.unsupported_reason(_problem(arch="sm_100a", page_size=16))


def test_gathered_rows_write_the_tma_layout():
    """The producer's row gather (:mod:`cutedsl_attn.sm90.mla.loads`): every thread owns one row and half of its
    pieces, the 128 threads cover each (row, piece) of a 64 x 576 block exactly once at the offset the TMA boxes
    use (``sw128_offset``), and the eight lanes of a quarter warp hit eight distinct 16-byte bank groups."""
    from cutedsl_attn.common.smem import sw128_offset
    from cutedsl_attn.sm90.mla import loads
    from cutedsl_attn.sm90.mla.config import GROUP_CHUNKS

    for fp8 in (False, True):
        assert sorted(loads.block_row(t, fp8) for t in range(0, 128, 2)) == list(range(64))
        seen = {}
        for tid in range(128):
            r, h, x16 = loads.block_row(tid, fp8), tid % 2, loads.swizzle_mask(tid, fp8)
            for g, chunks in enumerate(GROUP_CHUNKS):
                col0 = chunks[0] * 8
                base = chunks[0] * loads.CHUNK_BYTES + r * 128
                if fp8:
                    pieces = [(k, e, col0 + 4 * k + 2 * h + e) for k in range(len(chunks) * 2) for e in range(2)]
                    offs = [(k * 2 + e, base + loads.piece_offset(k, x16, True, e), c) for k, e, c in pieces]
                else:
                    offs = [(k, base + loads.piece_offset(k, x16, False), col0 + 2 * k + h)
                            for k in range(len(chunks) * 4)]
                for step, off, c in offs:
                    assert off == sw128_offset(r, c, 64), (fp8, tid, g, step)
                    seen.setdefault((g, step, tid // 8), []).append(off)
        assert sum(len(v) for v in seen.values()) == 64 * 72
        for key, offs in seen.items():  # one store instruction's quarter warp: distinct bank groups
            assert len({(o % 128) // 16 for o in offs}) == 8, (fp8, key, offs)
    # fp8 staged in place (Tiles.fp8_loads 1): fp8 piece k of a group is copied into the thread's own 16-bit slot
    # (n/2 + k // 2, k % 2) and widened in piece order into slots (k, 0), (k, 1): every staged piece is read
    # before a write lands on it, and the staging slots are the thread's own
    for tid in range(128):
        x16 = loads.swizzle_mask(tid, True)
        for n in (8, 2):  # a ckv group's and the kpe group's fp8 pieces per thread
            own = {loads.piece_offset(k, x16, True, e) for k in range(n) for e in range(2)}
            mem = {loads.piece_offset(n // 2 + k // 2, x16, True, k % 2): ("fp8", k) for k in range(n)}
            assert set(mem) <= own and len(mem) == n
            for k in range(n):
                assert mem[loads.piece_offset(n // 2 + k // 2, x16, True, k % 2)] == ("fp8", k), (tid, n, k)
                for e in range(2):
                    mem[loads.piece_offset(k, x16, True, e)] = ("f16", k)
            assert set(mem) == own and all(v[0] == "f16" for v in mem.values())


REG = dict(fp8_loads=0, consumer_registers=224)  # fp8 through registers: the producer's 56 registers
GATHER_VARIANTS = {
    "p1": (dict(page_size=1), {}),
    "p16_fp16_causal": (dict(page_size=16, dtype="float16", causal=True), {}),
    "p32": (dict(page_size=32), {}),
    "p32_s_first": (dict(page_size=32, causal=True), dict(schedule=1)),
    "fp8kv_p64": (dict(kv_dtype=FP8), {}),
    "fp8kv_p16_causal": (dict(kv_dtype=FP8, page_size=16, causal=True), {}),
    "fp8kv_fp16q_p1": (dict(dtype="float16", kv_dtype=FP8, page_size=1), {}),
    "fp8q_p64": (dict(dtype=FP8, kv_dtype=FP8), {}),
    "fp8q_p32": (dict(dtype=FP8, kv_dtype=FP8, page_size=32), {}),
    "fp8kv_p64_registers": (dict(kv_dtype=FP8), REG),
    "fp8q_p16_registers": (dict(dtype=FP8, kv_dtype=FP8, page_size=16), REG),
}


@pytest.mark.parametrize("variant", sorted(GATHER_VARIANTS))
def test_sm90_gather_ptx_and_cubin(variant):
    """Small pages and fp8 caches: every block gathered (no TMA), fp8 widened
    to f16 (staged in the stage by cp.async, or through registers), the same GEMMs as page 64, and no spills in the
    producer's 40 / 56 registers."""
    kw, tiles = GATHER_VARIANTS[variant]
    p = _problem(**kw)
    cfg = sm90.Config(p, sm90.Tiles(**{"merge_kernel": 1, **tiles}))
    b = build(sm90.compile, cfg)
    ptx = b.ptx
    assert re.search(r"\.target\s+sm_90a", ptx)
    assert len(re.findall(r"\.entry\s+(\S+)\(", ptx)) == 2  # the main kernel and the merge kernel
    ab = "f16" if p.kv_fp8 or p.dtype == "float16" else "bf16"
    assert len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.{ab}\.{ab}\s", ptx)) == 3 * 36
    assert len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.{ab}\.{ab}\s", ptx)) == 3 * 4
    assert "cp.async.bulk.tensor" not in ptx  # no TMA: every block is gathered row by row
    n_cp = len(re.findall(r"cp\.async\.cg\.shared\.global", ptx))
    n_ld = len(re.findall(r"ld\.global\.nc\.v4\.b32", ptx))
    if p.kv_fp8:
        staged = cfg.tiles.fp8_loads == 1
        # 16 e4m3 a piece, 18 per thread and block (8 + 8 ckv, 2 kpe): staged, one cp.async each (2 stages);
        # through registers, 16-byte loads (the ckv loops rolled by 4)
        assert n_ld == (0 if staged else 2 * (4 + 4 + 2)), n_ld
        n_kv = 2 * 18 if staged else 0
        assert "cvt.rn.f16x2.e4m3x2" in ptx and "st.shared.v4.b32" in ptx
        assert "mbarrier.arrive" in ptx and "fence.proxy.async" in ptx
        # Q by cp.async (one rolled loop; 8-byte pieces of an fp8 q), widened in place unless it is f16
        assert n_cp == n_kv + (0 if p.q_fp8 else 1)
        assert ("cp.async.ca.shared.global" in ptx) == p.q_fp8
        if p.dtype == "bfloat16":
            assert "cvt.rn.f16x2.f32" in ptx
    else:
        # Q (one rolled loop) and per stage 16 + 16 + 4 pieces a thread; the tail-page gather of page 64 is gone
        assert n_cp == 1 + 2 * 36
        assert "cvt.rn.f16x2.e4m3x2" not in ptx
        assert "cp.async.mbarrier.arrive.noinc" in ptx
    # each row's page id once per block: a 64-bit product of page id and page stride
    assert "mul.wide.s32" in ptx or "mul.lo.s64" in ptx
    c, pr = cfg.registers
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{pr}\b", ptx)
    assert ".local" not in ptx
    cub = b.cubin_path  # (for nvdisasm)
    res = cubin_kernel_resources(b.cubin)
    assert all(x["stack_bytes"] == 0 for x in res.values()), res  # no spills (the producer's 40 or 56 included)
    r = max(res.values(), key=lambda x: x["registers"])
    assert 256 * c + 128 * pr <= r["registers"] * cfg.num_threads
    tool = _nvdisasm()
    if tool is None:
        pytest.skip("no nvdisasm (pip install nvidia-cuda-nvdisasm) for the SASS checks")
    sass = subprocess.run([tool, "-c", cub], check=True, capture_output=True, text=True).stdout
    assert not re.search(r"\b(STL|LDL)\b", sass)
    hgmma = re.findall(r"HGMMA\.64x(\d+)x16\.F32\b", sass)
    assert hgmma.count("64") == 3 * 36 and hgmma.count("256") == 3 * 4
    assert len(re.findall(r"WARPGROUP\.DEPBAR", sass)) <= 6
    if p.kv_fp8:
        assert "F2FP.F16.E4M3.UNPACK_B" in sass
        assert ("LDG.E.128.CONSTANT" in sass) == (cfg.tiles.fp8_loads == 0)


# ------------------------------------------------------------------ the small-head form (Tiles.swap_ab)
def test_swap_ab_rules(monkeypatch):
    """swap_ab 0 / 1 and tile_n 16 / 32 (tile_n only with swap_ab), 16-bit caches only, reachable through
    CUTEDSL_ATTN_MLA_TUNE; the default tiles keep swap_ab 0."""
    from cutedsl_attn import dispatch as d

    assert (sm90.Tiles().swap_ab, sm90.Tiles().tile_n) == (0, 0)
    assert sm90.Tiles(swap_ab=1) == sm90.Tiles(swap_ab=1, tile_n=32)  # tile_n 0: 32 rows under swap_ab
    assert sm90.default_tiles(_problem(), num_sms=132).swap_ab == 0
    for bad in (dict(swap_ab=2), dict(swap_ab=1, tile_n=64), dict(swap_ab=1, tile_n=8), dict(tile_n=16),
                dict(tile_n=32)):
        with pytest.raises(ValueError, match="swap_ab|tile_n"):
            sm90.Tiles(**bad)
    assert sm90.override_tiles(sm90.Tiles(), {"swap_ab": "1", "tile_n": "16"}) == sm90.Tiles(swap_ab=1, tile_n=16)
    with pytest.raises(ValueError, match="fp8"):
        sm90.Config(_problem(kv_dtype="float8_e4m3fn"), sm90.Tiles(swap_ab=1))
    for kw in (dict(), dict(page_size=16, causal=True), dict(dtype="float16", page_size=1)):
        cfg = sm90.Config(_problem(**kw), sm90.Tiles(swap_ab=1))
        assert cfg.smem_bytes <= 227 * 1024 and cfg.tile_m == 64
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_KERNEL", "sm90")
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_TUNE", "swap_ab=1")
    module, cfg = d.mla_choice(_problem(), num_heads=16)
    assert module is sm90 and cfg.tiles == sm90.Tiles(merge_kernel=1, swap_ab=1, tile_n=32)
    monkeypatch.setenv("CUTEDSL_ATTN_MLA_TUNE", "swap_ab=1,tile_n=16,merge_kernel=0")
    assert d.mla_choice(_problem(page_size=16))[1].tiles == sm90.Tiles(swap_ab=1, tile_n=16)


def test_swap_ab_launch_refuses_rows_past_tile_n():
    """The packed rows (the plan's 16-row tiles) must fit tile_n: a named ValueError, nothing launched."""
    from cutedsl_attn.planning.mla import MlaArgs

    calls = []
    names = ("q_nope", "q_pe", "ckv", "kpe", "indices", "work", "out", "lse", "part_o", "part_lse", "counters")
    for tile_n, row_tiles, ok in ((16, 1, True), (16, 2, False), (32, 2, True), (32, 3, False), (32, 4, False)):
        cfg = sm90.Config(_problem(), sm90.Tiles(swap_ab=1, tile_n=tile_n))
        args = MlaArgs(*names, 0.5, row_tiles, 1.0)
        if ok:
            sm90.launch(lambda *a: calls.append(a), cfg, args)
            assert calls.pop() == (*names, 0.5, 1.0, 1)  # one CTA a work item
        else:
            with pytest.raises(ValueError, match="tile_n"):
                sm90.launch(lambda *a: calls.append(a), cfg, args)
            assert not calls


def test_swap_ab_p_t_layout():
    """P^T's 16-bit stores land where the O^T GEMM's B operand (the kpe chunk's first tile_n rows, K-major) reads
    them: the TMA boxes' swizzled layout, each (query row, token) once."""
    from cutedsl_attn.common.smem import sw128_offset
    from cutedsl_attn.sm90.mla.swapab import pt_offset

    seen = set()
    for col in range(32):
        for warp in range(4):
            for g in range(8):
                for h in range(2):
                    tok = 16 * warp + g + 8 * h
                    off = pt_offset(col, warp, g, h)
                    # the kpe chunk is the stage's chunk 8: 16-byte piece 64 + tok // 8 of row col, element tok % 8
                    assert off + 8 * 64 * 128 == sw128_offset(col, 64 + tok // 8, 64) + (tok % 8) * 2
                    seen.add(off)
    assert len(seen) == 32 * 64 and max(seen) < 32 * 128


SWAP_VARIANTS = {
    "bf16_p64_n16": (dict(), dict(tile_n=16)),
    "bf16_p64_n32_causal": (dict(causal=True), dict()),
    "bf16_p16_n32": (dict(page_size=16), dict()),
    "bf16_p16_n16_causal_merge_in_kernel": (dict(page_size=16, causal=True), dict(tile_n=16, merge_kernel=0)),
    "fp16_p64_n32_merge_in_kernel": (dict(dtype="float16"), dict(merge_kernel=0)),
    "fp16_p16_n16_causal_s_first": (dict(dtype="float16", page_size=16, causal=True), dict(tile_n=16, schedule=1)),
}


@pytest.mark.parametrize("variant", sorted(SWAP_VARIANTS))
def test_swap_ab_ptx_and_cubin(variant):
    """The swapped GEMMs: S^T = K Q^T as m64n{tile_n}k16 (36 k16 steps over [ckv | kpe], both operands K-major)
    and O^T = V^T P^T as 8 M tiles x 4 k16 steps (V^T MN-major: trans-a 1), each at two sites (one per consumer
    warpgroup's stage); no other MMA, no local memory, setmaxnreg kept by ptxas, no spills."""
    kw, tiles = SWAP_VARIANTS[variant]
    p = _problem(**kw)
    cfg = sm90.Config(p, sm90.Tiles(**{"merge_kernel": 1, "swap_ab": 1, **tiles}))
    n = cfg.tiles.tile_n
    b = build(sm90.compile, cfg)
    ptx = b.ptx
    assert re.search(r"\.target\s+sm_90a", ptx)
    assert len(re.findall(r"\.entry\s+(\S+)\(", ptx)) == (2 if cfg.tiles.merge_kernel else 1)
    ab = "bf16" if p.dtype == "bfloat16" else "f16"
    shapes = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.(\w+)\.(\w+)\s", ptx)
    assert shapes and set(shapes) == {(f"m64n{n}k16", ab, ab)}, set(shapes)
    # the immediates: scale-a, scale-b, trans-a, trans-b
    trans = re.findall(r"wgmma\.mma_async[^;]*,\s*1,\s*1,\s*([01]),\s*([01]);", ptx)
    assert trans.count(("0", "0")) == 2 * 36 and trans.count(("1", "0")) == 2 * 8 * 4 and len(trans) == len(shapes)
    assert "mma.sync" not in ptx
    assert ("cp.async.bulk.tensor" in ptx) == (p.page_size == 64)  # the kernel's producer: TMA pages or the gather
    assert "fence.proxy.async" in ptx and "st.shared.u16" in ptx  # P^T written for wgmma's reads
    assert re.search(r"bar\.sync\s+%r\d+,\s*128;|barrier\.sync(\.aligned)?\s+%r\d+,\s*128;", ptx)  # per warpgroup
    assert ".local" not in ptx
    c, pr = cfg.registers
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{pr}\b", ptx)
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{c}\b", ptx)
    assert re.search(r"\.minnctapersm\s+1\b", ptx)  # pins the entry register count: ptxas keeps setmaxnreg
    cub = b.cubin_path  # (for nvdisasm)
    res = cubin_kernel_resources(b.cubin)
    assert all(x["stack_bytes"] == 0 for x in res.values()), res
    r = max(res.values(), key=lambda x: x["registers"])
    assert r["registers"] <= 65536 // cfg.num_threads
    assert 256 * c + 128 * pr <= r["registers"] * cfg.num_threads, (c, pr, r["registers"])
    tool = _nvdisasm()
    if tool is None:
        pytest.skip("no nvdisasm (pip install nvidia-cuda-nvdisasm) for the SASS checks")
    sass = subprocess.run([tool, "-c", cub], check=True, capture_output=True, text=True).stdout
    assert not re.search(r"\b(STL|LDL)\b", sass)
    assert len(re.findall(r"USETMAXREG", sass)) == 2  # (dropped silently without .minnctapersm)
    hgmma = re.findall(r"HGMMA\.64x(\d+)x16\.F32\b", sass)
    assert hgmma.count(str(n)) == 2 * (36 + 32) and len(hgmma) == 2 * (36 + 32)
    assert len(re.findall(r"WARPGROUP\.DEPBAR", sass)) <= 6
