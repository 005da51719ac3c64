"""Token-serial gated delta rule (GDN) kernel: the decode step, and prefill until the chunked kernels exist.

Plain SM80-class instructions (vector global loads, warp shuffles, fp32 FMA): runs on SM90 and SM100 alike.

Decomposition: one CTA per (V-slice of ``tile_v`` rows, output head, sequence); its ``num_warps`` warps own
``tile_v / num_warps`` rows each; in a warp, groups of ``lanes_per_row`` lanes own ``rows_per_lane`` rows, each
lane ``K / lanes_per_row`` consecutive columns of them.  The fp32 state slice ``H[tile_v, K]`` stays in registers across all the sequence's tokens; in memory the
state is V-major ``[*, HO, V, K]`` (FlashInfer, cuDNN) or, with ``state_k_major``, K-major ``[*, HO, K, V]``
(fla, FlashInfer's ``gated_delta_rule_decode``).
Tokens go in blocks of ``prefetch``: the next block's q / k / v / gates are loaded into registers while the
current block is computed.  Per token::

    pk = H k,  pq = H q,  kq = k . q          (partial sums per lane, then one butterfly over the lane group)
    hk = a pk;  u = b (v - hk)                 (a = alpha_t, b = beta_t)
    o  = scale (a pq + u kq)                   (= scale H_t q: the readout after the update)
    H  = a H + u k^T

With ``use_qk_l2norm`` the norms ``k . k`` and ``q . q`` ride in the same butterfly and the dot products are
rescaled afterwards (``x * rsqrt(sum x^2 + 1e-6)``, in fp32, not rounded to the input type).  A sequence of
length 0 writes its initial state (zeros without one) as its final state.  Each CTA reads its state slice
before it writes it and no two CTAs share a slice, so an in-place pool update (one tensor for the initial and
the final state, unique rows) is race-free.

The rest of the delta-rule family, selected by problem fields (each a separate compiled kernel):

* ``gate_per_channel`` (GDN-2, KDA): a decay ``a_j`` per key channel, folded into the operands
  (``H' x = H (a * x)`` for ``H' = H D(a)``), so each lane loads and exponentiates its ``K / lanes_per_row``
  gates;
* ``erase_write_gates`` (GDN-2): ``u = w * v - H' (b * k)`` with the erase gate ``b`` per key channel and the
  write gate ``w`` per value row (one ``[K + V]`` fp32 row a token and head);
* ``num_householder = n`` (Gated DeltaProduct): the CTA walks the expanded timeline of ``n`` sub-tokens a
  token, the gate applied on the first sub-token (1 elsewhere), q read at the token's row, the output written
  after the last sub-token.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from ..common.dtypes import element_type
from ..common import ptx
from ..common.constants import LOG2E
from ..compile.arch import compile_options
from ..planning.gdn import (
    FLAG_HAS_BETA, FLAG_HAS_G, FLAG_HAS_INITIAL_STATE, FLAG_INITIAL_INDICES, FLAG_OUTPUT_INDICES, FLAG_WRITE_STATE,
    GdnArgs, GdnProblem,
)
from ..compile.tiles import override_int_fields

NAME = "gdn_recurrent"
L2NORM_EPS = 1e-6

_inline = cute.arch.inline_ptx


@dataclass(frozen=True)
class Tiles:
    """What the recurrent kernel chooses.

    ``tile_v`` state rows per CTA, split over ``num_warps`` warps; in a warp, groups of ``lanes_per_row`` lanes
    share rows (a group's lanes split K, so a dot product is a butterfly over ``lanes_per_row`` lanes: fewer
    lanes, fewer shuffles, more columns a lane); ``prefetch`` tokens are loaded a block ahead (the next block's
    loads overlap the current block's math).
    """

    tile_v: int = 16
    num_warps: int = 4
    prefetch: int = 4
    lanes_per_row: int = 32

    def __post_init__(self):
        for name in ("tile_v", "num_warps", "prefetch", "lanes_per_row"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {v!r}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"num_warps must be 1, 2, 4 or 8, got {self.num_warps}")
        if self.lanes_per_row not in (4, 8, 16, 32):
            raise ValueError(f"lanes_per_row must be 4, 8, 16 or 32, got {self.lanes_per_row}")
        groups = 32 // self.lanes_per_row
        if self.tile_v % (self.num_warps * groups) or (self.tile_v // (self.num_warps * groups)) not in (1, 2, 4, 8):
            raise ValueError(f"tile_v / (num_warps * 32 / lanes_per_row) (rows a lane) must be 1, 2, 4 or 8, got "
                             f"{self.tile_v} / ({self.num_warps} * {groups})")
        if self.prefetch not in (1, 2, 4, 8):
            raise ValueError(f"prefetch must be 1, 2, 4 or 8, got {self.prefetch}")

    @property
    def rows_per_warp(self) -> int:
        return self.tile_v // self.num_warps

    @property
    def rows_per_lane(self) -> int:
        return self.rows_per_warp * self.lanes_per_row // 32


@dataclass(frozen=True)
class Config:
    """The recurrent kernel's compile key: ``Config(problem, tiles)``.

    Raises ValueError when ``tile_v`` does not divide ``head_dim_v`` or a lane would own other than 2, 4, 8 or
    16 columns (``head_dim_k / lanes_per_row``).
    """

    problem: GdnProblem
    tiles: Tiles

    def __post_init__(self):
        if self.problem.head_dim_v % self.tiles.tile_v:
            raise ValueError(f"tile_v {self.tiles.tile_v} must divide head_dim_v {self.problem.head_dim_v}")
        if self.problem.head_dim_k // self.tiles.lanes_per_row not in (2, 4, 8, 16):
            raise ValueError(f"head_dim_k / lanes_per_row = {self.problem.head_dim_k} / {self.tiles.lanes_per_row}"
                             " (columns a lane) must be 2, 4, 8 or 16")


def unsupported_reason(problem: GdnProblem) -> str | None:
    """Why this kernel cannot serve ``problem``, or None (it serves every valid :class:`GdnProblem`)."""
    if problem.head_dim_k % 64 or problem.head_dim_v % 16:
        return f"head dims {problem.head_dim_k}/{problem.head_dim_v}: the recurrent kernel serves K, V in 64, 128"
    return None


def default_tiles(problem: GdnProblem, *, num_sms: int, chains: int | None = None) -> Tiles:
    """The default tiles.

    16 rows a CTA over 4 warps (4 rows a warp): enough CTAs to fill the SMs from ``N * HO >= 2 * num_sms / 8``
    on (a token-serial chain is latency-bound, so more, smaller chains beat fewer, wider ones), 16 fp32 state
    registers a lane at K = 128.
    Prefill: 4 tokens prefetched (one load latency spread over 4 tokens of math) and 16 lanes a row (half
    the shuffles of 32: a warp's shuffles, not its FMAs, bound the token rate).
    Decode: 1 token prefetched and 32 lanes a row (a token or two a sequence: the fewest registers, hence the
    most CTAs an SM and the most state in flight).
    Per-channel gates (GDN-2, KDA) prefill: 2 tokens prefetched (a token carries K / 16 more gate words a lane,
    twice that with erase gates: 4 tokens would not fit the registers).
    """
    del num_sms, chains  # the choice does not depend on the GPU size or the chain count yet
    if problem.decode:
        return Tiles(tile_v=16, num_warps=4, prefetch=1, lanes_per_row=32)
    if problem.gate_per_channel:
        return Tiles(tile_v=16, num_warps=4, prefetch=2, lanes_per_row=16)
    return Tiles(tile_v=16, num_warps=4, prefetch=4, lanes_per_row=16)


# ------------------------------------------------------------------ PTX helpers of this kernel
TUNING_FIELDS = tuple(f.name for f in dataclasses.fields(Tiles))  # the keys override_tiles takes


def override_tiles(tiles: Tiles, items: dict[str, str]) -> Tiles:
    """``tiles`` with the fields named in ``items`` (field name -> decimal text) replaced; ValueError naming the key
    for an unknown field or a non-integer value, and the Tiles checks for a refused combination."""
    return override_int_fields(tiles, items)


def _ld_nc_b32(addr):
    return _inline("ld.global.nc.b32 {$w0}, [{$r0}];", write_only_types=[Int32], read_only_args=[Int64(addr)])


def _ld_nc_v2_b32(addr):
    return _inline("ld.global.nc.v2.b32 { {$w0}, {$w1} }, [{$r0}];", write_only_types=[Int32] * 2,
                   read_only_args=[Int64(addr)])


def _ld_nc_v4_b32(addr):
    return _inline("ld.global.nc.v4.b32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];", write_only_types=[Int32] * 4,
                   read_only_args=[Int64(addr)])


def _ld_nc_f32_vec(addr, n: int) -> list:
    """``n`` (1, 2, 4, 8, 16) consecutive fp32 values at ``addr``, ``4 n``-byte aligned (16 from 4 on)."""
    if n == 1:
        return [_inline("ld.global.nc.f32 {$w0}, [{$r0}];", write_only_types=[Float32],
                        read_only_args=[Int64(addr)])]
    if n == 2:
        return list(_inline("ld.global.nc.v2.f32 { {$w0}, {$w1} }, [{$r0}];", write_only_types=[Float32] * 2,
                            read_only_args=[Int64(addr)]))
    out = []
    for h in range(n // 4):
        out += list(_inline("ld.global.nc.v4.f32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
                            write_only_types=[Float32] * 4, read_only_args=[Int64(addr + 16 * h)]))
    return out


def _ld_nc_u16(addr):
    return _inline("{ .reg .b16 h; ld.global.nc.b16 h, [{$r0}]; cvt.u32.u16 {$w0}, h; }",
                   write_only_types=[Int32], read_only_args=[Int64(addr)])


def _ld_state_vec(addr, n: int, bf16: bool) -> list:
    """``n`` (1, 2, 4, 8, 16) consecutive state values (fp32, or bf16 widened) at ``addr``; a plain ``ld`` (not
    ``.nc``): an in-place pool update writes these rows later in the same launch."""
    if bf16:
        if n == 1:
            return [ptx.b16_to_f32(_inline("{ .reg .b16 h; ld.global.b16 h, [{$r0}]; cvt.u32.u16 {$w0}, h; }",
                                           write_only_types=[Int32], read_only_args=[Int64(addr)]),
                                   cutlass.BFloat16)]
        words = [_inline("ld.global.b32 {$w0}, [{$r0}];", write_only_types=[Int32], read_only_args=[Int64(addr)])]
        if n == 4:
            words = list(_inline("ld.global.v2.b32 { {$w0}, {$w1} }, [{$r0}];", write_only_types=[Int32] * 2,
                                 read_only_args=[Int64(addr)]))
        elif n >= 8:
            words = []
            for h in range(n // 8):
                words += list(_inline("ld.global.v4.b32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
                                      write_only_types=[Int32] * 4, read_only_args=[Int64(addr + 16 * h)]))
        out = []
        for w in words:
            out += list(ptx.unpack2(w, cutlass.BFloat16))
        return out
    if n == 1:
        return [_inline("ld.global.f32 {$w0}, [{$r0}];", write_only_types=[Float32], read_only_args=[Int64(addr)])]
    if n == 2:
        return list(_inline("ld.global.v2.f32 { {$w0}, {$w1} }, [{$r0}];", write_only_types=[Float32] * 2,
                            read_only_args=[Int64(addr)]))
    out = []
    for h in range(n // 4):
        out += list(_inline("ld.global.v4.f32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
                            write_only_types=[Float32] * 4, read_only_args=[Int64(addr + 16 * h)]))
    return out


def _st_state_vec(addr, vals: list, bf16: bool) -> None:
    """Store ``len(vals)`` (1, 2, 4, 8, 16) fp32 values as consecutive state values (fp32 or rounded to bf16)."""
    n = len(vals)
    if bf16:
        if n == 1:
            _st_u16(addr, ptx.f32_to_16(vals[0], cutlass.BFloat16))
            return
        words = [ptx.pack2(vals[2 * i], vals[2 * i + 1], cutlass.BFloat16) for i in range(n // 2)]
        if n == 2:
            _st_b32(addr, words[0])
        elif n == 4:
            _st_v2_b32(addr, words[0], words[1])
        else:
            for h in range(n // 8):
                ptx.st_global_v4_b32(addr + 16 * h, *words[4 * h:4 * h + 4])
        return
    if n == 1:
        _inline("st.global.f32 [{$r0}], {$r1};", read_only_args=[Int64(addr), Float32(vals[0])])
    elif n == 2:
        _inline("st.global.v2.f32 [{$r0}], { {$r1}, {$r2} };",
                read_only_args=[Int64(addr)] + [Float32(x) for x in vals])
    else:
        for h in range(n // 4):
            _inline("st.global.v4.f32 [{$r0}], { {$r1}, {$r2}, {$r3}, {$r4} };",
                    read_only_args=[Int64(addr + 16 * h)] + [Float32(x) for x in vals[4 * h:4 * h + 4]])


def _st_b32(addr, a):
    _inline("st.global.b32 [{$r0}], {$r1};", read_only_args=[Int64(addr), Int32(a)])


def _st_v2_b32(addr, a, b):
    _inline("st.global.v2.b32 [{$r0}], { {$r1}, {$r2} };", read_only_args=[Int64(addr), Int32(a), Int32(b)])


def _st_u16(addr, a):
    _inline("{ .reg .b16 h; cvt.u16.u32 h, {$r1}; st.global.b16 [{$r0}], h; }",
            read_only_args=[Int64(addr), Int32(a)])


def _rsqrt(x):
    return _inline("rsqrt.approx.ftz.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[Float32(x)])


class GdnRecurrentKernel:
    """CuTe DSL token-serial GDN; see the module docstring.  Build with :func:`compile`."""

    def __init__(self, cfg: Config):
        p, t = cfg.problem, cfg.tiles
        self.cfg = cfg
        self.io = element_type(p.dtype)
        self.bf16_state = p.state_dtype == "bfloat16"
        self.k_major = p.state_k_major
        self.K, self.V = p.head_dim_k, p.head_dim_v
        self.L = t.lanes_per_row
        self.KL = p.head_dim_k // t.lanes_per_row  # columns a lane owns
        self.NW = t.num_warps
        self.TV = t.tile_v
        self.RW = t.rows_per_warp
        self.R = t.rows_per_lane  # rows a lane (its group) owns
        self.P = t.prefetch
        self.chan = p.gate_per_channel
        self.erase = p.erase_write_gates
        self.NH = p.num_householder
        self.NA = self.KL if self.chan else 1  # words of the gate: one a column, or the scalar alpha
        self.NB = self.KL + self.R if self.erase else 1  # erase gate columns + write gate rows, or the scalar beta
        # fp32 words of one token: q, k columns, v rows, the gate, beta
        self.W = 2 * self.KL + self.R + self.NA + self.NB
        self.NVT = p.head_dim_v // t.tile_v
        self.log_gate = p.gate_domain == "log"
        self.l2norm = p.use_qk_l2norm

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
                 mCu: cute.Tensor, mH0: cute.Tensor, mH0Idx: cute.Tensor, mHt: cute.Tensor, mHtIdx: cute.Tensor,
                 mO: cute.Tensor, scale: Float32, q_group: Int32, k_group: Int32, v_group: Int32, flags: Int32,
                 stream):
        self.kernel(mQ, mK, mV, mG, mBeta, mCu, mH0, mH0Idx, mHt, mHtIdx, mO, scale, q_group, k_group, v_group,
                    flags).launch(
            # V-slices of one head fastest: the CTAs reading the same q / k rows run side by side
            grid=(self.NVT * mO.shape[1], mCu.shape[0] - 1, 1),
            block=(32 * self.NW, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mQ, mK, mV, mG, mBeta, mCu, mH0, mH0Idx, mHt, mHtIdx, mO, scale: Float32, q_group: Int32,
               k_group: Int32, v_group: Int32, flags: Int32):
        """Device entry: one CTA per (V-slice, output head, sequence)."""
        K, V, KL, R = self.K, self.V, self.KL, self.R
        tidx, _, _ = cute.arch.thread_idx()
        bx, n, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        grp = lane // self.L  # the lane group sharing rows
        sub = lane % self.L
        vt = bx % self.NVT
        oh = bx // self.NVT
        ho = mO.shape[1]
        v0 = vt * self.TV + warp * self.RW + grp * R  # this lane group's first state row
        k0 = sub * KL  # this lane's first column
        bos = mCu[n]
        eos = mCu[n + 1]
        if const_expr(self.NH > 1):  # the expanded timeline: n sub-tokens a token
            bos = bos * self.NH
            eos = eos * self.NH
        qh = oh // q_group
        kh = oh // k_group
        vh = oh // v_group

        # state slice -> registers
        st = cute.make_rmem_tensor((R * KL,), Float32)
        for i in cutlass.range_constexpr(R * KL):
            st[i] = Float32(0.0)
        if (flags & FLAG_HAS_INITIAL_STATE) != 0:
            row = n
            if (flags & FLAG_INITIAL_INDICES) != 0:
                row = mH0Idx[n]
            self._load_state(mH0, st, Int64(row) * ho + oh, v0, k0)

        q_base = mQ.iterator.toint()
        k_base = mK.iterator.toint()
        v_base = mV.iterator.toint()
        o_base = mO.iterator.toint()

        P, W = self.P, self.W
        cur = cute.make_rmem_tensor((P * W,), Float32)  # the block of P tokens being computed
        nxt = cute.make_rmem_tensor((P * W,), Float32)  # the next block, in flight
        last = cutlass.max(eos - 1, 0)  # loads past the sequence's end re-read a valid row (ignored)
        for p in cutlass.range_constexpr(P):
            self._load_token(mQ, mK, mV, mG, mBeta, q_base, k_base, v_base, cur, p * W,
                             cutlass.min(bos + p, last), qh, kh, vh, oh, v0, k0, flags)
        red = cute.make_rmem_tensor((2 * R + 3,), Float32)
        n_blk = (eos - bos + P - 1) // P
        for blk in cutlass.range(n_blk, unroll=1):
            t0 = bos + blk * P
            for p in cutlass.range_constexpr(P):
                self._load_token(mQ, mK, mV, mG, mBeta, q_base, k_base, v_base, nxt, p * W,
                                 cutlass.min(t0 + P + p, last), qh, kh, vh, oh, v0, k0, flags)
            for p in cutlass.range_constexpr(P):
                if t0 + p < eos:
                    if const_expr(self.chan):
                        self._step_channel(st, cur, p * W, red, scale)
                    else:
                        self._step(st, cur, p * W, red, scale)
                    if const_expr(self.NH > 1):  # the readout follows the token's last update
                        if (t0 + p) % self.NH == self.NH - 1:
                            self._store_out(o_base, red, (t0 + p) // self.NH, ho, oh, v0, sub)
                    else:
                        self._store_out(o_base, red, t0 + p, ho, oh, v0, sub)
            for i in cutlass.range_constexpr(P * W):
                cur[i] = nxt[i]

        if (flags & FLAG_WRITE_STATE) != 0:
            row = n
            if (flags & FLAG_OUTPUT_INDICES) != 0:
                row = mHtIdx[n]
            self._store_state(mHt, st, Int64(row) * ho + oh, v0, k0)

    # ------------------------------------------------------------------ pieces
    @cute.jit
    def _load_state(self, mH, st, mat, v0, k0):
        """Matrix ``mat`` (= row * HO + head) of ``[*, HO, V, K]`` (or K-major ``[*, HO, K, V]``): this lane's
        R rows x KL columns -> ``st`` (fp32)."""
        K, V, KL, R = self.K, self.V, self.KL, self.R
        h_base = mH.iterator.toint()
        esize = 2 if self.bf16_state else 4
        if const_expr(self.k_major):
            for j in cutlass.range_constexpr(KL):  # column k0 + j: R consecutive v
                vals = _ld_state_vec(h_base + ((mat * K + k0 + j) * V + v0) * esize, R, self.bf16_state)
                for r in cutlass.range_constexpr(R):
                    st[r * KL + j] = vals[r]
        else:
            for r in cutlass.range_constexpr(R):  # row v0 + r: KL consecutive k
                vals = _ld_state_vec(h_base + ((mat * V + v0 + r) * K + k0) * esize, KL, self.bf16_state)
                for j in cutlass.range_constexpr(KL):
                    st[r * KL + j] = vals[j]

    @cute.jit
    def _store_state(self, mH, st, mat, v0, k0):
        K, V, KL, R = self.K, self.V, self.KL, self.R
        h_base = mH.iterator.toint()
        esize = 2 if self.bf16_state else 4
        if const_expr(self.k_major):
            for j in cutlass.range_constexpr(KL):
                _st_state_vec(h_base + ((mat * K + k0 + j) * V + v0) * esize,
                              [st[r * KL + j] for r in range(R)], self.bf16_state)
        else:
            for r in cutlass.range_constexpr(R):
                _st_state_vec(h_base + ((mat * V + v0 + r) * K + k0) * esize,
                              [st[r * KL + j] for j in range(KL)], self.bf16_state)

    @cute.jit
    def _load_vec16(self, addr, dst, at: cutlass.Constexpr, n: cutlass.Constexpr):
        """``n`` (1, 2, 4, 8 or 16) consecutive 16-bit values at ``addr`` -> fp32 ``dst[at .. at + n]``."""
        io = self.io
        if const_expr(n == 1):
            dst[at] = ptx.b16_to_f32(_ld_nc_u16(addr), io)
        elif const_expr(n == 2):
            lo, hi = ptx.unpack2(_ld_nc_b32(addr), io)
            dst[at] = lo
            dst[at + 1] = hi
        elif const_expr(n == 4):
            w = _ld_nc_v2_b32(addr)
            for j in cutlass.range_constexpr(2):
                lo, hi = ptx.unpack2(w[j], io)
                dst[at + 2 * j] = lo
                dst[at + 2 * j + 1] = hi
        else:
            for h in cutlass.range_constexpr(n // 8):
                w = _ld_nc_v4_b32(addr + 16 * h)
                for j in cutlass.range_constexpr(4):
                    lo, hi = ptx.unpack2(w[j], io)
                    dst[at + 8 * h + 2 * j] = lo
                    dst[at + 8 * h + 2 * j + 1] = hi

    @cute.jit
    def _load_token(self, mQ, mK, mV, mG, mBeta, q_base, k_base, v_base, dst, at: cutlass.Constexpr, t, qh, kh, vh,
                    oh, v0, k0, flags):
        """Token ``t``'s q / k columns of this lane, v rows of this warp, alpha, beta -> ``dst[at:at + W]``."""
        if const_expr(self.chan or self.erase or self.NH > 1):
            self._load_token_family(mQ, mK, mV, mG, mBeta, q_base, k_base, v_base, dst, at, t, qh, kh, vh, oh, v0,
                                    k0, flags)
        else:
            self._load_token_gdn(mQ, mK, mV, mG, mBeta, q_base, k_base, v_base, dst, at, t, qh, kh, vh, oh, v0,
                                 k0, flags)

    @cute.jit
    def _load_token_gdn(self, mQ, mK, mV, mG, mBeta, q_base, k_base, v_base, dst, at: cutlass.Constexpr, t, qh, kh,
                        vh, oh, v0, k0, flags):
        KL, R = self.KL, self.R
        q_off = Int64(t) * mQ.stride[0] + Int64(qh) * mQ.stride[1] + k0
        k_off = Int64(t) * mK.stride[0] + Int64(kh) * mK.stride[1] + k0
        v_off = Int64(t) * mV.stride[0] + Int64(vh) * mV.stride[1] + v0
        self._load_vec16(q_base + q_off * 2, dst, at, KL)
        self._load_vec16(k_base + k_off * 2, dst, at + KL, KL)
        self._load_vec16(v_base + v_off * 2, dst, at + 2 * KL, R)
        a = Float32(1.0)
        if (flags & FLAG_HAS_G) != 0:
            a = mG[t, oh]
            if const_expr(self.log_gate):
                a = ptx.ex2(a * Float32(LOG2E))
        b = Float32(1.0)
        if (flags & FLAG_HAS_BETA) != 0:
            b = mBeta[t, oh]
        dst[at + 2 * KL + R] = a
        dst[at + 2 * KL + R + 1] = b

    @cute.jit
    def _load_token_family(self, mQ, mK, mV, mG, mBeta, q_base, k_base, v_base, dst, at: cutlass.Constexpr, t, qh,
                           kh, vh, oh, v0, k0, flags):
        """:meth:`_load_token_gdn` for the other variants: per-channel gates, erase / write gates, sub-tokens."""
        KL, R, K = self.KL, self.R, self.K
        tq = t  # the real token: q and the gate are read at its row
        if const_expr(self.NH > 1):
            tq = t // self.NH
        q_off = Int64(tq) * mQ.stride[0] + Int64(qh) * mQ.stride[1] + k0
        k_off = Int64(t) * mK.stride[0] + Int64(kh) * mK.stride[1] + k0
        v_off = Int64(t) * mV.stride[0] + Int64(vh) * mV.stride[1] + v0
        self._load_vec16(q_base + q_off * 2, dst, at, KL)
        self._load_vec16(k_base + k_off * 2, dst, at + KL, KL)
        self._load_vec16(v_base + v_off * 2, dst, at + 2 * KL, R)
        ga = at + 2 * KL + R
        gb = ga + self.NA
        if const_expr(self.chan):
            if (flags & FLAG_HAS_G) != 0:
                g_addr = mG.iterator.toint() + ((Int64(tq) * mG.shape[1] + oh) * K + k0) * 4
                vals = _ld_nc_f32_vec(g_addr, KL)
                for j in cutlass.range_constexpr(KL):
                    x = vals[j]
                    if const_expr(self.log_gate):
                        x = ptx.ex2(x * Float32(LOG2E))
                    dst[ga + j] = x
            else:
                for j in cutlass.range_constexpr(KL):
                    dst[ga + j] = Float32(1.0)
        else:
            a = Float32(1.0)
            if (flags & FLAG_HAS_G) != 0:
                if t % self.NH == 0:  # the decay acts before the token's first update only
                    a = mG[tq, oh]
                    if const_expr(self.log_gate):
                        a = ptx.ex2(a * Float32(LOG2E))
            dst[ga] = a
        if const_expr(self.erase):
            if (flags & FLAG_HAS_BETA) != 0:
                row = mBeta.iterator.toint() + (Int64(t) * mBeta.shape[1] + oh) * (K + self.V) * 4
                bvals = _ld_nc_f32_vec(row + k0 * 4, KL)
                wvals = _ld_nc_f32_vec(row + (K + v0) * 4, R)
                for j in cutlass.range_constexpr(KL):
                    dst[gb + j] = bvals[j]
                for r in cutlass.range_constexpr(R):
                    dst[gb + KL + r] = wvals[r]
            else:
                for j in cutlass.range_constexpr(KL + R):
                    dst[gb + j] = Float32(1.0)
        else:
            b = Float32(1.0)
            if (flags & FLAG_HAS_BETA) != 0:
                b = mBeta[t, oh]
            dst[gb] = b

    @cute.jit
    def _step(self, st, cur, at: cutlass.Constexpr, red, scale):
        """One token: the dot products, one butterfly, the update; leaves ``o`` of the R rows in ``red[0:R]``."""
        KL, R = self.KL, self.R
        a = cur[at + 2 * KL + R]
        b = cur[at + 2 * KL + R + 1]
        rk, rq, kq_n = self._reduce(st, cur, at, red, scale, [cur[at + KL + j] for j in range(KL)],
                                    [cur[at + j] for j in range(KL)])
        ak = a * rk
        for r in cutlass.range_constexpr(R):
            u = b * (cur[at + 2 * KL + r] - ak * red[r])  # beta (v - alpha H k)
            red[r] = rq * (a * red[R + r] + u * kq_n)  # scale H_t q
            uk = u * rk
            for j in cutlass.range_constexpr(KL):
                st[r * KL + j] = a * st[r * KL + j] + uk * cur[at + KL + j]

    @cute.jit
    def _reduce(self, st, cur, at: cutlass.Constexpr, red, scale, xk, xq):
        """The token's reductions, summed over the group's lanes by one butterfly: ``red[r] = H x_k`` and
        ``red[R + r] = H x_q`` of the R rows (``xk`` / ``xq``: the lane's KL channels the state multiplies), then
        k.q, and (with l2norm) |k|^2 and |q|^2.  Returns ``(rk, rq, kq_n)``: k's normaliser, q's times ``scale``,
        and the normalised k.q."""
        KL, R = self.KL, self.R
        for r in cutlass.range_constexpr(R):
            pk = Float32(0.0)
            pq = Float32(0.0)
            for j in cutlass.range_constexpr(KL):
                pk = pk + st[r * KL + j] * xk[j]
                pq = pq + st[r * KL + j] * xq[j]
            red[r] = pk
            red[R + r] = pq
        kq = Float32(0.0)
        kk = Float32(0.0)
        qq = Float32(0.0)
        for j in cutlass.range_constexpr(KL):
            kq = kq + cur[at + j] * cur[at + KL + j]
            kk = kk + cur[at + KL + j] * cur[at + KL + j]
            qq = qq + cur[at + j] * cur[at + j]
        red[2 * R] = kq
        red[2 * R + 1] = kk
        red[2 * R + 2] = qq
        n_red = 2 * R + 3 if self.l2norm else 2 * R + 1
        for s in cutlass.range_constexpr(self.L.bit_length() - 1):  # xor within the aligned group of L lanes
            for i in cutlass.range_constexpr(n_red):
                red[i] = red[i] + cute.arch.shuffle_sync_bfly(red[i], offset=(self.L // 2) >> s)
        rk = Float32(1.0)
        rq = scale
        if const_expr(self.l2norm):
            rk = _rsqrt(red[2 * R + 1] + Float32(L2NORM_EPS))
            rq = scale * _rsqrt(red[2 * R + 2] + Float32(L2NORM_EPS))
        return rk, rq, red[2 * R] * rk

    @cute.jit
    def _step_channel(self, st, cur, at: cutlass.Constexpr, red, scale):
        """:meth:`_step` with a decay per key channel (and erase / write gates): ``H' = H D(a)``, so
        ``H' x = H (a * x)`` and the update is ``H = H' + u k^T``; leaves ``o`` in ``red[0:R]``."""
        KL, R = self.KL, self.R
        ga = at + 2 * KL + R
        gb = ga + self.NA
        aq = [cur[ga + j] * cur[at + j] for j in range(KL)]
        ak = [cur[ga + j] * cur[at + KL + j] for j in range(KL)]
        if const_expr(self.erase):
            ak = [ak[j] * cur[gb + j] for j in range(KL)]  # H' (b * k)
        rk, rq, kq_n = self._reduce(st, cur, at, red, scale, ak, aq)
        for r in cutlass.range_constexpr(R):
            if const_expr(self.erase):
                u = cur[gb + KL + r] * cur[at + 2 * KL + r] - rk * red[r]  # w v - H' (b * k)
            else:
                u = cur[gb] * (cur[at + 2 * KL + r] - rk * red[r])  # beta (v - H' k)
            red[r] = rq * (red[R + r] + u * kq_n)  # scale H_t q
            uk = u * rk
            for j in cutlass.range_constexpr(KL):
                st[r * KL + j] = cur[ga + j] * st[r * KL + j] + uk * cur[at + KL + j]

    @cute.jit
    def _store_out(self, o_base, red, t, ho, oh, v0, sub):
        """The group's first lane writes its R output values of token ``t`` (one vector store)."""
        R, io = self.R, self.io
        if sub == 0:
            addr = o_base + ((Int64(t) * ho + oh) * self.V + v0) * 2
            if const_expr(R == 1):
                _st_u16(addr, ptx.f32_to_16(red[0], io))
            elif const_expr(R == 2):
                _st_b32(addr, ptx.pack2(red[0], red[1], io))
            elif const_expr(R == 4):
                _st_v2_b32(addr, ptx.pack2(red[0], red[1], io), ptx.pack2(red[2], red[3], io))
            else:
                ptx.st_global_v4_b32(addr, ptx.pack2(red[0], red[1], io), ptx.pack2(red[2], red[3], io),
                                     ptx.pack2(red[4], red[5], io), ptx.pack2(red[6], red[7], io))


def _fake_args(cfg: Config) -> tuple:
    """Fake tensors (symbolic sizes) in :class:`GdnArgs` order."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

    p = cfg.problem
    io = element_type(p.dtype)
    sdt = cutlass.BFloat16 if p.state_dtype == "bfloat16" else Float32

    def sym():
        return cute.sym_int()

    def s64(div=8):
        return cute.sym_int64(divisibility=div)

    T, Hq, Hk, Hv, HO = (sym() for _ in range(5))
    Tk = sym() if p.num_householder > 1 else T  # k / v on the expanded timeline
    q = make_fake_tensor(io, (T, Hq, p.head_dim_k), (s64(), s64(), 1), assumed_align=16)
    k = make_fake_tensor(io, (Tk, Hk, p.head_dim_k), (s64(), s64(), 1), assumed_align=16)
    v = make_fake_tensor(io, (Tk, Hv, p.head_dim_v), (s64(), s64(), 1), assumed_align=16)
    if p.gate_per_channel:
        g = make_fake_compact_tensor(Float32, (sym(), sym(), p.head_dim_k), stride_order=(2, 1, 0), assumed_align=16)
    else:
        g = make_fake_tensor(Float32, (sym(), sym()), (s64(1), 1), assumed_align=4)
    if p.erase_write_gates:
        beta = make_fake_compact_tensor(Float32, (sym(), sym(), p.head_dim_k + p.head_dim_v), stride_order=(2, 1, 0),
                                        assumed_align=16)
    else:
        beta = make_fake_tensor(Float32, (sym(), sym()), (s64(1), 1), assumed_align=4)
    cu = make_fake_compact_tensor(Int32, (sym(),), assumed_align=4)
    mat = (p.head_dim_k, p.head_dim_v) if p.state_k_major else (p.head_dim_v, p.head_dim_k)
    h0 = make_fake_compact_tensor(sdt, (sym(), sym()) + mat, stride_order=(3, 2, 1, 0), assumed_align=16)
    h0_idx = make_fake_compact_tensor(Int32, (sym(),), assumed_align=4)
    ht = make_fake_compact_tensor(sdt, (sym(), sym()) + mat, stride_order=(3, 2, 1, 0), assumed_align=16)
    ht_idx = make_fake_compact_tensor(Int32, (sym(),), assumed_align=4)
    o = make_fake_compact_tensor(io, (sym(), HO, p.head_dim_v), stride_order=(2, 1, 0), assumed_align=16)
    return q, k, v, g, beta, cu, h0, h0_idx, ht, ht_idx, o


def compile(cfg: Config, *, keep_ptx_dir: str | None = None, keep_cubin: bool = False):
    """Compile :class:`GdnRecurrentKernel` for ``cfg`` from fake tensors (no GPU needed).

    Returns the tvm-ffi callable; call it through :func:`launch`.  Every size, stride (but the unit last one)
    and flag is dynamic; the problem's dtypes, head dims, gate domain and l2norm flag and the tiles are static.
    """
    from cutlass.cute.runtime import make_fake_stream

    opts = compile_options(cfg.problem.arch, keep_ptx_dir=keep_ptx_dir, keep_cubin=keep_cubin)
    return cute.compile(GdnRecurrentKernel(cfg), *_fake_args(cfg), Float32(1.0), Int32(1), Int32(1), Int32(1),
                        Int32(0), make_fake_stream(use_tvm_ffi_env_stream=True), options=opts)


def launch(fn, cfg: Config, args: GdnArgs) -> None:
    """Launch the compiled ``fn`` on torch's current stream (``cfg`` is unused: one signature for all)."""
    del cfg
    fn(args.q, args.k, args.v, args.g, args.beta, args.cu_seqlens, args.initial_state, args.initial_state_indices,
       args.output_state, args.output_state_indices, args.output, args.scale, args.q_group, args.k_group,
       args.v_group, args.flags)
