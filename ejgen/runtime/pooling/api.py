"""What every generated pooling op does before and after its kernels (docs/DESIGN.md §3 pooling): check the
arguments, bring them to the kernel layout, and undo it on the way out.

Kernel layout: x [T, D] (a dense [B, S, D] is B sequences of S rows), a per-token weight w [T] float32 (the
weights times the mask; for max the mask as 0 / 1; None when the call has neither), and per sequence n the rows
[lo[n], hi[n]) that it pools: ``ctx`` holds ``cu``, ``lo`` and ``hi`` where they are known only at run time
(varlen, a masked last token), else ``work.ranges`` makes them from the config as NumPy constants. Everything
here is plain jnp outside the op's ``custom_vjp``, so autodiff carries the weights' gradient through the mask.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ejgen.runtime.core import kernels, vma
from ejgen.runtime.core.platforms import auto_order, choose_platform  # noqa: F401 (the generated ops call it here)
from ejgen.runtime.pooling.config import PoolingConfig

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
CHUNK_SIZES = tuple(2 ** i for i in range(10))  # 1 .. 512 tokens per tile


@dataclasses.dataclass(frozen=True)
class SpecInfo:
    """What a generated pooling op knows of its spec, for messages and argument checks."""

    name: str
    path: str
    reduction: str  # mean | sum | max | last
    features: dict  # feature -> "runtime" | "always"
    arguments: dict  # keyword argument -> the feature (or "call") that brings it
    absent: dict = dataclasses.field(default_factory=dict)  # built-in argument the op does not take -> its feature
    required: tuple = ()  # arguments the spec compiles in (`always`): None is refused

    @property
    def kind(self) -> str:
        return "max" if self.reduction == "max" else "sum"


def reject_unsupported(spec: SpecInfo, unsupported: dict) -> None:
    if not unsupported:
        return
    name = sorted(unsupported)[0]
    if name in spec.absent:
        why = f"the spec does not enable feature '{spec.absent[name]}'"
    else:
        why = "it is not an argument of a pooling op"
    raise TypeError(f"{spec.name}() got an unsupported argument '{name}': {why} ({spec.path}). "
                    f"Accepted arguments: x, {', '.join(spec.arguments)}")


def choose_kernels(spec: SpecInfo, backends: dict, platform: str, backend: str, call: "Prepared"):
    """The kernel set of a call on ``backend``, with the reasons; recorded (debug log, ``explain``)."""
    here = kernels.target()
    if platform == "auto":
        why = f"platform {backend}: auto on {here.arch or here.platform} (order {', '.join(auto_order(backends))})"
    else:
        why = f"platform {backend}: asked for"
    forward, backward, reasons, deterministic = backends[backend].choose(call.cfg)
    choice = kernels.KernelChoice(backend, forward, backward, deterministic, (why,) + tuple(reasons))
    return kernels.record(choice, spec.name)


def _shape(x) -> str:
    return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"


def _array(spec, name, x):
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise ValueError(f"{spec.name}(): {name} must be an array, got {type(x).__name__}")
    return x


@dataclasses.dataclass(frozen=True)
class Prepared:
    """The call in the kernel layout: x [T, D], w [T] float32 or None, ctx {"lo", "hi"[, "cu"]} int32."""

    op: str
    x: jax.Array
    w: jax.Array | None
    ctx: dict
    cfg: PoolingConfig

    def empty(self):
        """The result when there is no token at all: zeros [N, D]."""
        return jnp.zeros((self.cfg.n_seqs, self.cfg.dim), self.x.dtype)


def check_chunk_size(spec: SpecInfo, chunk_size) -> int:
    """chunk_size: the kernels' token tile (rows per load, a power of two: Triton's and Pallas's tiles are)."""
    ok = isinstance(chunk_size, (int, np.integer)) and not isinstance(chunk_size, (bool, np.bool_))
    if not ok or int(chunk_size) not in CHUNK_SIZES:
        raise ValueError(f"{spec.name}(): chunk_size must be a Python int, a power of two from 1 to {CHUNK_SIZES[-1]} "
                         f"(the kernels' tile of tokens), got {chunk_size!r}")
    return int(chunk_size)


def prepare(spec: SpecInfo, x, *, chunk_size, cu_seqlens=None, weights=None, mask=None) -> Prepared:
    """Check the call's arguments and bring them to the kernel layout (module docstring)."""
    for name in spec.required:
        if {"cu_seqlens": cu_seqlens, "weights": weights, "mask": mask}[name] is None:
            feature = spec.arguments[name]
            raise TypeError(f"{spec.name}() needs {name}: the spec compiles feature '{feature}' in (always; "
                            f"{spec.path})")
    chunk = check_chunk_size(spec, chunk_size)
    x = _array(spec, "x", x)
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{spec.name}(): x must be float32, bfloat16 or float16, got {_shape(x)}")
    varlen = cu_seqlens is not None
    if varlen:
        if x.ndim != 2:
            raise ValueError(f"{spec.name}(): with cu_seqlens, x must be packed tokens [total_tokens, dim], got "
                             f"{_shape(x)}")
        tokens, dim = x.shape
        cu = _cu_seqlens(spec, cu_seqlens, tokens)
        n_seqs, seq_len, lead = cu.shape[0] - 1, 0, (tokens,)
        lo, hi = cu[:-1], cu[1:]
    else:
        if x.ndim != 3:
            extra = " (packed [total_tokens, dim] tokens need cu_seqlens)" if x.ndim == 2 else ""
            raise ValueError(f"{spec.name}(): x must be [batch, seq_len, dim]{extra}, got {_shape(x)}")
        n_seqs, seq_len, dim = x.shape
        tokens, lead = n_seqs * seq_len, (n_seqs, seq_len)
        lo = np.arange(n_seqs, dtype=np.int32) * seq_len  # static: not in ctx (work.ranges makes them again)
        hi = lo + seq_len
        x = x.reshape(tokens, dim)
    where = "[total_tokens]" if varlen else "[batch, seq_len]"
    if weights is not None:
        weights = _array(spec, "weights", weights)
        if weights.shape != lead or not jnp.issubdtype(weights.dtype, jnp.floating):
            raise ValueError(f"{spec.name}(): weights must be float {where} = {list(lead)}, got {_shape(weights)}")
        weights = weights.reshape(tokens)
    if mask is not None:
        mask = _array(spec, "mask", mask)
        if mask.shape != lead or mask.dtype != jnp.bool_:
            raise ValueError(f"{spec.name}(): mask must be bool {where} = {list(lead)}, got {_shape(mask)}")
        mask = mask.reshape(tokens)
    cfg = PoolingConfig(kind=spec.kind, scaled=spec.reduction == "mean", weighted=False,
                        weight_grad=weights is not None, ranged=spec.reduction == "last", varlen=varlen,
                        n_seqs=n_seqs, tokens=tokens, dim=dim, seq_len=seq_len, chunk=chunk)
    ctx = {"cu": cu, "lo": lo, "hi": hi} if varlen else {}
    w = None
    if spec.reduction == "last":
        if varlen or mask is not None:
            ctx["lo"], ctx["hi"] = _last_token(lo, hi, mask, tokens)
    elif weights is not None or mask is not None:
        w = jnp.ones((tokens,), jnp.float32) if weights is None else weights.astype(jnp.float32)
        if mask is not None:
            w = jnp.where(mask, w, 0.0)
    cfg = dataclasses.replace(cfg, weighted=w is not None)
    return Prepared(spec.name, x, w, ctx, cfg)


def vary_alike(x, w, ctx):
    """The inputs of the op's ``custom_vjp``, each made to vary over every mesh axis any of them varies over
    (inside ``jax.shard_map``; outside, all is returned as it is): the kernels' results vary so."""
    return vma.vary((x, w, ctx), vma.varying_axes(x, w, ctx))


def _cu_seqlens(spec, cu, tokens):
    cu = _array(spec, "cu_seqlens", cu)
    if cu.ndim != 1 or cu.dtype != jnp.int32 or cu.shape[0] < 2:
        raise ValueError(f"{spec.name}(): cu_seqlens must be int32 [num_seqs + 1] (at least 2 entries), got "
                         f"{_shape(cu)}")
    try:
        values = np.asarray(cu)
    except jax.errors.TracerArrayConversionError:  # under jit: checked where it is concrete
        return jnp.asarray(cu)
    if values[0] != 0 or np.any(np.diff(values) < 0) or values[-1] > tokens:
        raise ValueError(f"{spec.name}(): cu_seqlens must start at 0, never decrease and end at most at the "
                         f"{tokens} tokens of x, got {values.tolist()}")
    return jnp.asarray(cu)


def _last_token(lo, hi, mask, tokens):
    """Per sequence, the one-row range [t, t + 1) of its last pooled token (the last one, or the last the mask
    keeps); an empty range [lo, lo) where there is none."""
    if mask is None:
        some = hi > lo
        return jnp.where(some, hi - 1, lo), jnp.where(some, hi, lo)
    latest = lax.cummax(jnp.where(mask, jnp.arange(tokens, dtype=jnp.int32), -1))  # last kept token up to t
    last = jnp.where(hi > lo, latest[jnp.maximum(jnp.asarray(hi) - 1, 0)], -1)
    some = last >= lo
    return jnp.where(some, last, lo), jnp.where(some, last + 1, lo)

