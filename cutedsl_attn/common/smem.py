"""Shared-memory tiles of 16-bit elements in the K-major 128-byte-swizzled layout (the K_SW128 atom) that TMA
writes and wgmma reads: byte offsets for ``cp.async`` gathers into such a tile, and its transposed view.

The atom is 8 rows x 64 elements (128 bytes a row); a tile of ``rows`` rows stacks atoms down the rows first,
then along the row, so 64-column block ``c // 8`` of the tile is ``rows * 128`` bytes.  Within a row the
16-byte chunk index is XOR-ed with ``r % 8``; the tile base must be 1 KiB aligned for the hardware's swizzle
(which acts on address bits) to agree with these offsets.
"""

from __future__ import annotations

import cutlass.cute as cute


def sw128_offset(r, c, rows: int):
    """Byte offset of 16-byte chunk ``c`` (elements ``8c .. 8c+7``) of row ``r`` in a ``rows``-row K_SW128 tile
    of 16-bit elements.  ``r`` and ``c`` are plain ints or DSL integers (so the layout can be replayed on the
    host); ``rows`` is a Python int (a multiple of 8: whole atoms)."""
    return (c // 8) * (rows * 128) + r * 128 + (((c % 8) ^ (r % 8)) * 16)


def transpose_view(t):
    """The (A, B, ...) shared-memory tensor ``t`` viewed as (B, A, ...), swizzle kept: a (tokens, dims) V tile as
    the MN-major B operand of P V."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))
