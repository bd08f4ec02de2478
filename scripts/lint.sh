#!/usr/bin/env bash
# The linter and the type checker, as CI runs them (configured in pyproject.toml: [tool.ruff], [tool.mypy]).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check include dags plugins tests bench
.venv/bin/mypy
