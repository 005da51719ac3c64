"""The staged epilogue's shared-memory layout (common.epilogue.staged_offset / stmatrix_row), replayed in
Python against the PTX semantics of ``stmatrix.sync.aligned.m8n8.x4`` and 16-byte ``ld.shared``: every element
of a warp's 16 rows lands once, the read-back chunk (r, c) holds row r's columns 8c..8c+7, and neither the
stores nor the loads have bank conflicts (each 8-address phase covers all 32 banks once)."""

import pytest

from cutedsl_attn.common.epilogue import staged_offset, stmatrix_row


@pytest.mark.parametrize("dv", [64, 128, 256])
def test_staged_layout_roundtrip_and_banks(dv):
    mem = {}  # byte offset -> (row, column) of the bf16 element stored there
    for dd in range(0, dv // 8, 2):
        addr = {}
        for lane in range(32):  # lane L gives the row address of matrix L // 8, row L % 8
            r, c = stmatrix_row(lane, dd)
            addr[(lane // 8, lane % 8)] = staged_offset(r, c)
            assert staged_offset(r, c) % 16 == 0
        for m in range(4):  # one matrix per phase: 8 rows x 16 bytes over distinct 4-bank groups
            banks = sorted((addr[(m, j)] // 4) % 32 // 4 for j in range(8))
            assert banks == list(range(8)), (dd, m, banks)
        for lane in range(32):  # register i of a lane: matrix i, row lane // 4, columns 2 (lane % 4) + 0/1
            for i, (dblk, half) in enumerate([(dd, 0), (dd, 1), (dd + 1, 0), (dd + 1, 1)]):
                row, col = half * 8 + lane // 4, dblk * 8 + 2 * (lane % 4)
                base = addr[(i, lane // 4)] + 4 * (lane % 4)
                for e in range(2):
                    assert base + 2 * e not in mem
                    mem[base + 2 * e] = (row, col + e)
    assert len(mem) == 16 * dv and max(mem) < 16 * dv * 2
    for off, (r, col) in mem.items():  # the TMA box layout: 16 x 64 columns per 2 KiB, 128-byte swizzle
        box, rest = divmod(off, 2048)
        assert box == col // 64 and rest // 128 == r
        assert ((rest % 128) // 16) ^ (r % 8) == (col % 64) // 8 and (rest % 16) // 2 == col % 8
    cpr = dv // 8
    for it in range(16 * cpr // 32):
        phases = {}
        for lane in range(32):
            idx = it * 32 + lane
            r, c = idx // cpr, idx % cpr
            off = staged_offset(r, c)
            assert [mem[off + 2 * e] for e in range(8)] == [(r, 8 * c + e) for e in range(8)]
            phases.setdefault(lane // 8, []).append((off // 16) % 8)
        for ph in phases.values():  # a 16-byte load serves 8 lanes per wavefront: 8 distinct bank groups
            assert sorted(ph) == list(range(8)), ph


class _Stage:
    def __init__(self, index):
        self.index = index


@pytest.mark.parametrize("dq,dv,num_wg,q_stages", [(128, 128, 2, 2), (128, 128, 2, 1), (256, 256, 2, 1),
                                                   (192, 128, 2, 1), (64, 64, 3, 2), (128, 64, 2, 2),
                                                   (256, 128, 2, 1), (128, 128, 3, 1), (64, 64, 2, 1),
                                                   (192, 64, 3, 1)])
def test_staging_regions_inside_own_q_rows(dq, dv, num_wg, q_stages):
    """The SM90 kernel's ``_staging_offset``: each consumer warp's 16 x head_dim_vo staging bytes lie inside its
    own warpgroup's 64 Q rows of the current Q stage (the K-major 128-byte-swizzled Q layout keeps the rows
    of a 64-column atom together: row r of atom a at bytes a * tile_m * 128 + r * 128 of the stage; the
    swizzle only permutes 16-byte chunks inside a row), and no two warps' regions overlap -- the other
    warpgroup's in-flight S GEMM reads only its own rows; every region starts on 1 KiB (relative to the
    1 KiB-aligned sQ), as the TMA store's 128-byte-swizzle boxes need (``Epilogue.SMEM_TMA``)."""
    from cutedsl_attn.planning.prefill import PrefillProblem
    from cutedsl_attn.sm90.prefill import Config, Tiles
    from cutedsl_attn.sm90.prefill.config import Epilogue
    from cutedsl_attn.sm90.prefill.kernel import Sm90PrefillKernel

    cfg = Config(PrefillProblem(dtype="bfloat16", head_dim_qk=dq, head_dim_vo=dv, group_size=1),
                 Tiles(num_wg=num_wg, tile_n=64, q_stages=q_stages, epilogue=Epilogue.SMEM))
    k = Sm90PrefillKernel(cfg)
    tm, stage_bytes = 64 * num_wg, 64 * num_wg * dq * 2
    for st in range(q_stages):
        owner = {}  # byte -> warp
        for warp in range(4 * num_wg):
            wg = warp // 4
            off = k._staging_offset(_Stage(st), wg, warp)
            assert off % 1024 == 0, (warp, off)  # (sQ is 1 KiB aligned) the TMA store's 128-byte swizzle boxes
            for b in range(off, off + 16 * dv * 2, 16):
                rel = b - st * stage_bytes
                assert 0 <= rel < stage_bytes, (warp, b)
                atom, row = rel // (tm * 128), rel % (tm * 128) // 128
                assert atom < dq // 64 and row // 64 == wg, (warp, b, atom, row)
                assert b not in owner, (warp, owner.get(b), b)
                owner[b] = warp
