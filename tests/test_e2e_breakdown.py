"""The whole-run breakdown of ``tests/bench_comfyui_speedup.py`` (per step kind against the schedule's ideal) and the
run summary's line naming the Triton backend's sparse kernel per call shape (``engine.triton_sparse_choices``)."""

import importlib.util
import math
import sys
import types
from pathlib import Path

import pytest

from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.comfyui_mc_sparse.config import MCSparseConfig
from comfyui_mc_sparse_pack.comfyui_mc_sparse.engine import MCSparseRunner, triton_sparse_choices
from comfyui_mc_sparse_pack.kernels import registry


def _bench():
    path = Path(__file__).resolve().parent / "bench_comfyui_speedup.py"
    spec = importlib.util.spec_from_file_location("bench_comfyui_speedup_t", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Timer:
    def __init__(self, ms):
        self.ms = ms

    def times(self, kind):
        return {(12, 4096, 128): list(self.ms[kind])}


def _records():
    """Unpatched 6 steps; patched D D A R R R (3 blocks, block 0 dense), CFG batch 2."""
    dense_rec = {"step_s": [1.5, 1.2, 1.21, 1.19, 1.2, 1.2], "evals": []}
    kinds = ["dense", "dense", "anchor", "reuse", "reuse", "reuse"]
    walls = [1.21, 1.2, 1.9, 0.8, 0.7, 0.72]
    evals = []
    for kind in kinds:
        calls = {"anchor": 4 if kind == "anchor" else 0, "reuse": 4 if kind == "reuse" else 0}
        evals.append({"calls": calls, "eval_s": 0.0, "forward_batches": [2], "attn_s": None, "attn_calls": None})
    patched_rec = {"step_s": walls, "evals": evals}
    timer = _Timer({"dense": [10.0] * 9, "anchor": [100.0, 110.0, 90.0, 100.0], "reuse": [4.0] * 6})
    runner = types.SimpleNamespace(config=types.SimpleNamespace(density=0.15, warmup_layers=1), timer=timer)
    return dense_rec, patched_rec, types.SimpleNamespace(runner=runner)


def test_whole_breakdown_per_kind_against_the_ideal():
    bench = _bench()
    dense_rec, patched_rec, run = _records()
    b = bench.whole_breakdown(dense_rec, patched_rec, run, dense={"self_attn_s": 0.6}, layers=3,
                              totals={"dense_s": 7.6, "patched_s": 6.5})
    D = 1.2  # median of the unpatched steps after the first
    A, N, f, s = 0.6, 0.6, 2 / 3, 0.15
    k = b["kinds"]
    assert (k["dense"]["steps"], k["anchor"]["steps"], k["reuse"]["steps"]) == (2, 1, 3)
    assert k["reuse"]["total_s"] == pytest.approx(2.22)
    ideal = b["ideal"]["per_step"]
    assert ideal["dense"] == pytest.approx(D)
    assert ideal["anchor"] == pytest.approx(D + A * f * (0.5 + s))
    assert ideal["reuse"] == pytest.approx(N + A * (1 - f) + A * f * s)
    # reuse calls are timed per batch item: 6 calls x 4 ms x batch 2 over 3 reuse steps
    assert b["reuse_sparse_s_per_step"] == pytest.approx(6 * 4.0 * 2 / 1000 / 3)
    # anchor calls run per conditioning chunk (batch 1): their sum is the step's anchor time
    assert b["anchor_calls_s_per_step"] == pytest.approx(0.4)
    at = b["ideal"]["at_measured_kernels_per_step"]
    assert at["reuse"] == pytest.approx(N + A * (1 - f) + 0.016)
    assert at["anchor"] == pytest.approx(D + 0.4 - A * f)
    assert k["reuse"]["pack_overhead_s"] == pytest.approx(2.22 - 3 * at["reuse"])
    assert k["anchor"]["loss_vs_ideal_s"] == pytest.approx(1.9 - ideal["anchor"])
    # dense steps against the unpatched run's same (first, cold) steps; the whole against the unpatched steps' sum
    t_ideal = (1.5 + 1.2) + ideal["anchor"] + 3 * ideal["reuse"]
    assert k["dense"]["loss_vs_ideal_s"] == pytest.approx(1.21 + 1.2 - (1.5 + 1.2))
    assert b["ideal"]["speedup_ideal"] == pytest.approx(sum(dense_rec["step_s"]) / t_ideal)
    assert b["ideal"]["speedup_steps"] == pytest.approx(sum(dense_rec["step_s"]) / sum(patched_rec["step_s"]))
    assert b["outside_steps_s"]["patched"] == pytest.approx(6.5 - sum(patched_rec["step_s"]))
    assert b["attention"]["dense"]["total_s"] == pytest.approx(9 * 10.0 * 2 / 1000)
    assert any(line.startswith("reuse: 3 x") for line in b["lines"])
    limits = b["limits_s"]
    block0 = next(v for k, v in limits.items() if k.startswith("block 0"))
    assert block0 == pytest.approx(3 * (A * (1 - f) - 0.016 * (1 - f) / f))
    kernel = next(v for k, v in limits.items() if k.startswith("sparse kernel"))
    assert kernel == pytest.approx(3 * (0.016 - A * f * s))
    # on the spans' clock: A from the run's event-timed dense calls (10 ms per item x batch 2 x 3 blocks)
    ev = b["event_basis"]
    a_ev = 0.06
    assert ev["A_s"] == pytest.approx(a_ev)
    assert ev["reuse_at_kernels_s"] == pytest.approx(D - a_ev + a_ev * (1 - f) + 0.016)
    assert ev["reuse_pack_overhead_s_per_step"] == pytest.approx(0.72 - ev["reuse_at_kernels_s"])
    assert ev["anchor_at_kernels_s"] == pytest.approx(D + 0.4 - a_ev * f)
    assert ev["anchor_pack_overhead_s"] == pytest.approx(1.9 - ev["anchor_at_kernels_s"])


def test_whole_breakdown_without_the_attention_timing_has_no_ideal():
    bench = _bench()
    dense_rec, patched_rec, run = _records()
    b = bench.whole_breakdown(dense_rec, patched_rec, run, dense=None, layers=3)
    assert "ideal" not in b and b["kinds"]["reuse"]["steps"] == 3
    assert math.isfinite(b["kinds"]["anchor"]["total_s"])


def _fake_dispatch(monkeypatch, mode="auto", choices=None, times=None):
    fake = types.SimpleNamespace(gluon_mode=lambda: mode, choices=choices or {}, _times=times or {},
                                 GLUON_KEY=("triton.gluon_sm90", "sparse_attention"))
    monkeypatch.setitem(sys.modules, f"{kernels.__name__}.triton.sparse_dispatch", fake)
    return fake


def _runner(shapes):
    runner = MCSparseRunner(MCSparseConfig(density=0.15, warmup_steps=1, anchor_steps=(1,)))
    runner.sparse_shapes.update(shapes)
    return runner


def test_summary_names_the_sparse_kernel_per_shape(monkeypatch):
    reuse = (2, 12, 32760, 128)
    anchor = (1, 12, 32760, 128)
    key_reuse = ("cuda:0", "bf16", reuse, 32760, (256, 4992), 32760, "plain", False)
    key_anchor = ("cuda:0", "bf16", anchor, 32760, (256, 4992), 32760, None, False)
    other = ("cuda:0", "bf16", (2, 40, 75600, 128), 75600, (590, 11392), 75600, "plain", False)
    _fake_dispatch(monkeypatch, choices={key_reuse: "pingpong", key_anchor: "triton", other: "plain"},
                   times={key_reuse: {"plain": 3.1, "pingpong": 3.0, "triton": 3.5},
                          key_anchor: {"plain": 2.0, "triton": 1.9}})
    runner = _runner([reuse, anchor])
    lines = triton_sparse_choices(runner)
    assert lines == ["[1, 12, 32760, 128] triton (plain 2.000, triton 1.900 ms)",
                     "[2, 12, 32760, 128], residual plain gluon pingpong (plain 3.100, pingpong 3.000, triton 3.500 ms)"]
    runner.kernels.choices["sparse_attention"] = registry.Choice("triton", "auto")
    summary = runner.summary()
    assert "sparse kernel (triton backend) per call shape: [1, 12, 32760, 128] triton" in summary
    assert "75600" not in summary  # another run's shape is not this run's
    runner.kernels.choices["sparse_attention"] = registry.Choice("cutedsl", "auto")
    assert "sparse kernel (triton backend)" not in runner.summary()


def test_summary_sparse_kernel_forced_failed_or_refused(monkeypatch):
    shape = (2, 12, 32760, 128)
    _fake_dispatch(monkeypatch, mode="on")
    assert triton_sparse_choices(_runner([shape])) == ["[2, 12, 32760, 128] gluon (forced: MC_SPARSE_GLUON)"]
    _fake_dispatch(monkeypatch, mode="auto")
    assert triton_sparse_choices(_runner([shape])) == [
        "[2, 12, 32760, 128] triton (Gluon not timed: refused or not sm_90)"]
    runner = _runner([shape])
    runner.kernels.failures[("triton.gluon_sm90", "sparse_attention")] = "RuntimeError: boom"
    assert triton_sparse_choices(runner) == ["[2, 12, 32760, 128] triton (the Gluon kernel failed in this run)"]
    monkeypatch.delitem(sys.modules, f"{kernels.__name__}.triton.sparse_dispatch")
    assert triton_sparse_choices(_runner([shape])) == []


def test_run_report_never_imports_comfyuis_server(monkeypatch):
    """The end-of-run progress text uses ComfyUI's server only when it is already loaded (a running ComfyUI): no import
    of ``server`` (its whole node stack) at the end of a sampler call; with it loaded, the headline goes to the node."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle

    monkeypatch.delitem(sys.modules, "server", raising=False)
    assert lifecycle.running_server() == (None, None)
    assert "server" not in sys.modules
    sent = []
    instance = types.SimpleNamespace(send_progress_text=lambda text, node: sent.append((text, node)))
    monkeypatch.setitem(sys.modules, "server", types.SimpleNamespace(PromptServer=types.SimpleNamespace(instance=instance)))
    monkeypatch.setitem(sys.modules, "comfy_execution.utils",
                        types.SimpleNamespace(get_executing_context=lambda: types.SimpleNamespace(node_id="7")))
    run = types.SimpleNamespace(summary=lambda: "MC-Sparse: headline\n  detail", interrupted_by=None,
                                counts=lambda: {"sparse": 1, "anchor": 1, "dense": 0})
    lifecycle._report(run)
    assert sent == [("MC-Sparse: headline", "7")]


def _report(kernels_arg: str, whole_ops: dict) -> dict:
    x = {"speedup": 1.6, "anchor_step_s": 36.0, "dense_step_s": 24.0, "method": "extrapolated"}
    runs = [{"apply_kwargs": {"preset": p}, "extrapolation": dict(x), "run_kernels": {"line": "l"}}
            for p in ("quality", "fast")]
    whole = {"speedup": 1.55, "steps": 50, "dense_s": 60.0, "patched_s": 38.7,
             "run_kernels": {"ops": whole_ops, "line": "l"}}
    return {"args": {"kernels": kernels_arg, "cfg": 5.0, "sampler": "euler", "scheduler": "simple"},
            "configs": [{"model": "wan14b", "res": "720p", "runs": runs},
                        {"model": "wan1.3b", "res": "480p", "runs": [], "whole": whole}]}


def test_scoreboard_keys_of_a_triton_only_run_carry_the_suffix():
    """TEAM.md item 6: --kernels triton-only writes the e2e and anchor keys + '_triton_only' (never the plain keys,
    which hold the Hopper-install figures); the 1.3B whole-run key is Triton-only by definition (no suffix), and an
    installed run that ran a cutedsl / flash_attn4 op does not write it."""
    bench = _bench()
    triton = {"sparse_attention": "triton", "dense_attention": "cuda_sdpa"}
    keys = set(bench.scoreboard_entries(_report("triton-only", triton), command="c", commit="h", gpu=None))
    assert keys == {"e2e_wan14b_720p_quality_speedup_triton_only", "e2e_wan14b_720p_fast_speedup_triton_only",
                    "anchor_over_dense_step_wan14b_720p_triton_only", "e2e_wan13b_480p_fast_speedup_whole_run"}
    hopper = {"sparse_attention": "cutedsl", "dense_attention": "flash_attn4"}
    keys = set(bench.scoreboard_entries(_report("installed", hopper), command="c", commit="h", gpu=None))
    assert keys == {"e2e_wan14b_720p_quality_speedup", "e2e_wan14b_720p_fast_speedup",
                    "anchor_over_dense_step_wan14b_720p"}
    keys = set(bench.scoreboard_entries(_report("installed", triton), command="c", commit="h", gpu=None))
    assert "e2e_wan13b_480p_fast_speedup_whole_run" in keys


def test_presets_option_reduces_a_plan_to_those_presets():
    bench = _bench()
    plan = bench.only_presets([dict(c) for c in bench.H720], ["fast"])
    assert plan == [{"model": "wan14b", "res": "720p", "densities": [], "presets": ["fast"]}]
    assert bench.H720[0]["presets"] == ["quality", "fast"] and bench.H720[0]["peer"]  # the plan itself unchanged


def test_trace_summary_busy_idle_gaps_and_host_syncs():
    """--profile-reuse's reading of a Chrome trace: the union of every stream's GPU work (overlap counted once), the
    idle gaps with the kernels around them, per-stream and per-kernel totals, host syncs and the dispatch spans."""
    bench = _bench()
    ev = [  # compute stream 7: gemm 0-100, sparse 110-200; side stream 9: decode 150-230 (overlaps); gemm 300-400
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 100, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "sparse", "ts": 110, "dur": 90, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "decode", "ts": 150, "dur": 80, "args": {"stream": 9}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 230, "dur": 2, "args": {"stream": 9}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 300, "dur": 100, "args": {"stream": 7}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 240, "dur": 50},
        {"ph": "X", "cat": "user_annotation", "name": bench.DISPATCH_LABEL, "ts": 100, "dur": 30},
        {"ph": "X", "cat": "user_annotation", "name": bench.DISPATCH_LABEL, "ts": 260, "dur": 10},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 5},
    ]
    t = bench.trace_summary(ev)
    assert t["span_ms"] == pytest.approx(0.4)
    assert t["busy_ms"] == pytest.approx((100 + 122 + 100) / 1000)
    assert t["idle_ms"] == pytest.approx((10 + 68) / 1000)
    assert t["gaps"]["over_5us"] == 2 and t["gaps"]["largest"][0] == {"us": 68.0, "after": "Memcpy DtoD", "before": "gemm"}
    assert t["gaps"]["largest"][1]["after"] == "gemm" and t["gaps"]["largest"][1]["before"] == "sparse"
    assert t["kernels"]["gemm"] == [2, pytest.approx(0.2)]
    assert t["streams"]["9"] == {"ops": 2, "busy_ms": pytest.approx(0.082)}
    assert t["syncs"] == {"cudaStreamSynchronize": {"count": 1, "ms": 0.05}}
    assert t["dispatch"]["calls"] == 2 and t["dispatch"]["host_ms_per_call"] == pytest.approx(0.02)
    other = bench.trace_summary([dict(e, dur=e["dur"] * 2) if e.get("name") == "decode" else e for e in ev])
    assert bench.kernel_delta(t, other)[0] == ("decode", pytest.approx(0.08), 1, 1)


def test_host_phases_split_the_time_outside_the_steps(monkeypatch):
    """Before the first step, after the last one, the bench's own checks; the adapter's plan / summary / close timed
    through the module functions the OUTER_SAMPLE wrapper looks up, restored afterwards (mutation: a phase measured
    from the wrong mark, or a patched function left in place, fails here)."""
    bench = _bench()
    rec = {"t_call": 10.0, "t_start": 10.25, "step_ends": [(0, 11.0), (1, 12.0)], "t_return": 12.5, "t_done": 12.75}
    h = bench.host_phases(rec, {"plan": 0.125})
    assert h == {"before_first_step": 0.25, "after_last_step": 0.5, "bench_after": 0.25, "pack_plan": 0.125}
    rec["gc_pauses"] = [(10.0, 10.125, 0), (11.75, 12.25, 2)]  # the second one spans the last step's end
    h = bench.host_phases(rec)
    assert (h["gc_in_call"], h["gc_full_collections"], h["gc_after_last_step"]) == (0.625, 1, 0.25)
    clock = iter([1.0, 1.5, 2.0, 2.25, 3.0, 4.0])
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))

    class RunState:
        def close(self):
            return "closed"

    lc = types.SimpleNamespace(_plan_before_sampling=lambda *a: "planned", _report=lambda run: "reported",
                               RunState=RunState)
    saved = (lc._plan_before_sampling, lc._report, RunState.close)
    with bench.pack_phase_timer(types.SimpleNamespace(lifecycle=lc)) as pack:
        assert lc._plan_before_sampling(1, 2) == "planned" and lc._report(None) == "reported"
        assert RunState().close() == "closed"
    assert pack.s == {"plan": 0.5, "summary": 0.25, "close": 1.0}
    assert (lc._plan_before_sampling, lc._report, RunState.close) == saved


def test_exit_status_fails_on_errors_not_on_budget_skips(capsys):
    """``exit_status``: 0 for measured runs, the CPU split's hit-rate row and rows the time budget skipped (named in
    a printed line); 1 for a run's error, a run with no result, a config's error. ``table`` shows a skipped config
    as skipped, not FAILED."""
    bench = _bench()
    ok_run = {"label": "density 0.1", "extrapolation": {}}
    cfg = {"model": "wan21_1.3b", "res": "480p", "tokens": 1, "errors": [],
           "runs": [ok_run, {"label": "cpu split", "prefetch_hit_rate": 1.0},
                    {"label": "preset fast", "skipped": "time budget 9 s spent"}],
           "skipped": [{"stage": "peer", "skipped": "time budget 9 s spent"}]}
    skipped_cfg = {"model": "wan21_14b", "res": "720p", "tokens": "", "errors": [], "runs": [],
                   "skipped": [{"stage": "config", "skipped": "time budget spent"}]}
    report = {"configs": [cfg, skipped_cfg]}
    assert bench.exit_status(report) == 0
    said = capsys.readouterr().out
    assert "preset fast" in said and "peer" in said and "wan21_14b 720p config" in said
    assert "| skipped: time budget spent |" in bench.table(report) and "FAILED" not in bench.table(report)
    for bad in ({"runs": [ok_run, {"label": "density 0.2", "error": "RuntimeError: x"}]}, {"runs": [{"label": "?"}]},
                {"errors": [{"stage": "build/dense", "error": "x"}]}):
        assert bench.exit_status({"configs": [{**cfg, **bad}]}) == 1, bad


def test_a_failed_stage_is_printed_and_recorded(capsys):
    """``_failure`` (each stage's ``except``): the error and its traceback printed, and returned as the report's
    "error" / "traceback" fields."""
    bench = _bench()
    try:
        raise RuntimeError("boom")
    except RuntimeError as err:
        got = bench._failure("density 0.1", err)
    assert got["error"] == "RuntimeError: boom" and "raise RuntimeError" in got["traceback"]
    captured = capsys.readouterr()
    assert "[density 0.1] FAILED: RuntimeError: boom" in captured.out and "Traceback" in captured.err
