"""Load the checkout as a package the way ComfyUI does, outside ComfyUI.

ComfyUI imports a custom-node folder as a package named after its path (``nodes.load_custom_node``,
ComfyUI ``nodes.py`` L2111-2131), so every module here uses relative imports, including
``from ..kernels import ...``. The tests and ``python -m comfyui_mc_sparse`` load the checkout root the
same way under the fixed name below. This module has no relative imports so it can run before that.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PACK_NAME = "comfyui_mc_sparse_pack"
ROOT = Path(__file__).resolve().parent.parent


def load_pack(name: str = PACK_NAME) -> ModuleType:
    """Import the checkout root (``ROOT/__init__.py``) as package ``name`` and return it.

    Idempotent: a second call returns the module already in ``sys.modules``.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
