"""The DSL parser: precedence, literals, node locations (also inside YAML scalars), syntax errors."""

import textwrap

import pytest

from ejgen.errors import Loc, SpecError
from ejgen.ir.expr import Binary, Call, Const, ParamRef, Unary, Var, to_text, walk
from ejgen.spec import load_spec, parse_expr

ORIGIN = Loc("spec.yaml", 7, 8, "score: <expression>")


def parse(text):
    return parse_expr(text, ORIGIN)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a + b * c", "(a + (b * c))"),
        ("a - b - c", "((a - b) - c)"),
        ("a / b * c", "((a / b) * c)"),
        ("2 ** 3 ** 2", "(2 ** (3 ** 2))"),
        ("-x ** 2", "-((x ** 2))"),
        ("2 ** -x", "(2 ** -x)"),
        ("- - x", "-(-x)"),
        ("-a * b", "(-a * b)"),
        ("(a + b) * c", "((a + b) * c)"),
        ("a + b < c * d", "((a + b) < (c * d))"),
        ("not a < b", "not ((a < b))"),
        ("not not a", "not (not a)"),
        ("a or b and c", "(a or (b and c))"),
        ("a and b or c", "((a and b) or c)"),
        ("not a and b", "(not a and b)"),
        ("a <= b", "(a <= b)"),
        ("a >= b", "(a >= b)"),
        ("a == b", "(a == b)"),
        ("a != b", "(a != b)"),
        ("a > b", "(a > b)"),
        ("where(c, x, y)", "where(c, x, y)"),
        ("f()", "f()"),
        ("table[h, q_idx - 1, kv_idx]", "table[h, (q_idx - 1), kv_idx]"),
        ("notable + android + order", "((notable + android) + order)"),
        ("true_value or falsy", "(true_value or falsy)"),
        ("q_idx // 64 == kv_idx // 64", "((q_idx // 64) == (kv_idx // 64))"),  # Python's precedence
        ("a + b // c * d % e", "(a + (((b // c) * d) % e))"),
        ("-a % b", "(-a % b)"),
        ("a // b ** 2", "(a // (b ** 2))"),
        ("a / b // c", "((a / b) // c)"),
        ("int(log(x)) + floor(2.5)", "(int(log(x)) + floor(2.5))"),
        ("clamp(x, 0, n - 1)", "clamp(x, 0, (n - 1))"),
    ],
)
def test_precedence_and_associativity(text, expected):
    assert to_text(parse(text)) == expected


def test_literals():
    assert parse("42") == Const(42)
    assert type(parse("42").value) is int
    assert parse("1.5") == Const(1.5)
    assert parse("2.") == Const(2.0)
    assert parse(".5") == Const(0.5)
    assert parse("1e3") == Const(1000.0)
    assert type(parse("1e3").value) is float
    assert parse("2.5E-1") == Const(0.25)
    assert parse("true") == Const(True)
    assert parse("false") == Const(False)
    assert parse("-1") == Unary("-", Const(1))


def test_node_kinds():
    e = parse("s - slopes[h] * min(abs(q_idx - kv_idx), max_distance)")
    assert e == Binary(
        "-",
        Var("s"),
        Binary(
            "*",
            ParamRef("slopes", (Var("h"),)),
            Call(
                "min",
                (Call("abs", (Binary("-", Var("q_idx"), Var("kv_idx")),)), Var("max_distance")),
            ),
        ),
    )
    assert all(node.ty is None for node in walk(e))


def test_locations_on_one_line():
    e = parse("s - slopes[h] * min(q_idx, 4)")
    # Columns count from ORIGIN.col (8) for the first character.
    assert (e.loc.line, e.loc.col) == (7, 8)  # the binary starts at its left operand
    product = e.b
    assert (product.loc.line, product.loc.col) == (7, 12)
    assert (product.a.loc.line, product.a.loc.col) == (7, 12)  # slopes
    assert (product.a.indices[0].loc.line, product.a.indices[0].loc.col) == (7, 19)  # h
    call = product.b
    assert (call.loc.line, call.loc.col) == (7, 24)  # min
    assert (call.args[1].loc.line, call.args[1].loc.col) == (7, 35)  # 4
    assert call.loc.path == "spec.yaml"
    assert call.loc.text == ORIGIN.text


def test_locations_on_later_lines_start_at_column_one():
    lines = ["mask: |", "  kv_idx <= q_idx", "    and q_idx - kv_idx < 8"]
    origin = Loc("m.yaml", 2, 3, lines[1])
    e = parse_expr("kv_idx <= q_idx\n    and q_idx - kv_idx < 8", origin, source_lines=lines)
    right = e.b
    assert (right.loc.line, right.loc.col) == (3, 9)
    assert right.loc.text == lines[2]
    assert (right.b.loc.line, right.b.loc.col) == (3, 26)  # 8


def test_later_lines_without_source_lines_show_the_text_line():
    e = parse_expr("a +\n  b", Loc("x.yaml", 1, 5, "foo a +"))
    assert (e.b.loc.line, e.b.loc.col, e.b.loc.text) == (2, 3, "  b")


@pytest.mark.parametrize(
    "text, col, message",
    [
        ("", 8, "empty expression"),
        ("   ", 8, "empty expression"),
        ("a +", 10, "expected an expression after '+'"),
        ("a + )", 12, "expected an expression after '+'"),
        ("a * * b", 12, "expected an expression after '*'"),
        ("not", 8, "expected an expression after 'not'"),
        ("a and", 10, "expected an expression after 'and'"),
        ("f(a,", 11, "expected an expression after ','"),
        ("* a", 8, "expected an expression, got '*'"),
        ("(a + b", 8, "unbalanced parenthesis: '(' is never closed"),
        ("min(a, (b)", 11, "unbalanced parenthesis: '(' is never closed"),
        ("a + b)", 13, "unbalanced parenthesis: ')' has no matching '('"),
        ("x[a", 9, "unbalanced bracket: '[' is never closed"),
        ("a]", 9, "unbalanced bracket: ']' has no matching '['"),
        ("x[a)", 11, "expected ']' to close '['"),
        ("f(a]", 11, "expected ')' to close '('"),
        ("()", 9, "expected an expression inside '()'"),
        ("x[]", 10, "expected an index inside '[]'"),
        ("a < b < c", 14, "comparisons cannot be chained; join them with 'and'"),
        ("a b", 10, "missing operator before 'b'"),
        ("2x", 9, "missing operator before 'x'"),
        ("a + not b", 12, "'not' cannot follow '+'; put it in parentheses"),
        ("a = b", 10, "'=' is not an operator; use '==' to compare"),
        ("!a", 8, "'!' is not an operator"),
        ("a && b", 10, "'&' is not an operator; use 'and'"),
        ("a || b", 10, "'|' is not an operator; use 'or'"),
        ("a ^ 2", 10, "'^' is not an operator; use '**' for powers"),
        ("a % % b", 12, "expected an expression after '%'"),
        ("a // / b", 13, "expected an expression after '//'"),
        ("a $ b", 10, "unexpected character '$'"),
    ],
)
def test_syntax_errors(text, col, message):
    with pytest.raises(SpecError) as info:
        parse(text)
    err = info.value
    assert (err.loc.line, err.loc.col) == (7, col)
    assert message in err.message
    assert err.render().splitlines()[-1] == "    " + " " * (col - 1) + "^"


def test_syntax_error_on_a_later_line():
    lines = ["score: |", "  s +", "    (q_idx", "  * 2"]
    with pytest.raises(SpecError) as info:
        parse_expr("s +\n    (q_idx\n  * 2", Loc("f.yaml", 2, 3, lines[1]), source_lines=lines)
    err = info.value
    assert (err.loc.line, err.loc.col) == (3, 5)
    assert err.message == "unbalanced parenthesis: '(' is never closed"
    assert err.loc.text == "    (q_idx"


def test_syntax_error_after_an_operator_at_the_end_of_a_later_line():
    with pytest.raises(SpecError) as info:
        parse_expr("s *\n  2 -", Loc("f.yaml", 4, 8, "score: s *"))
    assert (info.value.loc.line, info.value.loc.col) == (5, 5)
    assert info.value.message == "expected an expression after '-'"


def write_spec(tmp_path, body, name="spec.yaml"):
    path = tmp_path / name
    path.write_text("name: demo\nfamily: attention\n" + textwrap.dedent(body))
    return path


def loc_of(node):
    return (node.loc.line, node.loc.col)


def test_location_in_a_plain_scalar(tmp_path):
    path = write_spec(tmp_path, "mask:   kv_idx <= q_idx + 3\n")
    mask = load_spec(path).mask
    assert loc_of(mask) == (3, 9)
    assert loc_of(mask.b) == (3, 19)
    assert loc_of(mask.b.b) == (3, 27)
    assert mask.b.b.loc.text == "mask:   kv_idx <= q_idx + 3"


def test_location_in_a_flow_mapping(tmp_path):
    line = "{name: demo, family: attention, score: s * 2, mask: q_idx >= kv_idx}"
    path = tmp_path / "flow.yaml"
    path.write_text(line + "\n")
    variant = load_spec(path)
    assert loc_of(variant.score.b) == (1, line.index("2") + 1)
    assert loc_of(variant.mask.b) == (1, line.index("kv_idx") + 1)


def test_location_in_quoted_scalars(tmp_path):
    path = write_spec(tmp_path, "score: 's * 2.0'\nmask: \"kv_idx <= q_idx\"\n")
    variant = load_spec(path)
    assert loc_of(variant.score) == (3, 9)
    assert loc_of(variant.score.b) == (3, 13)
    assert loc_of(variant.mask.b) == (4, 18)


def test_quoted_scalar_with_escapes_points_at_the_scalar(tmp_path):
    path = write_spec(tmp_path, 'mask: "kv_idx <=\\tq_idx"\n')
    mask = load_spec(path).mask
    assert mask == Binary("<=", Var("kv_idx", kind="builtin"), Var("q_idx", kind="builtin"))
    # With escapes the text differs from the file: positions count from inside the quote.
    assert loc_of(mask.a) == (3, 8)
    assert mask.b.loc.line == 3


def test_location_in_a_multi_line_plain_scalar(tmp_path):
    path = write_spec(tmp_path, "mask: kv_idx <= q_idx\n  and q_idx < 100\n")
    mask = load_spec(path).mask
    assert loc_of(mask.b) == (4, 7)
    assert loc_of(mask.b.b) == (4, 15)
    assert mask.b.loc.text == "  and q_idx < 100"


def test_location_in_a_literal_block_scalar(tmp_path):
    path = write_spec(
        tmp_path,
        """\
        score: |  # ALiBi with a cap
          s - slopes[h]
              * min(abs(q_idx - kv_idx), 64)
        params:
          slopes: {shape: [heads]}
        """,
    )
    score = load_spec(path).score
    assert loc_of(score) == (4, 3)
    assert loc_of(score.b.a) == (4, 7)  # slopes
    assert loc_of(score.b.a.indices[0]) == (4, 14)  # h
    assert loc_of(score.b.b) == (5, 9)  # min
    assert loc_of(score.b.b.args[0].args[0].b) == (5, 25)  # kv_idx
    assert score.b.b.loc.text == "      * min(abs(q_idx - kv_idx), 64)"


def test_location_in_a_folded_block_scalar(tmp_path):
    path = write_spec(tmp_path, "mask: >-\n\n    kv_idx <= q_idx and\n    q_idx < 64\n")
    mask = load_spec(path).mask
    assert loc_of(mask) == (5, 5)
    assert loc_of(mask.b) == (6, 5)
    assert loc_of(mask.b.b) == (6, 13)


def test_location_in_a_block_scalar_with_indentation_indicator(tmp_path):
    path = write_spec(tmp_path, "mask: |2\n     kv_idx <= q_idx\n")
    mask = load_spec(path).mask
    assert loc_of(mask.a) == (4, 6)
    assert loc_of(mask.b) == (4, 16)


def test_syntax_error_in_a_block_scalar(tmp_path):
    path = write_spec(tmp_path, "score: |\n  s -\n    slopes[h,]\nparams:\n  slopes: {shape: [heads]}\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    err = info.value
    assert (err.loc.line, err.loc.col) == (5, 14)
    assert err.message == "expected an expression after ','"
    assert err.render().splitlines()[1:] == ["    " + "    slopes[h,]", "    " + " " * 13 + "^"]
    assert str(err.loc) == f"{path}:5:14"
