#!/usr/bin/env bash
# GPU tests on the device machine, in groups, each with its own time limit; logs to $OUT.
# Carry [".devdeps"] (../shared/tools/device-bundle). Usage: bash bench/device/gpu_tests.sh [GROUP...]
# Groups: core (fwd + api + bwd, ~80 s), models (models + passes, ~160 s), fla (FLA's op and layer, ~160 s on a cold
# machine; TRITON_CACHE_DIR=/tmp/tc keeps FLA's Triton kernels while the machine stays warm). Default: core models.
set -uo pipefail
mkdir -p /tmp/site && tar xJf .devdeps/site.tar.xz -C /tmp/site
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 QLA_CACHE_DIR=${QLA_CACHE_DIR:-/tmp/qc} TRITON_CACHE_DIR=/tmp/tc
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
# the tree that ran (the device's copy of .git may be older than its files): compare with the same line run locally
echo "python tree $(find qla_compile tests -name '*.py' | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-12)"
declare -A files=(
  [core]="tests/gpu/test_fwd_hopper.py tests/gpu/test_api_hopper.py tests/gpu/test_bwd_hopper.py"
  [models]="tests/gpu/test_models_hopper.py tests/gpu/test_passes_cuda.py"
  [fla]="tests/gpu/test_fla_hopper.py"
)
declare -A limit=([core]=${CORE_S:-300} [models]=${MODELS_S:-240} [fla]=${FLA_S:-450})
for g in "${@:-core models}"; do
  for group in $g; do
    start=$SECONDS
    timeout "${limit[$group]}" python -m pytest -q -x -p no:cacheprovider --durations=6 ${files[$group]} > "$OUT/tests-$group.log" 2>&1
    echo "$group: rc $? in $((SECONDS - start)) s: $(tail -1 "$OUT/tests-$group.log")"
  done
done
