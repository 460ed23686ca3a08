"""The files of one attention op: its glue (`op.py`: argument checks, kernel choice, custom_vjp)
and, per backend the spec lists, the modules rendered from that backend's templates."""

from __future__ import annotations

import textwrap
from typing import Callable

import attrs

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
    for name in backends:
        backend = BACKENDS[name]
        context = backend.context(plan)
        for file, template in backend.files.items():
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
