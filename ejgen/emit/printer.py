"""Expression printing shared by every backend.

A backend subclasses ``Printer`` and fills in the function table and how names, params and
boolean operators are spelled. Output is parenthesised only where Python precedence needs it.
"""

from __future__ import annotations

from ejgen.ir.expr import INT_OPS, INT_RESULT_FUNCS, Binary, Call, Const, Expr, ParamRef, Type, Unary, Var, fold

_PREC = {"**": 7, "neg": 6, "*": 5, "/": 5, "//": 5, "%": 5, "+": 4, "-": 4, "cmp": 3}
_ATOM = 9


class Printer:
    functions: dict = {}  # DSL function name -> callable spelling, e.g. {"exp": "jnp.exp"}
    logical_and = "logical_and"
    logical_or = "logical_or"
    logical_not = "logical_not"

    def __init__(self, names: dict[str, str]):
        self.names = names  # DSL name -> code (builtins and options)

    def __call__(self, e: Expr) -> str:
        return self.expr(e)[0]

    def expr(self, e: Expr) -> tuple[str, int]:
        if isinstance(e, Const):
            negative = not isinstance(e.value, bool) and e.value < 0
            return self.const(e.value), _PREC["neg"] if negative else _ATOM
        if isinstance(e, Var):
            return self.names[e.name], _ATOM
        if isinstance(e, ParamRef):
            return self.param(e), _ATOM
        if isinstance(e, Unary):
            if e.op == "not":
                return f"{self.logical_not}({self(e.x)})", _ATOM
            return f"-{self.wrap(e.x, _PREC['neg'])}", _PREC["neg"]
        if isinstance(e, Binary):
            return self.binary(e)
        if isinstance(e, Call):
            return self.call(e), _ATOM
        raise TypeError(f"not an expression: {e!r}")

    def wrap(self, e: Expr, prec: int, strict: bool = False) -> str:
        text, p = self.expr(e)
        return f"({text})" if p < prec or (strict and p == prec) else text

    def binary(self, e: Binary) -> tuple[str, int]:
        if e.op in INT_OPS and isinstance(e.a, Const) and isinstance(e.b, Const):
            return self.expr(Const(fold(e.op, e.a.value, e.b.value), ty=Type.INT))
        if e.op in INT_OPS:
            return self.int_op(e)
        if e.op == "and":
            return f"{self.logical_and}({self(e.a)}, {self(e.b)})", _ATOM
        if e.op == "or":
            return f"{self.logical_or}({self(e.a)}, {self(e.b)})", _ATOM
        if e.op in ("<", "<=", ">", ">=", "==", "!="):
            prec = _PREC["cmp"]
            return f"{self.wrap(e.a, prec + 1)} {e.op} {self.wrap(e.b, prec + 1)}", prec
        prec = _PREC[e.op]
        if e.op == "**":
            return self.power(e), prec
        # left-associative: the right operand needs parentheses at equal precedence
        return f"{self.wrap(e.a, prec)} {e.op} {self.wrap(e.b, prec, strict=True)}", prec

    def power(self, e: Binary) -> str:
        return f"{self.wrap(e.a, _PREC['**'], strict=True)} ** {self.wrap(e.b, _PREC['neg'])}"

    def call(self, e: Call) -> str:
        if e.fn in INT_RESULT_FUNCS + ("float",):
            (x,) = e.args
            if isinstance(x, Const):
                return self.const(fold(e.fn, x.value))
            if (x.ty is Type.INT) == (e.fn != "float"):  # an int made an int, a float made a float
                return self(x)
            return self.cast(e.fn, x)
        return f"{self.functions[e.fn]}({', '.join(self(a) for a in e.args)})"

    def int_op(self, e: Binary) -> tuple[str, int]:
        """``a // b`` or ``a % b`` on ints (`ejgen.ir.expr.INT_OPS`: floor, Python's signs, ``a // 0 == 0``,
        ``a % 0 == a``), not both constants."""
        raise NotImplementedError

    def cast(self, fn: str, x: Expr) -> str:
        """``floor``, ``ceil``, ``round`` or ``int`` of a float (an int32 result), or ``float`` of an int."""
        raise NotImplementedError

    def const(self, value) -> str:
        if isinstance(value, bool):
            return "True" if value else "False"
        if isinstance(value, float):
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"non-finite constant {value}")
            return repr(value)
        return str(value)

    def param(self, e: ParamRef) -> str:
        raise NotImplementedError
