"""Line layout of emitted Python: ``reflow`` wraps the lines longer than ``WIDTH`` — code inside its
brackets, comments and one-line docstrings at spaces — without changing the code (the syntax tree is
compared). ``ejgen.render`` applies it to every generated Python file; the Triton template also calls it on
the blocks a spec makes long."""

from __future__ import annotations

import ast
import io
import keyword
import textwrap
import tokenize

WIDTH = 120  # columns of every emitted line

# reflow: binary operators a line may break before, best first (a comma, after which a line may break, ranks 0)
_BREAK_RANK = {"or": 1, "|": 1, "and": 2, "&": 2, "==": 3, "!=": 3, "<": 3, "<=": 3, ">": 3, ">=": 3,
               "+": 4, "-": 4, "*": 5, "/": 5, "//": 5, "%": 5}
_OPEN, _CLOSE = "([{", ")]}"
_ASSIGN = ("=", "+=", "-=", "*=", "/=", "//=", "%=", "&=", "|=")


def _operand_end(string: str, kind: int) -> bool:
    """Whether a token can end an operand (so that the next + or - is binary, the next [ a subscript)."""
    named = kind in (tokenize.NAME, tokenize.NUMBER, tokenize.STRING) and not keyword.iskeyword(string)
    return named or string in _CLOSE


def _break_code(toks: list, stack: list, indent: int, width: int) -> tuple | None:
    """One physical line, as ``toks`` [(string, spaces before it, can end an operand)], in lines of at most
    ``width`` columns, broken inside brackets (``stack``: the align columns of the brackets already open, None
    for a subscript) before the best break that fits: one that fills 40% of the line and aligns its continuation
    in the line's left half where there is such, then the shallowest, the best ranked, the last. A continuation
    is aligned after its innermost open bracket (or indented 8 past ``indent`` where that is too far right).
    Returns (lines, how bad: whether a continuation is indented so, the deepest break), or None where no break
    fits."""
    def text(a, b, col):
        return " " * col + "".join((" " * toks[j][1] if j > a else "") + toks[j][0] for j in range(a, b))

    lines, start, col0, stack, hanging, deepest = [], 0, indent, list(stack), False, 0
    while True:
        col, st, cands = col0, list(stack), []
        for j in range(start, len(toks)):
            string, gap, _ = toks[j]
            if j > start:
                rank = 0 if toks[j - 1][0] == "," else _BREAK_RANK.get(string) if toks[j - 1][2] else None
                if rank is not None and st and st[-1] is not None:
                    good = col - col0 >= (width - col0) * 2 // 5 and st[-1] <= width // 2  # fills, aligns
                    cands.append((not good, len(st), rank, -j, j, list(st)))
                col += gap
            col += len(string)
            if col > width:
                break
            if string in _OPEN:
                st.append(None if string == "[" and j > 0 and toks[j - 1][2] else col)
            elif string in _CLOSE and st:
                st.pop()
        else:
            return lines + [text(start, len(toks), col0)], (hanging, deepest)
        if not cands:
            return None
        _, depth, *_, j, st = min(cands)
        lines.append(text(start, j, col0))
        start, stack, deepest = j, st, max(deepest, depth)
        hanging = hanging or st[-1] > width // 2
        col0 = st[-1] if st[-1] <= width // 2 else indent + 8


def _break_statement(toks: list, stack: list, indent: int, width: int) -> list[str] | None:
    """The lines of ``_break_code``, or, where they are fewer or better (shallower breaks), those of the same
    with the expression of a return or an assignment put in parentheses, so that it may also break at its
    outermost operators."""
    best = _break_code(toks, stack, indent, width)
    if stack:
        return best and best[0]
    depth, expr = 0, None  # expr: where the expression starts
    for j, (string, _, _) in enumerate(toks):
        depth += (string in _OPEN) - (string in _CLOSE)
        if depth == 0 and (string in _ASSIGN or string == "return" and j == 0):
            expr = j + 1
    if expr is None or expr >= len(toks):
        return best and best[0]
    wrapped = toks[:expr] + [("(", toks[expr][1], False), (toks[expr][0], 0, toks[expr][2])] + toks[expr + 1:]
    wrapped.append((")", 0, True))
    other = _break_code(wrapped, stack, indent, width)
    layouts = [(len(lines), bad, i, lines) for i, (lines, bad) in enumerate(x for x in (best, other) if x)]
    return min(layouts)[-1] if layouts else None


def reflow(text: str, width: int = WIDTH) -> str:
    """``text`` (Python source) with every line longer than ``width`` wrapped: code inside its brackets,
    comments and one-line docstrings at spaces. The code is unchanged (asserted: the same syntax tree, docstrings
    compared up to whitespace); a line it cannot break stays as it is."""
    text = text.strip("\n")
    source = text.split("\n")
    if all(len(line) <= width for line in source):
        return text
    rows: dict[int, list] = {}
    stacks: dict[int, list] = {}  # row -> align columns of the brackets open at its start
    stack: list = []
    prev = None
    for tok in tokenize.generate_tokens(io.StringIO(text + "\n").readline):
        if tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        row = tok.start[0]
        if row not in rows:
            if prev is not None and prev.string in _OPEN and stack[-1] is not None:
                stack[-1] = tok.start[1]  # a bracket that ends its line: its items align with this row
            rows[row], stacks[row] = [], list(stack)
        rows[row].append(tok)
        if tok.string in _OPEN:
            subscript = tok.string == "[" and prev is not None and _operand_end(prev.string, prev.type)
            stack.append(None if subscript else tok.end[1])
        elif tok.string in _CLOSE:
            stack.pop()
        prev = tok
    out = []
    for row, line in enumerate(source, 1):
        toks = rows.get(row, [])
        if len(line) <= width or not toks or any(t.start[0] != t.end[0] for t in toks):
            out.append(line)
            continue
        indent = line[:len(line) - len(line.lstrip())]
        if toks[0].type == tokenize.COMMENT:
            out += [indent + "# " + part for part in textwrap.wrap(line.strip()[1:].strip(), width - len(indent) - 2)]
            continue
        if len(toks) == 1 and toks[0].string.startswith('"""') and toks[0].string.endswith('"""'):
            parts = textwrap.wrap(toks[0].string[3:-3], width - len(indent) - 3, break_on_hyphens=False)
            if len(parts) > 1:
                out += [indent + '"""' + parts[0]] + [indent + p for p in parts[1:-1]] + [indent + parts[-1] + '"""']
                continue
        comment = toks.pop() if toks[-1].type == tokenize.COMMENT else None  # goes on a line of its own, above
        code = [(t.string, t.start[1] - toks[i - 1].end[1] if i else 0, _operand_end(t.string, t.type))
                for i, t in enumerate(toks)]
        broken = _break_statement(code, stacks[row], len(indent), width) if toks else None
        out += [line] if broken is None else ([indent + comment.string] if comment else []) + broken
    result = "\n".join(out)
    if result != text and _tree(result) != _tree(text):
        raise AssertionError("reflow changed the code")  # a bug here, not in the spec
    return result


def _tree(source: str) -> str:
    """The syntax tree of ``source``, its strings' whitespace collapsed (docstrings wrap)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = " ".join(node.value.split())
    return ast.dump(tree)


def notation_lines(lines: list[str]) -> list[str]:
    """A notation block's lines (``ejgen show``, the generated op's docstring), each within the emitted width less
    the docstring's indent, continued 4 columns further in."""
    out = []
    for line in lines:
        indent = " " * (len(line) - len(line.lstrip()) + 4)
        out += textwrap.wrap(line, WIDTH - 8, subsequent_indent=indent, break_long_words=False,
                             break_on_hyphens=False) or [line]
    return out
