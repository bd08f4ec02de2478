"""
### knowledge_reindex: rebuild the help-centre index without ever serving a half-built one

1. **plan**: SHA-256 per document and chunk against live's manifest; nothing changed → `no_change`. Otherwise
   the plan is snapshotted in the state DB (the only task that reads `knowledge/`).
2. **create_version**: the version takes a slot (`<alias>__<model>__s<N>`) and is brought to the new manifest by
   the difference (an unfinished or ready version of the same plan is taken over).
   **path** then takes one of two ways, the other shown skipped: **small_run** (at most `small_run_points`,
   `KB_SMALL_RUN_POINTS` 1000, points to write) does steps 3-6 in one task; otherwise the mapped slices:
3. **build** (mapped over slices): copy unchanged vectors from live, embed the rest; a retry skips what is written.
4. **validate**: exact count and IDs, dimension, payload, golden set (hit@k, MRR, no regression). Fails → alias stays.
5. **promote**: compare-and-swap of the alias; the previous version is kept for rollback. A frozen alias
   (`kb-reindex freeze`, a rollback's freeze) skips it: the version is kept unpromoted, the run ends `frozen`.
6. **cleanup** applies retention, never touching live or the rollback target. The promotion's event on the
   alias Asset starts `knowledge_watch`, which watches the promoted version (`watch_minutes`, `KB_WATCH_MINUTES`
   > 0) and rolls it back on a regression: this run ends here, so a change made during the watch is built at once.

**When it runs**: on its time schedule (`KB_REINDEX_SCHEDULE`, a registry entry's `schedule`) OR within seconds
of a change to its source: a watcher in the triggerer, woken by a folder's file events, lists the source (and
every `KB_SOURCE_POLL_S`, default 15; 0: not watched) and fires once it was quiet for `KB_SOURCE_QUIET_S`
(default 1 s for a folder, 5 s for a bucket) and no run is in progress. A
watched DAG starts unpaused; pausing it stops both.

Params: `force_full_rebuild`, `dry_run`, `build_slice_size`, `small_run_points`, `watch_minutes`, `payload_layout` (empty: keep live's layout).
What on-call sees and does at each step: `docs/runbook.md` (rollback, locks, every status message).
"""

from __future__ import annotations

from airflow.sdk import DAG, Param
from kb_reindex.airflow.constants import BUILD_SLICE_SIZE
from kb_reindex.airflow.factory import for_each_knowledge_base, knowledge_dag, reindex_schedule, watched
from kb_reindex.domain.model import RunKind
from kb_reindex.services.registry import KnowledgeBase


def knowledge_reindex(kb: KnowledgeBase) -> DAG:
    return knowledge_dag(kb, "knowledge_reindex", kind=RunKind.REINDEX, doc_md=__doc__, params=PARAMS,
                         schedule=reindex_schedule(kb), unpaused=watched(kb))  # its time schedule OR a change of its watched source


PARAMS = {
    "force_full_rebuild": Param(False, type="boolean", title="Force full rebuild",
                                description="Embed every chunk again; reuse no vector from live.", section="Build"),
    "dry_run": Param(False, type="boolean", title="Dry run",
                     description="Plan only: report what would change and stop.", section="Build"),
    "payload_layout": Param(None, type=["null", "string"], title="Payload layout",
                            description="Empty: keep the layout live serves (KB_PAYLOAD_LAYOUT only shapes a "
                                        "first build). Set to change it on purpose: native, langchain4j (or "
                                        "langchain4j:<text key>), langchain, llamaindex; vectors are copied.",
                            section="Build"),
    "watch_minutes": Param(None, type=["null", "number"], minimum=0, maximum=1440, title="Watch after promotion",
                           description="Minutes to watch the alias after this run's promotion and roll back on a "
                                       "regression (between looks the watch holds no worker slot); empty: "
                                       "KB_WATCH_MINUTES, 0: no watch.", section="Promotion"),
    "build_slice_size": Param(BUILD_SLICE_SIZE, type="integer", minimum=1, title="Points per build task",
                              description="Size of each mapped build slice.", section="Build"),
    "small_run_points": Param(None, type=["null", "integer"], minimum=0, title="Points for one task",
                              description="A run with at most this many points to write (and no more than one "
                                          "slice) builds, validates, promotes and cleans up in one task "
                                          "(small_run); empty: KB_SMALL_RUN_POINTS (1000), 0: always the mapped "
                                          "slices.", section="Build"),
}

globals().update(for_each_knowledge_base(knowledge_reindex))
