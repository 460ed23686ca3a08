"""YAML with source positions.

``load_yaml`` composes a document with PyYAML's safe loader and turns the node graph into a tree
of ``Node``: a plain Python value (scalar, list of ``Node``, or dict of ``str`` to ``Node``) paired
with the ``Loc`` where it starts. Duplicate mapping keys, tags other than YAML's own and syntax
errors are ``SpecError``.
"""

from __future__ import annotations

import bisect
import re

import attrs
import yaml
from yaml.constructor import SafeConstructor

from ejgen.errors import Loc, SpecError

# PyYAML's line breaks (YAML 1.1); ``str.splitlines`` knows more and would shift line numbers.
_LINE_BREAK = re.compile("\r\n|[\n\r\x85\u2028\u2029]")
_MAP_TAG = "tag:yaml.org,2002:map"
_SEQ_TAG = "tag:yaml.org,2002:seq"


@attrs.frozen
class Source:
    """The text of one spec file and where each of its lines starts."""

    path: str
    text: str
    lines: tuple  # of str, without line breaks
    line_starts: tuple  # of int, the index in ``text`` where each line starts

    @classmethod
    def from_text(cls, path: str, text: str) -> "Source":
        lines, starts, pos = [], [0], 0
        for m in _LINE_BREAK.finditer(text):
            lines.append(text[pos : m.start()])
            pos = m.end()
            starts.append(pos)
        lines.append(text[pos:])
        return cls(path, text, tuple(lines), tuple(starts))

    def loc(self, line0: int, col0: int) -> Loc:
        """The ``Loc`` of a 0-based line and column."""
        text = self.lines[line0] if 0 <= line0 < len(self.lines) else ""
        return Loc(self.path, line0 + 1, col0 + 1, text)

    def loc_at(self, index: int) -> Loc:
        """The ``Loc`` of a character index into ``text``."""
        line0 = bisect.bisect_right(self.line_starts, index) - 1
        return self.loc(line0, index - self.line_starts[line0])


@attrs.frozen(eq=False)
class Node:
    """A YAML value with its position.

    ``value`` is a Python scalar (str, int, float, bool, None, ...), a list of ``Node`` or a dict of
    ``str`` to ``Node``. For mappings, ``key_locs`` holds the position of every key. For scalars,
    ``raw`` is the scalar's text before type resolution (``true`` stays ``"true"``), ``style``
    its YAML style (``None`` plain, ``'`` ``"`` ``|`` ``>``) and ``span`` its character range in
    the file.
    """

    value: object
    loc: Loc
    source: Source = attrs.field(repr=False)
    key_locs: dict = attrs.field(factory=dict, repr=False)
    raw: str | None = attrs.field(default=None, repr=False)
    style: str | None = attrs.field(default=None, repr=False)
    span: tuple = attrs.field(default=(0, 0), repr=False)

    @property
    def is_mapping(self) -> bool:
        return isinstance(self.value, dict)

    @property
    def is_sequence(self) -> bool:
        return isinstance(self.value, list)

    @property
    def is_scalar(self) -> bool:
        return self.raw is not None


def load_yaml(path: str, text: str) -> Node:
    """Parse one YAML document; an empty document is a null scalar at line 1, column 1."""
    source = Source.from_text(path, text)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is None:
            return Node(None, source.loc(0, 0), source, raw="")
        return _Builder(source).build(root)
    except yaml.MarkedYAMLError as e:
        raise _syntax_error(source, e) from None
    except yaml.reader.ReaderError as e:
        raise SpecError(f"invalid YAML: {e.reason}", source.loc_at(e.position)) from None


def _syntax_error(source: Source, e: yaml.MarkedYAMLError) -> SpecError:
    mark = e.problem_mark or e.context_mark
    loc = source.loc(mark.line, mark.column) if mark else None
    problem, context = e.problem or e.context or "not YAML", e.context
    if context and problem.startswith("but "):
        problem, context = f"{context}, {problem}", None
    where = f" (line {e.context_mark.line + 1})" if context and e.context_mark else ""
    return SpecError(f"invalid YAML: {problem}", loc, hint=f"{context}{where}" if context else None)


class _Builder:
    def __init__(self, source: Source):
        self.source = source
        self.constructor = SafeConstructor()
        self.open = set()  # ids of the collections being built, to catch recursive aliases

    def build(self, node: yaml.Node) -> Node:
        self._check_tag(node)
        if isinstance(node, yaml.ScalarNode):
            return self._scalar(node)
        if id(node) in self.open:
            loc = self.source.loc(node.start_mark.line, node.start_mark.column)
            raise SpecError("invalid YAML: an alias refers to a node that contains it", loc)
        self.open.add(id(node))
        if isinstance(node, yaml.MappingNode):
            built = self._mapping(node)
        else:
            built = self._wrap(node, [self.build(item) for item in node.value])
        self.open.discard(id(node))
        return built

    def _check_tag(self, node: yaml.Node) -> None:
        if isinstance(node, yaml.MappingNode):
            ok = node.tag == _MAP_TAG
        elif isinstance(node, yaml.SequenceNode):
            ok = node.tag == _SEQ_TAG
        else:
            ok = node.tag in SafeConstructor.yaml_constructors
        if not ok:
            loc = self.source.loc(node.start_mark.line, node.start_mark.column)
            raise SpecError(f"invalid YAML: unsupported tag '{node.tag}'", loc)

    def _wrap(self, node: yaml.Node, value: object, **kw) -> Node:
        loc = self.source.loc(node.start_mark.line, node.start_mark.column)
        return Node(value, loc, self.source, **kw)

    def _scalar(self, node: yaml.ScalarNode) -> Node:
        value = self.constructor.construct_object(node, deep=True)
        span = (node.start_mark.index, node.end_mark.index)
        return self._wrap(node, value, raw=node.value, style=node.style, span=span)

    def _mapping(self, node: yaml.MappingNode) -> Node:
        items, key_locs = {}, {}
        for key_node, value_node in node.value:
            key_loc = self.source.loc(key_node.start_mark.line, key_node.start_mark.column)
            if not isinstance(key_node, yaml.ScalarNode):
                message = "a mapping key must be a plain name, not a list or mapping"
                raise SpecError(message, key_loc)
            key = key_node.value
            if key in items:
                first = key_locs[key].line
                raise SpecError(f"duplicate key '{key}' (first given on line {first})", key_loc)
            items[key] = self.build(value_node)
            key_locs[key] = key_loc
        return self._wrap(node, items, key_locs=key_locs)


def scalar_source(node: Node) -> tuple[str, Loc]:
    """The text of a scalar as it stands in the file, and the ``Loc`` of its first character.

    An expression embedded in a scalar is parsed from this text, so its nodes point into the file.
    The text is a contiguous slice of the file, equal to the scalar's value up to whitespace: for a
    plain scalar the slice itself, for a quoted one the slice inside the quotes, for a block scalar
    (``|``, ``>``) the lines after the indicator. Where escapes make the slice differ from the
    value, the value is returned with the position of its first character in the file.
    """
    start, end = _content_span(node)
    text = node.source.text[start:end]
    if text.split() != node.raw.split():
        return node.raw, node.source.loc_at(start) if node.style in ("'", '"') else node.loc
    skipped = len(text) - len(text.lstrip())
    return text.strip(), node.source.loc_at(start + skipped)


def _content_span(node: Node) -> tuple[int, int]:
    start, end = node.span
    text = node.source.text
    if node.style in ("'", '"'):
        return start + 1, end - 1
    if node.style in ("|", ">"):
        header_end = _LINE_BREAK.search(text, start, end)
        return (header_end.end() if header_end else end), end
    return start, end
