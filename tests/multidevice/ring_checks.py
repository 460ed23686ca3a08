"""Ring attention on a CPU mesh of 8 host devices, for `test_ring.py`: ``python ring_checks.py <backend>`` runs every
check of that backend in this process and prints one JSON line, ``{check: [failures]}`` (empty: passed).

Each check cuts one global call's sequence over a mesh axis of 2, 4 or 8 devices (inside ``jax.shard_map``, under a
mesh context on global arrays, or through the mesh wrapper), runs it under ``jax.jit`` with ``jax.vjp`` (cotangents
for out and lse), brings a zigzag layout back to position order, and compares out, lse and every gradient with the
float64 oracle of the same call on the whole sequence (and, on xla, with the op on one device: the same kernels on
slices, merged in another order).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import shard_checks  # noqa: E402  (sets XLA_FLAGS for 8 host devices before JAX starts)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import oracle  # noqa: E402
from ejgen.generated import alibi_attention_ring, prefix_lm_attention_ring  # noqa: E402
from ejgen.zoo import chunked_local_attention_ring  # noqa: E402
from ejgen.ops import (blocksparse_attention, flash_attention, ring_attention, ring_permute,  # noqa: E402
                       ring_unpermute)
from ejgen.testing.shapes import AttnShape, packed_segments  # noqa: E402
from ejgen.types import MaskInfo  # noqa: E402

SEQ = P(None, "sp")  # [B, S, H, D] and segment ids [B, S]: the sequence over the ring's axis
RESULTS = (P(None, "sp"), P(None, None, "sp"))  # out [B, S, H, D], lse [B, H, S]


def laid_out(order, devices):
    """(to the ring's layout, back to position order) of a [B, S, ...] array (lse: its axis 2)."""
    if order == "contiguous":
        return (lambda x, axis=1: x), (lambda x, axis=1: x)
    return (lambda x, axis=1: ring_permute(x, devices, token_order=order, axis=axis),
            lambda x, axis=1: ring_unpermute(x, devices, token_order=order, axis=axis))


def in_shard_map(ring_op, devices, order, arrays: dict, seq_arrays: dict, **static):
    """``fn(**diff) -> (out, lse)``: ``ring_op`` inside ``jax.shard_map`` over ``devices`` devices of axis "sp", its
    inputs laid out in ``order`` (q, k, v and the ``seq_arrays`` [B, S] cut along the sequence; the other ``arrays``
    replicated) and its results back in position order."""
    mesh = shard_checks.auto_mesh((devices,), ("sp",))
    to, back = laid_out(order, devices)

    def fn(query, key, value, **extra):
        extra = {**arrays, **extra}
        seq = {n: to(x) for n, x in seq_arrays.items()}
        names = sorted(extra)

        def body(q, k, v, seq, values):
            kw = dict(zip(names, values))
            if "q_ids" in seq:
                kw["mask_info"] = MaskInfo.from_segments(seq["q_ids"])
            return ring_op(q, k, v, axis_name="sp", token_order=order, return_lse=True, **static, **kw)

        run = jax.shard_map(body, mesh=mesh, in_specs=(SEQ, SEQ, SEQ, {n: SEQ for n in seq}, [P()] * len(names)),
                            out_specs=RESULTS)
        out, lse = run(to(query), to(key), to(value), seq, [extra[n] for n in names])
        return back(out), back(lse, axis=2)

    return fn


def check(failures, sharded, ref, single=None):
    """The ring's out, lse and gradients against the oracle (its tolerances) and, where given, the one-device call."""
    out, lse, grads = sharded
    pairs = [("out", out, ref.out, oracle.TOLERANCE["float32"], 0),
             ("lse", lse, ref.lse, oracle.LSE_TOLERANCE, 1)]
    pairs += [(f"d{n}", grads[n], ref.grads[n], oracle.TOLERANCE["float32"], n) for n in grads]
    for name, x, exact, tol, key in pairs:
        wants = [("oracle", exact, tol)]
        if single is not None:
            one = single[key] if isinstance(key, int) else single[2][key]
            wants.append(("one device", one, shard_checks.SAME))
        for what, want, t in wants:
            try:
                oracle.assert_close(f"{name} vs {what}", x, want, t)
            except AssertionError as e:
                failures.append(str(e))


def check_zigzag_features(backend, failures, devices=4):
    """zigzag (balanced causal), GQA, segment ids (laid out too), per-head sinks (counted once) and a soft cap: the
    first step one causal call over both chunks, every later step full c x c blocks."""
    shape = AttnShape(1, 32, 32, 4, 2, 16)
    rng, diff, d_out, d_lse = shard_checks.inputs(shape, "ring-zigzag")
    diff["softmax_aux"] = jnp.asarray(rng.standard_normal(4) + 1.0, jnp.float32)
    ids = packed_segments(1, 32, rng)
    kw = dict(causal=True, logits_soft_cap=3.0, platform=backend)
    fn = in_shard_map(ring_attention, devices, "zigzag", {}, {"q_ids": jnp.asarray(ids)}, **kw)
    sharded = shard_checks.vjp_call(fn, diff, d_out, d_lse)
    ref = oracle.attention(**diff, causal=True, logits_soft_cap=3.0, q_segment_ids=ids, kv_segment_ids=ids,
                           d_out=d_out, d_lse=d_lse)
    check(failures, sharded, ref)


def check_zigzag_pairs(backend, failures, devices=4):
    """`check_zigzag_features` with each later step's two full blocks run as two calls (ring.COALESCE off; on, the
    default, they run as one 2c x 2c call with a block layout of the two, `ring._wide_layout`)."""
    from ejgen.runtime.attention import ring

    before, ring.COALESCE = ring.COALESCE, False
    try:
        check_zigzag_features(backend, failures, devices)
    finally:
        ring.COALESCE = before


def _coalescing(other: bool = False):
    """A context for the coalescing checks: ring.COALESCE on, ring._wide_forward counted (the dict it yields:
    "fwd"), and with ``other`` the wide call's forward kernels made to differ from the square pairs' (as where a
    backend's kernels cannot walk the wide call's block layout of c x c blocks: the Hopper set where c neither covers
    nor divides its tiles, `gluon.host.layout_misfit`)."""
    import contextlib
    import dataclasses

    from ejgen.runtime.attention import ring

    @contextlib.contextmanager
    def scope():
        saved = ring.COALESCE, ring._choose, ring._wide_forward
        real_choose, real_fwd = saved[1:]
        seen = {"fwd": 0}

        def wide_fwd(*args, **kwargs):
            seen["fwd"] += 1
            return real_fwd(*args, **kwargs)

        def choose(spec, backends, platform, backend_name, call, key, det):
            cfg, choice = real_choose(spec, backends, platform, backend_name, call, key, det)
            if key[2] != ring.WIDE:
                return cfg, choice
            return cfg, dataclasses.replace(choice, forward=choice.forward + "-other")

        ring.COALESCE, ring._wide_forward = True, wide_fwd
        if other:
            ring._choose = choose
        try:
            yield seen
        finally:
            ring.COALESCE, ring._choose, ring._wide_forward = saved

    return scope()


def check_zigzag_coalescing_gated(backend, failures, devices=2):
    """ring.COALESCE on: the later steps' forward runs each device's two full blocks as one call (`ring._wide_forward`,
    every local row against the whole held block through a 2 x 2 block layout of the pairs), which must happen here
    (every backend walks block layouts with the square calls' kernels); then with the wide call's forward on other
    kernels than the square ones' (as on a Hopper GPU where the chunk is not a whole number of the Hopper tiles: the
    square pairs on the Hopper set, the wide call on the generated kernels), which no stage must coalesce into. The
    ring equals the oracle both ways."""
    with _coalescing() as seen:
        check_zigzag_features(backend, failures, devices)
    if not seen["fwd"]:
        failures.append(f"the later steps' forward did not coalesce ({seen})")
    with _coalescing(other=True) as seen:
        check_zigzag_features(backend, failures, devices)
    if seen["fwd"]:
        failures.append(f"the forward coalesced into calls on other kernels than its square ones ({seen})")


def _branches(fn, diff, d_out, d_lse) -> list:
    """The branch ops (`lax.cond` / `lax.switch`) in the lowered forward and backward of ``fn(**diff) -> (out,
    lse)``."""
    def run(diff):
        (out, lse), pull = jax.vjp(lambda d: fn(**d), diff)
        return out, lse, pull((d_out, d_lse))[0]

    text = jax.jit(run).lower(diff).as_text()
    return [op for op in ("stablehlo.case", "stablehlo.if") if op in text]


def check_zigzag_without_branches(backend, failures, devices=2):
    """A causal zigzag ring (its later steps' forward coalesced, ring.COALESCE; forward and backward) lowers without a
    branch on the device index: XLA's GPU runtime evaluates a conditional on the host, copying the predicate back and
    waiting for the stream, so the host could no longer run ahead of the device (2 H100s, session 20: 0.8 ms a call).
    On 2 and 4 devices; the check sees a branch where there is one: a contiguous causal ring's steps differ by device
    (full or skipped, `lax.switch`). Lowered, not run, on the triton backend (what a GPU runs: the xla backend's own
    kernels branch inside their block loops)."""
    shape = AttnShape(1, 32, 32, 2, 2, 16)
    _, diff, d_out, d_lse = shard_checks.inputs(shape, "ring-no-branch")
    for n in (devices, 2 * devices):
        with _coalescing() as seen:
            found = _branches(in_shard_map(ring_attention, n, "zigzag", {}, {}, causal=True, platform=backend), diff,
                              d_out, d_lse)
        if found or not seen["fwd"]:
            failures.append(f"zigzag on {n} devices: branches {found}, wide forward calls {seen['fwd']}")
    contiguous = in_shard_map(ring_attention, devices, "contiguous", {}, {}, causal=True, platform=backend)
    if not _branches(contiguous, diff, d_out, d_lse):
        failures.append("a contiguous causal ring lowered without the lax.switch its steps need: the check is blind")


def check_dq_once(backend, failures, devices=4):
    """The backward's pairs adding into one float32 dQ of every local row (`ring.DQ_ONCE`; on a GPU the Hopper
    kernels add into it themselves, elsewhere each pair's dq is added after its kernels), against the oracle:
    `check_zigzag_features`' call (GQA, segment ids, sinks, soft cap) on a ring of 4 (a scan of two steps carrying
    the accumulator), and `check_window_ahead`'s on 3 (slots some devices skip: the accumulator passed on as found)."""
    from ejgen.runtime.attention import ring

    saved = ring._dq_into
    ring._dq_into = lambda plan: True  # (off a GPU no call is on the Hopper kernels: taken all the same)
    try:
        check_zigzag_features(backend, failures, devices)
        check_window_ahead(backend, failures, 3)
    finally:
        ring._dq_into = saved


def check_hopper_stand_ins(backend, failures, devices=2):
    """The ring's Hopper-only paths on a pretended Hopper GPU, the Gluon kernels replaced by jnp stand-ins that read
    K and V out of a given wire and add dQ into a given accumulator as the kernels do (`_stand_in_kernels` of
    tests/attention/test_gluon.py): a zigzag causal ring of 2 in bf16 with its steps as square pairs (ring.COALESCE
    off: the stand-ins know no block layout), each device's second step two full blocks at rows 0 and c of the
    received block, with `ring.KV_FROM_WIRE_BWD`, `ring.DQ_ONCE`, `ring.Q_IN_PLACE`, `ring.ZEROS_BY_DELTA` and
    `ring.DKV_INTO` off, then on: out and every gradient within bf16's error of the oracle, the Hopper backward given
    the wire, the accumulator and q / dO in place exactly when they are on, and the dK / dV wire (whose new buffer
    the stand-ins fill with NaN: rows no pair writes must be dropped by the receiver) on exactly the calls of the
    received block (the first backward step's, which read K and V out of the wire); with it the dK / dV transfer is
    the buffer the pairs wrote, in the inputs' dtype (every collective-permute 16-bit), not a float32 wire."""
    import re

    import pytest

    sys.path[:0] = [str(Path(_HERE).parent), str(Path(_HERE).parent / "attention")]
    from hopper_fakes import pretend_hopper
    from test_gluon import _stand_in_kernels

    from ejgen.runtime.attention import ring
    from ejgen.runtime.attention.triton import host as triton_host

    shape = AttnShape(1, 512, 512, 4, 2, 64)
    _, diff, d_out, d_lse = shard_checks.inputs(shape, "ring-stand-ins")
    diff = {n: x.astype(jnp.bfloat16) for n, x in diff.items()}
    ref = oracle.attention(**{n: x.astype(jnp.float32) for n, x in diff.items()}, causal=True, d_out=d_out,
                           d_lse=d_lse)
    d_out = d_out.astype(jnp.bfloat16)
    with pytest.MonkeyPatch.context() as mp:
        pretend_hopper(mp, values=False)
        _stand_in_kernels(mp)
        stand_in, given = triton_host._gluon_backward, []

        def spy(*args, dq_into=None, wire=None, q_rows=None, dkv_into=None, **kw):
            given.append((dq_into is not None, wire is not None, q_rows is not None, dkv_into is not None))
            return stand_in(*args, dq_into=dq_into, wire=wire, q_rows=q_rows, dkv_into=dkv_into, **kw)

        mp.setattr(triton_host, "_gluon_backward", spy)
        mp.setattr(ring, "COALESCE", False)
        for on in (False, True):
            mp.setattr(ring, "KV_FROM_WIRE_BWD", on)
            mp.setattr(ring, "DQ_ONCE", on)
            mp.setattr(ring, "Q_IN_PLACE", on)
            mp.setattr(ring, "ZEROS_BY_DELTA", on)
            mp.setattr(ring, "DKV_INTO", on)
            given.clear()
            fn = in_shard_map(ring_attention, devices, "zigzag", {}, {}, causal=True, platform=backend)
            out, lse, grads = shard_checks.vjp_call(fn, diff, d_out, d_lse)
            if (not given or {g[0] for g in given} != {on} or any(g[1] for g in given) != on
                    or {g[2] for g in given} != {on} or any(g[3] != (on and g[1]) for g in given)):
                failures.append(f"stand-ins, wire, one dQ, q in place and dK / dV into the wire {on}: the Hopper "
                                f"backward was given {given}")

            def run(diff, fn=fn):
                (out, lse), pull = jax.vjp(lambda d: fn(**d), diff)
                return out, lse, pull((d_out, d_lse))[0]

            seen = set(re.findall(r"collective_permute.*?-> tensor<\d+x(\w+)>", jax.jit(run).lower(diff).as_text()))
            if on and seen != {"ui16"} or not on and seen != {"ui16", "ui32"}:
                failures.append(f"stand-ins, dK / dV into the wire {on}: the transfers are {sorted(seen)}")
            for name, got, want in [("out", out, ref.out)] + [(f"d{n}", grads[n], ref.grads[n]) for n in grads]:
                want = np.asarray(want, np.float64)
                err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
                if not err < 2e-2:
                    failures.append(f"stand-ins, every switch {on}: {name} relative error {err:.2e} "
                                    "(< 2e-2)")


def check_narrow_accumulators(backend, failures, devices=2):
    """bf16 inputs, `ring.NARROW_ACCUMULATOR_HOPS` at 1 (an experiment, off by default): on a 2-device zigzag ring
    (one hop) the backward's dK/dV accumulators travel in bf16, as every other transfer, on a 4-device one (three hops)
    in float32, and at 0 (the default) in float32 on both; the 2-device ring's gradients stay within bf16's error of
    the oracle's."""
    import re

    from ejgen.runtime.attention import ring as ring_runtime

    shape = AttnShape(1, 64, 64, 2, 2, 16)
    _, diff, d_out, d_lse = shard_checks.inputs(shape, "ring-narrow")
    diff = {n: x.astype(jnp.bfloat16) for n, x in diff.items()}
    d_out = d_out.astype(jnp.bfloat16)
    before = ring_runtime.NARROW_ACCUMULATOR_HOPS
    try:
        for hops, n, want in ((1, devices, {"ui16"}), (1, 2 * devices, {"ui16", "ui32"}),
                              (0, devices, {"ui16", "ui32"})):
            ring_runtime.NARROW_ACCUMULATOR_HOPS = hops  # (read as the backward is traced)
            fn = in_shard_map(ring_attention, n, "zigzag", {}, {}, causal=True, platform=backend)

            def run(diff, fn=fn):
                (out, lse), pull = jax.vjp(lambda d: fn(**d), diff)
                return out, lse, pull((d_out, d_lse))[0]

            text = jax.jit(run).lower(diff).as_text()
            seen = set(re.findall(r"collective_permute.*?-> tensor<\d+x(\w+)>", text))
            if seen != want:
                failures.append(f"zigzag on {n} devices, bf16, NARROW_ACCUMULATOR_HOPS {hops}: the transfers are "
                                f"{sorted(seen)}, not {sorted(want)}")
        ring_runtime.NARROW_ACCUMULATOR_HOPS = 1
        fn = in_shard_map(ring_attention, devices, "zigzag", {}, {}, causal=True, platform=backend)
        _, _, grads = shard_checks.vjp_call(fn, diff, d_out, d_lse)
    finally:
        ring_runtime.NARROW_ACCUMULATOR_HOPS = before
    ref = oracle.attention(**{n: x.astype(jnp.float32) for n, x in diff.items()}, causal=True,
                           d_out=d_out.astype(jnp.float32), d_lse=d_lse)
    for name, got in grads.items():
        want = np.asarray(ref.grads[name], np.float64)
        err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
        if not err < 2e-2:
            failures.append(f"bf16 ring on {devices} devices: d{name} relative error {err:.2e} (bf16's: < 2e-2)")


def check_window(backend, failures, devices=4):
    """A sliding window (6, 3) without causal, contiguous: blocks the window cuts run with the tokens' positions,
    blocks it misses are skipped; the ring starts one device ahead (the right side) and takes three steps of four."""
    shape = AttnShape(1, 32, 32, 2, 1, 16)
    _, diff, d_out, d_lse = shard_checks.inputs(shape, "ring-window")
    kw = dict(sliding_window=(6, 3), platform=backend)
    fn = in_shard_map(ring_attention, devices, "contiguous", {}, {}, **kw)
    sharded = shard_checks.vjp_call(fn, diff, d_out, d_lse)
    check(failures, sharded, oracle.attention(**diff, sliding_window=(6, 3), d_out=d_out, d_lse=d_lse))


def check_window_ahead(backend, failures, devices=3):
    """A window that looks only ahead, (0, 5) without causal, contiguous, GQA, segment ids (travelling with their
    blocks): the ring starts one device ahead and takes two steps of three, its forward ending on each device's own
    block, so the backward's reverse ring starts there (nothing saved) and ends a device ahead, whose accumulators
    then go home one hop."""
    shape = AttnShape(2, 24, 24, 4, 2, 16)
    rng, diff, d_out, d_lse = shard_checks.inputs(shape, "ring-window-ahead")
    ids = packed_segments(2, 24, rng)
    fn = in_shard_map(ring_attention, devices, "contiguous", {}, {"q_ids": jnp.asarray(ids)}, sliding_window=(0, 5),
                      platform=backend)
    sharded = shard_checks.vjp_call(fn, diff, d_out, d_lse)
    check(failures, sharded, oracle.attention(**diff, sliding_window=(0, 5), q_segment_ids=ids, kv_segment_ids=ids,
                                              d_out=d_out, d_lse=d_lse))


def check_zigzag_window(backend, failures, devices=2):
    """zigzag with a causal window (5, 0): the window cuts the gap between a device's two chunks, so every step runs
    in chunks, those the window cuts with the tokens' positions."""
    shape = AttnShape(1, 32, 32, 2, 2, 16)
    _, diff, d_out, d_lse = shard_checks.inputs(shape, "ring-zigzag-window")
    fn = in_shard_map(ring_attention, devices, "zigzag", {}, {}, causal=True, sliding_window=(5, 0), platform=backend)
    sharded = shard_checks.vjp_call(fn, diff, d_out, d_lse)
    check(failures, sharded, oracle.attention(**diff, causal=True, sliding_window=(5, 0), d_out=d_out, d_lse=d_lse))


def check_alibi(backend, failures, devices=4):
    """An authored spec whose score reads q_idx and kv_idx (global positions on every shard), its param's gradient
    summed over the ring's steps and devices: alibi_attention, causal, zigzag."""
    shape = AttnShape(1, 32, 32, 2, 1, 16)
    rng, diff, d_out, d_lse = shard_checks.inputs(shape, "ring-alibi")
    diff["slopes"] = jnp.asarray(rng.uniform(0.05, 0.5, 2), jnp.float32)
    kw = dict(causal=True, max_distance=9, platform=backend)
    fn = in_shard_map(alibi_attention_ring, devices, "zigzag", {}, {}, **kw)
    sharded = shard_checks.vjp_call(fn, diff, d_out, d_lse)
    slopes = diff.pop("slopes")
    ref = oracle.variant_attention("alibi_attention", **diff, params={"slopes": slopes}, options={"max_distance": 9},
                                   causal=True, d_out=d_out, d_lse=d_lse)
    check(failures, sharded, ref)


def check_contiguous_causal(backend, failures, devices=2):
    """The plain causal ring on contiguous shards, 2 devices: one device's second step is a full block, the other's
    skipped."""
    shape = AttnShape(2, 32, 32, 4, 4, 16)
    _, diff, d_out, d_lse = shard_checks.inputs(shape, "ring-contiguous")
    fn = in_shard_map(ring_attention, devices, "contiguous", {}, {}, causal=True, platform=backend)
    sharded = shard_checks.vjp_call(fn, diff, d_out, d_lse)
    single = shard_checks.vjp_call(lambda **d: flash_attention(**d, causal=True, platform=backend, return_lse=True),
                                   diff, d_out, d_lse)
    check(failures, sharded, oracle.attention(**diff, causal=True, d_out=d_out, d_lse=d_lse), single)


def check_kv_apart(backend, failures, devices=2):
    """`ring.KV_APART` (the forward's block sent as its arrays, which XLA GPU's combiner makes one collective): a zigzag
    causal ring of 2 equals the single-device op and the oracle, forward and gradients; the forward's lowering sends
    K and V as they are (collective-permutes of their shapes), not packed into one flat buffer. `ring.Q_SPACER` kept
    and harmless."""
    import re

    from ejgen.runtime.attention import ring

    shape = AttnShape(1, 64, 64, 2, 2, 16)
    _, diff, d_out, d_lse = shard_checks.inputs(shape, "ring-kv-apart")
    fn = in_shard_map(ring_attention, devices, "zigzag", {}, {}, causal=True, platform=backend)
    sent = {}
    before = ring.KV_APART
    try:
        for apart in (True, False):
            ring.KV_APART = apart
            text = jax.jit(lambda q, k, v: fn(q, k, v)[0]).lower(diff["query"], diff["key"], diff["value"]).as_text()
            sent[apart] = re.findall(r"stablehlo.collective_permute.*: \((tensor<[^>]*>)\)", text)
        ring.KV_APART = True
        sharded = shard_checks.vjp_call(fn, diff, d_out, d_lse)
    finally:
        ring.KV_APART = before
    own = f"tensor<1x{64 // devices}x2x16xf32>"  # (a device's rows of K or V)
    if sent[True] != [own, own] or len(sent[False]) != 1 or sent[False][0] == own:
        failures.append(f"the forward's transfers: apart {sent[True]}, packed {sent[False]}")
    single = shard_checks.vjp_call(lambda **d: flash_attention(**d, causal=True, platform=backend, return_lse=True),
                                   diff, d_out, d_lse)
    check(failures, sharded, oracle.attention(**diff, causal=True, d_out=d_out, d_lse=d_lse), single)
    # `ring.Q_SPACER` (a diagnostic): the compiled forward keeps its sum over q (session 40: one that reached nothing
    # was dropped), and the result is unchanged
    before = ring.Q_SPACER
    try:
        ring.Q_SPACER = 100
        run = jax.jit(lambda q, k, v: fn(q, k, v)[0])
        hlo = run.lower(diff["query"], diff["key"], diff["value"]).compile().as_text()
        spaced = run(diff["query"], diff["key"], diff["value"])
    finally:
        ring.Q_SPACER = before
    if not re.search(r"f32\[100\]", hlo):
        failures.append("ring.Q_SPACER: no sum over 100 items of q in the compiled forward")
    plain = jax.jit(lambda q, k, v: fn(q, k, v)[0])(diff["query"], diff["key"], diff["value"])
    if not np.array_equal(np.asarray(spaced), np.asarray(plain)):
        failures.append("ring.Q_SPACER changed the forward's output")


def check_causal_window_8(backend, failures, devices=8):
    """Causal with a window of 27 on 8 devices of 8 rows: the ring takes 5 steps of 8 (the window reaches four blocks
    back; the backward's reverse ring runs its middle steps as a scan), sinks shared by all heads, MQA."""
    shape = AttnShape(1, 64, 64, 4, 1, 16)
    rng, diff, d_out, d_lse = shard_checks.inputs(shape, "ring-causal-window")
    diff["softmax_aux"] = jnp.asarray(rng.standard_normal(3) + 1.0, jnp.float32)
    kw = dict(causal=True, sliding_window=27, platform=backend)
    fn = in_shard_map(ring_attention, devices, "contiguous", {}, {}, **kw)
    sharded = shard_checks.vjp_call(fn, diff, d_out, d_lse)
    check(failures, sharded, oracle.attention(**diff, causal=True, sliding_window=27, d_out=d_out, d_lse=d_lse))


def check_prefix_lm(backend, failures, devices=2):
    """prefix_lm_attention (mask `kv_idx <= q_idx or kv_idx < prefix_len`: absolute key positions), zigzag: every
    query sees the prefix (the first chunk and part of the second, on both devices)."""
    shape = AttnShape(1, 32, 32, 2, 2, 16)
    _, diff, d_out, d_lse = shard_checks.inputs(shape, "ring-prefix")
    fn = in_shard_map(prefix_lm_attention_ring, devices, "zigzag", {}, {}, prefix_len=11, platform=backend)
    sharded = shard_checks.vjp_call(fn, diff, d_out, d_lse)
    ref = oracle.variant_attention("prefix_lm_attention", **diff, options={"prefix_len": 11}, d_out=d_out,
                                   d_lse=d_lse)
    check(failures, sharded, ref)


def check_chunked_local(backend, failures, devices=4):
    """chunked_local_attention (causal within chunks of 6: its mask `q_idx // chunk == kv_idx // chunk` runs as
    segment ids, computed at the tokens' global positions and encoded over the whole sequence), zigzag: chunks that
    straddle shards and chunks of a zigzag pair's two halves."""
    shape = AttnShape(1, 32, 32, 2, 1, 16)
    _, diff, d_out, d_lse = shard_checks.inputs(shape, "ring-chunked")
    fn = in_shard_map(chunked_local_attention_ring, devices, "zigzag", {}, {}, chunk=6, platform=backend)
    sharded = shard_checks.vjp_call(fn, diff, d_out, d_lse)
    ref = oracle.attention(**diff, causal=True, mask=lambda ix, _: ix.q_idx // 6 == ix.kv_idx // 6, d_out=d_out,
                           d_lse=d_lse)
    check(failures, sharded, ref)


# A spec built here: its mask is a segment key that reads the lengths (the query's and the key's third of the
# sequence), so only the key reads them; segment ids of the call's own beside it
THIRDS = """\
name: thirds_attention
family: attention
doc: Attention within each third of the sequence.
backends: [xla]
features:
  causal: runtime
  gqa: runtime
  segment_ids: runtime
mask: q_idx * 3 // q_len == kv_idx * 3 // kv_len
"""


@functools.cache
def thirds_attention_ring():
    root = tempfile.mkdtemp(prefix="ring-thirds-")
    atexit.register(shutil.rmtree, root, True)
    (Path(root) / "specs").mkdir()
    (Path(root) / "specs" / "thirds_attention.yaml").write_text(THIRDS)
    from ejgen.cli import main as ejgen_main

    with contextlib.redirect_stdout(sys.stderr):  # the build's lines: stdout is the JSON's
        assert ejgen_main(["build", str(Path(root) / "specs"), "-o", str(Path(root) / "ring_thirds_ops")]) == 0
    sys.path.insert(0, root)
    return importlib.import_module("ring_thirds_ops").thirds_attention_ring


def thirds(ix, _, length=32):
    return ix.q_idx * 3 // length == ix.kv_idx * 3 // length


def check_key_reads_lengths(backend, failures, devices=2):
    """A segment key reading q_len and kv_len (thirds of 32 tokens, which straddle the shards), zigzag, causal: the
    key's values at the tokens' global positions and the global lengths."""
    shape = AttnShape(1, 32, 32, 2, 1, 16)
    _, diff, d_out, d_lse = shard_checks.inputs(shape, "ring-thirds")
    fn = in_shard_map(thirds_attention_ring(), devices, "zigzag", {}, {}, causal=True, platform=backend)
    sharded = shard_checks.vjp_call(fn, diff, d_out, d_lse)
    check(failures, sharded, oracle.attention(**diff, causal=True, mask=thirds, d_out=d_out, d_lse=d_lse))


def check_key_with_segment_ids(backend, failures, devices=2):
    """The same key paired with the call's own segment ids (packed sequences, padding included): a query sees a key
    where both the third and the id match (ranks of the pairs over the whole sequence), contiguous, not causal."""
    shape = AttnShape(2, 32, 32, 2, 2, 16)
    rng, diff, d_out, d_lse = shard_checks.inputs(shape, "ring-thirds-segments")
    ids = packed_segments(2, 32, rng)
    fn = in_shard_map(thirds_attention_ring(), devices, "contiguous", {}, {"q_ids": jnp.asarray(ids)},
                      platform=backend)
    sharded = shard_checks.vjp_call(fn, diff, d_out, d_lse)
    check(failures, sharded, oracle.attention(**diff, mask=thirds, q_segment_ids=ids, kv_segment_ids=ids,
                                              d_out=d_out, d_lse=d_lse))


def check_context_mesh(backend, failures, devices=4):
    """ring_attention outside shard_map, on global arrays under `with jax.set_mesh(mesh):` (the op cuts the sequence
    over the named axis itself), zigzag, GQA, causal."""
    shape = AttnShape(2, 32, 32, 4, 2, 16)
    _, diff, d_out, d_lse = shard_checks.inputs(shape, "ring-context")
    to, back = laid_out("zigzag", devices)
    mesh = jax.make_mesh((devices,), ("sp",))

    def fn(query, key, value):
        out, lse = ring_attention(to(query), to(key), to(value), axis_name="sp", causal=True, token_order="zigzag",
                                  platform=backend, return_lse=True)
        return back(out), back(lse, axis=2)

    with jax.set_mesh(mesh):
        sharded = shard_checks.vjp_call(fn, diff, d_out, d_lse)
    sharded = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]), sharded)  # leave the mesh's types
    check(failures, sharded, oracle.attention(**diff, causal=True, d_out=d_out, d_lse=d_lse))


def check_wrapper(backend, failures):
    """The mesh wrapper with the sequence cut: flash_attention(..., mesh=(dp 2, sp 2), in_specs=P("dp", "sp"),
    token_order="zigzag") runs the ring over sp, batch over dp, segment ids cut like query, a window (4, 0) with
    causal; inputs laid out in zigzag order, results brought back."""
    shape = AttnShape(2, 32, 32, 4, 2, 16)
    rng, diff, d_out, d_lse = shard_checks.inputs(shape, "ring-wrapper")
    ids = packed_segments(2, 32, rng)
    m = shard_checks.mesh((2, 2), ("dp", "sp"))
    to, back = laid_out("zigzag", 2)
    kw = dict(causal=True, sliding_window=(4, 0), platform=backend, return_lse=True)

    def fn(query, key, value):
        out, lse = flash_attention(to(query), to(key), to(value), mask_info=MaskInfo.from_segments(to(ids)), **kw,
                                   mesh=m, in_specs=P("dp", "sp"), token_order="zigzag")
        return back(out), back(lse, axis=2)

    sharded = shard_checks.vjp_call(fn, diff, d_out, d_lse)
    sharded = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]), sharded)  # leave the mesh's types
    ref = oracle.attention(**diff, causal=True, sliding_window=(4, 0), q_segment_ids=ids, kv_segment_ids=ids,
                           d_out=d_out, d_lse=d_lse)
    check(failures, sharded, ref)


def check_blocksparse(backend, failures, devices=2):
    """The seed's blocksparse_attention ([B, H, S, D]) with sequence_parallelism_mesh_axis_name inside the user's
    shard_map: ring attention over that axis, causal (its default), segment ids."""
    shape = AttnShape(1, 32, 32, 4, 2, 16)
    rng, diff, d_out, d_lse = shard_checks.inputs(shape, "ring-blocksparse", layout="bhsd")
    ids = packed_segments(1, 32, rng)
    mesh = shard_checks.auto_mesh((devices,), ("sp",))
    cut = P(None, None, "sp")

    def body(q, k, v, ids):
        return blocksparse_attention(q, k, v, q_segment_ids=ids, sequence_parallelism_mesh_axis_name="sp",
                                     platform=backend, return_lse=True)

    run = jax.shard_map(body, mesh=mesh, in_specs=(cut, cut, cut, P(None, "sp")), out_specs=(cut, cut))
    sharded = shard_checks.vjp_call(lambda query, key, value: run(query, key, value, jnp.asarray(ids)), diff, d_out,
                                    d_lse)
    bshd = {n: x.swapaxes(1, 2) for n, x in diff.items()}
    ref = oracle.attention(**bshd, causal=True, q_segment_ids=ids, kv_segment_ids=ids, d_out=d_out.swapaxes(1, 2),
                           d_lse=d_lse)
    ref.out = ref.out.swapaxes(1, 2)
    ref.grads = {n: g.swapaxes(1, 2) for n, g in ref.grads.items()}
    check(failures, sharded, ref)


# check -> {backend: devices of the ring}. What differs between backends is the per-device kernels of each kind of
# step (full, diagonal, placed: explicit positions) and their types inside shard_map: the interpreters run the zigzag
# call (full and diagonal steps, segment ids travelling, sinks, soft cap) and the authored spec (placed steps whose
# score reads global positions), on 2 devices (an interpreted launch costs the same whatever its size). The ring's
# own machinery (token orders, windows, step selection, the mesh context, the wrapper, the seed's blocksparse entry;
# 2, 4 and 8 devices) is the same on every backend: xla alone, to keep the interpreters' share of the budget small.
# On 4 devices xla runs the zigzag call (its forward coalesced, the default's kernels, then with the wide forward gated
# off) and the window that skips a step; the rest of the machinery on 2 (half the compile time of 4), 3 and 8.
# Triton runs the zigzag call inside zigzag-coalescing-gated: its first call runs the default's kernels.
CHECKS = {
    "zigzag-causal-gqa-segments-sinks-softcap": (check_zigzag_features, {"pallas": 2}),  # xla, triton: inside
    # zigzag-coalescing-gated, whose first call runs this check with the default's kernels
    "alibi-zigzag": (check_alibi, {"xla": 2, "pallas": 2, "triton": 2}),
    "zigzag-pairs-steps": (check_zigzag_pairs, {"xla": 2}),
    "zigzag-coalescing-gated": (check_zigzag_coalescing_gated, {"xla": 4, "triton": 2}),
    "zigzag-without-branches": (check_zigzag_without_branches, {"triton": 2}),
    "zigzag-narrow-accumulators": (check_narrow_accumulators, {"xla": 2}),
    "zigzag-dq-once": (check_dq_once, {"xla": 4}),
    "zigzag-hopper-stand-ins": (check_hopper_stand_ins, {"triton": 2}),
    "window-noncausal-contiguous": (check_window, {"xla": 4}),
    "window-ahead-gqa-segments-contiguous": (check_window_ahead, {"xla": 3}),
    "zigzag-causal-window": (check_zigzag_window, {"xla": 2}),
    "contiguous-causal": (check_contiguous_causal, {"xla": 2}),
    "zigzag-kv-apart": (check_kv_apart, {"xla": 2}),
    "causal-window-mqa-shared-sinks": (check_causal_window_8, {"xla": 8}),
    "prefix_lm-zigzag": (check_prefix_lm, {"xla": 2}),
    "chunked_local-zigzag": (check_chunked_local, {"xla": 2}),
    "key-reads-lengths-zigzag": (check_key_reads_lengths, {"xla": 2}),
    "key-with-segment-ids-contiguous": (check_key_with_segment_ids, {"xla": 2}),
    "set_mesh-global-zigzag": (check_context_mesh, {"xla": 2}),
    "wrapper-dp2-sp2-zigzag-window-segments": (check_wrapper, {"xla": None}),
    "blocksparse-sequence-parallelism": (check_blocksparse, {"xla": 2}),
}


def main(backend: str) -> dict:
    return shard_checks.run_checks(CHECKS, backend)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
