"""The attention family's kernel sets (docs/DESIGN.md §6): what each serves and guarantees. Which one a
call takes is decided by the backend module of the op (``choose``) and recorded by
``ejgen.runtime.core.kernels``."""

from __future__ import annotations

from ejgen.runtime.core.kernels import KernelSet

KERNEL_SETS = {
    "triton": KernelSet(
        "triton", "triton", ("fwd", "bwd"),
        "Triton kernels generated from the spec: every feature, any head dim up to 256, f32/bf16/f16; "
        "deterministic unless a pinned or tuned dK/dV config says 'atomic'"),
    "gluon": KernelSet(
        "gluon", "triton", ("fwd",),
        "hand-written Hopper kernels (Gluon: warp-specialised, persistent): sm_90, bf16/f16, head dim 64 or "
        "128; causal, sliding windows (backward: none, or one with causal), segment ids, block layouts, a spec's "
        "mask that reads no params, a soft cap, sinks (joined outside the kernels); Sq == Sk, or Sq != Sk without "
        "masks (gluon_cross; the backward with gluon.host.CROSS_BACKWARD); no bias, dense mask, positions, varlen "
        "or score of a spec's own; dQ added by reduce-adds in run-time order"),
    "pallas": KernelSet(
        "pallas", "pallas", ("fwd", "bwd"),
        "Pallas kernels generated from the spec: GPUs through the Triton lowering, TPUs through Mosaic, "
        "interpreted elsewhere"),
    "xla": KernelSet("xla", "xla", ("fwd", "bwd"), "blockwise jnp (online softmax, flash-style backward), any device"),
}


def only(name: str, why: str):
    """``choose`` of a platform with one kernel set."""
    def choose(call, deterministic: bool):
        del call, deterministic
        return name, name, (f"forward and backward: {name} ({why})",)
    return choose
