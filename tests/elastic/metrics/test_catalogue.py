"""The catalogue is what the docs say it is, and settings a user gets wrong fail in one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from elastic.metrics import MetricsConfigError, RankInfo, WorkerMetrics, families, start_export

DOCS = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"


def _exposed_names() -> set[str]:
    out = set()
    for metric in families().registry.collect():
        out.add(metric.name + ("_total" if metric.type == "counter" else ""))
    return out


def _goodput_names() -> set[str]:
    """The goodput families docs/metrics.md tabulates too, though the agents export them."""
    from prometheus_client import CollectorRegistry

    from agent.node.goodput import GoodputMetrics

    registry = CollectorRegistry()
    GoodputMetrics(registry)
    return {m.name + ("_total" if m.type == "counter" else "") for m in registry.collect()}


def test_every_metric_is_documented_and_every_documented_metric_exists() -> None:
    documented = set(re.findall(r"^\| `(elastic_[a-z_]+)` \|", DOCS.read_text(), flags=re.M))
    assert documented == _exposed_names() | _goodput_names()


NAMES_THE_NODE = {"elastic_rank_info", "elastic_sdc_mismatches"}


def test_names_follow_the_conventions() -> None:
    for metric in families().registry.collect():
        assert metric.name.startswith("elastic_")
        if metric.type == "histogram":
            assert metric.name.endswith("_seconds"), metric.name
        for sample in metric.samples:
            # elastic_rank_info names the node (the next test), and so does the replica check's
            # count, whose node is the one a vote named (often not the one serving it); another
            # test in this process may have bound a child of the shared families with one
            banned = {"pid", "step"} if metric.name in NAMES_THE_NODE else {"pid", "step", "node"}
            assert not banned & set(sample.labels), sample


def test_rank_info_has_the_labels_issue_18_names_and_only_it_names_the_node() -> None:
    fam = families.__wrapped__()  # private families: binding a child here must not leak into other tests
    WorkerMetrics(3, 4, backend="gloo", device="cpu", torch_version="test", fam=fam,
                  identity=RankInfo(3, 1, "node-b", "host-b", "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52"))
    labelled = {s.name: s.labels for m in fam.registry.collect() for s in m.samples}
    assert labelled["elastic_rank_info"] == {"rank": "3", "local_rank": "1", "node": "node-b", "hostname": "host-b",
                                             "gpu_uuid": "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52"}
    assert {name for name, labels in labelled.items() if {"pid", "step", "node"} & set(labels)} == {
        "elastic_rank_info", "elastic_sdc_mismatches_total", "elastic_sdc_mismatches_created"}
    assert labelled["elastic_sdc_mismatches_total"] == {"node": "node-b"}  # served at 0 from the start


@pytest.mark.parametrize(("env", "expect"), [
    ({"ELASTIC_METRICS_PORT": "lots"}, "is not a port number"),
    ({"ELASTIC_METRICS_PORT": "65535"}, "is not a valid port"),
])
def test_a_bad_port_setting_is_one_clear_line(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                              expect: str) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(MetricsConfigError, match=expect):
        start_export(1)  # 65535 + local rank 1
