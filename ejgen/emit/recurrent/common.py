"""What every recurrent backend's template context shares: the gates the spec takes and its hooks, printed by the
backend's printer (``x`` the element)."""

from __future__ import annotations

from ejgen.ir.expr import to_text
from ejgen.plan.recurrent import RecurrentPlan


def hooks(plan: RecurrentPlan, printer) -> dict:
    """Per hook (feature_map, gate_map): None, or its text as written, the printed expression and derivative."""
    texts = dict(plan.variant.map_texts)
    out = {}
    for field in ("feature_map", "gate_map"):
        hook = getattr(plan, field)
        out[field] = None if hook is None else {
            "text": texts.get(field, to_text(hook.expr)),
            "expr": printer(hook.expr),
            "deriv": printer(hook.deriv),
        }
    return out


def flags(plan: RecurrentPlan) -> dict:
    return {"gates": list(plan.gates), "gqa": plan.has("gqa"), "varlen": plan.has("varlen")}
