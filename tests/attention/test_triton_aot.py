"""Every emitted Triton kernel compiles ahead of time for Hopper (sm_90) and Ampere (sm_80), with
representative constexpr configurations, on a machine without a GPU (Triton's bundled ptxas)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton", reason="the triton extra is part of the test install (README)")
from ejgen.spec import load_specs  # noqa: E402
from ejgen.testing.aot import compile_in_subprocess  # noqa: E402

SPECS = {v.name: v for v in load_specs(os.path.join(os.path.dirname(__file__), "..", "..", "specs"))}

# (id, variant, capability, config): kernel sizes of the heuristic table, features on and off
CASES = [
    ("flash-sm90-causal-d128", "flash_attention", 90, dict(causal=True, block_m=128, block_n=64)),
    ("flash-sm90-window-softcap-sinks-gqa", "flash_attention", 90,
     dict(causal=True, window=True, softcap=True, sinks=True, kv_heads=4, head_dim=64, block_m=128, block_n=128)),
    ("flash-sm90-bias-segments-d96", "flash_attention", 90, dict(causal=False, bias=True, segments=True, head_dim=96)),
    ("flash-sm90-dense-varlen-d256", "flash_attention", 90,
     dict(causal=True, dense=True, varlen=True, batch=1, head_dim=256, block_m=64, block_n=64)),
    ("flash-sm90-f32", "flash_attention", 90, dict(causal=True, dtype="float32", block_m=64, block_n=32)),
    ("flash-sm80-causal-d128", "flash_attention", 80, dict(causal=True, block_m=128, block_n=64)),
    ("alibi-sm90", "alibi_attention", 90, dict(causal=True)),
    ("prefix-lm-sm90", "prefix_lm_attention", 90, dict(causal=False, sinks=True, runtime_mask=True)),
    ("local-softcap-sinks-sm90", "local_softcap_sinks_attention", 90,
     dict(causal=True, window=True, softcap=True, sinks=True)),
    ("relative-bias-sm90", "relative_bias_attention", 90, dict(causal=False, head_dim=64)),
    ("relative-bias-sm80", "relative_bias_attention", 80, dict(causal=True, head_dim=64)),
]


@pytest.mark.parametrize("name,capability,config", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_triton_kernels_compile_ahead_of_time(name, capability, config):
    params = {p.name: p.dtype for p in SPECS[name].params}
    compiled = compile_in_subprocess("ejgen.generated", name, capability=capability, params=params,
                                     num_warps=8 if config.get("block_m", 128) >= 128 else 4, num_stages=2, **config)
    assert set(compiled) == {"fwd_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel"}
    for kernel, c in compiled.items():
        assert c["cubin"], f"{kernel}: no cubin"
        if capability >= 90 and config.get("dtype", "bfloat16") != "float32":
            assert c["wgmma"], f"{kernel}: no Hopper wgmma instructions in the PTX"
        assert c["shared"] <= 232448, f"{kernel}: {c['shared']} bytes of shared memory"
