"""The Pallas backend, shared by every spec: FlashAttention-2 kernels for GPUs (Triton lowering,
`gpu`) and TPUs (Mosaic, `tpu`), chosen per lowering platform; on any other platform the kernels
run interpreted (`common.interpret_kernels`).

Layout (from `op.py`, padded to whole PAD blocks):
  q [B, Hkv, G, Sq, D]   k [B, Hkv, Sk, D]   v [B, Hkv, Sk, Dv]   G = Hq // Hkv
  out [B, Hkv, G, Sq, Dv] in q's dtype, lse [B, Hkv, G, Sq] float32
One tile of logits s [block_q, block_k], float32, products accumulated in float32:
  s = scale * q k^T (+ bias)  ->  s = score(s)  ->  s = softcap * tanh(s / softcap)  ->  mask
A generated `pallas.py` holds the spec's hooks (`hooks.Hooks`: score, score_grads, param_grads,
visible, kv_blocks, q_blocks, runtime_mask) and builds a `PallasAttention` from them; everything
else is in this package, once.
Block metadata comes from the mask analysis, once per call outside the kernels: per block of
queries the key blocks to visit and those that need no element mask (`kv_blocks`; `q_blocks`, the
transpose, for the dK/dV kernel); masks only known at run time refine it into block kinds (0 skip,
1 element mask, 2 no mask).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from ejgen.runtime.attention import tiles
from ejgen.runtime.attention.api import HEADS_MAJOR, given_delta, sinks_grad
from ejgen.runtime.attention.pallas import common as _rt
from ejgen.runtime.attention.pallas.common import NEG_INF, PAD
from ejgen.runtime.attention.pallas.gpu import BlockSizes, GpuKernels
from ejgen.runtime.attention.pallas.hooks import Hooks
from ejgen.runtime.attention.pallas.tpu import TpuBlockSizes, TpuKernels

__all__ = ["TENSOR_LAYOUT", "BlockSizes", "Hooks", "PallasAttention", "TpuBlockSizes", "available", "block_sizes"]

TENSOR_LAYOUT = HEADS_MAJOR  # q [B, Hkv, G, S, D]: what the kernels index


def available():
    return _rt.available()


def block_sizes(cfg):
    """Padding granularity of the inputs: PAD on both axes, whatever the platform."""
    del cfg
    return PAD, PAD


class PallasAttention:
    """Forward and backward for one spec's hooks: the GPU or the TPU kernels, per lowering platform."""

    def __init__(self, hooks: Hooks):
        self.hooks = hooks
        self.gpu = GpuKernels(hooks)
        self.tpu = TpuKernels(hooks)

    def forward(self, q, k, v, ctx, cfg, kernels=None):
        """(out, lse, None) from the kernels of the lowering platform; the backward pass recomputes
        its block metadata, so nothing else is saved."""
        del kernels  # one kernel set (ejgen.runtime.attention.kernels)
        ctx, cfg = tiles.layout_as_mask(ctx, cfg, q.shape[0])
        gpu = functools.partial(self.gpu.forward, cfg=cfg)
        tpu = functools.partial(self.tpu.forward, cfg=cfg)
        out, lse = _rt.dispatch(gpu, tpu, q, k, v, ctx)
        return out, lse, None

    def backward(self, q, k, v, out, lse, kinds, d_out, d_lse, ctx, cfg, kernels=None):
        """Gradients (dq, dk, dv, dctx) from the saved lse: ds = p * (dp - delta) with
        delta = rowsum(d_out * out) - d_lse, then back through the soft cap and the score hook."""
        del kernels, kinds
        ctx, delta = given_delta(ctx)
        ctx, cfg = tiles.layout_as_mask(ctx, cfg, q.shape[0])
        f32 = jnp.float32
        if delta is None:
            delta = jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1) - d_lse
        lse_safe = jnp.where(lse == NEG_INF, 0.0, lse)
        gpu = functools.partial(self.gpu.backward, cfg=cfg)
        tpu = functools.partial(self.tpu.backward, cfg=cfg)
        dq, dk, dv, dbias, dparams = _rt.dispatch(gpu, tpu, q, k, v, d_out, lse_safe, delta, ctx)
        dctx = {}
        if cfg.bias:
            bias = ctx["bias"]
            dctx["bias"] = jnp.sum(dbias, axis=tuple(i for i in range(3) if bias.shape[i] == 1), keepdims=True)
        if cfg.sinks:
            dctx["softmax_aux"] = sinks_grad(ctx["softmax_aux"], lse, delta, cfg.seq_q)
        if self.hooks.grad_params:
            dctx["params"] = {name: dparams[name][:ctx["param_" + name].size].reshape(ctx["param_" + name].shape)
                              for name in self.hooks.grad_params}
        return dq, dk, dv, dctx
