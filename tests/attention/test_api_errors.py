"""Bad runtime input gives one clear error naming the argument (docs/DESIGN.md §7): ValueError for a bad
value or shape, TypeError naming the spec for an argument a variant does not accept, and for a
missing required param."""

from __future__ import annotations

import importlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

B, SQ, SK, HQ, HKV, D = 2, 9, 11, 4, 2, 8


def _flash_attention():
    from ejgen.ops import flash_attention

    return flash_attention


def _variant(name: str):
    return getattr(importlib.import_module("ejgen.generated"), name)


def _mask_info():
    from ejgen.types import MaskInfo

    return MaskInfo


def _arr(*shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(len(shape)).standard_normal(shape), dtype)


def _qkv():
    return _arr(B, SQ, HQ, D), _arr(B, SK, HKV, D), _arr(B, SK, HKV, D)


def _varlen_qkv():
    return _arr(10, HQ, D), _arr(12, HKV, D), _arr(12, HKV, D)


CU_Q = jnp.asarray([0, 4, 10], jnp.int32)
CU_K = jnp.asarray([0, 7, 12], jnp.int32)


def _names_all(exc_info, *names):
    message = str(exc_info.value)
    for name in names:
        assert re.search(rf"\b{re.escape(name)}\b", message), f"{name!r} not in: {message}"


def _bad_inputs():
    """(id, arguments to replace or add, a word the message must contain)."""
    q, k, v = _qkv()
    MaskInfo = _mask_info()
    return {
        "query-rank": (dict(query=q[0]), "query"),
        "key-rank": (dict(key=k[..., None]), "key"),
        "value-rank": (dict(value=v[0]), "value"),
        "heads-not-divisible": (dict(key=_arr(B, SK, 3, D), value=_arr(B, SK, 3, D)), "key"),
        "head-dim-q-vs-k": (dict(key=_arr(B, SK, HKV, D + 1)), "key"),
        "value-vs-key-length": (dict(value=_arr(B, SK + 1, HKV, D)), "value"),
        "value-vs-key-heads": (dict(value=_arr(B, SK, HKV * 2, D)), "value"),
        "int-query": (dict(query=jnp.ones((B, SQ, HQ, D), jnp.int32)), "query"),
        "batch-mismatch": (dict(key=_arr(B + 1, SK, HKV, D), value=_arr(B + 1, SK, HKV, D)), "key"),
        "softmax_aux-rank": (dict(softmax_aux=_arr(HQ, 2, 1)), "softmax_aux"),
        "softmax_aux-heads": (dict(softmax_aux=_arr(HQ + 1, 2)), "softmax_aux"),
        "bias-rank": (dict(bias=_arr(SQ, SK)), "bias"),
        "bias-kv-len": (dict(bias=_arr(B, HQ, SQ, SK + 1)), "bias"),
        "bias-heads": (dict(bias=_arr(1, HQ + 1, SQ, SK)), "bias"),
        "bias-batch": (dict(bias=_arr(B + 1, 1, SQ, SK)), "bias"),
        "segment-ids-q-len": (
            dict(mask_info=lambda: MaskInfo.from_segments(
                jnp.zeros((B, SQ + 1), jnp.int32), jnp.zeros((B, SK), jnp.int32))),
            "segment",
        ),
        "segment-ids-kv-len": (
            dict(mask_info=lambda: MaskInfo.from_segments(
                jnp.zeros((B, SQ), jnp.int32), jnp.zeros((B, SK - 1), jnp.int32))),
            "segment",
        ),
        "segment-ids-default-kv-with-sq-ne-sk": (
            dict(mask_info=lambda: MaskInfo.from_segments(jnp.zeros((B, SQ), jnp.int32))),
            "segment",
        ),
        "attention-mask-shape": (
            dict(mask_info=lambda: MaskInfo.from_attention_mask(jnp.ones((B, SQ, SK + 2), bool))),
            "mask",
        ),
        "platform-unknown": (dict(platform="no_such_backend"), "platform"),
    }


BAD_INPUT_IDS = [
    "query-rank", "key-rank", "value-rank", "heads-not-divisible", "head-dim-q-vs-k",
    "value-vs-key-length", "value-vs-key-heads", "int-query", "batch-mismatch",
    "softmax_aux-rank", "softmax_aux-heads", "bias-rank", "bias-kv-len", "bias-heads",
    "bias-batch", "segment-ids-q-len", "segment-ids-kv-len",
    "segment-ids-default-kv-with-sq-ne-sk", "attention-mask-shape", "platform-unknown",
]


@pytest.mark.parametrize("case", BAD_INPUT_IDS)
def test_bad_input_raises_value_error_naming_the_argument(case):
    op = _flash_attention()
    q, k, v = _qkv()
    args, word = _bad_inputs()[case]
    kwargs = dict(query=q, key=k, value=v)
    with pytest.raises(ValueError, match=rf"(?i){re.escape(word)}") as info:
        # The MaskInfo is built inside: a constructor that checks shapes may raise as well.
        kwargs.update({n: a() if callable(a) else a for n, a in args.items()})
        op(kwargs.pop("query"), kwargs.pop("key"), kwargs.pop("value"), **kwargs)
    if case == "platform-unknown":
        assert "xla" in str(info.value), "the error must say which platforms are available"


def test_bad_input_ids_match_the_table():
    assert set(BAD_INPUT_IDS) == set(_bad_inputs())


VARLEN_BAD = {
    "cu_seqlens_q-without-max_seqlen_q": (dict(max_seqlen_q=None), "max_seqlen_q"),
    "cu_seqlens_k-without-max_seqlen_k": (dict(max_seqlen_k=None), "max_seqlen_k"),
    "cu_seqlens_q-without-cu_seqlens_k": (dict(cu_seqlens_k=None), "cu_seqlens_k"),
    "cu_seqlens_q-float": (dict(cu_seqlens_q=CU_Q.astype(jnp.float32)), "cu_seqlens_q"),
    "cu_seqlens_k-rank": (dict(cu_seqlens_k=CU_K[None]), "cu_seqlens_k"),
    "cu_seqlens-count-mismatch": (dict(cu_seqlens_k=jnp.asarray([0, 12], jnp.int32)), "cu_seqlens"),
    "varlen-query-rank": (dict(query=_arr(1, 10, HQ, D)), "query"),
}


@pytest.mark.parametrize("case", VARLEN_BAD.values(), ids=VARLEN_BAD.keys())
def test_bad_varlen_input_raises_value_error(case):
    op = _flash_attention()
    q, k, v = _varlen_qkv()
    args, word = case
    kwargs = dict(
        query=q, key=k, value=v, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, max_seqlen_q=6,
        max_seqlen_k=7,
    )
    kwargs.update(args)
    with pytest.raises(ValueError, match=re.escape(word)):
        op(kwargs.pop("query"), kwargs.pop("key"), kwargs.pop("value"), **kwargs)


def _variant_args(name):
    q, k, v = _qkv()
    params = {
        "alibi_attention": {"slopes": _arr(HQ)},
        "relative_bias_attention": {"rel_table": _arr(HQ, 33)},
        "local_softcap_sinks_attention": {"softmax_aux": _arr(HQ)},
        "prefix_lm_attention": {},
    }[name]
    return (q, k, v), params


UNSUPPORTED = {
    "alibi-bias": ("alibi_attention", "bias", lambda: _arr(1, HQ, SQ, SK)),
    "alibi-softmax_aux": ("alibi_attention", "softmax_aux", lambda: _arr(HQ)),
    "alibi-sliding_window": ("alibi_attention", "sliding_window", lambda: 4),
    "alibi-logits_soft_cap": ("alibi_attention", "logits_soft_cap", lambda: 5.0),
    "alibi-cu_seqlens_q": ("alibi_attention", "cu_seqlens_q", lambda: CU_Q),
    "local-causal": ("local_softcap_sinks_attention", "causal", lambda: True),
    "local-sliding_window": ("local_softcap_sinks_attention", "sliding_window", lambda: 8),
    "local-logits_soft_cap": ("local_softcap_sinks_attention", "logits_soft_cap", lambda: 5.0),
    "local-mask_info": (
        "local_softcap_sinks_attention", "mask_info",
        lambda: _mask_info().from_segments(
            jnp.zeros((B, SQ), jnp.int32), jnp.zeros((B, SK), jnp.int32)
        ),
    ),
    "prefix_lm-causal": ("prefix_lm_attention", "causal", lambda: True),
    "prefix_lm-bias": ("prefix_lm_attention", "bias", lambda: _arr(1, HQ, SQ, SK)),
    "relative_bias-softmax_aux": ("relative_bias_attention", "softmax_aux", lambda: _arr(HQ)),
    "relative_bias-sliding_window": ("relative_bias_attention", "sliding_window", lambda: (4, 0)),
    "relative_bias-slopes": ("relative_bias_attention", "slopes", lambda: _arr(HQ)),
    "alibi-prefix_len": ("alibi_attention", "prefix_len", lambda: 3),
}


@pytest.mark.parametrize("case", UNSUPPORTED.values(), ids=UNSUPPORTED.keys())
def test_variant_rejects_an_argument_its_spec_lacks(case):
    name, arg, value = case
    op = _variant(name)
    (q, k, v), params = _variant_args(name)
    with pytest.raises(TypeError) as info:
        op(q, k, v, **params, **{arg: value()})
    _names_all(info, name, arg)


def test_flash_attention_rejects_a_variant_param():
    q, k, v = _qkv()
    with pytest.raises(TypeError) as info:
        _flash_attention()(q, k, v, slopes=_arr(HQ))
    _names_all(info, "flash_attention", "slopes")


MISSING = {
    "alibi-slopes": ("alibi_attention", "slopes"),
    "relative_bias-rel_table": ("relative_bias_attention", "rel_table"),
    "local-softmax_aux": ("local_softcap_sinks_attention", "softmax_aux"),
}


@pytest.mark.parametrize("case", MISSING.values(), ids=MISSING.keys())
def test_variant_requires_its_params(case):
    name, arg = case
    op = _variant(name)
    (q, k, v), params = _variant_args(name)
    del params[arg]
    with pytest.raises(TypeError) as info:
        op(q, k, v, **params)
    _names_all(info, arg)


WRONG_PARAM = {
    "alibi-slopes-len": ("alibi_attention", "slopes", lambda: _arr(HQ + 1)),
    "alibi-slopes-rank": ("alibi_attention", "slopes", lambda: _arr(HQ, 1)),
    "relative_bias-rel_table-cols": ("relative_bias_attention", "rel_table", lambda: _arr(HQ, 32)),
    "relative_bias-rel_table-heads": (
        "relative_bias_attention", "rel_table", lambda: _arr(HKV, 33)
    ),
    "local-softmax_aux-heads": (
        "local_softcap_sinks_attention", "softmax_aux", lambda: _arr(HQ + 1, 2)
    ),
}


@pytest.mark.parametrize("case", WRONG_PARAM.values(), ids=WRONG_PARAM.keys())
def test_variant_param_of_wrong_shape(case):
    name, arg, value = case
    op = _variant(name)
    (q, k, v), params = _variant_args(name)
    params[arg] = value()
    with pytest.raises(ValueError, match=re.escape(arg)):
        op(q, k, v, **params)


@pytest.mark.parametrize(
    "cu, longest, match",
    [
        ([0, 4, 10], 5, "max_seqlen_q=5 is shorter than a sequence of cu_seqlens_q"),
        ([0, 5, 4], 9, "cu_seqlens_q must start at 0, never decrease"),
        ([1, 4, 10], 9, "cu_seqlens_q must start at 0"),
        ([0, 4, 11], 9, "end at most at the 10 tokens"),
    ],
    ids=["max-too-short", "decreasing", "not-from-zero", "past-the-tokens"],
)
def test_concrete_cu_seqlens_are_checked(cu, longest, match):
    """Outside jit the offsets are concrete: the op checks them against the tokens and max_seqlen."""
    from ejgen.ops import flash_attention

    q = jnp.ones((10, 2, 16), jnp.float32)
    cu = jnp.asarray(cu, jnp.int32)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=jnp.asarray([0, 4, 10], jnp.int32),
                        max_seqlen_q=longest, max_seqlen_k=10, platform="xla")


def _segments_info():
    return _mask_info().from_segments(jnp.zeros((1, 10), jnp.int32), jnp.zeros((1, 12), jnp.int32))


# id -> (arguments to replace or add, the argument the message must name); each raises one ValueError.
FEATURE_ARGUMENTS = {
    "sliding_window-negative": (dict(sliding_window=-1), "sliding_window"),
    "sliding_window-negative-side": (dict(sliding_window=(4, -1)), "sliding_window"),
    "sliding_window-one-side": (dict(sliding_window=(4,)), "sliding_window"),
    "sliding_window-three-sides": (dict(sliding_window=(4, 0, 2)), "sliding_window"),
    "sliding_window-float": (dict(sliding_window=4.0), "sliding_window"),
    "sliding_window-float-side": (dict(sliding_window=(4, 2.5)), "sliding_window"),
    "sliding_window-bool": (dict(sliding_window=True), "sliding_window"),
    "sliding_window-bool-side": (dict(sliding_window=(True, 0)), "sliding_window"),
    "logits_soft_cap-zero": (dict(logits_soft_cap=0), "logits_soft_cap"),
    "logits_soft_cap-negative": (dict(logits_soft_cap=-30.0), "logits_soft_cap"),
    "logits_soft_cap-negative-array": (dict(logits_soft_cap=jnp.float32(-30.0)), "logits_soft_cap"),
    "logits_soft_cap-inf": (dict(logits_soft_cap=float("inf")), "logits_soft_cap"),
    "logits_soft_cap-nan": (dict(logits_soft_cap=float("nan")), "logits_soft_cap"),
    "logits_soft_cap-vector": (dict(logits_soft_cap=jnp.ones(2)), "logits_soft_cap"),
    "causal-int": (dict(causal=1), "causal"),
    "causal-str": (dict(causal="yes"), "causal"),
    "causal-array": (dict(causal=jnp.asarray(True)), "causal"),
    "deterministic-int": (dict(deterministic=1), "deterministic"),
    "deterministic-str": (dict(deterministic="yes"), "deterministic"),
    "softmax_scale-vector": (dict(softmax_scale=jnp.ones(2)), "softmax_scale"),
    "softmax_scale-str": (dict(softmax_scale="0.1"), "softmax_scale"),
    "key-dtype": (dict(key=_arr(B, SK, HKV, D, dtype=jnp.bfloat16)), "key"),  # "... must share a dtype"
    "value-dtype": (dict(value=_arr(B, SK, HKV, D, dtype=jnp.float16)), "value"),
}


@pytest.mark.parametrize("case", FEATURE_ARGUMENTS.values(), ids=FEATURE_ARGUMENTS.keys())
def test_bad_feature_argument_raises_value_error_naming_it(case):
    args, name = case
    q, k, v = _qkv()
    kwargs = dict(query=q, key=k, value=v, platform="xla")
    kwargs.update(args)
    with pytest.raises(ValueError, match=rf"\b{re.escape(name)}\b"):
        _flash_attention()(kwargs.pop("query"), kwargs.pop("key"), kwargs.pop("value"), **kwargs)


# With cu_seqlens (varlen): what varlen excludes.
VARLEN_EXCLUDES = {
    "mask_info-with-cu_seqlens": (dict(mask_info=_segments_info), "mask_info"),
    "bias-with-cu_seqlens": (dict(bias=lambda: _arr(1, HQ, 10, 12)), "bias"),
}


@pytest.mark.parametrize("case", VARLEN_EXCLUDES.values(), ids=VARLEN_EXCLUDES.keys())
def test_varlen_rejects_what_it_excludes(case):
    args, name = case
    q, k, v = _varlen_qkv()
    kwargs = dict(cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, max_seqlen_q=6, max_seqlen_k=7, platform="xla")
    kwargs.update({n: a() for n, a in args.items()})
    with pytest.raises(ValueError, match=rf"\b{re.escape(name)}\b.*cu_seqlens") as info:
        _flash_attention()(q, k, v, **kwargs)
    assert "cannot be combined" in str(info.value)


# A spec option: (variant, option, bad value, what the message says about it).
BAD_OPTIONS = {
    "int-option-python-float": ("alibi_attention", "max_distance", lambda: 2.5, "must be an int"),
    "int-option-float-array": ("alibi_attention", "max_distance", lambda: jnp.float32(2.0), "must be an int"),
    "int-option-bool": ("alibi_attention", "max_distance", lambda: True, "must be an int"),
    "int-option-str": ("alibi_attention", "max_distance", lambda: "8", "must be an int"),
    "int-option-vector": ("alibi_attention", "max_distance", lambda: jnp.ones(3, jnp.int32), "must be a scalar"),
    "int-option-past-int32": ("alibi_attention", "max_distance", lambda: 2**31, "does not fit int32"),
    "int-option-rank-1": ("prefix_lm_attention", "prefix_len", lambda: jnp.ones((1,), jnp.int32), "must be a scalar"),
    "float-option-bool": ("relative_bias_attention", "bias_scale", lambda: True, "must be a float"),
    "float-option-str": ("relative_bias_attention", "bias_scale", lambda: "0.5", "must be a float"),
    "float-option-matrix": ("relative_bias_attention", "bias_scale", lambda: jnp.ones((2, 2)), "must be a scalar"),
}


@pytest.mark.parametrize("case", BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_bad_option_raises_value_error_naming_it(case):
    name, option, value, says = case
    (q, k, v), params = _variant_args(name)
    with pytest.raises(ValueError, match=rf"option {re.escape(option)} {says}"):
        _variant(name)(q, k, v, **params, **{option: value()}, platform="xla")


@pytest.mark.parametrize(
    "name, option, value",
    [("alibi_attention", "max_distance", np.int64(8)), ("alibi_attention", "max_distance", jnp.int32(8)),
     ("relative_bias_attention", "bias_scale", 2), ("relative_bias_attention", "bias_scale", jnp.float32(0.5))],
    ids=["int-option-numpy-int", "int-option-int-array", "float-option-python-int", "float-option-array"],
)
def test_good_option_values_are_taken(name, option, value):
    """The checks above reject only what is wrong: integer types for an int option, any real for a
    float option."""
    (q, k, v), params = _variant_args(name)
    out = _variant(name)(q, k, v, **params, **{option: value}, platform="xla")
    assert out.shape == q.shape and np.isfinite(np.asarray(out)).all()


def test_concrete_soft_cap_array_is_checked_and_a_traced_one_taken():
    """A positive 0-d array works eagerly and under jit (where its value is unknown)."""
    import jax

    q, k, v = _qkv()
    op = _flash_attention()
    eager = op(q, k, v, logits_soft_cap=jnp.float32(5.0), platform="xla")
    traced = jax.jit(lambda cap: op(q, k, v, logits_soft_cap=cap, platform="xla"))(jnp.float32(5.0))
    np.testing.assert_allclose(np.asarray(eager), np.asarray(traced), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_return_lse_must_be_a_bool(value):
    from ejgen.ops import flash_attention

    q = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(ValueError, match=r"flash_attention\(\): return_lse must be a Python bool"):
        flash_attention(q, q, q, return_lse=value)


def test_numpy_integer_windows_are_windows():
    """A window computed with NumPy (np.int64) is an int like any other."""
    from ejgen.ops import flash_attention

    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 12, 2, 16)), jnp.float32)
    ref = flash_attention(q, q, q, sliding_window=(3, 2), platform="xla")
    for window in (np.int64(3), (np.int64(3), np.int32(2))):
        out = flash_attention(q, q, q, sliding_window=window, platform="xla")
        expected = ref if isinstance(window, tuple) else flash_attention(q, q, q, sliding_window=3, platform="xla")
        assert np.array_equal(np.asarray(out), np.asarray(expected))
    with pytest.raises(ValueError, match="sliding_window must be a non-negative int"):
        flash_attention(q, q, q, sliding_window=np.bool_(True))
