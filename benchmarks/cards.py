"""One GPU's causal attention on each card of the host, in turns: whether the cards of one host run the same work at
the same speed under a sustained load (issue 18's ring runs at the pace of its slower card; its one-GPU baseline is
card 0). For each round, the forward (and forward+backward) of S tokens on card 0, then card 1, ...; a row is a
card's median over rounds of the medians of --reps samples of --batch calls.

    python3 benchmarks/cards.py --seq 32768 --heads 16 --batch 16 --rounds 5
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--passes", default="fwd,fwdbwd")
    p.add_argument("--batch", type=int, default=16, help="calls a sample, dispatched back to back")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--platform", default="triton", help="xla for a smoke run on a CPU")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from ejgen.ops import flash_attention
    from ejgen.testing.timing import median_seconds

    cards = jax.devices()
    fn = lambda q, k, v: flash_attention(q, k, v, causal=True, platform=args.platform)  # noqa: E731
    passes = {"fwd": jax.jit(fn),
              "fwdbwd": jax.jit(lambda q, k, v: jax.grad(lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum(),
                                                         argnums=(0, 1, 2))(q, k, v))}
    shape = (1, args.seq, args.heads, args.dim)
    inputs = []
    for i, card in enumerate(cards):
        keys = jax.random.split(jax.random.key(i), 3)
        inputs.append([jax.device_put(jax.random.normal(key, shape, jnp.bfloat16), card) for key in keys])
    times = {(c, p): [] for c in range(len(cards)) for p in args.passes.split(",")}
    for r in range(args.rounds):
        for (c, pass_), got in times.items():
            got.append(median_seconds(passes[pass_], inputs[c], reps=args.reps, batch=args.batch) * 1e3)
            print(f"round {r} card {c} {pass_}: {got[-1]:.3f} ms", flush=True)
    print(f"\n| card | name | pass | ms (median of {args.rounds} rounds) | x card 0 | rounds |")
    print("|---|---|---|---|---|---|")
    for (c, pass_), got in times.items():
        ms, base = statistics.median(got), statistics.median(times[(0, pass_)])
        print(f"| {c} | {cards[c].device_kind} | {pass_} | {ms:.3f} | {base / ms:.3f} | "
              + " ".join(f"{t:.2f}" for t in got) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
