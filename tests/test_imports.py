"""No import circle among hotprefix's modules.

The graph is read from the source with ``ast``: an edge ``a -> b`` for every import of ``b`` in
``a``'s module-level code (``try:`` and ``if TYPE_CHECKING:`` blocks included: a circle through type
hints is still a circle in the design, though it cannot fail at run time) and, for the strictest
check, inside functions too (a deferred import dodges the failure at load time, not the circle). ``from pkg import name`` points at ``pkg.name`` when that is
a module, else at ``pkg``. The implicit import of a parent package (``pkg/__init__`` before
``pkg.mod``) is not an edge: a package that re-exports its own modules is not a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest


import hotprefix

ROOT = Path(hotprefix.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level_imports(tree: ast.Module, runtime_only: bool, deferred: bool = False):
    """Import statements outside any function or class body (and outside ``if TYPE_CHECKING:``
    when ``runtime_only``); with ``deferred``, every import statement of the module."""
    if deferred:
        yield from (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))
        return
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and runtime_only and _is_type_checking(node.test):
            stack.extend(node.orelse)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    stack.append(child)


def import_graph(runtime_only: bool = False, deferred: bool = False) -> dict[str, dict[str, int]]:
    """module -> {imported hotprefix module: line of the first such import}; ``deferred``: imports
    inside functions count too."""
    files = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        edges: dict[str, int] = {}
        for node in _module_level_imports(ast.parse(path.read_text(), str(path)), runtime_only,
                                          deferred):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the package this module is in
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[:len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                           for a in node.names]
            for t in targets:
                if t in files and t != mod:
                    edges.setdefault(t, node.lineno)
        graph[mod] = edges
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    comps: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in comps:  # walk one concrete circle inside the component, for the message
        members = set(comp)
        start = min(comp)
        path, seen = [start], {start}
        while True:
            nxt = min(w for w in graph[path[-1]] if w in members)
            if nxt in seen:
                cycles.append(path[path.index(nxt):] + [nxt])
                break
            path.append(nxt)
            seen.add(nxt)
    return cycles


def _describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_the_graph_sees_imports():
    graph = import_graph()
    assert "hotprefix.cache.block" in graph["hotprefix.cache.block_pool"]
    assert "hotprefix.simulate.replay" in graph["hotprefix.simulate.sweep"]
    assert not any(m.startswith("hotprefix.cache.") for m in graph["hotprefix.cache.block"]
                   if m != "hotprefix.cache.hashing")


def test_find_cycles_reports_a_circle():
    g = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert find_cycles(g) == [["a", "b", "c", "a"]]
    assert _describe(["a", "b", "c", "a"], g) == "a (line 1) -> b (line 2) -> c (line 3) -> a"
    assert find_cycles({"a": {"b": 1}, "b": {}}) == []


def test_no_import_cycle_at_run_time():
    """Imports that execute when a module loads: no circle at all, known or not."""
    graph = import_graph(runtime_only=True)
    cycles = find_cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(_describe(c, graph) for c in cycles)


def test_no_import_cycle_among_hotprefix_modules():
    """Type-hint imports included: a circle through type hints is still a circle in the design."""
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(_describe(c, graph) for c in cycles)


def test_no_import_cycle_through_imports_inside_functions():
    """Every import statement counts, at module level or inside a function: a deferred import
    only hides a circle from the interpreter (``cli`` <-> ``fleet.app`` and ``config`` <->
    ``vllm_compat`` were two, broken by ``config.flags`` and by translating vLLM's names at the edges)."""
    graph = import_graph(deferred=True)
    assert "hotprefix.server.app" in graph["hotprefix.cli"]  # _cmd_serve's deferred import is seen
    cycles = find_cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(_describe(c, graph) for c in cycles)


def test_the_config_dataclasses_know_nothing_of_vllm():
    graph = import_graph(deferred=True)
    assert not any(m.startswith("hotprefix.compat") for m in graph["hotprefix.config.sections"])
    import hotprefix.config.sections as sections

    with pytest.raises(sections.ConfigError, match="unknown option 'gpu_memory_utilization'"):
        sections.EngineConfig.from_options(gpu_memory_utilization=0.5)  # the edges translate it


ENTRY_POINTS = {"cli.py", "llm.py"}
"""The modules at the package's top level beside ``__init__.py``: the entry points."""


def test_the_top_level_holds_only_the_entry_points():
    """The folders are the architecture: everything else lives in a package named for what it
    serves; each entry point's docstring says what it does not know."""
    top = {p.name for p in ROOT.glob("*.py")} - {"__init__.py"}
    assert top == ENTRY_POINTS, f"modules at the top level: {sorted(top - ENTRY_POINTS)}"
    assert len(ENTRY_POINTS) <= 3
    for name in ENTRY_POINTS:
        doc = ast.get_docstring(ast.parse((ROOT / name).read_text())) or ""
        assert "does not know" in doc, f"{name}'s docstring names nothing it does not know"


def test_importing_hotprefix_and_its_engine_imports_no_ray():
    """Ray loads only with ``hotprefix serve --replicas N`` (hotprefix.fleet.app and below)."""
    import subprocess
    import sys

    code = ("import sys, hotprefix, hotprefix.cli, hotprefix.llm, hotprefix.engine.engine, "
            "hotprefix.server.app, hotprefix.fleet, hotprefix.fleet.config, hotprefix.fleet.hints, "
            "hotprefix.fleet.merge, hotprefix.fleet.asgi, hotprefix.fleet.live; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_fleets_ray_free_parts_import_no_torch():
    """The front end's routing hints, merges and ASGI calls run without torch."""
    import subprocess
    import sys

    code = ("import sys, hotprefix.fleet.hints, hotprefix.fleet.merge, hotprefix.fleet.asgi, "
            "hotprefix.fleet.config; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
