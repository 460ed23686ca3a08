"""The attention plan: everything a backend needs to emit one variant, decided once.

``plan_attention(variant)`` runs the passes (type check, derivatives, mask analysis, feature
resolution) and returns an ``AttentionPlan``. Backends only print what the plan says.
"""

from __future__ import annotations

import attrs

from ejgen.errors import SpecError
from ejgen.ir.expr import Binary, Const, Expr, ParamRef, Type, Var, walk
from ejgen.ir.passes import typecheck
from ejgen.ir.passes.derivative import ONE, add, diff, param_occurrences, simplify, sub
from ejgen.ir.passes.mask import Affine, MaskAnalysis, analyse
from ejgen.ir.variant import Variant

S = Var("s", kind="builtin", ty=Type.FLOAT)


@attrs.frozen
class ParamGrad:
    """The derivative of the score with respect to one occurrence of a param."""

    ref: ParamRef
    deriv: Expr


@attrs.frozen
class BuiltinConstraint:
    """An affine constraint of a built-in feature, active when ``guard`` (a config flag) holds."""

    guard: str  # Python condition over the config, e.g. "cfg.causal" or "cfg.window and not cfg.causal"
    affine: Affine


@attrs.frozen
class AttentionPlan:
    variant: Variant
    features: dict  # name -> Feature, only the features the spec enables
    score: Expr
    score_is_identity: bool
    dscore_ds: Expr
    param_grads: tuple  # of ParamGrad
    mask: MaskAnalysis  # of the spec's own mask
    builtin_constraints: tuple  # of BuiltinConstraint (causal, sliding window)

    @property
    def name(self) -> str:
        return self.variant.name

    def has(self, feature: str) -> bool:
        return feature in self.features

    def mode(self, feature: str) -> str | None:
        f = self.features.get(feature)
        return None if f is None else f.mode

    @property
    def grad_params(self) -> tuple:
        return tuple(p for p in self.variant.params if p.grad)

    @property
    def spec_mask(self) -> Expr | None:
        m = self.variant.mask
        return None if isinstance(m, Const) and m.value is True else m

    def names_used(self) -> set[str]:
        """Built-in DSL names used by score, mask or derivatives."""
        exprs = [self.score, self.dscore_ds, self.variant.mask] + [g.deriv for g in self.param_grads]
        exprs += [g.ref for g in self.param_grads]
        return {n.name for e in exprs for n in walk(e) if isinstance(n, Var) and n.kind == "builtin"}


def _builtin_constraints() -> tuple:
    """Causal and sliding window as affine constraints; ``off = kv_len - q_len`` aligns bottom-right.

    causal:        q_idx - kv_idx + off >= 0
    window left:   kv_idx - q_idx - off + window_left >= 0
    window right:  q_idx - kv_idx + off + window_right >= 0   (replaced by causal when causal)
    """
    q_len, kv_len = Var("q_len", kind="builtin", ty=Type.INT), Var("kv_len", kind="builtin", ty=Type.INT)
    off = sub(kv_len, q_len)
    left = Var("window_left", kind="builtin", ty=Type.INT)
    right = Var("window_right", kind="builtin", ty=Type.INT)
    return (
        BuiltinConstraint("cfg.causal", Affine(1, -1, off, "causal")),
        BuiltinConstraint("cfg.window", Affine(-1, 1, sub(left, off), "sliding_window left")),
        BuiltinConstraint(
            "cfg.window and not cfg.causal", Affine(1, -1, add(off, right), "sliding_window right")
        ),
    )


def plan_attention(variant: Variant) -> AttentionPlan:
    if variant.family != "attention":
        raise SpecError(
            f"family '{variant.family}' cannot be built yet: only 'attention' has kernels",
            variant.loc,
        )
    if tuple(variant.modes) != ("train",):
        extra = [m for m in variant.modes if m != "train"]
        raise SpecError(f"mode(s) {', '.join(extra)} cannot be built yet: only 'train' has kernels", variant.loc)
    variant = typecheck.check(variant)
    score = variant.score
    if score.ty is Type.INT:
        score = Binary("*", ONE, score, ty=Type.FLOAT)
    grad_params = {p.name for p in variant.params if p.grad}
    param_grads = tuple(
        ParamGrad(ref, simplify(diff(score, ref))) for ref in param_occurrences(score, grad_params)
    )
    return AttentionPlan(
        variant=variant,
        features={f.name: f for f in variant.features},
        score=score,
        score_is_identity=score == S,
        dscore_ds=simplify(diff(score, S)),
        param_grads=param_grads,
        mask=analyse(variant.mask),
        builtin_constraints=tuple(
            c for c in _builtin_constraints()
            if ("causal" if c.guard == "cfg.causal" else "sliding_window") in variant.feature_names()
        ),
    )
