"""Expression IR for the spec DSL (``score`` and ``mask``).

Nodes are frozen attrs classes. ``loc`` never takes part in equality, so structurally equal
expressions compare equal wherever they came from. ``ty`` is ``None`` until the type checker
(``ejgen.ir.passes.typecheck``) fills it in.

Names a DSL expression may use:
- ``s``: the logit (float);
- ``q_idx``, ``kv_idx``, ``b``, ``h``, ``q_len``, ``kv_len``: ints (``Var`` with kind ``builtin``);
- options: ``Var`` with kind ``option`` and the option's type;
- params: ``ParamRef(name, indices)``, one index per dim of the param's shape.
"""

from __future__ import annotations

import enum

import attrs

from ejgen.errors import Loc


class Type(enum.Enum):
    BOOL = "bool"
    INT = "int"
    FLOAT = "float"

    @property
    def numeric(self) -> bool:
        return self is not Type.BOOL


INDEX_VARS = ("s", "q_idx", "kv_idx", "b", "h", "q_len", "kv_len")
"""Built-in names. ``s`` is float, the others int."""

UNARY_FUNCS = ("exp", "log", "tanh", "sigmoid", "abs", "sqrt", "log2", "exp2", "sign", "floor", "ceil", "round",
               "int", "float")
BINARY_FUNCS = ("min", "max")
MACRO_FUNCS = ("relu", "elu", "silu", "softplus", "logsigmoid")
"""Functions of one float argument written in the others (``expand_macro``): the type checker expands them, so
printers and the derivative pass never see them; the forms keep ``exp`` of large positive numbers out."""
FUNCS = UNARY_FUNCS + BINARY_FUNCS + ("where", "clamp") + MACRO_FUNCS
INT_RESULT_FUNCS = ("floor", "ceil", "round", "int")
"""Functions whose result is an int (an index): ``floor``, ``ceil``, ``round`` (half to even, as Python's) and
``int`` (toward zero) of a float; of an int, the int itself."""

ARITH_OPS = ("+", "-", "*", "/", "//", "%", "**")
INT_OPS = ("//", "%")
"""Integer-only operators: floor division and its modulo, Python's signs (``-7 // 2 == -4``, ``-7 % 2 == 1``);
``a // 0 == 0`` and ``a % 0 == a`` (kernels cannot raise), so ``a == (a // b) * b + a % b`` always holds."""
COMPARE_OPS = ("<", "<=", ">", ">=", "==", "!=")
BOOL_OPS = ("and", "or")


def fold(fn: str, *values):
    """The value of an integer operator (``INT_OPS``) or a cast (``INT_RESULT_FUNCS``, ``float``) on constants:
    what printers write when every operand is a constant (the DSL's semantics, one place)."""
    import math

    if fn == "//":
        a, b = values
        return 0 if b == 0 else a // b
    if fn == "%":
        a, b = values
        return a if b == 0 else a % b
    (x,) = values
    if fn == "float":
        return float(x)
    if isinstance(x, int):
        return x
    return {"floor": math.floor, "ceil": math.ceil, "round": round, "int": int}[fn](x)


def expand_macro(fn: str, x: "Expr", loc=None) -> "Expr":
    """``fn(x)`` of ``MACRO_FUNCS`` in the DSL's own functions (untyped; every node at ``loc``):
    relu(x) = max(x, 0), elu(x) = where(x > 0, x, exp(min(x, 0)) - 1), silu(x) = x sigmoid(x),
    softplus(x) = max(x, 0) + log(1 + exp(-|x|)), logsigmoid(x) = min(x, 0) - log(1 + exp(-|x|))."""
    def c(value):
        return Const(value, loc=loc)

    def f(name, *args):
        return Call(name, args, loc=loc)

    def b(op, a, b_):
        return Binary(op, a, b_, loc=loc)

    tail = f("log", b("+", c(1.0), f("exp", Unary("-", f("abs", x), loc=loc))))  # log(1 + e^-|x|), in (0, log 2]
    if fn == "relu":
        return f("max", x, c(0.0))
    if fn == "elu":
        return f("where", b(">", x, c(0.0)), x, b("-", f("exp", f("min", x, c(0.0))), c(1.0)))
    if fn == "silu":
        return b("*", x, f("sigmoid", x))
    if fn == "softplus":
        return b("+", f("max", x, c(0.0)), tail)
    if fn == "logsigmoid":
        return b("-", f("min", x, c(0.0)), tail)
    raise ValueError(f"not a macro: {fn!r}")


def _loc_field():
    return attrs.field(default=None, eq=False, repr=False, kw_only=True)


def _ty_field():
    return attrs.field(default=None, eq=False, repr=False, kw_only=True)


@attrs.frozen
class Const:
    value: bool | int | float
    loc: Loc | None = _loc_field()
    ty: Type | None = _ty_field()


@attrs.frozen
class Var:
    """A built-in name or an option. ``kind`` is ``"builtin"`` or ``"option"`` once resolved."""

    name: str
    kind: str | None = attrs.field(default=None, kw_only=True)
    loc: Loc | None = _loc_field()
    ty: Type | None = _ty_field()


@attrs.frozen
class ParamRef:
    """``name[i0, i1, ...]``: one element of a tensor param."""

    name: str
    indices: tuple = ()
    loc: Loc | None = _loc_field()
    ty: Type | None = _ty_field()


@attrs.frozen
class Unary:
    op: str  # "-" or "not"
    x: object
    loc: Loc | None = _loc_field()
    ty: Type | None = _ty_field()


@attrs.frozen
class Binary:
    op: str  # ARITH_OPS + COMPARE_OPS + BOOL_OPS
    a: object
    b: object
    loc: Loc | None = _loc_field()
    ty: Type | None = _ty_field()


@attrs.frozen
class Call:
    fn: str  # one of FUNCS
    args: tuple = ()
    loc: Loc | None = _loc_field()
    ty: Type | None = _ty_field()


Expr = Const | Var | ParamRef | Unary | Binary | Call


def children(e: Expr) -> tuple:
    if isinstance(e, ParamRef):
        return e.indices
    if isinstance(e, Unary):
        return (e.x,)
    if isinstance(e, Binary):
        return (e.a, e.b)
    if isinstance(e, Call):
        return e.args
    return ()


def walk(e: Expr):
    """Pre-order traversal."""
    yield e
    for c in children(e):
        yield from walk(c)


def with_children(e: Expr, new: tuple) -> Expr:
    if isinstance(e, ParamRef):
        return attrs.evolve(e, indices=tuple(new))
    if isinstance(e, Unary):
        return attrs.evolve(e, x=new[0])
    if isinstance(e, Binary):
        return attrs.evolve(e, a=new[0], b=new[1])
    if isinstance(e, Call):
        return attrs.evolve(e, args=tuple(new))
    return e


def to_text(e: Expr) -> str:
    """DSL text of an expression, fully parenthesised where precedence could be in doubt."""
    if isinstance(e, Const):
        if isinstance(e.value, bool):
            return "true" if e.value else "false"
        return repr(e.value)
    if isinstance(e, Var):
        return e.name
    if isinstance(e, ParamRef):
        return f"{e.name}[{', '.join(to_text(i) for i in e.indices)}]"
    if isinstance(e, Unary):
        inner = to_text(e.x)
        if not isinstance(e.x, (Const, Var, ParamRef, Call)):
            inner = f"({inner})"
        return f"not {inner}" if e.op == "not" else f"-{inner}"
    if isinstance(e, Binary):
        return f"({to_text(e.a)} {e.op} {to_text(e.b)})"
    if isinstance(e, Call):
        return f"{e.fn}({', '.join(to_text(a) for a in e.args)})"
    raise TypeError(f"not an expression: {e!r}")
