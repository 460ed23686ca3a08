"""What every recurrent backend's template context shares: the gates the spec takes and its hooks, printed by a
printer (``x`` the element); the context of the op's ``hooks.py`` (the hooks in jnp)."""

from __future__ import annotations

from ejgen.emit.attention.xla import JnpPrinter
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


def has_hooks(plan: RecurrentPlan) -> bool:
    """The spec has a feature map or a gate map: the op's folder has a ``hooks.py`` (jnp), which the op and its
    backends import."""
    return plan.feature_map is not None or plan.gate_map is not None


def flags(plan: RecurrentPlan) -> dict:
    return {"gates": list(plan.gates), "gqa": plan.has("gqa"), "varlen": plan.has("varlen"), "hooks": has_hooks(plan)}


def jnp_hooks(plan: RecurrentPlan) -> dict:
    """The context of ``hooks.py``: the hooks printed as jax.numpy, with their derivatives."""
    printed = hooks(plan, JnpPrinter({"x": "x"}, {}))
    code = " ".join(h["expr"] + " " + h["deriv"] for h in printed.values() if h is not None)
    return {**printed, "uses_jax": "jax." in code, "uses_jnp": "jnp." in code}
