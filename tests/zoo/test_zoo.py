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
from ejgen.testing.shapes import DTYPE_IDS, AttnShape, random_cotangents, random_qkv, rng_for

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


def t5_score(s, ix, params, options):
    return s + oracle.param_at(params["table"], ix.h, t5_bucket(ix.q_idx, ix.kv_idx, options["max_distance"]))


ZOO = {
    "chunked_local_attention": dict(mask=chunked_mask, defaults={"chunk": 8192}, compiled={"causal": True}),
    "dilated_window_attention": dict(mask=dilated_mask, defaults={"dilation": 2}, compiled={}),
    "t5_relative_attention": dict(score=t5_score, defaults={"max_distance": 128}, compiled={}),
}


@dataclasses.dataclass(frozen=True)
class ZooCase:
    variant: str
    shape: AttnShape
    options: tuple = ()
    static: tuple = ()  # runtime features: causal, sliding_window
    dtype: str = "float32"

    @property
    def id(self) -> str:
        parts = [self.variant.removesuffix("_attention")] + [f"{n}{v}" for n, v in self.options + self.static]
        return "-".join(parts + [self.shape.id, DTYPE_IDS[self.dtype]]).replace(" ", "")


S_ODD, S_SQUARE, S_WIDE = AttnShape(2, 37, 41, 4, 2, 32), AttnShape(1, 64, 64, 2, 2, 64), AttnShape(1, 50, 35, 6, 2, 40)
S_NEAR = AttnShape(1, 12, 14, 2, 2, 16)  # distances below 16: T5's default max_distance has no bucket edge here
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
)
INTERPRETED = (0, 1, 4, 7, 8, 11)  # each variant in float32 on two tiles or more, and in bf16


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
    params = {}
    if case.variant == "t5_relative_attention":
        params["table"] = jnp.asarray(rng.standard_normal((case.shape.q_heads, 32)), jnp.float32)
    diff.update(params)
    options, static = dict(case.options), dict(case.static)
    d_out, d_lse = random_cotangents(case.shape, case.dtype, rng)
    out, lse, grads = run_vjp(_zoo_op(case.variant), diff, options, {**static, "platform": backend}, d_out, d_lse)
    ref = oracle.attention(**{n: np.asarray(x) for n, x in diff.items() if n not in params},
                           score=spec.get("score"), mask=spec.get("mask"), params=params,
                           options={**spec["defaults"], **options}, **spec["compiled"], **static,
                           d_out=d_out, d_lse=d_lse)
    oracle.check_attention(out, lse, grads, ref, diff, case.dtype)


def test_zoo_cases_cover_each_variant():
    for name in ZOO:
        cases = [c for c in CASES if c.variant == name]
        assert {c.dtype for c in cases} >= {"float32", "bfloat16"}, name
        assert any(not c.options for c in cases), f"{name}: the defaults"
        interpreted = [CASES[i] for i in INTERPRETED if CASES[i].variant == name]
        assert {c.dtype for c in interpreted} == {"float32", "bfloat16"}, name


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_kernels_compile_for_sm90(name):
    """Every zoo variant's Triton kernels (forward, dK/dV, dQ) compile ahead of time for an H100 (no GPU here)."""
    from ejgen.testing.aot import compile_in_subprocess

    params = {"table": "float32"} if name == "t5_relative_attention" else None
    compiled = compile_in_subprocess("ejgen.zoo", name, causal=True, params=params)
    assert set(compiled) == {"fwd_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel"}
    assert all(c["cubin"] and c["shared"] <= 227 * 1024 for c in compiled.values()), compiled
