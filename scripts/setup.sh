#!/usr/bin/env bash
# Installs everything stepwatch needs on a fresh Debian machine (idempotent):
#   - Debian packages influxdb, prometheus-alertmanager, chromium, tmux (when missing)
#   - a virtualenv in .venv with stepwatch and all its extras (torch: the CPU build)
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO="sudo"; fi

need=()
command -v influxd >/dev/null || need+=(influxdb)
command -v prometheus-alertmanager >/dev/null || command -v alertmanager >/dev/null \
  || need+=(prometheus-alertmanager)
command -v chromium >/dev/null || need+=(chromium)
command -v tmux >/dev/null || need+=(tmux)  # tests drive `stepwatch top` in a real terminal
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${need[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
# torch first, pinned: 2.13.0 is the CPU wheel this machine kind carries on disk; an
# unpinned torch would pull a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing torch 2.13.0 (CPU)"
  .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
fi
echo "setup: installing stepwatch and its components (editable)"
log=$(mktemp)
if ! .venv/bin/pip install -q --disable-pip-version-check -e ./core -e "./exporters[torch]" \
  -e ./otel_bridge -e ./detectors -e ".[all,dev]" >"$log" 2>&1; then
  grep -v "is ignored: it is neither a file nor a directory" "$log" >&2; exit 1
fi
.venv/bin/python -c "import stepwatch.core, torch; print('setup: ok, stepwatch', stepwatch.core.__version__, 'torch', torch.__version__)"

# ---- Node.js and the JS interop producer (tests/interop/js; issue 45) ----------------------
# The OpenTelemetry JavaScript SDK exports to the bridge in tests/interop: Node.js and npm from
# Debian when missing, then the project's locked packages (npm ci).
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "setup: installing Debian packages: nodejs npm"
  $SUDO apt-get update -qq || true
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    nodejs npm >/dev/null || true
fi
if command -v node >/dev/null && command -v npm >/dev/null; then
  echo "setup: installing tests/interop/js (npm ci)"
  (cd tests/interop/js && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
else
  echo "setup: no node/npm after trying apt-get: tests/interop (the JS SDK) will be skipped"
fi
# ---- end of the Node.js block ---------------------------------------------------------------
