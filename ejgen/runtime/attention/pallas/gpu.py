"""The Pallas kernels for GPUs (Triton lowering): FlashAttention-2 forward, a dK/dV kernel and a
dQ kernel, with their tiles (`BlockSizes`) and operands.

The kernels read q, k, v in the op's own [B, S, H, D] layout, heads strided (the transposes to and
from the kernel layout cancel out in XLA). A program per (query block, batch, head) loops over its
key blocks in three stages (masked, unmasked, masked), from the `Hooks.kv_blocks` table refined by
the runtime block kinds when `Hooks.runtime_mask` asks for them; backward: a dK/dV kernel per key
block over every query head of its group (`Hooks.q_blocks`), then a dQ kernel; no atomics, so
gradients are deterministic.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ejgen.runtime.attention.pallas import common as _rt
from ejgen.runtime.attention.pallas.common import NEG_INF, NN, NT, PAD
from ejgen.runtime.attention.pallas.hooks import Hooks, dense_kinds, grads_tile, logits, make_tile, with_token_views
from ejgen.runtime.core import shared_memory, vma

LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles of one GPU kernel (powers of two from 16 to PAD, so that they divide the padded
    lengths), with its warps and software-pipeline stages."""

    block_q: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            size = getattr(self, name)
            if not 16 <= size <= PAD or size & (size - 1):
                raise ValueError(f"BlockSizes.{name} must be a power of two from 16 to {PAD}, got {size}")

    @staticmethod
    def get_default(kernel: str, head_dim: int, dtype, interpret: bool = False) -> "BlockSizes":
        """Tiles of ``kernel`` ("fwd", "dkdv" or "dq"): on GPUs the table below (the Triton
        backend's H200 sweep; the D=128 bf16 forward re-tuned for these kernels on an H200); small
        tiles, many blocks, when interpreted."""
        if interpret:
            return INTERPRET_BLOCKS
        half = jnp.dtype(dtype).itemsize <= 2
        for max_dim, sixteen_bit, thirty_two_bit in GPU_BLOCKS[kernel]:
            if _rt.pow2(head_dim) <= max_dim:
                return sixteen_bit if half else thirty_two_bit
        return GPU_BLOCKS[kernel][-1][1 if half else 2]


# kernel -> [(max head dim, 16-bit inputs, float32 inputs)], first match wins.
GPU_BLOCKS = {
    "fwd": [
        (64, BlockSizes(128, 128, 8, 3), BlockSizes(64, 64, 4, 2)),
        (128, BlockSizes(128, 128, 8, 3), BlockSizes(64, 32, 4, 2)),
        (256, BlockSizes(128, 64, 8, 2), BlockSizes(32, 32, 4, 1)),
    ],
    "dkdv": [
        (64, BlockSizes(64, 128, 8, 3), BlockSizes(32, 64, 4, 2)),
        (128, BlockSizes(64, 128, 8, 3), BlockSizes(32, 32, 4, 1)),
        (256, BlockSizes(32, 64, 8, 1), BlockSizes(16, 32, 4, 1)),
    ],
    "dq": [
        (64, BlockSizes(128, 64, 8, 3), BlockSizes(64, 32, 4, 2)),
        (128, BlockSizes(128, 64, 8, 3), BlockSizes(32, 32, 4, 1)),
        (256, BlockSizes(64, 32, 8, 1), BlockSizes(16, 32, 4, 1)),
    ],
}
INTERPRET_BLOCKS = BlockSizes(32, 16)

# Shared memory of one Hopper thread block; `gpu_blocks` keeps every kernel's estimate under it.
GPU_SHARED_MEMORY = shared_memory.HOPPER


def gpu_shared_bytes(kernel: str, blocks: BlockSizes, d: int, dv: int, dtype, cfg) -> int:
    """`shared_memory.estimate` of a GPU kernel at these tiles (Triton multi-buffers each step's tiles once per
    pipeline stage)."""
    return shared_memory.estimate(kernel, blocks.block_q, blocks.block_k, blocks.num_stages, d, dv,
                                  jnp.dtype(dtype).itemsize, cfg.bias, cfg.dense_mask)


def gpu_blocks(kernel: str, d: int, dv: int, dtype, cfg, interpret: bool = False) -> BlockSizes:
    """The table's tiles, shrunk (`shared_memory.shrink`) where the kernel would not fit in shared memory: a bias
    or dense mask streams a [block_q, block_k] tile through every step besides the q/k/v tiles."""
    blocks = BlockSizes.get_default(kernel, max(d, dv), dtype, interpret)
    if interpret or not (cfg.bias or cfg.dense_mask):
        return blocks
    return shared_memory.shrink(blocks, "block_q" if kernel == "dkdv" else "block_k",
                                lambda b: gpu_shared_bytes(kernel, b, d, dv, dtype, cfg) <= GPU_SHARED_MEMORY)


def _exp(x):
    return jnp.exp2(x * LOG2E)  # ex2.approx: the fast exponential


def _load(ref, n):
    """A tile of ``ref`` whose last dim holds ``n`` values of its (power of two) block: zeros past them."""
    if ref.shape[-1] == n:
        return ref[...]
    cols = lax.broadcasted_iota(jnp.int32, (1, ref.shape[-1]), 1)
    return plgpu.load(ref, mask=cols < n, other=0)


def _store(ref, value, n):
    if ref.shape[-1] == n:
        ref[...] = value
    else:
        plgpu.store(ref, value, mask=lax.broadcasted_iota(jnp.int32, (1, ref.shape[-1]), 1) < n)


def _tile(r, b, h, rows, cols, q_at, k_at, mask, cfg, q_tok=(), kv_tok=()):
    """The `Tile` of query rows x key columns (broadcastable index tiles, either orientation);
    ``q_at``, ``k_at`` slice the per-position arrays (positions, lengths, segment ids); ``q_tok``,
    ``kv_tok`` the token views' values, shaped here as rows and columns."""
    q_side = lambda name: r[name][q_at].reshape(rows.shape)
    k_side = lambda name: r[name][k_at].reshape(cols.shape)
    return make_tile(b, h, rows, cols, q_side, k_side, mask, cfg, tuple(x.reshape(rows.shape) for x in q_tok),
                     tuple(x.reshape(cols.shape) for x in kv_tok))


def _views(r, side):
    """The refs of one side's token views, in order (operands ``q_tok0``, ``q_tok1``, ...)."""
    return [r[f"{side}_tok{i}"] for i in range(sum(name.startswith(side + "_tok") for name in r))]


def _member(ref, g, at=slice(None)):
    """``at`` of row ``g`` (a group member) of a token view's block of heads; row 0 when the view has one head
    (one indexer: the Triton lowering takes no more)."""
    return ref[g if ref.shape[0] > 1 else 0, at]


def _to_gpu_layout(x):
    """Kernel layout to the op's own, which the GPU kernels read with a head stride (as JAX's Pallas
    `mha`): q-like [B, Hkv, G, S, X] -> [B, S, Hkv * G, X], k-like [B, Hkv, S, X] -> [B, S, Hkv, X].
    These transposes undo the op's, and XLA cancels the pairs: no copy is made."""
    if x.ndim == 5:
        b, hk, g, s, d = x.shape
        return x.transpose(0, 3, 1, 2, 4).reshape(b, s, hk * g, d)
    return x.transpose(0, 2, 1, 3)


def _from_gpu_layout(x, groups=None):
    """The inverse of `_to_gpu_layout`; ``groups`` for q-like arrays."""
    if groups is None:
        return x.transpose(0, 2, 1, 3)
    b, s, h, d = x.shape
    return x.reshape(b, s, h // groups, groups, d).transpose(0, 2, 3, 1, 4)


def _operands(kernel, q, k, v, ctx, cfg, scalars, prm, blocks, metadata, q_side=()):
    """Inputs of a GPU kernel with their BlockSpecs, on q [B, Sq, H, D], k, v [B, Sk, Hkv, D(v)].
    fwd, dq: grid (query block, batch, head), one block of queries and every key; dkdv: grid
    (key block, batch, kv head), one block of keys and every query of the group. ``q_side``: more
    (name, array) laid out as q ([B, Sq, H, X]) or as lse ([B, H, Sq])."""
    batch, sq, heads, d = q.shape
    sk, kv_heads = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    block_q, block_k = blocks.block_q, blocks.block_k
    n_q = sq // block_q
    by_keys = kernel == "dkdv"

    def coords(i, b, h):
        """(batch, head, block): the query head (fwd, dq) or the kv head (dkdv) of the program."""
        return b, h, i if by_keys or not cfg.causal else n_q - 1 - i

    def spec(shape, index):
        return pl.BlockSpec(shape, lambda i, b, h: index(*coords(i, b, h)))

    def whole(x):
        return pl.BlockSpec(x.shape, lambda i, b, h: (0,) * x.ndim)

    def q_like(x):  # [B, Sq, H, X] or [B, H, Sq]
        if x.ndim == 3:
            if by_keys:
                return spec((None, groups, sq), lambda b, hk, i: (b, hk, 0))
            return spec((None, None, block_q), lambda b, h, i: (b, h, i))
        cols = _rt.pow2(x.shape[-1])
        if by_keys:
            return spec((None, sq, groups, cols), lambda b, hk, i: (b, 0, hk, 0))
        return spec((None, block_q, None, cols), lambda b, h, i: (b, i, h, 0))

    def kv_like(x):  # [B, Sk, Hkv, X]
        cols = _rt.pow2(x.shape[-1])
        if by_keys:
            return spec((None, block_k, None, cols), lambda b, hk, i: (b, i, hk, 0))
        return spec((None, sk, None, cols), lambda b, h, i: (b, 0, _rt.head(h, groups)[0], 0))

    def logits_like(x):  # [B|1, Hkv|1, G|1, Sq, Sk]
        pick = lambda axis, j: j if x.shape[axis] > 1 else 0
        if by_keys:
            return spec((None, None, x.shape[2], sq, block_k), lambda b, hk, i: (pick(0, b), pick(1, hk), 0, 0, i))

        def index(b, h, i):
            hk, g = _rt.head(h, groups)
            return pick(0, b), pick(1, hk), pick(2, g), i, 0

        return spec((None, None, None, block_q, sk), index)

    def row_of(x):  # [B, S]: one batch row
        return spec((None, x.shape[1]), lambda b, h, i: (b, 0))

    def view(x, side):  # a token view [B|1, H|1, S]: the program's block of rows (keys), or all of the other side
        pick = lambda axis, j: j if x.shape[axis] > 1 else 0
        own = (side == "kv") == by_keys
        length = (block_k if by_keys else block_q) if own else (sq if by_keys else sk)
        if by_keys:  # every query head of the program's kv head
            heads_of = groups if x.shape[1] > 1 else 1
            return spec((None, heads_of, length), lambda b, hk, i: (pick(0, b), pick(1, hk), i if own else 0))
        return spec((None, None, length), lambda b, h, i: (pick(0, b), pick(1, h), i if own else 0))

    ops = _rt.Operands()
    ops.add("f32", scalars[0], whole(scalars[0]))
    ops.add("i32", scalars[1], whole(scalars[1]))
    for name, x in prm.items():
        ops.add("param_" + name, x, whole(x))
    ranges, kinds = metadata
    ops.add("ranges", ranges, spec((None, 4), lambda b, h, i: (i, 0)))
    if kinds is not None:
        ops.add("kinds", kinds, spec((None, kinds.shape[1]), lambda b, h, i: (i, 0)))
    for name, x in (("q", q), *q_side):
        ops.add(name, x, q_like(x))
    ops.add("k", k, kv_like(k))
    ops.add("v", v, kv_like(v))
    if cfg.bias:
        ops.add("bias", ctx["bias"], logits_like(ctx["bias"]))
    if cfg.dense_mask:
        ops.add("mask", ctx["mask"].astype(jnp.int8), logits_like(ctx["mask"]))
    segments = cfg.segments or cfg.varlen
    placed = cfg.varlen or cfg.positions
    for name, used in (("q_pos", placed), ("kv_pos", placed), ("q_lens", cfg.varlen), ("kv_lens", cfg.varlen),
                       ("q_seg", segments), ("kv_seg", segments)):
        if used:
            ops.add(name, ctx[name], row_of(ctx[name]))
    for side in ("q", "kv"):
        for i, x in enumerate(ctx.get(side + "_tok", ())):
            ops.add(f"{side}_tok{i}", x, view(x, side))
    if cfg.sinks and not by_keys:
        aux = ctx["softmax_aux"].reshape(heads, -1)
        ops.add("aux", aux, spec((None, aux.shape[-1]), lambda b, h, i: (h, 0)))
    return ops


def _compiler_params(blocks):
    return plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def _key_block(r, i_k, block_k, q, b, h, rows, q_at, q_tok, sc, cfg, d, dv, precision):
    """Key block i_k of a query block's loop: (k [block_k, D_PAD], v [block_k, DV_PAD], the scaled logits with
    the bias added [block_q, block_k], the tile's index grids); ``q_tok`` the rows' token views."""
    start = pl.multiple_of(i_k * block_k, block_k)
    k = _load(r["k"].at[pl.ds(start, block_k), :], d)
    v = _load(r["v"].at[pl.ds(start, block_k), :], dv)
    s = lax.dot_general(q, k, NT, precision=precision, preferred_element_type=jnp.float32) * sc.scale
    if cfg.bias:
        s = s + r["bias"][:, pl.ds(start, block_k)].astype(jnp.float32)
    cols = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    mask = r["mask"][:, pl.ds(start, block_k)] if cfg.dense_mask else None
    kv_tok = [ref[pl.ds(start, block_k)] for ref in _views(r, "kv")]
    return k, v, s, _tile(r, b, h, rows, cols, q_at, pl.ds(start, block_k), mask, cfg, q_tok, kv_tok)


class GpuKernels:
    """The GPU kernels and their launches for one spec's hooks; inputs and outputs in the kernel
    layout (q [B, Hkv, G, S, D], as `PallasAttention`)."""

    def __init__(self, hooks: Hooks):
        self.hooks = hooks

    def _query_block(self, r, blocks, n_q, d, cfg):
        """The program's query block (the longest rows first under causal: a shorter tail), its batch row and
        head, the scalars and params, q [block_q, D_PAD], its rows, where they lie and their token views."""
        i_q = pl.program_id(0)
        if cfg.causal:
            i_q = n_q - 1 - i_q
        b, h = pl.program_id(1), pl.program_id(2)
        sc = self.hooks.scalars(r["f32"], r["i32"])
        prm = {name: r["param_" + name] for name in self.hooks.in_kernel}
        q = _load(r["q"], d)
        rows = i_q * blocks.block_q + lax.broadcasted_iota(jnp.int32, (blocks.block_q, 1), 0)
        q_tok = [ref[...] for ref in _views(r, "q")]
        return b, h, sc, prm, q, rows, pl.ds(i_q * blocks.block_q, blocks.block_q), q_tok

    def _fwd_kernel(self, *refs, names, cfg, blocks, n_q, d, dv, n_sinks, precision, use_kinds):
        """One block of queries of one head: online softmax over its key blocks (FlashAttention-2)."""
        r = dict(zip(names, refs))
        o_ref, lse_ref = refs[len(names):]
        block_q, block_k = blocks.block_q, blocks.block_k
        b, h, sc, prm, q, rows, q_at, q_tok = self._query_block(r, blocks, n_q, d, cfg)
        lo, hi, flo, fhi = (r["ranges"][j] for j in range(4))

        def step(i_k, carry, masked):
            acc, m_i, l_i = carry
            k, v, s, t = _key_block(r, i_k, block_k, q, b, h, rows, q_at, q_tok, sc, cfg, d, dv, precision)
            _, _, s = logits(self.hooks, s, t, sc, prm, cfg)
            if masked:
                s = jnp.where(self.hooks.visible(t, sc, prm, cfg), s, NEG_INF)
            m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
            m_use = jnp.where(m_new == NEG_INF, 0.0, m_new)
            p = jnp.exp2(s * LOG2E - (m_use * LOG2E)[:, None])  # [block_q, block_k]
            alpha = _exp(m_i - m_use)
            l_i = l_i * alpha + jnp.sum(p, axis=1)
            pv = lax.dot_general(p.astype(v.dtype), v, NN, precision=precision, preferred_element_type=jnp.float32)
            return acc * alpha[:, None] + pv, m_new, l_i

        init = (
            jnp.zeros((block_q, r["v"].shape[-1]), jnp.float32),
            jnp.full((block_q,), NEG_INF, jnp.float32),
            jnp.zeros((block_q,), jnp.float32),
        )
        kind_of = (lambda i: r["kinds"][i]) if use_kinds else None
        acc, m_i, l_i = _rt.visit(lo, hi, flo, fhi, kind_of, step, init)
        if cfg.sinks:
            m_i, l_i, alpha = _rt.add_sinks(m_i, l_i, [r["aux"][j] for j in range(n_sinks)])
            acc = acc * alpha[:, None]
        seen = l_i != 0.0  # a NaN row stays NaN (docs/DESIGN.md §3 step 5); only a row that saw nothing is 0
        l_safe = jnp.where(seen, l_i, 1.0)
        lse_ref[...] = jnp.where(seen, jnp.where(seen, m_i, 0.0) + jnp.log(l_safe), NEG_INF)
        _store(o_ref, (acc * jnp.where(seen, 1.0 / l_safe, 0.0)[:, None]).astype(o_ref.dtype), dv)

    def _dkdv_kernel(self, *refs, names, out_names, cfg, blocks, groups, d, dv, precision, use_kinds):
        """One block of keys of one kv head: dK and dV over the query blocks of every head of its group
        (no atomics), the bias gradient of its tiles and its share of the param gradients."""
        r = dict(zip(names, refs))
        out = dict(zip(out_names, refs[len(names):]))
        block_q, block_k = blocks.block_q, blocks.block_k
        i_k, b, hk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        sc = self.hooks.scalars(r["f32"], r["i32"])
        prm = {name: r["param_" + name] for name in self.hooks.in_kernel}
        k = _load(r["k"], d)  # [block_k, D_PAD]
        v = _load(r["v"], dv)  # [block_k, DV_PAD]
        cols = i_k * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)  # tiles are [keys, queries]
        k_at = pl.ds(i_k * block_k, block_k)
        lo, hi, flo, fhi = (r["ranges"][j] for j in range(4))
        kind_of = (lambda i: r["kinds"][i]) if use_kinds else None

        def group(g, carry):
            h = hk * groups + g
            g_bias = g if cfg.bias and r["bias"].shape[0] > 1 else 0
            g_mask = g if cfg.dense_mask and r["mask"].shape[0] > 1 else 0
            kv_tok = [_member(ref, g) for ref in _views(r, "kv")]

            def step(i_q, carry, masked):
                dk, dv_acc, acc = carry
                start = pl.multiple_of(i_q * block_q, block_q)
                q_at = pl.ds(start, block_q)
                q = _load(r["q"].at[q_at, g, :], d)  # [block_q, D_PAD]
                do = _load(r["do"].at[q_at, g, :], dv)  # [block_q, DV_PAD]
                lse = r["lse"][g, q_at][None, :]
                delta = r["delta"][g, q_at][None, :]
                s = lax.dot_general(k, q, NT, precision=precision, preferred_element_type=jnp.float32) * sc.scale
                if cfg.bias:
                    s = s + r["bias"][g_bias, q_at, :].astype(jnp.float32).T
                rows = start + lax.broadcasted_iota(jnp.int32, (1, block_q), 1)
                mask = r["mask"][g_mask, q_at, :].T if cfg.dense_mask else None
                q_tok = [_member(ref, g, q_at) for ref in _views(r, "q")]
                t = _tile(r, b, h, rows, cols, q_at, k_at, mask, cfg, q_tok, kv_tok)
                dp = lax.dot_general(v, do, NT, precision=precision, preferred_element_type=jnp.float32)
                p, ds1, ds0, vis = grads_tile(self.hooks, s, t, sc, prm, cfg, lse, dp, delta, masked, _exp)  # [block_k, block_q]
                dv_acc = dv_acc + lax.dot_general(p.astype(do.dtype), do, NN, precision=precision,
                                                  preferred_element_type=jnp.float32)
                dk = dk + lax.dot_general(ds0.astype(q.dtype), q, NN, precision=precision,
                                          preferred_element_type=jnp.float32)
                if cfg.bias:
                    out["dbias"][g, q_at, :] = ds0.T
                return dk, dv_acc, self.hooks.param_grads(acc, ds1, s, t, sc, prm, vis)

            return _rt.visit(lo, hi, flo, fhi, kind_of, step, carry)

        init = (
            jnp.zeros((block_k, r["k"].shape[-1]), jnp.float32),
            jnp.zeros((block_k, r["v"].shape[-1]), jnp.float32),
            {name: jnp.zeros(out["dparam_" + name].shape, jnp.float32) for name in self.hooks.grad_params},
        )
        dk, dv_acc, acc = lax.fori_loop(0, groups, group, init)
        _store(out["dk"], (dk * sc.scale).astype(out["dk"].dtype), d)
        _store(out["dv"], dv_acc.astype(out["dv"].dtype), dv)
        for name in self.hooks.grad_params:
            out["dparam_" + name][...] = acc[name]

    def _dq_kernel(self, *refs, names, cfg, blocks, n_q, d, dv, precision, use_kinds):
        """One block of queries of one head: dQ over its key blocks."""
        r = dict(zip(names, refs))
        (dq_ref,) = refs[len(names):]
        block_q, block_k = blocks.block_q, blocks.block_k
        b, h, sc, prm, q, rows, q_at, q_tok = self._query_block(r, blocks, n_q, d, cfg)
        do = _load(r["do"], dv)  # [block_q, DV_PAD]
        lse = r["lse"][...][:, None]
        delta = r["delta"][...][:, None]
        lo, hi, flo, fhi = (r["ranges"][j] for j in range(4))

        def step(i_k, dq, masked):
            k, v, s, t = _key_block(r, i_k, block_k, q, b, h, rows, q_at, q_tok, sc, cfg, d, dv, precision)
            dp = lax.dot_general(do, v, NT, precision=precision, preferred_element_type=jnp.float32)
            _, _, ds0, _ = grads_tile(self.hooks, s, t, sc, prm, cfg, lse, dp, delta, masked, _exp)  # [block_q, block_k]
            return dq + lax.dot_general(ds0.astype(k.dtype), k, NN, precision=precision, preferred_element_type=jnp.float32)

        kind_of = (lambda i: r["kinds"][i]) if use_kinds else None
        dq = _rt.visit(lo, hi, flo, fhi, kind_of, step, jnp.zeros((block_q, r["q"].shape[-1]), jnp.float32))
        _store(dq_ref, (dq * sc.scale).astype(dq_ref.dtype), d)

    def _kernel_params(self, prm):
        return {name: prm[name] for name in self.hooks.in_kernel}

    def _metadata(self, kernel, blocks, ctx, sc, prm, cfg, shape):
        """(ranges, kinds or None) of a GPU kernel: per program its blocks of the other index."""
        n_q, n_kv = shape[3] // blocks.block_q, shape[4] // blocks.block_k
        kinds = dense_kinds(self.hooks, blocks.block_q, blocks.block_k, ctx, sc, prm, cfg, shape) if self.hooks.runtime_mask(cfg) else None
        if kernel == "dkdv":
            return self.hooks.q_blocks(n_kv, blocks.block_q, blocks.block_k, n_q, sc, cfg), None if kinds is None else kinds.T
        return self.hooks.kv_blocks(n_q, blocks.block_q, blocks.block_k, n_kv, sc, cfg), kinds

    def forward(self, q, k, v, ctx, *, cfg, interpret):
        """(out, lse) in the kernel layout, from one forward kernel."""
        batch, kv_heads, groups, sq, d = q.shape
        sk, dv = k.shape[2], v.shape[-1]
        axes = vma.varying_axes(q, k, v, ctx)  # inside shard_map: the outputs vary as the inputs do
        blocks = gpu_blocks("fwd", d, dv, q.dtype, cfg, interpret)
        scalars, prm = self.hooks.pack_scalars(ctx), self.hooks.params_of(ctx)
        sc = self.hooks.scalars(*scalars)
        ctx = with_token_views(self.hooks, ctx, sc, prm, cfg, batch, kv_heads * groups)
        metadata = self._metadata("fwd", blocks, ctx, sc, prm, cfg, (batch, kv_heads, groups, sq, sk))
        q, k, v = _to_gpu_layout(q), _to_gpu_layout(k), _to_gpu_layout(v)
        ops = _operands("fwd", q, k, v, ctx, cfg, scalars, self._kernel_params(prm), blocks, metadata)
        n_q, heads = sq // blocks.block_q, kv_heads * groups
        q_block = lambda i: n_q - 1 - i if cfg.causal else i
        kernel = functools.partial(
            self._fwd_kernel, names=tuple(ops.names), cfg=cfg, blocks=blocks, n_q=n_q, d=d, dv=dv,
            n_sinks=ctx["softmax_aux"].shape[-1] if cfg.sinks else 0, precision=_rt.precision(q.dtype),
            use_kinds=self.hooks.runtime_mask(cfg))
        out, lse = pl.pallas_call(
            kernel,
            grid=(n_q, batch, heads),
            in_specs=ops.specs,
            out_specs=[
                pl.BlockSpec((None, blocks.block_q, None, _rt.pow2(dv)), lambda i, b, h: (b, q_block(i), h, 0)),
                pl.BlockSpec((None, None, blocks.block_q), lambda i, b, h: (b, h, q_block(i))),
            ],
            out_shape=[vma.struct((batch, sq, heads, dv), q.dtype, axes),
                       vma.struct((batch, heads, sq), jnp.float32, axes)],
            compiler_params=_compiler_params(blocks),
            interpret=interpret,
            name=f"{self.hooks.name}_fwd",
        )(*ops.arrays)
        return _from_gpu_layout(out, groups), lse.reshape(batch, kv_heads, groups, sq)

    def backward(self, q, k, v, d_out, lse, delta, ctx, *, cfg, interpret):
        """(dq, dk, dv, dbias or None, {param: flat gradient}): a dK/dV kernel, then a dQ kernel."""
        batch, kv_heads, groups, sq, d = q.shape
        sk, dv = k.shape[2], v.shape[-1]
        heads = kv_heads * groups
        axes = vma.varying_axes(q, k, v, d_out, ctx)
        scalars, prm = self.hooks.pack_scalars(ctx), self.hooks.params_of(ctx)
        sc = self.hooks.scalars(*scalars)
        ctx = with_token_views(self.hooks, ctx, sc, prm, cfg, batch, heads)
        shape = (batch, kv_heads, groups, sq, sk)
        precision = _rt.precision(q.dtype)
        q_side = (("do", _to_gpu_layout(d_out)), ("lse", lse.reshape(batch, heads, sq)),
                  ("delta", delta.reshape(batch, heads, sq)))
        q, k, v = _to_gpu_layout(q), _to_gpu_layout(k), _to_gpu_layout(v)

        blocks = gpu_blocks("dkdv", d, dv, q.dtype, cfg, interpret)
        n_kv = sk // blocks.block_k
        ops = _operands("dkdv", q, k, v, ctx, cfg, scalars, self._kernel_params(prm), blocks,
                        self._metadata("dkdv", blocks, ctx, sc, prm, cfg, shape), q_side)
        k_map = lambda i, b, hk: (b, i, hk, 0)
        outs = [("dk", vma.struct(k.shape, k.dtype, axes), pl.BlockSpec((None, blocks.block_k, None, _rt.pow2(d)), k_map)),
                ("dv", vma.struct(v.shape, v.dtype, axes), pl.BlockSpec((None, blocks.block_k, None, _rt.pow2(dv)), k_map))]
        aliases = {}
        if cfg.bias:  # tiles no program visits stay zero: the output starts as zeros
            dbias_spec = pl.BlockSpec((None, None, groups, sq, blocks.block_k), lambda i, b, hk: (b, hk, 0, 0, i))
            aliases[len(ops.names)] = len(outs)
            ops.add("dbias_zeros", vma.vary(jnp.zeros(shape, jnp.float32), axes), dbias_spec)
            outs.append(("dbias", vma.struct(shape, jnp.float32, axes), dbias_spec))
        for name in self.hooks.grad_params:
            lanes = _rt.param_lanes(prm[name])
            outs.append(("dparam_" + name, vma.struct((batch, kv_heads, n_kv, 1, lanes), jnp.float32, axes),
                         pl.BlockSpec((None, None, None, 1, lanes), lambda i, b, hk: (b, hk, i, 0, 0))))
        kernel = functools.partial(
            self._dkdv_kernel, names=tuple(ops.names), out_names=tuple(o[0] for o in outs), cfg=cfg, blocks=blocks,
            groups=groups, d=d, dv=dv, precision=precision, use_kinds=self.hooks.runtime_mask(cfg))
        results = pl.pallas_call(
            kernel,
            grid=(n_kv, batch, kv_heads),
            in_specs=ops.specs,
            out_specs=[o[2] for o in outs],
            out_shape=[o[1] for o in outs],
            input_output_aliases=aliases,
            compiler_params=_compiler_params(blocks),
            interpret=interpret,
            name=f"{self.hooks.name}_bwd_dkdv",
        )(*ops.arrays)
        grads = dict(zip((o[0] for o in outs), results))

        blocks = gpu_blocks("dq", d, dv, q.dtype, cfg, interpret)
        n_q = sq // blocks.block_q
        ops = _operands("dq", q, k, v, ctx, cfg, scalars, self._kernel_params(prm), blocks,
                        self._metadata("dq", blocks, ctx, sc, prm, cfg, shape), q_side)
        q_block = lambda i: n_q - 1 - i if cfg.causal else i
        kernel = functools.partial(self._dq_kernel, names=tuple(ops.names), cfg=cfg, blocks=blocks, n_q=n_q, d=d, dv=dv,
                                   precision=precision, use_kinds=self.hooks.runtime_mask(cfg))
        dq = pl.pallas_call(
            kernel,
            grid=(n_q, batch, heads),
            in_specs=ops.specs,
            out_specs=pl.BlockSpec((None, blocks.block_q, None, _rt.pow2(d)), lambda i, b, h: (b, q_block(i), h, 0)),
            out_shape=vma.struct(q.shape, q.dtype, axes),
            compiler_params=_compiler_params(blocks),
            interpret=interpret,
            name=f"{self.hooks.name}_bwd_dq",
        )(*ops.arrays)
        dparams = {name: jnp.sum(grads["dparam_" + name], axis=(0, 1, 2, 3)) for name in self.hooks.grad_params}
        dk, dv_ = _from_gpu_layout(grads["dk"]), _from_gpu_layout(grads["dv"])
        return _from_gpu_layout(dq, groups), dk, dv_, grads.get("dbias"), dparams
