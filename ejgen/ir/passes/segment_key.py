"""Segment keys: a conjunct ``F == G`` of a spec's mask whose one side reads only the query's token and the other
only the key's is an equality of per-token ids (docs/DESIGN.md §5, Segment keys).

Llama 4's chunks (``q_idx // chunk == kv_idx // chunk``), Flamingo's images (``kv_idx // image_tokens ==
latest[b, q_idx]``) and the dilated window's residues (``q_idx % dilation == kv_idx % dilation``, as
`separate.py` writes ``(q_idx - kv_idx) % dilation == 0``) say: query ``i`` sees key ``j`` only where
``F(i) == G(j)``. The op computes ``F`` at every query and ``G`` at every key once per call (O(S), in XLA),
encodes both as segment ids (`ejgen.runtime.attention.segment_key`), and the conjunct leaves the element mask: the
kernels skip and fill tiles by the ids' per-tile ranges, and where the rest of the mask is causal / the window (or
nothing) the Hopper kernels, which take segment ids, run the spec.

A side may read its own position, ``b``, ``q_len``, ``kv_len``, options, constants and int params indexed by such
expressions; no ``h`` (the ids are per token, shared by every head), no float anywhere in it (the ids must be the
values the kernels would compute, bit for bit: integer arithmetic only), and at least one side reads its position.
The first conjunct that qualifies becomes the key; the others stay in the element mask.
"""

from __future__ import annotations

import attrs

from ejgen.ir.expr import Binary, Const, Expr, ParamRef, Type, Var, to_text, walk
from ejgen.ir.passes.mask import conjuncts

QUERY_SIDE = frozenset({"q_idx", "b", "q_len", "kv_len"})
KEY_SIDE = frozenset({"kv_idx", "b", "q_len", "kv_len"})


@attrs.frozen
class SegmentKey:
    """``query == key``: ``query`` computed per query token, ``key`` per key token. ``base``: the side whose values
    the ids are offset from, one that reads no param ("key" or "query"; its values span what its positions' integer
    arithmetic spans), or None when both read params (the ids are then ranks of the values: exact for any)."""

    query: Expr
    key: Expr
    base: str | None
    source: Expr  # the conjunct

    def text(self) -> str:
        return to_text(self.source)


def _builtins(e: Expr) -> set[str]:
    return {n.name for n in walk(e) if isinstance(n, Var) and n.kind == "builtin"}


def _one_side(e: Expr, allowed: frozenset) -> bool:
    """Whether ``e`` is computed per token of one side: only ``allowed`` built-ins, integer and boolean values."""
    return _builtins(e) <= allowed and all(n.ty is not Type.FLOAT for n in walk(e))


def _reads_param(e: Expr) -> bool:
    return any(isinstance(n, ParamRef) for n in walk(e))


def key_of(term: Expr) -> SegmentKey | None:
    """The segment key ``term`` is, or None: an ``==`` of a query side and a key side (either order)."""
    if not (isinstance(term, Binary) and term.op == "==" and term.a.ty in (Type.INT, Type.BOOL)):
        return None
    for query, key in ((term.a, term.b), (term.b, term.a)):
        if not (_one_side(query, QUERY_SIDE) and _one_side(key, KEY_SIDE)):
            continue
        if "q_idx" not in _builtins(query) and "kv_idx" not in _builtins(key):
            continue  # neither side reads a position: a per-call condition, not ids
        base = "key" if not _reads_param(key) else "query" if not _reads_param(query) else None
        return SegmentKey(query, key, base, term)
    return None


def split(mask: Expr) -> tuple[SegmentKey | None, Expr]:
    """(the mask's segment key, the rest of the mask: its other conjuncts, ``true`` when none), or (None, mask)."""
    terms = conjuncts(mask)
    for i, term in enumerate(terms):
        found = key_of(term)
        if found is None:
            continue
        rest = None
        for other in terms[:i] + terms[i + 1:]:
            if isinstance(other, Const) and other.value is True:
                continue
            rest = other if rest is None else Binary("and", rest, other, ty=Type.BOOL)
        return found, Const(True, ty=Type.BOOL) if rest is None else rest
    return None, mask
