"""`BlockMask`: which (query block, key block) tiles an attention kernel visits, and which of them need the
element mask (docs/DESIGN.md §3, "Block-sparse attention").

A block mask is the conjunction of *conditions* (causal, a sliding window, segment ids, a dense mask, a block
layout, a user's ``mask_fn``). Each condition knows its element rule (`visible`) and classifies every tile
of a given size as 0 = nothing visible (skip), 1 = partly visible (visit with the element mask) or 2 = every
valid element visible (visit without it); the conjunction of conditions is the minimum of their kinds.
From the kinds come the lists a kernel walks: for each (batch|1, head|1, query block) the partial and the full
key blocks in ascending order with their counts, and the transposed lists (query blocks per key block) for
the dK/dV pass. Structured conditions classify a tile from its corners or per-block min/max (O(blocks), no
Sq x Sk array); a dense mask is reduced per tile; a ``mask_fn`` is evaluated one query block at a time.

Positions follow §3 step 4: causal and window are bottom-right aligned (query ``i`` stands at
``i + kv_len - q_len``). Rows past ``q_len`` and columns past ``kv_len`` in the last tiles are not counted:
a tile is full when every *valid* element is visible (kernels bound-check the rest).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from ejgen.types.mask_info import MaskInfo

SKIP, PARTIAL, FULL = 0, 1, 2


def _static(**kw):
    return dataclasses.field(metadata=dict(static=True), **kw)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _tile_ranges(n: int, block: int):
    """First and last valid index of each tile of ``block`` over ``n`` elements (int32 [tiles])."""
    start = jnp.arange(_ceil(n, block), dtype=jnp.int32) * block
    return start, jnp.minimum(start + block, n) - 1


def _kinds(any_visible, all_visible):
    return jnp.where(all_visible, FULL, jnp.where(any_visible, PARTIAL, SKIP)).astype(jnp.int8)


def _reduced(x, nq: int, fq: int, nk: int, fk: int):
    """Kinds of groups of fq x fk entries of a bool ``x [..., R, C]`` (nq x nk groups): entries past R, C do not
    count (padded False for "any visible", True for "all visible")."""
    pad = [(0, 0)] * (x.ndim - 2) + [(0, nq * fq - x.shape[-2]), (0, nk * fk - x.shape[-1])]
    shape = x.shape[:-2] + (nq, fq, nk, fk)
    any_v = jnp.pad(x, pad, constant_values=False).reshape(shape).any(axis=(-3, -1))
    all_v = jnp.pad(x, pad, constant_values=True).reshape(shape).all(axis=(-3, -1))
    return _kinds(any_v, all_v)


def tile_bounds(x, block: int, keep):
    """Least and greatest entry of each tile of ``block`` along the last axis of int ``x [B, n]``, over the
    entries ``keep`` (bool, broadcast to x) marks (a tile with none: least > greatest)."""
    tiles = _ceil(x.shape[-1], block)
    pad = ((0, 0), (0, tiles * block - x.shape[-1]))
    keep = jnp.pad(jnp.broadcast_to(keep, x.shape), pad).reshape(x.shape[0], tiles, block)  # past the end: not kept
    x = jnp.pad(x, pad).reshape(x.shape[0], tiles, block)
    big = jnp.iinfo(jnp.int32).max
    return jnp.min(jnp.where(keep, x, big), axis=-1), jnp.max(jnp.where(keep, x, -big), axis=-1)


def band_kinds(q_lo, q_hi, kv_lo, kv_hi, left, right):
    """Kinds of tiles whose query positions span [q_lo, q_hi] and key positions [kv_lo, kv_hi] (broadcast against
    each other) under ``q - left <= kv <= q + right`` (a bound None: absent). The one rule of causal and windows,
    for index tiles (`Band`) and for explicit positions."""
    any_v = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_lo), jnp.shape(kv_lo)), bool)
    all_v = any_v
    if left is not None:  # kv >= q - left: for some pair of the tile; for every one
        any_v &= kv_hi >= q_lo - left
        all_v &= kv_lo >= q_hi - left
    if right is not None:  # kv <= q + right
        any_v &= kv_lo <= q_hi + right
        all_v &= kv_hi <= q_lo + right
    return _kinds(any_v, all_v)


def elements(cond, batch: int, heads: int, q_len: int, kv_len: int):
    """bool [batch, heads, q_len, kv_len]: a condition's element rule over every element (the Sq x Sk array the
    kernels avoid: for tests, small shapes, and rules with no tile form such as a ``mask_fn``)."""
    b = jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(heads, dtype=jnp.int32)[None, :, None, None]
    i = jnp.arange(q_len, dtype=jnp.int32)[None, None, :, None]
    j = jnp.arange(kv_len, dtype=jnp.int32)[None, None, None, :]
    return jnp.broadcast_to(cond.visible(b, h, i, j, q_len, kv_len), (batch, heads, q_len, kv_len))


# -- conditions --------------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Band:
    """Causal and / or a sliding window (left, right) as one diagonal band, bottom-right aligned: key ``j`` is
    visible to query ``i`` when ``i + off - left <= j <= i + off + right`` (off = kv_len - q_len; causal is
    right = 0; a missing bound is None)."""

    left: int | None = _static(default=None)
    right: int | None = _static(default=None)

    def visible(self, b, h, i, j, q_len, kv_len):
        off = kv_len - q_len
        ok = jnp.ones(jnp.broadcast_shapes(jnp.shape(i), jnp.shape(j)), bool)
        if self.left is not None:
            ok &= j >= i + off - self.left
        if self.right is not None:
            ok &= j <= i + off + self.right
        return ok

    def kinds(self, block_q, block_k, q_len, kv_len):
        i0, i1 = (x[:, None] + (kv_len - q_len) for x in _tile_ranges(q_len, block_q))  # aligned positions
        j0, j1 = (x[None, :] for x in _tile_ranges(kv_len, block_k))
        return band_kinds(i0, i1, j0, j1, self.left, self.right)[None, None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Segments:
    """Segment ids: query ``i`` sees key ``j`` when ``q_ids[b, i] == kv_ids[b, j] >= 0``. A tile is skipped when
    the id ranges of its rows and columns (padding left out) do not meet, full when both hold one id and no
    padding; otherwise partial (exact for contiguous documents, safe for any ids)."""

    q_ids: jax.Array  # int32 [B, Sq]
    kv_ids: jax.Array  # int32 [B, Sk]

    def visible(self, b, h, i, j, q_len, kv_len):
        qi = self.q_ids[b, i]
        kj = self.kv_ids[b, j]
        return (qi == kj) & (qi >= 0)

    @staticmethod
    def _per_tile(ids, block):
        """(least id, greatest id, any id, any padding) per tile; past the end is neither."""
        real = ids >= 0
        lo, hi = tile_bounds(ids, block, real)
        pad = _ceil(ids.shape[1], block) * block - ids.shape[1]
        has_pad = jnp.pad(~real, ((0, 0), (0, pad))).reshape(ids.shape[0], -1, block).any(axis=-1)
        return lo, hi, lo <= hi, has_pad

    def kinds(self, block_q, block_k, q_len, kv_len):
        qlo, qhi, qany, qpad = self._per_tile(self.q_ids, block_q)
        klo, khi, kany, kpad = self._per_tile(self.kv_ids, block_k)
        qlo, qhi, qany, qpad = (x[:, :, None] for x in (qlo, qhi, qany, qpad))
        klo, khi, kany, kpad = (x[:, None, :] for x in (klo, khi, kany, kpad))
        any_v = qany & kany & (qlo <= khi) & (klo <= qhi)
        all_v = any_v & ~qpad & ~kpad & (qlo == qhi) & (klo == khi) & (qlo == klo)
        return _kinds(any_v, all_v)[:, None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Dense:
    """A dense bool mask ``[B, 1|H, Sq, Sk]`` (True = visible), reduced per tile."""

    mask: jax.Array

    def visible(self, b, h, i, j, q_len, kv_len):
        return self.mask[b, jnp.minimum(h, self.mask.shape[1] - 1), i, j]

    def kinds(self, block_q, block_k, q_len, kv_len):
        return _reduced(self.mask, _ceil(q_len, block_q), block_q, _ceil(kv_len, block_k), block_k)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Layout:
    """A block layout ``bool [B|1, H|1, nQ, nK]`` over tiles of (block_q, block_k): a True tile is visible
    whole (the seed's ``qkv_layouts``: local + global, strided, BigBird-style patterns)."""

    layout: jax.Array
    block_q: int = _static()
    block_k: int = _static()

    def visible(self, b, h, i, j, q_len, kv_len):
        lay = self.layout
        return lay[jnp.minimum(b, lay.shape[0] - 1), jnp.minimum(h, lay.shape[1] - 1), i // self.block_q,
                   j // self.block_k]

    def kinds(self, block_q, block_k, q_len, kv_len):
        lay, (lq, lk) = self.layout, (self.block_q, self.block_k)
        nq, nk = _ceil(q_len, block_q), _ceil(kv_len, block_k)
        if lq % block_q == 0 and lk % block_k == 0:  # tiles inside the layout's blocks: each takes its block's
            rows = jnp.minimum(jnp.arange(nq) * block_q // lq, lay.shape[2] - 1)
            cols = jnp.minimum(jnp.arange(nk) * block_k // lk, lay.shape[3] - 1)
            return jnp.where(lay[:, :, rows][:, :, :, cols], FULL, SKIP).astype(jnp.int8)
        if block_q % lq == 0 and block_k % lk == 0:  # tiles made of whole blocks: reduce them
            return _reduced(lay, nq, block_q // lq, nk, block_k // lk)
        # other tiles: expand the layout to elements one query tile at a time
        return _kinds_by_rows(self, lay.shape[0], lay.shape[1], block_q, block_k, q_len, kv_len)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Function:
    """A user's ``mask_fn(b, h, q_idx, kv_idx) -> bool`` (broadcasting jnp code, as FlexAttention's mask_mod),
    over ``batch`` x ``heads`` (1 where it does not depend on them), evaluated one query tile at a time."""

    fn: Callable = _static()
    batch: int = _static(default=1)
    heads: int = _static(default=1)

    def visible(self, b, h, i, j, q_len, kv_len):
        return jnp.asarray(self.fn(b, h, i, j), bool)

    def kinds(self, block_q, block_k, q_len, kv_len):
        return _kinds_by_rows(self, self.batch, self.heads, block_q, block_k, q_len, kv_len)


def _kinds_by_rows(cond, batch, heads, block_q, block_k, q_len, kv_len):
    """A condition's kinds from its element rule, one query tile ([B, H, block_q, Sk] elements) at a time."""
    nq, nk = _ceil(q_len, block_q), _ceil(kv_len, block_k)
    b = jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(heads, dtype=jnp.int32)[None, :, None, None]
    j = jnp.arange(nk * block_k, dtype=jnp.int32)[None, None, None, :]

    def row(iq):
        i = iq * block_q + jnp.arange(block_q, dtype=jnp.int32)[None, None, :, None]
        inside = (i < q_len) & (j < kv_len)
        vis = jnp.broadcast_to(cond.visible(b, h, jnp.minimum(i, q_len - 1), jnp.minimum(j, kv_len - 1),
                                            q_len, kv_len), (batch, heads, block_q, nk * block_k))
        shape = (batch, heads, block_q, nk, block_k)
        any_v = (vis & inside).reshape(shape).any(axis=(2, 4))
        all_v = (vis | ~inside).reshape(shape).all(axis=(2, 4))
        return _kinds(any_v, all_v)

    return jnp.moveaxis(lax.map(row, jnp.arange(nq)), 0, 2)


def tile_ranges(kinds, longest: bool = True) -> jax.Array:
    """int32 [..., n, 4] from tile kinds [..., n, m]: for each tile of the first axis, ``(lo, hi, full_lo,
    full_hi)`` over the second: every visited tile lies in [lo, hi) (skipped tiles inside it are visited with the
    element mask, which excludes them), and [full_lo, full_hi) is a run of full tiles (nothing visited: all four
    equal): the longest one, or with ``longest=False`` the first, which takes a few reductions where the longest
    takes a scan (packed documents have one run per tile: the same run, at a fraction of the device time; Gluon's
    per-call ranges). The contiguous view kernels that loop over a range take: exact for causal, windows and
    packed documents, a superset for scattered tiles."""
    kinds = jnp.asarray(kinds)
    m = kinds.shape[-1]
    j = jnp.arange(m, dtype=jnp.int32)
    visited = kinds != SKIP
    full = kinds == FULL
    if not longest:
        lo = jnp.min(jnp.where(visited, j, m), axis=-1)
        hi = jnp.max(jnp.where(visited, j + 1, 0), axis=-1)
        lo = jnp.where(hi > 0, lo, 0)
        flo = jnp.min(jnp.where(full, j, m), axis=-1)  # the first full tile (m: none)
        fhi = jnp.min(jnp.where(~full & (j > flo[..., None]), j, m), axis=-1)  # where its run ends
        none = flo >= m
        return jnp.stack([lo, hi, jnp.where(none, lo, flo), jnp.where(none, lo, fhi)], axis=-1).astype(jnp.int32)
    any_v = jnp.any(visited, axis=-1)
    lo = jnp.where(any_v, jnp.argmax(visited, axis=-1), 0).astype(jnp.int32)
    hi = jnp.where(any_v, m - jnp.argmax(visited[..., ::-1], axis=-1), 0).astype(jnp.int32)
    last_break = lax.cummax(jnp.where(full, -1, j), axis=kinds.ndim - 1)  # the latest non-full tile at or before j
    run = jnp.where(full, j - last_break, 0)  # length of the full run ending at j
    end = jnp.argmax(run, axis=-1).astype(jnp.int32)
    length = jnp.max(run, axis=-1).astype(jnp.int32)
    flo = jnp.where(length > 0, end - length + 1, lo)
    fhi = jnp.where(length > 0, end + 1, lo)
    return jnp.stack([lo, hi, flo, fhi], axis=-1)


def tile_lists(kinds) -> jax.Array:
    """int32 [..., n, 2 + m] from tile kinds [..., n, m]: for each tile of the first axis, the number of partial
    and of full tiles over the second, then their indices, partial ones first, each group ascending (the rest:
    the skipped tiles, never read). What kernels that walk lists take."""
    kinds = jnp.asarray(kinds)
    group = jnp.where(kinds == PARTIAL, 0, jnp.where(kinds == FULL, 1, 2))
    order = jnp.argsort(group, axis=-1, stable=True).astype(jnp.int32)
    counts = jnp.stack([jnp.sum(kinds == PARTIAL, axis=-1), jnp.sum(kinds == FULL, axis=-1)], axis=-1)
    return jnp.concatenate([counts.astype(jnp.int32), order], axis=-1)


# -- the block mask ----------------------------------------------------------------------------------------
def _lists(kinds):
    """(partial count, partial indices, full count, full indices) along the last axis: indices ascending,
    the listed ones first (entries past the count are the other blocks, never read)."""
    partial, full = kinds == PARTIAL, kinds == FULL
    order = lambda sel: jnp.argsort(~sel, axis=-1, stable=True).astype(jnp.int32)  # noqa: E731
    count = lambda sel: jnp.sum(sel, axis=-1, dtype=jnp.int32)  # noqa: E731
    return count(partial), order(partial), count(full), order(full)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockMask:
    """The tiles an attention kernel visits, for tiles of ``block_q`` query rows and ``block_k`` keys over
    ``q_len`` x ``kv_len``. A pytree (arrays traced under ``jit``; sizes static). Build it with the
    constructors below and combine with ``&``; a kernel walks the lists, and applies the element rule of
    ``conditions`` on partial tiles only."""

    kv_count: jax.Array  # int32 [B|1, H|1, nQ]: partial key blocks of each query block
    kv_indices: jax.Array  # int32 [B|1, H|1, nQ, nK]: their indices, ascending (first kv_count)
    full_kv_count: jax.Array  # int32 [B|1, H|1, nQ]: full key blocks
    full_kv_indices: jax.Array  # int32 [B|1, H|1, nQ, nK]
    q_count: jax.Array  # int32 [B|1, H|1, nK]: partial query blocks of each key block (the dK/dV pass)
    q_indices: jax.Array  # int32 [B|1, H|1, nK, nQ]
    full_q_count: jax.Array  # int32 [B|1, H|1, nK]
    full_q_indices: jax.Array  # int32 [B|1, H|1, nK, nQ]
    conditions: tuple  # the element rules, all of which must hold (Band, Segments, Dense, Layout, Function)
    block_q: int = _static()
    block_k: int = _static()
    q_len: int = _static()
    kv_len: int = _static()

    # -- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_conditions(cls, conditions, q_len: int, kv_len: int, block_q: int = 128,
                        block_k: int = 128) -> "BlockMask":
        """The conjunction of ``conditions`` at tiles of (block_q, block_k)."""
        for name, value in (("q_len", q_len), ("kv_len", kv_len), ("block_q", block_q), ("block_k", block_k)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BlockMask: {name} must be a positive Python int, got {value!r}")
        conditions = tuple(conditions)
        kinds = jnp.full((1, 1, _ceil(q_len, block_q), _ceil(kv_len, block_k)), FULL, jnp.int8)
        for cond in conditions:
            kinds = jnp.minimum(kinds, cond.kinds(block_q, block_k, q_len, kv_len))
        return cls.from_kinds(kinds, conditions, q_len, kv_len, block_q, block_k)

    @classmethod
    def from_kinds(cls, kinds, conditions, q_len, kv_len, block_q, block_k) -> "BlockMask":
        """From tile kinds ``int [B|1, H|1, nQ, nK]`` (0 skip, 1 partial, 2 full) and the element rules they
        were derived from."""
        kinds = jnp.asarray(kinds, jnp.int8)
        expected = (_ceil(q_len, block_q), _ceil(kv_len, block_k))
        if kinds.ndim != 4 or kinds.shape[2:] != expected:
            raise ValueError(f"BlockMask: kinds must be [B|1, H|1, {expected[0]}, {expected[1]}], got {list(kinds.shape)}")
        return cls(*_lists(kinds), *_lists(jnp.swapaxes(kinds, -1, -2)), conditions=tuple(conditions),
                   block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len)

    @classmethod
    def causal(cls, q_len: int, kv_len: int, block_q: int = 128, block_k: int = 128, *,
               sliding_window=None) -> "BlockMask":
        """Causal (bottom-right aligned), with a sliding window ``w`` or ``(left, right)`` if given (with causal
        the right bound is causal's)."""
        left = None if sliding_window is None else _window(sliding_window)[0]
        return cls.from_conditions((Band(left, 0),), q_len, kv_len, block_q, block_k)

    @classmethod
    def sliding_window(cls, q_len: int, kv_len: int, window, block_q: int = 128, block_k: int = 128) -> "BlockMask":
        """A sliding window ``w`` (= ``(w, w)``) or ``(left, right)``, bottom-right aligned."""
        left, right = _window(window)
        return cls.from_conditions((Band(left, right),), q_len, kv_len, block_q, block_k)

    @classmethod
    def from_segments(cls, q_segment_ids, kv_segment_ids=None, block_q: int = 128, block_k: int = 128) -> "BlockMask":
        """Segment ids (packed documents; negative = padding), as ``MaskInfo.from_segments``."""
        info = MaskInfo.from_segments(q_segment_ids, kv_segment_ids)
        return cls.from_mask_info(info, block_q, block_k)

    @classmethod
    def from_dense(cls, mask, block_q: int = 128, block_k: int = 128) -> "BlockMask":
        """A dense bool mask ``[B, Sq, Sk]`` or ``[B, 1|H, Sq, Sk]``, as ``MaskInfo.from_attention_mask``."""
        return cls.from_mask_info(MaskInfo.from_attention_mask(mask), block_q, block_k)

    @classmethod
    def from_mask_info(cls, info: MaskInfo, block_q: int = 128, block_k: int = 128) -> "BlockMask":
        """The block mask of a `MaskInfo` (segment ids or a dense mask); ``to_mask_info`` gives it back."""
        if not isinstance(info, MaskInfo):
            raise ValueError(f"BlockMask.from_mask_info: want an ejgen.types.MaskInfo, got {type(info).__name__}")
        conditions = []
        if info.has_segments:
            conditions.append(Segments(info.q_segment_ids, info.kv_segment_ids))
            q_len, kv_len = info.q_segment_ids.shape[1], info.kv_segment_ids.shape[1]
        if info.has_mask:
            conditions.append(Dense(info.attention_mask))
            q_len, kv_len = info.attention_mask.shape[2:]
        if not conditions:
            raise ValueError("BlockMask.from_mask_info: the MaskInfo holds neither segment ids nor a mask")
        return cls.from_conditions(conditions, int(q_len), int(kv_len), block_q, block_k)

    @classmethod
    def from_layout(cls, layout, q_len: int, kv_len: int, block_q: int = 128, block_k: int = 128) -> "BlockMask":
        """An explicit block layout ``bool [B|1, H|1, nQ, nK]`` (or ``[nQ, nK]``): True tiles are visible whole."""
        layout = jnp.asarray(layout)
        if layout.dtype != jnp.bool_:
            raise ValueError(f"BlockMask.from_layout: layout must be bool, got {layout.dtype}")
        if layout.ndim == 2:
            layout = layout[None, None]
        expected = (_ceil(q_len, block_q), _ceil(kv_len, block_k))
        if layout.ndim != 4 or layout.shape[2:] != expected:
            raise ValueError(f"BlockMask.from_layout: layout must be [B|1, H|1, {expected[0]}, {expected[1]}] for "
                             f"q_len {q_len}, kv_len {kv_len} in tiles of {block_q} x {block_k}, got {list(layout.shape)}")
        return cls.from_conditions((Layout(layout, block_q, block_k),), q_len, kv_len, block_q, block_k)

    @classmethod
    def from_mask_fn(cls, mask_fn: Callable, q_len: int, kv_len: int, block_q: int = 128, block_k: int = 128, *,
                     batch: int = 1, heads: int = 1) -> "BlockMask":
        """A user's ``mask_fn(b, h, q_idx, kv_idx) -> bool`` (broadcasting jnp code), over ``batch`` x ``heads``
        (leave them 1 where the function does not read ``b`` / ``h``), evaluated one query tile at a time."""
        if not callable(mask_fn):
            raise ValueError(f"BlockMask.from_mask_fn: mask_fn must be callable, got {type(mask_fn).__name__}")
        return cls.from_conditions((Function(mask_fn, batch, heads),), q_len, kv_len, block_q, block_k)

    # -- combination and views ----------------------------------------------------------------------------
    def __and__(self, other: "BlockMask") -> "BlockMask":
        """Both masks' conditions (tiles: this mask's)."""
        if not isinstance(other, BlockMask):
            return NotImplemented
        if (self.q_len, self.kv_len) != (other.q_len, other.kv_len):
            raise ValueError(f"BlockMask &: lengths differ ({self.q_len} x {self.kv_len} vs "
                             f"{other.q_len} x {other.kv_len})")
        return BlockMask.from_conditions(self.conditions + other.conditions, self.q_len, self.kv_len,
                                         self.block_q, self.block_k)

    def __or__(self, other):
        raise TypeError("BlockMask |: a union is not a conjunction of conditions; write it as one mask_fn "
                        "(BlockMask.from_mask_fn(lambda b, h, q, k: f(b, h, q, k) | g(b, h, q, k), ...)) or as a "
                        "block layout (BlockMask.from_layout(layout_a | layout_b, ...))")

    def retile(self, block_q: int, block_k: int) -> "BlockMask":
        """The same mask for another kernel's tiles (exact: rebuilt from the conditions)."""
        return BlockMask.from_conditions(self.conditions, self.q_len, self.kv_len, block_q, block_k)

    def kinds(self) -> jax.Array:
        """int8 [B|1, H|1, nQ, nK]: 0 skip, 1 partial, 2 full (from the lists)."""
        n_k = self.kv_indices.shape[-1]
        slots = jnp.arange(n_k, dtype=jnp.int32)

        def mark(count, indices):
            listed = slots < count[..., None]
            hit = jnp.zeros(indices.shape, bool)
            return jnp.put_along_axis(hit, indices, listed, axis=-1, inplace=False)

        partial = mark(self.kv_count, self.kv_indices)
        full = mark(self.full_kv_count, self.full_kv_indices)
        return jnp.where(full, FULL, jnp.where(partial, PARTIAL, SKIP)).astype(jnp.int8)

    def to_mask_info(self) -> MaskInfo:
        """The `MaskInfo` this mask was built from (segment ids or a dense mask); ValueError otherwise."""
        segments = [c for c in self.conditions if isinstance(c, Segments)]
        dense = [c for c in self.conditions if isinstance(c, Dense)]
        if len(self.conditions) != len(segments) + len(dense) or len(segments) > 1 or len(dense) > 1 or not self.conditions:
            raise ValueError("BlockMask.to_mask_info: only a mask built from one MaskInfo (segment ids and / or a "
                             "dense mask) converts back")
        return MaskInfo(q_segment_ids=segments[0].q_ids if segments else None,
                        kv_segment_ids=segments[0].kv_ids if segments else None,
                        attention_mask=dense[0].mask if dense else None)

    def dense(self, batch: int = 1, heads: int = 1) -> jax.Array:
        """bool [batch, heads, q_len, kv_len]: what the mask lets through, element by element (for tests and
        small shapes: this is the Sq x Sk array the kernels never build)."""
        b = jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]
        h = jnp.arange(heads, dtype=jnp.int32)[None, :, None, None]
        i = jnp.arange(self.q_len, dtype=jnp.int32)[None, None, :, None]
        j = jnp.arange(self.kv_len, dtype=jnp.int32)[None, None, None, :]
        kinds = self.kinds()
        kinds = kinds[jnp.minimum(b, kinds.shape[0] - 1), jnp.minimum(h, kinds.shape[1] - 1),
                      i // self.block_q, j // self.block_k]
        element = jnp.ones((batch, heads, self.q_len, self.kv_len), bool)
        for cond in self.conditions:
            element &= elements(cond, batch, heads, self.q_len, self.kv_len)
        return (kinds == FULL) | ((kinds == PARTIAL) & element)


def _window(window) -> tuple:
    if isinstance(window, int) and not isinstance(window, bool):
        window = (window, window)
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in window)):
        raise ValueError(f"BlockMask: sliding_window must be a non-negative int or a (left, right) pair, got {window!r}")
    return tuple(window)
