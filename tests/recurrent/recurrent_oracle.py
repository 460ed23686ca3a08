"""The float64 oracle of the linear recurrent family, written from docs/DESIGN.md §3 linear recurrent (never from the
kernels): the recurrence one step at a time in NumPy, S_t = D_t ⊙ S_{t-1} + k_tᵀ v_t with
D_t = e^{g_t + g_gamma} e^{gk_t} ⊗ e^{gv_t}, o_t = scale q_t S_t, each sequence on its own (reverse: t from the last
step to the first), and its adjoint, the same loop backwards in time:
    S̄_t += scale q_tᵀ do_t;  dq_t = scale do_t S_tᵀ;  dk_t = S̄_t v_t;  dv_t = k_t S̄_t;
    d log D_t = S̄_t ⊙ D_t ⊙ S_{t-1} (summed over V for gk, over K for gv, over both for g and g_gamma);
    S̄_{t-1} = D_t ⊙ S̄_t, from S̄ = d final_state; d initial_state is S̄ before the first step.
Hooks are functions written by hand from the spec's DSL text; their chain rule is JAX's derivative of those
functions in float64 (``jax.enable_x64`` as a context, so the setting never reaches the op under test).
``scan_reference`` is the same forward as a float64 ``lax.scan`` whose JAX derivative checks the adjoint
(test_recurrent_oracle.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

GATES = ("g", "g_gamma", "gk", "gv")
# relative error ||got - ref|| / ||ref|| per input dtype; what the XLA and kernel backends measure sits well inside
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 4e-3}


def _f64(x):
    return None if x is None else np.asarray(x, np.float64)


def _mapped(fn, x):
    """(fn(x), vjp) in float64, or (x, identity) without a hook."""
    if fn is None or x is None:
        return x, (lambda ct: ct)
    with jax.enable_x64(True):
        y, vjp = jax.vjp(fn, jnp.asarray(x))

    def back(ct):
        with jax.enable_x64(True):
            return np.asarray(vjp(jnp.asarray(ct))[0])

    return np.asarray(y), back


def _bounds(batch, steps, cu):
    if cu is None:
        return [(b, 0, steps) for b in range(batch)]
    cu = np.asarray(cu)
    return [(0, int(cu[n]), int(cu[n + 1])) for n in range(len(cu) - 1)]


def recurrent(inputs: dict, d_out, d_final, *, scale=None, reverse=False, cu=None, feature_map=None, gate_map=None):
    """(o, final_state, grads) in float64 for the cotangents (d_out, d_final); ``inputs`` holds query, key, value
    and any of the gates and initial_state (arrays of any float dtype, as the op takes them); grads is keyed like it."""
    x = {name: _f64(a) for name, a in inputs.items()}
    q_raw, k_raw, v = x["query"], x["key"], x["value"]
    batch, steps, heads, dk = q_raw.shape
    kv_heads, dv = k_raw.shape[2], v.shape[-1]
    group = heads // kv_heads
    q, q_back = _mapped(feature_map, q_raw)
    k, k_back = _mapped(feature_map, k_raw)
    step_gates = {name: _mapped(gate_map, x.get(name)) for name in ("g", "gk", "gv")}
    g, gk, gv = (step_gates[n][0] for n in ("g", "gk", "gv"))
    gamma = x.get("g_gamma")
    scale = dk ** -0.5 if scale is None else scale
    d_out, d_final = _f64(d_out), _f64(d_final)
    h0 = x.get("initial_state")
    o = np.zeros((batch, steps, heads, dv))
    grads = {"query": np.zeros_like(q), "key": np.zeros((batch, steps, heads, dk)),
             "value": np.zeros((batch, steps, heads, dv)), "g": np.zeros((batch, steps, heads)),
             "gk": np.zeros((batch, steps, heads, dk)), "gv": np.zeros((batch, steps, heads, dv)),
             "g_gamma": np.zeros(heads)}
    bounds = _bounds(batch, steps, cu)
    finals, d_h0 = np.zeros((len(bounds), heads, dk, dv)), np.zeros((len(bounds), heads, dk, dv))
    for n, (b, lo, hi) in enumerate(bounds):
        order = list(range(lo, hi))[::-1] if reverse else list(range(lo, hi))
        s = np.zeros((heads, dk, dv)) if h0 is None else h0[n].copy()
        states, decays = [], []
        for t in order:
            kt, vt = np.repeat(k[b, t], group, 0), np.repeat(v[b, t], group, 0)  # query head h reads h // group
            log = np.zeros((heads, dk, dv))
            if g is not None:
                log += g[b, t][:, None, None]
            if gamma is not None:
                log += gamma[:, None, None]
            if gk is not None:
                log += gk[b, t][:, :, None]
            if gv is not None:
                log += gv[b, t][:, None, :]
            decay = np.exp(log)
            states.append(s)
            s = decay * s + kt[:, :, None] * vt[:, None, :]
            decays.append(decay)
            o[b, t] = scale * np.einsum("hk,hkv->hv", q[b, t], s)
        finals[n] = s
        s_bar = d_final[n].copy()
        for i in reversed(range(len(order))):
            t = order[i]
            s_t = decays[i] * states[i] + np.repeat(k[b, t], group, 0)[:, :, None] * np.repeat(v[b, t], group, 0)[:, None, :]
            s_bar += scale * q[b, t][:, :, None] * d_out[b, t][:, None, :]
            grads["query"][b, t] = scale * np.einsum("hkv,hv->hk", s_t, d_out[b, t])
            grads["key"][b, t] = np.einsum("hkv,hv->hk", s_bar, np.repeat(v[b, t], group, 0))
            grads["value"][b, t] = np.einsum("hkv,hk->hv", s_bar, np.repeat(k[b, t], group, 0))
            p = s_bar * decays[i] * states[i]
            grads["g"][b, t] = p.sum((1, 2))
            grads["g_gamma"] += p.sum((1, 2))
            grads["gk"][b, t] = p.sum(2)
            grads["gv"][b, t] = p.sum(1)
            s_bar = decays[i] * s_bar
        d_h0[n] = s_bar
    out = {}
    for name in ("key", "value"):  # a key / value head's gradient sums its group's query heads
        grads[name] = grads[name].reshape(batch, steps, kv_heads, group, -1).sum(3)
    out["query"] = q_back(grads["query"])
    out["key"] = k_back(grads["key"])
    out["value"] = grads["value"]
    for name in ("g", "gk", "gv"):
        if name in x:
            out[name] = step_gates[name][1](grads[name])
    if gamma is not None:
        out["g_gamma"] = grads["g_gamma"]
    if h0 is not None:
        out["initial_state"] = d_h0
    return o, finals, out


def scan_reference(inputs: dict, *, scale=None, reverse=False):
    """The forward of a dense call (no hooks) as a float64 ``lax.scan`` per batch row: (o, final_state). Call it
    inside ``jax.enable_x64``; its JAX derivative is the adjoint's check."""
    q, k, v = inputs["query"], inputs["key"], inputs["value"]
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale

    def row(b):
        def step(s, t):
            log = jnp.zeros(s.shape)
            if "g" in inputs:
                log += inputs["g"][b, t][:, None, None]
            if "g_gamma" in inputs:
                log += inputs["g_gamma"][:, None, None]
            if "gk" in inputs:
                log += inputs["gk"][b, t][:, :, None]
            if "gv" in inputs:
                log += inputs["gv"][b, t][:, None, :]
            s = jnp.exp(log) * s + k[b, t][:, :, None] * v[b, t][:, None, :]
            return s, scale * jnp.einsum("hk,hkv->hv", q[b, t], s)

        s0 = inputs["initial_state"][b] if "initial_state" in inputs else jnp.zeros(q.shape[2:] + v.shape[-1:])
        s, o = lax.scan(step, s0, jnp.arange(q.shape[1]), reverse=reverse)
        return o, s

    outs = [row(b) for b in range(q.shape[0])]
    return jnp.stack([o for o, _ in outs]), jnp.stack([s for _, s in outs])


def rel_error(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(got - ref) / (denom if denom > 0 else 1.0))


def assert_close(name: str, got, ref, dtype: str, factor: float = 1.0):
    got = np.asarray(got, np.float64)
    assert got.shape == np.shape(ref), f"{name}: shape {got.shape}, expected {np.shape(ref)}"
    assert np.all(np.isfinite(got)), f"{name}: not finite"
    err = rel_error(got, ref)
    assert err <= TOLERANCE[dtype] * factor, f"{name}: relative error {err:.3g} > {TOLERANCE[dtype] * factor:.3g}"
