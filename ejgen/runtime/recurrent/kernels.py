"""The linear recurrent family's kernel sets (docs/DESIGN.md §6): what each serves and guarantees. One set per
platform and algorithm (``chunked``: chunks of C steps, intra-chunk work as matrix products; ``fused``: one step at
a time, the state kept in float32 throughout)."""

from __future__ import annotations

from ejgen.runtime.core.kernels import KernelSet

KERNEL_SETS = {
    "triton_chunked": KernelSet(
        "triton_chunked", "triton", ("fwd", "bwd"),
        "Triton kernels generated from the spec: the states at chunk starts (a program per block of the state and "
        "sequence x head, over the chunks in order), then every chunk's output and gradients in parallel, its "
        "sub-chunks in turn; gates g, g_gamma, gk"),
    "triton_fused": KernelSet(
        "triton_fused", "triton", ("fwd", "bwd"),
        "Triton kernels generated from the spec: one pass over time per sequence x head x block of V, the state in "
        "float32 registers; every gate"),
    "pallas_chunked": KernelSet(
        "pallas_chunked", "pallas", ("fwd", "bwd"),
        "Pallas kernels: chunks of 16 steps in order per (row, head), the state carried in float32 (GPUs: Triton "
        "lowering; TPUs: Mosaic, VMEM scratch); gates g, g_gamma, gk; for either algorithm, except the fused "
        "algorithm's forward over dense calls on GPUs (decoding): a program per block of V and head, one step at a "
        "time, the state in float32 registers and updated in place"),
    "xla_chunked": KernelSet(
        "xla_chunked", "xla", ("fwd", "bwd"),
        "jnp: lax.scan over chunks, sub-chunk matrix products, gates summed from each chunk's start; the backward "
        "is JAX's derivative of the same scan"),
    "xla_fused": KernelSet(
        "xla_fused", "xla", ("fwd", "bwd"), "jnp: lax.scan over steps; the backward is JAX's derivative"),
}


def for_platform(platform: str, why: str):
    """``choose`` of a platform whose kernel sets are ``<platform>_<algorithm>``: (forward set, backward set,
    reasons, deterministic)."""
    def choose(cfg):
        name = f"{platform}_{cfg.algorithm}"
        return name, name, (f"forward and backward: {name} ({why})",), True
    return choose
