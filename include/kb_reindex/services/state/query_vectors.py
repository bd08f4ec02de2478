"""Kept query vectors (`schema.query_vectors`): what validation embedded for a query text under an embedding
profile, so the next validation of that profile embeds only the probes that are new or changed."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import sqlalchemy as sa

from kb_reindex.services.state.schema import _table_missing, query_vectors

_BATCH = 500


def _packed(vector: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(vector)}d", *vector)


def _unpacked(blob: bytes) -> list[float]:
    return list(struct.unpack(f"<{len(blob) // 8}d", blob))


class QueryVectorsMixin:
    engine: sa.Engine

    def recall_query_vectors(self, profile: str, digests: Sequence[str]) -> dict[str, list[float]]:
        """digest -> the kept vector of each text `profile` embedded before; empty on a state DB from before
        the table (a read-only command on it)."""
        found: dict[str, list[float]] = {}
        try:
            with self.engine.connect() as conn:
                for start in range(0, len(digests), _BATCH):
                    rows = conn.execute(sa.select(query_vectors.c.text_sha256, query_vectors.c.vector)
                                        .where(query_vectors.c.embed_profile == profile,
                                               query_vectors.c.text_sha256.in_(digests[start:start + _BATCH])))
                    found.update((digest, _unpacked(blob)) for digest, blob in rows)
        except (sa.exc.OperationalError, sa.exc.ProgrammingError) as exc:
            if _table_missing(exc, query_vectors.name):
                return {}
            raise
        return found

    def remember_query_vectors(self, profile: str, vectors: dict[str, list[float]]) -> None:
        """Keep these vectors; one kept meanwhile by another validation stays as it is."""
        digests = list(vectors)
        for start in range(0, len(digests), _BATCH):
            batch = digests[start:start + _BATCH]
            rows = [{"embed_profile": profile, "text_sha256": d, "vector": _packed(vectors[d])} for d in batch]
            try:
                with self.engine.begin() as conn:
                    conn.execute(query_vectors.insert(), rows)
            except sa.exc.IntegrityError:
                kept = self.recall_query_vectors(profile, batch)
                fresh = [row for row in rows if row["text_sha256"] not in kept]
                if fresh:
                    with self.engine.begin() as conn:
                        conn.execute(query_vectors.insert(), fresh)
