"""Decode mode (`<name>_decode`, docs/DESIGN.md §3 linear recurrent): one step at a time from a given state equals the
train op over the whole sequence and the float64 oracle, on every backend (Triton and Pallas interpreted); a few steps
per call likewise, with every gate; gradients through a decode step (state, q, the gates) against the oracle; bad
calls."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import recurrent_oracle as oracle
from recurrent_cases import Case, inputs
from ejgen.generated import gla_decode, recurrent_decode
from ejgen.ops import settings

pytestmark = pytest.mark.usefixtures("x64_stays_off")


@pytest.mark.parametrize("backend", ["xla", "triton", "pallas"])
def test_one_step_at_a_time(backend):
    """GLA with GQA, six steps, each a call from the state the previous one returned."""
    case = Case("gla", ("gk",), shape=(2, 6, 4, 2, 16, 24), h0=True)
    x, d_out, d_final = inputs(case, seed=11)
    o_ref, final_ref, _ = oracle.recurrent(x, d_out, d_final)
    step = jax.jit(lambda q, k, v, s, gk: gla_decode(q, k, v, s, gk, platform=backend))
    state = jnp.asarray(x["initial_state"])
    outs = []
    for t in range(case.shape[1]):
        o, state = step(*(jnp.asarray(x[n][:, t]) for n in ("query", "key", "value")), state, jnp.asarray(x["gk"][:, t]))
        assert o.shape == (2, 4, 24) and state.shape == (2, 4, 16, 24) and state.dtype == jnp.float32
        outs.append(o)
    oracle.assert_close("o", jnp.stack(outs, axis=1), o_ref, "float32")
    oracle.assert_close("state", state, final_ref, "float32")


def test_a_large_batch_steps_in_wide_value_blocks(monkeypatch):
    """Triton's fused forward takes value blocks of host.FUSED_WIDE_BV where its grid is large (a decode step of a big
    batch; here every grid, FUSED_WIDE_PER_SM 0): V 48 in one block of 64 (16 columns masked), against the oracle."""
    from ejgen.runtime.launch import triton_call
    from ejgen.runtime.recurrent.triton import host

    blocks, launch = [], triton_call.launch

    def spy(kernel, grid, *args, **kwargs):
        blocks.append(kwargs.get("BV"))
        return launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(triton_call, "launch", spy)
    monkeypatch.setattr(host, "FUSED_WIDE_PER_SM", 0)
    case = Case("gla", ("gk",), shape=(3, 2, 2, 1, 16, 48), h0=True)
    x, d_out, d_final = inputs(case, seed=13)
    o_ref, final_ref, _ = oracle.recurrent(x, d_out, d_final)
    step = jax.jit(lambda q, k, v, s, gk: gla_decode(q, k, v, s, gk, platform="triton"))
    state, outs = jnp.asarray(x["initial_state"]), []
    for t in range(case.shape[1]):
        o, state = step(*(jnp.asarray(x[n][:, t]) for n in ("query", "key", "value")), state, jnp.asarray(x["gk"][:, t]))
        outs.append(o)
    assert blocks and set(blocks) == {64}, blocks  # the launches took 64-column blocks
    oracle.assert_close("o", jnp.stack(outs, axis=1), o_ref, "float32")
    oracle.assert_close("state", state, final_ref, "float32")
    blocks.clear()  # the fused_value_blocks setting "fixed": 32 columns whatever the grid (batch invariance)
    with settings(fused_value_blocks="fixed"):
        jax.jit(lambda q, k, v, s, gk: gla_decode(q, k, v, s, gk, platform="triton"))(
            *(jnp.asarray(x[n][:, 0]) for n in ("query", "key", "value")), jnp.asarray(x["initial_state"]),
            jnp.asarray(x["gk"][:, 0]))
    assert blocks and set(blocks) == {32}, blocks


def test_a_few_steps_per_call_with_every_gate_and_their_gradients():
    case = Case("recurrent", ("g", "g_gamma", "gk", "gv"), shape=(2, 3, 2, 2, 16, 16), h0=True)
    x, d_out, d_final = inputs(case, seed=12)
    o_ref, final_ref, grads_ref = oracle.recurrent(x, d_out, d_final)
    names = ["query", "key", "value", "initial_state", "g", "g_gamma", "gk", "gv"]

    def call(a):
        return recurrent_decode(a["query"], a["key"], a["value"], a["initial_state"], a["g"], a["g_gamma"], a["gk"],
                                a["gv"], platform="xla")

    (o, final), vjp = jax.vjp(call, {n: jnp.asarray(x[n]) for n in names})
    (grads,) = vjp((jnp.asarray(d_out), jnp.asarray(d_final)))
    oracle.assert_close("o", o, o_ref, "float32")
    oracle.assert_close("state", final, final_ref, "float32")
    for n in names:
        oracle.assert_close(f"d{n}", grads[n], grads_ref[n], "float32")


Q = jnp.zeros((2, 4, 16))
S = jnp.zeros((2, 4, 16, 16))
BAD = [
    ("rank", lambda: gla_decode(Q[0], Q, Q, S, Q), ValueError,
     "gla_decode(): query must be [batch, heads, K] (one step) or [batch, steps, heads, K], got float32[4, 16]"),
    ("state", lambda: gla_decode(Q, Q, Q, None, Q), ValueError, "gla_decode(): state is required: [batch, heads, K, V]"),
    ("gate-rank", lambda: gla_decode(Q, Q, Q, S, Q[:, None]), ValueError,
     "gla_decode(): gk must have 3 dims (one step: no steps axis, as query), got float32[2, 1, 4, 16]"),
    ("required-gate", lambda: gla_decode(Q, Q, Q, S), TypeError, "gla() needs gk"),
    ("unknown", lambda: gla_decode(Q, Q, Q, S, Q, reverse=True), TypeError,
     "gla() got an unsupported argument 'reverse'"),
]


@pytest.mark.parametrize("call,error,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_decode_call(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()
