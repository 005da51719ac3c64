"""GPU tests of the paged decode kernel on fp8 e4m3 K/V caches against the float64 oracle on the
dequantised cache (run on an H200).

The kernel is called through ``dispatch.decode_schedule`` / ``KernelChoice.launch`` with a ``DecodeArgs`` built
here (``sm_scale * q_scale * k_scale`` and ``output_scale = v_scale``, as the decode wrapper folds them).
Outputs are NaN-poisoned before each launch; spare pages and the unused slots of every last page hold NaN.
"""

import dataclasses
import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from cutedsl_attn import dispatch, ref
from cutedsl_attn.planning.decode import DecodeArgs, kv_lens_from_csr
from cutedsl_attn.ref.paged import dequantize_kv_cache
from _checks import TOL, rel_err  # noqa: E402

DEV = torch.device("cuda")
FP8 = torch.float8_e4m3fn
#: fp8 noise: the kernel on the quantised cache against the oracle on the unquantised one (e4m3 keeps 3
#: mantissa bits: about 2.7% rms relative error per element, averaged down by the softmax and P V sums)
FP8_NOISE_TOL = 6e-2


def make_case(kv_lens, page_size, hkv, hq, d, dtype, layout, gen, *, spare_pages=5, amp=2.0):
    """Random fp8 paged K/V (pages scattered; NaN in spare pages and unused slots), the float32 values before
    quantisation, q and the CSR table."""
    npages = [-(-L // page_size) for L in kv_lens]
    total = sum(npages) + spare_pages
    perm = torch.randperm(total, generator=gen)
    indices = perm[: sum(npages)].to(torch.int32)
    indptr = torch.tensor([0] + torch.tensor(npages, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([L - (n - 1) * page_size if n else 0 for L, n in zip(kv_lens, npages)], dtype=torch.int32)
    caches = []
    for _ in range(2):
        x = torch.randn(total, page_size, hkv, d, generator=gen) * amp  # NHD while poisoning
        x[perm[sum(npages):]] = float("nan")
        for b, n in enumerate(npages):
            if n:
                x[int(indices[indptr[b + 1] - 1]), int(last[b]):] = float("nan")
        x = x if layout == "NHD" else x.transpose(1, 2).contiguous()
        caches.append(x)
    k32, v32 = caches
    q = torch.randn((len(kv_lens), hq, d), generator=gen).to(dtype)
    return q, k32, v32, indptr, indices, last


def run_fp8(q, k8, v8, indptr, indices, last, *, layout, k_scale, v_scale, page_size, sm_scale=None,
            soft_cap=0.0, sinks=None, pos_encoding_mode="NONE", fixed_split_tokens=None, disable_split_kv=False):
    """One fp8 decode launch through dispatch; returns (out, lse, work plan)."""
    B, hq, d = q.shape
    hkv = k8.shape[2] if layout == "NHD" else k8.shape[1]
    problem = dataclasses.replace(
        dispatch.decode_problem(dtype=q.dtype, head_dim=d, page_size=page_size, group_size=hq // hkv,
                                pos_encoding_mode=pos_encoding_mode, use_soft_cap=soft_cap > 0,
                                use_sinks=sinks is not None),
        kv_dtype="float8_e4m3fn")
    kv_lens = kv_lens_from_csr(indptr, last, page_size)
    choice, wp = dispatch.decode_schedule(problem, kv_lens, indptr[:-1], num_kv_heads=hkv,
                                          fixed_split_tokens=fixed_split_tokens, disable_split_kv=disable_split_kv)
    k, v = (k8, v8) if layout == "NHD" else (k8.transpose(1, 2), v8.transpose(1, 2))  # [pages, ps, Hkv, D] views
    n_part = max(1, wp.num_partials)
    out = torch.full((B, hq, d), float("nan"), dtype=q.dtype, device=DEV)
    lse = torch.full((B, hq), float("nan"), dtype=torch.float32, device=DEV)
    part_o = torch.full((n_part, hq, d), float("nan"), dtype=torch.float32, device=DEV)
    part_lse = torch.full((n_part, hq), float("nan"), dtype=torch.float32, device=DEV)
    counters = torch.zeros(max(1, B * hkv), dtype=torch.int32, device=DEV)
    dummy = torch.zeros(1, dtype=torch.float32, device=DEV)
    slopes = ref.alibi_slopes(hq).to(torch.float32).to(DEV) if pos_encoding_mode == "ALIBI" else dummy
    scale = (1.0 / math.sqrt(d) if sm_scale is None else sm_scale) * k_scale
    args = DecodeArgs(q, k, v, indices.to(DEV), wp.work.to(DEV), out, lse, part_o, part_lse, counters,
                      dummy if sinks is None else sinks.to(DEV), slopes, scale, soft_cap, 1.0, math.log2(1e4),
                      v_scale)
    choice.launch(args)
    torch.cuda.synchronize()
    assert int(counters.abs().sum()) == 0, "split-KV counters must be left at 0"
    return out.cpu(), lse.cpu(), wp


def oracle(q, k, v, indptr, indices, last, *, layout, k_scale, v_scale, **kw):
    """float64 decode on ``k``, ``v`` dequantised with their scales (fp8 or float32 caches)."""
    return ref.paged_decode(q.cpu(), dequantize_kv_cache(k.cpu(), k_scale), dequantize_kv_cache(v.cpu(), v_scale),
                            indptr, indices, last, kv_layout=layout, **kw)


def check(out, lse, o_ref, lse_ref, dtype, what, tol=None):
    assert not torch.isnan(out).any(), f"{what}: NaN / unwritten output"
    assert not torch.isnan(lse).any(), f"{what}: NaN / unwritten LSE"
    e = rel_err(out, o_ref)
    assert e <= (TOL[dtype] if tol is None else tol), f"{what}: output rel err {e}"
    fin = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse.double()), fin), f"{what}: LSE -inf pattern differs"
    if fin.any():
        dl = (lse.double()[fin] - lse_ref[fin]).abs().max().item()
        assert dl < 2e-2, f"{what}: LSE abs err {dl}"
    if (~fin).any():
        assert (out[~fin] == 0).all(), f"{what}: rows with no visible key must be 0"
    return e


CASES = [
    # (kv_lens, page_size, hkv, group, d, dtype, layout, split)
    ([1, 17, 300, 64], 1, 2, 4, 128, torch.bfloat16, "NHD", False),
    ([5, 1000, 33], 1, 1, 8, 64, torch.float16, "HND", True),
    ([16, 31, 777, 1], 16, 2, 1, 128, torch.bfloat16, "HND", False),
    ([4096], 16, 8, 4, 128, torch.bfloat16, "NHD", True),
    ([129, 0, 2000, 15], 16, 4, 8, 256, torch.float16, "NHD", True),
    ([63, 64, 65, 1500], 64, 2, 4, 64, torch.bfloat16, "NHD", False),
    ([3000, 7], 64, 1, 1, 256, torch.bfloat16, "HND", True),
    ([200, 1], 64, 2, 8, 128, torch.float16, "NHD", True),
    ([513] * 8, 16, 2, 4, 64, torch.float16, "HND", False),
    ([9, 300], 16, 2, 8, 256, torch.bfloat16, "NHD", False),
    ([300, 1029], 16, 1, 16, 128, torch.bfloat16, "NHD", True),  # group 16, the largest GQA group served
    ([77, 500], 24, 2, 4, 64, torch.float16, "HND", True),  # page 24: the per-row gather
]


@pytest.mark.parametrize("kv_lens,page_size,hkv,group,d,dtype,layout,split", CASES)
def test_fp8_decode_sweep(kv_lens, page_size, hkv, group, d, dtype, layout, split):
    gen = torch.Generator().manual_seed(torch.seed() % (2**31))
    hq = hkv * group
    q, k32, v32, indptr, indices, last = make_case(kv_lens, page_size, hkv, hq, d, dtype, layout, gen)
    k8, v8 = k32.to(FP8).to(DEV), v32.to(FP8).to(DEV)
    k_scale, v_scale = 0.37, 1.7  # != 1: both reach the kernel folded into its scalars
    kw = dict(fixed_split_tokens=64) if split else dict(disable_split_kv=True)
    out, lse, wp = run_fp8(q.to(DEV), k8, v8, indptr, indices, last, layout=layout, k_scale=k_scale,
                           v_scale=v_scale, page_size=page_size, **kw)
    assert (wp.num_partials > 0) == (split and max(kv_lens) > 64)
    o_ref, lse_ref = oracle(q, k8, v8, indptr, indices, last, layout=layout, k_scale=k_scale, v_scale=v_scale)
    check(out, lse, o_ref, lse_ref, dtype, "fp8 cache vs dequantised oracle")
    # quantisation noise only: the oracle on the float32 values the cache was quantised from
    o_hi, _ = oracle(q, k32, v32, indptr, indices, last, layout=layout, k_scale=k_scale, v_scale=v_scale)
    check(out, lse, o_hi, lse_ref, dtype, "fp8 cache vs unquantised oracle", tol=FP8_NOISE_TOL)


@pytest.mark.parametrize("feature", ["soft_cap_sinks", "alibi", "sm_scale"])
def test_fp8_decode_features(feature):
    gen = torch.Generator().manual_seed(7)
    kv_lens, ps, hkv, group, d, dtype, layout = [1, 90, 1200], 16, 2, 4, 128, torch.bfloat16, "NHD"
    hq = hkv * group
    q, k32, v32, indptr, indices, last = make_case(kv_lens, ps, hkv, hq, d, dtype, layout, gen)
    k8, v8 = k32.to(FP8).to(DEV), v32.to(FP8).to(DEV)
    run_kw, ref_kw = {}, {}
    if feature == "soft_cap_sinks":
        sinks = torch.randn(hq, generator=gen).float()
        run_kw, ref_kw = dict(soft_cap=5.0, sinks=sinks), dict(logits_soft_cap=5.0, sinks=sinks)
    elif feature == "alibi":
        run_kw = ref_kw = dict(pos_encoding_mode="ALIBI")
    else:
        run_kw = ref_kw = dict(sm_scale=0.05)
    for split in (dict(disable_split_kv=True), dict(fixed_split_tokens=128)):
        out, lse, _ = run_fp8(q.to(DEV), k8, v8, indptr, indices, last, layout=layout, k_scale=1.3, v_scale=0.6,
                              page_size=ps, **run_kw, **split)
        o_ref, lse_ref = oracle(q, k8, v8, indptr, indices, last, layout=layout, k_scale=1.3, v_scale=0.6,
                                **({"sm_scale": 1 / math.sqrt(d)} | ref_kw))
        check(out, lse, o_ref, lse_ref, dtype, f"{feature} {split}")


def test_fp8_matches_16bit_kernel_on_exact_values():
    """e4m3 values are exact in bf16: the fp8 kernel and the bf16 kernel on the widened cache agree to
    the rounding of P (f16 against bf16) and of O."""
    gen = torch.Generator().manual_seed(3)
    kv_lens, ps, hkv, group, d = [700, 33], 16, 2, 8, 128
    hq = hkv * group
    q, k32, v32, indptr, indices, last = make_case(kv_lens, ps, hkv, hq, d, torch.bfloat16, "NHD", gen)
    k8, v8 = k32.to(FP8).to(DEV), v32.to(FP8).to(DEV)
    out8, lse8, _ = run_fp8(q.to(DEV), k8, v8, indptr, indices, last, layout="NHD", k_scale=1.0, v_scale=1.0,
                            page_size=ps, disable_split_kv=True)
    problem = dispatch.decode_problem(dtype=torch.bfloat16, head_dim=d, page_size=ps, group_size=group)
    choice, wp = dispatch.decode_schedule(problem, kv_lens_from_csr(indptr, last, ps), indptr[:-1],
                                          num_kv_heads=hkv, disable_split_kv=True)
    out = torch.full((2, hq, d), float("nan"), dtype=torch.bfloat16, device=DEV)
    lse = torch.full((2, hq), float("nan"), dtype=torch.float32, device=DEV)
    dummy = torch.zeros(1, dtype=torch.float32, device=DEV)
    scratch = torch.zeros(1, hq, d, dtype=torch.float32, device=DEV)
    choice.launch(DecodeArgs(q.to(DEV), k8.to(torch.bfloat16), v8.to(torch.bfloat16), indices.to(DEV),
                             wp.work.to(DEV), out, lse, scratch, scratch[:, :, 0].contiguous(),
                             torch.zeros(2 * hkv, dtype=torch.int32, device=DEV), dummy, dummy,
                             1 / math.sqrt(d), 0.0, 1.0, math.log2(1e4), 1.0))
    torch.cuda.synchronize()
    assert rel_err(out8, out.cpu()) < 6e-3
    assert (lse8 - lse.cpu()).abs().max().item() < 1e-2


def test_fp8_cuda_graph_replay():
    """A captured fp8 launch replays with new cache contents (the split-KV counters are reset in-kernel)."""
    gen = torch.Generator().manual_seed(11)
    kv_lens, ps, hkv, group, d = [2048, 100], 16, 2, 4, 128
    hq = hkv * group
    q, k32, v32, indptr, indices, last = make_case(kv_lens, ps, hkv, hq, d, torch.bfloat16, "NHD", gen)
    k8, v8 = k32.to(FP8).to(DEV), v32.to(FP8).to(DEV)
    problem = dataclasses.replace(dispatch.decode_problem(dtype=torch.bfloat16, head_dim=d, page_size=ps,
                                                          group_size=group), kv_dtype="float8_e4m3fn")
    choice, wp = dispatch.decode_schedule(problem, kv_lens_from_csr(indptr, last, ps), indptr[:-1],
                                          num_kv_heads=hkv, fixed_split_tokens=256)
    qd = q.to(DEV)
    out = torch.empty((2, hq, d), dtype=torch.bfloat16, device=DEV)
    lse = torch.empty((2, hq), dtype=torch.float32, device=DEV)
    part_o = torch.empty((wp.num_partials, hq, d), dtype=torch.float32, device=DEV)
    part_lse = torch.empty((wp.num_partials, hq), dtype=torch.float32, device=DEV)
    counters = torch.zeros(2 * hkv, dtype=torch.int32, device=DEV)
    dummy = torch.zeros(1, dtype=torch.float32, device=DEV)
    args = DecodeArgs(qd, k8, v8, indices.to(DEV), wp.work.to(DEV), out, lse, part_o, part_lse, counters, dummy,
                      dummy, 0.5 / math.sqrt(d), 0.0, 1.0, math.log2(1e4), 2.0)
    choice.launch(args)  # compiled and warm before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        choice.launch(args)
    for it in range(2):
        k8.copy_((torch.randn(k8.shape, generator=gen) * 2).to(FP8).to(DEV))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        o_ref, lse_ref = oracle(q, k8, v8, indptr, indices, last, layout="NHD", k_scale=0.5, v_scale=2.0,
                                sm_scale=1 / math.sqrt(d))
        check(out.cpu(), lse.cpu(), o_ref, lse_ref, torch.bfloat16, f"replay {it}")
