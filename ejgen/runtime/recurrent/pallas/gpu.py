"""The Pallas recurrent kernels for GPUs (Triton lowering): a program per (row of chunks, head) walks its chunks in
order (forward) or in reverse (backward) with the float32 state as the loop's carry; the whole row is the program's
block and each chunk a dynamic slice of it. Packed sequences share a row: a chunk that starts a sequence takes its
initial state, one that ends it writes its final state (``meta``: first, last, sequence per chunk).

The fused recurrence's forward (``fused_forward``: dense calls of algorithm fused, decoding among them) has a kernel
of its own: a program per (block of FUSED_BV value columns, sequence x head), its [K, FUSED_BV] share of the state in
float32 registers, one step at a time; each step's q, k and log gate a column of the layout, v and o a row. The state
is read once and written once, in place when the call lets it (``in_place``: the state's buffer is the final
state's, XLA copies it first only where the caller keeps it)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ejgen.runtime.recurrent.pallas import chunk

F32 = jnp.float32
NUM_WARPS = 4
FUSED_BV = 32  # value columns of a fused program (its state: K x 32 float32; B x H x V / 32 programs)


def _fwd_kernel(meta_ref, q_ref, k_ref, v_ref, l_ref, h0_ref, o_ref, hs_ref, ht_ref, *, c, n_chunks, n_seqs, dtype):
    def init(n, carry):
        ht_ref[n] = h0_ref[n]  # a sequence without steps keeps its initial state
        return carry

    lax.fori_loop(0, n_seqs, init, 0)

    def body(i, s):
        first, last, seq = meta_ref[0, i], meta_ref[1, i], meta_ref[2, i]
        s = jnp.where(first != 0, h0_ref[seq], s)
        hs_ref[i] = s
        rows = pl.ds(i * c, c)
        o, s = chunk.forward(q_ref[rows, :].astype(F32), k_ref[rows, :].astype(F32), v_ref[rows, :].astype(F32),
                             l_ref[rows, :], s, dtype)
        o_ref[rows, :] = o.astype(o_ref.dtype)

        @pl.when(last != 0)
        def _final():
            ht_ref[seq] = s

        return s

    lax.fori_loop(0, n_chunks, body, jnp.zeros(hs_ref.shape[1:], F32))


def _bwd_kernel(meta_ref, q_ref, k_ref, v_ref, l_ref, do_ref, hs_ref, dht_ref, dq_ref, dk_ref, dv_ref, dh0_ref,
                dlog_ref, *, c, n_chunks, n_seqs, dtype, gated):
    def init(n, carry):
        dh0_ref[n] = dht_ref[n]  # a sequence without steps: its final state is its initial one
        return carry

    lax.fori_loop(0, n_seqs, init, 0)

    def body(back, ds):
        i = n_chunks - 1 - back
        first, last, seq = meta_ref[0, i], meta_ref[1, i], meta_ref[2, i]
        ds = jnp.where(last != 0, dht_ref[seq], ds)
        rows = pl.ds(i * c, c)
        dq, dk, dv, ds, dlog = chunk.backward(q_ref[rows, :].astype(F32), k_ref[rows, :].astype(F32),
                                              v_ref[rows, :].astype(F32), l_ref[rows, :],
                                              do_ref[rows, :].astype(F32), hs_ref[i], ds, dtype, gated)
        dq_ref[rows, :] = dq
        dk_ref[rows, :] = dk
        dv_ref[rows, :] = dv
        if gated:
            dlog_ref[rows, :] = dlog

        @pl.when(first != 0)
        def _start():
            dh0_ref[seq] = ds

        return ds

    lax.fori_loop(0, n_chunks, body, jnp.zeros(hs_ref.shape[1:], F32))


def _specs(x, heads, groups):
    """BlockSpecs of a row's whole arrays for the grid (rows, heads)."""
    kv = heads // groups
    row = lambda shape: pl.BlockSpec((None,) + shape, lambda r, h: (r * heads + h,) + (0,) * len(shape))  # noqa: E731
    row_kv = lambda shape: pl.BlockSpec((None,) + shape, lambda r, h: (r * kv + h // groups,) + (0,) * len(shape))  # noqa: E731
    state = pl.BlockSpec((None, None) + x.h0.shape[2:], lambda r, h: (r, h, 0, 0, 0))
    meta = pl.BlockSpec((None,) + x.meta.shape[1:], lambda r, h: (r, 0, 0))
    return row, row_kv, state, meta


def forward(x, *, interpret):
    """(o [rows x H, Tp, Vp], hs [rows x H, NCp, Kp, Vp], ht like h0) of the kernel layout ``x``."""
    row, row_kv, state, meta = _specs(x, x.heads, x.groups)
    tp, kp, vp = x.q.shape[1], x.q.shape[2], x.v.shape[2]
    ncp = x.meta.shape[2]
    kernel = functools.partial(_fwd_kernel, c=x.chunk, n_chunks=x.n_chunks, n_seqs=x.h0.shape[2], dtype=x.dtype)
    return pl.pallas_call(
        kernel, grid=(x.rows, x.heads),
        in_specs=[meta, row((tp, kp)), row_kv((tp, kp)), row_kv((tp, vp)), row((tp, x.l.shape[2])), state],
        out_specs=[row((tp, vp)), row((ncp, kp, vp)), state],
        out_shape=[x.struct((x.rows * x.heads, tp, vp), x.q.dtype), x.struct((x.rows * x.heads, ncp, kp, vp), F32),
                   x.struct(x.h0.shape, F32)],
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1), interpret=interpret,
        name=f"{x.name}_pallas_fwd")(x.meta, x.q, x.k, x.v, x.l, x.h0)


def backward(x, hs, do, dht, *, interpret):
    """(dq, dk [rows x H, Tp, Kp], dv [rows x H, Tp, Vp] per query head, dh0 like h0, dlog [rows x H, Tp, Kp | 1]: the
    key side's log decay gradient (with gates; else left unwritten)), float32."""
    row, row_kv, state, meta = _specs(x, x.heads, x.groups)
    tp, kp, vp = x.q.shape[1], x.q.shape[2], x.v.shape[2]
    ncp = x.meta.shape[2]
    kernel = functools.partial(_bwd_kernel, c=x.chunk, n_chunks=x.n_chunks, n_seqs=x.h0.shape[2], dtype=x.dtype,
                               gated=x.gated)
    n = x.rows * x.heads
    width = x.l.shape[2]
    return pl.pallas_call(
        kernel, grid=(x.rows, x.heads),
        in_specs=[meta, row((tp, kp)), row_kv((tp, kp)), row_kv((tp, vp)), row((tp, width)), row((tp, vp)),
                  row((ncp, kp, vp)), state],
        out_specs=[row((tp, kp)), row((tp, kp)), row((tp, vp)), state, row((tp, width))],
        out_shape=[x.struct((n, tp, kp), F32), x.struct((n, tp, kp), F32), x.struct((n, tp, vp), F32),
                   x.struct(x.h0.shape, F32), x.struct((n, tp, width), F32)],
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1), interpret=interpret,
        name=f"{x.name}_pallas_bwd")(x.meta, x.q, x.k, x.v, x.l, do, hs, dht)


def _fused_kernel(*refs, steps, use_h0):
    q_ref, k_ref, v_ref, l_ref = refs[:4]
    o_ref, ht_ref = refs[-2:]
    start = refs[4][...] if use_h0 else jnp.zeros(ht_ref.shape, F32)

    def step(t, s):
        at = pl.ds(t, 1)
        s = s * jnp.exp(l_ref[:, at]) + k_ref[:, at] * v_ref[at, :].astype(F32)  # [K, 1 | 1] and [1, BV]
        o_ref[at, :] = jnp.sum(s * q_ref[:, at], axis=0, keepdims=True).astype(o_ref.dtype)
        return s

    ht_ref[...] = lax.fori_loop(0, steps, step, start)


def fused_forward(x, *, interpret, in_place=False):
    """(o [B x H, Tp, Vp] in v's dtype, ht [B x H, Kp, Vp] float32) of the fused layout ``x``
    (``kernels.FusedLayout``); ``in_place``: ht takes h0's buffer."""
    n, kp, tp = x.q.shape
    vp = x.v.shape[2]
    bv = min(FUSED_BV, vp)
    heads, groups = x.heads, x.groups
    kv = heads // groups

    def kv_row(i):  # the key / value head of row i = sequence x H + head
        return (i // heads) * kv + (i % heads) // groups

    state = pl.BlockSpec((None, kp, bv), lambda j, i: (i, 0, j))
    in_specs = [pl.BlockSpec((None, kp, tp), lambda j, i: (i, 0, 0)),
                pl.BlockSpec((None, kp, tp), lambda j, i: (kv_row(i), 0, 0)),
                pl.BlockSpec((None, tp, bv), lambda j, i: (kv_row(i), 0, j)),
                pl.BlockSpec((None, x.l.shape[1], tp), lambda j, i: (i, 0, 0))]
    ins = [x.q, x.k, x.v, x.l]
    if x.h0 is not None:
        in_specs.append(state)
        ins.append(x.h0)
    kernel = functools.partial(_fused_kernel, steps=x.steps, use_h0=x.h0 is not None)
    return pl.pallas_call(
        kernel, grid=(vp // bv, n), in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, tp, bv), lambda j, i: (i, 0, j)), state],
        out_shape=[x.struct((n, tp, vp), x.v.dtype), x.struct((n, kp, vp), F32)],
        input_output_aliases={4: 1} if in_place and x.h0 is not None else {},
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1), interpret=interpret,
        name=f"{x.name}_pallas_fused_fwd")(*ins)
