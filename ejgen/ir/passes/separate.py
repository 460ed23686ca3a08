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

from ejgen.ir.expr import (INT_RESULT_FUNCS, Binary, Call, Const, Expr, ParamRef, Type, Unary, Var, children, walk,
                            with_children)

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


# ------------------------------------------------------------------------------------------- position terms

MAX_POSITION_TERMS = 8  # table rows at most (the rest stays inline)


def _costly(e: Expr) -> bool:
    """Whether ``e`` holds an integer division or modulo by a non-constant, or an int made from a float: twenty-odd
    instructions a value on a GPU (a constant divisor is a multiply-high)."""
    for n in walk(e):
        if isinstance(n, Binary) and n.op in ("//", "%") and not isinstance(n.b, Const):
            return True
        if isinstance(n, Call) and n.fn in INT_RESULT_FUNCS and n.args[0].ty is Type.FLOAT:
            return True
    return False


def _one_position(e: Expr) -> bool:
    """Of one position (q_idx or kv_idx), lengths and options alone: no b, h, params or logit."""
    if _side(e) not in ("q", "kv"):
        return False
    return not any(isinstance(n, ParamRef) or (isinstance(n, Var) and n.name in ("b", "h", "s")) for n in walk(e))


def position_terms(mask: Expr) -> tuple[Expr, list[tuple[str, Expr]]]:
    """The mask's costly one-position integer terms taken out into a table (docs/DESIGN.md §6, position terms).

    A term of q_idx alone, or of kv_idx alone (with lengths and options), that divides by a run-time value costs its
    twenty-odd instructions per value of a tile: per key column of every key block in the forward, per query column
    in the backward (NATTEN 2-D's forward spent half its time there). Its values depend on the position only, so the
    host forms them once a call, a row of int32 per term over the positions 0 .. S - 1, and the Hopper kernels read
    them (`_spec_mask_terms`). Returns (the mask with each term replaced by ``Var("_t<i>", kind="term")``, [(side,
    term)]), the terms maximal (the largest one-position subexpression that holds the costly part), equal ones shared,
    at most MAX_POSITION_TERMS (the rest stays inline)."""
    found: list[tuple[str, Expr]] = []

    def visit(e: Expr) -> Expr:
        if e.ty is Type.INT and not isinstance(e, (Var, Const)) and _one_position(e) and _costly(e):
            for i, (_, t) in enumerate(found):
                if t == e:
                    return Var(f"_t{i}", kind="term", ty=Type.INT)
            if len(found) < MAX_POSITION_TERMS:
                found.append((_side(e), e))
                return Var(f"_t{len(found) - 1}", kind="term", ty=Type.INT)
        kids = children(e)
        return with_children(e, tuple(visit(c) for c in kids)) if kids else e

    rest = visit(mask)
    return rest, found


def position_form(term: Expr) -> Expr:
    """A term as a function of its position alone (q_idx and kv_idx one name, q_len and kv_len one): a table row over
    the positions 0 .. S - 1 (Sq = Sk) serves every term of the same form, the query side's and the key side's."""
    if isinstance(term, Var) and term.name in ("q_idx", "kv_idx", "q_len", "kv_len"):
        return Var("pos" if term.name.endswith("idx") else "len", kind="builtin", ty=Type.INT)
    kids = children(term)
    return with_children(term, tuple(position_form(c) for c in kids)) if kids else term
