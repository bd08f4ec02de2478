"""The instruction screen's kept scores (`kb_reindex.services.screen.ScoreMemory`): what the classifier said of a
text, by the classifier (`Classifier.key`) and the text's SHA-256, so a later plan embeds only the lines no
plan judged before."""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from kb_reindex.services.state.schema import _table_missing, screen_scores


_BATCH = 500


class ScreenScoresMixin:
    engine: sa.Engine

    def recall_scores(self, classifier: str, digests: Sequence[str]) -> dict[str, float]:
        """digest -> kept score of those `classifier` scored before; empty for a state DB from before the table
        (a read-only command on it)."""
        found: dict[str, float] = {}
        try:
            with self.engine.connect() as conn:
                for start in range(0, len(digests), _BATCH):
                    rows = conn.execute(sa.select(screen_scores.c.text_sha256, screen_scores.c.score)
                                        .where(screen_scores.c.classifier == classifier,
                                               screen_scores.c.text_sha256.in_(digests[start:start + _BATCH])))
                    found.update((d, float(score)) for d, score in rows)
        except (sa.exc.OperationalError, sa.exc.ProgrammingError) as exc:
            if _table_missing(exc, screen_scores.name):
                return {}
            raise
        return found

    def remember_scores(self, classifier: str, scores: dict[str, float]) -> None:
        """Keep these scores; one kept meanwhile by another plan stays as it is (same weights, same text, same
        score)."""
        digests = list(scores)
        for start in range(0, len(digests), _BATCH):
            batch = digests[start:start + _BATCH]
            try:
                with self.engine.begin() as conn:
                    conn.execute(screen_scores.insert(), [_row(classifier, d, scores[d]) for d in batch])
            except sa.exc.IntegrityError:
                kept = self.recall_scores(classifier, batch)
                fresh = [_row(classifier, d, scores[d]) for d in batch if d not in kept]
                if fresh:
                    with self.engine.begin() as conn:
                        conn.execute(screen_scores.insert(), fresh)


def _row(classifier: str, digest: str, score: float) -> dict[str, object]:
    return {"classifier": classifier, "text_sha256": digest, "score": score}
