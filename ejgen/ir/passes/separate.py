"""Separation of a mask's integer tests into a query side and a key side (docs/DESIGN.md §5, element mask).

Kernels evaluate the element mask on tiles: a term of ``q_idx`` alone is computed once per query row
(``[BLOCK_M, 1]``), a term of ``kv_idx`` alone once per key column, and only what mixes both costs a value per
element. An integer division or modulo by a run-time divisor is some twenty instructions on a GPU; in a mixed
term it runs per element (the dilated window's ``(q_idx - kv_idx) % dilation == 0`` made its kernels 2.5x slower
than FlexAttention's, whose divisor is a constant). The rewrite, exact under the DSL's ``%`` (the divisor's sign;
``a % 0 == a``, so it holds for every divisor)::

    (A - B) % D == 0   ->   A % D == B % D        (A of the query side, B of the key side, D of neither)
    (A + B) % D == 0   ->   A % D == (-B) % D

and the same under ``!=``, either operand order, sides swapped.
"""

from __future__ import annotations

from ejgen.ir.expr import Binary, Const, Expr, Type, Unary, Var, children, walk, with_children

_Q, _KV = {"q_idx"}, {"kv_idx"}


def _side(e: Expr) -> str:
    """'uniform' (neither position), 'q', 'kv' or 'mixed'."""
    names = {n.name for n in walk(e) if isinstance(n, Var) and n.kind == "builtin"}
    q, kv = bool(names & _Q), bool(names & _KV)
    return "mixed" if q and kv else "q" if q else "kv" if kv else "uniform"


def _zero(e: Expr) -> bool:
    return isinstance(e, Const) and not isinstance(e.value, bool) and e.value == 0


def _split(term: Expr):
    """``(A, B, D, negate_b)`` for ``(A ∓ B) % D`` with A and B on opposite sides and D uniform, else None."""
    if not (isinstance(term, Binary) and term.op == "%" and isinstance(term.a, Binary) and term.a.op in "+-"):
        return None
    a, b, d = term.a.a, term.a.b, term.b
    sides = {_side(a), _side(b)}
    if _side(d) != "uniform" or sides != {"q", "kv"}:
        return None
    return a, b, d, term.a.op == "+"


def separate(e: Expr) -> Expr:
    """``e`` with every separable modulo test rewritten (module docstring); anything else unchanged."""
    e = with_children(e, tuple(separate(c) for c in children(e))) if children(e) else e
    if not (isinstance(e, Binary) and e.op in ("==", "!=")):
        return e
    term = e.a if _zero(e.b) else e.b if _zero(e.a) else None
    found = None if term is None else _split(term)
    if found is None:
        return e
    a, b, d, plus = found
    right = Unary("-", b, ty=Type.INT) if plus else b
    mod = lambda x: Binary("%", x, d, ty=Type.INT)  # noqa: E731
    return Binary(e.op, mod(a), mod(right), loc=e.loc, ty=Type.BOOL)
