"""The recurrent ops (docs/DESIGN.md §3 linear recurrent) against the float64 oracle, forward and every gradient
(q, k, v, each gate, initial_state, and through final_state), under jit: every gate alone and all together, the
initial state, reverse, packed sequences with empty and length-1 ones and tokens past the last sequence, T not a
multiple of the chunk, shared K/V heads, K != V, float32 / bfloat16 / float16, both algorithms; strongly negative
gates (-20 per step) stay finite and accurate; T = 4096 does not drift; chunked equals fused; two calls through
final_state equal one call, forward and gradients; XLA's forward of one chunk from the zero state, compiled
afresh (issue 17: XLA:CPU misread it).

Shapes are the smallest that cut sequences into several chunks and sub-chunks (chunks of 16 and 32 steps); XLA
compiles each case once (seconds), so the cases cover the factors pairwise rather than as a product.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import recurrent_oracle as oracle
from recurrent_cases import (HOOKED_ORACLE, Case, built_ops, check, check_forward, check_state_untouched, inputs,
                             run)
from conftest import on_path
from ejgen import generated
from ejgen.ops import explain

pytestmark = pytest.mark.usefixtures("x64_stays_off")

ALL = ("g", "g_gamma", "gk", "gv")
PACKED = (0, 5, 5, 22, 23, 40)  # five sequences: 5, 0 (empty), 17, 1, 17 steps; one trailing token of none
SHORT = (0, 3, 3, 20, 21)  # four sequences: 3, 0, 17 (two chunks of 16), 1 steps; two trailing tokens of none
FUSED = {"algorithm": "fused", "chunk": None}
XLA_CASES = (
    Case("recurrent", ALL, h0=True),
    Case("recurrent", ALL, shape=(1, 41, 4, 2, 16, 24), cu=PACKED, h0=True, reverse=True),
    Case("gla", ("gk",), dtype="bfloat16", shape=(2, 70, 2, 2, 32, 16), chunk=32),
    Case("simple_gla", ("g",), dtype="float16", h0=True, reverse=True),
    Case("lightning_attention", ("g_gamma",), shape=(1, 130, 4, 1, 16, 16), chunk=64, h0=True),
    Case("linear_attention", (), shape=(1, 41, 2, 1, 16, 16), cu=PACKED, h0=True),
    Case("recurrent", ("gv",), dtype="bfloat16", shape=(1, 48, 2, 1, 16, 32), reverse=True),
)
# Triton's interpreter runs every program of a grid one after the other: the smallest shapes that still cut a
# sequence into two chunks of two sub-chunks (chunks of 32), GQA, K != V, packed with empty and length-1 sequences
TRITON_CASES = (
    Case("gla", ("gk",), shape=(1, 37, 2, 1, 16, 16), chunk=32, h0=True),
    Case("recurrent", ("g", "g_gamma", "gk"), shape=(1, 23, 2, 2, 16, 24), cu=SHORT, h0=True, reverse=True),
    Case("recurrent", ALL, shape=(1, 12, 2, 1, 16, 16), cu=(0, 3, 3, 8, 9, 11), h0=True, reverse=True, **FUSED),
    Case("simple_gla", ("g", "g_gamma"), dtype="bfloat16", shape=(1, 40, 2, 2, 16, 32), chunk=32, h0=True),
    # gk in bfloat16 (TF32 products) in chunks of 64: four sub-chunks, each in four pieces (`_intra_grads`)
    Case("gla", ("gk",), dtype="bfloat16", shape=(1, 70, 2, 1, 32, 16), chunk=64),
)
ELU1 = {"feature_map": lambda x: jnp.where(x > 0, x + 1.0, jnp.exp(x))}  # elu(x) + 1, by hand


def _hooks(case):
    return ELU1 if case.op == "linear_attention" else None


@pytest.mark.parametrize("case", XLA_CASES, ids=[c.id for c in XLA_CASES])
def test_xla_against_the_oracle(case):
    check(case, "xla", hooks=_hooks(case))


ONE_CHUNK = (  # steps within one chunk of four sub-chunks, no initial_state (issue 17)
    Case("gla", ("gk",), shape=(1, 64, 4, 4, 32, 32), chunk=64),
    Case("recurrent", ("gk", "gv"), shape=(1, 37, 2, 2, 32, 32), chunk=64, reverse=True),
)


@pytest.mark.parametrize("case", ONE_CHUNK, ids=[c.id for c in ONE_CHUNK])
def test_xla_forward_of_one_chunk_from_the_zero_state(case):
    """The forward alone under jit, compiled three times (each compilation a new draw): the scan runs once, XLA
    unrolls it, and the zero state would reach o's product q S as broadcast(0), which XLA:CPU's YNNPACK fusion read
    as garbage (up to 1e36 or NaN) in about two compilations of three (xla._opaque). o and final_state against the
    oracle every time."""
    x, d_out, d_final = inputs(case)
    o_ref, final_ref, _ = oracle.recurrent(x, d_out, d_final, reverse=case.reverse)
    args = {n: jnp.asarray(a) for n, a in x.items()}
    op = getattr(generated, case.op)
    for _ in range(3):
        o, final = jax.jit(lambda a: op(a.pop("query"), a.pop("key"), a.pop("value"), **a, platform="xla",
                                        **case.kwargs()))(dict(args))
        oracle.assert_close("o", o, o_ref, case.dtype)
        oracle.assert_close("final_state", final, final_ref, case.dtype)


@pytest.fixture
def launched(monkeypatch):
    """The names of the Triton kernels a test launches (a spy on ``triton_call.launch``)."""
    from ejgen.runtime.launch import triton_call

    names, launch = [], triton_call.launch

    def spy(kernel, *args, **kwargs):
        names.append(kernel.__name__)
        return launch(kernel, *args, **kwargs)

    monkeypatch.setattr(triton_call, "launch", spy)
    return names


@pytest.mark.parametrize("case", TRITON_CASES, ids=[c.id for c in TRITON_CASES])
def test_triton_against_the_oracle(case, launched):
    check(case, "triton", hooks=_hooks(case))
    kinds = {"fused" if "_fused_" in n else "chunked" for n in launched}
    assert kinds == {case.algorithm}, f"the call ran {launched}, not its {case.algorithm} kernels"


@pytest.mark.parametrize("case", [
    Case("gla", ("gk",), shape=(1, 37, 2, 1, 32, 48), chunk=32, h0=True),
    Case("simple_gla", ("g", "g_gamma"), dtype="bfloat16", shape=(1, 20, 2, 2, 32, 32), chunk=16, reverse=True),
], ids=lambda c: c.id)
def test_triton_chunked_kernels_by_blocks(case, monkeypatch):
    """The chunked kernels' programs by blocks of K and V (the state kernels, dq / dk and their log decay gradient by
    blocks of K, o and dv by blocks of V, chunk_intra's rows summed over blocks of K; the GPU's blocks are 32 to 64
    wide): 16-wide blocks here, so every kernel sees two or three of each, against the oracle."""
    from ejgen.runtime.recurrent.triton import host

    small = {n: host.Tiles(16 if t.block_k or n == "chunk_intra" else 0, 16 if t.block_v else 0, t.num_warps,
                           t.num_stages) for n, t in host.CHUNKED.items()}
    monkeypatch.setattr(host, "CHUNKED", small)
    check(case, "triton")


DIAGONAL_CASES = (  # 16-bit with the gates' sums (`_intra_fast`; a chunk whose last sub-chunk ends inside a piece),
    # and float32 packed and reversed (`_intra`)
    Case("gla", ("gk",), dtype="bfloat16", shape=(1, 42, 1, 1, 16, 16), chunk=32, h0=True),
    Case("recurrent", ("g", "gk"), shape=(1, 23, 2, 1, 16, 16), cu=SHORT, reverse=True),
)


@pytest.mark.parametrize("case", DIAGONAL_CASES, ids=[c.id for c in DIAGONAL_CASES])
def test_triton_chunk_intra_diagonal_forms(case, monkeypatch, launched):
    """chunk_intra's diagonal blocks formed by a launch of their own (host.CHUNK_INTRA_DIAGONAL "kernel",
    `chunk_intra_diag`) that chunk_intra reads: outputs and gradients equal to the inline form's bit for bit (the same
    sums in the same order); for 16-bit inputs that kernel's blocks in pieces of 4 steps (host.CHUNK_INTRA_PIECES:
    products between the pieces) against the oracle and within TF32's rounding of the inline form, and the pieces
    formed in chunk_intra itself equal to them; else the kernel form against the oracle."""
    from ejgen.runtime.recurrent.triton import host

    x, d_out, d_final = inputs(case, 0)
    op = getattr(generated, case.op)
    monkeypatch.setattr(host, "CHUNK_INTRA_DIAGONAL", "inline")
    monkeypatch.setattr(host, "CHUNK_INTRA_PIECES", False)
    inline = run(op, case, x, d_out, d_final, "triton")
    assert "chunk_intra_diag" not in " ".join(launched)
    monkeypatch.setattr(host, "CHUNK_INTRA_DIAGONAL", "kernel")
    launched.clear()
    kernel = run(op, case, x, d_out, d_final, "triton") if case.dtype != "float32" else check(case, "triton")
    # the forward's (the backward reads A as the forward kept it, and forms dA alone)
    assert sum(n.endswith("_chunk_intra_diag_kernel") for n in launched) == 1, launched
    for name, got, ref in [("o", kernel[0], inline[0]), ("final_state", kernel[1], inline[1])] + \
            [(f"d{n}", kernel[2][n], inline[2][n]) for n in kernel[2]]:
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32), err_msg=name)
    if case.dtype != "float32":
        monkeypatch.setattr(host, "CHUNK_INTRA_PIECES", True)
        o, _, _ = check(case, "triton")
        np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(inline[0], np.float32), rtol=2e-2,
                                   atol=2e-2)
        monkeypatch.setattr(host, "CHUNK_INTRA_DIAGONAL", "inline")  # the pieces in chunk_intra itself: the same
        np.testing.assert_array_equal(np.asarray(run(op, case, x, d_out, d_final, "triton")[0], np.float32),
                                      np.asarray(o, np.float32))


GRADS_SUMS_CASES = (  # 16-bit gk with the gates' sums, chunks of 64 (four sub-chunks, each meeting those before and
    # after it): packed (an empty sequence, partial chunks and sub-chunks), reversed, GQA, log gates down to -20 a step
    # (the sums cover every key-side gate alike: gk with a scalar gate runs on the GPU host, test_recurrent_gpu.py)
    Case("gla", ("gk",), dtype="bfloat16", shape=(1, 80, 2, 1, 16, 16), chunk=64, cu=(0, 50, 50, 77), reverse=True,
         strong=True),
)


@pytest.mark.parametrize("sums", [True, False], ids=["prefix-sums", "scanned-gates"])
@pytest.mark.parametrize("case", GRADS_SUMS_CASES, ids=[c.id for c in GRADS_SUMS_CASES])
def test_triton_grads_intra_from_the_prefix_sums(case, sums, monkeypatch):
    """chunk_grads_intra's exponents between sub-chunks from `chunk_sums`' prefix sums (host.GRADS_INTRA_SUMS, the
    default since session 28) and from the gates scanned again (False): every gradient against the oracle; the spy
    shows the backward launched that form. The gla case's gates of -20 a step over sequences that end inside a chunk
    also hold the forward's 16-bit forms to finite results (before, a sub-chunk past the end read P_b as 0, and rows
    past it took 2^{-(P_j - P_b)}: A's rows there were NaN, and dv's Aᵀ do carried them into every key)."""
    from ejgen.runtime.launch import triton_call
    from ejgen.runtime.recurrent.triton import host

    forms, launch = [], triton_call.launch

    def spy(kernel, *args, **kwargs):
        if kernel.__name__.endswith("_chunk_grads_intra_kernel"):
            forms.append(kwargs["SUMS"])
        return launch(kernel, *args, **kwargs)

    monkeypatch.setattr(triton_call, "launch", spy)
    monkeypatch.setattr(host, "GRADS_INTRA_SUMS", sums)
    check(case, "triton")
    assert forms == [sums], forms


AFTER_CASES = (  # 16-bit sums: gk packed (an empty sequence, partial chunks), reversed, gates down to -20 a step; a
    # scalar gate with g_gamma, GQA, an initial state
    Case("gla", ("gk",), dtype="bfloat16", shape=(1, 80, 2, 1, 16, 16), chunk=32, cu=(0, 50, 50, 77), reverse=True,
         strong=True),
    Case("simple_gla", ("g", "g_gamma"), dtype="bfloat16", shape=(2, 70, 4, 2, 16, 16), chunk=32, h0=True),
)


@pytest.mark.parametrize("case", AFTER_CASES, ids=[c.id for c in AFTER_CASES])
def test_triton_after_sums_stored(case, monkeypatch):
    """host.AFTER_FROM_PREFIX "never" (the default, "always", forms the after sums R_j = L(j, end] of 16-bit inputs
    where they are read as L_C - P_j, `_after_at`): chunk_sums stores them and chunk_state, chunk_grads_qk and
    chunk_grads_v read them: the output, the final state and every gradient against the oracle, and the spy shows
    every reader launched that way (and chunk_sums with RS)."""
    from ejgen.runtime.recurrent.triton import host

    seen = launched_with(monkeypatch, "AFTER")
    monkeypatch.setattr(host, "AFTER_FROM_PREFIX", "never")
    check(case, "triton")
    kinds = {kernel.__name__.rsplit("_kernel", 1)[0].split("_chunk_")[-1] for kernel, _, kw in seen}
    assert kinds == {"sums", "state", "grads_qk", "grads_v"}, kinds
    assert all(kw["AFTER"] for _, _, kw in seen), seen


def launched_with(monkeypatch, *names) -> list:
    """The Triton launches of the calls that follow that take any of the constexprs ``names``, as they go out: a list of
    (kernel, grid, every keyword of the launch)."""
    from ejgen.runtime.launch import triton_call

    seen, launch = [], triton_call.launch

    def spy(kernel, grid, *args, **kwargs):
        if any(n in kwargs for n in names):
            seen.append((kernel, grid, kwargs))
        return launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(triton_call, "launch", spy)
    return seen


FOLD_CASES = (  # scalar gates, 16-bit inputs (float32 ones take neither form): bf16, reversed, an initial state, a
    # partial chunk, K in two blocks of 64 (the host sums their parts); packed sequences (an empty one) at -20 a step
    # in f16 (TF32 products: by blocks of K whatever GRADS_QK_SCALAR_TILES); g_gamma alone, GQA
    Case("simple_gla", ("g", "g_gamma"), dtype="bfloat16", shape=(2, 70, 2, 1, 80, 16), chunk=32, h0=True,
         reverse=True),
    Case("simple_gla", ("g",), dtype="float16", shape=(1, 90, 2, 2, 80, 24), chunk=16, cu=(0, 33, 33, 80),
         strong=True, h0=True),
    Case("lightning_attention", ("g_gamma",), dtype="bfloat16", shape=(2, 40, 4, 2, 16, 16), chunk=16),
)


GRADS_QK_FORMS = {  # (host.GRADS_QK_FOLD, host.GRADS_QK_SCALAR_TILES): the default, and the forms before session 30
    "folded-a-program-a-chunk": (True, (128, 64, 8, 3)),
    "folded-blocks-of-k": (True, None),
    "unfolded-blocks-of-k": (False, None),
}
FORM_RUNS = [(c, form) for c in FOLD_CASES for form in GRADS_QK_FORMS]


@pytest.mark.parametrize("case,form", FORM_RUNS, ids=[f"{c.id}-{form}" for c, form in FORM_RUNS])
def test_triton_scalar_gate_grads_qk_forms(case, form, monkeypatch):
    """chunk_grads_qk with a scalar gate: its log decay gradient's terms from the chunk's states in the pairs' [C, C]
    scan (host.GRADS_QK_FOLD, `_folded`) or in scans of their own, by blocks of 64 channels or a program a chunk
    (host.GRADS_QK_SCALAR_TILES; both the default for 16-bit inputs, neither for float32 ones: host.grads_qk_form):
    every gradient, the gates' included, against the oracle, and the spy shows the launches took that form."""
    from ejgen.runtime.recurrent.triton import host

    seen = launched_with(monkeypatch, "FOLD")
    fold, tiles = GRADS_QK_FORMS[form]
    monkeypatch.setattr(host, "GRADS_QK_FOLD", fold)
    monkeypatch.setattr(host, "GRADS_QK_SCALAR_TILES", tiles and host.Tiles(*tiles))
    check(case, "triton")
    launches = [(kw["FOLD"], -(-kw["K"] // kw["BK"]), kw["BK"]) for _, _, kw in seen]  # (blocks of K, either order)
    dk = case.shape[4]
    whole = tiles is not None and case.dtype == "bfloat16"  # (a program a chunk with bf16 products: bf16's auto)
    bk = min(128 if whole else 64, 1 << (dk - 1).bit_length())
    assert launches == [(fold, -(-dk // bk), bk)], launches


def test_grads_v_ahead_by_gates(monkeypatch):
    """host.grads_v_ahead: chunk_grads_v reads ahead for scalar gates and none ("scalar", the default), with gk too
    ("always") or never; a value of another kind is refused by name."""
    from ejgen.runtime.recurrent.triton import host

    rule = {gates: host.grads_v_ahead(gates) for gates in [(), ("g",), ("g_gamma",), ("gk",), ("g", "gk")]}
    assert rule == {(): True, ("g",): True, ("g_gamma",): True, ("gk",): False, ("g", "gk"): False}, rule
    monkeypatch.setattr(host, "GRADS_V_AHEAD", "always")
    assert host.grads_v_ahead(("gk",)) and host.grads_v_ahead(())
    monkeypatch.setattr(host, "GRADS_V_AHEAD", "never")
    assert not host.grads_v_ahead(()) and not host.grads_v_ahead(("g",))
    monkeypatch.setattr(host, "GRADS_V_AHEAD", True)
    with pytest.raises(ValueError, match="GRADS_V_AHEAD must be 'scalar', 'always' or 'never', got True"):
        host.grads_v_ahead(("g",))


def test_grads_qk_form_by_inputs_and_machine():
    """host.grads_qk_form: folded and a program a chunk for a scalar gate with 16-bit inputs on sm_90 and in the
    interpreter; by blocks of 64 on sm_80 or with TF32 products (a program a chunk spills), float32 inputs unfolded
    by blocks of 64 (both spill more), gk by CHUNKED's blocks unfolded; at most 2 stages with the walks in groups."""
    from ejgen.runtime.recurrent.triton import host

    def form(dtype, gates, arch, dk=128, products="bfloat16"):
        fold, blocks, _ = host.grads_qk_form(dtype, products, gates, dk, 128, arch=arch)
        return fold, blocks["BK"], blocks["BV"]

    assert form("bfloat16", ("g", "g_gamma"), "sm90") == (True, 128, 64)
    assert form("float16", ("g_gamma",), None) == (True, 128, 64)
    assert form("bfloat16", ("g",), "sm90", dk=256) == (True, 128, 64)
    assert form("bfloat16", ("g",), "sm80") == (True, 64, 32)
    assert form("bfloat16", ("g",), "sm90", products="tf32") == (True, 64, 32)
    assert form("float32", ("g",), "sm90") == (False, 64, 32)
    assert form("bfloat16", ("gk",), "sm90") == (False, 64, 32)
    assert form("bfloat16", ("g", "gk"), None) == (False, 64, 32)
    stages = {grouped: host.grads_qk_form("bfloat16", "bfloat16", ("g",), 128, 128, "sm90", grouped)[2]["num_stages"]
              for grouped in (False, True)}  # (3 stages with the groups' tiles: 248 KB of shared memory on sm_90)
    assert stages == {False: host.GRADS_QK_SCALAR_TILES.num_stages, True: 2}, stages


AHEAD_CASES = (  # chunk_output's and chunk_grads_v's forms (reads ahead of the K loop or after it): a scalar gate
    # in bf16 (kᵀ / qᵀ as loaded where ahead), reversed with an initial state, K in two blocks; f16 packed sequences
    # at -20 a step; gk (v and A ahead, Aᵀ in whole rows); a map on k (kᵀ through the map); float32 (kᵀ in registers)
    FOLD_CASES[0],
    FOLD_CASES[1],
    Case("gla", ("gk",), dtype="bfloat16", shape=(1, 70, 2, 1, 32, 16), chunk=16, reverse=True),
    Case("linear_attention", (), dtype="bfloat16", shape=(2, 40, 2, 2, 16, 16), chunk=16),
    Case("lightning_attention", ("g_gamma",), shape=(2, 40, 4, 2, 16, 16), chunk=16),
)


@pytest.mark.parametrize("case", AHEAD_CASES, ids=[c.id for c in AHEAD_CASES])
def test_triton_output_and_grads_v_other_forms(case, monkeypatch):
    """chunk_output and chunk_grads_v in the forms the defaults do not take: host.OUTPUT_AHEAD off (v's tile and the
    gates' sums read after the K loop, gk's A through the triangle's mask) and GRADS_V_AHEAD the other way round for
    the case's gates (its default "scalar" reads ahead for scalar gates: do's tile, R and, 16-bit with no map, qᵀ
    loaded transposed; gk's Aᵀ in whole rows on "always"): o, final_state and every gradient against the oracle, and
    the spy shows both launches took them."""
    from ejgen.runtime.recurrent.triton import host

    seen = launched_with(monkeypatch, "AHEAD", "GRADS_AHEAD")
    v_ahead = not host.grads_v_ahead(case.gates)
    monkeypatch.setattr(host, "OUTPUT_AHEAD", False)
    monkeypatch.setattr(host, "GRADS_V_AHEAD", "always" if v_ahead else "never")
    check(case, "triton", hooks=ELU1 if case.op == "linear_attention" else None)
    launches = {(n, kw[n]) for _, _, kw in seen for n in ("AHEAD", "GRADS_AHEAD") if n in kw}
    assert launches == {("AHEAD", False), ("GRADS_AHEAD", v_ahead)}, launches


@pytest.mark.parametrize("case", FOLD_CASES, ids=[c.id for c in FOLD_CASES])
def test_triton_adjoint_walk_through_registers(case, monkeypatch):
    """host.ADJOINT_AS_LOADED off (on by default: chunk_state_bwd's scalar-gate walk with qᵀ fed as loaded and e^{P}
    on do's rows, `_retreat_do_gated`): q scaled through registers, the form float32 inputs take: o, final_state and
    every gradient against the oracle, and the spy shows the launch took it."""
    from ejgen.runtime.recurrent.triton import host

    seen = launched_with(monkeypatch, "AS_LOADED")
    monkeypatch.setattr(host, "ADJOINT_AS_LOADED", False)
    check(case, "triton")
    launches = [kw["AS_LOADED"] for _, _, kw in seen]
    assert launches and not any(launches), launches


BLOCKS_CASES = (  # two blocks of V and of K (partial second blocks): gk bf16 packed sequences (an empty one) reversed
    # with an initial state; a scalar gate in f16, GQA (TF32 products: dq / dk by blocks of 64 channels)
    Case("gla", ("gk",), dtype="bfloat16", shape=(1, 40, 1, 1, 80, 80), chunk=16, cu=(0, 17, 17, 36), h0=True,
         reverse=True),
    Case("simple_gla", ("g", "g_gamma"), dtype="float16", shape=(2, 40, 4, 2, 80, 80), chunk=16),
)


@pytest.mark.parametrize("case", BLOCKS_CASES, ids=[c.id for c in BLOCKS_CASES])
def test_triton_blocks_first(case, monkeypatch):
    """host.BLOCKS_FIRST the other way round for the case's gates (chunks first, a chunk's blocks in program id 1,
    since the default puts them side by side in program id 0 for every gate: every other test's form):
    chunk_output's, chunk_grads_v's and chunk_grads_qk's o, final_state and every gradient against the oracle, and
    the spy shows each launch took that order (a grid of chunks x blocks, one in its middle dimension where blocks
    first; two blocks each)."""
    from ejgen.runtime.recurrent.triton import host

    first = not host.blocks_first(case.gates)
    seen = launched_with(monkeypatch, "BLOCKS_FIRST")
    monkeypatch.setattr(host, "BLOCKS_FIRST", "always" if first else "never")
    check(case, "triton")
    kinds = {kernel.__name__.rsplit("_kernel", 1)[0].split("_chunk_")[-1] for kernel, _, _ in seen}
    assert kinds == {"output", "grads_v", "grads_qk"}, kinds
    blocks = {kernel.__name__.rsplit("_kernel", 1)[0].split("_chunk_")[-1]:
              -(-kw["K"] // kw["BK"]) if kernel.__name__.endswith("grads_qk_kernel") else -(-kw["V"] // kw["BV"])
              for kernel, _, kw in seen}
    assert blocks == {"output": 2, "grads_v": 2, "grads_qk": 2}, blocks
    assert all(kw["BLOCKS_FIRST"] == first and grid[1] == (1 if first else 2) for _, grid, kw in seen), seen


def test_blocks_first_by_gates(monkeypatch):
    """host.blocks_first: a chunk's blocks side by side for every gate ("always", the default since session 33), with
    gk alone ("gk") or for none ("never"); anything else is refused by name."""
    from ejgen.runtime.recurrent.triton import host

    every = [(), ("g",), ("g_gamma",), ("gk",), ("g", "gk")]
    assert all(host.blocks_first(gates) for gates in every)
    monkeypatch.setattr(host, "BLOCKS_FIRST", "gk")
    rule = {gates: host.blocks_first(gates) for gates in every}
    assert rule == {(): False, ("g",): False, ("g_gamma",): False, ("gk",): True, ("g", "gk"): True}, rule
    monkeypatch.setattr(host, "BLOCKS_FIRST", "never")
    assert not host.blocks_first(("gk",))
    monkeypatch.setattr(host, "BLOCKS_FIRST", True)
    with pytest.raises(ValueError, match="BLOCKS_FIRST must be 'gk', 'always' or 'never', got True"):
        host.blocks_first(("gk",))


def test_output_launch_by_inputs_and_gates(monkeypatch):
    """host.output_launch: chunk_output at OUTPUT_SCALAR_TILES (4 warps) with a scalar gate alone, 16-bit inputs and
    bf16 products on sm_90 and in the interpreter; CHUNKED's (8 warps) with gk or no gate, float32 inputs (4 warps
    spill), TF32 products or on sm_80, and for every call where OUTPUT_SCALAR_TILES is None; the launch takes it."""
    from ejgen.runtime.recurrent.triton import host

    gates = [(), ("g",), ("g_gamma",), ("g", "g_gamma"), ("gk",), ("g", "gk")]
    rule = {g: host.output_launch("bfloat16", "bfloat16", g, "sm90").num_warps for g in gates}
    assert rule == {(): 8, ("g",): 4, ("g_gamma",): 4, ("g", "g_gamma"): 4, ("gk",): 8, ("g", "gk"): 8}, rule
    assert host.output_launch("float16", "bfloat16", ("g",), None).num_warps == 4
    assert host.output_launch("float32", "bfloat16", ("g",), "sm90").num_warps == 8
    assert host.output_launch("bfloat16", "tf32", ("g",), "sm90").num_warps == 8
    assert host.output_launch("bfloat16", "bfloat16", ("g",), "sm80").num_warps == 8
    case = FOLD_CASES[2]  # (g_gamma alone, bf16: bf16 products, the chunk_products setting's auto)
    seen = launched_with(monkeypatch, "GATED_Q")  # (chunk_output's and chunk_intra's constexpr)
    check_forward(case, "triton")
    assert [kw["num_warps"] for _, _, kw in seen] == [4], seen
    monkeypatch.setattr(host, "OUTPUT_SCALAR_TILES", None)
    assert {host.output_launch("bfloat16", "bfloat16", g, "sm90") for g in gates} == {host.CHUNKED["chunk_output"]}


FIXED_GATE_CASES = (  # (case, the gates held fixed): a fixed decay alone (Lightning attention's), bf16 packed and
    # reversed; both scalar gates, one held (the log gradient still formed for the other); the seed's op, f16, with g
    # and gk held (gk's log gradient is always formed)
    (Case("lightning_attention", ("g_gamma",), dtype="bfloat16", shape=(1, 40, 2, 1, 16, 16), chunk=16,
          cu=(0, 17, 17, 36), h0=True, reverse=True), ("g_gamma",)),
    (Case("simple_gla", ("g", "g_gamma"), dtype="float16", shape=(2, 40, 4, 2, 80, 16), chunk=16), ("g_gamma",)),
    (Case("simple_gla", ("g", "g_gamma"), dtype="bfloat16", shape=(1, 40, 2, 1, 16, 16), chunk=16),
     ("g", "g_gamma")),
    (Case("recurrent", ("g", "gk"), dtype="float16", shape=(1, 40, 2, 1, 16, 16), chunk=16), ("g", "gk")),
)


@pytest.mark.parametrize("case, held", FIXED_GATE_CASES,
                         ids=[f"{c.id}-held-{'+'.join(h)}" for c, h in FIXED_GATE_CASES])
@pytest.mark.parametrize("platform", ["triton", "xla"])
def test_gates_held_fixed(case, held, platform, monkeypatch):
    """Gates held fixed (closed over, not differentiated: a fixed decay, as Lightning attention and RetNet keep it):
    o, final_state and the other inputs' gradients against the oracle on the chunked Triton kernels and XLA, and on
    Triton the spy shows chunk_grads_qk forms the log gates' gradient (LOG_GRADS) exactly where a scalar gate is
    differentiated or gk is there (docs/DESIGN.md §3, "Gates' gradients")."""
    seen = launched_with(monkeypatch, "LOG_GRADS")
    check(case, platform, fixed=held, algorithm="chunked")
    want = "gk" in case.gates or any(n in case.gates and n not in held for n in ("g", "g_gamma"))
    assert platform != "triton" or [kw["LOG_GRADS"] for _, _, kw in seen] == [want], seen


TOTAL_CASES = (  # g_gamma alone, 16-bit (the folded scan): bf16 packed sequences (an empty one, ends inside chunks)
    # reversed with an initial state, K whole; f16 dense, GQA, K in two blocks (TF32 products), T past the last chunk
    Case("lightning_attention", ("g_gamma",), dtype="bfloat16", shape=(1, 40, 2, 1, 16, 16), chunk=16,
         cu=(0, 17, 17, 36), h0=True, reverse=True),
    Case("lightning_attention", ("g_gamma",), dtype="float16", shape=(1, 40, 4, 2, 80, 16), chunk=16),
)


@pytest.mark.parametrize("case", TOTAL_CASES, ids=[c.id for c in TOTAL_CASES])
def test_triton_gamma_total(case, monkeypatch):
    """host.GAMMA_TOTAL the other way round (g_gamma alone: each chunk's whole share of its log gradient, the folded
    matrix's terms weighted by the steps that read them, or the per-step scan): o, final_state and every gradient,
    g_gamma's included, against the oracle, and the spy shows chunk_grads_qk took that form."""
    from ejgen.runtime.recurrent.triton import host

    total = not host.GAMMA_TOTAL
    seen = launched_with(monkeypatch, "TOTAL")
    monkeypatch.setattr(host, "GAMMA_TOTAL", total)
    check(case, "triton")
    assert [kw["TOTAL"] for _, _, kw in seen] == [total], seen


GATED_CASES = (  # gk with the gates' sums: bf16 packed sequences (an empty one, ends inside chunks) reversed with an
    # initial state; dense, GQA, K in two blocks of chunk_output (T past the last whole chunk). bf16 inputs: the
    # products' operands bf16 (the chunk_products setting's auto), the form's condition (host.gated_q)
    Case("gla", ("gk",), dtype="bfloat16", shape=(1, 40, 1, 1, 16, 16), chunk=16, cu=(0, 17, 17, 36), h0=True,
         reverse=True),
    Case("gla", ("gk",), dtype="bfloat16", shape=(1, 40, 4, 2, 80, 16), chunk=16),
)


@pytest.mark.parametrize("case", GATED_CASES, ids=[c.id for c in GATED_CASES])
def test_triton_gated_q(case, monkeypatch):
    """host.GATED_Q the other way round (chunk_intra stores q ⊙ e^{P} in bf16 and chunk_output reads it, or
    chunk_output forms it; the default's form is every other test's): o, final_state and every gradient against the
    oracle, and the spy shows the forward's chunk_intra and chunk_output took that form."""
    from ejgen.runtime.recurrent.triton import host

    gated = not host.GATED_Q
    seen = launched_with(monkeypatch, "GATED_Q")
    monkeypatch.setattr(host, "GATED_Q", gated)
    check(case, "triton")
    forms = {(kernel.__name__.rsplit("_chunk_", 1)[-1], kw["GATED_Q"]) for kernel, _, kw in seen}
    assert {("intra_kernel", gated), ("output_kernel", gated)} <= forms, forms


FIXED_CASES = (  # g_gamma alone: bf16 packed sequences (an empty one, ends inside chunks) reversed with an initial
    # state; f16 dense, GQA, K and V in two blocks; float32 (the scanned walk, sums formed); the seed's op with g_gamma
    Case("lightning_attention", ("g_gamma",), dtype="bfloat16", shape=(1, 70, 2, 1, 16, 16), chunk=16,
         cu=(0, 21, 21, 60), h0=True, reverse=True),
    Case("lightning_attention", ("g_gamma",), dtype="float16", shape=(2, 40, 4, 2, 80, 80), chunk=32),
    Case("lightning_attention", ("g_gamma",), shape=(2, 37, 2, 1, 16, 24), chunk=16, h0=True),
    Case("recurrent", ("g_gamma",), dtype="bfloat16", shape=(2, 40, 2, 2, 16, 16), chunk=16, strong=True),
)


@pytest.mark.parametrize("case", FIXED_CASES, ids=[c.id for c in FIXED_CASES])
def test_triton_fixed_decay_sums(case, monkeypatch):
    """host.FIXED_DECAY_SUMS: with g_gamma alone a forward outside a gradient launches no chunk_sums and its walk and
    output kernel, given no sums, form P_i = γ (i + 1) and L_C = γ n themselves (`_fixed_sums`); with the switch off
    they read chunk_sums'. o and final_state outside a gradient, both ways, against the oracle, and the spy shows each
    call's launches."""
    from ejgen.runtime.recurrent.triton import host

    name = lambda kernel: kernel.__name__.rsplit("_kernel", 1)[0].split("_chunk_")[-1]  # noqa: E731
    for fixed in (host.FIXED_DECAY_SUMS, not host.FIXED_DECAY_SUMS):
        seen = launched_with(monkeypatch, "SUMS", "AFTER")  # (chunk_sums takes AFTER alone)
        monkeypatch.setattr(host, "FIXED_DECAY_SUMS", fixed)
        check_forward(case, "triton")
        launches = sorted((name(kernel), kw.get("SUMS")) for kernel, _, kw in seen)
        assert launches == ([("output", False), ("state", False)] if fixed else
                            [("output", True), ("state", True), ("sums", None)]), (fixed, launches)


def test_triton_fixed_decay_differentiated_keeps_chunk_sums(monkeypatch):
    """host.FIXED_DECAY_SUMS on, g_gamma alone under a gradient: the forward launches chunk_sums once and keeps its
    sums for the backward (forming them there lost, BENCHMARKS.md "Session 33"), every launch reads them; o,
    final_state and every gradient against the oracle."""
    from ejgen.runtime.recurrent.triton import host

    name = lambda kernel: kernel.__name__.rsplit("_kernel", 1)[0].split("_chunk_")[-1]  # noqa: E731
    monkeypatch.setattr(host, "FIXED_DECAY_SUMS", True)
    seen = launched_with(monkeypatch, "SUMS", "AFTER")
    check(FIXED_CASES[0], "triton")
    launches = [(name(kernel), kw.get("SUMS")) for kernel, _, kw in seen]
    assert [n for n, _ in launches].count("sums") == 1, launches  # (the forward's, kept for the backward)
    assert all(sums is not False for _, sums in launches), launches
    assert {n for n, sums in launches if sums is True} >= {"output", "state", "state_bwd", "grads_qk", "grads_v"}, \
        launches


GROUPED_CASES = (  # a scalar gate's sums in bf16, reversed, an initial state, two sequences; gk with a scalar gate in
    # float32, gates down to -20 a step (every decay still a sum of its own steps: within float32's tolerance)
    Case("simple_gla", ("g", "g_gamma"), dtype="bfloat16", shape=(2, 130, 2, 1, 16, 32), chunk=16, h0=True,
         reverse=True),
    Case("recurrent", ("g", "gk"), shape=(1, 140, 2, 1, 16, 24), chunk=16, strong=True),
)


@pytest.mark.parametrize("form", ["relative", "rewalk"])
@pytest.mark.parametrize("case", GROUPED_CASES, ids=[c.id for c in GROUPED_CASES])
def test_triton_state_walk_in_groups(case, form, monkeypatch):
    """The state walks in groups (host.STATE_GROUPS): every group's chunks from the zero state (the backward's
    adjoints from the zero adjoint at the group's end) in parallel, the groups joined by `chunk_state_groups`, and
    either ("relative") the kernels that read the states and adjoints adding their group's, or ("rewalk") each group
    walked again from its joined start, storing the true states; here 3 groups of 3 chunks (the last chunk short),
    the output, the final state and every gradient against the oracle. The spy shows the grouped launches."""
    from ejgen.runtime.launch import triton_call
    from ejgen.runtime.recurrent.triton import host

    seen, launch = [], triton_call.launch

    def spy(kernel, grid, *args, **kwargs):
        seen.append((kernel.__name__.rsplit("_kernel", 1)[0].split("_chunk_")[-1], kwargs.get("GROUP"), len(grid)))
        return launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(triton_call, "launch", spy)
    monkeypatch.setattr(host, "STATE_GROUPS", True)
    monkeypatch.setattr(host, "STATE_GROUP_FORM", form)
    monkeypatch.setattr(host, "MIN_GROUP", 3)
    check(case, "triton")
    walks, readers = ("state", "state_bwd"), ("output", "grads_qk", "grads_v")
    launched = {n: g for n, g, _ in seen if n in walks + readers}
    assert launched == {**dict.fromkeys(walks, 3), **dict.fromkeys(readers, 3 if form == "relative" else 0)}, seen
    if form == "rewalk":  # each walk twice: the groups' ends, then from their starts (the forward's walk in each pass)
        assert [n for n, _, _ in seen if n in walks] == ["state", "state", "state", "state", "state_bwd",
                                                           "state_bwd"], seen
    assert sum(n == "state_groups" for n, _, _ in seen) == 3, seen  # the forward's, the backward's states, adjoints


FUSED_CHUNK_CASES = (
    Case("recurrent", ("g", "g_gamma", "gk"), shape=(1, 23, 2, 2, 16, 24), cu=SHORT, h0=True, reverse=True),
    Case("simple_gla", ("g", "g_gamma"), dtype="bfloat16", shape=(2, 40, 2, 2, 16, 32), chunk=32, h0=True),
    Case("linear_attention", (), shape=(1, 37, 2, 1, 16, 48), chunk=16),
)


@pytest.mark.parametrize("case", FUSED_CHUNK_CASES, ids=[c.id for c in FUSED_CHUNK_CASES])
def test_triton_fused_chunk_forward(case, monkeypatch, launched):
    """The one-pass chunked forward (chunk_forward "fused": a program per sequence x head and block of V walks
    the chunks with its state in registers): gk with the intra kernel's A, scalar gates, no gate with a feature map;
    packed sequences (an empty one among them), reverse, initial_state, GQA, bf16; o, final_state and every gradient
    (the backward as ever) against the oracle."""
    monkeypatch.setenv("EJGEN_CHUNK_FORWARD", "fused")
    check(case, "triton", hooks=_hooks(case))
    assert any(n.endswith("chunk_fused_fwd_kernel") for n in launched), launched
    assert not any(n.endswith("chunk_output_kernel") for n in launched), launched


STATE_DTYPE_CASES = (
    Case("gla", ("gk",), dtype="bfloat16", shape=(1, 40, 2, 1, 16, 32), chunk=16, h0=True),
    Case("simple_gla", ("g", "g_gamma"), dtype="float16", shape=(1, 23, 2, 2, 16, 16), cu=SHORT, chunk=16,
         reverse=True),
)


def _spy(monkeypatch, name, note):
    """Wrap the recurrent Triton host's function ``name``: ``note(args, result)`` of each call goes to the list
    returned (the output kernel's stored states: its args[7], HS; `chunk_sums`' result: None where it did not run)."""
    from ejgen.runtime.recurrent.triton import host

    seen = []
    real = getattr(host, name)

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(note(args, out))
        return out

    monkeypatch.setattr(host, name, spy)
    return seen


def _stored_states(monkeypatch):
    return _spy(monkeypatch, "chunk_output", lambda args, out: args[7].dtype)


def _sums_formed(monkeypatch):
    return _spy(monkeypatch, "chunk_sums", lambda args, out: out is not None)


@pytest.mark.parametrize("case", STATE_DTYPE_CASES, ids=[c.id for c in STATE_DTYPE_CASES])
def test_triton_chunk_states_in_the_inputs_dtype(case, monkeypatch):
    """chunk_state_dtype "bfloat16": the two-pass chunked forward stores the state at each chunk's start in bf16 for
    its output kernel (the carried state and the final state stay float32): gk and scalar
    gates; packed sequences (an empty one among them), reverse, initial_state, GQA; bf16 and f16 inputs. o,
    final_state and every gradient against the oracle at the dtype's tolerance, and the states the output kernel read
    were bf16."""
    read = _stored_states(monkeypatch)
    monkeypatch.setenv("EJGEN_CHUNK_STATE_DTYPE", "bfloat16")
    check(case, "triton", hooks=_hooks(case))
    assert read and all(d == jnp.bfloat16 for d in read), read


@pytest.mark.parametrize("dtype,stored", [("float16", jnp.bfloat16), ("float32", jnp.float32)])
def test_triton_chunk_states_auto_by_the_inputs_dtype(dtype, stored, monkeypatch):
    """chunk_state_dtype "auto" (the default): the stored chunk states are bf16 for 16-bit inputs (f16 here; bf16
    inputs in every other 16-bit chunked test) and float32 for float32 ones; results against the oracle either way;
    and by default (chunk_gate_sums "kernel") the gk sums are formed by `chunk_sums` in the forward and the
    backward."""
    read, formed = _stored_states(monkeypatch), _sums_formed(monkeypatch)
    monkeypatch.delenv("EJGEN_CHUNK_STATE_DTYPE", raising=False)
    monkeypatch.delenv("EJGEN_CHUNK_GATE_SUMS", raising=False)
    case = Case("gla", ("gk",), dtype=dtype, shape=(1, 40, 2, 1, 16, 32), chunk=16, h0=True)
    check(case, "triton", hooks=_hooks(case))
    assert read and all(d == stored for d in read), read
    assert formed and all(formed), formed  # chunk_gate_sums "kernel", the default: forward and backward


@pytest.mark.parametrize("dtype,asked,expected", [
    ("bfloat16", None, "bfloat16"), ("float16", None, "tf32"), ("bfloat16", "tf32", "tf32"),
    ("float16", "bfloat16", "bfloat16"), ("float32", "bfloat16", "tf32")])
def test_triton_state_products_by_the_inputs_dtype(dtype, asked, expected, monkeypatch):
    """chunk_products: the operands of the chunked kernels' products with a float32 state or adjoint are bf16 for
    bf16 inputs by default (auto), TF32 for f16 (a state past f16's range would not fit an f16 operand); float32
    inputs multiply in float32 whatever is asked. The choice is the call's (its config: the backward, traced later,
    takes the forward's), it reaches the output, dq / dk and dv kernels, the backward's stored states and adjoints are
    bf16 where the products round them so (else float32), and o, final_state and every gradient stay within the
    dtype's tolerance of the oracle (gk and a scalar gate)."""
    seen = _spy(monkeypatch, "chunk_output", lambda args, out: args[6].products)
    adjoints = _spy(monkeypatch, "chunk_grads_v", lambda args, out: (args[5].products, args[6].dtype))
    if asked is None:
        monkeypatch.delenv("EJGEN_CHUNK_PRODUCTS", raising=False)
    else:
        monkeypatch.setenv("EJGEN_CHUNK_PRODUCTS", asked)
    # f16 inputs with bf16 products asked for: f16 operands lose 3 bits, so bf16's error against f16's tolerance
    factor = 2.0 if dtype == "float16" and expected == "bfloat16" else 1.0
    for case in (Case("gla", ("gk",), dtype=dtype, shape=(1, 40, 2, 1, 16, 32), chunk=16, h0=True),
                 Case("simple_gla", ("g",), dtype=dtype, shape=(1, 40, 2, 2, 16, 16), chunk=16, reverse=True)):
        check(case, "triton", hooks=_hooks(case), factor=factor)
    stored = jnp.dtype(jnp.bfloat16 if expected == "bfloat16" else jnp.float32)
    assert seen and set(seen) == {expected}, seen
    assert adjoints and set(adjoints) == {(expected, stored)}, adjoints


def test_the_chunked_forward_form_is_checked(monkeypatch):
    """EJGEN_CHUNK_FORWARD (or settings(chunk_forward=...)) picks the chunked forward's form, EJGEN_CHUNK_STATE_DTYPE
    (or settings(chunk_state_dtype=...)) the dtype of its stored states, EJGEN_CHUNK_GATE_SUMS where the gates' sums
    are formed; a value that is not one is one clear error."""
    from ejgen.ops import settings
    from ejgen.runtime.core import settings as core_settings

    monkeypatch.setenv("EJGEN_CHUNK_FORWARD", "fused")
    assert core_settings.current().chunk_forward == "fused"
    monkeypatch.setenv("EJGEN_CHUNK_FORWARD", "fast")
    with pytest.raises(ValueError, match="EJGEN_CHUNK_FORWARD='fast': expected one of two_pass, fused"):
        core_settings.current()
    monkeypatch.delenv("EJGEN_CHUNK_FORWARD")
    assert core_settings.current().chunk_forward == "two_pass"
    with settings(chunk_forward="fused") as s:
        assert s.chunk_forward == "fused"
    with pytest.raises(ValueError, match="chunk_forward='fast': expected one of two_pass, fused"):
        with settings(chunk_forward="fast"):
            pass
    monkeypatch.setenv("EJGEN_CHUNK_STATE_DTYPE", "bf16")
    with pytest.raises(ValueError, match="EJGEN_CHUNK_STATE_DTYPE='bf16': expected one of auto, float32, bfloat16"):
        core_settings.current()
    monkeypatch.delenv("EJGEN_CHUNK_STATE_DTYPE")
    with settings(chunk_state_dtype="bfloat16") as s:
        assert s.chunk_state_dtype == "bfloat16"
    with pytest.raises(ValueError, match="chunk_state_dtype='half': expected one of auto, float32, bfloat16"):
        with settings(chunk_state_dtype="half"):
            pass
    monkeypatch.setenv("EJGEN_CHUNK_GATE_SUMS", "once")
    with pytest.raises(ValueError, match="EJGEN_CHUNK_GATE_SUMS='once': expected one of kernel, inline"):
        core_settings.current()
    monkeypatch.delenv("EJGEN_CHUNK_GATE_SUMS")
    monkeypatch.setenv("EJGEN_CHUNK_PRODUCTS", "fp8")
    with pytest.raises(ValueError, match="EJGEN_CHUNK_PRODUCTS='fp8': expected one of auto, tf32, bfloat16"):
        core_settings.current()


@pytest.mark.parametrize("gates", [("g", "g_gamma", "gk"), ("g", "g_gamma")], ids=["gk", "scalar"])
def test_triton_gate_sums_scanned_in_each_kernel(gates, monkeypatch):
    """chunk_gate_sums "inline": the chunked kernels scan the gates' sums over each chunk themselves (the default,
    "kernel", forms them once in `chunk_sums`, per channel with gk, one a step with a scalar gate: every other gated
    test): against the oracle (o, final_state, every gradient) with gk and the scalar gates, and the scalar gates
    alone, packed (an empty sequence and one of a step), reverse, GQA, bf16, and the sums kernel never ran."""
    formed = _sums_formed(monkeypatch)
    monkeypatch.setenv("EJGEN_CHUNK_GATE_SUMS", "inline")
    case = Case("recurrent", gates, dtype="bfloat16", shape=(1, 41, 2, 1, 16, 16), cu=PACKED,
                chunk=32, h0=True, reverse=True)
    check(case, "triton", hooks=_hooks(case))
    assert formed and not any(formed), formed


def test_triton_scalar_gate_sums_formed_once(monkeypatch):
    """A scalar gate's sums over each chunk (prefix, after each step, whole: one a step, [rows, H] and [chunks, H])
    come from `chunk_sums` by default, as gk's do: the state kernels' walks over the chunks scanned them at every
    chunk. Formed once, in the forward, and kept for the backward (small, unlike gk's, which the backward forms again).
    Against the oracle, packed with an empty sequence, reverse (float32 inputs, the pairs' own sums, in every other
    scalar-gate Triton test, e.g. the strong gates')."""
    formed = _sums_formed(monkeypatch)
    read = _spy(monkeypatch, "chunk_state_grads", lambda args, out: args[7] is not None)  # its sums
    monkeypatch.delenv("EJGEN_CHUNK_GATE_SUMS", raising=False)
    case = Case("simple_gla", ("g",), dtype="bfloat16", shape=(1, 41, 2, 2, 16, 16), cu=PACKED, chunk=16,
                reverse=True)
    check(case, "triton", hooks=_hooks(case))
    assert formed == [True], formed  # the forward's
    assert read == [True], read  # the backward read the forward's


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("recurrent_ops")
    with on_path(root):
        yield built_ops(root)


@pytest.mark.parametrize("backend", ["xla", "triton"])
def test_hooks(built, backend):
    """A feature map on q and k and a gate map on g and gk: forward and the gradients through both maps."""
    case = Case("hooked", ("g", "gk"), shape=(1, 20, 2, 2, 16, 16), chunk=16, h0=True, reverse=True)
    check(case, backend, op=built.hooked, hooks=HOOKED_ORACLE)


def test_triton_takes_the_fused_kernels_for_gv():
    """The chunked Triton kernels take no gv: auto runs the fused ones (and says why), chunked is refused."""
    sds = jax.ShapeDtypeStruct
    q = sds((1, 512, 2, 16), jnp.float32)
    choice = explain(generated.recurrent, q, q, q, gv=q, target="sm90")
    assert (choice.forward, choice.backward) == ("triton_fused", "triton_fused")
    assert any("the chunked kernels of this platform take no gv" in r for r in choice.reasons)
    with pytest.raises(ValueError, match="the chunked kernels of this platform take no gv: pass algorithm='fused'"):
        explain(generated.recurrent, q, q, q, gv=q, algorithm="chunked", target="sm90")
    assert explain(generated.recurrent, q, q, q, gv=q, algorithm="chunked", target="cpu").forward == "xla_chunked"


def test_strong_gates_stay_finite_and_accurate():
    """Down to -20 per step in every gate at once (a chunk's sum near -1300): e^{-20 t} underflows within a chunk,
    nothing overflows or turns NaN, and every decay comes from the sum of its own steps, so the result stays within
    1e-6 of float64 (a decay from the difference of two prefix sums would err by u·1300, 1e-4)."""
    case = Case("recurrent", ALL, shape=(1, 64, 2, 2, 16, 16), chunk=32, strong=True, h0=True)
    o, final, grads = check(case, "xla", factor=0.05)
    assert all(np.isfinite(np.asarray(x)).all() for x in (o, final, *grads.values()))


@pytest.mark.parametrize("case", [
    Case("recurrent", ("g", "g_gamma", "gk"), shape=(1, 64, 2, 2, 16, 16), chunk=32, strong=True, h0=True),
    Case("recurrent", ("g_gamma", "gk"), shape=(1, 40, 2, 2, 16, 16), chunk=32, strong=True, gamma=-8.0),
    Case("lightning_attention", ("g_gamma",), shape=(1, 40, 2, 2, 16, 16), chunk=32, reverse=True, gamma=-20.0),
    Case("simple_gla", ("g", "g_gamma"), shape=(1, 64, 2, 2, 16, 16), chunk=32, strong=True, gamma=-20.0),
], ids=lambda c: c.id)
def test_strong_gates_on_the_chunked_triton_kernels(case):
    """The same gates (but gv, which the chunked kernels do not take) on Triton's chunked kernels: every decay a sum
    of its own steps or of a sub-chunk's prefix sums, within 1e-5 of float64 (measured: 7e-6 at most, the gates').
    With every head's decay strong the gates' gradients are tiny (e^{-20} of the others): the gradient of step s
    sums the pairs r < s, each decayed through s, rather than an inclusive sum less step s's own undecayed term,
    whose rounding (e^{20} times the result) made dg_gamma 42% wrong, dgk 49%. A key's decay to its sub-chunk's end,
    L(j, end], is a reverse cumsum less its own step's, not the sub-chunk's sum less a prefix sum (which erred by
    u |L_I|, 3e-5 at -30 per step: dg_gamma 3.9e-5 in the last case, now 4e-6)."""
    check(case, "triton", factor=0.5)


def test_strong_gates_in_16_bits_on_the_chunked_triton_kernels():
    """Scalar gates down to -20 a step in bf16 (16-bit inputs take `chunk_sums`' prefix sums: P_i - P_j), packed
    sequences that end inside a chunk, reversed: every gradient finite and against the oracle. The prefix sums read 0
    past a sequence's end, so P_i - P_j overflowed on those rows, and the zero rows of dA times e^{+1300} were NaN rows
    that dk's Wᵀ q carried into every key (`_intra_scalar` now zeroes them; gk's forms: the prefix-sums test above)."""
    case = Case("simple_gla", ("g", "g_gamma"), dtype="bfloat16", shape=(1, 100, 2, 1, 16, 16), chunk=64,
                cu=(0, 70, 70, 97), reverse=True, strong=True, gamma=-8.0)
    o, final, grads = check(case, "triton")
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in (o, final, *grads.values()))


def test_chunked_triton_scalar_gate_dq_dk_in_bfloat16():
    """With a scalar gate the chunked kernels form a sub-chunk's dq and dk from dA e^{segsum} [16, 16] on the tensor
    cores: as TF32 (float32 dA rounded to 10 bits), dq and dk err as much as gla's (per channel, in float32), 3.5e-3
    here; with dA rounded to bf16 they erred 5.2e-3 to 6.4e-3 (Triton's interpreter rounds to bf16 toward zero, twice
    the GPU's error: 2.4e-3 against 1.7e-3 rounding to nearest)."""
    case = Case("simple_gla", ("g", "g_gamma"), dtype="bfloat16", shape=(1, 64, 2, 2, 32, 32), chunk=64)
    x, d_out, d_final = inputs(case)
    _, _, grads = check(case, "triton")
    _, _, ref = oracle.recurrent(x, d_out, d_final)
    for name in ("query", "key"):
        err = oracle.rel_error(np.asarray(grads[name], np.float64), ref[name])
        assert err <= 4.5e-3, f"d{name}: relative error {err:.3g} > 4.5e-3"


def test_no_drift_at_4096_steps():
    """T = 4096 in chunks of 64 with GLA's gates: the float32 state stays within the tolerance of float64."""
    case = Case("gla", ("gk",), shape=(1, 4096, 2, 2, 16, 16), chunk=64, h0=True)
    check(case, "xla")


def test_chunked_equals_fused():
    case = Case("recurrent", ALL, shape=(1, 40, 2, 2, 16, 16), h0=True)
    x, d_out, d_final = inputs(case, seed=3)
    op = generated.recurrent
    chunked = run(op, case, x, d_out, d_final, "xla")
    fused = run(op, case, x, d_out, d_final, "xla", algorithm="fused", chunk_size=None)
    for name, a, b in (("o", chunked[0], fused[0]), ("final", chunked[1], fused[1]),
                       *((f"d{n}", chunked[2][n], fused[2][n]) for n in x)):
        assert oracle.rel_error(a, b) < 2e-6, name


def test_two_calls_through_final_state_equal_one():
    """Chunked long-context training: a sequence cut in two, the second call starting from the first's final
    state, gives the one call's outputs, final state and every gradient (the cotangent of the first call's final
    state flows back through the second call's initial state)."""
    case = Case("gla", ("gk",), shape=(2, 48, 2, 2, 16, 16), h0=True)
    x, d_out, d_final = inputs(case, seed=5)
    op = generated.gla
    cut = 20

    def one(a):
        return op(a["query"], a["key"], a["value"], a["gk"], initial_state=a["initial_state"], chunk_size=16,
                  platform="xla")

    def two(a):
        first = {n: (v[:, :cut] if v.ndim == 4 else v) for n, v in a.items()}
        second = {n: (v[:, cut:] if v.ndim == 4 else v) for n, v in a.items()}
        o1, s1 = one(first)
        o2, s2 = one({**second, "initial_state": s1})
        return jnp.concatenate([o1, o2], axis=1), s2

    args = {n: jnp.asarray(v) for n, v in x.items()}
    results = []
    for fn in (one, two):
        (o, final), vjp = jax.vjp(jax.jit(fn), args)
        results.append((o, final, vjp((jnp.asarray(d_out), jnp.asarray(d_final)))[0]))
    (o1, f1, g1), (o2, f2, g2) = results
    assert oracle.rel_error(o2, o1) < 2e-6 and oracle.rel_error(f2, f1) < 2e-6
    for name in args:
        assert oracle.rel_error(g2[name], g1[name]) < 2e-6, name


IN_PLACE = [  # the fused forward outside a gradient, its final state written into h0's buffer
    ("triton", Case("recurrent", ("g", "g_gamma", "gk"), shape=(1, 12, 2, 1, 16, 16), cu=(0, 3, 3, 8, 9, 11), h0=True,
                    reverse=True, **FUSED)),
    ("pallas", Case("gla", ("gk",), shape=(2, 5, 4, 2, 16, 48), h0=True, reverse=True, **FUSED)),
]


@pytest.mark.parametrize("platform,case", IN_PLACE, ids=[f"{p}-{c.id}" for p, c in IN_PLACE])
def test_the_fused_forward_leaves_the_callers_state_as_it_was(monkeypatch, platform, case):
    """Outside a gradient the fused forward writes the final state into the initial state's buffer (Triton:
    ``triton_call.launch(aliases=)``, packed and reversed too; Pallas: input_output_aliases): the caller's
    initial_state is never changed, called eagerly or under jit with it used again after the call, and o and
    final_state equal the oracle's; under a gradient (h0 a residual) nothing is aliased."""
    from ejgen.runtime.launch import triton_call
    from ejgen.runtime.recurrent.pallas import gpu as pallas_gpu

    aliased, launch, fused = [], triton_call.launch, pallas_gpu.fused_forward

    def launch_spy(kernel, *args, **kwargs):
        if "_fused_fwd" in kernel.__name__:
            aliased.append(bool(kwargs.get("aliases")))
        return launch(kernel, *args, **kwargs)

    def fused_spy(x, *, interpret, in_place=False):
        aliased.append(in_place and x.h0 is not None)
        return fused(x, interpret=interpret, in_place=in_place)

    monkeypatch.setattr(triton_call, "launch", launch_spy)
    monkeypatch.setattr(pallas_gpu, "fused_forward", fused_spy)
    call, h0 = check_state_untouched(case, platform)
    assert aliased and all(aliased), aliased  # (Pallas: each platform's branch of the op)
    aliased.clear()
    jax.vjp(call, h0)  # the forward of a gradient: h0 kept as a residual, not aliased
    assert aliased and not any(aliased), aliased


def test_launch_aliases_only_arrays_of_one_shape_and_dtype():
    """``triton_call.launch(aliases=)``: an input and an output of one shape and dtype share a buffer, the output
    starting as the input (in the interpreter too: a kernel writing part of it leaves the rest as it was; the input
    array itself stays as it was); a pair of different shapes or dtypes, an index past the arrays, or a zeroed output
    (jax-triton would clear the input) is refused on every path, the interpreter's too (only the GPU would have said
    so)."""
    import triton
    import triton.language as tl

    from ejgen.runtime.launch import triton_call

    @triton.jit
    def add_one(X, Y, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(Y + i, tl.load(X + i) + 1.0)

    x = jnp.arange(16, dtype=jnp.float32)
    sds = jax.ShapeDtypeStruct
    (y,) = triton_call.launch(add_one, (1,), [x], [sds((16,), jnp.float32)], aliases={0: 0}, N=16)
    np.testing.assert_array_equal(y, np.arange(16) + 1.0)
    np.testing.assert_array_equal(x, np.arange(16))
    (y,) = triton_call.launch(add_one, (1,), [x], [sds((16,), jnp.float32)], aliases={0: 0}, N=8)  # half of it
    np.testing.assert_array_equal(y, np.concatenate([np.arange(8) + 1.0, np.arange(8, 16)]))
    for inputs_, outs, aliases, zeroed, message in (
            ([x.astype(jnp.bfloat16)], [sds((16,), jnp.float32)], {0: 0}, (),
             "input 0 bfloat16[16] cannot be output 0's buffer, float32[16] (an alias needs one shape and dtype)"),
            ([x.reshape(1, 16)], [sds((16,), jnp.float32)], {0: 0}, (), "input 0 float32[1, 16] cannot be output 0's"),
            ([x], [sds((16,), jnp.float32)], {1: 0}, (), "alias 1 -> 0 names no input / output (1 inputs, 1 outputs)"),
            ([x], [sds((16,), jnp.float32)], {0: 0}, (0,),
             "output 0 is zeroed before the kernel runs, so it cannot alias input 0")):
        with pytest.raises(ValueError, match=re.escape(f"add_one: {message}")):
            triton_call.launch(add_one, (1,), inputs_, outs, aliases=aliases, zeroed=zeroed, N=16)


def test_a_call_without_steps_returns_the_initial_state():
    h0 = jnp.ones((2, 2, 8, 4), jnp.float32)
    q = jnp.zeros((2, 0, 2, 8), jnp.float32)
    o, final = generated.recurrent(q, q, jnp.zeros((2, 0, 2, 4)), initial_state=h0, platform="xla")
    assert o.shape == (2, 0, 2, 4) and np.array_equal(final, h0)
    grad = jax.grad(lambda h: generated.recurrent(q, q, jnp.zeros((2, 0, 2, 4)), initial_state=h,
                                                  platform="xla")[1].sum())(h0)
    assert np.array_equal(grad, np.ones_like(h0))


def test_explain_says_which_algorithm_and_why():
    sds = jax.ShapeDtypeStruct
    q = sds((2, 4096, 4, 64), jnp.bfloat16)
    gk = sds((2, 4096, 4, 64), jnp.float32)
    choice = explain(generated.gla, q, q, q, gk, target="cpu")
    assert (choice.platform, choice.forward, choice.backward) == ("xla", "xla_chunked", "xla_chunked")
    assert any("auto, 4096 steps" in r and "chunks of 64" in r for r in choice.reasons)
    short = sds((2, 1, 4, 64), jnp.bfloat16)
    choice = explain(generated.gla, short, short, short, sds((2, 1, 4, 64), jnp.float32), target="cpu")
    assert choice.forward == "xla_fused"
    choice = explain(generated.gla, short, short, short, sds((2, 1, 4, 64), jnp.float32), algorithm="chunked",
                     chunk_size=32, target="cpu")
    assert choice.forward == "xla_chunked" and any("asked for, chunks of 32" in r for r in choice.reasons)
