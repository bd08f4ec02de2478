#!/usr/bin/env bash
# Create .venv/ with the kb-reindex and airflow commands, pinned by constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
python_bin="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x .venv/bin/python ]; then
  "$python_bin" -m venv .venv
fi
stamp=.venv/.kb-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[airflow,dev,s3]"
  touch "$stamp"
fi
echo "kb-reindex environment ready: $(pwd)/.venv"
