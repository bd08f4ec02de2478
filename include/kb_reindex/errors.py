"""Errors a user can act on. Each message names the file, field or value at fault."""

from __future__ import annotations


class KbError(Exception):
    """Base of every error kb-reindex raises on purpose."""

    #: the pipeline step that failed, recorded on the version
    step: str = "run"


class ConfigError(KbError):
    """A setting or argument is wrong; the CLI exits 2."""


class StoreUnreachable(ConfigError):
    """Nothing answers at the configured Qdrant URL: a setting to check from the CLI (exit 2), but in
    Airflow a server restarting for a minute, so its tasks retry it."""


class SourceError(KbError):
    """A knowledge document cannot be used as it is."""

    step = "plan"


class KnowledgeFolderMissing(SourceError, ConfigError):
    """KB_KNOWLEDGE_DIR names no folder: a setting to fix (exit 2), found while reading the sources."""


class SourceChangedError(KbError):
    """A file changed while the plan read it (between its scan and its snapshot): a new run plans again."""

    step = "plan"


class GoldenSetError(KbError):
    """The golden set file is malformed or names documents that do not exist."""

    step = "validate"


class EmbeddingError(KbError):
    """The embedder failed or answered something that must not be written."""

    step = "build"


class ModelNotServed(ConfigError, EmbeddingError):
    """The embedder cannot serve the model asked for: nothing may be built and named after that model."""


class StoreError(KbError):
    """Qdrant refused, or holds something this run cannot safely use."""


class AliasReadBackError(StoreError):
    """Qdrant answered an alias move with success, but the alias does not resolve to the target."""

    step = "promote"


class StateDriftError(KbError):
    """Qdrant and the state DB disagree; an operator must look before anything moves."""

    step = "plan"


class AliasMovedError(KbError):
    """Compare-and-swap refusal: the alias no longer points where this run planned."""

    step = "promote"


class LockHeldError(KbError):
    """Another run holds the reindex lock for this alias."""


class LockLostError(LockHeldError):
    """A DAG run's lock was broken by on-call or expired and was taken: no retry can get it back."""


class FencedError(LockLostError):
    """A run that no longer holds its lock tried to write (a batch, or the promotion): stopped before it."""


class ValidationFailed(KbError):
    """The candidate version did not pass validation; nothing was promoted."""

    step = "validate"


class RollbackRefused(KbError):
    """The rollback target is missing, broken or not confirmed."""

    step = "rollback"
