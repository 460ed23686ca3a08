"""Context parallelism of the linear recurrent family (docs/DESIGN.md §3, "Context parallelism (linear recurrent)"):
every recurrent op's `<name>_cp` form and the mesh wrapper of the recurrent ops on 2, 4 and 8 host devices against the
float64 oracle of the whole sequence (`recurrent_cp_checks.py`, a process of its own per backend, as `test_ring.py`);
and every refusal, before anything runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from ejgen.generated import gla, gla_cp, recurrent, recurrent_cp, simple_gla_cp

HERE = os.path.dirname(os.path.abspath(__file__))
EXPECTED = {
    "xla": {"gla-gk-gqa-h0-2", "simple_gla-g-g_gamma-h0-reverse-4", "recurrent-every-gate-gqa-h0-fused-8",
            "recurrent-every-gate-reverse-chunked-bf16-4", "recurrent-every-gate-gqa-h0-reverse-short-shards-8",
            "linear_attention-feature-map-h0-4", "hooked-gate-map-2",
            "set_mesh-global-4", "wrapper-dp2-sp4", "wrapper-dp2-sp2-tp2-reverse", "wrapper-tp2-packed"},
    "pallas": {"gla-gk-gqa-h0-2", "simple_gla-g-g_gamma-h0-reverse-2", "gla-gk-gqa-h0-fused-2"},
    "triton": {"gla-gk-gqa-h0-2", "recurrent-every-gate-gqa-h0-fused-2"},
}


@pytest.mark.parametrize("platform", ["xla", "pallas", "triton"])
def test_context_parallel_on_a_mesh_of_8_devices(platform):
    """Every check of `recurrent_cp_checks.py` on one backend: o, final_state and every gradient equal the oracle's
    of the whole sequence."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, os.path.join(HERE, "recurrent_cp_checks.py"), platform], env=env,
                         capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, f"recurrent_cp_checks.py {platform} failed:\n{run.stderr[-4000:]}"
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(results) == EXPECTED[platform]
    failed = {name: failures for name, failures in results.items() if failures}
    assert not failed, "\n\n".join(f"{name}:\n" + "\n".join(f) for name, f in failed.items())


def _qkv(batch=1, steps=16, heads=4, kv_heads=2, dk=8, dv=8):
    q = jnp.zeros((batch, steps, heads, dk), jnp.float32)
    k = jnp.zeros((batch, steps, kv_heads, dk), jnp.float32)
    v = jnp.zeros((batch, steps, kv_heads, dv), jnp.float32)
    return q, k, v


def _gk(batch=1, steps=16, heads=4, dk=8):
    return jnp.zeros((batch, steps, heads, dk), jnp.float32)


def _cp(**kw):
    return lambda: gla_cp(*_qkv(), _gk(), axis_name="sp", **kw)


CU = jnp.array([0, 5, 16], jnp.int32)
REFUSED = {
    "cu_seqlens": (_cp(cu_seqlens=CU), ValueError,
                   "gla_cp(): cu_seqlens cannot be combined with context parallelism (a cut sequence)"),
    "axis_name": (lambda: gla_cp(*_qkv(), _gk(), axis_name=("sp", "dp")), ValueError,
                  "axis_name must be the name of one mesh axis (a str)"),
    "no-mesh": (_cp(), ValueError, "gla_cp(): axis_name='sp' is not a bound mesh axis (no mesh is in scope)"),
    "mesh-argument": (_cp(mesh=AbstractMesh((2,), ("sp",))), TypeError,
                      "gla_cp() got mesh=: a context-parallel form runs inside jax.shard_map"),
    "unknown-argument": (_cp(g=jnp.zeros((1, 16, 4))), TypeError,
                         "gla_cp() got an unsupported argument 'g': the spec does not enable feature 'g'"),
    "missing-gate": (lambda: simple_gla_cp(*_qkv(), axis_name="sp", g_gamma=jnp.zeros(4)), TypeError,
                     "simple_gla_cp() needs g"),
}


@pytest.mark.parametrize("case", REFUSED.values(), ids=REFUSED.keys())
def test_context_parallel_refuses(case):
    """What a context-parallel call cannot take is one clear error naming the argument, before anything runs."""
    call, kind, message = case
    with pytest.raises(kind) as e:
        call()
    assert message in str(e.value)


def test_global_call_is_checked_whole():
    """On global arrays under a mesh context the call is checked with its global shapes before it is cut: steps that
    do not cut evenly over the axis, a gate of the wrong shape (named with the whole call's shape), a mesh without
    the axis."""
    with jax.sharding.use_abstract_mesh(AbstractMesh((4,), ("sp",))):
        with pytest.raises(ValueError, match=r"gla_cp\(\): the 18 steps of query cannot be cut evenly over mesh axis "
                                             r"'sp' \(4 devices\)"):
            gla_cp(*_qkv(steps=18), _gk(steps=18), axis_name="sp")
        with pytest.raises(ValueError, match=r"gk must be float \[batch, seq_len, heads, K\] = \[1, 16, 4, 8\]"):
            gla_cp(*_qkv(), _gk(steps=12), axis_name="sp")
    with jax.sharding.use_abstract_mesh(AbstractMesh((4,), ("dp",))):
        with pytest.raises(ValueError, match=r"the mesh in scope has axes \('dp',\)"):
            gla_cp(*_qkv(), _gk(), axis_name="sp")


def _gv(batch=1, steps=16, heads=4, dv=8):
    return jnp.zeros((batch, steps, heads, dv), jnp.float32)


PALLAS_GV = {  # the platform's chunked kernels take no gv, nor its kernel set: the op's own refusals
    "chunked": "the chunked kernels of this platform take no gv: pass algorithm='fused'",
    "auto": "platform 'pallas' cannot run this call: gv is not taken by the Pallas kernels",
}


@pytest.mark.parametrize("algorithm", PALLAS_GV)
def test_global_call_is_checked_on_its_platform(algorithm):
    """The whole call is checked as the op checks it on the platform it runs: Pallas with gv is refused before the
    call is cut, under the name the user called (the context-parallel form's; the mesh wrapper's op)."""
    with jax.sharding.use_abstract_mesh(AbstractMesh((4,), ("sp",))), pytest.raises(ValueError) as e:
        recurrent_cp(*_qkv(), gv=_gv(), axis_name="sp", algorithm=algorithm, platform="pallas")
    assert f"recurrent_cp(): {PALLAS_GV[algorithm]}" in str(e.value)
    with pytest.raises(ValueError) as e:
        recurrent(*_qkv(), gv=_gv(), algorithm=algorithm, platform="pallas", mesh=AbstractMesh((4,), ("sp",)),
                  in_specs=P(None, "sp"))
    assert f"recurrent(): {PALLAS_GV[algorithm]}" in str(e.value)


def test_call_inside_shard_map_names_the_cp_form():
    """Inside jax.shard_map the shard's call is checked under the context-parallel form's name."""
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("sp",))
    body = lambda q, k, v: gla_cp(q, k, v, _gk(steps=12), axis_name="sp")  # noqa: E731
    run = jax.shard_map(body, mesh=mesh, in_specs=P(None, "sp"), out_specs=(P(None, "sp"), P()))
    with pytest.raises(ValueError, match=r"gla_cp\(\): gk must be float \[batch, seq_len, heads, K\] = \[1, 16, 4, 8\]"):
        run(*_qkv())


MESH = AbstractMesh((2, 2, 2), ("dp", "sp", "tp"))
G = jnp.zeros((2, 16, 4), jnp.float32)
WRAPPER = {
    "in_specs-without-mesh": (dict(in_specs=P("dp")), "in_specs / out_specs were given without mesh="),
    "mesh-without-in_specs": (dict(mesh=MESH), "mesh= needs in_specs=: the PartitionSpecs of (query, key, value)"),
    "not-a-mesh": (dict(mesh="dp", in_specs=P("dp")), "mesh must be a jax.sharding.Mesh, got str"),
    "unknown-axis": (dict(mesh=MESH, in_specs=P("pp")), "in_specs for query names mesh axis 'pp', which the mesh "
                                                         "does not have (axes: dp, sp, tp)"),
    "head_dim": (dict(mesh=MESH, in_specs=P(None, None, None, "tp")), "in_specs cuts head_dim of query over mesh "
                                                                      "axis 'tp'"),
    "key-cut-otherwise": (dict(mesh=MESH, in_specs=(P("dp"), P("dp", None, "tp"), P("dp"))),
                          "in_specs cuts the heads of query over None but of key over 'tp'"),
    "sequence-over-two-axes": (dict(mesh=MESH, in_specs=P(None, ("sp", "tp"))),
                               "in_specs cuts the sequence over mesh axes ('sp', 'tp'): context parallelism runs over "
                               "one mesh axis"),
    "batch-uneven": (dict(mesh=AbstractMesh((4,), ("dp",)), in_specs=P("dp")),
                     r"batch (2) cannot be cut evenly over mesh axis 'dp' (4 devices)"),
    "steps-uneven": (dict(mesh=AbstractMesh((3,), ("sp",)), in_specs=P(None, "sp")),
                     "the steps of query (16) cannot be cut evenly over mesh axis 'sp' (3 devices)"),
    "kv-heads-uneven": (dict(mesh=AbstractMesh((4,), ("tp",)), in_specs=P(None, None, "tp")),
                        "key/value heads (2) cannot be cut evenly over mesh axis 'tp' (4 devices) (GQA"),
    "out_specs": (dict(mesh=MESH, in_specs=P("dp", "sp"), out_specs=(P("dp", "sp"), P("dp", None, None, "sp"))),
                  "is not how the results are cut: (P('dp', 'sp', None, None), P('dp', None, None, None))"),
    "gate-shape": (dict(mesh=MESH, in_specs=P("dp", "sp"), g=G[:, :8]),
                   r"g must be float [batch, seq_len, heads] = [2, 16, 4] (log space), got float32[2, 8, 4]"),
}


@pytest.mark.parametrize("case", WRAPPER.values(), ids=WRAPPER.keys())
def test_wrapper_refuses(case):
    """The mesh wrapper of a recurrent op: every problem with the mesh, the specs or the call (checked whole, with
    its global shapes) is one ValueError naming it, before anything runs (an abstract mesh: no device needed)."""
    kw, message = case
    kw = {"g": G, **kw}
    with pytest.raises(ValueError) as e:
        recurrent(*_qkv(batch=2), **kw)
    assert message in str(e.value)


def test_wrapper_refuses_packed_sequences_cut():
    """Packed sequences (cu_seqlens) keep their steps whole on every device: a cut sequence is refused, a cut batch
    (1 with packing) too."""
    with pytest.raises(ValueError, match="and cu_seqlens packs sequences along it"):
        gla(*_qkv(), _gk(), cu_seqlens=CU, mesh=MESH, in_specs=P(None, "sp"))
    with pytest.raises(ValueError, match=r"with cu_seqlens the batch is 1: packed sequences"):
        gla(*_qkv(), _gk(), cu_seqlens=CU, mesh=MESH, in_specs=P("dp"))
