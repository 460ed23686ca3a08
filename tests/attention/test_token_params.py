"""Params read by token position (docs/DESIGN.md §5, Printers): ``types[b, kv_idx]`` over [batch, kv_len],
``latest[b, q_idx]`` over [batch, q_len], float per-token biases and scales, a per-(head, key) row, a long int dim
read at a scaled position (clamped), on every backend against the float64 oracle, forward and backward, odd
lengths (the Pallas inputs are padded to whole blocks); the Pallas kernels read such params by block (token views),
both kernel families, and both lower for GPUs and TPUs. What the Pallas backend still cannot read, and a gradient
through a read by position past the gather's bound, fail the build at the param with what to write instead."""

from __future__ import annotations

import contextlib
import importlib
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import oracle
from conftest import on_path
from ejgen.cli import main
from ejgen.runtime.attention.pallas import common as pallas_kernels
from ejgen.testing.shapes import AttnShape, random_cotangents, random_qkv, rng_for

pytestmark = pytest.mark.usefixtures("x64_stays_off")

TOKENS = """\
name: token_types_attention
family: attention
doc: >
  Token-level params: a key sees a query of its own type (the first key is seen by all), a bias per key,
  a scale per (head, query), a row per (head, key), a long table read at a scaled key position (clamped); beside
  them, reads the Pallas kernels gather (a small table by distance, one with a gradient).
features:
  causal: runtime
  gqa: runtime
params:
  types: {shape: [batch, kv_len], dtype: int32}
  q_types: {shape: [batch, q_len], dtype: int32}
  kv_bias: {shape: [batch, kv_len], dtype: float32}
  q_scale: {shape: [heads, q_len], dtype: float32}
  head_row: {shape: [heads, kv_len], dtype: float32}
  long_w: {shape: [600], dtype: float32}
  rel: {shape: [heads, 9], dtype: float32}
  w: {shape: [heads, 8], dtype: float32, grad: true}
score: >
  s * q_scale[h, q_idx] + kv_bias[b, kv_idx] + head_row[h, kv_idx] + long_w[kv_idx * 16 - 5]
  + rel[h, clamp(q_idx - kv_idx, -4, 4) + 4] + w[h, kv_idx % 8]
mask: types[b, kv_idx] == q_types[b, q_idx] or kv_idx == 0
"""

FLAMINGO = """\
name: latest_image_attention
family: attention
doc: >
  Flamingo's cross-attention: a text token sees the image tokens (4 per image) of the latest image before
  it, latest[b, q_idx] (-1: none yet, the row sees nothing).
features:
  gqa: runtime
params:
  latest: {shape: [batch, q_len], dtype: int32}
mask: kv_idx // 4 == latest[b, q_idx]
"""

B, SQ, SK, HQ, HKV = 2, 37, 41, 4, 2
LONG = 600


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    root = tmp_path_factory.mktemp("token_params")
    (root / "specs").mkdir()
    (root / "specs" / "tokens.yaml").write_text(TOKENS)
    (root / "specs" / "flamingo.yaml").write_text(FLAMINGO)
    assert main(["build", str(root / "specs"), "-o", str(root / "token_pkg")]) == 0
    with on_path(root):
        yield importlib.import_module("token_pkg")


def _tokens_case(shape, dtype, rng):
    """(diff, params, score, mask) of the token-types spec: params as the op takes them, the oracle's hooks
    reading them as the DSL does (every index clamped into its dim)."""
    diff = random_qkv(shape, dtype, rng)
    b, sq, sk, hq = shape.batch, shape.q_len, shape.kv_len, shape.q_heads
    params = {
        "types": jnp.asarray(rng.integers(0, 3, (b, sk)), jnp.int32),
        "q_types": jnp.asarray(rng.integers(0, 3, (b, sq)), jnp.int32),
        "kv_bias": jnp.asarray(rng.standard_normal((b, sk)), jnp.float32),
        "q_scale": jnp.asarray(rng.uniform(0.5, 2.0, (hq, sq)), jnp.float32),
        "head_row": jnp.asarray(rng.standard_normal((hq, sk)), jnp.float32),
        "long_w": jnp.asarray(rng.standard_normal(LONG), jnp.float32),
        "rel": jnp.asarray(rng.standard_normal((hq, 9)), jnp.float32),
    }
    host = {n: np.asarray(x) for n, x in params.items()}
    p = lambda name: jnp.asarray(host[name])  # inside the oracle's float64 context
    diff["w"] = jnp.asarray(rng.standard_normal((hq, 8)), jnp.float32)  # differentiated: the oracle's params

    def score(s, ix, diff_params, _options):
        s = (s * oracle.param_at(p("q_scale"), ix.h, ix.q_idx) + oracle.param_at(p("kv_bias"), ix.b, ix.kv_idx)
             + oracle.param_at(p("head_row"), ix.h, ix.kv_idx) + oracle.param_at(p("long_w"), ix.kv_idx * 16 - 5))
        s = s + oracle.param_at(p("rel"), ix.h, jnp.clip(ix.q_idx - ix.kv_idx, -4, 4) + 4)
        return s + oracle.param_at(diff_params["w"], ix.h, ix.kv_idx % 8)

    def mask(ix, _options):
        same = oracle.param_at(p("types"), ix.b, ix.kv_idx) == oracle.param_at(p("q_types"), ix.b, ix.q_idx)
        return jnp.logical_or(same, ix.kv_idx == 0)

    return diff, params, score, mask


def _flamingo_case(shape, dtype, rng):
    diff = random_qkv(shape, dtype, rng)
    # images at random places in the text: the latest one so far, -1 before the first (rows that see nothing)
    starts = np.sort(rng.integers(0, shape.q_len, (shape.batch, shape.kv_len // 4)), axis=1)
    latest = np.stack([np.searchsorted(row, np.arange(shape.q_len), side="right") - 1 for row in starts])
    params = {"latest": jnp.asarray(latest, jnp.int32)}

    def mask(ix, _options):
        return ix.kv_idx // 4 == oracle.param_at(jnp.asarray(latest), ix.b, ix.q_idx)

    return diff, params, None, mask


CASES = {
    "tokens": ("token_types_attention", _tokens_case, {"causal": True}),
    "flamingo": ("latest_image_attention", _flamingo_case, {}),
}


def _kernels(backend):
    """(the op's platform, the context that picks the Pallas kernel family interpreted on this CPU)."""
    if backend.startswith("pallas-"):
        return "pallas", pallas_kernels.interpret_kernels(backend.split("-")[1])
    return backend, contextlib.nullcontext()


@pytest.mark.parametrize("dtype", ["float32"])
@pytest.mark.parametrize("backend", ["xla", "triton", "pallas-gpu", "pallas-tpu"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_token_params_match_the_oracle(ops, run_vjp, case, backend, dtype):
    check(ops, run_vjp, case, backend, dtype, AttnShape(B, SQ, SK, 2, 1, 16))


def test_token_params_in_bfloat16(ops, run_vjp):
    check(ops, run_vjp, "tokens", "pallas-gpu", "bfloat16", AttnShape(1, 40, 33, 2, 1, 16))


def check(ops, run_vjp, case, backend, dtype, shape):
    name, make, static = CASES[case]
    rng = rng_for("token-params", case, backend, dtype)
    diff, params, score, mask = make(shape, dtype, rng)
    d_out, d_lse = random_cotangents(shape, dtype, rng)
    platform, kernels = _kernels(backend)
    with kernels:
        out, lse, grads = run_vjp(getattr(ops, name), diff, params, {**static, "platform": platform}, d_out, d_lse)
    qkv = {n: np.asarray(diff[n]) for n in ("query", "key", "value")}
    grad_params = {n: np.asarray(x) for n, x in diff.items() if n not in qkv}
    ref = oracle.attention(**qkv, score=score, mask=mask, params=grad_params, **static, d_out=d_out, d_lse=d_lse)
    empty = oracle.check_attention(out, lse, grads, ref, diff, dtype)
    if case == "flamingo":
        assert empty.any() and not empty.all(), "the case has rows that see nothing and rows that see images"


def test_token_params_lower_for_gpus_and_tpus(ops):
    """jax.export of the op and its gradient, three TPU blocks of 128 and several GPU blocks: the token views'
    BlockSpecs respect Mosaic's tiling and the Triton lowering's one indexer per load."""
    op = ops.token_types_attention
    s, d = 384, 64
    sds = jax.ShapeDtypeStruct
    q, kv = sds((B, s, HQ, d), jnp.bfloat16), sds((B, s, HKV, d), jnp.bfloat16)
    params = {"types": sds((B, s), jnp.int32), "q_types": sds((B, s), jnp.int32), "kv_bias": sds((B, s), jnp.float32),
              "q_scale": sds((HQ, s), jnp.float32), "head_row": sds((HQ, s), jnp.float32),
              "long_w": sds((LONG,), jnp.float32), "rel": sds((HQ, 9), jnp.float32), "w": sds((HQ, 8), jnp.float32)}

    def fwd(q, k, v, params):
        return op(q, k, v, **params, causal=True, platform="pallas")

    def loss(q, k, v, params):
        return jnp.sum(fwd(q, k, v, params).astype(jnp.float32))

    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for platform, target in (("cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu_custom_call")):
        for what, fn, kernels in (("forward", fwd, 1), ("gradient", jax.grad(loss, argnums=(0, 1, 2)), 3)):
            exported = export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(q, kv, kv, params)
            found = exported.mlir_module().count(f"@{target}(")
            assert found == kernels, f"{what}: {found} Pallas kernels lowered for {platform}, expected {kernels}"


def _build(tmp_path, capsys, body: str, backends: str):
    """Build one spec (``body`` after its name and family, with ``backends``): (exit status, stderr, path)."""
    folder = tmp_path / f"specs_{re.sub(r'[^a-z]', '', backends)}"
    folder.mkdir()
    path = folder / "spec.yaml"
    path.write_text(f"name: refused_attention\nfamily: attention\nbackends: {backends}\n" + textwrap.dedent(body))
    capsys.readouterr()
    rc = main(["build", str(folder), "-o", str(tmp_path / f"out_{folder.name}")])
    return rc, capsys.readouterr().err, path


def test_a_read_by_both_positions_past_the_gather_is_refused_at_the_param(tmp_path, capsys):
    """A [q_len, kv_len] table read by both positions: one select per value of a long dim. The Pallas build fails
    at the param (line 6, column 3), saying what the spec can write instead; Triton and XLA read it."""
    body = """\
        params:
          qs: {shape: [q_len], dtype: float32}
          table: {shape: [q_len, kv_len], dtype: float32}
        score: s * qs[q_idx] + table[q_idx, kv_idx]
    """
    rc, err, path = _build(tmp_path, capsys, body, "[pallas, xla]")
    assert rc == 1 and "Traceback" not in err
    assert err.startswith(f"{path}:6:3: the pallas backend cannot read table[q_idx, kv_idx]: its indices depend on "
                          f"both a query and a key position"), err
    for hint in ("(here: q_len, kv_len)", "`table[b, kv_idx]`", "enable `bias: runtime`", "`backends: [triton, xla]`"):
        assert hint in err, (hint, err)
    assert _build(tmp_path, capsys, body, "[triton, xla]")[0] == 0


def test_a_gradient_through_a_token_read_is_refused_as_on_triton(tmp_path, capsys):
    """``grad: true`` on a param read by position over [batch, q_len]: neither kernel backend reduces it per
    program; both say so in the same words, at the param."""
    body = """\
        params:
          types: {shape: [batch, kv_len], dtype: int32}
          q_scale: {shape: [batch, q_len], dtype: float32, grad: true}
        score: s * q_scale[b, q_idx]
        mask: types[b, kv_idx] >= 0
    """
    said = {}
    for backend in ("pallas", "triton"):
        rc, err, path = _build(tmp_path, capsys, body, f"[{backend}, xla]")
        assert rc == 1 and "Traceback" not in err
        head = f"{path}:6:3: the {backend} backend cannot reduce the gradient of q_scale[b, q_idx] deterministically"
        assert err.startswith(head), err
        said[backend] = err.split(": ", 1)[1].replace(backend, "<backend>")
    assert said["pallas"] == said["triton"]
    assert "`bias: runtime`" in said["pallas"] and "`backends: [xla]`" in said["pallas"]
