"""Straggler rules with synthetic timings: the worker's step split, the naming rule, eviction."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent.node.pace import PaceMonitor
from agent.rendezvous.session import EtcdSession
from agent.node.policy import straggler_out
from agent.node.stragglers import MIN_LAG_S, Pace, Straggler, StragglerWatch, eviction, slowest
from elastic.metrics.step_split import SKIP_STEPS, StepSplit


# ---------------------------------------------------------------------- the worker's split

def test_compute_is_the_step_less_its_data_and_collective_wait() -> None:
    split = StepSplit(window=5, skip=0, min_steps=1)
    out = split.add(step_seconds=0.30, data_wait_seconds=0.05, collective_seconds=0.10)
    assert out is not None and out.compute == pytest.approx(0.15) and out.collective == pytest.approx(0.10)


def test_the_first_steps_of_a_world_and_a_single_pause_move_no_median() -> None:
    split = StepSplit(window=9, skip=SKIP_STEPS, min_steps=5)
    assert split.add(5.0, 0.0, 0.0) is None  # the first step: warm-up, left out
    assert split.add(1.0, 0.0, 0.0) is None
    for _ in range(7):
        split.add(0.1, 0.0, 0.0)
    split.add(3.0, 0.0, 0.0)  # a GC pause (or a snapshot's capture)
    assert split.current is not None and split.current.compute == pytest.approx(0.1)
    split.reset()
    assert split.current is None


def test_a_snapshot_stall_is_not_compute() -> None:
    split = StepSplit(window=3, skip=0, min_steps=1)
    out = split.add(0.5, 0.0, 0.1, snapshot_seconds=0.3)  # rank 0 submitting a snapshot every step
    assert out is not None and out.compute == pytest.approx(0.1)


def test_collective_wait_never_exceeds_the_step_it_was_in() -> None:
    split = StepSplit(window=3, skip=0, min_steps=1)
    out = split.add(0.1, 0.02, 0.5)  # a CUDA timing read late: counted once the step is over
    assert out is not None and out.compute == 0.0 and out.collective == pytest.approx(0.08)


# ---------------------------------------------------------------------- the rule

def feed(watch: StragglerWatch, windows: list[dict[str, float]], steps_per_window: int = 10) -> list[Straggler | None]:
    out = []
    for i, paces in enumerate(windows):
        out.append(watch.observe({n: Pace(v, (i + 1) * steps_per_window) for n, v in paces.items()}))
    return out


def test_a_persistently_slow_node_is_named_after_three_windows() -> None:
    got = feed(StragglerWatch(), [{"a": 0.1, "b": 0.1, "c": 0.2}] * 4)
    assert got[:2] == [None, None]
    assert got[2] is not None and got[2].node == "c" and got[2].windows == 3 and got[2].ratio == pytest.approx(2.0)
    assert got[3] is not None and got[3].windows == 4
    assert "node c is a straggler: 200 ms" in got[2].describe()


def test_a_one_off_pause_is_not_a_straggler() -> None:
    base = {"a": 0.1, "b": 0.1, "c": 0.1}
    got = feed(StragglerWatch(), [base, {**base, "b": 0.5}, base, {**base, "b": 0.5}, base])
    assert got == [None] * 5


def test_a_uniformly_slow_world_has_no_straggler() -> None:
    assert feed(StragglerWatch(), [{"a": 0.1, "b": 0.1}, {"a": 0.4, "b": 0.41}, {"a": 0.4, "b": 0.4}] * 2) == [None] * 6


def test_slowness_under_the_factor_is_not_straggling() -> None:
    assert feed(StragglerWatch(), [{"a": 0.1, "b": 0.1, "c": 0.14}] * 5) == [None] * 5


def test_a_lag_of_a_few_milliseconds_is_noise_whatever_its_factor() -> None:
    # rank 0 of a job of 3 ms steps on a loaded machine: 4x its peer, for seconds, and healthy
    assert feed(StragglerWatch(), [{"a": 0.014, "b": 0.0035}] * 5) == [None] * 5
    assert slowest({"a": 0.014, "b": 0.0035}) is None
    assert slowest({"a": 0.0045 + MIN_LAG_S, "b": 0.0035})[0] == "a"
    assert slowest({"a": 0.3, "b": 0.25}) is None  # 50 ms behind, but under the factor


def test_a_window_counts_only_once_every_member_stepped_on() -> None:
    watch = StragglerWatch(windows=2)
    slow = {"a": Pace(0.1, 10), "b": Pace(0.3, 10)}
    assert watch.observe(slow) is None
    assert watch.observe(slow) is None  # the same figures again: no new window
    assert watch.observe({"a": Pace(0.1, 20), "b": Pace(0.3, 12)}) is None  # b's figure is stale
    assert watch.observe({"a": Pace(0.1, 20), "b": Pace(0.3, 20)}) is not None


def test_a_named_straggler_stays_named_between_windows() -> None:
    """A look that finds no new window (the agent looks more often than members step) keeps
    the last verdict: returning None there logged "no longer lags" and named it again a
    look later, over and over."""
    watch = StragglerWatch(windows=2)
    assert watch.observe({"a": Pace(0.1, 10), "b": Pace(0.3, 10)}) is None
    named = watch.observe({"a": Pace(0.1, 20), "b": Pace(0.3, 20)})
    assert named is not None and named.node == "b"
    assert watch.observe({"a": Pace(0.1, 22), "b": Pace(0.3, 21)}) == named  # no new window yet
    assert watch.observe({"a": Pace(0.1, 30), "b": Pace(0.1, 30)}) is None  # a window: it caught up


def test_a_member_without_a_figure_and_a_new_world_start_the_count_again() -> None:
    watch = StragglerWatch(windows=2)
    assert watch.observe({"a": Pace(0.1, 10), "b": Pace(0.3, 10)}) is None
    assert watch.observe({"a": Pace(0.1, 20), "b": None}) is None  # b restarted: no figure yet
    assert watch.observe({"a": Pace(0.1, 30), "c": Pace(0.3, 5)}) is None  # another world: one window
    assert watch.observe({"a": Pace(0.1, 40), "c": Pace(0.3, 15)}) is not None


def test_a_slow_first_step_is_not_in_any_figure_so_never_named() -> None:
    # the worker leaves each world's first steps out of its median: its figure is its steady pace
    split = StepSplit()
    figures = [split.add(5.0 if i == 0 else 0.1, 0.0, 0.0) for i in range(10)]
    paces = [f.compute for f in figures if f is not None]
    assert paces and max(paces) == pytest.approx(0.1)


def test_slowest_needs_two_nodes_and_names_one() -> None:
    assert slowest({"a": 5.0}) is None
    assert slowest({"a": 0.0, "b": 0.1}) is None  # no real figure to compare with
    assert slowest({"a": 0.1, "b": 0.3, "c": 0.31})[0] == "c"
    # two slow nodes: one eviction at a time, the slowest first
    assert slowest({"a": 0.1, "b": 0.3, "c": 0.31, "d": 0.1, "e": 0.1})[0] == "c"


# ---------------------------------------------------------------------- eviction

def test_a_spare_means_evict() -> None:
    s = Straggler("b", 0.16, 0.1, 3)
    assert eviction(s, world=2, min_nodes=2, spares=1) == "a spare waits to take its place"
    assert eviction(s, world=2, min_nodes=2, spares=0) is None  # 2:2 and no spare: it stays


def test_without_a_spare_evict_only_when_the_smaller_world_is_faster() -> None:
    assert eviction(Straggler("b", 0.25, 0.1, 3), world=2, min_nodes=1, spares=0) is not None  # 2.5x > 2
    assert eviction(Straggler("b", 0.18, 0.1, 3), world=2, min_nodes=1, spares=0) is None  # 1.8x < 2
    assert eviction(Straggler("b", 0.16, 0.1, 3), world=4, min_nodes=1, spares=0) is not None  # 1.6x > 4/3
    assert eviction(Straggler("b", 0.3, 0.1, 3), world=4, min_nodes=4, spares=0) is None  # below MIN without it
    assert eviction(Straggler("b", 0.3, 0.1, 3), world=1, min_nodes=1, spares=1) is None


# ---------------------------------------------------------------------- the agent's monitor, etcd faked

class _Gauge:
    def __init__(self) -> None:
        self.values: dict[Any, float] = {}

    def labels(self, **kw: str) -> "_Gauge":
        self._key = tuple(kw.values())
        return self

    def set(self, v: float) -> None:
        self.values[getattr(self, "_key", ())] = v

    def inc(self) -> None:
        self.values[()] = self.values.get((), 0) + 1


class _Handler:
    def __init__(self) -> None:
        self.records: dict[str, SimpleNamespace] = {}
        self.lease = SimpleNamespace(update=self._update)
        self.me = "a"

    def _update(self, **kw: Any) -> None:
        self.records[self.me].__dict__.update(kw)

    def node_records(self) -> dict[str, SimpleNamespace]:
        return self.records


def test_the_monitor_names_and_evicts_only_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import agent.node.pace as pace

    handler = _Handler()
    for n, state in (("a", "running"), ("b", "running"), ("c", "spare")):
        handler.records[n] = SimpleNamespace(state=state, pace=None, pace_step=None)
    metrics = SimpleNamespace(pace=_Gauge(), straggler=_Gauge(), straggler_evictions=_Gauge())
    mine = {"compute": 0.1, "step": 0}
    monkeypatch.setattr(pace, "local_pace", lambda _d: mine["compute"])
    monkeypatch.setattr(pace, "local_step", lambda _d: mine["step"])
    session = EtcdSession(handler)  # the two calls the monitor makes of the rendezvous
    monitors = {n: PaceMonitor(n, session, metrics, tmp_path, tmp_path, period=0.0) for n in ("a", "b")}
    said = {}
    for window in range(1, 5):
        for n, compute in (("a", 0.1), ("b", 0.3)):
            handler.me, mine["compute"], mine["step"] = n, compute, window * 10
            said[n] = monitors[n].look(("a", "b"))
    a, b = said["a"], said["b"]
    assert a is not None and b is not None and a.straggler.node == b.straggler.node == "b"  # both name b
    assert straggler_out(a, min_nodes=2) == ""  # a names b but leaves the eviction to b's own agent
    assert "evicted: a spare waits" in straggler_out(b, min_nodes=2) and b.spares == 1
    assert metrics.straggler.values[("b",)] == 1


# ---------------------------------------------------------------------- the worker's gauges

def test_a_worker_exports_its_median_compute_and_drops_it_with_its_old_rank() -> None:
    from elastic.metrics.catalogue import families
    from elastic.metrics.worker import WorkerMetrics

    fam = families.__wrapped__()  # a private set: this test's values only
    worker = WorkerMetrics(0, 2, backend="gloo", device="cpu", torch_version="x", restart_count=0, fam=fam)

    def value(name: str, rank: str) -> float | None:
        return fam.registry.get_sample_value(name, {"rank": rank})

    for _ in range(10):
        worker.step_done(16, 0.30, 0.05, collective_seconds=0.20)
    assert value("elastic_step_compute_seconds", "0") == pytest.approx(0.05)
    assert value("elastic_step_collective_wait_seconds", "0") == pytest.approx(0.20)
    worker.rank_changed(1, 2)  # in place: the old rank's figure goes, the new one starts over
    assert value("elastic_step_compute_seconds", "0") is None
    worker.step_done(16, 0.30, 0.05, collective_seconds=0.20)
    assert value("elastic_step_compute_seconds", "1") is None  # warm-up steps of the new world
    fresh = WorkerMetrics(0, 2, backend="gloo", device="cpu", torch_version="x", restart_count=0,
                          fam=families.__wrapped__())
    fresh.step_done(16, 0.30, 0.05)
    fresh.rank_changed(1, 2)  # before any figure: nothing to retire, and no 0 that reads as a pace
    assert fresh.families.registry.get_sample_value("elastic_step_compute_seconds", {"rank": "0"}) is None
