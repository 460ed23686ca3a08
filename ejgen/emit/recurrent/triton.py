"""The Triton template context of a recurrent spec: its hooks printed as `triton.language` (in the kernels) and as
jax.numpy with their derivatives (the host's sums), and the helpers of `runtime/attention/triton/lib.py` they call."""

from __future__ import annotations

import re

from ejgen.emit.attention.triton import TlPrinter
from ejgen.emit.attention.xla import JnpPrinter
from ejgen.emit.recurrent.common import flags, hooks
from ejgen.plan.recurrent import RecurrentPlan

HELPERS = ("_int_div", "_int_mod", "_round", "_sign", "_tanh", "_ipow", "_pow")


def template_context(plan: RecurrentPlan) -> dict:
    triton = hooks(plan, TlPrinter({"x": "x"}, {}))
    jnp_hooks = hooks(plan, JnpPrinter({"x": "x"}, {}))
    code = " ".join(h["expr"] for h in triton.values() if h is not None)
    jnp_code = " ".join(h["expr"] + " " + h["deriv"] for h in jnp_hooks.values() if h is not None)
    return {
        **flags(plan),
        **triton,
        "jnp_hooks": jnp_hooks,
        "helpers": [h for h in HELPERS if re.search(rf"\b{h}\(", code)],
        "uses_jax": "jax." in jnp_code,
        "uses_jnp": "jnp." in jnp_code,
    }
