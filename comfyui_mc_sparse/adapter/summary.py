"""The end-of-run summary of one sampler call. Logged by the OUTER_SAMPLE wrapper (``lifecycle``); its first line
is also shown under the sampler node in the UI, so it tells an artist in a dozen words what happened."""

from __future__ import annotations

from .override import NOT_SELF_ATTENTION


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def headline(run) -> str:
    """The first line: share of self-attention calls that went sparse, expected speedup, where the cache was;
    or why the whole call stayed dense; or where an interrupted run stopped."""
    counts = run.counts()
    interrupted = getattr(run, "interrupted_by", None)
    if interrupted is not None:
        last = getattr(run, "last_step", None)
        where = f"after step {last + 1} of {run.num_steps}" if last is not None else "before its first step"
        return (f"MC-Sparse: run interrupted {where} ({interrupted}): {counts['sparse']} sparse, {counts['anchor']} "
                f"anchor, {counts['dense']} dense attention calls so far")
    if run.runner is None:
        return f"MC-Sparse: stayed dense: {run.dense_run_reason}"
    disabled = getattr(run.runner, "disabled_reason", None)
    if disabled and not counts["sparse"]:
        return f"MC-Sparse: stayed dense: {disabled}"
    self_dense = counts["dense"] - run.runner.stats.dense_reasons.get(NOT_SELF_ATTENTION, 0)
    total = counts["sparse"] + counts["anchor"] + self_dense
    share = counts["sparse"] / total if total else 0.0
    line = f"MC-Sparse: {share:.0%} of self-attention sparse"
    speed = getattr(run.runner, "speed", None)
    if speed is not None and counts["sparse"]:
        line += f", ~{speed.speedup:.2f}x expected"
    if counts["sparse"] or counts["anchor"]:
        line += f", cache in {run.runner.cache_where()}"
    return line


def format_summary(run) -> str:
    """Multi-line summary of a ``lifecycle.RunState``: ``headline``, then the calls and schedule, the runner's
    detail lines (dense reasons, anchors, cache, kernels, measured attention time, notes), cache keys, displaced
    overrides and notes. Ends with a WARNING line when no call went sparse in a finished run that tried to."""
    counts = run.counts()
    s = run.settings
    sched = run.schedule
    lines = [headline(run)]
    lines.append(f"  calls: {counts['sparse']} sparse, {counts['anchor']} anchor, {counts['dense']} dense over "
                 f"{_plural(run.num_steps, 'step')} (density {s.density:g}, preset {s.preset})")
    if run.config is not None:  # a schedule was resolved (also when the run then stayed dense up front)
        lines.append(f"  schedule: dense warm-up {_plural(sched.warmup_steps, 'step')}, "
                     f"{_plural(s.warmup_layers, 'layer')}; anchors at steps "
                     f"{', '.join(str(a + 1) for a in sched.anchor_steps) or 'none'} (1-based)")
    if run.runner is not None:
        lines.extend("  " + line for line in run.runner.summary_lines())
    else:
        for reason, n in run.dense_reasons.most_common():
            lines.append(f"  dense x{n}: {reason}")
    keys = getattr(run, "cache_keys", None)
    if keys:
        windows, branches = {k.window for k in keys}, {k.branch for k in keys}
        lines.append(f"  cache entries: {len(keys)} keys over {_plural(len({k.layer for k in keys}), 'block')}, "
                     f"{len(branches)} conditioning branch{'' if len(branches) == 1 else 'es'}, "
                     f"{len(windows - {None}) or 'no'} context windows, kinds {', '.join(sorted({k.kind for k in keys}))}")
    backend_line = getattr(run, "backend_line", None)
    line = backend_line() if callable(backend_line) else None
    if line:
        lines.append("  " + line)
    for what in run.displaced:
        lines.append(f"  another attention override ({what}) was installed after MC-Sparse; chained under it")
    lines.extend(f"  note: {n}" for n in run.notes)
    if counts["sparse"] == 0 and run.runner is not None and getattr(run, "interrupted_by", None) is None:
        lines.append("  WARNING: no attention call went sparse in this sampler call: MC-Sparse gave no speedup "
                     "(see the dense reasons above)")
    return "\n".join(lines)
