"""The house's layering, read from the source: no module imports upward, and no import cycles.

``policies`` imports nothing of ours but ``policies``; ``sim`` imports ``policies`` and ``sim``;
``controller`` may import anything. Every import counts, wherever it is written (module level, inside
a function, under ``TYPE_CHECKING``): a function-level import that dodges a cycle is still a cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("policies", "sim", "controller")
#: What each package may import of ours.
ALLOWED = {"policies": {"policies"}, "sim": {"policies", "sim"}, "controller": set(PACKAGES)}
#: Cycles tolerated for now: none (the sidecar's was split into server/streams/state/sidecar, issue 14);
#: a cycle that is not listed here fails, and so does one listed here that has gone.
KNOWN_CYCLES: list[list[str]] = []


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> Iterator[tuple[int, str]]:
    """(line, module of ours) for every import in the file; ``from pkg import mod`` names the module."""
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            if t.split(".")[0] in PACKAGES:
                # The module itself, or the package it lives in when the name is an attribute of it.
                while t not in known and "." in t:
                    t = t.rsplit(".", 1)[0]
                yield node.lineno, t


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    mods = _modules()
    known = set(mods)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    upward: list[str] = []
    for name, path in mods.items():
        pkg = name.split(".")[0]
        for line, target in _imports(name, path, known):
            if target.split(".")[0] not in ALLOWED[pkg]:
                upward.append(f"{path.relative_to(ROOT)}:{line}: {pkg} imports {target}")
            if target != name:
                graph[name].add(target)
    return graph, upward


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
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
                    out.append(sorted(comp))
    return out


def test_no_module_imports_upward() -> None:
    _, upward = _graph()
    assert not upward, "\n".join(upward)


def test_no_import_cycles() -> None:
    graph, _ = _graph()
    cycles = _cycles(graph)
    assert cycles == KNOWN_CYCLES, "\n".join(" <-> ".join(c) for c in cycles if c not in KNOWN_CYCLES)


def test_checks_see_what_they_forbid(tmp_path: Path) -> None:
    """The scan finds an upward import and a cycle when there is one (the checks can fail)."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from controller.sidecar import Sidecar\n", encoding="utf-8")
    assert list(_imports("policies.m", p, {"controller.sidecar"})) == [(2, "controller.sidecar")]
    with pytest.raises(ValueError):
        _module_name(tmp_path / "x.py")


def _reachable(graph: dict[str, set[str]], roots: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        for t in graph.get(todo.pop(), ()):
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


def test_the_plugin_does_not_import_the_sidecar() -> None:
    """The vLLM plugin (controller.vllm) reaches only the wire layer and the pure packages: not the
    sidecar's config, server or state, directly or through another module."""
    graph, _ = _graph()
    plugin = [m for m in graph if m == "controller.vllm" or m.startswith("controller.vllm.")]
    reached = {m for m in _reachable(graph, plugin) if m not in plugin}
    sidecar_side = sorted(
        m
        for m in reached
        if m.startswith("controller.") and not m.startswith(("controller.wire", "controller.v1"))
    )
    assert sidecar_side == ["controller.auth", "controller.errors"], sidecar_side
