"""The instruction screen's kept scores (`kb_reindex.services.screen.ScoreMemory`): what the classifier said of a
text, by the classifier (`Classifier.key`) and the text's SHA-256, so a later plan embeds only the lines no
plan judged before."""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from kb_reindex.services.state import by_digest
from kb_reindex.services.state.schema import screen_scores


class ScreenScoresMixin:
    engine: sa.Engine

    def recall_scores(self, classifier: str, digests: Sequence[str]) -> dict[str, float]:
        """digest -> kept score of those `classifier` scored before; empty for a state DB from before the table
        (a read-only command on it)."""
        found = by_digest.recall(self.engine, screen_scores, ("classifier", classifier), digests, "score")
        return {digest: float(score) for digest, score in found.items() if isinstance(score, (int, float))}

    def remember_scores(self, classifier: str, scores: dict[str, float]) -> None:
        """Keep these scores; one kept meanwhile by another plan stays as it is (same weights, same text, same
        score)."""
        by_digest.remember(self.engine, screen_scores,
                           [{"classifier": classifier, "text_sha256": d, "score": s} for d, s in scores.items()],
                           lambda batch: self.recall_scores(classifier, batch))
