"""The XLA backend, shared by every spec: blockwise online softmax, forward and flash-style backward.

A generated `xla.py` holds one spec's hooks (`Hooks`: score, score_grads, param_grads, visible,
kv_blocks, q_blocks, runtime_mask; the names of every backend's) and builds an `XlaAttention` from
them. Layout (the op in `op.py` transposes, pads and groups heads):
  q [B, Hkv, G, Sq, D]    k [B, Hkv, Sk, D]    v [B, Hkv, Sk, Dv]    G = Hq // Hkv
  logits of one block: [B, Hkv, G, BLOCK_Q, BLOCK_K], float32.
Memory is O(S * block): one block of logits is live at a time. Queries go block by block
(`lax.map`); each visits only the key blocks the mask analysis allows, and blocks known to be
fully visible skip the element mask.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ejgen.runtime.attention import tiles
from ejgen.runtime.attention.api import HEADS_MAJOR, given_delta, sinks_grad
from ejgen.runtime.core import kernels as kernel_choice
from ejgen.runtime.core import vma

TENSOR_LAYOUT = HEADS_MAJOR  # q [B, Hkv, G, S, D]: what the kernels below index

NEG_INF = float("-inf")
MAX_BLOCK = 64
MIN_BLOCK = 16


def available():
    """The XLA backend runs wherever JAX runs."""
    return True, ""


def _block_size(n):
    """The largest power of two <= MAX_BLOCK that is not much longer than the sequence."""
    size = MIN_BLOCK
    while size < n and size < MAX_BLOCK:
        size *= 2
    return size


def _einsum(subscripts, a, b):
    """A float32-accumulated product at full float32 precision: on GPUs XLA's default would round float32
    operands to TF32 (~1e-3 relative), short of the float32 accuracy the other backends give."""
    return jnp.einsum(subscripts, a, b, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)


def block_sizes(cfg):
    return _block_size(cfg.seq_q), _block_size(cfg.seq_k)


class Block(NamedTuple):
    """Index grids of one (query block, key block), broadcastable to [B, Hkv, G, BQ, BK]."""

    b: jax.Array
    h: jax.Array
    q_idx: jax.Array
    kv_idx: jax.Array
    q_len: jax.Array
    kv_len: jax.Array
    q_valid: jax.Array
    kv_valid: jax.Array
    q_rows: jax.Array  # [BQ] row numbers in the padded sequence
    kv_rows: jax.Array


def make_block(q_start, q_count, kv_start, kv_count, ctx, cfg, shape):
    batch, kv_heads, groups = shape
    q_rows = q_start + jnp.arange(q_count)
    kv_rows = kv_start + jnp.arange(kv_count)
    q_pos = lax.dynamic_slice_in_dim(ctx["q_pos"], q_start, q_count, axis=1)
    kv_pos = lax.dynamic_slice_in_dim(ctx["kv_pos"], kv_start, kv_count, axis=1)
    if cfg.varlen:
        q_len = lax.dynamic_slice_in_dim(ctx["q_lens"], q_start, q_count, axis=1)[:, None, None, :, None]
        kv_len = lax.dynamic_slice_in_dim(ctx["kv_lens"], q_start, q_count, axis=1)[:, None, None, :, None]
    else:
        q_len, kv_len = jnp.int32(cfg.seq_q), jnp.int32(cfg.seq_k)
    heads = jnp.arange(kv_heads)[:, None] * groups + jnp.arange(groups)[None, :]
    return Block(
        b=jnp.arange(batch)[:, None, None, None, None],
        h=heads[None, :, :, None, None],
        q_idx=q_pos[:, None, None, :, None],
        kv_idx=kv_pos[:, None, None, None, :],
        q_len=q_len,
        kv_len=kv_len,
        q_valid=(q_rows < cfg.seq_q)[None, None, None, :, None],
        kv_valid=(kv_rows < cfg.seq_k)[None, None, None, None, :],
        q_rows=q_rows,
        kv_rows=kv_rows,
    )


def rows_cols(x, blk):
    """The block's [.., BQ, BK] window of a [.., Sq, Sk] array."""
    x = lax.dynamic_slice_in_dim(x, blk.q_rows[0], blk.q_rows.shape[0], axis=3)
    return lax.dynamic_slice_in_dim(x, blk.kv_rows[0], blk.kv_rows.shape[0], axis=4)


def _ranges(visit, full, kinds, run):
    """Run `run(i, carry, masked)` over a visit range: from the block mask when there is one,
    else masked edges and an unmasked middle (as the Triton tutorial's stages)."""
    lo, hi = visit
    flo, fhi = full

    def go(carry):
        if kinds is not None:

            def step(i, c):
                # unmasked only where the block mask and the analysed range (causal, window, the spec's mask)
                # both say every element is visible
                kind = jnp.minimum(kinds[i], 1 + ((i >= flo) & (i < fhi)).astype(jnp.int32))
                branches = (lambda c: c, lambda c: run(i, c, True), lambda c: run(i, c, False))
                return lax.switch(kind, branches, c)

            return lax.fori_loop(lo, hi, step, carry)
        carry = lax.fori_loop(lo, flo, lambda i, c: run(i, c, True), carry)
        carry = lax.fori_loop(flo, fhi, lambda i, c: run(i, c, False), carry)
        return lax.fori_loop(fhi, hi, lambda i, c: run(i, c, True), carry)

    return go


def _sinks(ctx, cfg):
    return ctx["softmax_aux"][None, :, :, None, :] if cfg.sinks else None


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What one spec contributes, as emitted into its `xla.py`; the hooks have the names of the
    Pallas backend's (``ejgen.runtime.attention.pallas.hooks.Hooks``)."""

    grad_params: tuple
    score: Callable  # (s, blk, ctx) -> score
    score_grads: Callable  # (s, blk, ctx) -> (d score / d s, (d score / d each param occurrence,))
    param_grads: Callable | None  # (dparams, contributions, blk, ctx) -> dparams; None without grad_params
    visible: Callable  # (blk, ctx, cfg) -> element mask
    kv_blocks: Callable  # (iq, block_q, block_k, n_kv, ctx, cfg) -> (lo, hi, full_lo, full_hi)
    q_blocks: Callable  # (ik, block_q, block_k, n_q, ctx, cfg) -> (lo, hi, full_lo, full_hi)
    runtime_mask: Callable  # cfg -> whether block skipping needs the block mask computed per call


class XlaAttention:
    """Forward and backward for one spec's hooks."""

    def __init__(self, hooks: Hooks):
        self.hooks = hooks

    def choose(self, call, deterministic: bool):
        """The one kernel set of platform xla. Its param gradients are scatter-adds, which XLA runs with
        atomics on GPUs unless told otherwise: a deterministic call there needs XLA's deterministic ops."""
        del call
        flag = "--xla_gpu_deterministic_ops=true"
        if (deterministic and self.hooks.param_grads is not None and kernel_choice.target().platform == "gpu"
                and flag not in os.environ.get("XLA_FLAGS", "")):
            raise ValueError(f"deterministic=True on platform xla on a GPU: this spec's param gradients are "
                             f"scatter-adds, reproducible only with XLA_FLAGS={flag} set before JAX starts; "
                             f"set it, or use platform='triton' (deterministic by construction)")
        return "xla", "xla", ("forward and backward: xla (the one kernel set of platform xla)",)

    def _logits(self, qb, kb, blk, ctx, cfg):
        """Returns (s, s_score, s_final): after bias, after the score hook, after the soft cap."""
        s = _einsum("bkgqd,bkjd->bkgqj", qb, kb) * ctx["scale"]
        if cfg.bias:
            s = s + rows_cols(ctx["bias"], blk).astype(jnp.float32)
        s_score = jnp.broadcast_to(self.hooks.score(s, blk, ctx), s.shape).astype(jnp.float32)
        s_final = s_score
        if cfg.softcap:
            s_final = ctx["softcap"] * jnp.tanh(s_score / ctx["softcap"])
        return s, s_score, s_final

    def _block_kinds(self, q, k, ctx, cfg, block_q, block_k):
        """Runtime block mask, computed once per call: [n_q_blocks, n_kv_blocks] int32 with
        0 = nothing visible (skip), 1 = partly visible (element mask), 2 = fully visible; over every batch
        row and head (one loop serves them all). `_ranges` also takes the analysed ranges into account."""
        batch, kv_heads, groups, sq, _ = q.shape
        sk = k.shape[2]
        if tiles.classified(self.hooks.runtime_mask, cfg):
            # segment ids / a dense mask alone: their tile kinds (O(tiles) for segment ids), not every element
            return tiles.over_call(tiles.mask_kinds(ctx, cfg, block_q, block_k, sq, sk))

        def row(iq):
            blk = make_block(iq * block_q, block_q, 0, sk, ctx, cfg, (batch, kv_heads, groups))
            vis = jnp.broadcast_to(self.hooks.visible(blk, ctx, cfg), (batch, kv_heads, groups, block_q, sk))
            vis = vis.reshape(batch, kv_heads, groups, block_q, sk // block_k, block_k)
            any_vis = jnp.any(vis, axis=(0, 1, 2, 3, 5))
            all_vis = jnp.all(jnp.logical_or(vis, ~blk.q_valid[..., None]), axis=(0, 1, 2, 3, 5))
            return jnp.where(all_vis, 2, jnp.where(any_vis, 1, 0)).astype(jnp.int32)

        return lax.map(row, jnp.arange(sq // block_q))

    def forward(self, q, k, v, ctx, cfg, kernels=None):
        """(out [B, Hkv, G, Sq, Dv] in q's dtype, lse [B, Hkv, G, Sq] float32, block kinds)."""
        del kernels  # one kernel set (ejgen.runtime.attention.kernels)
        ctx, cfg = tiles.layout_as_mask(ctx, cfg, q.shape[0])
        batch, kv_heads, groups, sq, _ = q.shape
        sk, dv = k.shape[2], v.shape[-1]
        block_q, block_k = block_sizes(cfg)
        n_q, n_kv = sq // block_q, sk // block_k
        shape = (batch, kv_heads, groups)
        kinds = self._block_kinds(q, k, ctx, cfg, block_q, block_k) if self.hooks.runtime_mask(cfg) else None
        axes = vma.varying_axes(q, k, v, ctx)  # inside shard_map: loop carries vary as the blocks they meet

        def query_block(iq):
            qb = lax.dynamic_slice_in_dim(q, iq * block_q, block_q, axis=3)

            def run(ik, carry, masked):
                m, l, acc = carry
                kb = lax.dynamic_slice_in_dim(k, ik * block_k, block_k, axis=2)
                vb = lax.dynamic_slice_in_dim(v, ik * block_k, block_k, axis=2)
                blk = make_block(iq * block_q, block_q, ik * block_k, block_k, ctx, cfg, shape)
                _, _, s = self._logits(qb, kb, blk, ctx, cfg)
                if masked:
                    s = jnp.where(self.hooks.visible(blk, ctx, cfg), s, NEG_INF)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
                p = jnp.exp(s - m_safe[..., None])
                alpha = jnp.exp(m - m_safe)
                l = l * alpha + jnp.sum(p, axis=-1)
                pv = _einsum("bkgqj,bkjd->bkgqd", p.astype(v.dtype), vb)
                return m_new, l, acc * alpha[..., None] + pv

            if cfg.varlen or cfg.positions:  # no index ranges: the block kinds decide
                visit = full = (0, n_kv)
            else:
                lo, hi, flo, fhi = self.hooks.kv_blocks(iq, block_q, block_k, n_kv, ctx, cfg)
                visit, full = (lo, hi), (flo, fhi)
            init = vma.vary((
                jnp.full(shape + (block_q,), NEG_INF, jnp.float32),
                jnp.zeros(shape + (block_q,), jnp.float32),
                jnp.zeros(shape + (block_q, dv), jnp.float32),
            ), axes)
            m, l, acc = _ranges(visit, full, None if kinds is None else kinds[iq], run)(init)
            sinks = _sinks(ctx, cfg)
            if sinks is not None:
                m_all = jnp.maximum(m, jnp.max(sinks, axis=-1))
                alpha = jnp.exp(m - m_all)
                l = l * alpha + jnp.sum(jnp.exp(sinks - m_all[..., None]), axis=-1)
                acc = acc * alpha[..., None]
                m = m_all
            seen = l != 0  # a NaN row stays NaN (docs/DESIGN.md §3 step 5); only a row that saw nothing is 0
            lse = jnp.where(seen, jnp.where(seen, m, 0.0) + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF)
            out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
            return out.astype(q.dtype), lse

        out, lse = lax.map(query_block, jnp.arange(n_q))
        out = jnp.moveaxis(out, 0, 3).reshape(batch, kv_heads, groups, sq, dv)
        lse = jnp.moveaxis(lse, 0, 3).reshape(batch, kv_heads, groups, sq)
        return out, lse, kinds

    def backward(self, q, k, v, out, lse, kinds, d_out, d_lse, ctx, cfg, kernels=None):
        """Gradients (dq, dk, dv, dctx) from the saved lse; keys block by block, queries inside.

        ds = p * (dp - delta) with delta = rowsum(d_out * out) - d_lse, then back through the soft
        cap and the score hook. Every reduction runs in a fixed order: results are deterministic.
        """
        del kernels
        ctx, delta = given_delta(ctx)
        ctx, cfg = tiles.layout_as_mask(ctx, cfg, q.shape[0])
        batch, kv_heads, groups, sq, _ = q.shape
        sk = k.shape[2]
        block_q, block_k = block_sizes(cfg)
        n_q, n_kv = sq // block_q, sk // block_k
        shape = (batch, kv_heads, groups)
        f32 = jnp.float32
        if delta is None:
            delta = jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1) - d_lse
        lse_safe = jnp.where(lse == NEG_INF, 0.0, lse)
        if kinds is None and self.hooks.runtime_mask(cfg):  # not from a forward of this call (ring attention's steps)
            kinds = self._block_kinds(q, k, ctx, cfg, block_q, block_k)
        kinds_t = None if kinds is None else kinds.T
        axes = vma.varying_axes(q, k, v, ctx, d_out)

        def key_block(ik, carry):
            dq, dk, dv, dctx = carry
            kb = lax.dynamic_slice_in_dim(k, ik * block_k, block_k, axis=2)
            vb = lax.dynamic_slice_in_dim(v, ik * block_k, block_k, axis=2)

            def run(iq, inner, masked):
                dq, dk_b, dv_b, dctx = inner
                rows = iq * block_q
                qb = lax.dynamic_slice_in_dim(q, rows, block_q, axis=3)
                dob = lax.dynamic_slice_in_dim(d_out, rows, block_q, axis=3)
                lse_b = lax.dynamic_slice_in_dim(lse_safe, rows, block_q, axis=3)
                delta_b = lax.dynamic_slice_in_dim(delta, rows, block_q, axis=3)
                blk = make_block(rows, block_q, ik * block_k, block_k, ctx, cfg, shape)
                s, s_score, s_final = self._logits(qb, kb, blk, ctx, cfg)
                p = jnp.exp(s_final - lse_b[..., None])
                if masked:
                    vis = self.hooks.visible(blk, ctx, cfg)
                    p = jnp.where(vis, p, 0.0)
                dv_b = dv_b + _einsum("bkgqj,bkgqd->bkjd", p.astype(d_out.dtype), dob)
                dp = _einsum("bkgqd,bkjd->bkgqj", dob, vb)
                ds = p * (dp - delta_b[..., None])
                if cfg.softcap:
                    t = jnp.tanh(s_score / ctx["softcap"])
                    ds = ds * (1.0 - t * t)
                d_score, d_params = self.hooks.score_grads(s, blk, ctx)
                contribs = tuple(ds * d for d in d_params)
                ds = ds * d_score
                if masked:
                    ds = jnp.where(vis, ds, 0.0)
                    contribs = tuple(jnp.where(vis, c, 0.0) for c in contribs)
                if self.hooks.grad_params:
                    dctx = dict(dctx, params=self.hooks.param_grads(dctx["params"], contribs, blk, ctx))
                if cfg.bias:
                    bias = ctx["bias"]
                    db = jnp.sum(ds, axis=tuple(i for i in range(3) if bias.shape[i] == 1), keepdims=True)
                    old = rows_cols(dctx["bias"], blk)
                    db_all = lax.dynamic_update_slice(dctx["bias"], old + db, (0, 0, 0, rows, ik * block_k))
                    dctx = dict(dctx, bias=db_all)
                dq_b = _einsum("bkgqj,bkjd->bkgqd", ds, kb.astype(f32)) * ctx["scale"]
                dq = lax.dynamic_update_slice_in_dim(dq, lax.dynamic_slice_in_dim(dq, rows, block_q, 3) + dq_b, rows, 3)
                dk_b = dk_b + _einsum("bkgqj,bkgqd->bkjd", ds, qb.astype(f32)) * ctx["scale"]
                return dq, dk_b, dv_b, dctx

            if cfg.varlen or cfg.positions:  # no index ranges: the block kinds decide
                visit = full = (0, n_q)
            else:
                lo, hi, flo, fhi = self.hooks.q_blocks(ik, block_q, block_k, n_q, ctx, cfg)
                visit, full = (lo, hi), (flo, fhi)
            zeros_k = jnp.zeros((batch, kv_heads, block_k, k.shape[-1]), f32)
            zeros_v = jnp.zeros((batch, kv_heads, block_k, v.shape[-1]), f32)
            inner = (dq, *vma.vary((zeros_k, zeros_v), axes), dctx)
            dq, dk_b, dv_b, dctx = _ranges(visit, full, None if kinds_t is None else kinds_t[ik], run)(inner)
            dk = lax.dynamic_update_slice_in_dim(dk, dk_b, ik * block_k, 2)
            dv = lax.dynamic_update_slice_in_dim(dv, dv_b, ik * block_k, 2)
            return dq, dk, dv, dctx

        dctx = {}
        if self.hooks.grad_params:
            dctx["params"] = {name: jnp.zeros(ctx["param_" + name].shape, f32) for name in self.hooks.grad_params}
        if cfg.bias:
            dctx["bias"] = jnp.zeros(ctx["bias"].shape, f32)
        init = vma.vary((jnp.zeros(q.shape, f32), jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32), dctx), axes)
        dq, dk, dv, dctx = lax.fori_loop(0, n_kv, key_block, init)
        if cfg.sinks:
            dctx["softmax_aux"] = sinks_grad(ctx["softmax_aux"], lse, delta, cfg.seq_q)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dctx

