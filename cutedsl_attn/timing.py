"""GPU timing used by the benchmarks and the demo (L2 flushed, host launch excluded, median of the calls).

Before every timed call the L2 is flushed (a 512 MiB memset) and the GPU sleeps so
that the host has queued the call before it starts: CUDA events around the call then
measure the kernels, not the host launch cost.  The median of ``reps`` calls is
returned, in seconds.
"""

from __future__ import annotations

import statistics

import torch


class KernelTimer:
    """``timer(fn, reps=20) -> seconds``: median device time of ``fn()`` with a cold L2."""

    def __init__(self, device=None, sleep_cycles: int = 400_000):
        self.device = torch.device("cuda") if device is None else torch.device(device)
        self.sleep_cycles = sleep_cycles
        self._flush = None

    def __call__(self, fn, reps: int = 20, sleep_cycles: int | None = None) -> float:
        if self._flush is None:
            self._flush = torch.empty(512 << 20, dtype=torch.uint8, device=self.device)
        cycles = self.sleep_cycles if sleep_cycles is None else sleep_cycles
        fn()
        fn()
        torch.cuda.synchronize(self.device)
        ts = []
        for _ in range(reps):
            self._flush.zero_()
            torch.cuda._sleep(cycles)  # the host queues the whole call while the GPU sleeps
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize(self.device)
            ts.append(a.elapsed_time(b) * 1e-3)
        return statistics.median(ts)

    def interleaved(self, fns: dict, rounds: int, calls: int = 1) -> dict:
        """``{name: [[seconds of each call] for each round]}``: each round times every ``fns[name]`` ``calls``
        times (each call timed on its own, as :meth:`__call__` with one rep) one variant after the other, the
        order reversed every other round, so a drift of the GPU's speed during the run lands on every variant
        alike (a kernel's time can drift by several percent within a second, its peers' too).  Compare two
        variants' round medians with :func:`paired_ratio`."""
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        names = list(fns)
        out = {k: [] for k in names}
        for r in range(rounds):
            for k in names if r % 2 == 0 else names[::-1]:
                out[k].append([self(fns[k], reps=1) for _ in range(calls)])
        return out


def paired_ratio(a: list, b: list) -> float:
    """Median over rounds of ``a[i] / b[i]`` (two variants' times, e.g. round medians, from the same rounds of
    :meth:`KernelTimer.interleaved`): ``> 1`` means ``b`` was faster."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_ratio needs two equally long, non-empty series, got {len(a)} and {len(b)}")
    return statistics.median(x / y for x, y in zip(a, b))


def read_bandwidth(timer: KernelTimer, nbytes: int = 4 << 30) -> float:
    """Bytes/s of a plain device read (``x.sum()`` over ``nbytes`` of fp32): the decode ceiling."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=timer.device)
    t = timer(lambda: x.sum(), reps=10)
    del x
    torch.cuda.empty_cache()
    return nbytes / t


def copy_bandwidth(timer: KernelTimer, nbytes: int = 4 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=timer.device)
    y = torch.empty_like(x)
    t = timer(lambda: y.copy_(x), reps=10)
    del x, y
    torch.cuda.empty_cache()
    return 2 * nbytes / t
