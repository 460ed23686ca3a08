"""The Triton kernels' one-loop form (`merged` configs): masked and unmasked key (or query) blocks in
one pipelined loop, the element mask applied to edge blocks under a run-time branch.

In Triton's interpreter, with every pass pinned to it (pointer tiles and tensor descriptors), against
the float64 oracle: outputs, lse and every gradient, on shapes with full blocks between masked edges
(causal, sliding window), ragged sequence ends, GQA, soft cap, sinks and bias (not PLAIN: the ds mask
path). A spy checks that every launch really ran one loop.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton", reason="the triton extra is part of the test install (README)")

import test_conformance as conformance  # noqa: E402
from ejgen.testing.shapes import MHA_SHAPES, VARLEN_SHAPES, AttnShape  # noqa: E402

from ejgen.runtime.launch import triton_call
from ejgen.runtime.attention.triton import configs as triton_configs  # noqa: E402

pytestmark = pytest.mark.usefixtures("x64_stays_off")

CASES = [  # (id, shape, features, pinned configs)
    ("causal-gqa-ragged", AttnShape(1, 54, 54, 2, 1, 32), dict(causal=True), "16,16,4,1,merged"),
    ("window-softcap-sinks", AttnShape(1, 80, 80, 2, 1, 16), dict(sliding_window=(40, 0), logits_soft_cap=5.0, sinks="h"),
     "16,16,4,1,merged"),
    ("window-two-sided-tma", AttnShape(2, 64, 64, 2, 2, 32), dict(sliding_window=(20, 17)), "16,16,4,1,tma,merged"),
    ("bias-causal-tma", AttnShape(1, 45, 45, 2, 2, 32), dict(bias=True, causal=True), "16,16,4,1,tma,merged"),
]


@pytest.mark.parametrize("shape,features,conf", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_one_loop_matches_the_oracle(monkeypatch, triton_launches, triton_against_oracle, shape, features, conf):
    monkeypatch.setenv("EJGEN_TRITON_CONFIG", f"fwd={conf};dkdv={conf};dq={conf}")
    triton_against_oracle(shape, features, "bfloat16", "merged")
    assert {pass_ for pass_, _ in triton_launches} == {"fwd", "dkdv", "dq"}
    assert all(not kw["STAGED"] and kw["TMA"] == ("tma" in conf) for _, kw in triton_launches), triton_launches


def test_merged_is_a_config_flag():
    conf = triton_configs.parse("128,64,8,3,tma,merged")
    assert conf.merged and conf.tma and not conf.ws
    assert triton_configs.text(conf) == "128,64,8,3,tma,merged"
    assert not triton_configs.parse("128,64,8,3").merged
    with pytest.raises(ValueError, match="merged"):
        triton_configs.parse("128,64,8,3,fused")


def test_one_loop_kernels_compile_for_hopper():
    from ejgen.testing.aot import compile_all_in_subprocess

    requests = [dict(package="ejgen.generated", name="flash_attention", capability=90, num_warps=8, num_stages=2,
                     causal=True, window=True, block_m=128, block_n=64, tma=tma, staged=False) for tma in (False, True)]
    for tma, compiled in zip((False, True), compile_all_in_subprocess(requests)):  # one process for both
        assert "error" not in compiled, (tma, compiled.get("error"))
        for name, c in compiled.items():
            assert c["cubin"] and c["wgmma"], (tma, name)
            assert c["shared"] <= 232448, (tma, name)


ATOMIC_CASES = [  # (id, shape, features, dkdv config): dQ added by the dK/dV kernel
    ("gqa-causal-ragged", AttnShape(1, 45, 45, 4, 2, 32), dict(causal=True), "16,16,4,1,atomic"),
    ("window-softcap-sinks-merged", AttnShape(1, 64, 64, 2, 1, 16), dict(sliding_window=(20, 0), logits_soft_cap=5.0,
                                                                        sinks="h"), "16,16,4,1,merged,atomic"),
    ("bias-d24", AttnShape(2, 33, 29, 2, 2, 24), dict(bias=True), "16,16,4,1,atomic"),
    # on a GPU the dQ tiles go out as descriptor reductions; the interpreter has none (see below)
    ("tma-on-gpu", AttnShape(1, 54, 54, 2, 2, 32), dict(causal=True), "16,16,4,1,tma,merged,atomic"),
]


@pytest.mark.parametrize("shape,features,conf", [c[1:] for c in ATOMIC_CASES], ids=[c[0] for c in ATOMIC_CASES])
def test_dq_from_the_dkdv_kernel_matches_the_oracle(monkeypatch, triton_launches, triton_against_oracle, shape, features,
                                                     conf):
    if "tma" in conf and triton_call.mode()[0] != "gpu":
        conf = conf.replace("tma,", "")
    monkeypatch.setenv("EJGEN_TRITON_CONFIG", f"dkdv={conf}")
    triton_against_oracle(shape, features, "float32" if shape.head_dim == 24 else "bfloat16", "atomic")
    passes = [pass_ for pass_, _ in triton_launches]
    assert "dq" not in passes and "dkdv" in passes, passes  # no dQ kernel ran


def test_atomic_is_a_dkdv_flag_only(monkeypatch):
    from ejgen.ops import flash_attention

    if triton_call.mode()[0] is None:
        pytest.fail("this test needs the triton backend: run it with TRITON_INTERPRET=1 (README)")
    monkeypatch.setenv("EJGEN_TRITON_CONFIG", "fwd=16,16,4,1,atomic")
    q = jnp.zeros((1, 32, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="'atomic' .* is a flag of the dkdv config only"):
        flash_attention(q, q, q, platform="triton")


def test_the_interpreter_says_it_has_no_descriptor_reductions(monkeypatch):
    from ejgen.ops import flash_attention

    if triton_call.mode()[0] != "interpret":
        pytest.skip("the interpreter's limit; on a GPU the descriptor reductions run (tma-on-gpu above)")
    monkeypatch.setenv("EJGEN_TRITON_CONFIG", "dkdv=16,16,4,1,tma,atomic")
    loss = lambda q: flash_attention(q, q, q, platform="triton").astype(jnp.float32).sum()
    with pytest.raises(ValueError, match="no tensor-descriptor reductions; drop 'tma'"):
        jax.grad(loss)(jnp.ones((1, 32, 2, 16), jnp.bfloat16))
    # where descriptors would not run anyway (float32), the flag is no obstacle
    assert np.isfinite(np.asarray(jax.grad(loss)(jnp.ones((1, 32, 2, 16), jnp.float32)))).all()


def test_warp_specialisation_and_one_loop_do_not_mix(monkeypatch):
    from ejgen.ops import flash_attention

    if triton_call.mode()[0] is None:
        pytest.fail("this test needs the triton backend: run it with TRITON_INTERPRET=1 (README)")
    monkeypatch.setenv("EJGEN_TRITON_CONFIG", "fwd=16,16,4,1,tma,ws,merged")
    q = jnp.zeros((1, 32, 2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="'ws' .* cannot go with 'merged'"):
        flash_attention(q, q, q, platform="triton")


@pytest.mark.parametrize("tma", [False, True])
def test_dq_from_the_dkdv_kernel_compiles_for_hopper(tma):
    """With descriptors the dQ tiles go out as bulk reductions (cp.reduce.async.bulk.tensor), else as
    float32 atomic adds."""
    from ejgen.testing.aot import compile_in_subprocess

    compiled = compile_in_subprocess("ejgen.generated", "flash_attention", capability=90, num_warps=8, num_stages=2,
                                     causal=True, window=True, block_m=64, block_n=128, tma=tma, staged=False,
                                     atomic_dq=True, with_ptx=True)
    c = compiled["bwd_dkdv_kernel"]
    assert c["cubin"] and c["shared"] <= 232448
    if tma:
        assert re.search(r"cp\.reduce\.async\.bulk\.tensor\S*\.add", c["ptx"])
    else:
        assert re.search(r"(atom|red)\.global\.\S*add\S*\.f32", c["ptx"])


# Conformance cases under the one-loop and atomic-dQ configs: masks known only at run time (every
# block an edge), varlen sequences, float32, non-power-of-two head dims, rows that see no key.
ONE_LOOP = "fwd=16,16,4,1,merged;dkdv=16,16,4,1,merged;dq=16,16,4,1,merged"
ONE_LOOP_ATOMIC = "fwd=16,16,4,1,merged;dkdv=16,16,4,1,merged,atomic"
_F, _C, _CAP = conformance.Features, conformance.Case, conformance.CAP
_ALIGNED = AttnShape(1, 48, 48, 6, 2, 64)  # GQA_SHAPES[3]'s whole blocks and groups of 3, at 3 blocks a side, not 8
# GQA_SHAPES[1]'s kind (odd, Sq > Sk, MQA, D 72) at 3 blocks a side, not 7 x 4
_SQ_GT_SK = AttnShape(1, 45, 37, 4, 1, 72)
CONFORMANCE = [
    (_C(_F(sinks="h", segments="random"), _ALIGNED), ONE_LOOP_ATOMIC),
    (_C(_F(causal=True, mask="b1qk"), _SQ_GT_SK), ONE_LOOP),
    (_C(_F(causal=True, window=(20, 0), sinks="hn", bias="b1qk", segments="packed", **_CAP), MHA_SHAPES[0], "float16"),
     ONE_LOOP_ATOMIC),
    (_C(_F(causal=True, window=(8, 0), sinks="h"), VARLEN_SHAPES[1], "bfloat16"), ONE_LOOP_ATOMIC),
    (_C(_F(causal=True), VARLEN_SHAPES[2]), ONE_LOOP),
]


@pytest.mark.parametrize("case,pinned", CONFORMANCE, ids=[c[0].id for c in CONFORMANCE])
def test_conformance_cases_in_one_loop(monkeypatch, triton_launches, run_vjp, case, pinned):
    monkeypatch.setenv("EJGEN_TRITON_CONFIG", pinned)
    conformance.run_case(case, "triton", run_vjp)
    _ran_as_pinned(triton_launches, pinned)


def _ran_as_pinned(launches, pinned):
    passes = {pass_ for pass_, _ in launches}
    assert passes == ({"fwd", "dkdv"} if "atomic" in pinned else {"fwd", "dkdv", "dq"}), passes
    assert all(not kw["STAGED"] and kw["ATOMIC_DQ"] == ("atomic" in pinned and pass_ == "dkdv")
               for pass_, kw in launches)
    # without atomic dQ the dQ kernel runs first and computes delta = rowsum(dO * O) - d lse on the way
    backward = [(pass_, kw["DQ_DELTA"]) for pass_, kw in launches if pass_ != "fwd"]
    assert backward == ([("dkdv", False)] if "atomic" in pinned else [("dq", True), ("dkdv", False)]), backward


@pytest.mark.parametrize("how", ["segments", "causal_sq_gt_sk"])
def test_fully_masked_rows_in_one_loop(monkeypatch, triton_launches, run_vjp, how):
    monkeypatch.setenv("EJGEN_TRITON_CONFIG", ONE_LOOP_ATOMIC)
    conformance.check_fully_masked_rows("triton", run_vjp, how, "h")
    _ran_as_pinned(triton_launches, ONE_LOOP_ATOMIC)
