"""cutedsl_attn.timing's interleaving (no GPU: the timer's call is replaced by a recorder that returns a time per
variant and round, as a drifting GPU would)."""

import pytest

from cutedsl_attn.timing import KernelTimer, paired_ratio


class _FakeTimer(KernelTimer):
    """Times a variant as ``base[name] * drift(call index)`` and records the call order."""

    def __init__(self, base):
        super().__init__(device="cpu")
        self.base, self.order = base, []

    def __call__(self, fn, reps=20, sleep_cycles=None):
        name = fn()
        self.order.append((name, reps))
        return self.base[name] * (1.0 + 0.05 * len(self.order))  # the GPU slows down call after call


def test_interleaved_round_robin_and_paired_ratio():
    t = _FakeTimer({"ours": 1.0, "fa4": 1.1, "fi": 1.3})
    fns = {k: (lambda k=k: k) for k in ("ours", "fa4", "fi")}
    per_call = t.interleaved(fns, rounds=4, calls=2)
    # every variant `calls` times per round, the order reversed every other round, each call timed on its own
    assert [n for n, _ in t.order] == [n for n in ["ours", "fa4", "fi", "fi", "fa4", "ours"] * 2 for _ in (0, 1)]
    assert all(r == 1 for _, r in t.order)
    assert {k: [len(c) for c in v] for k, v in per_call.items()} == {k: [2] * 4 for k in ("ours", "fa4", "fi")}
    series = {k: [sum(c) / len(c) for c in v] for k, v in per_call.items()}  # round medians (of two calls)
    # the drift (up to 60% over the run here) cancels in the paired ratios: within the drift of one round
    assert 1.1 * 0.9 < paired_ratio(series["fa4"], series["ours"]) < 1.1 * 1.1
    assert 1.3 * 0.9 < paired_ratio(series["fi"], series["ours"]) < 1.3 * 1.1
    assert paired_ratio([2.0, 4.0, 9.0], [1.0, 1.0, 3.0]) == 3.0  # median of 2, 4, 3
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        t.interleaved(fns, rounds=0)
    with pytest.raises(ValueError, match="equally long, non-empty"):
        paired_ratio([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="equally long, non-empty"):
        paired_ratio([], [])
