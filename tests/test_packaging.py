"""Packaging contracts: the README's commands are what CI runs, the pack loads as ComfyUI loads it."""

import re
import sys
from pathlib import Path

import comfyui_mc_sparse_pack as pack
import pytest
from comfyui_mc_sparse_pack.comfyui_mc_sparse import engine  # noqa: F401  (imports kernels the way the pack does)

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands():
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [line.strip() for block in blocks[:2] for line in block.strip().splitlines()]


def test_ci_runs_the_readme_commands_verbatim():
    """`.ci/run` runs the README's set-up + main-job command and its test command, unchanged."""
    ci = (ROOT / ".ci" / "run").read_text()
    commands = _readme_commands()
    assert len(commands) == 2 and all(c in ci for c in commands)


def test_pack_loads_outside_comfyui_without_registering_nodes():
    """Outside ComfyUI the root package imports and exports no nodes (V3 only: no NODE_CLASS_MAPPINGS)."""
    assert not hasattr(pack, "NODE_CLASS_MAPPINGS")
    assert "comfy" not in sys.modules or hasattr(sys.modules["comfy"], "__file__")


def test_kernels_is_never_imported_as_a_top_level_module():
    """Loading the pack imports `kernels` only inside the pack (Hugging Face's `kernels` is never shadowed)."""
    assert pack.__name__ + ".kernels" in sys.modules
    top = sys.modules.get("kernels")
    assert top is None or Path(getattr(top, "__file__", "") or "").parent != ROOT / "kernels"


def test_pyproject_has_registry_metadata_and_requirements_no_torch():
    """Comfy Registry fields are present; torch is never a runtime requirement (ComfyUI provides it)."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+ (the README's quick start takes 3.10+)")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["name"] and re.fullmatch(r"\d+\.\d+\.\d+", meta["project"]["version"])
    assert meta["tool"]["comfy"]["PublisherId"] and meta["project"]["urls"]["Repository"]
    reqs = [ln.split("#")[0].strip() for ln in (ROOT / "requirements.txt").read_text().splitlines()]
    assert not any(r.lower().startswith("torch") for r in reqs if r)


def test_architecture_doc_names_every_module():
    """docs/architecture.md's tables name every module of ``comfyui_mc_sparse/`` (algorithm, tools, adapter) and every
    backend folder of ``kernels/`` (mutation: a module added without its row, as fidelity_nodes.py and the adapter's
    probe.py were until session 7)."""
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    modules = [p for p in sorted((ROOT / "comfyui_mc_sparse").rglob("*.py")) if p.name != "__init__.py"]
    same_name = {p.name: sum(q.name == p.name for q in modules) for p in modules}  # probe.py: tools/ and adapter/
    missing = [str(p.relative_to(ROOT)) for p in modules if str(p.relative_to(ROOT)) not in doc
               and doc.count(f"`{p.name}`") + doc.count(f"`{p.stem}`") < same_name[p.name]]
    missing += [f"kernels/{p.name}/" for p in sorted((ROOT / "kernels").iterdir())
                if p.is_dir() and (p / "__init__.py").is_file() and f"`{p.name}/`" not in doc]
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_readme_cache_sizes_are_the_estimates():
    """The README's residual-precision row gives the cache sizes the node's own estimate computes (Wan2.1-14B, 81
    frames, CFG, preset quality; ``settings.cache_size_note``, the tooltip's figures). Mutation: an encoding or
    estimate change that moves the sizes without the README."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.settings import cache_size_note

    note = cache_size_note()
    m = re.search(r"720p: bf16 (\S+) / fp8 (\S+) / int4 (\S+) GiB; 480p: bf16 (\S+) / fp8 (\S+) / int4 (\S+) GiB", note)
    assert m, note
    want = f"720p {m[1]} / {m[2]} / {m[3]} GiB, 480p {m[4]} / {m[5]} / {m[6]} GiB (bf16 / fp8 / int4)"
    assert want in (ROOT / "README.md").read_text(encoding="utf-8"), (want, note)


def test_architecture_doc_lists_every_environment_switch():
    """Every ``MC_SPARSE_*`` environment variable the pack or the benchmarks' helpers read has a row in
    docs/architecture.md's "Environment switches" table, and every row names one that is read (mutation: a switch
    added without its row, as MC_SPARSE_CUTEDSL_RES_OPTIONS, _STAGES and MC_SPARSE_PASS2_UNIT_QF were)."""
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").split("## Environment switches", 1)[-1]
    rows = set(re.findall(r"^\| `(MC_SPARSE_[A-Z0-9_]+)` \|", doc, flags=re.M))
    sources = [*(ROOT / "comfyui_mc_sparse").rglob("*.py"), *(ROOT / "kernels").rglob("*.py"),
               ROOT / "tests" / "_scoreboard.py", ROOT / "tests" / "_timing.py"]
    names = {n for p in sources for n in re.findall(r"[\"'](MC_SPARSE_[A-Z0-9_]+)[\"']", p.read_text(encoding="utf-8"))}
    names -= {"MC_SPARSE_PROBE"}  # a ComfyUI socket type name (adapter/probe.py), no environment variable
    assert names == rows, f"not in the table: {sorted(names - rows)}; not read anywhere: {sorted(rows - names)}"


def test_architecture_doc_switch_defaults_match_the_code():
    """Each default the "Environment switches" table states as a module constant (``(`module.NAME`: on)`` / off)
    is that constant's truth value in the module's source (read with ast: the CuTeDSL modules need no import).
    Mutation: the table said ``pass2_sm90.UNIT_QF: off`` for a session after UNIT_QF became True."""
    import ast

    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").split("## Environment switches", 1)[-1]
    claims = re.findall(r"\(`(\w+)\.([A-Z_]+)`: (on|off)\b", doc)
    assert len(claims) >= 3, claims
    for module, name, word in claims:
        paths = [p for d in ("kernels", "comfyui_mc_sparse") for p in (ROOT / d).rglob(f"{module}.py")]
        assert len(paths) == 1, (module, paths)
        values = [ast.literal_eval(node.value) for node in ast.parse(paths[0].read_text(encoding="utf-8")).body
                  if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets)]
        assert len(values) == 1, (module, name, values)
        assert bool(values[0]) == (word == "on"), f"{module}.{name} = {values[0]!r}, the table says {word}"



def test_readme_inputs_table_gives_the_nodes_defaults():
    """README's "Inputs" table lists every input of the MC-Sparse Patch node (but ``model``) with the node's default
    (read from ``adapter/nodes.py``'s schema with ast: no ComfyUI needed; ``BOX_DEFAULTS[...]`` resolved from
    ``adapter.settings``). Mutation: a node default changed without the README (density 0.2 -> 0.25)."""
    import ast

    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import settings

    tree = ast.parse((ROOT / "comfyui_mc_sparse" / "adapter" / "nodes.py").read_text(encoding="utf-8"))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MCSparsePatch")
    defaults = {}
    for call in ast.walk(node):
        if isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.Constant):
            kw = {k.arg: k.value for k in call.keywords}
            if "default" in kw:
                d = kw["default"]
                if isinstance(d, ast.Subscript) and ast.unparse(d.value) == "BOX_DEFAULTS":
                    value = settings.BOX_DEFAULTS[ast.literal_eval(d.slice)]
                else:
                    value = ast.literal_eval(d)
                defaults[call.args[0].value] = ("on" if value else "off") if isinstance(value, bool) else value
    table = (ROOT / "README.md").read_text(encoding="utf-8").split("### Inputs", 1)[1].split("\n### ", 1)[0]
    rows = dict(re.findall(r"^\| ([a-z_]+) \| ([^|]+?) \|", table, flags=re.M))
    rows.pop("input", None)  # the header
    assert set(rows) == set(defaults), (sorted(rows), sorted(defaults))
    for name, value in defaults.items():
        want = value if isinstance(value, str) else f"{value:g}"
        assert rows[name] == want, (name, rows[name], value)
