"""Compile the CuTeDSL pass-2 kernel's configs in parallel child processes into the disk cache (GPU rounds: the test
file and the bench load them from there instead of compiling one after another, ~5 s each)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def start(configs) -> dict:
    """Start one child process per config (a dict of ``pass2_sm90.compiled``'s arguments) compiling it into the disk
    cache; returns {repr(config): Popen}."""
    import json

    code = ("import sys, json; sys.path.insert(0, {root!r}); import _standalone; _standalone.load_pack(); "
            "from comfyui_mc_sparse_pack.kernels.cutedsl import pass2_sm90 as p2; "
            "p2.compiled(**json.loads(sys.argv[1]))").format(root=str(ROOT / "comfyui_mc_sparse"))
    return {repr(c): subprocess.Popen([sys.executable, "-c", code, json.dumps(c)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, env=dict(os.environ)) for c in configs}


def wait(procs: dict, timeout: float = 60.0) -> dict:
    """{repr(config): return code} of ``start``'s children (None: still running at ``timeout``, then killed). A
    failed compile shows its error again when the caller compiles in-process."""
    t0, rc = time.time(), {}
    for name, p in procs.items():
        try:
            rc[name] = p.wait(timeout=max(0.1, timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            rc[name] = None
    return rc


def warm_parallel(configs, timeout: float = 60.0) -> dict:
    """``start`` then ``wait``."""
    return wait(start(configs), timeout)
