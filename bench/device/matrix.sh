#!/usr/bin/env bash
# The forward matrix (bench/bench_fwd.py, every peer) on the device, in three calls on one warm machine (each within
# 30 s of the last: /tmp survives only while it stays warm). A run carries at most 64 MiB, so the bundles travel apart:
#   PHASE=site  carry [".devdeps"]: the site bundle into /tmp/site (any call that runs bench/device/gpu_tests.sh or
#               bench/device/ab_trees.sh does this too)
#   PHASE=load  carry [".devdeps-fi07/fi07-part1.tar.xz", ".carry/flashqla-cache.tar.xz"]: FlashInfer 0.7's first part
#               (bench/flashinfer07_bundle.sh) into /tmp/fi07, FlashQLA's prebuilt kernels (bench/flashqla_cache.py)
#               into /tmp/tl-cache
#   PHASE=run   carry [".devdeps-fi07/fi07-part2.tar.xz"]: the second part, then the matrix for HEADS (bench_fwd's
#               --heads items, default every head configuration of the matrix) over every sequence set, each head
#               configuration its own process of at most LIMIT seconds; JSON and the dated .md into $OUT/fwd (render
#               the whole matrix from several runs with bench_fwd.render; PEERS: bench_fwd's --peers, default all,
#               e.g. flashqla,flashinfer,flashinfer-0.7: the issue-20 bar's peers, without FLA). Session 24 (H100):
#               88-114 s a head configuration, so the seven need two or three run calls (each carrying part 2 again)
#               within 30 s of one another; site and load take ~5 s each
#   PHASE=power carry as run: the second part, then bench/power_probe.py over ROWS (qla and FlashInfer 0.7 under
#               sustained load: clocks, power, energy a call) into $OUT/power
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site TILELANG_CACHE_DIR=/tmp/tl-cache QLA_CACHE_DIR=/tmp/qc
OUT=${OUT:-/tmp/out}
part2() {  # FlashInfer 0.7's second part beside the first, on a machine that has the site and the first part
  [ -d /tmp/site ] && [ -d /tmp/fi07 ] || { echo "a cold machine: run PHASE=site and PHASE=load first" >&2; exit 2; }
  tar xJf .devdeps-fi07/fi07-part2.tar.xz -C /tmp/fi07
}
case "${PHASE:?PHASE=site, load, run or power}" in
  site) mkdir -p /tmp/site && tar xJf .devdeps/site.tar.xz -C /tmp/site && echo "site unpacked" ;;
  load) mkdir -p /tmp/fi07 /tmp/tl-cache && tar xJf .devdeps-fi07/fi07-part1.tar.xz -C /tmp/fi07 \
          && tar xJf .carry/flashqla-cache.tar.xz -C /tmp/tl-cache && echo "FlashInfer 0.7 part 1, FlashQLA kernels unpacked" ;;
  run)
    part2
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
    for h in $(echo "${HEADS:-2/8,4/16,8/32,16/32,16/64,16/16,32/32}" | tr , ' '); do
      start=$SECONDS
      timeout "${LIMIT:-280}" python bench/bench_fwd.py --heads "$h" --seqs all --peers "${PEERS:-all}" --out "$OUT/fwd" > "$OUT/fwd-${h/\//-}.log" 2>&1
      echo "$h: rc $? in $((SECONDS - start)) s: $(grep -c '"impl"' "$OUT/fwd/latest-fwd.json" 2>/dev/null) rows so far"
    done ;;
  power)
    part2
    python bench/power_probe.py ${ROWS:?ROWS=16/64:8192x4 ...} --fi07-path /tmp/fi07 --out "$OUT/power" ;;
  *) echo "PHASE=site, load, run or power" >&2; exit 2 ;;
esac
