"""The one writer of ``docs/results/scoreboard.json`` (the project brief's ``docs/scoreboard.md``), used by every
``tests/bench_*.py`` that records a figure, and the entry format that ``tests/test_scoreboard.py`` checks.

An entry (one key of the board)::

    {"value": 1.52, "unit": "x", "command": "<exact command>", "commit": "<git hash>", "gpu": "NVIDIA H200",
     "date": "YYYY-MM-DD", "note": "<what was measured, baseline, extrapolation>"}

``value`` is a finite number, ``unit`` one of ``UNITS``, ``commit`` an abbreviated or full git hash of the code
measured, ``gpu`` the device name (None for CPU-only figures), ``date`` the day measured.

A benchmark builds its entries with ``entry`` and hands them to ``update``, which writes

* the entries alone to its keys file (``<out>/scoreboard.json``; what a GPU round brings back and what
  ``python tests/_scoreboard.py merge FILE...`` merges into the board), and
* unless told not to, the board itself: read, these keys replaced, written back (keys sorted, indent 1).

A malformed entry (a commit "unknown" when the GPU copy has no .git and no --commit was given, a NaN) still goes to
the keys file, so the figure is not lost, but never onto the board; ``update`` says why on stdout.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BOARD = ROOT / "docs" / "results" / "scoreboard.json"
FIELDS = ("value", "unit", "command", "commit", "gpu", "date", "note")
UNITS = ("ratio", "x", "ms", "GiB", "fraction")


def measured_commit(arg: str | None = None) -> str:
    """The commit measured: ``arg`` (a --commit flag), else ``$MC_SPARSE_COMMIT``, else this checkout's
    ``git rev-parse --short HEAD`` (stale or absent on the GPU machine's copy), else ``"unknown"``."""
    if arg or os.environ.get("MC_SPARSE_COMMIT"):
        return arg or os.environ["MC_SPARSE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def entry(value: float, unit: str, note: str, *, command: str, commit: str, gpu: str | None,
          digits: int = 4) -> dict:
    """One board entry, dated today; ``value`` rounded to ``digits`` decimals."""
    return {"value": round(float(value), digits), "unit": unit, "command": command, "commit": commit, "gpu": gpu,
            "date": datetime.date.today().isoformat(), "note": note}


def entry_problems(key: str, item) -> list[str]:
    """What is wrong with one board entry, one line per broken field (empty: nothing)."""
    if not isinstance(item, dict):
        return [f"{key}: not an object"]
    bad = []
    if set(item) != set(FIELDS):
        bad.append(f"{key}: fields {sorted(item)}, want {sorted(FIELDS)}")
    value = item.get("value")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        bad.append(f"{key}: value {value!r} is not a finite number")
    if item.get("unit") not in UNITS:
        bad.append(f"{key}: unit {item.get('unit')!r} not one of {list(UNITS)}")
    for name in ("command", "note"):
        if not isinstance(item.get(name), str) or not item.get(name, "").strip():
            bad.append(f"{key}: {name} must be non-empty text")
    if not isinstance(item.get("commit"), str) or not re.fullmatch(r"[0-9a-f]{7,40}", item["commit"]):
        bad.append(f"{key}: commit {item.get('commit')!r} is not a git hash")
    if item.get("gpu") is not None and not isinstance(item.get("gpu"), str):
        bad.append(f"{key}: gpu {item.get('gpu')!r} is neither text nor null")
    try:
        datetime.date.fromisoformat(item.get("date"))
    except (TypeError, ValueError):
        bad.append(f"{key}: date {item.get('date')!r} is not YYYY-MM-DD")
    return bad


def dumps(board: dict) -> str:
    """The board's one layout: keys sorted, indent 1, a final newline."""
    return json.dumps(dict(sorted(board.items())), indent=1) + "\n"


def update(entries: dict, keys_file: Path | str | None, board: Path | str | None = BOARD,
           say: bool = True) -> list[str]:
    """Write ``entries`` (key -> ``entry``) alone to ``keys_file`` (None: no keys file) and, when ``board`` is a path,
    replace those keys in it (read, change, write back; a missing file is created). Returns the problems found
    (``entry_problems``); with any, the board is left as it was and the problems are printed. ``say``: print each
    key's value (benchmarks that save partial results after every step pass False)."""
    if keys_file is not None:
        Path(keys_file).parent.mkdir(parents=True, exist_ok=True)
        Path(keys_file).write_text(dumps(entries))
    problems = [p for key, item in entries.items() for p in entry_problems(key, item)]
    if problems:
        print("scoreboard NOT updated (malformed entries):\n  " + "\n  ".join(problems), flush=True)
        return problems
    if board is not None and entries:
        path = Path(board)
        current = json.loads(path.read_text()) if path.is_file() else {}
        current.update(entries)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(dumps(current))
        except OSError as err:  # a read-only checkout: the keys file has the figures
            print(f"scoreboard not written to {path}: {err}", flush=True)
    for key, item in entries.items() if say else ():
        print(f"scoreboard {key} = {item['value']} {item['unit']}", flush=True)
    return []


def main(argv: list[str] | None = None) -> int:
    """``python tests/_scoreboard.py merge KEYS_FILE... [--board PATH]``: merge keys files from GPU runs into the
    board (default ``docs/results/scoreboard.json``); exit status 1 if any entry is malformed (nothing merged)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "merge" or len(argv) < 2:
        print(main.__doc__)
        return 2
    files, board = argv[1:], BOARD
    if "--board" in files:
        i = files.index("--board")
        board, files = Path(files[i + 1]), files[:i] + files[i + 2:]
    entries = {}
    for f in files:
        entries.update(json.loads(Path(f).read_text()))
    return 1 if update(entries, None, board) else 0


if __name__ == "__main__":
    sys.exit(main())
