"""The ring's second step priced apart on one GPU (issue 18, notes/studies/s37-ring-fwd.md, finding 1): at 32k tokens
over 2 GPUs each device's second step is one wide Hopper forward of its 16k local rows against the 16k keys it
received, through a 2 x 2 block layout of 8k chunks (`ring._wide_layout`: device 0 [[0, 0], [1, 1]], device 1
[[1, 0], [1, 0]]); its blocks cost 1.58-1.61 SM-us against ~1.45 for the same work unmasked. This times, under the
profiler (the last of 3 single calls, kernel us), the forward of:

- the same work as plain calls: 8k queries x 16k keys (device 0's) and 16k x 8k (device 1's), unmasked;
- the wide call's block lists (`blocksparse_attention` with `BlockMask.from_layout` of 8k tiles): each device's
  layout, and all four chunks visible (against plain 16k x 16k: what the lists and their tile order cost alone);

and gives SM-us a visible block (kernel us x SMs / (visible BLOCK_M x BLOCK_N blocks)). What the ring's wide call
adds beyond these (its merge into the first step's result, K and V read out of the received buffer) is not here.
Every call takes the dynamic tile queue, as the ring's steps do (`ring.GLUON_DYNAMIC_TILES`).
Hopper GPUs only (`--cpu-smoke`: the calls
on the CPU, small, untimed).

    python benchmarks/wide_step.py [--heads 16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's ejgen, run from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))

D = 128
LAYOUTS = {"dev0": [[False, False], [True, True]], "dev1": [[True, False], [True, False]],
           "all": [[True, True], [True, True]]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16384, help="a device's local rows (two chunks of rows / 2)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--cpu-smoke", action="store_true", help="each call once on the CPU at 512 rows, 2 heads (xla)")
    p.add_argument("--out", default="bench-out/wide-step")
    return p.parse_args(argv)


def cases(rows: int):
    """(name, q rows, key rows, layout or None): the plain calls, then the layouts."""
    c = rows // 2
    plain = [("plain 8k x 16k", c, rows, None), ("plain 16k x 8k", rows, c, None),
             ("plain 16k x 16k", rows, rows, None)]
    return plain + [(f"layout {name}", rows, rows, layout) for name, layout in LAYOUTS.items()]


def visible_keys(sq: int, sk: int, layout) -> int:
    """(query row, key) pairs the call computes."""
    if layout is None:
        return sq * sk
    c_q, c_k = sq // len(layout), sk // len(layout[0])
    return sum(c_q * c_k for row in layout for seen in row if seen)


def call(sq: int, sk: int, layout, heads: int, platform: str):
    import jax
    import jax.numpy as jnp

    from ejgen.ops import blocksparse_attention, flash_attention
    from ejgen.types import BlockMask

    keys = jax.random.split(jax.random.PRNGKey(sq + 3 * sk), 3)
    q = jax.random.normal(keys[0], (1, sq, heads, D), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (1, sk, heads, D), jnp.bfloat16) for kk in keys[1:])
    if layout is None:
        fn = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=False, platform=platform))
    else:
        mask = BlockMask.from_layout(jnp.asarray(layout), sq, sk, sq // len(layout), sk // len(layout[0]))
        fn = jax.jit(lambda q, k, v: blocksparse_attention(q, k, v, block_mask=mask, causal=False,
                                                           platform=platform))
        q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))  # (the seed's blocksparse takes [B, H, S, D])
    return fn, (q, k, v)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.cpu_smoke:
        import jax

        for name, sq, sk, layout in cases(512):
            fn, inputs = call(sq, sk, layout, 2, "xla")
            print(name, jax.block_until_ready(fn(*inputs)).shape, flush=True)
        return 0
    from ejgen.runtime.attention.gluon import host as gluon_host
    from ejgen.runtime.core import settings
    from trace_table import _is_device, last_call, load, profile

    sms, block_m, block_n = gluon_host.num_sms(), gluon_host.BLOCK_M, gluon_host.TILES["BLOCK_N"]
    rows = []
    for name, sq, sk, layout in cases(args.rows):
        blocks = visible_keys(sq, sk, layout) // (block_m * block_n) * args.heads
        row = dict(case=name, sq=sq, sk=sk, blocks=blocks)
        try:
            fn, inputs = call(sq, sk, layout, args.heads, "triton")
            trace_dir = out / f"trace-{name.replace(' ', '-')}"
            with settings.settings(gluon_dynamic_tiles=True):  # (as the ring's steps ask: ring.GLUON_DYNAMIC_TILES)
                profile(fn, inputs, trace_dir, calls=3, label=name)
            slices = last_call([s for s in load(trace_dir) if _is_device(s["process"])], 1000.0)
            row["us"] = sum(s["dur"] for s in slices if "gluon_attention_fwd" in s["name"])
            row["sm_us_block"] = row["us"] * sms / blocks
        except Exception as e:  # noqa: BLE001  (a row says what failed; the others still run)
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        print(row, flush=True)
    lines = [f"SMs {sms}, heads {args.heads}, D {D}, bf16, B 1, blocks of {block_m} x {block_n}; kernel us of the "
             "last of 3 traced calls", "",
             "| case | Sq x Sk | visible blocks | fwd us | SM-us a block |",
             "|---|---|---|---|---|"]
    for r in rows:
        tail = r["error"] if "error" in r else f"{r['us']:.1f} | {r['sm_us_block']:.3f}"
        lines.append(f"| {r['case']} | {r['sq']} x {r['sk']} | {r['blocks']} | {tail} |")
    text = "\n".join(lines)
    print(text)
    (out / "wide_step.md").write_text(text + "\n")
    (out / "wide_step.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
