"""The Hopper backward's delta kernel (`ejgen.runtime.attention.gluon.delta`, launched by
`gluon.host.backward_delta`) in Triton's interpreter against float64 numpy: rowsum(dO * O) - d lse in lse's shape
over odd lengths (a partial last row block), head dims that are not a power of two, GQA groups, several batch rows
and every input dtype; and compiled for sm_90 by this Triton and the GPU host's. (The whole chain, the kernel's delta
feeding the backward and the sinks' gradient, is checked against the oracle by test_gluon.py's
test_sinks_join_outside_the_hopper_kernels.)"""

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton", reason="the triton extra is part of the test install (README)")

from ejgen.runtime.attention.gluon import host as gluon_attention  # noqa: E402
from ejgen.runtime.launch import triton_call  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreter():
    if triton_call.mode()[0] != "interpret":
        pytest.fail("the delta kernel runs in Triton's interpreter here: TRITON_INTERPRET=1 (README)")


CASES = {  # name: (batch, rows, kv heads, groups, value head dim, dtype)
    "bf16-odd-rows-gqa": (2, 70, 2, 3, 64, "bfloat16"),
    "f16-one-row": (1, 1, 1, 1, 128, "float16"),
    "f32-head-dim-72": (1, 130, 3, 1, 72, "float32"),
    "bf16-two-blocks": (1, 128, 1, 4, 128, "bfloat16"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_delta_kernel_matches_float64(name):
    batch, rows, hkv, groups, dv, dtype = CASES[name]
    rng = np.random.default_rng(len(name))
    out, d_out = (jnp.asarray(rng.standard_normal((batch, rows, hkv, groups, dv)), dtype) for _ in range(2))
    d_lse = jnp.asarray(rng.standard_normal((batch, hkv, groups, rows)), jnp.float32)
    got = gluon_attention.backward_delta(out, d_out, d_lse)
    assert got.shape == d_lse.shape and got.dtype == jnp.float32
    o, do = (np.asarray(x.astype(jnp.float32), np.float64) for x in (out, d_out))
    want = np.moveaxis(np.sum(o * do, axis=-1), 1, 3) - np.asarray(d_lse, np.float64)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4 * np.sqrt(dv))


def test_the_delta_launch_zeroes_an_accumulator_when_asked(monkeypatch):
    """``zeros`` (ring attention's dQ accumulator, `ring.ZEROS_BY_DELTA`): the launch asks for that output zeroed (a
    memset on the GPU; the interpreter starts every output at zero, so the request itself is what is checked), the
    zeros come back in that shape and delta is unchanged; without it, nothing is zeroed."""
    launch, asked = triton_call.launch, []

    def spy(kernel, grid, inputs, outs, **kw):
        asked.append((kw.get("zeroed", ()), [tuple(o.shape) for o in outs]))
        return launch(kernel, grid, inputs, outs, **kw)

    monkeypatch.setattr(triton_call, "launch", spy)
    rng = np.random.default_rng(5)
    out, d_out = (jnp.asarray(rng.standard_normal((1, 96, 2, 2, 64)), jnp.bfloat16) for _ in range(2))
    d_lse = jnp.zeros((1, 2, 2, 96), jnp.float32)
    plain = gluon_attention.backward_delta(out, d_out, d_lse)
    delta, zeros = gluon_attention.backward_delta(out, d_out, d_lse, (1, 96, 2, 2, 64))
    assert asked == [((), [(1, 4, 96), (1, )]), ((1, ), [(1, 4, 96), (1, 96, 2, 2, 64)])], asked
    assert zeros.shape == (1, 96, 2, 2, 64) and zeros.dtype == jnp.float32 and not np.asarray(zeros).any()
    np.testing.assert_array_equal(np.asarray(delta), np.asarray(plain))


@pytest.mark.parametrize("gpu_host", [False, True], ids=["this-triton", "gpu-host-triton"])
def test_the_delta_kernel_compiles_for_sm90(gpu_host):
    """At 32k rows, 16 heads, head dim 128, bf16: compiles for sm_90 with no spill and no global scratch."""
    from ejgen.testing.aot import compile_all_in_subprocess, gpu_host_triton

    (result,) = compile_all_in_subprocess([dict(delta=True, with_ptx=True)], gpu_host_triton() if gpu_host else None)
    assert "error" not in result, result.get("error")
    meta = result["delta"]
    assert meta["cubin"] and "ld.local" not in meta["ptx"] and meta["global_scratch"] == 0
