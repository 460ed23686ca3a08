"""The Triton template context of a recurrent spec: its hooks printed as `triton.language` (in the kernels; the host
imports the op's ``hooks.py`` for its sums), and the helpers of `runtime/attention/triton/lib.py` they call."""

from __future__ import annotations

import re

from ejgen.emit.attention.triton import TlPrinter
from ejgen.emit.recurrent.common import flags, hooks
from ejgen.plan.recurrent import RecurrentPlan

HELPERS = ("_int_div", "_int_mod", "_round", "_sign", "_tanh", "_ipow", "_pow")


def template_context(plan: RecurrentPlan) -> dict:
    triton = hooks(plan, TlPrinter({"x": "x"}, {}))
    code = " ".join(h["expr"] for h in triton.values() if h is not None)
    return {**flags(plan), **triton, "helpers": [h for h in HELPERS if re.search(rf"\b{h}\(", code)]}
