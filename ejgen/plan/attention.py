"""The attention plan: everything a backend needs to emit one variant, decided once.

``plan_attention(variant)`` runs the passes (type check, derivatives, mask analysis, feature
resolution) and returns an ``AttentionPlan``: the op's keyword arguments, the score and its
derivatives, the mask's block ranges. Emitters only print what the plan says.
"""

from __future__ import annotations

import attrs

from ejgen.errors import SpecError
from ejgen.ir.expr import Binary, Const, Expr, ParamRef, Type, Var, children, walk
from ejgen.ir.passes.derivative import ONE, add, diff, param_occurrences, simplify, sub
from ejgen.ir.passes.mask import Affine, MaskAnalysis, analyse
from ejgen.ir.passes.segment_key import SegmentKey
from ejgen.ir.passes.segment_key import split as split_segment_key
from ejgen.ir.passes.separate import separate
from ejgen.ir.variant import CALL_ARGUMENTS, FEATURE_ARGUMENTS, MESH_ARGUMENTS, Variant

S = Var("s", kind="builtin", ty=Type.FLOAT)


@attrs.frozen
class ParamGrad:
    """The derivative of the score with respect to one occurrence of a param."""

    ref: ParamRef
    deriv: Expr


@attrs.frozen
class Guard:
    """When a built-in constraint is active: every flag of ``on`` set and none of ``off``. Flags are
    the call's static configuration (``causal``, ``window``); each backend prints the condition."""

    on: tuple = ()
    off: tuple = ()

    def text(self, flag=lambda name: name) -> str:
        """The condition as Python source, each flag printed by ``flag``."""
        terms = [flag(n) for n in self.on] + [f"not {flag(n)}" for n in self.off]
        return " and ".join(terms) or "True"


@attrs.frozen
class BuiltinConstraint:
    """An affine constraint of a built-in feature, active when ``guard`` holds."""

    feature: str  # the spec feature that brings it: causal | sliding_window
    guard: Guard
    affine: Affine


@attrs.frozen
class Argument:
    """A keyword argument of the generated op. ``default`` is its default's Python source (None:
    required); ``passed`` is what the op hands the runtime under ``name`` (the argument itself, or a
    value the spec compiles in), None when the runtime never sees it; ``feature`` the spec feature
    (or param, option) that brings it."""

    name: str
    default: str | None
    passed: str | None
    feature: str
    in_signature: bool = True


@attrs.frozen
class AttentionPlan:
    variant: Variant
    features: dict  # name -> Feature, only the features the spec enables
    score: Expr
    score_is_identity: bool
    dscore_ds: Expr
    param_grads: tuple  # of ParamGrad
    mask: MaskAnalysis  # of the element mask
    builtin_constraints: tuple  # of BuiltinConstraint (causal, sliding window)
    arguments: tuple  # of Argument: the op's keyword arguments, in signature order
    absent_arguments: dict  # built-in arguments the op does not take -> the feature that would bring each
    segment_key: SegmentKey | None  # the mask's conjunct that runs as segment ids (`segment_key_of`)
    element_mask: Expr  # the mask the train kernels apply: the spec's, less its segment key

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
        """The mask the train kernels print: the element mask (the spec's, less its segment key), its modulo tests
        split by side (`ir/passes/separate.py`); None when nothing is left."""
        m = self.element_mask
        return None if isinstance(m, Const) and m.value is True else separate(m)

    @property
    def kernel_exprs(self) -> list:
        """Every expression the train kernels print: the score, its derivative, the element mask and the params'
        derivatives (in this order: the Pallas printer's token views follow it)."""
        return [self.score, self.dscore_ds, self.element_mask] + [g.deriv for g in self.param_grads]

    def index_reads(self) -> tuple:
        """``b`` and ``h`` where score or mask read them as numbers: anything but the whole index of a param's
        ``batch`` / ``heads`` dim (``slopes[h]`` with slopes [heads] reads the shard's own slice). Sharding that
        axis over a mesh would renumber them from 0 on every device (the mesh wrapper refuses it)."""
        dims = {p.name: p.shape for p in self.variant.params}
        own = {"b": "batch", "h": "heads"}
        found = set()

        def visit(e):
            if isinstance(e, Var) and e.name in own and e.kind == "builtin":
                found.add(e.name)
            elif isinstance(e, ParamRef):
                for index, dim in zip(e.indices, dims.get(e.name, ())):
                    if not (isinstance(index, Var) and own.get(index.name) == dim):
                        visit(index)
            else:
                for c in children(e):
                    visit(c)

        visit(self.score)
        visit(self.variant.mask)
        return tuple(sorted(found))

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
        BuiltinConstraint("causal", Guard(("causal",)), Affine(1, -1, off, "causal")),
        BuiltinConstraint("sliding_window", Guard(("window",)), Affine(-1, 1, sub(left, off), "sliding_window left")),
        BuiltinConstraint(
            "sliding_window", Guard(("window",), ("causal",)), Affine(1, -1, add(off, right), "sliding_window right")
        ),
    )


def _arguments(variant: Variant) -> tuple:
    """The op's keyword arguments (docs/DESIGN.md §3, calling convention): params, the built-in
    features the spec enables (ir.variant.FEATURE_ARGUMENTS), options, then the per-call ones and the mesh
    wrapper's."""
    args = [Argument(p.name, None, None, "param") for p in variant.params]
    for features, names in FEATURE_ARGUMENTS:
        found = [variant.feature(f) for f in ((features,) if isinstance(features, str) else features)]
        found = [f for f in found if f is not None]
        if not found:
            continue
        feature = " or ".join(f.name for f in found)
        if any(f.mode == "value" for f in found):  # compiled in: no argument, the value is passed on
            (name,) = names
            args.append(Argument(name, None, repr(found[0].value), feature, in_signature=False))
        elif features == "causal" and found[0].mode == "always":
            args.append(Argument("causal", None, "True", feature, in_signature=False))
        elif features == "causal":
            args += [Argument(n, "False", n, feature) for n in names]
        else:
            required = any(f.mode == "always" for f in found)
            args += [Argument(n, None if required else "None", n, feature) for n in names]
    args += [Argument(o.name, repr(o.default), None, "option") for o in variant.options]
    defaults = {"softmax_scale": "None", "deterministic": "None", "platform": '"auto"', "return_lse": "False"}
    args += [Argument(n, defaults[n], n if n == "softmax_scale" else None, "call") for n in CALL_ARGUMENTS]
    args += [Argument(n, "None", None, "mesh") for n in MESH_ARGUMENTS]
    return tuple(args)


def _absent(arguments: tuple) -> dict:
    """Built-in arguments the op does not take, and the feature that would bring each (for its message)."""
    taken = {a.name for a in arguments if a.in_signature}
    return {name: features if isinstance(features, str) else " or ".join(features)
            for features, names in FEATURE_ARGUMENTS for name in names if name not in taken}


# Features that mean nothing for the last rows of a sequence over a cache: a spec that compiles one in
# (`always` or a value) cannot have a decode mode.
TRAIN_ONLY_FEATURES = ("segment_ids", "attention_mask", "bias", "varlen", "block_mask", "positions")


def _check_modes(variant: Variant) -> None:
    """Decode and paged modes (docs/DESIGN.md §3) need the train mode (whose XLA hooks they run on), the xla
    backend (their kernels so far) and no train-only feature compiled in."""
    decode = [m for m in variant.modes if m != "train"]
    if not decode:
        return
    if "train" not in variant.modes:
        raise SpecError(f"mode(s) {', '.join(decode)} need 'train' in modes too (they run its hooks)", variant.loc)
    if "xla" not in variant.backends:
        raise SpecError(f"mode(s) {', '.join(decode)} are built on the xla backend so far: list xla in backends",
                        variant.loc)
    for f in variant.features:
        if f.name in TRAIN_ONLY_FEATURES and f.mode != "runtime":
            raise SpecError(f"feature '{f.name}' is compiled in ({f.mode}), but it has no meaning in mode(s) "
                            f"{', '.join(decode)}: make it runtime or drop those modes", f.loc)


# What keeps a spec's segment key in the element mask (`segment_key_of`): the decode modes run the train mode's XLA
# hooks and print the spec's mask into their kernels (they have no ids of the prompt's tokens), varlen restarts
# positions per sequence inside one row of ids, and explicit positions would place tokens the ids do not follow.
SEGMENT_KEY_BLOCKERS = ("varlen", "positions")


def segment_key_of(variant: Variant) -> tuple[SegmentKey | None, Expr]:
    """(the mask's segment key, the element mask left), or (None, the spec's mask) where the spec keeps it whole:
    modes beyond train, or a feature of `SEGMENT_KEY_BLOCKERS` (docs/DESIGN.md §5, Segment keys)."""
    if any(m != "train" for m in variant.modes) or variant.feature_names() & set(SEGMENT_KEY_BLOCKERS):
        return None, variant.mask
    key, rest = split_segment_key(separate(variant.mask))
    return (key, rest) if key is not None else (None, variant.mask)


def plan_attention(variant: Variant) -> AttentionPlan:
    """The plan of a loaded, type-checked variant (``ejgen.spec.load_spec`` checks types once)."""
    _check_modes(variant)
    score = variant.score
    if score.ty is Type.INT:
        score = Binary("*", ONE, score, ty=Type.FLOAT)
    grad_params = {p.name for p in variant.params if p.grad}
    param_grads = tuple(
        ParamGrad(ref, simplify(diff(score, ref))) for ref in param_occurrences(score, grad_params)
    )
    key, element_mask = segment_key_of(variant)
    plan = AttentionPlan(
        variant=variant,
        features={f.name: f for f in variant.features},
        score=score,
        score_is_identity=score == S,
        dscore_ds=simplify(diff(score, S)),
        param_grads=param_grads,
        mask=analyse(element_mask),
        builtin_constraints=tuple(c for c in _builtin_constraints() if c.feature in variant.feature_names()),
        arguments=(arguments := _arguments(variant)),
        absent_arguments=_absent(arguments),
        segment_key=key,
        element_mask=element_mask,
    )
    placed = plan.names_used() & {"q_idx", "kv_idx", "q_len", "kv_len"}
    if plan.has("positions") and placed:
        raise SpecError(f"feature 'positions' cannot be combined with a score or mask that reads "
                        f"{', '.join(sorted(placed))}: explicit positions place tokens for causal and the window only "
                        f"(spec expressions over them are not supported yet)", variant.feature("positions").loc)
    return plan
