"""deploy/prometheus: promtool's checks and rule tests, then a real Prometheus on the shipped configs.

Real: promtool, the prometheus server, the shipped configs and rules (only intervals and
the sd URL are shortened), etcd, ``elastic sd`` and HTTP. STAND-INS: the node endpoints
(tests/support/metrics_standin.py) serve catalogue-named metrics from real
prometheus_client registries, with made-up steps, instead of real training workers, so the
expected rates are exact. tests/deploy/test_prometheus_real_run.py scrapes real agents.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.parse
from pathlib import Path
from typing import Callable, Iterator

import prometheus_client
import pytest

from agent.tools.etcd_args import EtcdTarget
from agent.tools.top_model import Exposition
from agent.etcd import EtcdClient
from agent.rendezvous.registry import NodeLease, NodeRecord
from agent.rendezvous.signing import StateSigner
from tests.support import dashboard as dash
from tests.support.metrics_standin import StandinNode, dcgm_registry, gpu_uuid
from tests.support.prometheus import (PROM, RULES, PrometheusServer, ensure_prometheus, http_sd_config, shortened,
                                      start_sd, value_of)
from tests.support.waiting import wait_until

KEY = b"0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def promtool() -> str:
    return ensure_prometheus()


def run_tool(*args: str, cwd: Path = PROM) -> str:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=60, cwd=cwd)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-file-sd.yml"])
def test_config_is_valid(promtool: str, config: str) -> None:
    assert "SUCCESS: 2 rule files found" in run_tool(promtool, "check", "config", config)


@pytest.mark.slow  # starts processes
def test_rules_are_valid(promtool: str) -> None:
    run_tool(promtool, "check", "rules", "recording.yml", "alerts.yml", cwd=RULES)


@pytest.mark.slow  # starts processes
def test_rule_unit_tests_pass(promtool: str) -> None:
    assert "SUCCESS" in run_tool(promtool, "test", "rules", "tests.yml", cwd=RULES)


def test_every_rule_has_a_test_case() -> None:
    records = re.findall(r"^\s*- record:\s*(\S+)", (RULES / "recording.yml").read_text(), re.M)
    alerts = re.findall(r"^\s*- alert:\s*(\S+)", (RULES / "alerts.yml").read_text(), re.M)
    tests = (RULES / "tests.yml").read_text()
    tested_exprs = set(re.findall(r"^\s*- expr:\s*([\w:]+)", tests, re.M))
    tested_alerts = set(re.findall(r"^\s*alertname:\s*(\S+)", tests, re.M))
    assert records and alerts
    assert set(records) - tested_exprs == set(), "recording rules without a promql_expr_test"
    assert set(alerts) - tested_alerts == set(), "alerts without an alert_rule_test"
    # Bus bandwidth is checked at n=2 and n=4 (and n=1).
    for world in ("2", "4"):
        assert re.search(rf"elastic_world_size\{{run_id=\"n{world}\".*\n\s*values: '{world}x", tests)


# -- a real Prometheus ------------------------------------------------------------------------
@pytest.fixture
def cleanup() -> Iterator[Callable[[Callable[[], object]], None]]:
    """Register closers; all run at the end, newest first, even when the test fails."""
    closers: list[Callable[[], object]] = []
    try:
        yield closers.append
    finally:
        for close in reversed(closers):
            close()


def two_nodes(cleanup: Callable[[Callable[[], object]], None]) -> dict[str, StandinNode]:
    """Stand-in endpoints of a 4-rank world; rank 2 is five times slower than the rest."""
    nodes = {"node-a": StandinNode({0: 0.08, 1: 0.08}, world_size=4, host="node-a"),
             "node-b": StandinNode({2: 0.4, 3: 0.08}, world_size=4, host="node-b")}
    for node in nodes.values():
        cleanup(node.close)
    nodes["node-a"].durable.set(time.time())
    return nodes


def test_real_prometheus_follows_elastic_sd(promtool: str, tmp_path: Path, etcd_client: EtcdClient, run_id: str,
                                            cleanup: Callable[[Callable[[], object]], None]) -> None:
    nodes = two_nodes(cleanup)
    for name, node in nodes.items():
        record = NodeRecord(node=name, host="127.0.0.1", pid=1, metrics_url=node.serve(steps_per_second=10))
        cleanup(NodeLease(etcd_client, "/elastic", run_id, record, StateSigner(KEY), ttl=5).start().close)
    sd = start_sd(EtcdTarget(etcd_client, StateSigner(KEY), "/elastic", run_id))
    cleanup(sd.server_close)
    cleanup(sd.shutdown)
    prom = PrometheusServer(tmp_path, http_sd_config(sd))
    # A DCGM exporter STAND-IN on node-a, listed in file_sd as docs/dashboard.md says.
    dcgm, _ = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=dcgm_registry(host="node-a"))
    cleanup(dcgm.server_close)
    cleanup(dcgm.shutdown)
    (tmp_path / "file_sd" / "dcgm-test.json").write_text(json.dumps(
        [{"targets": [f"127.0.0.1:{dcgm.server_port}"], "labels": {"node": "node-a", "run_id": run_id}}]))
    prom.start()
    cleanup(prom.stop)

    samples = wait_until(lambda: value_of(prom.query("job:elastic_samples:rate1m")), 40,
                         "samples/s from the recording rule", on_timeout=prom.tail)
    assert list(samples) == [(run_id, "", "")] and samples[run_id, "", ""] > 0
    busbw = wait_until(lambda: len(rows := value_of(prom.query("node:elastic_allreduce_busbw_bytes_per_second:rate1m")))
                       == 2 and rows, 20, "all-reduce bus bandwidth of both nodes", on_timeout=prom.tail)
    # Each rank all-reduces 4 MB in 10 ms a step: algbw 400 MB/s, busbw x 2(4-1)/4 = 600 MB/s.
    assert busbw == {(run_id, "node-a", ""): pytest.approx(600e6), (run_id, "node-b", ""): pytest.approx(600e6)}
    ratio = wait_until(lambda: len(rows := value_of(prom.query("rank:elastic_step_duration_seconds:straggler_ratio_rate1m")))
                       == 4 and rows, 20, "straggler ratios of all four ranks", on_timeout=prom.tail)
    assert ratio[run_id, "node-b", "2"] == pytest.approx(5.0) and ratio[run_id, "node-a", "0"] == pytest.approx(1.0)

    targets = prom.api("targets")["activeTargets"]
    assert sorted((t["labels"]["node"], t["labels"]["run_id"], t["health"]) for t in targets
                  if t["labels"]["job"] == "elastic") == [("node-a", run_id, "up"), ("node-b", run_id, "up")]
    bad = [(r["name"], r.get("lastError")) for g in prom.api("rules")["groups"] for r in g["rules"]
           if r["health"] != "ok"]
    assert bad == [], "rules that failed to evaluate on real data"

    # Every query of the Grafana dashboard, as Grafana would send it, returns data: the
    # stand-ins serve the whole catalogue (and DCGM's names), so this checks label matching.
    served = set(Exposition.parse(nodes["node-a"].exposition()).samples)
    served |= set(Exposition.parse(prometheus_client.generate_latest(dcgm_registry()).decode()).samples)
    queries = dash.expressions(dash.load())
    assert all(dash.metrics_in(e) <= served for e in queries)
    wait_until(lambda: prom.query(f'DCGM_FI_DEV_GPU_UTIL{{run_id="{run_id}"}}'), 20, "the DCGM stand-in's GPUs",
               on_timeout=prom.tail)
    empty = [e for e in queries if not prom.query(dash.concrete(e, run_id=run_id))]
    assert empty == [], "dashboard queries without data"
    check_gpu_by_rank_panel(prom, run_id)


def check_gpu_by_rank_panel(prom: PrometheusServer, run_id: str) -> None:
    """The panel that joins DCGM to ranks: each rank's row holds its own GPU's readings.

    node-a's ranks 0 and 1 have its GPUs 0 and 1 (60 and 61 C; GPU 1 reported XID 79);
    node-b's ranks 2 and 3 have no DCGM exporter scraped, so only their step time shows.
    """
    (panel,) = [p for p in dash.panels(dash.load()) if p["title"].startswith("Each rank's GPU")]
    step, temperature, clock, xid = (
        {r["metric"]["rank"]: (r["metric"].get("hostname"), r["metric"].get("gpu_uuid"), float(r["value"][1]))
         for r in prom.query(dash.concrete(t["expr"], run_id=run_id))} for t in panel["targets"])
    assert sorted(step) == ["0", "1", "2", "3"] and step["2"][2] == pytest.approx(0.4), step
    assert step["2"][:2] == ("node-b", gpu_uuid("node-b", 0))
    assert temperature == {"0": ("node-a", gpu_uuid("node-a", 0), 60.0), "1": ("node-a", gpu_uuid("node-a", 1), 61.0)}
    assert {r: v for r, (_, _, v) in clock.items()} == {"0": 1980.0, "1": 1980.0}
    assert {r: v for r, (_, _, v) in xid.items()} == {"0": 0.0, "1": 79.0}
    # docs/metrics.md's example joins return the same rows
    docs = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    section = docs[docs.index("## Joining GPU metrics"):docs.index("## Cost")]
    examples = re.findall(r"```promql\n(.*?)```", section, re.S)
    assert len(examples) == 2
    rows = [prom.query(e.replace("my-run", run_id)) for e in examples]
    assert sorted((r["metric"]["rank"], float(r["value"][1])) for r in rows[0]) == [("0", 60.0), ("1", 61.0)]
    slowest = max(rows[1], key=lambda r: float(r["value"][1]))["metric"]
    assert len(rows[1]) == 3 and (slowest["rank"], slowest["gpu_uuid"]) == ("2", gpu_uuid("node-b", 0))
    # One series per rank, and the agent's own `node` copy dropped at scrape (metric_relabel_configs).
    info = prom.query(f'elastic_rank_info{{run_id="{run_id}"}}')
    assert sorted(r["metric"]["rank"] for r in info) == ["0", "1", "2", "3"]
    assert all("exported_node" not in r["metric"] and r["metric"]["node"] == r["metric"]["hostname"] for r in info)


@pytest.mark.slow  # starts processes
def test_real_prometheus_reads_file_sd(promtool: str, tmp_path: Path,
                                       cleanup: Callable[[Callable[[], object]], None]) -> None:
    nodes = two_nodes(cleanup)
    urls = {name: node.serve(steps_per_second=10) for name, node in nodes.items()}
    prom = PrometheusServer(tmp_path, shortened("prometheus-file-sd.yml"))
    # As docs/dashboard.md shows: one group names its node, the other is named after its host.
    groups = [{"targets": [urllib.parse.urlsplit(urls["node-a"]).netloc], "labels": {"run_id": "file-run",
                                                                                      "node": "node-a"}},
              {"targets": [urllib.parse.urlsplit(urls["node-b"]).netloc], "labels": {"run_id": "file-run"}}]
    (tmp_path / "file_sd" / "elastic-test.json").write_text(json.dumps(groups))
    prom.start()
    cleanup(prom.stop)

    per_node = wait_until(lambda: len(rows := value_of(prom.query("node:elastic_samples:rate1m"))) == 2 and rows,
                          40, "samples/s of both nodes", on_timeout=prom.tail)
    assert sorted(per_node) == [("file-run", "127.0.0.1", ""), ("file-run", "node-a", "")]
    assert all(v > 0 for v in per_node.values())
