"""Sweep Triton kernel configs (EJGEN_TRITON_CONFIG) on the GPU.

    python benchmarks/tune_triton.py --configs "cudnn||fwd=128,64,4,2,tma,merged" --cases 16384:1:1024 --jobs 8
    python benchmarks/tune_triton.py [--pass fwd|dkdv|dq|all]

--configs compares whole settings ('' = the table, 'cudnn' = the peer) on each S:causal[:left window]
case, forward and forward+backward, with the ratio to cuDNN from the same run. --pass varies one pass
over `ejgen tune`'s candidates, the others at their table defaults (fwd timed forward only, dkdv and
dq as forward+backward). The winners go into ejgen/runtime/attention/triton/configs.py by hand.
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp

from ejgen.ops import flash_attention
from ejgen.testing.timing import median_seconds as bench
from ejgen.runtime.attention.triton.configs import CANDIDATES as TUNE_CANDIDATES

CANDIDATES = TUNE_CANDIDATES["sm90"]  # one list of candidate configs: `ejgen tune`'s
CASES = [(16384, False, None), (4096, False, None), (16384, True, None), (4096, True, None)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pass", dest="pass_", default="all")
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--configs", help="whole EJGEN_TRITON_CONFIG settings to compare, '|'-separated "
                   "('' = the table, 'cudnn' = the peer); times forward and forward+backward of --cases")
    p.add_argument("--cases", default="16384:0,16384:1,16384:1:1024",
                   help="S:causal[:left window], comma-separated (with --configs)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds per (case, config) with --configs, compile included: each runs in its own "
                        "process, so a config that hangs or compiles for minutes costs no more than this")
    p.add_argument("--jobs", type=int, default=1, help="(case, config) processes at a time with --configs: "
                   "they compile in parallel and take turns on the GPU")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: "S:causal[:window]|config"
    args = p.parse_args()
    if args.one is not None:
        case, cfg = args.one.split("|", 1)
        return compare([cfg], case, args.d)
    if args.configs is not None:
        return compare_isolated(args.configs.split("|"), args.cases, args.d, args.timeout, args.jobs)
    passes = list(CANDIDATES) if args.pass_ == "all" else [args.pass_]
    d, h = args.d, 16
    for s, causal, _ in CASES:
        b = 32768 // s
        ks = jax.random.split(jax.random.PRNGKey(s), 4)
        q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in ks[:3])
        do = jax.random.normal(ks[3], (b, s, h, d), jnp.bfloat16)
        flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
        cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
        try:
            sec = bench(jax.jit(cudnn), (q, k, v))
            print(f"S={s} causal={int(causal)} fwd   cudnn          {sec * 1e3:8.3f} ms {flops / sec / 1e12:6.0f} TFLOP/s",
                  flush=True)
        except Exception as e:
            print(f"S={s} causal={int(causal)} cudnn failed: {str(e).splitlines()[0][:100]}", flush=True)
        for pass_ in passes:
            for cfg in CANDIDATES[pass_]:
                os.environ["EJGEN_TRITON_CONFIG"] = f"{pass_}={cfg}"
                f = lambda q, k, v: flash_attention(q, k, v, causal=causal, platform="triton")
                try:
                    if pass_ == "fwd":
                        sec = bench(jax.jit(f), (q, k, v))
                        tf = flops / sec / 1e12
                    else:
                        g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * do), (0, 1, 2)))
                        sec = bench(g, (q, k, v))
                        tf = 3.5 * flops / sec / 1e12
                    print(f"S={s} causal={int(causal)} {pass_:5} {cfg:14} {sec * 1e3:8.3f} ms {tf:6.0f} TFLOP/s", flush=True)
                except Exception as e:
                    print(f"S={s} causal={int(causal)} {pass_:5} {cfg:14} failed: {str(e).splitlines()[0][:100]}", flush=True)
    os.environ.pop("EJGEN_TRITON_CONFIG", None)
    return 0


def compare_isolated(configs, cases, d, timeout, jobs=1):
    """Each (case, config) in its own process, `jobs` at a time: a batch compiles side by side (the
    CPU work), then its processes take the GPU one after another with nothing else running (no
    compile steals the CPU that launches the timed kernels), so a sweep costs about the timing plus
    the slowest compile of each batch. A process not compiled within `timeout` is killed before the
    timing starts. 'cudnn' is a config: the peer, timed in the same run."""
    import shutil
    import subprocess
    import tempfile
    import time

    if jobs < 1:
        raise SystemExit("--jobs must be at least 1")
    sync = tempfile.mkdtemp(prefix="ejgen-tune-")
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # N processes share one GPU
    todo = [(case, cfg) for case in cases.split(",") for cfg in configs]
    results = {}
    ready = lambda i: os.path.exists(f"{sync}/{i}.ready")
    try:
        for start in range(0, len(todo), jobs):
            batch = []
            try:
                for i, (case, cfg) in enumerate(todo[start:start + jobs], start):
                    cmd = [sys.executable, "-u", __file__, "--d", str(d), "--one", f"{case}|{cfg}"]
                    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # no pipe to fill up
                    proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True,
                                            env=dict(env, EJGEN_TUNE_SYNC=f"{sync}/{i}", EJGEN_TUNE_WAIT=str(timeout)))
                    batch.append((case, cfg, proc, out, err, i))
                t0 = time.monotonic()
                while (any(p.poll() is None and not ready(i) for _, _, p, _, _, i in batch)
                       and time.monotonic() - t0 < timeout):
                    time.sleep(0.2)  # every process compiled (or gone)
                killed = set()
                for _, _, proc, _, _, i in batch:
                    if proc.poll() is None and not ready(i):  # still compiling: it would disturb the timing
                        proc.kill()
                        proc.wait()
                        killed.add(i)
                for case, cfg, proc, out_f, err_f, i in batch:
                    open(f"{sync}/{i}.go", "w").close()  # its turn on the GPU
                    try:
                        proc.wait(timeout)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                    out_f.seek(0)
                    err_f.seek(0)
                    out, err = out_f.read(), err_f.read()
                    lines = [l for l in out.splitlines() if l.startswith("S=")]
                    if lines:
                        line = "\n".join(lines)
                    elif i in killed:
                        line = f"{case} {cfg or 'table'}: not compiled within {timeout:.0f} s (hang or slow compile)"
                    else:
                        last = err.strip().splitlines()[-1][:160] if err.strip() else ""
                        line = f"{case} {cfg or 'table'}: no result (rc {proc.returncode}): {last}"
                    results[(case, cfg)] = line
                    print(line, flush=True)
            finally:  # an interrupted sweep leaves no process waiting for its turn
                for _, _, proc, out_f, err_f, _ in batch:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
                    out_f.close()
                    err_f.close()
    finally:
        shutil.rmtree(sync, ignore_errors=True)
    print("\nIn order (x cuDNN: its time over the config's, same run):", flush=True)
    for case in cases.split(","):
        ref = _times(results.get((case, "cudnn"), ""))
        for cfg in configs:
            line = results.get((case, cfg), "")
            t = _times(line)
            ratio = (f"  x cuDNN fwd {ref[0] / t[0]:.2f} fwd+bwd {ref[1] / t[1]:.2f}" if ref and t and cfg != "cudnn" else "")
            print(line.splitlines()[0] + ratio if line else f"{case} {cfg}: missing", flush=True)
    return 0


def _times(line):
    import re

    m = re.search(r"fwd\s+([\d.]+) ms\s+fwd\+bwd\s+([\d.]+) ms", line)
    return (float(m.group(1)), float(m.group(2))) if m else None


class _gpu_turn:
    """Wait for this process's turn on the GPU (EJGEN_TUNE_SYNC, set by compare_isolated: say it is
    compiled, wait for the go); a no-op without it. Gives up if the sweep is gone or after its timeout."""

    def __enter__(self):
        import time

        path = os.environ.get("EJGEN_TUNE_SYNC")
        if path:
            open(path + ".ready", "w").close()
            parent, deadline = os.getppid(), time.monotonic() + 2 * float(os.environ.get("EJGEN_TUNE_WAIT", "600"))
            while not os.path.exists(path + ".go"):
                if os.getppid() != parent or time.monotonic() > deadline:
                    raise SystemExit("tune_triton: the sweep that started this process is gone")
                time.sleep(0.05)

    def __exit__(self, *exc):
        pass


def case_inputs(case: str, d: int, h: int = 16):
    """"S:causal[:left window]" -> (label, causal, window, (q, k, v), dO): bf16, B * S = 32k tokens."""
    s, causal, *window = (int(x) for x in case.split(":"))
    window = (window[0], 0) if window else None
    b = 32768 // s
    ks = jax.random.split(jax.random.PRNGKey(s), 4)
    q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in ks[:3])
    do = jax.random.normal(ks[3], (b, s, h, d), jnp.bfloat16)
    return f"S={s} causal={causal} window={window}", bool(causal), window, (q, k, v), do


def case_fns(cfg: str, causal: bool, window, do):
    """(forward, forward+backward) of one setting: 'cudnn' (the peer), or an EJGEN_TRITON_CONFIG value
    ('' = the table; set here, read when the functions are traced)."""
    if cfg == "cudnn":
        f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, local_window_size=window,
                                                         implementation="cudnn")
    else:
        os.environ["EJGEN_TRITON_CONFIG"] = cfg
        f = lambda q, k, v: flash_attention(q, k, v, causal=causal, sliding_window=window, platform="triton")
    g = lambda q, k, v: jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * do), (0, 1, 2))(q, k, v)
    return f, g


def compare(configs, cases, d, h=16):
    for case in cases.split(","):
        label, causal, window, (q, k, v), do = case_inputs(case, d, h)
        for cfg in configs:
            f, g = case_fns(cfg, causal, window, do)
            try:
                f_c, g_c = jax.jit(f).lower(q, k, v).compile(), jax.jit(g).lower(q, k, v).compile()  # CPU work: side by side
                with _gpu_turn():
                    t_f, t_fb = bench(f_c, (q, k, v), reps=30, warmup=3), bench(g_c, (q, k, v), reps=20, warmup=2)
                print(f"{label} {cfg or 'table':60} fwd {t_f * 1e3:7.3f} ms  "
                      f"fwd+bwd {t_fb * 1e3:7.3f} ms", flush=True)
            except Exception as e:
                print(f"{label} {cfg or 'table':60} failed: {str(e).splitlines()[0][:100]}",
                      flush=True)
    os.environ.pop("EJGEN_TRITON_CONFIG", None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
