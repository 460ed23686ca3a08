"""``ejgen show --call``: parse a call written as Python source, with tensors as ``dtype[dims]``,
and report which kernels it would take (``ejgen.runtime.core.kernels.explain``). Nothing is evaluated:
the source is read with ``ast`` and only literals, ``dtype[dims]`` and the two mask helpers are
accepted."""

from __future__ import annotations

import ast
import importlib

from ejgen.errors import BuildError

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "f16": "float16", "float16": "float16",
          "f32": "float32", "float32": "float32", "int32": "int32", "i32": "int32", "bool": "bool"}


def _value(node: ast.AST, source: str):
    import jax
    import jax.numpy as jnp

    from ejgen.types import MaskInfo

    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in DTYPES:
        dims = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        try:
            shape = tuple(ast.literal_eval(d) for d in dims)
        except ValueError:
            shape = None
        if shape is None or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise BuildError(f"show --call: dims of {ast.get_source_segment(source, node)} must be non-negative ints")
        return jax.ShapeDtypeStruct(shape, jnp.dtype(DTYPES[node.value.id]))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("segments", "mask"):
        parts = [_value(a, source) for a in node.args]
        if node.func.id == "segments" and len(parts) in (1, 2):
            return MaskInfo(q_segment_ids=parts[0], kv_segment_ids=parts[-1])
        if node.func.id == "mask" and len(parts) == 1:
            return MaskInfo(attention_mask=parts[0])
        raise BuildError("show --call: segments(q_ids[, kv_ids]) or mask(bool[B,1|H,Sq,Sk])")
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise BuildError(f"show --call: {ast.get_source_segment(source, node)!r} is neither a literal nor "
                         f"dtype[dims] (dtypes: {', '.join(sorted(DTYPES))})") from None


def explain_call(source: str, package: str, target: str | None) -> str:
    from ejgen.runtime.core.kernels import explain

    try:
        tree = ast.parse(source.strip(), mode="eval").body
    except SyntaxError as e:
        raise BuildError(f"show --call: not a call: {e.msg} at column {e.offset}") from None
    if not isinstance(tree, ast.Call) or not isinstance(tree.func, ast.Name):
        raise BuildError("show --call: write it as op_name(arg, ..., keyword=value, ...)")
    try:
        module = importlib.import_module(package)
    except ImportError as e:
        raise BuildError(f"show --call: cannot import package {package!r}: {e}") from None
    op = getattr(module, tree.func.id, None)
    if not callable(op):
        raise BuildError(f"show --call: {package} has no op {tree.func.id!r}")
    args = [_value(a, source) for a in tree.args]
    kwargs = {k.arg: _value(k.value, source) for k in tree.keywords}
    try:
        choice = explain(op, *args, target=target, **kwargs)
    except (TypeError, ValueError, RuntimeError) as e:
        raise BuildError(f"show --call: {e}") from None
    return f"{ast.unparse(tree)}\n{choice.text()}"
