"""The package's import graph follows the layering of docs/DESIGN.md §1: data flows one way, the
compiler and the runtime never import each other, nothing imports the CLI, and no module imports
itself through others. Every import counts, those inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import ejgen

ROOT = Path(ejgen.__file__).parent
COMPILER = ("ejgen.spec", "ejgen.ir", "ejgen.plan", "ejgen.emit", "ejgen.render", "ejgen.writer")

# layer -> the ejgen packages it may not import
FORBIDDEN = {
    "ejgen.runtime": COMPILER + ("ejgen.cli", "ejgen.testing", "ejgen.ops", "ejgen.generated"),
    "ejgen.types": COMPILER + ("ejgen.cli", "ejgen.testing", "ejgen.ops", "ejgen.runtime"),
    **{c: ("ejgen.runtime", "ejgen.ops", "ejgen.generated", "ejgen.cli", "ejgen.testing", "ejgen.types")
       for c in COMPILER},
    "ejgen.ops": COMPILER + ("ejgen.cli", "ejgen.testing"),
    "ejgen.testing": ("ejgen.cli",) + COMPILER,
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The ejgen module an imported name lands in (a submodule, else the nearest package)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets |= {f"{base}.{a.name}" for a in node.names} | {base}
    resolved = {_resolve(t) for t in targets if t == "ejgen" or t.startswith("ejgen.")}
    return {r for r in resolved if r and r != module and r != "ejgen"}


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_graph_sees_the_layers():
    assert "ejgen.runtime.attention.triton.host" in GRAPH and "ejgen.plan.attention" in GRAPH
    assert "ejgen.runtime.launch.triton_call" in GRAPH["ejgen.runtime.attention.triton.host"]


def test_no_layer_imports_what_it_must_not():
    bad = []
    for module, targets in GRAPH.items():
        for layer, forbidden in FORBIDDEN.items():
            if _inside(module, layer):
                bad += [f"{module} -> {t}" for t in targets if any(_inside(t, f) for f in forbidden)]
    assert bad == []


def test_nothing_outside_the_cli_imports_it():
    assert [f"{m} -> {t}" for m, ts in GRAPH.items() for t in ts
            if _inside(t, "ejgen.cli") and not _inside(m, "ejgen.cli")] == []


def _cycles(graph) -> list:
    """Tarjan's strongly connected components with more than one module."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_the_checks_catch_a_planted_violation():
    """The same functions flag a runtime module importing the planner, and a circle through two modules."""
    planted = dict(GRAPH)
    planted["ejgen.runtime.core.settings"] = GRAPH["ejgen.runtime.core.settings"] | {"ejgen.plan.attention"}
    bad = [m for m, ts in planted.items() for t in ts
           if _inside(m, "ejgen.runtime") and any(_inside(t, f) for f in FORBIDDEN["ejgen.runtime"])]
    assert bad == ["ejgen.runtime.core.settings"]
    planted["ejgen.runtime.launch.triton_call"] = GRAPH["ejgen.runtime.launch.triton_call"] | {
        "ejgen.runtime.attention.triton.host"}
    cycles = _cycles(planted)  # (a circle through other modules that import triton_call too, gluon.host's plan)
    assert len(cycles) == 1 and {"ejgen.runtime.attention.triton.host", "ejgen.runtime.launch.triton_call"} <= set(
        cycles[0]), cycles
