"""docs/results/scoreboard.json's entry format (TEAM.md item 5: every figure with the command and commit that measured
it), checked on the committed file and on what bench_comfyui_speedup.py writes into it.

An entry: ``value`` (a finite number), ``unit``, ``command`` (the exact command line), ``commit`` (an abbreviated or
full git hash), ``gpu`` (the device name, or None off a GPU), ``date`` (ISO, the day measured) and ``note``.
"""

from __future__ import annotations

import datetime
import json
import math
import re
from pathlib import Path

from .test_e2e_breakdown import _bench, _report

BOARD = Path(__file__).resolve().parent.parent / "docs" / "results" / "scoreboard.json"
FIELDS = {"value", "unit", "command", "commit", "gpu", "date", "note"}
UNITS = {"ratio", "x", "ms", "GiB", "fraction"}


def entry_problems(key: str, entry) -> list[str]:
    """What is wrong with one scoreboard entry (empty: nothing)."""
    if not isinstance(entry, dict):
        return [f"{key}: not an object"]
    bad = []
    if set(entry) != FIELDS:
        bad.append(f"{key}: fields {sorted(entry)}, want {sorted(FIELDS)}")
    value = entry.get("value")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        bad.append(f"{key}: value {value!r} is not a finite number")
    if entry.get("unit") not in UNITS:
        bad.append(f"{key}: unit {entry.get('unit')!r} not one of {sorted(UNITS)}")
    for name in ("command", "note"):
        if not isinstance(entry.get(name), str) or not entry.get(name, "").strip():
            bad.append(f"{key}: {name} must be non-empty text")
    if not isinstance(entry.get("commit"), str) or not re.fullmatch(r"[0-9a-f]{7,40}", entry["commit"]):
        bad.append(f"{key}: commit {entry.get('commit')!r} is not a git hash")
    if entry.get("gpu") is not None and not isinstance(entry.get("gpu"), str):
        bad.append(f"{key}: gpu {entry.get('gpu')!r} is neither text nor null")
    try:
        datetime.date.fromisoformat(entry.get("date"))
    except (TypeError, ValueError):
        bad.append(f"{key}: date {entry.get('date')!r} is not YYYY-MM-DD")
    return bad


def test_committed_scoreboard_entries_are_well_formed():
    board = json.loads(BOARD.read_text())
    assert isinstance(board, dict) and board
    problems = [p for key, entry in board.items() for p in entry_problems(key, entry)]
    assert not problems, "\n".join(problems)


def test_entry_problems_names_each_break():
    """The check can fail: each broken field is named."""
    good = json.loads(BOARD.read_text())["cutedsl_sparse_eff_min"]
    assert entry_problems("k", good) == []
    for edit, words in [({"value": "0.9"}, "value"), ({"value": float("nan")}, "value"), ({"value": True}, "value"),
                        ({"unit": "%"}, "unit"), ({"command": ""}, "command"), ({"commit": "HEAD"}, "commit"),
                        ({"gpu": 1}, "gpu"), ({"date": "02.12.2026"}, "date"), ({"extra": 1}, "fields")]:
        problems = entry_problems("k", {**good, **edit})
        assert len(problems) == 1 and words in problems[0], (edit, problems)


def test_the_e2e_benchmark_writes_well_formed_entries():
    bench = _bench()
    ops = {"sparse_attention": "cutedsl", "dense_attention": "flash_attn4"}
    entries = bench.scoreboard_entries(_report("installed", ops), command="python3 tests/bench_comfyui_speedup.py",
                                       commit="8b1d692", gpu="NVIDIA H200")
    assert entries
    problems = [p for key, entry in entries.items() for p in entry_problems(key, entry)]
    assert not problems, "\n".join(problems)
