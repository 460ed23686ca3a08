"""Tiles of a spec's mask by interval arithmetic (`ejgen.runtime.core.intervals`, the generated `_mask_tiles`;
docs/DESIGN.md §3 block masks): against the mask evaluated element by element (numpy, written here from each
variant's definition), at tiles of one element (kinds must be exact: skip or full) and of many (sound: a skipped
tile holds no visible pair, a full one no hidden pair; and tight where the analysis promises it: chunks, video
tiles and NATTEN rows that are whole tiles give no partial tile). The zoo's chunks, images and dilations run as
segment ids (docs/DESIGN.md §5, Segment keys): their masks are classified here from copies written as negated
inequalities, which the segment-key pass leaves to the element mask."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import on_path
from ejgen.cli import main
from ejgen.runtime.core import intervals

TRICKY = """\
name: tricky_mask_attention
family: attention
doc: >
  Every operation of the interval arithmetic in one mask.
backends: [triton, xla]
features:
  gqa: runtime
params:
  types: {shape: [batch, kv_len], dtype: int32}
  gate: {shape: [heads], dtype: float32}
options:
  period: {type: int, default: 5}
  div: {type: int, default: 3}
mask: >
  ((3 * q_idx - kv_idx) % period < 2 and not (kv_idx // div == q_idx // 4))
  or (abs(q_idx - kv_idx) <= 2 and sign(q_idx - 20) != -1)
  or clamp(kv_idx - q_idx, -3, 3) == min(max(q_idx % 7 - 3, -3), 3)
  or (types[b, kv_idx] == q_idx % 3 and where(h == 0, kv_idx < q_len // 2, kv_idx >= 5))
  or (types[b, kv_idx // 2 + 1] > 2 and q_idx < 40)
  or (float(q_idx) * gate[h] > float(kv_idx) + 0.5 and floor(float(kv_idx) / 3.0) == ceil(float(q_idx) / 6.0))
  or (exp(float(q_idx - kv_idx)) < 1.0 and kv_idx % div == q_idx % div and q_idx ** 2 > 4)
"""


def tricky_dense(q, k, b, h, sq, sk, opts, prm):
    period, div = opts["period"], opts["div"]

    def fdiv(a, d):
        return np.where(d == 0, 0, np.floor_divide(a, np.where(d == 0, 1, d)))

    def fmod(a, d):
        return np.where(d == 0, a, np.mod(a, np.where(d == 0, 1, d)))

    m = (fmod(3 * q - k, period) < 2) & ~(fdiv(k, div) == q // 4)
    m = m | (np.abs(q - k) <= 2) & (np.sign(q - 20) != -1)
    m = m | (np.clip(k - q, -3, 3) == np.minimum(np.maximum(q % 7 - 3, -3), 3))
    m = m | (prm["types"][b, k] == q % 3) & np.where(h == 0, k < sq // 2, k >= 5)
    m = m | ((prm["types"][b, np.clip(k // 2 + 1, 0, sk - 1)] > 2) & (q < 40))
    qf, kf = q.astype(np.float32), k.astype(np.float32)
    m = m | (qf * prm["gate"][h] > kf + np.float32(0.5)) & (np.floor(kf / np.float32(3)) == np.ceil(qf / np.float32(6)))
    m = m | (np.exp((q - k).astype(np.float32)) < 1.0) & (fmod(k, div) == fmod(q, div)) & (q**2 > 4)
    return m


def chunked_dense(q, k, b, h, sq, sk, opts, prm):
    return q // opts["chunk"] == k // opts["chunk"]


def natten_2d_dense(q, k, b, h, sq, sk, opts, prm):
    w, n = opts["width"], opts["kernel"]
    ok = True
    for qq, kk, size in ((q // w, k // w, sk // w), (q % w, k % w, w)):
        start = np.clip(qq - n // 2, 0, size - n)
        ok = ok & (kk >= start) & (kk < start + n)
    return ok


def sliding_tile_dense(q, k, b, h, sq, sk, opts, prm):
    tokens, gh, gw = opts["tile_tokens"], opts["grid_h"], opts["grid_w"]
    tq, tk = q // tokens, k // tokens
    coords = lambda t: (t // (gh * gw), (t // gw) % gh, t % gw)  # noqa: E731
    radius = (opts["radius_t"], opts["radius_h"], opts["radius_w"])
    ok = True
    for a, c, r in zip(coords(tq), coords(tk), radius):
        ok = ok & (np.abs(a - c) <= r)
    return ok


def sink_window_dense(q, k, b, h, sq, sk, opts, prm):
    return (k < opts["sink_tokens"]) | (q - k < opts["window"])


def paligemma_dense(q, k, b, h, sq, sk, opts, prm):
    n = opts["image_tokens"]
    return (k <= q) | ((q < n) & (k < n))


def flamingo_dense(q, k, b, h, sq, sk, opts, prm):
    return k // opts["image_tokens"] == prm["latest"][b, q]


def dilated_dense(q, k, b, h, sq, sk, opts, prm):
    return (q - k) % opts["dilation"] == 0


@pytest.fixture(scope="module")
def tricky(tmp_path_factory):
    root = tmp_path_factory.mktemp("tricky")
    (root / "specs").mkdir()
    (root / "specs" / "tricky.yaml").write_text(TRICKY)
    assert main(["build", str(root / "specs"), "-o", str(root / "tricky_pkg")]) == 0
    with on_path(root):
        yield importlib.import_module("tricky_pkg.tricky_mask_attention.triton_launch")._mask_tiles


# the zoo's segment keys as element masks: `not (F != G)` is no `F == G` conjunct (ejgen.ir.passes.segment_key)
KEYS_AS_MASKS = {
    "chunked_local_attention": ("options:\n  chunk: {type: int, default: 8}\n",
                                "not (q_idx // chunk != kv_idx // chunk)"),
    "dilated_window_attention": ("options:\n  dilation: {type: int, default: 2}\n",
                                 "not ((q_idx - kv_idx) % dilation != 0)"),
    "flamingo_cross_attention": ("params:\n  latest: {shape: [batch, q_len], dtype: int32}\n"
                                 "options:\n  image_tokens: {type: int, default: 64}\n",
                                 "not (kv_idx // image_tokens != latest[b, q_idx])"),
}


@pytest.fixture(scope="module")
def keys_as_masks(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys_as_masks")
    (root / "specs").mkdir()
    for name, (fields, mask) in KEYS_AS_MASKS.items():
        (root / "specs" / f"{name}.yaml").write_text(f"name: {name}\nfamily: attention\ndoc: The zoo's mask, kept "
                                                     f"whole.\nbackends: [triton]\n{fields}mask: {mask}\n")
    assert main(["build", str(root / "specs"), "-o", str(root / "keys_pkg")]) == 0
    with on_path(root):
        yield {name: importlib.import_module(f"keys_pkg.{name}.triton_launch")._mask_tiles for name in KEYS_AS_MASKS}


def _zoo(name, keys=None):
    if name in KEYS_AS_MASKS:
        return keys[name]
    return importlib.import_module(f"ejgen.zoo.{name}.triton_launch")._mask_tiles


def _kinds(mask_tiles, batch, heads, bq, bk, sq, sk, opts, prm):
    ctx = {f"opt_{n}": jnp.int32(v) for n, v in opts.items()}
    ctx.update({f"param_{n}": jnp.asarray(v) for n, v in prm.items()})
    t = intervals.tiles(batch, heads, bq, bk, sq, sk)
    kinds = np.asarray(jax.jit(lambda ctx: mask_tiles(t, ctx))(ctx))  # as under the op's jit (eager: slow)
    return np.broadcast_to(kinds, (batch, heads, -(-sq // bq), -(-sk // bk)))


def _dense(dense, batch, heads, sq, sk, opts, prm):
    b = np.arange(batch)[:, None, None, None]
    h = np.arange(heads)[None, :, None, None]
    q = np.arange(sq)[None, None, :, None]
    k = np.arange(sk)[None, None, None, :]
    return np.broadcast_to(dense(q, k, b, h, sq, sk, opts, prm), (batch, heads, sq, sk))


def check_tiles(mask_tiles, dense, bq, bk, sq, sk, opts, prm=None, batch=1, heads=1, exact=True):
    """Sound at (bq, bk); ``exact``: skip or full, as the element mask says, at one element per tile. The kinds."""
    prm = prm or {}
    vis = _dense(dense, batch, heads, sq, sk, opts, prm)
    if exact:
        kinds = _kinds(mask_tiles, batch, heads, 1, 1, sq, sk, opts, prm)
        np.testing.assert_array_equal(kinds, np.where(vis, 2, 0), err_msg=f"one-element tiles, {opts}")
    kinds = _kinds(mask_tiles, batch, heads, bq, bk, sq, sk, opts, prm)
    nq, nk = kinds.shape[-2:]
    padded = np.zeros((batch, heads, nq * bq, nk * bk), bool)
    padded[..., :sq, :sk] = vis
    inside = np.zeros_like(padded)
    inside[..., :sq, :sk] = True
    blocks = lambda x: x.reshape(batch, heads, nq, bq, nk, bk)  # noqa: E731
    any_vis = blocks(padded).any(axis=(3, 5))
    all_vis = (blocks(padded) | ~blocks(inside)).all(axis=(3, 5))
    assert not np.any((kinds == 0) & any_vis), f"a skipped tile holds a visible pair ({opts}, tiles {bq}x{bk})"
    assert not np.any((kinds == 2) & ~all_vis), f"a full tile holds a hidden pair ({opts}, tiles {bq}x{bk})"
    return kinds


@pytest.mark.parametrize("tile", [(1, 1), (4, 4), (8, 16), (13, 7), (64, 64)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_every_interval_operation_is_sound(tricky, tile):
    rng = np.random.default_rng(sum(tile))
    batch, heads, sq, sk = 2, 3, 70, 61
    prm = {"types": rng.integers(-1, 4, (batch, sk)).astype(np.int32),
           "gate": np.asarray([0.5, 1.5, -1.0], np.float32)}
    for opts in ({"period": 5, "div": 3}, {"period": -4, "div": 0}, {"period": 0, "div": -7}):
        kinds = check_tiles(tricky, tricky_dense, *tile, sq, sk, opts, prm, batch, heads, exact=False)
        if tile == (1, 1):  # one element: "maybe" only where exp() decides (no bounds through it)
            vis = _dense(tricky_dense, batch, heads, sq, sk, opts, prm)
            assert np.all(kinds[vis] > 0) and np.mean(kinds == 1) < 0.5
            assert np.all(kinds[kinds != 1] == np.where(vis, 2, 0)[kinds != 1])


@pytest.mark.parametrize("name, dense, opts, tile, n", [
    ("chunked_local_attention", chunked_dense, {"chunk": 32}, (16, 32), 128),
    ("chunked_local_attention", chunked_dense, {"chunk": 24}, (16, 16), 100),
    ("natten_2d_attention", natten_2d_dense, {"width": 16, "kernel": 5}, (16, 16), 256),
    ("natten_2d_attention", natten_2d_dense, {"width": 12, "kernel": 3}, (8, 8), 144),
    ("sliding_tile_attention", sliding_tile_dense,
     dict(tile_tokens=16, grid_h=3, grid_w=2, radius_t=1, radius_h=1, radius_w=0), (16, 16), 288),
    ("sliding_tile_attention", sliding_tile_dense,
     dict(tile_tokens=8, grid_h=2, grid_w=3, radius_t=0, radius_h=1, radius_w=1), (16, 8), 144),
    ("sink_window_attention", sink_window_dense, {"sink_tokens": 4, "window": 20}, (8, 8), 96),
    ("paligemma_prefix_attention", paligemma_dense, {"image_tokens": 24}, (16, 16), 80),
    ("dilated_window_attention", dilated_dense, {"dilation": 3}, (8, 8), 40),
], ids=lambda x: x if isinstance(x, str) and x.endswith("attention") else None)
def test_zoo_masks_by_tile(keys_as_masks, name, dense, opts, tile, n):
    kinds = check_tiles(_zoo(name, keys_as_masks), dense, *tile, n, n, opts)

    whole = {"chunked_local_attention": opts.get("chunk", 1) % tile[0] == 0 and opts.get("chunk", 1) % tile[1] == 0,
             "sliding_tile_attention": opts.get("tile_tokens", 1) % max(tile) == 0}
    if whole.get(name):  # chunks or video tiles of whole kernel tiles: no element mask anywhere
        assert not np.any(kinds == 1), f"{name}: partial tiles where every tile is whole"
    if name == "natten_2d_attention":  # rows out of the neighbourhood are skipped: about kernel / rows visited
        rows = n // opts["width"]
        assert np.mean(kinds > 0) <= (opts["kernel"] + 2 * tile[0] // opts["width"] + 1) / rows


@pytest.mark.parametrize("tile", [(1, 1), (16, 16), (13, 8)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_flamingo_reads_its_param_per_tile(keys_as_masks, tile):
    """``latest[b, q_idx]``: the least and greatest image number of each query tile (one reduction per tile), so
    a text tile sees only its images' key tiles; rows before the first image (-1) see nothing."""
    rng = np.random.default_rng(7)
    batch, sq, sk, image_tokens = 2, 90, 64, 8
    starts = np.sort(rng.integers(0, sq, (batch, sk // image_tokens)), axis=1)
    latest = (np.sum(np.arange(sq)[None, :, None] >= starts[:, None, :], axis=2) - 1).astype(np.int32)
    kinds = check_tiles(_zoo("flamingo_cross_attention", keys_as_masks), flamingo_dense, *tile, sq, sk,
                        {"image_tokens": image_tokens}, {"latest": latest}, batch=batch)
    if tile == (16, 16):  # each query tile: its images' key tiles, about two of eight
        assert np.mean(kinds > 0) < 0.4
