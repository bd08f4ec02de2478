"""The retirement gate: a knowledge base on-call retired (`kb-reindex retire`) is built, promoted and rolled back
no more. Checked where a run plans (under its reindex lock) and where the alias moves (under the alias lock, as
the freeze is), so a run that started before the retirement stops there; its lock was taken from it too, so
its next write is fenced. Every refusal says who retired it, when, why and how to undo it.

The retirement lives in the state DB (`StateStore.retire`, `retirement`, `undo_retirement`); the rule for its
registry entry (refused while it is still there) is `kb_reindex.run.bases`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kb_reindex.domain.errors import ConfigError
from kb_reindex.services.registry import load_registry, registry_path
from kb_reindex.services.state.retirements import Retirement

if TYPE_CHECKING:  # the types alone: importing a rule never imports Qdrant's client
    from kb_reindex.services.runtime import Deps, StateDeps


def undo_hint(alias: str, *, registered: bool) -> str:
    """How a retirement is undone: its command (with `--kb` when a registry names the knowledge base)."""
    return f"`kb-reindex {f'--kb {alias} ' if registered else ''}retire --undo`"


def retired_message(retirement: Retirement, *, registry: Path | None, listed: bool = True) -> str:
    """The one refusal of a retired knowledge base: its entry (when a registry lists it: `listed`), who retired
    it, when and why, what is left, and the ways out."""
    alias = retirement.alias
    entry = registry is not None and listed
    where = f"{registry}: knowledge base {alias!r}" if entry else f"knowledge base {alias!r}"
    left = ("its alias and collections were dropped" if retirement.dropped_at is not None
            else "its alias still serves what was live, its collections are kept")
    ways = (f"Remove its entry from {registry} (its DAGs go at the next parse), or undo the retirement with "
            if entry else "Undo the retirement with ")
    return (f"{where} was retired by {retirement.retired_by} at {retirement.since} ({retirement.reason}): it is not "
            f"built, promoted or rolled back any more; {left}. {ways}"
            f"{undo_hint(alias, registered=registry is not None)}")


def ensure_not_retired(deps: Deps | StateDeps) -> None:
    """Raise a ConfigError (permanent: no retry) naming the retirement when the alias is retired."""
    retirement = deps.state.retirement(deps.settings.alias)
    if retirement is None:
        return
    registry = registry_path()
    try:
        listed = registry is not None and retirement.alias in load_registry().order
    except ConfigError:
        listed = True
    raise ConfigError(retired_message(retirement, registry=registry, listed=listed))
