#!/usr/bin/env bash
# The integration tier against both ComfyUI checkouts, one process each (ComfyUI is process-global):
#   COMFYUI_DIR      ComfyUI v0.3.64 checkout; python from COMFYUI_PYTHON      (default .venv-comfy/bin/python)
#   COMFYUI_2026_DIR ComfyUI v0.33.0 checkout; python from COMFYUI_2026_PYTHON (default .venv-comfy26/bin/python)
# A checkout whose variable is unset is reported as skipped (pytest says why). Extra arguments go to pytest.
# Exit status: non-zero when either run fails.
set -u
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
status=0
run() {  # version var python
    if [ -z "${!2:-}" ]; then
        echo "== ComfyUI $1: skipped ($2 is not set)"
        return
    fi
    echo "== ComfyUI $1 (${!2}) with $3"
    env -u COMFYUI_DIR -u COMFYUI_2026_DIR "$2=${!2}" MC_SPARSE_COMFYUI="$1" "$3" -m pytest tests/integration -q "${@:4}" \
        || status=1
}
run v0.3.64 COMFYUI_DIR "${COMFYUI_PYTHON:-$root/.venv-comfy/bin/python}" "$@"
run v0.33.0 COMFYUI_2026_DIR "${COMFYUI_2026_PYTHON:-$root/.venv-comfy26/bin/python}" "$@"
exit $status
