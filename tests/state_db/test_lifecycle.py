"""The version lifecycle: every allowed status move works, a disallowed one is refused before anything is
written, and a row that moved underneath the writer is a loud error naming what was expected and found."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import force_status
from kb_reindex.domain import lifecycle
from kb_reindex.domain.errors import KbError
from kb_reindex.domain.lifecycle import BUILDING, DELETED, FAILED, LIVE, READY, RETIRED, TRANSITIONS, StatusMoved
from kb_reindex.domain.model import VersionStatus
from kb_reindex.services.state.clock import ManualClock
from kb_reindex.services.state.store import StateStore
from kb_reindex.services.state.versions import VersionRecord


@pytest.fixture(params=["sqlite", pytest.param("mysql", marks=pytest.mark.mysql)])
def state(request: pytest.FixtureRequest, tmp_path: Path) -> StateStore:
    url = f"sqlite:///{tmp_path}/state.db" if request.param == "sqlite" else request.getfixturevalue("mysql_url")
    store = StateStore(url, clock=ManualClock())
    yield store
    store.dispose()


def new_version(state: StateStore, status: VersionStatus = BUILDING) -> VersionRecord:
    version = state.allocate_version(
        alias="kb", collection_for=lambda n: f"kb__m__v{n}", kind="reindex", embedder="hashing", embed_model="m",
        embed_dim=8, distance="Cosine", chunking_version="c", corpus_fingerprint="f",
    )
    assert version.status == lifecycle.CREATED
    if status != BUILDING:
        force_status(state, version.id, status)
    return state.version_by_id(version.id)


ALLOWED = [(f, t) for f, targets in TRANSITIONS.items() for t in sorted(targets)]
REFUSED = [(f, t) for f in VersionStatus for t in VersionStatus if t not in TRANSITIONS[f]]


def test_the_table_names_every_status_and_deleted_is_the_end() -> None:
    assert set(TRANSITIONS) == set(VersionStatus)
    assert TRANSITIONS[DELETED] == frozenset()
    assert lifecycle.sources(LIVE) == {BUILDING, READY, FAILED, RETIRED}
    assert lifecycle.SWITCHABLE <= lifecycle.sources(LIVE) and lifecycle.RECONCILABLE <= lifecycle.sources(LIVE)
    assert lifecycle.BUILDABLE <= lifecycle.sources(BUILDING)
    assert lifecycle.DROPPABLE <= lifecycle.sources(DELETED)


@pytest.mark.parametrize(("from_", "to"), ALLOWED, ids=[f"{f}->{t}" for f, t in ALLOWED])
def test_every_allowed_move_is_written_with_its_stamps(state: StateStore, from_: VersionStatus,
                                                        to: VersionStatus) -> None:
    version = new_version(state, from_)
    state.transition_version(version.id, from_=[from_], to=to, points_written=3)
    after = state.version_by_id(version.id)
    assert (after.status, after.points_written) == (to, 3)
    now = state.clock.now()
    stamped = {READY: after.ready_at, LIVE: after.promoted_at, RETIRED: after.retired_at, DELETED: after.deleted_at}
    if to in stamped:
        assert stamped[to] == now
    if to in (BUILDING, READY, LIVE):
        assert (after.error, after.failed_step) == (None, None)


@pytest.mark.parametrize(("from_", "to"), REFUSED, ids=[f"{f}->{t}" for f, t in REFUSED])
def test_a_disallowed_move_is_refused_and_nothing_is_written(state: StateStore, from_: VersionStatus,
                                                              to: VersionStatus) -> None:
    version = new_version(state, from_)
    with pytest.raises(KbError, match=f"cannot move from {from_} to {to}"):
        state.transition_version(version.id, from_=[from_], to=to)
    assert state.version_by_id(version.id).status == from_


def test_a_row_that_moved_underneath_is_not_written_and_the_error_names_both_statuses(state: StateStore) -> None:
    version = new_version(state)
    state.transition_version(version.id, from_=[BUILDING], to=READY)  # another run validated it meanwhile
    with pytest.raises(StatusMoved, match=r"v1 of kb is ready now, not building as expected: .* move to failed"):
        state.mark_failed(version.id, step="build", error="boom", from_=[BUILDING])
    after = state.version_by_id(version.id)
    assert (after.status, after.error) == (READY, None)
    force_status(state, version.id, DELETED)
    with pytest.raises(StatusMoved, match="v1 of kb is deleted now, not ready as expected"):
        state.transition_version(version.id, from_=[READY], to=LIVE)


def test_a_version_that_is_gone_is_named_as_gone(state: StateStore) -> None:
    with pytest.raises(StatusMoved, match="the version is gone, not building as expected"):
        state.transition_version(12345, from_=[BUILDING], to=READY)


def test_status_is_not_an_ordinary_column(state: StateStore) -> None:
    version = new_version(state)
    with pytest.raises(KbError, match="transition_version"):
        state.update_version(version.id, status="ready")
    with pytest.raises(KbError, match="rebuilt from Qdrant cannot be 'building'"):
        state.insert_version(alias="kb", version=9, collection="kb__m__v9", status="building", kind="reindex",
                             embedder="hashing", embed_model="m", embed_dim=8, distance="Cosine",
                             chunking_version="c", corpus_fingerprint="f")


def test_an_alias_switch_is_undone_whole_when_the_previous_live_moved(state: StateStore) -> None:
    first, second = new_version(state, READY), new_version(state, READY)
    state.record_switch(alias="kb", action="promote", to=first, previous=None, run_id="r1")
    stale = state.live_version("kb")
    force_status(state, first.id, RETIRED)  # a rollback or reconcile moved it meanwhile
    third = new_version(state, LIVE)
    with pytest.raises(StatusMoved, match="v1 of kb is retired now, not live"):
        state.record_switch(alias="kb", action="promote", to=second, previous=stale, run_id="r2")
    assert state.version_by_id(second.id).status == READY and state.version_by_id(third.id).status == LIVE
    assert len(state.alias_events("kb")) == 1, "the event went with the rest of the transaction"
    with pytest.raises(StatusMoved, match="v3 of kb is live now, not nothing as expected"):
        state.record_switch(alias="kb", action="promote", to=second, previous=None, run_id="r3")


def test_a_switch_to_a_version_that_is_not_switchable_is_refused(state: StateStore) -> None:
    building = new_version(state)
    with pytest.raises(StatusMoved, match="is building now, not ready or retired"):
        state.record_switch(alias="kb", action="promote", to=building, previous=None, run_id="r1")
    state.record_switch(alias="kb", action="reconcile", to=building, previous=None, run_id="r1",
                        from_=lifecycle.RECONCILABLE)
    assert state.live_version("kb").id == building.id


@pytest.mark.parametrize(("status", "step", "resumes", "validates"), [
    (BUILDING, None, True, True), (READY, None, False, True), (LIVE, None, False, False),
    (RETIRED, None, False, False), (DELETED, None, False, False),
    *[(FAILED, step, True, True) for step in lifecycle.RESUMABLE_STEPS],
    (FAILED, "rebuild", False, False),
])
def test_one_rule_says_what_a_rerun_resumes_and_what_a_validation_records(
        status: VersionStatus, step: str | None, resumes: bool, validates: bool) -> None:
    assert lifecycle.may_resume(status, step) is resumes
    assert lifecycle.may_validate(status, step) is validates
