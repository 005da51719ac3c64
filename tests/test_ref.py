"""Tests for the float64 torch attention oracle ``cutedsl_attn.ref``.

The oracle is checked against ``naive_attention`` below: an independent, deliberately
slow implementation using explicit Python loops over (i, h, j) and the ``math`` /
``cmath`` modules on Python floats (no torch in its arithmetic).
"""

from __future__ import annotations

import cmath
import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cutedsl_attn.ref import (
    alibi_slopes,
    apply_rope_llama,
    attention,
    block_tables_to_csr,
    csr_to_block_tables,
    paged_decode,
    paged_prefill,
    ragged_prefill,
)

LOG2E = 1.0 / math.log(2.0)
NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------
# independent naive implementation
# ----------------------------------------------------------------------------------
def naive_alibi_slopes(n_heads):
    """ALiBi paper (Press et al.) reference recursion."""

    def pow2_slopes(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n_heads).is_integer():
        return pow2_slopes(n_heads)
    closest = 2 ** math.floor(math.log2(n_heads))
    return pow2_slopes(closest) + naive_alibi_slopes(2 * closest)[0::2][: n_heads - closest]


def naive_rope(vec, pos, rope_scale=1.0, rope_theta=1e4):
    """Rotate-half RoPE via complex multiplication: (x_d + i x_{d+D/2}) * e^{i pos freq_d}."""
    D = len(vec)
    half = D // 2
    out = [0.0] * D
    for d in range(half):
        freq = (1.0 / rope_scale) * rope_theta ** (-2.0 * d / D)
        z = complex(vec[d], vec[d + half]) * cmath.exp(1j * pos * freq)
        out[d] = z.real
        out[d + half] = z.imag
    return out


def naive_attention(
    q,
    k,
    v,
    *,
    causal=False,
    window_left=-1,
    logits_soft_cap=None,
    sm_scale=None,
    sinks=None,
    pos_encoding_mode="NONE",
    rope_scale=None,
    rope_theta=None,
    custom_mask=None,
    score_mod=None,
    batch_idx=0,
):
    Q, K, V = q.double().tolist(), k.double().tolist(), v.double().tolist()
    qo_len, Hq, D = len(Q), q.shape[1], q.shape[2]
    kv_len, Hkv, Dv = len(K), k.shape[1], v.shape[2]
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    M = custom_mask.tolist() if custom_mask is not None else None
    S = sinks.double().tolist() if sinks is not None else None
    rs = 1.0 if rope_scale is None else rope_scale
    rt = 1e4 if rope_theta is None else rope_theta
    slopes = naive_alibi_slopes(Hq)
    O = [[[0.0] * Dv for _ in range(Hq)] for _ in range(qo_len)]
    L = [[NEG_INF] * Hq for _ in range(qo_len)]
    for i in range(qo_len):
        ia = i + kv_len - qo_len
        for h in range(Hq):
            kh = h // group
            qv = Q[i][h]
            if pos_encoding_mode == "ROPE_LLAMA":
                qv = naive_rope(qv, ia, rs, rt)
            logits = []  # (logit, j or None for the sink)
            for j in range(kv_len):
                if M is not None:
                    vis = M[i][j]
                else:
                    vis = (j <= ia) if causal else True
                if window_left >= 0 and j < ia - window_left:
                    vis = False
                if not vis:
                    continue
                kv = K[j][kh]
                if pos_encoding_mode == "ROPE_LLAMA":
                    kv = naive_rope(kv, j, rs, rt)
                s = 0.0
                for d in range(D):
                    s += qv[d] * kv[d]
                s *= scale
                if logits_soft_cap is not None and logits_soft_cap > 0:
                    s = logits_soft_cap * math.tanh(s / logits_soft_cap)
                if pos_encoding_mode == "ALIBI":
                    s += slopes[h] * (j - ia)
                if score_mod is not None:  # python scalars: request, query head, query position, key
                    s = float(score_mod(s, batch_idx, h, ia, j))
                logits.append((s, j))
            if S is not None:
                logits.append((S[h], None))
            if not logits:
                continue
            m = max(x for x, _ in logits)
            den = sum(math.exp(x - m) for x, _ in logits)
            L[i][h] = (m + math.log(den)) * LOG2E
            for d in range(Dv):
                acc = 0.0
                for x, j in logits:
                    if j is not None:
                        acc += math.exp(x - m) * V[j][kh][d]
                O[i][h][d] = acc / den
    return (
        torch.tensor(O, dtype=torch.float64).reshape(qo_len, Hq, Dv),
        torch.tensor(L, dtype=torch.float64).reshape(qo_len, Hq),
    )


def assert_matches(got, want, atol=1e-10, rtol=1e-9):
    o, lse = got
    o_ref, lse_ref = want
    assert o.dtype == torch.float64 and lse.dtype == torch.float64
    assert o.shape == o_ref.shape and lse.shape == lse_ref.shape
    assert not torch.isnan(o).any()
    # -inf must match exactly
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    torch.testing.assert_close(o, o_ref, atol=atol, rtol=rtol)
    fin = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse[fin], lse_ref[fin], atol=atol, rtol=rtol)


def rand_qkv(qo_len, kv_len, hq, hkv, d, dv=None, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    q = torch.randn(qo_len, hq, d, generator=g, dtype=torch.float64) * scale
    k = torch.randn(kv_len, hkv, d, generator=g, dtype=torch.float64) * scale
    v = torch.randn(kv_len, hkv, dv, generator=g, dtype=torch.float64)
    return q, k, v


def check(q, k, v, **kw):
    got = attention(q, k, v, **kw)
    want = naive_attention(q, k, v, **kw)
    assert_matches(got, want)
    return got


# ----------------------------------------------------------------------------------
# single-request attention vs naive
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_vs_naive(group, causal):
    q, k, v = rand_qkv(5, 9, 4, 4 // group, 8, seed=group + 10 * causal)
    check(q, k, v, causal=causal)


def test_gqa_head_mapping_explicit():
    # Hq=4, Hkv=2: heads 0,1 -> kv head 0; heads 2,3 -> kv head 1 (not h % Hkv)
    q, k, v = rand_qkv(3, 6, 4, 2, 8, seed=3)
    o, lse = attention(q, k, v)
    for h in range(4):
        o_h, lse_h = attention(q[:, h : h + 1], k[:, h // 2 : h // 2 + 1], v[:, h // 2 : h // 2 + 1])
        torch.testing.assert_close(o[:, h], o_h[:, 0], atol=1e-12, rtol=0)
        torch.testing.assert_close(lse[:, h], lse_h[:, 0], atol=1e-12, rtol=0)


def test_causal_bottom_right_qo_lt_kv():
    q, k, v = rand_qkv(3, 8, 2, 1, 8, seed=4)
    o, lse = check(q, k, v, causal=True)
    # row i sees exactly keys 0..i+5: same as non-causal attention over that prefix
    for i in range(3):
        o_i, lse_i = attention(q[i : i + 1], k[: i + 6], v[: i + 6])
        torch.testing.assert_close(o[i], o_i[0], atol=1e-12, rtol=0)
        torch.testing.assert_close(lse[i], lse_i[0], atol=1e-12, rtol=0)


def test_causal_qo_gt_kv_empty_rows():
    q, k, v = rand_qkv(7, 4, 4, 2, 8, seed=5)
    o, lse = check(q, k, v, causal=True)
    # first qo_len - kv_len = 3 rows see nothing
    assert torch.equal(o[:3], torch.zeros_like(o[:3]))
    assert torch.isneginf(lse[:3]).all()
    assert torch.isfinite(lse[3:]).all()


def test_empty_kv():
    q, k, v = rand_qkv(3, 0, 2, 2, 8, seed=6)
    o, lse = attention(q, k, v)
    assert o.shape == (3, 2, 8) and torch.equal(o, torch.zeros_like(o))
    assert torch.isneginf(lse).all()


@pytest.mark.parametrize("w", [0, 1, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_window_left_counts_w_plus_1(w, causal):
    qo_len, kv_len = 4, 10
    # uniform logits (q = 0) and one-hot values: o[i, h, j] = 1/count for visible j
    q = torch.zeros(qo_len, 2, 4, dtype=torch.float64)
    k = torch.randn(kv_len, 1, 4, dtype=torch.float64)
    v = torch.eye(kv_len, dtype=torch.float64)[:, None, :]
    o, lse = attention(q, k, v, causal=causal, window_left=w)
    for i in range(qo_len):
        ia = i + kv_len - qo_len
        visible = (o[i, 0] > 0).nonzero().flatten().tolist()
        if causal:
            assert visible == list(range(ia - w, ia + 1))
            assert len(visible) == w + 1
        else:  # left bound only
            assert visible == list(range(ia - w, kv_len))
        assert lse[i, 0].item() == pytest.approx(math.log2(len(visible)))
    q, k, v = rand_qkv(qo_len, kv_len, 2, 1, 8, seed=7)
    check(q, k, v, causal=causal, window_left=w)


def test_window_left_minus_one_disabled():
    q, k, v = rand_qkv(4, 9, 2, 2, 8, seed=8)
    a = attention(q, k, v, causal=True, window_left=-1)
    b = attention(q, k, v, causal=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    big = attention(q, k, v, causal=True, window_left=100)
    assert torch.equal(big[0], b[0])


@pytest.mark.parametrize("cap", [1.0, 5.0, 30.0])
def test_soft_cap(cap):
    q, k, v = rand_qkv(4, 7, 4, 2, 8, seed=9, scale=4.0)
    o, lse = check(q, k, v, logits_soft_cap=cap, causal=True)
    # every capped logit < cap, so lse (nat) < cap + ln(kv_len)
    assert (lse / LOG2E <= cap + math.log(7) + 1e-9).all()
    # cap None / 0 disables
    a = attention(q, k, v, logits_soft_cap=None)
    b = attention(q, k, v, logits_soft_cap=0.0)
    assert torch.equal(a[0], b[0])


def test_sinks_vs_naive_and_formula():
    q, k, v = rand_qkv(4, 6, 4, 2, 8, seed=10)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float32)
    o, lse = check(q, k, v, sinks=sinks, causal=True)
    # sink_attention_unified: concat sink (unscaled) to scaled logits, softmax, drop column
    o_plain, lse_plain = attention(q, k, v, causal=True)
    lse_nat_plain = lse_plain / LOG2E
    sink = sinks.double()[None, :]
    lse_nat = torch.logaddexp(lse_nat_plain, sink)
    torch.testing.assert_close(lse, lse_nat * LOG2E, atol=1e-12, rtol=0)
    torch.testing.assert_close(o, o_plain * torch.exp(lse_nat_plain - lse_nat)[..., None], atol=1e-12, rtol=0)


def test_sinks_not_scaled_by_sm_scale():
    q, k, v = rand_qkv(2, 3, 1, 1, 4, seed=11)
    sinks = torch.tensor([1.5])
    for sm in (0.1, 3.0):
        check(q, k, v, sinks=sinks, sm_scale=sm)


def test_sinks_with_empty_rows():
    q, k, v = rand_qkv(6, 3, 2, 1, 8, seed=12)
    sinks = torch.tensor([0.25, -2.0])
    o, lse = check(q, k, v, sinks=sinks, causal=True)
    assert torch.equal(o[:3], torch.zeros_like(o[:3]))
    torch.testing.assert_close(lse[:3], (sinks.double() * LOG2E).expand(3, 2), atol=1e-12, rtol=0)
    # empty kv with sink
    o, lse = attention(q, k[:0], v[:0], sinks=sinks)
    assert torch.equal(o, torch.zeros_like(o))
    torch.testing.assert_close(lse, (sinks.double() * LOG2E).expand(6, 2), atol=1e-12, rtol=0)


def test_alibi_slopes():
    for h in (1, 2, 3, 5, 8, 12, 16, 20, 32, 48):
        got = alibi_slopes(h)
        assert got.dtype == torch.float32 and got.shape == (h,)
        torch.testing.assert_close(got, torch.tensor(naive_alibi_slopes(h), dtype=torch.float32))
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0**-k for k in range(1, 9)]))
    # 12 heads: 8 pow2 slopes then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5
    torch.testing.assert_close(alibi_slopes(12)[8:], torch.tensor([2.0**-x for x in (0.5, 1.5, 2.5, 3.5)]))


def closed_form_alibi_slopes(n_heads):
    """Slope of head h (0-based) in closed form, float64: with n the largest power of two <= n_heads,
    2^(-8 (h + 1) / n) for h < n, else 2^(-4 (2 (h - n) + 1) / n) (the odd slopes of the 2n-head set)."""
    n = 1 << (n_heads.bit_length() - 1)
    return [2.0 ** (-8.0 * (h + 1) / n) if h < n else 2.0 ** (-4.0 * (2 * (h - n) + 1) / n) for h in range(n_heads)]


@pytest.mark.parametrize("n_heads", [1, 2, 4, 8, 16, 32, 64, 3, 6, 12, 20, 24, 40, 48, 96])
def test_alibi_slopes_closed_form(n_heads):
    """The oracle's slopes against the closed form (independent of both its code and the paper's recursion)."""
    want = torch.tensor(closed_form_alibi_slopes(n_heads), dtype=torch.float64)
    got = alibi_slopes(n_heads)
    assert got.dtype == torch.float32 and got.shape == (n_heads,)
    torch.testing.assert_close(got.double(), want, rtol=2.0**-23, atol=0)  # float32 rounding only
    n = 1 << (n_heads.bit_length() - 1)
    ratio = got[1:n].double() / got[: n - 1].double()  # the first n: geometric, ratio 2^(-8/n)
    torch.testing.assert_close(ratio, torch.full_like(ratio, 2.0 ** (-8.0 / n)), rtol=1e-6, atol=0)


@pytest.mark.parametrize("n_heads", [1, 2, 3, 6, 8, 12, 20, 32, 40, 64, 96])
def test_product_alibi_slopes_agree_with_the_oracle(n_heads):
    """The kernels' slopes (``planning.alibi``, FlashInfer's ``get_alibi_slopes``) are computed apart from the
    oracle's; both must give the closed form."""
    from cutedsl_attn.planning.alibi import get_alibi_slopes

    got = get_alibi_slopes(n_heads)
    assert got.dtype == torch.float32 and got.shape == (n_heads,)
    torch.testing.assert_close(got, alibi_slopes(n_heads), rtol=2.0**-23, atol=0)
    torch.testing.assert_close(got.double(), torch.tensor(closed_form_alibi_slopes(n_heads), dtype=torch.float64),
                               rtol=2.0**-23, atol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_alibi_vs_naive(causal):
    q, k, v = rand_qkv(4, 9, 6, 3, 8, seed=13)
    o, lse = check(q, k, v, pos_encoding_mode="ALIBI", causal=causal)
    # ALiBi bias is row-constant-shifted vs slope*j: output identical, LSE differs
    slopes = alibi_slopes(6).double()
    j = torch.arange(9, dtype=torch.float64)
    logits = torch.einsum("ihd,jhd->hij", q, k.repeat_interleave(2, 1)) / math.sqrt(8)
    logits = logits + slopes[:, None, None] * j
    if causal:
        keep = j[None, :] <= torch.arange(4)[:, None] + 5
        logits = logits.masked_fill(~keep[None], NEG_INF)
    p = torch.softmax(logits, -1)
    o2 = torch.einsum("hij,jhd->ihd", p, v.repeat_interleave(2, 1))
    torch.testing.assert_close(o, o2, atol=1e-12, rtol=0)


def test_alibi_with_soft_cap_order():
    # documented order: sm_scale -> soft cap -> + ALiBi bias
    q, k, v = rand_qkv(3, 5, 2, 2, 4, seed=14, scale=3.0)
    check(q, k, v, pos_encoding_mode="ALIBI", logits_soft_cap=2.0, causal=True)


def test_apply_rope_llama_vs_complex():
    g = torch.Generator().manual_seed(15)
    x = torch.randn(2, 5, 3, 8, generator=g, dtype=torch.float64)  # [batch, n, H, D]
    pos = torch.tensor([0, 1, 7, 100, -3])
    for scale, theta in ((1.0, 1e4), (2.0, 5e5), (0.5, 100.0)):
        got = apply_rope_llama(x, pos, rope_scale=scale, rope_theta=theta)
        want = torch.tensor(
            [
                [
                    [naive_rope(x[b, t, h].tolist(), pos[t].item(), scale, theta) for h in range(3)]
                    for t in range(5)
                ]
                for b in range(2)
            ],
            dtype=torch.float64,
        )
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    # position 0 is the identity; norms are preserved
    torch.testing.assert_close(apply_rope_llama(x, pos)[:, 0], x[:, 0], atol=0, rtol=0)
    torch.testing.assert_close(apply_rope_llama(x, pos).norm(dim=-1), x.norm(dim=-1))
    # float32 keeps dtype
    assert apply_rope_llama(x.float(), pos).dtype == torch.float32


@pytest.mark.parametrize("qo_len,kv_len", [(4, 9), (5, 5), (6, 3)])
def test_rope_vs_naive(qo_len, kv_len):
    q, k, v = rand_qkv(qo_len, kv_len, 4, 2, 8, seed=16)
    check(q, k, v, pos_encoding_mode="ROPE_LLAMA", causal=True)
    check(q, k, v, pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=500.0)


def test_rope_relative_position_invariance():
    # shifting all positions (here: prepending keys that are masked out) keeps q.k of
    # the rotated pair a function of (i_abs - j) only
    q, k, v = rand_qkv(1, 4, 1, 1, 8, seed=17)
    o1, _ = attention(q, k, v, pos_encoding_mode="ROPE_LLAMA")
    pad = torch.randn(3, 1, 8, dtype=torch.float64)
    mask = torch.tensor([[False] * 3 + [True] * 4])
    k2 = torch.cat([pad, k])
    v2 = torch.cat([pad, v])
    # custom mask hides the pad; positions of real keys shift by 3 and so does the query
    o2, _ = attention(q, k2, v2, pos_encoding_mode="ROPE_LLAMA", custom_mask=mask)
    torch.testing.assert_close(o1, o2, atol=1e-12, rtol=0)


def test_custom_mask_overrides_causal():
    q, k, v = rand_qkv(4, 6, 2, 1, 8, seed=18)
    g = torch.Generator().manual_seed(19)
    mask = torch.rand(4, 6, generator=g) < 0.5
    mask[2] = False  # an empty row
    mask[0, 5] = True  # a key above the causal diagonal
    o, lse = check(q, k, v, custom_mask=mask, causal=True)
    o2, lse2 = attention(q, k, v, custom_mask=mask, causal=False)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    assert torch.equal(o[2], torch.zeros_like(o[2])) and torch.isneginf(lse[2]).all()
    # window still applies on top of a custom mask
    check(q, k, v, custom_mask=mask, window_left=1)


@pytest.mark.parametrize("sm_scale", [0.05, 1.0, 2.5])
def test_sm_scale(sm_scale):
    q, k, v = rand_qkv(3, 5, 2, 2, 16, seed=20)
    check(q, k, v, sm_scale=sm_scale, causal=True)


def test_default_sm_scale_and_dvo():
    q, k, v = rand_qkv(3, 5, 2, 1, 16, dv=6, seed=21)
    a = attention(q, k, v)
    b = attention(q, k, v, sm_scale=0.25)
    assert torch.equal(a[0], b[0]) and a[0].shape == (3, 2, 6)
    check(q, k, v)


def test_lse_base2_equals_torch_logsumexp():
    q, k, v = rand_qkv(5, 7, 4, 2, 8, seed=22)
    _, lse = attention(q, k, v, causal=True, sm_scale=0.7)
    s = torch.einsum("ihd,jhd->ihj", q, k.repeat_interleave(2, 1)) * 0.7
    i = torch.arange(5)[:, None, None]
    j = torch.arange(7)[None, None, :]
    s = s.masked_fill(j > i + 2, NEG_INF)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1) * math.log2(math.e), atol=1e-12, rtol=0)


def test_extreme_negative_logits_dominate_masked():
    q = torch.full((1, 1, 4), 100.0, dtype=torch.float64)
    k = torch.full((2, 1, 4), -150.0, dtype=torch.float64)
    v = torch.tensor([[[1.0]], [[3.0]]], dtype=torch.float64)
    o, lse = attention(q, k, v, sm_scale=1.0, custom_mask=torch.tensor([[True, False]]))
    assert o.item() == 1.0 and lse.item() == pytest.approx(-60000 * LOG2E)


def test_float32_dtype_and_half_inputs():
    q, k, v = rand_qkv(3, 5, 2, 2, 8, seed=23)
    o32, l32 = attention(q.half(), k.half(), v.half(), dtype=torch.float32)
    assert o32.dtype == torch.float32 and l32.dtype == torch.float32
    o64, l64 = attention(q.half(), k.half(), v.half())
    torch.testing.assert_close(o32.double(), o64, atol=1e-5, rtol=1e-5)


def test_attention_errors():
    q, k, v = rand_qkv(2, 3, 4, 2, 8)
    with pytest.raises(KeyError, match="pos_encoding_mode"):
        attention(q, k, v, pos_encoding_mode="ROPE")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        attention(q, k[:, :1].expand(3, 3, 8).contiguous(), v[:, :1].expand(3, 3, 8).contiguous())
    with pytest.raises(ValueError, match="head_dim_qk"):
        attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match="kv_len"):
        attention(q, k, v[:2])
    with pytest.raises(ValueError, match="3-D"):
        attention(q[0], k, v)
    with pytest.raises(TypeError, match="floating"):
        attention(q.long(), k, v)
    with pytest.raises(TypeError, match="bool"):
        attention(q, k, v, custom_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="custom_mask"):
        attention(q, k, v, custom_mask=torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="sinks"):
        attention(q, k, v, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="window_left"):
        attention(q, k, v, window_left=-2)
    with pytest.raises(TypeError, match="dtype"):
        attention(q, k, v, dtype=torch.float16)
    with pytest.raises(ValueError, match="even"):
        attention(q[..., :7], k[..., :7], v, pos_encoding_mode="ROPE_LLAMA")


# ----------------------------------------------------------------------------------
# hypothesis: random shapes / masks / options vs naive
# ----------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    qo_len=st.integers(0, 5),
    kv_len=st.integers(0, 7),
    hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 3]),
    d=st.sampled_from([2, 4, 6]),
    dv=st.sampled_from([1, 3, 4]),
    causal=st.booleans(),
    window_left=st.sampled_from([-1, 0, 1, 3]),
    cap=st.sampled_from([None, 0.0, 0.7, 4.0]),
    sm_scale=st.sampled_from([None, 0.3, 1.7]),
    use_sinks=st.booleans(),
    pos=st.sampled_from(["NONE", "ALIBI", "ROPE_LLAMA"]),
    mask_mode=st.sampled_from(["none", "random"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_vs_naive(
    qo_len, kv_len, hkv, group, d, dv, causal, window_left, cap, sm_scale, use_sinks, pos, mask_mode, seed
):
    hq = hkv * group
    q, k, v = rand_qkv(qo_len, kv_len, hq, hkv, d, dv=dv, seed=seed, scale=1.5)
    g = torch.Generator().manual_seed(seed + 1)
    sinks = torch.randn(hq, generator=g) if use_sinks else None
    mask = torch.rand(qo_len, kv_len, generator=g) < 0.6 if mask_mode == "random" else None
    kw = dict(
        causal=causal,
        window_left=window_left,
        logits_soft_cap=cap,
        sm_scale=sm_scale,
        sinks=sinks,
        pos_encoding_mode=pos,
        custom_mask=mask,
    )
    if pos == "ROPE_LLAMA":
        kw.update(rope_scale=1.5, rope_theta=50.0)
    assert_matches(attention(q, k, v, **kw), naive_attention(q, k, v, **kw))


# ----------------------------------------------------------------------------------
# paged decode / page tables
# ----------------------------------------------------------------------------------
def build_paged(kv_lens, hkv, d, dv, page_size, seed=0, spare_pages=3):
    """Scatter random per-request K/V into a shuffled NHD page pool (unused slots NaN)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    npages = [(n + page_size - 1) // page_size for n in kv_lens]
    total = sum(npages) + spare_pages
    perm = list(range(total))
    rng.shuffle(perm)
    k_cache = torch.full((total, page_size, hkv, d), float("nan"), dtype=torch.float64)
    v_cache = torch.full((total, page_size, hkv, dv), float("nan"), dtype=torch.float64)
    ks, vs, indices, indptr, last = [], [], [], [0], []
    p = 0
    for n, npg in zip(kv_lens, npages):
        kb = torch.randn(n, hkv, d, generator=g, dtype=torch.float64)
        vb = torch.randn(n, hkv, dv, generator=g, dtype=torch.float64)
        ks.append(kb)
        vs.append(vb)
        pages = perm[p : p + npg]
        p += npg
        for t in range(n):
            k_cache[pages[t // page_size], t % page_size] = kb[t]
            v_cache[pages[t // page_size], t % page_size] = vb[t]
        indices += pages
        indptr.append(indptr[-1] + npg)
        last.append(n - (npg - 1) * page_size if npg else 0)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return k_cache, v_cache, ks, vs, i32(indptr), i32(indices), i32(last)


def cache_forms(k_cache, v_cache, page_size):
    """All accepted (layout, k_arg, v_arg) forms of the same paged cache."""
    k_hnd = k_cache.transpose(1, 2).contiguous()
    v_hnd = v_cache.transpose(1, 2).contiguous()
    forms = [
        ("NHD", k_cache, v_cache),
        ("HND", k_hnd, v_hnd),
        ("NHD", (k_cache, v_cache), None),
        ("HND", (k_hnd, v_hnd), None),
        # non-contiguous HND view of NHD storage
        ("HND", k_cache.transpose(1, 2), v_cache.transpose(1, 2)),
    ]
    if k_cache.shape[-1] == v_cache.shape[-1]:
        forms += [
            ("NHD", torch.stack([k_cache, v_cache], dim=1), None),
            ("HND", torch.stack([k_hnd, v_hnd], dim=1), None),
        ]
        if page_size == 1:
            forms += [
                ("NHD", torch.stack([k_cache, v_cache], dim=1)[:, :, 0], None),
                ("HND", torch.stack([k_hnd, v_hnd], dim=1)[:, :, :, 0], None),
            ]
    if page_size == 1:
        forms += [("NHD", k_cache[:, 0], v_cache[:, 0]), ("HND", k_hnd[:, :, 0], v_hnd[:, :, 0])]
    return forms


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_decode_layouts(page_size):
    kv_lens = [5, 0, 17, 1, 16]
    hq, hkv, d = 4, 2, 8
    kc, vc, ks, vs, indptr, indices, last = build_paged(kv_lens, hkv, d, d, page_size, seed=page_size)
    q = torch.randn(len(kv_lens), hq, d, dtype=torch.float64)
    sinks = torch.tensor([0.1, -0.3, 0.0, 1.0])
    want = [attention(q[b : b + 1], ks[b], vs[b], sinks=sinks, window_left=6) for b in range(len(kv_lens))]
    o_want = torch.cat([w[0] for w in want])
    l_want = torch.cat([w[1] for w in want])
    for layout, ka, va in cache_forms(kc, vc, page_size):
        o, lse = paged_decode(q, ka, va, indptr, indices, last, kv_layout=layout, sinks=sinks, window_left=6)
        assert o.shape == (5, hq, d) and lse.shape == (5, hq)
        assert not torch.isnan(o).any()
        torch.testing.assert_close(o, o_want, atol=1e-12, rtol=0)
        torch.testing.assert_close(lse, l_want, atol=1e-12, rtol=0)
    # empty request (index 1): o = 0 and lse = sink * log2 e
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    torch.testing.assert_close(lse[1], sinks.double() * LOG2E)


def test_paged_decode_vs_naive_positions():
    # decode query sits at position kv_len - 1 (matters for ALiBi / RoPE LSE)
    kv_lens = [4, 0, 7]
    kc, vc, ks, vs, indptr, indices, last = build_paged(kv_lens, 1, 4, 4, 3, seed=30)
    q = torch.randn(3, 2, 4, dtype=torch.float64)
    for pos in ("ALIBI", "ROPE_LLAMA"):
        o, lse = paged_decode(q, kc, vc, indptr, indices, last, pos_encoding_mode=pos, logits_soft_cap=3.0)
        for b in range(3):
            assert_matches((o[b : b + 1], lse[b : b + 1]),
                           naive_attention(q[b : b + 1], ks[b], vs[b], pos_encoding_mode=pos, logits_soft_cap=3.0))
    assert torch.isneginf(lse[1]).all() and torch.equal(o[1], torch.zeros_like(o[1]))


def test_paged_decode_errors():
    kc, vc, ks, vs, indptr, indices, last = build_paged([4, 2], 1, 4, 4, 3, seed=31)
    q = torch.randn(2, 2, 4, dtype=torch.float64)
    with pytest.raises(KeyError, match="kv_layout"):
        paged_decode(q, kc, vc, indptr, indices, last, kv_layout="NDH")
    with pytest.raises(ValueError, match="kv_last_page_len"):
        paged_decode(q, kc, vc, indptr, indices, torch.tensor([4, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_last_page_len"):
        paged_decode(q, kc, vc, indptr, indices, torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="0 pages"):
        paged_decode(q, kc, vc, torch.tensor([0, 0, 3], dtype=torch.int32), indices, last)
    with pytest.raises(ValueError, match="out of range"):
        paged_decode(q, kc, vc, indptr, indices + 100, last)
    with pytest.raises(ValueError, match="batch_size"):
        paged_decode(q[:1], kc, vc, indptr, indices, last)
    with pytest.raises(TypeError, match="integer"):
        paged_decode(q, kc, vc, indptr.float(), indices, last)
    with pytest.raises(TypeError, match="unexpected keyword"):
        paged_decode(q, kc, vc, indptr, indices, last, causa=True)
    with pytest.raises(ValueError, match="5-D"):
        paged_decode(q, torch.stack([kc, vc, vc], 1), None, indptr, indices, last)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_block_tables_csr_round_trip(page_size):
    rng = random.Random(page_size)
    seq_lens = [0, 1, page_size, page_size + 1, 3 * page_size, 40]
    max_pages = max((n + page_size - 1) // page_size for n in seq_lens) + 2
    table = torch.tensor([[rng.randrange(1000) for _ in range(max_pages)] for _ in seq_lens], dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    indptr, indices, last = block_tables_to_csr(table, sl, page_size)
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    for b, n in enumerate(seq_lens):
        npg = (n + page_size - 1) // page_size
        assert indptr[b + 1] - indptr[b] == npg
        assert indices[indptr[b] : indptr[b + 1]].tolist() == table[b, :npg].tolist()
        assert last[b] == (0 if n == 0 else n - (npg - 1) * page_size)
        assert (last[b] == 0) == (n == 0) and last[b] <= page_size
    table2, sl2 = csr_to_block_tables(indptr, indices, last, page_size)
    assert sl2.dtype == torch.int32 and sl2.tolist() == seq_lens
    for b, n in enumerate(seq_lens):
        npg = (n + page_size - 1) // page_size
        assert table2[b, :npg].tolist() == table[b, :npg].tolist()
    assert [t.tolist() for t in block_tables_to_csr(table2, sl2, page_size)] == [
        t.tolist() for t in (indptr, indices, last)
    ]
    with pytest.raises(ValueError, match="columns"):
        block_tables_to_csr(table[:, :1], sl, page_size)


# ----------------------------------------------------------------------------------
# ragged / paged prefill vs per-request attention
# ----------------------------------------------------------------------------------
def _segments(lens):
    ptr = [0]
    for n in lens:
        ptr.append(ptr[-1] + n)
    return ptr


@pytest.mark.parametrize("use_mask", [False, True])
def test_ragged_prefill(use_mask):
    qo_lens, kv_lens = [3, 0, 5, 4], [6, 2, 3, 0]
    hq, hkv, d, dv = 4, 2, 8, 5
    qp, kp = _segments(qo_lens), _segments(kv_lens)
    g = torch.Generator().manual_seed(40)
    q = torch.randn(qp[-1], hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(kp[-1], hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(kp[-1], hkv, dv, generator=g, dtype=torch.float64)
    masks = [torch.rand(a, b, generator=g) < 0.5 for a, b in zip(qo_lens, kv_lens)]
    flat = torch.cat([m.flatten() for m in masks]) if use_mask else None
    kw = dict(causal=True, pos_encoding_mode="ALIBI", logits_soft_cap=8.0)
    o, lse = ragged_prefill(
        q, k, v, torch.tensor(qp, dtype=torch.int32), torch.tensor(kp, dtype=torch.int32), custom_mask=flat, **kw
    )
    assert o.shape == (qp[-1], hq, dv) and lse.shape == (qp[-1], hq)
    for b in range(4):
        ob, lb = attention(
            q[qp[b] : qp[b + 1]], k[kp[b] : kp[b + 1]], v[kp[b] : kp[b + 1]],
            custom_mask=masks[b] if use_mask else None, **kw,
        )
        assert torch.equal(o[qp[b] : qp[b + 1]], ob) and torch.equal(lse[qp[b] : qp[b + 1]], lb)
    # request 2 (qo 5 > kv 3, causal): two empty rows; request 3: empty kv
    if not use_mask:
        assert torch.isneginf(lse[qp[2] : qp[2] + 2]).all()
    assert torch.isneginf(lse[qp[3] : qp[4]]).all()
    with pytest.raises(ValueError, match="custom_mask"):
        ragged_prefill(q, k, v, torch.tensor(qp), torch.tensor(kp), custom_mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="qo_indptr"):
        ragged_prefill(q[:-1], k, v, torch.tensor(qp), torch.tensor(kp))


@pytest.mark.parametrize("page_size", [1, 4])
def test_paged_prefill(page_size):
    qo_lens, kv_lens = [2, 5, 1, 3], [7, 3, 0, 9]
    hq, hkv, d = 4, 1, 8
    kc, vc, ks, vs, indptr, indices, last = build_paged(kv_lens, hkv, d, d, page_size, seed=50 + page_size)
    qp = _segments(qo_lens)
    g = torch.Generator().manual_seed(51)
    q = torch.randn(qp[-1], hq, d, generator=g, dtype=torch.float64)
    masks = [torch.rand(a, b, generator=g) < 0.7 for a, b in zip(qo_lens, kv_lens)]
    flat = torch.cat([m.flatten() for m in masks])
    qo_indptr = torch.tensor(qp, dtype=torch.int32)
    for kw, per_mask in (
        (dict(causal=True, window_left=2, pos_encoding_mode="ROPE_LLAMA"), False),
        (dict(custom_mask=flat, sinks=torch.ones(hq)), True),
    ):
        want = []
        for b in range(4):
            kwb = {x: y for x, y in kw.items() if x != "custom_mask"}
            if per_mask:
                kwb["custom_mask"] = masks[b]
            want.append(attention(q[qp[b] : qp[b + 1]], ks[b], vs[b], **kwb))
        o_want = torch.cat([w[0] for w in want])
        l_want = torch.cat([w[1] for w in want])
        for layout, ka, va in cache_forms(kc, vc, page_size)[:4]:
            o, lse = paged_prefill(q, ka, va, qo_indptr, indptr, indices, last, kv_layout=layout, **kw)
            torch.testing.assert_close(o, o_want, atol=1e-12, rtol=0)
            torch.testing.assert_close(lse, l_want, atol=1e-12, rtol=0)
    # decode == prefill with one query row per request
    qd = torch.randn(4, hq, d, dtype=torch.float64)
    a = paged_decode(qd, kc, vc, indptr, indices, last, window_left=3)
    b = paged_prefill(qd, kc, vc, torch.arange(5, dtype=torch.int32), indptr, indices, last, window_left=3, causal=True)
    torch.testing.assert_close(a[0], b[0], atol=0, rtol=0)
    torch.testing.assert_close(a[1], b[1], atol=0, rtol=0)


# ----------------------------------------------------------------------------------
# score_mod (this package's extension, FlashAttention-4 style)
# ----------------------------------------------------------------------------------
def _rel_bias(score, b, h, i, j):
    """Python arithmetic only: the same function serves python scalars (naive), torch tensors (oracle) and
    CuTe DSL scalars (kernels)."""
    return score - 0.05 * (i - j) + 0.1 * h - 0.3 * b


@pytest.mark.parametrize("causal,window_left", [(False, -1), (True, -1), (True, 5)])
def test_score_mod_vs_naive(causal, window_left):
    """The oracle's score_mod (one call on broadcasting tensors) against the naive per-score python call, with
    the masks applied after it, GQA, qo < kv and a batch index."""
    q, k, v = rand_qkv(7, 19, 4, 2, 16, seed=3)
    for b in (0, 3):
        got = attention(q, k, v, causal=causal, window_left=window_left, score_mod=_rel_bias, batch_idx=b)
        want = naive_attention(q, k, v, causal=causal, window_left=window_left, score_mod=_rel_bias, batch_idx=b)
        assert_matches(got, want)


def test_score_mod_as_alibi():
    """A score_mod adding FlashInfer's ALiBi bias equals pos_encoding_mode="ALIBI" (independent slopes), qo < kv:
    q_idx is the query's bottom-right position."""
    q, k, v = rand_qkv(6, 11, 8, 2, 16, seed=4)
    slopes = torch.tensor(naive_alibi_slopes(8), dtype=torch.float64)

    def alibi(score, b, h, i, j):
        return score + slopes[h] * (j - i)  # i: the query's bottom-right position

    assert_matches(attention(q, k, v, causal=True, score_mod=alibi),
                   attention(q, k, v, causal=True, pos_encoding_mode="ALIBI"))


def test_score_mod_batch_index_and_minus_inf():
    """ragged_prefill passes each request's index: a per-request constant leaves O unchanged and shifts the LSE
    by constant * log2(e); a score_mod returning -inf hides keys like a mask (rows left with none: O 0, LSE -inf)."""
    q, k, v = rand_qkv(12, 20, 2, 1, 8, seed=5)
    qo_indptr, kv_indptr = torch.tensor([0, 5, 5, 12]), torch.tensor([0, 8, 13, 20])
    o0, lse0 = ragged_prefill(q, k, v, qo_indptr, kv_indptr, causal=True)
    o1, lse1 = ragged_prefill(q, k, v, qo_indptr, kv_indptr, causal=True,
                              score_mod=lambda s, b, h, i, j: s + 0.7 * b)
    torch.testing.assert_close(o1, o0, atol=1e-12, rtol=1e-12)
    shift = torch.tensor([0.0] * 5 + [2 * 0.7 * LOG2E] * 7, dtype=torch.float64)[:, None]
    torch.testing.assert_close(lse1, lse0 + shift, atol=1e-12, rtol=1e-12)
    # keys more than 2 behind the query's (bottom-right) position hidden through the score_mod = window_left=2
    def far(s, b, h, i, j):
        return torch.where(i - j > 2, float("-inf"), s)

    o2, lse2 = attention(q, k, v, causal=True, score_mod=far)
    assert_matches((o2, lse2), attention(q, k, v, causal=True, window_left=2))
    with pytest.raises(TypeError, match="score_mod"):
        attention(q, k, v, score_mod=3)


def test_score_mod_integer_indices_in_float64():
    """The oracle's indices are int64 (bitwise operators work) and a python-float bias on them is float64."""
    q, k, v = rand_qkv(5, 9, 2, 1, 8, seed=6)
    seen = {}

    def mod(s, b, h, i, j):
        seen["dtypes"] = (b.dtype, h.dtype, i.dtype, j.dtype)
        bias = 1e-9 * (j - i) + 0.25 * (j & 1)
        seen["bias"] = bias.dtype
        return s + bias

    assert_matches(attention(q, k, v, causal=True, score_mod=mod),
                   naive_attention(q, k, v, causal=True, score_mod=lambda s, b, h, i, j: s + 1e-9 * (j - i) + 0.25 * (j & 1)))
    assert seen["dtypes"] == (torch.int64,) * 4 and seen["bias"] == torch.float64
    assert torch.get_default_dtype() == torch.float32  # restored
