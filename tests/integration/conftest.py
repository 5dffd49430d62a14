"""Integration tier: real ComfyUI checkouts imported in-process, one ComfyUI per process.

Two checkouts, each named by its own environment variable:

* ``COMFYUI_DIR``: ComfyUI v0.3.64 (Oct-2025, commit a125cd8), venv from ``requirements-integration.txt``;
* ``COMFYUI_2026_DIR``: ComfyUI v0.33.0 (2026-08-15 snapshot with MiniMax-H3, AttentionTensorContainer and
  comfy-kitchen attention), venv from ``requirements-integration-2026.txt``.

Every test that takes the ``comfy`` fixture is parametrised over both (ids ``v0.3.64`` / ``v0.33.0``). ComfyUI
cannot be imported twice in one process (its top-level modules ``comfy``, ``nodes``, ``folder_paths`` are
process-global and the two versions need different packages), so a process runs ONE checkout and skips the
other's parameters, saying why: ``MC_SPARSE_COMFYUI`` (``v0.3.64`` / ``v0.33.0``) picks it; unset, the process
runs the only checkout named, or, with both named, v0.33.0 when comfy-kitchen imports (its venv), else v0.3.64.
A checkout whose variable is unset is skipped with that reason. Tests marked ``@pytest.mark.comfyui("v0.33.0")``
run on that version only. Run both (``tests/integration/run_both.sh`` does this):

    COMFYUI_DIR=/work/main/.comfyui .venv-comfy/bin/python -m pytest tests/integration -q
    COMFYUI_2026_DIR=/work/main/.comfyui-2026 .venv-comfy26/bin/python -m pytest tests/integration -q
"""

import importlib.util
import logging
import os
import re

import pytest

CHECKOUTS = {"v0.3.64": "COMFYUI_DIR", "v0.33.0": "COMFYUI_2026_DIR"}


def _selected() -> tuple[str | None, str | None]:
    """(version this process runs, or None; reason when None)."""
    named = [v for v, var in CHECKOUTS.items() if os.environ.get(var)]
    want = os.environ.get("MC_SPARSE_COMFYUI")
    if want:
        if want not in CHECKOUTS:
            return None, f"MC_SPARSE_COMFYUI must be one of {', '.join(CHECKOUTS)}, got {want!r}"
        if want not in named:
            return None, f"MC_SPARSE_COMFYUI={want} but {CHECKOUTS[want]} is not set"
        return want, None
    if not named:
        return None, "neither COMFYUI_DIR (v0.3.64) nor COMFYUI_2026_DIR (v0.33.0) is set"
    if len(named) == 1:
        return named[0], None
    return ("v0.33.0" if importlib.util.find_spec("comfy_kitchen") else "v0.3.64"), None


SELECTED, NONE_REASON = _selected()


def _skip_reason(version: str) -> str | None:
    if not os.environ.get(CHECKOUTS[version]):
        return f"{CHECKOUTS[version]} is not set (ComfyUI {version} checkout)"
    if SELECTED is None:
        return NONE_REASON
    if version != SELECTED:
        return (f"this process runs ComfyUI {SELECTED}; one ComfyUI per process (comfy, nodes, folder_paths are "
                f"process-global): run {version} in its own process (tests/integration/run_both.sh)")
    try:
        import torchvision  # noqa: F401  (ComfyUI imports it at import time)
    except Exception as err:
        return f"ComfyUI's requirements are not importable here ({err})"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "comfyui(version): run only against that ComfyUI checkout version")
_COUNTS = re.compile(r"(\d+) sparse, (\d+) anchor, (\d+) dense")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "integration" not in str(item.fspath):
            continue
        callspec = getattr(item, "callspec", None)
        version = callspec.params.get("comfy") if callspec is not None else None
        if version is None:
            reason = NONE_REASON if SELECTED is None else None
        else:
            reason = _skip_reason(version)
            marker = item.get_closest_marker("comfyui")
            if reason is None and marker is not None and version not in marker.args:
                reason = f"needs ComfyUI {' or '.join(marker.args)} (this is {version})"
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


class SummaryCapture(logging.Handler):
    """Collects MC-Sparse run summaries (logged by the OUTER_SAMPLE wrapper of ComfyUI's copy of the pack)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.summaries = []

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("MC-Sparse:") and _COUNTS.search(msg):
            self.summaries.append(msg)

    def counts(self, i=-1):
        """Calls per kind of summary ``i``: its "calls: ..." line (or an interrupted run's first line)."""
        m = _COUNTS.search(self.summaries[i])
        return {"sparse": int(m[1]), "anchor": int(m[2]), "dense": int(m[3])}


def _headless():
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.tools import headless

    return headless


@pytest.fixture(scope="session", params=list(CHECKOUTS))
def comfy(request):
    """(headless harness module, ComfyUI's ``nodes``) for the checkout of this parameter."""
    version = request.param
    reason = _skip_reason(version)
    if reason:
        pytest.skip(reason)
    headless = _headless()
    nodes = headless.setup_comfy(os.environ[CHECKOUTS[version]])
    headless.COMFYUI_VERSION = version
    return headless, nodes


@pytest.fixture
def comfy_version(comfy):
    """``"v0.3.64"`` or ``"v0.33.0"``: the checkout this test runs against."""
    return comfy[0].COMFYUI_VERSION


@pytest.fixture
def summaries():
    handler = SummaryCapture()
    root = logging.getLogger()
    old = root.level
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    yield handler
    root.removeHandler(handler)
    root.setLevel(old)
