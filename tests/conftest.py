"""Load the checkout the way ComfyUI does (folder imported as a package), as ``comfyui_mc_sparse_pack``.

Test modules then import ``comfyui_mc_sparse_pack.comfyui_mc_sparse...`` and ``comfyui_mc_sparse_pack.kernels``.
"""

import importlib.util
import os
import zlib
from pathlib import Path

import pytest
import torch

# a bug in the sparse path fails its test instead of hiding behind the engine's dense fallback (engine.py)
os.environ.setdefault("MC_SPARSE_RAISE_ERRORS", "1")

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through Triton's interpreter; it is chosen when kernels are decorated.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _load_by_path(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if os.environ.get("TRITON_INTERPRET") == "1":  # fix two Triton 3.6 interpreter bugs for every test
    _load_by_path("_mc_sparse_triton_interp", Path(__file__).resolve().parent / "_triton_interp.py").patch_interpreter()

pack = _load_by_path(
    "_mc_sparse_standalone", Path(__file__).resolve().parent.parent / "comfyui_mc_sparse" / "_standalone.py"
).load_pack()

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


@pytest.fixture
def gen(request):
    """A seeded CPU generator per test: random inputs, different for every test (and parameter set) but the same on
    every run and machine (the seed is a hash of the test's id), so CI sees the inputs a developer saw."""
    seed = zlib.crc32(request.node.nodeid.encode())
    print(f"random seed: {seed} ({request.node.nodeid})")  # shown by pytest when the test fails
    return torch.Generator().manual_seed(seed)
