"""SM90 (Hopper) prefill / append attention: TMA + wgmma, warp-specialised.

One CTA per (work row, kv head): a tile of ``tile_m = 64 * num_wg`` (128, 192 or 256) packed
query rows of one request, the same decomposition and work table as the portable kernel
(:mod:`cutedsl_attn.planning.prefill`, request-major, longest first), so the API layer plans once for
either.  The grid is ``(work rows, kv heads)`` with the work row fastest: the CTAs in flight
are mostly tiles of one kv head and share its K/V through L2 (measured: the largest single
speed-up of this kernel, perf/RESULTS.md); with ``head_section_mib`` (the causal default on the
persistent grid) tile ``t`` instead walks sections of a few kv heads, rows of the section in the table's
longest-first order with its heads fastest (:meth:`Sm90PrefillKernel._tile_coords`).  ``num_ctas > 0``
(ragged K/V) instead launches a persistent grid of ``min(num_ctas, tiles)`` CTAs: CTA ``i`` starts
with tile ``i`` and then claims the next unclaimed tile from an atomic counter (``work[0, W_SCHED]``, reset to 0 by the
launch's last claim), so the tiles start in the same order as with one CTA per tile (the L2
sharing survives) while a CTA's next Q and K/V load during its current tile's last GEMMs and
epilogue (the K/V ring, the Q stage and the ping-pong turn carry from tile to tile).

CTA organisation (``128 * (num_wg + 1)`` threads: a producer and ``num_wg`` consumer warpgroups):

* the producer warpgroup: warp 0 hands each tile to the consumers through a Q pipeline of
  ``q_stages`` (1 or 2) buffers: it waits until the consumers have released a Q buffer (after their
  last ``S`` GEMM of its tile, or with ``smem_epilogue`` after that tile's epilogue), stores the tile
  index in shared memory and loads the tile's packed Q rows
  with one TMA box per 64 columns (Q viewed as ``((group, tokens), dim, kv_heads)``: the
  ``tile_m`` rows of a tile are ``tile_m / group`` tokens x ``group`` heads; rows past the
  request load other rows, whose results are never stored); index ``-1`` ends the CTA.  For
  ragged K/V the same warp streams K and V tiles of ``tile_n`` tokens with TMA
  (``cp.async.bulk.tensor``) into a ``num_stages``-deep ring, one mbarrier pipeline for K and
  one for V (``cutlass.pipeline.PipelineTmaAsync``).  For paged K/V a block whose tokens are
  whole pages or lie inside one page (:attr:`Sm90PrefillConfig.page_rows`: ``page_size >= 16``,
  one of ``tile_n`` / ``page_size`` dividing the other in whole 8-row units -- powers of two
  from 16 in practice) and that ends inside the request loads by TMA too, one box per page read from the page
  table; the block holding the request's end (all blocks for smaller pages) is gathered by
  all 128 threads through the page table with ``cp.async`` into the same swizzled layout,
  zero-filled past the request, so no stale row of a last page reaches ``P V``; either way
  the 128 threads arrive on the stage's mbarrier (``PipelineCpAsync``), and the consumers
  fence the generic-proxy writes before wgmma reads them.  KV blocks are walked right to left,
  so the block that needs the sequence-end / causal-diagonal mask comes first.  The producer gives its
  registers to the consumers (``setmaxnreg``: 24/240, 40/232 for the gather, 32/160 with
  three consumer warpgroups, 32/112 with four -- a tuning option at head_dim 64, measured slower; the
  consumers' increase can only take what the producer's decrease frees of the launch allocation).
* the consumer warpgroups, 64 rows each, wait for the tile's Q; then per KV block: ``S = Q K^T``
  (wgmma, both operands in shared memory), masks only on the blocks that need them, online
  softmax in fp32 with the scale folded into one
  ``fma`` + ``ex2`` per element, ``P`` converted in registers and used as the register A
  operand of ``O += P V`` (RS wgmma, V read transposed from its row-major tile).  The wgmma
  accumulator of one warp has the ``mma.m16n8`` C layout repeated over n8 tiles, so the
  softmax helpers of :mod:`cutedsl_attn.common.softmax` are shared with the portable kernels.
* intra-warpgroup overlap: the ``S`` GEMM of block ``j + 1`` is issued together with the
  ``P V`` GEMM of block ``j`` and the softmax of ``j + 1`` runs while the latter is in
  flight (the K stage is released after the softmax: released before it, ptxas scheduled the
  wait for ``P V`` ahead of the exponentials and the overlap was lost -- see
  ``tests/test_ptx.py::test_sm90_prefill_softmax_overlaps_pv``); inter-warpgroup ping-pong:
  the consumer warpgroups take turns issuing their GEMMs (named barriers), so one's softmax
  overlaps the other's GEMMs (FA3's schedule), in a ring with three warpgroups (the default at head_dim 64
  without window / soft cap / custom mask, tile_n 128, and for ragged K/V at head_dim 128 / 128 without those
  or a score_mod, tile_n 80: at 160 registers ptxas keeps no exponential ahead of the ``P V`` wait; for plain
  ragged problems of both O is rescaled while S runs, only where a row's max grew by more than 8 -- session
  11).  At head_dim 256 (plain, ragged) the default is
  FlashAttention-4's instead: tile_n 80, no ping-pong, O rescaled while S runs and only where a row's
  max grew by more than 8 (``rescale_threshold``); ptxas then keeps no exponential ahead of the
  ``P V`` wait, and it measured faster (perf/RESULTS.md, session 7).
* epilogue (normalised, sinks folded in, LSE base 2) straight from registers, or with
  ``smem_epilogue`` staged through the warpgroup's own Q rows (free after its last ``S`` GEMM):
  ``stmatrix`` of each warp's 16 rows, then whole-row 16-byte stores
  (:func:`cutedsl_attn.common.epilogue.stage_rows`, ``store_staged_rows``, ``store_lse``); the default for causal ragged head_dim
  128 (with two Q stages, so the next tile's Q has its own buffer) and head_dim 256.  With
  ``tma_epilogue`` (the causal ragged head_dim 128 default where the group size divides 16) a warp whose 16
  staged rows all lie in the request hands them to one TMA store per 64 columns (the staging rows are
  16 x 64 boxes in the 128-byte swizzle a TMA box reads) and waits only for its reads before releasing Q;
  a warp at the request's end stores row by row as before.
* custom masks: one byte of the packed mask per score, every block masked (two warpgroups x
  ``tile_n`` 64, :func:`default_tiles`).

Conventions (FlashInfer, identical to the portable kernel): bottom-right causal,
``window_left = w`` keeps ``w + 1`` keys, soft cap ``cap * tanh(s / cap)`` on scaled
logits, sinks in natural-log units, LSE base 2, empty rows give O = 0 and LSE = -inf.
The softmax scale must be > 0 unless a soft cap is used (the API plans the portable
kernel for ``sm_scale <= 0``).

Scope: fp16/bf16; head_dim_qk 64/128/192/256, head_dim_vo 64/128/256; ``tile_m`` a multiple
of ``group_size``; custom masks (FlashInfer's packed bits, one byte load per score element
in every block: a correctness path, not a fast one); a user ``score_mod`` traced per score
(:class:`Sm90PrefillConfig`; verified on the H200, session 10); no positional encoding (RoPE / ALiBi run on
the portable kernel: :func:`unsupported_reason` says which).  Verified on an H200 (SM90): ragged (one CTA
per tile and persistent) and paged (page 1/16/64/128, TMA and gather) against the float64
oracle; it does not build for SM100.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..common import epilogue, masks, paging, ptx
from ..common.dtypes import Dtype16, dtype_error
from ..compile.arch import compile_options
from ..compile.fake import prefill_tensors
from ..common import softmax as sm
from ..planning.prefill import W_BATCH, W_KV_LEN, W_KV_START, W_MASK_OFF, W_Q_START, W_QO_LEN, W_ROW0, W_SCHED, WORK_COLS

LOG2E = 1.4426950408889634
NEG_INF = float("-inf")


_SMEM_LIMIT = 227 * 1024
# work-table fields the producer copies next to the tile index with tile_info_smem (7 fit the 8-int slot)
_INFO_COLS = (W_BATCH, W_ROW0, W_QO_LEN, W_KV_LEN, W_Q_START, W_MASK_OFF)


@dataclass(frozen=True)
class Sm90PrefillConfig(Dtype16):
    """Compile-time configuration of :class:`Sm90PrefillKernel` (also its cache key).

    Field names match :class:`cutedsl_attn.portable.prefill.PrefillConfig` so the API
    layer treats both alike.  Lengths, offsets, head counts, strides, ``sm_scale``, the
    soft-cap value and ``window_left`` are run-time arguments.
    """

    dtype: str  # "bfloat16" | "float16"
    head_dim_qk: int
    head_dim_vo: int
    group_size: int
    page_size: int = 0  # 0: ragged K/V (TMA); > 0: paged K/V (TMA per page where page_rows > 0, else gather)
    causal: bool = False
    use_window: bool = False
    use_soft_cap: bool = False
    use_sinks: bool = False
    use_custom_mask: bool = False  # packed bits per request (replaces causal; every block masked)
    # a user function traced into the softmax (common.softmax.score_mod_logit): score_mod(score, batch_idx,
    # head_idx, q_idx, kv_idx) -> score on sm_scale * q.k before the masks, q_idx the query's bottom-right
    # position (kv_idx's axis); part of the compile key (its source, closure values and globals:
    # compile.cache.hash_callable); None: no code
    score_mod: object = None
    tile_n: int = 128
    num_stages: int = 2
    num_wg: int = 2  # consumer warpgroups (64 query rows each)
    pingpong: bool = True  # consumer warpgroups take turns issuing GEMMs (softmax of one overlaps the other's)
    num_ctas: int = 0  # 0: one CTA per tile; > 0: a persistent grid of min(num_ctas, tiles) CTAs
    rescale_o_before_pv: bool = False  # rescale O while the S GEMM runs (else after the P V GEMM completes)
    # of every 8 softmax exponentials of a row, this many by a cubic on the FMA pipe (common.ptx.ex2_poly);
    # measured slower on the H200 at head_dim 64 (2.29-2.61 vs 2.19 ms for 1-4 of 8, session 5): off
    ex2_poly: int = 0
    claim_after_q: bool = True  # persistent grid: claim the next tile after handing over this one's Q (else before)
    # FlashAttention's main-loop order (session 5; run and timed on the H200 in session 6: the d64 default
    # uses loop_split + v_wait_late):
    loop_split: bool = False  # masked blocks in their own loop, the rest without mask code
    v_wait_late: bool = False  # wait for V inside the ping-pong turn, after issuing S
    k_release_early: bool = False  # release the K stage right after the S wait
    # Q buffers: 2 lets the producer load the next tile's Q while the current one runs (persistent grid);
    # alone it measured no gain (session 6), it serves smem_epilogue
    q_stages: int = 1
    # development aid: per-tile %clock64 stamps written into the (otherwise unused) mask argument
    # (:meth:`Sm90PrefillKernel._stamp`); perf/trace_prefill.py reads them
    trace: bool = False
    # epilogue through shared memory (the warpgroup's own Q rows, free after its last S GEMM; Q is released
    # after the epilogue, so a persistent grid pairs it with q_stages=2): 16-byte stores of whole rows
    smem_epilogue: bool = False
    # the producer copies the tile's work-table fields next to its index in shared memory (_INFO_COLS), so
    # the consumers read them there instead of from global memory at the tile's start (and, with
    # smem_epilogue, in the epilogue); session 6, run on the H200 in session 7: passes its GPU test, no gain
    # measured alone (varlen 5.680 vs 5.663 ms, d128 causal equal); on at head_dim 64 with epi_coords_early
    # (session 13, default_tiles)
    tile_info_smem: bool = False
    # without smem_epilogue: the epilogue's tile coordinates (row0, qo_len, q_start) are read right after the main
    # loop, before the Q stage's release and the last P V's wait -- from the Q stage's fields with tile_info_smem,
    # else from global memory, whose latency then hides behind the last P V (session 13)
    epi_coords_early: bool = False
    # the unmasked loop of stale_max + loop_split without a window (elsewhere no effect): the warpgroup waits for the
    # previous block's
    # P V once all but the last p_tail n8 tiles of a block's exponentials are issued and converts their P (its A
    # registers are then free) while the rest run, leaving p_tail tiles to convert after the softmax instead of
    # all of them (0: off, everything after; session 13)
    p_tail: int = 0
    # with p_tail: the wait for P V pinned this many n8 tiles before the conversion point (after max(1, tile_n / 8 -
    # p_tail - p_wait_lead) tiles) by an arrive on a dummy mbarrier predicated on the rows' running sums, the
    # tiles after it converted one by one (0: the wait where ptxas puts it, after the first few exponentials;
    # session 13)
    p_wait_lead: int = 0
    # log2 units by which a row's max may grow before O is rescaled (FlashAttention-4's conditional rescaling
    # uses 8; common.softmax.online_softmax_step's max_slack): the O rescale is skipped while no row of the
    # warp moved its max; 0: exact maxima, O rescaled every block; session 7
    rescale_threshold: int = 0
    # blocks the main loop knows to be unmasked (no soft cap / score_mod / custom mask) take their exponentials
    # against the running max as it stands, without this block's max (common.softmax.stale_max_step): a thread
    # whose partial row sum reaches 2^15 makes its warpgroup (bar.red.or: the redo is a warpgroup GEMM) compute S
    # again (the K stage is still held) and run the exact step; session 12
    stale_max: bool = False
    # with smem_epilogue: a warp whose 16 staged rows all lie in the request stores them with TMA (one box of
    # 16 rows x 64 columns per 64 columns) instead of reading them back into registers; a partial warp (the
    # request's end) stores as before (session 8)
    tma_epilogue: bool = False
    # ragged K/V: the tiles go out in sections of S kv heads, S = this many MiB // one kv head's K+V bytes
    # (clamped to [1, kv heads]; the remainder heads join the last section), row by row with the heads of the
    # section fastest -- so the work table's longest-first order holds across S heads at a time, not one, while
    # the tiles in flight still share S heads' K/V through L2 (measured faster for causal problems, session 9;
    # why is not fully understood: a tail model explains 0.3% of the 2.4% at d128, perf/RESULTS.md); K's token
    # count is its buffer's rows (a larger buffer than the batch needs gives a smaller S); 0: one head at a
    # time (S = 1)
    head_section_mib: int = 0
    arch: str = "sm_90a"

    def __post_init__(self):
        reason = unsupported_reason(self)
        if reason:
            raise ValueError(f"Sm90PrefillConfig: {reason}")

    @property
    def pins_pv_wait(self) -> bool:
        """Whether the unmasked loop's mid-softmax wait for P V is pinned (``p_wait_lead``; its dummy mbarrier)."""
        return (self.p_tail > 0 and self.p_wait_lead > 0 and self.stale_max and self.loop_split
                and not self.use_window)

    @property
    def tile_m(self) -> int:
        return 64 * self.num_wg

    @property
    def num_threads(self) -> int:
        return 128 * (self.num_wg + 1)

    @property
    def positive_scale_only(self) -> bool:
        """Without a soft cap the softmax scale is folded into the exponent after the row max of the
        raw logits, which is only the max of the scaled ones for a positive scale (the API checks); a soft cap or a
        ``score_mod`` scales every logit before the max."""
        return not (self.use_soft_cap or self.score_mod is not None)

    @property
    def registers(self) -> tuple[int, int]:
        """(consumer, producer) registers per thread after ``setmaxnreg``."""
        if self.num_wg == 4:  # 640 threads launch with 96 registers: setmaxnreg can only move those 61,440
            return (112, 32)
        if self.num_wg == 3:
            return (160, 32)
        return (232, 40) if self.page_size > 0 else (240, 24)  # the cp.async gather needs producer registers

    @property
    def page_rows(self) -> int:
        """Rows of one K/V TMA box for paged K/V (:func:`_page_rows`): ``min(page_size, tile_n)`` where
        ``page_size >= 16``, a block of ``tile_n`` tokens is whole pages or lies inside one page, and the box
        is whole 8-row swizzle atoms; else 0 (every block gathered with cp.async)."""
        return _page_rows(self.page_size, self.tile_n)

    @property
    def smem_bytes(self) -> int:
        """Shared memory of Q, the K/V rings and the barriers (each buffer 1 KiB aligned)."""
        e = 2
        q = self.q_stages * self.tile_m * self.head_dim_qk * e
        k = self.num_stages * self.tile_n * self.head_dim_qk * e
        v = self.num_stages * self.tile_n * self.head_dim_vo * e
        return 1024 + q + k + v + 1024


# the fields a problem fixes; every other field of Sm90PrefillConfig is a tuning choice (default_tiles, or
# CUTEDSL_ATTN_PREFILL_TUNE for experiments)
PROBLEM_FIELDS = ("dtype", "head_dim_qk", "head_dim_vo", "group_size", "page_size", "causal", "use_window",
                   "use_soft_cap", "use_sinks", "use_custom_mask", "score_mod", "arch")
TUNING_FIELDS = tuple(f.name for f in fields(Sm90PrefillConfig) if f.name not in PROBLEM_FIELDS)


def _page_rows(page_size: int, tile_n: int) -> int:
    """``min(page_size, tile_n)`` when full blocks of paged K/V can load by TMA, one box of that many rows per
    page (or per block): ``page_size >= 16``, one of ``tile_n`` / ``page_size`` divides the other, and the box
    is whole 8-row swizzle atoms (so each box starts on a 1 KiB boundary of the 128-byte swizzle); else 0."""
    r = min(page_size, tile_n)
    if page_size >= 16 and (tile_n % page_size == 0 or page_size % tile_n == 0) and r % 8 == 0:
        return r
    return 0


def unsupported_reason(cfg) -> str | None:
    """Why the SM90 kernel cannot serve ``cfg`` (a prefill config of either kernel), or None."""
    for name in ("head_dim_qk", "head_dim_vo", "group_size", "page_size"):  # (the tuning fields: below)
        v = getattr(cfg, name, 0)
        if isinstance(v, bool) or not isinstance(v, int):
            return f"{name} must be an int, got {v!r}"
    if dtype_error(cfg.dtype):
        return dtype_error(cfg.dtype)
    if not str(cfg.arch).startswith("sm_90"):
        return f"the SM90 kernel builds for sm_90a only, got arch {cfg.arch!r}"
    if cfg.head_dim_qk not in (64, 128, 192, 256) or cfg.head_dim_vo not in (64, 128, 256):
        return f"head_dim_qk must be 64/128/192/256 and head_dim_vo 64/128/256, got {cfg.head_dim_qk}/{cfg.head_dim_vo}"
    if getattr(cfg, "pos_encoding_mode", "NONE") != "NONE":
        return "positional encodings are served by the portable kernel"
    score_mod = getattr(cfg, "score_mod", None)
    if score_mod is not None and (not callable(score_mod) or cfg.use_soft_cap):
        return "score_mod must be a callable, and not combined with a soft cap (fold the cap into the score_mod)"
    if cfg.group_size < 1 or 128 % cfg.group_size != 0:
        return f"group_size must divide 128, got {cfg.group_size}"
    if isinstance(cfg, Sm90PrefillConfig):
        for name in TUNING_FIELDS:  # bool fields take bools, int ones ints (not bools), before the range checks
            v, want_bool = getattr(cfg, name), isinstance(getattr(Sm90PrefillConfig, name), bool)
            if want_bool != isinstance(v, bool) or not isinstance(v, int):
                return f"{name} must be {'a bool' if want_bool else 'an int'}, got {v!r}"
        if not 64 <= cfg.tile_n <= 192 or cfg.tile_n % 16:
            return f"tile_n must be a multiple of 16 in [64, 192], got {cfg.tile_n}"
        if cfg.num_stages not in (2, 3):
            return f"num_stages must be 2 or 3, got {cfg.num_stages}"
        if cfg.num_wg not in (2, 3, 4) or (64 * cfg.num_wg) % cfg.group_size:
            return f"num_wg must be 2, 3 or 4 with 64 * num_wg a multiple of group_size, got {cfg.num_wg}"
        if cfg.num_wg == 4 and max(cfg.head_dim_qk, cfg.head_dim_vo) > 64:  # 112 registers per consumer thread
            return f"num_wg 4 needs head dims <= 64, got {cfg.head_dim_qk}/{cfg.head_dim_vo}"
        if cfg.q_stages not in (1, 2):
            return f"q_stages must be 1 or 2, got {cfg.q_stages}"
        if not 0 <= cfg.ex2_poly <= 8:
            return f"ex2_poly must be in 0..8, got {cfg.ex2_poly}"
        if not 0 <= cfg.rescale_threshold <= 15:  # P <= 2^threshold must fit float16 (max 65504)
            return f"rescale_threshold must be in 0..15, got {cfg.rescale_threshold}"
        if cfg.stale_max and (cfg.use_soft_cap or score_mod is not None or cfg.use_custom_mask or cfg.k_release_early):
            return ("stale_max needs logits scaled by sm_scale alone (no soft cap or score_mod), blocks without a "
                    "custom mask, and the K stage held through the softmax (k_release_early off)")
        if cfg.p_wait_lead < 0:
            return f"p_wait_lead must be >= 0, got {cfg.p_wait_lead}"
        if not 0 <= cfg.p_tail < cfg.tile_n // 8:
            return f"p_tail (n8 tiles of P converted after the softmax) must be in 0..{cfg.tile_n // 8 - 1}, got {cfg.p_tail}"
        if cfg.smem_epilogue and cfg.head_dim_vo > cfg.head_dim_qk:
            return "smem_epilogue stages O in the Q rows: needs head_dim_vo <= head_dim_qk"
        if cfg.tma_epilogue and (not cfg.smem_epilogue or 16 % cfg.group_size):
            return ("tma_epilogue stores a warp's 16 staged rows as whole query tokens: needs smem_epilogue and "
                    f"a group_size dividing 16, got smem_epilogue={cfg.smem_epilogue}, group_size={cfg.group_size}")
        if cfg.trace and (cfg.use_custom_mask or cfg.page_size > 0):
            return "trace writes into the mask argument: ragged K/V without a custom mask only"
        if cfg.trace and cfg.num_wg > 3:  # slots 4 wg + 0..3 of a 16-slot record; 12 and 13: CTA, hand-over
            return f"trace records at most three consumer warpgroups, got num_wg={cfg.num_wg}"
        if not 0 <= cfg.head_section_mib <= 1024:
            return f"head_section_mib must be in 0..1024, got {cfg.head_section_mib}"
        if cfg.head_section_mib and cfg.page_size > 0:
            return "head_section_mib > 0 (kv-head sections of the tile order) needs ragged K/V (page_size 0)"
        if cfg.num_ctas < 0:
            return f"num_ctas must be >= 0, got {cfg.num_ctas}"
        if cfg.num_ctas > 0 and cfg.page_size > 0:
            return "num_ctas > 0 (the persistent grid) needs ragged K/V (page_size 0)"
        if cfg.smem_bytes > _SMEM_LIMIT:
            return f"needs {cfg.smem_bytes} B of shared memory (> {_SMEM_LIMIT})"
    return None


def default_tiles(head_dim_qk: int, head_dim_vo: int, group_size: int, *, use_window: bool = False,
                  use_soft_cap: bool = False, use_custom_mask: bool = False, page_size: int = 0,
                  causal: bool = False, num_sms: int = 132, use_score_mod: bool = False) -> dict:
    """Tile choice per problem, measured on the H200 (perf/RESULTS.md, sessions 3-12, 2026-11-29/30):

    * ragged K/V at head_dim 128 (``head_dim_vo == head_dim_qk``, no window / soft cap / custom mask /
      score_mod, ``192 % group_size == 0``), causal or not (session 11): three consumer warpgroups (tile_m 192)
      x tile_n 80 (96 spills 32 B at 160 registers), conditional rescaling (``rescale_threshold=8``) with O
      rescaled while the S GEMM runs; causal keeps the two Q stages and the staged TMA epilogue below.
      Interleaved A/B, paired vs two warpgroups x tile_n 160 (causal) / 176 (full): the varlen mix 0.936
      (30 rounds; FlashInfer then 1.117x), GQA 32/8 0.951, d128 causal 0.966, d128 full 0.942 (12-15 rounds).
      Three warpgroups without the conditional rescaling measured 0.999 (varlen) and 1.032 (d128 causal),
      tile_n 64 1.05-1.09 (vs two warpgroups), rescaling O after P V 1.02 (varlen, vs O rescaled early).
      The head_dim 128 bullets below were measured with two warpgroups: tile_n 176 is now the paged
      problems' tiles (windows and soft caps take 128); the two Q stages and the staged / TMA epilogue carried
      over to the three warpgroups (tile_n 160 was the largest two Q stages fit with two);
    * ragged K/V at head_dim 128 with a score_mod (otherwise as the first bullet, session 12): the same three
      warpgroups x tile_n 80 with the conditional rescaling, no staged epilogue -- perf/bench_score_mod.py
      (relative bias, causal, 12 rounds): 1.845 vs 1.954 ms for two warpgroups x tile_n 176 (FA4 1.882), 1.943
      without the rescaling; full attention with a score_mod untimed;
    * the plain three-warpgroup problems (ragged, head_dim 64 and the first bullet's 128, session 12):
      ``stale_max`` -- the blocks the main loop knows to be unmasked skip the row max and take their
      exponentials against the running max as it stands, redoing the block exactly (S again) where a
      thread's partial row sum reaches 2^15 (:func:`common.softmax.stale_max_step`). Interleaved A/B, paired
      vs without: d64 0.967 / 0.973 (20 rounds, warp vote / the warpgroup's ``bar.red`` that the redo's GEMM
      needs), d128 causal 0.957 / 0.959, d128 full 0.977, GQA 32/8 0.951, the varlen mix 0.941 (warp
      vote); head_dim 256 0.998 (not used there). With it at d64: three knobs measured no gain
      (``num_stages=3`` 0.997, ``q_stages=2`` 1.000, no ping-pong 1.004), ``tile_n=112`` 1.028,
      ``ex2_poly=1`` 1.047 (the polynomial then also in the stale step, which now keeps MUFU ``ex2``: its
      argument can be +inf or >= 128 there, where the polynomial gives NaN or garbage);
    * head_dim 64 with ``stale_max`` (ragged, plain; session 13, ncu: the tensor pipe and the MUFU (XU) were
      both 63% busy, issue 43%; a consumer warp spent 9% of its time converting P after the P V wait and 6%
      in the redo agreement's ``bar.red``): the unmasked loop waits for P V after 14 of its 16 n8 tiles
      (``p_tail=2``) and converts their P while the last exponentials run, the wait itself pinned after 10
      tiles (``p_wait_lead=4``: an arrive on a dummy mbarrier predicated on the running row sums; unpinned, ptxas
      hoists it to the first exponentials, and its wait was then 2.8% of the ncu stall samples), the producer copies each tile's work-table fields into shared memory
      (``tile_info_smem``), the epilogue reads its coordinates from there before the Q stage's release
      (``epi_coords_early``) and the K/V ring has three stages. Interleaved A/B, paired vs the session-12
      tiles (14-20 rounds): ``p_tail`` 8 / 4 / 2 / 1 0.998 / 0.994 / 0.992 / 0.992, with ``tile_info_smem``
      0.991, with ``epi_coords_early`` too 0.986, all four 0.981 (FA4 then 1.081x slower than the session-12
      tiles, so 1.10x of the new ones), then the pinned wait 0.991 (``p_wait_lead`` 10 / 4: 0.997 / 0.991, its
      SASS waits after 48 / 50 of the 64 exponentials; FA4 1.113x -- pinned then by the V stage's release itself,
      which a review found could free V before P V had read it; with the dummy mbarrier, 46 exponentials before
      the wait: 0.995 vs unpinned, FA4 1.106x); ``tile_info_smem`` alone 0.996, ``epi_coords_early`` alone (reading
      global memory) 1.009, no ``v_wait_late`` 1.008 (vs ``p_tail`` alone). Not adopted: bf16 P rounded on
      the integer ALU (add 0x8000 + ``prmt``, 3 instructions instead of one ``F2FP``) 1.103 slower, 1.052 at
      d128 causal; a warp-local redo (each warp recomputing its rows with ``mma.sync`` after a warp vote, no
      ``bar.red``) 1.004 at d64, 1.011 at d128 causal (``ldmatrix``/``mma`` registers spill 64-96 B);
      ``p_tail`` at d128 causal (with ``loop_split``, tile_n 80: 4 and 2 of 10) 1.001 vs ``loop_split`` alone;
    * head_dim 64 (three warpgroups, ragged, plain): the same conditional rescaling, O rescaled while S runs --
      paired 0.978 in two interleaved runs (15 / 25 rounds, session 11); O rescaled early alone 0.999, the
      threshold alone 1.6% slower (session 7).  Four warpgroups (tile_m 256, tile_n 64, 112 registers): 1.078,
      with the rescaling 1.032 -- not used;

    * head_dim <= 64: three consumer warpgroups (tile_m 192) x tile_n 128 -- 2.19-2.29 vs 2.67 ms for
      two warpgroups on B2 x 8192 x 64 heads causal -- where it fits 160 registers per consumer thread
      without spilling: no sliding window, soft cap or custom mask (those spill 16-224 B), and ``192 %
      group_size == 0``.  At 160 registers ptxas serialises the softmax after P V (so the SASS overlap
      test, ``tests/test_ptx.py::test_sm90_prefill_softmax_overlaps_pv``, leaves d64 out); tile_n 112
      keeps the overlap in SASS but measured 2% slower (2.194 vs 2.155 ms; 96: 3.5% slower);
    * head_dim 128: tile_n 176 -- 1.5-5.5% faster than 128 on the d128 rows, 9% on the varlen mix -- without
      window, soft cap or custom mask (with them tile_n 176 spills 16-184 B; 128 does not);
    * head_dim 192: tile_n 128; head_dim 256: tile_n 64 (shared memory; 80 measured the same with ping-pong;
      without a window, soft cap or custom mask 80 and no ping-pong, below);
    * a custom mask: two warpgroups x tile_n 64 (the mask's per-element byte loads spill 240 B at 128; at
      head_dim 256 still 16-40 B, a correctness path);
    * paged K/V with ``page_size >= 16``: where the choice above gives no TMA box (:func:`_page_rows`: a
      block of whole pages or inside one page) and 128 (64 at head_dim 256) does, ``tile_n`` 128 (64), so
      full blocks load by TMA (page 64: 1.71 ms vs the gather's 3.8 ms on 2 x 8192 d128 causal);
    * ragged K/V at head_dim <= 128: the persistent grid, one CTA per SM (``num_ctas = num_sms``), with the
      request-major tile order of the planner: 12-15% faster on the varlen mix than one CTA per tile,
      1-3% on d128 full and GQA, equal on d128 causal (session 4, three runs); at head_dim 64 2.5% faster
      (2.125 vs 2.180 ms, interleaved A/B with a 2 ms sleep before each call, session 5; session 4's
      200 us-sleep timing had it varying 2.15-2.34 ms).  At head_dim 256 it measured 6-7% slower (1.559
      vs 1.470 ms), so one CTA per tile there and at head_dim 192 (untimed), and always for paged K/V,
      which it does not serve;
    * head_dim 64 (three warpgroups), ragged K/V: FlashAttention's main-loop order, ``loop_split`` + ``v_wait_late`` --
      3% faster in two interleaved A/B runs of session 6 (2.054-2.056 vs 2.118-2.124 ms, ragged, persistent);
    * causal, ragged K/V at head_dim 128 (``head_dim_vo == head_dim_qk``, as run): two Q stages and the epilogue staged
      through the warpgroup's own Q rows (``q_stages=2, smem_epilogue``), which with two Q stages fits shared
      memory at tile_n 160, not 176: 2.8% faster on the varlen mix (5.658 vs 5.819 ms) and 0.7% on d128
      causal (1.615 vs 1.626), session 6 interleaved A/B (a second run: varlen 5.672 vs 5.813); two Q stages
      alone, or tile_n 160 alone, measured no gain (per-tile %clock64 traces, ``perf/trace_prefill.py``:
      the epilogue was 8% of a CTA's time on the varlen mix, 2,810 cycles per tile, 2,470 staged).  Not
      without a causal mask: d128 full measured 3% slower (3.096 vs 3.002 ms; more blocks of 160 than 176);
    * head_dim 256 (``head_dim_vo`` 256) without window / soft cap / custom mask: the staged epilogue (one Q
      stage, one CTA per tile):
      0.5% and 1.0% faster in two A/B runs (1.464 vs 1.471, 1.454 vs 1.468 ms); and FlashAttention-4's
      tiles there, tile_n 80 without ping-pong, O rescaled while the S GEMM runs: 2.4-2.8% faster in two
      interleaved A/B runs of session 7 (1.452 / 1.458 vs 1.494 ms, FA4 1.457 / 1.461; ragged, causal; the
      same without the staged epilogue: 1.493; persistent: 1.573); with FlashAttention-4's conditional
      rescaling (``rescale_threshold=8``) on top, 1.3% faster again in two A/B runs (1.457 vs 1.476, 1.452 vs
      1.471 ms; FA4 1.472 / 1.476) -- at d64, d128 causal and on the varlen mix it measured 1.3-2.7% slower.
      Both for ragged K/V only, as timed: paged K/V keep tile_n 64 with ping-pong (session 6's tiles).
    * causal ragged K/V at head_dim <= 128 (the persistent grid): the tiles go out in sections of kv heads whose
      K+V fit 32 MiB (``head_section_mib``), longest first inside a section, instead of one kv head at a
      time -- interleaved A/B over 30 rounds, session 9: d128 causal 1.590-1.598 vs 1.628-1.640 ms (paired
      0.976, twice; FA4 1.623-1.641), d64 2.045-2.075 vs 2.079-2.129 (0.979-0.985), GQA 32/8 equal, the
      varlen mix untouched (one kv head's K+V exceed 32 MiB there, so S = 1); 16 and 64 MiB less, all heads
      at once (1024) 5-9% slower.  d128 full equal within noise (1.005), d256 (one CTA per tile) 0.6% slower:
      not there.  Window / soft-cap problems get it too, untimed (the order alone changes); custom-mask
      problems (the mask replaces causal) do not;
    * causal ragged head_dim 128 with the staged epilogue and a group size dividing 16: its warps store O by
      TMA (``tma_epilogue``, session 8): 2.7% faster on the varlen mix (5.453 vs 5.605 ms, paired ratio over
      30 interleaved rounds 0.974), 0.4-0.6% on d128 causal and GQA 32/8; at head_dim 256 equal (1.385 vs
      1.386), at d64 with a staged epilogue 0.6-1.9% slower, at d128 full within noise -- so not there.
    """
    d = max(head_dim_qk, head_dim_vo)
    plain = not use_window and not use_soft_cap and not use_custom_mask  # their masks / tanh need registers
    # a score_mod (session 10, perf/bench_score_mod.py: a relative bias, interleaved): at head_dim 64 the plain
    # tiles (three warpgroups: 2.82 vs 3.26 ms for two x tile_n 128; with FlashAttention's loop order 2.68 vs
    # 2.74), at head_dim 128 the non-causal ones (tile_n 176: 1.95 vs 1.99 for 128 before the exponent folded
    # log2 e, equal after; the staged epilogue at tile_n 160: 2.01); elsewhere the soft cap's tiles (untimed).
    # A heavy score_mod can spill a few bytes at three warpgroups (24 B for a select at group 4, ptxas -v)
    smod_plain = plain and use_score_mod
    plain = plain and not use_score_mod
    persistent = {"num_ctas": num_sms} if page_size == 0 and d <= 128 else {}
    if d <= 64 and 192 % group_size == 0 and (plain or smod_plain):
        tiles = {"tile_n": 128, "num_wg": 3, **persistent}
        if page_size == 0:  # (measured on ragged K/V)
            tiles.update(loop_split=True, v_wait_late=True)
            if plain:  # conditional rescaling with O rescaled while S runs: 2.2% faster (session 11); the
                # unmasked blocks against the running max as it stands: 2.7-3.3% faster (session 12); P converted
                # while the exponentials run, the tile's fields through shared memory, three K/V stages: 1.9%,
                # with the P V wait pinned late 2.8% (session 13)
                tiles.update(rescale_threshold=8, rescale_o_before_pv=True, stale_max=True, p_tail=2, p_wait_lead=4,
                             tile_info_smem=True, epi_coords_early=True, num_stages=3)
    elif (64 < d <= 128 and (plain or smod_plain) and page_size == 0 and head_dim_vo == head_dim_qk
          and 192 % group_size == 0):
        # three consumer warpgroups x tile_n 80 with conditional rescaling, O rescaled while S runs (session 11;
        # with a score_mod session 12, perf/bench_score_mod.py, causal: 1.845 vs 1.954 ms for two x tile_n 176,
        # FA4 1.882, the same without the rescaling 1.943; full attention untimed with a score_mod)
        tiles = {"tile_n": 80, "num_wg": 3, **persistent, "rescale_threshold": 8, "rescale_o_before_pv": True}
        if plain:  # (a score_mod: no stale_max, its logits are the function's; no staged epilogue, as timed)
            tiles["stale_max"] = True  # (session 12: 2.3-5.9% faster)
            if causal:
                tiles.update(q_stages=2, smem_epilogue=True)
                if 16 % group_size == 0:  # a warp's 16 staged rows are whole query tokens: stored by TMA
                    tiles["tma_epilogue"] = True
    elif 64 < d <= 128 and (plain or smod_plain):
        tiles = {"tile_n": 176, "num_wg": 2, **persistent}
    else:
        # custom masks: one byte load per score element; at tile_n 128 their addresses spill 240 B
        tiles = {"tile_n": 64 if d > 192 or use_custom_mask else 128, "num_wg": 2, **persistent}
    if d > 192 and plain and head_dim_vo == head_dim_qk:
        tiles["smem_epilogue"] = True
        if page_size == 0:
            # FlashAttention-4's SM90 head_dim 256 tiles (128 x 80, no ping-pong, O rescaled while S runs) and
            # its conditional rescaling (O rescaled only where a row's max grew by more than 8, log2 units)
            tiles.update(tile_n=80, pingpong=False, rescale_o_before_pv=True, rescale_threshold=8)
    if causal and not use_custom_mask and persistent:  # (a custom mask replaces causal)
        # the tile order by sections of kv heads whose K+V fit 32 MiB (4 heads of 16,384 tokens at head_dim
        # 128, 8 at 64): 2.4% faster at d128 causal, 1.5-2.1% at d64; GQA 32/8 equal; the varlen mix unchanged
        # (S = 1 there); all heads at once 5-9% slower at d128 / d64 (1.5% GQA), 64 MiB 1-1.5% slower than 32
        # at d128 / GQA (session 9)
        tiles["head_section_mib"] = 32
    alt = 64 if d > 192 else 128
    if page_size >= 16 and not _page_rows(page_size, tiles["tile_n"]) and _page_rows(page_size, alt):
        tiles["tile_n"] = alt  # blocks of whole pages (or inside one page): full K/V blocks by TMA
    return tiles


def _sw128_offset(r, c, rows: int):
    """Byte offset of 16-byte chunk ``c`` of row ``r`` in a ``rows``-row tile of 16-bit elements laid out as
    the K_SW128 wgmma/TMA atom (8 rows x 64 elements, tiled down the rows first, then along the row):
    the chunk index within a 128-byte row segment is XOR-ed with ``r % 8`` (the buffer is 1 KiB aligned)."""
    return (c // 8) * (rows * 128) + r * 128 + (((c % 8) ^ (r % 8)) * 16)


def _transpose_view(t):
    """(A, B, ...) smem tensor viewed as (B, A, ...) (swizzle kept)."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


class Sm90PrefillKernel:
    """CuTe DSL SM90 prefill; see the module docstring.  Build with :func:`compile`."""

    def __init__(self, cfg: Sm90PrefillConfig):
        self.cfg = cfg
        self.dtype = cfg.cutlass_dtype
        self.DQ, self.DV, self.G = cfg.head_dim_qk, cfg.head_dim_vo, cfg.group_size
        self.TM, self.TN, self.S = cfg.tile_m, cfg.tile_n, cfg.num_stages
        self.paged = cfg.page_size > 0
        self.NWG = cfg.num_wg
        self.NCT = 128 * cfg.num_wg  # consumer threads
        self.mask_causal = cfg.causal and not cfg.use_custom_mask  # a custom mask replaces causal (FlashInfer)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mIdx: cute.Tensor, mWork: cute.Tensor,
                 mO: cute.Tensor, mLSE: cute.Tensor, mMask: cute.Tensor, mSinks: cute.Tensor,
                 sm_scale: Float32, soft_cap: Float32, window_left: Int32, stream):
        DQ, DV, TM, TN, S = self.DQ, self.DV, self.TM, self.TN, self.S
        dt = self.dtype
        K_MAJOR = cute.nvgpu.OperandMajorMode.K
        MN_MAJOR = cute.nvgpu.OperandMajorMode.MN
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            dt, dt, K_MAJOR, K_MAJOR, Float32, atom_layout_mnk=(TM // 64, 1, 1), tiler_mn=(64, TN))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            dt, dt, K_MAJOR, MN_MAJOR, Float32, atom_layout_mnk=(TM // 64, 1, 1), tiler_mn=(64, DV),
            a_source=warpgroup.OperandSource.RMEM)
        QS = self.cfg.q_stages
        sQ_layout_st = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TM, TN, DQ), dt, QS)
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TM, TN, DQ), dt, S)
        # V tile (tile_n, DV), DV contiguous, as TMA writes it; the P V GEMM reads its transpose
        # (DV, tile_n) as an MN-major B operand
        sV_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TM, TN, DV), dt, S)
        sQ_layout = cute.select(sQ_layout_st, mode=[0, 1])  # one stage: the TMA box
        if const_expr(QS > 1):
            sQ_layout_k = sQ_layout_st
        else:
            sQ_layout_k = sQ_layout

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        hkv = mK.shape[2 if self.paged else 1]
        # Q as ((group, tokens), dim, kv_heads): packed row r of a tile is token r // G of query head
        # kv_head * G + r % G, so one TMA box of (tile_m, dim) loads the tile's packed rows
        G = self.G
        mQ_t = cute.make_tensor(mQ.iterator, cute.make_layout(
            ((G, mQ.shape[0]), DQ, hkv), stride=((mQ.stride[1], mQ.stride[0]), 1, G * mQ.stride[1])))
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(g2s, mQ_t, sQ_layout, ((G, TM // G), DQ), 1)
        tma_atom_K = tma_K = tma_atom_V = tma_V = None
        if const_expr(self.paged and self.cfg.page_rows > 0):
            # paged K/V as (row in page, dim, kv_heads, pages); one box = page_rows rows of one page
            R = self.cfg.page_rows
            mK_t = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2, 0]))
            mV_t = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[1, 3, 2, 0]))
            sKb = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TM, R, DQ), dt, 1)
            sVb = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TM, R, DV), dt, 1)
            tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(g2s, mK_t, cute.select(sKb, mode=[0, 1]), (R, DQ), 1)
            tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(g2s, mV_t, cute.select(sVb, mode=[0, 1]), (R, DV), 1)
        if const_expr(not self.paged):
            # K/V as (tokens, dim, kv_heads) for the TMA (dim contiguous)
            mK_t = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[0, 2, 1]))
            mV_t = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[0, 2, 1]))
            tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(g2s, mK_t, cute.select(sK_layout, mode=[0, 1]), (TN, DQ), 1)
            tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(g2s, mV_t, cute.select(sV_layout, mode=[0, 1]), (TN, DV), 1)
        tma_atom_O = tma_O = None
        # (a kernel argument either way; only tma_epilogue reads it)
        sO_layout = cute.select(sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (16, 16, DV), dt, 1), mode=[0, 1])
        if const_expr(self.cfg.tma_epilogue):
            # O as ((group, tokens), dim, kv_heads) like Q; one store = a warp's 16 packed rows x head_dim_vo
            # from its staging rows (common.epilogue.staged_offset: 16 x 64 boxes, 128-byte swizzle)
            mO_t = cute.make_tensor(mO.iterator, cute.make_layout(
                ((G, mO.shape[0]), DV, hkv), stride=((mO.stride[1], mO.stride[0]), 1, G * mO.stride[1])))
            tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mO_t, sO_layout,
                                                            ((G, 16 // G), DV), 1)

        @cute.struct
        class SharedStorage:
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * S]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * S]
            # (+ 1: pins_pv_wait's dummy mbarrier, arrived on and never waited for)
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * QS + (1 if self.cfg.pins_pv_wait else 0)]
            # per Q stage, the tile handed over with it (-1: none left) [and its work-table fields: tile_info_smem]
            s_tile: cute.struct.MemRange[Int32, 8 * QS if self.cfg.tile_info_smem else 2]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout_k)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_layout)], 1024]

        self.shared_storage = SharedStorage
        self.k_bytes = TN * DQ * 2
        self.v_bytes = TN * DV * 2
        self.q_bytes = TM * DQ * 2
        # work row fastest: the CTAs in flight share one kv head's K/V through L2 (the kernel maps blockIdx to
        # (work row, kv head) itself: _tile_coords)
        grid = (mWork.shape[0], hkv, 1)
        if const_expr(self.cfg.num_ctas > 0):
            grid = (cutlass.min(mWork.shape[0] * hkv, self.cfg.num_ctas), 1, 1)
        self.kernel(mQ, mK, mV, mIdx, tma_Q, tma_K, tma_V, tma_O, tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O, mWork,
                    mO, mLSE, mSinks, mMask, sm_scale, soft_cap, window_left, sQ_layout_k, sK_layout, sV_layout,
                    sO_layout, tiled_mma_qk, tiled_mma_pv).launch(
            grid=grid, block=(self.cfg.num_threads, 1, 1), smem=SharedStorage.size_in_bytes(), stream=stream,
        )

    @cute.kernel
    def kernel(self, mQ, mK, mV, mIdx, tma_Q, tma_K, tma_V, tma_O, tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O,
               mWork, mO, mLSE, mSinks, mMask, sm_scale: Float32, soft_cap: Float32, window_left: Int32,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sO_layout: cute.ComposedLayout, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma):
        """Device entry: one CTA per (work row, kv head) tile, or (``num_ctas > 0``) a persistent CTA that
        takes tiles from an atomic counter; see the module docstring."""
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_Q)
            if const_expr(not self.paged or cfg.page_rows > 0):
                cpasync.prefetch_descriptor(tma_atom_K)
                cpasync.prefetch_descriptor(tma_atom_V)
        one = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.NWG)  # lane 0 of each warp
        # Q and the tile index: q_stages buffers, filled by the producer's TMA, freed after the tile's last S GEMM
        # (with smem_epilogue after its epilogue)
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=cfg.q_stages, producer_group=one,
            consumer_group=consumer_warps, tx_count=self.q_bytes, defer_sync=True)
        if const_expr(not self.paged):
            pipe_k = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.S, producer_group=one,
                consumer_group=consumer_warps, tx_count=self.k_bytes, defer_sync=True)
            pipe_v = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.S, producer_group=one,
                consumer_group=consumer_warps, tx_count=self.v_bytes, defer_sync=True)
        else:
            # paged: all 128 producer threads arrive on a stage's full barrier, when their cp.async copies
            # of a gathered block land (cp.async.mbarrier.arrive.noinc) or, for a block loaded by TMA per
            # page, right away (one of them expects the bytes); every consumer thread releases
            producers = pipeline.CooperativeGroup(pipeline.Agent.Thread, 128)
            consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.NCT)
            pipe_k = pipeline.PipelineCpAsync.create(
                barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.S, producer_group=producers,
                consumer_group=consumers, defer_sync=True)
            pipe_v = pipeline.PipelineCpAsync.create(
                barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.S, producer_group=producers,
                consumer_group=consumers, defer_sync=True)
        pin_bar = None
        if const_expr(cfg.pins_pv_wait):
            pin_bar = storage.mbar_q.data_ptr() + 2 * cfg.q_stages
            if warp_idx == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_init(pin_bar, 1)
            cute.arch.mbarrier_init_fence()
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        s_tile = storage.s_tile.get_tensor(cute.make_layout(2))

        # tiles: t = work row + W * kv head (work row fastest; with head_section_mib by sections of kv heads,
        # _tile_coords), the order the CTAs of a one-tile-per-CTA grid start in; a persistent CTA starts with
        # tile blockIdx.x and then takes the next unclaimed one
        W = mWork.shape[0]
        num_tiles = W * mK.shape[2 if self.paged else 1]
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(cfg.registers[1])
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.q_stages)
            if const_expr(not self.paged):
                if warp_idx == 0:
                    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.S)
                    t = bx + W * by
                    while t < num_tiles:
                        claim = Int32(0)
                        if const_expr(cfg.num_ctas > 0 and not cfg.claim_after_q):
                            claim = self._claim_begin(mWork)
                        wi, kvh = self._tile_coords(t, W, mK)
                        b, blk_lo, n_blk = self._tile(mWork, wi, window_left)
                        if b >= 0:
                            self._hand_over(pipe_q, q_state, s_tile, t, tma_atom_Q, tma_Q, sQ, mWork, wi, kvh, mMask)
                            q_state.advance()
                        if const_expr(cfg.num_ctas > 0 and cfg.claim_after_q):
                            # claimed once this tile has started (its Q handed over), not before: a claim
                            # reserves a tile for this CTA; the atomic's latency hides behind the K/V loads
                            claim = self._claim_begin(mWork)
                        if b >= 0:
                            state = self._produce(tma_K, tma_V, tma_atom_K, tma_atom_V, sK, sV, pipe_k, pipe_v,
                                                  kvh, mWork[wi, W_KV_START], blk_lo, n_blk, state)
                        t = num_tiles  # one tile per CTA
                        if const_expr(cfg.num_ctas > 0):
                            t = self._claim_end(mWork, claim, num_tiles)
                    self._hand_over(pipe_q, q_state, s_tile, Int32(-1), tma_atom_Q, tma_Q, sQ, mWork, 0, 0, mMask)
            else:
                wi = bx
                b, blk_lo, n_blk = self._tile(mWork, wi, window_left)
                if b >= 0:
                    if warp_idx == 0:
                        self._hand_over(pipe_q, q_state, s_tile, bx + W * by, tma_atom_Q, tma_Q, sQ, mWork, wi, by)
                        q_state.advance()
                    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.S)
                    self._produce_paged(mK, mV, mIdx, storage.sK.data_ptr().toint(), storage.sV.data_ptr().toint(),
                                        pipe_k, pipe_v, by, mWork[wi, W_KV_START], mWork[wi, W_KV_LEN], blk_lo,
                                        n_blk, tidx, state, tma_K, tma_V, tma_atom_K, tma_atom_V, sK, sV)
                if warp_idx == 0:
                    self._hand_over(pipe_q, q_state, s_tile, Int32(-1), tma_atom_Q, tma_Q, sQ, mWork, 0, 0)
        else:
            cute.arch.setmaxregister_increase(cfg.registers[0])
            ctid = tidx - 128
            wg = cute.arch.make_warp_uniform(ctid // 128)
            if const_expr(cfg.pingpong):
                if wg == self.NWG - 1:  # the first warpgroup issues first
                    cute.arch.barrier_arrive(barrier_id=2, number_of_threads=256)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.S)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.q_stages)
            pipe_q.consumer_wait(q_state)
            t = s_tile[self._slot(q_state)]
            while t >= 0:
                self._stamp(mMask, t, 4 * wg, ctid % 128 == 0)
                if const_expr(cfg.trace):
                    if ctid == 0:
                        ptx.st_global_u32(self._record_addr(mMask, t, 12), bx)
                wi, kvh = self._tile_coords(t, W, mK)
                b, blk_lo, n_blk = self._tile(mWork, wi, window_left, s_tile, q_state)
                self._stamp_fine(mMask, t, 14, ctid)
                # opaque per tile: keeps LLVM from hoisting the per-thread addresses out of the tile loop
                state = self._consume(mK, mO, tma_O, tma_atom_O, sO_layout, mLSE, mSinks, mMask, sQ,
                                      storage.sQ.data_ptr().toint(), sK, sV, pipe_q, q_state, s_tile, pipe_k, pipe_v,
                                      tiled_mma_qk, tiled_mma_pv, mWork, t, wi, kvh, blk_lo, n_blk, sm_scale,
                                      soft_cap, window_left, ptx.opaque_i32(ctid), ptx.opaque_i32(wg), state, pin_bar)
                q_state.advance()
                pipe_q.consumer_wait(q_state)
                t = s_tile[self._slot(q_state)]

    def _q_index(self, q_state):
        """The Q stage's index (trace-time 0 with one stage, as before ``q_stages``)."""
        return q_state.index if const_expr(self.cfg.q_stages > 1) else 0

    def _slot(self, q_state):
        """Where the Q stage's tile index sits in ``s_tile`` (its work-table fields follow with
        ``tile_info_smem``: ``_INFO_COLS``)."""
        if const_expr(self.cfg.tile_info_smem):
            return self._q_index(q_state) * 8
        return self._q_index(q_state)

    def _field(self, mWork, wi, col, s_tile=None, q_state=None):
        """Work-table field ``col`` of work row ``wi``: from ``s_tile`` where the producer copied it
        (``tile_info_smem`` and a Q stage given), else from global memory."""
        if const_expr(self.cfg.tile_info_smem and s_tile is not None):
            return s_tile[self._slot(q_state) + 1 + _INFO_COLS.index(col)]
        return mWork[wi, col]

    @cute.jit
    def _claim_begin(self, mWork):
        """Persistent CTAs, producer warp 0, after the current tile's Q is handed over (``claim_after_q``, the
        default; before it otherwise): lane 0 claims the next tile with ``atomicAdd(counter, 1)`` on ``work[0, W_SCHED]``; the value is only read by
        :meth:`_claim_end`, after the current tile's K/V loads are issued, so the atomic's round trip does
        not delay them."""
        v = Int32(0)
        if cute.arch.lane_idx() == 0:
            v = ptx.atomic_add_global_u32(mWork.iterator.toint() + W_SCHED * 4, 1)
        return v

    @cute.jit
    def _claim_end(self, mWork, v, num_tiles):
        """The claimed tile, ``gridDim.x + v``, to the whole warp.  Every CTA claims until it gets a tile past
        the end, so the claims number ``num_tiles`` and the one that returned ``num_tiles - 1`` is the
        launch's last: it resets the counter to 0 for the next launch."""
        if cute.arch.lane_idx() == 0:
            if v == num_tiles - 1:
                ptx.st_global_u32(mWork.iterator.toint() + W_SCHED * 4, 0)
        return cute.arch.grid_dim()[0] + cute.arch.shuffle_sync(v, 0)

    @cute.jit
    def _hand_over(self, pipe_q, q_state, s_tile, t, tma_atom_Q, tma_Q, sQ, mWork, wi, kvh, mMaskT=None):
        """Producer warp 0: wait until the consumers are done with Q, publish tile ``t`` in shared memory
        and TMA its packed Q rows (``t < 0``: no tile left, the full barrier is arrived on without a
        load).  The tile index is stored before the barrier arrive, whose release orders it for the
        consumers' wait."""
        pipe_q.sync_object_empty.wait(q_state.index, q_state.phase)
        if const_expr(self.cfg.trace):
            if t >= 0:
                self._stamp(mMaskT, t, 13, cute.arch.lane_idx() == 0)
        s_tile[self._slot(q_state)] = t
        if t >= 0:
            if const_expr(self.cfg.tile_info_smem):
                for k, col in enumerate(_INFO_COLS):
                    s_tile[self._slot(q_state) + 1 + k] = mWork[wi, col]
            TM, DQ = self.TM, self.DQ
            gQ = cute.local_tile(
                cute.domain_offset(((0, mWork[wi, W_Q_START]), 0), tma_Q[None, None, kvh]), (TM, DQ),
                (mWork[wi, W_ROW0] // TM, 0))
            tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                               cute.group_modes(gQ, 0, 2))
            if const_expr(self.cfg.q_stages > 1):
                tQsQ = tQsQ[None, q_state.index]
            pipe_q.sync_object_full.arrive(q_state.index, None)
            cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        else:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive(pipe_q.producer_get_barrier(q_state))

    @cute.jit
    def _tile(self, mWork, wi, window_left, s_tile=None, q_state=None):
        """(request, KV block range) of work row ``wi``: blocks ``[blk_lo, blk_lo + n_blk)`` hold every KV
        token some row of the tile can see; ``b < 0`` marks a padding row.  (Consumers pass their Q stage's
        ``s_tile``: :meth:`_field`.)"""
        cfg = self.cfg
        f = lambda col: self._field(mWork, wi, col, s_tile, q_state)  # noqa: E731
        b = f(W_BATCH)
        blk_lo, n_blk = masks.kv_block_range(f(W_ROW0), f(W_QO_LEN), f(W_KV_LEN), window_left,
                                             self.G, self.TM, self.TN, self.mask_causal, cfg.use_window)
        return b, blk_lo, n_blk

    # ------------------------------------------------------------------ producer
    @cute.jit
    def _produce(self, tma_K, tma_V, tma_atom_K, tma_atom_V, sK, sV, pipe_k, pipe_v, kvh, kv_start, blk_lo, n_blk,
                 state):
        """Warp 0: TMA the tile's K and V blocks right to left into the stage ring (``state``: the ring
        position, carried from tile to tile; returned advanced)."""
        TN, DQ, DV = self.TN, self.DQ, self.DV
        gK = cute.local_tile(cute.domain_offset((kv_start, 0), tma_K[None, None, kvh]), (TN, DQ), (None, 0))
        gV = cute.local_tile(cute.domain_offset((kv_start, 0), tma_V[None, None, kvh]), (TN, DV), (None, 0))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                           cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                           cute.group_modes(gV, 0, 2))
        for i in cutlass.range(n_blk, unroll=1):
            n = blk_lo + n_blk - 1 - i
            pipe_k.producer_acquire(state)
            cute.copy(tma_atom_K, tKgK[None, n], tKsK[None, state.index], tma_bar_ptr=pipe_k.producer_get_barrier(state))
            pipe_v.producer_acquire(state)
            cute.copy(tma_atom_V, tVgV[None, n], tVsV[None, state.index], tma_bar_ptr=pipe_v.producer_get_barrier(state))
            state.advance()
        return state

    @cute.jit
    def _produce_paged(self, mK, mV, mIdx, sK_addr, sV_addr, pipe_k, pipe_v, kvh, page_off, kv_len, blk_lo, n_blk,
                       tid, state, tma_K, tma_V, tma_atom_K, tma_atom_V, sK, sV):
        """Producer warpgroup, paged K/V, blocks right to left.  A block that ends past the request is
        gathered through the page table with cp.async into the swizzled layout the TMA writes, zero past
        the request (so no stale value of the last page reaches P V).  With ``page_rows > 0`` every full
        block loads by TMA instead, one box of ``page_rows`` rows per page (one lane expects the
        transaction bytes, warp 0 issues the boxes, all 128 threads arrive), else it is gathered too."""
        TN, DQ, DV = self.TN, self.DQ, self.DV
        for i in cutlass.range(n_blk, unroll=1):
            tok0 = (blk_lo + n_blk - 1 - i) * TN
            tma_block = False
            if const_expr(self.cfg.page_rows > 0):
                tma_block = tok0 + TN <= kv_len
            self._paged_block(pipe_k, state, tma_block, tma_atom_K, tma_K, sK, self.k_bytes, mK, sK_addr, DQ, mIdx,
                              page_off, tok0, kv_len, kvh, tid)
            self._paged_block(pipe_v, state, tma_block, tma_atom_V, tma_V, sV, self.v_bytes, mV, sV_addr, DV, mIdx,
                              page_off, tok0, kv_len, kvh, tid)
            state.advance()
        return state

    @cute.jit
    def _paged_block(self, pipe, state, tma_block, tma_atom, tma_X, sX, nbytes, mX, s_addr, D: cutlass.Constexpr,
                     mIdx, page_off, tok0, kv_len, kvh, tid):
        """One K or V block of :meth:`_produce_paged` into stage ``state``: TMA per page, or the cp.async
        gather (committed as the stage's cp.async arrivals)."""
        pipe.producer_acquire(state)
        if tma_block:
            self._load_pages(tma_atom, tma_X, sX, pipe, state, nbytes, mIdx, page_off, tok0, kvh)
        else:
            self._gather(mX, mIdx, s_addr + state.index * (self.TN * D * 2), D, tok0, kv_len, page_off, kvh, tid)
            pipe.producer_commit(state)

    @cute.jit
    def _load_pages(self, tma_atom, tma_X, sX, pipe, state, nbytes, mIdx, page_off, tok0, kvh):
        """TMA one full block of ``tile_n`` paged tokens starting at ``tok0`` into stage ``state``: box ``j``
        (``page_rows`` rows) from page ``mIdx[page_off + (tok0 + j * page_rows) // page_size]`` into rows
        ``j * page_rows ..`` of the stage (1 KiB aligned: ``page_rows`` is a multiple of 8)."""
        R, PS, TN = self.cfg.page_rows, self.cfg.page_size, self.TN
        if const_expr(R > 0):  # (traced only where full blocks can load by TMA)
            bar = pipe.producer_get_barrier(state)
            # the whole of warp 0 issues: the TMA copy (and elect_one) elect a lane with elect.sync, which
            # needs every lane of the warp (called from one lane it hangs)
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_expect_tx(bar, nbytes)
                for j in cutlass.range_constexpr(TN // R):
                    tok = tok0 + j * R
                    page = mIdx[page_off + tok // PS]
                    gX = cute.local_tile(tma_X[None, None, kvh, page], (R, tma_X.shape[1]), (tok % PS // R, 0))
                    dst = cute.local_tile(sX[None, None, state.index], (R, sX.shape[1]), (j, 0))
                    tXs, tXg = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                                                     cute.group_modes(gX, 0, 2))
                    cute.copy(tma_atom, tXg, tXs, tma_bar_ptr=bar)
            cute.arch.mbarrier_arrive(bar)  # all 128 producer threads, as the cp.async arrivals of a gather

    @cute.jit
    def _gather(self, mX, mIdx, s_addr, D: cutlass.Constexpr, tok0, kv_len, page_off, kvh, tid):
        """cp.async one (tile_n, D) block of a paged cache, 16 bytes per copy, 128 producer threads."""
        TN, PS = self.TN, self.cfg.page_size
        cpr = D // 8
        base = mX.iterator.toint()
        # a rolled loop: unrolled, the page-id loads and 64-bit addresses of every copy stay live and
        # spill out of the producer's small register budget
        for it in cutlass.range((TN * cpr) // 128, unroll=2):
            idx = it * 128 + tid
            r = idx // cpr
            c = idx % cpr
            goff, valid = paging.kv_chunk_offset(mX, mIdx, tok0 + r, kv_len, page_off, kvh, c, PS)
            soff = _sw128_offset(r, c, TN)
            ptx.cp_async_16(s_addr + soff, base + goff * 2, cutlass.select_(valid, 16, 0))

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def _consume(self, mK, mO, tma_O, tma_atom_O, sO_layout, mLSE, mSinks, mMask, sQ, sQ_addr, sK, sV, pipe_q, q_state,
                 s_tile, pipe_k, pipe_v, tiled_mma_qk, tiled_mma_pv,
                 mWork, tile, wi, kvh, blk_lo, n_blk, sm_scale, soft_cap, window_left, tid, wg, state, pin_bar=None):
        """Consumer warpgroups, tile ``tile`` (work row ``wi``, kv head ``kvh``; its Q has landed): KV blocks
        right to left with S of block j+1 and P V of block j in flight together (intra-warpgroup overlap),
        GEMM issue handed between warpgroups (ping-pong); Q is released to the producer after the last S
        GEMM, so the next tile's Q loads during the last P V and the epilogue (with ``smem_epilogue`` after
        the epilogue, which stages O in Q's rows: the next tile's Q then needs a second Q stage to load
        early).  ``state``: the K/V ring position, carried from tile to tile; returned advanced.  ``pin_bar``: the
        dummy mbarrier of ``pins_pv_wait`` (else None)."""
        cfg = self.cfg
        row0 = self._field(mWork, wi, W_ROW0, s_tile, q_state)
        qo_len = self._field(mWork, wi, W_QO_LEN, s_tile, q_state)
        kv_len = self._field(mWork, wi, W_KV_LEN, s_tile, q_state)
        TM, TN, DV, G = self.TM, self.TN, self.DV, self.G
        wg_layout = cute.make_layout(self.NWG, stride=128)
        wg_mma_qk = tiled_mma_qk.get_slice(wg_layout(wg))
        wg_mma_pv = tiled_mma_pv.get_slice(wg_layout(wg))
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        if const_expr(cfg.q_stages > 1):
            tSrQ = tSrQ[None, None, None, q_state.index]
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(_transpose_view(sV)))
        acc_S = cute.make_rmem_tensor(wg_mma_qk.partition_shape_C((TM, TN)), Float32)
        acc_O = cute.make_rmem_tensor(wg_mma_pv.partition_shape_C((TM, DV)), Float32)
        tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((TM, TN)))
        acc_O.fill(0.0)
        acc_S.fill(0.0)  # defined input of the first (non-accumulating) S GEMM: no live range across tiles

        lane = tid % 32
        warp = tid // 32  # consumer warp: rows warp*16 .. +16 of the tile
        g = lane // 4
        t = lane % 4
        row_m = cute.make_rmem_tensor((2,), Float32)
        row_l = cute.make_rmem_tensor((2,), Float32)
        row_scale = cute.make_rmem_tensor((2,), Float32)
        qpos = cute.make_rmem_tensor((2,), Int32)
        row_bit = cute.make_rmem_tensor((2,), cutlass.Int64)  # custom mask: first bit of each row's mask
        for h in cutlass.range_constexpr(2):
            row_m[h] = Float32(NEG_INF)
            row_l[h] = Float32(0.0)
            qpos[h] = (row0 + warp * 16 + g + 8 * h) // G + kv_len - qo_len
            if const_expr(cfg.use_custom_mask):  # padding rows read the request's last row
                qtok = cutlass.min((row0 + warp * 16 + g + 8 * h) // G, qo_len - 1)
                row_bit[h] = masks.custom_row_bit(self._field(mWork, wi, W_MASK_OFF, s_tile, q_state), qtok, kv_len)
        mask = (mMask, row_bit)
        if const_expr(cfg.score_mod is not None):
            # score_mod's indices of the lane's two rows: request, query head and (qpos) the query's bottom-right
            # position on the key axis
            q_head = cute.make_rmem_tensor((2,), Int32)
            for h in cutlass.range_constexpr(2):
                q_head[h] = kvh * G + (row0 + warp * 16 + g + 8 * h) % G
            mask = (mMask, row_bit, self._field(mWork, wi, W_BATCH, s_tile, q_state), q_head, qpos)

        sc_in, sc_out = sm.logit_scales(sm_scale, soft_cap, cfg.use_soft_cap, cfg.score_mod is not None)
        # first / last query position of the tile (blocks ending before the first need no causal mask)
        pos_first = row0 // G + kv_len - qo_len
        pos_last = (cutlass.min(row0 + TM, qo_len * G) - 1) // G + kv_len - qo_len

        # epi_coords_early: the epilogue's coordinates, read in either branch below (a placeholder before: the
        # DSL needs the values defined ahead of a dynamic branch that assigns them)
        epi = (Int32(0),) * 6
        if n_blk > 0:
            n = blk_lo + n_blk - 1
            self._first_s(tiled_mma_qk, acc_S, tSrQ, tSrK, pipe_k, state, wg, mMask, tile, tid)
            warpgroup.wait_group(0)
            self._stamp(mMask, tile, 4 * wg + 1, tid % 128 == 0)
            pipe_k.consumer_release(state)
            self._softmax_block(acc_S, row_m, row_l, row_scale, n * TN, kv_len, qpos, pos_first, pos_last, sc_in,
                                sc_out, window_left, t, mask, "dynamic")
            self._to_p(acc_S, tOrP)
            blk = (acc_S, acc_O, tOrP, tSrQ, tSrK, tOrVt, tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, row_m, row_l,
                   row_scale, kv_len, qpos, pos_first, pos_last, sc_in, sc_out, window_left, t, mask, wg, pin_bar)
            if const_expr(cfg.loop_split):
                # the blocks needing the sequence-end / causal mask (counted from the right), then the rest
                n_r = n_blk  # (a custom mask masks every block)
                if const_expr(not cfg.use_custom_mask):
                    n_r = masks.num_right_masked(blk_lo, n_blk, kv_len, pos_first, TN, causal=self.mask_causal)
                n_r = cutlass.max(n_r, 1)
                for i in cutlass.range(n_r - 1, unroll=1):
                    state = self._mainloop_block(*blk, state, blk_lo, n_blk, 2, i, "all")
                for i in cutlass.range(n_blk - n_r, unroll=1):
                    state = self._mainloop_block(*blk, state, blk_lo, n_blk, n_r + 1, i, "window")
            else:
                for i in cutlass.range(n_blk - 1, unroll=1):
                    state = self._mainloop_block(*blk, state, blk_lo, n_blk, 2, i, "dynamic")
            if const_expr(not cfg.smem_epilogue):
                if const_expr(cfg.epi_coords_early):
                    epi = self._epi_coords(mK, mWork, tile, tid, s_tile, q_state)
                    if const_expr(cfg.tile_info_smem):
                        cute.arch.sync_warp()  # every lane's reads of the Q stage's fields before lane 0's release
                pipe_q.consumer_release(q_state)  # the last S GEMM is complete
            if const_expr(cfg.rescale_o_before_pv):
                self._rescale_o(acc_O, row_scale)
            pipe_v.consumer_wait(state)
            self._proxy_fence()
            self._turn_begin(wg)
            self._gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, state.index], False)
            self._turn_end(wg)
            warpgroup.wait_group(0)
            self._stamp(mMask, tile, 4 * wg + 2, tid % 128 == 0)
            pipe_v.consumer_release(state)
            state.advance()
        else:
            # no GEMM read Q; the warp's lanes have all read the tile index (s_tile) before lane 0's release
            # lets the producer overwrite it (with epi_coords_early also the fields read here)
            if const_expr(cfg.epi_coords_early and not cfg.smem_epilogue):
                epi = self._epi_coords(mK, mWork, tile, tid, s_tile, q_state)
            cute.arch.sync_warp()
            if const_expr(not cfg.smem_epilogue):
                pipe_q.consumer_release(q_state)
        self._tile_epilogue(mK, mO, tma_O, tma_atom_O, sO_layout, mLSE, mSinks, mMask, mWork, sQ_addr, pipe_q, q_state,
                            s_tile, acc_O, row_m, row_l, tile, tid, wg, epi)
        return state

    @cute.jit
    def _tile_epilogue(self, mK, mO, tma_O, tma_atom_O, sO_layout, mLSE, mSinks, mMask, mWork, sQ_addr, pipe_q, q_state,
                       s_tile, acc_O, row_m, row_l, tile, tid, wg, epi):
        """Normalise O by the row sums and store it and the LSE (staged through the Q rows with
        ``smem_epilogue``, which then releases the Q stage; with ``tma_epilogue`` a warp whose rows all lie in
        the request stores them by TMA, :meth:`_tma_store_o`).  ``epi``: the coordinates read before the Q
        stage's release (``epi_coords_early``), else unused."""
        cfg = self.cfg
        sm.quad_sum_rows(row_l)
        # re-derive the tile's coordinates from the (opaque) tile index rather than keep them live through
        # the main loop, where the consumer's registers run out
        # (the Q stage, and with it s_tile's copy of the fields, is still held only with smem_epilogue)
        if const_expr(cfg.epi_coords_early and not cfg.smem_epilogue):
            e_row0, e_qo_len, e_q_start, e_kvh, e_lane, e_warp = epi
        else:
            e_row0, e_qo_len, e_q_start, e_kvh, e_lane, e_warp = self._epi_coords(
                mK, mWork, tile, tid, s_tile if const_expr(cfg.smem_epilogue) else None, q_state)
        self._stamp_fine(mMask, tile, 8, tid)
        if const_expr(cfg.smem_epilogue):
            # the warpgroup's Q rows are free once all its warps are past the last S GEMM; each warp stages its
            # 16 rows of O there (own bytes), then releases Q once its reads of them are done
            cute.arch.barrier(barrier_id=2 + self.NWG + wg, number_of_threads=128)
            self._stamp_fine(mMask, tile, 9, tid)
            s_base = sQ_addr + self._staging_offset(q_state, wg, e_warp)
            lse0, lse1 = epilogue.stage_rows(mSinks, acc_O, row_m, row_l, e_row0, e_kvh, e_lane, e_warp, s_base,
                                             self.DV, self.G, cfg.use_sinks, self.dtype)
            if const_expr(cfg.tma_epilogue):
                ptx.fence_proxy_async_shared()  # the stmatrix writes, before the TMA store (async proxy) reads
            cute.arch.sync_warp()
            self._stamp_fine(mMask, tile, 10, tid)
            if const_expr(cfg.tma_epilogue):
                if e_row0 + e_warp * 16 + 16 <= e_qo_len * self.G:  # all 16 rows in the request
                    self._tma_store_o(tma_O, tma_atom_O, sO_layout, s_base, e_row0, e_q_start, e_kvh, e_lane, e_warp)
                else:
                    epilogue.store_staged_rows(mO, e_row0, e_qo_len, e_q_start, e_kvh, e_lane, e_warp, s_base,
                                               self.DV, self.G)
            else:
                epilogue.store_staged_rows(mO, e_row0, e_qo_len, e_q_start, e_kvh, e_lane, e_warp, s_base, self.DV,
                                           self.G)
            self._stamp_fine(mMask, tile, 11, tid)
            epilogue.store_lse(mLSE, lse0, lse1, e_row0, e_qo_len, e_q_start, e_kvh, e_lane, e_warp, self.G)
            ptx.fence_proxy_async_shared()  # before the next TMA load overwrites the staged rows
            cute.arch.sync_warp()  # every lane's reads and fence before lane 0's release
            pipe_q.consumer_release(q_state)
        else:
            self._epilogue(mO, mLSE, mSinks, acc_O, row_m, row_l, e_row0, e_qo_len, e_q_start, e_kvh, e_lane, e_warp)
        self._stamp(mMask, tile, 4 * wg + 3, tid % 128 == 0)

    @cute.jit
    def _tma_store_o(self, tma_O, tma_atom_O, sO_layout, s_base, row0, q_start, kvh, lane, warp):
        """``tma_epilogue``: store the warp's 16 staged rows (all inside the request) with TMA, one box per 64
        columns, and wait until the boxes have been read out of shared memory, so the Q stage they occupy can
        be released."""
        TMW = 16
        ptr = cute.make_ptr(self.dtype, s_base, cute.AddressSpace.smem, assumed_align=1024)
        sO = cute.make_tensor(cute.recast_ptr(ptr, sO_layout.inner, dtype=self.dtype), sO_layout.outer)
        gO = cute.local_tile(cute.domain_offset(((0, q_start), 0), tma_O[None, None, kvh]), (TMW, self.DV),
                             ((row0 + warp * TMW) // TMW, 0))
        tOsO, tOgO = cpasync.tma_partition(tma_atom_O, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                                           cute.group_modes(gO, 0, 2))
        # one lane issues (the DSL 4.8.1 emits the store unpredicated: every calling lane would store) and
        # waits for its bulk group's reads; the caller's warp sync then orders the release after them
        if lane == 0:
            cute.copy(tma_atom_O, tOsO, tOgO)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _first_s(self, tiled_mma_qk, acc_S, tSrQ, tSrK, pipe_k, state, wg, mMask, tile, tid):
        """Issue a tile's first S GEMM (its last K block, stage ``state``) in the warpgroup's ping-pong turn;
        the caller waits."""
        pipe_k.consumer_wait(state)
        self._proxy_fence()
        self._turn_begin(wg)
        self._stamp_fine(mMask, tile, 15, tid)
        self._gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], True)
        self._turn_end(wg)

    @cute.jit
    def _tile_coords(self, t, W, mK):
        """(work row, kv head) of tile ``t`` of ``W`` work rows per kv head: work row fastest (``t % W``,
        ``t // W``), or with ``head_section_mib`` by sections of S kv heads (:attr:`Sm90PrefillConfig.
        head_section_mib`; ragged K/V): section ``t // (W * S)`` (the last one also takes the ``hkv % S``
        remainder heads), inside it work row ``idx // s`` of kv head ``h0 + idx % s``.  S is derived from
        kernel parameters (K's token count, the head dims), so callers need not keep it live."""
        res = (t % W, t // W)
        if const_expr(self.cfg.head_section_mib > 0):
            hkv = mK.shape[1]
            # one kv head's K+V bytes per token: (DQ + DV) * 2; the budget in tokens is a compile-time int
            budget_tok = (self.cfg.head_section_mib << 20) // ((self.DQ + self.DV) * 2)
            sec_heads = cutlass.max(cutlass.min(Int32(budget_tok) // cutlass.max(mK.shape[0], 1), hkv), 1)
            n_sec = hkv // sec_heads
            sec = cutlass.min(t // (W * sec_heads), n_sec - 1)
            h0 = sec * sec_heads
            s_eff = sec_heads
            if sec == n_sec - 1:
                s_eff = hkv - h0
            idx = t - h0 * W
            res = (idx // s_eff, h0 + idx % s_eff)
        return res

    @cute.jit
    def _epi_coords(self, mK, mWork, tile, tid, s_tile=None, q_state=None):
        """(row0, qo_len, q_start, kv head, lane, consumer warp) of tile ``tile`` for the epilogue (the
        fields from ``s_tile`` where given: :meth:`_field`)."""
        wi, kvh = self._tile_coords(ptx.opaque_i32(tile), mWork.shape[0], mK)
        row0 = self._field(mWork, wi, W_ROW0, s_tile, q_state)
        qo_len = self._field(mWork, wi, W_QO_LEN, s_tile, q_state)
        q_start = self._field(mWork, wi, W_Q_START, s_tile, q_state)
        lane = ptx.opaque_i32(tid) % 32
        warp = ptx.opaque_i32(tid) // 32
        return row0, qo_len, q_start, kvh, lane, warp

    def _staging_offset(self, q_state, wg, warp):
        """Byte offset in ``sQ`` of consumer warp ``warp``'s ``16 x head_dim_vo`` staging rows: inside its
        warpgroup's 64 Q rows of the current Q stage, which the K-major 128-byte-swizzled layout stores as
        ``head_dim_qk / 64`` runs of 8 KiB (64 rows x 64 columns each, one per 64-column atom at ``atom *
        tile_m * 128``), ``256 / head_dim_vo`` warps per run."""
        TM, DQ, DV = self.TM, self.DQ, self.DV
        per_run = 256 // DV
        wl = warp % 4
        off = (wl // per_run) * (TM * 128) + wg * (64 * 128) + (wl % per_run) * (32 * DV)
        return off + self._q_index(q_state) * (TM * DQ * 2)

    @cute.jit
    def _stamp(self, mMask, t, slot: cutlass.Constexpr, pred):
        """``trace``: ``%clock64`` into 64-bit slot ``slot`` of tile ``t``'s 128-byte record in ``mMask``
        (slots 4 wg + 0..3: consumer warpgroup ``wg`` at the tile's start (Q landed), its first S GEMM done,
        its last P V done, its epilogue done; 12: the CTA index (32-bit); 13: the producer handing Q over)."""
        if const_expr(self.cfg.trace):
            if pred:
                ptx.stamp_clock64(self._record_addr(mMask, t, slot))

    def _stamp_fine(self, mMask, t, slot: cutlass.Constexpr, tid):
        """``trace`` with two consumer warpgroups: a finer stamp of warpgroup 0's thread 0 into slot ``slot``
        (8..11: the epilogue's coordinates loaded, its warpgroup barrier passed, O staged, O stored; 14: the
        tile's block range known; 15: the first S GEMM's ping-pong turn taken).  No code without ``trace``."""
        if const_expr(self.cfg.trace and self.NWG == 2):
            self._stamp(mMask, t, slot, tid == 0)  # consumer thread 0: warpgroup 0

    def _record_addr(self, mMask, t, slot: int):
        """``trace``: global byte address of 64-bit slot ``slot`` of tile ``t``'s 128-byte record in ``mMask``."""
        return mMask.iterator.toint() + t * 128 + slot * 8

    @cute.jit
    def _mainloop_block(self, acc_S, acc_O, tOrP, tSrQ, tSrK, tOrVt, tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v,
                        row_m, row_l, row_scale, kv_len, qpos, pos_first, pos_last, sc_in, sc_out, window_left, t,
                        mask, wg, pin_bar, state, blk_lo, n_blk, skip, i, mask_mode: cutlass.Constexpr):
        """One main-loop block, ``n = blk_lo + n_blk - skip - i`` (``state``: the K stage of the previous
        block; returned advanced): S of
        this block and P V of the previous one issued together in this warpgroup's ping-pong turn, this
        block's softmax while P V runs.  ``mask_mode``: see :meth:`_softmax_block`.  ``v_wait_late`` /
        ``k_release_early`` / ``loop_split`` (the caller) are variants of FlashAttention's loop order
        (session 5), timed on the H200 in session 6: the head_dim 64 default uses ``loop_split`` and
        ``v_wait_late`` (3% faster there), elsewhere they measured 0-3% slower."""
        cfg = self.cfg
        state_v = state.clone()
        state.advance()
        n = blk_lo + n_blk - skip - i
        pipe_k.consumer_wait(state)
        if const_expr(not cfg.v_wait_late):
            pipe_v.consumer_wait(state_v)
        self._proxy_fence()
        self._turn_begin(wg)
        self._gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], True)
        if const_expr(cfg.rescale_o_before_pv):  # the previous block's factor, while S is in flight
            self._rescale_o(acc_O, row_scale)
        if const_expr(cfg.v_wait_late):  # (FlashAttention's order: V waited for inside the turn, after S)
            pipe_v.consumer_wait(state_v)
            self._proxy_fence()
        self._gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, state_v.index], False)
        self._turn_end(wg)
        warpgroup.wait_group(1)
        if const_expr(cfg.k_release_early):
            pipe_k.consumer_release(state)
        stale = const_expr(cfg.stale_max and mask_mode != "all")
        # p_tail: blocks that are never masked (loop_split's unmasked loop without a window) convert all but the
        # last p_tail n8 tiles of P while those tiles' exponentials run (P V waited for there)
        early = const_expr(stale and cfg.p_tail > 0 and mask_mode == "window" and not cfg.use_window)
        n_early = self.TN // 8 - cfg.p_tail
        pin = const_expr(early and cfg.pins_pv_wait)
        n_wait = max(1, n_early - cfg.p_wait_lead)
        if const_expr(early):
            def after_tile(j, l_run):
                if const_expr(j == (n_wait if pin else n_early) - 1):
                    if const_expr(pin):
                        self._pin_arrive(pin_bar, l_run[0] + l_run[1], sc_in)
                    warpgroup.wait_group(0)
                    if const_expr(pin):
                        pipe_v.consumer_release(state_v)  # (after the wait: P V has read the stage)
                    self._to_p(acc_S, tOrP, 0, 2 * (j + 1))
                elif const_expr(pin and n_wait <= j < n_early):
                    self._to_p(acc_S, tOrP, 2 * j, 2 * (j + 1))

            redo = sm.stale_max_step(acc_S, self.TN // 8, row_m, row_l, row_scale, sc_in,
                                     lambda b: self._wg_any(b, wg), after_tile, running_sums=pin)
        else:
            redo = self._softmax_block(acc_S, row_m, row_l, row_scale, n * self.TN, kv_len, qpos, pos_first,
                                       pos_last, sc_in, sc_out, window_left, t, mask, mask_mode, stale, wg)
        if const_expr(stale):
            if redo:  # a row's max moved too far (warpgroup-uniform: _wg_any): S again from the still-held K stage
                # and the exact step (issued outside the ping-pong turn: a rare path)
                self._gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], True)
                warpgroup.wait_group(0)
                self._exact_block(acc_S, row_m, row_l, row_scale, n * self.TN, kv_len, qpos, window_left, t, mask,
                                  sc_in, sc_out, False)
                if const_expr(early):
                    self._to_p(acc_S, tOrP, 0, 2 * n_early)  # the exact P of those tiles
        # released here by default, not right after wait_group(1): ptxas keeps the wait for P V right behind
        # this mbarrier arrive and hoists the arrive as far as its inputs allow, so its position decides how
        # much of the softmax runs while P V is in flight (right after wait_group(1): only the row max,
        # 1-7% slower at head_dim 128 in session 3; here ptxas keeps part of the exponentials before the wait
        # at head_dim 128/256 and none at head_dim 64 causal).  Pinning the arrive (or a second one) to the
        # row sums puts every exponential before the wait and measured 2-6% slower on every benchmark row
        # (perf/RESULTS.md, session 5); p_tail's mid-softmax wait is pinned that way on purpose (p_wait_lead,
        # a dummy mbarrier's arrive: _pin_arrive)
        if const_expr(not cfg.k_release_early):
            pipe_k.consumer_release(state)
        # (with p_tail waited for already; without this second wait ptxas built the next turn's GEMM descriptors
        # in vector registers and moved them over with R2UR, session 13)
        warpgroup.wait_group(0)
        if const_expr(not pin):
            pipe_v.consumer_release(state_v)
        if const_expr(not cfg.rescale_o_before_pv):
            self._rescale_o(acc_O, row_scale)
        self._to_p(acc_S, tOrP, 2 * n_early if early else 0)  # (early: the tail tiles' words only)
        return state

    @cute.jit
    def _pin_arrive(self, bar, x, positive):
        """``pins_pv_wait``: lane 0 arrives on the dummy mbarrier ``bar`` (count 1: every arrive completes a phase;
        nothing waits on it) once ``x`` (a sum of probabilities: never negative) is computed -- ptxas keeps the
        wgmma wait that follows behind an mbarrier arrive and the arrive behind its inputs, so the wait for P V
        stays after the exponentials ``x`` sums (session 13; the V stage itself is released after the wait: P V
        reads it until then).  The predicate, ``not x < -positive`` (a run-time value > 0, stale_max's logit
        scale), always holds (NaN too) but is not provable: against a constant 0 ptxas folded it (it knows
        ``ex2`` is never negative) and moved the arrive up to the first exponentials."""
        if cute.arch.lane_idx() == 0:
            if not (x < -positive):
                cute.arch.mbarrier_arrive(bar)

    @cute.jit
    def _rescale_o(self, acc_O, row_scale):
        """O rows times their factors; with ``rescale_threshold`` or ``stale_max`` only where some row of the
        warp moved its max (a factor other than exactly 1; a warp-uniform branch)."""
        if const_expr(self.cfg.rescale_threshold > 0 or self.cfg.stale_max):
            if cute.arch.vote_any_sync((row_scale[0] != Float32(1.0)) | (row_scale[1] != Float32(1.0))):
                sm.rescale_rows(acc_O, self.DV // 8, row_scale)
        else:
            sm.rescale_rows(acc_O, self.DV // 8, row_scale)

    @cute.jit
    def _proxy_fence(self):
        """Paged K/V arrive through cp.async (generic proxy); wgmma reads shared memory through the async
        proxy: order the two after the full-barrier wait."""
        if const_expr(self.paged):
            cute.arch.fence_view_async_shared()

    @cute.jit
    def _turn_begin(self, wg):
        """Ping-pong: wait until the previous warpgroup has issued its GEMMs (named barrier 2 + wg)."""
        if const_expr(self.cfg.pingpong):
            cute.arch.barrier(barrier_id=2 + wg, number_of_threads=256)

    @cute.jit
    def _turn_end(self, wg):
        """Ping-pong: hand the tensor cores to the next warpgroup."""
        if const_expr(self.cfg.pingpong):
            nxt = Int32(cutlass.select_(wg == self.NWG - 1, 0, wg + 1))
            cute.arch.barrier_arrive(barrier_id=2 + nxt, number_of_threads=256)

    @cute.jit
    def _gemm(self, tiled_mma, acc, tA, tB, zero_init):
        """Issue one warpgroup GEMM (k-blocks unrolled) and commit it; the caller waits.  ``zero_init``
        (static or dynamic) overwrites ``acc`` instead of accumulating: the accumulators are only ever
        written by wgmma between pipeline stages, so ptxas keeps the wgmma pipeline (no serialisation)."""
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for k in cutlass.range_constexpr(cute.size(tA.shape[2])):
            cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def _softmax_block(self, acc_S, row_m, row_l, row_scale, tok0, kv_len, qpos, pos_first, pos_last, sc_in, sc_out,
                       window_left, t, mask, mask_mode: cutlass.Constexpr, stale: cutlass.Constexpr = False, wg=None):
        """Scale and mask S of the block starting at KV token ``tok0``, then the online softmax step;
        ``row_scale`` receives the factor for the O rows.  ``mask_mode``: ``"dynamic"`` masks where the block
        needs it (sequence end, causal diagonal, window; every block with a custom mask: ``mask = (mMask,
        row_bit)``); ``loop_split``'s ``"all"`` always, and ``"window"`` only where the sliding window cuts
        the block (no mask code at all without a window or custom mask).  ``stale`` (``stale_max``): a block
        needing no mask takes :func:`common.softmax.stale_max_step`; returns its redo flag (False where the
        block took the exact step), agreed by the warpgroup ``wg`` (the redo is a warpgroup GEMM):
        :meth:`_wg_any`."""
        cfg = self.cfg
        TN = self.TN
        n8 = TN // 8
        if const_expr(mask_mode == "all" or cfg.use_custom_mask):
            need_mask = True
        elif const_expr(mask_mode == "window"):
            need_mask = False
            if const_expr(cfg.use_window):
                need_mask = self._window_cuts(tok0, pos_last, window_left, kv_len)
        else:
            need_mask = tok0 + TN > kv_len
            if const_expr(self.mask_causal):
                need_mask = need_mask | (tok0 + TN - 1 > pos_first)
            if const_expr(cfg.use_window):
                need_mask = need_mask | self._window_cuts(tok0, pos_last, window_left, kv_len)
        exact = (acc_S, row_m, row_l, row_scale, tok0, kv_len, qpos, window_left, t, mask, sc_in, sc_out)
        redo = cutlass.Boolean(False)
        if const_expr(stale and isinstance(need_mask, bool)):  # "window" mode without a window: never masked
            redo = sm.stale_max_step(acc_S, n8, row_m, row_l, row_scale, sc_in, lambda b: self._wg_any(b, wg))
        elif const_expr(stale):  # (plain logits: no soft cap / score_mod / custom mask, unsupported_reason)
            if need_mask:
                self._exact_block(*exact, True)
            else:
                redo = sm.stale_max_step(acc_S, n8, row_m, row_l, row_scale, sc_in, lambda b: self._wg_any(b, wg))
        else:
            self._exact_block(*exact, need_mask)
        return redo

    @cute.jit
    def _exact_block(self, acc_S, row_m, row_l, row_scale, tok0, kv_len, qpos, window_left, t, mask, sc_in, sc_out,
                     need_mask):
        """The exact online softmax step (row max first) of the block starting at KV token ``tok0``, after the
        soft cap / ``score_mod`` and, where ``need_mask``, the masks (:meth:`_mask_scores`)."""
        cfg = self.cfg
        n8 = self.TN // 8
        if need_mask:
            self._mask_scores(acc_S, tok0, kv_len, qpos, window_left, t, mask, sc_in, sc_out)
        else:
            if const_expr(cfg.use_soft_cap):
                for i in cutlass.range_constexpr(4 * n8):
                    acc_S[i] = ptx.tanh(acc_S[i] * sc_in) * sc_out
            if const_expr(cfg.score_mod is not None):
                for j in cutlass.range_constexpr(n8):
                    for e in cutlass.range_constexpr(4):
                        acc_S[4 * j + e] = self._score_mod(acc_S[4 * j + e], sc_in, mask, e // 2,
                                                           tok0 + 2 * t + j * 8 + (e % 2))
        # without a soft cap S stays raw and the scale is folded into the exponent (fma + ex2); with a score_mod
        # the logits are in natural-log units and log2(e) is folded there
        logit_scale = None if cfg.use_soft_cap else (sc_out if cfg.score_mod is not None else sc_in)
        sm.online_softmax_step(acc_S, n8, row_m, row_l, row_scale, logit_scale, cfg.ex2_poly, cfg.rescale_threshold)

    def _wg_any(self, pred, wg):
        """Whether ``pred`` holds in any thread of consumer warpgroup ``wg`` (``bar.red.or`` on named barrier
        ``2 + 2 * num_wg + wg``: ids 2.. are the ping-pong turns, 2 + num_wg.. the epilogue's)."""
        return ptx.barrier_or(cutlass.select_(pred, Int32(1), Int32(0)), 2 + 2 * self.NWG + wg, 128) != Int32(0)

    @cute.jit
    def _mask_scores(self, acc_S, tok0, kv_len, qpos, window_left, t, mask, sc_in, sc_out):
        """Soft cap / ``score_mod`` and the masks of a block's scores (-inf where hidden)."""
        cfg = self.cfg
        n8 = self.TN // 8
        # the lane's scores of row h are keys tok0 + 2t + c with c = 8j + (e % 2) known at trace time:
        # one compare per bound and score (visible_range), no per-score key arithmetic
        bounds = [masks.visible_range(tok0 + 2 * t, kv_len, qpos[h], window_left, causal=self.mask_causal,
                                      use_window=cfg.use_window) for h in range(2)]
        for j in cutlass.range_constexpr(n8):
            for e in cutlass.range_constexpr(4):
                h = e // 2
                c = j * 8 + (e % 2)
                lo, hi = bounds[h]
                x = acc_S[4 * j + e]
                if const_expr(cfg.use_soft_cap):
                    x = ptx.tanh(x * sc_in) * sc_out
                if const_expr(cfg.score_mod is not None):
                    x = self._score_mod(x, sc_in, mask, h, tok0 + 2 * t + c)
                ok = hi >= c
                if const_expr(lo is not None):
                    ok = ok & (lo <= c)
                if const_expr(cfg.use_custom_mask):
                    ok = ok & masks.custom_visible(mask[0], mask[1][h], kv_len, tok0 + 2 * t + c)
                acc_S[4 * j + e] = Float32(cutlass.select_(ok, x, Float32(NEG_INF)))

    def _score_mod(self, x, sc_in, mask, h: int, kv_idx):
        """``score_mod`` of one raw score of the lane's row ``h`` (indices from ``mask``: :meth:`_consume`), in
        natural-log units (``sc_out = log2 e`` is folded into the exponent)."""
        return sm.score_mod_logit(self.cfg.score_mod, x, sc_in, mask[2], mask[3][h], mask[4][h], kv_idx)

    def _window_cuts(self, tok0, pos_last, window_left, kv_len):
        """Whether the sliding window (``window_left >= 0``, clamped to ``kv_len`` as in :mod:`common.masks`)
        hides some key of the block starting at ``tok0`` from the tile's last query (at ``pos_last``)."""
        return (window_left >= 0) & (tok0 < pos_last - cutlass.min(window_left, kv_len))

    @cute.jit
    def _to_p(self, acc_S, tOrP, lo: int = 0, hi: int = -1):
        """P (fp32 accumulator registers) -> the 16-bit A fragment of the P V GEMM (same register order),
        two values per ``cvt.rn.bf16x2`` / ``cvt.rn.f16x2`` (inline PTX: LLVM cannot duplicate or sink the conversion, which
        in the persistent tile loop it did, keeping S and P live together and running out of registers)."""
        n = cute.size(acc_S)
        s_flat = cute.make_tensor(acc_S.iterator, cute.make_layout(n))
        p_words = cute.make_tensor(cute.recast_ptr(tOrP.iterator, dtype=Int32), cute.make_layout(n // 2))
        for i in cutlass.range_constexpr(lo, n // 2 if hi < 0 else hi):  # (words lo .. hi - 1: p_tail)
            p_words[i] = ptx.pack2(s_flat[2 * i], s_flat[2 * i + 1], self.dtype)

    # ------------------------------------------------------------------ epilogue
    @cute.jit
    def _epilogue(self, mO, mLSE, mSinks, acc, row_m, row_l, row0, qo_len, q_start, kvh, lane, warp):
        """Normalise (sinks folded in), write O and the LSE of the lane's rows (:func:`common.epilogue.store_rows`);
        rows that saw no key get an exact 0."""
        epilogue.store_rows(mO, mLSE, mSinks, acc, row_m, row_l, row0, qo_len, q_start, kvh, lane, warp,
                            self.DV, self.G, self.cfg.use_sinks, self.dtype, True)


def compile(cfg: Sm90PrefillConfig, *, keep_ptx_dir: str | None = None, keep_cubin: bool = False):
    """Compile :class:`Sm90PrefillKernel` for ``cfg`` from fake tensors (no GPU needed).

    Returns the tvm-ffi callable ``f(q, k, v, indices, work, o, lse, mask, sinks, sm_scale,
    soft_cap, window_left)``: the portable prefill kernel's signature without its positional-
    encoding arguments, and its work table (``indices``: the flat page table of paged K/V; ``mask``: the packed
    custom mask; dummies otherwise),
    launching on torch's current stream.
    """
    from cutlass.cute.runtime import make_fake_stream

    opts = compile_options(cfg.arch, keep_ptx_dir=keep_ptx_dir, keep_cubin=keep_cubin)
    return cute.compile(
        Sm90PrefillKernel(cfg), *prefill_tensors(cfg, WORK_COLS), Float32(1.0), Float32(0.0),
        Int32(-1), make_fake_stream(use_tvm_ffi_env_stream=True), options=opts,
    )
