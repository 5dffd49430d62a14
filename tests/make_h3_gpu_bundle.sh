#!/usr/bin/env bash
# Build .gpu-bundle-h3/ (ignored) for tests/bench_h3_speedup.py on the GPU machine, which has no ComfyUI v0.33.0,
# comfy-kitchen or comfy-aimdo and reaches no registry. The whole carried tree must stay under 64 MiB, so:
#   comfyui-2026.tar.gz  ComfyUI v0.33.0 minus what sampling never imports (tests, blueprints, API nodes, the
#                        web app, tokenizer data files >= 1 MiB)
#   whl/                 comfy-kitchen 0.2.31 (cp312, its CUDA backend only: the HIP backend removed, ~48 MB) and
#                        comfy-aimdo 0.4.13, downloaded from PyPI here
# Usage: tests/make_h3_gpu_bundle.sh [COMFYUI_2026_DIR]   (default /work/main/.comfyui-2026)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
src="${1:-${COMFYUI_2026_DIR:-/work/main/.comfyui-2026}}"
out="$root/.gpu-bundle-h3"
rm -rf "$out" && mkdir -p "$out/whl"
tar -C "$src" -czf "$out/comfyui-2026.tar.gz" --exclude=.git --exclude=tests --exclude=tests-unit \
    --exclude=blueprints --exclude=comfy_api_nodes --exclude=app --exclude='*.png' --exclude='*.webp' \
    $(cd "$src" && find comfy -type f -size +1M -printf '--exclude=%p ') .
dl="$(mktemp -d)"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux_2_12_x86_64 \
    -d "$dl" comfy-kitchen==0.2.31 comfy-aimdo==0.4.13
cp "$dl"/comfy_aimdo-*.whl "$out/whl/"
kitchen="$(ls "$dl"/comfy_kitchen-*.whl)"
python3 - "$kitchen" "$out/whl/$(basename "$kitchen")" <<'PY'
import sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    for item in zin.infolist():
        if "/backends/hip/" in item.filename:
            continue
        data = zin.read(item.filename)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"\n".join(l for l in data.split(b"\n") if b"/backends/hip/" not in l)
        zout.writestr(item, data)
PY
rm -rf "$dl"
du -sh "$out" "$out"/* "$out"/whl/*
