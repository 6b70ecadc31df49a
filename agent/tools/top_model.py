"""What ``elastic top`` shows, computed from two scrapes of each node: pure functions, no I/O.

Counters and histograms only mean something over a window, so every rate and quantile
here is the difference between the previous and the current scrape of the same node,
as Prometheus' ``rate()`` and ``histogram_quantile()`` would compute them. A node whose
counters went down (its agent restarted) is read from zero, as ``rate()`` does.

The same definitions as ``deploy/prometheus/rules/recording.yml``:
- bus bandwidth of all-reduce = bytes / all-reduce seconds × 2(n−1)/n (nccl-tests);
- a straggler is a rank whose step-time p50 is ``ratio`` times the median rank's or more.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families

from elastic.goodput.account import Account
from elastic.goodput.report import describe, describe_fault, seconds

Labels = Mapping[str, str]
DEFAULT_STRAGGLER_RATIO = 1.2
SPARE = "spare"  # the registry state of a node waiting beside a full world (agent.rendezvous.rounds.waits_as_spare)
SPARE_NOTE = "spare: takes the next lost node's place"


@dataclass(frozen=True)
class Exposition:
    """Samples of one scrape by sample name (``elastic_steps_total``, ``..._bucket``)."""

    samples: Mapping[str, tuple[tuple[Labels, float], ...]]

    @classmethod
    def parse(cls, text: str) -> "Exposition":
        """Parse Prometheus text exposition; raises ValueError on text that is not."""
        grouped: dict[str, list[tuple[Labels, float]]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                grouped.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
        return cls({name: tuple(rows) for name, rows in grouped.items()})

    def series(self, name: str, **match: str) -> list[tuple[Labels, float]]:
        return [(labels, value) for labels, value in self.samples.get(name, ())
                if all(labels.get(k) == v for k, v in match.items())]

    def total(self, name: str, **match: str) -> float | None:
        """Sum of the matching series, or None if there are none."""
        rows = self.series(name, **match)
        return sum(value for _, value in rows) if rows else None

    def ranks(self) -> list[str]:
        """Live ranks: ``elastic_rank`` drops a dead worker's series; else every rank seen."""
        source = "elastic_rank" if "elastic_rank" in self.samples else "elastic_steps_total"
        found = {labels["rank"] for labels, _ in self.samples.get(source, ()) if "rank" in labels}
        return sorted(found, key=lambda r: (not r.isdigit(), int(r) if r.isdigit() else 0, r))


@dataclass(frozen=True)
class NodeScrape:
    """One node at one moment: what the registry says and what its endpoint served."""

    node: str
    state: str
    at: float  # unix time of the scrape
    metrics: Exposition | None = None
    error: str | None = None
    note: str = ""  # what the node says of itself beyond its state, e.g. why it is kept out


def increase(cur: float | None, prev: float | None) -> float | None:
    """Counter increase between scrapes; a reset (the value went down) counts from zero."""
    if cur is None or prev is None:
        return None
    return cur if cur < prev else cur - prev


def quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile`` over ``(upper_bound, cumulative_count)`` pairs."""
    ordered = sorted(buckets)
    if len(ordered) < 2 or not math.isinf(ordered[-1][0]) or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for upper, count in ordered:
        if count >= rank:
            if math.isinf(upper):
                return lower_bound  # in +Inf: the highest finite bound, as Prometheus says
            if count == lower_count:
                return upper
            if lower_bound > upper:  # first bucket with a negative bound: no interpolation
                return upper
            return lower_bound + (upper - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = upper, count
    return None


def bucket_increase(cur: Exposition, prev: Exposition | None, name: str, **match: str) -> list[tuple[float, float]]:
    """Cumulative bucket counts observed between two scrapes, summed over matching series."""
    def by_le(exp: Exposition) -> dict[float, float]:
        out: dict[float, float] = {}
        for labels, value in exp.series(name + "_bucket", **match):
            le = float(labels["le"])
            out[le] = out.get(le, 0.0) + value
        return out

    now, before = by_le(cur), (by_le(prev) if prev else {})
    reset = any(now[le] < before.get(le, 0.0) for le in now)
    return [(le, count if reset or prev is None else count - before.get(le, 0.0)) for le, count in now.items()]


def busbw_factor(world_size: float | None) -> float | None:
    """All-reduce moves 2(n−1)/n of the buffer over each link (nccl-tests' bus bandwidth)."""
    if not world_size or world_size < 1:
        return None
    return 2 * (world_size - 1) / world_size


@dataclass(frozen=True)
class RankView:
    node: str
    rank: str
    state: str
    steps: float | None
    samples_per_s: float | None
    step_p50: float | None
    step_p99: float | None
    allreduce_s_per_step: float | None  # the node's mean over its ranks
    busbw: float | None  # bytes/s, the node's
    snapshot_age_s: float | None  # the node's newest durable snapshot
    restarts: float | None
    straggler_ratio: float | None = None
    straggler: bool = False
    compute_s: float | None = None  # median own work per step (elastic_step_compute_seconds): a straggler's is high


@dataclass(frozen=True)
class NodeView:
    node: str
    state: str
    error: str | None
    ranks: tuple[RankView, ...]
    note: str = ""


@dataclass(frozen=True)
class JobView:
    nodes: tuple[NodeView, ...]
    world_size: int | None
    samples_per_s: float | None
    snapshot_age_s: float | None
    stragglers: tuple[str, ...] = field(default=())  # "node/rank"
    goodput: Account | None = None  # the job's record in etcd (agent.node.goodput), read beside the scrapes
    spares: tuple[str, ...] = field(default=())  # nodes waiting to replace a lost member


def spares(scrapes: Iterable[NodeScrape]) -> tuple[str, ...]:
    """The nodes that wait as spares, by name: how many losses the job absorbs at full size."""
    return tuple(sorted(s.node for s in scrapes if s.state == SPARE))


def node_note(scrape: NodeScrape) -> str:
    """What the note column says of a node: its own word, else what its state means for the job."""
    return scrape.note or (SPARE_NOTE if scrape.state == SPARE else "")


def goodput_lines(account: Account | None, now: float) -> list[str]:
    """Goodput since the first step, and the latest fault's phases (``elastic top``'s footer)."""
    if account is None:
        return ["goodput: no record yet (agents of this version record it once the job has stepped)"]
    lines = [describe(account)]
    if account.faults:
        last = account.faults[-1]
        lines.append(f"last fault {fmt_seconds(max(0.0, now - last.at))} ago, {describe_fault(last)}")
    return lines


def _delta(cur: Exposition, prev: Exposition | None, name: str, **match: str) -> float | None:
    """A counter's increase since the previous scrape; a series new since then started at 0."""
    if prev is None:
        return None
    return increase(cur.total(name, **match), prev.total(name, **match) or 0.0)


def _per_second(cur: Exposition, prev: Exposition | None, dt: float, name: str, **match: str) -> float | None:
    delta = _delta(cur, prev, name, **match)
    return None if delta is None or dt <= 0 else delta / dt


def _node_ranks(scrape: NodeScrape, prev: NodeScrape | None) -> list[RankView]:
    cur = scrape.metrics
    if cur is None:
        return []
    before = prev.metrics if prev is not None and prev.metrics is not None else None
    dt = scrape.at - prev.at if prev is not None else 0.0
    world = cur.total("elastic_world_size")
    ar = {"op": "allreduce"}
    ar_bytes = _delta(cur, before, "elastic_collective_bytes_total", **ar)
    ar_time = _delta(cur, before, "elastic_collective_duration_seconds_sum", **ar)
    node_steps = _delta(cur, before, "elastic_steps_total")
    factor = busbw_factor(world)
    busbw = ar_bytes / ar_time * factor if ar_bytes is not None and ar_time and factor is not None else None
    ar_per_step = ar_time / node_steps if ar_time is not None and node_steps else None
    durable = cur.total("elastic_snapshot_last_durable_timestamp_seconds")
    age = max(0.0, scrape.at - durable) if durable else None
    restarts = cur.total("elastic_agent_restarts_total")
    if restarts is None:
        restarts = cur.total("elastic_worker_restarts")

    rows = []
    for rank in cur.ranks():
        window = bucket_increase(cur, before, "elastic_step_duration_seconds", rank=rank) if before else []
        rows.append(RankView(
            node=scrape.node, rank=rank, state=scrape.state,
            steps=cur.total("elastic_steps_total", rank=rank),
            samples_per_s=_per_second(cur, before, dt, "elastic_samples_total", rank=rank),
            step_p50=quantile(0.5, window), step_p99=quantile(0.99, window),
            allreduce_s_per_step=ar_per_step, busbw=busbw, snapshot_age_s=age, restarts=restarts,
            compute_s=_compute(cur, rank),
        ))
    return rows


def _compute(cur: Exposition, rank: str) -> float | None:
    value = cur.total("elastic_step_compute_seconds", rank=rank)
    return value if value is not None and value >= 0 else None


def _pace(r: RankView, by_compute: bool) -> float | None:
    return r.compute_s if by_compute else r.step_p50


def mark_stragglers(rows: list[RankView], ratio: float) -> list[RankView]:
    """Flag ranks whose pace is ``ratio`` times the median rank's or more.

    The pace is the rank's compute per step where every timed rank exports it (``ElasticRun``):
    in data-parallel training every rank's step takes as long as the slowest's, so only the
    compute tells the straggler from those waiting for it. Else the step p50."""
    by_compute = sum(1 for r in rows if r.compute_s) >= 2
    timed = [p for p in (_pace(r, by_compute) for r in rows) if p]
    if len(timed) < 2:
        return rows
    median = statistics.median(timed)
    out = []
    for r in rows:
        pace = _pace(r, by_compute)
        share = pace / median if pace and median > 0 else None
        out.append(replace(r, straggler_ratio=share, straggler=share is not None and share >= ratio))
    return out


def build_view(current: Mapping[str, NodeScrape], previous: Mapping[str, NodeScrape],
               ratio: float = DEFAULT_STRAGGLER_RATIO) -> JobView:
    """The job as ``elastic top`` shows it, from this round of scrapes and the last one."""
    names = sorted(current)
    rows = mark_stragglers([row for n in names for row in _node_ranks(current[n], previous.get(n))], ratio)
    by_node: dict[str, list[RankView]] = {n: [] for n in names}
    for row in rows:
        by_node[row.node].append(row)
    nodes = tuple(NodeView(n, current[n].state, current[n].error, tuple(by_node[n]), node_note(current[n]))
                  for n in names)
    worlds = [s.metrics.total("elastic_world_size") for s in current.values() if s.metrics]
    world = max((w for w in worlds if w is not None), default=None)
    rates = [r.samples_per_s for r in rows if r.samples_per_s is not None]
    ages = [r.snapshot_age_s for r in rows if r.snapshot_age_s is not None]
    return JobView(
        nodes=nodes,
        world_size=int(world) if world is not None else None,
        samples_per_s=sum(rates) if rates else None,
        snapshot_age_s=min(ages) if ages else None,
        stragglers=tuple(f"{r.node}/{r.rank}" for r in rows if r.straggler),
        spares=spares(current.values()),
    )


# -- formatting: short, fixed-width-friendly, SI -------------------------------------------
def fmt_seconds(value: float | None) -> str:
    return "-" if value is None else seconds(value, fine=True)


def fmt_rate(value: float | None, unit: str = "/s") -> str:
    if value is None:
        return "-"
    sep = " " if unit[:1].isalpha() else ""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{sep}{prefix}{unit}"
    return f"{value:.1f}{sep}{unit}"


def fmt_count(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
