"""The measured default tiles of the SM90 prefill kernel: a decision table, one line of reason per row."""

# the measurements behind each row: perf/RESULTS.md, topic "Prefill: SM90 kernel"

from __future__ import annotations

import dataclasses

from ...planning.prefill import PrefillProblem
from .config import Epilogue, LoopOrder, Softmax, TileInfo, Tiles, _page_rows


def default_tiles(problem: PrefillProblem, *, num_sms: int) -> Tiles:
    """The tiles for ``problem`` on a GPU of ``num_sms`` SMs (the persistent grid's size): H200-measured.

    ``problem`` must be one the kernel serves (:func:`unsupported_reason` is None); the result then always
    makes a valid :class:`Config`.
    """
    p = problem
    d = max(p.head_dim_qk, p.head_dim_vo)
    ragged = p.page_size == 0
    simple = not (p.use_window or p.use_soft_cap or p.use_custom_mask)  # their masks / tanh need registers
    plain = simple and p.score_mod is None  # logits are sm_scale * q.k: the stale softmax applies
    three_wg = 192 % p.group_size == 0  # tile_m 192 holds whole query tokens
    ctas = num_sms if ragged and d <= 128 else 0  # persistent, one CTA per SM; slower at d 256, paged unserved

    if d <= 64 and simple and three_wg and ragged and plain:
        # MUFU-bound: three warpgroups, FA's loop order, stale max, P converted during the last exponentials
        t = Tiles(tile_n=128, num_wg=3, num_ctas=ctas, num_stages=3, loop_order=LoopOrder.SPLIT_LATE_V,
                  softmax=Softmax.STALE, p_tail=2, p_wait_lead=4, rescale_threshold=8, rescale_o_before_pv=True,
                  tile_info=TileInfo.SMEM_EARLY)
    elif d <= 64 and simple and three_wg and ragged:
        t = Tiles(tile_n=128, num_wg=3, num_ctas=ctas, loop_order=LoopOrder.SPLIT_LATE_V)  # a score_mod: as timed
    elif d <= 64 and simple and three_wg:
        t = Tiles(tile_n=128, num_wg=3)  # paged: three warpgroups fit 160 registers without spilling
    elif d <= 128 and simple and three_wg and ragged and p.head_dim_vo == p.head_dim_qk:
        # three warpgroups x tile_n 80 (96 spills at 160 registers), conditional rescaling with O rescaled early
        t = Tiles(tile_n=80, num_wg=3, num_ctas=ctas, rescale_threshold=8, rescale_o_before_pv=True)
        if plain:
            t = dataclasses.replace(t, softmax=Softmax.STALE)
        if plain and p.causal:  # the staged epilogue (two Q stages: the next Q loads under it), by TMA where it can
            t = dataclasses.replace(t, q_stages=2, epilogue=Epilogue.SMEM_TMA if 16 % p.group_size == 0
                                    else Epilogue.SMEM)
    elif 64 < d <= 128 and simple:
        t = Tiles(tile_n=176, num_wg=2, num_ctas=ctas)  # two warpgroups: 176 is the largest that does not spill
    elif d > 192 and plain and p.head_dim_vo == p.head_dim_qk and ragged:
        # FlashAttention-4's SM90 d256 tiles: 128 x 80, no ping-pong, O rescaled early and conditionally
        t = Tiles(tile_n=80, pingpong=False, rescale_o_before_pv=True, rescale_threshold=8, epilogue=Epilogue.SMEM)
    elif d > 192 and plain and p.head_dim_vo == p.head_dim_qk:
        t = Tiles(tile_n=64, epilogue=Epilogue.SMEM)  # paged d256: shared memory bounds tile_n
    else:
        # custom masks: the per-score byte loads spill at tile_n 128; d256: shared memory
        t = Tiles(tile_n=64 if d > 192 or p.use_custom_mask else 128, num_ctas=ctas)

    if p.causal and not p.use_custom_mask and ctas:
        t = dataclasses.replace(t, head_section_mib=32)  # kv-head sections of 32 MiB K+V: longest-first across heads
    alt = 64 if d > 192 else 128
    if p.page_size >= 16 and not _page_rows(p.page_size, t.tile_n) and _page_rows(p.page_size, alt):
        t = dataclasses.replace(t, tile_n=alt)  # blocks of whole pages (or inside one): full K/V blocks by TMA
    return t
