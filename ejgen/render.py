"""Rendering: specs in, ``{relative path: text}`` out, driven by the registry of families. Nothing
here touches the file system except reading templates (``ejgen.writer`` writes).

A family is a planner (``ejgen.plan.<family>``) and an emitter (``ejgen.emit.<family>.op``) whose
``BACKENDS`` name the templates of each backend (``ejgen/templates/<family>/<backend>/``); adding
a family adds one entry to ``FAMILIES`` (docs/DESIGN.md §9). What several of a family's ops would repeat but
for their names its ``shared`` step renders once per package, in a folder ``_<family>/`` (docs/DESIGN.md §5,
shared folders).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

import attrs
import jinja2

from ejgen.emit.attention import op as attention_op
from ejgen.emit.attention.describe import describe as describe_attention
from ejgen.emit.layout import reflow
from ejgen.emit.pooling import op as pooling_op
from ejgen.emit.pooling.describe import describe as describe_pooling
from ejgen.emit.recurrent import op as recurrent_op
from ejgen.emit.recurrent.describe import describe as describe_recurrent
from ejgen.errors import SpecError
from ejgen.plan.attention import plan_attention
from ejgen.plan.pooling import plan_pooling
from ejgen.plan.recurrent import plan_recurrent


@attrs.frozen
class Family:
    plan: Callable  # Variant -> plan (with ``.variant``)
    emit: Callable  # (plan, backends, common, render) -> {path: text}
    describe: Callable  # plan -> its notation block (`ejgen show`, the op's docstring)
    backends: tuple  # the backends it has templates for
    exports: Callable = lambda plan: []  # plan -> the op's further functions the package exports (decode modes)
    # [(plan, backends, common)] of the family's ops in the package, render -> the files they share (and those of
    # their own folders that point at them, which ``emit`` leaves out)
    shared: Callable = lambda ops, render: {}


FAMILIES = {
    "attention": Family(plan_attention, attention_op.emit, describe_attention, tuple(attention_op.BACKENDS),
                        attention_op.exports, attention_op.emit_shared),
    "pooling": Family(plan_pooling, pooling_op.emit, describe_pooling, tuple(pooling_op.BACKENDS)),
    "linear_recurrent": Family(plan_recurrent, recurrent_op.emit, describe_recurrent, tuple(recurrent_op.BACKENDS),
                               recurrent_op.exports, recurrent_op.emit_shared),
}

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("ejgen", "templates"),
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
    autoescape=False,
)


def _template(template: str, /, **context) -> str:
    return _ENV.get_template(template).render(**context)


def _summary(doc: str, family: str) -> str:
    first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    return first or ("attention variant" if family == "attention" else f"{family} op")


def _spec_path(path: str) -> str:
    """The spec's path as ``<folder>/<file>``: stable wherever the build runs."""
    p = Path(os.path.abspath(path))
    return f"{p.parent.name}/{p.name}" if p.parent.name else p.name


def _family(variant) -> Family:
    family = FAMILIES.get(variant.family)
    if family is None:
        raise SpecError(f"family '{variant.family}' cannot be built yet: only {', '.join(map(repr, FAMILIES))} "
                        f"has kernels", variant.loc)
    return family


def plan(variant):
    """The plan of one variant, by its family's planner."""
    return _family(variant).plan(variant)


def describe(variant_plan) -> str:
    """The notation block of a plan, by its family's describer."""
    return _family(variant_plan.variant).describe(variant_plan)


def _backends(variant_plan) -> list[str]:
    """The backends of the spec that its family can emit; at least one."""
    v = variant_plan.variant
    family = _family(v)
    backends = [b for b in v.backends if b in family.backends]
    if not backends:
        raise SpecError(f"spec '{v.name}' names no backend that can be emitted yet "
                        f"(emitted: {', '.join(family.backends)})", v.loc)
    return backends


def _common(variant_plan) -> dict:
    v = variant_plan.variant
    return {"name": v.name, "spec_path": _spec_path(v.path), "spec_hash": v.source_hash,
            "summary": _summary(v.doc, v.family)}


def render_op(variant_plan) -> dict[str, str]:
    """The files of one op's folder, but those its family's ``shared`` step writes."""
    return _family(variant_plan.variant).emit(variant_plan, _backends(variant_plan), _common(variant_plan), _template)


def _shared(plans) -> dict[str, str]:
    """The files each family's ops share, by the family's ``shared`` step: nothing where no op of the package
    shares (so that a build without such ops writes no shared folder, and the writer drops an old one)."""
    files: dict[str, str] = {}
    for name, family in FAMILIES.items():
        ops = [(p, _backends(p), _common(p)) for p in plans if p.variant.family == name]
        if ops:
            files.update(family.shared(ops, _template))
    return files


def render(variants) -> dict[str, str]:
    """All files of the generated package, keyed by path relative to its root."""
    plans = [plan(v) for v in sorted(variants, key=lambda v: v.name)]
    files: dict[str, str] = {}
    for p in plans:
        files.update(render_op(p))
    shared = _shared(plans)
    for path in sorted(set(shared) & set(files)):
        op = next(p.variant for p in plans if p.variant.name == path.split("/")[0])
        raise SpecError(f"spec '{op.name}' is named like the package's folder of shared kernels "
                        f"('{path.split('/')[0]}'); rename it", op.loc)
    files.update(shared)
    digest = hashlib.sha256("".join(p.variant.source_hash for p in plans).encode()).hexdigest()
    folder = _spec_path(plans[0].variant.path).split("/")[0] + "/" if plans else "(no specs)"
    files["__init__.py"] = _template(
        "glue/package_init.py.j2",
        spec_path=folder if len(plans) != 1 else _spec_path(plans[0].variant.path),
        spec_hash=digest,
        ops=[{"name": p.variant.name, "summary": _summary(p.variant.doc, p.variant.family),
              "extra": _family(p.variant).exports(p)} for p in plans],
    )
    return {path: _tidy(path, text) for path, text in sorted(files.items())}


def _tidy(path: str, text: str) -> str:
    """No trailing spaces, exactly one final newline; Python wrapped within ``emit.layout.WIDTH`` columns."""
    text = "\n".join(line.rstrip() for line in text.rstrip().splitlines())
    return (reflow(text) if path.endswith(".py") else text) + "\n"
