"""One way to time a jitted call, shared by `ejgen tune`, the benchmarks and the demo."""

from __future__ import annotations

import statistics
import time


def median_seconds(fn, args, reps: int = 10, warmup: int = 2, warm_seconds: float = 0.3) -> float:
    """Median wall seconds of ``fn(*args)`` over ``reps`` calls, after ``warmup`` calls (the first one
    compiles) and at least ``warm_seconds`` of calls that are not counted: a GPU left idle by a compile
    runs at low clocks, and a few milliseconds of work do not bring them back up."""
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
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)
