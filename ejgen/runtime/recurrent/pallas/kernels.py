"""The Pallas backend of the linear recurrent family, shared by every spec: the kernel layout, the dispatch to the GPU
kernels (Triton lowering) when lowering for CUDA or ROCm and to the TPU kernels (Mosaic) for TPUs, interpreted on any
other platform (``ejgen.runtime.core.pallas.interpret_kernels`` picks which), and the sums after them.

Layout (in XLA, before the kernels): the spec's hooks applied (q mapped and scaled, k mapped, the gates mapped and
the key side's log gate l = gk + g + g_gamma, or g + g_gamma as one column), the steps in the chunk layout of
``packing`` (chunks of CHUNK steps; packed sequences chunk-aligned, reverse as forward in time, so the kernels mask
nothing), heads first ([rows x H, Tp, D]), the steps and head dims padded to powers of two (Triton's tiles). The
kernels write the gradients of the mapped q and k per query head and the key side's log decay gradient per step;
``gates.finish`` does the rest, as for Triton. The chunk's arithmetic is ``chunk``: chunks of CHUNK = 16 steps for
either algorithm on TPUs, gates g, g_gamma, gk (no gv). On GPUs the fused algorithm's forward over dense calls
(decoding among them) has a kernel of its own (``gpu.fused_forward``, layout ``FusedLayout``: no chunks, each step a
column of q, k and the log gate), which updates the state in place when the call does not keep it for a gradient;
its backward is the chunked one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ejgen.runtime.core import pallas as _platforms
from ejgen.runtime.core import sizes, vma
from ejgen.runtime.recurrent import gates as gradients
from ejgen.runtime.recurrent import packing
from ejgen.runtime.recurrent.gates import log_gates
from ejgen.runtime.recurrent.pallas import gpu, tpu

F32 = jnp.float32
CHUNK = 16
GATES = ("g", "g_gamma", "gk")

available = _platforms.available


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q", "k", "v", "l", "h0", "meta"],
                   meta_fields=["name", "rows", "heads", "groups", "chunk", "n_chunks", "dtype", "gated"])
@dataclasses.dataclass(frozen=True)
class Layout:
    """A call in the kernels' layout (module docstring); a pytree of its arrays, so that ``dispatch`` hands them to
    interpreted kernels typed invariant inside ``jax.shard_map`` (``core.pallas``)."""

    name: str
    q: jax.Array  # [rows x H, Tp, Kp], mapped and scaled, q's dtype
    k: jax.Array  # [rows x Hkv, Tp, Kp]
    v: jax.Array  # [rows x Hkv, Tp, Vp]
    l: jax.Array  # [rows x H, Tp, Kp | 1] float32: the key side's log gate
    h0: jax.Array  # [rows, H, Np, Kp, Vp] float32: the initial states of each row's sequences
    meta: jax.Array  # [rows, 4, NCp] int32: per chunk, whether it starts / ends its sequence, and the sequence
    rows: int
    heads: int
    groups: int
    chunk: int
    n_chunks: int
    dtype: object
    gated: bool  # a gate is passed: the backward writes the key side's log decay gradient

    def struct(self, shape, dtype):
        """A kernel output's type, varying over the mesh axes its inputs vary over."""
        return vma.struct(shape, dtype, vma.varying_axes(self.q, self.k, self.v, self.l, self.h0, self.meta))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q", "k", "v", "l", "h0"],
                   meta_fields=["name", "heads", "groups", "steps"])
@dataclasses.dataclass(frozen=True)
class FusedLayout:
    """A dense call in the fused kernel's layout (``gpu.fused_forward``): heads first, the steps padded to a power of
    two (the kernel runs the first ``steps``), reverse as forward in time; a pytree, as ``Layout``."""

    name: str
    q: jax.Array  # [B x H, Kp, Tp] float32, mapped and scaled: a column per step
    k: jax.Array  # [B x Hkv, Kp, Tp] float32, mapped
    v: jax.Array  # [B x Hkv, Tp, Vp] in q's dtype: a row per step
    l: jax.Array  # [B x H, Kp | 1, Tp] float32: the key side's log gate
    h0: jax.Array | None  # [B x H, Kp, Vp] float32
    heads: int
    groups: int
    steps: int

    def struct(self, shape, dtype):
        return vma.struct(shape, dtype, vma.varying_axes(self.q, self.k, self.v, self.l, self.h0))


def _pad(x, widths):
    """``jnp.pad`` with zeros, and nothing at all where nothing is padded."""
    return jnp.pad(x, widths) if any(hi for _, hi in widths) else x


class PallasRecurrent:
    def __init__(self, name: str, hooks):
        self.name = name
        self.hooks = hooks

    def layout(self, q, k, v, gates, h0, ctx, cfg):
        """(Layout, to_rows: [B, T, H, D] -> [rows x H, Tp, D], from_rows: the inverse, to_states, from_states)."""
        dtype = q.dtype
        qm, km, log = self._maps(q, k, gates, cfg)
        chunk = CHUNK
        layout = packing.packed(ctx["cu"], cfg, chunk) if cfg.varlen else None
        nc = packing.n_chunks(cfg, chunk)
        ncp = sizes.pow2(nc)
        rows = 1 if cfg.varlen else cfg.batch
        tp = ncp * chunk
        kp, vp = sizes.pow2(cfg.dk, 16), sizes.pow2(cfg.dv, 16)

        def to_rows(x, width):
            x = packing.to_layout(x, cfg, chunk, layout)  # [rows, NC x C, heads, D]
            x = jnp.pad(x, [(0, 0), (0, tp - x.shape[1]), (0, 0), (0, width - x.shape[3])])
            return jnp.swapaxes(x, 1, 2).reshape((rows * x.shape[2], tp, width))

        def from_rows(y, width):
            y = y.reshape((rows, cfg.heads, tp, y.shape[-1]))[:, :, :nc * chunk, :width]
            return packing.from_layout(jnp.swapaxes(y, 1, 2), cfg, layout)

        n_row = 1 if not cfg.varlen else cfg.n_seqs
        np_row = sizes.pow2(n_row)

        def to_states(s):  # [N, H, K, V] -> [rows, H, Np, Kp, Vp]
            s = s.reshape((rows, n_row) + s.shape[1:]).transpose(0, 2, 1, 3, 4)
            return jnp.pad(s, [(0, 0), (0, 0), (0, np_row - n_row), (0, kp - cfg.dk), (0, vp - cfg.dv)])

        def from_states(s):
            return s[:, :, :n_row, :cfg.dk, :cfg.dv].transpose(0, 2, 1, 3, 4).reshape(
                (cfg.n_seqs, cfg.heads, cfg.dk, cfg.dv))

        c = jnp.arange(ncp, dtype=jnp.int32)
        if layout is None:
            meta = jnp.stack([(c == 0), (c == nc - 1), jnp.zeros_like(c, bool), jnp.zeros_like(c, bool)])
            meta = jnp.broadcast_to(meta.astype(jnp.int32)[None], (rows, 4, ncp))
        else:
            pad = [(0, ncp - nc)]
            meta = jnp.stack([jnp.pad(layout.chunk_first.astype(jnp.int32), pad),
                              jnp.pad(layout.chunk_last.astype(jnp.int32), pad),
                              jnp.pad(layout.chunk_seq, pad), jnp.zeros((ncp,), jnp.int32)])[None]
        start = jnp.zeros((cfg.n_seqs, cfg.heads, cfg.dk, cfg.dv), F32) if h0 is None else h0
        x = Layout(
            name=self.name,
            q=to_rows((qm * cfg.scale).astype(dtype), kp),
            k=to_rows(km.astype(dtype), kp),
            v=to_rows(v, vp),
            l=to_rows(log.astype(F32), kp if cfg.has("gk") else 1),
            h0=to_states(start), meta=meta, rows=rows, heads=cfg.heads, groups=cfg.groups, chunk=chunk,
            n_chunks=nc, dtype=F32 if dtype == F32 else dtype, gated=any(cfg.has(g) for g in GATES))
        return x, to_rows, from_rows, to_states, from_states

    def _maps(self, q, k, gates, cfg):
        """(q, k mapped, float32; the key side's log gate [B, T, H, K | 1] float32)."""
        hooks = self.hooks
        qm, km = q.astype(F32), k.astype(F32)
        if hooks.feature_map is not None:
            qm, km = hooks.feature_map(qm), hooks.feature_map(km)
        scalar, gk, _ = log_gates(gates, hooks, (cfg.batch, cfg.seq_len, cfg.heads))  # no gv (`choose` refuses it)
        if gk is not None:
            log = gk if scalar is None else gk + scalar[..., None]
        else:
            log = jnp.zeros(q.shape[:3] + (1,), F32) if scalar is None else scalar[..., None]
        return qm, km, log

    def fused_layout(self, q, k, v, gates, h0, cfg):
        """(FusedLayout, from_o: [B x H, Tp, Vp] -> o [B, T, H, V], from_state: [B x H, Kp, Vp] -> [B, H, K, V]) of
        a dense call. For one step every move here is a reshape (no copy); so is the state's for K and V powers of
        two."""
        qm, km, log = self._maps(q, k, gates, cfg)
        t = cfg.seq_len
        tp, kp, vp = sizes.pow2(t), sizes.pow2(cfg.dk, 16), sizes.pow2(cfg.dv, 16)

        def steps(x, width, columns):  # [B, T, h, D] -> [B x h, width, Tp] (columns) or [B x h, Tp, width]
            if cfg.reverse:
                x = jnp.flip(x, axis=1)
            x = _pad(x, [(0, 0), (0, tp - t), (0, 0), (0, width - x.shape[3])])
            x = jnp.transpose(x, (0, 2, 3, 1) if columns else (0, 2, 1, 3))
            return x.reshape((-1,) + x.shape[2:])

        def from_o(o):
            o = o.reshape((cfg.batch, cfg.heads, tp, vp))[:, :, :t, :cfg.dv]
            o = jnp.transpose(o, (0, 2, 1, 3))
            return jnp.flip(o, axis=1) if cfg.reverse else o

        def from_state(s):
            return s.reshape((cfg.batch, cfg.heads, kp, vp))[:, :, :cfg.dk, :cfg.dv]

        start = None
        if h0 is not None:
            start = _pad(h0, [(0, 0), (0, 0), (0, kp - cfg.dk), (0, vp - cfg.dv)]).reshape((-1, kp, vp))
        x = FusedLayout(name=self.name, q=steps(qm * cfg.scale, kp, True), k=steps(km, kp, True),
                        v=steps(v, vp, False), l=steps(log, kp if cfg.has("gk") else 1, True),
                        h0=start, heads=cfg.heads, groups=cfg.groups, steps=t)
        return x, from_o, from_state

    def forward(self, q, k, v, gates, h0, ctx, cfg, save):
        if cfg.algorithm == "fused" and not cfg.varlen:
            return self._fused_forward(q, k, v, gates, h0, ctx, cfg, in_place=not save)
        x, _, from_rows, _, from_states = self.layout(q, k, v, gates, h0, ctx, cfg)
        o, _, ht = _platforms.dispatch(gpu.forward, tpu.forward, x)
        return from_rows(o, cfg.dv), from_states(ht), {}

    def _fused_forward(self, q, k, v, gates, h0, ctx, cfg, in_place):
        """The fused algorithm on a dense call: the fused kernel on GPUs (the state in place unless a gradient keeps
        h0: ``in_place``), the chunked kernels on TPUs."""

        def on_gpu(q, k, v, gates, h0, *, interpret):
            x, from_o, from_state = self.fused_layout(q, k, v, gates, h0, cfg)
            o, ht = gpu.fused_forward(x, interpret=interpret, in_place=in_place)
            return from_o(o), from_state(ht)

        def on_tpu(q, k, v, gates, h0, *, interpret):
            x, _, from_rows, _, from_states = self.layout(q, k, v, gates, h0, ctx, cfg)
            o, _, ht = tpu.forward(x, interpret=interpret)
            return from_rows(o, cfg.dv), from_states(ht)

        o, ht = _platforms.dispatch(on_gpu, on_tpu, q, k, v, gates, h0)
        return o, ht, {}

    def backward(self, q, k, v, gates, h0, ctx, res, do, dht, cfg):
        x, to_rows, from_rows, to_states, from_states = self.layout(q, k, v, gates, h0, ctx, cfg)
        _, hs, _ = _platforms.dispatch(gpu.forward, tpu.forward, x)
        do_rows = to_rows(do.astype(q.dtype), x.v.shape[2])
        dq, dk, dv, dh0, dlog = _platforms.dispatch(gpu.backward, tpu.backward, x, hs, do_rows, to_states(dht))
        dphi_q = from_rows(dq, cfg.dk) * cfg.scale
        dphi_k, dv_h = from_rows(dk, cfg.dk), from_rows(dv, cfg.dv)
        d_key = from_rows(dlog, cfg.dk if cfg.has("gk") else 1) if x.gated else None
        return gradients.finish(self.hooks, q, k, v, gates, h0, cfg, dphi_q, dphi_k, dv_h, from_states(dh0), d_key)


def choose(cfg):
    """The one kernel set; gv is not taken (the triton and xla platforms take it)."""
    from ejgen.runtime.core.kernels import Unsupported

    if cfg.has("gv"):
        raise Unsupported("gv is not taken by the Pallas kernels (platform triton or xla takes it)")
    why = "Pallas kernels: chunks of 16 steps on GPUs (Triton lowering) and TPUs (Mosaic), interpreted elsewhere"
    if cfg.algorithm == "fused":
        why += ("; the fused recurrence: its own forward kernel on GPUs for dense calls (a program per block of V "
                "and head, one step at a time), else (backward, TPUs, packed sequences) as chunks of 16 steps")
    return "pallas_chunked", "pallas_chunked", (f"forward and backward: pallas_chunked ({why})",), True
