"""The Pallas template context of a recurrent spec: its hooks printed as jax.numpy with their derivatives (applied in
XLA around the spec-independent kernels of `ejgen.runtime.recurrent.pallas`)."""

from __future__ import annotations

from ejgen.emit.attention.xla import JnpPrinter
from ejgen.emit.recurrent.common import flags, hooks
from ejgen.plan.recurrent import RecurrentPlan


def template_context(plan: RecurrentPlan) -> dict:
    printed = hooks(plan, JnpPrinter({"x": "x"}, {}))
    code = " ".join(h["expr"] + " " + h["deriv"] for h in printed.values() if h is not None)
    return {**flags(plan), **printed, "uses_jax": "jax." in code, "uses_jnp": "jnp." in code}
