"""Digests of the PTX of every Triton and Gluon attention kernel, compiled ahead of time for sm_90 over a set of
representative configurations: one JSON object {kernel/config: sha256}. Two trees give the same digests iff
their compiled kernels are the same instruction for instruction (debug line info is left out, so moving code in
a source file does not count).

    python benchmarks/ptx_digest.py > new.json          # this tree
    PYTHONPATH=old-tree python benchmarks/ptx_digest.py > old.json
    python benchmarks/ptx_digest.py --compare old.json new.json

Runs on any machine with Triton (no GPU); the Triton version decides the PTX, so compare digests of one version.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys

SPECS = {  # spec -> its params (name: dtype), for the kernels' signatures
    "flash_attention": {},
    "alibi_attention": {"slopes": "float32"},
    "relative_bias_attention": {"rel_table": "float32"},
    "local_softcap_sinks_attention": {},
    "prefix_lm_attention": {},
}
CONFIGS = [  # (id, compile_attention kwargs)
    ("bf16-d128-causal-tma", dict(dtype="bfloat16", head_dim=128, causal=True, tma=True)),
    ("bf16-d64-full-merged", dict(dtype="bfloat16", head_dim=64, causal=False, staged=False, block_m=64)),
    ("bf16-d128-window-band", dict(dtype="bfloat16", head_dim=128, causal=True, window=True, band=True,
                                   block_m=64, block_n=64)),
    ("bf16-d128-softcap-sinks-bias", dict(dtype="bfloat16", head_dim=128, softcap=True, sinks=True, bias=True)),
    ("bf16-d64-segments-dense", dict(dtype="bfloat16", head_dim=64, segments=True, dense=True)),
    ("f16-d128-varlen-atomic", dict(dtype="float16", head_dim=128, varlen=True, atomic_dq=True)),
    ("f32-d64-causal", dict(dtype="float32", head_dim=64, causal=True, block_m=32, block_n=32)),
]
GLUON = [dict(dtype=dt, head_dim=d, causal=c, window=w) for dt in ("bfloat16", "float16") for d in (64, 128)
         for c, w in ((False, False), (True, False), (False, True), (True, True))]
GLUON += [dict(dtype="bfloat16", head_dim=128, causal=True, window=False, segments=True),  # documents
          dict(dtype="float16", head_dim=64, causal=False, window=False, segments=True),
          dict(dtype="bfloat16", head_dim=128, causal=True, window=False, dynamic=True),  # the tile queue
          dict(dtype="bfloat16", head_dim=128, causal=True, window=False, segments=True, dynamic=True)]


def _digest(ptx: str) -> str:
    """The PTX without its debug information: the DWARF sections, `.loc` / `.file` lines and the `$L__tmpN:` labels
    that only the line table refers to (an inlined helper adds some)."""
    text = ptx.split("\t.section\t.debug", 1)[0]
    lines = [line for line in text.splitlines()
             if not re.match(r"\s*\.(loc|file)\b", line) and not re.match(r"\$L__tmp\d+:$", line)]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _gluon_id(kw: dict) -> str:
    extra = "".join(f"-{k}" for k in ("segments", "dynamic") if kw.get(k))
    return f"{kw['dtype']}-d{kw['head_dim']}-causal{int(kw['causal'])}-window{int(kw['window'])}{extra}"


def _one(job) -> dict:
    """Digests of one (spec, config) or Gluon config: {key: digest} or {key: "error: ..."}."""
    from ejgen.testing import aot

    spec, cid, kw = job
    try:
        if spec == "gluon":
            compiled = aot.compile_gluon(**kw)
        else:
            compiled = aot.compile_attention("ejgen.generated", spec, params=SPECS[spec], **kw)
    except Exception as e:  # reported, not hidden
        return {f"{spec}/{cid}": f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"}
    return {f"{spec}/{cid}/{kernel}": _digest(c.asm["ptx"]) for kernel, c in compiled.items()}


def digests(specs, gluon: bool, jobs: int = 1) -> dict:
    work = [(spec, cid, kw) for spec in specs for cid, kw in CONFIGS]
    if gluon:
        work += [("gluon", _gluon_id(kw), kw) for kw in GLUON]
    out = {}
    if jobs > 1:
        import concurrent.futures
        import multiprocessing

        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for part in pool.map(_one, work):
                out.update(part)
    else:
        for job in work:
            out.update(_one(job))
    return out


def compare(old: dict, new: dict) -> int:
    same = sorted(k for k in old if new.get(k) == old[k] and not str(old[k]).startswith("error"))
    differ = sorted(k for k in old if k in new and new[k] != old[k])
    only = sorted(set(old) ^ set(new))
    errors = sorted(k for k in new if str(new[k]).startswith("error"))
    print(f"{len(same)} kernels identical, {len(differ)} differ, {len(only)} in one tree only, {len(errors)} errors")
    for k in differ + only + errors:
        print(f"  {k}: {old.get(k)} -> {new.get(k)}")
    return 0 if not (differ or only or errors) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    p.add_argument("--specs", default=",".join(SPECS))
    p.add_argument("--no-gluon", action="store_true")
    p.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    args = p.parse_args(argv)
    if args.compare:
        old, new = (json.load(open(f)) for f in args.compare)
        return compare(old, new)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter cannot compile", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as ejgen.testing.aot's compiles (Triton 3.9 warns)
    import triton

    result = {"_triton": triton.__version__, **digests(args.specs.split(","), not args.no_gluon, args.jobs)}
    print(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
