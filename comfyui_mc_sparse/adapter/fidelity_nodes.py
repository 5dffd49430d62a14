"""The fidelity nodes (ComfyUI V3 node API): "MC-Sparse Probe", "MC-Sparse Probe Report" and "MC-Sparse Compare".

An artist chooses a preset with them (README "Choosing a preset"): the Probe shows, on their own model and
prompt, how much of each block's attention MC-Sparse keeps and how far its output is from dense attention,
beside block-sparse attention and the oracles; Compare scores the finished video against a run with the patch
bypassed (PSNR / SSIM per frame).

Node ids, input ids and combo options are a persistence contract with saved workflows: never rename them
(``tests/test_adapter_workflows.py`` pins them). Why the Probe needs a separate Report node: ``adapter/probe.py``.
"""

from __future__ import annotations

import torch
from comfy_api.latest import io, ui

from .probe import PROBE_TYPE, ProbeSpec, apply_probe

ProbeType = io.Custom(PROBE_TYPE)


class MCSparseProbe(io.ComfyNode):
    """MODEL in; MODEL and a probe handle out. Measures one step of the next sampler call (see ``adapter/probe.py``)."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="MCSparseProbe",
            display_name="MC-Sparse Probe",
            category="model/patch",
            description=(
                "Measures, during one step of the next sampler call, how close MC-Sparse's attention is to exact dense "
                "attention in every transformer block of your model, beside vanilla block-sparse attention and the "
                "token / per-query oracles (attention recall and relative L1 of the output). Does not change the "
                "image. Put it after the MC-Sparse Patch (to measure that patch's settings) or use it alone (its own "
                "density). Connect its probe output and the sampler's LATENT to 'MC-Sparse Probe Report' to see the "
                "table and the plot; the console and ComfyUI's output folder (mc_sparse_probe/) get them too. Costs "
                "a few dense attentions per probed block at the probe step."
            ),
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model, after the MC-Sparse Patch node if you use one."),
                io.Float.Input("density", default=0.2, min=0.01, max=1.0, step=0.01,
                               tooltip="Share of keys every method keeps, used when no MC-Sparse Patch is on the model "
                                       "(with a patch, the patch's density is probed)."),
                io.Combo.Input("query_tile", options=["128", "64"], default="128",
                               tooltip="Queries per group C (without a patch; with one, the patch's)."),
                io.String.Input("probe_step", default="auto",
                                tooltip="Step to probe (1-based, or a percent like '20%'): MC-Sparse's anchor rows and "
                                        "the baselines are measured here. auto = the first anchor step of the patch's "
                                        "schedule (or the paper's schedule scaled to your step count)."),
                io.String.Input("reuse_step", default="auto",
                                tooltip="A later step where the anchor's selection (and residual) is reused over the "
                                        "new q, k, v: what the patch really outputs. auto = halfway to the next anchor "
                                        "(or to the last step)."),
                io.String.Input("blocks", default="all",
                                tooltip="Blocks to probe: 'all' or 0-based indices like '0, 10, 20, 39'."),
                io.Int.Input("heads", default=8, min=0, max=1024,
                             tooltip="Heads probed per block, evenly spaced (0 = all). 8 of Wan 14B's 40 heads keep a "
                                     "720p probe to seconds per block."),
                io.Boolean.Input("per_head", default=False,
                                 tooltip="Also list each probed head's error (worst first) in the report."),
                io.Int.Input("oracle_queries", default=512, min=0, max=1_000_000, step=64,
                             tooltip="Queries per head the per-query oracle is evaluated on, evenly spaced (0 = all; "
                                     "all is slow at 720p)."),
                io.String.Input("capture_blocks", default="none",
                                tooltip="Save the probed heads' q/k/v of these blocks at the probe and reuse steps to "
                                        "a .safetensors file in output/mc_sparse_probe/ ('none', 'all' or '0, 20'); "
                                        "the size is logged before writing. Recompute the table offline with "
                                        "python -m comfyui_mc_sparse probe --captured FILE."),
            ],
            outputs=[
                io.Model.Output(tooltip="The same model, observed by the probe during the next sampler call."),
                ProbeType.Output(display_name="probe", tooltip="Connect to MC-Sparse Probe Report."),
            ],
        )

    @classmethod
    def execute(cls, model, density: float, query_tile: str, probe_step: str, reuse_step: str, blocks: str, heads: int,
                per_head: bool, oracle_queries: int, capture_blocks: str) -> io.NodeOutput:
        try:
            tile = int(query_tile)
        except (TypeError, ValueError):
            raise ValueError(f"query tile C must be 64 or 128, got {query_tile!r}") from None
        spec = ProbeSpec(density=density, query_tile=tile, probe_step=probe_step, reuse_step=reuse_step, blocks=blocks,
                         heads=heads, per_head=per_head, oracle_queries=oracle_queries, capture_blocks=capture_blocks)
        return io.NodeOutput(apply_probe(model, spec), spec.handle)


class MCSparseProbeReport(io.ComfyNode):
    """The probe's report after the sampler: IMAGE (plot) and STRING (table); previews the plot."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="MCSparseProbeReport",
            display_name="MC-Sparse Probe Report",
            category="model/patch",
            description=("Shows the MC-Sparse Probe's result for the sampler run whose LATENT it receives: a plot of "
                         "the relative L1 error per block for every method, and the full table as text."),
            inputs=[
                ProbeType.Input("probe", tooltip="The probe output of MC-Sparse Probe."),
                io.Latent.Input("samples", tooltip="The sampler's output: makes this node run after that sampler."),
            ],
            outputs=[
                io.Image.Output(display_name="plot", tooltip="Relative L1 vs block index per method (960 x 540)."),
                io.String.Output(display_name="report", tooltip="The table: worst blocks first, recall, density, time."),
            ],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, probe, samples) -> io.NodeOutput:
        text, image = probe.text, probe.image
        if text is None or image is None:
            from ..tools.plot import line_plot

            text = ("MC-Sparse Probe: no report yet: the sampler that used the probed model has not finished a run "
                    "(or it did not use that model)")
            image = line_plot([], {}, title="MC-Sparse probe: no report yet", x_label="block index", y_label="relative L1")
        return io.NodeOutput(image, text, ui=ui.PreviewImage(image, cls=cls))


class MCSparseCompare(io.ComfyNode):
    """Two IMAGE batches -> PSNR / SSIM per frame and overall, and a side-by-side / difference image."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="MCSparseCompare",
            display_name="MC-Sparse Compare",
            category="image/analysis",
            description=("Compares two videos or image batches frame by frame, e.g. the same seed with the MC-Sparse "
                         "Patch and with it bypassed: PSNR (dB) and SSIM (Wang et al. 2004) per frame and overall, "
                         "and an image showing A | B | the difference (x4)."),
            inputs=[
                io.Image.Input("image_a", tooltip="Frames of run A (e.g. with the MC-Sparse Patch)."),
                io.Image.Input("image_b", tooltip="Frames of run B (e.g. the same seed with the patch bypassed), same "
                                                  "size and frame count."),
                io.String.Input("label_a", default="patched", tooltip="Name of A in the report."),
                io.String.Input("label_b", default="dense", tooltip="Name of B in the report."),
            ],
            outputs=[
                io.Image.Output(display_name="side_by_side", tooltip="A | B | |A - B| x4, per frame."),
                io.String.Output(display_name="report", tooltip="PSNR and SSIM overall and per frame."),
                io.Float.Output(display_name="psnr", tooltip="Overall PSNR in dB (pooled MSE; inf if identical)."),
                io.Float.Output(display_name="ssim", tooltip="Mean SSIM over frames (1 = identical)."),
            ],
        )

    @classmethod
    def execute(cls, image_a: torch.Tensor, image_b: torch.Tensor, label_a: str, label_b: str) -> io.NodeOutput:
        from ..tools.image_metrics import compare, side_by_side

        result = compare(image_a, image_b)
        return io.NodeOutput(side_by_side(image_a, image_b), result.text(label_a, label_b), result.psnr_overall,
                             result.ssim_overall)


FIDELITY_NODES = [MCSparseProbe, MCSparseProbeReport, MCSparseCompare]
"""The nodes ``nodes.MCSparseExtension`` registers beside MC-Sparse Patch."""
