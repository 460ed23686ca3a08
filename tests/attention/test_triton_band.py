"""The dS band (`band` dkdv flag): with a sliding window the dK/dV kernel also stores its dS tiles (the
window's band of key blocks per query block, input dtype), and dQ = scale * dS @ K runs as one matmul
per tile (the dQ kernel's BAND path) instead of a dQ kernel that recomputes the logits and dP.

In Triton's interpreter (and natively on a GPU), against the float64 oracle: outputs, lse and every
gradient, on causal and two-sided windows, Sq != Sk (the band's bottom-right alignment), GQA (one band
row per query head), ragged ends, soft cap, sinks and bias (not PLAIN: masked ds), float32 with a head
dim that is not a power of two, segments (a mask known at run time) and varlen sequences. A spy checks
that the dQ kernel ran over the band, after the dK/dV kernel, and not its recomputing loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("triton", reason="the triton extra is part of the test install (README)")

import test_conformance as conformance  # noqa: E402
from ejgen.testing.shapes import MHA_SHAPES, VARLEN_SHAPES, AttnShape  # noqa: E402

from ejgen.runtime.attention.triton import host as triton_attention
from ejgen.runtime.launch import triton_call
from ejgen.runtime.attention.triton import configs as triton_configs  # noqa: E402

pytestmark = pytest.mark.usefixtures("x64_stays_off")

BAND = "16,16,4,1,merged,band"
# Shapes of four or five 16 x 16 tiles a side: each window's band spans two or more key blocks and leaves some out
# (a batch of two in the f32 case: the band's rows per batch)
CASES = [  # (id, shape, features, dkdv config)
    ("causal-window-gqa-ragged", AttnShape(1, 54, 54, 2, 1, 32), dict(causal=True, sliding_window=(20, 0)), BAND),
    ("two-sided-sq-ne-sk-three-loops", AttnShape(1, 64, 50, 2, 2, 32), dict(sliding_window=(20, 17)), "16,16,4,1,band"),
    ("window-softcap-sinks", AttnShape(1, 80, 80, 2, 1, 16), dict(sliding_window=(40, 0), logits_soft_cap=5.0, sinks="h"),
     BAND),
    ("window-bias-sk-gt-sq", AttnShape(1, 45, 61, 2, 2, 32), dict(sliding_window=(9, 3), bias=True), BAND),
    ("window-f32-d24", AttnShape(2, 33, 29, 2, 2, 24), dict(causal=True, sliding_window=(7, 0)), BAND),
]


def _backward_passes(launches):
    """(pass, BAND, DQ_DELTA) of each backward launch, in order."""
    return [(pass_, kw["BAND"], kw["DQ_DELTA"]) for pass_, kw in launches if pass_ != "fwd"]


def _ran_with_band(launches):
    """The dK/dV kernel stored the band, then the dQ kernel ran over it (not the recomputing loop, and
    not computing delta: that came from XLA before the dK/dV kernel)."""
    assert _backward_passes(launches) == [("dkdv", True, False), ("dq", True, False)], launches
    assert all(not kw["BAND"] for pass_, kw in launches if pass_ == "fwd"), launches


@pytest.mark.parametrize("shape,features,conf", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_dq_over_the_ds_band_matches_the_oracle(monkeypatch, triton_launches, triton_against_oracle, shape, features,
                                                conf):
    monkeypatch.setenv("EJGEN_TRITON_CONFIG", f"dkdv={conf}")
    triton_against_oracle(shape, features, "float32" if shape.head_dim == 24 else "bfloat16", "band")
    _ran_with_band(triton_launches)


def test_band_with_segments_bias_sinks(monkeypatch, triton_launches, run_vjp):
    features = conformance.Features(causal=True, window=(20, 0), sinks="hn", bias="b1qk", segments="packed",
                                    **conformance.CAP)
    monkeypatch.setenv("EJGEN_TRITON_CONFIG", f"dkdv={BAND}")
    conformance.run_case(conformance.Case(features, MHA_SHAPES[0], "float16"), "triton", run_vjp)
    _ran_with_band(triton_launches)


def test_band_with_varlen(monkeypatch, triton_launches, run_vjp):
    features = conformance.Features(causal=True, window=(8, 0), sinks="h")
    monkeypatch.setenv("EJGEN_TRITON_CONFIG", f"dkdv={BAND}")
    conformance.run_case(conformance.Case(features, VARLEN_SHAPES[1], "bfloat16"), "triton", run_vjp)
    _ran_with_band(triton_launches)


def test_a_table_band_falls_back_where_the_window_is_too_wide(monkeypatch, triton_launches):
    """The table's window row has the band (16-bit, head dims 65-128; measured faster, triton_configs), and
    the interpreter mirrors it: it runs for a narrow window and recomputes dS in the dQ kernel where the
    band would take too much memory; without a window there is no band."""
    from ejgen.ops import flash_attention

    assert [key for key, rows in triton_configs._SPECIAL.items() if any(c.band for _, _, c in rows)] == [
        ("sm90", "dkdv", "window")]
    assert triton_configs.pick("sm90", "dkdv", 128, 16, 16384, True, True).band
    assert not triton_configs.pick("sm90", "dkdv", 128, 32, 16384, True, True).band  # f32: the generic table
    assert triton_configs.pick("interpret", "dkdv", 128, 16, 16384, True, True).band
    assert not triton_configs.pick("interpret", "dkdv", 128, 16, 16384, True, False).band
    monkeypatch.delenv("EJGEN_TRITON_CONFIG", raising=False)
    seq, d = 96, 72  # six key blocks: the (100, 0) window's band (capped by them) is still over the ratio below
    conf = triton_configs.pick(triton_attention._arch(), "dkdv", d, 16, seq, True, True)  # 16x16 here, 64x64 on a GPU
    narrow, wide = (triton_configs.band_blocks(conf.block_m, conf.block_n, left, seq) * conf.block_n for left in (8, 100))
    ratio = -(-narrow // d)
    assert narrow <= ratio * d < wide, (conf, narrow, wide)
    monkeypatch.setattr(triton_attention, "BAND_MAX_RATIO", ratio)  # the (8, 0) window's band fits, (100, 0)'s not
    q = jax.ShapeDtypeStruct((1, seq, 2, d), jnp.bfloat16)
    for window, passes in (((8, 0), [("dkdv", True, False), ("dq", True, False)]),
                           ((100, 0), [("dq", False, True), ("dkdv", False, False)])):
        triton_launches.clear()
        loss = lambda q: flash_attention(q, q, q, causal=True, sliding_window=window, platform="triton").astype(
            jnp.float32).sum()
        jax.eval_shape(jax.grad(loss), q)  # the passes are chosen and launched while tracing; the oracle tests run them
        assert _backward_passes(triton_launches) == passes, (window, triton_launches)


def test_no_table_band_with_explicit_positions(triton_launches, run_vjp):
    """Explicit positions replace the analysed ranges the band is laid along (every key block is visited, under the
    element mask): the table's band (16-bit, head dim 96, a window) gives way to the recomputing dQ kernel, whose
    gradients match the oracle (the band read the first blocks only: dQ was 48% off here)."""
    import numpy as np

    import oracle
    from ejgen.ops import flash_attention
    from ejgen.testing.shapes import random_cotangents, random_qkv, rng_for

    shape = AttnShape(1, 96, 96, 2, 2, 96)
    rng = rng_for("band-positions")
    diff = random_qkv(shape, "bfloat16", rng)
    d_out, d_lse = random_cotangents(shape, "bfloat16", rng)
    pos = jnp.arange(96, dtype=jnp.int32)[None] + 1000
    features = dict(causal=True, sliding_window=(20, 0))
    out, lse, grads = run_vjp(flash_attention, diff, dict(q_positions=pos, kv_positions=pos),
                              dict(**features, platform="triton"), d_out, d_lse)
    ref = oracle.attention(**{n: np.asarray(x) for n, x in diff.items()}, **features, d_out=d_out, d_lse=d_lse)
    oracle.check_attention(out, lse, grads, ref, diff, "bfloat16")
    assert [kw["BAND"] for pass_, kw in triton_launches if pass_ != "fwd"] == [False, False], triton_launches


@pytest.mark.parametrize("pin,message", [
    ("dkdv=16,16,4,1,band", "'band' needs a sliding window"),
    ("dkdv=16,16,4,1,atomic,band", "'band' and 'atomic' are two ways to dQ"),
    ("dq=16,16,4,1,band", "'band' .* is a flag of the dkdv config only"),
])
def test_band_errors(monkeypatch, pin, message):
    import jax

    from ejgen.ops import flash_attention

    if triton_call.mode()[0] is None:
        pytest.fail("this test needs the triton backend: run it with TRITON_INTERPRET=1 (README)")
    monkeypatch.setenv("EJGEN_TRITON_CONFIG", pin)
    window = (4, 0) if "atomic" in pin or pin.startswith("dq") else None
    loss = lambda q: flash_attention(q, q, q, sliding_window=window, platform="triton").astype(jnp.float32).sum()
    with pytest.raises(ValueError, match=message):
        jax.grad(loss)(jnp.ones((1, 32, 2, 16), jnp.bfloat16))


def test_a_pinned_band_too_wide_is_an_error(monkeypatch):
    import jax

    from ejgen.ops import flash_attention

    if triton_call.mode()[0] is None:
        pytest.fail("this test needs the triton backend: run it with TRITON_INTERPRET=1 (README)")
    monkeypatch.setenv("EJGEN_TRITON_CONFIG", f"dkdv={BAND}")
    d = 16
    window = (triton_attention.BAND_MAX_RATIO * d, 0)  # 18 blocks of 16 (the 20 blocks of keys do not cap it)
    loss = lambda q: flash_attention(q, q, q, sliding_window=window, platform="triton").astype(jnp.float32).sum()
    with pytest.raises(ValueError, match=r"dS band \(288 columns\) is over 16x the head dim"):
        jax.eval_shape(jax.grad(loss), jax.ShapeDtypeStruct((1, 320, 2, d), jnp.bfloat16))  # raised while tracing
    # a window wider than the keys: the band is capped by the keys' blocks (2 here) and runs
    assert jnp.isfinite(jax.grad(loss)(jnp.ones((1, 32, 2, d), jnp.bfloat16))).all()


def test_band_kernels_compile_for_hopper():
    from ejgen.testing.aot import compile_in_subprocess

    compiled = compile_in_subprocess("ejgen.generated", "flash_attention", capability=90, num_warps=4, num_stages=2,
                                     causal=True, window=True, block_m=64, block_n=64, staged=False, band=True)
    for name in ("bwd_dkdv_kernel", "bwd_dq_kernel"):  # compiled with BAND
        c = compiled[name]
        assert c["cubin"] and c["wgmma"] and c["shared"] <= 232448, (name, c)
