"""Ring attention on the GPUs of one host (`pytest -m gpu tests/multidevice/test_ring_gpu.py` on a host with 2 or more
GPUs; NCCL, NVLink multicast off): the ring over every GPU against the float64 oracle of the whole call, bf16, on the
triton platform (the Hopper kernels where the planned kinds allow them: asserted from the kernel choices the ring
logs), and the mesh wrapper with data x sequence parallelism. The CPU mesh covers the rest (`test_ring.py`)."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ejgen.generated import alibi_attention_ring
from ejgen.ops import flash_attention, ring_attention, ring_permute, ring_unpermute
from ejgen.testing.shapes import AttnShape, packed_segments, random_cotangents, random_qkv, rng_for
from ejgen.types import MaskInfo

_ORACLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "attention", "oracle.py")
_spec = importlib.util.spec_from_file_location("attention_oracle", _ORACLE)  # by path: other families have an oracle
oracle = sys.modules.setdefault("attention_oracle", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(oracle)

GPUS = len(jax.devices("gpu")) if jax.default_backend() == "gpu" else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 2, reason="ring attention on GPUs needs 2 or more GPUs")]


def _hopper() -> bool:
    from ejgen.runtime.attention.gluon import host as gluon_attention

    return gluon_attention.hopper()


def _choices(caplog) -> list[str]:
    """The kernel choices the ring logged (one per kind of step): 'platform triton: forward gluon, backward gluon'."""
    return [r.getMessage().split(": ", 1)[1].splitlines()[0] for r in caplog.records if r.name == "ejgen"]


def _run(fn, diff, d_out, d_lse):
    @jax.jit
    def run(diff, d_out, d_lse):
        (out, lse), pull = jax.vjp(lambda d: fn(**d), diff)
        return out, lse, pull((d_out, d_lse))[0]

    return jax.block_until_ready(run(diff, d_out, d_lse))


RING_FORMS = [  # (id, order, KV_FROM_WIRE, MERGE_IN_KERNEL, DQ_ONCE, KV_FROM_WIRE_BWD, Q_IN_PLACE, DKV_INTO,
    # gluon.host.LAYOUT_SPANS, KV_APART, FIRST_STEP_SPARE_SMS)
    ("zigzag", "zigzag", False, False, False, False, False, False, False, False, 0),
    ("contiguous", "contiguous", False, False, False, False, False, False, False, False, 0),
    ("zigzag-kv-from-wire", "zigzag", True, False, False, False, False, False, False, False, 0),
    ("zigzag-kv-from-wire-merge-in-kernel", "zigzag", True, True, False, False, False, False, False, False, 0),
    ("zigzag-dq-once", "zigzag", True, True, True, False, False, False, False, False, 0),
    ("contiguous-dq-once", "contiguous", False, False, True, False, False, False, False, False, 0),
    ("zigzag-kv-from-wire-bwd", "zigzag", True, True, False, True, False, False, False, False, 0),
    ("contiguous-kv-from-wire-bwd-dq-once", "contiguous", False, False, True, True, False, False, False, False, 0),
    ("zigzag-dq-once-copies", "zigzag", True, True, True, True, False, False, False, False, 0),  # session 35's default
    # Q_IN_PLACE and ZEROS_BY_DELTA on (session 37; contiguous rings' pairs are every local row: nothing in place)
    ("zigzag-q-in-place", "zigzag", True, True, True, True, True, False, False, False, 0),
    # the default since session 37 where the block travels packed (KV_APART off: at 32k and more unless XLA_FLAGS raise
    # the combiner's threshold): every switch on, dK / dV written into the wire by the first backward step's pairs
    # (ring.DKV_INTO) too
    ("zigzag-defaults", "zigzag", True, True, True, True, True, True, False, False, 0),
    # the wide step walking its tiles' spans of key blocks, not lists (gluon.host.LAYOUT_SPANS, off; session 39)
    ("zigzag-spans", "zigzag", True, True, True, True, True, True, True, False, 0),
    # the forward's block sent as its arrays (ring.KV_APART; on a GPU by default where XLA's combiner makes them one
    # collective: these shapes' blocks are under its threshold), then with the first step's SMs spared for the hop
    # (ring.FIRST_STEP_SPARE_SMS: by default with NCCL_CGA_CLUSTER_SIZE=0), whose wide step walks spans (session 40)
    ("zigzag-apart", "zigzag", True, True, True, True, True, True, False, True, 0),
    ("zigzag-hop-sms", "zigzag", True, True, True, True, True, True, False, True, 8),
]


@pytest.mark.parametrize("order,wire,merge,once,wire_bwd,in_place,dkv,spans,apart,spare", [c[1:] for c in RING_FORMS],
                         ids=[c[0] for c in RING_FORMS])
def test_causal_ring_over_every_gpu(order, wire, merge, once, wire_bwd, in_place, dkv, spans, apart, spare, caplog,
                                    monkeypatch):
    """Causal, GQA 8/2, D 128, bf16 over every GPU: out, lse and every gradient against the oracle; on Hopper every
    kind of step (full blocks, the diagonal, zigzag's coalesced calls) takes the Hopper kernel set both ways:
    every kernel launched is a Gluon one; with ``wire`` (ring.KV_FROM_WIRE) zigzag's coalesced forward reads K and V
    out of the received buffer (KV_AT), with ``merge`` (ring.MERGE_IN_KERNEL) on 2 GPUs merges into the first step's
    result in its kernel (MERGE); with ``once`` (ring.DQ_ONCE) the backward's kernels add dQ into one accumulator
    (aliased from launch to launch); with ``wire_bwd`` (ring.KV_FROM_WIRE_BWD) the backward's pairs on a received
    block read K and V out of it (KV_AT); with ``in_place`` (ring.Q_IN_PLACE, with ``once``) they read their rows of
    q and dO where they lie (QDO_IN_PLACE), and the accumulator is zeroed by the delta kernel's launch
    (ring.ZEROS_BY_DELTA); with ``dkv`` (ring.DKV_INTO) the received block's pairs write dK / dV into the buffer
    that travels home (DKV_AT), the pairs after the first into the first's, adding where they share keys; with
    ``spans`` (gluon.host.LAYOUT_SPANS) the wide step merged in its kernel walks each tile's span of key blocks
    (SPANS), no lists; with ``apart`` (ring.KV_APART) the forward sends K and V as they are (its wide step reads
    them, not a wire); with ``spare`` (ring.FIRST_STEP_SPARE_SMS) SMs left to the hop, the last wide step walks
    spans."""
    from ejgen.runtime.attention import ring
    from ejgen.runtime.attention.gluon import host as gluon_attention
    from ejgen.runtime.launch import triton_call

    launched, launch = [], triton_call.launch

    def spy(kernel, *args, **kw):
        bwd = kernel.__name__ == "gluon_attention_bwd_kernel"
        if getattr(kernel, "fn", kernel).__module__ not in gluon_attention.PLAIN_TRITON:  # (their plan and delta)
            launched.append((kernel.__name__, not bwd and kw.get("KV_AT", 0) > 0, kw.get("MERGE", False),
                             bwd and bool(kw.get("aliases")), bwd and kw.get("KV_AT", 0) > 0,
                             bwd and kw.get("QDO_IN_PLACE", False), bwd and kw.get("DKV_AT", 0) > 0,
                             not bwd and kw.get("SPANS", False)))
        return launch(kernel, *args, **kw)

    monkeypatch.setattr(triton_call, "launch", spy)
    monkeypatch.setattr(ring, "KV_FROM_WIRE", wire)
    monkeypatch.setattr(ring, "MERGE_IN_KERNEL", merge)
    monkeypatch.setattr(ring, "DQ_ONCE", once)
    monkeypatch.setattr(ring, "KV_FROM_WIRE_BWD", wire_bwd)
    monkeypatch.setattr(ring, "Q_IN_PLACE", in_place)
    monkeypatch.setattr(ring, "ZEROS_BY_DELTA", in_place)  # (the accumulator's zeros by the delta launch's memset)
    monkeypatch.setattr(ring, "DKV_INTO", dkv)
    monkeypatch.setattr(gluon_attention, "LAYOUT_SPANS", spans)
    monkeypatch.setattr(ring, "KV_APART", apart)
    monkeypatch.setattr(ring, "FIRST_STEP_SPARE_SMS", spare)
    n = GPUS
    shape = AttnShape(1, 256 * n, 256 * n, 8, 2, 128)
    rng = rng_for("ring-gpu", order, shape)
    diff = random_qkv(shape, "bfloat16", rng)
    d_out, d_lse = random_cotangents(shape, "bfloat16", rng)
    to = (lambda x, axis=1: ring_permute(x, n, token_order=order, axis=axis)) if order == "zigzag" else (
        lambda x, axis=1: x)
    back = (lambda x, axis=1: ring_unpermute(x, n, token_order=order, axis=axis)) if order == "zigzag" else (
        lambda x, axis=1: x)
    mesh = jax.make_mesh((n,), ("sp",))

    def fn(query, key, value):
        out, lse = ring_attention(to(query), to(key), to(value), axis_name="sp", causal=True, token_order=order,
                                  platform="triton", return_lse=True)
        return back(out), back(lse, axis=2)

    with caplog.at_level(logging.DEBUG, logger="ejgen"), jax.set_mesh(mesh):
        out, lse, grads = _run(fn, diff, d_out, d_lse)
    out, lse, grads = jax.tree.map(np.asarray, (out, lse, grads))
    ref = oracle.attention(**{k: np.asarray(x) for k, x in diff.items()}, causal=True, d_out=d_out, d_lse=d_lse)
    oracle.check_attention(jnp.asarray(out), jnp.asarray(lse), grads, ref, diff, "bfloat16")
    choices = _choices(caplog)
    assert choices, "the ring logged no kernel choice"
    if _hopper():  # a coalesced step is one square call with a 2 x 2 block layout (ring._wide_layout): the Hopper
        # set both ways too
        assert all(c.startswith("platform triton: forward gluon, backward gluon") for c in choices), choices
        assert launched and all(name.startswith("gluon_") for name, *_ in launched), sorted(set(launched))
        assert any(x[1] for x in launched) == (wire and not apart), launched
        assert any(x[2] for x in launched) == (merge and n == 2), launched
        assert any(x[3] for x in launched) == once, launched
        assert any(x[4] for x in launched) == wire_bwd, launched
        assert any(x[5] for x in launched) == in_place, launched
        assert any(x[6] for x in launched) == (dkv and n == 2), launched
        assert any(x[7] for x in launched) == ((spans or spare > 0) and merge and n == 2), launched


@pytest.mark.parametrize("apart,spare", [(False, 0), (True, 0), (True, 8)], ids=["packed", "apart", "hop-sms"])
def test_forward_alone_over_every_gpu(apart, spare, monkeypatch):
    """The forward alone (the primal call, no residuals) of a causal zigzag ring, GQA 8/2, D 128, bf16 over every
    GPU: out and lse against the oracle. On Hopper over 2 GPUs the first step is one Gluon launch, and the wide step
    reads the received wire (KV_AT; ``apart``, ring.KV_APART: K and V as received) and merges into the first step's
    result in its kernel (MERGE, aliased); with ``spare`` SMs left to the hop (ring.FIRST_STEP_SPARE_SMS) the wide
    step walks spans (SPANS)."""
    from ejgen.runtime.attention import ring
    from ejgen.runtime.launch import triton_call

    launched, launch = [], triton_call.launch

    def spy(kernel, *args, **kw):
        if kernel.__name__ == "gluon_attention_fwd_kernel":
            launched.append((bool(kw.get("aliases")), kw["KV_AT"] > 0, kw["MERGE"], kw.get("SPANS", False)))
        return launch(kernel, *args, **kw)

    monkeypatch.setattr(triton_call, "launch", spy)
    monkeypatch.setattr(ring, "KV_APART", apart)
    monkeypatch.setattr(ring, "FIRST_STEP_SPARE_SMS", spare)
    n = GPUS
    shape = AttnShape(1, 256 * n, 256 * n, 8, 2, 128)
    diff = random_qkv(shape, "bfloat16", rng_for("ring-gpu-apart", shape))
    mesh = jax.make_mesh((n,), ("sp",))

    @jax.jit
    def fn(query, key, value):
        to = lambda x: ring_permute(x, n, token_order="zigzag")  # noqa: E731
        out, lse = ring_attention(to(query), to(key), to(value), axis_name="sp", causal=True, token_order="zigzag",
                                  platform="triton", return_lse=True)
        return ring_unpermute(out, n, token_order="zigzag"), ring_unpermute(lse, n, token_order="zigzag", axis=2)

    with jax.set_mesh(mesh):
        out, lse = jax.block_until_ready(fn(**diff))
    ref = oracle.attention(**{k: np.asarray(x) for k, x in diff.items()}, causal=True)
    tol = oracle.tolerance("bfloat16", None)
    oracle.assert_close("out", np.asarray(out), ref.out, tol)
    oracle.assert_close("lse", np.asarray(lse), ref.lse, oracle.LSE_TOLERANCE)
    if _hopper() and n == 2:
        assert launched == [(False, False, False, False), (True, not apart, True, spare > 0)], launched


def test_window_segments_sinks_ring(caplog):
    """Causal window (300, 0), segment ids, per-head sinks, contiguous over every GPU, head dim 128: blocks the window
    cuts run the generated kernels with global positions (no dS band there); against the oracle."""
    n = GPUS
    shape = AttnShape(2, 256 * n, 256 * n, 4, 4, 128)
    rng = rng_for("ring-gpu-window", shape)
    diff = random_qkv(shape, "bfloat16", rng)
    diff["softmax_aux"] = jnp.asarray(rng.standard_normal(4) + 1.0, jnp.float32)
    d_out, d_lse = random_cotangents(shape, "bfloat16", rng)
    ids = packed_segments(2, shape.q_len, rng)
    mesh = jax.make_mesh((n,), ("sp",))

    def fn(query, key, value, softmax_aux):
        return ring_attention(query, key, value, axis_name="sp", causal=True, sliding_window=(300, 0),
                              softmax_aux=softmax_aux, mask_info=MaskInfo.from_segments(ids), platform="triton",
                              return_lse=True)

    with jax.set_mesh(mesh):
        out, lse, grads = _run(fn, diff, d_out, d_lse)
    out, lse, grads = jax.tree.map(np.asarray, (out, lse, grads))
    ref = oracle.attention(**{k: np.asarray(x) for k, x in diff.items()}, causal=True, sliding_window=(300, 0),
                           q_segment_ids=ids, kv_segment_ids=ids, d_out=d_out, d_lse=d_lse)
    oracle.check_attention(jnp.asarray(out), jnp.asarray(lse), grads, ref, diff, "bfloat16")


def test_authored_spec_ring():
    """alibi_attention's ring form (a score over global positions), zigzag over every GPU, its slopes' gradient."""
    n = GPUS
    shape = AttnShape(1, 256 * n, 256 * n, 4, 2, 64)
    rng = rng_for("ring-gpu-alibi", shape)
    diff = random_qkv(shape, "bfloat16", rng)
    diff["slopes"] = jnp.asarray(rng.uniform(0.01, 0.1, 4), jnp.float32)
    d_out, d_lse = random_cotangents(shape, "bfloat16", rng)
    mesh = jax.make_mesh((n,), ("sp",))

    def fn(query, key, value, slopes):
        to = lambda x: ring_permute(x, n)  # noqa: E731
        out, lse = alibi_attention_ring(to(query), to(key), to(value), slopes=slopes, causal=True, max_distance=200,
                                        axis_name="sp", token_order="zigzag", platform="triton", return_lse=True)
        return ring_unpermute(out, n), ring_unpermute(lse, n, axis=2)

    with jax.set_mesh(mesh):
        out, lse, grads = _run(fn, diff, d_out, d_lse)
    out, lse, grads = jax.tree.map(np.asarray, (out, lse, grads))
    plain = {k: np.asarray(x) for k, x in diff.items()}
    slopes = plain.pop("slopes")
    ref = oracle.variant_attention("alibi_attention", **plain, params={"slopes": slopes},
                                   options={"max_distance": 200}, causal=True, d_out=d_out, d_lse=d_lse)
    oracle.check_attention(jnp.asarray(out), jnp.asarray(lse), grads, ref, diff, "bfloat16")


@pytest.mark.skipif(GPUS < 4 or GPUS % 2, reason="data x sequence parallelism needs an even number of 4+ GPUs")
def test_mesh_wrapper_data_and_sequence_parallel():
    """flash_attention(..., mesh=(dp 2, sp GPUs/2), in_specs=P("dp", "sp"), token_order="zigzag"): a training-like
    step (forward and backward under jit, inputs laid out in zigzag order) equal to the same call on one GPU."""
    sp = GPUS // 2
    shape = AttnShape(2, 512 * sp, 512 * sp, 8, 2, 128)
    rng = rng_for("ring-gpu-wrapper", shape)
    diff = random_qkv(shape, "bfloat16", rng)
    d_out, d_lse = random_cotangents(shape, "bfloat16", rng)
    mesh = jax.make_mesh((2, sp), ("dp", "sp"))
    kw = dict(causal=True, platform="triton", return_lse=True)

    def zigzag(query, key, value):
        to = lambda x: ring_permute(x, sp)  # noqa: E731
        out, lse = flash_attention(to(query), to(key), to(value), **kw, mesh=mesh, in_specs=P("dp", "sp"),
                                   token_order="zigzag")
        return ring_unpermute(out, sp), ring_unpermute(lse, sp, axis=2)

    cut = _run(zigzag, diff, d_out, d_lse)
    one = _run(lambda **d: flash_attention(**d, **kw), diff, d_out, d_lse)
    for a, b, name in zip(jax.tree.leaves(cut), jax.tree.leaves(one), ["out", "lse", "dk", "dq", "dv"]):
        oracle.assert_close(name, np.asarray(a, np.float32), np.asarray(b, np.float32), 2e-2)
