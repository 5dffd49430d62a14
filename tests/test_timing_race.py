"""tests/_timing.race (the timing method of record) on a simulated GPU clock: the lead-in keeps a function's first,
slow call after another function's sample out of its median, and ``MC_SPARSE_RACE_LEAD_IN=0`` restores the old
method, where that call is timed."""
import importlib.util
from pathlib import Path

import pytest


@pytest.fixture
def timing(monkeypatch):
    spec = importlib.util.spec_from_file_location("_timing_under_test", Path(__file__).parent / "_timing.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    clock = {"t": 0.0, "last": None}

    class Event:  # records the simulated GPU clock; elapsed_time in ms like torch.cuda.Event
        def __init__(self, enable_timing=True):
            self.t = None

        def record(self):
            self.t = clock["t"]

        def elapsed_time(self, end):
            return end.t - self.t

    monkeypatch.setattr(mod.torch.cuda, "Event", Event)
    monkeypatch.setattr(mod.torch.cuda, "synchronize", lambda: None)

    def gpu_fn(name, ms, first_call_extra_ms):
        def fn():  # a call right after another function's calls pays first_call_extra_ms (host launch, clocks)
            clock["t"] += ms + (first_call_extra_ms if clock["last"] != name else 0.0)
            clock["last"] = name
        return fn

    return mod, gpu_fn


def test_lead_in_keeps_the_first_call_out_of_the_median(timing, monkeypatch):
    mod, gpu_fn = timing
    monkeypatch.delenv("MC_SPARSE_RACE_LEAD_IN", raising=False)
    fns = {"dense": gpu_fn("dense", 10.0, 0.0), "op": gpu_fn("op", 1.0, 0.5)}
    idle = {}
    ms = mod.race(fns, rounds=3, target_ms=20.0, from_idle=idle)
    assert ms["dense"] == pytest.approx(10.0) and ms["op"] == pytest.approx(1.0)
    # the op's lead-in: round(20 / 4 / 1.0) = 5 calls, the first of them slow
    assert idle["op"] == pytest.approx((5 * 1.0 + 0.5) / 5)


def test_without_lead_in_the_first_call_is_timed(timing, monkeypatch):
    mod, gpu_fn = timing
    monkeypatch.setenv("MC_SPARSE_RACE_LEAD_IN", "0")
    fns = {"dense": gpu_fn("dense", 10.0, 0.0), "op": gpu_fn("op", 1.0, 0.5)}
    idle = {}
    ms = mod.race(fns, rounds=3, target_ms=20.0, from_idle=idle)
    assert ms["op"] > 1.0 and not idle  # 20 calls of 1 ms, the first 0.5 ms slower
    assert ms["op"] == pytest.approx((20 * 1.0 + 0.5) / 20)


def test_samples_rounds_and_order(timing, monkeypatch):
    """Each round times every fn once, in a new order; a sample is led in by ~target/4 of calls (at least one, also for
    a fn slower than the target) and then runs ~target_ms of calls (at least one), sizes from a warmed-up estimate."""
    mod, gpu_fn = timing
    monkeypatch.delenv("MC_SPARSE_RACE_LEAD_IN", raising=False)
    log = []
    monkeypatch.setattr(mod.torch.cuda, "synchronize", lambda: log.append("|"))
    ms = {"fast": 0.25, "mid": 0.75, "slow": 50.0, "op": 2.0}

    def logged(name):
        fn = gpu_fn(name, ms[name], 5.0)  # a slow first call: the size estimate must come from a warmed-up call
        return lambda: (log.append(name), fn())

    rounds, target = 6, 20.0
    mod.race({k: logged(k) for k in ms}, rounds=rounds, target_ms=target)
    segments = "".join(x if x == "|" else x + "," for x in log).split("|")[:-1]
    samples = [s.rstrip(",").split(",") for s in segments[len(ms):]]
    assert len(samples) == rounds * len(ms)
    expect = {k: max(1, round(target / 4 / v)) + max(1, round(target / v)) for k, v in ms.items()}
    assert expect == {"fast": 20 + 80, "mid": 7 + 27, "slow": 1 + 1, "op": 2 + 10}
    for s in samples:
        assert len(set(s)) == 1 and len(s) == expect[s[0]]
    orders = [tuple(s[0] for s in samples[r * len(ms):(r + 1) * len(ms)]) for r in range(rounds)]
    assert all(sorted(o) == sorted(ms) for o in orders)
    assert len(set(orders)) > 1  # shuffled each round, not one fixed order
