"""Rendering: plans in, ``{relative path: text}`` out. Nothing here touches the file system
except reading templates (see ``ejgen.writer`` for writing)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import jinja2

from ejgen.backends import pallas, triton, xla
from ejgen.describe import describe
from ejgen.errors import SpecError
from ejgen.ir.plan import AttentionPlan, plan_attention

EMITTED_BACKENDS = ("triton", "pallas", "xla")  # backends with templates

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("ejgen", "templates"),
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
    autoescape=False,
)


def _summary(doc: str) -> str:
    first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    return first or "attention variant"


def _signature(plan: AttentionPlan) -> tuple[list[str], list[tuple[str, str]]]:
    """Keyword arguments of the op, and what it passes on to ``prepare``."""
    sig = [p.name for p in plan.variant.params]
    prep: list[tuple[str, str]] = []

    def feature(name, arg, default):
        mode = plan.mode(name)
        if mode == "runtime":
            sig.append(f"{arg}={default}")
            prep.append((arg, arg))
        elif mode == "always":
            sig.append(arg)
            prep.append((arg, arg))

    causal = plan.mode("causal")
    if causal == "runtime":
        sig.append("causal=False")
        prep.append(("causal", "causal"))
    elif causal == "always":
        prep.append(("causal", "True"))
    for name, arg in (("sliding_window", "sliding_window"), ("logits_soft_cap", "logits_soft_cap")):
        f = plan.features.get(name)
        if f is not None and f.mode == "value":
            prep.append((arg, repr(f.value)))
        elif f is not None:
            feature(name, arg, "None")
    feature("sinks", "softmax_aux", "None")
    feature("bias", "bias", "None")
    modes = {plan.mode("segment_ids"), plan.mode("attention_mask")} - {None}
    if modes:
        always = "always" in modes
        sig.append("mask_info" if always else "mask_info=None")
        prep.append(("mask_info", "mask_info"))
    if plan.has("varlen"):
        always = plan.mode("varlen") == "always"
        for arg in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"):
            sig.append(arg if always else f"{arg}=None")
            prep.append((arg, arg))
    sig += [f"{o.name}={o.default!r}" for o in plan.variant.options]
    sig += ["softmax_scale=None", 'platform="auto"', "return_lse=False"]
    prep.append(("softmax_scale", "softmax_scale"))
    return sig, prep


def _docstring(plan: AttentionPlan, sig: list[str]) -> str:
    v = plan.variant
    lines = [_summary(v.doc), ""]
    rest = v.doc.strip().split("\n\n")[1:]
    if rest:
        lines += ["\n\n".join(rest), ""]
    lines.append(f"Generated from {_spec_path(v.path)}; semantics of DESIGN §3. Keyword arguments:")
    lines += [f"  {a}" for a in sig]
    return "\n".join(lines).rstrip()


def _feature_settings(plan: AttentionPlan) -> str:
    items = []
    for f in plan.variant.features:
        setting = ("value", f.value) if f.mode == "value" else f.mode
        items.append(f'"{f.name}": {setting!r}')
    return "{" + ", ".join(items) + "}"


def _spec_path(path: str) -> str:
    """The spec's path as ``<folder>/<file>``: stable wherever the build runs."""
    p = Path(os.path.abspath(path))
    return f"{p.parent.name}/{p.name}" if p.parent.name else p.name


def render_op(plan: AttentionPlan) -> dict[str, str]:
    v = plan.variant
    sig, prep = _signature(plan)
    common = {
        "name": v.name,
        "spec_path": _spec_path(v.path),
        "spec_hash": v.source_hash,
        "summary": _summary(v.doc),
    }
    backends = [b for b in v.backends if b in EMITTED_BACKENDS]
    if not backends:
        raise SpecError(f"spec '{v.name}' names no backend that can be emitted yet "
                        f"(emitted: {', '.join(EMITTED_BACKENDS)})", v.loc)
    accepted = [a.split("=")[0] for a in sig]
    op = _ENV.get_template("glue/op.py.j2").render(
        **common,
        notation=describe(plan),
        backends=[{"name": b, "module": "triton_launch" if b == "triton" else b} for b in backends],
        feature_settings=_feature_settings(plan),
        accepted=accepted,
        signature=sig,
        docstring=_docstring(plan, sig),
        prepare_args=prep,
        params=[{"name": p.name, "shape": repr(tuple(p.shape)), "dtype": p.dtype} for p in v.params],
        options=[{"name": o.name, "type": o.type} for o in v.options],
    )
    files = {
        f"{v.name}/__init__.py": _ENV.get_template("glue/op_init.py.j2").render(**common),
        f"{v.name}/op.py": op,
    }
    if "triton" in backends:
        ctx = triton.template_context(plan)
        files[f"{v.name}/triton_kernels.py"] = _ENV.get_template("triton/kernels.py.j2").render(**common, **ctx)
        files[f"{v.name}/triton_launch.py"] = _ENV.get_template("triton/launch.py.j2").render(**common, **ctx)
    if "pallas" in backends:
        files[f"{v.name}/pallas.py"] = _ENV.get_template("pallas/attention.py.j2").render(
            **common, **pallas.template_context(plan))
    if "xla" in backends:
        files[f"{v.name}/xla.py"] = _ENV.get_template("xla/attention.py.j2").render(**common, **xla.template_context(plan))
    return files


def render(variants) -> dict[str, str]:
    """All files of the generated package, keyed by path relative to its root."""
    plans = [plan_attention(v) for v in sorted(variants, key=lambda v: v.name)]
    files: dict[str, str] = {}
    for plan in plans:
        files.update(render_op(plan))
    digest = hashlib.sha256("".join(p.variant.source_hash for p in plans).encode()).hexdigest()
    folder = _spec_path(plans[0].variant.path).split("/")[0] + "/" if plans else "(no specs)"
    files["__init__.py"] = _ENV.get_template("glue/package_init.py.j2").render(
        spec_path=folder if len(plans) != 1 else _spec_path(plans[0].variant.path),
        spec_hash=digest,
        ops=[{"name": p.name, "summary": _summary(p.variant.doc)} for p in plans],
    )
    return {path: _tidy(text) for path, text in sorted(files.items())}


def _tidy(text: str) -> str:
    """No trailing spaces, exactly one final newline."""
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines()) + "\n"
