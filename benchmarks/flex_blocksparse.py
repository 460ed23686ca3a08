"""FlexAttention (torch) on the document masks of `benchmarks/blocksparse.py`: `flex_attention` compiled with
`torch.compile`, `create_block_mask` from a document mask_mod (causal within documents), bf16, H=16, D=128,
B=1. Runs in its own process (torch and JAX do not share the GPU well); the same seeded documents.

    python benchmarks/flex_blocksparse.py --out bench-out/blocksparse
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

HEADS, DIM = 16, 128
CASES = [(8192, 8), (32768, 8), (32768, 64)]
LAYOUTS = [("local+global", 8192), ("random 10%", 8192), ("local+global", 32768), ("random 10%", 32768)]
CALLS = 4  # calls per sample (--calls), as blocksparse.py's BATCH


def block_layout(kind: str, tokens: int, seed: int = 0):
    """As benchmarks/blocksparse.py: (bool [nQ, nK], block size)."""
    if kind == "local+global":
        n = tokens // 64
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        return (np.abs(i - j) <= 8) | (i == 0) | (j == 0), 64
    n = tokens // 128
    rng = np.random.default_rng(seed + tokens)
    return (rng.random((n, n)) < 0.1) | np.eye(n, dtype=bool), 128


def document_ids(tokens: int, docs: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed + tokens + docs)  # as benchmarks/blocksparse.py
    cuts = np.sort(rng.choice(np.arange(1, tokens), size=docs - 1, replace=False))
    return np.searchsorted(cuts, np.arange(tokens), side="right").astype(np.int32)[None]


def timed(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / CALLS)
    return statistics.median(samples)


def run(tokens: int, docs, reps: int) -> list[dict]:
    if isinstance(docs, str):  # a block layout: the element mask is its blocks
        layout, block = block_layout(docs, tokens)
        lay = torch.tensor(layout, device="cuda")

        def document_causal(b, h, q_idx, kv_idx):
            return lay[q_idx // block, kv_idx // block]
    else:
        ids = torch.tensor(document_ids(tokens, docs)[0], device="cuda")

        def document_causal(b, h, q_idx, kv_idx):
            return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    flex = torch.compile(flex_attention)
    q, k, v, do = (torch.randn(1, HEADS, tokens, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=i < 3)
                   for i in range(4))
    build = lambda: create_block_mask(document_causal, 1, 1, tokens, tokens, device="cuda")  # noqa: E731
    mask = build()

    def fwd():
        return flex(q, k, v, block_mask=mask)

    def fwd_bwd():
        out = flex(q, k, v, block_mask=mask)
        torch.autograd.grad(out, (q, k, v), do)

    rows = []
    for pass_, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd), ("build", build)):
        ms = timed(fn, reps) * 1e3
        rows.append(dict(tokens=tokens, docs=docs, impl="flex_attention" if pass_ != "build" else "create_block_mask",
                         pass_=pass_, ms=ms))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-out/blocksparse")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--calls", type=int, default=4, help="calls a sample dispatches back to back (the peer's script "
                   "takes the same option): the host's dispatch of a sample's first call and its wake-up after the "
                   "wait count 1/calls of a row")
    a = p.parse_args()
    global CALLS
    CALLS = a.calls
    rows = [r for tokens, docs in CASES for r in run(tokens, docs, a.reps)]
    rows += [r for kind, tokens in LAYOUTS for r in run(tokens, kind, a.reps)]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r["calls"] = CALLS
    (out / "flex.json").write_text(json.dumps(rows, indent=1))
    lines = [f"{torch.cuda.get_device_name()}, {CALLS} calls a sample", "", "| tokens | docs | impl | pass | ms |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['docs']} | {r['impl']} | {r['pass_']} | {r['ms']:.3f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    (out / "flex.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
