"""On-call's settings (`Settings.for_on_call`): a mistake in a setting a rollback does not read never takes the
way back away; a mistake in one it reads refuses as every other command does."""

from __future__ import annotations

from pathlib import Path

import pytest

from kb_reindex.domain.errors import ConfigError
from kb_reindex.services.config import Settings
from kb_reindex.services.registry import environment_base


def env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"KB_PROJECT_ROOT": str(tmp_path), **extra}


@pytest.mark.parametrize(("mistakes", "said"), [
    ({"KB_CHUNK_SIZE": "10"}, ["KB_CHUNK_SIZE=10 must be at least 50"]),
    ({"KB_KEEP_VERSIONS": "abc", "KB_EMBEDDER": "ollamma"},
     ["KB_EMBEDDER='ollamma' is unknown", "KB_KEEP_VERSIONS='abc' is not an integer"]),
    # an error naming two settings leaves both out (each alone would refuse again with the other's default)
    ({"KB_CHUNK_SIZE": "100", "KB_CHUNK_OVERLAP": "60"}, ["KB_CHUNK_OVERLAP=60 must be less than half of KB_CHUNK_SIZE"]),
])
def test_a_mistake_on_call_does_not_read_is_left_out_named_and_its_default_taken(
        tmp_path: Path, mistakes: dict[str, str], said: list[str]) -> None:
    with pytest.raises(ConfigError):
        Settings.from_env(env(tmp_path, **mistakes))
    settings = Settings.for_on_call(env(tmp_path, KB_ALIAS="shop", **mistakes))
    default = Settings.from_env(env(tmp_path, KB_ALIAS="shop"))
    assert all(any(m.startswith(s) for s in said) for m in settings.ignored)
    assert len(settings.ignored) == len(said)
    assert (settings.alias, settings.chunk_size, settings.keep_versions, settings.embedder) == (
        "shop", default.chunk_size, default.keep_versions, default.embedder)
    assert all("every run refuses until it is mended" in p for p in settings.ignored_problems)


@pytest.mark.parametrize(("name", "value"), [("KB_LOCK_TTL", "x"), ("KB_QDRANT_URL", "ftp://qdrant"),
                                             ("KB_ALIAS", "bad alias"), ("KB_STATE_URL", "oracle://db")])
def test_a_mistake_in_what_on_call_reads_refuses_it_too(tmp_path: Path, name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        Settings.for_on_call(env(tmp_path, **{name: value}))


def test_a_knowledge_base_gives_on_call_settings_only_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KB_PROJECT_ROOT", str(tmp_path))
    monkeypatch.setenv("KB_CHUNK_SIZE", "10")
    kb = environment_base()
    with pytest.raises(ConfigError, match="KB_CHUNK_SIZE=10"):
        kb.settings()
    assert kb.settings(on_call=True).ignored == ("KB_CHUNK_SIZE=10 must be at least 50",)


def test_a_failed_runs_lock_is_let_go_when_a_setting_it_does_not_need_is_mistyped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The failure callback reads the alias and the state DB alone: a run failed by `KB_KEEP_VERSIONS=abc`
    (deployed while it ran) still lets its lock go, so the next run need not wait for KB_LOCK_TTL."""
    from types import SimpleNamespace

    from kb_reindex.airflow.callbacks import release_run_lock
    from kb_reindex.rules.locking import reindex_lock_name
    from kb_reindex.run.dag_lock import dag_run_owner
    from kb_reindex.services.state.dag_runs import kb_run_id
    from kb_reindex.services.state.store import StateStore

    monkeypatch.setenv("KB_PROJECT_ROOT", str(tmp_path))
    for name in ("KB_REGISTRY", "KB_STATE_URL", "KB_ALIAS"):
        monkeypatch.delenv(name, raising=False)
    state = StateStore(Settings.from_env().state_url)
    try:
        run_id = kb_run_id("knowledge_reindex", "manual__1")
        state.acquire_lock(reindex_lock_name("mall_knowledge"), owner=dag_run_owner(run_id), ttl_s=3600)
        monkeypatch.setenv("KB_KEEP_VERSIONS", "abc")
        release_run_lock({"dag": SimpleNamespace(dag_id="knowledge_reindex"), "run_id": "manual__1"})
        assert state.lock_held_by(reindex_lock_name("mall_knowledge")) is None
    finally:
        state.dispose()
