#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the whole check: ruff, mypy, pytest.
# This is the README's test command and what .ci/run calls.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
echo "== ruff check"; ruff check .
echo "== ruff format --check"; ruff format --check .
echo "== mypy"; mypy
echo "== pytest"; pytest "$@"
