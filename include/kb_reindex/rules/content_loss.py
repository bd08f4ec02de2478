"""Content loss: a change that no retrieval check can judge and that is held for a person. A run that removes
more documents than `max_docs_removed`, or whose remaining documents lose more than `max_shrink` of live's
chunks (pages emptied to a stub under their old titles keep their probes' hits and still lose the knowledge;
removed documents count only against `max_docs_removed`), is built and validated but
not promoted: its run ends `held`, naming what went, until someone looks and promotes it
(`kb-reindex promote --version N --reason ...`, the page's **Promote** button, knowledge_promote_shadow).

The defaults stop the trials' cases (3 of 10 documents removed; two pages of 41 points emptied to 36) and let
ordinary edits through (one document of a dozen removed, a section rewritten); a golden set may set its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from kb_reindex.domain.planning import Plan

#: documents a run may remove without a person's approval
DEFAULT_MAX_DOCS_REMOVED = 2
#: the share of live's chunks a run may lose without a person's approval
DEFAULT_MAX_SHRINK = 0.1


@dataclass(frozen=True)
class ContentLoss:
    removed: tuple[str, ...]
    removed_count: int
    live_chunks: int
    #: chunks the documents that stay lost against live (an emptied page), removed documents apart
    lost_chunks: int
    reasons: tuple[str, ...]

    @property
    def held(self) -> bool:
        return bool(self.reasons)

    @property
    def shrink(self) -> float:
        return self.lost_chunks / self.live_chunks if self.live_chunks else 0.0

    def message(self, version: int) -> str:
        return (f"v{version} is held for a person, built and validated but not promoted: {'; '.join(self.reasons)}. "
                f"Look at what went, then `kb-reindex promote --version {version} --reason \"...\"` (or the page's "
                "Promote button) puts it live; the alias keeps serving what it served")

    def to_dict(self) -> dict[str, object]:
        return {"held": self.held, "removed": list(self.removed), "removed_count": self.removed_count,
                "live_chunks": self.live_chunks, "lost_chunks": self.lost_chunks, "shrink": round(self.shrink, 4),
                "reasons": list(self.reasons)}


def content_loss(plan: Plan, *, live_chunks: int, lost: int, max_docs_removed: int, max_shrink: float) -> ContentLoss:
    """What the plan loses against live, and why it must be held (no reason: it may go live by itself).
    `live_chunks`: live's chunks; `lost`: the chunks live's documents that stay lost in the new manifest
    (each document's count down, summed: `StateStore.chunks_lost`)."""
    removed = plan.doc_keys.removed
    shrink = lost / live_chunks if live_chunks else 0.0
    reasons = []
    if plan.docs.removed > max_docs_removed:
        reasons.append(f"{plan.docs.removed} documents removed ({', '.join(removed)}), more than max_docs_removed="
                       f"{max_docs_removed}")
    if shrink > max_shrink:
        reasons.append(f"{shrink:.0%} of live's chunks lost by documents that stay ({lost} of {live_chunks}: "
                       f"pages emptied or cut), more than max_shrink={max_shrink:.0%}")
    return ContentLoss(removed=removed, removed_count=plan.docs.removed, live_chunks=live_chunks, lost_chunks=lost,
                       reasons=tuple(reasons))
