"""Portable MLA decode kernel (SM80-class instructions: ``cp.async``, ``ldmatrix``, ``mma.sync``).

MLA in the absorbed form is MQA with one latent KV head: K = ``[ckv | kpe]`` (576 wide), V = ``ckv`` (512).
Serves ``sm_90a``, ``sm_100a`` and ``sm_103a`` (only SM80-class instructions).  The module follows the kernel
contract: :data:`NAME`, :class:`Tiles`, :class:`Config`, :func:`unsupported_reason`, :func:`default_tiles`,
:func:`compile`, :func:`launch`.

Work decomposition (planned on the host by :func:`cutedsl_attn.planning.mla.plan_mla`):

* one CTA per (16-row tile, work item), row tiles fastest in the grid; a request's ``qo_len x num_heads``
  query rows are packed into 16-row tiles (row ``r``: query token ``r // H``, head ``r % H``), so the CTAs
  reading one request's pages run side by side and share them through L2;
* the CTA's four warps stream ``tile_n``-token chunks of K through a ``num_stages``-deep ``cp.async`` ring in
  shared memory (pages gathered through the page table, rows past the item's end zero-filled, so NaN in
  unused slots never reaches an MMA); each token row holds ``[ckv | kpe]`` once and serves as K and, its
  first 512 columns, as V;
* S = Q K^T is split along the 576-wide reduction: warp ``w`` multiplies dims ``[144 w, 144 w + 144)`` (its
  Q fragments, 36 registers, stay in registers), the four partial S tiles are summed through shared memory
  (double buffered, one CTA barrier per chunk, summed in the same order by every warp so all hold the same
  S bit for bit); each warp then runs the same fp32 online softmax and O += P V for its own 128 columns of
  O and V (64 accumulator registers).  A warp computing the whole S for its rows would hold 144 Q registers
  (the build spills at 255) and repeat the 576-wide S four times;
* a request with one work item writes O and the LSE from registers; a split request (split-KV) writes fp32
  partials and the last CTA of (request, row tile) to finish (an ``atom.add`` counter, reset by that CTA, so
  CUDA-graph replay needs no reset) merges them: no second launch.

Conventions (FlashInfer's MLA): logits ``sm_scale * (q_nope . ckv + q_pe . kpe)``, LSE base 2, causal
bottom-right (query token ``i`` sees keys ``j <= i + kv_len - qo_len``), empty rows give O = 0 and LSE = -inf.
O is multiplied by ``output_scale`` (``v_scale / o_scale``, trtllm's ``bmm2_scale``) in fp32 before the 16-bit
rounding, in the epilogue or the split-KV merge.
Page offsets are 64-bit products (``page_id * page_stride`` may pass 2^32).

fp8 e4m3 caches (``kv_dtype="float8_e4m3fn"``, and an fp8 q): rows land in the ring at 1 byte per element
(``576 + 16`` bytes); before its partial S each warp widens its own 144 columns of the chunk to f16
(``cvt.rn.f16x2.e4m3x2``, exact) into a double-buffered 16-bit tile, so the chunk barrier that publishes the
partial S also publishes the whole widened tile to the P V step.  Both MMAs then run in f16: an fp8 q is
widened in shared memory once per CTA, a bf16 q's A fragments are rounded to f16 in registers (exact for
values in f16's normal range; beyond 65504 they overflow).  Scales stay the caller's (``sm_scale``,
``output_scale``); softmax is fp32 as for 16-bit caches.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from ..common.dtypes import element_type
from ..common import ptx, splitkv
from ..common import softmax as sm
from ..common.constants import LOG2E, NEG_INF
from ..compile.arch import SUPPORTED_ARCHS, compile_options
from ..compile.fake import mla_tensors
from ..planning.decode import (
    W_BATCH, W_KV_LEN, W_NUM_SPLITS, W_PAGE_OFF, W_PART_BASE, W_SPLIT_IDX, W_TOK_END, W_TOK_START,
)
from ..planning.mla import HEAD_DIM_CKV, HEAD_DIM_KPE, MLA_WORK_COLS, TILE_M, W_Q_START, W_QO_LEN, MlaArgs, MlaProblem
from ..compile.tiles import check_int_fields, override_int_fields

NAME = "mla_decode_portable"

SMEM_LIMIT = 227 * 1024  # dynamic shared memory one CTA may use on sm_90a / sm_100a / sm_103a
D_QK = HEAD_DIM_CKV + HEAD_DIM_KPE  # 576
NUM_WARPS = 4
K_STEPS = D_QK // 16  # 36 k16 steps of S = Q K^T, 9 per warp
V_COLS = HEAD_DIM_CKV // NUM_WARPS  # 128 columns of O and V per warp


@dataclass(frozen=True)
class Tiles:
    """What the MLA kernel chooses: ``tile_n`` tokens per chunk (16 or 32; a 64-token stage is 73 KB, three of
    them do not fit) through a ``num_stages``-deep ``cp.async`` ring (3..6); ``num_warps`` is 4 (the 576-wide
    reduction splits into 9 k16 steps per warp and O's 512 columns into 128 per warp).

    Raises TypeError for a non-int field, ValueError for a value out of range.
    """

    tile_n: int = 32
    num_stages: int = 4
    num_warps: int = NUM_WARPS

    def __post_init__(self):
        check_int_fields(self)
        if self.tile_n not in (16, 32):
            raise ValueError(f"tile_n must be 16 or 32, got {self.tile_n}")
        if not 3 <= self.num_stages <= 6:
            raise ValueError(f"num_stages must be in [3, 6], got {self.num_stages}")
        if self.num_warps != NUM_WARPS:
            raise ValueError(f"num_warps must be {NUM_WARPS} (9 of the 36 k16 steps of S and 128 of O's 512 "
                             f"columns per warp), got {self.num_warps}")


TUNING_FIELDS = tuple(f.name for f in fields(Tiles))


def unsupported_reason(problem: MlaProblem) -> str | None:
    """Why the MLA kernel cannot serve ``problem``, or None: it refuses a target outside
    ``compile.arch.SUPPORTED_ARCHS``.  Raises TypeError when ``problem`` is not an MlaProblem."""
    if not isinstance(problem, MlaProblem):
        raise TypeError(f"problem must be an MlaProblem, got {type(problem).__name__}")
    if problem.arch not in SUPPORTED_ARCHS:
        return f"arch must be one of {SUPPORTED_ARCHS}, got {problem.arch!r}"
    return None


@dataclass(frozen=True)
class Config:
    """Compile-time configuration of :class:`MlaDecodeKernel` (its cache key): the problem and the tiles.

    Raises TypeError for ``tiles`` of another type, ValueError with :func:`unsupported_reason`'s reason or when
    the tiles need more than :data:`SMEM_LIMIT` bytes of shared memory.
    """

    problem: MlaProblem
    tiles: Tiles

    def __post_init__(self):
        if not isinstance(self.tiles, Tiles):
            raise TypeError(f"tiles must be an MLA Tiles, got {type(self.tiles).__name__}")
        reason = unsupported_reason(self.problem)
        if reason is not None:
            raise ValueError(f"the MLA kernel cannot serve this problem: {reason}")
        if self.smem_bytes > SMEM_LIMIT:
            raise ValueError(f"{self.tiles} needs {self.smem_bytes} bytes of shared memory, more than "
                             f"{SMEM_LIMIT}: use fewer stages or a smaller tile_n")

    @property
    def arch(self) -> str:
        return self.problem.arch

    @property
    def cutlass_dtype(self):
        """o's 16-bit type (q's, bf16 for an fp8 q)."""
        return element_type(self.problem.out_dtype)

    @property
    def q_cutlass_dtype(self):
        return cutlass.Float8E4M3FN if self.problem.q_fp8 else self.cutlass_dtype

    @property
    def kv_cutlass_dtype(self):
        return cutlass.Float8E4M3FN if self.problem.kv_fp8 else self.cutlass_dtype

    @property
    def mma_dtype(self):
        """The 16-bit type both MMAs run in: f16 under fp8 caches (e4m3 widens exactly to f16), else q's."""
        return cutlass.Float16 if self.problem.kv_fp8 else self.cutlass_dtype

    @property
    def num_threads(self) -> int:
        return 32 * self.tiles.num_warps

    @property
    def row_bytes(self) -> int:
        """Bytes of one ``[ckv | kpe]`` (or ``[q_nope | q_pe]``) row in shared memory."""
        return D_QK * 2 + 16  # 73 x 16 bytes: odd, so ldmatrix rows hit distinct banks

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one ring row: the 16-bit row, or ``576 + 16`` (37 x 16) for an fp8 cache."""
        return D_QK + 16 if self.problem.kv_fp8 else self.row_bytes

    @property
    def smem_q_bytes(self) -> int:
        return TILE_M * self.row_bytes

    @property
    def smem_kv_bytes(self) -> int:
        return self.tiles.num_stages * self.tiles.tile_n * self.kv_row_bytes

    @property
    def smem_widen_bytes(self) -> int:
        """fp8 caches: two widened 16-bit chunks (the second holds an fp8 q's bytes before the main loop)."""
        return 2 * self.tiles.tile_n * self.row_bytes if self.problem.kv_fp8 else 0

    @property
    def smem_s_bytes(self) -> int:
        """Two buffers of the warps' partial S tiles (fp32, 16 x tile_n each)."""
        return 2 * self.tiles.num_warps * TILE_M * self.tiles.tile_n * 4

    @property
    def smem_bytes(self) -> int:
        return self.smem_q_bytes + self.smem_s_bytes + 128 + self.smem_kv_bytes + self.smem_widen_bytes

    @property
    def max_splits_per_request(self) -> int:
        """Most pieces a split request may have: the merge keeps one fp32 weight per (piece, row) in the ring."""
        return self.smem_kv_bytes // (TILE_M * 4)


def default_tiles(problem: MlaProblem, *, num_sms: int) -> Tiles:
    """The default tiles (``num_sms`` unused: the planner fills the GPU by splitting).  Not tuned yet:

    ==============================  ==========================================================================
    16-bit caches                   tile_n 32, 4 stages: up to 96 tokens in flight, one CTA per SM (185 KB)
    fp8 caches                      tile_n 32, 6 stages: 160 tokens in flight in half-size rows (218 KB)
    ==============================  ==========================================================================
    """
    if problem.kv_fp8:
        return Tiles(tile_n=32, num_stages=6)
    return Tiles(tile_n=32, num_stages=4)


def override_tiles(tiles: Tiles, items: dict[str, str]) -> Tiles:
    """``tiles`` with the fields named in ``items`` (field name -> decimal text) replaced; ValueError naming an
    unknown key or a non-integer value, :class:`Tiles`' errors for one out of range."""
    return override_int_fields(tiles, items)


def _st_shared_v4_f32(addr, a, b, c, d):
    """16-byte fp32 store to a shared-window byte address (Int32, 16-byte aligned): ``st.shared.v4.f32``."""
    cute.arch.inline_ptx("st.shared.v4.f32 [{$r0}], { {$r1}, {$r2}, {$r3}, {$r4} };",
                         read_only_args=[Int32(addr), Float32(a), Float32(b), Float32(c), Float32(d)])


def _st_shared_v4_b32(addr, a, b, c, d):
    """16-byte store to a shared-window byte address (Int32, 16-byte aligned): ``st.shared.v4.b32``."""
    cute.arch.inline_ptx("st.shared.v4.b32 [{$r0}], { {$r1}, {$r2}, {$r3}, {$r4} };",
                         read_only_args=[Int32(addr), Int32(a), Int32(b), Int32(c), Int32(d)])


def _widen8(src, dst):
    """8 e4m3 bytes at shared ``src`` (8-byte aligned) -> 8 f16 at ``dst`` (16-byte aligned); exact."""
    w = ptx.ld_shared_v2_b32(src)
    a = ptx.e4m3x4_to_f16x2(w[0])
    b = ptx.e4m3x4_to_f16x2(w[1])
    _st_shared_v4_b32(dst, a[0], a[1], b[0], b[1])


def _ld_shared_v4_f32(addr):
    """16-byte fp32 load from a shared-window byte address (Int32, 16-byte aligned): 4 Float32."""
    return cute.arch.inline_ptx("ld.shared.v4.f32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
                                write_only_types=[Float32] * 4, read_only_args=[Int32(addr)])


class MlaDecodeKernel:
    """CuTe DSL MLA decode; see the module docstring.  Build with :func:`compile`."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.problem = cfg.problem
        self.dtype = cfg.cutlass_dtype
        self.mma_dt = cfg.mma_dtype
        self.kv_fp8 = cfg.problem.kv_fp8
        self.q_fp8 = cfg.problem.q_fp8
        self.q_to_f16 = cfg.problem.kv_fp8 and cfg.problem.dtype == "bfloat16"
        self.KRB = cfg.kv_row_bytes
        self.PS = cfg.problem.page_size
        self.TN = cfg.tiles.tile_n
        self.S = cfg.tiles.num_stages
        self.NW = cfg.tiles.num_warps
        self.NT = cfg.num_threads
        self.RB = cfg.row_bytes
        self.NS = self.TN // 2  # S accumulator registers per lane (16 x tile_n fp32 over 32 lanes)
        self.KPW = K_STEPS // self.NW  # k16 steps of S per warp

    @cute.jit
    def __call__(self, mQn: cute.Tensor, mQp: cute.Tensor, mCkv: cute.Tensor, mKpe: cute.Tensor, mIdx: cute.Tensor,
                 mWork: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mPO: cute.Tensor, mPLSE: cute.Tensor,
                 mCnt: cute.Tensor, sm_scale: Float32, output_scale: Float32, num_row_tiles: Int32, stream):
        self.kernel(mQn, mQp, mCkv, mKpe, mIdx, mWork, mO, mLSE, mPO, mPLSE, mCnt, sm_scale, output_scale).launch(
            grid=(num_row_tiles, mWork.shape[0], 1),
            block=(self.NT, 1, 1),
            smem=self.cfg.smem_bytes,
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mQn, mQp, mCkv, mKpe, mIdx, mWork, mO, mLSE, mPO, mPLSE, mCnt, sm_scale: Float32,
               output_scale: Float32):
        """Device entry: one CTA per (16-row tile, work item); see the module docstring."""
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        tile, wi, _ = cute.arch.block_idx()
        n_tiles, _, _ = cute.arch.grid_dim()
        lane = tidx % 32
        warp = tidx // 32
        smem_base = cute.arch.get_dyn_smem(cutlass.Int8, alignment=128).toint()
        sQ = smem_base
        sS = sQ + cfg.smem_q_bytes
        sFlag = sS + cfg.smem_s_bytes
        sKV = sFlag + 128

        H = mQn.shape[1]
        b = mWork[wi, W_BATCH]
        if b >= 0:
            qo_len = mWork[wi, W_QO_LEN]
            rows = qo_len * H
            row0 = tile * TILE_M
            if row0 < rows:
                q_start = mWork[wi, W_Q_START]
                t0 = mWork[wi, W_TOK_START]
                t1 = mWork[wi, W_TOK_END]
                kv_len = mWork[wi, W_KV_LEN]
                page_off = mWork[wi, W_PAGE_OFF]
                n_splits = mWork[wi, W_NUM_SPLITS]
                part0 = mWork[wi, W_PART_BASE]
                acc = cute.make_rmem_tensor(((V_COLS // 8) * 4,), Float32)
                row_m = cute.make_rmem_tensor((2,), Float32)
                row_l = cute.make_rmem_tensor((2,), Float32)
                self._mainloop(mQn, mQp, mCkv, mKpe, mIdx, acc, row_m, row_l, sQ, sS, sKV, q_start, row0, rows, H,
                               t0, t1, kv_len, qo_len, page_off, sm_scale * LOG2E, tidx, lane, warp,
                               sKV + cfg.smem_kv_bytes)
                part = part0 + mWork[wi, W_SPLIT_IDX]
                self._epilogue(mO, mLSE, mPO, mPLSE, acc, row_m, row_l, q_start, row0, rows, H, part,
                               n_splits == 1, output_scale, lane, warp)
                if n_splits > 1:
                    self._merge_splits(mO, mLSE, mPO, mPLSE, mCnt, sFlag, sKV, b, tile, n_tiles, q_start, row0,
                                       rows, H, part0, n_splits, output_scale, tidx)

    # ------------------------------------------------------------------ main loop
    @cute.jit
    def _mainloop(self, mQn, mQp, mCkv, mKpe, mIdx, acc, row_m, row_l, sQ, sS, sKV, q_start, row0, rows, H,
                  t0, t1, kv_len, qo_len, page_off, sc, tidx, lane, warp, sWid):
        """Q -> registers, then the chunks of ``[t0, t1)`` through the ring (module docstring).  ``sWid``: the
        two widened 16-bit chunks of an fp8 cache."""
        S, TN, RB, NS, KPW = self.S, self.TN, self.RB, self.NS, self.KPW
        dt = self.mma_dt
        g = lane // 4
        t = lane % 4
        m8 = lane // 8
        for i in cutlass.range_constexpr((V_COLS // 8) * 4):
            acc[i] = Float32(0.0)
        # the last key each of this lane's rows g, g + 8 may see (bottom-right causal)
        lim = cute.make_rmem_tensor((2,), Int32)
        for h in cutlass.range_constexpr(2):
            row_m[h] = Float32(NEG_INF)
            row_l[h] = Float32(0.0)
            lim[h] = t1 - 1
            if const_expr(self.problem.causal):
                pr = cutlass.min(row0 + g + 8 * h, rows - 1)
                lim[h] = cutlass.min(t1 - 1, kv_len - qo_len + pr // H)

        if const_expr(self.q_fp8):
            self._load_q8(mQn, mQp, sWid + TN * RB, q_start, row0, rows, H, tidx)
        else:
            self._load_q(mQn, mQp, sQ, q_start, row0, rows, H, tidx)
        n_chunks = (t1 - t0 + TN - 1) // TN
        for s in cutlass.range_constexpr(S - 1):
            if s < n_chunks:
                self._load_chunk(mCkv, mKpe, mIdx, sKV + s * TN * self.KRB, t0 + s * TN, t1, page_off, tidx)
            ptx.cp_async_commit()
        ptx.cp_async_wait(S - 2)  # Q and chunk 0 have landed
        cute.arch.sync_threads()
        if const_expr(self.q_fp8):
            # the 16 fp8 rows -> f16 rows of sQ: 72 pieces of 8 elements a row
            for k in cutlass.range_constexpr(TILE_M * (D_QK // 8) // self.NT):
                u = tidx + k * self.NT
                _widen8(sWid + TN * RB + (u // (D_QK // 8)) * self.KRB + (u % (D_QK // 8)) * 8,
                        sQ + (u // (D_QK // 8)) * RB + (u % (D_QK // 8)) * 16)
            cute.arch.sync_threads()

        qf = cute.make_rmem_tensor((KPW * 4,), Int32)
        q_row = (m8 % 2) * 8 + lane % 8
        for j in cutlass.range_constexpr(KPW):
            qr = ptx.ldmatrix_x4(sQ + q_row * RB + ((warp * KPW + j) * 16 + (m8 // 2) * 8) * 2)
            for e in cutlass.range_constexpr(4):
                if const_expr(self.q_to_f16):
                    qf[j * 4 + e] = ptx.bf16x2_to_f16x2(qr[e])  # the MMAs run in f16 under an fp8 cache
                else:
                    qf[j * 4 + e] = qr[e]

        k_row = (m8 // 2) * 8 + lane % 8
        v_row = (m8 % 2) * 8 + lane % 8
        sacc = cute.make_rmem_tensor((NS,), Float32)
        for i in cutlass.range(n_chunks, unroll=1):
            if const_expr(self.kv_fp8):
                # this warp's 144 columns of chunk i -> f16; the chunk barrier below publishes the rest for P V
                sK = sWid + (i % 2) * TN * RB
                self._widen_chunk(sKV + (i % S) * TN * self.KRB, sK, lane, warp)
                cute.arch.sync_warp()
            else:
                sK = sKV + (i % S) * TN * RB
            # partial S over this warp's 144 dims
            for e in cutlass.range_constexpr(NS):
                sacc[e] = Float32(0.0)
            for j in cutlass.range_constexpr(KPW):
                a = (qf[j * 4], qf[j * 4 + 1], qf[j * 4 + 2], qf[j * 4 + 3])
                for nb in cutlass.range_constexpr(TN // 16):
                    kb = ptx.ldmatrix_x4(sK + (nb * 16 + k_row) * RB + ((warp * KPW + j) * 16 + (m8 % 2) * 8) * 2)
                    for jj in cutlass.range_constexpr(2):
                        n8 = 2 * nb + jj
                        c = ptx.mma_m16n8k16(a, (kb[2 * jj], kb[2 * jj + 1]),
                                             (sacc[4 * n8], sacc[4 * n8 + 1], sacc[4 * n8 + 2], sacc[4 * n8 + 3]), dt)
                        for e in cutlass.range_constexpr(4):
                            sacc[4 * n8 + e] = c[e]
            # [warp][e // 4][lane][e % 4]: 16-byte vectors, consecutive lanes consecutive (conflict-free)
            s_buf = sS + (i % 2) * (self.NW * NS * 32 * 4)
            for e4 in cutlass.range_constexpr(NS // 4):
                _st_shared_v4_f32(s_buf + ((warp * (NS // 4) + e4) * 32 + lane) * 16,
                                  sacc[4 * e4], sacc[4 * e4 + 1], sacc[4 * e4 + 2], sacc[4 * e4 + 3])
            ptx.cp_async_wait(S - 3)  # chunk i + 1 has landed (this thread's copies)
            cute.arch.sync_threads()  # partial S of every warp and chunk i + 1 visible; chunk i - 1's stage free
            if i + S - 1 < n_chunks:
                self._load_chunk(mCkv, mKpe, mIdx, sKV + ((i + S - 1) % S) * TN * self.KRB, t0 + (i + S - 1) * TN,
                                 t1, page_off, tidx)
            ptx.cp_async_commit()
            # full S, summed in warp order (the same bits in every warp), scaled to log2 units and masked
            start = t0 + i * TN
            for e4 in cutlass.range_constexpr(NS // 4):
                x = _ld_shared_v4_f32(s_buf + (e4 * 32 + lane) * 16)
                xs = [x[0], x[1], x[2], x[3]]
                for w in cutlass.range_constexpr(1, self.NW):
                    y = _ld_shared_v4_f32(s_buf + ((w * (NS // 4) + e4) * 32 + lane) * 16)
                    for k in cutlass.range_constexpr(4):
                        xs[k] = xs[k] + y[k]
                for k in cutlass.range_constexpr(4):
                    e = 4 * e4 + k
                    tok = start + e4 * 8 + 2 * t + (k % 2)
                    sacc[e] = cutlass.select_(tok <= lim[k // 2], xs[k] * sc, Float32(NEG_INF))
            scale = cute.make_rmem_tensor((2,), Float32)
            sm.online_softmax_step(sacc, TN // 8, row_m, row_l, scale)
            sm.rescale_rows(acc, V_COLS // 8, scale)
            # O[:, this warp's 128 columns] += P V
            for ks in cutlass.range_constexpr(TN // 16):
                pa = sm.p_as_a_operand(sacc, ks, dt)
                for dp in cutlass.range_constexpr(V_COLS // 16):
                    vb = ptx.ldmatrix_x4(sK + (ks * 16 + v_row) * RB + (warp * V_COLS + (2 * dp + m8 // 2) * 8) * 2,
                                         trans=True)
                    for jj in cutlass.range_constexpr(2):
                        dd = 2 * dp + jj
                        c = ptx.mma_m16n8k16(pa, (vb[2 * jj], vb[2 * jj + 1]),
                                             (acc[dd * 4], acc[dd * 4 + 1], acc[dd * 4 + 2], acc[dd * 4 + 3]), dt)
                        for e in cutlass.range_constexpr(4):
                            acc[dd * 4 + e] = c[e]
        ptx.cp_async_wait(0)
        sm.quad_sum_rows(row_l)

    @cute.jit
    def _load_q(self, mQn, mQp, sQ, q_start, row0, rows, H, tidx):
        """cp.async the tile's 16 packed Q rows ``[q_nope | q_pe]`` -> smem (zero-filled past ``rows``): 8
        threads per row, 9 16-byte pieces each; one commit group."""
        RB = self.RB
        r = tidx // 8
        c8 = tidx % 8
        pr = row0 + r
        pr_c = cutlass.min(pr, rows - 1)
        tok = q_start + pr_c // H
        h = pr_c % H
        nbytes = cutlass.select_(pr < rows, 16, 0)
        qn = mQn.iterator.toint() + (Int64(tok) * mQn.stride[0] + Int64(h) * mQn.stride[1]) * 2
        qp = mQp.iterator.toint() + (Int64(tok) * mQp.stride[0] + Int64(h) * mQp.stride[1]) * 2
        for j in cutlass.range_constexpr(HEAD_DIM_CKV // 64):
            ptx.cp_async_16(sQ + r * RB + (j * 8 + c8) * 16, qn + (j * 8 + c8) * 16, nbytes)
        ptx.cp_async_16(sQ + r * RB + (HEAD_DIM_CKV // 8 + c8) * 16, qp + c8 * 16, nbytes)
        ptx.cp_async_commit()

    @cute.jit
    def _load_q8(self, mQn, mQp, sQ8, q_start, row0, rows, H, tidx):
        """cp.async the tile's 16 fp8 Q rows -> ``sQ8`` (``576 + 16``-byte rows, zero-filled past ``rows``): 8
        threads per row, 4 q_nope pieces each, the 4 q_pe pieces on threads 0..3; one commit group."""
        KRB = self.KRB
        r = tidx // 8
        c8 = tidx % 8
        pr = row0 + r
        pr_c = cutlass.min(pr, rows - 1)
        tok = q_start + pr_c // H
        h = pr_c % H
        nbytes = cutlass.select_(pr < rows, 16, 0)
        qn = mQn.iterator.toint() + (Int64(tok) * mQn.stride[0] + Int64(h) * mQn.stride[1])
        qp = mQp.iterator.toint() + (Int64(tok) * mQp.stride[0] + Int64(h) * mQp.stride[1])
        for j in cutlass.range_constexpr(HEAD_DIM_CKV // 128):
            ptx.cp_async_16(sQ8 + r * KRB + (j * 8 + c8) * 16, qn + (j * 8 + c8) * 16, nbytes)
        if c8 < HEAD_DIM_KPE // 16:
            ptx.cp_async_16(sQ8 + r * KRB + (HEAD_DIM_CKV // 16 + c8) * 16, qp + c8 * 16, nbytes)
        ptx.cp_async_commit()

    @cute.jit
    def _widen_chunk(self, src, dst, lane, warp):
        """This warp's 144 columns of a ``tile_n``-row fp8 chunk at ``src`` -> f16 rows at ``dst``: with 32 rows
        one row a lane in 16-byte pieces (row strides of 37 and 73 granules: conflict-free), with 16 two lanes a
        row in 8-byte pieces; constant offsets from one per-lane base."""
        cols = D_QK // self.NW
        col0 = warp * cols
        if const_expr(self.TN == 32):
            s0 = src + lane * self.KRB + col0
            d0 = dst + lane * self.RB + col0 * 2
            for c in cutlass.range_constexpr(cols // 16):
                w = ptx.ld_shared_v4_b32(s0 + c * 16)
                a = ptx.e4m3x4_to_f16x2(w[0])
                b = ptx.e4m3x4_to_f16x2(w[1])
                _st_shared_v4_b32(d0 + c * 32, a[0], a[1], b[0], b[1])
                a = ptx.e4m3x4_to_f16x2(w[2])
                b = ptx.e4m3x4_to_f16x2(w[3])
                _st_shared_v4_b32(d0 + c * 32 + 16, a[0], a[1], b[0], b[1])
        else:
            c0 = col0 + (lane // 16) * (cols // 2)
            for c in cutlass.range_constexpr(cols // 16):
                _widen8(src + (lane % 16) * self.KRB + c0 + c * 8, dst + (lane % 16) * self.RB + (c0 + c * 8) * 2)

    @cute.jit
    def _load_chunk(self, mCkv, mKpe, mIdx, s_dst, start, t1, page_off, tidx):
        """cp.async one ``tile_n``-token chunk of ``[ckv | kpe]`` rows (rows past ``t1`` zero-filled): 8 threads
        per row, 16 rows per pass, one page-table read per thread and row."""
        RB, PS = self.RB, self.PS
        c8 = tidx % 8
        ckv_base = mCkv.iterator.toint()
        kpe_base = mKpe.iterator.toint()
        for p in cutlass.range_constexpr(self.TN // 16):
            row = p * 16 + tidx // 8
            tok = start + row
            tok_c = cutlass.min(tok, t1 - 1)
            page = mIdx[page_off + tok_c // PS]
            slot = tok_c % PS
            nbytes = cutlass.select_(tok < t1, 16, 0)
            if const_expr(self.kv_fp8):
                # 1-byte elements: 4 ckv pieces per thread, the 4 kpe pieces on threads 0..3 of the row
                ckv = ckv_base + (Int64(page) * mCkv.stride[0] + Int64(slot) * mCkv.stride[1])
                kpe = kpe_base + (Int64(page) * mKpe.stride[0] + Int64(slot) * mKpe.stride[1])
                dst = s_dst + row * self.KRB
                for j in cutlass.range_constexpr(HEAD_DIM_CKV // 128):
                    ptx.cp_async_16(dst + (j * 8 + c8) * 16, ckv + (j * 8 + c8) * 16, nbytes)
                if c8 < HEAD_DIM_KPE // 16:
                    ptx.cp_async_16(dst + (HEAD_DIM_CKV // 16 + c8) * 16, kpe + c8 * 16, nbytes)
            else:
                # 64-bit: page * page_stride passes 2^32 for large caches
                ckv = ckv_base + (Int64(page) * mCkv.stride[0] + Int64(slot) * mCkv.stride[1]) * 2
                kpe = kpe_base + (Int64(page) * mKpe.stride[0] + Int64(slot) * mKpe.stride[1]) * 2
                dst = s_dst + row * RB
                for j in cutlass.range_constexpr(HEAD_DIM_CKV // 64):
                    ptx.cp_async_16(dst + (j * 8 + c8) * 16, ckv + (j * 8 + c8) * 16, nbytes)
                ptx.cp_async_16(dst + (HEAD_DIM_CKV // 8 + c8) * 16, kpe + c8 * 16, nbytes)

    # ------------------------------------------------------------------ epilogue and merge
    @cute.jit
    def _epilogue(self, mO, mLSE, mPO, mPLSE, acc, row_m, row_l, q_start, row0, rows, H, part, final, output_scale,
                  lane, warp):
        """This warp's 128 columns of O / l x ``output_scale`` (16-bit, or the unscaled fp32 partial of a split
        item) and, from warp 0, the rows' base-2 LSE."""
        dt = self.dtype
        g = lane // 4
        t = lane % 4
        o_base = mO.iterator.toint()
        for h in cutlass.range_constexpr(2):
            pr = row0 + g + 8 * h
            if pr < rows:
                l = row_l[h]
                inv = Float32(cutlass.select_(l > Float32(0.0), ptx.rcp(l), Float32(0.0)))
                # the output scale multiplies in fp32 before rounding; a split item's partials stay unscaled
                inv = inv * Float32(cutlass.select_(final, output_scale, Float32(1.0)))
                lse = Float32(cutlass.select_(l > Float32(0.0), row_m[h] + ptx.lg2(l), Float32(NEG_INF)))
                tok = q_start + pr // H
                hh = pr % H
                row_addr = o_base + (Int64(tok) * mO.stride[0] + Int64(hh) * mO.stride[1]) * 2
                for dd in cutlass.range_constexpr(V_COLS // 8):
                    col = warp * V_COLS + dd * 8 + 2 * t
                    v0 = acc[dd * 4 + 2 * h] * inv
                    v1 = acc[dd * 4 + 2 * h + 1] * inv
                    if final:
                        ptx.st_global_u32(row_addr + col * 2, ptx.pack2(v0, v1, dt))
                    else:
                        mPO[part, pr, col] = v0
                        mPO[part, pr, col + 1] = v1
                if warp == 0:
                    if t == 0:
                        if final:
                            mLSE[tok, hh] = lse
                        else:
                            mPLSE[part, pr] = lse

    @cute.jit
    def _merge_splits(self, mO, mLSE, mPO, mPLSE, mCnt, sFlag, sBuf, b, tile, n_tiles, q_start, row0, rows, H,
                      part0, n_splits, output_scale, tidx):
        """Split-KV: the last CTA of (request, row tile) to finish merges every piece's partial and writes O
        (x ``output_scale``, folded into the fp32 merge weights) and the LSE."""
        NT = self.NT
        dt = self.dtype
        is_last, cnt_addr = splitkv.last_to_arrive(mCnt, b, n_tiles, tile, n_splits, sFlag, tidx)
        if is_last:
            ptx.fence_gpu()
            R = mPO.shape[1]
            plse_base = mPLSE.iterator.toint()
            po_base = mPO.iterator.toint()
            if tidx < TILE_M:
                pr = row0 + tidx
                if pr < rows:
                    big_m = Float32(NEG_INF)
                    for p in cutlass.range(n_splits, unroll=1):
                        x = ptx.ld_global_cg_f32(plse_base + (Int64(part0 + p) * R + pr) * 4)
                        ptx.st_shared_f32(sBuf + (p * TILE_M + tidx) * 4, x)
                        big_m = cute.arch.fmax(big_m, x)
                    m_use = Float32(cutlass.select_(big_m == Float32(NEG_INF), Float32(0.0), big_m))
                    tot = Float32(0.0)
                    for p in cutlass.range(n_splits, unroll=1):
                        tot = tot + ptx.ex2(ptx.ld_shared_f32(sBuf + (p * TILE_M + tidx) * 4) - m_use)
                    inv = Float32(cutlass.select_(tot > Float32(0.0), ptx.rcp(tot), Float32(0.0))) * output_scale
                    for p in cutlass.range(n_splits, unroll=1):
                        a = sBuf + (p * TILE_M + tidx) * 4
                        ptx.st_shared_f32(a, ptx.ex2(ptx.ld_shared_f32(a) - m_use) * inv)
                    mLSE[q_start + pr // H, pr % H] = Float32(
                        cutlass.select_(tot > Float32(0.0), m_use + ptx.lg2(tot), Float32(NEG_INF)))
            cute.arch.sync_threads()
            o_base = mO.iterator.toint()
            n_vec = TILE_M * (HEAD_DIM_CKV // 4)
            for e in cutlass.range((n_vec + NT - 1 - tidx) // NT, unroll=1):
                vi = tidx + e * NT
                r = vi // (HEAD_DIM_CKV // 4)
                c4 = vi % (HEAD_DIM_CKV // 4)
                pr = row0 + r
                if pr < rows:
                    o0 = Float32(0.0)
                    o1 = Float32(0.0)
                    o2 = Float32(0.0)
                    o3 = Float32(0.0)
                    for p in cutlass.range(n_splits, unroll=4):
                        wgt = ptx.ld_shared_f32(sBuf + (p * TILE_M + r) * 4)
                        x = ptx.ld_global_cg_v4_f32(po_base + ((Int64(part0 + p) * R + pr) * HEAD_DIM_CKV + c4 * 4) * 4)
                        o0 = o0 + wgt * x[0]
                        o1 = o1 + wgt * x[1]
                        o2 = o2 + wgt * x[2]
                        o3 = o3 + wgt * x[3]
                    addr = o_base + (Int64(q_start + pr // H) * mO.stride[0] + Int64(pr % H) * mO.stride[1]
                                     + c4 * 4) * 2
                    ptx.st_global_u32(addr, ptx.pack2(o0, o1, dt))
                    ptx.st_global_u32(addr + 4, ptx.pack2(o2, o3, dt))
            if tidx == 0:
                ptx.st_global_u32(cnt_addr, 0)


def fake_tensors(cfg: Config) -> tuple:
    """The symbolic tensors :func:`compile` builds against (:func:`cutedsl_attn.compile.fake.mla_tensors`)."""
    return mla_tensors(cfg, MLA_WORK_COLS)


def compile(cfg: Config, *, keep_ptx_dir: str | None = None, keep_cubin: bool = False):
    """Compile :class:`MlaDecodeKernel` for ``cfg`` from fake tensors (no GPU needed).  Returns the tvm-ffi
    callable (call it through :func:`launch`).  ``keep_ptx_dir`` / ``keep_cubin``: keep the PTX / cubin there
    (:func:`cutedsl_attn.compile.arch.compile_options`; ValueError for ``keep_cubin`` without a dir)."""
    from cutlass.cute.runtime import make_fake_stream

    opts = compile_options(cfg.arch, keep_ptx_dir=keep_ptx_dir, keep_cubin=keep_cubin)
    return cute.compile(MlaDecodeKernel(cfg), *fake_tensors(cfg), Float32(1.0), Float32(1.0), Int32(1),
                        make_fake_stream(use_tvm_ffi_env_stream=True), options=opts)


def launch(fn, cfg: Config, args: MlaArgs) -> None:
    """Launch ``fn`` (:func:`compile` of ``cfg``) on torch's current stream over ``args.num_row_tiles`` x
    ``args.work.shape[0]`` CTAs; the only code that knows its argument order.  ``args``: an
    :class:`~cutedsl_attn.planning.mla.MlaArgs`; ``counters`` must read 0 (the kernel leaves them so).  The
    tvm-ffi entry raises ValueError for a tensor of the wrong dtype, rank or alignment."""
    (q_nope, q_pe, ckv, kpe, indices, work, out, lse, part_o, part_lse, counters, sm_scale, num_row_tiles,
     output_scale) = args
    fn(q_nope, q_pe, ckv, kpe, indices, work, out, lse, part_o, part_lse, counters, sm_scale, output_scale,
       num_row_tiles)
