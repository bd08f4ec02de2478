#!/usr/bin/env bash
# The main job on the embedded default (multilingual-e5-small in process, local Qdrant, SQLite): the
# knowledge_reindex DAG of each knowledge base the shipped registry lists (knowledge/registry.yaml: the shop's
# help centre and the sellers' rules) through Airflow, what they did, and questions answered through each alias.
# KB_REGISTRY= (empty) runs the one knowledge base the environment describes instead (DAG knowledge_reindex).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/airflow-env.sh
export KB_REGISTRY="${KB_REGISTRY-knowledge/registry.yaml}"
export PATH="$PWD/.venv/bin:$PATH"
airflow db migrate > .airflow-migrate.log 2>&1 || { cat .airflow-migrate.log; exit 1; }
# a write pool per knowledge base, KB_BUILD_PARALLELISM slots each (more than 1 is refused in local mode)
python -m kb_reindex.airflow.lanes --json > .airflow-pools.json
airflow pools import .airflow-pools.json > /dev/null
dags="$(kb-reindex bases --json | python -c 'import json, sys; print(*(b["dag_id"] for b in json.load(sys.stdin)["knowledge_bases"]))')"
: > .kb-demo.log
for dag in $dags; do
  airflow dags test "$dag" >> .kb-demo.log 2>&1 || true
  if grep -q "DagRun Finished: dag_id=$dag, .*state=success" .kb-demo.log; then
    echo "$dag: DAG run succeeded (full log: .kb-demo.log)"
  else
    grep -oE "kb_reindex: [^[]*" .kb-demo.log || true
    echo "$dag: DAG run did not succeed; see .kb-demo.log"
    exit 1
  fi
done
echo
kb-reindex bases
first="$(kb-reindex bases --json | python -c 'import json, sys; print(json.load(sys.stdin)["knowledge_bases"][0]["alias"])')"
echo
kb-reindex --kb "$first" status
echo
kb-reindex --kb "$first" history
# the pages are in Chinese; multilingual-e5-small (the embedded default) answers in either language
echo
echo "An English question, answered from the Chinese pages:"
echo "  kb-reindex --kb $first query \"my package arrived broken, what can I do\" -k 2"
kb-reindex --kb "$first" query "my package arrived broken, what can I do" -k 2
echo
echo "The same question in Chinese:"
echo "  kb-reindex --kb $first query \"收到的包裹破损了怎么办\" -k 2"
kb-reindex --kb "$first" query "收到的包裹破损了怎么办" -k 2
if [[ " $dags " == *" knowledge_reindex__seller_rules "* ]]; then
  echo
  echo "The second knowledge base answers the sellers' questions from its own pages:"
  echo "  kb-reindex --kb seller_rules query \"货款什么时候到账\" -k 1"
  kb-reindex --kb seller_rules query "货款什么时候到账" -k 1
fi
