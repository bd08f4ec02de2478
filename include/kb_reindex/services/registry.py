"""The knowledge bases of a deployment: the registry file `KB_REGISTRY` names, or the environment's one.

A registry is YAML with one top-level key, `knowledge_bases`, a mapping from alias to that knowledge base's
settings (`RegistryEntry`). Its relative paths resolve against the registry file's folder; the environment's
settings (`KB_*`) are the defaults an entry overrides; the state DB is shared. On the embedded default each
knowledge base keeps its own local-mode folder, `<KB_QDRANT_PATH>/<alias>`, so no two ever wait for one store.

Without `KB_REGISTRY` the environment describes one knowledge base (`KB_ALIAS`), whose DAG ids carry no
alias, as they always have. Reading a registry is the only I/O a DAG file does at parse time: it opens neither
Qdrant nor the state DB. Every mistake is one `ConfigError` naming the file, the knowledge base and the key.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kb_reindex.domain.errors import ConfigError
from kb_reindex.domain.names import escaped
from kb_reindex.services.config import (ALIAS_PATTERN, EMBEDDERS, NO_GOLDEN_SET_ENV, Settings, knowledge_source,
                                        project_root)
from kb_reindex.services.object_store import is_uri
from kb_reindex.services.yaml_input import load_yaml

if TYPE_CHECKING:  # the state DB is never imported while a DAG file parses
    from kb_reindex.services.state.entries import RecordedEntry

REGISTRY_ENV = "KB_REGISTRY"
#: selects one registry entry, as `kb-reindex --kb` does
NAME_ENV = "KB_NAME"
DEFAULT_SCHEDULE = "@daily"
#: the Airflow pool of Qdrant writes; a registered knowledge base has its own, `<POOL>__<alias>`
POOL = "kb_qdrant_writes"
QDRANT_CONN_ID = "qdrant_default"
OLLAMA_CONN_ID = "ollama_default"
#: the Airflow Connection whose credentials read an s3:// source in the DAG tasks
AWS_CONN_ID = "aws_default"


#: the presets Airflow's cron timetables take besides cron expressions (airflow.utils.dates.cron_presets)
CRON_PRESETS = {"@hourly": "0 * * * *", "@daily": "0 0 * * *", "@weekly": "0 0 * * 0", "@monthly": "0 0 1 * *",
                "@quarterly": "0 0 1 */3 *", "@yearly": "0 0 1 1 *"}


def cron_problem(schedule: str, *, none: str = "null") -> str | None:
    """Why `schedule` is not a time schedule `knowledge_reindex` can run on, or None. Checked as Airflow's cron
    timetable checks it (its presets, then croniter), when the entry loads: a DAG made with a schedule Airflow
    cannot compute parses without an error and then never runs on time. `none`: how the setting says "no time
    schedule" (a registry's `null`, the environment's empty value)."""
    from croniter import croniter  # type: ignore[import-untyped]

    if croniter.is_valid(CRON_PRESETS.get(schedule, schedule)):
        return None
    return (f"{schedule!r} is not a cron expression (five fields, as '0 3 * * *') or a preset "
            f"({', '.join(CRON_PRESETS)}); {none}: triggered and watched runs only")


class RegistryEntry(BaseModel):
    """One knowledge base as the registry writes it; unset keys take the environment's settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: a folder (relative to the registry file) or a bucket URI, `s3://bucket/prefix`
    source: str = Field(min_length=1)
    golden_set: str | None = None
    #: cron or preset; `null` for triggered runs only; unset: KB_REINDEX_SCHEDULE (default @daily)
    schedule: str | None = None

    @field_validator("schedule")
    @classmethod
    def _a_cron_schedule(cls, value: str | None) -> str | None:
        if value is not None and value.strip() and (problem := cron_problem(value.strip())):
            raise ValueError(problem)
        return value
    embedder: str | None = None
    model: str | None = None
    dimension: int | None = Field(default=None, ge=1)
    payload_layout: str | None = None
    keep_versions: int | None = Field(default=None, ge=0)
    chunk_size: int | None = Field(default=None, ge=50)
    chunk_overlap: int | None = Field(default=None, ge=0)
    #: the tenant of a document whose front matter names none (default `default`)
    tenant: str | None = Field(default=None, min_length=1, max_length=128)
    #: the Airflow Connections of its Qdrant and its Ollama (one knowledge base may live on another Qdrant)
    qdrant_conn_id: str | None = Field(default=None, min_length=1)
    ollama_conn_id: str | None = Field(default=None, min_length=1)
    #: the freshness watcher: seconds between listings of `source` (0: not watched), and of quiet before a run
    source_poll_s: float | None = Field(default=None, ge=0, le=3600)
    source_quiet_s: float | None = Field(default=None, ge=0, le=3600)
    #: a DAG run with at most this many points to write runs as one task (KB_SMALL_RUN_POINTS; 0: never)
    small_run_points: int | None = Field(default=None, ge=0)
    #: the Airflow Connection (type aws) a DAG task reads an s3:// source with; default aws_default
    aws_conn_id: str | None = Field(default=None, min_length=1)
    #: warn, hold or block: what an instruction-like line live does not serve does (KB_INSTRUCTION_POLICY)
    instruction_policy: Literal["warn", "hold", "block"] | None = None


#: the environment variable each registry key overrides (what `Settings.from_env` reads)
ENV_OF_KEY = {"source": "KB_KNOWLEDGE_DIR", "golden_set": "KB_GOLDEN_SET", "embedder": "KB_EMBEDDER",
              "model": "KB_EMBED_MODEL", "dimension": "KB_EMBED_DIM", "payload_layout": "KB_PAYLOAD_LAYOUT",
              "keep_versions": "KB_KEEP_VERSIONS", "chunk_size": "KB_CHUNK_SIZE", "chunk_overlap": "KB_CHUNK_OVERLAP",
              "tenant": "KB_DEFAULT_TENANT", "source_poll_s": "KB_SOURCE_POLL_S", "source_quiet_s": "KB_SOURCE_QUIET_S",
              "small_run_points": "KB_SMALL_RUN_POINTS",
              "instruction_policy": "KB_INSTRUCTION_POLICY"}


@dataclass(frozen=True)
class KnowledgeBase:
    """One knowledge base of the deployment: its alias, where it came from and how Airflow runs it. Its
    `Settings` are made when a command or task runs (`settings`), from the environment of that process."""

    alias: str
    #: the registry file it is an entry of; None: the environment's one knowledge base
    registry: Path | None
    schedule: str | None
    qdrant_conn_id: str = QDRANT_CONN_ID
    ollama_conn_id: str = OLLAMA_CONN_ID
    aws_conn_id: str = AWS_CONN_ID
    #: the KB_* settings the entry sets, as `Settings.from_env` reads them
    env: Mapping[str, str] = field(default_factory=dict)
    #: a stand-in for on-call (`stand_in`): why its entry does not load now (refused, or no longer in the
    #: registry); None for an entry that loaded
    problem: str | None = None
    #: a stand-in's: when the entry it stands in for last loaded (None: made from the alias alone)
    recorded_at: str | None = None

    @property
    def registered(self) -> bool:
        return self.registry is not None

    @property
    def schedule_problem(self) -> str | None:
        """Why the environment's knowledge base has no `knowledge_reindex` DAG: KB_REINDEX_SCHEDULE is no cron.
        A registry entry's schedule is checked when it loads (its entry refused), so an entry has none. The
        schedule matters to Airflow alone: the other DAGs and every command go on (a rollback, a run by hand)."""
        if self.registered or not self.schedule or not (problem := cron_problem(self.schedule, none="empty")):
            return None
        return f"KB_REINDEX_SCHEDULE: {problem}; {self.dag_id('knowledge_reindex')} does not load until it is mended"

    def recorded(self) -> RecordedEntry:
        """This entry as the state DB keeps it (`StateStore.record_entry`): what on-call acts from once it no
        longer loads."""
        from kb_reindex.services.state.entries import RecordedEntry

        return RecordedEntry(alias=self.alias, registry=str(self.registry), schedule=self.schedule,
                             qdrant_conn_id=self.qdrant_conn_id, ollama_conn_id=self.ollama_conn_id,
                             aws_conn_id=self.aws_conn_id, env=dict(self.env))

    def dag_id(self, base: str) -> str:
        """`knowledge_reindex` for the environment's knowledge base, `knowledge_reindex__<alias>` for an entry."""
        return f"{base}__{self.alias}" if self.registered else base

    @property
    def pool(self) -> str:
        return f"{POOL}__{self.alias}" if self.registered else POOL

    def settings(self, env: Mapping[str, str] | None = None, *, on_call: bool = False, **overrides: Any) -> Settings:
        """The settings of this knowledge base: the environment, overridden by the entry, then `overrides`.
        `on_call`: a mistake in a setting on-call does not read is left out (`Settings.for_on_call`)."""
        env = os.environ if env is None else env
        make = Settings.for_on_call if on_call else Settings.from_env
        try:
            return make({**env, **self.env}, **overrides)
        except ConfigError as exc:
            if not self.registered:
                raise
            message = str(exc)
            for key, name in ENV_OF_KEY.items():
                if name in self.env:
                    message = message.replace(f"{name}=", f"{key}=")
            raise ConfigError(f"{self.registry}: knowledge base {self.alias!r}: {message}") from None


@dataclass(frozen=True)
class Registry:
    """The knowledge bases of the deployment in the registry's order, and the entries refused (one message
    each, naming the file, the knowledge base and the key): a bad entry never hides the good ones."""

    bases: tuple[KnowledgeBase, ...]
    errors: tuple[str, ...] = ()
    path: Path | None = None
    #: the refused entries whose alias is one Qdrant and Airflow take, by alias: their refusal. They keep
    #: on-call's surface (`stand_in`): a rollback DAG, the CLI's status/rollback/freeze, their page
    broken: Mapping[str, str] = field(default_factory=dict)
    #: every entry's alias in the registry's order, loaded or refused
    order: tuple[str, ...] = ()
    #: what loads but looks like a mistake (entries sharing one source): said, never refused
    warnings: tuple[str, ...] = ()

    @property
    def names(self) -> list[str]:
        return [kb.alias for kb in self.bases]

    @property
    def entries(self) -> int:
        """How many entries the registry lists, loaded or refused."""
        return len(self.bases) + len(self.errors)

    def in_order(self, bases: tuple[KnowledgeBase, ...]) -> tuple[KnowledgeBase, ...]:
        """`bases` (entries and stand-ins) in the registry's order."""
        rank = {alias: n for n, alias in enumerate(self.order)}
        return tuple(sorted(bases, key=lambda kb: rank.get(kb.alias, len(rank))))

    def stand_ins(self, env: Mapping[str, str] | None = None) -> tuple[KnowledgeBase, ...]:
        """The broken entries as stand-ins made from their alias alone (what a DAG file can know at parse time)."""
        return tuple(stand_in(alias, registry=self.path, problem=error, env=env) for alias, error in self.broken.items())

    def removed(self, recorded: Iterable[RecordedEntry]) -> tuple[KnowledgeBase, ...]:
        """Stand-ins for the recorded entries (`recorded`, the state DB's, of knowledge bases not retired) that
        this registry no longer lists at all: what they serve keeps on-call's surface until they are retired."""
        if self.path is None:
            return ()
        return tuple(stand_in(e.alias, registry=self.path, problem=removed_problem(e.alias, self.path, e), recorded=e)
                     for e in recorded if e.alias not in self.order and valid_alias(e.alias))

    def check(self) -> None:
        """Refuse the registry if any entry is refused."""
        if self.errors:
            raise ConfigError("; ".join(self.errors))

    def get(self, name: str) -> KnowledgeBase:
        for kb in self.bases:
            if kb.alias == name:
                return kb
        refused = [e for e in self.errors if f"knowledge base {name!r}" in e]
        if refused:
            raise ConfigError(refused[0])
        where = f"the registry {self.path}" if self.path else "this deployment (no KB_REGISTRY: KB_ALIAS)"
        raise ConfigError(f"knowledge base {name!r} is not in {where}; choose one of {', '.join(self.names) or 'none'}")

    def select(self, name: str | None, env: Mapping[str, str] | None = None) -> KnowledgeBase:
        """The knowledge base `name` (`--kb`) or else KB_NAME names; with none named, the only one there is,
        else a refusal naming them."""
        name = name or named_in(env)
        if name:
            return self.get(name)
        if len(self.bases) == 1 and not self.errors:
            return self.bases[0]
        if not self.bases:
            self.check()
        refused = f" ({len(self.errors)} refused: {'; '.join(self.errors)})" if self.errors else ""
        raise ConfigError(f"{self.entries} knowledge bases are registered in {self.path}{refused}; "
                          f"name one with --kb or KB_NAME: {', '.join([*self.names, *self.broken])}")


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (PyYAML would keep the last silently)."""


class _KeyTwice(ConfigError):
    """A key given twice in one mapping of the registry (its file named by the loader's caller)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _value in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise _KeyTwice(f"line {key_node.start_mark.line + 1}: {key!r} is given twice")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def registry_path(env: Mapping[str, str] | None = None) -> Path | None:
    """The registry file KB_REGISTRY names (relative to the project root), or None."""
    env = os.environ if env is None else env
    raw = env.get(REGISTRY_ENV, "").strip()
    if not raw:
        return None
    path = Path(raw).expanduser()
    return path if path.is_absolute() else (project_root(env) / path).resolve()


def environment_base(env: Mapping[str, str] | None = None) -> KnowledgeBase:
    """The one knowledge base the environment describes (no registry)."""
    env = os.environ if env is None else env
    schedule = env.get("KB_REINDEX_SCHEDULE", DEFAULT_SCHEDULE).strip() or None
    return KnowledgeBase(alias=env.get("KB_ALIAS", "mall_knowledge").strip(), registry=None, schedule=schedule)


def load_registry(env: Mapping[str, str] | None = None) -> Registry:
    """The deployment's knowledge bases: the registry's, or the environment's one. A file that cannot be read
    as a registry raises; a refused entry is one of `errors`, the others are kept."""
    env = os.environ if env is None else env
    path = registry_path(env)
    if path is None:
        return Registry(bases=(environment_base(env),))
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{REGISTRY_ENV}={env[REGISTRY_ENV]!r}: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{REGISTRY_ENV}: {path} cannot be read: {exc}") from None
    try:
        data = load_yaml(text, where=str(path), loader=_UniqueKeyLoader)
    except _KeyTwice as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict) or set(data) != {"knowledge_bases"}:
        found = sorted(map(str, data)) if isinstance(data, dict) else type(data).__name__
        raise ConfigError(f"{path}: the registry has one top-level key, knowledge_bases (found: {found})")
    entries = data["knowledge_bases"]
    if not isinstance(entries, dict) or not entries:
        raise ConfigError(f"{path}: knowledge_bases must map each alias to its settings; it lists none")
    bases, errors, broken = [], [], {}
    by_case: dict[str, str] = {}
    for alias, raw in entries.items():
        try:
            other = by_case.setdefault(str(alias).casefold(), str(alias))
            if other != str(alias):
                # Airflow's DAG ids and a filesystem's folders may tell them apart, a person reading them may not
                raise ConfigError(f"{path}: knowledge base {str(alias)!r}: its alias differs from {other!r} only by "
                                  "case; rename one (the first is kept)")
            bases.append(_entry(path, str(alias), raw, env))
        except ConfigError as exc:
            errors.append(str(exc))
            if valid_alias(str(alias)):
                broken[str(alias)] = str(exc)
    return Registry(bases=tuple(bases), errors=tuple(errors), path=path, broken=broken,
                    order=tuple(map(str, entries)), warnings=tuple(_shared_sources(path, bases)))


def _shared_sources(path: Path, bases: list[KnowledgeBase]) -> list[str]:
    """A warning per source read by more than one entry: allowed (two models of one folder, say), but as often
    a copied entry whose source was never changed."""
    readers: dict[str, list[str]] = {}
    for kb in bases:
        readers.setdefault(kb.env.get("KB_KNOWLEDGE_DIR", ""), []).append(kb.alias)
    return [f"{path}: knowledge bases {', '.join(aliases)} all read {source}: each builds and serves it on its own; "
            "if that is not meant, give each its own source" for source, aliases in readers.items()
            if source and len(aliases) > 1]


def valid_alias(alias: str) -> bool:
    return bool(ALIAS_PATTERN.match(alias)) and "__" not in alias


def _entry(path: Path, alias: str, raw: Any, env: Mapping[str, str]) -> KnowledgeBase:
    where = f"{path}: knowledge base {alias!r}"
    if not valid_alias(alias):
        raise ConfigError(f"{where}: not an alias Qdrant and Airflow take: use letters, digits, '-' or '_', "
                          "at most 63, and no '__' (it separates the parts of a collection name)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: its settings must be a mapping with at least `source`")
    try:
        entry = RegistryEntry.model_validate(raw)
    except ValidationError as exc:
        # every wrong key at once: one fix per run is a slow way to learn a registry
        problems = []
        for error in exc.errors():
            key = ".".join(map(str, error["loc"])) or "?"
            reason = "unknown key (known: " + ", ".join(RegistryEntry.model_fields) + ")" \
                if error["type"] == "extra_forbidden" else "missing" if error["type"] == "missing" else \
                error["msg"].removeprefix("Value error, ")
            problems.append(f"{escaped(key[:80])}: {reason}")
        raise ConfigError(f"{where}: {'; '.join(problems[:10])}"
                          + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")) from None
    if entry.embedder is not None and entry.embedder not in EMBEDDERS:
        raise ConfigError(f"{where}: embedder: {entry.embedder!r} is unknown; choose one of {', '.join(EMBEDDERS)}")
    folder = path.parent
    values: dict[str, str] = {"KB_ALIAS": alias}
    for key, name in ENV_OF_KEY.items():
        value = getattr(entry, key)
        if value is None:
            continue
        if key == "source":
            try:
                value = knowledge_source(folder, str(value), setting="source")
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
        elif key == "golden_set":
            value = str(_resolve(folder, str(value)))
        values[name] = str(value)
    if "KB_GOLDEN_SET" in values:
        if not Path(values["KB_GOLDEN_SET"]).is_file():
            raise ConfigError(f"{where}: golden_set: {values['KB_GOLDEN_SET']} does not exist")
    else:
        values.update(own_golden_set(path, alias, values["KB_KNOWLEDGE_DIR"]))
    qdrant_base = _resolve(project_root(env), env.get("KB_QDRANT_PATH", "").strip() or ".kb/qdrant")
    values["KB_QDRANT_PATH"] = str(qdrant_base / alias)
    schedule = entry.schedule if "schedule" in entry.model_fields_set else \
        (env.get("KB_REINDEX_SCHEDULE", DEFAULT_SCHEDULE).strip() or None)
    if "schedule" not in entry.model_fields_set and schedule and (problem := cron_problem(schedule)):
        raise ConfigError(f"{where}: schedule: unset, so KB_REINDEX_SCHEDULE: {problem}")
    kb = KnowledgeBase(alias=alias, registry=path, schedule=(schedule or "").strip() or None,
                       qdrant_conn_id=entry.qdrant_conn_id or QDRANT_CONN_ID,
                       ollama_conn_id=entry.ollama_conn_id or OLLAMA_CONN_ID,
                       aws_conn_id=entry.aws_conn_id or AWS_CONN_ID, env=values)
    kb.settings(env)  # every value checked now, as a run would check it
    return kb


def own_golden_set(path: Path, alias: str, source: str) -> dict[str, str]:
    """The golden set of an entry without `golden_set`: `golden.yaml` in its source folder when there is one (a
    local folder only), else explicitly none (NO_GOLDEN_SET_ENV): validated without probes, said as a warning. Never
    the environment's KB_GOLDEN_SET, another knowledge base's probes (the shop's, by default)."""
    if not is_uri(source) and (Path(source) / "golden.yaml").is_file():
        return {"KB_GOLDEN_SET": str(Path(source) / "golden.yaml")}
    return {NO_GOLDEN_SET_ENV: f"{path}'s entry {alias}"}


def removed_problem(alias: str, registry: Path, recorded: RecordedEntry) -> str:
    """Why an entry the state DB recorded, and the registry no longer lists, acts from its recorded entry."""
    return (f"knowledge base {alias!r} is no longer in the registry {registry} (its entry last loaded "
            f"{recorded.since}); what it serves is kept: retire it when done (`kb-reindex --kb {alias} retire "
            f"--reason ...`)")


def stand_in(alias: str, *, registry: Path | None, problem: str, recorded: RecordedEntry | None = None,
             env: Mapping[str, str] | None = None) -> KnowledgeBase:
    """What on-call acts on when `alias`'s entry does not load (`problem`): the entry as it last loaded
    (`recorded`, kept in the state DB), or the alias alone over the environment's settings with its own store
    folder, as a registry entry has. A rollback needs nothing else: no source, no golden set."""
    if recorded is not None:
        return KnowledgeBase(alias=alias, registry=registry or Path(recorded.registry), schedule=recorded.schedule,
                             qdrant_conn_id=recorded.qdrant_conn_id, ollama_conn_id=recorded.ollama_conn_id,
                             aws_conn_id=recorded.aws_conn_id, env={**recorded.env, "KB_ALIAS": alias},
                             problem=problem, recorded_at=recorded.since)
    env = os.environ if env is None else env
    qdrant_base = _resolve(project_root(env), env.get("KB_QDRANT_PATH", "").strip() or ".kb/qdrant")
    return KnowledgeBase(alias=alias, registry=registry, schedule=None,
                         env={"KB_ALIAS": alias, "KB_QDRANT_PATH": str(qdrant_base / alias)}, problem=problem)


def _resolve(folder: Path, value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else (folder / path).resolve()


def named_in(env: Mapping[str, str] | None = None) -> str | None:
    """The knowledge base KB_NAME names, if any."""
    return (os.environ if env is None else env).get(NAME_ENV, "").strip() or None


def select_knowledge_base(name: str | None = None, env: Mapping[str, str] | None = None) -> KnowledgeBase:
    """The knowledge base a command or task acts on: `name` (`--kb`), else KB_NAME, else the only one."""
    return load_registry(env).select(name, env)


def pool_slots() -> None:
    """`python -m kb_reindex.services.registry`: one line `<pool> <slots>` per knowledge base, for the scripts
    that create the pools (`make demo`, `make airflow`, the compose init); a refusal names the mistake."""
    import sys

    try:
        registry = load_registry()
        for message in registry.errors:
            print(f"kb-reindex: configuration error: {message}", file=sys.stderr)
        for kb in registry.bases:
            print(kb.pool, kb.settings().build_parallelism)
    except ConfigError as exc:
        print(f"kb-reindex: configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    pool_slots()
