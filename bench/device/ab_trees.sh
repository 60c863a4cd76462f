#!/usr/bin/env bash
# A/B of patched trees against the checkout on the device: bench/onchip_inverse_ab.py per tree, each in its own
# process and kernel cache, base (the checkout) timed first and again last, then bench/ab_compare.py's table.
# Carry [".devdeps", ".carry"]; trees from bench/patch_trees.sh. Logs and JSON to $OUT/ab_NAME.
#   TREES=.carry/probes.tar.xz UNCHECKED=nokk,noinv bash bench/device/ab_trees.sh 32/32:4096x8 16/64:512x64
# QLA_BENCH_HOT_S=1 times every arm after a second of back-to-back replays (bench/common.time_graph): the clocks a
# sustained load runs at, where a row is power-capped (bench/power_probe.py tells).
set -uo pipefail
mkdir -p /tmp/site && tar xJf .devdeps/site.tar.xz -C /tmp/site
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/trees
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
tar xJf "$TREES" -C /tmp/trees
names=$(ls /tmp/trees)
run() {  # run NAME DIR: one tree's A/B into $OUT/ab_NAME
  (cd "$2" && QLA_CACHE_DIR=/tmp/qc_$1 PYTHONPATH=$PWD:/tmp/site timeout "${TREE_S:-150}" \
    python bench/onchip_inverse_ab.py "${ROWS[@]}" --out "$OUT/ab_$1" > "$OUT/ab_$1.log" 2>&1)
  echo "$1: rc $? $(grep -c '^{' "$OUT/ab_$1.log") rows"
}
ROWS=("$@")
run base "$PWD"
for n in $names; do run "$n" "/tmp/trees/$n"; done
run base2 "$PWD"
python bench/ab_compare.py "$OUT" --base base --unchecked "${UNCHECKED:-}" --md "$OUT/ab.md"
