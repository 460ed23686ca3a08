"""Bad calls of the recurrent ops: one clear error naming the argument (docs/DESIGN.md §7, bad input), raised before
any kernel is traced; and the spec side: the ops' signatures (the seed's order), what `ejgen show` says."""

from __future__ import annotations

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recurrent_cases import built_ops
from conftest import on_path
from ejgen.generated import gla, lightning_attention, linear_attention, recurrent, simple_gla

Q = jnp.zeros((2, 5, 4, 8), jnp.float32)
KV = jnp.zeros((2, 5, 2, 8), jnp.float32)
V6 = jnp.zeros((2, 5, 4, 6), jnp.float32)
GK = jnp.zeros((2, 5, 4, 8), jnp.float32)
PACKED = jnp.zeros((1, 7, 4, 8), jnp.float32)
CU = jnp.asarray([0, 3, 7], jnp.int32)

BAD_CALLS = [
    ("rank", lambda: recurrent(Q[0], Q[0], Q[0]), ValueError,
     "query must be [batch, seq_len, heads, head_dim], got float32[5, 4, 8]"),
    ("dtype", lambda: recurrent(Q.astype(jnp.int32), Q, Q), ValueError,
     "query must be float32, bfloat16 or float16, got int32[2, 5, 4, 8]"),
    ("mixed-dtypes", lambda: recurrent(Q, Q.astype(jnp.bfloat16), Q), ValueError,
     "query, key and value must share one dtype"),
    ("not-array", lambda: recurrent([[1.0]], Q, Q), ValueError, "query must be an array, got list"),
    ("key-shape", lambda: recurrent(Q, Q[:, :4], Q), ValueError,
     "key must be [batch, seq_len, kv_heads, K] and value [batch, seq_len, kv_heads, V]"),
    ("heads", lambda: recurrent(Q, Q[:, :, :3], Q[:, :, :3]), ValueError,
     "query's 4 heads must be a multiple of key and value's 3"),
    ("gate-shape", lambda: recurrent(Q, Q, V6, gv=GK), ValueError,
     "gv must be float [batch, seq_len, heads, V] = [2, 5, 4, 6] (log space), got float32[2, 5, 4, 8]"),
    ("g-shape", lambda: recurrent(Q, Q, Q, g=GK), ValueError, "g must be float [batch, seq_len, heads] = [2, 5, 4]"),
    ("g-gamma-shape", lambda: recurrent(Q, Q, Q, g_gamma=jnp.zeros((2,))), ValueError,
     "g_gamma must be float [heads] = [4]"),
    ("gate-dtype", lambda: recurrent(Q, Q, Q, gk=GK.astype(jnp.int32)), ValueError, "gk must be float"),
    ("required-gate", lambda: gla(Q, Q, Q), TypeError,
     "gla() needs gk: the spec compiles gate 'gk' in (always; specs/gla.yaml)"),
    ("absent-gate", lambda: gla(Q, Q, Q, GK, g=Q[..., 0]), TypeError,
     "gla() got an unsupported argument 'g': the spec does not enable feature 'g' (specs/gla.yaml)"),
    ("unknown", lambda: recurrent(Q, Q, Q, causal=True), TypeError,
     "got an unsupported argument 'causal': it is not an argument of a recurrent op"),
    ("h0-shape", lambda: recurrent(Q, Q, Q, initial_state=jnp.zeros((2, 4, 8, 6))), ValueError,
     "initial_state must be float [batch, heads, K, V] = [2, 4, 8, 8], got float32[2, 4, 8, 6]"),
    ("h0-packed", lambda: recurrent(PACKED, PACKED, PACKED, initial_state=jnp.zeros((1, 4, 8, 8)), cu_seqlens=CU),
     ValueError, "initial_state must be float [sequences, heads, K, V] = [2, 4, 8, 8]"),
    ("packed-batch", lambda: recurrent(Q, Q, Q, cu_seqlens=CU), ValueError,
     "with cu_seqlens, query, key and value are packed sequences [1, total_tokens, heads, head_dim]"),
    ("cu-dtype", lambda: recurrent(PACKED, PACKED, PACKED, cu_seqlens=CU.astype(jnp.float32)), ValueError,
     "cu_seqlens must be int32 [num_seqs + 1] (at least 2 entries), got float32[3]"),
    ("cu-values", lambda: recurrent(PACKED, PACKED, PACKED, cu_seqlens=jnp.asarray([0, 5, 3], jnp.int32)), ValueError,
     "cu_seqlens must start at 0, never decrease and end at most at the 7 tokens of query, got [0, 5, 3]"),
    ("scale", lambda: recurrent(Q, Q, Q, softmax_scale=jnp.float32(2.0)), ValueError,
     "softmax_scale must be None or a Python number, got ArrayImpl"),
    ("reverse", lambda: recurrent(Q, Q, Q, reverse=1), ValueError, "reverse must be a Python bool, got int"),
    ("algorithm", lambda: recurrent(Q, Q, Q, algorithm="parallel"), ValueError,
     "algorithm must be one of auto, chunked, fused, got 'parallel'"),
    ("chunk", lambda: recurrent(Q, Q, Q, chunk_size=48), ValueError,
     "chunk_size must be None or one of 16, 32, 64, 128 (steps of a chunk of the chunked algorithm), got 48"),
    ("chunk-bool", lambda: recurrent(Q, Q, Q, chunk_size=True), ValueError, "got True"),
    ("platform", lambda: recurrent(Q, Q, Q, platform="cuda"), ValueError,
     "platform must be one of auto, triton, pallas, xla"),
]


@pytest.mark.parametrize("call,error,message", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_call(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()


@pytest.fixture(scope="module")
def hooked(tmp_path_factory):
    root = tmp_path_factory.mktemp("recurrent_errors")
    with on_path(root):
        yield built_ops(root).hooked


def test_a_spec_without_gqa_or_varlen_refuses_them(hooked):
    gk = jnp.zeros((2, 5, 4, 8))
    with pytest.raises(ValueError, match=re.escape("key and value have 2 heads, query 4: sharing key/value heads "
                                                   "needs feature 'gqa'")):
        hooked(Q, KV, KV, gk=gk)
    with pytest.raises(TypeError, match=re.escape("hooked() got an unsupported argument 'cu_seqlens': the spec does "
                                                  "not enable feature 'varlen'")):
        hooked(Q, Q, Q, gk=gk, cu_seqlens=CU)


def test_cu_seqlens_is_checked_where_it_is_concrete_only():
    """Under jit cu_seqlens is a tracer: the shape and dtype are checked, the values cannot be."""
    f = jax.jit(lambda q, cu: recurrent(q, q, q, cu_seqlens=cu, platform="xla")[0])
    assert f(PACKED, CU).shape == PACKED.shape
    with pytest.raises(ValueError, match="cu_seqlens must be int32"):
        f(PACKED, CU.astype(jnp.int16))


def test_signatures_are_the_seeds():
    """recurrent(query, key, value, g=None, g_gamma=None, gk=None, gv=None, softmax_scale=None, initial_state=None,
    reverse=False, cu_seqlens=None), positional or keyword; the call's choices keyword-only; a spec's op takes the
    seed's arguments it enables, in the seed's order."""
    params = inspect.signature(recurrent).parameters
    seed = [("g", None), ("g_gamma", None), ("gk", None), ("gv", None), ("softmax_scale", None),
            ("initial_state", None), ("reverse", False), ("cu_seqlens", None)]
    assert [(n, p.default) for n, p in params.items()][3:11] == seed
    assert all(params[n].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for n, _ in seed)
    for name in ("algorithm", "chunk_size", "platform"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert list(inspect.signature(gla).parameters)[3:5] == ["gk", "softmax_scale"]
    assert list(inspect.signature(simple_gla).parameters)[3:6] == ["g", "g_gamma", "softmax_scale"]
    assert list(inspect.signature(lightning_attention).parameters)[3:5] == ["g_gamma", "softmax_scale"]
    assert list(inspect.signature(linear_attention).parameters)[3] == "softmax_scale"
    o, final = gla(Q, Q, Q, GK - 1.0, 0.5, jnp.ones((2, 4, 8, 8)), True, platform="xla")
    assert o.shape == (2, 5, 4, 8) and final.shape == (2, 4, 8, 8)


def test_show_describes_the_recurrent_spec(capsys):
    from ejgen.cli import main

    assert main(["show", "specs/linear_attention.yaml"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("linear_attention (linear_recurrent; modes train, decode; backends ")
    assert "S_t = S_(t-1) + phi(k_t)ᵀ v_t;  o_t = scale phi(q_t) S_t" in out
    assert "phi(x) = elu(x) + 1;  phi'(x) = " in out


def test_the_ops_are_exported():
    import ejgen.ops

    assert ejgen.ops.recurrent is recurrent
    np.testing.assert_array_equal(recurrent(Q, Q, Q, platform="xla")[1], np.zeros((2, 4, 8, 8)))


def test_a_grid_cuda_cannot_launch_is_one_clear_error():
    """Grids past CUDA's limits (65535 programs along axes 1 and 2) are refused before the launch, naming the
    kernel and the axis; the recurrent kernels put sequence x head on axis 0, so a decode step of 4096 sequences x
    32 heads launches (it needed 131072 programs along axis 1 before)."""
    import jax
    import jax.numpy as jnp

    from ejgen.runtime.launch import triton_call

    def fake_kernel():
        pass

    with pytest.raises(ValueError, match=r"fake_kernel: grid \(1, 65536\) has 65536 programs along axis 1"):
        triton_call.launch(fake_kernel, (1, 65536), [], [jax.ShapeDtypeStruct((1,), jnp.float32)])
    seen = []
    real = triton_call.launch

    def spy(kernel, grid, *a, **kw):
        seen.append((kernel.__name__, grid))
        triton_call._check_grid(kernel, grid)
        raise StopIteration

    from ejgen import generated
    q = jnp.zeros((4096, 1, 32, 16), jnp.float32)
    h0 = jnp.zeros((4096, 32, 16, 16), jnp.float32)
    triton_call.launch = spy
    try:
        with pytest.raises(StopIteration):
            generated.gla(q, q, q, gk=jnp.zeros_like(q), initial_state=h0, algorithm="fused", platform="triton")
    finally:
        triton_call.launch = real
    assert seen[0][0].endswith("fused_fwd_kernel") and seen[0][1][0] == 4096 * 32, seen


def test_chunked_tiles_are_blocks_of_the_head_dims(monkeypatch):
    """Every chunked kernel takes the head dim it sums over in a loop of blocks (the intra-chunk matrices too, since
    chunk_intra became a program per chunk), so a block narrower than the head dim is a launch setting, never a wrong
    result; blocks are 0 (the head dim whole, padded) or powers of two >= 16."""
    from ejgen.runtime.recurrent.triton import host

    for which in ("chunk_intra", "chunk_output", "chunk_grads_qk", "chunk_grads_v"):
        monkeypatch.setitem(host.CHUNKED, which, host.Tiles(16, 32))
        assert host.tiles(which, 48, 80)[0] == {"BK": 16, "BV": 32}
    monkeypatch.setitem(host.CHUNKED, "chunk_grads_qk", host.Tiles(16, 0))
    assert host.tiles("chunk_grads_qk", 48, 80)[0] == {"BK": 16, "BV": 128}
    for bad in (8, 24, -16):
        with pytest.raises(ValueError, match=f"Tiles.block_v must be 0 .* or a power of two >= 16, got {bad}"):
            host.Tiles(0, bad)
