"""Rows kept by the SHA-256 of a text under a key (the screen's scores by classifier, the query vectors by
embedding profile): looked up in batches, written once. A state DB from before such a table answers nothing
kept (a read-only command never creates the table); two writers racing keep the first row."""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import Any

import sqlalchemy as sa

from kb_reindex.services.state.schema import _table_missing

BATCH = 500


def recall(engine: sa.Engine, table: sa.Table, key: tuple[str, str], digests: Sequence[str],
           value: str) -> dict[str, object]:
    """digest -> the `value` column of the rows of `table` whose `key` column (name, value) matches."""
    key_column, digest_column = table.c[key[0]], table.c.text_sha256
    found: dict[str, object] = {}
    try:
        with engine.connect() as conn:
            for start in range(0, len(digests), BATCH):
                rows = conn.execute(sa.select(digest_column, table.c[value])
                                    .where(key_column == key[1], digest_column.in_(digests[start:start + BATCH])))
                found.update((digest, kept) for digest, kept in rows)
    except (sa.exc.OperationalError, sa.exc.ProgrammingError) as exc:
        if _table_missing(exc, table.name):
            return {}
        raise
    return found


def remember(engine: sa.Engine, table: sa.Table, rows: list[dict[str, Any]],
             kept: Callable[[list[str]], Container[str]]) -> None:
    """Insert `rows` (each with its `text_sha256`); where another writer kept some meanwhile (`kept`: the
    digests of a batch already there), only the others."""
    for start in range(0, len(rows), BATCH):
        batch = rows[start:start + BATCH]
        try:
            with engine.begin() as conn:
                conn.execute(table.insert(), batch)
        except sa.exc.IntegrityError:
            there = kept([row["text_sha256"] for row in batch])
            fresh = [row for row in batch if row["text_sha256"] not in there]
            if fresh:
                with engine.begin() as conn:
                    conn.execute(table.insert(), fresh)
