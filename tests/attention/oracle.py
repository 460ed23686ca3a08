"""Float64 reference for attention, written from docs/DESIGN.md §3 alone (never from ejgen's code).

The reference is a dense evaluation on full ``[B, Hq, Sq, Sk]`` score matrices in jax.numpy under
float64 (``jax.enable_x64`` as a context manager, so the setting never reaches the op under
test); gradients come from ``jax.vjp`` of the same function. Inputs may be numpy or jax arrays of
any float dtype; they are widened to float64 as given, so a bf16 input is compared against the
exact result for its bf16 values. Results are numpy float64 arrays.

Hooks stand in for a spec's DSL (docs/DESIGN.md §2): ``score(s, ix, params, options) -> s`` and
``mask(ix, options) -> bool``, evaluated on the full matrices; ``ix`` holds the index grids
``b, h, q_idx, kv_idx`` (broadcastable to ``[B, Hq, Sq, Sk]``) and the ints ``q_len, kv_len``.
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
    vis = jnp.ones((1, 1, ix.q_len, ix.kv_len), bool)
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
    """Everything about one oracle evaluation that is not an array; hashable, so that the jitted
    evaluation below is compiled once per configuration and shape."""

    causal: bool
    sliding_window: object
    logits_soft_cap: float | None
    score: ScoreFn | None
    mask: MaskFn | None
    options: tuple  # (name, value) pairs
    softmax_scale: float | None
    params: tuple  # param names, in the order given


def _attention(diff: dict, arrays: dict, cfg: _Config):
    """Dense §3 on float64 inputs; returns ``(out [B,Sq,Hq,Dv], lse [B,Hq,Sq])``.

    ``diff`` holds query, key, value and, when given, bias, softmax_aux and the params;
    ``arrays`` the segment ids and the dense mask (or None).
    """
    q, k, v = diff["query"], diff["key"], diff["value"]
    bias, softmax_aux = diff.get("bias"), diff.get("softmax_aux")
    params = {n: diff[n] for n in cfg.params}
    options = dict(cfg.options)
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    kh = jnp.repeat(k, group, axis=2)  # [B, Sk, Hq, D]: query head h reads kv head h // group
    vh = jnp.repeat(v, group, axis=2)  # [B, Sk, Hq, Dv]
    scale = 1.0 / np.sqrt(D) if cfg.softmax_scale is None else cfg.softmax_scale
    s = scale * jnp.einsum("bqhd,bkhd->bhqk", q, kh)  # [B, Hq, Sq, Sk]
    if bias is not None:
        s = s + bias
    ix = Index(
        b=jnp.arange(B)[:, None, None, None],
        h=jnp.arange(Hq)[None, :, None, None],
        q_idx=jnp.arange(Sq)[None, None, :, None],
        kv_idx=jnp.arange(Sk)[None, None, None, :],
        q_len=Sq,
        kv_len=Sk,
    )
    if cfg.score is not None:
        s = cfg.score(s, ix, params, options)
    if cfg.logits_soft_cap is not None:
        s = cfg.logits_soft_cap * jnp.tanh(s / cfg.logits_soft_cap)
    vis = visible(
        ix, causal=cfg.causal, sliding_window=cfg.sliding_window, mask=cfg.mask, options=options,
        **arrays,
    )
    vis = jnp.broadcast_to(vis, s.shape)
    m = jnp.max(jnp.where(vis, s, -jnp.inf), axis=-1, initial=-jnp.inf)  # [B, Hq, Sq]
    if softmax_aux is not None:
        sinks = sinks_per_head(softmax_aux, Hq)[None, :, None, :]  # [1, Hq, 1, n]
        m = jnp.maximum(m, jnp.max(sinks, axis=-1))
    # The max only stabilises; it cancels exactly, so it carries no gradient.
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    # exp(-inf) = 0 with a zero derivative: masked entries take no value and pass no gradient.
    p = jnp.exp(jnp.where(vis, s - m[..., None], -jnp.inf))  # [B, Hq, Sq, Sk]
    l = jnp.sum(p, axis=-1)
    if softmax_aux is not None:
        l = l + jnp.sum(jnp.exp(sinks - m[..., None]), axis=-1)
    has_mass = l > 0
    l_safe = jnp.where(has_mass, l, 1.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p / l_safe[..., None], vh)
    lse = jnp.where(has_mass, m + jnp.log(l_safe), -jnp.inf)
    return out, lse


def _varlen_attention(diff: dict, arrays: dict, cfg: tuple):
    """Packed sequences, one dense evaluation each; ``cfg = (_Config, cu_q, cu_k, Tq, Hq, Dv)``."""
    dense_cfg, cu_q, cu_k, Tq, Hq, Dv = cfg
    aux = diff.get("softmax_aux")
    out = jnp.zeros((Tq, Hq, Dv))
    lse = jnp.full((Hq, Tq), -jnp.inf)
    if aux is not None:  # tokens of no sequence still see the sinks
        lse = lse.at[:].set(jax.nn.logsumexp(sinks_per_head(aux, Hq), axis=-1)[:, None])
    for n in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
        if q1 == q0:
            continue
        one = {"query": diff["query"][None, q0:q1], "key": diff["key"][None, k0:k1],
               "value": diff["value"][None, k0:k1]}
        if aux is not None:
            one["softmax_aux"] = aux
        o, l = _attention(one, arrays, dense_cfg)
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
            {n: _exact(x) for n, x in arrays.items()},
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


def _diff_inputs(query, key, value, bias, softmax_aux, params) -> dict:
    diff = {"query": query, "key": key, "value": value}
    if bias is not None:
        diff["bias"] = bias
    if softmax_aux is not None:
        diff["softmax_aux"] = softmax_aux
    diff.update(params or {})
    return diff


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
    cfg = _Config(
        causal=bool(causal), sliding_window=_hashable_window(sliding_window),
        logits_soft_cap=logits_soft_cap, score=score, mask=mask,
        options=tuple(sorted((options or {}).items())), softmax_scale=softmax_scale,
        params=tuple(params or {}),
    )
    arrays = {
        "q_segment_ids": q_segment_ids, "kv_segment_ids": kv_segment_ids,
        "attention_mask": attention_mask,
    }
    diff = _diff_inputs(query, key, value, bias, softmax_aux, params)
    return _run(_attention, diff, arrays, cfg, d_out, d_lse)


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
    dense_cfg = _Config(
        causal=bool(causal), sliding_window=_hashable_window(sliding_window),
        logits_soft_cap=logits_soft_cap, score=None, mask=None, options=(),
        softmax_scale=softmax_scale, params=(),
    )
    cfg = (dense_cfg, cu_q, cu_k, query.shape[0], query.shape[1], value.shape[-1])
    arrays = {"q_segment_ids": None, "kv_segment_ids": None, "attention_mask": None}
    diff = _diff_inputs(query, key, value, None, softmax_aux, None)
    return _run(_varlen_attention, diff, arrays, cfg, d_out, d_lse)


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
