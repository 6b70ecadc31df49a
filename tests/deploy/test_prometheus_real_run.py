"""A real Prometheus scrapes a real run that it finds through ``elastic sd``, before and after a kill.

Everything is real; nothing is a stand-in:
- etcd;
- two ``elastic agent`` nodes (process trees) training the mlp job on gloo;
- ``elastic sd``, listing the nodes from the etcd registry under the job key;
- ``prometheus``, run on the shipped prometheus.yml and rules. Only the intervals and
  the sd URL are shortened.

Checked is what a user looks at: both nodes are ``up`` targets, the samples/s and
all-reduce bus-bandwidth recording rules return data for the run (busbw = algbw at n = 2),
every rule evaluates cleanly, every recording rule, every metric the docs name and every
dashboard query has data, and the metrics a user reads first have sane values. After one
node's tree is SIGKILLed, its target leaves http_sd, world size reads 1, samples/s
keeps coming from the survivor, and the kill is in the goodput fault timeline and the
dashboard's fault annotation, at the time it happened.
"""

from __future__ import annotations

import argparse
import re
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

import pytest

from agent.tools.etcd_args import connect
from agent.etcd import EmbeddedEtcd
from agent.local.local_node import AUTO_METRICS_PORT
from tests.support import dashboard as dash
from tests.support.nodes import TorchrunNode as Node
from tests.support.prometheus import RULES, PrometheusServer, ensure_prometheus, http_sd_config, start_sd, value_of
from tests.support.waiting import wait_until

JOB_KEY = "a-job-key-for-the-prometheus-test-0123456789"
DOCS = Path(__file__).resolve().parents[2] / "docs"
# The mlp job counts no tokens (docs/metrics.md: "Absent otherwise"), so neither the metric
# nor the rule over it has data.
NOT_IN_MLP = {"elastic_tokens_total", "job:elastic_tokens:rate1m"}
# The fault timeline has a series once there was a fault; this run has none until its end.
AFTER_A_FAULT = {"elastic_last_fault_timestamp_seconds", "elastic_last_fault_phase_seconds"}


@pytest.fixture(scope="module")
def prometheus_installed() -> str:
    return ensure_prometheus()


def documented_metrics() -> set[str]:
    """Every metric docs/metrics.md tabulates and docs/agent.md lists (the agent's own)."""
    worker = re.findall(r"^\| `(elastic_[a-z_]+)` \|", (DOCS / "metrics.md").read_text(), re.M)
    agent = re.findall(r"`(elastic_agent_[a-z_]+)", (DOCS / "agent.md").read_text())
    return set(worker) | set(agent)


def missing(families: set[str], names: set[str]) -> set[str]:
    """The families with no series among ``names`` (a histogram is there as NAME_bucket)."""
    return {f for f in families if not {f, f + "_bucket", f + "_count"} & names}


def single(prom: PrometheusServer, promql: str) -> float | None:
    """The value of a query that returns one series; None while it returns none (or several)."""
    rows = value_of(prom.query(promql))
    return next(iter(rows.values())) if len(rows) == 1 else None


def test_real_prometheus_scrapes_a_real_run_through_elastic_sd(
    prometheus_installed: str, etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    key_file = tmp_path / "job.key"
    key_file.write_text(JOB_KEY)
    job = ["--job", "mlp", "--steps", "100000", "--snapshot-dir", str(tmp_path / "snaps"),
           "--snapshot-every-steps", "10", "--step-sleep", "0.02", "--progress", "{progress}"]
    # The agents as the deploy files run them: the job key from the environment, a short lease.
    a, b = (nodes(name=n, endpoint=etcd_server.endpoint, run_id=run_id, module="elastic.train", module_args=job,
                  metrics_port=AUTO_METRICS_PORT, agent_args=["--lease-ttl", "2"],
                  env={"ELASTIC_RDZV_HMAC_KEY_FILE": str(key_file)}) for n in ("a", "b"))

    def logs() -> str:
        return a.log_tail() + b.log_tail()

    # `elastic sd` connects as its CLI does: the agents' endpoint, run id and job key.
    target = connect(argparse.Namespace(rdzv_endpoint=etcd_server.endpoint, rdzv_id=run_id,
                                        rdzv_conf=f"hmac_key_file={key_file}"))
    with ExitStack() as closers:  # run newest first, even when the test fails
        closers.callback(target.client.close)
        sd = start_sd(target)
        closers.callback(sd.server_close)
        closers.callback(sd.shutdown)
        prom = PrometheusServer(tmp_path / "prometheus", http_sd_config(sd))
        closers.callback(prom.stop)
        prom.start()
        run = f'run_id="{run_id}"'
        both_up = [("a", run_id, "up"), ("b", run_id, "up")]
        wait_until(lambda: prom.targets("elastic") == both_up, 120, "both agents as up targets through elastic sd",
                   on_timeout=lambda: f"{prom.targets('elastic')}\n{logs()}")

        samples = wait_until(lambda: value_of(prom.query(f"job:elastic_samples:rate1m{{{run}}} > 0")), 90,
                             "samples/s of the run from the recording rule", on_timeout=lambda: prom.tail() + logs())
        assert list(samples) == [(run_id, "", "")]

        busbw_rule = "node:elastic_allreduce_busbw_bytes_per_second:rate1m"
        busbw = wait_until(lambda: len(rows := value_of(prom.query(f"{busbw_rule}{{{run}}} > 0"))) == 2 and rows,
                           60, "all-reduce bus bandwidth of both nodes", on_timeout=prom.tail)
        assert sorted(busbw) == [(run_id, "a", ""), (run_id, "b", "")]
        # At n = 2 the bus factor 2(n-1)/n is 1: busbw equals algbw (pinned to one evaluation).
        at = time.time() - 2
        algbw = value_of(prom.query(f"node:elastic_allreduce_algbw_bytes_per_second:rate1m{{{run}}}", at))
        pinned = value_of(prom.query(f"{busbw_rule}{{{run}}}", at))
        assert pinned.keys() == algbw.keys() and all(pinned[k] == pytest.approx(algbw[k]) for k in algbw), \
            (pinned, algbw)
        world, two = f"elastic_world_size{{{run}}}", {(run_id, "a", ""): 2.0, (run_id, "b", ""): 2.0}
        wait_until(lambda: value_of(prom.query(world)) == two, 30, "both nodes' world size to read 2",
                   on_timeout=lambda: str(prom.query(world)))

        # Every rule evaluates cleanly on real data, and every recording rule has data for the run.
        records = set(re.findall(r"^\s*- record:\s*(\S+)", (RULES / "recording.yml").read_text(), re.M))
        wait_until(lambda: all(r["health"] != "unknown" for r in prom.rules())
                   and all(prom.query(f"{name}{{{run}}}") for name in records - NOT_IN_MLP), 30,
                   "every rule evaluated and every recording rule to have data for the run",
                   on_timeout=lambda: str([n for n in records if not prom.query(f"{n}{{{run}}}")]))
        bad = [(r["name"], r["health"], r.get("lastError")) for r in prom.rules() if r["health"] != "ok"]
        assert bad == [], "rules that failed to evaluate on a real run"
        # One worker per node: global ranks 0 and 1, each on its own node, each with a straggler ratio.
        ratio_rule = f"rank:elastic_step_duration_seconds:straggler_ratio_rate1m{{{run}}}"
        # a rate over 1m needs two scrapes of each rank's series: on a loaded machine that took over 30 s
        ratios = wait_until(lambda: len(rows := value_of(prom.query(ratio_rule))) == 2 and rows, 90,
                            "straggler ratios of both ranks", on_timeout=lambda: str(prom.query(ratio_rule)))
        assert sorted(k[2] for k in ratios) == ["0", "1"] and {k[1] for k in ratios} == {"a", "b"}, ratios

        # Every metric the docs name is in Prometheus for the run, and every dashboard panel
        # shows data: real metrics carry the labels the rules and the dashboard select on.
        documented = documented_metrics() - NOT_IN_MLP - AFTER_A_FAULT

        def undocumented() -> set[str]:
            stored = {r["metric"]["__name__"] for r in prom.query(f"count by (__name__) ({{{run}}})")}
            return missing(documented, stored)

        wait_until(lambda: not undocumented(), 30, "every documented metric in Prometheus",
                   on_timeout=lambda: f"missing: {sorted(undocumented())}")
        # ...with sane values: each (query, filter) keeps a node's series only if its value is sane.
        per_node_sane = [
            (f'elastic_build_info{{{run}, backend="gloo", device="cpu"}}', "== 1"),
            (f'elastic_agent_worker_group_state{{{run}, state="healthy"}}', "== 1"),
            (f"elastic_agent_nodes_in_round{{{run}}}", "== 2"),
            (f"elastic_agent_remaining_restarts{{{run}}}", "> 0"),
            (f'elastic_agent_rendezvous_duration_seconds_count{{{run}, outcome="ok"}}', "> 0"),
            (f"elastic_loss{{{run}}}", "> 0 < 1e6"),  # finite: NaN passes no comparison
            (f"elastic_time_to_first_step_seconds{{{run}}}", "> 0 < 300"),
            (f"elastic_restore_seconds{{{run}}}", ">= 0 < 300"),
            (f"sum by (run_id, node) (elastic_collective_errors_total{{{run}}})", "== 0"),
            (f"sum by (run_id, node) (rate(elastic_data_wait_seconds_sum{{{run}}}[1m]))"  # a share of the step
             f" / sum by (run_id, node) (rate(elastic_step_duration_seconds_sum{{{run}}}[1m]))", "< 1"),
        ]

        def insane() -> list[tuple[str, str]]:
            return [(q, sane) for q, sane in per_node_sane
                    if {k[1] for k in value_of(prom.query(f"{q} {sane}"))} != {"a", "b"}]

        wait_until(lambda: not insane(), 30, "sane values on both nodes",
                   on_timeout=lambda: "\n".join(f"{q} {sane}: {value_of(prom.query(q))}" for q, sane in insane()))
        # Rank 0 snapshots every 10 steps: soon the newest durable one is seconds old.
        snapshot_age = f"time() - max by (run_id) (elastic_snapshot_last_durable_timestamp_seconds{{{run}}})"
        wait_until(lambda: prom.query(f"{snapshot_age} < 60"), 30, "a durable snapshot under a minute old",
                   on_timeout=lambda: str(prom.query(snapshot_age)))
        panels = [e for e in dash.expressions(dash.load())
                  if not dash.metrics_in(e) & (NOT_IN_MLP | AFTER_A_FAULT)
                  and not any(map(dash.is_external, dash.metrics_in(e)))]

        def empty() -> list[str]:
            return [e for e in panels if not prom.query(dash.concrete(e, run_id=run_id))]

        wait_until(lambda: not empty(), 30, "every dashboard query to return data",
                   on_timeout=lambda: "empty:\n" + "\n".join(empty()))

        # Node loss: SIGKILL the whole tree of the node without rank 0 (the survivor stays rank "0").
        victim, survivor = (b, a) if a.progress()[-1]["rank"] == 0 else (a, b)
        node = f'{run}, node="{survivor.name}"'
        killed_at = time.time()
        victim.kill()
        wait_until(lambda: prom.targets("elastic") == [(survivor.name, run_id, "up")], 30,
                   "the killed node to leave http_sd", on_timeout=lambda: str(prom.targets("elastic")))
        # Scraped after the kill: every sample the survivor counted in the world of two is in here.
        samples_of_survivor = f"sum(elastic_samples_total{{{node}}})"
        counted = wait_until(lambda: single(prom, samples_of_survivor), 10, "the survivor's samples in Prometheus")
        wait_until(lambda: len(survivor.steps_at(1, after=killed_at)) >= 10, 90, "the survivor to train alone",
                   on_timeout=survivor.log_tail)
        # Prometheus sees the survivor's own counter go on rising in its world of one: samples/s
        # now comes from it alone (the victim's series is stale, though its last minute still
        # counts in rate1m until it slides out of the window).
        wait_until(lambda: single(prom, f"max by (run_id) (elastic_world_size{{{run}}})") == 1
                   and (single(prom, samples_of_survivor) or 0) > counted, 30,
                   "Prometheus to scrape the survivor training alone", on_timeout=prom.tail)
        assert (single(prom, f"job:elastic_samples:rate1m{{{run}}}") or 0) > 0
        assert (single(prom, f"node:elastic_samples:rate1m{{{node}}}") or 0) > 0
        assert (single(prom, f'sum(elastic_agent_inplace_reforms_total{{{node}}})') or 0) >= 1  # in place
        # The kill is in the fault timeline, and the dashboard's "Faults" annotation marks it
        # at the time it began (the query's value, in ms: Grafana's "series value as timestamp").
        fault = f'elastic_last_fault_timestamp_seconds{{{run}, fault_node="{victim.name}", reason="peer_lost"}}'
        began = wait_until(lambda: single(prom, f"max({fault})"), 30, "the kill in Prometheus' fault timeline",
                           on_timeout=prom.tail)
        assert killed_at - 5 < began <= killed_at + 1
        (annotation,) = dash.annotation_queries(dash.load())
        marks = [(r["metric"]["fault_node"], r["metric"]["reason"], float(r["value"][1]) / 1000)
                 for r in prom.query(dash.concrete(annotation["expr"], run_id=run_id))]
        assert marks == [(victim.name, "peer_lost", pytest.approx(began))], marks
        assert [(r["name"], r.get("lastError")) for r in prom.rules() if r["health"] != "ok"] == []
