"""The mesh wrapper of every recurrent op: ``op(query, key, value, ..., mesh=, in_specs=, out_specs=)`` runs the op
under ``jax.shard_map`` over ``mesh`` (docs/DESIGN.md §4, Transformations; §3 context parallelism).

The convention. ``in_specs`` are the PartitionSpecs of (query, key, value), ``[B, T, H, K | V]``; one PartitionSpec
stands for all three. Batch, heads and the sequence may be cut, over the same mesh axes in all three (query head h
reads key/value head h // G, so a device holding a slice of query heads needs the matching key/value heads); a cut
head dim is refused (q·S contracts K, and the value side's gate and state columns go with V: not worth a special
case). A sequence cut over one mesh axis runs the op's context-parallel form (`context_parallel.py`) over that axis.
The gates are cut as query: g [B, T, H] over (batch, sequence, heads), gk and gv [B, T, H, K | V] likewise,
g_gamma [H] over the heads; initial_state [N, H, K, V] over batch (N = B) and heads; cu_seqlens is replicated. The
output o is cut as query, final_state [N, H, K, V] over batch and heads (replicated over the sequence's axis);
``out_specs`` may be left out, and when given must say that.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ejgen.runtime.core import sharding, vma
from ejgen.runtime.recurrent import context_parallel

_TENSORS = ("query", "key", "value")
# the role of each dim of the op's tensor arguments; "heads" is query's heads, "kv" key / value's
_ROLES = {"query": ("batch", "sequence", "heads", None), "key": ("batch", "sequence", "kv", None),
          "value": ("batch", "sequence", "kv", None), "g": ("batch", "sequence", "heads"),
          "gk": ("batch", "sequence", "heads", None), "gv": ("batch", "sequence", "heads", None),
          "g_gamma": ("heads",), "initial_state": ("states", "heads", None, None)}


@dataclasses.dataclass(frozen=True)
class Cut:
    """The mesh axes of batch, heads and the sequence (tuples of names, () where not cut); states: initial and final
    states' first dim (the batch's axes, none with packed sequences)."""

    batch: tuple
    heads: tuple
    sequence: tuple
    states: tuple

    def spec(self, arg: str) -> P:
        axes = {"batch": self.batch, "sequence": self.sequence, "heads": self.heads, "kv": self.heads,
                "states": self.states, None: ()}
        return P(*(sharding.entry(axes[role]) for role in _ROLES[arg]))


def on_mesh(spec, op, cp, backends: dict, query, key, value, kwargs: dict, mesh, in_specs, out_specs):
    """``op(query, key, value, **kwargs)`` under ``jax.shard_map`` over ``mesh``, cut as ``in_specs`` say (the
    convention above); with the sequence cut, ``cp(query, key, value, axis_name=..., **kwargs)`` (the op's
    context-parallel form). ``backends``: the op's backends by name, for the whole call's checks. Each problem with
    the mesh or the specs is a ValueError that names it, before anything runs."""
    name = spec.name
    sharding.check_mesh(name, mesh, in_specs, "in_specs / out_specs",
                        "P('dp', 'sp', 'tp') for [batch, seq, heads, head_dim] over mesh axes dp, sp and tp")
    tensors = {"query": jnp.asarray(query), "key": jnp.asarray(key), "value": jnp.asarray(value)}
    for t, x in tensors.items():
        if x.ndim != 4:
            raise ValueError(f"{name}(): {t} must be [batch, seq_len, heads, head_dim], got {x.dtype}{list(x.shape)}")
    specs = sharding.tensor_specs(name, mesh, in_specs, _TENSORS, 4,
                                  "the gates, initial_state and cu_seqlens are cut as query")
    varlen = kwargs.get("cu_seqlens") is not None
    cut = _cut(name, mesh, tensors, specs, varlen)
    positional = {n: x for n, x in kwargs.items() if n not in ("algorithm", "chunk_size", "platform")}
    choices = {n: x for n, x in kwargs.items() if n not in positional}
    context_parallel.check_call(spec, backends, query, key, value, positional, choices, name)
    arrays = context_parallel.tensor_arguments(kwargs)
    static = {n: x for n, x in kwargs.items() if n not in arrays}
    array_specs = {n: cut.spec(n) if n in _ROLES else P() for n in arrays}
    want = (cut.spec("query"), cut.spec("initial_state"))
    if out_specs is not None and sharding.normal(out_specs) != sharding.normal(want):
        raise ValueError(f"{name}(): out_specs={sharding.show(out_specs)} is not how the results are cut: "
                         f"{sharding.show(want)} (o as query; final_state [N, H, K, V] over batch and heads, the same "
                         f"on every device of the sequence's axis); leave out_specs out to have it derived")

    def body(q, k, v, arrays):
        if cut.sequence:
            return cp(q, k, v, axis_name=cut.sequence[0], **static, **arrays)
        return op(q, k, v, **static, **arrays)

    qkv = tuple(cut.spec(t) for t in _TENSORS)
    run = vma.shard_map(body, mesh=mesh, in_specs=(*qkv, array_specs), out_specs=want)
    return run(tensors["query"], tensors["key"], tensors["value"], arrays)


def _cut(name, mesh, tensors, specs, varlen: bool) -> Cut:
    """Check the specs against the call (what may be cut, the same cut for q, k and v, divisibility) and say how
    it is cut."""
    for t, dims in zip(_TENSORS, specs):
        if dims[3]:
            raise ValueError(f"{name}(): in_specs cuts head_dim of {t} over mesh axis {sharding.entry(dims[3])!r}: the "
                             f"head dims are kept whole on every device (q·S contracts K; the state's columns go with "
                             f"V). Cut batch, heads or the sequence.")
    q = specs[0]
    for what, dim in (("batch", 0), ("sequence", 1), ("heads", 2)):
        for t, dims in zip(_TENSORS[1:], specs[1:]):
            if dims[dim] != q[dim]:
                why = ("the steps of a sequence go together" if what == "sequence" else
                       "query head h reads key/value head h // (H / Hkv)")
                raise ValueError(f"{name}(): in_specs cuts the {what} of query over {sharding.entry(q[dim])!r} but "
                                 f"of {t} over {sharding.entry(dims[dim])!r}: query, key and value must be cut over "
                                 f"the same mesh axes ({why})")
    batch, sequence, heads = q[0], q[1], q[2]
    if len(sequence) > 1:
        raise ValueError(f"{name}(): in_specs cuts the sequence over mesh axes {sharding.entry(sequence)!r}: context "
                         f"parallelism runs over one mesh axis")
    if sequence and varlen:
        raise ValueError(f"{name}(): in_specs cuts the sequence of query over mesh axis {sequence[0]!r}, and "
                         f"cu_seqlens packs sequences along it: packed sequences would cross the shards' bounds. Cut "
                         f"heads, or the batch of dense sequences.")
    query, key = tensors["query"], tensors["key"]
    devices = lambda axes: math.prod(mesh.shape[a] for a in axes)  # noqa: E731
    checks = (("batch", batch, query.shape[0]), ("the steps of query", sequence, query.shape[1]),
              ("query heads", heads, query.shape[2]), ("key/value heads", heads, key.shape[2]))
    for text, axes, n in checks:
        if axes and n % devices(axes):
            extra = ""
            if text == "key/value heads":
                extra = " (GQA: each device needs the key/value heads of its query heads; cut heads over fewer devices)"
            elif text == "batch" and varlen:
                extra = " (with cu_seqlens the batch is 1: packed sequences)"
            raise ValueError(f"{name}(): {text} ({n}) cannot be cut evenly over mesh axis {sharding.entry(axes)!r} "
                             f"({devices(axes)} devices){extra}")
    return Cut(batch, heads, sequence, () if varlen else batch)
