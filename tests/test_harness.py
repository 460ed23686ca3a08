"""The shared test harness: pairwise covering designs (tests/covering.py) and the conformance base
(tests/conformance.py) that every family's suite is built on."""

from __future__ import annotations

import itertools
import random

import pytest

import conformance
import covering
from conftest import ON_GPU


def _all_pairs_covered(rows, factors, valid):
    for (a, xs), (b, ys) in itertools.combinations(factors.items(), 2):
        for x, y in itertools.product(xs, ys):
            if valid({a: x, b: y}):
                assert any(r[a] == x and r[b] == y for r in rows), (a, x, b, y)


@pytest.mark.parametrize("seed", range(5))
def test_pairwise_covers_every_valid_pair_and_is_small(seed):
    rng = random.Random(seed)
    factors = {f"f{i}": tuple(range(rng.randint(1, 6))) for i in range(rng.randint(2, 8))}
    rows = covering.pairwise(factors, seed=seed)
    _all_pairs_covered(rows, factors, lambda _: True)
    sizes = sorted(len(v) for v in factors.values())
    assert len(rows) >= sizes[-1] * sizes[-2]
    assert len(rows) <= 2 * sizes[-1] * sizes[-2] + 4
    assert covering.missing_pairs(rows, factors) == []
    assert covering.pairwise(factors, seed=seed) == rows  # the same rows on every run


def test_pairwise_respects_constraints_and_names_what_is_missing():
    factors = {"a": (0, 1, 2), "b": ("x", "y"), "c": (None, "on")}
    valid = lambda row: not (row.get("a") == 2 and row.get("c") == "on")  # noqa: E731
    rows = covering.pairwise(factors, valid)
    assert all(valid(r) for r in rows)
    _all_pairs_covered(rows, factors, valid)
    missing = covering.missing_pairs(rows[1:], factors, valid)
    assert missing and all(" with " in m for m in missing)


def test_the_base_checks_pairs_tiles_and_refusals():
    """A toy family: the base's design covers it, a row set missing a pair or whole tiles is reported, a
    backend's refusal is taken out of its design and given back as a case to refuse."""

    class Shape:
        def __init__(self, n):
            self.n, self.id = n, f"S{n}"

    shapes = (Shape(1), Shape(40), Shape(300))
    suite = conformance.Suite(
        family="toy",
        factors={"mode": ("a", "b", "c"), "shape": shapes, "dtype": ("f32", "bf16")},
        valid=lambda row: True,
        make_case=lambda row: type("Case", (), {"id": f"{row['mode']}-{row['shape'].id}-{row['dtype']}"})(),
        lengths=lambda s: (s.n, s.n),
        backends=(
            conformance.Backend("small", lambda s: s.n < 100, lambda s, d: (16, 16)),
            conformance.Backend("big", lambda s: True, lambda s, d: (128, 128),
                                lambda row: "too long" if getattr(row.get("shape"), "n", 0) > 200 else None),
        ),
    )
    assert suite.missing("small", suite.rows("small")) == []
    assert all(r["shape"].n < 100 for r in suite.rows("small"))
    assert all(r["shape"].n < 200 for r in suite.rows("big"))
    # on "big" no allowed shape has two tiles: every level is reported
    assert any("two tiles" in p for p in suite.missing("big", suite.rows("big")))
    rows = [r for r in suite.rows("small") if r["shape"].n == 1]
    assert any("pair" in p for p in suite.missing("small", rows))
    assert any("mode=a: no case with two tiles" in p for p in suite.missing("small", rows))
    refusals = suite.refusals()
    assert [(p.values[0], p.values[2]) for p in refusals] == [("big", "too long")]


def test_an_interpreted_backend_runs_the_rows_that_cover_every_level(monkeypatch):
    """An interpreted backend (without EJGEN_FULL_SUITE) runs a subset of its pairwise rows: every shape, every other
    level on a shape of two tiles or more; the base checks levels for it, not pairs. With EJGEN_FULL_SUITE, pairs."""

    class Shape:
        def __init__(self, n):
            self.n, self.id = n, f"S{n}"

    def toy():
        return conformance.Suite(
            family="toy",
            factors={"mode": ("a", "b", "c", "d"), "flag": (None, "on"), "shape": (Shape(1), Shape(40), Shape(70)),
                     "dtype": ("f32", "bf16", "f16")},
            valid=lambda row: True,
            make_case=lambda row: type("Case", (), {"id": "-".join(map(str, row.values()))})(),
            lengths=lambda s: (s.n, s.n),
            backends=(conformance.Backend("slow", lambda s: True, lambda s, d: (16, 16), interpreted=True),),
        )

    monkeypatch.setattr(conformance, "FULL", False)
    suite = toy()
    pairwise, rows = suite.pairwise_rows("slow"), suite.rows("slow")
    assert len(rows) < len(pairwise) and all(r in pairwise for r in rows)
    assert suite.missing("slow", rows) == []
    assert {r["shape"].n for r in rows} == {1, 40, 70}
    for name in ("mode", "flag", "dtype"):
        assert {r[name] for r in rows if r["shape"].n > 16} == set(suite.factors[name]), name
    assert covering.missing_pairs(rows, suite.factors_for("slow"))  # pairs are not required of it
    others = [r for r in rows if r["mode"] != "a"]
    assert "mode=a: no case" in suite.missing("slow", others)
    one_tile = others + [{"mode": "a", "flag": None, "shape": suite.factors["shape"][0], "dtype": "f32"}]
    assert "mode=a: no case with two tiles or more on both axes" in suite.missing("slow", one_tile)
    monkeypatch.setattr(conformance, "FULL", True)
    full = toy()
    assert full.rows("slow") == full.pairwise_rows("slow") and full.missing("slow", full.rows("slow")) == []


try:
    import triton
    import triton.language as tl
except ImportError:  # the triton extra is part of the test install (README); without it this test fails
    triton = None
else:
    @triton.jit
    def _twice(x):
        return x * 2

    @triton.jit
    def _nested_calls(X, Y, N: tl.constexpr):
        offs = tl.arange(0, N)
        x = tl.load(X + offs)
        for _ in range(3):
            x = _twice(x) - tl.max(x, 0)
        tl.store(Y + offs, x + tl.sum(_twice(x), 0))


@pytest.mark.skipif(ON_GPU, reason="Triton's interpreter runs where there is no GPU")
def test_the_triton_interpreter_patches_the_language_once_per_launch(monkeypatch):
    """conftest installs ``ejgen.testing.interpreter.skip_nested_patches``: a launch patches triton.language once
    (and Triton's own helpers their module once), not at every call of a nested helper; results are unchanged."""
    import torch
    from triton.runtime import interpreter

    assert getattr(interpreter.GridExecutor.__call__, "_ejgen", False), "conftest did not install the shortcut here"
    patches = []
    patch_lang = interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: patches.append(fn.__name__) or patch_lang(fn))
    x = torch.arange(8, dtype=torch.float32) - 3
    y = torch.zeros(8)
    for _ in range(2):
        patches.clear()
        _nested_calls[(1,)](x, y, N=8)
        assert patches[0] == "_nested_calls" and len(patches) <= 3, patches  # the launch, then max and sum once each
    want = x.numpy().astype(float)
    for _ in range(3):
        want = 2 * want - want.max()
    assert y.numpy().tolist() == (want + 2 * want.sum()).tolist()
