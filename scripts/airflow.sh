#!/usr/bin/env bash
# A real local Airflow on the embedded default, without Docker: api-server, scheduler, dag-processor and
# triggerer in the background (LocalExecutor, SQLite metadata DB), pid files and logs under $AIRFLOW_HOME/run.
# Every setting below yields to the environment, so a test can run its own instance on a free port.
# Stop it with scripts/airflow-stop.sh (make airflow-stop).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export PATH="$root/.venv/bin:$PATH"

port="${KB_AIRFLOW_PORT:-8080}"
base="http://127.0.0.1:$port"
export AIRFLOW_HOME="${AIRFLOW_HOME:-$root/.airflow}"
export AIRFLOW__CORE__DAGS_FOLDER="${AIRFLOW__CORE__DAGS_FOLDER:-$root/dags}"
export AIRFLOW__CORE__PLUGINS_FOLDER="${AIRFLOW__CORE__PLUGINS_FOLDER:-$root/plugins}"
export AIRFLOW__CORE__LOAD_EXAMPLES=False
export AIRFLOW__CORE__EXECUTOR="${AIRFLOW__CORE__EXECUTOR:-LocalExecutor}"
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="${AIRFLOW__DATABASE__SQL_ALCHEMY_CONN:-sqlite:///$AIRFLOW_HOME/airflow.db}"
export AIRFLOW__CORE__AUTH_MANAGER="${AIRFLOW__CORE__AUTH_MANAGER:-airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager}"
export AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS="${AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS:-admin:admin}"
# tasks report to the api-server's execution API; its default assumes port 8080, and a task that cannot
# reach it is killed before our code runs
export AIRFLOW__CORE__EXECUTION_API_SERVER_URL="${AIRFLOW__CORE__EXECUTION_API_SERVER_URL:-$base/execution/}"
# the Knowledge index page triggers rollbacks through this api-server
export KB_AIRFLOW_API_URL="${KB_AIRFLOW_API_URL:-$base}"
# the embedded default: local-mode Qdrant and SQLite state under $KB_PROJECT_ROOT/.kb, multilingual-e5-small
# in process (offline; KB_EMBEDDER=hashing for a tiny machine)
export KB_PROJECT_ROOT="${KB_PROJECT_ROOT:-$root}"
export KB_EMBEDDER="${KB_EMBEDDER:-e5}"

run="$AIRFLOW_HOME/run"
mkdir -p "$run"
components=(api-server scheduler dag-processor triggerer)

alive() { [ -f "$run/$1.pid" ] && kill -0 "$(cat "$run/$1.pid")" 2> /dev/null; }

for name in "${components[@]}"; do
  if alive "$name"; then
    echo "Airflow already runs from $AIRFLOW_HOME ($name pid $(cat "$run/$name.pid")); stop it with make airflow-stop" >&2
    exit 1
  fi
done

airflow db migrate > "$run/db-migrate.log" 2>&1 || { tail -n 40 "$run/db-migrate.log"; exit 1; }
# the write pool's slots are KB_BUILD_PARALLELISM (build slices writing at once), checked by the settings:
# local mode admits one client, so a larger value there stops here with the reason
slots="$(python -m kb_reindex.config)"
airflow pools set kb_qdrant_writes "$slots" "Qdrant writes of kb-reindex (KB_BUILD_PARALLELISM)" > "$run/pool.log" 2>&1 \
  || { cat "$run/pool.log"; exit 1; }

# each component leads a session of its own (setsid), so stopping its process group stops its children too
# (executor workers, task processes, api-server workers)
for name in "${components[@]}"; do
  case "$name" in
    api-server) command=(airflow api-server --host 127.0.0.1 --port "$port") ;;
    *) command=(airflow "$name") ;;
  esac
  setsid "${command[@]}" > "$run/$name.log" 2>&1 < /dev/null &
  echo $! > "$run/$name.pid"
done

timeout_s="${KB_AIRFLOW_START_TIMEOUT:-180}"
deadline=$((SECONDS + timeout_s))
until python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
    "$base/api/v2/monitor/health" > /dev/null 2>&1; do
  for name in "${components[@]}"; do
    if ! alive "$name"; then
      echo "airflow $name exited while starting; last lines of $run/$name.log:" >&2
      tail -n 40 "$run/$name.log" >&2
      bash "$root/scripts/airflow-stop.sh" > /dev/null
      exit 1
    fi
  done
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "the Airflow API at $base did not answer within ${timeout_s}s; logs in $run" >&2
    bash "$root/scripts/airflow-stop.sh" > /dev/null
    exit 1
  fi
  sleep 1
done

# SimpleAuthManager writes the passwords it generated to this file (or [core] simple_auth_manager_passwords_file)
passwords="${AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE:-$AIRFLOW_HOME/simple_auth_manager_passwords.json.generated}"
login="$(python -c "import json, sys; users = json.load(open(sys.argv[1])); print('  '.join(f'{u} / {p}' for u, p in users.items()))" \
  "$passwords" 2> /dev/null || echo "see $passwords")"
echo "Airflow is up: $base  (login: $login)"
echo "Knowledge index page: $base/knowledge-index/ui"
echo "home $AIRFLOW_HOME, logs and pids in $run; stop with: make airflow-stop"
