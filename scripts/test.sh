#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the whole check: ruff, mypy, pytest.
# This is the README's test command and what .ci/run calls.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The tests also run the framework callbacks on real trainers (not needed for the demo).
echo "test: installing the exporters' lightning and huggingface extras"
log=$(mktemp)
if ! .venv/bin/pip install -q --disable-pip-version-check -e "./exporters[lightning,huggingface]" \
  >"$log" 2>&1; then
  grep -v "is ignored: it is neither a file nor a directory" "$log" >&2; exit 1
fi
export PATH="$PWD/.venv/bin:$PATH"
echo "== ruff check"; ruff check .
echo "== ruff format --check"; ruff format --check .
echo "== mypy"; mypy
echo "== pytest"; pytest "$@"
