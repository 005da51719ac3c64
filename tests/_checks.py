"""Comparisons shared by the GPU tests (kernel output against the float64 oracle)."""

import torch

#: relative-error bars of the GPU tests (Frobenius norm, against the float64 oracle)
TOL = {torch.bfloat16: 1e-2, torch.float16: 4e-3}


def rel_err(x, y):
    """``||x - y|| / ||y||`` in float64 over all elements (on the CPU: the oracle's device may differ)."""
    x, y = x.detach().double().cpu(), y.detach().double().cpu()
    return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()


def check(out, lse, o_ref, lse_ref, dtype, what):
    """O within tolerance, no unwritten (NaN-poisoned) value, exact zeros and -inf on rows with no visible key;
    returns the relative error of O (compared on the CPU)."""
    out, lse, o_ref, lse_ref = (t.detach().cpu() for t in (out, lse, o_ref, lse_ref))
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


NAN = float("nan")


def used_page_slots(kv_indptr, kv_indices, kv_last_page_len, num_pages: int, page_size: int) -> torch.Tensor:
    """bool ``[num_pages, page_size]``: the (page, slot) pairs a CSR page table's requests own (host tensors)."""
    used = torch.zeros(num_pages, page_size, dtype=torch.bool)
    ip, idx, last = kv_indptr.tolist(), kv_indices.tolist(), kv_last_page_len.tolist()
    for b in range(len(ip) - 1):
        pages = idx[ip[b]:ip[b + 1]]
        for i, pg in enumerate(pages):
            used[pg, : (last[b] if i == len(pages) - 1 else page_size)] = True
    return used


def check_poisoned(run, *, out, lse, oracle, dtype, what, ragged_kv=(), kv_end=None, paged_kv=(), used_slots=None):
    """Results depend only on the data a request owns: poison, run, compare with the float64 oracle.

    ``oracle()`` -> ``(o_ref, lse_ref)`` (CPU) is evaluated first, on the clean inputs.  Then every tensor of
    ``ragged_kv`` (``[rows, H, D]`` views, rows past ``kv_end = kv_indptr[-1]`` are spare) gets NaN in its
    spare rows, every tensor of ``paged_kv`` (``[pages, page_size, H, D]`` NHD-ordered views) NaN in the slots
    ``used_slots`` (:func:`used_page_slots`) marks unused, ``out`` and ``lse`` NaN everywhere (an unwritten
    element stays NaN).  ``run()`` launches (writing ``out`` / ``lse``); :func:`check` compares.  Returns the
    relative error of O."""
    o_ref, lse_ref = oracle()
    for t in ragged_kv:
        t[kv_end:] = NAN
    for t in paged_kv:
        t[~used_slots.to(t.device)] = NAN
    out.fill_(NAN)
    lse.fill_(NAN)
    run()
    torch.cuda.synchronize()
    return check(out.cpu(), lse.cpu(), o_ref, lse_ref, dtype, what)
