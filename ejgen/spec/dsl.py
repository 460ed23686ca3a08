"""The DSL of ``score`` and ``mask``: a lark grammar and a transformer to ``ejgen.ir.expr`` nodes.

Precedence follows Python: ``or`` < ``and`` < ``not`` < comparisons (not chained) < ``+ -`` <
``* / // %`` < unary ``-`` < ``**`` (right-associative, so ``-x ** 2`` is ``-(x ** 2)``).
"""

from __future__ import annotations

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from ejgen.errors import Loc, SpecError
from ejgen.ir.expr import Binary, Call, Const, Expr, ParamRef, Unary, Var

GRAMMAR = r"""
?start: expr

?expr: or_test
?or_test: and_test
    | or_test "or" and_test -> or_
?and_test: not_test
    | and_test "and" not_test -> and_
?not_test: comparison
    | "not" not_test -> not_
?comparison: sum
    | sum "<" sum -> lt
    | sum "<=" sum -> le
    | sum ">" sum -> gt
    | sum ">=" sum -> ge
    | sum "==" sum -> eq
    | sum "!=" sum -> ne
?sum: term
    | sum "+" term -> add
    | sum "-" term -> sub
?term: factor
    | term "*" factor -> mul
    | term "/" factor -> div
    | term "//" factor -> floordiv
    | term "%" factor -> mod
?factor: power
    | "-" factor -> neg
?power: atom
    | atom "**" factor -> pow
?atom: INT -> int
    | FLOAT -> float
    | TRUE -> true
    | FALSE -> false
    | NAME -> name
    | NAME "(" [args] ")" -> call
    | NAME "[" args "]" -> index
    | "(" expr ")"
args: expr ("," expr)*

TRUE: "true"
FALSE: "false"
NAME: /[A-Za-z_][A-Za-z0-9_]*/
FLOAT.2: /([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+/
INT: /[0-9]+/
%ignore /[ \t\f\r\n]+/
"""

# The basic lexer keeps keywords keywords everywhere: the contextual one would read the ``not`` of
# ``a + not b`` as a name.
_PARSER = Lark(
    GRAMMAR, parser="lalr", lexer="basic", propagate_positions=True, maybe_placeholders=True
)

OPERATORS = ("+", "-", "*", "/", "//", "%", "**", "<", "<=", ">", ">=", "==", "!=", "and", "or", "not")
_COMPARISONS = ("<", "<=", ">", ">=", "==", "!=")
_CLOSERS = {"(": ")", "[": "]"}


def parse_expr(text: str, loc: Loc, *, source_lines=None) -> Expr:
    """Parse DSL ``text`` whose first character stands at ``loc``.

    ``text`` is read as a slice of the spec file: its first line starts at ``loc.col``, any later
    line at column 1 of the following file lines. ``source_lines`` (the file's lines) gives those
    later lines' ``Loc.text``; without it the text's own line is shown.
    """
    locator = _Locator(loc, text, source_lines)
    try:
        tree = _PARSER.parse(text)
    except UnexpectedInput as e:
        raise _syntax_error(text, e, locator) from None
    return _Build(locator).transform(tree)


class _Locator:
    """Maps a 1-based (line, column) inside the text to a ``Loc`` in the file."""

    def __init__(self, origin: Loc, text: str, source_lines):
        self.origin = origin
        self.text_lines = text.split("\n")
        self.source_lines = source_lines

    def at(self, line: int, col: int) -> Loc:
        origin = self.origin
        if line == 1:
            return Loc(origin.path, origin.line, origin.col + col - 1, origin.text)
        file_line = origin.line + line - 1
        return Loc(origin.path, file_line, col, self._line_text(line, file_line))

    def _line_text(self, line: int, file_line: int) -> str:
        if self.source_lines is not None and 0 < file_line <= len(self.source_lines):
            return self.source_lines[file_line - 1]
        return self.text_lines[line - 1] if line <= len(self.text_lines) else ""

    def token(self, tok: Token) -> Loc:
        return self.at(tok.line, tok.column)


def _binary(op: str):
    def build(self, meta, children):
        a, b = children
        return Binary(op, a, b, loc=self._loc(meta))

    return build


@v_args(meta=True)
class _Build(Transformer):
    def __init__(self, locator: _Locator):
        super().__init__()
        self.locator = locator

    def _loc(self, meta) -> Loc:
        return self.locator.at(meta.line, meta.column)

    or_ = _binary("or")
    and_ = _binary("and")
    lt = _binary("<")
    le = _binary("<=")
    gt = _binary(">")
    ge = _binary(">=")
    eq = _binary("==")
    ne = _binary("!=")
    add = _binary("+")
    sub = _binary("-")
    mul = _binary("*")
    div = _binary("/")
    floordiv = _binary("//")
    mod = _binary("%")
    pow = _binary("**")

    def not_(self, meta, children):
        return Unary("not", children[0], loc=self._loc(meta))

    def neg(self, meta, children):
        return Unary("-", children[0], loc=self._loc(meta))

    def int(self, meta, children):
        return Const(int(children[0]), loc=self._loc(meta))

    def float(self, meta, children):
        return Const(float(children[0]), loc=self._loc(meta))

    def true(self, meta, children):
        return Const(True, loc=self._loc(meta))

    def false(self, meta, children):
        return Const(False, loc=self._loc(meta))

    def name(self, meta, children):
        return Var(str(children[0]), loc=self._loc(meta))

    def call(self, meta, children):
        fn, args = children
        return Call(str(fn), tuple(args or ()), loc=self._loc(meta))

    def index(self, meta, children):
        name, indices = children
        return ParamRef(str(name), tuple(indices), loc=self._loc(meta))

    def args(self, meta, children):
        return list(children)


def _syntax_error(text: str, e: UnexpectedInput, locator: _Locator) -> SpecError:
    at_end = isinstance(e, UnexpectedToken) and e.token.type == "$END"
    tokens = _tokens_before(text, len(text) if at_end else e.pos_in_stream)
    if isinstance(e, UnexpectedCharacters):
        char = text[e.pos_in_stream]
        return SpecError(_bad_character(char), locator.at(e.line, e.column))
    if not isinstance(e, UnexpectedToken):
        return SpecError("the expression ends too early", locator.at(1, 1))
    message, at = _bad_token(e, tokens)
    return SpecError(message, locator.token(at) if at is not None else locator.at(1, 1))


def _tokens_before(text: str, pos: int) -> list:
    tokens = []
    try:
        for tok in _PARSER.lex(text):
            if tok.start_pos >= pos:
                break
            tokens.append(tok)
    except UnexpectedCharacters:
        pass
    return tokens


def _bad_character(char: str) -> str:
    advice = {
        "=": "'=' is not an operator; use '==' to compare",
        "!": "'!' is not an operator; use 'not', or '!=' to compare",
        "&": "'&' is not an operator; use 'and'",
        "|": "'|' is not an operator; use 'or'",
        "^": "'^' is not an operator; use '**' for powers",
    }
    return advice.get(char, f"unexpected character {char!r}")


def _bad_token(e: UnexpectedToken, tokens: list) -> tuple[str, Token | None]:
    """A message for an unexpected token and the token to point at."""
    tok, prev = e.token, (tokens[-1] if tokens else None)
    at_end = tok.type == "$END"
    if "NAME" in e.expected:
        return _missing_operand(tok, prev, at_end)
    open_bracket = _unclosed_bracket(tokens)
    if open_bracket is not None and tok.value == _CLOSERS[open_bracket.value]:
        return f"unexpected {_describe(tok)}", tok
    if tok.value in (")", "]"):
        if open_bracket is None:
            kind = "parenthesis" if tok.value == ")" else "bracket"
            opener = "(" if tok.value == ")" else "["
            return f"unbalanced {kind}: '{tok.value}' has no matching '{opener}'", tok
        return f"expected '{_CLOSERS[open_bracket.value]}' to close '{open_bracket.value}'", tok
    if at_end and open_bracket is not None:
        kind = "parenthesis" if open_bracket.value == "(" else "bracket"
        return f"unbalanced {kind}: '{open_bracket.value}' is never closed", open_bracket
    if tok.value in _COMPARISONS:
        return "comparisons cannot be chained; join them with 'and'", tok
    return f"missing operator before {_describe(tok)}", tok


def _missing_operand(tok: Token, prev: Token | None, at_end: bool) -> tuple[str, Token | None]:
    if prev is None and at_end:
        return "empty expression", None
    if prev is None:
        return f"expected an expression, got {_describe(tok)}", tok
    if prev.value in _CLOSERS and tok.value == _CLOSERS[prev.value]:
        what = "an expression" if prev.value == "(" else "an index"
        return f"expected {what} inside '{prev.value}{tok.value}'", tok
    if tok.value == "not" and prev.value in OPERATORS:
        return f"'not' cannot follow '{prev.value}'; put it in parentheses", tok
    return f"expected an expression after '{prev.value}'", prev if at_end else tok


def _unclosed_bracket(tokens: list) -> Token | None:
    stack = []
    for tok in tokens:
        if tok.value in _CLOSERS:
            stack.append(tok)
        elif stack and tok.value == _CLOSERS[stack[-1].value]:
            stack.pop()
    return stack[-1] if stack else None


def _describe(tok: Token) -> str:
    return "the end of the expression" if tok.type == "$END" else f"'{tok.value}'"
