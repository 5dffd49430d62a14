"""Integration tier: a real ComfyUI checkout named by COMFYUI_DIR (Oct-2025 snapshot), imported in-process.

Skipped, with the reason, when COMFYUI_DIR is unset or ComfyUI cannot be imported (e.g. the plain CI venv
without ComfyUI's requirements). Run:
    COMFYUI_DIR=/work/main/.comfyui .venv-comfy/bin/python -m pytest tests/integration -q
"""

import logging
import os

import pytest

COMFYUI_DIR = os.environ.get("COMFYUI_DIR")


def pytest_collection_modifyitems(config, items):
    reason = None
    if not COMFYUI_DIR:
        reason = "COMFYUI_DIR is not set (integration tests need a ComfyUI checkout)"
    else:
        try:
            import torchvision  # noqa: F401  (ComfyUI imports it at import time)
        except Exception as err:
            reason = f"ComfyUI's requirements are not importable here ({err})"
    if reason:
        for item in items:
            if "integration" in str(item.fspath):
                item.add_marker(pytest.mark.skip(reason=reason))


class SummaryCapture(logging.Handler):
    """Collects MC-Sparse run summaries (logged by the OUTER_SAMPLE wrapper of ComfyUI's copy of the pack)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.summaries = []

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("MC-Sparse:") and "sparse," in msg.splitlines()[0]:
            self.summaries.append(msg)

    def counts(self, i=-1):
        import re

        head = self.summaries[i].splitlines()[0]
        m = re.match(r"MC-Sparse: (\d+) sparse, (\d+) anchor, (\d+) dense", head)
        return {"sparse": int(m[1]), "anchor": int(m[2]), "dense": int(m[3])}


@pytest.fixture(scope="session")
def comfy():
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.tools import headless

    nodes = headless.setup_comfy(COMFYUI_DIR)
    return headless, nodes


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
