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

import textwrap

from ejgen.emit.layout import WIDTH, reflow
from ejgen.emit.printer import Printer
from ejgen.emit.attention.common import (MAX_POSITIONAL_DIM, positional, positional_read_fits, range_constraints,
                                         scalar_layout)
from ejgen.emit.attention.intervals import mask_tiles_context
from ejgen.emit.attention.xla import JnpPrinter
from ejgen.errors import SpecError
from ejgen.ir.expr import Binary, Call, Const, Expr, ParamRef, Unary, Var, to_text, walk
from ejgen.ir.passes.separate import position_form, position_terms
from ejgen.plan.attention import AttentionPlan

DIM_CONSTEXPR = {"batch": "DIMS.B", "heads": "DIMS.HQ", "kv_heads": "DIMS.HKV", "q_len": "DIMS.SEQ_Q",
                 "kv_len": "DIMS.SEQ_K", "head_dim": "DIMS.D"}
# The kernels' constexprs in the order of their signatures (the host passes them by name).
KERNEL_DIMS = ["B", "HQ", "HKV", "SEQ_Q", "SEQ_K", "D", "DV", "D_PAD", "DV_PAD", "BLOCK_M", "BLOCK_N"]
KERNEL_FLAGS = ["CAUSAL", "WINDOW", "SOFTCAP", "SINKS", "N_SINKS", "SINKS_PAD", "BIAS_ON", "BIAS_BATCH", "BIAS_HEADS",
                "SEGMENTS", "DENSE", "MASK_BATCH", "MASK_HEADS", "MASK_BQ", "MASK_BK", "VARLEN", "RUNTIME_MASK", "TILE_RANGES", "TILE_BATCH",
                "TILE_HEADS", "TILE_LISTS", "TILE_COLS", "POSITIONS", "STAGED", "PLAIN", "PRECISION", "UPCAST",
                "TMA", "WS", "ATOMIC_DQ", "BAND", "BAND_BLOCKS", "BAND_TMA", "DQ_DELTA"]
NAMES = {"s": "s", "q_idx": "q_idx", "kv_idx": "kv_idx", "b": "off_b", "h": "off_h", "q_len": "q_len", "kv_len": "kv_len",
         "window_left": "window_left", "window_right": "window_right"}


def _integer_power(e: Binary) -> bool:
    """Whether ``a ** b`` has a constant integer exponent (printed as products, else `_pow`)."""
    b = e.b.x if isinstance(e.b, Unary) and e.b.op == "-" else e.b
    return isinstance(b, Const) and not isinstance(b.value, bool) and float(b.value).is_integer()


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
        "log2": "tl.log2",
        "exp2": "tl.exp2",
        "sign": "_sign",
    }

    def __init__(self, names, params, hoisted=None):
        super().__init__(names)
        self.params = params
        self.hoisted = hoisted or {}  # ParamRef -> the name it was loaded into before the key loop

    def int_op(self, e: Binary):
        """`_int_div` / `_int_mod` (Triton's own ``//`` and ``%`` on ints are C's)."""
        return f"{'_int_div' if e.op == '//' else '_int_mod'}({self(e.a)}, {self(e.b)})", 9

    def cast(self, fn, x):
        if fn == "float":
            return f"({self(x)}).to(tl.float32)"
        inner = {"floor": f"tl.floor({self(x)})", "ceil": f"tl.ceil({self(x)})", "round": f"_round({self(x)})",
                 "int": f"({self(x)})"}[fn]  # .to(tl.int32) of a float: toward zero
        return f"({inner}).to(tl.int32)"

    def call(self, e):
        if e.fn == "clamp":
            x, lo, hi = (self(a) for a in e.args)
            return f"tl.minimum(tl.maximum({x}, {lo}), {hi})"
        return super().call(e)

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
        """Python's ``a ** b``: a constant integer exponent by products (up to 4 inline, else `_ipow`), a
        negative one as their reciprocal, any other by `_pow` (exact signs for a negative base)."""
        if _integer_power(e):
            b, sign = (e.b.x, -1) if isinstance(e.b, Unary) and e.b.op == "-" else (e.b, 1)
            n, base = sign * int(b.value), f"({self(e.a)})"
            if n == 0:
                return "1.0"
            product = " * ".join([base] * abs(n)) if abs(n) <= 4 else f"_ipow({base}, {abs(n)})"
            return product if n > 0 else f"(1.0 / ({product}))"
        return f"_pow({self(e.a)}, {self(e.b)})"  # the exponent whole: its sign too

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
        if e in self.hoisted:
            return self.hoisted[e]
        return f"tl.load(PARAM_{e.name} + {self.flat(e)})"


def hoisted_params(exprs, printer: TlPrinter, varying=("s", "kv_idx")) -> list[str]:
    """Reads of params whose indices stay the same over a kernel's key loop (none of ``varying`` in them: in the
    decode kernel ``q_idx`` and ``off_h`` are the program's rows, fixed): each loaded once before the loop into
    ``param_<name>_<i>``, which ``printer`` prints from now on. A load inside the loop is a gather the software
    pipeline does not prefetch: ALiBi's slopes cost its decode 30% (notes/perf.md). Returns the loading lines."""
    lines, inside = [], set()  # inside: reads within a hoisted read's indices (loaded with it, not apart)
    for e in exprs:
        for n in walk(e):  # outer reads before the reads in their indices
            if not isinstance(n, ParamRef) or n in printer.hoisted or n in inside:
                continue
            if any(isinstance(x, Var) and x.name in varying for i in n.indices for x in walk(i)):
                continue
            name = f"param_{n.name}_{len(printer.hoisted)}"
            lines.append(f"{name} = {printer(n)}")
            printer.hoisted[n] = name
            inside |= {x for i in n.indices for x in walk(i) if isinstance(x, ParamRef)}
    return lines


def _dsl_helpers(plan) -> str:
    """The lib helpers the spec's expressions print (`TlPrinter`), for the kernels' import line ("" for none)."""
    used = set()
    for e in plan.kernel_exprs:
        for n in walk(e):
            if isinstance(n, Binary) and n.op == "**":
                used |= {"_ipow", "_pow"}
            elif isinstance(n, Binary) and n.op in ("//", "%"):
                used |= {"_int_div", "_int_mod"}
            elif isinstance(n, Call) and n.fn in ("round", "sign"):
                used.add(f"_{n.fn}")
    return ", ".join(sorted(used))


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
            f"{MAX_POSITIONAL_DIM} (here: {', '.join(str(d) for d in shape)}). If it is added to the score, drop the "
            f"param and enable `bias: runtime`: the call's `bias` [batch|1, heads|1, q_len, kv_len] has its gradient on "
            f"every backend; else list `backends: [xla]` for this spec",
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


def _kernel_params(plan: AttentionPlan) -> list:
    """The params the kernels read: all but those only the segment key reads (the op turns them into ids first)."""
    read = {n.name for e in plan.kernel_exprs for n in walk(e) if isinstance(n, ParamRef)}
    return [p for p in plan.variant.params if p.name in read or p.grad]


def gluon_mask(mask: Expr | None) -> bool:
    """Whether the Hopper kernels can call the spec's mask (`_spec_mask`, docs/DESIGN.md §6): there is one, it reads
    no param (they take none) and prints no `_pow` (whose tile of zeros needs a layout in Gluon)."""
    if mask is None:
        return False
    for n in walk(mask):
        if isinstance(n, ParamRef):
            return False
        if isinstance(n, Binary) and n.op == "**" and not _integer_power(n):
            return False
    return True


def divides_positions(mask: Expr | None) -> bool:
    """Whether the mask divides (``//``, ``%``) a position by a value known only at run time (an option, a length):
    integer divisions per element, whose temporaries the Hopper forward keeps within its registers by narrower key
    blocks (`gluon.host.fwd_key_tiles`)."""
    def reads(e, names):
        return any(isinstance(n, Var) and n.name in names for n in walk(e))

    return mask is not None and any(
        isinstance(n, Binary) and n.op in ("//", "%") and reads(n.a, ("q_idx", "kv_idx"))
        and any(isinstance(x, (Var, ParamRef)) for x in walk(n.b)) for n in walk(mask))


def position_terms_context(mask: Expr | None, variant, mask_options: list, i32_count: int) -> dict | None:
    """The Hopper kernels' form of a spec mask with costly one-position terms (`ir/passes/separate.position_terms`;
    docs/DESIGN.md §6): the terms as jax.numpy over the positions (triton_launch.py's `_position_terms`, formed once
    a call), the rest of the mask as Triton reading them (triton_kernels.py's `_spec_mask_terms`), and where the
    table starts in I32 (past its scalars and their marker, 16-byte aligned). None without such terms or where the
    Hopper kernels do not run the mask (`gluon_mask`)."""
    if not gluon_mask(mask):
        return None
    rest, terms = position_terms(mask)
    if not terms:
        return None
    # one table row per position form (`position_form`: a query-side and a key-side term of one form share it), in
    # the order key side only, both, query side only: the key side's rows [0, kv) are what the Hopper forward's
    # producer stages per key block, the query side's [q_first, rows) what the backward's stages per item
    forms = list(dict.fromkeys(position_form(t) for _, t in terms))
    sides = {f: {side for side, t in terms if position_form(t) == f} for f in forms}
    order = ([f for f in forms if sides[f] == {"kv"}] + [f for f in forms if len(sides[f]) == 2]
             + [f for f in forms if sides[f] == {"q"}])
    row = {f: r for r, f in enumerate(order)}
    kv = sum("kv" in sides[f] for f in order)
    q_first = sum(sides[f] == {"kv"} for f in order)
    q_rows = len(order) - q_first
    names = _names(variant)
    tl_printer = TlPrinter({**names, **{f"_t{i}": f"t{i}" for i in range(len(terms))}}, {})
    jnp_names = {"pos": "pos", "len": "seq"}  # q_len = kv_len on the Hopper set
    jnp_names.update({o.name: f'ctx["opt_{o.name}"]' for o in variant.options})
    jnp_printer = JnpPrinter(jnp_names, {})
    used = {f"opt_{n.name}" for n in walk(rest) if isinstance(n, Var) and n.kind == "option"}
    terms_ctx = []
    for side, t in terms:
        r = row[position_form(t)]
        terms_ctx.append({"index": "q_idx" if side == "q" else "kv_idx", "text": to_text(t), "row": r,
                          "staged": f"K[{r}]" if side == "kv" else f"Q[{r - q_first}]"})
    staged = 0 < kv <= 4  # the Hopper forward's staged form (`_spec_mask_staged`): at most 4 key-side rows
    return {
        "rest": rest,
        "rest_code": tl_printer(rest),
        "options": [(i, o) for i, o in enumerate(mask_options) if o in used],
        "count": len(mask_options),
        "at": -(-(i32_count + 1) // 4) * 4,  # I32's scalars and the marker `host._packed` appends
        "terms": terms_ctx,
        "rows": [{"text": to_text(f), "jnp": jnp_printer(f)} for f in order],  # in pos (a position) and len (S)
        "kv": kv if staged else 0,
        "q": list(range(q_first, len(order))),
        "q_first": q_first,
        # the Hopper backward's staged form: at most 4 query-side rows, given per item, with a staged key side
        "q_staged": q_rows if staged and 0 < q_rows <= 4 else 0,
    }


def template_context(plan: AttentionPlan) -> dict:
    variant = plan.variant
    params = {p.name: p for p in variant.params}
    printer = TlPrinter(_names(variant), params)
    f32, i32 = scalar_layout(variant)
    kernel_params = _kernel_params(plan)
    param_ptrs = "".join(f"PARAM_{p.name}, " for p in kernel_params)
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
    mask_bindings = [] if spec_mask is None else _bindings([spec_mask], variant)
    mask_options = [line.split(" = ", 1)[0] for line in mask_bindings]
    terms = position_terms_context(spec_mask, variant, mask_options, len(i32))
    return {
        "title": textwrap.fill(f"Triton kernels of `{plan.name}`: forward with lse; backward as a dK/dV and a dQ kernel.",
                               WIDTH - 3),
        "scalars": textwrap.fill(f"Runtime scalars live in two small arrays: F32 = [{', '.join(f32)}], "
                                 f"I32 = [{', '.join(i32)}].", WIDTH, break_on_hyphens=False),
        "param_ptrs": param_ptrs,  # "PARAM_a, PARAM_b, ": before more arguments
        "param_tail": "".join(f", PARAM_{p.name}" for p in kernel_params),  # ", PARAM_a, PARAM_b": after one
        "dparam_tail": "".join(f", DPARAM_{p.name}" for p in plan.grad_params),
        "kernel_constexprs": _kernel_constexprs(),
        "reflow": reflow,
        "dsl_helpers": _dsl_helpers(plan),
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
        "mask_bindings": mask_bindings,
        "mask_options": f"({mask_options[0]}, )" if len(mask_options) == 1 else f"({', '.join(mask_options)})",
        "mask_option_names": mask_options,
        "gluon_mask": repr(gluon_mask(spec_mask)),
        # the mask the Hopper kernels run: with position terms, the rest of it (`_spec_mask_terms`)
        "mask_divides": repr(divides_positions(terms["rest"] if terms else spec_mask)),
        "position_terms": terms,
        "runtime_mask_from_spec": plan.mask.needs_block_mask,
        "builtin_mask_only": repr(spec_mask is None),
        "mask_tiles": mask_tiles_context(spec_mask),
        "score_is_identity_py": repr(plan.score_is_identity),
        "gathers_by_position": repr(any(
            isinstance(n, ParamRef) and any(positional(i) for i in n.indices)
            for e in [plan.score, plan.element_mask] for n in walk(e))),
        "f32_options": [n for n in f32[2:]],
        "i32_options": [n for n in i32[2:]],
        "params": [{"name": p.name, "dtype": p.dtype} for p in kernel_params],
        "grad_params": [p.name for p in plan.grad_params],
    }


def decode_context(plan: AttentionPlan) -> dict:
    """Template data of the split-K decode kernel (`templates/attention/triton/decode_kernels.py.j2`): the spec's
    score and mask printed as in train mode, ``off_h`` and ``q_idx`` a column per query row (GQA packed)."""
    variant = plan.variant
    printer = TlPrinter(_names(variant), {p.name: p for p in variant.params})
    spec_mask = plan.spec_mask
    exprs = [plan.score] + ([spec_mask] if spec_mask is not None else [])
    f32, i32 = scalar_layout(variant)
    bindings = _bindings(exprs, variant)  # options first: a hoisted read may index by one
    bindings += hoisted_params(exprs, printer)
    return {
        "scalars": textwrap.fill(f"Runtime scalars: F32 = [{', '.join(f32)}], I32 = [{', '.join(i32)}].", WIDTH,
                                 break_on_hyphens=False),
        "param_tail": "".join(f", PARAM_{p.name}" for p in variant.params),
        "dsl_helpers": _dsl_helpers(plan),
        "score_is_identity": plan.score_is_identity,
        "score_code": printer(plan.score),
        "spec_mask_code": None if spec_mask is None else printer(spec_mask),
        "mask_bindings": bindings,
    }
