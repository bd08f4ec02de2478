"""Rollback: put a version that served before back behind the alias, through the same compare-and-swap.

The target is read from the alias history; a version that never served (a shadow) is refused, since a
shadow goes live only through a promotion that validates it again.
"""

from __future__ import annotations

import logging
from typing import Any

from kb_reindex.alias import has_served, rollback_target
from kb_reindex.errors import AliasMovedError, KbError, RollbackRefused
from kb_reindex.promote import confirmed_live, switch_alias
from kb_reindex.runtime import Deps

log = logging.getLogger(__name__)


def rollback(
    deps: Deps,
    *,
    reason: str,
    to_version: int | None = None,
    run_id: str | None = None,
    revalidate: bool = True,
    action: str = "rollback",
    expected_live: int | None = None,
) -> dict[str, Any]:
    """Put a previous version back behind the alias, after checking it is structurally whole.

    `expected_live`: the version on-call confirmed serving (the CLI's prompt, the DAG's `live_version`, the
    watch's own promotion). The alias moves only from that version, by the compare-and-swap under the alias
    lock, to `to_version` (default: the version that preceded it): if another version serves by then,
    nothing moves and `AliasMovedError` says which. None (scripts, tests): whatever serves when this reads.
    Takes no reindex lock: a build in flight does not delay it, and fails its own compare-and-swap after.
    `action="auto-rollback"` is the watch's."""
    from kb_reindex.checks import structural_problems
    from kb_reindex.validate import validate

    alias = deps.settings.alias
    if not reason or not reason.strip():
        raise RollbackRefused("a rollback needs a reason (it is recorded in the alias history)")
    live = deps.state.live_version(alias)
    if live is None:
        raise RollbackRefused(f"{alias} has no live version; there is nothing to roll back from")
    if expected_live is not None:
        confirmed_live(deps, expected_live, undone="rolled back")
    target = deps.state.get_version(alias, to_version) if to_version is not None else rollback_target(deps, live)
    if target is None:
        raise RollbackRefused(
            f"no version {to_version} of {alias}" if to_version is not None
            else f"no previous version of {alias} in the alias history; name one with --to-version"
        )
    if target.id == live.id:
        raise RollbackRefused(f"v{target.version} is already live")
    if target.status in ("failed", "deleted", "building"):
        raise RollbackRefused(f"v{target.version} is {target.status}; only a complete, kept version can serve")
    if not has_served(target):
        raise RollbackRefused(
            f"v{target.version} ({target.embed_model}, {target.embed_dim}-d) never served behind {alias}: a rollback "
            "returns only to a version that served before. A shadow goes live through a promotion that validates "
            f"it again: `kb-reindex promote --version {target.version}`"
        )
    problems = structural_problems(deps, target)
    if problems:
        raise RollbackRefused(f"v{target.version} ({target.collection}) is not whole: " + "; ".join(problems))
    scores = None
    if revalidate:
        # Scores are for the record: a golden set that names newer documents, a bad file in the folder
        # or an embedder outage must not stand between on-call and a structurally whole version.
        try:
            result = validate(deps, target.version, compare_live=False, raise_on_failure=False)
            scores = {"passed": result["passed"], "hit_rate": result["hit_rate"], "mrr": result["mrr"],
                      "report": result["report"]}
        except KbError as exc:
            scores = {"passed": None, "error": str(exc)}
            log.warning("kb_reindex: re-scoring v%d failed (%s); rolling back anyway", target.version, exc)
    try:
        switch_alias(deps, target, expected_from=live.collection, action=action, run_id=run_id,
                     reason=reason.strip())
    except AliasMovedError:
        confirmed_live(deps, live.version, undone="rolled back")  # names what serves now
        raise
    log.info("kb_reindex: rolled %s back from v%d to v%d (%s)", alias, live.version, target.version, reason.strip())
    return {"outcome": "rolled_back", "from_version": live.version, "to_version": target.version,
            "collection": target.collection, "validation": scores, "error": None}
