"""``elastic_rank_info`` on a real agent's endpoint: one series per rank, whichever source.

Real: etcd, ``elastic agent`` as a process tree with two local workers, HTTP scrapes.
``CUDA_VISIBLE_DEVICES`` lists two GPU uuids, which CPU-only torch ignores and the agent
reads as the GPUs of local ranks 0 and 1 (no ``nvidia-smi`` needed for uuids), and
``NODE_NAME`` stands for a Kubernetes node's name. So the agent's account of a worker
(uuid given) and an ``ElasticRun`` worker's own (on the CPU: no uuid) differ, and a
scrape shows which one the endpoint serves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable


from agent.etcd import EmbeddedEtcd
from tests.elastic.metrics.scrape import fetch_samples
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until
from agent.local.local_node import AUTO_METRICS_PORT
from tests.support.metrics_url import metrics_url

GPUS = ("GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52", "GPU-1b2c3d4e-0000-4111-8222-333344445555")
ENV = {"CUDA_VISIBLE_DEVICES": ",".join(GPUS), "NODE_NAME": "k8s-node-7"}


def rank_info(node: Node) -> dict[str, dict[str, str]] | None:
    """By rank, from one scrape; None before the endpoint answers. Fails on a rank shown twice."""
    try:
        rows = fetch_samples(metrics_url(node)).get("elastic_rank_info", [])
    except OSError:
        return None
    out: dict[str, dict[str, str]] = {}
    for labels, value in rows:
        assert value == 1 and labels["rank"] not in out, rows
        out[labels["rank"]] = labels
    return out


def test_the_agent_exports_rank_info_for_a_script_that_does_not(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node]
) -> None:
    # tiny_ddp: a plain torchrun DDP script, no ElasticRun, so no metrics of its own
    node = nodes(name="a", endpoint=etcd_server.endpoint, run_id=run_id, module="elastic.examples.tiny_ddp",
                 module_args=["--progress", "{progress}"], nnodes="1:1", nproc_per_node=2,
                 metrics_port=AUTO_METRICS_PORT, env=ENV)
    wait_until(lambda: len(node.progress()) >= 5, 120, "five steps", on_timeout=node.log_tail)
    got = rank_info(node)
    assert got is not None and sorted(got) == ["0", "1"], got
    for rank in (0, 1):
        assert got[str(rank)] == {"rank": str(rank), "local_rank": str(rank), "node": "a", "hostname": "k8s-node-7",
                                  "gpu_uuid": GPUS[rank]}


def test_an_elasticrun_worker_speaks_for_itself(etcd_server: EmbeddedEtcd, run_id: str,
                                                nodes: Callable[..., Node], tmp_path: Path) -> None:
    job = ["--job", "mlp", "--steps", "100000", "--snapshot-dir", str(tmp_path / "snaps"), "--step-sleep", "0.02",
           "--progress", "{progress}"]
    node = nodes(name="a", endpoint=etcd_server.endpoint, run_id=run_id, module="elastic.train", module_args=job,
                 nnodes="1:1", nproc_per_node=2, metrics_port=AUTO_METRICS_PORT, env=ENV)
    wait_until(lambda: len(node.progress()) >= 10, 120, "ten steps", on_timeout=node.log_tail)
    got = rank_info(node)
    assert got is not None and sorted(got) == ["0", "1"]
    for rank in (0, 1):  # the worker's truth (CPU: no GPU), not the agent's account of it
        assert got[str(rank)] == {"rank": str(rank), "local_rank": str(rank), "node": "a", "hostname": "k8s-node-7",
                                  "gpu_uuid": ""}
