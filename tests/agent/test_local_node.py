"""``LocalNode.metric``: what the benchmarks and tools read off a local agent's /metrics.

A real prometheus-client HTTP server on a port it bound (port 0) stands in for the agent's endpoint.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from agent.local.local_node import LocalNode


def test_a_series_is_summed_over_the_labels_asked_for_and_none_while_nothing_serves(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    Gauge("elastic_agent_spare", "spare", registry=registry).set(1)
    reforms = Counter("elastic_agent_inplace_reforms", "reforms", ["reason"], registry=registry)
    reforms.labels(reason="frozen").inc(2)
    reforms.labels(reason="peer_lost").inc(3)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)  # port 0: read back, not picked ahead
    node = LocalNode(name="a", endpoint="127.0.0.1:1", run_id="r", workdir=tmp_path, metrics_port=server.server_port)
    try:
        assert node.metric("elastic_agent_spare") == 1
        assert node.metric("elastic_agent_inplace_reforms_total") == 5
        assert node.metric("elastic_agent_inplace_reforms_total", reason="frozen") == 2
        assert node.metric("elastic_agent_inplace_reforms_total", reason="scale_up") is None
        assert node.metric("elastic_agent_spare_workers_ready") is None, "a series it does not serve"
    finally:
        server.shutdown()
        thread.join(5)
        server.server_close()
    assert node.metric("elastic_agent_spare") is None, "nothing listens any more"


def test_with_an_auto_port_the_agent_binds_a_free_one_and_the_node_reads_it_back(tmp_path: Path) -> None:
    """No port picked ahead that another process can take first (a red CI run: "Address already
    in use", and a harness that waited 240 s for a world that could not form)."""
    from agent.node.launch import AUTO_PORT, _port, _say_metrics_port
    from agent.local.local_node import AUTO_METRICS_PORT

    assert _port("auto") == AUTO_PORT == AUTO_METRICS_PORT
    node = LocalNode(name="a", endpoint="127.0.0.1:1", run_id="r", workdir=tmp_path, metrics_port=AUTO_METRICS_PORT)
    command = node.command()
    assert command[command.index("--metrics-port") + 1] == "auto"
    assert node.bound_metrics_port() is None and node.metric("elastic_agent_spare") is None  # not said yet
    registry = CollectorRegistry()
    Gauge("elastic_agent_spare", "spare", registry=registry).set(1)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        node.agent_dir.mkdir()
        _say_metrics_port(node.agent_dir, f"http://127.0.0.1:{server.server_address[1]}/metrics")
        assert node.bound_metrics_port() == server.server_address[1]
        assert node.metric("elastic_agent_spare") == 1
    finally:
        server.shutdown()
        thread.join(5)
