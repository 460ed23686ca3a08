"""The Triton kernels' tensor-descriptor (TMA) and warp-specialised paths.

- in Triton's interpreter, with every pass pinned to descriptors (and the forward to warp
  specialisation), against the float64 oracle: outputs, lse and every gradient, on shapes whose
  sequences end inside a block (descriptors read zeros there) and with GQA, causal, window, soft
  cap, sinks and bias; a spy checks that the launches really took the descriptor path;
- ahead of time for sm_90: the descriptor kernels compile (bulk tensor copies in the PTX), and the
  global-scratch rerouting that ejgen adds to jax-triton rewrites exactly the scratch reads.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest

pytest.importorskip("triton", reason="the triton extra is part of the test install (README)")

from conformance import FULL  # noqa: E402
from conftest import ON_GPU  # noqa: E402
from ejgen.testing.shapes import AttnShape  # noqa: E402

from ejgen.runtime.attention.triton import host as triton_attention
from ejgen.runtime.launch import triton_call  # noqa: E402

pytestmark = pytest.mark.usefixtures("x64_stays_off")

PINNED = "fwd=16,16,4,1,tma,ws;dkdv=16,16,4,1,tma;dq=16,16,4,1,tma"
PINNED_GPU = PINNED.replace(",ws", "")  # on a GPU 'ws' is refused (WS_TRITON_RELEASES): descriptors only

# (id, shape, features): head dims are powers of two (descriptors need whole heads); two batch rows and two heads or
# more where the descriptors' batch and head offsets matter
CASES = [
    ("plain-ragged", AttnShape(2, 45, 45, 2, 2, 32), dict()),
    ("plain-whole-blocks", AttnShape(1, 48, 64, 2, 2, 32), dict()),  # warp-specialised forward loop
    ("causal-gqa", AttnShape(2, 37, 53, 2, 1, 32), dict(causal=True)),
    ("window-softcap-sinks", AttnShape(1, 40, 40, 4, 1, 16), dict(sliding_window=(9, 3), logits_soft_cap=5.0, sinks="h")),
    ("bias", AttnShape(1, 33, 29, 2, 2, 32), dict(bias=True, causal=True)),
]


# Both 16-bit dtypes on every case on the GPU host and with EJGEN_FULL_SUITE; in the interpreter (the descriptors are
# the same for both: 16-bit elements) the cases alternate between them, so each dtype meets ragged and whole blocks.
_EVERY_DTYPE = ON_GPU or FULL
PARAMS = [pytest.param(shape, features, dtype, id=f"{dtype}-{name}")
          for dtype in ("bfloat16", "float16") for i, (name, shape, features) in enumerate(CASES)
          if _EVERY_DTYPE or dtype == ("bfloat16", "float16")[i % 2]]


@pytest.mark.parametrize("shape,features,dtype", PARAMS)
def test_descriptor_paths_match_the_oracle(monkeypatch, triton_launches, triton_against_oracle, shape, features, dtype):
    on_gpu = triton_call.mode()[0] == "gpu"
    monkeypatch.setenv("EJGEN_TRITON_CONFIG", PINNED_GPU if on_gpu else PINNED)
    triton_against_oracle(shape, features, dtype, "tma")
    kinds = {pass_: (kw["TMA"], kw["WS"]) for pass_, kw in triton_launches}
    assert kinds["fwd"][0] and kinds["dkdv"][0] and kinds["dq"][0], triton_launches
    whole = shape.q_len % 16 == 0 and shape.kv_len % 16 == 0
    plain = not features
    assert kinds["fwd"][1] == (whole and plain and not on_gpu), "warp specialisation: plain loops over whole blocks only"


def test_descriptors_need_16_bit_whole_power_of_two_heads():
    from ejgen.runtime.attention.config import AttentionConfig

    dense, varlen = AttentionConfig(seq_q=64, seq_k=64), AttentionConfig(seq_q=64, seq_k=64, varlen=True)
    q = lambda d, dtype=jnp.bfloat16: jnp.zeros((1, 64, 2, 1, d), dtype)
    assert triton_attention.tma_eligible(q(64), q(64), dense)
    assert not triton_attention.tma_eligible(q(48), q(48), dense)  # a tile would reach into the next head
    assert not triton_attention.tma_eligible(q(64), q(64), varlen)  # rows past a sequence are another's
    assert not triton_attention.tma_eligible(q(64, jnp.float32), q(64, jnp.float32), dense)


@pytest.fixture(scope="module")
def descriptor_kernels():
    from ejgen.testing.aot import compile_in_subprocess

    # 3 stages: Triton 3.6's ptxas (the GPU host's) crashes on the causal dQ kernel at 64x128 w8 s2
    return compile_in_subprocess("ejgen.generated", "flash_attention", capability=90, num_warps=8, num_stages=3,
                                 causal=True, block_m=64, block_n=128, tma=True, with_ptx=True)


def test_descriptor_kernels_compile_for_hopper(descriptor_kernels):
    for name, c in descriptor_kernels.items():
        assert c["cubin"] and c["wgmma"], name
        assert "cp.async.bulk.tensor" in c["ptx"], f"{name}: no tensor-descriptor copies"
        assert 0 < c["global_scratch"] <= triton_call.SCRATCH_PER_PROGRAM, name
        assert c["shared"] <= 232448, name


def test_global_scratch_reads_move_to_the_last_explicit_argument(descriptor_kernels):
    ptx = descriptor_kernels["fwd_kernel"]["ptx"]
    name = re.search(r"\.entry\s+(\w+)\s*\(", ptx).group(1)
    n = len(re.findall(rf"\b{name}_param_\d+\b", re.search(r"\((.*?)\)", ptx[ptx.index(".entry"):], re.S).group(1)))
    hidden, scratch = f"[{name}_param_{n - 2}]", f"[{name}_param_{n - 3}]"
    assert hidden in ptx
    routed = triton_call.route_global_scratch(ptx, name)
    assert hidden not in routed and routed.count(scratch) == ptx.count(scratch) + ptx.count(hidden)
    # nothing else changes
    assert routed.replace(scratch, "@") == ptx.replace(hidden, scratch).replace(scratch, "@")
    with pytest.raises(RuntimeError, match="unexpected PTX parameter list"):
        triton_call.route_global_scratch(ptx, "no_such_kernel")


def test_pinning_warp_specialisation_on_a_gpu_is_an_error_until_a_release_is_measured(monkeypatch):
    from ejgen.ops import flash_attention

    if triton_call.mode()[0] is None:
        pytest.fail("this test needs the triton backend: run it with TRITON_INTERPRET=1 (README)")
    monkeypatch.setenv("EJGEN_TRITON_CONFIG", "fwd=128,128,4,2,tma,ws")
    monkeypatch.setattr(triton_attention, "_arch", lambda: "sm90")
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="warp-specialised forward is not enabled on GPUs"):
        flash_attention(q, q, q, platform="triton")


def test_the_interpreter_takes_descriptors_exactly_where_the_gpu_table_does(monkeypatch):
    from ejgen.runtime.attention.triton import configs as triton_configs

    monkeypatch.delenv("EJGEN_TRITON_CONFIG", raising=False)
    monkeypatch.setenv("EJGEN_CACHE_DIR", "/nonexistent-ejgen-cache")
    for pass_ in ("fwd", "dkdv", "dq"):
        for head_dim in (32, 64, 128, 256):
            for bits in (16, 32):
                gpu = triton_configs.pick("sm90", pass_, head_dim, bits, 4096, True)
                cpu = triton_configs.pick("interpret", pass_, head_dim, bits, 4096, True)
                assert cpu.tma == gpu.tma and (cpu.block_m, cpu.block_n) == (16, 16), (pass_, head_dim, bits)
    assert triton_configs.pick("sm90", "fwd", 128, 16, 4096, True).tma  # the measured default


def test_a_heads_major_package_is_an_error_not_a_wrong_answer():
    from ejgen.runtime.attention.config import AttentionConfig
    from ejgen.runtime.core.kernels import KernelChoice

    cfg = AttentionConfig(seq_q=40, seq_k=40)
    q = jnp.zeros((1, 2, 1, 40, 16), jnp.float32)  # [B, Hkv, G, Sq, D]: what packages rendered before v5 pass
    layout = triton_attention.Layout("ejgen.generated.flash_attention.triton_kernels", "flash_attention", (), (), (),
                                     (), False, True, False)
    choice = KernelChoice("triton", "triton", "triton", False)
    with pytest.raises(RuntimeError, match="older than this runtime"):
        triton_attention._forward(layout, q, q[:, :, 0], q[:, :, 0], {}, cfg, choice)


def test_autotuning_in_the_interpreter_is_an_error_that_says_what_to_do(monkeypatch):
    from ejgen.ops import flash_attention

    if triton_call.mode()[0] is None:
        pytest.fail("this test needs the triton backend: run it with TRITON_INTERPRET=1 (README)")
    if triton_call.mode()[0] == "gpu":
        pytest.skip("on a GPU the autotuned call runs (benchmarks/gpu_check.py --autotune checks it)")
    monkeypatch.setenv("EJGEN_TRITON_AUTOTUNE", "1")
    q = jnp.zeros((1, 32, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="EJGEN_TRITON_AUTOTUNE: .* on a GPU; in the interpreter, pin a config"):
        flash_attention(q, q, q, platform="triton")
