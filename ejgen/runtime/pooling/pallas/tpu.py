"""The Pallas pooling kernels for TPUs (Mosaic). Tokens come in blocks of ``chunk_size`` rows (rounded up to the
sublane tile: 8 rows of 32-bit x, 16 of 16-bit) and D in blocks of 128 lanes times a power of two (or whole).

Work is a list of (segment, row block) items, scalar-prefetched, in order: a segment is a sequence's pooled range
(forward) or a piece of the tokens' partition (backward: the sequences, then the tokens past them). Consecutive
items revisit the same output block — the forward's by segment, the backward's by row block — so each block
accumulates in VMEM and is written back once, in a fixed order: deterministic. The grid is (column blocks,
items): the first parallel, the second in order.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ejgen.runtime.core import vma
from ejgen.runtime.pooling import work
from ejgen.runtime.pooling.pallas.gpu import NO_TOKEN, _column_best, _pick

F32 = jnp.float32
MAX_BLOCK_D = 512


@dataclasses.dataclass(frozen=True)
class TpuTiles:
    rows: int  # tokens of a block: chunk_size, at least the sublane tile
    block_d: int  # lanes of a block: whole D, or 128 times a power of two dividing D


def tiles(cfg, itemsize: int) -> TpuTiles:
    rows = max(cfg.chunk, 8 * 4 // itemsize)
    block_d = cfg.dim
    if cfg.dim > MAX_BLOCK_D and cfg.dim % 128 == 0:
        block_d = MAX_BLOCK_D
        while cfg.dim % block_d:
            block_d //= 2
    return TpuTiles(rows, block_d)


def block_items(seg_lo, seg_hi, rows: int, tokens: int):
    """[n, 4] int32 items (segment, row block, first row, end row) of the segments [seg_lo, seg_hi) (in order,
    disjoint) cut at the row blocks; padding items repeat the last real one with no rows."""
    xp = np if all(isinstance(a, np.ndarray) for a in (seg_lo, seg_hi)) else jnp
    some = seg_hi > seg_lo
    b0 = seg_lo // rows
    per_seg = xp.where(some, (seg_hi - 1) // rows - b0 + 1, 0)
    first = xp.concatenate([xp.zeros((1,), xp.int32), xp.cumsum(per_seg).astype(xp.int32)])
    if xp is np:
        n_items = max(int(first[-1]), 1)
    else:
        n_items = -(-tokens // rows) + 2 * seg_lo.shape[0]
    i = xp.arange(n_items, dtype=xp.int32)
    last = xp.maximum(first[-1] - 1, 0)
    real = i < first[-1]
    i = xp.minimum(i, last)
    seg = xp.minimum(xp.searchsorted(first[1:], i, side="right"), seg_lo.shape[0] - 1).astype(xp.int32)
    r = b0[seg] + (i - first[seg])
    start = xp.maximum(seg_lo[seg], r * rows)
    end = xp.minimum(seg_hi[seg], (r + 1) * rows)
    end = xp.where(real & (first[-1] > 0), end, start)
    return xp.stack([seg, r, start, end], axis=1).astype(xp.int32)


def _compiler_params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))


def _opens(tbl, i, key: int):
    """Whether item i is the first of its output block: entry ``key`` (0: segment, 1: row block) differs from the
    previous item's."""
    prev = jnp.maximum(i - 1, 0)
    return jnp.logical_or(i == 0, tbl[4 * prev + key] != tbl[4 * i + key])


def _fwd_kernel(tbl, x_ref, *refs, kind, weighted, t: TpuTiles):
    w_ref = refs[0] if weighted else None
    outs = refs[1:] if weighted else refs
    i = pl.program_id(1)
    r, start, end = tbl[4 * i + 1], tbl[4 * i + 2], tbl[4 * i + 3]
    rows = r * t.rows + lax.broadcasted_iota(jnp.int32, (t.rows, 1), 0)
    keep = (rows >= start) & (rows < end)  # [R, 1]
    x = x_ref[...].astype(F32)
    w = w_ref[...] if weighted else None  # [R, 1]
    if kind == "max":
        if w is not None:
            keep = keep & (w != 0)
        top, token = _column_best(jnp.where(keep, x, -jnp.inf), jnp.where(keep, rows, NO_TOKEN))  # [1, BD]
        top_ref, token_ref = outs

        @pl.when(_opens(tbl, i, 0))
        def _open_max():
            top_ref[...] = jnp.full(top_ref.shape, -jnp.inf, F32)
            token_ref[...] = jnp.full(token_ref.shape, NO_TOKEN, jnp.int32)

        best, at = _pick(top_ref[...], token_ref[...], top, token)
        top_ref[...] = best
        token_ref[...] = at
        return
    (acc_ref,) = outs
    x = jnp.where(keep, x, 0.0)
    if w is not None:
        x = x * jnp.where(keep, w, 0.0)

    @pl.when(_opens(tbl, i, 0))
    def _open():
        acc_ref[...] = jnp.zeros(acc_ref.shape, F32)

    acc_ref[...] += jnp.sum(x, axis=0, keepdims=True)


def _bwd_kernel(tbl, pooled, *refs, kind, weighted, weight_grad, t: TpuTiles):
    """The rows of item i's row block that its segment owns: dx = g of the segment (max: where the row holds the
    column's max) times the row's weight, in the pooled range; 0 elsewhere."""
    names = ["g"] + (["token"] if kind == "max" else []) + (["w"] if weighted else []) + (["x"] if weight_grad else [])
    r = dict(zip(names, refs))
    dx_ref = refs[len(names)]
    dot_ref = refs[len(names) + 1] if weight_grad else None
    i = pl.program_id(1)
    blk, start, end = tbl[4 * i + 1], tbl[4 * i + 2], tbl[4 * i + 3]
    lo, hi = pooled[2 * i], pooled[2 * i + 1]
    rows = blk * t.rows + lax.broadcasted_iota(jnp.int32, (t.rows, 1), 0)
    mine = (rows >= start) & (rows < end)
    inside = mine & (rows >= lo) & (rows < hi)
    g = jnp.where(inside, r["g"][...].astype(F32), 0.0)  # [R, BD]
    if kind == "max":
        g = jnp.where(r["token"][...] == rows, g, 0.0)

    @pl.when(_opens(tbl, i, 1))
    def _open():
        dx_ref[...] = jnp.zeros(dx_ref.shape, dx_ref.dtype)
        if weight_grad:
            dot_ref[...] = jnp.zeros(dot_ref.shape, F32)

    if weight_grad:
        dot = jnp.sum(g * jnp.where(inside, r["x"][...].astype(F32), 0.0), axis=1, keepdims=True)
        dot_ref[...] = jnp.where(mine, dot, dot_ref[...])
    if weighted and kind == "sum":
        g = g * jnp.where(mine, r["w"][...], 0.0)
    dx_ref[...] = jnp.where(mine, g.astype(dx_ref.dtype), dx_ref[...])


class TpuKernels:
    """Forward and backward of one kind of pooling on TPUs (``kind``, ``scaled``: the spec's reduction)."""

    def __init__(self, name: str, kind: str, scaled: bool):
        self.name, self.kind, self.scaled = name, kind, scaled

    def forward(self, x, w, ctx, *, cfg, save, interpret):
        t = tiles(cfg, x.dtype.itemsize)
        axes = vma.varying_axes(x, w, ctx)
        x, w = _at_least_a_block(x, w, t)
        n, d, n_d = cfg.n_seqs, cfg.dim, cfg.dim // t.block_d
        lo, hi = work.ranges(ctx, cfg)
        tbl = block_items(lo, hi, t.rows, cfg.tokens)
        weighted = w is not None
        x_spec = pl.BlockSpec((t.rows, t.block_d), lambda j, i, tbl: (tbl[4 * i + 1], j))
        in_specs = [x_spec] + ([pl.BlockSpec((t.rows, 1), lambda j, i, tbl: (tbl[4 * i + 1], 0))] if weighted else [])
        inputs = [x] + ([w[:, None]] if weighted else [])
        out_spec = pl.BlockSpec((None, 1, t.block_d), lambda j, i, tbl: (tbl[4 * i], 0, j))
        kinds = [F32, jnp.int32] if self.kind == "max" else [F32]
        kernel = functools.partial(_fwd_kernel, kind=self.kind, weighted=weighted, t=t)
        outs = pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(n_d, tbl.shape[0]), in_specs=in_specs,
                                                   out_specs=[out_spec] * len(kinds)),
            out_shape=[vma.struct((n, 1, d), k, axes) for k in kinds],
            compiler_params=_compiler_params(),
            interpret=interpret,
            name=f"{self.name}_fwd",
        )(jnp.asarray(tbl).reshape(-1), *inputs)
        some = (jnp.asarray(hi) > jnp.asarray(lo))[:, None]  # sequences without items never had a block written
        if self.kind == "max":
            top, token = outs[0][:, 0], outs[1][:, 0]
            seen = some & (token != NO_TOKEN)
            return jnp.where(seen, top, 0.0).astype(x.dtype), {"token": jnp.where(seen, token, -1)}
        total = jnp.where(some, outs[0][:, 0], 0.0)
        if not self.scaled:
            return total.astype(x.dtype), {}
        den = _weight_sums(w, lo, hi, ctx, cfg)
        scale = jnp.where(den != 0, 1.0 / jnp.where(den != 0, den, 1.0), 0.0)
        y32 = total * scale[:, None]
        if not save:
            return y32.astype(x.dtype), {}
        keep = weighted and cfg.weight_grad  # y in float32 for the weights' gradient
        return y32.astype(x.dtype), ({"scale": scale, "y32": y32} if keep else {"scale": scale})

    def backward(self, x, w, ctx, res, dy, *, cfg, interpret):
        t = tiles(cfg, x.dtype.itemsize)
        axes = vma.varying_axes(x, w, ctx, res, dy)
        w_given = w
        x, w = _at_least_a_block(x, w, t)
        n_d = cfg.dim // t.block_d
        part = work.partition_items(ctx, cfg, cfg.tokens, cfg.tokens)  # segments: the sequences, then the rest
        tbl = block_items(part[:, 0], part[:, 1], t.rows, cfg.tokens)
        pooled = part[:, 2:4][tbl[:, 0]]
        seq = part[:, 4][tbl[:, 0]]
        tbl = (jnp if isinstance(tbl, jax.Array) else np).concatenate([seq[:, None], tbl[:, 1:]], axis=1)
        weighted = w is not None
        weight_grad = self.kind == "sum" and weighted and cfg.weight_grad
        g = dy.astype(F32) * res["scale"][:, None] if self.scaled else dy
        def row_block(cols):
            return pl.BlockSpec((t.rows, cols), lambda j, i, tbl, pooled: (tbl[4 * i + 1], 0 if cols == 1 else j))

        of_seq = pl.BlockSpec((None, 1, t.block_d), lambda j, i, tbl, pooled: (tbl[4 * i], 0, j))
        inputs, specs = [g[:, None]], [of_seq]
        if self.kind == "max":
            inputs.append(res["token"][:, None])
            specs.append(of_seq)
        if weighted:
            inputs.append(w[:, None])
            specs.append(row_block(1))
        if weight_grad:
            inputs.append(x)
            specs.append(row_block(t.block_d))
        out_shape = [vma.struct(x.shape, x.dtype, axes)]
        out_specs = [row_block(t.block_d)]
        if weight_grad:
            out_shape.append(vma.struct((n_d, x.shape[0], 1), F32, axes))
            out_specs.append(pl.BlockSpec((None, t.rows, 1), lambda j, i, tbl, pooled: (j, tbl[4 * i + 1], 0)))
        kernel = functools.partial(_bwd_kernel, kind=self.kind, weighted=weighted, weight_grad=weight_grad, t=t)
        outs = pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=(n_d, tbl.shape[0]), in_specs=specs,
                                                   out_specs=out_specs),
            out_shape=out_shape,
            compiler_params=_compiler_params(),
            interpret=interpret,
            name=f"{self.name}_bwd",
        )(jnp.asarray(tbl).reshape(-1), jnp.asarray(pooled).reshape(-1), *inputs)
        dx = outs[0][:cfg.tokens]
        if not weighted:
            return dx, None
        if not weight_grad:
            return dx, jnp.zeros_like(w_given)
        return dx, work.weights_grad(jnp.sum(outs[1][:, :cfg.tokens, 0], axis=0), dy, res, ctx, cfg)


def _at_least_a_block(x, w, t: TpuTiles):
    """x (and w) with at least one block of rows: tiny inputs padded with zero rows (never pooled)."""
    pad = t.rows - x.shape[0]
    if pad <= 0:
        return x, w
    return jnp.pad(x, ((0, pad), (0, 0))), (None if w is None else jnp.pad(w, (0, pad)))


def _pooled_sequence(lo, hi, cfg):
    """Per token, the sequence whose pooled range holds it, or N."""
    t = jnp.arange(cfg.tokens, dtype=jnp.int32)
    lo, hi = jnp.asarray(lo), jnp.asarray(hi)
    seq = jnp.searchsorted(hi, t, side="right").astype(jnp.int32)  # first n with hi[n] > t
    safe = jnp.minimum(seq, cfg.n_seqs - 1)
    return jnp.where((seq < cfg.n_seqs) & (t >= lo[safe]), seq, cfg.n_seqs)


def _weight_sums(w, lo, hi, ctx, cfg):
    """Per sequence, the sum of the weights of its pooled tokens (their count without weights)."""
    if w is None:
        return (jnp.asarray(hi) - jnp.asarray(lo)).astype(F32)
    return jax.ops.segment_sum(w, _pooled_sequence(lo, hi, cfg), num_segments=cfg.n_seqs + 1)[:cfg.n_seqs]

