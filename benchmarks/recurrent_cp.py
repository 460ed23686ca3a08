"""Context parallelism of the linear recurrent family on the GPUs of one host (issue 18 item 3; docs/DESIGN.md §3
"Context parallelism (linear recurrent)"): ejgen's `gla_cp` (the steps cut over a mesh axis "sp" of N GPUs, the
states passed along it) against `gla` on one GPU holding the whole sequence; GLA, B 1, H 16, K = V = 128, bf16 q, k, v,
float32 gates (logsigmoid(x) / 16), platform triton.

Parts (`--parts`, default both):
- check: gla_cp on N GPUs against gla on one GPU, T = `--check-seq` (8k) with an initial state, forward and backward:
  relative error of o, final_state, dq, dk, dv, dgk, d initial_state (PASS under 2e-2, bf16).
- time: forward and forward+backward at each of `--seqs` (32k, 128k): `1gpu` (gla on device 0, the whole
  sequence), `shard` (gla on device 0 on T / N steps: what each device of the CP call runs before the combine, its
  lower bound) and `cp` (gla_cp over N GPUs). `vs 1gpu` is the one-GPU time over this one, `eff` that over N, and
  `vs shard` the CP time over the shard's: the cost of the states' gather, fold and share (docs/DESIGN.md: the
  share is a product per head plus the gates' running sums).

Run on the GPU host, from the repository root (jax-triton travels as a wheel in .whl; carry .whl):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && ln -sfn ../generated ejgen/generated && ln -sfn ../zoo/generated ejgen/zoo && \\
        export PYTHONPATH=/tmp/site:$PWD && PYTHONUNBUFFERED=1 timeout 580 \\
        python3 benchmarks/recurrent_cp.py --devices 2 --out $OUT/recurrent_cp

No case starts after `--budget-s` seconds (default 500) and the JSON is rewritten after every case. NVLink multicast
stays off (NCCL_NVLS_ENABLE=0 unless given). `python benchmarks/recurrent_cp.py --cpu-smoke` runs tiny shapes on 4
host CPU devices with the XLA backend (the script's plumbing, not a timing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=0, help="GPUs of the mesh axis (default: all)")
    p.add_argument("--parts", default="check,time", help="comma-separated: check, time")
    p.add_argument("--seqs", default="32768,131072", help="sequence lengths of the time part")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128, help="K = V")
    p.add_argument("--passes", default="fwd,fwdbwd", help="fwd and / or fwdbwd")
    p.add_argument("--check-seq", type=int, default=8192)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=500, help="start no case after this many seconds")
    p.add_argument("--out", default="bench-out/recurrent_cp")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on 4 CPU devices, platform xla")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.cpu_smoke:  # before JAX starts
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the device tool's KINDS.md)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's ejgen, run from anywhere

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from ejgen.generated import gla, gla_cp  # noqa: E402
from ejgen.testing.timing import median_seconds  # noqa: E402

TOL = 2e-2
ROWS: list = []
START = time.perf_counter()
SEQ = P(None, "sp")


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _inputs(seq, sharding, seed=0, h0=False):
    """q, k, v bf16 [1, T, H, D], gk float32 (GLA's gates), do bf16, made on the devices of ``sharding``; with h0 an
    initial state [1, H, D, D] (replicated)."""
    h, d = ARGS.heads, ARGS.dim

    def make(key):
        keys = jax.random.split(key, 6)
        q, k, v, do = (jax.random.normal(keys[i], (1, seq, h, d), jnp.bfloat16) for i in range(4))
        gk = jax.nn.log_sigmoid(jax.random.normal(keys[4], (1, seq, h, d), jnp.float32)) / 16
        return q, k, v, gk, do

    args = jax.jit(make, out_shardings=(sharding,) * 5)(jax.random.key(seed))
    if h0:
        state = jax.random.normal(jax.random.key(seed + 1), (1, h, d, d), jnp.float32)
        mesh = getattr(sharding, "mesh", None)
        args += (jax.device_put(state, NamedSharding(mesh, P()) if mesh is not None else sharding),)
    return args


def single(platform):
    return lambda q, k, v, gk, h0=None: gla(q, k, v, gk, initial_state=h0, platform=platform)


def context_parallel(mesh, platform):
    """gla_cp inside shard_map over mesh axis "sp": q, k, v, gk cut along the steps, the initial state replicated;
    o cut, final_state replicated."""

    def body(q, k, v, gk, h0):
        return gla_cp(q, k, v, gk, initial_state=h0, axis_name="sp", platform=platform)

    def fn(q, k, v, gk, h0=None):
        if h0 is None:
            return jax.shard_map(lambda *a: body(*a, None), mesh=mesh, in_specs=(SEQ,) * 4,
                                 out_specs=(SEQ, P()))(q, k, v, gk)
        return jax.shard_map(body, mesh=mesh, in_specs=(SEQ,) * 4 + (P(),), out_specs=(SEQ, P()))(q, k, v, gk, h0)

    return fn


def _passes(fn):
    """{"fwd": f(q, k, v, gk, do), "fwdbwd": o and the gradients of (o, final_state) for cotangents (do, 0)} jitted
    (o returned: the backward reads none of it, and XLA would drop the forward's output kernel, as a training step
    does not)."""
    fwd = jax.jit(lambda q, k, v, gk, do: fn(q, k, v, gk))

    def grads(q, k, v, gk, do):
        (o, final), pull = jax.vjp(fn, q, k, v, gk)
        return o, pull((do, jnp.zeros_like(final)))

    return {"fwd": fwd, "fwdbwd": jax.jit(grads)}


def record(row: dict, out_dir: Path):
    ROWS.append(row)
    (out_dir / "recurrent_cp.json").write_text(json.dumps(ROWS, indent=1))
    print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def time_case(seq, impl, gpus, pass_, fn, args, out_dir):
    """Compile (timed), then the median of --reps samples; a failure is a row with its error."""
    row = dict(part="time", T=seq, impl=impl, gpus=gpus, **{"pass": pass_})
    if time.perf_counter() - START > ARGS.budget_s:
        row["error"] = "skipped: --budget-s reached"
        record(row, out_dir)
        return
    try:
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        row["compile_s"] = round(time.perf_counter() - t0, 1)
        seconds = median_seconds(fn, args, reps=ARGS.reps, warmup=1)
        row.update(ms=round(seconds * 1e3, 3), mtok_gpu=round(seq / seconds / gpus / 1e6, 3))
    except Exception as e:  # noqa: BLE001 (a row with the error; the other cases go on)
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        traceback.print_exc()
    record(row, out_dir)


def _relative(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def part_check(devices, platform, out_dir):
    """gla_cp on every GPU against gla on one GPU, T = --check-seq, with an initial state: o, final_state and every
    gradient."""
    n, seq = len(devices), ARGS.check_seq
    mesh = jax.sharding.Mesh(np.array(devices), ("sp",))
    one = jax.sharding.SingleDeviceSharding(devices[0])
    q, k, v, gk, do, h0 = _inputs(seq, one, seed=7, h0=True)
    df = jax.random.normal(jax.random.key(9), h0.shape, jnp.float32)

    def run(fn, *args):
        (o, final), pull = jax.vjp(fn, *args)
        return (o, final) + pull((do, df))

    want = [np.asarray(x, np.float32) for x in jax.jit(lambda *a: run(single(platform), *a))(q, k, v, gk, h0)]
    row = dict(part="check", T=seq, impl="cp", gpus=n)
    try:
        cut = [jax.device_put(x, NamedSharding(mesh, SEQ)) for x in (q, k, v, gk)]
        whole = jax.device_put(h0, NamedSharding(mesh, P()))
        got = jax.jit(lambda *a: run(context_parallel(mesh, platform), *a))(*cut, whole)
        names = ("o", "final", "dq", "dk", "dv", "dgk", "dh0")
        errors = {name: _relative(g, w) for name, g, w in zip(names, got, want)}
        row.update({f"err_{k_}": round(e, 6) for k_, e in errors.items()},
                   result="PASS" if max(errors.values()) < TOL else "FAIL")
    except Exception as e:  # noqa: BLE001
        row.update(result="FAIL", error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        traceback.print_exc()
    record(row, out_dir)


def part_time(devices, platform, out_dir):
    n = len(devices)
    mesh = jax.sharding.Mesh(np.array(devices), ("sp",))
    one = jax.sharding.SingleDeviceSharding(devices[0])
    for seq in SEQS:
        for impl, steps, sharding, fn, gpus in (("1gpu", seq, one, single(platform), 1),
                                                 ("shard", seq // n, one, single(platform), 1),
                                                 ("cp", seq, NamedSharding(mesh, SEQ), context_parallel(mesh, platform),
                                                  n)):
            args = _inputs(steps, sharding)
            fns = _passes(fn)
            for pass_ in PASSES:
                time_case(seq, impl, gpus, pass_, fns[pass_], args, out_dir)
            del args


def summarise(out_dir: Path):
    timed = [r for r in ROWS if r.get("ms")]
    for r in timed:
        same = {b["impl"]: b for b in timed if b["T"] == r["T"] and b["pass"] == r["pass"]}
        if r["impl"] == "cp" and "1gpu" in same:
            r["vs_1gpu"] = round(same["1gpu"]["ms"] / r["ms"], 2)
            r["eff"] = round(r["vs_1gpu"] / r["gpus"], 3)
        if r["impl"] == "cp" and "shard" in same:
            r["vs_shard"] = round(r["ms"] / same["shard"]["ms"], 3)
    cols = ("T", "impl", "gpus", "pass", "ms", "mtok_gpu", "vs_1gpu", "eff", "vs_shard", "compile_s", "error")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in ROWS:
        if r["part"] == "time":
            cells = [_k(r[c]) if c == "T" else r.get(c, "") for c in cols]
            lines.append("| " + " | ".join("" if c is None else str(c) for c in cells) + " |")
    checks = [r for r in ROWS if r["part"] == "check"]
    if checks:
        names = ("o", "final", "dq", "dk", "dv", "dgk", "dh0")
        lines += ["", "| check | T | gpus | " + " | ".join(names) + " | result |", "|" + "---|" * (len(names) + 4)]
        for r in checks:
            lines.append(f"| {r['impl']} | {_k(r['T'])} | {r['gpus']} | "
                         + " | ".join(str(r.get(f"err_{n}", "")) for n in names) + f" | {r['result']} |")
    text = "\n".join(lines)
    (out_dir / "recurrent_cp.md").write_text(text + "\n")
    print(text)


def main():
    global SEQS, PASSES
    out_dir = Path(ARGS.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if ARGS.cpu_smoke:
        platform = "xla"
        ARGS.check_seq, ARGS.seqs, ARGS.heads, ARGS.dim, ARGS.reps = 256, "512", 2, 16, 1
        devices = jax.devices()
    else:
        platform = "triton"
        devices = jax.devices("gpu")
    if ARGS.devices:
        devices = devices[:ARGS.devices]
    SEQS = [int(s) for s in ARGS.seqs.split(",") if s]
    PASSES = [p for p in ARGS.passes.split(",") if p]
    print(f"devices: {len(devices)} x {devices[0].device_kind}; jax {jax.__version__}; platform {platform}; "
          f"H {ARGS.heads}, K = V = {ARGS.dim}", flush=True)
    parts = [p for p in ARGS.parts.split(",") if p]
    if "check" in parts:
        part_check(devices, platform, out_dir)
    if "time" in parts:
        part_time(devices, platform, out_dir)
    summarise(out_dir)


if __name__ == "__main__":
    main()
