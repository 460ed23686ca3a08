"""What every pooling backend's template context shares: the reduction, its accumulation and the features."""

from __future__ import annotations

from ejgen.plan.pooling import PoolingPlan


def flags(plan: PoolingPlan) -> dict:
    """The spec's choices as the templates read them."""
    return {
        "reduction": plan.reduction,
        "kind": plan.kind,
        "scaled": plan.scaled,
        "weighted": plan.weighted,
        "varlen": plan.has("varlen"),
        "ranged": plan.reduction == "last",  # the pooled range is narrower than the sequence
        "weight_grad": plan.has("weights") and plan.kind == "sum",
    }
