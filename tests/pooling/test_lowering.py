"""The pooling ops lowered for machines this one is not: Triton kernels compiled ahead of time for sm_90 and sm_80
(Triton's bundled ptxas: shapes, layouts and every lowering rule checked, 16-byte loads of x asserted), and the
Pallas kernels through ``jax.export`` for cuda (the Triton lowering) and tpu (Mosaic), forward and gradient."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax import export

from ejgen.generated import max_pooling, mean_pooling, weighted_mean_pooling
from ejgen.testing.aot import compile_pooling_in_subprocess

AOT = [
    ("mean-sm90-bf16", "mean_pooling", dict(capability=90)),
    ("weighted-sm90-f16-packed-grad", "weighted_mean_pooling",
     dict(capability=90, dtype="float16", varlen=True, weighted=True, weight_grad=True, dim=1000)),
    ("max-sm90-f32-packed", "max_pooling", dict(capability=90, dtype="float32", varlen=True, weighted=True)),
    ("last-sm80-bf16", "last_token_pooling", dict(capability=80, dim=768, chunk=16)),
]


@pytest.mark.parametrize("name,config", [c[1:] for c in AOT], ids=[c[0] for c in AOT])
def test_triton_kernels_compile_ahead_of_time(name, config):
    compiled = compile_pooling_in_subprocess("ejgen.generated", name, with_ptx=True, **config)
    assert set(compiled) == {"fwd", "combine", "bwd"}
    for kernel, c in compiled.items():
        assert c["cubin"], f"{kernel}: no cubin"
    if config.get("dim", 4096) % 8 == 0 and config.get("dtype", "bfloat16") != "float32":
        # x streams through 16-byte loads (8 16-bit values a thread): the bandwidth the op is built for
        loads = re.findall(r"ld\.global[\w.:]*\.v4\.b32", compiled["fwd"]["ptx"])
        assert loads, "the forward kernel loads x without 16-byte vectors"


SDS = jax.ShapeDtypeStruct
LOWERINGS = [
    ("mean-dense", lambda x, e: mean_pooling(x, platform="pallas"), SDS((2, 300, 256), jnp.bfloat16), {}),
    ("mean-packed", lambda x, e: mean_pooling(x, 32, e["cu"], platform="pallas"), SDS((600, 256), jnp.bfloat16),
     {"cu": SDS((5,), jnp.int32)}),
    ("weighted-packed", lambda x, e: weighted_mean_pooling(x, 16, e["cu"], weights=e["w"], mask=e["m"],
                                                           platform="pallas"),
     SDS((600, 640), jnp.float32), {"cu": SDS((5,), jnp.int32), "w": SDS((600,), jnp.float32),
                                    "m": SDS((600,), jnp.bool_)}),
    ("max-dense", lambda x, e: max_pooling(x, platform="pallas"), SDS((2, 300, 96), jnp.float32), {}),
]


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("fn,x,extra", [c[1:] for c in LOWERINGS], ids=[c[0] for c in LOWERINGS])
def test_pallas_exports(platform, fn, x, extra):
    """jax.export of the op and of its gradient: the forward is 2 kernels on a GPU (items, combine), 1 on a TPU;
    the backward adds 1."""
    target = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}[platform]
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    forward = 2 if platform == "cuda" else 1

    def loss(x, extra):
        return jnp.sum(fn(x, extra).astype(jnp.float32) ** 2)

    for what, f, kernels in (("forward", fn, forward), ("gradient", jax.grad(loss), forward + 1)):
        exported = export.export(jax.jit(f), platforms=[platform], disabled_checks=checks)(x, extra)
        found = exported.mlir_module().count(f"@{target}(")
        assert found == kernels, f"{what}: {found} Pallas kernels lowered for {platform}, expected {kernels}"
