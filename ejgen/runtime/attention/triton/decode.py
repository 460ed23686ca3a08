"""Host side of the Triton decode kernel (`decode_kernel` of a spec's `triton_decode.py`; docs/DESIGN.md §3,
"Decode and paged modes"): the work list, the launch, and the merge of the items by lse (sinks included,
`decode_merge.merge_kernel`).

Work list: items (sequence, kv head, split) of about equal keys, sized on the device from the lengths so that they
fill `WAVES` waves of the GPU's program slots: a ragged batch costs what its keys cost, not what its longest row
does, and the GPU's scheduler hands items to SMs as others finish. A sliding window visits only the
keys its last query row can see (from a block boundary). Paged calls read the pages through the block table inside
the kernel (no gather of the cache)."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

from ejgen.runtime.attention.triton import decode_merge, host
from ejgen.runtime.core import shared_memory
from ejgen.runtime.core.device import num_sms
from ejgen.runtime.launch import triton_call

PROGRAMS_PER_SM = 4  # resident programs per SM the work list fills: fewer leave loads too few to hide HBM latency
WAVES = 1  # work items per program slot: the items are about equal, so one wave is balanced
MIN_SPLIT_BLOCKS = 4  # an item reads at least this many key blocks (its fixed cost: the query, the stores)
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2
BATCH_INVARIANT_SPLIT = 512  # keys per item with batch_invariant: the same whatever the batch
INTERPRET_BLOCK_N = 16  # the interpreter's cost grows with the tile
INTERPRET_SMS = 2  # and with the programs, empty ones included


def slots(block_n: int, d: int, dv: int, item: int, sms: int | None = None) -> int:
    """Programs the GPU runs at once: SMs x PROGRAMS_PER_SM, fewer where their shared memory does not fit (Triton keeps
    NUM_STAGES - 1 K / V tiles in flight besides the query: 38.9 KB at bf16, D 128, BLOCK_N 64 in the sm_90 build)."""
    per_program = (max(1, NUM_STAGES - 1) * block_n * (host._pow2(d) + host._pow2(dv)) + 16 * host._pow2(d)) * item
    return (sms or num_sms()) * max(1, min(PROGRAMS_PER_SM, shared_memory.HOPPER // per_program))


def work_list(lengths, kv_heads: int, seq: int, block_n: int, target: int, batch_invariant: bool = False):
    """(splits [B], item offsets [B + 1], capacity): sequence b owns items [offsets[b], offsets[b + 1]), its kv heads
    times ceil(lengths[b] / splits[b]); ``capacity`` bounds the item count statically (the grid).

    Sequence b gets floor(target x its share of the batch's keys) splits (one at least, none when empty), whole
    blocks of at least MIN_SPLIT_BLOCKS each: at most ``target`` items plus one per (sequence, kv head), about equal,
    so a ragged batch costs what its keys cost, and ``target`` = whole waves of program slots leaves no wave half
    full on a uniform batch. ``batch_invariant``: every split is BATCH_INVARIANT_SPLIT keys, so that a sequence's
    items, and so its result, do not depend on what else is in the batch."""
    batch = lengths.shape[0]
    lengths = jnp.maximum(lengths.astype(jnp.int32), 0)
    if batch_invariant:
        split = -(-BATCH_INVARIANT_SPLIT // block_n) * block_n
        splits = jnp.full((batch,), split, jnp.int32)
        capacity = batch * kv_heads * max(1, -(-seq // split))
    else:
        total = jnp.maximum(jnp.sum(lengths.astype(jnp.float32)), 1.0)
        n = jnp.maximum(jnp.floor(lengths * (target / kv_heads) / total), 1.0).astype(jnp.int32)
        blocks = jnp.maximum(-(-lengths // (n * block_n)), MIN_SPLIT_BLOCKS)
        splits = (blocks * block_n).astype(jnp.int32)
        capacity = target + batch * kv_heads
    counts = -(-lengths // splits) * kv_heads
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])
    return splits, offsets, capacity


def visited(call, cfg, sq: int, block_n: int):
    """Keys each sequence's items read: with a sliding window only those its last Sq query rows can see, from the
    block boundary at or before them (so paged blocks stay page-aligned); the kernel skips the same keys."""
    lengths = jnp.maximum(call.ends - call.starts, 0)
    if not cfg.window:
        return lengths
    return lengths - jnp.maximum(lengths - sq - call.ctx["window_left"], 0) // block_n * block_n


def forward(kernel_module: str, f32_options: tuple, i32_options: tuple, params: tuple, call, batch_invariant=False):
    """(out [B, Sq, Hkv, G, Dv] in q's dtype, lse [B, Hkv, G, Sq] float32), as `decode.xla_forward`."""
    q, k, v, ctx, cfg = call.q, call.k, call.v, call.ctx, call.cfg
    batch, sq, hkv, groups, d = q.shape
    dv = v.shape[-1]
    paged = call.tables is not None
    seq = call.tables.shape[1] * call.page if paged else k.shape[1]
    interpret = triton_call.mode()[0] == "interpret"
    block_n = INTERPRET_BLOCK_N if interpret else BLOCK_N
    target = WAVES * slots(block_n, d, dv, q.dtype.itemsize, sms=INTERPRET_SMS if interpret else None)
    splits, offsets, capacity = work_list(visited(call, cfg, sq, block_n), hkv, seq, block_n, target, batch_invariant)
    m_pad = host._pow2(groups * sq)
    d_pad, dv_pad = host._pow2(d), host._pow2(dv)
    scalars = host.scalar_arrays(ctx, f32_options, i32_options)
    table = call.tables if paged else jnp.zeros((1,), jnp.int32)
    inputs = [q.reshape(batch, sq, hkv * groups, d), k, v, call.starts, call.ends, table, splits, offsets, *scalars]
    inputs += [ctx[f"param_{p}"] for p in params]
    parts = (capacity, m_pad)
    outs = [jax.ShapeDtypeStruct(parts + (dv_pad,), jnp.float32), jax.ShapeDtypeStruct(parts, jnp.float32),
            jax.ShapeDtypeStruct(parts, jnp.float32),
            jax.ShapeDtypeStruct((capacity * triton_call.SCRATCH_PER_PROGRAM,), jnp.uint8)]
    kernel = importlib.import_module(kernel_module).decode_kernel
    o_part, m_part, l_part, _ = triton_call.launch(
        kernel, (capacity,), inputs, outs, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        B=batch, HQ=hkv * groups, HKV=hkv, SQ=sq, SEQ_K=k.shape[1], D=d, DV=dv, D_PAD=d_pad, DV_PAD=dv_pad, G=groups,
        M_PAD=m_pad, BLOCK_N=block_n, LOG2_B=max(0, (batch - 1).bit_length()), CAUSAL=cfg.causal, WINDOW=cfg.window,
        SOFTCAP=cfg.softcap, PAGED=paged, PAGE=call.page if paged else 1,
        MAX_PAGES=call.tables.shape[1] if paged else 1, PRECISION="ieee" if q.dtype == jnp.float32 else "tf32",
        UPCAST=interpret and q.dtype == jnp.bfloat16)
    sinks = ctx["softmax_aux"].astype(jnp.float32).reshape(-1) if cfg.sinks else jnp.zeros((1,), jnp.float32)
    n_sinks = ctx["softmax_aux"].shape[-1] if cfg.sinks else 0
    outs = [jax.ShapeDtypeStruct((batch, sq, hkv * groups, dv), q.dtype),
            jax.ShapeDtypeStruct((batch, hkv, groups, sq), jnp.float32),
            jax.ShapeDtypeStruct((batch * hkv * triton_call.SCRATCH_PER_PROGRAM,), jnp.uint8)]
    out, lse, _ = triton_call.launch(
        decode_merge.merge_kernel, (batch, hkv), [o_part, m_part, l_part, offsets, sinks], outs, num_warps=4,
        num_stages=1, HKV=hkv, G=groups, SQ=sq, DV=dv, DV_PAD=dv_pad, M_PAD=m_pad, N_SINKS=n_sinks)
    return out.reshape(batch, sq, hkv, groups, dv), lse


def merge(o_part, m_part, l_part, sinks, groups: int, sq: int, dv: int, dtype):
    """The splits' partial results combined by their maxima (float32); sinks [Hkv, G, n] join the denominator."""
    rows = groups * sq
    o_part, m_part, l_part = o_part[..., :rows, :dv], m_part[..., :rows], l_part[..., :rows]
    m = jnp.max(m_part, axis=2)  # [B, Hkv, M]
    if sinks is not None:
        per_row = jnp.repeat(sinks, sq, axis=1)  # [Hkv, G * Sq, n]: row r is head r // Sq
        m = jnp.maximum(m, jnp.max(per_row, axis=-1)[None])
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.where(jnp.isfinite(m_part), jnp.exp(m_part - m_safe[:, :, None]), 0.0)
    denom = jnp.sum(w * l_part, axis=2)
    if sinks is not None:
        denom = denom + jnp.sum(jnp.exp(per_row[None] - m_safe[..., None]), axis=-1)
    out = jnp.sum(w[..., None] * o_part, axis=2) / jnp.where(denom > 0, denom, 1.0)[..., None]
    lse = jnp.where(denom > 0, m_safe + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    batch, hkv = out.shape[:2]
    out = out.reshape(batch, hkv, groups, sq, dv).transpose(0, 3, 1, 2, 4)
    return out.astype(dtype), lse.reshape(batch, hkv, groups, sq)
