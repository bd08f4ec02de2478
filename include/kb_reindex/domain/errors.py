"""Errors a user can act on. Each message names the file, field or value at fault."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass


class KbError(Exception):
    """Base of every error kb-reindex raises on purpose."""


class ConfigError(KbError):
    """A setting or argument is wrong; the CLI exits 2."""


class StateMissing(ConfigError):
    """A read-only command found no state DB file where KB_STATE_URL points (SQLite): nothing has been built
    with this configuration yet, or the path is wrong."""


class StateEmpty(ConfigError):
    """The state DB exists but holds no kb-reindex table: a first run creates them (a read-only command
    refuses, naming the URL; `plan` previews that first run)."""


class StoreUnreachable(ConfigError):
    """Nothing answers at the configured Qdrant URL: unavailable (the CLI's exit 3), or a setting to check; in
    Airflow a server restarting for a minute, so its tasks retry it."""


class SourceError(KbError):
    """A knowledge document cannot be used as it is."""


class KnowledgeFolderMissing(SourceError, ConfigError):
    """KB_KNOWLEDGE_DIR names no folder: a setting to fix (exit 2), found while reading the sources."""


class SourceRefused(SourceError, ConfigError):
    """The object store refused the credentials it was given for the knowledge bucket (a wrong or missing key,
    no permission to list or read it): a setting to fix (exit 2)."""


class SourceUnreachable(KbError):
    """The object store holding the knowledge (an S3 endpoint) does not answer: unavailable (the CLI's exit 3);
    in Airflow the plan task retries it."""


class SourceChangedError(KbError):
    """A file changed while the plan read it (between its scan and its snapshot): a new run plans again."""


class GoldenSetError(KbError):
    """The golden set file is malformed or names documents that do not exist."""


class GoldenSetMissing(GoldenSetError, ConfigError):
    """KB_GOLDEN_SET names no file: a setting to fix (exit 2), as a missing KB_KNOWLEDGE_DIR is."""


class EmbeddingError(KbError):
    """The embedder failed or answered something that must not be written."""


class EmbedderUnavailable(EmbeddingError):
    """No Ollama server answered, after every retry: unavailable (the CLI's exit 3), not a setting to change."""


class ModelNotServed(ConfigError, EmbeddingError):
    """The embedder cannot serve the model asked for: nothing may be built and named after that model."""


class DimensionMismatch(ConfigError):
    """The dimension asked for is not the one the embedder answers: refused at plan time, never retried."""


class StoreError(KbError):
    """Qdrant refused, or holds something this run cannot safely use."""


class AliasReadBackError(StoreError):
    """Qdrant answered an alias move with success, but the alias does not resolve to the target."""


class StateDriftError(KbError):
    """Qdrant and the state DB disagree; an operator must look before anything moves."""


class AliasMovedError(KbError):
    """Compare-and-swap refusal: the alias no longer points where this run planned."""


class AliasFrozen(KbError):
    """The alias is frozen (`kb-reindex freeze`): nothing moves it forward until `kb-reindex unfreeze`; the
    version stays ready. Not a failure of the version: a run that meets it ends `frozen`."""


class LockHeldError(KbError):
    """Another run holds the reindex lock for this alias."""


class LockLostError(LockHeldError):
    """A DAG run's lock was broken by on-call or expired and was taken: no retry can get it back."""


class FencedError(LockLostError):
    """A run that no longer holds its lock tried to write (a batch, or the promotion): stopped before it."""


class ValidationFailed(KbError):
    """The candidate version did not pass validation; nothing was promoted."""


class RollbackRefused(KbError):
    """The rollback target is missing, broken or not confirmed."""


class ReviewRefused(KbError):
    """A person's answer to a held version that no longer applies: the version is not ready, or served."""


class StateUnreachable(KbError):
    """The state DB stopped answering (its server or the network to it went away): nothing can be recorded
    until it is back; the next run then records the interrupted one as failed and resumes its version."""


# --- one error policy: an exception -> (transient or permanent, kind, exit code, one line) -------------------

#: errors no retry can fix: a task fails fast on them instead of retrying
PERMANENT: tuple[type[KbError], ...] = (ValidationFailed, AliasMovedError, StateDriftError, SourceError,
                                        SourceChangedError, GoldenSetError, ConfigError, RollbackRefused,
                                        LockLostError, AliasFrozen)


#: the CLI's exit code when a server it needs does not answer (Qdrant, the state DB, Ollama): distinct from 2, a
#: setting to fix, because what helps is waiting or calling whoever runs the server, not editing a setting
UNAVAILABLE_EXIT = 3
#: exceptions that say a server is unavailable, and the failure kind each is reported as
UNAVAILABLE: dict[type[KbError], str] = {StoreUnreachable: "store_unreachable", StateUnreachable: "state_unreachable",
                                         EmbedderUnavailable: "embedder_unreachable",
                                         SourceUnreachable: "source_unreachable"}
UNAVAILABLE_KINDS = frozenset(UNAVAILABLE.values())


@dataclass(frozen=True)
class Failure:
    """How every caller (the CLI, the engine, the Airflow tasks) reports and treats one exception."""

    kind: str  # "config" (a setting to fix), a KbError's class name, "state_unreachable", "store_unreachable", "unexpected"
    transient: bool  # another attempt later may succeed: an Airflow task retries it; False fails the task now
    exit_code: int  # the CLI's: 3 a server unavailable, 2 a setting to fix, 1 a failed run
    message: str  # one line: what failed, where, what to do
    expected: bool = True  # False: a bug or an unknown failure, whose traceback is worth logging
    #: False when the request never got through (bad URL, name not resolved, connection refused or not made in
    #: time): nothing happened on the other side, so a write may be sent again without asking whether it landed
    reached: bool = True


def classify(exc: BaseException, *, state_url: str | None = None, qdrant: Callable[[BaseException], str | None] | None = None) -> Failure:
    """The one mapping from an exception to how it is reported and retried.

    `state_url` names the state DB in a message about it (password masked); `qdrant` describes a failure of
    the Qdrant client in one line naming the server (store.describe_qdrant_failure bound to the settings)."""
    if isinstance(exc, KbError):
        permanent = isinstance(exc, PERMANENT) and not isinstance(exc, StoreUnreachable)
        unavailable = next((k for t, k in UNAVAILABLE.items() if isinstance(exc, t)), None)
        kind = unavailable or ("config" if isinstance(exc, ConfigError) else type(exc).__name__)
        code = UNAVAILABLE_EXIT if unavailable else 2 if isinstance(exc, ConfigError) else 1
        # as raised: a list of bad documents keeps one line per document
        return Failure(kind, not permanent, code, str(exc))
    if (database := state_db_failure(exc)) is not None:
        return Failure("state_unreachable", True, UNAVAILABLE_EXIT, state_unreachable_message(database, state_url))
    reached = not never_sent(exc)
    if qdrant is not None and (said := qdrant(exc)) is not None:
        if refused_credentials(exc):  # a key to set or fix: no retry helps
            return Failure("config", False, 2, one_line(said), reached=reached)
        return Failure("store_unreachable", True, UNAVAILABLE_EXIT, one_line(said), reached=reached)
    return Failure("unexpected", True, 1, one_line(f"{type(exc).__name__}: {exc}"), expected=False, reached=reached)


def refused_credentials(exc: BaseException) -> bool:
    """A server answered HTTP 401 or 403: it wants credentials we lack, or refused the ones we sent."""
    return getattr(exc, "status_code", None) in (401, 403)


def never_sent(exc: BaseException) -> bool:
    """The HTTP request never left (an invalid URL, or a connection not made: name, refusal, TLS, timeout), so
    the server cannot have acted on it; False when it may have arrived (a read timeout, a lost answer)."""
    import httpx

    return any(isinstance(cause, (httpx.ConnectError, httpx.ConnectTimeout, httpx.InvalidURL)) for cause in causes(exc))


def one_line(text: str) -> str:
    """A message on one line, without SQLAlchemy's "(Background on this error at: ...)" link."""
    return " ".join(text.split("(Background on this error")[0].split())


def causes(exc: BaseException) -> Iterator[BaseException]:
    """The exception and everything it was raised from or during, each once (explicit and implicit chains,
    PyMySQL's `original_exception`, SQLAlchemy's `orig` and the Qdrant client's `source`)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [e for e in (current.__cause__, current.__context__, getattr(current, "original_exception", None),
                             getattr(current, "orig", None), getattr(current, "source", None))
                 if isinstance(e, BaseException)]


def connect_failure(exc: BaseException) -> str | None:
    """What a failed connection met, in words: the name did not resolve, the connection was refused, timed
    out, TLS failed or the connection was lost; None when no cause in the chain says."""
    import socket  # here, not at import: the CLI's --help imports this module's names and never gets here
    import ssl

    for cause in causes(exc):
        if isinstance(cause, socket.gaierror):
            return "name not resolved"
        if isinstance(cause, ssl.SSLError):
            return f"TLS failed ({cause.reason or one_line(str(cause))})"
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        if isinstance(cause, TimeoutError):
            return "timed out"
        if isinstance(cause, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
            return "connection lost"
    for cause in causes(exc):
        text = str(cause)
        for words, said in _CONNECT_WORDS:
            if words in text:
                return said
    return None


#: what drivers say in text only (PyMySQL's 2003/2013 messages, httpx's transport errors)
_CONNECT_WORDS = (
    ("Name or service not known", "name not resolved"),
    ("nodename nor servname", "name not resolved"),
    ("Temporary failure in name resolution", "name not resolved"),
    ("Connection refused", "connection refused"),
    ("timed out", "timed out"),
    ("Lost connection", "connection lost"),
    ("server has gone away", "connection lost"),
    ("CERTIFICATE_VERIFY_FAILED", "TLS failed (certificate not verified)"),
)


def state_db_failure(exc: BaseException) -> BaseException | None:
    """The driver's connection error when the exception (or one it was raised from) is the state DB's
    connection failing, else None. A query the state DB refused is not this: that is a bug or a schema."""
    import sqlalchemy as sa

    for cause in causes(exc):
        if isinstance(cause, sa.exc.DBAPIError) and (cause.connection_invalidated or isinstance(
                cause, (sa.exc.OperationalError, sa.exc.InterfaceError)) and connect_failure(cause) is not None):
            return cause
    return None


def first_line(exc: BaseException | None) -> str:
    """An exception's first line, or its class name when it says nothing."""
    return str(exc).splitlines()[0] if exc is not None and str(exc) else type(exc).__name__


def state_unreachable_message(exc: BaseException, state_url: str | None) -> str:
    where = f" at {mask_url(state_url)}" if state_url else ""
    what = connect_failure(exc) or "connection failed"
    driver = one_line(first_line(getattr(exc, "orig", None) or exc))
    return (f"state DB{where} is unreachable ({what}: {driver}); check KB_STATE_URL (or the kb_state Connection) and "
            "that the server runs. This run could not be recorded and the live alias was not touched; when the state "
            "DB answers again, `kb-reindex run` (or the next DAG run) records this run as failed and resumes its version")


def mask_url(url: str) -> str:
    """A SQLAlchemy URL for messages: the password masked."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL: say nothing of it rather than risk a secret
        return "(KB_STATE_URL)"
