"""Decode and paged decode on one GPU (issue 16 §5, docs/DESIGN.md §3 "Decode and paged modes"): ejgen's
`ragged_decode_attention` / `page_attention` (platform "triton": the split-K kernel; "pallas": the Pallas GPU kernel;
"xla") against cuDNN
(`jax.nn.dot_product_attention(implementation="cudnn")`, query [B, 1, Hq, D]) and JAX's Pallas GPU kernels
(`jax.experimental.pallas.ops.gpu.decode_attention.gqa` / `.mqa`, `paged_attention.paged_attention`), next to the
card's streaming bandwidth measured in the same run. bf16, D=128, GQA Hq=32 / Hkv=8, one query per sequence (and one
row with Sq=4, speculative verification).

Cases: contiguous caches [B, S, Hkv, D] (`decode-B8-S8k`, `decode-B32-S8k`, `decode-B4-S32k`, and
`decode-B32-ragged16k`: lengths uniform in 1..16384, seeded, in cache rows of 16384); the same four batches paged
with pages of 16 and 64 tokens (`paged16-...`, `paged64-...`: a pool of B * S / page pages holding the same keys
and values, each sequence's pages at shuffled places in the pool, seeded); the authored ALiBi spec
(`alibi-B32-S8k`: `alibi_attention_decode`, slopes 2^(-8 i / 32)); and `decode-B32-S8k-Sq4`.

Run on the GPU host, from the repository root (jax-triton travels as a wheel in .whl; carry .whl):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && PYTHONUNBUFFERED=1 timeout 560 \
        python3 benchmarks/decode.py --out $OUT/decode

(meant to take 3-6 minutes on an H100, compiles included, not yet timed there; no case starts after `--budget-s`
seconds, default 450, and the JSON is rewritten after every case, so a run cut short keeps what it measured;
`--quick` runs 5 cases). Prints the device, the streaming bandwidth, a line per case as it finishes, then a markdown
table and the issue's speed targets; writes `<out>/decode.json` (every row, with compile seconds and errors) and
`<out>/decode.md`.
On a machine without a GPU, `python benchmarks/decode.py --cpu-smoke` runs tiny shapes (B2 S256 Hq8 Hkv2 D64) on XLA
and Triton's interpreter (it sets TRITON_INTERPRET=1 itself), ejgen-pallas interpreted; cuDNN and JAX's Pallas rows
read n/a there.

Columns:
- case: the batch (see above); keys read: the sequences' lengths summed (not the cache size).
- impl: ejgen-triton (the generated split-K Triton kernel and its merge), ejgen-triton-bi (the same with
  `batch_invariant=True`: fixed split size), ejgen-pallas (platform "pallas": the Pallas split-K kernel on the spec's
  Pallas hooks, Triton lowering, and its XLA merge), ejgen-xla (the spec's XLA hooks on whole cache rows, paged calls
  gather their pages first), ejgen-triton flash (alibi case only: the flash spec on the same inputs, for the
  authored-spec target), ejgen-triton contiguous (paged cases: the contiguous call on the same keys, timed in the
  case's own rounds: the paged target's pair), ejgen-triton pages in order (paged cases: the paged call on a pool
  holding each sequence's pages in order), cudnn (`jax.nn.dot_product_attention`, NO_MASK on uniform batches, key_value_seq_lengths on
  the ragged one), cudnn-paged (`jax._src.cudnn.fused_attention_stablehlo.paged_attention`, a private API: the same
  pool and tables), pallas-gqa (JAX's `gqa`, whose wrapper transposes the cache to [B, Hkv, S, D] in every call: timed
  as called), pallas-mqa-bhsd (JAX's `mqa` on a cache transposed once outside the timing: the kernel alone),
  pallas-paged (JAX's `paged_attention` on the pool in its layout [Hkv, pages, page, D], built outside the timing; it
  has no softmax scale, so its query comes pre-scaled).
- us: median microseconds per call (medians of `--rounds` interleaved rounds, each the median of `--reps` samples of
  `--calls` calls, 8 by default, dispatched back to back; every impl compiled before any is timed).
- GB/s: bytes of K and V actually read (sum of lengths x Hkv x D x 2 bytes x 2) / time.
- %stream: GB/s over the card's streaming bandwidth (the larger of a jitted bf16 copy, bytes read + written, and a
  jitted sum, bytes read, over a 2 GiB array, measured at the start of the run).
- vs cuDNN: cuDNN's time / this impl's time (> 1: faster than cuDNN) against the case's cudnn row, or, for paged
  cases, the contiguous case of the same batch (marked *).
- max|d| vs xla: max abs difference from ejgen-xla on the same inputs, in float32 (FLAG past 2e-2).
- error: why an impl did not run (import, unsupported shape, compile error): the other impls go on.

Targets (the issue's "Speed it must reach", from the ejgen-triton rows): %stream on decode-B32-S8k and
decode-B4-S32k (>= 85), cuDNN time / ejgen time on each contiguous case (>= 1), contiguous time / paged time per
batch and page size (>= 0.95), the ragged batch's time over the time its bytes take at decode-B32-S8k's GB/s
(<= 1.2), flash time / alibi time on the same inputs (>= 0.9).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

HQ, HKV, DIM = 32, 8, 128
SMOKE = dict(hq=8, hkv=2, dim=64)
TOL = 2e-2
QUICK = ("decode-B32-S8k", "decode-B4-S32k", "decode-B32-ragged16k", "paged16-B32-S8k", "alibi-B32-S8k")
ALL_IMPLS = ("ejgen-triton", "ejgen-triton-bi", "ejgen-triton flash", "ejgen-pallas", "ejgen-xla", "cudnn",
             "cudnn-paged",
             "pallas-gqa", "pallas-mqa-bhsd", "pallas-paged")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-out/decode")
    p.add_argument("--reps", type=int, default=5, help="samples per round (each --calls calls back to back)")
    p.add_argument("--calls", type=int, default=8,
                   help="calls a sample dispatches back to back on the GPU: the host's dispatch of a sample's first "
                        "call (~30 us) and its wake-up after the wait count 1/calls of a row")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median of their medians")
    p.add_argument("--cases", default="", help="comma-separated substrings of case names (default: all)")
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    p.add_argument("--platforms", default="",
                   help="comma-separated substrings of impl names to time (e.g. triton,cudnn); default all of "
                        + ", ".join(ALL_IMPLS) + " (ejgen-xla always runs as the correctness reference)")
    p.add_argument("--budget-s", type=float, default=450,
                   help="start no case after this many seconds (the rest are recorded as skipped)")
    p.add_argument("--stream-gib", type=float, default=2.0, help="size of the streaming-bandwidth array")
    p.add_argument("--trace", action="store_true",
                   help="after timing a case, its ejgen-triton and cudnn calls back to back under the profiler "
                        "(trace_table.back_to_back: each kernel, the device's busy time against the span, idle gaps)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on the CPU: XLA and Triton's interpreter (sets TRITON_INTERPRET=1)")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.cpu_smoke:  # before triton, jax and the kernels are imported
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's ejgen, run from anywhere

import jax
import jax.numpy as jnp
import numpy as np

from ejgen.testing.timing import median_seconds

# ---------------------------------------------------------------------------------------------------------- cases

class Case:
    """One row group of the table: a batch (lengths in cache rows of `seq`), contiguous or paged, Sq queries."""

    def __init__(self, name, batch, seq, lens, *, page=0, sq=1, spec="flash", group=""):
        self.name, self.batch, self.seq, self.lens = name, batch, seq, np.asarray(lens, np.int32)
        self.page, self.sq, self.spec, self.group = page, sq, spec, group

    @property
    def contiguous(self):
        return self.page == 0

    def kv_bytes(self, hkv, dim):
        return int(self.lens.astype(np.int64).sum()) * hkv * dim * 2 * 2


def _k(n):
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def make_cases(smoke: bool) -> list[Case]:
    """Per batch (B, S, ragged): decode, paged16, paged64; alibi and Sq=4 on B32 S8k (B2 S256 in the smoke run)."""
    if smoke:
        batches = [(2, 256, False), (2, 256, True)]
        main = "B2-S256"
    else:
        batches = [(8, 8192, False), (32, 8192, False), (4, 32768, False), (32, 16384, True)]
        main = "B32-S8k"
    cases = []
    for batch, seq, ragged in batches:
        if ragged:
            lens = np.random.default_rng(16).integers(1, seq, size=batch, endpoint=True)
            tag = f"B{batch}-ragged{_k(seq)}"
        else:
            lens = np.full(batch, seq)
            tag = f"B{batch}-S{_k(seq)}"
        cases.append(Case(f"decode-{tag}", batch, seq, lens, group=tag))
        for page in (16, 64):
            cases.append(Case(f"paged{page}-{tag}", batch, seq, lens, page=page, group=tag))
        if tag == main:
            cases.append(Case(f"alibi-{tag}", batch, seq, lens, spec="alibi", group=tag))
            cases.append(Case(f"decode-{tag}-Sq4", batch, seq, lens, sq=4, group=tag))
    return cases


def select(cases, filt: str, quick: bool, smoke: bool):
    if quick and not smoke:
        cases = [c for c in cases if c.name in QUICK]
    toks = [t for t in filt.split(",") if t]
    return [c for c in cases if not toks or any(t in c.name for t in toks)]


# ---------------------------------------------------------------------------------------------------------- inputs

def paged_pool(k, v, page: int, seed: int):
    """(k_pool, v_pool [B * n, page, Hkv, D], tables int32 [B, n]): cache row b's page i at pool[tables[b, i]],
    the pool's order a seeded shuffle."""
    k_pages, v_pages, in_order = ordered_pool(k, v, page)
    perm = np.random.default_rng(seed + page).permutation(in_order.size).astype(np.int32)
    inv = jnp.asarray(np.argsort(perm).astype(np.int32))
    return k_pages[inv], v_pages[inv], jnp.asarray(perm.reshape(in_order.shape))


def ordered_pool(k, v, page: int):
    """(k_pool, v_pool, tables) of `paged_pool`'s form with row b's page i at pool[b * n + i]: the cache itself
    reshaped (no copy), the table in order."""
    batch, seq = k.shape[:2]
    n = seq // page
    pool = lambda x: x.reshape(batch * n, page, *x.shape[2:])
    return pool(k), pool(v), jnp.arange(batch * n, dtype=jnp.int32).reshape(batch, n)


def alibi_slopes(hq: int):
    return jnp.asarray([2.0 ** (-8.0 * (i + 1) / hq) for i in range(hq)], jnp.float32)


# ---------------------------------------------------------------------------------------------------------- impls

def _ejgen_has(kw: str) -> bool:
    import inspect

    from ejgen.ops.decode import ragged_decode_attention
    return kw in inspect.signature(ragged_decode_attention).parameters


def impls_for(case: Case, d: dict, on_gpu: bool):
    """{name: (build, note[, build of its own reference])}; build() -> (fn, args), fn(*args) -> out [B, Hq, D] or
    [B, Sq, Hq, D]. The reference is ejgen-xla unless given. A missing import or a CPU-only run raises inside
    build, recorded per impl by the caller."""
    out = {}
    sq = case.sq
    q = d["q"]  # [B, Hq, D] or [B, Sq, Hq, D]

    def ejgen_contig(platform, **kw):
        def build():
            from ejgen.ops.decode import ragged_decode_attention
            return (lambda q, k, v, s, e: ragged_decode_attention(q, k, v, s, e, platform=platform, **kw),
                    (q, d["k"], d["v"], d["starts"], d["ends"]))
        return build

    def ejgen_paged(platform, in_order=False, **kw):
        def build():
            from ejgen.ops.decode import page_attention
            pool = ordered_pool(d["k"], d["v"], case.page) if in_order else (d["k_pool"], d["v_pool"], d["tables"])
            return (lambda q, kp, vp, lens, tab: page_attention(q, kp, vp, lens, tab, platform=platform, **kw),
                    (q, pool[0], pool[1], d["ends"], pool[2]))
        return build

    def alibi(platform):
        def build():
            from ejgen.generated.alibi_attention import alibi_attention_decode
            return (lambda q, k, v, s, e, sl: alibi_attention_decode(q, k, v, s, e, slopes=sl, platform=platform),
                    (q, d["k"], d["v"], d["starts"], d["ends"], d["slopes"]))
        return build

    if case.spec == "alibi":
        out["ejgen-triton"] = (alibi("triton"), "alibi_attention_decode")
        out["ejgen-pallas"] = (alibi("pallas"), "alibi_attention_decode")
        out["ejgen-xla"] = (alibi("xla"), "alibi_attention_decode (reference)")
        out["ejgen-triton flash"] = (ejgen_contig("triton"), "flash spec, same inputs; checked against flash xla",
                                     ejgen_contig("xla"))
        return out
    if case.contiguous:
        out["ejgen-triton"] = (ejgen_contig("triton"), "")
        if _ejgen_has("batch_invariant") and sq == 1:
            out["ejgen-triton-bi"] = (ejgen_contig("triton", batch_invariant=True), "batch_invariant=True")
        out["ejgen-pallas"] = (ejgen_contig("pallas"), "")
        out["ejgen-xla"] = (ejgen_contig("xla"), "reference")
    else:
        out["ejgen-triton"] = (ejgen_paged("triton"), "")
        # the same keys from the contiguous cache, timed in this case's interleaved rounds: the paged target's ratio
        # from one pair of neighbours (the contiguous case's own row ran minutes earlier: session 28, one H200, 128
        # calls a sample, paged B8 S8k 0.85 of that row and 0.96 in decode_tune.py's interleaved settings)
        out["ejgen-triton contiguous"] = (ejgen_contig("triton"), "the same keys, contiguous cache (A/B pair)")
        # the same kernel and table reads with each sequence's pages in order in the pool (the contiguous cache seen
        # as pages): what of the paged gap is the pages' scattered addresses, what the table's reads in the kernel
        out["ejgen-triton pages in order"] = (ejgen_paged("triton", in_order=True), "pool = the cache in order")
        out["ejgen-pallas"] = (ejgen_paged("pallas"), "")
        out["ejgen-xla"] = (ejgen_paged("xla"), "reference (gathers the pages)")
    if sq != 1:
        return out
    ragged = bool((d["lens_np"] != case.seq).any())
    scale = 1.0 / math.sqrt(q.shape[-1])

    if case.contiguous:
        def cudnn():
            if not on_gpu:
                raise RuntimeError("n/a on CPU")
            if ragged:
                return (lambda q, k, v, e: jax.nn.dot_product_attention(
                            q[:, None], k, v, key_value_seq_lengths=e, implementation="cudnn")[:, 0],
                        (q, d["k"], d["v"], d["ends"]))
            return (lambda q, k, v: jax.nn.dot_product_attention(q[:, None], k, v, implementation="cudnn")[:, 0],
                    (q, d["k"], d["v"]))
        out["cudnn"] = (cudnn, "key_value_seq_lengths" if ragged else "no mask")

        def pallas_gqa():
            if not on_gpu:
                raise RuntimeError("n/a on CPU")
            from jax.experimental.pallas.ops.gpu.decode_attention import gqa
            return (lambda q, k, v, e: gqa(q, k, v, kv_seq_len=e), (q, d["k"], d["v"], d["ends"]))
        out["pallas-gqa"] = (pallas_gqa, "its wrapper transposes K/V each call")

        def pallas_mqa():
            if not on_gpu:
                raise RuntimeError("n/a on CPU")
            from jax.experimental.pallas.ops.gpu.decode_attention import mqa
            batch, hq, dim = q.shape
            hkv = d["k"].shape[2]
            kt, vt = (jnp.swapaxes(x, 1, 2).reshape(batch * hkv, x.shape[1], dim) for x in (d["k"], d["v"]))
            qg = q.reshape(batch * hkv, hq // hkv, dim)
            lens = jnp.repeat(d["ends"], hkv)
            return (lambda q, k, v, e: mqa(q, k, v, kv_seq_len=e).reshape(batch, hq, dim), (qg, kt, vt, lens))
        out["pallas-mqa-bhsd"] = (pallas_mqa, "cache transposed once, outside the timing")
    else:
        def cudnn_paged():
            if not on_gpu:
                raise RuntimeError("n/a on CPU")
            from jax._src.cudnn.fused_attention_stablehlo import (
                MaskType,
                paged_attention,
            )
            tab = d["tables"][:, None, :, None]
            ones = jnp.ones_like(d["ends"])
            return (lambda q, kp, vp, lens, tab: paged_attention(
                        q[:, None], kp, vp, ones, lens, tab, tab, scale=scale, mask_type=MaskType.PADDING)[:, 0],
                    (q, d["k_pool"], d["v_pool"], d["ends"], tab))
        out["cudnn-paged"] = (cudnn_paged, "jax._src private API")

        def pallas_paged():
            if not on_gpu:
                raise RuntimeError("n/a on CPU")
            from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
            kp, vp = (jnp.transpose(x, (2, 0, 1, 3)) for x in (d["k_pool"], d["v_pool"]))
            qs = (q.astype(jnp.float32) * scale).astype(q.dtype)
            return (lambda q, kp, vp, tab, lens: paged_attention(q, kp, vp, tab, lens),
                    (qs, kp, vp, d["tables"], d["ends"]))
        out["pallas-paged"] = (pallas_paged, "pool as [Hkv, pages, page, D]; q pre-scaled")
    return out


# ---------------------------------------------------------------------------------------------------------- timing

def short_error(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    msg = lines[0] if lines else ""
    return f"{type(e).__name__}: {msg}"[:300]


def stream_bandwidth(gib: float, reps: int, batch: int) -> dict:
    """GB/s of a jitted bf16 copy (x + 1: read + write) and of a jitted sum (read) over a `gib` GiB array. At most 8
    calls a sample: each copy keeps its `gib` GiB output until the sample ends (64 of 2 GiB ran an H200 out of memory,
    session 27), and a call of ~1 ms needs no longer samples to hide the host."""
    batch = min(batch, 8)
    n = int(gib * 2 ** 30) // 2
    x = jax.random.normal(jax.random.PRNGKey(7), (n,), jnp.bfloat16)
    copy = jax.jit(lambda x: x + jnp.bfloat16(1)).lower(x).compile()
    total = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32)).lower(x).compile()
    res = {}
    for name, exe, nbytes in (("copy", copy, 4 * n), ("sum", total, 2 * n)):
        ts = [median_seconds(exe, (x,), reps, warmup=1, warm_seconds=0.3 if r == 0 else 0.05, batch=batch)
              for r in range(3)]
        res[f"{name}_gbs"] = nbytes / statistics.median(ts) / 1e9
    res["gbs"] = max(res["copy_gbs"], res["sum_gbs"])
    res["bytes"] = 2 * n
    del x
    return res


def to_f32(out, like_shape):
    out = out[0] if isinstance(out, (tuple, list)) else out
    return np.asarray(jnp.asarray(out, jnp.float32)).reshape(like_shape)


def run_case(case: Case, d: dict, args, on_gpu: bool, batch: int) -> list[dict]:
    """Compile every impl, check it against ejgen-xla, then time them in interleaved rounds."""
    toks = [t for t in args.platforms.split(",") if t]
    wanted = lambda name: name == "ejgen-xla" or not toks or any(t in name for t in toks)
    rows, compiled = {}, {}
    hkv, dim = d["k"].shape[2], d["k"].shape[3]
    nbytes = case.kv_bytes(hkv, dim)
    own_refs = {}
    for name, (build, note, *own_ref) in impls_for(case, d, on_gpu).items():
        if not wanted(name):
            continue
        row = dict(case=case.name, group=case.group, impl=name, note=note, batch=case.batch, seq=case.seq,
                   page=case.page, sq=case.sq, keys=int(case.lens.sum()), kv_bytes=nbytes, us=None, gbs=None,
                   max_abs_diff=None, error=None)
        rows[name] = row
        try:
            fn, fargs = build()
            t0 = time.perf_counter()
            exe = jax.jit(fn).lower(*fargs).compile()
            out = jax.block_until_ready(exe(*fargs))
            row["compile_s"] = round(time.perf_counter() - t0, 2)
            compiled[name] = (exe, fargs)
            row["_out"] = to_f32(out, d["out_shape"])
        except Exception as e:  # noqa: BLE001 - record and go on
            row["error"] = short_error(e)
            if "n/a on CPU" not in row["error"]:
                print(f"  {case.name} / {name}: {row['error']}", file=sys.stderr)
                traceback.print_exc(limit=3, file=sys.stderr)
            continue
        if own_ref:  # an untimed reference of its own (the flash spec in the alibi case)
            try:
                rfn, rargs = own_ref[0]()
                own_refs[name] = to_f32(jax.jit(rfn)(*rargs), d["out_shape"])
            except Exception as e:  # noqa: BLE001
                row["note"] += f" (its reference failed: {short_error(e)})"
    ref = rows.get("ejgen-xla", {}).get("_out")
    for name, row in rows.items():
        out = row.pop("_out", None)
        ref_i = own_refs.get(name, ref)
        if out is not None and ref_i is not None:
            diff = np.abs(out - ref_i)
            row["max_abs_diff"] = float(np.nanmax(diff)) if not np.isnan(diff).any() else float("nan")
    times = {name: [] for name in compiled}
    for r in range(args.rounds):
        for name, (exe, fargs) in compiled.items():
            if name in times:
                try:
                    times[name].append(median_seconds(exe, fargs, args.reps, warmup=1,
                                                      warm_seconds=0.3 if r == 0 else 0.05, batch=batch))
                except Exception as e:  # noqa: BLE001
                    rows[name]["error"] = short_error(e)
                    times.pop(name)
    for name, ts in times.items():
        if ts:
            sec = statistics.median(ts)
            rows[name]["us"] = sec * 1e6
            rows[name]["gbs"] = nbytes / sec / 1e9
    if args.trace and on_gpu:  # where a call's time goes: its kernels (split-K, merge) and the gaps between them
        from trace_table import back_to_back, profile

        for name in ("ejgen-triton", "cudnn"):
            if name in compiled:
                exe, fargs = compiled[name]
                where = Path(args.out) / "trace" / f"{case.name}-{name}"
                profile(exe, fargs, where / "one", label=f"{case.name} / {name}: one call's kernels")  # prints it
                print(back_to_back(exe, fargs, where / "batch", calls=batch, label=f"{case.name} / {name}",
                                   gap_us=2.0), flush=True)
    del compiled
    return list(rows.values())


def case_inputs(case: Case, kv: dict, hq: int) -> dict:
    d = dict(k=kv["k"], v=kv["v"], lens_np=case.lens)
    batch, _, _, dim = kv["k"].shape
    key = jax.random.PRNGKey(1000 + case.sq)
    shape = (batch, hq, dim) if case.sq == 1 else (batch, case.sq, hq, dim)
    d["q"] = jax.random.normal(key, shape, jnp.bfloat16)
    d["out_shape"] = shape
    d["starts"] = jnp.zeros((batch,), jnp.int32)
    d["ends"] = jnp.asarray(case.lens, jnp.int32)
    if case.spec == "alibi":
        d["slopes"] = alibi_slopes(hq)
    if not case.contiguous:
        if case.page not in kv:
            for old in [p for p in kv if isinstance(p, int)]:
                del kv[old]  # one pool at a time
            kv[case.page] = paged_pool(kv["k"], kv["v"], case.page, seed=case.batch)
        d["k_pool"], d["v_pool"], d["tables"] = kv[case.page]
    return d


# ---------------------------------------------------------------------------------------------------------- report

def fill_ratios(rows: list[dict], stream: float):
    """%stream, and cuDNN's time / the impl's (the case's cudnn row, else the contiguous case of the group)."""
    by = {(r["case"], r["impl"]): r for r in rows}
    for r in rows:
        r["pct_stream"] = 100.0 * r["gbs"] / stream if r["gbs"] and stream else None
        ref = by.get((r["case"], "cudnn"))
        r["vs_cudnn_from"] = r["case"]
        if (ref is None or ref["us"] is None) and r["page"]:
            ref = by.get((f"decode-{r['group']}", "cudnn"))
            r["vs_cudnn_from"] = f"decode-{r['group']}"
        r["vs_cudnn"] = ref["us"] / r["us"] if ref and ref["us"] and r["us"] and r["impl"] != "cudnn" else None


def _f(x, fmt):
    return "" if x is None else ("nan" if isinstance(x, float) and math.isnan(x) else format(x, fmt))


def table(rows: list[dict]) -> str:
    lines = ["| case | keys read | impl | us | GB/s | %stream | vs cuDNN | max\\|d\\| vs xla | error / note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        diff = r["max_abs_diff"]
        dtxt = _f(diff, ".1e")
        if diff is not None and (math.isnan(diff) or diff > TOL):
            dtxt += " FLAG"
        vs = _f(r["vs_cudnn"], ".2f") + ("*" if r["vs_cudnn"] is not None and r["page"] else "")
        if r["error"]:
            err = "n/a" if "n/a on CPU" in r["error"] else r["error"].replace("|", "/")[:110]
        else:
            err = r["note"]
        us = _f(r["us"], ".1f") if r["us"] is not None else ("n/a" if r["error"] else "")
        lines.append(f"| {r['case']} | {r['keys']} | {r['impl']} | {us} | {_f(r['gbs'], '.0f')} | "
                     f"{_f(r['pct_stream'], '.0f')} | {vs} | {dtxt} | {err} |")
    return "\n".join(lines)


def targets(rows: list[dict], smoke: bool) -> list[dict]:
    """The issue's 'Speed it must reach', from this run's ejgen-triton rows (None where a row is missing)."""
    def get(case, impl="ejgen-triton"):
        return next((r for r in rows if r["case"] == case and r["impl"] == impl and r["us"]), None)

    out = []

    def add(what, value, goal, ok):
        out.append(dict(target=what, value=value, goal=goal, met=None if value is None else ok(value)))

    groups = sorted({r["group"] for r in rows}, key=lambda g: [x["group"] for x in rows].index(g))
    uniform = "B2-S256" if smoke else "B32-S8k"
    for g in groups:
        if "ragged" in g:
            continue
        r = get(f"decode-{g}")
        if not smoke and g in ("B32-S8k", "B4-S32k"):
            add(f"decode-{g}: % of streaming bandwidth", r and r["pct_stream"], ">= 85", lambda v: v >= 85)
    for g in groups:
        r = get(f"decode-{g}")
        add(f"decode-{g}: cuDNN time / ejgen time", r and r["vs_cudnn"], ">= 1.0", lambda v: v >= 1.0)
    for g in groups:
        c = get(f"decode-{g}")
        for page in (16, 64):
            p = get(f"paged{page}-{g}")
            pair = get(f"paged{page}-{g}", "ejgen-triton contiguous")
            c_us = pair["us"] if pair and pair.get("us") else (c and c["us"])
            val = c_us / p["us"] if c_us and p and p.get("us") else None
            add(f"paged{page}-{g}: contiguous time (same rounds) / paged time", val, ">= 0.95", lambda v: v >= 0.95)
    u = get(f"decode-{uniform}")
    for g in groups:
        if "ragged" not in g:
            continue
        r = get(f"decode-{g}")
        val = r["us"] / (r["kv_bytes"] / (u["gbs"] * 1e9) * 1e6) if r and u else None
        add(f"decode-{g}: time / (its bytes at decode-{uniform}'s GB/s)", val, "<= 1.2", lambda v: v <= 1.2)
    a, f = get(f"alibi-{uniform}"), get(f"alibi-{uniform}", "ejgen-triton flash")
    add(f"alibi-{uniform}: flash time / alibi time", a and f and f["us"] / a["us"], ">= 0.9", lambda v: v >= 0.9)
    return out


def targets_table(ts: list[dict]) -> str:
    lines = ["| target (issue 16) | value | goal | met |", "|---|---|---|---|"]
    for t in ts:
        met = "n/a" if t["met"] is None else ("yes" if t["met"] else "NO")
        lines.append(f"| {t['target']} | {_f(t['value'], '.2f')} | {t['goal']} | {met} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------- main

def report(rows, stream, args, device, hq, hkv, dim, t_start, done: bool):
    """The table and the targets; writes <out>/decode.json and decode.md (after every case too, `done` False, so
    that a run stopped by a time limit leaves what it measured)."""
    fill_ratios(rows, stream["gbs"])
    ts = targets(rows, args.cpu_smoke)
    text = (f"{device}; streaming bandwidth {stream['gbs']:.0f} GB/s (copy {stream['copy_gbs']:.0f}, sum "
            f"{stream['sum_gbs']:.0f}); bf16, Hq={hq}, Hkv={hkv}, D={dim}; reps {args.reps}, rounds {args.rounds}, "
            f"{args.calls} calls a sample"
            f"{'' if done else ' (partial)'}\n\n{table(rows)}\n\n{targets_table(ts)}\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode.json").write_text(json.dumps(dict(
        device=device, backend=jax.default_backend(), jax=jax.__version__, smoke=args.cpu_smoke, hq=hq, hkv=hkv,
        dim=dim, reps=args.reps, rounds=args.rounds, calls=args.calls, complete=done, stream=stream, rows=rows,
        targets=ts,
        wall_s=round(time.perf_counter() - t_start, 1)), indent=1))
    (out / "decode.md").write_text(text)
    return text


def main(args):
    smoke = args.cpu_smoke
    on_gpu = jax.default_backend() == "gpu"
    if smoke:
        args.reps, args.rounds = min(args.reps, 2), 1
    hq, hkv, dim = (SMOKE["hq"], SMOKE["hkv"], SMOKE["dim"]) if smoke else (HQ, HKV, DIM)
    batch = args.calls if on_gpu else 1
    device = jax.devices()[0].device_kind
    t_start = time.perf_counter()
    print(f"device: {device} ({jax.default_backend()}), jax {jax.__version__}, Hq={hq} Hkv={hkv} D={dim} bf16",
          flush=True)
    stream = stream_bandwidth(0.0625 if smoke else args.stream_gib, args.reps if on_gpu else 2, batch)
    print(f"streaming bandwidth: copy {stream['copy_gbs']:.0f} GB/s (read + write), sum {stream['sum_gbs']:.0f} "
          f"GB/s (read); reference {stream['gbs']:.0f} GB/s", flush=True)
    cases = select(make_cases(smoke), args.cases, args.quick, smoke)
    rows = []
    for group in dict.fromkeys(c.group for c in cases):
        members = [c for c in cases if c.group == group]
        c0 = members[0]
        kk, kv_ = jax.random.split(jax.random.PRNGKey(c0.batch * 100003 + c0.seq))
        shape = (c0.batch, c0.seq, hkv, dim)
        kv = dict(k=jax.random.normal(kk, shape, jnp.bfloat16), v=jax.random.normal(kv_, shape, jnp.bfloat16))
        for case in members:
            t0 = time.perf_counter()
            base = dict(case=case.name, group=case.group, note="", batch=case.batch, seq=case.seq, page=case.page,
                        sq=case.sq, keys=int(case.lens.sum()), kv_bytes=case.kv_bytes(hkv, dim), us=None, gbs=None,
                        max_abs_diff=None)
            if t0 - t_start > args.budget_s:
                case_rows = [dict(base, impl="(skipped)", error=f"time budget: {args.budget_s:.0f}s spent")]
            else:
                try:
                    case_rows = run_case(case, case_inputs(case, kv, hq), args, on_gpu, batch)
                except Exception as e:  # noqa: BLE001 - inputs failed (e.g. out of memory): record and go on
                    case_rows = [dict(base, impl="(inputs)", error=short_error(e))]
            rows += case_rows
            summary = ", ".join(f"{r['impl']} {r['us']:.1f}us" if r["us"] else f"{r['impl']} n/a" for r in case_rows)
            print(f"[{time.perf_counter() - t_start:6.1f}s] {case.name} ({time.perf_counter() - t0:.1f}s): {summary}",
                  flush=True)
            report(rows, stream, args, device, hq, hkv, dim, t_start, done=False)
        del kv
        gc.collect()
    text = report(rows, stream, args, device, hq, hkv, dim, t_start, done=True)
    print("\n" + text)
    print(f"wrote {Path(args.out) / 'decode.json'} ({time.perf_counter() - t_start:.0f}s)")


if __name__ == "__main__":
    main(ARGS)
