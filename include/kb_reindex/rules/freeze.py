"""The freeze gate: the one check every forward move of the alias makes (a run's or a DAG's promotion, a
migration's, a shadow's), under the alias lock, just before the alias moves. While the alias is frozen the
version stays `ready` (a shadow), the run ends `frozen` and says why; rollbacks are never held.

The freeze itself lives in the state DB (`StateStore.freeze`, `unfreeze`, `freeze_status`): owned by the
product, not by Airflow's pause toggle, so the CLI, every DAG, migrations and shadow promotions obey it alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kb_reindex.domain.errors import AliasFrozen, RollbackRefused
from kb_reindex.domain.lifecycle import LIVE
from kb_reindex.rules.locking import pin_by
from kb_reindex.services.state.freezes import Freeze
from kb_reindex.services.state.versions import VersionRecord

if TYPE_CHECKING:  # the types alone: importing a rule never imports Qdrant's client
    from kb_reindex.services.runtime import Deps

log = logging.getLogger(__name__)

#: the outcome of a run that built and validated a version but found the alias frozen
FROZEN = "frozen"
#: the alias moves a freeze holds back; rollbacks ("rollback", "auto-rollback") and reconciles are not
FORWARD_ACTIONS = frozenset({"promote", "migrate"})


@dataclass(frozen=True)
class FreezeView:
    """A freeze as a result carries it: the state DB's record (None: frozen, but the record was gone by the
    time it was read) and the message said of it. `to_dict()` is the JSON status, the page and runs show."""

    freeze: Freeze | None
    message: str

    @classmethod
    def of(cls, freeze: Freeze) -> FreezeView:
        return cls(freeze, freeze.describe())

    def to_dict(self) -> dict[str, Any]:
        return {**(self.freeze.view() if self.freeze else {"frozen": True}), "message": self.message}


def frozen_message(freeze: Freeze, version_number: int) -> str:
    return (f"{freeze.describe()}; v{version_number} built and kept unpromoted; `kb-reindex unfreeze` then "
            f"`kb-reindex promote --version {version_number}`")


def ensure_not_frozen(deps: Deps, target: VersionRecord, *, action: str) -> None:
    """Raise AliasFrozen when `action` would move the alias forward to `target` while it is frozen.
    Called by `switch_alias` under the alias lock, so a freeze set during a run still stops its promotion."""
    if action not in FORWARD_ACTIONS or target.status == LIVE:  # re-pointing at live is no step forward
        return
    freeze = deps.state.freeze_status(deps.settings.alias)
    if freeze is not None:
        raise AliasFrozen(frozen_message(freeze, target.version))


def frozen_view(deps: Deps, exc: AliasFrozen) -> FreezeView:
    """What a run's result says of the freeze that held its version back."""
    freeze = deps.state.freeze_status(deps.settings.alias)
    log.warning("kb_reindex: %s", exc)
    return FreezeView(freeze, str(exc))


def freeze_view(deps: Any) -> FreezeView | None:
    """The freeze in force for status and the page, None when the alias is not frozen."""
    freeze = deps.state.freeze_status(deps.settings.alias)
    return FreezeView.of(freeze) if freeze else None


def freeze_for_rollback(deps: Any, *, reason: str, by: str) -> Freeze:
    """A rollback's freeze, set before the alias moves back: from then on no run, DAG, migration or shadow
    promotion can put the rolled-back change live again. Kept if the rollback then fails (lift it with
    `kb-reindex unfreeze`); a freeze already in force is kept as it is."""
    if not reason or not reason.strip():
        raise RollbackRefused("a rollback needs a reason (it is recorded in the alias history); nothing changed")
    freeze = deps.state.freeze(deps.settings.alias, reason=f"rollback: {reason.strip()}", by=by)
    log.info("kb_reindex: %s", freeze.describe())
    return freeze


def operator() -> str:
    """Who sets or lifts a freeze from this host (the login user, as a pin records it)."""
    return pin_by()
