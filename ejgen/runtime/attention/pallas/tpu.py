"""The Pallas kernels for TPUs (Mosaic): FlashAttention-2 forward, a dK/dV kernel and a dQ kernel,
with their tiles (`TpuBlockSizes`) and operands.

The key blocks are the innermost grid axis, m, l and acc live in VMEM scratch; the block kinds
(from the `Hooks.kv_blocks` table, refined by the runtime block mask when `Hooks.runtime_mask` asks
for it) are scalar-prefetched, and a skipped step repeats the previous block index (no DMA). Row
vectors are lane-replicated [rows, 128], column vectors sublane-replicated [8, cols].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ejgen.runtime.attention.pallas import common as _rt
from ejgen.runtime.attention.pallas.common import NEG_INF, NN, NT, NUM_LANES, NUM_SUBLANES, PAD
from ejgen.runtime.attention.pallas.hooks import Hooks, dense_kinds, grads_tile, logits, make_tile, with_token_views
from ejgen.runtime.core import vma


@dataclasses.dataclass(frozen=True)
class TpuBlockSizes:
    """Tiles of the TPU kernels: PAD (the lane width) times a power of two, so that every block
    respects Mosaic's (8, 128) tiling; `fit` halves them until they divide the padded lengths."""

    block_q: int = 256
    block_k: int = 256

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            size = getattr(self, name)
            if size < PAD or size % PAD or (size // PAD) & (size // PAD - 1):
                raise ValueError(f"TpuBlockSizes.{name} must be {PAD} times a power of two, got {size}")

    @staticmethod
    def get_default(interpret=False) -> "TpuBlockSizes":
        """The defaults; interpreted (``interpret`` True or TPU interpreter params): the smallest."""
        return TpuBlockSizes(PAD, PAD) if interpret else TpuBlockSizes()

    def fit(self, seq_q: int, seq_k: int) -> "TpuBlockSizes":
        block_q, block_k = self.block_q, self.block_k
        while seq_q % block_q:
            block_q //= 2
        while seq_k % block_k:
            block_k //= 2
        return TpuBlockSizes(block_q, block_k)


def _tile(r, b, h, i_q, i_k, block_q, block_k, cfg):
    """The `Tile` of a [block_q, block_k] step: row vectors (token views included) come lane-replicated
    [block_q, 128], column vectors sublane-replicated [8, block_k]."""
    shape = (block_q, block_k)
    rows = i_q * block_q + lax.broadcasted_iota(jnp.int32, shape, 0)
    cols = i_k * block_k + lax.broadcasted_iota(jnp.int32, shape, 1)
    q_side = lambda name: _rt.lanes(r[name][...], block_k)
    k_side = lambda name: r[name][:1, :]
    views = lambda side: [name for name in r if name.startswith(side + "_tok")]
    return make_tile(b, h, rows, cols, q_side, k_side, r["mask"][...] if cfg.dense_mask else None, cfg,
                     [q_side(name) for name in views("q")], [k_side(name) for name in views("kv")])


def _operands(q, k, v, ctx, cfg, scalars, prm, blocks, coords, q_side=()):
    """Inputs of a TPU kernel with their BlockSpecs. ``coords(*grid, kinds, fetch)`` gives the
    (batch, kv head, group member, query block, key block) that a grid step reads. Scalars, params
    and sinks sit in SMEM; q-side vectors are lane-replicated, k-side ones sublane-replicated (token
    views too: [B|1, H|1, S] as [B|1, H|1, S, 128] and [B|1, H|1, 8, S])."""
    d, dv = q.shape[-1], v.shape[-1]
    groups = q.shape[2]
    block_q, block_k = blocks.block_q, blocks.block_k
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)

    def spec(shape, index):
        return pl.BlockSpec(shape, lambda *idx: index(*coords(*idx)))

    def logits_like(x):  # [B|1, Hkv|1, G|1, Sq, Sk]
        pick = lambda axis, j: j if x.shape[axis] > 1 else 0
        return spec((None, None, None, block_q, block_k),
                    lambda b, hk, g, iq, ik: (pick(0, b), pick(1, hk), pick(2, g), iq, ik))

    def q_like(x):  # [B, Hkv, G, Sq, X]
        return spec((None, None, None, block_q, x.shape[-1]), lambda b, hk, g, iq, ik: (b, hk, g, iq, 0))

    def view(x, shape, index):  # a token view, [B|1, H|1, ...]: the query head's
        pick = lambda axis, j: j if x.shape[axis] > 1 else 0
        return spec(shape, lambda b, hk, g, iq, ik: (pick(0, b), pick(1, hk * groups + g)) + index(iq, ik))

    ops = _rt.Operands()
    ops.add("f32", scalars[0], smem)
    ops.add("i32", scalars[1], smem)
    for name, x in prm.items():  # the params the kernels read themselves (`Hooks.in_kernel`)
        ops.add("param_" + name, x, smem)
    if cfg.sinks:
        aux = ctx["softmax_aux"]
        ops.add("aux", aux.reshape(-1, aux.shape[-1]), smem)
    ops.add("q", q, q_like(q))
    for name, x in q_side:
        x = x if x.ndim == 5 else _rt.to_lanes(x)  # lse, delta: lane-replicated
        ops.add(name, x, q_like(x))
    ops.add("k", k, spec((None, None, block_k, d), lambda b, hk, g, iq, ik: (b, hk, ik, 0)))
    ops.add("v", v, spec((None, None, block_k, dv), lambda b, hk, g, iq, ik: (b, hk, ik, 0)))
    if cfg.bias:
        ops.add("bias", ctx["bias"], logits_like(ctx["bias"]))
    if cfg.dense_mask:
        ops.add("mask", ctx["mask"].astype(jnp.int32), logits_like(ctx["mask"]))
    segments = cfg.segments or cfg.varlen
    placed = cfg.varlen or cfg.positions
    for name, used in (("q_pos", placed), ("q_lens", cfg.varlen), ("kv_lens", cfg.varlen), ("q_seg", segments)):
        if used:
            ops.add(name, _rt.to_lanes(ctx[name]), spec((None, block_q, NUM_LANES), lambda b, hk, g, iq, ik: (b, iq, 0)))
    for name, used in (("kv_pos", placed), ("kv_seg", segments)):
        if used:
            ops.add(name, _rt.to_sublanes(ctx[name]), spec((None, NUM_SUBLANES, block_k), lambda b, hk, g, iq, ik: (b, 0, ik)))
    for i, x in enumerate(ctx.get("q_tok", ())):
        ops.add(f"q_tok{i}", _rt.to_lanes(x), view(x, (None, None, block_q, NUM_LANES), lambda iq, ik: (iq, 0)))
    for i, x in enumerate(ctx.get("kv_tok", ())):
        x8 = jnp.broadcast_to(x[:, :, None, :], x.shape[:2] + (NUM_SUBLANES, x.shape[2]))
        ops.add(f"kv_tok{i}", x8, view(x, (None, None, NUM_SUBLANES, block_k), lambda iq, ik: (0, ik)))
    return ops


def _compiler_params(*semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


class TpuKernels:
    """The TPU kernels and their launches for one spec's hooks; inputs and outputs in the kernel
    layout (q [B, Hkv, G, S, D], as `PallasAttention`)."""

    def __init__(self, hooks: Hooks):
        self.hooks = hooks

    def _kinds(self, block_q, block_k, ctx, sc, prm, cfg, shape):
        """[n_q, n_kv] block kinds from `Hooks.kv_blocks`, refined by the runtime block mask when there is one."""
        n_q, n_kv = shape[3] // block_q, shape[4] // block_k
        kinds = _rt.kinds_from_ranges(self.hooks.kv_blocks(n_q, block_q, block_k, n_kv, sc, cfg), n_kv)
        if self.hooks.runtime_mask(cfg):
            kinds = jnp.minimum(kinds, dense_kinds(self.hooks, block_q, block_k, ctx, sc, prm, cfg, shape))
        return kinds

    def _fwd_kernel(self, kinds_ref, fetch_ref, *refs, names, cfg, blocks, n_kv, groups, n_sinks, precision):
        """One step (query block, key block) of one head; the key axis is the innermost grid axis and
        m, l, acc live in VMEM scratch across it."""
        del fetch_ref  # read by the index maps
        r = dict(zip(names, refs))
        o_ref, lse_ref, m_scr, l_scr, acc_scr = refs[len(names):]
        block_q, block_k = blocks.block_q, blocks.block_k
        b, h, i_q, i_k = (pl.program_id(i) for i in range(4))
        kind = kinds_ref[i_q, i_k]
        dv = acc_scr.shape[-1]

        @pl.when(i_k == 0)
        def _init():
            m_scr[...] = jnp.full(m_scr.shape, NEG_INF, jnp.float32)
            l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
            acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

        def step(masked):
            sc = self.hooks.scalars(r["f32"], r["i32"])
            prm = {name: r["param_" + name] for name in self.hooks.in_kernel}
            q = r["q"][...]  # [block_q, D]
            k = r["k"][...]  # [block_k, D]
            s = lax.dot_general(q, k, NT, precision=precision, preferred_element_type=jnp.float32) * sc.scale
            if cfg.bias:
                s = s + r["bias"][...].astype(jnp.float32)
            t = _tile(r, b, h, i_q, i_k, block_q, block_k, cfg)
            _, _, s = logits(self.hooks, s, t, sc, prm, cfg)
            if masked:
                s = jnp.where(self.hooks.visible(t, sc, prm, cfg), s, NEG_INF)
            m_prev, l_prev = m_scr[...], l_scr[...]  # [block_q, 128]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            m_use = jnp.where(m_next == NEG_INF, 0.0, m_next)
            p = jnp.exp(s - _rt.lanes(m_use, block_k))  # [block_q, block_k]
            alpha = jnp.exp(m_prev - m_use)
            l_scr[...] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            m_scr[...] = m_next
            v = r["v"][...]  # [block_k, Dv]
            pv = lax.dot_general(p.astype(v.dtype), v, NN, precision=precision, preferred_element_type=jnp.float32)
            acc_scr[...] = acc_scr[...] * _rt.lanes(alpha, dv) + pv

        pl.when(kind == 1)(lambda: step(True))
        pl.when(kind == 2)(lambda: step(False))

        @pl.when(i_k == n_kv - 1)
        def _finish():
            m, l, acc = m_scr[...], l_scr[...], acc_scr[...]
            if cfg.sinks:
                m, l, alpha = _rt.add_sinks(m, l, [r["aux"][h, j] for j in range(n_sinks)])
                acc = acc * _rt.lanes(alpha, dv)
            seen = l != 0.0  # a NaN row stays NaN (docs/DESIGN.md §3 step 5)
            l_safe = jnp.where(seen, l, 1.0)
            lse_ref[...] = jnp.where(seen, jnp.where(seen, m, 0.0) + jnp.log(l_safe), NEG_INF)
            o_ref[...] = (acc * _rt.lanes(jnp.where(seen, 1.0 / l_safe, 0.0), dv)).astype(o_ref.dtype)

    def _grads_tile(self, r, b, h, i_q, i_k, block_q, block_k, cfg, precision, masked):
        """What both TPU backward kernels compute for one tile: (q, k, do, s, t, scalars, params,
        (p, ds1, ds0, vis)), every tile [block_q, block_k]."""
        sc = self.hooks.scalars(r["f32"], r["i32"])
        prm = {name: r["param_" + name] for name in self.hooks.in_kernel}
        q, k, v, do = r["q"][...], r["k"][...], r["v"][...], r["do"][...]
        s = lax.dot_general(q, k, NT, precision=precision, preferred_element_type=jnp.float32) * sc.scale
        if cfg.bias:
            s = s + r["bias"][...].astype(jnp.float32)
        t = _tile(r, b, h, i_q, i_k, block_q, block_k, cfg)
        dp = lax.dot_general(do, v, NT, precision=precision, preferred_element_type=jnp.float32)
        lse, delta = _rt.lanes(r["lse"][...], block_k), _rt.lanes(r["delta"][...], block_k)
        return q, k, do, s, t, sc, prm, grads_tile(self.hooks, s, t, sc, prm, cfg, lse, dp, delta, masked, jnp.exp)

    def _dkdv_kernel(self, kinds_ref, fetch_ref, *refs, names, out_names, cfg, blocks, n_q, groups, precision):
        """One step (key block, group member, query block) of one kv head; dK, dV and the param
        gradients accumulate in VMEM scratch over the two innermost grid axes."""
        del fetch_ref
        r = dict(zip(names, refs))
        out = dict(zip(out_names, refs[len(names):len(names) + len(out_names)]))
        dk_scr, dv_scr, *acc_scr = refs[len(names) + len(out_names):]
        acc_scr = dict(zip(self.hooks.grad_params, acc_scr))
        block_q, block_k = blocks.block_q, blocks.block_k
        b, hk, i_k, g, i_q = (pl.program_id(i) for i in range(5))
        h = hk * groups + g
        kind = kinds_ref[i_k, i_q]

        @pl.when(jnp.logical_and(g == 0, i_q == 0))
        def _init():
            dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
            dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)
            for ref in acc_scr.values():
                ref[...] = jnp.zeros(ref.shape, jnp.float32)

        def step(masked):
            q, _, do, s, t, sc, prm, (p, ds1, ds0, vis) = self._grads_tile(
                r, b, h, i_q, i_k, block_q, block_k, cfg, precision, masked)  # [block_q, block_k]
            dv_scr[...] += lax.dot(p.T.astype(do.dtype), do, precision=precision, preferred_element_type=jnp.float32)
            dk_scr[...] += lax.dot(ds0.T.astype(q.dtype), q, precision=precision, preferred_element_type=jnp.float32)
            if cfg.bias:
                out["dbias"][...] = ds0
            acc = self.hooks.param_grads({name: ref[...] for name, ref in acc_scr.items()}, ds1, s, t, sc, prm, vis)
            for name, ref in acc_scr.items():
                ref[...] = acc[name]

        pl.when(kind == 1)(lambda: step(True))
        pl.when(kind == 2)(lambda: step(False))
        if cfg.bias:  # every tile of the bias gradient is written, zeros where skipped

            @pl.when(kind == 0)
            def _zero():
                out["dbias"][...] = jnp.zeros(out["dbias"].shape, jnp.float32)

        @pl.when(jnp.logical_and(g == groups - 1, i_q == n_q - 1))
        def _finish():
            out["dk"][...] = (dk_scr[...] * r["f32"][0]).astype(out["dk"].dtype)
            out["dv"][...] = dv_scr[...].astype(out["dv"].dtype)
            for name, ref in acc_scr.items():
                out["dparam_" + name][...] = ref[...]

    def _dq_kernel(self, kinds_ref, fetch_ref, *refs, names, cfg, blocks, n_kv, precision):
        """One step (query block, key block) of one head; dQ accumulates in VMEM scratch."""
        del fetch_ref
        r = dict(zip(names, refs))
        dq_ref, dq_scr = refs[len(names):]
        block_q, block_k = blocks.block_q, blocks.block_k
        b, h, i_q, i_k = (pl.program_id(i) for i in range(4))
        kind = kinds_ref[i_q, i_k]

        @pl.when(i_k == 0)
        def _init():
            dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

        def step(masked):
            _, k, *_, (_, _, ds0, _) = self._grads_tile(r, b, h, i_q, i_k, block_q, block_k, cfg, precision, masked)
            dq_scr[...] += lax.dot_general(ds0.astype(k.dtype), k, NN, precision=precision, preferred_element_type=jnp.float32)

        pl.when(kind == 1)(lambda: step(True))
        pl.when(kind == 2)(lambda: step(False))

        @pl.when(i_k == n_kv - 1)
        def _finish():
            dq_ref[...] = (dq_scr[...] * r["f32"][0]).astype(dq_ref.dtype)

    def _setup(self, q, k, v, ctx, cfg, interpret):
        """(blocks, scalars, the params the kernels read, kinds [n_q, n_kv], ctx with the token views) shared by
        the TPU kernels of one call."""
        batch, kv_heads, groups, sq, _ = q.shape
        sk = k.shape[2]
        blocks = TpuBlockSizes.get_default(interpret).fit(sq, sk)
        scalars, prm = self.hooks.pack_scalars(ctx), self.hooks.params_of(ctx)
        sc = self.hooks.scalars(*scalars)
        ctx = with_token_views(self.hooks, ctx, sc, prm, cfg, batch, kv_heads * groups)
        kinds = self._kinds(blocks.block_q, blocks.block_k, ctx, sc, prm, cfg, (batch, kv_heads, groups, sq, sk))
        return blocks, scalars, {name: prm[name] for name in self.hooks.in_kernel}, kinds, ctx

    def forward(self, q, k, v, ctx, *, cfg, interpret):
        batch, kv_heads, groups, sq, _ = q.shape
        dv = v.shape[-1]
        axes = vma.varying_axes(q, k, v, ctx)  # inside shard_map: the outputs vary as the inputs do
        blocks, scalars, prm, kinds, ctx = self._setup(q, k, v, ctx, cfg, interpret)
        n_q, n_kv = kinds.shape
        coords = lambda b, h, iq, ik, kinds, fetch: (b, *_rt.head(h, groups), iq, fetch[iq, ik])
        ops = _operands(q, k, v, ctx, cfg, scalars, prm, blocks, coords)
        q_map = lambda b, h, iq, ik, kinds, fetch: (b, *_rt.head(h, groups), iq, 0)
        kernel = functools.partial(
            self._fwd_kernel, names=tuple(ops.names), cfg=cfg, blocks=blocks, n_kv=n_kv, groups=groups,
            n_sinks=ctx["softmax_aux"].shape[-1] if cfg.sinks else 0, precision=_rt.precision(q.dtype))
        out, lse = pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=2,
                grid=(batch, kv_heads * groups, n_q, n_kv),
                in_specs=ops.specs,
                out_specs=[pl.BlockSpec((None, None, None, blocks.block_q, dv), q_map),
                           pl.BlockSpec((None, None, None, blocks.block_q, NUM_LANES), q_map)],
                scratch_shapes=[pltpu.VMEM((blocks.block_q, NUM_LANES), jnp.float32),
                                pltpu.VMEM((blocks.block_q, NUM_LANES), jnp.float32),
                                pltpu.VMEM((blocks.block_q, dv), jnp.float32)],
            ),
            out_shape=[vma.struct((batch, kv_heads, groups, sq, dv), q.dtype, axes),
                       vma.struct((batch, kv_heads, groups, sq, NUM_LANES), jnp.float32, axes)],
            compiler_params=_compiler_params("parallel", "parallel", "parallel", "arbitrary"),
            interpret=interpret,
            name=f"{self.hooks.name}_fwd",
        )(kinds, _rt.fetch_table(kinds), *ops.arrays)
        return out, lse[..., 0]

    def backward(self, q, k, v, d_out, lse, delta, ctx, *, cfg, interpret):
        """(dq, dk, dv, dbias or None, {param: flat gradient}): a dK/dV kernel, then a dQ kernel."""
        batch, kv_heads, groups, sq, d = q.shape
        sk, dv = k.shape[2], v.shape[-1]
        axes = vma.varying_axes(q, k, v, d_out, ctx)
        blocks, scalars, prm, kinds, ctx = self._setup(q, k, v, ctx, cfg, interpret)
        n_q, n_kv = kinds.shape
        q_side = (("do", d_out), ("lse", lse), ("delta", delta))
        precision = _rt.precision(q.dtype)

        kinds_t = kinds.T
        coords = lambda b, hk, ik, g, iq, kinds, fetch: (b, hk, g, fetch[ik, iq], ik)
        ops = _operands(q, k, v, ctx, cfg, scalars, prm, blocks, coords, q_side)
        k_map = lambda b, hk, ik, g, iq, kinds, fetch: (b, hk, ik, 0)
        outs = [("dk", vma.struct(k.shape, k.dtype, axes), pl.BlockSpec((None, None, blocks.block_k, d), k_map)),
                ("dv", vma.struct(v.shape, v.dtype, axes), pl.BlockSpec((None, None, blocks.block_k, dv), k_map))]
        if cfg.bias:
            outs.append(("dbias", vma.struct((batch, kv_heads, groups, sq, sk), jnp.float32, axes),
                         pl.BlockSpec((None, None, None, blocks.block_q, blocks.block_k),
                                      lambda b, hk, ik, g, iq, kinds, fetch: (b, hk, g, iq, ik))))
        scratch = [pltpu.VMEM((blocks.block_k, d), jnp.float32), pltpu.VMEM((blocks.block_k, dv), jnp.float32)]
        for name in self.hooks.grad_params:
            lanes = _rt.param_lanes(prm[name])
            outs.append(("dparam_" + name, vma.struct((batch, kv_heads, n_kv, 1, lanes), jnp.float32, axes),
                         pl.BlockSpec((None, None, None, 1, lanes), lambda b, hk, ik, g, iq, kinds, fetch: (b, hk, ik, 0, 0))))
            scratch.append(pltpu.VMEM((1, lanes), jnp.float32))
        kernel = functools.partial(self._dkdv_kernel, names=tuple(ops.names), out_names=tuple(o[0] for o in outs), cfg=cfg,
                                   blocks=blocks, n_q=n_q, groups=groups, precision=precision)
        results = pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=2,
                grid=(batch, kv_heads, n_kv, groups, n_q),
                in_specs=ops.specs,
                out_specs=[o[2] for o in outs],
                scratch_shapes=scratch,
            ),
            out_shape=[o[1] for o in outs],
            compiler_params=_compiler_params("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
            interpret=interpret,
            name=f"{self.hooks.name}_bwd_dkdv",
        )(kinds_t, _rt.fetch_table(kinds_t), *ops.arrays)
        grads = dict(zip((o[0] for o in outs), results))

        coords = lambda b, h, iq, ik, kinds, fetch: (b, *_rt.head(h, groups), iq, fetch[iq, ik])
        ops = _operands(q, k, v, ctx, cfg, scalars, prm, blocks, coords, q_side)
        q_map = lambda b, h, iq, ik, kinds, fetch: (b, *_rt.head(h, groups), iq, 0)
        kernel = functools.partial(self._dq_kernel, names=tuple(ops.names), cfg=cfg, blocks=blocks, n_kv=n_kv,
                                   precision=precision)
        dq = pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=2,
                grid=(batch, kv_heads * groups, n_q, n_kv),
                in_specs=ops.specs,
                out_specs=pl.BlockSpec((None, None, None, blocks.block_q, d), q_map),
                scratch_shapes=[pltpu.VMEM((blocks.block_q, d), jnp.float32)],
            ),
            out_shape=vma.struct(q.shape, q.dtype, axes),
            compiler_params=_compiler_params("parallel", "parallel", "parallel", "arbitrary"),
            interpret=interpret,
            name=f"{self.hooks.name}_bwd_dq",
        )(kinds, _rt.fetch_table(kinds), *ops.arrays)
        dparams = {name: jnp.sum(grads["dparam_" + name], axis=(0, 1, 2, 3)) for name in self.hooks.grad_params}
        return dq, grads["dk"], grads["dv"], grads.get("dbias"), dparams
