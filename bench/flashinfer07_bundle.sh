#!/usr/bin/env bash
# Build .devdeps-fi07/fi07-part1.tar.xz and .devdeps-fi07/fi07-part2.tar.xz: FlashInfer 0.7.x (its CuTe-DSL SM90 GDN
# prefill, the peer "flashinfer-0.7" of bench/bench_fwd.py) and the CUTLASS DSL it compiles with, pruned to
# what that prefill imports and runs, in parts small enough to be carried one per device call.
#
# Usage (from the project root, on a CPU machine with pip and PyPI):   bash bench/flashinfer07_bundle.sh
# Environment: FI07=0.7.2.post1 (flashinfer-python), CUTLASS_DSL=4.7.1 (nvidia-cutlass-dsl; 4.7.1 is the
# version FlashInfer 0.7.2's own "b12x" extra pins), PART_MB=55 (largest part allowed, in MB of 10^6 bytes),
# XZ_LEVEL=6.
#
# What goes in: the whole Python tree of flashinfer-python less its JIT sources (flashinfer/data/csrc,
# cutlass, cccl, include, spdlog and every .cu/.cuh/.h/.hpp/.cc/.cpp/.inl/.ptx file: the SM90 GDN prefill
# is CuTe-DSL Python compiled at run time and needs none of them; `import flashinfer` still imports its
# whole Python surface, so no .py is dropped), nvidia-cutlass-dsl with -libs-core, -libs-base and -libs-cu13
# (cp312; the aarch64 stubs and the static runtime archive left out). Not in it, because the GPU machine's
# image or .devdeps/site.tar.xz (../shared/tools/device-bundle) already has them: torch, numpy, cuda-bindings,
# requests, tabulate, tqdm, click, einops, ninja, nvidia-ml-py, packaging, protobuf, typing-extensions
# (image) and apache-tvm-ffi 0.1.12 + torch-c-dlpack-ext (site.tar.xz). Left out as unused by the GDN
# prefill (imported lazily elsewhere in FlashInfer): cuda-tile, nccl4py, nccl-extensions,
# nvidia-cudnn-frontend, nvidia-cuda-nvdisasm (the DSL runs nvdisasm only to dump SASS).
#
# Part 1 holds the DSL's MLIR compiler (_cutlass_ir.cu13.*.so, ~50 MB compressed), part 2 everything else.
# Both unpack into one folder; part 2 also writes fi07_bundle.json (versions) there.
#
# On the GPU machine (each call carries at most 64 MiB; /tmp survives only while the machine stays warm,
# i.e. the next call comes within 30 s of the last one's return). With site.tar.xz and the two parts in
# .devdeps/ and .devdeps-fi07/ (all git-excluded; the parts stay out of .devdeps so that carrying .devdeps
# alone stays under the 64 MiB a run may carry), three consecutive calls:
#   1. carry [".devdeps/site.tar.xz", ...your kernel caches]:
#        mkdir -p /tmp/site && tar xJf .devdeps/site.tar.xz -C /tmp/site
#   2. carry [".devdeps-fi07/fi07-part1.tar.xz"]:
#        mkdir -p /tmp/fi07 && tar xJf .devdeps-fi07/fi07-part1.tar.xz -C /tmp/fi07
#   3. carry [".devdeps-fi07/fi07-part2.tar.xz"]:
#        tar xJf .devdeps-fi07/fi07-part2.tar.xz -C /tmp/fi07 && export PYTHONPATH=$PWD:/tmp/site
#        && python3 bench/bench_fwd.py --heads 16/64 --out bench/results   (finds /tmp/fi07 by itself)
#      (then copy bench/results/latest-fwd*.json and today's -fwd.md to $OUT; the whole recipe, with the
#      wheel's conventions: bench/NOTES-fwd.md, "FlashInfer 0.7 as a peer")
# bench_fwd.py runs FlashInfer 0.7 in a subprocess whose sys.path starts with /tmp/fi07 and
# /tmp/fi07/nvidia_cutlass_dsl/dsl_packages (the wheel's .pth file does that in a site-packages install;
# PYTHONPATH entries get no .pth processing), so FlashInfer 0.6.13 in /tmp/site stays out of its way.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.devdeps/' "$exclude" 2>/dev/null || echo '/.devdeps/' >> "$exclude"
grep -qxF '/.devdeps-fi07/' "$exclude" 2>/dev/null || echo '/.devdeps-fi07/' >> "$exclude"
FI07=${FI07:-0.7.2.post1}; CUTLASS_DSL=${CUTLASS_DSL:-4.7.1}; PART_MB=${PART_MB:-55}; XZ_LEVEL=${XZ_LEVEL:-6}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/whl" "flashinfer-python==$FI07" \
  "nvidia-cutlass-dsl==$CUTLASS_DSL" "nvidia-cutlass-dsl-libs-core==$CUTLASS_DSL" \
  "nvidia-cutlass-dsl-libs-base==$CUTLASS_DSL" "nvidia-cutlass-dsl-libs-cu13==$CUTLASS_DSL"
site="$work/site"
mkdir -p "$site"
for w in "$work"/whl/*.whl; do (cd "$site" && python3 -m zipfile -e "$w" .); done

# FlashInfer: no JIT sources (see above); keep data/*.py at its top level (build helpers some modules import).
fi="$site/flashinfer"
[ -f "$fi/gdn_prefill.py" ] || { echo "flashinfer $FI07 has no gdn_prefill.py" >&2; exit 1; }
rm -rf "$fi/data/csrc" "$fi/data/cutlass" "$fi/data/cccl" "$fi/data/include" "$fi/data/spdlog"
find "$fi" -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o -name '*.hpp' -o -name '*.cc' \
  -o -name '*.cpp' -o -name '*.inl' -o -name '*.ptx' \) -delete
# The DSL: the cu13 flavour only, without the aarch64 stubs and the static archive (AOT export only).
dsl="$site/nvidia_cutlass_dsl"
rm -rf "$dsl/cu13/lib/stubs" "$dsl/cu13/lib/libcuda_dialect_runtime_static.a"
rm -f "$site/nvidia_cutlass_dsl_packages.pth"   # not processed from PYTHONPATH; bench_fwd.py adds the path
find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +
mlir_libs="nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs"
ls "$site/$mlir_libs"/_cutlass_ir.cu13.cpython-312-*.so >/dev/null
python3 - "$site" "$FI07" "$CUTLASS_DSL" <<'EOF'
import json, sys
site, fi, dsl = sys.argv[1:]
with open(f"{site}/fi07_bundle.json", "w") as f:
    json.dump({"flashinfer-python": fi, "nvidia-cutlass-dsl": dsl, "python": "3.12", "flavour": "cu13",
               "dsl_path": "nvidia_cutlass_dsl/dsl_packages"}, f)
EOF
chmod -R u+rwX,go+rX "$site"
find "$site" -name '*.so*' -type f -exec chmod +x {} +

mkdir -p .devdeps-fi07
rm -f .devdeps-fi07/fi07-part*.tar.xz
(cd "$site" && ls -d "$mlir_libs"/_cutlass_ir.cu13.*.so) > "$work/part1.list"
(cd "$site" && find . -mindepth 1 \( -type f -o -type l \) | sed 's|^\./||' | grep -vxF -f "$work/part1.list" | sort) \
  > "$work/part2.list"
for n in 1 2; do
  tar cf - -C "$site" --owner=0 --group=0 -T "$work/part$n.list" | xz "-$XZ_LEVEL" -T0 > ".devdeps-fi07/fi07-part$n.tar.xz"
done
status=0
for n in 1 2; do
  size=$(stat -c %s ".devdeps-fi07/fi07-part$n.tar.xz")
  awk -v n="$n" -v s="$size" -v f="$(wc -l < "$work/part$n.list")" \
    'BEGIN { printf ".devdeps-fi07/fi07-part%s.tar.xz  %6.1f MB  (%s files)\n", n, s / 1e6, f }'
  if [ "$size" -gt $((PART_MB * 1000000)) ]; then echo "  larger than PART_MB=$PART_MB" >&2; status=1; fi
done
echo "unpacked: $(du -sm "$site" | cut -f1) MB; flashinfer-python $FI07, nvidia-cutlass-dsl $CUTLASS_DSL (cu13, cp312)"
exit $status
