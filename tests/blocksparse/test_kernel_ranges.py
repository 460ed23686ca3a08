"""Kernels that narrow their tile loops by the block mask of segment ids or a dense mask (docs/DESIGN.md §3
block masks): the generated Triton kernels take the tile ranges (TILE_RANGES) in every pass, skip the
element mask only on full tiles, and still match the float64 oracle; the XLA and Pallas kind tables of
contiguous documents are the exact ones."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from ejgen.testing.shapes import AttnShape, random_cotangents, random_qkv, rng_for
from ejgen.types import MaskInfo

pytest.importorskip("triton", reason="the triton extra is part of the test install (README)")

DOCS = np.repeat([0, 1, 2, 3, -1], [30, 17, 1, 40, 8])[None].astype(np.int32)  # 96 tokens, a one-token doc, padding


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("how", ["segments", "dense"])
def test_document_masks_take_tile_ranges_in_every_pass(run_vjp, triton_launches, how, causal):
    from ejgen.ops import flash_attention

    shape = AttnShape(1, 96, 96, 4, 2, 32)
    rng = rng_for("ranges", how, causal)
    diff = random_qkv(shape, "float32", rng)
    ids = DOCS
    dense = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)
    if how == "segments":
        info, ref = MaskInfo.from_segments(jnp.asarray(ids)), dict(q_segment_ids=ids, kv_segment_ids=ids)
    else:
        info, ref = MaskInfo.from_attention_mask(jnp.asarray(dense)), dict(attention_mask=dense)
    d_out, d_lse = random_cotangents(shape, "float32", rng)
    out, lse, grads = run_vjp(flash_attention, diff, {"mask_info": info}, {"causal": causal, "platform": "triton"},
                              d_out, d_lse)
    want = oracle.attention(**{n: np.asarray(x) for n, x in diff.items()}, causal=causal, **ref, d_out=d_out,
                            d_lse=d_lse)
    oracle.check_attention(out, lse, grads, want, diff, "float32")
    passes = {pass_ for pass_, _ in triton_launches}
    assert passes >= {"fwd", "dkdv"}, passes
    for pass_, kw in triton_launches:
        assert kw["TILE_RANGES"] and not kw["RUNTIME_MASK"], (pass_, kw["TILE_RANGES"], kw["RUNTIME_MASK"])


def test_host_ranges_follow_the_documents():
    """The forward's ranges at 16 x 16 tiles: each query tile visits the key tiles of its documents only, and
    tiles inside one document (both sides) need no element mask."""
    from ejgen.runtime.attention.triton import host
    from ejgen.runtime.attention.triton.configs import KernelConfig

    flags = {"varlen": False, "segments": True, "dense_mask": False, "layout": False, "positions": False}
    cfg = type("Cfg", (), flags)()
    layout = type("Layout", (), {"runtime_mask_from_spec": False, "mask_tiles": None})()
    ids = jnp.asarray(DOCS)
    q = jnp.zeros((1, 96, 2, 2, 32))
    ranges, consts = host._tiles(layout, {"q_seg": ids, "kv_seg": ids}, cfg, q, q[:, :, :, 0], KernelConfig(16, 16, 4, 1),
                                 False)
    assert consts == dict(TILE_RANGES=True, TILE_BATCH=1, TILE_HEADS=1, RUNTIME_MASK=False)
    r = np.asarray(ranges)[0, 0]
    # query tile 0 (tokens 0-15, doc 0 = tokens 0-29): key tiles 0-1; tile 0 full
    np.testing.assert_array_equal(r[0], [0, 2, 0, 1])
    # query tile 3 (tokens 48-63: doc 3 = 48-87): key tiles 3-5, 3 and 4 full
    np.testing.assert_array_equal(r[3], [3, 6, 3, 5])
    # query tile 5 (tokens 80-95: doc 3 to 87, then padding): key tiles 3-5, none full
    assert tuple(r[5, :2]) == (3, 6) and r[5, 2] == r[5, 3]


def test_xla_block_kinds_of_documents_are_exact():
    """The XLA backend's per-call tile kinds for segment ids come from the tile classifier (O(tiles)), not from
    every element: for contiguous documents they equal the exact kinds of the document mask (over the batch:
    skipped only where no row sees anything, full only where every row sees everything)."""
    import importlib

    from test_block_mask import exact_kinds
    from ejgen.runtime.attention.config import AttentionConfig

    xla = importlib.import_module("ejgen.generated.flash_attention.xla")
    ids = np.concatenate([DOCS, np.repeat([0, 1, -1], [60, 30, 6])[None].astype(np.int32)])  # two batch rows
    q = jnp.zeros((2, 1, 1, 96, 8))
    cfg = AttentionConfig(seq_q=96, seq_k=96, segments=True)
    kinds = np.asarray(xla._KERNELS._block_kinds(q, q[:, :, 0], {"q_seg": jnp.asarray(ids), "kv_seg": jnp.asarray(ids)},
                                                 cfg, 32, 16))
    dense = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)
    per_row = exact_kinds(dense[:, None], 32, 16)
    want = np.where((per_row == 2).all(axis=(0, 1)), 2, np.where((per_row > 0).any(axis=(0, 1)), 1, 0))
    np.testing.assert_array_equal(kinds, want)


def test_pallas_block_kinds_of_documents_are_exact():
    """The same for the Pallas kernels' kind table (GPU and TPU kernels share it)."""
    import importlib

    from test_block_mask import exact_kinds
    from ejgen.runtime.attention.config import AttentionConfig
    from ejgen.runtime.attention.pallas import hooks as pallas_hooks

    pallas = importlib.import_module("ejgen.generated.flash_attention.pallas")
    ids = np.concatenate([DOCS, np.repeat([0, 1, -1], [60, 30, 6])[None].astype(np.int32)])
    cfg = AttentionConfig(seq_q=96, seq_k=96, segments=True)
    ctx = {"q_seg": jnp.asarray(ids), "kv_seg": jnp.asarray(ids)}
    kinds = np.asarray(pallas_hooks.dense_kinds(pallas._KERNELS.hooks, 32, 16, ctx, None, None, cfg, (2, 1, 1, 96, 96)))
    dense = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)
    per_row = exact_kinds(dense[:, None], 32, 16)
    want = np.where((per_row == 2).all(axis=(0, 1)), 2, np.where((per_row > 0).any(axis=(0, 1)), 1, 0))
    np.testing.assert_array_equal(kinds, want)


def test_varlen_and_plain_calls_take_no_element_mask_on_every_block(triton_launches):
    """Packed sequences (varlen) are kept apart by per-sequence ranges and a plain causal call by the analysed
    ranges: no pass takes the run-time mask on every block (RUNTIME_MASK), which costs every tile its mask."""
    from ejgen.ops import flash_attention

    q = jnp.ones((40, 2, 16), jnp.float32)
    cu = jnp.asarray([0, 17, 40], jnp.int32)
    flash_attention(q, q, q, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=23, max_seqlen_k=23,
                    platform="triton")
    flash_attention(q[None], q[None], q[None], causal=True, platform="triton")
    assert triton_launches and not any(kw["RUNTIME_MASK"] for _, kw in triton_launches), triton_launches
