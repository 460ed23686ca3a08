"""The spec zoo against FlexAttention, the ejgen side: each variant of `zoo/*.yaml` (and the core ops' causal
baseline and prefix LM) as its generated op under `jax.jit`, forward and forward+backward, at the sizes of
`benchmarks/zoo_cases.py` (bf16, B=1, S=8192, H=16, D=128). `benchmarks/flex_zoo.py` times FlexAttention on the same
cases and data in its own process (torch and JAX do not share the GPU well); `--table` joins the two.

Timing as benchmarks/blocksparse.py (docs/DESIGN.md §8): each pass compiled first, then `--rounds` interleaved
rounds of `median_seconds` (samples of `--calls` calls back to back, 4 by default and as flex_zoo.py takes them,
after a warm-up that brings the clocks up); a figure
is the median over rounds. fwd+bwd is `jax.grad` of sum(out * a fixed random cotangent) with respect to q, k, v
and the learnable inputs (T5's table, gpt-oss's sinks), the forward included. Each case runs in its own
try/except (an error is recorded in the JSON and the run goes on), and the JSON is rewritten after every case, so
a crash keeps what ran before it. A variant the installed `ejgen.zoo` lacks (e.g. one not yet generated) is
recorded as "not built".

Outputs under --out: zoo_ejgen.json (rows: ms per pass, TFLOP/s of the visible pairs, errors) and
zoo_ejgen_check.npz (per case: out[0, rows, heads, :8] in float32, `zoo_cases.check_rows/check_heads`, and the
same slice of dq plus every learnable input's gradient), which `--table` compares with flex_zoo.py's.

    python benchmarks/zoo.py --out bench-out/zoo                        # ejgen, platform auto
    env -u PYTHONPATH python3 benchmarks/flex_zoo.py --out bench-out/zoo   # FlexAttention, its own process
    python benchmarks/zoo.py --out bench-out/zoo --table                # the markdown table, checks, zoo.png

Under a time limit per call, split the zoo with `--cases` and `--merge` (each call keeps the rows the earlier
calls wrote for the other cases, same sizes and device), the causal baseline in the first call.

The table: ejgen and Flex ms per pass, Flex / ejgen (> 1: ejgen faster), ejgen as a multiple of its causal
baseline (`flash_attention(causal=True)`, same run) and the ideal multiple, visible share / 0.5 (time
proportional to the visible (query, key) pairs; block-granular kernels cannot reach it on thin masks).
CPU check (no GPU: the XLA backend, a short sequence): `--seq 256 --platform xla --reps 1` (`--heads 2 --dim 64`
for a quicker one), and flex_zoo.py `--seq 256 --device cpu --eager --reps 1`; the CPU timings mean nothing, the
cross-check does.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zoo_cases

BATCH = 4  # calls per sample, dispatched back to back (flex_zoo.py times batches of 4 too)
FLAG = 2e-2  # cross-check: |ejgen - Flex| on the output slice (bf16 outputs of order 1; relative above 1)
GRAD_FLAG = 3e-2  # gradients: largest difference relative to the largest |value| of the slice


class NotBuilt(Exception):
    pass


def ejgen_op(case: zoo_cases.Case):
    """The case's generated op, imported lazily: "not built" when the installed package lacks it."""
    kind, name = case.op.split(":")
    module = {"zoo": "ejgen.zoo", "generated": "ejgen.generated", "ops": "ejgen.ops"}[kind]
    op = getattr(importlib.import_module(module), name, None)
    if op is None:
        raise NotBuilt(f"not built: {module} has no {name}")
    return op


def op_kwargs(case: zoo_cases.Case, arrays: dict) -> dict:
    """The op's keyword arguments: the case's options and the extra arrays by argument name, segment ids turned
    into `mask_info`."""
    from ejgen.types import MaskInfo

    kw = dict(case.kwargs)
    for name, a in arrays.items():
        if name == "segment_ids":
            kw["mask_info"] = MaskInfo.from_segments(a)
        else:
            kw[name] = a
    return kw


def make_call(case: zoo_cases.Case, platform: str):
    """fn(q, k, v, learn, fixed) -> out: the op with the case's options; `learn` and `fixed` are dicts of the
    case's extra arrays by argument name (learn: differentiated)."""
    op = ejgen_op(case)

    def call(q, k, v, learn, fixed):
        return op(q, k, v, platform=platform, **op_kwargs(case, {**learn, **fixed}))
    return call


def check_slice(x, case: zoo_cases.Case) -> np.ndarray:
    """x [B, S, H, D] -> float32 [rows, heads, 8]."""
    x = np.asarray(x.astype("float32"))
    return x[0, zoo_cases.check_rows(case.seq)][:, zoo_cases.check_heads(case.heads), :8]


def run_case(case: zoo_cases.Case, platform: str, reps: int, rounds: int, checks: dict) -> dict:
    """One case: compile fwd and fwd+bwd, save the check slices, time both in interleaved rounds."""
    import jax
    import jax.numpy as jnp

    from ejgen.testing.timing import median_seconds

    row = dict(case=case.key, label=case.label, visible=zoo_cases.visible_fraction(case), errors={})
    data = zoo_cases.inputs(case)
    q, k, v, do = (jnp.asarray(data[n], jnp.bfloat16) for n in ("q", "k", "v", "do"))
    learn = {n: jnp.asarray(a) for n, a in case.arrays.items() if n in case.learnable}
    fixed = {n: jnp.asarray(a) for n, a in case.arrays.items() if n not in case.learnable}
    call = make_call(case, platform)

    def loss(q, k, v, learn, fixed):
        return jnp.sum(call(q, k, v, learn, fixed).astype(jnp.float32) * do.astype(jnp.float32))

    args = (q, k, v, learn, fixed)
    try:  # which platform and kernel sets the call takes (ejgen.ops.explain: nothing runs)
        from ejgen.ops import explain

        row["kernels"] = explain(ejgen_op(case), q, k, v, platform=platform,
                                 **op_kwargs(case, {**learn, **fixed})).text()
    except NotBuilt:
        raise
    except Exception as e:  # noqa: BLE001 - informative only
        row["kernels"] = f"explain failed: {type(e).__name__}: {e}"[:500]
    compiled = {}
    for pass_, fn in (("fwd", call), ("fwd+bwd", jax.grad(loss, argnums=(0, 1, 2, 3)))):
        try:
            t0 = time.perf_counter()
            exe = jax.jit(fn).lower(*args).compile()
            result = jax.block_until_ready(exe(*args))
            row[f"compile_s {pass_}"] = time.perf_counter() - t0
            compiled[pass_] = exe
            if pass_ == "fwd":
                checks[f"{case.key}/out"] = check_slice(result, case)
                row["out_finite"] = bool(jnp.all(jnp.isfinite(result.astype(jnp.float32))))
            else:
                dq, _, _, dlearn = result
                checks[f"{case.key}/dq"] = check_slice(dq, case)
                for name, g in dlearn.items():
                    checks[f"{case.key}/d_{name}"] = np.asarray(g, np.float32)
        except Exception as e:  # noqa: BLE001 - recorded, the next pass / case goes on
            row["errors"][pass_] = error_text(e)
    times = {p: [] for p in compiled}
    for r in range(rounds):
        for pass_, exe in compiled.items():
            try:
                times[pass_].append(median_seconds(exe, args, reps, warmup=1, warm_seconds=0.3 if r == 0 else 0.05,
                                                   batch=BATCH))
            except Exception as e:  # noqa: BLE001
                row["errors"][pass_] = error_text(e)
    pairs = row["visible"] * case.seq * case.seq
    for pass_, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
        if times.get(pass_) and pass_ not in row["errors"]:
            ms = statistics.median(times[pass_]) * 1e3
            row[f"ms {pass_}"] = ms
            row[f"tflops {pass_}"] = mult * 4.0 * case.batch * case.heads * case.dim * pairs / ms / 1e9
    return row


def error_text(e: BaseException) -> str:
    """The exception and the last frames of its traceback (the JSON keeps what went wrong where)."""
    if isinstance(e, NotBuilt):
        return str(e)
    head = f"{type(e).__name__}: {' '.join(str(e).split())}"[:1500]  # the message on the first line
    frames = traceback.format_tb(e.__traceback__)
    return head + "\n" + "".join(frames[-2:])[-1500:]


def run(a) -> None:
    import jax

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    chosen = zoo_cases.select(zoo_cases.cases(a.seq, a.heads, a.dim), a.cases)
    meta = dict(side="ejgen", device=jax.devices()[0].device_kind, backend=jax.default_backend(),
                jax=jax.__version__, platform=a.platform, seq=a.seq, heads=a.heads, dim=a.dim, reps=a.reps,
                rounds=a.rounds, calls=BATCH, cases=[c.describe() for c in zoo_cases.cases(a.seq, a.heads, a.dim)])
    rows, checks = [], {}
    if a.merge:
        rows, checks = zoo_cases.previous(out / "zoo_ejgen.json", out / "zoo_ejgen_check.npz", meta, chosen)
    for case in chosen:
        t0 = time.perf_counter()
        try:
            row = run_case(case, a.platform, a.reps, a.rounds, checks)
        except Exception as e:  # noqa: BLE001 - one broken variant must not lose the rest of the run
            row = dict(case=case.key, label=case.label, errors={"case": error_text(e)})
        row["wall_s"] = time.perf_counter() - t0
        rows = sorted(rows + [row], key=lambda r: zoo_cases.order(r["case"]))
        (out / "zoo_ejgen.json").write_text(json.dumps(dict(meta, rows=rows), indent=1, default=str))
        np.savez(out / "zoo_ejgen_check.npz", **checks)
        err = "; ".join(f"{p}: {t.splitlines()[0][:300]}" for p, t in row["errors"].items())
        print(f"{case.key:15s} fwd {row.get('ms fwd', float('nan')):9.3f} ms  fwd+bwd "
              f"{row.get('ms fwd+bwd', float('nan')):9.3f} ms  ({row['wall_s']:.0f} s) {err}", flush=True)
    print(f"wrote {out / 'zoo_ejgen.json'}")


# ---------------------------------------------------------------------------------------------------- the report


def _fmt(x, spec=".3f", missing="—") -> str:
    return missing if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def cross_check(key: str, ours: dict, theirs: dict) -> tuple[str, bool | None, dict]:
    """The cell for one case: max |ejgen - Flex| on the output slice (flagged where a difference passes FLAG, or
    FLAG x |value| for values above 1: bf16's rounding is relative) and the gradients' largest difference relative
    to their largest value (flagged above GRAD_FLAG); ok is None when a side lacks the slice."""
    detail = {}
    if f"{key}/out" not in ours or f"{key}/out" not in theirs:
        return "—", None, detail
    a, b = ours[f"{key}/out"], theirs[f"{key}/out"]
    if a.shape != b.shape:
        return f"shapes {a.shape} vs {b.shape}", False, detail
    diff = float(np.max(np.abs(a - b)))
    detail["out"] = diff
    ok = bool(np.all(np.abs(a - b) <= FLAG * np.maximum(1.0, np.abs(b))))  # bf16 rounds relative above 1
    text = f"{diff:.1e}" + ("" if ok else " ✗")
    grads = sorted(n for n in ours if n.startswith(f"{key}/d") and n in theirs)
    worst = 0.0
    for n in grads:
        g, h = ours[n], theirs[n]
        rel = float(np.max(np.abs(g - h)) / max(float(np.max(np.abs(h))), 1e-6))
        detail[n.split("/", 1)[1]] = rel
        worst = max(worst, rel)
    if grads:
        ok = ok and worst <= GRAD_FLAG
        text += f", grads {worst:.1e}" + ("" if worst <= GRAD_FLAG else " ✗")
    return text, ok, detail


def table(out: Path, plot: Path | None) -> str:
    """The markdown report of zoo_ejgen.json and zoo_flex.json under `out` (either may be missing)."""
    sides = {}
    for side in ("ejgen", "flex"):
        path = out / f"zoo_{side}.json"
        sides[side] = json.loads(path.read_text()) if path.exists() else dict(rows=[])
    checks = {side: dict(np.load(out / f"zoo_{side}_check.npz")) if (out / f"zoo_{side}_check.npz").exists() else {}
              for side in ("ejgen", "flex")}
    ej, fx = sides["ejgen"], sides["flex"]
    by = {side: {r["case"]: r for r in sides[side]["rows"]} for side in sides}
    keys = sorted({r["case"] for s in sides.values() for r in s["rows"]}, key=zoo_cases.order)
    labels = {r["case"]: r["label"] for s in sides.values() for r in s["rows"]}
    lines = [f"ejgen: {ej.get('device', '?')}, jax {ej.get('jax', '?')}, platform {ej.get('platform', '?')}; "
             f"Flex: {fx.get('device', '?')}, torch {fx.get('torch', '?')}"
             + (" (eager)" if fx.get("eager") else ""),
             (f"S={ej.get('seq', fx.get('seq'))}, H={ej.get('heads', fx.get('heads'))}, "
              f"D={ej.get('dim', fx.get('dim'))}, B=1, bf16")]
    for name in ("seq", "heads", "dim", "calls"):
        if name in ej and name in fx and ej[name] != fx[name]:
            lines.append(f"**{'sizes' if name != 'calls' else 'calls a sample'} differ: {name} {ej[name]} (ejgen) vs "
                         f"{fx[name]} (Flex)**")
    if "calls" in ej or "calls" in fx:  # the sizes' line
        lines[1] += f"; {ej.get('calls', fx.get('calls'))} calls a sample"
    header = ("| variant | visible | ejgen fwd ms | Flex fwd ms | Flex / ejgen | ejgen fwd+bwd ms | Flex fwd+bwd ms "
              "| Flex / ejgen | ejgen × causal fwd | ejgen × causal fwd+bwd | ideal × causal | Flex mask build ms "
              "| check |")
    lines += ["", header, "|---" * 13 + "|"]
    base = by["ejgen"].get("causal", {})
    ratios = {"fwd": [], "fwd+bwd": []}
    plotted = []
    failures, notes, kernels = [], [], []
    for key in keys:
        e, f = by["ejgen"].get(key, {}), by["flex"].get(key, {})
        cells = [labels[key], _fmt(e.get("visible", f.get("visible")), ".3f")]
        row_ratio = {}
        for pass_ in ("fwd", "fwd+bwd"):
            em, fm = e.get(f"ms {pass_}"), f.get(f"ms {pass_}")
            r = fm / em if em and fm else None
            row_ratio[pass_] = r
            if r is not None and key != "causal":
                ratios[pass_].append(r)
            cells += [_fmt(em), _fmt(fm), _fmt(r, ".2f")]
        for pass_ in ("fwd", "fwd+bwd"):
            em, bm = e.get(f"ms {pass_}"), base.get(f"ms {pass_}")
            cells.append(_fmt(em / bm if em and bm else None, ".2f"))
        vis = e.get("visible", f.get("visible"))
        cells.append(_fmt(vis / 0.5 if vis is not None else None, ".2f"))
        cells.append(_fmt(f.get("ms build"), ".2f", "—" if not f or f.get("visible") != 1.0 else "none"))
        text, ok, _ = cross_check(key, checks["ejgen"], checks["flex"])
        if ok is False:
            failures.append(labels[key])
        cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")
        if row_ratio["fwd"] or row_ratio["fwd+bwd"]:
            plotted.append((labels[key], row_ratio["fwd"], row_ratio["fwd+bwd"]))
        for side, r in (("ejgen", e), ("Flex", f)):
            for pass_, t in (r.get("errors") or {}).items():
                notes.append(f"- {labels[key]}, {side} {pass_}: {t.splitlines()[0][:300]}")
            if not r and key in labels:
                notes.append(f"- {labels[key]}: no {side} row")
        if e.get("kernels"):
            kernels.append(f"- {labels[key]}: {e['kernels'].splitlines()[0]}")
    lines.append("")
    for pass_ in ("fwd", "fwd+bwd"):
        if ratios[pass_]:
            lines.append(f"Median Flex / ejgen over the zoo ({len(ratios[pass_])} variants, the baseline row left "
                         f"out), {pass_}: {statistics.median(ratios[pass_]):.2f}")
    verdict = "all agree" if not failures else "DISAGREE: " + ", ".join(failures)
    lines.append(f"Cross-check (output slice: max abs diff, flagged above {FLAG:g} (x |value| above 1); dq and the "
                 f"learnable inputs' gradients: relative to their largest value, flagged above {GRAD_FLAG:g}): "
                 + verdict)
    if notes:
        lines += ["", "Errors:"] + notes
    if kernels:
        lines += ["", "ejgen's kernel sets (`ejgen.ops.explain`):"] + kernels
    if plot is not None:
        lines.append(plot_ratios(plotted, plot, ej.get("device", "?")))
    return "\n".join(lines) + "\n"


def plot_ratios(plotted: list, path: Path, device: str) -> str:
    """Bars of Flex / ejgen per variant (fwd and fwd+bwd side by side); 1 = parity, above: ejgen faster."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(no matplotlib: no plot)"
    if not plotted:
        return "(nothing to plot)"
    names = [p[0] for p in plotted]
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(max(8.0, 0.6 * len(names) + 2), 5))
    for i, (pass_, color) in enumerate((("fwd", "#d62728"), ("fwd+bwd", "#1f77b4"))):
        vals = [p[1 + i] if p[1 + i] is not None else 0.0 for p in plotted]
        ax.bar(x + (i - 0.5) * 0.4, vals, 0.4, label=pass_, color=color)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(x, names, rotation=45, ha="right")
    ax.set_ylabel("Flex time / ejgen time (> 1: ejgen faster)")
    ax.set_title(f"The spec zoo against FlexAttention, {device}")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"(plot: {path})"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-out/zoo")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=4, help="calls a sample dispatches back to back (the peer's script "
                   "takes the same option): the host's dispatch of a sample's first call and its wake-up after the "
                   "wait count 1/calls of a row")
    p.add_argument("--cases", default="", help="comma-separated keys or parts of labels (default: all)")
    p.add_argument("--merge", action="store_true", help="keep the other cases' rows of an earlier run in --out "
                                                        "(same sizes and device): a run split over several calls")
    p.add_argument("--seq", type=int, default=zoo_cases.SEQ)
    p.add_argument("--heads", type=int, default=zoo_cases.HEADS)
    p.add_argument("--dim", type=int, default=zoo_cases.DIM)
    p.add_argument("--platform", default="auto", choices=["auto", "triton", "pallas", "xla"])
    p.add_argument("--table", action="store_true", help="print the report of zoo_ejgen.json + zoo_flex.json in --out")
    p.add_argument("--plot", default=str(Path(__file__).resolve().parent / "zoo.png"),
                   help="where --table writes its plot ('' for none)")
    a = p.parse_args()
    if a.table:
        text = table(Path(a.out), Path(a.plot) if a.plot else None)
        (Path(a.out) / "zoo.md").write_text(text)
        print(text)
    else:
        global BATCH
        BATCH = a.calls
        run(a)


if __name__ == "__main__":
    main()
