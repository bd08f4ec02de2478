# Sourced by the demo and test scripts: a project-local Airflow home on SQLite (AIRFLOW_HOME, the DAG and plugin
# folders, no examples). Not for `make airflow`'s stack: an airflow command by hand against that one sources the
# $AIRFLOW_HOME/run/airflow-env.sh scripts/airflow.sh writes (docs/configuration.md "Airflow Connections").
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export AIRFLOW_HOME="${AIRFLOW_HOME:-$root/.airflow}"
export AIRFLOW__CORE__DAGS_FOLDER="$root/dags"
export AIRFLOW__CORE__PLUGINS_FOLDER="$root/plugins"
export AIRFLOW__CORE__LOAD_EXAMPLES=False
export AIRFLOW__CORE__UNIT_TEST_MODE="${AIRFLOW__CORE__UNIT_TEST_MODE:-False}"
export KB_PROJECT_ROOT="${KB_PROJECT_ROOT:-$root}"
