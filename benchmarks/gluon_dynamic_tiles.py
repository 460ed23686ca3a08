"""The Hopper forward's dynamic tile queue against its static split, one GPU (notes/gluon-persistent-fwd.md,
"Dynamic tile queue"; the setting gluon_dynamic_tiles, off by default until this is measured).

    python benchmarks/gluon_dynamic_tiles.py [--sms 116] [--reps 10] [--rounds 5]

Per case (bf16, D = 128, H = 16, B * S = 32k tokens as in benchmarks/attention.py; packed documents at B = 1): the
forward compiled with the setting off and on (it is read when the launch is traced), the outputs compared (a tile
computes the same whichever program takes it: out and lse must be bitwise equal), then both timed in interleaved
rounds (median of the rounds' medians, ms). ``--sms N``: a grid of N programs instead of one per SM (116: what is
left to the kernel when NCCL's kernel holds 16 SMs; the static split then gives every program its share of the
tiles at once, the queue gives them out as programs free up). Prints a table; no GPU: refuses.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

HEADS, DIM, TOKENS = 16, 128, 32768


def cases():
    """(name, seq, batch, causal, window, documents)."""
    return [("16k causal", 16384, 2, True, None, 0), ("4k causal", 4096, 8, True, None, 0),
            ("4k", 4096, 8, False, None, 0), ("16k window (1024, 0)", 16384, 2, True, (1024, 0), 0),
            ("8k, 8 documents", 8192, 1, True, None, 8), ("32k, 64 documents", 32768, 1, True, None, 64)]


def forward_fn(seq, batch, causal, window, docs, dynamic: bool):
    """A compiled forward (out, lse) and its arguments, the setting as given while it is traced."""
    sys.path.insert(0, "benchmarks")
    from blocksparse import document_ids

    from ejgen.ops import flash_attention, settings
    from ejgen.types import MaskInfo

    keys = jax.random.split(jax.random.PRNGKey(seq + docs), 3)
    q, k, v = (jax.random.normal(kk, (batch, seq, HEADS, DIM), jnp.bfloat16) for kk in keys)
    extra = {"mask_info": MaskInfo.from_segments(jnp.asarray(document_ids(seq, docs)))} if docs else {}

    def f(q, k, v):
        return flash_attention(q, k, v, causal=causal, sliding_window=window, platform="triton", return_lse=True,
                               **extra)

    with settings(gluon_dynamic_tiles=dynamic):
        exe = jax.jit(f).lower(q, k, v).compile()
    return exe, (q, k, v)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sms", type=int, default=0, help="programs of the persistent grid (default: one per SM)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--only", default="", help="comma-separated case names (default: all)")
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("no GPU: this benchmark times the Hopper kernels", file=sys.stderr)
        return 2
    from ejgen.runtime.attention.gluon import host
    from ejgen.testing.timing import median_seconds

    if args.sms:
        host.num_sms = lambda: args.sms  # the grid: min(programs, tiles)
    rows = []
    for name, seq, batch, causal, window, docs in cases():
        if args.only and name not in args.only.split(","):
            continue
        fns = {dyn: forward_fn(seq, batch, causal, window, docs, dyn) for dyn in (False, True)}
        outs = {dyn: jax.block_until_ready(exe(*a)) for dyn, (exe, a) in fns.items()}
        same = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(outs[False], outs[True]))
        times = {False: [], True: []}
        for _ in range(args.rounds):
            for dyn, (exe, a) in fns.items():
                times[dyn].append(median_seconds(exe, a, reps=args.reps, batch=4) * 1e3)
        static, dynamic = (statistics.median(times[d]) for d in (False, True))
        rows.append((name, static, dynamic, same))
        print(f"{name:24s} static {static:7.3f} ms  dynamic {dynamic:7.3f} ms  x{static / dynamic:5.3f}  "
              f"{'bitwise equal' if same else 'OUTPUTS DIFFER'}", flush=True)
    grid = f"{args.sms} programs" if args.sms else "one program per SM"
    print(f"\n| case ({jax.devices()[0].device_kind}, {grid}) | static ms | dynamic ms | static / dynamic | equal |")
    print("|---|---|---|---|---|")
    for name, static, dynamic, same in rows:
        print(f"| {name} | {static:.3f} | {dynamic:.3f} | {static / dynamic:.3f} | {same} |")
    return 0 if all(r[3] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
