"""deploy/grafana: the dashboard's structural rules and its provisioning.

No Grafana server here (none is packaged for this machine); its PromQL is parsed by a real
promtool, and tests/deploy/test_prometheus.py runs some of it against a real Prometheus.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support import dashboard as dash

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
DB = dash.load()
PANELS = list(dash.panels(DB))
EXPRS = dash.expressions(DB)


def calls(expr: str, function: str) -> list[str]:
    """The argument text of every call of ``function`` in ``expr`` (balanced parentheses)."""
    found = []
    for match in re.finditer(rf"\b{function}\s*\(", expr):
        depth, start = 1, match.end()
        for i in range(start, len(expr)):
            depth += {"(": 1, ")": -1}.get(expr[i], 0)
            if depth == 0:
                found.append(expr[start:i])
                break
    return found


def test_variables() -> None:
    variables = {v["name"]: v for v in DB["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("run_id", "node"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"]["uid"] == "${datasource}"
    assert variables["node"]["multi"] and variables["node"]["includeAll"]
    assert '$run_id' in variables["node"]["query"]["query"]  # nodes of the chosen run only


@pytest.mark.parametrize("panel", PANELS, ids=[p["title"] for p in PANELS])
def test_every_panel_has_title_description_unit_and_the_datasource_variable(panel: dict[str, Any]) -> None:
    assert panel["title"].strip()
    assert len(panel.get("description", "").strip()) > 20
    assert panel["fieldConfig"]["defaults"].get("unit"), "no unit"
    assert panel["datasource"]["uid"] == "${datasource}"
    assert panel["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])


def test_panel_ids_are_unique_and_fit_the_grid() -> None:
    ids = [p["id"] for p in dash.panels(DB)] + [p["id"] for p in DB["panels"] if p["type"] == "row"]
    assert len(ids) == len(set(ids))
    for p in PANELS:
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and pos["h"] > 0


def test_every_rate_uses_rate_interval() -> None:
    ranges = [(fn, r) for e in EXPRS for fn in ("rate", "irate") for args in calls(e, fn)
              for r in re.findall(r"\[([^\]]*)\]\s*$", args.strip())]
    assert ranges and all(r == "$__rate_interval" for _, r in ranges), ranges
    assert len(ranges) == sum(len(calls(e, "rate")) + len(calls(e, "irate")) for e in EXPRS)
    for args in (a for e in EXPRS for a in calls(e, "increase")):
        assert re.search(r"\[\$__(rate_interval|range)\]\s*$", args), args


def test_quantiles_come_from_summed_buckets() -> None:
    quantiles = [args for e in EXPRS for args in calls(e, "histogram_quantile")]
    assert len(quantiles) >= 8
    for args in quantiles:
        m = re.match(r"\s*[\d.]+\s*,\s*sum by \(([^)]*)\)\s*\(\s*rate\(\w+_bucket\{", args)
        assert m and "le" in [label.strip() for label in m.group(1).split(",")], args
    # ...and buckets are read nowhere else (no averaging of quantiles, no raw bucket plots).
    buckets_read = sum(e.count("_bucket{") for e in EXPRS)
    assert buckets_read == len(quantiles)


def joins_dcgm_to_ranks(expr: str) -> bool:
    """DCGM series joined to ``elastic_rank_info`` on the GPU uuid: the join keeps the run's GPUs."""
    return ("elastic_rank_info{" in expr and re.search(r"\bon \(gpu_uuid\)", expr) is not None
            and all(re.search(r'label_replace\(\s*' + name + r'\{[^}]*\},\s*"gpu_uuid",\s*"\$1",\s*"UUID"', expr)
                    for name in re.findall(r"\b(DCGM_\w+)\{", expr)))


def test_every_elastic_selector_follows_the_run_and_node_variables() -> None:
    for expr in EXPRS:
        for name, matchers in re.findall(r"\b((?:elastic|DCGM)_\w+)\{([^}]*)\}", expr):
            if name.startswith("DCGM_") and joins_dcgm_to_ranks(expr):
                continue  # also works where DCGM is scraped without our labels (the GPU operator's own)
            assert 'run_id="$run_id"' in matchers and 'node=~"$node"' in matchers, (name, expr)
        assert not re.search(r"\b(?:elastic|DCGM)_\w+\b(?![\w{])", expr), f"unfiltered selector in {expr}"


def test_one_panel_shows_each_ranks_gpu_beside_its_step_time() -> None:
    """Issue 18: DCGM's temperature, SM clock and XID next to the rank that is slow."""
    (panel,) = [p for p in PANELS if any(joins_dcgm_to_ranks(t["expr"]) for t in p["targets"])]
    exprs = [t["expr"] for t in panel["targets"]]
    assert "elastic_step_duration_seconds_sum{" in exprs[0] and "on (rank) group_left (hostname, gpu_uuid)" in exprs[0]
    joined = " ".join(exprs[1:])
    for dcgm in ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_XID_ERRORS"):
        assert dcgm + "{" in joined, dcgm
    for expr in exprs[1:]:
        assert joins_dcgm_to_ranks(expr) and expr.startswith("max by (rank, hostname, gpu_uuid) (")
        assert "max by (gpu_uuid) (label_replace(" in expr  # one series per GPU, however often it is scraped


def test_queried_metrics_are_in_the_catalogue() -> None:
    queried = dash.queried_metrics(DB)
    ours = {dash.family(n) for n in queried if not dash.is_external(n)}
    assert ours <= dash.CATALOGUE, ours - dash.CATALOGUE
    # The panels issue 6 asks for, by the metrics they need.
    for needed in ("elastic_samples_total", "elastic_step_duration_seconds_bucket", "elastic_data_wait_seconds_sum",
                   "elastic_collective_duration_seconds_bucket", "elastic_collective_bytes_total",
                   "elastic_world_size", "elastic_agent_restarts_total",
                   "elastic_agent_rendezvous_duration_seconds_bucket", "elastic_snapshot_stall_seconds_bucket",
                   "elastic_snapshot_last_durable_timestamp_seconds", "DCGM_FI_DEV_GPU_UTIL", "elastic_rank_info"):
        assert needed in queried, needed


def test_queried_metrics_reads_promql() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, node) (rate(a_seconds_bucket{op="x", node=~"$node"}'
            '[$__rate_interval]))) / scalar(quantile(0.5, b_total)) * on (node) group_left () '
            '(2 * (max by (node) (c{k="1e9"}) - 1)) unless d:recorded:rate1m offset 5m')
    assert dash.metrics_in(expr) == {"a_seconds_bucket", "b_total", "c", "d:recorded:rate1m"}
    assert dash.metrics_in('label_values(elastic_steps_total{run_id="$run_id"}, node)') == {"elastic_steps_total"}


@pytest.mark.slow  # starts processes
def test_promql_parses(tmp_path: Path) -> None:
    """Every query, with Grafana's variables filled in, through promtool's PromQL parser."""
    if shutil.which("promtool") is None:
        pytest.fail("promtool missing: run deploy/prometheus/ensure-prometheus.sh (make test does)")
    rules = ["groups:", "  - name: dashboard", "    rules:"]
    for i, expr in enumerate(EXPRS):  # YAML single quotes: a quote inside is doubled
        rules += [f"      - record: dashboard:query_{i}", "        expr: '" + dash.concrete(expr).replace("'", "''") + "'"]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text("\n".join(rules) + "\n")
    done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(EXPRS)} rules found" in done.stdout


@pytest.mark.slow  # starts processes
def test_goodput_row_and_the_fault_annotations(tmp_path: Path) -> None:
    """Issue 18: goodput over time, lost time by cause stacked, and a fault timeline."""
    (row,) = [p for p in DB["panels"] if p["type"] == "row" and p["title"] == "Goodput"]
    goodput = [p for p in PANELS if row["gridPos"]["y"] < p["gridPos"]["y"] <= row["gridPos"]["y"] + 16]
    exprs = " ".join(t["expr"] for p in goodput for t in p["targets"])
    assert "elastic_productive_seconds_total{" in exprs and "sum by (cause) (rate(elastic_lost_seconds_total{" in exprs
    (stacked,) = [p for p in goodput if p["fieldConfig"]["defaults"].get("custom", {}).get("stacking")]
    assert stacked["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    (timeline,) = [p for p in goodput if p["type"] == "table"]
    phases = {re.search(r'phase="(\w+)"', t["expr"]).group(1) for t in timeline["targets"] if "phase=" in t["expr"]}
    assert phases == {"detection", "rendezvous", "worker_start", "restore", "join", "recompute", "unknown"}
    (faults,) = dash.annotation_queries(DB)
    assert faults["datasource"]["uid"] == "${datasource}" and faults["useValueForTime"]
    assert "{{fault_node}}" in faults["titleFormat"] and "{{reason}}" in faults["titleFormat"]
    for name, matchers in re.findall(r"\b(elastic_\w+)\{([^}]*)\}", faults["expr"]):
        assert 'run_id="$run_id"' in matchers and 'node=~"$node"' in matchers, name
    path = tmp_path / "annotations.yml"  # and it is PromQL promtool accepts
    path.write_text("groups:\n  - name: annotations\n    rules:\n      - record: dashboard:faults\n        expr: '"
                    + dash.concrete(faults["expr"]).replace("'", "''") + "'\n")
    done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_provisioning_points_at_the_dashboards_and_prometheus() -> None:
    datasource = (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()
    assert re.search(r"^\s+type: prometheus$", datasource, re.M)
    assert re.search(r"^\s+timeInterval: 10s$", datasource, re.M)  # = the shipped scrape interval
    provider = (GRAFANA / "provisioning" / "dashboards" / "elastic.yml").read_text()
    assert re.search(r"^\s+path: /var/lib/grafana/dashboards$", provider, re.M)
    shipped = (GRAFANA.parent / "prometheus" / "prometheus.yml").read_text()
    assert "scrape_interval: 10s" in shipped
