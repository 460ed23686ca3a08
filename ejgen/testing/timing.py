"""One way to time a jitted call, shared by `ejgen tune`, the benchmarks and the demo."""

from __future__ import annotations

import statistics
import time


def median_seconds(fn, args, reps: int = 10, warmup: int = 2, warm_seconds: float = 0.3, batch: int = 1) -> float:
    """Median wall seconds of ``fn(*args)`` over ``reps`` samples, after ``warmup`` calls (the first one
    compiles) and at least ``warm_seconds`` of calls that are not counted: a GPU left idle by a compile
    runs at low clocks, and a few milliseconds of work do not bring them back up. A sample is
    ``batch`` calls dispatched back to back and waited for once, divided by ``batch``: the device runs
    them without gaps, and the host's wake-up after each wait stops counting once per call."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    if jax.default_backend() == "cpu":  # no clocks to bring up (and interpreted kernels are slow)
        warm_seconds = 0.0
    t_end = time.perf_counter() + warm_seconds
    while time.perf_counter() < t_end:
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(batch)]
        jax.block_until_ready(outs)
        samples.append((time.perf_counter() - t0) / batch)
        del outs  # not alive while the next sample runs
    return statistics.median(samples)
