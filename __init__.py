"""ComfyUI entry point of the MC-Sparse node pack.

ComfyUI imports this folder as a package (``nodes.load_custom_node``) and calls ``comfy_entrypoint``
(V3 node API). Outside ComfyUI (tests, the demo) nothing is registered and nothing ComfyUI-specific
is imported.
"""

try:
    import comfy.model_patcher  # noqa: F401  (present only inside ComfyUI)
except ImportError:
    pass
else:
    from .comfyui_mc_sparse.adapter.nodes import comfy_entrypoint  # noqa: F401
