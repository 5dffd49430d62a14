"""The ComfyUI side of MC-Sparse: the "MC-Sparse Patch" node and everything it installs on a model.

Modules, by concern:

* ``settings``  - widget values -> validated ``PatchSettings``; per-sampler-call schedule resolution (no ComfyUI).
* ``steps``     - the denoising step of the current sigma within this sampler call's schedule (no ComfyUI).
* ``callsite``  - ``CallSite`` (the mark of a self-attention call) and the transformer_options keys.
* ``layouts``   - per-model rules: which modules are self-attention, block indices, joint text layouts.
* ``override``  - the ``optimized_attention_override`` and the per-call dispatch (dense / anchor / reuse).
* ``hunyuan3d21`` - the Hunyuan3D 2.1 attention forward (that model passes its attention no transformer_options).
* ``lifecycle`` - the per-run state (``RunState``), wrappers and callbacks, and ``apply_mc_sparse``.
* ``summary``   - the end-of-run summary text.
* ``nodes``     - the V3 node schema and ``comfy_entrypoint`` (imported only inside ComfyUI).

Only ``nodes``, ``hunyuan3d21``'s forward and the functions of ``lifecycle`` that register wrappers import ``comfy``;
everything else is importable (and unit-tested) without ComfyUI.
"""
