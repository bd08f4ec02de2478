#!/usr/bin/env bash
# The main job on the embedded default (multilingual-e5-small in process, local Qdrant, SQLite): the
# knowledge_reindex DAG through Airflow, what it did, and two questions answered through the alias.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/airflow-env.sh
export PATH="$PWD/.venv/bin:$PATH"
airflow db migrate > .airflow-migrate.log 2>&1 || { cat .airflow-migrate.log; exit 1; }
# a write pool per knowledge base, KB_BUILD_PARALLELISM slots each (more than 1 is refused in local mode)
pools="$(python -m kb_reindex.services.registry)"
while read -r pool slots; do
  airflow pools set "$pool" "$slots" "Qdrant writes of kb-reindex (KB_BUILD_PARALLELISM)" > /dev/null
done <<< "$pools"
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
# the pages are in Chinese; multilingual-e5-small (the embedded default) answers in either language
echo
echo "An English question, answered from the Chinese pages:"
echo "  kb-reindex query \"my package arrived broken, what can I do\" -k 2"
kb-reindex query "my package arrived broken, what can I do" -k 2
echo
echo "The same question in Chinese:"
echo "  kb-reindex query \"收到的包裹破损了怎么办\" -k 2"
kb-reindex query "收到的包裹破损了怎么办" -k 2
