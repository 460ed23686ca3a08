"""Pallas backend: prints the plan's expressions as jax.numpy for the inside of Pallas kernels
(GPU and TPU share the hooks) and fills the Pallas templates.

Names inside the hooks: ``s`` the logit tile; ``t`` a ``Tile`` of index grids (``t.q_idx``,
``t.kv_idx``, ``t.b``, ``t.h``, ``t.q_len``, ``t.kv_len``); ``sc`` the runtime scalars
(``sc.window_left``, ``sc.opt_<name>``); ``prm`` the params by name (refs inside the kernels,
arrays outside).

Params read by position. A read whose indices depend on one side's positions only (``types[b, kv_idx]``,
``latest[b, q_idx]``: the key's, or the query's with the lengths) is a token view: `_token_views` evaluates it
once per call outside the kernels, over whole rows ([B|1, H|1, S], clamped and padded as the op pads), and the
kernels read its tiles by block, as they read segment ids (``t.q_tok[i]``, ``t.kv_tok[i]``), whatever the dim's
size. A read that depends on both sides (``table[h, q_idx - kv_idx + 16]``), or has a gradient, is read with one
select per value of its dim (``_rt.gather``), so that Mosaic and Triton both lower it; its gradient is summed
per value. That needs a single positional index over an integer dim of at most MAX_POSITIONAL_DIM.
"""

from __future__ import annotations

from ejgen.emit.attention.common import (MAX_POSITIONAL_DIM, positional, positional_grad_error, positional_read_fits,
                                         range_constraints, scalar_layout)
from ejgen.emit.attention.xla import JnpPrinter
from ejgen.errors import SpecError
from ejgen.ir.expr import Call, Const, Expr, ParamRef, Type, Var, children, to_text, walk
from ejgen.plan.attention import AttentionPlan

TILE_NAMES = ("b", "h", "q_idx", "kv_idx", "q_len", "kv_len")
TILED = {"q_idx", "kv_idx", "q_len", "kv_len"}  # tiles inside a kernel (lengths: under varlen)


class KernelPrinter(JnpPrinter):
    """jnp spelling of hook expressions, names as in the module docstring; ``views`` maps each token view's
    read to the tile that holds it."""

    def __init__(self, names: dict[str, str], params: dict, views: dict | None = None):
        super().__init__(names, params)
        self.views = views or {}

    def call(self, e: Call) -> str:
        """``where`` with its constant branches typed float32: Pallas's Triton lowering (jax 0.10) gives a
        select between two weakly typed constants under a scalar condition (a param read per head) the
        predicate's i1 type, and the next arithmetic on it fails to lower."""
        if e.fn != "where":
            return super().call(e)
        args = [f"jnp.float32({self(a)})" if isinstance(a, Const) and not isinstance(a.value, bool) else self(a)
                for a in e.args]
        return f"{self.functions[e.fn]}({', '.join(args)})"

    def cast(self, fn, x):
        """``round`` through `_rt.round_half_even` (no `round` primitive in Pallas's Triton lowering)."""
        if fn == "round":
            return f"jnp.int32(_rt.round_half_even({self(x)}))"
        return super().cast(fn, x)

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
        if e in self.views:
            return self.views[e]
        codes, pos = self.indices(e)
        local = f'prm["{e.name}"]'
        if pos is None:
            return f"{local}[{', '.join(codes)}]"
        return f"_rt.gather({local}, {_tuple(codes)}, {pos})"


class ViewPrinter(KernelPrinter):
    """A token view's read over whole rows, outside the kernels: the param array indexed by the index grids
    of ``t``, each index clamped into its dim (``_rt.clamped``)."""

    def param(self, e: ParamRef) -> str:
        return f'_rt.clamped(prm["{e.name}"], {", ".join(self(i) for i in e.indices)})'


def _rounds(plan: AttentionPlan) -> bool:
    """Whether a hook prints the DSL's ``round`` of a float (`KernelPrinter.cast`)."""
    return any(isinstance(n, Call) and n.fn == "round" and n.args[0].ty is not Type.INT
               for e in plan.kernel_exprs for n in walk(e))


def _tuple(codes) -> str:
    items = ["None" if c is None else c for c in codes]
    return f"({', '.join(items)},)" if len(items) == 1 else f"({', '.join(items)})"


def _names_tuple(names) -> str:
    """A tuple literal of strings: ``()``, ``("a",)``, ``("a", "b")``."""
    items = [f'"{n}"' for n in names]
    return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"


def _side(ref: ParamRef) -> str | None:
    """Which positions a read depends on: None (none: a scalar read), "q" (the query's, or the lengths: per query
    row under varlen), "kv" (the key's only) or "both"."""
    used = {n.name for i in ref.indices for n in walk(i) if isinstance(n, Var) and n.kind == "builtin"} & TILED
    if not used:
        return None
    if "kv_idx" not in used:
        return "q"
    return "kv" if used == {"kv_idx"} else "both"


def _token_views(plan: AttentionPlan) -> dict[str, list[ParamRef]]:
    """The reads that become token views, per side ("q", "kv"), in order of first appearance; a read nested in
    a view's indices is part of that view. Refuses at the param what the kernels cannot read: a read by both
    sides' positions past the gather's bound, a gradient through a read past it (as the Triton backend)."""
    grad_refs = {g.ref for g in plan.param_grads}
    views = {"q": [], "kv": []}

    def visit(e):
        if isinstance(e, ParamRef):
            side = _side(e)
            if side is not None and not positional_read_fits(plan, e, TILED):
                if e in grad_refs:
                    raise positional_grad_error("pallas", plan, e)
                if side == "both":
                    raise _read_error(plan, e)
            if side in views and e not in grad_refs:
                if e not in views[side]:
                    views[side].append(e)
                return
        for c in children(e):
            visit(c)

    for e in plan.kernel_exprs:
        visit(e)
    return views


def _read_error(plan: AttentionPlan, ref: ParamRef) -> SpecError:
    param = plan.variant.param(ref.name)
    return SpecError(
        f"the pallas backend cannot read {to_text(ref)}: its indices depend on both a query and a key position, "
        f"which the kernels read with one select per value of the dim, so it needs exactly one such index, over "
        f"an integer dim of at most {MAX_POSITIONAL_DIM} (here: {', '.join(str(d) for d in param.shape)}). A read "
        f"by one side's position has no bound (`{param.name}[b, kv_idx]`, `{param.name}[b, q_idx]`); bucket the "
        f"distance into a small table (`table[h, clamp(kv_idx - q_idx, -16, 16) + 16]`); a [q_len, kv_len] "
        f"table is the call's `bias` (enable `bias: runtime`); else list `backends: [triton, xla]` for this spec",
        param.loc,
    )


def template_context(plan: AttentionPlan) -> dict:
    variant = plan.variant
    views = _token_views(plan)
    params = {p.name: p for p in variant.params}
    names = {"s": "s", **{n: f"t.{n}" for n in TILE_NAMES}, "window_left": "sc.window_left",
             "window_right": "sc.window_right", **{o.name: f"sc.opt_{o.name}" for o in variant.options}}
    tiles = {ref: f"t.{side}_tok[{i}]" for side, refs in views.items() for i, ref in enumerate(refs)}
    hook = KernelPrinter(names, params, tiles)
    scalar = KernelPrinter({**names, "q_len": "cfg.seq_q", "kv_len": "cfg.seq_k"}, params)
    whole = ViewPrinter(names, params)

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
    codes = {"score_code": hook(plan.score), "dscore_code": hook(plan.dscore_ds),
             "dparam_codes": [hook(g.deriv) for g in plan.param_grads],
             "spec_mask_code": None if spec_mask is None else hook(spec_mask)}
    reads = [n for e in plan.kernel_exprs for n in _kernel_reads(e, tiles)]
    in_kernel = {n.name for n in reads} | {p.name for p in plan.grad_params}
    gathers = any(_side(n) is not None for n in reads)
    return {
        **codes,
        "score_is_identity": plan.score_is_identity,
        "uses_rt": bool(param_grads or tiles or gathers or _rounds(plan)),  # _rt.scatter, .clamped, .gather, .round...
        "token_views": bool(tiles),
        "q_view_codes": [whole(ref) for ref in views["q"]],
        "kv_view_codes": [whole(ref) for ref in views["kv"]],
        "view_texts": [f"{tile.removeprefix('t.')} = {to_text(ref)}" for ref, tile in tiles.items()],
        "kernel_params_tuple": _names_tuple(p.name for p in variant.params if p.name in in_kernel),
        "param_grads": param_grads,
        "builtin_constraints": builtin,
        "range_constraints": builtin + spec_ranges,
        "spec_block_mask": plan.mask.needs_block_mask,
        "f32_fields": f32,
        "i32_fields": [{"name": n, "cast": " != 0" if n in bools else ""} for n in i32],
        "options": [{"name": f"opt_{o.name}", "dtype": "float32" if o.type == "float" else "int32"}
                    for o in variant.options],
        "params": [{"name": p.name, "dtype": "int32" if p.dtype == "int32" else "float32"} for p in variant.params],
        "params_tuple": _names_tuple(p.name for p in variant.params),
        "grad_params_tuple": _names_tuple(p.name for p in plan.grad_params),
    }


def _kernel_reads(e: Expr, tiles: dict):
    """The param reads of ``e`` that the kernels make themselves (a token view's tile stands for its read)."""
    if isinstance(e, ParamRef):
        if e in tiles:
            return
        yield e
    for c in children(e):
        yield from _kernel_reads(c, tiles)
