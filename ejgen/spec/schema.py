"""Validation of a spec's fields and construction of the ``Variant`` (docs/DESIGN.md §2).

Every check reports a ``SpecError`` at the offending YAML value or key. ``score`` and ``mask`` are
parsed here but not type-checked; that is ``ejgen.ir.passes.typecheck``.
"""

from __future__ import annotations

import difflib
import keyword
import math
import re

from ejgen.errors import Loc, SpecError
from ejgen.ir.expr import FUNCS, INDEX_VARS, Const, Expr, Var
from ejgen.ir.variant import (
    BACKENDS,
    DIMS,
    FAMILIES,
    FEATURES,
    LAYOUTS,
    MODES,
    OP_ARGUMENTS,
    OPTION_TYPES,
    PARAM_DTYPES,
    POOLING_FEATURES,
    POOLING_FIELDS,
    RECURRENT_FEATURES,
    RECURRENT_FIELDS,
    RECURRENT_MODES,
    RECURRENT_OP_ARGUMENTS,
    REDUCTIONS,
    WEIGHTED_REDUCTIONS,
    Feature,
    Option,
    Param,
    PoolingVariant,
    RecurrentVariant,
    Variant,
)
from ejgen.spec.dsl import parse_expr
from ejgen.spec.yaml_loader import Node, scalar_source

FIELDS = (
    "name", "family", "doc", "modes", "backends", "layout", "features", "params", "options", "score", "mask",
)  # fmt: skip
REQUIRED = ("name", "family")
PARAM_FIELDS = ("shape", "dtype", "grad")
OPTION_FIELDS = ("type", "default")

DSL_KEYWORDS = ("and", "or", "not", "true", "false")

_RESERVED = {
    **{n: "a built-in argument of the op" for n in OP_ARGUMENTS},
    **{n: "a DSL function" for n in FUNCS},
    **{n: "a built-in name of the DSL" for n in INDEX_VARS},
    **{n: "a DSL keyword" for n in DSL_KEYWORDS},
}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def build_variant(root: Node, *, path: str, source_hash: str) -> Variant | PoolingVariant | RecurrentVariant:
    """The ``Variant`` a spec's YAML tree describes, expressions parsed but not yet typed; a ``PoolingVariant``
    for family pooling and a ``RecurrentVariant`` for family linear_recurrent, whose fields are their own
    (``POOLING_FIELDS``, ``RECURRENT_FIELDS``)."""
    if root.value is None:
        raise SpecError("the spec is empty; it needs at least 'name' and 'family'", root.loc)
    family = _mapping(root, "the spec").get("family")
    if family is not None and _choice(family, FAMILIES, "family") == "pooling":
        return _pooling_variant(root, path=path, source_hash=source_hash)
    if family is not None and family.value == "linear_recurrent":
        return _recurrent_variant(root, path=path, source_hash=source_hash)
    fields = _fields(root, FIELDS, "field", "the spec")
    _require(fields, REQUIRED, "the spec", root.loc)
    name = _identifier(_string(fields["name"], "name"), fields["name"].loc, "the spec name")
    family = _choice(fields["family"], FAMILIES, "family")
    doc = _string(fields["doc"], "doc") if "doc" in fields else ""
    modes = _choices(fields.get("modes"), MODES, "modes", "mode", default=("train",))
    backends = _choices(fields.get("backends"), BACKENDS, "backends", "backend", default=BACKENDS)
    layout = _choice(fields["layout"], LAYOUTS, "layout") if "layout" in fields else LAYOUTS[0]
    features = _features(fields.get("features"))
    if layout == "bhsd" and any(f.name == "varlen" for f in features):
        raise SpecError("layout bhsd cannot take feature 'varlen' (packed tokens are [tokens, heads, dim]); use the "
                        "default layout bshd, or segment ids", fields["layout"].loc)
    params = _entries(fields.get("params"), "params", _param)
    options = _entries(fields.get("options"), "options", _option)
    _check_distinct(params, options)
    score = _expr(fields.get("score"), "score", default=Var("s"))
    mask = _expr(fields.get("mask"), "mask", default=Const(True))
    return Variant(
        name=name,
        family=family,
        doc=doc,
        modes=modes,
        backends=backends,
        layout=layout,
        features=features,
        params=params,
        options=options,
        score=score,
        mask=mask,
        path=path,
        source_hash=source_hash,
        loc=fields["name"].loc,
    )


def _pooling_variant(root: Node, *, path: str, source_hash: str) -> PoolingVariant:
    """A pooling spec (docs/DESIGN.md §2 pooling): name, doc, backends, the reduction and the features."""
    for key, loc in root.key_locs.items():
        if key in FIELDS and key not in POOLING_FIELDS:
            raise SpecError(f"field '{key}' is an attention field; a pooling spec has none", loc,
                            hint=f"pooling fields: {', '.join(POOLING_FIELDS)}")
    fields = _fields(root, POOLING_FIELDS, "field", "a pooling spec")
    _require(fields, REQUIRED, "the spec", root.loc)
    name = _identifier(_string(fields["name"], "name"), fields["name"].loc, "the spec name")
    reduction = _choice(fields["reduction"], REDUCTIONS, "reduction") if "reduction" in fields else "mean"
    features = ()
    if "features" in fields:
        node = fields["features"]
        entries = _fields(node, tuple(POOLING_FEATURES), "feature", "features")
        found = [_feature(key, value, node.key_locs[key]) for key, value in entries.items()]
        features = tuple(sorted((f for f in found if f is not None), key=lambda f: f.name))
    for f in features:
        if f.name == "weights" and reduction not in WEIGHTED_REDUCTIONS:
            weighing = " or ".join(WEIGHTED_REDUCTIONS)
            raise SpecError(f"feature 'weights' needs a reduction that weighs tokens ({weighing}); reduction "
                            f"'{reduction}' selects them", f.loc,
                            hint="use feature 'mask' to leave tokens out of a max or last-token pooling")
    return PoolingVariant(
        name=name,
        family="pooling",
        doc=_string(fields["doc"], "doc") if "doc" in fields else "",
        backends=_choices(fields.get("backends"), BACKENDS, "backends", "backend", default=BACKENDS),
        reduction=reduction,
        features=features,
        path=path,
        source_hash=source_hash,
        loc=fields["name"].loc,
    )


def _recurrent_variant(root: Node, *, path: str, source_hash: str) -> RecurrentVariant:
    """A linear recurrent spec (docs/DESIGN.md §2 linear recurrent): name, doc, backends, the gates and shapes as
    features, and the element-wise hooks feature_map and gate_map (DSL expressions of x, typed at load)."""
    others = {"attention": FIELDS, "pooling": POOLING_FIELDS}
    for key, loc in root.key_locs.items():
        owner = next((f for f, fields in others.items() if key in fields), None)
        if key not in RECURRENT_FIELDS and owner is not None:
            raise SpecError(f"field '{key}' is {'an' if owner == 'attention' else 'a'} {owner} field; a "
                            f"linear_recurrent spec has none", loc, hint=f"linear_recurrent fields: "
                            f"{', '.join(RECURRENT_FIELDS)}")
    fields = _fields(root, RECURRENT_FIELDS, "field", "a linear_recurrent spec")
    _require(fields, REQUIRED, "the spec", root.loc)
    name = _identifier(_string(fields["name"], "name"), fields["name"].loc, "the spec name")
    if name in RECURRENT_OP_ARGUMENTS:
        raise SpecError(f"the spec name '{name}' clashes with a built-in argument of the op", fields["name"].loc)
    features = ()
    if "features" in fields:
        node = fields["features"]
        entries = _fields(node, tuple(RECURRENT_FEATURES), "feature", "features")
        found = [_feature(key, value, node.key_locs[key]) for key, value in entries.items()]
        features = tuple(sorted((f for f in found if f is not None), key=lambda f: f.name))
    modes = _choices(fields.get("modes"), RECURRENT_MODES, "modes", "mode", default=("train",))
    if "train" not in modes:
        raise SpecError("modes must list train: a recurrent op's decode mode is its train op from a given state",
                        fields["modes"].loc, hint="modes: [train, decode]")
    return RecurrentVariant(
        name=name,
        family="linear_recurrent",
        doc=_string(fields["doc"], "doc") if "doc" in fields else "",
        backends=_choices(fields.get("backends"), BACKENDS, "backends", "backend", default=BACKENDS),
        features=features,
        feature_map=_expr(fields.get("feature_map"), "feature_map", default=None),
        gate_map=_expr(fields.get("gate_map"), "gate_map", default=None),
        path=path,
        source_hash=source_hash,
        map_texts=tuple((f, " ".join(scalar_source(fields[f])[0].split())) for f in ("feature_map", "gate_map")
                        if f in fields),
        modes=modes,
        loc=fields["name"].loc,
    )


def _fields(node: Node, allowed: tuple, noun: str, owner: str) -> dict:
    """The entries of a mapping whose keys must be in ``allowed``."""
    entries = _mapping(node, owner)
    for key in entries:
        if key not in allowed:
            raise SpecError(
                f"unknown {noun} '{key}'{_suggestion(key, allowed)}",
                node.key_locs[key],
                hint=f"known {noun}s: {', '.join(allowed)}",
            )
    return entries


def _mapping(node: Node, owner: str) -> dict:
    if not node.is_mapping:
        raise SpecError(f"{owner} must be a mapping, got {_kind(node)}", node.loc)
    return node.value


def _require(fields: dict, required: tuple, owner: str, loc: Loc) -> None:
    for name in required:
        if name not in fields:
            raise SpecError(f"{owner} is missing the required field '{name}'", loc)


def _string(node: Node, what: str) -> str:
    if not isinstance(node.value, str):
        raise SpecError(f"{what} must be a string, got {_kind(node)}", node.loc)
    return node.value


def _bool(node: Node, what: str) -> bool:
    if not isinstance(node.value, bool):
        raise SpecError(f"{what} must be true or false, got {_kind(node)}", node.loc)
    return node.value


def _choice(node: Node, allowed: tuple, what: str) -> str:
    value = _string(node, what)
    if value not in allowed:
        raise SpecError(
            f"unknown {what} '{value}'{_suggestion(value, allowed)}",
            node.loc,
            hint=f"one of: {', '.join(allowed)}",
        )
    return value


def _choices(node: Node | None, allowed: tuple, field: str, item: str, *, default: tuple) -> tuple:
    if node is None:
        return tuple(default)
    if not node.is_sequence or not node.value:
        raise SpecError(f"{field} must be a non-empty list, got {_kind(node)}", node.loc)
    chosen = []
    for entry in node.value:
        value = _choice(entry, allowed, item)
        if value in chosen:
            raise SpecError(f"{item} '{value}' is listed twice in {field}", entry.loc)
        chosen.append(value)
    return tuple(chosen)


def _identifier(name: str, loc: Loc, what: str) -> str:
    if not _IDENTIFIER.fullmatch(name):
        raise SpecError(
            f"{what} '{name}' is not an identifier",
            loc,
            hint="use letters, digits and underscores, not starting with a digit",
        )
    if keyword.iskeyword(name):
        raise SpecError(f"{what} '{name}' is a Python keyword", loc)
    if name in _RESERVED:
        raise SpecError(f"{what} '{name}' clashes with {_RESERVED[name]}", loc)
    return name


def _features(node: Node | None) -> tuple:
    if node is None:
        return ()
    entries = _fields(node, tuple(FEATURES), "feature", "features")
    features = [_feature(name, value, node.key_locs[name]) for name, value in entries.items()]
    return tuple(sorted((f for f in features if f is not None), key=lambda f: f.name))


def _feature(name: str, node: Node, key_loc: Loc) -> Feature | None:
    """One feature setting; ``None`` for a flag set to false (the feature is absent)."""
    value = node.value
    if value == "runtime":
        return Feature(name, "runtime", loc=key_loc)
    if name == "sliding_window":
        return Feature(name, "value", _window(node), loc=key_loc)
    if name == "logits_soft_cap":
        return Feature(name, "value", _soft_cap(node), loc=key_loc)
    if value == "always" or value is True:
        return Feature(name, "always", loc=key_loc)
    if value is False:
        return None
    expected = f"feature '{name}' takes 'runtime', 'always', true or false"
    raise _bad_setting(node, expected, ("runtime", "always"))


def _window(node: Node) -> tuple:
    if _is_int(node.value):
        if node.value <= 0:
            raise SpecError(f"sliding_window must be positive, got {node.value}", node.loc)
        return (node.value, node.value)
    if not node.is_sequence:
        raise _bad_setting(node, "sliding_window takes 'runtime', a positive int or [left, right]")
    if len(node.value) != 2:
        count = len(node.value)
        raise SpecError(f"sliding_window [left, right] needs 2 ints, got {count}", node.loc)
    for side in node.value:
        if not _is_int(side.value) or side.value < 0:
            message = f"a window side must be a non-negative int, got {_kind(side)}"
            raise SpecError(message, side.loc)
    return tuple(side.value for side in node.value)


def _soft_cap(node: Node) -> float:
    value = node.value
    if _is_number(value) and math.isfinite(value) and value > 0:
        return float(value)
    raise _bad_setting(node, "logits_soft_cap takes 'runtime' or a positive number")


def _bad_setting(node: Node, expected: str, words: tuple = ("runtime",)) -> SpecError:
    """A wrong feature setting, with a suggestion when it is a misspelt word."""
    close = _suggestion(node.value, words) if isinstance(node.value, str) else ""
    return SpecError(f"{expected}, got {_kind(node)}{close}", node.loc)


def _entries(node: Node | None, what: str, build) -> tuple:
    """``build(name, value node, key location)`` for each entry of the mapping ``what``, in spec order."""
    if node is None:
        return ()
    entries = _mapping(node, what)
    return tuple(build(name, value, node.key_locs[name]) for name, value in entries.items())


def _param(name: str, node: Node, key_loc: Loc) -> Param:
    _identifier(name, key_loc, "param name")
    owner = f"param '{name}'"
    fields = _fields(node, PARAM_FIELDS, "field", owner)
    _require(fields, ("shape",), owner, key_loc)
    dtype = _choice(fields["dtype"], PARAM_DTYPES, "dtype") if "dtype" in fields else "float32"
    grad = _bool(fields["grad"], "grad") if "grad" in fields else False
    if grad and dtype == "int32":
        raise SpecError(f"{owner} has dtype int32 and cannot have grad: true", fields["grad"].loc)
    return Param(name, _shape(fields["shape"]), dtype, grad, loc=key_loc)


def _shape(node: Node) -> tuple:
    if not node.is_sequence or not node.value:
        raise SpecError(f"shape must be a non-empty list of dims, got {_kind(node)}", node.loc)
    dims = []
    for dim in node.value:
        if _is_int(dim.value) and dim.value > 0:
            dims.append(dim.value)
        elif isinstance(dim.value, str):
            dims.append(_choice(dim, DIMS, "dim"))
        else:
            message = f"a dim must be a dim name or a positive int, got {_kind(dim)}"
            raise SpecError(message, dim.loc)
    return tuple(dims)


def _option(name: str, node: Node, key_loc: Loc) -> Option:
    _identifier(name, key_loc, "option name")
    owner = f"option '{name}'"
    fields = _fields(node, OPTION_FIELDS, "field", owner)
    _require(fields, OPTION_FIELDS, owner, key_loc)
    type_ = _choice(fields["type"], OPTION_TYPES, "type")
    return Option(name, type_, _default(fields["default"], type_, owner), loc=key_loc)


def _default(node: Node, type_: str, owner: str):
    value = node.value
    if type_ == "bool" and isinstance(value, bool):
        return value
    if type_ == "int" and _is_int(value):
        return value
    if type_ == "float" and _is_number(value):
        return float(value)
    article = "an" if type_ == "int" else "a"
    message = f"the default of {owner} must be {article} {type_}, got {_kind(node)}"
    raise SpecError(message, node.loc)


def _check_distinct(params: tuple, options: tuple) -> None:
    for option in options:
        for param in params:
            if option.name == param.name:
                later = max(option, param, key=lambda x: (x.loc.line, x.loc.col))
                raise SpecError(f"'{option.name}' is both a param and an option", later.loc)


def _expr(node: Node | None, field: str, *, default: Expr | None) -> Expr | None:
    if node is None:
        return default
    if not node.is_scalar or node.value is None:
        raise SpecError(f"{field} must be an expression, got {_kind(node)}", node.loc)
    text, loc = scalar_source(node)
    return parse_expr(text, loc, source_lines=node.source.lines)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _suggestion(word: str, choices: tuple) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def _kind(node: Node) -> str:
    """How a YAML value reads in a message."""
    value = node.value
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"a bool ({'true' if value else 'false'})"
    if isinstance(value, int):
        return f"an int ({value})"
    if isinstance(value, float):
        return f"a float ({value})"
    if isinstance(value, str):
        return f"a string ('{value}')" if len(value) <= 40 else "a long string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__} ({node.raw})"
