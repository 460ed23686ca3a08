"""How much of a short call is not its kernels (issue 14: the 8k documents call took 0.22 ms around 0.16 ms of
kernels, and the profile of one call shows the device idle for tens of microseconds between them).

For each case (benchmarks/zoo_cases.py keys) and pass it prints, on one card:
  kernels    the device time of one call (the kernels' durations summed, from a profiler trace: trace_table.py)
  span       first kernel's start to last kernel's end in that trace (idle gaps included)
  enqueue    host time to dispatch one call, 32 calls issued back to back without waiting
  batch N    per-call wall time, N calls dispatched back to back and waited for once (benchmarks time batches of 4)

If `batch 32` ~ `kernels`, the device runs the kernels back to back once the host is ahead and the gap is latency
(what a model's step does not see); if `enqueue` ~ `batch 32` > `kernels`, the host is the bottleneck.
Run it once plainly and once with XLA_FLAGS=--xla_gpu_enable_command_buffer= (XLA's CUDA graphs off) to see
whether graph updates are the host's cost.

    python benchmarks/dispatch.py --cases causal,documents,chunked,flamingo [--passes fwd,fwdbwd] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def enqueue_us(fn, args, calls: int = 32) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    outs = [fn(*args) for _ in range(calls)]
    t1 = time.perf_counter()
    jax.block_until_ready(outs)
    return (t1 - t0) / calls * 1e6


def host_table(trace_dir: Path, label: str, top: int = 14) -> str:
    """The host's slices (runtime and Python TraceMe events) of the last profiled call: from 300 us before its first
    kernel to its last kernel's end, the longest first, with their start relative to the first kernel."""
    import trace_table

    slices = trace_table.load(trace_dir)
    device = [s for s in slices if trace_table._is_device(s["process"])]
    last = trace_table.last_call(device, 1000.0)
    if not last:
        return f"{label}: no device slices"
    t0, t1 = min(s["ts"] for s in last), max(s["ts"] + s["dur"] for s in last)
    host = [s for s in slices if not trace_table._is_device(s["process"]) and t0 - 300 <= s["ts"] <= t1]
    host.sort(key=lambda s: -s["dur"])
    lines = [f"#### host slices of {label} (us; start relative to the first kernel)", "| start | dur | thread | name |",
             "|---|---|---|---|"]
    lines += [f"| {s['ts'] - t0:.1f} | {s['dur']:.1f} | {s['thread'][:20]} | {s['name'][:90]} |" for s in host[:top]]
    return "\n".join(lines)


def device_us(fn, args, trace_dir: Path) -> tuple[float, float]:
    """(kernel time summed, span) of the last of three profiled calls, in microseconds."""
    import contextlib
    import io

    import trace_table

    with contextlib.redirect_stdout(io.StringIO()):  # the kernel table: in the trace directory, not this table
        trace_table.profile(fn, args, trace_dir, calls=3)
    slices = [s for s in trace_table.load(trace_dir) if trace_table._is_device(s["process"])]
    last = trace_table.last_call(slices, 1000.0)
    if not last:
        return float("nan"), float("nan")
    return sum(s["dur"] for s in last), max(s["ts"] + s["dur"] for s in last) - min(s["ts"] for s in last)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="causal,documents,chunked,flamingo")
    p.add_argument("--passes", default="fwd,fwdbwd", help="fwd, fwdbwd, fwd-args, fwdbwd-args (-args: the learnable "
                   "inputs passed as arguments)")
    p.add_argument("--out", default="bench-out/dispatch")
    p.add_argument("--seq", type=int, default=8192, help="tokens (a multiple of 256; small for a CPU smoke run)")
    args = p.parse_args(argv)
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    sys.path.insert(0, str(here.parent))
    import jax
    import jax.numpy as jnp

    import zoo
    import zoo_cases
    from ejgen.testing.timing import median_seconds

    out = Path(args.out)
    cases = {c.key: c for c in zoo_cases.cases(seq=args.seq)}
    flags = os.environ.get("XLA_FLAGS", "")
    print(f"{jax.devices()[0].device_kind}; XLA_FLAGS={flags!r}\n", flush=True)
    hosts = []
    print("| case | pass | kernels us | span us | enqueue us | batch 1 us | batch 4 us | batch 32 us |", flush=True)
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for key in [c for c in args.cases.split(",") if c]:
        case = cases[key]
        call = zoo.make_call(case, "auto")
        data = zoo_cases.inputs(case)
        q, k, v, do = (jnp.asarray(data[n], jnp.bfloat16) for n in ("q", "k", "v", "do"))
        learn = {n: jnp.asarray(a) for n, a in case.arrays.items() if n in case.learnable}
        fixed = {n: jnp.asarray(a) for n, a in case.arrays.items() if n not in case.learnable}
        fns = {"fwd": jax.jit(lambda q, k, v: call(q, k, v, learn, fixed)),
               "fwdbwd": jax.jit(lambda q, k, v: jax.vjp(lambda q, k, v: call(q, k, v, learn, fixed), q, k, v)[1](do)),
               # the learnable inputs (sinks, T5's table) as arguments of the executable, as zoo.py and training pass
               # them, not constants folded into it
               "fwd-args": jax.jit(lambda q, k, v, learn: call(q, k, v, learn, fixed)),
               "fwdbwd-args": jax.jit(lambda q, k, v, learn: jax.vjp(lambda q, k, v, learn: call(q, k, v, learn, fixed),
                                                                      q, k, v, learn)[1](do))}
        for pass_ in [x for x in args.passes.split(",") if x]:
            fn, a = fns[pass_], (q, k, v) + ((learn,) if pass_.endswith("-args") else ())
            kern, span = device_us(fn, a, out / f"trace-{key}-{pass_}")
            hosts.append(host_table(out / f"trace-{key}-{pass_}", f"{case.label} {pass_}"))
            enq = enqueue_us(fn, a)
            per = [median_seconds(fn, a, reps=10, warmup=1, warm_seconds=0.2, batch=b) * 1e6 for b in (1, 4, 32)]
            print(f"| {case.label} | {pass_} | {kern:.1f} | {span:.1f} | {enq:.1f} | "
                  + " | ".join(f"{t:.1f}" for t in per) + " |", flush=True)
    print("\n\n".join(hosts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
