"""Bad calls of the pooling ops: one clear error naming the argument (docs/DESIGN.md §7, bad input), raised before
any kernel is traced; and the spec side: what `ejgen show` says of a pooling spec, the op's signature."""

from __future__ import annotations

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejgen.generated import last_token_pooling, max_pooling, mean_pooling, weighted_mean_pooling

X = jnp.zeros((2, 5, 8), jnp.float32)
PACKED = jnp.zeros((7, 8), jnp.float32)
CU = jnp.asarray([0, 3, 7], jnp.int32)

BAD_CALLS = [
    ("rank", lambda: mean_pooling(jnp.zeros((5, 8))), ValueError,
     "x must be [batch, seq_len, dim] (packed [total_tokens"),
    ("rank-packed", lambda: mean_pooling(X, cu_seqlens=CU), ValueError,
     "with cu_seqlens, x must be packed tokens [total_tokens, dim], got float32[2, 5, 8]"),
    ("dtype", lambda: mean_pooling(X.astype(jnp.int32)), ValueError, "x must be float32, bfloat16 or float16"),
    ("not-array", lambda: mean_pooling([[1.0]]), ValueError, "x must be an array, got list"),
    ("cu-dtype", lambda: mean_pooling(PACKED, cu_seqlens=CU.astype(jnp.float32)), ValueError,
     "cu_seqlens must be int32 [num_seqs + 1] (at least 2 entries), got float32[3]"),
    ("cu-shape", lambda: mean_pooling(PACKED, cu_seqlens=CU[None]), ValueError,
     "cu_seqlens must be int32 [num_seqs + 1]"),
    ("cu-short", lambda: mean_pooling(PACKED, cu_seqlens=CU[:1]), ValueError, "cu_seqlens must be int32"),
    ("cu-values", lambda: mean_pooling(PACKED, cu_seqlens=jnp.asarray([0, 5, 3], jnp.int32)), ValueError,
     "cu_seqlens must start at 0, never decrease and end at most at the 7 tokens of x, got [0, 5, 3]"),
    ("cu-past-end", lambda: mean_pooling(PACKED, cu_seqlens=jnp.asarray([0, 9], jnp.int32)), ValueError,
     "end at most at the 7 tokens of x"),
    ("chunk-zero", lambda: mean_pooling(X, 0), ValueError,
     "chunk_size must be a Python int, a power of two from 1 to 512"),
    ("chunk-odd", lambda: mean_pooling(X, chunk_size=48), ValueError, "got 48"),
    ("chunk-big", lambda: mean_pooling(X, 1024), ValueError, "got 1024"),
    ("chunk-bool", lambda: mean_pooling(X, True), ValueError, "got True"),
    ("chunk-float", lambda: mean_pooling(X, 32.0), ValueError, "got 32.0"),
    ("weights-shape", lambda: weighted_mean_pooling(X, weights=jnp.ones((2, 4))), ValueError,
     "weights must be float [batch, seq_len] = [2, 5], got float32[2, 4]"),
    ("weights-dtype", lambda: weighted_mean_pooling(X, weights=jnp.ones((2, 5), jnp.int32)), ValueError,
     "weights must be float"),
    ("mask-dtype", lambda: weighted_mean_pooling(X, mask=jnp.ones((2, 5), jnp.int32)), ValueError,
     "mask must be bool [batch, seq_len] = [2, 5], got int32[2, 5]"),
    ("mask-packed", lambda: max_pooling(PACKED, cu_seqlens=CU, mask=jnp.ones((2, 5), bool)), ValueError,
     "mask must be bool [total_tokens] = [7]"),
    ("absent-feature", lambda: mean_pooling(X, weights=jnp.ones((2, 5))), TypeError,
     "mean_pooling() got an unsupported argument 'weights': the spec does not enable feature 'weights' "
     "(specs/mean_pooling.yaml)"),
    ("unknown", lambda: last_token_pooling(X, causal=True), TypeError,
     "got an unsupported argument 'causal': it is not an argument of a pooling op"),
    ("platform", lambda: mean_pooling(X, platform="cuda"), ValueError,
     "platform must be one of auto, triton, pallas, xla"),
]


@pytest.mark.parametrize("call,error,message", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_call(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()


def test_cu_seqlens_is_checked_where_it_is_concrete_only():
    """Under jit cu_seqlens is a tracer: the shape and dtype are checked, the values cannot be."""
    f = jax.jit(lambda x, cu: mean_pooling(x, cu_seqlens=cu, platform="xla"))
    np.testing.assert_allclose(f(PACKED + 1.0, CU), np.ones((2, 8)))
    with pytest.raises(ValueError, match="cu_seqlens must be int32"):
        f(PACKED, CU.astype(jnp.int16))


def test_signature_is_the_seeds():
    """mean_pooling(x, chunk_size=32, cu_seqlens=None), as ejkernel's; the features' tensors keyword-only."""
    params = inspect.signature(mean_pooling).parameters
    assert [(n, p.default) for n, p in params.items()][:3] == [("x", inspect.Parameter.empty), ("chunk_size", 32),
                                                               ("cu_seqlens", None)]
    assert params["platform"].kind is inspect.Parameter.KEYWORD_ONLY
    weighted = inspect.signature(weighted_mean_pooling).parameters
    assert weighted["weights"].kind is weighted["mask"].kind is inspect.Parameter.KEYWORD_ONLY
    np.testing.assert_allclose(mean_pooling(PACKED + 2.0, 16, CU, platform="xla"), np.full((2, 8), 2.0))


def test_show_describes_the_pooling_spec(capsys):
    from ejgen.cli import main

    assert main(["show", "specs/weighted_mean_pooling.yaml"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("weighted_mean_pooling (pooling; reduction mean; backends triton, pallas, xla)")
    assert "y[n] = sum_t w_t x_t / sum_t w_t" in out and "dw_t = <dy[n], x_t - y[n]> / sum w" in out


def test_explain_names_the_kernel_set():
    from ejgen.ops import explain

    choice = explain(mean_pooling, jax.ShapeDtypeStruct((4, 64, 32), jnp.bfloat16), target="sm90")
    assert (choice.platform, choice.forward, choice.backward, choice.deterministic) == ("triton", "triton", "triton",
                                                                                        True)
