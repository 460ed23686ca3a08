"""What one spec contributes to the Pallas kernels (`Hooks`, emitted into its generated
``pallas.py``), the index grids they see (`Tile`), and what both kernel families derive from them:
a tile's logits and gradients, and the block kinds of one call.

The hooks have the names of every backend's (``ejgen.runtime.attention.xla.Hooks``): score,
score_grads, param_grads, visible, kv_blocks, q_blocks, runtime_mask; the Pallas kernels also read
the spec's scalars and params through scalars, pack_scalars and params_of, and the params read by
one side's positions through token_views (`with_token_views`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ejgen.runtime.attention import tiles


class Tile(NamedTuple):
    """Index grids of one tile of logits (inside the kernels) or of whole rows of blocks (block
    metadata), broadcastable to the logits. Fields are named as in the spec's DSL."""

    b: jax.Array
    h: jax.Array
    q_idx: jax.Array  # position in the sequence
    kv_idx: jax.Array
    q_len: jax.Array  # the sequence's length (varlen: per query row)
    kv_len: jax.Array
    q_valid: jax.Array  # a real query, not padding
    kv_valid: jax.Array
    q_seg: jax.Array | None = None  # segment ids (varlen: sequence ids); None without segments
    kv_seg: jax.Array | None = None
    mask: jax.Array | None = None  # the dense mask's tile; nonzero = visible
    q_tok: tuple = ()  # the token views' values (`with_token_views`): per query row
    kv_tok: tuple = ()  # per key


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What one spec contributes, as emitted into its `pallas.py`. ``t`` is a `Tile`, ``sc`` the
    spec's scalars, ``prm`` its params by name (refs inside the kernels, arrays outside)."""

    name: str
    params: tuple
    grad_params: tuple
    score_is_identity: bool
    scalars: Callable  # (f32, i32) -> sc, the spec's scalars
    pack_scalars: Callable  # ctx -> (F32, I32)
    params_of: Callable  # ctx -> prm, {name: param}
    score: Callable  # (s, t, sc, prm) -> score
    score_grads: Callable  # (s, t, sc, prm) -> (d score / d s, (d score / d each param occurrence,))
    param_grads: Callable  # (acc, ds1, s, t, sc, prm, vis) -> acc, the param-gradient accumulators
    visible: Callable  # (t, sc, prm, cfg) -> element mask
    kv_blocks: Callable  # (n_q, block_q, block_k, n_kv, sc, cfg) -> [n_q, 4] (lo, hi, full_lo, full_hi)
    q_blocks: Callable  # (n_kv, block_q, block_k, n_q, sc, cfg) -> [n_kv, 4] (lo, hi, full_lo, full_hi)
    runtime_mask: Callable  # cfg -> whether block skipping needs the block mask computed per call
    token_views: Callable | None = None  # (t, sc, prm) -> (q views, kv views): params read by one side's positions
    kernel_params: tuple | None = None  # the params the kernels read themselves; None: all

    @property
    def in_kernel(self) -> tuple:
        """The params the kernels take as operands; the others are read through token views only (a large
        [batch, kv_len] param never reaches TPU scalar memory)."""
        return self.params if self.kernel_params is None else self.kernel_params


def with_token_views(hooks: Hooks, ctx: dict, sc, prm, cfg, batch: int, heads: int) -> dict:
    """``ctx`` with the spec's token views, ``q_tok`` and ``kv_tok``: each read by one side's positions evaluated
    once over whole rows, [B|1, H|1, S] with S the padded length (positions and lengths padded as the op pads
    them, indices clamped as the DSL clamps them; padded rows are never visible). The kernels read their tiles
    by block, whatever the size of the param's dim."""
    if hooks.token_views is None:
        return ctx
    grid = lambda x: x[:, None, :]  # [B|1, S] -> [B|1, 1, S]
    t = Tile(
        b=jnp.arange(batch, dtype=jnp.int32)[:, None, None],
        h=jnp.arange(heads, dtype=jnp.int32)[None, :, None],
        q_idx=grid(ctx["q_pos"]),
        kv_idx=grid(ctx["kv_pos"]),
        q_len=grid(ctx["q_lens"]) if cfg.varlen else cfg.seq_q,
        kv_len=grid(ctx["kv_lens"]) if cfg.varlen else cfg.seq_k,
        q_valid=None,
        kv_valid=None,
    )
    q, kv = hooks.token_views(t, sc, prm)

    def rows(x, n):
        x = jnp.asarray(x)
        x = x.reshape((1,) * (3 - x.ndim) + x.shape)
        return jnp.broadcast_to(x, x.shape[:2] + (n,))

    return {**ctx, "q_tok": tuple(rows(x, ctx["q_pos"].shape[1]) for x in q),
            "kv_tok": tuple(rows(x, ctx["kv_pos"].shape[1]) for x in kv)}


def views_by_head(ctx: dict, side: str, kv_heads: int, groups: int) -> tuple:
    """The token views of one side as [B|1, Hkv|1, G|1, S] (query head h = kv head * groups + member)."""
    return tuple(x[:, :, None] if x.shape[1] == 1 else x.reshape(x.shape[0], kv_heads, groups, x.shape[2])
                 for x in ctx.get(side + "_tok", ()))


def make_tile(b, h, rows, cols, q_side, k_side, mask, cfg, q_tok=(), kv_tok=()):
    """The `Tile` of query rows x key columns; ``q_side(name)`` / ``k_side(name)`` read a per-position
    array (positions, lengths, segment ids) shaped for the rows / columns; ``q_tok``, ``kv_tok`` the token
    views' values so shaped."""
    segments = cfg.segments or cfg.varlen
    return Tile(
        b=b,
        h=h,
        q_idx=q_side("q_pos") if cfg.varlen or cfg.positions else rows,
        kv_idx=k_side("kv_pos") if cfg.varlen or cfg.positions else cols,
        q_len=q_side("q_lens") if cfg.varlen else cfg.seq_q,
        kv_len=q_side("kv_lens") if cfg.varlen else cfg.seq_k,
        q_valid=rows < cfg.seq_q,
        kv_valid=cols < cfg.seq_k,
        q_seg=q_side("q_seg") if segments else None,
        kv_seg=k_side("kv_seg") if segments else None,
        mask=mask,
        q_tok=tuple(q_tok),
        kv_tok=tuple(kv_tok),
    )


def logits(hooks: Hooks, s, t, sc, prm, cfg):
    """(s, s_score, s_final) of a tile from s = scale * q k^T (+ bias): as given, after the score
    hook, after the soft cap."""
    if hooks.score_is_identity:
        s_score = s
    else:
        s_score = jnp.broadcast_to(hooks.score(s, t, sc, prm), s.shape).astype(jnp.float32)
    s_final = s_score
    if cfg.softcap:
        s_final = sc.softcap * jnp.tanh(s_score / sc.softcap)
    return s, s_score, s_final


def grads_tile(hooks: Hooks, s, t, sc, prm, cfg, lse, dp, delta, masked, exp):
    """(p, ds1, ds0, vis) of one tile: probabilities; d loss / d score (through the soft cap);
    d loss / d logit (through the score hook); the element mask (None when not ``masked``)."""
    s, s_score, s_final = logits(hooks, s, t, sc, prm, cfg)
    p = exp(s_final - lse)
    vis = hooks.visible(t, sc, prm, cfg) if masked else None
    if masked:
        p = jnp.where(vis, p, 0.0)
    ds1 = p * (dp - delta)
    if cfg.softcap:
        th = jnp.tanh(s_score / sc.softcap)
        ds1 = ds1 * (1.0 - th * th)
    ds0 = ds1 if hooks.score_is_identity else ds1 * hooks.score_grads(s, t, sc, prm)[0]
    if masked:
        ds0 = jnp.where(vis, ds0, 0.0)
        ds1 = jnp.where(vis, ds1, 0.0)
    return p, ds1, ds0, vis


def dense_kinds(hooks: Hooks, block_q, block_k, ctx, sc, prm, cfg, shape):
    """[n_q, n_kv] block kinds (0 skip, 1 element mask, 2 no mask) over every batch row and head. Segment ids
    and dense masks alone: from their tile classifiers (ejgen.types.block_mask; O(tiles) for segment ids; the
    kernels combine them with the analysed causal / window ranges). Otherwise (varlen, a spec mask the analysis
    cannot bound) from the element mask over whole rows of blocks, one row at a time."""
    batch, kv_heads, groups, sq, sk = shape
    if tiles.classified(hooks.runtime_mask, cfg):
        return tiles.over_call(tiles.mask_kinds(ctx, cfg, block_q, block_k, sq, sk))
    heads = jnp.arange(kv_heads)[:, None] * groups + jnp.arange(groups)[None, :]
    segments = cfg.segments or cfg.varlen
    cols = lambda x: x[:, None, None, None, :]
    q_views, kv_views = (views_by_head(ctx, side, kv_heads, groups) for side in ("q", "kv"))

    def row(iq):
        rows = lambda x: lax.dynamic_slice_in_dim(x, iq * block_q, block_q, axis=1)[:, None, None, :, None]
        t = Tile(
            b=jnp.arange(batch)[:, None, None, None, None],
            h=heads[None, :, :, None, None],
            q_idx=rows(ctx["q_pos"]),
            kv_idx=cols(ctx["kv_pos"]),
            q_len=rows(ctx["q_lens"]) if cfg.varlen else cfg.seq_q,
            kv_len=rows(ctx["kv_lens"]) if cfg.varlen else cfg.seq_k,
            q_valid=(iq * block_q + jnp.arange(block_q) < cfg.seq_q)[:, None],
            kv_valid=jnp.arange(sk) < cfg.seq_k,
            q_seg=rows(ctx["q_seg"]) if segments else None,
            kv_seg=cols(ctx["kv_seg"]) if segments else None,
            mask=lax.dynamic_slice_in_dim(ctx["mask"], iq * block_q, block_q, axis=3) if cfg.dense_mask else None,
            q_tok=tuple(lax.dynamic_slice_in_dim(x, iq * block_q, block_q, axis=3)[..., None] for x in q_views),
            kv_tok=tuple(x[..., None, :] for x in kv_views),
        )
        vis = jnp.broadcast_to(hooks.visible(t, sc, prm, cfg), (batch, kv_heads, groups, block_q, sk))
        vis = vis.reshape(batch, kv_heads, groups, block_q, sk // block_k, block_k)
        any_vis = jnp.any(vis, axis=(0, 1, 2, 3, 5))
        all_vis = jnp.all(vis, axis=(0, 1, 2, 3, 5))
        return jnp.where(all_vis, 2, jnp.where(any_vis, 1, 0)).astype(jnp.int32)

    return lax.map(row, jnp.arange(sq // block_q))
