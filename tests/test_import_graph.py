"""klpen's modules import each other without a cycle, and the wheel's package holds no book code.

The graph is read from the source (every ``import`` and ``from ... import`` of a klpen module,
module-level or inside a function, relative or absolute), so a cycle hidden behind a lazy
import inside a function counts too; the lazy submodule hook of ``klpen/__init__.py``
(``importlib.import_module``) is not an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in (SRC / "klpen").rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                stem = node.module or ""
                root = f"{base}.{stem}".strip(".") if node.level else stem
                targets = [root] + [f"{root}.{a.name}" for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                # a package's own modules import the package's parents as a side effect only
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_checker_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_klpen_has_no_import_cycle() -> None:
    graph = _graph()
    assert "klpen.distributed._protocol" in graph and "klpen.kernels.blocks" in graph
    assert _cycle(graph) is None, _cycle(graph)


def test_klpen_imports_no_book_code() -> None:
    for path in (SRC / "klpen").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            book = ("klpen_book", "klpen.lab", "matplotlib")
            assert not any(n.startswith(book) for n in names), (path, names)
