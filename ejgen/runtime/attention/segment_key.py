"""A spec's segment key at run time (docs/DESIGN.md §5, Segment keys): the conjunct ``F == G`` of its mask that the
planner took out of the element mask (`ejgen.ir.passes.segment_key`) becomes segment ids, computed once per call
before the kernels, O(S).

Ids. The kernels see query ``i`` and key ``j`` together where ``q_seg[i] == kv_seg[j] >= 0`` (negative ids are
padding: §3 step 4). ``F`` and ``G`` are int32 of either sign, so their values are encoded (`encode`), per batch
row, so that ``q_ids[i] == kv_ids[j] >= 0`` exactly where ``F(i) == G(j)``:
- offset (the spec's key has a side that reads no param, its *base*): ids are the values less the base side's least
  value in the row; the other side's values outside the base side's [least, greatest] match nothing there and
  become -1, which sees nothing, as they would. Order is kept, so ids that grow along a side (chunks, images) keep
  the per-tile ranges tight. Where the base side's values of some row span 2^31 or more (``(kv_idx - c) * 2**20``
  at a few thousand tokens: no overflow in the spec, but their differences do not fit int32), the call takes ranks;
- ranks (both sides read params, whose values may be anything; or the call passes segment ids of its own): the
  dense rank of each value (of each pair (call's id, value)) among the row's queries and keys, by one sort of
  Sq + Sk entries: exact for any int32, ids below Sq + Sk. The call's padding (negative ids) stays -1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from ejgen.runtime.attention import api


@dataclasses.dataclass(frozen=True)
class SegmentKey:
    """What a generated op knows of its spec's segment key: ``values(ctx, b, q_idx, kv_idx, q_len, kv_len)`` gives
    ``F`` per query and ``G`` per key (``b`` [B, 1], positions [1, S]; ``ctx`` holds the params and options they
    read as ``param_<name>`` / ``opt_<name>``); ``base``: "query", "key" or None (ranks); ``text``: the conjunct."""

    values: Callable
    base: str | None
    text: str


def encode(q_vals, kv_vals, base: str | None, q_user=None, kv_user=None, wraps: bool | None = None):
    """(q_ids [B, Sq], kv_ids [B, Sk]) int32 from the key's values per token (module docstring), paired with the
    call's own segment ids where given (``q_user``, ``kv_user``). ``wraps``: whether some row's base values span
    2^31 or more, where known while tracing (`static_wraps`); None decides on the device (`lax.cond`, whose
    predicate a GPU reads back to the host: the call waits there for the kernels before it)."""
    q_vals, kv_vals = jnp.asarray(q_vals, jnp.int32), jnp.asarray(kv_vals, jnp.int32)
    if q_user is not None:
        return _ranks(q_vals, kv_vals, q_user, kv_user)
    ranks = lambda: _ranks(q_vals, kv_vals, jnp.zeros_like(q_vals), jnp.zeros_like(kv_vals))  # noqa: E731
    if base is None:
        return ranks()
    if wraps is not None:
        return ranks() if wraps else _offset(q_vals, kv_vals, base)
    return lax.cond(_wraps(q_vals if base == "query" else kv_vals), ranks, lambda: _offset(q_vals, kv_vals, base))


def _wraps(base_vals):
    return jnp.any(jnp.max(base_vals, axis=1) - jnp.min(base_vals, axis=1) < 0)  # a row's span past int32


def _manual() -> bool:
    """Inside ``shard_map`` (manual mesh axes), where eager work while tracing is not to be had (an H200 run of the
    ring: an eager op under a manual mesh fails JAX's sharding check): the device decides there."""
    mesh = getattr(jax.sharding, "get_abstract_mesh", lambda: None)()
    return bool(getattr(mesh, "manual_axes", ()))


def static_wraps(key: SegmentKey, ctx: dict, batch: int, q_len: int, kv_len: int) -> bool | None:
    """`encode`'s ``wraps`` for a call whose rows hold positions 0..len-1 (in any order: a ring's rows gathered), decided
    while tracing: the base side reads no param, so its values come from positions and options alone, evaluated here
    when the options are not traced. None where they are, inside ``shard_map``, or where the key has no base side."""
    if key.base is None or _manual():
        return None
    with jax.ensure_compile_time_eval():
        q_vals, kv_vals = _values(key, ctx, batch, jnp.arange(q_len, dtype=jnp.int32),
                                  jnp.arange(kv_len, dtype=jnp.int32), q_len, kv_len)
        base_vals = q_vals if key.base == "query" else kv_vals
        if isinstance(base_vals, jax.core.Tracer):
            return None
        return bool(_wraps(base_vals))


def _offset(q_vals, kv_vals, base: str):
    """(q_ids, kv_ids): the values less the base side's least one per row; the other side's values outside the base
    side's range match nothing: -1 (every row's span fits int32: `encode`)."""
    base_vals, other = (q_vals, kv_vals) if base == "query" else (kv_vals, q_vals)
    lo = jnp.min(base_vals, axis=1, keepdims=True)
    hi = jnp.max(base_vals, axis=1, keepdims=True)
    other_ids = jnp.where((other >= lo) & (other <= hi), other - lo, -1)
    return (base_vals - lo, other_ids) if base == "query" else (other_ids, base_vals - lo)


def _ranks(q_vals, kv_vals, q_user, kv_user):
    """Dense ranks of the pairs (user id, value) over each row's queries and keys; user padding stays -1."""
    sq = q_vals.shape[1]
    user = jnp.concatenate([q_user, kv_user], axis=1).astype(jnp.int32)
    vals = jnp.concatenate([q_vals, kv_vals], axis=1)
    batch, n = vals.shape
    where = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n))
    s_user, s_vals, s_where = lax.sort((user, vals, where), dimension=1, num_keys=2)
    new = (s_user[:, 1:] != s_user[:, :-1]) | (s_vals[:, 1:] != s_vals[:, :-1])
    rank = jnp.cumsum(jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), new.astype(jnp.int32)], axis=1), axis=1)
    ids = jnp.zeros((batch, n), jnp.int32).at[jnp.arange(batch)[:, None], s_where].set(rank)
    ids = jnp.where(user < 0, -1, ids)
    return ids[:, :sq], ids[:, sq:]


def _values(key: SegmentKey, ctx: dict, batch: int, q_pos, kv_pos, q_len: int, kv_len: int):
    """(F [B, Sq], G [B, Sk]) int32 at positions q_pos [Sq], kv_pos [Sk]."""
    b = jnp.arange(batch, dtype=jnp.int32)[:, None]
    q_vals, kv_vals = key.values(ctx, b, q_pos[None], kv_pos[None], jnp.int32(q_len), jnp.int32(kv_len))
    shape = lambda x, n: jnp.broadcast_to(jnp.asarray(x).astype(jnp.int32), (batch, n))  # noqa: E731 (bools: 0 / 1)
    return shape(q_vals, q_pos.shape[0]), shape(kv_vals, kv_pos.shape[0])


def lower(spec: api.SpecInfo, call: api.Prepared, ctx: dict) -> api.Prepared:
    """``call`` with the spec's segment key as segment ids (joined with the call's own: ranks of pairs); ``ctx``
    holds the params and options, checked by the op, as ``param_<name>`` / ``opt_<name>``."""
    key = spec.segment_key
    sq, sk = call.cfg.seq_q, call.cfg.seq_k
    q_vals, kv_vals = _values(key, ctx, call.q.shape[0], jnp.arange(sq, dtype=jnp.int32),
                              jnp.arange(sk, dtype=jnp.int32), sq, sk)
    user = (call.ctx["q_seg"], call.ctx["kv_seg"]) if call.cfg.segments else (None, None)
    wraps = None if user[0] is not None else static_wraps(key, ctx, call.q.shape[0], sq, sk)
    q_ids, kv_ids = encode(q_vals, kv_vals, key.base, *user, wraps=wraps)
    return dataclasses.replace(call, cfg=dataclasses.replace(call.cfg, segments=True),
                               ctx={**call.ctx, "q_seg": q_ids, "kv_seg": kv_ids},
                               segment_key=key.text + (" (paired with the call's segment ids)" if user[0] is not None
                                                       else ""))


def lower_on_ring(spec: api.SpecInfo, call: api.Prepared, ctx: dict, axis_name, devices: int,
                  positions: Callable) -> api.Prepared:
    """``call`` (this device's rows of a ring, ``ctx`` holding the checked params and options) with the key as
    segment ids at the rows' global positions (``positions(device)``: int32 [n]). The encoding looks at whole rows:
    the key's values and the call's ids are gathered over the axis (in device order: the encoding does not depend on
    the order of a row's tokens), encoded, and each device keeps its own rows."""
    key = spec.segment_key
    n = call.cfg.seq_q
    device = lax.axis_index(axis_name)
    pos = positions(device)
    q_vals, kv_vals = _values(key, ctx, call.q.shape[0], pos, pos, n * devices, n * devices)
    gather = lambda x: lax.all_gather(x, axis_name, axis=1, tiled=True)  # noqa: E731 [B, n * devices], device order
    user = (gather(call.ctx["q_seg"]), gather(call.ctx["kv_seg"])) if call.cfg.segments else (None, None)
    wraps = None if user[0] is not None else static_wraps(key, ctx, call.q.shape[0], n * devices, n * devices)
    q_ids, kv_ids = encode(gather(q_vals), gather(kv_vals), key.base, *user, wraps=wraps)
    mine = lambda x: lax.dynamic_slice_in_dim(x, device * n, n, axis=1)  # noqa: E731
    return dataclasses.replace(call, cfg=dataclasses.replace(call.cfg, segments=True),
                               ctx={**call.ctx, "q_seg": mine(q_ids), "kv_seg": mine(kv_ids)}, segment_key=key.text)

