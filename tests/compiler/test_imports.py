"""Importing ejgen or a generated package has no side effects (STYLE 9): no environment variables
beyond those `import jax` sets itself, no Triton or torch import, no device query."""

import json
import subprocess
import sys

SCRIPT = """
import json, os, sys
import jax
before = dict(os.environ)
import ejgen, ejgen.ops, ejgen.types, ejgen.generated
from ejgen.generated import alibi_attention, flash_attention, relative_bias_attention
from jax._src import xla_bridge
print(json.dumps({
    "env": sorted(k for k in set(before) ^ set(os.environ)) + sorted(k for k in before if before[k] != os.environ.get(k)),
    "heavy": sorted(m for m in ("triton", "torch", "jax_triton") if m in sys.modules),
    "backends_initialised": bool(getattr(xla_bridge, "_backends", {})),
}))
"""


def test_importing_ejgen_and_its_ops_has_no_side_effects():
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, check=True)
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"env": [], "heavy": [], "backends_initialised": False}
