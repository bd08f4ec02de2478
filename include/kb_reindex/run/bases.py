"""Every knowledge base of the deployment in one view, read from the shared state DB alone (never Qdrant, which a
build may hold in local mode): what serves, the model, the freeze, the last run and a problem marker. What
`kb-reindex bases` prints and the Knowledge index page lists before one knowledge base is opened."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kb_reindex.domain.errors import StateEmpty, StateMissing
from kb_reindex.domain.model import VersionStatus
from kb_reindex.rules.alias import has_served
from kb_reindex.run.status import last_run_problem
from kb_reindex.services.registry import KnowledgeBase, Registry
from kb_reindex.services.state.clock import utc_stamp
from kb_reindex.services.state.store import StateStore



@dataclass(frozen=True)
class LastRun:
    run_id: str
    kind: str
    outcome: str
    started_at: str
    finished_at: str | None
    error: str | None


@dataclass(frozen=True)
class BaseSummary:
    alias: str
    dag_id: str
    schedule: str | None
    #: the source watcher's poll in seconds (KB_SOURCE_POLL_S, the entry's source_poll_s); 0: not watched
    source_poll_s: float
    live_version: int | None
    collection: str | None
    embed_model: str | None
    dim: int | None
    frozen: bool
    freeze_reason: str | None
    last_run: LastRun | None
    #: what on-call should look at first: the last run failed, nothing serves yet
    problems: tuple[str, ...]
    #: shadow versions (ready, never served: only a promotion puts one live), as the page marks them
    shadows: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def when_it_runs(schedule: str | None, source_poll_s: float) -> str:
    """`@daily + on change (every 15s)`, `on change (every 15s)`, `@daily`, or `triggered only`."""
    watched = f"on change (every {source_poll_s:g}s)" if source_poll_s > 0 else ""
    return " + ".join(part for part in (schedule or "", watched) if part) or "triggered only"


@dataclass(frozen=True)
class BasesView:
    bases: tuple[BaseSummary, ...]
    #: registry entries refused (they have no DAGs): one message each, naming the file, the knowledge base and key
    refused: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"knowledge_bases": [b.to_dict() for b in self.bases], "refused": list(self.refused)}


def summary(state: StateStore | None, kb: KnowledgeBase) -> BaseSummary:
    live = state.live_version(kb.alias) if state is not None else None
    freeze = state.freeze_status(kb.alias) if state is not None else None
    runs = state.list_runs(kb.alias, limit=1) if state is not None else []
    last = None
    if runs:
        r = runs[0]
        last = LastRun(run_id=r.run_id, kind=r.kind, outcome=r.outcome, started_at=utc_stamp(r.started_at),
                       finished_at=utc_stamp(r.finished_at) if r.finished_at else None, error=r.error)
    problems = [p for p in [last_run_problem(state, kb.alias) if state is not None else None] if p]
    ready = state.list_versions(kb.alias, statuses=[VersionStatus.READY]) if state is not None else []
    if live is None:
        problems.append(f"no version serves yet: trigger {kb.dag_id('knowledge_reindex')}")
    return BaseSummary(alias=kb.alias, dag_id=kb.dag_id("knowledge_reindex"), schedule=kb.schedule,
                       source_poll_s=kb.settings().source_poll_s,
                       live_version=live.version if live else None, collection=live.collection if live else None,
                       embed_model=live.embed_model if live else None, dim=live.embed_dim if live else None,
                       frozen=freeze is not None, freeze_reason=freeze.reason if freeze is not None else None,
                       last_run=last, problems=tuple(problems),
                       shadows=tuple(sorted(v.version for v in ready if not has_served(v))))


def bases_view(registry: Registry, state_url: str) -> BasesView:
    """Every knowledge base of `registry` from the state DB at `state_url` (one the first run has not created
    yet: nothing serves anywhere)."""
    try:
        state: StateStore | None = StateStore(state_url, create=False)
    except (StateEmpty, StateMissing):  # a fresh install: nothing built anywhere yet
        state = None
    try:
        return BasesView(bases=tuple(summary(state, kb) for kb in registry.bases), refused=registry.errors)
    finally:
        if state is not None:
            state.dispose()
