"""The linear recurrent family on one GPU (issue 17 item 5, docs/DESIGN.md §3 linear recurrent): ejgen's gla,
simple_gla and lightning_attention ops, forward and forward+backward, bf16, H = 16, K = V = 128, at B4 T4096 and
B2 T16384, next to flash-linear-attention's chunk_gla / fused_recurrent_gla / chunk_simple_gla timed in a process of
their own (`benchmarks/recurrent_fla.py`, torch: run it first on the same machine and pass its JSON with --fla).

Impls: `ejgen-triton` (algorithm chunked, chunks of 64), `ejgen-triton-fused` (the fused recurrence; forward only
at T4096, the fused kernels are for decoding and short sequences), `ejgen-xla` (`--xla`: the chunked jnp backend).
Every ejgen impl's forward is checked against the XLA backend in float32 on the same inputs (relative error of o and
the final state, their first 2^20 entries each; FLAG past 2e-2).

Run on the GPU host from the repository root (jax-triton and lark from wheels in .whl, see
/work/shared/tools/gpu-wheelhouse; fla's wheels likewise):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 benchmarks/recurrent_fla.py --out $OUT/fla.json
    PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 benchmarks/recurrent.py --fla $OUT/fla.json --out $OUT

Decode (`--decode`, the issue's bandwidth target): gla_decode, one step from a float32 state [B, 16, 128, 128] for
B = 32 and 128, on triton (the fused kernels), pallas and xla: GB/s of the state read and written (plus q, k, v, gk)
against the streaming bandwidth of a jitted copy in the same run.

Prints the device and a markdown table (ms: median of interleaved rounds; vs fla: fla's time / ejgen's, > 1 is
faster), and the issue's targets; writes `<out>/recurrent.json`. `--cpu-smoke` runs tiny shapes on XLA and Triton's
interpreter without a GPU.
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
    p.add_argument("--out", default="bench-out/recurrent")
    p.add_argument("--fla", default="", help="JSON written by benchmarks/recurrent_fla.py on the same machine")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cases", default="", help="comma-separated substrings of case names (default: all)")
    p.add_argument("--xla", action="store_true", help="also time the XLA backend")
    p.add_argument("--decode", action="store_true", help="also time one decode step against the streaming bandwidth")
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

from ejgen import generated  # noqa: E402
from ejgen.testing.timing import median_seconds  # noqa: E402

FLAG = 2e-2
# (case, op, gates, B, T, H, K, V); the names are those of benchmarks/recurrent_fla.py
SHAPES = {"B4-T4096": (4, 4096), "B2-T16384": (2, 16384)}
SMOKE = {"B1-T64": (1, 64)}


def cases(smoke: bool):
    shapes = SMOKE if smoke else SHAPES
    heads, dim = (2, 16) if smoke else (16, 128)
    out = []
    for label, (b, t) in shapes.items():
        for op, gates in (("gla", ("gk",)), ("simple_gla", ("g",)), ("lightning_attention", ("g_gamma",))):
            out.append((f"{op}-{label}", op, gates, b, t, heads, dim, dim))
    return out


def make_inputs(op, gates, b, t, h, k, v, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 8)
    q = jax.random.normal(keys[0], (b, t, h, k), jnp.bfloat16)
    kk = jax.random.normal(keys[1], (b, t, h, k), jnp.bfloat16)
    vv = jax.random.normal(keys[2], (b, t, h, v), jnp.bfloat16)
    g = {}
    if "gk" in gates:  # GLA's gates: logsigmoid(x) / 16
        g["gk"] = jax.nn.log_sigmoid(jax.random.normal(keys[3], (b, t, h, k), jnp.float32)) / 16
    if "g" in gates:
        g["g"] = jax.nn.log_sigmoid(jax.random.normal(keys[4], (b, t, h), jnp.float32)) / 16
    if "g_gamma" in gates:  # lightning's decays: -(8 / H) (h + 1) in log2, as fla's lightning_attn
        g["g_gamma"] = -(8.0 / h) * (jnp.arange(h, dtype=jnp.float32) + 1) * np.log(2.0) / 8
    do = jax.random.normal(keys[5], (b, t, h, v), jnp.bfloat16)
    return (q, kk, vv), g, do


def impls(op_name, args, gates, do, smoke):
    """{name: (fwd fn, fwd+bwd fn)} of a case."""
    op = getattr(generated, op_name)
    out = {}
    platforms = [("ejgen-triton", "triton", "chunked")]
    if args[0].shape[1] <= 4096:
        platforms.append(("ejgen-triton-fused", "triton", "fused"))
    if ARGS.xla or smoke:
        platforms.append(("ejgen-xla", "xla", "chunked"))
    for name, platform, algorithm in platforms:
        def fwd(q, k, v, g, platform=platform, algorithm=algorithm):
            return op(q, k, v, **g, platform=platform, algorithm=algorithm)

        def fwd_bwd(q, k, v, g, do, fwd=fwd):
            (o, ht), vjp = jax.vjp(fwd, q, k, v, g)
            return vjp((do, jnp.zeros_like(ht)))

        out[name] = (jax.jit(fwd), jax.jit(fwd_bwd))
    return out


def main():
    args = ARGS
    smoke = args.cpu_smoke
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    fla = json.loads(Path(args.fla).read_text()) if args.fla else {}
    device = jax.devices()[0].device_kind
    print(f"device: {device}; jax {jax.__version__}", flush=True)
    toks = [t for t in args.cases.split(",") if t]
    rows = []
    for case, op_name, gates, b, t, h, k, v in cases(smoke):
        if toks and not any(tok in case for tok in toks):
            continue
        (q, kk, vv), g, do = make_inputs(op_name, gates, b, t, h, k, v)
        fns = impls(op_name, (q, kk, vv), gates, do, smoke)
        ref = None
        timed = {}
        for name, (fwd, fwd_bwd) in fns.items():
            for pass_, fn, fargs in (("fwd", fwd, (q, kk, vv, g)), ("fwd+bwd", fwd_bwd, (q, kk, vv, g, do))):
                if name == "ejgen-triton-fused" and pass_ == "fwd+bwd":
                    continue
                row = dict(case=case, impl=name, pass_=pass_, ms=None, vs_fla=None, max_abs_diff=None, error="")
                try:
                    t0 = time.perf_counter()
                    exe = fn.lower(*fargs).compile()
                    res = jax.block_until_ready(exe(*fargs))
                    row["compile_s"] = time.perf_counter() - t0
                    if pass_ == "fwd":
                        o, ht = res
                        got = np.concatenate([np.asarray(o, np.float32).ravel()[:1 << 20],
                                              np.asarray(ht, np.float32).ravel()[:1 << 20]])
                        if ref is None:
                            ref = _reference(op_name, q, kk, vv, g)
                        row["max_abs_diff"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
                    timed[(name, pass_)] = (exe, fargs, row)
                except Exception as e:  # noqa: BLE001 - record and go on
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    traceback.print_exc(limit=3)
                rows.append(row)
        samples = {key: [] for key in timed}
        for _ in range(args.rounds):  # interleaved rounds
            for key, (exe, fargs, _) in timed.items():
                samples[key].append(median_seconds(exe, fargs, args.reps, batch=2 if not smoke else 1))
        for key, (_, _, row) in timed.items():
            row["ms"] = statistics.median(samples[key]) * 1e3
            peer = fla.get(f"{_fla_name(op_name)}|{case.split('-', 1)[1]}|{row['pass_']}")
            if peer and row["ms"]:
                row["vs_fla"] = peer / row["ms"]
            print(f"{case:28s} {row['impl']:20s} {row['pass_']:8s} {row['ms']:9.3f} ms"
                  + (f"  vs fla {row['vs_fla']:.2f}x" if row["vs_fla"] else ""), flush=True)
    (out_dir / "recurrent.json").write_text(json.dumps({"device": device, "rows": rows}, indent=1))
    print(f"\n{device}, bf16, H={16 if not smoke else 2}, K=V={128 if not smoke else 16}\n")
    print("| case | impl | pass | ms | fla ms | vs fla | rel err |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        peer = fla.get(f"{_fla_name(r['case'].rsplit('-', 2)[0])}|{r['case'].split('-', 1)[1]}|{r['pass_']}")
        diff = "" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}" + (" FLAG" if r["max_abs_diff"] > FLAG
                                                                                 else "")
        ms = f"{r['ms']:.3f}" if r["ms"] else r["error"][:60]
        peer_ms = "" if not peer else f"{peer:.3f}"
        ratio = "" if not r["vs_fla"] else f"{r['vs_fla']:.2f}x"
        print(f"| {r['case']} | {r['impl']} | {r['pass_']} | {ms} | {peer_ms} | {ratio} | {diff} |")
    for key in sorted(k for k in fla if "fused_recurrent" in k):
        print(f"fla {key}: {fla[key]:.3f} ms")
    print("\ntargets: gla chunked fwd and fwd+bwd vs fla chunk_gla >= 1.0x (stretch 1.5x); simple_gla / lightning "
          "vs fla chunk_simple_gla >= 1.0x")
    if args.decode or smoke:
        decode_table(smoke)


def stream_bandwidth(gib: float, reps: int) -> float:
    """GB/s of a jitted float32 copy (x + 1: read + write) of a `gib` GiB array."""
    n = int(gib * 2 ** 30) // 4
    x = jax.random.normal(jax.random.PRNGKey(7), (n,), jnp.float32)
    exe = jax.jit(lambda x: x + 1.0).lower(x).compile()
    return 8 * n / median_seconds(exe, (x,), reps, batch=8) / 1e9


def decode_table(smoke: bool):
    """One gla_decode step per call from a float32 state: GB/s of the bytes moved, against the streaming copy."""
    heads, dim = (2, 16) if smoke else (16, 128)
    stream = stream_bandwidth(0.01 if smoke else 2.0, ARGS.reps)
    print(f"\ndecode: streaming copy {stream:.0f} GB/s\n")
    print("| batch | impl | us | GB/s | % stream |")
    print("|---|---|---|---|---|")
    for b in ((2,) if smoke else (32, 128)):
        keys = jax.random.split(jax.random.PRNGKey(b), 5)
        q, k, v = (jax.random.normal(keys[i], (b, heads, dim), jnp.bfloat16) for i in range(3))
        gk = jax.nn.log_sigmoid(jax.random.normal(keys[3], (b, heads, dim), jnp.float32)) / 16
        state = jax.random.normal(keys[4], (b, heads, dim, dim), jnp.float32)
        nbytes = 2 * state.size * 4 + 3 * q.size * 2 + gk.size * 4 + b * heads * dim * 2
        for platform in ("triton", "pallas", "xla"):
            try:
                exe = jax.jit(lambda q, k, v, s, gk, p=platform: generated.gla_decode(q, k, v, s, gk, platform=p)) \
                    .lower(q, k, v, state, gk).compile()
                sec = statistics.median(median_seconds(exe, (q, k, v, state, gk), ARGS.reps, batch=8)
                                        for _ in range(ARGS.rounds))
                gbs = nbytes / sec / 1e9
                print(f"| {b} | ejgen-{platform} | {sec * 1e6:.1f} | {gbs:.0f} | {100 * gbs / stream:.0f} |", flush=True)
            except Exception as e:  # noqa: BLE001 - record and go on
                print(f"| {b} | ejgen-{platform} | {type(e).__name__}: {str(e).splitlines()[0][:80]} | | |")
    print("\ntarget: the fused decode step at >= 80% of the streaming bandwidth for the state read + write")


def _fla_name(op_name: str) -> str:
    return {"gla": "chunk_gla", "simple_gla": "chunk_simple_gla", "lightning_attention": "chunk_simple_gla_gamma"}[
        op_name]


def _reference(op_name, q, k, v, g):
    """o and the final state of the XLA backend in float32 (the first 2^20 entries of each)."""
    op = getattr(generated, op_name)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    o, ht = jax.jit(lambda q, k, v, g: op(q, k, v, **g, platform="xla", algorithm="chunked"))(*f32, g)
    return np.concatenate([np.asarray(o, np.float32).ravel()[:1 << 20], np.asarray(ht, np.float32).ravel()[:1 << 20]])


if __name__ == "__main__":
    main()
