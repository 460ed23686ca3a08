"""Host side of the Triton decode kernel (`decode_kernel` of a spec's `triton_decode.py`; docs/DESIGN.md §3,
"Decode and paged modes"): the launch over (batch, kv head, split) programs; the split count is
`ejgen.runtime.attention.split_k`'s, shared with the Pallas GPU kernel, and so is the merge of the splits by lse (an
in-kernel merge by the last split of each pair to end lost to it on one H100, session 19). Paged calls read the pages
through the block table inside the kernel (no gather of the cache)."""

from __future__ import annotations

import importlib
import math

import jax
import jax.numpy as jnp

from ejgen.runtime.attention import split_k
from ejgen.runtime.attention.triton import host
from ejgen.runtime.launch import triton_call

BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2
# Pages that are not whole multiples of BLOCK_N (a block over several pages: smaller ones, or e.g. 96 keys):
# PAGES_AHEAD reads the next block's page numbers a step ahead (a loop carry), else each block reads its own (an
# indirect load the software pipeliner stages before K's); decode_tune.py A/Bs it. Session 21, one H200, 32 calls a
# sample, page 16 against the contiguous call: each block's own read took the ragged batch (B32, lengths 1..16k) from
# 298.8 to 272.3 us (0.89 -> 0.98 of contiguous), B8 S8k 81.9 -> 84.1 (0.99 -> 0.95), B32 S8k 268.6 -> 270.6, B4
# S32k 149.2 -> 148.8. Blocks of 16 or 32 keys for small pages (a launch of their own) lost or tied: not kept.
PAGES_AHEAD = False
# Pages that hold whole blocks (PAGE a multiple of BLOCK_N): WHOLE_PAGE reads a block's page number once (a scalar
# load whose result the block's K and V addresses wait on), else per key as smaller pages do (the indirect load the
# pipeliner stages). Session 26, one H200, 32 calls a sample: at B8 S8k paged 64 took 86.1 us against the contiguous
# 77.1 (0.90; 0.99 in session 21) where paged 16, read per key, took 81.7: `decode_tune.py` A/Bs it ("whole page").
WHOLE_PAGE = True
# The split's page numbers read once before the key loop instead (a block's picked from them, or each key's gathered)
# tied the reads in the loop (session 29, H200, 128 calls a sample: paged16 B8 S8k 81.2 -> 80.0 us, the other rows
# within 1%): removed (notes/perf.md).
# Paged calls at 3 stages (the pipeliner copying a block's page numbers one step before its K / V, which kept one
# buffer; a helper's static study of sm_90 SASS, session 33, notes/perf.md) lost (session 34, one H200,
# `decode_tune.py`, 128 calls a sample): paged16 B8 S8k 75.2 -> 131.5 us, the ragged B32 rows within 1%. Removed.
INTERPRET_BLOCK_N = 16  # the interpreter's cost grows with the tile


def forward(kernel_module: str, f32_options: tuple, i32_options: tuple, params: tuple, call, batch_invariant=False):
    """(out [B, Sq, Hkv, G, Dv] in q's dtype, lse [B, Hkv, G, Sq] float32), as `decode.xla_forward`."""
    q, k, v, ctx, cfg = call.q, call.k, call.v, call.ctx, call.cfg
    batch, sq, hkv, groups, d = q.shape
    dv = v.shape[-1]
    paged = call.tables is not None
    seq = call.tables.shape[1] * call.page if paged else k.shape[1]
    interpret = triton_call.mode()[0] == "interpret"
    block_n = INTERPRET_BLOCK_N if interpret else BLOCK_N
    slots = split_k.slots(block_n, d, dv, q.dtype.itemsize, NUM_STAGES, sms=split_k.INTERPRET_SMS if interpret else None)
    n_splits, per_split = split_k.splits(batch, hkv, split_k.keys_to_visit(seq, cfg, sq, block_n), block_n, slots,
                                         batch_invariant)
    m_pad = host._pow2(groups * sq)
    d_pad, dv_pad = host._pow2(d), host._pow2(dv)
    scalars = host.scalar_arrays(ctx, f32_options, i32_options)
    if paged:  # as given: the kernel clamps them and takes start 0 (no XLA kernel before the call)
        table, lens = call.raw  # (`prepare_paged`'s)
        bounds = [lens, lens]  # (STARTS unread)
    else:
        table, bounds = jnp.zeros((1,), jnp.int32), [call.starts, call.ends]
    inputs = [q.reshape(batch, sq, hkv * groups, d), k, v, *bounds, table, *scalars]
    inputs += [ctx[f"param_{p}"] for p in params]
    sinks = ctx.get("softmax_aux") if cfg.sinks else None  # [Hkv, G, n]: split_k.merge adds them
    grid = (batch, hkv, n_splits)
    parts = (batch, hkv, n_splits, groups * sq)  # the real rows (the kernel's M_PAD are the products')
    sds = jax.ShapeDtypeStruct
    outs = [sds(parts + (dv_pad,), jnp.float32), sds(parts, jnp.float32), sds(parts, jnp.float32),
            sds((math.prod(grid) * triton_call.SCRATCH_PER_PROGRAM,), jnp.uint8)]
    kernel = importlib.import_module(kernel_module).decode_kernel
    o_part, m_part, l_part, _ = triton_call.launch(
        kernel, grid, inputs, outs, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        B=batch, HQ=hkv * groups, HKV=hkv, SQ=sq, SEQ_K=k.shape[1], D=d, DV=dv, D_PAD=d_pad, DV_PAD=dv_pad, G=groups,
        M_PAD=m_pad, BLOCK_N=block_n, SPLIT=per_split, N_SPLITS=n_splits, CAUSAL=cfg.causal, WINDOW=cfg.window,
        SOFTCAP=cfg.softcap, PAGED=paged, PAGE=call.page if paged else 1,
        MAX_PAGES=call.tables.shape[1] if paged else 1, POOL_PAGES=k.shape[0] if paged else 1,
        PAGES_AHEAD=PAGES_AHEAD, WHOLE_PAGE=WHOLE_PAGE,
        PRECISION="ieee" if q.dtype == jnp.float32 else "tf32", UPCAST=interpret and q.dtype == jnp.bfloat16)
    return split_k.merge(o_part, m_part, l_part, sinks, groups, sq, dv, q.dtype)
