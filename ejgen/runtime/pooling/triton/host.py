"""The Triton backend of the pooling family, shared by every generated spec: tiles, work items, launches, and the
sums that finish the weights' gradient. A generated ``triton_launch.py`` names its kernels module and what its
kernels take (``Kernels``); everything else is here, once.

Forward: ``<name>_fwd_kernel`` on a grid (items, blocks of columns) writes one float32 partial per item and block
(the sum, or the max and its token, of at most ``rows`` tokens; ``work.items``), ``<name>_combine_kernel`` on
(sequences, blocks) reduces each sequence's items in order into y. Backward: ``<name>_bwd_kernel`` on (blocks of
``rows`` tokens, blocks of columns) writes dx, and per block of columns the dot products the weights' gradient sums.
A bandwidth-bound op (docs/DESIGN.md §8): items are sized so that the grid fills the GPU many times over whatever
the batch, and each program streams [chunk_size, BLOCK_D] tiles of 16-byte loads (``tiles``).
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp

from ejgen.runtime.launch import triton_call
from ejgen.runtime.pooling import work

F32 = jnp.float32
TILE_BYTES = 16384  # bytes of x a program loads per step: [chunk_size, BLOCK_D]
MAX_BLOCK_D = 1024
TARGET_PROGRAMS = 4096  # programs of a grid: about 30 per SM of an H100 / H200 (132 SMs)
MIN_ROWS, MAX_ROWS = 256, 4096  # tokens of a work item (and of a backward program)
NUM_WARPS, NUM_STAGES = 4, 3


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


def tiles(cfg, itemsize: int) -> Tiles:
    """BLOCK_D: chunk_size x BLOCK_D elements make TILE_BYTES of x (256 columns of 16-bit x, 128 of float32 at the
    default chunk of 32), at most D rounded up to a power of two. Rows of an item: enough items that the grid has
    about TARGET_PROGRAMS programs, within [MIN_ROWS, MAX_ROWS]; in Triton's interpreter (tests) two chunks, so
    that small inputs have sequences of several items."""
    block_d = min(work.pow2(cfg.dim), MAX_BLOCK_D, max(16, TILE_BYTES // (cfg.chunk * itemsize)))
    n_d = work.cdiv(cfg.dim, block_d)
    if triton_call.mode()[0] == "interpret":
        rows = 2 * cfg.chunk
    else:
        rows = min(MAX_ROWS, max(MIN_ROWS, work.pow2(cfg.tokens * n_d // TARGET_PROGRAMS)))
    return Tiles(block_d, max(rows, cfg.chunk))


def _dummy(dtype):
    return jnp.zeros((1,), dtype)


def forward(kernels: Kernels, x, w, ctx, cfg, save: bool):
    """(y [N, D] in x's dtype, residuals): the mean's scale and (save, weighted) y in float32; max's tokens."""
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
    part, *aux = triton_call.launch(
        kernels.get("fwd"), (n_items, n_d), [x, _dummy(F32) if w is None else w, items],
        [sds((n_items, d), F32), *aux], num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        D=d, ROWS=t.rows, CHUNK=cfg.chunk, BLOCK_D=t.block_d, WEIGHTED=w is not None, EVEN_D=even_d)
    y_shape = sds((n, d), x.dtype)
    if kernels.kind == "max":
        y, token = triton_call.launch(kernels.get("combine"), (n, n_d), [part, *aux, first],
                                      [y_shape, sds((n, d), jnp.int32)], num_warps=NUM_WARPS, num_stages=1,
                                      D=d, BLOCK_D=t.block_d)
        return y, {"token": token}
    if not kernels.scaled:
        (y,) = triton_call.launch(kernels.get("combine"), (n, n_d), [part, first], [y_shape], num_warps=NUM_WARPS,
                                  num_stages=1, D=d, BLOCK_D=t.block_d)
        return y, {}
    keep = save and w is not None and cfg.weight_grad  # y in float32 for the weights' gradient
    y, scale, y32 = triton_call.launch(
        kernels.get("combine"), (n, n_d), [part, *aux, first],
        [y_shape, sds((n,), F32), sds((n, d) if keep else (1,), F32)], num_warps=NUM_WARPS, num_stages=1,
        D=d, BLOCK_D=t.block_d, SAVE=keep)
    return y, ({"scale": scale, "y32": y32} if keep else {"scale": scale}) if save else {}


def backward(kernels: Kernels, x, w, ctx, res, dy, cfg):
    """(dx [T, D] in x's dtype, dw [T] float32 or None)."""
    t = tiles(cfg, x.dtype.itemsize)
    d = cfg.dim
    n_d = work.cdiv(d, t.block_d)
    weight_grad = kernels.kind == "sum" and w is not None and cfg.weight_grad
    seq = work.token_sequences(ctx, cfg) if cfg.varlen else _dummy(jnp.int32)
    lo, hi = work.ranges(ctx, cfg)
    by_kind = [res["token"]] if kernels.kind == "max" else [res["scale"]] if kernels.scaled else []
    sds = jax.ShapeDtypeStruct
    dx, dot = triton_call.launch(
        kernels.get("bwd"), (work.cdiv(cfg.tokens, t.rows), n_d),
        [x, _dummy(F32) if w is None else w, dy, *by_kind, seq, jnp.asarray(lo), jnp.asarray(hi)],
        [sds(x.shape, x.dtype), sds((n_d, cfg.tokens) if weight_grad else (1,), F32)],
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        T=cfg.tokens, D=d, SEQ_LEN=max(cfg.seq_len, 1), ROWS=t.rows, CHUNK=cfg.chunk, BLOCK_D=t.block_d,
        WEIGHTED=w is not None, VARLEN=cfg.varlen, RANGED=cfg.ranged, WEIGHT_GRAD=weight_grad,
        EVEN_D=d % t.block_d == 0)
    if w is None:
        return dx, None
    if not weight_grad:
        return dx, jnp.zeros_like(w)
    return dx, work.weights_grad(jnp.sum(dot, axis=0), dy, res, ctx, cfg)
