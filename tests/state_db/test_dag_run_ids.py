"""The run id a DAG run is recorded under (`airflow:<dag_id>:<run_id>`) names its DAG run exactly, whatever
`__` the DAG id (`knowledge_reindex__shop`) or Airflow's run id (`manual__2026-...`) holds, so a lock's
liveness is asked of the right DAG run and a dead run's lock is taken over at once, not after KB_LOCK_TTL."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from kb_reindex.run.dag_lock import dag_run_owner
from kb_reindex.services.state.dag_runs import DagRunRef, dag_run_of, kb_run_id
from kb_reindex.services.state.locks import lock_owner_alive

RUN = "manual__2026-12-01T09:00:00+00:00"


@pytest.mark.parametrize("dag_id", ["knowledge_reindex", "knowledge_reindex__mall_knowledge",
                                    "knowledge_rollback__seller-rules", "knowledge_promote_shadow__a__b"])
def test_a_kb_run_id_reads_back_as_its_dag_run(dag_id: str) -> None:
    assert dag_run_of(kb_run_id(dag_id, RUN)) == DagRunRef(dag_id, RUN)


def test_ids_written_before_are_still_read_and_others_are_not_dag_runs() -> None:
    assert dag_run_of(f"airflow__knowledge_reindex__{RUN}") == DagRunRef("knowledge_reindex", RUN)
    assert dag_run_of("cli__reindex__1234") is None and dag_run_of("airflow:") is None
    with pytest.raises(ValueError, match="holds ':'"):
        kb_run_id("a:b", RUN)


def test_liveness_asks_airflow_about_the_run_of_a_per_knowledge_base_dag(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'airflow.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE dag_run (dag_id TEXT, run_id TEXT, state TEXT)"))
        conn.execute(sa.text("INSERT INTO dag_run VALUES ('knowledge_reindex__shop', :r, 'running'), "
                             "('knowledge_reindex__wiki', :r, 'failed'), ('knowledge_reindex', :r, 'failed')"), {"r": RUN})
    engine.dispose()
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", url)
    # the two knowledge bases' runs share Airflow's run id; each lock is judged by its own DAG's run
    assert lock_owner_alive(dag_run_owner(kb_run_id("knowledge_reindex__shop", RUN))) is True
    assert lock_owner_alive(dag_run_owner(kb_run_id("knowledge_reindex__wiki", RUN))) is False
    assert lock_owner_alive(dag_run_owner(kb_run_id("knowledge_reindex__gone", RUN))) is None  # unknown: the TTL
