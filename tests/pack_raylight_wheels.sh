#!/usr/bin/env bash
# Packs what tests/bench_raylight_2gpu.py needs besides torch, for a GPU machine without a package index, into
# .gpu-bundle-raylight/ of the current checkout (added to .git/info/exclude; never committed):
#   xfuser 0.7.0 and yunchang 0.6.4 wheels (--no-deps: raylight's xfuser_compat loads only xfuser's core modules).
# ray is NOT needed by the benchmark (it sets the processes up as raylight's RayWorker does, without Ray). For the
# real node (MC-Sparse Patch (Ray) in ComfyUI) pass --with-ray: ray 2.60.0's 79 MB wheel is unpacked and
# recompressed with xz to ray.tar.xz (several minutes) so it can travel.
# On the GPU machine (Python 3.12, x86_64), from the checkout root:
#   bash tests/pack_raylight_wheels.sh --unpack        (unpacks the bundle into /tmp/site-raylight)
#   export PYTHONPATH=/tmp/site-raylight:$PYTHONPATH
# The benchmark also needs a raylight checkout with the inner-attention registry (carry .raylight: komikndr/raylight
# at or after 55ea37b) and ComfyUI (carry .comfyui).
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
b=.gpu-bundle-raylight
if [ "${1:-}" = "--unpack" ]; then
  mkdir -p /tmp/site-raylight
  for w in "$b"/*.whl; do python3 -c "import sys,zipfile; zipfile.ZipFile(sys.argv[1]).extractall('/tmp/site-raylight')" "$w"; done
  if [ -s "$b/ray.tar.xz" ]; then tar -C /tmp/site-raylight -xJf "$b/ray.tar.xz"; fi
  ls /tmp/site-raylight
  exit 0
fi
grep -qx "/$b/" "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null || echo "/$b/" >> "$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$b"
plat=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)
python3 -m pip download -q --no-deps --only-binary=:all: "${plat[@]}" -d "$b" xfuser==0.7.0 yunchang==0.6.4
if [ "${1:-}" = "--with-ray" ] && [ ! -s "$b/ray.tar.xz" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: "${plat[@]}" -d "$tmp" ray==2.60.0
  mkdir "$tmp/x" && (cd "$tmp/x" && python3 -c "import zipfile,glob; zipfile.ZipFile(glob.glob('../ray-*.whl')[0]).extractall('.')")
  tar -C "$tmp/x" -cf - . | xz -9e -T0 > "$b/ray.tar.xz"
  rm -rf "$tmp"
fi
du -sh "$b"
