#!/usr/bin/env bash
# The main job on the embedded default: the knowledge_reindex DAG through Airflow, then what it did.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/airflow-env.sh
export PATH="$PWD/.venv/bin:$PATH"
airflow db migrate > .airflow-migrate.log 2>&1 || { cat .airflow-migrate.log; exit 1; }
slots="$(python -m kb_reindex.config)"  # KB_BUILD_PARALLELISM; more than 1 is refused in local mode
airflow pools set kb_qdrant_writes "$slots" "Qdrant writes of kb-reindex (KB_BUILD_PARALLELISM)" > /dev/null
airflow dags test knowledge_reindex > .kb-demo.log 2>&1 || true
grep -oE "kb_reindex: [^[]*" .kb-demo.log || true
if grep -q "DagRun Finished: dag_id=knowledge_reindex.*state=success" .kb-demo.log; then
  echo "knowledge_reindex: DAG run succeeded (full log: .kb-demo.log)"
else
  echo "knowledge_reindex: DAG run did not succeed; see .kb-demo.log"
  exit 1
fi
echo
kb-reindex status
echo
kb-reindex history
