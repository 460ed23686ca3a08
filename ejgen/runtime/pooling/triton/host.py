"""The Triton backend of the pooling family, shared by every generated spec: tiles, work items, launches, and the
sums that finish the weights' gradient. A generated ``triton_launch.py`` names its kernels module and what its
kernels take (``Kernels``); everything else is here, once.

Forward: ``<name>_fwd_kernel`` on a grid of (blocks of columns, items) writes one float32 partial per item and
block (the sum, or the max and its token, of at most ``rows`` tokens; ``work.items``), ``<name>_combine_kernel`` on
(sequences, blocks) reduces each sequence's items in order into y. Backward: ``<name>_bwd_kernel`` on (blocks of
columns, items of the tokens' partition: ``work.partition_items``) writes dx, and per block of columns the dot
products the weights' gradient sums.
A bandwidth-bound op (docs/DESIGN.md §8): items are sized so that the grid fills the GPU many times over whatever
the batch, and each program streams [chunk_size, BLOCK_D] tiles of 16-byte loads (``tiles``).
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np

from ejgen.runtime.core import sizes
from ejgen.runtime.launch import triton_call
from ejgen.runtime.pooling import work

F32 = jnp.float32
# Launch settings, from benchmarks/pooling_tune.py on an H100 (jax 0.11.2, Triton 3.6) over x [32, 8192, 4096] bf16 and
# the same tokens packed in 32 sequences (BENCHMARKS.md): narrow blocks of columns, 8 warps, loads that evict first.
TILE_BYTES = 8192  # bytes of x a program loads a step, [chunk_size, BLOCK_D]: 128 columns of 16-bit x at chunk 32
WHOLE_TILE_BYTES = 4096  # the same when a program pools a whole sequence: more, narrower programs
SHORT_TILE_BYTES, SHORT_TOKENS = 16384, 512  # sequences shorter than SHORT_TOKENS on average: wider, 4 warps
MAX_BLOCK_D = 1024
TARGET_PROGRAMS = 2048  # programs of a grid: about 16 per SM of an H100 / H200 (132 SMs)
MIN_ROWS, MAX_ROWS = 256, 16384  # tokens of a work item (and of a backward program)
NUM_WARPS, SHORT_WARPS, NUM_STAGES = 8, 4, 1
ITEM_AXIS = 1  # items on grid axis 1: the blocks of columns of a row are neighbouring programs and read it whole
EVICT = "evict_first"  # the forward's loads of x: it is read once
GROUP = 16  # partials the combine kernel loads a step


def available():
    return triton_call.available()


@dataclasses.dataclass(frozen=True)
class Kernels:
    """A spec's kernels: their module and what its generated kernels take."""

    module: str
    name: str
    kind: str  # "sum" | "max"
    scaled: bool  # the mean: the combine kernel scales, and saves the scale

    def get(self, which: str):
        return getattr(importlib.import_module(self.module), f"{self.name}_{which}_kernel")


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_d: int  # columns of a program
    rows: int  # tokens of a work item (forward) and of a program (backward): a multiple of the chunk
    num_warps: int = NUM_WARPS


def tiles(cfg, itemsize: int) -> Tiles:
    """BLOCK_D: chunk_size x BLOCK_D elements make a step's bytes (TILE_BYTES: 128 columns of 16-bit x at the default
    chunk of 32), at most D rounded up to a power of two. Rows of an item: enough items that the grid has about
    TARGET_PROGRAMS programs, within [MIN_ROWS, MAX_ROWS]. A dense batch whose sequences make half as many programs
    at WHOLE_TILE_BYTES takes one item per sequence (no combine kernel); short sequences take wide blocks and fewer
    warps. In Triton's interpreter (tests) items are two chunks, so that small inputs have sequences of several."""
    def width(step_bytes):
        return min(sizes.pow2(cfg.dim), MAX_BLOCK_D, max(16, step_bytes // (cfg.chunk * itemsize)))

    if triton_call.mode()[0] == "interpret":
        return Tiles(width(TILE_BYTES), 2 * cfg.chunk)
    if cfg.tokens < SHORT_TOKENS * max(cfg.n_seqs, 1):
        block_d, warps = width(SHORT_TILE_BYTES), SHORT_WARPS
    else:
        block_d, warps = width(TILE_BYTES), NUM_WARPS
        whole = width(WHOLE_TILE_BYTES)
        programs = cfg.n_seqs * work.cdiv(cfg.dim, whole)
        if not cfg.varlen and cfg.seq_len <= MAX_ROWS and programs >= TARGET_PROGRAMS // 2:
            return Tiles(whole, max(sizes.pow2(cfg.seq_len), cfg.chunk), warps)
    rows = min(MAX_ROWS, max(MIN_ROWS, sizes.pow2(cfg.tokens * work.cdiv(cfg.dim, block_d) // TARGET_PROGRAMS)))
    return Tiles(block_d, max(rows, cfg.chunk), warps)


def _dummy(dtype):
    return jnp.zeros((1,), dtype)


def _direct(lo, hi, rows: int) -> bool:
    """Whether every sequence is one work item, statically (dense calls whose sequences fit an item): then the
    forward kernel finishes the result and the combine kernel is not launched."""
    return isinstance(lo, np.ndarray) and isinstance(hi, np.ndarray) and bool(np.all((hi - lo > 0) & (hi - lo <= rows)))


def _grid(n_items: int, n_d: int) -> tuple:
    return (n_items, n_d) if ITEM_AXIS == 0 else (n_d, n_items)


# Batching: jax-triton's call has no vmap rule. Under vmap a dense call whose ranges are static folds the mapped axis
# into its sequences (one launch: n x N sequences of n x T tokens; the tokens max saves are of the folded layout, and
# the backward folds the same way); any other call runs once per mapped index (lax.map).


def _sequential(fn, n, in_batched, args):
    def one(i):
        return fn(*jax.tree.map(lambda x, b: x[i] if b else x, tuple(args), tuple(in_batched)))

    outs = jax.lax.map(one, jnp.arange(n))
    return outs, jax.tree.map(lambda _: True, outs)


def _fold(x, batched: bool, n: int):
    """[n, T, ...] (or unmapped [T, ...]) -> [n * T, ...]."""
    x = x if batched else jnp.broadcast_to(x[None], (n,) + x.shape)
    return x.reshape((-1,) + x.shape[2:])


def _unfold(tree, n: int):
    return jax.tree.map(lambda x: x.reshape((n, -1) + x.shape[1:]), tree)


def _folded(cfg, n: int):
    return dataclasses.replace(cfg, n_seqs=n * cfg.n_seqs, tokens=n * cfg.tokens)


def forward(kernels: Kernels, x, w, ctx, cfg, save: bool):
    """(y [N, D] in x's dtype, residuals): the mean's scale and (save, weighted) y in float32; max's tokens."""
    fn = jax.custom_batching.custom_vmap(lambda x, w, ctx: _forward(kernels, x, w, ctx, cfg, save))

    @fn.def_vmap
    def rule(n, in_batched, x, w, ctx):
        if cfg.varlen or ctx:
            return _sequential(lambda *a: _forward(kernels, *a, cfg, save), n, in_batched, (x, w, ctx))
        wf = None if w is None else _fold(w, in_batched[1], n)
        outs = _unfold(_forward(kernels, _fold(x, in_batched[0], n), wf, {}, _folded(cfg, n), save), n)
        return outs, jax.tree.map(lambda _: True, outs)

    return fn(x, w, ctx)


def _forward(kernels: Kernels, x, w, ctx, cfg, save: bool):
    t = tiles(cfg, x.dtype.itemsize)
    n, d = cfg.n_seqs, cfg.dim
    lo, hi = work.ranges(ctx, cfg)
    n_items = work.count(n, cfg.tokens, t.rows, lo, hi)
    items, first = work.items(lo, hi, t.rows, n_items)
    n_d = work.cdiv(d, t.block_d)
    even_d = d % t.block_d == 0
    sds = jax.ShapeDtypeStruct
    if kernels.kind == "max":
        aux = [sds((n_items, d), jnp.int32)]
    else:
        aux = [sds((n_items,), F32)] if kernels.scaled else []
    keep = save and kernels.scaled and w is not None and cfg.weight_grad  # y in float32 for the weights' gradient
    direct = _direct(lo, hi, t.rows) and not keep
    if direct:  # item n is sequence n: the forward kernel writes y (and the scale, or the tokens)
        aux = [sds((n,), F32)] if kernels.scaled else [sds((n, d), jnp.int32)] if kernels.kind == "max" else []
    part, *aux = triton_call.launch(
        kernels.get("fwd"), _grid(n_items, n_d), [x, _dummy(F32) if w is None else w, items],
        [sds((n_items, d), x.dtype if direct else F32), *aux], num_warps=t.num_warps, num_stages=NUM_STAGES,
        D=d, CHUNK=cfg.chunk, BLOCK_D=t.block_d, WEIGHTED=w is not None, EVEN_D=even_d, ITEM_AXIS=ITEM_AXIS,
        EVICT=EVICT, DIRECT=direct)
    if direct:
        res = {"token": aux[0]} if kernels.kind == "max" else {"scale": aux[0]} if kernels.scaled and save else {}
        return part, res
    y_shape = sds((n, d), x.dtype)
    if kernels.kind == "max":
        y, token = triton_call.launch(kernels.get("combine"), (n, n_d), [part, *aux, first],
                                      [y_shape, sds((n, d), jnp.int32)], num_warps=t.num_warps, num_stages=1,
                                      D=d, BLOCK_D=t.block_d, GROUP=GROUP)
        return y, {"token": token}
    if not kernels.scaled:
        (y,) = triton_call.launch(kernels.get("combine"), (n, n_d), [part, first], [y_shape], num_warps=t.num_warps,
                                  num_stages=1, D=d, BLOCK_D=t.block_d, GROUP=GROUP)
        return y, {}
    y, scale, y32 = triton_call.launch(
        kernels.get("combine"), (n, n_d), [part, *aux, first],
        [y_shape, sds((n,), F32), sds((n, d) if keep else (1,), F32)], num_warps=t.num_warps, num_stages=1,
        D=d, BLOCK_D=t.block_d, GROUP=GROUP, SAVE=keep)
    return y, ({"scale": scale, "y32": y32} if keep else {"scale": scale}) if save else {}


def backward(kernels: Kernels, x, w, ctx, res, dy, cfg):
    """(dx [T, D] in x's dtype, dw [T] float32 or None): one program per item of the tokens' partition and block
    of columns, dy of the item's sequence read once."""
    fn = jax.custom_batching.custom_vmap(lambda x, w, ctx, res, dy: _backward(kernels, x, w, ctx, res, dy, cfg))

    @fn.def_vmap
    def rule(n, in_batched, x, w, ctx, res, dy):
        args = (x, w, ctx, res, dy)
        if cfg.varlen or ctx:
            return _sequential(lambda *a: _backward(kernels, *a, cfg), n, in_batched, args)
        folded = [None if a is None else jax.tree.map(lambda v, b: _fold(v, b, n), a, batched)
                  for a, batched in zip(args, in_batched)]
        outs = _unfold(_backward(kernels, *folded, _folded(cfg, n)), n)
        return outs, jax.tree.map(lambda _: True, outs)

    return fn(x, w, ctx, res, dy)


def _backward(kernels: Kernels, x, w, ctx, res, dy, cfg):
    t = tiles(cfg, x.dtype.itemsize)
    d = cfg.dim
    n_d = work.cdiv(d, t.block_d)
    weight_grad = kernels.kind == "sum" and w is not None and cfg.weight_grad
    table = work.partition_items(ctx, cfg, t.rows, cfg.tokens)
    by_kind = [res["token"]] if kernels.kind == "max" else [res["scale"]] if kernels.scaled else []
    sds = jax.ShapeDtypeStruct
    dx, dot = triton_call.launch(
        kernels.get("bwd"), _grid(table.shape[0], n_d),
        [x, _dummy(F32) if w is None else w, dy, *by_kind, jnp.asarray(table)],
        [sds(x.shape, x.dtype), sds((n_d, cfg.tokens) if weight_grad else (1,), F32)],
        num_warps=t.num_warps, num_stages=NUM_STAGES,
        T=cfg.tokens, D=d, CHUNK=cfg.chunk, BLOCK_D=t.block_d, WEIGHTED=w is not None, WEIGHT_GRAD=weight_grad,
        EVEN_D=d % t.block_d == 0, ITEM_AXIS=ITEM_AXIS)
    if w is None:
        return dx, None
    if not weight_grad:
        return dx, jnp.zeros_like(w)
    return dx, work.weights_grad(jnp.sum(dot, axis=0), dy, res, ctx, cfg)
