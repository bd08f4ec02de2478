#!/usr/bin/env bash
# The whole test suite: unit, local-mode Qdrant, real MariaDB, our Ollama server, Airflow DAGs.
set -euo pipefail
cd "$(dirname "$0")/.."
export KB_TEST_MYSQL_URL="${KB_TEST_MYSQL_URL:-mysql+pymysql://root@127.0.0.1:3306}"
if command -v mariadbd > /dev/null || [ -x /usr/sbin/mariadbd ]; then
  if ! .venv/bin/python -c "import pymysql; pymysql.connect(host='127.0.0.1', user='root', password='', connect_timeout=2)" 2> /dev/null; then
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd || true
    for _ in $(seq 1 30); do
      .venv/bin/python -c "import pymysql; pymysql.connect(host='127.0.0.1', user='root', password='', connect_timeout=2)" 2> /dev/null && break
      sleep 1
    done
  fi
fi
# The page test drives Debian's Chromium; install it where we may (root with apt), as CI does.
if ! command -v chromium > /dev/null || ! command -v chromedriver > /dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver) > .apt-chromium.log 2>&1 \
      || echo "could not install chromium (see .apt-chromium.log); the browser test will be skipped"
  fi
fi
# three workers on two cores: the real-Airflow modules mostly wait (on the scheduler, the triggerer, a poll), so a
# third worker filled the idle share (measured on this 2-core machine: 19.4 min against 24.8 min on two; a fourth
# made it slower, 25.6 min against 20.4 min on three, 2026-12-04: the suite is CPU-bound, 29-34 CPU-minutes); a test
# file each, so a file's module fixtures stay in one process; files in collection order (tests/conftest.py puts
# the real-Airflow modules first), not xdist's most-tests-first order, which left the two longest modules to run
# one after the other at the end
exec .venv/bin/python -m pytest -n "${KB_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder --durations=25 "$@"
