"""A person's review of a version held for them (kb_reindex.rules.instruction_hold): the new instruction-like
lines it would serve, each in the lines around it, read from the state DB alone (the plan's snapshot and the
chunk texts it stored: the knowledge folder may have changed since, and the page's server may not reach it);
and the other answer to "Promote anyway": keep live, which declines the version (failed at `review`, naming who
and why), so nothing protects its slot any more. Its lines still hold the next run until the page is fixed.
A newer version held for a person (not for content loss) or promoted by a run supersedes the older ones of its
embedding profile still waiting (not pinned): they are declined by kb-reindex, so a person weighs one version (the
newest), and a page saved again and again while held keeps one slot waiting, not one more full collection per
save.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kb_reindex.domain.errors import ConfigError, ReviewRefused
from kb_reindex.domain.lifecycle import READY, StatusMoved
from kb_reindex.domain.model import RunOutcome
from kb_reindex.domain.screen_text import normalize
from kb_reindex.rules.alias import has_served
from kb_reindex.rules.instruction_hold import Hold, instruction_hold
from kb_reindex.services.chunking import page_sections
from kb_reindex.services.layouts import version_profile
from kb_reindex.services.state.clock import utc_stamp
from kb_reindex.services.state.versions import VersionRecord

if TYPE_CHECKING:
    from kb_reindex.services.state.ports import AliasHistory, HeldVersions, ReviewReads, VersionWrites

log = logging.getLogger(__name__)

#: lines shown before and after a flagged line
AROUND = 2
#: the step a declined version failed at (not resumable: the next run builds anew and holds again)
REVIEW_STEP = "review"


@dataclass(frozen=True)
class FlaggedInContext:
    """A new instruction-like line of a held version (file, line, text, why), with the lines around it on the page
    as its chunks hold it (`page_sections`; empty when its text was not stored: a version planned before texts
    were kept)."""

    knowledge_key: str
    source: str
    line: int
    text: str
    why: str | None
    before: tuple[str, ...]
    after: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def review_lines(state: ReviewReads, version: VersionRecord, live: VersionRecord | None) -> tuple[FlaggedInContext, ...]:
    """The flagged lines `version`'s plan recorded that `live`'s did not (what holds it), in their context."""
    snapshot = state.snapshot(version.id)
    if snapshot is None or not snapshot.flagged:
        return ()
    served = state.snapshot(live.id) if live is not None else None
    new = instruction_hold(snapshot.flagged, served.flagged if served is not None else []).new
    if not new:
        return ()
    chunks = state.document_chunks(version.id, {f.get("knowledge_key") or "" for f in new} - {""})
    texts = state.texts({c.chunk_hash for c in chunks})
    by_key: dict[str, list[str]] = {}
    for c in chunks:  # in manifest order: by key, then chunk index
        if c.chunk_hash in texts:
            by_key.setdefault(c.knowledge_key, []).append(texts[c.chunk_hash][1])
    return tuple(_in_context(f, page_sections(by_key.get(f.get("knowledge_key") or "", []))) for f in new)


def _in_context(flagged: Any, sections: list[list[str]]) -> FlaggedInContext:
    wanted = normalize(flagged["text"]).strip()
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    found = [(lines, n) for lines in sections for n, line in enumerate(lines) if wanted and wanted in normalize(line)]
    # a line that is the flagged one before a line that holds it among other text
    found.sort(key=lambda pair: normalize(pair[0][pair[1]]).strip() != wanted)
    if found:
        lines, at = found[0]
        before = tuple(lines[max(0, at - AROUND):at])
        after = tuple(lines[at + 1:at + 1 + AROUND])
    return FlaggedInContext(knowledge_key=flagged.get("knowledge_key") or "", source=flagged["source"],
                            line=flagged["line"], text=flagged["text"], why=flagged.get("why"), before=before,
                            after=after)


def decline(state: VersionWrites, alias: str, number: int, *, by: str, reason: str,
            error: str | None = None) -> VersionRecord:
    """Keep live: the ready version `number`, never served (held, kept while frozen, a shadow), is not promoted;
    it fails at `review` with who and why (`error`: the whole message, where it is not a person's keep live),
    and nothing protects its slot any more. Refused, changing nothing,
    for a version that served or is not ready (a promotion that won the race, say)."""
    if not reason.strip():
        raise ConfigError("keeping live needs a reason (it is recorded on the version)")
    version = state.get_version(alias, number)
    if version is None:
        raise ReviewRefused(f"{alias} has no version {number}; `kb-reindex status` lists the versions")
    if version.status != READY or has_served(version):
        raise ReviewRefused(f"v{number} is {version.status}{' and served before' if has_served(version) else ''}: "
                          "only a ready version that never served waits for this answer")
    state.mark_failed(version.id, step=REVIEW_STEP, error=error or f"not promoted: {by} kept live ({reason.strip()})",
                      from_=[READY])
    declined = state.get_version(alias, number)
    assert declined is not None
    return declined


def kept_as(state: HeldVersions, v: VersionRecord) -> str | None:
    """Why a ready version that never served is kept: what its run ended as (`held`, `frozen`), else `shadow`;
    None for a version that served or is not ready."""
    if v.status != READY or has_served(v):
        return None
    run = state.get_run(v.run_id) if v.run_id else None
    outcome = run.outcome if run is not None else None
    return outcome if outcome in (RunOutcome.HELD, RunOutcome.FROZEN) else "shadow"


def supersede_held(state: HeldVersions, newer: VersionRecord, hold: Hold | None, *,
                   frozen: bool = False) -> tuple[int, ...]:
    """The versions `newer` supersedes, newer being held for a person by `hold`, kept ready while its alias is
    `frozen`, or promoted by its run (neither): older ones of its alias and embedding profile that wait the same
    way (held for a person; kept while frozen; a promotion supersedes both), never served and not pinned, each
    declined (`decline`, naming `newer`). A person weighs the newest alone (promoting an older waiting version
    after a newer one served would put the older text back), and their slots are free for the next build, which
    is brought from one of them by the difference: a page saved again and again while held or frozen keeps one
    slot waiting, not a new full copy per save. A version held for content loss supersedes nothing (it may be
    the broken build: what waited before it keeps waiting), a held one supersedes no frozen one nor the other way
    round, and a version that left the wait meanwhile (a person promoted or declined it) is left as it is."""
    if hold is not None and hold.loss is not None and hold.loss.held:
        return ()
    profile = version_profile(newer)
    pinned = state.active_pins(newer.alias)
    if hold is not None:
        how, waiting = "held for a person too: only the newest waits", {RunOutcome.HELD}
    elif frozen:
        how, waiting = "kept while frozen too: only the newest waits", {RunOutcome.FROZEN}
    else:
        how, waiting = "promoted after it", {RunOutcome.HELD, RunOutcome.FROZEN}
    superseded = []
    for v in state.list_versions(newer.alias, statuses=[READY]):
        if (v.version >= newer.version or version_profile(v) != profile or v.version in pinned
                or kept_as(state, v) not in waiting):
            continue
        reason = f"superseded by v{newer.version}, {how}"
        try:
            decline(state, newer.alias, v.version, by="kb-reindex", reason=reason,
                    error=f"not promoted: {reason} (kb-reindex)")
        except (ReviewRefused, StatusMoved) as exc:  # a person answered it meanwhile
            log.info("kb_reindex: v%d is not superseded by v%d: %s", v.version, newer.version, exc)
            continue
        superseded.append(v.version)
    return tuple(superseded)


@dataclass(frozen=True)
class ServedLines:
    """The instruction-like lines live serves (its validation recorded them) and who let them through: whoever
    put live behind the alias (`accepted_by`, the Airflow user or the CLI's login; None: a run under `warn`, or
    one from before moves named who), with the reason and when."""

    lines: int
    accepted_by: str | None
    reason: str | None
    at: str | None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "message": self.message}

    @property
    def message(self) -> str:
        who = f"let through by {self.accepted_by}" if self.accepted_by else "let through by a run, no person named"
        return (f"live serves {self.lines} instruction-like line(s), {who}"
                + (f" at {self.at}" if self.at else "") + (f" ({self.reason})" if self.reason else ""))


def served_lines(state: AliasHistory, alias: str, live: VersionRecord | None) -> ServedLines | None:
    """None when nothing serves or live serves no flagged line."""
    flagged = (live.validation or {}).get("flagged_instructions") or [] if live is not None else []
    if live is None or not flagged:
        return None
    moved = [e for e in state.alias_events(alias) if e.to_version == live.version]
    first = moved[0] if moved else None  # the move that first put it live let its lines through
    return ServedLines(lines=len(flagged), accepted_by=first.moved_by if first else None,
                       reason=first.reason if first else None, at=utc_stamp(first.at) if first else None)
