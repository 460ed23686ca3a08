"""Tests that can fail, shown: plant known bugs in the kernels and the runtime, one at a time, and check that
the suite fails for each (docs/DESIGN.md §7). On demand (minutes on 2 cores):

    python tests/mutations.py            # every mutation
    python tests/mutations.py lse_offset # some

Each mutation copies the working tree (tracked files) aside, replaces one piece of source (which must occur
exactly once), regenerates `generated/` from the specs in the copy (unless the mutation is in `ejgen/runtime/`, which
generation does not read), and runs the tests named for it there; a
mutation that leaves them passing is reported as missed and the exit status is 1.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple  # pytest arguments (paths and -k), run in the copy


MUTATIONS = (
    Mutation("causal_off_by_one", "the causal bound admits one key past the diagonal (every backend: the plan)",
             "ejgen/plan/attention.py", 'Affine(1, -1, off, "causal")', 'Affine(1, -1, add(off, ONE), "causal")',
             ("tests/attention/test_conformance.py", "-k", "xla and causal")),
    Mutation("running_max_dropped", "the online softmax stops subtracting the running max (exact in real numbers; "
             "overflows on large logits)", "ejgen/runtime/attention/xla.py",
             "m_new = jnp.maximum(m, jnp.max(s, axis=-1))",
             "m_new = jnp.maximum(m, jnp.max(jnp.where(s == NEG_INF, NEG_INF, 0.0), axis=-1))",
             ("tests/attention/test_conformance.py", "-k", "xla and large")),
    Mutation("rescale_dropped", "the accumulator is not rescaled when the running max grows (xla)",
             "ejgen/runtime/attention/xla.py", "return m_new, l, acc * alpha[..., None] + pv", "return m_new, l, acc + pv",
             ("tests/attention/test_conformance.py", "-k", "test_attention and xla and B2-Sq97-Sk130")),
    Mutation("triton_rescale_dropped", "the same in the generated Triton forward",
             "ejgen/templates/attention/triton/train_kernels.py.j2",
             "acc = _dot_acc(p.to(b_v.dtype), b_v, acc * alpha[:, None], SCHEDULE)",
             "acc = _dot_acc(p.to(b_v.dtype), b_v, acc, SCHEDULE)",
             ("tests/attention/test_conformance.py", "-k", "test_attention and triton and Sq64-Sk64 and f32")),
    Mutation("lse_offset", "lse comes out 0.05 too large (xla)", "ejgen/runtime/attention/xla.py",
             "lse = jnp.where(seen, jnp.where(seen, m, 0.0) + jnp.log(",
             "lse = 0.05 + jnp.where(seen, jnp.where(seen, m, 0.0) + jnp.log(",
             ("tests/attention/test_conformance.py", "-k", "test_attention and xla and bf16")),
    Mutation("gqa_heads_swapped", "query head h reads kv head h % Hkv instead of h // (Hq / Hkv)",
             "ejgen/runtime/attention/api.py", "q = query.reshape(batch, sq, hkv, groups, d)",
             "q = query.reshape(batch, sq, groups, hkv, d).swapaxes(2, 3)",
             ("tests/attention/test_conformance.py", "-k", "xla and H4x2")),
    Mutation("sink_dropped", "the sinks leave the softmax denominator (xla)", "ejgen/runtime/attention/xla.py",
             "l = l * alpha + jnp.sum(jnp.exp(sinks - m_all[..., None]), axis=-1)", "l = l * alpha",
             ("tests/attention/test_conformance.py", "-k", "xla and sink")),
    Mutation("sink_grad_sign", "the sinks' gradient has the wrong sign (every backend)",
             "ejgen/runtime/attention/api.py", "return -jnp.sum(p_sink * delta[..., None], axis=(0, 3))",
             "return jnp.sum(p_sink * delta[..., None], axis=(0, 3))",
             ("tests/attention/test_conformance.py", "-k", "xla and sink")),
    Mutation("power_as_exp_log", "Triton prints x ** n as exp(n log x) again (zero for a negative x)",
             "ejgen/emit/attention/triton.py", 'else f"_ipow({base}, {abs(n)})"',
             'else f"tl.exp({abs(n)} * tl.log({base}))"',
             ("tests/attention/test_dsl_functions.py", "-k", "triton")),
)


def _copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    (dest / "ejgen" / "generated").symlink_to("../generated")  # what setup.py's package_dir maps


def run(m: Mutation, workdir: Path) -> tuple[bool, float, str]:
    """(caught, seconds, the test that failed and why, or the tests' summary line)."""
    copy = workdir / m.name
    _copy_tree(copy)
    target = copy / m.path
    text = target.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"{m.name}: {m.path} holds {text.count(m.old)} copies of the text to replace, not one")
    target.write_text(text.replace(m.old, m.new))
    env = dict(os.environ, PYTHONPATH=str(copy), TRITON_INTERPRET="1", JAX_PLATFORMS="cpu")
    # generated/ renders the specs through the plan, the emitters and the templates; the runtime it imports is not
    # read in generating it, so a mutation there leaves the copied generated/ as it is (the render of specs/: a test)
    build = None if m.path.startswith("ejgen/runtime/") else subprocess.run(
        [sys.executable, "-m", "ejgen.cli", "build", "specs/"], cwd=copy, env=env, capture_output=True, text=True)
    if build is not None and build.returncode != 0:
        raise SystemExit(f"{m.name}: ejgen build failed in the copy: {build.stderr.strip()[-2000:]}")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider", *m.tests],
                          cwd=copy, env=env, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines() or ["(no output)"]
    last = next((line for line in lines if line.startswith("FAILED ")), lines[-1])[:240]
    if proc.returncode == 5:
        raise SystemExit(f"{m.name}: the tests named for it select nothing: {' '.join(m.tests)}")
    failed = any(line.startswith("FAILED ") for line in lines)
    if proc.returncode != 0 and not failed:  # an error in collection or a fixture is not a caught bug
        errors = [line for line in lines if line.startswith("ERROR ") or line.startswith("E ")]
        raise SystemExit(f"{m.name}: the tests errored instead of failing: {(errors or lines)[-1][:400]}")
    return failed, time.time() - t0, last


def main(argv=None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or [m.name for m in MUTATIONS]
    unknown = set(names) - {m.name for m in MUTATIONS}
    if unknown:
        raise SystemExit(f"unknown mutation(s) {sorted(unknown)}; known: {', '.join(m.name for m in MUTATIONS)}")
    missed = []
    with tempfile.TemporaryDirectory(prefix="ejgen-mutations-") as tmp:
        for m in (m for m in MUTATIONS if m.name in names):
            caught, sec, last = run(m, Path(tmp))
            print(f"{'caught' if caught else 'MISSED':6}  {m.name:24} {sec:6.1f}s  {' '.join(m.tests)}  ->  {last}",
                  flush=True)
            if not caught:
                missed.append(m.name)
    print(f"{len(names) - len(missed)} of {len(names)} planted bugs caught" + (f"; missed: {missed}" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
