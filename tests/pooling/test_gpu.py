"""The pooling kernels at the sizes they are built for, on a GPU (`pytest -m gpu tests/pooling`): several work items
per sequence, many blocks of columns, long packed batches with empty sequences, against float64 NumPy (vectorised
by sequence: `np.add.reduceat`), outputs and gradients; platforms triton and pallas (the Triton lowering)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from ejgen.generated import max_pooling, mean_pooling, weighted_mean_pooling

pytestmark = pytest.mark.gpu

LENGTHS = (0, 5000, 1, 777, 0, 16384, 3000, 129, 2048, 31)  # 27400 tokens: items of every size, empty sequences


def _segment_means(x, lens, w=None):
    """float64 [N, D]: the (weighted) mean of each sequence (0 for none), by cumulative sums per sequence."""
    x = np.asarray(x, np.float64)
    w = np.ones(x.shape[0]) if w is None else np.asarray(w, np.float64)
    cu = np.concatenate([[0], np.cumsum(lens)])
    out = np.zeros((len(lens), x.shape[1]))
    for n in range(len(lens)):
        if lens[n]:
            wn = w[cu[n]:cu[n + 1]]
            den = wn.sum()
            out[n] = (wn[:, None] * x[cu[n]:cu[n + 1]]).sum(0) / den if den else 0.0
    return out


@pytest.mark.parametrize("backend", ["triton", "pallas"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dense_large(backend, dtype):
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 4096, 1024), dtype)
    dy = jax.random.normal(jax.random.PRNGKey(1), (8, 1024), dtype)
    y, vjp = jax.vjp(lambda x: mean_pooling(x, platform=backend), x)
    (dx,) = vjp(dy)
    xs = np.asarray(x.astype(jnp.float32), np.float64)
    oracle.assert_close("y", y, xs.mean(axis=1), dtype)
    want_dx = np.broadcast_to(np.asarray(dy.astype(jnp.float32), np.float64)[:, None] / 4096, xs.shape)
    oracle.assert_close("dx", dx, want_dx, dtype)


@pytest.mark.parametrize("backend", ["triton", "pallas"])
def test_packed_large_with_weights(backend):
    lens = np.asarray(LENGTHS)
    t = int(lens.sum())
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    x = jax.random.normal(jax.random.PRNGKey(2), (t + 100, 768), jnp.bfloat16)  # 100 tokens past the last sequence
    w = jax.random.uniform(jax.random.PRNGKey(3), (t + 100,), jnp.float32, 0.5, 2.0)
    mask = jax.random.uniform(jax.random.PRNGKey(4), (t + 100,)) > 0.2
    dy = jax.random.normal(jax.random.PRNGKey(5), (len(lens), 768), jnp.bfloat16)
    f = lambda x, w: weighted_mean_pooling(x, 32, cu, weights=w, mask=mask, platform=backend)  # noqa: E731
    y, vjp = jax.vjp(f, x, w)
    dx, dw = vjp(dy)
    ww = np.where(np.asarray(mask), np.asarray(w, np.float64), 0.0)[:t]
    xs = np.asarray(x.astype(jnp.float32), np.float64)[:t]
    want = _segment_means(xs, lens, ww)
    oracle.assert_close("y", y, want, "bfloat16")
    y_ref = _segment_means(xs, lens)
    np.testing.assert_array_equal(np.asarray(dx[t:], np.float32), 0.0)
    assert np.all(np.isfinite(np.asarray(dw, np.float32))) and y_ref.shape == want.shape
    ref_dx, ref_dw = _weighted_grads(xs, lens, ww, np.asarray(dy.astype(jnp.float32), np.float64), want)
    oracle.assert_close("dx", dx[:t], ref_dx, "bfloat16")
    oracle.assert_close("dweights", np.where(np.asarray(mask)[:t], np.asarray(dw)[:t], 0.0), ref_dw, "bfloat16",
                        factor=4.0)


def _weighted_grads(xs, lens, ww, dy, y):
    cu = np.concatenate([[0], np.cumsum(lens)])
    dx = np.zeros_like(xs)
    dw = np.zeros(xs.shape[0])
    for n in range(len(lens)):
        a, b = cu[n], cu[n + 1]
        den = ww[a:b].sum()
        if den:
            dx[a:b] = ww[a:b, None] * dy[n] / den
            dw[a:b] = np.where(ww[a:b] != 0, (xs[a:b] - y[n]) @ dy[n] / den, 0.0)
    return dx, dw


@pytest.mark.parametrize("backend", ["triton", "pallas"])
def test_max_large(backend):
    x = jax.random.normal(jax.random.PRNGKey(6), (4, 3000, 512), jnp.float32)
    y = max_pooling(x, platform=backend)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x).max(axis=1))
    g = jax.grad(lambda x: jnp.sum(max_pooling(x, platform=backend)))(x)
    np.testing.assert_array_equal(np.asarray(g).sum(axis=1), np.ones((4, 512), np.float32))
