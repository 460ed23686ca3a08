"""Every emitted Triton kernel compiles ahead of time for Hopper (sm_90) and Ampere (sm_80), with
representative constexpr configurations, on a machine without a GPU (Triton's bundled ptxas)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton", reason="the triton extra is part of the test install (README)")
from ejgen.spec import load_specs  # noqa: E402
from ejgen.testing.aot import by_gpu_host_triton, compile_all_in_subprocess, gpu_host_triton  # noqa: E402

SPECS = {v.name: v for v in load_specs(os.path.join(os.path.dirname(__file__), "..", "..", "specs"))}

# (id, variant, capability, config): kernel sizes of the heuristic table, features on and off
CASES = [
    ("flash-sm90-causal-d128", "flash_attention", 90, dict(causal=True, block_m=128, block_n=64)),
    ("flash-sm90-window-softcap-sinks-gqa", "flash_attention", 90,
     dict(causal=True, window=True, softcap=True, sinks=True, kv_heads=4, head_dim=64, block_m=128, block_n=128)),
    ("flash-sm90-bias-segments-d96", "flash_attention", 90, dict(causal=False, bias=True, segments=True, head_dim=96)),
    ("flash-sm90-dense-varlen-d256", "flash_attention", 90,
     dict(causal=True, dense=True, varlen=True, batch=1, head_dim=256, block_m=64, block_n=64)),
    ("flash-sm90-layout-tile-ranges", "flash_attention", 90,  # a block layout of 64 x 64 blocks (block_mask=)
     dict(causal=False, dense=True, layout_block=64, tile_ranges=True, tile_lists=True, block_m=128, block_n=64)),
    ("flash-sm90-positions-window", "flash_attention", 90,  # explicit positions, walked by lists
     dict(causal=True, window=True, positions=True, runtime_mask=True, tile_ranges=True, tile_lists=True)),
    # float32 (IEEE products by FMA: the largest compile here) at the table's backward tiles for head dim 128, 32 x 32
    # (64 x 32, its forward's, took twice as long from a cold Triton cache, as CI's is: 56 s)
    ("flash-sm90-f32", "flash_attention", 90, dict(causal=True, dtype="float32", block_m=32, block_n=32)),
    ("flash-sm80-causal-d128", "flash_attention", 80, dict(causal=True, block_m=128, block_n=64)),
    ("alibi-sm90", "alibi_attention", 90, dict(causal=True)),
    ("prefix-lm-sm90", "prefix_lm_attention", 90, dict(causal=False, sinks=True, runtime_mask=True)),
    ("local-softcap-sinks-sm90", "local_softcap_sinks_attention", 90,
     dict(causal=True, window=True, softcap=True, sinks=True)),
    ("relative-bias-sm90", "relative_bias_attention", 90, dict(causal=False, head_dim=64)),
    ("relative-bias-sm80", "relative_bias_attention", 80, dict(causal=True, head_dim=64)),
]


def test_triton_kernels_compile_ahead_of_time():
    """Every case, in one process (one start and import, not one per case); each case checked on its own."""
    requests = [dict(package="ejgen.generated", name=name, capability=capability,
                     params={p.name: p.dtype for p in SPECS[name].params},
                     num_warps=8 if config.get("block_m", 128) >= 128 else 4, num_stages=2, **config)
                for _, name, capability, config in CASES]
    failures = []
    for (case, _, capability, config), compiled in zip(CASES, compile_all_in_subprocess(requests)):
        if "error" in compiled:
            failures.append(f"{case}: {compiled['error']}")
            continue
        if set(compiled) != {"fwd_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel"}:
            failures.append(f"{case}: compiled {sorted(compiled)}")
        for kernel, c in compiled.items():
            if not c["cubin"]:
                failures.append(f"{case}: {kernel}: no cubin")
            if capability >= 90 and config.get("dtype", "bfloat16") != "float32" and not c["wgmma"]:
                failures.append(f"{case}: {kernel}: no Hopper wgmma instructions in the PTX")
            if c["shared"] > 232448:
                failures.append(f"{case}: {kernel}: {c['shared']} bytes of shared memory")
    assert not failures, "\n".join(failures)


# What the GPU host's Triton (3.6) must compile too, in one process: the richest train case, the block-layout walk
# and the split-K decode kernel (all of CASES, decode and pooling compiled on 3.6 in session 14: 98 s)
GPU_HOST_CASES = ["flash-sm90-window-softcap-sinks-gqa", "flash-sm90-layout-tile-ranges"]


def test_the_gpu_hosts_triton_compiles_them_too():
    """A few cases with the GPU host's Triton (EJGEN_GPU_HOST_TRITON, set by CI; 3.6 where 3.9 is installed):
    generated code must compile on both (the recurrent scalar-gate kernels once compiled only on 3.9)."""
    cases = [c for c in CASES if c[0] in GPU_HOST_CASES]
    requests = [dict(package="ejgen.generated", name=name, capability=capability,
                     params={p.name: p.dtype for p in SPECS[name].params},
                     num_warps=8 if config.get("block_m", 128) >= 128 else 4, num_stages=2, **config)
                for _, name, capability, config in cases]
    requests.append({"decode": True, "package": "ejgen.generated", "name": "flash_attention", "capability": 90,
                     "paged": True, "window": True, "softcap": True, "groups": 8, "queries": 2})
    names = [c[0] for c in cases] + ["decode-flash-sm90-paged"]
    for case, compiled in zip(names, compile_all_in_subprocess(requests, triton=gpu_host_triton())):
        assert "error" not in compiled, f"{case}: {compiled.get('error')}"
        for kernel, c in compiled.items():
            assert c["cubin"] and by_gpu_host_triton(c), (case, kernel, c)


@pytest.mark.parametrize("bias,mask", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("d,dv", [(72, 40), (96, 96), (128, 128), (192, 128), (256, 256)])
def test_configs_fit_shared_memory_with_streamed_tiles(bias, mask, d, dv):
    """A bias or dense-mask tile per step besides the loop's tiles: the table's configs shrink until the
    multi-buffered steps fit one thread block's shared memory (an H200 refused the 16-bit forward at 128x128,
    3 stages, D 96, with both: 320 KB asked, 227 KB there); without them the table's config is kept."""
    from ejgen.runtime.attention.triton import configs

    for pass_ in ("fwd", "dkdv", "dq"):
        for bits in (16, 32):
            table = configs.pick("sm90", pass_, max(d, dv), bits)
            item = bits // 8
            assert configs.fit_shared_memory(table, pass_, d, dv, item, False, False) == table
            conf = configs.fit_shared_memory(table, pass_, d, dv, item, bias, mask)
            assert configs.shared_bytes(conf, pass_, d, dv, item, bias, mask) <= configs.SHARED_MEMORY, (pass_, conf)
            assert conf.block_m <= table.block_m and conf.block_n <= table.block_n
            assert conf.num_stages <= table.num_stages and (conf.tma, conf.merged) == (table.tma, table.merged)
    fwd = configs.fit_shared_memory(configs.pick("sm90", "fwd", 96, 16), "fwd", 96, 96, 2, True, True)
    assert (fwd.block_n, fwd.num_stages) != (128, 3)  # the configuration that failed on the GPU
