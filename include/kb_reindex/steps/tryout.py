"""Try a version before it serves: search one version's collection directly, not through the alias.

`kb-reindex query --version N` and the Knowledge index page's question box for a chosen version call
`search_version`. Any kept version answers (building, ready, a shadow, held, frozen, retired, failed while its
collection is still there); a deleted or unknown one is refused naming N. The query is embedded with that
version's own model, and filtered by tenant exactly as the reader filters (`KnowledgeStore.search`). A try-out
is not a customer's query: it is never written to the query log.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kb_reindex.domain.errors import ConfigError, KbError
from kb_reindex.domain.model import VersionStatus
from kb_reindex.services.layouts import SearchHit, version_profile
from kb_reindex.services.runtime import Deps


@dataclass(frozen=True)
class VersionAnswer:
    """What one version answered; `to_dict()` is `kb-reindex query --version N --json`, the reader's answer
    with the version's `status` and `collection` beside it."""

    alias: str
    version: int
    status: str
    collection: str
    serving: bool
    embed_model: str
    embed_profile: str | None
    payload_layout: str
    tenant: str | None
    results: tuple[SearchHit, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"alias": self.alias, "version": self.version, "status": self.status, "collection": self.collection,
                "serving": self.serving, "embed_model": self.embed_model, "embed_profile": self.embed_profile,
                "payload_layout": self.payload_layout, "tenant": self.tenant,
                "results": [asdict(hit) for hit in self.results]}


def search_version(deps: Deps, version: int, question: str, *, k: int = 4, tenant: str | None = None) -> VersionAnswer:
    """The top `k` chunks of version `version` for `question` (only `tenant`'s documents when given)."""
    alias = deps.settings.alias
    if not question or not question.strip():
        raise ConfigError("query text is empty")
    if k < 1:
        raise ConfigError(f"k={k} must be at least 1")
    record = deps.state.get_version(alias, version)
    if record is None:
        raise ConfigError(f"--version {version}: {alias} has no version {version}; `kb-reindex status` lists the "
                          "versions")
    if record.status == VersionStatus.DELETED:
        raise ConfigError(f"--version {version}: v{version} of {alias} was deleted (its collection {record.collection} "
                          "is gone); try a kept version (`kb-reindex status`)")
    if not deps.store.exists(record.collection):
        raise KbError(f"--version {version}: v{version} of {alias} is {record.status} but Qdrant has no collection "
                      f"{record.collection}; nothing to search")
    vector = deps.embedder_for(record).embed_queries([question])[0]
    if len(vector) != record.embed_dim:
        raise KbError(f"embedder {record.embed_model!r} answered a {len(vector)}-d vector; v{version} holds "
                      f"{record.embed_dim}-d vectors")
    hits = deps.store.search(record.collection, vector, k=k, tenant=tenant)
    return VersionAnswer(
        alias=alias, version=record.version, status=str(record.status), collection=record.collection,
        serving=deps.store.alias_target(alias) == record.collection, embed_model=record.embed_model,
        embed_profile=version_profile(record), payload_layout=record.payload_layout, tenant=tenant,
        results=tuple(SearchHit.of(h.payload or {}, h.score, record.payload_layout) for h in hits))
