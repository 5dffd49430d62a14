"""Build the shipped workflows from the official ComfyUI templates (PyPI ``comfyui-workflow-templates-json``).

For each template: insert an "MC-Sparse Patch" node right after the model loader (after the LoRA loader
where there is one), rewire its consumers, add a short MarkdownNote, and write

* ``<name>_mc_sparse.json``      UI workflow (load in ComfyUI),
* ``<name>_mc_sparse_api.json``  API-format twin (``/prompt``, ``PromptExecutor``; headless runs).

The API twin maps each node's positional ``widgets_values`` to input names with ``WIDGETS`` (the widget order
of the Oct-2025 node definitions; ``control_after_generate`` pseudo-widgets skipped, as the frontend's
``graphToPrompt`` does). Subgraph templates (Wan2.2 14B, Hunyuan3D 2.1) are edited inside their subgraph
definition and flattened for the API twin.

Then the fidelity workflows, from the built Wan 2.1 T2V 1.3B workflow (``build_fidelity``):

* ``wan21_t2v_1.3b_compare``  the same seed sampled with the patch and without it, into "MC-Sparse Compare";
* ``wan21_t2v_1.3b_probe``    "MC-Sparse Probe" after the patch, "MC-Sparse Probe Report" after the sampler.

Run (build-time only; the templates package is not a runtime requirement):
    .venv/bin/pip install comfyui-workflow-templates-json && .venv/bin/python workflows/build_workflows.py
    .venv/bin/python workflows/build_workflows.py --fidelity-only   # the fidelity workflows alone (no templates)
    .venv/bin/python workflows/build_workflows.py video_minimax_h3_t2v.json   # only the named templates
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

PATCH_WIDGETS = ["balanced", 0.2, "auto", 1, "auto", "128", "auto", "auto", 2048, False, "auto", 4.0]
PATCH_NAMES = ["preset", "density", "dense_warmup", "warmup_layers", "anchor_steps", "query_tile", "cache_placement",
               "backend", "min_tokens", "verbose", "residual_precision", "memory_headroom_gib"]

PROBE_WIDGETS = [0.2, "128", "auto", "auto", "all", 8, False, 512, "none"]
PROBE_NAMES = ["density", "query_tile", "probe_step", "reuse_step", "blocks", "heads", "per_head", "oracle_queries",
               "capture_blocks"]

# node type -> widget input names in widget order ("*" = UI-only control_after_generate pseudo-widget)
WIDGETS: dict[str, list[str]] = {
    "UNETLoader": ["unet_name", "weight_dtype"],
    "CLIPLoader": ["clip_name", "type", "device"],
    "DualCLIPLoader": ["clip_name1", "clip_name2", "type", "device"],
    "VAELoader": ["vae_name"],
    "CLIPTextEncode": ["text"],
    "EmptyHunyuanLatentVideo": ["width", "height", "length", "batch_size"],
    "KSampler": ["seed", "*", "steps", "cfg", "sampler_name", "scheduler", "denoise"],
    "KSamplerAdvanced": ["add_noise", "noise_seed", "*", "steps", "cfg", "sampler_name", "scheduler", "start_at_step",
                         "end_at_step", "return_with_leftover_noise"],
    "ModelSamplingSD3": ["shift"],
    "ModelSamplingAuraFlow": ["shift", "sampling"],  # "sampling": a newer widget, dropped (API_DROP)
    "VAEDecode": [],
    "VAEDecodeTiled": ["tile_size", "overlap", "temporal_size", "temporal_overlap"],
    "CreateVideo": ["fps", "bit_depth"],  # bit_depth: v0.33.0 (only the H3 template carries its value)
    "SaveVideo": ["filename_prefix", "format", "codec"],
    "LoraLoaderModelOnly": ["lora_name", "strength_model"],
    "CLIPVisionLoader": ["clip_name"],
    "CLIPVisionEncode": ["crop"],
    "LoadImage": ["image", "*"],  # "upload": the frontend's upload button (image_upload), not an input
    "WanImageToVideo": ["width", "height", "length", "batch_size"],
    "Wan22ImageToVideoLatent": ["width", "height", "length", "batch_size"],
    "KSamplerSelect": ["sampler_name"],
    "BasicScheduler": ["scheduler", "steps", "denoise"],
    "BasicGuider": [],
    "RandomNoise": ["noise_seed", "*"],
    "SamplerCustomAdvanced": [],
    "FluxGuidance": ["guidance"],
    "ImageOnlyCheckpointLoader": ["ckpt_name"],
    "Hunyuan3Dv2Conditioning": [],
    "EmptyLatentHunyuan3Dv2": ["resolution", "batch_size"],
    "VAEDecodeHunyuan3D": ["num_chunks", "octree_resolution"],
    "VoxelToMesh": ["algorithm", "threshold"],
    "SaveGLB": ["filename_prefix"],
    "MCSparsePatch": PATCH_NAMES,
    "MCSparseProbe": PROBE_NAMES,
    "MCSparseProbeReport": [],
    "MCSparseCompare": ["label_a", "label_b"],
    "PreviewImage": [],
    "PreviewAny": [],
    # ComfyUI v0.33.0 nodes of the MiniMax-H3 template (comfy_extras/nodes_minimax_h3.py, nodes_resolution.py,
    # nodes_audio.py, nodes_video.py); its API twin is checked against tests/data/comfyui_node_defs_v0.33.0.json
    "ResolutionSelector": ["aspect_ratio", "megapixels", "multiple"],
    "MiniMaxH3ImageToVideo": ["prompt", "width", "height", "length"],
    "VAEDecodeAudio": [],
}
UI_ONLY = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")
PASS_THROUGH = ("ComfySwitchNode",)
# Resolved to literals / the chosen branch in the API twin (their node types are newer than the Oct-2025
# snapshot, or, for Primitive*, only carry a value): "PrimitiveInt" & co. -> their widget value,
# "ComfySwitchNode" -> on_true / on_false by its switch, "ComfyMathExpression" -> the evaluated expression.
LITERAL_NODES = ("PrimitiveInt", "PrimitiveFloat", "PrimitiveBoolean", "PrimitiveString", "PrimitiveStringMultiline",
                 "ComfySwitchNode", "ComfyMathExpression")
# Inputs of newer templates that the Oct-2025 node definitions do not have (left out of the API twin).
API_DROP = {"ModelSamplingAuraFlow": ("sampling",)}
LOADERS = ("UNETLoader", "ImageOnlyCheckpointLoader", "CheckpointLoaderSimple")

TARGETS = {
    "text_to_video_wan.json": "wan21_t2v_1.3b",
    "image_to_video_wan.json": "wan21_i2v_14b",
    "video_wan2_2_5B_ti2v.json": "wan22_ti2v_5b",
    "hunyuan_video_text_to_video.json": "hunyuan_video_t2v",
    "video_wan2_2_14B_t2v.json": "wan22_t2v_14b_two_stage",
    "3d_hunyuan3d-v2.1.json": "hunyuan3d_v21",
    "video_minimax_h3_t2v.json": "minimax_h3_t2v",  # ComfyUI v0.33.0 (MiniMax-H3); subgraph template
}

NOTE = ("## MC-Sparse Patch\n\nSparse attention after the dense warm-up. Presets: quality (25% density), balanced "
        "(20%), fast (15%). Pick *custom* to set density, warm-up and anchor steps yourself. The console prints a "
        "run summary after each sampler: how many attention calls went sparse, and why any stayed dense.")


def _templates_dir() -> Path:
    import comfyui_workflow_templates_json as pkg

    return Path(pkg.__file__).resolve().parent / "templates"


def _graph_nodes(graph: dict) -> list[dict]:
    return graph["nodes"]


def _insert_patch(graph: dict, *, links_as_dicts: bool) -> list[int]:
    """Insert an MCSparsePatch after every MODEL-producing loader/LoRA chain end in ``graph`` (in place).
    Returns the new node ids."""
    nodes = {n["id"]: n for n in graph["nodes"]}
    links = graph["links"]

    def link_fields(link):
        if links_as_dicts:
            return link["id"], link["origin_id"], link["origin_slot"], link["target_id"], link["target_slot"], link["type"]
        return tuple(link)

    # chain ends: MODEL outputs of loaders, followed through LoRA loaders
    sources = []
    for n in graph["nodes"]:
        if n["type"] in LOADERS:
            sources.append(n["id"])
    ends = []
    for src in sources:
        cur = src
        while True:
            consumers = [link_fields(lk) for lk in links if link_fields(lk)[1] == cur and link_fields(lk)[5] == "MODEL"]
            # follow LoRA loaders, then a ComfySwitchNode (Wan2.2 "turbo" toggle: LoRA path vs plain loader), so
            # the patch sits where both paths meet and is applied whichever the switch picks
            nxt = ([c for c in consumers if nodes.get(c[3], {}).get("type") == "LoraLoaderModelOnly"]
                   or [c for c in consumers if nodes.get(c[3], {}).get("type") in PASS_THROUGH])
            if not nxt:
                break
            cur = nxt[0][3]
        ends.append(cur)
    new_ids = []
    next_id = max([n["id"] for n in graph["nodes"]] + [0]) + 1
    next_link = max([link_fields(lk)[0] for lk in links] + [graph.get("last_link_id", 0) or 0, 0]) + 1
    for end in dict.fromkeys(ends):
        out_links = [lk for lk in links if link_fields(lk)[1] == end and link_fields(lk)[5] == "MODEL"
                     and nodes.get(link_fields(lk)[3], {}).get("type") not in ("LoraLoaderModelOnly", *PASS_THROUGH)]
        if not out_links:
            continue
        src_node = nodes[end]
        pid = next_id
        next_id += 1
        in_link = next_link
        next_link += 1
        patch = {
            "id": pid, "type": "MCSparsePatch",
            "pos": [src_node.get("pos", [0, 0])[0] + 40, src_node.get("pos", [0, 0])[1] + 160], "size": [320, 300],
            "flags": {}, "order": src_node.get("order", 0), "mode": 0,
            "inputs": [{"name": "model", "type": "MODEL", "link": in_link}],
            "outputs": [{"name": "MODEL", "type": "MODEL", "links": [], "slot_index": 0}],
            "properties": {"Node name for S&R": "MCSparsePatch"},
            "widgets_values": list(PATCH_WIDGETS),
        }
        model_slot = 0
        for lk in out_links:
            lid, _o, oslot, tid, tslot, _t = link_fields(lk)
            model_slot = oslot
            if links_as_dicts:
                lk["origin_id"], lk["origin_slot"] = pid, 0
            else:
                lk[1], lk[2] = pid, 0
            patch["outputs"][0]["links"].append(lid)
        for out in src_node.get("outputs", []):
            if out.get("type") == "MODEL" and out.get("links"):
                out["links"] = [lid for lid in out["links"] if lid not in patch["outputs"][0]["links"]] + [in_link]
        new_link = ({"id": in_link, "origin_id": end, "origin_slot": model_slot, "target_id": pid, "target_slot": 0,
                     "type": "MODEL"} if links_as_dicts else [in_link, end, model_slot, pid, 0, "MODEL"])
        links.append(new_link)
        graph["nodes"].append(patch)
        new_ids.append(pid)
    if "last_node_id" in graph:
        graph["last_node_id"] = max(graph["last_node_id"], next_id - 1)
    if "last_link_id" in graph:
        graph["last_link_id"] = max(graph.get("last_link_id") or 0, next_link - 1)
    if "state" in graph:
        graph["state"]["lastNodeId"] = max(graph["state"].get("lastNodeId", 0), next_id - 1)
        graph["state"]["lastLinkId"] = max(graph["state"].get("lastLinkId", 0), next_link - 1)
    return new_ids


def build_ui(template: dict) -> dict:
    """The template with the patch node(s) inserted and a note added (subgraphs edited in place)."""
    ui = copy.deepcopy(template)
    inserted = _insert_patch(ui, links_as_dicts=False)
    for sg in ui.get("definitions", {}).get("subgraphs", []):
        inserted += _insert_patch(sg, links_as_dicts=True)
    if not inserted:
        raise ValueError("no model loader found to insert MC-Sparse Patch after")
    nid = ui["last_node_id"] + 1
    ui["nodes"].append({"id": nid, "type": "MarkdownNote", "pos": [-400, -200], "size": [380, 200], "flags": {},
                        "order": 0, "mode": 0, "inputs": [], "outputs": [], "properties": {},
                        "widgets_values": [NOTE], "color": "#432", "bgcolor": "#653"})
    ui["last_node_id"] = nid
    return ui


def _api_from_graph(graph: dict, *, prefix: str, links_as_dicts: bool, sub_inputs: dict, subgraphs: dict,
                    api: dict, outer_values: dict) -> dict:
    """Flatten ``graph`` into ``api``; returns {(node_id, slot)-> source ref} for subgraph outputs."""
    def lf(link):
        if links_as_dicts:
            return link["id"], link["origin_id"], link["origin_slot"], link["target_id"], link["target_slot"], link["type"]
        return tuple(link)

    by_link = {lf(lk)[0]: lf(lk) for lk in graph["links"]}
    sub_out_refs = {}

    def resolve(origin_id, origin_slot):
        if origin_id == -10:  # subgraph input node
            return sub_inputs.get(origin_slot)
        if (origin_id, origin_slot) in sub_out_refs:
            return sub_out_refs[(origin_id, origin_slot)]
        if origin_id in literal_nodes:
            if literal_nodes[origin_id]["type"] == "ComfyMathExpression" and origin_slot == 0:
                value = literal(origin_id)
                return ("value", float(value[1]))
            return literal(origin_id)
        return [f"{prefix}{origin_id}", origin_slot]

    literal_nodes = {n["id"]: n for n in graph["nodes"] if n["type"] in LITERAL_NODES}

    def input_ref(node, name):
        inp = next((i for i in node.get("inputs", []) if i["name"] == name), None)
        if inp is None or inp.get("link") is None:
            return None
        _lid, o, os_, _t, _ts, _ty = by_link[inp["link"]]
        return resolve(o, os_)

    def literal(nid):
        """("value", v) or a [node, slot] ref for a Primitive*/switch/math node (see LITERAL_NODES)."""
        n = literal_nodes[nid]
        vals = n.get("widgets_values") or []
        if n["type"].startswith("Primitive"):
            ref = input_ref(n, "value")
            return ref if ref is not None else ("value", vals[0])
        if n["type"] == "ComfySwitchNode":
            sw = input_ref(n, "switch")
            flag = sw[1] if isinstance(sw, tuple) else (vals[0] if vals else False)
            if isinstance(sw, list):
                raise KeyError(f"switch of node {nid} is not a literal ({sw})")
            return input_ref(n, "on_true" if flag else "on_false")
        if n["type"] == "ComfyMathExpression":
            env = {}
            for letter in "abc":
                ref = input_ref(n, f"values.{letter}")
                if isinstance(ref, tuple):
                    env[letter] = ref[1]
            import math

            value = eval(vals[0], {"__builtins__": {}, "floor": math.floor, "ceil": math.ceil,
                                   "round": round, "min": min, "max": max}, env)
            return ("value", value)
        raise KeyError(n["type"])

    # subgraph instances first so their outputs can be referenced
    order = sorted(graph["nodes"], key=lambda n: 0 if n["type"] in subgraphs else 1)
    for n in order:
        if n["type"] in subgraphs:
            sg = subgraphs[n["type"]]
            inner_inputs = {}
            sg_inputs = sg.get("inputs", [])
            slot_of = {sgi["name"]: i for i, sgi in enumerate(sg_inputs)}
            for i, inp in enumerate(n.get("inputs", [])):
                if inp.get("link") is not None:  # instance inputs may list fewer slots than the definition: by name
                    _lid, o, os_, _t, _ts, _ty = by_link[inp["link"]]
                    inner_inputs[slot_of.get(inp["name"], i)] = resolve(o, os_)
            # widget-promoted inputs of the subgraph instance: one value per widget-typed definition input, in
            # definition order (linked ones keep a value too), when the counts say so; else the unlinked ones
            widget_vals = n.get("widgets_values") or []
            widget_slots = [i for i, sgi in enumerate(sg_inputs) if sgi.get("type") in WIDGET_TYPES]
            if len(widget_slots) == len(widget_vals):
                for i, val in zip(widget_slots, widget_vals):
                    inner_inputs.setdefault(i, ("value", val))
            else:
                wi = 0
                for i, sgi in enumerate(sg_inputs):
                    if i not in inner_inputs and wi < len(widget_vals):
                        inner_inputs[i] = ("value", widget_vals[wi])
                        wi += 1
            inner_prefix = f"{prefix}{n['id']}:"
            inner = _api_from_graph(sg, prefix=inner_prefix, links_as_dicts=True, sub_inputs=inner_inputs,
                                    subgraphs=subgraphs, api=api, outer_values={})
            for lk in sg["links"]:
                lid, o, os_, t, ts, _ty = lf_sub(lk)
                if t == -20:
                    sub_out_refs[(n["id"], ts)] = inner.get((o, os_), [f"{inner_prefix}{o}", os_])
    for n in graph["nodes"]:
        if n["type"] in UI_ONLY or n["type"] in subgraphs or n["type"] in LITERAL_NODES or n.get("mode", 0) in (2, 4):
            continue
        names = WIDGETS.get(n["type"])
        if names is None:
            raise KeyError(f"no widget map for node type {n['type']}")
        inputs = {}
        vals = list(n.get("widgets_values") or [])
        for name, val in zip([x for x in names], vals):
            if name != "*":
                inputs[name] = val
        for inp in n.get("inputs", []):
            if inp.get("link") is None:
                continue
            _lid, o, os_, _t, _ts, _ty = by_link[inp["link"]]
            ref = resolve(o, os_)
            if isinstance(ref, tuple) and ref[0] == "value":
                inputs[inp["name"]] = ref[1]
            elif ref is not None:
                inputs[inp["name"]] = ref
        for name in API_DROP.get(n["type"], ()):
            inputs.pop(name, None)
        api[f"{prefix}{n['id']}"] = {"class_type": n["type"], "inputs": inputs, "_meta": {"title": n.get("title", n["type"])}}
    return {(k[0], k[1]): v for k, v in sub_out_refs.items()}


def lf_sub(link):
    return link["id"], link["origin_id"], link["origin_slot"], link["target_id"], link["target_slot"], link["type"]


def build_api(ui: dict) -> dict:
    """Flatten a UI workflow (with the patch inserted) into API format."""
    subgraphs = {sg["id"]: sg for sg in ui.get("definitions", {}).get("subgraphs", [])}
    api: dict = {}
    _api_from_graph(ui, prefix="", links_as_dicts=False, sub_inputs={}, subgraphs=subgraphs, api=api, outer_values={})
    # drop inputs referencing nodes that were not emitted (UI-only)
    for node in api.values():
        for k, v in list(node["inputs"].items()):
            if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and v[0] not in api:
                del node["inputs"][k]
    return api


FIDELITY_SOURCE = "wan21_t2v_1.3b_mc_sparse.json"
"""The fidelity workflows start from the built Wan 2.1 T2V 1.3B workflow (template + MC-Sparse Patch)."""

COMPARE_NOTE = ("## A/B: MC-Sparse vs dense\n\nThe same seed is sampled twice: top with the MC-Sparse Patch, bottom "
                "with the plain model (the patch bypassed). **MC-Sparse Compare** gives PSNR and SSIM per frame and "
                "overall and shows patched | dense | difference x4. Try the presets (quality / balanced / fast) on "
                "your prompt: above ~30 dB PSNR and ~0.9 SSIM the difference is hard to see.")
PROBE_NOTE = ("## MC-Sparse Probe\n\nMeasures, at one step of this run, how close MC-Sparse's attention is to exact "
              "dense attention in every block (relative L1 of the output, attention recall), beside block-sparse "
              "attention and the oracles. It does not change the video. **MC-Sparse Probe Report** shows the plot "
              "and the table after sampling; they are also in the console and in output/mc_sparse_probe/.")


def _find(ui: dict, node_type: str) -> dict:
    matches = [n for n in ui["nodes"] if n["type"] == node_type]
    if len(matches) != 1:
        raise ValueError(f"expected one {node_type} node, found {len(matches)}")
    return matches[0]


def _add_node(ui: dict, node_type: str, pos, widgets, inputs, outputs, size=(320, 160)) -> dict:
    """Append a node (``inputs`` / ``outputs``: ``[(name, type)]``) with a fresh id; returns it."""
    nid = ui["last_node_id"] + 1
    ui["last_node_id"] = nid
    node = {"id": nid, "type": node_type, "pos": list(pos), "size": list(size), "flags": {}, "order": len(ui["nodes"]),
            "mode": 0, "inputs": [{"name": n, "type": t, "link": None} for n, t in inputs],
            "outputs": [{"name": n, "type": t, "links": [], "slot_index": i} for i, (n, t) in enumerate(outputs)],
            "properties": {"Node name for S&R": node_type}, "widgets_values": list(widgets)}
    if node_type in UI_ONLY:
        node["properties"] = {}
    ui["nodes"].append(node)
    return node


def _link(ui: dict, src: dict, src_slot: int, dst: dict, dst_slot: int) -> None:
    """Connect ``src`` output ``src_slot`` to ``dst`` input ``dst_slot`` (replacing the input's old link)."""
    link_type = src["outputs"][src_slot]["type"]
    old = dst["inputs"][dst_slot].get("link")
    if old is not None:
        ui["links"] = [lk for lk in ui["links"] if lk[0] != old]
        for n in ui["nodes"]:
            for out in n.get("outputs", []):
                if out.get("links"):
                    out["links"] = [x for x in out["links"] if x != old]
    lid = ui["last_link_id"] + 1
    ui["last_link_id"] = lid
    ui["links"].append([lid, src["id"], src_slot, dst["id"], dst_slot, link_type])
    src["outputs"][src_slot]["links"].append(lid)
    dst["inputs"][dst_slot]["link"] = lid


def _note(ui: dict, text: str, pos) -> None:
    _add_node(ui, "MarkdownNote", pos, [text], [], [], size=(400, 220)).update(color="#432", bgcolor="#653")


def build_compare_ui(source: dict) -> dict:
    """The patched Wan workflow sampled twice with one fixed seed, patched and plain, into MC-Sparse Compare."""
    ui = copy.deepcopy(source)
    loader, shift, sampler = _find(ui, "UNETLoader"), _find(ui, "ModelSamplingSD3"), _find(ui, "KSampler")
    decode, vae = _find(ui, "VAEDecode"), _find(ui, "VAELoader")
    sampler["widgets_values"][1] = "fixed"  # both runs must use the same seed
    sampler["title"] = "KSampler (MC-Sparse)"
    x, y = sampler["pos"]
    shift_b = _add_node(ui, "ModelSamplingSD3", (shift["pos"][0], y + 420), shift["widgets_values"], [("model", "MODEL")],
                        [("MODEL", "MODEL")], size=(210, 60))
    sampler_b = _add_node(ui, "KSampler", (x, y + 520), sampler["widgets_values"],
                          [(i["name"], i["type"]) for i in sampler["inputs"]], [("LATENT", "LATENT")], size=(315, 262))
    sampler_b["title"] = "KSampler (dense, same seed)"
    decode_b = _add_node(ui, "VAEDecode", (decode["pos"][0], y + 520), [], [("samples", "LATENT"), ("vae", "VAE")],
                         [("IMAGE", "IMAGE")], size=(210, 46))
    compare = _add_node(ui, "MCSparseCompare", (decode["pos"][0] + 260, y + 420), ["patched", "dense"],
                        [("image_a", "IMAGE"), ("image_b", "IMAGE")],
                        [("side_by_side", "IMAGE"), ("report", "STRING"), ("psnr", "FLOAT"), ("ssim", "FLOAT")])
    preview = _add_node(ui, "PreviewImage", (decode["pos"][0] + 620, y + 420), [], [("images", "IMAGE")], [],
                        size=(400, 300))
    text = _add_node(ui, "PreviewAny", (decode["pos"][0] + 260, y + 620), [], [("source", "*")], [], size=(340, 200))
    _link(ui, loader, 0, shift_b, 0)
    _link(ui, shift_b, 0, sampler_b, 0)
    by_name = {i["name"]: i.get("link") for i in sampler["inputs"]}
    for slot, name in enumerate(["model", "positive", "negative", "latent_image"]):
        if name == "model":
            continue
        src_id, src_slot = next((lk[1], lk[2]) for lk in ui["links"] if lk[0] == by_name[name])
        _link(ui, next(n for n in ui["nodes"] if n["id"] == src_id), src_slot, sampler_b, slot)
    _link(ui, sampler_b, 0, decode_b, 0)
    _link(ui, vae, 0, decode_b, 1)
    _link(ui, decode, 0, compare, 0)
    _link(ui, decode_b, 0, compare, 1)
    _link(ui, compare, 0, preview, 0)
    _link(ui, compare, 1, text, 0)
    _note(ui, COMPARE_NOTE, (-400, 60))
    return ui


def build_probe_ui(source: dict) -> dict:
    """The patched Wan workflow with MC-Sparse Probe after the patch and its report after the sampler."""
    ui = copy.deepcopy(source)
    patch, shift, sampler = _find(ui, "MCSparsePatch"), _find(ui, "ModelSamplingSD3"), _find(ui, "KSampler")
    probe = _add_node(ui, "MCSparseProbe", (patch["pos"][0] + 380, patch["pos"][1] + 260), PROBE_WIDGETS,
                      [("model", "MODEL")], [("MODEL", "MODEL"), ("probe", PROBE_TYPE)], size=(320, 300))
    report = _add_node(ui, "MCSparseProbeReport", (sampler["pos"][0], sampler["pos"][1] + 320), [],
                       [("probe", PROBE_TYPE), ("samples", "LATENT")], [("plot", "IMAGE"), ("report", "STRING")],
                       size=(480, 320))
    text = _add_node(ui, "PreviewAny", (sampler["pos"][0] + 500, sampler["pos"][1] + 320), [], [("source", "*")], [],
                     size=(480, 320))
    _link(ui, patch, 0, probe, 0)
    _link(ui, probe, 0, shift, 0)
    _link(ui, probe, 1, report, 0)
    _link(ui, sampler, 0, report, 1)
    _link(ui, report, 1, text, 0)
    _note(ui, PROBE_NOTE, (-400, 60))
    return ui


PROBE_TYPE = "MC_SPARSE_PROBE"
FIDELITY_TARGETS = {"wan21_t2v_1.3b_compare": build_compare_ui, "wan21_t2v_1.3b_probe": build_probe_ui}


def build_fidelity() -> None:
    """Write the A/B compare and the probe workflows (UI + API twin) from ``FIDELITY_SOURCE``."""
    source = json.loads((HERE / FIDELITY_SOURCE).read_text(encoding="utf-8"))
    for out, build in FIDELITY_TARGETS.items():
        ui = build(source)
        api = build_api(ui)
        (HERE / f"{out}.json").write_text(json.dumps(ui, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        (HERE / f"{out}_api.json").write_text(json.dumps(api, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"{FIDELITY_SOURCE} -> {out}: {len(api)} API nodes")


def main(only: list[str] | None = None) -> None:
    """Build every target (then the fidelity workflows), or only the templates named in ``only`` (file names as
    in ``TARGETS``; the fidelity workflows are then left alone); ``--fidelity-only``: the fidelity workflows."""
    if "--fidelity-only" in sys.argv[1:]:
        build_fidelity()
        return
    tdir = _templates_dir()
    for template_name, out in TARGETS.items():
        if only and template_name not in only:
            continue
        template = json.loads((tdir / template_name).read_text(encoding="utf-8"))
        ui = build_ui(template)
        try:
            api = build_api(ui)
        except KeyError as err:
            print(f"{template_name}: API twin not built ({err}); UI workflow written")
            (HERE / f"{out}_mc_sparse.json").write_text(json.dumps(ui, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            continue
        (HERE / f"{out}_mc_sparse.json").write_text(json.dumps(ui, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        (HERE / f"{out}_mc_sparse_api.json").write_text(json.dumps(api, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"{template_name} -> {out}: {sum(1 for n in api.values() if n['class_type'] == 'MCSparsePatch')} patch node(s), {len(api)} API nodes")
    if not only:
        build_fidelity()


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if not a.startswith("--")] or None)
