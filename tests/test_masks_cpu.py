"""The kernels' shared mask helpers (:mod:`cutedsl_attn.common.masks`) replayed on the CPU."""


def test_visible_range_matches_visible(monkeypatch):
    """``masks.visible_range`` (the SM90 kernel's per-row bounds, one compare per score) keeps exactly the keys
    ``masks.visible`` keeps, for every mask combination, key offsets of a 176-key block, queries before /
    inside / after the block, windows off / 0 / small / large.  The device helpers are replayed on Python
    ints (``cutlass.min`` / ``select_`` / ``Int32`` swapped for their Python meaning)."""
    import types

    from cutedsl_attn.common import masks

    monkeypatch.setattr(masks, "cutlass", types.SimpleNamespace(min=min, select_=lambda c, a, b: a if c else b))
    monkeypatch.setattr(masks, "Int32", int)
    for causal in (False, True):
        for use_window in (False, True):
            for kv_len in (1, 100, 300):
                for qpos in (-5, 0, 37, 150, 299, 400):
                    for window_left in (-1, 0, 9, 1000):
                        for j0 in (0, 64, 176, 250):
                            lo, hi = masks.visible_range(j0, kv_len, qpos, window_left, causal=causal,
                                                         use_window=use_window)
                            for c in range(176):
                                want = masks.visible(j0 + c, kv_len, qpos, window_left, causal=causal,
                                                     use_window=use_window)
                                got = c <= hi and (lo is None or lo <= c)
                                assert bool(want) == got, (causal, use_window, kv_len, qpos, window_left, j0, c)


def test_custom_mask_bit_addressing(monkeypatch):
    """``custom_row_bit`` + ``custom_visible`` (both kernels' custom-mask lookup) read FlashInfer's packed layout:
    request b's ``qo x kv`` bits, row-major, little-endian, starting at byte ``indptr[b]`` of the packed buffer;
    keys past the request clamp to the row's last bit.  Replayed on Python ints against the unpacked mask."""
    import types

    import torch

    import cutedsl_attn as ca
    from cutedsl_attn.common import masks

    monkeypatch.setattr(masks, "cutlass", types.SimpleNamespace(min=min))
    monkeypatch.setattr(masks, "Int32", int)
    monkeypatch.setattr(masks, "Int64", int)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    qo, kv = [3, 1, 7, 5], [5, 9, 13, 1]
    ms = [torch.rand(a, b, generator=g) > 0.5 for a, b in zip(qo, kv)]
    elem_ptr = torch.tensor([0] + torch.tensor([a * b for a, b in zip(qo, kv)]).cumsum(0).tolist())
    packed, byte_ptr = ca.segment_packbits(torch.cat([m.flatten() for m in ms]), elem_ptr, bitorder="little")
    buf = packed.tolist()
    for b, m in enumerate(ms):
        off = 8 * int(byte_ptr[b])
        for q in range(qo[b]):
            row = masks.custom_row_bit(off, q, kv[b])
            for j in range(kv[b] + 3):
                want = bool(m[q, min(j, kv[b] - 1)])
                assert masks.custom_visible(buf, row, kv[b], j) == want, (b, q, j)


def test_mask_bounds_do_not_wrap_in_int32(monkeypatch):
    """The kernels compute the bounds in int32: ``window_left`` may be anything up to 2^31 - 1 (FlashInfer
    users pass int32 max for "no limit"), ``qpos`` is negative for rows above a shorter KV (requests of up to
    2^30 tokens here).  Replayed with
    wrapping numpy int32 against exact Python-int rules (a window of ``kv_len`` keys or more is no window)."""
    import types
    import warnings

    import numpy as np

    from cutedsl_attn.common import masks

    i32 = np.int32
    monkeypatch.setattr(masks, "cutlass", types.SimpleNamespace(
        min=lambda a, b: i32(min(a, b)), max=lambda a, b: i32(max(a, b)), select_=lambda c, a, b: a if c else b))
    monkeypatch.setattr(masks, "Int32", i32)
    big = 2**31 - 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy warns on int32 overflow: none may happen
        for kv_len in (1, 300, 2**30):
            # qpos = i + kv_len - qo_len: below kv_len, and above -2^30 for requests of up to 2^30 tokens
            for qpos in (kv_len - 2**30, -5, 0, 299):
                if qpos > kv_len - 1:
                    continue
                for window_left in (-1, 0, 7, kv_len - 1, kv_len, big):
                    for j0 in (0, 250, 2**30 - 176):
                        lo, hi = masks.visible_range(i32(j0), i32(kv_len), i32(qpos), i32(window_left), causal=False,
                                                     use_window=True)
                        for c in (0, 1, 5, 175):
                            j = j0 + c
                            want = j < kv_len and (window_left < 0 or j >= qpos - window_left)
                            assert (c <= hi and lo <= c) == want, (kv_len, qpos, window_left, j0, c)
                            got = masks.visible(i32(j), i32(kv_len), i32(qpos), i32(window_left), causal=True,
                                                use_window=True)
                            assert bool(got) == (want and j <= qpos), (kv_len, qpos, window_left, j)


def test_num_right_masked_matches_per_block_check(monkeypatch):
    """``num_right_masked`` (``loop_split``: how many blocks, from the right, go through the masked loop) equals
    the number of blocks the per-block check (``tok0 + tile_n > kv_len`` or, causal, ``tok0 + tile_n - 1 >
    pos_first``) would mask, and those are exactly the rightmost ones."""
    import types

    from cutedsl_attn.common import masks

    monkeypatch.setattr(masks, "cutlass", types.SimpleNamespace(min=min, max=max))
    for tile_n in (64, 128, 176):
        for kv_len in (1, 100, 176, 177, 1000):
            n_all = -(-kv_len // tile_n)
            for pos_first in (-300, -1, 0, 63, 175, 176, 500, kv_len - 1):
                for causal in (False, True):
                    for blk_lo in range(0, n_all):
                        for n_blk in range(0, n_all - blk_lo + 1):
                            need = [(n * tile_n + tile_n > kv_len) or (causal and n * tile_n + tile_n - 1 > pos_first)
                                    for n in range(blk_lo + n_blk - 1, blk_lo - 1, -1)]  # right to left
                            k = sum(need)
                            assert need == [True] * k + [False] * (n_blk - k)
                            assert masks.num_right_masked(blk_lo, n_blk, kv_len, pos_first, tile_n,
                                                          causal=causal) == k
