"""The prep kernel of the chunked per-channel-decay delta rule (KDA, GDN-2): one CTA per (64-token chunk, output
head), every chunk at once, on SM80-class instructions (``cp.async``, ``ldmatrix``, ``mma.sync``).  Its scratch
feeds the chunked GDN main kernel (:mod:`cutedsl_attn.portable.gdn_chunked`, per-channel branch).

Per chunk (``G_r`` the cumulative log2 decay per key channel from the chunk's start, each token's log2 gate
floored at ``GATE_FLOOR_LOG2``; ``e`` the erase key: ``beta k`` for KDA, ``b * k`` for GDN-2; ``x`` the written
value: ``beta v`` / ``w * v``; ``k``, ``q`` l2-normalised when asked)::

    A   = [e_r . (k_s 2^(G_r - G_s))]_{s < r}       T = (I + A)^-1
    Aqk = scale [q_r . (k_s 2^(G_r - G_s))]_{s <= r}
    W   = T (e 2^G)       U = T x       Qg = q 2^G       Kd = k 2^(G_last - G)

``A`` and ``Aqk`` go by 16-token sub-chunks, warp ``i`` owning rows ``16 i ..`` against the reference
``p = 16 i - 1`` (row ``-1`` of G is a zero row): row operands ``e_r 2^(G_r - G_p)``, ``q_r 2^(G_r - G_p)``
(factors ``<= 1``; built once as MMA fragments in registers) times column operands ``k_s 2^(G_p - G_s)``
(``<= 1`` for the earlier sub-chunks; through a 16-row buffer a warp, which v takes over afterwards: two CTAs
an SM at K = V = 128).  On the diagonal block the column factor exceeds 1; where it would pass ``2^limit``
(:func:`cutedsl_attn.ref.kda_chunked.diag_limit`) or the operand would overflow the io dtype, the warp
recomputes that 16 x 16 block directly in fp32 with ``2^min(G_r - G_s, 0)`` per channel.  No factor ever
overflows, so any gate the API accepts (``g <= 0``, ``-inf`` included) gives a finite, exact result.  ``T`` is
computed in fp32 by 16 x 16 blocks (:meth:`~cutedsl_attn.common.gdn_prep.GdnPrep._invert_blocks`), and ``W`` /
``U`` take it rounded to the io dtype straight from its fp32 transpose in shared memory.

The scratch contract (``nc`` chunks of the plan, ``HO`` output heads, ``C = 64``):

* ``W`` ``[nc, HO, C, K]``, ``U`` ``[nc, HO, C, V]``, ``Aqk`` ``[nc, HO, C, C]``: io dtype, every row written;
* ``Qg``, ``Kd`` ``[T, HO, K]`` io dtype, token-major (the main kernel reads them as its q / k, zero past a
  chunk's end);
* ``F`` ``[nc, HO, 2 C + K]`` fp32: ``scale`` (0 past the end), 1 (0 past the end), ``2^G_last`` per channel.

:class:`KdaPrep` is a mixin over :class:`~cutedsl_attn.common.gdn_prep.GdnPrep` (whose GEMMs, loaders,
normaliser and inverse it reuses); the kernel class sets ``C``, ``K``, ``V``, ``RK``, ``RV``, ``RA``,
``io``, ``l2norm``, ``erase_write``, ``diag_limit``, ``io_max`` and launches ``self.prep`` with
``PREP_THREADS`` threads and :func:`prep_smem_bytes` bytes.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from . import ptx
from .constants import LOG2E
from .gdn_prep import _ld_shared_v4_f32, _st_f32
from .kda_prep_rolled import KdaPrepRolled, _ld_nc_v4_f32, _st8, _x8
from ..planning.gdn import CHUNK, FLAG_HAS_BETA, FLAG_HAS_G, GdnProblem

SUB = 16  # tokens a sub-chunk: one warp's 16-row slab
GATE_FLOOR_LOG2 = -200.0  # 2^-200 is 0 in fp32: flooring changes nothing and keeps G finite (no inf - inf)
PREP_THREADS = 128
IO_MAX = {"bfloat16": 3.0e38, "float16": 65000.0}  # the largest operand the diagonal block's factored path writes
DIAG_LIMIT = {"bfloat16": 96.0, "float16": 4.0}  # log2; ref.kda_chunked.diag_limit (the CPU test checks)
#: prep CTAs an SM of the two shared-memory layouts (``Tiles.prep_ctas``): 2, every operand its own buffer; 3,
#: the compact KDA layout (e derived from k and beta, buffers reused across phases; not for GDN-2's erase gates)
PREP_LAYOUTS = (2, 3)
#: the prep's loop levels (``Tiles.prep_rolled``, :class:`~cutedsl_attn.common.kda_prep_rolled.KdaPrepRolled`): 0
#: unrolled, 1 the column-block and Qg / Kd phases as run-time loops, 2 the other long phases as well
PREP_ROLLED = (0, 1, 2)
#: the compact layout's preferred shared-memory carveout (percent): three CTAs an SM need nearly all of it
PREP_SMEM_CARVEOUT = 100

_inline = cute.arch.inline_ptx


def check_prep_ctas(prep_ctas, erase_write_gates: bool = False) -> None:
    """The checks of a per-channel kernel's ``Tiles.prep_ctas`` (and, given the problem's ``erase_write_gates``,
    of its Config): TypeError for a non-int (a bool is not one), ValueError for a value outside
    :data:`PREP_LAYOUTS` or the compact layout (3) with GDN-2's erase gates."""
    if isinstance(prep_ctas, bool) or not isinstance(prep_ctas, int):
        raise TypeError(f"prep_ctas must be an int, got {prep_ctas!r}")
    if prep_ctas not in PREP_LAYOUTS:
        raise ValueError(f"prep_ctas must be one of {PREP_LAYOUTS}, got {prep_ctas}")
    if prep_ctas == 3 and erase_write_gates:
        raise ValueError("prep_ctas 3 (the compact prep layout) serves KDA (a scalar beta) only; GDN-2's erase "
                         "gates take prep_ctas 2")


def default_prep_ctas(problem: GdnProblem) -> int:
    """The per-channel kernels' default ``Tiles.prep_ctas``: the compact layout (3) for bf16 KDA (1.06-1.10x on
    the whole op on the H200, perf/RESULTS.md), 2 for GDN-2 (the compact layout has no room for the erase gates)
    and fp16 (whose always-taken direct diagonal spills at the compact layout's 168 registers)."""
    return 3 if problem.dtype == "bfloat16" and not problem.erase_write_gates else 2


def check_prep_rolled(prep_rolled) -> None:
    """The check of a per-channel kernel's ``Tiles.prep_rolled``: TypeError for a non-int (a bool is not one),
    ValueError for a value outside :data:`PREP_ROLLED`."""
    if isinstance(prep_rolled, bool) or not isinstance(prep_rolled, int):
        raise TypeError(f"prep_rolled must be an int, got {prep_rolled!r}")
    if prep_rolled not in PREP_ROLLED:
        raise ValueError(f"prep_rolled must be one of {PREP_ROLLED}, got {prep_rolled}")


def row_pitch_g(head_dim_k: int) -> int:
    """Bytes of one fp32 row of G in shared memory (16-byte pad)."""
    return 4 * head_dim_k + 16


def prep_smem_bytes(head_dim_k: int, head_dim_v: int, prep_ctas: int = 2) -> int:
    """Dynamic shared memory of one prep CTA.  ``prep_ctas = 2``: q (then A and T^T, fp32), k, e (16-bit), G
    (fp32, after a zero row: the first sub-chunk's reference), the four warps' column blocks (then v) and three
    fp32 vectors; two CTAs an SM fit at K = V = 128.  ``prep_ctas = 3`` (KDA): q (then the column blocks, then A
    and T^T), k (then e 2^G), G (then v) and the vectors; three CTAs an SM fit at K = V = 128.  ValueError for
    another ``prep_ctas``."""
    rk, rv, ra = 2 * head_dim_k + 16, 2 * head_dim_v + 16, 4 * (CHUNK + 4)
    c = CHUNK
    if prep_ctas == 3:
        return c * max(rk, ra) + c * rk + max((c + 1) * row_pitch_g(head_dim_k), c * rv) + 3 * c * 4
    if prep_ctas != 2:
        raise ValueError(f"prep_ctas must be one of {PREP_LAYOUTS}, got {prep_ctas!r}")
    return (c * max(rk, ra) + 2 * c * rk + (c + 1) * row_pitch_g(head_dim_k) + max(4 * SUB * rk, c * rv)
            + 3 * c * 4)


def _fmax(a, b):
    """``max.f32`` (one FMNMX: no NaN-propagating compare-and-select chain)."""
    return _inline("max.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32], read_only_args=[Float32(a), Float32(b)])


def _abs_max(a, b):
    """``max(|a|, |b|)``."""
    return _inline("{ .reg .f32 x, y; abs.f32 x, {$r0}; abs.f32 y, {$r1}; max.f32 {$w0}, x, y; }",
                   write_only_types=[Float32], read_only_args=[Float32(a), Float32(b)])


def _tree(op, xs):
    """``op`` over ``xs`` as a balanced tree (a chain of depth log2 n instead of n)."""
    while len(xs) > 1:
        xs = [op(xs[i], xs[i + 1]) if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
    return xs[0]


def _ld_nc_v4_b32(addr):
    return _inline("ld.global.nc.v4.b32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];", write_only_types=[Int32] * 4,
                   read_only_args=[Int64(addr)])


def _g8(addr) -> list:
    """Eight fp32 at a 16-byte aligned shared address."""
    return list(_ld_shared_v4_f32(addr)) + list(_ld_shared_v4_f32(addr + 16))


class KdaPrep(KdaPrepRolled):
    """The per-channel prep kernel (``prep``); a mixin, see the module docstring."""

    #: the compact shared-memory layout (``prep_ctas = 3``, KDA only): set by the kernel class
    compact = False
    #: ``rolled`` (:class:`~cutedsl_attn.common.kda_prep_rolled.KdaPrepRolled`, set by the kernel class): >= 1 runs
    #: the column-block and Qg / Kd phases as run-time loops (one copy of the step: the same values in 2/3 of the
    #: code, which the unrolled prep's instruction fetch cannot stream); 2 rolls the other phases as well

    @cute.kernel
    def prep(self, mQ, mK, mV, mG, mBeta, mChunks, mQg, mKd, mW, mU, mAqk, mF, scale: Float32, q_group: Int32,
             k_group: Int32, v_group: Int32, flags: Int32):
        """One CTA per (chunk, output head): ``W``, ``U``, ``Aqk``, ``Qg``, ``Kd`` and ``F`` of the chunk."""
        tidx, _, _ = cute.arch.thread_idx()
        c, ho, _ = cute.arch.block_idx()
        tok0 = mChunks[c, 1]
        ln = mChunks[c, 2]
        if ln > 0:
            if const_expr(self.compact):
                self._prep_compact(mQ, mK, mV, mG, mBeta, mQg, mKd, mW, mU, mAqk, mF, scale, q_group, k_group,
                                   v_group, flags, c, ho, tok0, ln, tidx)
            else:
                self._prep_wide(mQ, mK, mV, mG, mBeta, mQg, mKd, mW, mU, mAqk, mF, scale, q_group, k_group,
                                v_group, flags, c, ho, tok0, ln, tidx)

    @cute.jit
    def _prep_wide(self, mQ, mK, mV, mG, mBeta, mQg, mKd, mW, mU, mAqk, mF, scale, q_group, k_group, v_group,
                   flags, c, ho, tok0, ln, tidx):
        """The two-CTA layout: q, k, e, G, the column blocks (then v) in buffers of their own."""
        C, K, V, RK, RV, RA = self.C, self.K, self.V, self.RK, self.RV, self.RA
        RG = row_pitch_g(K)
        lane = tidx % 32
        warp = tidx // 32
        HO = mW.shape[1]
        smem = cute.arch.get_dyn_smem(cutlass.Int8, alignment=128).toint()
        sQ = smem
        sA = smem  # A (fp32), then T^T, take q's place once Qg is written
        sK = sQ + C * max(RK, RA)
        sE = sK + C * RK
        sG = sE + C * RK + RG  # row -1 (zeros) is the first sub-chunk's reference: G_p = 0 without a select
        sBuf = sG + C * RG  # the warps' column operands, then v (loaded once they are done)
        sV = sBuf
        sRq = sBuf + max(4 * SUB * RK, C * RV)  # the q normalisers, then ones (T's column scale for W / U)
        sRk = sRq + C * 4
        sB = sRk + C * 4
        self._prep_load(mQ, mK, mG, mBeta, sQ, sK, sG, sB, tok0, ln, ho, HO, ho // q_group, ho // k_group, flags,
                        tidx)
        self._normalise_qk_r(sQ, sRq, sK, sRk, warp, lane)
        self._cumsum(sG, tidx)
        cute.arch.sync_threads()
        self._gate_rows_r(mBeta, sK, sE, self.RK, K, 0, sB, tok0, ln, ho, HO, flags, tidx, PREP_THREADS)
        cute.arch.sync_threads()

        # this warp's 16 rows of A and Aqk, one 16-column block at a time (blocks past the diagonal are 0):
        # the row operands as MMA fragments in registers (built once), the column block through the warp's
        # buffer (bounds tracked on the diagonal block only: before it every factor is <= 1)
        r0 = warp * SUB
        frag = cute.make_rmem_tensor((2 * (K // 16) * 4,), Int32)
        self._row_frags(frag, sE, sQ, sG, sB, RG, r0, r0 - 1, lane)
        acc_kk = [cute.make_rmem_tensor((8,), Float32) for _ in range(C // SUB)]
        acc_qk = [cute.make_rmem_tensor((8,), Float32) for _ in range(C // SUB)]
        bad = self._a_phase(acc_kk, acc_qk, frag, sBuf + warp * (SUB * RK), sK, sG, warp, lane)
        if cute.arch.vote_any_sync(bad > Float32(0.0)):
            self._diag_into(acc_kk, acc_qk, sE, sQ, sK, sG, sB, RG, warp, lane)
        cute.arch.sync_threads()  # every warp is done with the raw rows and its buffer

        # v into the buffers' place (its load overlaps what follows); Qg, Kd -> token-major scratch, e 2^G
        # in place (the W operand), the row factors
        self._load_rows_r(mV, sV, RV, V, tok0, ln, ho // v_group, tidx, PREP_THREADS)
        ptx.cp_async_commit()
        self._decay_out(mQg, mKd, sQ, sE, sK, sG, sB, RG, tok0, ln, ho, HO, tidx, True, True)
        blk = Int64(c) * HO + ho
        self._row_factors(mF, sG, sRq, blk, scale, ln, tidx)
        cute.arch.sync_threads()  # q and k are dead: A takes q's place
        self._store_a(mAqk, sA, acc_kk, acc_qk, blk, scale, warp, lane)
        ptx.cp_async_wait(0)
        cute.arch.sync_threads()

        # T = (I + A)^-1 by 16 x 16 blocks (T^T left in sA, fp32); warps 2-3 first scale v by the write gate
        # (KDA: beta) in place while warps 0-1 substitute the diagonal blocks
        if tidx >= C:
            self._gate_rows_r(mBeta, sV, sV, RV, V, K, sB, tok0, ln, ho, HO, flags, tidx - C, PREP_THREADS - C)
        self._invert_blocks_r(sA, tidx)
        cute.arch.sync_threads()
        self._w_u(mW, mU, sA, sRq, sE, sV, blk, warp, lane)

    @cute.jit
    def _prep_compact(self, mQ, mK, mV, mG, mBeta, mQg, mKd, mW, mU, mAqk, mF, scale, q_group, k_group, v_group,
                      flags, c, ho, tok0, ln, tidx):
        """The three-CTA layout (KDA: ``e = beta k``, formed where it is read): q, then the column blocks, then
        A and T^T in one buffer; k, then ``e 2^G``; G, then v."""
        C, K, V, RK, RV, RA = self.C, self.K, self.V, self.RK, self.RV, self.RA
        RG = row_pitch_g(K)
        lane = tidx % 32
        warp = tidx // 32
        HO = mW.shape[1]
        smem = cute.arch.get_dyn_smem(cutlass.Int8, alignment=128).toint()
        sQ = smem
        sBuf = smem  # the warps' column blocks once the row operands and Qg are built: warp i's are q's rows 16 i ..
        sA = smem  # A, then T^T, once the column blocks are done
        sK = sQ + C * max(RK, RA)  # k, then e 2^G (the W operand) in place
        sV = sK + C * RK  # v over G once Kd and the row factors are written
        sG = sV + RG  # row -1 (zeros) is the first sub-chunk's reference
        sRq = sV + max((C + 1) * RG, C * RV)  # the q normalisers, then ones (T's column scale for W / U)
        sRk = sRq + C * 4
        sB = sRk + C * 4
        qh = ho // q_group
        self._prep_load(mQ, mK, mG, mBeta, sQ, sK, sG, sB, tok0, ln, ho, HO, qh, ho // k_group, flags, tidx)
        self._normalise_qk_r(sQ, sRq, sK, sRk, warp, lane)
        self._cumsum(sG, tidx)
        cute.arch.sync_threads()

        # the row operands (e = beta k, rounded as the two-CTA layout stores it), then Qg: q is dead after both
        r0 = warp * SUB
        frag = cute.make_rmem_tensor((2 * (K // 16) * 4,), Int32)
        self._row_frags(frag, sK, sQ, sG, sB, RG, r0, r0 - 1, lane)
        self._decay_out(mQg, mKd, sQ, sK, sK, sG, sB, RG, tok0, ln, ho, HO, tidx, True, False)
        cute.arch.sync_threads()  # every thread is done with q: the column blocks take its place
        acc_kk = [cute.make_rmem_tensor((8,), Float32) for _ in range(C // SUB)]
        acc_qk = [cute.make_rmem_tensor((8,), Float32) for _ in range(C // SUB)]
        bufK = sBuf + warp * (SUB * RK)
        bad = self._a_phase(acc_kk, acc_qk, frag, bufK, sK, sG, warp, lane)
        if cute.arch.vote_any_sync(bad > Float32(0.0)):
            # the direct block reads this warp's q rows: back from global into its buffer (rounded as before)
            self._restore_q_rows(mQ, bufK, sRq, tok0, ln, qh, r0, lane)
            cute.arch.sync_warp()
            self._diag_into(acc_kk, acc_qk, sK, sQ, sK, sG, sB, RG, warp, lane)
        cute.arch.sync_threads()  # every warp is done with its buffer and the raw k

        # Kd -> token-major scratch, e 2^G over k (the W operand), the row factors; then v over G
        self._decay_out(mQg, mKd, sQ, sK, sK, sG, sB, RG, tok0, ln, ho, HO, tidx, False, True)
        blk = Int64(c) * HO + ho
        self._row_factors(mF, sG, sRq, blk, scale, ln, tidx)
        cute.arch.sync_threads()  # G is dead: v takes its place, A the column blocks'
        self._load_rows_r(mV, sV, RV, V, tok0, ln, ho // v_group, tidx, PREP_THREADS)
        ptx.cp_async_commit()
        self._store_a(mAqk, sA, acc_kk, acc_qk, blk, scale, warp, lane)
        cute.arch.sync_threads()
        self._invert_blocks_r(sA, tidx)  # T = (I + A)^-1 by 16 x 16 blocks while v lands
        ptx.cp_async_wait(0)
        cute.arch.sync_threads()
        self._gate_rows_r(mBeta, sV, sV, RV, V, K, sB, tok0, ln, ho, HO, flags, tidx, PREP_THREADS)
        cute.arch.sync_threads()
        self._w_u(mW, mU, sA, sRq, sK, sV, blk, warp, lane)

    # ------------------------------------------------------------------ phases shared by the two layouts
    @cute.jit
    def _prep_load(self, mQ, mK, mG, mBeta, sQ, sK, sG, sB, tok0, ln, ho, HO, qh, kh, flags, tidx):
        """q, k and the log gates by cp.async, the zero row -1 of G, beta (KDA; 0 past the chunk's end) into sB;
        waits for them (CTA barrier)."""
        K, RK = self.K, self.RK
        RG = row_pitch_g(K)
        self._load_rows_r(mQ, sQ, RK, K, tok0, ln, qh, tidx, PREP_THREADS)
        self._load_rows_r(mK, sK, RK, K, tok0, ln, kh, tidx, PREP_THREADS)
        if const_expr(self.rolled >= 2):
            self._load_gates_steps(mG, sG, RG, tok0, ln, ho, HO, flags, tidx)
        else:
            self._load_gates(mG, sG, RG, tok0, ln, ho, HO, flags, tidx)
        ptx.cp_async_commit()
        for d0 in cutlass.range_constexpr(0, K, PREP_THREADS):
            if d0 + tidx < K:
                ptx.st_shared_f32(sG - RG + (d0 + tidx) * 4, Float32(0.0))
        if const_expr(not self.erase_write):
            if tidx < self.C:
                b = Float32(0.0)  # beta = 0 past the chunk's end
                if tidx < ln:
                    b = Float32(1.0)
                    if (flags & FLAG_HAS_BETA) != 0:
                        b = mBeta[tok0 + tidx, ho]
                ptx.st_shared_f32(sB + tidx * 4, b)
        ptx.cp_async_wait(0)
        cute.arch.sync_threads()

    @cute.jit
    def _cumsum(self, sG, tidx):
        """The cumulative log2 decay in place (a thread a channel), each token's gate floored."""
        RG = row_pitch_g(self.K)
        if const_expr(self.rolled >= 2):
            self._cumsum_steps(sG, RG, GATE_FLOOR_LOG2, tidx)
        elif tidx < self.K:
            run = Float32(0.0)
            for r in cutlass.range_constexpr(self.C):
                x = ptx.ld_shared_f32(sG + r * RG + tidx * 4)
                run = run + cutlass.max(x * Float32(LOG2E), Float32(GATE_FLOOR_LOG2))
                ptx.st_shared_f32(sG + r * RG + tidx * 4, run)

    @cute.jit
    def _a_phase(self, acc_kk, acc_qk, frag, bufK, sK, sG, warp, lane):
        """This warp's blocks ``j <= warp`` of A and Aqk (one column block at a time through ``bufK``) into
        ``acc_kk[j]`` / ``acc_qk[j]`` (zeros past the diagonal); returns the diagonal block's bound excess."""
        RK = self.RK
        p = warp * SUB - 1
        bad = cute.make_rmem_tensor((1,), Float32)
        bad[0] = Float32(0.0)
        for j in cutlass.range_constexpr(self.C // SUB):
            for e in cutlass.range_constexpr(8):
                acc_kk[j][e] = Float32(0.0)
                acc_qk[j][e] = Float32(0.0)
            if j <= warp:
                if j == warp:
                    bad[0] = self._decay_cols(bufK - j * SUB * RK, sK, sG, j * SUB, p, lane, True)
                else:
                    self._decay_cols(bufK - j * SUB * RK, sK, sG, j * SUB, p, lane, False)
                cute.arch.sync_warp()
                self._mma_rows(acc_kk[j], acc_qk[j], frag, bufK, lane)
                cute.arch.sync_warp()
        return bad[0]

    @cute.jit
    def _diag_into(self, acc_kk, acc_qk, sE, sQ, sK, sG, sB, RG: cutlass.Constexpr, warp, lane):
        """The warp's diagonal block computed directly (:meth:`_diag_direct`) into ``acc_*[warp]``."""
        dkk = cute.make_rmem_tensor((8,), Float32)
        dqk = cute.make_rmem_tensor((8,), Float32)
        self._diag_direct(dkk, dqk, sE, sQ, sK, sG, sB, RG, warp * SUB, lane // 4, lane % 4)
        for j in cutlass.range_constexpr(self.C // SUB):
            if warp == j:
                for e in cutlass.range_constexpr(8):
                    acc_kk[j][e] = dkk[e]
                    acc_qk[j][e] = dqk[e]

    @cute.jit
    def _row_factors(self, mF, sG, sRq, blk, scale, ln, tidx):
        """F of the chunk (``scale``, 1, ``2^G_last``) -> global; ones into sRq (T's column scale for W / U)."""
        C, K = self.C, self.K
        RG = row_pitch_g(K)
        if tidx < C:
            ptx.st_shared_f32(sRq + tidx * 4, Float32(1.0))
            f_base = mF.iterator.toint() + blk * ((2 * C + K) * 4)
            ok = tidx < ln
            _st_f32(f_base + tidx * 4, cutlass.select_(ok, scale, Float32(0.0)))
            _st_f32(f_base + (C + tidx) * 4, cutlass.select_(ok, Float32(1.0), Float32(0.0)))
            for d0 in cutlass.range_constexpr(0, K, C):
                gl = ptx.ld_shared_f32(sG + (C - 1) * RG + (d0 + tidx) * 4)
                _st_f32(f_base + (2 * C + d0 + tidx) * 4, ptx.ex2(gl))

    @cute.jit
    def _store_a(self, mAqk, sA, acc_kk, acc_qk, blk, scale, warp, lane):
        """The warp's 16 rows: A (strictly lower, fp32) -> sA, Aqk (scaled, diagonal kept) -> global, io dtype."""
        C, RA, io = self.C, self.RA, self.io
        g = lane // 4
        t = lane % 4
        r0 = warp * SUB
        aqk_base = mAqk.iterator.toint() + blk * (C * C * 2)
        for j in cutlass.range_constexpr(C // SUB):
            for jj in cutlass.range_constexpr(2):
                s0 = j * SUB + jj * 8 + 2 * t
                for h in cutlass.range_constexpr(2):
                    r = r0 + g + 8 * h
                    for e2 in cutlass.range_constexpr(2):
                        val = acc_kk[j][4 * jj + 2 * h + e2]
                        ptx.st_shared_f32(sA + r * RA + (s0 + e2) * 4, cutlass.select_(s0 + e2 < r, val, Float32(0.0)))
                    v0 = cutlass.select_(s0 <= r, scale * acc_qk[j][4 * jj + 2 * h], Float32(0.0))
                    v1 = cutlass.select_(s0 + 1 <= r, scale * acc_qk[j][4 * jj + 2 * h + 1], Float32(0.0))
                    ptx.st_global_u32(aqk_base + (r * C + s0) * 2, ptx.pack2(v0, v1, io))

    @cute.jit
    def _w_u(self, mW, mU, sA, sOnes, sWop, sV, blk, warp, lane):
        """W = T (e 2^G), U = T x -> chunk-major scratch (T rounded to the io dtype), 64 columns at a time."""
        if const_expr(self.rolled >= 2):
            self._w_u_steps(mW, mU, sA, sOnes, sWop, sV, blk, warp, lane)
        else:
            self._w_u_unrolled(mW, mU, sA, sOnes, sWop, sV, blk, warp, lane)

    @cute.jit
    def _w_u_unrolled(self, mW, mU, sA, sOnes, sWop, sV, blk, warp, lane):
        C, K, V, RK, RV = self.C, self.K, self.V, self.RK, self.RV
        g = lane // 4
        t = lane % 4
        r0 = warp * SUB
        for nh in cutlass.range_constexpr(K // 64):
            accw = cute.make_rmem_tensor((32,), Float32)
            for i in cutlass.range_constexpr(32):
                accw[i] = Float32(0.0)
            self._gemm_t_nn(accw, sA, sOnes, sWop, RK, r0, nh * 64, warp, lane)
            self._store_slab(mW.iterator.toint() + blk * (C * K * 2), accw, K, nh * 64, r0, g, t)
        for nh in cutlass.range_constexpr(V // 64):
            accu = cute.make_rmem_tensor((32,), Float32)
            for i in cutlass.range_constexpr(32):
                accu[i] = Float32(0.0)
            self._gemm_t_nn(accu, sA, sOnes, sV, RV, r0, nh * 64, warp, lane)
            self._store_slab(mU.iterator.toint() + blk * (C * V * 2), accu, V, nh * 64, r0, g, t)

    @cute.jit
    def _restore_q_rows(self, mQ, dst, sRq, tok0, ln, qh, r0, lane):
        """One warp: rows ``r0 .. r0 + 16`` of q (head ``qh``) from global into ``dst`` (16 rows), times their
        normalisers in sRq and rounded as :meth:`_normalise_rows` left them (zero past ``ln``)."""
        K, RK, io = self.K, self.RK, self.io
        cpr = K // 8
        base = mQ.iterator.toint()
        for it in cutlass.range_constexpr((SUB * cpr) // 32):
            rr = it * (32 // cpr) + lane // cpr
            col = lane % cpr
            r = r0 + rr
            ok = r < ln
            tok = cutlass.select_(ok, tok0 + r, tok0)
            words = _ld_nc_v4_b32(base + (Int64(tok) * mQ.stride[0] + Int64(qh) * mQ.stride[1] + col * 8) * 2)
            rn = ptx.ld_shared_f32(sRq + r * 4)
            x = [v for wd in words for v in ptx.unpack2(wd, io)]
            if const_expr(self.l2norm):
                x = [x[e] * rn for e in range(8)]
            _st8(dst + rr * RK + col * 16, [cutlass.select_(ok, x[e], Float32(0.0)) for e in range(8)], io)

    @cute.jit
    def _load_gates(self, mG, sG, RG: cutlass.Constexpr, tok0, ln, ho, HO, flags, tidx):
        """cp.async the chunk's log gates ``[C, K]`` fp32 (contiguous ``[T, HO, K]``) into sG; 0 past ``ln`` and
        without g."""
        K = self.K
        cpr = K // 4
        base = mG.iterator.toint()
        has_g = (flags & FLAG_HAS_G) != 0
        for it in cutlass.range_constexpr((self.C * cpr) // PREP_THREADS):
            idx = it * PREP_THREADS + tidx
            r = idx // cpr
            col = idx % cpr
            ok = (r < ln) & has_g
            row = cutlass.select_(ok, Int64(tok0 + r) * HO + ho, Int64(0))
            ptx.cp_async_16(sG + r * RG + col * 16, base + (row * K + col * 4) * 4, cutlass.select_(ok, 16, 0))

    @cute.jit
    def _gate_rows(self, mBeta, src, dst, RB: cutlass.Constexpr, D: cutlass.Constexpr, off: cutlass.Constexpr, sB,
                   tok0, ln, ho, HO, flags, idx0, nthreads: cutlass.Constexpr):
        """``dst = gate * src`` over the chunk's ``[C, D]`` 16-bit rows (io dtype, fp32 math): KDA's beta a row
        (sB), or GDN-2's gates ``beta[t, ho, off .. off + D]`` of ``[T, HO, K + V]`` (erase: ``off = 0``,
        write: ``off = K``; 1 without beta)."""
        K, V, io = self.K, self.V, self.io
        has_b = (flags & FLAG_HAS_BETA) != 0
        base = mBeta.iterator.toint()
        cpr = D // 8
        for it in cutlass.range_constexpr((self.C * cpr) // nthreads):
            idx = it * nthreads + idx0
            r = idx // cpr
            col = idx % cpr
            x = _x8(src + r * RB + col * 16, io)
            if const_expr(self.erase_write):
                tok = cutlass.select_(r < ln, tok0 + r, tok0)
                addr = base + ((Int64(tok) * HO + ho) * (K + V) + off + col * 8) * 4
                bv = list(_ld_nc_v4_f32(addr)) + list(_ld_nc_v4_f32(addr + 16))
                for e in cutlass.range_constexpr(8):
                    bv[e] = cutlass.select_(has_b, bv[e], Float32(1.0))
                _st8(dst + r * RB + col * 16, [x[e] * bv[e] for e in range(8)], io)
            else:
                b = ptx.ld_shared_f32(sB + r * 4)
                _st8(dst + r * RB + col * 16, [x[e] * b for e in range(8)], io)

    def _e_pair(self, sE, sB, r, col):
        """``e_r`` at channels ``col, col + 1`` (fp32): from sE's rows, or (compact layout) ``beta_r k_r`` from
        the k rows at sE and the beta of sB, rounded to the io dtype as :meth:`_gate_rows` stores e."""
        if self.compact:
            k0, k1 = ptx.unpack2(ptx.ld_shared_b32(sE + r * self.RK + col * 2), self.io)
            b = ptx.ld_shared_f32(sB + r * 4)
            return ptx.unpack2(ptx.pack2(k0 * b, k1 * b, self.io), self.io)
        return ptx.unpack2(ptx.ld_shared_b32(sE + r * self.RK + col * 2), self.io)

    @cute.jit
    def _row_frags(self, frag, sE, sQ, sG, sB, RG: cutlass.Constexpr, r0, p, lane):
        """The row operands ``e_r 2^(G_r - G_p)`` (``frag[4 kk + q]``) and ``q_r 2^(G_r - G_p)``
        (``frag[4 K / 16 + 4 kk + q]``) of rows ``r0 .. r0 + 16`` as ``mma.m16n8k16`` A fragments (k-step
        ``kk``, register ``q``), rounded to the io dtype; ``G_p`` is row ``p`` of sG (the zero row for
        ``p = -1``), so every factor is ``<= 1``; e as :meth:`_e_pair` reads it."""
        RK, io = self.RK, self.io
        g = lane // 4
        t = lane % 4
        nq = 4 * (self.K // 16)
        gp_row = sG + p * RG
        for kk in cutlass.range_constexpr(self.K // 16):
            for q in cutlass.range_constexpr(4):
                r = r0 + g + 8 * (q % 2)
                col = kk * 16 + 8 * (q // 2) + 2 * t
                gr = ptx.ld_shared_v2_f32(sG + r * RG + col * 4)
                gp = ptx.ld_shared_v2_f32(gp_row + col * 4)
                f0 = ptx.ex2(gr[0] - gp[0])
                f1 = ptx.ex2(gr[1] - gp[1])
                e0, e1 = self._e_pair(sE, sB, r, col)
                q0, q1 = ptx.unpack2(ptx.ld_shared_b32(sQ + r * RK + col * 2), io)
                frag[4 * kk + q] = ptx.pack2(e0 * f0, e1 * f1, io)
                frag[nq + 4 * kk + q] = ptx.pack2(q0 * f0, q1 * f1, io)

    @cute.jit
    def _mma_rows(self, acc_kk, acc_qk, frag, bufK, lane):
        """acc_kk += E_rows bufK^T and acc_qk += Q_rows bufK^T over K (two n8 tiles: the buffer's 16 rows), the
        row operands the A fragments of :meth:`_row_frags`."""
        RK, io = self.RK, self.io
        m = lane // 8
        nq = 4 * (self.K // 16)
        for kk in cutlass.range_constexpr(self.K // 16):
            b = ptx.ldmatrix_x4(bufK + ((m // 2) * 8 + lane % 8) * RK + (kk * 16 + (m % 2) * 8) * 2)
            for jj in cutlass.range_constexpr(2):
                for which in cutlass.range_constexpr(2):
                    o = 0 if which == 0 else nq
                    acc = acc_kk if which == 0 else acc_qk
                    cc = ptx.mma_m16n8k16((frag[o + 4 * kk], frag[o + 4 * kk + 1], frag[o + 4 * kk + 2],
                                           frag[o + 4 * kk + 3]), (b[2 * jj], b[2 * jj + 1]),
                                          (acc[4 * jj], acc[4 * jj + 1], acc[4 * jj + 2], acc[4 * jj + 3]), io)
                    for e in cutlass.range_constexpr(4):
                        acc[4 * jj + e] = cc[e]

    @cute.jit
    def _decay_cols(self, dst, sK, sG, s0, p, lane, diag: cutlass.Constexpr):
        """One warp: rows ``s0 .. s0 + 16`` of sK times ``2^(G_p - G_s)`` into ``dst + s RK`` (``G_p``: row ``p`` of
        sG, the zero row for ``p = -1``).  With ``diag`` (the sub-chunk of row ``p + 1``, where the factor may
        exceed 1, clamped to ``2^limit``) returns how far this lane's elements exceed the factored path's bounds
        (``> 0``: recompute the block directly): the exponent past ``limit``, or an operand past the io dtype's
        range; without it returns 0 (``s <= p``: the factor is ``<= 1``)."""
        K, RK, io = self.K, self.RK, self.io
        RG = row_pitch_g(K)
        lim = Float32(self.diag_limit)
        cpr = K // 8
        col = lane % cpr  # the same 8 channels every step (32 % cpr == 0): G_p loaded once
        gp = _g8(sG + p * RG + col * 32)
        mx = Float32(-1.0e30)
        my = Float32(0.0)
        if const_expr(self.rolled):  # one copy of the step in a run-time loop: less code, the same values
            mm = cute.make_rmem_tensor((2,), Float32)
            mm[0] = mx
            mm[1] = my
            for it in cutlass.range((SUB * cpr) // 32, unroll=1):
                self._decay_cols_row(dst, sK, sG, gp, mm, s0 + it * (32 // cpr) + lane // cpr, col, lim, diag)
            mx = mm[0]
            my = mm[1]
        else:
            for it in cutlass.range_constexpr((SUB * cpr) // 32):
                s = s0 + it * (32 // cpr) + lane // cpr
                gs = _g8(sG + s * RG + col * 32)
                x = _x8(sK + s * RK + col * 16, io)
                xe = [gp[e] - gs[e] for e in range(8)]
                if const_expr(diag):
                    out = [x[e] * ptx.ex2(cutlass.min(xe[e], lim)) for e in range(8)]
                else:  # s <= p: G_s >= G_p (the gates are <= 0), the factor is <= 1
                    out = [x[e] * ptx.ex2(xe[e]) for e in range(8)]
                _st8(dst + s * RK + col * 16, out, io)
                if const_expr(diag):
                    mx = _fmax(mx, _tree(_fmax, xe))
                    my = _fmax(my, _tree(_fmax, [_abs_max(out[2 * e], out[2 * e + 1]) for e in range(4)]))
        bad = Float32(0.0)
        if const_expr(diag):
            bad = _fmax(mx - lim, my - Float32(self.io_max))
        return bad

    @cute.jit
    def _decay_cols_row(self, dst, sK, sG, gp, mm, s, col, lim, diag: cutlass.Constexpr):
        """One step of :meth:`_decay_cols`' run-time loop (``rolled``): row ``s`` of this lane's 8 channels;
        with ``diag`` the running maxima (exponent, operand magnitude) in ``mm``."""
        RK, io = self.RK, self.io
        RG = row_pitch_g(self.K)
        gs = _g8(sG + s * RG + col * 32)
        x = _x8(sK + s * RK + col * 16, io)
        xe = [gp[e] - gs[e] for e in range(8)]
        if const_expr(diag):
            out = [x[e] * ptx.ex2(cutlass.min(xe[e], lim)) for e in range(8)]
        else:
            out = [x[e] * ptx.ex2(xe[e]) for e in range(8)]
        _st8(dst + s * RK + col * 16, out, io)
        if const_expr(diag):
            mm[0] = _fmax(mm[0], _tree(_fmax, xe))
            mm[1] = _fmax(mm[1], _tree(_fmax, [_abs_max(out[2 * e], out[2 * e + 1]) for e in range(4)]))

    @cute.jit
    def _diag_direct(self, dkk, dqk, sE, sQ, sK, sG, sB, RG: cutlass.Constexpr, r0, g, t):
        """This thread's 8 entries (its C fragments of the two n8 tiles) of the warp's diagonal 16 x 16 block
        of ``e_r . k_s 2^(G_r - G_s)`` and ``q_r . k_s 2^(G_r - G_s)``, directly in fp32 (exponents clamped to
        ``<= 0``: the entries above the diagonal, masked later, stay finite); e as :meth:`_e_pair` reads it."""
        RK, io = self.RK, self.io
        for e in cutlass.range_constexpr(8):
            dkk[e] = Float32(0.0)
            dqk[e] = Float32(0.0)
        for d2 in cutlass.range(self.K // 2, unroll=1 if self.rolled >= 2 else 2):  # level 2: half the code
            d = d2 * 2
            gr, er, qr = [], [], []
            for h in cutlass.range_constexpr(2):
                r = r0 + g + 8 * h
                gr.append(ptx.ld_shared_v2_f32(sG + r * RG + d * 4))
                er.append(self._e_pair(sE, sB, r, d))
                qr.append(ptx.unpack2(ptx.ld_shared_b32(sQ + r * RK + d * 2), io))
            gs, ks = [], []
            for cc in cutlass.range_constexpr(4):
                s = r0 + 8 * (cc // 2) + 2 * t + cc % 2
                gs.append(ptx.ld_shared_v2_f32(sG + s * RG + d * 4))
                ks.append(ptx.unpack2(ptx.ld_shared_b32(sK + s * RK + d * 2), io))
            for jj in cutlass.range_constexpr(2):
                for h in cutlass.range_constexpr(2):
                    for e2 in cutlass.range_constexpr(2):
                        cc = 2 * jj + e2
                        i = 4 * jj + 2 * h + e2
                        for dd in cutlass.range_constexpr(2):
                            kf = ks[cc][dd] * ptx.ex2(cutlass.min(gr[h][dd] - gs[cc][dd], Float32(0.0)))
                            dkk[i] = dkk[i] + er[h][dd] * kf
                            dqk[i] = dqk[i] + qr[h][dd] * kf

    @cute.jit
    def _decay_out(self, mQg, mKd, sQ, sE, sK, sG, sB, RG: cutlass.Constexpr, tok0, ln, ho, HO, tidx,
                   qg: cutlass.Constexpr, kd: cutlass.Constexpr):
        """Every thread: with ``qg``, ``q 2^G``; with ``kd``, ``k 2^(G_last - G)`` (rows ``< ln``) -> rows
        ``tok0 ..`` of head ``ho`` of the token-major ``[T, HO, K]`` scratch, and ``e 2^G`` (e as
        :meth:`_e_pair` reads it) over sE in place (the W operand)."""
        K, C = self.K, self.C
        cpr = K // 8
        col = tidx % cpr  # the same 8 channels every step (PREP_THREADS % cpr == 0): G_last loaded once
        gl = _g8(sG + (C - 1) * RG + col * 32)
        if const_expr(self.rolled):  # one copy of the step in a run-time loop: less code, the same values
            for it in cutlass.range((C * cpr) // PREP_THREADS, unroll=1):
                self._decay_out_row(mQg, mKd, sQ, sE, sK, sG, sB, RG, gl, it * (PREP_THREADS // cpr) + tidx // cpr,
                                    col, tok0, ln, ho, HO, qg, kd)
        else:
            for it in cutlass.range_constexpr((C * cpr) // PREP_THREADS):
                self._decay_out_row(mQg, mKd, sQ, sE, sK, sG, sB, RG, gl, it * (PREP_THREADS // cpr) + tidx // cpr,
                                    col, tok0, ln, ho, HO, qg, kd)

    @cute.jit
    def _decay_out_row(self, mQg, mKd, sQ, sE, sK, sG, sB, RG: cutlass.Constexpr, gl, r, col, tok0, ln, ho, HO,
                       qg: cutlass.Constexpr, kd: cutlass.Constexpr):
        """One step of :meth:`_decay_out` (unrolled, or its run-time loop with ``rolled``): row ``r`` of this
        thread's 8 channels."""
        K, RK, io = self.K, self.RK, self.io
        gr = _g8(sG + r * RG + col * 32)
        f = [ptx.ex2(gr[e]) for e in range(8)]
        off = ((Int64(tok0 + r) * HO + ho) * K + col * 8) * 2
        if const_expr(qg):
            xq = _x8(sQ + r * RK + col * 16, io)
            wq = [ptx.pack2(xq[2 * i] * f[2 * i], xq[2 * i + 1] * f[2 * i + 1], io) for i in range(4)]
            if r < ln:
                ptx.st_global_v4_b32(mQg.iterator.toint() + off, wq[0], wq[1], wq[2], wq[3])
        if const_expr(kd):
            if const_expr(self.compact):
                x = [v for i in range(4) for v in self._e_pair(sE, sB, r, col * 8 + 2 * i)]
            else:
                x = _x8(sE + r * RK + col * 16, io)
            xk = _x8(sK + r * RK + col * 16, io)
            _st8(sE + r * RK + col * 16, [x[e] * f[e] for e in range(8)], io)
            wk = [ptx.pack2(xk[2 * i] * ptx.ex2(gl[2 * i] - gr[2 * i]),
                            xk[2 * i + 1] * ptx.ex2(gl[2 * i + 1] - gr[2 * i + 1]), io) for i in range(4)]
            if r < ln:
                ptx.st_global_v4_b32(mKd.iterator.toint() + off, wk[0], wk[1], wk[2], wk[3])
