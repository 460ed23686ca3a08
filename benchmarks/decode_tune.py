"""Launch settings of the Triton decode kernel (issue 16; `ejgen.runtime.attention.triton.decode`), measured on one
GPU: the settings of NAMES (BLOCK_N, NUM_STAGES, NUM_WARPS, WAVES, PROGRAMS_PER_SM, MAX_SPLIT_KEYS, PAGES_AHEAD,
WHOLE_PAGE; `--settings` or a built-in list) over the decode benchmark's batches
(benchmarks/decode.py), cuDNN timed in the same run for scale. Every setting of a case is compiled, then all are timed in `--rounds` interleaved rounds
(median of medians) of `--calls` calls a sample. Prints a table of µs per case with the best setting per case marked,
and the geometric mean of cuDNN time / time over cases per setting.

    python3 benchmarks/decode_tune.py --out $OUT/decode_tune [--budget-s 420] [--cases decode-B4,paged16-B8]

Settings are module constants read when a call is traced: each setting retraces and recompiles.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import decode as bench  # noqa: E402  (benchmarks/decode.py: cases, inputs, impls)
import jax  # noqa: E402
import numpy as np  # noqa: E402

from ejgen.runtime.attention import split_k  # noqa: E402
from ejgen.runtime.attention.triton import decode as host  # noqa: E402
from ejgen.testing.timing import median_seconds  # noqa: E402

CASES = ("decode-B8-S8k", "decode-B32-S8k", "decode-B4-S32k", "decode-B32-ragged16k", "paged16-B8-S8k",
         "paged16-B32-ragged16k", "paged64-B32-ragged16k")


NAMES = ("BLOCK_N", "stages", "warps", "waves", "programs/SM", "max split keys", "pages ahead", "whole page")


def current():
    return (host.BLOCK_N, host.NUM_STAGES, host.NUM_WARPS, split_k.WAVES, split_k.PROGRAMS_PER_SM,
            split_k.MAX_SPLIT_KEYS, int(host.PAGES_AHEAD), int(host.WHOLE_PAGE))


def settings(quick: bool, given: str = ""):
    """The settings (NAMES) to time, the current default first: ``given`` ("64,3,4,1,2,4096,1;..."; a tuple shorter
    than NAMES keeps the defaults of the rest) or a built-in list."""
    base = current()
    more = ([tuple(int(x) for x in t.split(",")) for t in given.split(";") if t.strip()] if given else
            [(64, 3, 4, 1, 2, 4096), (64, 2, 4, 1, 4, 2048), (64, 2, 4, 1, 3, 4096), (128, 3, 8, 1, 2, 4096),
             (64, 2, 4, 2, 4, 4096), (64, 3, 4, 1, 3, 4096)])
    if any(len(m) > len(NAMES) for m in more):
        raise SystemExit(f"decode_tune.py --settings {given!r}: at most {len(NAMES)} numbers a setting "
                         f"({', '.join(NAMES)})")
    more = [m + base[len(m):] for m in more]
    out = [base] + [s for s in more if s != base]
    return out[:3] if quick else out


def apply(setting):
    (host.BLOCK_N, host.NUM_STAGES, host.NUM_WARPS, split_k.WAVES, split_k.PROGRAMS_PER_SM,
     split_k.MAX_SPLIT_KEYS, ahead, whole) = setting
    host.PAGES_AHEAD, host.WHOLE_PAGE = bool(ahead), bool(whole)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-out/decode_tune")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--budget-s", type=float, default=420)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--settings", default="", help="';'-separated settings to time after the default (see NAMES)")
    p.add_argument("--calls", type=int, default=8, help="calls a sample dispatches back to back")
    args = p.parse_args()
    t_start = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    hq, hkv, dim = 32, 8, 128
    wanted = [c for c in args.cases.split(",") if c]
    cases = [c for c in bench.make_cases(False) if c.name in wanted]
    print(jax.devices()[0].device_kind, flush=True)
    prepared = {}  # case -> (inputs, impls, reference output); every case's cache stays on the device
    cudnn = {}
    for case in cases:
        rng = jax.random.PRNGKey(case.batch * 7 + case.seq)
        k = jax.random.normal(rng, (case.batch, case.seq, hkv, dim), jax.numpy.bfloat16)
        kv = dict(k=k, v=jax.random.normal(jax.random.fold_in(rng, 1), k.shape, k.dtype))
        d = bench.case_inputs(case, kv, hq)
        impls = bench.impls_for(case, d, True)
        ref_name = "cudnn" if "cudnn" in impls else "cudnn-paged"
        fn, fargs = impls[ref_name][0]()
        exe = jax.jit(fn).lower(*fargs).compile()
        prepared[case.name] = (d, impls, bench.to_f32(exe(*fargs), d["out_shape"]))
        cudnn[case.name] = 1e6 * statistics.median(
            median_seconds(exe, fargs, args.reps, warmup=1, warm_seconds=0.3, batch=args.calls)
            for _ in range(args.rounds))
        print(f"{case.name}: {ref_name} {cudnn[case.name]:.1f} us", flush=True)
    results = {}  # (setting, case) -> us
    chosen = settings(args.quick, args.settings)
    for case in cases:
        if time.perf_counter() - t_start > args.budget_s:
            print(f"budget spent: cases from {case.name} on not run", flush=True)
            break
        d, impls, ref_out = prepared[case.name]
        compiled = {}
        for s in chosen:
            apply(s)
            try:
                fn, fargs = impls["ejgen-triton"][0]()
                exe = jax.jit(fn).lower(*fargs).compile()
                out = bench.to_f32(exe(*fargs), d["out_shape"])
            except Exception as e:  # noqa: BLE001 - a setting that does not compile or fit is recorded
                print(f"  {s} {case.name}: {bench.short_error(e)}", flush=True)
                continue
            compiled[s] = (exe, fargs)
            print(f"  {s} {case.name}: max|d| vs cuDNN {float(np.max(np.abs(out - ref_out))):.1e}", flush=True)
        times = {s: [] for s in compiled}
        for r in range(args.rounds):
            for s, (exe, fargs) in compiled.items():
                times[s].append(median_seconds(exe, fargs, args.reps, warmup=1, warm_seconds=0.3 if r == 0 else 0.05,
                                               batch=args.calls))
        for s, ts in times.items():
            results[(s, case.name)] = statistics.median(ts) * 1e6
            print(f"  {s} {case.name}: {results[(s, case.name)]:.1f} us "
                  f"({cudnn[case.name] / results[(s, case.name)]:.2f}x cuDNN)", flush=True)
        del compiled
    apply(chosen[0])
    names = [c.name for c in cases]
    lines = ["| " + ", ".join(NAMES) + " | " + " | ".join(names)
             + " | geomean vs cuDNN |",
             "|---" * (len(names) + 2) + "|"]
    best = {n: min((us for (s, c), us in results.items() if c == n), default=None) for n in names}
    for s in chosen:
        row = [results.get((s, n)) for n in names]
        cells = [("n/a" if us is None else f"{us:.1f}" + (" *" if us == best[n] else "")) for us, n in zip(row, names)]
        ratios = [cudnn[n] / us for us, n in zip(row, names) if us is not None]
        gm = math.exp(statistics.mean(math.log(r) for r in ratios)) if len(ratios) == len(names) else None
        lines.append(f"| {s} | " + " | ".join(cells) + f" | {'n/a' if gm is None else f'{gm:.3f}'} |")
    lines.append("| cuDNN | " + " | ".join(f"{cudnn[n]:.1f}" for n in names) + " | 1 |")
    text = "\n".join(lines)
    print(text)
    (out_dir / "decode_tune.md").write_text(jax.devices()[0].device_kind + "\n\n" + text + "\n")
    (out_dir / "decode_tune.json").write_text(json.dumps(
        dict(device=jax.devices()[0].device_kind, cudnn=cudnn,
             results=[dict(setting=list(s), case=c, us=us) for (s, c), us in results.items()]), indent=1))


if __name__ == "__main__":
    main()
