"""MC-Sparse: training-free sparse attention for video and 3D diffusion transformers (arXiv 2610.06801).

The algorithm, free of ComfyUI: ``config`` (settings), ``schedule`` (dense / anchor / reuse steps),
``selection`` (K from density), ``attention`` (anchor and reuse steps of one layer), ``cache`` and
``encoding`` (the metadata cache and its compact storage), ``memory`` (estimates), ``engine`` (one
sampling run). ``tools`` holds what ComfyUI never loads: ``diagnostics`` (oracles and metrics), ``workload``
(synthetic q/k/v), ``cli`` (the demo), ``headless`` (a shipped workflow run in a ComfyUI checkout).
The kernels (Fast PDDP, exact selection, token-sparse attention) are in the checkout's ``kernels``
package; ``adapter`` is the ComfyUI side.

Nothing is imported here, so ``python -m comfyui_mc_sparse`` can start before the checkout root is
loaded as a package (see ``_standalone``); import the submodules.
"""
