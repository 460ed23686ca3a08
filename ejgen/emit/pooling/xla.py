"""The XLA template context of a pooling spec: the reduction the jnp code runs."""

from __future__ import annotations

from ejgen.emit.pooling.common import flags
from ejgen.plan.pooling import PoolingPlan


def template_context(plan: PoolingPlan) -> dict:
    return flags(plan)
