"""Specs with a mask of their own on the Hopper (Gluon) kernels (docs/DESIGN.md §6): the kernels walk lists of blocks
made from the mask's tiles (its interval arithmetic, `_mask_tiles`, joined with causal, the window and segment ids:
`gluon.host.fwd_lists` / `bwd_lists`) and call the generated module's own `_spec_mask` on the partial ones.

Here (no GPU): the lists, walked as the kernels walk them, count each visible pair of the variant's element rule
(written here by hand) exactly once; the zoo's mask variants take the Hopper kernels on sm_90 (`explain`) unless the
setting keeps them on the generated ones, with the spec's functions as constexprs (a fake launch); the kernels compile
for sm_90 (Triton 3.9 and the GPU host's 3.6). On an H100/H200 (`-m gpu`): each variant against the float64 oracle,
outputs, lse and gradients, with a spy showing the Hopper kernels ran."""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton", reason="the triton extra is part of the test install (README)")

from ejgen.runtime.attention.config import AttentionConfig  # noqa: E402
from ejgen.runtime.attention.gluon import host as gluon_attention  # noqa: E402
from test_gluon import _walk  # noqa: E402  (the kernels' walk of a list row)
from hopper_fakes import pretend_hopper  # noqa: E402

pytestmark = pytest.mark.usefixtures("x64_stays_off")

ON_GPU = jax.default_backend() == "gpu"


def _package(name: str) -> str:
    return "ejgen.generated" if name == "prefix_lm_attention" else "ejgen.zoo"


def _op(name: str):
    return getattr(importlib.import_module(_package(name)), name)


def _layout(name: str):
    return importlib.import_module(f"{_package(name)}.{name}.triton_launch").LAYOUT


# -- each variant's element rule, by hand (numpy; rows [R, 1], keys [1, C]) ---------------------------------------
def _clamp(x, lo, hi):
    return np.minimum(np.maximum(x, lo), hi)


def _natten_1d(q, k, o, seq):
    start = _clamp(q - o["kernel"] // 2, 0, seq - o["kernel"])
    return (k >= start) & (k < start + o["kernel"])


def _natten_2d(q, k, o, seq):
    w, n = o["width"], o["kernel"]
    ok = True
    for qa, ka, extent in ((q // w, k // w, seq // w), (q % w, k % w, w)):
        start = _clamp(qa - n // 2, 0, extent - n)
        ok = ok & (ka >= start) & (ka < start + n)
    return ok


def _sliding_tile(q, k, o, seq):
    t, gh, gw = o["tile_tokens"], o["grid_h"], o["grid_w"]
    return ((np.abs(q // (t * gh * gw) - k // (t * gh * gw)) <= o["radius_t"])
            & (np.abs(q // (t * gw) % gh - k // (t * gw) % gh) <= o["radius_h"])
            & (np.abs(q // t % gw - k // t % gw) <= o["radius_w"]))


def _sink_window(q, k, o, seq):
    return (k <= q) & ((k < o["sink_tokens"]) | (q - k < o["window"]))  # causal compiled in


def _paligemma(q, k, o, seq):
    n = o["image_tokens"]
    return (k <= q) | ((q < n) & (k < n))


def _prefix_lm(q, k, o, seq):
    return (k <= q) | (k < o["prefix_len"])


def _dilated(q, k, o, seq):  # causal and the window (left) passed as features
    return (k <= q) & (q - k <= o["left"]) & ((q - k) % o["dilation"] == 0)


# (name, rule, options, sequence): each with partial, full and skipped tiles of both passes, a ragged end
MASK_CASES = [
    ("natten_1d_attention", _natten_1d, {"kernel": 201}, 650),
    ("natten_2d_attention", _natten_2d, {"width": 40, "kernel": 5}, 720),
    ("sliding_tile_attention", _sliding_tile,
     {"tile_tokens": 48, "grid_h": 3, "grid_w": 2, "radius_t": 0, "radius_h": 1, "radius_w": 0}, 600),
    ("sink_window_attention", _sink_window, {"sink_tokens": 5, "window": 150}, 700),
    ("paligemma_prefix_attention", _paligemma, {"image_tokens": 200}, 500),
    ("prefix_lm_attention", _prefix_lm, {"prefix_len": 300}, 640),
]


@pytest.mark.parametrize("name,rule,options,seq", MASK_CASES, ids=[c[0] for c in MASK_CASES])
def test_spec_mask_lists_walk_each_visible_pair_once(name, rule, options, seq):
    """The forward's and the backward's lists of a spec mask (under jit, the options traced), walked as the kernels
    walk them with the element mask (the spec's rule, causal, the sequence's end) on the entries that say so, count
    each visible pair of the rule exactly once and no other; entries without the mask lie inside the sequence."""
    layout = _layout(name)
    causal = name == "sink_window_attention"
    cfg = AttentionConfig(seq_q=seq, seq_k=seq, causal=causal)
    ctx = {f"opt_{n}": jnp.int32(v) for n, v in options.items()}
    hq, hkv = 2, 1
    (fwd, fc, _), (bwd, bc, _) = jax.jit(lambda c: (
        gluon_attention.fwd_lists(c, cfg, seq, layout.mask_tiles, 1, hq),
        gluon_attention.bwd_lists(c, cfg, seq, hkv, layout.mask_tiles, 1, hq)))(ctx)
    i = np.arange(seq)
    want = rule(i[:, None], i[None, :], options, seq)

    def keep(rows, keys):
        return (rows < seq) & (keys < seq) & rule(rows, keys, options, seq)

    _check_walk(np.asarray(fwd), fc, np.asarray(bwd), bc, want, keep, seq, hq, hkv)
    assert fc["LIST"] and bc["LIST"] == 1 and not fc["SUB_Q"] and (fc["LIST_HEADS"], bc["LIST_HEADS"]) == (1, 1)


def _check_walk(fwd, fc, bwd, bc, want, keep, seq, hq, hkv):
    """Every pair the lists' items compute (visible under their element mask, or whole tiles without), per pass
    and head, against ``want`` [seq, seq]: each visible pair once, no other."""
    for what, table, consts, tiles, heads, group in (
            ("forward", fwd, fc, (gluon_attention.BLOCK_M, gluon_attention.TILES["BLOCK_N"]), hq, 1),
            ("backward", bwd, bc, (gluon_attention.BWD_TILES["BLOCK_M"], gluon_attention.BWD_TILES["BLOCK_N"]), hkv,
             hq // hkv)):
        seen = np.zeros((hq, seq, seq), np.int32)
        for kh in range(heads):
            for row in range(-(-seq // 128)):
                for g, rows, keys, vis in _walk(table, consts, seq, 0, kh, row, tiles, group, keep,
                                                transposed=what == "backward"):
                    vis = vis & (rows < seq) & (keys < seq)
                    np.add.at(seen[kh * group + g], (np.broadcast_to(rows, vis.shape)[vis],
                                                     np.broadcast_to(keys, vis.shape)[vis]), 1)
        assert seen.max() <= 1, f"{what}: a pair visited twice"
        for h in range(hq):
            np.testing.assert_array_equal(seen[h].astype(bool), want, err_msg=f"{what}, head {h}")


def test_dilated_window_backward_walks_lists_of_its_segment_ids():
    """The dilated window (its residues as segment ids, causal with a window): the backward now walks lists (the
    windows' persistent kernel takes no ids), each visible pair once against the rule by hand."""
    seq, options = 700, {"dilation": 3, "left": 300}
    i = np.arange(seq)
    ids = jnp.asarray((i % 3)[None].astype(np.int32))
    from ejgen.ops import settings

    cfg = AttentionConfig(seq_q=seq, seq_k=seq, causal=True, window=True, segments=True)
    assert gluon_attention.listed(cfg, False, "bwd") and not gluon_attention.listed(cfg, False, "fwd")
    with settings(gluon_spec_masks=False):
        assert not gluon_attention.listed(cfg, False, "bwd")
    ctx = {"q_seg": ids, "kv_seg": ids, "window_left": jnp.int32(300), "window_right": jnp.int32(0)}
    bwd, bc, _ = gluon_attention.bwd_lists(ctx, cfg, seq, 1)
    fwd, fc, _ = gluon_attention.fwd_lists(ctx, cfg, seq)  # (the forward walks ranges; its lists hold the same pairs)
    want = _dilated(i[:, None], i[None, :], options, seq)

    def keep(rows, keys):
        qs, ks = np.where(rows < seq, rows % 3, -1), np.where(keys < seq, keys % 3, -2)
        return (rows < seq) & (keys < seq) & (keys <= rows) & (rows - keys <= 300) & (qs == ks)

    _check_walk(np.asarray(fwd), fc, np.asarray(bwd), bc, want, keep, seq, 1, 1)


EXPLAIN_CASES = [  # (name, options as explain takes them, runtime features)
    ("natten_1d_attention", {}, {}), ("natten_2d_attention", {}, {}), ("sliding_tile_attention", {}, {}),
    ("sink_window_attention", {}, {}), ("paligemma_prefix_attention", {}, {}), ("prefix_lm_attention", {}, {}),
    ("dilated_window_attention", {}, {"causal": True, "sliding_window": (1023, 0)}),  # (gluon.host.NARROW_WINDOW)
]


@pytest.mark.parametrize("name,options,features", EXPLAIN_CASES, ids=[c[0] for c in EXPLAIN_CASES])
def test_zoo_masks_take_the_hopper_kernels(monkeypatch, name, options, features):
    """On sm_90 both passes of the zoo's mask variants take the Hopper set (before: the generated kernels, "the spec
    has a mask of its own"; the dilated window's backward: "segment ids with a sliding window"), the setting
    gluon_spec_masks being on by default; off, it keeps the spec masks on the generated kernels, saying so."""
    monkeypatch.delenv("EJGEN_GLUON_SPEC_MASKS", raising=False)
    from ejgen.ops import explain, settings

    q = jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
    choice = explain(_op(name), q, kv, kv, target="sm90", **options, **features)
    assert (choice.platform, choice.forward, choice.backward) == ("triton", "gluon", "gluon"), choice.text()
    spec = not _layout(name).builtin_mask_only
    assert ("the spec's mask on partial tiles" in choice.text()) == spec, choice.text()
    with settings(gluon_spec_masks=False):
        off = explain(_op(name), q, kv, kv, target="sm90", **options, **features)
    if spec:
        assert (off.forward, off.backward) == ("triton", "triton") and "gluon_spec_masks" in off.text(), off.text()
    else:  # the dilated window's mask is all segment key: its forward was on the Hopper set before
        assert (off.forward, off.backward) == ("gluon", "triton"), off.text()


def test_masks_the_hopper_kernels_cannot_call_keep_the_generated_kernels():
    """A spec mask the generated module does not hand over (one that reads params, or a package rendered before)
    is one clear reason for both passes."""
    layout = dataclasses.replace(_layout("paligemma_prefix_attention"), gluon_mask=False)
    cfg = AttentionConfig(seq_q=512, seq_k=512)
    q = jax.ShapeDtypeStruct((2, 512, 2, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 512, 2, 128), jnp.bfloat16)
    for pass_ in ("fwd", "bwd"):
        why = gluon_attention.ineligible(layout, cfg, q, kv, kv, False, pass_)
        assert why is not None and why.startswith("the spec has a mask of its own that the Hopper kernels cannot "
                                                  "call"), why
    assert layout.spec_mask() is None
    module = importlib.import_module("ejgen.zoo.paligemma_prefix_attention.triton_kernels")
    assert _layout("paligemma_prefix_attention").spec_mask() == (module._spec_mask, module._spec_options)


def test_spec_masks_reach_the_kernels_as_lists(monkeypatch):
    """NATTEN 2-D with GQA on a (pretended) Hopper GPU, forward and backward: both Gluon kernels get the generated
    module's mask with its position terms (docs/DESIGN.md §6): the forward `_spec_mask_staged` with the key side's two
    terms staged per block (KV_TERMS; KSEG is I32) and the query side's loader (SPEC_QTERMS), the backward the same
    with the query side's four staged per item (Q_TERMS from row Q_FIRST) and the key side's loader (SPEC_KVTERMS;
    `triton.host.STAGED_BACKWARD`), both `_spec_options_terms`; the lists of the mask's tiles (LIST; the forward's
    tiles in the order of their counts, its key blocks the wide ones: what divides positions is in the table) and the
    options in I32 where `_spec_options` reads them, the terms' table from I32[8]. A fake launch (the kernels' numbers
    are the GPU tests' business)."""
    seen = pretend_hopper(monkeypatch, sms=3)
    monkeypatch.delenv("EJGEN_GLUON_SPEC_MASKS", raising=False)  # on by default
    name, s, hq, hkv = "natten_2d_attention", 640, 4, 2
    q = jnp.ones((1, s, hq, 128), jnp.bfloat16)
    kv = jnp.ones((1, s, hkv, 128), jnp.bfloat16)
    jax.grad(lambda q: _op(name)(q, kv, kv, width=32, kernel=5, platform="triton").astype(jnp.float32).sum())(q)
    assert [k.__name__ for k, *_ in seen] == ["gluon_attention_fwd_kernel", "gluon_attention_bwd_kernel"]
    module = importlib.import_module(f"ejgen.zoo.{name}.triton_kernels")
    mask_tiles = _layout(name).mask_tiles
    ctx = {"opt_width": jnp.int32(32), "opt_kernel": jnp.int32(5)}
    cfg = AttentionConfig(seq_q=s, seq_k=s)
    assert seen[0][4]["BLOCK_N"] == gluon_attention.TILES["BLOCK_N"]  # no division left in the kernels' mask
    terms = np.asarray(_layout(name).position_terms(s, ctx)).ravel()
    lists = (gluon_attention.fwd_lists(ctx, cfg, s, mask_tiles, 1, hq, seen[0][4]["BLOCK_N"])[0],
             gluon_attention.bwd_lists(ctx, cfg, s, hkv, mask_tiles, 1, hq)[0])
    for (kernel, grid, inputs, outs, kw), table in zip(seen, lists):
        names = kernel.arg_names
        assert set(names[len(inputs) + len(outs):]) == set(kw) - {"zeroed", "aliases", "num_warps", "num_stages"}
        forward = kernel.__name__ == "gluon_attention_fwd_kernel"
        assert kw["SPEC_MASK"] is module._spec_mask_staged
        assert kw["SPEC_OPTIONS"] is module._spec_options_terms
        if forward:
            assert (kw["KV_TERMS"], kw["TERMS_AT"], kw["SPEC_QTERMS"]) == (2, 8, module._spec_q_terms), kw
        else:
            # the query side's four rows (2 .. 5) staged per item, the key side's read by `_spec_kv_terms`
            assert (kw["Q_TERMS"], kw["TERMS_AT"], kw["Q_FIRST"], kw["SPEC_KVTERMS"]) == (
                4, 8, 2, module._spec_kv_terms), kw
        assert kw["LIST"] and not kw["SEGMENTS"] and not kw["SUB_Q"], kw
        at = dict(zip(names, inputs))
        np.testing.assert_array_equal(at["RANGES"], table)
        # opt_width, opt_kernel: where `_spec_options` loads them; then the marker that keeps the array a literal
        # (`triton.host._packed`: window_left + 1), zeros up to I32[8] and the terms' table (6 rows of 768)
        assert at["I32"][2:8].tolist() == [32, 5, 1, 0, 0, 0]
        np.testing.assert_array_equal(at["I32"][8:], terms)
        if forward:
            np.testing.assert_array_equal(at["KSEG"], at["I32"])
    assert seen[0][4]["ORDERED"] and sorted(dict(zip(seen[0][0].arg_names, seen[0][2]))["ORDER"].tolist()) == list(
        range(5 * hq))
    assert seen[1][4]["MASK"] == 0 and seen[1][1] == (5, hkv)


# (name, options, sequence): masks with costly one-position terms (divisions by options), divisors of every sign
TERM_CASES = [
    ("natten_2d_attention", {"width": 40, "kernel": 5}, 500),
    ("natten_2d_attention", {"width": 7, "kernel": 3}, 250),
    ("natten_2d_attention", {"width": 0, "kernel": 3}, 130),  # a // 0 == 0, a % 0 == a: the DSL's
    ("sliding_tile_attention", {"tile_tokens": 16, "grid_h": 3, "grid_w": 2, "radius_t": 0, "radius_h": 1,
                                "radius_w": 0}, 300),
    ("sliding_tile_attention", {"tile_tokens": 5, "grid_h": -2, "grid_w": 3, "radius_t": 1, "radius_h": 0,
                                "radius_w": 1}, 250),
]


def test_position_terms_give_the_spec_mask():
    """The Hopper kernels' forms of a mask with costly one-position terms equal the spec's own `_spec_mask` on every
    pair of positions up to the table's end (the sequence rounded up to 256), in Triton's interpreter: the backward's
    `_spec_mask_terms` (the terms read from the table `_position_terms` forms on the host, appended to I32 by
    `Layout.gluon_scalars`) and `_spec_mask_staged` as the forward gives it its terms (the query side's from
    `_spec_q_terms`, the key side's rows as its producer loads them) and as the backward does (the query side's rows
    as its producer loads them, the key side's from `_spec_kv_terms`); NATTEN 2-D's and the sliding tile's terms are
    its divisions (docs/DESIGN.md §6, position terms)."""
    import triton
    import triton.language as tl

    from ejgen.runtime.attention.triton import host as triton_host
    from ejgen.runtime.launch import triton_call

    @triton.jit
    def both(F32, I32, I32T, OUT, S: tl.constexpr, WIDE: tl.constexpr, M: tl.constexpr, MASK: tl.constexpr,
             OPTIONS: tl.constexpr, MASK_T: tl.constexpr, OPTIONS_T: tl.constexpr, STAGED: tl.constexpr,
             Q_TERMS: tl.constexpr, KV: tl.constexpr, AT: tl.constexpr, KV_TERMS: tl.constexpr, NQ: tl.constexpr,
             Q_FIRST: tl.constexpr):
        q = tl.program_id(0) * M + tl.arange(0, M)[:, None]
        k = tl.program_id(1) * M + tl.arange(0, M)[None, :]
        zero = tl.program_id(0) * 0
        a = MASK(q, k, zero, zero, zero + S, zero + S, OPTIONS(F32, I32))
        opts = OPTIONS_T(F32, I32T)
        b = MASK_T(q, k, zero, zero, zero + S, zero + S, opts)
        # the Hopper forward's staged form: the key side's rows 0 .. KV - 1 as its producer loads them
        k0 = tl.load(I32T + AT + k)
        k1 = k0
        k2 = k0
        k3 = k0
        if KV > 1:
            k1 = tl.load(I32T + AT + WIDE + k)
        if KV > 2:
            k2 = tl.load(I32T + AT + 2 * WIDE + k)
        if KV > 3:
            k3 = tl.load(I32T + AT + 3 * WIDE + k)
        c = STAGED(q, k, Q_TERMS(q, zero + S, zero + S, opts), (k0, k1, k2, k3), zero, zero, zero + S, zero + S, opts)
        # the Hopper backward's: the query side's rows (from row Q_FIRST) as its producer loads them, the key side's
        # from `_spec_kv_terms`
        q0 = tl.load(I32T + AT + Q_FIRST * WIDE + q)
        q1 = q0
        q2 = q0
        q3 = q0
        if NQ > 1:
            q1 = tl.load(I32T + AT + (Q_FIRST + 1) * WIDE + q)
        if NQ > 2:
            q2 = tl.load(I32T + AT + (Q_FIRST + 2) * WIDE + q)
        if NQ > 3:
            q3 = tl.load(I32T + AT + (Q_FIRST + 3) * WIDE + q)
        d = STAGED(q, k, (q0, q1, q2, q3), KV_TERMS(k, zero + S, zero + S, opts), zero, zero, zero + S, zero + S, opts)
        tl.store(OUT + q * WIDE + k, a.to(tl.int32) * 8 + b.to(tl.int32) * 4 + c.to(tl.int32) * 2 + d.to(tl.int32))

    for name, options, seq in TERM_CASES:
        layout = _layout(name)
        module = layout.kernels()
        assert layout.position_terms is not None and layout.spec_mask() == (module._spec_mask_terms,
                                                                             module._spec_options_terms), name
        ctx = {"scale": 1.0, **{f"opt_{k}": jnp.int32(v) for k, v in options.items()}}
        f32, i32 = triton_host.scalar_arrays(ctx, layout.f32_options, layout.i32_options)
        i32_terms = layout.gluon_scalars([f32, i32], ctx, seq)[1]
        wide = -(-seq // 256) * 256
        assert i32_terms.shape[0] == layout.position_terms_at + len(layout.position_terms(seq, ctx).ravel())
        np.testing.assert_array_equal(i32_terms[:i32.shape[0]], i32)  # the scalars where `_spec_options` reads them
        staged, q_terms, kv, at = layout.staged_mask()
        assert at == layout.position_terms_at and 0 < kv <= 4, name
        staged_bwd, kv_terms, nq, at_bwd, q_first = layout.staged_bwd_mask()
        assert (staged_bwd, at_bwd) == (staged, at) and 0 < nq <= 4 and 0 <= q_first <= kv, name
        (ways,) = triton_call.launch(
            both, (wide // 64, wide // 64), [f32, i32, i32_terms], [jax.ShapeDtypeStruct((wide, wide), jnp.int32)],
            S=seq, WIDE=wide, M=64, MASK=module._spec_mask, OPTIONS=module._spec_options,
            MASK_T=module._spec_mask_terms, OPTIONS_T=module._spec_options_terms, STAGED=staged, Q_TERMS=q_terms,
            KV=kv, AT=at, KV_TERMS=kv_terms, NQ=nq, Q_FIRST=q_first)
        ways = np.asarray(ways)
        spec, terms, staged_form, staged_bwd_form = ways // 8, ways // 4 % 2, ways // 2 % 2, ways % 2
        if options.get("width") != 0:  # (a width of 0 hides every key, both ways)
            assert spec[:seq, :seq].any() and not spec[:seq, :seq].all(), (name, options)  # a mask worth the check
        np.testing.assert_array_equal(terms, spec, err_msg=f"{name} {options}: _spec_mask_terms")
        np.testing.assert_array_equal(staged_form, spec, err_msg=f"{name} {options}: _spec_mask_staged (forward)")
        np.testing.assert_array_equal(staged_bwd_form, spec, err_msg=f"{name} {options}: _spec_mask_staged (backward)")


STAGED_SPILL_BUDGET = 32  # bytes a thread (see `_check_zoo_compiles`)
ZOO_COMPILES = [  # one call's constexprs each: a mask whose divisions are position terms (staged per key block in the
    # forward), a light one in f16 / 64, one with causal
    dict(spec="ejgen.zoo.natten_2d_attention", causal=False),
    dict(spec="ejgen.zoo.paligemma_prefix_attention", causal=False, head_dim=64, dtype="float16"),
    dict(spec="ejgen.zoo.sink_window_attention", causal=True),
]


def _check_zoo_compiles(results):
    for kw, compiled in zip(ZOO_COMPILES, results):
        assert "error" not in compiled, (kw, compiled.get("error"))
        assert set(compiled) == {"gluon_fwd_kernel", "gluon_bwd_kernel"}, kw
        for name, meta in compiled.items():
            assert meta["warps"] == 12 and meta["cubin"] and meta["wgmma"], (kw, name)
            assert meta["shared"] <= 227 * 1024, (kw, name, meta["shared"])
            assert "ld.local" not in meta["ptx"], f"{kw} {name}: registers spilled (PTX)"  # (ptxas's own spills: stack)
            # NATTEN 2-D's forward with its key-side terms staged at 128-key tiles: Triton 3.9 spills 24 B a thread,
            # the GPU host's 3.6 none (measured there: 0.335 ms against 0.375 at 64-key tiles, H200, session 25); its
            # backward with the query-side terms staged (`triton.host.STAGED_BACKWARD`): 8 / 16 B (3.6 / 3.9)
            budget = STAGED_SPILL_BUDGET if "natten_2d" in kw["spec"] else 0
            assert meta["stack"] <= budget, f"{kw} {name}: {meta['stack']} B of registers spilled (SASS)"


def test_zoo_mask_kernels_compile_for_sm90():
    """The Hopper forward and backward with a spec's mask (`_spec_mask` called from the Gluon kernels) compile for
    sm_90: 12 warps, shared memory within Hopper's 227 KB, no spilled registers (the PTX's locals, the SASS's stack;
    NATTEN 2-D's divisions: position terms, the forward's key side staged in shared memory, the backward's mask
    before dP^T)."""
    from ejgen.testing.aot import compile_all_in_subprocess

    if not gluon_attention.importable()[0]:
        pytest.fail(gluon_attention.importable()[1])
    _check_zoo_compiles(compile_all_in_subprocess([dict(gluon=True, with_ptx=True, with_resources=True, **kw)
                                                   for kw in ZOO_COMPILES]))


STAGED_BWD_SPILL_BUDGET = 32  # bytes a thread: NATTEN 2-D 8 / 16, sliding tile 0 / 32 (Triton 3.6 / 3.9, session 25)


def test_the_backwards_position_term_forms_compile_for_sm90():
    """The Hopper backward's two forms of a mask with query-side position terms compile for sm_90 on both Tritons:
    the sliding tile's three shared rows staged per item by its producer (`triton.host.STAGED_BACKWARD`, the default;
    NATTEN 2-D's four in ZOO_COMPILES) and NATTEN 2-D's read from the table in the loop (`_spec_mask_terms`, the form
    with STAGED_BACKWARD off), their spills within STAGED_BWD_SPILL_BUDGET."""
    from ejgen.testing.aot import compile_all_in_subprocess, gpu_host_triton

    requests = [dict(gluon=True, spec=f"ejgen.zoo.{name}", causal=False, staged_backward=staged, backward_only=True,
                     with_resources=True)
                for name, staged in (("sliding_tile_attention", True), ("natten_2d_attention", False))]
    for triton in (None, gpu_host_triton()):
        for request, compiled in zip(requests, compile_all_in_subprocess(requests, triton=triton)):
            assert "error" not in compiled, (request, compiled.get("error"))
            meta = compiled["gluon_bwd_kernel"]
            assert meta["cubin"] and meta["wgmma"] and meta["warps"] == 12, request
            assert meta["stack"] <= STAGED_BWD_SPILL_BUDGET, (request["spec"], triton, meta["stack"])


def test_zoo_mask_kernels_compile_on_the_gpu_hosts_triton():
    """The same with the GPU host's Triton (EJGEN_GPU_HOST_TRITON: 3.6 where 3.9 is installed): a `triton.jit`
    helper called from `gluon.jit` code, its tuple of options across the warp-specialised partitions."""
    from ejgen.testing.aot import by_gpu_host_triton, compile_all_in_subprocess, gpu_host_triton

    results = compile_all_in_subprocess([dict(gluon=True, with_ptx=True, with_resources=True, **kw)
                                         for kw in ZOO_COMPILES], triton=gpu_host_triton())
    _check_zoo_compiles(results)
    assert all(by_gpu_host_triton(c) for r in results for c in r.values())


# -- on the GPU --------------------------------------------------------------------------------------------------
def _prefix_lm_mask(ix, options):
    return (ix.kv_idx <= ix.q_idx) | (ix.kv_idx < options["prefix_len"])


GPU_CASES = [  # (name, shape (B, S, Hq, Hkv, D), options, runtime features)
    ("natten_1d_attention", (1, 1000, 4, 2, 128), {"kernel": 201}, {}),
    ("natten_2d_attention", (2, 768, 2, 2, 64), {"width": 48, "kernel": 5}, {}),
    ("natten_2d_attention", (1, 2048, 2, 1, 128), {"width": 128, "kernel": 5}, {}),  # rows of whole key blocks
    ("sliding_tile_attention", (1, 1152, 2, 2, 128), {"tile_tokens": 48, "grid_h": 3, "grid_w": 2, "radius_t": 1,
                                                      "radius_h": 1, "radius_w": 0}, {}),
    ("sink_window_attention", (1, 1100, 4, 1, 128), {"sink_tokens": 5, "window": 300}, {}),
    ("paligemma_prefix_attention", (2, 900, 2, 2, 64), {"image_tokens": 200}, {}),
    ("prefix_lm_attention", (1, 1300, 4, 2, 128), {"prefix_len": 300}, {}),
    # (a window of 1024 keys: narrower ones take the generated backward, gluon.host.NARROW_WINDOW)
    ("dilated_window_attention", (1, 1200, 4, 2, 128), {"dilation": 3}, {"causal": True, "sliding_window": (1023, 0)}),
]


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on Hopper GPUs only (compile checks above)")
@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name,shape,options,features", GPU_CASES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}" for c in GPU_CASES])
def test_zoo_masks_on_the_hopper_kernels_match_the_oracle(monkeypatch, triton_launches, run_vjp, name, shape, options,
                                                          features, dynamic):
    """Each zoo mask variant (and prefix LM) on the Hopper kernels, bf16, GQA, ragged ends, 7 SMs (programs cross
    many tiles), static split and dynamic queue: outputs, lse and gradients against the float64 oracle (the variant's
    definition, tests/zoo/test_zoo.py); the spy shows the Gluon forward and backward ran with the spec's mask."""
    import oracle
    from ejgen.testing.shapes import AttnShape, random_cotangents, random_qkv, rng_for
    from test_zoo import ZOO

    monkeypatch.delenv("EJGEN_TRITON_CONFIG", raising=False)
    monkeypatch.setattr(gluon_attention, "num_sms", lambda: 7)
    monkeypatch.setenv("EJGEN_GLUON_DYNAMIC_TILES", "1" if dynamic else "0")
    if not gluon_attention.hopper():
        pytest.skip("not a Hopper GPU")
    b, s, hq, hkv, d = shape
    attn = AttnShape(b, s, s, hq, hkv, d)
    rng = rng_for(f"zoo-gluon-{name}-{shape}")
    diff = random_qkv(attn, "bfloat16", rng)
    d_out, d_lse = random_cotangents(attn, "bfloat16", rng)
    options = {k: jnp.int32(v) for k, v in options.items()}
    out, lse, grads = run_vjp(_op(name), diff, options, {**features, "platform": "triton"}, d_out, d_lse)
    spec = ZOO.get(name, {"mask": _prefix_lm_mask, "defaults": {"prefix_len": 0}, "compiled": {}})
    ref = oracle.attention(**{n: np.asarray(x) for n, x in diff.items()}, mask=spec["mask"],
                           options={**spec["defaults"], **{k: int(v) for k, v in options.items()}},
                           **spec["compiled"], **features, d_out=d_out, d_lse=d_lse)
    oracle.check_attention(out, lse, grads, ref, diff, "bfloat16")
    assert {p for p, _ in triton_launches} == {"fwd", "bwd"}, triton_launches
    mask = not _layout(name).builtin_mask_only  # else segment ids under a window: the backward's lists
    for pass_, kw in triton_launches:
        assert bool(kw["LIST"]) == (mask or pass_ == "bwd") and (kw["SPEC_MASK"] is not None) == mask, kw
