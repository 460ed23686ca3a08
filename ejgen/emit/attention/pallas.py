"""Pallas backend: prints the plan's expressions as jax.numpy for the inside of Pallas kernels
(GPU and TPU share the hooks) and fills the Pallas templates.

Names inside the hooks: ``s`` the logit tile; ``t`` a ``Tile`` of index grids (``t.q_idx``,
``t.kv_idx``, ``t.b``, ``t.h``, ``t.q_len``, ``t.kv_len``); ``sc`` the runtime scalars
(``sc.window_left``, ``sc.opt_<name>``); ``prm`` the params by name (refs inside the kernels,
arrays outside). A param index that depends on positions is read with one select per value of its
dim (``_rt.gather``), so that Mosaic and Triton both lower it; its gradient is summed per value.
"""

from __future__ import annotations

from ejgen.emit.attention.common import (MAX_POSITIONAL_DIM, positional, positional_read_fits, range_constraints,
                                         scalar_layout)
from ejgen.emit.attention.xla import JnpPrinter
from ejgen.errors import SpecError
from ejgen.ir.expr import Call, Const, ParamRef, to_text, walk
from ejgen.plan.attention import AttentionPlan

TILE_NAMES = ("b", "h", "q_idx", "kv_idx", "q_len", "kv_len")
TILED = {"q_idx", "kv_idx", "q_len", "kv_len"}  # tiles inside a kernel (lengths: under varlen)


class KernelPrinter(JnpPrinter):
    """jnp spelling of hook expressions, names as in the module docstring."""

    def call(self, e: Call) -> str:
        """``where`` with its constant branches typed float32: Pallas's Triton lowering (jax 0.10) gives a
        select between two weakly typed constants under a scalar condition (a param read per head) the
        predicate's i1 type, and the next arithmetic on it fails to lower."""
        if e.fn != "where":
            return super().call(e)
        args = [f"jnp.float32({self(a)})" if isinstance(a, Const) and not isinstance(a.value, bool) else self(a)
                for a in e.args]
        return f"{self.functions[e.fn]}({', '.join(args)})"

    def indices(self, e: ParamRef) -> tuple[list[str | None], str | None]:
        """Per index its clamped code, ``None`` for the one positional index, and that index' code."""
        local = f'prm["{e.name}"]'
        shape = self.params[e.name].shape
        codes: list[str | None] = []
        pos = None
        for axis, (dim, idx) in enumerate(zip(shape, e.indices)):
            code = self.index(local, axis, dim, idx)
            if positional(idx, TILED):
                codes.append(None)
                pos = code
            else:
                codes.append(code)
        return codes, pos

    def param(self, e: ParamRef) -> str:
        codes, pos = self.indices(e)
        local = f'prm["{e.name}"]'
        if pos is None:
            return f"{local}[{', '.join(codes)}]"
        return f"_rt.gather({local}, {_tuple(codes)}, {pos})"


def _tuple(codes) -> str:
    items = ["None" if c is None else c for c in codes]
    return f"({', '.join(items)},)" if len(items) == 1 else f"({', '.join(items)})"


def _names_tuple(names) -> str:
    """A tuple literal of strings: ``()``, ``("a",)``, ``("a", "b")``."""
    items = [f'"{n}"' for n in names]
    return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"


def _check_params(plan: AttentionPlan):
    """Every param read with at most one positional index, over an integer dim of bounded size."""
    exprs = [plan.score, plan.variant.mask] + [g.deriv for g in plan.param_grads]
    for e in exprs:
        for n in walk(e):
            if not isinstance(n, ParamRef):
                continue
            param = plan.variant.param(n.name)
            if not positional_read_fits(plan, n, TILED):
                raise SpecError(
                    f"the pallas backend cannot read {to_text(n)}: a param indexed by positions needs exactly one "
                    f"such index, over an integer dim of at most {MAX_POSITIONAL_DIM}; list `backends: [xla]` "
                    f"for this spec",
                    param.loc,
                )


def template_context(plan: AttentionPlan) -> dict:
    variant = plan.variant
    _check_params(plan)
    params = {p.name: p for p in variant.params}
    names = {"s": "s", **{n: f"t.{n}" for n in TILE_NAMES}, "window_left": "sc.window_left",
             "window_right": "sc.window_right", **{o.name: f"sc.opt_{o.name}" for o in variant.options}}
    hook = KernelPrinter(names, params)
    scalar = KernelPrinter({**names, "q_len": "cfg.seq_q", "kv_len": "cfg.seq_k"}, params)

    builtin, spec_ranges = range_constraints(plan, hook, scalar)
    param_grads = []
    for i, g in enumerate(plan.param_grads):
        codes, pos = hook.indices(g.ref)
        param_grads.append({
            "param": g.ref.name,
            "index": i,
            "text": f"d score / d {to_text(g.ref)} = {to_text(g.deriv)}",
            "index_code": _tuple(codes),
            "pos_code": pos or "None",
        })
    f32, i32 = scalar_layout(variant)
    bools = {f"opt_{o.name}" for o in variant.options if o.type == "bool"}
    spec_mask = plan.spec_mask
    return {
        "score_is_identity": plan.score_is_identity,
        "score_code": hook(plan.score),
        "dscore_code": hook(plan.dscore_ds),
        "dparam_codes": [hook(g.deriv) for g in plan.param_grads],
        "param_grads": param_grads,
        "builtin_constraints": builtin,
        "range_constraints": builtin + spec_ranges,
        "spec_mask_code": None if spec_mask is None else hook(spec_mask),
        "spec_block_mask": plan.mask.needs_block_mask,
        "f32_fields": f32,
        "i32_fields": [{"name": n, "cast": " != 0" if n in bools else ""} for n in i32],
        "options": [{"name": f"opt_{o.name}", "dtype": "float32" if o.type == "float" else "int32"}
                    for o in variant.options],
        "params": [{"name": p.name, "dtype": "int32" if p.dtype == "int32" else "float32"} for p in variant.params],
        "params_tuple": _names_tuple(p.name for p in variant.params),
        "grad_params_tuple": _names_tuple(p.name for p in plan.grad_params),
    }
