"""Every shipped workflow (UI and API) checked against the node definitions, without ComfyUI (CI).

``tests/data/comfyui_node_defs.json`` holds the definitions of every node type the workflows use, dumped from
the Oct-2025 ComfyUI snapshot by ``tools.headless.node_definitions`` (inputs in declaration order with type,
required flag and combo options; output types). The integration test
``tests/integration/test_comfyui_workflows.py::test_node_definitions_snapshot_is_current`` regenerates it from
a real ComfyUI and fails when it drifts. Checks:

* API twins: node types exist; every input is declared; required inputs are present; literals have the
  declared type (combo values among the options, except machine-specific file lists); links point at
  existing nodes whose output type is the declared input type.
* UI workflows (subgraphs included): node types exist (frontend-only notes and the newer-than-snapshot
  nodes in ``NEWER_NODES`` excepted, with the reason); every link joins an output and an input of the same
  type as declared; our patch node's widgets are the frozen inputs in order and valid settings.
"""

import json
from pathlib import Path

import pytest
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import settings

ROOT = Path(__file__).resolve().parent.parent
DEFS = json.loads((ROOT / "tests" / "data" / "comfyui_node_defs.json").read_text(encoding="utf-8"))
# ComfyUI v0.33.0's definitions of the core nodes the MiniMax-H3 workflow uses (dumped from the 2026 snapshot; the
# integration test test_node_definitions_snapshot_is_current checks it there). The pack's own node is recorded once,
# in DEFS, and must be the same in both ComfyUIs.
DEFS_2026 = json.loads((ROOT / "tests" / "data" / "comfyui_node_defs_v0.33.0.json").read_text(encoding="utf-8"))
OWN_NODES = ("MCSparsePatch",)


def _defs_for(path: Path) -> dict:
    """The node definitions of the ComfyUI a workflow targets: v0.33.0 for MiniMax-H3 (its nodes are newer)."""
    if path.name.startswith("minimax_h3"):
        return {**DEFS_2026, **{k: DEFS[k] for k in OWN_NODES}}
    return DEFS
FROZEN = ["preset", "density", "dense_warmup", "warmup_layers", "anchor_steps", "query_tile", "cache_placement",
          "backend", "min_tokens", "verbose", "residual_precision", "memory_headroom_gib"]
FRONTEND_ONLY = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}
NEWER_NODES = {  # in the newer templates (comfyui-workflow-templates-json 0.1.123) but not the Oct-2025 core
    "ComfySwitchNode": "Wan2.2 template's turbo toggle; resolved to its branch in the API twin",
    "ComfyMathExpression": "Wan2.2 template's frames = floor(duration * fps) + 1; a literal in the API twin",
}
PY_TYPES = {"INT": (int,), "FLOAT": (int, float), "STRING": (str,), "BOOLEAN": (bool,), "COMBO": (str, int, float),
            "COMFY_DYNAMICCOMBO_V3": (str,)}  # v0.33.0 V3 dynamic combo (SaveVideo.codec): a string literal
WILDCARDS = {"*", "COMFY_MATCHTYPE_V3"}  # v0.33.0 V3 match-type (ComfySwitchNode): takes the linked type
API = sorted((ROOT / "workflows").glob("*_api.json"))
UI = sorted(p for p in (ROOT / "workflows").glob("*.json") if not p.name.endswith("_api.json"))


def test_every_workflow_has_an_api_twin():
    """Each UI workflow has its API twin (Wan2.2 14B two-stage and Hunyuan3D 2.1 included)."""
    assert len(UI) >= 6
    for ui in UI:
        assert ui.with_name(ui.stem + "_api.json").is_file(), ui.name


def test_patch_node_definition_matches_settings():
    """The recorded MCSparsePatch definition is the frozen input list with the settings' combo options."""
    d = DEFS["MCSparsePatch"]
    assert list(d["inputs"]) == ["model", *FROZEN] and d["outputs"] == ["MODEL"]
    assert d["inputs"]["preset"]["options"] == list(settings.PRESET_NAMES)
    assert d["inputs"]["backend"]["options"] == list(settings.BACKENDS)
    assert d["inputs"]["cache_placement"]["options"] == list(settings.CACHE_PLACEMENTS)


FIDELITY_FROZEN = {  # node id -> (inputs in order, outputs): saved workflows depend on them
    "MCSparseProbe": (["model", "density", "query_tile", "probe_step", "reuse_step", "blocks", "heads", "per_head",
                       "oracle_queries", "capture_blocks"], ["MODEL", "MC_SPARSE_PROBE"]),
    "MCSparseProbeReport": (["probe", "samples"], ["IMAGE", "STRING"]),
    "MCSparseCompare": (["image_a", "image_b", "label_a", "label_b"], ["IMAGE", "STRING", "FLOAT", "FLOAT"]),
}


def test_fidelity_node_definitions_are_frozen_and_shipped():
    """The recorded Probe / Probe Report / Compare definitions are the frozen ones; the A/B and probe workflows ship
    (UI + API) and use them, and the probe workflow's widgets are valid ProbeSpec values."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.probe import ProbeSpec

    for node_id, (inputs, outputs) in FIDELITY_FROZEN.items():
        assert list(DEFS[node_id]["inputs"]) == inputs and DEFS[node_id]["outputs"] == outputs, node_id
    assert DEFS["MCSparseProbe"]["inputs"]["query_tile"]["options"] == ["128", "64"]
    used = {}
    for name in ("wan21_t2v_1.3b_compare_api.json", "wan21_t2v_1.3b_probe_api.json"):
        prompt = json.loads((ROOT / "workflows" / name).read_text(encoding="utf-8"))
        used[name] = {n["class_type"] for n in prompt.values()}
        for node in prompt.values():
            if node["class_type"] == "MCSparseProbe":
                values = {k: v for k, v in node["inputs"].items() if k != "model"}
                ProbeSpec(**{**values, "query_tile": int(values["query_tile"])})
    assert {"MCSparseCompare", "MCSparsePatch"} <= used["wan21_t2v_1.3b_compare_api.json"]
    assert {"MCSparseProbe", "MCSparseProbeReport", "MCSparsePatch"} <= used["wan21_t2v_1.3b_probe_api.json"]
    samplers = [n for n in json.loads((ROOT / "workflows" / "wan21_t2v_1.3b_compare_api.json").read_text()).values()
                if n["class_type"] == "KSampler"]
    assert len(samplers) == 2 and samplers[0]["inputs"]["seed"] == samplers[1]["inputs"]["seed"]


@pytest.mark.parametrize("path", API, ids=lambda p: p.name)
def test_api_workflow_matches_node_definitions(path):
    prompt = json.loads(path.read_text(encoding="utf-8"))
    defs = _defs_for(path)
    for nid, node in prompt.items():
        ct = node["class_type"]
        d = defs.get(ct)
        assert d is not None, f"{path.name} node {nid}: unknown node type {ct}"
        declared = d["inputs"]
        for name, value in node["inputs"].items():
            assert name in declared, f"{path.name} node {nid} ({ct}): undeclared input {name!r}"
            want = declared[name]
            if isinstance(value, list):
                src, slot = value
                assert src in prompt, f"{path.name} node {nid}: link to missing node {src}"
                src_type = defs[prompt[src]["class_type"]]["outputs"][slot]
                assert src_type == want["type"] or WILDCARDS & {src_type, want["type"]}, (
                    f"{path.name} node {nid} ({ct}).{name}: {want['type']} input fed by {src_type}")
            else:
                ok = PY_TYPES.get(want["type"])
                assert ok is not None, f"{path.name} node {nid} ({ct}).{name}: literal for a {want['type']} input"
                assert isinstance(value, ok) and not (want["type"] in ("INT", "FLOAT") and isinstance(value, bool)), (
                    f"{path.name} node {nid} ({ct}).{name}: {value!r} is not {want['type']}")
                if want["options"] is not None:
                    assert value in want["options"], f"{path.name} node {nid} ({ct}).{name}: {value!r} not an option"
        missing = [n for n, w in declared.items() if w["required"] and n not in node["inputs"]]
        assert not missing, f"{path.name} node {nid} ({ct}): missing required inputs {missing}"
        if ct == "MCSparsePatch":
            assert [k for k in node["inputs"] if k != "model"] == FROZEN
            settings.build_settings(**{**{k: node["inputs"][k] for k in FROZEN},
                                       "query_tile": int(node["inputs"]["query_tile"])})


def _graphs(ui):
    return [ui, *ui.get("definitions", {}).get("subgraphs", [])]


def _links(graph):
    for lk in graph.get("links", []):
        if isinstance(lk, dict):
            yield lk["id"], lk["origin_id"], lk["origin_slot"], lk["target_id"], lk["target_slot"], lk["type"]
        else:
            yield tuple(lk)


@pytest.mark.parametrize("path", UI, ids=lambda p: p.name)
def test_ui_workflow_matches_node_definitions(path):
    ui = json.loads(path.read_text(encoding="utf-8"))
    DEFS = _defs_for(path)  # noqa: N806  (the table of this workflow's ComfyUI)
    subgraph_ids = {sg["id"] for sg in ui.get("definitions", {}).get("subgraphs", [])}
    patches = 0
    for graph in _graphs(ui):
        nodes = {n["id"]: n for n in graph["nodes"]}
        for n in graph["nodes"]:
            t = n["type"]
            if t in FRONTEND_ONLY or t in subgraph_ids or t in NEWER_NODES:
                continue
            assert DEFS.get(t) is not None, f"{path.name} node {n['id']}: unknown node type {t}"
            declared = DEFS[t]["inputs"]
            for inp in n.get("inputs", []):
                if inp.get("link") is None:
                    continue
                assert inp["name"] in declared or (t in ("ModelSamplingAuraFlow",) and inp["name"] == "sampling"), (
                    f"{path.name} node {n['id']} ({t}): undeclared input {inp['name']!r}")
            if t == "MCSparsePatch":
                patches += 1
                vals = n["widgets_values"]
                assert len(vals) == len(FROZEN)
                settings.build_settings(**{**dict(zip(FROZEN, vals)), "query_tile": int(vals[5])})
        for _lid, o, os_, tgt, ts, ltype in _links(graph):
            if o < 0 or tgt < 0:  # subgraph input / output pseudo-nodes
                continue
            src, dst = nodes[o], nodes[tgt]
            if src["type"] in DEFS and DEFS[src["type"]] is not None and src["type"] not in subgraph_ids:
                out_type = DEFS[src["type"]]["outputs"][os_]
                assert out_type == ltype or WILDCARDS & {out_type, ltype} or src["type"].startswith("Primitive"), (
                    f"{path.name}: link from {src['type']}[{os_}] ({out_type}) typed {ltype}")
            if dst["type"] in DEFS and DEFS[dst["type"]] is not None:
                name = dst["inputs"][ts]["name"]
                if name in DEFS[dst["type"]]["inputs"]:
                    want = DEFS[dst["type"]]["inputs"][name]["type"]
                    assert want == ltype or WILDCARDS & {want, ltype} or want in PY_TYPES, (
                        f"{path.name}: {dst['type']}.{name} ({want}) fed a {ltype}")
    assert patches >= 1, f"{path.name}: no MCSparsePatch node"


@pytest.mark.parametrize("path", UI, ids=lambda p: p.name)
def test_ui_and_api_twins_set_the_pack_nodes_alike(path):
    """A UI workflow and its API twin give the pack's nodes (MC-Sparse Patch, MC-Sparse Probe) the same settings, in
    the same order of appearance: a user gets the same run from either file. Mutation: one twin's preset, density
    or probe widget edited alone (both files still valid on their own)."""
    ui = json.loads(path.read_text(encoding="utf-8"))
    api = json.loads(path.with_name(path.stem + "_api.json").read_text(encoding="utf-8"))
    for node_type, skip in (("MCSparsePatch", "model"), ("MCSparseProbe", "model")):
        ui_values = [n["widgets_values"] for graph in _graphs(ui) for n in graph["nodes"] if n["type"] == node_type]
        api_values = [[v for k, v in n["inputs"].items() if k != skip] for n in api.values()
                      if n["class_type"] == node_type]
        assert ui_values == api_values, f"{path.name}: {node_type} widgets {ui_values} vs the API twin's {api_values}"


SAMPLERS = {"KSampler", "KSamplerAdvanced", "CFGGuider", "BasicGuider", "DualCFGGuider"}
LOADERS = {"UNETLoader", "ImageOnlyCheckpointLoader", "CheckpointLoaderSimple", "LoraLoaderModelOnly", "LoraLoader"}


@pytest.mark.parametrize("path", API, ids=lambda p: p.name)
def test_api_samplers_get_the_patched_model(path):
    """Every sampler / guider's model is patched: its MODEL chain back to the loader passes one MCSparsePatch, placed
    right after the loader / LoRA and before ModelSampling* (README, "Where to put the node"); the A/B workflow's
    reference sampler alone runs the plain model. Mutation: a sampler fed from ModelSamplingSD3 on the loader (the
    patch left dangling: a valid prompt that never runs MC-Sparse), or the patch after ModelSamplingSD3."""
    prompt = json.loads(path.read_text(encoding="utf-8"))
    plain = 0
    for nid, node in prompt.items():
        if node["class_type"] not in SAMPLERS:
            continue
        chain, cur = [], node["inputs"]["model"]
        while isinstance(cur, list):
            src = prompt[cur[0]]
            chain.append(src["class_type"])
            cur = src["inputs"].get("model")
        assert chain and chain[-1] in LOADERS, f"{path.name} sampler {nid}: model chain {chain} ends at no loader"
        patches = [i for i, t in enumerate(chain) if t == "MCSparsePatch"]
        if not patches:
            plain += 1
            continue
        assert len(patches) == 1, f"{path.name} sampler {nid}: {len(patches)} patch nodes chained: {chain}"
        after = chain[patches[0] + 1:]  # upstream of the patch
        assert all(t in LOADERS for t in after), f"{path.name} sampler {nid}: patch after {after}"
    assert plain == (1 if path.name.startswith("wan21_t2v_1.3b_compare") else 0), f"{path.name}: {plain} unpatched"


@pytest.mark.parametrize("path", UI, ids=lambda p: p.name)
def test_ui_links_agree_with_the_nodes_and_the_patch_is_wired(path):
    """The UI graph's link table and the nodes' own link fields agree (the frontend reads both: a link the node does
    not list is dropped on load), and every MC-Sparse Patch node is active (mode 0, not bypassed or muted) with its
    model input linked and its MODEL output used. Mutation: a patch node set to bypass (mode 4), its output links
    cleared, or a link record whose target input names another link."""
    ui = json.loads(path.read_text(encoding="utf-8"))
    for graph in _graphs(ui):
        nodes = {n["id"]: n for n in graph["nodes"]}
        links = {lk[0]: lk for lk in _links(graph)}
        for lid, o, os_, tgt, ts, _ltype in links.values():
            if tgt >= 0:
                assert nodes[tgt]["inputs"][ts].get("link") == lid, f"{path.name}: link {lid} not on its target input"
            if o >= 0:
                assert lid in (nodes[o]["outputs"][os_].get("links") or []), f"{path.name}: link {lid} not on its origin"
        for n in graph["nodes"]:
            for inp in n.get("inputs", []):
                assert inp.get("link") is None or inp["link"] in links, f"{path.name} node {n['id']}: dangling input"
            for out in n.get("outputs", []):
                assert all(lid in links for lid in out.get("links") or []), f"{path.name} node {n['id']}: dangling"
            if n["type"] == "MCSparsePatch":
                assert n.get("mode", 0) == 0, f"{path.name} patch node {n['id']}: mode {n.get('mode')} (inactive)"
                assert [i.get("link") is not None for i in n["inputs"] if i["name"] == "model"] == [True], n["id"]
                assert any(out.get("links") for out in n["outputs"] if out["type"] == "MODEL"), n["id"]


def test_headless_models_dir_is_removed_at_exit(monkeypatch):
    """The per-process tiny-checkpoint folder goes when the process exits (integration runs left ~0.5 GB each)."""
    import atexit
    import sys
    import types

    from comfyui_mc_sparse_pack.comfyui_mc_sparse.tools import headless

    added, at_exit = [], []
    monkeypatch.setitem(sys.modules, "folder_paths",
                        types.SimpleNamespace(add_model_folder_path=lambda *a, **k: added.append(a)))
    monkeypatch.setattr(headless, "_state", {})
    monkeypatch.setattr(atexit, "register", lambda fn, *a, **k: at_exit.append((fn, a, k)))
    path = headless.models_dir()
    (path / "mc_sparse_tiny_x.safetensors").write_bytes(b"x" * 16)
    assert path.is_dir() and {a[0] for a in added} == {"diffusion_models", "loras"}
    for fn, a, k in at_exit:
        fn(*a, **k)
    assert not path.exists()
