"""The mesh wrapper of every attention op: ``op(query, key, value, ..., mesh=, in_specs=, out_specs=)`` runs the
op under ``jax.shard_map`` over ``mesh`` (docs/DESIGN.md §4, Transformations).

The convention. ``in_specs`` are the PartitionSpecs of (query, key, value) in the op's own layout (``[B, S, H, D]``,
``[B, H, S, D]`` for a ``bhsd`` spec, ``[T, H, D]`` under varlen); one PartitionSpec stands for all three. Only
batch and heads may be cut, over the same mesh axes in all three (query head h reads key/value head h // G, so a
device holding a slice of query heads needs the matching slice of key/value heads). A sequence cut over one mesh
axis (the same for all three) runs the op's ring form (`ring.py`) over that axis, with contiguous shards; segment ids
are cut with it. A cut head_dim would split the q·k contraction. Every other tensor argument is cut as query:
its batch dim over query's batch axes and its head dim over query's head axes where it has the full extent
(bias, dense masks, segment ids, positions, block masks, sinks, params with ``batch`` / ``heads`` / ``kv_heads``
dims), and is replicated otherwise (broadcast dims of 1, cu_seqlens, options, scalars). The output is cut as
query and lse ``[B, Hq, Sq]`` over (batch, heads, sequence); ``out_specs`` may be left out, and when given must say
that.
Inside the map each device runs the op on its shards; a replicated param's gradient is the sum over devices.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ejgen.runtime.attention import ring as ring_form
from ejgen.runtime.core import sharding, vma
from ejgen.runtime.core.sharding import entry as _entry
from ejgen.runtime.core.sharding import normal as _normal
from ejgen.runtime.core.sharding import show as _show
from ejgen.runtime.core.sharding import tensor_specs
from ejgen.types import BlockMask, MaskInfo
from ejgen.types import block_mask as bm

# dims of query / key / value in each layout: (batch, sequence, heads, head_dim); varlen has no batch dim
_DIMS = {"bshd": (0, 1, 2, 3), "bhsd": (0, 2, 1, 3), "varlen": (None, 0, 1, 2)}
_LAYOUT_TEXT = {"bshd": "[batch, seq, heads, head_dim]", "bhsd": "[batch, heads, seq, head_dim]",
                "varlen": "[tokens, heads, head_dim] (varlen)"}


@dataclasses.dataclass(frozen=True)
class Cut:
    """How a call is cut over the mesh: the mesh axes of batch, heads and the sequence (tuples of names, () when not
    cut; a cut sequence runs the ring) and the call's global extents (batch, heads, kv_heads)."""

    batch: tuple
    heads: tuple
    sizes: dict
    sequence: tuple = ()

    def spec(self, *roles, shape) -> P:
        """The spec of an array whose dims play ``roles`` ("batch", "heads", "kv_heads" or None): a dim is cut
        where it has the full extent of its role, else (a broadcast dim) replicated."""
        entries = []
        for role, n in zip(roles, shape):
            axes = {"batch": self.batch, "heads": self.heads, "kv_heads": self.heads}.get(role, ())
            entries.append(_entry(axes) if axes and n == self.sizes[role] and n != 1 else None)
        return P(*entries)


def on_mesh(spec, op, query, key, value, kwargs: dict, mesh, in_specs, out_specs, ring=None, token_order=None):
    """``op(query, key, value, **kwargs)`` under ``jax.shard_map`` over ``mesh``, cut as ``in_specs`` say (the
    convention above); with the sequence cut, ``ring(query, key, value, axis_name=..., token_order=..., **kwargs)``
    instead (the op's ring form; ``token_order`` the order of the cut sequence, default contiguous). Each problem
    with the mesh or the specs is a ValueError that names it."""
    name = spec.name
    sharding.check_mesh(name, mesh, in_specs, "in_specs / out_specs / token_order",
                        "P('dp', None, 'tp', None) for [batch, seq, heads, head_dim] over mesh axes dp and tp")
    if not isinstance(kwargs.get("return_lse"), bool):
        raise ValueError(f"{name}(): return_lse must be a Python bool, got {kwargs.get('return_lse')!r}")
    varlen = kwargs.get("cu_seqlens_q") is not None or kwargs.get("cu_seqlens_k") is not None
    layout = "varlen" if varlen else spec.layout
    tensors = {"query": jnp.asarray(query), "key": jnp.asarray(key), "value": jnp.asarray(value)}
    rank = 3 if varlen else 4
    for t, x in tensors.items():
        if x.ndim != rank:
            raise ValueError(f"{name}(): {t} must be {_LAYOUT_TEXT[layout]}, got {x.dtype}{list(x.shape)}")
    specs = tensor_specs(name, mesh, in_specs, ("query", "key", "value"), rank,
                         "the other tensor arguments are cut as query")
    cut = _cut(spec, mesh, layout, tensors, specs, ring is not None, token_order or "contiguous")
    if token_order is not None and not cut.sequence:
        raise ValueError(f"{name}(): token_order={token_order!r} is the order of a sequence cut over a mesh axis (ring "
                         f"attention), but in_specs cut no sequence")
    arrays, static, array_specs = {}, {}, {}
    for arg, x in kwargs.items():
        if isinstance(x, (MaskInfo, BlockMask)) or (hasattr(x, "shape") and hasattr(x, "dtype")):
            arrays[arg], array_specs[arg] = _argument_spec(spec, cut, arg, x)
        else:
            static[arg] = x
    if cut.sequence:
        ring_form.refuse(f"{name}()", spec, kwargs)
    out, lse = _result_specs(layout, cut)
    want = (out, lse) if kwargs["return_lse"] else out
    if out_specs is not None:
        given = (out_specs, lse) if kwargs["return_lse"] and isinstance(out_specs, P) else out_specs
        if _normal(given) != _normal(want):
            raise ValueError(f"{name}(): out_specs={_show(out_specs)} is not how the results are cut: {_show(want)} "
                             f"(the output as query, over its batch and head axes; lse [batch, heads, q_len] alike); "
                             f"leave out_specs out to have it derived")

    def body(q, k, v, arrays):
        if cut.sequence:
            return ring(q, k, v, axis_name=cut.sequence[0], token_order=token_order or "contiguous", **static,
                        **arrays)
        return op(q, k, v, **static, **arrays)

    qkv_specs = tuple(P(*(_entry(axes) for axes in dims)) for dims in specs)
    run = vma.shard_map(body, mesh=mesh, in_specs=(*qkv_specs, array_specs), out_specs=want)
    return run(tensors["query"], tensors["key"], tensors["value"], arrays)


def _cut(spec, mesh, layout, tensors, specs, has_ring: bool, token_order: str = "contiguous") -> Cut:
    """Check the specs against the call (what may be cut, the same cut for q, k and v, divisibility) and say how
    it is cut."""
    name = spec.name
    b_dim, s_dim, h_dim, d_dim = _DIMS[layout]
    for t, dims in zip(tensors, specs):
        if dims[s_dim] and (layout == "varlen" or not has_ring):
            what, why = (("token axis", "varlen packs sequences along it (ring attention takes segment ids)")
                         if layout == "varlen" else ("sequence axis", "this op has no ring form"))
            raise ValueError(f"{name}(): in_specs cuts the {what} of {t} over mesh axis {_entry(dims[s_dim])!r}: a "
                             f"plain op needs whole sequences on every device, and {why}. Cut batch or heads.")
        if dims[d_dim]:
            raise ValueError(f"{name}(): in_specs cuts head_dim of {t} over mesh axis {_entry(dims[d_dim])!r}: the "
                             f"head dim is contracted whole (q·k, p·v). Cut batch or heads.")
    q, k, v = specs
    for what, dim in (("batch", b_dim), ("heads", h_dim), ("sequence", s_dim)):
        if dim is None:
            continue
        for t, dims in (("key", k), ("value", v)):
            if dims[dim] != q[dim]:
                why = ("query head h reads key/value head h // (Hq // Hkv)" if what != "sequence" else
                       "ring attention passes key/value blocks around the query's ring")
                raise ValueError(f"{name}(): in_specs cuts the {what} of query over {_entry(q[dim])!r} but of {t} over "
                                 f"{_entry(dims[dim])!r}: query, key and value must be cut over the same mesh axes "
                                 f"({why})")
    batch_axes = q[b_dim] if b_dim is not None else ()
    head_axes = q[h_dim]
    query, key = tensors["query"], tensors["key"]
    sizes = {"batch": query.shape[b_dim] if b_dim is not None else 1, "heads": query.shape[h_dim],
             "kv_heads": key.shape[h_dim]}
    devices = lambda axes: math.prod(mesh.shape[a] for a in axes)  # noqa: E731
    checks = (("batch", batch_axes, sizes["batch"], "the batch"), ("heads", head_axes, sizes["heads"], "query heads"),
              ("kv_heads", head_axes, sizes["kv_heads"], "key/value heads"))
    for role, axes, n, text in checks:
        if axes and n % devices(axes):
            extra = (" (GQA: each device needs the key/value heads of its query heads; cut heads over fewer "
                     "devices)" if role == "kv_heads" and sizes["kv_heads"] != sizes["heads"] else "")
            raise ValueError(f"{name}(): {text} ({n}) cannot be cut evenly over mesh axis {_entry(axes)!r} "
                             f"({devices(axes)} devices){extra}")
    for index, role, axes in (("b", "batch", batch_axes), ("h", "head", head_axes)):
        if axes and index in spec.index_reads:
            raise ValueError(f"{name}(): in_specs cuts the {role}s over mesh axis {_entry(axes)!r}, but the spec's "
                             f"score or mask reads the {role} index {index} as a number ({spec.path}): every device "
                             f"would count its own {role}s from 0. Cut the other axis only.")
    sequence = q[s_dim]
    if len(sequence) > 1:
        raise ValueError(f"{name}(): in_specs cuts the sequence over mesh axes {_entry(sequence)!r}: ring attention "
                         f"runs over one mesh axis")
    ring_form.check_order(f"{name}()", token_order)
    parts = (2 if token_order == "zigzag" else 1) * (devices(sequence) if sequence else 1)
    for t, x in tensors.items():
        if sequence and x.shape[s_dim] % parts:
            what = f"{parts} zigzag chunks" if token_order == "zigzag" else f"{parts} devices"
            raise ValueError(f"{name}(): the sequence of {t} ({x.shape[s_dim]}) cannot be cut evenly over mesh axis "
                             f"{_entry(sequence)!r} ({what})")
    return Cut(batch_axes, head_axes, sizes, sequence)


def _argument_spec(spec, cut: Cut, arg: str, x):
    """(the argument, maybe broadcast, and its spec) for a tensor argument besides query, key and value."""
    if isinstance(x, MaskInfo):
        ids = lambda a: None if a is None else _with_sequence(cut.spec("batch", None, shape=a.shape), cut)  # noqa: E731
        dense = None if x.attention_mask is None else cut.spec("batch", "heads", shape=x.attention_mask.shape)
        return x, MaskInfo(ids(x.q_segment_ids), ids(x.kv_segment_ids), dense)
    if isinstance(x, BlockMask):
        return x, _block_mask_spec(spec, cut, x)
    x = jnp.asarray(x)
    if arg in spec.params:
        return x, cut.spec(*(d if d in ("batch", "heads", "kv_heads") else None for d in spec.params[arg]),
                           shape=x.shape)
    if arg == "bias":
        return x, cut.spec("batch", "heads", None, None, shape=x.shape)
    if arg in ("q_positions", "kv_positions"):
        return x, cut.spec("batch", None, shape=x.shape)
    if arg == "softmax_aux":
        heads = cut.sizes["heads"]
        if cut.heads and x.ndim == 1 and x.shape[0] != heads:  # n sinks shared by all heads: one row per head, so
            x = jnp.broadcast_to(x[None], (heads, x.shape[0]))  # that a device's n never reads as per-head
        return x, cut.spec("heads", None, shape=x.shape)
    return x, P()  # cu_seqlens, options and scalars given as arrays: the same on every device


def _with_sequence(spec: P, cut: Cut) -> P:
    """Segment ids [batch, seq] cut along the sequence as query is (ring attention: each device its tokens' ids)."""
    return P(spec[0] if len(spec) else None, _entry(cut.sequence)) if cut.sequence else spec


def _block_mask_spec(spec, cut: Cut, mask: BlockMask) -> BlockMask:
    """A BlockMask of specs: the tile lists and every condition's arrays cut over their [B|1, H|1] dims."""
    lead = lambda a: cut.spec("batch", "heads", shape=a.shape)  # noqa: E731
    conditions = []
    for c in mask.conditions:
        if isinstance(c, bm.Segments):
            c = dataclasses.replace(c, q_ids=cut.spec("batch", None, shape=c.q_ids.shape),
                                    kv_ids=cut.spec("batch", None, shape=c.kv_ids.shape))
        elif isinstance(c, bm.Dense):
            c = dataclasses.replace(c, mask=lead(c.mask))
        elif isinstance(c, bm.Layout):
            c = dataclasses.replace(c, layout=lead(c.layout))
        elif isinstance(c, bm.Function) and ((c.batch > 1 and cut.batch) or (c.heads > 1 and cut.heads)):
            raise ValueError(f"{spec.name}(): block_mask has a mask_fn over {c.batch} batch rows x {c.heads} heads, "
                             f"and the call is cut over them: on each device mask_fn would see b and h counted from "
                             f"0. Call the op inside your own jax.shard_map and build the BlockMask there, or write "
                             f"the rule as a spec mask.")
        conditions.append(c)
    lists = {f.name: lead(getattr(mask, f.name)) for f in dataclasses.fields(mask)
             if f.name.endswith(("_count", "_indices"))}
    return dataclasses.replace(mask, **lists, conditions=tuple(conditions))


def _result_specs(layout, cut: Cut) -> tuple:
    b, h, s = _entry(cut.batch), _entry(cut.heads), _entry(cut.sequence)
    out = {"bshd": P(b, s, h, None), "bhsd": P(b, h, s, None), "varlen": P(None, h, None)}[layout]
    lse = P(h, None) if layout == "varlen" else P(b, h, s)
    return out, lse
