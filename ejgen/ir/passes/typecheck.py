"""Name resolution and type checking of a variant's ``score`` and ``mask``.

``check`` returns a copy of the variant whose expressions have every node's ``ty`` set and every
``Var``'s ``kind`` resolved (``"builtin"`` or ``"option"``); misuse is a ``SpecError`` at the
offending node.
"""

from __future__ import annotations

import difflib

import attrs

from ejgen.errors import SpecError
from ejgen.ir.expr import (
    ARITH_OPS,
    BINARY_FUNCS,
    BOOL_OPS,
    COMPARE_OPS,
    FUNCS,
    INDEX_VARS,
    INT_OPS,
    INT_RESULT_FUNCS,
    MACRO_FUNCS,
    Binary,
    Call,
    Const,
    Expr,
    UNARY_FUNCS,
    ParamRef,
    Type,
    Unary,
    Var,
    expand_macro,
    walk,
)
from ejgen.ir.variant import RECURRENT_MAP_VARS, STEP_GATES, Param, RecurrentVariant, Variant

ARITY = {**dict.fromkeys(UNARY_FUNCS + MACRO_FUNCS, 1), **dict.fromkeys(BINARY_FUNCS, 2), "where": 3, "clamp": 3}
_FLOAT_RESULT = ("exp", "log", "tanh", "sigmoid", "sqrt", "log2", "exp2", "float")
_OPTION_TYPES = {"int": Type.INT, "float": Type.FLOAT, "bool": Type.BOOL}

BOOL_AS_NUMBER = "a bool used as a number"
NUMBER_AS_CONDITION = "a number used as a condition"


def check(variant: Variant) -> Variant:
    """The variant with typed ``score`` and ``mask``; raises ``SpecError`` on misuse."""
    score = infer(variant.score, variant)
    if score.ty is Type.BOOL:
        message = "score must be a number, but this expression is a condition (bool)"
        raise SpecError(message, score.loc)
    mask = infer(variant.mask, variant)
    for node in walk(mask):
        if isinstance(node, Var) and node.name == "s":
            raise SpecError("mask cannot depend on the logit s", node.loc)
    if mask.ty is not Type.BOOL:
        message = "mask must be a condition (bool), but this expression is a number"
        raise SpecError(message, mask.loc)
    return attrs.evolve(variant, score=score, mask=mask)


def check_recurrent(variant: RecurrentVariant) -> RecurrentVariant:
    """The recurrent variant with typed hooks: each a number that reads ``x`` (and nothing else but constants);
    gate_map needs a per-step gate to act on."""
    maps = {}
    for field in ("feature_map", "gate_map"):
        expr = getattr(variant, field)
        if expr is None:
            maps[field] = None
            continue
        typed = _MapChecker(field).infer(expr)
        if typed.ty is Type.BOOL:
            raise SpecError(f"{field} must be a number, but this expression is a condition (bool)", typed.loc)
        if not any(isinstance(n, Var) for n in walk(typed)):
            raise SpecError(f"{field} must read x (the element it maps), but this expression is a constant",
                            typed.loc)
        maps[field] = typed
    if maps["gate_map"] is not None and not variant.feature_names() & set(STEP_GATES):
        raise SpecError(f"gate_map maps the per-step gates, but the spec enables none of {', '.join(STEP_GATES)}",
                        variant.gate_map.loc, hint="add a gate under features, e.g. 'gk: always'")
    return attrs.evolve(variant, **maps)


def infer(expr: Expr, variant: Variant) -> Expr:
    """``expr`` with every node typed and every name resolved against ``variant``.

    For expressions a later pass builds (derivatives of ``score``, say) as much as for the spec's.
    """
    return _Checker(variant).infer(expr)


def promote(a: Type, b: Type) -> Type:
    """The type of arithmetic on two numbers: int only when both are int."""
    return Type.INT if a is Type.INT and b is Type.INT else Type.FLOAT


class _Checker:
    def __init__(self, variant: Variant):
        self.variant = variant

    def known_names(self) -> list:
        names = list(INDEX_VARS)
        names += [o.name for o in self.variant.options]
        names += [p.name for p in self.variant.params]
        return names

    def infer(self, e: Expr) -> Expr:
        if isinstance(e, Const):
            return attrs.evolve(e, ty=_const_type(e.value))
        if isinstance(e, Var):
            return self._var(e)
        if isinstance(e, ParamRef):
            return self._param_ref(e)
        if isinstance(e, Unary):
            return self._unary(e)
        if isinstance(e, Binary):
            return self._binary(e)
        if isinstance(e, Call):
            return self._call(e)
        raise TypeError(f"not an expression: {e!r}")

    def _var(self, e: Var) -> Var:
        if e.name in INDEX_VARS:
            ty = Type.FLOAT if e.name == "s" else Type.INT
            return attrs.evolve(e, kind="builtin", ty=ty)
        option = self.variant.option(e.name)
        if option is not None:
            return attrs.evolve(e, kind="option", ty=_OPTION_TYPES[option.type])
        param = self.variant.param(e.name)
        if param is not None:
            raise SpecError(
                f"param '{e.name}' has {_dims(param)} and must be indexed: "
                f"{e.name}[{', '.join(str(d) for d in param.shape)}]",
                e.loc,
            )
        if e.name in FUNCS:
            raise SpecError(f"'{e.name}' is a function; call it: {e.name}(...)", e.loc)
        raise _unknown("name", e.name, self.known_names(), e.loc, also=("true", "false"))

    def _param_ref(self, e: ParamRef) -> ParamRef:
        param = self.variant.param(e.name)
        if param is None:
            raise self._not_a_param(e)
        if len(e.indices) != len(param.shape):
            count = _plural(len(e.indices), "index", "indices")
            message = f"param '{e.name}' has {_dims(param)} but is indexed with {count}"
            raise SpecError(message, e.loc)
        indices = tuple(self.infer(i) for i in e.indices)
        for i in indices:
            if i.ty is not Type.INT:
                message = f"a param index must be an int, but this expression is a {i.ty.value}"
                raise SpecError(message, i.loc)
        ty = Type.INT if param.dtype == "int32" else Type.FLOAT
        return attrs.evolve(e, indices=indices, ty=ty)

    def _not_a_param(self, e: ParamRef) -> SpecError:
        if e.name in INDEX_VARS:
            return SpecError(f"'{e.name}' is a built-in scalar and cannot be indexed", e.loc)
        if self.variant.option(e.name) is not None:
            return SpecError(f"'{e.name}' is an option (a scalar) and cannot be indexed", e.loc)
        if e.name in FUNCS:
            message = f"'{e.name}' is a function; call it with parentheses: {e.name}(...)"
            return SpecError(message, e.loc)
        params = [p.name for p in self.variant.params]
        return _unknown("param", e.name, params or self.known_names(), e.loc)

    def _unary(self, e: Unary) -> Unary:
        x = self.infer(e.x)
        if e.op == "not":
            _require_bool(x)
            return attrs.evolve(e, x=x, ty=Type.BOOL)
        _require_number(x)
        return attrs.evolve(e, x=x, ty=x.ty)

    def _binary(self, e: Binary) -> Binary:
        a, b = self.infer(e.a), self.infer(e.b)
        typed = attrs.evolve(e, a=a, b=b)
        if e.op in BOOL_OPS:
            _require_bool(a)
            _require_bool(b)
            return attrs.evolve(typed, ty=Type.BOOL)
        if e.op in COMPARE_OPS:
            return attrs.evolve(typed, ty=_compare_type(e.op, a, b))
        if e.op in ARITH_OPS:
            return attrs.evolve(typed, ty=_arith_type(e.op, a, b))
        raise TypeError(f"unknown operator {e.op!r}")

    def _call(self, e: Call) -> Call:
        if e.fn not in ARITY:
            raise self._not_a_function(e)
        if len(e.args) != ARITY[e.fn]:
            count = _plural(ARITY[e.fn], "argument", "arguments")
            raise SpecError(f"{e.fn}() takes {count}, got {len(e.args)}", e.loc)
        args = tuple(self.infer(a) for a in e.args)
        if e.fn in MACRO_FUNCS:  # written in the other functions; the argument is checked once, as written
            _require_number(args[0])
            return self.infer(expand_macro(e.fn, args[0], e.loc))
        return attrs.evolve(e, args=args, ty=_call_type(e.fn, args))

    def _not_a_function(self, e: Call) -> SpecError:
        if self.variant.param(e.fn) is not None:
            return SpecError(f"'{e.fn}' is a param; index it with brackets: {e.fn}[...]", e.loc)
        if e.fn in INDEX_VARS or self.variant.option(e.fn) is not None:
            return SpecError(f"'{e.fn}' is a scalar, not a function", e.loc)
        return _unknown("function", e.fn, list(FUNCS), e.loc)


class _MapChecker(_Checker):
    """Types an element-wise hook of a recurrent spec: the one name is ``x`` (a float), no params or options."""

    def __init__(self, field: str):
        self.field = field
        self.variant = None

    def known_names(self) -> list:
        return list(RECURRENT_MAP_VARS)

    def _var(self, e: Var) -> Var:
        if e.name in RECURRENT_MAP_VARS:
            return attrs.evolve(e, kind="builtin", ty=Type.FLOAT)
        if e.name in FUNCS:
            raise SpecError(f"'{e.name}' is a function; call it: {e.name}(...)", e.loc)
        error = _unknown("name", e.name, self.known_names(), e.loc)
        raise SpecError(f"{error.message} ({self.field} reads only x, the element it maps)", e.loc, hint=error.hint)

    def _param_ref(self, e: ParamRef) -> ParamRef:
        raise SpecError(f"{self.field} has no params: '{e.name}[...]' cannot be read here (it reads only x)", e.loc)

    def _not_a_function(self, e: Call) -> SpecError:
        return _unknown("function", e.fn, list(FUNCS), e.loc)


def _const_type(value) -> Type:
    if isinstance(value, bool):
        return Type.BOOL
    return Type.INT if isinstance(value, int) else Type.FLOAT


def _compare_type(op: str, a: Expr, b: Expr) -> Type:
    if op in ("==", "!=") and a.ty is Type.BOOL and b.ty is Type.BOOL:
        return Type.BOOL
    if op in ("==", "!=") and (a.ty is Type.BOOL) != (b.ty is Type.BOOL):
        raise SpecError(f"'{op}' compares a bool with a number", b.loc)
    _require_number(a)
    _require_number(b)
    return Type.BOOL


def _arith_type(op: str, a: Expr, b: Expr) -> Type:
    _require_number(a)
    _require_number(b)
    if op in INT_OPS:
        for x in (a, b):
            if x.ty is not Type.INT:
                hint = "floor(a / b)" if op == "//" else "a - b * floor(a / b)"
                raise SpecError(f"'{op}' takes two ints, but this operand is a float; for floats write {hint}, "
                                f"or make it an int with int(), floor(), ceil() or round()", x.loc)
        return Type.INT
    return Type.FLOAT if op == "/" else promote(a.ty, b.ty)


def _call_type(fn: str, args: tuple) -> Type:
    if fn == "where":
        return _where_type(*args)
    for a in args:
        _require_number(a)
    if fn in _FLOAT_RESULT:
        return Type.FLOAT
    if fn in INT_RESULT_FUNCS:
        return Type.INT
    if fn in ("abs", "sign"):
        return args[0].ty
    if fn == "clamp":
        return promote(promote(args[0].ty, args[1].ty), args[2].ty)
    return promote(args[0].ty, args[1].ty)


def _where_type(cond: Expr, a: Expr, b: Expr) -> Type:
    _require_bool(cond)
    if a.ty is Type.BOOL and b.ty is Type.BOOL:
        return Type.BOOL
    if a.ty is Type.BOOL or b.ty is Type.BOOL:
        raise SpecError("where() needs two numbers or two conditions after the condition", b.loc)
    return promote(a.ty, b.ty)


def _require_number(e: Expr) -> None:
    if e.ty is Type.BOOL:
        raise SpecError(BOOL_AS_NUMBER, e.loc)


def _require_bool(e: Expr) -> None:
    if e.ty is not Type.BOOL:
        raise SpecError(NUMBER_AS_CONDITION, e.loc)


def _dims(param: Param) -> str:
    return f"{_plural(len(param.shape), 'dim', 'dims')} ({', '.join(str(d) for d in param.shape)})"


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _unknown(what: str, name: str, known: list, loc, also: tuple = ()) -> SpecError:
    """An unknown name, with the closest of ``known`` (or of ``also``) as a suggestion."""
    close = difflib.get_close_matches(name, [*known, *also], n=1)
    suggestion = f"; did you mean '{close[0]}'?" if close else ""
    hint = f"known {what}s: {', '.join(known)}"
    return SpecError(f"unknown {what} '{name}'{suggestion}", loc, hint=hint)
