"""GPU tests of the per-channel prep kernel (:mod:`cutedsl_attn.common.kda_prep`) alone: its scratch (``W``, ``U``,
``Aqk``, ``Qg``, ``Kd``, ``F``), NaN-poisoned before the launch, against a float64 evaluation of the prep's formulas
(the module docstring's), for both shared-memory layouts, the portable and the SM90 module (the same prep kernel),
KDA and GDN-2, gates that keep the factored diagonal blocks and gates that take the direct ones.

Fresh random inputs every run.
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from cutedsl_attn.compile import get_compiled, target_arch  # noqa: E402
from cutedsl_attn.planning.gdn import CHUNK, FLAG_HAS_BETA, FLAG_HAS_G, GdnArgs, GdnProblem  # noqa: E402
from cutedsl_attn.portable import kda_chunked as chk  # noqa: E402
from cutedsl_attn.ref import kda_chunked as rk  # noqa: E402

from test_kda_chunked_gpu import NAN, cu_of, inputs  # noqa: E402

DEV = torch.device("cuda")
TOL = 1e-2  # 16-bit operands and T rounded to the io dtype, ex2.approx
TOL_F = 1e-3  # fp32 factors: ex2.approx of the fp32 cumulative decay (summed in fp32)


def _rel(x, y):
    x, y = x.double(), y.double()
    assert torch.isfinite(x).all(), "non-finite values (a NaN-poisoned element was not written)"
    return ((x - y).norm() / max(y.norm().item(), 1e-30)).item()


def _launch_prep(mod, d, tiles, l2norm):
    """Compile and launch ``mod``'s kernel (prep + main) on ``d``; returns (chunks, Qg, Kd, W, U, Aqk, F, args)."""
    q, k, v = d["q"], d["k"], d["v"]
    T, hq, K = q.shape
    hk, hv, V = k.shape[1], v.shape[1], v.shape[2]
    ho = max(hq, hv)
    gdn2 = "b" in d
    p = GdnProblem(dtype="bfloat16" if q.dtype == torch.bfloat16 else "float16", head_dim_k=K, head_dim_v=V,
                   gate_domain="log", use_qk_l2norm=l2norm, gate_per_channel=True, erase_write_gates=gdn2,
                   arch=target_arch(DEV))
    cfg = mod.Config(p, tiles)
    fn = get_compiled(mod.NAME, cfg, mod.compile)
    beta = torch.cat([d["b"], d["w"]], -1).contiguous() if gdn2 else d["beta"].contiguous()
    dummy_s = torch.empty(1, ho, V, K, device=DEV)
    i32 = torch.empty(1, device=DEV, dtype=torch.int32)
    out = torch.empty(T, ho, V, device=DEV, dtype=q.dtype)
    args = GdnArgs(q, k, v, d["g"].contiguous(), beta, d["cu"], dummy_s, i32, dummy_s, i32, out,
                   1.0 / math.sqrt(K), ho // hq, ho // hk, ho // hv, FLAG_HAS_G | FLAG_HAS_BETA)
    chunks, chunk_off, qg, kd, w, u, aqk, f = mod.launch_tensors(args, cfg)
    for x in (qg, kd, w, u, aqk, f):
        x.fill_(NAN)
    fn(args.q, args.k, args.v, args.g, args.beta, args.cu_seqlens, chunks, chunk_off, args.initial_state,
       args.initial_state_indices, args.output_state, args.output_state_indices, args.output, qg, kd, w, u, aqk,
       f, args.scale, args.q_group, args.k_group, args.v_group, args.flags)
    torch.cuda.synchronize()
    return chunks, qg, kd, w, u, aqk, f, args


def _prep_ref(d, args, tok0, ln, l2norm):
    """Float64 scratch of one chunk, every output head: (Qg, Kd) ``[ln, HO, K]``, W, U, Aqk ``[HO, C, *]``, F."""
    C = CHUNK
    ho = args.output.shape[1]
    heads = torch.arange(ho, device=DEV)

    def rows(x, group):  # [C, HO, D] float64, zero past ln
        y = torch.zeros(C, ho, x.shape[2], device=DEV, dtype=torch.float64)
        y[:ln] = x[tok0:tok0 + ln][:, heads // group].double()
        return y

    q, k, v = rows(d["q"], args.q_group), rows(d["k"], args.k_group), rows(d["v"], args.v_group)
    if l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    lg = torch.zeros(C, ho, q.shape[2], device=DEV, dtype=torch.float64)
    lg[:ln] = torch.clamp(d["g"][tok0:tok0 + ln].double() * rk.LOG2E, min=rk.GATE_FLOOR_LOG2)
    G = lg.cumsum(0)  # [C, HO, K]
    if "b" in d:
        e, x = k * rows(d["b"], 1), v * rows(d["w"], 1)
    else:
        bt = torch.zeros(C, ho, device=DEV, dtype=torch.float64)
        bt[:ln] = d["beta"][tok0:tok0 + ln].double()
        e, x = k * bt[..., None], v * bt[..., None]
    q, k, e, x, G = (t.transpose(0, 1) for t in (q, k, e, x, G))  # [HO, C, D]
    fac = torch.exp2(torch.clamp(G[:, :, None, :] - G[:, None, :, :], max=0.0))  # [HO, r, s, K]
    A = torch.tril((e[:, :, None, :] * k[:, None, :, :] * fac).sum(-1), -1)
    Tm = torch.linalg.inv(torch.eye(C, device=DEV, dtype=torch.float64) + A)
    aqk = args.scale * torch.tril((q[:, :, None, :] * k[:, None, :, :] * fac).sum(-1))
    w = Tm @ (e * torch.exp2(G))
    u = Tm @ x
    qg = (q * torch.exp2(G)).transpose(0, 1)[:ln]
    kd = (k * torch.exp2(G[:, -1:] - G)).transpose(0, 1)[:ln]
    ok = (torch.arange(C, device=DEV) < ln).double()
    f = torch.cat([(args.scale * ok).expand(ho, C), ok.expand(ho, C), torch.exp2(G[:, -1])], -1)
    return qg, kd, w, u, aqk, f


def _check(mod, tiles, *, gate, gdn2=False, dtype=torch.bfloat16, l2norm=True):
    lens = [0, 1, 15, 16, 17, 63, 64, 65, 200]
    d = inputs(lens, 2, 2, 4, gate=gate, gdn2=gdn2, dtype=dtype)
    chunks, qg, kd, w, u, aqk, f, args = _launch_prep(mod, d, tiles, l2norm)
    got = {n: [] for n in ("qg", "kd", "w", "u", "aqk", "f")}
    want = {n: [] for n in got}
    for c, (_, tok0, ln, _) in enumerate(chunks.tolist()):
        if ln == 0:  # the plan's spare rows: their CTAs exit
            continue
        ref = _prep_ref(d, args, tok0, ln, l2norm)
        for n, g_, r_ in zip(("qg", "kd"), (qg, kd), ref[:2]):
            got[n].append(g_[tok0:tok0 + ln])
            want[n].append(r_)
        for n, g_, r_ in zip(("w", "u", "aqk", "f"), (w, u, aqk, f), ref[2:]):
            got[n].append(g_[c])
            want[n].append(r_)
    for n in got:
        err = _rel(torch.cat(got[n]), torch.cat(want[n]))
        assert err < (TOL_F if n == "f" else TOL), (n, err)


@pytest.mark.parametrize("prep_ctas", [2, 3])
@pytest.mark.parametrize("gate", ["safe", "strong", "inf"])
def test_portable_prep_scratch_vs_float64(prep_ctas, gate):
    _check(chk, chk.Tiles(64, 4, prep_ctas=prep_ctas), gate=gate)


def test_portable_prep_scratch_vs_float64_gdn2():
    _check(chk, chk.Tiles(64, 4), gate="safe", gdn2=True)


def test_portable_prep_scratch_vs_float64_fp16_strong():
    _check(chk, chk.Tiles(64, 4, prep_ctas=3), gate="strong", dtype=torch.float16)


@pytest.mark.skipif(torch.cuda.get_device_capability() != (9, 0), reason="the SM90 kernel needs an SM90 GPU")
@pytest.mark.parametrize("prep_ctas", [2, 3])
def test_sm90_prep_scratch_vs_float64(prep_ctas):
    from cutedsl_attn.sm90 import kda_chunked as kda90

    _check(kda90, kda90.Tiles(prep_ctas=prep_ctas), gate="safe")
