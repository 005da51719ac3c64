"""GPU correctness of the SM100 / SM103 tcgen05 prefill kernel (``cutedsl_attn.sm100.prefill``) against the float64
oracle, straight through the kernel contract (``compile`` / ``launch``; dispatch does not route to it).

Runs only on a Blackwell GPU (compute capability 10.0 or 10.3); skipped everywhere else.  Each case poisons the
spare K/V rows past ``kv_indptr[-1]`` and the outputs with NaN first (``_checks.check_poisoned``), so an
unwritten row, a V tail that was not zeroed or a row that reads another request's data fails.  The batches hit
the kernel's edges: a KV tail inside a block, one and many KV blocks, a request with no KV (O = 0,
LSE = -inf), causal rows that see no key (``qo_len > kv_len``), a tile cut by the request's end, GQA packing
with 1..16 heads per kv head, sinks, the output scale, and work-table padding rows.
"""

import dataclasses

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
from _checks import check_poisoned  # noqa: E402

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


def run_case(*, d, causal, group, dtype="bfloat16", sinks=False, batch="mixed", hkv=2, output_scale=1.0,
             pad_rows=0, seed=0, rescale_threshold=None, scale=1.0, q_tiles=1):
    qo_lens, kv_lens = BATCHES[batch]
    p = PrefillProblem(dtype=dtype, head_dim_qk=d, head_dim_vo=d, group_size=group, causal=causal,
                       use_sinks=sinks, arch=device_arch())
    tiles = K.default_tiles(p, num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    tiles = dataclasses.replace(tiles, q_tiles=q_tiles)
    if rescale_threshold is not None:
        tiles = dataclasses.replace(tiles, rescale_threshold=rescale_threshold)
    cfg = K.Config(p, tiles)
    fn = _compiled(cfg)
    tdt = DTYPES[dtype]
    hq = hkv * group
    qo_ip, kv_ip = indptr(qo_lens), indptr(kv_lens)
    tq, tk = int(qo_ip[-1]), int(kv_ip[-1])
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(tq, hq, d, generator=g) * scale).to(tdt).to(DEV)
    k = torch.randn(tk + SPARE, hkv, d, generator=g).to(tdt).to(DEV)
    v = torch.randn(tk + SPARE, hkv, d, generator=g).to(tdt).to(DEV)
    snk = (torch.randn(hq, generator=g) * 2).float().to(DEV) if sinks else torch.zeros(1, device=DEV)
    work, num_work = plan_prefill(qo_lens, kv_lens, qo_ip[:-1], kv_ip[:-1], group_size=group, tile_m=cfg.tile_m,
                                  causal=causal)
    if pad_rows:
        work, _ = plan_prefill(qo_lens, kv_lens, qo_ip[:-1], kv_ip[:-1], group_size=group, tile_m=cfg.tile_m,
                               causal=causal, num_rows=num_work + pad_rows)
    work = work.to(DEV)
    out = torch.empty(tq, hq, d, dtype=tdt, device=DEV)
    lse = torch.empty(tq, hq, dtype=torch.float32, device=DEV)
    sm_scale = d ** -0.5
    dummy_i = torch.zeros(1, dtype=torch.int32, device=DEV)
    dummy_u8 = torch.zeros(1, dtype=torch.uint8, device=DEV)

    def oracle():
        o_ref, lse_ref = ref.ragged_prefill(q.cpu(), k[:tk].cpu(), v[:tk].cpu(), qo_ip, kv_ip, causal=causal,
                                            sm_scale=sm_scale, sinks=snk.cpu() if sinks else None)
        return o_ref * output_scale, lse_ref

    def launch():
        K.launch(fn, cfg, PrefillArgs(q=q, k=k, v=v, indices=dummy_i, work=work, out=out, lse=lse, mask=dummy_u8,
                                      sinks=snk, alibi_slopes=snk, sm_scale=sm_scale, soft_cap=0.0, window_left=-1,
                                      rope_rcp_scale=1.0, rope_log2_theta=0.0, output_scale=output_scale))
        torch.cuda.synchronize()

    what = f"sm100 prefill d{d} causal={causal} G={group} {dtype} sinks={sinks} batch={batch} q_tiles={q_tiles}"
    return check_poisoned(launch, out=out, lse=lse, oracle=oracle, dtype=tdt, what=what, ragged_kv=(k, v),
                          kv_end=tk)


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
