"""A readable account of a pooling plan: shapes, features, the reduction and its gradients (``ejgen show`` and the
notation block of the generated op)."""

from __future__ import annotations

from ejgen.emit.layout import notation_lines
from ejgen.plan.pooling import PoolingPlan

FORMULAS = {
    "mean": ("y[n] = sum_t w_t x_t / sum_t w_t over the tokens t of sequence n (0 where sum_t w_t = 0)",
             "dx_t = w_t dy[n] / sum w;  dw_t = <dy[n], x_t - y[n]> / sum w"),
    "sum": ("y[n] = sum_t w_t x_t over the tokens t of sequence n (0 for none)",
            "dx_t = w_t dy[n];  dw_t = <dy[n], x_t>"),
    "max": ("y[n] = max_t x_t over the pooled tokens t of sequence n, per column (0 for none; a NaN wins)",
            "dx_t = dy[n] where t is the first token that attains the max of its column, else 0"),
    "last": ("y[n] = x_t for t the last pooled token of sequence n (0 for none)",
             "dx_t = dy[n] for that token, else 0"),
}


def _feature(f) -> str:
    return f"{f.name}={f.mode}"


def describe(plan: PoolingPlan) -> str:
    v = plan.variant
    shapes = "  x [B, S, D] -> y [B, D]"
    if plan.has("varlen"):
        shapes += "; with cu_seqlens [N + 1] (int32): x [T, D] -> y [N, D], sequence n = rows cu[n] .. cu[n + 1] - 1"
    weights = []
    if plan.has("weights"):
        weights.append("the weights")
    if plan.has("mask"):
        weights.append("the mask (1 kept, 0 left out)")
    value, grads = FORMULAS[v.reduction]
    lines = [
        f"{v.name} ({v.family}; reduction {v.reduction}; backends {', '.join(v.backends)})",
        shapes,
        f"  features: {', '.join(_feature(f) for f in v.features) or 'none'}",
        f"  {value}",
    ]
    if v.reduction in ("mean", "sum"):
        lines.append(f"  w_t = {' times '.join(weights) if weights else '1'}")
    elif plan.has("mask"):
        lines.append("  pooled tokens: those the mask keeps")
    lines += [f"  gradients: {grads}", f"  kernels accumulate: {plan.kind} (float32)"]
    return "\n".join(notation_lines(lines))
