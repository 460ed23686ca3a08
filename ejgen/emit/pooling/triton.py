"""The Triton template context of a pooling spec: the spec's reduction, which the kernels are written for."""

from __future__ import annotations

from ejgen.emit.pooling.common import flags
from ejgen.plan.pooling import PoolingPlan


def template_context(plan: PoolingPlan) -> dict:
    return flags(plan)
