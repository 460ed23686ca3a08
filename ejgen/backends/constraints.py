"""The mask analysis as template data, shared by every backend: one entry per affine constraint
with its guard (which feature switches it on), its element predicate and the pieces the block-range
code needs (coefficients a, b and the printed offset c)."""

from __future__ import annotations

from ejgen.ir.plan import AttentionPlan


def range_constraints(plan: AttentionPlan, element, scalar, guard=lambda g: g) -> tuple[list, list]:
    """(built-in constraints, spec-mask constraints); ``element`` and ``scalar`` are the backend's
    printers for the element mask and for the block-range arithmetic."""
    builtin = [
        {"guard": guard(c.guard), "text": c.affine.source, "expr": c.affine.as_expr(),
         "element_code": element(c.affine.as_expr()), "a": c.affine.a, "b": c.affine.b,
         "c_code": scalar(c.affine.c)}
        for c in plan.builtin_constraints
    ]
    spec = [
        {"guard": guard("True"), "text": f"spec mask: {c.source}", "a": c.a, "b": c.b, "c_code": scalar(c.c)}
        for c in plan.mask.constraints
    ]
    return builtin, spec
