"""docs/results/scoreboard.json's entry format (TEAM.md item 5: every figure with the command and commit that measured
it) and its one writer, tests/_scoreboard.py: checked on the committed file, on what the writer does with good and
malformed entries, on what bench_comfyui_speedup.py writes, and on every benchmark going through that writer.

An entry: ``value`` (a finite number), ``unit``, ``command`` (the exact command line), ``commit`` (an abbreviated or
full git hash), ``gpu`` (the device name, or None off a GPU), ``date`` (ISO, the day measured) and ``note``.
"""

from __future__ import annotations

import ast
import datetime
import importlib.util
import json
from pathlib import Path

import pytest

from .test_e2e_breakdown import _bench, _report

TESTS = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_scoreboard_under_test", TESTS / "_scoreboard.py")
sb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sb)
BOARD = sb.BOARD


def _problems(entries: dict) -> list[str]:
    return [p for key, entry in entries.items() for p in sb.entry_problems(key, entry)]


def test_committed_scoreboard_entries_are_well_formed():
    board = json.loads(BOARD.read_text())
    assert isinstance(board, dict) and board
    problems = _problems(board)
    assert not problems, "\n".join(problems)


def test_entry_problems_names_each_break():
    """The check can fail: each broken field is named (a hash shorter than git's 7 digits too)."""
    good = json.loads(BOARD.read_text())["cutedsl_sparse_eff_min"]
    assert sb.entry_problems("k", good) == []
    for edit, words in [({"value": "0.9"}, "value"), ({"value": float("nan")}, "value"), ({"value": True}, "value"),
                        ({"unit": "%"}, "unit"), ({"command": ""}, "command"), ({"note": " "}, "note"),
                        ({"commit": "HEAD"}, "commit"), ({"commit": "abc12"}, "commit"),
                        ({"gpu": 1}, "gpu"), ({"date": "02.12.2026"}, "date"), ({"extra": 1}, "fields")]:
        problems = sb.entry_problems("k", {**good, **edit})
        assert len(problems) == 1 and words in problems[0], (edit, problems)


def _entry(value, commit="8b1d692"):
    return sb.entry(value, "ratio", "a note", command="python3 tests/bench_x.py --out $OUT", commit=commit,
                    gpu="NVIDIA H200")


def test_entry_is_well_formed_dated_today_and_rounded():
    e = _entry(0.123456789)
    assert sb.entry_problems("k", e) == []
    assert e["value"] == 0.1235 and e["date"] == datetime.date.today().isoformat()
    assert sb.entry(1.23456, "x", "n", command="c", commit="abcdef0", gpu=None, digits=3)["value"] == 1.235


def test_update_replaces_its_keys_keeps_the_others_and_writes_one_layout(tmp_path):
    board, keys = tmp_path / "docs" / "board.json", tmp_path / "out" / "scoreboard.json"
    other = _entry(2.0)
    board.parent.mkdir()
    board.write_text(json.dumps({"z_other": other, "b_mine": _entry(9.0)}, indent=4))
    assert sb.update({"b_mine": _entry(0.5), "a_new": _entry(0.25)}, keys, board) == []
    text = board.read_text()
    got = json.loads(text)
    assert list(got) == ["a_new", "b_mine", "z_other"]  # keys sorted
    assert got["b_mine"]["value"] == 0.5 and got["a_new"]["value"] == 0.25 and got["z_other"] == other
    assert text == json.dumps(got, indent=1) + "\n"  # indent 1, a final newline
    assert json.loads(keys.read_text()) == {"a_new": _entry(0.25), "b_mine": _entry(0.5)}  # this run's keys alone
    assert keys.read_text() == sb.dumps(json.loads(keys.read_text()))


def test_update_says_each_value_unless_told_not_to(tmp_path, capsys):
    """``say``: one "scoreboard KEY = VALUE UNIT" line per key; none with say=False (benchmarks saving partial
    results after every step)."""
    assert sb.update({"k": _entry(1.5)}, None, tmp_path / "b.json") == []
    assert capsys.readouterr().out == "scoreboard k = 1.5 ratio\n"
    assert sb.update({"k": _entry(2.5)}, None, tmp_path / "b.json", say=False) == []
    assert capsys.readouterr().out == ""


def test_update_creates_a_missing_board_and_writes_no_board_when_told(tmp_path):
    board = tmp_path / "new" / "board.json"
    assert sb.update({"k": _entry(1.0)}, None, board) == []
    assert json.loads(board.read_text()) == {"k": _entry(1.0)}
    keys = tmp_path / "keys.json"
    assert sb.update({"k": _entry(3.0)}, keys, None) == []
    assert json.loads(board.read_text())["k"]["value"] == 1.0 and json.loads(keys.read_text())["k"]["value"] == 3.0


def test_a_malformed_entry_reaches_the_keys_file_but_never_the_board(tmp_path, capsys):
    board, keys = tmp_path / "board.json", tmp_path / "keys.json"
    before = sb.dumps({"k": _entry(1.0)})
    board.write_text(before)
    bad = {"k": _entry(0.5, commit="unknown"), "j": _entry(0.7)}
    problems = sb.update(bad, keys, board)
    assert len(problems) == 1 and "commit 'unknown'" in problems[0]
    assert board.read_text() == before  # not even the good key
    assert json.loads(keys.read_text()) == bad
    assert "scoreboard NOT updated" in capsys.readouterr().out


def test_merge_cli(tmp_path):
    board, a, b = tmp_path / "board.json", tmp_path / "a.json", tmp_path / "b.json"
    board.write_text(sb.dumps({"old": _entry(1.0)}))
    a.write_text(sb.dumps({"x": _entry(0.5)}))
    b.write_text(sb.dumps({"y": _entry(0.25)}))
    assert sb.main(["merge", str(a), "--board", str(board), str(b)]) == 0  # --board anywhere among the files
    assert set(json.loads(board.read_text())) == {"old", "x", "y"}
    b.write_text(sb.dumps({"y": _entry(0.125, commit="HEAD")}))
    assert sb.main(["merge", str(a), str(b), "--board", str(board)]) == 1
    assert json.loads(board.read_text())["y"]["value"] == 0.25
    assert sb.main([]) == 2


def test_measured_commit_order(monkeypatch):
    monkeypatch.setenv("MC_SPARSE_COMMIT", "1234567")
    assert sb.measured_commit("abcdef0") == "abcdef0"
    assert sb.measured_commit(None) == "1234567" and sb.measured_commit("") == "1234567"
    monkeypatch.delenv("MC_SPARSE_COMMIT")
    assert sb.measured_commit() != ""  # git HEAD here, or "unknown" without git


def test_the_e2e_benchmark_writes_well_formed_entries():
    bench = _bench()
    ops = {"sparse_attention": "cutedsl", "dense_attention": "flash_attn4"}
    entries = bench.scoreboard_entries(_report("installed", ops), command="python3 tests/bench_comfyui_speedup.py",
                                       commit="8b1d692", gpu="NVIDIA H200")
    assert entries
    problems = _problems(entries)
    assert not problems, "\n".join(problems)


def _direct_board_writes(source: str) -> list[str]:
    """Calls in ``source`` that write or dump a scoreboard themselves: a ``write_text`` / ``json.dump`` / ``open``
    whose receiver or arguments name a board (instead of ``_scoreboard.update``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name not in ("write_text", "dump", "open", "write"):
            continue
        text = ast.get_source_segment(source, node) or ""
        if "board" in text.lower():
            found.append(f"line {node.lineno}: {text[:100]}")
    return found


BENCHES = sorted(TESTS.glob("bench_*.py"))


@pytest.mark.parametrize("path", BENCHES, ids=lambda p: p.name)
def test_benchmarks_write_the_scoreboard_through_the_one_writer(path):
    source = path.read_text()
    assert not _direct_board_writes(source), _direct_board_writes(source)
    if "scoreboard.json" in source.replace("summary.json", ""):
        writes_keys = "_scoreboard.update(" in source or "_scoreboard.main(" in source
        says_none = "no scoreboard key" in source
        assert writes_keys or says_none, f"{path.name} names scoreboard.json but does not use tests/_scoreboard.py"


def test_the_writer_check_can_fail():
    for bad in ['(out / "scoreboard.json").write_text(json.dumps(board))',
                'SCOREBOARD.write_text(text)',
                'path.write_text(json.dumps(board, indent=2))',
                'json.dump(board, open(p, "w"))']:
        assert _direct_board_writes(bad), bad
    assert not _direct_board_writes('(out / "bench.json").write_text(json.dumps(report))')


def test_the_kernel_benchmark_writes_well_formed_entries_and_the_worst_point(tmp_path, monkeypatch):
    """bench_kernels.update_scoreboard (triton_sparse_eff_min, fa4_route_eff_min) on a synthetic two-shape report:
    well-formed entries, the best spill-free config's minimum (a wrong config excluded), the keys file beside."""
    monkeypatch.syspath_prepend(str(TESTS))
    spec = importlib.util.spec_from_file_location("bench_kernels_t", TESTS / "bench_kernels.py")
    bk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bk)

    def point(e):
        return {s: {"efficiency": v} for s, v in zip(("0.1", "0.5"), e)}

    def shape(op, kernel, route):
        return {"sparse": {"triton contiguous": point(op), bk.TRITON_KERNEL: point(kernel),
                           "flash_attn4 paged route": point(route)},
                "kernels": {"default": [(4, 200, 0)]}, "best_dense": {"name": "flash_attn4", "ms": 10.0},
                "errors": {"triton contiguous s=0.1": {"rel_l2": 1e-3, "max_abs": 1e-3},
                           f"{bk.TRITON_KERNEL} s=0.1": {"rel_l2": 0.5, "max_abs": 1.0}},  # the kernel row is wrong
                "sweep": {}, "gluon": {"gluon_ran": True}, "timing": "race"}

    report = {"gpu": "NVIDIA H200", "shapes": {"1.3b": shape((0.80, 0.90), (0.95, 0.99), (0.70, 0.88)),
                                               "14b": shape((0.85, 0.78), (0.99, 0.99), (0.86, 0.90))}}
    board, keys = tmp_path / "board.json", tmp_path / "out" / "scoreboard.json"
    entries = bk.update_scoreboard(board, keys, report, "python3 tests/bench_kernels.py --reuse", "8b1d692")
    assert set(entries) == {"triton_sparse_eff_min", "fa4_route_eff_min"} and not _problems(entries)
    assert entries["triton_sparse_eff_min"]["value"] == 0.78  # the op's worst point (14b s=0.5), not the wrong row's
    assert "worst at 14b s=0.5" in entries["triton_sparse_eff_min"]["note"]
    assert entries["fa4_route_eff_min"]["value"] == 0.70
    assert json.loads(keys.read_text()) == json.loads(board.read_text()) == entries
