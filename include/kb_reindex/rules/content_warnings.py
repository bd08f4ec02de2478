"""What the files of a version hold that no gate judges, said where a person reads it: each warning once on the
log of the step that finds it (the CLI's stderr, the plan or validate task's log). The plan finds
instruction-like lines; validation finds tenant changes and duplicates (`ContentWarning`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from kb_reindex.domain.validation_model import INSTRUCTION, NO_GOLDEN_SET, TENANT_CHANGED, ContentWarning, FlaggedLine
from kb_reindex.services.sources import knowledge_key_for
from kb_reindex.services.state.manifests import ManifestDocument

log = logging.getLogger(__name__)


def content_warnings(flagged: Iterable[FlaggedLine]) -> tuple[ContentWarning, ...]:
    """The flagged lines of a scan or a snapshot as the plan's warnings."""
    return tuple(ContentWarning(kind=INSTRUCTION, knowledge_key=f.get("knowledge_key") or knowledge_key_for(f["source"]),
                                line=f["line"], text=f["text"]) for f in flagged)


def warn(alias: str, warnings: tuple[ContentWarning, ...]) -> tuple[ContentWarning, ...]:
    """Each warning once on the log: a person must see it. An instruction-like line live does not serve holds
    the version for a person (KB_INSTRUCTION_POLICY=hold, the default), or refuses it (block); a tenant change or
    a duplicate is shown, never gated by itself."""
    for w in warnings:
        if w.kind == NO_GOLDEN_SET:
            log.warning("kb_reindex: %s: WARNING %s (every structural and exact check ran; an answer made worse is "
                        "not caught)", alias, w.message)
            continue
        why = ("a line live does not serve holds the version for a person under KB_INSTRUCTION_POLICY=hold, "
               "block refuses it" if w.kind == INSTRUCTION else
               "a probe naming its tenant fails the gate if it lost its document" if w.kind == TENANT_CHANGED else
               "crowding the answers with copies; remove one of them")
        log.warning("kb_reindex: %s: WARNING %s (never obeyed; %s)", alias, w.message, why)
    return warnings


def tenant_changes(changes: Iterable[tuple[ManifestDocument, ManifestDocument | None]], *,
                   base_version: int | None) -> tuple[ContentWarning, ...]:
    """A warning of kind `tenant_changed` for each document serving another tenant than in the version it was
    built on (`changes`: each changed document with the base's of its key, None when the base lacks it): a
    reader passing the old tenant no longer finds it."""
    return tuple(ContentWarning(kind=TENANT_CHANGED, knowledge_key=d.knowledge_key, line=None,
                                text=f"tenant {was.tenant} in v{base_version} -> {d.tenant} here; a reader "
                                     f"passing tenant {was.tenant} no longer finds it")
                 for d, was in sorted(changes, key=lambda pair: pair[0].knowledge_key)
                 if was is not None and was.tenant != d.tenant)
