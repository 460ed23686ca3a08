"""Cross-attention (Sq != Sk, no causal) on one GPU: the Hopper forward with its own key count (the gluon_cross
setting, docs/DESIGN.md settings) against the generated Triton kernels, and cuDNN, in one process on one card; each
call checked against the generated kernels' output first (max abs difference). bf16, D 128, forward (the backward
stays on the generated kernels either way).

    python3 benchmarks/cross.py [--cases 1x1024x8192x16,4x4096x1024x16] [--out DIR]

A case is BxSqxSkxH. Prints a table: ms per call (median of interleaved rounds, 4 calls a sample), TFLOP/s (4 B H
Sq Sk D), x generated, and the check; writes <out>/cross.json. On a CPU (`--cpu-smoke`) the plumbing runs on tiny
shapes in Triton's interpreter (the Hopper kernel does not run there: its rows read n/a).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="1x1024x8192x16,4x4096x1024x16,2x2048x16384x16")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="bench-out/cross")
    p.add_argument("--cpu-smoke", action="store_true")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.cpu_smoke:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ejgen.ops import flash_attention, settings  # noqa: E402
from ejgen.testing.timing import median_seconds  # noqa: E402

D = 128


def impls():
    def ejgen(cross: bool):
        def call(q, k, v):
            with settings(gluon_cross=cross):  # read as the call is traced
                return flash_attention(q, k, v, platform="triton")
        return call

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")

    return {"ejgen-generated": ejgen(False), "ejgen-gluon-cross": ejgen(True), "cudnn": cudnn}


def main() -> int:
    out_dir = Path(ARGS.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    d = 16 if ARGS.cpu_smoke else D
    rows = []
    print(f"{jax.devices()[0].device_kind}; bf16, D {d}, no causal", flush=True)
    for case in [c for c in ARGS.cases.split(",") if c]:
        b, sq, sk, h = (int(x) for x in case.split("x"))
        if ARGS.cpu_smoke:
            b, sq, sk, h = 1, 32, 80, 2
        keys = jax.random.split(jax.random.PRNGKey(sq * 7 + sk), 3)
        q = jax.random.normal(keys[0], (b, sq, h, d), jnp.bfloat16)
        k = jax.random.normal(keys[1], (b, sk, h, d), jnp.bfloat16)
        v = jax.random.normal(keys[2], (b, sk, h, d), jnp.bfloat16)
        compiled, ref = {}, None
        for name, fn in impls().items():
            try:
                exe = jax.jit(fn).lower(q, k, v).compile()
                out = exe(q, k, v).astype(jnp.float32)
            except Exception as e:  # noqa: BLE001 (cuDNN off a GPU, the Hopper kernel off sm_90)
                rows.append(dict(case=case, impl=name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"))
                continue
            ref = out if ref is None else ref
            compiled[name] = (exe, float(jnp.max(jnp.abs(out - ref))))
        times = {name: [] for name in compiled}
        for r in range(ARGS.rounds):
            for name, (exe, _) in compiled.items():
                times[name].append(median_seconds(exe, (q, k, v), ARGS.reps, warmup=1,
                                                  warm_seconds=0.3 if r == 0 else 0.05, batch=4))
        base = statistics.median(times["ejgen-generated"]) if "ejgen-generated" in times else None
        for name, (_, diff) in compiled.items():
            ms = statistics.median(times[name]) * 1e3
            row = dict(case=case, impl=name, ms=round(ms, 3), tflops=round(4 * b * h * sq * sk * d / ms / 1e9, 1),
                       max_diff=diff)
            if name.startswith("ejgen"):  # which forward kernel set the call took (gluon / triton)
                from ejgen.ops import explain

                with settings(gluon_cross=name.endswith("cross")):
                    row["forward"] = explain(flash_attention, q, k, v, platform="triton").forward
            if base:
                row["x_generated"] = round(base * 1e3 / ms, 2)
            rows.append(row)
            print(row, flush=True)
    lines = ["| case | impl | forward | ms | TFLOP/s | x generated | max diff vs generated | error |",
             "|---" * 8 + "|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['impl']} | {r.get('forward', '')} | {r.get('ms', '')} | "
                     f"{r.get('tflops', '')} | {r.get('x_generated', '')} | {r.get('max_diff', '')} | "
                     f"{r.get('error', '')} |")
    print("\n".join(lines), flush=True)
    (out_dir / "cross.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
