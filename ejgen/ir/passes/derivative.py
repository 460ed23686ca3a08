"""Symbolic differentiation of a typed score expression, and simplification.

``diff(e, wrt)`` differentiates with respect to the logit ``Var("s")`` or one occurrence of a
param (a ``ParamRef``, compared structurally: ``slopes[h]`` twice is one occurrence). Integer and
bool subexpressions have derivative zero (``//``, ``%``, ``floor``, ``ceil``, ``round`` and ``int`` are ints: the
integer parts pass no gradient; ``sign`` of a float is flat). Non-smooth functions use the one-sided conventions
``d|x| = sign(x)``, ``d min(a, b) = where(a <= b, da, db)``, ``d max(a, b) = where(a >= b, da, db)``,
``d clamp(x, lo, hi) = where(x < lo, dlo, where(x > hi, dhi, dx))``.
"""

from __future__ import annotations

import attrs

from ejgen.ir.expr import Binary, Call, Const, Expr, ParamRef, Type, Unary, Var, children, walk, with_children

ZERO = Const(0.0, ty=Type.FLOAT)
ONE = Const(1.0, ty=Type.FLOAT)


def const(value) -> Const:
    if isinstance(value, bool):
        return Const(value, ty=Type.BOOL)
    if isinstance(value, int):
        return Const(value, ty=Type.INT)
    return Const(float(value), ty=Type.FLOAT)


def _is_const(e: Expr, value) -> bool:
    return isinstance(e, Const) and not isinstance(e.value, bool) and e.value == value


def _promote(a: Expr, b: Expr) -> Type:
    return Type.FLOAT if Type.FLOAT in (a.ty, b.ty) else Type.INT


def add(a: Expr, b: Expr) -> Expr:
    if _is_const(a, 0):
        return b
    if _is_const(b, 0):
        return a
    if isinstance(a, Const) and isinstance(b, Const):
        return const(a.value + b.value)
    return Binary("+", a, b, ty=_promote(a, b))


def sub(a: Expr, b: Expr) -> Expr:
    if _is_const(b, 0):
        return a
    if _is_const(a, 0):
        return neg(b)
    if isinstance(a, Const) and isinstance(b, Const):
        return const(a.value - b.value)
    if a == b:
        return const(0 if a.ty is Type.INT else 0.0)
    return Binary("-", a, b, ty=_promote(a, b))


def mul(a: Expr, b: Expr) -> Expr:
    if _is_const(a, 0) or _is_const(b, 0):
        return ZERO if Type.FLOAT in (a.ty, b.ty) else const(0)
    if _is_const(a, 1):
        return b
    if _is_const(b, 1):
        return a
    if _is_const(a, -1):
        return neg(b)
    if _is_const(b, -1):
        return neg(a)
    if isinstance(a, Const) and isinstance(b, Const):
        return const(a.value * b.value)
    return Binary("*", a, b, ty=_promote(a, b))


def div(a: Expr, b: Expr) -> Expr:
    if _is_const(a, 0):
        return ZERO
    if _is_const(b, 1):
        return a if a.ty is Type.FLOAT else Binary("/", a, ONE, ty=Type.FLOAT)
    if isinstance(a, Const) and isinstance(b, Const) and b.value != 0:
        return const(float(a.value) / float(b.value))
    return Binary("/", a, b, ty=Type.FLOAT)


def neg(a: Expr) -> Expr:
    if isinstance(a, Const):
        return const(-a.value)
    if isinstance(a, Unary) and a.op == "-":
        return a.x
    return Unary("-", a, ty=a.ty)


def power(a: Expr, b: Expr) -> Expr:
    if _is_const(b, 1):
        return a
    if _is_const(b, 0):
        return ONE
    return Binary("**", a, b, ty=_promote(a, b))


def call(fn: str, *args: Expr, ty: Type = Type.FLOAT) -> Expr:
    return Call(fn, tuple(args), ty=ty)


def where(c: Expr, a: Expr, b: Expr) -> Expr:
    if isinstance(c, Const):
        return a if c.value else b
    if a == b:
        return a
    return Call("where", (c, a, b), ty=_promote(a, b))


def compare(op: str, a: Expr, b: Expr) -> Expr:
    return Binary(op, a, b, ty=Type.BOOL)


def diff(e: Expr, wrt: Expr) -> Expr:
    """d e / d wrt, simplified while it is built."""
    if e.ty in (Type.INT, Type.BOOL):
        return ZERO
    if e == wrt:
        return ONE
    if isinstance(e, (Const, Var, ParamRef)):
        return ZERO
    if isinstance(e, Unary):
        return neg(diff(e.x, wrt))
    if isinstance(e, Binary):
        return _diff_binary(e, wrt)
    if isinstance(e, Call):
        return _diff_call(e, wrt)
    raise TypeError(f"cannot differentiate {e!r}")


def _diff_binary(e: Binary, wrt: Expr) -> Expr:
    a, b = e.a, e.b
    da, db = diff(a, wrt), diff(b, wrt)
    if e.op == "+":
        return add(da, db)
    if e.op == "-":
        return sub(da, db)
    if e.op == "*":
        return add(mul(da, b), mul(a, db))
    if e.op == "/":
        return sub(div(da, b), div(mul(a, db), mul(b, b)))
    if e.op == "**":
        if _is_const(db, 0):
            return mul(mul(b, power(a, sub(b, ONE))), da)
        # d a^b = a^b (db log a + b da / a)
        return mul(e, add(mul(db, call("log", a)), div(mul(b, da), a)))
    raise TypeError(f"operator {e.op!r} has no derivative")


def _diff_call(e: Call, wrt: Expr) -> Expr:
    if e.fn == "where":
        c, a, b = e.args
        return where(c, diff(a, wrt), diff(b, wrt))
    if e.fn in ("min", "max"):
        a, b = e.args
        op = "<=" if e.fn == "min" else ">="
        return where(compare(op, a, b), diff(a, wrt), diff(b, wrt))
    if e.fn == "clamp":
        x, lo, hi = e.args
        inner = where(compare(">", x, hi), diff(hi, wrt), diff(x, wrt))
        return where(compare("<", x, lo), diff(lo, wrt), inner)
    (x,) = e.args
    dx = diff(x, wrt)
    if _is_const(dx, 0):
        return ZERO
    if e.fn == "exp":
        return mul(e, dx)
    if e.fn == "log":
        return div(dx, x)
    if e.fn == "tanh":
        return mul(sub(ONE, mul(e, e)), dx)
    if e.fn == "sigmoid":
        return mul(mul(e, sub(ONE, e)), dx)
    if e.fn == "sqrt":
        return div(dx, mul(const(2.0), e))
    if e.fn == "log2":
        return div(dx, mul(x, const(0.6931471805599453)))
    if e.fn == "exp2":
        return mul(mul(e, const(0.6931471805599453)), dx)
    if e.fn == "float":
        return dx
    if e.fn == "sign":
        return ZERO
    if e.fn == "abs":
        zero = ZERO if x.ty is Type.FLOAT else const(0)
        sign = where(compare(">", x, zero), ONE, where(compare("<", x, zero), const(-1.0), ZERO))
        return mul(sign, dx)
    raise TypeError(f"function {e.fn!r} has no derivative")


def simplify(e: Expr) -> Expr:
    """Bottom-up rebuild through the simplifying constructors."""
    new = tuple(simplify(c) for c in children(e))
    if isinstance(e, Binary):
        a, b = new
        builders = {"+": add, "-": sub, "*": mul, "/": div, "**": power}
        if e.op in builders:
            return builders[e.op](a, b)
        return attrs.evolve(e, a=a, b=b)
    if isinstance(e, Unary) and e.op == "-":
        return neg(new[0])
    if isinstance(e, Call) and e.fn == "where":
        return where(*new)
    return with_children(e, new)


def param_occurrences(e: Expr, grad_params: set[str]) -> tuple[ParamRef, ...]:
    """Distinct occurrences of differentiable params in ``e``, in order of first appearance."""
    seen: list[ParamRef] = []
    for node in walk(e):
        if isinstance(node, ParamRef) and node.name in grad_params and node not in seen:
            seen.append(node)
    return tuple(seen)
