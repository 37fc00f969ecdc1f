"""The package layout (docs/architecture.md): no import cycle between macinfer's modules,
late (function-level) and type-only imports included; only the public API and the entry
point loose at `macinfer/`; every package says what it holds."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1] / "macinfer"
LOOSE = {"__init__.py", "llm.py", "sampling_params.py", "launch.py"}  # the public API, the entry point


def _modules() -> dict[str, Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = p
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the macinfer modules it imports anywhere in its file (a package counts as
    its `__init__`; `from pkg import name` as the submodule when `name` is one)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:
                    out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
        graph[name] = {m for m in out if m in mods and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_packages_form_layers():
    """No cycle between packages either (a loose module counts as its own package)."""
    def package(m: str) -> str:
        return ".".join(m.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for m, deps in import_graph().items():
        graph.setdefault(package(m), set()).update(package(d) for d in deps if package(d) != package(m))
    assert cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_the_public_api_and_the_entry_point_are_loose():
    assert {p.name for p in ROOT.glob("*.py")} <= LOOSE


def test_every_package_says_what_it_holds():
    for init in ROOT.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init.relative_to(ROOT.parent)} has no docstring saying what it holds"
