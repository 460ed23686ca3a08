"""Interval arithmetic over tiles: the spec's mask evaluated once per (query tile, key tile) instead of per element
(docs/DESIGN.md §3 block masks, "tiles of a spec's mask"). The generated `mask_tiles` functions call these.

A number is an interval ``(lo, hi)`` of arrays that broadcast against each other (a tile's least and greatest
value); a condition is a pair ``(may, must)``: true for some element of the tile, true for all of them. Every
operation is sound: the interval holds every value the element-wise expression takes on the tile, so a tile
whose ``may`` is false holds no visible pair and one whose ``must`` is true needs no element mask. Precision
is lost, never soundness: what cannot be bounded here (a transcendental function, a product that could
overflow) is ``top``, the whole range, and its conditions are "maybe".

Ints are int32 within ``[-BIG, BIG]``: ``BIG`` stands for "unbounded" and absorbs (a sum with an unbounded term
is unbounded; values past it, from params or options, are read as unbounded: a wider interval, still sound).
Floats are float32 with infinities; only operations whose rounding is monotone (``+ - *``, ``/`` away from
zero, min, max, abs, comparisons, conversions) keep bounds: the corner values are the element values the
kernels compute at the corners, so the bounds hold for the rounded results too.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

BIG = 2**30 - 1  # two bounds add without overflowing int32


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x[0]), jnp.floating)


def _int(x):
    return jnp.clip(jnp.asarray(x, jnp.int32), -BIG, BIG)


def point(x):
    """A value known exactly (an option, a batch row or head, a constant)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        return x, x
    x = x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else _int(x)
    return x, x


def span(lo, hi):
    """An int interval from its bounds (a tile's first and last index)."""
    return _int(lo), _int(hi)


def top(like_float: bool = False):
    if like_float:
        return jnp.float32(-jnp.inf), jnp.float32(jnp.inf)
    return jnp.int32(-BIG), jnp.int32(BIG)




def _unbounded(x):
    lo, hi = x
    if _is_float(x):
        return jnp.isinf(lo) | jnp.isinf(hi)
    return (lo <= -BIG) | (hi >= BIG)


def _float(x):
    return x[0].astype(jnp.float32), x[1].astype(jnp.float32)


def _promote(x, y):
    if _is_float(x) or _is_float(y):
        return _float(x), _float(y)
    return x, y


# numbers


def add(x, y):
    x, y = _promote(x, y)
    if _is_float(x):  # inf + -inf (an unbounded side and an infinite param entry): unbounded, not NaN
        lo, hi = x[0] + y[0], x[1] + y[1]
        return jnp.where(jnp.isnan(lo), -jnp.inf, lo), jnp.where(jnp.isnan(hi), jnp.inf, hi)
    lo = jnp.where((x[0] <= -BIG) | (y[0] <= -BIG), -BIG, jnp.clip(x[0] + y[0], -BIG, BIG))
    hi = jnp.where((x[1] >= BIG) | (y[1] >= BIG), BIG, jnp.clip(x[1] + y[1], -BIG, BIG))
    return lo, hi


def neg(x):
    return -x[1], -x[0]


def sub(x, y):
    return add(x, neg(y))


def mul(x, y):
    x, y = _promote(x, y)
    if _is_float(x):
        corners = [a * b for a in x for b in y]
        lo, hi = _hull(corners)
        unknown = jnp.isnan(lo) | jnp.isnan(hi)  # inf * 0
        return jnp.where(unknown, -jnp.inf, lo), jnp.where(unknown, jnp.inf, hi)
    fits = ~(_unbounded(x) | _unbounded(y))
    for a in x:
        for b in y:
            fits &= jnp.abs(a.astype(jnp.float32) * b.astype(jnp.float32)) < BIG / 2
    lo, hi = _hull([a * b for a in x for b in y])  # exact where `fits`
    return jnp.where(fits, lo, -BIG), jnp.where(fits, hi, BIG)


def _hull(corners):
    """Least and greatest of four corner values (NaN propagates: the callers turn it into unbounded)."""
    return (jnp.minimum(jnp.minimum(corners[0], corners[1]), jnp.minimum(corners[2], corners[3])),
            jnp.maximum(jnp.maximum(corners[0], corners[1]), jnp.maximum(corners[2], corners[3])))


def truediv(x, y):
    """``x / y`` (floats): bounded where y keeps one sign."""
    x, y = _float(x), _float(y)
    safe = (y[0] > 0) | (y[1] < 0)
    lo, hi = _hull([a / jnp.where(safe, b, 1.0) for a in x for b in y])
    safe &= ~(jnp.isnan(lo) | jnp.isnan(hi))  # inf / inf
    return jnp.where(safe, lo, -jnp.inf), jnp.where(safe, hi, jnp.inf)


def floordiv(x, y):
    """``x // y`` on ints, Python's floor and ``x // 0 == 0`` (docs/DESIGN.md §2)."""
    one_sign = ((y[0] > 0) | (y[1] < 0)) & ~_unbounded(x) & ~_unbounded(y)
    d = [jnp.where(one_sign, b, 1) for b in y]
    lo, hi = _hull([a // b for a in x for b in d])
    zero = (y[0] == 0) & (y[1] == 0)
    lo = jnp.where(one_sign, lo, jnp.where(zero, 0, -BIG))
    hi = jnp.where(one_sign, hi, jnp.where(zero, 0, BIG))
    return lo, hi


def mod(x, y):
    """``x % y`` on ints, the divisor's sign and ``x % 0 == x``: within one quotient of a fixed divisor the
    remainder grows with x; else any remainder of the divisor's sign."""
    fixed = (y[0] == y[1]) & (y[0] != 0) & ~_unbounded(x) & ~_unbounded(y)
    d = jnp.where(fixed, y[0], 1)
    same = fixed & (x[0] // d == x[1] // d)
    lo = jnp.where(same, x[0] % d, jnp.where(y[0] > 0, 0, jnp.where(y[1] < 0, y[0] + 1, -BIG)))
    hi = jnp.where(same, x[1] % d, jnp.where(y[0] > 0, y[1] - 1, jnp.where(y[1] < 0, 0, BIG)))
    zero = (y[0] == 0) & (y[1] == 0)
    return jnp.where(zero, x[0], lo), jnp.where(zero, x[1], hi)


def abs_(x):
    lo, hi = x
    return (jnp.where(lo >= 0, lo, jnp.where(hi <= 0, -hi, 0 * lo)),
            jnp.where(lo >= 0, hi, jnp.where(hi <= 0, -lo, jnp.maximum(-lo, hi))))


def sign(x):
    return jnp.sign(x[0]), jnp.sign(x[1])


def minimum(x, y):
    x, y = _promote(x, y)
    return jnp.minimum(x[0], y[0]), jnp.minimum(x[1], y[1])


def maximum(x, y):
    x, y = _promote(x, y)
    return jnp.maximum(x[0], y[0]), jnp.maximum(x[1], y[1])


def clamp(x, lo, hi):
    return minimum(maximum(x, lo), hi)


def to_float(x):
    return _float(x)


def to_int(fn: str, x):
    """``floor``, ``ceil``, ``round`` or ``int`` of a float interval: each is monotone."""
    if not _is_float(x):
        return x
    f = {"floor": jnp.floor, "ceil": jnp.ceil, "round": jnp.round, "int": jnp.trunc}[fn]
    lo, hi = f(x[0]), f(x[1])
    return (jnp.where(lo <= -BIG, -BIG, jnp.clip(lo, -BIG, BIG)).astype(jnp.int32),
            jnp.where(hi >= BIG, BIG, jnp.clip(hi, -BIG, BIG)).astype(jnp.int32))


def where(c, x, y):
    x, y = _promote(x, y)
    may, must = c
    return (jnp.where(must, x[0], jnp.where(may, jnp.minimum(x[0], y[0]), y[0])),
            jnp.where(must, x[1], jnp.where(may, jnp.maximum(x[1], y[1]), y[1])))


# conditions


def lt(x, y):
    """Sound for saturated ints too: two values past BIG read as BIG may still differ."""
    x, y = _promote(x, y)
    return (x[0] < y[1]) | ((x[0] == y[1]) & (jnp.abs(x[0]) >= BIG)), x[1] < y[0]


def le(x, y):
    x, y = _promote(x, y)
    return x[0] <= y[1], (x[1] < y[0]) | ((x[1] == y[0]) & (jnp.abs(x[1]) < BIG))


def gt(x, y):
    return lt(y, x)


def ge(x, y):
    return le(y, x)


def eq(x, y):
    x, y = _promote(x, y)
    may = (x[0] <= y[1]) & (y[0] <= x[1])
    must = (x[0] == x[1]) & (y[0] == y[1]) & (x[0] == y[0]) & ~_unbounded(x)
    return may, must


def ne(x, y):
    return not_(eq(x, y))


def and_(x, y):
    return x[0] & y[0], x[1] & y[1]


def or_(x, y):
    return x[0] | y[0], x[1] | y[1]


def not_(x):
    return ~x[1], ~x[0]


def cond_eq(x, y):
    """``==`` of two conditions."""
    return or_(and_(x, y), and_(not_(x), not_(y)))


# params


def read(param, indices, ranged=(), block=None):
    """``param[i0, i1, ...]`` (each index clamped into its dim, docs/DESIGN.md §2) over index intervals; ``ranged``
    names the axes whose index depends on a position (the others are one value per tile: b, h, options). No
    ranged axis: exact. One: the least and greatest entry over the index's span — where that index is a tile's
    own (``q_idx`` or ``kv_idx`` itself, ``block`` its tile size) by one reduction per tile, else from a sparse
    table of minima and maxima along that axis (two lookups per tile). More: the whole param's least and
    greatest."""
    param = jnp.asarray(param)
    boolean = param.dtype == jnp.bool_
    if boolean:
        param = param.astype(jnp.int32)
    param = param.astype(jnp.float32) if jnp.issubdtype(param.dtype, jnp.floating) else _int(param)
    idx = [(jnp.clip(lo, 0, n - 1), jnp.clip(hi, 0, n - 1)) for (lo, hi), n in zip(indices, param.shape)]
    if not ranged:
        value = param[tuple(lo for lo, _ in idx)]
        out = value, value
    elif len(ranged) == 1 and block is not None:
        out = _tile_read(param, idx, ranged[0], indices[ranged[0]][0], block)
    elif len(ranged) == 1:
        out = _range_read(param, idx, ranged[0])
    else:
        out = jnp.min(param), jnp.max(param)
    if boolean:
        return out[1] > 0, out[0] > 0
    return out


def _tile_read(param, idx, axis, first, block: int):
    """Least and greatest of ``param`` over whole tiles of ``block`` entries along ``axis`` (entries past its end
    read as its last: the clamp), at the tiles starting at ``first`` (an array holding one tile per entry)."""
    n, n_tiles = param.shape[axis], first.size
    size = n_tiles * block
    if size > n:
        pad = [(0, 0)] * param.ndim
        pad[axis] = (0, size - n)
        param = jnp.pad(param, pad, mode="edge")
    else:
        param = lax.slice_in_dim(param, 0, size, axis=axis)
    tiled = param.reshape(param.shape[:axis] + (n_tiles, block) + param.shape[axis + 1:])
    where = [lo for lo, _ in idx]
    where[axis] = first // block
    return jnp.min(tiled, axis=axis + 1)[tuple(where)], jnp.max(tiled, axis=axis + 1)[tuple(where)]


def _range_read(param, idx, axis):
    """Least and greatest of ``param`` over ``idx[axis]``'s span, the other indices single values: a sparse table
    (level j: the least / greatest of the 2**j entries from each position, clamped at the end; a shifted copy per
    level) and, per tile, two lookups at the level that covers its span with two windows."""
    n = param.shape[axis]
    lows, highs = [param], [param]
    width = 1
    while 2 * width <= n:
        lows.append(jnp.minimum(lows[-1], _ahead(lows[-1], width, axis)))
        highs.append(jnp.maximum(highs[-1], _ahead(highs[-1], width, axis)))
        width *= 2
    lows, highs = jnp.stack(lows), jnp.stack(highs)
    lo, hi = idx[axis]
    hi = jnp.maximum(hi, lo)
    level = 31 - lax.clz(hi - lo + 1)  # floor(log2(length))
    second = hi - jnp.left_shift(1, level) + 1
    others = [first for first, _ in idx]

    def at(table, start):
        where = list(others)
        where[axis] = start
        return table[(level,) + tuple(where)]

    return jnp.minimum(at(lows, lo), at(lows, second)), jnp.maximum(at(highs, lo), at(highs, second))


def _ahead(x, width: int, axis: int):
    """``x`` shifted ``width`` entries back along ``axis``, the last entry repeated past the end."""
    n = x.shape[axis]
    rest = lax.slice_in_dim(x, width, n, axis=axis)
    last = lax.slice_in_dim(x, n - 1, n, axis=axis)
    return jnp.concatenate([rest] + [last] * 1, axis=axis) if width == 1 else jnp.concatenate(
        [rest, jnp.repeat(last, width, axis=axis)], axis=axis)


def kinds(cond):
    """int8 tile kinds of a condition: 0 skip (no element can be true), 1 partial, 2 full."""
    may, must = cond
    return jnp.where(must, 2, jnp.where(may, 1, 0)).astype(jnp.int8)


class Tiles(NamedTuple):
    """The index intervals of every (batch row, query head, query tile, key tile), broadcasting to [B, Hq, nQ, nK]."""

    b: tuple
    h: tuple
    q_idx: tuple
    kv_idx: tuple
    q_len: tuple
    kv_len: tuple
    q_block: int | None = None  # the tile sizes, where q_idx / kv_idx span whole tiles (not explicit positions)
    kv_block: int | None = None


def tiles(batch: int, heads: int, block_q: int, block_k: int, sq: int, sk: int, q_pos=None, kv_pos=None) -> Tiles:
    """Tiles of ``block_q`` queries by ``block_k`` keys over ``sq`` x ``sk``; with explicit positions (int [B|1, S]),
    each tile's least and greatest position instead of its first and last index."""

    def spans(pos, block, n, axis):
        if pos is None:
            first = jnp.arange(-(-n // block), dtype=jnp.int32) * block
            lo, hi = first, jnp.minimum(first + block, n) - 1
        else:
            from ejgen.types.block_mask import tile_bounds

            lo, hi = tile_bounds(pos[:, :n], block, True)  # [B|1, tiles]
        shape = [1, 1, 1, 1]
        shape[axis] = lo.shape[-1]
        if lo.ndim == 2:
            shape[0] = lo.shape[0]
        return span(lo.reshape(shape), hi.reshape(shape))

    return Tiles(
        b=point(jnp.arange(batch, dtype=jnp.int32).reshape(batch, 1, 1, 1)),
        h=point(jnp.arange(heads, dtype=jnp.int32).reshape(1, heads, 1, 1)),
        q_idx=spans(q_pos, block_q, sq, 2),
        kv_idx=spans(kv_pos, block_k, sk, 3),
        q_len=point(sq),
        kv_len=point(sk),
        q_block=block_q if q_pos is None else None,
        kv_block=block_k if kv_pos is None else None,
    )
