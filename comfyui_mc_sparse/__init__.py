"""MC-Sparse: training-free sparse attention for video and 3D diffusion transformers (arXiv 2610.06801).

The algorithm, free of ComfyUI: ``config`` (settings), ``schedule`` (dense / anchor / reuse steps),
``grouping`` (Fast PDDP query groups), ``selection`` (exact two-pass KV selection), ``attention``
(anchor and reuse steps of one layer), ``cache`` (the metadata cache), ``engine`` (one sampling run),
``diagnostics`` (oracles and metrics), ``workload`` (synthetic q/k/v). ``adapter`` is the ComfyUI side.

Nothing is imported here, so ``python -m comfyui_mc_sparse`` can start before the checkout root is
loaded as a package (see ``_standalone``); import the submodules.
"""
