"""Segment keys at run time (docs/DESIGN.md §5, Segment keys): the ids' encoding (offset or ranks) keeps exactly the
pairs of equal values, whatever their sign and size, and keeps padding for the call's own padding only; a spec whose
key meets the call's segment ids (ranks of pairs), a key of booleans beside a second key and a key of two params
(ranks) against the float64 oracle; and the zoo's chunked local and Flamingo specs, whose keys leave no element mask,
taking the Hopper kernels on sm_90 (`explain`)."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from conftest import on_path
from ejgen.cli import main
from ejgen.ops import explain
from ejgen.runtime.attention import segment_key
from ejgen.testing.shapes import AttnShape, random_cotangents, random_qkv, rng_for
from ejgen.types import MaskInfo

pytestmark = pytest.mark.usefixtures("x64_stays_off")

I32 = np.iinfo(np.int32)


def _pairs(q_ids, kv_ids):
    """bool [B, Sq, Sk]: the pairs the kernels see (§3 step 4)."""
    q_ids, kv_ids = np.asarray(q_ids), np.asarray(kv_ids)
    return (q_ids[:, :, None] == kv_ids[:, None, :]) & (q_ids[:, :, None] >= 0)


@pytest.mark.parametrize("base", ["key", "query", None])
def test_ids_keep_exactly_the_equal_values(base):
    """Values of either sign (a floor division of -1 is -1; the extremes of int32 on the side ranks see): ids equal
    and non-negative exactly where the values are equal; a value outside the base side's range is -1 (it matches
    nothing); an offset keeps the base side's order (tiles of growing ids stay ranges)."""
    rng = np.random.default_rng(3)
    q = rng.integers(-4, 5, (2, 13)).astype(np.int32)
    kv = np.sort(rng.integers(-3, 4, (2, 11)), axis=1).astype(np.int32)
    if base is None:  # params may hold anything: ranks are exact for every int32
        q[0, :3], kv[0, :2] = [I32.min, I32.max, 7], [I32.max, I32.min]
    if base == "query":
        q, kv = kv, q
    q_ids, kv_ids = segment_key.encode(q, kv, base)
    _check_ids(q, kv, q_ids, kv_ids, base)
    if base == "key":
        assert np.all(np.diff(np.asarray(kv_ids), axis=1) >= 0) and np.asarray(kv_ids).max() <= 6
        outside = (q < kv.min(axis=1, keepdims=True)) | (q > kv.max(axis=1, keepdims=True))
        assert outside.any()
        np.testing.assert_array_equal(np.asarray(q_ids) == -1, outside)


def _check_ids(q, kv, q_ids, kv_ids, base):
    np.testing.assert_array_equal(_pairs(q_ids, kv_ids), q[:, :, None] == kv[:, None, :])
    other, ids = (q_ids, kv_ids) if base != "query" else (kv_ids, q_ids)
    assert np.all(np.asarray(ids) >= 0) and np.all(np.asarray(other) >= -1)


@pytest.mark.parametrize("base", ["key", "query"])
def test_ids_of_a_base_side_spanning_past_int32(base):
    """A base side whose values in one row span 2^31 or more (no overflow in the values themselves; their differences
    do not fit int32): ids still equal exactly where the values are (the call takes ranks), none of a token that a
    key matches is padding."""
    q = np.array([[-2**31 + 5, 2**30 + 7, 0], [1, 2, 3]], np.int32)
    kv = np.array([[-2**31 + 5, 2**30 + 7, 0, 2**31 - 1], [3, 3, 9, 1]], np.int32)
    if base == "query":
        q, kv = kv, q
    q_ids, kv_ids = segment_key.encode(q, kv, base)
    _check_ids(q, kv, q_ids, kv_ids, base)
    matched = (q[:, :, None] == kv[:, None, :]).any(axis=2)
    assert np.all(np.asarray(q_ids)[matched] >= 0)
    static = segment_key.encode(q, kv, base, wraps=True)  # decided while tracing: the same ids, no lax.cond
    np.testing.assert_array_equal(np.asarray(static[0]), np.asarray(q_ids))
    np.testing.assert_array_equal(np.asarray(static[1]), np.asarray(kv_ids))


def _scaled_key(scale):
    """A key whose sides are the positions times the option ``scale`` (the key side is the base)."""
    return segment_key.SegmentKey(lambda ctx, b, q_idx, kv_idx, q_len, kv_len: (q_idx * ctx["opt_scale"],
                                                                                kv_idx * ctx["opt_scale"]),
                                  "key", "q_idx * scale == kv_idx * scale")


def test_wrapping_is_decided_while_tracing_when_the_options_are_known():
    """A base side of positions and options: whether some row spans 2^31 or more is known while tracing (no
    `lax.cond`, whose predicate a GPU reads back to the host mid-call) where the options are Python values, and left
    to the device where they are traced."""
    key = _scaled_key(None)
    one, big = jnp.int32(1), jnp.int32(2**27)  # 21 positions x 2^27 span more than 2^31
    assert segment_key.static_wraps(key, {"opt_scale": one}, 2, 21, 21) is False
    assert segment_key.static_wraps(key, {"opt_scale": big}, 2, 21, 21) is True
    seen = []
    jax.jit(lambda s: seen.append(segment_key.static_wraps(key, {"opt_scale": s}, 2, 21, 21)) or s)(one)
    assert seen == [None]


def test_zoo_chunks_trace_without_a_conditional():
    """The zoo's chunked local spec with a Python chunk: its segment key's encoding has no `cond` in the program."""
    op = importlib.import_module("ejgen.zoo").chunked_local_attention
    q = jnp.zeros((1, 64, 2, 16), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda q: op(q, q, q, chunk=16, platform="triton"))(q)
    assert "cond" not in {e.primitive.name for e in jaxpr.jaxpr.eqns}, jaxpr


def test_ids_pair_with_the_calls_segment_ids():
    """The call's ids and the key's values together: equal ids exactly where both are equal and the call's query id
    is not padding; the call's padding stays negative; ids below Sq + Sk."""
    rng = np.random.default_rng(5)
    q, kv = rng.integers(-2, 3, (2, 17)).astype(np.int32), rng.integers(-2, 3, (2, 19)).astype(np.int32)
    q_user, kv_user = rng.integers(-1, 3, (2, 17)).astype(np.int32), rng.integers(-1, 3, (2, 19)).astype(np.int32)
    q[1, 0], kv[1, 0] = I32.min, I32.min  # extremes pair too
    q_user[1, 0], kv_user[1, 0] = 2, 2
    for base in ("key", None):
        q_ids, kv_ids = segment_key.encode(q, kv, base, q_user, kv_user)
        want = (q[:, :, None] == kv[:, None, :]) & (q_user[:, :, None] == kv_user[:, None, :]) & (q_user[:, :, None] >= 0)
        np.testing.assert_array_equal(_pairs(q_ids, kv_ids), want)
        assert want[1, 0, 0]
        np.testing.assert_array_equal(np.asarray(q_ids) < 0, q_user < 0)
        np.testing.assert_array_equal(np.asarray(kv_ids) < 0, kv_user < 0)
        assert np.asarray(q_ids).max() < 36 and np.asarray(kv_ids).max() < 36


SPECS = {
    "chunked_documents_attention": """\
doc: Causal within chunks of each packed document.
features:
  causal: runtime
  segment_ids: runtime
options:
  chunk: {type: int, default: 4}
mask: q_idx // chunk == kv_idx // chunk
""",
    "halves_attention": """\
doc: Queries of either half see keys of the same half and of their own type (a key of booleans, then one of params).
params:
  q_types: {shape: [batch, q_len], dtype: int32}
  kv_types: {shape: [batch, kv_len], dtype: int32}
options:
  half: {type: int, default: 8}
mask: (q_idx < half) == (kv_idx < half) and q_types[b, q_idx] == kv_types[b, kv_idx]
""",
    "typed_attention": """\
doc: A query sees the keys of its own type, types of any int32 value (ranks).
features:
  causal: runtime
params:
  q_types: {shape: [batch, q_len], dtype: int32}
  kv_types: {shape: [batch, kv_len], dtype: int32}
mask: q_types[b, q_idx] == kv_types[b, kv_idx]
""",
}


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    root = tmp_path_factory.mktemp("segment_keys")
    (root / "specs").mkdir()
    for name, body in SPECS.items():
        (root / "specs" / f"{name}.yaml").write_text(f"name: {name}\nfamily: attention\nbackends: [triton, pallas, xla]\n{body}")
    assert main(["build", str(root / "specs"), "-o", str(root / "keys_pkg")]) == 0
    with on_path(root):
        yield importlib.import_module("keys_pkg")


def _documents(batch, n, rng):
    ids = np.sort(rng.integers(0, 3, (batch, n)), axis=1).astype(np.int32)
    ids[:, -2:] = -1  # padding
    return ids


@pytest.mark.parametrize("case, backend", [("chunked_documents", "xla"), ("chunked_documents", "triton"),
                                           ("chunked_documents", "pallas"), ("halves", "xla"), ("typed", "xla")])
def test_keys_match_the_oracle(ops, run_vjp, case, backend):
    shape = AttnShape(2, 21, 21, 2, 2, 16)
    rng = rng_for("segment-key", case, backend)
    diff = random_qkv(shape, "float32", rng)
    d_out, d_lse = random_cotangents(shape, "float32", rng)
    b, s = shape.batch, shape.q_len
    if case == "chunked_documents":
        q_ids, kv_ids = _documents(b, s, rng), _documents(b, s, rng)
        rest, static = {"mask_info": MaskInfo.from_segments(q_ids, kv_ids), "chunk": 5}, {"causal": True}
        ref_kw = dict(causal=True, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                      mask=lambda ix, _: ix.q_idx // 5 == ix.kv_idx // 5)
    else:
        spread = [I32.min, -7, -1, 0, 3, I32.max] if case == "typed" else [0, 1, 2]
        q_types = np.asarray(rng.choice(spread, (b, s)), np.int32)
        kv_types = np.asarray(rng.choice(spread, (b, s)), np.int32)
        rest = {"q_types": q_types, "kv_types": kv_types}
        same = lambda ix: jnp.asarray(q_types)[ix.b, ix.q_idx] == jnp.asarray(kv_types)[ix.b, ix.kv_idx]  # noqa: E731
        if case == "halves":
            rest["half"], static = 9, {}
            ref_kw = dict(mask=lambda ix, _: ((ix.q_idx < 9) == (ix.kv_idx < 9)) & same(ix))
        else:
            static = {"causal": True}
            ref_kw = dict(causal=True, mask=lambda ix, _: same(ix))
    op = getattr(ops, f"{case}_attention")
    out, lse, grads = run_vjp(op, diff, rest, {**static, "platform": backend}, d_out, d_lse)
    ref = oracle.attention(**{n: np.asarray(x) for n, x in diff.items()}, **ref_kw, d_out=d_out, d_lse=d_lse)
    empty = oracle.check_attention(out, lse, grads, ref, diff, "float32")
    assert not empty.all() and (empty.any() or case != "chunked_documents"), "padding rows see nothing, others keys"


def test_the_choice_names_the_key(ops):
    q = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.float32)
    ids = jnp.zeros((1, 64), jnp.int32)
    choice = explain(ops.chunked_documents_attention, q, q, q, mask_info=MaskInfo.from_segments(ids), causal=True)
    assert choice.reasons[-1] == ("mask ((q_idx // chunk) == (kv_idx // chunk)) (paired with the call's segment ids): "
                                  "as segment ids (docs/DESIGN.md §5, Segment keys)")
    choice = explain(ops.typed_attention, q, q, q, q_types=ids, kv_types=ids)
    assert choice.reasons[-1].startswith("mask (q_types[b, q_idx] == kv_types[b, kv_idx]): as segment ids")


@pytest.mark.parametrize("name, kwargs", [
    ("chunked_local_attention", dict(chunk=256)),
    ("flamingo_cross_attention", dict(latest=jax.ShapeDtypeStruct((1, 1024), jnp.int32), image_tokens=64)),
])
def test_zoo_keys_take_the_hopper_kernels(name, kwargs):
    """Chunks and images are segment ids and nothing of the mask is left: on sm_90 both passes take the Hopper set
    (before the pass: the generated kernels, "the spec has a mask of its own")."""
    op = getattr(importlib.import_module("ejgen.zoo"), name)
    q = jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
    choice = explain(op, q, kv, kv, target="sm90", **kwargs)
    assert (choice.platform, choice.forward, choice.backward) == ("triton", "gluon", "gluon"), choice.text()
    assert "as segment ids" in choice.reasons[-1]
