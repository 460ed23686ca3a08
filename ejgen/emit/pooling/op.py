"""The files of one pooling op: its folder's ``__init__.py``, ``op.py`` (arguments, ``custom_vjp``) and one
module per backend (docs/DESIGN.md §9)."""

from __future__ import annotations

import textwrap
from typing import Callable

from ejgen.emit.attention.op import Backend
from ejgen.emit.layout import WIDTH
from ejgen.emit.pooling import pallas, triton, xla
from ejgen.emit.pooling.describe import describe
from ejgen.plan.pooling import PoolingPlan

BACKENDS = {
    "triton": Backend(triton.template_context, {
        "triton_kernels.py": "pooling/triton/kernels.py.j2",
        "triton_launch.py": "pooling/triton/launch.py.j2",
    }, "triton_launch"),
    "pallas": Backend(pallas.template_context, {"pallas.py": "pooling/pallas/pool.py.j2"}, "pallas"),
    "xla": Backend(xla.template_context, {"xla.py": "pooling/xla/pool.py.j2"}, "xla"),
}
POSITIONAL = ("chunk_size", "cu_seqlens")  # the seed's order: mean_pooling(x, chunk_size=32, cu_seqlens=None)

ARGUMENT_DOCS = {
    "chunk_size": "tokens a kernel loads per step (a power of two from 1 to 512; its tile, not a semantic)",
    "cu_seqlens": "int32 [N + 1]: x is packed tokens [T, D], sequence n its rows cu[n] .. cu[n + 1] - 1",
    "weights": "float [B, S] ([T] with cu_seqlens): each token's weight",
    "mask": "bool [B, S] ([T] with cu_seqlens): the tokens to pool",
    "platform": "auto (by device), triton, pallas or xla",
}


def _docstring(plan: PoolingPlan, common: dict, signature: list[str]) -> str:
    doc = plan.variant.doc.strip().split("\n\n")
    lines = [textwrap.fill(common["summary"], WIDTH - 8), ""]
    if doc[1:]:
        lines += ["\n\n".join(textwrap.fill(p, WIDTH - 8) for p in doc[1:]), ""]
    lines.append(f"Generated from {common['spec_path']}; semantics of docs/DESIGN.md §3 pooling. Arguments:")
    lines += [f"  {a}: {ARGUMENT_DOCS[a.split('=')[0]]}" for a in signature]
    return "\n".join(lines).rstrip()


def emit(plan: PoolingPlan, backends: list[str], common: dict, render: Callable[..., str]) -> dict[str, str]:
    """``{path: text}`` of the op's folder; ``render(template, **context)`` fills one template."""
    v = plan.variant
    signature = [f"{a.name}={a.default}" for a in plan.arguments]
    positional = [s for a, s in zip(plan.arguments, signature) if a.name in POSITIONAL]
    files = {
        f"{v.name}/__init__.py": render("glue/op_init.py.j2", **common, extra=[]),
        f"{v.name}/op.py": render(
            "pooling/op.py.j2",
            **common,
            notation=describe(plan),
            reduction=v.reduction,
            backends=[{"name": b, "module": BACKENDS[b].module} for b in backends],
            feature_settings="{" + ", ".join(f'"{f.name}": "{f.mode}"' for f in v.features) + "}",
            arguments={a.name: a.feature for a in plan.arguments},
            absent=plan.absent_arguments,
            required=repr(plan.required),
            positional=positional,
            keywords=[s for s in signature if s not in positional],
            docstring=_docstring(plan, common, signature),
            prepare_args=[a.passed for a in plan.arguments if a.passed is not None],
        ),
    }
    for name in backends:
        backend = BACKENDS[name]
        context = backend.context(plan)
        for file, template in backend.files.items():
            files[f"{v.name}/{file}"] = render(template, **common, **context)
    return files
