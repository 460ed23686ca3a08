"""The float64 oracle of the pooling family, written from docs/DESIGN.md §3 pooling with plain NumPy loops over
sequences (never the generated code): outputs and every gradient by the formulas, and the check the tests use.

A call is given as x [B, S, D] or packed x [T, D] with cu [N + 1]; weights and mask as the op takes them.
"""

from __future__ import annotations

import numpy as np

TOLERANCE = {"float32": 2e-6, "bfloat16": 1e-2, "float16": 2e-3}  # relative error ||got - ref|| / ||ref||


def _sequences(x, cu):
    """[(rows of x, token indices)] per sequence, x as [T, D] float64."""
    x = np.asarray(x, np.float64)
    if cu is None:
        b, s, d = x.shape
        return x.reshape(b * s, d), [np.arange(i * s, (i + 1) * s) for i in range(b)]
    cu = np.asarray(cu)
    return x, [np.arange(cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def pool(reduction, x, dy, *, cu=None, weights=None, mask=None):
    """(y [N, D], dx like x, dweights like weights or None) in float64, for the cotangent dy [N, D]."""
    flat, seqs = _sequences(x, cu)
    dy = np.asarray(dy, np.float64)
    t_total, d = flat.shape
    w = np.ones(t_total) if weights is None else np.asarray(weights, np.float64).reshape(t_total)
    keep = np.ones(t_total, bool) if mask is None else np.asarray(mask).reshape(t_total)
    y = np.zeros((len(seqs), d))
    dx = np.zeros_like(flat)
    dw = np.zeros(t_total)
    for n, tokens in enumerate(seqs):
        kept = tokens[keep[tokens]]
        if reduction in ("mean", "sum"):
            wn = w[kept]
            total = (wn[:, None] * flat[kept]).sum(axis=0)
            if reduction == "sum":
                y[n] = total
                dx[kept] = wn[:, None] * dy[n]
                dw[kept] = flat[kept] @ dy[n]
                continue
            den = wn.sum()
            if den == 0:
                continue  # 0, and no gradient
            y[n] = total / den
            dx[kept] = wn[:, None] * dy[n] / den
            dw[kept] = (flat[kept] - y[n]) @ dy[n] / den
        elif reduction == "max":
            for col in range(d):
                if kept.size == 0:
                    break
                values = flat[kept, col]
                nan = np.isnan(values)
                at = int(np.argmax(nan)) if nan.any() else int(np.argmax(values))  # the first NaN, or the first max
                y[n, col] = values[at]
                dx[kept[at], col] = dy[n, col]
        elif reduction == "last":
            if kept.size:
                y[n] = flat[kept[-1]]
                dx[kept[-1]] = dy[n]
        else:
            raise ValueError(reduction)
    dx = dx.reshape(np.shape(x))
    dweights = None if weights is None else dw.reshape(np.shape(weights))
    return y, dx, dweights


def rel_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / (scale if scale > 0 else 1.0))


def assert_close(name: str, got, want, dtype: str, factor: float = 1.0):
    assert np.shape(got) == np.shape(want), f"{name}: shape {np.shape(got)}, expected {np.shape(want)}"
    got64 = np.asarray(got, np.float64)
    assert np.array_equal(np.isnan(got64), np.isnan(np.asarray(want, np.float64))), f"{name}: NaNs differ"
    err = rel_error(np.nan_to_num(got64), np.nan_to_num(np.asarray(want, np.float64)))
    tol = TOLERANCE[dtype] * factor
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"
