"""Float64 reference for attention, written from docs/DESIGN.md §3 alone (never from ejgen's code).

The reference is a dense evaluation on full ``[B, Hq, Sq, Sk]`` score matrices in jax.numpy under
float64 (``jax.enable_x64`` as a context manager, so the setting never reaches the op under
test); gradients come from ``jax.vjp`` of the same function. Inputs may be numpy or jax arrays of
any float dtype; they are widened to float64 as given, so a bf16 input is compared against the
exact result for its bf16 values. Results are numpy float64 arrays.

Hooks stand in for a spec's DSL (docs/DESIGN.md §2): ``score(s, ix, params, options) -> s`` and
``mask(ix, options) -> bool``, evaluated on the full matrices; ``ix`` holds the index grids
``b, h, q_idx, kv_idx`` (broadcastable to ``[B, Hq, Sq, Sk]``) and the ints ``q_len, kv_len``. What is visible
(the mask hook included, on numpy grids) is evaluated before the jitted evaluation and passed to it, as are the
scale, the soft cap, the bias (full) and the sinks (padded): one compilation serves every call of a shape.
``param_at`` reads a param with one index per dim, each clamped into its dim, as the DSL does.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

# Measured (relative errors, worst over xla and the triton/pallas interpreters on the CPU: every
# conformance case on every backend, and the CI subset of test_variants, test_dsl_functions,
# test_pallas, test_kernel_choice, test_triton_{band,merged,tma}):
#                  out       gradients  lse
#   float32        8.0e-7    1.7e-6     1.7e-7   (dvalue: DSL powers spec on pallas; lse: window (0, 0))
#   float16        2.7e-4    3.4e-4     6.2e-8
#   bfloat16       5.1e-3    7.0e-3     4.6e-8   (triton: the interpreter truncates f32 -> bf16, ~3x xla)
#   large logits, f32  2.2e-5  2.2e-5   1.0e-7   (scores to +-200: up to 2.1 u·L, L the largest |score|)
#   large logits, bf16 3.1e-3  1.8e-2   6.1e-8   (triton's truncating interpreter; xla 4.1e-3)
# float32 outputs and gradients get 6-12x their maximum, lse 12x; the 16-bit tolerances are unchanged.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}
"""Relative error ``‖x - ref‖ / ‖ref‖`` allowed per input dtype, for out and gradients."""

LSE_TOLERANCE = 2e-6
"""Relative error allowed for lse whatever the input dtype. lse is float32 and computed from the inputs
as given (bf16/f16 products are exact in float32); the oracle widens the same rounded inputs, so only
float32 accumulation and exp/log remain: 1.7e-7 at worst, in every dtype."""

UNIT_ROUNDOFF = 2.0**-24
"""float32's unit roundoff: a score ``s`` rounded to float32 moves ``exp(s - m)`` by up to ``u·|s|``."""

LOGIT_ULPS = 10
"""Large-logit cases add ``LOGIT_ULPS · u · L`` to the tolerance of out and gradients (L: the largest
|score| or |sink| reaching the softmax): measured up to 2.1 ``u·L`` at L = 100-210 in float32."""


@dataclasses.dataclass(frozen=True)
class Index:
    """Index grids for score/mask hooks; each broadcasts to ``[B, Hq, Sq, Sk]``."""

    b: jax.Array  # [B, 1, 1, 1]
    h: jax.Array  # [1, Hq, 1, 1]
    q_idx: jax.Array  # [1, 1, Sq, 1]
    kv_idx: jax.Array  # [1, 1, 1, Sk]
    q_len: int
    kv_len: int


ScoreFn = Callable[[jax.Array, Index, dict, dict], jax.Array]
MaskFn = Callable[[Index, dict], jax.Array]


@dataclasses.dataclass
class Reference:
    """What the oracle returns: float64 numpy arrays; ``grads`` keyed by argument name."""

    out: np.ndarray  # [B, Sq, Hq, Dv]   (varlen [Tq, Hq, Dv])
    lse: np.ndarray  # [B, Hq, Sq]       (varlen [Hq, Tq])
    grads: dict = dataclasses.field(default_factory=dict)
    stored_out: dict = dataclasses.field(default_factory=dict)  # 16-bit inputs: what reading back the output
    # as stored (rounded to the input dtype) moves each gradient by (`check_attention`)


def param_at(param: jax.Array, *indices) -> jax.Array:
    """``param[i0, i1, ...]`` with every index clamped into its dim (the DSL's indexing rule)."""
    if len(indices) != param.ndim:
        raise ValueError(f"param of rank {param.ndim} indexed with {len(indices)} indices")
    clamped = tuple(jnp.clip(i, 0, n - 1) for i, n in zip(indices, param.shape))
    return param[clamped]


def sinks_per_head(softmax_aux: jax.Array, num_heads: int) -> jax.Array:
    """``softmax_aux`` as ``[Hq, n]``.

    ``[Hq, n]`` is taken as is; a 1-D array of length ``Hq`` is one sink per head (``[Hq]``);
    any other 1-D length ``n`` is ``n`` sinks shared by every head. (A 1-D array of length ``Hq``
    could also read as ``n = Hq`` shared sinks; §3 does not say, and we take the per-head reading.)
    """
    if softmax_aux.ndim == 2:
        return softmax_aux
    if softmax_aux.shape[0] == num_heads:
        return softmax_aux[:, None]
    return jnp.broadcast_to(softmax_aux[None, :], (num_heads, softmax_aux.shape[0]))


def _window_bounds(sliding_window) -> tuple[int, int]:
    if isinstance(sliding_window, (int, np.integer)):
        return int(sliding_window), int(sliding_window)
    left, right = sliding_window
    return int(left), int(right)


def visible(
    ix: Index,
    *,
    causal: bool = False,
    sliding_window=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    attention_mask=None,
    mask: MaskFn | None = None,
    options: dict | None = None,
) -> jax.Array:
    """Step 4 of §3: bool, broadcastable to ``[B, Hq, Sq, Sk]``."""
    i, j = ix.q_idx, ix.kv_idx
    diag = i + (ix.kv_len - ix.q_len)  # bottom-right aligned diagonal
    vis = np.ones((1, 1, ix.q_len, ix.kv_len), bool)
    if causal:
        vis = vis & (j <= diag)
    if sliding_window is not None:
        left, right = _window_bounds(sliding_window)
        # With causal the right bound is 0: AND-ing with the causal condition gives min(right, 0).
        vis = vis & (j >= diag - left) & (j <= diag + right)
    if q_segment_ids is not None:
        kv_seg = q_segment_ids if kv_segment_ids is None else kv_segment_ids
        qs = q_segment_ids[:, None, :, None]  # [B, 1, Sq, 1]
        ks = kv_seg[:, None, None, :]  # [B, 1, 1, Sk]
        vis = vis & (qs == ks) & (qs >= 0)
    if attention_mask is not None:
        am = attention_mask if attention_mask.ndim == 4 else attention_mask[:, None]
        vis = vis & am.astype(bool)
    if mask is not None:
        vis = vis & mask(ix, options or {})
    return vis


@dataclasses.dataclass(frozen=True)
class _Config:
    """What about one oracle evaluation is compiled in; hashable, so that the jitted evaluation below is compiled
    once per configuration and shape. Everything else is an input of the evaluation (`attention`): which entries are
    visible (step 4 of §3, evaluated before it, on the host), the scale, the soft cap, a bias of the full score shape
    and the sinks padded to a few slots; calls of one shape then share one compilation whatever their features."""

    score: ScoreFn | None
    options: tuple  # (name, value) pairs; () without a score hook (a mask hook is evaluated before the evaluation)
    params: tuple  # param names, in the order given


SINK_SLOTS = 8
"""The oracle's evaluation takes ``[Hq, n]`` sinks padded with -inf to a multiple of this many (none: all -inf);
-inf sinks add exactly 0 to every denominator and take no gradient."""


def _index(B, Hq, Sq, Sk, xp):
    return Index(
        b=xp.arange(B)[:, None, None, None],
        h=xp.arange(Hq)[None, :, None, None],
        q_idx=xp.arange(Sq)[None, None, :, None],
        kv_idx=xp.arange(Sk)[None, None, None, :],
        q_len=Sq,
        kv_len=Sk,
    )


def _attention(diff: dict, arrays: dict, cfg: _Config):
    """Dense §3 on float64 inputs; returns ``(out [B,Sq,Hq,Dv], lse [B,Hq,Sq])``.

    ``diff`` holds query, key, value, softmax_aux (``[Hq, n]``, -inf slots: none), the params and, but for a
    packed sequence, bias (``[B, Hq, Sq, Sk]``, zeros: none); ``arrays`` what is visible (``[B, Hq, Sq, Sk]``,
    steps 4-5: causal, window, segment ids, the dense mask and a mask hook), the scale, the soft cap and whether
    it applies.
    """
    q, k, v = diff["query"], diff["key"], diff["value"]
    params = {n: diff[n] for n in cfg.params}
    options = dict(cfg.options)
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    kh = jnp.repeat(k, group, axis=2)  # [B, Sk, Hq, D]: query head h reads kv head h // group
    vh = jnp.repeat(v, group, axis=2)  # [B, Sk, Hq, Dv]
    s = arrays["scale"] * jnp.einsum("bqhd,bkhd->bhqk", q, kh)  # [B, Hq, Sq, Sk]
    if "bias" in diff:
        s = s + diff["bias"]
    if cfg.score is not None:
        s = cfg.score(s, _index(B, Hq, Sq, Sk, jnp), params, options)
    cap = arrays["cap"]
    s = jnp.where(arrays["capped"], cap * jnp.tanh(s / cap), s)
    vis = arrays["visible"]
    m = jnp.max(jnp.where(vis, s, -jnp.inf), axis=-1, initial=-jnp.inf)  # [B, Hq, Sq]
    sinks = diff["softmax_aux"][None, :, None, :]  # [1, Hq, 1, n]
    m = jnp.maximum(m, jnp.max(sinks, axis=-1))
    # The max only stabilises; it cancels exactly, so it carries no gradient.
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    # exp(-inf) = 0 with a zero derivative: masked entries take no value and pass no gradient.
    p = jnp.exp(jnp.where(vis, s - m[..., None], -jnp.inf))  # [B, Hq, Sq, Sk]
    l = jnp.sum(p, axis=-1) + jnp.sum(jnp.exp(sinks - m[..., None]), axis=-1)
    has_mass = l > 0
    l_safe = jnp.where(has_mass, l, 1.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p / l_safe[..., None], vh)
    lse = jnp.where(has_mass, m + jnp.log(l_safe), -jnp.inf)
    return out, lse


def _varlen_attention(diff: dict, arrays: dict, cfg: tuple):
    """Packed sequences, one dense evaluation each; ``cfg = (_Config, cu_q, cu_k, Tq, Hq, Dv, whether sinks were
    given)``, ``arrays`` the scale and soft cap and, per sequence, what is visible."""
    dense_cfg, cu_q, cu_k, Tq, Hq, Dv, sinks = cfg
    aux = diff["softmax_aux"]
    out = jnp.zeros((Tq, Hq, Dv))
    lse = jnp.full((Hq, Tq), -jnp.inf)
    if sinks:  # tokens of no sequence still see the sinks
        lse = lse.at[:].set(jax.nn.logsumexp(aux, axis=-1)[:, None])
    for n in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
        if q1 == q0:
            continue
        one = {"query": diff["query"][None, q0:q1], "key": diff["key"][None, k0:k1],
               "value": diff["value"][None, k0:k1], "softmax_aux": aux}
        o, l = _attention(one, {**arrays, "visible": arrays["visible"][n]}, dense_cfg)
        out = out.at[q0:q1].set(o[0])
        lse = lse.at[:, q0:q1].set(l[0])
    return out, lse


def _f64(x):
    return None if x is None else jnp.asarray(np.asarray(x, dtype=np.float64))


def _exact(x):
    return None if x is None else jnp.asarray(np.asarray(x))


def _to_numpy(tree):
    return jax.tree.map(lambda a: np.asarray(a, dtype=np.float64), tree)


def _forward(diff, arrays, d_out, d_lse, *, fn, cfg):
    return fn(diff, arrays, cfg)


def _forward_backward(diff, arrays, d_out, d_lse, *, fn, cfg):
    (out, lse), vjp = jax.vjp(lambda d: fn(d, arrays, cfg), diff)
    (grads,) = vjp((d_out, jnp.zeros_like(lse) if d_lse is None else d_lse))
    return out, lse, grads


# The reference graphs are small and run once: XLA's backend optimisations would only double the
# compile time, which dominates the oracle's cost in the test suite.
_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
_COMPILED: dict = {}


def _compiled(stage, fn, cfg, args):
    """``stage`` jitted with ``fn, cfg`` static, compiled once per configuration and shapes."""
    leaves, tree = jax.tree.flatten(args)
    key = (stage, fn, cfg, tree, tuple((x.shape, x.dtype) for x in leaves))
    if key not in _COMPILED:
        lowered = jax.jit(functools.partial(stage, fn=fn, cfg=cfg)).lower(*args)
        _COMPILED[key] = lowered.compile(compiler_options=_COMPILER_OPTIONS)
    return _COMPILED[key]


def _run(fn, diff: dict, arrays: dict, cfg, d_out, d_lse) -> Reference:
    """Evaluate ``fn(diff, arrays, cfg) -> (out, lse)`` in float64 and, given cotangents, its vjp."""
    with jax.enable_x64(True):
        args = (
            {n: _f64(x) for n, x in diff.items()},
            jax.tree.map(_exact, arrays),
            _f64(d_out),
            _f64(d_lse),
        )
        if d_out is None:
            out, lse = _compiled(_forward, fn, cfg, args)(*args)
            return Reference(*_to_numpy((out, lse)))
        out, lse, grads = _compiled(_forward_backward, fn, cfg, args)(*args)
        stored = {}
        dtype = jnp.dtype(diff["query"].dtype)
        if dtype.itemsize == 2:
            # A flash backward reads the output it stored, rounded to the input dtype: its
            # delta_i = sum_d dO * O (docs/DESIGN.md §3) moves by sum_d dO * (round(O) - O), which acts on
            # every gradient as that much more d_lse. The oracle evaluates the move: a kernel may err by it.
            moved = jnp.sum(args[2] * (out.astype(dtype).astype(jnp.float64) - out), axis=-1)
            zero = jnp.zeros_like(out)
            stored = _compiled(_forward_backward, fn, cfg, args[:2] + (zero, jnp.moveaxis(moved, -1, -2)))(
                *args[:2], zero, jnp.moveaxis(moved, -1, -2))[2]
        return Reference(*_to_numpy((out, lse)), _to_numpy(grads), _to_numpy(stored))


def _sinks(softmax_aux, num_heads: int):
    """``softmax_aux`` (or None) as the evaluation's ``[Hq, n]`` padded with -inf to a multiple of `SINK_SLOTS`."""
    with jax.enable_x64(True):  # sinks_per_head's jnp keeps float64
        given = np.zeros((num_heads, 0)) if softmax_aux is None else np.asarray(sinks_per_head(
            np.asarray(softmax_aux, np.float64), num_heads))
    slots = max(1, -(-given.shape[1] // SINK_SLOTS)) * SINK_SLOTS
    return np.concatenate([given, np.full((num_heads, slots - given.shape[1]), -np.inf)], axis=1)


def _sinks_gradient(grad, softmax_aux, num_heads: int):
    """The gradient of the padded ``[Hq, n]`` sinks as one of ``softmax_aux`` in its own form (`sinks_per_head`)."""
    n = 1 if softmax_aux.ndim == 1 and softmax_aux.shape[0] == num_heads else softmax_aux.shape[-1]
    grad = grad[:, :n]
    if softmax_aux.ndim == 2:
        return grad
    return grad[:, 0] if softmax_aux.shape[0] == num_heads else grad.sum(axis=0)  # shared: summed over the heads


def _bias_gradient(grad, shape):
    """The gradient of the full ``[B, Hq, Sq, Sk]`` bias as one of a bias of ``shape`` broadcast to it."""
    lead = grad.ndim - len(shape)
    grad = grad.sum(axis=tuple(range(lead)))
    return grad.sum(axis=tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1), keepdims=True)


def _grads_as_given(grads: dict, given: dict, num_heads: int) -> dict:
    """The evaluation's gradients (full bias, padded sinks) keyed and shaped like the call's arguments."""
    grads = {n: g for n, g in grads.items() if n in given}
    if "bias" in grads:
        grads["bias"] = _bias_gradient(grads["bias"], np.shape(given["bias"]))
    if "softmax_aux" in grads:
        grads["softmax_aux"] = _sinks_gradient(grads["softmax_aux"], np.asarray(given["softmax_aux"]), num_heads)
    return grads


def _scalars(softmax_scale, head_dim: int, logits_soft_cap) -> dict:
    scale = 1.0 / np.sqrt(head_dim) if softmax_scale is None else softmax_scale
    return {"scale": np.float64(scale), "cap": np.float64(1.0 if logits_soft_cap is None else logits_soft_cap),
            "capped": np.bool_(logits_soft_cap is not None)}


def _hashable_window(sliding_window):
    return sliding_window if sliding_window is None or isinstance(sliding_window, int) else tuple(
        int(x) for x in sliding_window
    )


def attention(
    query, key, value, *, causal=False, sliding_window=None, logits_soft_cap=None,
    softmax_aux=None, bias=None, q_segment_ids=None, kv_segment_ids=None, attention_mask=None,
    score: ScoreFn | None = None, mask: MaskFn | None = None, params: dict | None = None,
    options: dict | None = None, softmax_scale=None, d_out=None, d_lse=None,
) -> Reference:
    """Out and lse of §3 for ``query [B,Sq,Hq,D], key [B,Sk,Hkv,D], value [B,Sk,Hkv,Dv]``.

    With ``d_out`` (and optionally ``d_lse``) also the gradients of
    ``Σ out·d_out + Σ lse·d_lse`` with respect to query, key, value, bias and softmax_aux (those
    given) and every param. Segment ids and the dense mask follow ``MaskInfo``: negative ids are
    padding, the mask is ``[B, Sq, Sk]`` or ``[B, 1|Hq, Sq, Sk]`` with True = visible.
    """
    _check_heads(query, key)
    B, Sq, Hq, D = np.shape(query)
    Sk = np.shape(key)[1]
    cfg = _Config(score=score, options=tuple(sorted((options or {}).items())) if score is not None else (),
                  params=tuple(params or {}))
    with jax.enable_x64(True):  # a mask hook may compute with jnp (eagerly, here)
        vis = visible(_index(B, Hq, Sq, Sk, np), causal=causal, sliding_window=sliding_window,
                      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, attention_mask=attention_mask,
                      mask=mask, options=options)
        vis = np.broadcast_to(np.asarray(vis), (B, Hq, Sq, Sk))
    arrays = {"visible": vis, **_scalars(softmax_scale, D, logits_soft_cap)}
    given = {"query": query, "key": key, "value": value, **({} if bias is None else {"bias": bias}),
             **({} if softmax_aux is None else {"softmax_aux": softmax_aux}), **(params or {})}
    diff = {"query": query, "key": key, "value": value,
            "bias": np.zeros((B, Hq, Sq, Sk)) if bias is None else np.broadcast_to(
                np.asarray(bias, np.float64), (B, Hq, Sq, Sk)),
            "softmax_aux": _sinks(softmax_aux, Hq), **(params or {})}
    if d_out is not None and d_lse is None:  # no cotangent for lse: zeros (the same compilation as with one)
        d_lse = np.zeros((B, Hq, Sq))
    ref = _run(_attention, diff, arrays, cfg, d_out, d_lse)
    ref.grads = _grads_as_given(ref.grads, given, Hq)
    ref.stored_out = _grads_as_given(ref.stored_out, given, Hq)
    return ref


def varlen_attention(
    query, key, value, cu_seqlens_q, cu_seqlens_k, *, causal=False, sliding_window=None,
    logits_soft_cap=None, softmax_aux=None, softmax_scale=None, d_out=None, d_lse=None,
) -> Reference:
    """§3 step 8: packed ``query [Tq,Hq,D], key/value [Tk,Hkv,D|Dv]``, one dense call per sequence.

    Every sequence is independent, causal and window aligned to its own lengths. Tokens outside
    ``[0, cu_seqlens[-1])`` belong to no sequence and get out 0, lse -inf (sinks aside).
    """
    _check_heads(query[None], key[None])
    cu_q = tuple(int(x) for x in np.asarray(cu_seqlens_q))
    cu_k = tuple(int(x) for x in np.asarray(cu_seqlens_k))
    if len(cu_q) != len(cu_k):
        raise ValueError("cu_seqlens_q and cu_seqlens_k describe different numbers of sequences")
    Tq, Hq, D = np.shape(query)
    dense_cfg = _Config(score=None, options=(), params=())
    cfg = (dense_cfg, cu_q, cu_k, Tq, Hq, np.shape(value)[-1], softmax_aux is not None)
    vis = tuple(np.broadcast_to(visible(_index(1, Hq, q1 - q0, k1 - k0, np), causal=causal,
                                        sliding_window=sliding_window), (1, Hq, q1 - q0, k1 - k0))
                for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]))
    arrays = {"visible": vis, **_scalars(softmax_scale, D, logits_soft_cap)}
    given = {"query": query, "key": key, "value": value}
    if softmax_aux is not None:
        given["softmax_aux"] = softmax_aux
    diff = {"query": query, "key": key, "value": value, "softmax_aux": _sinks(softmax_aux, Hq)}
    if d_out is not None and d_lse is None:
        d_lse = np.zeros((Hq, Tq))
    ref = _run(_varlen_attention, diff, arrays, cfg, d_out, d_lse)
    ref.grads = _grads_as_given(ref.grads, given, Hq)
    ref.stored_out = _grads_as_given(ref.stored_out, given, Hq)
    return ref


def _check_heads(query, key):
    if query.shape[2] % key.shape[2]:
        raise ValueError(f"oracle: {query.shape[2]} query heads, {key.shape[2]} kv heads")


# Hand-written oracles of the variant specs in specs/*.yaml (docs/DESIGN.md §2 DSL, read by a person).


def alibi_score(s, ix: Index, params: dict, options: dict):
    # s - slopes[h] * min(abs(q_idx - kv_idx), max_distance)
    dist = jnp.minimum(jnp.abs(ix.q_idx - ix.kv_idx), options["max_distance"])
    return s - param_at(params["slopes"], ix.h) * dist


def prefix_lm_mask(ix: Index, options: dict):
    # kv_idx <= q_idx or kv_idx < prefix_len
    return (ix.kv_idx <= ix.q_idx) | (ix.kv_idx < options["prefix_len"])


def relative_bias_score(s, ix: Index, params: dict, options: dict):
    # s + bias_scale * rel_table[h, kv_idx - q_idx + 16]
    table = param_at(params["rel_table"], ix.h, ix.kv_idx - ix.q_idx + 16)
    return s + options["bias_scale"] * table


VARIANTS = {
    "alibi_attention": dict(
        score=alibi_score, defaults={"max_distance": 1024}, compiled={},
    ),
    "prefix_lm_attention": dict(
        mask=prefix_lm_mask, defaults={"prefix_len": 0}, compiled={},
    ),
    "local_softcap_sinks_attention": dict(
        defaults={},
        compiled={"causal": True, "sliding_window": (24, 0), "logits_soft_cap": 20.0},
    ),
    "relative_bias_attention": dict(
        score=relative_bias_score, defaults={"bias_scale": 1.0}, compiled={},
    ),
}
"""Per variant: its score/mask hook, its options' defaults, its compiled-in features."""


def variant_attention(name: str, query, key, value, *, options=None, **kwargs) -> Reference:
    """The oracle of a generated variant: its hooks and compiled-in features, spec defaults for
    options not given, everything else as in ``attention``."""
    spec = VARIANTS[name]
    opts = {**spec["defaults"], **(options or {})}
    return attention(
        query, key, value, score=spec.get("score"), mask=spec.get("mask"), options=opts,
        **spec["compiled"], **kwargs,
    )


def assert_close(name: str, x, ref, tol: float) -> float:
    """Assert ``‖x - ref‖ / ‖ref‖ <= tol`` (absolute where ``ref`` is all zero), after checking
    shape, that ``x`` has no NaN, and that ``x`` is infinite exactly where ``ref`` is (same sign).
    Returns the relative error."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert x.shape == ref.shape, f"{name}: shape {x.shape}, reference {ref.shape}"
    n_nan = int(np.isnan(x).sum())
    assert n_nan == 0, f"{name}: {n_nan} NaN of {x.size}"
    inf_ref = np.isinf(ref)
    bad_inf = np.isinf(x) != inf_ref
    bad_inf |= inf_ref & (x != ref)
    if bad_inf.any():
        where = tuple(int(i) for i in np.argwhere(bad_inf)[0])
        raise AssertionError(
            f"{name}: infinite at other places than the reference ({int(bad_inf.sum())} entries;"
            f" first at {where}: {x[where]} vs {ref[where]})"
        )
    fin = ~inf_ref
    diff = x[fin] - ref[fin]
    scale = float(np.linalg.norm(ref[fin]))
    err = float(np.linalg.norm(diff)) / scale if scale > 0 else float(np.linalg.norm(diff))
    if not err <= tol:
        gap = np.abs(np.where(fin, x, 0.0) - np.where(fin, ref, 0.0))
        worst = np.unravel_index(np.argmax(gap), x.shape)
        worst = tuple(int(i) for i in worst)
        raise AssertionError(
            f"{name}: relative error {err:.3e} > {tol:.1e} (‖ref‖ = {scale:.3e}; largest"
            f" difference at {worst}: {x[worst]:.6g} vs {ref[worst]:.6g})"
        )
    return err


def tolerance(dtype: str, max_logit: float | None = None) -> float:
    """The tolerance of out and gradients: ``TOLERANCE[dtype]``, plus ``LOGIT_ULPS · u · max_logit``
    for inputs whose scores (or sinks) reach ``±max_logit``, far beyond the standard normal's ~16."""
    extra = 0.0 if max_logit is None else LOGIT_ULPS * UNIT_ROUNDOFF * float(max_logit)
    return TOLERANCE[dtype] + extra


STORED_OUT_SLACK = 1.5
"""16-bit gradients may also err by this many times what reading back the stored output moves them by
(`Reference.stored_out`): where dP and delta nearly cancel (a single visible key, a tiny shape) that move is
a large share of a small gradient; over many entries it is far below ``TOLERANCE``."""


def _stored_out_allowance(ref: Reference, name: str) -> float:
    if name not in ref.stored_out:
        return 0.0
    scale = float(np.linalg.norm(ref.grads[name][np.isfinite(ref.grads[name])]))
    moved = float(np.linalg.norm(ref.stored_out[name]))
    return STORED_OUT_SLACK * moved / scale if scale > 0 else STORED_OUT_SLACK * moved


def check_attention(out, lse, grads, ref: Reference, diff: dict, dtype: str, *, max_logit=None, lse_atol=None):
    """Dtypes, every value against the oracle, and exact zeros where nothing is visible. lse is held
    to ``LSE_TOLERANCE`` whatever the dtype, or with ``lse_atol`` (an approximation's error model, e.g. the fast
    tanh's) each finite entry within that of the oracle's and the same entries infinite; out and gradients to
    ``tolerance(dtype, max_logit)``."""
    tol = tolerance(dtype, max_logit)
    assert out.dtype == jnp.dtype(dtype), f"out dtype {out.dtype}, input {dtype}"
    assert lse.dtype == jnp.float32, f"lse dtype {lse.dtype}"
    assert_close("out", out, ref.out, tol)
    if lse_atol is None:
        assert_close("lse", lse, ref.lse, LSE_TOLERANCE)
    else:
        got, want = np.asarray(lse, np.float64), np.asarray(ref.lse, np.float64)
        finite = np.isfinite(want)
        assert np.array_equal(np.isfinite(got), finite), "lse: infinite where the oracle's is finite, or not"
        worst = float(np.max(np.abs(got - want)[finite], initial=0.0))
        assert worst <= lse_atol, f"lse: largest difference {worst:.3e} > {lse_atol:.3e}"
    assert set(grads) == set(diff)
    for name, g in grads.items():
        assert g.dtype == diff[name].dtype, f"d{name} is {g.dtype}, {name} {diff[name].dtype}"
        assert_close(f"d{name}", g, ref.grads[name], tol + _stored_out_allowance(ref, name))
    out, dq = np.asarray(out, np.float64), np.asarray(grads["query"], np.float64)
    empty = np.all(ref.out == 0, axis=-1)  # queries that see no key: [..., Hq]
    assert np.all(out[empty] == 0), "out is not exactly 0 for a query that sees no key"
    assert np.all(dq[empty] == 0), "dq is not exactly 0 for a query that sees no key"
    unseen = np.all(ref.grads["value"] == 0, axis=-1)  # keys no query sees: [..., Hkv]
    for name in ("key", "value"):
        g = np.asarray(grads[name], np.float64)
        assert np.all(g[unseen] == 0), f"d{name} is not exactly 0 for a key no query sees"
    if "bias" in grads:
        zero = ref.grads["bias"] == 0  # masked entries (after broadcasting)
        assert np.all(np.asarray(grads["bias"], np.float64)[zero] == 0), "dbias through a mask"
    return empty
