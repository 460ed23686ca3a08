"""The spec zoo (zoo/*.yaml, built into ejgen.zoo) and the DSL's integer arithmetic on every backend: each variant
against an oracle written here from its paper's definition (jnp, float64: `oracle.attention` with a score / mask
hook), outputs, lse and every gradient (the learnable tables included); and one spec that uses every function
and operator of docs/DESIGN.md §2 added for the zoo (`//`, `%`, floor, ceil, round, int, float, clamp, sign,
log2, exp2), built here, against the same definitions."""

from __future__ import annotations

import dataclasses
import importlib

import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from conftest import ACCELERATOR_BACKENDS, BACKENDS, ON_GPU
from conformance import FULL
from ejgen.types import MaskInfo
from ejgen.testing.shapes import DTYPE_IDS, AttnShape, random_cotangents, random_qkv, random_sinks, rng_for

pytestmark = pytest.mark.usefixtures("x64_stays_off")


def chunked_mask(ix, options):
    # Llama 4: causal (compiled in) within chunks of `chunk` tokens
    return ix.q_idx // options["chunk"] == ix.kv_idx // options["chunk"]


def dilated_mask(ix, options):
    # every dilation-th key, counted from the query (Python's % of a negative difference)
    return (ix.q_idx - ix.kv_idx) % options["dilation"] == 0


def t5_bucket(q_idx, kv_idx, max_distance):
    """T5's bidirectional relative_position_bucket (num_buckets 32, max_exact 8), as in its reference code:
    memory - query, the positive side shifted by 16, logarithmic past 8, truncated toward zero, capped at 15."""
    n = kv_idx - q_idx
    ret = jnp.where(n > 0, 16, 0)
    a = jnp.abs(n)
    ratio = jnp.log(jnp.maximum(a, 1) / 8.0) / np.log(max_distance / 8.0) * 8.0
    large = jnp.minimum(8 + jnp.trunc(ratio).astype(jnp.int32), 15)
    return ret + jnp.where(a < 8, a, large)


def natten_1d_mask(ix, options):
    # the kernel nearest keys: a window of `kernel` starting kernel // 2 before the query, moved inside [0, kv_len)
    k = options["kernel"]
    start = jnp.clip(ix.q_idx - k // 2, 0, ix.kv_len - k)
    return (ix.kv_idx >= start) & (ix.kv_idx < start + k)


def natten_2d_mask(ix, options):
    # cells (idx // width, idx % width) of a grid of width columns; a kernel x kernel neighbourhood per axis
    w, k = options["width"], options["kernel"]
    ok = True
    for q, kv, n in ((ix.q_idx // w, ix.kv_idx // w, ix.kv_len // w), (ix.q_idx % w, ix.kv_idx % w, w)):
        start = jnp.clip(q - k // 2, 0, n - k)
        ok = ok & (kv >= start) & (kv < start + k)
    return ok


def sink_window_mask(ix, options):
    # StreamingLLM: the first sink_tokens keys and the latest `window` ones (causal compiled in)
    return (ix.kv_idx < options["sink_tokens"]) | (ix.q_idx - ix.kv_idx < options["window"])


def paligemma_mask(ix, options):
    # causal, and the image tokens see each other both ways
    n = options["image_tokens"]
    return (ix.kv_idx <= ix.q_idx) | ((ix.q_idx < n) & (ix.kv_idx < n))


def sliding_tile_mask(ix, options):
    # tiles of tile_tokens tokens in (time, row, column) order over grid_h x grid_w tiles a frame; a box of radii
    tokens, gh, gw = options["tile_tokens"], options["grid_h"], options["grid_w"]
    ok = True
    for axis, radius in enumerate((options["radius_t"], options["radius_h"], options["radius_w"])):
        coord = [lambda t: t // (gh * gw), lambda t: (t // gw) % gh, lambda t: t % gw][axis]
        ok = ok & (jnp.abs(coord(ix.q_idx // tokens) - coord(ix.kv_idx // tokens)) <= radius)
    return ok


def flamingo_mask(ix, options, latest):
    # text token i sees the tokens of image latest[b, i] (keys: image_tokens per image, one image after another)
    return ix.kv_idx // options["image_tokens"] == latest[ix.b, ix.q_idx]


def alibi_fixed_score(s, ix, params, options):
    # Press et al.: head h's slope 2^(-8 (h + 1) / H), the bias -slope * |i - j|
    slope = 2.0 ** (-8.0 * (ix.h + 1) / options["num_heads"])
    return s - slope * jnp.abs(ix.q_idx - ix.kv_idx)


def t5_score(s, ix, params, options):
    return s + oracle.param_at(params["table"], ix.h, t5_bucket(ix.q_idx, ix.kv_idx, options["max_distance"]))


ZOO = {
    "chunked_local_attention": dict(mask=chunked_mask, defaults={"chunk": 8192}, compiled={"causal": True}),
    "dilated_window_attention": dict(mask=dilated_mask, defaults={"dilation": 2}, compiled={}),
    "t5_relative_attention": dict(score=t5_score, defaults={"max_distance": 128}, compiled={}),
    "natten_1d_attention": dict(mask=natten_1d_mask, defaults={"kernel": 7}, compiled={}),
    "natten_2d_attention": dict(mask=natten_2d_mask, defaults={"width": 16, "kernel": 3}, compiled={}),
    "sink_window_attention": dict(mask=sink_window_mask, defaults={"sink_tokens": 4, "window": 1024},
                                  compiled={"causal": True}),
    "gpt_oss_attention": dict(defaults={}, compiled={"causal": True, "sliding_window": (127, 0)}),
    "gemma2_attention": dict(defaults={}, compiled={"causal": True, "logits_soft_cap": 50.0}),
    "paligemma_prefix_attention": dict(mask=paligemma_mask, defaults={"image_tokens": 256}, compiled={}),
    "alibi_fixed_attention": dict(score=alibi_fixed_score, defaults={"num_heads": 16}, compiled={}),
    "causal_attention": dict(defaults={}, compiled={"causal": True}),
    "sliding_window_attention": dict(defaults={}, compiled={"causal": True}),
    "document_attention": dict(defaults={}, compiled={"causal": True}),
    "gemma3_local_attention": dict(defaults={}, compiled={"causal": True, "sliding_window": (1023, 0)}),
    "flamingo_cross_attention": dict(mask=flamingo_mask, defaults={"image_tokens": 64}, compiled={}),
    "sliding_tile_attention": dict(mask=sliding_tile_mask, defaults=dict(
        tile_tokens=128, grid_h=4, grid_w=4, radius_t=1, radius_h=1, radius_w=1), compiled={}),
}
# made of built-in features only (each covered by the attention suite): one interpreted case each is enough
FEATURES_ONLY = ("causal_attention", "sliding_window_attention", "document_attention", "gemma3_local_attention",
                 "gpt_oss_attention", "gemma2_attention")


@dataclasses.dataclass(frozen=True)
class ZooCase:
    variant: str
    shape: AttnShape
    options: tuple = ()
    static: tuple = ()  # runtime features: causal, sliding_window
    dtype: str = "float32"
    sinks: str | None = None  # softmax_aux as random_sinks gives it ("h": one per head)
    q_scale: float = 1.0  # larger logits, where a soft cap must matter
    documents: bool = False  # segment ids: random documents, a one-token one, padding at the end

    @property
    def id(self) -> str:
        parts = [self.variant.removesuffix("_attention")] + [f"{n}{v}" for n, v in self.options + self.static]
        parts += [f"sink_{self.sinks}"] if self.sinks else []
        parts += [f"qx{self.q_scale:g}"] if self.q_scale != 1.0 else []
        parts += ["docs"] if self.documents else []
        return "-".join(parts + [self.shape.id, DTYPE_IDS[self.dtype]]).replace(" ", "")


S_ODD, S_SQUARE, S_WIDE = AttnShape(2, 37, 41, 4, 2, 32), AttnShape(1, 64, 64, 2, 2, 64), AttnShape(1, 50, 35, 6, 2, 40)
S_NEAR = AttnShape(1, 12, 14, 2, 2, 16)  # distances below 16: T5's default max_distance has no bucket edge here
S_GRID, S_GRID6 = AttnShape(1, 64, 64, 2, 2, 32), AttnShape(1, 48, 48, 2, 1, 16)  # 8 x 8 and 8 x 6 grids
S_LONG = AttnShape(1, 150, 150, 2, 1, 16)  # past gpt-oss's window of 128
CASES = (
    ZooCase("chunked_local_attention", S_ODD, (("chunk", 8),)),
    ZooCase("chunked_local_attention", S_SQUARE, (("chunk", 16),), dtype="bfloat16"),  # whole tiles per chunk
    ZooCase("chunked_local_attention", S_WIDE, (("chunk", 5),)),  # Sq > Sk: rows aligned bottom-right
    ZooCase("chunked_local_attention", S_NEAR),  # the default chunk: plain causal here
    ZooCase("dilated_window_attention", S_ODD, (("dilation", 3),), (("causal", True), ("sliding_window", (12, 0)))),
    ZooCase("dilated_window_attention", S_SQUARE, (("dilation", 4),), (("sliding_window", (9, 6)),)),
    ZooCase("dilated_window_attention", S_NEAR),
    ZooCase("dilated_window_attention", S_WIDE, (("dilation", 2),), (("causal", True),), dtype="bfloat16"),
    ZooCase("t5_relative_attention", S_ODD, (("max_distance", 100),)),
    ZooCase("t5_relative_attention", S_SQUARE, (("max_distance", 60),), (("causal", True),)),
    ZooCase("t5_relative_attention", S_NEAR),
    ZooCase("t5_relative_attention", S_WIDE, (("max_distance", 100),), dtype="bfloat16"),
    ZooCase("natten_1d_attention", S_SQUARE),
    ZooCase("natten_1d_attention", AttnShape(1, 45, 45, 2, 2, 32), (("kernel", 9),), dtype="bfloat16"),
    ZooCase("natten_1d_attention", S_NEAR, (("kernel", 16),)),  # more keys asked than there are: all of them
    ZooCase("natten_2d_attention", S_GRID, (("width", 8),)),
    ZooCase("natten_2d_attention", S_GRID6, (("width", 6), ("kernel", 5)), dtype="bfloat16"),
    ZooCase("natten_2d_attention", AttnShape(1, 48, 48, 2, 2, 16)),  # the defaults: 3 rows of 16
    ZooCase("sink_window_attention", S_ODD, (("sink_tokens", 3), ("window", 9))),
    ZooCase("sink_window_attention", S_SQUARE, (("sink_tokens", 2), ("window", 16)), dtype="bfloat16"),
    ZooCase("sink_window_attention", S_NEAR),
    ZooCase("gpt_oss_attention", S_LONG, sinks="h"),
    ZooCase("gpt_oss_attention", S_LONG, sinks="h", dtype="bfloat16"),
    ZooCase("gemma2_attention", S_ODD, static=(("sliding_window", (10, 0)),), q_scale=60.0),
    ZooCase("gemma2_attention", S_SQUARE, dtype="bfloat16", q_scale=60.0),
    ZooCase("paligemma_prefix_attention", S_ODD, (("image_tokens", 13),)),
    ZooCase("paligemma_prefix_attention", S_SQUARE, (("image_tokens", 20),), dtype="bfloat16"),
    ZooCase("paligemma_prefix_attention", S_NEAR),  # every token an image token: bidirectional
    ZooCase("alibi_fixed_attention", S_ODD, (("num_heads", 4),), (("causal", True),)),
    ZooCase("alibi_fixed_attention", S_WIDE, (("num_heads", 6),), dtype="bfloat16"),
    ZooCase("alibi_fixed_attention", S_NEAR),
    ZooCase("causal_attention", S_WIDE),
    ZooCase("causal_attention", S_ODD, dtype="bfloat16"),
    ZooCase("sliding_window_attention", S_ODD, static=(("sliding_window", (9, 0)),)),
    ZooCase("sliding_window_attention", S_SQUARE, static=(("sliding_window", (16, 0)),), dtype="bfloat16"),
    ZooCase("document_attention", S_ODD, documents=True),
    ZooCase("document_attention", S_SQUARE, documents=True, dtype="bfloat16"),
    ZooCase("gemma3_local_attention", S_ODD, static=(("logits_soft_cap", 20.0),), q_scale=30.0),
    ZooCase("gemma3_local_attention", S_SQUARE, static=(("logits_soft_cap", 20.0),), q_scale=30.0, dtype="bfloat16"),
    ZooCase("sliding_tile_attention", AttnShape(1, 48, 48, 2, 1, 16),  # 2 frames of 2 x 3 tiles of 4 tokens
            (("tile_tokens", 4), ("grid_h", 2), ("grid_w", 3), ("radius_t", 1), ("radius_h", 0), ("radius_w", 1))),
    ZooCase("sliding_tile_attention", AttnShape(1, 128, 128, 2, 1, 32),  # 2 frames of 2 x 2 tiles of 16 tokens
            (("tile_tokens", 16), ("grid_h", 2), ("grid_w", 2), ("radius_t", 0), ("radius_h", 1), ("radius_w", 0)),
            dtype="bfloat16"),
    ZooCase("sliding_tile_attention", S_NEAR),  # the defaults: one tile
    ZooCase("flamingo_cross_attention", AttnShape(2, 45, 40, 4, 2, 32), (("image_tokens", 8),)),  # 5 images
    ZooCase("flamingo_cross_attention", AttnShape(1, 64, 48, 2, 2, 32), (("image_tokens", 16),), dtype="bfloat16"),
    ZooCase("flamingo_cross_attention", S_NEAR),  # the defaults: one image, part of it
    # the Hopper kernels' shapes (bf16, Sq == Sk, D 64), where a GPU runs the segment keys on them (§5, Segment keys)
    ZooCase("flamingo_cross_attention", AttnShape(1, 128, 128, 2, 1, 64), (("image_tokens", 16),), dtype="bfloat16"),
    ZooCase("dilated_window_attention", AttnShape(1, 128, 128, 2, 1, 64), (("dilation", 3),),
            (("causal", True), ("sliding_window", (40, 0))), dtype="bfloat16"),
)
# in the interpreters (every case on xla, on the GPU host and with EJGEN_FULL_SUITE): each variant once, on a shape of
# two tiles or more on both axes of both interpreters (gpt-oss: past its window), the cheaper in Triton's interpreter
# (its tile pairs), float32 and bf16 both among them (each variant in both dtypes on xla)
INTERPRETED = (1, 5, 9, 13, 16, 19, 22, 24, 26, 28, 32, 34, 36, 38, 39, 43)


def _params():
    return [pytest.param(backend, case, id=f"{backend}-{case.id}")
            for backend in BACKENDS for i, case in enumerate(CASES)
            if backend not in ACCELERATOR_BACKENDS or ON_GPU or FULL or i in INTERPRETED]


def _zoo_op(name):
    return getattr(importlib.import_module("ejgen.zoo"), name)


@pytest.mark.parametrize("backend,case", _params())
def test_zoo_variant_matches_its_definition(backend, run_vjp, case):
    spec = ZOO[case.variant]
    rng = rng_for("zoo", case.id)
    diff = random_qkv(case.shape, case.dtype, rng)
    diff["query"] = (diff["query"].astype(jnp.float32) * case.q_scale).astype(case.dtype)
    if case.sinks:
        diff["softmax_aux"] = random_sinks(case.sinks, case.shape.q_heads, rng)
    documents = _documents(case.shape, rng) if case.documents else {}
    params = {}
    if case.variant == "t5_relative_attention":
        params["table"] = jnp.asarray(rng.standard_normal((case.shape.q_heads, 32)), jnp.float32)
    diff.update(params)
    options, static = dict(case.options), dict(case.static)
    mask = spec.get("mask")
    if case.variant == "flamingo_cross_attention":  # the latest image per text token, -1 before the first
        n_images = -(-case.shape.kv_len // dict(case.options).get("image_tokens", 64))
        starts = np.sort(rng.integers(0, case.shape.q_len, (case.shape.batch, n_images)), axis=1)
        latest = (np.sum(np.arange(case.shape.q_len)[None, :, None] >= starts[:, None, :], axis=2) - 1).astype(np.int32)
        options["latest"] = jnp.asarray(latest)
        mask = lambda ix, opts, f=mask: f(ix, opts, jnp.asarray(latest))  # noqa: E731
    d_out, d_lse = random_cotangents(case.shape, case.dtype, rng)
    info = {"mask_info": MaskInfo.from_segments(*documents.values())} if documents else {}
    out, lse, grads = run_vjp(_zoo_op(case.variant), diff, {**options, **info}, {**static, "platform": backend},
                              d_out, d_lse)
    options.pop("latest", None)
    ref = oracle.attention(**{n: np.asarray(x) for n, x in diff.items() if n not in params},
                           score=spec.get("score"), mask=mask, params=params,
                           options={**spec["defaults"], **options}, **spec["compiled"], **static, **documents,
                           d_out=d_out, d_lse=d_lse)
    oracle.check_attention(out, lse, grads, ref, diff, case.dtype)


def _documents(shape, rng) -> dict:
    """Segment ids [B, S]: documents of random lengths, the first one token long, the last two rows padding."""
    ids = []
    for s in (shape.q_len, shape.kv_len):
        cuts = np.sort(rng.choice(np.arange(2, s - 2), size=3, replace=False))
        row = np.searchsorted(np.concatenate([[1], cuts]), np.arange(s), side="right").astype(np.int32)
        row[-2:] = -1
        ids.append(np.broadcast_to(row, (shape.batch, s)).copy())
    return {"q_segment_ids": ids[0], "kv_segment_ids": ids[1]}


def test_zoo_cases_cover_each_variant():
    import test_conformance  # the interpreters' tiles

    for name in ZOO:
        cases = [c for c in CASES if c.variant == name]
        assert {c.dtype for c in cases} >= {"float32", "bfloat16"}, name
        assert any(not c.options for c in cases) or not ZOO[name]["defaults"], f"{name}: the defaults"
        interpreted = [CASES[i] for i in INTERPRETED if CASES[i].variant == name]
        assert len(interpreted) == 1, name
        if name in FEATURES_ONLY:
            assert interpreted[0].dtype == "bfloat16", name
        for backend in ACCELERATOR_BACKENDS:
            assert test_conformance.SUITE.nondegenerate(
                backend, {"shape": interpreted[0].shape, "dtype": interpreted[0].dtype}), (name, backend)
    assert {CASES[i].dtype for i in INTERPRETED if CASES[i].variant not in FEATURES_ONLY} == {"float32", "bfloat16"}


# What the compiles are about is the arithmetic's types, not the tiles: 64 x 32 blocks (a third of the compile time of
# the default 128 x 64 from a cold Triton cache, as CI's is), both variants in one process
ZOO_COMPILES = {"natten_2d_attention": dict(tile_ranges=True, tile_lists=True, tma=True),
                "t5_relative_attention": dict(params={"table": "float32"})}


def test_zoo_kernels_compile_for_sm90():
    """The Triton kernels (forward, dK/dV, dQ) of the variants with integer arithmetic compile ahead of time for
    an H100 (no GPU here): `//`, `%`, clamp, int, float, log in the mask and in a param's index (the others
    only combine features the core specs' compile checks cover). NATTEN's mask is beyond the affine analysis:
    its kernels walk tile lists (`_mask_tiles`), as they do on a GPU."""
    from ejgen.testing.aot import compile_all_in_subprocess

    requests = [dict(package="ejgen.zoo", name=name, causal=True, block_m=64, block_n=32, **kw)
                for name, kw in ZOO_COMPILES.items()]
    for name, compiled in zip(ZOO_COMPILES, compile_all_in_subprocess(requests)):
        assert "error" not in compiled, (name, compiled.get("error"))
        assert set(compiled) == {"fwd_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel"}, name
        assert all(c["cubin"] and c["shared"] <= 227 * 1024 for c in compiled.values()), (name, compiled)
