"""Which Pallas kernels run where, for every family: the GPU kernels (Triton lowering) when lowering for CUDA or
ROCm, the TPU kernels (Mosaic) for TPUs, and on any other platform the ones ``interpret_kernels`` names, run
interpreted (tests: both kernel families run on a CPU). One traced op: ``jax.export`` for any of these platforms
works from any machine."""

from __future__ import annotations

import contextlib
import contextvars
import functools

from jax import lax

from ejgen.runtime.core import vma

KERNELS = ("gpu", "tpu")

_INTERPRET = contextvars.ContextVar("ejgen_pallas_interpret", default=("gpu", True))


def available():
    """Pallas runs on GPUs (Triton lowering), TPUs (Mosaic) and, interpreted, anywhere else."""
    return True, ""


@contextlib.contextmanager
def interpret_kernels(which: str, interpret=True):
    """Which kernels ``platform="pallas"`` interprets where there is no GPU or TPU: ``"gpu"`` (the
    default) or ``"tpu"``, and how: ``interpret`` is what ``pallas_call`` gets, True (JAX's HLO
    interpreter) or, for the TPU kernels, a ``pltpu.InterpretParams`` (the TPU interpreter, which
    also models DMAs and poisons uninitialised memory). Read when the op is traced, so a function
    jitted before keeps its choice. For tests: both kernel families run on a CPU."""
    if which not in KERNELS:
        raise ValueError(f"interpret_kernels: which must be one of {', '.join(KERNELS)}, got {which!r}")
    token = _INTERPRET.set((which, interpret))
    try:
        yield
    finally:
        _INTERPRET.reset(token)


def dispatch(gpu, tpu, *args):
    """``gpu(*args, interpret=False)`` when lowering for CUDA or ROCm, ``tpu(...)`` for TPUs, and
    on every other platform the kernels chosen by ``interpret_kernels``, interpreted.
    One traced op: ``jax.export`` for any of these platforms works from any machine."""
    which, interpret = _INTERPRET.get()
    on_gpu = functools.partial(gpu, interpret=False)  # one branch for CUDA and ROCm
    return lax.platform_dependent(
        *args,
        cuda=on_gpu,
        rocm=on_gpu,
        tpu=functools.partial(tpu, interpret=False),
        default=_interpreted(functools.partial(gpu if which == "gpu" else tpu, interpret=interpret)),
    )


def _interpreted(kernels):
    """``kernels`` run interpreted. Inside ``jax.shard_map`` Pallas's interpreters evaluate the kernel, traced for
    blocks that vary over no mesh axis, on blocks that do, and JAX's loop check refuses the kernel's loops; so the
    inputs reach them typed invariant (``vma.erase``, a host copy: interpreters run in tests) and the outputs get
    the inputs' axes back. Outside shard_map this is ``kernels`` itself."""

    def run(*args):
        axes = vma.varying_axes(args)
        if not axes:
            return kernels(*args)
        return vma.vary(kernels(*vma.erase(args)), axes)

    return run
