"""What the "MC-Sparse Patch (Ray)" node runs inside each raylight Ray actor.

raylight calls ``fn(model, *args)`` on every actor (``RayWorker.model_function_runner``) and keeps the returned
model. Ray pickles ``fn`` with cloudpickle; the node registers this module to be pickled *by value*, because
the pack is not importable by name in an actor (ComfyUI imports custom nodes by path). So this module imports
only the standard library: the function loads the pack from its folder (as ComfyUI does) and calls
``adapter.raylight.apply_mc_sparse_raylight``. Actors on other hosts need the pack at the same path.
"""

from __future__ import annotations


def patch_on_actor(model, pack_root: str, pack_module: str, settings: dict):
    """Load the pack (folder ``pack_root``, package name ``pack_module``) in this process if needed, and return
    ``apply_mc_sparse_raylight(model, **settings)``.

    Raises:
        ImportError: the pack folder is missing here. RuntimeError / ValueError: from ``apply_mc_sparse_raylight``.
    """
    import importlib
    import importlib.util
    import os
    import sys

    if pack_module not in sys.modules:
        init = os.path.join(pack_root, "__init__.py")
        if not os.path.isfile(init):
            raise ImportError(f"MC-Sparse Patch (Ray): the pack is not at {pack_root} on this Ray worker's host")
        spec = importlib.util.spec_from_file_location(pack_module, init, submodule_search_locations=[pack_root])
        module = importlib.util.module_from_spec(spec)
        sys.modules[pack_module] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[pack_module]
            raise
    adapter = importlib.import_module(pack_module + ".comfyui_mc_sparse.adapter.raylight")
    return adapter.apply_mc_sparse_raylight(model, **settings)
