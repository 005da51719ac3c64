"""Chunked gated delta rule (GDN) prefill kernel: the WY / UT-transform form on SM80-class instructions
(``cp.async``, ``ldmatrix``, ``mma.sync``), so it runs on SM90 and SM100 alike.

Per chunk of ``C = 64`` tokens of one sequence and output head (cumulative log2 decay ``G_r``,
``gamma_r = 2^G_r``, ``Gamma_rs = 2^(G_r - G_s)``; ``k``, ``q`` l2-normalised when asked; V-major state
``S [V, K]``)::

    A   = strict_tril(diag(beta) K K^T . Gamma)           T = (I + A)^-1 (unit lower triangular)
    W   = T diag(beta gamma) K       U = T diag(beta) V  Aqk = scale tril(Q K^T . Gamma)  (diagonal kept)
    V'  = U - W S^T
    O   = scale diag(gamma) Q S^T + Aqk V'
    S  <- gamma_last S + V'^T diag(gamma_last / gamma) K

One launch of :func:`compile`'s function runs two kernels on the stream:

* **prep** (:mod:`cutedsl_attn.common.gdn_prep`, also the SM90 chunked kernel's with ``Tiles.prep = 0``), one CTA per (chunk,
  output head), every chunk at once: the ``K K^T`` and ``Q K^T`` products
  (``mma.sync``, fp32 accumulation), the decay masks, ``T`` by forward substitution in fp32 (one thread a
  column), then ``W``, ``U`` (``mma.sync`` with ``T`` rounded to the io dtype, as FlashInfer's SM100 kernel
  stores it) and the per-token row factors ``scale * rq * gamma`` and ``rk * gamma_last / gamma`` (``rq``,
  ``rk``: the l2 normalisers, 1 without l2norm) into scratch (``W``, ``U``, ``Aqk`` in the io dtype);
* **main**, one CTA per (V-slice of ``tile_v`` rows, output head, sequence), walking the sequence's chunks in
  order with the fp32 state slice in registers (the ``mma`` accumulator layout of the state update) and a
  16-bit copy in shared memory for the ``W S^T`` and ``Q S^T`` products (state rounded to the io dtype for
  the MMA, as fla and FlashInfer do); the next chunk's operands arrive by ``cp.async`` while the current one
  is computed.

A sequence of length 0 writes its initial state (zeros without one) as its final state.  Each main CTA reads
its state slice before it writes it and no two CTAs share one, so an in-place pool update is race-free.
Served: GDN with a scalar gate per token and head (linear alpha or log alpha), K and V in 64 / 128, a V-major
fp32 / bf16 state.  The per-channel members (KDA, GDN-2) run this main kernel behind their own prep
(:mod:`cutedsl_attn.portable.kda_chunked`: a compile-time branch decays the state per K column); the rest of the
family runs the recurrent kernel.
The two kernels also compile apart (:func:`compile_prep`, :func:`compile_main` with a
:class:`~cutedsl_attn.planning.gdn_cp.MainRun`): the context-parallel path runs one prep and then the main kernel
alone several times on its scratch, two of those runs computing final states only (no q / Aqk reads, no outputs;
the transition run without U).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from ..common import ptx
from ..common.dtypes import element_type
from ..common.gdn_launch import compile_kernel, launch, launch_main, launch_prep, prep_tensors  # noqa: F401
from ..common.gdn_prep import PREP_THREADS, GdnPrep
from ..compile.tiles import override_int_fields
from ..planning import gdn_cp
from ..planning.gdn import (
    CHUNK, FLAG_HAS_INITIAL_STATE, FLAG_INITIAL_INDICES, FLAG_OUTPUT_INDICES, FLAG_WRITE_STATE, GdnProblem,
)
from ..planning.gdn_cp import MainRun

NAME = "gdn_chunked"
#: cache names of the split entry points (the prep alone, the main kernel alone: :func:`compile_prep`,
#: :func:`compile_main`), which the context-parallel path launches once and several times on one scratch
NAME_PREP = NAME + "_prep"
NAME_MAIN = NAME + "_main"



@dataclass(frozen=True)
class Tiles:
    """What the chunked kernel's main CTA chooses: ``tile_v`` state rows (V-slice) it owns (32 or 64) and
    ``num_warps`` (4 or 8): four 16-row slabs of the chunk for the chunk GEMMs (8 warps: two column halves of
    each), the state update split ``tile_v / 16`` x ``num_warps * 16 / tile_v``.  The prep kernel has 4 warps.

    Raises TypeError for a non-int field, ValueError for another value.
    """

    tile_v: int = 64
    num_warps: int = 8

    def __post_init__(self):
        for name in ("tile_v", "num_warps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {v!r}")
        if self.tile_v not in (32, 64):
            raise ValueError(f"tile_v must be 32 or 64, got {self.tile_v}")
        if self.num_warps not in (4, 8):
            raise ValueError(f"num_warps must be 4 or 8, got {self.num_warps}")


TUNING_FIELDS = tuple(f.name for f in dataclasses.fields(Tiles))


def unsupported_reason(problem: GdnProblem) -> str | None:
    """Why the chunked kernel cannot serve ``problem``, or None.  It serves GDN prefill: scalar gates, one update a
    token, a V-major state; per-channel gates (GDN-2, KDA), erase / write gates, Gated DeltaProduct, a K-major
    state and the decode step run the recurrent kernel.

    Raises TypeError when ``problem`` is not a GdnProblem.
    """
    if not isinstance(problem, GdnProblem):
        raise TypeError(f"problem must be a GdnProblem, got {type(problem).__name__}")
    if problem.gate_per_channel or problem.erase_write_gates or problem.num_householder != 1:
        return "the chunked kernel serves GDN (scalar gates, one update a token) only"
    if problem.state_k_major:
        return "the chunked kernel reads and writes a V-major state only"
    if problem.decode:
        return "the decode step (a few tokens a sequence) runs the recurrent kernel"
    if problem.head_dim_k not in (64, 128) or problem.head_dim_v not in (64, 128):
        return f"head dims {problem.head_dim_k}/{problem.head_dim_v}: served K, V in 64, 128"
    return None


@dataclass(frozen=True)
class Config:
    """The chunked kernel's compile key: ``Config(problem, tiles)``.

    Raises TypeError for a ``tiles`` of another type, ValueError with :func:`unsupported_reason`'s reason or
    when ``tile_v`` does not divide ``head_dim_v``.
    """

    problem: GdnProblem
    tiles: Tiles

    def __post_init__(self):
        if not isinstance(self.tiles, Tiles):
            raise TypeError(f"tiles must be a gdn_chunked Tiles, got {type(self.tiles).__name__}")
        reason = unsupported_reason(self.problem)
        if reason is not None:
            raise ValueError(f"the chunked GDN kernel cannot serve this problem: {reason}")
        if self.problem.head_dim_v % self.tiles.tile_v:
            raise ValueError(f"tile_v {self.tiles.tile_v} must divide head_dim_v {self.problem.head_dim_v}")

    @property
    def arch(self) -> str:
        return self.problem.arch

    # 16-byte row pads: conflict-free ldmatrix
    @property
    def row_k(self) -> int:
        return 2 * self.problem.head_dim_k + 16

    @property
    def row_v(self) -> int:
        return 2 * self.problem.head_dim_v + 16

    @property
    def row_c(self) -> int:
        return 2 * CHUNK + 16

    @property
    def row_bv(self) -> int:
        return 2 * self.tiles.tile_v + 16

    @property
    def row_a(self) -> int:
        return 4 * (CHUNK + 4)  # fp32 A rows, 16-byte aligned for vector loads

    @property
    def prep_smem_bytes(self) -> int:
        c = CHUNK  # A (fp32) takes Q's place once Aqk is written
        return c * max(self.row_k, self.row_a) + c * self.row_k + c * self.row_v + c * self.row_c + 4 * c * 4

    @property
    def stage_bytes(self) -> int:
        c = CHUNK
        return 3 * c * self.row_k + c * self.row_bv + c * self.row_c + 3 * c * 4

    @property
    def main_smem_bytes(self) -> int:
        return 2 * self.stage_bytes + self.tiles.tile_v * self.row_k + 2 * CHUNK * self.row_bv


@dataclass(frozen=True)
class MainConfig(gdn_cp.MainConfig):
    """The compile key of :func:`compile_main` (:class:`cutedsl_attn.planning.gdn_cp.MainConfig` of this
    kernel's :class:`Config`)."""

    CONFIG = Config
    KERNEL = NAME


def default_tiles(problem: GdnProblem, *, num_sms: int, chains: int | None = None) -> Tiles:
    """The default tiles for ``chains`` = N * HO (sequence, head) chains on ``num_sms`` SMs (None: many).
    Measured on the H200 (K = V = 128):

    ====================================  =====================================================================
    ``chains * V / 64 >= num_sms``        64 state rows x 4 warps: one wave of wide CTAs is already full
    fewer chains (one long sequence)      32 rows x 8 warps: twice the CTAs of a chain, more warps an SM
    ====================================  =====================================================================
    """
    del problem
    if chains is None or chains * 2 >= num_sms:
        return Tiles(tile_v=64, num_warps=4)
    return Tiles(tile_v=32, num_warps=8)


def override_tiles(tiles: Tiles, items: dict[str, str]) -> Tiles:
    """``tiles`` with the fields named in ``items`` (field name -> decimal text) replaced; ValueError naming the key
    for an unknown field or a non-integer value, and the Tiles checks for a refused value."""
    return override_int_fields(tiles, items)


class GdnChunkedKernel(GdnPrep):
    """CuTe DSL chunked GDN (prep + main kernels); see the module docstring.  Build with :func:`compile`."""

    def __init__(self, cfg: Config):
        p = cfg.problem
        self.cfg = cfg
        self.io = element_type(p.dtype)
        self.bf16_state = p.state_dtype == "bfloat16"
        self.K, self.V, self.C = p.head_dim_k, p.head_dim_v, CHUNK
        self.BV = cfg.tiles.tile_v
        self.NVB = p.head_dim_v // self.BV
        self.RK, self.RV, self.RC, self.RBV, self.RA = cfg.row_k, cfg.row_v, cfg.row_c, cfg.row_bv, cfg.row_a
        self.NW = cfg.tiles.num_warps
        self.NT = 32 * self.NW
        self.NHALF = self.NW // 4  # column parts of the chunk GEMMs
        self.CB = self.BV // self.NHALF  # state rows (output columns) a warp's chunk GEMMs cover
        self.WM = self.BV // 16  # state-update warps along V
        self.WN = self.NW // self.WM  # ... and along K
        self.NS = self.K // self.WN  # state columns a warp owns
        self.log_gate = p.gate_domain == "log"
        self.l2norm = p.use_qk_l2norm
        # the per-channel subclass (portable.kda_chunked) decays the state per K column; F grows by K gates
        self.per_channel = False
        self.F_BYTES = 3 * CHUNK * 4
        # a main-only launch (GdnChunkedMainKernel) may skip the outputs and the q / Aqk / U reads
        self.write_output = True
        self.zero_u = False

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
                 mCu: cute.Tensor, mChunks: cute.Tensor, mChunkOff: cute.Tensor, mH0: cute.Tensor,
                 mH0Idx: cute.Tensor, mHt: cute.Tensor, mHtIdx: cute.Tensor, mO: cute.Tensor, mW: cute.Tensor,
                 mU: cute.Tensor, mAqk: cute.Tensor, mF: cute.Tensor, scale: Float32, q_group: Int32,
                 k_group: Int32, v_group: Int32, flags: Int32, stream):
        self._launch_prep(mQ, mK, mV, mG, mBeta, mChunks, mO, mW, mU, mAqk, mF, scale, q_group, k_group, v_group,
                          flags, stream)
        self._launch_main(mQ, mK, mCu, mChunkOff, mH0, mH0Idx, mHt, mHtIdx, mO, mW, mU, mAqk, mF, q_group, k_group,
                          flags, stream)

    @cute.jit
    def _launch_prep(self, mQ, mK, mV, mG, mBeta, mChunks, mO, mW, mU, mAqk, mF, scale, q_group, k_group, v_group,
                     flags, stream):
        """Launch the prep kernel (traced inside ``__call__``): one CTA per (chunk, output head)."""
        self.prep(mQ, mK, mV, mG, mBeta, mChunks, mW, mU, mAqk, mF, scale, q_group, k_group, v_group,
                  flags).launch(grid=(mChunks.shape[0], mO.shape[1], 1), block=(PREP_THREADS, 1, 1),
                                smem=self.cfg.prep_smem_bytes, stream=stream)

    @cute.jit
    def _launch_main(self, mQ, mK, mCu, mChunkOff, mH0, mH0Idx, mHt, mHtIdx, mO, mW, mU, mAqk, mF, q_group, k_group,
                     flags, stream):
        """Launch the main kernel (traced inside ``__call__``): one CTA per (V-slice, output head, sequence)."""
        self.main(mQ, mK, mCu, mChunkOff, mH0, mH0Idx, mHt, mHtIdx, mO, mW, mU, mAqk, mF, q_group, k_group,
                  flags).launch(grid=(self.NVB * mO.shape[1], mCu.shape[0] - 1, 1), block=(self.NT, 1, 1),
                                smem=self.cfg.main_smem_bytes, stream=stream)

    @cute.jit
    def _gemm_tn(self, acc, sAt, RA: cutlass.Constexpr, m0, sB, RB: cutlass.Constexpr, n0,
                 n_tiles: cutlass.Constexpr, k_steps: cutlass.Constexpr, lane):
        """acc += A B with A given transposed: ``sAt`` ``[k, M]`` row-major (rows m0..m0+16 of A are its columns),
        B ``[k, n]`` row-major (columns n0..)."""
        m = lane // 8
        for kt in cutlass.range_constexpr(k_steps):
            a = ptx.ldmatrix_x4(sAt + (kt * 16 + (m // 2) * 8 + lane % 8) * RA + (m0 + (m % 2) * 8) * 2, trans=True)
            self._mma_nn_step(acc, a, sB, RB, kt, n0, n_tiles, lane)

    # ================================================================== prep kernel

    # ================================================================== main kernel
    @cute.kernel
    def main(self, mQ, mK, mCu, mChunkOff, mH0, mH0Idx, mHt, mHtIdx, mO, mW, mU, mAqk, mF, q_group: Int32,
             k_group: Int32, flags: Int32):
        """One CTA per (V-slice, output head, sequence): the chunk chain of the sequence."""
        C, K, BV, RK, RC, RBV, io = self.C, self.K, self.BV, self.RK, self.RC, self.RBV, self.io
        tidx, _, _ = cute.arch.thread_idx()
        bx, n, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        g = lane // 4
        t = lane % 4
        vb = bx % self.NVB
        ho = bx // self.NVB
        HO = mO.shape[1]
        v0 = vb * BV
        bos = mCu[n]
        eos = mCu[n + 1]
        c0 = mChunkOff[n]
        nch = mChunkOff[n + 1] - c0
        qh = ho // q_group
        kh = ho // k_group
        wm = warp // self.WN
        wn = warp % self.WN
        slab = warp % 4  # the chunk GEMMs: rows 16 slab .., state rows (output columns) c_lo .. c_lo + CB
        c_lo = (warp // 4) * self.CB
        CB = self.CB
        NT8 = self.NS // 8  # n8 tiles of the warp's state columns

        smem = cute.arch.get_dyn_smem(cutlass.Int8, alignment=128).toint()
        stage = self.cfg.stage_bytes
        sS = smem + 2 * stage
        sVp = sS + BV * RK
        sVd = sVp + C * RBV

        # the fp32 state slice: rows 16 wm + g (+8) of the V-slice, columns wn * NS + 8 i + 2 t (+1)
        st = cute.make_rmem_tensor((NT8 * 4,), Float32)
        for i in cutlass.range_constexpr(NT8 * 4):
            st[i] = Float32(0.0)
        if (flags & FLAG_HAS_INITIAL_STATE) != 0:
            row = n
            if (flags & FLAG_INITIAL_INDICES) != 0:
                row = mH0Idx[n]
            self._state_io(mH0, st, (Int64(row) * HO + ho), v0, wm, wn, g, t, False)
        self._state_to_smem(sS, st, wm, wn, g, t)

        if nch > 0:
            self._issue_chunk(mQ, mK, mW, mU, mAqk, mF, smem, c0, bos, cutlass.min(eos - bos, C), qh, kh, ho,
                              HO, v0, tidx)
        ptx.cp_async_commit()

        r0 = slab * 16
        accx = cute.make_rmem_tensor(((CB // 8) * 4,), Float32)
        accy = cute.make_rmem_tensor(((CB // 8) * 4,), Float32)
        for j in cutlass.range(nch, unroll=1):
            stg = smem + (j % 2) * stage
            if j + 1 < nch:
                t1 = bos + (j + 1) * C
                self._issue_chunk(mQ, mK, mW, mU, mAqk, mF, smem + ((j + 1) % 2) * stage, c0 + j + 1, t1,
                                  cutlass.min(eos - t1, C), qh, kh, ho, HO, v0, tidx)
            ptx.cp_async_commit()
            ptx.cp_async_wait(1)
            cute.arch.sync_threads()
            sQ = stg
            sK = sQ + C * RK
            sW = sK + C * RK
            sU = sW + C * RK
            sAqk = sU + C * RBV
            sF = sAqk + C * RC
            t0 = bos + j * C
            ln = cutlass.min(eos - t0, C)

            # X = W S^T (the chunk-start state); V' = U - X -> sVp, (rk gamma_last / gamma) V' -> sVd
            for i in cutlass.range_constexpr((CB // 8) * 4):
                accx[i] = Float32(0.0)
            self._gemm_nt(accx, sW, RK, r0, sS, RK, c_lo, CB // 8, K // 16, lane)
            for h in cutlass.range_constexpr(2):
                r = r0 + g + 8 * h
                kf = ptx.ld_shared_f32(sF + (C + r) * 4)
                for i in cutlass.range_constexpr(CB // 8):
                    col = c_lo + i * 8 + 2 * t
                    if const_expr(self.zero_u):  # the transition run: v = 0, so U = T diag(beta) V = 0
                        p0 = -accx[4 * i + 2 * h]
                        p1 = -accx[4 * i + 2 * h + 1]
                    else:
                        u0, u1 = ptx.unpack2(ptx.ld_shared_b32(sU + r * RBV + col * 2), io)
                        p0 = u0 - accx[4 * i + 2 * h]
                        p1 = u1 - accx[4 * i + 2 * h + 1]
                    if const_expr(self.write_output):
                        ptx.st_shared_b32(sVp + r * RBV + col * 2, ptx.pack2(p0, p1, io))
                    ptx.st_shared_b32(sVd + r * RBV + col * 2, ptx.pack2(p0 * kf, p1 * kf, io))
            if const_expr(self.write_output):
                # Y = (scale rq gamma) Q S^T (X is dead: one 16 x tile_v accumulator live beside the state)
                for i in cutlass.range_constexpr((CB // 8) * 4):
                    accy[i] = Float32(0.0)
                self._gemm_nt(accy, sQ, RK, r0, sS, RK, c_lo, CB // 8, K // 16, lane)
                for h in cutlass.range_constexpr(2):
                    qf = ptx.ld_shared_f32(sF + (r0 + g + 8 * h) * 4)
                    for i in cutlass.range_constexpr(CB // 8):
                        accy[4 * i + 2 * h] = accy[4 * i + 2 * h] * qf
                        accy[4 * i + 2 * h + 1] = accy[4 * i + 2 * h + 1] * qf
            cute.arch.sync_threads()

            if const_expr(self.write_output):
                # O = Y + Aqk V' (Aqk is lower triangular: warp w needs key blocks 0..w)
                self._gemm_nn(accy, sAqk, RC, r0, sVp, RBV, c_lo, CB // 8, C // 16, slab, lane)
                o_base = mO.iterator.toint()
                for h in cutlass.range_constexpr(2):
                    r = r0 + g + 8 * h
                    if r < ln:
                        row_addr = o_base + ((Int64(t0 + r) * HO + ho) * self.V + v0 + c_lo) * 2
                        for i in cutlass.range_constexpr(CB // 8):
                            ptx.st_global_u32(row_addr + (i * 8 + 2 * t) * 2,
                                              ptx.pack2(accy[4 * i + 2 * h], accy[4 * i + 2 * h + 1], io))

            # S = gamma_last S + V'd^T K (per channel: S D(2^G_last) + V'd^T Kd)
            if const_expr(self.per_channel):
                for i in cutlass.range_constexpr(NT8):
                    gl2 = ptx.ld_shared_v2_f32(sF + (2 * C + wn * self.NS + i * 8 + 2 * t) * 4)
                    for e in cutlass.range_constexpr(4):
                        st[4 * i + e] = st[4 * i + e] * gl2[e % 2]
            else:
                gl = ptx.ld_shared_f32(sF + 2 * C * 4)
                for i in cutlass.range_constexpr(NT8 * 4):
                    st[i] = st[i] * gl
            self._gemm_tn(st, sVd, RBV, wm * 16, sK, RK, wn * self.NS, NT8, C // 16, lane)
            self._state_to_smem(sS, st, wm, wn, g, t)
            cute.arch.sync_threads()
        ptx.cp_async_wait(0)

        if (flags & FLAG_WRITE_STATE) != 0:
            row = n
            if (flags & FLAG_OUTPUT_INDICES) != 0:
                row = mHtIdx[n]
            self._state_io(mHt, st, (Int64(row) * HO + ho), v0, wm, wn, g, t, True)

    @cute.jit
    def _issue_chunk(self, mQ, mK, mW, mU, mAqk, mF, stg, c, t0, ln, qh, kh, ho, HO, v0, tidx):
        """cp.async chunk ``c`` (tokens ``t0 .. t0 + ln``) into the stage at ``stg``: q / k rows (zero past ``ln``),
        the prep kernel's W, the V-slice of U, Aqk and the row factors."""
        C, K, V, BV, RK, RBV, RC = self.C, self.K, self.V, self.BV, self.RK, self.RBV, self.RC
        sQ = stg
        sK = sQ + C * RK
        sW = sK + C * RK
        sU = sW + C * RK
        sAqk = sU + C * RBV
        sF = sAqk + C * RC
        if const_expr(self.write_output):  # q and Aqk feed the outputs only
            self._load_rows(mQ, sQ, RK, K, t0, ln, qh, tidx, self.NT)
        self._load_rows(mK, sK, RK, K, t0, ln, kh, tidx, self.NT)
        blk = Int64(c) * HO + ho
        self._copy_block(mW.iterator.toint() + blk * (C * K * 2), K, 0, sW, RK, K, tidx)
        if const_expr(not self.zero_u):
            self._copy_block(mU.iterator.toint() + blk * (C * V * 2), V, v0, sU, RBV, BV, tidx)
        if const_expr(self.write_output):
            self._copy_block(mAqk.iterator.toint() + blk * (C * C * 2), C, 0, sAqk, RC, C, tidx)
        if tidx < self.F_BYTES // 16:
            ptx.cp_async_16(sF + tidx * 16, mF.iterator.toint() + blk * self.F_BYTES + tidx * 16, 16)

    @cute.jit
    def _copy_block(self, g_base, ld: cutlass.Constexpr, col0, s_dst, RB: cutlass.Constexpr, D: cutlass.Constexpr,
                    tidx):
        """cp.async ``C`` rows x ``D`` 16-bit columns (from ``col0``) of a row-major ``[C, ld]`` global block."""
        cpr = D // 8
        n_chunks = self.C * cpr
        for it in cutlass.range_constexpr((n_chunks + self.NT - 1) // self.NT):
            idx = it * self.NT + tidx
            if const_expr(n_chunks % self.NT == 0):
                self._copy_one(g_base, ld, col0, s_dst, RB, cpr, idx)
            else:
                if idx < n_chunks:
                    self._copy_one(g_base, ld, col0, s_dst, RB, cpr, idx)

    @cute.jit
    def _copy_one(self, g_base, ld: cutlass.Constexpr, col0, s_dst, RB: cutlass.Constexpr, cpr: cutlass.Constexpr,
                  idx):
        r = idx // cpr
        col = idx % cpr
        ptx.cp_async_16(s_dst + r * RB + col * 16, g_base + (Int64(r) * ld + col0 + col * 8) * 2, 16)

    @cute.jit
    def _state_io(self, mH, st, mat, v0, wm, wn, g, t, store: cutlass.Constexpr):
        """Load (or store) the thread's state fragment of matrix ``mat`` (= row * HO + head) of ``[*, HO, V, K]``."""
        K, V = self.K, self.V
        h_base = mH.iterator.toint()
        for i in cutlass.range_constexpr(self.NS // 8):
            for h in cutlass.range_constexpr(2):
                v = v0 + wm * 16 + g + 8 * h
                k = wn * self.NS + i * 8 + 2 * t
                off = (mat * V + v) * K + k
                if const_expr(self.bf16_state):
                    addr = h_base + off * 2
                    if const_expr(store):
                        ptx.st_global_u32(addr, ptx.pack2(st[4 * i + 2 * h], st[4 * i + 2 * h + 1],
                                                          cutlass.BFloat16))
                    else:
                        lo, hi = ptx.unpack2(ptx.ld_global_b32(addr), cutlass.BFloat16)
                        st[4 * i + 2 * h] = lo
                        st[4 * i + 2 * h + 1] = hi
                else:
                    addr = h_base + off * 4
                    if const_expr(store):
                        ptx.st_global_v2_f32(addr, st[4 * i + 2 * h], st[4 * i + 2 * h + 1])
                    else:
                        x = ptx.ld_global_v2_f32(addr)
                        st[4 * i + 2 * h] = x[0]
                        st[4 * i + 2 * h + 1] = x[1]

    @cute.jit
    def _state_to_smem(self, sS, st, wm, wn, g, t):
        """The state fragment rounded to the io dtype into ``sS`` ``[tile_v, K]`` (the next chunk's MMA operand)."""
        for i in cutlass.range_constexpr(self.NS // 8):
            for h in cutlass.range_constexpr(2):
                v = wm * 16 + g + 8 * h
                k = wn * self.NS + i * 8 + 2 * t
                ptx.st_shared_b32(sS + v * self.RK + k * 2,
                                  ptx.pack2(st[4 * i + 2 * h], st[4 * i + 2 * h + 1], self.io))


class GdnChunkedPrepKernel(GdnChunkedKernel):
    """The prep kernel alone (the main kernel's arguments accepted and unused): its scratch serves the main-only
    launches of :class:`GdnChunkedMainKernel`.  Build with :func:`compile_prep`."""

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
                 mCu: cute.Tensor, mChunks: cute.Tensor, mChunkOff: cute.Tensor, mH0: cute.Tensor,
                 mH0Idx: cute.Tensor, mHt: cute.Tensor, mHtIdx: cute.Tensor, mO: cute.Tensor, mW: cute.Tensor,
                 mU: cute.Tensor, mAqk: cute.Tensor, mF: cute.Tensor, scale: Float32, q_group: Int32,
                 k_group: Int32, v_group: Int32, flags: Int32, stream):
        self._launch_prep(mQ, mK, mV, mG, mBeta, mChunks, mO, mW, mU, mAqk, mF, scale, q_group, k_group, v_group,
                          flags, stream)


class GdnChunkedMainKernel(GdnChunkedKernel):
    """The main kernel alone, over a prep's scratch (the prep's arguments accepted and unused), computing what
    ``MainConfig.run`` names.  Build with :func:`compile_main`."""

    def __init__(self, mcfg: MainConfig):
        super().__init__(mcfg.config)
        self.write_output = mcfg.run is MainRun.OUTPUT
        self.zero_u = mcfg.run is MainRun.TRANSITION

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
                 mCu: cute.Tensor, mChunks: cute.Tensor, mChunkOff: cute.Tensor, mH0: cute.Tensor,
                 mH0Idx: cute.Tensor, mHt: cute.Tensor, mHtIdx: cute.Tensor, mO: cute.Tensor, mW: cute.Tensor,
                 mU: cute.Tensor, mAqk: cute.Tensor, mF: cute.Tensor, scale: Float32, q_group: Int32,
                 k_group: Int32, v_group: Int32, flags: Int32, stream):
        self._launch_main(mQ, mK, mCu, mChunkOff, mH0, mH0Idx, mHt, mHtIdx, mO, mW, mU, mAqk, mF, q_group, k_group,
                          flags, stream)


def compile(cfg: Config, *, keep_ptx_dir: str | None = None, keep_cubin: bool = False):
    """Compile :class:`GdnChunkedKernel` (both kernels, one function) for ``cfg`` from fake tensors (no GPU needed).

    Returns the tvm-ffi callable; call it through :func:`launch`.  Raises ValueError for ``keep_cubin`` without
    a ``keep_ptx_dir``.
    """
    return compile_kernel(GdnChunkedKernel(cfg), cfg.problem, keep_ptx_dir, keep_cubin)


def compile_prep(cfg: Config, *, keep_ptx_dir: str | None = None, keep_cubin: bool = False):
    """Compile the prep kernel alone (:class:`GdnChunkedPrepKernel`, cache name :data:`NAME_PREP`) for ``cfg``;
    call it through :func:`launch_prep`.  Errors as :func:`compile`'s."""
    return compile_kernel(GdnChunkedPrepKernel(cfg), cfg.problem, keep_ptx_dir, keep_cubin)


def compile_main(mcfg: MainConfig, *, keep_ptx_dir: str | None = None, keep_cubin: bool = False):
    """Compile the main kernel alone (:class:`GdnChunkedMainKernel`, cache name :data:`NAME_MAIN`) for ``mcfg``;
    call it through :func:`launch_main`.  Errors as :func:`compile`'s."""
    return compile_kernel(GdnChunkedMainKernel(mcfg), mcfg.config.problem, keep_ptx_dir, keep_cubin)
