"""CPU tests of ``packbits`` / ``segment_packbits`` (FlashInfer's ``flashinfer.quantization``).

Ground truth is ``numpy.packbits`` / ``numpy.unpackbits`` (the semantics FlashInfer documents),
in both bit orders, plus FlashInfer's own documented examples; a hypothesis property test
round-trips random segment layouts.  A CUDA run of the same checks happens when a GPU is present.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cutedsl_attn as ca
from cutedsl_attn.api.quantization import packbits, segment_packbits

ORDERS = ("big", "little")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def np_pack(x: torch.Tensor, order: str) -> np.ndarray:
    return np.packbits(x.cpu().numpy().astype(bool), bitorder=order)


def np_segment_pack(x: torch.Tensor, indptr, order: str):
    ptr = [int(v) for v in indptr]
    parts = [np_pack(x[a:b], order) for a, b in zip(ptr[:-1], ptr[1:])]
    new = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int32)
    y = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    return y.astype(np.uint8), new


def test_public_names():
    assert ca.packbits is packbits and ca.segment_packbits is segment_packbits
    assert "packbits" in ca.__all__ and "segment_packbits" in ca.__all__


def test_flashinfer_documented_examples():
    x = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1], dtype=torch.bool)
    assert list(map(bin, packbits(x).tolist())) == ["0b10110011"]  # default bitorder="big"
    x = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    y, new = segment_packbits(x, torch.tensor([0, 4, 7, 11]), bitorder="big")
    assert list(map(bin, y.tolist())) == ["0b10110000", "0b100000", "0b11010000"]
    assert new.tolist() == [0, 1, 2, 3] and new.dtype == torch.int32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 64, 333])
def test_packbits_matches_numpy(device, order, n):
    g = torch.Generator().manual_seed(n)
    x = (torch.rand(n, generator=g) > 0.5).to(device)
    y = packbits(x, order)
    assert y.dtype == torch.uint8 and y.device.type == device and y.shape == ((n + 7) // 8,)
    assert np.array_equal(y.cpu().numpy(), np_pack(x, order))
    back = np.unpackbits(y.cpu().numpy(), count=n, bitorder=order).astype(bool)
    assert np.array_equal(back, x.cpu().numpy())


def test_little_bit_layout_is_the_mask_layout():
    # prefill custom masks: element off lives in bit off % 8 of byte off // 8
    x = torch.zeros(21, dtype=torch.bool)
    x[[0, 9, 20]] = True
    y = packbits(x, "little")
    assert y.tolist() == [1, 2, 16]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.int8])
def test_integer_inputs_nonzero_is_one(dtype):
    x = torch.tensor([0, 2, -1, 0, 5, 0, 0, 1, 3], dtype=torch.int64).to(dtype)
    ref = x != 0
    for order in ORDERS:
        assert torch.equal(packbits(x, order), packbits(ref, order))
        assert np.array_equal(packbits(x, order).numpy(), np_pack(ref, order))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("seglens", [[], [0], [5], [4, 3, 4], [0, 8, 0, 9, 1], [16, 1, 0, 0, 31]])
def test_segment_packbits_matches_numpy(device, order, seglens):
    g = torch.Generator().manual_seed(sum(seglens) + len(seglens))
    indptr = torch.tensor([0] + np.cumsum(seglens).tolist(), dtype=torch.int32)
    x = (torch.rand(int(indptr[-1]), generator=g) > 0.5).to(device)
    y, new = segment_packbits(x, indptr, order)
    y_ref, new_ref = np_segment_pack(x, indptr.tolist(), order)
    assert y.device.type == device and y.dtype == torch.uint8
    assert np.array_equal(y.cpu().numpy(), y_ref)
    assert new.tolist() == new_ref.tolist() and new.dtype == torch.int32 and new.device == indptr.device
    assert all((b - a) == (n + 7) // 8 for a, b, n in zip(new.tolist()[:-1], new.tolist()[1:], seglens))


def test_segment_packbits_nonzero_first_offset():
    x = torch.tensor([1, 1, 1, 0, 1, 0, 1], dtype=torch.bool)
    y, new = segment_packbits(x, torch.tensor([2, 5, 7]), "little")  # x[0:2] is not part of any segment
    assert y.tolist() == [np_pack(x[2:5], "little")[0], np_pack(x[5:7], "little")[0]]
    assert new.tolist() == [0, 1, 2]


def test_segment_packbits_single_segment_equals_packbits():
    x = torch.rand(1001) > 0.3
    for order in ORDERS:
        y, new = segment_packbits(x, torch.tensor([0, 1001]), order)
        assert torch.equal(y, packbits(x, order)) and new.tolist() == [0, 126]


@settings(max_examples=200, deadline=None)
@given(seglens=st.lists(st.integers(0, 40), max_size=10), order=st.sampled_from(ORDERS), seed=st.integers(0, 2**16))
def test_property_segment_round_trip(seglens, order, seed):
    g = torch.Generator().manual_seed(seed)
    indptr = torch.tensor([0] + np.cumsum(seglens, dtype=np.int64).tolist(), dtype=torch.int64)
    x = torch.rand(int(indptr[-1]), generator=g) > 0.5
    y, new = segment_packbits(x, indptr, order)
    ptr = new.tolist()
    yn = y.numpy()
    for i, n in enumerate(seglens):
        seg = np.unpackbits(yn[ptr[i]:ptr[i + 1]], count=n, bitorder=order).astype(bool)
        assert np.array_equal(seg, x[int(indptr[i]):int(indptr[i + 1])].numpy())
        # padding bits of each segment's last byte are zero
        full = np.unpackbits(yn[ptr[i]:ptr[i + 1]], bitorder=order)
        assert not full[n:].any()


@settings(max_examples=200, deadline=None)
@given(bits=st.lists(st.booleans(), max_size=100), order=st.sampled_from(ORDERS))
def test_property_packbits_round_trip(bits, order):
    x = torch.tensor(bits, dtype=torch.bool)
    y = packbits(x, order)
    assert np.array_equal(y.numpy(), np.packbits(np.array(bits, dtype=bool), bitorder=order))
    assert np.unpackbits(y.numpy(), count=len(bits), bitorder=order).astype(bool).tolist() == bits


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("x,exc,match", [
    ([1, 0, 1], TypeError, "x"),
    (torch.tensor([0.0, 1.0]), TypeError, "x"),
    (torch.ones(2, 3, dtype=torch.bool), ValueError, "x"),
    (torch.tensor(True), ValueError, "x"),
])
def test_packbits_bad_input(x, exc, match):
    with pytest.raises(exc, match=match):
        packbits(x)


@pytest.mark.parametrize("order", ["BIG", "msb", "", None])
def test_bad_bitorder(order):
    with pytest.raises(ValueError, match="bitorder"):
        packbits(torch.ones(3, dtype=torch.bool), order)
    with pytest.raises(ValueError, match="bitorder"):
        segment_packbits(torch.ones(3, dtype=torch.bool), torch.tensor([0, 3]), order)


@pytest.mark.parametrize("indptr,exc,match", [
    ([0, 3], TypeError, "indptr"),
    (torch.tensor([0.0, 3.0]), TypeError, "indptr"),
    (torch.tensor([True, False]), TypeError, "indptr"),
    (torch.tensor([[0, 3]]), ValueError, "indptr"),
    (torch.tensor([], dtype=torch.int32), ValueError, "indptr"),
    (torch.tensor([0, 2, 1, 3]), ValueError, "non-decreasing"),
    (torch.tensor([-1, 3]), ValueError, r"indptr\[0\]"),
    (torch.tensor([0, 2]), ValueError, r"indptr\[-1\]"),
    (torch.tensor([0, 4]), ValueError, r"indptr\[-1\]"),
])
def test_segment_packbits_bad_indptr(indptr, exc, match):
    with pytest.raises(exc, match=match):
        segment_packbits(torch.ones(3, dtype=torch.bool), indptr)


def test_segment_packbits_bad_x():
    with pytest.raises(TypeError, match="x"):
        segment_packbits(torch.ones(3), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="x"):
        segment_packbits(torch.ones(1, 3, dtype=torch.bool), torch.tensor([0, 3]))
