"""The Pallas backend on a CPU: its GPU kernels (Triton lowering) and its TPU kernels (Mosaic), run
with ``interpret=True`` against the float64 oracle, and both lowerings produced with ``jax.export``.

The GPU kernels run the conformance design of ``test_conformance`` (platform pallas). Here the TPU
kernels run a small cover of docs/DESIGN.md §3 through the same harness (``interpret_kernels("tpu")``):
every feature with all its gradients (bias, sinks and params included), GQA and MHA, odd lengths, f32
and 16-bit, varlen, rows that see nothing, authored variants.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas import tpu as pltpu

import oracle
import test_conformance as conformance
import test_variants as variants
from ejgen.runtime.attention.pallas import common as pallas_attention
from ejgen.types import MaskInfo
from ejgen.testing.shapes import GQA_SHAPES, MHA_SHAPES, VARLEN_SHAPES, rng_for

Features, Case = conformance.Features, conformance.Case
CAP = conformance.CAP
G0 = GQA_SHAPES[0]  # 63 x 65 GQA 4:2
M0, M1 = MHA_SHAPES[:2]  # 45 x 45 with Dv != D; 33 queries, 1 key

KERNELS = ("gpu", "tpu")


def _tpu(cases):
    return pytest.mark.parametrize("case", cases, ids=[c.id for c in cases])


TPU_CASES = (
    Case(Features(causal=True), G0),
    Case(Features(window=(8, 4), **CAP), M0),
    Case(Features(causal=True, sinks="hn"), M1),  # Sq > Sk: causal leaves rows with the sinks only
    Case(Features(causal=True, bias="1hqk"), M0),
    Case(Features(sinks="h", segments="random"), M0),
    Case(Features(window=(8, 4), mask="bhqk"), G0),
    # every feature at once in float32: `test_tpu_kernels_in_the_tpu_interpreter` (the same case, the stricter
    # interpreter)
    Case(Features(sinks="n", bias="11qk", mask="bqk", **CAP), M0),
    Case(Features(causal=True, window=(20, 0), sinks="hn", bias="b1qk", segments="packed", **CAP), G0, "bfloat16"),
    Case(Features(causal=True, sinks="hn", **CAP), VARLEN_SHAPES[0]),
)


@_tpu(TPU_CASES)
def test_tpu_kernels(run_vjp, case):
    with pallas_attention.interpret_kernels("tpu"):
        conformance.run_case(case, "pallas", run_vjp)


@pytest.mark.parametrize("how", ["segments", "causal_sq_gt_sk"])
def test_fully_masked_rows_on_the_tpu_kernels(run_vjp, how):
    with pallas_attention.interpret_kernels("tpu"):
        conformance.check_fully_masked_rows("pallas", run_vjp, how, "h" if how == "segments" else None)


VARIANT_CASES = (
    variants.VariantCase("alibi_attention", G0, causal=True, segments=True),
    variants.VariantCase("relative_bias_attention", M0, causal=True, options=(("bias_scale", -2.0),)),
    variants.VariantCase("prefix_lm_attention", G0, sinks="h", options=(("prefix_len", 20),)),
)


@_tpu(VARIANT_CASES)
def test_variant_on_the_tpu_kernels(run_vjp, case):
    """Authored variants: score hooks with param gradients (one param read by position), a spec
    mask with an option."""
    with pallas_attention.interpret_kernels("tpu"):
        variants.test_variant_matches_oracle("pallas", run_vjp, case)


EVERY_FEATURE = Case(Features(causal=True, window=(20, 0), sinks="hn", bias="b1qk", segments="packed", **CAP), G0)


def test_tpu_kernels_in_the_tpu_interpreter(run_vjp):
    """The TPU kernels under Pallas' TPU interpreter, which models DMAs and block revisits and
    fills uninitialised memory with NaN: every feature at once, GQA, odd lengths (TPU_CASES' float32 case of every
    feature: the same check, stricter)."""
    case = EVERY_FEATURE
    with pallas_attention.interpret_kernels("tpu", pltpu.InterpretParams()):
        conformance.run_case(case, "pallas", run_vjp)


def test_kernel_families_agree_and_are_deterministic():
    """The GPU and TPU kernels give the same numbers (up to summation order), and each gives
    bit-identical gradients, params included, when run twice."""
    case = variants.VariantCase("relative_bias_attention", G0, causal=True)
    op = variants._variant(case.variant)
    diff, rest, static, _ = variants.make_case_inputs(case, rng_for("families", case.id))

    def loss(diff, rest):
        q, k, v = diff["query"], diff["key"], diff["value"]
        params = {n: x for n, x in diff.items() if n not in ("query", "key", "value")}
        out, lse = op(q, k, v, **params, **rest, **static, platform="pallas", return_lse=True)
        return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(lse))

    results = {}
    for family in KERNELS:
        with pallas_attention.interpret_kernels(family):
            grad = jax.jit(jax.grad(loss))
            runs = [grad(diff, rest) for _ in range(2)]
        for name in diff:
            np.testing.assert_array_equal(runs[0][name], runs[1][name], err_msg=f"{family} d{name}: not deterministic")
        results[family] = runs[0]
    for name in diff:
        oracle.assert_close(f"d{name}: gpu vs tpu kernels", results["gpu"][name], results["tpu"][name],
                            oracle.TOLERANCE["float32"])


# Lowering for GPUs and TPUs on a machine that has neither: block shapes, Mosaic tiling and every
# lowering rule are checked; Triton's kernels are emitted as TTIR (compiled to PTX at load time).


@dataclasses.dataclass(frozen=True)
class Lowering:
    op: str
    static: tuple = ()  # (name, value) pairs
    extra: tuple = ()  # names of extra inputs, built by `_extra`
    varlen: bool = False

    @property
    def id(self) -> str:
        parts = [self.op.removesuffix("_attention")] + [n for n, _ in self.static] + list(self.extra)
        return "-".join(parts + (["varlen"] if self.varlen else []))


LOWERINGS = (
    Lowering("flash_attention", (("causal", True), ("sliding_window", (64, 0)), ("logits_soft_cap", 20.0)),
             ("softmax_aux", "bias", "segments")),
    Lowering("flash_attention", (), ("dense_mask",)),
    Lowering("flash_attention", (("causal", True),), ("softmax_aux",), varlen=True),
    Lowering("relative_bias_attention", (("causal", True),), ("rel_table",)),
    Lowering("alibi_attention", (), ("slopes",)),
    Lowering("prefix_lm_attention", (), ("softmax_aux",)),
    Lowering("local_softcap_sinks_attention", (), ("softmax_aux",)),
)
B, S, HQ, HKV, D = 2, 384, 4, 2, 64  # three TPU blocks of 128, a GPU grid of several blocks


def _extra(name, dtype):
    sds = jax.ShapeDtypeStruct
    return {
        "softmax_aux": lambda: {"softmax_aux": sds((HQ, 2), jnp.float32)},
        "bias": lambda: {"bias": sds((1, HQ, S, S), dtype)},
        "segments": lambda: {"mask_info": MaskInfo(sds((B, S), jnp.int32), sds((B, S), jnp.int32))},
        "dense_mask": lambda: {"mask_info": MaskInfo(attention_mask=sds((B, 1, S, S), jnp.bool_))},
        "rel_table": lambda: {"rel_table": sds((HQ, 33), jnp.float32)},
        "slopes": lambda: {"slopes": sds((HQ,), jnp.float32)},
    }[name]()


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("case", LOWERINGS, ids=[c.id for c in LOWERINGS])
def test_export(platform, case):
    """jax.export of the op and of its gradient for a platform this machine does not have."""
    op = variants._variant(case.op)
    dtype = jnp.bfloat16
    extra = {}
    for name in case.extra:
        extra.update(_extra(name, dtype))
    static = dict(case.static, platform="pallas")
    lead = ()
    if case.varlen:
        extra.update(cu_seqlens_q=jax.ShapeDtypeStruct((4,), jnp.int32), cu_seqlens_k=jax.ShapeDtypeStruct((4,), jnp.int32))
        static.update(max_seqlen_q=S, max_seqlen_k=S)
    else:
        lead = (B,)
    q = jax.ShapeDtypeStruct(lead + (S, HQ, D), dtype)
    kv = jax.ShapeDtypeStruct(lead + (S, HKV, D), dtype)

    def fwd(q, k, v, extra):
        return op(q, k, v, **extra, **static)

    def loss(q, k, v, extra):
        return jnp.sum(fwd(q, k, v, extra).astype(jnp.float32))

    # The Triton call's custom call has no compatibility guarantee; jax.export asks to be told.
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    target = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}[platform]
    for name, fn, kernels in (("forward", fwd, 1), ("gradient", jax.grad(loss, argnums=(0, 1, 2, 3), allow_int=True), 3)):
        exported = export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(q, kv, kv, extra)
        found = exported.mlir_module().count(f"@{target}(")
        assert found == kernels, f"{name}: {found} Pallas kernels lowered for {platform}, expected {kernels}"


@pytest.mark.parametrize("bias,dense", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("d,dv", [(72, 40), (128, 128), (48, 48), (256, 256)])
def test_gpu_blocks_fit_shared_memory_with_streamed_tiles(bias, dense, d, dv):
    """A bias (float32) or dense mask (int8) tile per step besides q/k/v: the GPU kernels' tiles shrink
    until the multi-buffered steps fit one thread block's shared memory (seen on an H200: the forward's
    128x128 x 3 stages at D=72 with a bias asked for 240 KB, 227 KB available)."""
    from ejgen.runtime.attention.pallas import gpu as pk

    cfg = type("Cfg", (), {"bias": bias, "dense_mask": dense})()
    plain = type("Cfg", (), {"bias": False, "dense_mask": False})()
    tile = 4 * bias + dense
    for kernel in ("fwd", "dkdv", "dq"):
        table = pk.BlockSizes.get_default(kernel, max(d, dv), jnp.bfloat16)
        assert pk.gpu_blocks(kernel, d, dv, jnp.bfloat16, plain) == table  # nothing streamed: the table
        b = pk.gpu_blocks(kernel, d, dv, jnp.bfloat16, cfg)
        assert pk.gpu_shared_bytes(kernel, b, d, dv, jnp.bfloat16, cfg) <= pk.GPU_SHARED_MEMORY, (kernel, b)
        # the estimate counts the streamed tile: at the table's tiles it is that much over the plain one
        assert (pk.gpu_shared_bytes(kernel, table, d, dv, jnp.bfloat16, cfg)
                == pk.gpu_shared_bytes(kernel, table, d, dv, jnp.bfloat16, plain)
                + table.num_stages * table.block_q * table.block_k * tile), kernel
        assert b.block_q <= table.block_q and b.block_k <= table.block_k and b.num_stages <= table.num_stages
        assert pk.gpu_blocks(kernel, d, dv, jnp.bfloat16, cfg, interpret=True) == pk.INTERPRET_BLOCKS
    if bias:
        fwd = pk.gpu_blocks("fwd", 72, 40, jnp.bfloat16, cfg)
        assert (fwd.block_k, fwd.num_stages) != (128, 3)  # the configuration that failed on the GPU
