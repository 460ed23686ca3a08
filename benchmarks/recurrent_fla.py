"""flash-linear-attention's kernels on the shapes of benchmarks/recurrent.py, in a process of their own (torch), for
ejgen's table: chunk_gla and fused_recurrent_gla (gk), chunk_simple_gla (g; and g_gamma, lightning's decays),
bf16, H = 16, K = V = 128, B4 T4096 and B2 T16384, forward and forward+backward. Writes {"<kernel>|<shape>|<pass>":
ms} (median of --reps timed runs after warm-up, CUDA events), and "tuning": what the first call of each case cost.

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl  # fla-core, fla
    PYTHONPATH=/tmp/site python3 benchmarks/recurrent_fla.py --out $OUT/fla.json [--cases chunk_gla|B4,fused]

Progress goes to stderr before every call (kernel, shape, pass, seconds since start) and the JSON is rewritten after
every case, so a run cut short by a timeout keeps what it measured.

Autotuning. fla 0.6.0 autotunes every Triton kernel on its first call for a key (block sizes, warps, stages: 4 to 48
configs a kernel, ~300 for chunk_gla forward + backward). Triton compiles the configs one after another and then
times each (triton.testing.do_bench, ~0.1 s a config): a fresh H200 spent > 240 s on the first case. Three things
cut that here, none of them changes what fla computes or which config it picks:
  * the configs of a kernel are compiled in parallel before Triton times them (--compile-threads, default the CPU
    count up to 16): Triton's own AsyncCompileMode (the mechanism its autotuners and torch use for parallel compiles)
    around a warm-up launch of each config, from Autotuner._bench's first call for a key; the timings and the choice
    are then Triton's, unchanged. Compiling dominates a cold autotune; the timing part (~0.1 s a config) stays.
  * Triton's on-disk autotune cache, which fla turns on (FLA_CACHE_RESULTS=1, its default: `cache_results=True` on
    every autotuner; TRITON_CACHE_AUTOTUNING=1 is set too): a key tuned once is not tuned again while
    TRITON_CACHE_DIR survives (benchmarks/recurrent_session.sh keeps it under bench-out/ for the session).
  * those cache entries (<TRITON_CACHE_DIR>/<hash>/<kernel>.autotune.json: the timings of every config, a few KB)
    are copied out after every case to <dir of --out>/fla_tuned/<GPU>/ and, at the start, copied in from --tuned
    (default benchmarks/fla_tuned/) for the same GPU name: commit a session's $OUT/.../fla_tuned/ there and the next
    fresh host compiles one config a kernel instead of tuning (Triton's cache key covers Triton's version, the
    compiler, the kernel's source, the key's values and dtypes and the config list, so a stale entry is only unused).
fla's own config directory (FLA_CACHE_MODE / FLA_CONFIG_DIR) is not used: the wheel ships none, and kernels decorated
with plain triton.autotune (chunk_fwd_kernel_h, chunk_bwd_kernel_dh) do not read it. A warm-up on a smaller shape
sharing the autotune keys (T is in none of chunk_gla's keys) was not taken: it would time the configs on another
shape and could pick others for the timed one, and do_bench's cost is per config, not per shape.

The forward+backward pass takes torch.autograd.grad (no .grad accumulation: an extra add per input each call).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
SHAPES = {"B4-T4096": (4, 4096), "B2-T16384": (2, 16384)}
KERNELS = ("chunk_gla", "chunk_simple_gla", "chunk_simple_gla_gamma", "fused_recurrent_gla")
STATS = {"compile_s": 0.0, "configs": 0, "kernels": 0}


def log(msg: str):
    print(f"[fla {time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def timed(fn, reps: int) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(4):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 4)
    return statistics.median(times)


def profile(fn, calls: int = 8) -> dict:
    """{kernel name: device us a call} over `calls` calls under torch.profiler (after the timed runs: tuned, warm)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if us > 0:
            per[ev.key[:90]] = round(us / calls, 2)
    per = dict(sorted(per.items(), key=lambda kv: -kv[1]))
    for name, us in per.items():
        log(f"  {us:9.2f} us  {name}")
    return per


def compile_configs_in_parallel(workers: int) -> bool:
    """Before Triton times a kernel's configs for a new key (Autotuner._bench's first call in a run), launch each
    config once as a warm-up (compile only) inside triton.AsyncCompileMode on `workers` threads; the timing loop then
    finds them compiled. Configs that fail to compile are left to Triton's own loop (ignore_errors), which reports
    them as it always does."""
    import triton
    from triton.runtime.autotuner import Autotuner

    mode = getattr(triton, "AsyncCompileMode", None)
    if workers < 2 or mode is None:
        log(f"configs compile one at a time (threads {workers}, AsyncCompileMode {mode is not None})")
        return False
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(workers, thread_name_prefix="triton-compile")
    bench = Autotuner._bench

    def _bench(self, *args, config, **meta):
        nargs = getattr(self, "nargs", None)
        if nargs is not None and getattr(self, "_ejgen_compiled_for", None) is not nargs:
            self._ejgen_compiled_for = nargs  # once per run(): run() makes a new nargs dict every call
            t0 = time.perf_counter()
            try:
                configs = self.prune_configs(meta)
                with mode(pool, ignore_errors=True):
                    for c in configs:
                        self.fn.run(*args, **{**meta, **c.all_kwargs(), "warmup": True})
                STATS["configs"] += len(configs)
                STATS["kernels"] += 1
            except Exception as e:  # noqa: BLE001 - Triton's serial path compiles what this could not
                log(f"parallel compile of {getattr(self.base_fn, '__name__', '?')} failed, serial: {e!r:.200}")
            STATS["compile_s"] += time.perf_counter() - t0
        return bench(self, *args, config=config, **meta)

    Autotuner._bench = _bench
    log(f"configs compile on {workers} threads (triton {triton.__version__})")
    return True


def _gpu_dir(name: str) -> str:
    return re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_")


def _triton_cache() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def restore_tuning(src: Path) -> int:
    """Copy <src>/*/*.autotune.json into Triton's cache (same <hash>/ folders); returns how many."""
    n = 0
    for f in src.glob("*/*.autotune.json"):
        dst = _triton_cache() / f.parent.name / f.name
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst)
            n += 1
    return n


def save_tuning(dst: Path) -> int:
    n = 0
    for f in _triton_cache().glob("*/*.autotune.json"):
        out = dst / f.parent.name / f.name
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, out)
            n += 1
    return n


def write(path: Path, res: dict):
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    tmp.replace(path)


def make_calls(b: int, t: int):
    """({kernel: (call, the inputs it has gradients for)}, do) at B b, T t."""
    import torch
    from fla.ops.gla import chunk_gla, fused_recurrent_gla
    from fla.ops.simple_gla import chunk_simple_gla

    h, d = 16, 128
    dev, bf16 = "cuda", torch.bfloat16
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, t, h, d, device=dev, dtype=bf16, requires_grad=True) for _ in range(3))
    gk = (torch.nn.functional.logsigmoid(torch.randn(b, t, h, d, device=dev)) / 16).requires_grad_()
    g = (torch.nn.functional.logsigmoid(torch.randn(b, t, h, device=dev)) / 16).requires_grad_()
    gamma = -(8.0 / h) * (torch.arange(h, device=dev, dtype=torch.float32) + 1) * math.log(2.0) / 8
    do = torch.randn(b, t, h, d, device=dev, dtype=bf16)
    calls = {
        "chunk_gla": (lambda: chunk_gla(q, k, v, gk, output_final_state=True), (q, k, v, gk)),
        "chunk_simple_gla": (lambda: chunk_simple_gla(q, k, v, g=g, output_final_state=True), (q, k, v, g)),
        "chunk_simple_gla_gamma": (lambda: chunk_simple_gla(q, k, v, g_gamma=gamma, output_final_state=True),
                                   (q, k, v)),
    }
    if t <= 4096:  # forward only
        calls["fused_recurrent_gla"] = (lambda: fused_recurrent_gla(q, k, v, gk=gk, output_final_state=True), ())
    return calls, do


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-out/recurrent/fla.json")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--cases", default="", help="comma-separated substrings of '<kernel>|<shape>|<pass>' (default all)")
    p.add_argument("--compile-threads", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--profile", action="store_true",
                   help="after timing, each timed case's kernels under torch.profiler: device time a call by kernel")
    p.add_argument("--tuned", default=str(Path(__file__).resolve().parent / "fla_tuned"),
                   help="autotune results of earlier runs, <dir>/<GPU name>/<hash>/<kernel>.autotune.json")
    args = p.parse_args()
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # fla asks for it on its autotuners already
    toks = [t for t in args.cases.split(",") if t]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log("importing torch, fla")
    import torch

    gpu = _gpu_dir(torch.cuda.get_device_name())
    n = restore_tuning(Path(args.tuned) / gpu)
    log(f"{n} autotune results restored from {Path(args.tuned) / gpu} into {_triton_cache()}")
    compile_configs_in_parallel(args.compile_threads)
    res = {"device": torch.cuda.get_device_name(), "tuning": {}}
    tuned_out = out.parent / "fla_tuned" / gpu
    for label, (b, t) in SHAPES.items():
        calls, do = make_calls(b, t)
        for name, (call, leaves) in calls.items():
            def fwd_bwd(call=call, leaves=leaves, do=do):
                o, _ = call()
                torch.autograd.grad(o, leaves, do)

            for pass_, fn in (("fwd", call), ("fwd+bwd", fwd_bwd)):
                key = f"{name}|{label}|{pass_}"
                if (pass_ == "fwd+bwd" and not leaves) or (toks and not any(tok in key for tok in toks)):
                    continue
                before = dict(STATS)
                log(f"{key}: first call (autotunes what is not tuned yet)")
                t0 = time.perf_counter()
                try:
                    with torch.no_grad() if pass_ == "fwd" else torch.enable_grad():
                        fn()
                        torch.cuda.synchronize()
                        first = time.perf_counter() - t0
                        log(f"{key}: first call {first:.1f} s ({STATS['kernels'] - before['kernels']} kernels tuned, "
                            f"{STATS['configs'] - before['configs']} configs compiled in "
                            f"{STATS['compile_s'] - before['compile_s']:.1f} s); timing")
                        res[key] = timed(fn, args.reps)
                        if args.profile:
                            res.setdefault("kernels", {})[key] = profile(fn)
                    res["tuning"][key] = {"first_call_s": round(first, 2), "tuned_kernels": STATS["kernels"]
                                          - before["kernels"], "compiled_configs": STATS["configs"] - before["configs"]}
                    log(f"{key}: {res[key]:.3f} ms")
                except Exception as e:  # noqa: BLE001 - record and go on
                    res["tuning"][key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    log(f"{key}: {type(e).__name__}: {str(e)[:300]}")
                write(out, res)
                saved = save_tuning(tuned_out)
                if saved:
                    log(f"{saved} new autotune results copied to {tuned_out}")
    print(f"fla on {res['device']} -> {out}")
    for key, v in res.items():
        if isinstance(v, float):
            print(f"{key:42s} {v:9.3f} ms   (first call {res['tuning'][key]['first_call_s']:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
