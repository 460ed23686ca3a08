"""The DSL's integer arithmetic and conversions (docs/DESIGN.md §2) end to end: one spec that uses every one of
them (``//`` and ``%`` with negative operands and a divisor that may be 0, floor, ceil, round half to even, int
toward zero, float, clamp, sign, log2, exp2), built here, on every backend against the same definitions written
in jnp (float64), with gradients (zero through the integer parts, exact elsewhere)."""

from __future__ import annotations

import importlib

import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from conftest import BACKENDS, jitted_vjp, on_path
from ejgen.cli import main
from ejgen.testing.shapes import AttnShape, random_cotangents, random_qkv, rng_for

pytestmark = pytest.mark.usefixtures("x64_stays_off")

SPEC = """\
name: arithmetic_attention
family: attention
doc: >
  Every integer operator and conversion of the DSL in one score and mask.
features:
  gqa: runtime
params:
  w: {shape: [heads, 7], dtype: float32, grad: true}
options:
  period: {type: int, default: 3}
  div: {type: int, default: 0}
score: >
  clamp(s, -2.0, 2.0) * float(1 + (kv_idx - q_idx) % period) / 3.0
  + w[h, clamp(round(float(q_idx - kv_idx) / 4.0), -3, 3) + 3]
  + 0.25 * sign(s) * log2(1.0 + exp2(-abs(s)))
  + 0.1 * float(floor(s) + ceil(-s) + int(2.0 * s))
  + 0.01 * float((q_idx - kv_idx) // 5 + q_idx // div + q_idx % div)
mask: (q_idx - kv_idx) // 7 != -2
"""


def _int_div(a, b):
    # Python's floor division, 0 for a zero divisor (the DSL's rule)
    return jnp.where(b == 0, 0, jnp.floor_divide(a, jnp.where(b == 0, 1, b)))


def score(s, ix, params, options):
    d = ix.q_idx - ix.kv_idx
    period, div = options["period"], options["div"]
    out = jnp.clip(s, -2.0, 2.0) * (1 + jnp.mod(ix.kv_idx - ix.q_idx, period)) / 3.0
    out = out + oracle.param_at(params["w"], ix.h, jnp.clip(jnp.round(d / 4.0), -3, 3).astype(jnp.int32) + 3)
    out = out + 0.25 * jnp.sign(s) * jnp.log2(1.0 + jnp.exp2(-jnp.abs(s)))
    ints = jnp.floor(s) + jnp.ceil(-s) + jnp.trunc(2.0 * s)
    out = out + 0.1 * jax_stop(ints)
    mod = ix.q_idx - _int_div(ix.q_idx, div) * div
    return out + 0.01 * (_int_div(d, 5) + _int_div(ix.q_idx, div) + mod)


def jax_stop(x):
    import jax

    return jax.lax.stop_gradient(x)


def mask(ix, options):
    return _int_div(ix.q_idx - ix.kv_idx, 7) != -2


@pytest.fixture(scope="module")
def arith(tmp_path_factory):
    root = tmp_path_factory.mktemp("arith")
    (root / "specs").mkdir()
    (root / "specs" / "arithmetic.yaml").write_text(SPEC)
    assert main(["build", str(root / "specs"), "-o", str(root / "arith_pkg")]) == 0
    with on_path(root):
        yield importlib.import_module("arith_pkg").arithmetic_attention


OPTIONS = ({"period": 3, "div": 0}, {"period": 4, "div": 6}, {"period": -5, "div": -7})
"""A zero divisor, positive ones and negative ones (Python's signs: the quotient floored, the remainder the divisor's
sign)."""


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_integer_operator_matches_its_definition(arith, backend):
    """Each backend with both option sets, through one compiled function: the options are runtime scalars."""
    shape = AttnShape(1, 37, 41, 2, 1, 16)  # two tiles or more on both axes, GQA (the operators are what counts)
    fwd_bwd = jitted_vjp(arith, {"platform": backend})
    for options in OPTIONS:
        rng = rng_for("arith", backend, str(options))
        diff = random_qkv(shape, "float32", rng)
        diff["query"] = diff["query"] * 3.0  # logits past the clamp and across several integers
        params = {"w": jnp.asarray(rng.standard_normal((shape.q_heads, 7)), jnp.float32)}
        diff.update(params)
        d_out, d_lse = random_cotangents(shape, "float32", rng)
        out, lse, grads = fwd_bwd(diff, options, d_out, d_lse)
        ref = oracle.attention(**{n: np.asarray(x) for n, x in diff.items() if n not in params}, score=score,
                               mask=mask, params=params, options=options, d_out=d_out, d_lse=d_lse)
        oracle.check_attention(out, lse, grads, ref, diff, "float32")
    assert fwd_bwd._cache_size() == 1, "the second option set compiled again"

