"""Context parallelism of the linear recurrent family on the GPUs of one host (`pytest -m gpu
tests/multidevice/test_recurrent_cp_gpu.py` on a host with 2 or more GPUs; NCCL, NVLink multicast off): `<name>_cp`
over every GPU against the float64 oracle of the whole sequence (forward and every gradient; triton's chunked and
fused kernels, pallas's), against gla on one GPU at a long sequence, and the mesh wrapper with data x sequence
parallelism. The CPU mesh covers the rest (`test_recurrent_cp.py`)."""

from __future__ import annotations

import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ejgen import generated

_RECURRENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recurrent")


def _load(name):
    """tests/recurrent's module ``name``, by path (the family's tests folder is not on this folder's path)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(_RECURRENT, f"{name}.py"))
    module = sys.modules.setdefault(name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    return module


oracle = _load("recurrent_oracle")
cases = _load("recurrent_cases")  # imports recurrent_oracle: the module above

GPUS = len(jax.devices("gpu")) if jax.default_backend() == "gpu" else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 2, reason="context parallelism on GPUs needs 2 or more GPUs")]


def _run(fn, x: dict, d_out, d_final, mesh):
    """(o, final_state, grads) of ``fn(args) -> (o, final_state)`` under jit; results gathered whole on the mesh."""

    @jax.jit
    def fwd_bwd(args, d_out, d_final):
        def call(a):
            o, final = fn(dict(a))
            whole = NamedSharding(mesh, P())
            return jax.sharding.reshard(o, whole), jax.sharding.reshard(final, whole)

        (o, final), vjp = jax.vjp(call, args)
        return o, final, vjp((d_out, d_final))[0]

    out = fwd_bwd({n: jnp.asarray(a) for n, a in x.items()}, jnp.asarray(d_out), jnp.asarray(d_final))
    return jax.tree.map(lambda a: np.asarray(jax.device_get(a)), out)


def _global(cp, **static):
    """``cp`` on global arrays (under ``jax.set_mesh``: the form cuts the steps over "sp" itself)."""
    return lambda a: cp(**a, axis_name="sp", **static)


def _check(case, got, x, d_out, d_final):
    o, final, grads = got
    o_ref, final_ref, grads_ref = oracle.recurrent(x, d_out, d_final, reverse=case.reverse)
    assert o.dtype == jnp.dtype(case.dtype) and final.dtype == np.float32
    oracle.assert_close("o", o, o_ref, case.dtype)
    oracle.assert_close("final_state", final, final_ref, case.dtype)
    assert set(grads) == set(x)
    for name in x:
        oracle.assert_close(f"d{name}", grads[name], grads_ref[name], case.dtype)


CASES = {  # (case, platform): T = 256 steps per GPU, several chunks of 64 on each
    "gla-chunked-gqa-h0-bf16-triton": (
        cases.Case("gla", ("gk",), dtype="bfloat16", shape=(1, 256 * GPUS, 4, 2, 64, 128), h0=True, chunk=64),
        "triton"),
    "recurrent-every-gate-fused-reverse-triton": (
        cases.Case("recurrent", ("g", "g_gamma", "gk", "gv"), shape=(2, 256 * GPUS, 4, 4, 64, 64), h0=True,
                   reverse=True, algorithm="fused", chunk=None), "triton"),
    "simple_gla-g-g_gamma-h0-pallas": (cases.Case("simple_gla", ("g", "g_gamma"), shape=(1, 256 * GPUS, 4, 4, 64, 64),
                                                  h0=True, chunk=64), "pallas"),
}


@pytest.mark.parametrize("case, platform", CASES.values(), ids=CASES.keys())
def test_cp_over_every_gpu_against_the_oracle(case, platform):
    """<name>_cp over every GPU (global arrays under a mesh context): o, final_state and every gradient against the
    oracle of the whole sequence."""
    mesh = jax.make_mesh((GPUS,), ("sp",))
    x, d_out, d_final = cases.inputs(case)
    cp = getattr(generated, f"{case.op}_cp")
    with jax.set_mesh(mesh):
        got = _run(_global(cp, platform=platform, **case.kwargs()), x, d_out, d_final, mesh)
    _check(case, got, x, d_out, d_final)


def test_cp_equals_one_gpu_on_a_long_sequence():
    """GLA, T = 16k per GPU, H 4, K = V = 128, bf16: gla_cp over every GPU against gla on one GPU (the same kernels on
    the whole sequence), every output and gradient."""
    case = cases.Case("gla", ("gk",), dtype="bfloat16", shape=(1, 16384 * GPUS, 4, 4, 128, 128), h0=True, chunk=64)
    x, d_out, d_final = cases.inputs(case)
    one = cases.run(generated.gla, case, x, d_out, d_final, "triton")
    mesh = jax.make_mesh((GPUS,), ("sp",))
    with jax.set_mesh(mesh):
        got = _run(_global(generated.gla_cp, platform="triton", **case.kwargs()), x, d_out, d_final, mesh)
    for name, a, b in [("o", got[0], one[0]), ("final_state", got[1], one[1])] + [
            (f"d{n}", got[2][n], one[2][n]) for n in x]:
        assert oracle.rel_error(a, b) < oracle.TOLERANCE["bfloat16"], name


@pytest.mark.skipif(GPUS < 4, reason="data x sequence parallelism: 4 or more GPUs")
def test_wrapper_data_and_sequence_parallel():
    """recurrent(..., mesh=(dp 2, sp GPUS / 2), in_specs=P("dp", "sp")): batch over dp, the steps over sp (the
    context-parallel form), every gate, against the oracle."""
    case = cases.Case("recurrent", ("g", "g_gamma", "gk"), dtype="bfloat16", shape=(2, 128 * GPUS, 4, 2, 64, 64),
                      h0=True, chunk=64)
    x, d_out, d_final = cases.inputs(case)
    mesh = jax.make_mesh((2, GPUS // 2), ("dp", "sp"))

    def fn(a):
        q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
        return generated.recurrent(q, k, v, **a, platform="triton", mesh=mesh, in_specs=P("dp", "sp"),
                                   **case.kwargs())

    _check(case, _run(fn, x, d_out, d_final, mesh), x, d_out, d_final)
