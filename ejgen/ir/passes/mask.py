"""Mask analysis: affine predicates in ``q_idx, kv_idx`` become block ranges.

A mask is split into conjuncts. A conjunct that is a comparison of two integer expressions
affine in ``q_idx`` and ``kv_idx`` with constant integer coefficients, and whose remaining term
uses only constants, int options, ``q_len`` and ``kv_len``, becomes one or two ``Affine``
constraints ``a * q_idx + b * kv_idx + c >= 0``. Everything else is the residual: it is applied
element by element on the tiles that need it, which the backends find at run time (the Triton kernels from the
whole mask evaluated per tile by interval arithmetic, `ejgen.emit.attention.intervals`; XLA and Pallas element by
element).

From the constraints, for a block of queries ``[q0, q1]`` the keys worth visiting and the keys
that need no element mask are (``kv_range``)::

    visit = ∩_c {k : ∃ q ∈ [q0, q1]: c(q, k)}      (a superset of the visible keys)
    full  = ∩_c {k : ∀ q ∈ [q0, q1]: c(q, k)}      (exact)

and symmetrically for a block of keys (``q_range``), which the backward pass iterates.
"""

from __future__ import annotations

import attrs

from ejgen.ir.expr import Binary, Const, Expr, Type, Unary, Var, to_text, walk
from ejgen.ir.passes.derivative import add, const, mul, neg, sub

_FREE_OK = {"q_len", "kv_len"}


@attrs.frozen
class Affine:
    """``a * q_idx + b * kv_idx + c >= 0``; ``c`` an int expression of runtime scalars."""

    a: int
    b: int
    c: Expr
    source: str = attrs.field(default="", eq=False)

    def as_expr(self) -> Expr:
        """The constraint as a typed DSL predicate (what backends print for the element mask)."""
        q = Var("q_idx", kind="builtin", ty=Type.INT)
        k = Var("kv_idx", kind="builtin", ty=Type.INT)
        lhs = None
        for coef, var in ((self.a, q), (self.b, k)):
            if coef == 0:
                continue
            term = mul(const(abs(coef)), var)
            lhs = (term if coef > 0 else neg(term)) if lhs is None else (add(lhs, term) if coef > 0 else sub(lhs, term))
        lhs = self.c if lhs is None else add(lhs, self.c)
        return Binary(">=", lhs, const(0), ty=Type.BOOL)

    def text(self) -> str:
        terms = []
        for coef, name in ((self.a, "q_idx"), (self.b, "kv_idx")):
            if coef:
                terms.append(name if coef == 1 else f"-{name}" if coef == -1 else f"{coef}*{name}")
        terms.append(to_text(self.c))
        return " + ".join(terms).replace("+ -", "- ") + " >= 0"


@attrs.frozen
class MaskAnalysis:
    constraints: tuple  # of Affine
    residual: Expr | None  # conjunction of the non-affine terms; None when there is none

    @property
    def needs_block_mask(self) -> bool:
        return self.residual is not None


def conjuncts(e: Expr) -> list[Expr]:
    if isinstance(e, Binary) and e.op == "and":
        return conjuncts(e.a) + conjuncts(e.b)
    return [e]


def _linear(e: Expr):
    """``(a, b, c)`` with ``e == a*q_idx + b*kv_idx + c``, or None when ``e`` is not of that form."""
    if e.ty is not Type.INT:
        return None
    if isinstance(e, Const):
        return 0, 0, e
    if isinstance(e, Var):
        if e.name == "q_idx":
            return 1, 0, const(0)
        if e.name == "kv_idx":
            return 0, 1, const(0)
        if e.name in _FREE_OK or e.kind == "option":
            return 0, 0, e
        return None
    if isinstance(e, Unary) and e.op == "-":
        inner = _linear(e.x)
        return None if inner is None else (-inner[0], -inner[1], neg(inner[2]))
    if isinstance(e, Binary) and e.op in ("+", "-"):
        left, right = _linear(e.a), _linear(e.b)
        if left is None or right is None:
            return None
        sign = 1 if e.op == "+" else -1
        c = add(left[2], right[2]) if sign == 1 else sub(left[2], right[2])
        return left[0] + sign * right[0], left[1] + sign * right[1], c
    if isinstance(e, Binary) and e.op == "*":
        left, right = _linear(e.a), _linear(e.b)
        if left is None or right is None:
            return None
        for k, other in ((left, right), (right, left)):
            if k[0] == 0 and k[1] == 0 and isinstance(k[2], Const):
                n = k[2].value
                return n * other[0], n * other[1], mul(k[2], other[2])
        return None
    return None


def _affine(term: Expr) -> list[Affine] | None:
    negate = False
    while isinstance(term, Unary) and term.op == "not":
        negate, term = not negate, term.x
    if not (isinstance(term, Binary) and term.op in ("<", "<=", ">", ">=", "==")):
        return None
    op = term.op
    if negate:
        op = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": None}[op]
        if op is None:
            return None
    diff = _linear(Binary("-", term.a, term.b, ty=Type.INT)) if term.a.ty is Type.INT else None
    if diff is None or term.b.ty is not Type.INT:
        return None
    a, b, c = diff
    source = to_text(term)
    flipped = (-a, -b, neg(c))
    one = const(1)
    forms = {
        ">=": [(a, b, c)],
        ">": [(a, b, sub(c, one))],
        "<=": [flipped],
        "<": [(flipped[0], flipped[1], sub(flipped[2], one))],
        "==": [(a, b, c), flipped],
    }[op]
    return [Affine(a, b, c, source) for a, b, c in forms]


def analyse(mask: Expr) -> MaskAnalysis:
    constraints: list[Affine] = []
    residual: list[Expr] = []
    for term in conjuncts(mask):
        if isinstance(term, Const) and term.value is True:
            continue
        found = _affine(term)
        if found is None:
            residual.append(term)
        else:
            constraints.extend(found)
    rest = None
    for term in residual:
        rest = term if rest is None else Binary("and", rest, term, ty=Type.BOOL)
    return MaskAnalysis(tuple(constraints), rest)


def uses(e: Expr | None, name: str) -> bool:
    return e is not None and any(isinstance(n, Var) and n.name == name for n in walk(e))


# Block ranges, evaluated in Python (``ejgen show``, tests). Backends emit the same arithmetic.


def _floordiv(x: int, y: int) -> int:
    return x // y


def _ceildiv(x: int, y: int) -> int:
    return -((-x) // y)


def _bounds(a: int, b: int, c: int, x0: int, x1: int, for_all: bool):
    """Bounds on y from ``a*x + b*y + c >= 0`` over x in [x0, x1] (exists, or for all)."""
    pick_hi = (a > 0) != for_all
    ax = a * (x1 if pick_hi else x0)
    total = ax + c
    if b > 0:
        return _ceildiv(-total, b), None
    if b < 0:
        return None, _floordiv(total, -b)
    return (None, None) if total >= 0 else (None, -1)


def other_range(constraints, x0: int, x1: int, n_other: int, env: dict, *, x_is_q: bool):
    """(lo, hi, full_lo, full_hi) inclusive element bounds of the other index."""
    lo, hi, flo, fhi = 0, n_other - 1, 0, n_other - 1
    for c in constraints:
        a, b = (c.a, c.b) if x_is_q else (c.b, c.a)
        cval = eval_int(c.c, env)
        for for_all in (False, True):
            low, high = _bounds(a, b, cval, x0, x1, for_all)
            if for_all:
                flo = flo if low is None else max(flo, low)
                fhi = fhi if high is None else min(fhi, high)
            else:
                lo = lo if low is None else max(lo, low)
                hi = hi if high is None else min(hi, high)
    return lo, hi, flo, fhi


def block_range(constraints, x0: int, x1: int, n_other: int, block: int, env: dict, *, x_is_q: bool):
    """(lo, hi, full_lo, full_hi) in blocks of the other index: visit [lo, hi), no mask [full_lo, full_hi)."""
    lo, hi, flo, fhi = other_range(constraints, x0, x1, n_other, env, x_is_q=x_is_q)
    n_blocks = _ceildiv(n_other, block)
    blo = min(max(_floordiv(lo, block), 0), n_blocks)
    bhi = blo if hi < lo else min(max(_floordiv(hi, block) + 1, blo), n_blocks)
    bflo = min(max(_ceildiv(flo, block), blo), bhi)
    bfhi = min(max(_floordiv(fhi + 1, block), bflo), bhi)
    return blo, bhi, bflo, bfhi


def eval_int(e: Expr, env: dict) -> int:
    """Evaluate an int expression of constants and named scalars (no eval of text)."""
    if isinstance(e, Const):
        return int(e.value)
    if isinstance(e, Var):
        return int(env[e.name])
    if isinstance(e, Unary) and e.op == "-":
        return -eval_int(e.x, env)
    if isinstance(e, Binary) and e.op in ("+", "-", "*"):
        x, y = eval_int(e.a, env), eval_int(e.b, env)
        return x + y if e.op == "+" else x - y if e.op == "-" else x * y
    raise TypeError(f"not an affine offset: {to_text(e)}")
