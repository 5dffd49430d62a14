"""Load the checkout the way ComfyUI does (folder imported as a package), as ``comfyui_mc_sparse_pack``.

Test modules then import ``comfyui_mc_sparse_pack.comfyui_mc_sparse...`` and ``comfyui_mc_sparse_pack.kernels``.
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through Triton's interpreter; it is chosen when kernels are decorated.
    os.environ.setdefault("TRITON_INTERPRET", "1")

_loader_path = Path(__file__).resolve().parent.parent / "comfyui_mc_sparse" / "_standalone.py"
_spec = importlib.util.spec_from_file_location("_mc_sparse_standalone", _loader_path)
_standalone = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_standalone)
pack = _standalone.load_pack()

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


@pytest.fixture
def gen():
    """A fresh, seeded CPU generator per test (fresh random inputs, reproducible failures)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {seed}")  # shown by pytest when the test fails
    return torch.Generator().manual_seed(seed)
