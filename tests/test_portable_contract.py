"""The kernel contract (KERNELS.md) of the two portable kernels, on the CPU: ``Tiles`` / ``Config`` validation and
compile keys, ``unsupported_reason``, ``default_tiles``, ``override_tiles``, ``launch``'s argument order, and a
cross-compile per target whose PTX shows the SM80-class instructions and the ``output_scale`` parameter."""

from __future__ import annotations

import dataclasses
import functools
import glob
import inspect
import os
import re
import tempfile

import pytest

from cutedsl_attn.compile import SUPPORTED_ARCHS, config_key
from cutedsl_attn.compile.fake import decode_tensors
from cutedsl_attn.planning.decode import WORK_COLS, DecodeArgs, DecodeProblem
from cutedsl_attn.planning.prefill import PrefillArgs, PrefillProblem
from cutedsl_attn.portable import paged_decode as pd
from cutedsl_attn.portable import prefill as pf

PREFILL = dict(dtype="bfloat16", head_dim_qk=128, head_dim_vo=128, group_size=4)
DECODE = dict(dtype="bfloat16", head_dim=128, page_size=16, group_size=4)

# one other legal value per problem field: each must give another compile key
PREFILL_OTHER = dict(dtype="float16", head_dim_qk=64, head_dim_vo=64, group_size=8, page_size=16, causal=True,
                     use_window=True, use_soft_cap=True, use_sinks=True, use_custom_mask=True,
                     pos_encoding_mode="ALIBI", score_mod=lambda s, b, h, q, k: s, arch="sm_100a")
DECODE_OTHER = dict(dtype="float16", head_dim=64, page_size=1, group_size=8, pos_encoding_mode="ROPE_LLAMA",
                    use_soft_cap=True, use_sinks=True, arch="sm_103a")


def _rel_bias(score, batch_idx, head_idx, q_idx, kv_idx):
    return score - 0.004 * (q_idx - kv_idx)


def _pf_cfg(tiles=None, **over):
    return pf.Config(PrefillProblem(**{**PREFILL, **over}), tiles or pf.Tiles())


def _pd_cfg(tiles=None, **over):
    return pd.Config(DecodeProblem(**{**DECODE, **over}), tiles or pd.Tiles())


# ----------------------------------------------------------------------------- Tiles and Config
def test_names():
    assert (pf.NAME, pd.NAME) == ("prefill_portable", "paged_decode")


def test_prefill_tiles_validation():
    assert pf.Tiles() == pf.Tiles(num_warps=4, tile_n=64, num_stages=2)
    assert pf.Tiles(num_warps=8, tile_n=32).num_warps == 8
    for bad in (dict(num_warps=4.0), dict(tile_n=True), dict(num_stages="2")):
        with pytest.raises(TypeError, match=next(iter(bad))):
            pf.Tiles(**bad)
    for bad, msg in ((dict(num_warps=2), "num_warps must be 4 or 8"), (dict(tile_n=128), "tile_n must be 32 or 64"),
                     (dict(num_stages=3), "num_stages must be 2")):
        with pytest.raises(ValueError, match=msg):
            pf.Tiles(**bad)
    with pytest.raises(dataclasses.FrozenInstanceError):
        pf.Tiles().num_warps = 8


def test_decode_tiles_validation():
    assert pd.Tiles() == pd.Tiles(num_warps=4, num_stages=3)
    for bad in (dict(num_warps=4.0), dict(num_stages=False)):
        with pytest.raises(TypeError, match=next(iter(bad))):
            pd.Tiles(**bad)
    for bad, msg in ((dict(num_warps=3), "num_warps must be 1, 2, 4 or 8"), (dict(num_stages=1), r"\[2, 6\]"),
                     (dict(num_stages=7), r"\[2, 6\]")):
        with pytest.raises(ValueError, match=msg):
            pd.Tiles(**bad)


def test_prefill_config_validation_and_derived():
    cfg = _pf_cfg()
    assert (cfg.tile_m, cfg.num_threads, cfg.row_bytes_qk, cfg.row_bytes_vo) == (64, 128, 272, 272)
    assert cfg.smem_bytes == 64 * 272 + 2 * 64 * (272 + 272)
    assert cfg.q_in_registers and not _pf_cfg(head_dim_qk=192).q_in_registers
    assert cfg.positive_scale_only is False
    assert (cfg.arch, cfg.head_dim_qk, cfg.head_dim_vo, cfg.page_size) == ("sm_90a", 128, 128, 0)
    assert _pf_cfg(pf.Tiles(num_warps=8)).tile_m == 128
    assert _pf_cfg(dtype="float16").cutlass_dtype.__name__ == "Float16"
    with pytest.raises(TypeError, match="tiles must be"):
        pf.Config(PrefillProblem(**PREFILL), pd.Tiles())
    with pytest.raises(TypeError, match="PrefillProblem"):
        pf.Config(DecodeProblem(**DECODE), pf.Tiles())
    with pytest.raises(ValueError, match="cannot serve.*arch"):
        _pf_cfg(arch="sm_80")


def test_decode_config_validation_and_derived():
    cfg = _pd_cfg()
    assert (cfg.num_threads, cfg.row_bytes, cfg.smem_q_bytes) == (128, 272, 16 * 272)
    assert cfg.smem_stats_bytes == (4 * 16 * 3 + 16 * 2 + 4) * 4
    assert cfg.smem_kv_bytes == 4 * 3 * 2 * 16 * 272
    assert cfg.smem_bytes == cfg.smem_q_bytes + cfg.smem_stats_bytes + cfg.smem_kv_bytes
    assert cfg.max_splits_per_request == cfg.smem_kv_bytes // 4 // 4
    assert cfg.q_in_registers and not _pd_cfg(head_dim=256).q_in_registers
    assert cfg.arch == "sm_90a"
    # the merge's fp32 O rows of the warps (aliasing the K/V ring) fit in it
    assert cfg.smem_kv_bytes >= 4 * 16 * 128 * 4
    with pytest.raises(ValueError, match="shared memory"):
        _pd_cfg(pd.Tiles(num_warps=8, num_stages=6), head_dim=256)
    with pytest.raises(TypeError, match="tiles must be"):
        pd.Config(DecodeProblem(**DECODE), pf.Tiles())
    with pytest.raises(TypeError, match="DecodeProblem"):
        pd.Config(PrefillProblem(**PREFILL), pd.Tiles())
    with pytest.raises(ValueError, match="cannot serve.*arch"):
        _pd_cfg(arch="hopper")


@pytest.mark.parametrize("field", list(PREFILL_OTHER))
def test_prefill_compile_key_per_problem_field(field):
    base = dict(PREFILL, score_mod=_rel_bias) if field == "score_mod" else dict(PREFILL)  # callable vs callable
    a = pf.Config(PrefillProblem(**base), pf.Tiles())
    b = pf.Config(PrefillProblem(**{**base, field: PREFILL_OTHER[field]}), pf.Tiles())
    assert a != b and config_key(a) != config_key(b)
    assert config_key(a) == config_key(pf.Config(PrefillProblem(**base), pf.Tiles()))


@pytest.mark.parametrize("field", list(DECODE_OTHER))
def test_decode_compile_key_per_problem_field(field):
    a, b = _pd_cfg(), _pd_cfg(**{field: DECODE_OTHER[field]})
    assert a != b and config_key(a) != config_key(b)
    assert config_key(a) == config_key(_pd_cfg())


def test_compile_key_per_tile_field():
    keys = {config_key(_pf_cfg(t)) for t in (pf.Tiles(), pf.Tiles(num_warps=8), pf.Tiles(tile_n=32))}
    assert len(keys) == 3
    keys = {config_key(_pd_cfg(t)) for t in (pd.Tiles(), pd.Tiles(num_warps=8), pd.Tiles(num_stages=2))}
    assert len(keys) == 3


# ----------------------------------------------------------------------------- unsupported_reason / default_tiles
@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_unsupported_reason_serves_every_problem(arch):
    for over in ({}, dict(page_size=16, causal=True), dict(head_dim_qk=192, head_dim_vo=128, group_size=3),
                 dict(head_dim_qk=32, head_dim_vo=32, use_custom_mask=True, use_sinks=True),
                 dict(pos_encoding_mode="ROPE_LLAMA", use_window=True, use_soft_cap=True),
                 dict(score_mod=_rel_bias)):
        assert pf.unsupported_reason(PrefillProblem(**{**PREFILL, **over, "arch": arch})) is None, over
    for over in ({}, dict(head_dim=256, page_size=1, group_size=16, pos_encoding_mode="ALIBI", use_sinks=True)):
        assert pd.unsupported_reason(DecodeProblem(**{**DECODE, **over, "arch": arch})) is None, over


def test_unsupported_reason_refuses():
    for arch in ("sm_80", "hopper", "sm_120a"):
        assert arch in pf.unsupported_reason(PrefillProblem(**PREFILL, arch=arch))
        assert arch in pd.unsupported_reason(DecodeProblem(**DECODE, arch=arch))
    with pytest.raises(TypeError):
        pf.unsupported_reason(DecodeProblem(**DECODE))
    with pytest.raises(TypeError):
        pd.unsupported_reason(PrefillProblem(**PREFILL))


def test_prefill_default_tiles():
    for over in ({}, dict(head_dim_qk=256, head_dim_vo=256), dict(page_size=1, causal=True), dict(arch="sm_100a")):
        assert pf.default_tiles(PrefillProblem(**{**PREFILL, **over}), num_sms=132) == pf.Tiles(4, 64, 2)


@pytest.mark.parametrize("head_dim,split,tiles", [
    (32, False, (4, 3)), (64, False, (4, 3)), (128, False, (4, 3)), (256, False, (4, 2)),
    (32, True, (8, 3)), (128, True, (8, 3)), (256, True, (4, 2)),
])
def test_decode_default_tiles(head_dim, split, tiles):
    problem = DecodeProblem(**{**DECODE, "head_dim": head_dim})
    t = pd.default_tiles(problem, num_sms=132, split=split)
    assert (t.num_warps, t.num_stages) == tiles
    pd.Config(problem, t)  # every default fits shared memory
    assert pd.default_tiles(problem, num_sms=8, split=split) == t  # the SM count does not enter


def test_override_tiles():
    assert pd.override_tiles(pd.Tiles(), {"num_warps": "8"}) == pd.Tiles(8, 3)
    assert pd.override_tiles(pd.Tiles(), {"num_warps": " 2", "num_stages": "4"}) == pd.Tiles(2, 4)
    assert pd.override_tiles(pd.Tiles(4, 2), {}) == pd.Tiles(4, 2)
    assert pf.override_tiles(pf.Tiles(), {"tile_n": "32", "num_warps": "8"}) == pf.Tiles(8, 32, 2)
    assert pd.TUNING_FIELDS == ("num_warps", "num_stages", "min_ctas_per_sm")
    assert pf.TUNING_FIELDS == ("num_warps", "tile_n", "num_stages")
    with pytest.raises(ValueError, match="'tile_n' is not a field"):
        pd.override_tiles(pd.Tiles(), {"tile_n": "64"})
    with pytest.raises(ValueError, match="'num_wg' is not a field"):
        pf.override_tiles(pf.Tiles(), {"num_wg": "2"})
    with pytest.raises(ValueError, match="num_stages takes an integer, got 'three'"):
        pd.override_tiles(pd.Tiles(), {"num_stages": "three"})
    with pytest.raises(ValueError, match="num_warps takes an integer, got '4.0'"):
        pf.override_tiles(pf.Tiles(), {"num_warps": "4.0"})
    with pytest.raises(ValueError, match="num_warps must be 1, 2, 4 or 8"):
        pd.override_tiles(pd.Tiles(), {"num_warps": "16"})
    with pytest.raises(ValueError, match="tile_n must be 32 or 64"):
        pf.override_tiles(pf.Tiles(), {"tile_n": "128"})


# ----------------------------------------------------------------------------- launch
class _Recorder:
    def __call__(self, *args, **kwargs):
        assert not kwargs
        self.args = args


# the kernels' parameter names (PrefillKernel.__call__ / PagedDecodeKernel.__call__) -> the args' field names
_TENSOR_FIELDS = dict(mQ="q", mK="k", mV="v", mIdx="indices", mWork="work", mO="out", mLSE="lse", mMask="mask",
                      mSinks="sinks", mAlibi="alibi_slopes", mPO="part_o", mPLSE="part_lse", mCnt="counters")


def _kernel_order(kernel_cls):
    params = [p for p in inspect.signature(kernel_cls.__call__).parameters if p not in ("self", "stream")]
    return [_TENSOR_FIELDS.get(p, p) for p in params]


@pytest.mark.parametrize("mod,args_cls,cfg", [(pf, PrefillArgs, _pf_cfg), (pd, DecodeArgs, _pd_cfg)])
def test_launch_argument_order(mod, args_cls, cfg):
    sentinels = {name: object() for name in args_cls._fields}
    rec = _Recorder()
    assert mod.launch(rec, cfg(), args_cls(**sentinels)) is None
    order = _kernel_order(pf.PrefillKernel if mod is pf else pd.PagedDecodeKernel)
    assert len(rec.args) == len(order) == len(args_cls._fields)
    assert [a is sentinels[name] for a, name in zip(rec.args, order)] == [True] * len(order), order
    assert order[-1] == "output_scale"


def test_kernel_orders():
    assert _kernel_order(pf.PrefillKernel) == [
        "q", "k", "v", "indices", "work", "out", "lse", "mask", "sinks", "alibi_slopes", "sm_scale", "soft_cap",
        "window_left", "rope_rcp_scale", "rope_log2_theta", "output_scale"]
    assert _kernel_order(pd.PagedDecodeKernel) == [
        "q", "k", "v", "indices", "work", "out", "lse", "part_o", "part_lse", "counters", "sinks", "alibi_slopes",
        "sm_scale", "soft_cap", "rope_rcp_scale", "rope_log2_theta", "output_scale"]


# ----------------------------------------------------------------------------- cross-compiles
@functools.lru_cache(maxsize=None)
def _build(kind: str, arch: str, keep_cubin: bool = False) -> dict[str, str]:
    """PTX text (and the artifact names) of a small config of ``kind`` compiled for ``arch``."""
    if kind == "prefill":
        mod, cfg = pf, pf.Config(PrefillProblem(dtype="bfloat16", head_dim_qk=64, head_dim_vo=64, group_size=2,
                                                causal=True, arch=arch), pf.Tiles())
    else:
        mod, cfg = pd, pd.Config(DecodeProblem(dtype="float16", head_dim=64, page_size=16, group_size=2, arch=arch),
                                 pd.Tiles())
    with tempfile.TemporaryDirectory() as d:
        mod.compile(cfg, keep_ptx_dir=d, keep_cubin=keep_cubin)
        (ptx,) = glob.glob(os.path.join(d, "*.ptx"))
        return dict(ptx=open(ptx).read(), files=" ".join(sorted(os.listdir(d))))


def _entry_params(text: str) -> tuple[str, list[str]]:
    m = re.search(r"\.entry\s+(\S+)\(\s*(.*?)\)", text, re.S)
    return m.group(1), re.findall(r"\.param\s+(\.\w+)", m.group(2))


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_cross_compile(kind, arch):
    text = _build(kind, arch)["ptx"]
    ab = "bf16" if kind == "prefill" else "f16"
    assert re.search(rf"^\.target\s+{arch}\s*$", text, re.M)
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32" in text
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in text
    assert re.search(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+\], 16", text)
    assert not re.search(r"\b(wgmma|tcgen05|cp\.async\.bulk)\b", text)
    entry, params = _entry_params(text)
    # tensors are struct params (.align), scalars .f32 / .b32; output_scale is the last, an f32 the kernel reads
    n_tensors, n_scalars = (10, 6) if kind == "prefill" else (12, 5)
    assert len(params) == n_tensors + n_scalars, params
    assert params[-1] == ".f32"
    last = len(params) - 1
    assert re.search(rf"ld\.param\.\w+\s+%\w+, \[{re.escape(entry)}_param_{last}\]", text), "output_scale unread"


def test_compile_keeps_cubin():
    assert ".cubin" in _build("decode", "sm_90a", True)["files"]
    assert ".cubin" in _build("prefill", "sm_100a", True)["files"]
    assert ".cubin" not in _build("decode", "sm_90a")["files"]
    for mod, cfg in ((pf, _pf_cfg()), (pd, _pd_cfg())):
        with pytest.raises(ValueError, match="keep_cubin"):
            mod.compile(cfg, keep_cubin=True)


def test_decode_fake_tensors():
    t = decode_tensors(_pd_cfg(page_size=64), WORK_COLS)
    assert len(t) == 12
    assert t[1].shape[1] == 64 and t[1].shape[3] == 128  # k [pages, page_size, Hkv, head_dim]: static dims


# ----------------------------------------------------------------------------- GPU: owned data only, output scale
# Each kernel is launched through its own compile() / launch() on a hand-built work table, so these check the
# kernel contract itself: K/V rows past a request (spare buffer rows, unused page slots, unused pages) hold NaN
# and must not reach any output; output_scale multiplies O in fp32 before the rounding, the LSE does not move.
def _cuda():
    import torch

    return torch.cuda.is_available()


_needs_gpu = [pytest.mark.gpu, pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")]


def _gpu_test(fn):
    for m in reversed(_needs_gpu):
        fn = m(fn)
    return fn


@_gpu_test
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_prefill_spare_rows_and_output_scale(causal):
    import math

    import torch

    from _checks import TOL, rel_err
    from cutedsl_attn import ref
    from cutedsl_attn.compile import target_arch
    from cutedsl_attn.planning.prefill import plan_prefill

    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator().manual_seed(18)
    hq, hkv, d, spare = 32, 8, 128, 64
    qo_lens, kv_lens = [250, 40, 250], [300, 40, 250]  # the ragged case that turned NaN on the SM90 kernel
    qo_indptr = torch.tensor([0, 250, 290, 540], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 300, 340, 590], dtype=torch.int32)
    q = torch.randn(540, hq, d, generator=gen).to(dt).to(dev)
    k = torch.randn(590 + spare, hkv, d, generator=gen).to(dt).to(dev)
    v = torch.randn(590 + spare, hkv, d, generator=gen).to(dt).to(dev)
    k[590:], v[590:] = float("nan"), float("nan")  # a preallocated buffer's uninitialised tail
    problem = PrefillProblem("bfloat16", d, d, hq // hkv, causal=causal, arch=target_arch())
    cfg = pf.Config(problem, pf.default_tiles(problem, num_sms=132))
    fn = pf.compile(cfg)
    work, _ = plan_prefill(qo_lens, kv_lens, qo_indptr[:-1], kv_indptr[:-1], group_size=hq // hkv,
                           tile_m=cfg.tile_m, causal=causal)
    work = work.to(dev)
    sm_scale = 1.0 / math.sqrt(d)
    i32, u8, f32 = (torch.zeros(1, dtype=t, device=dev) for t in (torch.int32, torch.uint8, torch.float32))

    def run(kb, vb, scale):
        out = torch.full((540, hq, d), float("nan"), dtype=dt, device=dev)
        lse = torch.full((540, hq), float("nan"), dtype=torch.float32, device=dev)
        pf.launch(fn, cfg, PrefillArgs(q, kb, vb, i32, work, out, lse, u8, f32, f32, sm_scale, 0.0, -1, 1.0,
                                       math.log2(1e4), scale))
        torch.cuda.synchronize()
        return out, lse

    o1, l1 = run(k, v, 1.0)
    assert torch.isfinite(o1).all() and torch.isfinite(l1).all()
    o0, l0 = run(torch.nan_to_num(k, nan=0.0), torch.nan_to_num(v, nan=0.0), 1.0)
    assert torch.equal(o1, o0) and torch.equal(l1, l0), "spare K/V rows reached the output"
    o_ref, lse_ref = ref.ragged_prefill(q.cpu(), k[:590].cpu(), v[:590].cpu(), qo_indptr, kv_indptr,
                                        causal=causal, sm_scale=sm_scale)
    assert rel_err(o1, o_ref) <= TOL[dt]
    s = 0.37
    o_s, l_s = run(k, v, s)
    assert torch.equal(l_s, l1), "the output scale must not enter the LSE"
    assert rel_err(o_s, o_ref * s) <= TOL[dt]
    # a power of two scales every fp32 product exactly, so the one rounding after it equals the scaled output
    o_q, _ = run(k, v, 0.25)
    assert torch.equal(o_q, o1 * 0.25)


@_gpu_test
@pytest.mark.parametrize("split", [False, True])
def test_gpu_decode_unused_page_slots_and_output_scale(split):
    import math

    import torch

    from _checks import TOL, rel_err
    from cutedsl_attn import ref
    from cutedsl_attn.compile import target_arch
    from cutedsl_attn.planning.decode import plan_paged_decode

    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator().manual_seed(18)
    hq, hkv, d, ps = 32, 8, 128, 16
    kv_lens = [700, 33, 1, 250]
    npages = [-(-L // ps) for L in kv_lens]
    total = sum(npages) + 5  # 5 pages no request owns
    perm = torch.randperm(total, generator=gen)
    indptr = torch.tensor([0] + torch.tensor(npages).cumsum(0).tolist(), dtype=torch.int32)
    indices = perm[: sum(npages)].to(torch.int32)
    last = torch.tensor([L - (n - 1) * ps for L, n in zip(kv_lens, npages)], dtype=torch.int32)
    k = torch.randn(total, ps, hkv, d, generator=gen).to(dt)
    v = torch.randn(total, ps, hkv, d, generator=gen).to(dt)
    owned = torch.zeros(total, ps, dtype=torch.bool)
    for b, L in enumerate(kv_lens):
        for t in range(L):
            owned[indices[indptr[b] + t // ps], t % ps] = True
    k[~owned], v[~owned] = float("nan"), float("nan")  # unused slots of last pages and unused pages
    q = torch.randn(len(kv_lens), hq, d, generator=gen).to(dt)
    problem = DecodeProblem("bfloat16", d, ps, hq // hkv, arch=target_arch())
    cfg = pd.Config(problem, pd.default_tiles(problem, num_sms=132, split=split))
    fn = pd.compile(cfg)
    kv_t = torch.tensor(kv_lens, dtype=torch.int64)
    plan = plan_paged_decode(kv_t, indptr[:-1].long(), num_kv_heads=hkv, page_size=ps,
                             fixed_split_tokens=64 if split else None, disable_split_kv=not split,
                             max_splits_per_request=cfg.max_splits_per_request)
    assert (plan.num_partials > 0) == split
    B, sm_scale, s = len(kv_lens), 1.0 / math.sqrt(d), 0.37
    qd, kd, vd, idx, work = (x.to(dev) for x in (q, k, v, indices, plan.work))
    part_o = torch.empty(max(plan.num_partials, 1), hq, d, dtype=torch.float32, device=dev)
    part_lse = torch.empty(max(plan.num_partials, 1), hq, dtype=torch.float32, device=dev)
    counters = torch.zeros(B * hkv, dtype=torch.int32, device=dev)
    f32 = torch.zeros(1, dtype=torch.float32, device=dev)

    def run(scale):
        out = torch.full((B, hq, d), float("nan"), dtype=dt, device=dev)
        lse = torch.full((B, hq), float("nan"), dtype=torch.float32, device=dev)
        pd.launch(fn, cfg, DecodeArgs(qd, kd, vd, idx, work, out, lse, part_o, part_lse, counters, f32, f32,
                                      sm_scale, 0.0, 1.0, math.log2(1e4), scale))
        torch.cuda.synchronize()
        return out, lse

    o1, l1 = run(1.0)
    assert torch.isfinite(o1).all() and torch.isfinite(l1).all(), "unused page slots reached the output"
    assert (counters == 0).all()
    o_ref, _ = ref.paged_decode(q, torch.nan_to_num(k, nan=0.0), torch.nan_to_num(v, nan=0.0), indptr, indices,
                                last, sm_scale=sm_scale)
    assert rel_err(o1, o_ref) <= TOL[dt]
    o_s, l_s = run(s)
    assert torch.equal(l_s, l1), "the output scale must not enter the LSE"
    assert rel_err(o_s, o_ref * s) <= TOL[dt]
    o_q, _ = run(0.25)  # exact in fp32: the scaled write equals the scaled output (split partials unscaled)
    assert torch.equal(o_q, o1 * 0.25)
