#!/usr/bin/env bash
# airflow-init: one-shot bootstrap of the Airflow side, run on every `docker compose up` (idempotent).
#   1. metadata DB schema          airflow db migrate
#   2. admin login                 SimpleAuthManager password file from AIRFLOW_ADMIN_PASSWORD
#   3. pools                       kb_qdrant_writes, KB_BUILD_PARALLELISM slots (default 1): build slices writing at once;
#                                  kb_oncall (on-call's lane) and default_pool sized beside it
#   4. Connections                 qdrant_default, kb_state, ollama_default (recreated from .env)
#   5. smoke check                 kb-reindex status: state DB and Qdrant reachable with these secrets
# The Connection ids are the ones include/kb_reindex/airflow/connections.py reads. A failure here (exit != 0)
# keeps every other Airflow service from starting: `docker compose logs airflow-init` says why.
set -euo pipefail

: "${AIRFLOW_ADMIN_PASSWORD:?AIRFLOW_ADMIN_PASSWORD is not set}"
: "${QDRANT_API_KEY:?QDRANT_API_KEY is not set}"
: "${KB_STATE_DB_PASSWORD:?KB_STATE_DB_PASSWORD is not set}"
: "${AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE:?AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE is not set}"

echo "airflow-init: migrating the metadata database"
airflow db migrate

echo "airflow-init: admin password for ${AIRFLOW_ADMIN_USER:-admin}"
# JSON written by Python, so any character in the password is safe. Rewritten on every run: a new
# AIRFLOW_ADMIN_PASSWORD takes effect on the next `up` (restart airflow-apiserver).
python - <<'PY'
import json, os, pathlib

path = pathlib.Path(os.environ["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"])
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(json.dumps({os.environ.get("AIRFLOW_ADMIN_USER", "admin"): os.environ["AIRFLOW_ADMIN_PASSWORD"]}) + "\n")
path.chmod(0o600)
PY

# a write pool per knowledge base (KB_REGISTRY's entries each kb_qdrant_writes__<alias>), KB_BUILD_PARALLELISM
# slots each (build slices writing to Qdrant at once), as the settings accept it; on-call's pool (KB_ONCALL_POOL,
# KB_ONCALL_SLOTS) and default_pool sized so that those slots of AIRFLOW__CORE__PARALLELISM stay free for
# rollbacks (kb_reindex.airflow.lanes)
# (all in one `airflow pools import`: one Airflow process, not one per pool)
python -m kb_reindex.airflow.lanes --json > /tmp/kb-pools.json
echo "airflow-init: pools $(python -c 'import json, sys; print(json.load(open(sys.argv[1])))' /tmp/kb-pools.json)"
airflow pools import /tmp/kb-pools.json

# `connections add` refuses an existing id: delete first, so values changed in .env are applied.
# --conn-json rather than --conn-type: for a type no installed provider registers, --conn-type silently
# stores "generic", and kb_state must stay "mysql" (kb_reindex.airflow.connections.state_url_from_connection).
conn_json() {
    python - "$@" <<'PY'
import json, sys

fields = dict(arg.split("=", 1) for arg in sys.argv[1:])
if "extra" in fields:
    fields["extra"] = json.loads(fields["extra"])
print(json.dumps(fields))
PY
}

echo "airflow-init: connections"
# https false: the compose Qdrant speaks plain http, and the client assumes https whenever an API key is
# given without it. timeout: seconds per request (the client's own default is 5).
airflow connections delete qdrant_default > /dev/null 2>&1 || true
airflow connections add qdrant_default --conn-json "$(conn_json \
    conn_type=qdrant host=qdrant port=6333 \
    password="${QDRANT_API_KEY}" \
    extra='{"grpc_port": 6334, "https": false, "timeout": 120}' \
    description="Qdrant (compose service qdrant); password = API key")"

airflow connections delete kb_state > /dev/null 2>&1 || true
airflow connections add kb_state --conn-json "$(conn_json \
    conn_type=mysql host=mysql port=3306 schema=kb_state \
    login="${KB_STATE_DB_USER:-kb_state}" \
    password="${KB_STATE_DB_PASSWORD}" \
    description="kb-reindex state DB (used as mysql+pymysql)")"

# No password: the compose ollama has no auth. For an Ollama behind a proxy, the Connection's password
# is sent as a bearer token.
airflow connections delete ollama_default > /dev/null 2>&1 || true
airflow connections add ollama_default --conn-json "$(conn_json \
    conn_type=http host=ollama port=11434 \
    description="Ollama embeddings (compose service ollama)")"

echo "airflow-init: smoke check"
kb-reindex status

echo "airflow-init: done"
