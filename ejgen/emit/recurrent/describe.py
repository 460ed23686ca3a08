"""A readable account of a recurrent plan: shapes, gates, the recurrence, hooks and their derivatives (``ejgen show``
and the notation block of the generated op)."""

from __future__ import annotations

from ejgen.emit.layout import notation_lines
from ejgen.ir.expr import to_text
from ejgen.plan.recurrent import RecurrentPlan

GATE_SHAPES = {"g": "g [B, T, H]", "g_gamma": "g_gamma [H]", "gk": "gk [B, T, H, K]", "gv": "gv [B, T, H, V]"}


def describe(plan: RecurrentPlan) -> str:
    v = plan.variant
    heads = "Hkv | H" if plan.has("gqa") else "H"
    gates = [f"{GATE_SHAPES[g]} ({plan.mode(g)})" for g in plan.gates]
    decay = " + ".join(["g_t"] * plan.has("g") + ["g_gamma"] * plan.has("g_gamma")) or "0"
    state = f"e^({decay})" if decay != "0" else ""
    state += " diag(e^gk_t) S_(t-1)" if plan.has("gk") else " S_(t-1)"
    state += " diag(e^gv_t)" if plan.has("gv") else ""
    phi = "phi(k_t)" if plan.feature_map else "k_t"
    lines = [
        f"{v.name} (linear_recurrent; modes {', '.join(v.modes)}; backends {', '.join(v.backends)})",
        f"  q [B, T, H, K], k [B, T, {heads}, K], v [B, T, {heads}, V] -> o [B, T, H, V], final_state [N, H, K, V]"
        + ("; with cu_seqlens [N + 1]: B = 1, sequence n = steps cu[n] .. cu[n + 1] - 1" if plan.has("varlen") else ""),
        f"  gates (log space): {', '.join(gates) or 'none'}",
        f"  S_t = {state.strip()} + {phi}ᵀ v_t;  o_t = scale {'phi(q_t)' if plan.feature_map else 'q_t'} S_t",
    ]
    texts = dict(v.map_texts)
    if plan.feature_map:
        lines.append(f"  phi(x) = {texts['feature_map']};  phi'(x) = {to_text(plan.feature_map.deriv)}")
    if plan.gate_map:
        lines.append(f"  gates g, gk, gv mapped first: m(x) = {texts['gate_map']};  m'(x) = "
                     f"{to_text(plan.gate_map.deriv)}")
    lines.append("  state float32; gradients for q, k, v, every gate, initial_state, and through final_state")
    return "\n".join(notation_lines(lines))
