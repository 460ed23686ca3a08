"""Kernel choice is declared, visible and controllable (docs/DESIGN.md §6): which kernel set a call takes
and why (``explain``, ``ejgen show --call``, the debug log), the settings that steer it, and the
``deterministic`` guarantee on every backend."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejgen.cli import main
from ejgen.ops import explain, flash_attention, settings
from ejgen.runtime.attention.kernels import KERNEL_SETS
from ejgen.testing.shapes import AttnShape, random_qkv, rng_for

pytestmark = pytest.mark.usefixtures("x64_stays_off")

BF16 = jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.bfloat16)
BF16_KV = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)


def test_every_chosen_set_is_declared():
    for target in ("cpu", "sm80", "sm90", "tpu"):
        choice = explain(flash_attention, BF16, BF16_KV, BF16_KV, causal=True, target=target)
        assert {choice.forward, choice.backward} <= set(KERNEL_SETS)
        assert KERNEL_SETS[choice.forward].platform == choice.platform


@pytest.mark.parametrize("target,platform,forward,backward", [
    ("cpu", "xla", "xla", "xla"),
    ("tpu", "pallas", "pallas", "pallas"),
    ("sm80", "triton", "triton", "triton"),
    ("sm90", "triton", "gluon", "gluon"),
])
def test_auto_by_target(target, platform, forward, backward):
    choice = explain(flash_attention, BF16, BF16_KV, BF16_KV, causal=True, target=target)
    assert (choice.platform, choice.forward, choice.backward) == (platform, forward, backward)
    assert choice.reasons[0].startswith(f"platform {platform}: auto on {target}")


@pytest.mark.parametrize("change,why", [
    (dict(q=jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.float32)), "16-bit only"),
    (dict(d=96), "head dims 96/96"),
    (dict(mask_info="dense"), "not gluon: a dense mask ("),
    (dict(kv_len=512), "Sq 1024 != Sk 512"),
])
def test_the_hopper_set_says_why_it_declines(change, why):
    from ejgen.types import MaskInfo

    d, kv_len = change.pop("d", 128), change.pop("kv_len", 1024)
    q = change.pop("q", jax.ShapeDtypeStruct((1, 1024, 8, d), jnp.bfloat16))
    kv = jax.ShapeDtypeStruct((1, kv_len, 2, d), q.dtype)
    if change.get("mask_info") == "dense":
        change["mask_info"] = MaskInfo(attention_mask=jax.ShapeDtypeStruct((1, 1, 1024, 1024), jnp.bool_))
    choice = explain(flash_attention, q, kv, kv, causal=True, target="sm90", **change)
    assert (choice.forward, choice.backward) == ("triton", "triton")
    assert why in choice.reasons[1] and why in choice.reasons[2]


def test_soft_cap_and_sinks_take_the_hopper_set():
    """A soft cap (the kernels' SOFTCAP) and sinks (joined outside them) keep the Hopper set, with a window too
    (Gemma 2 and 3, gpt-oss); a soft cap's backward with the exact tanh runs the generated kernels (faster there),
    with the fast_tanh setting the Hopper one, and says why."""
    aux = jax.ShapeDtypeStruct((8,), jnp.float32)
    for kw in (dict(softmax_aux=aux), dict(softmax_aux=aux, sliding_window=(127, 0))):
        choice = explain(flash_attention, BF16, BF16_KV, BF16_KV, causal=True, target="sm90", **kw)
        assert (choice.forward, choice.backward) == ("gluon", "gluon"), (kw, choice.text())
    for kw in (dict(logits_soft_cap=30.0), dict(logits_soft_cap=50.0, sliding_window=(1023, 0))):
        choice = explain(flash_attention, BF16, BF16_KV, BF16_KV, causal=True, target="sm90", **kw)
        assert (choice.forward, choice.backward) == ("gluon", "triton"), (kw, choice.text())
        assert "a soft cap with the exact tanh" in choice.reasons[2], choice.reasons
        with settings(fast_tanh=True):
            fast = explain(flash_attention, BF16, BF16_KV, BF16_KV, causal=True, target="sm90", **kw)
        assert (fast.forward, fast.backward) == ("gluon", "gluon"), (kw, fast.text())


def test_narrow_windows_take_the_generated_backward():
    """A window narrower than gluon.host.NARROW_WINDOW keys: the Hopper forward, the generated backward (faster
    there), saying why; with sinks (gpt-oss) the Hopper set both ways (its sinks' gradient is the cheaper)."""
    aux = jax.ShapeDtypeStruct((8,), jnp.float32)
    choice = explain(flash_attention, BF16, BF16_KV, BF16_KV, causal=True, sliding_window=(127, 0), target="sm90")
    assert (choice.forward, choice.backward) == ("gluon", "triton"), choice.text()
    assert "a window of 128 keys, narrower than gluon.host.NARROW_WINDOW" in choice.reasons[2], choice.reasons
    gpt_oss = explain(flash_attention, BF16, BF16_KV, BF16_KV, causal=True, sliding_window=(127, 0),
                      softmax_aux=aux, target="sm90")
    assert (gpt_oss.forward, gpt_oss.backward) == ("gluon", "gluon"), gpt_oss.text()


def test_cross_attention_takes_the_hopper_set(monkeypatch):
    """Sq != Sk without causal: the Hopper forward (gluon_cross, on by default) and backward (gluon.host.
    CROSS_BACKWARD, on; off sends the backward to the generated kernels and says why); the setting off keeps both
    generated, and says why."""
    from ejgen.runtime.attention.gluon import host as gluon_host

    kv = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16)
    choice = explain(flash_attention, BF16, kv, kv, target="sm90")
    assert (choice.forward, choice.backward) == ("gluon", "gluon"), choice.text()
    monkeypatch.setattr(gluon_host, "CROSS_BACKWARD", False)
    choice = explain(flash_attention, BF16, kv, kv, target="sm90")
    assert (choice.forward, choice.backward) == ("gluon", "triton"), choice.text()
    assert "CROSS_BACKWARD" in choice.reasons[2]
    with settings(gluon_cross=False):
        off = explain(flash_attention, BF16, kv, kv, target="sm90")
        assert (off.forward, off.backward) == ("triton", "triton") and "Sq 1024 != Sk 512" in off.reasons[2]


def test_deterministic_keeps_the_hopper_backward_out():
    per_call = explain(flash_attention, BF16, BF16_KV, BF16_KV, causal=True, target="sm90", deterministic=True)
    assert (per_call.forward, per_call.backward, per_call.deterministic) == ("gluon", "triton", True)
    assert "reduce-adds" in per_call.reasons[2] and "by the call's argument" in per_call.reasons[-1]
    with settings(deterministic=True):
        scoped = explain(flash_attention, BF16, BF16_KV, BF16_KV, causal=True, target="sm90")
        assert scoped == per_call and "by the setting" in scoped.reasons[-1]
        assert explain(flash_attention, BF16, BF16_KV, BF16_KV, target="sm90", deterministic=False).backward == "gluon"


def test_settings_come_from_the_environment_and_scopes(monkeypatch):
    monkeypatch.setenv("EJGEN_DETERMINISTIC", "1")
    assert explain(flash_attention, BF16, BF16_KV, BF16_KV, target="sm90").backward == "triton"
    with settings(deterministic=False):
        assert explain(flash_attention, BF16, BF16_KV, BF16_KV, target="sm90").backward == "gluon"
    monkeypatch.delenv("EJGEN_DETERMINISTIC")
    with settings(gluon=False):
        choice = explain(flash_attention, BF16, BF16_KV, BF16_KV, target="sm90")
        assert choice.forward == "triton" and "gluon setting is off" in choice.reasons[1]
    with settings(triton_configs="fwd=128,64,8,3"):
        choice = explain(flash_attention, BF16, BF16_KV, BF16_KV, target="sm90")
        assert (choice.forward, choice.backward) == ("triton", "gluon") and "pinned" in choice.reasons[1]


def test_bad_settings_and_arguments_are_named():
    with pytest.raises(TypeError, match="unknown setting 'determinstic'"):
        with settings(determinstic=True):
            pass
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        with settings(deterministic=1):
            pass
    q = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(ValueError, match="deterministic must be None or a Python bool, got 'yes'"):
        flash_attention(q, q, q, deterministic="yes")
    with pytest.raises(ValueError, match="target must be one of cpu, sm80, sm90, tpu"):
        explain(flash_attention, q, q, q, target="h100")


def test_the_choice_is_logged_at_debug_level(caplog):
    q = jnp.zeros((1, 8, 2, 16))
    with caplog.at_level(logging.DEBUG, logger="ejgen"):
        flash_attention(q, q, q, causal=True, platform="xla")
    assert any("flash_attention: platform xla: forward xla, backward xla" in r.getMessage() for r in caplog.records)


def test_ejgen_show_call_reports_the_choice(capsys):
    call = "flash_attention(bf16[1,1024,8,128], bf16[1,1024,2,128], bf16[1,1024,2,128], causal=True)"
    assert main(["show", "--call", call, "--target", "sm90"]) == 0
    out = capsys.readouterr().out
    assert "platform triton: forward gluon, backward gluon" in out
    documents = call.replace("causal=True", "causal=True, mask_info=segments(int32[1,1024])")
    assert main(["show", "--call", documents, "--target", "sm90"]) == 0
    assert "platform triton: forward gluon, backward gluon" in capsys.readouterr().out  # packed documents
    assert main(["show", "--call", call.replace("causal=True", "mask_info=mask(bool[1,1,1024,1024])"),
                 "--target", "sm90"]) == 0
    assert "not gluon: a dense mask (the Hopper kernels take none of" in capsys.readouterr().out
    assert main(["show", "--call", "flash_attention(q)"]) == 1
    assert "neither a literal nor dtype[dims]" in capsys.readouterr().err
    assert main(["show", "--call", "no_such_op(f32[1])"]) == 1
    assert "has no op 'no_such_op'" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["xla", "triton", "pallas"])
def test_deterministic_calls_are_bitwise_reproducible(backend):
    """Two runs of the same deterministic call (forward and every gradient) give identical bits. Run as
    two separately traced functions, so nothing is shared between them but the inputs."""
    shape = AttnShape(1, 40, 40, 4, 2, 32)  # GQA, ragged, two tiles or more a side on either interpreter
    rng = rng_for("deterministic", backend)
    qkv = random_qkv(shape, "float32", rng)
    aux = jnp.asarray(rng.standard_normal(shape.q_heads), jnp.float32)

    def loss(q, k, v, aux):
        out = flash_attention(q, k, v, causal=True, softmax_aux=aux, platform=backend, deterministic=True)
        return jnp.sum(out * jnp.cos(out))

    runs = [jax.jit(jax.value_and_grad(lambda *a: loss(*a), argnums=(0, 1, 2, 3)))(*qkv.values(), aux)
            for _ in range(2)]
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1])):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the Hopper kernel set runs on sm_90 GPUs")
def test_on_hopper_deterministic_calls_leave_the_gluon_backward_and_agree_with_the_oracle(run_vjp):
    """On an H100/H200: the default call takes the Gluon set for both passes, the deterministic one keeps the
    Gluon forward and takes the generated backward; both match the float64 oracle, and the deterministic one
    gives identical bits twice."""
    import oracle
    from ejgen.runtime.attention.gluon import host as gluon_attention
    from ejgen.testing.shapes import random_cotangents

    if not gluon_attention.hopper():
        pytest.skip("not a Hopper GPU")
    shape = AttnShape(1, 640, 640, 4, 2, 128)
    rng = rng_for("hopper-deterministic")
    diff = random_qkv(shape, "bfloat16", rng)
    d_out, d_lse = random_cotangents(shape, "bfloat16", rng)
    q, k, v = diff["query"], diff["key"], diff["value"]
    fast = explain(flash_attention, q, k, v, causal=True)
    det = explain(flash_attention, q, k, v, causal=True, deterministic=True)
    assert (fast.forward, fast.backward) == ("gluon", "gluon"), fast.text()
    assert (det.forward, det.backward) == ("gluon", "triton"), det.text()
    ref = oracle.attention(**{n: np.asarray(x) for n, x in diff.items()}, causal=True, d_out=d_out, d_lse=d_lse)
    runs = []
    for deterministic in (False, True, True):
        out, lse, grads = run_vjp(flash_attention, diff, {}, dict(causal=True, deterministic=deterministic),
                                  d_out, d_lse)
        oracle.check_attention(out, lse, grads, ref, diff, "bfloat16")
        runs.append((out, lse, grads))
    for a, b in zip(jax.tree.leaves(runs[1]), jax.tree.leaves(runs[2])):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_deterministic_xla_on_a_gpu_needs_deterministic_scatters(monkeypatch):
    """Param gradients on platform xla are scatter-adds: on a GPU a deterministic call needs XLA's flag."""
    from ejgen.generated import alibi_attention

    q = jax.ShapeDtypeStruct((1, 64, 4, 32), jnp.float32)
    slopes = jax.ShapeDtypeStruct((4,), jnp.float32)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    with pytest.raises(ValueError, match="xla_gpu_deterministic_ops=true"):
        explain(alibi_attention, q, q, q, slopes=slopes, platform="xla", deterministic=True, target="sm90")
    assert explain(flash_attention, q, q, q, platform="xla", deterministic=True, target="sm90").deterministic
    assert explain(alibi_attention, q, q, q, slopes=slopes, platform="xla", deterministic=True).deterministic
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
    assert explain(alibi_attention, q, q, q, slopes=slopes, platform="xla", deterministic=True, target="sm90")
