"""A version's collection: the settings and metadata it is created with, and the end of its bulk load
(the HNSW graph restored, indexing waited for) before validation queries it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kb_reindex.services.collection_config import CollectionConfig, effective, from_collection
from kb_reindex.services.layouts import embed_recipe, version_profile
from kb_reindex.services.state.versions import VersionRecord
from kb_reindex.services.state.clock import utc_stamp
from kb_reindex.services.store import CollectionMetadata

if TYPE_CHECKING:  # the types alone: importing a rule never imports Qdrant's client
    from kb_reindex.services.runtime import Deps, StepDeps


def collection_metadata(version: VersionRecord, config: CollectionConfig | None = None) -> CollectionMetadata:
    """Written on the collection: enough to rebuild the version's record if the state DB is lost, and the
    collection settings it was created with (`collection_config`: status shows them, a resumed build and
    validation restore indexing from them)."""
    metadata = CollectionMetadata(
        kb_alias=version.alias, kb_version=version.version, kind=version.kind, embedder=version.embedder,
        embed_model=version.embed_model, embed_dim=version.embed_dim, chunking_version=version.chunking_version,
        corpus_fingerprint=version.corpus_fingerprint, payload_layout=version.payload_layout,
        embed_profile=version_profile(version), embed_recipe=embed_recipe(version.embedder, version.embed_model).name,
        distance=version.distance,
        # restored by `reconcile --rebuild-state`, which would otherwise date every version to the rebuild
        created_at=utc_stamp(version.created_at))
    if config is not None:
        metadata["collection_config"] = config.to_dict()
    return metadata


def version_collection_config(deps: StepDeps[object], base_collection: str | None) -> CollectionConfig:
    """The settings of a new version: configured keys, the rest inherited from the live collection, and on a
    server always an explicit HNSW `m` to restore after the bulk load (Qdrant's default when nothing says).
    Local mode applies none of them and reports fixed values, so nothing is inherited there."""
    configured = deps.settings.collection_config
    if deps.store.is_local:
        return configured if configured is not None else CollectionConfig()
    inherited = None
    if base_collection and deps.store.exists(base_collection):
        inherited = from_collection(deps.store.collection_info(base_collection))
    return effective(configured, inherited).with_hnsw_m()


def finish_bulk_load(deps: Deps, version: VersionRecord) -> None:
    """Before validation's first query, on a server: restore the HNSW graph the bulk load deferred, then wait
    (KB_INDEX_WAIT_S) until Qdrant reports the collection indexed. Done from the recorded settings, so a build
    resumed after a crash, or built by several mapped tasks, is restored all the same. Local mode builds no
    index: nothing to restore or wait for."""
    if deps.store.is_local or not deps.store.exists(version.collection):
        return
    recorded = deps.store.collection_metadata(version.collection).get("collection_config")
    m = None
    if isinstance(recorded, dict):  # collections created before settings were recorded were never deferred
        m = CollectionConfig.from_dict(recorded, source=f"collection {version.collection}'s recorded "
                                                        "collection_config").hnsw_m
        deps.store.restore_indexing(version.collection, m=m)
    deps.store.wait_until_indexed(version.collection, wait_s=deps.settings.index_wait_s, m=m, waiter=deps.waiter)
