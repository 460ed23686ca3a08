"""ejgen's extension of jax-triton (ejgen.runtime.launch.triton_call._extend_jax_triton), run inside
jax-triton 0.3.1's real compile path on a CPU (tests/attention/jax_triton_lowering.py): the kernel object
jaxlib would receive reads the tensor descriptors' global scratch from the SCRATCH output, and
kernels that ejgen does not launch compile exactly as jax-triton compiles them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="the triton extra is part of the test install (README)")
if __import__("importlib").util.find_spec("jax_triton") is None:
    pytest.fail("jax-triton is part of the test install (pip install -e '.[test]')", pytrace=False)

SCRIPT = os.path.join(os.path.dirname(__file__), "jax_triton_lowering.py")


def lower(**args) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, SCRIPT, json.dumps(args)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


KERNELS = {  # name -> what is lowered; the foreign kernel first (jax_triton_lowering.lower_kernel)
    "foreign": dict(kernel="foreign", tma=True),
    "descriptors": dict(kernel="fwd_kernel", tma=True),
    "pointers": dict(kernel="fwd_kernel", tma=False),
}


@pytest.fixture(scope="module")
def lowered() -> dict:
    """`KERNELS` lowered in one process (one start and import of jax and Triton, not one per test)."""
    return dict(zip(KERNELS, lower(kernels=list(KERNELS.values()))))


def test_descriptor_kernels_read_their_scratch_from_the_scratch_output(lowered):
    got = lowered["descriptors"]
    assert got["bulk_tensor_copies"] > 0
    assert got["ptx_params"] == got["explicit_args"] + 2  # Triton's two hidden pointers
    assert got["hidden_scratch_reads"] == 0 and got["last_explicit_reads"] > 0
    assert got["num_warps"] == 8
    # no debug information or TTIR in what every launch hashes (triton_call.strip_debug)
    assert got["debug_sections"] == got["loc_lines"] == got["ttir_chars"] == 0


def test_kernels_without_descriptors_compile_unchanged(lowered):
    got = lowered["pointers"]
    assert got["bulk_tensor_copies"] == 0 and got["hidden_scratch_reads"] == 0


def test_kernels_ejgen_does_not_launch_are_left_as_jax_triton_compiles_them(lowered):
    got = lowered["foreign"]
    assert got["hidden_scratch_reads"] > 0  # jax-triton's own behaviour: no rerouting
    assert got["debug_sections"] > 0 and got["loc_lines"] > 0 and got["ttir_chars"] > 0


def test_ptx_without_debug_information_assembles_to_the_same_code(tmp_path):
    """`strip_debug` leaves the machine code alone: ptxas gives the same SASS for a kernel's PTX with and without it
    (the generated causal forward, sm_90a; 64 x 32 blocks: the debug sections are what counts, not the tiles)."""
    from triton.backends.nvidia.compiler import get_ptxas

    from ejgen.runtime.launch.triton_call import strip_debug
    from ejgen.testing import aot

    ptx = next(iter(aot.compile_in_subprocess("ejgen.generated", "flash_attention", dtype="bfloat16", head_dim=64,
                                              causal=True, block_m=64, block_n=32, with_ptx=True).values()))["ptx"]
    stripped = strip_debug(ptx)
    assert ".loc" not in stripped and ".section\t.debug" not in stripped and len(stripped) < len(ptx)
    ptxas = get_ptxas(90).path
    cuobjdump = os.path.join(os.path.dirname(ptxas), "cuobjdump")
    sass = []
    for name, text in (("with", ptx), ("without", stripped)):
        (tmp_path / f"{name}.ptx").write_text(text)
        subprocess.run([ptxas, "-arch=sm_90a", "-o", str(tmp_path / f"{name}.cubin"), str(tmp_path / f"{name}.ptx")],
                       check=True, capture_output=True)
        dump = subprocess.run([cuobjdump, "-sass", str(tmp_path / f"{name}.cubin")], check=True, capture_output=True,
                              text=True).stdout
        sass.append([line.split("*/", 1)[1] for line in dump.splitlines() if line.strip().startswith("/*0")])
    assert sass[0] and sass[0] == sass[1]


def test_ejgen_triton_autotune_lowers_to_jax_tritons_autotuned_call():
    """EJGEN_TRITON_AUTOTUNE=1: each of the three kernels becomes one autotuned call over several
    configs (the table's first), each with the grid of its own block size; jax-triton then times them
    on the call's inputs on the device. Without it: plain calls. (Head dim 16: the configs and grids do not depend
    on it up to 64, and its eleven compiles take half the time of head dim 64's.)"""
    seq = 256
    autotuned, plain = lower(op=True, autotune=[True, False], seq=seq, head_dim=16)["autotuned"]
    calls = {c[0]["kernel"].rsplit("_", 2)[-2] if "bwd" in c[0]["kernel"] else "fwd": c for c in autotuned}
    assert set(calls) == {"fwd", "dkdv", "dq"}
    for pass_, configs in calls.items():
        assert len(configs) >= 2, pass_
        block = "BLOCK_N" if pass_ == "dkdv" else "BLOCK_M"
        for c in configs:
            size = int(c["config"].split(f"{block}: ")[1].split(",")[0])
            assert c["grid"][0] == -(-seq // size), (pass_, c)
    assert "BLOCK_M: 128, BLOCK_N: 128, STAGED: True, num_warps: 8" in calls["fwd"][0]["config"]  # the table's first
    # a merged candidate carries its own STAGED
    assert any("BLOCK_M: 64, BLOCK_N: 128, STAGED: False, num_warps: 8" in c["config"] for c in calls["dkdv"])
    assert plain == []  # (lowered in the same process: the kernels compiled for the autotuned calls are reused)
