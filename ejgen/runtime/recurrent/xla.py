"""The XLA backend of the linear recurrent family: plain jnp on any device (docs/DESIGN.md §3 linear recurrent).

Two algorithms over the same layout (``packing``: rows of chunks, packed sequences chunk-aligned, reverse as
forward in time), each a ``lax.scan`` carrying the float32 state S [Bp, H, K, V]:
- ``fused``: one step at a time, S = decay(S) + kᵀv, o = q S;
- ``chunked``: C steps at a time. With log gates summed from the chunk's start (A for the scalar gate g + g_gamma,
  Bk for gk, Bv for gv; D = A + Bk), every factor is e to a difference of later minus earlier sums, never e to a
  large positive number (gates are decays):
      o_t  = ((q_t e^{D_t}) S) e^{Bv_t} + sum_{j <= t} [sum_k q_tk k_jk e^{D_tk - D_jk}] v_j e^{Bv_t - Bv_j}
      S'   = diag(e^{D_C}) S diag(e^{Bv_C}) + sum_j (k_j e^{D_C - D_j})ᵀ (v_j e^{Bv_C - Bv_j})
  The intra-chunk sum is matrix products between sub-chunks of SUB steps (secondary chunking): the block of
  sub-chunks (I, J), J < I, factors through the start of I, q_i e^{D(start of I, i]} and k_j e^{D(j, start of I]}
  (both exponents <= 0), and a diagonal block takes each pair's own sum (SUB x SUB x K). Without per-channel gates
  a chunk is one block of C x C.
Accuracy: every exponent is a sum of the gates of its own steps (prefix sums inside a sub-chunk, suffix sums, sums
over whole sub-chunks, a pair's segment sum), never the difference of two long prefix sums, whose float32 rounding
would err by u·|sum over the chunk| (u = 2⁻²⁴) in decays near 1 once the gates are large.
The spec's hooks (feature map, gate map) run first, in float32; the scale multiplies q. The backward is JAX's
derivative of the same computation (``jax.vjp``, recomputing the forward): exact for every gate, the initial state
and the final state's cotangent. What enters the products (inputs, the state a call starts from, the cotangents)
passes an optimization barrier first (``_opaque``: an XLA:CPU miscompile of a product with a constant operand).

``forward(q, k, v, gates, h0, ctx, cfg, hooks, save)`` -> (o, final_state, residuals); ``backward`` -> (dq, dk, dv,
dgates, dh0), as every backend of the family.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ejgen.runtime.core import vma
from ejgen.runtime.recurrent import packing
from ejgen.runtime.recurrent.gates import log_gates

F32 = jnp.float32
SUB = 16  # steps of a sub-chunk (per-channel gates)


def forward(q, k, v, gates, h0, ctx, cfg, hooks, save: bool):
    o, ht = run(q, k, v, gates, h0, ctx.get("cu"), cfg, hooks)
    return o, ht, {}


def backward(q, k, v, gates, h0, ctx, res, do, dht, cfg, hooks):
    del res
    _, vjp = jax.vjp(lambda *a: run(*a, ctx.get("cu"), cfg, hooks), q, k, v, gates, h0)
    return vjp(_opaque((do, dht)))  # o.sum()'s cotangents are constants: broadcast(1), broadcast(0)


def prepare_inputs(q, k, v, gates, cfg, hooks):
    """float32 q (mapped, scaled), k (mapped), v with H heads each, and the log gates after the gate map: the
    scalar gate a = g + g_gamma [B, T, H] (None without either), gk [B, T, H, K] and gv [B, T, H, V] (or None)."""
    q, k, v = (x.astype(F32) for x in (q, k, v))
    if hooks.feature_map is not None:
        q, k = hooks.feature_map(q), hooks.feature_map(k)
    q = q * cfg.scale
    if cfg.groups > 1:
        k, v = jnp.repeat(k, cfg.groups, axis=2), jnp.repeat(v, cfg.groups, axis=2)
    return (q, k, v) + log_gates(gates, hooks, (cfg.batch, cfg.seq_len, cfg.heads))


def run(q, k, v, gates, h0, cu, cfg, hooks):
    """(o [B, T, H, V] in q's dtype, final_state [N, H, K, V] float32)."""
    dtype = q.dtype
    state_shape = (cfg.n_seqs, cfg.heads, cfg.dk, cfg.dv)
    start = jnp.zeros(state_shape, F32) if h0 is None else h0
    q, k, v, a, gk, gv = prepare_inputs(q, k, v, gates, cfg, hooks)
    q, k, v, a, gk, gv, start = _opaque((q, k, v, a, gk, gv, start))
    chunk = cfg.chunk
    layout = packing.packed(cu, cfg, chunk) if cfg.varlen else None
    nc = packing.n_chunks(cfg, chunk)
    rows = 1 if cfg.varlen else cfg.batch

    def chunks(x):  # [B, T, H, ...] -> [NC, Bp, H, C, ...] in the layout (None stays None)
        if x is None:
            return None
        x = packing.to_layout(x, cfg, chunk, layout)
        x = x.reshape((rows, nc, chunk) + x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

    xs = {"q": chunks(q), "k": chunks(k), "v": chunks(v), "a": chunks(a), "gk": chunks(gk), "gv": chunks(gv)}
    body = _chunk if cfg.algorithm == "chunked" else _steps
    if layout is None:
        carry = vma.vary(start, vma.varying_axes(q, k, v, a, gk, gv))

        def step(s, x):
            s, o = body(s, x)
            return s, o

        final, o = lax.scan(step, carry, xs)
    else:
        meta = {"seq": layout.chunk_seq, "first": layout.chunk_first, "last": layout.chunk_last}
        zero = _opaque(jnp.zeros((1,) + state_shape[1:], F32))  # a chunk of no sequence runs from it
        carry = vma.vary((zero, start), vma.varying_axes(q, k, v, a, gk, gv, start))

        def step(carry, x):
            s, final = carry
            x, m = x
            s = jnp.where(m["first"], start[m["seq"]][None], s)  # a sequence starts from its own initial state
            s, o = body(s, x)
            final = final.at[m["seq"]].set(jnp.where(m["last"], s[0], final[m["seq"]]))
            return (s, final), o

        (_, final), o = lax.scan(step, carry, (xs, meta))
    o = jnp.moveaxis(jnp.moveaxis(o, 3, 2), 0, 1).reshape((rows, nc * chunk, cfg.heads, cfg.dv))
    return packing.from_layout(o, cfg, layout).astype(dtype), final


def _opaque(tree):
    """``tree`` through ``lax.optimization_barrier``: XLA sees no constant (nor broadcast scalar) in it, so none
    reaches a product. XLA:CPU of jaxlib 0.10.2 puts a dot and a reduce into one YNNPACK fusion (``__ynn_fusion``),
    and a dot operand there that is a broadcast scalar, constant or not, is read as a vector along the contracting
    dimension from the scalar's address: its first element right, the rest whatever memory follows (up to 1e36,
    NaN), fixed per compiled executable (issue 17; ``jnp.sum(x, -1, keepdims=True) + jnp.einsum("bik,bkv->biv",
    x * y, jnp.zeros((2, 32, 32)))`` on [2, 64, 32] inputs is wrong in about half the compilations). It struck the
    zero state of a call without initial_state whose steps fit one chunk of sub-chunks: the scan runs once, XLA
    unrolls it and q S became a product with broadcast(0). ``--xla_disable_hlo_passes=algsimp`` or
    ``--xla_cpu_experimental_ynn_fusion_type=`` hid it; the barrier costs a copy at most."""
    return lax.optimization_barrier(tree)


def _exp_masked(x, mask):
    """e^x where ``mask``, else 0 (x masked before exp: no e^{large}, no NaN in the gradient)."""
    return jnp.exp(jnp.where(mask, x, -jnp.inf))


def _segsum(x, axis):
    """out[..., i, j, ...] = sum_{j < s <= i} x[..., s, ...] along ``axis`` (a new axis j after it), for i >= j:
    each pair's sum from its own terms, in order (no difference of two long prefix sums)."""
    x = jnp.moveaxis(x, axis, -1)  # [..., c]
    c = x.shape[-1]
    later = jnp.arange(c)[:, None] > jnp.arange(c)[None, :]  # [s, j]: s > j
    out = jnp.cumsum(jnp.where(later, x[..., :, None], 0.0), axis=-2)  # [..., i, j]
    return jnp.moveaxis(jnp.moveaxis(out, -2, axis), -1, axis + 1)


def _suffix(x, axis):
    """sum_{s > j} x_s along ``axis`` (exclusive, from the end)."""
    tail = jnp.flip(jnp.cumsum(jnp.flip(x, axis), axis), axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, 1)
    return lax.slice_in_dim(jnp.pad(tail, pad), 1, x.shape[axis] + 1, axis=axis)


def _steps(s, x):
    """The fused recurrence over one chunk of one step: S = e^{a} diag(e^{gk}) S diag(e^{gv}) + kᵀv, o = q S."""
    q, k, v = x["q"][:, :, 0], x["k"][:, :, 0], x["v"][:, :, 0]  # [Bp, H, K|V]
    if x["a"] is not None:
        s = s * jnp.exp(x["a"][:, :, 0])[..., None, None]
    if x["gk"] is not None:
        s = s * jnp.exp(x["gk"][:, :, 0])[..., :, None]
    if x["gv"] is not None:
        s = s * jnp.exp(x["gv"][:, :, 0])[..., None, :]
    s = s + k[..., :, None] * v[..., None, :]
    o = jnp.einsum("bhk,bhkv->bhv", q, s)
    return s, o[:, :, None]


def _chunk(s, x):
    """One chunk [Bp, H, C, ...] from the state at its start: (state at its end, o [Bp, H, C, V]). The key side's
    log gate is gk + a per channel, or a alone as one column [.., C, 1]; the value side's is gv."""
    q, k, v = x["q"], x["k"], x["v"]
    key = x["gk"]
    if x["a"] is not None:
        key = x["a"][..., None] if key is None else key + x["a"][..., None]
    val = x["gv"]
    o = _intra(q, k, v, key, val)
    if key is not None:  # inter-chunk: the state at the chunk's start decayed to each step (prefix sums)
        q = q * jnp.exp(jnp.cumsum(key, axis=2))
    inter = jnp.einsum("bhck,bhkv->bhcv", q, s)
    if val is not None:
        inter = inter * jnp.exp(jnp.cumsum(val, axis=2))
    if key is not None:  # the state at the chunk's end: S decayed by the chunk's sum, k_j by the sum after j
        s = s * jnp.swapaxes(jnp.exp(jnp.sum(key, axis=2, keepdims=True)), -1, -2)
        k = k * jnp.exp(_suffix(key, 2))
    if val is not None:
        s = s * jnp.exp(jnp.sum(val, axis=2, keepdims=True))
        v = v * jnp.exp(_suffix(val, 2))
    return s + jnp.einsum("bhck,bhcv->bhkv", k, v), o + inter


def _intra(q, k, v, key, val):
    """sum_{j <= t} [sum_k q_tk k_jk e^{Dk_(j,t]}] v_j e^{Dv_(j,t]} over one chunk (D_(j,t] the sum of the log
    gates of steps j + 1 .. t), by sub-chunks of SUB steps where a gate is per channel, else as one block."""
    rows, heads, c, _ = q.shape
    per_channel = (key is not None and key.shape[-1] > 1) or val is not None
    sub = SUB if per_channel and c > SUB else c
    n = c // sub

    def blocks(x):  # [Bp, H, C, ...] -> [Bp, H, n, sub, ...]
        return None if x is None else x.reshape((rows, heads, n, sub) + x.shape[3:])

    q, k, v, key, val = (blocks(x) for x in (q, k, v, key, val))
    causal = (jnp.arange(sub)[:, None] >= jnp.arange(sub)[None, :])[..., None]  # [i, j, 1]: j <= i
    # diagonal blocks: each pair's decay from its own steps
    if key is None:
        att = jnp.where(causal[..., 0], jnp.einsum("bhnik,bhnjk->bhnij", q, k), 0.0)
    elif key.shape[-1] == 1:
        att = jnp.einsum("bhnik,bhnjk->bhnij", q, k) * _exp_masked(_segsum(key, 3), causal)[..., 0]
    else:
        att = jnp.einsum("bhnik,bhnjk,bhnijk->bhnij", q, k, _exp_masked(_segsum(key, 3), causal))
    if val is None:
        o = jnp.einsum("bhnij,bhnjv->bhniv", att, v)
    else:
        o = jnp.einsum("bhnij,bhnjv,bhnijv->bhniv", att, v, _exp_masked(_segsum(val, 3), causal))
    if n > 1:
        o = o + _off_diagonal(q, k, v, key, val)
    return o.reshape(rows, heads, c, v.shape[-1])


def _between(log):
    """The decay from step j of sub-chunk J to step i of sub-chunk I > J as two factors, both e^{<= 0}:
    (prefix sums inside I [.., n, sub, D], suffix sums inside J plus the sums of the sub-chunks between
    [.., I, J, sub, D]); -inf where J >= I."""
    total = jnp.sum(log, axis=3)  # [Bp, H, n, D]
    n = log.shape[2]
    gaps = _segsum(total, 2)  # [Bp, H, I', J, D]: sum over sub-chunks J < L <= I'
    gaps = jnp.concatenate([jnp.zeros_like(gaps[:, :, :1]), gaps[:, :, :-1]], axis=2)  # [I, J]: J < L < I
    earlier = (jnp.arange(n)[:, None] > jnp.arange(n)[None, :])[:, :, None, None]  # [I, J, 1, 1]
    right = jnp.where(earlier, _suffix(log, 3)[:, :, None] + gaps[:, :, :, :, None], -jnp.inf)
    return jnp.cumsum(log, axis=3), right


def _off_diagonal(q, k, v, key, val):
    """The blocks (I, J), J < I, of sub-chunks [Bp, H, n, sub, ...]: q_i e^{D(start of I, i]} times
    k_j e^{D(j, start of I]} (module docstring), and likewise on the value side."""
    n = q.shape[2]
    earlier = (jnp.arange(n)[:, None] > jnp.arange(n)[None, :])[:, :, None, None]  # [I, J, 1, 1]
    if key is None:
        qr, kr = q, jnp.where(earlier, k[:, :, None], 0.0)
    else:
        left, right = _between(key)
        qr, kr = q * jnp.exp(left), k[:, :, None] * jnp.exp(right)
    att = jnp.einsum("bhIik,bhIJjk->bhIJij", qr, kr)  # [Bp, H, I, J, i, j]
    if val is None:
        return jnp.einsum("bhIJij,bhJjv->bhIiv", att, v)
    left, right = _between(val)
    return jnp.exp(left) * jnp.einsum("bhIJij,bhIJjv->bhIiv", att, v[:, :, None] * jnp.exp(right))
