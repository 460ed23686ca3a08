"""Symbolic derivatives of ``score``, checked numerically against central finite differences.

Each score is loaded from a tiny spec (so it is parsed and type-checked as a user's would be),
differentiated with ``ejgen.ir.passes.derivative`` and through ``plan_attention`` (which also
simplifies), and every derivative is evaluated at random points by the float64 evaluator below,
written from the DSL's definition (docs/DESIGN.md §2), not from ejgen's printers. Points closer than
``KINK_GAP`` to a kink (``abs``, ``min``, ``max``, a float comparison) are skipped.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from ejgen.ir.expr import Binary, Call, Const, ParamRef, Type, Unary, Var, to_text, walk
from ejgen.ir.passes.derivative import diff, param_occurrences, simplify
from ejgen.plan.attention import plan_attention
from ejgen.spec import load_spec

HEADS = 4
TABLE_COLS = 5
BUILTINS = ("s", "q_idx", "kv_idx", "b", "h", "q_len", "kv_len")
STEP = 1e-5
KINK_GAP = 1e-3
POINTS = 24

SPEC = """\
name: probe
family: attention
params:
  slopes: {{shape: [heads], dtype: float32, grad: true}}
  table: {{shape: [heads, {cols}], dtype: float32, grad: true}}
  gate: {{shape: [heads], dtype: float32, grad: true}}
  cap: {{shape: [heads], dtype: float32, grad: true}}
  fixed: {{shape: [heads], dtype: float32}}
options:
  max_distance: {{type: int, default: 8}}
  temperature: {{type: float, default: 1.5}}
score: "{score}"
"""

GRAD_PARAMS = {"slopes", "table", "gate", "cap"}

SCORES = [
    "s",
    "s * s + 3.0 * s - 1.5",
    "s / (1.0 + s * s)",
    "(s * s + 1.0) ** 1.5",
    "s ** 3",
    "2.0 ** (s / 2.0)",
    "exp(s) - log(1.0 + exp(s))",
    "tanh(s) * sigmoid(s)",
    "sqrt(s * s + 0.5)",
    "abs(s) + abs(s - 1.0)",
    "min(s, 0.5) + max(s, -0.5)",
    "where(s > 0.0, s, 0.1 * s)",
    "-s + -(s * s)",
    "sigmoid(-s) * exp(-s * s / 2.0)",
    "30.0 * tanh(s / 30.0)",
    "cap[h] * tanh(s / cap[h])",
    "min(max(s, -cap[h]), cap[h])",
    "s * sigmoid(gate[h]) + (1.0 - sigmoid(gate[h])) * tanh(s)",
    "s - slopes[h] * min(abs(q_idx - kv_idx), max_distance)",
    "s + table[h, kv_idx - q_idx + 2]",
    "s * slopes[h] + slopes[h] ** 2",
    "table[h, 0] * s + table[h, 1] * table[h, 0] + exp(table[h, q_idx - q_idx + 1])",
    "s + slopes[h + b] * slopes[h]",
    "s / temperature + fixed[h] * s",
    "log(exp(s) + exp(slopes[h] * s))",
    "where(q_idx >= kv_idx, s * gate[h], s + gate[h])",
    "max(s * slopes[h], table[h, min(abs(q_idx - kv_idx), 4)])",
    "(1.0 + s * s) ** gate[h]",
    "s * q_idx / (kv_idx + 1)",
    "tanh(sqrt(exp(s) + gate[h] * gate[h]) / cap[h]) * log(cap[h] + sigmoid(s * slopes[h]))",
    "relu(s) + elu(s * gate[h]) + silu(s - 0.5)",
    "softplus(30.0 * s) - logsigmoid(s * slopes[h]) / 16",
]


# --- an independent float64 evaluator of DSL expressions ------------------------------------


class Point:
    """Values of every name at one point; ``kinks`` collects distances to non-smooth places."""

    def __init__(self, rng):
        self.env = {
            "s": float(rng.uniform(-3.0, 3.0)),
            "q_idx": int(rng.integers(0, 20)),
            "kv_idx": int(rng.integers(0, 20)),
            "b": int(rng.integers(0, 2)),
            "h": int(rng.integers(0, HEADS)),
            "q_len": 20,
            "kv_len": 20,
            "max_distance": int(rng.integers(1, 12)),
            "temperature": float(rng.uniform(0.5, 2.0)),
        }
        self.params = {
            "slopes": rng.uniform(-1.5, 1.5, HEADS),
            "table": rng.uniform(-1.5, 1.5, (HEADS, TABLE_COLS)),
            "gate": rng.uniform(-1.5, 1.5, HEADS),
            "cap": rng.uniform(0.5, 2.0, HEADS),
            "fixed": rng.uniform(-1.5, 1.5, HEADS),
        }

    def with_s(self, s):
        p = object.__new__(Point)
        p.env = dict(self.env, s=s)
        p.params = self.params
        return p

    def with_param(self, name, index, delta):
        p = object.__new__(Point)
        p.env = self.env
        p.params = dict(self.params)
        p.params[name] = self.params[name].copy()
        p.params[name][index] += delta
        return p


def _clamped_index(ref, point, kinks, bump):
    arr = point.params[ref.name]
    return tuple(
        min(max(evaluate(i, point, kinks, bump), 0), n - 1) for i, n in zip(ref.indices, arr.shape)
    )


def evaluate(e, point, kinks=None, bump=None):
    """``e`` at ``point``; ints stay Python ints, floats are Python floats (float64).

    ``bump = (ref, delta)`` adds ``delta`` to every occurrence structurally equal to ``ref``.
    """
    ev = lambda x: evaluate(x, point, kinks, bump)  # noqa: E731

    def kink(distance):
        if kinks is not None and isinstance(distance, float):
            kinks.append(abs(distance))

    if isinstance(e, Const):
        return e.value
    if isinstance(e, Var):
        return point.env[e.name]
    if isinstance(e, ParamRef):
        value = float(point.params[e.name][_clamped_index(e, point, kinks, bump)])
        if bump is not None and e == bump[0]:
            value += bump[1]
        return value
    if isinstance(e, Unary):
        return (not ev(e.x)) if e.op == "not" else -ev(e.x)
    if isinstance(e, Binary):
        if e.op == "and":
            return ev(e.a) and ev(e.b)
        if e.op == "or":
            return ev(e.a) or ev(e.b)
        a, b = ev(e.a), ev(e.b)
        if e.op in ("<", "<=", ">", ">=", "==", "!="):
            if isinstance(a, float) or isinstance(b, float):
                kink(float(a) - float(b))
            return {
                "<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b, "==": a == b, "!=": a != b,
            }[e.op]
        if e.op == "+":
            return a + b
        if e.op == "-":
            return a - b
        if e.op == "*":
            return a * b
        if e.op == "/":
            return float(a) / float(b)
        if e.op == "**":
            return a**b
    if isinstance(e, Call):
        args = [ev(x) for x in e.args]
        if e.fn == "where":
            return args[1] if args[0] else args[2]
        if e.fn in ("min", "max"):
            a, b = args
            if isinstance(a, float) or isinstance(b, float):
                kink(float(a) - float(b))
            return min(a, b) if e.fn == "min" else max(a, b)
        (x,) = args
        if e.fn == "abs":
            kink(x)
            return abs(x)
        x = float(x)
        return {
            "exp": math.exp,
            "log": math.log,
            "tanh": math.tanh,
            "sigmoid": lambda t: 1.0 / (1.0 + math.exp(-t)),
            "sqrt": math.sqrt,
        }[e.fn](x)
    raise TypeError(f"cannot evaluate {e!r}")


def smooth_at(score, point) -> bool:
    kinks = []
    evaluate(score, point, kinks)
    return all(k > KINK_GAP for k in kinks)


def fd_s(score, point):
    s = point.env["s"]
    hi = evaluate(score, point.with_s(s + STEP))
    lo = evaluate(score, point.with_s(s - STEP))
    return (hi - lo) / (2 * STEP)


def fd_occurrence(score, point, ref):
    hi = evaluate(score, point, bump=(ref, STEP))
    lo = evaluate(score, point, bump=(ref, -STEP))
    return (hi - lo) / (2 * STEP)


def assert_fd_close(name, got, want, text, point):
    assert math.isfinite(got), f"{name} of {text} is not finite at {point.env}"
    assert abs(got - want) <= 1e-6 * (1.0 + abs(want)), (
        f"{name} of `{text}`: symbolic {got!r}, finite difference {want!r} at {point.env}"
    )


# --- fixtures -------------------------------------------------------------------------------


def load_score(tmp_path, text):
    path = tmp_path / "probe.yaml"
    path.write_text(SPEC.format(cols=TABLE_COLS, score=text))
    return load_spec(path)


def smooth_points(score, seed, count=POINTS):
    rng = np.random.default_rng(seed)
    points = []
    for _ in range(count * 20):
        p = Point(rng)
        if smooth_at(score, p):
            points.append(p)
        if len(points) == count:
            break
    assert len(points) == count, "too few points away from kinks"
    return points


@pytest.fixture(params=range(len(SCORES)), ids=lambda i: SCORES[i].replace(" ", ""))
def case(request, tmp_path):
    text = SCORES[request.param]
    variant = load_score(tmp_path, text)
    plan = plan_attention(variant)
    return text, variant, plan, smooth_points(variant.score, seed=request.param)


# --- tests ----------------------------------------------------------------------------------


def test_d_ds_matches_finite_differences(case):
    text, variant, plan, points = case
    s = Var("s", kind="builtin", ty=Type.FLOAT)
    raw = diff(variant.score, s)
    for point in points:
        want = fd_s(variant.score, point)
        assert_fd_close("d/ds (diff)", float(evaluate(raw, point)), want, text, point)
        assert_fd_close("d/ds (plan)", float(evaluate(plan.dscore_ds, point)), want, text, point)


def test_d_dparam_occurrence_matches_finite_differences(case):
    text, variant, plan, points = case
    refs = param_occurrences(variant.score, GRAD_PARAMS)
    assert [g.ref for g in plan.param_grads] == list(refs)
    for ref in refs:
        raw = diff(variant.score, ref)
        (planned,) = [g.deriv for g in plan.param_grads if g.ref == ref]
        for point in points:
            want = fd_occurrence(variant.score, point, ref)
            name = f"d/d {to_text(ref)}"
            assert_fd_close(name + " (diff)", float(evaluate(raw, point)), want, text, point)
            assert_fd_close(name + " (plan)", float(evaluate(planned, point)), want, text, point)


def test_param_gradient_is_the_sum_over_occurrences(case):
    """Perturbing one element of a param moves every occurrence that reads it (indices clamped):
    the element's gradient is the sum of the occurrence derivatives whose index lands on it."""
    text, variant, plan, points = case
    for point in points[:8]:
        for name in sorted(GRAD_PARAMS):
            arr = point.params[name]
            for index in np.ndindex(arr.shape):
                hi = evaluate(variant.score, point.with_param(name, index, STEP))
                lo = evaluate(variant.score, point.with_param(name, index, -STEP))
                want = (hi - lo) / (2 * STEP)
                got = 0.0
                for g in plan.param_grads:
                    if g.ref.name == name and _clamped_index(g.ref, point, None, None) == index:
                        got += float(evaluate(g.deriv, point))
                assert_fd_close(f"d/d {name}{list(index)}", got, want, text, point)


def test_non_grad_params_have_no_occurrences(tmp_path):
    variant = load_score(tmp_path, "s / temperature + fixed[h] * s + slopes[h]")
    plan = plan_attention(variant)
    assert [to_text(g.ref) for g in plan.param_grads] == ["slopes[h]"]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("s * slopes[h] + slopes[h] ** 2", ["slopes[h]"]),
        ("table[h, 0] * s + table[h, 1]", ["table[h, 0]", "table[h, 1]"]),
        (
            "table[h, 0] * s + table[h, 1] * table[h, 0] + exp(table[h, q_idx - q_idx + 1])",
            ["table[h, 0]", "table[h, 1]", "table[h, ((q_idx - q_idx) + 1)]"],
        ),
        ("s + slopes[h + b] * slopes[h]", ["slopes[(h + b)]", "slopes[h]"]),
        ("s - 0.5 * gate[h] + gate[h] * gate[h]", ["gate[h]"]),
    ],
)
def test_occurrences_are_structural(tmp_path, text, expected):
    """The same param with the same index is one occurrence; different indices are two."""
    variant = load_score(tmp_path, text)
    refs = param_occurrences(variant.score, GRAD_PARAMS)
    assert [to_text(r) for r in refs] == expected
    assert [to_text(g.ref) for g in plan_attention(variant).param_grads] == expected


@pytest.mark.parametrize(
    "text",
    ["s", "s - slopes[h] * abs(q_idx - kv_idx)", "s - slopes[h] * min(abs(q_idx - kv_idx), max_distance)"],
)
def test_simplify_gives_one_for_d_ds_of_shifted_logits(tmp_path, text):
    variant = load_score(tmp_path, text)
    s = Var("s", kind="builtin", ty=Type.FLOAT)
    one = Const(1.0)
    assert simplify(diff(variant.score, s)) == one
    assert to_text(simplify(diff(variant.score, s))) == "1.0"
    plan = plan_attention(variant)
    assert plan.dscore_ds == one and to_text(plan.dscore_ds) == "1.0"


def test_alibi_slope_derivative_is_minus_the_distance(tmp_path):
    variant = load_score(tmp_path, "s - slopes[h] * min(abs(q_idx - kv_idx), max_distance)")
    (grad,) = plan_attention(variant).param_grads
    assert to_text(grad.deriv) == "-min(abs((q_idx - kv_idx)), max_distance)"


def test_integer_and_constant_parts_have_zero_derivative(tmp_path):
    variant = load_score(tmp_path, "s * 0.0 + slopes[h] * (q_idx - kv_idx) + 2.5")
    s = Var("s", kind="builtin", ty=Type.FLOAT)
    assert simplify(diff(variant.score, s)) == Const(0.0)
    (ref,) = param_occurrences(variant.score, GRAD_PARAMS)
    deriv = simplify(diff(variant.score, ref))
    assert to_text(deriv) == "(q_idx - kv_idx)"


def test_positions_refuse_a_spec_reading_indices(tmp_path):
    """Explicit positions place tokens for causal and the window; a score or mask over q_idx / kv_idx is refused
    at plan time, at the feature."""
    from ejgen.errors import SpecError

    path = tmp_path / "demo.yaml"
    path.write_text("name: demo\nfamily: attention\nfeatures:\n  positions: runtime\nmask: kv_idx <= q_idx\n")
    with pytest.raises(SpecError, match="feature 'positions' cannot be combined with a score or mask that reads "
                                        "kv_idx, q_idx") as e:
        plan_attention(load_spec(path))
    assert ":4:" in str(e.value), str(e.value)


MACROS = {  # the DSL's macro functions by their definitions (docs/DESIGN.md §2), in float64
    "relu": lambda x: max(x, 0.0),
    "elu": lambda x: x if x > 0 else math.expm1(x),
    "silu": lambda x: x / (1.0 + math.exp(-x)),
    "softplus": lambda x: math.log1p(math.exp(x)) if x < 30 else x + math.log1p(math.exp(-x)),
    "logsigmoid": lambda x: -(math.log1p(math.exp(-x)) if x > -30 else -x + math.log1p(math.exp(x))),
}


@pytest.mark.parametrize("fn", list(MACROS))
def test_macro_functions_are_their_definitions_and_stay_finite(tmp_path, fn):
    """relu, elu, silu, softplus and logsigmoid expand into the other functions (the printers never see them):
    their values match the definitions from -200 to 200, where e^{-x} or e^{x} alone would overflow float32."""
    variant = load_score(tmp_path, f"{fn}(s)")
    assert not any(isinstance(n, Call) and n.fn == fn for n in walk(variant.score))
    for x in (-200.0, -30.0, -1.5, -1e-3, 0.25, 3.0, 30.0, 200.0):
        point = Point(np.random.default_rng(0))
        point.env["s"] = x
        got = float(evaluate(variant.score, point))
        assert got == pytest.approx(MACROS[fn](x), rel=1e-12, abs=1e-12), (fn, x)
