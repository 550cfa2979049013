"""The house rules of the code base, read from the source: no import circles in `s4r`, a shallow import
graph, no file over 400 lines, and the library never reaching into the CLI or the research scripts.

Every import counts, also those inside functions and under `TYPE_CHECKING`: a circle broken only by
deferring one side is still a circle a reader has to follow.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_FLOORS = 12
MAX_LINES = 400
LINE_LIMITED = ("s4r", "s4r_cli", "tests", "research")


def module_name(path: Path, root: Path = REPO_ROOT) -> str:
    """`s4r/core/rope.py` -> `s4r.core.rope`; a package's `__init__.py` is the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(source: str) -> set[str]:
    """Every absolute module name (and `module.name` of a from-import) a source file imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def import_graph(package: str = "s4r", root: Path = REPO_ROOT) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports (a from-import of a submodule counts as that one)."""
    modules = {module_name(p, root): p for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for imported in imported_names(path.read_text(encoding="utf-8")):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported not in (name, package):
                deps.add(imported)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest import chain of an acyclic graph, importer first (its length is the floors)."""
    best: dict[str, list[str]] = {}
    open_: set[str] = set()

    def chain(v: str) -> list[str]:
        if v in open_:
            raise ValueError(f"import circle through {v}")
        if v not in best:
            open_.add(v)
            below = [chain(w) for w in sorted(graph[v])]
            open_.discard(v)
            best[v] = [v, *max(below, key=len, default=[])]
        return best[v]

    return max((chain(v) for v in graph), key=len, default=[])


def test_the_checks_see_a_circle_and_a_chain() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert longest_chain({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"c"}}) == ["a", "b", "c"]
    source = "import torch\nif TYPE_CHECKING:\n    from s4r.config import S4RConfig\n" \
             "def f():\n    from s4r.core import rope\n"
    assert {"s4r.config.S4RConfig", "s4r.core.rope", "torch"} <= imported_names(source)


def test_no_import_circles_in_the_library() -> None:
    assert cycles(import_graph()) == []


def test_the_import_graph_is_shallow() -> None:
    chain = longest_chain(import_graph())
    assert len(chain) <= MAX_FLOORS, " -> ".join(chain)


def test_the_library_never_imports_the_cli_or_the_research_scripts() -> None:
    offenders = []
    for path in (REPO_ROOT / "s4r").rglob("*.py"):
        for name in imported_names(path.read_text(encoding="utf-8")):
            if name.split(".")[0] in ("s4r_cli", "research"):
                offenders.append(f"{path.relative_to(REPO_ROOT)}: {name}")
    assert offenders == []


def test_no_file_is_over_400_lines() -> None:
    long_files = []
    for folder in LINE_LIMITED:
        for path in (REPO_ROOT / folder).rglob("*.py"):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > MAX_LINES:
                long_files.append(f"{path.relative_to(REPO_ROOT)}: {lines}")
    assert long_files == []
