"""Attention ops on a CPU mesh of 8 host devices, for `test_shard_map.py`: ``python shard_checks.py <backend>``
runs every check on that backend in this process and prints one JSON line, ``{check: [failures]}`` (an empty
list: the check passed).

Its own process because the device count is fixed when JAX starts (the test process has one device). Each check
runs a call cut over a mesh (under ``jax.jit``, forward and ``jax.vjp`` with cotangents for out and lse) and
compares output, lse and every gradient with the same call on one device and with the float64 oracle.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

_FLAGS = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _FLAGS:  # as tests/conftest.py: small CPU graphs compile faster
    _FLAGS += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = f"{_FLAGS} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "attention"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import oracle  # noqa: E402
from ejgen.generated import alibi_attention  # noqa: E402
from ejgen.ops import blocksparse_attention, flash_attention  # noqa: E402
from ejgen.testing.shapes import AttnShape, packed_segments, random_cotangents, random_qkv, rng_for  # noqa: E402
from ejgen.types import MaskInfo  # noqa: E402

SAME = 2e-6  # cut over a mesh against one device: the same kernels on slices; sums over devices differ in order


def mesh(shape, names):
    """The mesh users make (``jax.make_mesh``: explicit axes in newer JAX, which the wrapper must lay inputs out
    on itself)."""
    return jax.make_mesh(shape, names)


def auto_mesh(shape, names):
    """A mesh of the classic constructor (automatic axes: shard_map cuts its inputs itself)."""
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def vjp_call(fn, diff, d_out, d_lse):
    """(out, lse, grads) of ``fn(**diff) -> (out, lse)`` under jit, grads for every entry of ``diff``."""

    @jax.jit
    def run(diff, d_out, d_lse):
        (out, lse), pull = jax.vjp(lambda d: fn(**d), diff)
        return out, lse, pull((d_out, d_lse))[0]

    return jax.block_until_ready(run(diff, d_out, d_lse))


def compare(failures, sharded, single, ref):
    """Every result of the cut call against the one-device call (SAME) and the oracle (its tolerances)."""
    out, lse, grads = sharded
    pairs = [("out", out, single[0], ref.out, oracle.TOLERANCE["float32"]),
             ("lse", lse, single[1], ref.lse, oracle.LSE_TOLERANCE)]
    pairs += [(f"d{n}", grads[n], single[2][n], ref.grads[n], oracle.TOLERANCE["float32"]) for n in grads]
    for name, x, one, exact, tol in pairs:
        for what, want, t in (("one device", one, SAME), ("oracle", exact, tol)):
            try:
                oracle.assert_close(f"{name} vs {what}", x, want, t)
            except AssertionError as e:
                failures.append(str(e))


def inputs(shape, tag, layout="bshd"):
    rng = rng_for("multidevice", tag, shape)
    diff = random_qkv(shape, "float32", rng)
    d_out, d_lse = random_cotangents(shape, "float32", rng)
    if layout == "bhsd":
        diff = {n: x.swapaxes(1, 2) for n, x in diff.items()}
        d_out = d_out.swapaxes(1, 2)
    return rng, diff, d_out, d_lse


def check_shard_map(backend, failures):
    """The plain op inside the user's own ``jax.shard_map`` (check_vma on): GQA, causal, mesh (2, 4) = dp x tp."""
    shape = AttnShape(2, 16, 16, 8, 4, 16)
    _, diff, d_out, d_lse = inputs(shape, "shard_map")
    m = auto_mesh((2, 4), ("dp", "tp"))
    spec = P("dp", None, "tp", None)
    inner = lambda q, k, v: flash_attention(q, k, v, causal=True, platform=backend, return_lse=True)  # noqa: E731
    cut = jax.shard_map(inner, mesh=m, in_specs=(spec,) * 3, out_specs=(spec, P("dp", "tp", None)))
    sharded = vjp_call(lambda query, key, value: cut(query, key, value), diff, d_out, d_lse)
    single = vjp_call(lambda **d: inner(d["query"], d["key"], d["value"]), diff, d_out, d_lse)
    ref = oracle.attention(**diff, causal=True, d_out=d_out, d_lse=d_lse)
    compare(failures, sharded, single, ref)


def check_features(backend, failures):
    """The mesh wrapper, mesh (2, 2): a window, segment ids, per-head sinks and a full bias (its gradient cut too)."""
    shape = AttnShape(4, 16, 16, 4, 2, 16)
    rng, diff, d_out, d_lse = inputs(shape, "features")
    diff["bias"] = jnp.asarray(rng.standard_normal((4, 4, 16, 16)), jnp.float32)
    diff["softmax_aux"] = jnp.asarray(rng.standard_normal(4) + 1.0, jnp.float32)
    ids = packed_segments(4, 16, rng)
    m = mesh((2, 2), ("dp", "tp"))
    kw = dict(sliding_window=(6, 3), mask_info=MaskInfo.from_segments(ids), platform=backend, return_lse=True)
    sharded = vjp_call(lambda **d: flash_attention(**d, **kw, mesh=m, in_specs=P("dp", None, "tp")), diff, d_out, d_lse)
    single = vjp_call(lambda **d: flash_attention(**d, **kw), diff, d_out, d_lse)
    ref = oracle.attention(**diff, sliding_window=(6, 3), q_segment_ids=ids, kv_segment_ids=ids, d_out=d_out,
                           d_lse=d_lse)
    compare(failures, sharded, single, ref)


def check_replicated(backend, failures):
    """The mesh wrapper, heads over mesh (8,): sinks shared by all heads and a bias broadcast over batch and heads,
    both replicated, so their gradients are sums over the devices."""
    shape = AttnShape(1, 16, 16, 8, 8, 16)
    rng, diff, d_out, d_lse = inputs(shape, "replicated")
    diff["bias"] = jnp.asarray(rng.standard_normal((1, 1, 16, 16)), jnp.float32)
    diff["softmax_aux"] = jnp.asarray(rng.standard_normal(3) + 1.0, jnp.float32)
    m = mesh((8,), ("tp",))
    kw = dict(causal=True, platform=backend, return_lse=True)
    spec = P(None, None, "tp", None)
    sharded = vjp_call(lambda **d: flash_attention(**d, **kw, mesh=m, in_specs=(spec,) * 3), diff, d_out, d_lse)
    single = vjp_call(lambda **d: flash_attention(**d, **kw), diff, d_out, d_lse)
    ref = oracle.attention(**diff, causal=True, d_out=d_out, d_lse=d_lse)
    compare(failures, sharded, single, ref)


def check_alibi(backend, failures):
    """A generated spec with a param and an option: alibi_attention over mesh (2, 2), heads over tp and batch over
    dp, so that slopes are cut with the heads and replicated over dp (their gradient: the sum over dp)."""
    shape = AttnShape(2, 16, 16, 4, 4, 16)
    rng, diff, d_out, d_lse = inputs(shape, "alibi")
    diff["slopes"] = jnp.asarray(rng.uniform(0.05, 0.5, 4), jnp.float32)
    kw = dict(causal=True, max_distance=8, platform=backend, return_lse=True)
    m = mesh((2, 2), ("dp", "tp"))
    spec = P("dp", None, "tp", None)
    sharded = vjp_call(lambda **d: alibi_attention(**d, **kw, mesh=m, in_specs=spec), diff, d_out, d_lse)
    single = vjp_call(lambda **d: alibi_attention(**d, **kw), diff, d_out, d_lse)
    slopes = diff.pop("slopes")
    ref = oracle.variant_attention("alibi_attention", **diff, params={"slopes": slopes}, options={"max_distance": 8},
                                   causal=True, d_out=d_out, d_lse=d_lse)
    compare(failures, sharded, single, ref)


def check_blocksparse(backend, failures):
    """blocksparse_attention ([B, H, S, D]) through the mesh wrapper, heads over mesh (8,): a per-head block layout
    (cut with the heads) and segment ids, causal."""
    shape = AttnShape(1, 32, 32, 8, 8, 16)
    rng, diff, d_out, d_lse = inputs(shape, "blocksparse", layout="bhsd")
    layout = rng.random((1, 8, 4, 4)) < 0.6
    layout[..., np.arange(4), np.arange(4)] = True
    ids = packed_segments(1, 32, rng)
    m = mesh((8,), ("tp",))
    kw = dict(q_segment_ids=jnp.asarray(ids), qkv_layouts=jnp.asarray(layout), platform=backend, return_lse=True)
    spec = P(None, "tp")
    sharded = vjp_call(lambda **d: blocksparse_attention(**d, **kw, mesh=m, in_specs=spec), diff, d_out, d_lse)
    single = vjp_call(lambda **d: blocksparse_attention(**d, **kw), diff, d_out, d_lse)
    dense = np.broadcast_to(layout.repeat(8, axis=2).repeat(8, axis=3), (1, 8, 32, 32))
    bshd = {n: x.swapaxes(1, 2) for n, x in diff.items()}
    ref = oracle.attention(**bshd, causal=True, q_segment_ids=ids, kv_segment_ids=ids, attention_mask=dense,
                           d_out=d_out.swapaxes(1, 2), d_lse=d_lse)
    ref.out = ref.out.swapaxes(1, 2)
    ref.grads = {n: g.swapaxes(1, 2) for n, g in ref.grads.items()}
    compare(failures, sharded, single, ref)


# check -> the backends it runs on. What differs between backends is inside each device's call (kernel outputs and
# loop carries typed as varying, the interpreters' handling): the interpreters run one call of the wrapper with every
# built-in feature and one with a param. The rest is the same machinery on every backend (the user's own shard_map,
# replicated arguments summed over devices, block masks cut by the wrapper): xla alone, to keep the interpreters'
# share of the budget small.
CHECKS = {
    "wrapper-window-segments-sinks-bias-2x2": (check_features, ("xla", "pallas", "triton")),
    "alibi-slopes-2x2": (check_alibi, ("xla", "pallas", "triton")),
    "shard_map-gqa-causal-2x4": (check_shard_map, ("xla",)),
    "blocksparse-layout-segments-8": (check_blocksparse, ("xla",)),
    "wrapper-replicated-sinks-bias-8": (check_replicated, ("xla",)),
}


def run_checks(checks: dict, backend: str) -> dict:
    """{name: failures} of every check that runs on ``backend``. ``checks``: name -> (check, backends), backends a
    tuple (``check(backend, failures)``: the check sets its mesh) or {backend: devices} (devices None: as a tuple;
    else ``check(backend, failures, devices)``, the name gaining ``-<devices>``). A check's exception is a failure of
    that check: every check runs and reports; each one's seconds go to stderr."""
    results = {}
    for name, (check, backends) in checks.items():
        if backend not in backends:
            continue
        failures = []
        start = time.perf_counter()
        devices = backends[backend] if isinstance(backends, dict) else None
        name = name if devices is None else f"{name}-{devices}"
        try:
            check(backend, failures) if devices is None else check(backend, failures, devices)
        except Exception:  # reported, not raised
            failures.append(traceback.format_exc(limit=-6))
        results[name] = failures
        print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return results


def main(backend: str) -> dict:
    return run_checks(CHECKS, backend)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
