"""The files of one recurrent op: its folder's ``__init__.py``, ``op.py`` (arguments, ``custom_vjp``), ``hooks.py``
(the spec's feature map and gate map in jnp, where it has either), ``decode.py`` and one module per backend
(docs/DESIGN.md §9); and the files the ops of a package share (``emit_shared``: the Triton kernels of the specs
without hooks, rendered once)."""

from __future__ import annotations

import re
import textwrap
from typing import Callable

from ejgen.emit import shared
from ejgen.emit.attention.op import Backend
from ejgen.emit.layout import WIDTH
from ejgen.emit.recurrent import triton
from ejgen.emit.recurrent.common import flags, has_hooks, jnp_hooks
from ejgen.emit.recurrent.describe import describe
from ejgen.plan.recurrent import RecurrentPlan

BACKENDS = {
    "triton": Backend(triton.template_context, {
        "triton_kernels.py": "recurrent/triton/kernels.py.j2",
        "triton_launch.py": "recurrent/triton/launch.py.j2",
    }, "triton_launch"),
    "pallas": Backend(flags, {"pallas.py": "recurrent/pallas/recurrent.py.j2"}, "pallas"),
    "xla": Backend(flags, {"xla.py": "recurrent/xla/recurrent.py.j2"}, "xla"),
}

# The Triton kernels of a spec without hooks read nothing of it (its gates and features are constexpr flags the host
# passes): every such op of a package binds its kernel names to one module, SHARED_FOLDER/triton_kernels.py, whose
# functions, named SHARED_PREFIX_<which>_kernel, are what profiles show (Triton names a kernel by its function).
SHARED_FOLDER = "_linear_recurrent"
SHARED_PREFIX = "linear_recurrent"
KERNELS_FILE, KERNELS_TEMPLATE = "triton_kernels.py", BACKENDS["triton"].files["triton_kernels.py"]

ARGUMENT_DOCS = {
    "g": "float [B, T, H]: a log gate per head and step",
    "g_gamma": "float [H]: a fixed log decay per head (learnable: it has a gradient)",
    "gk": "float [B, T, H, K]: a log gate per key channel",
    "gv": "float [B, T, H, V]: a log gate per value channel",
    "softmax_scale": "multiplies q (default K ** -0.5)",
    "initial_state": "float [N, H, K, V]: the state before the first step of each sequence (default zeros)",
    "reverse": "run each sequence from its last step to its first",
    "cu_seqlens": "int32 [N + 1]: q, k, v are packed sequences [1, T, ...], sequence n the steps cu[n] .. cu[n + 1] - 1",
    "algorithm": "auto (fused for short sequences, else chunked), chunked or fused",
    "chunk_size": "steps of a chunk of the chunked algorithm (16, 32, 64 or 128; default 64)",
    "platform": "auto (by device), triton, pallas or xla",
    "mesh": "a jax.sharding.Mesh: run the op under jax.shard_map over it, cut as in_specs say (a cut sequence runs "
            "the context-parallel form)",
    "in_specs": "PartitionSpecs of (query, key, value) [B, T, H, K | V] (or one for all three): batch, heads and "
                "the sequence may be cut; the gates, initial_state and cu_seqlens are cut as query",
    "out_specs": "derived (o as query, final_state [N, H, K, V] over batch and heads); when given, must be that",
    "axis_name": "the mesh axis the sequence is cut over (bound inside jax.shard_map, or an axis of the mesh in "
                 "scope for global arrays)",
}


def _docstring(plan: RecurrentPlan, common: dict, signature: list[str]) -> str:
    doc = plan.variant.doc.strip().split("\n\n")
    lines = [textwrap.fill(common["summary"], WIDTH - 8), ""]
    if doc[1:]:
        lines += ["\n\n".join(textwrap.fill(p, WIDTH - 8) for p in doc[1:]), ""]
    lines.append(textwrap.fill(f"Generated from {common['spec_path']}; semantics of docs/DESIGN.md §3 linear "
                               f"recurrent. Returns (o [B, T, H, V] in q's dtype, final_state [N, H, K, V] float32). "
                               f"Arguments:", WIDTH - 8))
    lines += [textwrap.fill(f"{a}: {ARGUMENT_DOCS[a.split('=')[0]]}", WIDTH - 8, initial_indent="  ",
                            subsequent_indent="      ") for a in signature]
    return "\n".join(lines).rstrip()


def _decode_docstring(plan: RecurrentPlan, common: dict, gates: list[str]) -> str:
    lines = [textwrap.fill(f"`{plan.name}` one step (or a few) from a given state: (o, new_state).", WIDTH - 8), ""]
    lines.append(textwrap.fill(
        f"Generated from {common['spec_path']}; semantics of docs/DESIGN.md §3 linear recurrent (decode). query [B, H, "
        f"K] (one step) or [B, S, H, K] (S steps), key / value [B, (S,) Hkv, K | V], state [B, H, K, V]; the gates "
        f"per step as the train op takes them, without the S axis for one step. Returns (o [B, (S,) H, V], new_state "
        f"[B, H, K, V] float32): the train op from initial_state=state on the fused recurrence. Arguments:",
        WIDTH - 8))
    lines += [textwrap.fill(f"{a}: {ARGUMENT_DOCS[a.split('=')[0]]}", WIDTH - 8, initial_indent="  ",
                            subsequent_indent="      ") for a in gates + ["softmax_scale=None", 'platform="auto"']]
    return "\n".join(lines)


def _cp_docstring(plan: RecurrentPlan, common: dict, positional: list[str]) -> str:
    lines = [textwrap.fill(f"`{plan.name}` with the sequence cut over mesh axis `axis_name` (context parallelism): "
                           f"(o, final_state) of the whole sequence.", WIDTH - 8), ""]
    lines.append(textwrap.fill(
        f"Generated from {common['spec_path']}; semantics of docs/DESIGN.md §3 linear recurrent, context parallelism. "
        f"Inside jax.shard_map, query, key, value and the per-step gates are this device's consecutive steps (device "
        f"d holds steps [d n, (d + 1) n) of every sequence); outside it, global arrays cut over axis_name of the mesh "
        f"in scope. Each device runs {plan.name} on its steps from a zero state; the states entering each device are "
        f"combined across the axis in float32 and their contribution added to its outputs. Returns (o [B, n, H, V] "
        f"of this device's steps in q's dtype, final_state [B, H, K, V] float32, the same on every device). Arguments "
        f"as {plan.name}'s (cu_seqlens refused), and:", WIDTH - 8))
    keywords = ["axis_name"] + [a.name for a in plan.arguments if a.feature == "choice"]
    lines += [textwrap.fill(f"{a}: {ARGUMENT_DOCS[a]}", WIDTH - 8, initial_indent="  ", subsequent_indent="      ")
              for a in keywords]
    return "\n".join(lines)


def exports(plan: RecurrentPlan) -> list[str]:
    """The op's further functions its package exports: its context-parallel form, then its decode mode."""
    return [plan.cp_name] + plan.decode_names


def emit(plan: RecurrentPlan, backends: list[str], common: dict, render: Callable[..., str]) -> dict[str, str]:
    """``{path: text}`` of the op's folder; ``render(template, **context)`` fills one template."""
    v = plan.variant
    signature = [f"{a.name}={a.default}" for a in plan.arguments]
    positional = [s for a, s in zip(plan.arguments, signature) if a.feature not in ("choice", "mesh")]
    files = {
        f"{v.name}/__init__.py": render("glue/op_init.py.j2", **common, from_op=[plan.cp_name],
                                        extra=plan.decode_names),
        f"{v.name}/op.py": render(
            "recurrent/op.py.j2",
            **common,
            notation=describe(plan),
            hooks=has_hooks(plan),
            backends=[{"name": b, "module": BACKENDS[b].module} for b in backends],
            feature_settings="{" + ", ".join(f'"{f.name}": "{f.mode}"' for f in v.features) + "}",
            arguments={a.name: a.feature for a in plan.arguments},
            absent=plan.absent_arguments,
            required=repr(plan.required),
            positional=positional,
            keywords=[s for s in signature if s not in positional],
            choices=[s for a, s in zip(plan.arguments, signature) if a.feature == "choice"],
            choice_names=[a.name for a in plan.arguments if a.feature == "choice"],
            docstring=_docstring(plan, common, signature),
            cp_docstring=_cp_docstring(plan, common, positional),
            prepare_args=[a.passed for a in plan.arguments if a.passed is not None],
            passed_on=[a.name for a in plan.arguments if a.feature != "mesh"],
            cp_passed=[a.name for a in plan.arguments if a.feature not in ("choice", "mesh")],
        ),
    }
    if has_hooks(plan):
        files[f"{v.name}/hooks.py"] = render("recurrent/hooks.py.j2", **common, **jnp_hooks(plan))
    if plan.decode_names:
        gates = [a for a in plan.arguments if a.feature in plan.gates]
        files[f"{v.name}/decode.py"] = render(
            "recurrent/decode.py.j2", **common, gates=[a.name for a in gates],
            docstring=_decode_docstring(plan, common, [f"{a.name}={a.default}" for a in gates]))
    for name in backends:
        backend = BACKENDS[name]
        context = backend.context(plan)
        for file, template in backend.files.items():
            if name == "triton" and file == KERNELS_FILE and shares_kernels(plan, backends):
                continue  # emit_shared's
            files[f"{v.name}/{file}"] = render(template, **common, **context)
    return files


def shares_kernels(plan: RecurrentPlan, backends: list[str]) -> bool:
    """The op's Triton kernels are the package's shared ones: it has Triton kernels and no hooks."""
    return "triton" in backends and not has_hooks(plan)


def emit_shared(ops: list, render: Callable[..., str]) -> dict[str, str]:
    """``{path: text}`` of what the package's recurrent ops ``[(plan, backends, common)]`` share: where any has no
    hooks, ``SHARED_FOLDER`` (its ``__init__.py`` and the kernels, rendered once) and each such op's
    ``triton_kernels.py``, which binds the names the host looks up (``<name>_<which>_kernel``) to them; nothing
    where none. The kernels are rendered from each sharing spec's own context, and must come out the same: a
    template that reads more of a spec than its hooks fails the build here rather than run another spec's kernels."""
    sharing = [(plan, common) for plan, backends, common in ops if shares_kernels(plan, backends)]
    if not sharing:
        return {}
    header = shared.header([common for _, common in sharing])
    kernels = shared.rendered_once(
        {plan.name: render(KERNELS_TEMPLATE, **header, **triton.template_context(plan), name=SHARED_PREFIX)
         for plan, _ in sharing}, "Triton kernels", KERNELS_TEMPLATE, "none has hooks", "its hooks",
        "emit/recurrent/op.py, shares_kernels")
    which = re.findall(rf"^def {SHARED_PREFIX}_(\w+)_kernel\(", kernels, re.MULTILINE)
    names = [plan.name for plan, _ in sharing]
    files = {
        f"{SHARED_FOLDER}/__init__.py": render("recurrent/shared_init.py.j2", **header, ops=names),
        f"{SHARED_FOLDER}/{KERNELS_FILE}": kernels,
    }
    for plan, common in sharing:
        files[f"{plan.name}/{KERNELS_FILE}"] = render("recurrent/triton/shared_kernels.py.j2", **common,
                                                      folder=SHARED_FOLDER, prefix=SHARED_PREFIX, kernels=which)
    return files
