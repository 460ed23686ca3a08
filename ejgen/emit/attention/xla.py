"""XLA backend: prints the plan's expressions as jax.numpy and fills the XLA template."""

from __future__ import annotations

from ejgen.emit.attention.common import range_constraints
from ejgen.emit.printer import Printer
from ejgen.ir.expr import Const, Expr, ParamRef, Var, to_text, walk
from ejgen.plan.attention import AttentionPlan

BUILTINS = ("b", "h", "q_idx", "kv_idx", "q_len", "kv_len")
_AXES = {"b": (0,), "h": (1, 2), "q_idx": (3,), "kv_idx": (4,), "q_len": (3,), "kv_len": (3,)}


class JnpPrinter(Printer):
    functions = {
        "exp": "jnp.exp",
        "log": "jnp.log",
        "tanh": "jnp.tanh",
        "sigmoid": "jax.nn.sigmoid",
        "abs": "jnp.abs",
        "sqrt": "jnp.sqrt",
        "min": "jnp.minimum",
        "max": "jnp.maximum",
        "where": "jnp.where",
        "log2": "jnp.log2",
        "exp2": "jnp.exp2",
        "sign": "jnp.sign",
        "clamp": "jnp.clip",
    }
    logical_and = "jnp.logical_and"
    logical_or = "jnp.logical_or"
    logical_not = "jnp.logical_not"

    def __init__(self, names: dict[str, str], params: dict):
        super().__init__(names)
        self.params = params  # name -> Param

    def int_op(self, e):
        """jnp's ``//`` and ``%`` on ints are Python's; a divisor that may be 0 is guarded."""
        if isinstance(e.b, Const) and e.b.value != 0:
            return f"{self.wrap(e.a, 5)} {e.op} {self.wrap(e.b, 5, strict=True)}", 5
        b = self(e.b)
        quotient = f"jnp.where({b} == 0, 0, {self.wrap(e.a, 5)} // jnp.where({b} == 0, 1, {b}))"
        if e.op == "//":
            return quotient, 9
        return f"{self.wrap(e.a, 4)} - {quotient} * {self.wrap(e.b, 5, strict=True)}", 4

    def cast(self, fn, x):
        if fn == "float":
            return f"jnp.float32({self(x)})"
        inner = {"floor": f"jnp.floor({self(x)})", "ceil": f"jnp.ceil({self(x)})", "round": f"jnp.round({self(x)})",
                 "int": self(x)}[fn]  # jnp.round: half to even, as Python's; int32(): toward zero
        return f"jnp.int32({inner})"

    def param(self, e: ParamRef) -> str:
        shape = self.params[e.name].shape
        local = f"param_{e.name}"
        return f"{local}[{', '.join(self.index(local, i, dim, idx) for i, (dim, idx) in enumerate(zip(shape, e.indices)))}]"

    def index(self, local: str, axis: int, dim, idx: Expr) -> str:
        top = str(dim - 1) if isinstance(dim, int) else f"{local}.shape[{axis}] - 1"
        return f"jnp.clip({self(idx)}, 0, {top})"


def _names(variant) -> dict[str, str]:
    names = {n: n for n in ("s",) + BUILTINS}
    names.update({o.name: f"opt_{o.name}" for o in variant.options})
    return names


def _used(exprs, exclude=()) -> tuple[list[str], list[str]]:
    """(builtin names, option/param locals) used by ``exprs``, in a stable order."""
    builtins, others = set(), set()
    for e in exprs:
        for n in walk(e):
            if isinstance(n, Var) and n.kind == "builtin" and n.name != "s":
                builtins.add(n.name)
            elif isinstance(n, Var) and n.kind == "option":
                others.add(f"opt_{n.name}")
            elif isinstance(n, ParamRef):
                others.add(f"param_{n.name}")
    return [b for b in BUILTINS if b in builtins and b not in exclude], sorted(others)


def _bindings(exprs, exclude=()) -> list[str]:
    builtins, others = _used(exprs, exclude)
    lines = [f"{b} = blk.{b}" for b in builtins]
    lines += [f'{o} = ctx["{o}"]' for o in others]
    return lines


def _deps(e: Expr) -> set[int]:
    axes = set()
    for n in walk(e):
        if isinstance(n, Var) and n.kind == "builtin":
            axes.update(_AXES.get(n.name, ()))
    return axes


def template_context(plan: AttentionPlan) -> dict:
    variant = plan.variant
    params = {p.name: p for p in variant.params}
    names = _names(variant)
    hook = JnpPrinter(names, params)
    window = {"window_left": 'ctx["window_left"]', "window_right": 'ctx["window_right"]'}
    element = JnpPrinter({**names, **window}, params)
    scalar = JnpPrinter({**names, **window, "q_len": "cfg.seq_q", "kv_len": "cfg.seq_k",
                         **{o.name: f'ctx["opt_{o.name}"]' for o in variant.options}}, params)

    builtin, spec_ranges = range_constraints(plan, element, scalar)
    grad_exprs = [plan.dscore_ds] + [g.deriv for g in plan.param_grads]
    param_grads = []
    for g in plan.param_grads:
        deps = set().union(*(_deps(i) for i in g.ref.indices)) if g.ref.indices else set()
        reduce_axes = tuple(a for a in range(5) if a not in deps)
        param_grads.append({
            "param": g.ref.name,
            "text": f"d score / d {to_text(g.ref)} = {to_text(g.deriv)}",
            "deriv_code": hook(g.deriv),
            "reduce_axes": repr(reduce_axes),
            "index_codes": [hook.index(f"param_{g.ref.name}", i, d, idx)
                            for i, (d, idx) in enumerate(zip(params[g.ref.name].shape, g.ref.indices))],
        })
    spec_mask = plan.spec_mask
    runtime_mask = "cfg.runtime_block_mask" if not plan.mask.needs_block_mask else "True"
    return {
        "score_is_identity": plan.score_is_identity,
        "score_code": hook(plan.score),
        "score_bindings": _bindings([plan.score]),
        "dscore_code": hook(plan.dscore_ds),
        "grad_bindings": _bindings(grad_exprs),
        "param_grads": param_grads,
        "param_grad_bindings": _bindings([g.ref for g in plan.param_grads]),
        "grad_param_names": repr(tuple(p.name for p in plan.grad_params)),
        "builtin_constraints": builtin,
        "range_constraints": builtin + spec_ranges,
        "spec_mask_code": None if spec_mask is None else hook(spec_mask),
        "mask_bindings": [] if spec_mask is None else _bindings([spec_mask], exclude=("q_idx", "kv_idx", "q_len", "kv_len")),
        "block_mask_condition": runtime_mask,
        "uses_jax": any("jax." in code.replace("jnp.", "") for code in
                        [hook(plan.score), hook(plan.dscore_ds)] + [g["deriv_code"] for g in param_grads]
                        + ([hook(spec_mask)] if spec_mask is not None else [])),
    }


def segment_key_context(plan: AttentionPlan) -> dict | None:
    """The op glue's `_key_values` (docs/DESIGN.md §5, Segment keys): the key's two sides printed as jnp over
    ``b`` [B, 1] and positions [1, S], the params and options they read bound from ``ctx``; None without a key."""
    key = plan.segment_key
    if key is None:
        return None
    printer = JnpPrinter(_names(plan.variant), {p.name: p for p in plan.variant.params})
    _, reads = _used([key.query, key.key])
    return {
        "text": key.text(),
        "base": f"\"{key.base}\"" if key.base else "None",
        "bindings": [f'{o} = ctx["{o}"]' for o in reads],
        "query_code": printer(key.query),
        "key_code": printer(key.key),
    }
