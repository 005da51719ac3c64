"""Tests for ``cutedsl_attn.api.cascade`` (merge_state / merge_state_in_place / merge_states).

Ground truth: attention over a union of disjoint key sets, computed by the float64
oracle ``cutedsl_attn.ref.attention`` with custom masks.
"""

from __future__ import annotations

import math

import pytest
import torch

from cutedsl_attn.api.cascade import merge_state, merge_state_in_place, merge_states
from cutedsl_attn.ref import attention

NEG_INF = float("-inf")


def _problem(qo_len=6, kv_len=10, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(qo_len, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(kv_len, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(kv_len, hkv, d, generator=g, dtype=torch.float64)
    return q, k, v, g


def _partition(qo_len, kv_len, parts, g, empty_rows=()):
    """Random partition of each row's keys into `parts` disjoint masks (some rows empty)."""
    owner = torch.randint(0, parts, (qo_len, kv_len), generator=g)
    masks = [owner == p for p in range(parts)]
    for r in empty_rows:  # row r: all keys go to part 0 only -> other parts empty for r
        for p in range(parts):
            masks[p][r] = p == 0
    return masks


def _state(q, k, v, mask):
    o, lse = attention(q, k, v, custom_mask=mask)
    return o.float(), lse.float()


def test_merge_state_two_disjoint_key_sets_equals_union():
    q, k, v, g = _problem(seed=1)
    ma, mb = _partition(6, 10, 2, g, empty_rows=(2,))
    # row 4: everything in B (A empty)
    ma[4], mb[4] = False, True
    va, sa = _state(q, k, v, ma)
    vb, sb = _state(q, k, v, mb)
    assert torch.isneginf(sb[2]).all() and torch.isneginf(sa[4]).all()
    vu, su = attention(q, k, v, causal=True, custom_mask=ma | mb)
    vm, sm = merge_state(va, sa, vb, sb)
    assert vm.dtype == torch.float32 and sm.dtype == torch.float32
    assert vm.shape == (6, 4, 8) and sm.shape == (6, 4)
    torch.testing.assert_close(vm.double(), vu, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(sm.double(), su, atol=2e-6, rtol=1e-5)
    # union LSE is base 2: equals log2(2^sa + 2^sb)
    torch.testing.assert_close(sm.double(), torch.logaddexp2(sa.double(), sb.double()), atol=1e-6, rtol=0)


def test_merge_state_both_empty_no_nan():
    n, h, d = 3, 2, 4
    va = torch.full((n, h, d), float("nan"))  # garbage in empty states must not leak
    vb = torch.full((n, h, d), float("inf"))
    s = torch.full((n, h), NEG_INF)
    v, s_out = merge_state(va, s, vb, s.clone())
    assert torch.equal(v, torch.zeros(n, h, d))
    assert torch.isneginf(s_out).all()
    # one side empty with garbage: result equals the other side exactly
    vb = torch.randn(n, h, d)
    sb = torch.randn(n, h)
    v, s_out = merge_state(va, s, vb, sb)
    torch.testing.assert_close(v, vb, atol=1e-7, rtol=0)
    torch.testing.assert_close(s_out, sb, atol=1e-7, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_merge_state_dtypes(dtype):
    q, k, v, g = _problem(seed=2)
    ma, mb = _partition(6, 10, 2, g)
    va, sa = _state(q, k, v, ma)
    vb, sb = _state(q, k, v, mb)
    vm, sm = merge_state(va.to(dtype), sa.double(), vb.to(dtype), sb)  # float64 s is cast to fp32
    assert vm.dtype == dtype and sm.dtype == torch.float32
    vu, _ = attention(q, k, v, custom_mask=ma | mb)
    tol = {torch.float16: 3e-3, torch.bfloat16: 2e-2}.get(dtype, 2e-6)
    torch.testing.assert_close(vm.double(), vu, atol=tol, rtol=tol)


def test_merge_state_in_place_with_mask():
    q, k, v, g = _problem(seed=3)
    ma, mb = _partition(6, 10, 2, g, empty_rows=(0,))
    va, sa = _state(q, k, v, ma)
    vb, sb = _state(q, k, v, mb)
    vu, su = attention(q, k, v, custom_mask=ma | mb)
    # no mask: all rows merged
    v1, s1 = va.clone(), sa.clone()
    assert merge_state_in_place(v1, s1, vb, sb) is None
    torch.testing.assert_close(v1.double(), vu, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(s1.double(), su, atol=2e-6, rtol=1e-5)
    # masked: only selected rows change, others bit-identical
    sel = torch.tensor([True, False, True, False, False, True])
    v2, s2 = va.clone(), sa.clone()
    v2_ptr = v2.data_ptr()
    merge_state_in_place(v2, s2, vb, sb, mask=sel)
    assert v2.data_ptr() == v2_ptr
    assert torch.equal(v2[~sel], va[~sel]) and torch.equal(s2[~sel], sa[~sel])
    torch.testing.assert_close(v2[sel], v1[sel], atol=0, rtol=0)
    torch.testing.assert_close(s2[sel], s1[sel], atol=0, rtol=0)
    # bf16 v in place
    v3 = va.bfloat16()
    s3 = sa.clone()
    merge_state_in_place(v3, s3, vb.bfloat16(), sb)
    assert v3.dtype == torch.bfloat16
    torch.testing.assert_close(v3.double(), vu, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_states", [0, 1, 3])
def test_merge_states(num_states):
    q, k, v, g = _problem(seed=4 + num_states)
    n, hq, d = 6, 4, 8
    if num_states == 0:
        vs = torch.zeros(n, 0, hq, d, dtype=torch.bfloat16)
        ss = torch.zeros(n, 0, hq)
        vm, sm = merge_states(vs, ss)
        assert vm.dtype == torch.bfloat16 and vm.shape == (n, hq, d)
        assert torch.equal(vm, torch.zeros_like(vm))
        assert sm.dtype == torch.float32 and sm.shape == (n, hq) and torch.isneginf(sm).all()
        return
    masks = _partition(n, 10, num_states, g, empty_rows=(1,))
    states = [_state(q, k, v, m) for m in masks]
    vs = torch.stack([s[0] for s in states], dim=1)
    ss = torch.stack([s[1] for s in states], dim=1)
    union = masks[0]
    for m in masks[1:]:
        union = union | m
    union[3] = False  # row 3: make every state empty
    for st in range(num_states):
        ss[3, st] = NEG_INF
        vs[3, st] = float("nan")
    vm, sm = merge_states(vs, ss)
    vu, su = attention(q, k, v, custom_mask=union)
    assert vm.shape == (n, hq, d) and sm.shape == (n, hq)
    torch.testing.assert_close(vm.double(), vu, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(sm.double(), su, atol=2e-6, rtol=1e-5)
    assert torch.equal(vm[3], torch.zeros_like(vm[3])) and torch.isneginf(sm[3]).all()
    if num_states == 3:
        # merge_states == folding merge_state
        va, sa = vs[:, 0], ss[:, 0]
        for st in range(1, num_states):
            va, sa = merge_state(va, sa, vs[:, st], ss[:, st])
        torch.testing.assert_close(vm, va, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(sm, sa, atol=1e-6, rtol=1e-6)


def test_merge_is_commutative_and_weights_are_base2():
    va = torch.tensor([[[1.0]]])
    vb = torch.tensor([[[3.0]]])
    sa = torch.tensor([[0.0]])
    sb = torch.tensor([[1.0]])  # base 2: weight of b is twice a's
    v, s = merge_state(va, sa, vb, sb)
    assert v.item() == pytest.approx((1 + 2 * 3) / 3)
    assert s.item() == pytest.approx(math.log2(3))
    v2, s2 = merge_state(vb, sb, va, sa)
    assert torch.equal(v, v2) and torch.equal(s, s2)


# ----------------------------------------------------------------------------------
# validation errors
# ----------------------------------------------------------------------------------
V = torch.zeros(2, 3, 4)
S = torch.zeros(2, 3)


@pytest.mark.parametrize(
    "args,exc,match",
    [
        ((V.long(), S, V.long(), S), TypeError, "v_a must have a floating-point dtype"),
        (([0.0], S, V, S), TypeError, "v_a must be a torch.Tensor"),
        ((V, S.long(), V, S), TypeError, "s_a must have a floating-point dtype"),
        ((V, S, V.half(), S), TypeError, "same dtype"),
        ((V[0], S[0], V[0], S[0]), ValueError, "v_a must be 3-D"),
        ((V, S[None], V, S), ValueError, "s_a must be 2-D"),
        ((V, S[:, :2], V, S), ValueError, r"s_a shape \(2, 2\) must equal v_a.shape\[:2\]"),
        ((V, S, V[:, :, :3], S), ValueError, "v_a and v_b must have the same shape"),
        ((V, S, torch.zeros(2, 3, 4, device="meta"), torch.zeros(2, 3, device="meta")), ValueError, "same device"),
        ((V, torch.zeros(2, 3, device="meta"), V, S), ValueError, "s_a must be on the same device"),
    ],
)
def test_merge_state_validation(args, exc, match):
    with pytest.raises(exc, match=match):
        merge_state(*args)


def test_merge_state_in_place_validation():
    v, s = V.clone(), S.clone()
    with pytest.raises(TypeError, match="mask must be a bool"):
        merge_state_in_place(v, s, V, S, mask=torch.ones(2))
    with pytest.raises(ValueError, match=r"mask must have shape \[n\]"):
        merge_state_in_place(v, s, V, S, mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask must have shape \[n\]"):
        merge_state_in_place(v, s, V, S, mask=torch.ones(2, 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be a torch.Tensor"):
        merge_state_in_place(v, s, V, S, mask=[True, False])
    with pytest.raises(ValueError, match="mask must be on the same device"):
        merge_state_in_place(v, s, V, S, mask=torch.ones(2, dtype=torch.bool, device="meta"))
    with pytest.raises(TypeError, match="s must be float32"):
        merge_state_in_place(v, s.double(), V, S)
    with pytest.raises(ValueError, match="v_other must be 3-D"):
        merge_state_in_place(v, s, V[0], S)
    with pytest.raises(TypeError, match="v must have a floating-point dtype"):
        merge_state_in_place(v.int(), s, V, S)
    with pytest.raises(ValueError, match="v and v_other must have the same shape"):
        merge_state_in_place(v, s, torch.zeros(2, 3, 5), S)
    # nothing was modified by the failed calls
    assert torch.equal(v, V) and torch.equal(s, S)


def test_merge_states_validation():
    v4 = torch.zeros(2, 3, 4, 5)
    s3 = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="v must be 4-D"):
        merge_states(v4[0], s3)
    with pytest.raises(ValueError, match="s must be 3-D"):
        merge_states(v4, s3[0])
    with pytest.raises(ValueError, match=r"must equal v.shape\[:3\]"):
        merge_states(v4, s3[:, :2])
    with pytest.raises(TypeError, match="v must have a floating-point dtype"):
        merge_states(v4.long(), s3)
    with pytest.raises(TypeError, match="s must have a floating-point dtype"):
        merge_states(v4, s3.bool())
    with pytest.raises(TypeError, match="v must be a torch.Tensor"):
        merge_states(None, s3)
    with pytest.raises(ValueError, match="same device"):
        merge_states(v4, torch.zeros(2, 3, 4, device="meta"))
