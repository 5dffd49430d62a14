"""The MC-Sparse Probe inside ComfyUI: what it installs on a model, what it does during one sampler call, and how its
report reaches the user.

How the report reaches the user (ComfyUI runs a node's ``execute`` once, *before* the sampler that uses its MODEL,
so a MODEL-patching node cannot return numbers measured during sampling):

1. "MC-Sparse Probe" (MODEL in) returns the patched MODEL and a ``ProbeHandle`` (type ``MC_SPARSE_PROBE``), an
   empty mailbox shared by reference: ``ModelPatcher.clone`` deep-copies model_options, and the handle's
   ``__deepcopy__`` returns itself, so every clone downstream (ModelSamplingSD3, LoRA, ...) fills the same one.
2. During the next sampler call the probe measures its step(s); at the end of the call (OUTER_SAMPLE ``finally``,
   interrupts included) it logs the table (info), writes ``<output>/mc_sparse_probe/probe_<time>.txt`` and
   ``.json`` (and the capture, when asked), sends the first line as progress text under the sampler node, and
   posts the report (text + plot IMAGE) into the handle.
3. "MC-Sparse Probe Report" takes the handle and the sampler's LATENT; the LATENT input makes ComfyUI run it
   after the sampler (graph order), so it returns the report of that run as IMAGE + STRING and previews the plot.
   Without the report node the log and the files still carry everything.

Observation: the probe never changes what the model computes. It installs the pack's attention override and
call-site marks (the same ones as the MC-Sparse Patch node; idempotent when both are present, in either order)
and a ``ProbeRun`` under ``override.PROBE_RUN_KEY``; the override hands every marked self-attention call to
``ProbeRun.observe`` before dispatching it as usual (dense without the Patch, MC-Sparse with it). Any probe
failure is caught and reported; sampling never stops because of the probe (ComfyUI's interrupt still does).

Measured: the positive (cond) branch, first latent of the batch, the chosen heads of every chosen block, at the
probe step (MC-Sparse anchor rows and the baselines) and at the reuse step (MC-Sparse reuse rows, from the
anchor's selection and residual kept compactly on the CPU in between). Joint text+latent sequences (HunyuanVideo,
Hunyuan3D) and VACE blocks are not probed (noted). With an MC-Sparse Patch on the model the probe uses its
density and query tile, and ``auto`` steps follow its schedule; alone, its own density.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from .callsite import CallSite
from .override import PROBE_RUN_KEY
from .settings import parse_warmup
from .steps import current_sigma, step_index

logger = logging.getLogger(__name__)

PROBE_HOLDER_KEY = "mc_sparse_probe"
"""transformer_options key of the node's ``ProbeSpec``."""
WRAPPER_KEY = "mc_sparse_probe"
PROBE_TYPE = "MC_SPARSE_PROBE"
"""ComfyUI type name of the Probe node's second output (a ``ProbeHandle``)."""


class ProbeHandle:
    """The mailbox between the Probe node and the Probe Report node (shared by reference, never copied).

    Attributes:
        text: the latest report's text (None before a sampler call finished). image: its plot IMAGE.
        files: paths written for it. runs: sampler calls reported so far.
    """

    def __init__(self):
        self.text: str | None = None
        self.image: torch.Tensor | None = None
        self.files: list[str] = []
        self.runs = 0

    def __deepcopy__(self, memo):
        return self

    def post(self, text: str, image: torch.Tensor | None, files: list[str]) -> None:
        """Store a finished run's report."""
        self.text, self.image, self.files = text, image, list(files)
        self.runs += 1


def parse_blocks(text: str) -> tuple[int, ...] | None:
    """``"all"`` / blank -> None (every block); ``"0, 10, 20"`` -> 0-based block indices.

    Raises: ValueError naming "blocks" for anything else.
    """
    if not isinstance(text, str):
        raise ValueError(f"blocks must be text like 'all' or '0, 10, 20', got {type(text).__name__}")
    stripped = text.strip().lower()
    if stripped in ("", "all"):
        return None
    try:
        values = tuple(sorted({int(x) for x in stripped.replace(";", ",").split(",") if x.strip()}))
    except ValueError:
        raise ValueError(f"blocks must be 'all' or 0-based block indices like '0, 10, 20', got {text!r}") from None
    if not values or values[0] < 0:
        raise ValueError(f"blocks must be 'all' or 0-based block indices >= 0, got {text!r}")
    return values


def parse_capture(text: str) -> tuple[int, ...]:
    """``""`` / ``"none"`` -> () (no capture); otherwise ``parse_blocks`` (``"all"`` captures every probed block)."""
    stripped = text.strip().lower() if isinstance(text, str) else text
    if stripped in ("", "none"):
        return ()
    blocks = parse_blocks(text)
    return (-1,) if blocks is None else blocks


def parse_step(text: str, name: str):
    """``"auto"`` -> None; ``"7"`` (1-based) or ``"40%"`` -> a ``settings.StepSpec``. Raises ValueError naming ``name``."""
    try:
        spec = parse_warmup(text)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be 'auto', a 1-based step number or a percent like '40%', got {text!r}") from None
    if spec is not None and spec.value <= 0:
        raise ValueError(f"{name} must be >= 1 (steps are 1-based) or a percent > 0, got {text!r}")
    return spec


class ProbeSpec:
    """What the Probe node asked for (validated at node time; cheap to deep-copy; shares its handle)."""

    def __init__(self, *, density: float, query_tile: int, probe_step: str, reuse_step: str, blocks: str, heads: int,
                 per_head: bool, oracle_queries: int, capture_blocks: str, handle: ProbeHandle | None = None):
        from ..tools.probe import ProbeSettings

        ProbeSettings(density=density, group_size=query_tile, oracle_queries=oracle_queries)  # validates
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 0:
            raise ValueError(f"heads must be a whole number >= 0 (0 = all), got {heads!r}")
        self.density, self.query_tile = float(density), int(query_tile)
        self.probe_step, self.reuse_step = parse_step(probe_step, "probe step"), parse_step(reuse_step, "reuse step")
        self.blocks = parse_blocks(blocks)
        self.capture = parse_capture(capture_blocks)
        self.heads, self.per_head, self.oracle_queries = heads, bool(per_head), int(oracle_queries)
        self.handle = handle if handle is not None else ProbeHandle()

    def __deepcopy__(self, memo):
        return self  # immutable after construction; the handle must stay shared


def choose_heads(total: int, wanted: int) -> list[int]:
    """``wanted`` evenly spaced head indices of ``total`` (all when wanted is 0 or >= total)."""
    if wanted <= 0 or wanted >= total:
        return list(range(total))
    return sorted({round(i * (total - 1) / (wanted - 1)) for i in range(wanted)}) if wanted > 1 else [0]


def _auto_steps(num_steps: int, anchors: tuple[int, ...]) -> tuple[int, int | None]:
    """Probe step = the first anchor; reuse step = midway from it to the next anchor (or to the last step)."""
    anchor = anchors[0] if anchors else max(0, math.ceil(0.2 * num_steps) - 1)
    end = anchors[1] if len(anchors) > 1 else num_steps
    reuse = anchor + max(1, (end - anchor) // 2)
    return anchor, (reuse if reuse < num_steps else None)


class ProbeRun:
    """The probe during one sampler call.

    Args:
        spec: the node's ``ProbeSpec``. sample_sigmas: this call's schedule (``steps + 1`` values).
        patch_settings: the MC-Sparse Patch node's ``PatchSettings`` when one is on the model, else None.
        model_name: the diffusion model's class name (report header).
    """

    def __init__(self, spec: ProbeSpec, sample_sigmas, *, patch_settings=None, model_name: str = "?"):
        from ..tools.probe import ProbeReport, ProbeSettings
        from .settings import resolve_schedule

        self.spec = spec
        self.sample_sigmas = [float(s) for s in (sample_sigmas.tolist() if isinstance(sample_sigmas, torch.Tensor)
                                                 else sample_sigmas)]
        self.num_steps = max(1, len(self.sample_sigmas) - 1)
        if patch_settings is not None:
            density, tile = patch_settings.density, patch_settings.group_size
            anchors = resolve_schedule(patch_settings, self.num_steps).anchor_steps
            source = f"from the MC-Sparse Patch on this model (preset {patch_settings.preset})"
        else:
            from ..schedule import paper_video_schedule

            density, tile = spec.density, spec.query_tile
            anchors = tuple(int(a) for a in paper_video_schedule(self.num_steps)[1])
            source = "the probe's own (no MC-Sparse Patch on this model)"
        self.settings = ProbeSettings(density=density, group_size=tile, oracle_queries=spec.oracle_queries)
        auto_anchor, auto_reuse = _auto_steps(self.num_steps, anchors)
        self.anchor = spec.probe_step.to_index(self.num_steps) if spec.probe_step else auto_anchor
        self.reuse = spec.reuse_step.to_index(self.num_steps) if spec.reuse_step else auto_reuse
        self.report = ProbeReport(self.settings)
        self.notes = self.report.notes
        if self.anchor >= self.num_steps:
            self.notes.append(f"probe step {self.anchor + 1} lies past this {self.num_steps}-step sampler call: nothing "
                              f"was probed")
        if self.reuse is not None and (self.reuse <= self.anchor or self.reuse >= self.num_steps):
            self.notes.append(f"reuse step {self.reuse + 1} is not after the probe step {self.anchor + 1} within "
                              f"{self.num_steps} steps: no reuse rows")
            self.reuse = None
        reuse = f"reuse step {self.reuse + 1}" if self.reuse is not None else "no reuse step"
        self.report.header = [
            f"MC-Sparse Probe: {model_name}, probe (anchor) step {self.anchor + 1} and {reuse} of {self.num_steps} "
            f"(1-based); settings {source}; positive branch, first latent of the batch",
        ]
        self._blocks: dict[int, Any] = {}  # block -> BlockReport
        self._entries: dict[int, Any] = {}  # block -> PackedEntry (CPU) until the reuse step
        self._done: set[tuple[int, int]] = set()
        self._captured: dict[str, torch.Tensor] = {}
        self._scale: float | None = None
        self._said_memory = False
        self.skipped: dict[str, int] = {}

    # -- called from the attention override ------------------------------------------------------------------
    def observe(self, site: CallSite | None, q, k, v, heads: int, *, skip_reshape: bool, options: dict,
                scale: float | None = None) -> None:
        """Look at one attention call; measure it when it is a chosen block at the probe or reuse step.

        Never raises (except ComfyUI's interrupt and other BaseExceptions): failures become notes.
        """
        if site is None:
            return
        sigma = current_sigma(options)
        if sigma is None:
            return
        step = step_index(sigma, self.sample_sigmas)
        if step not in (self.anchor, self.reuse):
            return
        block = site.layer
        if self.spec.blocks is not None and block not in self.spec.blocks:
            return
        if (step, block) in self._done:
            return  # a second evaluation of the same step (heun corrector, context windows, split conds)
        if site.joint is not None or site.kind != "self":
            self._skip(f"{'joint text+latent' if site.joint else site.kind} attention is not probed")
            return
        self._done.add((step, block))
        from ..tools.probe import BlockReport, Stopwatch

        try:
            qh, kh, vh = (self._cond_heads(t, heads, skip_reshape, options) for t in (q, k, v))
            timer = Stopwatch(qh.device)
            if step == self.anchor:
                self._anchor(block, qh, kh, vh, scale, BlockReport)
            elif block in self._entries:
                self._reuse(block, qh, kh, vh, scale)
            else:
                return
            self._blocks[block].seconds += timer.seconds()
        except Exception as err:  # the probe must never cost the user their run
            if "out of memory" in str(err) and torch.cuda.is_available():
                torch.cuda.empty_cache()
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            self.notes.append(f"block {block}, step {step + 1}: probe failed ({type(err).__name__}: {first})")
            logger.warning("MC-Sparse Probe: block %d, step %d: %s: %s", block, step + 1, type(err).__name__, first)

    def _skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def _cond_heads(self, t: torch.Tensor, heads: int, skip_reshape: bool, options: dict) -> torch.Tensor:
        """``[1, h, S, D]`` contiguous: the positive branch's first latent, the chosen heads."""
        chunks = list(options.get("cond_or_uncond") or [0])
        per = max(1, t.shape[0] // max(1, len(chunks)))
        row = (chunks.index(0) if 0 in chunks else 0) * per
        x = t[row : row + 1]
        x = x if skip_reshape else x.view(1, x.shape[1], heads, x.shape[2] // heads).transpose(1, 2)  # [1, H, S, D]
        self._heads = choose_heads(x.shape[1], self.spec.heads)
        return x[:, self._heads].contiguous()

    def _anchor(self, block: int, q, k, v, scale, block_report_cls) -> None:
        from ..tools.probe import PackedEntry, anchor_scores

        scores, entry = anchor_scores(q, k, v, self.settings, scale=scale)
        self._scale = scale
        self._blocks[block] = block_report_cls(block=block, heads=list(self._heads), tokens=q.shape[2], step=self.anchor,
                                               reuse_step=self.reuse, scores=scores)
        if self.reuse is not None:
            packed = PackedEntry.pack(entry, "cpu")
            self._entries[block] = packed
            if not self._said_memory:
                self._said_memory = True
                logger.info("MC-Sparse Probe: keeping each probed block's MC-Sparse selection and residual on the CPU "
                            "until step %d: %.1f MiB per block", self.reuse + 1, packed.nbytes / 2**20)
        if self._captures(block):
            self._capture(block, "anchor", q, k, v)

    def _reuse(self, block: int, q, k, v, scale) -> None:
        from ..tools.probe import reuse_scores

        entry = self._entries.pop(block).unpack(q.device)
        self._blocks[block].scores.update(reuse_scores(q, k, v, entry, self.settings, scale=scale))
        if self._captures(block):
            self._capture(block, "reuse", q, k, v)

    def _captures(self, block: int) -> bool:
        return -1 in self.spec.capture or block in self.spec.capture

    def _capture(self, block: int, which: str, q, k, v) -> None:
        for name, t in (("q", q), ("k", k), ("v", v)):
            self._captured[f"block{block}.{which}.{name}"] = t.detach().to("cpu", copy=True)

    # -- end of the sampler call ---------------------------------------------------------------------------
    def finish(self, interrupted_by: str | None = None):
        """Assemble the ``ProbeReport`` (blocks in index order)."""
        report = self.report
        report.blocks = [self._blocks[b] for b in sorted(self._blocks)]
        report.seconds = sum(b.seconds for b in report.blocks)
        if self._blocks:
            heads = report.blocks[0].heads
            report.header.append(f"heads probed per block: {len(heads)} ({', '.join(map(str, heads))}); "
                                 f"tokens per call: {report.blocks[0].tokens}")
        elif not any("nothing was probed" in n for n in self.notes):
            self.notes.append("no marked self-attention call reached the probe step (unsupported model, or the "
                              "sampler call ended first)")
        for reason, n in self.skipped.items():
            self.notes.append(f"{n} calls skipped: {reason}")
        if self.reuse is not None and self._entries:
            self.notes.append(f"{len(self._entries)} blocks never reached the reuse step {self.reuse + 1}")
        if interrupted_by:
            self.notes.append(f"the sampler call was interrupted ({interrupted_by}); partial report")
        self._entries.clear()
        return report

    def capture_metadata(self) -> dict[str, str]:
        """safetensors metadata of the capture (strings): format, settings, steps, scale, heads."""
        from dataclasses import asdict

        return {"settings": json.dumps(asdict(self.settings)),
                "probe_step": str(self.anchor), "reuse_step": "" if self.reuse is None else str(self.reuse),
                "scale": "" if self._scale is None else repr(float(self._scale)),
                "heads": json.dumps({str(b): r.heads for b, r in self._blocks.items()})}


def output_dir() -> Path:
    """``<ComfyUI output>/mc_sparse_probe`` (created)."""
    import folder_paths

    path = Path(folder_paths.get_output_directory()) / "mc_sparse_probe"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _write_outputs(run: ProbeRun, report, text: str) -> list[str]:
    """Write the text, JSON and (when asked) the capture; returns the paths. Failures are logged, not raised."""
    from ..tools.capture import save_capture

    files = []
    try:
        stem = output_dir() / datetime.datetime.now().strftime("probe_%Y%m%d_%H%M%S_%f")
        stem.with_suffix(".txt").write_text(text + "\n", encoding="utf-8")
        stem.with_suffix(".json").write_text(json.dumps(report.to_json(), indent=1) + "\n", encoding="utf-8")
        files += [str(stem.with_suffix(".txt")), str(stem.with_suffix(".json"))]
        if run._captured:
            path = stem.parent / (stem.name + "_capture.safetensors")
            nbytes = sum(t.numel() * t.element_size() for t in run._captured.values())
            logger.info("MC-Sparse Probe: writing the capture (%d tensors, %.1f MiB) to %s", len(run._captured),
                        nbytes / 2**20, path)
            save_capture(path, run._captured, run.capture_metadata())
            files.append(str(path))
    except Exception as err:  # a full disk or a read-only output folder must not lose the report
        logger.warning("MC-Sparse Probe: could not write the report files (%s: %s)", type(err).__name__, err)
    return files


def _progress_text(text: str) -> None:
    try:  # progress text under the sampler node in the UI (server.py L1008), when a server is running
        from .lifecycle import running_server

        server, context = running_server()
        if context is not None and server is not None and hasattr(server, "send_progress_text"):
            server.send_progress_text(text, context.node_id)
    except Exception as err:
        logger.debug("MC-Sparse Probe: no progress text (%s)", err)


# -- wrappers (called by ComfyUI) ---------------------------------------------------------------------------------

def outer_sample_wrapper(executor, *args, **kwargs):
    """OUTER_SAMPLE: a fresh ``ProbeRun`` for this sampler call; report, files and handle in ``finally``."""
    from comfy.model_patcher import create_model_options_clone

    from ..tools.probe import plot_report
    from .lifecycle import HOLDER_KEY
    from .override import install_override

    guider = executor.class_obj
    original = guider.model_options
    spec: ProbeSpec | None = original.get("transformer_options", {}).get(PROBE_HOLDER_KEY)
    if spec is None:
        return executor(*args, **kwargs)
    sigmas = args[3] if len(args) > 3 else kwargs["sigmas"]
    patch = original.get("transformer_options", {}).get(HOLDER_KEY)
    model_name = type(guider.model_patcher.get_model_object("diffusion_model")).__name__
    run = ProbeRun(spec, sigmas, patch_settings=getattr(patch, "settings", None), model_name=model_name)
    interrupted = None
    try:
        guider.model_options = create_model_options_clone(original)
        options = guider.model_options.setdefault("transformer_options", {})
        options[PROBE_RUN_KEY] = run
        install_override(options)
        return executor(*args, **kwargs)
    except BaseException as err:
        interrupted = type(err).__name__
        raise
    finally:
        guider.model_options = original
        try:
            report = run.finish(interrupted)
            text = report.table(per_head=spec.per_head)
            image = plot_report(report)
            logger.info("%s", text)
            files = _write_outputs(run, report, text)
            if files:
                text += "\nfiles: " + ", ".join(files)
            spec.handle.post(text, image, files)
            _progress_text(text.splitlines()[0] + f" (probe took {report.seconds:.1f} s)")
        except Exception as err:  # never turn a finished (or interrupted) sampling into an error
            logger.warning("MC-Sparse Probe: no report (%s: %s)", type(err).__name__, err)


def apply_probe(model, spec: ProbeSpec):
    """A clone of ``model`` with the probe installed (attention override + call-site marks shared with the MC-Sparse
    Patch, an OUTER_SAMPLE wrapper and the step re-assertion wrappers). The original model is untouched."""
    import comfy.patcher_extension as pe

    from .layouts import install_plan, plan_for
    from .lifecycle import calc_cond_batch_wrapper, on_prepare_state
    from .override import install_override

    patched = model.clone()
    plan = plan_for(patched.get_model_object("diffusion_model"))
    if plan.reason_unsupported:
        logger.warning("MC-Sparse Probe: %s; nothing will be probed", plan.reason_unsupported)
    options = patched.model_options.setdefault("transformer_options", {})
    options[PROBE_HOLDER_KEY] = spec
    install_override(options)
    install_plan(patched, plan)
    patched.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, outer_sample_wrapper)
    patched.add_wrapper_with_key(pe.WrappersMP.CALC_COND_BATCH, WRAPPER_KEY, calc_cond_batch_wrapper)
    patched.add_callback_with_key(pe.CallbacksMP.ON_PREPARE_STATE, WRAPPER_KEY, on_prepare_state)
    return patched


__all__ = ["PROBE_HOLDER_KEY", "PROBE_TYPE", "ProbeHandle", "ProbeRun", "ProbeSpec", "apply_probe",
           "choose_heads", "parse_blocks", "parse_capture", "parse_step"]
