"""The SM90 MLA producer's row loads: every 64-token block gathered row by row (small pages, fp8 caches) and Q
widened to f16 in place (fp8 q, bf16 q over fp8 caches).

A mixin of :class:`~cutedsl_attn.sm90.mla.kernel.MlaSm90Kernel`.  Both write the layout the TMA boxes write
(64-column chunks of 128-byte-swizzled 16-bit rows), so the consumers read shared memory as for TMA pages.

Block rows: producer thread ``tid`` owns row ``r`` (a permutation of ``tid // 2``) of every block and half
``h = tid % 2`` of its 16-byte pieces, so it computes the row's token, page and global addresses once per block
(64-bit: page id x page stride may pass 2^32).  Row ``r`` of block ``n`` is token ``(t0 // 64 + n) * 64 + r``, in
page ``indices[page_off + tok // page_size]`` at slot ``tok % page_size``; rows outside the item's ``[t0, t1)``
are zero-filled and their page id is not read (unused page slots may hold NaN, and a zero P would not cancel
them in P V; past the request's pages the page ids are not the request's).  The two threads of a row read 32
contiguous bytes (a full sector) and the eight lanes of a quarter warp write eight distinct 16-byte bank groups of
the swizzled row (the row permutation makes the pieces' swizzle distinct).

* 16-bit caches: ``cp.async`` 16 bytes a piece, zero-filled rows by a zero source size; the group's full
  barrier gets a ``cp.async.mbarrier.arrive.noinc`` per thread (as the TMA tail page did).
* fp8 caches, widened to f16 (``cvt.rn.f16x2.e4m3x2``, exact) and stored as two swizzled 16-byte pieces per 16
  e4m3 values, then ``fence.proxy.async`` and a plain mbarrier arrive per thread.  No separate fp8 staging copy
  fits next to Q and two 16-bit stages; ``Tiles.fp8_loads`` picks how the bytes arrive:
  :data:`~cutedsl_attn.sm90.mla.config.FP8_LOADS_STAGED` (the default) ``cp.async`` copies a whole block's fp8 bytes
  into the thread's own 16-bit slots of each group's upper half and widens them in place (a block in flight, no
  registers held), :data:`~cutedsl_attn.sm90.mla.config.FP8_LOADS_REGISTERS` loads 16 bytes at a time with
  ``ld.global.nc`` into registers (four in flight per thread: the producer has 40 or 56 registers).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from ...common import ptx
from ...common.smem import sw128_offset
from ...planning.mla import HEAD_DIM_CKV
from .config import BLOCK_N, FP8_LOADS_STAGED, GROUP_CHUNKS, NUM_GROUPS, TILE_M

CHUNK_BYTES = BLOCK_N * 64 * 2  # one 64 x 64 16-bit chunk of a stage
PIECES_PER_ROW = (HEAD_DIM_CKV + 64) // 8  # 72 16-byte (16-bit) pieces per 576-wide row
LOADS_IN_FLIGHT = 4  # 16-byte fp8 loads a producer thread holds before widening them


def _ld_global_nc_v4(addr):
    """16 bytes from global memory through the non-coherent path (read-only for the kernel); 4 Int32."""
    return cute.arch.inline_ptx("ld.global.nc.v4.b32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
                                write_only_types=[Int32] * 4, read_only_args=[Int64(addr)])


def _cp_async_8(smem_addr, gmem_addr, src_bytes):
    """``cp.async.ca.shared.global`` of 8 bytes (Int32 shared, Int64 global address), zero-filling past
    ``src_bytes`` (0 or 8)."""
    cute.arch.inline_ptx("cp.async.ca.shared.global [{$r0}], [{$r1}], 8, {$r2};",
                         read_only_args=[Int32(smem_addr), Int64(gmem_addr), Int32(src_bytes)])


def _st_shared_v4(addr, a, b, c, d):
    """16 bytes to a shared-window byte address (Int32, 16-byte aligned)."""
    cute.arch.inline_ptx("st.shared.v4.b32 [{$r0}], { {$r1}, {$r2}, {$r3}, {$r4} };",
                         read_only_args=[Int32(addr), Int32(a), Int32(b), Int32(c), Int32(d)])


def block_row(tid, fp8: bool):
    """The block row producer thread ``tid`` (0..127) owns: ``tid // 2`` with its low three bits permuted so that
    the quarter warp's rows (``tid // 2 = 4 a .. 4 a + 3``) have distinct swizzle bits where the half ``tid % 2``
    does not land: bits 1 and 2 for 16-bit pieces ``2 k + h``, bits 0 and 2 for fp8 pieces (16-bit pieces
    ``4 k + 2 h + e``).  Plain ints or DSL integers."""
    u = tid // 2
    if fp8:
        return (u // 8) * 8 + u % 2 + ((u // 2) % 2) * 4 + ((u // 4) % 2) * 2
    return (u // 8) * 8 + (u % 4) * 2 + (u // 4) % 2


def swizzle_mask(tid, fp8: bool):
    """The xor mask (bytes) of producer thread ``tid``'s first 16-byte piece in its swizzled 128-byte row: the
    half ``tid % 2`` in piece bit 0 (16-bit caches) or bit 1 (fp8), xor the row's ``r % 8``."""
    h = tid % 2
    return (((2 * h) if fp8 else h) ^ (block_row(tid, fp8) % 8)) * 16


def piece_offset(k, x16, fp8: bool, e=0):
    """Byte offset from a row group's first chunk row of the thread's ``k``-th 16-bit piece (16-bit caches:
    group piece ``2 k + h``) or of the ``e``-th half of its ``k``-th fp8 piece (16-bit pieces ``4 k + 2 h + e``);
    ``x16`` :func:`swizzle_mask`.  The layout :func:`cutedsl_attn.common.smem.sw128_offset` replays (64-row
    chunks)."""
    if fp8:
        return (k // 2) * CHUNK_BYTES + ((((4 * k) % 8 + e) * 16) ^ x16)
    return (k // 4) * CHUNK_BYTES + ((((2 * k) % 8) * 16) ^ x16)


class ProducerLoads:
    """Mixin: the producer's row-gathered blocks (:meth:`_produce_rows`), Q widened in place
    (:meth:`_load_q_widen`) and the page-64 path's tail page (:meth:`_gather_group`).  Expects ``self.cfg``,
    ``self.kv_fp8``, ``self.q_fp8``, ``self.page_size`` and ``_load_order``."""

    @cute.jit
    def _produce_rows(self, mCkv, mKpe, mIdx, sK_addr, full, empty, page_off, pg0, n_blk, t0, t1, tid):
        """Blocks in pairs (block ``2 j + c`` -> stage ``c``), gathered row by row, each stage's three groups as
        their last reader releases them (empty mbarrier, parity of the pair ``j``)."""
        fp8 = self.kv_fp8
        eb = 1 if const_expr(fp8) else 2  # bytes per cache element
        h = tid % 2
        r = block_row(tid, fp8)
        x16 = swizzle_mask(tid, fp8)
        ckv0 = mCkv.iterator.toint()
        kpe0 = mKpe.iterator.toint()
        for j in cutlass.range((n_blk + 1) // 2, unroll=1):
            for c in cutlass.range_constexpr(2):
                n = 2 * j + c
                if n < n_blk:
                    tok = (pg0 + n) * BLOCK_N + r
                    ok = (tok >= t0) & (tok < t1)
                    tok_c = Int32(cutlass.select_(ok, tok, t0))  # (a token of the item: its page id is the request's)
                    page = Int64(mIdx[page_off + tok_c // self.page_size])
                    slot = Int64(tok_c % self.page_size)
                    # the own half's first piece (16 bytes in)
                    row_c = ckv0 + (page * mCkv.stride[0] + slot * mCkv.stride[1]) * eb + h * 16
                    row_p = kpe0 + (page * mKpe.stride[0] + slot * mKpe.stride[1]) * eb + h * 16
                    s_row = sK_addr + c * self.cfg.stage_bytes + r * 128
                    if const_expr(fp8 and self.cfg.tiles.fp8_loads == FP8_LOADS_STAGED):
                        self._stage_block_fp8(row_c, row_p, s_row, full, empty, c, j, x16, ok)
                    else:
                        for g in self._load_order(c):
                            cute.arch.mbarrier_wait(empty + (c * NUM_GROUPS + g), (j % 2) ^ 1)
                            bar = full + (c * NUM_GROUPS + g)
                            ckv = len(GROUP_CHUNKS[g]) > 1
                            src = row_c if const_expr(ckv) else row_p
                            dst = s_row + GROUP_CHUNKS[g][0] * CHUNK_BYTES
                            if const_expr(fp8):
                                self._widen_row_group(src + (g * 256 if const_expr(ckv) else 0), dst, x16, ok,
                                                      len(GROUP_CHUNKS[g]) * 2)
                                ptx.fence_proxy_async_shared()  # st.shared (generic proxy) before wgmma's reads
                                cute.arch.mbarrier_arrive(bar)
                            else:
                                for k in cutlass.range_constexpr(len(GROUP_CHUNKS[g]) * 4):  # pieces 2 k + h
                                    ptx.cp_async_16(dst + piece_offset(k, x16, False),
                                                    src + (g * 512 if const_expr(ckv) else 0) + 2 * k * 16,
                                                    cutlass.select_(ok, 16, 0))
                                cute.arch.cp_async_mbarrier_arrive_noinc(bar)

    @cute.jit
    def _stage_block_fp8(self, row_c, row_p, s_row, full, empty, c: cutlass.Constexpr, j, x16, ok):
        """:data:`FP8_LOADS_STAGED`: the block's three groups as raw e4m3 by ``cp.async`` into the thread's own
        16-bit slots of each group's upper half (a group's fp8 bytes are half its 16-bit ones), all three in flight,
        then each widened in place by the thread that copied it (so no barrier: no thread reads or overwrites
        another's bytes) and released to the consumers in the schedule's order.  A block's groups are freed by
        the consumers' work on earlier blocks only, so waiting for all three before widening the first cannot
        deadlock; the next block waits for this one's widening."""
        order = self._load_order(c)
        for g in order:
            cute.arch.mbarrier_wait(empty + (c * NUM_GROUPS + g), (j % 2) ^ 1)
            ckv = len(GROUP_CHUNKS[g]) > 1
            n_loads = len(GROUP_CHUNKS[g]) * 2
            src = row_c + g * 256 if const_expr(ckv) else row_p
            dst = s_row + GROUP_CHUNKS[g][0] * CHUNK_BYTES
            for k in cutlass.range_constexpr(n_loads):  # piece k -> the slot of 16-bit piece (n/2 + k // 2, k % 2)
                ptx.cp_async_16(dst + piece_offset(n_loads // 2 + k // 2, x16, True, k % 2), src + k * 32,
                                cutlass.select_(ok, 16, 0))
            ptx.cp_async_commit()
        for i in cutlass.range_constexpr(NUM_GROUPS):
            g = order[i]
            ptx.cp_async_wait(NUM_GROUPS - 1 - i)  # the own copies of group g have landed
            n_loads = len(GROUP_CHUNKS[g]) * 2
            dst = s_row + GROUP_CHUNKS[g][0] * CHUNK_BYTES
            # in piece order: piece k's 16-bit slots (k, 0 / 1) hold staged pieces 2 (k - n/2) and + 1, which are
            # widened before it (or are piece k itself, read before its slots are written)
            for k in cutlass.range_constexpr(n_loads):
                w = ptx.ld_shared_v4_b32(dst + piece_offset(n_loads // 2 + k // 2, x16, True, k % 2))
                self._store_widened(dst, k, x16, w)
            ptx.fence_proxy_async_shared()  # st.shared (generic proxy) before wgmma's reads
            cute.arch.mbarrier_arrive(full + (c * NUM_GROUPS + g))

    @cute.jit
    def _store_widened(self, dst, k: cutlass.Constexpr, x16, w):
        """16 e4m3 (4 words ``w``) -> f16 pieces ``(k, 0)``, ``(k, 1)`` of the own row at ``dst``."""
        for e in cutlass.range_constexpr(2):
            a = ptx.e4m3x4_to_f16x2(w[2 * e])
            b = ptx.e4m3x4_to_f16x2(w[2 * e + 1])
            _st_shared_v4(dst + piece_offset(k, x16, True, e), a[0], a[1], b[0], b[1])

    @cute.jit
    def _widen_row_group(self, src, dst, x16, ok, n_loads: cutlass.Constexpr):
        """The own ``n_loads`` fp8 pieces of a row group (piece ``k``: 16 e4m3 at ``src + 32 k``; zero where not
        ``ok``) -> f16 pieces ``4 k + 2 h``, ``4 k + 2 h + 1`` of the swizzled row at ``dst`` (``x16``: the xor
        mask of piece ``2 h``).  A rolled loop of :data:`LOADS_IN_FLIGHT` pieces: unrolled, ptxas hoists every
        load of the group and spills."""
        per = min(n_loads, LOADS_IN_FLIGHT)
        for kk in cutlass.range(n_loads // per, unroll=1):
            words = []
            for k in cutlass.range_constexpr(per):
                w = _ld_global_nc_v4(src + (kk * per + k) * 32)
                words.append([Int32(cutlass.select_(ok, w[e], 0)) for e in range(4)])
            d = dst + kk * (per // 2) * CHUNK_BYTES  # (= piece_offset(kk * per + k, ..): per is even)
            for k in cutlass.range_constexpr(per):
                self._store_widened(d, k, x16, words[k])

    @cute.jit
    def _load_q_widen(self, mQn, mQp, sQ_addr, q_bar, q_start, row0, rows, H, tid):
        """The tile's 64 packed Q rows (as ``_load_q``) as f16: each thread ``cp.async`` copies its pieces' bf16 (16
        bytes) or e4m3 (8 bytes) into the slot its f16 piece takes, then widens them in place (bf16 rounded to f16:
        the wgmmas run in f16 under fp8 caches; e4m3 exactly), zero past ``rows``; it touches its own slots only,
        so no barrier.  Every producer thread arrives on ``q_bar`` (a plain arrive after ``fence.proxy.async``)."""
        q8 = self.q_fp8
        eb = 1 if const_expr(q8) else 2
        qn = mQn.iterator.toint()
        qp = mQp.iterator.toint()
        per_thread = TILE_M * PIECES_PER_ROW // 128  # 36 pieces of 8 values
        for it in cutlass.range(per_thread, unroll=1):
            idx = it * 128 + tid
            r = idx // PIECES_PER_ROW
            c16 = idx % PIECES_PER_ROW
            pr = row0 + r
            pr_c = cutlass.min(pr, rows - 1)
            tok = q_start + pr_c // H
            hh = pr_c % H
            nope = c16 < HEAD_DIM_CKV // 8
            src = Int64(cutlass.select_(
                nope, qn + (Int64(tok) * mQn.stride[0] + Int64(hh) * mQn.stride[1]) * eb + c16 * 8 * eb,
                qp + (Int64(tok) * mQp.stride[0] + Int64(hh) * mQp.stride[1]) * eb
                + (c16 - HEAD_DIM_CKV // 8) * 8 * eb))
            dst = sQ_addr + sw128_offset(r, c16, TILE_M)
            if const_expr(q8):
                _cp_async_8(dst, src, cutlass.select_(pr < rows, 8, 0))
            else:
                ptx.cp_async_16(dst, src, cutlass.select_(pr < rows, 16, 0))
        ptx.cp_async_commit()
        ptx.cp_async_wait(0)
        for it in cutlass.range(per_thread, unroll=1):
            idx = it * 128 + tid
            dst = sQ_addr + sw128_offset(idx // PIECES_PER_ROW, idx % PIECES_PER_ROW, TILE_M)
            if const_expr(q8):
                w = ptx.ld_shared_v2_b32(dst)
                a = ptx.e4m3x4_to_f16x2(w[0])
                b = ptx.e4m3x4_to_f16x2(w[1])
                _st_shared_v4(dst, a[0], a[1], b[0], b[1])
            else:
                w = ptx.ld_shared_v4_b32(dst)
                _st_shared_v4(dst, *[ptx.bf16x2_to_f16x2(w[i]) for i in range(4)])
        ptx.fence_proxy_async_shared()
        cute.arch.mbarrier_arrive(q_bar)

    @cute.jit
    def _gather_group(self, mCkv, mKpe, s_stage, g: cutlass.Constexpr, page, valid_rows, tid):
        """``cp.async`` group ``g`` of page ``page`` into the stage at ``s_stage`` (same swizzled layout as the
        boxes), slots ``valid_rows ..`` zero-filled (never read: rows clamp to slot 0, which the block holds)."""
        ckv = len(GROUP_CHUNKS[g]) > 1
        per_row = 32 if ckv else 8  # 16-byte pieces of the group per row
        col0 = GROUP_CHUNKS[g][0] * 8
        mX = mCkv if const_expr(ckv) else mKpe
        base = mX.iterator.toint() + Int64(page) * mX.stride[0] * 2
        for it in cutlass.range(BLOCK_N * per_row // 128, unroll=1):
            idx = it * 128 + tid
            r = idx // per_row
            p = idx % per_row
            ok = r < valid_rows
            r_c = Int32(cutlass.select_(ok, r, 0))
            src = base + Int64(r_c) * mX.stride[1] * 2 + (p + (col0 if const_expr(ckv) else 0)) * 16
            ptx.cp_async_16(s_stage + sw128_offset(r, col0 + p, BLOCK_N), src, cutlass.select_(ok, 16, 0))
