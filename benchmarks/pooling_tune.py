"""Sweep the pooling Triton kernels' launch settings (`ejgen.runtime.pooling.triton.host`: bytes of x a program
loads per step, warps, pipeline stages, tokens per work item) on the issue's two target shapes, against
`jnp.mean` / the segment-sum mean in the same process. Prints one line per setting, fastest first per case.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/pooling_tune.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pooling import lengths  # noqa: E402
from ejgen.generated import mean_pooling  # noqa: E402
from ejgen.runtime.pooling.triton import host  # noqa: E402
from ejgen.testing.timing import median_seconds  # noqa: E402


def timed(fn, args, rounds=3):
    exe = jax.jit(fn).lower(*args).compile()
    return statistics.median(median_seconds(exe, args, 5, warm_seconds=0.2, batch=8) for _ in range(rounds))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    t = 32 * 8192
    lens = lengths(t, 32, 1)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    seg = jnp.asarray(np.repeat(np.arange(32), lens), jnp.int32)
    counts = jnp.asarray(np.maximum(lens, 1), jnp.float32)
    x = jax.random.normal(jax.random.PRNGKey(0), (32, 8192, 4096), jnp.bfloat16)
    xp = x.reshape(t, 4096)
    nbytes = x.size * 2
    base = {"dense": timed(lambda x: jnp.mean(x, axis=1), (x,)),
            "packed": timed(lambda x: jax.ops.segment_sum(x, seg, 32, indices_are_sorted=True)
                            / counts.astype(x.dtype)[:, None], (xp,))}
    print({k: f"{v * 1e6:.1f}us {nbytes / v / 1e9:.0f}GB/s" for k, v in base.items()}, flush=True)
    space = dict(whole=(2048, 4096), tile=(4096, 8192), programs=(1024, 2048, 4096), warps=(8,), evict=("evict_first",))
    if args.quick:
        space = dict(whole=(4096,), tile=(8192,), programs=(2048,), warps=(4, 8), evict=("", "evict_first"))
    results = {"dense": [], "packed": []}
    for conf in itertools.product(*space.values()):
        host.WHOLE_TILE_BYTES, host.TILE_BYTES, host.TARGET_PROGRAMS, host.NUM_WARPS, host.EVICT = conf
        text = ", ".join(f"{k}={v!r}" for k, v in zip(space, conf))
        for case, fn, arg in (("dense", lambda x: mean_pooling(x, platform="triton"), x),
                              ("packed", lambda x: mean_pooling(x, 32, cu, platform="triton"), xp)):
            try:
                sec = timed(fn, (arg,), rounds=1)
            except Exception as e:  # noqa: BLE001
                print(f"{case} {text}: {type(e).__name__} {str(e)[:120]}", flush=True)
                continue
            results[case].append((sec, text))
            print(f"{case} {text}: {sec * 1e6:.1f}us {nbytes / sec / 1e9:.0f}GB/s {base[case] / sec:.2f}x", flush=True)
    for case, rows in results.items():
        print(f"--- {case}, fastest first")
        for sec, text in sorted(rows)[:8]:
            print(f"{sec * 1e6:.1f}us {nbytes / sec / 1e9:.0f}GB/s {base[case] / sec:.2f}x  {text}")


if __name__ == "__main__":
    main()
