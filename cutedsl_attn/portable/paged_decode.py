"""Portable paged-KV decode kernel (SM80-class instructions: ``cp.async``, ``ldmatrix``, ``mma.sync``).

Serves every decode problem (RoPE on an fp8 cache excepted) on every target (``sm_90a``, ``sm_100a``,
``sm_103a``); 16-bit caches verified on an H200 (SM90), fp8 caches and Blackwell builds cross-compiled and
PTX-checked only.  The module follows the kernel contract:
:data:`NAME`, :class:`Tiles`, :class:`Config`, :func:`unsupported_reason`, :func:`default_tiles`,
:func:`compile`, :func:`launch`.

Work decomposition (planned on the host by :mod:`cutedsl_attn.planning`):

* one CTA per (kv head, work item), kv heads fastest in the grid; a work item is a token range ``[tok_start,
  tok_end)`` of one request (a request is split across several items when the
  batch is too small to fill the GPU, "split-KV");
* the CTA's ``num_warps`` warps each stream 16-token chunks of that range
  (chunk ``c`` goes to warp ``c % num_warps``) through their own ``num_stages``-deep
  ``cp.async`` ring in shared memory, gathering rows through the page table, so
  no CTA-wide barrier sits in the main loop;
* all ``group_size`` query heads that share the kv head are packed into the 16
  rows of one ``mma.m16n8k16`` tile, so each K/V row is read from HBM once per
  group: S = Q K^T (Q from ``ldmatrix``, K from ``ldmatrix``), online softmax in
  fp32 with exp2, O += P V (P re-used from the S accumulators as the A operand,
  V from ``ldmatrix.trans``);
* the warps' (m, l, O) states are merged through shared memory (:mod:`.decode_merge`); a request with
  one work item writes O and LSE directly, otherwise each item writes an fp32
  partial and the last CTA to finish (a per-(request, kv head) counter with
  ``atom.add``) merges the partials, so split-KV needs no second launch.  The
  counter is reset by that CTA, which keeps the kernel CUDA-graph replayable.

Conventions (FlashInfer): LSE is base 2 over the visible keys, sinks included;
sinks are natural-log logits not multiplied by ``sm_scale``; soft cap
``cap * tanh(s / cap)`` applies to the scaled logit; ALiBi adds
``slope_h * (j - (kv_len - 1))``; ROPE_LLAMA rotates q at position ``kv_len - 1``
and k at its token position; empty rows give O = 0 and LSE = -inf; ``output_scale`` (FlashInfer's
``v_scale``) multiplies the normalised O in fp32 before the 16-bit rounding, once, in the final write (the
LSE and split-KV partials do not include it).

fp8 K/V (``kv_dtype="float8_e4m3fn"``, 1 byte per element): rows land in shared memory by the same ``cp.async``
(``D + 16`` bytes a row), are read with ``ld.shared.b32`` (``ldmatrix`` moves 16-bit elements) and widened
with ``cvt.rn.f16x2.e4m3x2`` straight into the B fragments; both MMAs then run in f16, a bf16 q being
converted to f16 in shared memory once per CTA (exact except for |q| > 65504 or below f16's normal range;
e4m3 and P in [0, 1] are exact in f16).  With ``g = lane // 4``, ``t = lane % 4`` (the ``mma`` layouts of
:mod:`cutedsl_attn.common.ptx`):

* S = Q K^T permutes the reduction index d inside each 16-column block ``kk``: logical k ``2t, 2t+1, 2t+8,
  2t+9`` are physical ``d = 16 kk + 4t + 0..3``, so one 32-bit load of K row ``g`` (``+8`` for the second n8
  tile) gives b0 (its low two bytes) and b1 (its high two); the A fragment of Q follows the same
  permutation (``a0, a2`` one 8-byte load of Q row ``g``, ``a1, a3`` of row ``g + 8``), so S is unchanged;
* O += P V permutes the output column instead: n8 tile ``dd = 4 q4 + i``, column ``n`` holds
  ``d = 32 q4 + 4 n + i``, so one 32-bit load of V row ``r`` at byte ``32 q4 + 4g`` holds the four tiles'
  column ``g`` of token ``r``; lanes load rows ``2t, 2t+1, 2t+8, 2t+9`` and ``prmt`` pairs tokens
  ``(2t, 2t+1)`` / ``(2t+8, 2t+9)`` byte by byte into the e4m3x2 halves of b0 / b1; the warp merge writes
  column ``d`` back to its place;
* rows are ``D + 16`` bytes (``16 * odd``): the K loads (8 rows x 16 bytes) and the V loads (rows 0, 2, 4, 6
  x 32 bytes) hit 32 distinct banks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from ..common.dtypes import element_type
from ..common import ptx
from ..common import softmax as sm
from ..common.constants import LOG2E, NEG_INF
from ..compile.arch import SUPPORTED_ARCHS, compile_options
from ..compile.fake import decode_tensors
from ..planning.decode import (
    CHUNK, W_BATCH, W_KV_LEN, W_NUM_SPLITS, W_PAGE_OFF, W_PART_BASE, W_SPLIT_IDX, W_TOK_END, W_TOK_START, WORK_COLS,
    DecodeArgs, DecodeProblem,
)
from ..compile.tiles import check_int_fields, override_int_fields
from .decode_merge import DecodeMerge

NAME = "paged_decode"

SMEM_LIMIT = 227 * 1024  # dynamic shared memory one CTA may use on sm_90a / sm_100a / sm_103a


@dataclass(frozen=True)
class Tiles:
    """What the decode kernel chooses: ``num_warps`` warps per CTA, each streaming 16-token chunks through its
    own ``num_stages``-deep ``cp.async`` ring; ``min_ctas_per_sm`` > 0 asks ptxas for that many resident CTAs
    an SM (a register cap, ``.minnctapersm``), 0 leaves registers to ptxas.

    Raises TypeError for a non-int field, ValueError for ``num_warps`` not in 1, 2, 4, 8, ``num_stages``
    outside 2..6 or ``min_ctas_per_sm`` outside 0..32.
    """

    num_warps: int = 4
    num_stages: int = 3
    min_ctas_per_sm: int = 0

    def __post_init__(self):
        check_int_fields(self)
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"num_warps must be 1, 2, 4 or 8, got {self.num_warps}")
        if not 2 <= self.num_stages <= 6:
            raise ValueError(f"num_stages must be in [2, 6], got {self.num_stages}")
        if not 0 <= self.min_ctas_per_sm <= 32:
            raise ValueError(f"min_ctas_per_sm must be in [0, 32], got {self.min_ctas_per_sm}")


TUNING_FIELDS = tuple(f.name for f in fields(Tiles))  # the keys override_tiles takes


def unsupported_reason(problem: DecodeProblem) -> str | None:
    """Why the decode kernel cannot serve ``problem``, or None.  Its SM80-class code serves every
    :class:`~cutedsl_attn.planning.decode.DecodeProblem` but one: it refuses a target outside
    ``compile.arch.SUPPORTED_ARCHS`` (``sm_90a``, ``sm_100a``, ``sm_103a``, spelled so) and RoPE on an fp8 cache.

    Raises TypeError when ``problem`` is not a DecodeProblem.
    """
    if not isinstance(problem, DecodeProblem):
        raise TypeError(f"problem must be a DecodeProblem, got {type(problem).__name__}")
    if problem.arch not in SUPPORTED_ARCHS:
        return f"arch must be one of {SUPPORTED_ARCHS}, got {problem.arch!r}"
    if problem.kv_fp8 and problem.pos_encoding_mode == "ROPE_LLAMA":
        return ("pos_encoding_mode 'ROPE_LLAMA' with an fp8 K/V cache is not supported (K is rotated in shared "
                "memory at 16 bits); fp8 caches serve pos_encoding_mode 'NONE' and 'ALIBI'")
    return None


@dataclass(frozen=True)
class Config:
    """Compile-time configuration of :class:`PagedDecodeKernel` (also its cache key): the problem and the tiles.

    Everything else (batch, lengths, page count, number of kv heads, strides, layout NHD/HND, scales, window)
    is a run-time argument (:class:`~cutedsl_attn.planning.decode.DecodeArgs`), so one compiled kernel serves
    them all.  Raises TypeError for a ``problem`` / ``tiles`` of another type, ValueError with
    :func:`unsupported_reason`'s reason or when the tiles need more than :data:`SMEM_LIMIT` bytes of shared memory.
    """

    problem: DecodeProblem
    tiles: Tiles

    def __post_init__(self):
        if not isinstance(self.tiles, Tiles):
            raise TypeError(f"tiles must be a paged-decode Tiles, got {type(self.tiles).__name__}")
        reason = unsupported_reason(self.problem)
        if reason is not None:
            raise ValueError(f"the paged-decode kernel cannot serve this problem: {reason}")
        if self.smem_bytes > SMEM_LIMIT:
            raise ValueError(f"{self.tiles} needs {self.smem_bytes} bytes of shared memory at head_dim "
                             f"{self.problem.head_dim}, more than {SMEM_LIMIT}: use fewer warps or stages")

    @property
    def arch(self) -> str:
        return self.problem.arch

    @property
    def cutlass_dtype(self):
        """The CuTe DSL element type of q and o (and of k and v for a 16-bit cache)."""
        return element_type(self.problem.dtype)

    @property
    def kv_cutlass_dtype(self):
        """The CuTe DSL element type of k and v."""
        return cutlass.Float8E4M3FN if self.problem.kv_fp8 else self.cutlass_dtype

    @property
    def mma_dtype(self):
        """The 16-bit type both MMAs run in: f16 for an fp8 cache (e4m3 widens exactly to f16), else q's."""
        return cutlass.Float16 if self.problem.kv_fp8 else self.cutlass_dtype

    @property
    def kv_elem_bytes(self) -> int:
        return 1 if self.problem.kv_fp8 else 2

    # ---- derived quantities (host side) ----
    @property
    def num_threads(self) -> int:
        return 32 * self.tiles.num_warps

    @property
    def row_bytes(self) -> int:
        """Bytes of one K/V row in shared memory."""
        # one 16B pad per row: rows shift by 4 banks, so ldmatrix (fp8: the 32-bit loads) is conflict-free
        return self.problem.head_dim * self.kv_elem_bytes + 16

    @property
    def q_row_bytes(self) -> int:
        """Bytes of one Q row in shared memory (16-bit elements)."""
        return self.problem.head_dim * 2 + 16

    @property
    def smem_q_bytes(self) -> int:
        return 16 * self.q_row_bytes

    @property
    def smem_stats_bytes(self) -> int:
        # m, l, weights per (warp, row); per-row merge stats (2); a flag
        return (self.tiles.num_warps * 16 * 3 + 16 * 2 + 4) * 4

    @property
    def smem_kv_bytes(self) -> int:
        return self.tiles.num_warps * self.tiles.num_stages * 2 * CHUNK * self.row_bytes

    @property
    def smem_bytes(self) -> int:
        kv = max(self.smem_kv_bytes, self.tiles.num_warps * 16 * self.problem.head_dim * 4)
        return self.smem_q_bytes + self.smem_stats_bytes + kv

    @property
    def q_in_registers(self) -> bool:
        return self.problem.head_dim <= 128

    @property
    def max_splits_per_request(self) -> int:
        """Most pieces a split request may have: the merge keeps one fp32 LSE per piece and query head in the
        K/V ring's shared memory (the planner's ``max_splits_per_request``)."""
        return (self.smem_kv_bytes // 4) // self.problem.group_size


def default_tiles(problem: DecodeProblem, *, num_sms: int, split: bool = False) -> Tiles:
    """The default tiles for ``problem``; ``split``: the plan splits requests (split-KV).  ``num_sms`` is unused
    (the planner fills the GPU by splitting).  Measured on the H200:

    ==============================  ==========================================================================
    head_dim 256                    2 stages: 3 would need about 212 KB of shared memory per CTA
    otherwise                       3 stages: (4, 3) and (8, 3) within 1-3% of each other, (2, 4) slowest
    split, head_dim <= 128          8 warps: with split-KV 12-16% faster than 4 on (1, 8192), equal elsewhere
    otherwise                       4 warps
    fp8 K/V, head_dim <= 128        2 stages unsplit, 3 split: 10-17% faster than 5 on (64, 4096), (128, 8192)
                                    and (1, 8192); same output (perf/RESULTS.md, "Decode")
    fp8 K/V, head_dim 256           3 stages (not measured)
    ==============================  ==========================================================================
    """
    num_stages = 2 if problem.head_dim >= 256 else 3
    num_warps = 8 if split and problem.head_dim <= 128 else 4
    if problem.kv_fp8:
        num_stages = 3 if (split or problem.head_dim >= 256) else 2
    return Tiles(num_warps=num_warps, num_stages=num_stages)


def override_tiles(tiles: Tiles, items: dict[str, str]) -> Tiles:
    """``tiles`` with the fields named in ``items`` (field name -> decimal text, the parsed ``key=value`` pairs
    of a tuning hook such as ``CUTEDSL_ATTN_DECODE_TUNE``) replaced.  Raises ValueError naming the key for an
    unknown field or a value that is not an integer, and :class:`Tiles`' errors for one out of range."""
    return override_int_fields(tiles, items)


class PagedDecodeKernel(DecodeMerge):
    """CuTe DSL paged decode; see the module docstring.  Build with :func:`compile`."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.problem = pb = cfg.problem
        self.dtype = cfg.cutlass_dtype
        self.mma_dtype = cfg.mma_dtype
        self.kv_fp8 = pb.kv_fp8
        self.q_to_f16 = pb.kv_fp8 and pb.dtype == "bfloat16"
        self.EB = cfg.kv_elem_bytes
        self.QRB = cfg.q_row_bytes
        self.D = pb.head_dim
        self.PS = pb.page_size
        self.G = pb.group_size
        self.NW = cfg.tiles.num_warps
        self.S = cfg.tiles.num_stages
        self.NT = cfg.num_threads
        self.RB = cfg.row_bytes
        self.TILE = CHUNK * cfg.row_bytes
        self.rope = pb.pos_encoding_mode == "ROPE_LLAMA"
        self.alibi = pb.pos_encoding_mode == "ALIBI"

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [B, Hq, D]
        mK: cute.Tensor,  # [P, page_size, Hkv, D] (any strides, d contiguous)
        mV: cute.Tensor,  # [P, page_size, Hkv, D]
        mIdx: cute.Tensor,  # [nnz] int32 page ids
        mWork: cute.Tensor,  # [W, 8] int32
        mO: cute.Tensor,  # [B, Hq, D]
        mLSE: cute.Tensor,  # [B, Hq] fp32
        mPO: cute.Tensor,  # [NP, Hq, D] fp32 (split-KV partials)
        mPLSE: cute.Tensor,  # [NP, Hq] fp32
        mCnt: cute.Tensor,  # [>= B*Hkv] int32, zero between launches
        mSinks: cute.Tensor,  # [Hq] fp32 (ignored unless use_sinks)
        mAlibi: cute.Tensor,  # [Hq] fp32 slopes (ignored unless ALIBI)
        sm_scale: Float32,
        soft_cap: Float32,
        rope_rcp_scale: Float32,
        rope_log2_theta: Float32,
        output_scale: Float32,
        stream,
    ):
        self.kernel(
            mQ, mK, mV, mIdx, mWork, mO, mLSE, mPO, mPLSE, mCnt, mSinks, mAlibi,
            sm_scale, soft_cap, rope_rcp_scale, rope_log2_theta, output_scale,
        ).launch(
            # kv heads fastest: the CTAs reading the heads of one token row run side by side
            grid=(mK.shape[2], mWork.shape[0], 1),
            block=(self.NT, 1, 1),
            smem=self.cfg.smem_bytes,
            stream=stream,
            **self._occupancy_hint(),
        )

    def _occupancy_hint(self) -> dict:
        """Launch keywords of ``Tiles.min_ctas_per_sm``: none at 0; else the CTA count and a shared-memory
        carveout (percent of the SM's 228 KB) that holds that many CTAs (an explicit carveout also keeps the DSL
        from querying a device while it compiles)."""
        n = self.cfg.tiles.min_ctas_per_sm
        if n == 0:
            return {}
        per_cta = self.cfg.smem_bytes + 1024  # the 1 KB the driver reserves a CTA
        return dict(min_blocks_per_mp=n, preferred_smem_carveout=min(100, -(-100 * n * per_cta // (228 * 1024))))

    # ------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(
        self, mQ, mK, mV, mIdx, mWork, mO, mLSE, mPO, mPLSE, mCnt, mSinks, mAlibi,
        sm_scale: Float32, soft_cap: Float32, rope_rcp_scale: Float32, rope_log2_theta: Float32,
        output_scale: Float32,
    ):
        """Device entry: one CTA per (kv head, work item); see the module docstring.  ``output_scale`` multiplies
        the normalised O of the final write in fp32 before its 16-bit rounding (split-KV partials stay unscaled)."""
        D, G, NW = self.D, self.G, self.NW
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        kvh, wi, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        g = lane // 4

        smem_base = cute.arch.get_dyn_smem(cutlass.Int8, alignment=128).toint()
        sQ = smem_base
        sStat = smem_base + cfg.smem_q_bytes
        sM = sStat
        sL = sStat + NW * 16 * 4
        sW = sStat + NW * 16 * 8
        sRow = sStat + NW * 16 * 12
        sFlag = sRow + 16 * 2 * 4
        sKV = sStat + cfg.smem_stats_bytes

        b = mWork[wi, W_BATCH]
        if b >= 0:
            t0 = mWork[wi, W_TOK_START]
            t1 = mWork[wi, W_TOK_END]
            kv_len = mWork[wi, W_KV_LEN]
            page_off = mWork[wi, W_PAGE_OFF]
            n_splits = mWork[wi, W_NUM_SPLITS]
            part0 = mWork[wi, W_PART_BASE]
            part = part0 + mWork[wi, W_SPLIT_IDX]
            head0 = kvh * G

            # scalars folded once: x_log2 = sc_out * f(sc_in * q.k)
            sc_in, sc_out = sm.logit_scales(sm_scale, soft_cap, self.problem.use_soft_cap)

            self._issue_q(mQ, sQ, b, head0, tidx)
            qf = cute.make_rmem_tensor(((D // 16) * 4,), Int32)

            # ALiBi slopes (log2 units) for rows g and g+8
            slope = cute.make_rmem_tensor((2,), Float32)
            for h in cutlass.range_constexpr(2):
                slope[h] = Float32(0.0)
                if const_expr(self.alibi):
                    if g + 8 * h < G:
                        slope[h] = mAlibi[head0 + g + 8 * h] * LOG2E

            acc = cute.make_rmem_tensor(((D // 8) * 4,), Float32)
            row_m = cute.make_rmem_tensor((2,), Float32)
            row_l = cute.make_rmem_tensor((2,), Float32)
            self._mainloop(mK, mV, mIdx, qf, acc, row_m, row_l, slope, sQ, sKV, t0, t1, kv_len, page_off, kvh,
                           sc_in, sc_out, rope_rcp_scale, rope_log2_theta, lane, warp)
            if const_expr(self.kv_fp8):
                self._merge(mO, mLSE, mPO, mPLSE, mCnt, mSinks, mWork, acc, row_m, row_l, sM, sL, sW, sRow, sFlag,
                            sKV, wi, kvh, mK.shape[2], head0, output_scale, tidx, lane, warp)
            else:
                final = n_splits == 1
                self._merge_warps(mO, mLSE, mPO, mPLSE, mSinks, acc, row_m, row_l, sM, sL, sW, sKV,
                                  b, part, head0, final, output_scale, tidx, lane, warp)
                if n_splits > 1:
                    self._merge_splits(mO, mLSE, mPO, mPLSE, mCnt, mSinks, sRow, sFlag, sKV,
                                       b, kvh, mK.shape[2], part0, n_splits, head0, output_scale, tidx)

    @cute.jit
    def _issue_q(self, mQ, sQ, b, head0, tidx):
        """cp.async the group's Q rows -> smem (16 rows, zero-filled past G); one commit group.

        The wait happens in :meth:`_mainloop` after the K/V prologue is issued, so the Q
        latency overlaps the first K/V loads."""
        D, G, NT, RB = self.D, self.G, self.NT, self.QRB
        q_base = mQ.iterator.toint()
        for it in cutlass.range_constexpr((2 * D + NT - 1) // NT):
            idx = it * NT + tidx
            if idx < 2 * D:
                row = idx // (D // 8)
                col = idx % (D // 8)
                head = head0 + cutlass.min(row, G - 1)
                goff = Int64(b) * mQ.stride[0] + Int64(head) * mQ.stride[1] + col * 8
                ptx.cp_async_16(sQ + row * RB + col * 16, q_base + goff * 2, cutlass.select_(row < G, 16, 0))
        ptx.cp_async_commit()

    @cute.jit
    def _mainloop(self, mK, mV, mIdx, qf, acc, row_m, row_l, slope, sQ, sKV, t0, t1, kv_len, page_off, kvh,
                  sc_in, sc_out, rope_rcp_scale, rope_log2_theta, lane, warp):
        """This warp's 16-token chunks c = warp, warp+NW, ... through a num_stages cp.async ring."""
        D, NW, S, TILE = self.D, self.NW, self.S, self.TILE
        g = lane // 4
        t = lane % 4
        for i in cutlass.range_constexpr((D // 8) * 4):
            acc[i] = Float32(0.0)
        for h in cutlass.range_constexpr(2):
            row_m[h] = Float32(NEG_INF)
            row_l[h] = Float32(0.0)

        n_chunks = (t1 - t0 + CHUNK - 1) // CHUNK
        my_n = cutlass.max(n_chunks - warp + NW - 1, 0) // NW
        k_base = mK.iterator.toint()
        v_base = mV.iterator.toint()
        warp_kv = sKV + warp * (S * 2 * TILE)

        for s in cutlass.range_constexpr(S - 1):
            if s < my_n:
                self._load_chunk(mK, mV, mIdx, k_base, v_base, warp_kv + s * 2 * TILE,
                                 t0 + (warp + s * NW) * CHUNK, t1, page_off, kvh, lane)
            ptx.cp_async_commit()

        # Q (the oldest commit group) has landed once at most S-1 groups are pending
        ptx.cp_async_wait(S - 1)
        cute.arch.sync_threads()
        if const_expr(self.rope):
            self._rope_rows(sQ, 16 * (D // 2), warp * 32 + lane, self.NT, kv_len - 1, 0, rope_rcp_scale,
                            rope_log2_theta)
            cute.arch.sync_threads()
        if const_expr(self.q_to_f16):
            self._q_to_f16(sQ, warp * 32 + lane)
            cute.arch.sync_threads()
        if const_expr(self.cfg.q_in_registers):
            for kk in cutlass.range_constexpr(D // 16):
                if const_expr(self.kv_fp8):
                    qr = self._q_frag_fp8(sQ, lane, kk)
                else:
                    qr = ptx.ldmatrix_x4(self._q_frag_addr(sQ, lane, kk))
                for e in cutlass.range_constexpr(4):
                    qf[kk * 4 + e] = qr[e]

        for i in cutlass.range(my_n, unroll=1):
            j = i + S - 1
            if j < my_n:
                self._load_chunk(mK, mV, mIdx, k_base, v_base, warp_kv + (j % S) * 2 * TILE,
                                 t0 + (warp + j * NW) * CHUNK, t1, page_off, kvh, lane)
            ptx.cp_async_commit()
            ptx.cp_async_wait(S - 1)
            cute.arch.sync_warp()
            sK_st = warp_kv + (i % S) * 2 * TILE
            start = t0 + (warp + i * NW) * CHUNK
            if const_expr(self.rope):
                self._rope_rows(sK_st, CHUNK * (D // 2), lane, 32, start, 1, rope_rcp_scale, rope_log2_theta)
                cute.arch.sync_warp()
            self._consume_chunk(qf, acc, row_m, row_l, slope, sQ, sK_st, sK_st + TILE, start, t1, kv_len,
                                sc_in, sc_out, lane, g, t)
            cute.arch.sync_warp()
        ptx.cp_async_wait(0)
        sm.quad_sum_rows(row_l)

    # ------------------------------------------------------------------ pieces
    @cute.jit
    def _q_frag_addr(self, sQ, lane, kk: cutlass.Constexpr):
        m = lane // 8
        row = (m % 2) * 8 + lane % 8
        return sQ + row * self.QRB + (kk * 16 + (m // 2) * 8) * 2

    @cute.jit
    def _q_frag_fp8(self, sQ, lane, kk: cutlass.Constexpr):
        """The A fragment of Q for k block ``kk`` in the fp8 path's permuted k order (module docstring):
        ``(a0, a1, a2, a3)`` with ``a0, a2`` = Q[g, 16 kk + 4t .. +3] and ``a1, a3`` the same of row g + 8."""
        g = lane // 4
        t = lane % 4
        addr = sQ + g * self.QRB + (kk * 16 + 4 * t) * 2
        lo = ptx.ld_shared_v2_b32(addr)
        hi = ptx.ld_shared_v2_b32(addr + 8 * self.QRB)
        return (lo[0], hi[0], lo[1], hi[1])

    @cute.jit
    def _q_to_f16(self, sQ, tid):
        """bf16 Q rows in smem -> f16 in place (the fp8 path's MMAs run in f16); all NT threads."""
        D, NT, QRB = self.D, self.NT, self.QRB
        for it in cutlass.range_constexpr(16 * (D // 2) // NT):  # 8 D words, a multiple of NT
            idx = it * NT + tid
            addr = sQ + (idx // (D // 2)) * QRB + (idx % (D // 2)) * 4
            ptx.st_shared_b32(addr, ptx.bf16x2_to_f16x2(ptx.ld_shared_b32(addr)))

    @cute.jit
    def _load_chunk(self, mK, mV, mIdx, k_base, v_base, s_dst, start, t1, page_off, kvh, lane):
        """cp.async one 16-token chunk of K and V (rows past ``t1`` zero-filled)."""
        D, PS, RB, EB = self.D, self.PS, self.RB, self.EB
        epp = 16 // EB  # elements per 16-byte piece
        cpr = D // epp  # 16-byte pieces per row
        rpp = 32 // cpr  # rows per pass
        col = lane % cpr
        for p in cutlass.range_constexpr(CHUNK // rpp):
            row = p * rpp + lane // cpr
            tok = start + row
            valid = tok < t1
            tok_c = cutlass.min(tok, t1 - 1)
            page = mIdx[page_off + tok_c // PS]
            slot = tok_c % PS
            koff = Int64(page) * mK.stride[0] + Int64(slot) * mK.stride[1] + Int64(kvh) * mK.stride[2] + col * epp
            voff = Int64(page) * mV.stride[0] + Int64(slot) * mV.stride[1] + Int64(kvh) * mV.stride[2] + col * epp
            nbytes = cutlass.select_(valid, 16, 0)
            ptx.cp_async_16(s_dst + row * RB + col * 16, k_base + koff * EB, nbytes)
            ptx.cp_async_16(s_dst + self.TILE + row * RB + col * 16, v_base + voff * EB, nbytes)

    @cute.jit
    def _consume_chunk(self, qf, acc, row_m, row_l, slope, sQ, sK, sV, start, t1, kv_len, sc_in, sc_out, lane, g, t):
        D, RB, dt = self.D, self.RB, self.dtype
        m = lane // 8
        # S = Q K^T : two n8 tiles (tokens 0-7, 8-15)
        sacc = cute.make_rmem_tensor((8,), Float32)
        for i in cutlass.range_constexpr(8):
            sacc[i] = Float32(0.0)
        if const_expr(self.kv_fp8):
            self._qk_fp8(qf, sacc, sQ, sK, lane)
        else:
            k_row = (m // 2) * 8 + lane % 8
            for kk in cutlass.range_constexpr(D // 16):
                if const_expr(self.cfg.q_in_registers):
                    a = (qf[kk * 4], qf[kk * 4 + 1], qf[kk * 4 + 2], qf[kk * 4 + 3])
                else:
                    a = ptx.ldmatrix_x4(self._q_frag_addr(sQ, lane, kk))
                kb = ptx.ldmatrix_x4(sK + k_row * RB + (kk * 16 + (m % 2) * 8) * 2)
                for j in cutlass.range_constexpr(2):
                    c = ptx.mma_m16n8k16(a, (kb[2 * j], kb[2 * j + 1]),
                                         (sacc[4 * j], sacc[4 * j + 1], sacc[4 * j + 2], sacc[4 * j + 3]), dt)
                    for e in cutlass.range_constexpr(4):
                        sacc[4 * j + e] = c[e]
        # logits in log2 units, masked past t1
        for j in cutlass.range_constexpr(2):
            for e in cutlass.range_constexpr(4):
                tok = start + j * 8 + 2 * t + (e % 2)
                x = sacc[4 * j + e] * sc_in
                if const_expr(self.problem.use_soft_cap):
                    x = ptx.tanh(x) * sc_out
                if const_expr(self.alibi):
                    x = x + slope[e // 2] * Float32(tok - (kv_len - 1))
                sacc[4 * j + e] = cutlass.select_(tok < t1, x, Float32(NEG_INF))
        # online softmax for rows g and g+8, rescale O, P as the A operand of O += P V (k = 16 tokens)
        scale = cute.make_rmem_tensor((2,), Float32)
        sm.online_softmax_step(sacc, 2, row_m, row_l, scale)
        sm.rescale_rows(acc, D // 8, scale)
        pa = sm.p_as_a_operand(sacc, 0, self.mma_dtype)
        if const_expr(self.kv_fp8):
            self._pv_fp8(pa, acc, sV, lane)
        else:
            v_row = (m % 2) * 8 + lane % 8
            for dp in cutlass.range_constexpr(D // 16):
                vb = ptx.ldmatrix_x4(sV + v_row * RB + ((2 * dp + m // 2) * 8) * 2, trans=True)
                for j in cutlass.range_constexpr(2):
                    dd = 2 * dp + j
                    c = ptx.mma_m16n8k16(pa, (vb[2 * j], vb[2 * j + 1]),
                                         (acc[dd * 4], acc[dd * 4 + 1], acc[dd * 4 + 2], acc[dd * 4 + 3]), dt)
                    for e in cutlass.range_constexpr(4):
                        acc[dd * 4 + e] = c[e]

    @cute.jit
    def _qk_fp8(self, qf, sacc, sQ, sK, lane):
        """S += Q K^T of one chunk from an fp8 K tile: per k block and n8 tile one 32-bit load of K row
        ``g`` (+8), widened to b0 / b1 (the permuted k order of the module docstring); f16 MMAs."""
        D, RB = self.D, self.RB
        k_addr = sK + (lane // 4) * RB + 4 * (lane % 4)
        for kk in cutlass.range_constexpr(D // 16):
            if const_expr(self.cfg.q_in_registers):
                a = (qf[kk * 4], qf[kk * 4 + 1], qf[kk * 4 + 2], qf[kk * 4 + 3])
            else:
                a = self._q_frag_fp8(sQ, lane, kk)
            for j in cutlass.range_constexpr(2):
                kb = ptx.e4m3x4_to_f16x2(ptx.ld_shared_b32(k_addr + j * 8 * RB + kk * 16))
                c = ptx.mma_m16n8k16(a, kb, (sacc[4 * j], sacc[4 * j + 1], sacc[4 * j + 2], sacc[4 * j + 3]),
                                     cutlass.Float16)
                for e in cutlass.range_constexpr(4):
                    sacc[4 * j + e] = c[e]

    @cute.jit
    def _pv_fp8(self, pa, acc, sV, lane):
        """O += P V of one chunk from an fp8 V tile: per 32 columns, four 32-bit loads (token rows 2t, 2t+1,
        2t+8, 2t+9 at byte 32 q4 + 4g), byte-paired by ``prmt`` into the b0 / b1 of n8 tiles 4 q4 .. 4 q4 + 3
        (column g of tile 4 q4 + i is d = 32 q4 + 4g + i); f16 MMAs."""
        D, RB = self.D, self.RB
        v_addr = sV + 2 * (lane % 4) * RB + 4 * (lane // 4)
        for q4 in cutlass.range_constexpr(D // 32):
            w0 = ptx.ld_shared_b32(v_addr + q4 * 32)
            w1 = ptx.ld_shared_b32(v_addr + RB + q4 * 32)
            w8 = ptx.ld_shared_b32(v_addr + 8 * RB + q4 * 32)
            w9 = ptx.ld_shared_b32(v_addr + 9 * RB + q4 * 32)
            for h in cutlass.range_constexpr(2):
                sel = 0x5140 if h == 0 else 0x7362  # bytes (2h, 2h+1) of each word, tokens interleaved
                b0 = ptx.e4m3x4_to_f16x2(ptx.prmt(w0, w1, sel))  # tokens 2t, 2t+1 of tiles 4 q4 + 2h, + 1
                b1 = ptx.e4m3x4_to_f16x2(ptx.prmt(w8, w9, sel))  # tokens 2t+8, 2t+9
                for i in cutlass.range_constexpr(2):
                    dd = 4 * q4 + 2 * h + i
                    c = ptx.mma_m16n8k16(pa, (b0[i], b1[i]),
                                         (acc[dd * 4], acc[dd * 4 + 1], acc[dd * 4 + 2], acc[dd * 4 + 3]),
                                         cutlass.Float16)
                    for e in cutlass.range_constexpr(4):
                        acc[dd * 4 + e] = c[e]

    @cute.jit
    def _rope_rows(self, s_base, n_pairs: cutlass.Constexpr, tid, nthr: cutlass.Constexpr, pos0, pos_step: cutlass.Constexpr,
                   rcp_scale, log2_theta):
        """Rotate-half RoPE in place on 16-bit rows in smem, pairs (d, d + D/2); row r is at position pos0 + pos_step*r."""
        D, RB, dt = self.D, self.RB, self.dtype
        half = D // 2
        two_pi = 6.283185307179586
        for it in cutlass.range_constexpr((n_pairs + nthr - 1) // nthr):
            idx = it * nthr + tid
            if idx < n_pairs:
                row = idx // half
                d = idx % half
                a1 = s_base + row * RB + d * 2
                a2 = a1 + half * 2
                x1 = ptx.b16_to_f32(ptx.ld_shared_u16(a1), dt)
                x2 = ptx.b16_to_f32(ptx.ld_shared_u16(a2), dt)
                freq = rcp_scale * ptx.ex2(Float32(d) * Float32(-2.0 / D) * log2_theta)
                ang = Float32(pos0 + pos_step * row) * freq
                ang = ang - two_pi * ptx.rint(ang * (1.0 / two_pi))
                sn, cs = ptx.sin_cos(ang)
                ptx.st_shared_u16(a1, ptx.f32_to_16(x1 * cs - x2 * sn, dt))
                ptx.st_shared_u16(a2, ptx.f32_to_16(x2 * cs + x1 * sn, dt))


def compile(cfg: Config, *, keep_ptx_dir: str | None = None, keep_cubin: bool = False):
    """Compile :class:`PagedDecodeKernel` for ``cfg`` from fake tensors
    (:func:`cutedsl_attn.compile.fake.decode_tensors`; no GPU needed).

    Returns the tvm-ffi callable (call it through :func:`launch`) launching on torch's current stream.
    ``keep_ptx_dir``: keep the PTX (and with ``keep_cubin`` the cubin) there
    (:func:`cutedsl_attn.compile.arch.compile_options`).  Raises ValueError for ``keep_cubin`` without a
    ``keep_ptx_dir``.
    """
    from cutlass.cute.runtime import make_fake_stream

    opts = compile_options(cfg.arch, keep_ptx_dir=keep_ptx_dir, keep_cubin=keep_cubin)
    return cute.compile(
        PagedDecodeKernel(cfg), *decode_tensors(cfg, WORK_COLS),
        Float32(1.0), Float32(0.0), Float32(1.0), Float32(1.0), Float32(1.0),
        make_fake_stream(use_tvm_ffi_env_stream=True),
        options=opts,
    )


def launch(fn, cfg: Config, args: DecodeArgs) -> None:
    """Launch ``fn`` (:func:`compile` of ``cfg``) on torch's current stream; the only code that knows its argument
    order.  ``args``: a :class:`~cutedsl_attn.planning.decode.DecodeArgs` (shapes, dtypes and layouts there);
    ``counters`` must read 0 (the kernel leaves them so).  The tvm-ffi entry raises ValueError for a tensor of
    the wrong dtype, rank or alignment."""
    (q, k, v, indices, work, out, lse, part_o, part_lse, counters, sinks, alibi_slopes, sm_scale, soft_cap,
     rope_rcp_scale, rope_log2_theta, output_scale) = args
    fn(q, k, v, indices, work, out, lse, part_o, part_lse, counters, sinks, alibi_slopes, sm_scale, soft_cap,
       rope_rcp_scale, rope_log2_theta, output_scale)
