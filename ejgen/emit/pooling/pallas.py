"""The Pallas template context of a pooling spec: the reduction the shared kernels run."""

from __future__ import annotations

from ejgen.emit.pooling.common import flags
from ejgen.plan.pooling import PoolingPlan


def template_context(plan: PoolingPlan) -> dict:
    return flags(plan)
