"""Platform choice (docs/DESIGN.md §4): `auto` picks by device and availability; a forced platform that
cannot run says why and how to get there."""

import subprocess
import sys

import pytest

from ejgen.runtime.attention.api import SpecInfo, choose_platform

SPEC = SpecInfo("my_attention", "specs/my_attention.yaml", {}, ())


class Backend:
    def __init__(self, ok: bool, why: str = ""):
        self.ok, self.why = ok, why

    def available(self):
        return self.ok, self.why


def test_auto_on_a_cpu_prefers_xla():
    assert choose_platform(SPEC, "auto", {"triton": Backend(True), "pallas": Backend(True), "xla": Backend(True)}) == "xla"


def test_auto_takes_what_was_generated_and_can_run():
    assert choose_platform(SPEC, "auto", {"triton": Backend(True)}) == "triton"
    assert choose_platform(SPEC, "auto", {"triton": Backend(False, "no GPU"), "pallas": Backend(True)}) == "pallas"


def test_auto_with_nothing_runnable_says_why_for_each():
    with pytest.raises(RuntimeError, match=r"my_attention\(\): no generated backend can run here \(triton: no GPU\)"):
        choose_platform(SPEC, "auto", {"triton": Backend(False, "no GPU")})


def test_a_platform_the_spec_did_not_generate_is_named():
    with pytest.raises(ValueError, match="platform 'pallas' was not generated for this spec"):
        choose_platform(SPEC, "pallas", {"xla": Backend(True)})


def test_an_unknown_platform_lists_the_known_ones():
    with pytest.raises(ValueError, match="platform must be one of auto, triton, pallas, xla"):
        choose_platform(SPEC, "cuda", {"xla": Backend(True)})


def test_triton_without_gpu_or_interpreter_says_how_to_get_there():
    script = (
        "import jax.numpy as jnp\n"
        "from ejgen.ops import flash_attention\n"
        "q = jnp.ones((1, 16, 2, 16))\n"
        "try:\n"
        "    flash_attention(q, q, q, platform='triton')\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True).stdout
    assert "platform 'triton' is not available here" in out and "TRITON_INTERPRET=1" in out
