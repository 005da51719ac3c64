"""Comparisons shared by the GPU tests (kernel output against the float64 oracle)."""

import torch

#: relative-error bars of the GPU tests (Frobenius norm, against the float64 oracle)
TOL = {torch.bfloat16: 1e-2, torch.float16: 4e-3}


def rel_err(x, y):
    """``||x - y|| / ||y||`` in float64 over all elements."""
    x, y = x.double(), y.double()
    return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()


def check(out, lse, o_ref, lse_ref, dtype, what):
    """O within tolerance, no unwritten (NaN-poisoned) value, exact zeros and -inf on rows with no visible key;
    returns the relative error of O."""
    assert not torch.isnan(out).any(), f"{what}: NaN / unwritten output"
    assert not torch.isnan(lse).any(), f"{what}: NaN / unwritten LSE"
    e = rel_err(out, o_ref)
    assert e <= TOL[dtype], f"{what}: output rel err {e}"
    lse_c, lse_r = lse.double(), lse_ref.double()
    fin = torch.isfinite(lse_r)
    assert torch.equal(torch.isfinite(lse_c), fin), f"{what}: LSE -inf pattern differs"
    assert (lse_c[~fin] == float("-inf")).all(), f"{what}: LSE of empty rows must be -inf"
    if fin.any():
        d = (lse_c[fin] - lse_r[fin]).abs().max().item()
        assert d < 2e-2, f"{what}: LSE abs err {d}"
    if (~fin).any():
        assert (out[~fin] == 0).all(), f"{what}: rows with no visible key must be 0"
    return e
