"""Attention benchmark: ejgen against cuDNN, JAX's Pallas-Triton `mha` and XLA, in one process.

    python benchmarks/attention.py [--quick] [--out DIR]

bf16, [B, S, H, D] with B*S = 32k tokens, H = 16; forward and forward+backward; causal and not;
ejgen with the default settings and with deterministic=True (docs/DESIGN.md §6);
plus a sliding-window case (S = 16k, window (1024, 0)). FLOPs as FlashAttention counts them
(docs/DESIGN.md §8): forward 4*B*H*Sq*Sk*D over visible pairs, backward 2.5x forward. Prints a table
(TFLOP/s, ratio to cuDNN; every impl compiled first, then timed in interleaved rounds), writes results.json, results.md and a PNG plot to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ejgen.ops import flash_attention
from ejgen.testing.timing import median_seconds

TOKENS = 32768
HEADS = 16


def _visible_pairs(s: int, causal: bool, window) -> int:
    i = np.arange(s)
    lo = np.zeros(s, np.int64) if window is None else np.maximum(i - window[0], 0)
    hi = i if causal else (np.full(s, s - 1) if window is None else np.minimum(i + window[1], s - 1))
    return int(np.sum(hi - lo + 1))


def _impls(causal: bool, window):
    impls = {
        "ejgen-triton": lambda q, k, v: flash_attention(q, k, v, causal=causal, sliding_window=window, platform="triton"),
        # deterministic=True: bitwise-reproducible gradients (on Hopper the backward leaves the Gluon set)
        "ejgen-triton-det": lambda q, k, v: flash_attention(q, k, v, causal=causal, sliding_window=window,
                                                            platform="triton", deterministic=True),
        "ejgen-pallas": lambda q, k, v: flash_attention(q, k, v, causal=causal, sliding_window=window, platform="pallas"),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, local_window_size=window, implementation="cudnn"),
    }
    if window is None:
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention

        impls["pallas-mha"] = lambda q, k, v: pallas_attention.mha(q, k, v, segment_ids=None, causal=causal)
        impls["xla"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
    return impls


def run_case(s, d, causal, window, reps, only=None, rounds=5, batch=4):
    """Every impl is compiled first, then timed in `rounds` interleaved rounds (each impl and pass in
    turn, `reps` samples of `batch` calls dispatched back to back): clock or thermal drift over the
    case touches every impl alike. A row's
    time is the median over its rounds; `ms_rounds` keeps each round's median (ratio spreads)."""
    b = TOKENS // s
    keys = jax.random.split(jax.random.PRNGKey(s * 7 + d), 4)
    q, k, v = (jax.random.normal(kk, (b, s, HEADS, d), jnp.bfloat16) for kk in keys[:3])
    do = jax.random.normal(keys[3], (b, s, HEADS, d), jnp.bfloat16)
    flops_fwd = 4.0 * b * HEADS * d * _visible_pairs(s, causal, window)
    base = dict(s=s, d=d, causal=causal, window=window)
    compiled, rows = [], []
    for name, f in _impls(causal, window).items():
        if only and name not in only:
            continue

        def loss(q, k, v, f=f):
            return jnp.sum(f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

        for pass_, fn, flops in (("fwd", f, flops_fwd), ("fwd+bwd", jax.grad(loss, argnums=(0, 1, 2)), 3.5 * flops_fwd)):
            try:
                exe = jax.jit(fn).lower(q, k, v).compile()
                jax.block_until_ready(exe(q, k, v))
                compiled.append((dict(base, impl=name, pass_=pass_), exe, flops))
            except Exception as e:  # an impl that cannot run this case is reported, not hidden
                msg = str(e).splitlines()[0][:80] if str(e) else type(e).__name__
                rows.append(dict(base, impl=name, pass_=pass_, ms=None, tflops=None, error=msg))
    times, errors = [[] for _ in compiled], [None for _ in compiled]
    for r in range(rounds):
        for i, (_, exe, _) in enumerate(compiled):
            if errors[i] is not None:
                continue
            try:
                times[i].append(median_seconds(exe, (q, k, v), reps, warmup=1, warm_seconds=0.3 if r == 0 else 0.05,
                                               batch=batch))
            except Exception as e:  # e.g. out of memory with `batch` calls in flight: reported, the rest go on
                errors[i] = str(e).splitlines()[0][:80] if str(e) else type(e).__name__
    for (row, _, flops), t, err in zip(compiled, times, errors):
        if err is not None:
            rows.append(dict(row, ms=None, tflops=None, error=err))
            continue
        sec = float(np.median(t))
        rows.append(dict(row, ms=sec * 1e3, tflops=flops / sec / 1e12, ms_rounds=[x * 1e3 for x in t]))
    order = {name: i for i, name in enumerate(_impls(causal, window))}
    return sorted(rows, key=lambda r: (order[r["impl"]], r["pass_"] != "fwd"))


def table(rows) -> str:
    """ms and TFLOP/s: medians over the rounds; x cuDNN: the ratio of the medians, and in brackets the
    lowest and highest ratio of one round's times (the same round's cuDNN)."""
    cudnn = {(r["s"], r["d"], r["causal"], str(r["window"]), r["pass_"]): r for r in rows if r["impl"] == "cudnn"}
    lines = ["| S | D | causal | window | pass | impl | ms | TFLOP/s | x cuDNN (rounds) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = cudnn.get((r["s"], r["d"], r["causal"], str(r["window"]), r["pass_"]))
        ms = f"{r['ms']:.3f}" if r["ms"] else "—"
        tf = f"{r['tflops']:.0f}" if r["tflops"] else r.get("error", "—")
        ratio = "—"
        if r["tflops"] and ref and ref["tflops"]:
            ratio = f"{r['tflops'] / ref['tflops']:.2f}"
            per_round = [c / x for c, x in zip(ref.get("ms_rounds", []), r.get("ms_rounds", []))]
            if len(per_round) > 1 and r["impl"] != "cudnn":
                ratio += f" ({min(per_round):.2f}–{max(per_round):.2f})"
        win = "" if r["window"] is None else f"{r['window'][0]},{r['window'][1]}"
        lines.append(f"| {r['s']} | {r['d']} | {int(r['causal'])} | {win} | {r['pass_']} | {r['impl']} | {ms} | {tf} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="head dim 128, S 4k and 16k, and the window case")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--reps", type=int, default=5, help="timed samples per impl and pass in each round")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per case (median reported)")
    p.add_argument("--batch", type=int, default=4, help="calls dispatched back to back per timed sample")
    p.add_argument("--impls", default="", help="comma-separated subset, e.g. ejgen-triton,cudnn (default: all)")
    p.add_argument("--dims", default="", help="head dims, e.g. 64 (default: 64,128; --quick: 128)")
    p.add_argument("--seqs", default="", help="sequence lengths, e.g. 1024,2048 (default: 1k-16k; --quick: 4k,16k)")
    p.add_argument("--no-window", action="store_true", help="leave out the sliding-window case")
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("benchmarks/attention.py needs an NVIDIA GPU", file=sys.stderr)
        return 2
    only = set(filter(None, args.impls.split(",")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0].device_kind
    seqs = (4096, 16384) if args.quick else (1024, 2048, 4096, 8192, 16384)
    dims = (128,) if args.quick else (64, 128)
    seqs = tuple(int(x) for x in args.seqs.split(",")) if args.seqs else seqs
    dims = tuple(int(x) for x in args.dims.split(",")) if args.dims else dims
    rows = []
    for d in dims:
        for s in seqs:
            for causal in (False, True):
                rows += run_case(s, d, causal, None, args.reps, only, args.rounds, args.batch)
                print(table(rows[-2 * (len(only) or len(_impls(causal, None))):]).split("\n", 2)[2], flush=True)
    if not args.no_window:
        rows += run_case(16384, 128, True, (1024, 0), args.reps, only, args.rounds, args.batch)
    text = f"Device: {device}; jax {jax.__version__}; bf16, B*S = {TOKENS}, H = {HEADS}\n\n{table(rows)}\n"
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(dict(device=device, rows=rows), indent=1))
    try:
        import plot  # benchmarks/plot.py: the same figure as BENCHMARKS.md's, from this run

        plot.plot(plot.from_results_json(out / "results.json"), out / "attention.png")
    except ImportError as e:
        print(f"no plot: {e}", file=sys.stderr)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
