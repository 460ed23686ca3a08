"""The files of one attention op: its glue (`op.py`: argument checks, kernel choice, custom_vjp)
and, per backend the spec lists, the modules rendered from that backend's templates; and the files the ops of a
package share (``emit_shared``: the backend modules of the specs with no hooks of their own, rendered once per set of
built-in masks)."""

from __future__ import annotations

import re
import textwrap
from typing import Callable

import attrs

from ejgen.emit import shared
from ejgen.emit.attention import pallas, triton, xla
from ejgen.emit.attention.common import scalar_layout
from ejgen.emit.attention.describe import describe
from ejgen.emit.layout import WIDTH
from ejgen.ir.expr import Var, walk
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


def _ring_docstring(plan: AttentionPlan, common: dict) -> str:
    name = plan.variant.name
    text = (f"Ring attention form of `{name}` (docs/DESIGN.md §3, Ring attention): called inside jax.shard_map with "
            f"the sequence cut over mesh axis `axis_name` (query, key and value: this device's rows), or on global "
            f"arrays under a mesh context (`with jax.set_mesh(mesh):`), which it cuts over that axis itself. "
            f"Key/value blocks travel the ring (ppermute), partial results merge by lse in float32; on contiguous "
            f"shards the result is `{name}`'s on the whole sequence.\n\n"
            f"token_order: 'contiguous' (device d holds positions [d n, (d + 1) n)) or 'zigzag' (two chunks per "
            f"device, d and 2N - 1 - d: causal work balanced; lay inputs out with ejgen.ops.ring_permute). Keyword "
            f"arguments as `{name}`'s, without the mesh wrapper's; a ring does not take bias, block_mask, "
            f"positions, cu_seqlens or a dense attention_mask.")
    return "\n\n".join(textwrap.fill(p, WIDTH - 8) for p in text.split("\n\n"))


POSITIONS = {"q_idx", "kv_idx", "q_len", "kv_len"}


def _element_reads(plan: AttentionPlan) -> tuple:
    """The positions the kernels read: the score's, its derivatives' and the element mask's (the mask less its
    segment key, which the op computes before them)."""
    return tuple(sorted({n.name for e in plan.kernel_exprs for n in walk(e) if isinstance(n, Var) and n.kind == "builtin"}
                        & POSITIONS))


def _feature_settings(plan: AttentionPlan) -> str:
    items = []
    for f in plan.variant.features:
        setting = ("value", f.value) if f.mode == "value" else f.mode
        items.append(f'"{f.name}": {setting!r}')
    return "{" + ", ".join(items) + "}"


def emit(plan: AttentionPlan, backends: list[str], common: dict, render: Callable[..., str]) -> dict[str, str]:
    """``{path: text}`` of the op's folder; ``render(template, **context)`` fills one template."""
    v = plan.variant
    signed = [a for a in plan.arguments if a.in_signature]
    signature = [a.name if a.default is None else f"{a.name}={a.default}" for a in signed]
    files = {
        f"{v.name}/__init__.py": render("glue/op_init.py.j2", **common, from_op=[f"{v.name}_ring"],
                                            extra=decode_names(plan)),
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
            passed_on=[a.name for a in plan.arguments if a.in_signature and a.feature != "mesh"],
            index_reads=plan.index_reads(),
            position_reads=tuple(sorted(plan.names_used() & POSITIONS)),
            segment_key=xla.segment_key_context(plan),
            element_reads=_element_reads(plan),
            ring_signature=[s for a, s in zip(signed, signature) if a.feature != "mesh"],
            ring_docstring=_ring_docstring(plan, common),
            params=[{"name": p.name, "shape": repr(tuple(p.shape)), "dtype": p.dtype} for p in v.params],
            options=[{"name": o.name, "type": o.type} for o in v.options],
        ),
    }
    key = shared_key(plan)
    for name in backends:
        backend = BACKENDS[name]
        context = backend.context(plan)
        for file, template in backend.files.items():
            if key is not None and file in SHARED_FILES:
                continue  # emit_shared's
            files[f"{v.name}/{file}"] = render(template, **common, **context)
    modes = decode_modes(plan)
    if modes:
        args = [a for a in plan.arguments
                if a.in_signature and a.feature in DECODE_ARGUMENT_KINDS and a.name != "deterministic"]
        accepted = [a.name for a in args] + ["batch_invariant"]
        triton_ctx = triton.decode_context(plan) if "triton" in backends else None
        if triton_ctx is not None:
            files[f"{v.name}/triton_decode.py"] = render("attention/triton/decode_kernels.py.j2", **common,
                                                         **triton_ctx)
        f32, i32 = scalar_layout(v)
        files[f"{v.name}/decode.py"] = render(
            "attention/decode.py.j2",
            **common,
            triton=triton_ctx is not None,
            pallas="pallas" in backends,
            backends_tuple=repr(tuple(backends)),
            f32_options=repr(tuple(f32[2:])),
            i32_options=repr(tuple(i32[2:])),
            param_names=repr(tuple(p.name for p in v.params)),
            modes=[{**m, "doc": _decode_doc(m["doc"], v.name, accepted)} for m in modes],
            accepted=repr(tuple(accepted)),
            signature=[a.name if a.default is None else f"{a.name}={_decode_default(a)}" for a in args],
            prepare_args=[(a.name, a.passed) for a in plan.arguments
                          if a.passed is not None and a.feature in DECODE_ARGUMENT_KINDS],
            params=[{"name": p.name, "shape": repr(tuple(p.shape)), "dtype": p.dtype} for p in v.params],
            options=[{"name": o.name, "type": o.type} for o in v.options],
        )
    return files


# What a decode op takes: the spec's params and options, the built-in features that mean something for the last
# rows of a sequence, and the per-call arguments but `deterministic` (the decode kernels have one reduction order).
DECODE_ARGUMENT_KINDS = ("param", "option", "causal", "sliding_window", "logits_soft_cap", "sinks", "call")
DECODE_MODES = {
    "decode": {"suffix": "decode", "prepare": "prepare", "positional": ["key", "value", "sequence_start",
                                                                        "sequence_end"],
               "doc": "Ragged decode: query [B, Hq, D] or [B, Sq, Hq, D] (the last Sq positions of each sequence), "
                      "key/value [B, S, Hkv, D|Dv], sequence b = keys sequence_start[b] <= j < sequence_end[b]."},
    "paged": {"suffix": "paged", "prepare": "prepare_paged", "positional": ["key_cache", "value_cache",
                                                                           "context_lens", "block_tables"],
              "doc": "Paged decode: query [B, Hq, D] or [B, Sq, Hq, D], key_cache/value_cache [pages, page_size, "
                     "Hkv, D|Dv], token t of sequence b at (block_tables[b, t // page_size], t % page_size), "
                     "t < context_lens[b]."},
}


def decode_modes(plan: AttentionPlan) -> list[dict]:
    """The decode modes the spec lists, in DECODE_MODES order (each one's template data)."""
    return [DECODE_MODES[m] for m in DECODE_MODES if m in plan.variant.modes]


def exports(plan: AttentionPlan) -> list[str]:
    """The op's further functions its package exports: its ring form, then its decode modes."""
    return [f"{plan.variant.name}_ring"] + decode_names(plan)


def decode_names(plan: AttentionPlan) -> list[str]:
    """The decode ops the op's package exports (`<name>_decode`, `<name>_paged`)."""
    return [f"{plan.variant.name}_{m['suffix']}" for m in decode_modes(plan)]


def _decode_doc(doc: str, name: str, accepted: list) -> str:
    text = (f"{doc}\n\nKeyword arguments as `{name}` in train mode, less the train-only ones: {', '.join(accepted)} "
            f"(batch_invariant: a sequence's result bitwise the same whatever else is in the batch; Triton and Pallas).")
    return "\n\n".join(textwrap.fill(p, WIDTH - 8, subsequent_indent="    ") for p in text.split("\n\n")).replace(
        "\n\n", "\n\n    ")


def _decode_default(a) -> str:
    """Decode is causal by nature: a runtime causal flag defaults to on."""
    return "True" if a.name == "causal" else a.default


# The backend modules of a spec with no hooks of its own (identity score; no mask, params or options) read nothing of
# it but its name and the built-in masks it prints (causal, sliding window: constexpr-guarded code for each). Every
# such op of a package with the same masks binds its names to one module per file, SHARED_FOLDER/<masks>/<file>,
# rendered with the name SHARED_PREFIX_<masks>: the name profiles show (Triton names a kernel by its function, the
# Pallas kernels are named after NAME). The triton_launch.py of each op stays its own (it names the op's Layout).
SHARED_FOLDER = "_attention"
SHARED_PREFIX = "attention"
SHARED_FILES = ("triton_kernels.py", "pallas.py", "xla.py")
BUILTIN_MASKS = {"causal": "causal", "sliding_window": "window"}  # feature -> its word in a key


def shared_key(plan: AttentionPlan) -> str | None:
    """The built-in masks of a spec with no hooks of its own (`causal_window`, `causal`, ..., `unmasked`): its backend
    modules are the package's shared ones of that key; None for a spec with a score, mask, param or option."""
    v = plan.variant
    if not plan.score_is_identity or plan.spec_mask is not None or plan.segment_key is not None or v.params \
            or v.options:
        return None
    return "_".join(word for feature, word in BUILTIN_MASKS.items() if plan.has(feature)) or "unmasked"


def _bound_names(file: str, text: str, prefix: str) -> list[str]:
    """What an op's module takes from a shared one: the kernels (their names past the prefix) of `triton_kernels.py`;
    every top-level assignment of the others (the backend interface, `_KERNELS`, `__all__`)."""
    if file == "triton_kernels.py":
        return re.findall(rf"^def {prefix}_(\w+_kernel)\(", text, re.MULTILINE)
    return re.findall(r"^([A-Za-z_]\w*) = ", text, re.MULTILINE)


def _named(plan: AttentionPlan, name: str) -> AttentionPlan:
    """The plan under another name (what a context prints of the spec's name, the shared module's)."""
    return attrs.evolve(plan, variant=attrs.evolve(plan.variant, name=name))


def emit_shared(ops: list, render: Callable[..., str]) -> dict[str, str]:
    """``{path: text}`` of what the package's attention ops ``[(plan, backends, common)]`` share: for each key of
    `shared_key` some op has, ``SHARED_FOLDER/<key>/`` with the backend modules of ``SHARED_FILES`` those ops have,
    each rendered once, and each such op's module of that name, which binds the names the runtime and the op's glue
    look up to them; nothing where no op has a key. Each file is rendered from each sharing spec's own context and
    must come out the same: a template that reads more of a spec than `shared_key` says fails the build here rather
    than run another spec's kernels."""
    keyed = [(shared_key(plan), plan, backends, common) for plan, backends, common in ops]
    keyed = sorted((k for k in keyed if k[0] is not None), key=lambda k: (k[0], k[1].name))
    if not keyed:
        return {}

    def header(sharing):
        return shared.header([common for *_, common in sharing])

    files, keys = {}, {}
    for key in sorted({k[0] for k in keyed}):
        group = [k for k in keyed if k[0] == key]
        folder, prefix = f"{SHARED_FOLDER}/{key}", f"{SHARED_PREFIX}_{key}"
        keys[key] = [plan.name for _, plan, _, _ in group]
        modules = []
        for backend_name, backend in BACKENDS.items():
            for file, template in backend.files.items():
                sharing = [(plan, common) for _, plan, backends, common in group
                           if file in SHARED_FILES and backend_name in backends]
                if not sharing:
                    continue
                text = shared.rendered_once(
                    {plan.name: render(template, **header(group), **backend.context(_named(plan, prefix)), name=prefix)
                     for plan, _ in sharing}, file, template, f"all have no hooks and the built-in masks '{key}'",
                    "its masks", "emit/attention/op.py, shared_key")
                files[f"{folder}/{file}"] = text
                modules.append(file[:-len(".py")])
                names = _bound_names(file, text, prefix)
                for plan, common in sharing:
                    bound = ([(f"{plan.name}_{n}", f"{prefix}_{n}") for n in names] if file == "triton_kernels.py"
                             else [(n, n) for n in names])
                    files[f"{plan.name}/{file}"] = render("attention/shared_binding.py.j2", **common, folder=folder,
                                                          module=file[:-len(".py")], key=key, prefix=prefix,
                                                          bound=bound)
        files[f"{folder}/__init__.py"] = render("attention/shared_init.py.j2", **header(group), key=key,
                                                ops=keys[key], modules=modules, prefix=prefix)
    files[f"{SHARED_FOLDER}/__init__.py"] = render("attention/shared_init.py.j2", **header(keyed), key=None,
                                                   groups="; ".join(f"`{k}`: {', '.join(v)}" for k, v in keys.items()))
    return files
