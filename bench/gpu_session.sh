#!/bin/bash
# One call of a lent GPU machine (the workplace's device tool), prepared here:
#
#   mkdir -p .whl && python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     cupti-python==13.2.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
#     opentelemetry-proto==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
#     opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-grpc==1.45.2 \
#     opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-http-transport==0.66b2 \
#     opentelemetry-exporter-otlp-common==0.66b2 googleapis-common-protos==1.76.0 protobuf==7.36.2
#   mkdir -p .base && git archive REV core exporters | tar -x -C .base   # the old: arms' tree
#   printf '/.whl/\n/.base/\n' >> .git/info/exclude
#
# then, on the machine (carry .whl and .base):  bash bench/gpu_session.sh PARTS [gpu_check args]
# e.g.  bash bench/gpu_session.sh marks,abhooks    or
#       bash bench/gpu_session.sh hostbound,overhead --baseline "$PWD/.base" --overhead-runs 3
# The image's python3 has torch (CUDA), numpy and nvidia-ml-py; cupti-python 13.2 matches the
# CUPTI 13.0 library of its torch wheel (13.4 asks for a newer one). Results: $OUT.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
parts=${1:?parts, e.g. cupti,frames,marks}
shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 || { echo "pip failed"; tail "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
for tree in . .base; do
  [ -d "$tree/exporters" ] || continue
  (cd "$tree/exporters" && python3 setup.py build_ext --inplace) >> "$OUT/build.log" 2>&1 \
    || { echo "extension build failed in $tree"; tail -30 "$OUT/build.log"; exit 1; }
done
export PYTHONPATH="$PWD/core/src:$PWD/exporters/src:$PWD:/tmp/site"
python3 -c "from stepwatch.exporters import _recorder as r; assert r.FAST_RECORDER, 'no C recorder'"
python3 bench/gpu_check.py --out "$OUT" --parts "$parts" "$@" 2>&1 | tail -c 11000
