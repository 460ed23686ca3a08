"""What every generated recurrent op does before and after its kernels (docs/DESIGN.md §3 linear recurrent): check
the arguments, resolve the algorithm and the chunk, and bring the gates and the initial state to float32.

Kernel layout: the caller's own arrays, q [B, T, H, K], k [B, T, Hkv, K], v [B, T, Hkv, V] (with varlen B = 1 and
the sequences' bounds in ``ctx["cu"]``), the gates the call passes in ``gates`` (float32: g [B, T, H], g_gamma [H],
gk [B, T, H, K], gv [B, T, H, V], before the spec's gate_map), h0 [N, H, K, V] float32 or None. Everything here is
plain jnp outside the op's ``custom_vjp``, so autodiff carries the gradients through the casts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ejgen.runtime.core import kernels, settings, vma
from ejgen.runtime.core.platforms import auto_order, choose_platform  # noqa: F401 (the generated ops call it here)
from ejgen.runtime.recurrent.config import SCALAR_LOG_GATES, RecurrentConfig

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
ALGORITHMS = ("auto", "chunked", "fused")
CHUNK_SIZES = (16, 32, 64, 128)
DEFAULT_CHUNK = 64
FUSED_MAX_STEPS = 64  # auto: the fused recurrence for at most this many steps (decoding, short prompts)
GATE_SHAPES = {"g": "[batch, seq_len, heads]", "g_gamma": "[heads]", "gk": "[batch, seq_len, heads, K]",
               "gv": "[batch, seq_len, heads, V]"}
GATES = ("g", "g_gamma", "gk", "gv")


@dataclasses.dataclass(frozen=True)
class SpecInfo:
    """What a generated recurrent op knows of its spec, for messages and argument checks."""

    name: str
    path: str
    features: dict  # feature -> "runtime" | "always"
    arguments: dict  # argument -> the feature (or "call", "choice") that brings it
    absent: dict = dataclasses.field(default_factory=dict)  # built-in argument the op does not take -> its feature
    required: tuple = ()  # gates the spec compiles in (`always`): None is refused

    @property
    def gqa(self) -> bool:
        return "gqa" in self.features


def reject_unsupported(spec: SpecInfo, unsupported: dict) -> None:
    if not unsupported:
        return
    name = sorted(unsupported)[0]
    if name in spec.absent:
        why = f"the spec does not enable feature '{spec.absent[name]}'"
    else:
        why = "it is not an argument of a recurrent op"
    raise TypeError(f"{spec.name}() got an unsupported argument '{name}': {why} ({spec.path}). "
                    f"Accepted arguments: query, key, value, {', '.join(spec.arguments)}")


def kernel_choice(backends: dict, platform: str, backend: str, call: Prepared):
    """The kernel set of a call on ``backend``, with the reasons; not recorded (`choose_kernels` records it). A
    backend that cannot run the call is a ValueError naming the function the user called (``call.op``)."""
    here = kernels.target()
    if platform == "auto":
        why = f"platform {backend}: auto on {here.arch or here.platform} (order {', '.join(auto_order(backends))})"
    else:
        why = f"platform {backend}: asked for"
    try:
        forward, backward, reasons, deterministic = backends[backend].choose(call.cfg)
    except kernels.Unsupported as e:
        raise ValueError(f"{call.op}(): platform '{backend}' cannot run this call: {e}") from None
    return kernels.KernelChoice(backend, forward, backward, deterministic, (why, call.why_algorithm) + tuple(reasons))


def choose_kernels(spec: SpecInfo, backends: dict, platform: str, backend: str, call: "Prepared"):
    """The kernel set of a call on ``backend``, with the reasons; recorded (debug log, ``explain``)."""
    return kernels.record(kernel_choice(backends, platform, backend, call), spec.name)


def _shape(x) -> str:
    return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"


def _array(op: str, name, x):
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise ValueError(f"{op}(): {name} must be an array, got {type(x).__name__}")
    return x


@dataclasses.dataclass(frozen=True)
class Prepared:
    """The call in the kernel layout (module docstring) and its static configuration."""

    op: str
    q: jax.Array
    k: jax.Array
    v: jax.Array
    gates: dict  # name -> float32 array, the gates the call passes
    h0: jax.Array | None  # [N, H, K, V] float32
    ctx: dict  # {"cu": int32 [N + 1]} with varlen
    cfg: RecurrentConfig
    why_algorithm: str

    def empty(self):
        """The result of a call without steps: o [B, 0, H, V] and the initial state (or zeros) as the final one."""
        c = self.cfg
        o = jnp.zeros((c.batch, 0, c.heads, c.dv), self.q.dtype)
        ht = self.h0 if self.h0 is not None else jnp.zeros((c.n_seqs, c.heads, c.dk, c.dv), jnp.float32)
        return o, ht


def _python_bool(op: str, name, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{op}(): {name} must be a Python bool, got {type(value).__name__}")
    return bool(value)


def chunked_gates(backend) -> tuple:
    """The gates a generated backend module's chunked kernels take (``CHUNKED_GATES``; all by default)."""
    return getattr(backend, "CHUNKED_GATES", GATES)


def _algorithm(op: str, algorithm, chunk_size, steps, passed, chunked) -> tuple:
    """(algorithm, chunk, why): auto takes the fused recurrence for at most FUSED_MAX_STEPS steps, or where the
    backend's chunked kernels do not take a gate the call passes."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{op}(): algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    if chunk_size is not None:
        ok = isinstance(chunk_size, (int, np.integer)) and not isinstance(chunk_size, (bool, np.bool_))
        if not ok or int(chunk_size) not in CHUNK_SIZES:
            raise ValueError(f"{op}(): chunk_size must be None or one of {', '.join(map(str, CHUNK_SIZES))} "
                             f"(steps of a chunk of the chunked algorithm), got {chunk_size!r}")
    chunk = DEFAULT_CHUNK if chunk_size is None else int(chunk_size)
    missing = [g for g in passed if g not in chunked]
    if missing and algorithm == "chunked":
        raise ValueError(f"{op}(): the chunked kernels of this platform take no {', '.join(missing)}: pass "
                         f"algorithm='fused' (or 'auto'), or another platform")
    if missing and algorithm == "auto":
        return "fused", 1, f"algorithm fused: auto, the chunked kernels of this platform take no {', '.join(missing)}"
    if algorithm == "auto":
        algorithm = "fused" if steps <= FUSED_MAX_STEPS else "chunked"
        why = (f"algorithm {algorithm}: auto, {steps} steps "
               f"({'at most' if algorithm == 'fused' else 'more than'} {FUSED_MAX_STEPS})")
    else:
        why = f"algorithm {algorithm}: asked for"
    if algorithm == "chunked":
        why += f", chunks of {chunk} steps"
    return algorithm, (chunk if algorithm == "chunked" else 1), why


def prepare(spec: SpecInfo, query, key, value, *, g=None, g_gamma=None, gk=None, gv=None, softmax_scale=None,
            initial_state=None, reverse=False, cu_seqlens=None, algorithm="auto", chunk_size=None,
            chunked=GATES, name=None) -> Prepared:
    """Check the call's arguments and bring them to the kernel layout (module docstring). ``chunked``: the gates the
    backend's chunked kernels take (`chunked_gates`); ``name``: the function the user called, for messages (the
    op's own name by default; ``<name>_cp`` for its context-parallel form)."""
    op = name or spec.name
    given = {"g": g, "g_gamma": g_gamma, "gk": gk, "gv": gv}
    for gate in spec.required:
        if given[gate] is None:
            raise TypeError(f"{op}() needs {gate}: the spec compiles gate '{gate}' in (always; {spec.path})")
    q, k, v = (_array(op, n, x) for n, x in (("query", query), ("key", key), ("value", value)))
    for arg, x in (("query", q), ("key", k), ("value", v)):
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{op}(): {arg} must be float32, bfloat16 or float16, got {_shape(x)}")
        if x.ndim != 4:
            raise ValueError(f"{op}(): {arg} must be [batch, seq_len, heads, head_dim], got {_shape(x)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{op}(): query, key and value must share one dtype, got {_shape(q)}, {_shape(k)}, "
                         f"{_shape(v)}")
    batch, steps, heads, dk = q.shape
    kv_heads, dv = k.shape[2], v.shape[3]
    if k.shape != (batch, steps, kv_heads, dk) or v.shape[:3] != (batch, steps, kv_heads):
        raise ValueError(f"{op}(): key must be [batch, seq_len, kv_heads, K] and value [batch, seq_len, "
                         f"kv_heads, V] with query's batch, seq_len and K = {dk}; got query {_shape(q)}, key "
                         f"{_shape(k)}, value {_shape(v)}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{op}(): query's {heads} heads must be a multiple of key and value's {kv_heads}")
    if kv_heads != heads and not spec.gqa:
        raise ValueError(f"{op}(): key and value have {kv_heads} heads, query {heads}: sharing key/value "
                         f"heads needs feature 'gqa' ({spec.path})")
    varlen = cu_seqlens is not None
    if varlen:
        if batch != 1:
            raise ValueError(f"{op}(): with cu_seqlens, query, key and value are packed sequences "
                             f"[1, total_tokens, heads, head_dim], got query {_shape(q)}")
        cu = _cu_seqlens(op, cu_seqlens, steps)
        n_seqs = cu.shape[0] - 1
    else:
        n_seqs = batch
    gates = {}
    expected = {"g": (batch, steps, heads), "g_gamma": (heads,), "gk": (batch, steps, heads, dk),
                "gv": (batch, steps, heads, dv)}
    for gate in GATES:
        x = given[gate]
        if x is None:
            continue
        x = _array(op, gate, x)
        if tuple(x.shape) != expected[gate] or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{op}(): {gate} must be float {GATE_SHAPES[gate]} = {list(expected[gate])} "
                             f"(log space), got {_shape(x)}")
        gates[gate] = x.astype(jnp.float32)
    h0 = None
    if initial_state is not None:
        h0 = _array(op, "initial_state", initial_state)
        want = (n_seqs, heads, dk, dv)
        if tuple(h0.shape) != want or not jnp.issubdtype(h0.dtype, jnp.floating):
            seqs = "sequences" if varlen else "batch"
            raise ValueError(f"{op}(): initial_state must be float [{seqs}, heads, K, V] = {list(want)}, got "
                             f"{_shape(h0)}")
        h0 = h0.astype(jnp.float32)
    if softmax_scale is None:
        scale = dk ** -0.5
    elif isinstance(softmax_scale, (int, float, np.integer, np.floating)) and not isinstance(softmax_scale, bool):
        scale = float(softmax_scale)
    else:
        raise ValueError(f"{op}(): softmax_scale must be None or a Python number, got "
                         f"{type(softmax_scale).__name__}")
    reverse = _python_bool(op, "reverse", reverse)
    algorithm, chunk, why = _algorithm(op, algorithm, chunk_size, steps, tuple(gates), chunked)
    cfg = RecurrentConfig(batch=batch, seq_len=steps, heads=heads, kv_heads=kv_heads, dk=dk, dv=dv, n_seqs=n_seqs,
                          varlen=varlen, reverse=reverse, gates=tuple(gates), initial_state=h0 is not None,
                          scale=scale, algorithm=algorithm, chunk=chunk, dtype=jnp.dtype(q.dtype).name,
                          products=_products(q.dtype))
    return Prepared(op, q, k, v, gates, h0, {"cu": cu} if varlen else {}, cfg, why)


def _products(dtype) -> str:
    """The chunk_products setting for inputs of ``dtype``: "bfloat16" (bf16 inputs under auto, or asked for 16-bit
    ones) or "tf32" (float32 inputs, whose kernels multiply in float32, read it as that too)."""
    asked = settings.current().chunk_products
    if jnp.dtype(dtype).itemsize != 2:
        return "tf32"
    if asked == "bfloat16" or (asked == "auto" and jnp.dtype(dtype) == jnp.bfloat16):
        return "bfloat16"
    return "tf32"


def primals(args):
    """``args``, (q, k, v, gates, h0, ctx) of the op's custom_vjp forward rule (``symbolic_zeros``: each array leaf a
    ``CustomVJPPrimal``), as (their values, whether the differentiation perturbs a scalar log gate)."""
    values = jax.tree.map(lambda p: p.value, args, is_leaf=_is_primal)
    return values, any(args[3][name].perturbed for name in SCALAR_LOG_GATES if name in args[3])


def _is_primal(x) -> bool:
    return isinstance(x, jax.custom_derivatives.CustomVJPPrimal)


def learned(cfg, perturbed: bool):
    """``cfg`` for the backward: the scalar log gates' gradients formed only where one of them is ``perturbed``
    (`primals`'); gates held fixed get zero cotangents, which JAX drops."""
    return dataclasses.replace(cfg, log_grads=perturbed)


def instantiated(cotangent):
    """A cotangent of the op's outputs as an array: a symbolic zero (the output unused) becomes zeros of its type,
    varying over the mesh axes it does (inside ``jax.shard_map``)."""
    if isinstance(cotangent, jax.custom_derivatives.SymbolicZero):
        aval = cotangent.aval
        return vma.vary(jnp.zeros(aval.shape, aval.dtype), vma.aval_axes(aval))
    return cotangent


def vary_alike(*trees):
    """The inputs of the op's ``custom_vjp``, each made to vary over every mesh axis any of them varies over
    (inside ``jax.shard_map``; outside, all is returned as it is): the kernels' results vary so."""
    return vma.vary(trees, vma.varying_axes(*trees))


def _cu_seqlens(op: str, cu, tokens):
    cu = _array(op, "cu_seqlens", cu)
    if cu.ndim != 1 or cu.dtype != jnp.int32 or cu.shape[0] < 2:
        raise ValueError(f"{op}(): cu_seqlens must be int32 [num_seqs + 1] (at least 2 entries), got "
                         f"{_shape(cu)}")
    try:
        values = np.asarray(cu)
    except jax.errors.TracerArrayConversionError:  # under jit: checked where it is concrete
        return jnp.asarray(cu)
    if values[0] != 0 or np.any(np.diff(values) < 0) or values[-1] > tokens:
        raise ValueError(f"{op}(): cu_seqlens must start at 0, never decrease and end at most at the "
                         f"{tokens} tokens of query, got {values.tolist()}")
    return jnp.asarray(cu)


def decode(spec: SpecInfo, op, query, key, value, state, gates: dict, softmax_scale, platform):
    """``<name>_decode``: one step (query [B, H, K]) or S steps ([B, S, H, K]) of ``op`` from ``state`` [B, H, K, V]:
    (o [B, (S,) H, V], new_state [B, H, K, V] float32), the train op with initial_state=state on the fused recurrence
    (forward and gradients as the train op's)."""
    name = f"{spec.name}_decode"
    q = _array(spec.name, "query", query)
    if q.ndim not in (3, 4):
        raise ValueError(f"{name}(): query must be [batch, heads, K] (one step) or [batch, steps, heads, K], got "
                         f"{_shape(q)}")
    if state is None:
        raise ValueError(f"{name}(): state is required: [batch, heads, K, V], the state before the step")
    one = q.ndim == 3
    steps = {"key": key, "value": value, **{g: x for g, x in gates.items() if g != "g_gamma"}}
    rank = {"key": 3, "value": 3, "g": 2, "gk": 3, "gv": 3}
    args = {}
    for arg, x in steps.items():
        if x is None:
            continue
        x = _array(spec.name, arg, x)
        want = rank[arg] + (0 if one else 1)
        if x.ndim != want:
            what = "one step: no steps axis" if one else "with the steps axis after batch"
            raise ValueError(f"{name}(): {arg} must have {want} dims ({what}, as query), got {_shape(x)}")
        args[arg] = x[:, None] if one else x
    if gates.get("g_gamma") is not None:
        args["g_gamma"] = gates["g_gamma"]
    key, value = args.pop("key"), args.pop("value")
    o, new_state = op(q[:, None] if one else q, key, value, **args, softmax_scale=softmax_scale, initial_state=state,
                      algorithm="fused", platform=platform)
    return (o[:, 0] if one else o), new_state
