"""Reading deploy/grafana/dashboards/elastic.json: its panels, PromQL and the metrics it queries.

Shared by the dashboard's structural tests and by the tests that check its metrics against
a real scrape, so both read the dashboard the same way.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards" / "elastic.json"

# The metric catalogue (issue 6): family names, in base units. Histograms appear in a scrape
# as NAME_bucket, NAME_sum and NAME_count; counters as NAME (ending in _total).
WORKER_METRICS = frozenset({
    "elastic_steps_total", "elastic_samples_total", "elastic_tokens_total",
    "elastic_step_duration_seconds", "elastic_data_wait_seconds",
    "elastic_last_step_timestamp_seconds", "elastic_loss", "elastic_world_size", "elastic_rank", "elastic_rank_info",
    "elastic_worker_restarts", "elastic_build_info",
    "elastic_collective_duration_seconds", "elastic_collective_bytes_total", "elastic_collective_errors_total",
    "elastic_snapshot_stall_seconds", "elastic_snapshot_write_seconds", "elastic_snapshot_bytes_total",
    "elastic_snapshot_last_durable_timestamp_seconds", "elastic_restore_seconds",
    "elastic_time_to_first_step_seconds",
})
AGENT_METRICS = frozenset({
    "elastic_agent_rendezvous_duration_seconds", "elastic_agent_restarts_total",
    "elastic_agent_remaining_restarts", "elastic_agent_worker_group_state", "elastic_agent_nodes_in_round",
    "elastic_agent_round", "elastic_agent_info", "elastic_agent_etcd_errors_total", "elastic_agent_spare",
})
# Goodput (docs/metrics.md "Goodput"): exported by the agents from the job's record.
GOODPUT_METRICS = frozenset({
    "elastic_productive_seconds_total", "elastic_lost_seconds_total", "elastic_goodput_ratio",
    "elastic_last_fault_timestamp_seconds", "elastic_last_fault_phase_seconds",
})
CATALOGUE = WORKER_METRICS | AGENT_METRICS | GOODPUT_METRICS
# NVIDIA's DCGM exporter, scraped separately where it runs; never in our own endpoints.
EXTERNAL_PREFIXES = ("DCGM_",)

_KEYWORDS = frozenset({"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
                       "bool", "offset", "inf", "nan"})
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_DURATION = re.compile(r"(?<![\w.:])(?:\d+(?:ms|[smhdwy]))+\b")
_NUMBER = re.compile(r"(?<![\w.:])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
_IDENT = re.compile(r"(?<![\w:])([A-Za-z_:][\w:]*)\b(?!\s*\()")
_LABEL_VALUES = re.compile(r"label_values\(\s*(?:([A-Za-z_:][\w:]*)\s*(?:\{[^}]*\})?\s*,)?\s*\w+\s*\)")


def load(path: Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(path.read_text())


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel but row headers, including those inside collapsed rows."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") != "row":
            yield panel
        yield from panels(panel)


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """The PromQL of every panel target, in dashboard order."""
    return [t["expr"] for p in panels(dashboard) for t in p.get("targets", []) if t.get("expr")]


def variable_queries(dashboard: dict[str, Any]) -> list[str]:
    out = []
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var.get("query")
            out.append(query.get("query", "") if isinstance(query, dict) else str(query))
    return out


def metrics_in(expr: str) -> set[str]:
    """Metric names an expression selects, as written (``..._bucket`` stays ``..._bucket``)."""
    names = {m.group(1) for m in _LABEL_VALUES.finditer(expr) if m.group(1)}
    text = _LABEL_VALUES.sub(" ", expr)
    for pattern in (_VARIABLE, _STRING, _MATCHERS, _RANGE, _GROUPING, _DURATION, _NUMBER):
        text = pattern.sub(" ", text)
    names |= {m.group(1) for m in _IDENT.finditer(text) if m.group(1).lower() not in _KEYWORDS}
    return names


def annotation_queries(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """The dashboard's annotations that query Prometheus (not Grafana's built-in one)."""
    return [a for a in dashboard.get("annotations", {}).get("list", []) if a.get("expr")]


def queried_metrics(dashboard: dict[str, Any]) -> set[str]:
    """Every metric name the dashboard's panels, variables and annotations query, as written in PromQL."""
    found: set[str] = set()
    for expr in expressions(dashboard) + variable_queries(dashboard) + [a["expr"] for a in
                                                                        annotation_queries(dashboard)]:
        found |= metrics_in(expr)
    return found


def family(name: str) -> str:
    """The metric family a sample name belongs to: histograms lose _bucket/_sum/_count."""
    return re.sub(r"_(bucket|sum|count)$", "", name)


def is_external(name: str) -> bool:
    return name.startswith(EXTERNAL_PREFIXES)


def concrete(expr: str, run_id: str = "run", node: str = ".*", rate_interval: str = "1m",
             range_: str = "1h") -> str:
    """The expression as Grafana would send it, for a Prometheus or promtool to check."""
    for var, value in (("$__rate_interval", rate_interval), ("$__range", range_), ("$__interval", rate_interval),
                       ("${run_id}", run_id), ("$run_id", run_id), ("${node}", node), ("$node", node)):
        expr = expr.replace(var, value)
    return expr
