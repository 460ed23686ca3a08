"""One chunk of C steps of the recurrence, forward and backward, in the jnp a Pallas kernel body may use on both
lowerings (Triton and Mosaic): 2-D arrays, elementwise ops, reductions, matrix products; no value slices, no cumsum
(prefix sums are a product with a triangular matrix), a row or column of a tile read by a masked reduction.

Inputs of a chunk: q (mapped and scaled), k (mapped) [C, K], v [C, V], the key side's log gate l [C, K] (gk + g +
g_gamma) or [C, 1] (scalar gates), the state S [K, V] at the chunk's start. With P the prefix sums of l from the
chunk's start (inclusive), Q the suffix sums after a step and E the chunk's sum:
    o_i  = (q_i e^{P_i}) S + sum_{j <= i} A_ij v_j,   A_ij = sum_k q_ik k_jk e^{P_ik - P_jk}
    S'   = diag(e^E) S + (k e^Q)ᵀ v
(every exponent <= 0 for decaying gates; the chunk is short, so P_i - P_j loses little to float32 rounding).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST


def _dot(a, b, dtype, trans_a=False, trans_b=False):
    """a @ b (a or b transposed) in float32; 16-bit inputs meet as 16-bit operands, float32 ones in full float32."""
    if dtype != F32:
        a, b = a.astype(dtype), b.astype(dtype)
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=HIGHEST if dtype == F32 else None, preferred_element_type=F32)


def _iota(c):
    rows = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    cols = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    return rows, cols


def sums(l):
    """(P, Q, E): prefix sums [C, D], suffix sums after each step [C, D] and the chunk's sum [1, D] of l [C, D]."""
    c = l.shape[0]
    rows, cols = _iota(c)
    lower = (rows >= cols).astype(F32)
    prefix = lax.dot_general(lower, l, (((1,), (0,)), ((), ())), precision=HIGHEST, preferred_element_type=F32)
    total = jnp.sum(l, axis=0, keepdims=True)
    return prefix, total - prefix, total


def column(x, d: int):
    """[D, 1] of a row [1, D] (a transpose by a masked reduction: both lowerings have it)."""
    rows = lax.broadcasted_iota(jnp.int32, (d, d), 0)
    cols = lax.broadcasted_iota(jnp.int32, (d, d), 1)
    return jnp.sum(jnp.where(rows == cols, x, 0.0), axis=1, keepdims=True)


def row(x, d: int):
    """[1, D] of a column [D, 1]."""
    rows = lax.broadcasted_iota(jnp.int32, (d, d), 0)
    cols = lax.broadcasted_iota(jnp.int32, (d, d), 1)
    return jnp.sum(jnp.where(rows == cols, x, 0.0), axis=0, keepdims=True)


def _row(x, j):
    """Row j of x [C, D] as [1, D]."""
    rows = lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.sum(jnp.where(rows == j, x, 0.0), axis=0, keepdims=True)


def _col(x, j):
    """Column j of x [C, C] as [C, 1]."""
    cols = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return jnp.sum(jnp.where(cols == j, x, 0.0), axis=1, keepdims=True)


def diagonal(a, b, p):
    """X [C, C]: X_ij = sum_k a_ik b_jk e^{P_ik - P_jk} for j <= i, else 0 (each column from row j of b and P)."""
    c = a.shape[0]
    rows, cols = _iota(c)
    rows_c = lax.broadcasted_iota(jnp.int32, p.shape, 0)
    x = jnp.zeros((c, c), F32)
    for j in range(c):
        decay = jnp.exp(jnp.where(rows_c >= j, p - _row(p, j), 0.0))  # [C, D]: e^{P_i - P_j} for i >= j
        col = jnp.sum(a * _row(b, j) * decay, axis=1, keepdims=True)  # [C, 1]
        x = jnp.where((cols == j) & (rows >= j), col, x)
    return x


def decay_state(s, total):
    """diag(e^E) s for E [1, K] (per channel) or [1, 1] (scalar)."""
    e = jnp.exp(total)
    return s * (column(e, s.shape[0]) if total.shape[1] > 1 else e)


def forward(q, k, v, l, s, dtype):
    """(o [C, V], S' [K, V]) of one chunk (module docstring), float32."""
    p, after, total = sums(l)
    o = _dot(diagonal(q, k, p), v, dtype) + _dot(q * jnp.exp(p), s, dtype)
    s = decay_state(s, total) + _dot(k * jnp.exp(after), v, dtype, trans_a=True)
    return o, s


def _per_gate(x, width: int):
    """A share of the key side's log decay gradient [C, K]: per channel (width K), or summed over them (width 1)."""
    return x if width > 1 else jnp.sum(x, axis=1, keepdims=True)


def _masked_sums(mask, x):
    """sum_t mask[s, t] x_t for a [C, C] mask (prefix or suffix sums as a product with a triangular matrix)."""
    return lax.dot_general(mask.astype(F32), x, (((1,), (0,)), ((), ())), precision=HIGHEST,
                           preferred_element_type=F32)


def backward(q, k, v, l, do, s, ds, dtype, gated: bool = True):
    """(dq [C, K] (of the scaled q), dk [C, K], dv [C, V], dS at the chunk's start, dlog [C, K | 1] or None) of one
    chunk, from the state S at its start and the adjoint dS at its end:
        dq_i = e^{P_i} (do_i Sᵀ) + sum_{j <= i} dA_ij k_j e^{P_i - P_j},   dA_ij = do_i · v_j
        dk_j = e^{Q_j} (v_j dSᵀ) + sum_{i >= j} dA_ij q_i e^{P_i - P_j}
        dv_j = (k_j e^{Q_j}) dS + sum_{i >= j} A_ij do_i
        dS_start = diag(e^E) dS + (q e^P)ᵀ do
    With ``gated``, dlog: the key side's log decay gradient of each step s (l's width: per channel or one column),
    the sum over the pairs r < s <= t of q_t k_r e^{P_t - P_r} dA_tr (docs/DESIGN.md §3 linear recurrent, "Gates'
    gradients"), r = the start state and t = the end adjoint included, none subtracted from another:
        dlog_s = sum_{t >= s} q_t ⊙ dq^S_t + sum_{r < s} k_r ⊙ dk^dS_r + (e^E ⊙ S ⊙ dS summed over V)
                 + sum_{r < s <= t} (the pairs inside the chunk)
    with dq^S, dk^dS the start state's and end adjoint's terms of dq and dk."""
    c = q.shape[0]
    width = l.shape[1]
    p, after, total = sums(l)
    rows, cols = _iota(c)
    rows_c = lax.broadcasted_iota(jnp.int32, p.shape, 0)
    rows_k = lax.broadcasted_iota(jnp.int32, q.shape, 0)
    rows_g = lax.broadcasted_iota(jnp.int32, (c, width), 0)
    da = jnp.where(rows >= cols, _dot(do, v, dtype, trans_b=True), 0.0)
    dq_s = _dot(do, s, dtype, trans_b=True) * jnp.exp(p)
    dq = dq_s
    dk = jnp.zeros(k.shape, F32)
    pairs = jnp.zeros((c, width), F32)  # the pairs (t, r) with r < s so far, by t
    inner = jnp.zeros((c, width), F32)
    for j in range(c):
        decay = jnp.exp(jnp.where(rows_c >= j, p - _row(p, j), 0.0))  # e^{P_i - P_j} for i >= j
        da_j = _col(da, j)  # [C, 1]: dA[:, j], 0 above the diagonal
        dq_j = da_j * _row(k, j) * decay
        dq = dq + dq_j
        dk = jnp.where(rows_k == j, jnp.sum(da_j * q * decay, axis=0, keepdims=True), dk)
        if gated:
            pairs = pairs + _per_gate(q * dq_j, width)
            inner = jnp.where(rows_g == j + 1, jnp.sum(jnp.where(rows_g > j, pairs, 0.0), axis=0, keepdims=True), inner)
    dk_s = _dot(v, ds, dtype, trans_b=True) * jnp.exp(after)
    dk = dk + dk_s
    dv = _dot(k * jnp.exp(after), ds, dtype) + _dot(diagonal(q, k, p), do, dtype, trans_a=True)
    dlog = None
    if gated:
        through = _per_gate(row(jnp.sum(decay_state(s, total) * ds, axis=1, keepdims=True), s.shape[0]), width)
        dlog = (_masked_sums(cols >= rows, _per_gate(q * dq_s, width))
                + _masked_sums(cols < rows, _per_gate(k * dk_s, width)) + inner + through)
    ds = decay_state(ds, total) + _dot(q * jnp.exp(p), do, dtype, trans_a=True)
    return dq, dk, dv, ds, dlog
