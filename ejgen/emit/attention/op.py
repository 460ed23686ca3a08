"""The files of one attention op: its glue (`op.py`: argument checks, kernel choice, custom_vjp)
and, per backend the spec lists, the modules rendered from that backend's templates."""

from __future__ import annotations

import textwrap
from typing import Callable

import attrs

from ejgen.emit.attention import pallas, triton, xla
from ejgen.emit.attention.describe import describe
from ejgen.emit.layout import WIDTH
from ejgen.plan.attention import AttentionPlan


@attrs.frozen
class Backend:
    """How one backend is emitted: its template context, and which module each template becomes
    (``module`` is the one the glue imports: forward, backward, choice of kernels)."""

    context: Callable[[AttentionPlan], dict]
    files: dict  # file name in the op's folder -> template
    module: str


BACKENDS = {
    "triton": Backend(triton.template_context, {
        "triton_kernels.py": "attention/triton/train_kernels.py.j2",
        "triton_launch.py": "attention/triton/train_launch.py.j2",
    }, "triton_launch"),
    "pallas": Backend(pallas.template_context, {"pallas.py": "attention/pallas/train.py.j2"}, "pallas"),
    "xla": Backend(xla.template_context, {"xla.py": "attention/xla/train.py.j2"}, "xla"),
}


def _docstring(plan: AttentionPlan, common: dict, signature: list[str]) -> str:
    doc = plan.variant.doc.strip().split("\n\n")
    lines = [textwrap.fill(common["summary"], WIDTH - 8), ""]
    if doc[1:]:
        lines += ["\n\n".join(textwrap.fill(p, WIDTH - 8) for p in doc[1:]), ""]
    lines.append(f"Generated from {common['spec_path']}; semantics of docs/DESIGN.md §3. Keyword arguments:")
    lines += [f"  {a}" for a in signature]
    return "\n".join(lines).rstrip()


def _feature_settings(plan: AttentionPlan) -> str:
    items = []
    for f in plan.variant.features:
        setting = ("value", f.value) if f.mode == "value" else f.mode
        items.append(f'"{f.name}": {setting!r}')
    return "{" + ", ".join(items) + "}"


def emit(plan: AttentionPlan, backends: list[str], common: dict, render: Callable[..., str]) -> dict[str, str]:
    """``{path: text}`` of the op's folder; ``render(template, **context)`` fills one template."""
    v = plan.variant
    signature = [a.name if a.default is None else f"{a.name}={a.default}" for a in plan.arguments if a.in_signature]
    files = {
        f"{v.name}/__init__.py": render("glue/op_init.py.j2", **common),
        f"{v.name}/op.py": render(
            "attention/op.py.j2",
            **common,
            notation=describe(plan),
            backends=[{"name": b, "module": BACKENDS[b].module} for b in backends],
            feature_settings=_feature_settings(plan),
            tensor_layout=v.layout,
            arguments={a.name: a.feature for a in plan.arguments if a.in_signature},
            absent=plan.absent_arguments,
            signature=signature,
            docstring=_docstring(plan, common, signature),
            prepare_args=[(a.name, a.passed) for a in plan.arguments if a.passed is not None],
            params=[{"name": p.name, "shape": repr(tuple(p.shape)), "dtype": p.dtype} for p in v.params],
            options=[{"name": o.name, "type": o.type} for o in v.options],
        ),
    }
    for name in backends:
        backend = BACKENDS[name]
        context = backend.context(plan)
        for file, template in backend.files.items():
            files[f"{v.name}/{file}"] = render(template, **common, **context)
    return files
