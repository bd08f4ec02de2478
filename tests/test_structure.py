"""The package's shape, checked: every import arrow points down (no cycle among the package's modules,
counting imports inside functions), and no engine function grows past 100 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "include" / "kb_reindex"
#: the test servers are tools, not the engine; their request handlers are long by nature of the protocol
ENGINE_FILES = [p for p in PACKAGE.rglob("*.py") if "testing" not in p.parts]


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    modules = {module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                # a module importing its own package's __init__ is not an arrow between modules
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_a_cycle_through_an_import_inside_a_function_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def f():\n    from pkg.high import g\n    return g\n")
    (package / "high.py").write_text("from pkg.low import f\n\ndef g():\n    return f\n")
    (package / "alone.py").write_text("from . import low\n")
    graph = import_graph(package)
    assert graph["pkg.low"] == {"pkg.high"} and graph["pkg.alone"] == {"pkg.low"}
    assert cycles(graph) == [["pkg.high", "pkg.low"]]


def test_no_import_cycle_among_the_package_modules() -> None:
    assert cycles(import_graph()) == []


#: the engine functions still over 100 lines, each to be split (issue #22): the list may only shrink. A
#: function that grows past 100 lines fails here, and so does one of these once it is split but still listed.
STILL_LONG: dict[str, set[str]] = {}


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_engine_function_grows_past_100_lines(path: Path) -> None:
    long = {node.name for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and (node.end_lineno or node.lineno) - node.lineno + 1 > 100}
    assert long == STILL_LONG.get(str(path.relative_to(PACKAGE)), set())


#: The floors of docs/design.md's module layout: a module may import its own floor or lower ones, never higher.
#: A new module must be placed here (the test names it), which is the moment to ask where it belongs.
FLOORS: dict[int, set[str]] = {
    1: {"model", "planning", "validation_model", "lifecycle", "errors", "vectors", "hostname"},
    2: {"store", "collection_config", "layouts", "embedding", "e5", "config", "runtime", "metrics", "corpus",
        "sources", "chunking", "state"},
    3: {"locking", "fence", "freeze", "manifest", "checks", "audit", "alias", "collection_setup"},
    4: {"plan", "snapshot", "build", "validate", "promote", "rollback", "retention", "reconcile",
        "golden", "replay", "reports", "querylog", "templating", "estimate"},
    5: {"pipeline", "runs", "dag_lock", "status", "pageview", "watch"},
    6: {"cli", "airflow", "web", "engine", "reader"},
}
#: the steps of floor 4, which should not lean on each other: what one needs of another belongs a floor down
STEPS = {"plan", "snapshot", "build", "validate", "promote", "rollback", "retention", "reconcile"}
#: the step-to-step imports still there (issue #22): this set may only shrink
STEP_EDGES_LEFT: set[tuple[str, str]] = set()


def floor_of(module: str) -> tuple[str, int | None]:
    """(top-level name under kb_reindex, its floor); the test servers have none."""
    top = module.split(".")[1] if "." in module else module
    return top, next((floor for floor, names in FLOORS.items() if top in names), None)


def test_every_import_points_to_the_same_floor_or_down() -> None:
    upward, unplaced, step_edges = [], set(), set()
    for module, targets in import_graph().items():
        top, floor = floor_of(module)
        if module == "kb_reindex" or top == "testing":
            continue
        if floor is None:
            unplaced.add(top)
            continue
        for target in targets:
            target_top, target_floor = floor_of(target)
            if target_floor is not None and target_floor > floor:
                upward.append(f"{module} (floor {floor}) imports {target} (floor {target_floor})")
            if top in STEPS and target_top in STEPS and top != target_top:
                step_edges.add((top, target_top))
    assert unplaced == set(), f"place these modules in FLOORS: {sorted(unplaced)}"
    assert upward == []
    assert step_edges == STEP_EDGES_LEFT


#: where a function of the engine may return `dict[str, Any]` (not `to_dict`): the Airflow tasks, whose return value is
#: their XCom, a JSON object by Airflow's contract. Everything else hands typed values between layers (issue #22).
UNTYPED_DICT_EDGE = "airflow/tasks.py"
#: issue #22: at most ~15 such functions, the XCom edge
UNTYPED_DICT_BUDGET = 15


def untyped_dict_returns(path: Path) -> list[str]:
    """The functions of one file whose return annotation holds `dict[str, Any]`, serialisers aside."""
    return [node.name for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None
            and "dict[str, Any]" in ast.unparse(node.returns) and node.name not in ("to_dict", "to_json", "view")]


def test_untyped_dicts_only_at_the_xcom_edge(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("def a() -> dict[str, Any]: ...\ndef to_dict() -> dict[str, Any]: ...\ndef b() -> Plan: ...\n")
    assert untyped_dict_returns(sample) == ["a"]
    found = {str(path.relative_to(PACKAGE)): untyped_dict_returns(path) for path in ENGINE_FILES}
    assert {where: names for where, names in found.items() if names and where != UNTYPED_DICT_EDGE} == {}
    assert len(found[UNTYPED_DICT_EDGE]) <= UNTYPED_DICT_BUDGET
