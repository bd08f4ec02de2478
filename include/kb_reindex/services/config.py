"""Settings from the environment: one frozen object every step receives.

Relative paths resolve against the project root (``KB_PROJECT_ROOT`` or the checkout this package lives
in), never against the working directory, so the CLI, the DAGs and the tests agree on where `.kb/` is.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kb_reindex.domain.embedders import DEFAULT_DIMS, DEFAULT_EMBEDDER, DEFAULT_MODELS, EMBEDDERS
from kb_reindex.domain.errors import ConfigError
from kb_reindex.domain.validation_model import NoGoldenSet
from kb_reindex.services.object_store import is_uri, parse_bucket_uri

if TYPE_CHECKING:
    from kb_reindex.services.collection_config import CollectionConfig

ALIAS_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_\-]{0,62}$")


def model_or_default(embedder: str, model: str | None) -> str:
    """The model named, or when none is, the embedder's own default: never another embedder's (hashing
    vectors in a collection named after bge-m3)."""
    if embedder not in DEFAULT_MODELS:
        raise ConfigError(f"embedder {embedder!r} is unknown; choose one of {', '.join(EMBEDDERS)}")
    return (model or "").strip() or DEFAULT_MODELS[embedder]


def project_root(env: Mapping[str, str] | None = None) -> Path:
    """The folder holding `knowledge/` and `dags/`; the anchor for every relative path."""
    env = os.environ if env is None else env
    if env.get("KB_PROJECT_ROOT"):
        return Path(env["KB_PROJECT_ROOT"]).expanduser().resolve()
    checkout = Path(__file__).resolve().parents[3]
    if (checkout / "pyproject.toml").exists() and (checkout / "include" / "kb_reindex").is_dir():
        return checkout
    return Path.cwd().resolve()


def state_url_from_env(env: Mapping[str, str] | None = None) -> str:
    """KB_STATE_URL, or the SQLite file under the project: read alone where the other settings may be broken
    (a failed task still records its failure)."""
    env = os.environ if env is None else env
    url = env.get("KB_STATE_URL", "").strip() or f"sqlite:///{_resolve(project_root(env), '.kb/state.db')}"
    if not url.startswith(("sqlite", "mysql", "postgresql")):
        raise ConfigError("KB_STATE_URL must be a SQLAlchemy URL starting with sqlite:///, mysql+pymysql:// or "
                          "postgresql+psycopg://")
    if not url.startswith("sqlite"):
        _check_server_url(url)
    return url


def _check_server_url(url: str) -> None:
    """A database server's URL whose host and port SQLAlchemy can read, else one line (its password hidden)."""
    from sqlalchemy.engine import make_url

    shown = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)
    try:
        port = make_url(url).port
    except Exception as exc:  # SQLAlchemy's ValueError/ArgumentError: the URL is the user's, not a bug
        raise ConfigError(f"KB_STATE_URL={shown!r} cannot be read as a URL: {' '.join(str(exc).split())[:200]}") from None
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"KB_STATE_URL={shown!r}: port {port} is not a port (1-65535)")


def _resolve(root: Path, value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else (root / path).resolve()


#: what a registry entry without a golden set puts in its settings (`services.registry`) in place of
#: KB_GOLDEN_SET: where one is added, `<registry file>'s entry <alias>`; not a setting of its own
NO_GOLDEN_SET_ENV = "KB_NO_GOLDEN_SET"


def golden_set_of(root: Path, env: Mapping[str, str]) -> Path | NoGoldenSet:
    """The golden set file (KB_GOLDEN_SET, default `knowledge/golden.yaml`), or, for a registry entry that has
    none, explicitly none (`NoGoldenSet`, from NO_GOLDEN_SET_ENV, which wins over the environment's file)."""
    entry = env.get(NO_GOLDEN_SET_ENV, "").strip()
    if entry:
        return NoGoldenSet(entry=entry)
    return _resolve(root, env.get("KB_GOLDEN_SET", "knowledge/golden.yaml"))


def knowledge_source(root: Path, value: str, *, setting: str = "KB_KNOWLEDGE_DIR") -> str:
    """A source as the settings keep it: a bucket URI checked and normalised (`s3://bucket/prefix`), or a
    local path resolved against `root`."""
    if is_uri(value):
        return parse_bucket_uri(value, setting=setting).uri
    return str(_resolve(root, value))


def env_int(env: Mapping[str, str], name: str, default: int, *, minimum: int) -> int:
    """A whole number setting of at least `minimum`; the refusal names the setting."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"{name}={value} must be at least {minimum}")
    return value


def _number(env: Mapping[str, str], name: str, default: float, *, low: float, high: float, unit: str = "",
            above_low: bool = False, meaning: str = "") -> float:
    """A number, fractions allowed, from `low` (or above it) to `high`; the refusal names the setting and range."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number{f' of {unit}' if unit else ''}") from None
    if not (low < value if above_low else low <= value) or value > high:
        span = f"above {low:g} and at most {high:g}" if above_low else f"from {low:g}{meaning} to {high:g}"
        raise ConfigError(f"{name}={raw} must be {span}{f' {unit}' if unit else ''}")
    return value


#: KB_SOURCE_QUIET_S's defaults: a local folder (its file events) and a bucket (listed every poll)
FOLDER_QUIET_S, BUCKET_QUIET_S = 1.0, 5.0


def _seconds(env: Mapping[str, str], name: str, default: float, *, most: float = 3600.0) -> float:
    """A number of seconds, fractions allowed, from 0 to `most`."""
    return _number(env, name, default, low=0, high=most, unit="seconds")


#: near-duplicate chunks (kb_reindex.steps.duplicates): calibrated on multilingual-e5-small, bench/duplicates.py
DEFAULT_DUPLICATE_COSINE = 0.975


def _cosine(env: Mapping[str, str], name: str, default: float) -> float:
    """A cosine above 0 and at most 1 (1: only exact copies)."""
    return _number(env, name, default, low=0, high=1, above_low=True)


def _minutes(env: Mapping[str, str], name: str) -> float:
    """A window in minutes, fractions allowed; 0 (the default) is off."""
    return _number(env, name, 0.0, low=0, high=24 * 60, unit="minutes", meaning=" (off)")


def _bool(env: Mapping[str, str], name: str) -> bool:
    return bool(_optional_bool(env, name))


def _optional_bool(env: Mapping[str, str], name: str) -> bool | None:
    """None when unset: the Qdrant client then decides (e.g. https follows the URL's scheme)."""
    raw = env.get(name, "").strip().lower()
    if not raw:
        return None
    if raw in ("0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"{name}={raw!r} is not a boolean (true/false)")


def _qdrant_url(env: Mapping[str, str], https: bool | None) -> str | None:
    url = env.get("KB_QDRANT_URL", "").strip() or None
    if url is None:
        return None
    scheme = url.split("://", 1)[0].lower() if "://" in url else None
    if scheme is not None and scheme not in ("http", "https"):
        raise ConfigError(f"KB_QDRANT_URL={url.split('@')[-1]!r} must start with http:// or https://")
    if scheme is not None and https is not None and https != (scheme == "https"):
        # the client silently lets the URL's scheme win; a contradiction is a mistake worth naming
        raise ConfigError(f"KB_QDRANT_HTTPS={'true' if https else 'false'} contradicts the {scheme}:// scheme of "
                          "KB_QDRANT_URL; drop one of them")
    from urllib.parse import urlsplit

    shown = url.split("@")[-1]
    try:
        parts = urlsplit(url if scheme else f"http://{url}")
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"KB_QDRANT_URL={shown!r} cannot be read as a URL: {exc}") from None
    if not parts.hostname:
        raise ConfigError(f"KB_QDRANT_URL={shown!r} names no host")
    if port is not None and port == 0:
        raise ConfigError(f"KB_QDRANT_URL={shown!r}: port 0 is not a port (1-65535)")
    return url


def split_ollama_hosts(value: str, *, source: str = "OLLAMA_HOST") -> list[str]:
    """The Ollama servers a comma-separated value lists, each checked; errors name the entry by position and
    host, never its credentials."""
    from urllib.parse import urlsplit

    entries = [entry.strip() for entry in value.split(",")]
    hosts: list[str] = []
    for position, entry in enumerate(entries, start=1):
        where = f"{source} entry {position} of {len(entries)}"
        if not entry:
            raise ConfigError(f"{where} is empty; list servers separated by single commas, "
                              "e.g. http://ollama-a:11434,http://ollama-b:11434")
        scheme = entry.split("://", 1)[0].lower() if "://" in entry else "http"
        try:
            parts = urlsplit(entry if "://" in entry else f"http://{entry}")
            parts.port  # noqa: B018 - raises on a port that is not a number
        except ValueError:
            raise ConfigError(f"{where} ({entry.split('@')[-1]!r}) is not a host, host:port or URL") from None
        if scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"{where} ({entry.split('@')[-1]!r}) must be host:port or an http:// or https:// URL")
        if entry in hosts:
            raise ConfigError(f"{where} repeats {parts.hostname}{f':{parts.port}' if parts.port else ''}; "
                              "list each server once")
        hosts.append(entry)
    return hosts


def _port(env: Mapping[str, str], name: str, default: int) -> int:
    value = env_int(env, name, default, minimum=1)
    if value > 65535:
        raise ConfigError(f"{name}={value} is not a port (1-65535)")
    return value


def _collection_config(env: Mapping[str, str], root: Path) -> CollectionConfig | None:
    raw = env.get("KB_QDRANT_COLLECTION_CONFIG", "").strip()
    if not raw:
        return None
    from kb_reindex.services.collection_config import load_collection_config  # qdrant-client's models: only when set

    return load_collection_config(raw, source="KB_QDRANT_COLLECTION_CONFIG", root=root)


def _payload_layout(env: Mapping[str, str]) -> str:
    from kb_reindex.services.layouts import layout_spec

    return layout_spec(env.get("KB_PAYLOAD_LAYOUT", "").strip() or "native", env.get("KB_PAYLOAD_TEXT_KEY", ""))


INSTRUCTION_POLICIES = ("warn", "hold", "block")
#: how the instruction screen judges (kb_reindex.services.screen): `auto` is `meaning` except with the hashing embedder
INSTRUCTION_SCREENS = ("auto", "meaning", "patterns")


def _instruction_policy(env: Mapping[str, str]) -> str:
    """KB_INSTRUCTION_POLICY (default `hold`); the deprecated KB_BLOCK_ON_INSTRUCTIONS=true still means `block`
    where it is unset."""
    raw = env.get("KB_INSTRUCTION_POLICY", "").strip().lower()
    if not raw:
        return "block" if _bool(env, "KB_BLOCK_ON_INSTRUCTIONS") else "hold"
    if raw not in INSTRUCTION_POLICIES:
        raise ConfigError(f"KB_INSTRUCTION_POLICY={raw!r} is unknown; choose warn, hold or block")
    return raw


def _instruction_screen(env: Mapping[str, str]) -> str:
    raw = env.get("KB_INSTRUCTION_SCREEN", "").strip().lower() or "auto"
    if raw not in INSTRUCTION_SCREENS:
        raise ConfigError(f"KB_INSTRUCTION_SCREEN={raw!r} is unknown; choose auto, meaning or patterns")
    return raw


def _tenant(env: Mapping[str, str]) -> str:
    value = env.get("KB_DEFAULT_TENANT", "").strip() or "default"
    if len(value) > 128:
        raise ConfigError(f"KB_DEFAULT_TENANT is {len(value)} characters, over the limit of 128")
    return value


#: what on-call's commands and tasks read (`Settings.for_on_call`): a mistake here refuses them too
ON_CALL_READS = frozenset({
    "KB_PROJECT_ROOT", "KB_ALIAS", "KB_STATE_URL", "KB_QDRANT_URL", "KB_QDRANT_PATH", "KB_QDRANT_API_KEY",
    "KB_QDRANT_HTTPS", "KB_QDRANT_PREFIX", "KB_QDRANT_PREFER_GRPC", "KB_QDRANT_GRPC_PORT", "KB_QDRANT_TIMEOUT",
    "KB_QDRANT_COLLECTION_CONFIG", "KB_LOCK_TTL", "KB_LOCK_WAIT",
})
#: a setting an error names: `KB_CHUNK_SIZE=10 must be ...`, `OLLAMA_HOST: ...`
_NAMED_SETTING = re.compile(r"\b(KB_[A-Z0-9_]+|OLLAMA_HOST)\b")
#: at most this many mistakes left out, one error at a time
_MOST_IGNORED = 20


@dataclass(frozen=True)
class Settings:
    """Everything a reindex needs to know; secrets are kept out of ``repr``."""

    root: Path
    #: the knowledge: a local folder's resolved path, or a bucket URI (`s3://bucket/prefix`)
    knowledge_source: str
    #: its probes and thresholds, or explicitly none (a registry entry without one: `NoGoldenSet`)
    golden_set: Path | NoGoldenSet
    alias: str
    state_url: str = field(repr=False)
    qdrant_url: str | None
    qdrant_api_key: str | None = field(repr=False)
    qdrant_path: Path | None
    embedder: str
    embed_model: str
    embed_dim: int | None
    ollama_host: str
    ollama_timeout_s: float
    chunk_size: int
    chunk_overlap: int
    reports_dir: Path
    keep_versions: int
    embed_batch_size: int
    copy_batch_size: int
    max_doc_bytes: int
    lock_ttl_s: int
    #: `warn` (instruction-like lines are shown), `hold` (a version with a line live does not serve is built and
    #: validated, then held for a person, as content loss is) or `block` (a version holding one fails validation)
    instruction_policy: str = "hold"
    #: `auto`, `meaning` (patterns, then the classifier over e5) or `patterns` (kb_reindex.services.screen)
    instruction_screen: str = "auto"
    lock_wait_s: int = 30
    # Qdrant client options beyond the URL and key (the QdrantHook's options, and the timeout it lacks);
    # host/port come only from an Airflow Connection that names a host instead of a URL
    qdrant_https: bool | None = None
    qdrant_prefix: str | None = None
    qdrant_prefer_grpc: bool = False
    qdrant_grpc_port: int = 6334
    qdrant_timeout_s: int = 60
    qdrant_host: str | None = None
    qdrant_port: int = 6333
    # validated collection settings (kb_reindex.services.collection_config), None: inherit from live
    collection_config: CollectionConfig | None = field(default=None, hash=False)
    index_wait_s: int = 600
    snapshot_before_drop: bool = False
    # batch requests to Ollama in flight per task, spread over the servers OLLAMA_HOST lists
    embed_concurrency: int = 1
    # how payloads look to the consumer (kb_reindex.services.layouts): `native`, `langchain4j[:<text key>]`, ...
    payload_layout: str = "native"
    # the opt-in query log (personal data), replay before promotion and the watch after it
    query_log: bool = False
    query_log_keep: int = 5000
    replay_queries: int = 200
    watch_minutes: float = 0.0
    watch_interval_s: float = 60.0
    # slots of the Airflow pool kb_qdrant_writes: build slices writing at once (scripts and compose init set it)
    build_parallelism: int = 1
    # a DAG run with at most this many points to write (and no more than one build slice) runs build, validate,
    # promote and cleanup in one task (kb_reindex.rules.run_path); 0: always the mapped slices
    small_run_points: int = 1000
    # the tenant of a document whose front matter names none
    default_tenant: str = "default"
    # the freshness watcher (kb_reindex.domain.freshness): list the source every poll (0: not watched); fire
    # once it stayed unchanged this long
    source_poll_s: float = 15.0
    source_quiet_s: float = 5.0
    # cosine at or above which a new chunk and a chunk of another document are named near-duplicates
    duplicate_cosine: float = DEFAULT_DUPLICATE_COSINE
    #: on-call's settings (`for_on_call`): the mistakes in settings it does not read, each as its error said it,
    #: their defaults taken instead
    ignored: tuple[str, ...] = ()

    @classmethod
    def for_on_call(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """`from_env` for on-call's commands and tasks (status, rollback, freeze, a lock broken): a mistake in a
        setting they do not read (`ON_CALL_READS`: where the state DB, Qdrant and the alias are, the lock's
        timing, how a restored slot is made) does not take the way back away. Each such variable named by the
        error is left out and its default taken; the error is kept in `ignored`, for the caller to say. A
        mistake in what on-call reads, or one an error does not name, refuses as `from_env` does."""
        env = dict(os.environ if env is None else env)
        ignored: list[str] = []
        while True:
            try:
                settings = cls.from_env(env, **overrides)
            except ConfigError as exc:
                named = [name for name in dict.fromkeys(_NAMED_SETTING.findall(str(exc)))
                         if name in env and name not in ON_CALL_READS]
                if not named or len(ignored) >= _MOST_IGNORED:
                    raise
                ignored.append(str(exc))
                for name in named:
                    del env[name]
                continue
            return replace(settings, ignored=tuple(ignored)) if ignored else settings

    @property
    def ignored_problems(self) -> list[str]:
        """Each mistake `for_on_call` left out, as status, bases and a rollback's log say it."""
        return [f"{mistake} (left out here, its default taken: on-call does not read it; every run refuses until "
                "it is mended)" for mistake in self.ignored]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        env = os.environ if env is None else env
        root = project_root(env)
        alias = env.get("KB_ALIAS", "mall_knowledge").strip()
        if not ALIAS_PATTERN.match(alias) or "__" in alias:
            raise ConfigError(
                f"KB_ALIAS={alias!r} is not a valid alias: use letters, digits, '-' or '_' "
                "(no '__', which separates the parts of a collection name)"
            )
        embedder = env.get("KB_EMBEDDER", "").strip().lower() or DEFAULT_EMBEDDER
        if embedder not in EMBEDDERS:
            raise ConfigError(f"KB_EMBEDDER={embedder!r} is unknown; choose one of {', '.join(EMBEDDERS)}")
        qdrant_https = _optional_bool(env, "KB_QDRANT_HTTPS")
        qdrant_url = _qdrant_url(env, qdrant_https)
        qdrant_path = None if qdrant_url else _resolve(root, env.get("KB_QDRANT_PATH", ".kb/qdrant"))
        state_url = state_url_from_env(env)
        dim_raw = env.get("KB_EMBED_DIM", "").strip()
        embed_dim = env_int(env, "KB_EMBED_DIM", 0, minimum=1) if dim_raw else None
        if embed_dim is None:
            embed_dim = DEFAULT_DIMS.get(embedder)
        chunk_size = env_int(env, "KB_CHUNK_SIZE", 500, minimum=50)
        chunk_overlap = env_int(env, "KB_CHUNK_OVERLAP", 50, minimum=0)
        if chunk_overlap >= chunk_size // 2:
            raise ConfigError(f"KB_CHUNK_OVERLAP={chunk_overlap} must be less than half of KB_CHUNK_SIZE={chunk_size}")
        timeout_raw = env.get("KB_OLLAMA_TIMEOUT", "60").strip()
        try:
            ollama_timeout_s = float(timeout_raw)
        except ValueError:
            raise ConfigError(f"KB_OLLAMA_TIMEOUT={timeout_raw!r} is not a number of seconds") from None
        ollama_host = env.get("OLLAMA_HOST", "").strip() or "http://127.0.0.1:11434"
        split_ollama_hosts(ollama_host)  # a mistake in the list fails here, not at the first embedding
        source = knowledge_source(root, env.get("KB_KNOWLEDGE_DIR", "") or "knowledge/docs")
        settings = cls(
            root=root,
            knowledge_source=source,
            golden_set=golden_set_of(root, env),
            alias=alias,
            state_url=state_url,
            qdrant_url=qdrant_url,
            qdrant_api_key=env.get("KB_QDRANT_API_KEY") or None,
            qdrant_path=qdrant_path,
            embedder=embedder,
            embed_model=env.get("KB_EMBED_MODEL", "").strip() or DEFAULT_MODELS[embedder],
            embed_dim=embed_dim,
            ollama_host=ollama_host,
            ollama_timeout_s=ollama_timeout_s,
            chunk_size=chunk_size,
            chunk_overlap=chunk_overlap,
            reports_dir=_resolve(root, env.get("KB_REPORTS_DIR", ".kb/reports")),
            keep_versions=env_int(env, "KB_KEEP_VERSIONS", 2, minimum=0),
            embed_batch_size=env_int(env, "KB_EMBED_BATCH_SIZE", 32, minimum=1),
            copy_batch_size=env_int(env, "KB_COPY_BATCH_SIZE", 256, minimum=1),
            max_doc_bytes=env_int(env, "KB_MAX_DOC_BYTES", 2_000_000, minimum=1),
            lock_ttl_s=env_int(env, "KB_LOCK_TTL", 3600, minimum=10),
            instruction_policy=_instruction_policy(env),
            instruction_screen=_instruction_screen(env),
            lock_wait_s=env_int(env, "KB_LOCK_WAIT", 30, minimum=0),
            qdrant_https=qdrant_https,
            qdrant_prefix=env.get("KB_QDRANT_PREFIX", "").strip().strip("/") or None,
            qdrant_prefer_grpc=_bool(env, "KB_QDRANT_PREFER_GRPC"),
            qdrant_grpc_port=_port(env, "KB_QDRANT_GRPC_PORT", 6334),
            qdrant_timeout_s=env_int(env, "KB_QDRANT_TIMEOUT", 60, minimum=1),
            collection_config=_collection_config(env, root),
            index_wait_s=env_int(env, "KB_INDEX_WAIT_S", 600, minimum=0),
            snapshot_before_drop=_bool(env, "KB_SNAPSHOT_BEFORE_DROP"),
            embed_concurrency=env_int(env, "KB_EMBED_CONCURRENCY", 1, minimum=1),
            payload_layout=_payload_layout(env),
            query_log=_bool(env, "KB_QUERY_LOG"),
            query_log_keep=env_int(env, "KB_QUERY_LOG_KEEP", 5000, minimum=1),
            replay_queries=env_int(env, "KB_REPLAY_QUERIES", 200, minimum=0),
            watch_minutes=_minutes(env, "KB_WATCH_MINUTES"),
            watch_interval_s=float(env_int(env, "KB_WATCH_INTERVAL_S", 60, minimum=1)),
            build_parallelism=env_int(env, "KB_BUILD_PARALLELISM", 1, minimum=1),
            small_run_points=env_int(env, "KB_SMALL_RUN_POINTS", 1000, minimum=0),
            default_tenant=_tenant(env),
            source_poll_s=_seconds(env, "KB_SOURCE_POLL_S", 15.0),
            # a folder's file events are seen at once, so a burst of saves is over within its second of quiet
            source_quiet_s=_seconds(env, "KB_SOURCE_QUIET_S", BUCKET_QUIET_S if is_uri(source) else FOLDER_QUIET_S),
            duplicate_cosine=_cosine(env, "KB_DUPLICATE_COSINE", DEFAULT_DUPLICATE_COSINE),
        )
        settings = replace(settings, **overrides) if overrides else settings
        settings.check_build_parallelism()
        return settings

    def check_build_parallelism(self) -> None:
        """Local mode opens its folder for one client: slices writing at once would fail on its lock."""
        if self.build_parallelism > 1 and not self.qdrant_remote:
            raise ConfigError(
                f"KB_BUILD_PARALLELISM={self.build_parallelism} needs a Qdrant server (KB_QDRANT_URL): local mode "
                f"(KB_QDRANT_PATH={self.qdrant_path}) admits one client at a time; set KB_BUILD_PARALLELISM=1"
            )

    @property
    def knowledge_remote(self) -> bool:
        """The knowledge is in object storage (a bucket URI), not a local folder."""
        return is_uri(self.knowledge_source)

    @property
    def knowledge_dir(self) -> Path:
        """The local knowledge folder; a bucket source has none (`knowledge_source` is its URI)."""
        if self.knowledge_remote:
            raise ConfigError(f"KB_KNOWLEDGE_DIR is {self.knowledge_source}, not a local folder")
        return Path(self.knowledge_source)

    @property
    def qdrant_remote(self) -> bool:
        """A Qdrant server (URL or host) rather than local mode."""
        return bool(self.qdrant_url or self.qdrant_host)

    def with_embedder(self, *, embedder: str, model: str, dim: int | None) -> Settings:
        """The same deployment with another embedding model: used by reindex (live model) and migration."""
        if embedder not in EMBEDDERS:
            raise ConfigError(f"embedder {embedder!r} is unknown; choose one of {', '.join(EMBEDDERS)}")
        return replace(self, embedder=embedder, embed_model=model, embed_dim=dim)


def build_pool_slots() -> int:
    """`python -m kb_reindex.services.config`: the slots of the write pool, for the scripts that create it (`make demo`,
    `make airflow`, the compose init): KB_BUILD_PARALLELISM as the settings accept it, or a clear refusal."""
    import sys

    try:
        slots = Settings.from_env().build_parallelism
    except ConfigError as exc:
        print(f"kb-reindex: configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(slots)
    return slots


if __name__ == "__main__":
    build_pool_slots()
