"""Source addresses of the 16-byte ``cp.async`` chunks the prefill kernels gather, shared by the portable
and SM90 kernels (one formula for GQA-packed Q rows, one for ragged or paged K/V rows).

Each helper returns ``(element offset from the tensor's base, valid)``; the caller copies from
``base + 2 * offset`` with ``16 if valid else 0`` source bytes: rows past the request are clamped to its
last row and copied with 0 source bytes, so the destination is zero-filled (``cp.async`` zfill).  (The
caller forms the address, after its shared-memory destination, so the generated code keeps its order.)
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int64, const_expr


@cute.jit
def q_chunk_offset(mQ, pr, qo_len, q_start, kvh, col, group_size: cutlass.Constexpr):
    """Chunk ``col`` of packed Q row ``pr`` of a request: query token ``pr // group_size`` (global row
    ``q_start + ...``) of query head ``kvh * group_size + pr % group_size``; ``mQ`` is ``[tokens, Hq, D]``
    16-bit with a contiguous last dim."""
    G = group_size
    tok = pr // G
    valid = tok < qo_len
    tok_c = cutlass.min(tok, qo_len - 1)
    goff = Int64(q_start + tok_c) * mQ.stride[0] + Int64(kvh * G + pr % G) * mQ.stride[1] + col * 8
    return goff, valid


@cute.jit
def kv_chunk_offset(mX, mIdx, tok, kv_len, kv_start, kvh, col, page_size: cutlass.Constexpr):
    """Chunk ``col`` of KV token ``tok`` of a request: ragged ``mX [tokens, Hkv, D]`` with the request at
    token ``kv_start`` (``page_size == 0``), or a paged ``mX [pages, page_size, Hkv, D]`` whose page ids
    are ``mIdx[kv_start + tok // page_size]``."""
    valid = tok < kv_len
    tok_c = cutlass.min(tok, kv_len - 1)
    if const_expr(page_size > 0):
        page = mIdx[kv_start + tok_c // page_size]
        goff = (Int64(page) * mX.stride[0] + Int64(tok_c % page_size) * mX.stride[1] + Int64(kvh) * mX.stride[2]
                + col * 8)
    else:
        goff = Int64(kv_start + tok_c) * mX.stride[0] + Int64(kvh) * mX.stride[1] + col * 8
    return goff, valid
