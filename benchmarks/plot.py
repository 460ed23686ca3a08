"""The benchmark plot, benchmarks/attention.png, regenerated from the latest table in BENCHMARKS.md.

    python benchmarks/plot.py                      # latest BENCHMARKS.md table -> benchmarks/attention.png
    python benchmarks/plot.py --check              # exit 1 if the PNG is not of the latest table (no matplotlib)
    python benchmarks/plot.py --json bench-out/results.json -o bench-out/attention.png   # a run's own output

The source is the table, not a run's results.json: BENCHMARKS.md is what is versioned (the raw output of a run
is not), so the plot shows exactly the figures of the newest `## Train mode, <card> ...` section: its first
table's TFLOP/s columns (ejgen, cuDNN, Pallas-Triton mha where the table has them) and its first x cuDNN
column. Grouped bars per case, forward and forward+backward side by side, the y axis from zero in TFLOP/s, the
card in the title. The figures are embedded in the PNG (a text chunk), which `--check` compares with the table.
"""

from __future__ import annotations

import argparse
import json
import re
import struct
import sys
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MD = ROOT / "BENCHMARKS.md"
DEFAULT_PNG = ROOT / "benchmarks" / "attention.png"
META_KEY = "ejgen-figures"
IMPL_COLUMNS = (  # table column (a prefix, case-insensitive) -> impl name
    ("ejgen triton", "ejgen-triton"),
    ("ejgen pallas", "ejgen-pallas"),
    ("ejgen deterministic", "ejgen-triton-det"),
    ("cudnn", "cudnn"),
    ("pallas-triton mha", "pallas-mha"),
)
LABELS = {"ejgen-triton": "ejgen (Triton / Gluon)", "ejgen-triton-det": "ejgen, deterministic=True",
          "ejgen-pallas": "ejgen (Pallas)", "cudnn": "cuDNN",
          "pallas-mha": "JAX Pallas-Triton mha", "xla": "XLA"}
COLORS = {"ejgen-triton": "#d62728", "ejgen-triton-det": "#ff7f0e", "ejgen-pallas": "#ff9896", "cudnn": "#1f77b4", "pallas-mha": "#2ca02c",
          "xla": "#7f7f7f"}


class TableError(ValueError):
    pass


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def latest_table(md: str) -> dict:
    """The newest `## Train mode, <card> (...)` section's first table, as figures:
    {card, title, d, rows: [{s, d, causal, window, pass_, tflops: {impl: x}, x_cudnn}]}."""
    sections = re.split(r"^## ", md, flags=re.M)
    section = next((s for s in sections[1:] if s.startswith("Train mode")), None)
    if section is None:
        raise TableError("no '## Train mode, <card> ...' section in BENCHMARKS.md")
    heading = section.splitlines()[0]
    m = re.match(r"Train mode, (.+?) \((.*)\)\s*$", heading)
    if not m:
        raise TableError(f"heading not of the form 'Train mode, <card> (<date, versions>)': {heading!r}")
    card, detail = m.groups()
    lines = section.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith("|")), None)
    if start is None or start + 1 >= len(lines) or not re.match(r"^\|[-| :]+\|$", lines[start + 1].strip()):
        raise TableError(f"no table under '## {heading}'")
    header = _cells(lines[start])
    col = {h.lower(): i for i, h in enumerate(header)}
    for need in ("s", "causal", "window", "pass"):
        if need not in col:
            raise TableError(f"the table under '## {heading}' has no {need!r} column: {header}")
    impls = []
    for i, h in enumerate(header):
        for prefix, impl in IMPL_COLUMNS:
            if h.lower().startswith(prefix) and impl not in (x for x, _ in impls):
                impls.append((impl, i))
    if not any(impl == "cudnn" for impl, _ in impls) or not any(impl.startswith("ejgen") for impl, _ in impls):
        raise TableError(f"the table under '## {heading}' lacks an ejgen or a cuDNN TFLOP/s column: {header}")
    ratio_col = next((i for i, h in enumerate(header) if h.lower().startswith("x cudnn")
                      or h.lower().startswith("triton x cudnn")), None)
    d_default = None
    if "d" not in col:  # a --quick table: the head dim the preamble states
        dm = re.search(r"\bD = (\d+)\b", sections[0])
        if not dm:
            raise TableError("the table has no D column and the preamble states no 'D = <head dim>'")
        d_default = int(dm.group(1))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        c = _cells(line)
        if len(c) != len(header):
            raise TableError(f"row with {len(c)} cells under a header of {len(header)}: {line}")
        window = re.findall(r"-?\d+", c[col["window"]])
        tflops = {}
        for impl, i in impls:
            v = c[i].replace("*", "")
            if re.fullmatch(r"\d+(\.\d+)?", v):
                tflops[impl] = float(v)
        ratio = None
        if ratio_col is not None:
            rm = re.match(r"\**(\d+\.\d+)", c[ratio_col])
            ratio = float(rm.group(1)) if rm else None
        rows.append(dict(s=int(c[col["s"]]), d=int(c[col["d"]]) if "d" in col else d_default,
                         causal=bool(int(c[col["causal"]])), window=[int(x) for x in window] or None,
                         pass_=c[col["pass"]], tflops=tflops, x_cudnn=ratio))
    if not rows:
        raise TableError(f"empty table under '## {heading}'")
    return dict(card=card, title=f"BENCHMARKS.md, {detail}", source=f"BENCHMARKS.md: ## {heading}", rows=rows)


def from_results_json(path: Path) -> dict:
    """A run's own results.json (benchmarks/attention.py --out): the same figures (ratios recomputed)."""
    data = json.loads(path.read_text())
    by_case = {}
    for r in data["rows"]:
        if not r.get("tflops"):
            continue
        key = (r["s"], r["d"], r["causal"], tuple(r["window"]) if r["window"] else None, r["pass_"])
        by_case.setdefault(key, {})[r["impl"]] = round(r["tflops"])
    rows = []
    for (s, d, causal, window, pass_), tflops in by_case.items():
        ours = tflops.get("ejgen-triton")
        ratio = round(ours / tflops["cudnn"], 2) if ours and tflops.get("cudnn") else None
        rows.append(dict(s=s, d=d, causal=causal, window=list(window) if window else None, pass_=pass_,
                         tflops=tflops, x_cudnn=ratio))
    return dict(card=data["device"], title=path.name, source=str(path), rows=rows)


def _case_label(r, with_d: bool) -> str:
    s = f"{r['s'] // 1024}k" if r["s"] % 1024 == 0 else str(r["s"])
    label = (f"D={r['d']} " if with_d else "") + f"S={s}" + (" causal" if r["causal"] else "")
    if r["window"]:
        label += f"\nwindow ({r['window'][0]}, {r['window'][1]})"
    return label


def plot(fig_data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = fig_data["rows"]
    with_d = len({r["d"] for r in rows}) > 1
    passes = [p for p in ("fwd", "fwd+bwd") if any(r["pass_"] == p for r in rows)]
    impls = [i for i in LABELS if any(i in r["tflops"] for r in rows)]
    cases = []
    for r in rows:
        key = (r["d"], r["s"], r["causal"], tuple(r["window"] or ()))
        if key not in [c[0] for c in cases]:
            cases.append((key, _case_label(r, with_d)))
    top = max(v for r in rows for v in r["tflops"].values())
    fig, axes = plt.subplots(1, len(passes), figsize=(6.5 * len(passes), 4.6), squeeze=False, sharey=True)
    width = 0.8 / len(impls)
    for ax, pass_ in zip(axes[0], passes):
        for k, impl in enumerate(impls):
            xs, ys, notes = [], [], []
            for j, (key, _) in enumerate(cases):
                r = next((r for r in rows if r["pass_"] == pass_ and (r["d"], r["s"], r["causal"],
                                                                     tuple(r["window"] or ())) == key), None)
                if r and impl in r["tflops"]:
                    xs.append(j + (k - (len(impls) - 1) / 2) * width)
                    ys.append(r["tflops"][impl])
                    # the table's ratio is the default ejgen's; any other ejgen bar gets its own from the figures
                    own = r["tflops"][impl] / r["tflops"]["cudnn"] if r["tflops"].get("cudnn") else None
                    ratio = r["x_cudnn"] if impl == "ejgen-triton" and r["x_cudnn"] else own
                    notes.append(ratio if impl.startswith("ejgen") else None)
            bars = ax.bar(xs, ys, width, label=LABELS[impl], color=COLORS[impl])
            for bar, y, note in zip(bars, ys, notes):
                ax.annotate(f"{y:.0f}" + (f"\n{note:.2f}x" if note else ""), (bar.get_x() + bar.get_width() / 2, y),
                            xytext=(0, 2), textcoords="offset points", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(cases)), [label for _, label in cases], fontsize=8)
        ax.set_ylim(0, top * 1.18)
        ax.set_title("forward" if pass_ == "fwd" else "forward + backward", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    axes[0][0].set_ylabel(f"TFLOP/s on {fig_data['card']} (FlashAttention FLOP count)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(impls), fontsize=9, frameon=False)
    d = sorted({r["d"] for r in rows})
    peers = ", ".join(LABELS[i] for i in impls if not i.startswith("ejgen"))
    fig.suptitle(f"Attention on {fig_data['card']}, ejgen against {peers}: {fig_data['title']}\n"
                 f"bf16, head dim {'/'.join(map(str, d))}, B·S = 32k tokens, H = 16; over each ejgen bar: "
                 f"TFLOP/s and its ratio to cuDNN", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out, dpi=110, metadata={"Software": None, "Source": fig_data["source"],
                                        META_KEY: json.dumps(figures(fig_data), sort_keys=True)})
    plt.close(fig)


def figures(fig_data: dict) -> dict:
    """What the PNG shows, in canonical form (what --check compares)."""
    return dict(card=fig_data["card"], title=fig_data["title"], rows=fig_data["rows"])


def png_text(path: Path) -> dict:
    """The tEXt / zTXt / iTXt chunks of a PNG (standard library only)."""
    data = path.read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path}: not a PNG")
    out, i = {}, 8
    while i + 8 <= len(data):
        n, kind = struct.unpack(">I4s", data[i:i + 8])
        body = data[i + 8:i + 8 + n]
        i += 12 + n
        if kind == b"tEXt":
            k, v = body.split(b"\0", 1)
            out[k.decode("latin-1")] = v.decode("latin-1")
        elif kind == b"zTXt":
            k, v = body.split(b"\0", 1)
            out[k.decode("latin-1")] = zlib.decompress(v[1:]).decode("latin-1")
        elif kind == b"iTXt":
            k, rest = body.split(b"\0", 1)
            compressed, rest = rest[0], rest[2:]
            _lang, rest = rest.split(b"\0", 1)
            _tkey, v = rest.split(b"\0", 1)
            out[k.decode("latin-1")] = (zlib.decompress(v) if compressed else v).decode("utf-8")
        elif kind == b"IEND":
            break
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--md", type=Path, default=DEFAULT_MD, help="the markdown with the tables (BENCHMARKS.md)")
    p.add_argument("--json", type=Path, help="plot a run's results.json (benchmarks/attention.py) instead")
    p.add_argument("-o", "--out", type=Path, default=DEFAULT_PNG)
    p.add_argument("--check", action="store_true", help="only check that --out shows the latest table's figures")
    args = p.parse_args(argv)
    try:
        fig_data = from_results_json(args.json) if args.json else latest_table(args.md.read_text())
    except TableError as e:
        print(f"plot.py: {e}", file=sys.stderr)
        return 2
    if args.check:
        want = json.loads(json.dumps(figures(fig_data), sort_keys=True))
        try:
            got = json.loads(png_text(args.out).get(META_KEY, "null"))
        except (OSError, ValueError) as e:
            got = f"unreadable: {e}"
        if got != want:
            print(f"{args.out} is not the plot of {fig_data['source']}: run python benchmarks/plot.py",
                  file=sys.stderr)
            return 1
        print(f"{args.out}: up to date with {fig_data['source']}")
        return 0
    plot(fig_data, args.out)
    print(f"{args.out}: {len(fig_data['rows'])} rows of {fig_data['source']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
