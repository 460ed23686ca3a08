"""Every DSL function and operator runs on every backend, forward and gradients, against the float64
oracle (docs/DESIGN.md §2, §3): specs written for the purpose are built into a package of their own, and
each has a hand-written oracle hook. Integer powers of negative logits, where the base is negative half
the time, are among them: Triton once printed `x ** 5` as `exp(5 log x)`, zero output for a negative x."""

from __future__ import annotations

import importlib
import os

import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from conftest import on_path
from ejgen.cli import main
from ejgen.testing.shapes import AttnShape, random_cotangents, random_qkv, rng_for

pytestmark = pytest.mark.usefixtures("x64_stays_off")
PACKAGE = "dsl_functions_ops"

SPECS = {
    "powers": """\
name: powers
family: attention
features: {gqa: runtime}
doc: Integer powers of the logit, odd and even, of negative bases too.
params:
  w: {shape: [heads], dtype: float32, grad: true}
score: >
  s + 0.01 * s ** 5 - 0.05 * s ** 2 + w[h] * s ** 3 / 10 + 0.001 * s ** 6 + 0.5 * s ** 1 + s ** 0
  + abs(s) ** 1.5 / 4 + (1.0 + abs(s)) ** w[h] + (1.0 + s * s) ** -2 + (2.0 + abs(s)) ** -w[h]
""",
    "transcendental": """\
name: transcendental
family: attention
features: {gqa: runtime}
doc: exp, log, sqrt, sigmoid, tanh, abs, min, max, where and division in one score.
params:
  g: {shape: [heads], dtype: float32, grad: true}
score: >
  where(s > 0.0, sqrt(s + 1.0) * log(1.0 + exp(-abs(s))), max(s, -2.0) * sigmoid(g[h]))
  + tanh(s) * min(s, 1.0) / (2.0 + abs(g[h]))
""",
    "masked_functions": """\
name: masked_functions
family: attention
doc: A mask built from abs, max, not, and, or.
features:
  causal: runtime
  gqa: runtime
mask: (max(q_idx - kv_idx, 0) < 20 and not (kv_idx == 5)) or abs(q_idx - kv_idx) <= 1
""",
}


def powers(s, ix, params, options):
    w = oracle.param_at(params["w"], ix.h)
    return (s + 0.01 * s ** 5 - 0.05 * s ** 2 + w * s ** 3 / 10 + 0.001 * s ** 6 + 0.5 * s + 1.0
            + jnp.abs(s) ** 1.5 / 4 + (1.0 + jnp.abs(s)) ** w + (1.0 + s * s) ** -2 + (2.0 + jnp.abs(s)) ** -w)


def transcendental(s, ix, params, options):
    g = oracle.param_at(params["g"], ix.h)
    sigmoid = 1.0 / (1.0 + jnp.exp(-g))
    pos = jnp.sqrt(jnp.where(s > 0, s, 0.0) + 1.0) * jnp.log(1.0 + jnp.exp(-jnp.abs(s)))
    return jnp.where(s > 0, pos, jnp.maximum(s, -2.0) * sigmoid) + jnp.tanh(s) * jnp.minimum(s, 1.0) / (2.0 + jnp.abs(g))


def masked_functions(ix, options):
    return ((jnp.maximum(ix.q_idx - ix.kv_idx, 0) < 20) & ~(ix.kv_idx == 5)) | (jnp.abs(ix.q_idx - ix.kv_idx) <= 1)


HOOKS = {"powers": dict(score=powers), "transcendental": dict(score=transcendental),
         "masked_functions": dict(mask=masked_functions)}


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsl_functions")
    (root / "specs").mkdir()
    for name, text in SPECS.items():
        (root / "specs" / f"{name}.yaml").write_text(text)
    assert main(["build", str(root / "specs"), "-o", str(root / PACKAGE)]) == 0
    with on_path(root):
        yield importlib.import_module(PACKAGE)


SHAPE = AttnShape(1, 40, 37, 2, 1, 16)  # several 16-wide blocks in the interpreters, GQA, ragged ends


@pytest.mark.parametrize("backend", ["xla", "triton", "pallas"])
@pytest.mark.parametrize("spec", list(SPECS))
def test_dsl_functions_against_the_oracle(ops, run_vjp, spec, backend):
    rng = rng_for("dsl", spec)
    diff = random_qkv(SHAPE, "float32", rng)
    params = {}
    if spec == "powers":
        params["w"] = jnp.asarray(rng.uniform(-1, 1, SHAPE.q_heads), jnp.float32)
    if spec == "transcendental":
        params["g"] = jnp.asarray(rng.standard_normal(SHAPE.q_heads), jnp.float32)
    diff.update(params)
    flags = {"causal": True} if spec == "masked_functions" else {}
    d_out, d_lse = random_cotangents(SHAPE, "float32", rng)
    out, lse, grads = run_vjp(getattr(ops, spec), diff, {}, {**flags, "platform": backend}, d_out, d_lse)
    qkv = {n: np.asarray(diff[n]) for n in ("query", "key", "value")}
    ref = oracle.attention(**qkv, **HOOKS[spec], params={n: np.asarray(p) for n, p in params.items()},
                           options={}, **flags, d_out=d_out, d_lse=d_lse)
    if spec == "powers":  # the point of the spec: negative logits raised to odd powers
        s = np.einsum("bqhd,bkhd->bhqk", qkv["query"][:, :, :1], qkv["key"]) / np.sqrt(SHAPE.head_dim)
        assert (s < -1).mean() > 0.1
    oracle.check_attention(out, lse, grads, ref, diff, "float32")


def test_the_function_kernels_compile_for_sm90(ops, monkeypatch):
    """The interpreter is lenient about types; Triton's compiler is not: the helpers the powers take
    (`_ipow`, `_pow`) and every function compile ahead of time for Hopper. (The functions' types are what counts,
    not the tiles: 64 x 32 blocks, a third of the compile time of the default 128 x 64 from a cold Triton cache, both
    specs in one process.)"""
    from pathlib import Path

    from ejgen.testing.aot import compile_all_in_subprocess

    pytest.importorskip("triton")
    root = str(Path(ops.__file__).parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    specs = {"powers": {"w": "float32"}, "transcendental": {"g": "float32"}}
    requests = [dict(package=PACKAGE, name=spec, params=params, dtype="bfloat16", head_dim=64, block_m=64, block_n=32,
                     with_ptx=True) for spec, params in specs.items()]
    for spec, compiled in zip(specs, compile_all_in_subprocess(requests)):
        assert "error" not in compiled, (spec, compiled.get("error"))
        assert set(compiled) == {"fwd_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel"}, spec
        assert all(c["cubin"] for c in compiled.values()), spec


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("spec", list(SPECS))
def test_the_function_kernels_lower_for_pallas_gpu_and_tpu(ops, spec, platform):
    """The Pallas kernels of every function lower for CUDA (Triton) and TPU (Mosaic) from the CPU, forward and
    gradients: a scalar `where` of two constants once lowered to an i1 value on CUDA (found on an H100)."""
    import jax
    from jax import export

    op = getattr(ops, spec)
    q = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 256, 1, 128), jnp.float32)
    name = {"powers": "w", "transcendental": "g"}.get(spec)
    extra = {name: jax.ShapeDtypeStruct((2,), jnp.float32)} if name else {}

    def loss(q, k, v, extra):
        return jnp.sum(op(q, k, v, platform="pallas", **extra))

    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    target = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}[platform]
    exported = export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))), platforms=[platform],
                             disabled_checks=checks)(q, kv, kv, extra)
    assert exported.mlir_module().count(f"@{target}(") == 3  # forward, dK/dV, dQ
