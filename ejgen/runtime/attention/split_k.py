"""Split-K decode (FlashDecoding) shared by the Triton and Pallas GPU kernels (docs/DESIGN.md §3, "Decode and paged
modes"): how many splits a call takes, and the merge of the splits' partial results by lse (sinks included).

Splits: one count for every sequence of a call, B x Hkv x splits about the GPU's program slots (SMs x
PROGRAMS_PER_SM, fewer where their shared memory does not fit), at least MIN_SPLIT_BLOCKS key blocks and at most
MAX_SPLIT_KEYS keys each; a split past its sequence's end is a program that returns at once. ``batch_invariant``:
BATCH_INVARIANT_SPLIT keys per split, so a sequence's splits, and so its result, do not depend on what else is in the
batch."""

from __future__ import annotations

import jax.numpy as jnp

from ejgen.runtime.core import shared_memory, sizes
from ejgen.runtime.core.device import num_sms

PROGRAMS_PER_SM = 4  # resident programs per SM the splits fill: fewer leave too few loads in flight to hide HBM latency
WAVES = 1  # programs per slot
MIN_SPLIT_BLOCKS = 4  # a split reads at least this many key blocks (its fixed cost: the query, the partial stores)
BATCH_INVARIANT_SPLIT = 512  # keys per split with batch_invariant: the same whatever the batch
MAX_SPLIT_KEYS = 4096  # keys per split at most (0: no cap): the split count comes from the cache rows, so in a ragged
# batch (lengths 1..16k in rows of 16k, B32) its long sequences held 8k-key programs long after the others ended: 346 us
# (1.36x its bytes' time in a uniform batch); capped at 2048, 303 us (H200, session 18, decode_tune.py). 4096 leaves
# every uniform case of the benchmark as it was (their splits are 1024-4096 keys): 2048 cost B32 S8k 8% there.
INTERPRET_SMS = 2  # the interpreters' cost grows with the programs, empty ones included


def slots(block_n: int, d: int, dv: int, item: int, stages: int = 2, sms: int | None = None) -> int:
    """Programs the GPU runs at once: SMs x PROGRAMS_PER_SM, fewer where their shared memory does not fit (Triton keeps
    ``stages`` - 1 K / V tiles in flight besides the query: 38.9 KB at bf16, D 128, BLOCK_N 64 in the sm_90 build)."""
    dp, dvp = sizes.pow2(d), sizes.pow2(dv)
    per_program = (max(1, stages - 1) * block_n * (dp + dvp) + 16 * dp) * item
    return (sms or num_sms()) * max(1, min(PROGRAMS_PER_SM, shared_memory.HOPPER // per_program))


def splits(batch: int, kv_heads: int, seq: int, block_n: int, slots: int, batch_invariant: bool = False):
    """(splits, keys per split) of one call over cache rows of ``seq`` keys, whole blocks each (module docstring)."""
    blocks = max(1, -(-seq // block_n))
    if batch_invariant:
        per = -(-BATCH_INVARIANT_SPLIT // block_n)
    else:
        per = -(-blocks // max(1, min(WAVES * slots // (batch * kv_heads), blocks // MIN_SPLIT_BLOCKS)))
        if MAX_SPLIT_KEYS:
            per = max(1, min(per, MAX_SPLIT_KEYS // block_n))
    return -(-blocks // per), per * block_n


def keys_to_visit(seq: int, cfg, sq: int, block_n: int) -> int:
    """Keys a sequence's splits cover at most: the cache row, or with a sliding window the keys the last Sq rows can
    see (window span + Sq) and the block boundary before them."""
    return min(seq, cfg.window_span + sq + block_n) if cfg.window else seq


def merge(o_part, m_part, l_part, sinks, groups: int, sq: int, dv: int, dtype):
    """The splits' partial results [B, Hkv, splits, M(, Dv)] (rows g * Sq + i) combined by their maxima (float32);
    sinks [Hkv, G, n] join the denominator. Returns (out [B, Sq, Hkv, G, Dv] in ``dtype``, lse [B, Hkv, G, Sq])."""
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
