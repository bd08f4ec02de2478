#!/bin/bash
# First start of the mysql container only (empty data volume): the two databases and their users.
#   airflow   - Airflow's metadata DB   (user $AIRFLOW_DB_USER)
#   kb_state  - kb-reindex's state DB   (user $KB_STATE_DB_USER; tables are created on first use)
#
# The official image's entrypoint runs this against its temporary, socket-only server; it executes the
# file when it is executable and sources it otherwise, so this script neither exits nor sets -u.
# Users get MySQL 8.4's default caching_sha2_password; PyMySQL handles it (with `cryptography`, which
# the Airflow image has) over the plain TCP of the compose network.
set -eo pipefail

: "${MYSQL_ROOT_PASSWORD:?MYSQL_ROOT_PASSWORD is not set}"
: "${AIRFLOW_DB_PASSWORD:?AIRFLOW_DB_PASSWORD is not set}"
: "${KB_STATE_DB_PASSWORD:?KB_STATE_DB_PASSWORD is not set}"

# A value as a single-quoted SQL string literal: backslashes and quotes escaped.
kb_sql_quote() {
    local value=${1//\\/\\\\}
    printf "'%s'" "${value//\'/\'\'}"
}

kb_airflow_user=$(kb_sql_quote "${AIRFLOW_DB_USER:-airflow}")
kb_airflow_password=$(kb_sql_quote "${AIRFLOW_DB_PASSWORD}")
kb_state_user=$(kb_sql_quote "${KB_STATE_DB_USER:-kb_state}")
kb_state_password=$(kb_sql_quote "${KB_STATE_DB_PASSWORD}")

# MYSQL_PWD keeps the root password off the command line.
MYSQL_PWD="${MYSQL_ROOT_PASSWORD}" mysql --protocol=socket -uroot <<SQL
CREATE DATABASE IF NOT EXISTS \`airflow\` CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci;
CREATE DATABASE IF NOT EXISTS \`kb_state\` CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci;

CREATE USER IF NOT EXISTS ${kb_airflow_user}@'%' IDENTIFIED BY ${kb_airflow_password};
GRANT ALL PRIVILEGES ON \`airflow\`.* TO ${kb_airflow_user}@'%';

CREATE USER IF NOT EXISTS ${kb_state_user}@'%' IDENTIFIED BY ${kb_state_password};
GRANT ALL PRIVILEGES ON \`kb_state\`.* TO ${kb_state_user}@'%';

FLUSH PRIVILEGES;
SQL

echo "01-databases.sh: databases airflow and kb_state ready"
