"""The spec's mask as interval arithmetic over tiles (docs/DESIGN.md §3 block masks, "tiles of a spec's mask"):
printed as straight-line code, one `ejgen.runtime.core.intervals` call per node (a node that repeats is
computed once), into a function ``mask_tiles(t, ctx)`` that gives each (query tile, key tile) its kind: skip
(no element of the tile can be visible), partial (the element mask decides) or full. ``t`` holds the tiles'
index intervals (``t.q_idx``, ``t.kv_idx``: each tile's first and last index; ``t.b``, ``t.h``, ``t.q_len``,
``t.kv_len``: single values), ``ctx`` the op's runtime values (options ``opt_<name>``, params ``param_<name>``).

The mask analysis (`ejgen.ir.passes.mask`) bounds affine conjuncts inside the kernels; this covers every other
mask: `q_idx // C == kv_idx // C` (chunks), `%` patterns, `or`, params read by position (Flamingo's image
numbers: their least and greatest value per tile). What it cannot bound (transcendental functions) reads as
"maybe": those tiles take the element mask, never a wrong skip.
"""

from __future__ import annotations

from ejgen.emit.attention.common import positional
from ejgen.ir.expr import Binary, Call, Const, Expr, ParamRef, Type, Unary, Var, to_text

_BINARY = {"+": "add", "-": "sub", "*": "mul", "/": "truediv", "//": "floordiv", "%": "mod", "<": "lt", "<=": "le",
           ">": "gt", ">=": "ge", "==": "eq", "!=": "ne", "and": "and_", "or": "or_"}
_CALLS = {"abs": "abs_", "min": "minimum", "max": "maximum", "clamp": "clamp", "sign": "sign", "where": "where"}
_CASTS = ("floor", "ceil", "round", "int")
_BUILTINS = ("q_idx", "kv_idx", "b", "h", "q_len", "kv_len")


class IntervalPrinter:
    """Prints an expression as assignments ``v<n> = iv.<op>(...)``; ``lines`` collects them in order."""

    def __init__(self):
        self.lines: list[str] = []
        self.names: dict[str, str] = {}  # a node's text -> the name holding its interval
        self.inputs: dict[str, str] = {}  # options and params bound at the top

    def __call__(self, e: Expr) -> str:
        key = f"{e.ty}:{to_text(e)}"
        if key not in self.names:
            code = self.node(e)
            if code.isidentifier() or code.startswith("t.") or isinstance(e, Const):
                return code
            name = f"v{len(self.lines)}"
            self.lines.append(f"{name} = {code}  # {_short(to_text(e))}")
            self.names[key] = name
        return self.names[key]

    def node(self, e: Expr) -> str:
        if isinstance(e, Const):
            return f"iv.point({e.value!r})"
        if isinstance(e, Var):
            if e.kind == "builtin" and e.name in _BUILTINS:
                return f"t.{e.name}"
            name = f"opt_{e.name}"
            self.inputs[name] = f'iv.point(ctx["{name}"])'
            return name
        if isinstance(e, ParamRef):
            name = f"param_{e.name}"
            self.inputs[name] = f'ctx["{name}"]'
            indices = [self(i) for i in e.indices]
            ranged = [axis for axis, i in enumerate(e.indices) if positional(i)]
            tile = [i.name for i in e.indices if isinstance(i, Var) and i.name in ("q_idx", "kv_idx")]
            block = f", block=t.{tile[0].removesuffix('_idx')}_block" if len(ranged) == 1 and len(tile) == 1 else ""
            return f"iv.read({name}, ({', '.join(indices)},), ranged={tuple(ranged)!r}{block})"
        if isinstance(e, Unary):
            return f"iv.{'not_' if e.op == 'not' else 'neg'}({self(e.x)})"
        if isinstance(e, Binary):
            if e.op == "**":
                return f"iv.top({e.ty is Type.FLOAT})"
            if e.op in ("==", "!=") and e.a.ty is Type.BOOL:
                same = f"iv.cond_eq({self(e.a)}, {self(e.b)})"
                return same if e.op == "==" else f"iv.not_({same})"
            return f"iv.{_BINARY[e.op]}({self(e.a)}, {self(e.b)})"
        if isinstance(e, Call):
            if e.fn in _CALLS:
                if e.fn == "where" and e.ty is Type.BOOL:  # where(c, x, y) of conditions: (c and x) or (not c and y)
                    c, x, y = (self(a) for a in e.args)
                    return f"iv.or_(iv.and_({c}, {x}), iv.and_(iv.not_({c}), {y}))"
                return f"iv.{_CALLS[e.fn]}({', '.join(self(a) for a in e.args)})"
            if e.fn in _CASTS:
                return f'iv.to_int("{e.fn}", {self(e.args[0])})'
            if e.fn == "float":
                return f"iv.to_float({self(e.args[0])})"
            return "iv.top(True)"  # exp, log, tanh, ...: no bounds kept (their rounding need not be monotone)
        raise TypeError(f"not an expression: {e!r}")


def _short(text: str, width: int = 70) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def mask_tiles_context(mask: Expr | None) -> dict | None:
    """Template data of ``mask_tiles``: the input bindings and the straight-line body; None without a mask."""
    if mask is None:
        return None
    printer = IntervalPrinter()
    result = printer(mask)
    inputs = [f"{name} = {code}" for name, code in sorted(printer.inputs.items())]
    return {"lines": inputs + printer.lines, "result": result}
