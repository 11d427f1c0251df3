#!/usr/bin/env bash
# CI's build matrix: stepwatch as a user installs it, on every Python it says it runs on, with
# and without a C compiler (docs/packaging.md, "What CI checks").
#
#   bash scripts/ci_matrix.sh
#
# 1. sdists of the five distributions, from this checkout (PEP 517's build_sdist);
# 2. for each Python (pyenv's 3.11.7, 3.12.1, 3.13.0): wheels built from those sdists in
#    isolated builds (the C compiled with the project's warning flags as errors, CFLAGS=-Werror),
#    which must be tagged for that CPython (an extension that did not compile makes a pure
#    wheel: caught here); a fresh virtualenv; the wheels installed, not editable; the matrix
#    suite (below) with STEPWATCH_REQUIRE_C=1. PyTorch's CPU wheel is on this machine for cp311
#    only (pip would fetch a multi-GB CUDA build for the others): 3.12 and 3.13 run without
#    torch, and the tests that need it skip (tests/torchless.py says which and why);
# 3. no C compiler (CC=false), Python 3.11 with torch: the two C packages must build pure
#    wheels (py3-none-any), StepMonitor and the bridge must each warn once that their C is
#    missing, and the matrix suite passes on the Python paths.
#
# The matrix suite: tests/core, tests/exporters, tests/otel_bridge, tests/test_packaging.py and
# tests/test_architecture.py, without the slow tests (real DDP jobs and servers), which the main
# suite (scripts/test.sh, editable on 3.11) runs. MATRIX_TESTS overrides it, MATRIX_PYTHONS the
# versions, MATRIX_WORK keeps the wheels and venvs there. Prints each stage's time.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PYENV_VERSIONS=${PYENV_ROOT:-/root/.pyenv}/versions
VERSIONS=${MATRIX_PYTHONS:-3.11.7 3.12.1 3.13.0}
TESTS=${MATRIX_TESTS:-tests/core tests/exporters tests/otel_bridge tests/test_packaging.py \
tests/test_architecture.py}
TORCH_PIN=torch==2.13.0  # the CPU wheel on this machine's disk (cp311); scripts/setup.sh
if [ -n "${MATRIX_WORK:-}" ]; then  # kept: the venvs and wheels, to look into a failure
  work=$MATRIX_WORK
  mkdir -p "$work"
else
  work=$(mktemp -d /tmp/stepwatch-matrix.XXXXXX)
  trap 'rm -rf "$work"' EXIT
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
times=()

stage() {  # stage NAME COMMAND...: runs it, records its time
  local name=$1 start=$SECONDS
  shift
  echo "== matrix: $name"
  "$@"
  times+=("$(printf '%-44s %4d s' "$name" $((SECONDS - start)))")
}

quiet_pip() {  # pip with its output kept in a log, shown on failure
  local log
  log=$(mktemp "$work/pip.XXXXXX")
  if ! "$@" >"$log" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$log" | tail -60 >&2
    return 1
  fi
}

sdists() {
  mkdir -p "$work/sdist"
  for package in core exporters otel_bridge detectors .; do
    (cd "$package" && "$REPO/.venv/bin/python" -c \
      "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])" \
      "$work/sdist" >/dev/null)
  done
  ls "$work/sdist"
}

wheels() {  # wheels PYTHON_BIN OUT_DIR [env...]: wheels of the sdists, in isolated builds
  local python=$1 out=$2
  shift 2
  mkdir -p "$out"
  env "$@" "$python" -m pip wheel --no-deps --no-cache-dir -v -w "$out" "$work"/sdist/*.tar.gz \
    >"$out/build.log" 2>&1 || { tail -80 "$out/build.log" >&2; return 1; }
  ls "$out"/*.whl | xargs -n1 basename
}

install() {  # install VENV WHEEL_DIR WITH_TORCH
  local venv=$1 dir=$2 torch=$3
  local exporters=("$dir"/stepwatch_exporters-*.whl) root=("$dir"/stepwatch-0.1.0-*.whl)
  local extra=()
  if [ "$torch" = yes ]; then extra=("$TORCH_PIN" "${exporters[0]}[torch]"); fi
  quiet_pip "$venv/bin/pip" install "$dir"/*.whl "${root[0]}[all,dev]" "${extra[@]}"
  if [ "$torch" != yes ] && "$venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "matrix: torch was installed on a Python without its CPU wheel" >&2
    return 1
  fi
}

suite() {  # suite VENV [env...]: the matrix suite, from the checkout, on the installed wheels
  local venv=$1
  shift
  local plugins=PYTEST_PLUGINS=
  "$venv/bin/python" -c "import torch" 2>/dev/null || plugins=PYTEST_PLUGINS=tests.torchless
  env -u STEPWATCH_REQUIRE_C "$plugins" "$@" "$venv/bin/python" -m pytest -q -x -p no:cacheprovider \
    -m "not slow" $TESTS
}

tag_check() {  # tag_check WHEEL_DIR EXPECTED_TAG: the C packages' wheels carry this tag
  local dir=$1 tag=$2 wheel
  for wheel in "$dir"/stepwatch_exporters-*.whl "$dir"/stepwatch_otel_bridge-*.whl; do
    case "$(basename "$wheel")" in
      *-"$tag".whl) ;;
      *)
        echo "matrix: $(basename "$wheel") is not tagged $tag; the build said:" >&2
        grep -E "error|warning|WARNING|not built" "$dir/build.log" | tail -40 >&2
        return 1
        ;;
    esac
  done
}

run_python() {  # run_python VERSION
  local version=$1 short python venv tag torch=no
  python=$PYENV_VERSIONS/$version/bin/python
  short=$("$python" -c "import sys; print(f'{sys.version_info[0]}{sys.version_info[1]}')")
  tag="cp$short-cp$short-linux_x86_64"
  venv=$work/venv-$version
  [ "$short" = 311 ] && torch=yes
  stage "$version: wheels from the sdists (-Werror)" \
    wheels "$python" "$work/wheels-$version" CFLAGS=-Werror
  tag_check "$work/wheels-$version" "$tag"
  "$python" -m venv "$venv"
  stage "$version: install (torch: $torch)" install "$venv" "$work/wheels-$version" "$torch"
  stage "$version: matrix suite" suite "$venv" STEPWATCH_REQUIRE_C=1
}

no_compiler() {
  local python=$PYENV_VERSIONS/3.11.7/bin/python venv=$work/venv-no-cc
  stage "no C compiler: wheels (CC=false)" wheels "$python" "$work/wheels-no-cc" CC=false
  tag_check "$work/wheels-no-cc" "py3-none-any"
  grep -q "WARNING: stepwatch.otel_bridge._fastpath not built" "$work/wheels-no-cc/build.log"
  "$python" -m venv "$venv"
  stage "no C compiler: install (torch: yes)" install "$venv" "$work/wheels-no-cc" yes
  # Loud at run time: one warning each from the exporters and the bridge.
  env -u STEPWATCH_REQUIRE_C "$venv/bin/python" - <<'EOF'
import io, logging
from stepwatch.exporters import InMemoryExporter, StepMonitor
from stepwatch.otel_bridge import Bridge
class Writer:  # nothing is sent
    def write_lines(self, lines): pass
    def close(self): pass
stream = io.StringIO()
logging.basicConfig(stream=stream, level=logging.WARNING)
for _ in range(2):
    StepMonitor(job_id="j", rank=0, world_size=1, exporter=InMemoryExporter(), start=False).close()
with Bridge(Writer(), grpc_port=None, http_port=0) as b:
    gauge = b.metrics.registry.get_sample_value("stepwatch_bridge_fast_path")
said = stream.getvalue()
assert said.count("C extensions not built") == 1, said
assert said.count("C fast path unavailable") == 1, said
assert gauge == 0, gauge
print("no C compiler: one warning from the exporters, one from the bridge; fast_path gauge 0")
EOF
  stage "no C compiler: matrix suite" suite "$venv"
}

stage "sdists" sdists
for version in $VERSIONS; do
  run_python "$version"
done
no_compiler
echo "== matrix: times"
printf '%s\n' "${times[@]}"
