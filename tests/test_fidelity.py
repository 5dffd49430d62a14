"""The fidelity tools without ComfyUI: the probe's numbers, its compact entry storage, the capture file, the plot,
PSNR / SSIM against a float64 reference written here, and the probe's observation through the attention override."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import override
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import probe as adapter_probe
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import MARK_KEY, CallSite
from comfyui_mc_sparse_pack.comfyui_mc_sparse.tools import capture, cli, image_metrics, plot, probe
from comfyui_mc_sparse_pack.comfyui_mc_sparse.tools.workload import SyntheticWorkload, WorkloadSpec

@pytest.fixture(scope="module")
def workload():
    """S = 512 (4 x 8 x 16), 2 heads of 64: anchor step 2 and reuse step 5 of 8."""
    w = SyntheticWorkload(WorkloadSpec(frames=4, height=8, width=16, heads=2, head_dim=64, num_steps=8, seed=3))
    return w.qkv(2), w.qkv(5)


SETTINGS = probe.ProbeSettings(density=0.15, group_size=64, oracle_queries=0)


def _scores(workload, exact):
    (q, k, v), (q2, k2, v2) = workload
    anchor, reuse = (probe.exact_anchor_scores, probe.exact_reuse_scores) if exact else (probe.anchor_scores,
                                                                                         probe.reuse_scores)
    scores, entry = anchor(q, k, v, SETTINGS)
    scores.update(reuse(q2, k2, v2, entry, SETTINGS))
    return scores


def test_probe_equals_the_diagnostics_on_the_same_tensors(workload):
    """Every row of the node's fast path (sparse-kernel LSE recall, sampled-row oracle at 'all' rows) equals the pack's
    diagnostics (exact chunked probabilities) on the synthetic workload: recall, rel L1, density, per head.
    Kills: recall from the wrong LSE difference, a dropped residual, the wrong step's dense reference, a wrong
    per-query top-K, a mis-counted density."""
    fast, exact = _scores(workload, False), _scores(workload, True)
    assert list(fast) and set(fast) == set(exact) == set(probe.METHODS)
    for m in probe.METHODS:
        a, b = fast[m], exact[m]
        assert a.recall == pytest.approx(b.recall, rel=1e-5, abs=1e-6), m
        assert a.rel_l1 == pytest.approx(b.rel_l1, rel=1e-4, abs=1e-6), m
        assert a.density == pytest.approx(b.density, abs=1e-12), m
        assert a.recall_per_head == pytest.approx(b.recall_per_head, rel=1e-5, abs=1e-6), m
        assert a.rel_l1_per_head == pytest.approx(b.rel_l1_per_head, rel=1e-4, abs=1e-6), m
    # the rows measure different things (so a mix-up of two rows cannot pass)
    assert fast[probe.MC_REUSE].rel_l1 < fast[probe.MC_REUSE_NO_RES].rel_l1
    assert fast[probe.MC_ANCHOR].rel_l1 < 0.01 < fast[probe.MC_ANCHOR_NO_RES].rel_l1
    assert fast[probe.QUERY_ORACLE].recall > fast[probe.TOKEN_ORACLE].recall > fast[probe.BSA].recall


def test_probe_and_diagnostics_in_many_chunks_equal_one_chunk(workload, monkeypatch):
    """The probe's per-query oracle and the diagnostics behind its exact rows work in chunks of rows / query groups
    (many at real sizes, one here otherwise); with the budgets cut to a few rows / one group per chunk every score
    is the one-chunk score. Mutations that left the suite green: a chunk's kept mass written at the first rows, a
    group chunk read from the first groups."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.tools import diagnostics

    whole = [_scores(workload, exact) for exact in (False, True)]
    (q, k, v), _ = workload
    S = q.shape[2]
    monkeypatch.setattr(probe, "_ROW_CHUNK_BYTES", 4 * S * 5)  # 5 sampled rows per chunk
    monkeypatch.setattr(diagnostics, "_CHUNK_BYTES", 4 * q.shape[0] * q.shape[1] * 64 * S)  # one group per chunk
    for exact, one in zip((False, True), whole):
        cut = _scores(workload, exact)
        tol = 1e-9 if exact else 1e-6  # the fast path's products in fp32: another summation order per chunk
        for m in probe.METHODS:
            assert cut[m].recall == pytest.approx(one[m].recall, rel=tol, abs=1e-12), (exact, m)
            assert cut[m].rel_l1 == pytest.approx(one[m].rel_l1, rel=tol, abs=1e-12), (exact, m)
            assert cut[m].recall_per_head == pytest.approx(one[m].recall_per_head, rel=tol, abs=1e-12), (exact, m)


def test_per_query_oracle_on_sampled_rows_matches_float64_brute_force(gen):
    """Sampled rows: each row's own top-K keys, its renormalised output, recall and rel L1 over those rows only."""
    q, k, v = (torch.randn(1, 2, 200, 64, generator=gen) * 1.5 for _ in range(3))
    out, lse = kernels.dense_attention(q, k, v, return_lse=True)
    rows = probe.sampled_rows(200, 37, q.device)
    got = probe.per_query_oracle_scores(q, k, v, out, lse, 50, rows)
    p = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 8.0, -1)[:, :, rows]  # [1, 2, n, 200]
    top = p.topk(50, dim=-1)
    mask = torch.zeros_like(p).scatter_(-1, top.indices, 1.0)
    o = (p * mask) @ v.double() / top.values.sum(-1, keepdim=True)
    ref = out[:, :, rows].double()
    assert rows.numel() == 37 and "37 of 200" in got.note
    assert got.recall == pytest.approx(float(top.values.sum(-1).mean()), rel=1e-5)
    assert got.rel_l1 == pytest.approx(float((o - ref).abs().sum() / ref.abs().sum()), rel=1e-4)


def test_packed_entry_round_trips_the_selection(workload):
    """Bitmask storage returns kv_idx exactly (sorted, -1 padded), perm and residual unchanged; smaller than int32.
    Kills: a wrong bit order, a lost ragged tail, padding in the wrong place."""
    (q, k, v), _ = workload
    _, entry = probe.anchor_scores(q[..., :300, :], k[..., :300, :], v[..., :300, :], SETTINGS)  # S = 300: ragged bytes
    entry.kv_idx[0, 0, 0, -5:] = -1  # a group with fewer real keys than slots
    packed = probe.PackedEntry.pack(entry)
    back = packed.unpack("cpu")
    assert torch.equal(back.kv_idx, entry.kv_idx) and back.kv_idx.dtype == torch.int32
    assert torch.equal(back.perm, entry.perm) and torch.equal(back.residual, entry.residual)
    assert packed.bits.numel() < entry.kv_idx.numel() * 4 / 4


def test_report_table_sorts_worst_blocks_first_and_lists_heads():
    s = probe.ProbeSettings()

    def score(m, e):
        return probe.MethodScore(m, 0.9, e, 0.2, [0.9, 0.9], [e, e / 2])

    blocks = [probe.BlockReport(block=b, heads=[0, 5], tokens=10, step=1, scores={probe.MC_REUSE: score(probe.MC_REUSE, e),
                                                                                    probe.BSA: score(probe.BSA, 0.5)})
              for b, e in ((0, 0.01), (1, 0.30), (2, 0.10))]
    text = probe.ProbeReport(s, blocks=blocks, header=["head line"]).table(per_head=True)
    rows = [line.split()[0] for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert rows[:3] == ["1", "2", "0"]  # worst MC-Sparse reuse error first
    assert text.startswith("head line") and "block 1: h0 0.3000, h5 0.1500" in text
    assert "mean" in text and "MC reuse" in text


def test_plot_is_an_image_with_the_series_drawn():
    """[1, H, W, 3] float in [0, 1]; each series' colour appears; an empty report still renders."""
    img = plot.line_plot([0, 1, 5], {"a": [0.1, 0.3, 0.2], "b": [0.05, float("nan"), 0.4]}, title="t 0.2",
                         x_label="block", y_label="rel l1", width=640, height=360)
    assert img.shape == (1, 360, 640, 3) and img.dtype == torch.float32
    assert float(img.min()) >= 0.0 and float(img.max()) <= 1.0
    for color in plot.PALETTE[:2]:
        hit = (img[0] - torch.tensor(color)).abs().amax(-1) < 1e-6
        assert int(hit.sum()) > 50
    assert float(img[0, 10:25, 60:120].min()) < 0.5  # title ink
    report = probe.ProbeReport(probe.ProbeSettings())
    assert probe.plot_report(report).shape == (1, 540, 960, 3)


# --- PSNR / SSIM against a float64 reference written from the paper ----------------------------------------------

def _ssim_reference(x, y):
    """Wang et al. 2004, eq. (13) + mean SSIM: 11x11 Gaussian sigma 1.5 (sum 1), K1 0.01, K2 0.03, L 1, every window
    position fully inside the image, per channel then averaged. Direct sums per window (no convolution)."""
    r = torch.arange(11, dtype=torch.float64) - 5
    w = torch.exp(-(r[:, None] ** 2 + r[None, :] ** 2) / (2 * 1.5**2))
    w = w / w.sum()
    c1, c2 = 0.01**2, 0.03**2
    H, W, C = x.shape
    vals = []
    for c in range(C):
        for i in range(H - 10):
            for j in range(W - 10):
                a, b = x[i : i + 11, j : j + 11, c], y[i : i + 11, j : j + 11, c]
                ma, mb = (w * a).sum(), (w * b).sum()
                va, vb = (w * (a - ma) ** 2).sum(), (w * (b - mb) ** 2).sum()
                cov = (w * (a - ma) * (b - mb)).sum()
                vals.append(((2 * ma * mb + c1) * (2 * cov + c2)) / ((ma**2 + mb**2 + c1) * (va + vb + c2)))
    return float(torch.stack(vals).view(C, -1).mean())


@pytest.mark.parametrize("chunk", [8, 2])
def test_psnr_ssim_match_a_float64_reference(gen, monkeypatch, chunk):
    """Per frame and overall, on structured frames with noise and a brightness shift (SSIM well below 1), in one chunk
    of frames and in two (the last partial: long videos run in many). Kills: a box window, sigma != 1.5, zero
    padding, swapped C1/C2, luminance-only SSIM, mean-of-dB overall PSNR, a chunk read from the first frames."""
    monkeypatch.setattr(image_metrics, "_FRAMES_PER_CHUNK", chunk)
    base = torch.rand(3, 18, 21, 3, generator=gen, dtype=torch.float64)
    a = base.float()
    b = (base * 0.8 + 0.1 + 0.08 * torch.randn(base.shape, generator=gen, dtype=torch.float64)).clamp(0, 1).float()
    b[2] = a[2]  # one identical frame: PSNR inf, SSIM 1
    res = image_metrics.compare(a, b)
    for f in range(3):
        x, y = a[f].double(), b[f].double()
        mse = float(((x - y) ** 2).mean())
        assert res.psnr[f] == (math.inf if mse == 0 else pytest.approx(10 * math.log10(1 / mse), rel=1e-9))
        assert res.ssim[f] == pytest.approx(_ssim_reference(x, y), abs=1e-6)
    assert res.ssim[2] == pytest.approx(1.0, abs=1e-9) and res.ssim[0] < 0.97
    pooled = float(((a.double() - b.double()) ** 2).mean())
    assert res.psnr_overall == pytest.approx(10 * math.log10(1 / pooled), rel=1e-9)
    assert res.ssim_overall == pytest.approx(sum(res.ssim) / 3, rel=1e-12)
    assert "frame 2: PSNR inf dB" in res.text()


def test_side_by_side_and_shape_errors(gen):
    a, b = torch.rand(2, 12, 14, 3, generator=gen), torch.rand(2, 12, 14, 3, generator=gen)
    img = image_metrics.side_by_side(a, b, gap=4)
    assert img.shape == (2, 12, 3 * 14 + 8, 3) and float(img.min()) >= 0 and float(img.max()) <= 1
    assert torch.equal(img[:, :, :14], a) and torch.equal(img[:, :, 18:32], b)
    diff = ((a - b).abs().mean(-1) * image_metrics.DIFF_GAIN).clamp(0, 1)
    torch.testing.assert_close(img[:, :, 36:, 0], diff)
    with pytest.raises(ValueError, match="same"):
        image_metrics.compare(a, b[:1])
    with pytest.raises(ValueError, match="at least 11"):
        image_metrics.compare(a[:, :8], b[:, :8])
    with pytest.raises(ValueError, match="at least one frame"):  # before: ZeroDivisionError
        image_metrics.compare(a[:0], b[:0])


# --- capture files and the CLI ------------------------------------------------------------------------------------

def test_capture_round_trip_and_cli_table(workload, tmp_path, capsys):
    """save -> load keeps tensors and metadata; the exact (diagnostics) report of a capture equals the fast path's;
    ``python -m comfyui_mc_sparse probe --captured`` prints that table; a foreign safetensors file is refused, a
    truncated or non-safetensors file too, with a message (before: a SafetensorError traceback from the CLI)."""
    (q, k, v), (q2, k2, v2) = ([t[:, :1, :256].contiguous() for t in qkv] for qkv in workload)
    tensors = {f"block3.{w}.{n}": t for w, qkv in (("anchor", (q, k, v)), ("reuse", (q2, k2, v2)))
               for n, t in zip("qkv", qkv)}
    meta = {"settings": json.dumps({"density": 0.15, "group_size": 64, "oracle_queries": 0}), "probe_step": "2",
            "reuse_step": "5", "scale": "", "heads": json.dumps({"3": [0, 7]})}
    path = tmp_path / "cap.safetensors"
    assert capture.save_capture(path, tensors, meta) == capture.capture_nbytes(tensors) == 6 * q.numel() * 4
    blocks, stored = capture.load_capture(path)
    assert torch.equal(blocks[3]["reuse"]["v"], v2) and stored["probe_step"] == "2"
    exact = capture.report_from_capture(path, exact=True)
    fast = capture.report_from_capture(path, exact=False)
    assert exact.blocks[0].heads == [0, 7] and exact.blocks[0].block == 3
    for m in probe.METHODS:
        assert fast.blocks[0].scores[m].rel_l1 == pytest.approx(exact.blocks[0].scores[m].rel_l1, rel=1e-4, abs=1e-6)
    assert cli.main(["probe", "--captured", str(path), "--json", str(tmp_path / "r.json")]) == 0
    printed = capsys.readouterr().out
    mc = exact.blocks[0].scores[probe.MC_REUSE].rel_l1
    assert f"{mc:.4f}" in printed and "exact diagnostics" in printed
    assert json.loads((tmp_path / "r.json").read_text())["blocks"][0]["block"] == 3
    assert cli.main(["probe", "--captured", str(tmp_path / "missing.safetensors")]) == 2
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not an MC-Sparse probe capture"):
        capture.load_capture(tmp_path / "other.safetensors")
    data = path.read_bytes()  # a truncated capture and one that is no safetensors at all: a message, exit code 2
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.safetensors").write_text("not a capture")
    for name in ("cut", "text"):
        with pytest.raises(ValueError, match="cannot be read as a .safetensors file"):
            capture.load_capture(tmp_path / f"{name}.safetensors")
        assert cli.main(["probe", "--captured", str(tmp_path / f"{name}.safetensors")]) == 2


# --- the probe inside the attention override (ComfyUI stand-ins) --------------------------------------------------

def _spec(**over):
    args = dict(density=0.2, query_tile=64, probe_step="2", reuse_step="4", blocks="all", heads=1, per_head=False,
                oracle_queries=0, capture_blocks="none")
    return adapter_probe.ProbeSpec(**{**args, **over})


def test_probe_run_observes_marked_calls_without_changing_them(workload):
    """Through the override: the output is bit-identical to the backend's, the probe measures the positive branch
    (cond_or_uncond [1, 0] puts it second) at the probe and reuse steps only, once per (step, block).
    Kills: measuring the uncond chunk, probing every step, an observer that edits q in place."""
    (q, k, v), (q2, k2, v2) = ([t[..., :256, :].contiguous() for t in qkv] for qkv in workload)  # [1, 2, 256, 64]
    sigmas = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]  # 5 steps: probe step 2 (index 1), reuse step 4 (index 3)
    run = adapter_probe.ProbeRun(_spec(), sigmas)
    fn = override.make_override(None)
    calls = []

    def func(q_, k_, v_, heads, **kw):
        calls.append(1)
        return q_ * 2.0

    def to_comfy(t):  # [B, H, S, D] -> ComfyUI's [B, S, H*D]
        return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)

    noise = torch.randn_like(q)
    for step, (qq, kk, vv) in ((0, (q, k, v)), (1, (q, k, v)), (1, (q, k, v)), (3, (q2, k2, v2))):
        batch = [torch.cat([to_comfy(noise), to_comfy(t)]) for t in (qq, kk, vv)]  # uncond first, then cond
        before = batch[0].clone()
        options = {override.PROBE_RUN_KEY: run, MARK_KEY: CallSite(4, "wan"), "sigmas": torch.tensor([sigmas[step]]),
                   "cond_or_uncond": [1, 0]}
        out = fn(func, *batch, 2, transformer_options=options)
        assert torch.equal(out, before * 2.0) and torch.equal(batch[0], before)
    report = run.finish()
    assert len(calls) == 4 and len(report.blocks) == 1
    b = report.blocks[0]
    assert b.block == 4 and b.heads == [0] and set(b.scores) == set(probe.METHODS)
    ref, entry = probe.anchor_scores(q[:, :1].contiguous(), k[:, :1].contiguous(), v[:, :1].contiguous(), run.settings)
    ref.update(probe.reuse_scores(q2[:, :1].contiguous(), k2[:, :1].contiguous(), v2[:, :1].contiguous(), entry,
                                  run.settings))
    for m in probe.METHODS:
        assert b.scores[m].rel_l1 == pytest.approx(ref[m].rel_l1, rel=1e-6), m
    assert "probe (anchor) step 2 and reuse step 4 of 5" in report.header[0]


def test_probe_inputs_steps_and_filters_at_their_edges(workload):
    """The Probe node's edges: blank blocks / capture boxes mean all / none, a negative block is refused; the auto
    reuse step is at least one step after the anchor and dropped past the call's end; a reuse step at or before the
    probe step is dropped with a note; a block outside ``blocks`` is not measured and a step evaluated twice (heun's
    corrector, split conds) is measured once, from its first evaluation. Eight mutations that left the suite green."""
    assert adapter_probe.parse_blocks("") is None and adapter_probe.parse_blocks("  ") is None
    assert adapter_probe.parse_capture("") == () and adapter_probe.parse_capture(" None ") == ()
    with pytest.raises(ValueError, match=">= 0"):
        adapter_probe.parse_blocks("2, -1")
    assert adapter_probe._auto_steps(3, (1, 2)) == (1, 2)  # next anchor right after: reuse = that step, never the anchor
    assert adapter_probe._auto_steps(2, (1,)) == (1, None)  # no step after the anchor
    early = adapter_probe.ProbeRun(_spec(probe_step="4", reuse_step="2"), [1.0, 0.8, 0.6, 0.4, 0.2, 0.0])
    assert early.reuse is None and any("not after the probe step 4" in n for n in early.notes)

    (q, k, v), (q2, k2, v2) = ([t[..., :256, :].contiguous() for t in qkv] for qkv in workload)
    sigmas = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]
    fn = override.make_override(None)

    def func(q_, k_, v_, heads, **kw):
        return q_

    def to_comfy(t):
        return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)

    def observe(run, block, tensors):
        options = {override.PROBE_RUN_KEY: run, MARK_KEY: CallSite(block, "wan"), "sigmas": torch.tensor([sigmas[1]]),
                   "cond_or_uncond": [0]}
        fn(func, *(to_comfy(t) for t in tensors), 2, transformer_options=options)

    only_one = adapter_probe.ProbeRun(_spec(blocks="1", reuse_step="auto"), sigmas)
    observe(only_one, 4, (q, k, v))
    assert not only_one.finish().blocks
    twice = adapter_probe.ProbeRun(_spec(reuse_step="auto"), sigmas)
    observe(twice, 4, (q, k, v))
    observe(twice, 4, (q2, k2, v2))  # the same step again, other tensors: not measured again
    ref, _ = probe.anchor_scores(q[:, :1].contiguous(), k[:, :1].contiguous(), v[:, :1].contiguous(), twice.settings)
    got = twice.finish().blocks[0].scores
    assert all(got[m].rel_l1 == pytest.approx(ref[m].rel_l1, rel=1e-6) for m in ref)


def test_probe_spec_and_auto_steps():
    assert adapter_probe.parse_blocks("all") is None and adapter_probe.parse_blocks(" 3, 0,3") == (0, 3)
    assert adapter_probe.parse_capture("none") == () and adapter_probe.parse_capture("all") == (-1,)
    assert adapter_probe.choose_heads(40, 8) == [0, 6, 11, 17, 22, 28, 33, 39] and adapter_probe.choose_heads(2, 8) == [0, 1]
    for bad in ({"blocks": "x"}, {"probe_step": "0"}, {"heads": -1}, {"density": 0.0}, {"query_tile": 96}):
        with pytest.raises(ValueError):
            _spec(**bad)
    run = adapter_probe.ProbeRun(_spec(probe_step="auto", reuse_step="auto"), [1.0 - i / 50 for i in range(51)])
    assert (run.anchor, run.reuse) == (9, 29)  # published schedule at 50 steps: one anchor at 10 (1-based), reuse midway to the end
    patch = SimpleNamespace(density=0.25, group_size=128, preset="quality", warmup=None, anchors=None)
    run = adapter_probe.ProbeRun(_spec(probe_step="auto"), [1.0 - i / 20 for i in range(21)], patch_settings=patch)
    assert run.settings.density == 0.25 and run.settings.group_size == 128 and run.anchor == 3
    late = adapter_probe.ProbeRun(_spec(probe_step="9", reuse_step="3"), [1.0, 0.5, 0.0])
    assert late.reuse is None and any("past" in n for n in late.notes)
    assert adapter_probe.ProbeSpec.__deepcopy__(_spec(), {}) is not None
