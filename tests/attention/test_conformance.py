"""flash_attention against the float64 oracle (docs/DESIGN.md §3, §7): backend x features x shapes x
dtypes, outputs, lse and every gradient, under jax.jit and jax.vjp / jax.grad.

The parametrisation is representative, not a full product: every feature (bias, soft cap, sinks,
segments, dense mask) appears alone, with causal and with a window, and each feature case runs on
one GQA/MQA shape and one MHA shape of the registry (all of which but one are odd);
``test_parametrisation_covers_the_plan`` keeps it that way. f32 runs everywhere, bf16/f16 on a
subset. Large-logit cases (scores to +-200, a soft cap far exceeded, dominant sinks) run on every
backend, with a tolerance widened by the scores' float32 rounding (``oracle.tolerance``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from conftest import backend_cases
from oracle import TOLERANCE, assert_close
from ejgen.testing.shapes import (
    GQA_SHAPES,
    MHA_SHAPES,
    VARLEN_SHAPES,
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

    @property
    def structure(self) -> str:
        return {
            (False, False): "none", (True, False): "causal", (False, True): "window",
            (True, True): "causal+window",
        }[(self.causal, self.window is not None)]


@dataclasses.dataclass(frozen=True)
class Case:
    features: Features
    shape: AttnShape | VarlenShape
    dtype: str = "float32"

    @property
    def id(self) -> str:
        return f"{self.features.id}-{self.shape.id}-{DTYPE_IDS[self.dtype]}"


CAP = dict(soft_cap=2.0, scale=0.5)  # scale 0.5 with D >= 16 makes logits large enough to cap

FEATURES = (
    Features(),
    Features(causal=True),
    Features(window=16),
    Features(window=(8, 4)),
    Features(window=(0, 0)),
    Features(causal=True, window=(20, 7)),  # with causal the right bound is 0
    Features(**CAP),
    Features(causal=True, **CAP),
    Features(window=(8, 4), **CAP),
    Features(sinks="h"),
    Features(causal=True, sinks="hn"),
    Features(window=16, sinks="n"),
    Features(bias="bhqk"),
    Features(causal=True, bias="1hqk"),
    Features(window=(8, 4), bias="b1qk"),
    Features(causal=True, window=(20, 0), bias="11qk"),
    Features(segments="packed"),
    Features(causal=True, segments="packed"),
    Features(window=16, segments="packed"),
    Features(sinks="h", segments="random"),
    Features(mask="bqk"),
    Features(causal=True, mask="b1qk"),
    Features(window=(8, 4), mask="bhqk"),
    Features(causal=True, window=(20, 0), sinks="hn", bias="b1qk", segments="packed", **CAP),
    Features(sinks="n", bias="bhqk", mask="bhqk", **CAP),
)

# Each feature case on one GQA/MQA shape and one MHA shape, rotating through the registry.
F32_CASES = tuple(
    Case(f, shape)
    for i, f in enumerate(FEATURES)
    for shape in (GQA_SHAPES[i % len(GQA_SHAPES)], MHA_SHAPES[i % len(MHA_SHAPES)])
)

LOW_PRECISION_FEATURES = (
    Features(),
    Features(causal=True),
    Features(window=(8, 4), mask="b1qk"),
    Features(sinks="n", bias="1hqk"),
    Features(causal=True, window=(20, 0), sinks="hn", bias="b1qk", segments="packed", **CAP),
)

# bf16 and f16 each on the odd GQA shape and the odd MHA shape, alternating.
LOW_PRECISION_CASES = tuple(
    Case(f, (GQA_SHAPES[0], MHA_SHAPES[0])[(i + j) % 2], dtype)
    for i, f in enumerate(LOW_PRECISION_FEATURES)
    for j, dtype in enumerate(("bfloat16", "float16"))
)

VARLEN_FEATURES = (
    Features(),
    Features(causal=True),
    Features(window=(8, 4)),
    Features(causal=True, window=16),
    Features(causal=True, sinks="hn", **CAP),
    Features(sinks="n"),
)

VARLEN_CASES = tuple(
    Case(f, VARLEN_SHAPES[(i + j) % len(VARLEN_SHAPES)])
    for i, f in enumerate(VARLEN_FEATURES)
    for j in range(2)
) + (
    Case(Features(causal=True), VARLEN_SHAPES[0], "bfloat16"),
    Case(Features(causal=True, sinks="h", window=(8, 0)), VARLEN_SHAPES[1], "bfloat16"),
)

# Logits far beyond the ~4.5 of standard-normal inputs: scores up to +-200, a soft cap far exceeded
# (raw scores 5x the cap of 100, tanh at 0.9999, capped scores near +-100), sinks above every score.
# exp of any of them overflows float32 (past 88.7), so a kernel without the running-max subtraction
# fails here. Shapes: the registry's odd GQA and MHA shapes at batch 1 (S <= 96, half the time).
_LG, _LM = AttnShape(1, 63, 65, 4, 2, 48), AttnShape(1, 45, 45, 2, 2, 72, 40)
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


@pytest.mark.parametrize("backend,case", backend_cases(F32_CASES, _ids(F32_CASES)))
def test_attention_f32(backend, run_vjp, case):
    run_case(case, backend, run_vjp)


@pytest.mark.parametrize("backend,case", backend_cases(LOW_PRECISION_CASES, _ids(LOW_PRECISION_CASES)))
def test_attention_low_precision(backend, run_vjp, case):
    run_case(case, backend, run_vjp)


@pytest.mark.parametrize("case", LARGE_LOGIT_CASES, ids=_ids(LARGE_LOGIT_CASES))
def test_large_logits(backend, run_vjp, case):
    """Scores up to +-200, a soft cap far exceeded, sinks above every score: on every backend (not
    the subset), each case with a score or sink that float32's exp overflows on without the
    running-max subtraction."""
    run_case(case, backend, run_vjp)


@pytest.mark.parametrize("backend,case", backend_cases(VARLEN_CASES, _ids(VARLEN_CASES)))
def test_varlen(backend, run_vjp, case):
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
    oracle.check_attention(out, lse, grads, ref, diff, dtype)


FULLY_MASKED = {
    "segments": AttnShape(2, 37, 29, 4, 2, 16),
    "mask": AttnShape(1, 21, 40, 2, 1, 24),
    "causal_sq_gt_sk": AttnShape(1, 50, 19, 4, 1, 16),
}


@pytest.mark.parametrize("sinks", [None, "h"], ids=["nosinks", "sinks"])
@pytest.mark.parametrize("how", FULLY_MASKED, ids=list(FULLY_MASKED))
def test_fully_masked_rows(backend, run_vjp, how, sinks):
    """Queries that see no key: out exactly 0, lse -inf (the sinks' logsumexp with sinks), zero
    gradients, and no NaN anywhere — with rows chosen by hand, not read from the oracle."""
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


def test_vmap_over_an_extra_leading_axis(backend):
    """jax.vmap over a leading axis (inputs, bias and segment ids batched, sinks shared) equals a
    Python loop, forward and backward, and the loop equals the oracle."""
    op, MaskInfo = _flash_attention(), _mask_info()
    E, shape = 2, GQA_SHAPES[0]
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


def test_parametrisation_covers_the_plan():
    """Every feature alone, with causal and with a window; with and without GQA; in an odd
    shape; every low-precision dtype on GQA and MHA shapes; varlen with an empty sequence."""
    atoms = {"soft_cap", "sinks", "bias", "segments", "mask"}
    seen = {(a, c.features.structure) for c in F32_CASES for a in c.features.atoms}
    for a in atoms:
        for structure in ("none", "causal", "window"):
            assert (a, structure) in seen, (a, structure)
        assert {c.shape.gqa for c in F32_CASES if a in c.features.atoms} == {True, False}, a
        assert any(c.shape.odd for c in F32_CASES if a in c.features.atoms), a
    structures = {c.features.structure for c in F32_CASES}
    assert structures == {"none", "causal", "window", "causal+window"}
    assert {c.features.sinks for c in F32_CASES} >= {"h", "hn", "n"}
    assert {c.features.bias for c in F32_CASES} >= {"bhqk", "1hqk", "b1qk", "11qk"}
    assert {c.features.mask for c in F32_CASES} >= {"bqk", "b1qk", "bhqk"}
    assert {c.shape for c in F32_CASES} == set(GQA_SHAPES + MHA_SHAPES)
    for dtype in ("bfloat16", "float16"):
        cases = [c for c in LOW_PRECISION_CASES if c.dtype == dtype]
        assert {c.shape.gqa for c in cases} == {True, False}, dtype
        assert any(c.features.causal for c in cases) and any(c.features.atoms for c in cases)
    assert {c.shape for c in VARLEN_CASES} == set(VARLEN_SHAPES)
    every = F32_CASES + LOW_PRECISION_CASES + VARLEN_CASES + LARGE_LOGIT_CASES
    assert len({c.id for c in every}) == len(every)


F32_EXP_OVERFLOW = float(np.log(np.finfo(np.float32).max))  # 88.72: exp of more is inf


def test_large_logit_cases_cover_the_plan():
    """Scores of +-200, a soft cap exceeded 5x, sinks above every score, in each dtype, with and
    without causal; each case's largest score or sink overflows float32's exp, and the inputs stay
    small enough for the CPU suite (S <= 96)."""
    cases = LARGE_LOGIT_CASES
    assert {c.dtype for c in cases} == {"float32", "bfloat16", "float16"}
    assert any(c.features.logits >= 200 and not c.features.atoms for c in cases)
    assert any(c.features.soft_cap and c.features.logits >= 5 * c.features.soft_cap for c in cases)
    assert any(c.features.sink_margin for c in cases)
    assert {c.features.causal for c in cases} == {True, False}
    for case in cases:
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
    "case", (F32_CASES[0],) + LARGE_LOGIT_CASES, ids=_ids((F32_CASES[0],) + LARGE_LOGIT_CASES)
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
    case = next(c for c in LOW_PRECISION_CASES if c.dtype == dtype and not c.features.atoms)
    rng = rng_for(case.id)
    diff, rest, static, ref_kwargs = make_inputs(case.features, case.shape, case.dtype, rng)
    d_out, d_lse = random_cotangents(case.shape, case.dtype, rng)
    out, lse, grads = run_vjp(_flash_attention(), diff, rest, {**static, "platform": "xla"}, d_out, d_lse)
    ref = oracle.attention(**_as_numpy(diff), **ref_kwargs, d_out=d_out, d_lse=d_lse)
    oracle.check_attention(out, lse, grads, ref, diff, dtype)
    assert assert_close(f"lse + {offset}", lse + offset, ref.lse, 1.0) < TOLERANCE[dtype]
    with pytest.raises(AssertionError, match="lse: relative error"):
        oracle.check_attention(out, lse + offset, grads, ref, diff, dtype)
