"""Development and evaluation tools, outside the runtime import path (ComfyUI never imports them).

* ``diagnostics`` - the paper's sec. 2 oracles and metrics on exact dense probabilities (small S).
* ``workload``    - the synthetic DiT-like q/k/v generator (tests, demo, benchmarks).
* ``cli``         - ``python -m comfyui_mc_sparse demo`` / ``comfyui`` (see ``__main__``).
* ``headless``    - a shipped API workflow run in a real ComfyUI checkout with a tiny random checkpoint
  (its test nodes and checkpoint writers serve the integration tier and the main job).
"""
