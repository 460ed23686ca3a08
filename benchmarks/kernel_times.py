"""Per-kernel GPU times of one forward+backward call, ejgen's triton against cuDNN, under Nsight Compute.

    ncu --clock-control none --cache-control none --profile-from-start off --print-kernel-base demangled --csv --log-file K.csv \\
        --metrics gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size,\\
launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,\\
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \\
        python benchmarks/kernel_times.py --cases 16384:1:1024,4096:1 --configs "cudnn||fwd=..."
    python benchmarks/kernel_times.py --parse K.csv

Every (case, config) is compiled and run first; then, inside the profiled range only, each runs once,
with a marker kernel (torch's fill) between them, so `--parse` can say which kernels belong to which
call. Nsight Compute runs one kernel at a time: the times are each kernel alone on the GPU.
"""

import argparse
import csv
import ctypes
import os
import sys


def run(cases, configs, d, h=16):
    import jax
    import torch

    from tune_triton import case_fns, case_inputs  # this directory's sweep: the same cases and settings

    calls = []
    for case in cases.split(","):
        label, causal, window, args, do = case_inputs(case, d, h)
        for cfg in configs:
            _, g = case_fns(cfg, causal, window, do)
            fn = jax.jit(g).lower(*args).compile()  # the config is read while tracing
            for _ in range(3):
                jax.block_until_ready(fn(*args))
            calls.append((f"{label} {cfg or 'table'}", fn, args))
    os.environ.pop("EJGEN_TRITON_CONFIG", None)
    marker = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    cuda = ctypes.CDLL("libcuda.so.1")
    print("order:", flush=True)
    cuda.cuProfilerStart()
    for name, fn, args in calls:
        marker.fill_(1.0)
        torch.cuda.synchronize()
        jax.block_until_ready(fn(*args))
        print(f"  {name}", flush=True)
    marker.fill_(1.0)
    torch.cuda.synchronize()
    cuda.cuProfilerStop()
    with open(os.environ.get("EJGEN_KERNEL_TIMES_ORDER", "kernel_times.order"), "w") as f:
        f.write("\n".join(name for name, _, _ in calls))


def parse(path, order_path):
    """ncu's CSV (one row per kernel and metric) -> one table per call, kernels in launch order."""
    with open(path) as f:
        lines = f.read().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))
    rows = list(csv.DictReader(lines[start:]))
    kernels = {}
    for r in rows:
        k = kernels.setdefault(int(r["ID"]), {"name": r["Kernel Name"]})
        k[r["Metric Name"]] = r["Metric Value"]
    names = open(order_path).read().splitlines() if os.path.exists(order_path) else []
    groups, current = [], None
    for _, k in sorted(kernels.items()):
        if "elementwise_kernel" in k["name"]:  # the marker (torch's fill)
            current = []
            groups.append(current)
        elif current is not None:
            current.append(k)
    num = lambda k, m: float(k.get(m, "nan").replace(",", "") or "nan")
    for i, group in enumerate(g for g in groups if g):
        total = sum(num(k, "gpu__time_duration.sum") for k in group) / 1e3
        print(f"\n{names[i] if i < len(names) else f'call {i}'}: {total:.1f} us in {len(group)} kernels")
        for k in group:
            short = k["name"].split("(")[0].split("<")[0][-70:]
            print(f"  {num(k, 'gpu__time_duration.sum') / 1e3:9.1f} us  regs {num(k, 'launch__registers_per_thread'):4.0f}"
                  f"  grid {num(k, 'launch__grid_size'):7.0f}  ctas/sm (regs {num(k, 'launch__occupancy_limit_registers'):2.0f}"
                  f", smem {num(k, 'launch__occupancy_limit_shared_mem'):2.0f})  tensor "
                  f"{num(k, 'sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active'):5.1f}%  {short}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="16384:1:1024,4096:1")
    p.add_argument("--configs", default="cudnn|")
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--parse")
    p.add_argument("--order", default=os.environ.get("EJGEN_KERNEL_TIMES_ORDER", "kernel_times.order"))
    args = p.parse_args()
    if args.parse:
        return parse(args.parse, args.order)
    run(args.cases, args.configs.split("|"), args.d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
