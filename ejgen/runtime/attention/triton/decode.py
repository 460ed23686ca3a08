"""Host side of the Triton decode kernel (`decode_kernel` of a spec's `triton_decode.py`; docs/DESIGN.md §3,
"Decode and paged modes"): the split count, the launch, and the merge of the splits by lse (sinks included).

Splits: the count that gives the busiest SM the least work (`splits`), each split a whole number of key blocks;
a split past its sequence's end returns at once, so a batch of short sequences in a long cache costs the programs'
launch only. Paged calls read the pages through the block table inside the kernel (no
gather of the cache)."""

from __future__ import annotations

import importlib
import math

import jax
import jax.numpy as jnp

from ejgen.runtime.attention.triton import host
from ejgen.runtime.core.device import num_sms
from ejgen.runtime.launch import triton_call

MIN_PROGRAMS_PER_SM = 2  # resident programs an SM needs to keep enough loads in flight
PROGRAM_COST_BLOCKS = 2  # a program's fixed cost (query load, pipeline fill, partial stores), in key blocks
MAX_SPLITS = 64
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2
BATCH_INVARIANT_SPLIT = 512  # keys per split with batch_invariant: the same whatever the batch
INTERPRET_BLOCK_N = 16  # the interpreter's cost grows with the tile


def splits(batch: int, kv_heads: int, seq: int, block_n: int, batch_invariant: bool = False,
           sms: int | None = None) -> tuple[int, int]:
    """(number of splits, keys per split): a multiple of ``block_n`` keys each. ``batch_invariant``: a fixed split
    size, so that a sequence's partial sums, and so its result, do not depend on what else is in the batch.

    Otherwise the split count that gives the busiest SM the least work: every program is resident at once
    (``MIN_PROGRAMS_PER_SM`` per SM when there are keys enough), so an SM's time is its programs' keys plus a fixed
    cost per program (``PROGRAM_COST_BLOCKS``). Programs (B * Hkv * splits) that are not a multiple of the SM count
    leave some SMs one program more: 32 (b, kv head) pairs in 9 splits put 3 programs on some SMs of 132 where 12
    splits give every SM at most 3 shorter ones (a third less on the busiest SM)."""
    blocks = max(1, -(-seq // block_n))
    if batch_invariant:
        per = -(-BATCH_INVARIANT_SPLIT // block_n)
        return -(-blocks // per), per * block_n
    sms = sms or num_sms()
    pairs = batch * kv_heads
    best = None
    for n in range(1, min(blocks, MAX_SPLITS) + 1):
        per = -(-blocks // n)
        n = -(-blocks // per)  # splits that hold keys
        busiest = -(-pairs * n // sms)  # programs on the busiest SM
        cost = busiest * (per + PROGRAM_COST_BLOCKS)
        starved = pairs * n < MIN_PROGRAMS_PER_SM * sms and n < blocks  # fewer programs than SMs can hold
        key = (starved, cost, n)
        if best is None or key < best[0]:
            best = (key, n, per)
    return best[1], best[2] * block_n


def forward(kernel_module: str, f32_options: tuple, i32_options: tuple, params: tuple, call, batch_invariant=False):
    """(out [B, Sq, Hkv, G, Dv] in q's dtype, lse [B, Hkv, G, Sq] float32), as `decode.xla_forward`."""
    q, k, v, ctx, cfg = call.q, call.k, call.v, call.ctx, call.cfg
    batch, sq, hkv, groups, d = q.shape
    dv = v.shape[-1]
    paged = call.tables is not None
    seq = call.tables.shape[1] * call.page if paged else k.shape[1]
    block_n = INTERPRET_BLOCK_N if triton_call.mode()[0] == "interpret" else BLOCK_N
    n_splits, per_split = splits(batch, hkv, seq, block_n, batch_invariant)
    m_pad = host._pow2(groups * sq)
    d_pad, dv_pad = host._pow2(d), host._pow2(dv)
    scalars = host.scalar_arrays(ctx, f32_options, i32_options)
    table = call.tables if paged else jnp.zeros((1,), jnp.int32)
    inputs = [q.reshape(batch, sq, hkv * groups, d), k, v, call.starts, call.ends, table, *scalars]
    inputs += [ctx[f"param_{p}"] for p in params]
    grid = (batch, hkv, n_splits)
    parts = (batch, hkv, n_splits, m_pad)
    outs = [jax.ShapeDtypeStruct(parts + (dv_pad,), jnp.float32), jax.ShapeDtypeStruct(parts, jnp.float32),
            jax.ShapeDtypeStruct(parts, jnp.float32),
            jax.ShapeDtypeStruct((math.prod(grid) * triton_call.SCRATCH_PER_PROGRAM,), jnp.uint8)]
    kernel = importlib.import_module(kernel_module).decode_kernel
    o_part, m_part, l_part, _ = triton_call.launch(
        kernel, grid, inputs, outs, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        B=batch, HQ=hkv * groups, HKV=hkv, SQ=sq, SEQ_K=k.shape[1], D=d, DV=dv, D_PAD=d_pad, DV_PAD=dv_pad, G=groups,
        M_PAD=m_pad, BLOCK_N=block_n, SPLIT=per_split, N_SPLITS=n_splits, CAUSAL=cfg.causal, WINDOW=cfg.window,
        SOFTCAP=cfg.softcap, PAGED=paged, PAGE=call.page if paged else 1,
        MAX_PAGES=call.tables.shape[1] if paged else 1, PRECISION="ieee" if q.dtype == jnp.float32 else "tf32",
        UPCAST=triton_call.mode()[0] == "interpret" and q.dtype == jnp.bfloat16)
    return merge(o_part, m_part, l_part, ctx.get("softmax_aux") if cfg.sinks else None, groups, sq, dv, q.dtype)


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
