"""flash-linear-attention's kernels on the shapes of benchmarks/recurrent.py, in a process of their own (torch), for
ejgen's table: chunk_gla and fused_recurrent_gla (gk), chunk_simple_gla (g; and g_gamma, lightning's decays),
bf16, H = 16, K = V = 128, B4 T4096 and B2 T16384, forward and forward+backward. Writes {"<kernel>|<shape>|<pass>":
ms} (median of --reps timed runs after warm-up, CUDA events).

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl  # fla-core, fla
    PYTHONPATH=/tmp/site python3 benchmarks/recurrent_fla.py --out $OUT/fla.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch


def timed(fn, reps: int) -> float:
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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench-out/recurrent/fla.json")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    from fla.ops.gla import chunk_gla, fused_recurrent_gla
    from fla.ops.simple_gla import chunk_simple_gla

    h, d = 16, 128
    dev, bf16 = "cuda", torch.bfloat16
    res = {}
    for label, (b, t) in {"B4-T4096": (4, 4096), "B2-T16384": (2, 16384)}.items():
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, t, h, d, device=dev, dtype=bf16, requires_grad=True) for _ in range(3))
        gk = (torch.nn.functional.logsigmoid(torch.randn(b, t, h, d, device=dev)) / 16).requires_grad_()
        g = (torch.nn.functional.logsigmoid(torch.randn(b, t, h, device=dev)) / 16).requires_grad_()
        gamma = -(8.0 / h) * (torch.arange(h, device=dev, dtype=torch.float32) + 1) * math.log(2.0) / 8
        do = torch.randn(b, t, h, d, device=dev, dtype=bf16)
        calls = {
            "chunk_gla": lambda: chunk_gla(q, k, v, gk, output_final_state=True),
            "chunk_simple_gla": lambda: chunk_simple_gla(q, k, v, g=g, output_final_state=True),
            "chunk_simple_gla_gamma": lambda: chunk_simple_gla(q, k, v, g_gamma=gamma, output_final_state=True),
        }
        if t <= 4096:
            calls["fused_recurrent_gla"] = lambda: fused_recurrent_gla(q, k, v, gk=gk, output_final_state=True)
        for name, call in calls.items():
            with torch.no_grad():
                res[f"{name}|{label}|fwd"] = timed(call, args.reps)

            def fwd_bwd(call=call):
                o, _ = call()
                o.backward(do)

            if not name.startswith("fused"):
                res[f"{name}|{label}|fwd+bwd"] = timed(fwd_bwd, args.reps)
            print(name, label, {key: f"{v:.3f} ms" for key, v in res.items() if key.startswith(f"{name}|{label}")},
                  flush=True)
    res["device"] = torch.cuda.get_device_name()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
