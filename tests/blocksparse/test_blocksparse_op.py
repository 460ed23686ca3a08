"""`ejgen.ops.blocksparse_attention` (the seed's signature, layout [B, H, S, D]) against the float64 oracle on
every backend, forward and every gradient: random block layouts with empty query rows and key columns,
segment ids with padding and one-token documents, chunked attention, GQA, sinks, soft cap, bias and its
gradient, a window, Sq != Sk at odd lengths, a dense mask, bf16 / f16 / f32. The reference mask is built
here element by element (layout blocks repeated, ids compared), independently of `BlockMask`."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from ejgen.testing.shapes import AttnShape, random_cotangents, random_qkv, rng_for

pytest.importorskip("triton", reason="the triton extra is part of the test install (README)")


def _layout(rng, batch, heads, n_q, n_k):
    lay = rng.random((batch, heads, n_q, n_k)) < 0.5
    lay[..., 1, :] = False  # a query block that sees nothing
    lay[..., :, 0] = False  # a key block nobody sees
    lay[..., 0, -1] = True
    return lay


def _expand(lay, block_q, block_k, sq, sk):
    return np.repeat(np.repeat(lay, block_q, axis=2), block_k, axis=3)[:, :, :sq, :sk]


def _chunks(ix, options, size):
    return (ix.q_idx + (ix.kv_len - ix.q_len)) // size == ix.kv_idx // size


CASES = {
    # name: (shape, dtype)
    "layout_gqa_sinks": (AttnShape(2, 64, 64, 4, 2, 16), "float32"),
    "segments_chunks_softcap": (AttnShape(1, 64, 64, 2, 2, 16), "bfloat16"),
    "bias_window_odd": (AttnShape(1, 50, 70, 2, 1, 16), "float16"),
    "dense_mask_wide_values": (AttnShape(1, 48, 48, 2, 2, 16, 32), "float32"),
    "positions_out_of_order_window": (AttnShape(2, 48, 48, 4, 2, 16), "float32"),
    "positions_chunked_prefill": (AttnShape(1, 24, 64, 2, 2, 16), "bfloat16"),
}


def _case(name, rng, shape):
    """(op kwargs, traced kwargs, oracle kwargs) of one case."""
    b, sq, sk, hq = shape.batch, shape.q_len, shape.kv_len, shape.q_heads
    if name == "layout_gqa_sinks":
        lay = _layout(rng, 1, hq, 4, 4)
        aux = rng.standard_normal(hq).astype(np.float32)
        return ({}, {"qkv_layouts": jnp.asarray(lay), "softmax_aux": jnp.asarray(aux)},
                dict(causal=True, attention_mask=_expand(lay, 16, 16, sq, sk), softmax_aux=aux))
    if name == "segments_chunks_softcap":
        ids = np.repeat([0, 1, 2, -1], [21, 1, 36, 6])[None].astype(np.int32)
        return ({"chunk_size": 24, "logits_soft_cap": 5.0}, {"q_segment_ids": jnp.asarray(ids)},
                dict(causal=True, logits_soft_cap=5.0, q_segment_ids=ids, kv_segment_ids=ids,
                     mask=functools.partial(_chunks, size=24)))
    if name == "bias_window_odd":
        bias = rng.standard_normal((1, hq, sq, sk)).astype(np.float16)
        lay = _layout(rng, 1, 1, 4, 5)  # 13 x 14 blocks: mask_builder's layout
        builder = lambda q_len, kv_len: jnp.asarray(lay)  # noqa: E731
        return ({"causal": False, "sliding_window": (20, 6), "mask_builder": builder}, {"bias": jnp.asarray(bias)},
                dict(sliding_window=(20, 6), bias=bias, attention_mask=_expand(lay, 13, 14, sq, sk)))
    if name == "positions_out_of_order_window":  # two chunks placed out of order, a different order per row
        pos = np.stack([np.concatenate([np.arange(24) + 100, np.arange(24)]),
                        np.concatenate([np.arange(16) + 30, np.arange(32)])]).astype(np.int32)
        d = pos[:, :, None] - pos[:, None, :]  # q_pos - kv_pos
        return ({"sliding_window": (12, 0)}, {"q_positions": jnp.asarray(pos), "kv_positions": jnp.asarray(pos)},
                dict(attention_mask=(d >= 0) & (d <= 12)))
    if name == "positions_chunked_prefill":  # the last 24 of 64 tokens against all 64, by position
        q_pos = np.arange(40, 64, dtype=np.int32)[None]
        return ({}, {"q_positions": jnp.asarray(q_pos)},
                dict(attention_mask=np.arange(sk)[None, None, :] <= q_pos[:, :, None]))
    dense = rng.random((b, sq, sk)) < 0.6
    lay = _layout(rng, 1, 1, 3, 3)
    return ({"causal": False}, {"attention_mask": jnp.asarray(dense), "qkv_layouts": (jnp.asarray(lay),) * 3},
            dict(attention_mask=dense[:, None] & _expand(lay, 16, 16, sq, sk)))


def _to_bhsd(x):
    return jnp.swapaxes(x, 1, 2)


@pytest.mark.parametrize("platform", ["xla", "pallas", "triton"])
@pytest.mark.parametrize("name", list(CASES))
def test_blocksparse_attention_against_the_oracle(run_vjp, name, platform):
    _check(run_vjp, name, platform)


@pytest.mark.parametrize("name", ["layout_gqa_sinks", "segments_chunks_softcap", "positions_out_of_order_window"])
def test_blocksparse_attention_on_the_tpu_kernels(run_vjp, name):
    """The Pallas TPU kernels (Mosaic, interpreted) on the cases that reach them differently: a layout folded into
    the element mask, chunks as segment ids, positions read per row."""
    from ejgen.runtime.attention.pallas import common

    with common.interpret_kernels("tpu"):
        _check(run_vjp, name, "pallas")


def _check(run_vjp, name, platform):
    from ejgen.ops import blocksparse_attention

    shape, dtype = CASES[name]
    rng = rng_for("blocksparse_op", name)
    qkv = random_qkv(shape, dtype, rng)  # [B, S, H, D]
    d_out, d_lse = random_cotangents(shape, dtype, rng)
    static, traced, ref = _case(name, rng, shape)
    diff = {n: _to_bhsd(x) for n, x in qkv.items()}
    for n in ("bias", "softmax_aux"):
        if n in traced:
            diff[n] = traced.pop(n).astype(dtype if n == "bias" else jnp.float32)
    out, lse, grads = run_vjp(blocksparse_attention, diff, traced, {**static, "platform": platform},
                              _to_bhsd(jnp.asarray(d_out)), d_lse)
    want = oracle.attention(**{n: np.asarray(x) for n, x in qkv.items()}, **ref, d_out=d_out, d_lse=d_lse)
    grads = {n: _to_bhsd(g) if n in qkv else g for n, g in grads.items()}
    seq_diff = {**{n: x for n, x in qkv.items()}, **{n: x for n, x in diff.items() if n not in qkv}}
    oracle.check_attention(_to_bhsd(out), lse, grads, want, seq_diff, dtype)


def test_blocksparse_attention_refuses_what_it_does_not_take():
    from ejgen.ops import blocksparse_attention

    q = jnp.zeros((1, 2, 32, 16), jnp.float32)
    ids = jnp.zeros((1, 32), jnp.int32)
    with pytest.raises(ValueError, match=r"q_positions must be an integer array \[batch\|1, q_len\] = \[1\|1, 32\], "
                                         r"got float32\[1, 32\]"):
        blocksparse_attention(q, q, q, q_positions=ids.astype(jnp.float32), platform="xla")
    with pytest.raises(ValueError, match="qkv_layouts cannot be combined with sequence_parallelism_mesh_axis_name"):
        blocksparse_attention(q, q, q, qkv_layouts=jnp.ones((2, 2), bool), sequence_parallelism_mesh_axis_name="sp")
    with pytest.raises(ValueError, match="axis_name='sp' is not a bound mesh axis"):  # ring attention, outside a map
        blocksparse_attention(q, q, q, sequence_parallelism_mesh_axis_name="sp", platform="xla")
    with pytest.raises(ValueError, match="fused_backward=True: ejgen chooses the backward kernels itself"):
        blocksparse_attention(q, q, q, fused_backward=True, platform="xla")
    with pytest.raises(ValueError, match="a 12 x 12 layout does not tile 32 x 32 in equal blocks"):
        blocksparse_attention(q, q, q, qkv_layouts=jnp.ones((12, 12), bool), platform="xla")
    with pytest.raises(ValueError, match="pass one layout \\(or the same one three times\\)"):
        blocksparse_attention(q, q, q, qkv_layouts=(jnp.ones((2, 2), bool), jnp.eye(2, dtype=bool)), platform="xla")
    with pytest.raises(ValueError, match="either as arguments or in mask_info, not both"):
        from ejgen.types import MaskInfo
        blocksparse_attention(q, q, q, q_segment_ids=ids, mask_info=MaskInfo.from_segments(ids), platform="xla")
    with pytest.raises(ValueError, match=r"query must be \[batch, heads, seq, head_dim\]"):
        from ejgen.generated import blocksparse_attention as spec_op
        spec_op(q[0], q[0], q[0], platform="xla")
