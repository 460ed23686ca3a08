"""What every attention backend's template context shares: the mask analysis as template data, the
layout of the runtime scalar arrays, and the rule for params read by position."""

from __future__ import annotations

from ejgen.errors import SpecError
from ejgen.ir.expr import Expr, ParamRef, Var, to_text, walk
from ejgen.plan.attention import AttentionPlan

POSITIONAL = {"q_idx", "kv_idx"}
MAX_POSITIONAL_DIM = 512  # a param read by position: its positional dim is held in one tile


def range_constraints(plan: AttentionPlan, element, scalar, flag=lambda name: f"cfg.{name}") -> tuple[list, list]:
    """(built-in constraints, spec-mask constraints): one entry per affine constraint with its guard
    (printed with ``flag``), its element predicate and the pieces the block-range code needs
    (coefficients a, b and the printed offset c). ``element`` and ``scalar`` are the backend's
    printers for the element mask and for the block-range arithmetic."""
    builtin = [
        {"guard": c.guard.text(flag), "text": c.affine.source, "expr": c.affine.as_expr(),
         "element_code": element(c.affine.as_expr()), "a": c.affine.a, "b": c.affine.b,
         "c_code": scalar(c.affine.c)}
        for c in plan.builtin_constraints
    ]
    spec = [
        {"guard": "True", "text": f"spec mask: {c.source}", "a": c.a, "b": c.b, "c_code": scalar(c.c)}
        for c in plan.mask.constraints
    ]
    return builtin, spec


def scalar_layout(variant) -> tuple[list[str], list[str]]:
    """Entries of the F32 and I32 runtime scalar arrays every backend packs: the built-in scalars,
    then the spec's options by type."""
    f32 = ["scale", "softcap"] + [f"opt_{o.name}" for o in variant.options if o.type == "float"]
    i32 = ["window_left", "window_right"] + [f"opt_{o.name}" for o in variant.options if o.type != "float"]
    return f32, i32


def positional(e: Expr, names=POSITIONAL) -> bool:
    """Whether an index expression depends on a query or key position (or another of ``names``)."""
    return any(isinstance(n, Var) and n.kind == "builtin" and n.name in names for n in walk(e))


def positional_read_fits(plan: AttentionPlan, ref: ParamRef, names=POSITIONAL) -> bool:
    """A param read by positions fits the kernels when one index is positional, over an integer dim of
    at most MAX_POSITIONAL_DIM (it is then gathered from one tile)."""
    shape = plan.variant.param(ref.name).shape
    axes = [i for i, idx in enumerate(ref.indices) if positional(idx, names)]
    return not axes or (len(axes) == 1 and isinstance(shape[axes[0]], int) and shape[axes[0]] <= MAX_POSITIONAL_DIM)


def positional_grad_error(backend: str, plan: AttentionPlan, ref: ParamRef) -> SpecError:
    """The error of a backend that reduces param gradients per program (Triton, Pallas) for a ``grad: true`` param
    read by positions that does not fit one tile: the reduction would need one partial per position. Both backends
    say the same, at the param."""
    param = plan.variant.param(ref.name)
    return SpecError(
        f"the {backend} backend cannot reduce the gradient of {to_text(ref)} deterministically: a param "
        f"indexed by positions needs exactly one such index, over an integer dim of at most "
        f"{MAX_POSITIONAL_DIM} (here: {', '.join(str(d) for d in param.shape)}). If it is added to the score, drop the "
        f"param and enable `bias: runtime`: the call's `bias` [batch|1, heads|1, q_len, kv_len] has its gradient on "
        f"every backend; else list `backends: [xla]` for this spec",
        param.loc,
    )
