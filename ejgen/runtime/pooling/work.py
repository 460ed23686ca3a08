"""Work items of the pooling kernels: each sequence's rows cut into pieces of at most ``rows`` tokens, so that a
long sequence spreads over many programs and a short one takes one (Triton and the Pallas GPU kernels; one
program per item and block of columns). Items of a sequence are consecutive; the combine step sums (or takes the
max of) a sequence's items in their order, so results do not depend on how programs are scheduled.

Tables are NumPy constants where the ranges are (dense inputs without a mask), else jnp arrays."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def count(n_seqs: int, tokens: int, rows: int, lo=None, hi=None) -> int:
    """How many items a call has at most: exactly, where the ranges are static; else the bound
    sum(ceil(len / rows)) <= n_seqs + floor(tokens / rows) (which holds whatever the lengths)."""
    if isinstance(lo, np.ndarray) and isinstance(hi, np.ndarray):
        return max(int(np.sum(-(-np.maximum(hi - lo, 0) // rows))), 1)
    return n_seqs + tokens // rows


def _xp(*arrays):
    return np if all(isinstance(a, np.ndarray) for a in arrays) else jnp


def items(lo, hi, rows: int, n_items: int, with_seq: bool = False):
    """(items [n_items, 2] int32: each item's rows [start, end); first [N + 1] int32: sequence n owns the items
    first[n] .. first[n + 1] - 1; with ``with_seq`` also each item's sequence). Items past the last one are empty
    ([0, 0))."""
    xp = _xp(lo, hi)
    per_seq = (xp.maximum(hi - lo, 0) + rows - 1) // rows
    first = xp.concatenate([xp.zeros((1,), xp.int32), xp.cumsum(per_seq).astype(xp.int32)])
    i = xp.arange(n_items, dtype=xp.int32)
    seq = xp.minimum(xp.searchsorted(first[1:], i, side="right"), lo.shape[0] - 1).astype(xp.int32)
    start = lo[seq] + (i - first[seq]) * rows
    end = xp.minimum(start + rows, hi[seq])
    real = i < first[-1]
    table = xp.stack([xp.where(real, start, 0), xp.where(real, end, 0)], axis=1).astype(xp.int32)
    return (table, first, seq) if with_seq else (table, first)


def sequence_bounds(ctx: dict, cfg):
    """(starts [N], ends [N]) of the sequences themselves (the pooled ranges may be narrower: ``ranges``)."""
    if cfg.varlen:
        return ctx["cu"][:-1], ctx["cu"][1:]
    lo = np.arange(cfg.n_seqs, dtype=np.int32) * cfg.seq_len
    return lo, lo + cfg.seq_len


def partition_items(ctx: dict, cfg, rows: int, tokens: int):
    """Items that cover every token of [0, tokens) once (the backward's: each writes its rows of dx), as
    [n, 8] int32 rows (start, end, pooled_lo, pooled_hi, sequence, 0, 0, 0): the sequences cut into pieces of at
    most ``rows`` tokens, then the tokens past the last sequence (sequence 0, nothing pooled). Rows of
    [pooled_lo, pooled_hi) are those the sequence pools."""
    starts, ends = sequence_bounds(ctx, cfg)
    lo, hi = ranges(ctx, cfg)
    xp = _xp(starts, ends, lo, hi)
    seg_lo = xp.concatenate([starts, ends[-1:]]).astype(xp.int32)
    seg_hi = xp.concatenate([ends, xp.full((1,), tokens, xp.int32)]).astype(xp.int32)
    n_items = count(cfg.n_seqs + 1, tokens, rows, *((seg_lo, seg_hi) if xp is np else ()))
    table, _, seq = items(seg_lo, seg_hi, rows, n_items, with_seq=True)
    start, end = table[:, 0], table[:, 1]
    real = seq < cfg.n_seqs
    n = xp.where(real, seq, 0)
    p_lo = xp.where(real, xp.clip(xp.asarray(lo)[n], start, end), start)
    p_hi = xp.where(real, xp.clip(xp.asarray(hi)[n], p_lo, end), start)
    zero = xp.zeros_like(start)
    return xp.stack([start, end, p_lo, p_hi, n, zero, zero, zero], axis=1).astype(xp.int32)


def ranges(ctx: dict, cfg):
    """(lo [N], hi [N]): the rows each sequence pools; NumPy constants where the call has them static (dense
    inputs: whole sequences, or the last token of each)."""
    if "lo" in ctx:
        return ctx["lo"], ctx["hi"]
    lo = np.arange(cfg.n_seqs, dtype=np.int32) * cfg.seq_len
    hi = lo + cfg.seq_len
    return (hi - 1 if cfg.ranged else lo), hi


def token_sequences(ctx: dict, cfg):
    """Per token, the sequence it belongs to (-1 for tokens past the last sequence): varlen only (dense tokens
    belong to t // seq_len)."""
    cu = ctx["cu"]
    t = jnp.arange(cfg.tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)  # first n with cu[n + 1] > t
    return jnp.where(seq < cfg.n_seqs, seq, -1)


def per_token(v, ctx: dict, cfg):
    """v [N] read per token, by the sequence that holds it (0 for tokens past the last sequence)."""
    if cfg.varlen:
        seq = token_sequences(ctx, cfg)
        return jnp.where(seq >= 0, v[jnp.maximum(seq, 0)], 0.0)
    return jnp.repeat(v, cfg.seq_len, total_repeat_length=cfg.tokens)


def weights_grad(dots, dy, res: dict, ctx: dict, cfg):
    """The weights' gradient from the kernels' per-token dots (scale <dy, x_t> summed over the blocks of columns):
    for the mean, whose 1 / sum(w) depends on w too, less scale <dy, y> of the token's sequence."""
    if not cfg.scaled:
        return dots
    c = res["scale"] * jnp.sum(dy.astype(jnp.float32) * res["y32"], axis=1)
    return dots - per_token(c, ctx, cfg)
