"""The FMA-pipe exponential of the SM90 softmax (:func:`cutedsl_attn.common.ptx.ex2_poly`), its arithmetic
replayed in float32 with numpy, instruction by instruction, against float64 ``2**x``."""

import numpy as np
import pytest

from cutedsl_attn.common import ptx


def ex2_poly_f32(x):
    """The PTX sequence of ``ptx.ex2_poly`` in float32 (round-to-nearest adds and fmas; numpy's float32
    fma is emulated by computing in float64 and rounding once, exact for these magnitudes)."""
    f32 = np.float32
    c1, c2, c3 = (f32(c) for c in ptx.EX2_POLY_COEFFS)
    x = np.maximum(np.asarray(x, dtype=f32), f32(ptx.EX2_POLY_MIN))
    magic = f32(ptx._EX2_MAGIC)
    t = (x + magic).astype(f32)
    n = (t - magic).astype(f32)
    fr = (x - n).astype(f32)
    fma = lambda a, b, c: (a.astype(np.float64) * b + c).astype(f32)  # noqa: E731
    p = fma(fr, c3, np.float64(c2))
    p = fma(p, fr, np.float64(c1))
    p = fma(p, fr, np.float64(1.0))
    bits = (p.view(np.uint32).astype(np.int64) + (t.view(np.uint32).astype(np.int64) << 23)) & 0xFFFFFFFF
    return bits.astype(np.uint32).view(np.float32)


def test_relative_error_below_bf16_and_fp16_ulp():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    x = np.concatenate([np.linspace(-126.0, 0.0, 2_000_001), -rng.exponential(3.0, 100_000),
                        np.arange(-126, 1) - 0.5, np.arange(-126, 1.0)]).astype(np.float32)
    x = x[x >= -126.0]
    got = ex2_poly_f32(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    rel = np.abs(got - want) / want
    assert rel.max() < 1.05e-4, (seed, rel.max(), x[rel.argmax()])  # fp16 ulp 9.8e-4, bf16 7.8e-3 near 1
    assert got[x == 0.0].tolist() == [1.0] * int((x == 0.0).sum())  # the row max itself: exactly 1


def test_masked_scores_give_exact_zero():
    """-inf (a masked score) and anything at or below -127 give +0.0 exactly, as ``ex2.approx.ftz`` gives for
    -inf: a fully masked row then sums to 0 and keeps O = 0, LSE = -inf."""
    x = np.array([-np.inf, -1e30, -1000.0, -127.0, -127.0001], dtype=np.float32)
    got = ex2_poly_f32(x)
    assert got.tolist() == [0.0] * len(x) and not np.signbit(got).any()
    # just above the clamp: denormal-sized, non-negative, far below any softmax row sum (>= 1)
    tiny = ex2_poly_f32(np.linspace(-126.999, -126.0, 1001, dtype=np.float32)).astype(np.float64)
    assert (tiny >= 0).all() and tiny.max() <= 2.0 ** -125


@pytest.mark.parametrize("x", [-0.5, 0.5 - 2**-24, -125.5, -126.0, -1e-7])
def test_rounding_boundaries(x):
    got = float(ex2_poly_f32(np.float32(x)))
    assert got == pytest.approx(2.0 ** float(np.float32(x)), rel=1.05e-4, abs=0)


def test_coefficients_are_the_minimax_fit():
    """With p(0) = 1 fixed, the cubic's relative error on [-1/2, 1/2] levels out: its four extrema away from 0
    (the ends and one inside each half; a small fifth sits next to 0) have equal size (to 0.1%), i.e. no coefficient change lowers the
    maximum -- the minimax fit, checked in float64 independently of the constants' comment."""
    c1, c2, c3 = ptx.EX2_POLY_COEFFS
    f = np.linspace(-0.5, 0.5, 200_001)
    err = (1 + f * (c1 + f * (c2 + f * c3))) / np.exp2(f) - 1
    inner = np.flatnonzero((np.diff(np.sign(np.diff(err))) != 0)) + 1
    pts = np.concatenate([[0], inner, [len(f) - 1]])
    ext = np.abs(err[pts])
    ext = ext[ext > 0.5 * ext.max()]  # (the small one next to f = 0, where the error is pinned to 0)
    assert len(ext) == 4, ext
    assert ext.max() < 1.02e-4 and ext.min() > 0.999 * ext.max(), ext
