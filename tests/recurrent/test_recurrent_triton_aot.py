"""Every Triton kernel of the recurrent family (fused and chunked, forward and backward) compiles ahead of time for
Hopper (sm_90) and Ampere (sm_80) on a machine without a GPU (Triton's bundled ptxas), with the blocks and flags the
host gives a GLA-sized call: the interpreter is lenient about types, the compiler is not. The 16-bit kernels' state
products round their TF32 operands (cvt.rna, as the interpreter does) rather than leave the tensor cores to truncate."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="the triton extra is part of the test install (README)")
from ejgen.testing.aot import (by_gpu_host_triton, compile_all_in_subprocess,  # noqa: E402
                               compile_recurrent_in_subprocess, gpu_host_triton)

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


def test_the_gpu_hosts_triton_compiles_the_scalar_gate_kernels():
    """The chunked kernels of a scalar gate per step (and of none) on the GPU host's Triton (3.6): its scan lowering
    asserted on their [S, 1] cumsums, which Triton 3.9 compiles (the first GPU run's chunked failures of
    linear_attention, simple_gla, lightning_attention). CI installs that Triton (.ci/run, EJGEN_GPU_HOST_TRITON)."""
    shape = dict(dk=64, dv=128, heads=4, kv_heads=2)
    requests = [{"recurrent": True, "package": "ejgen.generated", "name": name, "capability": 90, "gates": gates,
                 "dtype": dtype, "kernels": ["chunk_state", "chunk_grads_qk"], **shape}
                for name, gates, dtype in [("linear_attention", (), "float32"), ("simple_gla", ("g", "g_gamma"),
                                                                                "bfloat16")]]
    for request, compiled in zip(requests, compile_all_in_subprocess(requests, triton=gpu_host_triton())):
        assert "error" not in compiled, f"{request['name']} {request['gates']}: {compiled.get('error')}"
        for kernel, c in compiled.items():
            assert c["cubin"] and by_gpu_host_triton(c), (request["name"], kernel, c)
