"""Context parallelism of the linear recurrent family on a CPU mesh of 8 host devices, for `test_recurrent_cp.py`:
``python recurrent_cp_checks.py <backend>`` runs every check of that backend in this process and prints one JSON
line, ``{check: [failures]}`` (empty: passed).

Each check cuts one call's steps over a mesh axis of 2, 4 or 8 devices (the `<name>_cp` form inside the user's
``jax.shard_map``, on global arrays under a mesh context, or through the mesh wrapper), runs it under ``jax.jit`` with
``jax.vjp`` (cotangents for o and final_state) and compares o, final_state and every gradient (q, k, v, each gate,
initial_state) with the float64 oracle of the whole sequence (tests/recurrent/recurrent_oracle.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(_HERE, "..", "recurrent"))
import shard_checks  # noqa: E402  (sets XLA_FLAGS for 8 host devices before JAX starts)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import recurrent_oracle as oracle  # noqa: E402
from recurrent_cases import HOOKED_ORACLE, Case, built_ops, inputs  # noqa: E402
from ejgen import generated  # noqa: E402

SEQ = P(None, "sp")  # [B, T, ...]: the steps over the axis "sp"
ALL = ("g", "g_gamma", "gk", "gv")
ELU1 = {"feature_map": lambda x: jnp.where(x > 0, x + 1.0, jnp.exp(x))}  # elu(x) + 1, by hand


def run(fn, x: dict, d_out, d_final, mesh=None):
    """(o, final_state, grads by argument name) of ``fn(args) -> (o, final_state)`` under jit, forward and vjp. On
    a mesh of explicit axes (``jax.make_mesh``'s) the results are typed as cut; they are gathered whole first, as the
    cotangents are."""

    @jax.jit
    def fwd_bwd(args, d_out, d_final):
        def call(a):
            o, final = fn(dict(a))
            if mesh is not None:
                whole = NamedSharding(mesh, P())
                o, final = jax.sharding.reshard(o, whole), jax.sharding.reshard(final, whole)
            return o, final

        (o, final), vjp = jax.vjp(call, args)
        return o, final, vjp((d_out, d_final))[0]

    out = fwd_bwd({n: jnp.asarray(a) for n, a in x.items()}, jnp.asarray(d_out), jnp.asarray(d_final))
    return jax.tree.map(lambda a: np.asarray(jax.device_get(a)), out)


def compare(failures, case: Case, got, x, d_out, d_final, hooks=None):
    """o, final_state and every gradient against the oracle of the whole sequence (the dtype's tolerance)."""
    o, final, grads = got
    o_ref, final_ref, grads_ref = oracle.recurrent(x, d_out, d_final, reverse=case.reverse, cu=case.cu,
                                                   **(hooks or {}))
    if o.dtype != jnp.dtype(case.dtype) or final.dtype != np.float32:
        failures.append(f"dtypes: o {o.dtype}, final_state {final.dtype}")
    if set(grads) != set(x):
        failures.append(f"gradients for {sorted(grads)}, expected {sorted(x)}")
    pairs = [("o", o, o_ref), ("final_state", final, final_ref)]
    pairs += [(f"d{n}", grads[n], grads_ref[n]) for n in x if n in grads]
    for name, value, want in pairs:
        try:
            oracle.assert_close(name, value, want, case.dtype)
        except AssertionError as e:
            failures.append(str(e))


def in_shard_map(op, devices: int, **static):
    """``fn(args) -> (o, final_state)``: ``op``'s context-parallel form inside ``jax.shard_map`` over ``devices``
    devices of axis "sp", q, k, v and the per-step gates cut over it, g_gamma and initial_state replicated; o comes
    back cut, final_state replicated (the same on every device: out_specs P())."""
    mesh = Mesh(np.array(jax.devices()[:devices]), ("sp",))

    def fn(a):
        q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
        specs = {n: SEQ if n in ("g", "gk", "gv") else P() for n in a}

        def body(q, k, v, rest):
            return op(q, k, v, **rest, axis_name="sp", **static)

        return jax.shard_map(body, mesh=mesh, in_specs=(SEQ, SEQ, SEQ, specs), out_specs=(SEQ, P()))(q, k, v, a)

    return fn


def check_shard_map(case: Case, hooks=None, op=None, **extra):
    """``case``'s op as ``<name>_cp`` inside the user's shard_map over ``devices`` devices."""

    def check(backend, failures, devices):
        x, d_out, d_final = inputs(case)
        cp = op or getattr(generated, f"{case.op}_cp")
        fn = in_shard_map(cp, devices, platform=backend, **case.kwargs(), **extra)
        compare(failures, case, run(fn, x, d_out, d_final), x, d_out, d_final, hooks)

    return check


def check_gate_map(backend, failures, devices):
    """A spec with a gate map and a feature map (built here, tests/recurrent's HOOKED spec): the incoming states'
    share takes the mapped gates and q from the op's own jnp hooks."""
    case = Case("hooked", ("g", "gk"), shape=(2, 32, 2, 2, 8, 8), h0=True, algorithm="chunked", chunk=16)
    with tempfile.TemporaryDirectory() as root:
        sys.path.insert(0, root)
        try:
            with contextlib.redirect_stdout(sys.stderr):  # the build's lines: stdout is the JSON's
                ops = built_ops(Path(root))
        finally:
            sys.path.remove(root)
        check_shard_map(case, HOOKED_ORACLE, op=ops.hooked_cp)(backend, failures, devices)


def check_context_mesh(backend, failures, devices):
    """lightning_attention_cp on global arrays under `with jax.set_mesh(mesh):`: the op cuts the steps over "sp"
    itself (g_gamma and initial_state replicated); reverse given as a numpy bool (a Python value all the same)."""
    case = Case("lightning_attention", ("g_gamma",), shape=(2, 32, 4, 4, 8, 8), h0=True)
    x, d_out, d_final = inputs(case)
    mesh = jax.make_mesh((devices,), ("sp",))

    def fn(a):
        kw = {**case.kwargs(), "reverse": np.bool_(case.reverse)}
        return generated.lightning_attention_cp(**a, axis_name="sp", platform=backend, **kw)

    with jax.set_mesh(mesh):
        got = run(fn, x, d_out, d_final, mesh)
    compare(failures, case, got, x, d_out, d_final)


def check_wrapper(shape: tuple, names: tuple, in_specs: P, case: Case):
    """``case`` through the op's mesh wrapper over a mesh (``jax.make_mesh``) of ``shape`` x ``names``, cut as
    ``in_specs`` say (a cut sequence: the context-parallel form); reverse given as a numpy bool."""

    def check(backend, failures):
        x, d_out, d_final = inputs(case)
        mesh = jax.make_mesh(shape, names)
        cu = {} if case.cu is None else {"cu_seqlens": jnp.asarray(np.array(case.cu, np.int32))}
        op = getattr(generated, case.op)

        def fn(a):
            q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
            kw = {**case.kwargs(), "reverse": np.bool_(case.reverse)}
            return op(q, k, v, **a, **cu, platform=backend, mesh=mesh, in_specs=in_specs, **kw)

        compare(failures, case, run(fn, x, d_out, d_final, mesh), x, d_out, d_final)

    return check


# check -> {backend: devices} (None: the check sets its mesh). The combine across devices is the same code on every
# backend (jnp); what differs is each shard's own recurrence inside the map: the interpreters run one small call of
# theirs on 2 devices (Pallas takes no gv), xla the rest: every gate, GQA, initial and final states, reverse, 2, 4
# and 8 devices, the chunked and fused algorithms, hooks, the mesh context and the wrapper.
CHECKS = {
    "gla-gk-gqa-h0": (check_shard_map(Case("gla", ("gk",), shape=(1, 48, 2, 1, 16, 16), h0=True, chunk=16)),
                      {"xla": 2, "pallas": 2, "triton": 2}),
    "simple_gla-g-g_gamma-h0-reverse": (
        check_shard_map(Case("simple_gla", ("g", "g_gamma"), shape=(2, 64, 2, 2, 16, 16), h0=True, reverse=True)),
        {"xla": 4, "pallas": 2}),
    "gla-gk-gqa-h0-fused": (  # Pallas's own fused forward (GPUs) inside the map
        check_shard_map(Case("gla", ("gk",), shape=(1, 24, 2, 1, 16, 16), h0=True, algorithm="fused", chunk=None)),
        {"pallas": 2}),
    "recurrent-every-gate-gqa-h0-fused": (
        check_shard_map(Case("recurrent", ALL, shape=(2, 24, 4, 2, 8, 12), h0=True, algorithm="fused", chunk=None)),
        {"xla": 8, "triton": 2}),
    "recurrent-every-gate-reverse-chunked-bf16": (
        check_shard_map(Case("recurrent", ALL, dtype="bfloat16", shape=(1, 128, 2, 1, 8, 8), reverse=True)),
        {"xla": 4}),
    # 2 steps a shard, float32: a state carried past many devices still weighs (the fold's decays over every hop)
    "recurrent-every-gate-gqa-h0-reverse-short-shards": (
        check_shard_map(Case("recurrent", ALL, shape=(1, 16, 4, 2, 4, 6), h0=True, reverse=True, algorithm="fused",
                             chunk=None)), {"xla": 8}),
    "linear_attention-feature-map-h0": (
        check_shard_map(Case("linear_attention", (), shape=(1, 32, 2, 1, 8, 8), h0=True), ELU1), {"xla": 4}),
    "hooked-gate-map": (check_gate_map, {"xla": 2}),
    "set_mesh-global": (check_context_mesh, {"xla": 4}),
    "wrapper-dp2-sp4": (check_wrapper((2, 4), ("dp", "sp"), P("dp", "sp"),
                                      Case("recurrent", ALL, shape=(2, 32, 4, 2, 8, 8), h0=True)), {"xla": None}),
    "wrapper-dp2-sp2-tp2-reverse": (check_wrapper((2, 2, 2), ("dp", "sp", "tp"), P("dp", "sp", "tp"),
                                                  Case("simple_gla", ("g", "g_gamma"), shape=(2, 32, 4, 2, 8, 8),
                                                       h0=True, reverse=True)), {"xla": None}),
    "wrapper-tp2-packed": (check_wrapper((4, 2), ("dp", "tp"), P(None, None, "tp"),
                                         Case("gla", ("gk",), shape=(1, 30, 4, 2, 8, 8), cu=(0, 7, 7, 20, 28),
                                              h0=True)), {"xla": None}),
}


def main(backend: str) -> dict:
    return shard_checks.run_checks(CHECKS, backend)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
