"""Errors raised while reading, checking and building specs.

Every error that a spec author can cause is a ``SpecError`` carrying a ``Loc``; ``render()`` prints
``path:line:col: message``, the offending line and a caret under the column.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Loc:
    """A position in a spec file: 1-based line and column; ``text`` is the whole source line."""

    path: str
    line: int
    col: int
    text: str = attrs.field(default="", eq=False, repr=False)

    def shifted(self, line_delta: int, col: int, text: str | None = None) -> "Loc":
        return Loc(self.path, self.line + line_delta, col, self.text if text is None else text)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col}"


class EjgenError(Exception):
    """Base of every error ejgen raises on purpose."""


class SpecError(EjgenError):
    """A problem in a spec, reported at a source location."""

    def __init__(self, message: str, loc: Loc | None = None, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.loc = loc
        self.hint = hint

    def render(self) -> str:
        head = f"{self.loc}: {self.message}" if self.loc else self.message
        lines = [head]
        if self.loc is not None and self.loc.text:
            text = self.loc.text.rstrip("\n")
            lines.append(f"    {text}")
            lines.append("    " + " " * (max(self.loc.col, 1) - 1) + "^")
        if self.hint:
            lines.append(f"hint: {self.hint}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


class BuildError(EjgenError):
    """A problem writing or checking the generated package."""
