"""CPU tests of the GDN prep kernel's blockwise triangular inverse: a float32 emulation of the kernel's phases
(the same shared-memory buffer, the same block order and operand slots) against float64 ``torch.linalg``, and
the prep kernel's PTX (cross-compiled for sm_90a)."""

import re

import numpy as np
import pytest
import torch

C = 64  # the chunk
B = 16  # the diagonal blocks inverted by substitution


def _column_substitution(A):
    """T = (I + A)^-1, one column at a time by forward substitution in float32 (the previous kernel's method)."""
    T = np.zeros((C, C), np.float32)
    for j in range(C):
        col = np.zeros(C, np.float32)
        for r in range(C):
            part = [np.float32(1.0 if j == r else 0.0), np.float32(0), np.float32(0), np.float32(0)]
            for s in range(r):
                part[s % 4] = np.float32(part[s % 4] - A[r, s] * col[s])
            col[r] = np.float32(np.float32(part[0] + part[1]) + np.float32(part[2] + part[3]))
        T[:, j] = col
    return T


def _dot(x, y):
    acc = np.float32(0.0)
    for a, b in zip(x, y):
        acc = np.float32(acc + np.float32(a * b))
    return acc


def blockwise_inverse(A):
    """The kernel's ``_invert_blocks`` in float32.  ``M`` is its shared fp32 buffer: ``A`` strictly lower
    triangular on entry; on exit ``T^T`` sits in its upper triangle (diagonal blocks whole).  Returns T."""
    M = A.astype(np.float32).copy()
    # phase 1: the four 16 x 16 diagonal blocks by substitution, one thread a column; then each thread writes its
    # column of T as row j of the block (T^T: the block's lower part becomes 0, the diagonal 1)
    cols = {}
    for b in range(4):
        for j in range(B):
            col = np.zeros(B, np.float32)
            for r in range(B):
                part = [np.float32(1.0 if j == r else 0.0), np.float32(0), np.float32(0), np.float32(0)]
                for s in range(r):
                    part[s % 4] = np.float32(part[s % 4] - M[B * b + r, B * b + s] * col[s])
                col[r] = np.float32(np.float32(part[0] + part[1]) + np.float32(part[2] + part[3]))
            cols[b, j] = col
    for (b, j), col in cols.items():
        M[B * b + j, B * b:B * b + B] = col
    # phase 2: R = A_{b+1,b} T_bb (b = 0, 2) into A_{b+1,b}'s slot (A's rows against T^T's rows)
    R = {}
    for b in (0, 2):
        i = b + 1
        for r in range(B):
            for c in range(B):
                R[b, r, c] = _dot(M[B * i + r, B * b:B * b + B], M[B * b + c, B * b:B * b + B])
    for (b, r, c), v in R.items():
        M[B * (b + 1) + r, B * b + c] = v
    # phase 3: T_{b+1,b} = -T_{b+1,b+1} R, stored transposed in the upper block (b, b+1)
    for b in (0, 2):
        i = b + 1
        for c in range(B):
            for r in range(B):
                acc = np.float32(0.0)
                for s in range(B):
                    acc = np.float32(acc + np.float32(M[B * i + s, B * b + c] * M[B * i + s, B * i + r]))
                M[B * b + c, B * i + r] = -acc
    # phase 4: R32 = A_{H1,H0} T_H0 (32 x 32) into A_{H1,H0}'s slot; T_H0's columns 16.. start at row 16
    # (the block below them holds phase 2's R)
    R32 = np.zeros((32, 32), np.float32)
    for c in range(32):
        s0 = 0 if c < B else B
        for r in range(32):
            R32[r, c] = _dot(M[32 + r, s0:32], M[c, s0:32])
    M[32:, :32] = R32
    # phase 5: T_{H1,H0} = -T_H1 R32, transposed into the upper-right quadrant; T_H1's rows 0..15 only for its
    # columns 0..15 (its block below holds phase 2's R)
    for c in range(32):
        for r in range(32):
            s1 = B if r < B else 32
            acc = np.float32(0.0)
            for s in range(s1):
                acc = np.float32(acc + np.float32(M[32 + s, c] * M[32 + s, 32 + r]))
            M[c, 32 + r] = -acc
    return np.triu(M).T.copy()


def _chunk_A(seed, *, strong=False, length=C):
    """A = strict_tril(diag(beta) K K^T . Gamma) in float32 as the prep builds it (l2-normalised k)."""
    g = torch.Generator().manual_seed(seed)
    if strong:  # nearly parallel keys, beta near 1, no decay: the largest entries of T
        base = torch.randn(1, 128, generator=g, dtype=torch.float64)
        k = base + 0.05 * torch.randn(C, 128, generator=g, dtype=torch.float64)
        beta = 0.9 + 0.1 * torch.rand(C, generator=g, dtype=torch.float64)
        alpha = 1.0 - 0.01 * torch.rand(C, generator=g, dtype=torch.float64)
    else:
        k = torch.randn(C, 128, generator=g, dtype=torch.float64)
        beta = torch.rand(C, generator=g, dtype=torch.float64).clamp_min(1e-3)
        alpha = torch.rand(C, generator=g, dtype=torch.float64).clamp_min(1e-3) ** 0.1
    k = k / k.norm(dim=-1, keepdim=True)
    kb = k.to(torch.bfloat16).float()
    beta[length:] = 0.0
    G = torch.cumsum(torch.log2(alpha), 0).float()
    kk = kb @ kb.T
    A = torch.tril(beta.float()[:, None] * kk * torch.exp2(G[:, None] - G[None, :]), -1)
    return A.numpy().astype(np.float32)


@pytest.mark.parametrize("case", [(0, False, C), (1, False, C), (2, False, 37), (3, True, C), (4, True, C),
                                  (5, True, 1), (6, False, 17)])
def test_blockwise_inverse_matches_float64(case):
    seed, strong, length = case
    A = _chunk_A(seed, strong=strong, length=length)
    exact = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + torch.from_numpy(A).double())
    T = torch.from_numpy(blockwise_inverse(A)).double()
    ref = torch.from_numpy(_column_substitution(A)).double()
    scale = exact.abs().max().item()
    err = (T - exact).abs().max().item() / scale
    err_ref = (ref - exact).abs().max().item() / scale
    assert torch.equal(torch.triu(T, 1), torch.zeros_like(T)) and torch.equal(torch.diagonal(T), torch.ones(C).double())
    # float32 accuracy, of the order of the serial substitution's
    assert err < 2e-5 * max(1.0, scale) and err <= 8 * err_ref + 1e-6, (err, err_ref, scale)
    # rounded to bf16 (what W / U are computed from): no more roundings off the exact one's than substitution's
    eb = exact.to(torch.bfloat16)
    off, off_ref = ((x.to(torch.bfloat16) != eb).float().mean().item() for x in (T, ref))
    assert off <= off_ref + 0.01, (off, off_ref)
    if not strong:
        assert torch.equal(T.to(torch.bfloat16), ref.to(torch.bfloat16))
    if length < C:  # rows past the chunk's end are identity rows (beta = 0 there)
        assert torch.equal(T[length:, :length], torch.zeros(C - length, length, dtype=T.dtype))


def test_prep_ptx_blockwise_sm90():
    from _builds import build  # (tests/ is on sys.path)

    from cutedsl_attn.compile.cubin import cubin_kernel_resources
    from cutedsl_attn.planning.gdn import GdnProblem

    sm90 = pytest.importorskip("cutedsl_attn.sm90.gdn_chunked")
    p = GdnProblem(dtype="bfloat16", head_dim_k=128, head_dim_v=128, use_qk_l2norm=True)
    b = build(sm90.compile, sm90.Config(p, sm90.Tiles(tile_v=64, num_stages=2)))
    prep = b.ptx.split(".entry")[1]
    assert "mma.sync.aligned.m16n8k16" in prep and ".local" not in prep
    assert len(re.findall(r"bar\.sync|barrier\.sync", prep)) >= 8  # the inverse's phases
    assert re.search(r"\.minnctapersm\s+4", prep) and re.search(r"\.reqntid\s+128", prep)
    # four CTAs an SM also by shared memory (228 KiB an SM, 1 KiB reserved a CTA)
    from cutedsl_attn.common.gdn_prep import PREP_CTAS_PER_SM, prep_smem_bytes

    assert PREP_CTAS_PER_SM * (prep_smem_bytes(128, 128) + 1024) <= 228 * 1024
    res = [r for n, r in cubin_kernel_resources(b.cubin).items() if "prep" in n][0]
    assert res["stack_bytes"] == 0
    assert res["registers"] <= 128, res  # 4 CTAs of 128 threads an SM by registers
