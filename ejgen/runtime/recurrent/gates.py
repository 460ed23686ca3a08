"""The gates' gradients from the gradients of q, k and v, for the kernels that write only those (Triton, Pallas):
docs/DESIGN.md §3 linear recurrent, derived once here.

With G_t the key-side log gate summed over a sequence's steps up to t (processing order), o_t depends on G through
q_t e^{G_t} and k_j e^{-G_j} only, and the final state through e^{G_T}; so
    dL/dG_t = phi(q_t) ⊙ dphi(q_t) - phi(k_t) ⊙ dphi(k_t)        (+ rowsum(d final ⊙ final) at the last step)
and a gate of step s, which adds to every G_t from s on, gets the sum of these over t >= s: a reverse cumulative sum
per sequence (forward in memory with reverse). The value side likewise with o_t ⊙ do_t - v_t ⊙ dv_t and column sums;
the scalar gate g is the key side summed over K, g_gamma that summed over every step. Everything in float32, per
query head (k, v and their gradients as each query head sees them). The gate map's derivative comes last.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def token_sequences(cu, tokens: int):
    """Per token its sequence (clipped into [0, N)) and whether it belongs to one (not past cu[N])."""
    t = jnp.arange(tokens, dtype=jnp.int32)
    n = cu.shape[0] - 1
    seq = jnp.clip(jnp.searchsorted(cu, t, side="right").astype(jnp.int32) - 1, 0, n - 1)
    return seq, t < cu[n]


def later_sums(x, cfg, cu):
    """sum over the steps at or after t (processing order) of the same sequence, x [B, T, H, D]."""
    backward = not cfg.reverse  # in memory: suffix sums, or prefix sums for reverse
    if cu is None:
        return lax.cumsum(x, axis=1, reverse=backward)
    seq, _ = token_sequences(cu, cfg.seq_len)
    edge = jnp.concatenate([seq[1:] != seq[:-1], jnp.ones((1,), bool)]) if backward else \
        jnp.concatenate([jnp.ones((1,), bool), seq[1:] != seq[:-1]])  # the first step in scan order

    def combine(a, b):  # a segmented sum: b's value restarts where b begins a sequence
        (va, fa), (vb, fb) = a, b
        return jnp.where(fb, vb, va + vb), fa | fb

    flags = jnp.broadcast_to(edge[None, :, None, None], x.shape)
    sums, _ = lax.associative_scan(combine, (x, flags), reverse=backward, axis=1)
    return sums


def per_token(final_term, cfg, cu):
    """[N, H, D] per sequence -> [B, T, H, D] per token (0 for tokens of no sequence)."""
    if cu is None:
        return jnp.broadcast_to(final_term[:, None], (cfg.batch, cfg.seq_len) + final_term.shape[1:])
    seq, valid = token_sequences(cu, cfg.seq_len)
    return jnp.where(valid[:, None, None], final_term[seq], 0.0)[None]


def gate_grads(gates, cfg, cu, hooks, *, q, dq, k, dk, o=None, do=None, v=None, dv=None, final=None, d_final=None):
    """{gate: gradient} for the gates the call passed (``gates``: raw, before the gate map). q, dq, k, dk: the
    mapped q, k and their gradients per query head [B, T, H, K]; o, do, v, dv (gv only) [B, T, H, V]; final,
    d_final [N, H, K, V]."""
    out = {}
    key = {"g", "g_gamma", "gk"} & set(gates)
    valid = None if cu is None else token_sequences(cu, cfg.seq_len)[1][None, :, None, None]
    if key:
        step = q.astype(F32) * dq - k.astype(F32) * dk
        d_log = later_sums(step, cfg, cu) + per_token(jnp.sum(d_final * final, axis=3), cfg, cu)
        if valid is not None:
            d_log = jnp.where(valid, d_log, 0.0)
        if "gk" in gates:
            out["gk"] = _mapped_grad(hooks, gates["gk"], d_log)
        scalar = jnp.sum(d_log, axis=3)  # [B, T, H]
        if "g" in gates:
            out["g"] = _mapped_grad(hooks, gates["g"], scalar)
        if "g_gamma" in gates:
            out["g_gamma"] = jnp.sum(scalar, axis=(0, 1))
    if "gv" in gates:
        step = o.astype(F32) * do.astype(F32) - v.astype(F32) * dv
        d_log = later_sums(step, cfg, cu) + per_token(jnp.sum(d_final * final, axis=2), cfg, cu)
        if valid is not None:
            d_log = jnp.where(valid, d_log, 0.0)
        out["gv"] = _mapped_grad(hooks, gates["gv"], d_log)
    return out


def _mapped_grad(hooks, raw, d_mapped):
    return d_mapped if hooks.gate_map_grad is None else hooks.gate_map_grad(raw) * d_mapped


def finish(hooks, q, k, v, gates, h0, ctx, res, do, dht, cfg, dphi_q, dphi_k, dv_h, dh0):
    """From the kernels' gradients of the mapped q and k and of v, per query head (float32): the gates' gradients,
    the hooks' derivatives, the sums over each key / value head's group, the inputs' dtypes."""
    cu = ctx.get("cu")
    group = cfg.groups
    phi_q, phi_k = q.astype(F32), jnp.repeat(k.astype(F32), group, axis=2)
    if hooks.feature_map is not None:
        phi_q, phi_k = hooks.feature_map(phi_q), hooks.feature_map(phi_k)
    v_h = jnp.repeat(v.astype(F32), group, axis=2) if cfg.has("gv") else None
    dgates = gate_grads(gates, cfg, cu, hooks, q=phi_q, dq=dphi_q, k=phi_k, dk=dphi_k,
                                      o=res.get("o"), do=do, v=v_h, dv=dv_h, final=res["final"], d_final=dht)
    dk = dphi_k.reshape(dphi_k.shape[:2] + (cfg.kv_heads, group, cfg.dk)).sum(3)
    dv = dv_h.reshape(dv_h.shape[:2] + (cfg.kv_heads, group, cfg.dv)).sum(3)
    dq = dphi_q
    if hooks.feature_map_grad is not None:
        dq = dq * hooks.feature_map_grad(q.astype(F32))
        dk = dk * hooks.feature_map_grad(k.astype(F32))
    dgates = {name: dgates[name].astype(gates[name].dtype) for name in gates}
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dgates, (None if h0 is None else dh0)
