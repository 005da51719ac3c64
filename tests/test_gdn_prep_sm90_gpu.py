"""GPU tests of the SM90 GDN prep kernel (``cutedsl_attn.sm90.gdn_prep``): its scratch (W, U, Aqk, F) against the
shared prep kernel's (``common.gdn_prep``, through the SM90 chunked module's prep-only entry) and against the prep
formulas in float64.  Needs an SM90 GPU (H100 / H200).

Fresh random inputs every run, both scratches poisoned with NaN before the launches, relative Frobenius errors
over the plan's real chunks (every row of those must be written).
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the SM90 prep kernel needs an SM90 GPU", allow_module_level=True)

from cutedsl_attn.api import gdn as api  # noqa: E402
from cutedsl_attn.planning import gdn as pg  # noqa: E402
from cutedsl_attn.sm90 import gdn_chunked as chk90  # noqa: E402
from cutedsl_attn.sm90 import gdn_prep as p90  # noqa: E402

DEV = torch.device("cuda")
C = pg.CHUNK
TOL_16 = 1e-2  # 16-bit outputs: io rounding of the operands and results
TOL_F = 1e-4  # fp32 row factors against float64 (approximate ex2 / lg2 / rsqrt, the fp32 cumsum)
LENS = [1, 63, 64, 65, 4097]
_FNS: dict = {}


def rel(x, y):
    x, y = x.double(), y.double()
    assert torch.isfinite(x).all(), "non-finite values (a NaN-poisoned element was not written)"
    return ((x - y).norm() / max(y.norm().item(), 1e-30)).item()


def plan(lens, heads, dims, dtype, l2norm, gates, init=False):
    """``(problem, args, kw)`` of the public call's planning (its checks, dummies and flags; with ``init`` an
    initial state and the final state requested), not launched; ``kw`` the public call's arguments."""
    hq, hk, hv = heads
    K, V = dims
    T, ho = sum(lens), max(hq, hv)
    q = torch.randn(T, hq, K, device=DEV).to(dtype)
    k = torch.randn(T, hk, K, device=DEV)
    if not l2norm:
        k = k / k.norm(dim=-1, keepdim=True)
    k = k.to(dtype)
    v = torch.randn(T, hv, V, device=DEV).to(dtype)
    g = beta = None
    domain = "linear"
    if gates != "none":
        alpha = torch.rand(T, ho, device=DEV) * 0.5 + 0.5
        g = alpha if gates == "linear" else alpha.log()
        domain = gates
        beta = torch.rand(T, ho, device=DEV)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    h0 = torch.randn(len(lens), ho, V, K, device=DEV) * 0.1 if init else None
    problem, args, _ = api._plan_prefill(q, k, v, g, beta, None, h0, init, cu, l2norm, None, None, None, None, 0,
                                         False, None, None, "auto", None, domain)
    kw = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm,
              gate_domain=domain)
    return problem, args, kw


def scratch(args, problem):
    s = pg.chunked_launch_tensors(args, problem.head_dim_k, problem.head_dim_v)
    for x in s[2:]:
        x.fill_(float("nan"))
    return s


def run_old(problem, args):
    cfg = chk90.Config(problem, chk90.default_tiles(problem, num_sms=132))  # the prep ignores the tiles
    key = ("old", problem)
    if key not in _FNS:
        _FNS[key] = chk90.compile_prep(cfg)
    s = scratch(args, problem)
    chk90.launch_prep(_FNS[key], cfg, args, s)
    return s


def run_new(problem, args):
    key = ("new", problem)
    if key not in _FNS:
        _FNS[key] = p90.compile(problem)
    s = scratch(args, problem)
    p90.launch(_FNS[key], args, s)
    return s


def prep64(problem, args, chunks):
    """The prep formulas in float64 (the module docstring of ``common.gdn_prep``) for every chunk of the plan:
    ``(W, U, Aqk, F)`` shaped as the scratch."""
    f64 = torch.float64
    seq_tok0, ln = chunks[:, 1].long(), chunks[:, 2].long()
    ar = torch.arange(C, device=DEV)
    ok = ar[None, :] < ln[:, None]  # [nc, C]
    tok = torch.where(ok, seq_tok0[:, None] + ar[None, :], 0)
    ho = args.output.shape[1]
    heads = torch.arange(ho, device=DEV)

    def rows(x, group):  # [T, H, D] -> [nc, HO, C, D], zero past each chunk's end
        r = x.to(f64)[tok][:, :, heads // group].permute(0, 2, 1, 3)
        return r * ok[:, None, :, None]

    q, k, v = rows(args.q, args.q_group), rows(args.k, args.k_group), rows(args.v, args.v_group)
    if problem.use_qk_l2norm:
        rq = torch.rsqrt((q * q).sum(-1) + 1e-6)
        rk = torch.rsqrt((k * k).sum(-1) + 1e-6)
        q, k = q * rq[..., None], k * rk[..., None]
    else:
        rq = rk = torch.ones(q.shape[:3], device=DEV, dtype=f64)
    okh = ok[:, None, :].expand(-1, ho, -1)
    lg = torch.zeros(okh.shape, device=DEV, dtype=f64)
    b = okh.to(f64)
    if args.flags & pg.FLAG_HAS_G:
        x = args.g.to(f64)[tok]  # [nc, C, HO]
        x = x.permute(0, 2, 1)
        lg = x / math.log(2) if problem.gate_domain == "log" else torch.log2(x.clamp_min(1e-30))
        lg = torch.where(okh, lg, 0.0)
    if args.flags & pg.FLAG_HAS_BETA:
        b = torch.where(okh, args.beta.to(f64)[tok].permute(0, 2, 1), 0.0)
    G = torch.cumsum(lg, -1)  # [nc, HO, C]
    r_idx, s_idx = ar[:, None], ar[None, :]
    dG = G[..., :, None] - G[..., None, :]
    strict = torch.exp2(torch.where(s_idx < r_idx, dG, -math.inf))
    lower = torch.exp2(torch.where(s_idx <= r_idx, dG, -math.inf))
    A = b[..., :, None] * (k @ k.transpose(-1, -2)) * strict
    T = torch.linalg.inv(torch.eye(C, device=DEV, dtype=f64) + A)
    gam = torch.exp2(G)
    W = T @ ((b * gam)[..., None] * k)
    U = T @ (b[..., None] * v)
    Aqk = args.scale * (q @ k.transpose(-1, -2)) * lower
    g_last = G.gather(-1, (ln.clamp_min(1) - 1)[:, None, None].expand(-1, ho, 1))  # [nc, HO, 1]
    qf = torch.where(okh, args.scale * rq * gam, 0.0)
    kf = torch.where(okh, rk * torch.exp2(g_last - G), 0.0)
    F = torch.stack([qf, kf, torch.exp2(g_last).expand(-1, -1, C)], 2)
    return W, U, Aqk, F


CASES = {
    "gva_bf16_l2norm_linear": (LENS, (2, 2, 4), (128, 128), torch.bfloat16, True, "linear"),
    "gva_fp16_l2norm_linear": (LENS, (2, 2, 4), (128, 128), torch.float16, True, "linear"),
    "gqa_bf16_log": (LENS, (4, 2, 2), (128, 128), torch.bfloat16, False, "log"),
    "mha_fp16_none": (LENS, (2, 2, 2), (128, 128), torch.float16, False, "none"),
    "mha_bf16_l2norm_none": (LENS, (2, 2, 2), (128, 128), torch.bfloat16, True, "none"),
    "gva_bf16_k64_v64_log": (LENS, (2, 2, 4), (64, 64), torch.bfloat16, True, "log"),
    "gqa_fp16_k64_v128": (LENS, (4, 2, 2), (64, 128), torch.float16, True, "linear"),
    "gva_bf16_k128_v64": (LENS, (2, 2, 4), (128, 64), torch.bfloat16, False, "linear"),
    "one_token": ([1], (2, 2, 2), (128, 128), torch.bfloat16, True, "linear"),
    "one_chunk": ([64], (2, 2, 4), (128, 128), torch.float16, True, "log"),
    "long_4097": ([4097], (4, 4, 4), (128, 128), torch.bfloat16, True, "linear"),
    "many_short_one_long": ([17] * 20 + [3000, 65], (2, 2, 4), (128, 128), torch.bfloat16, True, "linear"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_prep_sm90_vs_shared_prep_and_float64(case):
    problem, args, _ = plan(*CASES[case])
    old = run_old(problem, args)
    new = run_new(problem, args)
    torch.cuda.synchronize()
    chunks = new[0]
    real = chunks[:, 2] > 0
    ref = prep64(problem, args, chunks)
    for name, i in (("W", 2), ("U", 3), ("Aqk", 4)):
        n, o, r = new[i][real], old[i][real], ref[i - 2][real]
        e_old, e_new = rel(o, r), rel(n, r)
        assert rel(n, o) < TOL_16, (name, rel(n, o))
        assert e_new < TOL_16, (name, e_new)
        assert e_new <= 1.5 * e_old + 1e-4, (name, e_new, e_old)  # as close to float64 as the shared prep
    f_new, f_old = new[5][real], old[5][real]
    assert torch.isfinite(f_new).all()
    # the same instructions on the same values: F near-exact
    assert (f_new - f_old).abs().max().item() <= 1e-6 * f_old.abs().max().item(), case
    assert rel(f_new, ref[3][real]) < TOL_F


def test_prep_sm90_rows_past_the_end_are_finite():
    """A 65-token sequence: its second chunk holds one token; rows 1..63 of that chunk are written and finite
    (beta is 0 there), as the main kernel's reads of whole blocks need."""
    problem, args, _ = plan([65], (2, 2, 2), (128, 128), torch.bfloat16, True, "linear")
    new = run_new(problem, args)
    torch.cuda.synchronize()
    for x in new[2:]:
        assert torch.isfinite(x[:2]).all()
    assert (new[3][1, :, 1:] == 0).all()  # U = T diag(beta) V: zero rows past the end


@pytest.mark.parametrize("case", ["gva_bf16_l2norm_linear", "gqa_fp16_k64_v128", "gqa_bf16_log", "gva_bf16_k128_v64"])
def test_sm90_main_kernel_on_the_sm90_prep(case):
    """The SM90 main kernel (its main-only entry) unchanged on the SM90 prep's scratch: outputs and final states
    against the float64 oracle, and against the same main kernel on the shared prep's scratch."""
    from cutedsl_attn.ref.gdn import chunk_gated_delta_rule as oracle

    problem, args, kw = plan(*CASES[case], init=True)
    cfg = chk90.Config(problem, chk90.default_tiles(problem, num_sms=132))
    mcfg = chk90.MainConfig(cfg)
    fn = chk90.compile_main(mcfg)
    outs = []
    for run_prep in (run_new, run_old):
        args.output.fill_(float("nan"))
        args.output_state.fill_(float("nan"))
        s = run_prep(problem, args)
        chk90.launch_main(fn, mcfg, args, s)
        torch.cuda.synchronize()
        outs.append((args.output.clone(), args.output_state.clone()))
    (o_new, st_new), (o_old, st_old) = outs
    o_ref, st_ref = oracle(**kw, output_final_state=True)
    assert rel(o_new, o_ref) < TOL_16 and rel(st_new, st_ref) < 5e-3, (rel(o_new, o_ref), rel(st_new, st_ref))
    assert rel(o_new, o_old) < TOL_16 and rel(st_new, st_old) < 5e-3
