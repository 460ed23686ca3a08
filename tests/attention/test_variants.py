"""The generated variants (specs/*.yaml) against the hand-written oracle of each spec: outputs,
lse, every gradient (params included), options changed at runtime, and no retrace when an option
changes under jit."""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from conftest import ACCELERATOR_BACKENDS, BACKENDS, ON_GPU
from conformance import FULL
from oracle import TOLERANCE, assert_close
from ejgen.testing.shapes import (
    GQA_SHAPES,
    MHA_SHAPES,
    DTYPE_IDS,
    AttnShape,
    packed_segments,
    random_cotangents,
    random_qkv,
    random_sinks,
    rng_for,
)

pytestmark = pytest.mark.usefixtures("x64_stays_off")

def _variant(name: str):
    # Imported here so the suite collects while the generated package is being written.
    return getattr(importlib.import_module("ejgen.generated"), name)


def _mask_info():
    from ejgen.types import MaskInfo

    return MaskInfo


def make_params(variant: str, shape: AttnShape, rng) -> dict:
    """The spec's params, float32, with the spec's shapes (``heads`` = Hq)."""
    H = shape.q_heads
    if variant == "alibi_attention":
        # The usual ALiBi slopes 2^(-8 (h + 1) / H), jittered so that heads differ more.
        base = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)
        return {"slopes": jnp.asarray(base * rng.uniform(0.5, 1.5, H), jnp.float32)}
    if variant == "relative_bias_attention":
        return {"rel_table": jnp.asarray(rng.standard_normal((H, 33)), jnp.float32)}
    return {}


@dataclasses.dataclass(frozen=True)
class VariantCase:
    variant: str
    shape: AttnShape
    causal: bool = False  # runtime feature (alibi, relative_bias)
    sinks: str | None = None  # "h" [Hq], "hn" [Hq, 2], "n" [Hq + 1]
    segments: bool = False  # runtime feature (alibi)
    options: tuple = ()  # (name, value) pairs; absent options take the spec's default
    dtype: str = "float32"
    q_scale: float = 1.0  # larger logits, so that a compiled-in soft cap matters

    @property
    def id(self) -> str:
        parts = [self.variant.removesuffix("_attention")]
        parts += ["causal"] if self.causal else []
        parts += [f"sink_{self.sinks}"] if self.sinks else []
        parts += ["seg"] if self.segments else []
        parts += [f"{n}{v:g}" for n, v in self.options] or ["defaults"]
        parts += [f"qx{self.q_scale:g}"] if self.q_scale != 1.0 else []
        return "-".join(parts + [self.shape.id, DTYPE_IDS[self.dtype]])


G0, G1, G2, G3 = GQA_SHAPES
M0, M1, M2, M3 = MHA_SHAPES
LOCAL = "local_softcap_sinks_attention"
# G1's kind (odd, Sq > Sk: causal leaves rows empty, MQA, D = 72) at a third of its tiles: the interpreters run it
G1_SMALL = AttnShape(1, 45, 37, 4, 1, 72)

CASES = (
    VariantCase("alibi_attention", G0),
    VariantCase("alibi_attention", M0, causal=True),
    VariantCase("alibi_attention", G1_SMALL, causal=True, segments=True),
    VariantCase("alibi_attention", M2, options=(("max_distance", 8),)),
    VariantCase("alibi_attention", G3, causal=True, options=(("max_distance", 5),)),
    VariantCase("alibi_attention", G0, causal=True, segments=True, dtype="bfloat16"),
    VariantCase("prefix_lm_attention", G0),
    VariantCase("prefix_lm_attention", M0, options=(("prefix_len", 10),)),
    VariantCase("prefix_lm_attention", G1, sinks="h", options=(("prefix_len", 20),)),
    VariantCase("prefix_lm_attention", M2, sinks="hn", options=(("prefix_len", 5),)),
    VariantCase("prefix_lm_attention", G2, sinks="n", options=(("prefix_len", 30),)),
    VariantCase(
        "prefix_lm_attention", M0, sinks="h", options=(("prefix_len", 7),), dtype="bfloat16"
    ),
    VariantCase(LOCAL, G0, sinks="h", q_scale=4.0),
    VariantCase(LOCAL, M0, sinks="hn", q_scale=4.0),
    VariantCase(LOCAL, G1_SMALL, sinks="n", q_scale=4.0),  # Sq > Sk: queries with only the sinks
    VariantCase(LOCAL, G3, sinks="h", q_scale=4.0),
    VariantCase(LOCAL, M2, sinks="hn"),
    VariantCase(LOCAL, M0, sinks="h", q_scale=4.0, dtype="bfloat16"),
    VariantCase("relative_bias_attention", G0),
    VariantCase("relative_bias_attention", M0, causal=True),
    VariantCase("relative_bias_attention", G1, options=(("bias_scale", 0.5),)),
    VariantCase("relative_bias_attention", M2, causal=True, options=(("bias_scale", -2.0),)),
    VariantCase("relative_bias_attention", G3, causal=True),
    VariantCase("relative_bias_attention", G0, causal=True, dtype="bfloat16"),
)


# What the interpreters run in CI (every case runs on XLA, on the GPU host and with EJGEN_FULL_SUITE): each
# variant once with its runtime features, on a shape of two tiles or more on both axes; the params' gradients
# (alibi's slopes, relative_bias's table) in float32, at its tolerance; prefix_lm's mask in bf16.
INTERPRETED = (2, 11, 14, 19)


def _params() -> list:
    every = ON_GPU or FULL
    return [
        pytest.param(backend, case, id=f"{backend}-{case.id}")
        for backend in BACKENDS
        for i, case in enumerate(CASES)
        if backend not in ACCELERATOR_BACKENDS or every or i in INTERPRETED
    ]


def make_case_inputs(case: VariantCase, rng):
    """Returns ``(diff, rest, static, ref_kwargs)`` as in the conformance suite."""
    shape = case.shape
    diff = random_qkv(shape, case.dtype, rng)
    diff["query"] = (diff["query"].astype(jnp.float32) * case.q_scale).astype(case.dtype)
    params = make_params(case.variant, shape, rng)
    diff.update(params)
    rest, static, ref = {}, dict(case.options), {"params": params, "options": dict(case.options)}
    if case.causal:
        static["causal"] = ref["causal"] = True
    if case.sinks:
        diff["softmax_aux"] = random_sinks(case.sinks, shape.q_heads, rng)
    if case.segments:
        qseg = packed_segments(shape.batch, shape.q_len, rng)
        kseg = packed_segments(shape.batch, shape.kv_len, rng)
        rest["mask_info"] = _mask_info().from_segments(jnp.asarray(qseg), jnp.asarray(kseg))
        ref.update(q_segment_ids=qseg, kv_segment_ids=kseg)
    return diff, rest, static, ref


def _numpy_inputs(diff: dict, params: dict) -> dict:
    return {n: np.asarray(x) for n, x in diff.items() if n not in params}


@pytest.mark.parametrize("backend,case", _params())
def test_variant_matches_oracle(backend, run_vjp, case):
    op = _variant(case.variant)
    rng = rng_for(case.id)
    diff, rest, static, ref_kwargs = make_case_inputs(case, rng)
    d_out, d_lse = random_cotangents(case.shape, case.dtype, rng)
    out, lse, grads = run_vjp(op, diff, rest, {**static, "platform": backend}, d_out, d_lse)
    ref = oracle.variant_attention(
        case.variant, **_numpy_inputs(diff, ref_kwargs["params"]), **ref_kwargs,
        d_out=d_out, d_lse=d_lse,
    )
    assert out.shape == case.shape.out and lse.shape == case.shape.lse
    oracle.check_attention(out, lse, grads, ref, diff, case.dtype)


def test_variant_cases_cover_the_plan():
    """Each variant with and without GQA, in f32 and bf16, with every runtime feature and every
    option away from its default; param gradients for both variants with params."""
    for name in oracle.VARIANTS:
        cases = [c for c in CASES if c.variant == name]
        assert {c.shape.gqa for c in cases} == {True, False}, name
        assert {c.dtype for c in cases} == {"float32", "bfloat16"}, name
        defaults = oracle.VARIANTS[name]["defaults"]
        changed = {n for c in cases for n, v in c.options if v != defaults[n]}
        assert changed == set(defaults), name
        assert any(not c.options for c in cases), f"{name}: no case leaves the options default"
    assert any(c.causal for c in CASES if c.variant == "alibi_attention")
    assert any(c.segments for c in CASES if c.variant == "alibi_attention")
    assert any(c.causal for c in CASES if c.variant == "relative_bias_attention")
    assert {c.sinks for c in CASES if c.variant == LOCAL} == {"h", "hn", "n"}
    assert {c.sinks for c in CASES if c.variant == "prefix_lm_attention"} == {None, "h", "hn", "n"}


def test_the_interpreters_run_every_variant_on_whole_tiles():
    """In CI each interpreted backend runs every variant on a shape of two tiles or more on both axes of that
    backend, those with params in float32, and a 16-bit dtype among them."""
    import test_conformance

    cases = [CASES[i] for i in INTERPRETED]
    assert {c.dtype for c in cases} == {"float32", "bfloat16"}
    for name in oracle.VARIANTS:
        mine = [c for c in cases if c.variant == name]
        assert mine, name
        if make_params(name, mine[0].shape, np.random.default_rng(0)):
            assert any(c.dtype == "float32" for c in mine), name
        for backend in ACCELERATOR_BACKENDS:
            assert any(test_conformance.SUITE.nondegenerate(backend, {"shape": c.shape, "dtype": c.dtype})
                       for c in mine), (name, backend)


# What the option tests are about is the option, not the tiles: a small shape of two tiles or more on both axes of
# each interpreter (Triton's 16 x 16, Pallas' 32 x 16), GQA, ragged ends.
OPTION_SHAPE = AttnShape(1, 40, 37, 2, 1, 16)
OPTION_SWEEPS = {
    "prefix_lm-prefix_len": ("prefix_lm_attention", "prefix_len", (0, 10, 40), OPTION_SHAPE),
    "alibi-max_distance": ("alibi_attention", "max_distance", (1024, 8, 2), OPTION_SHAPE),
    "relative_bias-bias_scale": ("relative_bias_attention", "bias_scale", (1.0, 0.5, -2.0), OPTION_SHAPE),
}


@pytest.mark.parametrize("sweep", OPTION_SWEEPS.values(), ids=OPTION_SWEEPS.keys())
def test_option_changes_at_runtime_without_retrace(backend, sweep):
    """An option is a runtime scalar (docs/DESIGN.md §2): passed as a traced jit argument, each value gives
    the oracle's result, and the jitted function is traced once."""
    name, option, values, shape = sweep
    op = _variant(name)
    rng = rng_for("sweep", name, option)
    x = random_qkv(shape, "float32", rng)
    params = make_params(name, shape, rng)
    traces = []

    @jax.jit
    def f(q, k, v, params, value):
        traces.append(None)  # runs only while tracing
        return op(q, k, v, **params, **{option: value}, platform=backend, return_lse=True)

    outs = []
    for value in values:
        out, lse = f(x["query"], x["key"], x["value"], params, value)
        ref = oracle.variant_attention(
            name, *(np.asarray(x[n]) for n in ("query", "key", "value")),
            params={n: np.asarray(p) for n, p in params.items()}, options={option: value},
        )
        assert_close(f"out {option}={value}", out, ref.out, TOLERANCE["float32"])
        assert_close(f"lse {option}={value}", lse, ref.lse, TOLERANCE["float32"])
        outs.append(np.asarray(out))
    assert len(traces) == 1, f"traced {len(traces)} times for {len(values)} values of {option}"
    assert not np.allclose(outs[0], outs[1]) and not np.allclose(outs[1], outs[2]), (
        f"{option} made no difference: the sweep tests nothing"
    )


# An option's default is the generated function's own keyword default, filled in before a platform is chosen
# (generated/<name>/op.py): one backend shows it. The interpreted backends meet the defaults against the oracle
# (test_variant_matches_oracle's INTERPRETED: alibi and relative_bias with defaults) and every option at three values
# (test_option_changes_at_runtime_without_retrace).
@pytest.mark.parametrize("backend", ["xla"])
def test_options_default_to_the_spec(backend):
    """Leaving an option out equals passing the spec's default."""
    shape = OPTION_SHAPE
    rng = rng_for("defaults")
    x = random_qkv(shape, "float32", rng)
    for name, spec in oracle.VARIANTS.items():
        if not spec["defaults"]:
            continue
        op = _variant(name)
        params = make_params(name, shape, rng)
        q, k, v = x["query"], x["key"], x["value"]
        implicit = op(q, k, v, **params, platform=backend)
        explicit = op(q, k, v, **params, **spec["defaults"], platform=backend)
        assert_close(f"{name} default", implicit, explicit, TOLERANCE["float32"])
