"""The package's shape, checked: every import arrow points down (no cycle among the package's modules,
counting imports inside functions), and no engine function grows past 100 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "include" / "kb_reindex"
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


#: The floors of docs/design.md's module layout, one folder each: a module may import its own folder or a lower
#: floor's, never a higher one. A new folder must be placed here (the test names it).
FLOORS: dict[int, set[str]] = {
    1: {"domain"},
    2: {"services"},
    3: {"rules"},
    4: {"steps"},
    5: {"run"},
    6: {"cli", "airflow", "web", "reader"},
}
#: the steps of floor 4, which should not lean on each other: what one needs of another belongs a floor down
STEPS = {"plan", "snapshot", "build", "validate", "promote", "rollback", "retention", "reconcile"}
#: the step-to-step imports still there (issue #22): this set may only shrink
STEP_EDGES_LEFT: set[tuple[str, str]] = set()
#: the edges serve different outside worlds: none imports another (the CLI works without Airflow and the page)
EDGES = {"cli", "airflow", "web", "reader"}
#: but `kb-reindex query` searches through the reader, exactly as an assistant does
EDGE_ARROWS = {("cli", "reader")}


def floor_of(module: str) -> tuple[str, int | None]:
    """(the folder under kb_reindex, its floor); the test servers have none."""
    top = module.split(".")[1] if "." in module else module
    return top, next((floor for floor, names in FLOORS.items() if top in names), None)


def step_of(module: str) -> str | None:
    """The step a module of `steps/` is (`kb_reindex.steps.plan` -> `plan`), None for a part or another folder."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "steps" and parts[2] in STEPS else None


def test_every_import_points_to_the_same_floor_or_down() -> None:
    upward, unplaced, step_edges, across_edges = [], set(), set(), []
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
            if target_top == "testing":
                upward.append(f"{module} imports the test servers ({target})")
            if top in EDGES and target_top in EDGES and top != target_top and (top, target_top) not in EDGE_ARROWS:
                across_edges.append(f"{module} imports another edge, {target}")
            step, target_step = step_of(module), step_of(target)
            if step and target_step and step != target_step:
                step_edges.add((step, target_step))
    assert unplaced == set(), f"place these folders in FLOORS: {sorted(unplaced)}"
    assert upward == []
    assert across_edges == []
    assert step_edges == STEP_EDGES_LEFT


#: the package's top level: the floors' folders, the edges, the test servers and the templates (issue #29: at most 12)
TOP_LEVEL_BUDGET = 12


def test_the_top_level_shows_the_floors_as_folders() -> None:
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert len(entries) <= TOP_LEVEL_BUDGET, entries
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()} - {"testing"}
    assert {"domain", "services", "rules", "steps", "run"} <= folders
    unplaced = {name.removesuffix(".py") for name in entries if name not in ("__init__.py", "templates", "testing")}
    assert unplaced <= set().union(*FLOORS.values()), f"not a floor: {sorted(unplaced - set().union(*FLOORS.values()))}"


def test_every_folder_says_what_it_holds_and_may_import() -> None:
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        assert doc, f"{init.relative_to(PACKAGE)} has no docstring"
        if init.parent.parent == PACKAGE and init.parent.name not in ("testing",):
            assert "import" in doc.split("\n\n")[0].lower(), f"{init.relative_to(PACKAGE)}: say what it may import"


def test_no_module_only_re_exports_names() -> None:
    """A module whose body is imports (and `__all__`) only is a shim: import from where the names live."""
    shims = []
    for path in PACKAGE.rglob("*.py"):
        body = [node for node in ast.parse(path.read_text(encoding="utf-8")).body
                if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
        imports = [node for node in body if isinstance(node, ast.Import | ast.ImportFrom)
                   and not (isinstance(node, ast.ImportFrom) and node.module == "__future__")]
        rest = [node for node in body if node not in imports and not (isinstance(node, ast.ImportFrom))
                and not (isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets))]
        if imports and not rest:
            shims.append(str(path.relative_to(PACKAGE)))
    assert shims == []


#: where a function of the engine may return `dict[str, Any]` (not `to_dict`): the Airflow tasks, whose return value is
#: their XCom, a JSON object by Airflow's contract. Everything else hands typed values between layers (issue #22).
UNTYPED_DICT_EDGE = "airflow/tasks.py"
#: issue #22: at most ~15 such functions, the XCom edge
UNTYPED_DICT_BUDGET = 15


def untyped_dict_returns(path: Path) -> list[str]:
    """The functions of one file whose return annotation holds `dict[str, Any]`, serialisers aside."""
    return [node.name for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None
            and "dict[str, Any]" in ast.unparse(node.returns)
            and node.name not in ("to_dict", "to_json", "view", "serialize")]  # serialize: a trigger's, Airflow's contract


def test_untyped_dicts_only_at_the_xcom_edge(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("def a() -> dict[str, Any]: ...\ndef to_dict() -> dict[str, Any]: ...\ndef b() -> Plan: ...\n")
    assert untyped_dict_returns(sample) == ["a"]
    found = {str(path.relative_to(PACKAGE)): untyped_dict_returns(path) for path in ENGINE_FILES}
    assert {where: names for where, names in found.items() if names and where != UNTYPED_DICT_EDGE} == {}
    assert len(found[UNTYPED_DICT_EDGE]) <= UNTYPED_DICT_BUDGET


def test_help_and_usage_errors_import_no_store_model_or_airflow() -> None:
    """`kb-reindex --help` and a mistyped command answer before the heavy imports (qdrant-client alone takes
    seconds on a busy machine): they need none of them."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from kb_reindex.cli import main\n"
            "for argv in (['--help'], ['run', '--help'], ['nonsense']):\n"
            "    try:\n"
            "        main(argv)\n"
            "    except SystemExit:\n"
            "        pass\n"
            "heavy = ('qdrant_client', 'airflow', 'sqlalchemy', 'ollama', 'torch', 'onnxruntime', 'pandas', 'pydantic')\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & set(heavy)))\n"
            "print(sorted(m for m in sys.modules if m.startswith('kb_reindex')))\n"
            "print(sorted(set(sys.modules) & {'logging', 'json', 'typing', 'dataclasses', 'ssl', 'socket'}))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    heavy, ours, light = done.stdout.strip().splitlines()[-3:]
    assert heavy == "[]", done.stdout[-500:]
    # not even the package's settings and errors, nor the standard library's modules they bring (#41: --help
    # within 5x a bare `python -c pass`)
    assert ours == str(["kb_reindex", "kb_reindex.cli", "kb_reindex.domain", "kb_reindex.domain.embedders"]), ours
    assert light == "[]", light


def _heavy_imports_of_commands(root: Path, commands: list[list[str]], registry: str) -> tuple[list[int], list[str]]:
    """Each command's exit code, and which of Qdrant's client, numpy, rich and pandas the process imported, the
    commands run in one fresh process (`cli.main`) with the project at `root`."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json, sys\n"
            "from kb_reindex.cli import main\n"
            f"codes = [main(argv) for argv in {commands!r}]\n"
            "print(json.dumps([codes, sorted({m.split('.')[0] for m in sys.modules}\n"
            "                                & {'qdrant_client', 'numpy', 'rich', 'pandas'})]))\n")
    env = {**os.environ, "KB_PROJECT_ROOT": str(root), "KB_REGISTRY": registry}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    codes, heavy = json.loads(done.stdout.strip().splitlines()[-1])
    return codes, heavy


def test_bases_reads_the_state_db_without_importing_qdrants_client(tmp_path: Path) -> None:
    """`kb-reindex bases` reads the state DB alone (never Qdrant), so it never imports qdrant-client, whose import
    alone took most of its time (#41: bases within 1.2x a bare `import qdrant_client`)."""
    import shutil

    shutil.copytree(PACKAGE.parents[1] / "knowledge", tmp_path / "knowledge")
    assert _heavy_imports_of_commands(tmp_path, [["bases", "--json", "-q"]], "knowledge/registry.yaml") == ([0], [])


def test_on_calls_state_db_commands_never_import_qdrants_client(tmp_path: Path) -> None:
    """`history`, `freeze`, `unfreeze` and `unlock` need the state DB alone (on-call breaks a lock while the stuck
    process still holds Qdrant): they never import qdrant-client, half a second of each such command."""
    import shutil

    from kb_reindex.services.state.store import StateStore

    shutil.copytree(PACKAGE.parents[1] / "knowledge", tmp_path / "knowledge")
    (tmp_path / ".kb").mkdir()
    StateStore(f"sqlite:///{tmp_path / '.kb' / 'state.db'}").dispose()  # made as a first run makes it
    commands = [["history", "--json", "-q"], ["freeze", "--reason", "drill", "-q"], ["unfreeze", "-q"],
                ["unlock", "--reason", "drill", "--yes", "-q"]]
    assert _heavy_imports_of_commands(tmp_path, commands, "") == ([0, 0, 0, 0], [])


def test_the_cli_lays_out_tables_as_pandas_did_without_importing_it(tmp_path: Path) -> None:
    """`bases` and `status` print their tables without pandas (a sixth of their time was its import), laid out
    exactly as `DataFrame.to_string(index=False)` laid them out: right-aligned, one space apart, control
    characters escaped, None as `-`."""
    import os
    import subprocess
    import sys

    import pandas as pd

    from kb_reindex.cli import _table

    rows = [{"version": 12, "status": "live", "collection": "kb__e5__s1", "note": None},
            {"version": 3, "status": "ready *shadow", "collection": "知识__e5__s2", "note": "a\tb\nc\rd"}]
    columns = ["version", "status", "collection", "note"]
    cells = [["-" if row[name] is None else str(row[name]) for name in columns] for row in rows]
    assert _table(rows, columns) == pd.DataFrame(cells, columns=columns, dtype=object).to_string(index=False)
    assert _table([], columns) == "(none)"

    (tmp_path / "knowledge" / "docs").mkdir(parents=True)
    code = ("import sys\nfrom kb_reindex.cli import main\nmain(['bases'])\n"
            "print('pandas' in {m.split('.')[0] for m in sys.modules})\n")
    env = {**os.environ, "KB_PROJECT_ROOT": str(tmp_path), "KB_REGISTRY": ""}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "alias live model" in done.stdout, done.stdout[-800:] + done.stderr[-800:]  # the table was laid out
    assert done.stdout.strip().splitlines()[-1] == "False", done.stdout[-800:] + done.stderr[-800:]


#: the version model's steps and the rules they call: each takes the narrow part of the state store it uses
VERSION_MODEL = ["steps/slots.py", "steps/restore.py", "steps/retention.py", "steps/build.py", "rules/slots.py",
                 "rules/checks.py:by_difference,shape_checks,_id_differences,structural_problems",
                 "rules/alias.py:rollback_target,moved_from", "rules/locking.py:run_is_active"]


def test_the_version_models_steps_take_a_narrow_part_of_the_state_store() -> None:
    """No function of the version model's steps (slots, build, restore, retention) or of the rules they call
    takes the whole `Deps` or `StateStore`: a `StepDeps[<port>]` (or a protocol built on one) names the part
    of the state store it uses, and mypy holds it to it."""
    wide: list[str] = []
    for entry in VERSION_MODEL:
        relative, _, names = entry.partition(":")
        path = PACKAGE / relative
        only = set(names.split(",")) if names else None
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef) or (only is not None and node.name not in only):
                continue
            for arg in node.args.args + node.args.kwonlyargs:
                annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if annotation in ("Deps", "StateStore"):
                    wide.append(f"{relative}:{node.lineno} {node.name}({arg.arg}: {annotation})")
    assert not wide, wide
    ports = ast.parse((PACKAGE / "services" / "state" / "ports.py").read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(ports) if isinstance(node, ast.ImportFrom)}
    assert "kb_reindex.services.state.store" not in imported, "the ports say what a step uses, not the store"


def _qdrant_imports(tree: ast.Module) -> list[str]:
    """The module's imports of qdrant-client outside `if TYPE_CHECKING:` blocks, as `from` or `import` lines."""
    typing_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(block.test) for stmt in block.body for node in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "qdrant_client":
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "qdrant_client" for a in node.names):
            found.append("import qdrant_client")
    return found


def test_the_package_takes_qdrants_client_from_services_qdrant() -> None:
    """Only `services/qdrant.py` imports the client's package itself (skipping its up-front rebuild of every REST
    model); a module may import one of the client's submodules only after importing `services.qdrant` itself."""
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).as_posix() == "services/qdrant.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        via_ours = any(isinstance(node, ast.ImportFrom) and node.module == "kb_reindex.services.qdrant"
                       for node in tree.body)
        for line in _qdrant_imports(tree):
            if line in ("import qdrant_client", "from qdrant_client import ...") or not via_ours:
                wrong.append(f"{path.relative_to(PACKAGE)}: {line}")
    assert wrong == []


def test_a_process_opening_qdrant_builds_only_the_client_models_it_uses(tmp_path: Path) -> None:
    """Importing the store (as every command that opens Qdrant does) leaves the client's REST models unbuilt,
    pydantic's own `model_rebuild` back in place, and a local-mode round trip (collection, point, filtered
    query, alias) working: the models it uses are built on first use."""
    import json
    import subprocess
    import sys

    script = """
import inspect, json, pydantic
rebuild = pydantic.BaseModel.__dict__["model_rebuild"]
from kb_reindex.services.store import KnowledgeStore
from kb_reindex.services.qdrant import QdrantClient, models
unbuilt = [n for n, c in inspect.getmembers(models, inspect.isclass)
           if issubclass(c, pydantic.BaseModel) and not c.__pydantic_complete__]
client = QdrantClient(location=":memory:")
client.create_collection("c", vectors_config=models.VectorParams(size=2, distance=models.Distance.COSINE))
client.upsert("c", [models.PointStruct(id=1, vector=[1.0, 0.0], payload={"k": "a"})])
hit = client.query_points("c", query=[1.0, 0.0], limit=1, query_filter=models.Filter(
    must=[models.FieldCondition(key="k", match=models.MatchValue(value="a"))])).points[0].id
client.update_collection_aliases(change_aliases_operations=[
    models.CreateAliasOperation(create_alias=models.CreateAlias(collection_name="c", alias_name="live"))])
print(json.dumps([len(unbuilt), pydantic.BaseModel.__dict__["model_rebuild"] is rebuild, hit,
                  [a.alias_name for a in client.get_aliases().aliases], models.Filter.__pydantic_complete__]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    unbuilt, restored, hit, aliases, filter_built = json.loads(done.stdout.strip().splitlines()[-1])
    assert unbuilt > 100 and restored and hit == 1 and aliases == ["live"] and filter_built
