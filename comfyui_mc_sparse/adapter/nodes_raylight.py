"""The "MC-Sparse Patch (Ray)" node: MC-Sparse inside raylight's per-GPU Ray actors.

A raylight workflow has no MODEL wire to the sampler: the model lives in the actors and nodes pass
``RAY_ACTORS`` (raylight's own patch nodes, e.g. ``comfy_extra_dist/nodes_minimax_h3.py``, take and return it).
So this is a separate node with the MC-Sparse Patch node's inputs behind a ``ray_actors`` input, placed where
raylight's patch nodes go (after the model loader, before the sampler). It validates the settings here, then
runs ``raylight_actor.patch_on_actor`` on every actor (``adapter/raylight.py`` does the work there).

Listed only when raylight is installed (``raylight_installed``); ``ray`` and raylight are imported only when
the node runs. The node id and input ids are a contract with saved workflows: never rename them.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from comfy_api.latest import io

NODE_ID = "MCSparsePatchRay"
RAY_ACTORS = "RAY_ACTORS"


def raylight_installed() -> bool:
    """True when ``raylight`` is importable or a sibling custom-node folder holds ``src/raylight`` (ComfyUI may
    load this pack before raylight puts its ``src`` on sys.path). Only checks paths; imports nothing."""
    if importlib.util.find_spec("raylight") is not None:
        return True
    custom_nodes = Path(__file__).resolve().parents[3]
    try:
        return any((custom_nodes / name / "src" / "raylight" / "__init__.py").is_file()
                   for name in os.listdir(custom_nodes))
    except OSError:
        return False


class MCSparsePatchRay(io.ComfyNode):
    """RAY_ACTORS in, RAY_ACTORS out: MC-Sparse in every raylight worker (Ulysses sequence parallel)."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        from .nodes import MCSparsePatch

        settings_inputs = [i for i in MCSparsePatch.define_schema().inputs if i.id != "model"]
        return io.Schema(
            node_id=NODE_ID,
            display_name="MC-Sparse Patch (Ray)",
            category="Raylight/extra",
            description=(
                "MC-Sparse sparse self-attention inside raylight's GPU workers (Wan 2.1/2.2 with Ulysses "
                "sequence parallelism; CFG parallel works). Same settings as MC-Sparse Patch. Ring attention is "
                "refused (set ring degree 1). Each GPU runs MC-Sparse on its share of the heads; one run summary "
                "for all GPUs appears in the console."
            ),
            inputs=[io.Custom(RAY_ACTORS).Input("ray_actors", tooltip="raylight's workers (from the Ray init / "
                                                "model loader nodes).")] + settings_inputs,
            outputs=[io.Custom(RAY_ACTORS).Output(display_name="ray_actors",
                                                  tooltip="The same workers, with MC-Sparse installed.")],
        )

    @classmethod
    def execute(cls, ray_actors, preset: str, density: float, dense_warmup: str, warmup_layers: int,
                anchor_steps: str, query_tile: str, cache_placement: str, backend: str, min_tokens: int,
                verbose: bool, residual_precision: str = "auto", memory_headroom_gib: float = 4.0) -> io.NodeOutput:
        from .settings import build_settings

        try:
            tile = int(query_tile)
        except (TypeError, ValueError):
            raise ValueError(f"query tile C must be 64 or 128, got {query_tile!r}") from None
        settings = dict(preset=preset, density=density, dense_warmup=dense_warmup, warmup_layers=warmup_layers,
                        anchor_steps=anchor_steps, query_tile=tile, cache_placement=cache_placement, backend=backend,
                        min_tokens=min_tokens, verbose=verbose, residual_precision=residual_precision,
                        memory_headroom_gib=memory_headroom_gib)
        build_settings(**settings)  # bad inputs fail here, naming the input, before any worker is touched
        patch_workers(ray_actors, settings)
        return io.NodeOutput(ray_actors)


def patch_workers(ray_actors: dict, settings: dict) -> None:
    """Run ``raylight_actor.patch_on_actor`` on every worker in ``ray_actors["workers"]`` and wait for all."""
    import ray

    from . import raylight_actor

    ray.cloudpickle.register_pickle_by_value(sys.modules[raylight_actor.__name__])
    pack_root = str(Path(__file__).resolve().parents[2])
    pack_module = __name__.rsplit(".comfyui_mc_sparse.adapter.", 1)[0]
    ray.get([worker.model_function_runner.remote(raylight_actor.patch_on_actor, pack_root, pack_module, settings)
             for worker in ray_actors["workers"]])


def raylight_nodes() -> list[type[io.ComfyNode]]:
    """[MCSparsePatchRay] when raylight is installed, else []."""
    return [MCSparsePatchRay] if raylight_installed() else []
