"""Cases of the linear recurrent family's tests: a call (op, gates, shape, packing, dtype, options), random inputs
for it, and the check of one backend's outputs and every gradient against the float64 oracle (oracle.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import recurrent_oracle as oracle
from ejgen import generated

GATE_ARGS = ("g", "g_gamma", "gk", "gv")

# Specs the tests build into a package of their own (``built_ops``): both hooks, and neither gqa nor varlen.
HOOKED = """\
name: hooked
family: linear_recurrent
doc: A feature map and a gate map on a gated recurrence, without shared heads or packed sequences.
features:
  g: runtime
  gk: always
feature_map: relu(x) + 0.5 * x
gate_map: logsigmoid(x) / 16
"""
HOOKED_ORACLE = {  # the hooks above, by hand
    "feature_map": lambda x: jnp.maximum(x, 0.0) + 0.5 * x,
    "gate_map": lambda x: -jnp.logaddexp(0.0, -x) / 16,
}


@dataclasses.dataclass(frozen=True)
class Case:
    op: str  # a spec of specs/ (or of a package a test builds)
    gates: tuple = ()  # the gates the call passes
    dtype: str = "float32"
    shape: tuple = (2, 37, 4, 2, 16, 24)  # B, T, H, Hkv, K, V
    cu: tuple | None = None  # packed sequences' bounds (B = 1, T = cu[-1] + trailing tokens of no sequence)
    h0: bool = False
    reverse: bool = False
    algorithm: str = "chunked"
    chunk: int | None = 16
    strong: bool = False  # log gates down to -20 per step
    gamma: float | None = None  # g_gamma of every head (None: drawn)

    @property
    def id(self) -> str:
        b, t, h, hkv, k, v = self.shape
        parts = [self.op, "+".join(self.gates) or "nogate", self.algorithm + (str(self.chunk) if self.chunk else ""),
                 f"B{b}-T{t}-H{h}x{hkv}-K{k}-V{v}", self.dtype]
        parts += [name for name in ("h0", "reverse", "strong") if getattr(self, name)]
        if self.gamma is not None:
            parts.append(f"gamma{self.gamma:g}")
        if self.cu is not None:
            parts.append("cu" + "_".join(map(str, self.cu)))
        return "-".join(parts)

    @property
    def n_seqs(self) -> int:
        return self.shape[0] if self.cu is None else len(self.cu) - 1

    def kwargs(self) -> dict:
        """The call's static arguments."""
        kw = {"reverse": self.reverse, "algorithm": self.algorithm}
        if self.chunk is not None:
            kw["chunk_size"] = self.chunk
        return kw


def built_ops(root):
    """Build the tests' specs under ``root`` and return the package's module (``conftest.on_path`` keeps it
    importable while the caller's block lasts)."""
    import importlib

    from ejgen.cli import main

    (root / "specs").mkdir()
    (root / "specs" / "hooked.yaml").write_text(HOOKED)
    assert main(["build", str(root / "specs"), "-o", str(root / "recurrent_test_ops")]) == 0
    return importlib.import_module("recurrent_test_ops")


def inputs(case: Case, seed: int = 0) -> tuple[dict, np.ndarray, np.ndarray]:
    """(inputs by argument name, d_out, d_final) as NumPy arrays; q, k, v and d_out rounded to the dtype."""
    rng = np.random.default_rng(seed)
    b, t, h, hkv, dk, dv = case.shape
    dtype = jnp.dtype(case.dtype)

    def rounded(x):
        return np.asarray(jnp.asarray(x.astype(np.float32), dtype))

    x = {"query": rounded(rng.standard_normal((b, t, h, dk))),
         "key": rounded(rng.standard_normal((b, t, hkv, dk))),
         "value": rounded(rng.standard_normal((b, t, hkv, dv)))}
    low = -20.0 if case.strong else None
    shapes = {"g": (b, t, h), "gk": (b, t, h, dk), "gv": (b, t, h, dv)}
    for name in case.gates:
        if name == "g_gamma":
            x[name] = -rng.uniform(0.02, 0.3, (h,)).astype(np.float32)
            if case.gamma is not None:
                x[name] = np.full((h,), case.gamma, np.float32)
        elif low is not None:
            x[name] = rng.uniform(low, 0.0, shapes[name]).astype(np.float32)
        else:  # log of a forget gate in [0.7, 1): the decays of trained models
            x[name] = np.log(rng.uniform(0.7, 1.0, shapes[name])).astype(np.float32)
    if case.h0:
        x["initial_state"] = rng.standard_normal((case.n_seqs, h, dk, dv)).astype(np.float32)
    d_out = rounded(rng.standard_normal((b, t, h, dv)))
    d_final = rng.standard_normal((case.n_seqs, h, dk, dv)).astype(np.float32)
    return x, d_out, d_final


def run(op, case: Case, x: dict, d_out, d_final, platform: str, fixed=(), **extra):
    """(o, final_state, grads by argument name) of ``op`` under jit, forward and backward; the arguments named in
    ``fixed`` are held fixed (closed over, not differentiated: no gradient of theirs)."""
    kwargs = {**case.kwargs(), **extra}
    if case.cu is not None:
        kwargs["cu_seqlens"] = jnp.asarray(np.array(case.cu, np.int32))

    @jax.jit
    def fwd_bwd(args, held, d_out, d_final):
        def call(a):
            a = {**a, **held}
            q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
            return op(q, k, v, **a, platform=platform, **kwargs)

        (o, final), vjp = jax.vjp(call, args)
        (grads,) = vjp((d_out, d_final))
        return o, final, grads

    arrays = {n: jnp.asarray(a) for n, a in x.items()}
    return fwd_bwd({n: a for n, a in arrays.items() if n not in fixed}, {n: arrays[n] for n in fixed},
                   jnp.asarray(d_out), jnp.asarray(d_final))


def check(case: Case, platform: str, op=None, hooks: dict | None = None, seed: int = 0, factor: float = 1.0,
          fixed=(), **extra):
    """The case on ``platform`` against the oracle: o, final_state and the gradient of every input (but those named
    in ``fixed``, held fixed: `run`), each within ``factor`` times the dtype's tolerance."""
    op = getattr(generated, case.op) if op is None else op
    x, d_out, d_final = inputs(case, seed)
    o, final, grads = run(op, case, x, d_out, d_final, platform, fixed=fixed, **extra)
    o_ref, final_ref, grads_ref = oracle.recurrent(x, d_out, d_final, reverse=case.reverse, cu=case.cu,
                                                   **(hooks or {}))
    assert o.dtype == jnp.dtype(case.dtype) and final.dtype == jnp.float32
    assert set(grads) == set(x) - set(fixed)
    failures = []  # every quantity out of tolerance, not only the first (a GPU log then says which and by how much)
    for name, got, ref in [("o", o, o_ref), ("final_state", final, final_ref)] + \
            [(f"d{n}", grads[n], grads_ref[n]) for n in x if n not in fixed]:
        assert name[0] != "d" or got.dtype == jnp.asarray(x[name[1:]]).dtype, name
        try:
            oracle.assert_close(name, got, ref, case.dtype, factor)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "; ".join(failures)
    return o, final, grads


def check_forward(case: Case, platform: str, seed: int = 0):
    """The case's forward outside a gradient (the op's primal: what inference runs, no residuals kept) on
    ``platform``: o and final_state against the oracle."""
    x, d_out, d_final = inputs(case, seed)
    o_ref, final_ref, _ = oracle.recurrent(x, d_out, d_final, reverse=case.reverse, cu=case.cu)
    kwargs = case.kwargs()
    if case.cu is not None:
        kwargs["cu_seqlens"] = jnp.asarray(np.array(case.cu, np.int32))
    rest = {n: jnp.asarray(a) for n, a in x.items() if n not in ("query", "key", "value")}
    o, final = getattr(generated, case.op)(*(jnp.asarray(x[n]) for n in ("query", "key", "value")), **rest,
                                           platform=platform, **kwargs)
    oracle.assert_close("o", o, o_ref, case.dtype)
    oracle.assert_close("final_state", final, final_ref, case.dtype)
    return o, final


def check_state_untouched(case: Case, platform: str, seed: int = 5):
    """The case's forward outside a gradient (where the fused kernels write the final state into the initial state's
    buffer) on ``platform``: o and final_state against the oracle, and the caller's initial_state as it was, after an
    eager call and after a jitted one that uses it again once the kernel has run."""
    x, d_out, d_final = inputs(case, seed)
    o_ref, final_ref, _ = oracle.recurrent(x, d_out, d_final, reverse=case.reverse, cu=case.cu)
    kwargs = case.kwargs()
    if case.cu is not None:
        kwargs["cu_seqlens"] = jnp.asarray(np.array(case.cu, np.int32))
    op = getattr(generated, case.op)
    h0 = jnp.asarray(x["initial_state"])
    rest = {n: jnp.asarray(a) for n, a in x.items() if n not in ("query", "key", "value", "initial_state")}
    q, k, v = (jnp.asarray(x[n]) for n in ("query", "key", "value"))

    def call(h):
        return op(q, k, v, **rest, initial_state=h, platform=platform, **kwargs)

    o, final = call(h0)  # eagerly
    np.testing.assert_array_equal(np.asarray(h0), x["initial_state"])
    oracle.assert_close("o", o, o_ref, case.dtype)
    oracle.assert_close("final_state", final, final_ref, case.dtype)
    (o2, final2), again = jax.jit(lambda h: (call(h), h * 2.0))(h0)  # h0 needed after the kernel
    np.testing.assert_array_equal(np.asarray(again), 2.0 * x["initial_state"])
    np.testing.assert_array_equal(np.asarray(h0), x["initial_state"])
    assert np.array_equal(o2, o) and np.array_equal(final2, final)
    return call, h0
