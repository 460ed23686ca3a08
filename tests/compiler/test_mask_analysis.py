"""Mask analysis, brute force: affine masks give block ranges that hold for every element.

Random conjunctions of affine comparisons (each with its own NumPy predicate, written here from
the DSL text) are loaded from specs, analysed, and the Python block ranges
(``ejgen.ir.passes.mask.block_range``) are checked block by block against the dense visibility
matrix, in both directions (query blocks -> key blocks for the forward pass, key blocks -> query
blocks for the backward pass). The traced-int32 implementation the XLA kernels use
(``ejgen.runtime.core.blocks``) must give the same numbers.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from ejgen.ir.expr import to_text
from ejgen.ir.passes import mask as mask_pass
from ejgen.runtime.core import blocks as xla_blocks
from ejgen.spec import load_spec

SPEC = """\
name: probe
family: attention
params:
  window: {{shape: [heads], dtype: int32}}
  weight: {{shape: [heads], dtype: float32}}
options:
  prefix: {{type: int, default: 0}}
  shift: {{type: int, default: 0}}
  fshift: {{type: float, default: 0.5}}
  use_it: {{type: bool, default: true}}
mask: "{mask}"
"""

BLOCKS = (1, 2, 3, 4, 5, 8, 16)


def load_mask(tmp_path, text):
    path = tmp_path / "probe.yaml"
    path.write_text(SPEC.format(mask=text))
    return load_spec(path).mask


# Conjunct makers: rng -> (DSL text, predicate(q, k, env) on int grids, exact_q, exact_kv).
# exact_q / exact_kv: whether the visit range of this conjunct alone must be exact when blocks of
# queries (resp. keys) are the outer loop. One inequality always is (the keys with a witness form a
# ray); an equality is when its coefficients are 0 or +-1 (`kv_idx == 2 * q_idx` over query blocks
# visits the odd keys between the even ones).


def _le_diag(rng):
    c = int(rng.integers(-6, 7))
    return f"kv_idx <= q_idx + {c}" if c >= 0 else f"kv_idx <= q_idx - {-c}", lambda q, k, e: k <= q + c, True, True


def _ge_window(rng):
    w = int(rng.integers(0, 12))
    return f"kv_idx >= q_idx - {w}", lambda q, k, e: k >= q - w, True, True


def _scaled_lt(rng):
    m, c = int(rng.integers(2, 4)), int(rng.integers(-3, 8))
    return f"{m}*kv_idx < q_idx + {c}", lambda q, k, e: m * k < q + c, True, True


def _scaled_q(rng):
    m, c = int(rng.integers(2, 4)), int(rng.integers(0, 8))
    return f"{m} * q_idx > kv_idx - {c}", lambda q, k, e: m * q > k - c, True, True


def _prefix(rng):
    return "kv_idx < prefix", lambda q, k, e: k < e["prefix"], True, True


def _q_from(rng):
    c = int(rng.integers(0, 12))
    return f"q_idx >= {c}", lambda q, k, e: q >= c, True, True


def _kv_tail(rng):
    c = int(rng.integers(0, 12))
    return f"kv_idx > kv_len - {c}", lambda q, k, e: k > e["kv_len"] - c, True, True


def _equal(rng):
    c = int(rng.integers(-3, 4))
    return f"kv_idx == q_idx + ({c})", lambda q, k, e: k == q + c, True, True


def _not(rng):
    c = int(rng.integers(-4, 5))
    return f"not (kv_idx > q_idx + {c})", lambda q, k, e: ~(k > q + c), True, True


def _bottom_right(rng):
    return (
        "kv_idx + q_len <= q_idx + kv_len + shift",
        lambda q, k, e: k + e["q_len"] <= q + e["kv_len"] + e["shift"],
        True,
        True,
    )


def _negated_terms(rng):
    c = int(rng.integers(0, 6))
    return f"-kv_idx >= -q_idx - {c} * 2", lambda q, k, e: -k >= -q - c * 2, True, True


def _shifted_double(rng):
    return "kv_idx * 2 >= q_idx - shift", lambda q, k, e: k * 2 >= q - e["shift"], True, True


def _double_equal(rng):
    c = int(rng.integers(0, 4))
    return f"kv_idx == 2 * q_idx + {c}", lambda q, k, e: k == 2 * q + c, False, True


MAKERS = (
    _le_diag, _ge_window, _scaled_lt, _scaled_q, _prefix, _q_from, _kv_tail, _equal, _not,
    _bottom_right, _negated_terms, _shifted_double, _double_equal,
)  # fmt: skip


def random_case(rng, n_conjuncts):
    parts = [MAKERS[int(rng.integers(len(MAKERS)))](rng) for _ in range(n_conjuncts)]
    text = " and ".join(f"({p[0]})" for p in parts)
    preds = [p[1] for p in parts]
    sq, sk = int(rng.integers(1, 41)), int(rng.integers(1, 41))
    env = {"q_len": sq, "kv_len": sk, "prefix": int(rng.integers(0, sk + 3)), "shift": int(rng.integers(-6, 7))}
    exact = (n_conjuncts == 1 and parts[0][2], n_conjuncts == 1 and parts[0][3])
    blocks = (int(rng.choice(BLOCKS)), int(rng.choice(BLOCKS)))
    return text, preds, env, exact, blocks


def dense_visible(preds, env):
    q = np.arange(env["q_len"])[:, None]
    k = np.arange(env["kv_len"])[None, :]
    vis = np.ones((env["q_len"], env["kv_len"]), bool)
    for p in preds:
        vis &= np.broadcast_to(p(q, k, env), vis.shape)
    return vis


def python_ranges(constraints, vis, block_x, block_y, env, x_is_q):
    """block_range for every outer block: list of (x0, x1, (lo, hi, full_lo, full_hi))."""
    n_x, n_y = vis.shape
    out = []
    for x0 in range(0, n_x, block_x):
        x1 = min(x0 + block_x, n_x) - 1
        r = mask_pass.block_range(constraints, x0, x1, n_y, block_y, env, x_is_q=x_is_q)
        out.append((x0, x1, tuple(int(v) for v in r)))
    return out


PAD = 48  # every call uses arrays of one shape, so eager jnp compiles each op once


def xla_ranges(constraints, n_x, n_y, block_x, block_y, env, x_is_q):
    """The same with ``xla_blocks``, every outer block at once (the functions are elementwise)."""
    count = -(-n_x // block_x)
    x0 = np.zeros(PAD, np.int32)
    x0[:count] = np.arange(0, n_x, block_x)
    x1 = np.minimum(x0 + block_x, n_x) - 1
    x0, x1 = jnp.asarray(x0), jnp.asarray(x1)
    bounds = xla_blocks.initial(n_y)
    for c in constraints:
        a, b = (c.a, c.b) if x_is_q else (c.b, c.a)
        bounds = xla_blocks.tighten(bounds, a, b, jnp.int32(mask_pass.eval_int(c.c, env)), x0, x1)
    n_blocks = -(-n_y // block_y)
    result = [np.broadcast_to(np.asarray(r), (PAD,)) for r in xla_blocks.to_blocks(bounds, block_y, n_blocks)]
    return [tuple(int(r[i]) for r in result) for i in range(count)]


def check_direction(text, vis, ranges, block_y, exact, label):
    """(a) visit covers every block with a visible element; (b) full blocks are fully visible;
    (c) with ``exact``, no visited block is empty."""
    n_y = vis.shape[1]
    n_blocks = -(-n_y // block_y)
    for x0, x1, (lo, hi, flo, fhi) in ranges:
        where = f"{label} mask `{text}`, outer rows [{x0}, {x1}], block {block_y}: got {(lo, hi, flo, fhi)}"
        assert 0 <= lo <= hi <= n_blocks, where
        assert lo <= flo <= fhi <= hi, where
        rows = vis[x0 : x1 + 1]
        for j in range(n_blocks):
            tile = rows[:, j * block_y : min((j + 1) * block_y, n_y)]
            if tile.any():
                assert lo <= j < hi, f"{where}: block {j} has a visible element but is not visited"
            if flo <= j < fhi:
                assert tile.all(), f"{where}: block {j} is in the full range but not fully visible"
            if exact and lo <= j < hi:
                assert tile.any(), f"{where}: block {j} is visited but has no visible element"


CASES = 160


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    rng = np.random.default_rng(20260126)
    folder = tmp_path_factory.mktemp("masks")
    out = []
    for i in range(CASES):
        text, preds, env, exact, blocks = random_case(rng, 1 if i % 3 == 0 else int(rng.integers(2, 4)))
        analysis = mask_pass.analyse(load_mask(folder, text))
        out.append((text, preds, env, exact, blocks, analysis))
    return out


def test_random_affine_masks_are_fully_affine(cases):
    for text, preds, _, _, _, analysis in cases:
        assert analysis.residual is None, f"`{text}` left a residual: {to_text(analysis.residual)}"
        n_eq = text.count("==")
        assert len(analysis.constraints) == len(preds) + n_eq, text
        assert not analysis.needs_block_mask


@pytest.mark.parametrize("x_is_q", [True, False], ids=["q-blocks", "kv-blocks"])
def test_block_ranges_hold_for_every_element(cases, x_is_q):
    for text, preds, env, exact, (bq, bk), analysis in cases:
        vis = dense_visible(preds, env)
        if not x_is_q:
            vis = vis.T
        bx, by = (bq, bk) if x_is_q else (bk, bq)
        ranges = python_ranges(analysis.constraints, vis, bx, by, env, x_is_q)
        label = "query-block" if x_is_q else "key-block"
        check_direction(text, vis, ranges, by, exact[0] if x_is_q else exact[1], label)


SINGLE = [
    ("kv_idx <= q_idx", lambda q, k, e: k <= q),
    ("kv_idx <= q_idx + 5", lambda q, k, e: k <= q + 5),
    ("kv_idx >= q_idx - 3", lambda q, k, e: k >= q - 3),
    ("kv_idx < q_idx", lambda q, k, e: k < q),
    ("kv_idx > q_idx + 2", lambda q, k, e: k > q + 2),
    ("kv_idx < prefix", lambda q, k, e: k < e["prefix"]),
    ("kv_idx >= prefix", lambda q, k, e: k >= e["prefix"]),
    ("q_idx >= 3", lambda q, k, e: q >= 3),
    ("q_idx < 7", lambda q, k, e: q < 7),
    ("kv_idx == q_idx + 2", lambda q, k, e: k == q + 2),
    ("not (kv_idx < q_idx - 4)", lambda q, k, e: ~(k < q - 4)),
    ("kv_idx <= 2 * q_idx - 3", lambda q, k, e: k <= 2 * q - 3),
    ("2*kv_idx < q_idx + 5", lambda q, k, e: 2 * k < q + 5),
    ("kv_idx * 3 >= q_idx - 4", lambda q, k, e: k * 3 >= q - 4),
    ("2 * kv_idx == q_idx", lambda q, k, e: 2 * k == q),
    ("kv_idx - kv_len <= q_idx - q_len", lambda q, k, e: k - e["kv_len"] <= q - e["q_len"]),
]


@pytest.mark.parametrize("text, pred", SINGLE, ids=[t for t, _ in SINGLE])
def test_single_conjunct_visit_range_is_exact(tmp_path, text, pred):
    """One inequality (any coefficients) or an equality of unit coefficients: the visit range
    has no empty block, in both directions."""
    analysis = mask_pass.analyse(load_mask(tmp_path, text))
    assert analysis.residual is None and analysis.constraints
    rng = np.random.default_rng(len(text))
    for _ in range(12):
        sq, sk = int(rng.integers(1, 40)), int(rng.integers(1, 40))
        env = {"q_len": sq, "kv_len": sk, "prefix": int(rng.integers(0, sk + 2)), "shift": 0}
        bq, bk = int(rng.choice(BLOCKS)), int(rng.choice(BLOCKS))
        vis = dense_visible([pred], env)
        # `2 * kv_idx == q_idx` over key blocks: the odd queries between the even ones are empty.
        exact_kv = text != "2 * kv_idx == q_idx"
        check_direction(text, vis, python_ranges(analysis.constraints, vis, bq, bk, env, True), bk, True, "q")
        ranges_t = python_ranges(analysis.constraints, vis.T, bk, bq, env, False)
        check_direction(text, vis.T, ranges_t, bq, exact_kv, "kv")


@pytest.fixture(scope="module", params=[True, False], ids=["q-blocks", "kv-blocks"])
def both_ranges(request, cases):
    """Per case: (text, env, blocks, python ranges, xla ranges) over one direction."""
    x_is_q = request.param
    out = []
    for text, _, env, _, (bq, bk), analysis in cases:
        n_x, n_y = (env["q_len"], env["kv_len"]) if x_is_q else (env["kv_len"], env["q_len"])
        bx, by = (bq, bk) if x_is_q else (bk, bq)
        vis = np.zeros((n_x, n_y), bool)
        want = [r for _, _, r in python_ranges(analysis.constraints, vis, bx, by, env, x_is_q)]
        got = xla_ranges(analysis.constraints, n_x, n_y, bx, by, env, x_is_q)
        out.append((text, env, (bx, by), want, got))
    return out


def test_xla_blocks_match_the_python_block_ranges(both_ranges):
    """``xla_blocks`` (what the generated XLA kernels run) gives the same four numbers."""
    mismatches = []
    for text, env, blocks, want, got in both_ranges:
        assert len(got) == len(want)
        if got != want:
            i = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
            mismatches.append(f"`{text}` env={env} blocks={blocks} outer block {i}: xla {got[i]}, python {want[i]}")
    assert not mismatches, f"{len(mismatches)} of {len(both_ranges)} cases differ; first: {mismatches[0]}"


def test_xla_blocks_visit_the_same_blocks_as_python(both_ranges):
    """Weaker than identical numbers: the same visited blocks and the same unmasked blocks."""
    for text, env, blocks, want, got in both_ranges:
        assert len(got) == len(want)
        for i, ((lo, hi, flo, fhi), (glo, ghi, gflo, gfhi)) in enumerate(zip(want, got)):
            where = f"`{text}` env={env} blocks={blocks} outer block {i}: xla {got[i]}, python {want[i]}"
            assert set(range(glo, ghi)) == set(range(lo, hi)), where
            assert set(range(gflo, gfhi)) == set(range(flo, fhi)), where


def test_xla_blocks_with_causal_offsets(tmp_path):
    """The built-in causal constraint with a runtime offset (kv_len - q_len), as the kernels call it."""
    analysis = mask_pass.analyse(load_mask(tmp_path, "q_idx - kv_idx + (kv_len - q_len) >= 0"))
    (c,) = analysis.constraints
    assert (c.a, c.b) == (1, -1)
    for sq, sk, bq, bk in [(40, 40, 16, 16), (7, 33, 4, 8), (33, 7, 8, 4), (1, 17, 1, 16), (64, 64, 64, 64)]:
        env = {"q_len": sq, "kv_len": sk}
        for x_is_q in (True, False):
            n_x, n_y = (sq, sk) if x_is_q else (sk, sq)
            bx, by = (bq, bk) if x_is_q else (bk, bq)
            vis = (np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq)
            vis = vis if x_is_q else vis.T
            want = python_ranges(analysis.constraints, vis, bx, by, env, x_is_q)
            check_direction("causal", vis, want, by, True, "q" if x_is_q else "kv")
            assert xla_ranges(analysis.constraints, n_x, n_y, bx, by, env, x_is_q) == [r for *_, r in want]


# --- what is not affine goes to the residual -------------------------------------------------


@pytest.mark.parametrize(
    "text, n_constraints, residual",
    [
        ("kv_idx <= q_idx or kv_idx < prefix", 0, "((kv_idx <= q_idx) or (kv_idx < prefix))"),
        ("kv_idx <= q_idx + window[h]", 0, "(kv_idx <= (q_idx + window[h]))"),
        ("weight[h] > 0.5", 0, "(weight[h] > 0.5)"),
        ("kv_idx != q_idx", 0, "(kv_idx != q_idx)"),
        ("kv_idx <= q_idx + fshift", 0, "(kv_idx <= (q_idx + fshift))"),
        ("kv_idx < q_idx + h", 0, "(kv_idx < (q_idx + h))"),
        ("kv_idx * kv_idx <= q_idx", 0, "((kv_idx * kv_idx) <= q_idx)"),
        ("kv_idx <= abs(q_idx - 3)", 0, "(kv_idx <= abs((q_idx - 3)))"),
        ("not (kv_idx == q_idx)", 0, "not ((kv_idx == q_idx))"),
        ("use_it", 0, "use_it"),
        ("false", 0, "false"),
        ("kv_idx <= q_idx and kv_idx != 3", 1, "(kv_idx != 3)"),
        ("kv_idx <= q_idx and (q_idx < 5 or kv_idx > 2) and kv_idx >= q_idx - 8", 2, "((q_idx < 5) or (kv_idx > 2))"),
        ("kv_idx < prefix and kv_idx < q_idx + fshift and use_it", 1, "((kv_idx < (q_idx + fshift)) and use_it)"),
    ],
)
def test_non_affine_terms_go_to_the_residual(tmp_path, text, n_constraints, residual):
    analysis = mask_pass.analyse(load_mask(tmp_path, text))
    assert len(analysis.constraints) == n_constraints
    assert analysis.residual is not None and analysis.needs_block_mask
    assert to_text(analysis.residual) == residual


@pytest.mark.parametrize("text", ["true", "true and true"])
def test_true_gives_no_constraints(tmp_path, text):
    analysis = mask_pass.analyse(load_mask(tmp_path, text))
    assert analysis.constraints == ()
    assert analysis.residual is None and not analysis.needs_block_mask


def test_true_conjunct_is_dropped(tmp_path):
    analysis = mask_pass.analyse(load_mask(tmp_path, "true and kv_idx <= q_idx"))
    assert [(c.a, c.b) for c in analysis.constraints] == [(1, -1)]
    assert analysis.residual is None


@pytest.mark.parametrize(
    "text, expected",
    [
        ("kv_idx <= q_idx", [(1, -1, 0)]),
        ("kv_idx < q_idx", [(1, -1, -1)]),
        ("2*kv_idx < q_idx + 5", [(1, -2, 4)]),
        ("q_idx >= 3", [(1, 0, -3)]),
        ("kv_idx == q_idx + 1", [(-1, 1, -1), (1, -1, 1)]),
        ("not (kv_idx > q_idx)", [(1, -1, 0)]),
        ("kv_idx < prefix", [(0, -1, 6)]),
        ("kv_idx >= q_idx - shift", [(-1, 1, 2)]),
    ],
)
def test_affine_coefficients(tmp_path, text, expected):
    """``a*q_idx + b*kv_idx + c >= 0`` with c evaluated at prefix=7, shift=2."""
    analysis = mask_pass.analyse(load_mask(tmp_path, text))
    env = {"prefix": 7, "shift": 2, "q_len": 10, "kv_len": 10}
    got = [(c.a, c.b, mask_pass.eval_int(c.c, env)) for c in analysis.constraints]
    assert sorted(got) == sorted(expected)
    assert analysis.residual is None


def test_empty_and_oversized_lengths_stay_in_range(tmp_path):
    """A block range never leaves [0, n_blocks], even when a constraint excludes everything."""
    for text in ("kv_idx < prefix", "kv_idx > q_idx + 100", "q_idx >= 50", "kv_idx >= 0 - 100"):
        analysis = mask_pass.analyse(load_mask(tmp_path, text))
        for n_y, block in ((1, 1), (5, 2), (9, 16)):
            env = {"prefix": 0, "q_len": 4, "kv_len": n_y}
            lo, hi, flo, fhi = mask_pass.block_range(analysis.constraints, 0, 3, n_y, block, env, x_is_q=True)
            n_blocks = -(-n_y // block)
            assert 0 <= lo <= hi <= n_blocks and lo <= flo <= fhi <= hi, (text, n_y, block, (lo, hi, flo, fhi))


@pytest.mark.parametrize("text, want", [
    ("(q_idx - kv_idx) % shift == 0", "((q_idx % shift) == (kv_idx % shift))"),
    ("0 != (kv_idx + 2 * q_idx) % (shift + 1)", "((kv_idx % (shift + 1)) != (-((2 * q_idx)) % (shift + 1)))"),
    ("(q_idx - kv_idx) % kv_idx == 0", None),  # the divisor reads a position: left alone
    ("(q_idx + 1 - kv_idx) % shift == 1", None),  # not a test against 0
])
def test_modulo_tests_split_by_side(tmp_path, text, want):
    """`ir/passes/separate.py`: a modulo test of a difference of a query-side and a key-side term becomes two
    remainders compared (one per row, one per column in the kernels); the rewrite is exact for every divisor."""
    from ejgen.ir.passes.separate import separate

    mask = load_mask(tmp_path, text)
    assert to_text(separate(mask)) == (to_text(mask) if want is None else want)
    q, k = np.arange(-12, 13)[:, None], np.arange(-12, 13)[None, :]
    for d in (-3, -1, 0, 1, 2, 5):  # the DSL's %: the divisor's sign, a % 0 == a
        mod = lambda a: a if d == 0 else np.mod(a, d)  # noqa: E731
        np.testing.assert_array_equal(mod(q - k) == 0, mod(q) == mod(k))
        np.testing.assert_array_equal(mod(q + k) == 0, mod(q) == mod(-k))
