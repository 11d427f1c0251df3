#!/usr/bin/env bash
# Prints the path of clang with its sanitizer and libFuzzer runtimes, installing Debian's
# clang-14 and libclang-rt-14-dev first where they are missing (root or sudo). Used by
# scripts/ci_sanitizers.sh and bench/fastpath_fuzz.sh.
set -euo pipefail
clang=$(command -v clang-14 || command -v clang || true)
if [ -z "$clang" ] || [ ! -e "$("$clang" -print-file-name=libclang_rt.fuzzer-x86_64.a)" ]; then
  echo "clang: installing clang-14 and libclang-rt-14-dev (libFuzzer, sanitizers)" >&2
  SUDO=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO="sudo"; fi
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    clang-14 libclang-rt-14-dev >/dev/null
  clang=$(command -v clang-14)
fi
echo "$clang"
