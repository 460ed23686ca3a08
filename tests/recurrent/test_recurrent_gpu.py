"""The recurrent family on a GPU (`pytest -m gpu tests/recurrent`): the cross product of gates, layouts (dense, packed
with empty and length-1 sequences), reverse, initial state, dtypes and algorithms on the triton platform (and the
chunked ones on the pallas platform, whose GPU kernels run natively), at shapes
of several chunks and head dims of 64 and 128 (GQA, K != V), forward and every gradient against the float64 oracle;
the XLA backend at T = 4096 on the same inputs as Triton."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import recurrent_oracle as oracle
from recurrent_cases import Case, check, check_forward, check_state_untouched, inputs, run
from ejgen import generated

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("x64_stays_off")]

GATE_SETS = {  # spec -> gate sets it takes
    "recurrent": [("g", "g_gamma", "gk", "gv"), ("g", "gk"), ("gv",)],
    "gla": [("gk",)],
    "simple_gla": [("g",), ("g", "g_gamma")],
    "lightning_attention": [("g_gamma",)],
    "linear_attention": [()],
}
LAYOUTS = {"dense": dict(shape=(2, 300, 4, 2, 64, 128)),
           "packed": dict(shape=(1, 700, 4, 4, 128, 64), cu=(0, 1, 1, 257, 300, 300, 640))}
ELU1 = {"feature_map": lambda x: jnp.where(x > 0, x + 1.0, jnp.exp(x))}


def _cases():
    out = []
    for (op, gate_sets), layout, reverse, dtype, algorithm in itertools.product(
            GATE_SETS.items(), LAYOUTS, (False, True), ("bfloat16", "float32"), ("chunked", "fused")):
        for gates in gate_sets:
            if "gv" in gates and algorithm == "chunked":
                continue  # the chunked Triton kernels take no gv (the fused ones run: test_recurrent.py)
            out.append(Case(op, gates, dtype=dtype, reverse=reverse, h0=reverse, algorithm=algorithm,
                            chunk=64 if algorithm == "chunked" else None, **LAYOUTS[layout]))
    return out


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_triton_against_the_oracle(case):
    check(case, "triton", hooks=ELU1 if case.op == "linear_attention" else None)


DIAGONAL = [(c, form, pieces) for c in CASES if "gk" in c.gates and "gv" not in c.gates and c.algorithm == "chunked"
            and not c.reverse for form, pieces in ((("kernel", False), ("kernel", True), ("inline", True))
                                                   if c.dtype == "bfloat16" else (("kernel", False), ))]


@pytest.mark.parametrize("case, form, pieces", DIAGONAL,
                         ids=[f"{c.id}-{f}" + ("-pieces" if p else "") for c, f, p in DIAGONAL])
def test_triton_chunk_intra_diagonal_in_a_kernel_of_its_own(case, form, pieces, monkeypatch):
    """chunk_intra's diagonal blocks from their own launch (host.CHUNK_INTRA_DIAGONAL "kernel") in 16 steps, and for
    16-bit inputs in pieces of 4 (host.CHUNK_INTRA_PIECES) from that launch or formed inline, against the oracle."""
    from ejgen.runtime.recurrent.triton import host

    monkeypatch.setattr(host, "CHUNK_INTRA_DIAGONAL", form)
    monkeypatch.setattr(host, "CHUNK_INTRA_PIECES", pieces)
    check(case, "triton")


GRADS_SUMS = [c for c in CASES if "gk" in c.gates and "gv" not in c.gates and c.algorithm == "chunked"
              and c.dtype == "bfloat16"]


@pytest.mark.parametrize("case", GRADS_SUMS, ids=[c.id for c in GRADS_SUMS])
def test_triton_grads_intra_from_the_scanned_gates(case, monkeypatch):
    """chunk_grads_intra's exponents between sub-chunks from its gates scanned again (host.GRADS_INTRA_SUMS off; the
    prefix sums are the default since session 28 and run in every other test), 16-bit inputs, against the oracle."""
    from ejgen.runtime.recurrent.triton import host

    monkeypatch.setattr(host, "GRADS_INTRA_SUMS", False)
    check(case, "triton")


AFTER = [c for c in CASES if c.algorithm == "chunked" and c.dtype != "float32" and "gv" not in c.gates
         and set(c.gates) & {"g", "g_gamma", "gk"}]


@pytest.mark.parametrize("case", AFTER, ids=[c.id for c in AFTER])
def test_triton_after_sums_stored(case, monkeypatch):
    """host.AFTER_FROM_PREFIX "never": the after sums of 16-bit inputs stored by chunk_sums and read (the default
    forms them where they are read, L_C - P), against the oracle."""
    from ejgen.runtime.recurrent.triton import host

    monkeypatch.setattr(host, "AFTER_FROM_PREFIX", "never")
    check(case, "triton", hooks=ELU1 if case.op == "linear_attention" else None)


FOLDED = [c for c in CASES if c.algorithm == "chunked" and "gk" not in c.gates and "gv" not in c.gates
          and set(c.gates) & {"g", "g_gamma"} and (c.dtype == "bfloat16" or c.reverse)]


GRADS_QK_FORMS = {"folded-blocks-of-k": (True, None), "unfolded-blocks-of-k": (False, None)}  # (GRADS_QK_FOLD,
# GRADS_QK_SCALAR_TILES) before session 30 (the default, folded and a program a chunk: every scalar-gate case above)
FORM_RUNS = [(c, form) for c in FOLDED for form in GRADS_QK_FORMS  # 16-bit inputs (float32 takes neither form)
             if c.dtype != "float32"]


@pytest.mark.parametrize("case,form", FORM_RUNS, ids=[f"{c.id}-{form}" for c, form in FORM_RUNS])
def test_triton_scalar_gate_grads_qk_forms(case, form, monkeypatch):
    """chunk_grads_qk with a scalar gate in the forms that are not the default (host.GRADS_QK_FOLD,
    GRADS_QK_SCALAR_TILES), against the oracle."""
    from ejgen.runtime.recurrent.triton import host

    fold, tiles = GRADS_QK_FORMS[form]
    monkeypatch.setattr(host, "GRADS_QK_FOLD", fold)
    monkeypatch.setattr(host, "GRADS_QK_SCALAR_TILES", tiles)
    check(case, "triton")


AHEAD = [c for c in CASES if c.algorithm == "chunked" and "gv" not in c.gates and (c.dtype == "bfloat16" or c.reverse)]


@pytest.mark.parametrize("case", AHEAD, ids=[c.id for c in AHEAD])
def test_triton_output_and_grads_v_other_forms(case, monkeypatch):
    """chunk_output and chunk_grads_v in the forms the defaults do not take (host.OUTPUT_AHEAD off, GRADS_V_AHEAD the
    other way round for the case's gates), against the oracle."""
    from ejgen.runtime.recurrent.triton import host

    monkeypatch.setattr(host, "OUTPUT_AHEAD", False)
    monkeypatch.setattr(host, "GRADS_V_AHEAD", "never" if host.grads_v_ahead(case.gates) else "always")
    check(case, "triton", hooks=ELU1 if case.op == "linear_attention" else None)


@pytest.mark.parametrize("case", AHEAD, ids=[c.id for c in AHEAD])
def test_triton_blocks_first(case, monkeypatch):
    """host.BLOCKS_FIRST the other way round for the case's gates (chunk_output's, chunk_grads_v's and
    chunk_grads_qk's chunks first in the grid: the default puts a chunk's blocks side by side for every gate), against
    the oracle: the dense layout's V 128 in two blocks of chunk_output and chunk_grads_v, the packed one's K 128 in two of
    chunk_grads_qk with gk and with float32 inputs (a scalar gate's bf16 dq / dk take K whole)."""
    from ejgen.runtime.recurrent.triton import host

    monkeypatch.setattr(host, "BLOCKS_FIRST", "never" if host.blocks_first(case.gates) else "always")
    check(case, "triton", hooks=ELU1 if case.op == "linear_attention" else None)


GATED = [c for c in CASES if c.algorithm == "chunked" and "gk" in c.gates and c.dtype != "float32"]


@pytest.mark.parametrize("case", GATED, ids=[c.id for c in GATED])
def test_triton_gated_q(case, monkeypatch):
    """host.GATED_Q the other way round (chunk_intra's q ⊙ e^{P} in bf16 read by chunk_output, or formed there),
    against the oracle."""
    from ejgen.runtime.recurrent.triton import host

    monkeypatch.setattr(host, "GATED_Q", not host.GATED_Q)
    check(case, "triton")


HELD = [c for c in CASES if c.algorithm == "chunked" and set(c.gates) & {"g", "g_gamma"} and "gk" not in c.gates]


@pytest.mark.parametrize("case", HELD, ids=[c.id for c in HELD])
def test_triton_scalar_gates_held_fixed(case):
    """The scalar gates held fixed (closed over: chunk_grads_qk forms no log gates' gradient, LOG_GRADS off), o,
    final_state and the other gradients against the oracle."""
    check(case, "triton", fixed=tuple(n for n in ("g", "g_gamma") if n in case.gates))


TOTAL = [c for c in CASES if c.algorithm == "chunked" and c.gates == ("g_gamma",) and c.dtype != "float32"]


@pytest.mark.parametrize("case", TOTAL, ids=[c.id for c in TOTAL])
def test_triton_gamma_total(case, monkeypatch):
    """host.GAMMA_TOTAL the other way round (g_gamma alone: each chunk's whole share of its log gradient, or the
    per-step scan), against the oracle."""
    from ejgen.runtime.recurrent.triton import host

    monkeypatch.setattr(host, "GAMMA_TOTAL", not host.GAMMA_TOTAL)
    check(case, "triton")


FIXED = [c for c in CASES if c.algorithm == "chunked" and c.gates == ("g_gamma",)]


@pytest.mark.parametrize("case", FIXED, ids=[c.id for c in FIXED])
def test_triton_fixed_decay_sums(case, monkeypatch):
    """host.FIXED_DECAY_SUMS both ways (g_gamma alone: a forward outside a gradient forms the decay's sums in its walk
    and output kernel, no chunk_sums, or reads chunk_sums'), o and final_state against the oracle (a differentiated
    forward keeps chunk_sums' either way: every other test)."""
    from ejgen.runtime.recurrent.triton import host

    for fixed in (True, False):
        monkeypatch.setattr(host, "FIXED_DECAY_SUMS", fixed)
        check_forward(case, "triton")


OUTPUT_SCALAR = [c for c in FOLDED if c.dtype == "bfloat16"]  # (bf16 products: the inputs the launch applies to)


@pytest.mark.parametrize("case", OUTPUT_SCALAR, ids=[c.id for c in OUTPUT_SCALAR])
def test_triton_output_at_chunked_launch(case, monkeypatch):
    """chunk_output with a scalar gate at CHUNKED's launch (8 warps; host.OUTPUT_SCALAR_TILES None; the default 4 warps
    since session 33: every scalar-gate case), against the oracle."""
    from ejgen.runtime.recurrent.triton import host

    monkeypatch.setattr(host, "OUTPUT_SCALAR_TILES", None)
    check_forward(case, "triton")


AS_LOADED = [c for c in FOLDED if c.dtype != "float32"]  # (float32 walks through registers whatever the setting)


@pytest.mark.parametrize("case", AS_LOADED, ids=[c.id for c in AS_LOADED])
def test_triton_adjoint_walk_through_registers(case, monkeypatch):
    """host.ADJOINT_AS_LOADED off (chunk_state_bwd's scalar-gate walk with q scaled through registers), against the
    oracle."""
    from ejgen.runtime.recurrent.triton import host

    monkeypatch.setattr(host, "ADJOINT_AS_LOADED", False)
    check(case, "triton")


STRONG_16 = [Case(op, gates, dtype="bfloat16", reverse=True, strong=True, chunk=64, **LAYOUTS["packed"])
             for op, gates in (("gla", ("gk",)), ("simple_gla", ("g", "g_gamma")))]


@pytest.mark.parametrize("case", STRONG_16, ids=[c.id for c in STRONG_16])
def test_strong_gates_in_16_bits_stay_finite(case):
    """Gates down to -20 a step in bf16 over packed sequences that end inside chunks (the prefix sums' differences of
    16-bit inputs): every gradient finite and against the oracle (NaN rows past a sequence's end before session 27)."""
    o, final, grads = check(case, "triton")
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in (o, final, *grads.values()))


GROUPED = [c for c in CASES if c.algorithm == "chunked" and c.cu is None and not c.reverse and "gv" not in c.gates
           and (c.dtype == "bfloat16" or c.op == "recurrent")]


@pytest.mark.parametrize("form", ["relative", "rewalk"])
@pytest.mark.parametrize("case", GROUPED, ids=[c.id for c in GROUPED])
def test_triton_state_walk_in_groups(case, form, monkeypatch):
    """The state walks in groups (host.STATE_GROUPS; groups of 3 and 2 of the 5 chunks here) in either form
    (host.STATE_GROUP_FORM), against the oracle."""
    from ejgen.runtime.recurrent.triton import host

    monkeypatch.setattr(host, "STATE_GROUPS", True)
    monkeypatch.setattr(host, "STATE_GROUP_FORM", form)
    monkeypatch.setattr(host, "MIN_GROUP", 2)
    check(case, "triton", hooks=ELU1 if case.op == "linear_attention" else None)


PALLAS = [c for c in CASES if "gv" not in c.gates and (c.algorithm == "chunked" or (  # the fused forward: dense
    c.cu is None and c.dtype == "bfloat16" and not c.reverse))]


@pytest.mark.parametrize("case", PALLAS, ids=[c.id for c in PALLAS])
def test_pallas_against_the_oracle(case):
    """The Pallas GPU kernels (Triton lowering) natively."""
    check(case, "pallas", hooks=ELU1 if case.op == "linear_attention" else None)


@pytest.mark.parametrize("platform,wide", [("triton", False), ("triton", True), ("pallas", False)],
                         ids=["triton", "triton-wide-blocks", "pallas"])
def test_decode_updates_the_state_in_place(platform, wide, monkeypatch):
    """A gla_decode step jitted with its state donated: the compiled program copies no state (the kernel writes the
    new state into the old one's buffer) and the donated array is consumed; four such steps, and four in a
    lax.fori_loop carrying the state, equal four steps on the XLA backend. ``wide``: Triton's value blocks of
    host.FUSED_WIDE_BV (a large batch's, here forced)."""
    from ejgen.runtime.recurrent.triton import host

    if wide:
        monkeypatch.setattr(host, "FUSED_WIDE_PER_SM", 0)
    b, h, dk, dv = 4, 4, 64, 128
    keys = jax.random.split(jax.random.PRNGKey(3), 5)
    q, k, v = (jax.random.normal(keys[i], (b, h, d), jnp.bfloat16) for i, d in enumerate((dk, dk, dv)))
    gk = jax.nn.log_sigmoid(jax.random.normal(keys[3], (b, h, dk), jnp.float32)) / 16
    state = jax.random.normal(keys[4], (b, h, dk, dv), jnp.float32)

    def step(q, k, v, s, gk, platform=platform):
        return generated.gla_decode(q, k, v, s, gk, platform=platform)

    donated = jax.jit(step, donate_argnums=3)
    hlo = donated.lower(q, k, v, state, gk).compile().as_text()
    shapes = (f"f32[{b},{h},{dk},{dv}]", f"f32[{b * h},{dk},{dv}]")
    copies = [line for line in hlo.splitlines() if "copy" in line and any(s in line for s in shapes)]
    assert not copies, "\n".join(copies)
    ref, s = jax.jit(functools.partial(step, platform="xla")), state
    for _ in range(4):
        o_ref, s = ref(q, k, v, s, gk)
    got = state.copy()
    for _ in range(4):
        old = got
        o, got = donated(q, k, v, got, gk)
        assert old.is_deleted()
    loop = jax.jit(lambda q, k, v, s, gk: jax.lax.fori_loop(0, 4, lambda i, s: step(q, k, v, s, gk)[1], s))
    for name, a, b_ in (("o", o, o_ref), ("state", got, s), ("loop state", loop(q, k, v, state, gk), s)):
        assert oracle.rel_error(a, b_) < 1e-5, name


IN_PLACE = [
    ("triton", Case("gla", ("gk",), shape=(2, 300, 4, 2, 64, 128), h0=True, reverse=True, algorithm="fused",
                    chunk=None)),
    ("triton", Case("recurrent", ("g", "g_gamma", "gk", "gv"), shape=(1, 700, 4, 4, 128, 64), h0=True, reverse=True,
                    cu=LAYOUTS["packed"]["cu"], algorithm="fused", chunk=None)),
    ("pallas", Case("gla", ("gk",), dtype="bfloat16", shape=(2, 300, 4, 2, 64, 128), h0=True, reverse=True,
                    algorithm="fused", chunk=None)),
    ("pallas", Case("simple_gla", ("g", "g_gamma"), shape=(3, 1, 4, 4, 16, 16), h0=True, algorithm="fused",
                    chunk=None)),  # one step, the smallest state (K = V = 16: a [16, 16] block per program)
]


@pytest.mark.parametrize("platform,case", IN_PLACE, ids=[f"{p}-{c.id}" for p, c in IN_PLACE])
def test_the_state_in_place_leaves_the_callers_state_as_it_was(platform, case):
    """The fused forward outside a gradient, its final state written into the initial state's buffer (the paths
    the oracle checks above never take: they run under a gradient), dense and packed, reversed, GQA: o and
    final_state against the oracle, the caller's initial_state unchanged after an eager call and after a jitted one
    that reads it again once the kernel has run (XLA copies it first)."""
    check_state_untouched(case, platform)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_long_sequences_triton_equals_xla(dtype):
    """T = 4096, GLA gates, K = V = 128: the chunked Triton kernels against the XLA backend and the oracle."""
    case = Case("gla", ("gk",), dtype=dtype, shape=(1, 4096, 2, 2, 128, 128), chunk=64, h0=True)
    o, final, grads = check(case, "triton")
    x, d_out, d_final = inputs(case)
    o_x, final_x, grads_x = run(generated.gla, case, x, d_out, d_final, "xla")
    assert oracle.rel_error(final, final_x) < oracle.TOLERANCE[dtype]
    for name in grads:
        assert oracle.rel_error(grads[name], grads_x[name]) < 2 * oracle.TOLERANCE[dtype], name
    del o, o_x


def test_chunked_equals_fused_on_the_gpu():
    case = Case("recurrent", ("g", "g_gamma", "gk"), shape=(2, 1000, 4, 4, 64, 64), h0=True, chunk=64)
    x, d_out, d_final = inputs(case, seed=7)
    a = run(generated.recurrent, case, x, d_out, d_final, "triton")
    b = run(generated.recurrent, case, x, d_out, d_final, "triton", algorithm="fused", chunk_size=None)
    assert oracle.rel_error(a[0], b[0]) < 1e-5 and oracle.rel_error(a[1], b[1]) < 1e-5
    for name in x:
        assert oracle.rel_error(a[2][name], b[2][name]) < 1e-5, name
    assert np.isfinite(np.asarray(jax.device_get(a[1]))).all()


def test_linear_attention_on_every_path_on_the_gpu():
    """Float32 linear attention (no gate, elu + 1) on the chunked and the fused kernels, each against the oracle, with
    XLA's errors beside them in the message: the first GPU run failed the chunked case in every layout while Triton's
    interpreter met it a hundred times over, so the table says whether the chunked kernels, the kernels of both
    algorithms, or the harness around them err."""
    case = Case("linear_attention", (), shape=(2, 300, 4, 2, 64, 128), chunk=64)
    x, d_out, d_final = inputs(case)
    o_ref, final_ref, grads_ref = oracle.recurrent(x, d_out, d_final, **ELU1)
    paths = {"chunked": ("triton", {}), "fused": ("triton", dict(algorithm="fused", chunk_size=None)),
             "xla": ("xla", {})}
    errors = {}
    for path, (platform, extra) in paths.items():
        o, final, grads = run(generated.linear_attention, case, x, d_out, d_final, platform, **extra)
        got = {"o": o, "final_state": final, **{f"d{n}": grads[n] for n in x}}
        ref = {"o": o_ref, "final_state": final_ref, **{f"d{n}": grads_ref[n] for n in x}}
        errors[path] = {n: oracle.rel_error(got[n], ref[n]) for n in got}
    table = "; ".join(f"{p}: " + ", ".join(f"{n} {e:.2g}" for n, e in errs.items()) for p, errs in errors.items())
    for path in ("chunked", "fused"):
        assert max(errors[path].values()) < oracle.TOLERANCE["float32"], table
