"""`ejgen.types.BlockMask` (docs/DESIGN.md §3, block-sparse attention): every builder against its dense
equivalent written from §3 step 4, tile kinds that are exact (a tile is skipped only when nothing in it is
visible, full only when everything valid is), the lists kernels walk and their transposes, composition,
re-tiling, the MaskInfo round trip, and jit without retracing when the ids change."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejgen.types import BlockMask, MaskInfo
from ejgen.types.block_mask import FULL, PARTIAL, SKIP

TILES = [(16, 16), (32, 16), (16, 64), (64, 64)]
LENGTHS = [(37, 41), (64, 64), (100, 29), (1, 50), (50, 1)]


def reference_band(q_len, kv_len, left=None, right=None):
    """§3 step 4, bottom-right aligned."""
    i = np.arange(q_len)[:, None] + kv_len - q_len
    j = np.arange(kv_len)[None, :]
    vis = np.ones((q_len, kv_len), bool)
    if left is not None:
        vis &= j >= i - left
    if right is not None:
        vis &= j <= i + right
    return vis[None, None]


def exact_kinds(dense, block_q, block_k):
    """Tile kinds from an element mask [B, H, Sq, Sk], by brute force."""
    B, H, sq, sk = dense.shape
    nq, nk = -(-sq // block_q), -(-sk // block_k)
    kinds = np.zeros((B, H, nq, nk), np.int8)
    for a in range(nq):
        for c in range(nk):
            tile = dense[:, :, a * block_q:(a + 1) * block_q, c * block_k:(c + 1) * block_k]
            kinds[:, :, a, c] = np.where(tile.all(axis=(2, 3)), FULL, np.where(tile.any(axis=(2, 3)), PARTIAL, SKIP))
    return kinds


def check(mask: BlockMask, dense, *, exact=True):
    """The mask lets through exactly ``dense``; its kinds are the exact ones (or, where the builder is only
    safe, never skip a visible tile nor call a tile full that is not); lists and transposes agree."""
    dense = np.asarray(dense)
    B, H = dense.shape[:2]
    np.testing.assert_array_equal(np.asarray(mask.dense(B, H)), dense)
    kinds = np.broadcast_to(np.asarray(mask.kinds()), exact_kinds(dense, mask.block_q, mask.block_k).shape)
    want = exact_kinds(dense, mask.block_q, mask.block_k)
    if exact:
        np.testing.assert_array_equal(kinds, want)
    else:
        assert np.all((kinds == SKIP) <= (want == SKIP)) and np.all((kinds == FULL) <= (want == FULL))
    # lists: counts, ascending indices of that kind; transposes of the same kinds
    k = np.asarray(mask.kinds())
    for count, idx, full_count, full_idx, kk in (
        (mask.kv_count, mask.kv_indices, mask.full_kv_count, mask.full_kv_indices, k),
        (mask.q_count, mask.q_indices, mask.full_q_count, mask.full_q_indices, np.swapaxes(k, -1, -2)),
    ):
        for c, ix, kind in ((count, idx, PARTIAL), (full_count, full_idx, FULL)):
            c, ix = np.asarray(c), np.asarray(ix)
            for pos in np.ndindex(*kk.shape[:-1]):
                listed = ix[pos][: c[pos]]
                np.testing.assert_array_equal(listed, np.flatnonzero(kk[pos] == kind))


@pytest.mark.parametrize("tiles", TILES, ids=[f"{a}x{b}" for a, b in TILES])
@pytest.mark.parametrize("lengths", LENGTHS, ids=[f"{a}x{b}" for a, b in LENGTHS])
def test_causal_and_windows(lengths, tiles):
    (sq, sk), (bq, bk) = lengths, tiles
    check(BlockMask.causal(sq, sk, bq, bk), reference_band(sq, sk, None, 0))
    check(BlockMask.causal(sq, sk, bq, bk, sliding_window=20), reference_band(sq, sk, 20, 0))
    check(BlockMask.sliding_window(sq, sk, (8, 4), bq, bk), reference_band(sq, sk, 8, 4))
    check(BlockMask.sliding_window(sq, sk, 0, bq, bk), reference_band(sq, sk, 0, 0))


def packed_ids(rng, batch, n, docs):
    """Contiguous documents of random lengths (some of one token), then padding (-1)."""
    ids = np.full((batch, n), -1, np.int32)
    for b in range(batch):
        used = int(rng.integers(max(n - 8, 1), n + 1))
        cuts = np.sort(rng.choice(np.arange(1, used), size=min(docs - 1, max(used - 1, 0)), replace=False))
        ids[b, :used] = np.searchsorted(cuts, np.arange(used), side="right")
    return ids


@pytest.mark.parametrize("tiles", TILES, ids=[f"{a}x{b}" for a, b in TILES])
def test_segments_packed_and_random(tiles):
    bq, bk = tiles
    rng = np.random.default_rng(0)
    q = packed_ids(rng, 2, 150, 6)
    q[1] = np.repeat([0, 1, 2, 3, 4, -1], [40, 1, 30, 1, 60, 18])  # one-token documents, padding
    dense = (q[:, :, None] == q[:, None, :]) & (q[:, :, None] >= 0)
    check(BlockMask.from_segments(jnp.asarray(q), block_q=bq, block_k=bk), dense[:, None])
    # different q and kv ids (Sq != Sk), and ids in no order at all: safe, not exact
    kv = packed_ids(rng, 2, 90, 4)
    dense = (q[:, :, None] == kv[:, None, :]) & (q[:, :, None] >= 0)
    check(BlockMask.from_segments(q, kv, bq, bk), dense[:, None])
    shuffled = rng.integers(-1, 4, (2, 70)).astype(np.int32)
    dense = (shuffled[:, :, None] == shuffled[:, None, :]) & (shuffled[:, :, None] >= 0)
    check(BlockMask.from_segments(shuffled, block_q=bq, block_k=bk), dense[:, None], exact=False)


@pytest.mark.parametrize("heads", [1, 3])
def test_dense_masks(heads):
    rng = np.random.default_rng(1)
    mask = rng.random((2, heads, 45, 70)) < 0.3
    mask[:, :, :16] = True  # a full row of tiles
    mask[:, :, :, 48:64] = False  # an empty column of tiles
    mask[0, :, 5, :] = False  # an empty query row
    check(BlockMask.from_dense(jnp.asarray(mask), 16, 16), mask)
    check(BlockMask.from_dense(mask[:, 0], 32, 16), mask[:, :1])


def test_layouts_local_global_and_random():
    """The seed's qkv_layouts: local + global and a random 10% layout, at their own tiles and re-tiled."""
    nq = nk = 8
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    local_global = (np.abs(i - j) <= 1) | (j == 0) | (i == 0)
    rng = np.random.default_rng(2)
    random_layout = rng.random((2, 3, nq, nk)) < 0.1
    random_layout[:, :, 3] = False  # a query block that sees nothing
    for layout in (local_global, random_layout):
        mask = BlockMask.from_layout(jnp.asarray(layout), 8 * 16, 8 * 16, 16, 16)
        lay = np.broadcast_to(layout, (1, 1) + layout.shape) if layout.ndim == 2 else layout
        dense = np.repeat(np.repeat(lay, 16, axis=-2), 16, axis=-1)
        check(mask, dense)
        check(mask.retile(32, 64), dense)  # coarser: mixed tiles become partial, the element rule holds
        check(mask.retile(8, 16), dense)


def test_mask_fn_matches_its_elements():
    """A user's mask_fn (here: document ids read from a closure, plus a prefix every query sees)."""
    ids = jnp.asarray(np.repeat(np.arange(5), 13)[None, :60].astype(np.int32))

    def mask_fn(b, h, q, k):
        return (ids[b, q] == ids[b, k]) | (k < 4)

    mask = BlockMask.from_mask_fn(mask_fn, 60, 60, 16, 16)
    q, k = np.arange(60)[:, None], np.arange(60)[None, :]
    idn = np.asarray(ids[0])
    check(mask, ((idn[q] == idn[k]) | (k < 4))[None, None])


def test_and_composition_and_or_refused():
    rng = np.random.default_rng(3)
    q = packed_ids(rng, 1, 80, 3)
    seg = (q[:, :, None] == q[:, None, :]) & (q[:, :, None] >= 0)
    both = BlockMask.from_segments(q, block_q=16, block_k=16) & BlockMask.causal(80, 80, 16, 16, sliding_window=24)
    check(both, seg[:, None] & reference_band(80, 80, 24, 0))
    with pytest.raises(TypeError, match="mask_fn"):
        BlockMask.causal(80, 80) | BlockMask.causal(80, 80)
    with pytest.raises(ValueError, match="lengths differ"):
        BlockMask.causal(80, 80) & BlockMask.causal(80, 81)


def test_mask_info_round_trip():
    rng = np.random.default_rng(4)
    q, kv = packed_ids(rng, 2, 33, 3), packed_ids(rng, 2, 47, 3)
    for info in (MaskInfo.from_segments(q, kv), MaskInfo.from_attention_mask(rng.random((2, 33, 47)) < 0.5)):
        back = BlockMask.from_mask_info(info, 16, 32).to_mask_info()
        for name in ("q_segment_ids", "kv_segment_ids", "attention_mask"):
            a, b = getattr(info, name), getattr(back, name)
            assert (a is None) == (b is None), name
            if a is not None:
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="converts back"):
        BlockMask.causal(8, 8).to_mask_info()


def test_jit_without_retrace_when_documents_change():
    """Document boundaries are traced values: new boundaries, same trace; the result follows them."""
    traces = []

    @jax.jit
    def build(ids):
        traces.append(None)
        return BlockMask.from_segments(ids, block_q=16, block_k=16)

    rng = np.random.default_rng(5)
    for docs in (2, 5, 9):
        ids = packed_ids(rng, 1, 96, docs)
        mask = build(jnp.asarray(ids))
        dense = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)
        check(mask, dense[:, None])
    assert len(traces) == 1
    leaves = jax.tree.leaves(mask)
    assert all(isinstance(x, jax.Array) for x in leaves)  # sizes are static, everything else is traced


@pytest.mark.parametrize("bad,match", [
    (lambda: BlockMask.causal(0, 8), "q_len must be a positive Python int"),
    (lambda: BlockMask.sliding_window(8, 8, (-1, 2)), "sliding_window"),
    (lambda: BlockMask.from_layout(np.ones((2, 2), np.int32), 32, 32, 16, 16), "must be bool"),
    (lambda: BlockMask.from_layout(np.ones((3, 2), bool), 32, 32, 16, 16), r"\[B\|1, H\|1, 2, 2\]"),
    (lambda: BlockMask.from_mask_fn(3, 8, 8), "callable"),
    (lambda: BlockMask.from_mask_info(MaskInfo()), "neither"),
])
def test_bad_input_is_named(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_tile_ranges_cover_every_visited_tile_and_only_full_ones_unmasked():
    from ejgen.types.block_mask import tile_ranges

    rng = np.random.default_rng(6)
    kinds = rng.choice([SKIP, PARTIAL, FULL], size=(2, 3, 7, 9), p=[0.5, 0.2, 0.3]).astype(np.int8)
    kinds[0, 0, 0] = SKIP  # nothing visited
    kinds[0, 0, 1] = [0, 1, 2, 2, 2, 1, 0, 0, 0]  # a document: partial edges, full middle
    for longest in (True, False):
        ranges = np.asarray(tile_ranges(jnp.asarray(kinds), longest))
        for pos in np.ndindex(*kinds.shape[:-1]):
            lo, hi, flo, fhi = ranges[pos]
            row = kinds[pos]
            visited = np.flatnonzero(row != SKIP)
            assert lo <= flo <= fhi <= hi
            if len(visited):
                assert (lo, hi) == (visited[0], visited[-1] + 1)
            else:
                assert lo == hi == flo == fhi
            assert np.all(row[flo:fhi] == FULL)
            runs = [len(r) for r in "".join("F" if k == FULL else "." for k in row).split(".")]
            first = next((r for r in runs if r), 0)
            assert fhi - flo == (max(runs) if longest else first), (longest, row, ranges[pos])
            if not longest and first:
                assert flo == np.flatnonzero(row == FULL)[0]
        np.testing.assert_array_equal(ranges[0, 0, 1], [1, 6, 2, 5])
