"""Launching a Triton kernel from JAX: jax-triton on CUDA, Triton's interpreter on the CPU.

On the CPU the kernel runs inside ``jax.pure_callback`` on torch CPU tensors, so the very kernel
source that runs on the GPU is what CI executes. That needs TRITON_INTERPRET=1 in the environment
before the kernels are imported (Triton decides at decoration time) and torch installed.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def mode() -> tuple[str | None, str]:
    """("gpu" | "interpret" | None, why not when None)."""
    if not _has("triton"):
        return None, "triton is not installed (pip install 'ejgen[gpu]')"
    if jax.default_backend() == "gpu":
        if not _has("jax_triton"):
            return None, "jax-triton is not installed (pip install 'ejgen[gpu]')"
        return "gpu", ""
    if os.environ.get("TRITON_INTERPRET") == "1":
        if not _has("torch"):
            return None, "Triton's interpreter needs torch (pip install torch==2.13.0 for a CPU build)"
        return "interpret", ""
    return None, ("no NVIDIA GPU is visible to JAX; to run the Triton kernels in Triton's interpreter on "
                  "the CPU, set TRITON_INTERPRET=1 before starting Python")


def available() -> tuple[bool, str]:
    how, why = mode()
    return how is not None, why


def launch(kernel, grid, inputs, out_shapes, *, zeroed=(), num_warps=4, num_stages=2, **constexprs):
    """Run ``kernel[grid](*inputs, *outputs, **constexprs)``; returns the outputs as a list."""
    how, why = mode()
    if how == "gpu":
        import jax_triton as jt

        outs = jt.triton_call(*inputs, kernel=kernel, out_shape=out_shapes, grid=grid, num_warps=num_warps,
                              num_stages=num_stages, zeroed_outputs=tuple(zeroed), **constexprs)
        return list(outs)
    if how == "interpret":
        call = functools.partial(_interpret, kernel, grid, tuple(out_shapes), constexprs)
        return list(jax.pure_callback(call, tuple(out_shapes), *inputs, vmap_method="sequential"))
    raise RuntimeError(f"the triton backend cannot run here: {why}")


def _to_torch(x):
    import torch

    x = np.asarray(x)
    if x.dtype == jnp.bfloat16:
        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    if x.dtype == np.bool_:
        return torch.from_numpy(x.astype(np.int8))
    return torch.from_numpy(x.copy())


def _torch_dtype(dtype):
    import torch

    return {
        np.dtype(np.float32): torch.float32,
        np.dtype(np.float16): torch.float16,
        np.dtype(jnp.bfloat16): torch.bfloat16,
        np.dtype(np.int32): torch.int32,
    }[np.dtype(dtype)]


def _to_numpy(t, dtype):
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(jnp.bfloat16)
    return t.numpy().astype(dtype, copy=False)


def _interpret(kernel, grid, out_shapes, constexprs, *arrays):
    import torch

    inputs = [_to_torch(a) for a in arrays]
    outputs = [torch.zeros(s.shape, dtype=_torch_dtype(s.dtype)) for s in out_shapes]
    kernel[grid](*inputs, *outputs, **constexprs)
    return tuple(_to_numpy(o, s.dtype) for o, s in zip(outputs, out_shapes))
