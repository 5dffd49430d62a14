"""Captured q/k/v of probed blocks: safetensors files (never pickles) and the table recomputed from them.

Written by the MC-Sparse Probe node when ``capture_blocks`` is set (``adapter/probe.py``): for each captured block
``b``, tensors ``block{b}.anchor.{q,k,v}`` (the probe step) and, when reached, ``block{b}.reuse.{q,k,v}`` (the reuse
step), each ``[1, h, S, D]`` in the model's dtype (the probed heads of the positive branch's first latent), plus
string metadata: ``format`` (``CAPTURE_FORMAT``), ``settings`` (JSON of ``probe.ProbeSettings``), ``probe_step`` and
``reuse_step`` (0-based), ``scale`` (the softmax scale the model passed, or empty for 1/sqrt(D)), ``heads`` (JSON
block -> head indices).

``python -m comfyui_mc_sparse probe --captured FILE`` prints the Probe's table from such a file, computed by the
pack's diagnostics (``report_from_capture``).
"""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path

import torch

CAPTURE_FORMAT = "mc_sparse_probe_capture/1"
_KEY = re.compile(r"^block(\d+)\.(anchor|reuse)\.([qkv])$")


def capture_nbytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes the tensors take (what the file will hold, plus a small header)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def save_capture(path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """Write ``tensors`` (CPU, contiguous) and string ``metadata`` to ``path`` as safetensors; returns the bytes.

    Raises: ValueError for a key outside ``block{b}.{anchor|reuse}.{q|k|v}`` or non-string metadata.
    """
    from safetensors.torch import save_file

    for key in tensors:
        if not _KEY.match(key):
            raise ValueError(f"capture keys must look like 'block3.anchor.q', got {key!r}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("capture metadata must map strings to strings")
    save_file({k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}, str(path),
              metadata={"format": CAPTURE_FORMAT, **metadata})
    return capture_nbytes(tensors)


def load_capture(path) -> tuple[dict[int, dict[str, dict[str, torch.Tensor]]], dict[str, str]]:
    """Read a capture: ``({block: {"anchor"|"reuse": {"q","k","v": [1, h, S, D]}}}, metadata)``.

    Raises: FileNotFoundError; ValueError when the file is not a probe capture (format), cannot be read as
    safetensors (corrupt or truncated) or a block lacks q, k or v.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--captured must name a probe capture (.safetensors), got {path}")
    blocks: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            if metadata.get("format") != CAPTURE_FORMAT:
                raise ValueError(f"{path} is not an MC-Sparse probe capture (format {metadata.get('format')!r}, "
                                 f"expected {CAPTURE_FORMAT!r})")
            for key in f.keys():
                m = _KEY.match(key)
                if m:
                    blocks.setdefault(int(m[1]), {}).setdefault(m[2], {})[m[3]] = f.get_tensor(key)
    except SafetensorError as err:
        raise ValueError(f"{path} cannot be read as a .safetensors file (corrupt or truncated?): {err}") from None
    for b, steps in blocks.items():
        for which, qkv in steps.items():
            if set(qkv) != {"q", "k", "v"}:
                raise ValueError(f"{path}: block {b} {which} step lacks {sorted({'q', 'k', 'v'} - set(qkv))}")
    return blocks, metadata


def settings_from(metadata: dict[str, str], **override):
    """The ``probe.ProbeSettings`` a capture was measured with (fields in ``override`` replace stored ones)."""
    from .probe import ProbeSettings

    stored = json.loads(metadata.get("settings") or "{}")
    known = {f.name for f in fields(ProbeSettings)}
    return ProbeSettings(**{**{k: v for k, v in stored.items() if k in known}, **override})


def report_from_capture(path, *, exact: bool = True, device: str = "cpu", backend: str | None = None):
    """The Probe's report recomputed from a capture.

    Args:
        path: the capture file. exact: True = the pack's diagnostics (``probe.exact_*_scores``: exact chunked
            probabilities, every query for the per-query oracle); False = the node's own fast path (same
            numbers within float rounding, the per-query oracle on the node's sampled queries).
        device: where to compute. backend: kernel backend (None = the captured settings' one).
    Returns: ``probe.ProbeReport``.
    """
    from . import probe

    blocks, metadata = load_capture(path)
    settings = settings_from(metadata, **({} if backend is None else {"backend": backend}))
    scale = float(metadata["scale"]) if metadata.get("scale") else None
    heads = json.loads(metadata.get("heads") or "{}")
    step = int(metadata.get("probe_step") or 0)
    reuse = int(metadata["reuse_step"]) if metadata.get("reuse_step") else None
    report = probe.ProbeReport(settings, header=[
        f"MC-Sparse Probe (from capture {Path(path).name}): probe (anchor) step {step + 1}"
        + (f", reuse step {reuse + 1}" if reuse is not None else "") + " (1-based); "
        + ("exact diagnostics (tools/diagnostics.py)" if exact else "the node's fast path")])
    anchor_fn = probe.exact_anchor_scores if exact else probe.anchor_scores
    reuse_fn = probe.exact_reuse_scores if exact else probe.reuse_scores
    for b in sorted(blocks):
        steps = blocks[b]
        if "anchor" not in steps:
            report.notes.append(f"block {b}: no anchor-step tensors captured; skipped")
            continue
        q, k, v = (steps["anchor"][n].to(device) for n in "qkv")
        timer = probe.Stopwatch(q.device)
        scores, entry = anchor_fn(q, k, v, settings, scale=scale)
        if "reuse" in steps:
            q2, k2, v2 = (steps["reuse"][n].to(device) for n in "qkv")
            scores.update(reuse_fn(q2, k2, v2, entry, settings, scale=scale))
        report.blocks.append(probe.BlockReport(block=b, heads=list(heads.get(str(b), range(q.shape[1]))),
                                               tokens=q.shape[2], step=step, reuse_step=reuse if "reuse" in steps else None,
                                               scores=scores, seconds=timer.seconds()))
    report.seconds = sum(b.seconds for b in report.blocks)
    return report


def add_probe_parser(sub) -> None:
    """Register ``probe --captured FILE [--fast] [--per-head] [--device D] [--json OUT]`` on an argparse subparsers."""
    p = sub.add_parser("probe", help="the MC-Sparse Probe's table recomputed from a captured .safetensors file")
    p.add_argument("--captured", required=True, help="capture written by the MC-Sparse Probe node (capture_blocks)")
    p.add_argument("--fast", action="store_true", help="the node's fast path instead of the exact diagnostics")
    p.add_argument("--per-head", action="store_true", help="also list the error per head")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    p.add_argument("--json", help="also write every number to this JSON file")


def run_probe(args) -> int:
    """``probe --captured``: print the table (stdout); exit code 2 with a message for a missing or foreign file."""
    import sys

    try:
        report = report_from_capture(args.captured, exact=not args.fast, device=args.device)
    except (FileNotFoundError, ValueError) as err:
        print(f"probe: {err}", file=sys.stderr)
        return 2
    print(report.table(per_head=args.per_head))
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=1) + "\n", encoding="utf-8")
    return 0
