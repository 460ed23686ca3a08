"""Every Triton kernel of the recurrent family (fused and chunked, forward and backward) compiles ahead of time for
Hopper (sm_90) and Ampere (sm_80) on a machine without a GPU (Triton's bundled ptxas), with the blocks and flags the
host gives a GLA-sized call: the interpreter is lenient about types, the compiler is not. The 16-bit kernels' state
products round their TF32 operands (cvt.rna, as the interpreter does) rather than leave the tensor cores to truncate."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="the triton extra is part of the test install (README)")
from ejgen.testing.aot import compile_recurrent_in_subprocess  # noqa: E402

KERNELS = {"fused_fwd", "fused_bwd", "chunk_state", "chunk_state_bwd", "chunk_output", "chunk_grads_qk",
           "chunk_grads_v"}
FORWARD = ("fused_fwd", "chunk_state", "chunk_output")
CASES = [  # every kernel for Hopper; Ampere's forward (its mma lowering) with other flags and head dims
    ("recurrent-sm90-every-gate-bf16", "recurrent", 90, dict(gates=("g", "g_gamma", "gk", "gv"), kv_heads=4)),
    ("linear-attention-sm80-varlen-reverse-f16", "linear_attention", 80,
     dict(gates=(), dtype="float16", varlen=True, reverse=True, dk=64, dv=256, h0=False, kernels=FORWARD)),
]


@pytest.mark.parametrize("name,capability,config", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_recurrent_kernels_compile_ahead_of_time(name, capability, config):
    compiled = compile_recurrent_in_subprocess("ejgen.generated", name, capability=capability, with_ptx=True, **config)
    assert set(compiled) == set(config.get("kernels", KERNELS))
    for kernel, c in compiled.items():
        assert c["cubin"], f"{kernel}: no cubin"
        assert c["shared"] <= 232448, f"{kernel}: {c['shared']} bytes of shared memory"
    if capability >= 90:  # the states' products run on the warpgroup tensor cores
        assert compiled["chunk_state"]["wgmma"] and compiled["chunk_state_bwd"]["wgmma"]
    for kernel in {"chunk_output", "chunk_grads_qk", "chunk_grads_v"} & set(compiled):  # TF32 operands rounded
        assert "cvt.rna.tf32.f32" in compiled[kernel]["ptx"], f"{kernel}: its state products' operands are truncated"
