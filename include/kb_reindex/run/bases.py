"""Every knowledge base of the deployment in one view, read from the shared state DB alone (never Qdrant, which a
build may hold in local mode): what serves, the model, the freeze, the last run and a problem marker. What
`kb-reindex bases` prints and the Knowledge index page lists before one knowledge base is opened."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from kb_reindex.domain.errors import ConfigError, StateEmpty, StateMissing
from kb_reindex.domain.model import VersionStatus
from kb_reindex.rules.alias import has_served
from kb_reindex.rules.retirement import retired_message
from kb_reindex.rules.run_problems import last_run_problem
from kb_reindex.services.registry import KnowledgeBase, Registry, named_in, removed_problem, stand_in, valid_alias
from kb_reindex.services.state.clock import utc_stamp
from kb_reindex.services.state.entries import RecordedEntry
from kb_reindex.services.state.retirements import Retirement
from kb_reindex.services.state.store import StateStore
from kb_reindex.steps.review import served_lines


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
    #: shadow versions (ready, never served: only a promotion puts one live), as the page marks them; a
    #: candidate whose run is still in progress is none
    shadows: tuple[int, ...] = ()
    #: its registry entry does not load (refused, or no longer in the registry): why. What serves is still
    #: shown, and on-call's surface kept (its rollback DAG, status/rollback/freeze, its page)
    registry_error: str | None = None
    #: the instruction-like lines live serves, and who let them through (None: a run, no person named)
    served_instructions: int = 0
    instructions_accepted_by: str | None = None

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
    settings = kb.settings(on_call=True)  # a mistake in one setting never hides what serves
    problems = [p for p in [kb.problem, kb.schedule_problem, *settings.ignored_problems,
                            last_run_problem(state, kb.alias) if state is not None else None] if p]
    ready = state.list_versions(kb.alias, statuses=[VersionStatus.READY]) if state is not None else []
    shadows = tuple(sorted(v.version for v in ready if not has_served(v) and not _in_progress(state, v)))
    building = {r.run_id for r in runs if r.finished_at is None}
    if live is None and building:
        problems.append(f"no version serves yet: its first run ({runs[0].run_id}) is in progress")
    elif live is None and shadows:
        # a first build held for a person (new instruction-like lines): a run over the same files resumes it and
        # is held again; what it waits for is someone to read it
        problems.append(f"no version serves yet: v{shadows[-1]} is built and held for a person (`status` says why); "
                        f"`kb-reindex promote --version {shadows[-1]} --reason ...` or the page's Promote anyway puts "
                        "it live")
    elif live is None and kb.problem is None and kb.schedule_problem is None:
        # a refused entry, a schedule that is no cron: no reindex DAG, and the problem says what to mend
        problems.append(f"no version serves yet: trigger {kb.dag_id('knowledge_reindex')}")
    served = served_lines(state, kb.alias, live) if state is not None else None
    return BaseSummary(alias=kb.alias, dag_id=kb.dag_id("knowledge_reindex"), schedule=kb.schedule,
                       source_poll_s=settings.source_poll_s,
                       live_version=live.version if live else None, collection=live.collection if live else None,
                       embed_model=live.embed_model if live else None, dim=live.embed_dim if live else None,
                       frozen=freeze is not None, freeze_reason=freeze.reason if freeze is not None else None,
                       last_run=last, problems=tuple(problems), registry_error=kb.problem,
                       served_instructions=served.lines if served else 0,
                       instructions_accepted_by=served.accepted_by if served else None,
                       shadows=shadows)


def _in_progress(state: StateStore | None, version: Any) -> bool:
    """A candidate: the run that built it has not ended (it validates or promotes now), so it is no shadow."""
    run = state.get_run(version.run_id) if state is not None and version.run_id else None
    return run is not None and run.finished_at is None


def bases_view(registry: Registry, state_url: str) -> BasesView:
    """Every knowledge base of `registry` from the state DB at `state_url` (one the first run has not created
    yet: nothing serves anywhere), and every one the state DB recorded that the registry no longer lists (its
    recorded entry, saying so). A retired one is left out, and its entry, while the registry still lists it,
    is refused (`retired_refusal`)."""
    try:
        state: StateStore | None = StateStore(state_url, create=False)
    except (StateEmpty, StateMissing):  # a fresh install: nothing built anywhere yet
        state = None
    try:
        retired = state.retired_aliases() if state is not None else {}
        broken = tuple(_stand_in(state, registry, alias, error) for alias, error in registry.broken.items())
        removed = registry.removed(state.recorded_unretired()) if state else ()
        shown = [kb for kb in registry.in_order((*registry.bases, *broken, *removed)) if kb.alias not in retired]
        return BasesView(bases=tuple(summary(state, kb) for kb in shown),
                         refused=(*registry.errors, *retired_refusals(registry, retired)))
    finally:
        if state is not None:
            state.dispose()


def retired_refusal(registry: Registry, retirement: Retirement) -> str:
    """What a retired knowledge base is refused with: its entry named while the registry still lists it."""
    return retired_message(retirement, registry=registry.path, listed=retirement.alias in registry.order)


def retired_refusals(registry: Registry, retired: Mapping[str, Retirement]) -> tuple[str, ...]:
    """The refusal of each entry the registry still lists whose knowledge base was retired, in its order."""
    return tuple(retired_refusal(registry, retired[alias]) for alias in registry.order if alias in retired)


def retirements(state_url: str) -> dict[str, Retirement]:
    """Every retirement in force, by alias (none without a state DB yet)."""
    try:
        state = StateStore(state_url, create=False)
    except (StateEmpty, StateMissing):
        return {}
    try:
        return state.retired_aliases()
    finally:
        state.dispose()


def refuse_retired(registry: Registry, kb: KnowledgeBase, state_url: str) -> None:
    """Raise a ConfigError naming the retirement (who, when, why, how to undo) when `kb` was retired."""
    retirement = retirements(state_url).get(kb.alias)
    if retirement is not None:
        raise ConfigError(retired_refusal(registry, retirement))


def _stand_in(state: StateStore | None, registry: Registry, alias: str, problem: str) -> KnowledgeBase:
    recorded = state.recorded_entry(alias) if state is not None else None
    return stand_in(alias, registry=registry.path, problem=problem, recorded=recorded)


def removed_entries(registry: Registry, state_url: str) -> tuple[KnowledgeBase, ...]:
    """Stand-ins for the knowledge bases the state DB recorded, not retired, that the registry no longer lists
    (none without a state DB yet)."""
    try:
        state = StateStore(state_url, create=False)
    except (StateEmpty, StateMissing):
        return ()
    try:
        return registry.removed(state.recorded_unretired())
    finally:
        state.dispose()


def recorded_entry(state_url: str, alias: str) -> RecordedEntry | None:
    """`alias`'s last entry that loaded, as the state DB keeps it (None: none, or no state DB yet)."""
    try:
        state = StateStore(state_url, create=False)
    except (StateEmpty, StateMissing):
        return None
    try:
        return state.recorded_entry(alias)
    finally:
        state.dispose()


def on_call_base(registry: Registry, name: str | None, state_url: str, *, retired: bool = False) -> KnowledgeBase:
    """The knowledge base on-call names (`--kb`, KB_NAME, the only one): its entry; when that does not load
    (refused, or removed from the registry) a stand-in (`KnowledgeBase.problem` says why) made from the entry the
    state DB recorded when it last loaded, or from the alias alone. A name the registry never held, or one
    removed and never recorded, is refused as before; so is a retired one (`refuse_retired`), unless `retired`
    (`kb-reindex retire` itself: said again, or undone)."""
    kb = _on_call_base(registry, name, state_url)
    if not retired:
        refuse_retired(registry, kb, state_url)
    return kb


def _on_call_base(registry: Registry, name: str | None, state_url: str) -> KnowledgeBase:
    try:
        return registry.select(name)
    except ConfigError:
        name = name or named_in()
        if registry.path is None or not name or not valid_alias(name):
            raise
        recorded = recorded_entry(state_url, name)
        problem = registry.broken.get(name)
        if problem is None:
            if recorded is None:
                raise
            problem = removed_problem(name, registry.path, recorded)
        return stand_in(name, registry=registry.path, problem=problem, recorded=recorded)
