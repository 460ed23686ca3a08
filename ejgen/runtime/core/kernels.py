"""Kernel sets, and which one a call takes: declared, visible, controllable (docs/DESIGN.md §6).

A *kernel set* is a group of kernels that serve one ``platform=`` value, with what it supports:
generated per spec (``triton``, ``pallas``, ``xla``) or written by hand for one GPU generation
(``gluon``, Hopper). Every op call ends in a ``KernelChoice`` — the platform, the set that runs the
forward and the one that runs the backward, whether the call is deterministic, and one line per
decision saying why. The choice is made once per call, logged at debug level on the ``ejgen``
logger, and passed to the kernels as a static argument, so the backward runs what was chosen.

``explain(op, *args, **kwargs)`` returns the choice without running anything; with
``target="sm90"`` (or ``"sm80"``, ``"tpu"``, ``"cpu"``) it answers for that machine from any
other (``ejgen show --call`` is the same from the command line).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging

import jax
import numpy as np

log = logging.getLogger("ejgen")


@dataclasses.dataclass(frozen=True)
class KernelSet:
    name: str
    platform: str  # the ``platform=`` value that reaches it
    deterministic: tuple  # passes ("fwd", "bwd") that are bitwise reproducible run to run
    summary: str


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    platform: str
    forward: str  # kernel set of the forward pass
    backward: str  # kernel set of the backward pass
    deterministic: bool
    reasons: tuple = dataclasses.field(default=(), compare=False)
    # a soft cap's tanh as the hardware's approximation in both passes (the fast_tanh setting where both are the
    # Hopper set): decided once, with the kernels, so the backward traced later under other settings still agrees
    fast_tanh: bool = False

    def text(self) -> str:
        lines = [f"platform {self.platform}: forward {self.forward}, backward {self.backward}"
                 f"{' (deterministic)' if self.deterministic else ''}"]
        return "\n".join(lines + [f"  - {r}" for r in self.reasons])


@dataclasses.dataclass(frozen=True)
class Target:
    """The machine a choice is made for: ``platform`` as ``jax.default_backend()`` names it, and
    for GPUs the architecture (``"sm90"``)."""

    platform: str
    arch: str | None = None
    simulated: bool = False  # asked for by `explain`, not the machine this runs on


TARGETS = {
    "cpu": Target("cpu", None, True),
    "sm80": Target("gpu", "sm80", True),
    "sm90": Target("gpu", "sm90", True),
    "tpu": Target("tpu", None, True),
}
_TARGET: contextvars.ContextVar = contextvars.ContextVar("ejgen_target", default=None)
_EXPLAIN: contextvars.ContextVar = contextvars.ContextVar("ejgen_explain", default=None)


def target() -> Target:
    """The machine calls run on, or the one `explain` was asked about."""
    override = _TARGET.get()
    if override is not None:
        return override
    platform = jax.default_backend()
    if platform != "gpu":
        return Target(platform)
    capability = str(getattr(jax.devices("gpu")[0], "compute_capability", ""))
    return Target("gpu", "sm" + capability.replace(".", "") if capability else None)


class Unsupported(Exception):
    """Raised by a backend's ``choose`` for a call none of its kernel sets can run; the op turns it into one
    ValueError that names the op, the platform and why."""


class _Explained(Exception):
    pass


def record(choice: KernelChoice, op: str) -> KernelChoice:
    """Log the choice; under `explain`, hand it over and stop the call before any kernel is traced."""
    log.debug("%s: %s", op, choice.text())
    box = _EXPLAIN.get()
    if box is not None:
        box.append(choice)
        raise _Explained()
    return choice


def explain(op, *args, target: str | None = None, **kwargs) -> KernelChoice:
    """Which platform and kernel sets ``op(*args, **kwargs)`` takes, and why; nothing runs (inputs may
    be ``jax.ShapeDtypeStruct``). ``target``: answer for another machine (one of ``TARGETS``)."""
    if target is not None and target not in TARGETS:
        raise ValueError(f"explain: target must be one of {', '.join(TARGETS)}, got {target!r}")
    leaves, tree = jax.tree.flatten((args, kwargs))
    traced = [isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) for x in leaves]

    def call(*arrays):  # arrays (and their stand-ins) traced, everything else as given: flags stay Python values
        it = iter(arrays)
        a, kw = jax.tree.unflatten(tree, [next(it) if t else x for x, t in zip(leaves, traced)])
        return op(*a, **kw)

    box: list = []
    with _scoped(_EXPLAIN, box), _scoped(_TARGET, TARGETS[target] if target else None):
        try:
            jax.eval_shape(call, *[x for x, t in zip(leaves, traced) if t])
        except _Explained:
            pass
    if not box:
        raise RuntimeError(f"explain: {getattr(op, '__name__', op)!r} made no kernel choice (not an ejgen op?)")
    return box[0]


@contextlib.contextmanager
def _scoped(var: contextvars.ContextVar, value):
    if value is None and var is _TARGET:
        yield
        return
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)
