#!/usr/bin/env bash
# The main job on the embedded default: the knowledge_reindex DAG through Airflow, then what it did.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/airflow-env.sh
export PATH="$PWD/.venv/bin:$PATH"
airflow db migrate > .airflow-migrate.log 2>&1 || { cat .airflow-migrate.log; exit 1; }
airflow pools set kb_qdrant_writes 1 "Serialises writes to the Qdrant knowledge store" > /dev/null
airflow dags test knowledge_reindex 2>&1 | tee .kb-demo.log | grep -oE "kb_reindex: [^[]*|DagRun Finished: dag_id=[a-z_]+|state=(success|failed)|ERROR.*" || true
grep -q "DagRun Finished.*state=success\|Marking run.*successful\|state=success" .kb-demo.log || { echo "knowledge_reindex did not succeed; see .kb-demo.log"; exit 1; }
echo
kb-reindex status
echo
kb-reindex history
