"""Nsight Compute's stall samples by source line for the recurrent Triton kernels (notes/recurrent-perf.md, session 24).

The kernels jax-triton launches carry no line info, so Nsight Compute's source page gives SASS alone. This compiles
the same kernel here with the GPU host's Triton (``EJGEN_GPU_HOST_TRITON``, as the AOT tests do), disassembles it with
line info (``nvdisasm -c -g``, shipped with Triton) and pairs its instructions with the profile's by index: the table
says how many paired and how many opcodes agree (a kernel compiled under other constexprs than the profiled call shows
as a count that differs). Lines of Triton's library (a `tl.sum`'s shuffles, a scan) are given to the kernel line
before them, marked "(lib)".

The profile: `gpu_round.sh ncu-src` writes `src-<op>.csv.gz` (`ncu -i REPORT --page source --csv --print-source
sass`) into the device call's $OUT. Then here:

    EJGEN_GPU_HOST_TRITON=/work/triton36 python benchmarks/ncu_lines.py src-gla.csv.gz --op gla \\
        --kernel chunk_grads_intra [--top 30]

``--op`` picks the spec and its gates (gla: gk, simple_gla: g, lightning_attention: g_gamma); the kernel is compiled
as `recurrent_kernels.py` times it (bf16, H 16, K = V = 128, bf16 states and products: the defaults for bf16 inputs).
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GATES = {"gla": ("gk",), "simple_gla": ("g",), "lightning_attention": ("g_gamma",)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile", help="the source page's CSV (.csv or .csv.gz)")
    p.add_argument("--op", default="gla", choices=sorted(GATES))
    p.add_argument("--kernel", required=True, help="e.g. chunk_grads_intra (the profile's first launch of it)")
    p.add_argument("--top", type=int, default=30)
    return p.parse_args(argv)


def profile_rows(path: str, kernel: str) -> tuple[list, list]:
    """(header, rows) of the first block of ``kernel`` in the CSV (blocks start with a "Kernel Name" row)."""
    opener = gzip.open if path.endswith(".gz") else open
    header, rows, current = None, [], None
    with opener(path, "rt") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                if rows:
                    break
                current = row[1]
            elif row[0] == "Address":
                header = row
            elif current and current.endswith(kernel + "_kernel") and header:
                rows.append(row)
    if not rows:
        raise SystemExit(f"{path}: no source page of a kernel named *{kernel}_kernel")
    return header, rows


def compile_kernel(op: str, kernel: str) -> bytes:
    """The kernel's cubin from this host's compile (the GPU host's Triton first on the path)."""
    host = os.environ.get("EJGEN_GPU_HOST_TRITON")
    if host:
        sys.path.insert(0, host)
    sys.path.insert(0, str(ROOT))
    from ejgen.testing import aot

    compiled = aot.compile_recurrent("ejgen.generated", op, gates=GATES[op], states="bfloat16", products="bfloat16",
                                     h0=False, kernels=[kernel])
    return compiled[kernel].asm["cubin"]


def disassembly(cubin: bytes) -> list[tuple[int, str]]:
    """[(source line, instruction)] in address order; lines of files other than the kernels' negated (the kernel
    line before them)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    path = Path(os.environ.get("TMPDIR", "/tmp")) / "ncu_lines.cubin"
    path.write_bytes(cubin)
    text = subprocess.run([str(tool), "-c", "-g", str(path)], capture_output=True, text=True, check=True).stdout
    out, line, kernel_line = [], 0, 0
    for entry in text.splitlines():
        m = re.search(r'//## File "(.*)", line (\d+)', entry)
        if m:
            if m.group(1).endswith("triton_kernels.py"):
                line = kernel_line = int(m.group(2))
            else:
                line = -kernel_line
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", entry)
        if m:
            out.append((line, m.group(1)))
    return out


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text.strip()).split(" ")[0].split(".")[0] if text.strip() else ""


def main(argv=None) -> int:
    args = parse_args(argv)
    header, rows = profile_rows(args.profile, args.kernel)
    col = {name: i for i, name in enumerate(header)}
    samples = col["Warp Stall Sampling (All Samples)"]
    local = disassembly(compile_kernel(args.op, args.kernel))
    pairs = list(zip(rows, local))
    agree = sum(opcode(r[col["Source"]]) == opcode(t) for r, (_, t) in pairs)
    total = sum(int(r[samples]) for r in rows) or 1
    print(f"{args.kernel} ({args.op}): profile {len(rows)} instructions, here {len(local)}; paired {len(pairs)}, "
          f"opcodes agree on {agree}; {total} samples\n")
    by_op = collections.Counter()
    for r in rows:
        by_op[opcode(r[col["Source"]])] += int(r[samples])
    print("by opcode: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in by_op.most_common(10)) + "\n")
    by_line = collections.Counter()
    for r, (line, _) in pairs:
        by_line[line] += int(r[samples])
    source = (ROOT / "generated" / "_linear_recurrent" / "triton_kernels.py").read_text().splitlines()
    print("| samples | line | source |")
    print("|---|---|---|")
    for line, n in by_line.most_common(args.top):
        text = source[abs(line) - 1].strip()[:100] if line else ""
        print(f"| {100 * n / total:.1f}% | {abs(line)}{' (lib)' if line < 0 else ''} | `{text}` |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
