"""Sanity of the float64 oracle itself, against JAX's own attention, first principles and finite
differences; and of the shape registry and ``assert_close``."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from oracle import assert_close
from ejgen.testing.shapes import (
    GQA_SHAPES,
    MHA_SHAPES,
    SHAPES,
    VARLEN_SHAPES,
    INTERPRETER_SHAPES,
    XLA_SHAPES,
    GPU_SHAPES,
    WIDE_SHAPE,
    AttnShape,
    VarlenShape,
    rng_for,
)

pytestmark = pytest.mark.usefixtures("x64_stays_off")

EXACT = 1e-12  # float64 against float64


def _normal(rng, *shape):
    return rng.standard_normal(shape)


def _qkv(rng, B, Sq, Sk, Hq, Hkv, D, Dv=None):
    q = _normal(rng, B, Sq, Hq, D)
    return q, _normal(rng, B, Sk, Hkv, D), _normal(rng, B, Sk, Hkv, Dv or D)


def _one_hot_values(B, Sk, Hkv):
    """value[b, j, g, :] = e_j, so that out[b, i, h, :] is row i of the probability matrix."""
    return np.broadcast_to(np.eye(Sk)[None, :, None, :], (B, Sk, Hkv, Sk)).copy()


def _probabilities(q, k, **features):
    """``P [B, Sq, Hq, Sk]`` of the oracle, read through one-hot values."""
    B, Sk, Hkv = k.shape[0], k.shape[1], k.shape[2]
    return oracle.attention(q, k, _one_hot_values(B, Sk, Hkv), **features)


JAX_CASES = {
    "plain-B2-S45-H2x2-D16": dict(shape=(2, 45, 45, 2, 2, 16)),
    "causal-B2-S45-H2x2-D16": dict(shape=(2, 45, 45, 2, 2, 16), causal=True),
    "causal-B1-S33-H4x2-D8": dict(shape=(1, 33, 33, 4, 2, 8), causal=True),
    "plain-B1-S20-H4x1-D8": dict(shape=(1, 20, 20, 4, 1, 8)),
    "plain-B2-Sq7-Sk30-H2x1-D8": dict(shape=(2, 7, 30, 2, 1, 8)),
    "scale0.3-B1-S9-H2x2-D8": dict(shape=(1, 9, 9, 2, 2, 8), softmax_scale=0.3),
    "window3,2-B1-S24-H2x1-D8": dict(shape=(1, 24, 24, 2, 1, 8), sliding_window=(3, 2)),
    "bias-B2-S17-H4x2-D8": dict(shape=(2, 17, 17, 4, 2, 8), bias=(1, 4, 17, 17)),
    "mask-B2-S17-H2x2-D8": dict(shape=(2, 17, 17, 2, 2, 8), attention_mask=(2, 1, 17, 17)),
}


@pytest.mark.parametrize("case", JAX_CASES.values(), ids=JAX_CASES.keys())
def test_matches_jax_dot_product_attention(case):
    """The oracle equals ``jax.nn.dot_product_attention`` given float64 inputs."""
    rng = rng_for("jax", *case["shape"])
    B, Sq, Sk, Hq, Hkv, D = case["shape"]
    q, k, v = _qkv(rng, B, Sq, Sk, Hq, Hkv, D)
    kwargs = dict(causal=case.get("causal", False), softmax_scale=case.get("softmax_scale"))
    jax_kwargs = dict(is_causal=kwargs["causal"], scale=kwargs["softmax_scale"])
    if "sliding_window" in case:
        kwargs["sliding_window"] = jax_kwargs["local_window_size"] = case["sliding_window"]
    bias = mask = None
    if "bias" in case:
        bias = kwargs["bias"] = _normal(rng, *case["bias"])
    if "attention_mask" in case:
        mask = rng.random(case["attention_mask"]) < 0.7
        mask[..., 0] = True  # no empty rows: JAX's masked softmax is uniform there, §3's is 0
        kwargs["attention_mask"] = mask
    with jax.enable_x64(True):
        expected = np.asarray(
            jax.nn.dot_product_attention(
                jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                bias=None if bias is None else jnp.asarray(bias),
                mask=None if mask is None else jnp.asarray(mask),
                implementation="xla", **jax_kwargs,
            )
        )
    assert expected.dtype == np.float64
    ref = oracle.attention(q, k, v, **kwargs)
    # JAX's XLA path takes the softmax in float32 even for float64 inputs.
    assert_close("out", ref.out, expected, 1e-6)


def test_rows_sum_to_one_and_masked_entries_are_zero():
    rng = rng_for("rows")
    B, Sq, Sk, Hq, Hkv, D = 2, 19, 23, 4, 2, 8
    q, k, _ = _qkv(rng, B, Sq, Sk, Hq, Hkv, D)
    qseg = np.repeat(np.array([[0] * 10 + [1] * 7 + [-1] * 2, [2] * 19]), 1, axis=0)
    kseg = np.array([[0] * 12 + [1] * 9 + [-1] * 2, [2] * 20 + [-1] * 3])
    features = dict(
        causal=True, sliding_window=(6, 3), logits_soft_cap=2.0, q_segment_ids=qseg,
        kv_segment_ids=kseg,
    )
    p = _probabilities(q, k, **features).out  # [B, Sq, Hq, Sk]
    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    diag = i + Sk - Sq
    expected_visible = (
        (j <= diag) & (j >= diag - 6)
        & (qseg[:, :, None] == kseg[:, None, :]) & (qseg[:, :, None] >= 0)
    )[:, :, None, :]  # [B, Sq, 1, Sk]
    expected_visible = np.broadcast_to(expected_visible, p.shape)
    assert np.all(p[~expected_visible] == 0)
    assert np.all(p[expected_visible] > 0)
    rows = expected_visible.any(-1)
    assert rows.any() and (~rows).any()
    assert_close("row sums", p.sum(-1)[rows], np.ones(rows.sum()), EXACT)
    assert np.all(p.sum(-1)[~rows] == 0)


@pytest.mark.parametrize(
    "Sq, Sk, expected",
    [
        (2, 4, [[1, 1, 1, 0], [1, 1, 1, 1]]),
        (4, 2, [[0, 0], [0, 0], [1, 0], [1, 1]]),
        (3, 3, [[1, 0, 0], [1, 1, 0], [1, 1, 1]]),
    ],
    ids=["Sq2-Sk4", "Sq4-Sk2", "Sq3-Sk3"],
)
def test_causal_is_bottom_right_aligned(Sq, Sk, expected):
    q, k, _ = _qkv(rng_for("br", Sq, Sk), 1, Sq, Sk, 1, 1, 4)
    p = _probabilities(q, k, causal=True)
    np.testing.assert_array_equal(p.out[0, :, 0, :] > 0, np.array(expected, bool))
    empty = ~np.array(expected, bool).any(-1)
    assert np.all(np.isneginf(p.lse[0, 0, empty]))
    assert np.all(np.isfinite(p.lse[0, 0, ~empty]))


def test_window_bounds():
    """An int w is (w, w); with causal the right bound is 0; (left, right) is bottom-right
    aligned: i + Sk - Sq - left <= j <= i + Sk - Sq + right."""
    Sq, Sk = 9, 13
    q, k, _ = _qkv(rng_for("win"), 1, Sq, Sk, 1, 1, 4)
    seen = lambda **f: _probabilities(q, k, **f).out[0, :, 0, :] > 0  # noqa: E731
    np.testing.assert_array_equal(seen(sliding_window=3), seen(sliding_window=(3, 3)))
    np.testing.assert_array_equal(
        seen(causal=True, sliding_window=(3, 5)), seen(causal=True, sliding_window=(3, 0))
    )
    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    np.testing.assert_array_equal(
        seen(sliding_window=(2, 1)), (j >= i + 4 - 2) & (j <= i + 4 + 1)
    )


@pytest.mark.parametrize("kind", ["h", "hn", "n"])
def test_sinks_take_mass_and_only_join_the_denominator(kind):
    rng = rng_for("sinks", kind)
    B, Sq, Sk, Hq, Hkv, D = 2, 11, 14, 4, 2, 8
    q, k, _ = _qkv(rng, B, Sq, Sk, Hq, Hkv, D)
    if kind == "h":
        aux = _normal(rng, Hq)
        per_head = aux[:, None]
    elif kind == "hn":
        aux = per_head = _normal(rng, Hq, 3)
    else:
        aux = _normal(rng, 5)
        per_head = np.broadcast_to(aux, (Hq, 5))
    ones = np.ones((B, Sk, Hkv, 1))
    plain = oracle.attention(q, k, ones, causal=True)
    sunk = oracle.attention(q, k, ones, causal=True, softmax_aux=aux)
    sink_lse = np.log(np.exp(per_head).sum(-1))  # [Hq]
    # lse with sinks = logaddexp(lse without, logsumexp(sinks))
    assert_close("lse", sunk.lse, np.logaddexp(plain.lse, sink_lse[None, :, None]), EXACT)
    # With value = 1 the output is the mass left to the keys: 1 - Σ_sinks exp(a - lse).
    mass = 1 - np.exp(sink_lse[None, :, None] - sunk.lse)  # [B, Hq, Sq]
    assert_close("kept mass", sunk.out[..., 0], mass.transpose(0, 2, 1), EXACT)
    assert np.all(sunk.out < plain.out)
    # Each sink shape is the per-head [Hq, n] form.
    as_hn = oracle.attention(q, k, ones, causal=True, softmax_aux=per_head)
    assert_close("as [Hq, n]", sunk.out, as_hn.out, EXACT)


@pytest.mark.parametrize("sinks", [False, True], ids=["nosinks", "sinks"])
def test_fully_masked_rows(sinks):
    rng = rng_for("masked", sinks)
    B, Sq, Sk, Hq, Hkv, D = 1, 6, 5, 2, 1, 4
    q, k, v = _qkv(rng, B, Sq, Sk, Hq, Hkv, D)
    qseg = np.array([[0, 0, -1, 1, 1, 2]])  # query 2 is padding; segment 2 has no keys
    kseg = np.array([[0, 0, 1, 1, -1]])  # key 4 is padding
    aux = _normal(rng, Hq) if sinks else None
    ref = oracle.attention(
        q, k, v, q_segment_ids=qseg, kv_segment_ids=kseg, softmax_aux=aux,
        d_out=_normal(rng, B, Sq, Hq, D), d_lse=_normal(rng, B, Hq, Sq),
    )
    empty = [2, 5]
    assert np.all(ref.out[0, empty] == 0)
    if sinks:
        np.testing.assert_allclose(ref.lse[0, :, empty], np.broadcast_to(aux, (2, Hq)))
    else:
        assert np.all(np.isneginf(ref.lse[0, :, empty]))
    assert np.all(np.isfinite(ref.lse[0, :, [0, 1, 3, 4]]))
    for name, g in ref.grads.items():
        assert not np.isnan(g).any(), name
    assert np.all(ref.grads["query"][0, empty] == 0)
    assert np.all(ref.grads["key"][0, 4] == 0) and np.all(ref.grads["value"][0, 4] == 0)


def _finite_difference_check(fn, inputs: dict, grads: dict, eps=1e-6, tol=1e-7):
    """Central differences of the scalar ``fn(inputs)`` against ``grads``, every element."""
    for name, x in inputs.items():
        fd = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            plus, minus = dict(inputs), dict(inputs)
            plus[name] = x.copy()
            minus[name] = x.copy()
            plus[name][idx] += eps
            minus[name][idx] -= eps
            fd[idx] = (fn(plus) - fn(minus)) / (2 * eps)
        assert_close(f"d{name}", grads[name], fd, tol)


@pytest.mark.parametrize("causal", [False, True], ids=["window", "causal-window"])
def test_gradients_match_finite_differences(causal):
    """Every gradient of the oracle (q, k, v, bias, sinks, a score-hook param) against central
    differences in float64, on a tiny case with every feature and a fully masked row."""
    rng = rng_for("fd", causal)
    B, Sq, Sk, Hq, Hkv, D, Dv = 1, 3, 4, 2, 1, 3, 2
    q, k, v = _qkv(rng, B, Sq, Sk, Hq, Hkv, D, Dv)
    inputs = {
        "query": q, "key": k, "value": v, "bias": _normal(rng, 1, Hq, Sq, Sk),
        "softmax_aux": _normal(rng, Hq, 2), "table": _normal(rng, Hq, 3),
    }
    qseg, kseg = np.array([[0, 0, -1]]), np.array([[0, 0, 0, -1]])
    d_out, d_lse = _normal(rng, B, Sq, Hq, Dv), _normal(rng, B, Hq, Sq)

    def score(s, ix, params, options):
        table = oracle.param_at(params["table"], ix.h, ix.kv_idx - ix.q_idx + 1)
        return s + options["scale"] * table

    def run(x, with_grads):
        return oracle.attention(
            x["query"], x["key"], x["value"], bias=x["bias"], softmax_aux=x["softmax_aux"],
            params={"table": x["table"]}, score=score, options={"scale": 0.7},
            causal=causal, sliding_window=(2, 1), logits_soft_cap=1.5, softmax_scale=0.9,
            q_segment_ids=qseg, kv_segment_ids=kseg,
            d_out=d_out if with_grads else None, d_lse=d_lse if with_grads else None,
        )

    def loss(x):
        r = run(x, False)
        return float(np.sum(r.out * d_out) + np.sum(r.lse * d_lse))

    ref = run(inputs, True)
    assert set(ref.grads) == set(inputs)
    assert np.all(ref.grads["query"][0, 2] == 0)  # the padding query
    _finite_difference_check(loss, inputs, ref.grads)


def test_gqa_maps_query_head_to_kv_head_by_group():
    """Query head h reads kv head h // (Hq // Hkv)."""
    rng = rng_for("gqa")
    q, k, v = _qkv(rng, 1, 5, 6, 6, 2, 4)
    ref = oracle.attention(q, k, v)
    for h in range(6):
        g = slice(h // 3, h // 3 + 1)
        one = oracle.attention(q[:, :, h : h + 1], k[:, :, g], v[:, :, g])
        assert_close(f"head {h}", ref.out[:, :, h : h + 1], one.out, EXACT)


def test_varlen_matches_dense_per_sequence():
    rng = rng_for("varlen")
    shape = VarlenShape((4, 0, 6, 3), (5, 0, 6, 0), 4, 2, 8, 3)
    q, k, v = (_normal(rng, *getattr(shape, n)) for n in ("query", "key", "value"))
    aux = _normal(rng, 4)
    d_out, d_lse = _normal(rng, *shape.out), _normal(rng, *shape.lse)
    ref = oracle.varlen_attention(
        q, k, v, shape.cu_seqlens_q, shape.cu_seqlens_k, causal=True, softmax_aux=aux,
        d_out=d_out, d_lse=d_lse,
    )
    cq, ck = shape.cu_seqlens_q, shape.cu_seqlens_k
    for n in range(4):
        qs, ks = slice(cq[n], cq[n + 1]), slice(ck[n], ck[n + 1])
        if cq[n] == cq[n + 1]:
            continue
        one = oracle.attention(
            q[None, qs], k[None, ks], v[None, ks], causal=True, softmax_aux=aux,
            d_out=d_out[None, qs], d_lse=d_lse[None, :, qs],
        )
        assert_close(f"out[{n}]", ref.out[qs], one.out[0], EXACT)
        assert_close(f"lse[{n}]", ref.lse[:, qs], one.lse[0], EXACT)
        assert_close(f"dq[{n}]", ref.grads["query"][qs], one.grads["query"][0], EXACT)
        assert_close(f"dk[{n}]", ref.grads["key"][ks], one.grads["key"][0], EXACT)
    # The last sequence has no keys: out 0, lse of the sinks alone.
    last = slice(cq[3], cq[4])
    assert np.all(ref.out[last] == 0)
    np.testing.assert_allclose(ref.lse[:, last], np.broadcast_to(aux[:, None], (4, 3)))


def test_varlen_of_equal_lengths_is_the_batch():
    rng = rng_for("varlen-batch")
    B, S, Hq, Hkv, D = 2, 7, 2, 1, 4
    q, k, v = _qkv(rng, B, S, S, Hq, Hkv, D)
    dense = oracle.attention(q, k, v, causal=True, sliding_window=(2, 0))
    cu = np.array([0, S, 2 * S], np.int32)
    packed = oracle.varlen_attention(
        q.reshape(B * S, Hq, D), k.reshape(B * S, Hkv, D), v.reshape(B * S, Hkv, D), cu, cu,
        causal=True, sliding_window=(2, 0),
    )
    assert_close("out", packed.out, dense.out.reshape(B * S, Hq, D), EXACT)
    assert_close("lse", packed.lse, dense.lse.transpose(1, 0, 2).reshape(Hq, B * S), EXACT)


def _explicit_bias(fn, B, Hq, Sq, Sk):
    bias = np.zeros((B, Hq, Sq, Sk))
    for b, h, i, j in itertools.product(range(B), range(Hq), range(Sq), range(Sk)):
        bias[b, h, i, j] = fn(h, i, j)
    return bias


@pytest.mark.parametrize("options", [{}, {"max_distance": 3}], ids=["default", "max_distance3"])
def test_alibi_oracle_is_a_bias(options):
    rng = rng_for("alibi", *options)
    B, Sq, Sk, Hq, Hkv, D = 1, 6, 9, 2, 1, 4
    q, k, v = _qkv(rng, B, Sq, Sk, Hq, Hkv, D)
    slopes = np.array([0.5, 0.25])
    md = options.get("max_distance", 1024)
    dist = _explicit_bias(lambda h, i, j: min(abs(i - j), md), 1, 1, Sq, Sk)[0, 0]
    bias = -slopes[None, :, None, None] * dist
    d_out = _normal(rng, B, Sq, Hq, D)
    ref = oracle.variant_attention(
        "alibi_attention", q, k, v, params={"slopes": slopes}, options=options, d_out=d_out
    )
    expected = oracle.attention(q, k, v, bias=bias, d_out=d_out)
    assert_close("out", ref.out, expected.out, EXACT)
    # d slopes[h] = Σ dbias[h, i, j] · (-min(|i - j|, max_distance))
    dslopes = -(expected.grads["bias"] * dist).sum(axis=(0, 2, 3))
    assert_close("dslopes", ref.grads["slopes"], dslopes, EXACT)


def test_relative_bias_oracle_clamps_into_the_table():
    rng = rng_for("relbias")
    B, Sq, Sk, Hq, Hkv, D = 1, 5, 40, 2, 2, 4
    q, k, v = _qkv(rng, B, Sq, Sk, Hq, Hkv, D)
    table = _normal(rng, Hq, 33)
    entry = lambda h, i, j: table[h, min(max(j - i + 16, 0), 32)]  # noqa: E731
    bias = 0.5 * _explicit_bias(entry, B, Hq, Sq, Sk)
    d_out = _normal(rng, B, Sq, Hq, D)
    ref = oracle.variant_attention(
        "relative_bias_attention", q, k, v, params={"rel_table": table},
        options={"bias_scale": 0.5}, d_out=d_out,
    )
    expected = oracle.attention(q, k, v, bias=bias, d_out=d_out)
    assert_close("out", ref.out, expected.out, EXACT)
    dtable = np.zeros_like(table)
    for h, i, j in itertools.product(range(Hq), range(Sq), range(Sk)):
        dtable[h, min(max(j - i + 16, 0), 32)] += 0.5 * expected.grads["bias"][0, h, i, j]
    assert np.all(dtable[:, 32] != 0)  # keys 17 and more past a query share the last entry
    assert_close("drel_table", ref.grads["rel_table"], dtable, EXACT)


def test_prefix_lm_oracle_is_a_mask():
    rng = rng_for("prefix")
    B, Sq, Sk, Hq, Hkv, D = 2, 8, 11, 2, 1, 4
    q, k, v = _qkv(rng, B, Sq, Sk, Hq, Hkv, D)
    aux = _normal(rng, Hq)
    for prefix_len in (0, 3, 20):
        mask = _explicit_bias(lambda h, i, j: j <= i or j < prefix_len, B, 1, Sq, Sk).astype(bool)
        ref = oracle.variant_attention(
            "prefix_lm_attention", q, k, v, options={"prefix_len": prefix_len}, softmax_aux=aux
        )
        expected = oracle.attention(q, k, v, attention_mask=mask, softmax_aux=aux)
        assert_close(f"out prefix_len={prefix_len}", ref.out, expected.out, EXACT)


def test_local_softcap_sinks_oracle_compiles_in_its_features():
    rng = rng_for("local")
    q, k, v = _qkv(rng, 1, 40, 50, 2, 1, 4)
    aux = _normal(rng, 2)
    ref = oracle.variant_attention("local_softcap_sinks_attention", q, k, v, softmax_aux=aux)
    expected = oracle.attention(
        q, k, v, causal=True, sliding_window=(24, 0), logits_soft_cap=20.0, softmax_aux=aux
    )
    assert_close("out", ref.out, expected.out, EXACT)
    wide = oracle.attention(q, k, v, causal=True, logits_soft_cap=20.0, softmax_aux=aux)
    assert not np.allclose(ref.out, wide.out)  # the window matters at this length


def test_param_at_clamps_every_index():
    table = jnp.arange(12.0).reshape(3, 4)
    got = oracle.param_at(table, jnp.array([-1, 0, 2, 5]), jnp.array([9, -3, 1, 3]))
    np.testing.assert_array_equal(np.asarray(got), [3.0, 0.0, 9.0, 11.0])


def test_oracle_keeps_low_precision_inputs_exact_and_x64_local():
    rng = rng_for("bf16")
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _qkv(rng, 1, 5, 5, 2, 2, 4))
    ref = oracle.attention(q, k, v)
    wide = oracle.attention(*(np.asarray(x).astype(np.float64) for x in (q, k, v)))
    assert ref.out.dtype == np.float64
    assert_close("out", ref.out, wide.out, 0.0)
    assert not jax.config.jax_enable_x64
    assert jnp.asarray(1.0).dtype == jnp.float32


def test_assert_close_can_fail():
    ref = np.array([1.0, -np.inf, 2.0])
    assert_close("same", ref.copy(), ref, 0.0)
    with pytest.raises(AssertionError, match="relative error"):
        assert_close("x", np.array([1.1, -np.inf, 2.0]), ref, 1e-3)
    with pytest.raises(AssertionError, match="NaN"):
        assert_close("x", np.array([np.nan, -np.inf, 2.0]), ref, 1.0)
    with pytest.raises(AssertionError, match="infinite"):
        assert_close("x", np.array([1.0, -1e30, 2.0]), ref, 1.0)
    with pytest.raises(AssertionError, match="shape"):
        assert_close("x", ref[:2], ref, 1.0)


def test_shape_registry_covers_the_plan():
    shapes = GQA_SHAPES + MHA_SHAPES
    cpu = shapes + VARLEN_SHAPES + INTERPRETER_SHAPES + XLA_SHAPES
    every = set(cpu + GPU_SHAPES + (WIDE_SHAPE,))
    assert len({s.id for s in every}) == len(every) == len(SHAPES)
    assert AttnShape(2, 63, 65, 4, 2, 48).id == "B2-Sq63-Sk65-H4x2-D48"
    for s in cpu:  # small enough for the CPU suite
        lengths = (s.q_len, s.kv_len) if isinstance(s, AttnShape) else (s.total_q, s.total_kv)
        assert max(lengths) <= 130 and s.head_dim <= 72 and getattr(s, "batch", 1) <= 2, s
    assert WIDE_SHAPE.head_dim > 256 and WIDE_SHAPE.q_len * WIDE_SHAPE.kv_len < 1000
    assert any(s.q_len < s.kv_len and s.odd for s in shapes)
    assert any(s.q_len > s.kv_len and s.odd for s in shapes)
    assert any((s.q_heads, s.kv_heads) == (4, 2) for s in shapes)
    assert any((s.q_heads, s.kv_heads) == (4, 1) for s in shapes)
    assert {48, 72} <= {s.head_dim for s in shapes}
    assert any(s.q_len == 1 for s in shapes) and any(s.kv_len == 1 for s in shapes)
    assert any(s.dv != s.head_dim for s in shapes)
    assert sum(0 in s.q_lens or 0 in s.kv_lens for s in VARLEN_SHAPES) >= 2
    assert any(q > 0 and k == 0 for s in VARLEN_SHAPES for q, k in zip(s.q_lens, s.kv_lens))
    for s in VARLEN_SHAPES:
        assert s.cu_seqlens_q.dtype == np.int32 and s.cu_seqlens_q[-1] == s.total_q
