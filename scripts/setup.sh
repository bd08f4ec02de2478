#!/usr/bin/env bash
# Create .venv/ with the kb-reindex and airflow commands, pinned by constraints.txt (every package at one
# version: the lock). KB_SETUP_EXTRAS picks what is installed: `make setup`/`make demo` the runtime
# (airflow,s3), `make test`/`make lint` the test tools besides (airflow,dev,s3).
# uv installs it (one wheel from PyPI, pinned below; downloads in parallel, no resolver walk) and compiles the
# bytecode as pip does: about a minute on a fresh machine against pip's 4-5 min; else pip does the same install.
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=0.13.9
extras="${KB_SETUP_EXTRAS:-airflow,s3}"
python_bin="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x .venv/bin/python ]; then
  "$python_bin" -m venv .venv
fi
stamp=".venv/.kb-installed-${extras//,/-}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  if [ ! -x .venv/bin/uv ] || [ "$(.venv/bin/uv --version 2> /dev/null | cut -d' ' -f2)" != "$UV_VERSION" ]; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION" 2> /dev/null || true
  fi
  if [ -x .venv/bin/uv ]; then
    .venv/bin/uv pip install --quiet --compile-bytecode --python .venv/bin/python -c constraints.txt -e ".[$extras]"
  else
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[$extras]"
  fi
  touch "$stamp"
fi
# our own modules' bytecode, written once here: a shell with PYTHONDONTWRITEBYTECODE set (this machine's is) otherwise
# compiles the package from source in every process, each CLI command and Airflow task (about 0.06 s of a
# 1 s `status`); compileall rewrites only what changed since, and Python still recompiles a stale file in memory
.venv/bin/python -m compileall -q include dags plugins > /dev/null
echo "kb-reindex environment ready: $(pwd)/.venv ($extras)"
