"""Where a jitted call's GPU time goes: run it under JAX's profiler with a Perfetto trace and print, per device and
stream, the kernels of the last call in time order (start offset, duration, name) and the time per kernel kind.

    from trace_table import profile
    profile(fn, args, out_dir / "trace-ring", calls=3, label="ring fwd 32k")

Used by `benchmarks/ring.py --parts profile`, and as a script on zoo cases (`benchmarks/zoo_cases.py` keys; issues 14
and 15: how much of a 0.2 ms masked call is the XLA work before the kernel — segment keys, tile ranges, tile order):

    python benchmarks/trace_table.py --cases causal,documents,chunked,flamingo [--passes fwd,fwdbwd] [--out DIR]

 (issue 18: where the 2-GPU ring's 32k step time goes: the step kernels
against the one-GPU kernel, NCCL's send/receive kernel beside them, the merges). Reads the
``perfetto_trace.json.gz`` that `jax.profiler.trace(..., create_perfetto_trace=True)` writes (Chrome trace events:
``ph`` "X" slices with ``ts`` / ``dur`` in microseconds, ``M`` events naming processes and threads). Device
processes are those whose name holds "GPU" (or "/device:"); on a CPU-only run nothing is a device and the host's
slices are listed instead (`--cpu-smoke` checks the plumbing).
"""

from __future__ import annotations

import collections
import gzip
import json
import statistics
from pathlib import Path

KINDS = (("nccl", "nccl"), ("gluon_attention_fwd", "gluon fwd"), ("gluon_attention_bwd", "gluon bwd"),
         ("attention", "attention (generated)"), ("fusion", "XLA fusion"), ("copy", "copy"), ("memset", "memset"),
         ("memcpy", "memcpy"))


def kind(name: str) -> str:
    low = name.lower()
    for key, label in KINDS:
        if key in low:
            return label
    return "other"


def load(trace_dir: Path) -> list[dict]:
    """The slices of the newest Perfetto trace under ``trace_dir``: dicts of process, thread, name, ts, dur."""
    files = sorted(Path(trace_dir).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(files[-1], "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e.get("pid")] = e.get("args", {}).get("name", str(e.get("pid")))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = e.get("args", {}).get("name", str(e.get("tid")))
    return [dict(process=procs.get(e.get("pid"), str(e.get("pid"))),
                 thread=threads.get((e.get("pid"), e.get("tid")), str(e.get("tid"))),
                 name=e.get("name", ""), ts=float(e["ts"]), dur=float(e.get("dur", 0.0)))
            for e in events if e.get("ph") == "X" and "ts" in e]


def _is_device(process: str) -> bool:
    return "GPU" in process or "/device:" in process


def last_call(slices: list[dict], gap_us: float) -> list[dict]:
    """The slices after the last idle gap longer than ``gap_us`` on every stream together: the last call's."""
    slices = sorted(slices, key=lambda s: s["ts"])
    start, end = 0, -1e30
    for i, s in enumerate(slices):
        if s["ts"] - end > gap_us:
            start = i
        end = max(end, s["ts"] + s["dur"])
    return slices[start:]


def table(slices: list[dict], label: str, gap_us: float = 1000.0, width: int = 70) -> str:
    """The last call's kernels per device process (each its own timeline) and the time per kind."""
    device = [s for s in slices if _is_device(s["process"])]
    pool = device or slices
    lines = [f"### {label}" + ("" if device else " (no device slices: host slices shown)")]
    by_proc = collections.defaultdict(list)
    for s in pool:
        by_proc[s["process"]].append(s)
    calls = {proc: last_call(by_proc[proc], gap_us) for proc in sorted(by_proc)}
    first = min(min(s["ts"] for s in call) for call in calls.values())
    for proc, call in calls.items():
        t0 = min(s["ts"] for s in call)
        t1 = max(s["ts"] + s["dur"] for s in call)
        # where the devices' calls start against each other (one timeline): a device launched late holds the others
        # at the first transfer (issue 18: the 2-GPU ring's forward+backward started 5.5 ms apart)
        lines.append(f"{proc}: last call {t1 - t0:.1f} us, {len(call)} slices, starts {t0 - first:.1f} us after "
                     f"the first device's")
        lines.append("| start us | dur us | stream | kernel |")
        lines.append("|---|---|---|---|")
        for s in call[:100]:
            lines.append(f"| {s['ts'] - t0:.1f} | {s['dur']:.1f} | {s['thread'][:24]} | {s['name'][:width]} |")
        if len(call) > 100:
            lines.append(f"| ... | | | {len(call) - 100} more |")
        sums = collections.Counter()
        for s in call:
            sums[kind(s["name"])] += s["dur"]
        lines.append("per kind (us, summed over streams): " + ", ".join(f"{k} {v:.1f}" for k, v in sums.most_common()))
        lines.append("")
    if device and len(calls) > 1:
        lines += launches(slices, first, max(s["ts"] + s["dur"] for call in calls.values() for s in call))
    return "\n".join(lines)


def launches(slices: list[dict], first: float, end: float, before_us: float = 20000.0) -> list[str]:
    """The host's per-device launch slices (named "[<device>] ...Execute...") of the last call, from ``before_us``
    before the first device's kernels to the call's end, with their start against that first kernel: which device's
    launch came late, and what held it."""
    rows = sorted((s for s in slices if not _is_device(s["process"]) and s["name"].startswith("[")
                   and "Execute" in s["name"] and first - before_us <= s["ts"] <= end), key=lambda s: s["ts"])
    if not rows:
        return []
    lines = ["host launch slices of the last call (start us against the first device's first kernel)",
             "| start | dur | thread | name |", "|---|---|---|---|"]
    lines += [f"| {s['ts'] - first:.1f} | {s['dur']:.1f} | {s['thread'][:24]} | {s['name'][:70]} |" for s in rows[-24:]]
    return lines + [""]


def profile(fn, args, trace_dir: Path, calls: int = 3, label: str = "", gap_us: float = 1000.0) -> str:
    """Run ``fn(*args)`` (compiled first) ``calls`` times under the profiler, each call waited for and followed by
    5 ms of idle devices (the gap that tells calls apart), and return the table of the last one."""
    import time

    import jax

    jax.block_until_ready(fn(*args))
    trace_dir = Path(trace_dir)
    trace_dir.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
            time.sleep(0.005)
    text = table(load(trace_dir), label or str(trace_dir), gap_us)
    print(text, flush=True)
    return text


def hop_lead(slices: list[dict], step_us: float = 500.0) -> list[float]:
    """For each NCCL kernel among one device's ``slices`` (time-sorted), its start less the start of the step it runs
    beside: the first other kernel of at least ``step_us`` that is running when it starts or starts after it (a hop
    that starts late in its step shows a large value; one that goes first, a small negative one)."""
    steps = [s for s in slices if "nccl" not in s["name"].lower() and s["dur"] >= step_us]
    lead = []
    for hop in (s for s in slices if "nccl" in s["name"].lower()):
        beside = [s for s in steps if s["ts"] + s["dur"] > hop["ts"]]
        if beside:
            lead.append(hop["ts"] - beside[0]["ts"])
    return lead


def back_to_back(fn, args, trace_dir: Path, calls: int = 4, label: str = "", gap_us: float = 20.0) -> str:
    """``calls`` calls of ``fn(*args)`` dispatched back to back and waited for once (the timed method,
    ejgen/testing/timing.py) under the profiler: per device, the span of all of them against the sum of its busy time
    (the union of its slices over streams), and its idle gaps over ``gap_us`` with the kernels either side; the host's
    seconds to return from each dispatch. Tells idle devices (launch, a host wait) from slower kernels (clocks) when a
    timed call is longer than its profiled span (issue 18: the ring's 1.5-2 ms a call)."""
    import time

    import jax

    # a batch first: the allocator grows to hold ``calls`` calls' buffers once, outside the trace (session 18: the
    # one-GPU forward's 4th dispatch waited 19.6 ms on "Build buffer allocations" in a first batch)
    jax.block_until_ready([fn(*args) for _ in range(calls)])
    trace_dir = Path(trace_dir)
    trace_dir.mkdir(parents=True, exist_ok=True)
    dispatch = []
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        jax.block_until_ready(fn(*args))
        time.sleep(0.005)
        t_all = time.perf_counter()
        outs = []
        for _ in range(calls):
            t0 = time.perf_counter()
            outs.append(fn(*args))
            dispatch.append((time.perf_counter() - t0) * 1e3)
        jax.block_until_ready(outs)
        wall = (time.perf_counter() - t_all) * 1e3
    slices = load(trace_dir)
    device = [s for s in slices if _is_device(s["process"])]
    lines = [f"### {label} ({calls} calls back to back)",
             f"host: {wall / calls:.3f} ms a call waited for once; dispatch returns " +
             ", ".join(f"{d:.2f}" for d in dispatch) + " ms"]
    by_proc = collections.defaultdict(list)
    for s in device:
        by_proc[s["process"]].append(s)
    for proc in sorted(by_proc):
        # the batch: the slices after the 5 ms sleep (the last idle gap over 1 ms before the end)
        call = sorted(last_call(by_proc[proc], 1000.0), key=lambda s: s["ts"])
        if not call:
            continue
        t0, busy, end, gaps = call[0]["ts"], 0.0, call[0]["ts"], []
        prev = call[0]
        for s in call:
            if s["ts"] > end:
                if s["ts"] - end > gap_us:
                    gaps.append((s["ts"] - end, end - t0, prev["name"], s["name"]))
            lo = max(s["ts"], end)
            hi = s["ts"] + s["dur"]
            if hi > lo:
                busy += hi - lo
            if hi > end:
                end, prev = hi, s
        span = end - t0
        idle = sum(g[0] for g in gaps)
        lines.append(f"{proc}: span {span / calls / 1e3:.3f} ms a call, busy {busy / calls / 1e3:.3f}, "
                     f"idle in gaps over {gap_us:.0f} us {idle / calls / 1e3:.3f} ({len(gaps)} gaps)")
        for size, at, before, after in sorted(gaps, reverse=True)[:10]:
            lines.append(f"  gap {size:.1f} us at {at / 1e3:.3f} ms: after {before[:50]} | before {after[:50]}")
        kinds = collections.defaultdict(list)  # kernel name -> its durations in the batch, in time order
        for s in call:
            kinds[s["name"].split("(")[0][:40]].append(s["dur"])
        for name, durs in sorted(kinds.items(), key=lambda kv: -sum(kv[1]))[:4]:  # whether kernels slow down
            # over the batch (clocks) or some calls (a peer's wait)
            lines.append(f"  {name}: {sum(durs) / calls:.1f} us a call; first " +
                         " ".join(f"{d:.0f}" for d in durs[:4]) + " | last " + " ".join(f"{d:.0f}" for d in durs[-4:]))
        lead = hop_lead(call)
        if lead:  # (session 39: the hop must start before the step it hides behind, notes/studies/s39-hop-launch.md)
            lines.append(f"  hop start against its step's (us; < 0: before it): median {statistics.median(lead):.1f}, "
                         f"max {max(lead):.1f}, {sum(x > 100.0 for x in lead)} of {len(lead)} over 100 us late")
        # the batch's middle calls as they ran: which kernels overlap which (a hop beside a step, or alone)
        big = [s for s in call if s["dur"] >= 20.0]
        middle = big[len(big) // 2:len(big) // 2 + 16]
        lines.append("  the middle of the batch (slices >= 20 us; start us from the batch's first, duration, "
                     "stream):")
        lines += [f"    {s['ts'] - t0:10.1f} {s['dur']:8.1f}  {s['thread'][:24]:24}  {s['name'][:40]}"
                  for s in middle]
        if middle:  # the host's launches in that window: when each thread asked for the hop and the steps
            lo, hi = middle[0]["ts"] - 5000.0, middle[-1]["ts"]
            asks = sorted((s for s in slices if not _is_device(s["process"]) and lo <= s["ts"] <= hi
                           and any(w in s["name"].lower() for w in ("nccl", "collective", "launch", "permute",
                                                                    "execute", "thunk"))),
                          key=lambda s: s["ts"])
            lines.append("  the host's launch slices in that window (start us from the batch's first, duration, "
                         "thread):")
            lines += [f"    {s['ts'] - t0:10.1f} {s['dur']:8.1f}  {s['thread'][:24]:24}  {s['name'][:50]}"
                      for s in asks[:40]]
    host = collections.Counter()
    for s in slices:
        if not _is_device(s["process"]):
            host[s["name"][:60]] += s["dur"]
    lines.append("host slices by total us (all threads): " +
                 ", ".join(f"{n} {v:.0f}" for n, v in host.most_common(12)))
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def main(argv=None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="causal,documents,chunked,flamingo", help="zoo_cases keys")
    p.add_argument("--passes", default="fwd,fwdbwd")
    p.add_argument("--platform", default="auto")
    p.add_argument("--out", default="bench-out/trace")
    args = p.parse_args(argv)
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    sys.path.insert(0, str(here.parent))
    import jax
    import jax.numpy as jnp

    import zoo
    import zoo_cases

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = [c for c in args.cases.split(",") if c]
    cases = {c.key: c for c in zoo_cases.cases()}
    tables = []
    for key in wanted:
        case = cases[key]
        call = zoo.make_call(case, args.platform)
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        q, k, v, do = (jax.random.normal(kk, (case.batch, case.seq, case.heads, case.dim), jnp.bfloat16)
                       for kk in keys)
        learn = {n: jnp.asarray(a) for n, a in case.arrays.items() if n in case.learnable}
        fixed = {n: jnp.asarray(a) for n, a in case.arrays.items() if n not in case.learnable}
        fns = {"fwd": jax.jit(lambda q, k, v: call(q, k, v, learn, fixed)),
               "fwdbwd": jax.jit(lambda q, k, v: jax.vjp(lambda q, k, v: call(q, k, v, learn, fixed), q, k, v)[1](do))}
        for pass_ in [x for x in args.passes.split(",") if x]:
            tables.append(profile(fns[pass_], (q, k, v), out / f"trace-{key}-{pass_}", label=f"{case.label} {pass_}"))
            (out / "profile.md").write_text("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
