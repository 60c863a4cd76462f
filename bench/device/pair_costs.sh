#!/usr/bin/env bash
# What a (sequence, v-head) pair costs the on-chip forward besides its chunks, on the device: bench/pair_overhead.py
# (the forward over one token count cut into sequences of several lengths, with and without h0 and the ht store)
# and bench/timeline_onchip.py's pair-boundary report (the traced variant, compiled here first by
# `QLA_CACHE_DIR=/tmp/qc_trace python bench/timeline_onchip.py --build && tar cJf .carry/qc_trace.tar.xz -C /tmp/qc_trace .`).
# Carry [".devdeps", ".carry/qc_trace.tar.xz"]; output into $OUT.
#   HEADS=32/32,16/64 TIMELINES="32/32:512x64 16/64:512x64" bash bench/device/pair_costs.sh
set -uo pipefail
mkdir -p /tmp/site /tmp/qc && tar xJf .devdeps/site.tar.xz -C /tmp/site && tar xJf .carry/qc_trace.tar.xz -C /tmp/qc
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site QLA_CACHE_DIR=/tmp/qc
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
for row in ${TIMELINES:-32/32:512x64}; do
  python bench/timeline_onchip.py "$row" --out "$OUT/timeline-${row//[\/:]/-}.md" > "$OUT/timeline-${row//[\/:]/-}.log" 2>&1
  echo "timeline $row: rc $?"; grep -A14 "^Pair boundaries" "$OUT/timeline-${row//[\/:]/-}.md"
done
python bench/pair_overhead.py --heads "${HEADS:-32/32,16/64}" --lens "${LENS:-512,1024,2048,4096,8192}" --out "$OUT" \
  > "$OUT/pair-overhead.log" 2>&1
echo "pair_overhead: rc $?"; sed -n '/^| heads | seq len/,$p' "$OUT/pair-overhead.log"
