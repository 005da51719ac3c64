"""Thin wrappers over single PTX instructions, shared by every kernel.

Each function emits exactly one (or a handful of) PTX instructions through
``cute.arch.inline_ptx`` while a CuTe DSL kernel is being traced; they must be
called from inside ``@cute.kernel`` / ``@cute.jit`` code.  They exist so the
kernels can state the SM80-class instruction they mean (``mma.sync``,
``ldmatrix``, ``cp.async``) with the register layout written out in the PTX
ISA, which makes the fragment bookkeeping in the kernels explicit and
checkable in the generated PTX (``cutedsl_attn.inspect.ptx``).

Register layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"), with
``g = lane // 4`` and ``t = lane % 4``:

* A (16x16, row-major): ``a0=(g, 2t..2t+1)``, ``a1=(g+8, 2t..)``,
  ``a2=(g, 2t+8..)``, ``a3=(g+8, 2t+8..)``; each register holds two 16-bit
  values, the lower column in the low half.
* B (16x8, "col"): ``b0=(k=2t..2t+1, n=g)``, ``b1=(k=2t+8..2t+9, n=g)``.
* C/D (16x8 fp32): ``c0,c1=(g, 2t..2t+1)``, ``c2,c3=(g+8, 2t..2t+1)``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

_inline = cute.arch.inline_ptx


def mma_m16n8k16(a, b, c, dtype):
    """D = A*B + C for one m16n8k16 tile; ``a`` 4 x Int32, ``b`` 2 x Int32, ``c`` 4 x Float32.

    ``dtype`` is ``cutlass.BFloat16`` or ``cutlass.Float16`` (the A/B element type);
    accumulation is fp32.  Returns a tuple of 4 Float32.
    """
    ab = "bf16" if dtype is cutlass.BFloat16 else "f16"
    return _inline(
        f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32 "
        "{ {$w0}, {$w1}, {$w2}, {$w3} }, { {$r0}, {$r1}, {$r2}, {$r3} }, "
        "{ {$r4}, {$r5} }, { {$r6}, {$r7}, {$r8}, {$r9} };",
        write_only_types=[Float32] * 4,
        read_only_args=[a[0], a[1], a[2], a[3], b[0], b[1], c[0], c[1], c[2], c[3]],
    )


def ldmatrix_x4(smem_addr, trans: bool = False):
    """``ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16``: four 8x8 16-bit matrices.

    ``smem_addr`` (Int32, shared-window byte address) is this lane's row address:
    lanes 8i..8i+7 give the 8 rows of matrix i.  Returns 4 Int32 registers.
    """
    tr = ".trans" if trans else ""
    return _inline(
        f"ldmatrix.sync.aligned.m8n8.x4{tr}.shared.b16 "
        "{ {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
        write_only_types=[Int32] * 4,
        read_only_args=[Int32(smem_addr)],
    )


def cp_async_16(smem_addr, gmem_addr, src_bytes):
    """``cp.async.cg.shared.global`` of 16 bytes, zero-filling past ``src_bytes`` (0 or 16).

    ``smem_addr`` Int32 shared address, ``gmem_addr`` Int64 global address (must be a
    valid address even when ``src_bytes`` is 0).
    """
    _inline(
        "cp.async.cg.shared.global [{$r0}], [{$r1}], 16, {$r2};",
        read_only_args=[Int32(smem_addr), Int64(gmem_addr), Int32(src_bytes)],
    )


def cp_async_commit():
    """Close this thread's current group of ``cp.async`` copies (``cp.async.commit_group``)."""
    _inline("cp.async.commit_group;")


def cp_async_wait(n: int):
    """Wait until at most ``n`` (compile-time) cp.async groups of this thread are pending."""
    _inline(f"cp.async.wait_group {int(n)};")


def pack2(lo, hi, dtype):
    """Round two fp32 to one 32-bit register of two 16-bit values (``lo`` in the low half)."""
    t = "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"
    return _inline(
        f"cvt.rn.{t}.f32 {{$w0}}, {{$r0}}, {{$r1}};",
        write_only_types=[Int32],
        read_only_args=[Float32(hi), Float32(lo)],
    )


def unpack2(x, dtype):
    """Split one register of two 16-bit values into (low, high) fp32."""
    if dtype is cutlass.BFloat16:
        lo = _inline("shl.b32 {$w0}, {$r0}, 16;", write_only_types=[Float32], read_only_args=[Int32(x)])
        hi = _inline("and.b32 {$w0}, {$r0}, 0xffff0000;", write_only_types=[Float32], read_only_args=[Int32(x)])
        return lo, hi
    return _inline(
        "{ .reg .f16 l, h; mov.b32 {l, h}, {$r0}; cvt.f32.f16 {$w0}, l; cvt.f32.f16 {$w1}, h; }",
        write_only_types=[Float32, Float32],
        read_only_args=[Int32(x)],
    )


def opaque_i32(x):
    """``x`` through a ``mov.b32`` the compiler cannot see through (inline asm with side effects).

    Inside a persistent tile loop, per-thread geometry derived from ``x`` (thread or warpgroup
    index) is then recomputed per tile instead of being hoisted out of the loop by LLVM and kept
    live through the main loop, where those registers are the ones the wgmma pipeline needs.
    """
    return _inline("mov.b32 {$w0}, {$r0};", write_only_types=[Int32], read_only_args=[Int32(x)])


def barrier_or(pred, barrier_id, num_threads: int):
    """``bar.red.or.pred`` on named barrier ``barrier_id`` (Int32) over ``num_threads`` (compile time) threads: waits
    for them like ``bar.sync`` and returns 1 (Int32) to each if ``pred`` (Int32, nonzero = true) holds for any."""
    return _inline(
        "{ .reg .pred q, p; setp.ne.s32 q, {$r0}, 0; "
        f"bar.red.or.pred p, {{$r1}}, {int(num_threads)}, q; selp.s32 {{$w0}}, 1, 0, p; }}",
        write_only_types=[Int32],
        read_only_args=[Int32(pred), Int32(barrier_id)],
    )


def ex2(x):
    """2**x (``ex2.approx.ftz.f32``; ex2(-inf) = 0)."""
    return _inline("ex2.approx.ftz.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[Float32(x)])


def lg2(x):
    """log2(x) (``lg2.approx.ftz.f32``; lg2(0) = -inf)."""
    return _inline("lg2.approx.ftz.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[Float32(x)])


def tanh(x):
    """``tanh.approx.f32`` (sm_75+)."""
    return _inline("tanh.approx.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[Float32(x)])


def sin_cos(x):
    """(sin x, cos x) with ``sin/cos.approx.ftz.f32``; reduce large arguments first."""
    s = _inline("sin.approx.ftz.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[Float32(x)])
    c = _inline("cos.approx.ftz.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[Float32(x)])
    return s, c


def rcp(x):
    """1/x (``rcp.approx.ftz.f32``)."""
    return _inline("rcp.approx.ftz.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[Float32(x)])


def ld_shared_f32(addr):
    """fp32 load from a shared-window byte address (Int32)."""
    return _inline("ld.shared.f32 {$w0}, [{$r0}];", write_only_types=[Float32], read_only_args=[Int32(addr)])


def st_shared_f32(addr, v):
    """fp32 store to a shared-window byte address (Int32)."""
    _inline("st.shared.f32 [{$r0}], {$r1};", read_only_args=[Int32(addr), Float32(v)])


def ld_shared_u16(addr):
    """16-bit load from shared memory, zero-extended into an Int32."""
    return _inline("ld.shared.u16 {$w0}, [{$r0}];", write_only_types=[Int32], read_only_args=[Int32(addr)])


def st_shared_u16(addr, v):
    """Store the low 16 bits of ``v`` to shared memory."""
    _inline("st.shared.u16 [{$r0}], {$r1};", read_only_args=[Int32(addr), Int32(v)])


def ld_global_cg_f32(addr):
    """fp32 load that bypasses L1 (data written by other CTAs of the same launch)."""
    return _inline("ld.global.cg.f32 {$w0}, [{$r0}];", write_only_types=[Float32], read_only_args=[Int64(addr)])


def atomic_add_global_u32(addr, v):
    """``atom.global.add.u32``; returns the old value."""
    return _inline(
        "atom.global.add.u32 {$w0}, [{$r0}], {$r1};",
        write_only_types=[Int32],
        read_only_args=[Int64(addr), Int32(v)],
    )


def st_global_u32(addr, v):
    """32-bit store to a global byte address (Int64)."""
    _inline("st.global.u32 [{$r0}], {$r1};", read_only_args=[Int64(addr), Int32(v)])


def stmatrix_x4(smem_addr, r0, r1, r2, r3):
    """``stmatrix.sync.aligned.m8n8.x4.shared.b16``: four 8x8 16-bit matrices from the ``mma`` C-fragment
    layout (register ``i``: matrix ``i``'s row ``lane // 4``, columns ``2 (lane % 4)`` and ``+1``); lanes
    ``8i .. 8i+7`` give the row addresses (Int32 shared-window bytes, 16-byte aligned) of matrix ``i``."""
    _inline("stmatrix.sync.aligned.m8n8.x4.shared.b16 [{$r0}], { {$r1}, {$r2}, {$r3}, {$r4} };",
            read_only_args=[Int32(smem_addr), Int32(r0), Int32(r1), Int32(r2), Int32(r3)])


def ld_shared_v4_b32(addr):
    """16-byte shared load (Int32 shared-window byte address); 4 Int32."""
    return _inline("ld.shared.v4.b32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];", write_only_types=[Int32] * 4,
                   read_only_args=[Int32(addr)])


def st_global_v4_b32(addr, v0, v1, v2, v3):
    """16-byte global store (Int64 byte address, 16-byte aligned)."""
    _inline("st.global.v4.b32 [{$r0}], { {$r1}, {$r2}, {$r3}, {$r4} };",
            read_only_args=[Int64(addr), Int32(v0), Int32(v1), Int32(v2), Int32(v3)])


def st_shared_zero_v4(addr):
    """16 zero bytes to a shared-window byte address (Int32, 16-byte aligned): ``st.shared.v4.b32``."""
    _inline("st.shared.v4.b32 [{$r0}], {0, 0, 0, 0};", read_only_args=[Int32(addr)])


def fence_proxy_async_shared():
    """``fence.proxy.async.shared::cta``: order this thread's generic-proxy shared memory accesses with later
    async-proxy (TMA, wgmma) ones."""
    _inline("fence.proxy.async.shared::cta;")


def stamp_clock64(addr):
    """Store the SM's ``%clock64`` to the global byte address ``addr`` (Int64): development traces."""
    _inline("st.global.u64 [{$r0}], {$r1};", read_only_args=[Int64(addr), Int64(cute.arch.clock64())])


def fence_gpu():
    """``fence.acq_rel.gpu`` (a __threadfence())."""
    _inline("fence.acq_rel.gpu;")


def f32_to_16(x, dtype):
    """Round one fp32 to a 16-bit value in the low half of an Int32."""
    t = "bf16" if dtype is cutlass.BFloat16 else "f16"
    return _inline(
        f"{{ .reg .b16 h; cvt.rn.{t}.f32 h, {{$r0}}; cvt.u32.u16 {{$w0}}, h; }}",
        write_only_types=[Int32],
        read_only_args=[Float32(x)],
    )


def b16_to_f32(x, dtype):
    """Widen a 16-bit value held in the low half of an Int32 to fp32."""
    if dtype is cutlass.BFloat16:
        return _inline("shl.b32 {$w0}, {$r0}, 16;", write_only_types=[Float32], read_only_args=[Int32(x)])
    return _inline(
        "{ .reg .b16 h; cvt.u16.u32 h, {$r0}; cvt.f32.f16 {$w0}, h; }",
        write_only_types=[Float32],
        read_only_args=[Int32(x)],
    )


def rint(x):
    """Round to nearest integer (``cvt.rni.f32.f32``)."""
    return _inline("cvt.rni.f32.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[Float32(x)])


def ld_global_cg_v4_f32(addr):
    """Four fp32 from a 16-byte aligned address, bypassing L1 (``ld.global.cg.v4.f32``)."""
    return _inline(
        "ld.global.cg.v4.f32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
        write_only_types=[Float32] * 4,
        read_only_args=[Int64(addr)],
    )


def ld_shared_b32(addr):
    """32-bit load from a shared-window byte address (Int32)."""
    return _inline("ld.shared.b32 {$w0}, [{$r0}];", write_only_types=[Int32], read_only_args=[Int32(addr)])


def ld_shared_v2_b32(addr):
    """8-byte load from a shared-window byte address (Int32, 8-byte aligned); 2 Int32."""
    return _inline("ld.shared.v2.b32 { {$w0}, {$w1} }, [{$r0}];", write_only_types=[Int32] * 2,
                   read_only_args=[Int32(addr)])


def st_shared_b32(addr, v):
    """32-bit store to a shared-window byte address (Int32)."""
    _inline("st.shared.b32 [{$r0}], {$r1};", read_only_args=[Int32(addr), Int32(v)])


def prmt(a, b, sel: int):
    """``prmt.b32``: byte ``i`` of the result is byte ``sel``'s nibble ``i`` of {b, a} (0-3: a, 4-7: b)."""
    return _inline(f"prmt.b32 {{$w0}}, {{$r0}}, {{$r1}}, {sel:#06x};", write_only_types=[Int32],
                   read_only_args=[Int32(a), Int32(b)])


def e4m3x4_to_f16x2(w):
    """Four e4m3 bytes -> two f16x2 registers (bytes 0, 1 -> the first, 2, 3 -> the second; the lower byte in
    the low half), ``cvt.rn.f16x2.e4m3x2`` (sm_89+): exact."""
    return _inline("{ .reg .b16 l, h; mov.b32 {l, h}, {$r0}; cvt.rn.f16x2.e4m3x2 {$w0}, l; "
                   "cvt.rn.f16x2.e4m3x2 {$w1}, h; }", write_only_types=[Int32, Int32], read_only_args=[Int32(w)])


def bf16x2_to_f16x2(w):
    """Two bf16 -> two f16 (round to nearest) in one register."""
    return _inline("{ .reg .b32 l, h; shl.b32 l, {$r0}, 16; and.b32 h, {$r0}, 0xffff0000; "
                   "cvt.rn.f16x2.f32 {$w0}, h, l; }", write_only_types=[Int32], read_only_args=[Int32(w)])


def ld_shared_v2_f32(addr):
    """8-byte load from a shared-window byte address (Int32, 8-byte aligned); 2 Float32."""
    return _inline("ld.shared.v2.f32 { {$w0}, {$w1} }, [{$r0}];", write_only_types=[Float32] * 2,
                   read_only_args=[Int32(addr)])


def ld_global_v2_f32(addr):
    """8-byte global load (Int64 address, 8-byte aligned); 2 Float32.  A plain ``ld`` (not ``.nc``): the chunked
    delta-rule kernels read state rows an in-place pool update writes later in the same launch."""
    return _inline("ld.global.v2.f32 { {$w0}, {$w1} }, [{$r0}];", write_only_types=[Float32] * 2,
                   read_only_args=[Int64(addr)])


def ld_global_b32(addr):
    """32-bit global load (Int64 address); Int32."""
    return _inline("ld.global.b32 {$w0}, [{$r0}];", write_only_types=[Int32], read_only_args=[Int64(addr)])


def st_global_v2_f32(addr, a, b):
    """8-byte global store of two Float32 (Int64 address, 8-byte aligned)."""
    _inline("st.global.v2.f32 [{$r0}], { {$r1}, {$r2} };", read_only_args=[Int64(addr), Float32(a), Float32(b)])
