"""Backend selection: a backend that raises at run time falls back and says so once; missing toolchains never
break the import."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.kernels import reference, registry


def test_runtime_failure_falls_back_and_is_reported(caplog, gen):
    """A backend whose kernel raises is disabled for that op, logged once, and the next backend answers."""
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("simulated kernel crash")

    registry.register(registry.Backend(name="broken_test", priority=99, ops={"dense_attention": broken}))
    try:
        q, k, v = (torch.randn(1, 1, 8, 16, generator=gen) for _ in range(3))
        with caplog.at_level(logging.WARNING):
            out = kernels.dense_attention(q, k, v)
            out2 = kernels.dense_attention(q, k, v)
        assert torch.allclose(out, reference.dense_attention(q, k, v)) and torch.equal(out, out2)
        assert len(calls) == 1  # never retried
        assert sum("broken_test failed on dense_attention" in r.getMessage() for r in caplog.records) == 1
        assert "simulated kernel crash" in registry.failures()[("broken_test", "dense_attention")]
        assert registry.last_choices()["dense_attention"].backend != "broken_test"
    finally:
        registry._backends.pop("broken_test", None)
        registry._failed.pop(("broken_test", "dense_attention"), None)


def test_import_without_triton_and_flash_attn(tmp_path):
    """With triton and flash_attn unimportable, the pack imports, and those backends report why."""
    root = Path(__file__).resolve().parent.parent
    script = textwrap.dedent(
        f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("triton", "flash_attn"):
                    raise ImportError(f"blocked {{name}} for the test")
        sys.meta_path.insert(0, Block())
        sys.path.insert(0, {str(root / "comfyui_mc_sparse")!r})
        import _standalone
        _standalone.load_pack()
        from comfyui_mc_sparse_pack.kernels import registry
        print(registry.report())
        """
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = {line.split(" ")[0]: line for line in res.stdout.splitlines()}
    assert "unavailable" in lines["triton"] and "blocked triton" in lines["triton"]
    assert "unavailable" in lines["flash_attn4"]
    assert "torch (priority 0): available" in res.stdout
