"""The pooling plan: what every backend emits for one pooling spec, decided once.

``plan_pooling(variant)`` resolves the reduction into the kernels' accumulation (``kind``: a weighted sum, of
which mean, sum and last are cases, or a running max with its argmax) and the op's arguments, in signature order
(docs/DESIGN.md §2 pooling, §3 pooling). Emitters only print what the plan says.
"""

from __future__ import annotations

import attrs

from ejgen.ir.variant import POOLING_FEATURE_ARGUMENTS, PoolingVariant
from ejgen.plan.attention import Argument

# How each reduction accumulates (docs/DESIGN.md §3 pooling): `last` is the sum over the one-token range of the
# sequence's last pooled token, `mean` the sum scaled by 1 / (the sum of the weights) per sequence.
KINDS = {"mean": "sum", "sum": "sum", "last": "sum", "max": "max"}


@attrs.frozen
class PoolingPlan:
    variant: PoolingVariant
    features: dict  # name -> Feature, only the features the spec enables
    kind: str  # "sum" | "max": the kernels' accumulation
    arguments: tuple  # of Argument: the op's arguments after x, in signature order
    required: tuple  # arguments the op needs (features compiled in, `always`): None is refused, by name
    absent_arguments: dict  # built-in arguments the op does not take -> the feature that would bring each

    @property
    def name(self) -> str:
        return self.variant.name

    @property
    def reduction(self) -> str:
        return self.variant.reduction

    def has(self, feature: str) -> bool:
        return feature in self.features

    def mode(self, feature: str) -> str | None:
        f = self.features.get(feature)
        return None if f is None else f.mode

    @property
    def scaled(self) -> bool:
        """Whether each sequence's sum is scaled by 1 / its total weight (the mean)."""
        return self.variant.reduction == "mean"

    @property
    def weighted(self) -> bool:
        """Whether the kernels read a per-token weight: the weights, a mask, or both (a mask pools a token with
        weight 1 or leaves it out with 0); `last` reads neither (its range is the token itself)."""
        return self.variant.reduction != "last" and (self.has("weights") or self.has("mask"))


def _arguments(variant: PoolingVariant) -> tuple:
    """``chunk_size`` (the kernels' token tile, the seed's second argument), ``cu_seqlens`` where the spec enables
    varlen (the third, as the seed has it), the other features' tensors, ``platform``. Every tensor defaults to None
    (``cu_seqlens`` follows a default); the runtime refuses None for those in ``required``."""
    args = [Argument("chunk_size", "32", "chunk_size", "call")]
    for feature, names in POOLING_FEATURE_ARGUMENTS:
        if variant.feature(feature) is not None:
            args += [Argument(n, "None", n, feature) for n in names]
    args.append(Argument("platform", '"auto"', None, "call"))
    return tuple(args)


def plan_pooling(variant: PoolingVariant) -> PoolingPlan:
    arguments = _arguments(variant)
    taken = {a.name for a in arguments}
    return PoolingPlan(
        variant=variant,
        features={f.name: f for f in variant.features},
        kind=KINDS[variant.reduction],
        arguments=arguments,
        required=tuple(n for feature, names in POOLING_FEATURE_ARGUMENTS for n in names
                       if variant.feature(feature) is not None and variant.feature(feature).mode == "always"),
        absent_arguments={n: feature for feature, names in POOLING_FEATURE_ARGUMENTS for n in names if n not in taken},
    )
