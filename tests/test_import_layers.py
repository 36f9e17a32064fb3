"""qllm's subpackages and top-level modules import one another without cycles.

Every ``import qllm.x...`` and ``from qllm.x... import`` statement counts, those inside
functions and under ``TYPE_CHECKING`` too: a lazy import hides a cycle from the interpreter,
not from the design. A unit is ``qllm.<name>``, a subpackage or a top-level module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import qllm

PACKAGE_ROOT = Path(qllm.__file__).parent


def _unit(module: str) -> str | None:
    """``qllm.engine.scheduler`` -> ``qllm.engine``; None outside qllm."""
    parts = module.split(".")
    if parts[0] != "qllm" or len(parts) < 2:
        return None
    return ".".join(parts[:2])


def _imported_modules(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from qllm import cli`` imports the unit ``qllm.cli``
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def import_graph() -> dict[str, set[str]]:
    """unit -> the other units it imports."""
    units = {f"qllm.{path.stem if path.is_file() else path.name}"
             for path in PACKAGE_ROOT.iterdir()
             if (path.suffix == ".py" and path.stem != "__init__")
             or (path / "__init__.py").is_file()}
    graph: dict[str, set[str]] = {unit: set() for unit in units}
    for path in PACKAGE_ROOT.rglob("*.py"):
        parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
        source = _unit(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        if source is None:  # qllm/__init__.py, the public facade
            continue
        for module in _imported_modules(ast.parse(path.read_text(), str(path))):
            target = _unit(module)
            if target in units and target != source:
                graph[source].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(unit: str) -> None:
        index[unit] = low[unit] = len(index)
        stack.append(unit)
        on_stack.add(unit)
        for target in graph[unit]:
            if target not in index:
                visit(target)
                low[unit] = min(low[unit], low[target])
            elif target in on_stack:
                low[unit] = min(low[unit], index[target])
        if low[unit] == index[unit]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == unit:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for unit in sorted(graph):
        if unit not in index:
            visit(unit)
    return found


def test_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_between_subpackages():
    graph = import_graph()
    assert "qllm.engine" in graph and "qllm.batch" in graph["qllm.engine"]
    assert cycles(graph) == []
