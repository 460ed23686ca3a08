"""The linear recurrent plan: what every backend emits for one recurrent spec, decided once.

``plan_recurrent(variant)`` resolves the gates the op takes into its arguments, in the seed's order (docs/DESIGN.md
§2 linear recurrent), and differentiates the element-wise hooks (``feature_map`` on q and k, ``gate_map`` on the
per-step gates) with respect to their element ``x``, so that kernels apply a hook where they load a tensor and its
derivative where they write that tensor's gradient. Emitters only print what the plan says.
"""

from __future__ import annotations

import attrs

from ejgen.ir.expr import Expr, Type, Var
from ejgen.ir.passes.derivative import diff, simplify
from ejgen.ir.variant import (
    RECURRENT_CALL_ARGUMENTS,
    RECURRENT_FEATURE_ARGUMENTS,
    RECURRENT_GATES,
    RECURRENT_MESH_ARGUMENTS,
    RecurrentVariant,
)
from ejgen.plan.attention import Argument

X = Var("x", kind="builtin", ty=Type.FLOAT)
DEFAULTS = {"reverse": "False"}  # every other argument of the seed's defaults to None


@attrs.frozen
class Hook:
    """An element-wise hook: ``expr`` of ``x`` and its derivative ``deriv`` (d expr / d x)."""

    expr: Expr
    deriv: Expr


@attrs.frozen
class RecurrentPlan:
    variant: RecurrentVariant
    features: dict  # name -> Feature, only the features the spec enables
    arguments: tuple  # of Argument: the op's arguments after query, key and value, in signature order
    required: tuple  # gate arguments the op needs (gates compiled in, `always`): None is refused, by name
    absent_arguments: dict  # built-in arguments the op does not take -> the feature that would bring each
    feature_map: Hook | None  # phi on q and k
    gate_map: Hook | None  # on g, gk and gv (not g_gamma)

    @property
    def name(self) -> str:
        return self.variant.name

    def has(self, feature: str) -> bool:
        return feature in self.features

    def mode(self, feature: str) -> str | None:
        f = self.features.get(feature)
        return None if f is None else f.mode

    @property
    def decode_names(self) -> list:
        """The op's further functions: ``<name>_decode`` when the spec lists the decode mode."""
        return [f"{self.name}_decode"] if "decode" in self.variant.modes else []

    @property
    def cp_name(self) -> str:
        """The op's context-parallel form (docs/DESIGN.md §3): every recurrent op has one."""
        return f"{self.name}_cp"

    @property
    def gates(self) -> tuple:
        """The gates the op takes, in ``RECURRENT_GATES`` order."""
        return tuple(g for g in RECURRENT_GATES if g in self.features)


def _hook(expr: Expr | None) -> Hook | None:
    return None if expr is None else Hook(expr, simplify(diff(expr, X)))


def _arguments(variant: RecurrentVariant) -> tuple:
    """The seed's arguments after query, key and value, those the spec enables: gates, softmax_scale,
    initial_state, reverse, cu_seqlens (positional or keyword); then keyword-only the call's choices: algorithm,
    chunk_size, platform; and the mesh wrapper's: mesh, in_specs, out_specs (feature "mesh")."""
    args = []
    for feature, names in RECURRENT_FEATURE_ARGUMENTS:
        if feature in RECURRENT_CALL_ARGUMENTS or variant.feature(feature) is not None:
            args += [Argument(n, DEFAULTS.get(n, "None"), n, feature) for n in names]
    args += [Argument("algorithm", '"auto"', "algorithm", "choice"),  # keyword-only (feature "choice")
             Argument("chunk_size", "None", "chunk_size", "choice"),
             Argument("platform", '"auto"', None, "choice")]
    args += [Argument(n, "None", None, "mesh") for n in RECURRENT_MESH_ARGUMENTS]
    return tuple(args)


def plan_recurrent(variant: RecurrentVariant) -> RecurrentPlan:
    arguments = _arguments(variant)
    taken = {a.name for a in arguments}
    return RecurrentPlan(
        variant=variant,
        features={f.name: f for f in variant.features},
        arguments=arguments,
        required=tuple(g for g in RECURRENT_GATES if variant.feature(g) is not None
                       and variant.feature(g).mode == "always"),
        absent_arguments={n: feature for feature, names in RECURRENT_FEATURE_ARGUMENTS for n in names
                          if n not in taken},
        feature_map=_hook(variant.feature_map),
        gate_map=_hook(variant.gate_map),
    )
