"""flash_attention against the float64 oracle (docs/DESIGN.md §3, §7): backend x features x shapes x
dtypes, outputs, lse and every gradient, under jax.jit and jax.vjp / jax.grad.

The cases are a pairwise covering design (``SUITE``, on the conformance base of ``tests/conformance.py``)
over the features (mask structure, soft cap, scale, sinks, bias, segment ids or a dense mask), the shapes
(``ejgen.testing.shapes``: GQA / MQA / MHA, odd lengths, Sq != Sk, S = 1, varlen with empty sequences,
Dv != D) and the dtypes: every level of every factor meets every level of every other on every backend (the
interpreters without a GPU: the few of those cases that hold every level, `conformance.Suite.rows`), and every
level runs on a shape of two tiles or more on both axes of that backend;
``test_the_collected_cases_cover_the_design`` checks it on what pytest collected. ``EJGEN_FULL_SUITE=1``
runs every backend on every shape, every pair. On the GPU host the shapes reach the GPU tiles and the Hopper kernels
(``GPU_SHAPES``), head dims 96-256 run, and every triton case asserts which kernels it launched.
Large-logit cases (scores to +-200, a soft cap far exceeded, dominant sinks) run on every backend, with
a tolerance widened by the scores' float32 rounding (``oracle.tolerance``).
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conformance
import oracle
from conftest import ACCELERATOR_BACKENDS, BACKENDS, ON_GPU
from oracle import TOLERANCE, assert_close
from ejgen.testing.shapes import (
    GPU_SHAPES,
    GQA_SHAPES,
    INTERPRETER_SHAPES,
    MHA_SHAPES,
    WIDE_SHAPE,
    XLA_SHAPES,
    DTYPE_IDS,
    AttnShape,
    VarlenShape,
    packed_segments,
    random_cotangents,
    random_mask,
    random_qkv,
    random_sinks,
    rng_for,
)

pytestmark = pytest.mark.usefixtures("x64_stays_off")

def _flash_attention():
    # Imported here so the suite collects while the op is being written.
    from ejgen.ops import flash_attention

    return flash_attention


def _mask_info():
    from ejgen.types import MaskInfo

    return MaskInfo


@dataclasses.dataclass(frozen=True)
class Features:
    """One combination of flash_attention's built-in features."""

    causal: bool = False
    window: int | tuple | None = None
    soft_cap: float | None = None
    scale: float | None = None  # softmax_scale; None = 1/sqrt(D)
    sinks: str | None = None  # "h": [Hq], "hn": [Hq, 2], "n": [Hq + 1] shared by all heads
    bias: str | None = None  # "bhqk" full, or broadcast "1hqk", "b1qk", "11qk"
    segments: str | None = None  # "packed": contiguous runs, -1 padding at the end; "random"
    mask: str | None = None  # dense mask "bqk" [B, Sq, Sk], "b1qk", "bhqk"
    logits: float | None = None  # softmax_scale set so that the largest |scale * q.k| is this
    sink_margin: float | None = None  # sinks this far above `logits` (plus N(0, 1)): they dominate

    def __post_init__(self):
        assert not (self.segments and self.mask), "a MaskInfo holds segments or a dense mask"
        assert not (self.logits and self.scale), "logits sets softmax_scale"
        assert self.sink_margin is None or (self.sinks and self.logits), "sink_margin: sinks over logits"

    @property
    def id(self) -> str:
        parts = ["causal"] if self.causal else []
        if self.window is not None:
            w = self.window
            parts.append(f"win{w}" if isinstance(w, int) else f"win{w[0]},{w[1]}")
        if self.soft_cap is not None:
            parts.append(f"cap{self.soft_cap:g}")
        if self.scale is not None:
            parts.append(f"scale{self.scale:g}")
        if self.logits is not None:
            parts.append(f"logits{self.logits:g}")
        for name in ("sinks", "bias", "segments", "mask"):
            if getattr(self, name):
                parts.append(f"{name[:4] if name != 'segments' else 'seg'}_{getattr(self, name)}")
        if self.sink_margin is not None:
            parts.append(f"over{self.sink_margin:g}")
        return "-".join(parts) or "plain"

    @property
    def atoms(self) -> set:
        """The features besides causal and window."""
        names = {"soft_cap": self.soft_cap, "sinks": self.sinks, "bias": self.bias}
        names.update(segments=self.segments, mask=self.mask)
        return {n for n, v in names.items() if v is not None}


@dataclasses.dataclass(frozen=True)
class Case:
    features: Features
    shape: AttnShape | VarlenShape
    dtype: str = "float32"

    @property
    def id(self) -> str:
        return f"{self.features.id}-{self.shape.id}-{DTYPE_IDS[self.dtype]}"


CAP = dict(soft_cap=2.0, scale=0.5)  # scale 0.5 with D >= 16 makes logits large enough to cap

# -- the design -------------------------------------------------------------------------------------
# Mask structure: (causal, sliding_window); a window as an int is symmetric; with causal the right
# bound is 0.
STRUCTURES = {
    "none": (False, None), "causal": (True, None), "win16": (False, 16), "win8,4": (False, (8, 4)),
    "win0,0": (False, (0, 0)), "causal-win20,7": (True, (20, 7)),
}
MASKS = {  # MaskInfo: segment ids (packed runs with padding, or random with -1) or a dense mask
    None: {}, "seg_packed": {"segments": "packed"}, "seg_random": {"segments": "random"},
    "mask_bqk": {"mask": "bqk"}, "mask_b1qk": {"mask": "b1qk"}, "mask_bhqk": {"mask": "bhqk"},
}
ALL_SHAPES = INTERPRETER_SHAPES + XLA_SHAPES + (WIDE_SHAPE,) + (GPU_SHAPES if ON_GPU else ())

FACTORS = {
    "structure": tuple(STRUCTURES),
    "soft_cap": (None, 2.0),
    "scale": (None, 0.5),
    "sinks": (None, "h", "hn", "n"),
    "bias": (None, "bhqk", "1hqk", "b1qk", "11qk"),
    "mask": tuple(MASKS),
    "shape": ALL_SHAPES,
    "dtype": ("float32", "bfloat16", "float16"),
}


def _valid(row: dict) -> bool:
    """Varlen calls take no bias and no MaskInfo (the packing is the mask)."""
    varlen = isinstance(row.get("shape"), VarlenShape)
    return not (varlen and (row.get("bias") or row.get("mask")))


def _make_case(row: dict) -> Case:
    causal, window = STRUCTURES[row["structure"]]
    features = Features(causal=causal, window=window, soft_cap=row["soft_cap"], scale=row["scale"],
                        sinks=row["sinks"], bias=row["bias"], **MASKS[row["mask"]])
    return Case(features, row["shape"], row["dtype"])


def _lengths(shape) -> tuple:
    if isinstance(shape, VarlenShape):  # the kernels tile each sequence
        return shape.max_seqlen_q, shape.max_seqlen_k
    return shape.q_len, shape.kv_len


def _dims(shape) -> int:
    return max(shape.head_dim, shape.dv)


def _xla_tiles(shape, dtype):
    from ejgen.runtime.attention import xla

    return tuple(xla._block_size(n) for n in _lengths(shape))


def _triton_tiles(shape, dtype):
    from ejgen.runtime.attention.triton import configs
    from ejgen.runtime.core import kernels

    if not ON_GPU:
        return configs.INTERPRET.block_m, configs.INTERPRET.block_n
    if _takes_hopper_kernels(Case(Features(), shape, dtype))[0]:
        return 128, 128
    c = configs.pick(kernels.target().arch or "sm90", "fwd", min(_dims(shape), 256), np.dtype(dtype).itemsize * 8)
    return c.block_m, c.block_n


def _pallas_tiles(shape, dtype):
    from ejgen.runtime.attention.pallas import gpu

    blocks = gpu.BlockSizes.get_default("fwd", _dims(shape), jnp.dtype(dtype), interpret=not ON_GPU)
    return blocks.block_q, blocks.block_k


def _interpreted_triton_cost(row: dict) -> float:
    """A case's seconds in Triton's interpreter, relative: a second of set-up and tracing, and about a sixteenth
    for each (query tile, key tile) pair of each head (varlen: of its longest sequences, over the batch)."""
    shape = row["shape"]
    sq, sk = _lengths(shape)
    batch = len(shape.q_lens) if isinstance(shape, VarlenShape) else shape.batch
    tq, tk = _triton_tiles(shape, row["dtype"])
    return 1 + batch * shape.q_heads * -(-sq // tq) * -(-sk // tk) / 16


def _triton_refuses(row: dict):
    shape = row.get("shape")
    if shape is not None and _dims(shape) > 256:
        return rf"platform 'triton' cannot run this call: head dims {shape.head_dim}/{shape.dv}"
    return None


def _on_this_host(shapes):
    """The shapes a backend runs here: on the GPU host the GPU shapes too; everything with EJGEN_FULL_SUITE."""
    return lambda shape: conformance.FULL or shape in shapes or (ON_GPU and shape in GPU_SHAPES)


_INTERPRETED = INTERPRETER_SHAPES + (WIDE_SHAPE,)
SUITE = conformance.Suite(
    family="attention",
    factors=FACTORS,
    valid=_valid,
    make_case=_make_case,
    lengths=_lengths,
    backends=(
        conformance.Backend("xla", _on_this_host(XLA_SHAPES + INTERPRETER_SHAPES[2:] + (WIDE_SHAPE,)), _xla_tiles),
        conformance.Backend("triton", _on_this_host(_INTERPRETED), _triton_tiles, _triton_refuses,
                            interpreted=not ON_GPU, cost=_interpreted_triton_cost),
        # pallas runs head dims past 256 too, on the GPU host and with EJGEN_FULL_SUITE (xla runs them in CI)
        conformance.Backend("pallas", _on_this_host(INTERPRETER_SHAPES), _pallas_tiles, interpreted=not ON_GPU),
    ),
)


def _takes_hopper_kernels(case: Case, deterministic: bool = False) -> tuple:
    """(forward, backward): whether a triton call of ``case`` must take the hand-written Hopper kernels here,
    stated from docs/DESIGN.md §6 (not from the runtime's own test): an sm_90 GPU with the gluon setting on,
    16-bit inputs, head dims 64 or 128 (D = Dv), Sq = Sk (or Sq != Sk with the gluon_cross setting where there is no
    causal, window or segment ids; the backward that only with gluon.host.CROSS_BACKWARD), not varlen, no feature
    but causal, a window, segment ids, a soft cap and sinks (joined outside the kernels); the backward also not a
    window without causal, nor a window with segment ids unless the gluon_spec_masks setting is on, nor a soft cap
    without the fast_tanh setting, nor a window narrower than gluon.host.NARROW_WINDOW keys without sinks, and not
    deterministic."""
    from ejgen.runtime.core import kernels, settings

    f, shape, now = case.features, case.shape, settings.current()
    here = ON_GPU and kernels.target().arch == "sm90" and now.gluon
    square = isinstance(shape, AttnShape) and shape.q_len == shape.kv_len
    cross = now.gluon_cross and not f.causal and f.window is None and not f.segments
    fwd = (here and case.dtype in ("bfloat16", "float16") and isinstance(shape, AttnShape)
           and shape.head_dim == shape.dv and shape.head_dim in (64, 128) and (square or cross)
           and f.atoms <= {"segments", "sinks", "soft_cap"})
    from ejgen.runtime.attention.gluon import host as gluon_host

    sides = (f.window, f.window) if isinstance(f.window, int) else f.window  # an int: that many keys either side
    narrow = f.window is not None and sum(sides) + 1 < gluon_host.NARROW_WINDOW and not f.sinks
    bwd = (fwd and (square or gluon_host.CROSS_BACKWARD) and not deterministic and not narrow
           and not (f.window is not None and not f.causal)
           and not (f.window is not None and f.segments and not now.gluon_spec_masks)
           and not (f.soft_cap is not None and not now.fast_tanh))
    return fwd, bwd


# Logits far beyond the ~4.5 of standard-normal inputs: scores up to +-200, a soft cap far exceeded
# (raw scores 5x the cap of 100, tanh at 0.9999, capped scores near +-100), sinks above every score.
# exp of any of them overflows float32 (past 88.7), so a kernel without the running-max subtraction
# fails here. Shapes: the registry's odd GQA and MHA shapes at batch 1 (S <= 96, half the time), the GQA one with
# two query heads to one (groups as before, half the interpreters' tiles).
_LG, _LM = AttnShape(1, 63, 65, 2, 1, 48), AttnShape(1, 45, 45, 2, 2, 72, 40)
LARGE_LOGIT_CASES = (
    Case(Features(logits=200.0), _LG),
    Case(Features(causal=True, logits=200.0), _LM, "bfloat16"),
    Case(Features(window=(8, 4), soft_cap=100.0, logits=500.0), _LM),
    Case(Features(causal=True, soft_cap=100.0, logits=500.0), _LG, "float16"),
    Case(Features(sinks="h", sink_margin=8.0, logits=200.0), _LG),
    Case(Features(causal=True, sinks="hn", sink_margin=4.0, logits=200.0), _LM, "bfloat16"),
)


def _ids(cases):
    return [c.id for c in cases]


def _every_backend(cases: dict, interpreted) -> list:
    """``(backend, case)`` params, ids ``<backend>-<id>``: every case (id -> case) on xla, and on the interpreted
    backends (no GPU, no EJGEN_FULL_SUITE) the ids in ``interpreted`` only; every case everywhere else."""
    return [pytest.param(b, case, id=f"{b}-{i}") for b in BACKENDS for i, case in cases.items()
            if b not in ACCELERATOR_BACKENDS or ON_GPU or conformance.FULL or i in interpreted]


def make_inputs(f: Features, shape: AttnShape, dtype: str, rng):
    """Returns ``(diff, rest, static, ref_kwargs)``: differentiable op inputs by keyword, traced
    non-differentiable ones, Python-valued ones, and the oracle's keyword arguments."""
    B, Sq, Sk, Hq = shape.batch, shape.q_len, shape.kv_len, shape.q_heads
    diff = random_qkv(shape, dtype, rng)
    rest = {}
    scale = f.scale
    if f.logits is not None:  # the scale that takes the largest |q.k| (of the rounded inputs) to f.logits
        scale = f.logits / float(np.abs(dot_products(diff["query"], diff["key"])).max())
    static = dict(
        causal=f.causal, sliding_window=f.window, logits_soft_cap=f.soft_cap,
        softmax_scale=scale,
    )
    ref = dict(static)
    if f.bias:
        dims = {"b": B, "h": Hq, "1": 1, "q": Sq, "k": Sk}
        diff["bias"] = jnp.asarray(rng.standard_normal([dims[c] for c in f.bias]), dtype)
    if f.sinks:
        diff["softmax_aux"] = random_sinks(f.sinks, Hq, rng)
        if f.sink_margin is not None:  # N(logits + margin, 1): above every logit
            diff["softmax_aux"] = diff["softmax_aux"] + (f.logits + f.sink_margin - 1.0)
    if f.segments == "packed":
        qseg = packed_segments(B, Sq, rng)
        kseg = qseg if Sq == Sk else packed_segments(B, Sk, rng)
    elif f.segments == "random":
        qseg = rng.integers(-1, 3, (B, Sq)).astype(np.int32)
        kseg = rng.integers(-1, 3, (B, Sk)).astype(np.int32)
    if f.segments:
        # With equal lengths the kv ids default to the query's.
        kv_arg = None if Sq == Sk and f.segments == "packed" else jnp.asarray(kseg)
        rest["mask_info"] = _mask_info().from_segments(jnp.asarray(qseg), kv_arg)
        ref.update(q_segment_ids=qseg, kv_segment_ids=kseg)
    if f.mask:
        dims = {"b": B, "h": Hq, "1": 1, "q": Sq, "k": Sk}
        mask = random_mask(tuple(dims[c] for c in f.mask), rng)
        rest["mask_info"] = _mask_info().from_attention_mask(jnp.asarray(mask))
        ref["attention_mask"] = mask
    return diff, rest, static, ref


def dot_products(query, key) -> np.ndarray:
    """float64 ``q . k`` as ``[B, Hq, Sq, Sk]`` (query head h reads kv head h // group)."""
    q, k = np.asarray(query, np.float64), np.asarray(key, np.float64)
    k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
    return np.einsum("bqhd,bkhd->bhqk", q, k)


def _as_numpy(arrays: dict) -> dict:
    return {n: np.asarray(x) for n, x in arrays.items()}


def largest_logit(diff: dict, static: dict) -> float:
    """The largest |score| reaching the softmax (after bias and soft cap, every entry, masked or
    not) or |sink|."""
    d = diff["query"].shape[-1]
    scale = 1.0 / np.sqrt(d) if static["softmax_scale"] is None else static["softmax_scale"]
    s = scale * dot_products(diff["query"], diff["key"])
    if "bias" in diff:
        s = s + np.asarray(diff["bias"], np.float64)
    if static["logits_soft_cap"] is not None:
        s = static["logits_soft_cap"] * np.tanh(s / static["logits_soft_cap"])
    sinks = np.abs(np.asarray(diff.get("softmax_aux", 0.0), np.float64)).max()
    return float(max(np.abs(s).max(), sinks))


def run_case(case: Case, backend: str, run_vjp):
    """One case on one backend against the oracle: output, lse and every gradient."""
    if isinstance(case.shape, VarlenShape):
        return _run_varlen(case, backend, run_vjp)
    op = _flash_attention()
    rng = rng_for(case.id)
    diff, rest, static, ref_kwargs = make_inputs(case.features, case.shape, case.dtype, rng)
    d_out, d_lse = random_cotangents(case.shape, case.dtype, rng)
    out, lse, grads = run_vjp(op, diff, rest, {**static, "platform": backend}, d_out, d_lse)
    ref = oracle.attention(**_as_numpy(diff), **ref_kwargs, d_out=d_out, d_lse=d_lse)
    assert out.shape == case.shape.out and lse.shape == case.shape.lse
    # Scores far beyond the standard normal's widen the tolerance by their rounding (oracle.tolerance).
    max_logit = None if case.features.logits is None else largest_logit(diff, static)
    return oracle.check_attention(out, lse, grads, ref, diff, case.dtype, max_logit=max_logit)


def _run_varlen(case: Case, backend: str, run_vjp):
    op = _flash_attention()
    f, shape, dtype = case.features, case.shape, case.dtype
    rng = rng_for(case.id)
    diff = random_qkv(shape, dtype, rng)
    if f.sinks:
        diff["softmax_aux"] = random_sinks(f.sinks, shape.q_heads, rng)
    features = dict(
        causal=f.causal, sliding_window=f.window, logits_soft_cap=f.soft_cap,
        softmax_scale=f.scale,
    )
    rest = {
        "cu_seqlens_q": jnp.asarray(shape.cu_seqlens_q),
        "cu_seqlens_k": jnp.asarray(shape.cu_seqlens_k),
    }
    static = dict(
        features, max_seqlen_q=shape.max_seqlen_q, max_seqlen_k=shape.max_seqlen_k,
        platform=backend,
    )
    d_out, d_lse = random_cotangents(shape, dtype, rng)
    out, lse, grads = run_vjp(op, diff, rest, static, d_out, d_lse)
    ref = oracle.varlen_attention(
        **_as_numpy(diff), cu_seqlens_q=shape.cu_seqlens_q, cu_seqlens_k=shape.cu_seqlens_k,
        **features, d_out=d_out, d_lse=d_lse,
    )
    assert out.shape == shape.out and lse.shape == shape.lse
    return oracle.check_attention(out, lse, grads, ref, diff, dtype)


def _record_launches(monkeypatch) -> list:
    """The names of the Triton kernels the test launches, in order (a spy on ``triton_call.launch``; the Hopper
    path's plain Triton kernels, `gluon.host.PLAIN_TRITON`, which feed the Gluon kernels their plan and delta, are
    not listed)."""
    from ejgen.runtime.attention.gluon import host as gluon_attention
    from ejgen.runtime.launch import triton_call

    launches, launch = [], triton_call.launch

    def spy(kernel, *args, **kw):
        if getattr(kernel, "fn", kernel).__module__ not in gluon_attention.PLAIN_TRITON:
            launches.append(kernel.__name__)
        return launch(kernel, *args, **kw)

    monkeypatch.setattr(triton_call, "launch", spy)
    return launches


def _kernel_kinds(launches) -> dict:
    """Launched kernel names -> {"fwd": {...}, "bwd": {...}}: "gluon" (the Hopper set) or "triton" (generated)."""
    kinds = {"fwd": set(), "bwd": set()}
    for name in launches:
        kinds["bwd" if "_bwd" in name else "fwd"].add("gluon" if name.startswith("gluon_") else "triton")
    return kinds


@pytest.mark.parametrize("backend,case", SUITE.params())
def test_attention(backend, run_vjp, monkeypatch, case):
    """A case of the design against the oracle; on triton, the kernels it launched are the ones it must take
    here (the Hopper set where it covers the call, else the generated kernels): no silent fallback."""
    launches = _record_launches(monkeypatch) if backend == "triton" else []
    run_case(case, backend, run_vjp)
    if backend == "triton":
        fwd, bwd = _takes_hopper_kernels(case)
        expected = {"fwd": {"gluon" if fwd else "triton"}, "bwd": {"gluon" if bwd else "triton"}}
        assert _kernel_kinds(launches) == expected, launches


# The Hopper kernels on every mask structure they take, GQA and MHA, bf16 and f16, more tiles than an H100 has
# SMs: on the GPU host only (deselected elsewhere: the interpreters would take minutes per case).
HOPPER_CASES = tuple(
    Case(Features(causal=causal, window=window), GPU_SHAPES[i % 2], ("bfloat16", "float16")[i // 2 % 2])
    for i, (causal, window) in enumerate(STRUCTURES.values())
) + tuple(  # document masks: packed runs with padding (whole padding tiles, full tiles inside documents), random ids
    Case(Features(causal=STRUCTURES[st][0], window=STRUCTURES[st][1], segments=seg), GPU_SHAPES[i % 2],
         ("bfloat16", "float16")[i // 2 % 2])
    for i, (st, seg) in enumerate(itertools.product(("causal", "none", "causal-win20,7", "win16"), ("packed", "random")))
) + (  # a soft cap (SOFTCAP in the kernels) and sinks (joined outside them): Gemma 2 / 3 and gpt-oss forms
    Case(Features(causal=True, soft_cap=2.0), GPU_SHAPES[0], "bfloat16"),
    Case(Features(causal=True, window=(20, 0), soft_cap=3.0, sinks="h"), GPU_SHAPES[1], "float16"),
    Case(Features(soft_cap=1.5, sinks="hn"), GPU_SHAPES[1], "bfloat16"),
)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("case", HOPPER_CASES, ids=_ids(HOPPER_CASES))
def test_hopper_kernels(run_vjp, monkeypatch, case, deterministic):
    """On an sm_90 GPU these calls take the Hopper kernel set, forward and backward (deterministic: the
    generated backward), and match the oracle; elsewhere the generated kernels, which must match too."""
    from ejgen.ops import settings

    from ejgen.runtime.attention.gluon import host as gluon_host

    monkeypatch.setattr(gluon_host, "NARROW_WINDOW", 0)  # the Hopper kernels on these narrow windows too
    launches = _record_launches(monkeypatch)
    with settings(deterministic=deterministic):
        run_case(case, "triton", run_vjp)
    fwd, bwd = _takes_hopper_kernels(case, deterministic)
    assert _kernel_kinds(launches) == {"fwd": {"gluon" if fwd else "triton"}, "bwd": {"gluon" if bwd else "triton"}}
    from ejgen.runtime.core import kernels

    if kernels.target().arch == "sm90":
        assert fwd, f"{case.id}: must qualify for the Hopper forward (docs/DESIGN.md §6)"


@pytest.mark.parametrize("backend,case,message", SUITE.refusals())
def test_backends_refuse_what_they_do_not_run(backend, run_vjp, case, message):
    """A case a backend declares it cannot run raises one ValueError naming the op, the platform and why."""
    with pytest.raises(ValueError, match=r"^flash_attention\(\): " + message):
        run_case(case, backend, run_vjp)


# What the interpreters run in CI (every case on xla, on the GPU host and with EJGEN_FULL_SUITE): each kind of large
# logit (scores alone, a soft cap exceeded, dominant sinks), each dtype, causal and not
LARGE_LOGITS_INTERPRETED = tuple(LARGE_LOGIT_CASES[i].id for i in (1, 3, 4))


@pytest.mark.parametrize("backend,case", _every_backend({c.id: c for c in LARGE_LOGIT_CASES}, LARGE_LOGITS_INTERPRETED))
def test_large_logits(backend, run_vjp, case):
    """Scores up to +-200, a soft cap far exceeded, sinks above every score: on every backend (the
    interpreters: `LARGE_LOGITS_INTERPRETED`), each case with a score or sink that float32's exp overflows
    on without the running-max subtraction."""
    run_case(case, backend, run_vjp)


FULLY_MASKED = {  # GQA 2:1 (what the rows see does not depend on the heads; half the interpreters' tiles of 4:2)
    "segments": AttnShape(2, 37, 29, 2, 1, 16),
    "mask": AttnShape(1, 21, 40, 2, 1, 24),
    "causal_sq_gt_sk": AttnShape(1, 50, 19, 2, 1, 16),
}


# The interpreters in CI (every way with and without sinks on xla, on the GPU host and with EJGEN_FULL_SUITE): each
# way, with sinks and without
FULLY_MASKED_INTERPRETED = ("segments-sinks", "mask-nosinks", "causal_sq_gt_sk-sinks")


def test_the_interpreters_meet_every_way_of_masking_rows_fully():
    """`FULLY_MASKED_INTERPRETED` holds every way of `FULLY_MASKED`, and rows with sinks and without."""
    ways, sinks = zip(*(i.rsplit("-", 1) for i in FULLY_MASKED_INTERPRETED))
    assert set(ways) == set(FULLY_MASKED) and set(sinks) == {"sinks", "nosinks"}


@pytest.mark.parametrize("backend,how_sinks", _every_backend(
    {f"{how}-{'sinks' if sinks else 'nosinks'}": (how, sinks) for how in FULLY_MASKED for sinks in (None, "h")},
    FULLY_MASKED_INTERPRETED))
def test_fully_masked_rows(backend, run_vjp, how_sinks):
    """Queries that see no key: out exactly 0, lse -inf (the sinks' logsumexp with sinks), zero
    gradients, and no NaN anywhere — with rows chosen by hand, not read from the oracle."""
    check_fully_masked_rows(backend, run_vjp, *how_sinks)


def check_fully_masked_rows(backend, run_vjp, how, sinks):
    """`test_fully_masked_rows`' check of one way (`FULLY_MASKED`), sinks None or "h"."""
    op, MaskInfo = _flash_attention(), _mask_info()
    shape = FULLY_MASKED[how]
    B, Sq, Sk, Hq = shape.batch, shape.q_len, shape.kv_len, shape.q_heads
    rng = rng_for("masked", how, sinks)
    diff = random_qkv(shape, "float32", rng)
    if sinks:
        diff["softmax_aux"] = jnp.asarray(rng.standard_normal(Hq), jnp.float32)
    empty_q = np.zeros((B, Sq), bool)
    unseen_k = np.zeros((B, Sk), bool)
    rest, static, ref_kwargs = {}, {"causal": False}, {}
    if how == "segments":
        qseg = np.zeros((B, Sq), np.int32)
        kseg = np.zeros((B, Sk), np.int32)
        qseg[:, 10:20], kseg[:, 12:20] = 1, 1
        qseg[:, 20:25] = 7  # a segment no key belongs to
        qseg[:, -5:], kseg[:, -4:] = -1, -1  # padding
        qseg[1, :] = -1  # a whole batch row of padding queries
        empty_q[:, 20:25], empty_q[:, -5:], empty_q[1] = True, True, True
        unseen_k[:, -4:], unseen_k[1] = True, True
        rest["mask_info"] = MaskInfo.from_segments(jnp.asarray(qseg), jnp.asarray(kseg))
        ref_kwargs.update(q_segment_ids=qseg, kv_segment_ids=kseg)
    elif how == "mask":
        mask = rng.random((B, Hq, Sq, Sk)) < 0.5
        mask[:, :, [0, 7, 20]] = False
        mask[:, :, :, [3, 39]] = False
        mask[:, :, 1:7, 3] = True  # key 3 is seen, by some queries
        mask[:, :, 8, 3] = False
        empty_q[:, [0, 7, 20]] = True
        unseen_k[:, 39] = True
        rest["mask_info"] = MaskInfo.from_attention_mask(jnp.asarray(mask))
        ref_kwargs["attention_mask"] = mask
    else:
        static["causal"] = ref_kwargs["causal"] = True
        empty_q[:, : Sq - Sk] = True  # bottom-right aligned: the first Sq - Sk queries see nothing
    d_out, d_lse = random_cotangents(shape, "float32", rng)
    out, lse, grads = run_vjp(op, diff, rest, {**static, "platform": backend}, d_out, d_lse)
    values = {"out": out, "lse": lse, **{f"d{n}": g for n, g in grads.items()}}
    for name, x in values.items():
        assert not np.isnan(np.asarray(x)).any(), f"NaN in {name}"
    assert np.all(np.asarray(out)[empty_q] == 0)
    lse_rows = np.asarray(lse).transpose(0, 2, 1)  # [B, Sq, Hq]
    if sinks:
        aux = np.asarray(diff["softmax_aux"], np.float64)
        expected = np.broadcast_to(aux, lse_rows[empty_q].shape)
        np.testing.assert_allclose(lse_rows[empty_q], expected, rtol=1e-6)
        assert np.all(np.asarray(grads["softmax_aux"]) != 0)
    else:
        assert np.all(np.isneginf(lse_rows[empty_q]))
    assert np.all(np.isfinite(lse_rows[~empty_q]))
    assert np.all(np.asarray(grads["query"])[empty_q] == 0)
    assert np.all(np.asarray(grads["key"])[unseen_k] == 0)
    assert np.all(np.asarray(grads["value"])[unseen_k] == 0)
    ref = oracle.attention(**_as_numpy(diff), **ref_kwargs, d_out=d_out, d_lse=d_lse)
    oracle.check_attention(out, lse, grads, ref, diff, "float32")


# What vmap is about is the extra axis, not the tiles: a small shape of two tiles or more on both axes of each
# interpreter (Triton's 16 x 16, Pallas' 32 x 16), GQA, ragged ends (a quarter of the Triton interpreter's work of
# INTERPRETER_SHAPES[0])
VMAP_SHAPE = AttnShape(1, 40, 37, 2, 1, 16)


def test_vmap_over_an_extra_leading_axis(backend):
    """jax.vmap over a leading axis (inputs, bias and segment ids batched, sinks shared) equals a
    Python loop, forward and backward, and the loop equals the oracle."""
    op, MaskInfo = _flash_attention(), _mask_info()
    E, shape = 2, VMAP_SHAPE
    rng = rng_for("vmap")
    qkv = [random_qkv(shape, "float32", rng) for _ in range(E)]
    q, k, v = (jnp.stack([x[n] for x in qkv]) for n in ("query", "key", "value"))
    bias = rng.standard_normal((E, 1, shape.q_heads, shape.q_len, shape.kv_len))
    bias = jnp.asarray(bias, jnp.float32)
    aux = jnp.asarray(rng.standard_normal(shape.q_heads), jnp.float32)
    qseg, kseg = (
        jnp.asarray(np.stack([packed_segments(shape.batch, n, rng) for _ in range(E)]))
        for n in (shape.q_len, shape.kv_len)
    )
    d_out = jnp.asarray(rng.standard_normal((E,) + shape.out), jnp.float32)
    d_lse = jnp.asarray(rng.uniform(0.5, 1.5, (E,) + shape.lse), jnp.float32)

    def f(q, k, v, bias, qseg, kseg):
        return op(
            q, k, v, bias=bias, softmax_aux=aux, mask_info=MaskInfo.from_segments(qseg, kseg),
            causal=True, platform=backend, return_lse=True,
        )

    def fwd_bwd(q, k, v, bias, qseg, kseg, d_out, d_lse):
        res, vjp = jax.vjp(lambda *a: f(*a, qseg, kseg), q, k, v, bias)
        return res, vjp((d_out, d_lse))

    batched = jax.jit(jax.vmap(fwd_bwd))(q, k, v, bias, qseg, kseg, d_out, d_lse)
    one = jax.jit(fwd_bwd)
    names = ("query", "key", "value", "bias")
    for e in range(E):
        (out, lse), grads = one(q[e], k[e], v[e], bias[e], qseg[e], kseg[e], d_out[e], d_lse[e])
        (b_out, b_lse), b_grads = jax.tree.map(lambda x: x[e], batched)
        tol = TOLERANCE["float32"]
        assert_close(f"vmap out[{e}]", b_out, out, tol)
        assert_close(f"vmap lse[{e}]", b_lse, lse, tol)
        for n, g, bg in zip(names, grads, b_grads):
            assert_close(f"vmap d{n}[{e}]", bg, g, tol)
        ref = oracle.attention(
            np.asarray(q[e]), np.asarray(k[e]), np.asarray(v[e]), bias=np.asarray(bias[e]),
            softmax_aux=np.asarray(aux), causal=True, q_segment_ids=np.asarray(qseg[e]),
            kv_segment_ids=np.asarray(kseg[e]),
            d_out=d_out[e], d_lse=d_lse[e],
        )
        assert_close(f"out[{e}]", out, ref.out, tol)
        assert_close(f"lse[{e}]", lse, ref.lse, tol)
        for n, g in zip(names, grads):
            assert_close(f"d{n}[{e}]", g, ref.grads[n], tol)


def test_jax_grad_of_a_scalar_loss(backend):
    """jax.jit(jax.grad(...)) with return_lse=False: a single array out, the oracle's gradients."""
    op = _flash_attention()
    shape = MHA_SHAPES[0]
    rng = rng_for("grad")
    x = random_qkv(shape, "float32", rng)
    bias = jnp.asarray(rng.standard_normal((1, 1, shape.q_len, shape.kv_len)), jnp.float32)
    d_out = jnp.asarray(rng.standard_normal(shape.out), jnp.float32)

    def loss(q, k, v, bias):
        out = op(q, k, v, bias=bias, causal=True, sliding_window=(9, 0), platform=backend)
        assert not isinstance(out, tuple), "return_lse=False must return the output alone"
        return jnp.sum(out * d_out)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x["query"], x["key"], x["value"], bias)
    ref = oracle.attention(
        *(np.asarray(x[n]) for n in ("query", "key", "value")), bias=np.asarray(bias),
        causal=True, sliding_window=(9, 0), d_out=d_out,
    )
    for name, g in zip(("query", "key", "value", "bias"), grads):
        assert_close(f"d{name}", g, ref.grads[name], TOLERANCE["float32"])


def test_eager_call_without_jit(backend):
    op = _flash_attention()
    shape = GQA_SHAPES[0]
    rng = rng_for("eager")
    x = random_qkv(shape, "float32", rng)
    aux = jnp.asarray(rng.standard_normal((shape.q_heads, 2)), jnp.float32)
    out, lse = op(
        x["query"], x["key"], x["value"], causal=True, logits_soft_cap=3.0, softmax_aux=aux,
        platform=backend, return_lse=True,
    )
    ref = oracle.attention(
        **_as_numpy(x), causal=True, logits_soft_cap=3.0, softmax_aux=np.asarray(aux)
    )
    assert_close("out", out, ref.out, TOLERANCE["float32"])
    assert_close("lse", lse, ref.lse, TOLERANCE["float32"])


# On the GPU host `pytest -m gpu` runs the accelerator backends' cases, and this check for them.
@(pytest.mark.gpu if ON_GPU else lambda f: f)
def test_the_collected_cases_cover_the_design(request):
    """The conformance cases pytest collected for this run (after selection and subsetting) cover the
    design on every backend: every valid pair of levels, and every level on a shape of two tiles or more on
    both axes of that backend; each backend refuses only what it declares. Run as one shard of a selection
    (benchmarks/gpu_shards.sh sets EJGEN_SHARD_SELECTION to the file of its test ids): that whole selection's."""
    import os

    shard = os.environ.get("EJGEN_SHARD_SELECTION")
    selection = open(shard).read().split() if shard else None
    SUITE.check_collected(request.session.items, ACCELERATOR_BACKENDS if ON_GPU else BACKENDS, selection)


def test_the_design_covers_the_plan():
    """The factors hold what the plan names (docs/DESIGN.md §7): every structure, sink form, bias broadcast
    and MaskInfo kind; GQA, MQA and MHA; odd lengths, Sq > Sk, Sq < Sk, S = 1 on each side; varlen with an
    empty sequence and with queries that see no key; Dv != D; every dtype; and a design far smaller than
    the product."""
    shapes = INTERPRETER_SHAPES
    dense = [s for s in shapes if isinstance(s, AttnShape)]
    assert {s.q_heads // s.kv_heads > 1 for s in dense} == {True, False}
    assert any(s.kv_heads == 1 and s.q_heads > 1 for s in shapes)
    assert any(s.odd for s in dense) and any(s.q_len > s.kv_len for s in dense) and any(s.q_len < s.kv_len for s in dense)
    assert any(s.q_len == 1 for s in dense) and any(s.kv_len == 1 for s in dense)
    assert any(s.dv != s.head_dim for s in shapes)
    varlen = [s for s in shapes if isinstance(s, VarlenShape)]
    assert any(0 in s.q_lens and 0 in s.kv_lens for s in varlen)
    assert any(q > 0 and k == 0 for s in varlen for q, k in zip(s.q_lens, s.kv_lens))
    assert {f for f in FACTORS["sinks"] if f} == {"h", "hn", "n"}
    assert {f for f in FACTORS["bias"] if f} == {"bhqk", "1hqk", "b1qk", "11qk"}
    for backend in SUITE.backend:
        rows = SUITE.rows(backend)
        factors = SUITE.factors_for(backend)
        assert SUITE.missing(backend, rows) == [], backend
        product = np.prod([len(v) for v in factors.values()])
        assert len(rows) < product / 100, (backend, len(rows))


PLAIN = Case(Features(), _LG)
F32_EXP_OVERFLOW = float(np.log(np.finfo(np.float32).max))  # 88.72: exp of more is inf


def test_large_logit_cases_cover_the_plan():
    """Scores of +-200, a soft cap exceeded 5x, sinks above every score, in each dtype, with and
    without causal; each case's largest score or sink overflows float32's exp, and the inputs stay
    small enough for the CPU suite (S <= 96). The interpreters' subset in CI too (`LARGE_LOGITS_INTERPRETED`)."""
    interpreted = [c for c in LARGE_LOGIT_CASES if c.id in LARGE_LOGITS_INTERPRETED]
    assert len(interpreted) == len(LARGE_LOGITS_INTERPRETED)
    for cases in (LARGE_LOGIT_CASES, interpreted):
        assert {c.dtype for c in cases} == {"float32", "bfloat16", "float16"}
        assert any(c.features.logits >= 200 and not c.features.atoms for c in cases)
        assert any(c.features.soft_cap and c.features.logits >= 5 * c.features.soft_cap for c in cases)
        assert any(c.features.sink_margin for c in cases)
        assert {c.features.causal for c in cases} == {True, False}
    for case in LARGE_LOGIT_CASES:
        assert max(case.shape.q_len, case.shape.kv_len) <= 96, case.id
        diff, _, static, _ = make_inputs(case.features, case.shape, case.dtype, rng_for(case.id))
        assert largest_logit(diff, static) > F32_EXP_OVERFLOW, case.id


def _softmax_without_max(diff: dict, static: dict):
    """A planted bug: attention in float32 as a kernel would compute it without the running-max
    subtraction (p = exp(s), l = sum p + sum exp(sinks)); returns (out, lse) like the op."""
    q, k, v = (np.asarray(diff[n], np.float32) for n in ("query", "key", "value"))
    B, Sq, Hq, D = q.shape
    Sk, group = k.shape[1], Hq // k.shape[2]
    scale = np.float32(1 / np.sqrt(D) if static["softmax_scale"] is None else static["softmax_scale"])
    s = scale * np.einsum("bqhd,bkhd->bhqk", q, np.repeat(k, group, axis=2))
    if static["logits_soft_cap"] is not None:
        cap = np.float32(static["logits_soft_cap"])
        s = cap * np.tanh(s / cap)
    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    vis = np.ones((Sq, Sk), bool)
    if static["causal"]:
        vis &= j <= i + Sk - Sq
    if static["sliding_window"] is not None:
        left, right = static["sliding_window"]
        vis &= (j >= i + Sk - Sq - left) & (j <= i + Sk - Sq + right)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        p = np.where(vis, np.exp(s), np.float32(0))
        l = p.sum(-1)
        if "softmax_aux" in diff:
            aux = oracle.sinks_per_head(np.asarray(diff["softmax_aux"], np.float32), Hq)
            l = l + np.exp(aux).sum(-1)[None, :, None]
        out = np.einsum("bhqk,bkhd->bqhd", p / l[..., None], np.repeat(v, group, axis=2))
        return out.astype(diff["value"].dtype), np.log(l)


@pytest.mark.parametrize(
    "case", (PLAIN,) + LARGE_LOGIT_CASES, ids=_ids((PLAIN,) + LARGE_LOGIT_CASES)
)
def test_a_softmax_without_max_fails_only_on_large_logits(case):
    """The planted bug "no running-max subtraction" passes on standard-normal inputs (largest score
    4.5: the suite without large logits could not see it) and fails every large-logit case."""
    diff, _, static, ref_kwargs = make_inputs(case.features, case.shape, case.dtype, rng_for(case.id))
    out, lse = _softmax_without_max(diff, static)
    ref = oracle.attention(**_as_numpy(diff), **ref_kwargs)
    large = case.features.logits is not None
    tol = oracle.tolerance(case.dtype, largest_logit(diff, static) if large else None)
    if not large:
        assert_close("out", out, ref.out, tol)
        assert_close("lse", lse, ref.lse, oracle.LSE_TOLERANCE)
    else:
        with pytest.raises(AssertionError, match="NaN|infinite|relative error"):
            assert_close("out", out, ref.out, tol)
            assert_close("lse", lse, ref.lse, oracle.LSE_TOLERANCE)


@pytest.mark.parametrize("dtype,offset", [("bfloat16", 0.05), ("float16", 0.01)])
def test_lse_offset_fails_in_low_precision(run_vjp, dtype, offset):
    """lse is float32 whatever the inputs: held to its own tolerance, an lse off by a constant fails,
    an offset that the input dtype's tolerance (bf16 2e-2, f16 5e-3) would let through."""
    case = Case(Features(), _LG, dtype)
    rng = rng_for(case.id)
    diff, rest, static, ref_kwargs = make_inputs(case.features, case.shape, case.dtype, rng)
    d_out, d_lse = random_cotangents(case.shape, case.dtype, rng)
    out, lse, grads = run_vjp(_flash_attention(), diff, rest, {**static, "platform": "xla"}, d_out, d_lse)
    ref = oracle.attention(**_as_numpy(diff), **ref_kwargs, d_out=d_out, d_lse=d_lse)
    oracle.check_attention(out, lse, grads, ref, diff, dtype)
    assert assert_close(f"lse + {offset}", lse + offset, ref.lse, 1.0) < TOLERANCE[dtype]
    with pytest.raises(AssertionError, match="lse: relative error"):
        oracle.check_attention(out, lse + offset, grads, ref, diff, dtype)


def test_non_finite_inputs_propagate_to_the_rows_they_reach(backend):
    """§3 step 5: a NaN in a query makes its row NaN (out and lse), as jax.nn.dot_product_attention does; a
    NaN in a key reaches exactly the rows that see that key (causal: the later ones), since visibility
    depends on the masks, never on values; every other row equals the call on clean inputs. Nothing hides a
    diverging model as zeros. (A NaN in a value reaches every row whose tile multiplies it, even by a zero
    probability, as in any matmul: that depends on the tiles, so it is not pinned here.)"""
    op = _flash_attention()
    shape = INTERPRETER_SHAPES[0]  # B2, 37 x 41, GQA 4:2
    x = random_qkv(shape, "float32", rng_for("non-finite"))
    q, k, v = x["query"], x["key"], x["value"]
    clean = [np.asarray(a) for a in op(q, k, v, causal=True, platform=backend, return_lse=True)]
    j, off = 20, shape.kv_len - shape.q_len
    reached_q = np.zeros(clean[0].shape[:3], bool)
    reached_q[1, 5, 3] = True
    reached_k = np.zeros(clean[0].shape[:3], bool)
    reached_k[0, j - off:, :2] = True  # key j of kv head 0: query heads 0 and 1, rows i >= j - (Sk - Sq)
    for what, inputs, reached in (("query", (q.at[1, 5, 3, 0].set(jnp.nan), k, v), reached_q),
                                  ("key", (q, k.at[0, j, 0, 2].set(jnp.nan), v), reached_k)):
        out, lse = (np.asarray(a) for a in op(*inputs, causal=True, platform=backend, return_lse=True))
        lse = lse.transpose(0, 2, 1)  # [B, Sq, Hq] like the rows
        assert np.isnan(out[reached]).all() and np.isnan(lse[reached]).all(), f"NaN {what}: a reached row is not NaN"
        np.testing.assert_array_equal(out[~reached], clean[0][~reached], err_msg=f"NaN {what}: another row moved")
        np.testing.assert_array_equal(lse[~reached], clean[1].transpose(0, 2, 1)[~reached])
