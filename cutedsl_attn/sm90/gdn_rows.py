"""The row mapping of the SM90 chunked GDN kernel on an expanded timeline (``Config.expand_rows`` of
:mod:`cutedsl_attn.sm90.gdn_chunked`): Gated DeltaProduct with ``n`` updates a token runs as GDN over ``T n``
rows without building expanded copies of q, g and the output.

k / v / beta and the sequences (``cu_seqlens``, ``n`` times the tokens' offsets) are on the expanded timeline;
q ``[T, Hq, K]``, g ``[T, HO]`` and the output ``[T, HO, V]`` are on the tokens' one.  Expanded row ``r``
(absolute, as the chunk plan gives it) belongs to token ``r // n``:

* q row ``r`` is ``q[r // n]`` when ``r % n == n - 1`` (the readout follows the token's last update), else zeros
  (``cp.async`` zero-fill; the l2 norm keeps a zero row zero);
* g row ``r`` is ``g[r // n]`` when ``r % n == 0`` (the decay acts before the token's first update), else the
  identity (1 linear, 0 log), converted exactly as an expanded copy's identity entry would be;
* output row ``r`` is stored to ``out[r // n]`` when ``r % n == n - 1``; the other rows are not stored.

The prep and the main kernel then compute what they compute on expanded copies, bit for bit.

:class:`GdnSm90Rows` is a mixin of the SM90 prep (:class:`~cutedsl_attn.sm90.gdn_prep.GdnPrepSm90`) and hence of
the chunked kernel classes: each helper keeps today's code for ``expand_rows == 1`` (the attribute's default, so
the fused and per-channel kernels are unchanged) and maps rows otherwise.  It reads the kernel's ``C`` / ``K`` /
``V`` / ``io`` / ``log_gate`` attributes.  :func:`compile_expanded`, :func:`launch_expanded` and :func:`launch`
(the kernel module's, either timeline) are the host side: q's row count free of k's, the chunk plan over k's
``T n`` rows.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32, const_expr

from ..common import ptx
from ..common.constants import LOG2E
from ..common.dtypes import element_type
from ..common.gdn_launch import launch as _launch_tokens
from ..common.gdn_prep import LINEAR_GATE_FLOOR, PREP_THREADS
from ..common.smem import sw128_offset
from ..compile.arch import compile_options
from ..compile.fake import gdn_chunked_tensors
from ..planning.gdn import CHUNK, FLAG_HAS_BETA, FLAG_HAS_G, GdnArgs, chunked_launch_tensors

_inline = cute.arch.inline_ptx


def _st_b16(addr, v):
    _inline("{ .reg .b16 h; cvt.u16.u32 h, {$r1}; st.global.b16 [{$r0}], h; }", read_only_args=[Int64(addr), Int32(v)])


def _token_of(r, n: int):
    """``(r // n, r % n)`` of an expanded row ``r >= 0`` (unsigned: a shift and a mask for n = 2, 4, 8)."""
    tok = Int32(Uint32(r) // Uint32(n))
    return tok, r - tok * n


class GdnSm90Rows:
    """The expanded-timeline row mapping of the SM90 chunked GDN prep and main kernel; see the module docstring."""

    #: rows of the expanded timeline a token (1: the tokens' timeline itself)
    expand_rows = 1

    # ------------------------------------------------------------------ prep
    @cute.jit
    def _p90_load_q(self, mQ, s_dst, tok0, ln, head, tidx):
        """The prep's q tile: expanded rows ``tok0 .. tok0 + C`` of head ``head`` into a swizzled (C, K) tile,
        zero past ``ln`` and on the rows that are not a token's readout."""
        if const_expr(self.expand_rows == 1):
            self._p90_load_rows(mQ, s_dst, self.K, tok0, ln, head, tidx)
        else:
            cpr = self.K // 8
            for it in cutlass.range_constexpr((self.C * cpr) // PREP_THREADS):
                self._q_row_copy(mQ, s_dst, it * PREP_THREADS + tidx, tok0, ln, head)

    @cute.jit
    def _p90_gates(self, mG, mBeta, sG, sB, tok0, ln, ho, flags, tidx):
        """The prep's gate rows (:meth:`GdnPrep._gates_to_smem`'s contract): beta of expanded row ``tok0 + i``,
        the gate of its token on a token's first row and the identity on the others."""
        if const_expr(self.expand_rows == 1):
            self._gates_to_smem(mG, mBeta, sG, sB, tok0, ln, ho, flags, tidx)
        else:
            n = self.expand_rows
            if tidx < self.C:
                lg = Float32(0.0)
                b = Float32(0.0)
                if tidx < ln:
                    b = Float32(1.0)
                    if (flags & FLAG_HAS_BETA) != 0:
                        b = mBeta[tok0 + tidx, ho]
                    if (flags & FLAG_HAS_G) != 0:
                        tok, sub = _token_of(tok0 + tidx, n)
                        # the identity goes through the conversion an expanded copy's entry would (bit-equal)
                        x = Float32(0.0 if self.log_gate else 1.0)
                        if sub == 0:
                            x = mG[tok, ho]
                        if const_expr(self.log_gate):
                            lg = x * Float32(LOG2E)
                        else:
                            lg = ptx.lg2(cutlass.max(x, Float32(LINEAR_GATE_FLOOR)))
                ptx.st_shared_f32(sG + tidx * 4, lg)
                ptx.st_shared_f32(sB + tidx * 4, b)

    # ------------------------------------------------------------------ main kernel
    @cute.jit
    def _load_q_rows(self, mQ, s_dst, t0, ln, head, tid):
        """The main kernel's q tile of a chunk (producer warpgroup, 128 threads): as :meth:`_p90_load_q`."""
        if const_expr(self.expand_rows == 1):
            self._load_qk_rows(mQ, s_dst, t0, ln, head, tid)
        else:
            cpr = self.K // 8
            for it in cutlass.range((self.C * cpr) // 128, unroll=2):
                self._q_row_copy(mQ, s_dst, it * 128 + tid, t0, ln, head)

    @cute.jit
    def _q_row_copy(self, mQ, s_dst, idx, t0, ln, head):
        """One 16-byte piece ``idx`` (row ``idx // (K / 8)``) of a q tile on the expanded timeline: token
        ``(t0 + row) // n``'s q on a readout row inside the chunk, zero-filled otherwise (the source address stays
        in bounds: token ``t0 // n``)."""
        n = self.expand_rows
        cpr = self.K // 8
        r = idx // cpr
        col = idx % cpr
        tok, sub = _token_of(t0 + r, n)
        ok = (r < ln) & (sub == n - 1)
        tok = cutlass.select_(ok, tok, _token_of(t0, n)[0])
        goff = Int64(tok) * mQ.stride[0] + Int64(head) * mQ.stride[1] + col * 8
        ptx.cp_async_16(s_dst + sw128_offset(r, col, CHUNK), mQ.iterator.toint() + goff * 2,
                        cutlass.select_(ok, 16, 0))

    @cute.jit
    def _store_o_rows(self, fO, o_base, o_tok, HO, t0, ln, ho, vw, warp, g, t):
        """Consumer warpgroup: the chunk's O^T accumulator (rows ``t0 + s``, ``s < ln``) -> the output, the
        thread's two state rows of each of its token columns; on an expanded timeline only a token's readout row,
        to the token's row.  ``o_base`` the output's address, ``o_tok`` its bytes a row."""
        C, V, io = self.C, self.V, self.io
        if const_expr(self.expand_rows == 1):
            o_row = o_base + ((Int64(t0 + 2 * t) * HO + ho) * V + vw + warp * 16 + g) * 2
            for jj in cutlass.range_constexpr(C // 8):
                for e in cutlass.range_constexpr(2):
                    if jj * 8 + 2 * t + e < ln:
                        addr = o_row + (jj * 8 + e) * o_tok
                        for h in cutlass.range_constexpr(2):
                            _st_b16(addr + 16 * h, ptx.f32_to_16(fO[4 * jj + 2 * h + e], io))
        else:
            n = self.expand_rows
            o_col = o_base + (Int64(ho) * V + vw + warp * 16 + g) * 2
            for jj in cutlass.range_constexpr(C // 8):
                for e in cutlass.range_constexpr(2):
                    # n = 2: t0 = 2 cu + C j is even, so the readout rows are the odd columns (e = 1) only
                    if const_expr(n != 2 or e == 1):
                        s = jj * 8 + 2 * t + e
                        tok, sub = _token_of(t0 + s, n)
                        live = s < ln
                        if const_expr(n != 2):
                            live = live & (sub == n - 1)
                        if live:
                            addr = o_col + Int64(tok) * o_tok
                            for h in cutlass.range_constexpr(2):
                                _st_b16(addr + 16 * h, ptx.f32_to_16(fO[4 * jj + 2 * h + e], io))


# ---------------------------------------------------------------------------- host side
def compile_expanded(kernel, cfg, keep_ptx_dir: str | None, keep_cubin: bool):
    """``cute.compile`` of an SM90 chunked kernel object with ``cfg.expand_rows`` > 1 from fake tensors in the
    compiled function's order (:func:`cutedsl_attn.compile.fake.gdn_chunked_tensors`), q's row count its own
    (``T`` where k / v have ``T n``).  Raises ValueError for ``keep_cubin`` without a ``keep_ptx_dir``."""
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    p = cfg.problem
    io = element_type(p.dtype)
    state = cutlass.BFloat16 if p.state_dtype == "bfloat16" else Float32
    fake = list(gdn_chunked_tensors(io, state, p.head_dim_k, p.head_dim_v, CHUNK))
    fake[0] = make_fake_tensor(io, (cute.sym_int(), cute.sym_int(), p.head_dim_k),
                               (cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), 1), assumed_align=16)
    opts = compile_options(p.arch, keep_ptx_dir=keep_ptx_dir, keep_cubin=keep_cubin)
    return cute.compile(kernel, *fake, Float32(1.0), Int32(1), Int32(1), Int32(1), Int32(0),
                        make_fake_stream(use_tvm_ffi_env_stream=True), options=opts)


def launch_expanded(fn, cfg, args: GdnArgs) -> None:
    """Launch ``fn`` (:func:`compile_expanded`'s) on torch's current stream: the chunk plan over k's ``T n``
    expanded rows and the prep's scratch (:func:`~cutedsl_attn.planning.gdn.chunked_launch_tensors`, no host
    sync).  ``args``: k / v ``[T n, H, D]``, beta ``[T n, HO]``, ``cu_seqlens`` ``n`` times the tokens' offsets;
    q ``[T, Hq, K]``, g ``[T, HO]`` and the output ``[T, HO, V]`` on the tokens' timeline.

    Raises ValueError when k's (or v's) rows are not ``n`` times q's, the output's rows are not q's, or a gate the
    flags mark present is off its timeline (g ``[T, HO]``, beta ``[T n, HO]``: the kernels index them unchecked).
    """
    n = cfg.expand_rows
    T, ho = args.q.shape[0], args.output.shape[1]
    if args.k.shape[0] != T * n or args.v.shape[0] != T * n or args.output.shape[0] != T:
        raise ValueError(f"expand_rows {n}: k must have {n} x q's {T} rows and the output q's, got k "
                         f"{tuple(args.k.shape)}, v {tuple(args.v.shape)}, output {tuple(args.output.shape)}")
    # the expansion's g is [T n, HO]: handed to a native config it would read the wrong tokens' gates
    if args.flags & FLAG_HAS_G and tuple(args.g.shape) != (T, ho):
        raise ValueError(f"expand_rows {n}: g must be [T, HO] = [{T}, {ho}] (the tokens' timeline), got "
                         f"{tuple(args.g.shape)}")
    if args.flags & FLAG_HAS_BETA and tuple(args.beta.shape) != (T * n, ho):
        raise ValueError(f"expand_rows {n}: beta must be [T n, HO] = [{T * n}, {ho}] (the expanded timeline), got "
                         f"{tuple(args.beta.shape)}")
    # the plan and the scratch span the expanded rows: k's (same device and dtype as q)
    chunks, chunk_off, w, u, aqk, f = chunked_launch_tensors(args._replace(q=args.k), cfg.problem.head_dim_k,
                                                             cfg.problem.head_dim_v)
    fn(args.q, args.k, args.v, args.g, args.beta, args.cu_seqlens, chunks, chunk_off, args.initial_state,
       args.initial_state_indices, args.output_state, args.output_state_indices, args.output, w, u, aqk, f,
       args.scale, args.q_group, args.k_group, args.v_group, args.flags)


def launch(fn, cfg, args: GdnArgs) -> None:
    """The SM90 chunked kernel's launch (:mod:`cutedsl_attn.sm90.gdn_chunked` re-exports it): ``fn``
    (its ``compile``'s) on torch's current stream with the chunk plan, the prep's scratch (and the persistent work
    plan) of ``args`` (:func:`cutedsl_attn.common.gdn_launch.launch`); with ``cfg.expand_rows`` > 1 over k's
    expanded rows (:func:`launch_expanded`, which raises ValueError for row counts off the contract)."""
    if getattr(cfg, "expand_rows", 1) > 1:
        launch_expanded(fn, cfg, args)
    else:
        _launch_tokens(fn, cfg, args)
