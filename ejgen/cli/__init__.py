"""The ``ejgen`` command: build, check, show, new, tune."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ejgen.errors import BuildError, EjgenError, SpecError

SCAFFOLD = """\
name: "{name}"
family: attention
doc: One line on what this variant is for.
modes: [train]
features:
  causal: runtime
  gqa: runtime
# params:
#   slopes: {{shape: [heads], dtype: float32, grad: true}}
# options:
#   max_distance: {{type: int, default: 1024}}
score: s
mask: true
"""


def _build(args) -> int:
    from ejgen.render import render
    from ejgen.spec import load_specs
    from ejgen.writer import diff_package, write_package

    specs = Path(args.specs)
    if not specs.is_dir():
        raise BuildError(f"{specs}: not a folder of specs")
    variants = load_specs(specs)
    if not variants:
        raise BuildError(f"{specs}: no *.yaml specs found")
    files = render(variants)
    out = Path(args.out)
    if args.check:
        diffs = diff_package(files, out)
        if diffs:
            sys.stdout.write("".join(diffs))
            print(f"ejgen: {out} is out of date with {specs} ({len(diffs)} file(s)); run `ejgen build {specs} -o {out}`",
                  file=sys.stderr)
            return 1
        print(f"{out} is up to date with {specs} ({len(variants)} spec(s))")
        return 0
    write_package(files, out)
    for v in sorted(variants, key=lambda v: v.name):
        backends = [b for b in v.backends if any(p.startswith(f"{v.name}/{b}") for p in files)]
        print(f"{v.name:<32} {v.path} -> {out / v.name} ({', '.join(backends)})")
    return 0


def _show(args) -> int:
    if (args.spec is None) == (args.call is None):
        raise BuildError("show: give a spec file, or --call 'op(...)' (not both)")
    if args.call is not None:
        from ejgen.cli.call import explain_call

        print(explain_call(args.call, args.package, args.target))
        return 0
    from ejgen.render import describe, plan
    from ejgen.spec import load_spec

    print(describe(plan(load_spec(args.spec))))
    return 0


def _new(args) -> int:
    from ejgen.spec.schema import _identifier

    name = args.name
    _identifier(name, None, "op name")
    path = Path(args.dir) / f"{name}.yaml"
    if path.exists():
        raise BuildError(f"{path} already exists")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(SCAFFOLD.format(name=name), encoding="utf-8")
    print(f"wrote {path}; edit it, then `ejgen build {args.dir}`")
    return 0


def _tune(args) -> int:
    from ejgen.cli.tune import tune

    for seq in args.seq:
        window = "" if args.window is None else f" window {args.window}"
        print(f"tuning S={seq} D={args.head_dim} {args.dtype} {'causal' if args.causal else 'full'}{window}:")
        tune(seq, args.head_dim, args.dtype, args.causal, heads=args.heads, batch=args.batch, reps=args.reps,
             window=args.window)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ejgen", description="Attention-kernel compiler for JAX.")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="generate the ops of every spec in a folder")
    b.add_argument("specs", help="folder of *.yaml specs")
    b.add_argument("-o", "--out", default="generated", help="package folder to write (default: generated)")
    b.add_argument("--check", action="store_true", help="write nothing; fail if OUT differs from the specs")
    b.set_defaults(run=_build)
    c = sub.add_parser("check", help="same as build --check")
    c.add_argument("specs")
    c.add_argument("-o", "--out", default="generated")
    c.set_defaults(run=_build, check=True)
    s = sub.add_parser("show", help="print a spec's IR, derivatives and mask analysis, or (--call) which "
                                    "kernels a call takes and why")
    s.add_argument("spec", nargs="?")
    s.add_argument("--call", metavar="'OP(...)'",
                   help="a call with tensors as dtype[dims], e.g. \"flash_attention(bf16[1,4096,16,128], "
                        "bf16[1,4096,4,128], bf16[1,4096,4,128], causal=True)\"; mask_info=segments(int32[B,S]) "
                        "or mask(bool[B,1,Sq,Sk])")
    s.add_argument("--package", default="ejgen.generated", help="package holding the op (default: ejgen.generated)")
    s.add_argument("--target", choices=("cpu", "sm80", "sm90", "tpu"),
                   help="answer for this machine instead of the one running the command")
    s.set_defaults(run=_show)
    n = sub.add_parser("new", help="scaffold a spec")
    n.add_argument("name")
    n.add_argument("-d", "--dir", default="specs", help="folder for the spec (default: specs)")
    n.set_defaults(run=_new)
    t = sub.add_parser("tune", help="time Triton kernel configs on this device; keep the fastest in the config cache")
    t.add_argument("--seq", type=int, nargs="+", required=True, help="sequence length(s)")
    t.add_argument("--head-dim", type=int, default=128)
    t.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    t.add_argument("--causal", action="store_true")
    t.add_argument("--window", type=int, metavar="LEFT",
                   help="tune windowed calls: sliding_window=(LEFT, 0) with --causal, else (LEFT, LEFT)")
    t.add_argument("--heads", type=int, default=16)
    t.add_argument("--batch", type=int, default=1)
    t.add_argument("--reps", type=int, default=10)
    t.set_defaults(run=_tune)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except SpecError as e:
        print(e.render() if e.loc else f"ejgen: {e.render()}", file=sys.stderr)
        return 1
    except EjgenError as e:
        print(f"ejgen: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
