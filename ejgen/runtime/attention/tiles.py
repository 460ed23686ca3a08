"""Tile kinds of a call's masks, shared by every backend (docs/DESIGN.md §3, block masks): segment ids, a dense
mask and a block layout classified per tile by `ejgen.types.block_mask` (O(tiles) but for a dense mask), from the
op's ctx in the kernel layout (ids [B, S], the mask [B, Hkv|1, G|1, Sq, Sk] and the layout [B|1, Hkv|1, G|1, nQ,
nK]; padding never visible, so tiles holding it are never full); causal and the window by tile (`band_kinds`),
over indices or explicit positions, for kernels that walk lists instead of analysed ranges."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ejgen.runtime.core import intervals
from ejgen.types import block_mask


def classified(runtime_mask, cfg) -> bool:
    """Whether the call's runtime block mask is segment ids and / or a dense mask alone: not varlen, and no
    spec mask the analysis cannot bound (``runtime_mask(cfg)``: the spec's hook, asked without those)."""
    if cfg.varlen or cfg.positions or not (cfg.segments or cfg.dense_mask or cfg.layout):
        return False
    return not runtime_mask(dataclasses.replace(cfg, segments=False, dense_mask=False, varlen=False, layout=False))


def mask_kinds(ctx, cfg, block_q: int, block_k: int, sq: int, sk: int):
    """int8 [B|1, 1|Hq, nQ, nK]: the tiles of (block_q, block_k) over sq x sk that segment ids and the dense
    mask leave (0 skip, 1 partial, 2 full); the conditions of causal, window and the spec are not in it."""
    kinds = jnp.full((1, 1, -(-sq // block_q), -(-sk // block_k)), block_mask.FULL, jnp.int8)
    if cfg.segments:
        segments = block_mask.Segments(ctx["q_seg"], ctx["kv_seg"])
        kinds = jnp.minimum(kinds, segments.kinds(block_q, block_k, sq, sk))
    if cfg.dense_mask:
        mask = ctx["mask"]
        dense = block_mask.Dense(mask.reshape(mask.shape[0], -1, mask.shape[3], mask.shape[4]))
        kinds = jnp.minimum(kinds, dense.kinds(block_q, block_k, sq, sk))
    if cfg.layout:
        kinds = jnp.minimum(kinds, layout_condition(ctx, cfg).kinds(block_q, block_k, sq, sk))
    return kinds


def spec_kinds(mask_tiles, ctx, cfg, block_q: int, block_k: int, sq: int, sk: int, batch: int, heads: int):
    """int8 [B|1, Hq|1, nQ, nK]: the tiles the spec's mask leaves, by the generated ``mask_tiles`` (interval
    arithmetic, `ejgen.runtime.core.intervals`), over indices or explicit positions; not for varlen (a tile may
    straddle two sequences, whose indices restart). The batch and head axes appear where the mask reads b or h."""
    q_pos, kv_pos = (ctx["q_pos"], ctx["kv_pos"]) if cfg.positions else (None, None)
    t = intervals.tiles(batch, heads, block_q, block_k, sq, sk, q_pos, kv_pos)
    kinds = mask_tiles(t, ctx)
    n_q, n_k = -(-sq // block_q), -(-sk // block_k)
    shape = jnp.broadcast_shapes(kinds.shape, (1, 1, n_q, n_k))
    return jnp.broadcast_to(kinds, shape)


def band_kinds(ctx, cfg, block_q: int, block_k: int, sq: int, sk: int):
    """int8 [1|B, 1, nQ, nK]: the tiles causal and the window leave (the window's bounds traced: no recompile). With
    explicit positions, from each tile's least and greatest position (``ctx`` holds the query positions shifted by
    ``kv_len - q_len``, so that the aligned rules of the kernels compare positions)."""
    left = ctx["window_left"] if cfg.window else None
    right = jnp.int32(0) if cfg.causal else (ctx["window_right"] if cfg.window else None)
    if not cfg.positions:
        return block_mask.Band(left, right).kinds(block_q, block_k, sq, sk)
    q_pos = ctx["q_pos"] + (cfg.seq_k - cfg.seq_q)  # the positions themselves
    q_lo, q_hi = block_mask.tile_bounds(q_pos, block_q, jnp.arange(q_pos.shape[1]) < cfg.seq_q)
    kv_lo, kv_hi = block_mask.tile_bounds(ctx["kv_pos"], block_k, jnp.arange(ctx["kv_pos"].shape[1]) < cfg.seq_k)
    kinds = block_mask.band_kinds(q_lo[:, :, None], q_hi[:, :, None], kv_lo[:, None, :], kv_hi[:, None, :], left, right)
    return kinds[:, None]


def edges_partial(kinds, block_q: int, block_k: int, sq: int, sk: int):
    """Tiles that cross the end of either sequence are at most partial: bound checks come with the element mask."""
    if sq % block_q:
        kinds = kinds.at[..., -1, :].min(block_mask.PARTIAL)
    if sk % block_k:
        kinds = kinds.at[..., :, -1].min(block_mask.PARTIAL)
    return kinds


def layout_condition(ctx, cfg) -> block_mask.Layout:
    """The call's block layout (``ctx["layout"]`` [B|1, Hkv|1, G|1, nQ, nK]) as a condition over B|1 x Hq|1."""
    lay = ctx["layout"]
    return block_mask.Layout(lay.reshape(lay.shape[0], -1, *lay.shape[3:]), *cfg.layout_block)


def layout_as_mask(ctx, cfg, batch: int):
    """(ctx, cfg) with the block layout folded into the dense mask, element by element (the XLA and Pallas
    kernels read one mask; they skip the tiles the layout skips through its tile kinds all the same). The
    mask is [B, Hkv|1, G|1, Sq, Sk] over the padded lengths of ``ctx``'s other entries: padding stays hidden."""
    if not cfg.layout:
        return ctx, cfg
    lay = ctx["layout"]
    (bq, bk), (sq, sk) = cfg.layout_block, (cfg.seq_q, cfg.seq_k)
    elements = jnp.repeat(jnp.repeat(lay, bq, axis=3), bk, axis=4)[..., :sq, :sk]
    ctx = dict(ctx)
    del ctx["layout"]
    if cfg.dense_mask:
        mask = ctx["mask"]
        pad = [(0, 0)] * 3 + [(0, mask.shape[3] - sq), (0, mask.shape[4] - sk)]
        ctx["mask"] = mask & jnp.pad(elements, pad, constant_values=False)
    else:
        sq_pad, sk_pad = ctx["q_pos"].shape[1], ctx["kv_pos"].shape[1]
        pad = [(0, 0)] * 3 + [(0, sq_pad - sq), (0, sk_pad - sk)]
        ctx["mask"] = jnp.pad(elements, pad, constant_values=False)
    ctx["mask"] = jnp.broadcast_to(ctx["mask"], (batch,) + ctx["mask"].shape[1:])
    return ctx, dataclasses.replace(cfg, layout=False, layout_block=(0, 0), dense_mask=True)


def union(kinds, axis):
    """Tile kinds of a loop that serves every entry along ``axis`` (batch rows, heads): visited where any entry
    visits, full only where every entry is full."""
    full = jnp.all(kinds == block_mask.FULL, axis=axis)
    seen = jnp.any(kinds != block_mask.SKIP, axis=axis)
    return jnp.where(full, block_mask.FULL, jnp.where(seen, block_mask.PARTIAL, block_mask.SKIP)).astype(jnp.int8)


def over_call(kinds):
    """int32 [nQ, nK] for kernels whose one loop serves every batch row and head."""
    return union(kinds, (0, 1)).astype(jnp.int32)
