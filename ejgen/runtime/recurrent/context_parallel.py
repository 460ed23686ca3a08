"""Context parallelism for the linear recurrent family (docs/DESIGN.md §3, "Context parallelism (linear
recurrent)"): every recurrent op's `<name>_cp` form, and the mesh wrapper's when it cuts the sequence.

Inside ``jax.shard_map`` each of the N devices of ``axis_name`` holds n consecutive steps of every sequence (device d
the steps [d n, (d + 1) n)). A shard's recurrence is affine in the state h it starts from: with Dk_t and Dv_t the log
decays summed over the shard's steps up to t (key side g + g_gamma + gk, [K] or one number per head; value side gv,
[V]; reverse: from the shard's end),
    S_t = S_t^loc + diag(e^{Dk_t}) h diag(e^{Dv_t}),    o_t = o_t^loc + ((scale phi(q_t)) ⊙ e^{Dk_t}) h ⊙ e^{Dv_t},
where S^loc and o^loc are the shard's own recurrence from a zero state. So each device
1. runs the op on its shard from zero (its kernels and its custom_vjp): o^loc and the end state E (the first device
   adds the user's initial state carried through its shard);
2. gathers every device's E [B, H, K, V] and total decays Dk_n ([B, H, K], or [B, H, 1] for scalar gates), Dv_n
   ([B, H, V]) over the axis (one all_gather of small arrays) and folds them in float32, in the recurrence's order,
   up to its own: h_d = fold over the devices before it of h <- e^{Dk_n} h e^{Dv_n} + E (the first device: the
   initial state);
3. adds h_d's share to its outputs: one [n, K] x [K, V] product per head and row;
4. the final state is the last device's e^{Dk_n} h e^{Dv_n} + E, made the same on every device by a psum (zeros
   elsewhere): replicated over the axis.
The backward is JAX's derivative of these steps: the op's custom_vjp for each shard's recurrence, the gather's
transpose (a reduce-scatter) for the carried states, jnp for the rest. Every exponent is a sum of the shard's own
log gates from its start (never a difference of two long sums); gates that decay keep every factor <= 1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ejgen.runtime.core import sharding, vma
from ejgen.runtime.recurrent import api
from ejgen.runtime.recurrent.gates import log_gates

F32 = jnp.float32
_MESH_ARGUMENTS = ("mesh", "in_specs", "out_specs")


def reject_unsupported(spec: api.SpecInfo, unsupported: dict) -> None:
    """A context-parallel form takes the op's arguments but the mesh wrapper's; anything else is the op's own
    error."""
    mesh_args = sorted(n for n in unsupported if n in _MESH_ARGUMENTS)
    if mesh_args:
        raise TypeError(f"{spec.name}_cp() got {mesh_args[0]}=: a context-parallel form runs inside jax.shard_map (or "
                        f"under a mesh context on global arrays); to cut a call over a mesh, pass mesh= and in_specs= "
                        f"to {spec.name}() itself (a cut sequence runs this form)")
    try:
        api.reject_unsupported(spec, unsupported)
    except TypeError as e:
        raise TypeError(str(e).replace(f"{spec.name}()", f"{spec.name}_cp()", 1)) from None


def refuse(name: str, arguments: dict) -> None:
    """What a context-parallel call cannot take, a ValueError naming it (the mesh wrapper asks before it cuts a
    sequence)."""
    if arguments.get("cu_seqlens") is not None:
        raise ValueError(f"{name}: cu_seqlens cannot be combined with context parallelism (a cut sequence): packed "
                         f"sequences would cross the shards' bounds; cut the batch of dense sequences instead")


def context_parallel(spec: api.SpecInfo, op, backends: dict, hooks, query, key, value, *, axis_name, arguments: dict,
                     choices: dict):
    """``op``'s context-parallel form: ``backends`` are its backends by name (among which it chooses), ``arguments``
    its positional arguments by name (gates, softmax_scale, initial_state, reverse, cu_seqlens), ``choices`` its
    algorithm, chunk_size and platform, ``hooks`` the spec's feature map and gate map in jnp. Inside
    ``jax.shard_map`` with ``axis_name`` bound, query, key, value and the per-step gates are this device's steps;
    outside, global arrays cut over ``axis_name`` of the context mesh."""
    name = f"{spec.name}_cp"
    refuse(f"{name}()", arguments)
    if not isinstance(axis_name, str):
        raise ValueError(f"{name}(): axis_name must be the name of one mesh axis (a str), got {axis_name!r}")
    try:
        devices = sharding.axis_size(axis_name)
    except NameError:
        return _on_context_mesh(spec, op, backends, hooks, query, key, value, axis_name, arguments, choices)
    call = prepare(spec, backends, query, key, value, arguments, choices, name)
    return _inside(spec, op, hooks, call, axis_name, devices, arguments, choices)


def _on_context_mesh(spec, op, backends, hooks, query, key, value, axis_name, arguments, choices):
    """A call on global arrays: checked whole and brought to the kernel layout once, then run under
    ``jax.shard_map`` over the context mesh, the steps of q, k, v and the per-step gates cut over ``axis_name``,
    everything else replicated; o comes back cut as query, the final state replicated."""
    name = f"{spec.name}_cp"
    call = prepare(spec, backends, query, key, value, arguments, choices, name)
    mesh = sharding.mesh_with_axis(f"{name}()", axis_name)
    devices = mesh.shape[axis_name]
    if call.cfg.seq_len % devices:
        raise ValueError(f"{name}(): the {call.cfg.seq_len} steps of query cannot be cut evenly over mesh axis "
                         f"{axis_name!r} ({devices} devices)")
    cut = P(None, axis_name)
    arrays = {"gates": call.gates, "h0": call.h0}
    specs = {"gates": {n: P() if n == "g_gamma" else cut for n in call.gates}, "h0": P()}

    def body(q, k, v, arrays):  # this device's steps; cfg's shapes stay the whole call's (`_inside` reads none)
        return _inside(spec, op, hooks, dataclasses.replace(call, q=q, k=k, v=v, **arrays), axis_name, devices,
                       arguments, choices)

    run = vma.shard_map(body, mesh=mesh, in_specs=(cut, cut, cut, specs), out_specs=(cut, P()))
    return run(jnp.asarray(call.q), jnp.asarray(call.k), jnp.asarray(call.v), arrays)


TENSOR_ARGUMENTS = (*api.GATES, "initial_state", "cu_seqlens")  # the op's arrays beside q, k, v (by name: a numpy
# scalar softmax_scale or reverse has a shape too, and stays a Python value)


def tensor_arguments(arguments: dict) -> dict:
    """The arguments that travel into shard_map as arrays (those given)."""
    return {n: jnp.asarray(x) for n, x in arguments.items() if n in TENSOR_ARGUMENTS and x is not None}


def prepare(spec: api.SpecInfo, backends: dict, query, key, value, arguments: dict, choices: dict,
            name: str) -> api.Prepared:
    """The call checked as the op checks it (``backends``: the op's), errors naming ``name`` (the function the user
    called): its platform, its arguments against that backend's chunked kernels, the backend's kernel choice (not
    recorded: each shard's own call records its choice); brought to the kernel layout."""
    backend = api.choose_platform(dataclasses.replace(spec, name=name), choices["platform"], backends)
    options = {n: x for n, x in choices.items() if n != "platform"}
    call = api.prepare(spec, query, key, value, **arguments, **options, chunked=api.chunked_gates(backends[backend]),
                       name=name)
    api.kernel_choice(backends, choices["platform"], backend, call)
    return call


def check_call(spec: api.SpecInfo, backends: dict, query, key, value, arguments: dict, choices: dict,
               name: str) -> None:
    """`prepare`'s checks of a whole call, traced for shapes only: before it is cut."""
    jax.eval_shape(lambda: prepare(spec, backends, query, key, value, arguments, choices, name) and None)


def _inside(spec, op, hooks, call: api.Prepared, axis, devices, arguments, choices):
    """The steps above on this device: ``call`` holds its q, k, v, gates and initial state (``call.cfg``'s
    reverse, scale and dtype; its shapes may be the whole call's)."""
    cfg = call.cfg
    o_own, end = op(call.q, call.k, call.v, **call.gates, softmax_scale=arguments.get("softmax_scale"),
                    reverse=cfg.reverse, **choices)  # checked as `prepare` checked it: it takes the call as it is
    q, key_log, value_log = _mapped(call.q, call.gates, cfg, hooks)
    key_total = None if key_log is None else jnp.sum(key_log, axis=1)  # [B, H, K | 1]
    value_total = None if value_log is None else jnp.sum(value_log, axis=1)  # [B, H, V]
    r = lax.axis_index(axis)
    first, last = (devices - 1, 0) if cfg.reverse else (0, devices - 1)
    if call.h0 is not None:  # the initial state enters at the first device
        end = end + jnp.where(r == first, _decayed(call.h0, key_total, value_total), 0.0)
    carried = _carried(axis, r, cfg.reverse, end, key_total, value_total)
    h = carried if call.h0 is None else carried + jnp.where(r == first, call.h0, 0.0)
    o = o_own.astype(F32) + _share(q, key_log, value_log, h, cfg)
    final = _decayed(carried, key_total, value_total) + end
    final = lax.psum(jnp.where(r == last, final, 0.0), axis)
    return o.astype(o_own.dtype), final


def _mapped(q, gates, cfg, hooks):
    """float32 q mapped and scaled [B, n, H, K]; the key side's log gate per step, g + g_gamma + gk ([B, n, H, K],
    or [B, n, H, 1] without gk; None without any), and the value side's, gv ([B, n, H, V] or None), after the gate
    map."""
    q = q.astype(F32)
    if hooks.feature_map is not None:
        q = hooks.feature_map(q)
    q = q * cfg.scale
    scalar, key_log, value_log = log_gates(gates, hooks, q.shape[:3])
    if scalar is not None:
        key_log = scalar[..., None] if key_log is None else key_log + scalar[..., None]
    return q, key_log, value_log


def _decayed(h, key_total, value_total):
    """diag(e^{Dk}) h diag(e^{Dv}) of states h [B, H, K, V]."""
    if key_total is not None:
        h = h * jnp.exp(key_total)[..., None]
    if value_total is not None:
        h = h * jnp.exp(value_total)[..., None, :]
    return h


def _carried(axis, r, reverse: bool, end, key_total, value_total):
    """The state entering this device's shard from the devices before it (zero on the first; without the initial
    state): every device's end state and total decays gathered, folded in float32 in the recurrence's order."""
    shared = jax.tree_util.tree_map(lambda x: lax.all_gather(x, axis), (end, key_total, value_total))
    devices = shared[0].shape[0]
    order = jnp.arange(devices)
    before = order > r if reverse else order < r

    def step(h, x):
        (e, kt, vt), take = x
        return jnp.where(take, _decayed(h, kt, vt) + e, h), None

    start = vma.vary(jnp.zeros_like(end), vma.varying_axes(shared, r))
    h, _ = lax.scan(step, start, (shared, before), reverse=reverse)
    return h


def _share(q, key_log, value_log, h, cfg):
    """The outputs' share of the entering state h [B, H, K, V]: ((q ⊙ e^{Dk_t}) h) ⊙ e^{Dv_t}, float32 [B, n, H,
    V], Dk_t and Dv_t summed from the shard's start (reverse: from its end) up to t."""
    if key_log is not None:
        q = q * jnp.exp(_cumulative(key_log, cfg.reverse))
    exact = lax.Precision.HIGHEST if cfg.dtype == "float32" else lax.Precision.DEFAULT
    share = jnp.einsum("bthk,bhkv->bthv", q, h, precision=exact)
    if value_log is not None:
        share = share * jnp.exp(_cumulative(value_log, cfg.reverse))
    return share


def _cumulative(x, reverse: bool):
    """Sums over the steps (axis 1) from the shard's start up to each step, inclusive (reverse: from its end)."""
    return jnp.flip(jnp.cumsum(jnp.flip(x, 1), axis=1), 1) if reverse else jnp.cumsum(x, axis=1)
