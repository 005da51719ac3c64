"""GPU tests of the SM90 chunked KDA / GDN-2 kernel (:mod:`cutedsl_attn.sm90.kda_chunked`), launched directly,
against the float64 oracles of ``cutedsl_attn.ref.delta_family`` and against the portable chunked per-channel
kernel (the same prep kernel and the same 16-bit roundings: the two agree closely).  Needs an SM90 GPU.

Fresh random inputs every run; outputs and written states NaN-poisoned before each launch.
"""

import dataclasses
import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the SM90 chunked KDA kernel needs an SM90 GPU", allow_module_level=True)

from cutedsl_attn.compile import get_compiled, target_arch  # noqa: E402
from cutedsl_attn.planning.gdn import (  # noqa: E402
    FLAG_HAS_BETA, FLAG_HAS_G, FLAG_HAS_INITIAL_STATE, FLAG_INITIAL_INDICES, FLAG_OUTPUT_INDICES, FLAG_WRITE_STATE,
    GdnArgs, GdnProblem,
)
from cutedsl_attn.portable import kda_chunked as chk  # noqa: E402
from cutedsl_attn.ref import delta_family as rd  # noqa: E402
from cutedsl_attn.sm90 import kda_chunked as kda90  # noqa: E402
# the portable kernel's GPU test helpers (pytest puts tests/ on sys.path): the same inputs and oracle
from test_kda_chunked_gpu import LENS, NAN, TOL_O, TOL_S16, TOL_SC, cu_of, inputs, oracle, rel  # noqa: E402

DEV = torch.device("cuda")


def run_direct(module, d, *, h0=None, ht=None, h0_idx=None, ht_idx=None, l2norm=True, state_dtype="float32",
               tiles=None):
    """Launch ``module``'s kernel straight (compile cache, ``module.launch``); returns the NaN-poisoned, written
    output."""
    q, k, v = d["q"], d["k"], d["v"]
    T, hq, K = q.shape
    hk, hv, V = k.shape[1], v.shape[1], v.shape[2]
    ho = max(hq, hv)
    gdn2 = "b" in d
    p = GdnProblem(dtype="bfloat16" if q.dtype == torch.bfloat16 else "float16", head_dim_k=K, head_dim_v=V,
                   state_dtype=state_dtype, gate_domain="log", use_qk_l2norm=l2norm, gate_per_channel=True,
                   erase_write_gates=gdn2, arch=target_arch(DEV))
    cfg = module.Config(p, tiles or module.default_tiles(p, num_sms=132, chains=(d["cu"].shape[0] - 1) * ho))
    fn = get_compiled(module.NAME, cfg, module.compile)
    sdt = torch.float32 if state_dtype == "float32" else torch.bfloat16
    dummy_s = torch.empty(1, ho, V, K, device=DEV, dtype=sdt)
    i32 = torch.empty(1, device=DEV, dtype=torch.int32)
    beta = torch.cat([d["b"], d["w"]], -1).contiguous() if gdn2 else d["beta"].contiguous()
    flags = (FLAG_HAS_G | FLAG_HAS_BETA | (FLAG_HAS_INITIAL_STATE if h0 is not None else 0)
             | (FLAG_WRITE_STATE if ht is not None else 0) | (FLAG_INITIAL_INDICES if h0_idx is not None else 0)
             | (FLAG_OUTPUT_INDICES if ht_idx is not None else 0))
    out = torch.full((T, ho, V), NAN, device=DEV, dtype=q.dtype)
    args = GdnArgs(q, k, v, d["g"].contiguous(), beta, d["cu"], h0 if h0 is not None else dummy_s,
                   h0_idx if h0_idx is not None else i32, ht if ht is not None else dummy_s,
                   ht_idx if ht_idx is not None else i32, out, 1.0 / math.sqrt(K), ho // hq, ho // hk, ho // hv,
                   flags)
    module.launch(fn, cfg, args)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("gate", ["mild", "strong", "huge", "inf"])
@pytest.mark.parametrize("mode", ["kda", "gdn2"])
def test_vs_oracle_and_portable_varlen(mode, gate):
    heads = (2, 2, 4) if mode == "kda" else (4, 2, 2)  # KDA: GVA; GDN-2: GQA
    d = inputs(LENS, *heads, gate=gate, gdn2=mode == "gdn2")
    n, ho = len(LENS), max(heads[0], heads[2])
    h0 = torch.randn(n, ho, 128, 128, device=DEV) * 0.1
    o_ref, s_ref = oracle(d, h0)
    ht = torch.full_like(h0, NAN)
    o = run_direct(kda90, d, h0=h0, ht=ht)
    assert rel(o, o_ref) < TOL_O and rel(ht, s_ref) < TOL_SC
    assert torch.equal(ht[0], h0[0])  # a zero-length sequence: final state = initial state
    assert rel(ht.transpose(-1, -2), s_ref) > 0.1  # a transposed state is far off: the check is not vacuous
    ht_p = torch.full_like(h0, NAN)
    o_p = run_direct(chk, d, h0=h0, ht=ht_p)
    assert rel(o, o_p) < TOL_O / 2 and rel(ht, ht_p) < TOL_SC / 2


@pytest.mark.parametrize("tiles", [(64, 2), (64, 3), (128, 2), (128, 3)])
@pytest.mark.parametrize("mode", ["kda", "gdn2"])
def test_tiles(mode, tiles):
    lens = LENS + [130]
    d = inputs(lens, 2, 2, 4, gate="strong", gdn2=mode == "gdn2")
    h0 = torch.randn(len(lens), 4, 128, 128, device=DEV) * 0.1
    o_ref, s_ref = oracle(d, h0)
    ht = torch.full_like(h0, NAN)
    o = run_direct(kda90, d, h0=h0, ht=ht, tiles=kda90.Tiles(tile_v=tiles[0], num_stages=tiles[1]))
    assert rel(o, o_ref) < TOL_O and rel(ht, s_ref) < TOL_SC


def _assert_prep_variants_agree(gate, tiles, K=128, V=128, gdn2=False, dtype=torch.bfloat16, l2norm=True):
    """Each of ``tiles`` (prep variants of one main kernel) gives exactly the first one's outputs and final state
    on a ragged batch with an initial state, and the last one is within tolerance of the float64 oracle."""
    lens = [0, 1, 64, 65, 1000]
    d = inputs(lens, 2, 2, 4, K=K, V=V, gate=gate, gdn2=gdn2, dtype=dtype)
    if not l2norm:  # bounded rows without the kernel's l2norm
        d["k"] = (d["k"].float() / d["k"].float().norm(dim=-1, keepdim=True)).to(dtype)
        d["q"] = (d["q"].float() / math.sqrt(K)).to(dtype)
    h0 = torch.randn(len(lens), 4, V, K, device=DEV) * 0.1
    outs = []
    for t in tiles:
        ht = torch.full_like(h0, NAN)
        outs.append((run_direct(kda90, d, h0=h0, ht=ht, tiles=t, l2norm=l2norm), ht))
    for o, ht in outs[1:]:
        assert torch.equal(outs[0][0], o) and torch.equal(outs[0][1], ht)
    o_ref, s_ref = oracle(d, h0, l2norm=l2norm)
    assert rel(outs[-1][0], o_ref) < TOL_O and rel(outs[-1][1], s_ref) < TOL_SC


@pytest.mark.parametrize("gate", ["safe", "strong"])
def test_compact_prep_layout_equals_the_wide_one(gate):
    """``prep_ctas=3`` (the compact prep layout, three CTAs an SM) gives exactly the outputs of ``prep_ctas=2``."""
    _assert_prep_variants_agree(gate, [kda90.Tiles(tile_v=64, prep_ctas=pc) for pc in (2, 3)])


@pytest.mark.parametrize("prep_ctas", [2, 3])
@pytest.mark.parametrize("gate", ["safe", "strong"])
def test_rolled_prep_equals_the_unrolled_one(gate, prep_ctas):
    """``prep_rolled=1`` (the prep's column and output phases as run-time loops) and 2 (the other long phases as
    well) give exactly the outputs of the unrolled prep: the same per-element operations in the same order;
    "strong" gates reach the direct diagonal blocks."""
    _assert_prep_variants_agree(gate, [kda90.Tiles(tile_v=64, prep_ctas=prep_ctas, prep_rolled=r) for r in (0, 1, 2)])


@pytest.mark.parametrize("case,prep_ctas", [("gdn2", 2), ("fp16_k64", 2), ("fp16_k64", 3), ("no_l2norm", 2),
                                            ("no_l2norm", 3)])
def test_rolled2_prep_equals_rolled1_other_problems(case, prep_ctas):
    """``prep_rolled=2`` against 1, bit-exact, where its rolled phases take other paths: GDN-2's erase / write
    gates (loaded per channel in the gate step), fp16 at K = V = 64 (the direct diagonal blocks always), and
    no l2norm (the normaliser step off); the compact layout (its q rows restored from the normalisers) for the
    last two (GDN-2 takes the two-CTA layout only)."""
    kw = dict(gdn2=dict(gdn2=True), fp16_k64=dict(K=64, V=64, dtype=torch.float16), no_l2norm=dict(l2norm=False))
    tiles = [kda90.Tiles(tile_v=64, prep_ctas=prep_ctas, prep_rolled=r) for r in (1, 2)]
    _assert_prep_variants_agree("strong", tiles, **kw[case])


@pytest.mark.parametrize("gate", ["mild", "strong"])
def test_fp16(gate):
    d = inputs([1, 64, 65, 1000], 2, 2, 2, gate=gate, dtype=torch.float16)
    h0 = torch.randn(4, 2, 128, 128, device=DEV) * 0.1
    o_ref, s_ref = oracle(d, h0)
    ht = torch.full_like(h0, NAN)
    o = run_direct(kda90, d, h0=h0, ht=ht)
    assert rel(o, o_ref) < TOL_O and rel(ht, s_ref) < TOL_SC


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dims", [(128, 128), (64, 64), (64, 128), (128, 64)])
def test_pools_in_place_no_l2norm(state_dtype, dims):
    K, V = dims
    lens = [65, 0, 300, 16, 4097]
    d = inputs(lens, 2, 2, 4, K=K, V=V)
    d["k"] = (d["k"].float() / d["k"].float().norm(dim=-1, keepdim=True)).bfloat16()  # bounded without l2norm
    d["q"] = (d["q"].float() / math.sqrt(K)).bfloat16()
    sdt = torch.float32 if state_dtype == "float32" else torch.bfloat16
    pool = (torch.randn(9, 4, V, K, device=DEV) * 0.1).to(sdt)
    idx = torch.tensor([7, 2, 0, 5, 8], device=DEV, dtype=torch.int32)
    before = pool.clone()
    o_ref, s_ref = oracle(d, pool[idx.long()].double(), l2norm=False)
    o = run_direct(kda90, d, h0=pool, ht=pool, h0_idx=idx, ht_idx=idx, l2norm=False, state_dtype=state_dtype)
    tol_s = TOL_SC if state_dtype == "float32" else TOL_S16
    assert rel(o, o_ref) < TOL_O and rel(pool[idx.long()], s_ref) < tol_s
    others = [r for r in range(9) if r not in idx.tolist()]
    assert torch.equal(pool[others], before[others])  # rows no sequence owns stay untouched
    assert torch.equal(pool[2], before[2])  # the zero-length sequence's row: its initial state, rewritten as is


def test_no_initial_state_and_zero_gate_is_ungated():
    lens = [130, 64, 17]
    d = inputs(lens, 2, 2, 2, gdn2=True)
    d["g"] = torch.zeros_like(d["g"])
    o_ref, s_ref = oracle(d, None)
    ht = torch.full((3, 2, 128, 128), NAN, device=DEV)
    o = run_direct(kda90, d, ht=ht)
    assert rel(o, o_ref) < TOL_O and rel(ht, s_ref) < TOL_SC
    ungated = rd.chunk_gated_delta_rule2(d["q"], d["k"], d["v"], None, d["b"], d["w"], cu_seqlens=d["cu"],
                                         use_qk_l2norm_in_kernel=True)
    assert rel(o, ungated) < TOL_O


def test_per_channel_decay_is_per_k_column():
    """Decay only on the upper half of the K channels: the state's lower-half columns must match the oracle, which
    a per-row (V) or transposed application of 2^G_last would break."""
    lens = [200, 65]
    d = inputs(lens, 2, 2, 2, gate="strong")
    d["g"][..., :64] = 0.0
    h0 = torch.randn(2, 2, 128, 128, device=DEV)
    o_ref, s_ref = oracle(d, h0)
    ht = torch.full_like(h0, NAN)
    o = run_direct(kda90, d, h0=h0, ht=ht)
    assert rel(o, o_ref) < TOL_O and rel(ht, s_ref) < TOL_SC
    # each half on its own (the decayed half is small: a looser bound; a mis-mapped decay is off by O(1))
    assert rel(ht[..., :64], s_ref[..., :64]) < TOL_SC and rel(ht[..., 64:], s_ref[..., 64:]) < 4 * TOL_SC


def test_api_recurrent_kda_forced(monkeypatch):
    """Through the public API with ``CUTEDSL_ATTN_GDN_KERNEL=kda_chunked_sm90`` (forced), in place on the state."""
    from cutedsl_attn.api import delta_family as api

    monkeypatch.setenv("CUTEDSL_ATTN_GDN_KERNEL", "kda_chunked_sm90")
    monkeypatch.delenv("CUTEDSL_ATTN_GDN_TUNE", raising=False)
    calls = []
    real = kda90.launch
    monkeypatch.setattr(kda90, "launch", lambda fn, cfg, args: (calls.append(cfg), real(fn, cfg, args)))
    H, HV, T = 2, 4, sum(LENS)
    q, k = (torch.randn(1, T, H, 128, device=DEV).bfloat16() for _ in range(2))
    v = torch.randn(1, T, HV, 128, device=DEV).bfloat16()
    g = (-torch.rand(1, T, HV, 128, device=DEV) * 0.5).bfloat16()
    beta = torch.rand(1, T, HV, device=DEV).bfloat16()
    cu = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    h0 = torch.randn(len(LENS), HV, 128, 128, device=DEV) * 0.1
    ref_state = h0.double()
    o_ref, _ = rd.recurrent_kda(q, k, v, g, beta, initial_state=ref_state, cu_seqlens=cu)
    out = torch.full(tuple(v.shape), NAN, device=DEV, dtype=torch.bfloat16)
    o, s = api.recurrent_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, output=out,
                             output_final_state=True)
    assert calls, "the SM90 chunked KDA kernel did not run"
    assert o is out and s is h0
    assert rel(o, o_ref) < TOL_O and rel(h0, ref_state) < TOL_SC


def _tma_pair(d, tiles, h0):
    """``[(output, final state)]`` of ``tiles`` with ``tma=0`` and with ``tma=1`` on the same inputs (fresh
    NaN-poisoned outputs and states each)."""
    V, K = d["v"].shape[2], d["q"].shape[2]
    ho = max(d["q"].shape[1], d["v"].shape[1])
    outs = []
    for tma in (0, 1):
        ht = torch.full((d["cu"].shape[0] - 1, ho, V, K), NAN, device=DEV)
        o = run_direct(kda90, d, h0=h0, ht=ht, tiles=dataclasses.replace(tiles, tma=tma))
        outs.append((o, ht))
    return outs


# (K, V), (tile_v, num_stages)
TMA_SHAPES = {"k128_v128_64x2": ((128, 128), (64, 2)), "k128_v128_128x3": ((128, 128), (128, 3)),
              "k64_v64_64x3": ((64, 64), (64, 3)), "k64_v128_128x2": ((64, 128), (128, 2)),
              "k128_v64_64x2": ((128, 64), (64, 2))}


@pytest.mark.parametrize("shape", sorted(TMA_SHAPES))
@pytest.mark.parametrize("gate", ["mild", "inf"])
@pytest.mark.parametrize("mode", ["kda", "gdn2"])
def test_tma_loads_bit_equal_and_vs_oracle(mode, gate, shape):
    """``tma=1`` (W, Aqk and full chunks' Qg / Kd by TMA boxes; a tail chunk's rows by zero-filling cp.async):
    bit-equal to the cp.async loads and the oracle's result, over the varlen
    lengths 0, 1, 15, 16, 17, 63, 64, 65, 1000, 4097."""
    (K, V), tiles = TMA_SHAPES[shape]
    heads = (2, 2, 4) if mode == "kda" else (4, 2, 2)  # KDA: GVA; GDN-2: GQA
    d = inputs(LENS, *heads, K=K, V=V, gate=gate, gdn2=mode == "gdn2")
    h0 = torch.randn(len(LENS), max(heads[0], heads[2]), V, K, device=DEV) * 0.1
    (o0, s0), (o1, s1) = _tma_pair(d, kda90.Tiles(tile_v=tiles[0], num_stages=tiles[1]), h0)
    o_ref, s_ref = oracle(d, h0)
    assert rel(o1, o_ref) < TOL_O and rel(s1, s_ref) < TOL_SC
    assert torch.equal(o1, o0) and torch.equal(s1, s0)
    assert torch.equal(s1[0], h0[0])  # a zero-length sequence: final state = initial state


@pytest.mark.parametrize("lens", [[15], [1, 15, 17], [17, 4097, 40], [64, 63, 65], [100, 0, 28]])
def test_tma_tail_chunks_read_neighbour_rows(lens):
    """Tail chunks beside full ones (ragged lengths, a launch shorter than one box): with ``tma=1`` the full
    chunks' Qg / Kd go by boxes and the tail rows by zero-filling copies, bit for bit the cp.async loads'."""
    d = inputs(lens, 2, 2, 4, gate="strong")
    h0 = torch.randn(len(lens), 4, 128, 128, device=DEV) * 0.1
    (o0, s0), (o1, s1) = _tma_pair(d, kda90.Tiles(tile_v=64, num_stages=2), h0)
    assert torch.equal(o1, o0) and torch.equal(s1, s0)
    o_ref, s_ref = oracle(d, h0)
    assert rel(o1, o_ref) < TOL_O and rel(s1, s_ref) < TOL_SC


@pytest.mark.parametrize("mode", ["kda", "gdn2"])
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_tma_pools_in_place(mode, state_dtype):
    """``tma=1`` on an indexed state pool updated in place (fp32 and bf16 states): the cp.async loads' pool bit
    for bit, the oracle's states, rows no sequence owns untouched."""
    lens = [65, 0, 300, 16, 4097, 1]
    d = inputs(lens, 2, 2, 4, gdn2=mode == "gdn2")
    sdt = torch.float32 if state_dtype == "float32" else torch.bfloat16
    pool0 = (torch.randn(9, 4, 128, 128, device=DEV) * 0.1).to(sdt)
    idx = torch.tensor([7, 2, 0, 5, 8, 3], device=DEV, dtype=torch.int32)
    before = pool0.clone()
    o_ref, s_ref = oracle(d, pool0[idx.long()].double())
    pools, outs = [], []
    for tma in (0, 1):
        pool = before.clone()
        outs.append(run_direct(kda90, d, h0=pool, ht=pool, h0_idx=idx, ht_idx=idx, state_dtype=state_dtype,
                               tiles=kda90.Tiles(tile_v=64, num_stages=3, tma=tma)))
        pools.append(pool)
    assert torch.equal(outs[1], outs[0]) and torch.equal(pools[1], pools[0])
    tol_s = TOL_SC if state_dtype == "float32" else TOL_S16
    assert rel(outs[1], o_ref) < TOL_O and rel(pools[1][idx.long()], s_ref) < tol_s
    others = [r for r in range(9) if r not in idx.tolist()]
    assert torch.equal(pools[1][others], before[others])
    assert torch.equal(pools[1][2], before[2])  # the zero-length sequence's row: its initial state


def test_tma_compact_prep_and_fp16():
    """``tma=1`` with the compact prep layout (``prep_ctas=3``) and fp16 io: bit-equal to the cp.async loads."""
    lens = [0, 1, 64, 65, 1000, 17]
    d = inputs(lens, 2, 2, 4, gate="safe", dtype=torch.float16)
    h0 = torch.randn(len(lens), 4, 128, 128, device=DEV) * 0.1
    (o0, s0), (o1, s1) = _tma_pair(d, kda90.Tiles(tile_v=128, num_stages=2, prep_ctas=3), h0)
    assert torch.equal(o1, o0) and torch.equal(s1, s0)
    o_ref, s_ref = oracle(d, h0)
    assert rel(o1, o_ref) < TOL_O and rel(s1, s_ref) < TOL_SC


def test_tma_through_the_tune_env(monkeypatch):
    """``CUTEDSL_ATTN_GDN_TUNE=tma=1`` reaches the SM90 chunked KDA kernel through the public API."""
    from cutedsl_attn.api import delta_family as api

    monkeypatch.setenv("CUTEDSL_ATTN_GDN_KERNEL", "kda_chunked_sm90")
    monkeypatch.setenv("CUTEDSL_ATTN_GDN_TUNE", "tma=1")
    calls = []
    real = kda90.launch
    monkeypatch.setattr(kda90, "launch", lambda fn, cfg, args: (calls.append(cfg), real(fn, cfg, args)))
    H, HV, T = 2, 4, sum(LENS)
    q, k = (torch.randn(1, T, H, 128, device=DEV).bfloat16() for _ in range(2))
    v = torch.randn(1, T, HV, 128, device=DEV).bfloat16()
    g = (-torch.rand(1, T, HV, 128, device=DEV) * 0.5).bfloat16()
    beta = torch.rand(1, T, HV, device=DEV).bfloat16()
    cu = cu_of(LENS)
    h0 = torch.randn(len(LENS), HV, 128, 128, device=DEV) * 0.1
    ref_state = h0.double()
    o_ref, _ = rd.recurrent_kda(q, k, v, g, beta, initial_state=ref_state, cu_seqlens=cu)
    o, s = api.recurrent_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, output_final_state=True)
    assert calls and all(c.tiles.tma == 1 for c in calls), calls
    assert rel(o, o_ref) < TOL_O and rel(h0, ref_state) < TOL_SC
