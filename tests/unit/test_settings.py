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
