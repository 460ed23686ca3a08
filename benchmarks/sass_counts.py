"""Static instruction counts of the Hopper (Gluon) kernels' sm_90 SASS, compiled here: no GPU needed.

Session 25 found NATTEN 2-D's forward cost this way (its masked-block loop ran 972 instructions a 128-key block, 512 of
them the element mask's ISETP / FSEL chain; notes/perf.md): compile a call's kernel with the GPU host's Triton
(``EJGEN_GPU_HOST_TRITON``, as the AOT tests do, else the installed one), disassemble it (``nvdisasm``, shipped with
Triton) and count opcodes over the whole kernel and over its main loop (the instructions between the loop's first
predicated two-way branch and the next unconditional one: the pipelined block loop of the forward's consumers).
Counts compare two trees or two settings of one change; they are not times (the forward at 1000 instructions a
block was latency-bound, notes/perf.md).

    EJGEN_GPU_HOST_TRITON=/work/triton36 python benchmarks/sass_counts.py --case natten2d --kernel fwd
    python benchmarks/sass_counts.py --case documents --kernel bwd --top 12
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

CASES = {  # compile_gluon's arguments per case (B 1, H 16, S 8192, D 128: the zoo's benchmark size)
    "causal": dict(causal=True),
    "plain": dict(causal=False),
    "window": dict(causal=True, window=True),
    "documents": dict(causal=True, segments=True),
    "natten2d": dict(causal=False, spec="ejgen.zoo.natten_2d_attention"),
    "sliding_tile": dict(causal=False, spec="ejgen.zoo.sliding_tile_attention"),
    "prefix_lm": dict(causal=False, spec="ejgen.generated.prefix_lm_attention"),
}
OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="natten2d", choices=sorted(CASES))
    p.add_argument("--kernel", default="fwd", choices=["fwd", "bwd"])
    p.add_argument("--top", type=int, default=10, help="opcodes shown per count")
    p.add_argument("--staged-backward", type=int, choices=[0, 1], default=None, help="the backward's position "
                   "terms staged (1) or read from the table (0); default: as calls take them, "
                   "triton.host.STAGED_BACKWARD")
    return p.parse_args(argv)


def sass(case: str, kernel: str, staged_backward: bool | None = None) -> str:
    """The kernel's SASS text (nvdisasm) for one case of `CASES`."""
    import triton

    from ejgen.testing.aot import compile_gluon

    kw = dict(CASES[case], batch=1, heads=16, kv_heads=16, seq=8192, head_dim=128)
    if kernel == "fwd":
        kw["forward_only"] = True
    else:
        kw.update(backward_only=True, staged_backward=staged_backward)
    compiled = compile_gluon(**kw)[f"gluon_{kernel}_kernel"]
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout


def counts(lines) -> collections.Counter:
    return collections.Counter(m.group(1) for line in lines for m in [OPCODE.search(line)] if m)


def main_loop(lines: list) -> list:
    """The lines of the main loop: from the second predicated two-way branch (``@P0 BRA P1, ...``: the first is the
    first block's, before the loop) to the next unconditional branch; empty if the kernel has no such shape."""
    two_way = [i for i, line in enumerate(lines) if re.search(r"@!?P\d BRA !?P\d, `", line)]
    if len(two_way) < 2:
        return []
    start = two_way[1]
    ends = [i for i, line in enumerate(lines) if i > start and re.search(r"\*/\s+BRA `", line)]
    return lines[start:ends[0]] if ends else []


def main(argv=None) -> int:
    a = parse_args(argv)
    if os.environ.get("EJGEN_GPU_HOST_TRITON"):
        sys.path.insert(0, os.environ["EJGEN_GPU_HOST_TRITON"])
    import triton

    lines = sass(a.case, a.kernel, None if a.staged_backward is None else bool(a.staged_backward)).splitlines()
    whole = counts(lines)
    print(f"{a.case} {a.kernel} (Triton {triton.__version__}, sm_90): {sum(whole.values())} instructions; "
          f"local memory {whole['STL'] + whole['LDL']} (STL + LDL)")
    print("  " + ", ".join(f"{op} {n}" for op, n in whole.most_common(a.top)))
    loop = counts(main_loop(lines))
    if loop:
        print(f"main loop: {sum(loop.values())} instructions a trip")
        print("  " + ", ".join(f"{op} {n}" for op, n in loop.most_common(a.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
