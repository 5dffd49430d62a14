"""GPU benchmark scripts refuse bad flags before they make any input (a round's device time is minutes): checked on
the CPU by their own argument checks."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def timeline():
    sys.path.insert(0, str(TESTS))
    try:
        import bench_select_timeline
    finally:
        sys.path.remove(str(TESTS))
    return bench_select_timeline


@pytest.mark.parametrize(("flags", "words"), [
    ({}, None),
    ({"rows": "defaults, bracket", "densities": "1,0.1", "calls": 3}, None),
    ({"rows": "unit fold"}, "unknown ['unit fold']"),  # the row the usage line named until session 13
    ({"rows": " , "}, "unknown empty"),
    ({"shape": "2b"}, "--shape must be one of"),
    ({"densities": "0.1,x"}, "comma-separated numbers"),
    ({"densities": "0,0.5"}, "in (0, 1]"),
    ({"densities": "nan"}, "in (0, 1]"),
    ({"densities": "1.5"}, "in (0, 1]"),
    ({"calls": 2}, "--calls must be >= 3"),
])
def test_select_timeline_flags(timeline, flags, words):
    """tests/bench_select_timeline.py's ``check_args``: the defaults and known rows pass; an unknown row (a KeyError
    after ~10 s of GPU input generation before), shape, density outside (0, 1] (s = 0 keeps no key) or fewer than 3
    calls (no table) are named."""
    args = argparse.Namespace(**{"shape": "1.3b", "rows": "defaults", "densities": "0.5,0.1", "calls": 12, **flags})
    why = timeline.check_args(args)
    assert (why is None) if words is None else (words in why), why
