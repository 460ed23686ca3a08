"""The linear recurrent family on one GPU (issue 17 item 5, docs/DESIGN.md §3 linear recurrent): ejgen's gla,
simple_gla and lightning_attention ops, forward and forward+backward, bf16, H = 16, K = V = 128, at B4 T4096 and
B2 T16384, next to flash-linear-attention's chunk_gla / fused_recurrent_gla / chunk_simple_gla timed in a process of
their own (`benchmarks/recurrent_fla.py`, torch: run it first on the same machine and pass its JSON with --fla).

Impls: `ejgen-triton` (algorithm chunked, chunks of 64; its defaults: the forward's chunk states stored in bf16 for
these bf16 inputs), `ejgen-triton-f32-states` (the same with them in float32, the chunk_state_dtype setting
"float32": the default before session 22), `ejgen-triton-inline-sums` (each chunked
kernel scans the gates' sums itself, the chunk_gate_sums setting "inline": the form before session 22),
`ejgen-triton-tf32-products` (the products with a float32 state or adjoint on TF32 operands, the chunk_products
setting "tf32": the default before session 23; the default rounds them to bf16 for these bf16 inputs),
`ejgen-triton-onepass` (`--onepass`: chunked
with the one-pass forward, the chunk_forward setting "fused"; 1.6x the two passes in session 23),
`ejgen-triton-fused` (the fused recurrence; forward only
at T4096, the fused kernels are for decoding and short sequences), `ejgen-xla` (`--xla`: the chunked jnp backend).
Every ejgen impl's forward is checked against the XLA backend in float32 on the same inputs (relative error of o and
the final state, their first 2^20 entries each; FLAG past 2e-2).

Run on the GPU host from the repository root (jax-triton and lark from wheels in .whl, see
/work/shared/tools/gpu-wheelhouse; fla's wheels likewise):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 benchmarks/recurrent_fla.py --out $OUT/fla.json
    PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 benchmarks/recurrent.py --fla $OUT/fla.json --out $OUT

Decode (`--decode`, the issue's bandwidth target): gla_decode, one step from a float32 state [B, 16, 128, 128] for
B = 32 and 128, on triton (the fused kernel), pallas (its fused kernel) and xla: GB/s of the state read and written
(plus q, k, v, gk, o) against the streaming bandwidth of a jitted copy (x + 1, 2 GiB) in the same run, two ways:
  loop: 32 steps in one jitted lax.fori_loop carrying the state (donated from call to call): the device's time per
        step, as inside a model's jitted decode step; the issue's target is this one;
  call: one jitted step per call, the state donated and the next call given the returned one (a serving loop that
        dispatches every step from Python): adds the host's dispatch of a jitted call (tens of us; ~55 us on the
        CPU where this was written), the likely reason B32 took 65 us a call on the H200 for 16 us of bytes.
The steps update the state in place (kernels alias it; the donation lets XLA reuse its buffer: no copy).
`--decode-sweep`: the fused kernels' value block (FUSED_BV) and warps, loop timing; `--decode-profile`: the kernels of
one 4-step loop under JAX's profiler (trace_table.py), per-kernel device times; `--decode-only` skips the train table.

Prints the device and a markdown table (ms: median of interleaved rounds; vs fla: fla's time / ejgen's, > 1 is
faster), and the issue's targets; writes `<out>/recurrent.json`. `--cpu-smoke` runs tiny shapes on XLA and Triton's
interpreter without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
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
    p.add_argument("--calls", type=int, default=8,
                   help="train table: calls a sample, dispatched back to back (fla's script times 4 between CUDA "
                        "events, device time; 2 here before session 29 put ~30-80 us of JAX's dispatch and wake-up "
                        "in each 0.3-0.9 ms forward)")
    p.add_argument("--cases", default="", help="comma-separated substrings of case names (default: all)")
    p.add_argument("--xla", action="store_true", help="also time the XLA backend")
    p.add_argument("--onepass", action="store_true", help="also time the one-pass forward (chunk_forward fused)")
    p.add_argument("--no-variants", action="store_true",
                   help="without the rows that change one setting (-f32-states, -inline-sums, -tf32-products)")
    p.add_argument("--decode", action="store_true", help="also time one decode step against the streaming bandwidth")
    p.add_argument("--decode-only", action="store_true", help="only the decode table (implies --decode)")
    p.add_argument("--decode-sweep", action="store_true", help="decode: the fused kernels' FUSED_BV x warps")
    p.add_argument("--decode-profile", action="store_true", help="decode: one 4-step loop's kernels under the profiler")
    p.add_argument("--batches", default="32,128", help="decode batches")
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
from ejgen.ops import settings  # noqa: E402
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


BASE = {"chunk_forward": "two_pass", "chunk_state_dtype": "auto", "chunk_products": "auto"}  # the impls' defaults


def impls(op_name, args, gates, do, smoke):
    """{name: (fwd fn, fwd+bwd fn)} of a case."""
    op = getattr(generated, op_name)
    out = {}
    platforms = [("ejgen-triton", "triton", "chunked", {}),
                 ("ejgen-triton-f32-states", "triton", "chunked", {"chunk_state_dtype": "float32"}),
                 ("ejgen-triton-inline-sums", "triton", "chunked", {"chunk_gate_sums": "inline"}),
                 ("ejgen-triton-tf32-products", "triton", "chunked", {"chunk_products": "tf32"})]
    if ARGS.no_variants:
        platforms = platforms[:1]
    if ARGS.onepass:
        platforms.append(("ejgen-triton-onepass", "triton", "chunked", {"chunk_forward": "fused"}))
    if args[0].shape[1] <= 4096:
        platforms.append(("ejgen-triton-fused", "triton", "fused", {}))
    if ARGS.xla or smoke:
        platforms.append(("ejgen-xla", "xla", "chunked", {}))
    platforms = [p + ((),) for p in platforms]  # (the gates each impl's fwd+bwd holds fixed: none)
    if "g_gamma" in gates:  # the decay held fixed, as Lightning attention and RetNet keep it and as fla's backward
        # takes it (it forms no g_gamma gradient): no log gates' gradient formed
        platforms.insert(1, ("ejgen-triton-fixed-decay", "triton", "chunked", {}, ("g_gamma",)))
    for name, platform, algorithm, asked, held in platforms:
        def fwd(q, k, v, g, platform=platform, algorithm=algorithm, asked=asked):
            from ejgen.ops import settings

            # the impl's settings over the defaults, read as the call is traced
            with settings(**{**BASE, **asked}):
                return op(q, k, v, **g, platform=platform, algorithm=algorithm)

        def fwd_bwd(q, k, v, g, do, fwd=fwd, asked=asked, held=held):
            from ejgen.ops import settings

            # the backward is traced as vjp is applied: under the impl's settings too. o is returned: the backward
            # reads none of it, and XLA drops a forward kernel whose result nothing reads (chunk_output went
            # untimed in every fwd+bwd row before session 32), where a training step and fla's backward run it
            fixed = {n: g[n] for n in held}
            with settings(**{**BASE, **asked}):
                (o, ht), vjp = jax.vjp(lambda q, k, v, g: fwd(q, k, v, {**g, **fixed}), q, k, v,
                                       {n: x for n, x in g.items() if n not in held})
                return o, vjp((do, jnp.zeros_like(ht)))

        out[name] = (jax.jit(fwd), jax.jit(fwd_bwd))
    return out


def main():
    args = ARGS
    smoke = args.cpu_smoke
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    fla = json.loads(Path(args.fla).read_text()) if args.fla else {}
    device = jax.devices()[0].device_kind
    print(f"device: {device}; jax {jax.__version__}; train table: {args.calls} calls a sample", flush=True)
    toks = [t for t in args.cases.split(",") if t]
    rows = []
    for case, op_name, gates, b, t, h, k, v in cases(smoke):
        if (toks and not any(tok in case for tok in toks)) or args.decode_only:
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
                samples[key].append(median_seconds(exe, fargs, args.reps, batch=args.calls if not smoke else 1))
        for key, (_, _, row) in timed.items():
            row["ms"] = statistics.median(samples[key]) * 1e3
            peer = fla.get(f"{_fla_name(op_name)}|{case.split('-', 1)[1]}|{row['pass_']}")
            if peer and row["ms"]:
                row["vs_fla"] = peer / row["ms"]
            print(f"{case:28s} {row['impl']:20s} {row['pass_']:8s} {row['ms']:9.3f} ms"
                  + (f"  vs fla {row['vs_fla']:.2f}x" if row["vs_fla"] else ""), flush=True)
    if args.decode_only:
        decode_table(smoke, out_dir)
        return
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
        decode_table(smoke, out_dir)


def stream_bandwidth(gib: float, reps: int) -> float:
    """GB/s of a jitted float32 copy (x + 1: read + write) of a `gib` GiB array."""
    n = int(gib * 2 ** 30) // 4
    x = jax.random.normal(jax.random.PRNGKey(7), (n,), jnp.float32)
    exe = jax.jit(lambda x: x + 1.0).lower(x).compile()
    return 8 * n / median_seconds(exe, (x,), reps, batch=8) / 1e9


def chained_seconds(fn, args, reps: int, batch: int, warm_seconds: float = 0.3) -> float:
    """Median wall seconds of one call of ``fn(q, k, v, state, gk) -> (o, state)`` jitted with the state donated, each
    call given the state the previous one returned (samples of ``batch`` calls dispatched back to back), after a
    warm-up that brings the clocks up (``median_seconds``'s reasons)."""
    args = list(args)
    args[3] = args[3].copy()  # a buffer of our own to donate

    def call():
        o, args[3] = fn(*args)
        return o

    for _ in range(2):
        jax.block_until_ready(call())
    t_end = time.perf_counter() + (0.0 if jax.default_backend() == "cpu" else warm_seconds)
    while time.perf_counter() < t_end:
        jax.block_until_ready(call())
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(batch):
            o = call()
        jax.block_until_ready((o, args[3]))
        samples.append((time.perf_counter() - t0) / batch)
    return statistics.median(samples)


LOOP_STEPS = 32


def decode_fns(platform: str, steps: int = LOOP_STEPS):
    """(one step, ``steps`` steps in a lax.fori_loop carrying the state): (q, k, v, state, gk) -> (o, state)."""
    def step(q, k, v, s, gk):
        return generated.gla_decode(q, k, v, s, gk, platform=platform)

    def loop(q, k, v, s, gk):
        o = jnp.zeros(q.shape[:2] + (s.shape[3],), q.dtype)
        return jax.lax.fori_loop(0, steps, lambda i, c: step(q, k, v, c[1], gk), (o, s))

    return step, loop


@contextlib.contextmanager
def _fused_config(platform: str, bv: int, warps: int):
    """The fused decode kernels' value block and warps for the traces inside (``--decode-sweep``; Triton's wide
    blocks off, the fused_value_blocks setting "fixed": the swept block everywhere)."""
    from ejgen.runtime.recurrent.pallas import gpu as pallas_gpu
    from ejgen.runtime.recurrent.triton import host

    module = host if platform == "triton" else pallas_gpu
    saved = (module.FUSED_BV, module.NUM_WARPS)
    module.FUSED_BV, module.NUM_WARPS = bv, warps
    try:
        with settings(fused_value_blocks="fixed"):
            yield
    finally:
        module.FUSED_BV, module.NUM_WARPS = saved


def decode_inputs(b: int, heads: int, dim: int):
    keys = jax.random.split(jax.random.PRNGKey(b), 5)
    q, k, v = (jax.random.normal(keys[i], (b, heads, dim), jnp.bfloat16) for i in range(3))
    gk = jax.nn.log_sigmoid(jax.random.normal(keys[3], (b, heads, dim), jnp.float32)) / 16
    state = jax.random.normal(keys[4], (b, heads, dim, dim), jnp.float32)
    nbytes = 2 * state.size * 4 + 3 * q.size * 2 + gk.size * 4 + b * heads * dim * 2
    return (q, k, v, state, gk), nbytes


def decode_table(smoke: bool, out_dir: Path):
    """gla_decode steps from a float32 state: GB/s of the bytes moved per step, against the streaming copy (module
    docstring: loop and call)."""
    heads, dim = (2, 16) if smoke else (16, 128)
    stream = stream_bandwidth(0.01 if smoke else 2.0, ARGS.reps)
    batches = (2,) if smoke else tuple(int(b) for b in ARGS.batches.split(","))
    steps = 4 if smoke else LOOP_STEPS
    print(f"\ndecode: streaming copy {stream:.0f} GB/s; loop: {steps} steps per call\n")
    print("| batch | impl | loop us/step | loop GB/s | loop % stream | call us | call % stream |")
    print("|---|---|---|---|---|---|---|")
    results = {"stream_gbs": stream, "rows": []}

    def measure(args, platform, config=None, call=True):
        """(seconds per step in the loop, seconds per call of one step or None)."""
        step, loop = decode_fns(platform, steps)
        with config or contextlib.nullcontext():
            loop_exe = jax.jit(loop, donate_argnums=3).lower(*args).compile()
            step_exe = jax.jit(step, donate_argnums=3).lower(*args).compile() if call else None
        per_step = statistics.median(chained_seconds(loop_exe, args, ARGS.reps, 4) for _ in range(ARGS.rounds)) / steps
        if not call:
            return per_step, None
        return per_step, statistics.median(chained_seconds(step_exe, args, ARGS.reps, 8) for _ in range(ARGS.rounds))

    for b in batches:
        args, nbytes = decode_inputs(b, heads, dim)
        for platform in ("triton", "pallas", "xla"):
            try:
                per_step, per_call = measure(args, platform)
                gbs = nbytes / per_step / 1e9
                results["rows"].append(dict(batch=b, impl=f"ejgen-{platform}", loop_us=per_step * 1e6,
                                            call_us=per_call * 1e6, loop_gbs=gbs))
                print(f"| {b} | ejgen-{platform} | {per_step * 1e6:.1f} | {gbs:.0f} | {100 * gbs / stream:.0f} | "
                      f"{per_call * 1e6:.1f} | {100 * nbytes / per_call / 1e9 / stream:.0f} |", flush=True)
            except Exception as e:  # noqa: BLE001 - record and go on
                print(f"| {b} | ejgen-{platform} | {type(e).__name__}: {str(e).splitlines()[0][:80]} | | | | |")
                traceback.print_exc(limit=3)
    print("\ntarget: the fused decode step at >= 80% of the streaming bandwidth for the state read + write (loop)")
    if ARGS.decode_sweep and not smoke:
        print("\ndecode sweep (loop us/step, % stream): the fused kernels' FUSED_BV x warps\n")
        print("| batch | impl | BV | warps | us/step | % stream |")
        print("|---|---|---|---|---|---|")
        for b in batches:
            args, nbytes = decode_inputs(b, heads, dim)
            for platform in ("triton", "pallas"):
                for bv in (16, 32, 64):
                    for warps in (2, 4, 8):
                        try:
                            per_step, _ = measure(args, platform, _fused_config(platform, bv, warps), call=False)
                            pct = 100 * nbytes / per_step / 1e9 / stream
                            results["rows"].append(dict(batch=b, impl=f"ejgen-{platform}", bv=bv, warps=warps,
                                                        loop_us=per_step * 1e6))
                            print(f"| {b} | ejgen-{platform} | {bv} | {warps} | {per_step * 1e6:.1f} | {pct:.0f} |",
                                  flush=True)
                        except Exception as e:  # noqa: BLE001
                            print(f"| {b} | ejgen-{platform} | {bv} | {warps} | {type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:60]} | |")
    if ARGS.decode_profile:
        from trace_table import profile

        args, _ = decode_inputs(batches[0], heads, dim)
        tables = []
        for platform in ("triton", "pallas", "xla"):
            _, loop = decode_fns(platform, 4)
            exe = jax.jit(loop).lower(*args).compile()  # not donated: the first step's state is copied once
            try:
                tables.append(profile(exe, args, out_dir / f"trace-decode-{platform}", calls=3,
                                      label=f"gla_decode B{batches[0]} {platform}: 4 steps in a loop", gap_us=500.0))
            except Exception as e:  # noqa: BLE001
                print(f"profile {platform}: {type(e).__name__}: {e}")
        (out_dir / "decode_profile.md").write_text("\n\n".join(tables))
    (out_dir / "decode.json").write_text(json.dumps(results, indent=1))


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
