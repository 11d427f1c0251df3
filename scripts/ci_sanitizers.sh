#!/usr/bin/env bash
# CI: the C extensions under AddressSanitizer + UndefinedBehaviorSanitizer, then a bounded
# coverage-guided fuzzing run of the bridge's fast path (docs/packaging.md, "What CI checks").
#
#   bash scripts/ci_sanitizers.sh [FUZZ_SECONDS=30]
#
# The three extensions are built with clang's -fsanitize=address,undefined (UB aborts; clang's
# UBSan also checks pointer arithmetic on NULL, which gcc's does not) into copies of the two
# packages, first on PYTHONPATH, and the tests that drive the C (SANITIZED_TESTS) run on them
# with the ASan runtime preloaded and Python's allocator off (PYTHONMALLOC=malloc: the
# extensions' PyMem buffers are ASan's heap). Then bench/fastpath_fuzz.sh fuzzes the protobuf
# reader for FUZZ_SECONDS (libFuzzer). Clang: scripts/ensure_clang.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
fuzz_seconds=${1:-30}
work=$(mktemp -d /tmp/stepwatch-sanitizers.XXXXXX)
trap 'rm -rf "$work"' EXIT
TESTS=${SANITIZED_TESTS:-tests/exporters/test_fastrecord.py tests/exporters/test_step_buffer.py \
tests/exporters/test_phase_slots.py tests/exporters/test_histogram_fast.py \
tests/exporters/test_histogram.py tests/exporters/kernels/test_cheap_drain.py \
tests/exporters/test_event_pool.py tests/exporters/test_optimizer_gate.py \
tests/exporters/test_hidden_post.py tests/exporters/test_timed_in_c.py \
tests/exporters/test_device_in_c.py tests/exporters/test_class_toggle.py \
tests/exporters/test_nested_step.py tests/exporters/test_engine_mark.py \
tests/exporters/test_wait_at_engine.py tests/exporters/test_cold_paths.py \
tests/exporters/test_cadence_waiter.py tests/exporters/test_monitor.py \
tests/otel_bridge/test_fastpath.py tests/otel_bridge/test_fastpath_float.py \
tests/otel_bridge/test_fastpath_intake.py}

start=$SECONDS
CLANG=$(bash scripts/ensure_clang.sh)
read -r inc suffix < <("$PY" -c "import sysconfig as s
print(s.get_paths()['include'], s.get_config_var('EXT_SUFFIX'))")
mkdir -p "$work/stepwatch"
cp -r exporters/src/stepwatch/exporters otel_bridge/src/stepwatch/otel_bridge "$work/stepwatch/"
find "$work/stepwatch" \( -name '*.so' -o -name __pycache__ \) -prune -exec rm -rf {} +
flags=(-shared -fPIC -g -O1 -fno-omit-frame-pointer -fsanitize=address,undefined -shared-libsan
  -fno-sanitize-recover=undefined -std=c11 -ffp-contract=off -Werror
  -Werror=implicit-function-declaration -Wall -Wextra -Wshadow -Wstrict-prototypes -Wconversion
  -I"$inc")
"$CLANG" "${flags[@]}" -Iexporters/csrc exporters/csrc/fastrecord.c \
  -o "$work/stepwatch/exporters/_fastrecord$suffix"
"$CLANG" "${flags[@]}" exporters/csrc/fasthist.c -o "$work/stepwatch/exporters/_fasthist$suffix"
"$CLANG" "${flags[@]}" -Iotel_bridge/csrc otel_bridge/csrc/fastpath.c \
  -o "$work/stepwatch/otel_bridge/_fastpath$suffix"

LD_PRELOAD=$("$CLANG" -print-file-name=libclang_rt.asan-x86_64.so)  # UBSan's handlers too
export LD_PRELOAD
# Reports go to files: pytest captures the test's own stderr, which dies with the process.
export ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0:abort_on_error=1:log_path=$work/report
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path=$work/report
export PYTHONMALLOC=malloc PYTHONPATH=$work STEPWATCH_REQUIRE_C=1
"$PY" - "$work" <<'EOF'
import sys
from stepwatch.exporters import _fasthist, _fastrecord
from stepwatch.otel_bridge import _fastpath
for module in (_fastrecord, _fasthist, _fastpath):
    assert module.__file__.startswith(sys.argv[1]), module.__file__  # the sanitized builds
print("sanitizers: the sanitized builds are the ones imported")
EOF
# shellcheck disable=SC2086  # TESTS is a list of paths
if ! "$PY" -m pytest -q -x -p no:cacheprovider $TESTS; then
  cat "$work"/report.* 2>/dev/null | head -80 >&2
  exit 1
fi
unset LD_PRELOAD ASAN_OPTIONS UBSAN_OPTIONS PYTHONMALLOC PYTHONPATH
echo "sanitizers: ASan + UBSan tests clean in $((SECONDS - start)) s"

start=$SECONDS
bash bench/fastpath_fuzz.sh "$fuzz_seconds" "$work/fuzz"
echo "sanitizers: fuzzing stage $((SECONDS - start)) s"
