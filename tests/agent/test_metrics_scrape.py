"""Scrape real ``elastic agent`` nodes training the mlp job, before and after a kill.

Everything is real: etcd, two agents as process trees, gloo workers writing multiprocess
metrics, the agents' /metrics over HTTP. Checked: what the dashboard queries exists,
counters rise, world size follows the kill, all-reduce bytes match the model's gradient
size per step, and a restart neither double counts nor loses a counter.

The node killed holds rank 0, so the survivor's worker goes from rank 1 to rank 0: its
``elastic_steps_total`` must equal, rank by rank, the steps its progress file records
(dead worker pids are summed once, not twice), and for the gone rank 1 exactly what
docs/metrics.md documents may remain: its counters and histograms, flat; none of its
gauges.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from agent.etcd import EmbeddedEtcd
from elastic.jobs.mlp import make_model
from tests.elastic.metrics.scrape import Samples, fetch_samples
from tests.support.dashboard import family, is_external, load, queried_metrics
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until
from agent.local.local_node import AUTO_METRICS_PORT
from tests.support.metrics_url import metrics_url

NOT_IN_MLP = {"elastic_tokens_total"}  # the mlp job defines no tokens (documented in metrics.md)
AFTER_A_FAULT = {"elastic_last_fault_timestamp_seconds", "elastic_last_fault_phase_seconds"}  # the fault timeline
DOCS = Path(__file__).resolve().parents[2] / "docs"


def scrape(node: Node) -> Samples:
    return fetch_samples(metrics_url(node))


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def series_kept_for_a_gone_rank() -> set[str]:
    """docs/metrics.md, "What happens at a restart": a gone rank's counters (histograms too,
    as "all counters and histograms" are summed over dead pids) stay; its gauges vanish.
    The sample names of every ``rank``-labelled counter and histogram in the catalogue."""
    catalogue = re.findall(r"^\| `(elastic_[a-z_]+)` \| (\w+) \| ([^|]*)\|", (DOCS / "metrics.md").read_text(), re.M)
    kept = set()
    for name, kind, labels in catalogue:
        if "`rank`" in labels and kind == "counter":
            kept.add(name)
        elif "`rank`" in labels and kind == "histogram":
            kept |= {name + "_bucket", name + "_count", name + "_sum"}
    assert {"elastic_steps_total", "elastic_step_duration_seconds_count"} <= kept and "elastic_rank" not in kept
    return kept - NOT_IN_MLP


def steps_by_rank(rows: list[dict[str, Any]]) -> Counter[str]:
    """Steps a node's progress file records, by the global rank that took them."""
    return Counter(str(r["rank"]) for r in rows)


def of_rank(samples: Samples, rank: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(name, tuple(sorted(lab.items()))): v for name, rows in samples.items()
            for lab, v in rows if lab.get("rank") == rank}


def test_metrics_of_a_real_run_follow_training_and_a_kill(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    job = ["--job", "mlp", "--steps", "100000", "--snapshot-dir", str(tmp_path / "snaps"),
           "--snapshot-every-steps", "10", "--step-sleep", "0.02", "--progress", "{progress}"]
    a, b = (nodes(name=n, endpoint=etcd_server.endpoint, run_id=run_id, module="elastic.train", module_args=job,
                  metrics_port=AUTO_METRICS_PORT, agent_args=["--lease-ttl", "2"]) for n in ("a", "b"))
    wait_until(lambda: len(a.steps_at(2)) >= 30 and len(b.steps_at(2)) >= 30, 120,
               "two nodes to train 30 steps", on_timeout=lambda: a.log_tail() + b.log_tail())

    first = {n.name: scrape(n) for n in (a, b)}
    exposed = {family(name) for s in first.values() for name in s}
    wanted = {family(m) for m in queried_metrics(load()) if not is_external(m)} - NOT_IN_MLP - AFTER_A_FAULT
    assert wanted <= exposed, f"dashboard queries metrics no node exports: {sorted(wanted - exposed)}"

    gradient_bytes = sum(p.numel() for p in make_model().parameters()) * 4
    for node in (a, b):
        s = first[node.name]
        assert total(s, "elastic_world_size") == 2
        assert total(s, "elastic_agent_nodes_in_round") == 2
        steps = total(s, "elastic_steps_total")
        sent = total(s, "elastic_collective_bytes_total", op="allreduce", backend="gloo")
        assert steps >= 30
        # bytes are counted when a bucket is enqueued, steps when the step commits
        assert steps * gradient_bytes <= sent <= (steps + 1) * gradient_bytes, (steps, sent, gradient_bytes)
        assert total(s, "elastic_snapshot_last_durable_timestamp_seconds") > 0 or node.progress()[-1]["rank"] != 0

    wait_until(lambda: total(scrape(a), "elastic_steps_total") > total(first["a"], "elastic_steps_total") + 5,
               30, "a's step counter to rise")

    # Kill the node that holds rank 0: the survivor's worker moves from rank 1 to rank 0.
    victim, survivor = (a, b) if a.progress()[-1]["rank"] == 0 else (b, a)
    assert (survivor.progress()[-1]["rank"], survivor.progress()[-1]["world_size"]) == (1, 2)
    before = scrape(survivor)
    killed_at = time.time()
    victim.kill()
    wait_until(lambda: len(survivor.steps_at(1, after=killed_at)) >= 10, 90, "the survivor to train alone",
               on_timeout=survivor.log_tail)
    counted_before = steps_by_rank(survivor.progress())
    after = scrape(survivor)
    counted_after = steps_by_rank(survivor.progress())
    assert total(after, "elastic_world_size") == 1  # the dead worker's gauge is gone, not averaged in
    wait_until(lambda: AFTER_A_FAULT <= {family(name) for name in scrape(survivor)}, 10,
               "the survivor to export the fault timeline the dashboard shows")
    assert total(after, "elastic_agent_nodes_in_round") == 1
    # the mlp job runs in place: the survivor re-formed its world without a restart
    assert total(after, "elastic_agent_inplace_reforms_total") >= 1
    # the old worker's counters stay (multiprocess files of dead pids), the new one adds on
    assert total(after, "elastic_steps_total") > total(before, "elastic_steps_total")
    # The survivor's worker start is timed where its state came from: a load from disk (or a
    # fresh start) in elastic_restore_seconds; a heal from the other node's replica, when it
    # came up second and joined a world already training, in elastic_heal_seconds.
    if total(after, "elastic_restores_total", source="replica") > 0:
        assert total(after, "elastic_heal_seconds") > 0
    else:
        assert total(after, "elastic_restore_seconds") > 0

    # No double counting: every rank's step counter is the steps the progress file records
    # (the live rank 0 bracketed by reading the file before and after the scrape).
    assert counted_before["1"] == counted_after["1"] > 0, "rank 1 took steps after the restart"
    assert total(after, "elastic_steps_total", rank="1") == counted_after["1"]
    assert counted_before["0"] <= total(after, "elastic_steps_total", rank="0") <= counted_after["0"], \
        (total(after, "elastic_steps_total", rank="0"), counted_before, counted_after)
    assert sum(counted_before.values()) <= total(after, "elastic_steps_total") <= sum(counted_after.values())
    for histogram in ("elastic_step_duration_seconds_count", "elastic_data_wait_seconds_count"):
        assert total(after, histogram, rank="1") == counted_after["1"], histogram
    # No stale series: the live ranks are rank 0 alone, and rank 1 keeps exactly its
    # documented counters and histograms (none of its gauges), flat while rank 0 trains on.
    assert [lab["rank"] for lab, _ in after["elastic_rank"]] == ["0"]
    assert {name for name, _ in of_rank(after, "1")} == series_kept_for_a_gone_rank()
    trained = len(survivor.progress())
    wait_until(lambda: len(survivor.progress()) >= trained + 5, 30, "the survivor to train on",
               on_timeout=survivor.log_tail)
    later = scrape(survivor)
    assert of_rank(later, "1") == of_rank(after, "1"), "a gone rank's counters moved"
    assert total(later, "elastic_steps_total", rank="0") > total(after, "elastic_steps_total", rank="0")
