"""Pairwise covering designs: few rows that still put every level of every factor next to every level
of every other factor (docs/DESIGN.md §7, "How a family's tests are sized").

A factor is a name and its levels (any values; compared by index). ``valid(assignment)`` says whether a
partial assignment ``{factor: level}`` may appear in a row; the constraints a family states must be
decidable pair by pair (the pairs that ``valid`` rejects are not required, and a row is built factor
by factor, so a level is taken only if it agrees with every level taken before it).

The construction is the greedy one of AETG (Cohen et al., 1997): each new row starts from an uncovered
pair, fills the other factors one at a time with the level that covers the most uncovered pairs, and
the best of a few such candidates is kept. A fixed seed makes the rows the same on every run.
"""

from __future__ import annotations

import itertools
import random
from typing import Callable, Mapping, Sequence


def required_pairs(factors: Mapping[str, Sequence], valid: Callable[[dict], bool]) -> set:
    """Every ``((factor, level index), (factor, level index))`` pair (factors in declaration order)
    that ``valid`` allows."""
    names = list(factors)
    pairs = set()
    for i, j in itertools.combinations(range(len(names)), 2):
        a, b = names[i], names[j]
        for x, y in itertools.product(range(len(factors[a])), range(len(factors[b]))):
            if valid({a: factors[a][x], b: factors[b][y]}):
                pairs.add(((a, x), (b, y)))
    return pairs


def pairs_of(row: Mapping[str, int], names: Sequence[str]) -> set:
    """The pairs one row (factor -> level index) covers."""
    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2)}


def pairwise(factors: Mapping[str, Sequence], valid: Callable[[dict], bool] = lambda _: True, *,
             seed: int = 0, candidates: int = 64) -> list[dict]:
    """Rows ``{factor: level}`` covering every valid pair of levels of two factors."""
    names = list(factors)
    for name in names:
        if not factors[name]:
            raise ValueError(f"factor {name!r} has no levels")
    uncovered = required_pairs(factors, valid)
    partners = {(n, i): set() for n in names for i in range(len(factors[n]))}  # (factor, level) -> uncovered pairs'
    for p, q in uncovered:  # other ends, so that a level's gain is one set intersection
        partners[p].add(q)
        partners[q].add(p)
    rng = random.Random(seed)
    rows = []

    def values(row):
        return {n: factors[n][i] for n, i in row.items()}

    while uncovered:
        ordered = sorted(uncovered)
        best, best_gain = None, 0
        for _ in range(candidates):
            (a, x), (b, y) = rng.choice(ordered)
            row = {a: x, b: y}
            taken = {(a, x), (b, y)}  # the row's (factor, level) items
            given = values(row)
            rest = [n for n in names if n not in row]
            rng.shuffle(rest)
            for name in rest:
                scored = []
                for level, value in enumerate(factors[name]):
                    if not valid({**given, name: value}):
                        continue
                    scored.append((len(partners[(name, level)] & taken), rng.random(), level))
                if not scored:
                    row = None
                    break
                row[name] = level = max(scored)[2]
                taken.add((name, level))
                given[name] = factors[name][level]
            if row is None:
                continue
            gain = len(pairs_of(row, names) & uncovered)
            if gain > best_gain:
                best, best_gain = row, gain
        if best is None:
            raise ValueError(f"no valid row covers any of {len(uncovered)} pairs, e.g. {ordered[0]}")
        for p, q in pairs_of(best, names) & uncovered:
            partners[p].discard(q)
            partners[q].discard(p)
        uncovered -= pairs_of(best, names)
        rows.append({n: best[n] for n in names})
    return [values(r) for r in _without_redundant_rows(rows, names)]


def _without_redundant_rows(rows: list, names) -> list:
    """Drop rows (latest first: the greedy rows late in the list cover least) whose pairs other rows
    also cover."""
    count = {}
    for row in rows:
        for p in pairs_of(row, names):
            count[p] = count.get(p, 0) + 1
    kept = list(rows)
    for row in reversed(rows):
        pairs = pairs_of(row, names)
        if all(count[p] > 1 for p in pairs):
            kept.remove(row)
            for p in pairs:
                count[p] -= 1
    return kept


def missing_pairs(rows: Sequence[Mapping], factors: Mapping[str, Sequence],
                  valid: Callable[[dict], bool] = lambda _: True) -> list[str]:
    """The valid pairs no row covers, readable (``"mask=bhqk with shape=B1-Sq1-..."``); rows hold
    level values."""
    names = list(factors)
    index = {n: {_key(v): i for i, v in enumerate(factors[n])} for n in names}
    covered = set()
    for row in rows:
        covered |= pairs_of({n: index[n][_key(row[n])] for n in names}, names)
    return [
        f"{a}={label(factors[a][x])} with {b}={label(factors[b][y])}"
        for (a, x), (b, y) in sorted(required_pairs(factors, valid) - covered)
    ]


def _key(value):
    return repr(value)


def label(value) -> str:
    """A level as a test id would show it."""
    return getattr(value, "id", None) or str(value)
