#!/usr/bin/env bash
# Installed as users install it: build the wheel from the source tree, check that it holds every module and
# template of the tree, install it (with its dependencies from the index pip uses) into a fresh virtual
# environment, author a spec of its own in a temporary folder, `ejgen build` it into a package there, import
# that package and run it forward and backward on the CPU (platform="xla") against a dense jnp reference.
# Nothing of the source tree is importable during the check: it runs outside it, from the installed wheel.
#   bash .ci/wheel_check.sh        (PYTHON=python3.12 to pick the interpreter; KEEP=1 keeps the temp folder)
set -Eeuo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ejgen-wheel-check.XXXXXX")
cleanup() {
  local rc=$?
  if [[ ${KEEP:-0} == 1 ]]; then echo "wheel_check: kept $WORK"; else rm -rf "$WORK"; fi
  if ((rc)); then echo "wheel_check: FAILED (exit $rc)" >&2; fi
}
trap cleanup EXIT
log() { printf '::: wheel_check %4ds  %s\n' "$SECONDS" "$*"; }
fail() {
  echo "wheel_check: FAIL: $*" >&2
  exit 1
}
unset PYTHONPATH
export PYTHONNOUSERSITE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# 1. The source as a clone would have it (tracked files and untracked ones git does not ignore, as on disk):
#    no build/, *.egg-info or __pycache__ of the work tree can leak into the wheel, and nothing is written there.
log "copy the source tree"
git -C "$ROOT" rev-parse --is-inside-work-tree > /dev/null 2>&1 || fail "$ROOT is not a git work tree"
"$PYTHON" - "$ROOT" "$WORK/src" <<'EOF'
import os, shutil, subprocess, sys
root, dst = sys.argv[1:]
names = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       check=True, capture_output=True).stdout.decode().split("\0")
for name in sorted(set(filter(None, names))):
    src = os.path.join(root, name)
    if os.path.isfile(src):  # a file deleted in the work tree but still in the index is left out
        os.makedirs(os.path.dirname(os.path.join(dst, name)), exist_ok=True)
        shutil.copy2(src, os.path.join(dst, name))
EOF

# 2. Every folder of modules is a package: setuptools' find_packages skips a folder without __init__.py, and the
#    wheel silently lacks it (ejgen/backends once did).
log "check that every folder of modules has an __init__.py"
missing=$(cd "$WORK/src" && find ejgen generated -name '*.py' -not -path '*/__pycache__/*' -exec dirname {} \; \
  | sort -u | while read -r d; do [[ -f $d/__init__.py ]] || echo "$d"; done)
[[ -z $missing ]] || fail "folders with modules but no __init__.py (the wheel would lack them):"$'\n'"$missing"

# 3. Build the wheel as pip does for a user (isolated build with the setuptools of the index).
log "build the wheel"
"$PYTHON" -m pip wheel "$WORK/src" --no-deps -q -w "$WORK/dist"
wheels=("$WORK"/dist/ejgen-*.whl)
((${#wheels[@]} == 1)) && [[ -f ${wheels[0]} ]] || fail "expected one ejgen wheel in $WORK/dist, found: ${wheels[*]}"
WHEEL=${wheels[0]}

# 4. The wheel holds every module and template of the tree: ejgen/**/*.py, ejgen/templates/**/*.j2, and
#    generated/**/*.py as ejgen/generated/ (setup.py's package_dir).
log "check the wheel's contents ($(basename "$WHEEL"))"
"$PYTHON" - "$WORK/src" "$WHEEL" <<'EOF'
import pathlib, sys, zipfile
src, wheel = pathlib.Path(sys.argv[1]), sys.argv[2]
want = set()
for top, prefix in (("ejgen", "ejgen"), ("generated", "ejgen/generated")):
    for p in (src / top).rglob("*"):
        if p.is_file() and p.suffix in (".py", ".j2") and "__pycache__" not in p.parts:
            want.add(f"{prefix}/{p.relative_to(src / top).as_posix()}")
names = zipfile.ZipFile(wheel).namelist()
have = set(names)
missing = sorted(want - have)
if missing:
    sys.exit("wheel_check: FAIL: the wheel lacks " + str(len(missing)) + " file(s) of the source tree:\n  "
             + "\n  ".join(missing))
meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
requires = [l.split(":", 1)[1].strip() for l in zipfile.ZipFile(wheel).read(meta).decode().splitlines()
            if l.startswith("Requires-Dist:") and "extra ==" not in l]
entry = next((n for n in names if n.endswith(".dist-info/entry_points.txt")), None)
if entry is None or "ejgen = ejgen.cli:main" not in zipfile.ZipFile(wheel).read(entry).decode():
    sys.exit("wheel_check: FAIL: the wheel declares no `ejgen` console script")
packages = sorted({n.rsplit("/", 1)[0] for n in want if n.endswith("/__init__.py")})
print(f"wheel_check: {len(want)} modules and templates present, {len(packages)} packages; requires: {', '.join(requires)}")
EOF

# 5. A fresh virtual environment (no system site-packages) with the wheel and its dependencies.
log "install the wheel into a fresh venv"
"$PYTHON" -m venv "$WORK/venv"
VPY=$WORK/venv/bin/python
"$VPY" -m pip install -q "$WHEEL"
[[ -x $WORK/venv/bin/ejgen ]] || fail "no ejgen command in the venv after installing the wheel"

# 6. A user's spec in a folder of its own, built with the installed command into a package `myops`.
log "author a spec and ejgen build it"
mkdir -p "$WORK/user/specs" "$WORK/out"
cat > "$WORK/user/specs/capped_causal_attention.yaml" <<'EOF'
name: capped_causal_attention
family: attention
doc: Causal attention whose logits are divided by a runtime temperature, then soft-capped at 30.
features:
  causal: always
  logits_soft_cap: 30.0
  gqa: runtime
options:
  temperature: {type: float, default: 1.0}
score: s / temperature
EOF
(cd "$WORK/user" && "$WORK/venv/bin/ejgen" build specs -o "$WORK/out/myops")
[[ -f $WORK/out/myops/__init__.py ]] || fail "ejgen build wrote no package at $WORK/out/myops"

# 7. Import it from the installed ejgen and run it forward and backward on the CPU against a dense reference.
log "import myops, forward and backward on the CPU against a dense reference"
(cd "$WORK/user" && PYTHONPATH="$WORK/out" JAX_PLATFORMS=cpu "$VPY" - "$ROOT" <<'EOF'
import importlib, os, pkgutil, sys

import jax
import jax.numpy as jnp
import numpy as np

import ejgen
import myops

root = os.path.realpath(sys.argv[1])
where = os.path.realpath(ejgen.__file__)
assert not where.startswith(root + os.sep), f"ejgen imported from the source tree ({where}), not the wheel"
assert "site-packages" in where, where
# every package of the installed ejgen imports (modules that need Triton or a GPU are imported on use)
packages = [m.name for m in pkgutil.walk_packages(ejgen.__path__, "ejgen.") if m.ispkg]
for name in ("ejgen.emit", "ejgen.plan", "ejgen.runtime.core", "ejgen.runtime.launch", "ejgen.runtime.attention",
             "ejgen.runtime.attention.triton", "ejgen.runtime.attention.gluon", "ejgen.runtime.attention.pallas",
             "ejgen.cli", "ejgen.generated"):
    assert name in packages, f"{name} is not in the installed ejgen (packages: {packages})"
for name in packages:
    importlib.import_module(name)

op = myops.capped_causal_attention
B, S, HQ, HKV, D, CAP, TEMPERATURE = 2, 80, 4, 2, 32, 30.0, 0.5
keys = jax.random.split(jax.random.key(0), 4)
q = 3.0 * jax.random.normal(keys[0], (B, S, HQ, D), jnp.float32)  # large logits: the soft cap matters
k = 3.0 * jax.random.normal(keys[1], (B, S, HKV, D), jnp.float32)
v = jax.random.normal(keys[2], (B, S, HKV, D), jnp.float32)
do = jax.random.normal(keys[3], (B, S, HQ, D), jnp.float32)


def reference(q, k, v, temperature, cap=CAP):
    """Dense attention: s = q k^T / sqrt(D), the spec's score s / temperature, the soft cap, causal mask."""
    kh, vh = (jnp.repeat(x, HQ // HKV, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kh, precision="highest") / np.sqrt(D)
    s = s / temperature
    if cap:
        s = cap * jnp.tanh(s / cap)
    s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), vh, precision="highest")


def rel(x, ref):
    return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


failed = []
for temperature in (TEMPERATURE, None):  # None: the option's default, 1.0
    kw = {} if temperature is None else {"temperature": temperature}
    t = 1.0 if temperature is None else temperature
    out, vjp = jax.vjp(jax.jit(lambda q, k, v: op(q, k, v, platform="xla", **kw)), q, k, v)
    ref, ref_vjp = jax.vjp(lambda q, k, v: reference(q, k, v, t), q, k, v)
    errors = dict(out=rel(out, ref), **{n: rel(g, r) for n, g, r in zip(("dq", "dk", "dv"), vjp(do), ref_vjp(do))})
    uncapped = rel(reference(q, k, v, t, cap=None), ref)
    print(f"capped_causal_attention temperature={t}: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
          + f" (without the soft cap the reference moves by {uncapped:.1e})")
    failed += [f"{n} {e:.1e} at temperature {t}" for n, e in errors.items() if not e < 1e-4]
    if not uncapped > 1e-2:
        failed.append(f"the soft cap changes nothing at temperature {t}: the check would not see it")
if failed:
    sys.exit("wheel_check: FAIL: " + "; ".join(failed))
print(f"wheel_check: ejgen {ejgen.__file__} (jax {jax.__version__}): myops forward and backward match the reference")
EOF
)
log "passed"
