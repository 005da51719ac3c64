"""CPU tests of the per-channel prep kernel's (:mod:`cutedsl_attn.common.kda_prep`) arithmetic, in float32
emulation against the float32 algorithm reference (:mod:`cutedsl_attn.ref.kda_chunked`) and float64 ``torch``:

* the cumulative log2 decay, summed in the kernel's order, never rises, so the off-diagonal column factors
  ``2^(G_p - G_s)`` (``s <= p``) are ``<= 1`` without a clamp or a bound check;
* the diagonal block's bound check (the largest exponent against the limit, the largest operand against the io
  dtype's range) falls back to the direct block exactly where the reference does;
* ``T`` by 16 x 16 blocks (the GDN prep's inverse, emulated by ``test_gdn_prep_cpu.blockwise_inverse``) on
  KDA's per-channel ``A`` rounds to the io dtype as the reference's triangular solve does, and ``W = T (e 2^G)``
  agrees with it to float32 accuracy.
"""

import math

import numpy as np
import pytest
import torch

from cutedsl_attn.ref import kda_chunked as rk
from test_gdn_prep_cpu import blockwise_inverse  # pytest puts tests/ on sys.path

C, SUB, K = rk.CHUNK, rk.SUB, 128


def _gates(kind, gen, shape=(C, K)):
    u = torch.rand(shape, generator=gen)
    if kind == "safe":  # the benchmark's: -5 sigmoid(x)
        return -5.0 * torch.sigmoid(torch.randn(shape, generator=gen))
    if kind == "strong":
        return -u * 30.0
    if kind == "huge":
        return -u * 1e4
    g = -u * 2.0  # "inf": a tenth of the gates -inf
    g[torch.rand(shape, generator=gen) < 0.1] = -math.inf
    return g


def _cumsum_kernel_order(g):
    """G as the prep sums it: one channel a thread, a token at a time in float32, each log2 gate floored."""
    lg = torch.clamp(g.float() * np.float32(rk.LOG2E), min=rk.GATE_FLOOR_LOG2)
    out = torch.empty_like(lg)
    run = torch.zeros(lg.shape[1])
    for r in range(lg.shape[0]):
        run = run + lg[r]
        out[r] = run
    return out


@pytest.mark.parametrize("kind", ["safe", "strong", "huge", "inf"])
def test_off_diagonal_factors_never_exceed_one(kind):
    gen = torch.Generator().manual_seed(7)
    for _ in range(4):
        G = _cumsum_kernel_order(_gates(kind, gen))
        Gz = torch.cat([torch.zeros(1, K), G])  # the zero row -1: the first sub-chunk's reference
        assert torch.all(Gz[1:] <= Gz[:-1])  # never rises, in float32, in the kernel's order
        for i in range(1, C // SUB):
            p = SUB * i - 1
            xe = G[p][None, :] - G[:p + 1]
            assert torch.all(xe <= 0.0) and torch.all(torch.exp2(xe) <= 1.0)


def _kernel_falls_back(k, G, i, lim, io_max):
    """The kernel's diagonal-block test of sub-chunk ``i``: max exponent past ``lim`` or max |operand| past
    ``io_max`` (fp32 operand, before its rounding)."""
    p = SUB * i - 1
    gp = G[p] if p >= 0 else torch.zeros(K)
    xe = gp[None, :] - G[SUB * i:SUB * (i + 1)]
    y = k[SUB * i:SUB * (i + 1)] * torch.exp2(torch.clamp(xe, max=lim))
    return max((xe.max() - lim).item(), (y.abs().max() - io_max).item()) > 0.0


def _reference_falls_back(k, G, i, lim, io_max):
    """The reference's rule (``ref.kda_chunked._chunk``): not every element within both bounds."""
    p = SUB * i - 1
    gp = G[p] if p >= 0 else torch.zeros(K)
    xe = gp[None, :] - G[:SUB * (i + 1)]
    kc = k[:SUB * (i + 1)] * torch.exp2(torch.clamp(xe, max=lim))
    ok = ((xe[SUB * i:] <= lim) & (kc[SUB * i:].abs() <= io_max)).all().item()
    return not ok


@pytest.mark.parametrize("io", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["safe", "strong", "huge", "inf"])
def test_diagonal_bound_check_matches_the_reference(io, kind):
    gen = torch.Generator().manual_seed(11)
    lim, io_max = rk.diag_limit(io), rk._IO_MAX[io]
    seen = set()
    for trial in range(6):
        G = _cumsum_kernel_order(_gates(kind, gen))
        k = torch.randn(C, K, generator=gen)
        if trial % 2:  # keys without l2norm, large enough for the fp16 operand bound to matter
            k = k * 3000.0
        k = k.to(io).float()
        for i in range(C // SUB):
            mine = _kernel_falls_back(k, G, i, lim, io_max)
            assert mine == _reference_falls_back(k, G, i, lim, io_max), (trial, i)
            seen.add(mine)
    if kind in ("strong", "huge"):
        assert True in seen  # the direct block is exercised


def _kda_chunk(seed, kind):
    """(A, e 2^G) of one KDA chunk in float32 as the prep builds them (l2-normalised bf16 k, beta in (0, 1))."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(C, K, generator=gen)
    k = (k / k.norm(dim=-1, keepdim=True)).to(torch.bfloat16).float()
    beta = torch.rand(C, generator=gen)
    G = _cumsum_kernel_order(_gates(kind, gen))
    e = (beta[:, None] * k).to(torch.bfloat16).float()
    f = torch.exp2(torch.clamp(G[:, None, :] - G[None, :, :], max=0.0))  # [r, s, K]
    A = torch.tril((e[:, None, :] * k[None, :, :] * f).sum(-1), -1)
    return A, (e * torch.exp2(G)).to(torch.bfloat16).float()


@pytest.mark.parametrize("case", [(0, "safe"), (1, "safe"), (2, "inf"), (3, "strong")])
def test_blockwise_T_rounds_like_the_reference_solve(case):
    A, eg = _kda_chunk(*case)
    eye = torch.eye(C)
    t_ref = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)  # the reference's T
    t_blk = torch.from_numpy(blockwise_inverse(A.numpy().astype(np.float32)))
    exact = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A.double())
    scale = exact.abs().max().item()
    assert (t_blk.double() - exact).abs().max().item() <= 2e-5 * max(1.0, scale)
    rb, bb = t_ref.to(torch.bfloat16), t_blk.to(torch.bfloat16)
    assert (rb != bb).float().mean().item() < 0.01  # the same bf16 T but for rare ties
    w_ref = (rb.float() @ eg).to(torch.bfloat16).float()
    w_blk = (bb.float() @ eg).to(torch.bfloat16).float()
    assert ((w_blk - w_ref).norm() / w_ref.norm()).item() < 1e-3
