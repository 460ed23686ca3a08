"""Document masks (packed sequences) on the GPU: ejgen's triton platform with `MaskInfo.from_segments`, against the
ideal (ejgen's plain causal kernel scaled by the fraction of visible tiles) and, in its own process,
FlexAttention (`benchmarks/flex_blocksparse.py`, same masks). bf16, H=16, D=128, causal, B=1. Prints a
markdown table; `--json` writes the rows (docs/DESIGN.md §8: medians of interleaved rounds, same card).

    python benchmarks/blocksparse.py --out bench-out/blocksparse     # then flex_blocksparse.py the same way
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ejgen.ops import flash_attention
from ejgen.testing.timing import median_seconds
from ejgen.types import BlockMask, MaskInfo

HEADS, DIM = 16, 128
CASES = [(8192, 8), (32768, 8), (32768, 64)]  # (tokens, documents)
BATCH = 4  # calls per sample, dispatched back to back (flex_blocksparse.py times batches of 4 too)
LAYOUTS = [("local+global", 8192), ("random 10%", 8192), ("local+global", 32768), ("random 10%", 32768)]


def block_layout(kind: str, tokens: int, seed: int = 0) -> tuple[np.ndarray, int]:
    """(bool [nQ, nK] layout, block size): "local+global" = 64-token blocks, a window of 512 tokens (8 blocks) either
    side and the first 64 tokens global (they see and are seen by all); "random 10%" = 128-token blocks, 10% of them
    at random (seeded) plus the diagonal. The same for every peer."""
    if kind == "local+global":
        n = tokens // 64
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        return (np.abs(i - j) <= 8) | (i == 0) | (j == 0), 64
    n = tokens // 128
    rng = np.random.default_rng(seed + tokens)
    return (rng.random((n, n)) < 0.1) | np.eye(n, dtype=bool), 128


def run_layout(kind: str, tokens: int, reps: int, rounds: int) -> list[dict]:
    """A block layout (non-causal) through `block_mask=`, against the plain non-causal kernel scaled by the share of
    visible 128 x 128 tiles (the ideal) and against the generated kernels on the same call."""
    layout, block = block_layout(kind, tokens)
    keys = jax.random.split(jax.random.PRNGKey(tokens + len(kind)), 4)
    q, k, v, do = (jax.random.normal(kk, (1, tokens, HEADS, DIM), jnp.bfloat16) for kk in keys)
    mask = BlockMask.from_layout(jnp.asarray(layout), tokens, tokens, block, block)
    share = float(np.asarray(BlockMask.from_layout(jnp.asarray(layout), tokens, tokens, block, block)
                             .retile(128, 128).kinds() > 0).mean())
    impls = {
        f"ejgen-triton {kind}": lambda q, k, v, m: flash_attention(q, k, v, block_mask=m, platform="triton"),
        "ejgen-triton dense (all tokens)": lambda q, k, v, m: flash_attention(q, k, v, platform="triton"),
    }
    # the generated kernels on the same call (on Hopper the row above runs the Gluon kernels' lists: before / after)
    impls[f"ejgen-triton {kind}, generated kernels"] = _generated(impls[f"ejgen-triton {kind}"])
    flops = 4.0 * HEADS * DIM * float(layout.sum()) * block * block
    compiled = []
    for name, f in impls.items():
        def loss(q, k, v, m, f=f):
            return jnp.sum(f(q, k, v, m).astype(jnp.float32) * do.astype(jnp.float32))

        for pass_, fn, mult in (("fwd", f, 1.0), ("fwd+bwd", jax.grad(loss, argnums=(0, 1, 2)), 3.5)):
            exe = jax.jit(fn).lower(q, k, v, mask).compile()
            jax.block_until_ready(exe(q, k, v, mask))
            compiled.append((name, pass_, exe, mult))
    times = [[] for _ in compiled]
    for r in range(rounds):
        for i, (_, _, exe, _) in enumerate(compiled):
            times[i].append(median_seconds(exe, (q, k, v, mask), reps, warmup=1, warm_seconds=0.3 if r == 0 else 0.05,
                                          batch=BATCH))
    rows = []
    for (name, pass_, _, mult), t in zip(compiled, times):
        ms = float(np.median(t)) * 1e3
        rows.append(dict(tokens=tokens, docs=kind, impl=name, pass_=pass_, ms=ms, tflops=mult * flops / ms / 1e9,
                         tile_share=share))
    for pass_ in ("fwd", "fwd+bwd"):
        full = next(r["ms"] for r in rows if r["impl"].startswith("ejgen-triton dense") and r["pass_"] == pass_)
        rows.append(dict(tokens=tokens, docs=kind, impl="ideal (dense x tile share)", pass_=pass_, ms=full * share,
                         tflops=None, tile_share=share))
    return rows


def document_ids(tokens: int, docs: int, seed: int = 0) -> np.ndarray:
    """int32 [1, tokens]: `docs` contiguous documents of random lengths (the same for every peer: seeded)."""
    rng = np.random.default_rng(seed + tokens + docs)
    cuts = np.sort(rng.choice(np.arange(1, tokens), size=docs - 1, replace=False))
    return np.searchsorted(cuts, np.arange(tokens), side="right").astype(np.int32)[None]


def visible_pairs(ids: np.ndarray) -> int:
    """Causal pairs within documents (the FLOPs actually needed)."""
    _, counts = np.unique(ids[0], return_counts=True)
    return int(sum(n * (n + 1) // 2 for n in counts))


def _generated(f):
    """f on the generated Triton kernels (the Hopper set off while it traces)."""
    from ejgen.ops import settings

    def call(*args):
        with settings(gluon=False):
            return f(*args)
    return call


@contextlib.contextmanager
def _switched(name: str, value: bool | int = True):
    """`gluon_attention.<name>` set to ``value`` while a call is traced (both passes: the compile loop lowers them
    inside it); a bool where the switch is one (0 / 1 from --switch), else as given."""
    from ejgen.runtime.attention.gluon import host as gluon_attention

    before = getattr(gluon_attention, name)
    setattr(gluon_attention, name, bool(value) if isinstance(before, bool) else value)
    try:
        yield
    finally:
        setattr(gluon_attention, name, before)


def _static(f):
    """f with the Gluon kernels' tiles in their static order (`gluon_attention.ordered` off while it traces: the
    forward's tile order and the backward's launch order)."""
    from ejgen.runtime.attention.gluon import host as gluon_attention

    def call(*args):
        ordered = gluon_attention.ordered
        gluon_attention.ordered = lambda cfg: False
        try:
            return f(*args)
        finally:
            gluon_attention.ordered = ordered
    return call


def run(tokens: int, docs: int, reps: int, rounds: int, documents_only: bool = False, probe: bool = False,
        trace: Path | None = None, forms: tuple = (), causal: bool = False) -> list[dict]:
    ids = document_ids(tokens, docs)
    keys = jax.random.split(jax.random.PRNGKey(tokens + docs), 4)
    q, k, v, do = (jax.random.normal(kk, (1, tokens, HEADS, DIM), jnp.bfloat16) for kk in keys)
    info = MaskInfo.from_segments(jnp.asarray(ids))
    # tiles a 128 x 128 kernel visits: the ideal scales the plain causal kernel by their share of causal tiles
    tiles = np.asarray(BlockMask.from_segments(ids, block_q=128, block_k=128).kinds()) > 0
    causal_tiles = np.asarray(BlockMask.causal(tokens, tokens, 128, 128).kinds()) > 0
    share = float((tiles & causal_tiles).sum() / causal_tiles.sum())
    impls = {
        "ejgen-triton documents": lambda q, k, v, info: flash_attention(q, k, v, causal=True, mask_info=info,
                                                                        platform="triton"),
        "ejgen-triton causal (all tokens)": lambda q, k, v, info: flash_attention(q, k, v, causal=True,
                                                                                   platform="triton"),
    }
    switches = {}  # impl -> (the gluon host switch, its value) while it is traced (`_switched`)
    if probe:  # where the time goes: the generated kernels on the same call, one document (segment ids, no cut)
        impls["ejgen-triton documents, generated kernels"] = _generated(impls["ejgen-triton documents"])
        one = MaskInfo.from_segments(jnp.zeros_like(jnp.asarray(ids)))
        impls["ejgen-triton one document"] = lambda q, k, v, info: flash_attention(q, k, v, causal=True, mask_info=one,
                                                                                 platform="triton")
        impls["ejgen-triton documents, static tile order"] = _static(impls["ejgen-triton documents"])
        # session 33's forms: the forward's DOCS masks (off: it lost the 32k forward in session 34), the backward one
        # program a key block (the persistent one with segment ids, on since session 34, off)
        impls["ejgen-triton documents, DOCS masks"] = impls["ejgen-triton documents"]
        impls["ejgen-triton documents, per-program backward"] = impls["ejgen-triton documents"]
        switches["ejgen-triton documents, DOCS masks"] = ("DOCS_MASKS", True)
        switches["ejgen-triton documents, per-program backward"] = ("PERSISTENT_SEGMENTS_BWD", False)
    causal = causal or probe or not documents_only  # the causal call (and the ideal) timed
    if not causal:
        impls.pop("ejgen-triton causal (all tokens)")
    for name, value in forms:  # --switch: the documents (and the causal call, where timed) again with a `gluon.host`
        # switch set while they trace
        for base in [b for b in ("ejgen-triton documents", "ejgen-triton causal (all tokens)") if b in impls]:
            label = f"{base}, {name}={value}"
            impls[label] = impls[base]
            switches[label] = (name, value)
    flops = 4.0 * HEADS * DIM * visible_pairs(ids)
    compiled = []
    for name, f in impls.items():
        def loss(q, k, v, info, f=f):
            return jnp.sum(f(q, k, v, info).astype(jnp.float32) * do.astype(jnp.float32))

        for pass_, fn, mult in (("fwd", f, 1.0), ("fwd+bwd", jax.grad(loss, argnums=(0, 1, 2)), 3.5)):
            with _switched(*switches[name]) if name in switches else contextlib.nullcontext():
                exe = jax.jit(fn).lower(q, k, v, info).compile()
            jax.block_until_ready(exe(q, k, v, info))
            compiled.append((name, pass_, exe, mult))
    if trace is not None:  # every kernel of one documents call, then BATCH calls back to back (span, busy, gaps)
        import trace_table

        for name, pass_, exe, _ in compiled:
            if name.startswith("ejgen-triton documents") and (name in switches or name == "ejgen-triton documents"):
                form = "" if name not in switches else "-" + "-".join(str(x) for x in switches[name])
                where = trace / f"trace-{tokens}x{docs}-{pass_.replace('+', '')}{form}"
                label = f"{name} {tokens} tokens / {docs} documents, {pass_}"
                trace_table.profile(exe, (q, k, v, info), where, label=label)
                trace_table.back_to_back(exe, (q, k, v, info), Path(f"{where}-batch"), calls=BATCH, label=label,
                                         gap_us=5.0)
    times = [[] for _ in compiled]
    for r in range(rounds):
        for i, (_, _, exe, _) in enumerate(compiled):
            times[i].append(median_seconds(exe, (q, k, v, info), reps, warmup=1, warm_seconds=0.3 if r == 0 else 0.05,
                                          batch=BATCH))
    rows = []
    for (name, pass_, _, mult), t in zip(compiled, times):
        ms = float(np.median(t)) * 1e3
        rows.append(dict(tokens=tokens, docs=docs, impl=name, pass_=pass_, ms=ms, tflops=mult * flops / ms / 1e9,
                         tile_share=share))
    for pass_ in ("fwd", "fwd+bwd") if causal else ():
        full = next(r["ms"] for r in rows if r["impl"].startswith("ejgen-triton causal") and r["pass_"] == pass_)
        rows.append(dict(tokens=tokens, docs=docs, impl="ideal (causal x tile share)", pass_=pass_, ms=full * share,
                         tflops=None, tile_share=share))
    # the block mask's build time under jit (new boundaries: traced, no recompile)
    if probe:
        from ejgen.runtime.attention.config import AttentionConfig
        from ejgen.runtime.attention.gluon import host as gluon_attention

        cfg = AttentionConfig(seq_q=tokens, seq_k=tokens, causal=True, segments=True)
        def fwd_tiles(i):
            ranges = gluon_attention.segment_ranges({"q_seg": i, "kv_seg": i}, cfg, tokens, "fwd")
            return ranges, gluon_attention.tile_order(ranges, HEADS, True, gluon_attention.num_sms())

        def bwd_tiles(i):
            return gluon_attention.segment_ranges({"q_seg": i, "kv_seg": i}, cfg, tokens, "bwd")

        for name, fn in (("Gluon fwd tile ranges + order", fwd_tiles), ("Gluon bwd tile ranges", bwd_tiles)):
            fn = jax.jit(fn)
            jax.block_until_ready(fn(jnp.asarray(ids)))
            ms = median_seconds(fn, (jnp.asarray(ids),), reps, warmup=1, batch=16) * 1e3  # device-bound
            rows.append(dict(tokens=tokens, docs=docs, impl=f"{name} (jit, 16 back to back)", pass_="build", ms=ms,
                             tflops=None, tile_share=share))
    build = jax.jit(lambda i: BlockMask.from_segments(i, block_q=128, block_k=128))
    jax.block_until_ready(build(jnp.asarray(ids)))
    # timed as the calls above (BATCH back to back): one call of a small jitted function waited for alone is the
    # host's round trip (0.13-0.16 ms on an H200, session 21), not the build
    ms = median_seconds(build, (jnp.asarray(ids),), reps, warmup=1, batch=BATCH) * 1e3
    rows.append(dict(tokens=tokens, docs=docs, impl=f"BlockMask.from_segments (jit, {BATCH} back to back)",
                     pass_="build", ms=ms, tflops=None, tile_share=share))
    return rows


def table(rows) -> str:
    lines = ["| tokens | docs / layout | impl | pass | ms | TFLOP/s (visible) |", "|---|---|---|---|---|---|"]
    for r in rows:
        tf = "" if r["tflops"] is None else f"{r['tflops']:.0f}"
        lines.append(f"| {r['tokens']} | {r['docs']} | {r['impl']} | {r['pass_']} | {r['ms']:.3f} | {tf} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-out/blocksparse")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=4, help="calls a sample dispatches back to back (the peer's script "
                   "takes the same option): the host's dispatch of a sample's first call and its wake-up after the "
                   "wait count 1/calls of a row")
    p.add_argument("--documents-only", action="store_true", help="only the document-mask call (config sweeps)")
    p.add_argument("--layouts-only", action="store_true", help="only the block layouts (local+global, random)")
    p.add_argument("--layout-tokens", default="8192,32768", help="lengths of the block-layout cases")
    p.add_argument("--doc-cases", default=",".join(f"{t}x{d}" for t, d in CASES),
                   help="the document cases, comma-separated TOKENSxDOCUMENTS")
    p.add_argument("--causal", action="store_true", help="with --documents-only: time the causal call (all tokens) and "
                   "the ideal too, and each --switch form of it")
    p.add_argument("--probe", action="store_true", help="also the generated kernels on the documents, one document, "
                                                        "and the Gluon kernels' tile ranges alone")
    p.add_argument("--switch", action="append", default=[], metavar="NAME=INT",
                   help="also time the documents (and the causal call but with --documents-only) with "
                   "`gluon.host.NAME` set (0 / 1 for a bool switch, an int for others; an A/B "
                   "in one process; repeatable)")
    p.add_argument("--trace", action="store_true", help="also print every kernel of one documents call (each --switch "
                   "form's too) and the device's span, busy time and gaps over 5 us of --calls calls back to back "
                   "(trace_table.py)")
    a = p.parse_args()
    global BATCH
    BATCH = a.calls
    doc_cases = [tuple(int(x) for x in c.split("x")) for c in a.doc_cases.split(",") if c]
    forms = tuple((f.split("=")[0], int(f.split("=")[1])) for f in a.switch)
    rows = [] if a.layouts_only else [r for tokens, docs in doc_cases
                                      for r in run(tokens, docs, a.reps, a.rounds, a.documents_only, a.probe,
                                                   Path(a.out) if a.trace else None, forms, a.causal)]
    if not a.documents_only:
        lengths = {int(t) for t in a.layout_tokens.split(",") if t}
        for kind, tokens in LAYOUTS:
            if tokens in lengths:
                case = run_layout(kind, tokens, a.reps, a.rounds)
                print(table(case), flush=True)  # each case as it ends: a call cut short still reports what ran
                rows += case
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r["calls"] = BATCH
    (out / "ejgen.json").write_text(json.dumps(rows, indent=1))
    text = f"{jax.devices()[0].device_kind}, {BATCH} calls a sample\n\n{table(rows)}\n"
    (out / "ejgen.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
