#!/usr/bin/env bash
# A real local Airflow without Docker: api-server, scheduler, dag-processor and triggerer in the background,
# pid files and logs under $AIRFLOW_HOME/run. Every setting below yields to the environment, so a test can run
# its own instance on a free port.
#   default            LocalExecutor on SQLite (the embedded default, one machine)
#   Celery             KB_AIRFLOW_EXECUTOR=CeleryExecutor KB_AIRFLOW_DB_URL=postgresql+psycopg2://... make airflow
#                      adds KB_CELERY_WORKERS (2) Celery workers on the broker KB_CELERY_BROKER_URL (Redis), and
#                      on-call's worker (worker-oncall), which takes only the queue KB_ONCALL_QUEUE (kb_oncall)
# On-call's lane (kb_reindex.airflow.lanes): rollbacks and shadow promotions run in the pool KB_ONCALL_POOL
# (kb_oncall, KB_ONCALL_SLOTS slots, default 2), and default_pool is sized so that every other task leaves those
# slots of AIRFLOW__CORE__PARALLELISM (32) free; with Celery they go to on-call's own queue and worker.
# KB_ONCALL_POOL= / KB_ONCALL_QUEUE= (empty) turn either off.
# Run again after a component died: it starts what is missing and leaves what runs.
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
export AIRFLOW__CORE__EXECUTOR="${KB_AIRFLOW_EXECUTOR:-${AIRFLOW__CORE__EXECUTOR:-LocalExecutor}}"
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="${KB_AIRFLOW_DB_URL:-${AIRFLOW__DATABASE__SQL_ALCHEMY_CONN:-sqlite:///$AIRFLOW_HOME/airflow.db}}"
# Airflow's async engine on PostgreSQL: psycopg 3 (installed, pinned) rather than asyncpg (not installed)
if [[ "$AIRFLOW__DATABASE__SQL_ALCHEMY_CONN" == postgresql* ]] && [ -z "${AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC:-}" ]; then
  export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC="postgresql+psycopg://${AIRFLOW__DATABASE__SQL_ALCHEMY_CONN#*://}"
fi
export AIRFLOW__CORE__AUTH_MANAGER="${AIRFLOW__CORE__AUTH_MANAGER:-airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager}"
export AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS="${AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS:-admin:admin}"
# tasks report to the api-server's execution API; its default assumes port 8080, and a task that cannot
# reach it is killed before our code runs
export AIRFLOW__CORE__EXECUTION_API_SERVER_URL="${AIRFLOW__CORE__EXECUTION_API_SERVER_URL:-$base/execution/}"
# the hostname a task instance records: each Celery worker's own (KB_WORKER_HOSTNAME), else the machine's
export AIRFLOW__CORE__HOSTNAME_CALLABLE="${AIRFLOW__CORE__HOSTNAME_CALLABLE:-kb_reindex.airflow.hostname.worker_hostname}"
# how long a task's supervisor sleeps between looks at its process (and at most heartbeats): Airflow 3.3's
# supervisor can miss a task process's exit (its sockets close a moment before it can be reaped) and notice it
# only at the next look, so with the default 5 s a run often ends ~5 s after its last task, and a task holds its
# slot that long; 1 s ends it within a second, for one heartbeat a second per running task
export AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL="${AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL:-1}"
# the Knowledge index page triggers rollbacks through this api-server
export KB_AIRFLOW_API_URL="${KB_AIRFLOW_API_URL:-$base}"
# the embedded default: local-mode Qdrant and SQLite state under $KB_PROJECT_ROOT/.kb, multilingual-e5-small
# in process (offline; KB_EMBEDDER=hashing for a tiny machine)
export KB_PROJECT_ROOT="${KB_PROJECT_ROOT:-$root}"
export KB_EMBEDDER="${KB_EMBEDDER:-e5}"
# the knowledge bases: the shipped registry (the shop's help centre and the sellers' rules) unless KB_REGISTRY
# names another; KB_REGISTRY= (empty) serves the one knowledge base KB_ALIAS and the KB_* settings describe
if [ -z "${KB_REGISTRY+set}" ] && { [ -n "${KB_ALIAS:-}" ] || [ -n "${KB_KNOWLEDGE_DIR:-}" ]; }; then
  echo "warning: KB_ALIAS/KB_KNOWLEDGE_DIR are set but KB_REGISTRY is not: serving the shipped registry" \
    "knowledge/registry.yaml, whose entries they do not change; KB_REGISTRY= (empty) serves the one knowledge" \
    "base they describe" >&2
fi
export KB_REGISTRY="${KB_REGISTRY-knowledge/registry.yaml}"
# on-call's lane: its pool (every component parses the DAG files with the same value) and the parallelism the
# pools are sized against
export KB_ONCALL_POOL="${KB_ONCALL_POOL-kb_oncall}"
export AIRFLOW__CORE__PARALLELISM="${AIRFLOW__CORE__PARALLELISM:-32}"

run="$AIRFLOW_HOME/run"
mkdir -p "$run"
components=(api-server scheduler dag-processor triggerer)

case "$AIRFLOW__CORE__EXECUTOR" in
  *CeleryExecutor*)
    if [[ "$AIRFLOW__DATABASE__SQL_ALCHEMY_CONN" == sqlite* ]]; then
      echo "CeleryExecutor needs a metadata DB every worker reaches, not SQLite ($AIRFLOW__DATABASE__SQL_ALCHEMY_CONN):" \
        "set KB_AIRFLOW_DB_URL=postgresql+psycopg2://user@host:5432/airflow" >&2
      exit 1
    fi
    export AIRFLOW__CELERY__BROKER_URL="${KB_CELERY_BROKER_URL:-${AIRFLOW__CELERY__BROKER_URL:-redis://127.0.0.1:6379/0}}"
    # unset: Celery keeps task results in the metadata DB (db+postgresql://...)
    [ -n "${KB_CELERY_RESULT_BACKEND:-}" ] && export AIRFLOW__CELERY__RESULT_BACKEND="$KB_CELERY_RESULT_BACKEND"
    workers="${KB_CELERY_WORKERS:-2}"
    [[ "$workers" =~ ^[1-9][0-9]*$ ]] || { echo "KB_CELERY_WORKERS must be a whole number >= 1, not '$workers'" >&2; exit 1; }
    for i in $(seq 1 "$workers"); do components+=("worker-$i"); done
    # on-call's queue and the worker that takes it alone: a rollback never waits for a build slice's worker
    export KB_ONCALL_QUEUE="${KB_ONCALL_QUEUE-kb_oncall}"
    [ -z "$KB_ONCALL_QUEUE" ] || components+=("worker-oncall")
    ;;
esac

# what the components are started with, for an `airflow` command typed by hand against this stack (`airflow
# connections add`, `airflow pools set`: on PostgreSQL it needs the metadata DB's async URL too): every AIRFLOW*
# variable, to source first (its DB URLs may hold a password: readable by this user alone)
( umask 077
  { echo "# written by scripts/airflow.sh: \`source $run/airflow-env.sh\` before an airflow command against this stack"
    for name in $(compgen -e | grep '^AIRFLOW' | sort); do printf 'export %s=%q\n' "$name" "${!name}"; done
  } > "$run/airflow-env.sh" )

source "$root/scripts/processes.sh"  # running, start_ticks
alive() { [ -f "$run/$1.pid" ] && running "$(cat "$run/$1.pid")"; }

missing=()
for name in "${components[@]}"; do
  if alive "$name"; then
    echo "airflow $name already runs (pid $(cat "$run/$name.pid")); left as it is"
  else
    missing+=("$name")
  fi
done

if [ "${#missing[@]}" -gt 0 ]; then
  airflow db migrate > "$run/db-migrate.log" 2>&1 || { tail -n 40 "$run/db-migrate.log"; exit 1; }
  # a write pool per knowledge base (kb_qdrant_writes; with KB_REGISTRY kb_qdrant_writes__<alias>), its slots
  # KB_BUILD_PARALLELISM (build slices writing at once), checked by the settings: local mode admits one client,
  # so a larger value there, or a bad registry, stops here with the reason
  # and on-call's pool with default_pool sized beside it (kb_reindex.airflow.lanes)
  # (all in one `airflow pools import`: one Airflow process, not one per pool)
  python -m kb_reindex.airflow.lanes --json > "$run/pools.json"
  airflow pools import "$run/pools.json" >> "$run/pool.log" 2>&1 || { cat "$run/pool.log"; exit 1; }
fi

# each component leads a session of its own (setsid), so airflow-stop.sh finds its children too (executor
# workers, Celery's pool, task processes in process groups of their own, api-server workers)
for name in ${missing[@]+"${missing[@]}"}; do
  # a component killed with kill -9 may leave children in its session (no leader: nobody stops them)
  if [ -f "$run/$name.pid" ] && old="$(cat "$run/$name.pid")" && [[ "$old" =~ ^[0-9]+$ ]] && ! running "$old"; then
    orphans="$(ps -e -o pid=,sid=,stat= | awk -v s="$old" '$2 == s && $3 !~ /^Z/ {print $1}')"
    [ -z "$orphans" ] || kill -KILL $orphans 2> /dev/null || true
  fi
  extra=()
  case "$name" in
    api-server) command=(airflow api-server --host 127.0.0.1 --port "$port") ;;
    worker-oncall)
      # on-call's queue alone, as many tasks at once as on-call's pool has slots
      extra=(env "KB_WORKER_HOSTNAME=${KB_WORKER_HOSTNAME_PREFIX:-$(hostname -s)}-worker-oncall"
             "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT=${KB_CELERY_ONCALL_LOG_PORT:-$(( ${KB_CELERY_LOG_PORT:-8793} + workers ))}")
      command=(airflow celery worker --celery-hostname "kb-worker-oncall@%h" --queues "$KB_ONCALL_QUEUE"
               --concurrency "${KB_ONCALL_SLOTS:-2}") ;;
    worker-*)
      n="${name#worker-}"
      # its own Celery node name and the hostname its task instances record; its own log-server port
      extra=(env "KB_WORKER_HOSTNAME=${KB_WORKER_HOSTNAME_PREFIX:-$(hostname -s)}-worker-$n"
             "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT=$(( ${KB_CELERY_LOG_PORT:-8793} + n - 1 ))")
      command=(airflow celery worker --celery-hostname "kb-worker-$n@%h" --concurrency "${KB_CELERY_CONCURRENCY:-1}") ;;
    *) command=(airflow "$name") ;;
  esac
  setsid ${extra[@]+"${extra[@]}"} "${command[@]}" > "$run/$name.log" 2>&1 < /dev/null &
  echo $! > "$run/$name.pid"
  start_ticks $! > "$run/$name.start" || rm -f "$run/$name.start"
  echo "started airflow $name (pid $!)"
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
echo "Airflow is up: $base  (login: $login; executor $AIRFLOW__CORE__EXECUTOR)"
echo "Knowledge index page: $base/knowledge-index/ui"
echo "home $AIRFLOW_HOME, logs and pids in $run; stop with: make airflow-stop"
echo "airflow commands by hand against it: source $run/airflow-env.sh first"
