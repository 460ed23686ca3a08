"""The pooling ops (docs/DESIGN.md §3 pooling) against the float64 oracle, on every backend: outputs, dx and the
weights' gradient, under jit, dense and packed (empty sequences, tokens past the last sequence), odd D, every
float dtype, every reduction of the committed specs (mean, weighted mean, max, last) and a sum spec built here.

Shapes are the smallest that still cut sequences into several work items (chunk_size 4 to 16: the interpreters'
items are two chunks) and D into more than one block on the TPU kernels. The Pallas TPU kernels run under
``interpret_kernels("tpu")`` (and once under the TPU interpreter, which poisons memory never written).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import pooling_oracle as oracle
from ejgen.generated import last_token_pooling, max_pooling, mean_pooling, weighted_mean_pooling
from ejgen.runtime.core.pallas import interpret_kernels

pytestmark = pytest.mark.usefixtures("x64_stays_off")

OPS = {"mean_pooling": (mean_pooling, "mean"), "weighted_mean_pooling": (weighted_mean_pooling, "mean"),
       "max_pooling": (max_pooling, "max"), "last_token_pooling": (last_token_pooling, "last")}
CU = (0, 10, 10, 41, 47)  # 4 sequences, one empty, 3 tokens past the last one (T = 50)


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    packed: bool
    dtype: str
    dim: int
    chunk: int = 8
    weights: bool = False
    mask: bool = False
    nan: bool = False  # a NaN in a pooled token (max: it wins)
    dense_shape: tuple = (3, 37)

    @property
    def id(self) -> str:
        parts = [self.op.removesuffix("_pooling"), "packed" if self.packed else "dense", self.dtype, f"D{self.dim}",
                 f"c{self.chunk}"]
        parts += [name for name in ("weights", "mask", "nan") if getattr(self, name)]
        return "-".join(parts)


CASES = (
    Case("mean_pooling", False, "float32", 33),
    Case("mean_pooling", True, "bfloat16", 64),
    Case("weighted_mean_pooling", True, "float16", 40, chunk=4, weights=True, mask=True),
    Case("weighted_mean_pooling", False, "float32", 48, weights=True),
    Case("max_pooling", True, "float32", 33, mask=True, nan=True),
    Case("max_pooling", False, "bfloat16", 64, chunk=16),
    Case("last_token_pooling", True, "float16", 33, mask=True),
    Case("last_token_pooling", False, "float32", 16, mask=True),
    # sequences of one work item (the interpreters' items are two chunks): the forward kernel writes y itself
    Case("mean_pooling", False, "float16", 24, chunk=16, dense_shape=(4, 20)),
    Case("max_pooling", False, "float32", 20, chunk=16, dense_shape=(2, 30)),
)
# Pallas compiles each case's kernels for its interpreter (seconds): its GPU kernels run a cover of the reductions and
# layouts, its TPU kernels the packed ones (items across row blocks) and a D of several blocks of lanes.
PALLAS_CASES = (CASES[1], CASES[3], CASES[4], CASES[7])
TPU_CASES = (CASES[2], CASES[4], CASES[6], Case("mean_pooling", False, "bfloat16", 640, chunk=16))
BY_BACKEND = ([("xla", c) for c in CASES[:8]] + [("triton", c) for c in CASES]
              + [("pallas", c) for c in PALLAS_CASES])


def make_inputs(case: Case, seed: int = 0):
    """(x, cu or None, weights or None, mask or None, dy) as NumPy arrays (x and dy rounded to the dtype)."""
    rng = np.random.default_rng(seed)
    lead = (CU[-1] + 3,) if case.packed else case.dense_shape
    x = rng.standard_normal(lead + (case.dim,)).astype(np.float32)
    mask = rng.uniform(size=lead) > 0.3 if case.mask else None
    if mask is not None:
        if case.packed:
            mask[10:41] = False  # sequence 2: every token left out
        else:
            mask[1] = False
    if case.nan:
        x[12, 3] = np.nan  # sequence 2 of the packed layout... masked out: no effect
        x[5, 7] = np.nan  # sequence 0: its max in column 7
        if mask is not None:
            mask[5] = True
    weights = rng.uniform(0.25, 2.0, size=lead).astype(np.float32) if case.weights else None
    n = len(CU) - 1 if case.packed else lead[0]
    dy = rng.standard_normal((n, case.dim)).astype(np.float32)
    dtype = jnp.dtype(case.dtype)
    x = np.asarray(jnp.asarray(x, dtype))
    dy = np.asarray(jnp.asarray(dy, dtype))
    return x, (np.asarray(CU, np.int32) if case.packed else None), weights, mask, dy


def run_case(case: Case, platform: str):
    op, reduction = OPS[case.op]
    x, cu, weights, mask, dy = make_inputs(case)
    extra = {} if mask is None else {"mask": jnp.asarray(mask)}
    if cu is not None:
        extra["cu_seqlens"] = jnp.asarray(cu)

    @jax.jit
    def fwd_bwd(x, w, extra, dy):
        def f(x, w):
            kw = dict(extra)
            if w is not None:
                kw["weights"] = w
            return op(x, case.chunk, platform=platform, **kw)

        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(dy))

    y, dx, dw = fwd_bwd(jnp.asarray(x), None if weights is None else jnp.asarray(weights), extra, jnp.asarray(dy))
    ref_y, ref_dx, ref_dw = oracle.pool(reduction, x, dy, cu=cu, weights=weights, mask=mask)
    assert y.dtype == x.dtype and dx.dtype == x.dtype
    oracle.assert_close("y", y, ref_y, case.dtype)
    oracle.assert_close("dx", dx, ref_dx, case.dtype)
    if weights is not None:
        oracle.assert_close("dweights", dw, ref_dw, case.dtype, factor=4.0)  # dots over D of rounded x
    return y


@pytest.mark.parametrize("backend,case", BY_BACKEND, ids=[f"{b}-{c.id}" for b, c in BY_BACKEND])
def test_matches_oracle(backend, case):
    run_case(case, backend)


@pytest.mark.parametrize("case", TPU_CASES, ids=[c.id for c in TPU_CASES])
def test_tpu_kernels_match_oracle(case):
    with interpret_kernels("tpu"):
        run_case(case, "pallas")


def test_tpu_kernels_in_the_tpu_interpreter():
    """The TPU interpreter fills memory no kernel wrote with NaN: every output block is written before it is
    read (the first item of a block opens it), and sequences without items come out 0."""
    with interpret_kernels("tpu", pltpu.InterpretParams()):
        run_case(Case("weighted_mean_pooling", True, "float32", 40, chunk=8, weights=True, mask=True), "pallas")


SUM_SPEC = """\
name: sum_pooling
family: pooling
doc: Sum of each sequence's tokens, weighted.
reduction: sum
features:
  varlen: always
  weights: runtime
"""


@pytest.mark.parametrize("backend", ["triton"])
def test_sum_spec_built_here(tmp_path, backend):
    """A spec this test writes (reduction sum, varlen compiled in): built, imported, against the oracle."""
    from conftest import on_path
    from ejgen import render
    from ejgen.spec import load_spec
    from ejgen.writer import write_package

    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "sum_pooling.yaml").write_text(SUM_SPEC)
    write_package(render.render([load_spec(tmp_path / "specs" / "sum_pooling.yaml")]), tmp_path / "sum_pkg")
    with on_path(tmp_path):
        import importlib

        op = importlib.import_module("sum_pkg").sum_pooling
        case = Case("sum", True, "float32", 24, chunk=4, weights=True)
        x, cu, weights, _, dy = make_inputs(case)
        f = lambda x, w: op(x, 4, jnp.asarray(cu), weights=w, platform=backend)  # noqa: E731
        y, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(weights))
        dx, dw = vjp(jnp.asarray(dy))
        ref_y, ref_dx, ref_dw = oracle.pool("sum", x, dy, cu=cu, weights=weights)
        oracle.assert_close("y", y, ref_y, "float32")
        oracle.assert_close("dx", dx, ref_dx, "float32")
        oracle.assert_close("dweights", dw, ref_dw, "float32")
        with pytest.raises(TypeError, match="needs cu_seqlens: the spec compiles feature 'varlen' in"):
            op(jnp.asarray(x), platform=backend)


def test_triton_is_deterministic_and_equals_xla_on_a_long_sequence():
    """Sequences cut into many work items (chunk 4: items of 8 tokens) combine in order: two runs agree bit for bit,
    and with the XLA backend to float32 rounding."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 90, 16)), jnp.float32)
    runs = [np.asarray(mean_pooling(x, 4, platform="triton")) for _ in range(2)]
    np.testing.assert_array_equal(runs[0], runs[1])
    np.testing.assert_allclose(runs[0], np.asarray(mean_pooling(x, platform="xla")), rtol=1e-5, atol=1e-6)


def test_no_tokens_and_chunk_size_tiles_only(backend):
    """No tokens at all gives zeros [N, D]; chunk_size changes the tiles, not the result."""
    x = jnp.zeros((2, 0, 8), jnp.float32)
    np.testing.assert_array_equal(mean_pooling(x, platform=backend), np.zeros((2, 8), np.float32))
    xs = jnp.asarray(np.random.default_rng(2).standard_normal((2, 9, 8)), jnp.float32)
    a, b = (np.asarray(mean_pooling(xs, c, platform=backend)) for c in (1, 16))
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["xla", "triton", "pallas"])
def test_vmap(backend):
    """jax.vmap over a leading axis, with gradients: dense calls (Triton: folded into one launch) and packed ones
    with shared weights (Triton: one launch per index) against the oracle per index."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 11, 8)).astype(np.float32)
    dy = rng.standard_normal((2, 3, 8)).astype(np.float32)
    dense = jax.jit(jax.vmap(lambda x, dy: jax.vjp(lambda x: max_pooling(x, 4, platform=backend), x)[1](dy)[0]))
    y = jax.vmap(lambda x: max_pooling(x, 4, platform=backend))(x)
    dx = dense(x, dy)
    xp = rng.standard_normal((2, 20, 8)).astype(np.float32)
    cu, w = np.asarray([0, 6, 6, 17], np.int32), rng.uniform(0.5, 2.0, 20).astype(np.float32)
    dyp = rng.standard_normal((2, 3, 8)).astype(np.float32)

    def packed(x, dy):
        f = lambda x, w: weighted_mean_pooling(x, 4, jnp.asarray(cu), weights=w, platform=backend)  # noqa: E731
        out, vjp = jax.vjp(f, x, jnp.asarray(w))
        return (out, *vjp(dy))

    yp, dxp, dwp = jax.jit(jax.vmap(packed))(xp, dyp)
    for i in range(2):
        ref_y, ref_dx, _ = oracle.pool("max", x[i], dy[i])
        oracle.assert_close(f"y[{i}]", y[i], ref_y, "float32")
        oracle.assert_close(f"dx[{i}]", dx[i], ref_dx, "float32")
        ref_y, ref_dx, ref_dw = oracle.pool("mean", xp[i], dyp[i], cu=cu, weights=w)
        oracle.assert_close(f"packed y[{i}]", yp[i], ref_y, "float32")
        oracle.assert_close(f"packed dx[{i}]", dxp[i], ref_dx, "float32")
        oracle.assert_close(f"packed dweights[{i}]", dwp[i], ref_dw, "float32")


def test_inside_shard_map():
    """The ops inside the caller's shard_map (check_vma on) on 4 host devices, every backend (shard_check.py, in a
    process of its own)."""
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "shard_check.py")
    env = dict(os.environ, JAX_PLATFORMS="cpu", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.split() == ["xla", "ok", "triton", "ok", "pallas", "ok"]
