#!/bin/bash
# Checkouts of HEAD with candidate patches applied, each with its own prebuilt binaries, packed for one device call
# that times them side by side (each in its own process: they change the same kernels).
#
#   bash bench/patch_trees.sh NAME=PATCH[+PATCH...] ... [--out .carry/trees.tar.xz]
#   bash bench/patch_trees.sh main= fast=bench/patches/2026-12-06-some-candidate.patch
#
# NAME= (no patch) is HEAD itself. Needs the CPU build environment (TileLang, nvcc): every variant the patches
# change is compiled here (``qla_compile.prebuild --build-artifact``). On the device, with the site bundle in
# /tmp/site:
#
#   mkdir -p /tmp/trees && tar xJf .carry/trees.tar.xz -C /tmp/trees
#   cd /tmp/trees/NAME && QLA_CACHE_DIR=/tmp/qc_NAME PYTHONPATH=$PWD:/tmp/site python bench/onchip_inverse_ab.py ...
set -euo pipefail
root=$(git rev-parse --show-toplevel)
out="$root/.carry/trees.tar.xz"
specs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$(realpath -m "$2"); shift 2 ;;
    *=*) specs+=("$1"); shift ;;
    *) echo "not NAME=PATCH[+PATCH...]: $1" >&2; exit 2 ;;
  esac
done
[ ${#specs[@]} -gt 0 ] || { echo "no NAME=PATCH given" >&2; exit 2; }
work=$(mktemp -d)
cleanup() {  # the checkouts too when a patch does not apply or a build fails
  for tree in "$work"/*; do
    [ "$tree" = "$work/stage" ] || git -C "$root" worktree remove --force "$tree" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT
stage="$work/stage"
mkdir -p "$stage"
for spec in "${specs[@]}"; do
  name=${spec%%=*}
  patches=${spec#*=}
  tree="$work/$name"
  git -C "$root" worktree add -q --detach "$tree" HEAD
  if [ -n "$patches" ]; then
    IFS=+ read -ra list <<< "$patches"
    for p in "${list[@]}"; do git -C "$tree" apply "$root/$p"; done
  fi
  echo "== $name: $patches"
  (cd "$tree" && PYTHONPATH="$tree" python -m qla_compile.prebuild --build-artifact --jobs 2 | tail -1)
  mkdir -p "$stage/$name"
  (cd "$tree" && tar cf - --exclude=__pycache__ qla_compile bench tests pyproject.toml) | tar xf - -C "$stage/$name"
  git -C "$root" worktree remove --force "$tree"
done
mkdir -p "$(dirname "$out")"
tar cJf "$out" -C "$stage" .
echo "wrote $out ($(du -h "$out" | cut -f1))"
