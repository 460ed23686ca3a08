"""A readable account of a plan: the IR, the derivatives and the mask analysis.

Used by ``ejgen show`` and as the notation block at the top of every generated op.
"""

from __future__ import annotations

from ejgen.emit.layout import notation_lines
from ejgen.ir.expr import to_text
from ejgen.plan.attention import AttentionPlan


def _feature(f) -> str:
    if f.mode == "value":
        return f"{f.name}={f.value!r} (compiled in)"
    return f"{f.name}={f.mode}"


def describe(plan: AttentionPlan) -> str:
    v = plan.variant
    lines = [
        f"{v.name} ({v.family}; modes {', '.join(v.modes)}; backends {', '.join(v.backends)})",
        "  query [B, Sq, Hq, D], key [B, Sk, Hkv, D], value [B, Sk, Hkv, Dv] -> out [B, Sq, Hq, Dv], lse [B, Hq, Sq]"
        if v.layout == "bshd" else
        "  query [B, Hq, Sq, D], key [B, Hkv, Sk, D], value [B, Hkv, Sk, Dv] -> out [B, Hq, Sq, Dv], lse [B, Hq, Sq] "
        "(layout bhsd)",
    ]
    lines.append(f"  features: {', '.join(_feature(f) for f in v.features) or 'none'}")
    for p in v.params:
        dims = ", ".join(str(d) for d in p.shape)
        lines.append(f"  param  {p.name} [{dims}] {p.dtype}{' (grad)' if p.grad else ''}")
    for o in v.options:
        lines.append(f"  option {o.name}: {o.type} = {o.default!r}")
    lines.append(f"  score: {to_text(plan.score)}")
    lines.append(f"  mask:  {to_text(v.mask)}")
    lines.append("  derivatives:")
    lines.append(f"    d score / d s = {to_text(plan.dscore_ds)}")
    for g in plan.param_grads:
        lines.append(f"    d score / d {to_text(g.ref)} = {to_text(g.deriv)}")
    lines.append("  mask analysis (constraints a*q_idx + b*kv_idx + c >= 0 give block ranges):")
    if plan.segment_key is not None:
        key = plan.segment_key
        how = f"less the {key.base} side's least value" if key.base else "their ranks"
        lines.append(f"    segment key: {key.text()} -> segment ids from {to_text(key.query)} per query and "
                     f"{to_text(key.key)} per key ({how})")
    for c in plan.builtin_constraints:
        lines.append(f"    when {c.guard.text()}: {c.affine.text()}  [{c.affine.source}]")
    for c in plan.mask.constraints:
        lines.append(f"    always: {c.text()}  [spec mask: {c.source}]")
    if plan.mask.residual is not None:
        lines.append(f"    element mask + runtime block mask: {to_text(plan.mask.residual)}")
    lines.append("    segment ids, dense masks and varlen: element mask + runtime block mask")
    return "\n".join(notation_lines(lines))

