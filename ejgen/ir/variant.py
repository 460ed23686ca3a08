"""The variant IR: what one spec describes, after loading and validation.

A ``Variant`` is what the spec loader (``ejgen.spec``) produces and every later pass consumes.
"""

from __future__ import annotations

import attrs

from ejgen.errors import Loc
from ejgen.ir.expr import Expr

FAMILIES = ("attention", "linear_recurrent", "pooling")
MODES = ("train", "decode", "paged")
BACKENDS = ("triton", "pallas", "xla")
LAYOUTS = ("bshd", "bhsd")  # the op's tensor layout: [batch, seq, heads, dim] (the default) or [batch, heads, seq, dim]
DIMS = ("batch", "heads", "kv_heads", "q_len", "kv_len", "head_dim")
PARAM_DTYPES = ("float32", "bfloat16", "float16", "int32")
OPTION_TYPES = ("int", "float", "bool")

# Attention features and the settings each accepts (docs/DESIGN.md §2):
#   "runtime": a keyword argument of the op (tensors: optional; flags: default off);
#   "always":  compiled in and on; the op takes no argument (tensors: the argument is required);
#   a value:   compiled in (sliding_window: int or [left, right]; logits_soft_cap: float).
FEATURES = {
    "causal": ("runtime", "always"),
    "sliding_window": ("runtime", "value"),
    "logits_soft_cap": ("runtime", "value"),
    "sinks": ("runtime", "always"),
    "gqa": ("runtime", "always"),
    "segment_ids": ("runtime", "always"),
    "attention_mask": ("runtime", "always"),
    "bias": ("runtime", "always"),
    "varlen": ("runtime", "always"),
    "block_mask": ("runtime", "always"),
    "positions": ("runtime", "always"),
}

# The attention op's built-in keyword arguments, in signature order, with the feature that enables
# each (docs/DESIGN.md §3, calling convention). The one definition: the spec schema reserves these
# names, the planner builds each op's signature from them, the runtime names the feature in errors.
FEATURE_ARGUMENTS = (
    ("causal", ("causal",)),
    ("sliding_window", ("sliding_window",)),
    ("logits_soft_cap", ("logits_soft_cap",)),
    ("sinks", ("softmax_aux",)),
    ("bias", ("bias",)),
    (("segment_ids", "attention_mask"), ("mask_info",)),
    ("block_mask", ("block_mask",)),
    ("positions", ("q_positions", "kv_positions")),
    ("varlen", ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")),
)
TENSOR_ARGUMENTS = ("query", "key", "value")
CALL_ARGUMENTS = ("softmax_scale", "deterministic", "platform", "return_lse")  # every op, last
# every op, after them: the call under shard_map (DESIGN.md §4); token_order: a cut sequence's (ring attention, §3)
MESH_ARGUMENTS = ("mesh", "in_specs", "out_specs", "token_order")
RING_ARGUMENTS = ("axis_name",)  # the ring form's own (`<name>_ring`, docs/DESIGN.md §3), besides token_order
OP_ARGUMENTS = (TENSOR_ARGUMENTS + tuple(a for _, args in FEATURE_ARGUMENTS for a in args) + CALL_ARGUMENTS
                + MESH_ARGUMENTS + RING_ARGUMENTS)

# The pooling family (docs/DESIGN.md §3 pooling): a spec chooses the reduction over each sequence's tokens and
# which per-token inputs the op takes. Features take "runtime" or "always" (true), as attention's flags do.
REDUCTIONS = ("mean", "sum", "max", "last")
POOLING_FIELDS = ("name", "family", "doc", "backends", "reduction", "features")
POOLING_FEATURES = {
    "varlen": ("runtime", "always"),  # packed x [T, D] with cu_seqlens [N + 1]
    "weights": ("runtime", "always"),  # per-token float weights [B, S] / [T] (mean and sum)
    "mask": ("runtime", "always"),  # per-token bool mask [B, S] / [T]: tokens to pool
}
WEIGHTED_REDUCTIONS = ("mean", "sum")  # the reductions that weigh tokens (max and last only select them)
# The pooling op's signature, defined once: x, then chunk_size and cu_seqlens positional or keyword (the seed's
# `mean_pooling(x, chunk_size=32, cu_seqlens=None)`), then the features' tensors and the call's arguments.
POOLING_FEATURE_ARGUMENTS = (
    ("varlen", ("cu_seqlens",)),
    ("weights", ("weights",)),
    ("mask", ("mask",)),
)
POOLING_TENSOR_ARGUMENTS = ("x",)
POOLING_CALL_ARGUMENTS = ("chunk_size", "platform")
POOLING_OP_ARGUMENTS = (POOLING_TENSOR_ARGUMENTS + POOLING_CALL_ARGUMENTS
                        + tuple(a for _, args in POOLING_FEATURE_ARGUMENTS for a in args))

# The linear recurrent family (docs/DESIGN.md §3 linear recurrent): each gate is a feature (runtime: an optional
# argument; always: a required one; absent: not an argument), gqa permits fewer key/value heads than query heads,
# varlen takes packed sequences. Two optional element-wise hooks, DSL expressions of `x` (RECURRENT_MAP_VARS):
# feature_map on q and k, gate_map on the per-step gates (g, gk, gv) before they act.
RECURRENT_FIELDS = ("name", "family", "doc", "modes", "backends", "features", "feature_map", "gate_map")
RECURRENT_MODES = ("train", "decode")  # decode: <name>_decode, one step (or a few) from a given state
RECURRENT_GATES = ("g", "g_gamma", "gk", "gv")
STEP_GATES = ("g", "gk", "gv")  # the gates given per step, which gate_map transforms (g_gamma is per head)
RECURRENT_FEATURES = {
    "g": ("runtime", "always"),  # g [B, T, H]: a log gate per head and step
    "g_gamma": ("runtime", "always"),  # g_gamma [H]: a fixed log decay per head
    "gk": ("runtime", "always"),  # gk [B, T, H, K]: a log gate per key channel
    "gv": ("runtime", "always"),  # gv [B, T, H, V]: a log gate per value channel
    "gqa": ("runtime", "always"),  # key and value heads shared by groups of query heads (H % Hkv == 0)
    "varlen": ("runtime", "always"),  # packed sequences: batch 1 and cu_seqlens [N + 1]
}
RECURRENT_MAP_VARS = ("x",)
# The recurrent op's signature, defined once (the seed's order): query, key, value, the gates, then softmax_scale,
# initial_state, reverse and cu_seqlens, positional or keyword; then keyword-only the call's choices.
RECURRENT_TENSOR_ARGUMENTS = ("query", "key", "value")
RECURRENT_FEATURE_ARGUMENTS = (
    ("g", ("g",)),
    ("g_gamma", ("g_gamma",)),
    ("gk", ("gk",)),
    ("gv", ("gv",)),
    ("softmax_scale", ("softmax_scale",)),  # every op (the "call" rows: no feature brings them)
    ("initial_state", ("initial_state",)),
    ("reverse", ("reverse",)),
    ("varlen", ("cu_seqlens",)),
)
RECURRENT_CALL_ARGUMENTS = ("softmax_scale", "initial_state", "reverse")
RECURRENT_CHOICE_ARGUMENTS = ("algorithm", "chunk_size", "platform")  # keyword-only, every op
RECURRENT_MESH_ARGUMENTS = ("mesh", "in_specs", "out_specs")  # keyword-only, every op: the call under shard_map
RECURRENT_CP_ARGUMENTS = ("axis_name",)  # the context-parallel form's own (`<name>_cp`, docs/DESIGN.md §3)
RECURRENT_OP_ARGUMENTS = (RECURRENT_TENSOR_ARGUMENTS + tuple(a for _, args in RECURRENT_FEATURE_ARGUMENTS for a in args)
                          + RECURRENT_CHOICE_ARGUMENTS + RECURRENT_MESH_ARGUMENTS + RECURRENT_CP_ARGUMENTS)


@attrs.frozen
class Feature:
    """One built-in feature. ``mode`` is ``"runtime"``, ``"always"`` or ``"value"``.

    ``value`` is the compiled-in value for ``mode == "value"``: ``(left, right)`` ints for
    sliding_window, a float for logits_soft_cap; ``None`` otherwise. ``causal: true`` and
    ``gqa: true`` load as ``"always"``.
    """

    name: str
    mode: str
    value: object = None
    loc: Loc | None = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class Param:
    """An extra tensor input. ``shape`` holds dim names (``DIMS``) or ints."""

    name: str
    shape: tuple
    dtype: str = "float32"
    grad: bool = False
    loc: Loc | None = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class Option:
    """An extra runtime scalar keyword argument."""

    name: str
    type: str  # "int" | "float" | "bool"
    default: bool | int | float
    loc: Loc | None = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class Variant:
    name: str
    family: str
    doc: str
    modes: tuple
    backends: tuple
    features: tuple  # of Feature, sorted by name
    params: tuple  # of Param, in spec order
    options: tuple  # of Option, in spec order
    score: Expr
    mask: Expr
    path: str  # the spec's path as given to the loader (relative where it was relative)
    source_hash: str  # sha256 hex of the spec file's bytes
    layout: str = "bshd"  # LAYOUTS
    loc: Loc | None = attrs.field(default=None, eq=False, repr=False)

    def feature(self, name: str) -> Feature | None:
        for f in self.features:
            if f.name == name:
                return f
        return None

    def feature_names(self) -> set[str]:
        return {f.name for f in self.features}

    def param(self, name: str) -> Param | None:
        for p in self.params:
            if p.name == name:
                return p
        return None

    def option(self, name: str) -> Option | None:
        for o in self.options:
            if o.name == name:
                return o
        return None


@attrs.frozen
class PoolingVariant:
    """A pooling spec (family ``pooling``): the reduction and the per-token inputs the op takes. ``features`` holds
    ``Feature``s of ``POOLING_FEATURES`` (mode ``runtime`` or ``always``), sorted by name."""

    name: str
    family: str
    doc: str
    backends: tuple
    reduction: str  # REDUCTIONS
    features: tuple  # of Feature, sorted by name
    path: str
    source_hash: str
    loc: Loc | None = attrs.field(default=None, eq=False, repr=False)

    def feature(self, name: str) -> Feature | None:
        for f in self.features:
            if f.name == name:
                return f
        return None

    def feature_names(self) -> set[str]:
        return {f.name for f in self.features}


@attrs.frozen
class RecurrentVariant:
    """A linear recurrent spec (family ``linear_recurrent``): the gates and shapes the op takes (``features``,
    ``Feature``s of ``RECURRENT_FEATURES`` with mode ``runtime`` or ``always``, sorted by name) and the element-wise
    hooks, expressions of ``x`` (typed by ``ir.passes.typecheck.check_recurrent``; None when the spec has none)."""

    name: str
    family: str
    doc: str
    backends: tuple
    features: tuple  # of Feature, sorted by name
    feature_map: Expr | None  # phi(x) on every element of q and k
    gate_map: Expr | None  # on every element of the per-step gates (STEP_GATES) the call passes
    path: str
    source_hash: str
    map_texts: tuple = ()  # (field, DSL text as written) of each hook, for notation blocks
    modes: tuple = ("train",)  # RECURRENT_MODES
    loc: Loc | None = attrs.field(default=None, eq=False, repr=False)

    def feature(self, name: str) -> Feature | None:
        for f in self.features:
            if f.name == name:
                return f
        return None

    def feature_names(self) -> set[str]:
        return {f.name for f in self.features}
