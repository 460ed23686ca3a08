"""Pooling on one GPU (issue 18 item 6, docs/DESIGN.md §3 pooling): ejgen's pooling ops on the platforms triton,
pallas and xla against XLA's own `jnp.mean` (dense) and `jax.ops.segment_sum` (packed), next to the card's
streaming bandwidth measured in the same run. A bandwidth-bound op: every impl is reported in GB/s of x read and y
written, and as a share of the streaming bandwidth.

Cases (bf16 unless named): `dense-B32-S8k-D4k` (x [32, 8192, 4096], 2 GiB: the issue's dense target),
`packed-T256k-D4k` (the same 262144 tokens in 32 sequences of seeded random lengths, two of them empty: the
packed target), `dense-B1-S32k-D4k` (one long sequence: the split over the sequence), `dense-B64-S512-D1k` (short
sequences), `packed-N4096-D1k` (4096 sequences of 1..127 tokens), `weighted-T256k-D4k` (weighted_mean_pooling with
weights and a mask), `max-B32-S8k-D4k` (max_pooling), `bwd-B32-S8k-D4k` (the gradient of mean_pooling against
`jax.grad` of `jnp.mean`: dx written, dy read).

Run on the GPU host from the repository root (jax-triton from a wheel in .whl if it is not installed):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/jax_triton-0.3.1-py3-none-any.whl;
    PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 benchmarks/pooling.py --out $OUT/pooling

(about a minute on an H100, compiles included). Prints the device, the streaming bandwidth, a line per case, then a
markdown table and the issue's targets; writes `<out>/pooling.json` and `<out>/pooling.md`. Without a GPU,
`python benchmarks/pooling.py --cpu-smoke` runs tiny shapes on XLA and Triton's interpreter.

Columns: us (median of `--rounds` interleaved rounds, each the median of `--reps` samples of 8 calls back to back);
GB/s (bytes of x read + y written (bwd: dy read + dx written) / time); %stream (over the larger of a jitted bf16
copy, read + write, and a jitted sum, read, of a 2 GiB array); vs peer (the peer's time / this one's: > 1 faster);
max|d| (max abs difference from a float32 reference, FLAG past 2e-2).
Targets: dense-B32-S8k-D4k ejgen-triton >= 1.0x jnp.mean and >= 85 %stream; packed-T256k-D4k ejgen-triton >= 5x
segment_sum and >= 80 %stream.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-out/pooling")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cases", default="", help="comma-separated substrings of case names (default: all)")
    p.add_argument("--impls", default="", help="comma-separated substrings of impl names (default: all)")
    p.add_argument("--stream-gib", type=float, default=2.0)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes: XLA and Triton's interpreter")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.cpu_smoke:  # before triton, jax and the kernels are imported
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's ejgen, run from anywhere

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ejgen.generated import max_pooling, mean_pooling, weighted_mean_pooling  # noqa: E402
from ejgen.testing.timing import median_seconds  # noqa: E402

TOL = 2e-2
PLATFORMS = ("triton", "pallas", "xla")


def lengths(total: int, n: int, seed: int, empty: int = 2) -> np.ndarray:
    """n seeded random lengths summing to total, `empty` of them 0."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, total), n - empty - 1, replace=False))
    lens = np.diff(np.concatenate([[0], cuts, [total]]))
    return rng.permutation(np.concatenate([lens, np.zeros(empty, np.int64)])).astype(np.int32)


def make_cases(smoke: bool):
    """(name, kind, shape: dense (B, S, D) / packed (T, D), lengths or None)."""
    if smoke:
        return [("dense-B2-S64-D32", "mean", (2, 64, 32), None),
                ("packed-T128-D32", "mean", (128, 32), lengths(128, 6, 1)),
                ("weighted-T128-D32", "weighted", (128, 32), lengths(128, 6, 2)),
                ("max-B2-S64-D32", "max", (2, 64, 32), None),
                ("bwd-B2-S64-D32", "bwd", (2, 64, 32), None)]
    t = 32 * 8192
    return [("dense-B32-S8k-D4k", "mean", (32, 8192, 4096), None),
            ("packed-T256k-D4k", "mean", (t, 4096), lengths(t, 32, 1)),
            ("dense-B1-S32k-D4k", "mean", (1, 32768, 4096), None),
            ("dense-B64-S512-D1k", "mean", (64, 512, 1024), None),
            ("packed-N4096-D1k", "mean", (int(np.sum(lengths(4096 * 64, 4096, 3))), 1024), lengths(4096 * 64, 4096, 3)),
            ("weighted-T256k-D4k", "weighted", (t, 4096), lengths(t, 32, 2)),
            ("max-B32-S8k-D4k", "max", (32, 8192, 4096), None),
            ("bwd-B32-S8k-D4k", "bwd", (32, 8192, 4096), None)]


def stream_bandwidth(gib: float, reps: int) -> dict:
    """GB/s of a jitted bf16 copy (x + 1: read + write) and of a jitted sum (read) of a `gib` GiB array."""
    n = int(gib * 2 ** 30) // 2
    x = jax.random.normal(jax.random.PRNGKey(7), (n,), jnp.bfloat16)
    res = {}
    for name, fn, nbytes in (("copy", lambda x: x + jnp.bfloat16(1), 4 * n),
                             ("sum", lambda x: jnp.sum(x, dtype=jnp.float32), 2 * n)):
        exe = jax.jit(fn).lower(x).compile()
        sec = statistics.median(median_seconds(exe, (x,), reps, batch=8) for _ in range(3))
        res[f"{name}_gbs"] = nbytes / sec / 1e9
    res["gbs"] = max(res["copy_gbs"], res["sum_gbs"])
    return res


def impls(kind: str, x, lens):
    """{name: (jitted fn, args)} of a case; the first entry is the float32 reference, the second the peer."""
    packed = lens is not None
    cu = None if not packed else jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    f32 = jnp.float32
    out = {}
    if kind == "bwd":
        dy = jnp.ones((x.shape[0], x.shape[-1]), x.dtype)
        ref = lambda x, dy: jnp.broadcast_to(dy.astype(f32)[:, None] / x.shape[1], x.shape)  # noqa: E731
        out["reference"] = (jax.jit(ref), (x, dy))
        out["jnp.mean"] = (jax.jit(lambda x, dy: jax.vjp(lambda x: jnp.mean(x, axis=1), x)[1](dy)[0]), (x, dy))
        for p in PLATFORMS:
            grad = lambda x, dy, p=p: jax.vjp(lambda x: mean_pooling(x, platform=p), x)[1](dy)[0]  # noqa: E731
            out[f"ejgen-{p}"] = (jax.jit(grad), (x, dy))
        return out
    if kind == "max":
        out["reference"] = (jax.jit(lambda x: jnp.max(x.astype(f32), axis=1)), (x,))
        out["jnp.max"] = (jax.jit(lambda x: jnp.max(x, axis=1)), (x,))
        for p in PLATFORMS:
            out[f"ejgen-{p}"] = (jax.jit(lambda x, p=p: max_pooling(x, platform=p)), (x,))
        return out
    if kind == "weighted":
        rng = np.random.default_rng(5)
        w = jnp.asarray(rng.uniform(0.5, 2.0, x.shape[0]), f32)
        mask = jnp.asarray(rng.uniform(size=x.shape[0]) > 0.1)
        seg = jnp.asarray(np.repeat(np.arange(len(lens)), lens), jnp.int32)
        n = len(lens)

        def reference(x, w, mask):
            ww = jnp.where(mask, w, 0.0)
            num = jax.ops.segment_sum(x.astype(f32) * ww[:, None], seg, n)
            den = jax.ops.segment_sum(ww, seg, n)
            return num / jnp.where(den == 0, 1.0, den)[:, None]

        out["reference"] = (jax.jit(reference), (x, w, mask))
        def peer(x, w, mask):  # the weighted mean as XLA's segment ops give it
            ww = jnp.where(mask, w, 0.0)
            num = jax.ops.segment_sum(x * ww.astype(x.dtype)[:, None], seg, n, indices_are_sorted=True)
            den = jax.ops.segment_sum(ww, seg, n, indices_are_sorted=True)
            return num / jnp.where(den == 0, 1.0, den).astype(x.dtype)[:, None]

        out["segment_sum"] = (jax.jit(peer), (x, w, mask))
        for p in PLATFORMS:
            out[f"ejgen-{p}"] = (jax.jit(lambda x, w, mask, p=p: weighted_mean_pooling(
                x, 32, cu, weights=w, mask=mask, platform=p)), (x, w, mask))
        return out
    if packed:
        seg = jnp.asarray(np.repeat(np.arange(len(lens)), lens), jnp.int32)
        n = len(lens)
        counts = jnp.asarray(np.maximum(lens, 1), f32)
        out["reference"] = (jax.jit(lambda x: jax.ops.segment_sum(x.astype(f32), seg, n) / counts[:, None]), (x,))
        out["segment_sum"] = (jax.jit(lambda x: jax.ops.segment_sum(x, seg, n, indices_are_sorted=True)
                                      / counts.astype(x.dtype)[:, None]), (x,))  # the mean by XLA's segment sum
        for p in PLATFORMS:
            out[f"ejgen-{p}"] = (jax.jit(lambda x, p=p: mean_pooling(x, 32, cu, platform=p)), (x,))
        return out
    out["reference"] = (jax.jit(lambda x: jnp.mean(x.astype(f32), axis=1)), (x,))
    out["jnp.mean"] = (jax.jit(lambda x: jnp.mean(x, axis=1)), (x,))
    for p in PLATFORMS:
        out[f"ejgen-{p}"] = (jax.jit(lambda x, p=p: mean_pooling(x, platform=p)), (x,))
    return out


def run_case(name, kind, shape, lens, args, stream):
    x = jax.random.normal(jax.random.PRNGKey(hash(name) % 2 ** 31), shape, jnp.bfloat16)
    n_out = (shape[0] if lens is None else len(lens)) * shape[-1] * 2
    nbytes = x.size * 2 + n_out + (x.shape[0] * 5 if kind == "weighted" else 0)
    everything = impls(kind, x, lens)
    toks = [t for t in args.impls.split(",") if t]
    names = [n for n in everything if n == "reference" or not toks or any(t in n for t in toks)]
    ref, compiled, rows = None, {}, []
    for impl in names:
        fn, fargs = everything[impl]
        row = dict(case=name, impl=impl, us=None, gbs=None, stream=None, vs_peer=None, max_abs_diff=None, error="")
        try:
            t0 = time.perf_counter()
            exe = fn.lower(*fargs).compile()
            out = np.asarray(jnp.asarray(exe(*fargs), jnp.float32))
            row["compile_s"] = time.perf_counter() - t0
            if impl == "reference":
                ref = out
                continue
            row["max_abs_diff"] = float(np.max(np.abs(out - ref))) if ref is not None else None
            compiled[impl] = (exe, fargs)
        except Exception as e:  # noqa: BLE001 - record and go on with the other impls
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            traceback.print_exc(limit=3)
        rows.append(row)
    times = {impl: [] for impl in compiled}
    for r in range(args.rounds):
        for impl, (exe, fargs) in compiled.items():
            times[impl].append(median_seconds(exe, fargs, args.reps, warm_seconds=0.3 if r == 0 else 0.05, batch=8))
    peer = next((n for n in names[1:2]), None)
    for row in rows:
        if row["impl"] in times:
            sec = statistics.median(times[row["impl"]])
            row.update(us=sec * 1e6, gbs=nbytes / sec / 1e9, stream=100 * nbytes / sec / 1e9 / stream["gbs"])
            if peer in times:
                row["vs_peer"] = statistics.median(times[peer]) / sec
    return rows


def table(rows) -> str:
    lines = ["| case | impl | us | GB/s | %stream | vs peer | max abs diff | error |", "|" + "---|" * 8]
    fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        flag = " FLAG" if (r["max_abs_diff"] or 0) > TOL else ""
        lines.append(f"| {r['case']} | {r['impl']} | {fmt(r['us'], '.1f')} | {fmt(r['gbs'], '.0f')} | "
                     f"{fmt(r['stream'], '.1f')} | {fmt(r['vs_peer'], '.2f')} | "
                     f"{fmt(r['max_abs_diff'], '.3g')}{flag} | {r['error']} |")
    return "\n".join(lines)


def targets(rows) -> list[str]:
    get = lambda case, impl: next((r for r in rows if r["case"] == case and r["impl"] == impl), None)  # noqa: E731
    out = []
    for case, peer_min, stream_min in (("dense-B32-S8k-D4k", 1.0, 85.0), ("packed-T256k-D4k", 5.0, 80.0)):
        r = get(case, "ejgen-triton")
        if r is None or r["us"] is None:
            out.append(f"{case}: not measured")
            continue
        ok = (r["vs_peer"] or 0) >= peer_min and r["stream"] >= stream_min
        out.append(f"{case}: ejgen-triton {r['vs_peer']:.2f}x the peer (>= {peer_min}), {r['stream']:.1f} %stream "
                   f"(>= {stream_min}): {'MET' if ok else 'NOT MET'}")
    return out


def main(args) -> int:
    smoke = args.cpu_smoke
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}", flush=True)
    stream = stream_bandwidth(1 / 64 if smoke else args.stream_gib, 2 if smoke else args.reps)
    print(f"streaming bandwidth: copy {stream['copy_gbs']:.0f} GB/s, sum {stream['sum_gbs']:.0f} GB/s; reference "
          f"{stream['gbs']:.0f} GB/s", flush=True)
    rows = []
    for name, kind, shape, lens in make_cases(smoke):
        if args.cases and not any(t in name for t in args.cases.split(",")):
            continue
        t0 = time.perf_counter()
        case_rows = run_case(name, kind, shape, lens, args, stream)
        rows += case_rows
        print(f"{name} ({time.perf_counter() - t0:.1f}s): " + ", ".join(
            f"{r['impl']} {r['us']:.1f}us" if r["us"] else f"{r['impl']} n/a" for r in case_rows), flush=True)
    text = table(rows)
    goals = targets(rows)
    print(text)
    print("\n".join(goals))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pooling.json").write_text(json.dumps({"device": device.device_kind, "stream": stream, "rows": rows},
                                                 indent=1))
    (out / "pooling.md").write_text(f"device: {device.device_kind}, stream {stream['gbs']:.0f} GB/s\n\n{text}\n\n"
                                    + "\n".join(goals) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
