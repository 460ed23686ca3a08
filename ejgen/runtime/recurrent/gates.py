"""The gates of the linear recurrent family: the log gates as every backend and the context-parallel form read them
(``log_gates``), and the gates' gradients from the log decay's gradient per step, which the kernels write (Triton,
Pallas): docs/DESIGN.md §3 linear recurrent, "Gates' gradients".

With D_s the decay of step s (key side e^{g_s + g_gamma + gk_s}, value side e^{gv_s}) and S̄_s the adjoint of the
state after step s (every later output's and the final state's share), the log decay's gradient is
    dL/dlog D_s = S̄_s ⊙ D_s ⊙ S_{s-1}    (summed over V for the key side, over K for the value side)
a sum over the pairs (r, t) with r < s <= t of what k_r v_r (the initial state for r = 0) gives o_t (the final
state for t = T); no term cancels another. The kernels write it per step (the chunked Triton ones a part per block of
channels, which ``triton.host`` puts together); here it becomes each gate's: gk takes the key side per channel, g its
sum over the channels, g_gamma that summed over every step, gv the value side, each through the gate map's
derivative.

(The gradient can also be written as reverse cumulative sums of q ⊙ dq - k ⊙ dk over the steps: exact, but its
terms grow with the steps after s while the result does not, so float32 loses digits in proportion to T, and
g_gamma's gradient, a sum over every step, most: 4e-5 at T = 300 in float32 and 0.38 in bfloat16 (Triton's chunked
kernels, against the float64 oracle), where the direct sum errs by 3e-7 and 7e-4.)
"""

from __future__ import annotations

import jax.numpy as jnp

from ejgen.runtime.recurrent.config import SCALAR_LOG_GATES

F32 = jnp.float32


def log_gates(gates, hooks, shape):
    """The per-step log gates after the gate map (``gates``: the call's, raw): the scalar gate g + g_gamma (None
    without either; g_gamma [H] broadcast to ``shape``, [B, T, H]), gk [B, T, H, K] and gv [B, T, H, V] (or None)."""
    step = {n: gates[n] for n in ("g", "gk", "gv") if n in gates}
    if hooks.gate_map is not None:
        step = {n: hooks.gate_map(x) for n, x in step.items()}
    scalar = step.get("g")
    if "g_gamma" in gates:
        gamma = jnp.broadcast_to(gates["g_gamma"], shape)
        scalar = gamma if scalar is None else scalar + gamma
    return scalar, step.get("gk"), step.get("gv")


def token_sequences(cu, tokens: int):
    """Per token its sequence (clipped into [0, N)) and whether it belongs to one (not past cu[N])."""
    t = jnp.arange(tokens, dtype=jnp.int32)
    n = cu.shape[0] - 1
    seq = jnp.clip(jnp.searchsorted(cu, t, side="right").astype(jnp.int32) - 1, 0, n - 1)
    return seq, t < cu[n]


def step_index(cfg, cu):
    """([B, T] int32: each step's index in its sequence in processing order, [B, T] int32: its sequence, [1, T] bool or
    None: whether it belongs to one)."""
    t = jnp.arange(cfg.seq_len, dtype=jnp.int32)
    if cu is None:
        i = cfg.seq_len - 1 - t if cfg.reverse else t
        seq = jnp.arange(cfg.batch, dtype=jnp.int32)[:, None]
        return jnp.broadcast_to(i, (cfg.batch, cfg.seq_len)), jnp.broadcast_to(seq, (cfg.batch, cfg.seq_len)), None
    seq, valid = token_sequences(cu, cfg.seq_len)
    i = cu[seq + 1] - 1 - t if cfg.reverse else t - cu[seq]
    return i[None], seq[None], valid[None]


def gate_grads(gates, hooks, d_key=None, d_value=None):
    """{gate: gradient} for the gates the call passed (``gates``: raw, before the gate map). d_key [B, T, H, K] (with
    gk) or [B, T, H, 1]: the key side's log decay gradient per step and query head; d_value [B, T, H, V] (gv)."""
    out = {}
    if "gk" in gates:
        out["gk"] = _mapped_grad(hooks, gates["gk"], d_key)
    scalar_gates = [name for name in SCALAR_LOG_GATES if name in gates]
    if scalar_gates and d_key is None:  # not formed, none being learned (RecurrentConfig.log_grads): zeros, which JAX
        out.update({name: jnp.zeros_like(gates[name]) for name in scalar_gates})  # drops
    elif scalar_gates:
        scalar = jnp.sum(d_key, axis=3)  # [B, T, H]
        if "g" in gates:
            out["g"] = _mapped_grad(hooks, gates["g"], scalar)
        if "g_gamma" in gates:
            out["g_gamma"] = jnp.sum(scalar, axis=(0, 1))
    if "gv" in gates:
        out["gv"] = _mapped_grad(hooks, gates["gv"], d_value)
    return out


def _mapped_grad(hooks, raw, d_mapped):
    return d_mapped if hooks.gate_map_grad is None else hooks.gate_map_grad(raw) * d_mapped


def finish(hooks, q, k, v, gates, h0, cfg, dphi_q, dphi_k, dv_h, dh0, d_key=None, d_value=None):
    """From the kernels' gradients of the mapped q and k and of v, per query head (float32), and the log decays'
    gradients (``gate_grads``): the gates' gradients, the hooks' derivatives, the sums over each key / value head's
    group, the inputs' dtypes."""
    group = cfg.groups
    dgates = gate_grads(gates, hooks, d_key, d_value)
    dk, dv = dphi_k, dv_h
    if group > 1:
        dk = dk.reshape(dk.shape[:2] + (cfg.kv_heads, group, cfg.dk)).sum(3)
        dv = dv.reshape(dv.shape[:2] + (cfg.kv_heads, group, cfg.dv)).sum(3)
    dq = dphi_q
    if hooks.feature_map_grad is not None:
        dq = dq * hooks.feature_map_grad(q.astype(F32))
        dk = dk * hooks.feature_map_grad(k.astype(F32))
    dgates = {name: dgates[name].astype(gates[name].dtype) for name in gates}
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dgates, (None if h0 is None else dh0)
