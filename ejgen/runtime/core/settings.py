"""Settings the user can see and change, read when an op is called (never at import).

Each has a default, an environment variable (read at call time) and a scoped override::

    with ejgen.ops.settings(deterministic=True):   # or EJGEN_DETERMINISTIC=1, or deterministic=True per call
        grads = jax.grad(loss)(params)

- ``deterministic`` (EJGEN_DETERMINISTIC, default off): bitwise-reproducible outputs and gradients on
  every backend; kernel sets whose backward adds in run-time order (the Hopper set's dQ) are not
  chosen (docs/DESIGN.md §6).
- ``gluon`` (EJGEN_GLUON, default on): the hand-written Hopper kernel set may be chosen on sm_90.
- ``gluon_spec_masks`` (EJGEN_GLUON_SPEC_MASKS, default on; ``0`` turns it off): calls of a spec with a mask of its
  own may take the Hopper set (the spec's mask on partial tiles), and segment ids under a window its backward on
  lists; off keeps them on the generated kernels. On since the GPU suite passed them (session 17, H100) and they
  measured faster (prefix LM forward+backward 3.02 -> 2.04 ms, NATTEN 2-D 2.25 -> 1.59 ms; BENCHMARKS.md).
- ``gluon_dynamic_tiles`` (EJGEN_GLUON_DYNAMIC_TILES: ``1`` / ``0`` / ``auto``, default auto): whether the Hopper
  forward's persistent programs take their tiles from a shared counter instead of a static split; auto (None)
  takes it where it was measured to win (`gluon.host.dynamic_tiles`).
- ``gluon_cross`` (EJGEN_GLUON_CROSS, default on; ``0`` turns it off): the Hopper forward also takes Sq != Sk
  (cross-attention without causal, a window, segment ids, a layout or a spec mask; the key count a constexpr of its
  own, SEQ_K). On since the GPU suite passed it (session 19, H100) and it measured 1.08-1.43x the generated kernels
  (BENCHMARKS.md).
- ``fast_tanh`` (EJGEN_FAST_TANH=1, default off): a soft cap's tanh is the hardware's tanh.approx.f32 (one MUFU
  operation an element instead of two) in calls whose forward and backward are both the Hopper set (read when the
  kernels are chosen, `KernelChoice.fast_tanh`; elsewhere the exact tanh): a capped logit is within about
  cap x 2^-11 of the exact one, and so is the lse (outputs stay within the dtype's tolerance; FlashAttention's soft
  cap takes the same instruction). H100 (session 20, one run): Gemma 2's forward 0.921 -> 0.671 ms; with the fast
  tanh the backward is the Hopper one (without it, the generated one: faster for the exact tanh).
- ``chunk_forward`` (EJGEN_CHUNK_FORWARD: ``two_pass`` / ``fused``, default two_pass): the linear recurrent chunked
  forward on Triton, two passes (the chunk states through memory) or one (`chunk_fused_fwd`, the state in registers;
  not the default until GPU-timed, docs/DESIGN.md §3).
- ``chunk_state_dtype`` (EJGEN_CHUNK_STATE_DTYPE: ``auto`` / ``float32`` / ``bfloat16``, default auto): the dtype in
  which the linear recurrent chunked forward on Triton (two passes) stores the state at each chunk's start for its
  output kernel; ``auto``: bfloat16 for 16-bit inputs, float32 for float32 ones. ``bfloat16``, as
  flash-linear-attention stores them for 16-bit inputs: half the bytes written and read back; float32's exponent
  range, so unnormalised sums that pass float16's 65504 stay finite. The state carried from chunk to chunk and the
  final state stay float32 (the backward's stored states follow ``chunk_products``). Each stored state is rounded to
  bf16 (2^-8 relative) before its product with q: 16-bit outputs stay within their dtype's tolerance (docs/DESIGN.md
  §3). H200 (session 22, one run): the forward of simple_gla 0.612 -> 0.551 ms, lightning 0.563 -> 0.475, gla 1.587
  -> 1.538 (B4 T4096, H 16, K = V = 128).
- ``chunk_gate_sums`` (EJGEN_CHUNK_GATE_SUMS: ``kernel`` / ``inline``, default kernel): with a key-side gate (gk per
  channel; g, g_gamma one a step), the linear recurrent chunked kernels on Triton read the sums of the log gates over
  each chunk's steps (prefix sums, sums after each step, the chunk's whole sum) from one kernel that forms them first
  (`chunk_sums`), or each scans the gates itself (``inline``, the form before session 22 for gk, session 23 for the
  scalar gates). The same sums either way (each a sum of its own
  steps); the scans cross warps, and in the state kernels' walks over the chunks they sat on the critical path.
- ``chunk_products`` (EJGEN_CHUNK_PRODUCTS: ``auto`` / ``tf32`` / ``bfloat16``, default auto): the operands of the
  linear recurrent chunked kernels' products with a float32 state or adjoint (q S, do Sᵀ, v S̄ᵀ, k S̄), for 16-bit
  inputs: rounded to TF32 (10 bits, to nearest) or to bf16
  (7 bits: flash-linear-attention's choice, the tensor cores' full rate and half the operand bytes); ``auto``: bf16
  for bf16 inputs, TF32 for f16 ones (a state past f16's range would not fit an f16 operand). Float32 inputs
  multiply in exact float32 either way. With bf16 products the backward stores the states and adjoints those kernels
  read in bf16 (the same products, half the bytes). Read when the op is called (the call's config carries it to the
  backward).
  Gradients and outputs stay within the dtype's tolerance either way (docs/DESIGN.md §3, linear recurrent).
- ``fused_value_blocks`` (EJGEN_FUSED_VALUE_BLOCKS: ``auto`` / ``fixed``, default auto): the linear recurrent fused
  forward on Triton (decode steps, short sequences) takes 64 value columns a program where its grid still gives every
  SM 16 programs, else 32 (``auto``: a decode step of B128, H 16, K = V = 128 streams its state at 83% of the copy
  rate against 77%, H200, session 29), or 32 always (``fixed``). The state is the same either way; a step's output
  sums q ⊙ S over K in an order the block decides, so with ``auto`` it can differ in its last bits between batch sizes
  (or GPUs with other SM counts): ``fixed`` makes a sequence's output bitwise the same whatever else is in the batch.
- ``triton_configs`` (EJGEN_TRITON_CONFIG, e.g. ``"fwd=128,64,8,3;dkdv=64,128,8,3"``): pinned Triton
  configs per pass (tuning, tests); a pinned pass never takes the Hopper set.
- ``triton_autotune`` (EJGEN_TRITON_AUTOTUNE=1): jax-triton's autotuner over `ejgen tune`'s candidates.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Settings:
    deterministic: bool = False
    gluon: bool = True
    gluon_spec_masks: bool = True
    gluon_dynamic_tiles: bool | None = None  # None: auto
    gluon_cross: bool = True
    fast_tanh: bool = False
    chunk_forward: str = "two_pass"
    chunk_state_dtype: str = "auto"
    chunk_gate_sums: str = "kernel"
    chunk_products: str = "auto"
    fused_value_blocks: str = "auto"
    triton_configs: str = ""
    triton_autotune: bool = False


_ENV = {
    "deterministic": ("EJGEN_DETERMINISTIC", lambda t: t.strip().lower() in ("1", "true", "yes", "on")),
    "gluon": ("EJGEN_GLUON", lambda t: t.strip().lower() not in ("0", "false", "no", "off")),
    "gluon_spec_masks": ("EJGEN_GLUON_SPEC_MASKS", lambda t: t.strip().lower() not in ("0", "false", "no", "off")),
    "gluon_dynamic_tiles": ("EJGEN_GLUON_DYNAMIC_TILES", lambda t: _on_off_auto("EJGEN_GLUON_DYNAMIC_TILES", t)),
    "gluon_cross": ("EJGEN_GLUON_CROSS", lambda t: t.strip().lower() not in ("0", "false", "no", "off")),
    "fast_tanh": ("EJGEN_FAST_TANH", lambda t: t.strip().lower() in ("1", "true", "yes", "on")),
    "chunk_forward": ("EJGEN_CHUNK_FORWARD", lambda t: _one_of("EJGEN_CHUNK_FORWARD", t, WORDS["chunk_forward"])),
    "chunk_state_dtype": ("EJGEN_CHUNK_STATE_DTYPE",
                          lambda t: _one_of("EJGEN_CHUNK_STATE_DTYPE", t, WORDS["chunk_state_dtype"])),
    "chunk_gate_sums": ("EJGEN_CHUNK_GATE_SUMS",
                        lambda t: _one_of("EJGEN_CHUNK_GATE_SUMS", t, WORDS["chunk_gate_sums"])),
    "chunk_products": ("EJGEN_CHUNK_PRODUCTS",
                       lambda t: _one_of("EJGEN_CHUNK_PRODUCTS", t, WORDS["chunk_products"])),
    "fused_value_blocks": ("EJGEN_FUSED_VALUE_BLOCKS",
                           lambda t: _one_of("EJGEN_FUSED_VALUE_BLOCKS", t, WORDS["fused_value_blocks"])),
    "triton_configs": ("EJGEN_TRITON_CONFIG", str),
    "triton_autotune": ("EJGEN_TRITON_AUTOTUNE", lambda t: t.strip() == "1"),
}


def _on_off_auto(var: str, text: str) -> bool | None:
    """A tri-state variable's value: on (True), off (False) or auto (None, also empty)."""
    word = text.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    if word in ("", "auto"):
        return None
    raise ValueError(f"ejgen settings: {var}={text!r}: expected 1, 0 or auto")


WORDS = {"chunk_forward": ("two_pass", "fused"), "chunk_state_dtype": ("auto", "float32", "bfloat16"),
         "chunk_gate_sums": ("kernel", "inline"), "chunk_products": ("auto", "tf32", "bfloat16"),
         "fused_value_blocks": ("auto", "fixed")}
"""The settings that take one of a few words: the words, by setting."""


def _one_of(var: str, text: str, words: tuple) -> str:
    """A variable naming one of ``words``."""
    word = text.strip().lower()
    if word not in words:
        raise ValueError(f"ejgen settings: {var}={text!r}: expected one of {', '.join(words)}")
    return word


_OVERRIDES: contextvars.ContextVar = contextvars.ContextVar("ejgen_settings", default=())


def current() -> Settings:
    """The settings in force: scoped overrides, else the environment, else the defaults."""
    values = {}
    for field, (var, parse) in _ENV.items():
        text = os.environ.get(var)
        if text is not None:
            values[field] = parse(text)
    for changes in _OVERRIDES.get():
        values.update(changes)
    return Settings(**values)


@contextlib.contextmanager
def settings(**changes):
    """Override settings inside a ``with`` block (this thread / context only)."""
    known = {f.name: f.type for f in dataclasses.fields(Settings)}
    changes = dict(changes)
    for name, value in changes.items():
        if name not in known:
            raise TypeError(f"ejgen settings: unknown setting {name!r} (known: {', '.join(known)})")
        if name in WORDS:
            changes[name] = _one_of(name, value if isinstance(value, str) else repr(value), WORDS[name])
            continue
        want = str if name == "triton_configs" else bool
        if not (isinstance(value, want) or (value is None and name == "gluon_dynamic_tiles")):
            also = " or None (auto)" if name == "gluon_dynamic_tiles" else ""
            raise TypeError(f"ejgen settings: {name} must be a {want.__name__}{also}, got {value!r}")
    token = _OVERRIDES.set(_OVERRIDES.get() + (changes,))
    try:
        yield current()
    finally:
        _OVERRIDES.reset(token)


def deterministic(per_call: bool | None) -> bool:
    """An op's ``deterministic=`` argument (None: the setting in force)."""
    if per_call is None:
        return current().deterministic
    if not isinstance(per_call, bool):
        raise ValueError(f"deterministic must be None or a Python bool, got {per_call!r}")
    return per_call
