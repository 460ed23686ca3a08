"""Reading spec files: YAML with positions, field validation, the DSL, and the type check.

``load_spec`` returns a ``Variant`` whose ``score`` and ``mask`` are typed and resolved; every
problem is a ``SpecError`` pointing into the file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ejgen.errors import SpecError
from ejgen.ir.passes import typecheck
from ejgen.ir.variant import PoolingVariant, RecurrentVariant, Variant
from ejgen.spec.dsl import parse_expr
from ejgen.spec.schema import build_variant
from ejgen.spec.yaml_loader import load_yaml

__all__ = ["load_spec", "load_specs", "parse_expr"]

SPEC_SUFFIXES = (".yaml", ".yml")


def load_spec(path) -> Variant | PoolingVariant | RecurrentVariant:
    """Load, validate and type-check one spec file."""
    path = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise SpecError(f"cannot read spec {path}: {e.strerror}") from None
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark is not part of the first line
    except UnicodeDecodeError as e:
        raise SpecError(f"{path}: not UTF-8 text (byte {e.start})") from None
    root = load_yaml(path, text)
    variant = build_variant(root, path=path, source_hash=hashlib.sha256(data).hexdigest())
    if isinstance(variant, Variant):
        return typecheck.check(variant)
    if isinstance(variant, RecurrentVariant):
        return typecheck.check_recurrent(variant)  # its hooks
    return variant  # pooling specs have no DSL


def load_specs(directory) -> list[Variant]:
    """Load every ``*.yaml`` / ``*.yml`` file of a directory, in file-name order.

    Two specs with the same ``name`` are an error at the second one's name.
    """
    folder = Path(directory)
    if not folder.is_dir():
        raise SpecError(f"not a directory: {directory}")
    paths = sorted(
        (p for p in folder.iterdir() if p.suffix in SPEC_SUFFIXES and p.is_file()),
        key=lambda p: p.name,
    )
    variants, seen = [], {}
    for p in paths:
        variant = load_spec(p)
        if variant.name in seen:
            first = seen[variant.name]
            raise SpecError(
                f"spec name '{variant.name}' is already used by {first.path}",
                variant.loc,
                hint="every spec needs its own name: it names the generated module",
            )
        seen[variant.name] = variant
        variants.append(variant)
    return variants
