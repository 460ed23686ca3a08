"""The Pallas pooling kernels for GPUs (Triton lowering): the Triton backend's work items (``work.items``), a
forward of float32 partials per item and block of columns, a combine per sequence, and a backward per item of the
sequences' partition (every token in exactly one item, so dx needs no zero fill and no gather).

Pallas's interpreter slices refs as ``lax.dynamic_slice`` does, moving a window that would run past the end back
inside; so every window here is placed inside the array (``_window``) and its rows masked by position, which is
what the compiled kernels do too. Columns come in blocks that divide D (D is padded to a multiple of 16 first).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ejgen.runtime.core import sizes, vma
from ejgen.runtime.pooling import work

F32 = jnp.float32
NO_TOKEN = jnp.iinfo(jnp.int32).max
TILE_BYTES = 16384  # bytes of x a program loads per step
MAX_BLOCK_D = 256
TARGET_PROGRAMS = 4096
MIN_ROWS, MAX_ROWS = 256, 4096


@dataclasses.dataclass(frozen=True)
class GpuTiles:
    chunk: int  # rows a step (chunk_size)
    block_d: int  # columns of a program: a power of two dividing the padded D
    rows: int  # tokens of a work item
    dim: int  # D padded to a multiple of 16
    num_warps: int = 4
    num_stages: int = 3


def tiles(cfg, itemsize: int, interpret) -> GpuTiles:
    dim = -(-cfg.dim // 16) * 16
    cap = min(MAX_BLOCK_D, max(16, TILE_BYTES // (cfg.chunk * itemsize)))
    block_d = 16
    while block_d * 2 <= cap and dim % (block_d * 2) == 0:
        block_d *= 2
    if interpret:
        rows = 2 * cfg.chunk  # small inputs: sequences of several items
    else:
        rows = min(MAX_ROWS, max(MIN_ROWS, sizes.pow2(cfg.tokens * (dim // block_d) // TARGET_PROGRAMS)))
    return GpuTiles(cfg.chunk, block_d, max(rows, cfg.chunk), dim)


def _compiler_params(t: GpuTiles, stages=None):
    return plgpu.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages if stages is None else stages)


def _window(row0, chunk: int, tokens: int):
    """(start, rows [chunk, 1], rows [chunk]) of a window of ``chunk`` rows meant to start at ``row0``, moved inside
    [0, tokens) (``tokens >= chunk``); rows before ``row0`` belong to another step and are masked by the caller. (Both
    shapes: the Triton lowering has no slice of a value.)"""
    start = jnp.minimum(row0, tokens - chunk)
    return start, start + lax.broadcasted_iota(jnp.int32, (chunk, 1), 0), start + lax.iota(jnp.int32, chunk)


def _pick(v1, t1, v2, t2):
    """The better of two (value, token) candidates per column: a NaN before a number, the larger value, the
    earlier token."""
    nan1, nan2 = v1 != v1, v2 != v2
    tie = (v2 == v1) | (nan1 & nan2)
    second = (nan2 & ~nan1) | ((nan1 == nan2) & ((v2 > v1) | (tie & (t2 < t1))))
    return jnp.where(second, v2, v1), jnp.where(second, t2, t1)


def _column_best(top, token):
    """(value, token) [B] of the lanes [C, B]: a NaN if any lane has one (its earliest token), else the max and the
    earliest token that attains it (lanes without a token hold NO_TOKEN)."""
    nan = top != top
    any_nan = jnp.max(nan.astype(jnp.int32), axis=0, keepdims=True) > 0
    best = jnp.max(jnp.where(nan, -jnp.inf, top), axis=0, keepdims=True)
    best = jnp.where(any_nan, jnp.nan, best)
    hit = jnp.where(any_nan, nan, top == best)
    return best.reshape(best.shape[1:]), jnp.min(jnp.where(hit, token, NO_TOKEN), axis=0)


def _fwd_kernel(items_ref, x_ref, *refs, kind, scaled, weighted, t: GpuTiles, tokens):
    w_ref = refs[0] if weighted else None
    outs = refs[1:] if weighted else refs
    j = pl.program_id(1)
    start, end = items_ref[0], items_ref[1]
    cols = pl.ds(pl.multiple_of(j * t.block_d, t.block_d), t.block_d)

    def step(k, carry):
        row0 = start + k * t.chunk
        at, rows, rows1 = _window(row0, t.chunk, tokens)
        valid = (rows >= row0) & (rows < end)  # [C, 1]
        x = plgpu.load(x_ref.at[pl.ds(at, t.chunk), cols], mask=valid, other=0).astype(F32)
        if weighted:
            w = plgpu.load(w_ref.at[pl.ds(at, t.chunk)], mask=(rows1 >= row0) & (rows1 < end), other=0)[:, None]
        else:
            w = None
        if kind == "max":
            top, token = carry
            keep = valid if w is None else valid & (w != 0)
            x = jnp.where(keep, x, -jnp.inf)
            take = keep & ((x > top) | ((x != x) & (top == top)) | (token == NO_TOKEN))
            return jnp.where(take, x, top), jnp.where(take, rows, token)
        acc, den = carry
        if w is not None:
            x = x * w
        return acc + x, den + (valid.astype(F32) if w is None else w)

    shape = (t.chunk, t.block_d)
    if kind == "max":
        init = (jnp.full(shape, -jnp.inf, F32), jnp.full(shape, NO_TOKEN, jnp.int32))
    else:
        init = (jnp.zeros(shape, F32), jnp.zeros((t.chunk, 1), F32))
    carry = lax.fori_loop(0, t.rows // t.chunk, step, init)
    if kind == "max":
        top, token = _column_best(*carry)
        outs[0][...] = top
        outs[1][...] = token
        return
    acc, den = carry
    outs[0][...] = jnp.sum(acc, axis=0)
    if scaled:
        outs[1][...] = jnp.broadcast_to(jnp.sum(den), outs[1].shape)


def _combine_kernel(spans_ref, part_ref, *refs, kind, scaled, save, t: GpuTiles):
    first, last = spans_ref[0], spans_ref[1]
    if kind == "max":
        token_ref, y_ref, tok_out = refs

        def step(i, carry):
            v = plgpu.load(part_ref.at[pl.ds(i, 1), :])
            return _pick(*carry, v, plgpu.load(token_ref.at[pl.ds(i, 1), :]))

        init = (jnp.full((1, t.block_d), -jnp.inf, F32), jnp.full((1, t.block_d), NO_TOKEN, jnp.int32))
        top, token = lax.fori_loop(first, last, step, init)
        seen = token != NO_TOKEN
        y_ref[...] = jnp.where(seen, top, 0.0).astype(y_ref.dtype)
        tok_out[...] = jnp.where(seen, token, -1)
        return
    if scaled:
        den_ref, y_ref, scale_ref, y32_ref = refs
    else:
        (y_ref,) = refs

    def add(i, carry):
        acc, den = carry
        acc = acc + plgpu.load(part_ref.at[pl.ds(i, 1), :])
        return acc, (den + jnp.max(plgpu.load(den_ref.at[pl.ds(i, 1), :]), axis=1, keepdims=True) if scaled else den)

    acc, den = lax.fori_loop(first, last, add, (jnp.zeros((1, t.block_d), F32), jnp.zeros((1, 1), F32)))
    if scaled:
        scale = jnp.where(den != 0, 1.0 / jnp.where(den != 0, den, 1.0), 0.0)  # [1, 1]
        acc = acc * scale
        scale_ref[...] = jnp.broadcast_to(scale, scale_ref.shape)
        if save:
            y32_ref[...] = acc
    y_ref[...] = acc.astype(y_ref.dtype)


def _bwd_kernel(items_ref, dy_ref, *refs, kind, scaled, weighted, weight_grad, t: GpuTiles, tokens):
    """dx for the rows [start, end) of one item of the partition: those in [pooled_lo, pooled_hi) get dy of the
    item's sequence (times its scale and their weight; max: where they hold the column's max), the rest 0."""
    names = (["token"] if kind == "max" else ["scale"] if scaled else []) + (["w"] if weighted else [])
    names += ["x"] if weight_grad else []
    r = dict(zip(names, refs))
    dx_ref = refs[len(names)]
    dot_ref = refs[len(names) + 1] if weight_grad else None
    j = pl.program_id(1)
    start, end, lo, hi, n = (items_ref[i] for i in range(5))
    cols = pl.ds(pl.multiple_of(j * t.block_d, t.block_d), t.block_d)
    g = plgpu.load(dy_ref.at[pl.ds(n, 1), cols]).astype(F32)  # [1, BD]
    if scaled:
        g = g * jnp.max(plgpu.load(r["scale"].at[pl.ds(n, 1), :]), axis=1, keepdims=True)
    token = plgpu.load(r["token"].at[pl.ds(n, 1), cols]) if kind == "max" else None

    def step(k, carry):
        row0 = start + k * t.chunk
        at, rows, rows1 = _window(row0, t.chunk, tokens)
        mine = (rows >= row0) & (rows < end)
        mine1 = (rows1 >= row0) & (rows1 < end)
        pooled = mine & (rows >= lo) & (rows < hi)
        dx = jnp.where(pooled, g, 0.0)  # [C, BD]
        if kind == "max":
            dx = jnp.where(token == rows, dx, 0.0)
        if weight_grad:
            x = plgpu.load(r["x"].at[pl.ds(at, t.chunk), cols], mask=pooled, other=0).astype(F32)
            plgpu.store(dot_ref.at[pl.ds(at, t.chunk)], jnp.sum(dx * x, axis=1), mask=mine1)
        if weighted and kind == "sum":
            dx = dx * plgpu.load(r["w"].at[pl.ds(at, t.chunk)], mask=mine1, other=0)[:, None]
        plgpu.store(dx_ref.at[pl.ds(at, t.chunk), cols], dx.astype(dx_ref.dtype), mask=mine)
        return carry

    lax.fori_loop(0, t.rows // t.chunk, step, 0)


class GpuKernels:
    """Forward and backward of one kind of pooling (``kind``, ``scaled``: the spec's reduction)."""

    def __init__(self, name: str, kind: str, scaled: bool):
        self.name, self.kind, self.scaled = name, kind, scaled

    def _padded(self, x, t: GpuTiles):
        """x [T', D'] with D' = t.dim and T' >= chunk (tiny inputs padded with zero rows)."""
        pad_rows = max(t.chunk - x.shape[0], 0)
        if pad_rows or t.dim != x.shape[1]:
            x = jnp.pad(x, ((0, pad_rows), (0, t.dim - x.shape[1])))
        return x

    def forward(self, x, w, ctx, *, cfg, save, interpret):
        t = tiles(cfg, x.dtype.itemsize, interpret)
        axes = vma.varying_axes(x, w, ctx)
        xp = self._padded(x, t)
        tokens, n, n_d = xp.shape[0], cfg.n_seqs, t.dim // t.block_d
        lo, hi = work.ranges(ctx, cfg)
        n_items = work.count(n, cfg.tokens, t.rows, lo, hi)
        items, first = work.items(lo, hi, t.rows, n_items)
        whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)  # noqa: E731
        weighted = w is not None
        inputs = [jnp.asarray(items), xp] + ([jnp.pad(w, (0, tokens - w.shape[0]))] if weighted else [])
        in_specs = [pl.BlockSpec((None, 2), lambda i, j: (i, 0)), whole(xp)] + ([whole(inputs[2])] if weighted else [])
        row = pl.BlockSpec((None, t.block_d), lambda i, j: (i, j))
        if self.kind == "max":
            out_shape = [vma.struct((n_items, t.dim), F32, axes), vma.struct((n_items, t.dim), jnp.int32, axes)]
            out_specs = [row, row]
        else:
            out_shape = [vma.struct((n_items, t.dim), F32, axes)]
            out_specs = [row]
            if self.scaled:
                out_shape.append(vma.struct((n_items, 16), F32, axes))
                out_specs.append(pl.BlockSpec((None, 16), lambda i, j: (i, 0)))
        kernel = functools.partial(_fwd_kernel, kind=self.kind, scaled=self.scaled, weighted=weighted, t=t,
                                   tokens=tokens)
        parts = pl.pallas_call(kernel, grid=(n_items, n_d), in_specs=in_specs, out_specs=out_specs,
                               out_shape=out_shape, compiler_params=_compiler_params(t), interpret=interpret,
                               name=f"{self.name}_fwd")(*inputs)
        spans = jnp.stack([jnp.asarray(first[:-1]), jnp.asarray(first[1:])], axis=1)
        keep = save and self.scaled and weighted and cfg.weight_grad
        col = pl.BlockSpec((1, t.block_d), lambda i, j: (i, j))
        if self.kind == "max":
            out_shape = [vma.struct((n, t.dim), x.dtype, axes), vma.struct((n, t.dim), jnp.int32, axes)]
            out_specs = [col, col]
            part_specs = [pl.BlockSpec((n_items, t.block_d), lambda i, j: (0, j))] * 2
        else:
            out_shape = [vma.struct((n, t.dim), x.dtype, axes)]
            out_specs = [col]
            part_specs = [pl.BlockSpec((n_items, t.block_d), lambda i, j: (0, j))]
            if self.scaled:
                part_specs.append(pl.BlockSpec((n_items, 16), lambda i, j: (0, 0)))
                out_shape += [vma.struct((n, 16), F32, axes), vma.struct((n, t.dim) if keep else (1, 16), F32, axes)]
                out_specs += [pl.BlockSpec((1, 16), lambda i, j: (i, 0)),
                              col if keep else pl.BlockSpec((1, 16), lambda i, j: (0, 0))]
        kernel = functools.partial(_combine_kernel, kind=self.kind, scaled=self.scaled, save=keep, t=t)
        spans_spec = pl.BlockSpec((None, 2), lambda i, j: (i, 0))
        outs = pl.pallas_call(kernel, grid=(n, n_d), in_specs=[spans_spec] + part_specs,
                              out_shape=out_shape, out_specs=out_specs, compiler_params=_compiler_params(t, 1),
                              interpret=interpret, name=f"{self.name}_combine")(spans, *parts)
        y = outs[0][:, :cfg.dim]
        if self.kind == "max":
            return y, {"token": outs[1][:, :cfg.dim]}
        if not self.scaled or not save:
            return y, {}
        res = {"scale": outs[1][:, 0]}
        if keep:
            res["y32"] = outs[2][:, :cfg.dim]
        return y, res

    def backward(self, x, w, ctx, res, dy, *, cfg, interpret):
        t = tiles(cfg, x.dtype.itemsize, interpret)
        axes = vma.varying_axes(x, w, ctx, res, dy)
        xp = self._padded(x, t)
        tokens, n_d = xp.shape[0], t.dim // t.block_d
        table = work.partition_items(ctx, cfg, t.rows, tokens)
        weighted = w is not None
        weight_grad = self.kind == "sum" and weighted and cfg.weight_grad
        whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)  # noqa: E731
        pad_d = lambda a: jnp.pad(a, ((0, 0), (0, t.dim - a.shape[1])))  # noqa: E731
        inputs, specs = [jnp.asarray(table), pad_d(dy)], []
        if self.kind == "max":
            inputs.append(pad_d(res["token"]))
        elif self.scaled:
            inputs.append(jnp.broadcast_to(res["scale"][:, None], (cfg.n_seqs, 16)))
        if weighted:
            inputs.append(jnp.pad(w, (0, tokens - w.shape[0])))
        if weight_grad:
            inputs.append(xp)
        specs = [pl.BlockSpec((None, 8), lambda i, j: (i, 0))] + [whole(a) for a in inputs[1:]]
        out_shape = [vma.struct(xp.shape, x.dtype, axes)]
        out_specs = [whole(xp)]
        if weight_grad:
            out_shape.append(vma.struct((n_d, tokens), F32, axes))
            out_specs.append(pl.BlockSpec((None, tokens), lambda i, j: (j, 0)))
        kernel = functools.partial(_bwd_kernel, kind=self.kind, scaled=self.scaled, weighted=weighted,
                                   weight_grad=weight_grad, t=t, tokens=tokens)
        outs = pl.pallas_call(kernel, grid=(table.shape[0], n_d), in_specs=specs, out_specs=out_specs,
                              out_shape=out_shape, compiler_params=_compiler_params(t), interpret=interpret,
                              name=f"{self.name}_bwd")(*inputs)
        dx = outs[0][:cfg.tokens, :cfg.dim]
        if not weighted:
            return dx, None
        if not weight_grad:
            return dx, jnp.zeros_like(w)
        return dx, work.weights_grad(jnp.sum(outs[1], axis=0)[:cfg.tokens], dy, res, ctx, cfg)
