"""Backend selection: a backend that raises at run time falls back and says so once; missing toolchains never
break the import."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from comfyui_mc_sparse_pack import kernels
from comfyui_mc_sparse_pack.kernels import reference, registry


def test_runtime_failure_falls_back_and_is_reported(caplog, gen):
    """A backend whose kernel raises is skipped for that op for the rest of the run (the active registry Record),
    logged once, and the next backend answers; the next run tries it again (defect 10: per run, not per process)."""
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("simulated kernel crash")

    registry.register(registry.Backend(name="broken_test", priority=99, ops={"dense_attention": broken}))
    try:
        q, k, v = (torch.randn(1, 1, 8, 16, generator=gen) for _ in range(3))
        with caplog.at_level(logging.WARNING), registry.recording(registry.Record()) as run:
            out = kernels.dense_attention(q, k, v)
            out2 = kernels.dense_attention(q, k, v)
        assert torch.allclose(out, reference.dense_attention(q, k, v)) and torch.equal(out, out2)
        assert len(calls) == 1  # never retried within the run
        assert sum("broken_test failed on dense_attention" in r.getMessage() for r in caplog.records) == 1
        assert "simulated kernel crash" in run.failures[("broken_test", "dense_attention")]
        assert run.choices["dense_attention"].backend != "broken_test"
        with registry.recording(registry.Record()) as next_run:
            kernels.dense_attention(q, k, v)
        assert len(calls) == 2 and ("broken_test", "dense_attention") in next_run.failures  # tried again, next run
    finally:
        registry._backends.pop("broken_test", None)


@pytest.mark.parametrize("error", [ValueError, TypeError])
def test_bad_input_errors_propagate_without_a_fallback(gen, error):
    """A backend raising ValueError / TypeError (bad input: the caller's error, the same on every backend) is not a
    backend failure: it propagates unchanged, no other backend runs and the run records no failure (mutation: either
    type dropped from the re-raised pair, which sent bad input on to the next backend)."""
    def picky(*args, **kwargs):
        raise error("simulated bad input")

    registry.register(registry.Backend(name="picky_test", priority=99, ops={"dense_attention": picky}))
    try:
        q, k, v = (torch.randn(1, 1, 8, 16, generator=gen) for _ in range(3))
        with registry.recording(registry.Record()) as run, pytest.raises(error, match="simulated bad input"):
            kernels.dense_attention(q, k, v)
        assert not run.failures and not run.choices
    finally:
        registry._backends.pop("picky_test", None)


def test_a_refused_requested_backend_is_named_once(gen):
    """``backend=NAME`` that NAME refuses: the NoCapableBackendError (every backend refusing) lists NAME's refusal
    once, marked "(requested)" (mutation: listed again among the others)."""
    registry.register(registry.Backend(name="refusing_test", priority=99,
                                       ops={"dense_attention": reference.dense_attention},
                                       refuse=lambda op, q, requested: "never runs (simulated)"))
    try:
        q = torch.randn(1, 1, 8, 16, generator=gen)
        with pytest.raises(registry.NoCapableBackendError) as err:
            registry.candidates("no_such_op", q, backend="refusing_test")
        text = str(err.value)
        assert text.count("refusing_test") == 1 and "refusing_test (requested): does not implement" in text, text
    finally:
        registry._backends.pop("refusing_test", None)


def test_out_of_memory_reaches_the_engine_and_disables_nothing(gen):
    """Defect 2: out of memory in a backend is not a backend failure: it propagates (no fallback to the slow
    reference), the engine's out-of-memory path turns the rest of that run dense and says so, and the backend is
    used again afterwards."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.cache import CacheKey
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.config import MCSparseConfig
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.engine import MCSparseRunner

    calls = []

    def oom_once(q, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return reference.pddp_groups(q, *args, **kwargs)

    registry.register(registry.Backend(name="oom_test", priority=99, ops={"pddp_groups": oom_once}))
    try:
        q, k, v = (torch.randn(1, 2, 128, 64, generator=gen) for _ in range(3))
        runner = MCSparseRunner(MCSparseConfig(density=0.5, group_size=64, warmup_steps=0, anchor_steps=(0,)))
        out = runner.attention(q, k, v, step=0, layer=0, key=CacheKey(0))
        torch.testing.assert_close(out, reference.dense_attention(q, k, v))
        assert runner.disabled_reason and "out of memory" in runner.disabled_reason
        assert any("out of memory at step" in n for n in runner.stats.notes)
        assert not runner.kernels.failures
        assert kernels.pddp_groups(q, 64).shape == (1, 2, 128) and len(calls) == 2  # not disabled
    finally:
        registry._backends.pop("oom_test", None)


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
