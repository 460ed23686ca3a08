"""The pooling family's kernel sets (docs/DESIGN.md §6): what each serves and guarantees. Every pooling kernel
reduces in a fixed order (work items combined in sequence order, no atomics), so every set is deterministic; the
xla set's packed path is a scatter, in run-time order on GPUs."""

from __future__ import annotations

from ejgen.runtime.core.kernels import KernelSet

KERNEL_SETS = {
    "triton": KernelSet(
        "triton", "triton", ("fwd", "bwd"),
        "Triton kernels generated from the spec: float32 partial sums (or max and argmax) of work items of at most "
        "a few thousand tokens by blocks of columns, combined per sequence; a token-parallel backward"),
    "pallas": KernelSet(
        "pallas", "pallas", ("fwd", "bwd"),
        "Pallas kernels: the Triton kernels' work items on GPUs (Triton lowering), blocks of tokens by sequence "
        "on TPUs (Mosaic), interpreted elsewhere"),
    "xla": KernelSet("xla", "xla", ("fwd", "bwd"), "jnp reductions (dense) and segment ops (packed, last token)"),
}


def only(name: str, why: str):
    """``choose`` of a platform with one kernel set: (forward set, backward set, reasons, deterministic)."""
    def choose(cfg):
        del cfg
        return name, name, (f"forward and backward: {name} ({why})",), True
    return choose
