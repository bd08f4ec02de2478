"""
### knowledge_model_migration: rebuild the knowledge base with another embedding model

Manual only. The same run as `knowledge_reindex` (plan, create_version, build mapped over slices, validate,
promote, cleanup; the promotion starts `knowledge_watch`), as a full build into a new collection named by the new model
(`<alias>__<model>__v<N>`): no vector is reused across models or dimensions. Validation uses the golden
set's absolute thresholds (or the overrides below); the report shows old-model and new-model ranks side by
side per probe.

- **promote** on: the alias moves to the new model after validation (compare-and-swap), and later
  reindexes keep using the new model.
- **promote** off: a *shadow* version, built and validated only (the `promote` task is skipped, the run
  ends `shadow`), kept until promoted through `knowledge_promote_shadow` or dropped.

Rolling back a migration is an ordinary rollback (`knowledge_rollback`). A promotion updates the alias Asset
with `extra` {alias, action: "migrate", version, collection, model, dimension, previous_version}.
What on-call sees and does at each step: `docs/runbook.md`.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param
from kb_reindex.airflow.factory import for_each_knowledge_base, knowledge_dag
from kb_reindex.domain.model import RunKind
from kb_reindex.services.config import DEFAULT_MODELS, EMBEDDERS
from kb_reindex.services.registry import KnowledgeBase


def knowledge_model_migration(kb: KnowledgeBase) -> DAG:
    return knowledge_dag(kb, "knowledge_model_migration", kind=RunKind.MIGRATION, doc_md=__doc__, params=PARAMS,
                         schedule=None, tags=("migration",))


PARAMS = {
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
}

globals().update(for_each_knowledge_base(knowledge_model_migration))
