"""The conformance base every family's suite is built on (docs/DESIGN.md §7).

A family states its suite once (a `Suite`): its factors (feature axes, shapes, dtypes) with the
constraints between them, and for each backend (a `Backend`) the shapes it is tested on, what it
refuses (a case it cannot run must raise a clear error, and is tested to) and the tiles a case gets on
this host. From that the base derives
- the cases each backend runs: a pairwise covering design over the factors (`covering.pairwise`); with
  ``EJGEN_FULL_SUITE=1`` (the GPU host) over every shape of the suite on every backend;
- the cases each backend must refuse, one per reason it gives;
- what each backend's cases must cover: every valid pair of levels, and every level of every factor
  with a shape of at least two tiles on both sequence axes (a one-block shape never runs the code that
  carries state from block to block). `check_collected` checks it on the test items pytest actually
  collected, after any subsetting, so the list cannot drift from what runs.
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

    @functools.cache
    def rows(self, backend: str) -> tuple:
        """The rows ``backend`` runs: the covering design over the shapes it is tested on here (every shape of
        the suite with ``EJGEN_FULL_SUITE=1``: the family's ``tests_shape`` says so)."""
        return tuple(covering.pairwise(self.factors_for(backend), self.allowed(backend), seed=self.seed))

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
