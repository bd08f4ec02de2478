"""Make the state DB agree with what the alias really serves, explicitly and on the record.

Used after a crash between the alias move and the state write, or a manual alias change. Qdrant's
alias is what readers see, so it is the truth; the state is corrected and the correction is an event.
"""

from __future__ import annotations

from typing import Any

from kb_reindex.errors import StateDriftError
from kb_reindex.runtime import Deps


def reconcile(deps: Deps, *, run_id: str | None = None) -> dict[str, Any]:
    alias = deps.settings.alias
    serving = deps.store.alias_target(alias)
    live = deps.state.live_version(alias)
    if serving == (live.collection if live else None):
        return {"changed": False, "message": f"{alias}: state and Qdrant agree (serving {serving or 'nothing'})"}
    if serving is None:
        raise StateDriftError(
            f"alias {alias} points to nothing but the state DB says v{live.version if live else '?'} is live; "
            f"restore it with `kb-reindex rollback --to-version {live.version if live else 'N'} --reason ...` "
            "after checking the collection"
        )
    target = next((v for v in deps.state.list_versions(alias) if v.collection == serving), None)
    if target is None or target.status in ("deleted",):
        raise StateDriftError(
            f"alias {alias} points to {serving}, which the state DB does not know as a usable version; "
            "point the alias back at a known version (kb-reindex rollback --to-version N) before reindexing"
        )
    deps.state.record_switch(alias=alias, action="reconcile", to=target, previous=live, run_id=run_id,
                             reason=f"alias found pointing at {serving}; state said {live.collection if live else 'nothing'}")
    return {"changed": True, "live_version": target.version, "previous_version": live.version if live else None,
            "message": f"{alias}: recorded v{target.version} ({serving}) as live"
                       + (f"; v{live.version} retired" if live else "")}
