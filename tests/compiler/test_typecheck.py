"""Name resolution and type checking of score and mask."""

import pytest

from ejgen.errors import Loc, SpecError
from ejgen.ir.expr import Const, ParamRef, Type, Var, to_text, walk
from ejgen.ir.passes.typecheck import check, infer
from ejgen.ir.variant import BACKENDS, Option, Param, Variant
from ejgen.spec import parse_expr

PARAMS = (
    Param("slopes", ("heads",), "float32", grad=True),
    Param("table", ("heads", "q_len", "kv_len"), "bfloat16"),
    Param("bucket", ("q_len", 16), "int32"),
)
OPTIONS = (
    Option("max_distance", "int", 1024),
    Option("temperature", "float", 1.0),
    Option("use_mask", "bool", True),
)


def make_variant(score="s", mask="true"):
    return Variant(
        name="demo",
        family="attention",
        doc="",
        modes=("train",),
        backends=BACKENDS,
        features=(),
        params=PARAMS,
        options=OPTIONS,
        score=parse_expr(score, Loc("demo.yaml", 1, 8, f"score: {score}")),
        mask=parse_expr(mask, Loc("demo.yaml", 2, 7, f"mask: {mask}")),
        path="demo.yaml",
        source_hash="0" * 64,
    )


def type_of(text):
    return infer(parse_expr(text, Loc("demo.yaml", 1, 1, text)), make_variant()).ty


@pytest.mark.parametrize(
    "text, ty",
    [
        ("s", Type.FLOAT),
        ("q_idx", Type.INT),
        ("kv_idx", Type.INT),
        ("b", Type.INT),
        ("h", Type.INT),
        ("q_len", Type.INT),
        ("kv_len", Type.INT),
        ("1", Type.INT),
        ("1.0", Type.FLOAT),
        ("true", Type.BOOL),
        ("max_distance", Type.INT),
        ("temperature", Type.FLOAT),
        ("use_mask", Type.BOOL),
        ("slopes[h]", Type.FLOAT),
        ("table[h, q_idx, kv_idx]", Type.FLOAT),
        ("bucket[q_idx, 3]", Type.INT),
        ("q_idx + kv_idx", Type.INT),
        ("q_idx - 1", Type.INT),
        ("q_idx * 2", Type.INT),
        ("q_idx * 2.0", Type.FLOAT),
        ("s + 1", Type.FLOAT),
        ("q_idx / 2", Type.FLOAT),
        ("q_idx ** 2", Type.INT),
        ("q_idx ** 0.5", Type.FLOAT),
        ("s ** 2", Type.FLOAT),
        ("-q_idx", Type.INT),
        ("-s", Type.FLOAT),
        ("q_idx < kv_idx", Type.BOOL),
        ("s >= 0", Type.BOOL),
        ("use_mask == true", Type.BOOL),
        ("(q_idx < 3) != use_mask", Type.BOOL),
        ("not use_mask", Type.BOOL),
        ("use_mask and q_idx > 0 or false", Type.BOOL),
        ("abs(q_idx - kv_idx)", Type.INT),
        ("abs(s)", Type.FLOAT),
        ("exp(q_idx)", Type.FLOAT),
        ("log(s)", Type.FLOAT),
        ("tanh(s)", Type.FLOAT),
        ("sigmoid(1)", Type.FLOAT),
        ("sqrt(kv_len)", Type.FLOAT),
        ("min(q_idx, kv_idx)", Type.INT),
        ("max(q_idx, 1.5)", Type.FLOAT),
        ("where(use_mask, q_idx, kv_idx)", Type.INT),
        ("where(use_mask, q_idx, s)", Type.FLOAT),
        ("where(use_mask, q_idx > 0, false)", Type.BOOL),
    ],
)
def test_types(text, ty):
    assert type_of(text) is ty


def test_check_types_every_node_and_resolves_every_name():
    variant = check(
        make_variant(
            "s * temperature - slopes[h] * min(abs(q_idx - kv_idx), max_distance)",
            "where(use_mask, kv_idx <= q_idx, true)",
        )
    )
    for expr in (variant.score, variant.mask):
        for node in walk(expr):
            assert node.ty is not None, node
            if isinstance(node, Var):
                assert node.kind is not None
    kinds = {n.name: n.kind for e in (variant.score, variant.mask) for n in walk(e) if isinstance(n, Var)}
    assert kinds == {
        "s": "builtin",
        "temperature": "option",
        "h": "builtin",
        "q_idx": "builtin",
        "kv_idx": "builtin",
        "max_distance": "option",
        "use_mask": "option",
    }
    assert variant.score.ty is Type.FLOAT and variant.mask.ty is Type.BOOL


def test_check_keeps_everything_else_and_locations():
    before = make_variant("s + slopes[h]", "kv_idx <= q_idx")
    after = check(before)
    assert after.name == before.name and after.params == before.params
    assert to_text(after.score) == to_text(before.score)
    assert after.score.b.loc == before.score.b.loc
    assert isinstance(after.score.b, ParamRef) and after.score.b.ty is Type.FLOAT
    assert before.score.ty is None  # the input is left untouched


def test_default_score_and_mask():
    variant = Variant(
        name="plain",
        family="attention",
        doc="",
        modes=("train",),
        backends=BACKENDS,
        features=(),
        params=(),
        options=(),
        score=Var("s"),
        mask=Const(True),
        path="plain.yaml",
        source_hash="",
    )
    checked = check(variant)
    assert checked.score == Var("s", kind="builtin")
    assert checked.score.ty is Type.FLOAT
    assert checked.mask.ty is Type.BOOL


@pytest.mark.parametrize(
    "score, mask, at, message",
    [
        ("s + slope[h]", "true", (1, 12), "unknown param 'slope'; did you mean 'slopes'?"),
        ("s * temprature", "true", (1, 12), "unknown name 'temprature'; did you mean 'temperature'?"),
        ("s * exq(q_idx)", "true", (1, 12), "unknown function 'exq'; did you mean 'exp'?"),
        ("s * gelu(s)", "true", (1, 12), "unknown function 'gelu'"),
        ("s - slopes[h, q_idx]", "true", (1, 12), "param 'slopes' has 1 dim (heads) but is indexed with 2 indices"),
        ("s + table[h]", "true", (1, 12), "param 'table' has 3 dims (heads, q_len, kv_len) but is indexed with 1 index"),
        ("s + slopes[h / 2]", "true", (1, 19), "a param index must be an int, but this expression is a float"),
        ("s + slopes[use_mask]", "true", (1, 19), "a param index must be an int, but this expression is a bool"),
        ("s + slopes", "true", (1, 12), "param 'slopes' has 1 dim (heads) and must be indexed: slopes[heads]"),
        ("s + h[0]", "true", (1, 12), "'h' is a built-in scalar and cannot be indexed"),
        ("s + max_distance[0]", "true", (1, 12), "'max_distance' is an option (a scalar) and cannot be indexed"),
        ("s + exp[0]", "true", (1, 12), "'exp' is a function; call it with parentheses"),
        ("s + exp", "true", (1, 12), "'exp' is a function; call it: exp(...)"),
        ("s + slopes(h)", "true", (1, 12), "'slopes' is a param; index it with brackets: slopes[...]"),
        ("s + q_idx(1)", "true", (1, 12), "'q_idx' is a scalar, not a function"),
        ("s + min(s)", "true", (1, 12), "min() takes 2 arguments, got 1"),
        ("s + exp(s, 1)", "true", (1, 12), "exp() takes 1 argument, got 2"),
        ("where(true, s)", "true", (1, 8), "where() takes 3 arguments, got 2"),
        ("s + (q_idx < 3)", "true", (1, 13), "a bool used as a number"),
        ("s * true", "true", (1, 12), "a bool used as a number"),
        ("-use_mask + s", "true", (1, 9), "a bool used as a number"),
        ("s * exp(use_mask)", "true", (1, 16), "a bool used as a number"),
        ("max(s, use_mask)", "true", (1, 15), "a bool used as a number"),
        ("s", "use_mask < 1", (2, 7), "a bool used as a number"),
        ("s", "q_idx and true", (2, 7), "a number used as a condition"),
        ("s", "true or kv_idx", (2, 15), "a number used as a condition"),
        ("s", "not q_idx", (2, 11), "a number used as a condition"),
        ("where(q_idx, s, 0)", "true", (1, 14), "a number used as a condition"),
        ("where(q_idx > 0, s, false)", "true", (1, 28), "where() needs two numbers or two conditions"),
        ("s", "use_mask == 1", (2, 19), "'==' compares a bool with a number"),
        ("s > 0", "true", (1, 8), "score must be a number, but this expression is a condition (bool)"),
        ("s", "q_idx - kv_idx", (2, 7), "mask must be a condition (bool), but this expression is a number"),
        ("s", "1", (2, 7), "mask must be a condition (bool), but this expression is a number"),
        ("s", "kv_idx <= q_idx and s > 0", (2, 27), "mask cannot depend on the logit s"),
        ("s", "exp(s) > 1", (2, 11), "mask cannot depend on the logit s"),
    ],
)
def test_errors(score, mask, at, message):
    with pytest.raises(SpecError) as info:
        check(make_variant(score, mask))
    err = info.value
    assert (err.loc.line, err.loc.col) == at
    assert message in err.message
    line, col = at
    source = f"score: {score}" if line == 1 else f"mask: {mask}"
    assert err.render().splitlines()[1:3] == [f"    {source}", "    " + " " * (col - 1) + "^"]


def test_unknown_name_hint_lists_the_known_names():
    with pytest.raises(SpecError) as info:
        check(make_variant("s + zzz"))
    assert info.value.message == "unknown name 'zzz'"
    assert info.value.hint.startswith("known names: s, q_idx, kv_idx, b, h, q_len, kv_len, max_distance")


@pytest.mark.parametrize("text, ty", [
    ("q_idx // 64", Type.INT), ("(q_idx - kv_idx) % max_distance", Type.INT), ("floor(s)", Type.INT),
    ("ceil(temperature)", Type.INT), ("round(s / 2.0)", Type.INT), ("int(log(s))", Type.INT), ("int(q_idx)", Type.INT),
    ("float(q_idx)", Type.FLOAT), ("float(s)", Type.FLOAT), ("sign(s)", Type.FLOAT), ("sign(q_idx - kv_idx)", Type.INT),
    ("clamp(q_idx, 0, 7)", Type.INT), ("clamp(s, -1, 1)", Type.FLOAT), ("log2(s)", Type.FLOAT), ("exp2(q_idx)", Type.FLOAT),
    ("slopes[h] * float(q_idx // 4)", Type.FLOAT), ("bucket[q_idx, int(log(float(kv_idx + 1)) * 4.0)]", Type.INT),
])
def test_integer_arithmetic_and_conversions(text, ty):
    """docs/DESIGN.md §2: ``//``, ``%`` and floor / ceil / round / int give ints (indices); float, log2, exp2 give
    floats; sign, clamp follow their operands."""
    assert type_of(text) is ty


@pytest.mark.parametrize("text, col, message", [
    ("s // 2", 1, "'//' takes two ints, but this operand is a float; for floats write floor(a / b)"),
    ("q_idx % temperature", 9, "'%' takes two ints, but this operand is a float; for floats write a - b * floor(a / b)"),
    ("q_idx // use_mask", 10, "a bool used as a number"),
    ("slopes[q_idx / 2]", 8, "a param index must be an int, but this expression is a float"),
    ("floor(use_mask)", 7, "a bool used as a number"),
    ("clamp(s, 0)", 1, "clamp() takes 3 arguments, got 2"),
    ("round(s, 2)", 1, "round() takes 1 argument, got 2"),
])
def test_integer_arithmetic_type_errors_point_at_the_operand(text, col, message):
    with pytest.raises(SpecError) as err:
        type_of(text)
    assert message in str(err.value)
    assert err.value.loc.col == col, (err.value.loc, str(err.value))
