"""The Pallas recurrent kernels: the GPU kernels (Triton lowering) and the TPU kernels (Mosaic) interpreted on the CPU
against the float64 oracle, forward and every gradient (dense with GQA, K != V and gates g, g_gamma, gk on the GPU
kernels, chunked and the fused forward (reversed; a feature map and bf16 without h0); packed and reversed with empty
and length-1 sequences, a feature map and bf16 on the TPU kernels); both lowered for CUDA and TPU through
``jax.export`` from the CPU, and a decode step for CUDA (one fused kernel, the state in place); gv refused with a clear
error."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax import export

from recurrent_cases import Case, check
from ejgen import generated
from ejgen.runtime.core.pallas import interpret_kernels

pytestmark = pytest.mark.usefixtures("x64_stays_off")

PACKED = (0, 3, 3, 20, 21)  # four sequences: 3, 0, 17 (two chunks), 1 steps; two trailing tokens of none
FUSED = {"algorithm": "fused", "chunk": None}
CASES = [  # (kernels, case): chunks of 16 steps, so T = 37 makes three chunks, the last one partial
    ("gpu", Case("recurrent", ("g", "g_gamma", "gk"), shape=(2, 37, 4, 2, 16, 24), h0=True)),
    ("tpu", Case("linear_attention", (), dtype="bfloat16", shape=(1, 23, 2, 1, 16, 24), cu=PACKED, h0=True,
                 reverse=True)),
    # the GPU's fused forward (dense calls; T not a power of two, V two blocks, no h0), its backward the chunked one
    ("gpu", Case("recurrent", ("g", "g_gamma", "gk"), shape=(2, 13, 4, 2, 16, 48), h0=True, reverse=True, **FUSED)),
    ("gpu", Case("linear_attention", (), dtype="bfloat16", shape=(1, 5, 2, 1, 16, 24), **FUSED)),
]
ELU1 = {"feature_map": lambda x: jnp.where(x > 0, x + 1.0, jnp.exp(x))}


@pytest.mark.parametrize("kernels,case", CASES, ids=[f"{k}-{c.id}" for k, c in CASES])
def test_pallas_against_the_oracle(kernels, case):
    with interpret_kernels(kernels):
        check(case, "pallas", hooks=ELU1 if case.op == "linear_attention" else None)


SDS = jax.ShapeDtypeStruct


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_pallas_kernels_lower_for_cuda_and_tpu(platform):
    """jax.export of a GLA call and of its gradient: one forward kernel; the gradient adds the forward again (the
    states at chunk starts) and the backward."""
    target = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}[platform]
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]

    def fwd(q, k, v, gk, cu):
        return generated.gla(q, k, v, gk, initial_state=jnp.ones((3, 4, 64, 32)), reverse=True, cu_seqlens=cu,
                             platform="pallas", algorithm="chunked")

    def loss(q, k, v, gk, cu):
        o, ht = fwd(q, k, v, gk, cu)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(ht)

    args = (SDS((1, 100, 4, 64), jnp.bfloat16), SDS((1, 100, 2, 64), jnp.bfloat16), SDS((1, 100, 2, 32), jnp.bfloat16),
            SDS((1, 100, 4, 64), jnp.float32), SDS((4,), jnp.int32))
    for what, fn, kernels in (("forward", fwd, 1), ("gradient", jax.grad(loss, argnums=(0, 1, 2, 3)), 3)):
        exported = export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args)
        found = exported.mlir_module().count(f"@{target}(")
        assert found == kernels, f"{what}: {found} Pallas kernels lowered for {platform}, expected {kernels}"


def test_a_decode_step_lowers_for_cuda_as_one_kernel_updating_the_state_in_place():
    """gla_decode on the pallas platform exported for CUDA from the CPU: one kernel, the fused forward, whose final
    state is the initial state's buffer (output_operand_aliases); every other operation on the state a reshape."""
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    b, h, k, v = 8, 4, 64, 128
    args = (SDS((b, h, k), jnp.bfloat16), SDS((b, h, k), jnp.bfloat16), SDS((b, h, v), jnp.bfloat16),
            SDS((b, h, k, v), jnp.float32), SDS((b, h, k), jnp.float32))
    step = jax.jit(lambda q, k, v, s, gk: generated.gla_decode(q, k, v, s, gk, platform="pallas"), donate_argnums=3)
    module = export.export(step, platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()
    calls = [line for line in module.splitlines() if "@__gpu$xla.gpu.triton(" in line]
    assert len(calls) == 1 and 'name = "gla_pallas_fused_fwd"' in calls[0], calls
    assert "output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [1], operand_index = 4" \
        in calls[0]
    state = f"tensor<{b}x{h}x{k}x{v}xf32>"
    on_state = {re.search(r"stablehlo\.(\w+)", line).group(1) for line in module.splitlines()
                if "stablehlo." in line and state in line.split(":")[-1].split("->")[0]}
    assert on_state <= {"reshape", "custom_call", "return"}, on_state


def test_pallas_refuses_gv():
    q = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(ValueError, match=re.escape("platform 'pallas' cannot run this call: gv is not taken by the "
                                                   "Pallas kernels (platform triton or xla takes it)")):
        generated.recurrent(q, q, q, gv=q, platform="pallas")
