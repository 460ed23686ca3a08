"""Ring attention (docs/DESIGN.md §3, Ring attention): the ring on 2, 4 and 8 host devices against the float64 oracle
(`ring_checks.py`, a process of its own per backend, as `test_shard_map.py`); the static plan of the ring's steps
(which device computes what at each step, and which steps run at all); the token orders' helpers; and every refusal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

from ejgen.ops import (blocksparse_attention, flash_attention, ring_attention, ring_permute, ring_positions,
                       ring_unpermute)
from ejgen.runtime.attention import ring
from ejgen.types import BlockMask, MaskInfo
from ejgen.zoo import flamingo_cross_attention_ring, natten_1d_attention_ring

HERE = os.path.dirname(os.path.abspath(__file__))
EXPECTED = {
    "xla": {"alibi-zigzag-2", "zigzag-pairs-steps-2", "zigzag-narrow-accumulators-2", "zigzag-dq-once-4",
            "zigzag-coalescing-gated-4", "window-noncausal-contiguous-4", "zigzag-kv-apart-2",
            "window-ahead-gqa-segments-contiguous-3", "zigzag-causal-window-2", "contiguous-causal-2",
            "causal-window-mqa-shared-sinks-8", "prefix_lm-zigzag-2", "chunked_local-zigzag-2",
            "key-reads-lengths-zigzag-2", "key-with-segment-ids-contiguous-2", "set_mesh-global-zigzag-2",
            "wrapper-dp2-sp2-zigzag-window-segments", "blocksparse-sequence-parallelism-2"},
    "pallas": {"zigzag-causal-gqa-segments-sinks-softcap-2", "alibi-zigzag-2"},
    "triton": {"alibi-zigzag-2", "zigzag-without-branches-2", "zigzag-coalescing-gated-2",
               "zigzag-hopper-stand-ins-2"},
}


@pytest.mark.parametrize("platform", ["xla", "pallas", "triton"])
def test_ring_on_a_mesh_of_8_devices(platform):
    """Every check of `ring_checks.py` on one backend: outputs, lse and every gradient equal the oracle's."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, os.path.join(HERE, "ring_checks.py"), platform], env=env,
                         capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, f"ring_checks.py {platform} failed:\n{run.stderr[-4000:]}"
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(results) == EXPECTED[platform]
    failed = {name: failures for name, failures in results.items() if failures}
    assert not failed, "\n\n".join(f"{name}:\n" + "\n".join(f) for name, f in failed.items())


def _plan(order, devices, n, causal=True, window=None, reads=False):
    """(start, steps, {distance: (chunk rows, [per device: sorted (query chunk, key chunk, kind) it runs]})} of the
    whole ring, from the static planner."""
    needed = {t for t in range(devices) for r in range(devices)
              if ring._kind(order, devices, n, r, (r - t) % devices, ring.Pair((0, n), (0, n)), causal, window,
                            reads) != ring.SKIP}
    start, steps = ring._interval(needed, devices)
    table = {}
    for stage in ring._stages(order, devices, n, start, steps, causal, window, reads):
        for i, slots in enumerate(stage.slots):
            runs = [sorted(slot[r] for slot in slots if slot[r][2] != ring.SKIP) for r in range(devices)]
            table[start + stage.first + i] = (stage.chunk, runs)
    return start, steps, table


def test_contiguous_causal_steps():
    """Contiguous causal: step 0 is every device's own block (causal), then device r sees the blocks of the r
    devices before it in full and skips the rest."""
    start, steps, table = _plan("contiguous", 4, 8)
    assert (start, steps) == (0, 4)
    assert table[0] == (8, [[(0, 0, ring.DIAGONAL)]] * 4)
    for t in range(1, 4):
        assert table[t] == (8, [[(0, 0, ring.FULL)] if r >= t else [] for r in range(4)])


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_zigzag_balances_causal_work(devices):
    """Zigzag: step 0 is one causal call over both chunks; at every later step each device computes exactly two full
    chunk x chunk blocks (no element mask, no idle device): the same work everywhere. A device whose block comes from
    a device before it sees that block's first chunk with both of its own; from a device after it, both of that
    block's chunks with its second chunk."""
    n = 8
    start, steps, table = _plan("zigzag", devices, n)
    assert (start, steps) == (0, devices)
    assert table[0] == (n, [[(0, 0, ring.DIAGONAL)]] * devices)
    for t in range(1, devices):
        chunk, runs = table[t]
        assert chunk == n // 2
        for r in range(devices):
            before = (r - t) % devices < r
            want = [(0, 0, ring.FULL), (1, 0, ring.FULL)] if before else [(1, 0, ring.FULL), (1, 1, ring.FULL)]
            assert runs[r] == want, (t, r, runs[r])


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_zigzag_later_steps_coalesce_into_one_call(devices):
    """`ring._wide`: every step after the first of a causal zigzag ring gives each device two full blocks sharing a
    query chunk or a key chunk (one call with ring.COALESCE); a window's steps (pairs cut by it) do not."""
    n = 8
    stages = ring._stages("zigzag", devices, n, 0, devices, True, None, False)
    assert [ring._wide(stage) for stage in stages] == [False, True]
    windowed = ring._stages("zigzag", devices, n, 0, devices, True, (5, 0), False)
    assert not any(ring._wide(stage) for stage in windowed)


def test_the_backward_reads_only_its_own_calls_kernels():
    """The backward's Hopper-only paths (DQ_ONCE's one accumulator, the delta kernel) ask that every call the backward
    runs takes the Hopper backward: its pairs, not a coalesced step's wide call, which only the forward runs (its
    backward choice, say the generated kernels where the wide layout misfits the Hopper tiles, must not turn them off);
    a pair on the generated backward does."""
    import dataclasses
    import types

    choice = lambda fwd, bwd: types.SimpleNamespace(forward=fwd, backward=bwd)  # noqa: E731
    pairs = tuple(((8, 8, kind), None, choice("gluon", "gluon")) for kind in (ring.FULL, ring.DIAGONAL))
    wide = ((16, 16, ring.WIDE), None, choice("gluon", "triton"))
    plan = ring.Plan("op", None, "sp", 2, "zigzag", 16, 0, 2, (), pairs + (wide,), False, (False, True))
    assert ring._hopper_backward(plan) and ring._dq_into(plan)
    generated = dataclasses.replace(plan, calls=(pairs[0], (pairs[1][0], None, choice("gluon", "triton")), wide))
    assert not ring._hopper_backward(generated) and not ring._dq_into(generated)


def test_window_takes_only_the_steps_it_reaches():
    """A causal window of 5 keys over 8 devices of 8 rows reaches one block back: 2 steps, not 8; a window (6, 3)
    without causal reaches one block each way: the ring starts one device ahead and takes 3 steps; windows that cut a
    block run it with the tokens' positions."""
    start, steps, table = _plan("contiguous", 8, 8, window=(5, 0))
    assert (start, steps) == (0, 2)
    assert table[1][1] == [[]] + [[(0, 0, ring.PLACED)]] * 7
    start, steps, table = _plan("contiguous", 4, 8, causal=False, window=(6, 3))
    assert (start, steps) == (-1, 3)
    assert sorted(table) == [-1, 0, 1]
    assert table[-1][1] == [[(0, 0, ring.PLACED)]] * 3 + [[]]  # the last device has none ahead of it
    start, steps, _ = _plan("contiguous", 4, 8, window=(100, 0))
    assert (start, steps) == (0, 4)


def test_spec_reading_positions_runs_placed():
    """A spec whose score or mask reads q_idx / kv_idx gets the tokens' global positions on every step it runs."""
    _, _, table = _plan("zigzag", 4, 8, reads=True)
    assert all(kind == ring.PLACED for _, runs in table.values() for run in runs for _, _, kind in run)


def _transfers(jaxpr) -> list:
    """For each ``ppermute`` in ``jaxpr`` and the jaxprs inside it (scans, branches, the shard_map): the sorted
    names of the primitives that read what it received."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    readers = {}
    for eqn in jaxpr.eqns:
        for x in eqn.invars:
            if not hasattr(x, "val"):  # a variable, not a literal
                readers.setdefault(x, set()).add(eqn.primitive.name)
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute":
            found.append(sorted(readers.get(eqn.outvars[0], ())))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                    found += _transfers(sub)
    return found


# (token order, devices, window): the transfers of forward+backward read as they come: a ring that starts on a device
# ahead (a window's right side) receives its first block before any kernel, and a backward that ends there sends
# each block's accumulators home after its last step
EARLY_TRANSFERS = {("zigzag", 2, None): 0, ("zigzag", 4, None): 0, ("contiguous", 4, (6, 3)): 2}


@pytest.mark.parametrize("case", EARLY_TRANSFERS, ids=lambda c: "-".join(map(str, c)))
def test_received_blocks_wait_for_the_steps_kernels(case):
    """Every block (and accumulator) a step receives while kernels run is read only through the optimization barrier
    that ties it to the step's results (`ring._after_kernels`): nothing reading it can be scheduled before the step's
    kernels (docs/DESIGN.md §3, Ring attention). Traced on an abstract mesh, forward and backward."""
    order, devices, window = case
    mesh = AbstractMesh((devices,), ("sp",))
    kw = dict(causal=window is None, sliding_window=window, token_order=order, platform="xla")
    ring_call = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="sp", **kw), mesh=mesh,
                              in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))
    q = jax.ShapeDtypeStruct((1, 16 * devices, 4, 8), jnp.bfloat16)
    found = _transfers(jax.make_jaxpr(lambda q, k, v: jax.vjp(ring_call, q, k, v)[1](q))(q, q, q))
    early = sum(readers != ["optimization_barrier"] for readers in found)
    assert len(found) > early == EARLY_TRANSFERS[case], found


def test_token_order_helpers():
    """Zigzag over 2 devices and 8 tokens: device 0 holds chunks 0 and 3, device 1 chunks 1 and 2; ring_permute lays
    a sequence out so, ring_unpermute undoes it, ring_positions says where each row stands."""
    assert ring_positions(8, 2, "zigzag").tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert ring_positions(8, 2, "contiguous").tolist() == list(range(8))
    x = jnp.arange(2 * 8 * 3).reshape(2, 8, 3)
    laid = ring_permute(x, 2)
    np.testing.assert_array_equal(laid[:, :, 0], x[:, np.array([0, 1, 6, 7, 2, 3, 4, 5]), 0])
    np.testing.assert_array_equal(ring_unpermute(laid, 2), x)
    lse = x.swapaxes(1, 2)  # [B, H, S]: the sequence on axis 2
    np.testing.assert_array_equal(ring_unpermute(ring_permute(lse, 2, axis=2), 2, axis=2), lse)
    for d in range(2):
        np.testing.assert_array_equal(ring.device_positions("zigzag", 2, 4, d), ring_positions(8, 2)[4 * d:4 * d + 4])


def _qkv(seq=16, batch=1, heads=4, kv_heads=2, dim=8):
    q = jnp.zeros((batch, seq, heads, dim), jnp.float32)
    k = jnp.zeros((batch, seq, kv_heads, dim), jnp.float32)
    return q, k, k


def _in_map(fn, devices=1):
    """``fn(q, k, v)`` inside jax.shard_map over this process's one device, axis "sp" (size 1): the ring's checks of
    a bound axis run."""
    mesh = Mesh(np.array(jax.devices()[:devices]), ("sp",))
    return jax.shard_map(fn, mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))


def _ring(**kw):
    return lambda: ring_attention(*_qkv(), axis_name="sp", **kw)


REFUSED = {
    "bias": (_ring(bias=jnp.zeros((1, 4, 16, 16))), ValueError, "bias cannot be combined with ring attention"),
    "block_mask": (_ring(block_mask=BlockMask.causal(16, 16)), ValueError, "block_mask cannot be combined"),
    "positions": (_ring(q_positions=jnp.zeros((1, 16), jnp.int32)), ValueError, "q_positions cannot be combined"),
    "varlen": (lambda: ring_attention(*(x[0] for x in _qkv()), axis_name="sp", cu_seqlens_q=jnp.array([0, 16]),
                                      cu_seqlens_k=jnp.array([0, 16]), max_seqlen_q=16, max_seqlen_k=16),
               ValueError, "cu_seqlens_q cannot be combined with ring attention"),
    "dense-mask": (_ring(mask_info=MaskInfo.from_attention_mask(jnp.ones((1, 16, 16), bool))), ValueError,
                   "mask_info with a dense attention_mask cannot be combined with ring attention"),
    "token_order": (_ring(token_order="striped"), ValueError, "token_order must be one of contiguous, zigzag"),
    "axis_name": (lambda: ring_attention(*_qkv(), axis_name=("sp", "dp")), ValueError,
                  "axis_name must be the name of one mesh axis"),
    "no-mesh": (_ring(), ValueError, "axis_name='sp' is not a bound mesh axis (no mesh is in scope)"),
    "mesh-argument": (_ring(mesh=AbstractMesh((2,), ("sp",))), TypeError,
                      "flash_attention_ring() got mesh=: a ring form runs inside jax.shard_map"),
    "unknown-argument": (_ring(slopes=jnp.ones(4)), TypeError,
                         "flash_attention_ring() got an unsupported argument 'slopes'"),
    "spec-reads-kv_len": (lambda: natten_1d_attention_ring(*_qkv(), axis_name="sp"), ValueError,
                          "the spec's score or mask reads kv_len (zoo/natten_1d_attention.yaml)"),
    "param-by-position": (lambda: flamingo_cross_attention_ring(*_qkv(), latest=jnp.zeros((1, 16), jnp.int32),
                                                                axis_name="sp"),
                          ValueError, "param latest has a q_len / kv_len dim"),
    "odd-zigzag": (lambda: _in_map(lambda q, k, v: ring_attention(q, k, v, axis_name="sp", token_order="zigzag"))(
        *_qkv(seq=15)), ValueError, "token_order='zigzag' needs an even number of rows per device (two chunks), got "
                                    "15"),
    "cross-lengths": (lambda: _in_map(lambda q, k, v: ring_attention(q, k[:, :8], v[:, :8], axis_name="sp"))(*_qkv()),
                      ValueError, "query and key/value hold 16 and 8 rows of the sequence on each device"),
    "blocksparse-layouts": (lambda: blocksparse_attention(*(x.swapaxes(1, 2) for x in _qkv()),
                                                          qkv_layouts=jnp.ones((2, 2), bool),
                                                          sequence_parallelism_mesh_axis_name="sp"),
                            ValueError, "qkv_layouts cannot be combined with sequence_parallelism_mesh_axis_name"),
}


@pytest.mark.parametrize("case", REFUSED.values(), ids=REFUSED.keys())
def test_ring_refuses(case):
    """What a ring cannot take is one clear error naming the argument, before anything runs."""
    call, kind, message = case
    with pytest.raises(kind) as e:
        call()
    assert message in str(e.value)


def test_global_sequence_must_cut_evenly():
    """On global arrays under a mesh context, a sequence that does not cut into the axis' devices (zigzag: two chunks
    each) is refused with the numbers."""
    with jax.sharding.use_abstract_mesh(AbstractMesh((4,), ("sp",))):
        with pytest.raises(ValueError) as e:
            ring_attention(*_qkv(seq=20), axis_name="sp", token_order="zigzag")
    assert "query float32[1, 20, 4, 8]: its sequence dim must cut into 8 equal chunks (zigzag: two per device" in str(
        e.value)
    with jax.sharding.use_abstract_mesh(AbstractMesh((4,), ("dp",))):
        with pytest.raises(ValueError) as e:
            ring_attention(*_qkv(), axis_name="sp")
    assert "the mesh in scope has axes ('dp',)" in str(e.value)


def test_wrapper_refuses_what_a_ring_cannot_take():
    """The mesh wrapper cuts a sequence only as a ring can run it."""
    mesh = AbstractMesh((2, 4), ("dp", "sp"))
    with pytest.raises(ValueError, match="bias cannot be combined with ring attention"):
        flash_attention(*_qkv(), bias=jnp.zeros((1, 4, 16, 16)), mesh=mesh, in_specs=P(None, "sp"))
    with pytest.raises(ValueError, match=r"the sequence of query \(18\) cannot be cut evenly over mesh axis 'sp'"):
        flash_attention(*_qkv(seq=18), mesh=mesh, in_specs=P(None, "sp"))
    with pytest.raises(ValueError, match=r"the sequence of query \(20\) cannot be cut evenly over mesh axis 'sp' "
                                         r"\(8 zigzag chunks\)"):
        flash_attention(*_qkv(seq=16 + 4), mesh=mesh, in_specs=P(None, "sp"), token_order="zigzag")
    with pytest.raises(ValueError, match="token_order='zigzag' is the order of a sequence cut over a mesh axis"):
        flash_attention(*_qkv(batch=2), mesh=mesh, in_specs=P("dp"), token_order="zigzag")
    with pytest.raises(ValueError, match="token_order must be one of contiguous, zigzag"):
        flash_attention(*_qkv(), mesh=mesh, in_specs=P(None, "sp"), token_order="striped")
    with pytest.raises(ValueError, match="cuts the token axis of query over mesh axis 'sp'"):
        flash_attention(*(x[0] for x in _qkv()), cu_seqlens_q=jnp.array([0, 16]), cu_seqlens_k=jnp.array([0, 16]),
                        max_seqlen_q=16, max_seqlen_k=16, mesh=mesh, in_specs=P("sp"))


def test_a_rows_first_result_is_written_as_a_merge_into_nothing_would_give_it():
    """`ring._write` (the first step's pair whose rows no earlier pair of the step wrote) equals `ring._merge` into
    the zeros and -inf it replaces, bitwise, rows that see nothing included; `ring._fresh` says which slots of a
    first step those are, on every device (a SKIP entry writes nothing)."""
    rng = np.random.default_rng(0)
    b, n, hkv, g, d, chunk = 1, 8, 2, 2, 4, 4
    out_p = jnp.asarray(rng.normal(size=(b, chunk, hkv, g, d)), jnp.bfloat16)
    lse_p = jnp.asarray(rng.normal(size=(b, hkv, g, chunk)), jnp.float32).at[0, 1, 0, 2].set(-jnp.inf)
    acc, lse = jnp.zeros((b, n, hkv, g, d), jnp.float32), jnp.full((b, hkv, g, n), -jnp.inf, jnp.float32)
    for q0 in (0, 4):
        want, written = ring._merge(acc, lse, out_p, lse_p, q0, chunk), ring._write(acc, lse, out_p, lse_p, q0, chunk)
        for x, y in zip(want, written):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    whole = ring._write(acc[:, :chunk], lse[..., :chunk], out_p, lse_p, 0, chunk)  # the pair covers every row
    for x, y in zip(ring._merge(acc[:, :chunk], lse[..., :chunk], out_p, lse_p, 0, chunk), whole):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    full, skip = ring.FULL, ring.SKIP
    # slots[step][slot][device] = (query chunk, key chunk, kind)
    stage = ring.Stage(4, ((((0, 0, full), (1, 0, full)), ((1, 1, full), (1, 0, skip)), ((0, 1, full), (0, 0, full))),),
                       0)
    assert [ring._fresh(stage, j) for j in range(3)] == [True, False, False]  # 1: device 1's rows 1 (even skipped)
    stage = ring.Stage(4, ((((0, 0, full), (1, 0, skip)), ((1, 1, full), (1, 0, full))),), 0)
    assert [ring._fresh(stage, j) for j in range(2)] == [True, True]  # device 1's row 1: its slot 0 skipped


def test_the_forward_sends_apart_where_xla_combines(monkeypatch):
    """`ring.KV_APART` unset: the forward's block goes as its arrays on a GPU where their bytes are within XLA's
    collective-permute combiner threshold (XLA_FLAGS' last value, else 30 MiB + 7), packed otherwise and off a GPU;
    set, as set. `ring.FIRST_STEP_SPARE_SMS` unset: HOP_SMS where NCCL_CGA_CLUSTER_SIZE=0, else none."""
    own = {"k": jax.ShapeDtypeStruct((1, 8192, 16, 128), jnp.bfloat16),  # 32 MiB each
           "v": jax.ShapeDtypeStruct((1, 8192, 16, 128), jnp.bfloat16)}
    small = {n: jax.ShapeDtypeStruct((1, 1024, 16, 128), jnp.bfloat16) for n in own}  # 4 MiB each
    monkeypatch.setattr(ring, "KV_APART", None)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for flags, big_apart in (("", False), ("--xla_gpu_collective_permute_combine_threshold_bytes=67108864", True),
                             ("--xla_gpu_collective_permute_combine_threshold_bytes=1073741824 --xla_foo=1 "
                              "--xla_gpu_collective_permute_combine_threshold_bytes=67108863", False)):
        monkeypatch.setenv("XLA_FLAGS", flags)
        assert ring._sends_apart(own) == big_apart and ring._sends_apart(small), flags
    assert not ring._sends_apart({"k": small["k"]})  # (one array: nothing to pack)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert not ring._sends_apart(small)
    for given in (True, False):
        monkeypatch.setattr(ring, "KV_APART", given)
        assert ring._sends_apart(own) == given
    monkeypatch.setattr(ring, "FIRST_STEP_SPARE_SMS", None)
    for env, sms in (("0", ring.HOP_SMS), (" 0 ", ring.HOP_SMS), ("4", 0), (None, 0)):
        if env is None:
            monkeypatch.delenv("NCCL_CGA_CLUSTER_SIZE", raising=False)
        else:
            monkeypatch.setenv("NCCL_CGA_CLUSTER_SIZE", env)
        assert ring._hop_sms() == sms, env
    monkeypatch.setattr(ring, "FIRST_STEP_SPARE_SMS", 3)
    assert ring._hop_sms() == 3
