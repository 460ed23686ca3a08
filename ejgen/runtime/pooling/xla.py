"""The XLA backend of the pooling family: plain jnp, on any device (docs/DESIGN.md §3 pooling).

Dense inputs reduce over the sequence axis of [N, S, D] (XLA's own reduction, as ``jnp.mean``); packed ones, and
the ranges of ``last``, reduce by segment (``jax.ops.segment_sum`` / ``segment_max``: a scatter, deterministic on
CPUs and TPUs, in run-time order on GPUs, where the triton platform is the default). Accumulation in float32.

``forward(x, w, ctx, cfg, save)`` -> (y [N, D] in x's dtype, residuals); ``backward`` -> (dx [T, D], dw [T] or
None), as every backend of the family.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ejgen.runtime.core import kernels
from ejgen.runtime.pooling import work

F32 = jnp.float32
_NO_TOKEN = jnp.iinfo(jnp.int32).max


def on_gpu() -> bool:
    """Whether calls run on a GPU, where the segment ops' scatters add in run-time order."""
    return kernels.target().platform == "gpu"


def _segments(ctx, cfg):
    """Per token, the sequence whose pooled range holds it, or N (dropped by the segment ops)."""
    t = jnp.arange(cfg.tokens, dtype=jnp.int32)
    seq = work.token_sequences(ctx, cfg) if cfg.varlen else t // max(cfg.seq_len, 1)
    safe = jnp.clip(seq, 0, cfg.n_seqs - 1)
    lo, hi = work.ranges(ctx, cfg)
    inside = (seq >= 0) & (t >= jnp.asarray(lo)[safe]) & (t < jnp.asarray(hi)[safe])
    return jnp.where(inside, seq, cfg.n_seqs), inside


def _by_sequence(cfg) -> bool:
    """Dense inputs pooled over whole sequences reduce over [N, S, D]'s axis 1; the rest by segment."""
    return not (cfg.varlen or cfg.ranged)


def _scale(den):
    """1 / den, and 0 where the weights sum to 0 (an empty sequence, or every token masked)."""
    safe = jnp.where(den != 0, den, 1.0)
    return jnp.where(den != 0, 1.0 / safe, 0.0)


def forward(x, w, ctx, cfg, save: bool):
    if cfg.kind == "max":
        return _max_forward(x, w, ctx, cfg)
    n, d = cfg.n_seqs, cfg.dim
    xw = x.astype(F32) if w is None else x.astype(F32) * w[:, None]
    if _by_sequence(cfg):
        total = jnp.sum(xw.reshape(n, cfg.seq_len, d), axis=1)
        den = jnp.full((n,), cfg.seq_len, F32) if w is None else jnp.sum(w.reshape(n, cfg.seq_len), axis=1)
    else:
        seg, inside = _segments(ctx, cfg)
        total = jax.ops.segment_sum(xw, seg, num_segments=n + 1)[:n]
        den = jax.ops.segment_sum(inside.astype(F32) if w is None else w, seg, num_segments=n + 1)[:n]
    if not cfg.scaled:
        return total.astype(x.dtype), {}
    scale = _scale(den)
    y32 = total * scale[:, None]
    return y32.astype(x.dtype), ({"scale": scale, "y32": y32} if save else {})


def _max_forward(x, w, ctx, cfg):
    n, d = cfg.n_seqs, cfg.dim
    t = jnp.arange(cfg.tokens, dtype=jnp.int32)
    if _by_sequence(cfg):
        xv = x.astype(F32).reshape(n, cfg.seq_len, d)
        if w is not None:
            xv = jnp.where((w != 0).reshape(n, cfg.seq_len, 1), xv, -jnp.inf)
        some = jnp.ones((n, 1), bool) if w is None else jnp.any(w.reshape(n, cfg.seq_len) != 0, axis=1)[:, None]
        top = jnp.max(xv, axis=1)
        arg = jnp.argmax(xv, axis=1).astype(jnp.int32) + (jnp.arange(n, dtype=jnp.int32) * cfg.seq_len)[:, None]
    else:
        seg, inside = _segments(ctx, cfg)
        visible = inside if w is None else inside & (w != 0)
        xv = jnp.where(visible[:, None], x.astype(F32), -jnp.inf)
        top = jax.ops.segment_max(xv, seg, num_segments=n + 1)[:n]
        some = (jax.ops.segment_sum(visible.astype(jnp.int32), seg, num_segments=n + 1)[:n] > 0)[:, None]
        at_top = (xv == top[jnp.minimum(seg, n - 1)]) | (jnp.isnan(xv) & jnp.isnan(top[jnp.minimum(seg, n - 1)]))
        candidates = jnp.where(visible[:, None] & at_top, t[:, None], _NO_TOKEN)
        arg = jax.ops.segment_min(candidates, seg, num_segments=n + 1)[:n]
    y = jnp.where(some, top, 0.0).astype(x.dtype)
    return y, {"token": jnp.where(some, arg, -1)}


def _per_token(v, seq, cfg):
    """v [N, ...] read per token: token t gets its sequence's row (dense: a broadcast, no gather)."""
    if _by_sequence(cfg):
        n, s = cfg.n_seqs, cfg.seq_len
        return jnp.broadcast_to(v[:, None], (n, s) + v.shape[1:]).reshape((n * s,) + v.shape[1:])
    return v[jnp.minimum(seq, cfg.n_seqs - 1)]


def backward(x, w, ctx, res, dy, cfg):
    dy = dy.astype(F32)
    t = jnp.arange(cfg.tokens, dtype=jnp.int32)
    seq, inside = (None, None) if _by_sequence(cfg) else _segments(ctx, cfg)

    def outside_zero(g):
        return g if inside is None else jnp.where(inside.reshape(inside.shape + (1,) * (g.ndim - 1)), g, 0.0)

    if cfg.kind == "max":
        g = outside_zero(jnp.where(_per_token(res["token"], seq, cfg) == t[:, None], _per_token(dy, seq, cfg), 0.0))
        return g.astype(x.dtype), (None if w is None else jnp.zeros_like(w))
    g = dy if not cfg.scaled else dy * res["scale"][:, None]
    g = outside_zero(_per_token(g, seq, cfg))
    dw = None
    if w is not None:
        dw = jnp.zeros_like(w)
        if cfg.weight_grad:
            dw = work.weights_grad(jnp.sum(g * x.astype(F32), axis=1), dy, res, ctx, cfg)
        g = g * w[:, None]
    return g.astype(x.dtype), dw
