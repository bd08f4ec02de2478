"""
### knowledge_model_migration: rebuild the knowledge base with another embedding model

Manual only. A migration is a full build into a new collection named by the new model
(`<alias>__<model>__v<N>`): no vector is reused across models or dimensions. Validation uses the
golden set's absolute thresholds (or the overrides below); the report shows old-model and new-model
ranks side by side per probe.

- **promote** on: the alias moves to the new model after validation (compare-and-swap), and later
  reindexes keep using the new model.
- **promote** off: a *shadow* version, built and validated only, kept until promoted or dropped.

Rolling back a migration is an ordinary rollback (`knowledge_rollback`). A shadow goes live later
through `knowledge_promote_shadow` (validated again, never through a rollback). A promotion updates the
alias Asset with `extra` {alias, action: "migrate", version, collection, model, dimension, previous_version}.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import Param, TriggerRule, dag, task
from kb_reindex.assets import KNOWLEDGE_ALIAS, POOL
from kb_reindex.config import DEFAULT_MODELS, EMBEDDERS
from kb_reindex.dag_support import current_run_id, release_run_lock


@dag(
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    # a run that fails as a whole (marked failed in the UI, timed out) lets its lock go too; the lock's
    # liveness check asks Airflow about the run as well, so nothing depends on this callback firing
    on_failure_callback=release_run_lock,
    doc_md=__doc__,
    tags=["knowledge", "qdrant", "migration"],
    # the run holds the alias's reindex lock from plan to cleanup; a task that fails for good releases it
    default_args={"retries": 2, "retry_delay": timedelta(minutes=1), "retry_exponential_backoff": True,
                  "on_failure_callback": release_run_lock},
    params={
        "embedder": Param("ollama", type="string", enum=list(EMBEDDERS), title="Embedder",
                          description="ollama: the Ollama server of the ollama_default Connection (production); "
                                      "e5: multilingual-e5-small in the worker's process (offline, real semantics, "
                                      "English and Chinese); hashing: character n-grams, offline and deterministic, "
                                      "for tests and tiny machines.", section="Model"),
        "model": Param(None, type=["null", "string"], title="Model name",
                       description="Empty: the embedder's default ("
                                   + ", ".join(f"{kind}: {name}" for kind, name in DEFAULT_MODELS.items())
                                   + "). It must be a model the embedder serves, checked before anything is built: "
                                     "hashing serves only its own hashing-* names, e5 only multilingual-e5-small, "
                                     "Ollama only models it has pulled.",
                       section="Model"),
        "dimension": Param(None, type=["null", "integer"], minimum=1, title="Dimension",
                           description="Empty: probed from the embedder.", section="Model"),
        "payload_layout": Param(None, type=["null", "string"], title="Payload layout",
                                description="Empty: the layout live serves (KB_PAYLOAD_LAYOUT for a first build). How "
                                            "the new version's payloads look to the assistant that reads them: "
                                            "native, langchain4j (or langchain4j:<text key>), langchain, "
                                            "llamaindex.", section="Model"),
        "promote": Param(True, type="boolean", title="Promote after validation",
                         description="Off: build and validate a shadow version only.", section="Release"),
        "min_hit_rate": Param(None, type=["null", "number"], minimum=0, maximum=1, title="Minimum hit rate",
                              description="Empty: the golden set's value.", section="Release"),
        "min_mrr": Param(None, type=["null", "number"], minimum=0, maximum=1, title="Minimum MRR",
                         description="Empty: the golden set's value.", section="Release"),
    },
)
def knowledge_model_migration():
    @task
    def plan(params: dict | None = None) -> dict:
        from kb_reindex.airflow_tasks import plan_task

        return plan_task(run_id=current_run_id(), kind="migration", embedder=params["embedder"], model=params["model"],
                         dim=params["dimension"], layout=params.get("payload_layout"))

    @task(pool=POOL)
    def create_version(plan: dict) -> dict:
        from kb_reindex.airflow_tasks import create_version_task

        return create_version_task(plan=plan, run_id=current_run_id())

    @task(pool=POOL, retries=3)
    def build(version: dict) -> dict:
        from kb_reindex.airflow_tasks import build_task

        return build_task(version=version, run_id=current_run_id())

    @task
    def validate(version: dict, params: dict | None = None) -> dict:
        from kb_reindex.airflow_tasks import validate_task

        return validate_task(version=version, run_id=current_run_id(), min_hit_rate=params["min_hit_rate"],
                             min_mrr=params["min_mrr"])

    @task.branch
    def release(params: dict | None = None) -> str:
        return "promote" if params["promote"] else "keep_shadow"

    @task(pool=POOL, outlets=[KNOWLEDGE_ALIAS])
    def promote(plan: dict, version: dict) -> dict:
        from kb_reindex.airflow_tasks import promote_task

        return promote_task(plan=plan, version=version, run_id=current_run_id())

    @task
    def keep_shadow(plan: dict, version: dict) -> dict:
        from kb_reindex.airflow_tasks import finish_shadow_task

        return finish_shadow_task(plan=plan, version=version, run_id=current_run_id())

    # after a promotion, a kept shadow or a promotion that found the version already live; never after a failure
    @task(pool=POOL, trigger_rule=TriggerRule.NONE_FAILED)
    def cleanup() -> dict:
        from kb_reindex.airflow_tasks import cleanup_task

        return cleanup_task(run_id=current_run_id())

    planned = plan()
    version = create_version(planned)
    built = build(version)
    checked = validate(version)
    built >> checked >> release() >> [promote(planned, version), keep_shadow(planned, version)] >> cleanup()


knowledge_model_migration()
