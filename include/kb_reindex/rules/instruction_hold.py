"""Instruction-like lines held for a person (KB_INSTRUCTION_POLICY=hold, the default), as content loss is
(kb_reindex.rules.content_loss): a version whose files hold a flagged line that live does not serve is built and
validated but not promoted; its run ends `held`, naming each new line (file, line number, text, why), until
someone reads them and promotes it (`kb-reindex promote --version N --reason ...`, the page's Promote button).

A line live already serves was let through before (promoted under `warn`, or by a person): it does not hold the
next run again. A line is the same line when its document and its text (as the screen reads it) are: a line
that only moved (an edit above it) is not new.

`Hold` is what a held promotion carries: the content loss, the new flagged lines, or both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kb_reindex.domain.screen_text import normalize
from kb_reindex.domain.validation_model import FlaggedLine
from kb_reindex.rules.content_loss import ContentLoss

#: the lines a held run's reason names in full (the rest are counted; the version's validation lists all)
NAMED = 10


def _key(f: FlaggedLine) -> tuple[str, str]:
    return f.get("knowledge_key") or f["source"], normalize(f["text"])


@dataclass(frozen=True)
class InstructionHold:
    """`new`: the flagged lines live does not serve; `accepted`: how many flagged lines live serves already."""

    new: tuple[FlaggedLine, ...]
    accepted: int

    @property
    def held(self) -> bool:
        return bool(self.new)

    @property
    def reasons(self) -> tuple[str, ...]:
        if not self.new:
            return ()
        named = "; ".join(f"{f['source']}:{f['line']}: {f['text'][:120]}" + (f" ({f['why']})" if f.get("why") else "")
                          for f in self.new[:NAMED])
        more = f"; and {len(self.new) - NAMED} more" if len(self.new) > NAMED else ""
        return (f"{len(self.new)} instruction-like line(s) live does not serve (KB_INSTRUCTION_POLICY=hold): "
                f"{named}{more}",)

    def to_dict(self) -> dict[str, Any]:
        return {"held": self.held, "new": [dict(f) for f in self.new], "accepted": self.accepted,
                "reasons": list(self.reasons)}


def instruction_hold(flagged: Sequence[FlaggedLine], live_flagged: Sequence[FlaggedLine]) -> InstructionHold:
    """The version's flagged lines against live's: the new ones hold it."""
    served = {_key(f) for f in live_flagged}
    new = tuple(f for f in flagged if _key(f) not in served)
    return InstructionHold(new=new, accepted=len(flagged) - len(new))


@dataclass(frozen=True)
class Hold:
    """Why a built and validated version waits for a person: content loss, new instruction-like lines, or both."""

    loss: ContentLoss | None = None
    instructions: InstructionHold | None = None

    @property
    def held(self) -> bool:
        return bool((self.loss and self.loss.held) or (self.instructions and self.instructions.held))

    @property
    def reasons(self) -> tuple[str, ...]:
        return ((self.loss.reasons if self.loss else ()) + (self.instructions.reasons if self.instructions else ()))

    def message(self, version: int) -> str:
        return (f"v{version} is held for a person, built and validated but not promoted: {'; '.join(self.reasons)}. "
                f"Look at what it names, then `kb-reindex promote --version {version} --reason \"...\"` (or the "
                "page's Promote button) puts it live; the alias keeps serving what it served (a first build: "
                "nothing, until then)")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = self.loss.to_dict() if self.loss and self.loss.held else {"held": self.held}
        out["reasons"] = list(self.reasons)
        if self.instructions is not None and self.instructions.held:
            out["instructions"] = self.instructions.to_dict()
        return out
