"""The Pallas recurrent kernels for TPUs (Mosaic): the grid is (rows of chunks, heads, chunks), the chunk axis in order
(``arbitrary``; reversed for the backward), so each step's blocks are one chunk of q, k, v and the gates, DMA'd while
the previous chunk computes, and the float32 state (or its adjoint) lives in a VMEM scratch across the steps; the
initial and final states of a row's sequences stay in VMEM for the whole row. ``meta`` (first, last, sequence per
chunk) is scalar-prefetched."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ejgen.runtime.recurrent.pallas import chunk

F32 = jnp.float32


def _flags(meta_ref, r, i, ncp):
    base = r * 4 * ncp
    return meta_ref[base + i], meta_ref[base + ncp + i], meta_ref[base + 2 * ncp + i]


def _fwd_kernel(meta_ref, q_ref, k_ref, v_ref, l_ref, h0_ref, o_ref, hs_ref, ht_ref, s_ref, *, ncp, dtype):
    r, i = pl.program_id(0), pl.program_id(2)
    first, last, seq = _flags(meta_ref, r, i, ncp)

    @pl.when(i == 0)
    def _row():
        s_ref[...] = jnp.zeros(s_ref.shape, F32)
        ht_ref[...] = h0_ref[...]  # a sequence without steps keeps its initial state

    @pl.when(first != 0)
    def _start():
        s_ref[...] = h0_ref[seq]

    s = s_ref[...]
    hs_ref[...] = s
    o, s = chunk.forward(q_ref[...].astype(F32), k_ref[...].astype(F32), v_ref[...].astype(F32), l_ref[...], s, dtype)
    o_ref[...] = o.astype(o_ref.dtype)
    s_ref[...] = s

    @pl.when(last != 0)
    def _final():
        ht_ref[seq] = s


def _bwd_kernel(meta_ref, q_ref, k_ref, v_ref, l_ref, do_ref, hs_ref, dht_ref, dq_ref, dk_ref, dv_ref, dh0_ref,
                dlog_ref, ds_ref, *, ncp, n_chunks, dtype, gated):
    r, back = pl.program_id(0), pl.program_id(2)
    first, last, seq = _flags(meta_ref, r, n_chunks - 1 - back, ncp)

    @pl.when(back == 0)
    def _row():
        ds_ref[...] = jnp.zeros(ds_ref.shape, F32)
        dh0_ref[...] = dht_ref[...]  # a sequence without steps: its final state is its initial one

    @pl.when(last != 0)
    def _end():
        ds_ref[...] = dht_ref[seq]

    dq, dk, dv, ds, dlog = chunk.backward(q_ref[...].astype(F32), k_ref[...].astype(F32), v_ref[...].astype(F32),
                                          l_ref[...], do_ref[...].astype(F32), hs_ref[...], ds_ref[...], dtype, gated)
    dq_ref[...] = dq
    dk_ref[...] = dk
    dv_ref[...] = dv
    if gated:
        dlog_ref[...] = dlog
    ds_ref[...] = ds

    @pl.when(first != 0)
    def _start():
        dh0_ref[seq] = ds


def _specs(x, reverse: bool):
    heads, kv, groups, c = x.heads, x.heads // x.groups, x.groups, x.chunk
    last = x.n_chunks - 1

    def at(i):
        return last - i if reverse else i

    def row(d):
        return pl.BlockSpec((None, c, d), lambda r, h, i, m: (r * heads + h, at(i), 0))

    def row_kv(d):
        # lax.div, not //: Mosaic lowers // through sign(), which asks which TPU it lowers for (none, from a CPU)
        return pl.BlockSpec((None, c, d), lambda r, h, i, m: (r * kv + lax.div(h, groups), at(i), 0))

    state = pl.BlockSpec((None, None) + x.h0.shape[2:], lambda r, h, i, m: (r, h, 0, 0, 0))
    hs = pl.BlockSpec((None, None) + x.h0.shape[3:], lambda r, h, i, m: (r * heads + h, at(i), 0, 0))
    return row, row_kv, state, hs


def _params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def forward(x, *, interpret):
    row, row_kv, state, hs = _specs(x, reverse=False)
    tp, kp, vp = x.q.shape[1], x.q.shape[2], x.v.shape[2]
    ncp = x.meta.shape[2]
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(x.rows, x.heads, x.n_chunks),
        in_specs=[row(kp), row_kv(kp), row_kv(vp), row(x.l.shape[2]), state],
        out_specs=[row(vp), hs, state], scratch_shapes=[pltpu.VMEM((kp, vp), F32)])
    n = x.rows * x.heads
    return pl.pallas_call(
        functools.partial(_fwd_kernel, ncp=ncp, dtype=x.dtype), grid_spec=grid,
        out_shape=[x.struct((n, tp, vp), x.q.dtype), x.struct((n, ncp, kp, vp), F32), x.struct(x.h0.shape, F32)],
        compiler_params=_params(), interpret=interpret, name=f"{x.name}_pallas_fwd",
    )(x.meta.reshape(-1), x.q, x.k, x.v, x.l, x.h0)


def backward(x, hs, do, dht, *, interpret):
    row, row_kv, state, hs_spec = _specs(x, reverse=True)
    tp, kp, vp = x.q.shape[1], x.q.shape[2], x.v.shape[2]
    ncp = x.meta.shape[2]
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(x.rows, x.heads, x.n_chunks),
        in_specs=[row(kp), row_kv(kp), row_kv(vp), row(x.l.shape[2]), row(vp), hs_spec, state],
        out_specs=[row(kp), row(kp), row(vp), state, row(x.l.shape[2])], scratch_shapes=[pltpu.VMEM((kp, vp), F32)])
    n = x.rows * x.heads
    return pl.pallas_call(
        functools.partial(_bwd_kernel, ncp=ncp, n_chunks=x.n_chunks, dtype=x.dtype, gated=x.gated), grid_spec=grid,
        out_shape=[x.struct((n, tp, kp), F32), x.struct((n, tp, kp), F32), x.struct((n, tp, vp), F32),
                   x.struct(x.h0.shape, F32), x.struct((n, tp, x.l.shape[2]), F32)],
        compiler_params=_params(), interpret=interpret, name=f"{x.name}_pallas_bwd",
    )(x.meta.reshape(-1), x.q, x.k, x.v, x.l, do, hs, dht)
