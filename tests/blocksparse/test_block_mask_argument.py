"""`block_mask=` on the generated ops (docs/DESIGN.md §3, block masks): every kind of condition a `BlockMask`
holds reaches every backend, forward and backward, and the result is attention under the mask's own element
view (`BlockMask.dense`, itself checked against the dense rule in test_block_mask.py), against the float64
oracle. Layouts take the block path on Triton (no element mask where the kernel's tiles sit inside the
layout's blocks); misuse raises one clear error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from ejgen.testing.shapes import AttnShape, random_cotangents, random_qkv, rng_for
from ejgen.types import BlockMask, MaskInfo

pytest.importorskip("triton", reason="the triton extra is part of the test install (README)")

PLATFORMS = ["xla", "pallas", "triton"]
S = 64  # two tiles per axis on every backend's interpreter tiles (XLA 32, Pallas 32 x 16, Triton 16)


def _random_layout(rng, batch, heads, n_q, n_k):
    lay = rng.random((batch, heads, n_q, n_k)) < 0.45
    lay[..., 0, :] = False  # a query block that sees nothing: o = 0, lse = -inf
    lay[..., :, -1] = False  # a key block nobody sees: dk = dv = 0
    lay[..., -1, 0] = True
    return lay


def _masks(rng):
    ids = np.repeat([0, 1, 2, -1], [20, 1, 37, 6])[None].astype(np.int32)  # a one-token document, padding
    return {
        # a layout in 16 x 16 blocks over batch 2 and per head: Triton's tiles are its blocks, XLA's and
        # Pallas's hold several (partial where they mix)
        "layout_per_head": (2, BlockMask.from_layout(_random_layout(rng, 2, 4, 4, 4), S, S, 16, 16)),
        # 32 x 32 blocks: Triton's 16 x 16 tiles sit inside them (kinds exact, no element mask)
        "layout_coarse": (1, BlockMask.from_layout(_random_layout(rng, 1, 1, 2, 2), S, S, 32, 32)),
        # a mask_fn (dilated: every third key) and a causal band, and a window with segment ids
        "mask_fn_causal": (1, BlockMask.from_mask_fn(lambda b, h, q, k: (q - k) % 3 == 0, S, S, 16, 16)
                           & BlockMask.causal(S, S, 16, 16)),
        "window_segments": (1, BlockMask.sliding_window(S, S, (9, 4), 16, 16)
                            & BlockMask.from_segments(jnp.asarray(ids), block_q=16, block_k=16)),
    }


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", ["layout_per_head", "layout_coarse", "mask_fn_causal", "window_segments"])
def test_block_mask_on_every_backend(run_vjp, platform, name):
    from ejgen.ops import flash_attention

    rng = rng_for("block_mask_argument", name)
    batch, mask = _masks(rng)[name]
    shape = AttnShape(batch, S, S, 4, 2, 16)
    diff = random_qkv(shape, "float32", rng)
    d_out, d_lse = random_cotangents(shape, "float32", rng)
    out, lse, grads = run_vjp(flash_attention, diff, {"block_mask": mask}, {"platform": platform}, d_out, d_lse)
    dense = np.asarray(mask.dense(batch, 4))
    want = oracle.attention(**{n: np.asarray(x) for n, x in diff.items()}, attention_mask=dense, d_out=d_out,
                            d_lse=d_lse)
    oracle.check_attention(out, lse, grads, want, diff, "float32")


def test_triton_takes_a_layout_by_blocks(run_vjp, triton_launches):
    """A 32 x 32 layout reaches the Triton kernels as a mask of its blocks (MASK_BQ x MASK_BK), and every pass walks
    lists of its tiles (TILE_LISTS) rather than a range."""
    from ejgen.ops import flash_attention

    rng = rng_for("block_mask_argument", "triton_blocks")
    shape = AttnShape(1, S, S, 2, 2, 16)
    lay = np.array([[True, False], [True, True]])
    mask = BlockMask.from_layout(lay, S, S, 32, 32)
    diff = random_qkv(shape, "float32", rng)
    d_out, d_lse = random_cotangents(shape, "float32", rng)
    out, lse, grads = run_vjp(flash_attention, diff, {"block_mask": mask}, {"platform": "triton"}, d_out, d_lse)
    want = oracle.attention(**{n: np.asarray(x) for n, x in diff.items()}, attention_mask=np.asarray(mask.dense()),
                            d_out=d_out, d_lse=d_lse)
    oracle.check_attention(out, lse, grads, want, diff, "float32")
    assert {p for p, _ in triton_launches} >= {"fwd", "dkdv"}
    for pass_, kw in triton_launches:
        got = (kw["DENSE"], kw["MASK_BQ"], kw["MASK_BK"], kw["TILE_RANGES"], kw["TILE_LISTS"], kw["RUNTIME_MASK"])
        assert got == (True, 32, 32, True, True, False), (pass_, kw)


def test_block_mask_joins_mask_info_and_causal(run_vjp):
    """A layout with mask_info's dense mask and the op's own causal flag: all three hold."""
    from ejgen.ops import flash_attention

    rng = rng_for("block_mask_argument", "joined")
    shape = AttnShape(1, S, S, 2, 1, 16)
    dense = rng.random((1, 1, S, S)) < 0.7
    mask = BlockMask.from_layout(_random_layout(rng, 1, 1, 4, 4), S, S, 16, 16)
    diff = random_qkv(shape, "float32", rng)
    d_out, d_lse = random_cotangents(shape, "float32", rng)
    rest = {"block_mask": mask, "mask_info": MaskInfo.from_attention_mask(jnp.asarray(dense))}
    want = oracle.attention(**{n: np.asarray(x) for n, x in diff.items()}, causal=True,
                            attention_mask=dense & np.asarray(mask.dense()), d_out=d_out, d_lse=d_lse)
    for platform in ("xla", "triton"):
        out, lse, grads = run_vjp(flash_attention, diff, rest, {"platform": platform, "causal": True}, d_out, d_lse)
        oracle.check_attention(out, lse, grads, want, diff, "float32")


def test_new_layouts_do_not_retrace():
    from ejgen.ops import flash_attention

    traces = []
    rng = rng_for("block_mask_argument", "retrace")
    q = jnp.asarray(rng.standard_normal((1, S, 2, 16)), jnp.float32)

    @jax.jit
    def f(mask):
        traces.append(1)
        return flash_attention(q, q, q, block_mask=mask, platform="xla")

    outs = [f(BlockMask.from_layout(_random_layout(rng, 1, 1, 4, 4), S, S, 16, 16)) for _ in range(3)]
    assert len(traces) == 1
    assert not np.allclose(outs[0], outs[1])


def test_block_mask_misuse_is_one_clear_error():
    from ejgen.ops import flash_attention
    from generated.alibi_attention import alibi_attention

    q = jnp.zeros((1, S, 2, 16), jnp.float32)
    ids = jnp.zeros((1, S), jnp.int32)
    with pytest.raises(ValueError, match=r"block_mask was built for q_len 32 x kv_len 32, the call has 64 x 64"):
        flash_attention(q, q, q, block_mask=BlockMask.causal(32, 32), platform="xla")
    with pytest.raises(ValueError, match="block_mask must be an ejgen.types.BlockMask, got MaskInfo"):
        flash_attention(q, q, q, block_mask=MaskInfo.from_segments(ids), platform="xla")
    with pytest.raises(ValueError, match=r"segment ids given twice \(mask_info and block_mask\)"):
        flash_attention(q, q, q, block_mask=BlockMask.from_segments(ids), mask_info=MaskInfo.from_segments(ids),
                        platform="xla")
    with pytest.raises(TypeError, match="alibi_attention\\(\\) got a block_mask with a sliding window, but the spec "
                                        "does not enable feature 'sliding_window'"):
        alibi_attention(q, q, q, slopes=jnp.ones(2), block_mask=BlockMask.sliding_window(S, S, 4), platform="xla")
    with pytest.raises(ValueError, match=r"layout must be \[batch\|1, heads\|1, nQ, nK\] = \[1\|1, 2\|1, ...\]"):
        flash_attention(q, q, q, block_mask=BlockMask.from_layout(np.ones((1, 3, 4, 4), bool), S, S, 16, 16),
                        platform="xla")
    cu = jnp.asarray([0, S], jnp.int32)
    with pytest.raises(ValueError, match="block_mask cannot be combined with cu_seqlens"):
        flash_attention(q[0], q[0], q[0], block_mask=BlockMask.causal(S, S), cu_seqlens_q=cu, cu_seqlens_k=cu,
                        max_seqlen_q=S, max_seqlen_k=S, platform="xla")
