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


def test_samples_give_each_timed_sample_in_time_order(timing, monkeypatch):
    """``samples``: per fn its timed samples as (round, position, predecessor, ms per call), one per round, in the
    race's order; the race's figure is their median; a slow sample shows as it was."""
    mod, gpu_fn = timing
    monkeypatch.delenv("MC_SPARSE_RACE_LEAD_IN", raising=False)
    times = {"dense": 10.0, "op": 1.0, "again": 3.0}
    state = {"op_samples": 0, "log": []}

    def logged(name):
        fn = gpu_fn(name, times[name], 0.0)
        slow = gpu_fn(name, times[name] + 2.0, 0.0)

        def call():  # the op's first timed sample (after the size estimate's synchronize) runs 2 ms slower per call
            state["log"].append(name)
            (slow if name == "op" and state["op_samples"] == 1 else fn)()
        return call

    def sync():  # each sample ends with a synchronize: count the op's
        if state["log"] and state["log"][-1] == "op":
            state["op_samples"] += 1
        state["log"].append("|")

    monkeypatch.setattr(mod.torch.cuda, "synchronize", sync)
    got = {}
    ms = mod.race({k: logged(k) for k in times}, rounds=4, target_ms=20.0, samples=got)
    assert sorted(got) == sorted(times)
    segs = "".join(x if x == "|" else x + "," for x in state["log"]).split("|")[len(times):-1]
    order = [seg.split(",")[0] for seg in segs]  # the timed samples' fns in time order
    flat = sorted((r, p, prev, k) for k, v in got.items() for (r, p, prev, _) in v)
    assert [k for *_, k in flat] == order
    assert [prev for _, _, prev, _ in flat] == [None] + order[:-1]
    assert [p for _, p, _, _ in flat] == [0, 1, 2] * 4
    for k, v in got.items():
        assert [r for r, *_ in v] == [0, 1, 2, 3]
        mid = sorted(t for *_, t in v)[1:3]
        assert ms[k] == pytest.approx(sum(mid) / 2)
    op = [t for *_, t in got["op"]]
    assert op[0] == pytest.approx(3.0) and op[1:] == [pytest.approx(1.0)] * 3


@pytest.mark.parametrize("n", [2, 3, 5, 6])
def test_balanced_orders_balance_position_and_predecessor(timing, n):
    """Williams design: over n rounds (n even) or 2n (n odd) every name at every position and right after every other
    name equally often within a round; the race times that sequence with order="balanced"."""
    mod, gpu_fn = timing
    names = [f"f{i}" for i in range(n)]
    period = n if n % 2 == 0 else 2 * n
    plan = mod.balanced_orders(names, period)
    assert all(sorted(o) == names for o in plan)
    pos = {(k, i): 0 for k in names for i in range(n)}
    pairs = {(a, b): 0 for a in names for b in names if a != b}
    for o in plan:
        for i, k in enumerate(o):
            pos[k, i] += 1
        for a, b in zip(o, o[1:]):
            pairs[a, b] += 1
    assert set(pos.values()) == {period // n} and set(pairs.values()) == {period // n}
    got = {}
    mod.race({k: gpu_fn(k, 1.0 + i, 0.0) for i, k in enumerate(names)}, rounds=period, target_ms=5.0, samples=got,
             order="balanced")
    timed = sorted((r, p, k) for k, v in got.items() for (r, p, _, _) in v)
    assert [[k for r, _, k in timed if r == rnd] for rnd in range(period)] == plan
    with pytest.raises(ValueError):
        mod.race({"a": gpu_fn("a", 1.0, 0.0)}, rounds=1, target_ms=5.0, order="sorted")


@pytest.mark.parametrize("order", ["random", "balanced"])
def test_warm_up_runs_the_first_fn_before_the_first_sample(timing, monkeypatch, order):
    """warm_up: after the size estimates and before the first timed sample, the first fn of round 0's order runs
    about target_ms of untimed calls (then a synchronize); the first sample's predecessor is that fn; without it the
    first sample's predecessor is None and no calls come between the estimates and the first sample's lead-in."""
    mod, gpu_fn = timing
    monkeypatch.delenv("MC_SPARSE_RACE_LEAD_IN", raising=False)
    times = {"a": 1.0, "b": 2.0, "c": 4.0}
    for warm in (False, True):
        log = []
        monkeypatch.setattr(mod.torch.cuda, "synchronize", lambda: log.append("|"))

        def logged(name):
            fn = gpu_fn(name, times[name], 0.0)
            return lambda: (log.append(name), fn())

        got = {}
        mod.race({k: logged(k) for k in times}, rounds=3, target_ms=20.0, samples=got, order=order, warm_up=warm)
        segs = [seg.strip(",").split(",") for seg in "".join(x if x == "|" else x + "," for x in log).split("|")[:-1]]
        first = min((v[0] for v in got.values()), key=lambda x: (x[0], x[1]))
        k0 = next(k for k, v in got.items() if v[0] == first)
        lead = max(1, round(20.0 / 4 / times[k0]))
        reps = max(1, round(20.0 / times[k0]))
        if warm:
            assert segs[len(times)] == [k0] * reps  # the warm-up segment, then the first sample
            assert segs[len(times) + 1] == [k0] * (lead + reps) and first[2] == k0
        else:
            assert segs[len(times)] == [k0] * (lead + reps) and first[2] is None
