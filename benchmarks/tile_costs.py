"""What a block of work costs the Hopper kernels at each length: the Gluon forward and backward kernels traced alone
(issues 14 and 18: short lists and 16k-sized ring steps run at another rate than long sequences).

    python benchmarks/tile_costs.py [--seqs 4096,8192,16384,32768,65536] [--heads 16] [--l2-kv-budget 32]

Each case is one `flash_attention(..., platform="triton")` call (B 1, D 128, bf16, causal and unmasked) and its
gradient, traced three times (`trace_table.profile`: each call alone, 5 ms apart; the last call's kernels read). The
forward's work is counted in tiles (BLOCK_M query rows of one head) and the key blocks they visit, the backward's in
programs ((key block, kv head) pairs) and items ((query block, query head) pairs a program walks). The table gives
each kernel's time, its counts and SM-us a block (an item): kernel us x SMs / blocks. Session 37 (one H200) found no
fixed cost a tile that a linear fit over lengths could separate: a block's cost itself moves with the length (K and V
out of L2 or not), 1.49-1.67 SM-us unmasked, 1.52-2.13 causal. `--l2-kv-budget` repeats the causal cases with other
head sections of the forward's tile order (`gluon.host.L2_KV_BUDGET`, MiB). Hopper GPUs only. Traces are single
calls on an idle GPU (boost clocks): compare rows of one run, not with timed tables.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's ejgen, run from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))


D = 128


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="4096,8192,16384,32768,65536", help="sequence lengths (multiples of 128)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--l2-kv-budget", default="", help="comma-separated MiB: the causal cases again at each")
    p.add_argument("--out", default="bench-out/tile-costs")
    return p.parse_args(argv)


def counts(seq: int, heads: int, causal: bool, block_m: int, block_n: int, bwd_m: int, bwd_n: int) -> dict:
    """The forward's tiles, key blocks and diagonal blocks, the backward's programs and items (one kv head a query
    head here)."""
    n_m, n_n = -(-seq // block_m), -(-seq // block_n)
    if causal:  # a tile's blocks up to its last row's
        blocks = sum(min(n_n, ((i + 1) * block_m + block_n - 1) // block_n) for i in range(n_m))
    else:
        blocks = n_m * n_n
    p_n, p_m = -(-seq // bwd_n), -(-seq // bwd_m)
    items = sum(p_m - (j * bwd_n) // bwd_m for j in range(p_n)) if causal else p_n * p_m
    return dict(tiles=n_m * heads, blocks=blocks * heads, diagonals=n_m * heads if causal else 0,
                programs=p_n * heads, items=items * heads, bwd_diagonals=p_n * heads if causal else 0)


def kernel_us(text_slices, name: str) -> float:
    durs = [s["dur"] for s in text_slices if name in s["name"]]
    return float(sum(durs))


def measure(seq: int, heads: int, causal: bool, out: Path) -> dict:
    import jax
    import jax.numpy as jnp

    from ejgen.ops import flash_attention
    from trace_table import _is_device, last_call, load, profile

    key = jax.random.PRNGKey(seq + causal)
    q, k, v = (jax.random.normal(kk, (1, seq, heads, D), jnp.bfloat16) for kk in jax.random.split(key, 3))

    def loss(q, k, v):
        return flash_attention(q, k, v, causal=causal, platform="triton").astype(jnp.float32).sum()

    fwd = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=causal, platform="triton"))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    got = {}
    for label, fn, kernel in (("fwd", fwd, "gluon_attention_fwd"), ("bwd", grad, "gluon_attention_bwd")):
        trace_dir = out / f"trace-{label}-{seq}-{int(causal)}"
        profile(fn, (q, k, v), trace_dir, calls=3, label=f"{label} S={seq} causal={causal}")
        slices = [s for s in load(trace_dir) if _is_device(s["process"])]
        got[label] = kernel_us(last_call(slices, 1000.0), kernel)
    return got


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from ejgen.runtime.attention.gluon import host as gluon_host

    sms = gluon_host.num_sms()
    seqs = [int(s) for s in args.seqs.split(",") if s.strip()]
    budgets = [None] + [int(b) for b in args.l2_kv_budget.split(",") if b.strip()]
    default_budget = gluon_host.L2_KV_BUDGET
    bwd = gluon_host.BWD_TILES
    rows = []
    for budget in budgets:
        gluon_host.L2_KV_BUDGET = default_budget if budget is None else budget << 20
        for causal in (True, False) if budget is None else (True, ):
            for seq in seqs:
                c = counts(seq, args.heads, causal, gluon_host.BLOCK_M, gluon_host.TILES["BLOCK_N"], bwd["BLOCK_M"],
                           bwd["BLOCK_N"])
                try:
                    got = measure(seq, args.heads, causal, out)
                except Exception as e:  # noqa: BLE001  (a row says what failed; the others still run)
                    rows.append(dict(seq=seq, causal=causal, budget=budget, error=f"{type(e).__name__}: {e}"[:300]))
                    continue
                rows.append(dict(seq=seq, causal=causal, budget=budget, fwd_us=got["fwd"], bwd_us=got["bwd"], **c))
    gluon_host.L2_KV_BUDGET = default_budget
    lines = [f"SMs {sms}, heads {args.heads}, D {D}, bf16, B 1; kernel us of the last of 3 traced calls", "",
             "| S | causal | L2 MiB | fwd us | tiles | blocks | SM-us a block | bwd us | programs | items | "
             "SM-us an item |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['seq']} | {r['causal']} | {r['budget'] or 'default'} | {r['error']} |")
            continue
        lines.append(f"| {r['seq']} | {r['causal']} | {r['budget'] or 'default'} | {r['fwd_us']:.1f} | {r['tiles']} | "
                     f"{r['blocks']} | {r['fwd_us'] * sms / r['blocks']:.3f} | {r['bwd_us']:.1f} | {r['programs']} | "
                     f"{r['items']} | {r['bwd_us'] * sms / r['items']:.3f} |")
    text = "\n".join(lines)
    print(text)
    (out / "tile_costs.md").write_text(text + "\n")
    (out / "tile_costs.json").write_text(json.dumps(dict(rows=rows, sms=sms), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
