"""The oracle's hand-written adjoint (oracle.py) against JAX's derivative of the same recurrence written as a
float64 ``lax.scan``, and against finite differences, on every gate, the initial state and the final state's
cotangent; and its packed sequences against separate dense calls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import recurrent_oracle as oracle
from recurrent_cases import Case, inputs

pytestmark = pytest.mark.usefixtures("x64_stays_off")


def test_adjoint_equals_the_derivative_of_the_scan(reverse=True):
    case = Case("recurrent", ("g", "g_gamma", "gk", "gv"), shape=(2, 9, 4, 2, 3, 5), h0=True, reverse=reverse)
    x, d_out, d_final = inputs(case, seed=1)
    o, final, grads = oracle.recurrent(x, d_out, d_final, reverse=reverse)
    with jax.enable_x64(True):
        args = {n: jnp.asarray(a, jnp.float64) for n, a in x.items()}
        (o_ref, final_ref), vjp = jax.vjp(lambda a: oracle.scan_reference(a, reverse=reverse), args)
        (ref,) = vjp((jnp.asarray(d_out, jnp.float64), jnp.asarray(d_final, jnp.float64)))
    assert oracle.rel_error(o, o_ref) < 1e-12 and oracle.rel_error(final, final_ref) < 1e-12
    for name in x:
        assert oracle.rel_error(grads[name], ref[name]) < 1e-12, name


def test_adjoint_matches_finite_differences_through_the_hooks():
    """One entry of each input, hooks on (a feature map and a gate map), central differences in float64."""
    case = Case("recurrent", ("g", "gk"), shape=(1, 6, 2, 1, 3, 2), h0=True)
    x, d_out, d_final = inputs(case, seed=2)
    hooks = {"feature_map": lambda v: jnp.where(v > 0, v + 1.0, jnp.exp(v)),
             "gate_map": lambda v: -jnp.log1p(jnp.exp(-v)) / 16}
    _, _, grads = oracle.recurrent(x, d_out, d_final, **hooks)

    def loss(inp):
        o, final, _ = oracle.recurrent(inp, d_out, d_final, **hooks)
        return float(np.sum(o * np.asarray(d_out, np.float64)) + np.sum(final * d_final))

    rng = np.random.default_rng(0)
    for name, a in x.items():
        a = np.asarray(a, np.float64)
        idx = tuple(int(rng.integers(0, d)) for d in a.shape)
        eps = 1e-6
        plus, minus = dict(x), dict(x)
        plus[name], minus[name] = a.copy(), a.copy()
        plus[name][idx] += eps
        minus[name][idx] -= eps
        numeric = (loss(plus) - loss(minus)) / (2 * eps)
        assert abs(grads[name][idx] - numeric) <= 1e-6 * max(1.0, abs(numeric)), name


def test_packed_sequences_are_separate_calls():
    case = Case("recurrent", ("g", "gv"), shape=(1, 12, 2, 2, 3, 4), cu=(0, 4, 4, 11), h0=True, reverse=True)
    x, d_out, d_final = inputs(case, seed=4)
    o, final, grads = oracle.recurrent(x, d_out, d_final, cu=case.cu, reverse=True)
    assert np.all(o[0, 11] == 0) and np.all(grads["query"][0, 11] == 0)  # a token of no sequence
    assert np.array_equal(final[1], x["initial_state"][1])  # the empty sequence keeps its initial state
    for seq, lo, hi in ((0, 0, 4), (2, 4, 11)):
        part = {name: (a[:, lo:hi] if np.ndim(a) == 4 or name == "g" else a) for name, a in x.items()}
        part["initial_state"] = x["initial_state"][seq:seq + 1]
        o_n, final_n, _ = oracle.recurrent(part, d_out[:, lo:hi], d_final[seq:seq + 1], reverse=True)
        assert np.allclose(o[:, lo:hi], o_n, rtol=0, atol=1e-12) and np.allclose(final[seq], final_n[0], atol=1e-12)
