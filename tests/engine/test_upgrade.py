"""The upgrade to the version model: a deployment made by the release before it (one collection per version,
`<alias>__<model>__v<N>`) keeps serving and rolling back, and its first run after the upgrade moves to slots
without a manual step. The state DB and the local store are made by that release itself, its package taken
from git, run as its CLI in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

import pytest

from conftest import REPO

#: the last release with a collection per version
BEFORE_SLOTS = "0a70e71"
#: the last release whose manifests held a row per chunk (kb_manifest_chunks), before document revisions
BEFORE_REVISIONS = "b9cb78b"
ALIAS = "mall_knowledge"


def release(commit: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """That commit's package, taken from git."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit, "include"],
                             capture_output=True, timeout=60)
    assert archive.returncode == 0, (f"git cannot give the release {commit}: "
                                     f"{archive.stderr.decode()[-500:]}; a full clone is needed")
    where = tmp_path_factory.mktemp(f"release-{commit}")
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(where, filter="data")
    return where / "include"


@pytest.fixture(scope="module")
def old_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return release(BEFORE_SLOTS, tmp_path_factory)


def cli(project: Path, *argv: str, package: Path | None = None) -> tuple[int, dict]:
    """The old release's CLI in a subprocess (`package`), or this one's in the test's process."""
    if package is None:
        return new_cli(project, *argv)
    env = {**os.environ, "KB_PROJECT_ROOT": str(project), "KB_EMBEDDER": "hashing", "PYTHONPATH": str(package)}
    env.pop("KB_REGISTRY", None)
    done = subprocess.run([sys.executable, "-c", "import sys; from kb_reindex.cli import main; "
                           "sys.exit(main(sys.argv[1:]))", *argv, "--json", "-q"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=project)
    try:
        return done.returncode, json.loads(done.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"exit {done.returncode}: {done.stdout[-1000:]}\n{done.stderr[-3000:]}") from None


def new_cli(project: Path, *argv: str) -> tuple[int, dict]:
    import contextlib
    import io

    from kb_reindex.cli import main

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setenv("KB_PROJECT_ROOT", str(project))
        patch.setenv("KB_EMBEDDER", "hashing")
        patch.delenv("KB_REGISTRY", raising=False)
        code = main([*argv, "--json", "-q"])
    return code, json.loads(out.getvalue())


def edit(project: Path, key: str, extra: str) -> None:
    path = project / "knowledge" / "docs" / f"{key}.md"
    path.write_text(path.read_text(encoding="utf-8") + f"\n\n{extra}\n", encoding="utf-8")


def test_a_deployment_of_the_release_before_slots_keeps_serving_and_moves_to_slots(project: Path,
                                                                                   old_release: Path) -> None:
    for n, key in enumerate(["", "coupon-rules", "shipping-policy"]):
        if key:
            edit(project, key, f"补充{n}：升级前。")
        code, run = cli(project, "run", package=old_release)
        assert code == 0 and run["outcome"] == "promoted", run
        assert run["collection"].endswith(f"__v{n + 1}")  # made the old way

    # the new release reads it: what serves, the rollback target one move away, no problem
    code, status = cli(project, "status")
    assert code == 0, status
    assert status["live"]["version"] == 3 and status["rollback_target"] == 2 and status["problems"] == []
    assert {r["version"]: r["one_move_away"] for r in status["residence"]} == {2: True, 1: True}

    # its first run after the upgrade builds into a slot, with no manual step
    edit(project, "payment-guide", "补充：升级后第一版。")
    code, run = cli(project, "run")
    assert code == 0 and run["outcome"] == "promoted", run
    assert run["version"] == 4 and run["collection"].endswith("__s1")
    # and rolls back to the version the old release made, in one move
    code, back = cli(project, "rollback", "--reason", "upgrade check", "--yes", "--live-version", "4")
    assert code == 0 and back["to_version"] == 3 and back["collection"].endswith("__v3"), back
    code, status = cli(project, "status")
    assert code == 0 and status["live"]["version"] == 3 and status["problems"] == [], status
    # v4, rolled away from, stays one move away while the next build runs: that build takes a slot of its own
    assert {r["version"]: r["one_move_away"] for r in status["residence"]}[4] is True
    edit(project, "payment-guide", "补充：升级后第二版。")
    code, run = cli(project, "run")
    assert code == 0 and run["outcome"] == "promoted" and run["collection"].endswith("__s2"), run
    code, status = cli(project, "status")
    assert code == 0 and status["problems"] == [], status
    # and the build after it writes only what differs: v4 (now neither live, nor the rollback target, nor the
    # version just left) gives its slot
    edit(project, "payment-guide", "补充：升级后第三版。")
    code, run = cli(project, "run")
    assert code == 0 and run["outcome"] == "promoted" and run["collection"].endswith("__s1"), run
    assert run["build"]["kept"] > 0 and run["build"]["copied"] + run["build"]["embedded"] < run["build"]["kept"]


def test_a_deployment_of_the_release_before_revisions_keeps_serving_and_its_manifests_move_to_revisions(
        project: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Made by the release whose manifests held a row per chunk: the new release's first command splits them
    into document revisions (the old table emptied), every kept version still serves, rolls back and restores,
    and its first edit writes only what differs, its difference taken against a converted manifest."""
    import sqlalchemy as sa

    before = release(BEFORE_REVISIONS, tmp_path_factory)
    for n, key in enumerate(["", "coupon-rules", "shipping-policy", "coupon-rules"]):
        if key:
            edit(project, key, f"补充{n}：升级前。")
        code, run = cli(project, "run", package=before)
        assert code == 0 and run["outcome"] == "promoted" and run["version"] == n + 1, run
    engine = sa.create_engine(f"sqlite:///{project / '.kb' / 'state.db'}")
    with engine.connect() as conn:
        old_rows = conn.execute(sa.text("SELECT count(*) FROM kb_manifest_chunks")).scalar_one()
    assert old_rows > 0, "the old release wrote a row per chunk"

    code, status = cli(project, "status")  # read-only: converts, then reads
    assert code == 0 and status["live"]["version"] == 4 and status["rollback_target"] == 3, status
    assert status["problems"] == [], status
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM kb_manifest_chunks")).scalar_one() == 0
        assert conn.execute(sa.text("SELECT count(*) FROM kb_manifest_documents WHERE rev_id IS NULL")).scalar_one() == 0

    edit(project, "payment-guide", "补充：升级后第一版。")
    code, run = cli(project, "run")
    assert code == 0 and run["outcome"] == "promoted" and run["version"] == 5, run
    assert run["build"]["kept"] > 0 and run["build"]["copied"] + run["build"]["embedded"] < run["build"]["kept"], run
    code, back = cli(project, "rollback", "--reason", "upgrade check", "--yes", "--live-version", "5")
    assert code == 0 and back["to_version"] == 4, back
    residence = {r["version"]: r["one_move_away"] for r in cli(project, "status")[1]["residence"]}
    older = min(v for v, one_move in residence.items() if not one_move)  # its slot taken: needs a restore
    code, restored = cli(project, "restore", "--version", str(older))
    assert code == 0, restored
    code, status = cli(project, "status")
    assert code == 0 and status["problems"] == [], status
    assert {r["version"]: r["one_move_away"] for r in status["residence"]}[older] is True
    engine.dispose()
