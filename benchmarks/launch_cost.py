"""What one Triton kernel launch costs the host, by the size of the kernel's PTX (issues 14 and 15: the host slice of
the Hopper forward's custom call takes 70-90 us in a profiled documents or Flamingo call; jaxlib finds a launch's
kernel by hashing and comparing the call's whole opaque, its zlib-compressed PTX included, on every launch).

A probe kernel (one program: REPEAT dependent multiply-adds unrolled, so its PTX grows with REPEAT while it runs for
microseconds) is launched CHAIN times in one jitted function through ejgen's launch path (`triton_call.launch`);
`calls` such functions are dispatched back to back and waited for once. The host is the bottleneck (the kernels are
tiny), so the time per launch is the host's cost of one launch. Prints, per REPEAT: the PTX bytes, its compressed
bytes (what the opaque carries), us per launch.

    python3 benchmarks/launch_cost.py [--repeats 1,512,2048,8192] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from ejgen.runtime.launch import triton_call  # noqa: E402

CHAIN = 8


@triton.jit
def launch_probe_kernel(X, Y, REPEAT: tl.constexpr):
    x = tl.load(X + tl.arange(0, 32))
    for i in tl.static_range(REPEAT):
        x = x * 1.0001 + (i % 7) * 0.5
    tl.store(Y + tl.arange(0, 32), x)


_LAST_PTX: list = []  # the PTX ejgen's launch path last handed to jaxlib (recorded by `_record`)


def _record():
    """Record each PTX the launch path finishes (`triton_call.strip_debug` is its last step), so the sizes are those of
    the opaques jaxlib hashes, with no compile of our own (Triton's cache manager refused one on the GPU host)."""
    strip = triton_call.strip_debug

    def recording(ptx: str) -> str:
        out = strip(ptx)
        _LAST_PTX.append(out)
        return out

    triton_call.strip_debug = recording


def ptx_bytes() -> tuple[int, int]:
    ptx = _LAST_PTX[-1] if _LAST_PTX else ""
    return len(ptx), len(zlib.compress(ptx.encode()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", default="1,512,2048,8192")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", default="bench-out/launch")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    x = jnp.ones((32,), jnp.float32)
    _record()
    rows = []
    print(f"{jax.devices()[0].device_kind}; {CHAIN} launches a call, {args.calls} calls back to back", flush=True)
    print("| REPEAT | PTX bytes | compressed | us per launch |\n|---|---|---|---|", flush=True)
    for repeat in [int(r) for r in args.repeats.split(",") if r]:
        def chain(x, repeat=repeat):
            for _ in range(CHAIN):
                (x,) = triton_call.launch(launch_probe_kernel, (1,), [x], [jax.ShapeDtypeStruct((32,), jnp.float32)],
                                          num_warps=1, REPEAT=repeat)
            return x

        fn = jax.jit(chain)
        jax.block_until_ready(fn(x))
        for _ in range(3):
            jax.block_until_ready([fn(x) for _ in range(args.calls)])
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready([fn(x) for _ in range(args.calls)])
            best = min(best, (time.perf_counter() - t0) / args.calls / CHAIN * 1e6)
        size, packed = ptx_bytes()
        rows.append(dict(repeat=repeat, ptx=size, compressed=packed, us=round(best, 2)))
        print(f"| {repeat} | {size} | {packed} | {best:.2f} |", flush=True)
    (out / "launch.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
