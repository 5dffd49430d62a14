"""tests/gpu_p2ws_tests.sh selects the Gluon pass-2 GPU cases it runs (one process each) by test id: its default
selection must be the intended 7 cases. In round s6r2 the exclude list sat inside ``${VAR:-...}``, where the shell
removed its single quotes, so it matched nothing but two ids and 18 processes ran past the round's cap."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_default_selection_is_the_intended_cases():
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("P2WS_TEST_EXCLUDE", None)
    out = subprocess.run(["bash", "tests/gpu_p2ws_tests.sh", "--list"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.splitlines()
    ids = [line for line in out if "::" in line]
    joined = "\n".join(ids)
    assert len(ids) == 7, joined
    assert "'groups': 3" not in joined and "B1H2S4000" not in joined, joined
    assert any(i.endswith("-{}]") for i in ids) and any("'poly': 0, 'kb_poly': False" in i for i in ids), joined
    assert any(i.endswith("test_gluon_pass2_through_the_dispatch_and_select_kv") for i in ids), joined
