"""Triton backend: prints the plan's expressions as `triton.language` and fills the templates.

Names inside the kernels: ``s`` the logit tile, ``q_idx [BLOCK_M, 1]`` and ``kv_idx [1, BLOCK_N]``
positions, ``off_b``/``off_h`` the program's batch (sequence) and query head, ``q_len``/``kv_len``
the sequence lengths, options ``opt_<name>`` loaded from the F32/I32 scalar arrays, params read
from ``PARAM_<name>`` with row-major offsets, sizes as fields of the ``DIMS`` group and the
built-in features' flags as fields of ``MASKS`` (the constexpr groups of
``ejgen.runtime.attention.triton.lib``).

The kernel module keeps within ``WIDTH`` columns: the template is written so, and ``reflow`` wraps
the lines that the spec makes longer (its expressions, many params) without changing the code.
"""

from __future__ import annotations

import ast
import io
import keyword
import textwrap
import tokenize

from ejgen.emit.printer import Printer
from ejgen.emit.attention.common import MAX_POSITIONAL_DIM, positional, positional_read_fits, range_constraints, scalar_layout
from ejgen.errors import SpecError
from ejgen.ir.expr import Binary, Const, Expr, ParamRef, Var, to_text, walk
from ejgen.plan.attention import AttentionPlan

DIM_CONSTEXPR = {"batch": "DIMS.B", "heads": "DIMS.HQ", "kv_heads": "DIMS.HKV", "q_len": "DIMS.SEQ_Q",
                 "kv_len": "DIMS.SEQ_K", "head_dim": "DIMS.D"}
# The kernels' constexprs in the order of their signatures (the host passes them by name).
KERNEL_DIMS = ["B", "HQ", "HKV", "SEQ_Q", "SEQ_K", "D", "DV", "D_PAD", "DV_PAD", "BLOCK_M", "BLOCK_N"]
KERNEL_FLAGS = ["CAUSAL", "WINDOW", "SOFTCAP", "SINKS", "N_SINKS", "SINKS_PAD", "BIAS_ON", "BIAS_BATCH", "BIAS_HEADS",
                "SEGMENTS", "DENSE", "MASK_HEADS", "VARLEN", "RUNTIME_MASK", "STAGED", "PLAIN", "PRECISION", "UPCAST",
                "TMA", "WS", "ATOMIC_DQ", "BAND", "BAND_BLOCKS", "BAND_TMA", "DQ_DELTA"]
WIDTH = 120  # the longest line of the kernel module
NAMES = {"s": "s", "q_idx": "q_idx", "kv_idx": "kv_idx", "b": "off_b", "h": "off_h", "q_len": "q_len", "kv_len": "kv_len",
         "window_left": "window_left", "window_right": "window_right"}


class TlPrinter(Printer):
    functions = {
        "exp": "tl.exp",
        "log": "tl.log",
        "tanh": "_tanh",
        "sigmoid": "tl.sigmoid",
        "abs": "tl.abs",
        "sqrt": "tl.sqrt",
        "min": "tl.minimum",
        "max": "tl.maximum",
        "where": "tl.where",
    }

    def __init__(self, names, params):
        super().__init__(names)
        self.params = params

    def binary(self, e: Binary):
        if e.op in ("and", "or"):
            op = "&" if e.op == "and" else "|"
            return f"(({self(e.a)}) {op} ({self(e.b)}))", 9
        return super().binary(e)

    def expr(self, e: Expr):
        if getattr(e, "op", None) == "not":
            return f"(({self(e.x)}) == 0)", 9
        return super().expr(e)

    def power(self, e: Binary) -> str:
        b = e.b
        if isinstance(b, Const) and not isinstance(b.value, bool) and float(b.value).is_integer() and 0 <= b.value <= 4:
            n = int(b.value)
            if n == 0:
                return "1.0"
            base = f"({self(e.a)})"
            return " * ".join([base] * n)
        return f"tl.exp(({self(b)}) * tl.log({self(e.a)}))"

    def clamped(self, dim, idx: Expr) -> str:
        top = str(dim - 1) if isinstance(dim, int) else f"{DIM_CONSTEXPR[dim]} - 1"
        return f"tl.minimum(tl.maximum({self(idx)}, 0), {top})"

    def strides(self, shape) -> list[str]:
        out = []
        for i in range(len(shape)):
            rest = [str(d) if isinstance(d, int) else DIM_CONSTEXPR[d] for d in shape[i + 1:]]
            out.append(" * ".join(rest) if rest else "1")
        return out

    def flat(self, ref: ParamRef, skip=()) -> str:
        shape = self.params[ref.name].shape
        terms = []
        for i, (dim, idx, stride) in enumerate(zip(shape, ref.indices, self.strides(shape))):
            if i in skip:
                continue
            term = self.clamped(dim, idx)
            terms.append(term if stride == "1" else f"{term} * ({stride})")
        return " + ".join(terms) if terms else "0"

    def param(self, e: ParamRef) -> str:
        return f"tl.load(PARAM_{e.name} + {self.flat(e)})"


def _names(variant) -> dict[str, str]:
    names = dict(NAMES)
    names.update({o.name: f"opt_{o.name}" for o in variant.options})
    return names


def _bindings(exprs, variant) -> list[str]:
    f32, i32 = scalar_layout(variant)
    used = set()
    for e in exprs:
        for n in walk(e):
            if isinstance(n, Var) and n.kind == "option":
                used.add(f"opt_{n.name}")
            if isinstance(n, Var) and n.name in ("window_left", "window_right"):
                used.add(n.name)
    lines = []
    for name in sorted(used):
        if name in f32:
            lines.append(f"{name} = tl.load(F32 + {f32.index(name)})")
        else:
            option = variant.option(name[len("opt_"):]) if name.startswith("opt_") else None
            cast = " != 0" if option is not None and option.type == "bool" else ""
            lines.append(f"{name} = tl.load(I32 + {i32.index(name)}){cast}")
    return lines


def _param_grad(plan, g, index, printer) -> dict:
    variant = plan.variant
    param = variant.param(g.ref.name)
    shape = param.shape
    pos_axes = [i for i, idx in enumerate(g.ref.indices) if positional(idx)]
    numel = " * ".join(str(d) if isinstance(d, int) else DIM_CONSTEXPR[d] for d in shape)
    info = {
        "param": param.name,
        "hook": f"_dscore_d{index}",
        "text": f"d score / d {to_text(g.ref)} = {to_text(g.deriv)}",
        "numel": f"({numel})",
        "bindings": _bindings(list(g.ref.indices), variant),
        "positional": bool(pos_axes),
    }
    if not positional_read_fits(plan, g.ref):
        raise SpecError(
            f"the triton backend cannot reduce the gradient of {to_text(g.ref)} deterministically: a param "
            f"indexed by positions needs exactly one such index, over an integer dim of at most "
            f"{MAX_POSITIONAL_DIM}; list `backends: [xla]` for this spec",
            param.loc,
        )
    if pos_axes:
        axis = pos_axes[0]
        info["pos_code"] = printer.clamped(shape[axis], g.ref.indices[axis])
        info["pos_size"] = shape[axis]
        info["pos_stride"] = f"({printer.strides(shape)[axis]})"
        info["flat_code"] = f"({printer.flat(g.ref, skip=(axis,))})"
    else:
        info["flat_code"] = f"({printer.flat(g.ref)})"
    return info


def _kernel_constexprs(indent: str = "    ") -> str:
    """The kernels' constexpr parameters, sizes then flags, each group filled to WIDTH."""
    lines = []
    for group in (KERNEL_DIMS, KERNEL_FLAGS):
        line = indent
        for name in group:
            item = f"{name}: tl.constexpr,"
            if line.strip() and len(line) + 1 + len(item) > WIDTH:
                lines.append(line)
                line = indent
            line += (" " if line.strip() else "") + item
        lines.append(line)
    return "\n".join(lines)


# reflow: binary operators a line may break before, best first (a comma, after which a line may break, ranks 0)
_BREAK_RANK = {"or": 1, "|": 1, "and": 2, "&": 2, "==": 3, "!=": 3, "<": 3, "<=": 3, ">": 3, ">=": 3,
               "+": 4, "-": 4, "*": 5, "/": 5, "//": 5, "%": 5}
_OPEN, _CLOSE = "([{", ")]}"
_ASSIGN = ("=", "+=", "-=", "*=", "/=", "//=", "%=", "&=", "|=")


def _operand_end(string: str, kind: int) -> bool:
    """Whether a token can end an operand (so that the next + or - is binary, the next [ a subscript)."""
    named = kind in (tokenize.NAME, tokenize.NUMBER, tokenize.STRING) and not keyword.iskeyword(string)
    return named or string in _CLOSE


def _break_code(toks: list, stack: list, indent: int, width: int) -> tuple | None:
    """One physical line, as ``toks`` [(string, spaces before it, can end an operand)], in lines of at most
    ``width`` columns, broken inside brackets (``stack``: the align columns of the brackets already open, None
    for a subscript) before the best break that fits: one that fills 40% of the line and aligns its continuation
    in the line's left half where there is such, then the shallowest, the best ranked, the last. A continuation
    is aligned after its innermost open bracket (or indented 8 past ``indent`` where that is too far right).
    Returns (lines, how bad: whether a continuation is indented so, the deepest break), or None where no break
    fits."""
    def text(a, b, col):
        return " " * col + "".join((" " * toks[j][1] if j > a else "") + toks[j][0] for j in range(a, b))

    lines, start, col0, stack, hanging, deepest = [], 0, indent, list(stack), False, 0
    while True:
        col, st, cands = col0, list(stack), []
        for j in range(start, len(toks)):
            string, gap, _ = toks[j]
            if j > start:
                rank = 0 if toks[j - 1][0] == "," else _BREAK_RANK.get(string) if toks[j - 1][2] else None
                if rank is not None and st and st[-1] is not None:
                    good = col - col0 >= (width - col0) * 2 // 5 and st[-1] <= width // 2  # fills, aligns
                    cands.append((not good, len(st), rank, -j, j, list(st)))
                col += gap
            col += len(string)
            if col > width:
                break
            if string in _OPEN:
                st.append(None if string == "[" and j > 0 and toks[j - 1][2] else col)
            elif string in _CLOSE and st:
                st.pop()
        else:
            return lines + [text(start, len(toks), col0)], (hanging, deepest)
        if not cands:
            return None
        _, depth, *_, j, st = min(cands)
        lines.append(text(start, j, col0))
        start, stack, deepest = j, st, max(deepest, depth)
        hanging = hanging or st[-1] > width // 2
        col0 = st[-1] if st[-1] <= width // 2 else indent + 8


def _break_statement(toks: list, stack: list, indent: int, width: int) -> list[str] | None:
    """The lines of ``_break_code``, or, where they are fewer or better (shallower breaks), those of the same
    with the expression of a return or an assignment put in parentheses, so that it may also break at its
    outermost operators."""
    best = _break_code(toks, stack, indent, width)
    if stack:
        return best and best[0]
    depth, expr = 0, None  # expr: where the expression starts
    for j, (string, _, _) in enumerate(toks):
        depth += (string in _OPEN) - (string in _CLOSE)
        if depth == 0 and (string in _ASSIGN or string == "return" and j == 0):
            expr = j + 1
    if expr is None or expr >= len(toks):
        return best and best[0]
    wrapped = toks[:expr] + [("(", toks[expr][1], False), (toks[expr][0], 0, toks[expr][2])] + toks[expr + 1:]
    wrapped.append((")", 0, True))
    other = _break_code(wrapped, stack, indent, width)
    layouts = [(len(lines), bad, i, lines) for i, (lines, bad) in enumerate(x for x in (best, other) if x)]
    return min(layouts)[-1] if layouts else None


def reflow(text: str, width: int = WIDTH) -> str:
    """``text`` (Python source) with every line longer than ``width`` wrapped: code inside its brackets,
    comments and one-line docstrings at spaces. The code is unchanged (asserted: the same syntax tree, docstrings
    compared up to whitespace); a line it cannot break stays as it is."""
    text = text.strip("\n")
    source = text.split("\n")
    rows: dict[int, list] = {}
    stacks: dict[int, list] = {}  # row -> align columns of the brackets open at its start
    stack: list = []
    prev = None
    for tok in tokenize.generate_tokens(io.StringIO(text + "\n").readline):
        if tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        row = tok.start[0]
        if row not in rows:
            if prev is not None and prev.string in _OPEN and stack[-1] is not None:
                stack[-1] = tok.start[1]  # a bracket that ends its line: its items align with this row
            rows[row], stacks[row] = [], list(stack)
        rows[row].append(tok)
        if tok.string in _OPEN:
            subscript = tok.string == "[" and prev is not None and _operand_end(prev.string, prev.type)
            stack.append(None if subscript else tok.end[1])
        elif tok.string in _CLOSE:
            stack.pop()
        prev = tok
    out = []
    for row, line in enumerate(source, 1):
        toks = rows.get(row, [])
        if len(line) <= width or not toks or any(t.start[0] != t.end[0] for t in toks):
            out.append(line)
            continue
        indent = line[:len(line) - len(line.lstrip())]
        if toks[0].type == tokenize.COMMENT:
            out += [indent + "# " + part for part in textwrap.wrap(line.strip()[1:].strip(), width - len(indent) - 2)]
            continue
        if len(toks) == 1 and toks[0].string.startswith('"""') and toks[0].string.endswith('"""'):
            parts = textwrap.wrap(toks[0].string[3:-3], width - len(indent) - 3)
            if len(parts) > 1:
                out += [indent + '"""' + parts[0]] + [indent + p for p in parts[1:-1]] + [indent + parts[-1] + '"""']
                continue
        comment = toks.pop() if toks[-1].type == tokenize.COMMENT else None  # goes on a line of its own, above
        code = [(t.string, t.start[1] - toks[i - 1].end[1] if i else 0, _operand_end(t.string, t.type))
                for i, t in enumerate(toks)]
        broken = _break_statement(code, stacks[row], len(indent), width) if toks else None
        out += [line] if broken is None else ([indent + comment.string] if comment else []) + broken
    result = "\n".join(out)
    if _tree(result) != _tree(text):
        raise AssertionError("reflow changed the code")  # a bug here, not in the spec
    return result


def _tree(source: str) -> str:
    """The syntax tree of ``source``, its strings' whitespace collapsed (docstrings wrap)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = " ".join(node.value.split())
    return ast.dump(tree)


def template_context(plan: AttentionPlan) -> dict:
    variant = plan.variant
    params = {p.name: p for p in variant.params}
    printer = TlPrinter(_names(variant), params)
    f32, i32 = scalar_layout(variant)
    param_ptrs = "".join(f"PARAM_{p.name}, " for p in variant.params)
    builtin, spec_ranges = range_constraints(plan, printer, printer, flag=lambda name: f"MASKS.{name.upper()}")
    for c in builtin:
        c["bindings"] = _bindings([c["expr"]], variant)
    ranges = builtin + spec_ranges
    grad_hooks = [{"fn": "_dscore_ds", "text": f"d score / d s = {to_text(plan.dscore_ds)}",
                   "code": printer(plan.dscore_ds), "bindings": _bindings([plan.dscore_ds], variant)}]
    for i, g in enumerate(plan.param_grads):
        grad_hooks.append({"fn": f"_dscore_d{i}", "text": f"d score / d {to_text(g.ref)} = {to_text(g.deriv)}",
                           "code": printer(g.deriv), "bindings": _bindings([g.deriv], variant)})
    spec_mask = plan.spec_mask
    return {
        "title": textwrap.fill(f"Triton kernels of `{plan.name}`: forward with lse; backward as a dK/dV and a dQ kernel.",
                               WIDTH - 3),
        "scalars": textwrap.fill(f"Runtime scalars live in two small arrays: F32 = [{', '.join(f32)}], "
                                 f"I32 = [{', '.join(i32)}].", WIDTH, break_on_hyphens=False),
        "param_ptrs": param_ptrs,  # "PARAM_a, PARAM_b, ": before more arguments
        "param_tail": "".join(f", PARAM_{p.name}" for p in variant.params),  # ", PARAM_a, PARAM_b": after one
        "dparam_tail": "".join(f", DPARAM_{p.name}" for p in plan.grad_params),
        "kernel_constexprs": _kernel_constexprs(),
        "reflow": reflow,
        "score_is_identity": plan.score_is_identity,
        "score_code": printer(plan.score),
        "score_bindings": _bindings([plan.score], variant),
        "grad_hooks": grad_hooks if not plan.score_is_identity else [],
        "param_grads": [_param_grad(plan, g, i, printer) for i, g in enumerate(plan.param_grads)],
        "builtin_constraints": builtin,
        "range_constraints": ranges,
        "range_bindings": _bindings([c_expr for c_expr in [c.affine.c for c in plan.builtin_constraints]
                                     + [c.c for c in plan.mask.constraints]], variant),
        "spec_mask_code": None if spec_mask is None else printer(spec_mask),
        "mask_bindings": [] if spec_mask is None else _bindings([spec_mask], variant),
        "runtime_mask_from_spec": plan.mask.needs_block_mask,
        "builtin_mask_only": repr(spec_mask is None),
        "score_is_identity_py": repr(plan.score_is_identity),
        "gathers_by_position": repr(any(
            isinstance(n, ParamRef) and any(positional(i) for i in n.indices)
            for e in [plan.score, plan.variant.mask] for n in walk(e))),
        "f32_options": [n for n in f32[2:]],
        "i32_options": [n for n in i32[2:]],
        "params": [{"name": p.name, "dtype": p.dtype} for p in variant.params],
        "grad_params": [p.name for p in plan.grad_params],
    }
