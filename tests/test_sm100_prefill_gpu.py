"""GPU correctness of the SM100 / SM103 tcgen05 prefill kernel (``cutedsl_attn.sm100.prefill``) against the float64
oracle, straight through the kernel contract (``compile`` / ``launch``; dispatch does not route to it).

Runs only on a Blackwell GPU (compute capability 10.0 or 10.3); skipped everywhere else.  Each case poisons the
spare K/V rows past ``kv_indptr[-1]`` and the outputs with NaN first (``_checks.check_poisoned``), so an
unwritten row, a V tail that was not zeroed or a row that reads another request's data fails.  The batches hit
the kernel's edges: a KV tail inside a block, one and many KV blocks, a request with no KV (O = 0,
LSE = -inf), causal rows that see no key (``qo_len > kv_len``), a tile cut by the request's end, GQA packing
with 1..16 heads per kv head, sinks, the output scale, and work-table padding rows; then the softmax-side features:
sliding windows (``window_left`` 0, inside a block, across blocks, with and without causal: whole blocks left of
the window skipped), soft caps, custom masks (packed little-endian bits, replacing causal; rows with no visible
key), ``score_mod`` (a relative bias, a band mask through -inf) and their combinations; head_dim 256 and 192/128;
paged K/V (the same K/V on shuffled pages of 1..256 tokens, spare pages and unused slots NaN-poisoned).  Every
case runs the default tiles (a persistent grid without causal or a window, one CTA per tile with them); the grid
tests add both grids for each and a three-CTA persistent grid (several tiles a CTA), and the output path tests the
build whose correction warpgroup stores O itself (no room for the epilogue warp's staging buffers) beside the
staged default (TMA boxes for whole tiles, 16-byte stores for tiles cut by a request's end).
"""

import dataclasses

import cutedsl_attn as ca

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability() not in ((10, 0), (10, 3)):
    pytest.skip("needs an SM100 / SM103 (Blackwell) GPU", allow_module_level=True)

from cutedsl_attn import ref  # noqa: E402
from cutedsl_attn.compile.arch import device_arch  # noqa: E402
from cutedsl_attn.planning.prefill import PrefillArgs, PrefillProblem, plan_prefill  # noqa: E402
from cutedsl_attn.sm100 import prefill as K  # noqa: E402
from _checks import check_poisoned, used_page_slots  # noqa: E402

DEV = torch.device("cuda")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
SPARE = 40  # K/V rows past the batch's end, NaN-poisoned

# (qo_lens, kv_lens): a tail inside a block, one block, many blocks, no KV, causal rows with no visible key,
# single-token queries, a request whose packed rows cut the last tile
BATCHES = {
    "mixed": ((37, 300, 1, 129), (37, 700, 5, 129)),
    "tails": ((200, 17), (333, 1)),
    "empty_kv": ((40, 9), (0, 64)),
    "q_longer": ((150, 3), (90, 2)),
    "one_block": ((128,), (128,)),
}

_FNS = {}


def _compiled(cfg):
    if cfg not in _FNS:
        _FNS[cfg] = K.compile(cfg)
    return _FNS[cfg]


def indptr(lens):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


def paged_copy(k, v, kv_lens, kv_ip, page_size, gen):
    """The ragged ``k`` / ``v`` of a batch on shuffled pages of ``page_size`` tokens (three spare pages):
    ``((k_pages, v_pages), page-table offsets [B], page ids (device int32), check_poisoned's paged arguments)``."""
    n_pages = [-(-n // page_size) for n in kv_lens]
    total = sum(n_pages) + 3
    pages = torch.randperm(total, generator=gen)[: sum(n_pages)].to(torch.int32)
    pg_ip = indptr(n_pages)
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, n_pages)], dtype=torch.int32)
    kp = torch.zeros(total, page_size, *k.shape[1:], dtype=k.dtype)
    vp = torch.zeros(total, page_size, *v.shape[1:], dtype=v.dtype)
    for b, n in enumerate(kv_lens):
        tok = torch.arange(n)
        pg = pages[int(pg_ip[b]) + tok // page_size].long()
        kp[pg, tok % page_size] = k[int(kv_ip[b]):int(kv_ip[b]) + n].cpu()
        vp[pg, tok % page_size] = v[int(kv_ip[b]):int(kv_ip[b]) + n].cpu()
    kp, vp = kp.to(DEV), vp.to(DEV)
    used = used_page_slots(pg_ip, pages, last, total, page_size)
    return (kp, vp), pg_ip[:-1], pages.to(DEV), dict(paged_kv=(kp, vp), used_slots=used)


def run_case(*, d, causal, group, dtype="bfloat16", sinks=False, batch="mixed", hkv=2, output_scale=1.0,
             pad_rows=0, seed=0, rescale_threshold=None, scale=1.0, q_tiles=1, window_left=-1, soft_cap=0.0,
             mask=False, score_mod=None, sm_scale=None, dv=None, page_size=0, num_ctas=None, kv_stages=None):
    """One batch through the kernel against the oracle; ``window_left >= 0``, ``soft_cap > 0``, ``mask`` (a random
    custom mask, packed little-endian) and ``score_mod`` switch the features on; ``page_size > 0`` puts the same
    K/V on shuffled pages of that size (spare pages and the slots past each request NaN-poisoned); ``num_ctas`` /
    ``kv_stages`` override the default tiles' grid / K/V stages."""
    qo_lens, kv_lens = BATCHES[batch]
    dv = d if dv is None else dv
    p = PrefillProblem(dtype=dtype, head_dim_qk=d, head_dim_vo=dv, group_size=group, causal=causal,
                       use_sinks=sinks, use_window=window_left >= 0, use_soft_cap=soft_cap > 0,
                       use_custom_mask=mask, score_mod=score_mod, page_size=page_size, arch=device_arch())
    tiles = K.default_tiles(p, num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    tiles = dataclasses.replace(tiles, q_tiles=q_tiles)
    if rescale_threshold is not None:
        tiles = dataclasses.replace(tiles, rescale_threshold=rescale_threshold)
    if num_ctas is not None:
        tiles = dataclasses.replace(tiles, num_ctas=num_ctas)
    if kv_stages is not None:
        tiles = dataclasses.replace(tiles, kv_stages=kv_stages)
    cfg = K.Config(p, tiles)
    fn = _compiled(cfg)
    tdt = DTYPES[dtype]
    hq = hkv * group
    qo_ip, kv_ip = indptr(qo_lens), indptr(kv_lens)
    tq, tk = int(qo_ip[-1]), int(kv_ip[-1])
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(tq, hq, d, generator=g) * scale).to(tdt).to(DEV)
    k = torch.randn(tk + SPARE, hkv, d, generator=g).to(tdt).to(DEV)
    v = torch.randn(tk + SPARE, hkv, dv, generator=g).to(tdt).to(DEV)
    snk = (torch.randn(hq, generator=g) * 2).float().to(DEV) if sinks else torch.zeros(1, device=DEV)
    kv_args, kv_starts, idx = (k, v), kv_ip[:-1], torch.zeros(1, dtype=torch.int32, device=DEV)
    poison = dict(ragged_kv=(k, v), kv_end=tk)
    if page_size:
        kv_args, kv_starts, idx, poison = paged_copy(k, v, kv_lens, kv_ip, page_size, g)
    ref_kw = {}
    bit_offsets = None
    packed = torch.zeros(1, dtype=torch.uint8, device=DEV)
    if mask:
        n_elem = [a * b for a, b in zip(qo_lens, kv_lens)]
        m = torch.rand(sum(n_elem), generator=g) > 0.3
        m[: n_elem[0] // 2] = False  # some rows of the first request see no key at all
        packed, byte_ptr = ca.segment_packbits(m.to(DEV), indptr(n_elem).to(DEV), bitorder="little")
        bit_offsets = byte_ptr[:-1].cpu().to(torch.int64) * 8
        ref_kw["custom_mask"] = m
    if window_left >= 0:
        ref_kw["window_left"] = window_left
    if soft_cap > 0:
        ref_kw["logits_soft_cap"] = soft_cap
    if score_mod is not None:
        ref_kw["score_mod"] = score_mod
    # (a custom mask replaces causal: the oracle applies that rule itself, the plan gets no causal then)
    plan_kw = dict(group_size=group, tile_m=cfg.tile_m, causal=causal and not mask, window_left=window_left)
    work, num_work = plan_prefill(qo_lens, kv_lens, qo_ip[:-1], kv_starts, bit_offsets, **plan_kw)
    if pad_rows:
        work, _ = plan_prefill(qo_lens, kv_lens, qo_ip[:-1], kv_starts, bit_offsets, num_rows=num_work + pad_rows,
                               **plan_kw)
    work = work.to(DEV)
    out = torch.empty(tq, hq, dv, dtype=tdt, device=DEV)
    lse = torch.empty(tq, hq, dtype=torch.float32, device=DEV)
    sm_scale = d ** -0.5 if sm_scale is None else sm_scale

    def oracle():
        o_ref, lse_ref = ref.ragged_prefill(q.cpu(), k[:tk].cpu(), v[:tk].cpu(), qo_ip, kv_ip, causal=causal,
                                            sm_scale=sm_scale, sinks=snk.cpu() if sinks else None, **ref_kw)
        return o_ref * output_scale, lse_ref

    def launch():
        K.launch(fn, cfg, PrefillArgs(q=q, k=kv_args[0], v=kv_args[1], indices=idx, work=work, out=out, lse=lse,
                                      mask=packed, sinks=snk, alibi_slopes=snk, sm_scale=sm_scale, soft_cap=soft_cap,
                                      window_left=window_left, rope_rcp_scale=1.0, rope_log2_theta=0.0,
                                      output_scale=output_scale))
        torch.cuda.synchronize()

    what = (f"sm100 prefill d{d}/{dv} page_size={page_size} causal={causal} G={group} {dtype} sinks={sinks} "
            f"batch={batch} q_tiles={q_tiles} window_left={window_left} soft_cap={soft_cap} mask={mask} "
            f"score_mod={getattr(score_mod, '__name__', None)} num_ctas={cfg.tiles.num_ctas} "
            f"epi_stages={cfg.epi_stages}")
    return check_poisoned(launch, out=out, lse=lse, oracle=oracle, dtype=tdt, what=what, **poison)


Q_TILES = (1, 2)  # one Q tile per CTA (the default), two (two softmax warpgroups, P aliased in S)


@pytest.mark.parametrize("q_tiles", Q_TILES)
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("group", (1, 4, 8))
def test_matches_oracle(d, causal, group, q_tiles):
    run_case(d=d, causal=causal, group=group, q_tiles=q_tiles)


@pytest.mark.parametrize("q_tiles", Q_TILES)
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("causal", (False, True))
def test_edge_batches(batch, causal, q_tiles):
    run_case(d=128, causal=causal, group=4, batch=batch, q_tiles=q_tiles)


@pytest.mark.parametrize("q_tiles", Q_TILES)
@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
def test_dtypes_and_sinks(dtype, q_tiles):
    run_case(d=128, causal=True, group=2, dtype=dtype, sinks=True, q_tiles=q_tiles)


@pytest.mark.parametrize("q_tiles", Q_TILES)
def test_group_16_and_output_scale(q_tiles):
    run_case(d=64, causal=True, group=16, output_scale=0.37, q_tiles=q_tiles)


@pytest.mark.parametrize("q_tiles", Q_TILES)
@pytest.mark.parametrize("threshold", (0, 8))
def test_exact_and_conditional_rescaling(threshold, q_tiles):
    """Large logits (q scaled up) make the row max jump between blocks: the exact path rescales O every block,
    the conditional one only past 2^8."""
    run_case(d=128, causal=True, group=4, rescale_threshold=threshold, scale=4.0, q_tiles=q_tiles)


@pytest.mark.parametrize("q_tiles", Q_TILES)
def test_padding_rows_are_skipped(q_tiles):
    run_case(d=128, causal=False, group=4, pad_rows=5, q_tiles=q_tiles)


def test_repeated_launches_agree():
    """A stale pipeline phase or TMEM state would show as a run-to-run difference."""
    for q_tiles in Q_TILES:
        e0 = run_case(d=128, causal=True, group=4, seed=3, q_tiles=q_tiles)
        e1 = run_case(d=128, causal=True, group=4, seed=3, q_tiles=q_tiles)
        assert e0 == e1


# ----------------------------------------------------------------------------- softmax-side features
def _rel_bias(score, batch_idx, head_idx, q_idx, kv_idx):
    """Python arithmetic only: the kernel traces it with the DSL's scalars, the oracle calls it on tensors."""
    return score - 0.004 * (q_idx - kv_idx) + 0.2 * head_idx - 0.5 * batch_idx


def _band(score, batch_idx, head_idx, q_idx, kv_idx):
    """A mask through the score_mod: keys more than 40 positions before the query's get -inf (rows can lose every
    key)."""
    if isinstance(score, torch.Tensor):
        return torch.where(kv_idx < q_idx - 40, float("-inf"), score)
    import cutlass
    return cutlass.select_(kv_idx < q_idx - 40, cutlass.Float32(float("-inf")), score)


@pytest.mark.parametrize("q_tiles", Q_TILES)
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("causal,window_left", ((True, 0), (True, 37), (True, 300), (False, 100)))
def test_sliding_window(d, causal, window_left, q_tiles):
    """``window_left`` 0 (the diagonal only), inside one block, across blocks (the blocks left of every row's
    window are skipped), and without causal (keys right of the query stay visible)."""
    run_case(d=d, causal=causal, group=4, window_left=window_left, q_tiles=q_tiles)


@pytest.mark.parametrize("q_tiles", Q_TILES)
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_sliding_window_edge_batches(batch, q_tiles):
    run_case(d=128, causal=True, group=4, batch=batch, window_left=50, q_tiles=q_tiles)


@pytest.mark.parametrize("q_tiles", Q_TILES)
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("causal", (False, True))
def test_soft_cap(d, causal, q_tiles):
    """Large logits (q scaled up) so the cap bites; a negative sm_scale is served with a cap (the max is taken
    after the tanh)."""
    run_case(d=d, causal=causal, group=4, soft_cap=7.0, scale=4.0, q_tiles=q_tiles)
    run_case(d=d, causal=causal, group=4, soft_cap=30.0, sm_scale=-(d ** -0.5), q_tiles=q_tiles, seed=1)


@pytest.mark.parametrize("q_tiles", Q_TILES)
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("batch", ("mixed", "tails", "q_longer"))
def test_custom_mask(d, causal, batch, q_tiles):
    """A random packed mask (bit offsets not multiples of 32 within a row: the rows of kv_len bits run on), the
    causal flag replaced by it, rows that see nothing."""
    run_case(d=d, causal=causal, group=4, batch=batch, mask=True, q_tiles=q_tiles)


@pytest.mark.parametrize("q_tiles", Q_TILES)
@pytest.mark.parametrize("fn", (_rel_bias, _band), ids=("rel_bias", "band"))
@pytest.mark.parametrize("d", (64, 128))
def test_score_mod(d, fn, q_tiles):
    run_case(d=d, causal=True, group=4, score_mod=fn, sinks=d == 64, q_tiles=q_tiles)


@pytest.mark.parametrize("q_tiles", Q_TILES)
def test_feature_combinations(q_tiles):
    """Window + soft cap + sinks; window + custom mask + soft cap; window + score_mod; with padding rows and an
    output scale."""
    run_case(d=128, causal=True, group=4, window_left=50, soft_cap=9.0, sinks=True, q_tiles=q_tiles)
    run_case(d=128, causal=False, group=2, window_left=70, soft_cap=9.0, mask=True, q_tiles=q_tiles, pad_rows=3)
    run_case(d=64, causal=True, group=8, window_left=120, score_mod=_rel_bias, output_scale=0.5, q_tiles=q_tiles)
    run_case(d=128, causal=True, group=4, window_left=20, rescale_threshold=0, scale=4.0, q_tiles=q_tiles)


# ----------------------------------------------------------------------------- head_dim 256 and 192/128
@pytest.mark.parametrize("dims", ((256, 256), (192, 128)), ids=("d256", "d192_128"))
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("group", (1, 4))
def test_large_head_dims(dims, causal, group):
    """head_dim 256 (one Q tile, 64-token blocks: the TMEM plan) and 192/128 (head_dim_qk != head_dim_vo)."""
    run_case(d=dims[0], dv=dims[1], causal=causal, group=group)


@pytest.mark.parametrize("dims", ((256, 256), (192, 128)), ids=("d256", "d192_128"))
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_large_head_dims_edge_batches(dims, batch):
    run_case(d=dims[0], dv=dims[1], causal=True, group=4, batch=batch, sinks=True)


@pytest.mark.parametrize("dims", ((256, 256), (192, 128)), ids=("d256", "d192_128"))
def test_large_head_dims_with_features(dims):
    run_case(d=dims[0], dv=dims[1], causal=True, group=2, window_left=60, soft_cap=9.0, scale=4.0)
    run_case(d=dims[0], dv=dims[1], causal=False, group=2, mask=True, batch="tails")
    run_case(d=dims[0], dv=dims[1], causal=True, group=2, score_mod=_rel_bias, rescale_threshold=0)


# ----------------------------------------------------------------------------- paged K/V
@pytest.mark.parametrize("q_tiles", Q_TILES)
@pytest.mark.parametrize("page_size", (1, 8, 16, 32, 48, 64, 128, 256))
@pytest.mark.parametrize("causal", (False, True))
def test_paged_kv(page_size, causal, q_tiles):
    """TMA per page: pages smaller than the block (several boxes per block), one block, larger (a block inside a
    page; the tail block's boxes past the request re-read its last page: masked in S, zeroed in V); the cp.async
    gather: 1, 8 and 48-token pages (no whole box fits; zero-filled past the request)."""
    run_case(d=128, causal=causal, group=4, page_size=page_size, q_tiles=q_tiles)


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("page_size", (1, 16, 128))
def test_paged_kv_edge_batches(batch, page_size):
    run_case(d=128, causal=True, group=4, batch=batch, page_size=page_size, sinks=True)


def test_paged_kv_head_dims_and_features():
    """head_dim 64 and 192/128 on pages; window + soft cap, custom mask and score_mod on pages."""
    run_case(d=64, causal=True, group=8, page_size=32)
    run_case(d=192, dv=128, causal=True, group=1, page_size=64)
    run_case(d=192, dv=128, causal=False, group=4, page_size=1, q_tiles=1, sinks=True)
    run_case(d=64, causal=True, group=4, page_size=8, window_left=30, q_tiles=2)
    run_case(d=128, causal=True, group=4, page_size=16, window_left=50, soft_cap=9.0, q_tiles=2)
    run_case(d=128, causal=False, group=4, page_size=64, mask=True, batch="tails")
    run_case(d=128, causal=True, group=4, page_size=256, score_mod=_rel_bias)


# ----------------------------------------------------------------------------- grids and the output path
@pytest.mark.parametrize("q_tiles", Q_TILES)
@pytest.mark.parametrize("num_ctas", (0, 3, 148), ids=("one_cta_per_tile", "persistent3", "persistent148"))
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("batch", ("mixed", "tails", "empty_kv"))
def test_grids(batch, causal, num_ctas, q_tiles):
    """Both grids whatever the default picks; three CTAs carry every pipeline (the staging buffers' included)
    across many tiles, padding rows among them."""
    run_case(d=128, causal=causal, group=4, batch=batch, num_ctas=num_ctas, q_tiles=q_tiles, pad_rows=3,
             sinks=True)


@pytest.mark.parametrize("num_ctas", (0, 3))
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("batch", ("mixed", "one_block", "q_longer"))
def test_unstaged_output(batch, causal, num_ctas):
    """head_dim 128 with three 128-token K/V stages: no staging buffer fits, the correction warpgroup stores O."""
    cfg = K.Config(PrefillProblem(dtype="bfloat16", head_dim_qk=128, head_dim_vo=128, group_size=4,
                                  arch=device_arch()), K.Tiles(kv_stages=3))
    assert cfg.epi_stages == 0
    run_case(d=128, causal=causal, group=4, batch=batch, num_ctas=num_ctas, kv_stages=3)


@pytest.mark.parametrize("group", (1, 2, 16))
@pytest.mark.parametrize("dims", ((64, 64), (128, 128), (192, 128), (256, 256)), ids=("d64", "d128", "d192", "d256"))
def test_whole_and_cut_tiles_store_alike(dims, group):
    """Whole 128-row tiles leave by TMA boxes (every group size packs its heads into the box), tiles cut by the
    request's end by the epilogue warp's row stores: both in one batch, every head dim (one and two buffers)."""
    run_case(d=dims[0], dv=dims[1], causal=False, group=group, batch="mixed")
    run_case(d=dims[0], dv=dims[1], causal=True, group=group, batch="one_block")
