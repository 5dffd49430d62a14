"""The end-of-run summary of one sampler call: what went sparse, what stayed dense and why, anchors, cache
memory and the attention time saved as measured. Logged by the OUTER_SAMPLE wrapper (``lifecycle``)."""

from __future__ import annotations


def format_summary(run) -> str:
    """Multi-line summary of a ``lifecycle.RunState``. The first line is short enough for UI progress text.

    With a runner, its own summary (calls per kind, dense reasons, anchors, cache peak, kernels) is included;
    the adapter adds the schedule, measured time saved per conditioning chunk, displaced overrides and notes.
    Ends with a loud WARNING line when no call went sparse in a finished run. A run that ended by an exception
    (``run.interrupted_by``, e.g. ComfyUI's InterruptProcessingException) starts
    "MC-Sparse: run interrupted after step N (ExceptionType): <counts> so far", N being the last step
    (1-based) a model evaluation reached, or "before its first step".
    """
    counts = run.counts()
    s = run.settings
    sched = run.schedule
    tally = f"{counts['sparse']} sparse, {counts['anchor']} anchor, {counts['dense']} dense attention calls"
    interrupted = getattr(run, "interrupted_by", None)
    if interrupted is not None:
        last = getattr(run, "last_step", None)
        where = f"after step {last + 1} of {run.num_steps}" if last is not None else "before its first step"
        head = (f"MC-Sparse: run interrupted {where} ({interrupted}): {tally} so far "
                f"(density {s.density:g}, preset {s.preset})")
    else:
        head = f"MC-Sparse: {tally} over {run.num_steps} steps (density {s.density:g}, preset {s.preset})"
    lines = [head]
    lines.append(f"  schedule: dense warm-up {sched.warmup_steps} steps, {s.warmup_layers} layers; anchors at steps "
                 f"{', '.join(str(a + 1) for a in sched.anchor_steps) or 'none'} (1-based)")
    if run.runner is not None:
        lines.extend("  " + line for line in run.runner.summary().splitlines()
                     if "WARNING" not in line)
    else:
        lines.append(f"  whole sampler call dense: {run.dense_run_reason}")
        for reason, n in run.dense_reasons.most_common():
            lines.append(f"  dense x{n}: {reason}")
    keys = getattr(run, "cache_keys", None)
    if keys:
        windows = {k.window for k in keys}
        lines.append(f"  cache entries: {len(keys)} keys over {len({k.layer for k in keys})} blocks, "
                     f"{len({k.branch for k in keys})} conditioning branches, "
                     f"{len(windows - {None}) or 'no'} context windows, kinds {', '.join(sorted({k.kind for k in keys}))}")
    backend_line = getattr(run, "backend_line", None)
    line = backend_line() if callable(backend_line) else None
    if line:
        lines.append("  " + line)
    saved = run.time_saved_ms()
    if saved is not None:
        lines.append(f"  attention time saved (measured by the adapter): {saved / 1000:.3f} s")
    for what in run.displaced:
        lines.append(f"  another attention override ({what}) was installed after MC-Sparse; chained under it")
    lines.extend(f"  note: {n}" for n in run.notes)
    if counts["sparse"] == 0 and interrupted is None:
        lines.append("  WARNING: no attention call went sparse in this sampler call: MC-Sparse gave no speedup "
                     "(see the dense reasons above)")
    return "\n".join(lines)
