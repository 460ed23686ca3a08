"""The conformance base every family's suite is built on (docs/DESIGN.md §7).

A family states its suite once (a `Suite`): its factors (feature axes, shapes, dtypes) with the
constraints between them, and for each backend (a `Backend`) the shapes it is tested on, what it
refuses (a case it cannot run must raise a clear error, and is tested to) and the tiles a case gets on
this host. From that the base derives
- the cases each backend runs: a pairwise covering design over the factors (`covering.pairwise`); with
  ``EJGEN_FULL_SUITE=1`` (the GPU host) over every shape of the suite on every backend. A backend that runs in an
  interpreter here (``Backend.interpreted``: the accelerator backends without a GPU, seconds a case) runs, unless
  ``EJGEN_FULL_SUITE=1``, a subset of those rows that still covers every level of every factor (every shape, and
  every other level on a shape of two tiles or more): `Suite.rows`; its pairs run on the GPU host;
- the cases each backend must refuse, one per reason it gives;
- what each backend's cases must cover: every valid pair of levels (an interpreted backend's subset: every
  level), and every level of every factor with a shape of at least two tiles on both sequence axes (a one-block
  shape never runs the code that carries state from block to block). `check_collected` checks it on the test
  items pytest actually collected, after any subsetting, so the list cannot drift from what runs.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable

import pytest

import covering

FULL = os.environ.get("EJGEN_FULL_SUITE") == "1"
"""Every backend on every shape of its suite (the GPU host); a family's ``tests_shape`` reads it. (The product
of the factors itself, 86,400 cases per backend for attention, is beyond any session's device time.)"""


@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend as a suite tests it."""

    name: str  # the op's platform= value
    tests_shape: Callable[[Any], bool]  # the shapes it runs here (a cost choice, not a capability)
    tiles: Callable[[Any, str], tuple]  # (shape, dtype) -> (query tile, key tile) a call gets on this host
    refuses: Callable[[dict], str | None] = lambda row: None  # a (partial) row it cannot run -> the message
    # it must raise (a regular expression); None where it runs the row
    interpreted: bool = False  # it runs in an interpreter on this host (seconds a case): without EJGEN_FULL_SUITE,
    # the subset of its pairwise rows that covers every level (Suite.rows), not every pair
    cost: Callable[[dict], float] = lambda row: 1.0  # a row's seconds here, relative: what the subset weighs


@dataclasses.dataclass(eq=False)
class Suite:
    """A family's conformance suite: ``factors`` (name -> levels; "shape" and "dtype" among them),
    ``valid`` (constraints, on partial rows), ``make_case`` (a full row -> a case with an ``id``),
    ``lengths`` (shape -> (query length, key length): what the tiles divide) and the backends."""

    family: str
    factors: dict
    valid: Callable[[dict], bool]
    make_case: Callable[[dict], Any]
    lengths: Callable[[Any], tuple]
    backends: tuple
    seed: int = 0

    def __post_init__(self):
        assert {"shape", "dtype"} <= set(self.factors), "a suite's factors include shape and dtype"
        self.backend = {b.name: b for b in self.backends}
        self._rows = {}  # case id -> row

    # -- the design ---------------------------------------------------------------------------------
    def factors_for(self, backend: str) -> dict:
        b = self.backend[backend]
        return {**self.factors, "shape": tuple(s for s in self.factors["shape"] if b.tests_shape(s))}

    def allowed(self, backend: str) -> Callable[[dict], bool]:
        refuses = self.backend[backend].refuses
        return lambda row: self.valid(row) and refuses(row) is None

    def levels_only(self, backend: str) -> bool:
        """Whether ``backend``'s cases here need cover every level only (an interpreter, not EJGEN_FULL_SUITE),
        not every pair of levels."""
        return self.backend[backend].interpreted and not FULL

    @functools.cache
    def pairwise_rows(self, backend: str) -> tuple:
        """The pairwise covering design over the shapes ``backend`` is tested on here (every shape of the suite with
        ``EJGEN_FULL_SUITE=1``: the family's ``tests_shape`` says so)."""
        return tuple(covering.pairwise(self.factors_for(backend), self.allowed(backend), seed=self.seed))

    @functools.cache
    def rows(self, backend: str) -> tuple:
        """The rows ``backend`` runs: its pairwise design (`pairwise_rows`); for a backend run in an interpreter,
        without EJGEN_FULL_SUITE, a few of those rows (a greedy set cover, weighed by ``Backend.cost``) that still
        hold every shape and every other level on a shape of two tiles or more on both axes, ties broken by the pairs
        a row adds, in the design's order."""
        rows = self.pairwise_rows(backend)
        if not self.levels_only(backend):
            return rows
        cost = self.backend[backend].cost
        items = [self._levels_of(backend, r) for r in rows]
        pairs = [covering.pairs_of(self._indices(backend, r), list(r)) for r in rows]
        needed, seen, chosen = set().union(*items), set(), []
        while needed:
            best = max((i for i in range(len(rows)) if i not in chosen),
                       key=lambda i: (len(items[i] & needed) / cost(rows[i]), len(pairs[i] - seen), -i))
            chosen.append(best)
            needed -= items[best]
            seen |= pairs[best]
        return tuple(rows[i] for i in sorted(chosen))

    def _indices(self, backend: str, row: dict) -> dict:
        factors = self.factors_for(backend)
        return {n: [covering._key(v) for v in factors[n]].index(covering._key(row[n])) for n in factors}

    def _levels_of(self, backend: str, row: dict) -> set:
        """What a row adds to a covering of every level: its shape; its other levels where its shape has two tiles
        or more on both axes."""
        items = {("shape", covering._key(row["shape"]))}
        if self.nondegenerate(backend, row):
            items |= {(n, covering._key(v)) for n, v in row.items() if n != "shape"}
        return items

    def case(self, row: dict):
        case = self.make_case(row)
        self._rows[case.id] = row
        return case

    def params(self, backends=None) -> list:
        """``(backend, case)`` pytest params of every backend's rows, ids ``<backend>-<case id>``."""
        mark = pytest.mark.conformance(self.family)
        return [
            pytest.param(b, c, id=f"{b}-{c.id}", marks=mark)
            for b in (backends or self.backend)
            for c in (self.case(r) for r in self.rows(b))
        ]

    def refusals(self) -> list:
        """``(backend, case, message)`` params: for each backend and each reason it refuses for, one case
        of the design over everything valid that it must refuse."""
        params = []
        for name, b in self.backend.items():
            if b.refuses is Backend.refuses:  # the default: it refuses nothing (no design to derive)
                continue
            seen = set()
            for row in covering.pairwise(self.factors_for(name), self.valid, seed=self.seed):
                why = b.refuses(row)
                if why is not None and why not in seen:
                    seen.add(why)
                    case = self.case(row)
                    params.append(pytest.param(name, case, why, id=f"{name}-{case.id}"))
        return params

    # -- what the cases must cover -----------------------------------------------------------------
    def nondegenerate(self, backend: str, row: dict) -> bool:
        """Both sequence axes span at least two of the tiles the backend uses for the row here."""
        sq, sk = self.lengths(row["shape"])
        tq, tk = self.backend[backend].tiles(row["shape"], row["dtype"])
        return sq > tq and sk > tk

    def missing(self, backend: str, rows) -> list[str]:
        """What ``rows`` (run on ``backend``) leave uncovered, readable; empty when nothing is."""
        factors, allowed = self.factors_for(backend), self.allowed(backend)
        if self.levels_only(backend):  # every level, not every pair (a level with no pair allowed is not required)
            required = {(name, covering._key(factors[name][i]))
                        for pair in covering.required_pairs(factors, allowed) for name, i in pair}
            present = {(n, covering._key(v)) for r in rows for n, v in r.items()}
            problems = [f"{name}={covering.label(level)}: no case"
                        for name, levels in factors.items() for level in levels
                        if (name, covering._key(level)) in required - present]
        else:
            problems = [f"pair {p}" for p in covering.missing_pairs(rows, factors, allowed)]
        for name, levels in factors.items():
            if name == "shape":
                continue
            for level in levels:
                if not any(allowed({name: level, "shape": s}) for s in factors["shape"]):
                    continue
                hits = [r for r in rows if r[name] == level]
                if hits and not any(self.nondegenerate(backend, r) for r in hits):
                    problems.append(f"{name}={covering.label(level)}: no case with two tiles or more on both axes")
        if not any(self.nondegenerate(backend, r) for r in rows):
            problems.append("no case with two tiles or more on both axes")
        return problems

    def check_collected(self, items, backends, selection: list | None = None) -> None:
        """Fail unless the conformance items pytest collected for this suite cover the design on each of
        ``backends`` (the run's, after -m / -k selection and any subsetting). ``selection``: where this process runs
        one shard of a larger selection (benchmarks/gpu_shards.sh), that whole selection's test ids instead; a
        conformance case's id is ``<test>[<backend>-<case id>]``."""
        ran = {b: [] for b in backends}
        if selection is not None:
            names = {item.originalname for item in items if (m := item.get_closest_marker("conformance"))
                     and m.args == (self.family,)} or {"test_" + self.family}
            for node in selection:
                name, _, param = node.rpartition("::")[2].partition("[")
                for backend in ran:
                    case_id = param[:-1].removeprefix(backend + "-")
                    if name in names and case_id != param[:-1] and case_id in self._rows:
                        ran[backend].append(self._rows[case_id])
            items = ()
        for item in items:
            mark = item.get_closest_marker("conformance")
            params = getattr(getattr(item, "callspec", None), "params", {})
            if mark is None or mark.args != (self.family,) or params.get("backend") not in ran:
                continue
            ran[params["backend"]].append(self._rows[params["case"].id])
        problems = []
        for backend, rows in ran.items():
            if not rows:
                problems.append(f"{backend}: no conformance case collected (deselected by -k or -m?)")
                continue
            problems += [f"{backend}: {p}" for p in self.missing(backend, rows)]
        assert not problems, f"{self.family} conformance coverage:\n  " + "\n  ".join(problems)
