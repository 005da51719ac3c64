"""Portable prefill / append attention kernel (SM80-class: ``cp.async``, ``ldmatrix``, ``mma.sync``).

Serves every prefill problem on every target (``sm_90a``, ``sm_100a``, ``sm_103a``): the SM90 kernel takes
over where it applies.  Verified on an H200 (SM90); Blackwell builds are cross-compiled and PTX-checked only.
The module follows the kernel contract: :data:`NAME`, :class:`Tiles`, :class:`Config`,
:func:`unsupported_reason`, :func:`default_tiles`, :func:`compile`, :func:`launch`.

Decomposition (planned on the host by :mod:`cutedsl_attn.planning.prefill`): one CTA
per (kv head, tile of ``tile_m`` packed query rows of one request).  The query heads
that share a kv head are packed into the rows (packed row ``r`` = query token
``r // group_size``, head ``kv_head * group_size + r % group_size``), so each K/V tile
is loaded once for the whole group.  Each warp owns 16 packed rows; K/V tiles of
``tile_n`` tokens stream through a 2-stage ``cp.async`` ring shared by the CTA (rows
gathered through the page table when the cache is paged).  S = Q K^T and O += P V are
``mma.m16n8k16`` (P re-used from the S accumulators as the A operand); online
softmax in fp32 with exp2.

A user ``score_mod`` (``PrefillProblem.score_mod``) is traced per score after the scale and before the masks
(not with a soft cap or ALiBi), as in the SM90 kernel.

Conventions (FlashInfer): causal is bottom-right (key ``j`` is visible to query ``i``
iff ``j <= i + kv_len - qo_len``); ``window_left = w`` keeps ``w + 1`` keys; a custom
mask (packed bits, little-endian, 1 = visible) replaces causal; soft cap
``cap * tanh(s / cap)`` on scaled logits; sinks are natural-log logits (not scaled)
in the denominator and the LSE; LSE is base 2; rows with no visible key give O = 0,
LSE = -inf.  ``output_scale`` (FlashInfer's ``v_scale / o_scale``) multiplies the normalised O in fp32
before the 16-bit rounding; the LSE does not include it.

fp8 K/V (``PrefillProblem.kv_dtype="float8_e4m3fn"``, paged caches, 1 byte per element): the ``cp.async`` ring
lands the e4m3 rows in a staging area (``D + 16`` bytes a row), and once a tile has landed all threads widen it
in shared memory (``ld.shared.b32``, ``cvt.rn.f16x2.e4m3x2``, for bf16 q on through fp32 to bf16x2: e4m3 is
exact in both) into one 16-bit K and one V tile of q's dtype, which the 16-bit main loop then reads unchanged
(``ldmatrix``, ``mma.sync`` in q's dtype, RoPE in place).  Every warp of the CTA reads the whole K/V tile, so
widening it once in shared memory costs a quarter (at 4 warps) of widening the fragments in each warp's
registers, and the MMAs see exactly the values a 16-bit cache of the widened numbers gives.  ``k_scale`` and
``v_scale`` are per-tensor: the caller folds them into ``sm_scale`` and ``output_scale``.

Positional encodings (``PrefillProblem.pos_encoding_mode``; query token ``i`` of a request
sits at position ``pos_i = i + kv_len - qo_len``, key ``j`` at ``j``):

* ``"ROPE_LLAMA"`` (FlashInfer ``prefill.cuh`` / ``pos_enc.cuh``): non-interleaved
  ("rotate half") RoPE, pair ``(d, d + D/2)`` rotated by ``pos * freq_d`` with
  ``freq_d = rope_rcp_scale * 2^(-2d/D * rope_log2_theta)`` (= ``theta^(-2d/D) / scale``).
  The tile's Q rows are rotated in place in shared memory once, after they land; each
  K tile is rotated in place after it lands, before the QK MMA (a barrier-separated pass
  of all threads over the tile; fp32 math, rounded back to the 16-bit input type, as
  FlashInfer does).  Angles are range-reduced to [-pi, pi] before ``sin/cos.approx``.
* ``"ALIBI"``: ``slope_h * (j - pos_i)`` (natural-log units, ``slopes`` = FlashInfer's
  ``get_alibi_slopes(num_qo_heads)``, a run-time ``[Hq]`` fp32 tensor) is added to the
  scaled (and soft-capped) logit, in log2 units here (slope * log2 e), before masking.
  FlashInfer's FA2 kernel uses the un-offset row index ``i`` instead of ``pos_i``: a
  per-row constant, so O is identical and only the LSE differs (by
  ``slope_h * (kv_len - qo_len) * log2 e``); ``pos_i`` makes the bias translation
  invariant (the same as the decode kernel's ``j - (kv_len - 1)``, and the oracle's).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..common.dtypes import element_type
from ..common import epilogue, masks, paging, ptx
from ..common import softmax as sm
from ..common.constants import LOG2E, NEG_INF
from ..compile.arch import SUPPORTED_ARCHS, compile_options
from ..compile.fake import prefill_tensors, vector_f32
from ..planning.prefill import (
    W_BATCH, W_KV_LEN, W_KV_START, W_MASK_OFF, W_Q_START, W_QO_LEN, W_ROW0, WORK_COLS, PrefillArgs, PrefillProblem,
)
from ..compile.tiles import check_int_fields, override_int_fields

NAME = "prefill_portable"


@dataclass(frozen=True)
class Tiles:
    """What the portable prefill kernel chooses: ``num_warps`` warps of 16 packed query rows each
    (``tile_m = 16 * num_warps``), K/V tiles of ``tile_n`` tokens through a ``num_stages``-deep ``cp.async`` ring.

    Raises TypeError for a non-int field, ValueError for ``num_warps`` other than 4 / 8, ``tile_n`` other than
    32 / 64 or ``num_stages`` other than 2 (the ring is double-buffered).
    """

    num_warps: int = 4
    tile_n: int = 64
    num_stages: int = 2

    def __post_init__(self):
        check_int_fields(self)
        if self.num_warps not in (4, 8):
            raise ValueError(f"num_warps must be 4 or 8, got {self.num_warps}")
        if self.tile_n not in (32, 64):
            raise ValueError(f"tile_n must be 32 or 64, got {self.tile_n}")
        if self.num_stages != 2:
            raise ValueError(f"num_stages must be 2 (a double-buffered ring), got {self.num_stages}")


TUNING_FIELDS = tuple(f.name for f in fields(Tiles))  # the keys override_tiles takes


def unsupported_reason(problem: PrefillProblem) -> str | None:
    """Why the portable kernel cannot serve ``problem``, or None.  Its ``cp.async`` / ``ldmatrix`` /
    ``mma.sync`` code serves every :class:`~cutedsl_attn.planning.prefill.PrefillProblem` (dtypes, head dims,
    groups, paging, masks, positional encodings, ``score_mod``, fp8 e4m3 paged caches); it refuses only a target
    outside ``compile.arch.SUPPORTED_ARCHS`` (``sm_90a``, ``sm_100a``, ``sm_103a``, spelled so).

    Raises TypeError when ``problem`` is not a PrefillProblem.
    """
    if not isinstance(problem, PrefillProblem):
        raise TypeError(f"problem must be a PrefillProblem, got {type(problem).__name__}")
    if problem.arch not in SUPPORTED_ARCHS:
        return f"arch must be one of {SUPPORTED_ARCHS}, got {problem.arch!r}"
    return None


@dataclass(frozen=True)
class Config:
    """Compile-time configuration of :class:`PrefillKernel` (also its cache key): the problem and the tiles.

    Lengths, offsets, head counts, strides, ``sm_scale``, the soft-cap value, ``window_left``, the RoPE
    parameters, the ALiBi slopes and the output scale are run-time arguments (:class:`PrefillArgs`).
    Raises TypeError for a ``problem`` / ``tiles`` of another type, ValueError with
    :func:`unsupported_reason`'s reason.
    """

    problem: PrefillProblem
    tiles: Tiles

    def __post_init__(self):
        if not isinstance(self.tiles, Tiles):
            raise TypeError(f"tiles must be a portable prefill Tiles, got {type(self.tiles).__name__}")
        reason = unsupported_reason(self.problem)
        if reason is not None:
            raise ValueError(f"the portable prefill kernel cannot serve this problem: {reason}")

    # ---- what compile/ reads (fake tensors, the target) ----
    @property
    def arch(self) -> str:
        return self.problem.arch

    @property
    def cutlass_dtype(self):
        """The CuTe DSL element type of q and o (and of k and v for a 16-bit cache): the MMAs' type."""
        return element_type(self.problem.dtype)

    @property
    def kv_cutlass_dtype(self):
        """The CuTe DSL element type of k and v: ``Float8E4M3FN`` for an fp8 cache, else q's."""
        return cutlass.Float8E4M3FN if self.problem.kv_fp8 else self.cutlass_dtype

    @property
    def head_dim_qk(self) -> int:
        return self.problem.head_dim_qk

    @property
    def head_dim_vo(self) -> int:
        return self.problem.head_dim_vo

    @property
    def page_size(self) -> int:
        return self.problem.page_size

    # ---- derived (host side) ----
    @property
    def tile_m(self) -> int:
        """Packed query rows per CTA (the work table's row tile)."""
        return 16 * self.tiles.num_warps

    @property
    def num_threads(self) -> int:
        return 32 * self.tiles.num_warps

    @property
    def row_bytes_qk(self) -> int:
        return self.problem.head_dim_qk * 2 + 16  # 16B pad: conflict-free ldmatrix

    @property
    def row_bytes_vo(self) -> int:
        return self.problem.head_dim_vo * 2 + 16

    @property
    def staging_row_bytes_qk(self) -> int:
        """Bytes of one fp8 K row in the staging ring (16B pad: 16-byte aligned ``cp.async`` rows)."""
        return self.problem.head_dim_qk + 16

    @property
    def staging_row_bytes_vo(self) -> int:
        return self.problem.head_dim_vo + 16

    @property
    def smem_bytes(self) -> int:
        t = self.tiles
        if self.problem.kv_fp8:  # Q, one widened 16-bit K/V tile, the fp8 ring
            return (self.tile_m * self.row_bytes_qk + t.tile_n * (self.row_bytes_qk + self.row_bytes_vo)
                    + t.num_stages * t.tile_n * (self.staging_row_bytes_qk + self.staging_row_bytes_vo))
        return self.tile_m * self.row_bytes_qk + t.num_stages * t.tile_n * (self.row_bytes_qk + self.row_bytes_vo)

    @property
    def q_in_registers(self) -> bool:
        return self.problem.head_dim_qk <= 128

    @property
    def positive_scale_only(self) -> bool:
        """False: the logits are scaled before the row max, so any ``sm_scale`` works."""
        return False


def default_tiles(problem: PrefillProblem, *, num_sms: int) -> Tiles:
    """The default tiles for ``problem`` (``num_sms``: unused, the grid is one CTA per tile).  Measured on the
    H200:

    ==============  ==========================================================================
    every problem   4 warps x 64 keys, 2 stages: the measured tiles; 8 warps and 32 keys build, unmeasured
    ==============  ==========================================================================
    """
    return Tiles(num_warps=4, tile_n=64, num_stages=2)


def override_tiles(tiles: Tiles, items: dict[str, str]) -> Tiles:
    """``tiles`` with the fields named in ``items`` (field name -> decimal text, a tuning hook's parsed
    ``key=value`` pairs) replaced.  Raises ValueError naming the key for an unknown field or a value that is
    not an integer, and Tiles' own errors for a value out of range."""
    return override_int_fields(tiles, items)


class PrefillKernel:
    """CuTe DSL portable prefill; see the module docstring.  Build with :func:`compile`."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.problem = pb = cfg.problem
        self.dtype = cfg.cutlass_dtype
        self.DQ, self.DV, self.G = pb.head_dim_qk, pb.head_dim_vo, pb.group_size
        self.NW, self.NT, self.TM, self.TN = cfg.tiles.num_warps, cfg.num_threads, cfg.tile_m, cfg.tiles.tile_n
        self.PS = pb.page_size
        self.RQ, self.RV = cfg.row_bytes_qk, cfg.row_bytes_vo
        self.paged = pb.page_size > 0
        self.kv_fp8 = pb.kv_fp8
        self.SK, self.SV = cfg.staging_row_bytes_qk, cfg.staging_row_bytes_vo
        # bytes of a K / V row of the cp.async ring: the fp8 staging rows, or the 16-bit rows the MMAs read
        self.LK, self.LV = (self.SK, self.SV) if self.kv_fp8 else (self.RQ, self.RV)
        self.mask_causal = pb.causal and not pb.use_custom_mask
        self.rope = pb.pos_encoding_mode == "ROPE_LLAMA"
        self.alibi = pb.pos_encoding_mode == "ALIBI"

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mIdx: cute.Tensor, mWork: cute.Tensor,
                 mO: cute.Tensor, mLSE: cute.Tensor, mMask: cute.Tensor, mSinks: cute.Tensor, mAlibi: cute.Tensor,
                 sm_scale: Float32, soft_cap: Float32, window_left: Int32, rope_rcp_scale: Float32,
                 rope_log2_theta: Float32, output_scale: Float32, stream):
        hkv = mK.shape[2 if self.paged else 1]
        self.kernel(mQ, mK, mV, mIdx, mWork, mO, mLSE, mMask, mSinks, mAlibi, sm_scale, soft_cap, window_left,
                    rope_rcp_scale, rope_log2_theta, output_scale).launch(
            grid=(hkv, mWork.shape[0], 1), block=(self.NT, 1, 1), smem=self.cfg.smem_bytes, stream=stream,
        )

    @cute.kernel
    def kernel(self, mQ, mK, mV, mIdx, mWork, mO, mLSE, mMask, mSinks, mAlibi,
               sm_scale: Float32, soft_cap: Float32, window_left: Int32, rope_rcp_scale: Float32,
               rope_log2_theta: Float32, output_scale: Float32):
        """Device entry: one CTA per (kv head, tile of packed query rows); see the module docstring.

        Arguments (all but the scalars are ``cute.Tensor``):

        * ``mQ`` ``[total_q, Hq, Dqk]``; ``mK``/``mV`` ragged ``[total_kv, Hkv, D]`` or paged
          ``[pages, page_size, Hkv, D]`` (any strides, last dim contiguous; e4m3 for ``kv_fp8``); ``mIdx``
          int32 flat page ids (paged only); ``mWork`` int32 ``[W, 8]`` work table
          (:mod:`cutedsl_attn.planning.prefill`); ``mO`` ``[total_q, Hq, Dvo]``; ``mLSE`` fp32
          ``[total_q, Hq]`` (base 2); ``mMask`` uint8 packed custom mask (``use_custom_mask``);
          ``mSinks`` fp32 ``[Hq]`` (``use_sinks``); ``mAlibi`` fp32 ``[Hq]`` ALiBi slopes in
          natural-log units (``pos_encoding_mode == "ALIBI"``).  Tensors a config does not use
          are not read (a 1-element dummy is fine).
        * ``sm_scale``; ``soft_cap`` (``use_soft_cap``); ``window_left`` (``use_window``; -1
          disables); ``rope_rcp_scale = 1 / rope_scale`` and ``rope_log2_theta = log2(rope_theta)``
          (``ROPE_LLAMA``); ``output_scale`` multiplies the normalised O in fp32 before its 16-bit rounding.
        """
        pb = self.problem
        G, TM, TN, RQ = self.G, self.TM, self.TN, self.RQ
        tidx, _, _ = cute.arch.thread_idx()
        kvh, wi, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32

        smem = cute.arch.get_dyn_smem(cutlass.Int8, alignment=128).toint()
        sQ = smem
        sK = sQ + TM * RQ
        if const_expr(self.kv_fp8):
            sV = sK + TN * RQ  # one widened 16-bit K and V tile
            ldK = sV + TN * self.RV  # the fp8 cp.async ring the tiles land in
            ldV = ldK + 2 * TN * self.LK
        else:
            sV = sK + 2 * TN * RQ
            ldK, ldV = sK, sV

        b = mWork[wi, W_BATCH]
        if b >= 0:
            row0 = mWork[wi, W_ROW0]
            qo_len = mWork[wi, W_QO_LEN]
            kv_len = mWork[wi, W_KV_LEN]
            q_start = mWork[wi, W_Q_START]
            kv_start = mWork[wi, W_KV_START]
            mask_off = mWork[wi, W_MASK_OFF]

            sc_in, sc_out = sm.logit_scales(sm_scale, soft_cap, pb.use_soft_cap, pb.score_mod is not None)
            # kv token range any row of this tile can see
            blk_lo, n_blk = masks.kv_block_range(row0, qo_len, kv_len, window_left, G, TM, TN, self.mask_causal,
                                                 pb.use_window)

            self._issue_q(mQ, sQ, row0, qo_len, q_start, kvh, tidx)
            if n_blk > 0:
                self._issue_kv(mK, mV, mIdx, ldK, ldV, blk_lo * TN, kv_len, kv_start, kvh, tidx)
            ptx.cp_async_commit()

            acc = cute.make_rmem_tensor(((self.DV // 8) * 4,), Float32)
            row_m = cute.make_rmem_tensor((2,), Float32)
            row_l = cute.make_rmem_tensor((2,), Float32)
            self._mainloop(mK, mV, mIdx, mMask, mAlibi, acc, row_m, row_l, sQ, sK, sV, ldK, ldV, row0, qo_len,
                           kv_len, kv_start, mask_off, kvh, blk_lo, n_blk, sc_in, sc_out, window_left, rope_rcp_scale,
                           rope_log2_theta, tidx, lane, warp, b)
            self._epilogue(mO, mLSE, mSinks, acc, row_m, row_l, row0, qo_len, q_start, kvh, lane, warp, output_scale)

    # ------------------------------------------------------------------ loads
    @cute.jit
    def _issue_q(self, mQ, sQ, row0, qo_len, q_start, kvh, tidx):
        """cp.async the tile's packed Q rows (zero-filled past the request) into smem."""
        DQ, G, NT, TM, RQ = self.DQ, self.G, self.NT, self.TM, self.RQ
        cpr = DQ // 8
        q_base = mQ.iterator.toint()
        for it in cutlass.range_constexpr((TM * cpr + NT - 1) // NT):
            idx = it * NT + tidx
            if idx < TM * cpr:
                r = idx // cpr
                col = idx % cpr
                goff, valid = paging.q_chunk_offset(mQ, row0 + r, qo_len, q_start, kvh, col, G)
                ptx.cp_async_16(sQ + r * RQ + col * 16, q_base + goff * 2, cutlass.select_(valid, 16, 0))
        ptx.cp_async_commit()

    @cute.jit
    def _issue_kv(self, mK, mV, mIdx, sK, sV, tok0, kv_len, kv_start, kvh, tidx):
        """cp.async one K tile and one V tile (tokens tok0..tok0+tile_n, zero-filled past kv_len); fp8 rows land
        in the staging ring (``sK`` / ``sV`` are its stage)."""
        self._issue_rows(mK, mIdx, sK, self.DQ, self.LK, tok0, kv_len, kv_start, kvh, tidx)
        self._issue_rows(mV, mIdx, sV, self.DV, self.LV, tok0, kv_len, kv_start, kvh, tidx)

    @cute.jit
    def _issue_rows(self, mX, mIdx, s_dst, D: cutlass.Constexpr, RB: cutlass.Constexpr, tok0, kv_len, kv_start,
                    kvh, tidx):
        NT, TN = self.NT, self.TN
        ept = 16 if self.kv_fp8 else 8  # elements per 16-byte chunk
        cpr = D // ept
        base = mX.iterator.toint()
        for it in cutlass.range_constexpr((TN * cpr + NT - 1) // NT):
            idx = it * NT + tidx
            if idx < TN * cpr:
                r = idx // cpr
                col = idx % cpr
                if const_expr(self.kv_fp8):
                    # kv_chunk_offset counts 8-element chunks: chunk col of 16 e4m3 elements is its chunk 2 col
                    goff, valid = paging.kv_chunk_offset(mX, mIdx, tok0 + r, kv_len, kv_start, kvh, col * 2,
                                                         self.PS if self.paged else 0)
                    ptx.cp_async_16(s_dst + r * RB + col * 16, base + goff, cutlass.select_(valid, 16, 0))
                else:
                    goff, valid = paging.kv_chunk_offset(mX, mIdx, tok0 + r, kv_len, kv_start, kvh, col,
                                                         self.PS if self.paged else 0)
                    ptx.cp_async_16(s_dst + r * RB + col * 16, base + goff * 2, cutlass.select_(valid, 16, 0))

    @cute.jit
    def _widen_rows(self, s_src, s_dst, D: cutlass.Constexpr, RS: cutlass.Constexpr, RB: cutlass.Constexpr,
                    tidx):
        """e4m3 rows of one staged tile (``RS`` bytes a row) -> 16-bit rows of q's dtype (``RB`` bytes a row), all
        ``tile_n`` rows by all threads, 4 source bytes per thread and step (exact: e4m3 fits f16 and bf16)."""
        NT, TN = self.NT, self.TN
        wpr = D // 4  # 4-byte words of a staged row
        # lanes 16..31 store their two words in the other order: each store of a warp then hits 32 distinct banks
        # (rows of 64 elements or more)
        swap = (tidx // 16) % 2
        for it in cutlass.range_constexpr((TN * wpr + NT - 1) // NT):
            idx = it * NT + tidx
            if idx < TN * wpr:
                r = idx // wpr
                c = idx % wpr
                lo, hi = ptx.e4m3x4_to_f16x2(ptx.ld_shared_b32(s_src + r * RS + c * 4))
                if const_expr(self.dtype is cutlass.BFloat16):
                    a0, a1 = ptx.unpack2(lo, cutlass.Float16)
                    b0, b1 = ptx.unpack2(hi, cutlass.Float16)
                    lo = ptx.pack2(a0, a1, cutlass.BFloat16)
                    hi = ptx.pack2(b0, b1, cutlass.BFloat16)
                dst = s_dst + r * RB + c * 8
                ptx.st_shared_b32(dst + swap * 4, cutlass.select_(swap == 1, hi, lo))
                ptx.st_shared_b32(dst + 4 - swap * 4, cutlass.select_(swap == 1, lo, hi))

    # ------------------------------------------------------------------ main loop
    @cute.jit
    def _mainloop(self, mK, mV, mIdx, mMask, mAlibi, acc, row_m, row_l, sQ, sK, sV, ldK, ldV, row0, qo_len,
                  kv_len, kv_start, mask_off, kvh, blk_lo, n_blk, sc_in, sc_out, window_left, rope_rcp_scale,
                  rope_log2_theta, tidx, lane, warp, b):
        DQ, DV, G, TN, RQ, RV = self.DQ, self.DV, self.G, self.TN, self.RQ, self.RV
        g = lane // 4
        t = lane % 4
        m = lane // 8
        for i in cutlass.range_constexpr((DV // 8) * 4):
            acc[i] = Float32(0.0)
        # per-lane rows g and g+8 of this warp: query token index and its bottom-right position
        qtok = cute.make_rmem_tensor((2,), Int32)
        qpos = cute.make_rmem_tensor((2,), Int32)
        for h in cutlass.range_constexpr(2):
            row_m[h] = Float32(NEG_INF)
            row_l[h] = Float32(0.0)
            tk = (row0 + warp * 16 + g + 8 * h) // G
            qtok[h] = cutlass.min(tk, qo_len - 1)
            qpos[h] = tk + kv_len - qo_len
        # ALiBi slopes (log2 units) of rows g and g+8: query head kv_head * G + packed_row % G
        slope = cute.make_rmem_tensor((2,), Float32)
        if const_expr(self.alibi):
            for h in cutlass.range_constexpr(2):
                slope[h] = mAlibi[kvh * G + (row0 + warp * 16 + g + 8 * h) % G] * LOG2E
        q_head = cute.make_rmem_tensor((2,), Int32)  # score_mod: the query head of rows g and g+8
        if const_expr(self.problem.score_mod is not None):
            for h in cutlass.range_constexpr(2):
                q_head[h] = kvh * G + (row0 + warp * 16 + g + 8 * h) % G

        # Q has landed once at most one group (the first K/V tile) is pending
        ptx.cp_async_wait(1)
        cute.arch.sync_threads()
        if const_expr(self.rope):
            # packed row r is query token (row0 + r) // G at position token + kv_len - qo_len
            self._rope_rows(sQ, self.TM, row0, kv_len - qo_len, True, tidx, rope_rcp_scale, rope_log2_theta)
            cute.arch.sync_threads()
        qf = cute.make_rmem_tensor(((DQ // 16) * 4,), Int32)
        if const_expr(self.cfg.q_in_registers):
            for kk in cutlass.range_constexpr(DQ // 16):
                qr = ptx.ldmatrix_x4(self._q_frag_addr(sQ, lane, warp, kk))
                for e in cutlass.range_constexpr(4):
                    qf[kk * 4 + e] = qr[e]

        sacc = cute.make_rmem_tensor(((TN // 8) * 4,), Float32)
        for it in cutlass.range(n_blk, unroll=1):
            st = it % 2
            if it + 1 < n_blk:
                nst = (it + 1) % 2
                self._issue_kv(mK, mV, mIdx, ldK + nst * TN * self.LK, ldV + nst * TN * self.LV,
                               (blk_lo + it + 1) * TN, kv_len, kv_start, kvh, tidx)
            ptx.cp_async_commit()
            ptx.cp_async_wait(1)
            cute.arch.sync_threads()
            if const_expr(self.kv_fp8):
                # the staged fp8 tile -> the one 16-bit K/V tile (free: the previous iteration ended on a barrier)
                self._widen_rows(ldK + st * TN * self.LK, sK, DQ, self.LK, RQ, tidx)
                self._widen_rows(ldV + st * TN * self.LV, sV, DV, self.LV, RV, tidx)
                cute.arch.sync_threads()
                sK_st = sK
                sV_st = sV
            else:
                sK_st = sK + st * TN * RQ
                sV_st = sV + st * TN * RV
            tok0 = (blk_lo + it) * TN
            if const_expr(self.rope):
                # key row r of the tile is token tok0 + r (rows past kv_len are zero-filled: stay zero)
                self._rope_rows(sK_st, TN, 0, tok0, False, tidx, rope_rcp_scale, rope_log2_theta)
                cute.arch.sync_threads()

            # S = Q K^T over tile_n tokens
            for i in cutlass.range_constexpr((TN // 8) * 4):
                sacc[i] = Float32(0.0)
            for kk in cutlass.range_constexpr(DQ // 16):
                if const_expr(self.cfg.q_in_registers):
                    a = (qf[kk * 4], qf[kk * 4 + 1], qf[kk * 4 + 2], qf[kk * 4 + 3])
                else:
                    a = ptx.ldmatrix_x4(self._q_frag_addr(sQ, lane, warp, kk))
                for j2 in cutlass.range_constexpr(TN // 16):
                    kb = ptx.ldmatrix_x4(sK_st + (j2 * 16 + (m // 2) * 8 + lane % 8) * RQ + (kk * 16 + (m % 2) * 8) * 2)
                    for jj in cutlass.range_constexpr(2):
                        n8 = 2 * j2 + jj
                        c = ptx.mma_m16n8k16(a, (kb[2 * jj], kb[2 * jj + 1]),
                                             (sacc[4 * n8], sacc[4 * n8 + 1], sacc[4 * n8 + 2], sacc[4 * n8 + 3]),
                                             self.dtype)
                        for e in cutlass.range_constexpr(4):
                            sacc[4 * n8 + e] = c[e]

            # logits (log2 units) and masks
            for n8 in cutlass.range_constexpr(TN // 8):
                for e in cutlass.range_constexpr(4):
                    h = e // 2
                    j = tok0 + n8 * 8 + 2 * t + (e % 2)
                    x = sacc[4 * n8 + e] * sc_in
                    if const_expr(self.problem.use_soft_cap):
                        x = ptx.tanh(x) * sc_out
                    if const_expr(self.problem.score_mod is not None):  # (q_idx: the query's bottom-right position)
                        x = sm.score_mod_logit(self.problem.score_mod, sacc[4 * n8 + e], sc_in, b, q_head[h], qpos[h],
                                               j) * sc_out
                    if const_expr(self.alibi):
                        x = x + slope[h] * Float32(j - qpos[h])
                    ok = masks.visible(j, kv_len, qpos[h], window_left, causal=self.mask_causal,
                                       use_window=self.problem.use_window)
                    if const_expr(self.problem.use_custom_mask):
                        ok = ok & masks.custom_visible(mMask, masks.custom_row_bit(mask_off, qtok[h], kv_len), kv_len, j)
                    sacc[4 * n8 + e] = Float32(cutlass.select_(ok, x, Float32(NEG_INF)))

            # online softmax for rows g and g+8, then rescale O
            scale = cute.make_rmem_tensor((2,), Float32)
            sm.online_softmax_step(sacc, TN // 8, row_m, row_l, scale)
            sm.rescale_rows(acc, DV // 8, scale)

            # O += P V, 16 tokens per k-step
            for kt in cutlass.range_constexpr(TN // 16):
                pa = sm.p_as_a_operand(sacc, kt, self.dtype)
                v_row = kt * 16 + (m % 2) * 8 + lane % 8
                for dp in cutlass.range_constexpr(DV // 16):
                    vb = ptx.ldmatrix_x4(sV_st + v_row * RV + ((2 * dp + m // 2) * 8) * 2, trans=True)
                    for jj in cutlass.range_constexpr(2):
                        dd = 2 * dp + jj
                        c = ptx.mma_m16n8k16(pa, (vb[2 * jj], vb[2 * jj + 1]),
                                             (acc[dd * 4], acc[dd * 4 + 1], acc[dd * 4 + 2], acc[dd * 4 + 3]),
                                             self.dtype)
                        for e in cutlass.range_constexpr(4):
                            acc[dd * 4 + e] = c[e]
            cute.arch.sync_threads()  # the stage is refilled next iteration
        ptx.cp_async_wait(0)
        sm.quad_sum_rows(row_l)

    @cute.jit
    def _rope_rows(self, s_base, n_rows: cutlass.Constexpr, row0, pos_off, packed_q: cutlass.Constexpr, tidx,
                   rcp_scale, log2_theta):
        """Rotate-half RoPE in place on ``n_rows`` 16-bit rows (stride ``row_bytes_qk``) in smem, by all threads.

        Row ``r`` sits at position ``(row0 + r) // G + pos_off`` when ``packed_q`` (packed query
        rows), else ``pos_off + r`` (key rows).  Pair ``(d, d + D/2)``, angle ``pos * freq_d``,
        ``freq_d = rcp_scale * 2^(-2d/D * log2_theta)``; fp32 math, one rounding per element."""
        DQ, NT = self.DQ, self.NT
        half = DQ // 2
        n_pairs = n_rows * half
        fixed_d = NT % half == 0  # every pass of the threads hits the same d: one freq per thread
        freq0 = Float32(0.0)
        if const_expr(fixed_d):
            freq0 = rcp_scale * ptx.ex2(Float32(tidx % half) * Float32(-2.0 / DQ) * log2_theta)
        for it in cutlass.range_constexpr((n_pairs + NT - 1) // NT):
            idx = it * NT + tidx
            if const_expr(n_pairs % NT == 0):
                self._rope_pair(s_base, idx, freq0, row0, pos_off, packed_q, fixed_d, rcp_scale, log2_theta)
            else:
                if idx < n_pairs:
                    self._rope_pair(s_base, idx, freq0, row0, pos_off, packed_q, fixed_d, rcp_scale, log2_theta)

    @cute.jit
    def _rope_pair(self, s_base, idx, freq0, row0, pos_off, packed_q: cutlass.Constexpr, fixed_d: cutlass.Constexpr,
                   rcp_scale, log2_theta):
        """Pair number ``idx`` of :meth:`_rope_rows` (row ``idx // (D/2)``, dim ``idx % (D/2)``)."""
        DQ, G, RQ, dt = self.DQ, self.G, self.RQ, self.dtype
        half = DQ // 2
        two_pi = 6.283185307179586
        row = idx // half
        d = idx % half
        freq = freq0
        if const_expr(not fixed_d):
            freq = rcp_scale * ptx.ex2(Float32(d) * Float32(-2.0 / DQ) * log2_theta)
        pos = pos_off + row
        if const_expr(packed_q):
            pos = (row0 + row) // G + pos_off
        a1 = s_base + row * RQ + d * 2
        a2 = a1 + half * 2
        x1 = ptx.b16_to_f32(ptx.ld_shared_u16(a1), dt)
        x2 = ptx.b16_to_f32(ptx.ld_shared_u16(a2), dt)
        ang = Float32(pos) * freq
        ang = ang - two_pi * ptx.rint(ang * (1.0 / two_pi))
        sn, cs = ptx.sin_cos(ang)
        ptx.st_shared_u16(a1, ptx.f32_to_16(x1 * cs - x2 * sn, dt))
        ptx.st_shared_u16(a2, ptx.f32_to_16(x2 * cs + x1 * sn, dt))

    @cute.jit
    def _q_frag_addr(self, sQ, lane, warp, kk: cutlass.Constexpr):
        m = lane // 8
        row = warp * 16 + (m % 2) * 8 + lane % 8
        return sQ + row * self.RQ + (kk * 16 + (m // 2) * 8) * 2

    # ------------------------------------------------------------------ epilogue
    @cute.jit
    def _epilogue(self, mO, mLSE, mSinks, acc, row_m, row_l, row0, qo_len, q_start, kvh, lane, warp, output_scale):
        """Normalise (sinks folded in), scale by ``output_scale`` in fp32, write O and the LSE of the lane's rows
        (:func:`common.epilogue.store_rows`)."""
        epilogue.store_rows(mO, mLSE, mSinks, acc, row_m, row_l, row0, qo_len, q_start, kvh, lane, warp,
                            self.DV, self.G, self.problem.use_sinks, self.dtype, False, output_scale=output_scale)


def compile(cfg: Config, *, keep_ptx_dir: str | None = None, keep_cubin: bool = False):
    """Compile :class:`PrefillKernel` for ``cfg`` from fake tensors (no GPU needed).

    Returns the tvm-ffi callable (call it through :func:`launch`) launching on torch's current stream.
    ``keep_ptx_dir``: keep the PTX (and with ``keep_cubin`` the cubin) there
    (:func:`cutedsl_attn.compile.arch.compile_options`).  Raises ValueError for ``keep_cubin`` without a
    ``keep_ptx_dir``.
    """
    from cutlass.cute.runtime import make_fake_stream

    opts = compile_options(cfg.arch, keep_ptx_dir=keep_ptx_dir, keep_cubin=keep_cubin)
    return cute.compile(
        PrefillKernel(cfg), *prefill_tensors(cfg, WORK_COLS), vector_f32(), Float32(1.0), Float32(0.0), Int32(-1),
        Float32(1.0), Float32(1.0), Float32(1.0), make_fake_stream(use_tvm_ffi_env_stream=True), options=opts,
    )


def launch(fn, cfg: Config, args: PrefillArgs) -> None:
    """Launch ``fn`` (:func:`compile` of ``cfg``) on torch's current stream; the only code that knows its argument
    order.  ``args``: a :class:`~cutedsl_attn.planning.prefill.PrefillArgs` (shapes, dtypes and layouts there and in
    :meth:`PrefillKernel.kernel`); the tvm-ffi entry raises ValueError for a tensor of the wrong dtype, rank or
    alignment."""
    (q, k, v, indices, work, out, lse, mask, sinks, alibi_slopes, sm_scale, soft_cap, window_left, rope_rcp_scale,
     rope_log2_theta, output_scale) = args
    fn(q, k, v, indices, work, out, lse, mask, sinks, alibi_slopes, sm_scale, soft_cap, window_left, rope_rcp_scale,
       rope_log2_theta, output_scale)
