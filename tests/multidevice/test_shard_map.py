"""Attention ops on a mesh of devices (docs/DESIGN.md §4, Transformations): inside the user's `jax.shard_map` with
`check_vma` on and through the mesh wrapper (`mesh=`, `in_specs=`, `out_specs=`), forward and every gradient under
`jit`, on every backend (the interpreters here), against the same call on one device and the float64 oracle; and
the mesh wrapper's refusals.

The test process has one device (JAX fixed it at start-up), so the checks on 8 host devices run in a process of
their own, one per backend (`shard_checks.py`: each check's failures come back as JSON). The refusals need no
devices: the wrapper checks its arguments against an abstract mesh before anything runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from ejgen.ops import blocksparse_attention, flash_attention
from ejgen.types import BlockMask
from ejgen.zoo import alibi_fixed_attention

HERE = os.path.dirname(os.path.abspath(__file__))
EXPECTED = {
    "xla": {"shard_map-gqa-causal-2x4", "wrapper-window-segments-sinks-bias-2x2", "alibi-slopes-2x2",
            "blocksparse-layout-segments-8", "wrapper-replicated-sinks-bias-8"},
    "pallas": {"wrapper-window-segments-sinks-bias-2x2", "alibi-slopes-2x2"},
    "triton": {"wrapper-window-segments-sinks-bias-2x2", "alibi-slopes-2x2"},
}


@pytest.mark.parametrize("platform", ["xla", "pallas", "triton"])
def test_ops_on_a_mesh_of_8_devices(platform):
    """Every check of `shard_checks.py` on one backend: results and gradients equal the one-device call's."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", TRITON_INTERPRET="1")  # the CPU's 8 host devices, on any host
    run = subprocess.run([sys.executable, os.path.join(HERE, "shard_checks.py"), platform], env=env,
                         capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, f"shard_checks.py {platform} failed:\n{run.stderr[-4000:]}"
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(results) == EXPECTED[platform]
    failed = {name: failures for name, failures in results.items() if failures}
    assert not failed, "\n\n".join(f"{name}:\n" + "\n".join(f) for name, f in failed.items())


MESH = AbstractMesh((2, 4), ("dp", "tp"))


def _qkv(batch=2, heads=8, kv_heads=4, seq=16, dim=16):
    q = jnp.zeros((batch, seq, heads, dim), jnp.float32)
    k = jnp.zeros((batch, seq, kv_heads, dim), jnp.float32)
    return q, k, k


def _flash(in_specs=None, mesh=MESH, **kw):
    shape = {n: kw.pop(n) for n in ("batch", "heads", "kv_heads") if n in kw}
    return lambda: flash_attention(*_qkv(**shape), mesh=mesh, in_specs=in_specs, **kw)


HEADS = P(None, None, "tp", None)


def _mask_fn():
    return BlockMask.from_mask_fn(lambda b, h, i, j: j <= i + h, 16, 16, 16, 16, heads=8)


REFUSED = {
    "mesh-without-in_specs": (_flash(), "mesh= needs in_specs=: the PartitionSpecs of (query, key, value)"),
    "in_specs-without-mesh": (_flash(HEADS, mesh=None), "in_specs / out_specs / token_order were given without mesh="),
    "mesh-not-a-mesh": (_flash(HEADS, mesh="tp"), "mesh must be a jax.sharding.Mesh, got str"),
    "in_specs-not-specs": (_flash("tp"), "in_specs must be the PartitionSpecs of (query, key, value)"),
    "unknown-mesh-axis": (_flash(P("sp")), "in_specs for query names mesh axis 'sp', which the mesh does not have"),
    "heads-of-q-only": (_flash((HEADS, P(), P())), "cuts the heads of query over 'tp' but of key over None"),
    "heads-over-another-axis": (_flash((HEADS, P(None, None, "dp"), P(None, None, "dp"))),
                                "cuts the heads of query over 'tp' but of key over 'dp'"),
    "batch-of-q-only": (_flash((P("dp"), P(), P("dp"))), "cuts the batch of query over 'dp' but of key over None"),
    "sequence-over-two-axes": (_flash(P(None, ("dp", "tp"))), "cuts the sequence over mesh axes ('dp', 'tp'): ring "
                                                              "attention runs over one mesh axis"),
    "sequence-of-kv": (_flash((P(), P(None, "dp"), P(None, "dp"))),
                       "cuts the sequence of query over None but of key over 'dp'"),
    "head_dim": (_flash(P(None, None, None, "tp")), "cuts head_dim of query over mesh axis 'tp'"),
    "axis-twice": (_flash(P("tp", None, "tp")), "in_specs for query uses a mesh axis twice"),
    "heads-not-divisible": (_flash(HEADS, heads=6, kv_heads=6),
                            "query heads (6) cannot be cut evenly over mesh axis 'tp' (4 devices)"),
    "gqa-kv-heads-not-divisible": (_flash(HEADS, heads=8, kv_heads=2),
                                   "key/value heads (2) cannot be cut evenly over mesh axis 'tp' (4 devices) (GQA"),
    "batch-not-divisible": (_flash(P("dp"), batch=3), "the batch (3) cannot be cut evenly over mesh axis 'dp'"),
    "out_specs": (_flash(HEADS, out_specs=P("dp", None, "tp")),
                  "out_specs=P('dp', None, 'tp') is not how the results are cut: P(None, None, 'tp', None)"),
    "out_specs-without-lse": (_flash(HEADS, out_specs=(HEADS, P(None, None)), return_lse=True),
                              "is not how the results are cut: (P(None, None, 'tp', None), P(None, 'tp', None))"),
    "spec-reads-h": (lambda: alibi_fixed_attention(*_qkv(kv_heads=8), mesh=MESH, in_specs=HEADS),
                     "the spec's score or mask reads the head index h as a number (zoo/alibi_fixed_attention.yaml)"),
    "mask_fn-over-heads": (lambda: flash_attention(*_qkv(), mesh=MESH, in_specs=HEADS, block_mask=_mask_fn()),
                           "block_mask has a mask_fn over 1 batch rows x 8 heads"),
    "blocksparse-sequence-layouts": (lambda: blocksparse_attention(*(x.swapaxes(1, 2) for x in _qkv()), mesh=MESH,
                                                                   qkv_layouts=jnp.ones((2, 2), bool),
                                                                   in_specs=P(None, None, "tp")),
                                     "blocksparse_attention(): block_mask cannot be combined with ring attention"),
}


@pytest.mark.parametrize("case", REFUSED.values(), ids=REFUSED.keys())
def test_mesh_wrapper_refuses(case):
    """Each problem with the mesh or the specs is one ValueError that names it, before anything runs."""
    call, message = case
    with pytest.raises(ValueError) as e:
        call()
    assert message in str(e.value)

