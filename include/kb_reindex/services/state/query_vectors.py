"""Kept query vectors (`schema.query_vectors`): what validation embedded for a query text under an embedding
profile, so the next validation of that profile embeds only the probes that are new or changed."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import sqlalchemy as sa

from kb_reindex.services.state import by_digest
from kb_reindex.services.state.schema import query_vectors


def _packed(vector: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(vector)}d", *vector)


def _unpacked(blob: bytes) -> list[float]:
    return list(struct.unpack(f"<{len(blob) // 8}d", blob))


class QueryVectorsMixin:
    engine: sa.Engine

    def recall_query_vectors(self, profile: str, digests: Sequence[str]) -> dict[str, list[float]]:
        """digest -> the kept vector of each text `profile` embedded before; empty on a state DB from before
        the table (a read-only command on it)."""
        found = by_digest.recall(self.engine, query_vectors, ("embed_profile", profile), digests, "vector")
        return {digest: _unpacked(bytes(blob)) for digest, blob in found.items() if isinstance(blob, bytes | bytearray | memoryview)}

    def remember_query_vectors(self, profile: str, vectors: dict[str, list[float]]) -> None:
        """Keep these vectors; one kept meanwhile by another validation stays as it is."""
        by_digest.remember(self.engine, query_vectors,
                           [{"embed_profile": profile, "text_sha256": d, "vector": _packed(v)} for d, v in vectors.items()],
                           lambda batch: self.recall_query_vectors(profile, batch))
