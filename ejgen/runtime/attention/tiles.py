"""Tile kinds of a call's runtime masks, shared by every backend (docs/DESIGN.md §3, block masks): segment ids
and a dense mask classified per tile by `ejgen.types.block_mask` (O(tiles) for segment ids), from the op's
ctx in the kernel layout (ids [B, S] and the mask [B, Hkv|1, G|1, Sq, Sk], both padded so that padding is
never visible: tiles holding it are never full)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

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


def band_kinds(ctx, cfg, block_q: int, block_k: int, sq: int, sk: int):
    """int8 [1|B, 1, nQ, nK]: the tiles causal and the window leave (the window's bounds traced: no recompile). With
    explicit positions, from each tile's least and greatest position (``ctx`` holds the query positions shifted by
    ``kv_len - q_len``, so that the aligned rules of the kernels compare positions)."""
    left = ctx["window_left"] if cfg.window else None
    right = jnp.int32(0) if cfg.causal else (ctx["window_right"] if cfg.window else None)
    if not cfg.positions:
        return block_mask.Band(left, right).kinds(block_q, block_k, sq, sk)
    qlo, qhi = _per_tile(ctx["q_pos"] + (cfg.seq_k - cfg.seq_q), block_q, cfg.seq_q)
    klo, khi = _per_tile(ctx["kv_pos"], block_k, cfg.seq_k)
    qlo, qhi, klo, khi = qlo[:, :, None], qhi[:, :, None], klo[:, None, :], khi[:, None, :]
    any_v = jnp.ones(jnp.broadcast_shapes(qlo.shape, klo.shape), bool)
    all_v = any_v
    if right is not None:  # kv <= q + right
        any_v &= klo <= qhi + right
        all_v &= khi <= qlo + right
    if left is not None:  # kv >= q - left
        any_v &= khi >= qlo - left
        all_v &= klo >= qhi - left
    kinds = jnp.where(all_v, block_mask.FULL, jnp.where(any_v, block_mask.PARTIAL, block_mask.SKIP))
    return kinds.astype(jnp.int8)[:, None]


def _per_tile(pos, block: int, n: int):
    """Least and greatest position of each tile of ``block`` over the first ``n`` entries of ``pos`` [B|1, S]."""
    tiles = -(-pos.shape[1] // block)
    pad = tiles * block - pos.shape[1]
    valid = (jnp.arange(tiles * block) < n).reshape(tiles, block)
    pos = jnp.pad(pos, ((0, 0), (0, pad))).reshape(pos.shape[0], tiles, block)
    big = jnp.iinfo(jnp.int32).max
    return jnp.min(jnp.where(valid, pos, big), axis=-1), jnp.max(jnp.where(valid, pos, -big), axis=-1)


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
