#!/usr/bin/env bash
# Coverage-guided fuzzing of the bridge's C fast path (otel_bridge/csrc/fastpath.c), the C that
# reads OTLP protobuf request bodies straight off the network.
#
#   bash bench/fastpath_fuzz.sh [SECONDS=600] [WORK_DIR]
#
# Builds tests/otel_bridge/fuzz/fastpath_fuzzer.c with clang's libFuzzer, AddressSanitizer and
# UndefinedBehaviorSanitizer (the extension's source compiled into it, with coverage), seeds a
# corpus with valid requests (tests/otel_bridge/fuzz/corpus.py) and fuzzes for SECONDS: every
# input must neither crash nor trip a sanitizer, and where the fast path handles a body the
# Python path must agree with it (tests/otel_bridge/fuzz/oracle.py). Then replays the corpus
# through a build with source-based coverage and prints fastpath.c's line and branch
# coverage. CI runs it for 30 s (scripts/ci_sanitizers.sh). Needs clang and its runtimes
# (scripts/ensure_clang.sh installs Debian's clang-14 libclang-rt-14-dev where missing); .venv
# from scripts/setup.sh. A finding leaves its input as WORK_DIR/crash-* and prints it in base64
# (rerun: the fuzzer binary with that file as its argument, the environment as below).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-600}
work=${2:-$(mktemp -d /tmp/stepwatch-fuzz.XXXXXX)}
mkdir -p "$work/corpus"
PY=${PYTHON:-.venv/bin/python}

CLANG=$(bash scripts/ensure_clang.sh)
LLVM_BIN=$(dirname "$(readlink -f "$CLANG")")

read -r inc libdir version site < <("$PY" -c "import sys, sysconfig as s
print(s.get_paths()['include'], s.get_config_var('LIBDIR'),
      f'{sys.version_info[0]}.{sys.version_info[1]}', s.get_paths()['purelib'])")
build() {  # build OUTPUT EXTRA_FLAGS...
  local out=$1
  shift
  "$CLANG" -g -O1 -fno-omit-frame-pointer -std=c11 -ffp-contract=off \
    -Werror=implicit-function-declaration -Wall -Wextra -Wshadow -Wconversion \
    -I"$inc" -Iotel_bridge/csrc "$@" tests/otel_bridge/fuzz/fastpath_fuzzer.c \
    -L"$libdir" -lpython"$version" -Wl,-rpath,"$libdir" -o "$out"
}
build "$work/fastpath_fuzzer" -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
"$PY" -m tests.otel_bridge.fuzz.corpus "$work/corpus" >/dev/null

export PYTHONMALLOC=malloc PYTHONPATH=$PWD FUZZ_SITE=$site
export ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
echo "fuzz: $seconds s on fastpath.c (libFuzzer + ASan + UBSan, Python $version), in $work"
status=0
"$work/fastpath_fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 \
  -print_final_stats=1 -artifact_prefix="$work/" "$work/corpus" >"$work/fuzz.log" 2>&1 \
  || status=$?
grep -E "DONE|^stat::(number_of_executed_units|average_exec_per_sec|new_units_added)" \
  "$work/fuzz.log" || true
if [ "$status" != 0 ]; then
  tail -60 "$work/fuzz.log"
  echo "fuzz: FAILED (exit $status); the inputs, base64 (reproduce: base64 -d > input, then"
  echo "  the fuzzer with the input as its argument, in this environment):"
  for input in "$work"/crash-* "$work"/timeout-* "$work"/oom-*; do
    [ -e "$input" ] && { echo "$(basename "$input"):"; base64 -w 100 "$input"; }
  done
  exit 1
fi

# fastpath.c's coverage by the final corpus (source-based, one replay without the sanitizers)
build "$work/fastpath_cover" -fsanitize=fuzzer -fprofile-instr-generate -fcoverage-mapping
LLVM_PROFILE_FILE="$work/cover.profraw" "$work/fastpath_cover" -runs=0 "$work/corpus" \
  >"$work/cover.log" 2>&1
"$LLVM_BIN/llvm-profdata" merge -sparse "$work/cover.profraw" -o "$work/cover.profdata"
"$LLVM_BIN/llvm-cov" report "$work/fastpath_cover" -instr-profile="$work/cover.profdata" \
  otel_bridge/csrc/fastpath.c | tail -1 | awk '{printf "fuzz: fastpath.c coverage: regions %s, functions %s, lines %s, branches %s (corpus %s inputs)\n", $4, $7, $10, $13, "'"$(ls "$work/corpus" | wc -l)"'"}'
echo "fuzz: clean"
