"""The Pallas backend, shared by every spec: FlashAttention-2 kernels for GPUs (Triton lowering) and TPUs
(Mosaic), chosen per lowering platform; on any other platform the kernels run interpreted.

Layout (from `op.py`, padded to whole PAD blocks):
  q [B, Hkv, G, Sq, D]   k [B, Hkv, Sk, D]   v [B, Hkv, Sk, Dv]   G = Hq // Hkv
  out [B, Hkv, G, Sq, Dv] in q's dtype, lse [B, Hkv, G, Sq] float32
One tile of logits s [block_q, block_k], float32, products accumulated in float32:
  s = scale * q k^T (+ bias)  ->  s = score(s)  ->  s = softcap * tanh(s / softcap)  ->  mask
A generated `pallas.py` holds the spec's hooks (score, derivatives, masks, block ranges) and
builds a `PallasAttention` from them; everything else is here, once.
Block metadata comes from the mask analysis, once per call outside the kernels: per block of
queries the key blocks to visit and those that need no element mask (and the transpose for the
dK/dV kernel); masks only known at run time refine it into block kinds (0 skip, 1 element mask,
2 no mask).
GPU: the kernels read q, k, v in the op's own [B, S, H, D] layout, heads strided (the transposes
to and from the kernel layout cancel out in XLA). A program per (query block, batch, head) loops
over its key blocks in three stages (masked, unmasked, masked); backward: a dK/dV kernel per key
block over every query head of its group, then a dQ kernel; no atomics, so gradients are
deterministic.
TPU: the key blocks are the innermost grid axis, m, l and acc live in VMEM scratch, the kinds are
scalar-prefetched and a skipped step repeats the previous block index (no DMA).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from ejgen.runtime.attention.pallas import common as _rt
from ejgen.runtime.attention.api import HEADS_MAJOR, sinks_grad

TENSOR_LAYOUT = HEADS_MAJOR  # q [B, Hkv, G, S, D]: what the kernels below index

NEG_INF = float("-inf")
LOG2E = math.log2(math.e)
PAD = 128  # padding granularity of the op: GPU blocks divide it, TPU blocks are multiples of it
NUM_LANES = _rt.NUM_LANES
NUM_SUBLANES = _rt.NUM_SUBLANES
NT = (((1,), (1,)), ((), ()))  # a @ b^T
NN = (((1,), (0,)), ((), ()))  # a @ b




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
        backend's H200 sweep; the D=128 bf16 self.forward re-tuned for these kernels on an H200); small
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

# Shared memory of one Hopper thread block (227 KB); `gpu_blocks` keeps every kernel's estimate under it.
GPU_SHARED_MEMORY = 227 * 1024


def gpu_shared_bytes(kernel: str, blocks: BlockSizes, d: int, dv: int, dtype, cfg) -> int:
    """An upper estimate of a GPU kernel's shared memory: its loop's tiles per step (q/k/v, and a bias
    (float32) or dense mask (int8) tile of [block_q, block_k]) once per pipeline stage, plus the tiles
    that stay (the dK/dV kernel loops over query blocks, keeping k and v; the others over key blocks,
    keeping q, and dO in the dQ kernel)."""
    size, dp, dvp = jnp.dtype(dtype).itemsize, _rt.pow2(d), _rt.pow2(dv)
    tile = (4 if cfg.bias else 0) + (1 if cfg.dense_mask else 0)
    if kernel == "dkdv":
        step, resident = blocks.block_q * (dp + dvp) * size, blocks.block_k * (dp + dvp) * size
    else:
        step = blocks.block_k * (dp + dvp) * size
        resident = blocks.block_q * (dp + (dvp if kernel == "dq" else 0)) * size
    return blocks.num_stages * (step + blocks.block_q * blocks.block_k * tile) + resident


def gpu_blocks(kernel: str, d: int, dv: int, dtype, cfg, interpret: bool = False) -> BlockSizes:
    """The table's tiles, shrunk where the kernel would not fit in shared memory (`gpu_shared_bytes`):
    a bias or dense mask streams a [block_q, block_k] tile through every step besides the q/k/v tiles,
    and Triton multi-buffers each step's tiles once per pipeline stage. Fewer stages first (down to
    two), then a halved loop block, then one stage."""
    blocks = BlockSizes.get_default(kernel, max(d, dv), dtype, interpret)
    if interpret or not (cfg.bias or cfg.dense_mask):
        return blocks
    estimate = lambda b: gpu_shared_bytes(kernel, b, d, dv, dtype, cfg)
    loop = "block_q" if kernel == "dkdv" else "block_k"
    while estimate(blocks) > GPU_SHARED_MEMORY:
        if blocks.num_stages > 2:
            blocks = dataclasses.replace(blocks, num_stages=blocks.num_stages - 1)
        elif getattr(blocks, loop) > 32:
            blocks = dataclasses.replace(blocks, **{loop: getattr(blocks, loop) // 2})
        elif blocks.num_stages > 1:
            blocks = dataclasses.replace(blocks, num_stages=1)
        else:
            break
    return blocks


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


def available():
    return _rt.available()


def block_sizes(cfg):
    """Padding granularity of the inputs: PAD on both axes, whatever the platform."""
    del cfg
    return PAD, PAD


def _precision(dtype):
    """Exact float32 products for float32 inputs (no TF32); the native path for 16-bit inputs."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _head(h, groups):
    """(kv head, group member) of query head ``h`` (lax.div and rem: index maps of non-negative ints)."""
    return lax.div(h, jnp.int32(groups)), lax.rem(h, jnp.int32(groups))


def _param_lanes(x):
    """Width of a param's flattened gradient accumulator [1, n]: a power of two of at least 128."""
    return _rt.pow2(x.size, NUM_LANES)


def _add_sinks(m, l, sinks):
    """(m, l, alpha) once the sinks (scalars) join the softmax denominator; scale acc by alpha."""
    m_all = m
    for a in sinks:
        m_all = jnp.maximum(m_all, a)
    alpha = jnp.exp(m - m_all)
    l = l * alpha
    for a in sinks:
        l = l + jnp.exp(a - m_all)
    return m_all, l, alpha


def _exp_gpu(x):
    return jnp.exp2(x * LOG2E)  # ex2.approx: the fast exponential


def _gpu_load(ref, n):
    """A tile of ``ref`` whose last dim holds ``n`` values of its (power of two) block: zeros past them."""
    if ref.shape[-1] == n:
        return ref[...]
    cols = lax.broadcasted_iota(jnp.int32, (1, ref.shape[-1]), 1)
    return plgpu.load(ref, mask=cols < n, other=0)


def _gpu_store(ref, value, n):
    if ref.shape[-1] == n:
        ref[...] = value
    else:
        plgpu.store(ref, value, mask=lax.broadcasted_iota(jnp.int32, (1, ref.shape[-1]), 1) < n)


def _tile(b, h, rows, cols, q_side, k_side, mask, cfg):
    """The `Tile` of query rows x key columns; ``q_side(name)`` / ``k_side(name)`` read a per-position
    array (positions, lengths, segment ids) shaped for the rows / columns."""
    segments = cfg.segments or cfg.varlen
    return Tile(
        b=b,
        h=h,
        q_idx=q_side("q_pos") if cfg.varlen else rows,
        kv_idx=k_side("kv_pos") if cfg.varlen else cols,
        q_len=q_side("q_lens") if cfg.varlen else cfg.seq_q,
        kv_len=q_side("kv_lens") if cfg.varlen else cfg.seq_k,
        q_valid=rows < cfg.seq_q,
        kv_valid=cols < cfg.seq_k,
        q_seg=q_side("q_seg") if segments else None,
        kv_seg=k_side("kv_seg") if segments else None,
        mask=mask,
    )


def _gpu_tile(r, b, h, rows, cols, q_at, k_at, mask, cfg):
    """The `Tile` of query rows x key columns (broadcastable index tiles, either orientation);
    ``q_at``, ``k_at`` slice the per-position arrays (positions, lengths, segment ids)."""
    q_side = lambda name: r[name][q_at].reshape(rows.shape)
    k_side = lambda name: r[name][k_at].reshape(cols.shape)
    return _tile(b, h, rows, cols, q_side, k_side, mask, cfg)


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


def _gpu_operands(kernel, q, k, v, ctx, cfg, scalars, prm, blocks, metadata, q_side=()):
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
        return spec((None, sk, None, cols), lambda b, h, i: (b, 0, _head(h, groups)[0], 0))

    def logits_like(x):  # [B|1, Hkv|1, G|1, Sq, Sk]
        pick = lambda axis, j: j if x.shape[axis] > 1 else 0
        if by_keys:
            return spec((None, None, x.shape[2], sq, block_k), lambda b, hk, i: (pick(0, b), pick(1, hk), 0, 0, i))

        def index(b, h, i):
            hk, g = _head(h, groups)
            return pick(0, b), pick(1, hk), pick(2, g), i, 0

        return spec((None, None, None, block_q, sk), index)

    def row_of(x):  # [B, S]: one batch row
        return spec((None, x.shape[1]), lambda b, h, i: (b, 0))

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
    for name, used in (("q_pos", cfg.varlen), ("kv_pos", cfg.varlen), ("q_lens", cfg.varlen), ("kv_lens", cfg.varlen),
                       ("q_seg", segments), ("kv_seg", segments)):
        if used:
            ops.add(name, ctx[name], row_of(ctx[name]))
    if cfg.sinks and not by_keys:
        aux = ctx["softmax_aux"].reshape(heads, -1)
        ops.add("aux", aux, spec((None, aux.shape[-1]), lambda b, h, i: (h, 0)))
    return ops


def _gpu_params(blocks):
    return plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def _tpu_tile(r, b, h, i_q, i_k, block_q, block_k, cfg):
    """The `Tile` of a [block_q, block_k] step: row vectors come lane-replicated [block_q, 128],
    column vectors sublane-replicated [8, block_k]."""
    shape = (block_q, block_k)
    rows = i_q * block_q + lax.broadcasted_iota(jnp.int32, shape, 0)
    cols = i_k * block_k + lax.broadcasted_iota(jnp.int32, shape, 1)
    q_side = lambda name: _rt.lanes(r[name][...], block_k)
    k_side = lambda name: r[name][:1, :]
    return _tile(b, h, rows, cols, q_side, k_side, r["mask"][...] if cfg.dense_mask else None, cfg)


def _tpu_operands(q, k, v, ctx, cfg, scalars, prm, blocks, coords, q_side=()):
    """Inputs of a TPU kernel with their BlockSpecs. ``coords(*grid, kinds, fetch)`` gives the
    (batch, kv head, group member, query block, key block) that a grid step reads. Scalars, params
    and sinks sit in SMEM; q-side vectors are lane-replicated, k-side ones sublane-replicated."""
    d, dv = q.shape[-1], v.shape[-1]
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

    ops = _rt.Operands()
    ops.add("f32", scalars[0], smem)
    ops.add("i32", scalars[1], smem)
    for name, x in prm.items():
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
    for name, used in (("q_pos", cfg.varlen), ("q_lens", cfg.varlen), ("kv_lens", cfg.varlen), ("q_seg", segments)):
        if used:
            ops.add(name, _rt.to_lanes(ctx[name]), spec((None, block_q, NUM_LANES), lambda b, hk, g, iq, ik: (b, iq, 0)))
    for name, used in (("kv_pos", cfg.varlen), ("kv_seg", segments)):
        if used:
            ops.add(name, _rt.to_sublanes(ctx[name]), spec((None, NUM_SUBLANES, block_k), lambda b, hk, g, iq, ik: (b, 0, ik)))
    return ops


def _tpu_params(*semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What one spec contributes, as emitted into its `pallas.py`."""

    name: str
    params: tuple
    grad_params: tuple
    score_is_identity: bool
    scalars: Callable  # (f32, i32) -> the spec's scalars
    pack_scalars: Callable  # ctx -> (F32, I32)
    params_of: Callable  # ctx -> {name: param}
    score: Callable
    score_grads: Callable
    param_grads: Callable
    visible: Callable
    kv_ranges: Callable
    q_ranges: Callable
    runtime_mask: Callable


class PallasAttention:
    """The kernels and their launches for one spec's hooks."""

    def __init__(self, hooks: Hooks):
        self.hooks = hooks

    def _logits(self, s, t, sc, prm, cfg):
        """(s, s_score, s_final) of a tile from s = scale * q k^T (+ bias): as given, after the score
        hook, after the soft cap."""
        if self.hooks.score_is_identity:
            s_score = s
        else:
            s_score = jnp.broadcast_to(self.hooks.score(s, t, sc, prm), s.shape).astype(jnp.float32)
        s_final = s_score
        if cfg.softcap:
            s_final = sc.softcap * jnp.tanh(s_score / sc.softcap)
        return s, s_score, s_final

    def _grads_tile(self, s, t, sc, prm, cfg, lse, dp, delta, masked, exp):
        """(p, ds1, ds0, vis) of one tile: probabilities; d loss / d score (through the soft cap);
        d loss / d logit (through the score hook); the element mask (None when not ``masked``)."""
        s, s_score, s_final = self._logits(s, t, sc, prm, cfg)
        p = exp(s_final - lse)
        vis = self.hooks.visible(t, sc, prm, cfg) if masked else None
        if masked:
            p = jnp.where(vis, p, 0.0)
        ds1 = p * (dp - delta)
        if cfg.softcap:
            th = jnp.tanh(s_score / sc.softcap)
            ds1 = ds1 * (1.0 - th * th)
        ds0 = ds1 if self.hooks.score_is_identity else ds1 * self.hooks.score_grads(s, t, sc, prm)[0]
        if masked:
            ds0 = jnp.where(vis, ds0, 0.0)
            ds1 = jnp.where(vis, ds1, 0.0)
        return p, ds1, ds0, vis

    def _dense_kinds(self, block_q, block_k, ctx, sc, prm, cfg, shape):
        """[n_q, n_kv] block kinds (0 skip, 1 element mask, 2 no mask) from the element mask over
        whole rows of blocks, one row at a time."""
        batch, kv_heads, groups, sq, sk = shape
        heads = jnp.arange(kv_heads)[:, None] * groups + jnp.arange(groups)[None, :]
        segments = cfg.segments or cfg.varlen
        cols = lambda x: x[:, None, None, None, :]

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
            )
            vis = jnp.broadcast_to(self.hooks.visible(t, sc, prm, cfg), (batch, kv_heads, groups, block_q, sk))
            vis = vis.reshape(batch, kv_heads, groups, block_q, sk // block_k, block_k)
            any_vis = jnp.any(vis, axis=(0, 1, 2, 3, 5))
            all_vis = jnp.all(vis, axis=(0, 1, 2, 3, 5))
            return jnp.where(all_vis, 2, jnp.where(any_vis, 1, 0)).astype(jnp.int32)

        return lax.map(row, jnp.arange(sq // block_q))

    def _kinds(self, block_q, block_k, ctx, sc, prm, cfg, shape):
        """[n_q, n_kv] block kinds from the ranges, refined by the runtime block mask when there is one."""
        n_q, n_kv = shape[3] // block_q, shape[4] // block_k
        kinds = _rt.kinds_from_ranges(self.hooks.kv_ranges(n_q, block_q, block_k, n_kv, sc, cfg), n_kv)
        if self.hooks.runtime_mask(cfg):
            kinds = jnp.minimum(kinds, self._dense_kinds(block_q, block_k, ctx, sc, prm, cfg, shape))
        return kinds

    def _gpu_fwd_kernel(self, *refs, names, cfg, blocks, n_q, d, dv, n_sinks, precision, use_kinds):
        """One block of queries of one head: online softmax over its key blocks (FlashAttention-2)."""
        r = dict(zip(names, refs))
        o_ref, lse_ref = refs[len(names):]
        block_q, block_k = blocks.block_q, blocks.block_k
        i_q = pl.program_id(0)
        if cfg.causal:  # the longest rows first: a shorter tail
            i_q = n_q - 1 - i_q
        b, h = pl.program_id(1), pl.program_id(2)
        sc = self.hooks.scalars(r["f32"], r["i32"])
        prm = {name: r["param_" + name] for name in self.hooks.params}
        q = _gpu_load(r["q"], d)  # [block_q, D_PAD]
        rows = i_q * block_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
        q_at = pl.ds(i_q * block_q, block_q)
        lo, hi, flo, fhi = (r["ranges"][j] for j in range(4))

        def step(i_k, carry, masked):
            acc, m_i, l_i = carry
            start = pl.multiple_of(i_k * block_k, block_k)
            k = _gpu_load(r["k"].at[pl.ds(start, block_k), :], d)  # [block_k, D_PAD]
            v = _gpu_load(r["v"].at[pl.ds(start, block_k), :], dv)  # [block_k, DV_PAD]
            s = lax.dot_general(q, k, NT, precision=precision, preferred_element_type=jnp.float32) * sc.scale
            if cfg.bias:
                s = s + r["bias"][:, pl.ds(start, block_k)].astype(jnp.float32)
            cols = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
            mask = r["mask"][:, pl.ds(start, block_k)] if cfg.dense_mask else None
            t = _gpu_tile(r, b, h, rows, cols, q_at, pl.ds(start, block_k), mask, cfg)
            _, _, s = self._logits(s, t, sc, prm, cfg)
            if masked:
                s = jnp.where(self.hooks.visible(t, sc, prm, cfg), s, NEG_INF)
            m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
            m_use = jnp.where(m_new == NEG_INF, 0.0, m_new)
            p = jnp.exp2(s * LOG2E - (m_use * LOG2E)[:, None])  # [block_q, block_k]
            alpha = _exp_gpu(m_i - m_use)
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
            m_i, l_i, alpha = _add_sinks(m_i, l_i, [r["aux"][j] for j in range(n_sinks)])
            acc = acc * alpha[:, None]
        seen = l_i > 0.0
        l_safe = jnp.where(seen, l_i, 1.0)
        lse_ref[...] = jnp.where(seen, jnp.where(seen, m_i, 0.0) + jnp.log(l_safe), NEG_INF)
        _gpu_store(o_ref, (acc * jnp.where(seen, 1.0 / l_safe, 0.0)[:, None]).astype(o_ref.dtype), dv)

    def _gpu_dkdv_kernel(self, *refs, names, out_names, cfg, blocks, groups, d, dv, precision, use_kinds):
        """One block of keys of one kv head: dK and dV over the query blocks of every head of its group
        (no atomics), the bias gradient of its tiles and its share of the param gradients."""
        r = dict(zip(names, refs))
        out = dict(zip(out_names, refs[len(names):]))
        block_q, block_k = blocks.block_q, blocks.block_k
        i_k, b, hk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        sc = self.hooks.scalars(r["f32"], r["i32"])
        prm = {name: r["param_" + name] for name in self.hooks.params}
        k = _gpu_load(r["k"], d)  # [block_k, D_PAD]
        v = _gpu_load(r["v"], dv)  # [block_k, DV_PAD]
        cols = i_k * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)  # tiles are [keys, queries]
        k_at = pl.ds(i_k * block_k, block_k)
        lo, hi, flo, fhi = (r["ranges"][j] for j in range(4))
        kind_of = (lambda i: r["kinds"][i]) if use_kinds else None

        def group(g, carry):
            h = hk * groups + g
            g_bias = g if cfg.bias and r["bias"].shape[0] > 1 else 0
            g_mask = g if cfg.dense_mask and r["mask"].shape[0] > 1 else 0

            def step(i_q, carry, masked):
                dk, dv_acc, acc = carry
                start = pl.multiple_of(i_q * block_q, block_q)
                q_at = pl.ds(start, block_q)
                q = _gpu_load(r["q"].at[q_at, g, :], d)  # [block_q, D_PAD]
                do = _gpu_load(r["do"].at[q_at, g, :], dv)  # [block_q, DV_PAD]
                lse = r["lse"][g, q_at][None, :]
                delta = r["delta"][g, q_at][None, :]
                s = lax.dot_general(k, q, NT, precision=precision, preferred_element_type=jnp.float32) * sc.scale
                if cfg.bias:
                    s = s + r["bias"][g_bias, q_at, :].astype(jnp.float32).T
                rows = start + lax.broadcasted_iota(jnp.int32, (1, block_q), 1)
                mask = r["mask"][g_mask, q_at, :].T if cfg.dense_mask else None
                t = _gpu_tile(r, b, h, rows, cols, q_at, k_at, mask, cfg)
                dp = lax.dot_general(v, do, NT, precision=precision, preferred_element_type=jnp.float32)
                p, ds1, ds0, vis = self._grads_tile(s, t, sc, prm, cfg, lse, dp, delta, masked, _exp_gpu)  # [block_k, block_q]
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
        _gpu_store(out["dk"], (dk * sc.scale).astype(out["dk"].dtype), d)
        _gpu_store(out["dv"], dv_acc.astype(out["dv"].dtype), dv)
        for name in self.hooks.grad_params:
            out["dparam_" + name][...] = acc[name]

    def _gpu_dq_kernel(self, *refs, names, cfg, blocks, n_q, d, dv, precision, use_kinds):
        """One block of queries of one head: dQ over its key blocks."""
        r = dict(zip(names, refs))
        (dq_ref,) = refs[len(names):]
        block_q, block_k = blocks.block_q, blocks.block_k
        i_q = pl.program_id(0)
        if cfg.causal:
            i_q = n_q - 1 - i_q
        b, h = pl.program_id(1), pl.program_id(2)
        sc = self.hooks.scalars(r["f32"], r["i32"])
        prm = {name: r["param_" + name] for name in self.hooks.params}
        q = _gpu_load(r["q"], d)  # [block_q, D_PAD]
        do = _gpu_load(r["do"], dv)  # [block_q, DV_PAD]
        lse = r["lse"][...][:, None]
        delta = r["delta"][...][:, None]
        rows = i_q * block_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
        q_at = pl.ds(i_q * block_q, block_q)
        lo, hi, flo, fhi = (r["ranges"][j] for j in range(4))

        def step(i_k, dq, masked):
            start = pl.multiple_of(i_k * block_k, block_k)
            k = _gpu_load(r["k"].at[pl.ds(start, block_k), :], d)  # [block_k, D_PAD]
            v = _gpu_load(r["v"].at[pl.ds(start, block_k), :], dv)  # [block_k, DV_PAD]
            s = lax.dot_general(q, k, NT, precision=precision, preferred_element_type=jnp.float32) * sc.scale
            if cfg.bias:
                s = s + r["bias"][:, pl.ds(start, block_k)].astype(jnp.float32)
            cols = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
            mask = r["mask"][:, pl.ds(start, block_k)] if cfg.dense_mask else None
            t = _gpu_tile(r, b, h, rows, cols, q_at, pl.ds(start, block_k), mask, cfg)
            dp = lax.dot_general(do, v, NT, precision=precision, preferred_element_type=jnp.float32)
            _, _, ds0, _ = self._grads_tile(s, t, sc, prm, cfg, lse, dp, delta, masked, _exp_gpu)  # [block_q, block_k]
            return dq + lax.dot_general(ds0.astype(k.dtype), k, NN, precision=precision, preferred_element_type=jnp.float32)

        kind_of = (lambda i: r["kinds"][i]) if use_kinds else None
        dq = _rt.visit(lo, hi, flo, fhi, kind_of, step, jnp.zeros((block_q, r["q"].shape[-1]), jnp.float32))
        _gpu_store(dq_ref, (dq * sc.scale).astype(dq_ref.dtype), d)

    def _gpu_metadata(self, kernel, blocks, ctx, sc, prm, cfg, shape):
        """(ranges, kinds or None) of a GPU kernel: per program its blocks of the other index."""
        n_q, n_kv = shape[3] // blocks.block_q, shape[4] // blocks.block_k
        kinds = self._dense_kinds(blocks.block_q, blocks.block_k, ctx, sc, prm, cfg, shape) if self.hooks.runtime_mask(cfg) else None
        if kernel == "dkdv":
            return self.hooks.q_ranges(n_kv, blocks.block_q, blocks.block_k, n_q, sc, cfg), None if kinds is None else kinds.T
        return self.hooks.kv_ranges(n_q, blocks.block_q, blocks.block_k, n_kv, sc, cfg), kinds

    def _gpu_forward(self, q, k, v, ctx, *, cfg, interpret):
        """(out, lse) in the kernel layout, from one self.forward kernel."""
        batch, kv_heads, groups, sq, d = q.shape
        sk, dv = k.shape[2], v.shape[-1]
        blocks = gpu_blocks("fwd", d, dv, q.dtype, cfg, interpret)
        scalars, prm = self.hooks.pack_scalars(ctx), self.hooks.params_of(ctx)
        metadata = self._gpu_metadata("fwd", blocks, ctx, self.hooks.scalars(*scalars), prm, cfg, (batch, kv_heads, groups, sq, sk))
        q, k, v = _to_gpu_layout(q), _to_gpu_layout(k), _to_gpu_layout(v)
        ops = _gpu_operands("fwd", q, k, v, ctx, cfg, scalars, prm, blocks, metadata)
        n_q, heads = sq // blocks.block_q, kv_heads * groups
        q_block = lambda i: n_q - 1 - i if cfg.causal else i
        kernel = functools.partial(
            self._gpu_fwd_kernel, names=tuple(ops.names), cfg=cfg, blocks=blocks, n_q=n_q, d=d, dv=dv,
            n_sinks=ctx["softmax_aux"].shape[-1] if cfg.sinks else 0, precision=_precision(q.dtype),
            use_kinds=self.hooks.runtime_mask(cfg))
        out, lse = pl.pallas_call(
            kernel,
            grid=(n_q, batch, heads),
            in_specs=ops.specs,
            out_specs=[
                pl.BlockSpec((None, blocks.block_q, None, _rt.pow2(dv)), lambda i, b, h: (b, q_block(i), h, 0)),
                pl.BlockSpec((None, None, blocks.block_q), lambda i, b, h: (b, h, q_block(i))),
            ],
            out_shape=[jax.ShapeDtypeStruct((batch, sq, heads, dv), q.dtype),
                       jax.ShapeDtypeStruct((batch, heads, sq), jnp.float32)],
            compiler_params=_gpu_params(blocks),
            interpret=interpret,
            name=f"{self.hooks.name}_fwd",
        )(*ops.arrays)
        return _from_gpu_layout(out, groups), lse.reshape(batch, kv_heads, groups, sq)

    def _gpu_backward(self, q, k, v, d_out, lse, delta, ctx, *, cfg, interpret):
        """(dq, dk, dv, dbias or None, {param: flat gradient}): a dK/dV kernel, then a dQ kernel."""
        batch, kv_heads, groups, sq, d = q.shape
        sk, dv = k.shape[2], v.shape[-1]
        heads = kv_heads * groups
        scalars, prm = self.hooks.pack_scalars(ctx), self.hooks.params_of(ctx)
        sc = self.hooks.scalars(*scalars)
        shape = (batch, kv_heads, groups, sq, sk)
        precision = _precision(q.dtype)
        q_side = (("do", _to_gpu_layout(d_out)), ("lse", lse.reshape(batch, heads, sq)),
                  ("delta", delta.reshape(batch, heads, sq)))
        q, k, v = _to_gpu_layout(q), _to_gpu_layout(k), _to_gpu_layout(v)

        blocks = gpu_blocks("dkdv", d, dv, q.dtype, cfg, interpret)
        n_kv = sk // blocks.block_k
        ops = _gpu_operands("dkdv", q, k, v, ctx, cfg, scalars, prm, blocks,
                            self._gpu_metadata("dkdv", blocks, ctx, sc, prm, cfg, shape), q_side)
        k_map = lambda i, b, hk: (b, i, hk, 0)
        outs = [("dk", jax.ShapeDtypeStruct(k.shape, k.dtype), pl.BlockSpec((None, blocks.block_k, None, _rt.pow2(d)), k_map)),
                ("dv", jax.ShapeDtypeStruct(v.shape, v.dtype), pl.BlockSpec((None, blocks.block_k, None, _rt.pow2(dv)), k_map))]
        aliases = {}
        if cfg.bias:  # tiles no program visits stay zero: the output starts as zeros
            dbias_spec = pl.BlockSpec((None, None, groups, sq, blocks.block_k), lambda i, b, hk: (b, hk, 0, 0, i))
            aliases[len(ops.names)] = len(outs)
            ops.add("dbias_zeros", jnp.zeros(shape, jnp.float32), dbias_spec)
            outs.append(("dbias", jax.ShapeDtypeStruct(shape, jnp.float32), dbias_spec))
        for name in self.hooks.grad_params:
            lanes = _param_lanes(prm[name])
            outs.append(("dparam_" + name, jax.ShapeDtypeStruct((batch, kv_heads, n_kv, 1, lanes), jnp.float32),
                         pl.BlockSpec((None, None, None, 1, lanes), lambda i, b, hk: (b, hk, i, 0, 0))))
        kernel = functools.partial(
            self._gpu_dkdv_kernel, names=tuple(ops.names), out_names=tuple(o[0] for o in outs), cfg=cfg, blocks=blocks,
            groups=groups, d=d, dv=dv, precision=precision, use_kinds=self.hooks.runtime_mask(cfg))
        results = pl.pallas_call(
            kernel,
            grid=(n_kv, batch, kv_heads),
            in_specs=ops.specs,
            out_specs=[o[2] for o in outs],
            out_shape=[o[1] for o in outs],
            input_output_aliases=aliases,
            compiler_params=_gpu_params(blocks),
            interpret=interpret,
            name=f"{self.hooks.name}_bwd_dkdv",
        )(*ops.arrays)
        grads = dict(zip((o[0] for o in outs), results))

        blocks = gpu_blocks("dq", d, dv, q.dtype, cfg, interpret)
        n_q = sq // blocks.block_q
        ops = _gpu_operands("dq", q, k, v, ctx, cfg, scalars, prm, blocks,
                            self._gpu_metadata("dq", blocks, ctx, sc, prm, cfg, shape), q_side)
        q_block = lambda i: n_q - 1 - i if cfg.causal else i
        kernel = functools.partial(self._gpu_dq_kernel, names=tuple(ops.names), cfg=cfg, blocks=blocks, n_q=n_q, d=d, dv=dv,
                                   precision=precision, use_kinds=self.hooks.runtime_mask(cfg))
        dq = pl.pallas_call(
            kernel,
            grid=(n_q, batch, heads),
            in_specs=ops.specs,
            out_specs=pl.BlockSpec((None, blocks.block_q, None, _rt.pow2(d)), lambda i, b, h: (b, q_block(i), h, 0)),
            out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
            compiler_params=_gpu_params(blocks),
            interpret=interpret,
            name=f"{self.hooks.name}_bwd_dq",
        )(*ops.arrays)
        dparams = {name: jnp.sum(grads["dparam_" + name], axis=(0, 1, 2, 3)) for name in self.hooks.grad_params}
        dk, dv_ = _from_gpu_layout(grads["dk"]), _from_gpu_layout(grads["dv"])
        return _from_gpu_layout(dq, groups), dk, dv_, grads.get("dbias"), dparams

    def _tpu_fwd_kernel(self, kinds_ref, fetch_ref, *refs, names, cfg, blocks, n_kv, groups, n_sinks, precision):
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
            prm = {name: r["param_" + name] for name in self.hooks.params}
            q = r["q"][...]  # [block_q, D]
            k = r["k"][...]  # [block_k, D]
            s = lax.dot_general(q, k, NT, precision=precision, preferred_element_type=jnp.float32) * sc.scale
            if cfg.bias:
                s = s + r["bias"][...].astype(jnp.float32)
            t = _tpu_tile(r, b, h, i_q, i_k, block_q, block_k, cfg)
            _, _, s = self._logits(s, t, sc, prm, cfg)
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
                m, l, alpha = _add_sinks(m, l, [r["aux"][h, j] for j in range(n_sinks)])
                acc = acc * _rt.lanes(alpha, dv)
            seen = l > 0.0
            l_safe = jnp.where(seen, l, 1.0)
            lse_ref[...] = jnp.where(seen, jnp.where(seen, m, 0.0) + jnp.log(l_safe), NEG_INF)
            o_ref[...] = (acc * _rt.lanes(jnp.where(seen, 1.0 / l_safe, 0.0), dv)).astype(o_ref.dtype)

    def _tpu_grads_tile(self, r, b, h, i_q, i_k, block_q, block_k, cfg, precision, masked):
        """What both TPU backward kernels compute for one tile: (q, k, do, s, t, scalars, params,
        (p, ds1, ds0, vis)), every tile [block_q, block_k]."""
        sc = self.hooks.scalars(r["f32"], r["i32"])
        prm = {name: r["param_" + name] for name in self.hooks.params}
        q, k, v, do = r["q"][...], r["k"][...], r["v"][...], r["do"][...]
        s = lax.dot_general(q, k, NT, precision=precision, preferred_element_type=jnp.float32) * sc.scale
        if cfg.bias:
            s = s + r["bias"][...].astype(jnp.float32)
        t = _tpu_tile(r, b, h, i_q, i_k, block_q, block_k, cfg)
        dp = lax.dot_general(do, v, NT, precision=precision, preferred_element_type=jnp.float32)
        lse, delta = _rt.lanes(r["lse"][...], block_k), _rt.lanes(r["delta"][...], block_k)
        return q, k, do, s, t, sc, prm, self._grads_tile(s, t, sc, prm, cfg, lse, dp, delta, masked, jnp.exp)

    def _tpu_dkdv_kernel(self, kinds_ref, fetch_ref, *refs, names, out_names, cfg, blocks, n_q, groups, precision):
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
            q, _, do, s, t, sc, prm, (p, ds1, ds0, vis) = self._tpu_grads_tile(
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

    def _tpu_dq_kernel(self, kinds_ref, fetch_ref, *refs, names, cfg, blocks, n_kv, precision):
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
            _, k, *_, (_, _, ds0, _) = self._tpu_grads_tile(r, b, h, i_q, i_k, block_q, block_k, cfg, precision, masked)
            dq_scr[...] += lax.dot_general(ds0.astype(k.dtype), k, NN, precision=precision, preferred_element_type=jnp.float32)

        pl.when(kind == 1)(lambda: step(True))
        pl.when(kind == 2)(lambda: step(False))

        @pl.when(i_k == n_kv - 1)
        def _finish():
            dq_ref[...] = (dq_scr[...] * r["f32"][0]).astype(dq_ref.dtype)

    def _tpu_setup(self, q, k, v, ctx, cfg, interpret):
        """(blocks, scalars, params, kinds [n_q, n_kv]) shared by the TPU kernels of one call."""
        batch, kv_heads, groups, sq, _ = q.shape
        sk = k.shape[2]
        blocks = TpuBlockSizes.get_default(interpret).fit(sq, sk)
        scalars, prm = self.hooks.pack_scalars(ctx), self.hooks.params_of(ctx)
        kinds = self._kinds(blocks.block_q, blocks.block_k, ctx, self.hooks.scalars(*scalars), prm, cfg, (batch, kv_heads, groups, sq, sk))
        return blocks, scalars, prm, kinds

    def _tpu_forward(self, q, k, v, ctx, *, cfg, interpret):
        batch, kv_heads, groups, sq, _ = q.shape
        dv = v.shape[-1]
        blocks, scalars, prm, kinds = self._tpu_setup(q, k, v, ctx, cfg, interpret)
        n_q, n_kv = kinds.shape
        coords = lambda b, h, iq, ik, kinds, fetch: (b, *_head(h, groups), iq, fetch[iq, ik])
        ops = _tpu_operands(q, k, v, ctx, cfg, scalars, prm, blocks, coords)
        q_map = lambda b, h, iq, ik, kinds, fetch: (b, *_head(h, groups), iq, 0)
        kernel = functools.partial(
            self._tpu_fwd_kernel, names=tuple(ops.names), cfg=cfg, blocks=blocks, n_kv=n_kv, groups=groups,
            n_sinks=ctx["softmax_aux"].shape[-1] if cfg.sinks else 0, precision=_precision(q.dtype))
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
            out_shape=[jax.ShapeDtypeStruct((batch, kv_heads, groups, sq, dv), q.dtype),
                       jax.ShapeDtypeStruct((batch, kv_heads, groups, sq, NUM_LANES), jnp.float32)],
            compiler_params=_tpu_params("parallel", "parallel", "parallel", "arbitrary"),
            interpret=interpret,
            name=f"{self.hooks.name}_fwd",
        )(kinds, _rt.fetch_table(kinds), *ops.arrays)
        return out, lse[..., 0]

    def _tpu_backward(self, q, k, v, d_out, lse, delta, ctx, *, cfg, interpret):
        """(dq, dk, dv, dbias or None, {param: flat gradient}): a dK/dV kernel, then a dQ kernel."""
        batch, kv_heads, groups, sq, d = q.shape
        sk, dv = k.shape[2], v.shape[-1]
        blocks, scalars, prm, kinds = self._tpu_setup(q, k, v, ctx, cfg, interpret)
        n_q, n_kv = kinds.shape
        q_side = (("do", d_out), ("lse", lse), ("delta", delta))
        precision = _precision(q.dtype)

        kinds_t = kinds.T
        coords = lambda b, hk, ik, g, iq, kinds, fetch: (b, hk, g, fetch[ik, iq], ik)
        ops = _tpu_operands(q, k, v, ctx, cfg, scalars, prm, blocks, coords, q_side)
        k_map = lambda b, hk, ik, g, iq, kinds, fetch: (b, hk, ik, 0)
        outs = [("dk", jax.ShapeDtypeStruct(k.shape, k.dtype), pl.BlockSpec((None, None, blocks.block_k, d), k_map)),
                ("dv", jax.ShapeDtypeStruct(v.shape, v.dtype), pl.BlockSpec((None, None, blocks.block_k, dv), k_map))]
        if cfg.bias:
            outs.append(("dbias", jax.ShapeDtypeStruct((batch, kv_heads, groups, sq, sk), jnp.float32),
                         pl.BlockSpec((None, None, None, blocks.block_q, blocks.block_k),
                                      lambda b, hk, ik, g, iq, kinds, fetch: (b, hk, g, iq, ik))))
        scratch = [pltpu.VMEM((blocks.block_k, d), jnp.float32), pltpu.VMEM((blocks.block_k, dv), jnp.float32)]
        for name in self.hooks.grad_params:
            lanes = _param_lanes(prm[name])
            outs.append(("dparam_" + name, jax.ShapeDtypeStruct((batch, kv_heads, n_kv, 1, lanes), jnp.float32),
                         pl.BlockSpec((None, None, None, 1, lanes), lambda b, hk, ik, g, iq, kinds, fetch: (b, hk, ik, 0, 0))))
            scratch.append(pltpu.VMEM((1, lanes), jnp.float32))
        kernel = functools.partial(self._tpu_dkdv_kernel, names=tuple(ops.names), out_names=tuple(o[0] for o in outs), cfg=cfg,
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
            compiler_params=_tpu_params("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
            interpret=interpret,
            name=f"{self.hooks.name}_bwd_dkdv",
        )(kinds_t, _rt.fetch_table(kinds_t), *ops.arrays)
        grads = dict(zip((o[0] for o in outs), results))

        coords = lambda b, h, iq, ik, kinds, fetch: (b, *_head(h, groups), iq, fetch[iq, ik])
        ops = _tpu_operands(q, k, v, ctx, cfg, scalars, prm, blocks, coords, q_side)
        q_map = lambda b, h, iq, ik, kinds, fetch: (b, *_head(h, groups), iq, 0)
        kernel = functools.partial(self._tpu_dq_kernel, names=tuple(ops.names), cfg=cfg, blocks=blocks, n_kv=n_kv,
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
            out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
            compiler_params=_tpu_params("parallel", "parallel", "parallel", "arbitrary"),
            interpret=interpret,
            name=f"{self.hooks.name}_bwd_dq",
        )(kinds, _rt.fetch_table(kinds), *ops.arrays)
        dparams = {name: jnp.sum(grads["dparam_" + name], axis=(0, 1, 2, 3)) for name in self.hooks.grad_params}
        return dq, grads["dk"], grads["dv"], grads.get("dbias"), dparams

    def forward(self, q, k, v, ctx, cfg, kernels=None):
        del kernels  # one kernel set (ejgen.runtime.attention.kernels)
        """(out, lse, None) from the kernels of the lowering platform; the self.backward pass recomputes
        its block metadata, so nothing else is saved."""
        gpu = functools.partial(self._gpu_forward, cfg=cfg)
        tpu = functools.partial(self._tpu_forward, cfg=cfg)
        out, lse = _rt.dispatch(gpu, tpu, q, k, v, ctx)
        return out, lse, None

    def backward(self, q, k, v, out, lse, kinds, d_out, d_lse, ctx, cfg, kernels=None):
        del kernels
        """Gradients (dq, dk, dv, dctx) from the saved lse: ds = p * (dp - delta) with
        delta = rowsum(d_out * out) - d_lse, then back through the soft cap and the score hook."""
        del kinds
        f32 = jnp.float32
        delta = jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1) - d_lse
        lse_safe = jnp.where(lse == NEG_INF, 0.0, lse)
        gpu = functools.partial(self._gpu_backward, cfg=cfg)
        tpu = functools.partial(self._tpu_backward, cfg=cfg)
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

