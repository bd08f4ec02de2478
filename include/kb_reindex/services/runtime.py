"""What every step needs, opened once: settings, the state DB and the Qdrant store."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from kb_reindex.domain.waiting import Sleeping, Waiter
from kb_reindex.services.config import Settings
from kb_reindex.services.object_store import CLI_CREDENTIALS, BucketAccess, env_filesystem, parse_bucket_uri
from kb_reindex.services.sources import KnowledgeSource
from kb_reindex.services.state.store import StateStore
from kb_reindex.services.state.versions import VersionRecord

if TYPE_CHECKING:  # Qdrant's client (half a second to import) only where Qdrant is opened: `StateDeps` needs none
    from qdrant_client import QdrantClient

    from kb_reindex.services.embedding import Embedder
    from kb_reindex.services.store import KnowledgeStore

#: the part of the state store a step uses (a protocol of `services.state.ports`)
StateT_co = TypeVar("StateT_co", covariant=True)


class StepDeps(Protocol[StateT_co]):
    """What a step of the version model takes: the settings, the Qdrant store and only the part of the state
    store it uses (`StepDeps[SlotState]`). A `Deps` is one; so is a test's stand-in with a narrower state."""

    @property
    def settings(self) -> Settings: ...

    @property
    def state(self) -> StateT_co: ...

    @property
    def store(self) -> KnowledgeStore: ...


@dataclass
class Deps:
    settings: Settings
    state: StateStore
    store: KnowledgeStore
    ollama_headers: dict[str, str] | None = field(default=None, repr=False)
    #: how a bucket source is reached: a DAG task's ObjectStoragePath with its Airflow Connection; None: s3fs
    #: with the AWS environment (the CLI)
    bucket_access: BucketAccess | None = field(default=None, repr=False)
    #: how a step waits for another run's lock or for Qdrant's index: sleeping (the CLI), or, in a DAG task,
    #: giving the worker slot back between looks (kb_reindex.airflow.waiting)
    waiter: Waiter = field(default_factory=Sleeping, repr=False)
    _knowledge: KnowledgeSource | None = field(default=None, init=False, repr=False)

    @property
    def knowledge(self) -> KnowledgeSource:
        """The knowledge source, opened when first asked for (only the plan reads it)."""
        if self._knowledge is None:
            self._knowledge = open_source(self.settings, self.bucket_access)
        return self._knowledge

    def embedder_for(self, version: VersionRecord) -> Embedder:
        """The model a version was built with, reached through this deployment's connection settings."""
        from kb_reindex.services.embedding import make_embedder

        return make_embedder(
            self.settings.with_embedder(embedder=version.embedder, model=version.embed_model, dim=version.embed_dim),
            headers=self.ollama_headers,
        )


@dataclass
class StateDeps:
    """The state DB alone: history and breaking a lock need nothing of Qdrant."""

    settings: Settings
    state: StateStore


@dataclass
class ReaderDeps:
    """What reading through the alias needs: no state DB (it may be lost, locked or down)."""

    settings: Settings
    store: KnowledgeStore
    ollama_headers: dict[str, str] | None = field(default=None, repr=False)


@contextmanager
def open_reader(settings: Settings, *, client: QdrantClient | None = None) -> Iterator[ReaderDeps]:
    from kb_reindex.services.store import open_store

    with open_store(settings, client=client, create=False) as store:
        yield ReaderDeps(settings=settings, store=store)


@contextmanager
def open_deps(
    settings: Settings, *, client: QdrantClient | None = None, state: StateStore | None = None, create: bool = True
) -> Iterator[Deps]:
    """`create=False` for read-only commands: neither a state DB nor a local Qdrant folder is made."""
    from kb_reindex.services.store import open_store

    own_state = state is None
    state = state or StateStore(settings.state_url, create=create)
    try:
        with open_store(settings, client=client, create=create) as store:
            yield Deps(settings=settings, state=state, store=store)
    finally:
        if own_state:
            state.dispose()


def open_source(settings: Settings, access: BucketAccess | None = None) -> KnowledgeSource:
    """The knowledge source of the settings: a local folder, or a bucket through `access` (an Airflow task's
    ObjectStoragePath) or else s3fs with the AWS environment."""
    if not settings.knowledge_remote:
        return KnowledgeSource.folder(Path(settings.knowledge_source))
    location = parse_bucket_uri(settings.knowledge_source)
    if access is not None:
        return KnowledgeSource.in_bucket(location, access.filesystem(location.uri), credentials=access.credentials)
    return KnowledgeSource.in_bucket(location, env_filesystem(), credentials=CLI_CREDENTIALS)


def new_run_id(kind: str) -> str:
    return f"cli__{kind}__{uuid.uuid4().hex[:12]}"
